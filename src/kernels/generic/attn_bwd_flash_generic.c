/* SPDX-License-Identifier: MIT */
/* attn_bwd_flash_generic.c: the driver of the FlashAttention-2 style backward (bwd_flash.h) and
 * its portable arithmetic. Plain C for the baseline ISA; the SIMD files (kernels/x86/
 * attn_bwd_flash_<isa>.c) only replace the two operations of mha__bwd_flash_ops.
 *
 * Tiles: Bq = 32 query rows x Bk = 64 keys (MHA__BWD_BQ / MHA__BWD_BK). Per tile the float
 * scratch is 3 x 32 x 64 (S then P then z P, dP then dS, tanh') + (dk + dv) x 64 x 2 (K^T, V^T and
 * the dK, dV accumulators): ~88 KB at d = 64, L2-resident. Bk = 64 as the forward's (measured
 * there); Bq = 32 keeps the per-tile blocks in L1/L2 and gives 8 row blocks of the 4-row GEMM.
 * Q, dO (all rows of the unit's heads, once) and each K tile are copied to contiguous rows: in
 * the layer's [B, L, heads, d] layout their rows are h*d floats apart (4 KiB at d_model 1024),
 * so a block's rows would share a few L1 sets and evict each other while the GEMMs reread them
 * as the B operand (the forward measured 30% on O += P V for the same reason).
 */
#include "kernels/bwd_flash.h"
#include "kernels/flash_fwd.h"

#include <string.h>

/* ---------------------------------------------------------------------------------------------- */
/* Scratch.                                                                                       */
/* ---------------------------------------------------------------------------------------------- */

typedef struct bwd_layout {
    size_t D, dq, qp, dop, orow, kr, kt, vt, dka, dva, s, dp, tp, total;
} bwd_layout;

static bool carve(size_t *cursor, int64_t count, size_t *off) {
    size_t bytes;
    if (count < 0 || !mha__bytes(count, sizeof(float), &bytes) || bytes > SIZE_MAX - 64 - *cursor)
        return false;
    *off = *cursor;
    *cursor += (bytes + 63) & ~(size_t)63;
    return true;
}

static bool layout_for(const mha__problem *p, bwd_layout *L) {
    const int64_t BQ = MHA__BWD_BQ, BK = MHA__BWD_BK;
    int64_t rows, dqn, don;
    if (!mha__mul_i64(p->group, p->n, &rows) || !mha__mul_i64(rows, p->dk, &dqn) ||
        !mha__mul_i64(rows, p->dv, &don) || p->dk > MHA_MAX_DIM || p->dv > MHA_MAX_DIM)
        return false;
    size_t c = 0;
    return carve(&c, rows, &L->D) && carve(&c, dqn, &L->dq) && carve(&c, dqn, &L->qp) &&
           carve(&c, don, &L->dop) && carve(&c, p->dv, &L->orow) && carve(&c, BK * p->dk, &L->kr) &&
           carve(&c, p->dk * BK, &L->kt) && carve(&c, p->dv * BK, &L->vt) &&
           carve(&c, BK * p->dk, &L->dka) && carve(&c, BK * p->dv, &L->dva) &&
           carve(&c, BQ * BK, &L->s) && carve(&c, BQ * BK, &L->dp) && carve(&c, BQ * BK, &L->tp) &&
           ((L->total = c), true);
}

bool mha__bwd_flash_scratch(const mha__problem *p, size_t *bytes) {
    bwd_layout L;
    if (!layout_for(p, &L))
        return false;
    *bytes = L.total;
    return true;
}

/* ---------------------------------------------------------------------------------------------- */
/* The driver.                                                                                    */
/* ---------------------------------------------------------------------------------------------- */

/* dst[d] (dtype dt, element offset at) = acc[d], or + acc[d]: the sum in float32, rounded once. */
static void
store(mha_dtype dt, void *base, int64_t at, const float *acc, int64_t len, int accumulate) {
    if (dt == MHA_DTYPE_F32) {
        float *dst = (float *)base + at;
        for (int64_t d = 0; d < len; d++)
            dst[d] = accumulate ? dst[d] + acc[d] : acc[d];
        return;
    }
    if (!accumulate) {
        mha__narrow_rows(dt, acc, mha__elem_mut(dt, base, at), len);
        return;
    }
    for (int64_t d = 0; d < len; d++)
        mha__store(dt, base, at + d, mha__load(dt, base, at + d) + acc[d]);
}

