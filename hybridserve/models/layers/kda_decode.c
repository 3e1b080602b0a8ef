/* One decode step of Kimi Delta Attention (CPU), in place on the state pool.
 *
 * Per request b and head h, with S the [HEAD_DIM (key channel), HEAD_DIM (value channel)] float32 state in
 * slot slots[b]:
 *
 *     S = diag(exp(g)) S ;  u = beta (v - S^T k) ;  S = S + k u^T ;  o = S^T q
 *
 * as kda_recurrent in kda.py computes it with a dozen batched ops, which also gather the step's states
 * out of the pool and scatter them back (two copies of every state per layer and step). Here each head
 * streams its state twice while it sits in L1 (16 KiB at HEAD_DIM 64): once to decay it and accumulate
 * S^T k, once to add the update and accumulate S^T q. Heads are spread over PyTorch's OpenMP threads when
 * there are enough of them to pay for it.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_math.h"

#ifndef HEAD_DIM
#error "build with -DHEAD_DIM=<the KDA head dim>"
#endif

/* Enough state elements that waking the other threads pays off. */
#define PARALLEL_MIN_ELEMENTS 65536

static void head_step(const float* q, const float* k, const float* v, const float* g, float beta, float* s,
                      float* o) {
    float kv[HEAD_DIM] = {0.0f}; /* S^T k after the decay */
    for (int i = 0; i < HEAD_DIM; i++) {
        float* row = s + i * HEAD_DIM;
        const float decay = expf(g[i]), ki = k[i];
#pragma omp simd
        for (int j = 0; j < HEAD_DIM; j++) {
            row[j] *= decay;
            kv[j] += ki * row[j];
        }
    }
    float u[HEAD_DIM];
#pragma omp simd
    for (int j = 0; j < HEAD_DIM; j++) {
        u[j] = (v[j] - kv[j]) * beta;
        o[j] = 0.0f;
    }
    for (int i = 0; i < HEAD_DIM; i++) {
        float* row = s + i * HEAD_DIM;
        const float ki = k[i], qi = q[i];
#pragma omp simd
        for (int j = 0; j < HEAD_DIM; j++) {
            row[j] += ki * u[j];
            o[j] += qi * row[j];
        }
    }
}

/* q, k, v: [batch, heads, HEAD_DIM] float32, rows `*_stride` elements apart, heads contiguous within a row;
 * g: [batch, heads, HEAD_DIM] and beta: [batch, heads] float32, contiguous; states: [num_slots, heads,
 * HEAD_DIM, HEAD_DIM] float32, contiguous, updated at slots[b] (distinct); out: [batch, heads, HEAD_DIM].
 * Returns -1, or the first row whose slot is outside [0, num_slots) (then nothing is computed). */
EXPORT int64_t kda_decode_f32(const float* q, int64_t q_stride, const float* k, int64_t k_stride, const float* v,
                              int64_t v_stride, const float* g, const float* beta, float* states, int64_t num_slots,
                              const int64_t* slots, float* out, int64_t batch, int64_t heads) {
    for (int64_t b = 0; b < batch; b++)
        if (slots[b] < 0 || slots[b] >= num_slots) return b;
    const int64_t state_size = (int64_t)HEAD_DIM * HEAD_DIM;
#pragma omp parallel for collapse(2) if (batch * heads * state_size >= PARALLEL_MIN_ELEMENTS)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t bh = b * heads + h;
            head_step(q + b * q_stride + h * HEAD_DIM, k + b * k_stride + h * HEAD_DIM,
                      v + b * v_stride + h * HEAD_DIM, g + bh * HEAD_DIM, beta[bh],
                      states + (slots[b] * heads + h) * state_size, out + bh * HEAD_DIM);
        }
    }
    return -1;
}
