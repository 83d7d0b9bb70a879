/* SPDX-License-Identifier: MIT */
/* decode_scores_avx512.h: pass 1b of the AVX-512 decode kernels (decode_avx512.c and
 * decode_q8x16_avx512vnni.c), 16 keys at a time: a row's raw dot products q . k_j become its scores
 * (scale, soft-cap, ALiBi; -inf outside the keys the row sees: causal, window, chunk, draft tree).
 * One copy so that every AVX-512 decode kernel masks and scales the same way. */
#ifndef MHA_DECODE_SCORES_AVX512_H
#define MHA_DECODE_SCORES_AVX512_H

#include "cache/kv_cache.h"
#include "kernels/x86/simd_avx512.h"

/* Row r of a unit (r = i * group + gh: token i, query head g * group + gh): the keys it sees,
 * [lo, hi] relative to the unit's first key j0, clamped to [0, nb - 1]. */
typedef struct dec_row {
    int64_t i, h, pos, lo, hi;
} dec_row;

MHA_INLINE dec_row
dec_row_of(const mha__dec_problem *p, const mha__dec_unit *u, int64_t r, int64_t nb, int64_t L) {
    dec_row w;
    w.i = r / p->group;
    w.h = u->g * p->group + r % p->group;
    w.pos = mha__dec_tree_pos(p, L, w.i);
    /* Visible keys, relative to j0: [lo, hi] (clamped to the block), and with a draft tree the
     * lanes mha__dec_tree_lanes allows. */
    w.hi = mha__dec_tree_last_key(p, L, w.pos) - u->j0;
    w.lo = mha__dec_first_key(p, w.pos) - u->j0;
    w.hi = w.hi > nb - 1 ? nb - 1 : w.hi;
    w.lo = w.lo < 0 ? 0 : w.lo;
    return w;
}

/* The scores of keys [jj, jj + 16) of row w, lanes below `end` (in), from its raw dot products
 * at sr + jj: s = scale q . k, soft-capped, minus ALiBi's slope times the distance, -inf where the
 * row does not see the key (lanes outside `in` too). A visible NaN score sets its lane of
 * *nan_seen. */
MHA_INLINE v16 dec_score16(const mha__dec_problem *p,
                           const mha__dec_unit *u,
                           const dec_row *w,
                           int64_t L,
                           int64_t jj,
                           int64_t end,
                           const float *sr,
                           __mmask16 *nan_seen) {
    const v16 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const v16 scale = v16_set1(p->scale), cap = v16_set1(p->softcap);
    const v16 inv_cap = v16_set1(p->softcap > 0.0f ? 1.0f / p->softcap : 0.0f);
    const float slope = p->slopes ? p->slopes[w->h] : 0.0f;
    const v16 vslope = v16_set1(slope), vdist0 = v16_set1((float)(w->pos - u->j0));
    const int64_t rem = end - jj;
    const __mmask16 in = v16_first((int)(rem < 16 ? rem : 16));
    const v16 jrel = v16_add(iota, v16_set1((float)jj));
    __mmask16 vis = in & _mm512_cmp_ps_mask(jrel, v16_set1((float)w->lo), _CMP_GE_OQ) &
                    _mm512_cmp_ps_mask(jrel, v16_set1((float)w->hi), _CMP_LE_OQ);
    float shift[16] = {0};
    if (p->tree_vis) {
        vis &= (__mmask16)mha__dec_tree_lanes(p, u->s, w->i, L, u->j0 + jj);
        if (p->slopes)
            mha__dec_tree_shift(p, L, u->j0 + jj, rem < 16 ? rem : 16, shift);
    }
    v16 s = v16_mul(scale, _mm512_maskz_loadu_ps(in, sr + jj));
    if (p->softcap > 0.0f)
        s = v16_mul(cap, v16_tanh(v16_mul(s, inv_cap)));
    if (p->slopes)
        s = _mm512_fnmadd_ps(vslope, v16_sub(vdist0, jrel), s);
    if (p->tree_vis && p->slopes) /* a draft key's position is not its slot */
        s = _mm512_fnmadd_ps(vslope, _mm512_loadu_ps(shift), s);
    *nan_seen |= _mm512_mask_cmp_ps_mask(vis, s, s, _CMP_UNORD_Q);
    return v16_select(vis, s, v16_set1(-INFINITY));
}

#endif /* MHA_DECODE_SCORES_AVX512_H */
