/* SPDX-License-Identifier: MIT */
/* simd_avx2.h: a thin vocabulary over AVX2 + FMA intrinsics (8 floats per vector) for the AVX2
 * kernels. Included only by files compiled with the AVX2 flags (*_avx2.c).
 *
 * v8_exp: exp(x) for every float x, max error 1 ULP on [-87.3, 0] against exp rounded to float
 * (tests/test_kernels.c sweeps a dense grid; subnormal results are correctly scaled, NaN stays
 * NaN, -inf gives 0, overflow gives +inf). Same polynomial as simd_avx512.h.
 * v8_tanh: tanh(x), max error 2 ULP (same test).
 */
#ifndef MHA_SIMD_AVX2_H
#define MHA_SIMD_AVX2_H

#include "base/internal.h"

#include <immintrin.h>
#include <string.h>

#define MHA_INLINE static inline __attribute__((always_inline))

typedef __m256 v8;

MHA_INLINE v8 v8_zero(void) {
    return _mm256_setzero_ps();
}
MHA_INLINE v8 v8_set1(float x) {
    return _mm256_set1_ps(x);
}
MHA_INLINE v8 v8_load(const float *p) { /* 32-byte aligned */
    return _mm256_load_ps(p);
}
MHA_INLINE v8 v8_loadu(const float *p) {
    return _mm256_loadu_ps(p);
}
MHA_INLINE void v8_store(float *p, v8 x) { /* 32-byte aligned */
    _mm256_store_ps(p, x);
}
/* All-ones lanes for lanes whose bit in `bits` (8 bits) is set. */
MHA_INLINE __m256i v8_mask_from_bits(unsigned bits) {
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), sel), sel);
}
/* Mask of the first n lanes (0 <= n <= 8). */
MHA_INLINE __m256i v8_first(int n) {
    return v8_mask_from_bits(n >= 8 ? 0xFFu : ((1u << n) - 1u));
}
/* Masked-off lanes read as 0 and are not accessed. */
MHA_INLINE v8 v8_loadu_mask(__m256i k, const float *p) {
    return _mm256_maskload_ps(p, k);
}
MHA_INLINE void v8_storeu_mask(float *p, __m256i k, v8 x) {
    _mm256_maskstore_ps(p, k, x);
}
MHA_INLINE v8 v8_add(v8 a, v8 b) {
    return _mm256_add_ps(a, b);
}
MHA_INLINE v8 v8_sub(v8 a, v8 b) {
    return _mm256_sub_ps(a, b);
}
MHA_INLINE v8 v8_mul(v8 a, v8 b) {
    return _mm256_mul_ps(a, b);
}
/* a * b + c with one rounding. */
MHA_INLINE v8 v8_fma(v8 a, v8 b, v8 c) {
    return _mm256_fmadd_ps(a, b, c);
}
/* max(x, acc) that ignores a NaN x: VMAXPS returns its second operand when either is NaN. */
MHA_INLINE v8 v8_max_nan_ignoring(v8 x, v8 acc) {
    return _mm256_max_ps(x, acc);
}
/* Lanes whose mask is clear become `other`. */
MHA_INLINE v8 v8_select(__m256i k, v8 x, v8 other) {
    return _mm256_blendv_ps(other, x, _mm256_castsi256_ps(k));
}
MHA_INLINE float v8_hmax(v8 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
MHA_INLINE float v8_hsum(v8 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp: see simd_avx512.h for the method and the origin of the constants. Without VSCALEFPS,
 * 2^k is applied as 2^(k - k/2) * 2^(k/2): both factors are normal floats for k in
 * [-150, 128], the first product is exact and the second rounds once, so subnormal results are
 * correctly rounded and large k overflows to +inf. */
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
MHA_INLINE v8 v8_exp_reduced(v8 x, v8 *t) {
    *t = v8_fma(x, v8_set1(MHA_EXP_LOG2E), v8_set1(MHA_EXP_ROUND));
    const v8 k = v8_sub(*t, v8_set1(MHA_EXP_ROUND));
    v8 r = v8_fma(k, v8_set1(-MHA_EXP_LN2_HI), x);
    r = v8_fma(k, v8_set1(-MHA_EXP_LN2_LO), r);
    v8 q = v8_set1(MHA_EXP_C6);
    q = v8_fma(q, r, v8_set1(MHA_EXP_C5));
    q = v8_fma(q, r, v8_set1(MHA_EXP_C4));
    q = v8_fma(q, r, v8_set1(MHA_EXP_C3));
    q = v8_fma(q, r, v8_set1(MHA_EXP_C2));
    q = v8_fma(q, r, v8_set1(1.0f));
    return v8_fma(q, r, v8_set1(1.0f));
}

/* exp for x in [XMIN, XMAX] or NaN (no clamping). */
MHA_INLINE v8 v8_exp_unclamped(v8 x) {
    v8 t;
    const v8 p = v8_exp_reduced(x, &t);
    /* the low bits of t hold k as a two's-complement integer */
    const __m256i ki =
        _mm256_sub_epi32(_mm256_castps_si256(t), _mm256_castps_si256(v8_set1(MHA_EXP_ROUND)));
    const __m256i k1 = _mm256_srai_epi32(ki, 1), k2 = _mm256_sub_epi32(ki, k1);
    const __m256i bias = _mm256_set1_epi32(127);
    const v8 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
    const v8 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
    return v8_mul(v8_mul(p, s1), s2);
}

/* 2^k as one float, (k + 127) << 23, for the k in t (see v8_exp_reduced) in [-126, 127]. Where
 * p 2^k is normal (or overflows) the product is exact (or +inf) and has the bits of the two-factor
 * product of v8_exp_unclamped, in 3 operations instead of 9. bits(t) - bits(ROUND) = k, so
 * k + 127 = bits(t) + (127 - bits(ROUND)); 0x4B400000 is the bits of MHA_EXP_ROUND = 1.5 2^23. */
MHA_INLINE v8 v8_pow2_normal(v8 t) {
    const __m256i bias = _mm256_set1_epi32(127 - 0x4B400000);
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_castps_si256(t), bias), 23));
}

