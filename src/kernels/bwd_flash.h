/* SPDX-License-Identifier: MIT */
/* bwd_flash.h: the FlashAttention-2 style backward, split like the forward into an
 * ISA-independent driver (attn_bwd_flash_generic.c: tiling, visibility, masks, dropout, softcap)
 * and per-ISA arithmetic (mha__bwd_flash_ops: a small accumulating GEMM, a scaled and shifted exp,
 * and the softmax backward of a row, which run on every score of a visited block).
 *
 * One work unit is (batch row b, kv head g) (attention_bwd.h). For each key tile of Bk keys the
 * driver packs K^T and V^T, zeroes the tile's dK, dV accumulators, and visits every query block
 * (Bq rows of one query head of the group) that can see the tile:
 *   S  = Q K^T                       (gemm_acc, [R, nk])
 *   P  = exp(s(S) - lse)             (recomputed: no n x m matrix ever exists)
 *   dP = dO V^T                      (gemm_acc)
 *   dV += (z P)^T dO                 (gemm_acc, A read transposed, into the tile accumulator)
 *   dS = scale P (z dP - D) tanh'    (elementwise, D = dO . O per row, precomputed)
 *   dK += dS^T Q                     (gemm_acc into the tile accumulator)
 *   dQ += dS K                       (gemm_acc into the unit's dQ accumulator [group, n, dk])
 * dK/dV are written once per tile, dQ once per unit: every output element has one writer.
 */
#ifndef MHA_BWD_FLASH_H
#define MHA_BWD_FLASH_H

#include "kernels/registry.h"

typedef struct mha__bwd_flash_ops {
    /* C[r * ldc + j] += sum_{k < K} A[r * sa + k * sk] * B[k * ldb + j] for r < R, j < N,
     * one chain per element in increasing k. (sa, sk) = (lda, 1) reads A, (1, lda) reads A^T,
     * so P^T dO and dS^T Q need no transposed copies. */
    void (*gemm_acc)(int64_t R,
                     int64_t K,
                     int64_t N,
                     const float *A,
                     int64_t sa,
                     int64_t sk,
                     const float *B,
                     int64_t ldb,
                     float *C,
                     int64_t ldc);
    /* y[i] = exp(scale x[i] - c) for i < count (x = -inf gives 0): the product rounded, then the
     * difference (scale 1 leaves x as it is). y may be x. */
    void (*exp_shift)(const float *x, float scale, float c, float *y, int64_t count);
    /* The softmax backward of one row: dp[i] = P[i] != 0 ? scale (P[i] (dp[i] - D)) : 0 for
     * i < count, each product rounded in that order (no fused multiply-add). P = 0 (a hidden key)
     * gives 0 even when dp[i] is not finite. */
    void (*softmax_grad)(const float *P, float D, float scale, float *dp, int64_t count);
} mha__bwd_flash_ops;

/* Runs unit (b, g) with the given arithmetic. */
void mha__bwd_flash_unit(
    const mha__bwd_flash_ops *ops, const mha__bwd_problem *bp, int64_t b, int64_t g, void *scratch);

#endif /* MHA_BWD_FLASH_H */
