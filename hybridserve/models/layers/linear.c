/* Matmuls of the linear layers, y = x W^T + b, for the batch sizes a serving step has (CPU): float32 first,
 * bfloat16 (AVX512-BF16 and AMX) below.
 *
 * oneDNN's float32 GEMM on an AVX2 CPU reaches 50-60% of its square-matrix throughput at 8-32 rows and a
 * third of the read bandwidth at one row (the head: 49152 x 576). This kernel is the textbook register tile
 * instead: the weight is packed once at load into panels of NR output columns, each panel [K][NR] contiguous,
 * and a tile of MR rows x NR columns is accumulated in registers over the whole K, one pass over the panel.
 * Threads split the panels, so at small batch every weight byte is read once, by one thread; at large batch
 * the rows go in chunks of MC that stay in the cache while a thread sweeps its panels.
 *
 * Every output element is one accumulator summed over k = 0..K-1 in order: a row's result does not depend on
 * how many rows share the call or where it sits among them (batch invariance by construction).
 *
 * Vectors are GCC's vector extensions, so -march=native picks the width: 16 floats with AVX-512, else 8.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_math.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
#define NR (2 * VW) /* output columns per panel: two vectors */
#define MR 6        /* rows per register tile: 2 x MR accumulators, two weight vectors and a broadcast */
#define MC 96       /* rows per chunk at large batch: MC x K floats of x stay in L2 across a thread's panels */
/* Enough multiply-adds that waking the other threads pays off: at one row, 64 Ki of them read 256 KiB of
 * weights, about 15 us at this class of CPU's bandwidth, against a few us to start and join a team. */
#define PARALLEL_MIN_WORK (1 << 16)
#define PREFETCH_MIN_ROWS 4 /* rows from which a panel's tiles prefetch the next panel (see linear_f32) */
#define PAIR_ROWS 2         /* rows left over that a tile takes over two panels: 2 x 4 accumulators */

typedef float vf __attribute__((vector_size(VW * sizeof(float)), aligned(sizeof(float))));

int64_t linear_panel_width(void) { return NR; }
const char* linear_isa(void) { return BUILT_ISA; }

/* w: [n, k] row-major; packed: [ceil(n / NR), k, NR], the columns past n zero. */
void linear_pack_f32(const float* w, int64_t n, int64_t k, float* packed) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for if (n * k >= PARALLEL_MIN_WORK)
    for (int64_t p = 0; p < panels; p++) {
        float* dst = packed + p * k * NR;
        for (int64_t c = 0; c < NR; c++) {
            const int64_t row = p * NR + c;
            for (int64_t i = 0; i < k; i++) dst[i * NR + c] = row < n ? w[row * k + i] : 0.0f;
        }
    }
}

/* silu(g) u, lane by lane, as fused_ops.c's silu_mul_f32 computes it, bit for bit: g / (1 + exp_approx(-g)) u, the
 * vector exp_approx where there is one (its steps the scalar one's). */
static inline vf silu_times(vf g, vf u) {
#if VW == 16
    const vf e = (vf)exp_approx16((__m512)-g);
#elif defined(__AVX2__)
    const vf e = (vf)exp_approx8((__m256)-g);
#else
    vf e;
    for (int c = 0; c < VW; c++) e[c] = exp_approx(-g[c]);
#endif
    return g / (1.0f + e) * u;
}

/* A gated tile's row: its first ncols of silu(g) u at dst, g and u two vectors each (u plus bias). */
static inline __attribute__((always_inline)) void silu_store(vf g_lo, vf g_hi, vf u_lo, vf u_hi, const float* bias,
                                                             float* dst, int64_t ncols) {
    if (bias != 0) u_lo += *(const vf*)bias, u_hi += *(const vf*)(bias + VW);
    const vf lo = silu_times(g_lo, u_lo), hi = silu_times(g_hi, u_hi);
    if (ncols == NR) {
        *(vf*)dst = lo;
        *(vf*)(dst + VW) = hi;
        return;
    }
    float out[NR];
    memcpy(out, &lo, sizeof(vf));
    memcpy(out + VW, &hi, sizeof(vf));
    memcpy(dst, out, (size_t)ncols * sizeof(float));
}

/* A tile's sums (plus bias) into y: rows r < mr over np panels, the last one's first ncols columns valid. With
 * gate (a matmul gated by SiLU, linear_f32_silu): over an up panel (np 1) y gets silu(g) u, g the row's NR sums of
 * the gate panel at gate (rows NR apart); over a gate panel and its up panel (np 2) the same from the first
 * panel's sums (gate not read). */
static inline __attribute__((always_inline)) void tile_store(int mr, int np, vf acc[MR][4], const float* bias, float* y,
                                                             int64_t y_stride, int64_t ncols, const float* gate) {
    if (gate != 0) {
        for (int r = 0; r < mr; r++) {
            vf g_lo, g_hi;
            if (np == 2) {
                g_lo = acc[r][0], g_hi = acc[r][1];
                if (bias != 0) g_lo += *(const vf*)bias, g_hi += *(const vf*)(bias + VW);
            } else {
                g_lo = *(const vf*)(gate + r * NR), g_hi = *(const vf*)(gate + r * NR + VW);
            }
            silu_store(g_lo, g_hi, acc[r][2 * np - 2], acc[r][2 * np - 1], bias == 0 ? 0 : bias + (np - 1) * NR,
                       y + r * y_stride, ncols);
        }
        return;
    }
    for (int r = 0; r < mr; r++)
        for (int j = 0; j < np; j++) {
            float* dst = y + r * y_stride + j * NR;
            const float* add = bias == 0 ? 0 : bias + j * NR;
            const int64_t valid = j == np - 1 ? ncols : NR;
            vf lo = acc[r][2 * j], hi = acc[r][2 * j + 1];
            if (valid == NR) { /* a whole panel: two vector stores, not a call to memcpy per row */
                if (add != 0) lo += *(const vf*)add, hi += *(const vf*)(add + VW);
                *(vf*)dst = lo;
                *(vf*)(dst + VW) = hi;
                continue;
            }
            float out[NR];
            memcpy(out, &lo, sizeof(vf));
            memcpy(out + VW, &hi, sizeof(vf));
            for (int64_t c = 0; c < valid; c++) dst[c] = add != 0 ? out[c] + add[c] : out[c];
        }
}

/* One tile of mr <= MR rows over np (1, or 2 with mr <= PAIR_ROWS) adjacent panels: y[r, c] = sum_i x[r, i] *
 * panel[i, c] (+ bias[c]) for the panels' columns, the last panel's first ncols of them valid. next: a panel to
 * bring into L2 meanwhile, its row i with row i of this one (NULL: none). */
static inline __attribute__((always_inline)) void tile(int mr, int np, const float* x, int64_t x_stride,
                                                       const float* panel, const float* next, int64_t k,
                                                       const float* bias, float* y, int64_t y_stride,
                                                       int64_t ncols, const float* gate) {
    vf acc[MR][4];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < 2 * np; v++) acc[r][v] = (vf){0};
    for (int64_t i = 0; i < k; i++) {
        if (next != 0)
            for (int line = 0; line < NR * (int)sizeof(float); line += 64)
                __builtin_prefetch((const char*)(next + i * NR) + line, 0, 2);
        vf b[4];
        for (int v = 0; v < 2 * np; v++) b[v] = *(const vf*)(panel + v / 2 * k * NR + i * NR + v % 2 * VW);
        for (int r = 0; r < mr; r++) {
            const float a = x[r * x_stride + i];
            for (int v = 0; v < 2 * np; v++) acc[r][v] += a * b[v];
        }
    }
    tile_store(mr, np, acc, bias, y, y_stride, ncols, gate);
}

/* The tile for the mr rows left over np panels, each a copy with its loops unrolled for those counts. */
static void tile_rows(int mr, int np, const float* x, int64_t x_stride, const float* panel, const float* next,
                      int64_t k, const float* bias, float* y, int64_t y_stride, int64_t ncols, const float* gate) {
#define ROWS(n, p) tile(n, p, x, x_stride, panel, next, k, bias, y, y_stride, ncols, gate)
    if (np == 2) {
        if (mr == 2) ROWS(2, 2);
        else ROWS(1, 2);
        return;
    }
    switch (mr) {
        case 6: ROWS(6, 1); break;
        case 5: ROWS(5, 1); break;
        case 4: ROWS(4, 1); break;
        case 3: ROWS(3, 1); break;
        case 2: ROWS(2, 1); break;
        default: ROWS(1, 1); break;
    }
#undef ROWS
}

/* The columns of W that panel p holds: NR, or fewer in the last panel. */
static inline int64_t panel_cols(int64_t n, int64_t p) { return n - p * NR < NR ? n - p * NR : NR; }

/* One thread's share of a parallel loop's items (a matmul's panel pairs, the greedy head's int8 panels): [front,
 * back) in one word, a cache line to itself. The owner takes its items from the front, in the order a static
 * split gives it; a thread done with its own share takes the others' from the back. So a thread the scheduler
 * preempts (for the frontend, the clients, anything else on these cores) holds up the call by the item it is in,
 * not by the rest of its share, while the other thread waits at the region's end. Without preemption every
 * thread does its own share, and which thread computes an item never changes the item's result. */
typedef struct {
    uint64_t word;
    char pad[64 - sizeof(uint64_t)];
} __attribute__((aligned(64))) share;
#define STACK_SHARES 16 /* shares on the stack; more (row chunks times threads) come from the heap */

static inline uint64_t share_word(int64_t front, int64_t back) { return (uint64_t)front << 32 | (uint64_t)back; }

