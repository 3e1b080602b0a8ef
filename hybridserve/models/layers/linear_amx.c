/* The bfloat16 matmul on AMX's tiles: linear_bf16 (linear_bf16.c) takes this path where linear_amx_init got the tiles
 * from Linux and k is a whole number of them. */
#include "linear_bf16.h"

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
/* AMX: a tile multiply takes 16 rows x 32 k of x against 32 k x 16 columns of W, whose layout, pairs of k
 * per column, is the panel's own: a panel half over 16 pairs is a tile of 16 rows 128 bytes apart. Rows go
 * in blocks of 16, two blocks at a time against the same two weight tiles (tiles 0-3 the sums, 4-5 x, 6-7 W);
 * the rows past the last whole block are copied into a zero-padded block, so no row past m is read. A row's
 * outputs do not depend on the other rows of its tile: each still sums its k in order, 32 a tile. */
#define AMX_PREFETCH (2 * AMX_K) /* k ahead: a weight tile takes longer from memory than two tile steps */

int linear_amx_enabled = 0;

/* Linux hands AMX's tile registers to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM). */
EXPORT int64_t linear_amx_init(void) {
    if (!linear_amx_enabled) linear_amx_enabled = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return linear_amx_enabled;
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

void linear_bf16_amx(const uint16_t* x, int64_t x_stride, int64_t m, int64_t k, const uint16_t* packed,
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
#else
EXPORT int64_t linear_amx_init(void) { return 0; } /* no AMX here (or no AVX512-BF16, which the AMX path builds on) */
#endif
