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

#define DEFINE_PAGED_DECODE(NAME, T, LOAD, STORE)                                                            \
    void NAME(const T* q, int64_t q_stride, const T* cache, int64_t num_blocks, const int64_t* tables,       \
              int64_t table_stride, const int64_t* lens, T* out, int64_t batch, int64_t q_heads,             \
              int64_t kv_heads, float scale) {                                                               \
        const int64_t head_stride = num_blocks * BLOCK_SIZE * HEAD_DIM;                                      \
        _Pragma("omp parallel for schedule(dynamic, 1)") for (int64_t item = 0; item < batch * kv_heads;     \
                                                              item++) {                                      \
            const int64_t b = item / kv_heads, h = item % kv_heads, len = lens[b];                           \
            float acc[GROUP][HEAD_DIM], p[GROUP][BLOCK_SIZE] __attribute__((aligned(32)));                   \
            float run_max[GROUP], run_sum[GROUP];                                                            \
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
                float rescale[GROUP];                                                                        \
                BLOCK_SCORES(kb, n, next_k, next_v)                                                          \
                BLOCK_WEIGHTS(n, rescale)                                                                    \
                for (int g = 0; g < GROUP; g++) VALUE_SUMS(vb, n, g, rescale[g])                             \
            }                                                                                                \
            for (int g = 0; g < GROUP; g++) {                                                                \
                T* dst = out + (b * q_heads + h * GROUP + g) * HEAD_DIM;                                     \
                const float inv = 1.0f / run_sum[g];                                                         \
                for (int d = 0; d < HEAD_DIM; d++) dst[d] = STORE(acc[g][d] * inv);                          \
            }                                                                                                \
        }                                                                                                    \
    }

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
#define DEFINE_ROPE_WRITE_KV(NAME, T, ROTATE_HEAD)                                                           \
    void NAME(T* qkv, int64_t tokens, int64_t token_stride, int64_t q_heads, int64_t kv_heads, const T* cos, \
              const T* sin, T* cache, int64_t num_blocks, const int64_t* slots) {                            \
        const int64_t head_stride = num_blocks * BLOCK_SIZE * HEAD_DIM;                                      \
        _Pragma("omp parallel if (tokens >= 32)") {                                                          \
            _Pragma("omp for schedule(static) nowait") for (int64_t t = 0; t < tokens; t++) {                \
                for (int64_t h = 0; h < 2 * kv_heads; h++) {                                                 \
                    const char* dst = (const char*)(cache + h * head_stride + slots[t] * HEAD_DIM);          \
                    for (int o = 0; o < ROW_BYTES(T); o += CACHE_LINE) __builtin_prefetch(dst + o, 1, 3);    \
                }                                                                                            \
            }                                                                                                \
            _Pragma("omp for schedule(static)") for (int64_t t = 0; t < tokens; t++) {                       \
                T* row = qkv + t * token_stride;                                                             \
                for (int64_t head = 0; head < q_heads + kv_heads; head++)                                    \
                    ROTATE_HEAD(row + head * HEAD_DIM, cos + t * HEAD_DIM, sin + t * HEAD_DIM);              \
                const int64_t slot = slots[t];                                                               \
                for (int64_t h = 0; h < 2 * kv_heads; h++) /* K heads, then V heads */                       \
                    memcpy(cache + h * head_stride + slot * HEAD_DIM, row + (q_heads + h) * HEAD_DIM,        \
                           ROW_BYTES(T));                                                                    \
            }                                                                                                \
        }                                                                                                    \
    }

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

