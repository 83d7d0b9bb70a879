/* SPDX-License-Identifier: MIT */
/* attn_bwd_flash_neon.c: AArch64 Advanced SIMD (NEON) arithmetic of the flash backward
 * (bwd_flash.h). Compiled only for aarch64 (NEON is baseline there); dispatched when
 * cpu_features.c reports HWCAP_ASIMD. The tiling, masks, dropout and the softmax backward are
 * the shared driver's (attn_bwd_flash_generic.c); this file replaces its two operations.
 *
 * gemm_acc: C[R, N] += A[R, K] B[K, N] with a 5-row x 16-column register block: 20 accumulators
 * + 4 B vectors + 5 A elements (scalar loads, used through the by-element FMLA: no broadcast
 * instruction; each still occupies a vector register, so 6 rows (34 registers) would spill).
 * Per k: 4 vector + 5 scalar loads for 20 FMAs. The A operand is read through (sa, sk) strides,
 * so A (Q K^T, dO V^T, dS K) and A^T ((zP)^T dO, dS^T Q) take the same path. 20 independent
 * chains cover 4 FMA pipes x 4 cycles of latency (Neoverse V1/V2, Apple M) with a margin and
 * 2 pipes (Neoverse N1, Cortex-A7x) 2.5 times; the loads (9 per 20 FMAs) stay below 2 (N1) or 3
 * (V1) load ports. Row tails run the same block with fewer rows (R = 32 query rows = 6 x 5 + 2;
 * nk = 64 keys = 12 x 5 + 4); whole 16-column blocks use plain loads and stores, the column tail
 * (N not a multiple of 16) whole vectors, then one partial vector that touches nothing past
 * column N. Each C element is one FMA chain in increasing k, whatever the blocking (a different
 * blocking keeps results bit-identical).
 * exp_shift uses v4_exp (simd_neon.h).
 */
#include "kernels/bwd_flash.h"

#if defined(__aarch64__)
#    include "kernels/arm/simd_neon.h"

#    define MR 5 /* rows of a register block */
#    define NV 4 /* vectors of columns of a register block (16 columns) */

/* A scheduling barrier for GCC's pre-allocation scheduler, which would otherwise hoist the next
 * k step's loads above this step's FMAs and push the live vectors (20 accumulators + 4 B + 5 A)
 * past 32 (accumulators spilled inside the loop with gcc 12). Emits nothing. */
#    define SCHED_BARRIER() __asm__ volatile("")

/* Column vector c of a block of NVC vectors: whole, except the last one when LAST < 4, of which
 * only the first LAST floats are read or written (LAST is a compile-time constant, so the lane
 * loads have no branches). */
MHA_INLINE v4 load_col(const float *p, int c, const int NVC, const int LAST) {
    return LAST == 4 || c < NVC - 1 ? v4_loadu(p) : v4_loadu_first(p, LAST);
}
MHA_INLINE void store_col(float *p, int c, v4 x, const int NVC, const int LAST) {
    if (LAST == 4 || c < NVC - 1)
        v4_store(p, x);
    else
        v4_storeu_first(p, LAST, x);
}

/* C[ROWS, cols] += A[ROWS, K] B[K, cols], cols = 4 (NVC - 1) + LAST. */
MHA_INLINE void gemm_block(int64_t K,
                           const float *A,
                           int64_t sa,
                           int64_t sk,
                           const float *B,
                           int64_t ldb,
                           float *C,
                           int64_t ldc,
                           const int ROWS,
                           const int NVC,
                           const int LAST) {
    v4 acc[MR][NV];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NVC; c++)
            acc[r][c] = load_col(C + r * ldc + 4 * c, c, NVC, LAST);
    for (int64_t k = 0; k < K; k++) {
        const float *bk = B + k * ldb, *ak = A + k * sk;
        v4 b[NV];
        for (int c = 0; c < NVC; c++)
            b[c] = load_col(bk + 4 * c, c, NVC, LAST);
        for (int r = 0; r < ROWS; r++) {
            const float x = ak[r * sa];
            for (int c = 0; c < NVC; c++)
                acc[r][c] = vfmaq_n_f32(acc[r][c], b[c], x);
        }
        SCHED_BARRIER();
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NVC; c++)
            store_col(C + r * ldc + 4 * c, c, acc[r][c], NVC, LAST);
}

/* The rows of one column block, in blocks of MR and one block of the R % MR rows left. */
MHA_INLINE void gemm_cols(int64_t R,
                          int64_t K,
                          const float *A,
                          int64_t sa,
                          int64_t sk,
                          const float *B,
                          int64_t ldb,
                          float *C,
                          int64_t ldc,
                          const int NVC,
                          const int LAST) {
    int64_t r = 0;
    for (; r + MR <= R; r += MR)
        gemm_block(K, A + r * sa, sa, sk, B, ldb, C + r * ldc, ldc, MR, NVC, LAST);
    const float *a = A + r * sa;
    float *c = C + r * ldc;
    switch (R - r) {
    case 4:
        gemm_block(K, a, sa, sk, B, ldb, c, ldc, 4, NVC, LAST);
        break;
    case 3:
        gemm_block(K, a, sa, sk, B, ldb, c, ldc, 3, NVC, LAST);
        break;
    case 2:
        gemm_block(K, a, sa, sk, B, ldb, c, ldc, 2, NVC, LAST);
        break;
    case 1:
        gemm_block(K, a, sa, sk, B, ldb, c, ldc, 1, NVC, LAST);
        break;
    default:
        break;
    }
}