/* The next item of a share (its owner's: the front; another thread's: the back), or -1 when none is left. */
static inline int64_t take(share* s, int owner) {
    uint64_t word = __atomic_load_n(&s->word, __ATOMIC_RELAXED), next;
    int64_t front, back;
    do {
        front = (int64_t)(word >> 32), back = (int64_t)(word & 0xffffffffu);
        if (front >= back) return -1;
        next = owner ? share_word(front + 1, back) : share_word(front, back - 1);
    } while (!__atomic_compare_exchange_n(&s->word, &word, next, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return owner ? front : back - 1;
}

/* Every item of the `team` shares for thread `self`: its own first, then the others', each in turn. */
#define FOR_EACH_TAKEN(item, shares, team, self)                \
    for (int taken_v = 0; taken_v < (team); taken_v++)          \
        for (int64_t item; (item = take(&(shares)[((self) + taken_v) % (team)], taken_v == 0)) >= 0;)

/* `chunks` times `items` split over `team` shares as a static schedule splits them, contiguous and in order: on
 * the stack (`on_stack`, STACK_SHARES of them) when they fit, else from the heap (shares_free gives them back). */
static inline share* shares_out(share* on_stack, int64_t chunks, int team, int64_t items) {
    const int64_t count = chunks * team;
    share* shares = count <= STACK_SHARES ? on_stack : aligned_alloc(sizeof(share), count * sizeof(share));
    if (shares == 0) abort();
    for (int64_t i = 0; i < count; i++) {
        const int64_t t = i % team;
        shares[i].word = share_word(t * items / team, (t + 1) * items / team);
    }
    return shares;
}

static inline void shares_free(share* shares, const share* on_stack) {
    if (shares != on_stack) free(shares);
}

/* The rows of tile t when `rows` go in `tiles` tiles a row apart in size at most, the larger first (every row
 * kernel here splits its rows so: a tile much smaller than the others keeps too few multiply-adds in flight). */
static inline int tile_share(int64_t rows, int64_t tiles, int64_t t) {
    return (int)(rows / tiles + (t < rows % tiles));
}

/* Weights kept in GGUF's blocks, 32 weights along k a block: Q4_1, d q + m with d and m float16 and q 4-bit
 * (0..15); Q8_0, d q with d float16 and q int8. d q is exact in float32 (11 bits times 4 or 8), so d q + m rounds
 * once, whether fused or not: the float32 weight a GGUF loader computes is fmaf(d, q, m) (d q) bitwise. A block
 * panel holds per group of 32 k its NR columns' d (and m) in float32, then their q: Q4_1 two to a byte (byte j of a
 * k: column j low, column j + VW high), 12 bytes a k for 16 columns where float32 takes 64; Q8_0 a byte each, 18.
 * Tiles dequantize each weight vector as they need it, or from Q4_EXPAND_MIN_ROWS rows each thread expands its
 * panels into float32 ones in its cache and runs the same tiles over them: either way the outputs are linear_f32's
 * over the dequantized weight bitwise, from 19% (28%) of the memory traffic at decode batch sizes. */
#define BLOCK_Q4_1 0
#define BLOCK_Q8_0 1
#define BLOCK_Q4_0 2 /* d (q - 8): packed as Q4_1 with m = -8 d, as d q - 8 d rounds to the exact d (q - 8) */
#define QK 32 /* weights of a GGUF block, along k */
/* Rows from which a thread expands its block panels into float32 ones rather than dequantizing them in each tile:
 * below, the tiles are few and the writes cost more (one row: 5.8 against 8.9 ms for a 30-layer step's matmuls). */
#define Q4_EXPAND_MIN_ROWS 8

typedef int32_t vi __attribute__((vector_size(VW * sizeof(int32_t)), aligned(sizeof(int32_t))));

/* VW bytes, each widened to an int32 lane, as unsigned or signed integers (GCC lowers a vector conversion from
 * bytes to scalar moves). */
static inline __attribute__((always_inline)) vi widen(const uint8_t* q, int is_signed) {
#if defined(__AVX512F__)
    const __m128i b = _mm_loadu_si128((const __m128i*)q);
    return (vi)(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
    const __m128i b = _mm_loadl_epi64((const __m128i*)q);
    return (vi)(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#else
    vi v;
    for (int j = 0; j < VW; j++) v[j] = is_signed ? (int8_t)q[j] : q[j];
    return v;
#endif
}

/* Bytes of a block panel's group of 32 k: the d (and m) vectors, then 32 rows of q. */
static inline int64_t group_bytes(int kind) {
    return kind == BLOCK_Q4_1 ? 2 * NR * (int64_t)sizeof(float) + QK * VW : NR * (int64_t)sizeof(float) + QK * NR;
}

int64_t linear_blocks_group_bytes(int64_t kind) { return group_bytes(kind == BLOCK_Q8_0 ? BLOCK_Q8_0 : BLOCK_Q4_1); }

/* The weights of row i of a group, its columns 0 .. VW - 1 in *lo and VW .. NR - 1 in *hi; q: the group's q. */
static inline __attribute__((always_inline)) void dequantize(int kind, const uint8_t* q, int i, const vf* d,
                                                             const vf* m, vf* lo, vf* hi) {
    if (kind == BLOCK_Q4_1) {
        const vi w = widen(q + i * VW, 0);
        *lo = d[0] * __builtin_convertvector(w & 15, vf) + m[0];
        *hi = d[1] * __builtin_convertvector(w >> 4, vf) + m[1];
    } else {
        *lo = d[0] * __builtin_convertvector(widen(q + i * NR, 1), vf);
        *hi = d[1] * __builtin_convertvector(widen(q + i * NR + VW, 1), vf);
    }
}

/* How far ahead of the group it sums a tile (or an expansion) asks for a block panel's bytes. With the hardware's
 * prefetchers alone a one-row tile waited on memory a third of its time. Alternating with the code before, the
 * 120 matmuls of the default model took 6.4 against 7.2 ms at one row, 7.4 against 8.2 at two, 2-4% less at
 * 8-32 rows (the expansion's reads), the same at 4-6; 6 and 12 KiB ahead measured worse than 9, T1 prefetches
 * (into L2 as well) no better than non-temporal ones. */
#define BLOCK_AHEAD 9216

/* The lines of the group at `group` (gb bytes), BLOCK_AHEAD bytes on, as non-temporal prefetches: a block panel's
 * bytes are read once per call. Past the end of a panel they are the next one this thread reads (its panels are
 * adjacent under the static split; past the last, harmless: a prefetch never faults). */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t* group, int64_t gb) {
    for (int64_t line = 0; line < gb; line += 64) __builtin_prefetch(group + BLOCK_AHEAD + line, 0, 0);
}

/* A group's d vectors and m vectors (NULL for Q8_0), read in place from the panel, and where its q start. (Copied
 * out into arrays, they took a store and a reload per vector and group, 10% of a one-row step's tiles.) */
static inline __attribute__((always_inline)) const uint8_t* group_scales(int kind, const uint8_t* src, const vf** d,
                                                                         const vf** m) {
    *d = (const vf*)src;
    if (kind == BLOCK_Q8_0) {
        *m = 0;
        return src + 2 * sizeof(vf);
    }
    *m = (const vf*)(src + 2 * sizeof(vf));
    return src + 4 * sizeof(vf);
}

static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | mant << 13; /* inf, NaN */
    else if (exp != 0) bits = sign | (exp + 112) << 23 | mant << 13;
    else if (mant == 0) bits = sign;
    else { /* subnormal: normal in float32 */
        int e = -1;
        uint32_t m = mant;
        do e++, m <<= 1;
        while ((m & 0x400) == 0);
        bits = sign | (uint32_t)(112 - e) << 23 | (m & 0x3ff) << 13;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* tile() over block panels (np adjacent, panel_bytes apart), each weight vector dequantized in registers as it is
 * needed: bitwise tile()'s over the float32 panels, without writing them out. */
static inline __attribute__((always_inline)) void tile_blocks(int kind, int mr, int np, const float* x,
                                                              int64_t x_stride, const uint8_t* panel, int64_t k,
                                                              const float* bias, float* y, int64_t y_stride,
                                                              int64_t ncols, const float* gate) {
    const int64_t gb = group_bytes(kind), panel_bytes = k / QK * gb;
    vf acc[MR][4];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < 2 * np; v++) acc[r][v] = (vf){0};
    for (int64_t g = 0; g < k / QK; g++) {
        const vf *d[2], *m[2];
        const uint8_t* q[2];
        for (int j = 0; j < np; j++) {
            q[j] = group_scales(kind, panel + j * panel_bytes + g * gb, &d[j], &m[j]);
            prefetch_ahead(panel + j * panel_bytes + g * gb, gb);
        }
        const float* xg = x + g * QK;
        for (int i = 0; i < QK; i++) {
            vf b[4];
            for (int j = 0; j < np; j++) dequantize(kind, q[j], i, d[j], m[j], b + 2 * j, b + 2 * j + 1);
            for (int r = 0; r < mr; r++) {
                const float a = xg[r * x_stride + i];
                for (int v = 0; v < 2 * np; v++) acc[r][v] += a * b[v];
            }
        }
    }
    tile_store(mr, np, acc, bias, y, y_stride, ncols, gate);
}

/* tile_rows for block panels of one kind, each row count's copy with its loops unrolled. */
#define DEFINE_TILE_ROWS_BLOCKS(NAME, KIND)                                                                     \
    static void NAME(int mr, int np, const float* x, int64_t x_stride, const uint8_t* panel, int64_t k,         \
                     const float* bias, float* y, int64_t y_stride, int64_t ncols, const float* gate) {         \
        if (np == 2) {                                                                                          \
            if (mr == 2) tile_blocks(KIND, 2, 2, x, x_stride, panel, k, bias, y, y_stride, ncols, gate);        \
            else tile_blocks(KIND, 1, 2, x, x_stride, panel, k, bias, y, y_stride, ncols, gate);                \
            return;                                                                                             \
        }                                                                                                       \
        switch (mr) {                                                                                           \
            case 6: tile_blocks(KIND, 6, 1, x, x_stride, panel, k, bias, y, y_stride, ncols, gate); break;      \
            case 5: tile_blocks(KIND, 5, 1, x, x_stride, panel, k, bias, y, y_stride, ncols, gate); break;      \
            case 4: tile_blocks(KIND, 4, 1, x, x_stride, panel, k, bias, y, y_stride, ncols, gate); break;      \
            case 3: tile_blocks(KIND, 3, 1, x, x_stride, panel, k, bias, y, y_stride, ncols, gate); break;      \
            case 2: tile_blocks(KIND, 2, 1, x, x_stride, panel, k, bias, y, y_stride, ncols, gate); break;      \
            default: tile_blocks(KIND, 1, 1, x, x_stride, panel, k, bias, y, y_stride, ncols, gate); break;     \
        }                                                                                                       \
    }
DEFINE_TILE_ROWS_BLOCKS(tile_rows_q4_1, BLOCK_Q4_1)
DEFINE_TILE_ROWS_BLOCKS(tile_rows_q8_0, BLOCK_Q8_0)

/* blocks: W [n, k] as GGUF blocks of `kind` (0: Q4_1, 1: Q8_0, 2: Q4_0), row after row (k / 32 blocks a row); w:
 * the same W dequantized, float32 [n, k]; packed: [ceil(n / NR), k / 32, linear_blocks_group_bytes(kind)] (k a
 * multiple of 32), the columns past n zero: Q8_0 panels, or for the others Q4_1 ones. Returns how many weights of
 * w the blocks do not give bitwise (0: the packed panels are w's), or -1 for an unknown kind. */
int64_t linear_pack_blocks(int64_t kind, const uint8_t* blocks, const float* w, int64_t n, int64_t k,
                           uint8_t* packed) {
    if (kind != BLOCK_Q4_1 && kind != BLOCK_Q8_0 && kind != BLOCK_Q4_0) return -1;
    const int panel = kind == BLOCK_Q8_0 ? BLOCK_Q8_0 : BLOCK_Q4_1;
    const int64_t panels = (n + NR - 1) / NR, groups = k / QK, gb = group_bytes(panel);
    const int64_t at = kind == BLOCK_Q4_1 ? 4 : 2; /* GGUF's block: d (, m) float16, then q */
    const int64_t block = at + (panel == BLOCK_Q4_1 ? QK / 2 : QK);
    const int64_t scales = (panel == BLOCK_Q4_1 ? 2 : 1) * NR;
    int64_t mismatches = 0;
#pragma omp parallel for reduction(+ : mismatches) if (n * k >= PARALLEL_MIN_WORK)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t* dst = packed + (p * groups + g) * gb;
            float dm[2 * NR];
            uint8_t* q = dst + scales * sizeof(float);
            memset(q, 0, gb - scales * sizeof(float));
            for (int64_t c = 0; c < NR; c++) {
                const int64_t row = p * NR + c;
                dm[c] = dm[NR + c] = 0.0f;
                if (row >= n) continue;
                const uint8_t* b = blocks + (row * groups + g) * block;
                const float d = half_to_float((uint16_t)(b[0] | b[1] << 8));
                const float m = kind == BLOCK_Q4_1   ? half_to_float((uint16_t)(b[2] | b[3] << 8))
                                : kind == BLOCK_Q4_0 ? -8.0f * d
                                                     : 0.0f;
                dm[c] = d, dm[NR + c] = m;
                for (int64_t j = 0; j < QK; j++) {
                    float v;
                    if (panel == BLOCK_Q4_1) { /* byte j: element j low, element j + 16 high */
                        const uint8_t nibble = j < QK / 2 ? b[at + j] & 15 : b[at + j - QK / 2] >> 4;
                        v = fmaf(d, (float)nibble, m);
                        q[j * VW + c % VW] |= (uint8_t)(nibble << (c < VW ? 0 : 4));
                    } else {
                        v = d * (float)(int8_t)b[at + j];
                        q[j * NR + c] = b[at + j];
                    }
                    /* equal, or the same bits (a NaN): Q4_0's d (q - 8) is -0 for q = 8 and d < 0, where d q - 8 d
                     * gives +0; a sum of products starting at +0 never tells the two apart */
                    const float want = w[row * k + g * QK + j];
                    mismatches += v != want && memcmp(&v, &want, sizeof v) != 0;
                }
            }
            memcpy(dst, dm, scales * sizeof(float));
        }
    return mismatches;
}

/* Block panels p0 .. p0 + np - 1 expanded into float32 panels, linear_pack_f32's layout, at out. */
static inline __attribute__((always_inline)) void expand_blocks(int kind, const uint8_t* packed, int64_t groups,
                                                                int64_t p0, int64_t np, float* out) {
    const int64_t gb = group_bytes(kind);
    for (int64_t g = 0; g < np * groups; g++) {
        const vf *d, *m;
        const uint8_t* q = group_scales(kind, packed + (p0 * groups + g) * gb, &d, &m);
        prefetch_ahead(packed + (p0 * groups + g) * gb, gb);
        float* dst = out + g * QK * NR;
        for (int i = 0; i < QK; i++) dequantize(kind, q, i, d, m, (vf*)(dst + i * NR), (vf*)(dst + i * NR + VW));
    }
}

/* x: [m, k], rows x_stride apart; y: [m, n] contiguous; bias: [n] or NULL. The weight W [n, k] is either packed
 * (linear_pack_f32's panels) or blocks of `kind` (linear_pack_blocks'). linear_f32, linear_q4_1_f32 and
 * linear_q8_0_f32 below.
 *
 * Threads take the panels two at a time, each its static share of the pairs and then what another thread's share
 * has left (take). Rows go MR to a tile, panel by panel. Below 2 MR rows, one or two rows left over (8 rows: 6 + 2)
 * go over both panels at once: alone on a panel their 2 or 4 chains of multiply-adds, each waiting on the last,
 * left the FMA units half idle (a batch-8 decode step ~7% faster; with more whole tiles per panel, at 32 rows,
 * pairing measured no better). From Q4_EXPAND_MIN_ROWS rows, block panels are expanded pair by pair into a
 * thread's own two float32 panels, once per call.
 *
 * gated (linear_f32_silu and its block kinds): W's panels go in pairs, a gate panel and then the up panel of the
 * same NR columns of a SiLU-gated MLP's intermediate (n of them; LinearKernels.pack_gated's order), and y [m, n]
 * gets silu(gate) up, as fused_ops.c's silu_mul_f32 would from the plain matmul's output, bit for bit. A pair is
 * one thread's: each row tile of the gate panel leaves its sums on the stack for the same rows' tile of the up
 * panel, which stores silu(g) u. No [m, 2n] output is written, read back by the other thread and written again. */
static inline __attribute__((always_inline)) void linear_panels(const float* x, int64_t x_stride, int64_t m,
                                                                int64_t k, const float* packed, const uint8_t* blocks,
                                                                int kind, int64_t n, const float* bias, float* y,
                                                                int gated) {
    const int64_t panels = gated ? 2 * ((n + NR - 1) / NR) : (n + NR - 1) / NR, pairs = (panels + 1) / 2;
    const int64_t panel_bytes = k / QK * group_bytes(kind);
    const int expand = blocks != 0 && m >= Q4_EXPAND_MIN_ROWS;
    /* Expanded panels take every row in one chunk: expanding a pair again per chunk of MC rows cost a prefill
     * more (~2%) than reading x from L3 instead of L2 does. */
    const int64_t chunk = expand ? m : MC, chunks = (m + chunk - 1) / chunk;
    const int team = omp_get_max_threads();
    share on_stack[STACK_SHARES], *shares = shares_out(on_stack, chunks, team, pairs);
#pragma omp parallel if (m * n * k >= PARALLEL_MIN_WORK)
    {
        const int self = omp_get_thread_num();
        float* expanded = expand ? aligned_alloc(64, 2 * k * NR * sizeof(float)) : 0;
        const int fused = blocks != 0 && expanded == 0; /* dequantized in the tiles (or no memory to expand) */
        /* chunk by chunk without waiting: chunks share no output */
        for (int64_t m0 = 0, c = 0; m0 < m; m0 += chunk, c++) {
            const int64_t m1 = m0 + chunk < m ? m0 + chunk : m, rest = (m1 - m0) % MR;
            FOR_EACH_TAKEN(pair, shares + c * team, team, self) {
                const int64_t p0 = 2 * pair, np = p0 + 1 < panels ? 2 : 1;
                const int64_t whole = np == 2 && rest != 0 && rest <= PAIR_ROWS && m1 - m0 < 2 * MR ? m1 - rest : m1;
                if (expanded != 0) expand_blocks(kind, blocks, k / QK, p0, np, expanded);
                const float* base = expanded != 0 ? expanded : packed + p0 * k * NR;
                /* The first row tile of a panel brings in the next one (this thread's next in its own share):
                 * a tile's arithmetic and the next panel's read from memory overlap instead of taking turns. Below
                 * PREFETCH_MIN_ROWS a panel has too little arithmetic to hide a read behind, and the hardware's own
                 * prefetch streams the panels as well (one row: ~3% slower with it). Expanded panels are in the
                 * cache already. */
#define NEXT(p, r) \
    (blocks == 0 && (r) == m0 && (p) + 1 < panels && m1 - m0 >= PREFETCH_MIN_ROWS ? packed + ((p) + 1) * k * NR : 0)
                /* One tile of mr rows from row r over panel p (or, np 2, over p and p + 1), its sums to dst. */
#define PANEL_TILE(mr, np, r, p, dst, dst_stride, ncols, gate)                                                         \
    (fused ? (kind == BLOCK_Q4_1 ? tile_rows_q4_1 : tile_rows_q8_0)(                                                   \
                 mr, np, x + (r) * x_stride, x_stride, blocks + (p) * panel_bytes, k, bias == 0 ? 0 : bias + (p) * NR, \
                 dst, dst_stride, ncols, gate)                                                                         \
           : tile_rows(mr, np, x + (r) * x_stride, x_stride, base + ((p) - p0) * k * NR, NEXT(p, r), k,                \
                       bias == 0 ? 0 : bias + (p) * NR, dst, dst_stride, ncols, gate))
                /* The rows go in as few tiles as MR allows, their sizes a row apart at most: a tile of fewer than 4
                 * rows has too few chains of multiply-adds to keep both FMA units busy, so 32 rows as 6 6 5 5 5 5
                 * take the time of 32, as 6 6 6 6 6 2 took that of 34. */
                const int64_t rows = whole - m0, tiles = (rows + MR - 1) / MR;
                if (gated) { /* tile by tile: the gate panel's sums, then the up panel's tile storing silu(g) u */
                    for (int64_t t = 0, r = m0; t < tiles; t++) {
                        const int mr = tile_share(rows, tiles, t);
                        float gate_sums[MR * NR] __attribute__((aligned(64)));
                        PANEL_TILE(mr, 1, r, p0, gate_sums, NR, NR, 0);
                        PANEL_TILE(mr, 1, r, p0 + 1, y + r * n + pair * NR, n, panel_cols(n, pair), gate_sums);
                        r += mr;
                    }
                } else {
                    for (int64_t p = p0; p < p0 + np; p++)
                        for (int64_t t = 0, r = m0; t < tiles; t++) {
                            const int mr = tile_share(rows, tiles, t);
                            PANEL_TILE(mr, 1, r, p, y + r * n + p * NR, n, panel_cols(n, p), 0);
                            r += mr;
                        }
                }
                if (whole < m1) { /* gated: the rows' gate and up sums in registers together, silu(g) u stored */
                    float* dst = y + whole * n + (gated ? pair * NR : p0 * NR);
                    const int64_t ncols = gated ? panel_cols(n, pair) : panel_cols(n, p0 + 1);
                    PANEL_TILE((int)rest, 2, whole, p0, dst, n, ncols, gated ? dst : 0); /* gate: any non-NULL */
                }
#undef PANEL_TILE
#undef NEXT
            }
        }
        free(expanded);
    }
    shares_free(shares, on_stack);
}

/* The exported matmuls, linear_panels over one weight layout each: W's float32 panels (linear_pack_f32) or block
 * panels of a kind (linear_pack_blocks; bitwise linear_f32's over W dequantized), and with _silu a SiLU-gated MLP's
 * first matmul and activation in one: y [m, n] = silu(x G^T + bg) * (x U^T + bu), W's panels (and bias) a gate panel
 * then the up panel of the same columns in turn (see linear_panels). */
#define DEFINE_LINEAR(NAME, W_T, PACKED, BLOCKS, KIND, GATED)                                                       \
    void NAME(const float* x, int64_t x_stride, int64_t m, int64_t k, const W_T* w, int64_t n, const float* bias, \
              float* y) {                                                                                           \
        linear_panels(x, x_stride, m, k, PACKED, BLOCKS, KIND, n, bias, y, GATED);                                  \
    }
/* the kind is unused without blocks */
DEFINE_LINEAR(linear_f32, float, w, 0, BLOCK_Q4_1, 0)
DEFINE_LINEAR(linear_q4_1_f32, uint8_t, 0, w, BLOCK_Q4_1, 0)
DEFINE_LINEAR(linear_q8_0_f32, uint8_t, 0, w, BLOCK_Q8_0, 0)
DEFINE_LINEAR(linear_f32_silu, float, w, 0, BLOCK_Q4_1, 1)
DEFINE_LINEAR(linear_q4_1_f32_silu, uint8_t, 0, w, BLOCK_Q4_1, 1)
DEFINE_LINEAR(linear_q8_0_f32_silu, uint8_t, 0, w, BLOCK_Q8_0, 1)
#undef DEFINE_LINEAR

/* The greedy head in float32: each row's argmax of x W^T, the first largest of the logits linear_f32 gives (as
 * torch.argmax picks it), with only the few logits that could be the largest computed. The idea of the bf16
 * head below (linear_argmax), on AVX2's integer multiply-adds:
 *
 * W is kept a second time in int8 (per row v a scale s_v = max |w_v| / 127) and each row of x in int16 (scale
 * t, as many bits as k products of 127 leave room for in an int32). vpmaddwd multiplies 16 int16 pairs and adds
 * each pair: two products a lane where an FMA has one, from a quarter of the weight's bytes. Their sums give
 * every logit within a bound: with x = t qx + ex and w = s qw + ew,
 *     x.w - s t qx.qw = x.ew + ex.(s qw),   so   |x.w - approx| <= |x| |ew| + |ex| (|w| + |ew|).
 * A logit whose upper bound is below the best lower bound of its row cannot be the largest, even as float32
 * sums it (their rounding, at most 2 (k + 2) 2^-24 |x| |w|, is in the margin). The rest, the candidates, are
 * summed by linear_f32's own tile over a panel of their columns, so their logits are its logits bitwise.
 * Per call: the bounds (threads split the int8 panels, each weight read once), then per row its candidates.
 * A row with too many candidates (nearly flat logits), or a non-finite x, is reported undecided (-1): the
 * caller computes its logits. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>

#define FQP 16  /* columns per int8 panel: two vectors of eight int32 sums */
#define FQMR 5 /* rows of x per register tile: 10 accumulators, two weight vectors, a broadcast and a product */

int64_t linear_argmax_f32_available(int64_t k) { return k > 0; }

typedef struct {
    float t, norm, err; /* x's scale (NaN: x not finite), |x|, |x - t qx|, the last two rounded up */
} argmax_f32_row;

/* Candidates past which a row's exact logits cost more than its full row: a row with more is undecided. */
static int64_t argmax_f32_most(int64_t n) { return n / 8 > 64 ? n / 8 : 64; }

/* The workspace: per thread and row of x, the lanes of its best lower bound so far; per row, every column's
 * upper bound in float16 rounded up (-inf past n); room for its candidates' columns; x in int16; the rows'
 * argmax_f32_row; per thread a panel of NR candidate columns for the exact logits. */
typedef struct {
    float* lower;         /* [threads][m][8] */
    uint16_t* upper;      /* [m][stride] */
    int32_t* cand;        /* [m][most] */
    argmax_f32_row* rows; /* [m] */
    int16_t* xq;          /* [m][k2 * 2] */
    float* panels;        /* [threads][k][NR] */
    int64_t stride, most;
    int64_t size; /* bytes from base to the end */
} argmax_f32_work;

/* The workspace's parts from base (NULL: only their size). */
static argmax_f32_work argmax_f32_layout(char* base, int64_t m, int64_t n, int64_t k, int64_t threads) {
    argmax_f32_work w;
    int64_t at = 0;
#define PART(field, type, count) w.field = (type*)(uintptr_t)((uintptr_t)base + at), at += (count) * sizeof(type)
    w.stride = (n + FQP - 1) / FQP * FQP, w.most = argmax_f32_most(n);
    PART(panels, float, threads * k * NR);
    PART(lower, float, threads * m * 8);
    PART(upper, uint16_t, m * w.stride);
    PART(cand, int32_t, m * w.most);
    PART(rows, argmax_f32_row, m);
    PART(xq, int16_t, m * 2 * ((k + 1) / 2));
#undef PART
    w.size = at;
    return w;
}

/* Bytes of workspace linear_argmax_f32 needs for m rows, n columns and inner size k. */
int64_t linear_argmax_f32_workspace(int64_t m, int64_t n, int64_t k) {
    return argmax_f32_layout(0, m, n, k, omp_get_max_threads()).size;
}

/* The largest |q| a row of x rounds to: k products with |q w| <= 127 |q| sum in an int32 without overflow. */
static int32_t argmax_f32_xmax(int64_t k2) {
    const int64_t most = (INT32_MAX / 127) / (2 * k2);
    return (int32_t)(most < INT16_MAX ? most : INT16_MAX);
}

/* v [k] rounded to integers of at most qmax (<= INT16_MAX) with one scale (max |v| / qmax, returned; NaN if a
 * value is not finite) into q [k2 * 2], zero past k; *err: |v - scale q|, *norm: |v|, both rounded up. */
static float argmax_f32_quantize(const float* v, int64_t k, int64_t k2, int32_t qmax, int16_t* q, float* err,
                                 float* norm) {
    float amax = 0.0f;
    int finite = 1;
    for (int64_t i = 0; i < k; i++) {
        const float a = fabsf(v[i]);
        if (!(a <= FLT_MAX)) finite = 0;
        else if (a > amax) amax = a;
    }
    const float scale = amax / (float)qmax;
    double e2 = 0.0, n2 = 0.0;
    for (int64_t i = 0; i < 2 * k2; i++) {
        const float x = i < k && finite ? v[i] : 0.0f;
        const float r = scale > 0.0f ? nearbyintf(x / scale) : 0.0f;
        const int32_t qi = r > (float)qmax ? qmax : r < -(float)qmax ? -qmax : (int32_t)r;
        q[i] = (int16_t)qi;
        const double e = (double)x - (double)scale * qi;
        e2 += e * e, n2 += (double)x * x;
    }
    *err = (float)(sqrt(e2) * (1.0 + 1e-6));
    *norm = (float)(sqrt(n2) * (1.0 + 1e-6));
    return finite ? scale : NAN;
}

/* w: [n, k] float32 row-major. q: [ceil(n / FQP), ceil(k / 2), FQP, 2] int8 (the k and rows past w zero); meta:
 * [3, ceil(n / FQP) * FQP] float32: per row its scale, |w - s q| and |w| (both rounded up). Returns 0, or -1 where
 * w holds a non-finite value. */
int64_t linear_argmax_f32_pack(const float* w, int64_t n, int64_t k, int8_t* q, float* meta) {
    const int64_t k2 = (k + 1) / 2, padded = (n + FQP - 1) / FQP * FQP;
    int bad = 0;
#pragma omp parallel for reduction(| : bad) if (n * k >= PARALLEL_MIN_WORK)
    for (int64_t v = 0; v < padded; v++) {
        int16_t row[2 * k2];
        float err = 0.0f, norm = 0.0f, scale = 0.0f;
        if (v < n) {
            scale = argmax_f32_quantize(w + v * k, k, k2, 127, row, &err, &norm);
            bad |= !(scale == scale);
        } else {
            memset(row, 0, sizeof row);
        }
        int8_t* panel = q + (v / FQP) * k2 * FQP * 2;
        for (int64_t i = 0; i < 2 * k2; i++) panel[(i / 2) * FQP * 2 + (v % FQP) * 2 + i % 2] = (int8_t)row[i];
        meta[v] = scale, meta[padded + v] = err, meta[2 * padded + v] = norm;
    }
    return bad ? -1 : 0;
}

/* acc + the pairwise products of a and b (int16, summed a pair a lane), in place: with the intrinsics GCC moves
 * every accumulator to another register and back each step, and spills some. */
static inline __attribute__((always_inline)) __m256i madd_add(__m256i acc, __m256i a, __m256i b) {
    __m256i t;
    __asm__("vpmaddwd %3, %2, %1\n\tvpaddd %1, %0, %0" : "+x"(acc), "=&x"(t) : "x"(a), "x"(b));
    return acc;
}

/* The bounds of rows r0 .. r0 + mr - 1 against one int8 panel (columns col ..): their upper bounds stored,
 * their lower bounds into this thread's best. next: a panel to bring into L2 meanwhile (NULL: none). */
static inline __attribute__((always_inline)) void argmax_f32_tile(int mr, int64_t r0, int64_t m, const int8_t* panel,
                                                                  const int8_t* next, int64_t k, int64_t k2,
                                                                  const float* meta, int64_t padded, int64_t col,
                                                                  int64_t n, const argmax_f32_work* w, int thread) {
    __m256i acc[FQMR][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    const int16_t* xq = w->xq + r0 * 2 * k2;
/* one pair of k, i: the panel's 16 columns widened to int16, times each row's pair of x */
#define STEP(i)                                                                                                 \
    do {                                                                                                        \
        const __m256i b0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(panel + (i) * FQP * 2)));      \
        const __m256i b1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(panel + (i) * FQP * 2 + 16))); \
        for (int r = 0; r < mr; r++) {                                                                          \
            int32_t two;                                                                                        \
            memcpy(&two, xq + r * 2 * k2 + 2 * (i), sizeof two);                                                \
            const __m256i a = _mm256_set1_epi32(two);                                                           \
            acc[r][0] = madd_add(acc[r][0], a, b0);                                                             \
            acc[r][1] = madd_add(acc[r][1], a, b1);                                                             \
        }                                                                                                       \
    } while (0)
    int64_t i = 0;
    /* One or two rows with a panel to bring in: two pairs of k a turn and one prefetch, with no test of i in the
     * loop. At one row that test and the loop's count were most of a turn (the batch-1 head 0.69-0.74 -> 0.56-0.59
     * ms, one request 1.5-5% more tokens/s in-process); from 3 rows the loop below measured the same or faster. */
    if (next != 0 && mr <= 2)
        for (; i + 1 < k2; i += 2) {
            __builtin_prefetch(next + i * FQP * 2, 0, 2); /* a line: two of its rows */
            STEP(i);
            STEP(i + 1);
        }
    for (; i < k2; i++) {
        if (next != 0 && i % 2 == 0) __builtin_prefetch(next + i * FQP * 2, 0, 2);
        STEP(i);
    }
