/* Shared by the paged attention library's sources (native.LIBRARIES["paged_attention"]: paged_decode.c,
 * paged_decode_bf16.c, paged_prefill.c, rope_write_kv.c): CPU kernels that read the paged KV cache in place.
 *
 * Decode: one query token per request; each (request, KV head) pair is one work item, spread over the
 * OpenMP threads that PyTorch itself uses (the process has a single libgomp). The item walks its request's
 * blocks once, keeping a running max and sum per query head (online softmax), so no key or value is
 * copied out of the cache and nothing is materialised per token. Everything is accumulated in float32.
 * While a block is read the next one is prefetched: blocks are scattered, so the hardware cannot guess.
 *
 * Built at start-up for the host (-march=native) with HEAD_DIM, BLOCK_SIZE and GROUP (query heads per KV
 * head) fixed at compile time, which lets the compiler keep a key or value row and the accumulators in
 * registers and vectorise every inner loop; see native.py. Everything here is a macro or static inline.
 *
 * Cache layout: [2 (K, V), kv_heads, num_blocks, BLOCK_SIZE, HEAD_DIM], as in attention.py.
 */
#ifndef HYBRIDSERVE_PAGED_ATTENTION_H
#define HYBRIDSERVE_PAGED_ATTENTION_H

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
 * and queries (exact products, float32 sums). -DPORTABLE forces the first, so tests cover both. The decode
 * loop below takes a block's scores from BLOCK_SCORES (setting p[g][t] and asking for the next block's lines among
 * its products), the online softmax step that turns them into weights from BLOCK_WEIGHTS, and its value sums from
 * VALUE_SUMS; a key at a time and an element at a time in plain C (BLOCK_SCORES_EACH_KEY, BLOCK_WEIGHTS_EACH_KEY,
 * VALUE_SUMS_EACH_ELEMENT), float32 on AVX2 its own of all three. */
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
        }                                                                                                    \
    }

/* A block's scores a key at a time; the next block is somewhere else in memory: ask for it a row per row of this
 * one. */
#define BLOCK_SCORES_EACH_KEY(T, LOAD, kb, n, next_k, next_v)                                                \
    for (int t = 0; t < n; t++) {                                                                            \
        for (int o = t * ROW_BYTES(T); o < (t + 1) * ROW_BYTES(T); o += CACHE_LINE) {                        \
            __builtin_prefetch(next_k + o);                                                                  \
            __builtin_prefetch(next_v + o);                                                                  \
        }                                                                                                    \
        KEY_SCORES_FLOAT(LOAD, kb + t * HEAD_DIM, t)                                                         \
    }

/* The online softmax step over a block's n scores p[g][t] of each query head: its maximum so far, the rescale of
 * what came before (rescale[g]), the keys' weights in place of their scores and their sum. */
#define BLOCK_WEIGHTS_EACH_KEY(n, rescale)                                                                   \
    for (int g = 0; g < GROUP; g++) {                                                                        \
        float top = run_max[g], sum = 0.0f;                                                                  \
        for (int t = 0; t < n; t++) top = p[g][t] > top ? p[g][t] : top;                                     \
        rescale[g] = exp_approx(run_max[g] - top);                                                           \
        _Pragma("omp simd reduction(+ : sum)") for (int t = 0; t < n; t++) {                                 \
            p[g][t] = exp_approx(p[g][t] - top);                                                             \
            sum += p[g][t];                                                                                  \
        }                                                                                                    \
        run_max[g] = top;                                                                                    \
        run_sum[g] = run_sum[g] * rescale[g] + sum;                                                          \
    }

/* Query head g's running sums rescaled, then the block's n weighted values added, a key at a time. */
#define VALUE_SUMS_EACH_ELEMENT(LOAD, vb, n, g, rescale)                                                     \
    {                                                                                                        \
        for (int d = 0; d < HEAD_DIM; d++) acc[g][d] *= rescale;                                             \
        for (int t = 0; t < n; t++)                                                                          \
            for (int d = 0; d < HEAD_DIM; d++) acc[g][d] += p[g][t] * LOAD(vb[t * HEAD_DIM + d]);            \
    }

#if defined(__AVX512BF16__) && !defined(PORTABLE) && HEAD_DIM % 32 == 0 && BLOCK_SIZE % 16 == 0
#include <immintrin.h>
#define BF16_DOT 1
#endif

/* The body of a decode function with paged_decode_f32's parameters (q .. scale) for element type T: the float32
 * path (any target), its key scores, weights and value sums from the BLOCK_SCORES, BLOCK_WEIGHTS and VALUE_SUMS the
 * source defines (and its queries from LOAD_QUERIES). */
#define PAGED_DECODE(T, LOAD, STORE)                                                                         \
    const int64_t head_stride = num_blocks * BLOCK_SIZE * HEAD_DIM;                                          \
    _Pragma("omp parallel for schedule(dynamic, 1)") for (int64_t item = 0; item < batch * kv_heads;         \
                                                          item++) {                                          \
        const int64_t b = item / kv_heads, h = item % kv_heads, len = lens[b];                               \
        float acc[GROUP][HEAD_DIM], p[GROUP][BLOCK_SIZE] __attribute__((aligned(32)));                       \
        float run_max[GROUP], run_sum[GROUP];                                                                \
        const T* queries = q + b * q_stride + h * GROUP * HEAD_DIM;                                          \
        LOAD_QUERIES(queries)                                                                                \
        for (int g = 0; g < GROUP; g++) {                                                                    \
            for (int d = 0; d < HEAD_DIM; d++) acc[g][d] = 0.0f;                                             \
            run_max[g] = -INFINITY;                                                                          \
            run_sum[g] = 0.0f;                                                                               \
        }                                                                                                    \
        const T* keys = cache + h * head_stride;                                                             \
        const T* values = cache + (kv_heads + h) * head_stride;                                              \
        for (int64_t start = 0, j = 0; start < len; start += BLOCK_SIZE, j++) {                              \
            const int64_t block = tables[b * table_stride + j];                                              \
            const int n = len - start < BLOCK_SIZE ? (int)(len - start) : BLOCK_SIZE;                        \
            const T* kb = keys + block * BLOCK_SIZE * HEAD_DIM;                                              \
            const T* vb = values + block * BLOCK_SIZE * HEAD_DIM;                                            \
            const int64_t next = start + BLOCK_SIZE < len ? tables[b * table_stride + j + 1] : block;        \
            const char* next_k = (const char*)(keys + next * BLOCK_SIZE * HEAD_DIM);                         \
            const char* next_v = (const char*)(values + next * BLOCK_SIZE * HEAD_DIM);                       \
            float rescale[GROUP];                                                                            \
            BLOCK_SCORES(kb, n, next_k, next_v)                                                              \
            BLOCK_WEIGHTS(n, rescale)                                                                        \
            for (int g = 0; g < GROUP; g++) VALUE_SUMS(vb, n, g, rescale[g])                                 \
        }                                                                                                    \
        for (int g = 0; g < GROUP; g++) {                                                                    \
            T* dst = out + (b * q_heads + h * GROUP + g) * HEAD_DIM;                                         \
            const float inv = 1.0f / run_sum[g];                                                             \
            for (int d = 0; d < HEAD_DIM; d++) dst[d] = STORE(acc[g][d] * inv);                              \
        }                                                                                                    \
    }

#endif