void paged_decode_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* cache, int64_t num_blocks,
                       const int64_t* tables, int64_t table_stride, const int64_t* lens, uint16_t* out,
                       int64_t batch, int64_t q_heads, int64_t kv_heads, float scale) {
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
}
#else
#define LOAD_QUERIES(queries) LOAD_QUERIES_FLOAT(bf16_to_float)
#define BLOCK_SCORES(kb, n, next_k, next_v) BLOCK_SCORES_EACH_KEY(uint16_t, bf16_to_float, kb, n, next_k, next_v)
#define BLOCK_WEIGHTS(n, rescale) BLOCK_WEIGHTS_EACH_KEY(n, rescale)
#define VALUE_SUMS(vb, n, g, rescale) VALUE_SUMS_EACH_ELEMENT(bf16_to_float, vb, n, g, rescale)
DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, bf16_to_float, float_to_bf16)
#undef LOAD_QUERIES
#undef BLOCK_SCORES
#undef BLOCK_WEIGHTS
#undef VALUE_SUMS
#endif

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
DEFINE_PAGED_DECODE(paged_decode_f32, float, identity, identity)
#undef LOAD_QUERIES
#undef BLOCK_SCORES
#undef BLOCK_WEIGHTS
#undef VALUE_SUMS

/* Which key-score path the bfloat16 kernel was built with, for tests and logs: 1 dot-product instructions. */
int paged_decode_bf16_dot(void) {
#ifdef BF16_DOT
    return 1;
#else
    return 0;
#endif
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
DEFINE_ROPE_WRITE_KV(rope_write_kv_bf16, uint16_t, rotate_head_bf16)
DEFINE_ROPE_WRITE_KV(rope_write_kv_f32, float, rotate_head_f32)

/* Both prefill kernels' work items: `item` of row_blocks x kv_heads is PREFILL_ROWS query tokens (rows) of KV
 * head h, GROUP query vectors each; the last rows see the most keys, so they go first and the threads end
 * together. Declares the item's rows, its query vectors (qv[v]: row v / GROUP, head h * GROUP + v % GROUP), its
 * last query position (keys up to it) and each vector's zeroed value sums and online-softmax state. */
#define PREFILL_ROWS 16
#define PREFILL_VECTORS (PREFILL_ROWS * GROUP)
#define PREFILL_ITEM(T)                                                                                      \
    const int64_t i0 = (row_blocks - 1 - item / kv_heads) * PREFILL_ROWS, h = item % kv_heads;              \
    const int rows = n - i0 < PREFILL_ROWS ? (int)(n - i0) : PREFILL_ROWS, nv = rows * GROUP;                \
    const int64_t last = pos0 + i0 + rows - 1;                                                               \
    float acc[PREFILL_VECTORS][HEAD_DIM] __attribute__((aligned(64)));                                       \
    float run_max[PREFILL_VECTORS], run_sum[PREFILL_VECTORS];                                                \
    const T* qv[PREFILL_VECTORS];                                                                            \
    for (int v = 0; v < nv; v++) {                                                                           \
        qv[v] = q + (i0 + v / GROUP) * q_stride + (h * GROUP + v % GROUP) * HEAD_DIM;                        \
        run_max[v] = -INFINITY;                                                                              \
        run_sum[v] = 0.0f;                                                                                   \
        for (int d = 0; d < HEAD_DIM; d++) acc[v][d] = 0.0f;                                                 \
    }

/* Prefill, bfloat16 with AVX512-BF16 and 16-token blocks: a chunk's n queries (positions pos0 .. pos0 + n - 1
 * of one request, `table` its block table) against the request's cached keys up to each query's own position
 * (the step wrote the chunk's keys first, so a chunk after a prefix hit reads the prefix in place too).
 *
 * First every block the chunk sees is unpacked once per KV head: keys transposed into [HEAD_DIM / 2 pairs]
 * [16 keys], so one dot-product instruction scores 16 keys against a pair of a query's dimensions, and values
 * widened to float32. Then a work item is PREFILL_ROWS query tokens of one KV head, GROUP query vectors each,
 * walking the blocks its last query sees, SCORE_TILE queries sharing each key vector. Online softmax and the
 * sums in float32, as in decode. A query's result does not depend on the chunk or the item it falls in: every
 * query walks the same blocks in the same order, so chunked and whole prefills agree bit for bit.
 * Returns 0, or -1 when the unpacked blocks found no memory. */
#if defined(BF16_DOT) && BLOCK_SIZE == 16
#include <stdlib.h>
#define PREFILL 1
#define SCORE_TILE 12 /* query vectors scored together: their sums, a key vector and a broadcast in registers */
#define VECTORS PREFILL_VECTORS

typedef struct { /* past the context: zeros */
    uint32_t keys[HEAD_DIM / 2][BLOCK_SIZE];       /* pairs of dimensions x keys */
    uint16_t values[BLOCK_SIZE / 2][HEAD_DIM][2]; /* pairs of keys x dimensions */
} unpacked_block;

static void unpack_block(const uint16_t* kb, const uint16_t* vb, int nk, unpacked_block* u) {
    for (int t = 0; t < BLOCK_SIZE; t++) {
        for (int i = 0; i < HEAD_DIM / 2; i++) {
            uint32_t two = 0;
            if (t < nk) memcpy(&two, kb + t * HEAD_DIM + 2 * i, sizeof two);
            u->keys[i][t] = two;
        }
        for (int d = 0; d < HEAD_DIM; d++) u->values[t / 2][d][t % 2] = t < nk ? vb[t * HEAD_DIM + d] : 0;
    }
}

/* The raw scores s[r] (lane t: key t) of the item's query vectors v0 .. v0 + nt - 1 (nt <= SCORE_TILE) against
 * one unpacked block. */
static inline void score_block(const uint16_t* const* qv, int v0, int nt, const unpacked_block* u, __m512* s) {
    const uint16_t* tile[SCORE_TILE]; /* past nt: the tile's last vector again */
    for (int r = 0; r < SCORE_TILE; r++) tile[r] = qv[v0 + (r < nt ? r : nt - 1)];
    for (int r = 0; r < SCORE_TILE; r++) s[r] = _mm512_setzero_ps();
    for (int i = 0; i < HEAD_DIM / 2; i++) {
        const __m512bh k = (__m512bh)_mm512_load_si512((const void*)u->keys[i]);
        for (int r = 0; r < SCORE_TILE; r++) {
            uint32_t two;
            memcpy(&two, tile[r] + 2 * i, sizeof two);
            s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)_mm512_set1_epi32((int)two), k);
        }
    }
}

