/* SPDX-License-Identifier: MIT */
/* decode_avx512.c: the split-KV decode kernel (flash-decoding) with AVX-512F/BW/VL intrinsics.
 *
 * Same unit and contract as decode_generic.c: keys [j0, j1) of kv head g of one sequence, for all
 * R = group * t query rows that share it, producing an unnormalised (o, m, l) per row. K and V
 * rows are streamed four at a time and widened in registers (float16 with VCVTPH2PS, bfloat16 by
 * a 16-bit left shift); each 16-float slice of the four rows serves up to four query rows from
 * registers (a 4 x 4 block of accumulators), so for groups of <= 4 rows every K/V element is
 * loaded and widened exactly once:
 *   pass 1: 4 x 4 dot products, one 4-way horizontal sum per row; then, vectorised over the
 *           block: scale, soft-cap (vector tanh), ALiBi, causal / window mask
 *   pass 2: m = max, e = exp(s - m) (vector exp of simd_avx512.h, 0.06 ULP), l = sum e
 *   pass 3: o += e_j v_j, four keys per load/store of each accumulator row
 * Measured on a cache that fits in L3 (h = 32, g = 8, d = 128, 512 keys, 1 thread, best of 200
 * steps on a shared machine): 0.28 ms for float32 and bfloat16, against 0.37 / 0.49 ms for the
 * first version that widened rows into scratch and swept the rows one at a time.
 * The float32 sums are in a fixed order that does not depend on threads (bit-identical for any
 * thread count); they differ in rounding from the generic kernel's order (tolerance-tested).
 */
#include "kv_cache.h"
#include "simd_avx512.h"

#include <string.h>

/* Elements [d, d+16) of a cache row as float32; lanes outside mask k read 0. */
MHA_INLINE v16 load_row16(mha_dtype dt, const void *row, int64_t d, __mmask16 k) {
    if (dt == MHA_DTYPE_F16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, (const uint16_t *)row + d));
    if (dt == MHA_DTYPE_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, (const uint16_t *)row + d)), 16));
    return _mm512_maskz_loadu_ps(k, (const float *)row + d);
}

/* Software prefetch of rows [j, j+4) of a unit (keys past j1 are skipped): the K and V streams
 * are long and regular, but each group of four rows is followed by R rows of arithmetic, which
 * keeps few cache-line misses in flight for the hardware prefetcher alone. TODO(#5): tune the
 * distance on a quiet machine (this one was shared with other builds when it was written). */
#define MHA_DEC_PREFETCH 16 /* keys ahead: 8 KiB of float32 K rows of d = 128 */

MHA_INLINE void
prefetch_rows(const struct mha_kv_cache *c,
              const void *(*row)(const struct mha_kv_cache *, int64_t, int64_t, int64_t),
              int64_t seq,
              int64_t g,
              int64_t j,
              int64_t j1,
              size_t bytes) {
    for (int64_t x = 0; x < 4 && j + x < j1; x++) {
        const char *p = row(c, seq, g, j + x);
        for (size_t b = 0; b < bytes; b += 64)
            _mm_prefetch(p + b, _MM_HINT_T0);
    }
}

/* Scores of NR rows (q[0..NR)) against four keys (kr[0..4)): out[x * BLOCK + y] = q_x . k_y for
 * y < nk. Inlined with a constant NR, the 4 x NR accumulators live in registers. */
MHA_INLINE void dots(const int NR,
                     mha_dtype dt,
                     const void *const kr[4],
                     const float *const q[4],
                     int64_t dk,
                     int64_t dkp,
                     __mmask16 ktail,
                     int64_t nk,
                     float *out) {
    v16 acc[4][4];
#pragma GCC unroll 4
    for (int x = 0; x < NR; x++)
        acc[x][0] = acc[x][1] = acc[x][2] = acc[x][3] = v16_zero();
    for (int64_t d = 0; d < dkp; d += 16) {
        const __mmask16 k = d + 16 <= dk ? (__mmask16)0xFFFF : ktail;
        const v16 k0 = load_row16(dt, kr[0], d, k), k1 = load_row16(dt, kr[1], d, k);
        const v16 k2 = load_row16(dt, kr[2], d, k), k3 = load_row16(dt, kr[3], d, k);
#pragma GCC unroll 4
        for (int x = 0; x < NR; x++) {
            const v16 qv = _mm512_maskz_loadu_ps(k, q[x] + d);
            acc[x][0] = v16_fma(qv, k0, acc[x][0]);
            acc[x][1] = v16_fma(qv, k1, acc[x][1]);
            acc[x][2] = v16_fma(qv, k2, acc[x][2]);
            acc[x][3] = v16_fma(qv, k3, acc[x][3]);
        }
    }
    /* Lane 4y of the 4-way sum holds key y's dot product. */
    const __m512i pick = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
#pragma GCC unroll 4
    for (int x = 0; x < NR; x++) {
        const v16 sums = v16_hsum4(acc[x][0], acc[x][1], acc[x][2], acc[x][3]);
        const __m128 packed = _mm512_castps512_ps128(_mm512_permutexvar_ps(pick, sums));
        _mm_mask_storeu_ps(out + x * MHA_DEC_BLOCK, (__mmask8)((1u << nk) - 1u), packed);
    }
}

