/* SPDX-License-Identifier: MIT */
/* gemm_avx2.c: AVX2+FMA micro-kernel of the projection GEMM (compiled with -mavx2 -mfma; only
 * called after the CPU check in gemm.c).
 *
 * Tile 6 x 16: 12 ymm accumulators (6 rows x 2 vectors of 8 columns), 2 ymm for the packed W
 * row of the current k, 1 for the broadcast: 15 of the 16 ymm registers. Per k: 2 loads + 6
 * broadcasts for 12 FMAs. Same blocking rule as the AVX-512 kernel: the 6 x KC micro-panel of x
 * in L1, a KC x NC block of packed W in L2.
 */
#if defined(__x86_64__) || defined(__i386__)

#    include "kernels/x86/gemm_pack_x86.h"

#    include <string.h>

#    define MR 6
#    define NV 2 /* vectors of 8 floats per tile row */
#    define NR (8 * NV)

static __m256i lane_mask(int cols) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), idx);
}

static void ukr_6x16(int64_t kc,
                     const float *ap,
                     const float *bp,
                     float *c,
                     int64_t ldc,
                     int m,
                     int n,
                     const float *bias,
                     int first) {
    __m256 acc[MR][NV];
    MHA_UNROLL
    for (int i = 0; i < MR; i++) {
        MHA_UNROLL
        for (int j = 0; j < NV; j++)
            acc[i][j] = _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < kc; k++) {
        __m256 b[NV];
        MHA_UNROLL
        for (int j = 0; j < NV; j++)
            b[j] = _mm256_loadu_ps(bp + 8 * j);
        MHA_UNROLL
        for (int i = 0; i < MR; i++) {
            const __m256 a = _mm256_broadcast_ss(ap + i);
            MHA_UNROLL
            for (int j = 0; j < NV; j++)
                acc[i][j] = _mm256_fmadd_ps(a, b[j], acc[i][j]);
        }
        ap += MR;
        bp += NR;
    }
    if (m == MR && n == NR) {
        MHA_UNROLL
        for (int i = 0; i < MR; i++) {
            MHA_UNROLL
            for (int j = 0; j < NV; j++) {
                float *cp = c + i * ldc + 8 * j;
                __m256 v = acc[i][j];
                if (!first)
                    v = _mm256_add_ps(_mm256_loadu_ps(cp), v);
                else if (bias)
                    v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * j));
                _mm256_storeu_ps(cp, v);
            }
        }
        return;
    }
    /* Edge tile: the same sums, stored through lane masks. */
    __m256i mask[NV];
    MHA_UNROLL
    for (int j = 0; j < NV; j++)
        mask[j] = lane_mask(n - 8 * j);
    /* Conditions instead of early exits, so both loops unroll fully (also with clang) and the
     * accumulators stay in registers in the whole function. */
    MHA_UNROLL
    for (int i = 0; i < MR; i++) {
        MHA_UNROLL
        for (int j = 0; j < NV; j++) {
            if (i < m && n - 8 * j > 0) {
                float *cp = c + i * ldc + 8 * j;
                __m256 v = acc[i][j];
                if (!first)
                    v = _mm256_add_ps(_mm256_maskload_ps(cp, mask[j]), v);
                else if (bias)
                    v = _mm256_add_ps(v, _mm256_maskload_ps(bias + 8 * j, mask[j]));
                _mm256_maskstore_ps(cp, mask[j], v);
            }
        }
    }
}

static void pack_b_16(const float *w, int64_t ldw, int n, int64_t kc, float *dst) {
    gemm_pack_b_x86(w, ldw, n, kc, dst, NR);
}

/* Sum of the 8 lanes, in a fixed order. */
static float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* Dot path (few rows): m x n (<= 2 x 4) dot products, 8 lanes each, one accumulator per dot (8
 * independent chains; 16 ymm registers allow no more with the loaded operands); lane l adds the
 * k = l mod 8 in increasing k. The main loop takes 32 k (4 steps of 8, in order: the same sums)
 * and prefetches each W row's two 64-byte lines one block ahead, as dot_h_body (the hardware
 * prefetcher alone held a float32 decode step at ~55% of the read bandwidth on AMD Zen 5).
 * Specialised per row count mm (1 or 2, constant): a decode step computes no discarded second
 * row. K tail through a lane mask. */
