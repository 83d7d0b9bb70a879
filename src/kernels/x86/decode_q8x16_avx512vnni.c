/* SPDX-License-Identifier: MIT */
/* decode_q8x16_avx512vnni.c: the split-KV decode kernel for q8_0 caches in the key-interleaved
 * order (cache/kv_cache.h, MHA__Q8X16_LANES), AVX-512 with VNNI (VPDPBUSD) and VBMI (VPERMB).
 * docs/INFERENCE.md ("A key-interleaved q8_0 layout with VNNI") has the derivation and the
 * measurements; bench/q8_interleaved_vnni.c is the prototype it follows.
 *
 * Same unit and contract as decode_generic.c: keys [j0, j1) of kv head g of one sequence, the
 * R = group * t query rows that share them, an unnormalised (o, m, l) per row. Float32 results
 * from exact integer sums, per chunk of CHUNK_GROUPS groups of 16 keys (64 keys):
 *   query   each row once per unit as Q = round(q 2^e) (|Q| <= 127 (2^16 + 2^8 + 1), e per row),
 *           split into three signed digits Q = D2 2^16 + D1 2^8 + D0 (int8)
 *   pass 1  per group and q8_0 block b of 32 elements: VPDPBUSD of the key bytes (k + 128,
 *           lanes = keys) against each digit, broadcast: three exact int32 sums per key, less
 *           128 x the digits' sum (the bias); s = sum_b scale_kb (S2 2^16 + S1 2^8 + S0) 2^-e
 *   scores  scale, soft-cap, ALiBi, masks (decode_scores_avx512.h, the AVX-512 kernel's), an
 *           online softmax: e = exp(s - m) with m the running max, o and l rescaled when a chunk
 *           raises m
 *   pass 3  per block b of dv: W = round(e_j scale_vjb 2^f_b) < 2^24 (f_b from the chunk's largest
 *           scale of block b), its three unsigned digits (VPERMB of W's bytes), VPDPBUSD against
 *           the value bytes (4 keys per dword, lanes = elements), rows in pairs;
 *           o += 2^-f_b (A2 2^16 + A1 2^8 + A0)
 * The rounding before float32 is Q's (2^-24 of max|q|) and W's (2^-25 of the chunk's largest
 * e scale per block); the integer sums are exact (no overflow: 2^19 per block in pass 1, 64 keys
 * x 255 x 128 < 2^22 in pass 3). Software prefetch (prefetch_lines): a chunk's V during its pass
 * 1, the next chunk's K (or the next unit's) during its pass 3, the prototype's phase split;
 * without it the step from memory ran 1.7x slower, and whole-unit passes (one softmax per unit)
 * 5% slower (Zen 5, docs/INFERENCE.md).
 * A unit whose scales are not finite and non-negative (the unsigned weight digits need scale >= 0;
 * appends never write negative scales, but NaN and inf keys make non-finite ones), whose query row
 * is not finite or below 2^-97, or whose scores hold a NaN runs the generic kernel instead, which
 * gives those values their float32 meaning.
 */
#include "kernels/registry.h"
#include "kernels/x86/decode_scores_avx512.h"
#include "kernels/x86/simd_avx512.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES MHA__Q8X16_LANES
/* The loops over rows, digits and key vectors unrolled whole, so that their accumulators stay in
 * registers (clang ignores GCC's pragma; without it, it kept them on the stack: 2x slower) */
#ifdef __clang__
#    define UNROLL _Pragma("clang loop unroll(full)")
#else
#    define UNROLL _Pragma("GCC unroll 16")
#endif
enum {
    CHUNK_GROUPS = 4, /* groups per chunk: 64 keys (mha__dec_scratch_floats sizes its weights) */
    MAX_GROUPS = MHA_DEC_BLOCK / LANES + MHA__KV_MAX_RUNS + 1, /* a unit's: one partial per run */
    DIGIT_ROW = 96,  /* bytes of a row's 3 digits, 1 block */
    S_PAD = 16,      /* floats before a score row */
    MAX_VBLOCKS = 16 /* q8_0 blocks of dv (d <= 512) */
};

/* A group of 16 slots a unit reads: its K and V bytes, the unit key of lane 0 (may be < 0) and
 * the lanes that are the unit's keys. */