/* The online softmax and value sums of the item's query vectors v0 .. v0 + nt - 1 over one unpacked block, from
 * their raw scores s. */
static inline void attend_block(__m512* s, int v0, int nt, const unpacked_block* u, int64_t start, int nk,
                                int64_t first_pos, float scale, float (*acc)[HEAD_DIM], float* run_max,
                                float* run_sum) {
    /* Every vector's new maximum first, so that their rescales come from one vector exp. */
    float shift[16] __attribute__((aligned(64))) = {0}, block_max[SCORE_TILE];
    int visible[SCORE_TILE];
    for (int r = 0; r < nt; r++) {
        const int v = v0 + r;
        const int64_t seen = first_pos + v / GROUP + 1 - start; /* this query sees the block's keys t < seen */
        visible[r] = seen <= 0 ? 0 : seen < nk ? (int)seen : nk;  /* none: the block is past it */
        if (visible[r] == 0) continue;
        s[r] = _mm512_mul_ps(s[r], _mm512_set1_ps(scale));
        const float seen_max = _mm512_mask_reduce_max_ps((__mmask16)((1u << visible[r]) - 1), s[r]);
        block_max[r] = seen_max > run_max[v] ? seen_max : run_max[v];
        shift[r] = run_max[v] - block_max[r];
    }
    float rescales[16] __attribute__((aligned(64)));
    _mm512_store_ps(rescales, exp_approx16(_mm512_load_ps(shift)));
    for (int r = 0; r < nt; r++) {
        if (visible[r] == 0) continue;
        const int v = v0 + r;
        const float rescale = rescales[r];
        const __mmask16 mask = (__mmask16)((1u << visible[r]) - 1);
        const __m512 probs = _mm512_maskz_mov_ps(mask, exp_approx16(_mm512_sub_ps(s[r], _mm512_set1_ps(block_max[r]))));
        run_max[v] = block_max[r];
        run_sum[v] = run_sum[v] * rescale + _mm512_reduce_add_ps(probs);
        /* Weighted values by dot products over pairs of keys, the weights rounded to bf16 as PyTorch's CPU
         * flash attention rounds them for its value matmul; the sums stay float32. */
        uint32_t pairs[BLOCK_SIZE / 2] __attribute__((aligned(32)));
        _mm256_store_si256((__m256i*)pairs, (__m256i)_mm512_cvtneps_pbh(probs));
        __m512 a[HEAD_DIM / 16];
        const __m512 rs = _mm512_set1_ps(rescale);
        for (int c = 0; c < HEAD_DIM / 16; c++) a[c] = _mm512_mul_ps(_mm512_load_ps(acc[v] + 16 * c), rs);
        for (int tp = 0; tp < (visible[r] + 1) / 2; tp++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pairs[tp]);
            for (int c = 0; c < HEAD_DIM / 16; c++)
                a[c] = _mm512_dpbf16_ps(a[c], w, (__m512bh)_mm512_load_si512((const void*)u->values[tp][16 * c]));
        }
        for (int c = 0; c < HEAD_DIM / 16; c++) _mm512_store_ps(acc[v] + 16 * c, a[c]);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
/* With AMX, a block's scores for all the item's query vectors come from tile multiplies: for each query head of
 * the group, its PREFILL_ROWS tokens (tile 1, 32 dimensions a tile) against the block's keys as unpacked (tile
 * 2: pairs of dimensions x 16 keys, the tile layout itself), 16 x 16 float32 sums (tile 0) stored as the rows
 * of those tokens' vectors. A score does not depend on the other rows of its tile. */
#define PREFILL_AMX 1
static int prefill_amx = -1; /* unknown yet; then whether Linux lets the process use AMX's tiles */

static void prefill_amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed)) cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 3; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    cfg.colsb[3] = BLOCK_SIZE * 2, cfg.rows[3] = 16;     /* a head's weights: tokens x keys, bf16 */
    cfg.colsb[4] = 64, cfg.rows[4] = BLOCK_SIZE / 2;     /* values: pairs of keys x 16 dimensions */
    cfg.colsb[5] = 64, cfg.rows[5] = 16;                 /* their sums: tokens x 16 dimensions */
    _tile_loadconfig(&cfg);
}

