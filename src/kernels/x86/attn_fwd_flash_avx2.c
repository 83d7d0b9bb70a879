/* SPDX-License-Identifier: MIT */
/* attn_fwd_flash_avx2.c: FlashAttention-2 forward tile operations for AVX2 + FMA (compiled with
 * the AVX2 flags only; dispatch.c calls it only when cpu_features.c (cpuid + XGETBV) reports
 * AVX2, FMA and YMM state). The tiling, masking and bookkeeping are the shared driver's
 * (flash_fwd.c); the structure mirrors attn_fwd_flash_avx512.c with 8-float vectors.
 *
 * Register blocking (16 ymm registers, 2 FMA ports with 4-cycle latency: >= 8 independent
 * accumulators keep both busy):
 *   S = Q K^T: 6 query rows x 16 keys (2 vectors) = 12 accumulators + 2 K^T vectors + 1 broadcast.
 *   O += P V:  6 rows x 2 vectors of V columns = 12 accumulators + 2 V vectors + 1 broadcast.
 * K is packed per key tile into K^T [dk][Bk] with 8x8 in-register transposes; V is read in place.
 * Head sizes 32, 64, 80, 96, 128 and 256 are compiled with a constant D; others use a run-time D.
 */
#include "kernels/flash_fwd.h"

#if defined(__x86_64__) || defined(__i386__)
#    include "kernels/x86/simd_avx2.h"

#    define QK_MR 6
#    define QK_NV 2
#    define PV_MR 6
#    define PV_NV 2

/* ---------------------------------------------------------------------------------------------- */
/* Packing                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

/* In-register transpose of 8 vectors of 8 floats: interleave row pairs, then pairs of pairs
 * (each 128-bit lane then holds a 4x4 block), then swap 128-bit halves. */
MHA_INLINE void transpose8(v8 r[8]) {
    v8 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int q = 0; q < 2; q++) {
        u[4 * q + 0] = _mm256_shuffle_ps(t[4 * q], t[4 * q + 2], 0x44);
        u[4 * q + 1] = _mm256_shuffle_ps(t[4 * q], t[4 * q + 2], 0xEE);
        u[4 * q + 2] = _mm256_shuffle_ps(t[4 * q + 1], t[4 * q + 3], 0x44);
        u[4 * q + 3] = _mm256_shuffle_ps(t[4 * q + 1], t[4 * q + 3], 0xEE);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
        r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
    }
}

