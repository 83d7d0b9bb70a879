/* SPDX-License-Identifier: MIT */
/* attn_bwd_flash_avx2.c: AVX2+FMA arithmetic of the flash backward (bwd_flash.h). Compiled with
 * -mavx2 -mfma; only called when dispatch detects AVX2.
 *
 * gemm_acc: C[R, N] += A[R, K] B[K, N] with a 4-row x 16-column register block (8 ymm
 * accumulators + 2 B vectors + 1 broadcast of the 16 ymm registers); masked column tails, 1-row
 * version for row tails. Each C element is one FMA chain in increasing k. exp_shift uses v8_exp.
 */
#include "kernels/bwd_flash.h"
#include "kernels/x86/simd_avx2.h"

/* Named accumulators (an array stays on the stack with gcc 12, see the AVX-512 file). */
static void gemm_block_4(int64_t K,
                         const float *A,
                         int64_t sa,
                         int64_t sk,
                         const float *B,
                         int64_t ldb,
                         float *C,
                         int64_t ldc,
                         const __m256i mk[2]) {
    const __m256i m0 = mk[0], m1 = mk[1];
    float *c0 = C, *c1 = C + ldc, *c2 = C + 2 * ldc, *c3 = C + 3 * ldc;
    v8 a00 = v8_loadu_mask(m0, c0), a01 = v8_loadu_mask(m1, c0 + 8);
    v8 a10 = v8_loadu_mask(m0, c1), a11 = v8_loadu_mask(m1, c1 + 8);
    v8 a20 = v8_loadu_mask(m0, c2), a21 = v8_loadu_mask(m1, c2 + 8);
    v8 a30 = v8_loadu_mask(m0, c3), a31 = v8_loadu_mask(m1, c3 + 8);
    for (int64_t k = 0; k < K; k++) {
        const float *bk = B + k * ldb, *ak = A + k * sk;
        const v8 b0 = v8_loadu_mask(m0, bk), b1 = v8_loadu_mask(m1, bk + 8);
        v8 x = v8_set1(ak[0 * sa]);
        a00 = v8_fma(x, b0, a00), a01 = v8_fma(x, b1, a01);
        x = v8_set1(ak[1 * sa]);
        a10 = v8_fma(x, b0, a10), a11 = v8_fma(x, b1, a11);
        x = v8_set1(ak[2 * sa]);
        a20 = v8_fma(x, b0, a20), a21 = v8_fma(x, b1, a21);
        x = v8_set1(ak[3 * sa]);
        a30 = v8_fma(x, b0, a30), a31 = v8_fma(x, b1, a31);
    }
    v8_storeu_mask(c0, m0, a00), v8_storeu_mask(c0 + 8, m1, a01);
    v8_storeu_mask(c1, m0, a10), v8_storeu_mask(c1 + 8, m1, a11);
    v8_storeu_mask(c2, m0, a20), v8_storeu_mask(c2 + 8, m1, a21);
    v8_storeu_mask(c3, m0, a30), v8_storeu_mask(c3 + 8, m1, a31);
}

static void gemm_block_1(int64_t K,
                         const float *A,
                         int64_t sk,
                         const float *B,
                         int64_t ldb,
                         float *C,
                         int64_t ldc,
                         const __m256i mk[2]) {
    (void)ldc;
    const __m256i m0 = mk[0], m1 = mk[1];
    v8 a0 = v8_loadu_mask(m0, C), a1 = v8_loadu_mask(m1, C + 8);
    for (int64_t k = 0; k < K; k++) {
        const float *bk = B + k * ldb;
        const v8 x = v8_set1(A[k * sk]);
        a0 = v8_fma(x, v8_loadu_mask(m0, bk), a0);
        a1 = v8_fma(x, v8_loadu_mask(m1, bk + 8), a1);
    }
    v8_storeu_mask(C, m0, a0), v8_storeu_mask(C + 8, m1, a1);
}

static void gemm_acc_avx2(int64_t R,
                          int64_t K,
                          int64_t N,
                          const float *A,
                          int64_t sa,
                          int64_t sk,
                          const float *B,
                          int64_t ldb,
                          float *C,
                          int64_t ldc) {
    for (int64_t j0 = 0; j0 < N; j0 += 16) {
        __m256i mk[2];
        for (int v = 0; v < 2; v++) {
            const int64_t left = N - j0 - 8 * v;
            mk[v] = v8_first(left <= 0 ? 0 : (left >= 8 ? 8 : (int)left));
        }
        int64_t r = 0;
        for (; r + 4 <= R; r += 4)
            gemm_block_4(K, A + r * sa, sa, sk, B + j0, ldb, C + r * ldc + j0, ldc, mk);
        for (; r < R; r++)
            gemm_block_1(K, A + r * sa, sk, B + j0, ldb, C + r * ldc + j0, ldc, mk);
    }
}

static void exp_shift_avx2(const float *x, float c, float *y, int64_t count) {
    const v8 cv = v8_set1(c);
    for (int64_t i = 0; i < count; i += 8) {
        const __m256i k = v8_first(count - i < 8 ? (int)(count - i) : 8);
        v8_storeu_mask(y + i, k, v8_exp(v8_sub(v8_loadu_mask(k, x + i), cv)));
    }
}

static const mha__bwd_flash_ops avx2_ops = {gemm_acc_avx2, exp_shift_avx2};

void mha_bwd_f32_flash_q32k64__avx2(const mha__bwd_problem *bp,
                                    int64_t b,
                                    int64_t g,
                                    void *scratch) {
    mha__bwd_flash_unit(&avx2_ops, bp, b, g, scratch);
}
