/* SPDX-License-Identifier: MIT */
/* simd_neon.h: a thin vocabulary over AArch64 Advanced SIMD (NEON) intrinsics (4 floats per
 * vector) for the NEON kernels (*_neon.c, compiled only for aarch64, where NEON is baseline).
 * The same words as simd_avx2.h (v8_*) with 4 lanes, so that a kernel reads the same on both.
 *
 * v4_exp: exp(x) for every float x with the polynomial and range reduction of simd_avx2.h (same
 * constants, same operation order: max error 1 ULP on [-87.3, 0], tested by tests/test_kernels.c
 * through mha__vexp_neon); subnormal results correctly scaled, NaN stays NaN, -inf gives 0.
 * v4_tanh: tanh(x), max error 2 ULP (same test).
 * 32 vector registers (v0-v31), 2 FMA pipes on most cores (4-cycle latency): a kernel keeps
 * >= 8 independent accumulators to hide the latency.
 */
#ifndef MHA_SIMD_NEON_H
#define MHA_SIMD_NEON_H

#include "base/internal.h"

#include <arm_neon.h>
#include <stdint.h>
#include <string.h>

#define MHA_INLINE static inline __attribute__((always_inline))

typedef float32x4_t v4;
typedef uint32x4_t v4m; /* lane mask: all ones or all zeros per lane */

MHA_INLINE v4 v4_zero(void) {
    return vdupq_n_f32(0.0f);
}
MHA_INLINE v4 v4_set1(float x) {
    return vdupq_n_f32(x);
}
/* NEON loads and stores need no alignment; both names exist so that kernels read like the x86
 * ones (load: the caller's buffer is 16-byte aligned). */
MHA_INLINE v4 v4_load(const float *p) {
    return vld1q_f32(p);
}
MHA_INLINE v4 v4_loadu(const float *p) {
    return vld1q_f32(p);
}
MHA_INLINE void v4_store(float *p, v4 x) {
    vst1q_f32(p, x);
}
/* The first n floats of p (n <= 4), the other lanes 0, and the store of the first n lanes of x:
 * lane by lane (LD1/ST1 to a lane), touching nothing past p[n - 1]. (A copy through a stack array
 * is a loop that gcc 12 turns into a memcpy call, which also spills the live accumulators of the
 * FMA loops around it.) With n a compile-time constant the tests fold away. */
MHA_INLINE v4 v4_loadu_first(const float *p, int n) {
    if (n >= 4)
        return vld1q_f32(p);
    v4 x = vdupq_n_f32(0.0f);
    if (n > 0)
        x = vld1q_lane_f32(p, x, 0);
    if (n > 1)
        x = vld1q_lane_f32(p + 1, x, 1);
    if (n > 2)
        x = vld1q_lane_f32(p + 2, x, 2);
    return x;
}
MHA_INLINE void v4_storeu_first(float *p, int n, v4 x) {
    if (n >= 4) {
        vst1q_f32(p, x);
        return;
    }
    if (n > 0)
        vst1q_lane_f32(p, x, 0);
    if (n > 1)
        vst1q_lane_f32(p + 1, x, 1);
    if (n > 2)
        vst1q_lane_f32(p + 2, x, 2);
}
MHA_INLINE v4 v4_add(v4 a, v4 b) {
    return vaddq_f32(a, b);
}
MHA_INLINE v4 v4_sub(v4 a, v4 b) {
    return vsubq_f32(a, b);
}
MHA_INLINE v4 v4_mul(v4 a, v4 b) {
    return vmulq_f32(a, b);
}
/* a * b + c with one rounding (FMLA). */
MHA_INLINE v4 v4_fma(v4 a, v4 b, v4 c) {
    return vfmaq_f32(c, a, b);
}
/* a * b[lane] + c: the by-element FMLA, which saves the broadcast register of the x86 kernels. */
#define v4_fma_lane(a, b, lane, c) vfmaq_laneq_f32((c), (a), (b), (lane))
/* max(x, acc) that ignores a NaN x (FMAXNM returns the number when one operand is NaN). */
MHA_INLINE v4 v4_max_nan_ignoring(v4 x, v4 acc) {
    return vmaxnmq_f32(x, acc);
}
MHA_INLINE v4 v4_max(v4 a, v4 b) {
    return vmaxq_f32(a, b);
}
/* Lanes whose mask is clear become `other`. */
MHA_INLINE v4 v4_select(v4m k, v4 x, v4 other) {
    return vbslq_f32(k, x, other);
}
MHA_INLINE float v4_hmax(v4 x) {
    return vmaxvq_f32(x);
}
/* (x0 + x1) + (x2 + x3): pairwise, as FADDP does it. */
MHA_INLINE float v4_hsum(v4 x) {
    return vaddvq_f32(x);
}
/* In-place transpose of the 4 x 4 block r[0..3] (rows in, columns out): TRN1/TRN2 on 32-bit
 * elements pair up rows 0-1 and 2-3, TRN1/TRN2 on 64-bit elements then join the pairs. */