#undef STEP
    const float gamma = 2.0f * (float)(k + 2) * 0x1p-24f, tiny = (float)k * 0x1p-126f;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int h = 0; h < 2; h++) {
        const int64_t c = col + h * 8;
        const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - c < 8 ? n - c : 8)), lanes));
        const __m256 s = _mm256_loadu_ps(meta + c), ew = _mm256_loadu_ps(meta + padded + c);
        const __m256 nw = _mm256_loadu_ps(meta + 2 * padded + c);
        for (int r = 0; r < mr; r++) {
            const argmax_f32_row* row = w->rows + r0 + r;
            if (!(row->t == row->t)) continue; /* x not finite: undecided */
            const __m256 hn = _mm256_set1_ps(row->norm), eh = _mm256_set1_ps(row->err);
            const __m256 approx = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][h]), _mm256_mul_ps(s, _mm256_set1_ps(row->t)));
            const __m256 bound = _mm256_fmadd_ps(hn, ew, _mm256_mul_ps(eh, _mm256_add_ps(nw, ew)));
            __m256 margin = _mm256_mul_ps(_mm256_set1_ps(1e-5f), _mm256_add_ps(_mm256_and_ps(approx, abs_mask), bound));
            margin = _mm256_fmadd_ps(_mm256_set1_ps(gamma), _mm256_mul_ps(hn, nw), margin);
            const __m256 denormals = _mm256_add_ps(_mm256_add_ps(hn, nw), _mm256_set1_ps(1.0f)); /* flushed */
            margin = _mm256_fmadd_ps(_mm256_set1_ps(tiny), denormals, margin);
            const __m256 spread = _mm256_add_ps(bound, margin);
            const __m256 up = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_add_ps(approx, spread), valid);
            _mm_storeu_si128((__m128i*)(w->upper + (r0 + r) * w->stride + c),
                             _mm256_cvtps_ph(up, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC));
            float* lower = w->lower + (thread * m + r0 + r) * 8;
            const __m256 low = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_sub_ps(approx, spread), valid);
            _mm256_storeu_ps(lower, _mm256_max_ps(_mm256_loadu_ps(lower), low));
        }
    }
}