/* exp(x) for x <= 0 or NaN, flushed to 0 below MHA_EXP_FLUSH (see simd_avx512.h: results under
 * 2^-124 are irrelevant in a softmax and would cost a microcode assist each). */
#define MHA_EXP_FLUSH -0x1.58p+6f /* -86 */

MHA_INLINE v8 v8_exp_nonpos(v8 x) {
    const v8 keep = _mm256_cmp_ps(x, v8_set1(MHA_EXP_FLUSH), _CMP_NLT_UQ);
    x = _mm256_max_ps(v8_set1(MHA_EXP_FLUSH), x); /* NaN x passes (second operand) */
    /* x >= -86 gives k >= -124: p 2^k is normal, and exact */
    v8 t;
    const v8 p = v8_exp_reduced(x, &t);
    return _mm256_and_ps(v8_mul(p, v8_pow2_normal(t)), keep);
}

/* exp for every float. A vector whose lanes are all in [MHA_EXP_FLUSH, 88] (or NaN) takes the
 * one-factor scaling of v8_exp_nonpos: k is in [-124, 127] there, 2^k is normal and the product
 * is exact or overflows alike, so the bits are those of v8_exp_unclamped. Any other vector takes
 * v8_exp_unclamped, whose two factors round subnormal results correctly and keep e^x finite up to
 * 88.72 (k = 128 has no one-factor float). */
MHA_INLINE v8 v8_exp(v8 x) {
    const v8 out = _mm256_or_ps(_mm256_cmp_ps(x, v8_set1(MHA_EXP_FLUSH), _CMP_LT_OQ),
                                _mm256_cmp_ps(x, v8_set1(88.0f), _CMP_GT_OQ));
    if (_mm256_movemask_ps(out)) {
        x = _mm256_max_ps(v8_set1(MHA_EXP_XMIN), x); /* NaN x passes (second operand) */
        return v8_exp_unclamped(_mm256_min_ps(v8_set1(MHA_EXP_XMAX), x));
    }
    v8 t;
    const v8 p = v8_exp_reduced(x, &t);
    return v8_mul(p, v8_pow2_normal(t));
}

/* tanh: see simd_avx512.h. */
#define MHA_TANH_SPLIT 0x1.4p-1f
#define MHA_TANH_T1    -0x1.555532p-2f
#define MHA_TANH_T2    0x1.110726p-3f
#define MHA_TANH_T3    -0x1.b83c5ap-5f
#define MHA_TANH_T4    0x1.522698p-6f
#define MHA_TANH_T5    -0x1.75e1c0p-8f

MHA_INLINE v8 v8_tanh(v8 x) {
    const v8 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const v8 ax = _mm256_andnot_ps(sign, x);
    const v8 x2 = v8_mul(x, x);
    v8 q = v8_set1(MHA_TANH_T5);
    q = v8_fma(q, x2, v8_set1(MHA_TANH_T4));
    q = v8_fma(q, x2, v8_set1(MHA_TANH_T3));
    q = v8_fma(q, x2, v8_set1(MHA_TANH_T2));
    q = v8_fma(q, x2, v8_set1(MHA_TANH_T1));
    const v8 small = v8_fma(v8_mul(x, x2), q, x);
    const v8 e = v8_exp(v8_add(ax, ax));
    v8 big = v8_sub(v8_set1(1.0f), _mm256_div_ps(v8_set1(2.0f), v8_add(e, v8_set1(1.0f))));
    big = _mm256_or_ps(big, _mm256_and_ps(x, sign));
    const v8 is_small = _mm256_cmp_ps(ax, v8_set1(MHA_TANH_SPLIT), _CMP_LT_OQ);
    return _mm256_blendv_ps(big, small, is_small);
}