MHA_INLINE void v4_transpose4(v4 r[4]) {
    const float64x2_t t0 = vreinterpretq_f64_f32(vtrn1q_f32(r[0], r[1]));
    const float64x2_t t1 = vreinterpretq_f64_f32(vtrn2q_f32(r[0], r[1]));
    const float64x2_t t2 = vreinterpretq_f64_f32(vtrn1q_f32(r[2], r[3]));
    const float64x2_t t3 = vreinterpretq_f64_f32(vtrn2q_f32(r[2], r[3]));
    r[0] = vreinterpretq_f32_f64(vtrn1q_f64(t0, t2));
    r[1] = vreinterpretq_f32_f64(vtrn1q_f64(t1, t3));
    r[2] = vreinterpretq_f32_f64(vtrn2q_f64(t0, t2));
    r[3] = vreinterpretq_f32_f64(vtrn2q_f64(t1, t3));
}

/* exp: the method and constants of simd_avx2.h (Cody-Waite reduction x = k ln2 + r, degree-6
 * polynomial for e^r, 2^k applied as 2^(k - k/2) * 2^(k/2) so subnormal results round once and
 * large k overflows to +inf; as one factor where the result is normal). */
#define MHA_EXP_LOG2E  0x1.715476p+0f
#define MHA_EXP_LN2_HI 0x1.62e430p-1f
#define MHA_EXP_LN2_LO -0x1.05c610p-29f
#define MHA_EXP_C2     0x1.fffffcp-2f
#define MHA_EXP_C3     0x1.555492p-3f
#define MHA_EXP_C4     0x1.5558f2p-5f
#define MHA_EXP_C5     0x1.1239d4p-7f
#define MHA_EXP_C6     0x1.6a244cp-10f
#define MHA_EXP_XMIN   -0x1.a0p+6f
#define MHA_EXP_XMAX   0x1.633334p+6f
#define MHA_EXP_ROUND  0x1.8p+23f

/* e^r for x = k ln 2 + r, |r| <= ln 2 / 2; *t holds k in the low bits of its float (t = k +
 * ROUND, an integer-valued float with exponent 23). */
MHA_INLINE v4 v4_exp_reduced(v4 x, v4 *t) {
    *t = v4_fma(x, v4_set1(MHA_EXP_LOG2E), v4_set1(MHA_EXP_ROUND));
    const v4 k = v4_sub(*t, v4_set1(MHA_EXP_ROUND));
    v4 r = v4_fma(k, v4_set1(-MHA_EXP_LN2_HI), x);
    r = v4_fma(k, v4_set1(-MHA_EXP_LN2_LO), r);
    v4 q = v4_set1(MHA_EXP_C6);
    q = v4_fma(q, r, v4_set1(MHA_EXP_C5));
    q = v4_fma(q, r, v4_set1(MHA_EXP_C4));
    q = v4_fma(q, r, v4_set1(MHA_EXP_C3));
    q = v4_fma(q, r, v4_set1(MHA_EXP_C2));
    q = v4_fma(q, r, v4_set1(1.0f));
    return v4_fma(q, r, v4_set1(1.0f));
}

/* exp for x in [XMIN, XMAX] or NaN (no clamping). */
MHA_INLINE v4 v4_exp_unclamped(v4 x) {
    v4 t;
    const v4 p = v4_exp_reduced(x, &t);
    /* the low bits of t hold k as a two's-complement integer */
    const int32x4_t ki =
        vsubq_s32(vreinterpretq_s32_f32(t), vreinterpretq_s32_f32(v4_set1(MHA_EXP_ROUND)));
    const int32x4_t k1 = vshrq_n_s32(ki, 1), k2 = vsubq_s32(ki, k1);
    const int32x4_t bias = vdupq_n_s32(127);
    const v4 s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k1, bias), 23));
    const v4 s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(k2, bias), 23));
    return v4_mul(v4_mul(p, s1), s2);
}