static void argmax_f32_tile_rows(int mr, int64_t r0, int64_t m, const int8_t* panel, const int8_t* next, int64_t k,
                                 int64_t k2, const float* meta, int64_t padded, int64_t col, int64_t n,
                                 const argmax_f32_work* w, int thread) {
    switch (mr) {
#define ROWS(rows) \
    case rows: argmax_f32_tile(rows, r0, m, panel, next, k, k2, meta, padded, col, n, w, thread); break;
        ROWS(5) ROWS(4) ROWS(3) ROWS(2)
#undef ROWS
        default: argmax_f32_tile(1, r0, m, panel, next, k, k2, meta, padded, col, n, w, thread); break;
    }
}

/* The exact logits of row x at the nc (<= NR) columns cand: their weight rows copied into a panel as
 * linear_pack_f32 lays one out and summed by linear_f32's own tile, so bitwise its logits; folded into the
 * running best: the first largest, ties to the lower column. */
static void argmax_f32_exact_best(const float* x, int64_t k, const float* w, const int32_t* cand, int nc,
                                  float* panel, float* best, int64_t* best_col) {
    for (int j = 0; j < NR; j++) {
        const float* row = w + (int64_t)cand[j < nc ? j : 0] * k;
        for (int64_t i = 0; i < k; i++) panel[i * NR + j] = row[i];
    }
    float exact[NR];
    tile(1, 1, x, k, panel, 0, k, 0, exact, NR, NR, 0);
    for (int j = 0; j < nc; j++)
        if (exact[j] > *best || (exact[j] == *best && cand[j] < *best_col)) *best = exact[j], *best_col = cand[j];
}

