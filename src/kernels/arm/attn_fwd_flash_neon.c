/* SPDX-License-Identifier: MIT */
/* attn_fwd_flash_neon.c: FlashAttention-2 forward tile operations for AArch64 Advanced SIMD
 * (NEON, 4 floats per vector; compiled only for aarch64, where it is baseline, and dispatched
 * when cpu_features.c reports HWCAP_ASIMD). The tiling, masking and bookkeeping are the shared
 * driver's (flash_fwd.c); the structure follows attn_fwd_flash_avx2.c with 4-float vectors.
 *
 * Register budget (32 vector registers v0-v31; the target cores have 2 (Neoverse N1, Cortex-A7x)
 * or 4 (Neoverse V1/V2, Apple M) 128-bit FMA pipes with about 4 cycles of FMA latency, so 8 to 16
 * independent accumulators keep every pipe busy):
 *   S = Q K^T: 5 query rows x 16 keys (4 vectors) = 20 accumulators. Each row's Q vector holds 4
 *              consecutive d and feeds 4 d steps through the by-element FMLA
 *              (fmla v.4s, v.4s, v.s[l]: no broadcast instruction or register); per d step 4 K^T
 *              vectors. Live: 20 + 5 Q + 4 K^T = 29 registers; per 4 d steps 16 + 5 loads for
 *              80 FMAs.
 *   O += P V:  5 rows x 16 columns of V (4 vectors) = 20 accumulators; each row's P vector holds
 *              4 consecutive keys, per key 4 V vectors (same budget and load count).
 * Why 5 x 16: a broadcast scalar occupies a vector register too, so 6 x 16 (24 accumulators, the
 * AVX2 shape) needs 24 + 6 + 4 = 34 registers and spilled; 4 x 16 has 16 chains, no more than
 * the latency x pipes product of the 4-pipe cores; 20 chains leave a margin there and cover the
 * 2-pipe cores 2.5 times. Bq = 64 rows are 12 micro-tiles of 5 and one of 4 (98.5% of full).
 * What limits the kernel: on 2-pipe cores the FMA pipes (loads, about 1 per 4 FMAs, are far from
 * the 2 load ports); on 4-pipe cores the small chain margin and the issue width (about 5
 * instructions per cycle for 4 FMAs per cycle). The softmax costs about 25 instructions per 4
 * scores (exp included): an estimated 20-25% of the tile's FMA time at d = 64, 10-15% at d = 128.
 * K is packed per key tile into K^T [dk][Bk] with 4x4 in-register transposes (TRN1/TRN2 on 32-
 * then 64-bit elements); V comes packed by the driver. Head sizes 32, 64, 80, 96, 128 and 256
 * are compiled with a constant D (all whole 16-column blocks); others run the same code with a
 * run-time D (column tails by partial vectors).
 */
#include "kernels/flash_fwd.h"

#if defined(__aarch64__)
#    include "kernels/arm/simd_neon.h"

#    define QK_MR 5 /* rows of an S = Q K^T micro-tile */
#    define QK_NV 4 /* vectors of keys of an S micro-tile (16 keys) */
#    define PV_MR 5 /* rows of an O += P V micro-tile */
#    define PV_NV 4 /* vectors of V columns of an O micro-tile (16 columns) */

/* GCC's first scheduling pass (before register allocation, -fschedule-insns is on at -O2 for
 * aarch64) hoists the next step's loads above this step's FMAs; with 20 accumulators, 5 Q (or P)
 * vectors and 4 K (or V) vectors live that needs more than 32 registers, and accumulators were
 * spilled inside the loop (seen in the assembly of gcc 12). An empty volatile asm is a
 * scheduling barrier for that pass and emits nothing; the out-of-order core overlaps the steps
 * by itself. */
#    define SCHED_BARRIER() __asm__ volatile("")

/* acc + b * x with x a scalar: FMLA by element (GCC keeps x in lane 0 of an s register). */
MHA_INLINE v4 fma_scalar(v4 acc, v4 b, float x) {
    return vfmaq_n_f32(acc, b, x);
}

