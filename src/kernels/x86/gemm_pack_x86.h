/* SPDX-License-Identifier: MIT */
/* gemm_pack_x86.h: packing of W panels for the x86 GEMM kernels (included only by
 * gemm_avx2.c, gemm_avx512.c and decode_avx2.c (its 8 x 8 transpose), which are compiled with AVX2
 * enabled).
 *
 * A panel of NR rows of W [N, K] (nn.Linear layout, row stride ldw) becomes [kc][NR]: for each k
 * the NR output columns side by side, which is what the micro-kernel loads as vectors. This is a
 * transpose; it is done in 8 x 8 blocks with AVX (unpack / shuffle / permute), which measured
 * about 3x faster than the scalar loop (the pack is ~5% of a 2048 x 1024 x 1024 GEMM otherwise).
 */
#ifndef MHA_GEMM_PACK_X86_H
#define MHA_GEMM_PACK_X86_H

#include "base/cpu_features.h"
#include "kernels/registry.h"

#include <immintrin.h>
#include <stdint.h>

/* The few-rows path's prefetch distance in bytes for W rows of ldw elements of es bytes: the
 * same offset in the rows of the next block of MHA_GEMM_DOT_N rows, the one this thread computes
 * next (dot_range walks its blocks in order), i.e. one block's pass ahead. Measured on AMD Zen 5
 * (bf16 decode step, K = 4096: 32 KiB ahead; fixed distances instead): 1 KiB 0.8x, 4 KiB 0.6x,
 * 16 KiB 0.9x, 64 KiB 1.0x. */
static inline int64_t gemm_dot_prefetch_bytes(int64_t ldw, size_t es) {
    return (int64_t)es * MHA_GEMM_DOT_N * ldw;
}

/* The few-rows path's software prefetch of the line `bytes` past p: into the L2 (l2, AMD Zen 4
 * and later: mha__cpu_prefetch_to_l2) or the L1. The address may lie past W's end (a prefetch
 * never faults), hence the integer arithmetic. */
static inline __attribute__((always_inline)) void
gemm_dot_prefetch(const void *p, int64_t bytes, int l2) {
    const char *at = (const char *)((uintptr_t)p + (uintptr_t)bytes);
    if (l2)
        _mm_prefetch(at, _MM_HINT_T1);
    else
        _mm_prefetch(at, _MM_HINT_T0);
}

/* In-place 8 x 8 transpose of r[0..7] (rows in, columns out). */
static inline void gemm_transpose8x8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* dst[k][j] = w[j][k] for j < n, 0 for n <= j < nr; k < kc. nr is a multiple of 8. */
static inline void
gemm_pack_b_x86(const float *w, int64_t ldw, int n, int64_t kc, float *dst, int nr) {
    const int n8 = n & ~7;
    const int64_t kc8 = kc & ~(int64_t)7;
    for (int j = 0; j < n8; j += 8) {
        const float *src = w + (int64_t)j * ldw;
        for (int64_t k = 0; k < kc8; k += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = _mm256_loadu_ps(src + i * ldw + k);
            gemm_transpose8x8(r);
            for (int i = 0; i < 8; i++)
                _mm256_storeu_ps(dst + (k + i) * nr + j, r[i]);
        }
        for (int64_t k = kc8; k < kc; k++)
            for (int i = 0; i < 8; i++)
                dst[k * nr + j + i] = src[i * ldw + k];
    }
    /* Rows n8 .. n-1 (scalar) and the zero padding n .. nr-1. */
    if (n8 < nr)
        for (int64_t k = 0; k < kc; k++)
            for (int j = n8; j < nr; j++)
                dst[k * nr + j] = j < n ? w[(int64_t)j * ldw + k] : 0.0f;
}

/* dst[k][j] = src[j][k] for j < n, 0 for n <= j < width; k < kc; width <= 16 need not be a
 * multiple of 8 (the x micro-panels of the 14-row AVX-512 tile): the last group of 8 is
 * loaded with zero rows past n and stored with a lane mask, so row k + 1 of dst is never
 * touched by row k's store. Measured: the scalar loop of gemm.c was ~10% of a GEMM's time
 * (perf, 2048 x 1024 x 1024), as the packing of x is redone for every NC block. */
static inline void
gemm_pack_rows_x86(const float *src, int64_t ld, int n, int64_t kc, float *dst, int width) {
    const int64_t kc8 = kc & ~(int64_t)7;
    for (int j = 0; j < width; j += 8) {
        const int rows = n - j < 0 ? 0 : (n - j < 8 ? n - j : 8);
        const int lanes = width - j < 8 ? width - j : 8;
        const __m256i lane_mask =
            _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const float *s = src + (int64_t)j * ld;
        for (int64_t k = 0; k < kc8; k += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = i < rows ? _mm256_loadu_ps(s + i * ld + k) : _mm256_setzero_ps();
            gemm_transpose8x8(r);
            for (int i = 0; i < 8; i++) {
                if (lanes == 8)
                    _mm256_storeu_ps(dst + (k + i) * width + j, r[i]);
                else
                    _mm256_maskstore_ps(dst + (k + i) * width + j, lane_mask, r[i]);
            }
        }
        for (int64_t k = kc8; k < kc; k++)
            for (int i = 0; i < lanes; i++)
                dst[k * width + j + i] = i < rows ? s[i * ld + k] : 0.0f;
    }
}

#endif /* MHA_GEMM_PACK_X86_H */
