/* SPDX-License-Identifier: MIT */
/* attention_bwd_ref.c: the reference backward of the attention core. Plain loops, one query row
 * at a time, float32 storage and accumulation (the peer of the fast backward in the ratio test).
 * The probabilities are recomputed from q, k and the saved lse; nothing n x m is stored.
 *
 *   q: [B, H, n, dk]  k: [B, G, m, dk]  v: [B, G, m, dv]  out (O), dout (dO): [B, H, n, dv]
 *   lse: [B, H, n]    dq: [B, H, n, dk]  dk: [B, G, m, dk]  dv: [B, G, m, dv]
 *
 * Derivation (one query row i of head h; docs/TRAINING.md has the same in prose).
 * Forward (attention_ref.c), with r_ij = scale q_i.k_j the raw score:
 *   (F1) s_ij = softcap tanh(r_ij / softcap) (or r_ij) + bias_ij, -inf where invisible
 *   (F2) P_ij = exp(s_ij - lse_i),  lse_i = log(exp(sink_h) + sum_j exp(s_ij))
 *   (F3) O_i = sum_j z_ij P_ij V_j,  z_ij = keep_ij / (1 - p) or 0 (1 without dropout)
 * Backward:
 *   from (F3): dV_j += z_ij P_ij dO_i  and  dP_ij = z_ij (dO_i . V_j).
 *   from (F2): softmax over the keys AND the sink, where the sink has no value row, so its
 *     "dP" is 0: dS_ij = P_ij (dP_ij - sum_k P_ik dP_ik) and dsink = P_sink,i (0 - sum_k ...).
 *     The row sum is D_i = sum_k P_ik z_ik (dO_i . V_k) = dO_i . (sum_k z_ik P_ik V_k) = dO_i . O_i
 *     by (F3): dropout and sinks need no extra term (P_sink never multiplies a value).
 *   from (F1): dr_ij = dS_ij (1 - tanh^2(r_ij / softcap)) (or dS_ij); the bias is a constant.
 *   from r_ij = scale q_i . k_j: dQ_i += scale dr_ij K_j, dK_j += scale dr_ij Q_i.
 *   Invisible keys have P_ij = 0, so they contribute nothing; a fully masked row (lse = -inf)
 *   has P = 0 everywhere and a zero gradient (it is skipped, so no exp(-inf - -inf) NaN).
 */
#include "kernels/registry.h"

#include <string.h>

/* Scratch per unit: P, dP, tanh' rows [m], dK and dV accumulators [m, dk] + [m, dv], K and V
 * of the kv head widened to float32 [m, dk] + [m, dv], the rows dQ, Q [dk], O and dO [dv]. */
bool mha__attention_bwd_ref_scratch(const mha__problem *p, size_t *bytes) {
    int64_t per_key, total, rows;
    if (!mha__add_i64(p->dk, p->dv, &rows) || !mha__mul_i64(rows, 2, &per_key) ||
        !mha__add_i64(per_key, 3, &per_key) || !mha__mul_i64(per_key, p->m, &total) ||
        !mha__mul_i64(rows, 2, &rows) || !mha__add_i64(total, rows, &total))
        return false;
    return mha__bytes(total, sizeof(float), bytes);
}

/* Writes (or adds, in float32) acc[0..len) into elements at.. of base (dtype dt), rounded once. */
static void
store(mha_dtype dt, void *base, int64_t at, const float *acc, int64_t len, int accumulate) {
    for (int64_t d = 0; d < len; d++)
        mha__store(dt, base, at + d, accumulate ? mha__load(dt, base, at + d) + acc[d] : acc[d]);
}

/* Rows [0, rows) of length len with row stride `stride` from base (dtype dt), widened into dst. */
static void widen_rows(mha_dtype dt,
                       const void *base,
                       int64_t at,
                       int64_t rows,
                       int64_t stride,
                       int64_t len,
                       float *dst) {
    for (int64_t r = 0; r < rows; r++)
        mha__widen(dt, mha__elem(dt, base, at + r * stride), dst + r * len, len);
}