/* ---------------------------------------------------------------------------------------------- */
/* Packing                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

static void pack_kt(const float *k, int64_t ks, int nk, int64_t dk, float *kt, int ldk) {
    const int nkp = (nk + 15) / 16 * 16;
    for (int j0 = 0; j0 < nkp; j0 += 4) {
        const int rows = nk - j0 < 4 ? (nk - j0 > 0 ? nk - j0 : 0) : 4;
        for (int64_t d0 = 0; d0 < dk; d0 += 4) {
            const int cols = dk - d0 < 4 ? (int)(dk - d0) : 4;
            v4 r[4];
            for (int i = 0; i < 4; i++)
                r[i] = i < rows ? v4_loadu_first(k + (j0 + i) * ks + d0, cols) : v4_zero();
            v4_transpose4(r);
            for (int c = 0; c < cols; c++)
                v4_store(kt + (d0 + c) * ldk + j0, r[c]);
        }
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* S = Q K^T                                                                                      */
/* ---------------------------------------------------------------------------------------------- */

/* One d step of the micro-tile: the 4 K^T vectors of row d + L times lane L of each row's Q
 * vector (L a literal: FMLA by element needs an immediate lane). */
#    define QK_STEP(L)                                                                             \
        do {                                                                                       \
            const float *kd = kt + (d + (L)) * ldk;                                                \
            const v4 k0 = v4_load(kd), k1 = v4_load(kd + 4);                                       \
            const v4 k2 = v4_load(kd + 8), k3 = v4_load(kd + 12);                                  \
            for (int r = 0; r < ROWS; r++) {                                                       \
                acc[r][0] = v4_fma_lane(k0, qv[r], L, acc[r][0]);                                  \
                acc[r][1] = v4_fma_lane(k1, qv[r], L, acc[r][1]);                                  \
                acc[r][2] = v4_fma_lane(k2, qv[r], L, acc[r][2]);                                  \
                acc[r][3] = v4_fma_lane(k3, qv[r], L, acc[r][3]);                                  \
            }                                                                                      \
            SCHED_BARRIER();                                                                       \
        } while (0)

/* S[ROWS][16] = Q[ROWS][:D] K^T[:D][16]; one FMA chain per element in increasing d. Each row's
 * Q vector serves 4 d steps (lanes 0..3); a d tail (D % 4, run-time sizes only) takes the
 * element itself. */