/* 2^k as one float, (k + 127) << 23, for the k in t (see v4_exp_reduced) in [-126, 127]. Where
 * p 2^k is normal (or overflows) the product is exact (or +inf) and has the bits of the two-factor
 * product of v4_exp_unclamped, in 3 operations instead of 9 (as in simd_avx2.h). */
MHA_INLINE v4 v4_pow2_normal(v4 t) {
    const int32x4_t bias = vdupq_n_s32(127 - 0x4B400000); /* 0x4B400000: bits of ROUND */
    return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vreinterpretq_s32_f32(t), bias), 23));
}

/* exp(x) for x <= 0 or NaN, flushed to 0 below MHA_EXP_FLUSH (results under 2^-124 are
 * irrelevant in a softmax). */
#define MHA_EXP_FLUSH -0x1.58p+6f /* -86 */

/* exp for every float: one-factor scaling when every lane is in [MHA_EXP_FLUSH, 88] (or NaN), the
 * same bits as the two factors, which take any other vector (see v8_exp in simd_avx2.h). */
MHA_INLINE v4 v4_exp(v4 x) {
    const v4m out = vorrq_u32(vcltq_f32(x, v4_set1(MHA_EXP_FLUSH)), vcgtq_f32(x, v4_set1(88.0f)));
    if (vmaxvq_u32(out)) {
        x = vmaxq_f32(v4_set1(MHA_EXP_XMIN), x); /* FMAX propagates a NaN x */
        return v4_exp_unclamped(vminq_f32(v4_set1(MHA_EXP_XMAX), x));
    }
    v4 t;
    const v4 p = v4_exp_reduced(x, &t);
    return v4_mul(p, v4_pow2_normal(t));
}

MHA_INLINE v4 v4_exp_nonpos(v4 x) {
    const v4m nan = vmvnq_u32(vceqq_f32(x, x));
    const v4m keep = vorrq_u32(vcgeq_f32(x, v4_set1(MHA_EXP_FLUSH)), nan);
    /* x >= -86 gives k >= -124: p 2^k is normal, and exact */
    v4 t;
    const v4 p = v4_exp_reduced(vmaxq_f32(v4_set1(MHA_EXP_FLUSH), x), &t); /* NaN propagates */
    const v4 y = v4_mul(p, v4_pow2_normal(t));
    return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(y), keep));
}

/* tanh: the odd polynomial of simd_avx2.h below |x| = 0.625, 1 - 2 / (e^{2|x|} + 1) above. */
#define MHA_TANH_SPLIT 0x1.4p-1f
#define MHA_TANH_T1    -0x1.555532p-2f
#define MHA_TANH_T2    0x1.110726p-3f
#define MHA_TANH_T3    -0x1.b83c5ap-5f
#define MHA_TANH_T4    0x1.522698p-6f
#define MHA_TANH_T5    -0x1.75e1c0p-8f

MHA_INLINE v4 v4_tanh(v4 x) {
    const v4 ax = vabsq_f32(x);
    const v4 x2 = v4_mul(x, x);
    v4 q = v4_set1(MHA_TANH_T5);
    q = v4_fma(q, x2, v4_set1(MHA_TANH_T4));
    q = v4_fma(q, x2, v4_set1(MHA_TANH_T3));
    q = v4_fma(q, x2, v4_set1(MHA_TANH_T2));
    q = v4_fma(q, x2, v4_set1(MHA_TANH_T1));
    const v4 small = v4_fma(v4_mul(x, x2), q, x);
    const v4 e = v4_exp(v4_add(ax, ax));
    v4 big = v4_sub(v4_set1(1.0f), vdivq_f32(v4_set1(2.0f), v4_add(e, v4_set1(1.0f))));
    const uint32x4_t sign = vdupq_n_u32(0x80000000u);
    big = vreinterpretq_f32_u32(
        vorrq_u32(vreinterpretq_u32_f32(big), vandq_u32(vreinterpretq_u32_f32(x), sign)));
    /* NaN: the comparison is false, so big (NaN from the exp) is chosen. */
    return vbslq_f32(vcltq_f32(ax, v4_set1(MHA_TANH_SPLIT)), small, big);
}

