/* SPDX-License-Identifier: MIT */
/* decode_neon.c: the split-KV decode kernel (flash-decoding) with AArch64 Advanced SIMD (NEON)
 * intrinsics (compiled only for aarch64, where NEON is baseline).
 *
 * Same unit and contract as decode_generic.c: keys [j0, j1) of kv head g of one sequence, for all
 * R = group * t query rows that share it (every query head of the GQA group, every new token),
 * producing an unnormalised partial (o, m, l) per row that decode.c merges. K and V rows are read
 * straight from the cache (each key's row looked up once per unit: ring buffer, pages)
 * and widened in registers, 4 elements per vector: float16 with FCVTL (vcvt_f32_f16), bfloat16 by
 * a 16-bit left shift (USHLL #16). The body is instantiated per cache dtype and per number of rows
 * (a constant in the hot loops).
 *   pass 1: s_rj = q_r . k_j: 4 keys x up to 4 query rows = 16 accumulators of 4 lanes over d,
 *           each K vector loaded once for the 4 rows; the 4 keys' sums of a row are reduced into
 *           one vector by two pairwise adds (FADDP) and stored with one store
 *   pass 2: per row, vectorised over the unit's keys: scale, soft-cap (v4_tanh), ALiBi, causal /
 *           window mask (-inf), m = max, e = exp(s - m) (v4_exp_nonpos), l = sum e
 *   pass 3: o_r += e_rj v_j over blocks of MHA_DEC_SUB keys: up to 4 rows x 16 columns of o (16
 *           accumulators) held in registers across the block; the weights of 4 keys of a row are
 *           one vector and feed the by-element FMLA (no broadcasts); V vectors loaded once per
 *           row group
 * Register budget: pass 1 16 accumulators + 4 K vectors + 1 q vector; pass 3 16 accumulators +
 * 4 V vectors + 4 weight vectors: at most 24 of the 32. Rows beyond 4 (GQA groups of 8, several
 * tokens) take further row groups that reread the block's K / V rows from L1.
 * Hidden keys: a score outside the causal / window band is -inf before any arithmetic, so a NaN
 * or infinite K there changes nothing; pass 3 skips a key for a row whose weight is 0 (it does not
 * see it, or its weight underflowed), so an infinite V there cannot give 0 * inf = NaN. A NaN
 * score the row sees makes m, l and o NaN, as in the reference.
 * What limits it, by design (not measured: the aarch64 build runs under emulation here): with
 * one token per step, each K / V element is used by R FMA lanes, so for caches beyond L2 the
 * kernel is bound by memory bandwidth (Neoverse N1 ~20-25 GB/s per core, V1 ~30, Apple M ~60-100)
 * and arithmetic is cheap; in L2 (short caches), pass 1 at R = 1 runs 4 FMA chains (latency
 * 4 cycles: 1 FMLA per cycle, half of N1's peak). Units whose rows all lie in L1 / L2 benefit
 * from the next rows being fetched early: the loops prefetch MHA_DEC_PREFETCH keys ahead (the
 * K pass continues onto the first V rows), since a unit's rows are one sequential stream per pass.
 * The float32 sums are in a fixed order that does not depend on threads (bit-identical for any
 * thread count); they differ in rounding from the generic kernel's order (tolerance-tested).
 */
#if defined(__aarch64__)

#    include "kernels/arm/simd_neon.h"
#    include "kernels/registry.h"

#    include <string.h>

/* Keys per block of pass 3 (the block's V rows, 16 x d_v floats, stay in L1 across the row and
 * column groups). */
#    define MHA_DEC_SUB      16
/* Software prefetch distance in keys (0: none). */
#    define MHA_DEC_PREFETCH 16

/* 4 float16 (FCVTL) or bfloat16 (USHLL #16: the bits are the high half of a float32) values as
 * float32. */
