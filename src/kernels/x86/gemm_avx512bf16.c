/* SPDX-License-Identifier: MIT */
/* gemm_avx512bf16.c: AVX512-BF16 micro-kernel of the projection GEMM for bf16 x AND bf16 W
 * (compiled with the AVX-512 flags + -mavx512bf16; gemm.c selects it only when the CPU has
 * MHA_ISA_AVX512BF16 and both operands are bf16: registry.def, dtypes MHA_DTS_BF16).
 *
 *   vdpbf16ps acc, a, b: acc[i] += a[2i] b[2i] + a[2i+1] b[2i+1] for 16 float32 lanes i; the
 *   products of two bf16 are exact in float32, the sums rounded to nearest, denormal inputs and
 *   outputs flushed to zero. One instruction does 32 multiply-adds where an FMA does 16.
 *
 * Panels hold k in pairs, one 32-bit slot (of the float panels the driver allocates) per pair,
 * the even k in the low half: W panel [ceil(kc/2)][NR][2], x micro-panel [ceil(kc/2)][MR][2]; an
 * odd kc gets a zero as the second half of its last pair. A pair of a row of a row-major operand
 * is two adjacent bf16, i.e. one 32-bit word: packing is the 32-bit transpose of gemm_pack_x86.h.
 * Tile 14 x 32 as the f32 kernel (28 zmm accumulators, 2 for the W pair row, 1 broadcast): per
 * k pair 2 loads + 14 broadcasts for 28 vdpbf16ps (56 k-steps of an f32 FMA tile's work).
 * Each element of C: one chain over the k pairs in increasing k per K block (KC = 256 k, even, so
 * blocks never split a pair), blocks added in order: bit-identical for any thread count.
 */
#if defined(__x86_64__) || defined(__i386__)

#    include "kernels/x86/gemm_pack_x86.h"

#    include <string.h>

#    define MR 14
#    define NV 2 /* vectors of 16 columns per tile row */
#    define NR (16 * NV)

static void ukr_bf16_14x32(int64_t kc,
                           const float *ap,
                           const float *bp,
                           float *c,
                           int64_t ldc,
                           int m,
                           int n,
                           const float *bias,
                           int first) {
    const int64_t kp = (kc + 1) / 2; /* k pairs */
    __m512 acc[MR][NV];
    MHA_UNROLL
    for (int i = 0; i < MR; i++) {
        MHA_UNROLL
        for (int j = 0; j < NV; j++)
            acc[i][j] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < kp; k++) {
        __m512bh b[NV];
        MHA_UNROLL
        for (int j = 0; j < NV; j++)
            b[j] = (__m512bh)_mm512_castps_si512(_mm512_loadu_ps(bp + 16 * j));
        MHA_UNROLL
        for (int i = 0; i < MR; i++) {
            /* The pair (x[i][2k], x[i][2k+1]) broadcast: a 32-bit move, bits unchanged. */
            const __m512bh a = (__m512bh)_mm512_castps_si512(_mm512_set1_ps(ap[i]));
            MHA_UNROLL
            for (int j = 0; j < NV; j++)
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
        }
        ap += MR;
        bp += NR;
    }
    /* The store of the f32 kernel: full tiles plain, edge tiles through lane masks. */
    __mmask16 mask[NV];
    MHA_UNROLL
    for (int j = 0; j < NV; j++) {
        const int cols = n - 16 * j;
        mask[j] = cols >= 16 ? (__mmask16)0xFFFF
                             : (cols <= 0 ? (__mmask16)0 : (__mmask16)((1u << cols) - 1u));
    }
    MHA_UNROLL
    for (int i = 0; i < MR; i++) {
        MHA_UNROLL
        for (int j = 0; j < NV; j++) {
            if (i < m) {
                float *cp = c + i * ldc + 16 * j;
                __m512 v = acc[i][j];
                if (!first)
                    v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask[j], cp), v);
                else if (bias)
                    v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask[j], bias + 16 * j));
                _mm512_mask_storeu_ps(cp, mask[j], v);
            }
        }
    }
}

/* mha__gemm_pack_pairs_fn: rows [0, n) of a row-major bf16 operand (row stride ld elements),
 * columns [0, kc), into dst [ceil(kc/2)][width] 32-bit pairs, rows n .. width-1 zero. Groups of 8
 * rows x 8 pairs (16 bf16 = 32 bytes per row) go through the 8 x 8 transpose of 32-bit lanes
 * (shuffles only: bits unchanged); the pair tail (and an odd kc's last pair, padded with a zero)
 * is scalar. width <= 16 need not be a multiple of 8 (the last group is stored with a lane
 * mask, as gemm_pack_rows_x86). */
static void pack_pairs(const uint16_t *src, int64_t ld, int n, int64_t kc, float *dst, int width) {
    const int64_t kp = (kc + 1) / 2, kp8 = (kc / 2) & ~(int64_t)7;
    for (int j = 0; j < width; j += 8) {
        const int rows = n - j < 0 ? 0 : (n - j < 8 ? n - j : 8);
        const int lanes = width - j < 8 ? width - j : 8;
        const __m256i lane_mask =
            _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const uint16_t *s = src + (int64_t)j * ld;
        for (int64_t q = 0; q < kp8; q += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = i < rows ? _mm256_castsi256_ps(
                                      _mm256_loadu_si256((const __m256i *)(s + i * ld + 2 * q)))
                                : _mm256_setzero_ps();
            gemm_transpose8x8(r);
            for (int i = 0; i < 8; i++) {
                if (lanes == 8)
                    _mm256_storeu_ps(dst + (q + i) * width + j, r[i]);
                else
                    _mm256_maskstore_ps(dst + (q + i) * width + j, lane_mask, r[i]);
            }
        }
        for (int64_t q = kp8; q < kp; q++)
            for (int i = 0; i < lanes; i++) {
                uint32_t v = 0;
                if (i < rows) {
                    const uint16_t *e = s + i * ld + 2 * q;
                    v = (uint32_t)e[0] | (2 * q + 1 < kc ? (uint32_t)e[1] << 16 : 0u);
                }
                memcpy(dst + q * width + j + i, &v, sizeof v);
            }
    }
}

/* MR and NR are also this kernel's registry line (p1, p2; tests/test_gemm.c checks them). No
 * few-rows dot path of its own: the driver runs decode-sized calls (M <= MHA_GEMM_SMALL_M) on the
 * float32 tier's dot_h (W widened in registers) under MHA__GEMM_AUTO. KC even (pairs). */
const mha__gemm_kernel mha_gemm_bf16_14x32__avx512bf16 = {
    MR, NR, 256, 1024, ukr_bf16_14x32, NULL, NULL, NULL, NULL, pack_pairs, NULL, NULL,
};

#endif
