/* Scalar helpers shared by the CPU kernels: bfloat16 conversion with PyTorch's rounding, and an exp that
 * vectorises. Everything is static inline, so each kernel library compiles its own copy. */
#ifndef HYBRIDSERVE_CPU_MATH_H
#define HYBRIDSERVE_CPU_MATH_H

#include <stdint.h>

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

#endif
