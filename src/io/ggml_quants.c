/* SPDX-License-Identifier: MIT */
/* ggml_quants.c: the block-quantised tensor types of ggml (GGUF files) to float32 or to q8_0
 * blocks, written from the layouts described in docs/SEMANTICS.md "GGUF quantised types" and
 * checked against the `gguf` Python package's dequantiser (tests/test_cli_gguf.py). Every value
 * is computed in float32 in the order ggml's CPU dequantiser uses; the products are exact (at
 * most 11 + 8 + 5 significant bits), so only the final `+ m` / `- m` of the types with an offset
 * rounds (once, to nearest even), and the compiler's -ffp-contract=off keeps it a separate add.
 *
 * Block layouts (little-endian float16 `d`, `dmin`/`m`; QK = values per block):
 *   Q4_0  QK 32,  18 B: d, qs[16]               value i: nibble i, d * (q - 8)
 *   Q4_1  QK 32,  20 B: d, m, qs[16]            d * q + m
 *   Q5_0  QK 32,  22 B: d, qh[4], qs[16]        q = nibble i | bit i of qh << 4, d * (q - 16)
 *   Q5_1  QK 32,  24 B: d, m, qh[4], qs[16]     d * q + m
 *   Q8_0  QK 32,  34 B: d, int8 q[32]           d * q
 *   Q2_K  QK 256, 84 B: scales[16], qs[64], d, dmin
 *   Q3_K  QK 256, 110 B: hmask[32], qs[64], scales[12], d
 *   Q4_K  QK 256, 144 B: d, dmin, scales[12], qs[128]
 *   Q5_K  QK 256, 176 B: d, dmin, scales[12], qh[32], qs[128]
 *   Q6_K  QK 256, 210 B: ql[128], qh[64], int8 scales[16], d
 * "Nibble i" of a 32-value block with 16 bytes qs: the low nibble of qs[i] for i < 16, the high
 * nibble of qs[i - 16] for i >= 16. The K-types are detailed at their functions.
 */
#include "io/ggml_quants.h"

#include "base/internal.h"
#include "io/gguf.h"

#include <math.h>
#include <string.h>

void mha__ggml_type_block(uint32_t t, uint64_t *values, uint64_t *bytes) {
    *values = 1;
    *bytes = 0;
    switch (t) {
    case MHA__GGML_F32:
        *bytes = 4;
        break;
    case MHA__GGML_F16:
    case MHA__GGML_BF16:
        *bytes = 2;
        break;
    case MHA__GGML_Q8_0:
        *values = 32, *bytes = 34;
        break;
    case MHA__GGML_Q4_0:
        *values = 32, *bytes = 18;
        break;
    case MHA__GGML_Q4_1:
        *values = 32, *bytes = 20;
        break;
    case MHA__GGML_Q5_0:
        *values = 32, *bytes = 22;
        break;
    case MHA__GGML_Q5_1:
        *values = 32, *bytes = 24;
        break;
    case MHA__GGML_Q2_K:
        *values = 256, *bytes = 84;
        break;
    case MHA__GGML_Q3_K:
        *values = 256, *bytes = 110;
        break;
    case MHA__GGML_Q4_K:
        *values = 256, *bytes = 144;
        break;
    case MHA__GGML_Q5_K:
        *values = 256, *bytes = 176;
        break;
    case MHA__GGML_Q6_K:
        *values = 256, *bytes = 210;
        break;
    default:
        break;
    }
}

static float h16(const unsigned char *p) {
    return mha__f16_to_f32((uint16_t)(p[0] | p[1] << 8));
}

