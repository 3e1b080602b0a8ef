/* Paged attention kernels for CPU: decode attention that reads the paged KV cache in place, and the
 * rotary embedding of a step's queries and keys fused with writing its keys and values into the cache.
 *
 * Decode: one query token per request; each (request, KV head) pair is one work item, spread over the
 * OpenMP threads that PyTorch itself uses (the process has a single libgomp). The item walks its request's
 * blocks once, keeping a running max and sum per query head (online softmax), so no key or value is
 * copied out of the cache and nothing is materialised per token. Everything is accumulated in float32.
 * While a block is read the next one is prefetched: blocks are scattered, so the hardware cannot guess.
 *
 * Built at start-up for the host (-march=native) with HEAD_DIM, BLOCK_SIZE and GROUP (query heads per KV
 * head) fixed at compile time, which lets the compiler keep a key or value row and the accumulators in
 * registers and vectorise every inner loop; see native.py.
 *
 * Cache layout: [2 (K, V), kv_heads, num_blocks, BLOCK_SIZE, HEAD_DIM], as in attention.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<head dimension>"
#endif
#ifndef BLOCK_SIZE
#error "compile with -DBLOCK_SIZE=<tokens per KV block>"
#endif
#ifndef GROUP
#error "compile with -DGROUP=<query heads per KV head>"
#endif

#define CACHE_LINE 64
#define ROW_BYTES(T) ((int)(HEAD_DIM * sizeof(T)))

/* How a block's key scores are computed: in float32 with the query heads scaled once (any target), or,
 * for bfloat16 on CPUs with AVX512-BF16, with dot-product instructions straight on the stored bf16 keys
 * and queries (exact products, float32 sums). -DPORTABLE forces the first, so tests cover both. Each
 * KEY_SCORES sets p[g][t] and raises block_max[g]. */
#define LOAD_QUERIES_FLOAT(LOAD)                                                                             \
    float qf[GROUP][HEAD_DIM];                                                                               \
    for (int g = 0; g < GROUP; g++)                                                                          \
        for (int d = 0; d < HEAD_DIM; d++) qf[g][d] = LOAD(queries[g * HEAD_DIM + d]) * scale;

#define KEY_SCORES_FLOAT(LOAD, krow, t)                                                                      \
    {                                                                                                        \
        float k[HEAD_DIM];                                                                                   \
        for (int d = 0; d < HEAD_DIM; d++) k[d] = LOAD((krow)[d]);                                           \
        for (int g = 0; g < GROUP; g++) {                                                                    \
            float dot = 0.0f;                                                                                \
            _Pragma("omp simd reduction(+ : dot)") for (int d = 0; d < HEAD_DIM; d++) dot += qf[g][d] * k[d]; \
            p[g][t] = dot;                                                                                   \
            block_max[g] = dot > block_max[g] ? dot : block_max[g];                                          \
        }                                                                                                    \
    }

#if defined(__AVX512BF16__) && !defined(PORTABLE) && HEAD_DIM % 32 == 0
#include <immintrin.h>
#define BF16_DOT 1
#define LOAD_QUERIES_BF16_DOT                                                                                \
    __m512bh qb[GROUP][HEAD_DIM / 32];                                                                       \
    for (int g = 0; g < GROUP; g++)                                                                          \
        for (int c = 0; c < HEAD_DIM / 32; c++)                                                              \
            qb[g][c] = (__m512bh)_mm512_loadu_si512((const void*)(queries + g * HEAD_DIM + 32 * c));

#define KEY_SCORES_BF16_DOT(krow, t)                                                                         \
    {                                                                                                        \
        __m512 sums[GROUP];                                                                                  \
        for (int g = 0; g < GROUP; g++) sums[g] = _mm512_setzero_ps();                                       \
        for (int c = 0; c < HEAD_DIM / 32; c++) {                                                            \
            const __m512bh k = (__m512bh)_mm512_loadu_si512((const void*)((krow) + 32 * c));                 \
            for (int g = 0; g < GROUP; g++) sums[g] = _mm512_dpbf16_ps(sums[g], qb[g][c], k);                \
        }                                                                                                    \
        for (int g = 0; g < GROUP; g++) {                                                                    \
            const float dot = _mm512_reduce_add_ps(sums[g]) * scale;                                         \
            p[g][t] = dot;                                                                                   \
            block_max[g] = dot > block_max[g] ? dot : block_max[g];                                          \
        }                                                                                                    \
    }