MHA_INLINE v4 widen4(const mha_dtype DT, uint16x4_t h) {
    if (DT == MHA_DTYPE_F16)
        return vcvt_f32_f16(vreinterpret_f16_u16(h));
    return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
}

/* Elements [d, d + 4) of a cache row of type DT as float32. */
MHA_INLINE v4 load4(const mha_dtype DT, const void *row, int64_t d) {
    if (DT == MHA_DTYPE_FP8_E4M3)
        return v4_fp8_widen((const char *)row + d);
    if (DT == MHA_DTYPE_Q8_0)
        return v4_q8_widen(row, d, v4_q8_scale(row, d));
    if (DT == MHA_DTYPE_F32)
        return vld1q_f32((const float *)row + d);
    return widen4(DT, vld1_u16((const uint16_t *)row + d));
}

/* Elements [d, d + n) of a cache row (0 < n < 4), the other lanes 0, loaded lane by lane:
 * nothing past the row is read. */
MHA_INLINE v4 load4_first(const mha_dtype DT, const void *row, int64_t d, int64_t n) {
    if (DT == MHA_DTYPE_FP8_E4M3) {
        unsigned char t[4] = {0, 0, 0, 0};
        memcpy(t, (const char *)row + d, (size_t)n);
        return v4_fp8_widen(t);
    }
    if (DT == MHA_DTYPE_Q8_0) { /* (q8_0 head sizes are multiples of 32: not reached) */
        unsigned char t[MHA__Q8_BYTES] = {0};
        memcpy(t, (const char *)row + (d >> 5) * MHA__Q8_BYTES, 2 + (size_t)(d & 31) + (size_t)n);
        return v4_q8_widen(t, d & 31, v4_q8_scale(t, 0));
    }
    if (DT == MHA_DTYPE_F32)
        return v4_loadu_first((const float *)row + d, (int)n);
    const uint16_t *p = (const uint16_t *)row + d;
    uint16x4_t h = vdup_n_u16(0);
    if (n > 0)
        h = vld1_lane_u16(p, h, 0);
    if (n > 1)
        h = vld1_lane_u16(p + 1, h, 1);
    if (n > 2)
        h = vld1_lane_u16(p + 2, h, 2);
    return widen4(DT, h);
}

/* Rows of one unit (sequence, kv head, keys j0 .. j1-1): the row of unit key x (x < nb), looked
 * up once per unit by mha__kv_unit_rows (cache/kv_cache.h: ring wrap, pages). */
typedef struct row_stream {
    const char *const *rows;
    size_t row_bytes;
} row_stream;

MHA_INLINE const void *stream_row(const row_stream *st, int64_t x) {
    return st->rows[x];
}

MHA_INLINE void prefetch_row(const row_stream *st, int64_t x) {
    const char *row = stream_row(st, x);
    for (size_t b = 0; b < st->row_bytes; b += 64)
        __builtin_prefetch(row + b, 0, 3);
}

/* Pass 1 for NR rows (q[x], float32, row x's copy, zero-padded to a multiple of 4) and 4 keys
 * (kr[y], cache rows of type DT; keys past nk repeat a valid row): out[x * BLOCK + y] = q_x . k_y
 * for y < 4 (lanes past nk hold finite junk the caller never reads as a score). Each lane of
 * acc[x][y] sums the elements d = lane (mod 4) in increasing d; the 4 lanes are then added
 * pairwise, (l0 + l1) + (l2 + l3). */