typedef struct qgroup {
    const uint8_t *k, *v;
    int64_t key0;
    __mmask16 lanes;
} qgroup;

/* The groups of keys [j0, j0 + nb) of kv head g of sequence seq, in key order; their number. A
 * run (kv_cache.h) starts at lane (row % 16): rows of a kv head keep the slots' group alignment. */
static int unit_groups(const struct mha_kv_cache *c,
                       int64_t seq,
                       int64_t g,
                       int64_t j0,
                       int64_t nb,
                       qgroup gr[MAX_GROUPS]) {
    mha__kv_run runs[MHA__KV_MAX_RUNS];
    const int nr = mha__kv_runs(c, seq, g, j0, nb, runs);
    const int64_t kg = LANES * c->k_row_bytes, vg = LANES * c->v_row_bytes;
    int n = 0;
    for (int r = 0; r < nr; r++) {
        const int64_t lane0 = (runs[r].k - (const char *)c->k) / c->k_row_bytes % LANES;
        const uint8_t *k = (const uint8_t *)runs[r].k - lane0 * c->k_row_bytes;
        const uint8_t *v = (const uint8_t *)runs[r].v - lane0 * c->v_row_bytes;
        for (int64_t off = -lane0; off < runs[r].n && n < MAX_GROUPS; off += LANES, n++) {
            const int64_t lo = off < 0 ? -off : 0;
            const int64_t hi = runs[r].n - off < LANES ? runs[r].n - off : LANES;
            gr[n].k = k + (off + lane0) / LANES * kg;
            gr[n].v = v + (off + lane0) / LANES * vg;
            gr[n].key0 = runs[r].y0 + off;
            gr[n].lanes = (__mmask16)(v16_first((int)hi) & ~v16_first((int)lo));
        }
    }
    return n;
}

/* Lines [from, to) of 64 bytes at a into the L1 (PREFETCHT0), or into the L2 where the decode
 * kernels' prefetches fill it (l2 = p->prefetch_l2: AMD Zen 4; cpu_features.h). */
MHA_INLINE void prefetch_lines(const void *a, int64_t from, int64_t to, int l2) {
    for (int64_t ln = from; ln < to; ln++) {
        if (l2)
            _mm_prefetch((const char *)a + 64 * ln, _MM_HINT_T1);
        else
            _mm_prefetch((const char *)a + 64 * ln, _MM_HINT_T0);
    }
}

/* ---- The query's digits ------------------------------------------------------------------- */
/* Row x (< 4) of a block of 4 rows: its digits at qd + (b * 4 + x) * DIGIT_ROW, [digit p][32 d]
 * (p 0: 2^16, 1: 2^8, 2: 1), the bias correction -128 sum_d D_p at corr[(b * 4 + x) * 3 + p], the
 * factor 2^-e at *inv. Returns 0 (and the unit runs the generic kernel) for a row that is not
 * finite or so small that 2^-e would leave float32's normal range. */
static int query_digits(const float *q, int64_t dk, int x, int8_t *qd, int32_t *corr, float *inv) {
    v16 mx = v16_zero();
    for (int64_t d = 0; d < dk; d += 16)
        mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(q + d)));
    const float m = _mm512_reduce_max_ps(mx);
    if (!(m <= FLT_MAX) || (m != 0.0f && m < 0x1p-97f)) /* NaN, inf, or 2^-e would be subnormal */
        return 0;
    int E = 0;
    frexpf(m, &E);
    int e = m == 0.0f ? 0 : 23 - E;                              /* m 2^e in [2^22, 2^23) */
    if (m != 0.0f && nearbyint(ldexp((double)m, e)) > 8355711.0) /* 127 (2^16 + 2^8 + 1) */
        e--;
    *inv = ldexpf(1.0f, -e);
    const v16 ev = v16_set1((float)e);
    const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
    for (int64_t b = 0; b < dk / 32; b++) {
        __m512i sum[3] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
        int8_t *row = qd + (b * 4 + x) * DIGIT_ROW;
        for (int half = 0; half < 2; half++) {
            /* Q = D2 2^16 + D1 2^8 + D0, each digit in [-128, 127] (balanced, exact shifts) */
            const __m512i Q =
                _mm512_cvtps_epi32(_mm512_scalef_ps(_mm512_loadu_ps(q + 32 * b + 16 * half), ev));
            const __m512i d0 =
                _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(Q, c128), c255), c128);
            const __m512i q1 = _mm512_srai_epi32(_mm512_sub_epi32(Q, d0), 8);
            const __m512i d1 =
                _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(q1, c128), c255), c128);
            const __m512i d2 = _mm512_srai_epi32(_mm512_sub_epi32(q1, d1), 8);
            const __m512i dg[3] = {d2, d1, d0};
            for (int p = 0; p < 3; p++) {
                _mm_storeu_si128((__m128i *)(row + 32 * p + 16 * half),
                                 _mm512_cvtepi32_epi8(dg[p]));
                sum[p] = _mm512_add_epi32(sum[p], dg[p]);
            }
        }
        for (int p = 0; p < 3; p++)
            corr[(b * 4 + x) * 3 + p] = -128 * _mm512_reduce_add_epi32(sum[p]);
    }
    return 1;
}

