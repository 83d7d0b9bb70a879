/* SPDX-License-Identifier: MIT */
/* gemm_avx512.c: AVX-512F micro-kernel of the projection GEMM (compiled with -mavx512f etc.;
 * only called after the CPU check in gemm.c).
 *
 * Tile 14 x 32: 28 zmm accumulators (14 rows x 2 vectors of 16 columns), 2 zmm for the packed W
 * row of the current k, 1 for the broadcast x value: 31 of 32 registers. Per k: 2 vector loads +
 * 14 broadcasts for 28 FMAs, i.e. 14 cycles of FMA work on 2 ports against 16 loads on 2-3 load
 * ports. Measured on this Xeon (2048 x 1024 x 1024, 1 thread): 14x32 and 12x32 ~equal, 6x64 -7%,
 * 8x48 -15%; 14x32 wins by a hair and wastes the least in M tails of 2^k rows.
 * Blocking: the 14 x KC micro-panel of x stays in L1 (14 x 256 x 4 B = 14 KB of 48 KB) while
 * 256 x 32 panels of packed W stream from L2 (a KC x NC block = 256 x 1024 x 4 B = 1 MB of 2 MB).
 * Each element of C is one FMA chain in increasing k per K block, and blocks are added in order.
 */
#if defined(__x86_64__) || defined(__i386__)

#    include "kernels/x86/gemm_pack_x86.h"

#    include <string.h>

#    define MR 14
#    define NV 2 /* vectors of 16 floats per tile row */
#    define NR (16 * NV)

static void ukr_14x32(int64_t kc,
                      const float *ap,
                      const float *bp,
                      float *c,
                      int64_t ldc,
                      int m,
                      int n,
                      const float *bias,
                      int first) {
    __m512 acc[MR][NV];
    MHA_UNROLL
    for (int i = 0; i < MR; i++) {
        MHA_UNROLL
        for (int j = 0; j < NV; j++)
            acc[i][j] = _mm512_setzero_ps();
    }
    if (!first)
        for (int i = 0; i < m; i++) {
            _mm_prefetch((const char *)(c + i * ldc), _MM_HINT_T0);
            _mm_prefetch((const char *)(c + i * ldc + 16), _MM_HINT_T0);
        }
    for (int64_t k = 0; k < kc; k++) {
        __m512 b[NV];
        MHA_UNROLL
        for (int j = 0; j < NV; j++)
            b[j] = _mm512_loadu_ps(bp + 16 * j);
        MHA_UNROLL
        for (int i = 0; i < MR; i++) {
            const __m512 a = _mm512_set1_ps(ap[i]);
            MHA_UNROLL
            for (int j = 0; j < NV; j++)
                acc[i][j] = _mm512_fmadd_ps(a, b[j], acc[i][j]);
        }
        ap += MR;
        bp += NR;
    }
    if (m == MR && n == NR) {
        MHA_UNROLL
        for (int i = 0; i < MR; i++) {
            MHA_UNROLL
            for (int j = 0; j < NV; j++) {
                float *cp = c + i * ldc + 16 * j;
                __m512 v = acc[i][j];
                if (!first)
                    v = _mm512_add_ps(_mm512_loadu_ps(cp), v);
                else if (bias)
                    v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * j));
                _mm512_storeu_ps(cp, v);
            }
        }
        return;
    }
    /* Edge tile: the same sums, stored through lane masks. */
    __mmask16 mask[NV];
    MHA_UNROLL
    for (int j = 0; j < NV; j++) {
        const int cols = n - 16 * j;
        mask[j] = cols >= 16 ? (__mmask16)0xFFFF
                             : (cols <= 0 ? (__mmask16)0 : (__mmask16)((1u << cols) - 1u));
    }
    /* A condition instead of an early exit, so the loop unrolls fully (also with clang) and the
     * accumulators stay in registers in the whole function. */
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

static void pack_b_32(const float *w, int64_t ldw, int n, int64_t kc, float *dst) {
    gemm_pack_b_x86(w, ldw, n, kc, dst, NR);
}

/* Dot path (few rows): m x n (<= 2 x 4) dot products, 16 lanes each, 2 accumulators per dot
 * (k in steps of 32) so that 16 independent FMA chains cover the FMA latency; the K tail is
 * loaded with a lane mask. Memory-bound on W, as a matrix-vector product is. */
