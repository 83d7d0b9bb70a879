/* SPDX-License-Identifier: MIT */
/* simd_avx512.h: a thin vocabulary over AVX-512F intrinsics (16 floats per vector) for the
 * AVX-512 kernels. Included only by files compiled with the AVX-512 flags (*_avx512.c).
 *
 * v16_exp: exp(x) for every float x, max error 1 ULP on [-87.3, 0] against exp rounded to float
 * (tests/test_kernels.c sweeps a dense grid; below -87.34 results are correctly scaled
 * subnormals, NaN stays NaN, -inf gives 0, overflow gives +inf).
 * v16_tanh: tanh(x), max error 2 ULP (same test).
 */
#ifndef MHA_SIMD_AVX512_H
#define MHA_SIMD_AVX512_H

#include "base/internal.h"

#include <immintrin.h>
#include <string.h>

#define MHA_INLINE static inline __attribute__((always_inline))

typedef __m512 v16;

MHA_INLINE v16 v16_zero(void) {
    return _mm512_setzero_ps();
}
MHA_INLINE v16 v16_set1(float x) {
    return _mm512_set1_ps(x);
}
MHA_INLINE v16 v16_load(const float *p) { /* 64-byte aligned */
    return _mm512_load_ps(p);
}
MHA_INLINE v16 v16_loadu(const float *p) {
    return _mm512_loadu_ps(p);
}
/* Lanes whose bit is clear read as 0 and are not accessed (no fault past an array's end). */
MHA_INLINE v16 v16_loadu_mask(__mmask16 k, const float *p) {
    return _mm512_maskz_loadu_ps(k, p);
}
MHA_INLINE void v16_store(float *p, v16 x) { /* 64-byte aligned */
    _mm512_store_ps(p, x);
}
MHA_INLINE void v16_storeu_mask(float *p, __mmask16 k, v16 x) {
    _mm512_mask_storeu_ps(p, k, x);
}
MHA_INLINE v16 v16_add(v16 a, v16 b) {
    return _mm512_add_ps(a, b);
}
MHA_INLINE v16 v16_sub(v16 a, v16 b) {
    return _mm512_sub_ps(a, b);
}
MHA_INLINE v16 v16_mul(v16 a, v16 b) {
    return _mm512_mul_ps(a, b);
}
/* a * b + c with one rounding. */
MHA_INLINE v16 v16_fma(v16 a, v16 b, v16 c) {
    return _mm512_fmadd_ps(a, b, c);
}
/* max(x, acc) that ignores a NaN x: VMAXPS returns its second operand when either is NaN. */
MHA_INLINE v16 v16_max_nan_ignoring(v16 x, v16 acc) {
    return _mm512_max_ps(x, acc);
}
/* Lanes with a clear bit in k become `other`. */
MHA_INLINE v16 v16_select(__mmask16 k, v16 x, v16 other) {
    return _mm512_mask_blend_ps(k, other, x);
}
MHA_INLINE float v16_hmax(v16 x) {
    return _mm512_reduce_max_ps(x);
}
MHA_INLINE float v16_hsum(v16 x) {
    return _mm512_reduce_add_ps(x);
}
/* Mask of the first n lanes (0 <= n <= 16). */
MHA_INLINE __mmask16 v16_first(int n) {
    return (__mmask16)(n >= 16 ? 0xFFFFu : ((1u << n) - 1u));
}

/* exp(x) = 2^k * e^r, k = round(x / ln 2), r = x - k ln 2 in [-ln2/2, ln2/2].
 * e^r ~ 1 + r (1 + r (c2 + r (c3 + r (c4 + r (c5 + r c6))))): coefficients fitted for this project
 * (Lawson's iteratively reweighted least squares for minimax relative error on 4001 Chebyshev
 * points of [-ln2/2, ln2/2]), max relative error 3.8e-9 (0.06 ULP) after rounding them to float.
 * ln 2 = LN2_HI + LN2_LO (LN2_HI = ln 2 rounded to float); with FMA, r = x - k LN2_HI is exact
 * for |k| <= 150, so the reduction adds < 2^-50 absolute error. 2^k is applied with VSCALEFPS,
 * which rounds subnormal results correctly and saturates to 0 / +inf. */
