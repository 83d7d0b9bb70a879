/* SPDX-License-Identifier: MIT */
/* decode_generic.c: the portable split-KV decode kernel (flash-decoding), plain C, no intrinsics.
 *
 *   one unit = keys [j0, j1) of kv head g of one sequence; its R = group * t query rows
 *   (every query head of the group, every new token) share each K and V row loaded from the
 *   cache (float32, or the other dtypes widened here; q8_0 in either order: mha__kv_get).
 *   pass 1: s_rj = scale q_r.k_j, soft-capped, minus ALiBi slope_h (p_r - j); -inf if hidden
 *   pass 2: m_r = max_j s_rj, e_rj = exp(s_rj - m_r), l_r = sum_j e_rj
 *   pass 3: o_r = sum_j e_rj v_j            (unnormalised; decode.c merges the units exactly)
 */
#include "kernels/registry.h"

#include <string.h>

void mha_decode_f32acc_splitkv__generic(const mha__dec_problem *p,
                                        const mha__dec_unit *u,
                                        float *o,
                                        float *m,
                                        float *l,
                                        float *scratch) {
    const struct mha_kv_cache *c = p->cache;
    const int64_t R = p->group * p->t, nb = u->j1 - u->j0, dk = p->dk, dv = p->dv;
    const int64_t seq = p->seq[u->s], L = c->len[seq];
    float *S = scratch, *kb = S + R * MHA_DEC_BLOCK, *vb = kb + dk;

    /* Pass 1: scores. */
    for (int64_t r = 0; r < R; r++)
        m[r] = -INFINITY;
    for (int64_t jj = 0; jj < nb; jj++) {
        const int64_t j = u->j0 + jj;
        mha__kv_get(c, 0, seq, u->g, j, kb);
        for (int64_t r = 0; r < R; r++) {
            const int64_t i = r / p->group, h = u->g * p->group + r % p->group;
            const int64_t pos = mha__dec_tree_pos(p, L, i);
            if (!mha__dec_tree_visible(p, u->s, i, L, pos, j)) {
                S[r * MHA_DEC_BLOCK + jj] = -INFINITY;
                continue;
            }
            const float *q = p->q + u->s * p->q_ss + i * p->q_ts + h * dk;
            float dot = 0.0f;
            for (int64_t d = 0; d < dk; d++)
                dot += q[d] * kb[d];
            float s = p->scale * dot;
            if (p->softcap > 0.0f)
                s = p->softcap * tanhf(s / p->softcap);
            if (p->slopes)
                s -= p->slopes[h] * (float)(pos - mha__dec_tree_key_pos(p, L, j));
            S[r * MHA_DEC_BLOCK + jj] = s;
            if (s > m[r])
                m[r] = s;
        }
    }
    /* Pass 2: exponentials against the unit's own row max. */
    for (int64_t r = 0; r < R; r++) {
        float *sr = S + r * MHA_DEC_BLOCK, sum = 0.0f;
        for (int64_t jj = 0; jj < nb; jj++) {
            const float e = sr[jj] == -INFINITY ? 0.0f : expf(sr[jj] - m[r]);
            sr[jj] = e;
            sum += e;
        }
        l[r] = sum;
        memset(o + r * dv, 0, sizeof(float) * (size_t)dv);
    }
    /* Pass 3: weighted values, each V row loaded once for the R rows. */
    for (int64_t jj = 0; jj < nb; jj++) {
        mha__kv_get(c, 1, seq, u->g, u->j0 + jj, vb);
        for (int64_t r = 0; r < R; r++) {
            const float e = S[r * MHA_DEC_BLOCK + jj];
            if (e == 0.0f)
                continue;
            float *orow = o + r * dv;
            for (int64_t d = 0; d < dv; d++)
                orow[d] += e * vb[d];
        }
    }
}