static void dot_avx512(int64_t K,
                       const float *x,
                       int64_t ldx,
                       int m,
                       const float *w,
                       int64_t ldw,
                       int n,
                       const float *bias,
                       float *y,
                       int64_t ldy) {
    __m512 acc0[MHA_GEMM_DOT_M][MHA_GEMM_DOT_N], acc1[MHA_GEMM_DOT_M][MHA_GEMM_DOT_N];
    MHA_UNROLL
    for (int i = 0; i < MHA_GEMM_DOT_M; i++) {
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++)
            acc0[i][j] = acc1[i][j] = _mm512_setzero_ps();
    }
    /* Rows / columns beyond m / n re-read row 0 / column 0 (valid memory) and are not stored. */
    const float *xr[MHA_GEMM_DOT_M], *wr[MHA_GEMM_DOT_N];
    for (int i = 0; i < MHA_GEMM_DOT_M; i++)
        xr[i] = x + (i < m ? i : 0) * ldx;
    for (int j = 0; j < MHA_GEMM_DOT_N; j++)
        wr[j] = w + (j < n ? j : 0) * ldw;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512 a0[MHA_GEMM_DOT_M], a1[MHA_GEMM_DOT_M];
        MHA_UNROLL
        for (int i = 0; i < MHA_GEMM_DOT_M; i++) {
            a0[i] = _mm512_loadu_ps(xr[i] + k);
            a1[i] = _mm512_loadu_ps(xr[i] + k + 16);
        }
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++) {
            const __m512 b0 = _mm512_loadu_ps(wr[j] + k), b1 = _mm512_loadu_ps(wr[j] + k + 16);
            MHA_UNROLL
            for (int i = 0; i < MHA_GEMM_DOT_M; i++) {
                acc0[i][j] = _mm512_fmadd_ps(a0[i], b0, acc0[i][j]);
                acc1[i][j] = _mm512_fmadd_ps(a1[i], b1, acc1[i][j]);
            }
        }
    }
    for (; k < K; k += 16) {
        const int64_t left = K - k;
        const __mmask16 mk = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        __m512 a0[MHA_GEMM_DOT_M];
        MHA_UNROLL
        for (int i = 0; i < MHA_GEMM_DOT_M; i++)
            a0[i] = _mm512_maskz_loadu_ps(mk, xr[i] + k);
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++) {
            const __m512 b0 = _mm512_maskz_loadu_ps(mk, wr[j] + k);
            MHA_UNROLL
            for (int i = 0; i < MHA_GEMM_DOT_M; i++)
                acc0[i][j] = _mm512_fmadd_ps(a0[i], b0, acc0[i][j]);
        }
    }
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            const float s = _mm512_reduce_add_ps(_mm512_add_ps(acc0[i][j], acc1[i][j]));
            y[i * ldy + j] = bias ? s + bias[j] : s;
        }
}

/* 16 half W elements widened exactly: bf16 by a 16-bit shift into the top of the float, f16 by
 * vcvtph2ps. Masked lanes read nothing and give 0. */
static inline __m512 load_half16(const uint16_t *p, int bf16, __mmask16 mk) {
    const __m256i h = _mm256_maskz_loadu_epi16(mk, p);
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                : _mm512_cvtph_ps(h);
}

/* 8 half W elements widened exactly in a ymm register (the one-row main loop below). */
static inline __m256 load_half8(const uint16_t *p, int bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                : _mm256_cvtph_ps(h);
}

/* The storage of W in the few-rows paths below (a compile-time constant in each caller). */
enum { W_F16, W_BF16, W_Q8, W_Q4 };

/* The main loop of dot_w_body for one x row of half W (a decode step): the same sums in the same
 * order as the zmm loop, each 16-lane accumulator held as two ymm halves (acc0 = c[j][0..1] for k
 * mod 32 in [0, 16), acc1 = c[j][2..3] for [16, 32)), W widened 8 at a time. Measured on AMD Zen 5
 * from memory (bf16 and f16, 1 thread, the layer's best decode step): 37 GB/s against 26-28 with
 * vpmovzxwd / vcvtph2ps into zmm, 34 with the zmm operand built from two ymm widenings. Returns the
 * k it stopped at; acc0/acc1 [0][j] hold the sums so far. */