MHA_INLINE void dots(const int NR,
                     const mha_dtype DT,
                     const void *const kr[4],
                     const float *const q[4],
                     int64_t dk,
                     float *out) {
    v4 acc[4][4];
    MHA_UNROLL
    for (int x = 0; x < NR; x++)
        acc[x][0] = acc[x][1] = acc[x][2] = acc[x][3] = v4_zero();
    const int64_t dk4 = dk & ~(int64_t)3;
    for (int64_t d = 0; d < dk4; d += 4) {
        const v4 k0 = load4(DT, kr[0], d), k1 = load4(DT, kr[1], d);
        const v4 k2 = load4(DT, kr[2], d), k3 = load4(DT, kr[3], d);
        MHA_UNROLL
        for (int x = 0; x < NR; x++) {
            const v4 qv = v4_load(q[x] + d);
            acc[x][0] = v4_fma(qv, k0, acc[x][0]);
            acc[x][1] = v4_fma(qv, k1, acc[x][1]);
            acc[x][2] = v4_fma(qv, k2, acc[x][2]);
            acc[x][3] = v4_fma(qv, k3, acc[x][3]);
        }
    }
    if (dk4 < dk) { /* head size not a multiple of 4: the last elements, zero-filled */
        const int64_t n = dk - dk4;
        const v4 k0 = load4_first(DT, kr[0], dk4, n), k1 = load4_first(DT, kr[1], dk4, n);
        const v4 k2 = load4_first(DT, kr[2], dk4, n), k3 = load4_first(DT, kr[3], dk4, n);
        MHA_UNROLL
        for (int x = 0; x < NR; x++) {
            const v4 qv = v4_load(q[x] + dk4);
            acc[x][0] = v4_fma(qv, k0, acc[x][0]);
            acc[x][1] = v4_fma(qv, k1, acc[x][1]);
            acc[x][2] = v4_fma(qv, k2, acc[x][2]);
            acc[x][3] = v4_fma(qv, k3, acc[x][3]);
        }
    }
    for (int x = 0; x < NR; x++) {
        const v4 s01 = vpaddq_f32(acc[x][0], acc[x][1]), s23 = vpaddq_f32(acc[x][2], acc[x][3]);
        v4_store(out + x * MHA_DEC_BLOCK, vpaddq_f32(s01, s23));
    }
}

/* Pass 3, one block of nkb <= MHA_DEC_SUB value rows (vr[y], cache rows of type DT), NR rows,
 * columns [c0, c0 + 16) of o (row stride dv; FULL: all 16 inside, else nc < 16 of them):
 *   o_x[c] += e_x[y] v_y[c] for y in increasing order,
 * e_x at e + x * BLOCK (the block's weights). Bit y of seen[x] says e_x[y] != 0 (NaN counts as
 * seen); a row skips the keys it does not see (their v may be infinite: 0 * inf = NaN). The
 * weights of 4 consecutive keys of a row are one vector: the by-element FMLA takes lane y % 4.
 * CHECK = 0 (a constant) says every row sees every key of the block: no per-key tests. */