static inline __attribute__((always_inline)) void dot_body(int64_t K,
                                                           const float *x,
                                                           int64_t ldx,
                                                           int m,
                                                           const float *w,
                                                           const int mm,
                                                           const int l2,
                                                           int64_t pfb,
                                                           int64_t ldw,
                                                           int n,
                                                           const float *bias,
                                                           float *y,
                                                           int64_t ldy) {
    __m256 acc[MHA_GEMM_DOT_M][MHA_GEMM_DOT_N];
    MHA_UNROLL
    for (int i = 0; i < MHA_GEMM_DOT_M; i++) {
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++)
            acc[i][j] = _mm256_setzero_ps();
    }
    /* Rows / columns beyond m / n re-read row 0 / column 0 (valid memory) and are not stored. */
    const float *xr[MHA_GEMM_DOT_M], *wr[MHA_GEMM_DOT_N];
    for (int i = 0; i < MHA_GEMM_DOT_M; i++)
        xr[i] = x + (i < m ? i : 0) * ldx;
    for (int j = 0; j < MHA_GEMM_DOT_N; j++)
        wr[j] = w + (j < n ? j : 0) * ldw;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++) {
            gemm_dot_prefetch(wr[j] + k, pfb, l2);
            gemm_dot_prefetch(wr[j] + k + 16, pfb, l2);
        }
        MHA_UNROLL
        for (int u = 0; u < 32; u += 8) {
            __m256 a[MHA_GEMM_DOT_M];
            MHA_UNROLL
            for (int i = 0; i < mm; i++)
                a[i] = _mm256_loadu_ps(xr[i] + k + u);
            MHA_UNROLL
            for (int j = 0; j < MHA_GEMM_DOT_N; j++) {
                const __m256 b = _mm256_loadu_ps(wr[j] + k + u);
                MHA_UNROLL
                for (int i = 0; i < mm; i++)
                    acc[i][j] = _mm256_fmadd_ps(a[i], b, acc[i][j]);
            }
        }
    }
    for (; k < K; k += 8) {
        const int64_t left = K - k;
        const __m256i mk = lane_mask(left >= 8 ? 8 : (int)left);
        __m256 a[MHA_GEMM_DOT_M];
        MHA_UNROLL
        for (int i = 0; i < mm; i++)
            a[i] = left >= 8 ? _mm256_loadu_ps(xr[i] + k) : _mm256_maskload_ps(xr[i] + k, mk);
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++) {
            const __m256 b =
                left >= 8 ? _mm256_loadu_ps(wr[j] + k) : _mm256_maskload_ps(wr[j] + k, mk);
            MHA_UNROLL
            for (int i = 0; i < mm; i++)
                acc[i][j] = _mm256_fmadd_ps(a[i], b, acc[i][j]);
        }
    }
    /* Fully unrolled with a condition: the accumulators stay in registers (see gemm_avx512.c). */
    MHA_UNROLL
    for (int i = 0; i < MHA_GEMM_DOT_M; i++) {
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++)
            if (i < mm && i < m && j < n) {
                const float s = hsum8(acc[i][j]);
                y[i * ldy + j] = bias ? s + bias[j] : s;
            }
    }
}

static void dot_avx2(int64_t K,
                     const float *x,
                     int64_t ldx,
                     int m,
                     const float *w,
                     int64_t ldw,
                     int n,
                     const float *bias,
                     float *y,
                     int64_t ldy) {
    const int64_t pfb = gemm_dot_prefetch_bytes(ldw, sizeof(float));
    const int l2 = mha__cpu_prefetch_to_l2();
    if (m == 1)
        dot_body(K, x, ldx, m, w, 1, l2, pfb, ldw, n, bias, y, ldy);
    else
        dot_body(K, x, ldx, m, w, MHA_GEMM_DOT_M, l2, pfb, ldw, n, bias, y, ldy);
}

/* 8 half W elements widened exactly (bf16: a 16-bit shift; f16: F16C's vcvtph2ps); `left` < 8
 * reads only the first `left` (a scalar copy: no 16-bit masked load in AVX2), the rest are 0. */
static inline __m256 load_half8(const uint16_t *p, int bf16, int64_t left) {
    __m128i h;
    if (left >= 8) {
        h = _mm_loadu_si128((const __m128i *)p);
    } else {
        uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t i = 0; i < left; i++)
            t[i] = p[i];
        h = _mm_loadu_si128((const __m128i *)t);
    }
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                : _mm256_cvtph_ps(h);
}

