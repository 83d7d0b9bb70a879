/* SPDX-License-Identifier: MIT */
/* attn_bwd_flash_avx512.c: AVX-512 arithmetic of the flash backward (bwd_flash.h). Compiled with
 * -mavx512f -mavx512dq -mavx512bw -mavx512vl -mfma; only called when dispatch detects AVX-512.
 *
 * gemm_acc: C[R, N] += A[R, K] B[K, N] with a 4-row x 64-column register block (16 zmm
 * accumulators in named variables, 4 B loads and 4 broadcasts per 16 FMAs), 4 x 32 and 4 x 48
 * blocks for column tails of at most 32 and 48; column tails use masked loads/stores, row tails a
 * 1-row version of the same loop. Every call of the backward has N <= max(64, d), so one or a few
 * column blocks cover it. Each C element is one FMA chain in increasing k. exp_shift uses the
 * forward kernels' v16_exp (simd_avx512.h, 1 ULP on [-87.3, 0]); softmax_grad is the generic
 * formula 16 lanes at a time, each product rounded as there.
 */
#include "kernels/bwd_flash.h"
#include "kernels/x86/simd_avx512.h"

/* Rows [0, 4), columns [0, 16 NV) clipped to N by the masks, NV = 4, 3 or 2 (a compile-time
 * constant in every call: the columns past 16 NV then vanish). The 2- and 3-vector versions take
 * a column tail of at most 32 (d = 80, 96, 160) or 48 (d = 112, 176, 240), where the 64-column
 * block spent a quarter to three quarters of its FMAs on masked-off lanes. 16, 12 or 8
 * accumulators, as many chains as the FMA latency needs at two 512-bit FMAs per cycle. The
 * accumulators are named variables, not an array: gcc 12 keeps an acc[4][4] array on the stack and
 * stores it every iteration (measured 2.5x slower). */
MHA_INLINE void gemm_block_4(const int NV,
                             int64_t K,
                             const float *A,
                             int64_t sa,
                             int64_t sk,
                             const float *B,
                             int64_t ldb,
                             float *C,
                             int64_t ldc,
                             const __mmask16 mk[4]) {
    const __mmask16 m0 = mk[0], m1 = mk[1], m2 = NV >= 3 ? mk[2] : 0, m3 = NV == 4 ? mk[3] : 0;
    float *c0 = C, *c1 = C + ldc, *c2 = C + 2 * ldc, *c3 = C + 3 * ldc;
    v16 a00 = v16_loadu_mask(m0, c0), a01 = v16_loadu_mask(m1, c0 + 16);
    v16 a10 = v16_loadu_mask(m0, c1), a11 = v16_loadu_mask(m1, c1 + 16);
    v16 a20 = v16_loadu_mask(m0, c2), a21 = v16_loadu_mask(m1, c2 + 16);
    v16 a30 = v16_loadu_mask(m0, c3), a31 = v16_loadu_mask(m1, c3 + 16);
    v16 a02 = v16_zero(), a03 = v16_zero(), a12 = v16_zero(), a13 = v16_zero();
    v16 a22 = v16_zero(), a23 = v16_zero(), a32 = v16_zero(), a33 = v16_zero();
    if (NV >= 3) {
        a02 = v16_loadu_mask(m2, c0 + 32), a12 = v16_loadu_mask(m2, c1 + 32);
        a22 = v16_loadu_mask(m2, c2 + 32), a32 = v16_loadu_mask(m2, c3 + 32);
    }
    if (NV == 4) {
        a03 = v16_loadu_mask(m3, c0 + 48), a13 = v16_loadu_mask(m3, c1 + 48);
        a23 = v16_loadu_mask(m3, c2 + 48), a33 = v16_loadu_mask(m3, c3 + 48);
    }
    for (int64_t k = 0; k < K; k++) {
        const float *bk = B + k * ldb, *ak = A + k * sk;
        const v16 b0 = v16_loadu_mask(m0, bk), b1 = v16_loadu_mask(m1, bk + 16);
        const v16 x0 = v16_set1(ak[0 * sa]), x1 = v16_set1(ak[1 * sa]);
        const v16 x2 = v16_set1(ak[2 * sa]), x3 = v16_set1(ak[3 * sa]);
        a00 = v16_fma(x0, b0, a00), a01 = v16_fma(x0, b1, a01);
        a10 = v16_fma(x1, b0, a10), a11 = v16_fma(x1, b1, a11);
        a20 = v16_fma(x2, b0, a20), a21 = v16_fma(x2, b1, a21);
        a30 = v16_fma(x3, b0, a30), a31 = v16_fma(x3, b1, a31);
        if (NV >= 3) {
            const v16 b2 = v16_loadu_mask(m2, bk + 32);
            a02 = v16_fma(x0, b2, a02), a12 = v16_fma(x1, b2, a12);
            a22 = v16_fma(x2, b2, a22), a32 = v16_fma(x3, b2, a32);
        }
        if (NV == 4) {
            const v16 b3 = v16_loadu_mask(m3, bk + 48);
            a03 = v16_fma(x0, b3, a03), a13 = v16_fma(x1, b3, a13);
            a23 = v16_fma(x2, b3, a23), a33 = v16_fma(x3, b3, a33);
        }
    }
    v16_storeu_mask(c0, m0, a00), v16_storeu_mask(c0 + 16, m1, a01);
    v16_storeu_mask(c1, m0, a10), v16_storeu_mask(c1 + 16, m1, a11);
    v16_storeu_mask(c2, m0, a20), v16_storeu_mask(c2 + 16, m1, a21);
    v16_storeu_mask(c3, m0, a30), v16_storeu_mask(c3 + 16, m1, a31);
    if (NV >= 3) {
        v16_storeu_mask(c0 + 32, m2, a02), v16_storeu_mask(c1 + 32, m2, a12);
        v16_storeu_mask(c2 + 32, m2, a22), v16_storeu_mask(c3 + 32, m2, a32);
    }
    if (NV == 4) {
        v16_storeu_mask(c0 + 48, m3, a03), v16_storeu_mask(c1 + 48, m3, a13);
        v16_storeu_mask(c2 + 48, m3, a23), v16_storeu_mask(c3 + 48, m3, a33);
    }
}