/* out[r]: the argmax over columns 0 .. n - 1 of x's row r times W (q, meta: linear_argmax_f32_pack's of W's
 * first n or more rows, meta_rows its padded row count; w: W itself, [n, k] row-major), or -1 where undecided.
 * work: linear_argmax_f32_workspace(m, n, k) bytes, 32-byte aligned. Returns the number of rows undecided. */
int64_t linear_argmax_f32(const float* x, int64_t x_stride, int64_t m, int64_t k, const int8_t* q, const float* meta,
                          int64_t meta_rows, const float* w_rows, int64_t n, void* work, int64_t* out) {
    const int64_t k2 = (k + 1) / 2, threads = omp_get_max_threads(), panels = (n + FQP - 1) / FQP;
    const argmax_f32_work w = argmax_f32_layout((char*)work, m, n, k, threads);
    const int32_t qmax = argmax_f32_xmax(k2);
    for (int64_t i = 0; i < threads * m * 8; i++) w.lower[i] = -INFINITY;
    for (int64_t r = 0; r < m; r++) {
        argmax_f32_row* row = w.rows + r;
        row->t = argmax_f32_quantize(x + r * x_stride, k, k2, qmax, w.xq + r * 2 * k2, &row->err, &row->norm);
    }
    const int64_t tiles = (m + FQMR - 1) / FQMR;
    int64_t undecided = 0;
    share on_stack[STACK_SHARES], *shares = shares_out(on_stack, 1, (int)threads, panels);
#pragma omp parallel reduction(+ : undecided)
    {
        const int thread = omp_get_thread_num();
        /* the panels as linear_panels takes its pairs: a thread's own share, then what the others' left; each
         * thread's lower bounds go to its own lanes, whichever panels they came from */
        FOR_EACH_TAKEN(p, shares, (int)threads, thread) {
            /* The first tile brings in the next int8 panel, as linear_f32's do; at every row count here, as at
             * one row it measured faster too (0.80-0.85 -> 0.70 ms for the default model's head). */
            const int8_t* next = p + 1 < panels ? q + (p + 1) * k2 * FQP * 2 : 0;
            for (int64_t t = 0, r = 0; t < tiles; t++) {
                const int mr = tile_share(m, tiles, t);
                argmax_f32_tile_rows(mr, r, m, q + p * k2 * FQP * 2, t == 0 ? next : 0, k, k2, meta, meta_rows,
                                     p * FQP, n, &w, thread);
                r += mr;
            }
        }
#pragma omp barrier /* every bound is in */
        float* panel = w.panels + thread * k * NR;
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < m; r++) {
            if (!(w.rows[r].t == w.rows[r].t)) { /* x not finite */
                out[r] = -1, undecided++;
                continue;
            }
            __m256 lanes = _mm256_set1_ps(-INFINITY);
            for (int64_t t = 0; t < threads; t++) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(w.lower + (t * m + r) * 8));
            float most_low[8];
            _mm256_storeu_ps(most_low, lanes);
            float low = most_low[0];
            for (int j = 1; j < 8; j++) low = most_low[j] > low ? most_low[j] : low;
            const __m256 lower = _mm256_set1_ps(low);
            const uint16_t* upper = w.upper + r * w.stride;
            int32_t* cand = w.cand + r * w.most;
            int64_t count = 0;
            for (int64_t v = 0; v < n && count <= w.most; v += 8) { /* the columns whose upper bound reaches it */
                const __m256 up = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(upper + v)));
                unsigned keep = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(up, lower, _CMP_GE_OQ));
                if (n - v < 8) keep &= (1u << (n - v)) - 1;
                for (; keep != 0; keep &= keep - 1)
                    if (count++ < w.most) cand[count - 1] = (int32_t)(v + __builtin_ctz(keep));
            }
            if (count > w.most) {
                out[r] = -1, undecided++;
                continue;
            }
            const float* row = x + r * x_stride;
            float best = -INFINITY;
            int64_t best_col = -1;
            for (int64_t i = 0; i < count; i += NR)
                argmax_f32_exact_best(row, k, w_rows, cand + i, (int)(count - i < NR ? count - i : NR), panel, &best,
                                      &best_col);
            out[r] = best_col;
            if (best_col < 0) undecided++;
        }
    }
    shares_free(shares, on_stack);
    return undecided;
}
#else
int64_t linear_argmax_f32_available(int64_t k) {
    (void)k;
    return 0; /* no AVX2 with FMA and F16C here */
}
#endif

/* bfloat16: the same panels and tile, summed with the CPU's bf16 dot-product instruction (AVX512-BF16), which
 * multiplies pairs of bf16 along k and adds both products to a float32 accumulator. A panel holds NRB columns
 * as [ceil(k / 2)][NRB][2]: per pair of k, two vectors of 16 (column, k pair) elements. Rows accumulate in
 * float32 over k in order, pair by pair, and are rounded to bf16 once (nearest even), so a row's result still
 * does not depend on its batch; or stored in float32 as they are (the head: logits one bf16 step apart, 0.125
 * at 25, are near ties that rounding would make exact). */
#if defined(__AVX512BF16__)
#include <immintrin.h>

#define NRB 32  /* output columns per bf16 panel: two vectors of 16 float32 accumulators */
#define MRB 12  /* rows per bf16 register tile: 24 accumulators, two weight vectors and a broadcast */

int64_t linear_bf16_panel_width(void) { return NRB; }

/* w: [n, k] bf16 row-major; packed: [ceil(n / NRB), ceil(k / 2), NRB, 2], the columns past n and the k past
 * an odd k zero. */
void linear_pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed) {
    const int64_t panels = (n + NRB - 1) / NRB, pairs = (k + 1) / 2;
#pragma omp parallel for if (n * k >= PARALLEL_MIN_WORK)
    for (int64_t p = 0; p < panels; p++) {
        uint16_t* dst = packed + p * pairs * NRB * 2;
        for (int64_t c = 0; c < NRB; c++) {
            const int64_t row = p * NRB + c;
            for (int64_t i = 0; i < 2 * pairs; i++)
                dst[(i / 2) * NRB * 2 + c * 2 + (i & 1)] = row < n && i < k ? w[row * k + i] : 0;
        }
    }
}

/* x[2i], x[2i + 1] of a row as one 32-bit lane in every position; past an odd k the second is zero (the
 * panel's weight there is zero too, but x's next element could be anything, a NaN included). */
static inline __m512bh pair(const uint16_t* x, int64_t i, int64_t k) {
    uint32_t two;
    if (2 * i + 1 < k)
        memcpy(&two, x + 2 * i, sizeof two);
    else
        two = x[2 * i];
    return (__m512bh)_mm512_set1_epi32((int)two);
}

/* float32 outputs of at least this many elements (4 MiB, past any core's L2) go straight to memory
 * (non-temporal stores): they are read once, later, so writing them through the cache only costs the read of
 * each line before its write and the eviction of the panels and rows in use. The head at 32-512 rows: 13-17%
 * faster, 8-10% with the argmax that reads its logits. */
#define STREAM_MIN (1 << 20)
#define STREAM 2 /* f32 mode: float32 outputs, whole aligned panels streamed */

/* Rows y[0..rows) of a panel's two 16-column halves from the float32 tiles c0, c1 ([16][16] each): + bias,
 * the ncols valid stored at y[at + r * y_stride + c], rounded to bf16 (nearest even) or, with f32, as they
 * are (y float32; with f32 == STREAM, whole panels bypass the cache). */
