/* Element-wise chains of a decoder layer fused into one pass each (CPU).
 *
 * In stock PyTorch an RMSNorm on bfloat16 is eight small ops (upcast, square, mean, add, rsqrt, scale,
 * downcast, weight) and the residual add before it one more; at decode batch sizes their fixed cost per
 * op outweighs the arithmetic. These loops do the same arithmetic with the same roundings to the model
 * dtype as Hugging Face's modules, in one call. Rows are spread over PyTorch's OpenMP threads when there
 * are enough of them to pay for it.
 */
#include <math.h>
#include <stdint.h>

#include "cpu_math.h"

/* Enough elements that waking the other threads pays off: silu_mul at 8 rows of 1536 takes 7 us on two threads,
 * 11 on one. */
#define PARALLEL_MIN_ELEMENTS 8192

/* residual: [rows, dim], updated in place to residual + delta (rounded to the dtype) unless delta is NULL;
 * out: [rows, dim] = RMSNorm(residual) * weight, normalised in float32, rounded, then scaled and rounded. */
#define DEFINE_ADD_RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                                     \
    void NAME(T* residual, const T* delta, const T* weight, T* out, int64_t rows, int64_t dim, float eps) {  \
        _Pragma("omp parallel for if (rows * dim >= PARALLEL_MIN_ELEMENTS)") for (int64_t r = 0; r < rows;   \
                                                                                  r++) {                     \
            T* x = residual + r * dim;                                                                       \
            if (delta != 0) {                                                                                \
                const T* dx = delta + r * dim;                                                               \
                for (int64_t i = 0; i < dim; i++) x[i] = STORE(LOAD(x[i]) + LOAD(dx[i]));                    \
            }                                                                                                \
            float sum = 0.0f;                                                                                \
            _Pragma("omp simd reduction(+ : sum)") for (int64_t i = 0; i < dim; i++) sum +=                  \
                LOAD(x[i]) * LOAD(x[i]);                                                                     \
            const float inv = 1.0f / sqrtf(sum / (float)dim + eps);                                          \
            T* y = out + r * dim;                                                                            \
            for (int64_t i = 0; i < dim; i++) y[i] = STORE(ROUND(LOAD(x[i]) * inv) * LOAD(weight[i]));       \
        }                                                                                                    \
    }

/* gate_up: [rows, 2 * dim] (gate then up); out: [rows, dim] = silu(gate) * up, silu rounded first. */
#define DEFINE_SILU_MUL(NAME, T, LOAD, STORE, ROUND)                                                         \
    void NAME(const T* gate_up, T* out, int64_t rows, int64_t dim) {                                         \
        _Pragma("omp parallel for if (rows * dim >= PARALLEL_MIN_ELEMENTS)") for (int64_t r = 0; r < rows;   \
                                                                                  r++) {                     \
            const T* gate = gate_up + r * 2 * dim;                                                           \
            const T* up = gate + dim;                                                                        \
            T* y = out + r * dim;                                                                            \
            for (int64_t i = 0; i < dim; i++) {                                                              \
                const float g = LOAD(gate[i]);                                                               \
                y[i] = STORE(ROUND(g / (1.0f + exp_approx(-g))) * LOAD(up[i]));                              \
            }                                                                                                \
        }                                                                                                    \
    }

/* x: [rows, n], rows `stride` apart; out[r] = the index of row r's largest value, the first of equals, as
 * torch.argmax: a NaN counts as the largest (the first NaN wins), a row of -inf gives 0. PyTorch's CPU argmax
 * walks [64, 49152] bf16 logits in ~8 ms on one thread; this is a vectorised max, then a scan for its first
 * index, rows across the threads. */