/* ---- Pass 1 ------------------------------------------------------------------------------- */
/* VPDPBUSD acc, a (u8), [base + off]{1to16} (s8): the digit dword broadcast inside the
 * instruction (a separate VPBROADCASTD would cost a uop per product). GCC gets the offset as an
 * immediate (with "m" operands it hoists a block's 96 addresses into registers and spills them);
 * clang, which wants "i" operands constant before unrolling, and unoptimised builds a memory
 * operand. */
#if defined(__clang__) || !defined(__OPTIMIZE__)
#    define DPBUSD_BC(acc, a, base, off)                                                           \
        __asm__("vpdpbusd %2%{1to16%}, %1, %0"                                                     \
                : "+v"(acc)                                                                        \
                : "v"(a), "m"(*(const int32_t *)((const char *)(base) + (off))))
#else
#    define DPBUSD_BC(acc, a, base, off)                                                           \
        __asm__("vpdpbusd %c3(%2)%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "r"(base), "i"(off))
#endif

/* Scores of group kg's lanes for NR rows (a block of 4 rows' digits qd, corr, inv): stored at
 * S + x * ss + key0 (its lanes only). *bad gets the lanes whose K scale is negative or not
 * finite. */
MHA_INLINE void pass1_group(const int NR,
                            const uint8_t *kg,
                            int64_t nbk,
                            const int8_t *qd,
                            const int32_t *corr,
                            const float *inv,
                            __mmask16 lanes,
                            float *S,
                            int64_t ss,
                            int64_t key0,
                            __mmask16 *bad) {
    v16 s[4];
    UNROLL
    for (int x = 0; x < NR; x++)
        s[x] = v16_zero();
    const uint16_t *sc16 = (const uint16_t *)(kg + nbk * 512);
    for (int64_t b = 0; b < nbk; b++) {
        __m512i kc[8];
        UNROLL
        for (int j = 0; j < 8; j++)
            kc[j] = _mm512_loadu_si512(kg + b * 512 + j * 64);
        const __m256i h = _mm256_maskz_loadu_epi16(lanes, sc16 + 16 * b);
        *bad |= _mm256_mask_cmpge_epu16_mask(lanes, h, _mm256_set1_epi16(0x7C00));
        const v16 sc = _mm512_cvtph_ps(h);
        const int8_t *qb = qd + b * 4 * DIGIT_ROW;
        __m512i a[4][3];
        UNROLL
        for (int x = 0; x < NR; x++)
            UNROLL
        for (int p = 0; p < 3; p++)
            a[x][p] = _mm512_set1_epi32(corr[(b * 4 + x) * 3 + p]);
        UNROLL
        for (int j = 0; j < 8; j++)
            UNROLL
        for (int x = 0; x < NR; x++)
            UNROLL
        for (int p = 0; p < 3; p++)
            DPBUSD_BC(a[x][p], kc[j], qb, x * DIGIT_ROW + 32 * p + 4 * j);
        UNROLL
        for (int x = 0; x < NR; x++) {
            const __m512i ml = _mm512_add_epi32(_mm512_slli_epi32(a[x][1], 8), a[x][2]);
            const v16 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[x][0]), v16_set1(65536.0f),
                                          _mm512_cvtepi32_ps(ml));
            s[x] = _mm512_fmadd_ps(t, sc, s[x]);
        }
    }
    /* masked stores are slow on AMD Zen: whole groups take plain ones */
    UNROLL
    for (int x = 0; x < NR; x++) {
        const v16 sx = v16_mul(s[x], v16_set1(inv[x]));
        if (lanes == 0xFFFF)
            _mm512_storeu_ps(S + x * ss + key0, sx);
        else
            _mm512_mask_storeu_ps(S + x * ss + key0, lanes, sx);
    }
}

