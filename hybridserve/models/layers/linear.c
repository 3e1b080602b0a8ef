/* float32 matmuls of the linear layers, y = x W^T + b, for the batch sizes a serving step has (CPU).
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
#include <stdint.h>
#include <string.h>

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

typedef float vf __attribute__((vector_size(VW * sizeof(float)), aligned(sizeof(float))));

int64_t linear_panel_width(void) { return NR; }

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

/* One MR x NR tile (mr <= MR rows): y[r, c] = sum_i x[r, i] * panel[i, c] (+ bias[c]) for the ncols valid. */
static inline __attribute__((always_inline)) void tile(int mr, const float* x, int64_t x_stride,
                                                       const float* panel, int64_t k, const float* bias,
                                                       float* y, int64_t y_stride, int64_t ncols) {
    vf acc[MR][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = (vf){0};
    for (int64_t i = 0; i < k; i++) {
        const vf b0 = *(const vf*)(panel + i * NR);
        const vf b1 = *(const vf*)(panel + i * NR + VW);
        for (int r = 0; r < mr; r++) {
            const float a = x[r * x_stride + i];
            acc[r][0] += a * b0;
            acc[r][1] += a * b1;
        }
    }
    for (int r = 0; r < mr; r++) {
        float* dst = y + r * y_stride;
        if (bias != 0 && ncols == NR) {
            acc[r][0] += *(const vf*)bias;
            acc[r][1] += *(const vf*)(bias + VW);
        }
        if (ncols == NR) { /* a whole panel: two vector stores, not a call to memcpy per row */
            *(vf*)dst = acc[r][0];
            *(vf*)(dst + VW) = acc[r][1];
            continue;
        }
        float out[NR];
        memcpy(out, &acc[r][0], sizeof(vf));
        memcpy(out + VW, &acc[r][1], sizeof(vf));
        for (int64_t c = 0; c < ncols; c++) dst[c] = bias != 0 ? out[c] + bias[c] : out[c];
    }
}

/* The tile for the mr left, each a copy with its loops unrolled for that count. */
static void tile_rows(int mr, const float* x, int64_t x_stride, const float* panel, int64_t k, const float* bias,
                      float* y, int64_t y_stride, int64_t ncols) {
    switch (mr) {
        case 6: tile(6, x, x_stride, panel, k, bias, y, y_stride, ncols); break;
        case 5: tile(5, x, x_stride, panel, k, bias, y, y_stride, ncols); break;
        case 4: tile(4, x, x_stride, panel, k, bias, y, y_stride, ncols); break;
        case 3: tile(3, x, x_stride, panel, k, bias, y, y_stride, ncols); break;
        case 2: tile(2, x, x_stride, panel, k, bias, y, y_stride, ncols); break;
        default: tile(1, x, x_stride, panel, k, bias, y, y_stride, ncols); break;
    }
}

/* x: [m, k], rows x_stride apart; packed: linear_pack_f32's panels of W [n, k]; bias: [n] or NULL;
 * y: [m, n] contiguous. */
void linear_f32(const float* x, int64_t x_stride, int64_t m, int64_t k, const float* packed, int64_t n,
                const float* bias, float* y) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel if (m * n * k >= PARALLEL_MIN_WORK)
    for (int64_t m0 = 0; m0 < m; m0 += MC) {
        const int64_t m1 = m0 + MC < m ? m0 + MC : m;
        /* static and nowait: a thread keeps the same panels for every chunk, and chunks share no output */
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < panels; p++) {
            const int64_t col = p * NR, ncols = n - col < NR ? n - col : NR;
            for (int64_t r = m0; r < m1; r += MR) {
                const int mr = (int)(m1 - r < MR ? m1 - r : MR);
                tile_rows(mr, x + r * x_stride, x_stride, packed + p * k * NR, k, bias == 0 ? 0 : bias + col,
                          y + r * n + col, n, ncols);
            }
        }
    }
}