/* The column tail, cols = N % 16 (only for head sizes or key tiles that are not multiples of
 * 16): its whole vectors, then one partial vector, each shape its own out-of-line function (so
 * that the whole-block path stays small, and each block's accumulators stay in registers: with
 * all shapes inlined into one function gcc 12 kept some on the stack). */
typedef void (*gemm_cols_fn)(int64_t R,
                             int64_t K,
                             const float *A,
                             int64_t sa,
                             int64_t sk,
                             const float *B,
                             int64_t ldb,
                             float *C,
                             int64_t ldc);
#    define TAIL_FN(NVC, LAST)                                                                     \
        __attribute__((noinline)) static void tail_##NVC##_##LAST(                                 \
            int64_t R, int64_t K, const float *A, int64_t sa, int64_t sk, const float *B,          \
            int64_t ldb, float *C, int64_t ldc) {                                                  \
            gemm_cols(R, K, A, sa, sk, B, ldb, C, ldc, NVC, LAST);                                 \
        }
TAIL_FN(1, 4)
TAIL_FN(2, 4)
TAIL_FN(3, 4)
TAIL_FN(1, 1)
TAIL_FN(1, 2)
TAIL_FN(1, 3)
#    undef TAIL_FN

static void gemm_tail(int64_t R,
                      int64_t K,
                      const float *A,
                      int64_t sa,
                      int64_t sk,
                      const float *B,
                      int64_t ldb,
                      float *C,
                      int64_t ldc,
                      int cols) {
    static const gemm_cols_fn whole[4] = {NULL, tail_1_4, tail_2_4, tail_3_4};
    static const gemm_cols_fn part[4] = {NULL, tail_1_1, tail_1_2, tail_1_3};
    const int nw = cols / 4, rem = cols % 4;
    if (nw)
        whole[nw](R, K, A, sa, sk, B, ldb, C, ldc);
    if (rem)
        part[rem](R, K, A, sa, sk, B + 4 * nw, ldb, C + 4 * nw, ldc);
}

static void gemm_acc_neon(int64_t R,
                          int64_t K,
                          int64_t N,
                          const float *A,
                          int64_t sa,
                          int64_t sk,
                          const float *B,
                          int64_t ldb,
                          float *C,
                          int64_t ldc) {
    int64_t j0 = 0;
    for (; j0 + 16 <= N; j0 += 16)
        gemm_cols(R, K, A, sa, sk, B + j0, ldb, C + j0, ldc, NV, 4);
    if (j0 < N)
        gemm_tail(R, K, A, sa, sk, B + j0, ldb, C + j0, ldc, (int)(N - j0));
}

static void exp_shift_neon(const float *x, float scale, float c, float *y, int64_t count) {
    const v4 sv = v4_set1(scale), cv = v4_set1(c);
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        const v4 e0 = v4_exp(v4_sub(v4_mul(sv, v4_loadu(x + i)), cv));
        const v4 e1 = v4_exp(v4_sub(v4_mul(sv, v4_loadu(x + i + 4)), cv));
        v4_store(y + i, e0);
        v4_store(y + i + 4, e1);
    }
    for (; i < count; i += 4) {
        const int n = count - i < 4 ? (int)(count - i) : 4;
        v4_storeu_first(y + i, n, v4_exp(v4_sub(v4_mul(sv, v4_loadu_first(x + i, n)), cv)));
    }
}

/* 4 lanes of softmax_grad: P != 0 ? scale (P (dp - D)) : 0 (NaN P counts as != 0). */
MHA_INLINE v4 softmax_grad4(v4 P, v4 dp, v4 D, v4 scale) {
    const v4 g = v4_mul(scale, v4_mul(P, v4_sub(dp, D)));
    return vbslq_f32(vceqq_f32(P, v4_zero()), v4_zero(), g);
}

static void softmax_grad_neon(const float *P, float D, float scale, float *dp, int64_t count) {
    const v4 dv = v4_set1(D), sv = v4_set1(scale);
    int64_t i = 0;
    for (; i + 4 <= count; i += 4)
        v4_store(dp + i, softmax_grad4(v4_loadu(P + i), v4_loadu(dp + i), dv, sv));
    if (i < count) {
        const int n = (int)(count - i);
        v4_storeu_first(dp + i, n,
                        softmax_grad4(v4_loadu_first(P + i, n), v4_loadu_first(dp + i, n), dv, sv));
    }
}

static const mha__bwd_flash_ops neon_ops = {gemm_acc_neon, exp_shift_neon, softmax_grad_neon};

void mha_bwd_f32_flash_q32k64__neon(const mha__bwd_problem *bp,
                                    int64_t b,
                                    int64_t g,
                                    void *scratch) {
    mha__bwd_flash_unit(&neon_ops, bp, b, g, scratch);
}

#endif /* aarch64 */
