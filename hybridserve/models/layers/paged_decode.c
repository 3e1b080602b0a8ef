/* Paged decode attention in float32: one query token per request over its cached keys, the blocks read in place
 * (paged_attention.h's plan); on AVX2 its key scores, weights and value sums in AVX2's registers. */
#include "paged_attention.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && !defined(PORTABLE) && HEAD_DIM % 8 == 0
#include <immintrin.h>
/* float32 on AVX2: two keys' scores for every query head of the group at once (2 x GROUP accumulators over the
 * dimensions, eight at a time, both key vectors in registers, each query vector loaded once a step), then each
 * head's two sums out of their vectors by one horizontal-add tree instead of one reduction a key: keys t0 and
 * t0 + 1, the second not to be used past the block's nk keys. Four keys at a time (12 accumulators) left GCC no
 * register for a key: it loaded every key vector again for each head and every query vector again for each key,
 * two loads a multiply-add; this way the arithmetic of a step's decode attention takes 11-14% less time
 * (keys in cache) and the step 3-5% less with its blocks in runs, the sums bitwise the same. Among the
 * products, the same two rows of the next block's keys and values are asked for a line at a time. */
static inline void key_scores2_f32(const float (*qf)[HEAD_DIM], const float* kb, int t0, int nk,
                                   float (*p)[BLOCK_SIZE], const char* next_k, const char* next_v) {
    __m256 acc[2][GROUP];
    for (int t = 0; t < 2; t++)
        for (int g = 0; g < GROUP; g++) acc[t][g] = _mm256_setzero_ps();
    for (int c = 0; c < HEAD_DIM; c += 8) {
        /* rows t0 and t0 + 1 are 2 * HEAD_DIM * 4 bytes: HEAD_DIM / 8 steps of c, a line of each a step */
        const int line = t0 * HEAD_DIM * 4 + c / 8 * CACHE_LINE;
        if (line < BLOCK_SIZE * HEAD_DIM * 4) {
            __builtin_prefetch(next_k + line);
            __builtin_prefetch(next_v + line);
        }
        __m256 k0 = _mm256_loadu_ps(kb + t0 * HEAD_DIM + c);
        __m256 k1 = _mm256_loadu_ps(kb + (t0 + (nk > 1 ? 1 : 0)) * HEAD_DIM + c); /* past nk: unused */
        __asm__("" : "+x"(k0), "+x"(k1)); /* kept in registers, not folded into each head's multiply-add */
        for (int g = 0; g < GROUP; g++) {
            const __m256 qv = _mm256_loadu_ps(qf[g] + c);
            acc[0][g] = _mm256_fmadd_ps(qv, k0, acc[0][g]);
            acc[1][g] = _mm256_fmadd_ps(qv, k1, acc[1][g]);
        }
    }
    for (int g = 0; g < GROUP; g++) { /* each key: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) of its lanes */
        const __m256 pairs = _mm256_hadd_ps(acc[0][g], acc[1][g]), quads = _mm256_hadd_ps(pairs, pairs);
        const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1));
        p[g][t0] = _mm_cvtss_f32(sums);
        if (nk > 1) p[g][t0 + 1] = _mm_cvtss_f32(_mm_movehdup_ps(sums));
    }
}
#define BLOCK_SCORES(kb, n, next_k, next_v)                                                                  \
    for (int t0 = 0; t0 < n; t0 += 2) key_scores2_f32(qf, kb, t0, n - t0 < 2 ? n - t0 : 2, p, next_k, next_v);

#if BLOCK_SIZE == 16 && GROUP <= 8
/* The eight lanes' largest, and their sum in a fixed order (halves, then pairs). */
static inline float lanes_max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float lanes_sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* BLOCK_WEIGHTS_EACH_KEY in vectors: a head's 16 scores are two, so its maximum, exponentials and their sum take a
 * few instructions where a key at a time made chains of scalar ones, and every head's rescale is one exponential
 * of eight lanes. A step's 30 layers of decode attention, context 650, on a Zen 3: keys in L1, batch 8 5.4-5.5 ->
 * 4.7-4.8 ms, batch 32 20.2-20.6 -> 18.2 ms; from memory, blocks scattered, 0-5% faster. Keys past n score -inf
 * and weigh zero. */