#define DEFINE_ARGMAX(NAME, T, LOAD)                                                                         \
    void NAME(const T* x, int64_t stride, int64_t rows, int64_t n, int64_t* out) {                           \
        _Pragma("omp parallel for if (rows * n >= PARALLEL_MIN_ELEMENTS)") for (int64_t r = 0; r < rows;     \
                                                                                r++) {                       \
            const T* row = x + r * stride;                                                                   \
            float best = -INFINITY;                                                                          \
            int nan = 0;                                                                                     \
            _Pragma("omp simd reduction(max : best) reduction(| : nan)") for (int64_t i = 0; i < n; i++) {   \
                const float v = LOAD(row[i]);                                                                \
                best = v > best ? v : best;                                                                  \
                nan |= v != v;                                                                               \
            }                                                                                                \
            int64_t at = 0;                                                                                  \
            for (int64_t i = 0; i < n; i++) {                                                                \
                const float v = LOAD(row[i]);                                                                \
                if (nan ? v != v : v == best) {                                                              \
                    at = i;                                                                                  \
                    break;                                                                                   \
                }                                                                                            \
            }                                                                                                \
            out[r] = at;                                                                                     \
        }                                                                                                    \
    }

#if defined(__AVX512BF16__) && !defined(PORTABLE)
/* bfloat16 with AVX512-BF16: the same arithmetic sixteen lanes at a time, each rounding one instruction
 * (to_bf16x16) instead of the dozen integer operations float_to_bf16 vectorises into, which made these loops
 * count-bound: the same bits, faster. The sum of squares is the macro's loop, so it adds in the same order. */
EXPORT void add_rms_norm_bf16(uint16_t* residual, const uint16_t* delta, const uint16_t* weight, uint16_t* out,
                              int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for if (rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t* x = residual + r * dim;
        if (delta != 0) {
            const uint16_t* dx = delta + r * dim;
            for (int64_t i = 0; i < dim; i += 16) {
                const __mmask16 m = first_lanes(dim - i);
                const __m512 sum = _mm512_add_ps(load_bf16x16(x + i, m), load_bf16x16(dx + i, m));
                _mm256_mask_storeu_epi16(x + i, m, to_bf16x16(sum));
            }
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; i++) sum += bf16_to_float(x[i]) * bf16_to_float(x[i]);
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(sum / (float)dim + eps));
        uint16_t* y = out + r * dim;
        for (int64_t i = 0; i < dim; i += 16) {
            const __mmask16 m = first_lanes(dim - i);
            const __m512 normed = round_bf16x16(_mm512_mul_ps(load_bf16x16(x + i, m), inv));
            _mm256_mask_storeu_epi16(y + i, m, to_bf16x16(_mm512_mul_ps(normed, load_bf16x16(weight + i, m))));
        }
    }
}

EXPORT void silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t dim) {
#pragma omp parallel for if (rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* gate = gate_up + r * 2 * dim;
        const uint16_t* up = gate + dim;
        uint16_t* y = out + r * dim;
        for (int64_t i = 0; i < dim; i += 16) {
            const __mmask16 m = first_lanes(dim - i);
            const __m512 g = load_bf16x16(gate + i, m);
            const __m512 e = exp_approx16(_mm512_xor_ps(g, _mm512_set1_ps(-0.0f)));
            const __m512 silu = round_bf16x16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            _mm256_mask_storeu_epi16(y + i, m, to_bf16x16(_mm512_mul_ps(silu, load_bf16x16(up + i, m))));
        }
    }
}
#else
EXPORT void add_rms_norm_bf16(uint16_t* residual, const uint16_t* delta, const uint16_t* weight, uint16_t* out,
                              int64_t rows, int64_t dim, float eps);
EXPORT void silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t dim);
DEFINE_ADD_RMS_NORM(add_rms_norm_bf16, uint16_t, bf16_to_float, float_to_bf16, round_bf16)
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, bf16_to_float, float_to_bf16, round_bf16)
#endif
/* The exported functions the macros define, for native.py's bindings. */
EXPORT void add_rms_norm_f32(float* residual, const float* delta, const float* weight, float* out, int64_t rows,
                             int64_t dim, float eps);
EXPORT void silu_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t dim);
EXPORT void argmax_bf16(const uint16_t* x, int64_t stride, int64_t rows, int64_t n, int64_t* out);
EXPORT void argmax_f32(const float* x, int64_t stride, int64_t rows, int64_t n, int64_t* out);
DEFINE_ADD_RMS_NORM(add_rms_norm_f32, float, identity, identity, identity)
DEFINE_SILU_MUL(silu_mul_f32, float, identity, identity, identity)
DEFINE_ARGMAX(argmax_bf16, uint16_t, bf16_to_float)
DEFINE_ARGMAX(argmax_f32, float, identity)