/* queries: [GROUP][PREFILL_ROWS][HEAD_DIM], the item's (rows past it zero); raw: [VECTORS][16]. */
static inline void amx_score_block(const uint16_t* queries, const unpacked_block* u, float* raw) {
    for (int g = 0; g < GROUP; g++) {
        _tile_zero(0);
        for (int c = 0; c < HEAD_DIM / 32; c++) {
            _tile_loadd(1, queries + (g * PREFILL_ROWS) * HEAD_DIM + 32 * c, HEAD_DIM * 2);
            _tile_loadd(2, u->keys[16 * c], BLOCK_SIZE * 4);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, raw + g * 16, GROUP * 16 * 4); /* token t's row: vector t * GROUP + g */
    }
}

/* attend_block for all nv of the item's vectors with AMX: the softmax as there, each weight rounded to bf16 as
 * there, then a head's value sums over the block in tile multiplies (weights[g]: its tokens x the block's keys;
 * rows of a token that sees none of the block, or past the item, zero), added to the rescaled sums. */
static inline void amx_attend_block(const float (*raw)[16], int nv, const unpacked_block* u, int64_t start, int nk,
                                    int64_t first_pos, float scale, float (*acc)[HEAD_DIM], float* run_max,
                                    float* run_sum, uint16_t (*weights)[PREFILL_ROWS][BLOCK_SIZE]) {
    float shift[VECTORS + 15] __attribute__((aligned(64))) = {0}, block_max[VECTORS], rescales[VECTORS + 15];
    int visible[VECTORS];
    __m512 s[VECTORS];
    for (int v = 0; v < nv; v++) {
        const int64_t seen = first_pos + v / GROUP + 1 - start; /* this query sees the block's keys t < seen */
        visible[v] = seen <= 0 ? 0 : seen < nk ? (int)seen : nk;  /* none: the block is past it */
        if (visible[v] == 0) continue;
        s[v] = _mm512_mul_ps(_mm512_load_ps(raw[v]), _mm512_set1_ps(scale));
        const float seen_max = _mm512_mask_reduce_max_ps((__mmask16)((1u << visible[v]) - 1), s[v]);
        block_max[v] = seen_max > run_max[v] ? seen_max : run_max[v];
        shift[v] = run_max[v] - block_max[v];
    }
    for (int v = 0; v < nv; v += 16) _mm512_storeu_ps(rescales + v, exp_approx16(_mm512_loadu_ps(shift + v)));
    for (int v = 0; v < nv; v++) {
        uint16_t* w = weights[v % GROUP][v / GROUP];
        if (visible[v] == 0) {
            memset(w, 0, BLOCK_SIZE * 2);
            continue;
        }
        const __mmask16 mask = (__mmask16)((1u << visible[v]) - 1);
        const __m512 probs = _mm512_maskz_mov_ps(mask, exp_approx16(_mm512_sub_ps(s[v], _mm512_set1_ps(block_max[v]))));
        run_max[v] = block_max[v];
        run_sum[v] = run_sum[v] * rescales[v] + _mm512_reduce_add_ps(probs);
        _mm256_storeu_si256((__m256i*)w, (__m256i)_mm512_cvtneps_pbh(probs));
        const __m512 rs = _mm512_set1_ps(rescales[v]);
        for (int c = 0; c < HEAD_DIM / 16; c++) _mm512_store_ps(acc[v] + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc[v] + 16 * c), rs));
    }
    float sums[PREFILL_ROWS][HEAD_DIM] __attribute__((aligned(64)));
    for (int g = 0; g < GROUP; g++) {
        _tile_loadd(3, weights[g], BLOCK_SIZE * 2);
        for (int c = 0; c < HEAD_DIM / 16; c++) {
            _tile_zero(5);
            _tile_loadd(4, u->values[0][16 * c], HEAD_DIM * 4);
            _tile_dpbf16ps(5, 3, 4);
            _tile_stored(5, sums[0] + 16 * c, HEAD_DIM * 4);
        }
        for (int v = g; v < nv; v += GROUP) {
            if (visible[v] == 0) continue;
            for (int c = 0; c < HEAD_DIM / 16; c++)
                _mm512_store_ps(acc[v] + 16 * c,
                                _mm512_add_ps(_mm512_load_ps(acc[v] + 16 * c), _mm512_load_ps(sums[v / GROUP] + 16 * c)));
        }
    }
}
#endif