static uint32_t u32le(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The 4-bit (qh NULL) or 5-bit unsigned integers of a 32-value block. */
static void ints32(const unsigned char *qs, const unsigned char *qh, int q[32]) {
    const uint32_t h = qh ? u32le(qh) : 0;
    for (int i = 0; i < 16; i++) {
        q[i] = (qs[i] & 15) | (int)((h >> i) & 1) << 4;
        q[i + 16] = (qs[i] >> 4) | (int)((h >> (i + 16)) & 1) << 4;
    }
}

/* Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: one 32-value block. */
static int block32(uint32_t type, const unsigned char *b, float *y) {
    const float d = h16(b);
    if (!isfinite(d))
        return 0;
    int q[32];
    switch (type) {
    case MHA__GGML_Q8_0:
        for (int i = 0; i < 32; i++)
            y[i] = (float)(int8_t)b[2 + i] * d;
        return 1;
    case MHA__GGML_Q4_0:
    case MHA__GGML_Q5_0: {
        const int off = type == MHA__GGML_Q4_0 ? 8 : 16;
        ints32(type == MHA__GGML_Q4_0 ? b + 2 : b + 6, type == MHA__GGML_Q4_0 ? NULL : b + 2, q);
        for (int i = 0; i < 32; i++)
            y[i] = d * (float)(q[i] - off);
        return 1;
    }
    default: { /* Q4_1, Q5_1: d * q + m */
        const float m = h16(b + 2);
        if (!isfinite(m))
            return 0;
        ints32(type == MHA__GGML_Q4_1 ? b + 4 : b + 8, type == MHA__GGML_Q4_1 ? NULL : b + 4, q);
        for (int i = 0; i < 32; i++)
            y[i] = d * (float)q[i] + m;
        return 1;
    }
    }
}

/* Q2_K: 16 groups of 16 values; group j's 4-bit scale and 4-bit min in scales[j] (low, high
 * nibble). Value i = 128h + 32s + l (h < 2, s < 4, l < 32) is bits 2s..2s+1 of qs[32h + l], in
 * group i / 16: (d * sc) * q - dmin * mn. */
static int block_q2_k(const unsigned char *b, float *y) {
    const unsigned char *sc = b, *qs = b + 16;
    const float d = h16(b + 80), dmin = h16(b + 82);
    if (!isfinite(d) || !isfinite(dmin))
        return 0;
    for (int i = 0; i < 256; i++) {
        const int h = i / 128, s = i % 128 / 32, l = i % 32;
        const int q = qs[32 * h + l] >> (2 * s) & 3;
        const float dl = d * (float)(sc[i / 16] & 15), ml = dmin * (float)(sc[i / 16] >> 4);
        y[i] = dl * (float)q - ml;
    }
    return 1;
}

/* Q3_K: 16 groups of 16 values with 6-bit scales: scale j's low 4 bits are the low (j < 8) or
 * high (j >= 8) nibble of scales[j % 8], its high 2 bits bits 2(j / 4).. of scales[8 + j % 4];
 * the group's factor is d * (scale - 32). Value i = 128h + 32s + l: q = bits 2s..2s+1 of qs[32h +
 * l], minus 4 unless bit (i / 32) of hmask[l] is set; value (d * (scale - 32)) * q. */
static int block_q3_k(const unsigned char *b, float *y) {
    const unsigned char *hm = b, *qs = b + 32, *sc = b + 96;
    const float d = h16(b + 108);
    if (!isfinite(d))
        return 0;
    for (int i = 0; i < 256; i++) {
        const int j = i / 16, h = i / 128, s = i % 128 / 32, l = i % 32;
        const int lo = j < 8 ? sc[j] & 15 : sc[j - 8] >> 4;
        const int hi = sc[8 + j % 4] >> (2 * (j / 4)) & 3;
        const float dl = d * (float)((lo | hi << 4) - 32);
        const int q = (qs[32 * h + l] >> (2 * s) & 3) - ((hm[l] >> (i / 32) & 1) ? 0 : 4);
        y[i] = dl * (float)q;
    }
    return 1;
}

/* Q4_K and Q5_K's 8 pairs (scale, min) of 6 bits, one per group of 32 values, packed in 12
 * bytes: for j < 4, scale = p[j] & 63 and min = p[j + 4] & 63; for j >= 4, scale = (p[j + 4] &
 * 15) | (p[j - 4] >> 6) << 4 and min = (p[j + 4] >> 4) | (p[j] >> 6) << 4. */
static void scale_min_k4(const unsigned char *p, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = p[j] & 63;
        *mn = p[j + 4] & 63;
    } else {
        *sc = (p[j + 4] & 15) | (p[j - 4] >> 6) << 4;
        *mn = (p[j + 4] >> 4) | (p[j] >> 6) << 4;
    }
}

/* Q4_K (qh NULL) and Q5_K: value i in group j = i / 32 (l = i % 32): the low (j even) or high
 * nibble of qs[32 (j / 2) + l], plus 16 if bit j of qh[l] is set (Q5_K); value (d * scale_j) * q
 * - dmin * min_j. */
