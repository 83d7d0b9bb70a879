/* SPDX-License-Identifier: MIT */
/* q8.c: ggml's q8_0 block (float16 scale + 32 int8) for the q8_0 KV cache and q8_0 weights, and
 * its q4_0 block (float16 scale + 32 nibbles) for q4_0 weights (at the end).
 *
 *   block b of a row x[32 b .. 32 b + 31]:
 *     a = max_i |x_i|,  d = f16(a / 127) rounded to nearest even, clamped to 65504,
 *     q_i = clamp(rne(x_i / d), -127, 127)   (q_i = 0 when d = 0),  value_i = q_i d
 *   bytes: d (2, little-endian float16) then q_0 .. q_31 (1 each) = 34 bytes.
 * q is computed against the STORED (rounded) d, so the error of a value is |x - q d| <= d / 2
 * unless saturated (docs/SEMANTICS.md "q8_0 KV cache"). Ties round to even (rintf in the default
 * rounding mode), where ggml's quantize_row_q8_0 rounds them away from zero (roundf) and divides
 * by the unrounded scale: the two differ on exact ties and by the scale's f16 rounding only.
 * A block with a NaN or an infinity stores d = NaN and q = 0: every value of it reads as NaN, as
 * the non-finite value would poison an f32 cache's attention. */
#include "base/internal.h"

#include <math.h>
#include <string.h>

static void quantize_block(const float *x, unsigned char *dst) {
    float a = 0.0f;
    int finite = 1;
    for (int i = 0; i < MHA__Q8_BLOCK; i++) {
        finite &= isfinite(x[i]) != 0;
        a = fabsf(x[i]) > a ? fabsf(x[i]) : a;
    }
    uint16_t dh = finite ? mha__f32_to_f16(a / 127.0f) : (uint16_t)0x7E00;
    if (finite && (dh & 0x7FFF) >= 0x7C00)
        dh = 0x7BFF; /* 65504: a / 127 past the float16 range saturates */
    const float d = mha__f16_to_f32(dh);
    memcpy(dst, &dh, 2);
    for (int i = 0; i < MHA__Q8_BLOCK; i++) {
        float q = 0.0f;
        if (finite && d > 0.0f) {
            q = rintf(x[i] / d);
            q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
        }
        const signed char qi = (signed char)q;
        memcpy(dst + 2 + i, &qi, 1);
    }
}

void mha__q8_quantize(const float *src, int64_t n, void *dst) {
    for (int64_t b = 0; b < n / MHA__Q8_BLOCK; b++)
        quantize_block(src + b * MHA__Q8_BLOCK, (unsigned char *)dst + b * MHA__Q8_BYTES);
}

void mha__q8_dequantize(const void *src, int64_t n, float *dst) {
    for (int64_t b = 0; b < n / MHA__Q8_BLOCK; b++) {
        const unsigned char *blk = (const unsigned char *)src + b * MHA__Q8_BYTES;
        uint16_t dh;
        memcpy(&dh, blk, 2);
        const float d = mha__f16_to_f32(dh);
        for (int i = 0; i < MHA__Q8_BLOCK; i++)
            dst[b * MHA__Q8_BLOCK + i] = (float)(signed char)blk[2 + i] * d;
    }
}

/* q4_0 (docs/SEMANTICS.md "q4_0 weights"):
 *   m = the x_i of largest |x_i| (the first), d = f16(m / -8) rounded to nearest even, clamped to
 *   +-65504, q_i = clamp(rne(x_i / d) + 8, 0, 15) (8 when d = 0), value_i = (q_i - 8) d;
 *   bytes: d (2, little-endian) then 16 bytes, byte i = q_i | q_{i+16} << 4 = 18 bytes.
 * The scale's sign is m's opposite, so m maps to q = 0 (-8 d = m up to d's rounding) and the
 * other sign reaches 7 |d| only: ggml's asymmetric range. */
static void quantize_block_q4(const float *x, unsigned char *dst) {
    float m = 0.0f;
    int finite = 1;
    for (int i = 0; i < MHA__Q8_BLOCK; i++) {
        finite &= isfinite(x[i]) != 0;
        m = fabsf(x[i]) > fabsf(m) ? x[i] : m;
    }
    uint16_t dh = finite ? mha__f32_to_f16(m / -8.0f) : (uint16_t)0x7E00;
    if (finite && (dh & 0x7FFF) >= 0x7C00)
        dh = (uint16_t)((dh & 0x8000) | 0x7BFF); /* |m| / 8 past the float16 range saturates */
    const float d = mha__f16_to_f32(dh);
    memcpy(dst, &dh, 2);
    unsigned char q[MHA__Q8_BLOCK];
    for (int i = 0; i < MHA__Q8_BLOCK; i++) {
        float v = 8.0f;
        if (finite && d != 0.0f) {
            v = rintf(x[i] / d) + 8.0f;
            v = v > 15.0f ? 15.0f : v < 0.0f ? 0.0f : v;
        }
        q[i] = (unsigned char)v;
    }
    for (int i = 0; i < 16; i++)
        dst[2 + i] = (unsigned char)(q[i] | q[i + 16] << 4);
}

void mha__q4_quantize(const float *src, int64_t n, void *dst) {
    for (int64_t b = 0; b < n / MHA__Q8_BLOCK; b++)
        quantize_block_q4(src + b * MHA__Q8_BLOCK, (unsigned char *)dst + b * MHA__Q4_BYTES);
}

void mha__q4_dequantize(const void *src, int64_t n, float *dst) {
    for (int64_t i = 0; i < n; i++)
        dst[i] = mha__q4_load(src, i);
}
