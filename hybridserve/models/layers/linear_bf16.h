/* Shared by the bfloat16 matmul's sources (linear_bf16.c, linear_amx.c) and the bf16 greedy head (greedy_head.c):
 * the bf16 panel layout, a row's pair of k, the tiles' stores; and where AMX is built, its state and path. */
#ifndef HYBRIDSERVE_LINEAR_BF16_H
#define HYBRIDSERVE_LINEAR_BF16_H

#include "linear.h"

#if defined(__AVX512BF16__)
#define NRB 32  /* output columns per bf16 panel: two vectors of 16 float32 accumulators */
#define MRB 12  /* rows per bf16 register tile: 24 accumulators, two weight vectors and a broadcast */

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
static void __attribute__((unused)) store_rows(const float* c0, const float* c1, int rows, const float* bias, void* y, int64_t at,
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX_K 32

/* Whether linear_amx_init got AMX's tiles from Linux (linear_amx.c). */
extern HIDDEN int linear_amx_enabled;

/* linear_bf16 on AMX's tiles (linear_amx.c), where linear_amx_enabled and k is a multiple of AMX_K; mode: 0 bf16
 * outputs, 1 float32, STREAM float32 streamed. */
HIDDEN void linear_bf16_amx(const uint16_t* x, int64_t x_stride, int64_t m, int64_t k, const uint16_t* packed,
                            int64_t n, const float* bias, void* y, int mode);
#endif
#endif

#endif