static int block_q45_k(const unsigned char *b, int five, float *y) {
    const float d = h16(b), dmin = h16(b + 2);
    if (!isfinite(d) || !isfinite(dmin))
        return 0;
    const unsigned char *sc = b + 4, *qh = five ? b + 16 : NULL, *qs = five ? b + 48 : b + 16;
    for (int j = 0; j < 8; j++) {
        int s, m;
        scale_min_k4(sc, j, &s, &m);
        const float dl = d * (float)s, ml = dmin * (float)m;
        for (int l = 0; l < 32; l++) {
            int q = j % 2 ? qs[32 * (j / 2) + l] >> 4 : qs[32 * (j / 2) + l] & 15;
            if (qh)
                q |= (qh[l] >> j & 1) << 4;
            y[32 * j + l] = dl * (float)q - ml;
        }
    }
    return 1;
}

/* Q6_K: value i = 128h + 32s + l (h < 2, s < 4, l < 32): low 4 bits the low (s < 2) or high
 * nibble of ql[64h + 32(s % 2) + l], high 2 bits bits 2s..2s+1 of qh[32h + l]; q = that - 32,
 * value (d * scales[i / 16]) * q with int8 scales. */
static int block_q6_k(const unsigned char *b, float *y) {
    const unsigned char *ql = b, *qh = b + 128, *sc = b + 192;
    const float d = h16(b + 208);
    if (!isfinite(d))
        return 0;
    for (int i = 0; i < 256; i++) {
        const int h = i / 128, s = i % 128 / 32, l = i % 32;
        const int lo = ql[64 * h + 32 * (s % 2) + l] >> (4 * (s / 2)) & 15;
        const int hi = qh[32 * h + l] >> (2 * s) & 3;
        const float ds = d * (float)(int8_t)sc[i / 16];
        y[i] = ds * (float)((lo | hi << 4) - 32);
    }
    return 1;
}

int mha__ggml_dequantize_row(uint32_t type, const unsigned char *src, int64_t cols, float *dst) {
    switch (type) {
    case MHA__GGML_Q8_0:
    case MHA__GGML_Q4_0:
    case MHA__GGML_Q4_1:
    case MHA__GGML_Q5_0:
    case MHA__GGML_Q5_1: {
        uint64_t values, bytes;
        mha__ggml_type_block(type, &values, &bytes);
        for (int64_t k = 0; k < cols / (int64_t)values; k++)
            if (!block32(type, src + k * (int64_t)bytes, dst + k * (int64_t)values))
                return 0;
        return 1;
    }
    case MHA__GGML_Q2_K:
    case MHA__GGML_Q3_K:
    case MHA__GGML_Q4_K:
    case MHA__GGML_Q5_K:
    case MHA__GGML_Q6_K: {
        uint64_t values, bytes;
        mha__ggml_type_block(type, &values, &bytes);
        for (int64_t k = 0; k < cols / (int64_t)values; k++) {
            const unsigned char *b = src + k * (int64_t)bytes;
            float *y = dst + k * (int64_t)values;
            int ok;
            switch (type) {
            case MHA__GGML_Q2_K:
                ok = block_q2_k(b, y);
                break;
            case MHA__GGML_Q3_K:
                ok = block_q3_k(b, y);
                break;
            case MHA__GGML_Q4_K:
                ok = block_q45_k(b, 0, y);
                break;
            case MHA__GGML_Q5_K:
                ok = block_q45_k(b, 1, y);
                break;
            default:
                ok = block_q6_k(b, y);
                break;
            }
            if (!ok)
                return 0;
        }
        return 1;
    }
    default:
        return 0;
    }
}

int mha__ggml_to_q8_0_row(uint32_t type,
                          const unsigned char *src,
                          int64_t cols,
                          unsigned char *dst) {
    if (type != MHA__GGML_Q8_0 && type != MHA__GGML_Q4_0 && type != MHA__GGML_Q5_0)
        return 0;
    const int64_t n = cols / 32;
    if (type == MHA__GGML_Q8_0) {
        memcpy(dst, src, (size_t)n * 34);
        return 1;
    }
    const int five = type == MHA__GGML_Q5_0;
    uint64_t values, bytes;
    mha__ggml_type_block(type, &values, &bytes);
    for (int64_t k = 0; k < n; k++) {
        const unsigned char *b = src + k * (int64_t)bytes;
        unsigned char *o = dst + k * 34;
        int q[32];
        ints32(five ? b + 6 : b + 2, five ? b + 2 : NULL, q);
        o[0] = b[0];
        o[1] = b[1];
        for (int i = 0; i < 32; i++)
            o[2 + i] = (unsigned char)(int8_t)(q[i] - (five ? 16 : 8));
    }
    return 1;
}
