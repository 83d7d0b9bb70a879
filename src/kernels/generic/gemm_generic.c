/* SPDX-License-Identifier: MIT */
/* gemm_generic.c: portable C micro-kernel of the projection GEMM, for CPUs without AVX2 (and
 * the MHA_MAX_ISA=generic test tier). No intrinsics; the build's -ffp-contract=off keeps every
 * step a separate multiply and add, so the bits do not depend on the compiler.
 *
 * Tile 4 x 16: 64 float accumulators in a local array that the compiler keeps in (SSE) registers
 * or L1; the inner j loop is plain enough to auto-vectorize at -O3.
 */
#include "kernels/registry.h"

#define MR 4
#define NR 16

static void ukr_4x16(int64_t kc,
                     const float *ap,
                     const float *bp,
                     float *c,
                     int64_t ldc,
                     int m,
                     int n,
                     const float *bias,
                     int first) {
    float acc[MR][NR];
    MHA_UNROLL
    for (int i = 0; i < MR; i++) {
        MHA_UNROLL
        for (int j = 0; j < NR; j++)
            acc[i][j] = 0.0f;
    }
    for (int64_t k = 0; k < kc; k++) {
        MHA_UNROLL
        for (int i = 0; i < MR; i++) {
            const float a = ap[i];
            MHA_UNROLL
            for (int j = 0; j < NR; j++)
                acc[i][j] += a * bp[j];
        }
        ap += MR;
        bp += NR;
    }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            float *cp = c + i * ldc + j;
            if (!first)
                *cp = *cp + acc[i][j];
            else
                *cp = bias ? acc[i][j] + bias[j] : acc[i][j];
        }
}

static void pack_b_16(const float *w, int64_t ldw, int n, int64_t kc, float *dst) {
    mha__gemm_pack_b_ref(w, ldw, n, kc, dst, NR);
}

static void pack_a_4(const float *x, int64_t ldx, int m, int64_t kc, float *dst) {
    mha__gemm_pack_b_ref(x, ldx, m, kc, dst, MR);
}

/* Dot path: 8 partial sums per dot (k mod 8), added pairwise at the end; no reassociation by
 * the compiler is needed (or allowed: no -ffast-math). */
static void dot_generic(int64_t K,
                        const float *x,
                        int64_t ldx,
                        int m,
                        const float *w,
                        int64_t ldw,
                        int n,
                        const float *bias,
                        float *y,
                        int64_t ldy) {
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            const float *a = x + i * ldx, *b = w + j * ldw;
            float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            int64_t k = 0;
            for (; k + 8 <= K; k += 8)
                for (int l = 0; l < 8; l++)
                    acc[l] += a[k + l] * b[k + l];
            for (int l = 0; k < K; k++, l++)
                acc[l] += a[k] * b[k];
            const float s =
                ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
            y[i * ldy + j] = bias ? s + bias[j] : s;
        }
}

/* MR and NR are also this kernel's registry line (p1, p2; tests/test_gemm.c checks them). */
const mha__gemm_kernel mha_gemm_f32_4x16__generic = {
    MR,
    NR,
    256,
    1024,
    ukr_4x16,
    pack_b_16,
    dot_generic,
    pack_a_4,
    mha__gemm_dot_h_ref,
    NULL,
    mha__gemm_dot_q8_ref,
    mha__gemm_dot_q4_ref,
};
