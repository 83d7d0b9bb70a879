/* SPDX-License-Identifier: MIT */
/* attn_fwd_flash_avx512bf16.c: FlashAttention-2 forward tile operations on bf16 tiles for
 * AVX512-BF16 (compiled with the AVX-512 flags + -mavx512bf16 only; dispatch runs it only when
 * cpu_features.c reports MHA_ISA_AVX512BF16, and only for bf16 q, k and v: registry.def).
 * The tiling, masking and bookkeeping are the shared driver's (flash_fwd.c); the softmax steps
 * are the AVX-512 float32 ones (mha__flash_softmax_avx512), so only the two tile products differ
 * from mha_fwd_f32_flash_q64k64__avx512:
 *
 *   vdpbf16ps acc, a, b: acc[i] += a[2i] b[2i] + a[2i+1] b[2i+1] for 16 float32 lanes i, the
 *   products of two bf16 exact in float32 (8 + 8 significant bits), the sums rounded to nearest
 *   (denormal inputs and outputs flushed to zero). One instruction does 32 multiply-adds where an
 *   FMA does 16.
 *
 *   S = Q K^T: lanes = 16 keys, the pair = two consecutive d. Kt2[d/2][j] = (K[j][d], K[j][d+1])
 *              packed per key tile (a 16x16 transpose of 32-bit pairs), a Q pair broadcast. The
 *              scores are the float32 sums of exact products of the bf16 inputs: no rounding
 *              beyond the f32 kernel's (only its summation order differs).
 *   O += P V:  lanes = 16 columns of V, the pair = two consecutive keys. V2[j/2][d] = (V[j][d],
 *              V[j+1][d]) packed per tile; P is rounded to bf16 (nearest even, as FlashAttention
 *              does) and a P pair broadcast. Each probability then carries a relative error of
 *              at most 2^-8 (docs/SEMANTICS.md, "Half precision"); l sums the unrounded p.
 *
 * Register blocking as the f32 kernel's: S 4 rows x 64 keys (16 accumulators), O 4 rows x up to
 * 5 vectors of columns; per pair step 4 loads of Kt2 + 4 broadcasts for 16 vdpbf16ps.
 * Odd sizes: an odd dk gets a zero appended to each Q row (driver) and to each K row (here); an
 * odd key count a zero V row.
 */
#include "kernels/flash_fwd.h"

#if defined(__x86_64__) || defined(__i386__)
#    include "kernels/x86/simd_avx512.h"

#    include <string.h>

#    define QK_MR 4
#    define PV_MR 4

/* acc + a.even b.even + a.odd b.odd, a and b 16 pairs of bf16 each. */
MHA_INLINE v16 dot2(v16 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* The pair (x[0], x[1]) of bf16 as one 32-bit word, broadcast to 16 lanes. */
MHA_INLINE __m512i pair_set1(const uint16_t *x) {
    uint32_t w;
    memcpy(&w, x, sizeof w);
    return _mm512_set1_epi32((int)w);
}

/* ---------------------------------------------------------------------------------------------- */
/* Packing                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

/* K tile rows [0, nk) (bf16, row stride ks) -> Kt2[p][j] = (K[j][2p], K[j][2p+1]) for
 * p < ceil(dk / 2), 32-bit pairs with row stride ldk; keys nk .. round_up(nk, 16) - 1 and the
 * odd dk's last upper half are zero. */
static void pack_kt(const void *kv, int64_t ks, int nk, int64_t dk, void *ktv, int ldk) {
    const uint16_t *k = kv;
    uint32_t *kt = ktv;
    const int64_t dp = (dk + 1) / 2;
    const int nkp = (nk + 15) / 16 * 16;
    for (int j0 = 0; j0 < nkp; j0 += 16) {
        const int rows = nk - j0 < 16 ? nk - j0 : 16;
        for (int64_t p0 = 0; p0 < dp; p0 += 16) {
            const int64_t left = dk - 2 * p0; /* bf16 elements of the row from 2 p0 on, >= 1 */
            const __mmask32 em = left >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << left) - 1);
            const int cols = dp - p0 < 16 ? (int)(dp - p0) : 16;
            v16 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = i < rows ? _mm512_castsi512_ps(
                                      _mm512_maskz_loadu_epi16(em, k + (j0 + i) * ks + 2 * p0))
                                : v16_zero();
            v16_transpose16(r); /* 32-bit lanes: pairs move as a whole */
            for (int c = 0; c < cols; c++)
                _mm512_storeu_si512(kt + (p0 + c) * ldk + j0, _mm512_castps_si512(r[c]));
        }
    }
}