/* Philox4x32-10, 8 counters at once, output word 0 only (see simd_avx512.h). */
#define MHA_PHILOX_M0 0xD2511F53u
#define MHA_PHILOX_M1 0xCD9E8D57u
#define MHA_PHILOX_W0 0x9E3779B9u
#define MHA_PHILOX_W1 0xBB67AE85u

MHA_INLINE void v8i_mul_hilo(__m256i a, __m256i m, __m256i *hi, __m256i *lo) {
    const __m256i even = _mm256_mul_epu32(a, m);
    const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
    *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

MHA_INLINE __m256i
v8i_philox_word0(__m256i c0, __m256i c1, __m256i c2, __m256i c3, uint32_t k0, uint32_t k1) {
    const __m256i m0 = _mm256_set1_epi32((int)MHA_PHILOX_M0);
    const __m256i m1 = _mm256_set1_epi32((int)MHA_PHILOX_M1);
    for (int round = 0; round < 9; round++) {
        __m256i hi0, lo0, hi1, lo1;
        v8i_mul_hilo(c0, m0, &hi0, &lo0);
        v8i_mul_hilo(c2, m1, &hi1, &lo1);
        c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32((int)k0));
        c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32((int)k1));
        c1 = lo1;
        c3 = lo0;
        k0 += MHA_PHILOX_W0;
        k1 += MHA_PHILOX_W1;
    }
    __m256i hi1, lo1;
    v8i_mul_hilo(c2, m1, &hi1, &lo1);
    return _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32((int)k0));
}

/* q8_0 rows (docs/SEMANTICS.md "q8_0 KV cache"): element d lives in block d / 32 (34 bytes: a
 * float16 scale, then 32 int8), byte 2 + d % 32. v8_q8_scale broadcasts the scale s of the block
 * holding element d; v8_q8_widen widens the 8 values [d, d + 8) (d % 8 == 0) with it, exactly:
 * VPMOVSXBD, VCVTDQ2PS, VMULPS q s (q s fits a float32: 8 by 11 significant bits), as
 * v16_q8_widen (simd_avx512.h). The bits are those of the form used until session 39, the FMA
 * (C + q) s - C s after VPADDD of C = 1.5 2^23, for every scale the cache stores (0 with q = 0,
 * finite positive, NaN); that form costs one FMA plus C s, and on the AMD Zen 5 host the FMA pipes
 * are the limit of this kernel: the L2/L3-resident q8_0 step ran 10% faster (1 thread,
 * docs/INFERENCE.md). */
MHA_INLINE v8 v8_q8_scale(const void *row, int64_t d) {
    uint16_t h;
    memcpy(&h, (const char *)row + (d >> 5) * MHA__Q8_BYTES, 2);
    return _mm256_set1_ps(_cvtsh_ss(h));
}
MHA_INLINE v8 v8_q8_widen(const void *row, int64_t d, v8 s) {
    const char *q = (const char *)row + (d >> 5) * MHA__Q8_BYTES + 2 + (d & 31);
    return _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q))), s);
}

/* fp8 e4m3 (docs/SEMANTICS.md "fp8 KV cache"): e4m3 bytes as float32 values times 2^-8, as
 * v16_fp8_widen (simd_avx512.h). In 16-bit lanes, a = (sign-extended b) << 7 holds b's 7 low bits
 * at 13..7 and its sign at 15: h = a & 0xBF80 is the float16 S.0EEEE.MMM0000000; a NaN byte
 * (S.1111.111, bits 13..7 of h all set) gets bit 14 too, the float16 NaN 0x7F80: h + 0x80 carries
 * into bit 14 (clear in h) exactly then, so h | ((h + 0x80) & 0x4000) is the float16 for all 256
 * bytes (checked exhaustively; one vector op fewer than a VPCMPEQW test: the L2/L3-resident fp8
 * step ran 4% faster on the AMD Zen 5 host, AVX2 tier, 1 thread) (integer ops on
 * 16 values at once; a float compare + VBLENDVPS per 8 values ran the Zen 5 host's L = 32768
 * fp8 step in 9.7-20 ms, this in 8.6-9.0 ms, 1 thread). */
MHA_INLINE __m256i fp8_to_half16(__m256i w) {
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16((short)0xBF80));
    const __m256i nan = _mm256_add_epi16(h, _mm256_set1_epi16(0x0080));
    return _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x4000)));
}
/* the 8 bytes at p */
MHA_INLINE v8 v8_fp8_widen(const void *p) {
    const __m256i w =
        _mm256_castsi128_si256(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p)));
    return _mm256_cvtph_ps(_mm256_castsi256_si128(fp8_to_half16(w)));
}
/* the 16 bytes at p: *a = values 0..7, *b = 8..15 */
MHA_INLINE void v8_fp8_widen16(const void *p, v8 *a, v8 *b) {
    const __m256i h = fp8_to_half16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)));
    *a = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *b = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

#endif /* MHA_SIMD_AVX2_H */