/* o_x += sum_y e[x][y] v_y for NR accumulator rows (row stride dv) and four value rows. */
MHA_INLINE void axpys(const int NR,
                      mha_dtype dt,
                      const void *const vr[4],
                      float e[4][4],
                      float *o,
                      int64_t dv,
                      int64_t dvp,
                      __mmask16 vtail) {
    v16 ev[4][4];
#pragma GCC unroll 4
    for (int x = 0; x < NR; x++)
        for (int y = 0; y < 4; y++)
            ev[x][y] = v16_set1(e[x][y]);
    for (int64_t d = 0; d < dvp; d += 16) {
        const __mmask16 k = d + 16 <= dv ? (__mmask16)0xFFFF : vtail;
        const v16 v0 = load_row16(dt, vr[0], d, k), v1 = load_row16(dt, vr[1], d, k);
        const v16 v2 = load_row16(dt, vr[2], d, k), v3 = load_row16(dt, vr[3], d, k);
#pragma GCC unroll 4
        for (int x = 0; x < NR; x++) {
            float *orow = o + x * dv;
            v16 acc = _mm512_maskz_loadu_ps(k, orow + d);
            acc = v16_fma(ev[x][0], v0, acc);
            acc = v16_fma(ev[x][1], v1, acc);
            acc = v16_fma(ev[x][2], v2, acc);
            acc = v16_fma(ev[x][3], v3, acc);
            _mm512_mask_storeu_ps(orow + d, k, acc);
        }
    }
}