static inline __attribute__((always_inline)) int64_t dot_h_row1(int64_t K,
                                                                const float *xr,
                                                                const unsigned char *const wr[],
                                                                const int bf16,
                                                                const int l2,
                                                                int64_t pfb,
                                                                __m512 acc0[][MHA_GEMM_DOT_N],
                                                                __m512 acc1[][MHA_GEMM_DOT_N]) {
    __m256 c[MHA_GEMM_DOT_N][4];
    MHA_UNROLL
    for (int j = 0; j < MHA_GEMM_DOT_N; j++)
        c[j][0] = c[j][1] = c[j][2] = c[j][3] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++)
            gemm_dot_prefetch((const uint16_t *)wr[j] + k, pfb, l2);
        __m256 a[4];
        MHA_UNROLL
        for (int q = 0; q < 4; q++)
            a[q] = _mm256_loadu_ps(xr + k + 8 * q);
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++) {
            MHA_UNROLL
            for (int q = 0; q < 4; q++)
                c[j][q] = _mm256_fmadd_ps(
                    a[q], load_half8((const uint16_t *)wr[j] + k + 8 * q, bf16), c[j][q]);
        }
    }
    MHA_UNROLL
    for (int j = 0; j < MHA_GEMM_DOT_N; j++) {
        acc0[0][j] = _mm512_insertf32x8(_mm512_castps256_ps512(c[j][0]), c[j][1], 1);
        acc1[0][j] = _mm512_insertf32x8(_mm512_castps256_ps512(c[j][2]), c[j][3], 1);
    }
    return k;
}

/* 16 q8_0 values widened exactly: int8 -> int32 -> float32, times the block's scale d (exact:
 * 8 bits times 11 fit float32's 24). */
static inline __m512 load_q8x16(const signed char *q, __m512 d) {
    const __m128i b = _mm_loadu_si128((const __m128i *)q);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), d);
}

/* One q4_0 block's 32 values (its 16 bytes at q: low nibbles the first 16, high nibbles the
 * next) as float32: the block's 16 possible values (k - 8) d, k = 0..15, are made once (one exact
 * multiply: the bits q8_0's q d has for the same q - 8), then each value is looked up by its
 * nibble (VPERMPS reads the index's low 4 bits, so the low nibbles need no mask). Per block and W
 * row three shuffles (a widening, two lookups: the shuffle pipe bounds it) and a multiply,
 * instead of q8_0's two widenings, two conversions and two multiplies. Measured slower on Zen 5:
 * the widening and the multiply by d applied to each value (1.6 against 1.0 ms per 4096-wide
 * decode step); the bytes broadcast to the four 128-bit lanes and shifted per lane by VPSRLVD
 * (no widening shuffle; x read in the transposed order, the accumulators put back at the end:
 * 1.1 ms). */
static inline void load_q4x32(const unsigned char *q, __m512 d, __m512 *b0, __m512 *b1) {
    const __m512 ks = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
    const __m512 table = _mm512_mul_ps(ks, d);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    *b0 = _mm512_permutexvar_ps(b, table);
    *b1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}

/* One q8_0 block's 32 values q (its int8 at q) times its scale d, widened exactly into b0 (the
 * first 16) and b1. */
static inline void load_q8x32(const signed char *q, __m512 d, __m512 *b0, __m512 *b1) {
    *b0 = load_q8x16(q, d), *b1 = load_q8x16(q + 16, d);
}

/* The 32 half W values of a row from p on, widened exactly into b0 (the first 16) and b1. */
static inline __attribute__((always_inline)) void
load_w32(const unsigned char *p, const int wk, __m512 *b0, __m512 *b1) {
    const uint16_t *h = (const uint16_t *)p;
    *b0 = load_half16(h, wk == W_BF16, (__mmask16)0xFFFF);
    *b1 = load_half16(h + 16, wk == W_BF16, (__mmask16)0xFFFF);
}

