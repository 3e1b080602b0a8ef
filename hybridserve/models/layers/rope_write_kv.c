/* Rotary embedding of a step's queries and keys, fused with writing its keys and values into the paged cache. */
#include "paged_attention.h"

/* One head row rotated in place (x, c, s: HEAD_DIM each), in plain C. */
#define DEFINE_ROTATE_HEAD(NAME, T, LOAD, STORE, ROUND)                                                      \
    static inline void NAME(T* x, const T* c, const T* s) {                                                  \
        float xf[HEAD_DIM];                                                                                  \
        for (int d = 0; d < HEAD_DIM; d++) xf[d] = LOAD(x[d]);                                               \
        for (int d = 0; d < HEAD_DIM; d++)                                                                   \
            x[d] = STORE(ROUND(xf[d] * LOAD(c[d])) + xf[(d + HEAD_DIM / 2) % HEAD_DIM] * LOAD(s[d]));        \
    }

/* qkv: [tokens, q_heads + 2 * kv_heads, HEAD_DIM] with `token_stride` elements between tokens, queries then
 * keys then values. Queries and keys are rotated in place (Hugging Face's rotate-half layout; cos and sin:
 * [tokens, HEAD_DIM], the sign of the first half folded into sin, as in rope.py) with PyTorch's roundings,
 * x * cos rounded, then + rolled x * sin rounded; then each token's keys and values are copied to its cache
 * slot (block * BLOCK_SIZE + offset). The cache rows a thread will write are asked for first (the same static
 * split as the loop after): each is a miss, often a TLB miss too, and taken one at a time they were most of the
 * function's time (a batch-64 decode step's 30 layers in bf16: 1.34 -> 0.65 ms with the vector rotation below). */
#define ROPE_WRITE_KV(T, ROTATE_HEAD)                                                                        \
    const int64_t head_stride = num_blocks * BLOCK_SIZE * HEAD_DIM;                                          \
    _Pragma("omp parallel if (tokens >= 32)") {                                                              \
        _Pragma("omp for schedule(static) nowait") for (int64_t t = 0; t < tokens; t++) {                    \
            for (int64_t h = 0; h < 2 * kv_heads; h++) {                                                     \
                const char* dst = (const char*)(cache + h * head_stride + slots[t] * HEAD_DIM);              \
                for (int o = 0; o < ROW_BYTES(T); o += CACHE_LINE) __builtin_prefetch(dst + o, 1, 3);        \
            }                                                                                                \
        }                                                                                                    \
        _Pragma("omp for schedule(static)") for (int64_t t = 0; t < tokens; t++) {                           \
            T* row = qkv + t * token_stride;                                                                 \
            for (int64_t head = 0; head < q_heads + kv_heads; head++)                                        \
                ROTATE_HEAD(row + head * HEAD_DIM, cos + t * HEAD_DIM, sin + t * HEAD_DIM);                  \
            const int64_t slot = slots[t];                                                                   \
            for (int64_t h = 0; h < 2 * kv_heads; h++) /* K heads, then V heads */                           \
                memcpy(cache + h * head_stride + slot * HEAD_DIM, row + (q_heads + h) * HEAD_DIM,            \
                       ROW_BYTES(T));                                                                        \
        }                                                                                                    \
    }

#if defined(__AVX512BF16__) && !defined(PORTABLE) && HEAD_DIM % 32 == 0
/* bfloat16 with AVX512-BF16: DEFINE_ROTATE_HEAD's arithmetic on sixteen lanes, the row in HEAD_DIM / 16 vectors,
 * its rolled half the vectors half a row on, each rounding one instruction (to_bf16x16): the same bits. */
static inline void rotate_head_bf16(uint16_t* x, const uint16_t* c, const uint16_t* s) {
    enum { CH = HEAD_DIM / 16 };
    __m512 xf[CH];
    for (int v = 0; v < CH; v++) xf[v] = load_bf16x16(x + 16 * v, 0xffff);
    for (int v = 0; v < CH; v++) {
        const __m512 rolled = _mm512_mul_ps(xf[(v + CH / 2) % CH], load_bf16x16(s + 16 * v, 0xffff));
        const __m512 y = _mm512_add_ps(round_bf16x16(_mm512_mul_ps(xf[v], load_bf16x16(c + 16 * v, 0xffff))), rolled);
        _mm256_storeu_si256((__m256i*)(x + 16 * v), to_bf16x16(y));
    }
}
#else
DEFINE_ROTATE_HEAD(rotate_head_bf16, uint16_t, bf16_to_float, float_to_bf16, round_bf16)
#endif
DEFINE_ROTATE_HEAD(rotate_head_f32, float, identity, identity, identity)

EXPORT void rope_write_kv_bf16(uint16_t* qkv, int64_t tokens, int64_t token_stride, int64_t q_heads, int64_t kv_heads,
                               const uint16_t* cos, const uint16_t* sin, uint16_t* cache, int64_t num_blocks,
                               const int64_t* slots) {
    ROPE_WRITE_KV(uint16_t, rotate_head_bf16)
}

EXPORT void rope_write_kv_f32(float* qkv, int64_t tokens, int64_t token_stride, int64_t q_heads, int64_t kv_heads,
                              const float* cos, const float* sin, float* cache, int64_t num_blocks,
                              const int64_t* slots) {
    ROPE_WRITE_KV(float, rotate_head_f32)
}
