/* Paged decode attention in bfloat16: one query token per request over its cached keys, the blocks read in place
 * (paged_attention.h's plan). One kernel, two builds: with AVX512-BF16 (BF16_DOT: a head of whole 32s, blocks of
 * whole 16s, not -DPORTABLE) its scores and value sums in the CPU's bf16 dot products, else the float32 path of
 * paged_decode_f32 on the widened values. */
#include "paged_attention.h"

#ifdef BF16_DOT
/* Sixteen vectors' lane sums in one vector: lane t of the result sums s[(t % 4) * 4 + t / 4], each in the order
 * of _mm512_reduce_add_ps (halves, quarters, pairs, lanes), four vectors a shuffle-and-add. */
static inline __m512 lane_sums16(const __m512* s) {
    __m512 c[8], d[4], e[2];
    for (int i = 0; i < 8; i++) /* [a.q0 + a.q2, a.q1 + a.q3, b.q0 + b.q2, b.q1 + b.q3] */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xee));
    for (int i = 0; i < 4; i++) /* quarter k: the four partial sums of s[4 i + k] */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; i++)
        e[i] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * i], d[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(d[2 * i], d[2 * i + 1], 0xee));
    return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xdd));
}

/* Decode, bfloat16 with AVX512-BF16: the work items of DEFINE_PAGED_DECODE, their keys taken 16 at a time (a
 * tile; a block is one or more). A query head's scores against a tile: two dot-product instructions per key
 * (exact products, float32 sums), the sixteen keys' sums then reduced together (lane_sums16). The online
 * softmax, in float32, takes CHUNK_TILES tiles a step: their scores are all computed first, so no tile waits on
 * the one before's max and exponentials (5-8% faster than a step a tile, batch 1-64, context 64-2000, on a Xeon
 * with AVX512-BF16). The values: the weights rounded to bf16 in pairs of keys, as PyTorch's CPU
 * flash attention and the prefill kernel below round them, against those two keys' values interleaved, one
 * dot-product instruction per pair and 16 dimensions, float32 sums in a copy of the accumulators that lives
 * only through a chunk's values, so the compiler keeps it in registers (updated in place, the accumulators were
 * stored back after every pair: 25% of the kernel's time with its tiles in L1, 8-15% from memory, on Zen 4).
 * The tile PREFETCH_TILES ahead is asked into L2 (blocks are scattered, so the hardware cannot guess; asked into
 * L1, tiles crowded out the one at work: 64 requests of 128 tokens from a cache larger than L3, 480 against 340 us
 * a layer), a few lines at a time among the dot products, its keys' during the scores and its values' during the
 * values: asked at once at the tile's start, the requests past what the core keeps in flight held up the
 * arithmetic behind them (Zen 4, 30 layers, context 600: 8 requests 5.97 -> 5.05 ms, 64 requests 52.7 -> 48.1 ms;
 * 64 of 116 tokens 9.8 -> 9.2 ms). A request's first tiles are still asked at once. */
#define KEY_TILE 16
#define PREFETCH_TILES 2
#define CHUNK_TILES 8
#define CHUNKS (HEAD_DIM / 16) /* float32 vectors per head row */

#define TILE_LINES (KEY_TILE * HEAD_DIM * 2 / CACHE_LINE) /* of a tile's keys, and of its values */
/* A key tile's lines one per (query head, key) of the scores where there are enough of those, else all at once;
 * a value tile's TILE_LINES / 8 per key pair (HEAD_DIM is a multiple of 32, so that is whole). */
#define SPREAD_KEYS (GROUP * KEY_TILE >= TILE_LINES)
#define VALUE_LINES (TILE_LINES / (KEY_TILE / 2))

static inline void prefetch_tile(const uint16_t* k, const uint16_t* v) {
    for (int o = 0; o < KEY_TILE * HEAD_DIM * 2; o += CACHE_LINE) {
        _mm_prefetch((const char*)k + o, _MM_HINT_T1);
        _mm_prefetch((const char*)v + o, _MM_HINT_T1);
    }
}

#else
#define LOAD_QUERIES(queries) LOAD_QUERIES_FLOAT(bf16_to_float)
#define BLOCK_SCORES(kb, n, next_k, next_v) BLOCK_SCORES_EACH_KEY(uint16_t, bf16_to_float, kb, n, next_k, next_v)
#define BLOCK_WEIGHTS(n, rescale) BLOCK_WEIGHTS_EACH_KEY(n, rescale)
#define VALUE_SUMS(vb, n, g, rescale) VALUE_SUMS_EACH_ELEMENT(bf16_to_float, vb, n, g, rescale)
#endif

