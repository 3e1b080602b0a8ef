/* The bfloat16 matmul: linear_f32.c's panels and tile, summed with the CPU's bf16 dot-product instruction (AVX512-BF16), which
 * multiplies pairs of bf16 along k and adds both products to a float32 accumulator. A panel holds NRB columns
 * as [ceil(k / 2)][NRB][2]: per pair of k, two vectors of 16 (column, k pair) elements. Rows accumulate in
 * float32 over k in order, pair by pair, and are rounded to bf16 once (nearest even), so a row's result still
 * does not depend on its batch; or stored in float32 as they are (the head: logits one bf16 step apart, 0.125
 * at 25, are near ties that rounding would make exact). */
#include "linear_bf16.h"

#if defined(__AVX512BF16__)
EXPORT int64_t linear_bf16_panel_width(void) { return NRB; }

/* w: [n, k] bf16 row-major; packed: [ceil(n / NRB), ceil(k / 2), NRB, 2], the columns past n and the k past
 * an odd k zero. */
EXPORT void linear_pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* packed) {
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

/* x: [m, k] bf16, rows x_stride apart; packed: linear_pack_bf16's panels of W [n, k]; bias: [n] float32 or
 * NULL; y: [m, n] contiguous, bf16, or float32 (the sums unrounded) with f32. AMX (linear_amx.c) where
 * linear_amx_init enabled it and k is a whole number of its tiles, else the AVX512-BF16 register tile. */
EXPORT void linear_bf16(const uint16_t* x, int64_t x_stride, int64_t m, int64_t k, const uint16_t* packed, int64_t n,
                 const float* bias, void* y, int64_t f32) {
    const int mode = f32 && m * n >= STREAM_MIN && n % 16 == 0 && (uintptr_t)y % 64 == 0 ? STREAM : (int)f32;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (linear_amx_enabled && k % AMX_K == 0) {
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
#else
EXPORT int64_t linear_bf16_panel_width(void) { return 0; } /* no AVX512-BF16 here: bf16 stays with oneDNN */
#endif