#endif

#define DEFINE_PAGED_DECODE(NAME, T, LOAD, STORE)                                                            \
    void NAME(const T* q, int64_t q_stride, const T* cache, int64_t num_blocks, const int64_t* tables,       \
              int64_t table_stride, const int64_t* lens, T* out, int64_t batch, int64_t q_heads,             \
              int64_t kv_heads, float scale) {                                                               \
        const int64_t head_stride = num_blocks * BLOCK_SIZE * HEAD_DIM;                                      \
        _Pragma("omp parallel for schedule(dynamic, 1)") for (int64_t item = 0; item < batch * kv_heads;     \
                                                              item++) {                                      \
            const int64_t b = item / kv_heads, h = item % kv_heads, len = lens[b];                           \
            float acc[GROUP][HEAD_DIM], p[GROUP][BLOCK_SIZE], run_max[GROUP], run_sum[GROUP];                \
            const T* queries = q + b * q_stride + h * GROUP * HEAD_DIM;                                      \
            LOAD_QUERIES(queries)                                                                            \
            for (int g = 0; g < GROUP; g++) {                                                                \
                for (int d = 0; d < HEAD_DIM; d++) acc[g][d] = 0.0f;                                         \
                run_max[g] = -INFINITY;                                                                      \
                run_sum[g] = 0.0f;                                                                           \
            }                                                                                                \
            const T* keys = cache + h * head_stride;                                                         \
            const T* values = cache + (kv_heads + h) * head_stride;                                          \
            for (int64_t start = 0, j = 0; start < len; start += BLOCK_SIZE, j++) {                          \
                const int64_t block = tables[b * table_stride + j];                                          \
                const int n = len - start < BLOCK_SIZE ? (int)(len - start) : BLOCK_SIZE;                    \
                const T* kb = keys + block * BLOCK_SIZE * HEAD_DIM;                                          \
                const T* vb = values + block * BLOCK_SIZE * HEAD_DIM;                                        \
                const int64_t next = start + BLOCK_SIZE < len ? tables[b * table_stride + j + 1] : block;    \
                const char* next_k = (const char*)(keys + next * BLOCK_SIZE * HEAD_DIM);                     \
                const char* next_v = (const char*)(values + next * BLOCK_SIZE * HEAD_DIM);                   \
                float block_max[GROUP];                                                                      \
                for (int g = 0; g < GROUP; g++) block_max[g] = run_max[g];                                   \
                /* The next block is somewhere else in memory: ask for it a row per row of this one. */      \
                for (int t = 0; t < n; t++) {                                                                \
                    for (int o = t * ROW_BYTES(T); o < (t + 1) * ROW_BYTES(T); o += CACHE_LINE) {            \
                        __builtin_prefetch(next_k + o);                                                      \
                        __builtin_prefetch(next_v + o);                                                      \
                    }                                                                                        \
                    KEY_SCORES(kb + t * HEAD_DIM, t)                                                         \
                }                                                                                            \
                for (int g = 0; g < GROUP; g++) {                                                            \
                    const float rescale = exp_approx(run_max[g] - block_max[g]);                             \
                    float sum = 0.0f;                                                                        \
                    _Pragma("omp simd reduction(+ : sum)") for (int t = 0; t < n; t++) {                     \
                        p[g][t] = exp_approx(p[g][t] - block_max[g]);                                        \
                        sum += p[g][t];                                                                      \
                    }                                                                                        \
                    run_max[g] = block_max[g];                                                               \
                    run_sum[g] = run_sum[g] * rescale + sum;                                                 \
                    for (int d = 0; d < HEAD_DIM; d++) acc[g][d] *= rescale;                                 \
                }                                                                                            \
                for (int t = 0; t < n; t++) {                                                                \
                    float v[HEAD_DIM];                                                                       \
                    for (int d = 0; d < HEAD_DIM; d++) v[d] = LOAD(vb[t * HEAD_DIM + d]);                    \
                    for (int g = 0; g < GROUP; g++)                                                          \
                        for (int d = 0; d < HEAD_DIM; d++) acc[g][d] += p[g][t] * v[d];                      \
                }                                                                                            \
            }                                                                                                \
            for (int g = 0; g < GROUP; g++) {                                                                \
                T* dst = out + (b * q_heads + h * GROUP + g) * HEAD_DIM;                                     \
                const float inv = 1.0f / run_sum[g];                                                         \
                for (int d = 0; d < HEAD_DIM; d++) dst[d] = STORE(acc[g][d] * inv);                          \
            }                                                                                                \
        }                                                                                                    \
    }