/* ---- The online softmax of a chunk -------------------------------------------------------- */
/* Keys [a, e) of the unit, every row r: scores in place of the dot products, then weights
 * exp(s - m_r) with m_r the running max; when the chunk raises m_r, o_r and the row's sum vector
 * lv_r (its 16 lanes summed into l_r at the unit's end) are rescaled by exp(m_old - m_new).
 * Rows that see every key of the chunk with no soft-cap, ALiBi or draft tree take the scores as
 * scale q . k (dec_score16's result on them, without its masks). Returns 0 when a visible score
 * is NaN (the unit then runs the generic kernel, which propagates it). */
static int chunk_softmax(const mha__dec_problem *p,
                         const mha__dec_unit *u,
                         int64_t R,
                         int64_t nb,
                         int64_t L,
                         int64_t a,
                         int64_t e,
                         float *S,
                         int64_t ss,
                         float *o,
                         float *m,
                         v16 *lv) {
    const int64_t dv = p->dv;
    const int plain = !p->tree_vis && !p->slopes && !(p->softcap > 0.0f);
    for (int64_t r = 0; r < R; r++) {
        const dec_row w = dec_row_of(p, u, r, nb, L);
        float *sr = S + r * ss;
        v16 vmax = v16_set1(-INFINITY);
        __mmask16 nan_seen = 0;
        if (plain && w.lo <= a && w.hi >= e - 1) {
            const v16 scale = v16_set1(p->scale);
            for (int64_t jj = a; jj < e; jj += 16) {
                const __mmask16 in = v16_first((int)(e - jj < 16 ? e - jj : 16));
                const v16 s = _mm512_mask_mul_ps(v16_set1(-INFINITY), in, scale,
                                                 _mm512_maskz_loadu_ps(in, sr + jj));
                nan_seen |= _mm512_mask_cmp_ps_mask(in, s, s, _CMP_UNORD_Q);
                _mm512_storeu_ps(sr + jj, s);
                vmax = v16_max_nan_ignoring(s, vmax);
            }
        } else {
            for (int64_t jj = a; jj < e; jj += 16) {
                const v16 s = dec_score16(p, u, &w, L, jj, e, sr, &nan_seen);
                _mm512_storeu_ps(sr + jj, s); /* -inf past e, within the rows' padding */
                vmax = v16_max_nan_ignoring(s, vmax);
            }
        }
        if (nan_seen)
            return 0;
        const float mc = v16_hmax(vmax), m0 = m[r];
        if (mc > m0) {
            const v16 alpha = v16_set1(m0 == -INFINITY ? 0.0f : expf(m0 - mc));
            for (int64_t d = 0; d < dv; d += 16)
                _mm512_storeu_ps(o + r * dv + d, v16_mul(alpha, _mm512_loadu_ps(o + r * dv + d)));
            lv[r] = v16_mul(alpha, lv[r]);
            m[r] = mc;
        }
        const float mr = m[r];
        if (mr == -INFINITY) {
            for (int64_t jj = a; jj < e; jj += 16)
                _mm512_storeu_ps(sr + jj, v16_zero());
            continue;
        }
        const v16 vm = v16_set1(mr);
        v16 vsum = lv[r];
        for (int64_t jj = a; jj < e; jj += 16) {
            const __mmask16 in = v16_first((int)(e - jj < 16 ? e - jj : 16));
            const v16 ex = _mm512_maskz_mov_ps(
                in, v16_exp_nonpos(v16_sub(_mm512_maskz_loadu_ps(in, sr + jj), vm)));
            _mm512_storeu_ps(sr + jj, ex); /* 0 past e */
            vsum = v16_add(vsum, ex);
        }
        lv[r] = vsum;
    }
    return 1;
}