/* Philox4x32-10, 4 counters at once, output word 0 only (mha__philox4x32_10, philox.c). */
#define MHA_PHILOX_M0 0xD2511F53u
#define MHA_PHILOX_M1 0xCD9E8D57u
#define MHA_PHILOX_W0 0x9E3779B9u
#define MHA_PHILOX_W1 0xBB67AE85u

MHA_INLINE void v4i_mul_hilo(uint32x4_t a, uint32_t m, uint32x4_t *hi, uint32x4_t *lo) {
    const uint64x2_t p0 = vmull_n_u32(vget_low_u32(a), m);
    const uint64x2_t p1 = vmull_high_n_u32(a, m);
    *lo = vuzp1q_u32(vreinterpretq_u32_u64(p0), vreinterpretq_u32_u64(p1));
    *hi = vuzp2q_u32(vreinterpretq_u32_u64(p0), vreinterpretq_u32_u64(p1));
}

MHA_INLINE uint32x4_t v4i_philox_word0(
    uint32x4_t c0, uint32x4_t c1, uint32x4_t c2, uint32x4_t c3, uint32_t k0, uint32_t k1) {
    for (int round = 0; round < 9; round++) {
        uint32x4_t hi0, lo0, hi1, lo1;
        v4i_mul_hilo(c0, MHA_PHILOX_M0, &hi0, &lo0);
        v4i_mul_hilo(c2, MHA_PHILOX_M1, &hi1, &lo1);
        c0 = veorq_u32(veorq_u32(hi1, c1), vdupq_n_u32(k0));
        c2 = veorq_u32(veorq_u32(hi0, c3), vdupq_n_u32(k1));
        c1 = lo1;
        c3 = lo0;
        k0 += MHA_PHILOX_W0;
        k1 += MHA_PHILOX_W1;
    }
    uint32x4_t hi1, lo1;
    v4i_mul_hilo(c2, MHA_PHILOX_M1, &hi1, &lo1);
    return veorq_u32(veorq_u32(hi1, c1), vdupq_n_u32(k0));
}

/* q8_0 rows (docs/SEMANTICS.md "q8_0 KV cache"): element d lives in block d / 32 (34 bytes: a
 * float16 scale, then 32 int8), byte 2 + d % 32. v4_q8_scale broadcasts the scale of the block
 * holding element d (FCVTL); v4_q8_widen widens the 4 values [d, d + 4) (d % 4 == 0) with it:
 * SXTL twice, SCVTF, FMUL, exact (an 8-bit integer times an 11-bit significand fits the 24 bits
 * of a float32), so the values equal mha__q8_dequantize's. */
MHA_INLINE v4 v4_q8_scale(const void *row, int64_t d) {
    uint16_t h;
    memcpy(&h, (const char *)row + (d >> 5) * MHA__Q8_BYTES, 2);
    return vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h)));
}
MHA_INLINE v4 v4_q8_widen(const void *row, int64_t d, v4 s) {
    int32_t w;
    memcpy(&w, (const char *)row + (d >> 5) * MHA__Q8_BYTES + 2 + (d & 31), 4);
    const int16x8_t x = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(w)));
    return vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(x))), s);
}

/* fp8 e4m3 (docs/SEMANTICS.md "fp8 KV cache"): the 4 bytes at p as float32 e4m3 values times
 * 2^-8: float16 bits (sign-extended b << 7) & 0xBF80, FCVTL; S.1111.111 (read as +-1.875 that
 * way, a value no other byte gives) becomes NaN. */
MHA_INLINE v4 v4_fp8_widen(const void *p) {
    int32_t w;
    memcpy(&w, p, 4);
    const int16x8_t x = vshlq_n_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(w))), 7);
    const uint16x4_t h = vand_u16(vreinterpret_u16_s16(vget_low_s16(x)), vdup_n_u16(0xBF80));
    const v4 f = vcvt_f32_f16(vreinterpret_f16_u16(h));
    return vbslq_f32(vceqq_f32(vabsq_f32(f), vdupq_n_f32(1.875f)), vdupq_n_f32(__builtin_nanf("")),
                     f);
}

#endif /* MHA_SIMD_NEON_H */