void mha_bwd_f32_naive__ref(const mha__bwd_problem *bp, int64_t b, int64_t g, void *scratch) {
    const mha__problem *p = bp->p;
    const int64_t m = p->m, n = p->n, dk = p->dk, dv = p->dv;
    float *P = scratch, *dP = P + m, *tp = dP + m;
    float *dK = tp + m, *dV = dK + m * dk, *kb = dV + m * dv, *vb = kb + m * dk;
    float *dq = vb + m * dv, *q = dq + dk, *o = q + dk, *dO = o + dv;
    memset(dK, 0, sizeof(float) * (size_t)(m * (dk + dv)));
    widen_rows(p->k_dt, p->k, b * p->ks[0] + g * p->ks[1], m, p->ks[2], dk, kb);
    widen_rows(p->v_dt, p->v, b * p->vs[0] + g * p->vs[1], m, p->vs[2], dv, vb);
    const float keep_scale = p->dropout_on ? 1.0f / (1.0f - p->dropout_p) : 1.0f;

    for (int64_t h = g * p->group; h < (g + 1) * p->group; h++) {
        float sink_grad = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            widen_rows(p->q_dt, p->q, b * p->qs[0] + h * p->qs[1] + i * p->qs[2], 1, 0, dk, q);
            widen_rows(p->o_dt, p->out, b * p->os[0] + h * p->os[1] + i * p->os[2], 1, 0, dv, o);
            widen_rows(bp->do_dt, bp->dout, b * bp->dos[0] + h * bp->dos[1] + i * bp->dos[2], 1, 0,
                       dv, dO);
            const float lse = p->lse[(b * p->H + h) * n + i];
            for (int64_t d = 0; d < dk; d++)
                dq[d] = 0.0f;

            if (lse != -INFINITY) { /* fully masked rows contribute nothing */
                /* Pass 1: P_ij = exp(s_ij - lse_i), the scores recomputed exactly as the forward
                 * does them (F1, F2); tp_j = d s / d r (the softcap derivative). */
                for (int64_t j = 0; j < m; j++) {
                    tp[j] = 1.0f;
                    if (!mha__visible(p, b, h, i, j)) {
                        P[j] = 0.0f;
                        continue;
                    }
                    const float *k = kb + j * dk;
                    float dot = 0.0f;
                    for (int64_t d = 0; d < dk; d++)
                        dot += q[d] * k[d];
                    float sj = p->scale * dot;
                    if (p->softcap > 0.0f) {
                        /* forward: sj = p->softcap * tanhf(sj / p->softcap); */
                        const float t = tanhf(sj / p->softcap);
                        sj = p->softcap * t;
                        tp[j] = 1.0f - t * t;
                    }
                    sj += mha__score_bias(p, b, h, i, j);
                    P[j] = expf(sj - lse);
                }

                /* Pass 2: D_i = dO_i . O_i (the softmax row sum, see the derivation), minus
                 * dL/dlse_i when the loss reads lse (d lse_i / d s_ij = P_ij). */
                float D = 0.0f;
                for (int64_t d = 0; d < dv; d++)
                    D += dO[d] * o[d];
                if (bp->dlse)
                    D -= bp->dlse[(b * p->H + h) * n + i];
                /* A loss reading the probabilities (G = dL/dP): dS_ij gains
                 * P_ij (G_ij - sum_k P_ik G_ik), i.e. D += sum_k P_ik G_ik and dP_ij += G_ij. */
                const float *G = bp->dprobs ? mha__probs_grad_row(p, bp->dprobs, b, h, i) : NULL;
                const float gs = mha__probs_grad_scale(p);
                if (G) {
                    float c = 0.0f;
                    for (int64_t j = 0; j < m; j++)
                        if (P[j] != 0.0f)
                            c += P[j] * (G[j] * gs);
                    D += c;
                }

                /* Pass 3: forward "o[d] += pj * v[d]" with pj = z_ij P_ij gives
                 * dV_j += z_ij P_ij dO_i and dP_ij = z_ij dO_i . V_j. */
                for (int64_t j = 0; j < m; j++) {
                    if (P[j] == 0.0f) {
                        dP[j] = 0.0f;
                        continue;
                    }
                    float z = 1.0f;
                    if (p->dropout_on)
                        z = mha__problem_keep(p, b, h, i, j) ? keep_scale : 0.0f;
                    const float *v = vb + j * dv;
                    const float pz = z * P[j];
                    float *dv_j = dV + j * dv;
                    float dot = 0.0f;
                    for (int64_t d = 0; d < dv; d++) {
                        dv_j[d] += pz * dO[d];
                        dot += dO[d] * v[d];
                    }
                    dP[j] = z * dot;
                    if (G) /* the probabilities are taken before dropout */
                        dP[j] += G[j] * gs;
                }

                /* Pass 4: forward "P_ij = exp(s_ij - lse_i)" (softmax with the sink) gives
                 * dS_ij = P_ij (dP_ij - D_i); forward "s = softcap tanh(r / softcap)" gives
                 * dr = dS (1 - tanh^2); forward "r = scale q.k" gives dQ_i += scale dr K_j and
                 * dK_j += scale dr Q_i. */
                for (int64_t j = 0; j < m; j++) {
                    if (P[j] == 0.0f)
                        continue;
                    const float ds = P[j] * (dP[j] - D) * tp[j];
                    const float dr = p->scale * ds;
                    const float *k = kb + j * dk;
                    float *dk_j = dK + j * dk;
                    for (int64_t d = 0; d < dk; d++) {
                        dq[d] += dr * k[d];
                        dk_j[d] += dr * q[d];
                    }
                }

                /* Pass 5: the sink's probability P_sink = exp(sink - lse) has
                 * dS = P_sink (0 - D). */
                if (p->sinks)
                    sink_grad -= expf(p->sinks[h] - lse) * D;
            }
            if (bp->dq)
                store(bp->dq_dt, bp->dq, b * bp->dqs[0] + h * bp->dqs[1] + i * bp->dqs[2], dq, dk,
                      bp->accumulate);
        }
        if (bp->sink_part)
            bp->sink_part[b * p->H + h] = sink_grad;
    }

    /* dK, dV of kv head g: the sums over its query heads, written once. */
    for (int64_t j = 0; j < m; j++) {
        if (bp->dk)
            store(bp->dk_dt, bp->dk, b * bp->dks[0] + g * bp->dks[1] + j * bp->dks[2], dK + j * dk,
                  dk, bp->accumulate);
        if (bp->dv)
            store(bp->dv_dt, bp->dv, b * bp->dvs[0] + g * bp->dvs[1] + j * bp->dvs[2], dV + j * dv,
                  dv, bp->accumulate);
    }
}