/* ---- Pass 3 ------------------------------------------------------------------------------- */
/* VPERMB order: bytes 2, 1, 0 of 16 int32 W (the 2^16, 2^8 and 1 digits of 16 keys), byte 3 */
static const uint8_t digit_perm[64] = {
    2,  6,  10, 14, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58, 62, 1,  5,  9,  13, 17, 21,
    25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 0,  4,  8,  12, 16, 20, 24, 28, 32, 36, 40, 44,
    48, 52, 56, 60, 3,  7,  11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63};

/* Block b's scale exponents over the chunk's groups: f = 2^(24 - E) with 2^(E-1) <= the largest
 * V scale < 2^E, and its inverse; *bad gets lanes whose scale is negative or not finite. */
static void chunk_exponents(
    const qgroup *gr, int ng, int64_t nbv, int64_t voff, float *f, float *finv, __mmask16 *bad) {
    for (int64_t b = 0; b < nbv; b++) {
        v16 mx = v16_zero();
        for (int i = 0; i < ng; i++) {
            const __m256i h =
                _mm256_maskz_loadu_epi16(gr[i].lanes, (const uint16_t *)(gr[i].v + voff) + 16 * b);
            *bad |= _mm256_mask_cmpge_epu16_mask(gr[i].lanes, h, _mm256_set1_epi16(0x7C00));
            mx = _mm512_max_ps(mx, _mm512_cvtph_ps(h));
        }
        const float m = _mm512_reduce_max_ps(mx);
        uint32_t mb;
        memcpy(&mb, &m, 4);
        const int E = m > 0.0f ? (int)(mb >> 23) - 126 : 0;
        const uint32_t fb = (uint32_t)(127 + 24 - E) << 23, ib = (uint32_t)(127 - 24 + E) << 23;
        memcpy(&f[b], &fb, 4);
        memcpy(&finv[b], &ib, 4);
    }
}

/* The weight digits of NR rows (scores rows S + x ss) for the chunk's groups: at
 * wbuf + ((i * 4 + x) nbv + b) 64, [16 keys' 2^16 digits][2^8][1][unused] */
MHA_INLINE void build_weights(const int NR,
                              const qgroup *gr,
                              int ng,
                              int64_t nbv,
                              int64_t voff,
                              const float *S,
                              int64_t ss,
                              const float *f,
                              uint8_t *wbuf) {
    const __m512i idx = _mm512_loadu_si512(digit_perm), wmax = _mm512_set1_epi32(0xFFFFFF);
    for (int i = 0; i < ng; i++) {
        for (int64_t b = 0; b < nbv; b++) {
            const __m256i h =
                _mm256_maskz_loadu_epi16(gr[i].lanes, (const uint16_t *)(gr[i].v + voff) + 16 * b);
            const v16 sc = v16_mul(_mm512_cvtph_ps(h), v16_set1(f[b]));
            UNROLL
            for (int x = 0; x < NR; x++) {
                const v16 e = _mm512_maskz_loadu_ps(gr[i].lanes, S + x * ss + gr[i].key0);
                const __m512i W = _mm512_min_epi32(_mm512_cvtps_epi32(v16_mul(e, sc)), wmax);
                _mm512_storeu_si512(wbuf + ((i * 4 + x) * nbv + b) * 64,
                                    _mm512_permutexvar_epi8(idx, W));
            }
        }
    }
}

/* The K groups pass 3 prefetches (the next chunk's or the next unit's first ones): lines
 * [b per, (b + 1) per) of group i during block b's sweep, at group i; l2 as prefetch_lines. */
typedef struct k_prefetch {
    const qgroup *k;
    int n, l2;
    int64_t per, lines;
} k_prefetch;

/* o[x][32 b .. + 31] += 2^-f_b (A2 2^16 + A1 2^8 + A0) for NR rows, one block b of dv, over the
 * chunk's groups: per 4 keys, their 2 value vectors (32 elements x 4 keys) against the weight
 * digit dwords, broadcast; pf (NULL: none) prefetched meanwhile. */