static void gemm_block_1(int64_t K,
                         const float *A,
                         int64_t sk,
                         const float *B,
                         int64_t ldb,
                         float *C,
                         int64_t ldc,
                         const __mmask16 mk[4]) {
    (void)ldc;
    const __mmask16 m0 = mk[0], m1 = mk[1], m2 = mk[2], m3 = mk[3];
    v16 a0 = v16_loadu_mask(m0, C), a1 = v16_loadu_mask(m1, C + 16);
    v16 a2 = v16_loadu_mask(m2, C + 32), a3 = v16_loadu_mask(m3, C + 48);
    for (int64_t k = 0; k < K; k++) {
        const float *bk = B + k * ldb;
        const v16 x = v16_set1(A[k * sk]);
        a0 = v16_fma(x, v16_loadu_mask(m0, bk), a0);
        a1 = v16_fma(x, v16_loadu_mask(m1, bk + 16), a1);
        a2 = v16_fma(x, v16_loadu_mask(m2, bk + 32), a2);
        a3 = v16_fma(x, v16_loadu_mask(m3, bk + 48), a3);
    }
    v16_storeu_mask(C, m0, a0), v16_storeu_mask(C + 16, m1, a1);
    v16_storeu_mask(C + 32, m2, a2), v16_storeu_mask(C + 48, m3, a3);
}

static void gemm_acc_avx512(int64_t R,
                            int64_t K,
                            int64_t N,
                            const float *A,
                            int64_t sa,
                            int64_t sk,
                            const float *B,
                            int64_t ldb,
                            float *C,
                            int64_t ldc) {
    for (int64_t j0 = 0; j0 < N; j0 += 64) {
        __mmask16 mk[4];
        for (int v = 0; v < 4; v++) {
            const int64_t left = N - j0 - 16 * v;
            mk[v] = v16_first(left <= 0 ? 0 : (left >= 16 ? 16 : (int)left));
        }
        int64_t r = 0;
        if (N - j0 <= 32)
            for (; r + 4 <= R; r += 4)
                gemm_block_4(2, K, A + r * sa, sa, sk, B + j0, ldb, C + r * ldc + j0, ldc, mk);
        if (N - j0 <= 48)
            for (; r + 4 <= R; r += 4)
                gemm_block_4(3, K, A + r * sa, sa, sk, B + j0, ldb, C + r * ldc + j0, ldc, mk);
        for (; r + 4 <= R; r += 4)
            gemm_block_4(4, K, A + r * sa, sa, sk, B + j0, ldb, C + r * ldc + j0, ldc, mk);
        for (; r < R; r++)
            gemm_block_1(K, A + r * sa, sk, B + j0, ldb, C + r * ldc + j0, ldc, mk);
    }
}

static void exp_shift_avx512(const float *x, float scale, float c, float *y, int64_t count) {
    const v16 sv = v16_set1(scale), cv = v16_set1(c);
    for (int64_t i = 0; i < count; i += 16) {
        const __mmask16 k = v16_first(count - i < 16 ? (int)(count - i) : 16);
        v16_storeu_mask(y + i, k, v16_exp(v16_sub(v16_mul(sv, v16_loadu_mask(k, x + i)), cv)));
    }
}

static void softmax_grad_avx512(const float *P, float D, float scale, float *dp, int64_t count) {
    const v16 dv = v16_set1(D), sv = v16_set1(scale);
    for (int64_t i = 0; i < count; i += 16) {
        const __mmask16 k = v16_first(count - i < 16 ? (int)(count - i) : 16);
        const v16 pv = v16_loadu_mask(k, P + i);
        const __mmask16 seen = _mm512_cmp_ps_mask(pv, v16_zero(), _CMP_NEQ_UQ);
        const v16 g = v16_mul(sv, v16_mul(pv, v16_sub(v16_loadu_mask(k, dp + i), dv)));
        v16_storeu_mask(dp + i, k, _mm512_maskz_mov_ps(seen, g));
    }
}

static const mha__bwd_flash_ops avx512_ops = {gemm_acc_avx512, exp_shift_avx512,
                                              softmax_grad_avx512};

void mha_bwd_f32_flash_q32k64__avx512(const mha__bwd_problem *bp,
                                      int64_t b,
                                      int64_t g,
                                      void *scratch) {
    mha__bwd_flash_unit(&avx512_ops, bp, b, g, scratch);
}