/* One unit's state: the problem, its (b, g), the scratch's buffers (bwd_layout) and what every
 * block asks of the problem. */
typedef struct bwd_unit {
    const mha__bwd_flash_ops *ops;
    const mha__bwd_problem *bp;
    const mha__problem *p;
    int64_t b, g;
    float *Drow, *dQ, *Qp, *dOp, *Orow, *Kr, *Kt, *Vt, *dKa, *dVa, *S, *dP, *T;
    const float *lse_b; /* [H, n] of batch b */
    int has_bias;
    float keep_scale;
} bwd_unit;

/* Pass 1: D_i = dO_i . O_i - dlse_i per row of the group's heads, Q and dO packed (widened exactly
 * when half precision), dQ = 0. */
static void unit_rows(const bwd_unit *u) {
    const mha__problem *p = u->p;
    const mha__bwd_problem *bp = u->bp;
    const int64_t n = p->n, dk = p->dk, dv = p->dv, group = p->group, b = u->b;
    for (int64_t hh = 0; hh < group; hh++) {
        const int64_t h = u->g * group + hh;
        for (int64_t i = 0; i < n; i++) {
            const int64_t o0 = b * p->os[0] + h * p->os[1] + i * p->os[2];
            float *dO = u->dOp + (hh * n + i) * dv;
            mha__widen_rows(
                bp->do_dt,
                mha__elem(bp->do_dt, bp->dout, b * bp->dos[0] + h * bp->dos[1] + i * bp->dos[2]),
                dO, dv);
            const float lse = u->lse_b[h * n + i];
            float D = 0.0f;
            if (lse != -INFINITY) {
                const float *o = u->Orow;
                if (p->o_dt == MHA_DTYPE_F32)
                    o = (const float *)p->out + o0;
                else
                    mha__widen_rows(p->o_dt, mha__elem(p->o_dt, p->out, o0), u->Orow, dv);
                for (int64_t d = 0; d < dv; d++)
                    D += dO[d] * o[d];
                if (bp->dlse) /* lse's own gradient shifts D (mha_attention_backward) */
                    D -= bp->dlse[(b * p->H + h) * n + i];
            }
            u->Drow[hh * n + i] = D;
            mha__widen_rows(p->q_dt,
                            mha__elem(p->q_dt, p->q, b * p->qs[0] + h * p->qs[1] + i * p->qs[2]),
                            u->Qp + (hh * n + i) * dk, dk);
        }
    }
    if (bp->dq)
        memset(u->dQ, 0, sizeof(float) * (size_t)(group * n * dk));
}

/* The key tile [j0, j0 + nk): K rows (Kr), K^T and V^T (Kt, Vt, row stride BK), the tile's dK / dV
 * accumulators zeroed. Returns whether every K element is finite. */
static int load_key_tile(const bwd_unit *u, int64_t j0, int64_t nk) {
    const mha__problem *p = u->p;
    const int64_t dk = p->dk, dv = p->dv, BK = MHA__BWD_BK;
    const int64_t k0 = u->b * p->ks[0] + u->g * p->ks[1] + j0 * p->ks[2];
    const int64_t v0 = u->b * p->vs[0] + u->g * p->vs[1] + j0 * p->vs[2];
    int k_finite = 1;
    for (int64_t c = 0; c < nk; c++) {
        const float *kr = u->Kr + c * dk;
        mha__widen_rows(p->k_dt, mha__elem(p->k_dt, p->k, k0 + c * p->ks[2]), u->Kr + c * dk, dk);
        for (int64_t d = 0; d < dk; d++)
            k_finite &= isfinite(kr[d]) != 0;
        for (int64_t d = 0; d < dk; d++)
            u->Kt[d * BK + c] = kr[d];
        const float *vr = (const float *)p->v + v0 + c * p->vs[2];
        if (p->v_dt != MHA_DTYPE_F32) { /* widened into dVa, zeroed below */
            mha__widen_rows(p->v_dt, mha__elem(p->v_dt, p->v, v0 + c * p->vs[2]), u->dVa, dv);
            vr = u->dVa;
        }
        for (int64_t d = 0; d < dv; d++)
            u->Vt[d * BK + c] = vr[d];
    }
    memset(u->dKa, 0, sizeof(float) * (size_t)(BK * dk));
    memset(u->dVa, 0, sizeof(float) * (size_t)(BK * dv));
    return k_finite;
}

