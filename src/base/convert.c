/* SPDX-License-Identifier: MIT */
/* convert.c: float16 (IEEE binary16) and bfloat16 <-> float32 conversions in portable C.
 *
 * Pure integer bit manipulation: no hardware F16C, no floating-point rounding modes involved, so
 * the results are the same on every machine. Narrowing rounds to nearest, ties to even; overflow
 * gives infinity; subnormals are produced and read exactly. A NaN keeps its sign and the top bits
 * of its payload (made nonzero if they were all dropped), so f16/bf16 -> f32 -> f16/bf16 is the
 * identity.
 */
#include "base/internal.h"

#include <string.h>

static float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint32_t f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

float mha__f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1f) /* Inf or NaN: the payload moves to the top of the float32 mantissa. */
        return bits_to_f32(sign | 0x7f800000u | (mant << 13));
    if (exp != 0) /* Normal: rebias the exponent from 15 to 127. */
        return bits_to_f32(sign | ((exp + 112u) << 23) | (mant << 13));
    if (mant == 0)
        return bits_to_f32(sign);
    /* Subnormal: mant * 2^-24. Normalise so the leading one becomes the implicit bit 10. */
    uint32_t e = 113; /* biased float32 exponent of 2^-14, the f16 subnormal scale */
    while ((mant & 0x400u) == 0) {
        mant <<= 1;
        e--;
    }
    return bits_to_f32(sign | (e << 23) | ((mant & 0x3ffu) << 13));
}

float mha__bf16_to_f32(uint16_t h) {
    return bits_to_f32((uint32_t)h << 16);
}

uint16_t mha__f32_to_f16(float f) {
    const uint32_t u = f32_to_bits(f);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) { /* NaN: keep the top 10 payload bits, never turn it into Inf. */
        uint32_t payload = (a >> 13) & 0x3ffu;
        if (payload == 0)
            payload = 0x200u;
        return (uint16_t)(sign | 0x7c00u | payload);
    }
    if (a >= 0x47800000u) /* |f| >= 2^16 (or Inf): beyond even the rounding range of 65504. */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) {
        /* Normal f16 range (|f| >= 2^-14): rebias, then round the 23-bit mantissa to 10 bits.
         * A carry out of the mantissa correctly bumps the exponent (up to Inf at 65520). */
        uint32_t v = a - (112u << 23);
        v += 0xfffu + ((v >> 13) & 1u);
        return (uint16_t)(sign | (v >> 13));
    }
    const uint32_t exp = a >> 23;
    if (exp < 102) /* |f| < 2^-25: rounds to zero (2^-25 itself is a tie and goes to even 0). */
        return sign;
    /* Subnormal f16: result = round(|f| / 2^-24) = round(m * 2^(exp - 126)) with the 24-bit
     * significand m; exp in [102, 112] so the shift is 14..24. */
    const uint32_t m = (a & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exp;
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u)))
        r++; /* r may become 0x400, the smallest normal: the encoding is still right */
    return (uint16_t)(sign | r);
}

uint16_t mha__f32_to_bf16(float f) {
    const uint32_t u = f32_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) { /* NaN: keep sign and top payload bits. */
        uint32_t hi = u >> 16;
        if ((hi & 0x7fu) == 0)
            hi |= 0x40u;
        return (uint16_t)hi;
    }
    /* Round to nearest even on the low 16 bits; the carry handles exponent bumps and overflow
     * (values at or above the midpoint past bf16's largest finite become Inf). */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

void mha__widen(mha_dtype dt, const void *src, float *dst, int64_t count) {
    if (dt == MHA_DTYPE_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)count);
        return;
    }
    const uint16_t *h = src;
    if (dt == MHA_DTYPE_BF16) /* a shift: the compiler vectorises it */
        for (int64_t i = 0; i < count; i++)
            dst[i] = bits_to_f32((uint32_t)h[i] << 16);
    else
        for (int64_t i = 0; i < count; i++)
            dst[i] = mha__f16_to_f32(h[i]);
}

void mha__narrow(mha_dtype dt, const float *src, void *dst, int64_t count) {
    if (dt == MHA_DTYPE_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)count);
        return;
    }
    uint16_t *h = dst;
    for (int64_t i = 0; i < count; i++)
        h[i] = dt == MHA_DTYPE_BF16 ? mha__f32_to_bf16(src[i]) : mha__f32_to_f16(src[i]);
}