#define MHA_EXP_LOG2E  0x1.715476p+0f   /* 1 / ln 2, rounded to float */
#define MHA_EXP_LN2_HI 0x1.62e430p-1f   /* ln 2 rounded to float */
#define MHA_EXP_LN2_LO -0x1.05c610p-29f /* ln 2 - LN2_HI, rounded to float */
#define MHA_EXP_C2     0x1.fffffcp-2f
#define MHA_EXP_C3     0x1.555492p-3f
#define MHA_EXP_C4     0x1.5558f2p-5f
#define MHA_EXP_C5     0x1.1239d4p-7f
#define MHA_EXP_C6     0x1.6a244cp-10f
#define MHA_EXP_XMIN   -0x1.a0p+6f    /* -104: exp is below half the smallest subnormal */
#define MHA_EXP_XMAX   0x1.633334p+6f /* 88.8: exp overflows float */
#define MHA_EXP_ROUND  0x1.8p+23f     /* adding it rounds |y| < 2^22 to an integer */

/* exp for x in [XMIN, XMAX] or NaN (no clamping). */
MHA_INLINE v16 v16_exp_unclamped(v16 x) {
    const v16 t = v16_fma(x, v16_set1(MHA_EXP_LOG2E), v16_set1(MHA_EXP_ROUND));
    const v16 k = v16_sub(t, v16_set1(MHA_EXP_ROUND));
    v16 r = v16_fma(k, v16_set1(-MHA_EXP_LN2_HI), x);
    r = v16_fma(k, v16_set1(-MHA_EXP_LN2_LO), r);
    v16 q = v16_set1(MHA_EXP_C6);
    q = v16_fma(q, r, v16_set1(MHA_EXP_C5));
    q = v16_fma(q, r, v16_set1(MHA_EXP_C4));
    q = v16_fma(q, r, v16_set1(MHA_EXP_C3));
    q = v16_fma(q, r, v16_set1(MHA_EXP_C2));
    q = v16_fma(q, r, v16_set1(1.0f));
    return _mm512_scalef_ps(v16_fma(q, r, v16_set1(1.0f)), k);
}

/* exp(x) for x <= 0 or NaN (x - max in a softmax), flushed to 0 below MHA_EXP_FLUSH: there
 * e^x < 2^-124 only contributes below 2^-100 of the row's largest term, and producing it would
 * cost a microcode assist per vector on Intel cores (subnormal or underflowing results), which
 * every masked (-inf) lane would otherwise pay. */
#define MHA_EXP_FLUSH -0x1.58p+6f /* -86 */

MHA_INLINE v16 v16_exp_nonpos(v16 x) {
    const __mmask16 keep = _mm512_cmp_ps_mask(x, v16_set1(MHA_EXP_FLUSH), _CMP_NLT_UQ);
    x = _mm512_max_ps(v16_set1(MHA_EXP_FLUSH), x); /* NaN x passes (second operand) */
    const v16 t = v16_fma(x, v16_set1(MHA_EXP_LOG2E), v16_set1(MHA_EXP_ROUND));
    const v16 k = v16_sub(t, v16_set1(MHA_EXP_ROUND));
    v16 r = v16_fma(k, v16_set1(-MHA_EXP_LN2_HI), x);
    r = v16_fma(k, v16_set1(-MHA_EXP_LN2_LO), r);
    v16 q = v16_set1(MHA_EXP_C6);
    q = v16_fma(q, r, v16_set1(MHA_EXP_C5));
    q = v16_fma(q, r, v16_set1(MHA_EXP_C4));
    q = v16_fma(q, r, v16_set1(MHA_EXP_C3));
    q = v16_fma(q, r, v16_set1(MHA_EXP_C2));
    q = v16_fma(q, r, v16_set1(1.0f));
    return _mm512_maskz_scalef_ps(keep, v16_fma(q, r, v16_set1(1.0f)), k);
}

MHA_INLINE v16 v16_exp(v16 x) {
    x = _mm512_max_ps(v16_set1(MHA_EXP_XMIN), x); /* NaN x passes (second operand) */
    return v16_exp_unclamped(_mm512_min_ps(v16_set1(MHA_EXP_XMAX), x));
}

/* Horizontal max / sum of four vectors at once: 128-bit block k of the result holds, in each of
 * its lanes, the max / sum of the 16 lanes of the k-th argument (13 operations instead of 32). */
MHA_INLINE v16 v16_hmax4(v16 a, v16 b, v16 c, v16 d) {
    const v16 ab =
        _mm512_max_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const v16 cd =
        _mm512_max_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    v16 x = _mm512_max_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    x = _mm512_max_ps(x, _mm512_permute_ps(x, 0x4E));
    return _mm512_max_ps(x, _mm512_permute_ps(x, 0xB1));
}
/* v16_hsum4's first two stages: lane i of 128-bit block k holds c0 + c2 + (c1 + c3), the lanes i
 * of the four 128-bit blocks c0..c3 of the k-th argument (the sum of its 16 lanes is then
 * (l0 + l2) + (l1 + l3) over the block's lanes l0..l3). */