/* qkv: [tokens, q_heads + 2 * kv_heads, HEAD_DIM] with `token_stride` elements between tokens, queries then
 * keys then values. Queries and keys are rotated in place (Hugging Face's rotate-half layout; cos and sin:
 * [tokens, HEAD_DIM], the sign of the first half folded into sin, as in rope.py) with PyTorch's roundings,
 * x * cos rounded, then + rolled x * sin rounded; then each token's keys and values are copied to its cache
 * slot (block * BLOCK_SIZE + offset). */
#define DEFINE_ROPE_WRITE_KV(NAME, T, LOAD, STORE, ROUND)                                                    \
    void NAME(T* qkv, int64_t tokens, int64_t token_stride, int64_t q_heads, int64_t kv_heads, const T* cos, \
              const T* sin, T* cache, int64_t num_blocks, const int64_t* slots) {                            \
        const int64_t head_stride = num_blocks * BLOCK_SIZE * HEAD_DIM;                                      \
        _Pragma("omp parallel for if (tokens >= 64)") for (int64_t t = 0; t < tokens; t++) {                 \
            T* row = qkv + t * token_stride;                                                                 \
            const T* c = cos + t * HEAD_DIM;                                                                 \
            const T* s = sin + t * HEAD_DIM;                                                                 \
            for (int64_t head = 0; head < q_heads + kv_heads; head++) {                                      \
                T* x = row + head * HEAD_DIM;                                                                \
                float xf[HEAD_DIM];                                                                          \
                for (int d = 0; d < HEAD_DIM; d++) xf[d] = LOAD(x[d]);                                       \
                for (int d = 0; d < HEAD_DIM; d++)                                                           \
                    x[d] = STORE(ROUND(xf[d] * LOAD(c[d])) +                                                 \
                                 xf[(d + HEAD_DIM / 2) % HEAD_DIM] * LOAD(s[d]));                            \
            }                                                                                                \
            const int64_t slot = slots[t];                                                                   \
            for (int64_t h = 0; h < 2 * kv_heads; h++) /* K heads, then V heads */                           \
                memcpy(cache + h * head_stride + slot * HEAD_DIM, row + (q_heads + h) * HEAD_DIM,            \
                       HEAD_DIM * sizeof(T));                                                                \
        }                                                                                                    \
    }

#ifdef BF16_DOT
#define LOAD_QUERIES(queries) LOAD_QUERIES_BF16_DOT
#define KEY_SCORES(krow, t) KEY_SCORES_BF16_DOT(krow, t)
#else
#define LOAD_QUERIES(queries) LOAD_QUERIES_FLOAT(bf16_to_float)
#define KEY_SCORES(krow, t) KEY_SCORES_FLOAT(bf16_to_float, krow, t)
#endif
DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, bf16_to_float, float_to_bf16)
#undef LOAD_QUERIES
#undef KEY_SCORES

#define LOAD_QUERIES(queries) LOAD_QUERIES_FLOAT(identity)
#define KEY_SCORES(krow, t) KEY_SCORES_FLOAT(identity, krow, t)
DEFINE_PAGED_DECODE(paged_decode_f32, float, identity, identity)
#undef LOAD_QUERIES
#undef KEY_SCORES

/* Which key-score path the bfloat16 kernel was built with, for tests and logs: 1 dot-product instructions. */
int paged_decode_bf16_dot(void) {
#ifdef BF16_DOT
    return 1;
#else
    return 0;
#endif
}
DEFINE_ROPE_WRITE_KV(rope_write_kv_bf16, uint16_t, bf16_to_float, float_to_bf16, round_bf16)
DEFINE_ROPE_WRITE_KV(rope_write_kv_f32, float, identity, identity, identity)