/* dot_avx512 over W stored as halves (mha__gemm_dot_h_fn) or q8_0 / q4_0 blocks
 * (mha__gemm_dot_q8_fn):
 * the same lanes and chains (lane l of acc0 adds the k = l mod 32, of acc1 the k = 16 + l mod 32,
 * in increasing k), each W vector widened / dequantised in registers (q8_0: one 32-value block per
 * step, K a multiple of 32), so the result is the float32 dot's over the widened rows, bit for
 * bit; only W's bytes shrink (x is float32). Row j of W starts at byte j * ldwb. Specialised per
 * storage wk and per row count mm (1 or 2), compile-time constants in each caller, so that the
 * inner loop has no branch: a decode step (m = 1) then does not compute a second, discarded row
 * (measured at batch 1 on a 4096-wide layer: 1.3x faster than always computing two) and, over
 * halves, runs dot_h_row1. Each 64-byte line of W gets a software prefetch pfb bytes ahead (the
 * same offset in the next block's rows, gemm_dot_prefetch_bytes), into the L2 where l2
 * (mha__cpu_prefetch_to_l2). */
static inline __attribute__((always_inline)) void dot_w_body(int64_t K,
                                                             const float *x,
                                                             int64_t ldx,
                                                             int m,
                                                             const void *w,
                                                             const int wk,
                                                             const int mm,
                                                             const int l2,
                                                             int64_t pfb,
                                                             int64_t ldwb,
                                                             int n,
                                                             const float *bias,
                                                             float *y,
                                                             int64_t ldy) {
    __m512 acc0[MHA_GEMM_DOT_M][MHA_GEMM_DOT_N], acc1[MHA_GEMM_DOT_M][MHA_GEMM_DOT_N];
    MHA_UNROLL
    for (int i = 0; i < MHA_GEMM_DOT_M; i++) {
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++)
            acc0[i][j] = acc1[i][j] = _mm512_setzero_ps();
    }
    const float *xr[MHA_GEMM_DOT_M];
    const unsigned char *wr[MHA_GEMM_DOT_N];
    for (int i = 0; i < MHA_GEMM_DOT_M; i++)
        xr[i] = x + (i < m ? i : 0) * ldx;
    for (int j = 0; j < MHA_GEMM_DOT_N; j++)
        wr[j] = (const unsigned char *)w + (j < n ? j : 0) * ldwb;
    /* the bytes of W per 32 values: 64 halves, one q8_0 or q4_0 block */
    const int blocks = wk == W_Q8 || wk == W_Q4;
    const int64_t step = wk == W_Q8   ? MHA__Q8_BYTES
                         : wk == W_Q4 ? MHA__Q4_BYTES
                                      : 32 * (int64_t)sizeof(uint16_t);
    int64_t k = 0;
    if (!blocks && mm == 1)
        k = dot_h_row1(K, xr[0], wr, wk == W_BF16, l2, pfb, acc0, acc1);
    for (int64_t at = k / 32 * step; k + 32 <= K; k += 32, at += step) {
        __m512 a0[MHA_GEMM_DOT_M], a1[MHA_GEMM_DOT_M];
        MHA_UNROLL
        for (int i = 0; i < mm; i++) {
            a0[i] = _mm512_loadu_ps(xr[i] + k);
            a1[i] = _mm512_loadu_ps(xr[i] + k + 16);
        }
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++)
            gemm_dot_prefetch(wr[j] + at, pfb, l2);
        /* q8_0, q4_0: the rows' scales converted together (one VCVTPH2PS) and broadcast from
         * memory (a load). Per row and block, VPINSRW + VCVTPH2PS + VBROADCASTSS took three
         * operations of the two 512-bit ports (0 and 5 on an Intel core) that the widening and
         * the FMAs use (q4_0: the lookups keep the shuffle pipe busy). The empty asm hides
         * where dsm points, so GCC broadcasts from ds in memory instead of shuffling the register
         * it was converted in (a VSHUFPS and a VBROADCASTSS per row, on port 5). */
        float ds[MHA_GEMM_DOT_N] __attribute__((aligned(16)));
        const float *dsm = ds;
        __asm__("" : "+r"(dsm));
        if (blocks) {
            uint64_t bits = 0;
            MHA_UNROLL
            for (int j = 0; j < MHA_GEMM_DOT_N; j++) {
                uint16_t dh;
                memcpy(&dh, wr[j] + at, 2);
                bits |= (uint64_t)dh << (16 * j);
            }
            _mm_store_ps(ds, _mm_cvtph_ps(_mm_set_epi64x(0, (long long)bits)));
        }
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++) {
            __m512 b0, b1;
            if (wk == W_Q4)
                load_q4x32(wr[j] + at + 2, _mm512_set1_ps(dsm[j]), &b0, &b1);
            else if (wk == W_Q8)
                load_q8x32((const signed char *)wr[j] + at + 2, _mm512_set1_ps(dsm[j]), &b0, &b1);
            else
                load_w32(wr[j] + at, wk, &b0, &b1);
            MHA_UNROLL
            for (int i = 0; i < mm; i++) {
                acc0[i][j] = _mm512_fmadd_ps(a0[i], b0, acc0[i][j]);
                acc1[i][j] = _mm512_fmadd_ps(a1[i], b1, acc1[i][j]);
            }
        }
    }
    for (; !blocks && k < K; k += 16) { /* the K tail of halves (blocks: none) */
        const int64_t left = K - k;
        const __mmask16 mk = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        __m512 a0[MHA_GEMM_DOT_M];
        MHA_UNROLL
        for (int i = 0; i < mm; i++)
            a0[i] = _mm512_maskz_loadu_ps(mk, xr[i] + k);
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++) {
            const __m512 b0 = load_half16((const uint16_t *)wr[j] + k, wk == W_BF16, mk);
            MHA_UNROLL
            for (int i = 0; i < mm; i++)
                acc0[i][j] = _mm512_fmadd_ps(a0[i], b0, acc0[i][j]);
        }
    }
    /* Fully unrolled with a condition (not loops up to m, n): indexed by constants, the
     * accumulators stay in registers (with variable bounds gcc 12 stored all 16 to the stack in
     * every iteration of the main loop: 1.7x slower). */
    MHA_UNROLL
    for (int i = 0; i < MHA_GEMM_DOT_M; i++) {
        MHA_UNROLL
        for (int j = 0; j < MHA_GEMM_DOT_N; j++)
            if (i < mm && i < m && j < n) {
                const float s = _mm512_reduce_add_ps(_mm512_add_ps(acc0[i][j], acc1[i][j]));
                y[i * ldy + j] = bias ? s + bias[j] : s;
            }
    }
}