static void store_rows(const float* c0, const float* c1, int rows, const float* bias, void* y, int64_t at,
                       int64_t y_stride, int64_t ncols, int f32) {
    const __mmask16 m0 = ncols >= 16 ? 0xffff : (__mmask16)((1u << ncols) - 1);
    const __mmask16 m1 = ncols >= 32 ? 0xffff : ncols <= 16 ? 0 : (__mmask16)((1u << (ncols - 16)) - 1);
    const __m512 b0 = bias != 0 ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
    const __m512 b1 = bias != 0 ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(c0 + r * 16), b0);
        const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(c1 + r * 16), b1);
        const int64_t i = at + r * y_stride;
        if (f32 == STREAM && ncols == NRB) { /* y + i is 64-byte aligned: linear_bf16 checked y, n and col */
            _mm512_stream_ps((float*)y + i, lo);
            _mm512_stream_ps((float*)y + i + 16, hi);
        } else if (f32) {
            _mm512_mask_storeu_ps((float*)y + i, m0, lo);
            _mm512_mask_storeu_ps((float*)y + i + 16, m1, hi);
        } else {
            _mm256_mask_storeu_epi16((uint16_t*)y + i, m0, (__m256i)_mm512_cvtneps_pbh(lo));
            _mm256_mask_storeu_epi16((uint16_t*)y + i + 16, m1, (__m256i)_mm512_cvtneps_pbh(hi));
        }
    }
}

/* next: a panel to bring into L2 meanwhile (whole panels fit there, not in L1), a line pair per k pair (NULL:
 * none). */
static inline __attribute__((always_inline)) void tile_bf16(int mr, const uint16_t* x, int64_t x_stride,
                                                            const uint16_t* panel, const uint16_t* next, int64_t k,
                                                            const float* bias, void* y, int64_t at,
                                                            int64_t y_stride, int64_t ncols, int f32) {
    __m512 acc[MRB][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t pairs = (k + 1) / 2;
    for (int64_t i = 0; i < pairs; i++) {
        if (next != 0) {
            _mm_prefetch((const char*)(next + i * NRB * 2), _MM_HINT_T1);
            _mm_prefetch((const char*)(next + i * NRB * 2 + 32), _MM_HINT_T1);
        }
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + i * NRB * 2);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + i * NRB * 2 + 32);
        for (int r = 0; r < mr; r++) {
            const __m512bh a = pair(x + r * x_stride, i, k);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
        }
    }
    float c0[MRB * 16] __attribute__((aligned(64))), c1[MRB * 16] __attribute__((aligned(64)));
    for (int r = 0; r < mr; r++) {
        _mm512_store_ps(c0 + r * 16, acc[r][0]);
        _mm512_store_ps(c1 + r * 16, acc[r][1]);
    }
    store_rows(c0, c1, mr, bias, y, at, y_stride, ncols, f32);
}

