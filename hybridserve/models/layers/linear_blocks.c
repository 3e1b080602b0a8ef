/* Packing of GGUF blocks (Q4_1, Q8_0, Q4_0) into the block panels the float32 matmuls read in place
 * (linear_q4_1_f32, linear_q8_0_f32 and their _silu kinds, linear_f32.c's driver). The layout and the tiles that
 * dequantize it: linear_blocks.h. */
#include "linear_blocks.h"

EXPORT int64_t linear_blocks_group_bytes(int64_t kind) { return group_bytes(kind == BLOCK_Q8_0 ? BLOCK_Q8_0 : BLOCK_Q4_1); }

static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | mant << 13; /* inf, NaN */
    else if (exp != 0) bits = sign | (exp + 112) << 23 | mant << 13;
    else if (mant == 0) bits = sign;
    else { /* subnormal: normal in float32 */
        int e = -1;
        uint32_t m = mant;
        do e++, m <<= 1;
        while ((m & 0x400) == 0);
        bits = sign | (uint32_t)(112 - e) << 23 | (m & 0x3ff) << 13;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* blocks: W [n, k] as GGUF blocks of `kind` (0: Q4_1, 1: Q8_0, 2: Q4_0), row after row (k / 32 blocks a row); w:
 * the same W dequantized, float32 [n, k]; packed: [ceil(n / NR), k / 32, linear_blocks_group_bytes(kind)] (k a
 * multiple of 32), the columns past n zero: Q8_0 panels, or for the others Q4_1 ones. Returns how many weights of
 * w the blocks do not give bitwise (0: the packed panels are w's), or -1 for an unknown kind. */
EXPORT int64_t linear_pack_blocks(int64_t kind, const uint8_t* blocks, const float* w, int64_t n, int64_t k,
                           uint8_t* packed) {
    if (kind != BLOCK_Q4_1 && kind != BLOCK_Q8_0 && kind != BLOCK_Q4_0) return -1;
    const int panel = kind == BLOCK_Q8_0 ? BLOCK_Q8_0 : BLOCK_Q4_1;
    const int64_t panels = (n + NR - 1) / NR, groups = k / QK, gb = group_bytes(panel);
    const int64_t at = kind == BLOCK_Q4_1 ? 4 : 2; /* GGUF's block: d (, m) float16, then q */
    const int64_t block = at + (panel == BLOCK_Q4_1 ? QK / 2 : QK);
    const int64_t scales = (panel == BLOCK_Q4_1 ? 2 : 1) * NR;
    int64_t mismatches = 0;
#pragma omp parallel for reduction(+ : mismatches) if (n * k >= PARALLEL_MIN_WORK)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t g = 0; g < groups; g++) {
            uint8_t* dst = packed + (p * groups + g) * gb;
            float dm[2 * NR];
            uint8_t* q = dst + scales * sizeof(float);
            memset(q, 0, gb - scales * sizeof(float));
            for (int64_t c = 0; c < NR; c++) {
                const int64_t row = p * NR + c;
                dm[c] = dm[NR + c] = 0.0f;
                if (row >= n) continue;
                const uint8_t* b = blocks + (row * groups + g) * block;
                const float d = half_to_float((uint16_t)(b[0] | b[1] << 8));
                const float m = kind == BLOCK_Q4_1   ? half_to_float((uint16_t)(b[2] | b[3] << 8))
                                : kind == BLOCK_Q4_0 ? -8.0f * d
                                                     : 0.0f;
                dm[c] = d, dm[NR + c] = m;
                for (int64_t j = 0; j < QK; j++) {
                    float v;
                    if (panel == BLOCK_Q4_1) { /* byte j: element j low, element j + 16 high */
                        const uint8_t nibble = j < QK / 2 ? b[at + j] & 15 : b[at + j - QK / 2] >> 4;
                        v = fmaf(d, (float)nibble, m);
                        q[j * VW + c % VW] |= (uint8_t)(nibble << (c < VW ? 0 : 4));
                    } else {
                        v = d * (float)(int8_t)b[at + j];
                        q[j * NR + c] = b[at + j];
                    }
                    /* equal, or the same bits (a NaN): Q4_0's d (q - 8) is -0 for q = 8 and d < 0, where d q - 8 d
                     * gives +0; a sum of products starting at +0 never tells the two apart */
                    const float want = w[row * k + g * QK + j];
                    mismatches += v != want && memcmp(&v, &want, sizeof v) != 0;
                }
            }
            memcpy(dst, dm, scales * sizeof(float));
        }
    return mismatches;
}