MHA_INLINE void pass3_block(const int NR,
                            const qgroup *gr,
                            int ng,
                            int64_t b,
                            int64_t nbv,
                            int64_t dv,
                            const uint8_t *wbuf,
                            float finv,
                            float *o,
                            const k_prefetch *pf) {
    __m512i acc[4][3][2];
    UNROLL
    for (int x = 0; x < NR; x++)
        UNROLL
    for (int p = 0; p < 3; p++)
        acc[x][p][0] = acc[x][p][1] = _mm512_setzero_si512();
    for (int i = 0; i < ng; i++) {
        if (pf && i < pf->n) {
            const int64_t end = (b + 1) * pf->per;
            prefetch_lines(pf->k[i].k, b * pf->per, end < pf->lines ? end : pf->lines, pf->l2);
        }
        UNROLL
        for (int g4 = 0; g4 < 4; g4++) {
            const uint8_t *vp = gr[i].v + g4 * 4 * dv + b * 128;
            const __m512i v0 = _mm512_loadu_si512(vp), v1 = _mm512_loadu_si512(vp + 64);
            UNROLL
            for (int x = 0; x < NR; x++) {
                const uint8_t *w = wbuf + ((i * 4 + x) * nbv + b) * 64 + 4 * g4;
                UNROLL
                for (int p = 0; p < 3; p++) {
                    int32_t wd;
                    memcpy(&wd, w + 16 * p, 4);
                    const __m512i wb = _mm512_set1_epi32(wd);
                    acc[x][p][0] = _mm512_dpbusd_epi32(acc[x][p][0], wb, v0);
                    acc[x][p][1] = _mm512_dpbusd_epi32(acc[x][p][1], wb, v1);
                }
            }
        }
    }
    UNROLL
    for (int x = 0; x < NR; x++)
        UNROLL
    for (int hf = 0; hf < 2; hf++) {
        const v16 t =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[x][0][hf]), v16_set1(65536.0f),
                            _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[x][1][hf]), v16_set1(256.0f),
                                            _mm512_cvtepi32_ps(acc[x][2][hf])));
        float *op = o + x * dv + 32 * b + 16 * hf;
        _mm512_storeu_ps(op, _mm512_fmadd_ps(t, v16_set1(finv), _mm512_loadu_ps(op)));
    }
}

/* Pass 3 of a chunk for NR rows (scores rows S + x ss, output rows o + x dv). */
MHA_INLINE void pass3_rows(const int NR,
                           const qgroup *gr,
                           int ng,
                           int64_t nbv,
                           int64_t dv,
                           int64_t voff,
                           const float *S,
                           int64_t ss,
                           const float *f,
                           const float *finv,
                           uint8_t *wbuf,
                           float *o,
                           const k_prefetch *pf) {
    build_weights(NR, gr, ng, nbv, voff, S, ss, f, wbuf);
    /* rows in pairs: 12 accumulators (4 rows' 24 and the operands spilled from the 32 registers:
     * 1.1x slower) */
    for (int64_t b = 0; b < nbv; b++) {
        for (int x0 = 0; x0 + 1 < NR; x0 += 2)
            pass3_block(2, gr, ng, b, nbv, dv, wbuf + x0 * nbv * 64, finv[b], o + x0 * dv,
                        x0 == 0 ? pf : NULL);
        if (NR % 2)
            pass3_block(1, gr, ng, b, nbv, dv, wbuf + (NR - 1) * nbv * 64, finv[b],
                        o + (NR - 1) * dv, NR == 1 ? pf : NULL);
    }
}

/* The unit's query rows' digits, per block of 4 rows; 0 if a row needs the generic kernel. */
static int unit_digits(const mha__dec_problem *p,
                       const mha__dec_unit *u,
                       int64_t R,
                       int8_t *qd,
                       int32_t *corr,
                       float *inv) {
    const int64_t dk = p->dk, nbk = dk / 32;
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = r / p->group, h = u->g * p->group + r % p->group;
        const float *q = p->q + u->s * p->q_ss + i * p->q_ts + h * dk;
        if (!query_digits(q, dk, (int)(r % 4), qd + r / 4 * nbk * 4 * DIGIT_ROW,
                          corr + r / 4 * nbk * 12, inv + r))
            return 0;
    }
    return 1;
}