EXPORT void paged_decode_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* cache, int64_t num_blocks,
                              const int64_t* tables, int64_t table_stride, const int64_t* lens, uint16_t* out,
                              int64_t batch, int64_t q_heads, int64_t kv_heads, float scale) {
#ifdef BF16_DOT
    const int64_t head_stride = num_blocks * BLOCK_SIZE * HEAD_DIM;
    /* Unpacking two rows of 32 interleaves them four dimensions at a time: value-pair vector 2c holds dimensions
     * 32c + {0-3, 8-11, 16-19, 24-27}, vector 2c + 1 the four after each; these put them back in order. */
    const __m512i in_order_lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i in_order_hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < batch * kv_heads; item++) {
        const int64_t b = item / kv_heads, h = item % kv_heads, len = lens[b];
        const int64_t* table = tables + b * table_stride;
        const uint16_t* queries = q + b * q_stride + h * GROUP * HEAD_DIM;
        const uint16_t* keys = cache + h * head_stride;
        const uint16_t* values = cache + (kv_heads + h) * head_stride;
        __m512bh qb[GROUP][HEAD_DIM / 32];
        __m512 acc[GROUP][CHUNKS];
        float run_max[GROUP], run_sum[GROUP];
        for (int g = 0; g < GROUP; g++) {
            for (int c = 0; c < HEAD_DIM / 32; c++)
                qb[g][c] = (__m512bh)_mm512_loadu_si512((const void*)(queries + g * HEAD_DIM + 32 * c));
            for (int c = 0; c < CHUNKS; c++) acc[g][c] = _mm512_setzero_ps();
            run_max[g] = -INFINITY;
            run_sum[g] = 0.0f;
        }
        const int64_t tiles = (len + KEY_TILE - 1) / KEY_TILE;
#define TILE_OFFSET(i) (table[(i) * KEY_TILE / BLOCK_SIZE] * BLOCK_SIZE + (i) * KEY_TILE % BLOCK_SIZE) * HEAD_DIM
        for (int64_t i = 0; i < PREFETCH_TILES && i < tiles; i++)
            prefetch_tile(keys + TILE_OFFSET(i), values + TILE_OFFSET(i));
        for (int64_t first = 0; first < tiles; first += CHUNK_TILES) {
            const int count = tiles - first < CHUNK_TILES ? (int)(tiles - first) : CHUNK_TILES;
            __m512 scores[GROUP][CHUNK_TILES], chunk_max[GROUP];
            for (int g = 0; g < GROUP; g++) chunk_max[g] = _mm512_set1_ps(-INFINITY);
            /* The chunk's scores: no tile waits on another's softmax. */
            for (int i = 0; i < count; i++) {
                const int64_t tile = first + i;
                const char* ahead = tile + PREFETCH_TILES < tiles ? (const char*)(keys + TILE_OFFSET(tile + PREFETCH_TILES)) : 0;
                if (!SPREAD_KEYS && ahead != 0)
                    for (int l = 0; l < TILE_LINES; l++) _mm_prefetch(ahead + l * CACHE_LINE, _MM_HINT_T1);
                const uint16_t* kt = keys + TILE_OFFSET(tile);
                const int n = len - tile * KEY_TILE < KEY_TILE ? (int)(len - tile * KEY_TILE) : KEY_TILE;
                const __mmask16 valid = (__mmask16)((1u << n) - 1);
                for (int g = 0; g < GROUP; g++) {
                    __m512 sums[KEY_TILE];
                    for (int j = 0; j < KEY_TILE; j++) { /* lane t of the sums: key t (a key past n is never used) */
                        if (SPREAD_KEYS && ahead != 0 && g < TILE_LINES / KEY_TILE)
                            _mm_prefetch(ahead + (g * KEY_TILE + j) * CACHE_LINE, _MM_HINT_T1);
                        const uint16_t* krow = kt + ((j % 4) * 4 + j / 4) * HEAD_DIM;
                        sums[j] = _mm512_setzero_ps();
                        for (int c = 0; c < HEAD_DIM / 32; c++)
                            sums[j] = _mm512_dpbf16_ps(sums[j], qb[g][c],
                                                       (__m512bh)_mm512_loadu_si512((const void*)(krow + 32 * c)));
                    }
                    scores[g][i] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid, lane_sums16(sums),
                                                      _mm512_set1_ps(scale));
                    chunk_max[g] = _mm512_max_ps(chunk_max[g], scores[g][i]);
                }
            }
            /* One softmax step for the chunk: its max, the rescale of what came before, its weights. */
            float shift[KEY_TILE] __attribute__((aligned(64))) = {0}, new_max[GROUP];
            for (int g = 0; g < GROUP; g++) {
                const float seen = _mm512_reduce_max_ps(chunk_max[g]);
                new_max[g] = seen > run_max[g] ? seen : run_max[g];
                shift[g] = run_max[g] - new_max[g];
            }
            float rescale[KEY_TILE] __attribute__((aligned(64))); /* every head's at once */
            _mm512_store_ps(rescale, exp_approx16(_mm512_load_ps(shift)));
            uint32_t pairs[GROUP][CHUNK_TILES][KEY_TILE / 2] __attribute__((aligned(32)));
            for (int g = 0; g < GROUP; g++) {
                const __m512 top = _mm512_set1_ps(new_max[g]);
                __m512 total = _mm512_setzero_ps();
                for (int i = 0; i < count; i++) {
                    const int64_t tile = first + i;
                    const int n = len - tile * KEY_TILE < KEY_TILE ? (int)(len - tile * KEY_TILE) : KEY_TILE;
                    const __m512 probs = _mm512_maskz_mov_ps((__mmask16)((1u << n) - 1),
                                                             exp_approx16(_mm512_sub_ps(scores[g][i], top)));
                    total = _mm512_add_ps(total, probs);
                    /* The weights rounded to bf16 in pairs of keys, as PyTorch's CPU flash attention rounds them
                     * for its value matmul (a key past n weighs zero). */
                    _mm256_store_si256((__m256i*)pairs[g][i], (__m256i)_mm512_cvtneps_pbh(probs));
                }
                run_max[g] = new_max[g];
                run_sum[g] = run_sum[g] * rescale[g] + _mm512_reduce_add_ps(total);
            }
            /* The values of each pair of keys interleaved, against the pair's two weights: a dot-product
             * instruction adds both products (the dimensions come out of order; see in_order_lo). A key past n
             * counts as zeros. What came before is rescaled first. */
            __m512 sum[GROUP][CHUNKS];
#pragma GCC unroll 8
            for (int g = 0; g < GROUP; g++)
#pragma GCC unroll 8
                for (int c = 0; c < CHUNKS; c++) sum[g][c] = _mm512_mul_ps(acc[g][c], _mm512_set1_ps(rescale[g]));
            for (int i = 0; i < count; i++) {
                const int64_t tile = first + i;
                const uint16_t* vt = values + TILE_OFFSET(tile);
                const int n = len - tile * KEY_TILE < KEY_TILE ? (int)(len - tile * KEY_TILE) : KEY_TILE;
                const char* ahead = tile + PREFETCH_TILES < tiles ? (const char*)(values + TILE_OFFSET(tile + PREFETCH_TILES)) : 0;
                for (int tp = 0; tp < (n + 1) / 2; tp++) {
                    if (ahead != 0)
                        for (int l = 0; l < VALUE_LINES; l++)
                            _mm_prefetch(ahead + (tp * VALUE_LINES + l) * CACHE_LINE, _MM_HINT_T1);
                    const uint16_t* r0 = vt + 2 * tp * HEAD_DIM;
                    const __mmask32 second = 2 * tp + 1 < n ? 0xffffffffu : 0;
                    __m512i v[CHUNKS];
                    for (int c = 0; c < HEAD_DIM / 32; c++) {
                        const __m512i a = _mm512_loadu_si512((const void*)(r0 + 32 * c));
                        const __m512i b = _mm512_maskz_loadu_epi16(second, r0 + HEAD_DIM + 32 * c);
                        v[2 * c] = _mm512_unpacklo_epi16(a, b);
                        v[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
                    }
#pragma GCC unroll 8
                    for (int g = 0; g < GROUP; g++) {
                        const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pairs[g][i][tp]);
#pragma GCC unroll 8
                        for (int c = 0; c < CHUNKS; c++) sum[g][c] = _mm512_dpbf16_ps(sum[g][c], w, (__m512bh)v[c]);
                    }
                }
            }
#pragma GCC unroll 8
            for (int g = 0; g < GROUP; g++)
#pragma GCC unroll 8
                for (int c = 0; c < CHUNKS; c++) acc[g][c] = sum[g][c];
        }
#undef TILE_OFFSET
        for (int g = 0; g < GROUP; g++) {
            uint16_t* dst = out + (b * q_heads + h * GROUP + g) * HEAD_DIM;
            const __m512 inv = _mm512_set1_ps(1.0f / run_sum[g]);
            for (int c = 0; c < CHUNKS; c += 2) { /* dimensions back in order, rounded to nearest even */
                const __m512 lo = _mm512_mul_ps(acc[g][c], inv), hi = _mm512_mul_ps(acc[g][c + 1], inv);
                _mm256_storeu_si256((__m256i*)(dst + 16 * c),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(lo, in_order_lo, hi)));
                _mm256_storeu_si256((__m256i*)(dst + 16 * c + 16),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(lo, in_order_hi, hi)));
            }
        }
    }
#else
    PAGED_DECODE(uint16_t, bf16_to_float, float_to_bf16)
#endif
}

/* Which key-score path the bfloat16 kernel was built with, for tests and logs: 1 dot-product instructions. */
EXPORT int paged_decode_bf16_dot(void) {
#ifdef BF16_DOT
    return 1;
#else
    return 0;
#endif
}