/* dot_avx2 over half W (mha__gemm_dot_h_fn): the same lanes and chains (each accumulator lane
 * adds k = lane mod 8 in increasing k), each W vector widened in registers. The main loop takes
 * 32 k (4 steps of 8, in order: the same sums) so that each W row gets one software prefetch per
 * 64-byte line: the line pfb bytes ahead (the caller's: the same offset in the rows of the next
 * block of MHA_GEMM_DOT_N), into the L2 where l2 (mha__cpu_prefetch_to_l2): on AMD Zen 5 1.6-2.2x
 * the loop without it (bf16 decode step, 1 thread). Specialised per dtype and row count mm (1 or
 * 2), constants in each caller, as in gemm_avx512.c. */
static inline __attribute__((always_inline)) void dot_h_body(int64_t K,
                                                             const float *x,
                                                             int64_t ldx,
                                                             int m,
                                                             const uint16_t *w,
                                                             const int bf16,
                                                             const int mm,
                                                             const int l2,
                                                             int64_t pfb,
                                                             int64_t ldw,
                                                             int n,
                                                             const float *bias,
                                                             float *y,
                                                             int64_t ldy) {
    __m256 acc[MHA_GEMM_DOT_M][MHA_GEMM_DOT_N];
    MHA_UNROLL
    for (int i = 0; i < MHA_GEMM_DOT_M; i++) {
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++)
            acc[i][j] = _mm256_setzero_ps();
    }
    const float *xr[MHA_GEMM_DOT_M];
    const uint16_t *wr[MHA_GEMM_DOT_N];
    for (int i = 0; i < MHA_GEMM_DOT_M; i++)
        xr[i] = x + (i < m ? i : 0) * ldx;
    for (int j = 0; j < MHA_GEMM_DOT_N; j++)
        wr[j] = w + (j < n ? j : 0) * ldw;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++)
            gemm_dot_prefetch(wr[j] + k, pfb, l2);
        MHA_UNROLL
        for (int u = 0; u < 32; u += 8) {
            __m256 a[MHA_GEMM_DOT_M];
            MHA_UNROLL
            for (int i = 0; i < mm; i++)
                a[i] = _mm256_loadu_ps(xr[i] + k + u);
            MHA_UNROLL
            for (int j = 0; j < MHA_GEMM_DOT_N; j++) {
                const __m256 b = load_half8(wr[j] + k + u, bf16, 8);
                MHA_UNROLL
                for (int i = 0; i < mm; i++)
                    acc[i][j] = _mm256_fmadd_ps(a[i], b, acc[i][j]);
            }
        }
    }
    for (; k < K; k += 8) {
        const int64_t left = K - k;
        const __m256i mk = lane_mask(left >= 8 ? 8 : (int)left);
        __m256 a[MHA_GEMM_DOT_M];
        MHA_UNROLL
        for (int i = 0; i < mm; i++)
            a[i] = left >= 8 ? _mm256_loadu_ps(xr[i] + k) : _mm256_maskload_ps(xr[i] + k, mk);
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++) {
            const __m256 b = load_half8(wr[j] + k, bf16, left);
            MHA_UNROLL
            for (int i = 0; i < mm; i++)
                acc[i][j] = _mm256_fmadd_ps(a[i], b, acc[i][j]);
        }
    }
    /* Fully unrolled with a condition: the accumulators stay in registers (see gemm_avx512.c). */
    MHA_UNROLL
    for (int i = 0; i < MHA_GEMM_DOT_M; i++) {
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++)
            if (i < mm && i < m && j < n) {
                const float s = hsum8(acc[i][j]);
                y[i * ldy + j] = bias ? s + bias[j] : s;
            }
    }
}

static void dot_h_avx2(int64_t K,
                       const float *x,
                       int64_t ldx,
                       int m,
                       const uint16_t *w,
                       int bf16,
                       int64_t ldw,
                       int n,
                       const float *bias,
                       float *y,
                       int64_t ldy) {
    const int64_t pfb = gemm_dot_prefetch_bytes(ldw, sizeof(uint16_t));
    const int l2 = mha__cpu_prefetch_to_l2();
    if (bf16 && m == 1)
        dot_h_body(K, x, ldx, m, w, 1, 1, l2, pfb, ldw, n, bias, y, ldy);
    else if (bf16)
        dot_h_body(K, x, ldx, m, w, 1, MHA_GEMM_DOT_M, l2, pfb, ldw, n, bias, y, ldy);
    else if (m == 1)
        dot_h_body(K, x, ldx, m, w, 0, 1, l2, pfb, ldw, n, bias, y, ldy);
    else
        dot_h_body(K, x, ldx, m, w, 0, MHA_GEMM_DOT_M, l2, pfb, ldw, n, bias, y, ldy);
}

