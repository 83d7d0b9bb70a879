/* SPDX-License-Identifier: MIT */
/* attn_fwd_flash_avx512.c: FlashAttention-2 forward tile operations for AVX-512 (compiled with
 * the AVX-512 flags only; dispatch.c calls it only when cpu_features.c (cpuid + XGETBV) reports
 * AVX-512 F/DQ/BW/VL).
 * The tiling, masking and bookkeeping are the shared driver's (flash_fwd.c).
 *
 * Register blocking (32 zmm registers, 2 FMA ports with 4-cycle latency, so >= 8 independent
 * accumulators are needed to keep both ports busy):
 *   S = Q K^T: 4 query rows x 64 keys (4 vectors) = 16 accumulators; per d step 4 aligned loads
 *              of the packed K^T tile + 4 broadcasts of Q for 16 FMAs (loads never the limit).
 *   O += P V:  4 rows x up to 5 vectors of V columns (<= 20 accumulators); per key 4-5 loads of
 *              a V row + 4 broadcasts of P.
 * K is packed per key tile into K^T [dk][Bk] with 16x16 in-register transposes, so that the
 * score micro-kernel reads contiguous key vectors; V is read in place (its rows are contiguous).
 * Head sizes 32, 64, 80, 96, 128 and 256 are compiled with a constant D (the column chunking of
 * O += P V and the loop trip counts are then fixed); every other size runs the same code with a
 * run-time D.
 */
#include "kernels/flash_fwd.h"

#if defined(__x86_64__) || defined(__i386__)
#    include "kernels/x86/simd_avx512.h"

#    include <string.h>

/* Rows of a micro-tile (see the header comment). */
#    define QK_MR 4
#    define PV_MR 4

/* ---------------------------------------------------------------------------------------------- */
/* Packing: K tile rows [0, nk) x [0, dk) -> Kt[d][j].                                            */
/* ---------------------------------------------------------------------------------------------- */