int paged_prefill_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* cache, int64_t num_blocks,
                       const int64_t* table, int64_t pos0, int64_t n, uint16_t* out, int64_t q_heads,
                       int64_t kv_heads, float scale) {
    const int64_t head_stride = num_blocks * BLOCK_SIZE * HEAD_DIM, row_blocks = (n + PREFILL_ROWS - 1) / PREFILL_ROWS;
    const int64_t context = pos0 + n, blocks = (context + BLOCK_SIZE - 1) / BLOCK_SIZE;
    unpacked_block* unpacked = aligned_alloc(64, (size_t)(blocks * kv_heads) * sizeof(unpacked_block));
    if (unpacked == 0) return -1;
#ifdef PREFILL_AMX
    if (prefill_amx < 0) prefill_amx = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
    const int amx = prefill_amx;
#endif
#pragma omp parallel
    {
#ifdef PREFILL_AMX
        if (amx) prefill_amx_configure();
#endif
#pragma omp for schedule(static)
        for (int64_t i = 0; i < blocks * kv_heads; i++) {
            const int64_t h = i / blocks, j = i % blocks, start = j * BLOCK_SIZE;
            const int nk = context - start < BLOCK_SIZE ? (int)(context - start) : BLOCK_SIZE;
            const int64_t offset = table[j] * BLOCK_SIZE * HEAD_DIM;
            unpack_block(cache + h * head_stride + offset, cache + (kv_heads + h) * head_stride + offset, nk,
                         unpacked + i);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < row_blocks * kv_heads; item++) {
            PREFILL_ITEM(uint16_t)
#ifdef PREFILL_AMX
            uint16_t queries[GROUP][PREFILL_ROWS][HEAD_DIM] __attribute__((aligned(64)));
            float raw[VECTORS][16] __attribute__((aligned(64)));
            uint16_t weights[GROUP][PREFILL_ROWS][BLOCK_SIZE] __attribute__((aligned(64)));
            if (amx) memset(weights, 0, sizeof weights); /* the rows past the item's stay zero */
            if (amx)
                for (int g = 0; g < GROUP; g++)
                    for (int r = 0; r < PREFILL_ROWS; r++) {
                        if (r < rows)
                            memcpy(queries[g][r], qv[r * GROUP + g], HEAD_DIM * 2);
                        else
                            memset(queries[g][r], 0, HEAD_DIM * 2);
                    }
#endif
            for (int64_t start = 0, j = 0; start <= last; start += BLOCK_SIZE, j++) {
                const int nk = last + 1 - start < BLOCK_SIZE ? (int)(last + 1 - start) : BLOCK_SIZE;
                const unpacked_block* u = unpacked + h * blocks + j;
#ifdef PREFILL_AMX
                if (amx) {
                    amx_score_block(&queries[0][0][0], u, &raw[0][0]);
                    amx_attend_block(raw, nv, u, start, nk, pos0 + i0, scale, acc, run_max, run_sum, weights);
                    continue;
                }
#endif
                for (int v0 = 0; v0 < nv; v0 += SCORE_TILE) {
                    const int nt = nv - v0 < SCORE_TILE ? nv - v0 : SCORE_TILE;
                    __m512 s[SCORE_TILE];
                    score_block(qv, v0, nt, u, s);
                    attend_block(s, v0, nt, u, start, nk, pos0 + i0, scale, acc, run_max, run_sum);
                }
            }
            for (int v = 0; v < nv; v++) {
                uint16_t* dst = out + ((i0 + v / GROUP) * q_heads + h * GROUP + v % GROUP) * HEAD_DIM;
                const float inv = 1.0f / run_sum[v];
                for (int d = 0; d < HEAD_DIM; d++) dst[d] = float_to_bf16(acc[v][d] * inv);
            }
        }
#ifdef PREFILL_AMX
        if (amx) _tile_release();
#endif
    }
    free(unpacked);
    return 0;
}
#endif