static void pack_kt(const float *k, int64_t ks, int nk, int64_t dk, float *kt, int ldk) {
    const int nkp = (nk + 15) / 16 * 16;
    for (int j0 = 0; j0 < nkp; j0 += 8) {
        const int rows = nk - j0 < 8 ? (nk - j0 > 0 ? nk - j0 : 0) : 8;
        for (int64_t d0 = 0; d0 < dk; d0 += 8) {
            const int cols = dk - d0 < 8 ? (int)(dk - d0) : 8;
            const __m256i cm = v8_first(cols);
            v8 r[8];
            for (int i = 0; i < 8; i++)
                r[i] = i < rows ? v8_loadu_mask(cm, k + (j0 + i) * ks + d0) : v8_zero();
            transpose8(r);
            for (int c = 0; c < cols; c++)
                v8_store(kt + (d0 + c) * ldk + j0, r[c]);
        }
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* S = Q K^T                                                                                      */
/* ---------------------------------------------------------------------------------------------- */

MHA_INLINE void qk_micro(const float *const *q,
                         const float *kt,
                         int ldk,
                         int64_t D,
                         float *s,
                         int lds,
                         const int ROWS,
                         const int NV) {
    v8 acc[QK_MR][QK_NV];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NV; c++)
            acc[r][c] = v8_zero();
    for (int64_t d = 0; d < D; d++) {
        v8 kv[QK_NV];
        for (int c = 0; c < NV; c++)
            kv[c] = v8_load(kt + d * ldk + 8 * c);
        for (int r = 0; r < ROWS; r++) {
            const v8 qb = v8_set1(q[r][d]);
            for (int c = 0; c < NV; c++)
                acc[r][c] = v8_fma(qb, kv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NV; c++)
            v8_store(s + r * lds + 8 * c, acc[r][c]);
}

MHA_INLINE void qk_body(const float *const *q,
                        int rows,
                        const float *kt,
                        int ldk,
                        int nk,
                        int64_t D,
                        float *s,
                        int lds) {
    const int nv = (nk + 7) / 8;
    for (int r0 = 0; r0 < rows; r0 += QK_MR) {
        const int rr = rows - r0 < QK_MR ? rows - r0 : QK_MR;
        for (int c0 = 0; c0 < nv; c0 += QK_NV) {
            const int cc = nv - c0 < QK_NV ? nv - c0 : QK_NV;
            const float *const *qp = q + r0;
            const float *k = kt + 8 * c0;
            float *sp = s + r0 * lds + 8 * c0;
#    define QK_CASE(R, C)                                                                          \
    case (R)*8 + (C):                                                                              \
        qk_micro(qp, k, ldk, D, sp, lds, R, C);                                                    \
        break;
            switch (rr * 8 + cc) {
                QK_CASE(6, 2)
                QK_CASE(6, 1)
                QK_CASE(5, 2)
                QK_CASE(5, 1)
                QK_CASE(4, 2)
                QK_CASE(4, 1)
                QK_CASE(3, 2)
                QK_CASE(3, 1)
                QK_CASE(2, 2)
                QK_CASE(2, 1)
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

MHA_INLINE void pv_micro(const float *pm,
                         int lds,
                         int nk,
                         const float *v,
                         int64_t vs,
                         const float *alpha,
                         float *o,
                         int ldo,
                         __m256i last,
                         const int ROWS,
                         const int NV,
                         const int WHOLE) {
    v8 acc[PV_MR][PV_NV];
    for (int r = 0; r < ROWS; r++) {
        const v8 a = v8_set1(alpha[r]);
        for (int c = 0; c < NV; c++)
            acc[r][c] = v8_mul(v8_load(o + r * ldo + 8 * c), a);
    }
    for (int j = 0; j < nk; j++) {
        const float *vj = v + j * vs;
        v8 vv[PV_NV];
        for (int c = 0; c < NV - 1; c++)
            vv[c] = v8_loadu(vj + 8 * c);
        /* The last vector of the block: plain when whole (a VMASKMOVPS per key costs on Zen). */
        vv[NV - 1] = WHOLE ? v8_loadu(vj + 8 * (NV - 1)) : v8_loadu_mask(last, vj + 8 * (NV - 1));
        for (int r = 0; r < ROWS; r++) {
            const v8 pb = v8_set1(pm[r * lds + j]);
            for (int c = 0; c < NV; c++)
                acc[r][c] = v8_fma(pb, vv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < NV; c++)
            v8_store(o + r * ldo + 8 * c, acc[r][c]);
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
    for (int64_t col = 0; col < DV; col += 8 * PV_NV) {
        const int64_t cols = DV - col < 8 * PV_NV ? DV - col : 8 * PV_NV;
        const int nv = (int)((cols + 7) / 8);
        const __m256i last = v8_first((int)(cols - 8 * (nv - 1)));
        for (int r0 = 0; r0 < rows; r0 += PV_MR) {
            const int rr = rows - r0 < PV_MR ? rows - r0 : PV_MR;
            const float *pr = pm + r0 * lds;
            const float *vc = v + col;
            float *orow = o + r0 * ldo + col;
            const float *al = alpha + r0;
#    define PV_CASE(R, C, W)                                                                       \
    case (R)*8 + (C):                                                                              \
        pv_micro(pr, lds, nk, vc, vs, al, orow, ldo, last, R, C, W);                               \
        break;
#    define PV_CASES(W)                                                                            \
        PV_CASE(6, 2, W)                                                                           \
        PV_CASE(6, 1, W)                                                                           \
        PV_CASE(5, 2, W)                                                                           \
        PV_CASE(5, 1, W)                                                                           \
        PV_CASE(4, 2, W)                                                                           \
        PV_CASE(4, 1, W)                                                                           \
        PV_CASE(3, 2, W)                                                                           \
        PV_CASE(3, 1, W)                                                                           \
        PV_CASE(2, 2, W)                                                                           \
        PV_CASE(2, 1, W)                                                                           \
        PV_CASE(1, 2, W)                                                                           \
        PV_CASE(1, 1, W)                                                                           \
    default:                                                                                       \
        MHA_ASSERT(0);
            if (cols % 8 == 0) {
                switch (rr * 8 + nv) { PV_CASES(1) }
            } else {
                switch (rr * 8 + nv) { PV_CASES(0) }
            }
#    undef PV_CASES
#    undef PV_CASE
        }
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* D specialisation                                                                               */
/* ---------------------------------------------------------------------------------------------- */

#    include "kernels/flash_fwd_specialise.h" /* qk() and pv() per head size */

/* ---------------------------------------------------------------------------------------------- */
/* Softmax steps                                                                                  */
/* ---------------------------------------------------------------------------------------------- */

MHA_INLINE unsigned lane_bits(const mha__flash_softmax *a, int r, int c) {
    const int n = a->nk - 8 * c;
    unsigned k = n >= 8 ? 0xFFu : ((1u << n) - 1u);
    if (a->vis)
        k &= (unsigned)(a->vis[r * MHA_FLASH_WORDS + c / 8] >> (8 * (c % 8))) & 0xFFu;
    return k;
}

MHA_INLINE v8 score(const mha__flash_softmax *a, const float *s, int r, int c, unsigned bits) {
    const __m256i k = v8_mask_from_bits(bits);
    v8 x = v8_mul(v8_set1(a->scale), v8_load(s + 8 * c));
    if (a->softcap > 0.0f) {
        const v8 cap = v8_set1(a->softcap);
        x = v8_mul(cap, v8_tanh(_mm256_div_ps(x, cap)));
    }
    if (a->bias)
        x = v8_add(x, v8_loadu_mask(k, a->bias + r * a->ldb + 8 * c));
    return v8_select(k, x, v8_set1(-INFINITY));
}

/* Three phases as in the AVX-512 kernel: (A) scores and row max, (B) m, mu and alpha for 8 rows
 * per vector, (C) P = exp(x - mu) and row sums. */
static void softmax_online(const mha__flash_softmax *args) {
    /* A local copy: stores through a->s cannot alias it, so the loop-invariant fields stay in
     * registers. */
    const mha__flash_softmax local = *args, *a = &local;
    const int nv = (a->nk + 7) / 8, rows = a->rows;
    /* Whole vectors of a tile with no visibility bits, bias or softcap: score() would select
     * every lane of x = scale S, so they skip the mask (the same values). */
    const int plain_nv = !a->vis && !a->bias && a->softcap <= 0.0f ? a->nk / 8 : 0;
    const v8 scale = v8_set1(a->scale);
    /* (A) The new max goes to a->mu for now. */
    for (int r = 0; r < rows; r++) {
        float *s = a->s + r * a->lds;
        v8 vmax = v8_set1(-INFINITY);
        int c = 0;
        for (; c < plain_nv; c++) {
            const v8 x = v8_mul(scale, v8_load(s + 8 * c));
            v8_store(s + 8 * c, x);
            vmax = v8_max_nan_ignoring(x, vmax);
        }
        for (; c < nv; c++) {
            const v8 x = score(a, s, r, c, lane_bits(a, r, c));
            v8_store(s + 8 * c, x);
            vmax = v8_max_nan_ignoring(x, vmax);
        }
        const float tmax = v8_hmax(vmax), m_old = a->m[r];
        a->mu[r] = tmax > m_old ? tmax : m_old;
    }
    /* (B) */
    for (int r0 = 0; r0 < rows; r0 += 8) {
        const __m256i k = v8_first(rows - r0 < 8 ? rows - r0 : 8);
        const v8 m_old = v8_loadu_mask(k, a->m + r0), m_new = v8_loadu_mask(k, a->mu + r0);
        const v8 inf = _mm256_cmp_ps(m_new, v8_set1(-INFINITY), _CMP_EQ_OQ);
        const v8 mu = _mm256_andnot_ps(inf, m_new);
        v8_storeu_mask(a->alpha + r0, k, v8_exp(v8_sub(m_old, mu)));
        v8_storeu_mask(a->m + r0, k, m_new);
        v8_storeu_mask(a->mu + r0, k, mu);
    }
    /* (C) */
    for (int r = 0; r < rows; r++) {
        float *s = a->s + r * a->lds;
        const v8 vmu = v8_set1(a->mu[r]);
        v8 sum = v8_zero();
        for (int c = 0; c < nv; c++) {
            v8 p = v8_exp_nonpos(v8_sub(v8_load(s + 8 * c), vmu));
            sum = v8_add(sum, p);
            if (a->keep) {
                const unsigned kb =
                    (unsigned)(a->keep[r * MHA_FLASH_WORDS + c / 8] >> (8 * (c % 8))) & 0xFFu;
                p = _mm256_and_ps(v8_mul(p, v8_set1(a->keep_scale)),
                                  _mm256_castsi256_ps(v8_mask_from_bits(kb)));
            }
            v8_store(s + 8 * c, p);
        }
        a->l[r] = a->l[r] * a->alpha[r] + v8_hsum(sum);
    }
}

static void softmax_final(const mha__flash_softmax *args) {
    /* A local copy: stores through a->s cannot alias it, so the loop-invariant fields stay in
     * registers. */
    const mha__flash_softmax local = *args, *a = &local;
    const int nv = (a->nk + 7) / 8;
    for (int r = 0; r < a->rows; r++) {
        float *s = a->s + r * a->lds;
        const v8 vmu = v8_set1(a->mu[r]), inv = v8_set1(a->inv_l[r]);
        for (int c = 0; c < nv; c++) {
            const v8 x = score(a, s, r, c, lane_bits(a, r, c));
            v8_store(s + 8 * c, v8_mul(v8_exp(v8_sub(x, vmu)), inv));
        }
    }
}

static int all_finite(const float *v, int64_t vs, int nk, int64_t dv) {
    v8 acc = v8_zero();
    const v8 zero = v8_zero();
    for (int j = 0; j < nk; j++) {
        const float *vj = v + j * vs;
        int64_t d = 0;
        for (; d + 8 <= dv; d += 8)
            acc = v8_fma(v8_loadu(vj + d), zero, acc);
        if (d < dv)
            acc = v8_fma(v8_loadu_mask(v8_first((int)(dv - d)), vj + d), zero, acc);
    }
    return _mm256_movemask_ps(_mm256_cmp_ps(acc, acc, _CMP_UNORD_Q)) == 0;
}

/* 8 keys per Philox vector; counter (j, i, h, b), key (seed lo, seed hi) as in philox.c. */
static void dropout_bits(
    uint64_t seed, float p, int64_t b, int64_t h, int64_t i, int64_t j0, int nk, uint64_t *words) {
    /* Unsigned w >= thr as a signed compare after flipping the sign bits. */
    const __m256i flip = _mm256_set1_epi32((int)0x80000000u);
    const __m256i thr_m1 = _mm256_xor_si256(
        _mm256_set1_epi32((int)(mha__dropout_threshold(p) - 1u)), flip); /* w > thr - 1 */
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int k = 0; k < MHA_FLASH_WORDS; k++)
        words[k] = 0;
    for (int c = 0; 8 * c < nk; c++) {
        const __m256i cj = _mm256_add_epi32(_mm256_set1_epi32((int)(uint32_t)(j0 + 8 * c)), lane);
        const __m256i w0 = v8i_philox_word0(
            cj, _mm256_set1_epi32((int)(uint32_t)i), _mm256_set1_epi32((int)(uint32_t)h),
            _mm256_set1_epi32((int)(uint32_t)b), (uint32_t)seed, (uint32_t)(seed >> 32));
        const __m256i gt = _mm256_cmpgt_epi32(_mm256_xor_si256(w0, flip), thr_m1);
        unsigned keep = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(gt));
        const int left = nk - 8 * c;
        if (left < 8)
            keep &= (1u << left) - 1u;
        words[c / 8] |= (uint64_t)keep << (8 * (c % 8));
    }
}

MHA_FLASH_F32_TILE_OPS(avx2_tile_ops)
static const mha__flash_softmax_ops avx2_softmax_ops = {softmax_online, softmax_final,
                                                        dropout_bits};

/* Bq and Bk come from this kernel's registry line (kernels/registry.def). */
void mha_fwd_f32_flash_q64k64__avx2(const mha__kernel_info *k,
                                    const mha__problem *p,
                                    const mha__fwd_unit *u,
                                    void *scratch) {
    mha__flash_fwd(&avx2_softmax_ops, &avx2_tile_ops, k->bq, k->bk, p, u, scratch);
}

void mha__dropout_bits_avx2(
    uint64_t seed, float p, int64_t b, int64_t h, int64_t i, int64_t j0, int nk, uint64_t *words) {
    dropout_bits(seed, p, b, h, i, j0, nk, words);
}

void mha__vexp_avx2(const float *x, float *y, int64_t count) {
    for (int64_t i = 0; i < count; i += 8) {
        const __m256i k = v8_first(count - i < 8 ? (int)(count - i) : 8);
        v8_storeu_mask(y + i, k, v8_exp(v8_loadu_mask(k, x + i)));
    }
}

void mha__vtanh_avx2(const float *x, float *y, int64_t count) {
    for (int64_t i = 0; i < count; i += 8) {
        const __m256i k = v8_first(count - i < 8 ? (int)(count - i) : 8);
        v8_storeu_mask(y + i, k, v8_tanh(v8_loadu_mask(k, x + i)));
    }
}

#endif /* x86 */
