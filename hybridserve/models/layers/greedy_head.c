/* The greedy head: each row's argmax of x W^T, the fused lm_head and argmax of greedy sampling, with only the
 * logits that could be the largest computed, bitwise as the matmuls sum them: float32 with AVX2 (linear_argmax_f32,
 * on linear_f32.c's register tile), bfloat16 with AVX512-VNNI (linear_argmax, on linear_bf16.c's order). */
#include "linear.h"
#include "linear_bf16.h"

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

EXPORT int64_t linear_argmax_f32_available(int64_t k) { return k > 0; }

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
EXPORT int64_t linear_argmax_f32_workspace(int64_t m, int64_t n, int64_t k) {
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
EXPORT int64_t linear_argmax_f32_pack(const float* w, int64_t n, int64_t k, int8_t* q, float* meta) {
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
EXPORT int64_t linear_argmax_f32(const float* x, int64_t x_stride, int64_t m, int64_t k, const int8_t* q, const float* meta,
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
EXPORT int64_t linear_argmax_f32_available(int64_t k) {
    (void)k;
    return 0; /* no AVX2 with FMA and F16C here */
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
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
EXPORT int64_t linear_argmax_available(int64_t k) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (linear_amx_enabled && k % AMX_K == 0) return 0;
#endif
    return k > 0;
}

/* w: [n, k] bf16 row-major. q: [ceil(n / 2 QW) * 2, k4 / 4, QW, 4] int8 (whole pairs of panels; k4: k rounded
 * up to 4; the k and rows past w zero); meta: [4, ceil(n / 2 QW) * 2 QW] float32: per row its scale, |w - s q|
 * and |w| (both rounded up) and the sum of its q. Returns 0, or -1 where w holds a non-finite value. */
EXPORT int64_t linear_argmax_pack(const uint16_t* w, int64_t n, int64_t k, int8_t* q, float* meta) {
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
EXPORT int64_t linear_argmax_workspace(int64_t m, int64_t n, int64_t k) {
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
EXPORT int64_t linear_argmax(const uint16_t* x, int64_t x_stride, int64_t m, int64_t k, const int8_t* q, const float* meta,
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
EXPORT int64_t linear_argmax_available(int64_t k) {
    (void)k;
    return 0; /* no AVX512-BF16 with AVX512-VNNI here */
}
#endif
