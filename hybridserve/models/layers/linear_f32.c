/* Float32 matmuls of the linear layers, y = x W^T + b, for the batch sizes a serving step has (CPU).
 *
 * oneDNN's float32 GEMM on an AVX2 CPU reaches 50-60% of its square-matrix throughput at 8-32 rows and a
 * third of the read bandwidth at one row (the head: 49152 x 576). This kernel is the textbook register tile
 * instead (linear.h): the weight is packed once at load into panels of NR output columns, each [K][NR]
 * contiguous, and a tile of MR rows x NR columns is accumulated in registers over the whole K, one pass.
 * Threads split the panels, so at small batch every weight byte is read once, by one thread; at large batch
 * the rows go in chunks of MC that stay in the cache while a thread sweeps its panels.
 *
 * This file: the float32 matmuls, over float32 panels (linear_pack_f32) or GGUF block panels (linear_blocks.h,
 * packed by linear_blocks.c), plain or SiLU-gated; one driver, linear_panels, for all six. The register tile and
 * the panels' work-sharing are linear.h's; bfloat16 is linear_bf16.c's (AMX: linear_amx.c), the greedy head
 * greedy_head.c's.
 */
#include "linear.h"
#include "linear_blocks.h"

#define PREFETCH_MIN_ROWS 4 /* rows from which a panel's tiles prefetch the next panel (see linear_f32) */
#define PAIR_ROWS 2         /* rows left over that a tile takes over two panels: 2 x 4 accumulators */

EXPORT int64_t linear_panel_width(void) { return NR; }
EXPORT const char* linear_isa(void) { return BUILT_ISA; }

/* w: [n, k] row-major; packed: [ceil(n / NR), k, NR], the columns past n zero. */
EXPORT void linear_pack_f32(const float* w, int64_t n, int64_t k, float* packed) {
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

DEFINE_TILE_ROWS_BLOCKS(tile_rows_q4_1, BLOCK_Q4_1)
DEFINE_TILE_ROWS_BLOCKS(tile_rows_q8_0, BLOCK_Q8_0)

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
/* The exported matmuls' prototypes (DEFINE_LINEAR below defines them), for native.py's bindings. */
EXPORT void linear_f32(const float* x, int64_t x_stride, int64_t m, int64_t k, const float* w, int64_t n,
                       const float* bias, float* y);
EXPORT void linear_q4_1_f32(const float* x, int64_t x_stride, int64_t m, int64_t k, const uint8_t* w, int64_t n,
                            const float* bias, float* y);
EXPORT void linear_q8_0_f32(const float* x, int64_t x_stride, int64_t m, int64_t k, const uint8_t* w, int64_t n,
                            const float* bias, float* y);
EXPORT void linear_f32_silu(const float* x, int64_t x_stride, int64_t m, int64_t k, const float* w, int64_t n,
                            const float* bias, float* y);
EXPORT void linear_q4_1_f32_silu(const float* x, int64_t x_stride, int64_t m, int64_t k, const uint8_t* w,
                                 int64_t n, const float* bias, float* y);
EXPORT void linear_q8_0_f32_silu(const float* x, int64_t x_stride, int64_t m, int64_t k, const uint8_t* w,
                                 int64_t n, const float* bias, float* y);
/* the kind is unused without blocks */
DEFINE_LINEAR(linear_f32, float, w, 0, BLOCK_Q4_1, 0)
DEFINE_LINEAR(linear_q4_1_f32, uint8_t, 0, w, BLOCK_Q4_1, 0)
DEFINE_LINEAR(linear_q8_0_f32, uint8_t, 0, w, BLOCK_Q8_0, 0)
DEFINE_LINEAR(linear_f32_silu, float, w, 0, BLOCK_Q4_1, 1)
DEFINE_LINEAR(linear_q4_1_f32_silu, uint8_t, 0, w, BLOCK_Q4_1, 1)
DEFINE_LINEAR(linear_q8_0_f32_silu, uint8_t, 0, w, BLOCK_Q8_0, 1)
#undef DEFINE_LINEAR