/* Rows [i0, i0 + R) of head h (hh in the group) against the tile: S = Q K^T (forward: dot +=
 * q[d] * k[d]), then P = exp(s - lse) with the forward's score pipeline: scale, softcap, bias,
 * -inf where invisible; T = d s / d r (softcap derivative, only with softcap). `whole`: every row
 * sees the whole tile and no per-element rule or modifier applies, so a plain (vectorisable) loop
 * does it. */
static void block_probs(const bwd_unit *u,
                        int64_t hh,
                        int64_t i0,
                        int64_t R,
                        int64_t j0,
                        int64_t nk,
                        int whole,
                        const uint64_t *vis) {
    const mha__problem *p = u->p;
    const int64_t n = p->n, dk = p->dk, BK = MHA__BWD_BK, h = u->g * p->group + hh;
    memset(u->S, 0, sizeof(float) * (size_t)(R * BK));
    u->ops->gemm_acc(R, dk, nk, u->Qp + (hh * n + i0) * dk, dk, 1, u->Kt, BK, u->S, BK);
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = i0 + r;
        const float lse = u->lse_b[h * n + i];
        float *srow = u->S + r * BK, *trow = u->T + r * BK;
        if (lse == -INFINITY) { /* fully masked row: P = 0 */
            for (int64_t c = 0; c < nk; c++)
                srow[c] = 0.0f;
            continue;
        }
        if (!whole) {
            for (int64_t c = 0; c < nk; c++) {
                const int64_t j = j0 + c;
                float x = p->scale * srow[c];
                if (p->softcap > 0.0f) {
                    const float t = tanhf(x / p->softcap);
                    x = p->softcap * t;
                    trow[c] = 1.0f - t * t;
                }
                if (u->has_bias)
                    x += mha__score_bias(p, u->b, h, i, j);
                if (!((vis[r] >> c) & 1))
                    x = -INFINITY;
                srow[c] = x;
            }
        }
        u->ops->exp_shift(srow, whole ? p->scale : 1.0f, lse, srow, nk);
    }
}

/* dP = dO V^T; then dropout (forward: pj = keep ? pj * keep_scale : 0) and
 * dS = scale P (z dP - D) tanh' into dP, and z P into S (for dV). */
static void
block_dscores(const bwd_unit *u, int64_t hh, int64_t i0, int64_t R, int64_t j0, int64_t nk) {
    const mha__problem *p = u->p;
    const int64_t n = p->n, dv = p->dv, BK = MHA__BWD_BK, h = u->g * p->group + hh;
    memset(u->dP, 0, sizeof(float) * (size_t)(R * BK));
    u->ops->gemm_acc(R, dv, nk, u->dOp + (hh * n + i0) * dv, dv, 1, u->Vt, BK, u->dP, BK);
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = i0 + r;
        const float D = u->Drow[hh * n + i];
        float *srow = u->S + r * BK, *dprow = u->dP + r * BK;
        const float *trow = u->T + r * BK;
        const float *G =
            u->bp->dprobs ? mha__probs_grad_row(p, u->bp->dprobs, u->b, h, i) + j0 : NULL;
        const float gs = mha__probs_grad_scale(p);
        /* P = 0 (hidden key) gives dS = 0 even if dP is not finite (a NaN value row behind a
         * mask must not leak), as the reference's skip does. */
        if (!p->dropout_on && p->softcap == 0.0f) {
            if (G) /* dP + G (softmax_grad gives a hidden key 0 whatever its sum) */
                for (int64_t c = 0; c < nk; c++) {
                    const float x = dprow[c] + G[c] * gs;
                    dprow[c] = srow[c] != 0.0f ? x : dprow[c];
                }
            u->ops->softmax_grad(srow, D, p->scale, dprow, nk);
            continue;
        }
        for (int64_t c = 0; c < nk; c++) {
            const float P = srow[c];
            if (P == 0.0f) {
                dprow[c] = 0.0f;
                continue;
            }
            float z = 1.0f;
            if (p->dropout_on)
                z = mha__problem_keep(p, u->b, h, i, j0 + c) ? u->keep_scale : 0.0f;
            float zdp = z * dprow[c]; /* + G: the probabilities are taken before dropout */
            if (G)
                zdp += G[c] * gs;
            float ds = P * (zdp - D);
            if (p->softcap > 0.0f)
                ds *= trow[c];
            dprow[c] = p->scale * ds;
            srow[c] = z * P;
        }
    }
}