/* 8 q8_0 values as float32, exactly: int8 -> int32 -> float32. */
static inline __m256 load_q8x8(const signed char *q) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)q);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

/* The 32 values of the q4_0 block whose 16 nibble bytes are at q as int8 q - 8 (the values of
 * the q8_0 block with the same scale): lo holds values 0..15 (the low nibbles), hi 16..31. One
 * load and four byte operations per block and row, not per 8 values. */
static inline void load_q4x32_i8(const unsigned char *q, __m128i *lo, __m128i *hi) {
    const __m128i b = _mm_loadu_si128((const __m128i *)q);
    const __m128i nib = _mm_set1_epi8(15), eight = _mm_set1_epi8(8);
    *lo = _mm_sub_epi8(_mm_and_si128(b, nib), eight);
    *hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), nib), eight);
}

/* Values u .. u+7 (u = 0, 8, 16, 24) of a q4_0 block from load_q4x32_i8's lo / hi, as float32. */
static inline __m256 q4x8(__m128i lo, __m128i hi, const int u) {
    const __m128i v = u < 16 ? lo : hi;
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(u % 16 ? _mm_unpackhi_epi64(v, v) : v));
}

/* One q8_0 or q4_0 (q4) block (32 k from k, its bytes at blk in each row) of dot_q8_body (q4_0:
 * the values q - 8, so the bits of the q8_0 block with the same values): per lane l, p_l =
 * sum of x_k q_k over the block's k = l mod 8 in increasing k (a multiply then 3 FMAs), then
 * acc_l = fma(p_l, d_b, acc_l). The rows' scales are gathered by integer loads, converted
 * together and broadcast from memory (a load, no vector ALU operation). */
static inline __attribute__((always_inline)) void
dot_q8_block(__m256 acc[MHA_GEMM_DOT_M][MHA_GEMM_DOT_N],
             const float *const xr[MHA_GEMM_DOT_M],
             const unsigned char *const wr[MHA_GEMM_DOT_N],
             const int mm,
             const int q4,
             int64_t k,
             int64_t blk) {
    __m256 p[MHA_GEMM_DOT_M][MHA_GEMM_DOT_N];
    __m128i lo[MHA_GEMM_DOT_N], hi[MHA_GEMM_DOT_N];
    if (q4) {
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++)
            load_q4x32_i8(wr[j] + blk + 2, &lo[j], &hi[j]);
    }
    MHA_UNROLL
    for (int u = 0; u < 32; u += 8) {
        __m256 a[MHA_GEMM_DOT_M];
        MHA_UNROLL
        for (int i = 0; i < mm; i++)
            a[i] = _mm256_loadu_ps(xr[i] + k + u);
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++) {
            const __m256 b =
                q4 ? q4x8(lo[j], hi[j], u) : load_q8x8((const signed char *)wr[j] + blk + 2 + u);
            MHA_UNROLL
            for (int i = 0; i < mm; i++)
                p[i][j] = u == 0 ? _mm256_mul_ps(a[i], b) : _mm256_fmadd_ps(a[i], b, p[i][j]);
        }
    }
    uint64_t bits = 0;
    MHA_UNROLL
    for (int j = 0; j < MHA_GEMM_DOT_N; j++) {
        uint16_t dh;
        memcpy(&dh, wr[j] + blk, 2);
        bits |= (uint64_t)dh << (16 * j);
    }
    float ds[MHA_GEMM_DOT_N] __attribute__((aligned(16)));
    _mm_store_ps(ds, _mm_cvtph_ps(_mm_set_epi64x(0, (long long)bits)));
    MHA_UNROLL
    for (int j = 0; j < MHA_GEMM_DOT_N; j++) {
        const __m256 d = _mm256_broadcast_ss(ds + j);
        MHA_UNROLL
        for (int i = 0; i < mm; i++)
            acc[i][j] = _mm256_fmadd_ps(p[i][j], d, acc[i][j]);
    }
}