MHA_INLINE void axpy_block(const int NR,
                           const mha_dtype DT,
                           const int FULL,
                           const int CHECK,
                           const void *const vr[MHA_DEC_SUB],
                           int64_t nkb,
                           const float *e,
                           const unsigned seen[4],
                           float *o,
                           int64_t dv,
                           int64_t c0,
                           int64_t nc) {
    v4 acc[4][4];
    for (int x = 0; x < NR; x++)
        for (int c = 0; c < 4; c++) {
            const int64_t left = FULL ? 4 : nc - 4 * c;
            acc[x][c] = FULL || left >= 4 ? v4_loadu(o + x * dv + c0 + 4 * c)
                        : left > 0        ? v4_loadu_first(o + x * dv + c0 + 4 * c, (int)left)
                                          : v4_zero();
        }
    unsigned any = 0, all = ~0u;
    for (int x = 0; x < NR; x++) {
        any |= seen[x];
        all &= seen[x];
    }
    for (int64_t y0 = 0; y0 < nkb; y0 += 4) {
        v4 ev[4];
        for (int x = 0; x < NR; x++)
            ev[x] = v4_loadu(e + x * MHA_DEC_BLOCK + y0);
/* Key y0 + LANE: skipped when no row sees it; rows that do not see it skip it. */
#    define KEY_(LANE)                                                                             \
        do {                                                                                       \
            const int64_t y = y0 + (LANE);                                                         \
            const unsigned bit = 1u << y;                                                          \
            if (y < nkb && (!CHECK || (any & bit))) {                                              \
                v4 v[4];                                                                           \
                for (int c = 0; c < 4; c++) {                                                      \
                    const int64_t left = FULL ? 4 : nc - 4 * c;                                    \
                    v[c] = FULL || left >= 4 ? load4(DT, vr[y], c0 + 4 * c)                        \
                           : left > 0        ? load4_first(DT, vr[y], c0 + 4 * c, left)            \
                                             : v4_zero();                                                 \
                }                                                                                  \
                for (int x = 0; x < NR; x++) {                                                     \
                    if (CHECK && !(all & bit) && !(seen[x] & bit))                                 \
                        continue;                                                                  \
                    for (int c = 0; c < 4; c++)                                                    \
                        acc[x][c] = v4_fma_lane(v[c], ev[x], LANE, acc[x][c]);                     \
                }                                                                                  \
            }                                                                                      \
        } while (0)
        KEY_(0);
        KEY_(1);
        KEY_(2);
        KEY_(3);
#    undef KEY_
    }
    for (int x = 0; x < NR; x++)
        for (int c = 0; c < 4; c++) {
            const int64_t left = FULL ? 4 : nc - 4 * c;
            if (FULL || left >= 4)
                v4_store(o + x * dv + c0 + 4 * c, acc[x][c]);
            else if (left > 0)
                v4_storeu_first(o + x * dv + c0 + 4 * c, (int)left, acc[x][c]);
        }
}

/* Pass 1 for a unit of nb keys (rows ks, logical keys j0 + y) and R query rows (qbuf, row r at
 * qbuf + r dkp): S[r][y] = q_r . k_y. For each group of 4 keys, every group of up to 4 rows (the
 * K rows stay in L1 between them). The prefetch runs MHA_DEC_PREFETCH keys ahead on the K rows,
 * then on the first V rows (pass 3 reads them next). */
MHA_INLINE void scores(const mha_dtype DT,
                       const row_stream *ks,
                       const row_stream *vs,
                       int64_t nb,
                       int64_t R,
                       const float *qbuf,
                       int64_t dkp,
                       int64_t dk,
                       float *S) {
    for (int64_t y0 = 0; y0 < nb; y0 += 4) {
        const int64_t nk = nb - y0 < 4 ? nb - y0 : 4;
        if (MHA_DEC_PREFETCH > 0)
            for (int64_t y = y0 + MHA_DEC_PREFETCH; y < y0 + MHA_DEC_PREFETCH + 4; y++) {
                if (y < nb)
                    prefetch_row(ks, y);
                else if (y - nb < nb)
                    prefetch_row(vs, y - nb);
            }
        const void *kr[4];
        for (int y = 0; y < 4; y++)
            kr[y] = stream_row(ks, y0 + (y < nk ? y : 0));
        for (int64_t r0 = 0; r0 < R; r0 += 4) {
            const int64_t nr = R - r0 < 4 ? R - r0 : 4;
            const float *q[4];
            for (int64_t x = 0; x < 4; x++)
                q[x] = qbuf + (r0 + (x < nr ? x : 0)) * dkp;
            float *out = S + r0 * MHA_DEC_BLOCK + y0;
            switch (nr) {
            case 4:
                dots(4, DT, kr, q, dk, out);
                break;
            case 3:
                dots(3, DT, kr, q, dk, out);
                break;
            case 2:
                dots(2, DT, kr, q, dk, out);
                break;
            default:
                dots(1, DT, kr, q, dk, out);
                break;
            }
        }
    }
}

/* Pass 3 for a unit of nb keys (value rows vs) and R rows of weights (S, row r at S + r BLOCK):
 * o_r += e_rj v_j over blocks of MHA_DEC_SUB value rows, for up to 4 rows x 16 columns of
 * accumulators held in registers across the block. */
