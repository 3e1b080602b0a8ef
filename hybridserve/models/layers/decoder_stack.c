/* A Llama-family decode step through every decoder layer in one call (CPU).
 *
 * A decode-only step of a small model is mostly fixed costs: per layer, nine kernel calls, each wrapped in
 * Python (shape checks, an output tensor, a ctypes call): ~3 ms of a ~15 ms batch-1 step for a 30-layer model.
 * This loop makes the same calls, in the same order and on the same kernels (the linear, fused_ops and
 * paged_attention libraries', handed over as function pointers), so its hidden states are bitwise those of the module
 * path; only the Python between them is gone. Intermediates live in one workspace the caller provides.
 *
 * No compile-time shapes: the kernels it drives carry their own.
 */
#include <stddef.h>
#include <stdint.h>

#include "cpu_math.h"

/* Per layer: its norm weights, the packed panels of its four matmuls (one of the linear library's layouts) with
 * their float32 biases or NULL, its paged cache, and the matmul (linear_f32.c's or linear_bf16.c's) each one's
 * panels take. A stack without silu_mul has gated gate_up matmuls (linear_f32_silu's), which write the activation
 * themselves. */
#define DEFINE_DECODER_STACK(NAME, T, LINEAR_T, LINEAR_CALL)                                                        \
    typedef struct {                                                                                                \
        const T *input_norm, *post_norm;                                                                            \
        const void *qkv, *o, *gate_up, *down;                                                                       \
        const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;                                                  \
        T* cache;                                                                                                   \
        int64_t num_blocks;                                                                                         \
        LINEAR_T qkv_linear, o_linear, gate_up_linear, down_linear;                                                 \
    } NAME##_layer;                                                                                                 \
                                                                                                                    \
    typedef struct {                                                                                                \
        void (*add_rms_norm)(T*, const T*, const T*, T*, int64_t, int64_t, float);                                  \
        void (*silu_mul)(const T*, T*, int64_t, int64_t);                                                           \
        void (*rope_write_kv)(T*, int64_t, int64_t, int64_t, int64_t, const T*, const T*, T*, int64_t,              \
                              const int64_t*);                                                                      \
        void (*decode)(const T*, int64_t, const T*, int64_t, const int64_t*, int64_t, const int64_t*, T*,           \
                       int64_t, int64_t, int64_t, float);                                                           \
        int64_t layers, hidden, q_heads, kv_heads, head_dim, intermediate;                                          \
        float eps, scale;                                                                                           \
        const T* final_norm;                                                                                        \
        const NAME##_layer* layer;                                                                                  \
    } NAME##_stack;                                                                                                 \
                                                                                                                    \
    /* x: [b, hidden], the step's embeddings, then the residual stream (overwritten); cos, sin: [b, head_dim]       \
     * rotary tables of the tokens' positions; slots, tables, lens: the decode group's cache slots, block           \
     * tables (rows table_stride apart) and context lengths; work: decoder_stack_workspace(...) elements;           \
     * out: [b, hidden], the hidden states after the final norm. */                                                 \
    void NAME(const NAME##_stack* s, T* x, const T* cos, const T* sin, const int64_t* slots, const int64_t* tables, \
              int64_t table_stride, const int64_t* lens, int64_t b, T* work, T* out) {                              \
        const int64_t hidden = s->hidden, q_width = s->q_heads * s->head_dim;                                       \
        const int64_t qkv_width = q_width + 2 * s->kv_heads * s->head_dim, inter = s->intermediate;                 \
        T* h = work;                   /* a norm's output: [b, hidden] */                                           \
        T* qkv = h + b * hidden;       /* [b, qkv_width] */                                                         \
        T* attn = qkv + b * qkv_width; /* [b, q_width] */                                                           \
        T* proj = attn + b * q_width;  /* o_proj's, then down_proj's output: [b, hidden] */                         \
        T* gate_up = proj + b * hidden; /* [b, 2 * inter] */                                                        \
        T* act = gate_up + b * 2 * inter; /* [b, inter] */                                                          \
        for (int64_t l = 0; l < s->layers; l++) {                                                                   \
            const NAME##_layer* L = s->layer + l;                                                                   \
            s->add_rms_norm(x, l == 0 ? NULL : proj, L->input_norm, h, b, hidden, s->eps);                          \
            LINEAR_CALL(L->qkv_linear, h, hidden, b, hidden, L->qkv, qkv_width, L->qkv_bias, qkv);                  \
            s->rope_write_kv(qkv, b, qkv_width, s->q_heads, s->kv_heads, cos, sin, L->cache, L->num_blocks, slots); \
            s->decode(qkv, qkv_width, L->cache, L->num_blocks, tables, table_stride, lens, attn, b, s->q_heads,     \
                      s->kv_heads, s->scale);                                                                       \
            LINEAR_CALL(L->o_linear, attn, q_width, b, q_width, L->o, hidden, L->o_bias, proj);                     \
            s->add_rms_norm(x, proj, L->post_norm, h, b, hidden, s->eps);                                           \
            if (s->silu_mul != NULL) {                                                                              \
                LINEAR_CALL(L->gate_up_linear, h, hidden, b, hidden, L->gate_up, 2 * inter, L->gate_up_bias, gate_up); \
                s->silu_mul(gate_up, act, b, inter);                                                                \
            } else { /* gated matmuls: silu(gate) * up in their tiles */                                            \
                LINEAR_CALL(L->gate_up_linear, h, hidden, b, hidden, L->gate_up, inter, L->gate_up_bias, act);      \
            }                                                                                                       \
            LINEAR_CALL(L->down_linear, act, inter, b, inter, L->down, hidden, L->down_bias, proj);                 \
        }                                                                                                           \
        s->add_rms_norm(x, proj, s->final_norm, out, b, hidden, s->eps);                                            \
    }

typedef void (*linear_bf16_fn)(const uint16_t*, int64_t, int64_t, int64_t, const void*, int64_t, const float*, void*,
                               int64_t);
typedef void (*linear_f32_fn)(const float*, int64_t, int64_t, int64_t, const void*, int64_t, const float*, float*);

#define LINEAR_BF16(fn, x, ldx, m, k, w, n, bias, y) fn(x, ldx, m, k, w, n, bias, y, 0)
#define LINEAR_F32(fn, x, ldx, m, k, w, n, bias, y) fn(x, ldx, m, k, w, n, bias, y)
DEFINE_DECODER_STACK(decoder_stack_bf16, uint16_t, linear_bf16_fn, LINEAR_BF16)
DEFINE_DECODER_STACK(decoder_stack_f32, float, linear_f32_fn, LINEAR_F32)
/* The exported functions the macro defines, for native.py's bindings. */
EXPORT void decoder_stack_bf16(const decoder_stack_bf16_stack* s, uint16_t* x, const uint16_t* cos, const uint16_t* sin,
                               const int64_t* slots, const int64_t* tables, int64_t table_stride, const int64_t* lens,
                               int64_t b, uint16_t* work, uint16_t* out);
EXPORT void decoder_stack_f32(const decoder_stack_f32_stack* s, float* x, const float* cos, const float* sin,
                              const int64_t* slots, const int64_t* tables, int64_t table_stride, const int64_t* lens,
                              int64_t b, float* work, float* out);

/* Elements of the workspace a step of b rows needs. */
EXPORT int64_t decoder_stack_workspace(int64_t b, int64_t hidden, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                       int64_t intermediate) {
    return b * (2 * hidden + (2 * q_heads + 2 * kv_heads) * head_dim + 3 * intermediate);
}