/* dot_avx2 over q8_0 W (mha__gemm_dot_q8_fn), each block's scale applied once to the block's
 * partial sums (dot_q8_block; docs/SEMANTICS.md "q8_0 weights"): per 8 weights a sign
 * extension, a conversion and an FMA (not also a multiply by the scale), and each accumulator's
 * loop-carried chain is one FMA per block instead of four (at batch 1 the 4 rows' 4 chains held
 * the per-element dot at one FMA per cycle). The 8 lanes reduced as hsum8. One software prefetch
 * per row and block, pfb bytes ahead (the same offset in the next MHA_GEMM_DOT_N rows); two blocks
 * per iteration measured the same. Specialised per row count mm (1 or 2) and block type (q4: q4_0,
 * the same order over the values q - 8). K is a multiple of 32. */
static inline __attribute__((always_inline)) void dot_q8_body(int64_t K,
                                                              const float *x,
                                                              int64_t ldx,
                                                              int m,
                                                              const void *w,
                                                              const int mm,
                                                              const int q4,
                                                              const int l2,
                                                              int64_t pfb,
                                                              int64_t ldw,
                                                              int n,
                                                              const float *bias,
                                                              float *y,
                                                              int64_t ldy) {
    __m256 acc[MHA_GEMM_DOT_M][MHA_GEMM_DOT_N];
    MHA_UNROLL
    for (int i = 0; i < MHA_GEMM_DOT_M; i++) {
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++)
            acc[i][j] = _mm256_setzero_ps();
    }
    const float *xr[MHA_GEMM_DOT_M];
    const unsigned char *wr[MHA_GEMM_DOT_N];
    for (int i = 0; i < MHA_GEMM_DOT_M; i++)
        xr[i] = x + (i < m ? i : 0) * ldx;
    for (int j = 0; j < MHA_GEMM_DOT_N; j++)
        wr[j] = (const unsigned char *)w + (j < n ? j : 0) * ldw;
    const int64_t step = q4 ? MHA__Q4_BYTES : MHA__Q8_BYTES;
    for (int64_t k = 0, blk = 0; k < K; k += MHA__Q8_BLOCK, blk += step) {
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++)
            gemm_dot_prefetch(wr[j] + blk, pfb, l2);
        dot_q8_block(acc, xr, wr, mm, q4, k, blk);
    }
    MHA_UNROLL
    for (int i = 0; i < MHA_GEMM_DOT_M; i++) {
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++)
            if (i < mm && i < m && j < n) {
                const float s = hsum8(acc[i][j]);
                y[i * ldy + j] = bias ? s + bias[j] : s;
            }
    }
}

static void dot_q8_avx2(int64_t K,
                        const float *x,
                        int64_t ldx,
                        int m,
                        const void *w,
                        int64_t ldw_bytes,
                        int n,
                        const float *bias,
                        float *y,
                        int64_t ldy) {
    const int64_t pfb = gemm_dot_prefetch_bytes(ldw_bytes, 1);
    const int l2 = mha__cpu_prefetch_to_l2();
    if (m == 1)
        dot_q8_body(K, x, ldx, m, w, 1, 0, l2, pfb, ldw_bytes, n, bias, y, ldy);
    else
        dot_q8_body(K, x, ldx, m, w, MHA_GEMM_DOT_M, 0, l2, pfb, ldw_bytes, n, bias, y, ldy);
}

/* dot_q8_avx2's order over q4_0 W (mha__gemm_kernel.dot_q4). */
static void dot_q4_avx2(int64_t K,
                        const float *x,
                        int64_t ldx,
                        int m,
                        const void *w,
                        int64_t ldw_bytes,
                        int n,
                        const float *bias,
                        float *y,
                        int64_t ldy) {
    const int64_t pfb = gemm_dot_prefetch_bytes(ldw_bytes, 1);
    const int l2 = mha__cpu_prefetch_to_l2();
    if (m == 1)
        dot_q8_body(K, x, ldx, m, w, 1, 1, l2, pfb, ldw_bytes, n, bias, y, ldy);
    else
        dot_q8_body(K, x, ldx, m, w, MHA_GEMM_DOT_M, 1, l2, pfb, ldw_bytes, n, bias, y, ldy);
}

static void pack_a_6(const float *x, int64_t ldx, int m, int64_t kc, float *dst) {
    gemm_pack_rows_x86(x, ldx, m, kc, dst, MR);
}

/* MR and NR are also this kernel's registry line (p1, p2; tests/test_gemm.c checks them). */
const mha__gemm_kernel mha_gemm_f32_6x16__avx2 = {
    MR,       NR,       256,        1024, ukr_6x16,    pack_b_16,
    dot_avx2, pack_a_6, dot_h_avx2, NULL, dot_q8_avx2, dot_q4_avx2,
};

#endif