mha_status
mha_half_to_f32(mha_dtype dtype, const uint16_t *src, float *dst, int64_t count, mha_error *err) {
    MHA_RETURN_IF(dtype != MHA_DTYPE_F16 && dtype != MHA_DTYPE_BF16, err, INVALID_ARG,
                  "dtype %d is not float16 or bfloat16", (int)dtype);
    MHA_RETURN_IF(count < 0, err, INVALID_ARG, "count=%lld is negative", (long long)count);
    MHA_RETURN_IF(count > 0 && (!src || !dst), err, INVALID_ARG, "src or dst is NULL");
    /* dst [count floats] must not overlap src [count halves] (docs/SEMANTICS.md, "Aliasing"; the
     * rule of check/overlap.c, which base cannot include). */
    if (count > 0) {
        const uintptr_t s0 = (uintptr_t)src, d0 = (uintptr_t)dst;
        const uintptr_t big = UINTPTR_MAX / 8, n = (uint64_t)count > big ? big : (uintptr_t)count;
        const uintptr_t s1 = s0 + 2 * n < s0 ? UINTPTR_MAX : s0 + 2 * n;
        const uintptr_t d1 = d0 + 4 * n < d0 ? UINTPTR_MAX : d0 + 4 * n;
        MHA_RETURN_IF(s0 < d1 && d0 < s1, err, INVALID_ARG,
                      "dst overlaps src in memory: an output must not alias an input (dst holds "
                      "count floats, src count halves)");
    }
    for (int64_t i = 0; i < count; i++)
        dst[i] = dtype == MHA_DTYPE_F16 ? mha__f16_to_f32(src[i]) : mha__bf16_to_f32(src[i]);
    mha__ok(err);
    return MHA_STATUS_OK;
}

/* dst (dst_bytes) overlapping src (src_bytes)? (the rule of check/overlap.c, which base cannot
 * include; sizes already bounded by the caller). */
static int bytes_overlap(const void *src, size_t src_bytes, const void *dst, size_t dst_bytes) {
    const uintptr_t s0 = (uintptr_t)src, d0 = (uintptr_t)dst;
    const uintptr_t s1 = s0 + src_bytes < s0 ? UINTPTR_MAX : s0 + src_bytes;
    const uintptr_t d1 = d0 + dst_bytes < d0 ? UINTPTR_MAX : d0 + dst_bytes;
    return s0 < d1 && d0 < s1;
}

/* The arguments of the block (de)quantizers: dt is MHA_DTYPE_Q8_0 or Q4_0. */
static mha_status block_check(
    mha_dtype dt, const void *src, int64_t count, const void *dst, int to_q8, mha_error *err) {
    const char *name = dt == MHA_DTYPE_Q4_0 ? "q4_0" : "q8_0";
    MHA_RETURN_IF(count < 0 || count % MHA__Q8_BLOCK != 0, err, INVALID_ARG,
                  "count=%lld is not a nonnegative multiple of 32 (whole %s blocks)",
                  (long long)count, name);
    MHA_RETURN_IF(count > 0 && (!src || !dst), err, INVALID_ARG, "src or dst is NULL");
    MHA_RETURN_IF((uint64_t)count > SIZE_MAX / sizeof(float), err, OVERFLOW,
                  "count=%lld values overflow the address space", (long long)count);
    const size_t fb = sizeof(float) * (size_t)count;
    const size_t qb = mha__weight_bytes(dt, count);
    MHA_RETURN_IF(count > 0 && bytes_overlap(src, to_q8 ? fb : qb, dst, to_q8 ? qb : fb), err,
                  INVALID_ARG,
                  "dst overlaps src in memory: an output must not alias an input (count / 32 "
                  "blocks of %d bytes, count floats)",
                  (int)mha__block_bytes(dt));
    return MHA_STATUS_OK;
}

mha_status mha_q8_0_quantize(const float *src, int64_t count, void *dst, mha_error *err) {
    mha_status st = block_check(MHA_DTYPE_Q8_0, src, count, dst, 1, err);
    if (st)
        return st;
    mha__q8_quantize(src, count, dst);
    mha__ok(err);
    return MHA_STATUS_OK;
}

mha_status mha_q8_0_dequantize(const void *src, int64_t count, float *dst, mha_error *err) {
    mha_status st = block_check(MHA_DTYPE_Q8_0, src, count, dst, 0, err);
    if (st)
        return st;
    mha__q8_dequantize(src, count, dst);
    mha__ok(err);
    return MHA_STATUS_OK;
}

mha_status mha_q4_0_quantize(const float *src, int64_t count, void *dst, mha_error *err) {
    mha_status st = block_check(MHA_DTYPE_Q4_0, src, count, dst, 1, err);
    if (st)
        return st;
    mha__q4_quantize(src, count, dst);
    mha__ok(err);
    return MHA_STATUS_OK;
}

mha_status mha_q4_0_dequantize(const void *src, int64_t count, float *dst, mha_error *err) {
    mha_status st = block_check(MHA_DTYPE_Q4_0, src, count, dst, 0, err);
    if (st)
        return st;
    mha__q4_dequantize(src, count, dst);
    mha__ok(err);
    return MHA_STATUS_OK;
}
