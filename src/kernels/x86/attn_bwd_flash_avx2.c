/* SPDX-License-Identifier: MIT */
/* attn_bwd_flash_avx2.c: AVX2+FMA arithmetic of the flash backward (bwd_flash.h). Compiled with
 * -mavx2 -mfma; only called when dispatch detects AVX2.
 *
 * gemm_acc: C[R, N] += A[R, K] B[K, N] with a 6-row x 16-column register block (12 ymm
 * accumulators + 2 B vectors + 1 broadcast of the 16 ymm registers), a 4-row block for the row
 * tails of R = 32 and 64 and a 1-row version for any other; plain loads and stores for whole
 * 16-column blocks, masked ones for the column tail. Each C element is one FMA chain in
 * increasing k, whatever the blocking (so changing the blocking keeps results bit-identical).
 * exp_shift uses v8_exp.
 */
#include "kernels/bwd_flash.h"
#include "kernels/x86/simd_avx2.h"

/* Loads and stores of a 16-column block: plain when the block is whole (the common case: d and
 * the key tile are multiples of 16), masked otherwise. VMASKMOVPS costs several times a plain
 * access on AMD Zen (a masked store is microcoded), so the whole-block path matters there.
 * Both read and write the same elements, so results do not depend on the path. */
MHA_INLINE v8 load_cols(int whole, __m256i m, const float *p) {
    return whole ? v8_loadu(p) : v8_loadu_mask(m, p);
}
MHA_INLINE void store_cols(int whole, __m256i m, float *p, v8 x) {
    if (whole)
        _mm256_storeu_ps(p, x);
    else
        v8_storeu_mask(p, m, x);
}

/* C[ROWS, 16] += A[ROWS, K] B[K, 16] for ROWS = 6 or 4 (a compile-time constant in every call:
 * the rows 4 and 5 then vanish from the 4-row version). 6 rows: 12 accumulators (named: an array
 * stays on the stack with gcc 12) + 2 B vectors + 1 broadcast of the 16 ymm registers, 12
 * independent FMA chains for the FMA latency (4-5 cycles) at 2 FMAs per cycle. 4 rows: the row
 * tail of R = 32 or 64 (32 = 4 x 6 + 2 x 4, 64 = 10 x 6 + 4), 8 chains, still enough; the 1-row
 * loop below has 2 and runs at a quarter of the rate. Each C element is one chain in
 * increasing k. */
MHA_INLINE void gemm_block(const int ROWS,
                           int whole,
                           int64_t K,
                           const float *A,
                           int64_t sa,
                           int64_t sk,
                           const float *B,
                           int64_t ldb,
                           float *C,
                           int64_t ldc,
                           const __m256i mk[2]) {
    const __m256i m0 = mk[0], m1 = mk[1];
    float *c0 = C, *c1 = C + ldc, *c2 = C + 2 * ldc, *c3 = C + 3 * ldc, *c4 = C + 4 * ldc,
          *c5 = C + 5 * ldc;
    v8 a00 = load_cols(whole, m0, c0), a01 = load_cols(whole, m1, c0 + 8);
    v8 a10 = load_cols(whole, m0, c1), a11 = load_cols(whole, m1, c1 + 8);
    v8 a20 = load_cols(whole, m0, c2), a21 = load_cols(whole, m1, c2 + 8);
    v8 a30 = load_cols(whole, m0, c3), a31 = load_cols(whole, m1, c3 + 8);
    v8 a40 = v8_zero(), a41 = v8_zero(), a50 = v8_zero(), a51 = v8_zero();
    if (ROWS == 6) {
        a40 = load_cols(whole, m0, c4), a41 = load_cols(whole, m1, c4 + 8);
        a50 = load_cols(whole, m0, c5), a51 = load_cols(whole, m1, c5 + 8);
    }
    for (int64_t k = 0; k < K; k++) {
        const float *bk = B + k * ldb, *ak = A + k * sk;
        const v8 b0 = load_cols(whole, m0, bk), b1 = load_cols(whole, m1, bk + 8);
        v8 x = v8_set1(ak[0 * sa]);
        a00 = v8_fma(x, b0, a00), a01 = v8_fma(x, b1, a01);
        x = v8_set1(ak[1 * sa]);
        a10 = v8_fma(x, b0, a10), a11 = v8_fma(x, b1, a11);
        x = v8_set1(ak[2 * sa]);
        a20 = v8_fma(x, b0, a20), a21 = v8_fma(x, b1, a21);
        x = v8_set1(ak[3 * sa]);
        a30 = v8_fma(x, b0, a30), a31 = v8_fma(x, b1, a31);
        if (ROWS == 6) {
            x = v8_set1(ak[4 * sa]);
            a40 = v8_fma(x, b0, a40), a41 = v8_fma(x, b1, a41);
            x = v8_set1(ak[5 * sa]);
            a50 = v8_fma(x, b0, a50), a51 = v8_fma(x, b1, a51);
        }
    }
    store_cols(whole, m0, c0, a00), store_cols(whole, m1, c0 + 8, a01);
    store_cols(whole, m0, c1, a10), store_cols(whole, m1, c1 + 8, a11);
    store_cols(whole, m0, c2, a20), store_cols(whole, m1, c2 + 8, a21);
    store_cols(whole, m0, c3, a30), store_cols(whole, m1, c3 + 8, a31);
    if (ROWS == 6) {
        store_cols(whole, m0, c4, a40), store_cols(whole, m1, c4 + 8, a41);
        store_cols(whole, m0, c5, a50), store_cols(whole, m1, c5 + 8, a51);
    }
}