static void pack_kt(const float *k, int64_t ks, int nk, int64_t dk, float *kt, int ldk) {
    const int nkp = (nk + 15) / 16 * 16;
    for (int j0 = 0; j0 < nkp; j0 += 16) {
        const int rows = nk - j0 < 16 ? nk - j0 : 16;
        for (int64_t d0 = 0; d0 < dk; d0 += 16) {
            const int cols = dk - d0 < 16 ? (int)(dk - d0) : 16;
            const __mmask16 cm = v16_first(cols);
            v16 r[16];
            for (int i = 0; i < 16; i++)
                r[i] = i < rows ? v16_loadu_mask(cm, k + (j0 + i) * ks + d0) : v16_zero();
            v16_transpose16(r);
            for (int c = 0; c < cols; c++)
                v16_store(kt + (d0 + c) * ldk + j0, r[c]);
        }
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* S = Q K^T                                                                                      */
/* ---------------------------------------------------------------------------------------------- */

/* ROWS x NV micro-tile: rows q[0..ROWS), key vectors [0, NV) of kt (already offset). */
MHA_INLINE void qk_micro(const float *const *q,
                         const float *kt,
                         int ldk,
                         int64_t D,
                         float *s,
                         int lds,
                         const int ROWS,
                         const int NV) {
    v16 acc[QK_MR][4];
    const float *qr[QK_MR];
    for (int r = 0; r < ROWS; r++) {
        qr[r] = q[r];
        for (int c = 0; c < NV; c++)
            acc[r][c] = v16_zero();
    }
    for (int64_t d = 0; d < D; d++) {
        v16 kv[4];
        for (int c = 0; c < NV; c++)
            kv[c] = v16_load(kt + d * ldk + 16 * c);
        for (int r = 0; r < ROWS; r++) {
            const v16 qb = v16_set1(qr[r][d]);
            for (int c = 0; c < NV; c++)
                acc[r][c] = v16_fma(qb, kv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NV; c++)
            v16_store(s + r * lds + 16 * c, acc[r][c]);
}

MHA_INLINE void qk_body(const float *const *q,
                        int rows,
                        const float *kt,
                        int ldk,
                        int nk,
                        int64_t D,
                        float *s,
                        int lds) {
    const int nv = (nk + 15) / 16;
    for (int r0 = 0; r0 < rows; r0 += QK_MR) {
        const int rr = rows - r0 < QK_MR ? rows - r0 : QK_MR;
        for (int c0 = 0; c0 < nv; c0 += 4) {
            const int cc = nv - c0 < 4 ? nv - c0 : 4;
            const float *const *qp = q + r0;
            const float *k = kt + 16 * c0;
            float *sp = s + r0 * lds + 16 * c0;
#    define QK_CASE(R, C)                                                                          \
    case (R)*8 + (C):                                                                              \
        qk_micro(qp, k, ldk, D, sp, lds, R, C);                                                    \
        break;
            switch (rr * 8 + cc) {
                QK_CASE(4, 4)
                QK_CASE(4, 3)
                QK_CASE(4, 2)
                QK_CASE(4, 1)
                QK_CASE(3, 4)
                QK_CASE(3, 3)
                QK_CASE(3, 2)
                QK_CASE(3, 1)
                QK_CASE(2, 4)
                QK_CASE(2, 3)
                QK_CASE(2, 2)
                QK_CASE(2, 1)
                QK_CASE(1, 4)
                QK_CASE(1, 3)
                QK_CASE(1, 2)
                QK_CASE(1, 1)
            default:
                MHA_ASSERT(0);
            }
#    undef QK_CASE
        }
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* O = alpha O + P V                                                                              */
/* ---------------------------------------------------------------------------------------------- */

/* ROWS x NV micro-tile over V columns [c0, c0 + 16 NV); the last vector reads only `last` lanes
 * of V (O rows are padded to whole vectors, so O is always written in full vectors). */
MHA_INLINE void pv_micro(const float *pm,
                         int lds,
                         int nk,
                         const float *v,
                         int64_t vs,
                         const float *alpha,
                         float *o,
                         int ldo,
                         __mmask16 last,
                         const int ROWS,
                         const int NV) {
    v16 acc[PV_MR][5];
    for (int r = 0; r < ROWS; r++) {
        const v16 a = v16_set1(alpha[r]);
        for (int c = 0; c < NV; c++)
            acc[r][c] = v16_mul(v16_load(o + r * ldo + 16 * c), a);
    }
    for (int j = 0; j < nk; j++) {
        const float *vj = v + j * vs;
        v16 vv[5];
        for (int c = 0; c < NV - 1; c++)
            vv[c] = v16_loadu(vj + 16 * c);
        vv[NV - 1] = v16_loadu_mask(last, vj + 16 * (NV - 1));
        for (int r = 0; r < ROWS; r++) {
            const v16 pb = v16_set1(pm[r * lds + j]);
            for (int c = 0; c < NV; c++)
                acc[r][c] = v16_fma(pb, vv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NV; c++)
            v16_store(o + r * ldo + 16 * c, acc[r][c]);
}

MHA_INLINE void pv_rows(const float *pm,
                        int lds,
                        int nk,
                        const float *v,
                        int64_t vs,
                        const float *alpha,
                        float *o,
                        int ldo,
                        __mmask16 last,
                        const int ROWS,
                        int nv) {
    switch (nv) {
    case 1:
        pv_micro(pm, lds, nk, v, vs, alpha, o, ldo, last, ROWS, 1);
        break;
    case 2:
        pv_micro(pm, lds, nk, v, vs, alpha, o, ldo, last, ROWS, 2);
        break;
    case 3:
        pv_micro(pm, lds, nk, v, vs, alpha, o, ldo, last, ROWS, 3);
        break;
    case 4:
        pv_micro(pm, lds, nk, v, vs, alpha, o, ldo, last, ROWS, 4);
        break;
    case 5:
        pv_micro(pm, lds, nk, v, vs, alpha, o, ldo, last, ROWS, 5);
        break;
    default:
        MHA_ASSERT(0);
    }
}

MHA_INLINE void pv_body(const float *pm,
                        int lds,
                        int rows,
                        int nk,
                        const float *v,
                        int64_t vs,
                        int64_t DV,
                        const float *alpha,
                        float *o,
                        int ldo) {
    /* Column chunks: up to 5 vectors in one chunk, else near-equal chunks of <= 4 vectors
     * (8 -> 4+4, 6 -> 3+3, 16 -> 4x4), so every chunk has >= 8 accumulators when ROWS = 4. */
    const int64_t nvec = (DV + 15) / 16;
    const int64_t nchunks = nvec <= 5 ? 1 : (nvec + 3) / 4;
    int64_t col = 0;
    for (int64_t ch = 0; ch < nchunks; ch++) {
        const int nv = (int)((nvec - col / 16) / (nchunks - ch));
        const int64_t cols = DV - col < 16 * nv ? DV - col : 16 * nv;
        const __mmask16 last = v16_first((int)(cols - 16 * (nv - 1)));
        for (int r0 = 0; r0 < rows; r0 += PV_MR) {
            const int rr = rows - r0 < PV_MR ? rows - r0 : PV_MR;
            const float *pr = pm + r0 * lds;
            float *orow = o + r0 * ldo + col;
            switch (rr) {
            case 4:
                pv_rows(pr, lds, nk, v + col, vs, alpha + r0, orow, ldo, last, 4, nv);
                break;
            case 3:
                pv_rows(pr, lds, nk, v + col, vs, alpha + r0, orow, ldo, last, 3, nv);
                break;
            case 2:
                pv_rows(pr, lds, nk, v + col, vs, alpha + r0, orow, ldo, last, 2, nv);
                break;
            default:
                pv_rows(pr, lds, nk, v + col, vs, alpha + r0, orow, ldo, last, 1, nv);
                break;
            }
        }
        col += 16 * nv;
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* D specialisation: one instance per common head size, one with a run-time size.                 */
/* ---------------------------------------------------------------------------------------------- */

#    include "kernels/flash_fwd_specialise.h" /* qk() and pv() per head size */

/* ---------------------------------------------------------------------------------------------- */
/* Softmax steps                                                                                  */
/* ---------------------------------------------------------------------------------------------- */

/* Visible lanes of vector c of row r: the tile's first nk lanes, & the row's visibility bits. */
MHA_INLINE __mmask16 lanes(const mha__flash_softmax *a, int r, int c) {
    __mmask16 k = v16_first(a->nk - 16 * c);
    if (a->vis)
        k &= (__mmask16)(a->vis[r * MHA_FLASH_WORDS + c / 4] >> (16 * (c % 4)));
    return k;
}

/* x = transformed score vector c of row r (see mha__flash_softmax), -inf where invisible. */
MHA_INLINE v16 score(const mha__flash_softmax *a, const float *s, int r, int c, __mmask16 k) {
    v16 x = v16_mul(v16_set1(a->scale), v16_load(s + 16 * c));
    if (a->softcap > 0.0f) {
        const v16 cap = v16_set1(a->softcap);
        x = v16_mul(cap, v16_tanh(_mm512_div_ps(x, cap)));
    }
    if (a->bias)
        x = v16_add(x, v16_loadu_mask(k, a->bias + r * a->ldb + 16 * c));
    return v16_select(k, x, v16_set1(-INFINITY));
}

/* Three phases, so that no step waits on a scalar: (A) transformed scores and the row max,
 * four rows at a time (one joint horizontal reduction); (B) m, mu and alpha = exp(m - mu) for 16
 * rows per vector; (C) P = exp(x - mu) and the row sums, four rows at a time. */
static void softmax_online(const mha__flash_softmax *args) {
    /* A local copy: stores through a->s cannot alias it, so the loop-invariant fields stay in
     * registers. */
    const mha__flash_softmax local = *args, *a = &local;
    const int nv = (a->nk + 15) / 16, rows = a->rows;
    /* Full tile, no mask, bias or softcap: the transform is one multiply. */
    const int plain = !a->vis && !a->bias && !(a->softcap > 0.0f) && a->nk % 16 == 0;
    const v16 scale = v16_set1(a->scale);
    float red[16] __attribute__((aligned(64)));
    /* (A) The new max goes to a->mu for now. */
    for (int r0 = 0; r0 < rows; r0 += 4) {
        v16 vm[4] = {v16_set1(-INFINITY), v16_set1(-INFINITY), v16_set1(-INFINITY),
                     v16_set1(-INFINITY)};
        const int rr = rows - r0 < 4 ? rows - r0 : 4;
        for (int q = 0; q < rr; q++) {
            float *s = a->s + (r0 + q) * a->lds;
            v16 mx = v16_set1(-INFINITY); /* a register, not vm[q]: no store-load chain */
            if (plain) {
                for (int c = 0; c < nv; c++) {
                    const v16 x = v16_mul(scale, v16_load(s + 16 * c));
                    v16_store(s + 16 * c, x);
                    mx = v16_max_nan_ignoring(x, mx);
                }
            } else {
                for (int c = 0; c < nv; c++) {
                    const v16 x = score(a, s, r0 + q, c, lanes(a, r0 + q, c));
                    v16_store(s + 16 * c, x);
                    mx = v16_max_nan_ignoring(x, mx);
                }
            }
            vm[q] = mx;
        }
        v16_store(red, v16_hmax4(vm[0], vm[1], vm[2], vm[3]));
        for (int q = 0; q < rr; q++) {
            const float tmax = red[4 * q], m_old = a->m[r0 + q];
            a->mu[r0 + q] = tmax > m_old ? tmax : m_old;
        }
    }
    /* (B) */
    for (int r0 = 0; r0 < rows; r0 += 16) {
        const __mmask16 k = v16_first(rows - r0);
        const v16 m_old = v16_loadu_mask(k, a->m + r0), m_new = v16_loadu_mask(k, a->mu + r0);
        const __mmask16 inf = _mm512_cmp_ps_mask(m_new, v16_set1(-INFINITY), _CMP_EQ_OQ);
        const v16 mu = _mm512_mask_blend_ps(inf, m_new, v16_zero());
        v16_storeu_mask(a->alpha + r0, k, v16_exp(v16_sub(m_old, mu)));
        v16_storeu_mask(a->m + r0, k, m_new);
        v16_storeu_mask(a->mu + r0, k, mu);
    }
    /* (C) */
    for (int r0 = 0; r0 < rows; r0 += 4) {
        v16 sum[4] = {v16_zero(), v16_zero(), v16_zero(), v16_zero()};
        const int rr = rows - r0 < 4 ? rows - r0 : 4;
        for (int q = 0; q < rr; q++) {
            const int r = r0 + q;
            float *s = a->s + r * a->lds;
            const v16 mu = v16_set1(a->mu[r]);
            v16 acc = v16_zero();
            for (int c = 0; c < nv; c++) {
                v16 p = v16_exp_nonpos(v16_sub(v16_load(s + 16 * c), mu));
                acc = v16_add(acc, p);
                if (a->keep) {
                    const __mmask16 kb =
                        (__mmask16)(a->keep[r * MHA_FLASH_WORDS + c / 4] >> (16 * (c % 4)));
                    p = _mm512_maskz_mul_ps(kb, p, v16_set1(a->keep_scale));
                }
                v16_store(s + 16 * c, p);
            }
            sum[q] = acc;
        }
        v16_store(red, v16_hsum4(sum[0], sum[1], sum[2], sum[3]));
        for (int q = 0; q < rr; q++)
            a->l[r0 + q] = a->l[r0 + q] * a->alpha[r0 + q] + red[4 * q];
    }
}

static void softmax_final(const mha__flash_softmax *args) {
    /* A local copy: stores through a->s cannot alias it, so the loop-invariant fields stay in
     * registers. */
    const mha__flash_softmax local = *args, *a = &local;
    const int nv = (a->nk + 15) / 16;
    for (int r = 0; r < a->rows; r++) {
        float *s = a->s + r * a->lds;
        const v16 vmu = v16_set1(a->mu[r]), inv = v16_set1(a->inv_l[r]);
        for (int c = 0; c < nv; c++) {
            const v16 x = score(a, s, r, c, lanes(a, r, c));
            v16_store(s + 16 * c, v16_mul(v16_exp(v16_sub(x, vmu)), inv));
        }
    }
}

static int all_finite(const float *v, int64_t vs, int nk, int64_t dv) {
    /* x * 0 is 0 for finite x and NaN for Inf/NaN; FMAs into 4 independent sums. */
    v16 acc[4] = {v16_zero(), v16_zero(), v16_zero(), v16_zero()};
    const v16 zero = v16_zero();
    const __mmask16 tail = v16_first((int)(dv % 16));
    for (int j = 0; j < nk; j++) {
        const float *vj = v + j * vs;
        int64_t d = 0;
        for (; d + 64 <= dv; d += 64)
            for (int c = 0; c < 4; c++)
                acc[c] = v16_fma(v16_loadu(vj + d + 16 * c), zero, acc[c]);
        for (; d + 16 <= dv; d += 16)
            acc[j & 3] = v16_fma(v16_loadu(vj + d), zero, acc[j & 3]);
        if (d < dv)
            acc[j & 3] = v16_fma(v16_loadu_mask(tail, vj + d), zero, acc[j & 3]);
    }
    const v16 all = v16_add(v16_add(acc[0], acc[1]), v16_add(acc[2], acc[3]));
    return _mm512_cmp_ps_mask(all, all, _CMP_UNORD_Q) == 0;
}

/* 16 keys per Philox vector; counter (j, i, h, b), key (seed lo, seed hi) as in philox.c. */
static void dropout_bits(
    uint64_t seed, float p, int64_t b, int64_t h, int64_t i, int64_t j0, int nk, uint64_t *words) {
    const __m512i thr = _mm512_set1_epi32((int)mha__dropout_threshold(p));
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int k = 0; k < MHA_FLASH_WORDS; k++)
        words[k] = 0;
    for (int c = 0; 16 * c < nk; c++) {
        const __m512i cj = _mm512_add_epi32(_mm512_set1_epi32((int)(uint32_t)(j0 + 16 * c)), lane);
        const __m512i w0 = v16i_philox_word0(
            cj, _mm512_set1_epi32((int)(uint32_t)i), _mm512_set1_epi32((int)(uint32_t)h),
            _mm512_set1_epi32((int)(uint32_t)b), (uint32_t)seed, (uint32_t)(seed >> 32));
        const __mmask16 keep = _mm512_cmpge_epu32_mask(w0, thr) & v16_first(nk - 16 * c);
        words[c / 4] |= (uint64_t)keep << (16 * (c % 4));
    }
}

MHA_FLASH_F32_TILE_OPS(avx512_tile_ops)
const mha__flash_softmax_ops mha__flash_softmax_avx512 = {softmax_online, softmax_final,
                                                          dropout_bits};

/* Bq and Bk come from this kernel's registry line (kernels/registry.def). */
void mha_fwd_f32_flash_q64k64__avx512(const mha__kernel_info *k,
                                      const mha__problem *p,
                                      const mha__fwd_unit *u,
                                      void *scratch) {
    mha__flash_fwd(&mha__flash_softmax_avx512, &avx512_tile_ops, k->bq, k->bk, p, u, scratch);
}

void mha__dropout_bits_avx512(
    uint64_t seed, float p, int64_t b, int64_t h, int64_t i, int64_t j0, int nk, uint64_t *words) {
    dropout_bits(seed, p, b, h, i, j0, nk, words);
}

void mha__vexp_avx512(const float *x, float *y, int64_t count) {
    for (int64_t i = 0; i < count; i += 16) {
        const __mmask16 k = v16_first(count - i < 16 ? (int)(count - i) : 16);
        v16_storeu_mask(y + i, k, v16_exp(v16_loadu_mask(k, x + i)));
    }
}

void mha__vtanh_avx512(const float *x, float *y, int64_t count) {
    for (int64_t i = 0; i < count; i += 16) {
        const __mmask16 k = v16_first(count - i < 16 ? (int)(count - i) : 16);
        v16_storeu_mask(y + i, k, v16_tanh(v16_loadu_mask(k, x + i)));
    }
}

#endif /* x86 */