/* V tile rows [0, nk) (bf16, row stride vs) -> V2[j/2][d] = (V[j][d], V[j+1][d]) for d < ldv
 * (zero from dv on, and V[nk] = 0 when nk is odd), rows of ldv 32-bit pairs. */
static void pack_v(const void *vv, int64_t vs, int nk, int64_t dv, void *vtv, int64_t ldv) {
    const uint16_t *v = vv;
    uint32_t *vt = vtv;
    for (int j = 0; j < nk; j += 2) {
        const uint16_t *r0 = v + j * vs, *r1 = v + (j + 1) * vs;
        uint32_t *out = vt + (j / 2) * ldv;
        for (int64_t d0 = 0; d0 < ldv; d0 += 16) {
            const __mmask16 m = dv - d0 > 0 ? v16_first(dv - d0 < 16 ? (int)(dv - d0) : 16) : 0;
            const __m512i a = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r0 + d0));
            const __m512i b = j + 1 < nk
                                  ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r1 + d0))
                                  : _mm512_setzero_si512();
            _mm512_storeu_si512(out + d0, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
    }
}

/* 1 when no bf16 of the packed V tile (pairs of keys < nk, columns < dv) is Inf or NaN, i.e.
 * has an all-ones exponent. */
static int all_finite(const void *vv, int64_t vs, int nk, int64_t dv) {
    const uint32_t *v = vv;
    const __m512i e = _mm512_set1_epi16(0x7f80);
    __mmask32 bad = 0;
    for (int q = 0; q < (nk + 1) / 2; q++)
        for (int64_t d0 = 0; d0 < dv; d0 += 16) { /* rows are zero-padded to a multiple of 16 */
            const __m512i x = _mm512_loadu_si512(v + q * vs + d0);
            bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(x, e), e);
        }
    return bad == 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* S = Q K^T                                                                                      */
/* ---------------------------------------------------------------------------------------------- */

/* ROWS x NV micro-tile: Q rows q[r * ldq] (bf16), key vectors [0, NV) of kt (already offset),
 * DP pairs of d. */