/* One row of C (the row tail). */
MHA_INLINE void gemm_block_1(int whole,
                             int64_t K,
                             const float *A,
                             int64_t sk,
                             const float *B,
                             int64_t ldb,
                             float *C,
                             const __m256i mk[2]) {
    const __m256i m0 = mk[0], m1 = mk[1];
    v8 a0 = load_cols(whole, m0, C), a1 = load_cols(whole, m1, C + 8);
    for (int64_t k = 0; k < K; k++) {
        const float *bk = B + k * ldb;
        const v8 x = v8_set1(A[k * sk]);
        a0 = v8_fma(x, load_cols(whole, m0, bk), a0);
        a1 = v8_fma(x, load_cols(whole, m1, bk + 8), a1);
    }
    store_cols(whole, m0, C, a0), store_cols(whole, m1, C + 8, a1);
}

/* The rows of one 16-column block; `whole` is a compile-time constant in each call below, so
 * the plain and the masked paths are separate loops. */
MHA_INLINE void gemm_cols(int whole,
                          int64_t R,
                          int64_t K,
                          const float *A,
                          int64_t sa,
                          int64_t sk,
                          const float *B,
                          int64_t ldb,
                          float *C,
                          int64_t ldc,
                          const __m256i mk[2]) {
    int64_t r = 0;
    /* 6-row blocks while they leave 0 or at least 4 rows, then 4-row blocks, then single rows. */
    for (; R - r >= 6 && (R - r == 6 || R - r >= 10); r += 6)
        gemm_block(6, whole, K, A + r * sa, sa, sk, B, ldb, C + r * ldc, ldc, mk);
    for (; R - r >= 4; r += 4)
        gemm_block(4, whole, K, A + r * sa, sa, sk, B, ldb, C + r * ldc, ldc, mk);
    for (; r < R; r++)
        gemm_block_1(whole, K, A + r * sa, sk, B, ldb, C + r * ldc, mk);
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
        if (N - j0 >= 16)
            gemm_cols(1, R, K, A, sa, sk, B + j0, ldb, C + j0, ldc, mk);
        else
            gemm_cols(0, R, K, A, sa, sk, B + j0, ldb, C + j0, ldc, mk);
    }
}

static void exp_shift_avx2(const float *x, float scale, float c, float *y, int64_t count) {
    const v8 sv = v8_set1(scale), cv = v8_set1(c);
    int64_t i = 0;
    for (; i + 8 <= count; i += 8)
        _mm256_storeu_ps(y + i, v8_exp(v8_sub(v8_mul(sv, v8_loadu(x + i)), cv)));
    for (; i < count; i += 8) {
        const __m256i k = v8_first(count - i < 8 ? (int)(count - i) : 8);
        v8_storeu_mask(y + i, k, v8_exp(v8_sub(v8_mul(sv, v8_loadu_mask(k, x + i)), cv)));
    }
}

/* 8 lanes of softmax_grad: P != 0 ? scale (P (dp - D)) : 0 (NaN P counts as != 0). */
MHA_INLINE v8 softmax_grad8(v8 P, v8 dp, v8 D, v8 scale) {
    const v8 g = v8_mul(scale, v8_mul(P, v8_sub(dp, D)));
    return _mm256_and_ps(_mm256_cmp_ps(P, v8_zero(), _CMP_NEQ_UQ), g);
}

static void softmax_grad_avx2(const float *P, float D, float scale, float *dp, int64_t count) {
    const v8 dv = v8_set1(D), sv = v8_set1(scale);
    int64_t i = 0;
    for (; i + 8 <= count; i += 8)
        _mm256_storeu_ps(dp + i, softmax_grad8(v8_loadu(P + i), v8_loadu(dp + i), dv, sv));
    for (; i < count; i += 8) {
        const __m256i k = v8_first(count - i < 8 ? (int)(count - i) : 8);
        v8_storeu_mask(dp + i, k,
                       softmax_grad8(v8_loadu_mask(k, P + i), v8_loadu_mask(k, dp + i), dv, sv));
    }
}

static const mha__bwd_flash_ops avx2_ops = {gemm_acc_avx2, exp_shift_avx2, softmax_grad_avx2};

void mha_bwd_f32_flash_q32k64__avx2(const mha__bwd_problem *bp,
                                    int64_t b,
                                    int64_t g,
                                    void *scratch) {
    mha__bwd_flash_unit(&avx2_ops, bp, b, g, scratch);
}
