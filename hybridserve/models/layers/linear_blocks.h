/* GGUF block panels (linear_blocks.c packs them, linear_f32.c's driver sums them): the layout, and the tiles that
 * dequantize them in registers or expand them into float32 panels. */
#ifndef HYBRIDSERVE_LINEAR_BLOCKS_H
#define HYBRIDSERVE_LINEAR_BLOCKS_H

#include "linear.h"

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

#endif