/* dV += (z P)^T dO;  dK += dS^T Q;  dQ += dS K. With a non-finite key in the tile, dQ skips the
 * dS = 0 terms as the reference does, so a hidden non-finite key never reaches dQ. */
static void
block_accumulate(const bwd_unit *u, int64_t hh, int64_t i0, int64_t R, int64_t nk, int k_finite) {
    const mha__problem *p = u->p;
    const mha__bwd_problem *bp = u->bp;
    const int64_t n = p->n, dk = p->dk, dv = p->dv, BK = MHA__BWD_BK;
    const float *qh = u->Qp + (hh * n + i0) * dk, *dOh = u->dOp + (hh * n + i0) * dv;
    float *dQ = u->dQ + (hh * n + i0) * dk;
    if (bp->dv)
        u->ops->gemm_acc(nk, R, dv, u->S, 1, BK, dOh, dv, u->dVa, dv);
    if (bp->dk)
        u->ops->gemm_acc(nk, R, dk, u->dP, 1, BK, qh, dk, u->dKa, dk);
    if (bp->dq && k_finite)
        u->ops->gemm_acc(R, nk, dk, u->dP, BK, 1, u->Kr, dk, dQ, dk);
    else if (bp->dq)
        for (int64_t r = 0; r < R; r++) {
            float *dq = dQ + r * dk;
            for (int64_t c = 0; c < nk; c++) {
                const float ds = u->dP[r * BK + c];
                if (ds == 0.0f)
                    continue;
                for (int64_t d = 0; d < dk; d++)
                    dq[d] += ds * u->Kr[c * dk + d];
            }
        }
}

/* Whether rows [i0, i0 + R) of head hh (in the group) see any key of the tile [j0, j0 + nk):
 * vis gets a word per row (every rule: the band AND the block mask, BK = 64), *whole says
 * block_probs may take its plain path (every row sees the whole tile, no per-element modifier). */
static int block_visible(const bwd_unit *u,
                         int64_t hh,
                         int64_t i0,
                         int64_t R,
                         int64_t j0,
                         int64_t nk,
                         uint64_t *vis,
                         int *whole) {
    const mha__problem *p = u->p;
    /* Skip blocks that cannot see the tile (ranges grow with i). */
    int64_t lo0, hi0, lo1, hi1;
    mha__flash_key_range(p, u->b, i0, &lo0, &hi0);
    mha__flash_key_range(p, u->b, i0 + R - 1, &lo1, &hi1);
    if (hi1 < j0 || lo0 > j0 + nk - 1 || lo0 > hi1)
        return 0;
    int bias = 0;
    const mha_tile_class c =
        mha__rows_class(p, u->b, u->g * p->group + hh, i0, R, j0, (int)nk, vis, &bias);
    *whole = c == MHA_TILE_VISIBLE && !bias && !p->alibi_slopes && p->softcap == 0.0f;
    return c != MHA_TILE_HIDDEN;
}

/* sum_k P_k G_k gs over a row of a tile, hidden keys (P = 0) adding nothing whatever their G, in
 * 8 interleaved partial sums: a fixed order (no thread count changes it) that vectorises (the
 * product is formed for every key, then selected: a branch-free loop). */
