/* SPDX-License-Identifier: MIT */
/* decode_q8_avx512.c: the split-KV decode kernel for q8_0 caches (docs/SEMANTICS.md "q8_0 KV
 * cache"), AVX-512. The generic kernel's three passes (decode_generic.c) with the rows
 * dequantised in registers and the dot products / value sums 16 lanes wide:
 *   row of d values = d / 32 blocks (f16 scale s, 32 int8 q): x = cvt(q) * s, two vectors of 16
 *   per block (VPMOVSXBD + VCVTDQ2PS + VMULPS; q * s is exact in float32: 8 + 11 bits);
 *   pass 1: s_rj = scale q_r.k_j (16 partial sums, one horizontal sum per row and key);
 *   pass 3: o_r += e_rj v_j, 16 lanes per FMA.
 * The K or V row is dequantised once into scratch and shared by the R rows of the unit. Sums run
 * in a fixed order per unit, so results do not depend on the thread count.
 */
#include "kernels/registry.h"

#include <immintrin.h>
#include <string.h>

/* d (a multiple of 32) values of a q8_0 row at src into dst. */
static void dequant_row(const unsigned char *src, int64_t d, float *dst) {
    for (int64_t b = 0; b < d / MHA__Q8_BLOCK; b++) {
        const unsigned char *blk = src + b * MHA__Q8_BYTES;
        uint16_t dh;
        memcpy(&dh, blk, 2);
        const __m512 s = _mm512_set1_ps(mha__f16_to_f32(dh));
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
        _mm512_storeu_ps(dst + 32 * b,
                         _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), s));
        _mm512_storeu_ps(dst + 32 * b + 16,
                         _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), s));
    }
}

/* q . k over d (a multiple of 32) floats. */
static float dot(const float *q, const float *k, int64_t d) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 32) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i + 16), _mm512_loadu_ps(k + i + 16), a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

void mha_decode_q8_splitkv__avx512(const mha__dec_problem *p,
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
        dequant_row(mha__kv_k_row(c, seq, u->g, j), dk, kb);
        for (int64_t r = 0; r < R; r++) {
            const int64_t i = r / p->group, h = u->g * p->group + r % p->group;
            const int64_t pos = mha__dec_tree_pos(p, L, i);
            if (!mha__dec_tree_visible(p, u->s, i, L, pos, j)) {
                S[r * MHA_DEC_BLOCK + jj] = -INFINITY;
                continue;
            }
            float s = p->scale * dot(p->q + u->s * p->q_ss + i * p->q_ts + h * dk, kb, dk);
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
    /* Pass 3: weighted values, each V row dequantised once for the R rows. */
    for (int64_t jj = 0; jj < nb; jj++) {
        dequant_row(mha__kv_v_row(c, seq, u->g, u->j0 + jj), dv, vb);
        for (int64_t r = 0; r < R; r++) {
            const float e = S[r * MHA_DEC_BLOCK + jj];
            if (e == 0.0f)
                continue; /* a hidden key: 0 * a non-finite v would be NaN */
            const __m512 ev = _mm512_set1_ps(e);
            float *orow = o + r * dv;
            for (int64_t d = 0; d < dv; d += 16)
                _mm512_storeu_ps(orow + d, _mm512_fmadd_ps(ev, _mm512_loadu_ps(vb + d),
                                                           _mm512_loadu_ps(orow + d)));
        }
    }
}