MHA_INLINE void values(const mha_dtype DT,
                       const row_stream *vs,
                       int64_t nb,
                       int64_t R,
                       const float *S,
                       float *o,
                       int64_t dv) {
    const uint32x4_t bits = {1u, 2u, 4u, 8u};
    for (int64_t jb = 0; jb < nb; jb += MHA_DEC_SUB) {
        const int64_t nkb = nb - jb < MHA_DEC_SUB ? nb - jb : MHA_DEC_SUB;
        const void *vb[MHA_DEC_SUB];
        for (int64_t y = 0; y < MHA_DEC_SUB; y++)
            vb[y] = stream_row(vs, jb + (y < nkb ? y : 0));
        if (MHA_DEC_PREFETCH > 0)
            for (int64_t y = jb + MHA_DEC_PREFETCH; y < jb + MHA_DEC_PREFETCH + MHA_DEC_SUB; y++)
                if (y < nb)
                    prefetch_row(vs, y);
        for (int64_t r0 = 0; r0 < R; r0 += 4) {
            const int64_t nr = R - r0 < 4 ? R - r0 : 4;
            const float *e = S + r0 * MHA_DEC_BLOCK + jb;
            /* which keys of the block each row sees (e != 0; NaN counts as seen), shared by the
             * column groups */
            unsigned seen[4] = {0, 0, 0, 0};
            for (int64_t x = 0; x < nr; x++)
                for (int64_t y0 = 0; y0 < nkb; y0 += 4) {
                    const v4m nz =
                        vmvnq_u32(vceqq_f32(v4_loadu(e + x * MHA_DEC_BLOCK + y0), v4_zero()));
                    seen[x] |= vaddvq_u32(vandq_u32(nz, bits)) << y0;
                }
            const unsigned block = (1u << nkb) - 1u; /* nkb <= 16 */
            unsigned every = block;
            for (int64_t x = 0; x < nr; x++)
                every &= seen[x];
            const int check = every != block;
            float *orow = o + r0 * dv;
            for (int64_t c0 = 0; c0 < dv; c0 += 16) {
                const int full = c0 + 16 <= dv;
                const int64_t nc = full ? 16 : dv - c0;
                /* the last, partial column group always checks (one instance less) */
                switch (nr * 4 + full * 2 + (check || !full)) {
#    define AXPY_(nr_, full_, check_)                                                              \
    case nr_ * 4 + full_ * 2 + check_:                                                             \
        axpy_block(nr_, DT, full_, check_, vb, nkb, e, seen, orow, dv, c0, nc);                    \
        break;
                    // clang-format off
                AXPY_(4, 1, 0) AXPY_(4, 1, 1) AXPY_(4, 0, 1) AXPY_(3, 1, 0) AXPY_(3, 1, 1) AXPY_(3, 0, 1)
                AXPY_(2, 1, 0) AXPY_(2, 1, 1) AXPY_(2, 0, 1) AXPY_(1, 1, 0) AXPY_(1, 1, 1) AXPY_(1, 0, 1)
                    // clang-format on
#    undef AXPY_
                                default : break;
                }
            }
        }
    }
}

/* One non-inlined instance of each pass per cache dtype: each is a small function whose hot
 * loops keep their accumulators and pointers in registers (the x86 kernel measured GCC spilling
 * pointers inside the FMA loops when everything was inlined into one function). */
#    define DTYPE_FNS_(tag, dt)                                                                    \
        static __attribute__((noinline)) void scores_##tag(                                        \
            const row_stream *ks, const row_stream *vs, int64_t nb, int64_t R, const float *qbuf,  \
            int64_t dkp, int64_t dk, float *S) {                                                   \
            scores(dt, ks, vs, nb, R, qbuf, dkp, dk, S);                                           \
        }                                                                                          \
        static __attribute__((noinline)) void values_##tag(                                        \
            const row_stream *vs, int64_t nb, int64_t R, const float *S, float *o, int64_t dv) {   \
            values(dt, vs, nb, R, S, o, dv);                                                       \
        }
