/* SPDX-License-Identifier: MIT */
/* kv_dtype.c: the KV cache's storage dtypes, one table row each (internal.h
 * mha__kv_dtype_traits), and fp8 e4m3 (docs/SEMANTICS.md "fp8 KV cache").
 *
 * fp8 e4m3 (OCP E4M3FN): byte S.EEEE.MMM; normal E in 1..15: (-1)^S 2^(E-7) (1 + M/8), subnormal
 * E = 0: (-1)^S 2^-6 M/8; S.1111.111 is NaN; no infinities, so the largest value is 448
 * (S.1111.110). Quantising rounds to nearest even and saturates to +-448 (infinities too: vLLM's
 * saturating cast); NaN stays NaN. */
#include "base/internal.h"

#include <math.h>
#include <string.h>

uint8_t mha__fp8_from_f32(float x) {
    const uint8_t sign = signbit(x) ? 0x80 : 0x00;
    if (isnan(x))
        return (uint8_t)(sign | 0x7F);
    float a = fabsf(x);
    if (a >= 448.0f) /* saturate (448 itself included), infinities too */
        return (uint8_t)(sign | 0x7E);
    int e;
    (void)frexpf(a, &e); /* a = f 2^e, f in [0.5, 1): a in [2^(e-1), 2^e) */
    /* the spacing of e4m3 values around a: 2^(e-1-3) for normals (e - 1 >= -6), 2^-9 below */
    const int q = e - 1 >= -6 ? e - 4 : -9;
    const float m = rintf(ldexpf(a, -q)); /* exact scaling; ties to even */
    /* m 2^q back into bits: subnormal if m < 8 at q = -9, else normal (m in [8, 16], 16 when
     * rounding carried into the next binade) */
    if (m == 0.0f)
        return sign;
    int mi = (int)m, qe = q;
    if (mi == 16) {
        mi = 8;
        qe++;
    }
    if (qe == -9 && mi < 8)
        return (uint8_t)(sign | mi); /* subnormal */
    const int E = qe + 3 + 7;        /* value = 2^(qe + 3) (mi / 8) */
    return (uint8_t)(sign | E << 3 | (mi - 8));
}

float mha__fp8_to_f32(uint8_t b) {
    const int E = b >> 3 & 15, M = b & 7;
    float v;
    if (E == 15 && M == 7)
        v = NAN;
    else if (E == 0)
        v = ldexpf((float)M, -9);
    else
        v = ldexpf((float)(8 + M), E - 10);
    return b & 0x80 ? -v : v;
}

/* ---- row conversions ---- */
static void f32_to(const void *src, int64_t n, float *dst, float scale) {
    (void)scale;
    memcpy(dst, src, sizeof(float) * (size_t)n);
}
static void f32_from(const float *src, int64_t n, void *dst, float scale) {
    (void)scale;
    memcpy(dst, src, sizeof(float) * (size_t)n);
}
static void f16_to(const void *src, int64_t n, float *dst, float scale) {
    (void)scale;
    for (int64_t i = 0; i < n; i++)
        dst[i] = mha__f16_to_f32(((const uint16_t *)src)[i]);
}
static void f16_from(const float *src, int64_t n, void *dst, float scale) {
    (void)scale;
    for (int64_t i = 0; i < n; i++)
        ((uint16_t *)dst)[i] = mha__f32_to_f16(src[i]);
}
static void bf16_to(const void *src, int64_t n, float *dst, float scale) {
    (void)scale;
    for (int64_t i = 0; i < n; i++)
        dst[i] = mha__bf16_to_f32(((const uint16_t *)src)[i]);
}
static void bf16_from(const float *src, int64_t n, void *dst, float scale) {
    (void)scale;
    for (int64_t i = 0; i < n; i++)
        ((uint16_t *)dst)[i] = mha__f32_to_bf16(src[i]);
}
static void q8_to(const void *src, int64_t n, float *dst, float scale) {
    (void)scale;
    mha__q8_dequantize(src, n, dst);
}
static void q8_from(const float *src, int64_t n, void *dst, float scale) {
    (void)scale;
    mha__q8_quantize(src, n, dst);
}
/* read: e4m3 * scale, one float32 rounding (the kernels' widening computes the same product) */
static void fp8_to(const void *src, int64_t n, float *dst, float scale) {
    for (int64_t i = 0; i < n; i++)
        dst[i] = mha__fp8_to_f32(((const uint8_t *)src)[i]) * scale;
}
/* write: e4m3(x / scale), the division rounded to float32 first (as vLLM's x / scale) */
static void fp8_from(const float *src, int64_t n, void *dst, float scale) {
    for (int64_t i = 0; i < n; i++)
        ((uint8_t *)dst)[i] = mha__fp8_from_f32(src[i] / scale);
}

static const mha__kv_dtype_traits kv_dtypes[] = {
    {MHA_DTYPE_F32, "f32", 1, 4, 0, f32_to, f32_from},
    {MHA_DTYPE_F16, "f16", 1, 2, 0, f16_to, f16_from},
    {MHA_DTYPE_BF16, "bf16", 1, 2, 0, bf16_to, bf16_from},
    {MHA_DTYPE_Q8_0, "q8_0", MHA__Q8_BLOCK, MHA__Q8_BYTES, 0, q8_to, q8_from},
    {MHA_DTYPE_FP8_E4M3, "fp8_e4m3", 1, 1, 1, fp8_to, fp8_from},
};

const mha__kv_dtype_traits *mha__kv_dtype(mha_dtype dtype) {
    for (size_t i = 0; i < sizeof kv_dtypes / sizeof kv_dtypes[0]; i++)
        if (kv_dtypes[i].dtype == dtype)
            return &kv_dtypes[i];
    return NULL;
}