/* Whether paged_prefill_bf16 was built (bfloat16 dot products and 16-token blocks): 1 yes. */
int paged_prefill_available(void) {
#ifdef PREFILL
    return 1;
#else
    return 0;
#endif
}

/* Causal prefill attention in float32 over the paged cache, for any CPU (GCC's vector extensions, as wide as the
 * target's registers: 8 floats with AVX2, 16 with AVX-512). The bf16 kernel's plan, in float32 FMAs: every block
 * the chunk sees has its keys transposed once per KV head into [HEAD_DIM][16 keys], so a query's 16 scores against
 * the block are summed over the dimensions in order, one or two vectors; a work item is PREFILL_ROWS query
 * tokens of one KV head, GROUP query vectors each, SCORE_F32_TILE of them sharing each key vector (linear.c's
 * register tile); the tile's online softmax runs its rows side by side, and each block's values are read in place
 * once per tile, every row of it summing them (6-9% faster than a row at a time on a Zen 3, the same bits). Online
 * softmax and the sums in float32, as in decode. A query's result does not depend on the chunk or the item it falls in: every query walks the same
 * blocks in the same order, so chunked and whole prefills agree bit for bit. Returns 0, or -1 when the transposed
 * keys found no memory. */
#if defined(__AVX512F__)
#define FW 16
#define SCORE_F32_TILE 12 /* query vectors scored together: their sums, a key vector and a broadcast */
#else
#define FW 8
#define SCORE_F32_TILE 6 /* 12 accumulators (two vectors of keys each), the two key vectors and a broadcast */
#endif
#if BLOCK_SIZE == 16 && HEAD_DIM % FW == 0
#include <stdlib.h>
#define PREFILL_F32 1
#define KEY_VECTORS (BLOCK_SIZE / FW)

typedef float fvec __attribute__((vector_size(FW * sizeof(float)), aligned(sizeof(float))));
typedef float keys_f32[HEAD_DIM][BLOCK_SIZE]; /* one block's keys, dimensions x keys; past the context: zeros */

#define VALUE_STEP (HEAD_DIM / FW % 2 == 0 ? 2 : 1) /* vectors of dimensions the value sums take at a time */