MHA_INLINE v16 v16_hsum4_blocks(v16 a, v16 b, v16 c, v16 d) {
    const v16 ab =
        _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const v16 cd =
        _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
}
MHA_INLINE v16 v16_hsum4(v16 a, v16 b, v16 c, v16 d) {
    v16 x = v16_hsum4_blocks(a, b, c, d);
    x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E));
    return _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));
}
/* The sums of 16 vectors acc[x][y] at once, each added in v16_hsum4's order (the same bits):
 * lane 4 y + x of the result = the sum of the 16 lanes of acc[x][y]. Rows x >= nr are not read
 * (their lanes hold 0). The last two stages of four v16_hsum4 run on full vectors: 45 operations
 * instead of 52, with 4 independent chains instead of 4 x 4 lanes of one vector each. */
MHA_INLINE v16 v16_hsum16(int nr, const v16 acc[4][4]) {
    v16 b[4];
    for (int x = 0; x < 4; x++)
        b[x] = x < nr ? v16_hsum4_blocks(acc[x][0], acc[x][1], acc[x][2], acc[x][3]) : v16_zero();
    /* lanes of block y: (l0 + l2, l1 + l3) of rows 0 and 1, then of rows 2 and 3 */
    const v16 r01 =
        _mm512_add_ps(_mm512_shuffle_ps(b[0], b[1], 0x44), _mm512_shuffle_ps(b[0], b[1], 0xEE));
    const v16 r23 =
        _mm512_add_ps(_mm512_shuffle_ps(b[2], b[3], 0x44), _mm512_shuffle_ps(b[2], b[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(r01, r23, 0x88), _mm512_shuffle_ps(r01, r23, 0xDD));
}

/* tanh(x): |x| < 0.625: x + x^3 (t1 + t2 x^2 + ... + t5 x^8), coefficients fitted like exp's
 * (minimax relative error on [0, 0.625], 8.5e-9 after rounding to float); otherwise
 * sign(x) (1 - 2 / (exp(2|x|) + 1)), where tanh >= 0.55 keeps the cancellation harmless. */
#define MHA_TANH_SPLIT 0x1.4p-1f /* 0.625 */
#define MHA_TANH_T1    -0x1.555532p-2f
#define MHA_TANH_T2    0x1.110726p-3f
#define MHA_TANH_T3    -0x1.b83c5ap-5f
#define MHA_TANH_T4    0x1.522698p-6f
#define MHA_TANH_T5    -0x1.75e1c0p-8f

MHA_INLINE v16 v16_tanh(v16 x) {
    const v16 ax = _mm512_abs_ps(x);
    const v16 x2 = v16_mul(x, x);
    v16 q = v16_set1(MHA_TANH_T5);
    q = v16_fma(q, x2, v16_set1(MHA_TANH_T4));
    q = v16_fma(q, x2, v16_set1(MHA_TANH_T3));
    q = v16_fma(q, x2, v16_set1(MHA_TANH_T2));
    q = v16_fma(q, x2, v16_set1(MHA_TANH_T1));
    const v16 small = v16_fma(v16_mul(x, x2), q, x);
    const v16 e = v16_exp(v16_add(ax, ax));
    v16 big = v16_sub(v16_set1(1.0f), _mm512_div_ps(v16_set1(2.0f), v16_add(e, v16_set1(1.0f))));
    /* copy the sign of x onto big (|big| = big >= 0) */
    big = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(big),
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u))));
    const __mmask16 is_small = _mm512_cmp_ps_mask(ax, v16_set1(MHA_TANH_SPLIT), _CMP_LT_OQ);
    return v16_select(is_small, small, big);
}

/* Philox4x32-10 (Salmon et al., SC'11; the constants are the paper's, as in src/base/philox.c), 16
 * counters at once, returning only output word 0 (what dropout uses). 32x32 -> 64-bit products:
 * VPMULUDQ multiplies the even 32-bit lanes; the odd lanes are shifted down and multiplied too. */
#define MHA_PHILOX_M0 0xD2511F53u
#define MHA_PHILOX_M1 0xCD9E8D57u
#define MHA_PHILOX_W0 0x9E3779B9u
#define MHA_PHILOX_W1 0xBB67AE85u