static float probs_dot(const float *P, const float *G, float gs, int64_t nk) {
    float acc[8] = {0};
    int64_t k = 0;
    for (; k + 8 <= nk; k += 8)
        for (int l = 0; l < 8; l++) {
            const float x = P[k + l] * (G[k + l] * gs);
            acc[l] += P[k + l] != 0.0f ? x : 0.0f;
        }
    for (; k < nk; k++) {
        const float x = P[k] * (G[k] * gs);
        acc[0] += P[k] != 0.0f ? x : 0.0f;
    }
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* Pass 1b, only for a loss that reads the probabilities: D_i += sum_j P_ij G_ij (the softmax's
 * own derivative, dS_ij = P_ij (G_ij - sum_k P_ik G_ik), shifts D as dlse does; G_ij itself joins
 * dP in block_dscores). P is recomputed tile by tile as pass 2 does it: one more S = Q K^T, and
 * G [n, m] per head is read twice, here and in pass 2, which bounds the cost: at n = m = 1024,
 * d 64, the backward takes 2.0x its time without G (G is 3x the other operands' bytes; reading it
 * in row order here instead measured no faster). */
static void unit_probs_rows(const bwd_unit *u) {
    const mha__problem *p = u->p;
    const int64_t n = p->n, m = p->m, BQ = MHA__BWD_BQ, BK = MHA__BWD_BK;
    for (int64_t j0 = 0; j0 < m; j0 += BK) {
        const int64_t nk = m - j0 < BK ? m - j0 : BK;
        load_key_tile(u, j0, nk);
        for (int64_t hh = 0; hh < p->group; hh++)
            for (int64_t i0 = 0; i0 < n; i0 += BQ) {
                const int64_t R = n - i0 < BQ ? n - i0 : BQ, h = u->g * p->group + hh;
                uint64_t vis[MHA__BWD_BQ];
                int whole;
                if (!block_visible(u, hh, i0, R, j0, nk, vis, &whole))
                    continue;
                block_probs(u, hh, i0, R, j0, nk, whole, vis);
                for (int64_t r = 0; r < R; r++)
                    u->Drow[hh * n + i0 + r] += probs_dot(
                        u->S + r * BK, mha__probs_grad_row(p, u->bp->dprobs, u->b, h, i0 + r) + j0,
                        mha__probs_grad_scale(p), nk);
            }
    }
}

/* dL/dsink_h's share of the unit: -sum_i P_sink,i D_i per head (D as passes 1 and 1b left it). */
static void unit_sinks(const bwd_unit *u) {
    const mha__problem *p = u->p;
    const int64_t n = p->n;
    for (int64_t hh = 0; hh < p->group; hh++) {
        const int64_t h = u->g * p->group + hh;
        float sink_grad = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            const float lse = u->lse_b[h * n + i];
            if (lse != -INFINITY)
                sink_grad -= expf(p->sinks[h] - lse) * u->Drow[hh * n + i];
        }
        u->bp->sink_part[u->b * p->H + h] = sink_grad;
    }
}

