/* SPDX-License-Identifier: MIT */
/* attn_fwd_flash_generic.c: FlashAttention-2 forward tile operations in plain C, for every CPU.
 * Same structure as the SIMD kernels (packed K^T tile, register-blocked S = Q K^T and
 * O = alpha O + P V micro-tiles, online softmax) with scalar arithmetic the compiler may
 * auto-vectorise; exp and tanh are the C library's expf/tanhf, as in the reference.
 *
 * With -ffp-contract=off (CMakeLists.txt) each score is the same sequence of roundings as the
 * reference's dot product (sum over d in order, no FMA), so this layer differs from the
 * reference only by the online softmax: the rescaling and the summation order of P V.
 */
#include "kernels/flash_fwd.h"

#include <string.h>

#define MR 4 /* rows per micro-tile */

static void pack_kt(const float *k, int64_t ks, int nk, int64_t dk, float *kt, int ldk) {
    const int nkp = (nk + 15) / 16 * 16;
    for (int64_t d = 0; d < dk; d++) {
        float *row = kt + d * ldk;
        for (int j = 0; j < nk; j++)
            row[j] = k[j * ks + d];
        for (int j = nk; j < nkp; j++)
            row[j] = 0.0f;
    }
}

static void qk(const float *const *q,
               int rows,
               const float *kt,
               int ldk,
               int nk,
               int64_t dk,
               float *s,
               int lds) {
    float acc[MR][MHA_FLASH_MAX_BK];
    for (int r0 = 0; r0 < rows; r0 += MR) {
        const int rr = rows - r0 < MR ? rows - r0 : MR;
        for (int r = 0; r < rr; r++)
            for (int j = 0; j < nk; j++)
                acc[r][j] = 0.0f;
        for (int64_t d = 0; d < dk; d++) {
            const float *kr = kt + d * ldk;
            for (int r = 0; r < rr; r++) {
                const float qd = q[r0 + r][d];
                for (int j = 0; j < nk; j++)
                    acc[r][j] += qd * kr[j];
            }
        }
        for (int r = 0; r < rr; r++)
            memcpy(s + (r0 + r) * lds, acc[r], sizeof(float) * (size_t)nk);
    }
}

static int visible(const mha__flash_softmax *a, int r, int j) {
    return !a->vis || ((a->vis[r * MHA_FLASH_WORDS + (j >> 6)] >> (j & 63)) & 1);
}

/* The score transform of mha__flash_softmax, in place on row r. */
static void scores(const mha__flash_softmax *a, int r, float *s) {
    for (int j = 0; j < a->nk; j++) {
        float x = a->scale * s[j];
        if (a->softcap > 0.0f)
            x = a->softcap * tanhf(x / a->softcap);
        if (a->bias)
            x += a->bias[r * a->ldb + j];
        s[j] = visible(a, r, j) ? x : -INFINITY;
    }
}

static void softmax_online(const mha__flash_softmax *a) {
    for (int r = 0; r < a->rows; r++) {
        float *s = a->s + r * a->lds;
        scores(a, r, s);
        float tmax = -INFINITY;
        for (int j = 0; j < a->nk; j++)
            if (s[j] > tmax) /* false for NaN: NaN does not move the max */
                tmax = s[j];
        const float m_old = a->m[r];
        const float m_new = tmax > m_old ? tmax : m_old;
        const float mu = m_new == -INFINITY ? 0.0f : m_new;
        const float alpha = expf(m_old - mu);
        float sum = 0.0f;
        for (int j = 0; j < a->nk; j++) {
            float p = expf(s[j] - mu);
            sum += p;
            if (a->keep)
                p = ((a->keep[r * MHA_FLASH_WORDS + (j >> 6)] >> (j & 63)) & 1) ? p * a->keep_scale
                                                                                : 0.0f;
            s[j] = p;
        }
        a->l[r] = a->l[r] * alpha + sum;
        a->m[r] = m_new;
        a->alpha[r] = alpha;
    }
}

static void softmax_final(const mha__flash_softmax *a) {
    for (int r = 0; r < a->rows; r++) {
        float *s = a->s + r * a->lds;
        scores(a, r, s);
        for (int j = 0; j < a->nk; j++)
            s[j] = expf(s[j] - a->mu[r]) * a->inv_l[r];
    }
}

static void pv(const float *pm,
               int lds,
               int rows,
               int nk,
               const float *v,
               int64_t vs,
               int64_t dv,
               const float *alpha,
               float *o,
               int ldo) {
    for (int r0 = 0; r0 < rows; r0 += MR) {
        const int rr = rows - r0 < MR ? rows - r0 : MR;
        for (int r = 0; r < rr; r++) {
            float *orow = o + (r0 + r) * ldo;
            for (int64_t d = 0; d < dv; d++)
                orow[d] *= alpha[r0 + r];
        }
        for (int j = 0; j < nk; j++) {
            const float *vj = v + j * vs;
            for (int r = 0; r < rr; r++) {
                const float pj = pm[(r0 + r) * lds + j];
                float *orow = o + (r0 + r) * ldo;
                for (int64_t d = 0; d < dv; d++)
                    orow[d] += pj * vj[d];
            }
        }
    }
}

static int all_finite(const float *v, int64_t vs, int nk, int64_t dv) {
    /* Inf and NaN are the floats whose exponent bits are all ones. */
    uint32_t bad = 0;
    for (int j = 0; j < nk; j++) {
        const float *vj = v + j * vs;
        for (int64_t d = 0; d < dv; d++) {
            uint32_t bits;
            memcpy(&bits, vj + d, sizeof bits);
            bad |= (~bits & 0x7f800000u) == 0;
        }
    }
    return bad == 0;
}

static void dropout_bits(
    uint64_t seed, float p, int64_t b, int64_t h, int64_t i, int64_t j0, int nk, uint64_t *words) {
    for (int k = 0; k < MHA_FLASH_WORDS; k++)
        words[k] = 0;
    for (int j = 0; j < nk; j++)
        if (mha__dropout_keep(seed, p, b, h, i, j0 + j))
            words[j >> 6] |= (uint64_t)1 << (j & 63);
}

MHA_FLASH_F32_TILE_OPS(generic_tile_ops)
static const mha__flash_softmax_ops generic_softmax_ops = {softmax_online, softmax_final,
                                                           dropout_bits};

/* Bq and Bk come from this kernel's registry line (kernels/registry.def). */
void mha_fwd_f32_flash_q32k32__generic(const mha__kernel_info *k,
                                       const mha__problem *p,
                                       const mha__fwd_unit *u,
                                       void *scratch) {
    mha__flash_fwd(&generic_softmax_ops, &generic_tile_ops, k->bq, k->bk, p, u, scratch);
}