MHA_INLINE void v16i_mul_hilo(__m512i a, __m512i m, __m512i *hi, __m512i *lo) {
    const __m512i even = _mm512_mul_epu32(a, m);
    const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
    *lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
    *hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

MHA_INLINE __m512i
v16i_philox_word0(__m512i c0, __m512i c1, __m512i c2, __m512i c3, uint32_t k0, uint32_t k1) {
    const __m512i m0 = _mm512_set1_epi32((int)MHA_PHILOX_M0);
    const __m512i m1 = _mm512_set1_epi32((int)MHA_PHILOX_M1);
    for (int round = 0; round < 9; round++) {
        __m512i hi0, lo0, hi1, lo1;
        v16i_mul_hilo(c0, m0, &hi0, &lo0);
        v16i_mul_hilo(c2, m1, &hi1, &lo1);
        /* 0x96: a ^ b ^ c */
        c0 = _mm512_ternarylogic_epi32(hi1, c1, _mm512_set1_epi32((int)k0), 0x96);
        c2 = _mm512_ternarylogic_epi32(hi0, c3, _mm512_set1_epi32((int)k1), 0x96);
        c1 = lo1;
        c3 = lo0;
        k0 += MHA_PHILOX_W0;
        k1 += MHA_PHILOX_W1;
    }
    __m512i hi1, lo1;
    v16i_mul_hilo(c2, m1, &hi1, &lo1);
    return _mm512_ternarylogic_epi32(hi1, c1, _mm512_set1_epi32((int)k0), 0x96);
}

/* In-register transpose of 16 vectors of 16 floats (r[i][c] -> r[c][i]; any 32-bit lanes): pairs of
 * rows are interleaved (unpack ps), then pairs of pairs (unpack pd); each 128-bit lane then holds
 * 4x4 blocks, which two rounds of 128-bit lane shuffles put in place. */
MHA_INLINE void v16_transpose16(v16 r[16]) {
    v16 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    /* u[4q + k] holds, in lane L, column 4L + k of rows 4q .. 4q+3. */
    for (int q = 0; q < 4; q++) {
        const __m512d a = _mm512_castps_pd(t[4 * q]), b = _mm512_castps_pd(t[4 * q + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * q + 2]), d = _mm512_castps_pd(t[4 * q + 3]);
        u[4 * q + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int k = 0; k < 4; k++) {
        const v16 v = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);
        const v16 w = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xdd);
        const v16 x = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
        const v16 y = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xdd);
        r[k] = _mm512_shuffle_f32x4(v, x, 0x88);
        r[8 + k] = _mm512_shuffle_f32x4(v, x, 0xdd);
        r[4 + k] = _mm512_shuffle_f32x4(w, y, 0x88);
        r[12 + k] = _mm512_shuffle_f32x4(w, y, 0xdd);
    }
}

/* q8_0 rows (docs/SEMANTICS.md "q8_0 KV cache"): element d lives in block d / 32 (34 bytes: a
 * float16 scale, then 32 int8), byte 2 + d % 32. v16_q8_scale broadcasts the scale s of the block
 * holding element d; v16_q8_widen widens the 16 values [d, d + 16) (d % 16 == 0) with it, exactly
 * (the values equal mha__q8_dequantize's q s): VPMOVSXBD, VCVTDQ2PS (exact, |q| <= 127), then
 * VMULPS by s, exact too: q s has 8 + 11 significant bits. On the Zen 5 host (microbenchmark of
 * each instruction against 16 independent FMAs, session 39) VCVTDQ2PS does not take an FMA pipe
 * (two per cycle beside the FMAs, like VADDPS), so this costs one FMA-pipe operation per vector
 * and none per block. (Until session 39: VPADDD of the bits of C = 1.5 * 2^23 and one FMSUB
 * (C + q) s - C s, which is the same value but needs C s, a VMULSS on an FMA pipe, per block.)
 * One scale serves two vectors. */
MHA_INLINE v16 v16_q8_scale(const void *row, int64_t d) {
    uint16_t h;
    memcpy(&h, (const char *)row + (d >> 5) * MHA__Q8_BYTES, 2);
    return _mm512_set1_ps(_cvtsh_ss(h));
}
MHA_INLINE v16 v16_q8_widen(const void *row, int64_t d, v16 s) {
    const char *q = (const char *)row + (d >> 5) * MHA__Q8_BYTES + 2 + (d & 31);
    return _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), s);
}