static void tile_rows_bf16(int mr, const uint16_t* x, int64_t x_stride, const uint16_t* panel,
                           const uint16_t* next, int64_t k, const float* bias, void* y, int64_t at,
                           int64_t y_stride, int64_t ncols, int f32) {
    switch (mr) {
#define ROWS(n) \
    case n: tile_bf16(n, x, x_stride, panel, next, k, bias, y, at, y_stride, ncols, f32); break;
        ROWS(12) ROWS(11) ROWS(10) ROWS(9) ROWS(8) ROWS(7) ROWS(6) ROWS(5) ROWS(4) ROWS(3) ROWS(2)
#undef ROWS
        default: tile_bf16(1, x, x_stride, panel, next, k, bias, y, at, y_stride, ncols, f32); break;
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
/* AMX: a tile multiply takes 16 rows x 32 k of x against 32 k x 16 columns of W, whose layout, pairs of k
 * per column, is the panel's own: a panel half over 16 pairs is a tile of 16 rows 128 bytes apart. Rows go
 * in blocks of 16, two blocks at a time against the same two weight tiles (tiles 0-3 the sums, 4-5 x, 6-7 W);
 * the rows past the last whole block are copied into a zero-padded block, so no row past m is read. A row's
 * outputs do not depend on the other rows of its tile: each still sums its k in order, 32 a tile. */
#define AMX_K 32
#define AMX_PREFETCH (2 * AMX_K) /* k ahead: a weight tile takes longer from memory than two tile steps */

static int amx_enabled = 0;

/* Linux hands AMX's tile registers to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM). */
int64_t linear_amx_init(void) {
    if (!amx_enabled) amx_enabled = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_enabled;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

static void amx_configure(void) {
    tile_config cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

static void linear_bf16_amx(const uint16_t* x, int64_t x_stride, int64_t m, int64_t k, const uint16_t* packed,
                            int64_t n, const float* bias, void* y, int mode) {
    const int64_t panels = (n + NRB - 1) / NRB, panel_size = k / 2 * NRB * 2;
    const int64_t full = m / 16, blocks = (m + 15) / 16;
    uint16_t* padded = 0;
    if (blocks > full) {
        padded = calloc((size_t)(16 * k), sizeof(uint16_t));
        if (padded == 0) abort();
        for (int64_t r = full * 16; r < m; r++) memcpy(padded + (r - full * 16) * k, x + r * x_stride, k * 2);
    }
    /* One task a (panel, pair of row blocks), panel-major: the threads split the panels, so each weight comes from
     * memory once, and a panel's later pairs find it in L1/L2 (a panel is 32 k-pairs of 64 bytes: 36 KiB at k 576).
     * Pair-major, each thread swept every weight once per pair it took. The tasks go as linear_panels' pairs do. */
    const int64_t pairs = (blocks + 1) / 2;
    const int team = omp_get_max_threads();
    share on_stack[STACK_SHARES], *shares = shares_out(on_stack, 1, team, pairs * panels);
#pragma omp parallel if (m * n * k >= PARALLEL_MIN_WORK)
    {
        float c[4][16 * 16] __attribute__((aligned(64)));
        amx_configure();
        FOR_EACH_TAKEN(task, shares, team, omp_get_thread_num()) {
            const int64_t p = task / pairs, blk = task % pairs * 2;
            const uint16_t* w = packed + p * panel_size;
            const int64_t col = p * NRB, ncols = n - col < NRB ? n - col : NRB;
            const float* b = bias == 0 ? 0 : bias + col;
            const int two = blk + 1 < blocks;
            const uint16_t* x0 = blk < full ? x + blk * 16 * x_stride : padded;
            const uint16_t* x1 = blk + 1 < full ? x0 + 16 * x_stride : padded;
            const int64_t s0 = (blk < full ? x_stride : k) * 2, s1 = (blk + 1 < full ? x_stride : k) * 2;
            _tile_zero(0);
            _tile_zero(1);
            if (two) {
                _tile_zero(2);
                _tile_zero(3);
            }
            for (int64_t kk = 0; kk < k; kk += AMX_K) {
                /* the first pair: the weights two tiles on (past the panel's end: the next panel's); the later
                 * pairs find the panel in the cache */
                if (blk == 0)
                    for (int line = 0; line < AMX_K * NRB * 2 / 64; line++)
                        _mm_prefetch((const char*)(w + (kk + AMX_PREFETCH) * NRB) + line * 64, _MM_HINT_T0);
                _tile_loadd(6, w + kk * NRB, NRB * 4);
                _tile_loadd(7, w + kk * NRB + 32, NRB * 4);
                _tile_loadd(4, x0 + kk, s0);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two) {
                    _tile_loadd(5, x1 + kk, s1);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            const int64_t r0 = blk * 16, rows0 = m - r0 < 16 ? m - r0 : 16;
            store_rows(c[0], c[1], (int)rows0, b, y, r0 * n + col, n, ncols, mode);
            if (two) {
                _tile_stored(2, c[2], 64);
                _tile_stored(3, c[3], 64);
                const int64_t r1 = r0 + 16, rows1 = m - r1 < 16 ? m - r1 : 16;
                store_rows(c[2], c[3], (int)rows1, b, y, r1 * n + col, n, ncols, mode);
            }
        }
        if (mode == STREAM) _mm_sfence();
        _tile_release();
    }
    shares_free(shares, on_stack);
    free(padded);
}
#endif

/* x: [m, k] bf16, rows x_stride apart; packed: linear_pack_bf16's panels of W [n, k]; bias: [n] float32 or
 * NULL; y: [m, n] contiguous, bf16, or float32 (the sums unrounded) with f32. AMX where linear_amx_init
 * enabled it and k is a whole number of its tiles, else the AVX512-BF16 register tile. */
void linear_bf16(const uint16_t* x, int64_t x_stride, int64_t m, int64_t k, const uint16_t* packed, int64_t n,
                 const float* bias, void* y, int64_t f32) {
    const int mode = f32 && m * n >= STREAM_MIN && n % 16 == 0 && (uintptr_t)y % 64 == 0 ? STREAM : (int)f32;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx_enabled && k % AMX_K == 0) {
        linear_bf16_amx(x, x_stride, m, k, packed, n, bias, y, mode);
        return;
    }
#endif
    const int64_t panels = (n + NRB - 1) / NRB, panel_size = (k + 1) / 2 * NRB * 2;
    /* Row chunks of at most MC, as even as they go, and each chunk's row tiles too: 64 rows are six tiles of
     * 10-11, not five of 12 and one of 4 (which reads the panel for a third of the work). */
    const int64_t chunks = (m + MC - 1) / MC;
    const int team = omp_get_max_threads();
    share on_stack[STACK_SHARES], *shares = shares_out(on_stack, chunks, team, panels);
#pragma omp parallel if (m * n * k >= PARALLEL_MIN_WORK)
    {
        const int self = omp_get_thread_num();
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t m0 = m / chunks * c + (c < m % chunks ? c : m % chunks);
            const int64_t m1 = m0 + m / chunks + (c < m % chunks);
            const int64_t tiles = (m1 - m0 + MRB - 1) / MRB;
            /* the panels as linear_panels takes its pairs, chunk by chunk without waiting: chunks share no output */
            FOR_EACH_TAKEN(p, shares + c * team, team, self) {
                const int64_t col = p * NRB, ncols = n - col < NRB ? n - col : NRB;
                /* The first row tile brings in the next panel (this thread's next one in its own share),
                 * which would otherwise come from memory while the next panel's first tile waits for it. */
                const uint16_t* next = p + 1 < panels ? packed + (p + 1) * panel_size : 0;
                for (int64_t t = 0, r = m0; t < tiles; t++) {
                    const int mr = tile_share(m1 - m0, tiles, t);
                    tile_rows_bf16(mr, x + r * x_stride, x_stride, packed + p * panel_size, t == 0 ? next : 0, k,
                                   bias == 0 ? 0 : bias + col, y, r * n + col, n, ncols, mode);
                    r += mr;
                }
            }
        }
        if (mode == STREAM) _mm_sfence(); /* the streamed lines reach memory before the threads join */
    }
    shares_free(shares, on_stack);
}

#if defined(__AVX512VNNI__)
#include <float.h>
#include <math.h>
#include <omp.h>

/* The greedy head: each row's argmax of x W^T (the first largest of the float32 logits linear_bf16 gives, as
 * torch.argmax picks it) with only the few logits that could be the largest computed.
 *
 * W is kept a second time in int8 (per row v a scale s_v = max |w_v| / 127) and each row of x is rounded the
 * same way (scale t). Their integer dot products, four bytes a lane with AVX512-VNNI (twice bf16's products
 * an instruction, half its bytes), give every logit within a bound: with x = t qx + ex and w = s qw + ew,
 *     x.w - s t qx.qw = x.ew + ex.(s qw),   so   |x.w - approx| <= |x| |ew| + |ex| (|w| + |ew|).
 * A logit whose upper bound is below the best lower bound of its row cannot be the largest, even as float32
 * sums it (their rounding, at most 2 (k + 2) 2^-24 |x| |w|, is in the margin); the rest, a few hundred of
 * 49152 on the default model, are summed exactly as the panel kernel sums them: each lane of vdpbf16ps depends
 * only on its own inputs, so 16 candidates' weight pairs side by side in one vector give their logits bitwise.
 * Per call: the bounds (threads split the int8 panels, each weight read once), then per row its candidates.
 * A row with too many candidates (nearly flat logits), or a non-finite x, is reported undecided (-1): the
 * caller computes its logits. */

#define QW 16 /* rows of W per int8 panel: one vector of int32 sums */
#define QMR 12 /* rows of x per int8 register tile: 24 accumulators, two weight vectors and a broadcast */

/* acc + a (unsigned bytes) . b (signed bytes), four a lane, in place: with the intrinsic GCC copies every
 * accumulator in and out of another register each step, and spills some. */
static inline __attribute__((always_inline)) __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* A row of k bf16 values rounded to int8 with one scale (max |v| / 127, returned; NaN if a value is not finite),
 * q[0 .. k4) (zero past k); *err: |v - scale q|, *norm: |v|, both rounded up; *sum: the sum of q. */
static float quantize_row(const uint16_t* v, int64_t k, int64_t k4, int8_t* q, float* err, float* norm, int32_t* sum) {
    float amax = 0.0f;
    int finite = 1;
    for (int64_t i = 0; i < k; i++) {
        const float a = fabsf(bf16_to_float(v[i]));
        if (!(a <= FLT_MAX)) finite = 0;
        else if (a > amax) amax = a;
    }
    const float scale = amax / 127.0f;
    double e2 = 0.0, n2 = 0.0;
    *sum = 0;
    for (int64_t i = 0; i < k4; i++) {
        const float x = i < k ? bf16_to_float(v[i]) : 0.0f;
        const float r = scale > 0.0f ? nearbyintf(x / scale) : 0.0f;
        const int qi = r > 127.0f ? 127 : r < -127.0f ? -127 : (int)r;
        q[i] = (int8_t)qi, *sum += qi;
        const double e = (double)x - (double)scale * qi;
        e2 += e * e, n2 += (double)x * x;
    }
    *err = (float)(sqrt(e2) * (1.0 + 1e-6));
    *norm = (float)(sqrt(n2) * (1.0 + 1e-6));
    return finite ? scale : NAN;
}

/* Whether linear_bf16 sums a head of inner size k on the AVX512-BF16 path, whose order the exact logits
 * follow (the AMX path sums 32 k a tile). */
int64_t linear_argmax_available(int64_t k) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx_enabled && k % AMX_K == 0) return 0;
#endif
    return k > 0;
}

/* w: [n, k] bf16 row-major. q: [ceil(n / 2 QW) * 2, k4 / 4, QW, 4] int8 (whole pairs of panels; k4: k rounded
 * up to 4; the k and rows past w zero); meta: [4, ceil(n / 2 QW) * 2 QW] float32: per row its scale, |w - s q|
 * and |w| (both rounded up) and the sum of its q. Returns 0, or -1 where w holds a non-finite value. */
int64_t linear_argmax_pack(const uint16_t* w, int64_t n, int64_t k, int8_t* q, float* meta) {
    const int64_t k4 = (k + 3) / 4 * 4, padded = (n + 2 * QW - 1) / (2 * QW) * 2 * QW;
    int bad = 0;
#pragma omp parallel for reduction(| : bad) if (n * k >= PARALLEL_MIN_WORK)
    for (int64_t v = 0; v < padded; v++) {
        int8_t row[k4];
        float err = 0.0f, norm = 0.0f, scale = 0.0f;
        int32_t sum = 0;
        if (v < n) {
            scale = quantize_row(w + v * k, k, k4, row, &err, &norm, &sum);
            bad |= !(scale == scale);
        } else {
            memset(row, 0, (size_t)k4);
        }
        int8_t* panel = q + (v / QW) * k4 * QW;
        for (int64_t i = 0; i < k4; i++) panel[(i / 4) * QW * 4 + (v % QW) * 4 + i % 4] = row[i];
        meta[v] = scale, meta[padded + v] = err, meta[2 * padded + v] = norm, meta[3 * padded + v] = (float)sum;
    }
    return bad ? -1 : 0;
}

typedef struct {
    float t, norm, err; /* x's scale (NaN: x not finite), |x|, |x - t qx|, the last two rounded up */
} argmax_row;

/* Candidates past which a row's exact logits cost more than its full row: a row with more is undecided. */
static int64_t argmax_most(int64_t n) { return n / 8 > 64 ? n / 8 : 64; }

/* The workspace: per thread and row of x, the lanes of its best lower bound so far; per row, every column's
 * upper bound in float16 rounded up (-inf past n: half the bytes to write and read back of float32, and still
 * an upper bound), room for its candidates' columns, x in uint8 (qx + 128) and its argmax_row. */
typedef struct {
    float* lower;     /* [threads][m][16] */
    uint16_t* upper;  /* [m][stride] */
    int32_t* cand;    /* [m][most] */
    argmax_row* rows; /* [m] */
    uint8_t* xq;      /* [m][k4] */
    int64_t stride;   /* n rounded up to panel pairs */
    int64_t most;
} argmax_work;

static argmax_work argmax_layout(void* base, int64_t m, int64_t n, int64_t threads) {
    argmax_work w;
    char* p = base;
    w.stride = (n + 2 * QW - 1) / (2 * QW) * 2 * QW, w.most = argmax_most(n);
    w.lower = (float*)p, p += threads * m * 16 * sizeof(float);
    w.upper = (uint16_t*)p, p += m * w.stride * sizeof(uint16_t);
    w.cand = (int32_t*)p, p += m * w.most * sizeof(int32_t);
    w.rows = (argmax_row*)p, p += m * sizeof(argmax_row);
    w.xq = (uint8_t*)p;
    return w;
}

/* Bytes of workspace linear_argmax needs for m rows, n columns and inner size k. */
int64_t linear_argmax_workspace(int64_t m, int64_t n, int64_t k) {
    const int64_t k4 = (k + 3) / 4 * 4, threads = omp_get_max_threads();
    const int64_t stride = (n + 2 * QW - 1) / (2 * QW) * 2 * QW;
    return threads * m * 16 * (int64_t)sizeof(float) + m * stride * (int64_t)sizeof(uint16_t) +
           m * argmax_most(n) * (int64_t)sizeof(int32_t) + m * (int64_t)sizeof(argmax_row) + m * k4;
}

/* Row r of x into w->xq (as qx + 128, for VNNI's unsigned operand) and w->rows[r]. */
static void argmax_quantize(const uint16_t* x, int64_t k, int64_t k4, uint8_t* xq, argmax_row* row) {
    int32_t sum;
    row->t = quantize_row(x, k, k4, (int8_t*)xq, &row->err, &row->norm, &sum);
    for (int64_t i = 0; i < k4; i++) xq[i] = (uint8_t)((int8_t)xq[i] + 128);
}

/* The bounds of rows r0 .. r0 + mr - 1 against one or two int8 panels (columns col ..): their upper bounds
 * stored, their lower bounds into this thread's best. */
static inline __attribute__((always_inline)) void argmax_tile(int mr, int64_t r0, int64_t m, const int8_t* panel,
                                                              const int8_t* next, int halves, int64_t k, int64_t k4,
                                                              const float* meta, int64_t padded, int64_t col,
                                                              int64_t n, const argmax_work* w, int thread) {
    __m512i acc[QMR][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    const uint8_t* xq = w->xq + r0 * k4;
    for (int64_t i = 0; i < k4 / 4; i++) {
        if (next != 0) { /* the next pair of panels into L2, as linear_bf16 does */
            _mm_prefetch((const char*)(next + i * QW * 4), _MM_HINT_T1);
            _mm_prefetch((const char*)(next + k4 * QW + i * QW * 4), _MM_HINT_T1);
        }
        const __m512i b0 = _mm512_loadu_si512(panel + i * QW * 4);
        const __m512i b1 = _mm512_loadu_si512(panel + k4 * QW + i * QW * 4); /* zero past n: q holds whole pairs */
        for (int r = 0; r < mr; r++) {
            int32_t four;
            memcpy(&four, xq + r * k4 + 4 * i, sizeof four);
            const __m512i a = _mm512_set1_epi32(four);
            acc[r][0] = dpbusd(acc[r][0], a, b0);
            acc[r][1] = dpbusd(acc[r][1], a, b1);
        }
    }
    int32_t sums[2][QMR * 16] __attribute__((aligned(64))); /* out of registers: the loop above keeps acc in them */
    for (int r = 0; r < mr; r++) {
        _mm512_store_si512(sums[0] + r * 16, acc[r][0]);
        _mm512_store_si512(sums[1] + r * 16, acc[r][1]);
    }
    const float gamma = 2.0f * (float)(k + 2) * 0x1p-24f, tiny = (float)k * 0x1p-126f;
    for (int h = 0; h < halves; h++) {
        const int64_t c = col + h * QW;
        const __mmask16 valid = first_lanes(n - c);
        const __m512 s = _mm512_loadu_ps(meta + c), ew = _mm512_loadu_ps(meta + padded + c);
        const __m512 nw = _mm512_loadu_ps(meta + 2 * padded + c);
        const __m512i offset = _mm512_slli_epi32(_mm512_cvtps_epi32(_mm512_loadu_ps(meta + 3 * padded + c)), 7);
        for (int r = 0; r < mr; r++) {
            const argmax_row* row = w->rows + r0 + r;
            if (!(row->t == row->t)) continue; /* x not finite: undecided */
            const __m512 hn = _mm512_set1_ps(row->norm), eh = _mm512_set1_ps(row->err);
            const __m512i dot = _mm512_sub_epi32(_mm512_load_si512(sums[h] + r * 16), offset);
            const __m512 approx = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(row->t)));
            const __m512 bound = _mm512_fmadd_ps(hn, ew, _mm512_mul_ps(eh, _mm512_add_ps(nw, ew)));
            __m512 margin = _mm512_mul_ps(_mm512_set1_ps(1e-5f), _mm512_add_ps(_mm512_abs_ps(approx), bound));
            margin = _mm512_fmadd_ps(_mm512_set1_ps(gamma), _mm512_mul_ps(hn, nw), margin);
            const __m512 denormals = _mm512_add_ps(_mm512_add_ps(hn, nw), _mm512_set1_ps(1.0f)); /* flushed */
            margin = _mm512_fmadd_ps(_mm512_set1_ps(tiny), denormals, margin);
            const __m512 spread = _mm512_add_ps(bound, margin);
            const __m512 up = _mm512_mask_add_ps(_mm512_set1_ps(-INFINITY), valid, approx, spread);
            _mm256_store_si256((__m256i*)(w->upper + (r0 + r) * w->stride + c),
                               _mm512_cvt_roundps_ph(up, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC));
            float* lower = w->lower + (thread * m + r0 + r) * 16;
            _mm512_store_ps(lower, _mm512_mask_max_ps(_mm512_load_ps(lower), valid, _mm512_load_ps(lower),
                                                      _mm512_sub_ps(approx, spread)));
        }
    }
}

