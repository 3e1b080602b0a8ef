/* Shared by the sources of the matmul library (native.LIBRARIES["linear"]: linear_f32.c, linear_blocks.c,
 * linear_bf16.c, linear_amx.c, greedy_head.c): the float32 panel layout and its register tile, and the
 * work-sharing of the panels between threads. Everything here is static inline, so each source compiles its own
 * copy, inlined where it is used.
 *
 * The float32 register tile: the weight is packed once at load into panels of NR output columns, each panel
 * [K][NR] contiguous, and a tile of MR rows x NR columns is accumulated in registers over the whole K, one pass
 * over the panel. Every output element is one accumulator summed over k = 0..K-1 in order: a row's result does
 * not depend on how many rows share the call or where it sits among them (batch invariance by construction).
 *
 * Vectors are GCC's vector extensions, so -march=native picks the width: 16 floats with AVX-512, else 8.
 */
#ifndef HYBRIDSERVE_LINEAR_H
#define HYBRIDSERVE_LINEAR_H

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

typedef float vf __attribute__((vector_size(VW * sizeof(float)), aligned(sizeof(float))));

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

#endif