/* The online softmax step of a tile's first nt query vectors over one block: raw scores s[r] (key t at s[r][t]),
 * the first seen[r] keys visible to row r (0: the block is past it); acc, run_max and run_sum the rows' own; the
 * block's values [BLOCK_SIZE][HEAD_DIM] read in place, each once for the whole tile. Every row's sums take its
 * visible keys in order, as it would alone (a key it does not see adds an exact zero). */
static inline void attend_tile_f32(const float (*s)[BLOCK_SIZE], const int* seen, int nt, const float* values,
                                   float scale, float (*acc)[HEAD_DIM], float* run_max, float* run_sum) {
    /* The rows side by side at each key (their chains of maxima and sums interleave), each row's in key order. */
    float p[SCORE_F32_TILE][BLOCK_SIZE] __attribute__((aligned(64)));
    float block_max[SCORE_F32_TILE], rescale[SCORE_F32_TILE], sum[SCORE_F32_TILE];
    int visible[SCORE_F32_TILE], keys = 0; /* keys: the most any row sees */
    for (int r = 0; r < SCORE_F32_TILE; r++) {
        visible[r] = r < nt ? seen[r] : 0;
        keys = visible[r] > keys ? visible[r] : keys;
        block_max[r] = r < nt ? run_max[r] : 0.0f;
        sum[r] = 0.0f;
        for (int t = 0; t < BLOCK_SIZE; t++) p[r][t] = s[r][t] * scale;
    }
    for (int t = 0; t < BLOCK_SIZE; t++)
        for (int r = 0; r < SCORE_F32_TILE; r++)
            if (t < visible[r]) block_max[r] = p[r][t] > block_max[r] ? p[r][t] : block_max[r];
    for (int r = 0; r < SCORE_F32_TILE; r++) {
        rescale[r] = visible[r] ? exp_approx(run_max[r] - block_max[r]) : 1.0f;
#pragma omp simd /* GCC leaves exp_approx scalar here without being told */
        for (int t = 0; t < BLOCK_SIZE; t++) p[r][t] = exp_approx(p[r][t] - block_max[r]);
        for (int t = visible[r]; t < BLOCK_SIZE; t++) p[r][t] = 0.0f;
    }
    for (int t = 0; t < BLOCK_SIZE; t++)
        for (int r = 0; r < SCORE_F32_TILE; r++) sum[r] += p[r][t];
    for (int r = 0; r < nt; r++) {
        run_max[r] = block_max[r];
        run_sum[r] = run_sum[r] * rescale[r] + sum[r];
    }
    for (int c = 0; c < HEAD_DIM / FW; c += VALUE_STEP) { /* VALUE_STEP vectors of every row, in registers */
        fvec a[SCORE_F32_TILE][VALUE_STEP];
        for (int r = 0; r < SCORE_F32_TILE; r++)
            for (int i = 0; i < VALUE_STEP; i++)
                a[r][i] = r < nt ? *(const fvec*)(acc[r] + FW * (c + i)) * rescale[r] : (fvec){0};
        for (int t = 0; t < keys; t++) {
            fvec x[VALUE_STEP];
            for (int i = 0; i < VALUE_STEP; i++) x[i] = *(const fvec*)(values + t * HEAD_DIM + FW * (c + i));
            for (int r = 0; r < SCORE_F32_TILE; r++)
                for (int i = 0; i < VALUE_STEP; i++) a[r][i] += p[r][t] * x[i];
        }
        for (int r = 0; r < nt; r++)
            for (int i = 0; i < VALUE_STEP; i++) *(fvec*)(acc[r] + FW * (c + i)) = a[r][i];
    }
}