void mha__bwd_flash_unit(const mha__bwd_flash_ops *ops,
                         const mha__bwd_problem *bp,
                         int64_t b,
                         int64_t g,
                         void *scratch) {
    const mha__problem *p = bp->p;
    const int64_t n = p->n, m = p->m, dk = p->dk, dv = p->dv, group = p->group;
    const int64_t BQ = MHA__BWD_BQ, BK = MHA__BWD_BK;
    bwd_layout L = {0};
    if (!layout_for(p, &L)) /* validated by mha__bwd_flash_scratch before any unit runs */
        return;
    char *ws = scratch;
    const bwd_unit u = {
        .ops = ops,
        .bp = bp,
        .p = p,
        .b = b,
        .g = g,
        .Drow = (float *)(ws + L.D),
        .dQ = (float *)(ws + L.dq),
        .Qp = (float *)(ws + L.qp),
        .dOp = (float *)(ws + L.dop),
        .Orow = (float *)(ws + L.orow),
        .Kr = (float *)(ws + L.kr),
        .Kt = (float *)(ws + L.kt),
        .Vt = (float *)(ws + L.vt),
        .dKa = (float *)(ws + L.dka),
        .dVa = (float *)(ws + L.dva),
        .S = (float *)(ws + L.s),
        .dP = (float *)(ws + L.dp),
        .T = (float *)(ws + L.tp),
        .lse_b = p->lse + b * p->H * n,
        .has_bias = p->additive.data || p->alibi_slopes,
        .keep_scale = p->dropout_on ? 1.0f / (1.0f - p->dropout_p) : 1.0f,
    };
    MHA_ASSERT(p->map || !mha__has_element_rules(p)); /* the core builds it (core/mask_map.c) */
    unit_rows(&u);
    if (bp->dprobs)
        unit_probs_rows(&u);
    if (bp->sink_part)
        unit_sinks(&u);

    /* Pass 2: key tiles; each row block that can see the tile adds its share. */
    for (int64_t j0 = 0; j0 < m; j0 += BK) {
        const int64_t nk = m - j0 < BK ? m - j0 : BK;
        const int k_finite = load_key_tile(&u, j0, nk);
        for (int64_t hh = 0; hh < group; hh++)
            for (int64_t i0 = 0; i0 < n; i0 += BQ) {
                const int64_t R = n - i0 < BQ ? n - i0 : BQ;
                uint64_t vis[MHA__BWD_BQ];
                int whole;
                if (!block_visible(&u, hh, i0, R, j0, nk, vis, &whole))
                    continue;
                block_probs(&u, hh, i0, R, j0, nk, whole, vis);
                block_dscores(&u, hh, i0, R, j0, nk);
                block_accumulate(&u, hh, i0, R, nk, k_finite);
            }
        for (int64_t c = 0; c < nk; c++) {
            if (bp->dk)
                store(bp->dk_dt, bp->dk, b * bp->dks[0] + g * bp->dks[1] + (j0 + c) * bp->dks[2],
                      u.dKa + c * dk, dk, bp->accumulate);
            if (bp->dv)
                store(bp->dv_dt, bp->dv, b * bp->dvs[0] + g * bp->dvs[1] + (j0 + c) * bp->dvs[2],
                      u.dVa + c * dv, dv, bp->accumulate);
        }
    }

    /* Pass 3: dQ of the unit's rows, written once. */
    if (bp->dq)
        for (int64_t hh = 0; hh < group; hh++)
            for (int64_t i = 0; i < n; i++)
                store(bp->dq_dt, bp->dq,
                      b * bp->dqs[0] + (g * group + hh) * bp->dqs[1] + i * bp->dqs[2],
                      u.dQ + (hh * n + i) * dk, dk, bp->accumulate);
}

/* ---------------------------------------------------------------------------------------------- */
/* Portable arithmetic.                                                                           */
/* ---------------------------------------------------------------------------------------------- */

static void gemm_acc_generic(int64_t R,
                             int64_t K,
                             int64_t N,
                             const float *A,
                             int64_t sa,
                             int64_t sk,
                             const float *B,
                             int64_t ldb,
                             float *C,
                             int64_t ldc) {
    for (int64_t r = 0; r < R; r++) {
        float *c = C + r * ldc;
        for (int64_t k = 0; k < K; k++) {
            const float a = A[r * sa + k * sk];
            const float *brow = B + k * ldb;
            for (int64_t j = 0; j < N; j++)
                c[j] += a * brow[j];
        }
    }
}

static void exp_shift_generic(const float *x, float scale, float c, float *y, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        y[i] = expf(scale * x[i] - c);
}

static void softmax_grad_generic(const float *P, float D, float scale, float *dp, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        dp[i] = P[i] != 0.0f ? scale * (P[i] * (dp[i] - D)) : 0.0f;
}

static const mha__bwd_flash_ops generic_ops = {gemm_acc_generic, exp_shift_generic,
                                               softmax_grad_generic};

void mha_bwd_f32_flash_q32k64__generic(const mha__bwd_problem *bp,
                                       int64_t b,
                                       int64_t g,
                                       void *scratch) {
    mha__bwd_flash_unit(&generic_ops, bp, b, g, scratch);
}