static inline void block_weights_f32(float (*p)[BLOCK_SIZE], int n, float* run_max, float* run_sum, float* rescale) {
    const __m256 count = _mm256_set1_ps((float)n), none = _mm256_set1_ps(-INFINITY);
    const __m256 seen_lo = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), count, _CMP_LT_OQ);
    const __m256 seen_hi = _mm256_cmp_ps(_mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15), count, _CMP_LT_OQ);
    __m256 lo[GROUP], hi[GROUP];
    float top[GROUP], shift[8] __attribute__((aligned(32))) = {0}, scales[8] __attribute__((aligned(32)));
    for (int g = 0; g < GROUP; g++) {
        lo[g] = _mm256_blendv_ps(none, _mm256_load_ps(p[g]), seen_lo);
        hi[g] = _mm256_blendv_ps(none, _mm256_load_ps(p[g] + 8), seen_hi);
        const float seen = lanes_max8(_mm256_max_ps(lo[g], hi[g]));
        top[g] = seen > run_max[g] ? seen : run_max[g];
        shift[g] = run_max[g] - top[g];
    }
    _mm256_store_ps(scales, exp_approx8(_mm256_load_ps(shift)));
    for (int g = 0; g < GROUP; g++) {
        const __m256 t = _mm256_set1_ps(top[g]);
        const __m256 w_lo = _mm256_and_ps(exp_approx8(_mm256_sub_ps(lo[g], t)), seen_lo);
        const __m256 w_hi = _mm256_and_ps(exp_approx8(_mm256_sub_ps(hi[g], t)), seen_hi);
        _mm256_store_ps(p[g], w_lo);
        _mm256_store_ps(p[g] + 8, w_hi);
        rescale[g] = scales[g];
        run_max[g] = top[g];
        run_sum[g] = run_sum[g] * scales[g] + lanes_sum8(_mm256_add_ps(w_lo, w_hi));
    }
}
#define BLOCK_WEIGHTS(n, rescale) block_weights_f32(p, n, run_max, run_sum, rescale);
#else
#define BLOCK_WEIGHTS(n, rescale) BLOCK_WEIGHTS_EACH_KEY(n, rescale)
#endif
/* Query head g's value sums in eight registers across the block's keys (rescaled as they are loaded), instead of
 * every head's sums through memory a key at a time: per element the same products added in the same order. */
#define VALUE_SUMS(vb, n, g, rescale)                                                                        \
    {                                                                                                        \
        __m256 a[HEAD_DIM / 8];                                                                              \
        const __m256 rs = _mm256_set1_ps(rescale);                                                          \
        for (int c = 0; c < HEAD_DIM / 8; c++) a[c] = _mm256_mul_ps(_mm256_loadu_ps(acc[g] + 8 * c), rs);  \
        for (int t = 0; t < n; t++) {                                                                        \
            const __m256 w = _mm256_set1_ps(p[g][t]);                                                        \
            for (int c = 0; c < HEAD_DIM / 8; c++)                                                           \
                a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vb + t * HEAD_DIM + 8 * c), a[c]);                 \
        }                                                                                                    \
        for (int c = 0; c < HEAD_DIM / 8; c++) _mm256_storeu_ps(acc[g] + 8 * c, a[c]);                      \
    }
#else
#define BLOCK_SCORES(kb, n, next_k, next_v) BLOCK_SCORES_EACH_KEY(float, identity, kb, n, next_k, next_v)
#define BLOCK_WEIGHTS(n, rescale) BLOCK_WEIGHTS_EACH_KEY(n, rescale)
#define VALUE_SUMS(vb, n, g, rescale) VALUE_SUMS_EACH_ELEMENT(identity, vb, n, g, rescale)
#endif
#define LOAD_QUERIES(queries) LOAD_QUERIES_FLOAT(identity)

EXPORT void paged_decode_f32(const float* q, int64_t q_stride, const float* cache, int64_t num_blocks,
                             const int64_t* tables, int64_t table_stride, const int64_t* lens, float* out,
                             int64_t batch, int64_t q_heads, int64_t kv_heads, float scale) {
    PAGED_DECODE(float, identity, identity)
}