/* The raw scores s[r][t] of the query vectors tile[0 .. SCORE_F32_TILE) against one block's transposed keys. */
static inline void score_block_f32(const float* const* tile, const keys_f32* kt, float (*s)[BLOCK_SIZE]) {
    fvec acc[SCORE_F32_TILE][KEY_VECTORS];
    for (int r = 0; r < SCORE_F32_TILE; r++)
        for (int c = 0; c < KEY_VECTORS; c++) acc[r][c] = (fvec){0};
    for (int d = 0; d < HEAD_DIM; d++) {
        fvec k[KEY_VECTORS];
        for (int c = 0; c < KEY_VECTORS; c++) k[c] = *(const fvec*)((*kt)[d] + FW * c);
        for (int r = 0; r < SCORE_F32_TILE; r++) {
            const float a = tile[r][d];
            for (int c = 0; c < KEY_VECTORS; c++) acc[r][c] += a * k[c];
        }
    }
    for (int r = 0; r < SCORE_F32_TILE; r++)
        for (int c = 0; c < KEY_VECTORS; c++) *(fvec*)(s[r] + FW * c) = acc[r][c];
}

int paged_prefill_f32(const float* q, int64_t q_stride, const float* cache, int64_t num_blocks, const int64_t* table,
                      int64_t pos0, int64_t n, float* out, int64_t q_heads, int64_t kv_heads, float scale) {
    const int64_t head_stride = num_blocks * BLOCK_SIZE * HEAD_DIM;
    const int64_t row_blocks = (n + PREFILL_ROWS - 1) / PREFILL_ROWS;
    const int64_t context = pos0 + n, blocks = (context + BLOCK_SIZE - 1) / BLOCK_SIZE;
    keys_f32* keys = aligned_alloc(64, (size_t)(blocks * kv_heads) * sizeof(keys_f32));
    if (keys == 0) return -1;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < blocks * kv_heads; i++) {
            const int64_t h = i / blocks, j = i % blocks, start = j * BLOCK_SIZE;
            const int nk = context - start < BLOCK_SIZE ? (int)(context - start) : BLOCK_SIZE;
            const float* kb = cache + h * head_stride + table[j] * BLOCK_SIZE * HEAD_DIM;
            for (int d = 0; d < HEAD_DIM; d++)
                for (int t = 0; t < BLOCK_SIZE; t++) keys[i][d][t] = t < nk ? kb[t * HEAD_DIM + d] : 0.0f;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < row_blocks * kv_heads; item++) {
            PREFILL_ITEM(float)
            for (int64_t start = 0, j = 0; start <= last; start += BLOCK_SIZE, j++) {
                const keys_f32* kt = keys + h * blocks + j;
                const float* values = cache + (kv_heads + h) * head_stride + table[j] * BLOCK_SIZE * HEAD_DIM;
                for (int v0 = 0; v0 < nv; v0 += SCORE_F32_TILE) {
                    const int nt = nv - v0 < SCORE_F32_TILE ? nv - v0 : SCORE_F32_TILE;
                    const float* tile[SCORE_F32_TILE]; /* past nt: the tile's last vector again */
                    for (int r = 0; r < SCORE_F32_TILE; r++) tile[r] = qv[v0 + (r < nt ? r : nt - 1)];
                    float s[SCORE_F32_TILE][BLOCK_SIZE] __attribute__((aligned(64)));
                    score_block_f32(tile, kt, s);
                    int seen[SCORE_F32_TILE]; /* keys t < seen[r] of the block, for each row */
                    for (int r = 0; r < nt; r++) {
                        const int64_t n_seen = pos0 + i0 + (v0 + r) / GROUP + 1 - start;
                        seen[r] = n_seen <= 0 ? 0 : (n_seen < BLOCK_SIZE ? (int)n_seen : BLOCK_SIZE);
                    }
                    attend_tile_f32((const float(*)[BLOCK_SIZE])s, seen, nt, values, scale, acc + v0, run_max + v0,
                                    run_sum + v0);
                }
            }
            for (int v = 0; v < nv; v++) {
                float* dst = out + ((i0 + v / GROUP) * q_heads + h * GROUP + v % GROUP) * HEAD_DIM;
                const float inv = 1.0f / run_sum[v];
                for (int d = 0; d < HEAD_DIM; d++) dst[d] = acc[v][d] * inv;
            }
        }
    }
    free(keys);
    return 0;
}
#endif

/* Whether paged_prefill_f32 was built (16-token blocks, a head of whole vectors): 1 yes. */
int paged_prefill_f32_available(void) {
#ifdef PREFILL_F32
    return 1;
#else
    return 0;
#endif
}