static void argmax_tile_rows(int mr, int64_t r0, int64_t m, const int8_t* panel, const int8_t* next, int halves,
                             int64_t k, int64_t k4, const float* meta, int64_t padded, int64_t col, int64_t n,
                             const argmax_work* w, int thread) {
    switch (mr) {
#define ROWS(rows) \
    case rows: argmax_tile(rows, r0, m, panel, next, halves, k, k4, meta, padded, col, n, w, thread); break;
        ROWS(12) ROWS(11) ROWS(10) ROWS(9) ROWS(8) ROWS(7) ROWS(6) ROWS(5) ROWS(4) ROWS(3) ROWS(2)
#undef ROWS
        default: argmax_tile(1, r0, m, panel, next, halves, k, k4, meta, padded, col, n, w, thread); break;
    }
}

/* The exact logits of row x at the *nc (<= 16) columns cand, in the panel kernel's order (w: W row-major,
 * each row's pairs read in turn, so 16 rows stream through L1 rather than 16 cache lines a pair), folded into
 * the running best: the first largest, ties to the lower column. *nc back to 0. */
static void argmax_exact_best(const uint16_t* x, int64_t k, const uint16_t* w, const int32_t* cand, int* nc,
                              float* best, int64_t* best_col) {
    const int64_t pairs = (k + 1) / 2;
    const uint16_t* rows[16];
    for (int j = 0; j < 16; j++) rows[j] = w + cand[j < *nc ? j : 0] * k;
    __m512 acc = _mm512_setzero_ps();
    int32_t two[16] __attribute__((aligned(64)));
    if (k % 2 == 0) {
        /* 16 pairs of the 16 rows at a time: a 16 x 16 transpose of 32-bit words gives pair i of every row */
        int64_t i = 0;
        for (; i + 16 <= pairs; i += 16) {
            __m512i t[16], u[16];
            for (int j = 0; j < 16; j++) t[j] = _mm512_loadu_si512(rows[j] + 2 * i);
            for (int j = 0; j < 16; j += 2) {
                u[j] = _mm512_unpacklo_epi32(t[j], t[j + 1]);
                u[j + 1] = _mm512_unpackhi_epi32(t[j], t[j + 1]);
            }
            for (int j = 0; j < 16; j += 4) {
                t[j] = _mm512_unpacklo_epi64(u[j], u[j + 2]);
                t[j + 1] = _mm512_unpackhi_epi64(u[j], u[j + 2]);
                t[j + 2] = _mm512_unpacklo_epi64(u[j + 1], u[j + 3]);
                t[j + 3] = _mm512_unpackhi_epi64(u[j + 1], u[j + 3]);
            }
            for (int j = 0; j < 8; j++) {
                const int a = (j / 4) * 8 + j % 4, b = a + 4;
                u[j] = _mm512_shuffle_i32x4(t[a], t[b], 0x88);     /* 128-bit lanes 0, 2 of each */
                u[j + 8] = _mm512_shuffle_i32x4(t[a], t[b], 0xdd); /* lanes 1, 3 */
            }
            for (int j = 0; j < 4; j++) {
                t[j] = _mm512_shuffle_i32x4(u[j], u[j + 4], 0x88);
                t[j + 4] = _mm512_shuffle_i32x4(u[j + 8], u[j + 12], 0x88);
                t[j + 8] = _mm512_shuffle_i32x4(u[j], u[j + 4], 0xdd);
                t[j + 12] = _mm512_shuffle_i32x4(u[j + 8], u[j + 12], 0xdd);
            }
            /* t[p]: pair i + p of all 16 rows, row j in lane j */
            for (int p = 0; p < 16; p++) acc = _mm512_dpbf16_ps(acc, pair(x, i + p, k), (__m512bh)t[p]);
        }
        int32_t idx[16] __attribute__((aligned(64)));
        for (int j = 0; j < 16; j++) idx[j] = (int32_t)((rows[j] - w) / 2); /* in 32-bit words */
        const __m512i base = _mm512_load_si512(idx);
        for (; i < pairs; i++) {
            const __m512i at = _mm512_add_epi32(base, _mm512_set1_epi32((int)i));
            acc = _mm512_dpbf16_ps(acc, pair(x, i, k), (__m512bh)_mm512_i32gather_epi32(at, (const void*)w, 4));
        }
    } else { /* rows are not word-aligned: each pair from its two halves; the last one's second is zero */
        for (int64_t i = 0; i < pairs; i++) {
            for (int j = 0; j < 16; j++) {
                const uint32_t second = 2 * i + 1 < k ? (uint32_t)rows[j][2 * i + 1] << 16 : 0u;
                two[j] = (int32_t)((uint32_t)rows[j][2 * i] | second);
            }
            acc = _mm512_dpbf16_ps(acc, pair(x, i, k), (__m512bh)_mm512_load_si512(two));
        }
    }
    float exact[16] __attribute__((aligned(64)));
    _mm512_store_ps(exact, acc);
    for (int j = 0; j < *nc; j++)
        if (exact[j] > *best || (exact[j] == *best && cand[j] < *best_col)) *best = exact[j], *best_col = cand[j];
    *nc = 0;
}

/* out[r]: the argmax over columns 0 .. n - 1 of x's row r times W (q, meta: linear_argmax_pack's of W's first
 * n or more rows; w: W itself, [n, k] row-major), or -1 where undecided. work: linear_argmax_workspace(m, n, k)
 * bytes, 64-byte aligned. Returns the number of rows undecided. */
int64_t linear_argmax(const uint16_t* x, int64_t x_stride, int64_t m, int64_t k, const int8_t* q, const float* meta,
                      int64_t meta_rows, const uint16_t* w_rows, int64_t n, void* work, int64_t* out) {
    const int64_t k4 = (k + 3) / 4 * 4, threads = omp_get_max_threads();
    const int64_t panels = (n + QW - 1) / QW, pairs = (panels + 1) / 2;
    const argmax_work w = argmax_layout(work, m, n, threads);
    for (int64_t i = 0; i < threads * m * 16; i++) w.lower[i] = -INFINITY;
    for (int64_t r = 0; r < m; r++) argmax_quantize(x + r * x_stride, k, k4, w.xq + r * k4, w.rows + r);
    const int64_t tiles = (m + QMR - 1) / QMR;
    int64_t undecided = 0;
    share on_stack[STACK_SHARES], *shares = shares_out(on_stack, 1, (int)threads, pairs);
#pragma omp parallel reduction(+ : undecided)
    {
        const int thread = omp_get_thread_num();
        FOR_EACH_TAKEN(p, shares, (int)threads, thread) { /* as linear_argmax_f32's panels */
            const int64_t col = p * 2 * QW;
            const int halves = n - col > QW ? 2 : 1;
            for (int64_t t = 0, r = 0; t < tiles; t++) {
                const int mr = tile_share(m, tiles, t);
                const int8_t* next = t == 0 && p + 1 < pairs ? q + (p + 1) * 2 * k4 * QW : 0;
                argmax_tile_rows(mr, r, m, q + p * 2 * k4 * QW, next, halves, k, k4, meta, meta_rows, col, n, &w,
                                 thread);
                r += mr;
            }
        }
#pragma omp barrier /* every bound is in */
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < m; r++) {
            if (!(w.rows[r].t == w.rows[r].t)) { /* x not finite */
                out[r] = -1, undecided++;
                continue;
            }
            __m512 lanes = _mm512_set1_ps(-INFINITY);
            for (int64_t t = 0; t < threads; t++)
                lanes = _mm512_max_ps(lanes, _mm512_load_ps(w.lower + (t * m + r) * 16));
            const __m512 lower = _mm512_set1_ps(_mm512_reduce_max_ps(lanes));
            const uint16_t* upper = w.upper + r * w.stride;
            int32_t* cand = w.cand + r * w.most;
            int64_t count = 0;
            for (int64_t v = 0; v < n && count <= w.most; v += 16) { /* the columns whose upper bound reaches it */
                const __m512 up = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(upper + v)));
                for (unsigned keep = _mm512_mask_cmp_ps_mask(first_lanes(n - v), up, lower, _CMP_GE_OQ); keep != 0;
                     keep &= keep - 1)
                    if (count++ < w.most) cand[count - 1] = (int32_t)(v + __builtin_ctz(keep));
            }
            if (count > w.most) {
                out[r] = -1, undecided++;
                continue;
            }
            const uint16_t* row = x + r * x_stride;
            float best = -INFINITY;
            int64_t best_col = -1;
            for (int64_t i = 0; i < count; i += 16) {
                int nc = (int)(count - i < 16 ? count - i : 16);
                argmax_exact_best(row, k, w_rows, cand + i, &nc, &best, &best_col);
            }
            out[r] = best_col;
            if (best_col < 0) undecided++;
        }
    }
    shares_free(shares, on_stack);
    return undecided;
}
#else
int64_t linear_argmax_available(int64_t k) {
    (void)k;
    return 0; /* no AVX512-VNNI here */
}
#endif
#else
int64_t linear_bf16_panel_width(void) { return 0; } /* no AVX512-BF16 here: bf16 stays with oneDNN */
int64_t linear_argmax_available(int64_t k) {
    (void)k;
    return 0;
}
#endif

#if !(defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__))
int64_t linear_amx_init(void) { return 0; } /* no AMX here (or no AVX512-BF16, which the AMX path builds on) */
#endif