/* fp8 e4m3 (docs/SEMANTICS.md "fp8 KV cache"): the 16 bytes b as float32 e4m3 values times 2^-8
 * (the kernels fold 2^8 and the kv head's scale into the scores and o): the bits S.EEEE.MMM
 * become the float16 S.0EEEE.MMM0000000 ((sign-extended b << 7) & 0xBF80: e4m3's bias 7 is
 * float16's 15 minus 8, subnormals included), then VCVTPH2PS; S.1111.111 (NaN) reads NaN.
 * v16_fp8_widen_finite skips the NaN fix-up: for bytes fp8_has_nan (below) found free of NaN. */
MHA_INLINE v16 v16_fp8_widen_finite(__m128i b) {
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                            _mm256_set1_epi16((short)0xBF80)));
}
MHA_INLINE v16 v16_fp8_widen(__m128i b) {
    const __mmask16 nan =
        _mm_cmpeq_epi8_mask(_mm_or_si128(b, _mm_set1_epi8((char)0x80)), _mm_set1_epi8((char)0xFF));
    return _mm512_mask_mov_ps(v16_fp8_widen_finite(b), nan, _mm512_set1_ps(__builtin_nanf("")));
}

/* Whether the n bytes of fp8 e4m3 at p hold a NaN (S.1111.111): one compare per 64 bytes, so a
 * kernel can test a row once and widen it with v16_fp8_widen_finite (no NaN fix-up per vector)
 * when it has none. */
MHA_INLINE int fp8_has_nan(const void *p, int64_t n) {
    __mmask64 any = 0;
    for (int64_t i = 0; i < n; i += 64) {
        const __mmask64 in = n - i >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (n - i)) - 1;
        const __m512i x = _mm512_maskz_loadu_epi8(in, (const char *)p + i);
        any |= _mm512_cmpeq_epi8_mask(_mm512_or_si512(x, _mm512_set1_epi8((char)0x80)),
                                      _mm512_set1_epi8((char)0xFF));
    }
    return any != 0;
}

/* bfloat16 rows in the decode kernel's contiguous path are widened 32 elements at a time, even and
 * odd elements apart: one 64-byte load, then a 16-bit left shift gives the even elements as float32
 * and clearing the low halves gives the odd ones (1 vector operation per 16 elements, against 2 for
 * VPMOVZXWD + VPSLLD). Dot products take q in the same even/odd order; pass 3 accumulates o in it
 * and restores the natural order at the end of the unit. Elements [d, d + 32) of a row: half 0 =
 * the even ones, half 1 = the odd ones. */
MHA_INLINE v16 v16_bf16_half(const char *row, int64_t d, int half) {
    const __m512i x = _mm512_loadu_si512((const uint16_t *)row + d);
    return _mm512_castsi512_ps(half ? _mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u))
                                    : _mm512_slli_epi32(x, 16));
}

/* fp8 rows in pass 3 of the contiguous path are widened like bfloat16 (v16_bf16_half), 32 elements
 * at a time, even and odd elements apart, without the cross-lane VPMOVSXBW of v16_fp8_widen: one
 * 32-byte load as 16-bit words, the even bytes' float16 rebias ((w << 8) >>a 1) & 0xBF80, the
 * odd bytes' (w >>a 1) & 0xBF80 (the bits of v16_fp8_widen), then VCVTPH2PS. On the Zen 5 host
 * VPMOVSXBW and VCVTPH2PS share the shuffle pipes, which bound this pass (microbenchmarks,
 * session 39); the shifts do not. o is accumulated in the even/odd order and restored at the end
 * of the unit, so each output element's sum is the same. FIN: the row holds no NaN byte
 * (fp8_has_nan); else NaN bytes read NaN. Elements [d, d + 32) of a row: half 0 = the even ones,
 * half 1 = the odd ones. */
MHA_INLINE v16 v16_fp8_half(const int FIN, const char *row, int64_t d, int half) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)(row + d));
    const __m256i h = _mm256_and_si256(_mm256_srai_epi16(half ? w : _mm256_slli_epi16(w, 8), 1),
                                       _mm256_set1_epi16((short)0xBF80));
    const v16 f = _mm512_cvtph_ps(h);
    if (FIN)
        return f;
    const __m256i low7 = _mm256_set1_epi16(half ? 0x7F00 : 0x007F);
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(w, low7), low7);
    return _mm512_mask_mov_ps(f, nan, _mm512_set1_ps(__builtin_nanf("")));
}

#endif /* MHA_SIMD_AVX512_H */
