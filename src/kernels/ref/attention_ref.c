/* SPDX-License-Identifier: MIT */
/* attention_ref.c: the reference attention core. Plain loops that follow the formulas of
 * docs/SEMANTICS.md one pass at a time, float32 storage and float32 accumulation (the same
 * contract as the fast kernels, so it is their peer in the accuracy-ratio test). No intrinsics,
 * no blocking, no threads: it must be obviously right.
 *
 *   q: [B, H, n, dk]  k: [B, G, m, dk]  v: [B, G, m, dv]  out: [B, H, n, dv]
 *   lse: [B, H, n]    probs: [B, H, n, m] or [B, n, m] (averaged over heads)
 *   query head h reads kv head h / (H / G).
 *
 * The two sums over keys (the softmax denominator and O = sum_j p_j v_j) are added in blocks of
 * MHA_REF_SUM_BLOCK keys: each block is one running float sum, and the block sums are added in
 * order. A single running sum over m = 65536 terms drifts by many units in the last place (the
 * error grows with the number of terms; test_extremes measured 1.9x its backstop); rows of at
 * most 2048 keys are one block, i.e. exactly the plain loop.
 */
#include "kernels/kernels.h"

#include <string.h>

#define MHA_REF_SUM_BLOCK 2048

/* One query row (b, h, i); s is scratch for m scores, ob and o for dv floats each. Every input
 * element is read through mha__load (widened exactly when it is half precision); the output row
 * is formed in float32 in o and rounded once to its dtype at the end. */
static void
attend_row(const mha__problem *p, int64_t b, int64_t h, int64_t i, float *s, float *ob, float *o) {
    const int64_t m = p->m, g = h / p->group;
    const int64_t q0 = b * p->qs[0] + h * p->qs[1] + i * p->qs[2];
    const int64_t k0 = b * p->ks[0] + g * p->ks[1], v0 = b * p->vs[0] + g * p->vs[1];

    /* Pass 1: scores s_j = scale * q.k_j, soft-capped, plus additive mask and ALiBi; -inf where
     * a boolean rule (causal, window, bool mask, key padding, segments) hides key j. */
    float max_s = -INFINITY;
    int has_nan = 0;
    for (int64_t j = 0; j < m; j++) {
        if (!mha__visible(p, b, h, i, j)) {
            s[j] = -INFINITY;
            continue;
        }
        const int64_t kj = k0 + j * p->ks[2];
        float dot = 0.0f;
        for (int64_t d = 0; d < p->dk; d++)
            dot += mha__load(p->q_dt, p->q, q0 + d) * mha__load(p->k_dt, p->k, kj + d);
        float sj = p->scale * dot;
        if (p->softcap > 0.0f)
            sj = p->softcap * tanhf(sj / p->softcap);
        sj += mha__score_bias(p, b, h, i, j);
        s[j] = sj;
        has_nan |= isnan(sj);
        if (sj > max_s)
            max_s = sj;
    }
    const float sink = p->sinks ? p->sinks[h] : -INFINITY;
    has_nan |= isnan(sink);

    /* A fully masked row (every score -inf) attends to nothing: zero output, zero probabilities,
     * lse = -inf. NaN anywhere in the row propagates instead (policy: docs/SEMANTICS.md). */
    if (max_s == -INFINITY && !has_nan) {
        for (int64_t d = 0; d < p->dv; d++)
            o[d] = 0.0f;
        for (int64_t j = 0; j < m; j++)
            s[j] = 0.0f;
        if (p->lse)
            p->lse[(b * p->H + h) * p->n + i] = -INFINITY;
    } else {
        /* Pass 2: softmax with the row max subtracted (the sink joins the max and the sum). */
        if (sink > max_s)
            max_s = sink;
        float sum = p->sinks ? expf(sink - max_s) : 0.0f;
        for (int64_t j0 = 0; j0 < m; j0 += MHA_REF_SUM_BLOCK) {
            float block = 0.0f;
            for (int64_t j = j0; j < m && j < j0 + MHA_REF_SUM_BLOCK; j++) {
                s[j] = expf(s[j] - max_s);
                block += s[j];
            }
            sum += block;
        }
        const float inv_sum = 1.0f / sum;
        for (int64_t j = 0; j < m; j++)
            s[j] *= inv_sum;
        if (p->lse)
            p->lse[(b * p->H + h) * p->n + i] = max_s + logf(sum);

        /* Pass 3: o = sum_j dropout(p_j) v_j. */
        for (int64_t d = 0; d < p->dv; d++)
            o[d] = 0.0f;
        const float keep_scale = p->dropout_on ? 1.0f / (1.0f - p->dropout_p) : 1.0f;
        for (int64_t j0 = 0; j0 < m; j0 += MHA_REF_SUM_BLOCK) {
            for (int64_t d = 0; d < p->dv; d++)
                ob[d] = 0.0f;
            for (int64_t j = j0; j < m && j < j0 + MHA_REF_SUM_BLOCK; j++) {
                float pj = s[j];
                if (p->dropout_on)
                    pj = mha__problem_keep(p, b, h, i, j) ? pj * keep_scale : 0.0f;
                if (pj == 0.0f)
                    continue;
                const int64_t vj = v0 + j * p->vs[2];
                for (int64_t d = 0; d < p->dv; d++)
                    ob[d] += pj * mha__load(p->v_dt, p->v, vj + d);
            }
            for (int64_t d = 0; d < p->dv; d++)
                o[d] += ob[d];
        }
    }

    const int64_t o0 = b * p->os[0] + h * p->os[1] + i * p->os[2];
    for (int64_t d = 0; d < p->dv; d++)
        mha__store(p->o_dt, p->out, o0 + d, o[d]);

    /* Pass 4: probabilities as requested (before dropout). */
    if (p->probs) {
        if (p->average_probs) {
            float *row = p->probs + (b * p->n + i) * m;
            const float inv_h = 1.0f / (float)p->H;
            for (int64_t j = 0; j < m; j++)
                row[j] = (h == 0 ? 0.0f : row[j]) + s[j] * inv_h;
        } else {
            memcpy(p->probs + ((b * p->H + h) * p->n + i) * m, s, sizeof(float) * (size_t)m);
        }
    }
}

void mha__attention_ref(const mha__problem *p, int64_t bh_begin, int64_t bh_end, float *scratch) {
    for (int64_t bh = bh_begin; bh < bh_end; bh++) {
        const int64_t b = bh / p->H, h = bh % p->H;
        for (int64_t i = 0; i < p->n; i++)
            attend_row(p, b, h, i, scratch, scratch + p->m, scratch + p->m + p->dv);
    }
}