/* The unit's scratch (mha__dec_scratch_floats): scores [R][ss], each row S_PAD floats after its
 * start (a group's lane 0 may lie before the unit's first key); 2^-e, the digits' corrections
 * and the digits per block of 4 rows; a chunk's weight digits (room for MAX_VBLOCKS); the rows'
 * sum vectors. */
typedef struct unit_scratch {
    v16 *lv; /* [R] the rows' softmax sums, 16 lanes each */
    float *S, *inv;
    int32_t *corr;
    int8_t *qd;
    uint8_t *wbuf;
    int64_t ss;
} unit_scratch;

static unit_scratch unit_scratch_of(float *scratch, int64_t R, int64_t nbk) {
    const int64_t R4 = (R + 3) / 4;
    unit_scratch w;
    w.ss = MHA_DEC_BLOCK + 2 * S_PAD;
    w.S = scratch + S_PAD;
    w.inv = scratch + R * w.ss;
    w.corr = (int32_t *)(w.inv + 4 * R4);
    w.qd = (int8_t *)(w.corr + R4 * nbk * 12);
    w.wbuf = (uint8_t *)w.qd + R4 * nbk * 4 * DIGIT_ROW;
    const uintptr_t end = (uintptr_t)(w.wbuf + CHUNK_GROUPS * 4 * MAX_VBLOCKS * 64);
    w.lv = (v16 *)((end + 63) & ~(uintptr_t)63); /* vectors: 64-byte aligned */
    return w;
}

/* The groups of the first 64 keys after the unit's (this pair's next keys, else those of the
 * unit this thread takes next); how many of them to prefetch (<= CHUNK_GROUPS). */
static int next_groups(const mha__dec_problem *p, const mha__dec_unit *u, qgroup nx[MAX_GROUPS]) {
    const int64_t seq = p->seq[u->s], L = p->cache->len[seq];
    const mha__dec_unit *nu = L > u->j1 ? NULL : u->next;
    const int64_t nseq = nu ? p->seq[nu->s] : seq, nj = nu ? nu->j0 : u->j1, nend = nu ? nu->j1 : L,
                  nn = nend - nj < 64 ? nend - nj : 64;
    const int n = nn > 0 ? unit_groups(p->cache, nseq, nu ? nu->g : u->g, nj, nn, nx) : 0;
    return n < CHUNK_GROUPS ? n : CHUNK_GROUPS;
}

/* Pass 1 of a chunk's cn groups, every row; their V prefetched meanwhile. */
static void chunk_pass1(const mha__dec_problem *p,
                        const qgroup *cg,
                        int cn,
                        int64_t R,
                        const unit_scratch *w,
                        __mmask16 *bad) {
    const int64_t nbk = p->dk / 32, R4 = (R + 3) / 4;
    const int64_t vlines = LANES * p->cache->v_row_bytes / 64;
    for (int i = 0; i < cn; i++) {
        prefetch_lines(cg[i].v, 0, vlines, p->prefetch_l2);
        for (int64_t rb = 0; rb < R4; rb++) {
            const int nr = (int)(R - 4 * rb < 4 ? R - 4 * rb : 4);
            const int8_t *qb = w->qd + rb * nbk * 4 * DIGIT_ROW;
            const int32_t *cb = w->corr + rb * nbk * 12;
            float *Sb = w->S + 4 * rb * w->ss, *inv = w->inv + 4 * rb;
#define PASS1_(n_)                                                                                 \
    case n_:                                                                                       \
        pass1_group(n_, cg[i].k, nbk, qb, cb, inv, cg[i].lanes, Sb, w->ss, cg[i].key0, bad);       \
        break;
            switch (nr) { PASS1_(1) PASS1_(2) PASS1_(3) PASS1_(4) }
#undef PASS1_
        }
    }
}

/* Pass 3 of a chunk's cn groups, every row (weights e in the scores rows); pf prefetched
 * meanwhile. */