void mha__dec_kernel_avx512(const mha__dec_problem *p,
                            const mha__dec_unit *u,
                            float *o,
                            float *m,
                            float *l,
                            float *scratch) {
    const struct mha_kv_cache *c = p->cache;
    const mha_dtype dt = c->cfg.dtype;
    const int64_t R = p->group * p->t, nb = u->j1 - u->j0, dk = p->dk, dv = p->dv;
    const int64_t seq = p->seq[u->s], L = c->len[seq];
    const int64_t dkp = (dk + 15) & ~(int64_t)15, dvp = (dv + 15) & ~(int64_t)15;
    float *S = scratch;
    const __mmask16 ktail = v16_first((int)(dk - (dkp - 16))),
                    vtail = v16_first((int)(dv - (dvp - 16)));

    /* Pass 1a: raw dot products q_r . k_j, four keys per step, up to four rows per sweep of
     * the keys' vectors (the keys are widened in registers, once per sweep). */
    for (int64_t jj = 0; jj < nb; jj += 4) {
        const int64_t nk = nb - jj < 4 ? nb - jj : 4;
        prefetch_rows(c, mha__kv_k_row, seq, u->g, u->j0 + jj + MHA_DEC_PREFETCH, u->j1,
                      (size_t)dk * c->elem);
        const void *kr[4];
        for (int64_t x = 0; x < 4; x++)
            kr[x] = mha__kv_k_row(c, seq, u->g, u->j0 + jj + (x < nk ? x : 0));
        for (int64_t r0 = 0; r0 < R; r0 += 4) {
            const int64_t nr = R - r0 < 4 ? R - r0 : 4;
            const float *q[4];
            for (int64_t x = 0; x < 4; x++) {
                const int64_t r = r0 + (x < nr ? x : 0);
                const int64_t i = r / p->group, h = u->g * p->group + r % p->group;
                q[x] = p->q + u->s * p->q_ss + i * p->q_ts + h * dk;
            }
            float *out = S + r0 * MHA_DEC_BLOCK + jj;
            switch (nr) {
            case 4:
                dots(4, dt, kr, q, dk, dkp, ktail, nk, out);
                break;
            case 3:
                dots(3, dt, kr, q, dk, dkp, ktail, nk, out);
                break;
            case 2:
                dots(2, dt, kr, q, dk, dkp, ktail, nk, out);
                break;
            default:
                dots(1, dt, kr, q, dk, dkp, ktail, nk, out);
                break;
            }
        }
    }

    /* Pass 1b + 2, per row, vectorised over the block: score pipeline, mask, max, exp, sum. */
    const v16 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = r / p->group, h = u->g * p->group + r % p->group;
        const int64_t pos = L - p->t + i;
        /* Visible keys, relative to j0: [lo, hi] (clamped to the block). */
        int64_t hi = pos - u->j0, lo = p->window > 0 ? pos - p->window + 1 - u->j0 : 0;
        hi = hi > nb - 1 ? nb - 1 : hi;
        lo = lo < 0 ? 0 : lo;
        float *sr = S + r * MHA_DEC_BLOCK;
        const v16 scale = v16_set1(p->scale), cap = v16_set1(p->softcap);
        const v16 inv_cap = v16_set1(p->softcap > 0.0f ? 1.0f / p->softcap : 0.0f);
        const float slope = p->slopes ? p->slopes[h] : 0.0f;
        const v16 vslope = v16_set1(slope), vdist0 = v16_set1((float)(pos - u->j0));
        v16 vmax = v16_set1(-INFINITY);
        for (int64_t jj = 0; jj < nb; jj += 16) {
            const int64_t rem = nb - jj;
            const __mmask16 in = v16_first((int)(rem < 16 ? rem : 16));
            const v16 jrel = v16_add(iota, v16_set1((float)jj));
            const __mmask16 vis = in & _mm512_cmp_ps_mask(jrel, v16_set1((float)lo), _CMP_GE_OQ) &
                                  _mm512_cmp_ps_mask(jrel, v16_set1((float)hi), _CMP_LE_OQ);
            v16 s = v16_mul(scale, _mm512_maskz_loadu_ps(in, sr + jj));
            if (p->softcap > 0.0f)
                s = v16_mul(cap, v16_tanh(v16_mul(s, inv_cap)));
            if (p->slopes)
                s = _mm512_fnmadd_ps(vslope, v16_sub(vdist0, jrel), s);
            s = v16_select(vis, s, v16_set1(-INFINITY));
            _mm512_mask_storeu_ps(sr + jj, in, s);
            vmax = v16_max_nan_ignoring(s, vmax);
        }
        float mr = v16_hmax(vmax);
        /* NaN scores propagate: a NaN anywhere in the row makes m NaN. */
        for (int64_t jj = lo; jj <= hi; jj++)
            if (isnan(sr[jj]))
                mr = NAN;
        m[r] = mr;
        v16 vsum = v16_zero();
        if (mr == -INFINITY) {
            memset(sr, 0, sizeof(float) * (size_t)nb);
        } else {
            const v16 vm = v16_set1(mr);
            for (int64_t jj = 0; jj < nb; jj += 16) {
                const int64_t rem = nb - jj;
                const __mmask16 in = v16_first((int)(rem < 16 ? rem : 16));
                const v16 e = _mm512_maskz_mov_ps(
                    in, v16_exp_nonpos(v16_sub(_mm512_maskz_loadu_ps(in, sr + jj), vm)));
                _mm512_mask_storeu_ps(sr + jj, in, e);
                vsum = v16_add(vsum, e);
            }
        }
        l[r] = v16_hsum(vsum);
        memset(o + r * dv, 0, sizeof(float) * (size_t)dv);
    }

    /* Pass 3: o_r += e_rj v_j, four keys (widened in registers) per pass over up to four
     * accumulator rows. */
    for (int64_t jj = 0; jj < nb; jj += 4) {
        const int64_t nk = nb - jj < 4 ? nb - jj : 4;
        prefetch_rows(c, mha__kv_v_row, seq, u->g, u->j0 + jj + MHA_DEC_PREFETCH, u->j1,
                      (size_t)dv * c->elem);
        const void *vr[4];
        for (int64_t x = 0; x < 4; x++)
            vr[x] = mha__kv_v_row(c, seq, u->g, u->j0 + jj + (x < nk ? x : 0));
        for (int64_t r0 = 0; r0 < R; r0 += 4) {
            const int64_t nr = R - r0 < 4 ? R - r0 : 4;
            float e[4][4]; /* e[row][key], 0 for keys past nk */
            int any = 0;
            for (int64_t x = 0; x < nr; x++)
                for (int64_t y = 0; y < 4; y++) {
                    e[x][y] = y < nk ? S[(r0 + x) * MHA_DEC_BLOCK + jj + y] : 0.0f;
                    any |= e[x][y] != 0.0f;
                }
            if (!any)
                continue; /* masked keys (causal tail, window head) add nothing */
            float *orow = o + r0 * dv;
            switch (nr) {
            case 4:
                axpys(4, dt, vr, e, orow, dv, dvp, vtail);
                break;
            case 3:
                axpys(3, dt, vr, e, orow, dv, dvp, vtail);
                break;
            case 2:
                axpys(2, dt, vr, e, orow, dv, dvp, vtail);
                break;
            default:
                axpys(1, dt, vr, e, orow, dv, dvp, vtail);
                break;
            }
        }
    }
}