static void dot_h_avx512(int64_t K,
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
    const int64_t ldwb = ldw * (int64_t)sizeof(uint16_t);
    const int l2 = mha__cpu_prefetch_to_l2();
    if (bf16 && m == 1)
        dot_w_body(K, x, ldx, m, w, W_BF16, 1, l2, pfb, ldwb, n, bias, y, ldy);
    else if (bf16)
        dot_w_body(K, x, ldx, m, w, W_BF16, MHA_GEMM_DOT_M, l2, pfb, ldwb, n, bias, y, ldy);
    else if (m == 1)
        dot_w_body(K, x, ldx, m, w, W_F16, 1, l2, pfb, ldwb, n, bias, y, ldy);
    else
        dot_w_body(K, x, ldx, m, w, W_F16, MHA_GEMM_DOT_M, l2, pfb, ldwb, n, bias, y, ldy);
}

static void dot_q8_avx512(int64_t K,
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
        dot_w_body(K, x, ldx, m, w, W_Q8, 1, l2, pfb, ldw_bytes, n, bias, y, ldy);
    else
        dot_w_body(K, x, ldx, m, w, W_Q8, MHA_GEMM_DOT_M, l2, pfb, ldw_bytes, n, bias, y, ldy);
}

static void dot_q4_avx512(int64_t K,
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
        dot_w_body(K, x, ldx, m, w, W_Q4, 1, l2, pfb, ldw_bytes, n, bias, y, ldy);
    else
        dot_w_body(K, x, ldx, m, w, W_Q4, MHA_GEMM_DOT_M, l2, pfb, ldw_bytes, n, bias, y, ldy);
}

static void pack_a_14(const float *x, int64_t ldx, int m, int64_t kc, float *dst) {
    gemm_pack_rows_x86(x, ldx, m, kc, dst, MR);
}

/* MR and NR are also this kernel's registry line (p1, p2; tests/test_gemm.c checks them). */
const mha__gemm_kernel mha_gemm_f32_14x32__avx512 = {
    MR,         NR,        256,          1024, ukr_14x32,     pack_b_32,
    dot_avx512, pack_a_14, dot_h_avx512, NULL, dot_q8_avx512, dot_q4_avx512,
};

#endif