MHA_INLINE void qk_micro(const uint16_t *q,
                         int64_t ldq,
                         const uint32_t *kt,
                         int ldk,
                         int64_t DP,
                         float *s,
                         int lds,
                         const int ROWS,
                         const int NV) {
    v16 acc[QK_MR][4];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NV; c++)
            acc[r][c] = v16_zero();
    for (int64_t p = 0; p < DP; p++) {
        __m512i kv[4];
        for (int c = 0; c < NV; c++)
            kv[c] = _mm512_loadu_si512(kt + p * ldk + 16 * c);
        for (int r = 0; r < ROWS; r++) {
            const __m512i qb = pair_set1(q + r * ldq + 2 * p);
            for (int c = 0; c < NV; c++)
                acc[r][c] = dot2(acc[r][c], qb, kv[c]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NV; c++)
            v16_store(s + r * lds + 16 * c, acc[r][c]);
}

MHA_INLINE void qk_body(const uint16_t *q,
                        int64_t ldq,
                        int rows,
                        const uint32_t *kt,
                        int ldk,
                        int nk,
                        int64_t DP,
                        float *s,
                        int lds) {
    const int nv = (nk + 15) / 16;
    for (int r0 = 0; r0 < rows; r0 += QK_MR) {
        const int rr = rows - r0 < QK_MR ? rows - r0 : QK_MR;
        for (int c0 = 0; c0 < nv; c0 += 4) {
            const int cc = nv - c0 < 4 ? nv - c0 : 4;
            const uint16_t *qp = q + r0 * ldq;
            const uint32_t *k = kt + 16 * c0;
            float *sp = s + r0 * lds + 16 * c0;
#    define QK_CASE(R, C)                                                                          \
    case (R)*8 + (C):                                                                              \
        qk_micro(qp, ldq, k, ldk, DP, sp, lds, R, C);                                              \
        break;
#    define QK_ROW(R) QK_CASE(R, 4) QK_CASE(R, 3) QK_CASE(R, 2) QK_CASE(R, 1)
            switch (rr * 8 + cc) {
                QK_ROW(4)
                QK_ROW(3)
                QK_ROW(2)
                QK_ROW(1)
            default:
                MHA_ASSERT(0);
            }
#    undef QK_ROW
#    undef QK_CASE
        }
    }
}

/* Constant pair counts for head sizes 64 and 128 (unrolled loops), any other at run time. */
static void qk_dp32(const uint16_t *q,
                    int64_t ldq,
                    int rows,
                    const uint32_t *kt,
                    int ldk,
                    int nk,
                    float *s,
                    int lds) {
    qk_body(q, ldq, rows, kt, ldk, nk, 32, s, lds);
}
static void qk_dp64(const uint16_t *q,
                    int64_t ldq,
                    int rows,
                    const uint32_t *kt,
                    int ldk,
                    int nk,
                    float *s,
                    int lds) {
    qk_body(q, ldq, rows, kt, ldk, nk, 64, s, lds);
}

static void qk(const void *q,
               int64_t ldq,
               int rows,
               const void *kt,
               int ldk,
               int nk,
               int64_t dk,
               float *s,
               int lds) {
    const int64_t dp = (dk + 1) / 2;
    if (dp == 32)
        qk_dp32(q, ldq, rows, kt, ldk, nk, s, lds);
    else if (dp == 64)
        qk_dp64(q, ldq, rows, kt, ldk, nk, s, lds);
    else
        qk_body(q, ldq, rows, kt, ldk, nk, dp, s, lds);
}

/* ---------------------------------------------------------------------------------------------- */
/* O = alpha O + P V                                                                              */
/* ---------------------------------------------------------------------------------------------- */

#    define LDP (MHA_FLASH_MAX_BK / 2) /* pairs per row of the rounded P */

/* pp[r][q] = (bf16(P[r][2q]), bf16(P[r][2q+1])), nearest even, for q < 8 ceil(nk / 16) (P is 0
 * in the lanes from nk to round_up(nk, 16): the softmax step writes them so). */
static void round_p(const float *pm, int lds, int rows, int nk, uint32_t *pp) {
    for (int r = 0; r < rows; r++)
        for (int c = 0; 16 * c < nk; c++) {
            const __m256bh h = _mm512_cvtneps_pbh(v16_load(pm + r * lds + 16 * c));
            _mm256_storeu_si256((__m256i *)(pp + r * LDP + 8 * c), (__m256i)h);
        }
}

/* ROWS x NV micro-tile over packed V columns [0, 16 NV) (v already offset), npairs key pairs. */
MHA_INLINE void pv_micro(const uint32_t *pp,
                         int npairs,
                         const uint32_t *v,
                         int64_t vs,
                         const float *alpha,
                         float *o,
                         int ldo,
                         const int ROWS,
                         const int NV) {
    v16 acc[PV_MR][5];
    for (int r = 0; r < ROWS; r++) {
        const v16 a = v16_set1(alpha[r]);
        for (int c = 0; c < NV; c++)
            acc[r][c] = v16_mul(v16_load(o + r * ldo + 16 * c), a);
    }
    for (int q = 0; q < npairs; q++) {
        __m512i vv[5];
        for (int c = 0; c < NV; c++)
            vv[c] = _mm512_loadu_si512(v + q * vs + 16 * c);
        for (int r = 0; r < ROWS; r++) {
            const __m512i pb = _mm512_set1_epi32((int)pp[r * LDP + q]);
            for (int c = 0; c < NV; c++)
                acc[r][c] = dot2(acc[r][c], pb, vv[c]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NV; c++)
            v16_store(o + r * ldo + 16 * c, acc[r][c]);
}

MHA_INLINE void pv_rows(const uint32_t *pp,
                        int npairs,
                        const uint32_t *v,
                        int64_t vs,
                        const float *alpha,
                        float *o,
                        int ldo,
                        const int ROWS,
                        int nv) {
    switch (nv) {
    case 1:
        pv_micro(pp, npairs, v, vs, alpha, o, ldo, ROWS, 1);
        break;
    case 2:
        pv_micro(pp, npairs, v, vs, alpha, o, ldo, ROWS, 2);
        break;
    case 3:
        pv_micro(pp, npairs, v, vs, alpha, o, ldo, ROWS, 3);
        break;
    case 4:
        pv_micro(pp, npairs, v, vs, alpha, o, ldo, ROWS, 4);
        break;
    case 5:
        pv_micro(pp, npairs, v, vs, alpha, o, ldo, ROWS, 5);
        break;
    default:
        MHA_ASSERT(0);
    }
}

/* O rows and the packed V rows are padded to whole vectors (ldo, with zeros in V), so every
 * column vector is read and written whole. Chunks of columns as the f32 kernel's. */
static void pv(const float *pm,
               int lds,
               int rows,
               int nk,
               const void *vv,
               int64_t vs,
               int64_t dv,
               const float *alpha,
               float *o,
               int ldo) {
    const uint32_t *v = vv;
    uint32_t pp[MHA_FLASH_MAX_BQ * LDP] __attribute__((aligned(64)));
    round_p(pm, lds, rows, nk, pp);
    const int npairs = (nk + 1) / 2;
    const int64_t nvec = (dv + 15) / 16;
    const int64_t nchunks = nvec <= 5 ? 1 : (nvec + 3) / 4;
    int64_t col = 0;
    for (int64_t ch = 0; ch < nchunks; ch++) {
        const int nv = (int)((nvec - col / 16) / (nchunks - ch));
        for (int r0 = 0; r0 < rows; r0 += PV_MR) {
            const int rr = rows - r0 < PV_MR ? rows - r0 : PV_MR;
            const uint32_t *pr = pp + r0 * LDP;
            float *orow = o + r0 * ldo + col;
            switch (rr) {
            case 4:
                pv_rows(pr, npairs, v + col, vs, alpha + r0, orow, ldo, 4, nv);
                break;
            case 3:
                pv_rows(pr, npairs, v + col, vs, alpha + r0, orow, ldo, 3, nv);
                break;
            case 2:
                pv_rows(pr, npairs, v + col, vs, alpha + r0, orow, ldo, 2, nv);
                break;
            default:
                pv_rows(pr, npairs, v + col, vs, alpha + r0, orow, ldo, 1, nv);
                break;
            }
        }
        col += 16 * nv;
    }
}

static const mha__flash_tile_ops bf16_tile_ops = {MHA_DTYPE_BF16, pack_kt, qk,
                                                  pack_v,         pv,      all_finite};

/* Bq and Bk come from this kernel's registry line (kernels/registry.def). */
void mha_fwd_bf16_flash_q64k64__avx512bf16(const mha__kernel_info *k,
                                           const mha__problem *p,
                                           const mha__fwd_unit *u,
                                           void *scratch) {
    mha__flash_fwd(&mha__flash_softmax_avx512, &bf16_tile_ops, k->bq, k->bk, p, u, scratch);
}

#endif /* x86 */
