/* Causal prefill attention over the paged cache: a chunk of one request's queries against its cached keys, the
 * blocks read in place: bfloat16 with AVX512-BF16 (on AMX's tiles where there are), and float32 on any CPU. */
#include "paged_attention.h"

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

EXPORT int paged_prefill_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* cache, int64_t num_blocks,
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
EXPORT int paged_prefill_available(void) {
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
 * tokens of one KV head, GROUP query vectors each, SCORE_F32_TILE of them sharing each key vector (linear.h's
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

EXPORT int paged_prefill_f32(const float* q, int64_t q_stride, const float* cache, int64_t num_blocks, const int64_t* table,
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
EXPORT int paged_prefill_f32_available(void) {
#ifdef PREFILL_F32
    return 1;
#else
    return 0;
#endif
}