static void chunk_pass3(const mha__dec_problem *p,
                        const qgroup *cg,
                        int cn,
                        int64_t R,
                        const unit_scratch *w,
                        const float *f,
                        const float *finv,
                        float *o,
                        const k_prefetch *pf) {
    const int64_t nbv = p->dv / 32, dv = p->dv, voff = LANES * dv;
    for (int64_t rb = 0; rb < (R + 3) / 4; rb++) {
        const int nr = (int)(R - 4 * rb < 4 ? R - 4 * rb : 4);
        const float *Sb = w->S + 4 * rb * w->ss;
        float *ob = o + 4 * rb * dv;
        const k_prefetch *pr = rb == 0 ? pf : NULL;
#define PASS3_(n_)                                                                                 \
    case n_:                                                                                       \
        pass3_rows(n_, cg, cn, nbv, dv, voff, Sb, w->ss, f, finv, w->wbuf, ob, pr);                \
        break;
        switch (nr) { PASS3_(1) PASS3_(2) PASS3_(3) PASS3_(4) }
#undef PASS3_
    }
}

/* The unit's passes; 0 when it must run the generic kernel instead (see the top). */
static int q8x16_unit(const mha__dec_problem *p,
                      const mha__dec_unit *u,
                      float *o,
                      float *m,
                      float *l,
                      float *scratch) {
    const struct mha_kv_cache *c = p->cache;
    const int64_t R = p->group * p->t, nb = u->j1 - u->j0, dv = p->dv, nbv = dv / 32;
    const int64_t seq = p->seq[u->s], L = c->len[seq];
    const int64_t klines = LANES * c->k_row_bytes / 64;
    if (nbv > MAX_VBLOCKS)
        return 0;
    const unit_scratch w = unit_scratch_of(scratch, R, p->dk / 32);
    if (!unit_digits(p, u, R, w.qd, w.corr, w.inv))
        return 0;
    qgroup gr[MAX_GROUPS], nx[MAX_GROUPS];
    const int ng = unit_groups(c, seq, u->g, u->j0, nb, gr), nnx = next_groups(p, u, nx);
    for (int64_t r = 0; r < R; r++) {
        m[r] = -INFINITY;
        w.lv[r] = v16_zero();
        memset(o + r * dv, 0, sizeof(float) * (size_t)dv);
    }
    __mmask16 bad = 0;
    for (int c0 = 0; c0 < ng; c0 += CHUNK_GROUPS) {
        const qgroup *cg = gr + c0;
        const int cn = ng - c0 < CHUNK_GROUPS ? ng - c0 : CHUNK_GROUPS;
        chunk_pass1(p, cg, cn, R, &w, &bad);
        /* the chunk's keys [a, e) of the unit: its first group's first lane to its last's last */
        const int64_t a = cg[0].key0 + __builtin_ctz(cg[0].lanes);
        const int64_t e = cg[cn - 1].key0 + 16 - __builtin_clz((unsigned)cg[cn - 1].lanes << 16);
        if (bad || !chunk_softmax(p, u, R, nb, L, a, e, w.S, w.ss, o, m, w.lv))
            return 0;
        float f[MAX_VBLOCKS], finv[MAX_VBLOCKS];
        chunk_exponents(cg, cn, nbv, LANES * dv, f, finv, &bad);
        if (bad)
            return 0;
        /* the next chunk's K, or the next unit's, prefetched during this chunk's pass 3 */
        const int more = ng - c0 - cn;
        const k_prefetch pf = {more > 0 ? cg + cn : nx,
                               more > 0 ? (more < CHUNK_GROUPS ? more : CHUNK_GROUPS) : nnx,
                               p->prefetch_l2, (klines + nbv - 1) / nbv, klines};
        chunk_pass3(p, cg, cn, R, &w, f, finv, o, &pf);
    }
    for (int64_t r = 0; r < R; r++)
        l[r] = v16_hsum(w.lv[r]);
    return 1;
}

void mha_decode_q8x16_splitkv__avx512(const mha__dec_problem *p,
                                      const mha__dec_unit *u,
                                      float *o,
                                      float *m,
                                      float *l,
                                      float *scratch) {
    if (!q8x16_unit(p, u, o, m, l, scratch))
        mha_decode_f32acc_splitkv__generic(p, u, o, m, l, scratch);
}
