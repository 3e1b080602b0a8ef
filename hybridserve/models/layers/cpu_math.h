/* Helpers shared by the CPU kernels: the EXPORT marker of their C API, the ISA level built for, bfloat16 conversion
 * with PyTorch's rounding, and an exp that vectorises. The functions are static inline, so each kernel source
 * compiles its own copy. */
#ifndef HYBRIDSERVE_CPU_MATH_H
#define HYBRIDSERVE_CPU_MATH_H

#include <stdint.h>

/* A kernel library's C API: the functions native.py calls, each marked EXPORT where it is declared or defined. The
 * libraries are built with -fvisibility=hidden, so nothing else is exported, and native.py reads the prototypes of
 * the EXPORT functions from the sources for their ctypes signatures (native.signatures): a prototype after EXPORT
 * is the only place a kernel's signature is written. Its types: int64_t, int, float, double, void, pointers. */
#define EXPORT __attribute__((visibility("default")))
/* Shared between the sources of one library (a function or variable defined in one and used in another), not
 * exported: declared so in the header, other sources reach it directly rather than through the GOT or PLT. */
#define HIDDEN __attribute__((visibility("hidden")))

/* The instruction-set level this library is built for, by native.py's ISA_LEVELS names. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define BUILT_ISA "amx"
#elif defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define BUILT_ISA "avx512_bf16"
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define BUILT_ISA "avx512"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BUILT_ISA "avx2"
#else
#define BUILT_ISA "baseline"
#endif

typedef union {
    uint32_t u;
    float f;
} bits32;

static inline float bf16_to_float(uint16_t x) {
    bits32 b;
    b.u = (uint32_t)x << 16;
    return b.f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as PyTorch does */
    bits32 b;
    b.f = f;
    if ((b.u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN stays NaN */
    return (uint16_t)((b.u + 0x7fffu + ((b.u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }
static inline float identity(float x) { return x; }

/* exp(x) in plain arithmetic, so that loops over it vectorise on any target (a libm call would not).
 * Relative error about 2e-7. x is clamped to [-87, 88]: -inf and anything below give about 1e-38 instead
 * of 0, which is harmless where it is used (it only ever scales sums that are still zero). */
static inline float exp_approx(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float k = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round(x / ln 2) */
    const float r = x - k * 0.693145752f - k * 1.42860677e-6f;      /* x - k ln 2, in two parts */
    const float p =
        1.0f + r * (1.0f + r * (0.5f + r * (1.66666672e-1f + r * (4.16666679e-2f + r * (8.33333377e-3f +
                                                                                          r * 1.38888892e-3f)))));
    bits32 scale;
    scale.u = (uint32_t)((int32_t)k + 127) << 23; /* 2^k */
    return p * scale.f;
}

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>

/* exp_approx on a vector of W bits' float lanes (W: 256 or 512), the same steps (GCC contracts the scalar one into
 * these FMAs), so the same bits; NaN stays NaN. */
#define DEFINE_EXP_APPROX(NAME, W)                                                                             \
    static inline __m##W NAME(__m##W x) {                                                                      \
        x = _mm##W##_min_ps(_mm##W##_set1_ps(88.0f), _mm##W##_max_ps(_mm##W##_set1_ps(-87.0f), x));           \
        const __m##W round = _mm##W##_set1_ps(12582912.0f);                                                    \
        const __m##W k = _mm##W##_sub_ps(_mm##W##_fmadd_ps(x, _mm##W##_set1_ps(1.44269504f), round), round);   \
        const __m##W r = _mm##W##_fnmadd_ps(k, _mm##W##_set1_ps(1.42860677e-6f),                               \
                                            _mm##W##_fnmadd_ps(k, _mm##W##_set1_ps(0.693145752f), x));         \
        static const float coefficients[] = {8.33333377e-3f, 4.16666679e-2f, 1.66666672e-1f, 0.5f, 1.0f, 1.0f}; \
        __m##W p = _mm##W##_set1_ps(1.38888892e-3f);                                                           \
        for (int i = 0; i < 6; i++) p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(coefficients[i]));           \
        const __m##W##i e = _mm##W##_add_epi32(_mm##W##_cvttps_epi32(k), _mm##W##_set1_epi32(127));            \
        return _mm##W##_mul_ps(p, _mm##W##_castsi##W##_ps(_mm##W##_slli_epi32(e, 23)));                        \
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
DEFINE_EXP_APPROX(exp_approx8, 256)
#endif
#if defined(__AVX512F__)
DEFINE_EXP_APPROX(exp_approx16, 512)
#endif

#if defined(__AVX512BF16__)
/* Sixteen bfloat16 values (m: which) widened exactly to float32. */
static inline __m512 load_bf16x16(const uint16_t* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* Sixteen float32 values rounded to bfloat16 exactly as float_to_bf16 rounds them: in one instruction
 * (VCVTNEPS2BF16, nearest even), unless a lane is a denormal, which the instruction flushes to zero, or a NaN,
 * whose sign and payload it keeps; a vector with either (rare) takes float_to_bf16's integer steps. */
static inline __m256i to_bf16x16(__m512 x) {
    if (__builtin_expect(_mm512_fpclass_ps_mask(x, 0xa1 /* quiet NaN, denormal, signalling NaN */) != 0, 0)) {
        const __m512i u = _mm512_castps_si512(x);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
        r = _mm512_mask_mov_epi32(r, _mm512_fpclass_ps_mask(x, 0x81), _mm512_set1_epi32(0x7fc0));
        return _mm512_cvtepi32_epi16(r);
    }
    return (__m256i)_mm512_cvtneps_pbh(x);
}
static inline __m512 round_bf16x16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(x)), 16));
}
static inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1); }
#endif

#endif