MHA_INLINE void qk_micro(
    const float *const *q, const float *kt, int ldk, int64_t D, float *s, int lds, const int ROWS) {
    v4 acc[QK_MR][QK_NV];
    const float *qr[QK_MR];
    for (int r = 0; r < ROWS; r++) {
        qr[r] = q[r];
        for (int c = 0; c < QK_NV; c++)
            acc[r][c] = v4_zero();
    }
    int64_t d = 0;
    for (; d + 4 <= D; d += 4) {
        v4 qv[QK_MR];
        for (int r = 0; r < ROWS; r++)
            qv[r] = v4_loadu(qr[r] + d);
        QK_STEP(0);
        QK_STEP(1);
        QK_STEP(2);
        QK_STEP(3);
    }
    for (; d < D; d++) {
        const float *kd = kt + d * ldk;
        const v4 k0 = v4_load(kd), k1 = v4_load(kd + 4), k2 = v4_load(kd + 8),
                 k3 = v4_load(kd + 12);
        for (int r = 0; r < ROWS; r++) {
            const float x = qr[r][d];
            acc[r][0] = fma_scalar(acc[r][0], k0, x);
            acc[r][1] = fma_scalar(acc[r][1], k1, x);
            acc[r][2] = fma_scalar(acc[r][2], k2, x);
            acc[r][3] = fma_scalar(acc[r][3], k3, x);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < QK_NV; c++)
            v4_store(s + r * lds + 4 * c, acc[r][c]);
}
#    undef QK_STEP

/* Whole 16-key blocks up to round_up(nk, 16): the packed K^T is zero there (pack_kt), and the
 * contract of qk lets S be written up to that lane. */
MHA_INLINE void qk_body(const float *const *q,
                        int rows,
                        const float *kt,
                        int ldk,
                        int nk,
                        int64_t D,
                        float *s,
                        int lds) {
    const int nkp = (nk + 15) / 16 * 16;
    for (int r0 = 0; r0 < rows; r0 += QK_MR) {
        const int rr = rows - r0 < QK_MR ? rows - r0 : QK_MR;
        const float *const *qp = q + r0;
        for (int j0 = 0; j0 < nkp; j0 += 16) {
            const float *k = kt + j0;
            float *sp = s + r0 * lds + j0;
            switch (rr) {
            case 5:
                qk_micro(qp, k, ldk, D, sp, lds, 5);
                break;
            case 4:
                qk_micro(qp, k, ldk, D, sp, lds, 4);
                break;
            case 3:
                qk_micro(qp, k, ldk, D, sp, lds, 3);
                break;
            case 2:
                qk_micro(qp, k, ldk, D, sp, lds, 2);
                break;
            default:
                qk_micro(qp, k, ldk, D, sp, lds, 1);
                break;
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* O = alpha O + P V                                                                              */
/* ---------------------------------------------------------------------------------------------- */

/* One key of the micro-tile: the V vectors of row j + L times lane L of each row's P vector. */
#    define PV_STEP(L)                                                                             \
        do {                                                                                       \
            const float *vj = v + (j + (L)) * vs;                                                  \
            v4 vv[PV_NV];                                                                          \
            for (int c = 0; c < NV - 1; c++)                                                       \
                vv[c] = v4_loadu(vj + 4 * c);                                                      \
            vv[NV - 1] =                                                                           \
                LAST == 4 ? v4_loadu(vj + 4 * (NV - 1)) : v4_loadu_first(vj + 4 * (NV - 1), LAST); \
            for (int r = 0; r < ROWS; r++)                                                         \
                for (int c = 0; c < NV; c++)                                                       \
                    acc[r][c] = v4_fma_lane(vv[c], pv4[r], L, acc[r][c]);                          \
            SCHED_BARRIER();                                                                       \
        } while (0)

/* O[ROWS][4 NV] = alpha O + P[ROWS][:nk] V[:nk][4 NV]; one FMA chain per element in increasing j
 * after the alpha product. Each row's P vector serves 4 keys (lanes 0..3); the key tail (nk % 4)
 * takes the element itself. The last of the NV column vectors holds LAST (1..4) columns of V and
 * reads nothing past them (O is read and written whole: its rows are ldo >= round_up(dv, 16)
 * floats long). */
MHA_INLINE void pv_micro(const float *pm,
                         int lds,
                         int nk,
                         const float *v,
                         int64_t vs,
                         const float *alpha,
                         float *o,
                         int ldo,
                         const int ROWS,
                         const int NV,
                         const int LAST) {
    v4 acc[PV_MR][PV_NV];
    const float *pr[PV_MR];
    for (int r = 0; r < ROWS; r++) {
        const float a = alpha[r];
        pr[r] = pm + r * lds;
        for (int c = 0; c < NV; c++)
            acc[r][c] = vmulq_n_f32(v4_load(o + r * ldo + 4 * c), a);
    }
    int j = 0;
    for (; j + 4 <= nk; j += 4) {
        v4 pv4[PV_MR];
        for (int r = 0; r < ROWS; r++)
            pv4[r] = v4_loadu(pr[r] + j);
        PV_STEP(0);
        PV_STEP(1);
        PV_STEP(2);
        PV_STEP(3);
    }
    for (; j < nk; j++) {
        const float *vj = v + j * vs;
        v4 vv[PV_NV];
        for (int c = 0; c < NV - 1; c++)
            vv[c] = v4_loadu(vj + 4 * c);
        vv[NV - 1] =
            LAST == 4 ? v4_loadu(vj + 4 * (NV - 1)) : v4_loadu_first(vj + 4 * (NV - 1), LAST);
        for (int r = 0; r < ROWS; r++) {
            const float x = pr[r][j];
            for (int c = 0; c < NV; c++)
                acc[r][c] = fma_scalar(acc[r][c], vv[c], x);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NV; c++)
            v4_store(o + r * ldo + 4 * c, acc[r][c]);
}
#    undef PV_STEP

/* All rows of one column block of NV vectors, the last with LAST columns. */
MHA_INLINE void pv_rows(const float *pm,
                        int lds,
                        int rows,
                        int nk,
                        const float *v,
                        int64_t vs,
                        const float *alpha,
                        float *o,
                        int ldo,
                        const int NV,
                        const int LAST) {
    for (int r0 = 0; r0 < rows; r0 += PV_MR) {
        const int rr = rows - r0 < PV_MR ? rows - r0 : PV_MR;
        const float *pr = pm + r0 * lds;
        float *orow = o + r0 * ldo;
        const float *al = alpha + r0;
        switch (rr) {
        case 5:
            pv_micro(pr, lds, nk, v, vs, al, orow, ldo, 5, NV, LAST);
            break;
        case 4:
            pv_micro(pr, lds, nk, v, vs, al, orow, ldo, 4, NV, LAST);
            break;
        case 3:
            pv_micro(pr, lds, nk, v, vs, al, orow, ldo, 3, NV, LAST);
            break;
        case 2:
            pv_micro(pr, lds, nk, v, vs, al, orow, ldo, 2, NV, LAST);
            break;
        default:
            pv_micro(pr, lds, nk, v, vs, al, orow, ldo, 1, NV, LAST);
            break;
        }
    }
}

/* The last cols = dv % 16 columns (run-time head sizes only): their whole vectors, then one
 * partial vector. */
__attribute__((noinline)) static void pv_part(const float *pm,
                                              int lds,
                                              int rows,
                                              int nk,
                                              const float *v,
                                              int64_t vs,
                                              int cols,
                                              const float *alpha,
                                              float *o,
                                              int ldo) {
    const int nw = cols / 4, rem = cols % 4;
    switch (nw) {
    case 3:
        pv_rows(pm, lds, rows, nk, v, vs, alpha, o, ldo, 3, 4);
        break;
    case 2:
        pv_rows(pm, lds, rows, nk, v, vs, alpha, o, ldo, 2, 4);
        break;
    case 1:
        pv_rows(pm, lds, rows, nk, v, vs, alpha, o, ldo, 1, 4);
        break;
    default:
        break;
    }
    v += 4 * nw;
    o += 4 * nw;
    switch (rem) {
    case 3:
        pv_rows(pm, lds, rows, nk, v, vs, alpha, o, ldo, 1, 3);
        break;
    case 2:
        pv_rows(pm, lds, rows, nk, v, vs, alpha, o, ldo, 1, 2);
        break;
    case 1:
        pv_rows(pm, lds, rows, nk, v, vs, alpha, o, ldo, 1, 1);
        break;
    default:
        break;
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
    int64_t col = 0;
    for (; col + 16 <= DV; col += 16)
        pv_rows(pm, lds, rows, nk, v + col, vs, alpha, o + col, ldo, PV_NV, 4);
    if (col < DV)
        pv_part(pm, lds, rows, nk, v + col, vs, (int)(DV - col), alpha, o + col, ldo);
}

/* ---------------------------------------------------------------------------------------------- */
/* D specialisation                                                                               */
/* ---------------------------------------------------------------------------------------------- */

#    include "kernels/flash_fwd_specialise.h" /* qk() and pv() per head size */

/* ---------------------------------------------------------------------------------------------- */
/* Softmax steps                                                                                  */
/* ---------------------------------------------------------------------------------------------- */

/* All-ones lanes where the bit of `bits` (4 bits) is set. */
MHA_INLINE v4m mask_from_bits(unsigned bits) {
    const uint32x4_t sel = {1, 2, 4, 8};
    return vtstq_u32(vdupq_n_u32(bits), sel);
}

/* Visible lanes of vector c (keys 4c .. 4c+3) of row r: the tile's first nk keys, & the row's
 * visibility bits. */
MHA_INLINE unsigned lane_bits(const mha__flash_softmax *a, int r, int c) {
    const int n = a->nk - 4 * c;
    unsigned k = n >= 4 ? 0xFu : ((1u << n) - 1u);
    if (a->vis)
        k &= (unsigned)(a->vis[r * MHA_FLASH_WORDS + c / 16] >> (4 * (c % 16))) & 0xFu;
    return k;
}

/* x = transformed score vector c of row r (see mha__flash_softmax), -inf where invisible. The
 * bias row is read whole (its buffer holds Bk floats per row; lanes past nk are discarded). */
MHA_INLINE v4 score(const mha__flash_softmax *a, const float *s, int r, int c, unsigned bits) {
    v4 x = v4_mul(v4_set1(a->scale), v4_load(s + 4 * c));
    if (a->softcap > 0.0f) {
        const v4 cap = v4_set1(a->softcap);
        x = v4_mul(cap, v4_tanh(vdivq_f32(x, cap)));
    }
    if (a->bias)
        x = v4_add(x, v4_loadu(a->bias + r * a->ldb + 4 * c));
    return v4_select(mask_from_bits(bits), x, v4_set1(-INFINITY));
}

/* Row maxima of 4 rows as one vector (lane q = max of m[q]); FMAXNMP ignores NaN like the
 * per-row accumulators. */
MHA_INLINE v4 hmax4(v4 m0, v4 m1, v4 m2, v4 m3) {
    return vpmaxnmq_f32(vpmaxnmq_f32(m0, m1), vpmaxnmq_f32(m2, m3));
}
/* Row sums of 4 rows as one vector, each (x0 + x1) + (x2 + x3) as v4_hsum. */
MHA_INLINE v4 hsum4(v4 s0, v4 s1, v4 s2, v4 s3) {
    return vpaddq_f32(vpaddq_f32(s0, s1), vpaddq_f32(s2, s3));
}

/* Four rows at a time, so that no step waits on a scalar: (A) transformed scores and the row
 * maxima (one joint pairwise reduction), m, mu and alpha = exp(m - mu) for the 4 rows in one
 * vector; (C) P = exp(x - mu) and the row sums (one joint reduction), l = alpha l + sum.
 * Two accumulators per row (even and odd vectors) halve the max/add dependency chains. */
static void softmax_online(const mha__flash_softmax *args) {
    /* A local copy: stores through a->s cannot alias it, so the loop-invariant fields stay in
     * registers. */
    const mha__flash_softmax local = *args, *a = &local;
    const int nv = (a->nk + 3) / 4, rows = a->rows;
    /* Full tile, no mask, bias or softcap: the transform is one multiply. */
    const int plain = !a->vis && !a->bias && !(a->softcap > 0.0f) && a->nk % 4 == 0;
    const v4 scale = v4_set1(a->scale), ninf = v4_set1(-INFINITY);
    for (int r0 = 0; r0 < rows; r0 += 4) {
        const int rr = rows - r0 < 4 ? rows - r0 : 4;
        /* (A) */
        v4 vm[4] = {ninf, ninf, ninf, ninf};
        for (int q = 0; q < rr; q++) {
            float *s = a->s + (r0 + q) * a->lds;
            v4 mx0 = ninf, mx1 = ninf;
            int c = 0;
            if (plain) {
                for (; c + 2 <= nv; c += 2) {
                    const v4 x0 = v4_mul(scale, v4_load(s + 4 * c));
                    const v4 x1 = v4_mul(scale, v4_load(s + 4 * c + 4));
                    v4_store(s + 4 * c, x0);
                    v4_store(s + 4 * c + 4, x1);
                    mx0 = v4_max_nan_ignoring(x0, mx0);
                    mx1 = v4_max_nan_ignoring(x1, mx1);
                }
                if (c < nv) {
                    const v4 x = v4_mul(scale, v4_load(s + 4 * c));
                    v4_store(s + 4 * c, x);
                    mx0 = v4_max_nan_ignoring(x, mx0);
                }
            } else {
                for (; c + 2 <= nv; c += 2) {
                    const v4 x0 = score(a, s, r0 + q, c, lane_bits(a, r0 + q, c));
                    const v4 x1 = score(a, s, r0 + q, c + 1, lane_bits(a, r0 + q, c + 1));
                    v4_store(s + 4 * c, x0);
                    v4_store(s + 4 * c + 4, x1);
                    mx0 = v4_max_nan_ignoring(x0, mx0);
                    mx1 = v4_max_nan_ignoring(x1, mx1);
                }
                if (c < nv) {
                    const v4 x = score(a, s, r0 + q, c, lane_bits(a, r0 + q, c));
                    v4_store(s + 4 * c, x);
                    mx0 = v4_max_nan_ignoring(x, mx0);
                }
            }
            vm[q] = v4_max_nan_ignoring(mx1, mx0);
        }
        /* m_new = max(m, tile max) (m is never NaN: NaN scores do not move the max);
         * mu = m_new, or 0 when -inf; alpha = exp(m - mu). */
        const v4 m_old = v4_loadu_first(a->m + r0, rr);
        const v4 m_new = v4_max(hmax4(vm[0], vm[1], vm[2], vm[3]), m_old);
        const v4 mu = v4_select(vceqq_f32(m_new, ninf), v4_zero(), m_new);
        const v4 alpha = v4_exp(v4_sub(m_old, mu));
        v4_storeu_first(a->alpha + r0, rr, alpha);
        v4_storeu_first(a->m + r0, rr, m_new);
        v4_storeu_first(a->mu + r0, rr, mu);
        /* (C) */
        float mus[4];
        v4_store(mus, mu);
        v4 sum[4] = {v4_zero(), v4_zero(), v4_zero(), v4_zero()};
        for (int q = 0; q < rr; q++) {
            const int r = r0 + q;
            float *s = a->s + r * a->lds;
            const v4 vmu = v4_set1(mus[q]);
            v4 acc0 = v4_zero(), acc1 = v4_zero();
            if (!a->keep) {
                int c = 0;
                for (; c + 2 <= nv; c += 2) {
                    const v4 p0 = v4_exp_nonpos(v4_sub(v4_load(s + 4 * c), vmu));
                    const v4 p1 = v4_exp_nonpos(v4_sub(v4_load(s + 4 * c + 4), vmu));
                    acc0 = v4_add(acc0, p0);
                    acc1 = v4_add(acc1, p1);
                    v4_store(s + 4 * c, p0);
                    v4_store(s + 4 * c + 4, p1);
                }
                if (c < nv) {
                    const v4 p = v4_exp_nonpos(v4_sub(v4_load(s + 4 * c), vmu));
                    acc0 = v4_add(acc0, p);
                    v4_store(s + 4 * c, p);
                }
            } else {
                const v4 ks = v4_set1(a->keep_scale);
                const uint64_t *kw = a->keep + r * MHA_FLASH_WORDS;
                for (int c = 0; c < nv; c++) {
                    const v4 p = v4_exp_nonpos(v4_sub(v4_load(s + 4 * c), vmu));
                    if (c & 1)
                        acc1 = v4_add(acc1, p);
                    else
                        acc0 = v4_add(acc0, p);
                    const unsigned kb = (unsigned)(kw[c / 16] >> (4 * (c % 16))) & 0xFu;
                    v4_store(s + 4 * c, v4_select(mask_from_bits(kb), v4_mul(p, ks), v4_zero()));
                }
            }
            sum[q] = v4_add(acc0, acc1);
        }
        /* l = l alpha + sum */
        const v4 l_old = v4_loadu_first(a->l + r0, rr);
        v4_storeu_first(a->l + r0, rr,
                        v4_add(v4_mul(l_old, alpha), hsum4(sum[0], sum[1], sum[2], sum[3])));
    }
}

static void softmax_final(const mha__flash_softmax *args) {
    /* A local copy: stores through a->s cannot alias it, so the loop-invariant fields stay in
     * registers. */
    const mha__flash_softmax local = *args, *a = &local;
    const int nv = (a->nk + 3) / 4;
    for (int r = 0; r < a->rows; r++) {
        float *s = a->s + r * a->lds;
        const v4 vmu = v4_set1(a->mu[r]), inv = v4_set1(a->inv_l[r]);
        for (int c = 0; c < nv; c++) {
            const v4 x = score(a, s, r, c, lane_bits(a, r, c));
            v4_store(s + 4 * c, v4_mul(v4_exp(v4_sub(x, vmu)), inv));
        }
    }
}

/* Inf and NaN are the floats whose exponent bits are all ones: the largest masked exponent field
 * over the tile equals the mask exactly when one is present. */
static int all_finite(const float *v, int64_t vs, int nk, int64_t dv) {
    const uint32x4_t expo = vdupq_n_u32(0x7f800000u);
    uint32x4_t acc0 = vdupq_n_u32(0), acc1 = vdupq_n_u32(0);
    for (int j = 0; j < nk; j++) {
        const float *vj = v + j * vs;
        int64_t d = 0;
        for (; d + 8 <= dv; d += 8) {
            acc0 = vmaxq_u32(acc0, vandq_u32(vreinterpretq_u32_f32(v4_loadu(vj + d)), expo));
            acc1 = vmaxq_u32(acc1, vandq_u32(vreinterpretq_u32_f32(v4_loadu(vj + d + 4)), expo));
        }
        for (; d < dv; d += 4) {
            const int n = dv - d < 4 ? (int)(dv - d) : 4;
            acc0 =
                vmaxq_u32(acc0, vandq_u32(vreinterpretq_u32_f32(v4_loadu_first(vj + d, n)), expo));
        }
    }
    return vmaxvq_u32(vmaxq_u32(acc0, acc1)) != 0x7f800000u;
}

/* 8 keys per step, as two independent 4-lane Philox streams (10 dependent rounds each: two
 * chains let the multiplies of one overlap the other's); counter (j, i, h, b), key (seed lo,
 * seed hi) as in philox.c; keep <=> word 0 >= the integer threshold (mha__dropout_threshold). */
static void dropout_bits(
    uint64_t seed, float p, int64_t b, int64_t h, int64_t i, int64_t j0, int nk, uint64_t *words) {
    const uint32x4_t thr = vdupq_n_u32(mha__dropout_threshold(p));
    const uint32x4_t lane = {0, 1, 2, 3}, four = vdupq_n_u32(4), sel = {1, 2, 4, 8};
    const uint32x4_t ci = vdupq_n_u32((uint32_t)i), ch = vdupq_n_u32((uint32_t)h);
    const uint32x4_t cb = vdupq_n_u32((uint32_t)b);
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int k = 0; k < MHA_FLASH_WORDS; k++)
        words[k] = 0;
    for (int c = 0; 8 * c < nk; c++) {
        const uint32x4_t cj0 = vaddq_u32(vdupq_n_u32((uint32_t)(j0 + 8 * c)), lane);
        const uint32x4_t cj1 = vaddq_u32(cj0, four);
        const uint32x4_t w0 = v4i_philox_word0(cj0, ci, ch, cb, k0, k1);
        const uint32x4_t w1 = v4i_philox_word0(cj1, ci, ch, cb, k0, k1);
        unsigned keep = vaddvq_u32(vandq_u32(vcgeq_u32(w0, thr), sel)) |
                        vaddvq_u32(vandq_u32(vcgeq_u32(w1, thr), sel)) << 4;
        const int left = nk - 8 * c;
        if (left < 8)
            keep &= (1u << left) - 1u;
        words[c / 8] |= (uint64_t)keep << (8 * (c % 8));
    }
}

MHA_FLASH_F32_TILE_OPS(neon_tile_ops)
static const mha__flash_softmax_ops neon_softmax_ops = {softmax_online, softmax_final,
                                                        dropout_bits};

/* Bq and Bk come from this kernel's registry line (kernels/registry.def). */
void mha_fwd_f32_flash_q64k64__neon(const mha__kernel_info *k,
                                    const mha__problem *p,
                                    const mha__fwd_unit *u,
                                    void *scratch) {
    mha__flash_fwd(&neon_softmax_ops, &neon_tile_ops, k->bq, k->bk, p, u, scratch);
}

void mha__dropout_bits_neon(
    uint64_t seed, float p, int64_t b, int64_t h, int64_t i, int64_t j0, int nk, uint64_t *words) {
    dropout_bits(seed, p, b, h, i, j0, nk, words);
}

void mha__vexp_neon(const float *x, float *y, int64_t count) {
    for (int64_t i = 0; i < count; i += 4) {
        const int n = count - i < 4 ? (int)(count - i) : 4;
        v4_storeu_first(y + i, n, v4_exp(v4_loadu_first(x + i, n)));
    }
}

void mha__vtanh_neon(const float *x, float *y, int64_t count) {
    for (int64_t i = 0; i < count; i += 4) {
        const int n = count - i < 4 ? (int)(count - i) : 4;
        v4_storeu_first(y + i, n, v4_tanh(v4_loadu_first(x + i, n)));
    }
}

#endif /* aarch64 */