DTYPE_FNS_(f32, MHA_DTYPE_F32)
DTYPE_FNS_(f16, MHA_DTYPE_F16)
DTYPE_FNS_(bf16, MHA_DTYPE_BF16)
DTYPE_FNS_(q8, MHA_DTYPE_Q8_0)
DTYPE_FNS_(fp8, MHA_DTYPE_FP8_E4M3)
#    undef DTYPE_FNS_

void mha_decode_f32acc_splitkv__neon(const mha__dec_problem *p,
                                     const mha__dec_unit *u,
                                     float *o,
                                     float *m,
                                     float *l,
                                     float *scratch) {
    mha__dec_problem fp8p; /* fp8: the scores' scale times 2^8 k_scale (kv_cache.h) */
    if (p->cache->cfg.dtype == MHA_DTYPE_FP8_E4M3)
        p = mha__kv_fp8_problem(p, u->g, &fp8p);
    const struct mha_kv_cache *c = p->cache;
    const mha_dtype dt = c->cfg.dtype;
    const int64_t R = p->group * p->t, nb = u->j1 - u->j0, dk = p->dk, dv = p->dv;
    const int64_t seq = p->seq[u->s], L = c->len[seq];
    const int64_t dkp = (dk + 3) & ~(int64_t)3, nb4 = (nb + 3) & ~(int64_t)3;
    /* scratch: scores [R][BLOCK], then the unit's query rows [R][dkp] (zero-padded) */
    float *S = scratch, *qbuf = S + R * MHA_DEC_BLOCK;
    const char *krows[MHA_DEC_BLOCK], *vrows[MHA_DEC_BLOCK];
    mha__kv_unit_rows(c, seq, u->g, u->j0, nb, krows, vrows);
    const row_stream ks = {krows, c->k_row_bytes};
    const row_stream vs = {vrows, c->v_row_bytes};

    /* The unit's query rows, copied once: row r = i * group + gh is query head g * group + gh of
     * token i. */
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = r / p->group, h = u->g * p->group + r % p->group;
        const float *src = p->q + u->s * p->q_ss + i * p->q_ts + h * dk;
        float *dst = qbuf + r * dkp;
        memcpy(dst, src, sizeof(float) * (size_t)dk);
        for (int64_t d = dk; d < dkp; d++)
            dst[d] = 0.0f;
    }

    /* Pass 1: raw dot products. */
    if (dt == MHA_DTYPE_F16)
        scores_f16(&ks, &vs, nb, R, qbuf, dkp, dk, S);
    else if (dt == MHA_DTYPE_BF16)
        scores_bf16(&ks, &vs, nb, R, qbuf, dkp, dk, S);
    else if (dt == MHA_DTYPE_Q8_0)
        scores_q8(&ks, &vs, nb, R, qbuf, dkp, dk, S);
    else if (dt == MHA_DTYPE_FP8_E4M3)
        scores_fp8(&ks, &vs, nb, R, qbuf, dkp, dk, S);
    else
        scores_f32(&ks, &vs, nb, R, qbuf, dkp, dk, S);

    /* Pass 2, per row, vectorised over the unit's keys (nb4 of the row's BLOCK floats, all
     * written by pass 1): score pipeline, mask, max, exp, sum. */
    const float32x4_t iota = {0.0f, 1.0f, 2.0f, 3.0f};
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = r / p->group, h = u->g * p->group + r % p->group;
        const int64_t pos = mha__dec_tree_pos(p, L, i);
        /* Visible keys, relative to j0: [lo, hi] (clamped to the unit), and with a draft tree the
         * lanes mha__dec_tree_lanes allows. */
        int64_t hi = mha__dec_tree_last_key(p, L, pos) - u->j0,
                lo = mha__dec_first_key(p, pos) - u->j0;
        hi = hi > nb - 1 ? nb - 1 : hi;
        lo = lo < 0 ? 0 : lo;
        float *sr = S + r * MHA_DEC_BLOCK;
        const v4 scale = v4_set1(p->scale), cap = v4_set1(p->softcap);
        const v4 inv_cap = v4_set1(p->softcap > 0.0f ? 1.0f / p->softcap : 0.0f);
        const v4 vslope = v4_set1(p->slopes ? p->slopes[h] : 0.0f);
        const v4 vdist0 = v4_set1((float)(pos - u->j0));
        const v4 vlo = v4_set1((float)lo), vhi = v4_set1((float)hi), ninf = v4_set1(-INFINITY);
        v4 vmax = ninf;
        v4m nan_seen = vdupq_n_u32(0);
        for (int64_t jj = 0; jj < nb4; jj += 4) {
            const v4 jrel = v4_add(iota, v4_set1((float)jj));
            v4m vis = vandq_u32(vcgeq_f32(jrel, vlo), vcleq_f32(jrel, vhi));
            float shift[4] = {0, 0, 0, 0};
            if (p->tree_vis) {
                const uint32x4_t bit = {1, 2, 4, 8};
                const uint32x4_t lanes =
                    vdupq_n_u32(mha__dec_tree_lanes(p, u->s, i, L, u->j0 + jj));
                vis = vandq_u32(vis, vtstq_u32(lanes, bit));
                if (p->slopes)
                    mha__dec_tree_shift(p, L, u->j0 + jj, nb - jj < 4 ? nb - jj : 4, shift);
            }
            v4 s = v4_mul(scale, v4_load(sr + jj));
            if (p->softcap > 0.0f)
                s = v4_mul(cap, v4_tanh(v4_mul(s, inv_cap)));
            if (p->slopes) /* s - slope (pos - j), one rounding */
                s = vfmsq_f32(s, vslope, v4_sub(vdist0, jrel));
            if (p->tree_vis && p->slopes) /* a draft key's position is not its slot */
                s = vfmsq_f32(s, vslope, v4_load(shift));
            nan_seen = vorrq_u32(nan_seen, vandq_u32(vis, vmvnq_u32(vceqq_f32(s, s))));
            s = v4_select(vis, s, ninf);
            v4_store(sr + jj, s);
            vmax = v4_max_nan_ignoring(s, vmax);
        }
        /* NaN scores propagate: a NaN among the visible keys makes m NaN. */
        const float mr = vmaxvq_u32(nan_seen) ? NAN : v4_hmax(vmax);
        m[r] = mr;
        v4 vsum = v4_zero();
        if (mr == -INFINITY) {
            memset(sr, 0, sizeof(float) * (size_t)nb4);
        } else {
            const v4 vm = v4_set1(mr);
            for (int64_t jj = 0; jj < nb4; jj += 4) {
                /* lanes past nb hold -inf: e = 0 */
                const v4 e = v4_exp_nonpos(v4_sub(v4_load(sr + jj), vm));
                v4_store(sr + jj, e);
                vsum = v4_add(vsum, e);
            }
        }
        l[r] = v4_hsum(vsum);
        memset(o + r * dv, 0, sizeof(float) * (size_t)dv);
    }

    /* Pass 3: weighted values. */
    if (dt == MHA_DTYPE_F16)
        values_f16(&vs, nb, R, S, o, dv);
    else if (dt == MHA_DTYPE_BF16)
        values_bf16(&vs, nb, R, S, o, dv);
    else if (dt == MHA_DTYPE_Q8_0)
        values_q8(&vs, nb, R, S, o, dv);
    else if (dt == MHA_DTYPE_FP8_E4M3) {
        values_fp8(&vs, nb, R, S, o, dv);
        mha__kv_fp8_scale_o(c, u->g, o, R, dv);
    } else
        values_f32(&vs, nb, R, S, o, dv);
}

#endif
