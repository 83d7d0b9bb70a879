/* SPDX-License-Identifier: MIT */
/* flash_fwd.c: the ISA-independent driver of the FlashAttention-2 forward (flash_fwd.h).
 *
 * Plain C, compiled for the baseline ISA. It owns everything that is not arithmetic on tiles:
 * which key tiles a query block can see (causal and window bands: tiles outside are never
 * touched), visibility bits from the boolean rules, additive bias rows (float mask + ALiBi),
 * dropout keep bits (the same Philox decisions as the reference), the exact path for value tiles
 * holding Inf/NaN, the final normalisation (sinks, fully masked rows, lse) and the probabilities
 * pass. The per-ISA tile operations do the O(R * Bk * d) work; what runs here is O(R * Bk) per
 * tile, and only when the problem has that feature.
 */
#include "kernels/flash_fwd.h"

#include <string.h>

/* ---------------------------------------------------------------------------------------------- */
/* Scratch layout.                                                                                */
/* ---------------------------------------------------------------------------------------------- */

/* K^T and V cache: when every packed key tile of one kv head (K^T [dk][Bk] and V [Bk][ldv])
 * fits in MHA_FLASH_KT_CACHE_BYTES, a thread packs each tile once per (b, g) and reuses it for all
 * the query blocks it runs on that head (consecutive units share (b, g)); otherwise one tile is
 * packed at a time. The tile state (packed, V finite) lives next to it. Measured: packing K was
 * 7% (d = 64) to 11% (d = 128) of the time at n = 2048 with per-block packing. V is packed
 * because its rows sit h*d floats apart in the layer's [B, L, heads, d] layout: at d_model = 1024
 * that is 4 KiB, so the 64 rows of a tile fall into the same few L1 sets and evict each other
 * while the block's row groups reread them (perf: O += P V took 30% longer than S = Q K^T on the
 * same flop count; packed, they match). The cap bounds the workspace (it is per thread) to 8 MiB
 * per thread (m = 8192 keys at d = 128); beyond it the packed tiles would not stay in cache
 * anyway. With a chunk size C < m a block's keys span at most mha__flash_key_span(m, C, causal)
 * keys (C + Bq causal, 2C + Bq otherwise), so the cache holds a window of that many tiles,
 * [base, base + ntiles), moved (and emptied) when a block's tiles leave it: a chunked call at
 * m = 32768, C = 8192 packs each chunk's tiles once per thread, as four 8192-long calls do. */
#define MHA_FLASH_KT_CACHE_BYTES ((int64_t)8 << 20)
enum { TILE_PACKED = 1, TILE_FINITE_KNOWN = 2, TILE_FINITE = 4, TILE_V_PACKED = 8 };

typedef struct cache_header {
    int64_t b, g; /* the kv head whose tiles the cache holds; -1 = none */
    int64_t base; /* its first tile (tile t lives at t - base) */
} cache_header;

typedef struct flash_layout {
    size_t kt, vt, kw, qp, s, o, o_main, l_main, beta, m, l, alpha, mu, inv_l, bias, vis, keep,
        header, state, total;
    int64_t ldo, ntiles; /* ldo: row stride of O and of the packed V tiles */
    int cached;
} flash_layout;

static bool carve(size_t *cursor, int64_t count, size_t elem, size_t *off) {
    size_t bytes;
    if (!mha__bytes(count, elem, &bytes) || bytes > SIZE_MAX - 64 - *cursor)
        return false;
    *off = *cursor;
    *cursor += (bytes + 63) & ~(size_t)63;
    return true;
}

/* widen_k: K is not float32, and each tile's rows are widened into kw ([Bk][dk]) before the
 * ISA's pack_kt transposes them. */
static bool flash_layout_for(
    int bq, int bk, int64_t dk, int64_t dv, int64_t m, int64_t span, int widen_k, flash_layout *L) {
    size_t c = 0;
    int64_t kt_n, vt_n, qp_n, s_n, o_n, kv_all, kt_all = 0, vt_all = 0;
    L->ldo = (dv + 15) / 16 * 16;
    L->ntiles = (m + bk - 1) / bk;
    if (span < m && (span + bk - 1) / bk + 1 < L->ntiles) /* a window: + 1 for an unaligned lo */
        L->ntiles = (span + bk - 1) / bk + 1;
    if (!mha__mul_i64(dk, bk, &kt_n) || !mha__mul_i64(bk, L->ldo, &vt_n) ||
        !mha__mul_i64(bq, bk, &s_n) || !mha__mul_i64(bq, L->ldo, &o_n) ||
        !mha__mul_i64(bq, dk, &qp_n))
        return false;
    L->cached = mha__mul_i64(kt_n, L->ntiles, &kt_all) && mha__mul_i64(vt_n, L->ntiles, &vt_all) &&
                mha__add_i64(kt_all, vt_all, &kv_all) && kv_all <= MHA_FLASH_KT_CACHE_BYTES / 4;
    if (L->cached)
        kt_n = kt_all, vt_n = vt_all;
    return carve(&c, kt_n, sizeof(float), &L->kt) && carve(&c, vt_n, sizeof(float), &L->vt) &&
           carve(&c, widen_k ? (int64_t)bk * dk : 0, sizeof(float), &L->kw) &&
           carve(&c, qp_n, sizeof(float), &L->qp) && carve(&c, s_n, sizeof(float), &L->s) &&
           carve(&c, o_n, sizeof(float), &L->o) && carve(&c, o_n, sizeof(float), &L->o_main) &&
           carve(&c, bq, sizeof(float), &L->l_main) && carve(&c, bq, sizeof(float), &L->beta) &&
           carve(&c, bq, sizeof(float), &L->m) && carve(&c, bq, sizeof(float), &L->l) &&
           carve(&c, bq, sizeof(float), &L->alpha) && carve(&c, bq, sizeof(float), &L->mu) &&
           carve(&c, bq, sizeof(float), &L->inv_l) && carve(&c, s_n, sizeof(float), &L->bias) &&
           carve(&c, (int64_t)bq * MHA_FLASH_WORDS, sizeof(uint64_t), &L->vis) &&
           carve(&c, (int64_t)bq * MHA_FLASH_WORDS, sizeof(uint64_t), &L->keep) &&
           carve(&c, 1, sizeof(cache_header), &L->header) &&
           carve(&c, L->cached ? L->ntiles : 1, 1, &L->state) && ((L->total = c), true);
}

bool mha__flash_scratch_bytes(
    int bq, int bk, int64_t dk, int64_t dv, int64_t m, int64_t span, int widen_k, size_t *bytes) {
    flash_layout L;
    if (!flash_layout_for(bq, bk, dk, dv, m, span, widen_k, &L))
        return false;
    *bytes = L.total;
    return true;
}

void mha__flash_unit_keys(const mha__problem *p,
                          int64_t b,
                          int64_t h0,
                          int64_t h1,
                          int64_t i0,
                          int64_t i1,
                          int64_t *lo,
                          int64_t *hi) {
    int64_t hi0, lo1;
    mha__flash_key_range(p, b, i0, lo, &hi0);
    mha__flash_key_range(p, b, i1 - 1, &lo1, hi);
    /* lo and hi grow with i, so the band's union is [lo(i0), hi(i1 - 1)]. */
    const mha__mask_map *mm = p->map;
    if (!mm || *lo > *hi)
        return;
    int64_t first = INT64_MAX, last = -1;
    for (int64_t h = h0; h < (mm->span_h ? h1 : h0 + 1); h++)
        for (int64_t i = i0; i < (mm->span_i ? i1 : i0 + 1); i++) {
            int64_t f, l;
            mha__map_span(mm, b, h, i, &f, &l);
            if (f <= l) {
                first = f < first ? f : first;
                last = l > last ? l : last;
            }
        }
    *lo = first > *lo ? first : *lo;
    *hi = last < *hi ? last : *hi;
}

int64_t mha__flash_visible_tiles(
    const mha__problem *p, int64_t b, int64_t h0, int64_t h1, int64_t i0, int64_t i1, int bk) {
    int64_t lo, hi;
    mha__flash_unit_keys(p, b, h0, h1, i0, i1, &lo, &hi);
    return lo > hi ? 0 : hi / bk - lo / bk + 1;
}

/* ---------------------------------------------------------------------------------------------- */
/* The state of one query block.                                                                  */
/* ---------------------------------------------------------------------------------------------- */

typedef struct block {
    const mha__flash_softmax_ops *sm;
    const mha__flash_tile_ops *tile;
    const mha__problem *p;
    int bq, bk;
    int64_t b, g, h0, nh, i0, nq, R;
    const void *kb, *vb;           /* K and V of (b, g), of dtypes p->k_dt and p->v_dt */
    float *o_main, *l_main, *beta; /* blocked accumulation over long rows (fold_partial) */
    float *kt, *vt, *kw, *s, *o, *m, *l, *alpha, *mu, *inv_l, *bias;
    void *qp; /* the block's Q rows, [R][ldq] of the tile dtype (flash_fwd.h) */
    uint64_t *vis, *keep;
    int64_t ldo, ldq;
    int cached;            /* this block reads and fills the cache */
    int cache_on;          /* the layout has one (ctiles tiles at hdr->base) */
    int64_t ctiles, cbase; /* its tiles; the block's copy of hdr->base */
    struct cache_header *hdr;
    uint8_t *state; /* per tile, when cached: tile t at state[t - cbase] */
    int need_bias;  /* the current tile's additive mask is not all 0 (build_vis) */
} block;

/* Bits [a, b] (lanes, clipped to [0, nk - 1]) set, others clear. */
static void range_bits(uint64_t *w, int64_t a, int64_t b, int nk) {
    for (int k = 0; k < MHA_FLASH_WORDS; k++)
        w[k] = 0;
    if (a < 0)
        a = 0;
    if (b > nk - 1)
        b = nk - 1;
    for (int k = 0; k < MHA_FLASH_WORDS && a <= b; k++) {
        const int64_t wlo = 64 * (int64_t)k, whi = wlo + 63;
        const int64_t s = a > wlo ? a : wlo, e = b < whi ? b : whi;
        if (s > e)
            continue;
        const int64_t width = e - s + 1;
        const uint64_t ones = width == 64 ? ~(uint64_t)0 : (((uint64_t)1 << width) - 1);
        w[k] = ones << (s - wlo);
    }
}

static int bits_any(const uint64_t *w) {
    uint64_t x = 0;
    for (int k = 0; k < MHA_FLASH_WORDS; k++)
        x |= w[k];
    return x != 0;
}

/* build_vis for a tile inside the band of every row, of at most 64 keys (the SIMD kernels'
 * Bk): the map's word per row, nothing else (this runs for every tile of every block). */
static mha_tile_class map_tile(block *B, int64_t j0, int nk, int head_dependent) {
    const mha__mask_map *mm = B->p->map;
    const uint64_t full = nk == 64 ? ~(uint64_t)0 : (((uint64_t)1 << nk) - 1);
    uint64_t any = 0;
    int all = 1, bias = 0;
    for (int64_t hh = 0; hh < B->nh; hh++) {
        uint64_t *w = B->vis + hh * B->nq * MHA_FLASH_WORDS;
        if (hh > 0 && !head_dependent) { /* the first head's rows, repeated */
            memcpy(w, B->vis, sizeof(uint64_t) * MHA_FLASH_WORDS * (size_t)B->nq);
            continue;
        }
        const int64_t base = B->b * mm->plane_b + (B->h0 + hh) * mm->plane_h;
        for (int64_t ii = 0; ii < B->nq; ii++, w += MHA_FLASH_WORDS) {
            const int64_t at = base + (B->i0 + ii) * mm->row_i;
            const uint64_t x = mha__map_word(mm, at, j0) & full;
            w[0] = x;
            w[1] = 0;
            any |= x;
            all &= x == full;
            if (mm->need_bias)
                bias |= mha__map_bias(mm, at, j0, nk);
        }
    }
    B->need_bias = bias;
    return !any ? MHA_TILE_HIDDEN : all ? MHA_TILE_VISIBLE : MHA_TILE_MIXED;
}

/* Visibility bits of every row of the block for keys [j0, j0 + nk): the causal / window band
 * ANDed with the block mask (the element rules, base/internal.h). Returns the tile's class:
 * HIDDEN (no row sees any key: skipped), VISIBLE (every row sees every key: the unmasked kernel)
 * or MIXED (the bits); sets B->need_bias when the additive mask is not 0 somewhere in the tile. */
static mha_tile_class build_vis(block *B, int64_t j0, int nk, int band_interior) {
    const mha__problem *p = B->p;
    const mha__mask_map *mm = p->map;
    const int nwords = (nk + 63) / 64;
    const int head_dependent = mm && mm->plane_h != 0;
    if (mm && band_interior && nwords == 1)
        return map_tile(B, j0, nk, head_dependent);
    int any = 0, all = 1, bias = 0;
    for (int64_t r = 0; r < B->R; r++) {
        const int64_t hh = r / B->nq, ii = r % B->nq, i = B->i0 + ii, h = B->h0 + hh;
        uint64_t *w = B->vis + r * MHA_FLASH_WORDS;
        if (hh > 0 && !head_dependent) { /* the rows of the first head, repeated */
            memcpy(w, B->vis + ii * MHA_FLASH_WORDS, sizeof(uint64_t) * MHA_FLASH_WORDS);
            continue;
        }
        int64_t lo, hi;
        mha__flash_key_range(p, B->b, i, &lo, &hi);
        range_bits(w, lo - j0, hi - j0, nk);
        mha_tile_class c;
        if (mm) {
            c = mha__map_row_words(mm, B->b, h, i, j0, nk, nwords, w, &bias);
        } else {
            c = bits_any(w) ? MHA_TILE_VISIBLE : MHA_TILE_HIDDEN;
            for (int k = 0; k < nwords; k++) {
                const int rem = nk - 64 * k;
                all &= w[k] == (rem >= 64 ? ~(uint64_t)0 : (((uint64_t)1 << rem) - 1));
            }
        }
        any |= c != MHA_TILE_HIDDEN;
        all &= c == MHA_TILE_VISIBLE;
    }
    B->need_bias = bias;
    return !any ? MHA_TILE_HIDDEN : all ? MHA_TILE_VISIBLE : MHA_TILE_MIXED;
}

/* bias[r][j] = additive mask + ALiBi, the same float operations as mha__score_bias. */
static void build_bias(const block *B, int64_t j0, int nk) {
    const mha__problem *p = B->p;
    for (int64_t r = 0; r < B->R; r++) {
        const int64_t h = B->h0 + r / B->nq, i = B->i0 + r % B->nq;
        float *br = B->bias + r * B->bk;
        const float *add = NULL;
        int64_t s3 = 0;
        if (p->additive.data && B->need_bias) {
            const int64_t *st = p->additive.strides;
            add =
                (const float *)p->additive.data + B->b * st[0] + h * st[1] + i * st[2] + j0 * st[3];
            s3 = st[3];
        }
        const float slope = p->alibi_slopes ? p->alibi_slopes[h] : 0.0f;
        const int64_t pos = i + p->delta[B->b];
        for (int j = 0; j < nk; j++) {
            float x = 0.0f;
            if (add)
                x += add[j * s3];
            if (p->alibi_slopes) {
                int64_t dist = pos - (j0 + j);
                if (dist < 0)
                    dist = -dist;
                x -= slope * (float)dist;
            }
            br[j] = x;
        }
    }
}

static void build_keep(const block *B, int64_t j0, int nk) {
    const mha__problem *p = B->p;
    for (int64_t r = 0; r < B->R; r++) {
        const int64_t h = B->h0 + r / B->nq, i = B->i0 + r % B->nq;
        B->sm->dropout_bits(p->dropout_seed, p->dropout_p, B->b, h, i + p->dropout_row0,
                            j0 + p->dropout_col0, nk, B->keep + r * MHA_FLASH_WORDS);
    }
}

/* O = alpha O + P V for a value tile with Inf/NaN: like the reference, a term with P = 0
 * (masked, dropped or underflowed) is skipped, so 0 * Inf never turns into NaN. v: the float32
 * tile (rows of vs floats), or NULL when the tiles are half precision: then the rows of keys
 * j0 .. j0 + nk - 1 are read from storage (widened exactly; P is not rounded on this path). */
static void pv_exact(const block *B, int64_t j0, int nk, const float *v, int64_t vs) {
    const mha__problem *p = B->p;
    const int64_t dv = p->dv;
    for (int64_t r = 0; r < B->R; r++) {
        float *o = B->o + r * B->ldo;
        const float a = B->alpha[r];
        const float *pr = B->s + r * B->bk;
        for (int64_t d = 0; d < dv; d++)
            o[d] *= a;
        for (int j = 0; j < nk; j++) {
            const float pj = pr[j];
            if (pj == 0.0f)
                continue;
            if (v) {
                const float *vj = v + j * vs;
                for (int64_t d = 0; d < dv; d++)
                    o[d] += pj * vj[d];
            } else {
                const void *vj = mha__elem(p->v_dt, B->vb, (j0 + j) * p->vs[2]);
                for (int64_t d = 0; d < dv; d++)
                    o[d] += pj * mha__load(p->v_dt, vj, d);
            }
        }
    }
}

/* Asks for the K and V rows of the next tile while this one computes (one request per 64-byte
 * line; the hardware prefetchers do not follow strided rows across tiles well). */
static void prefetch_tile(const block *B, int64_t j0, int keys) {
    const mha__problem *p = B->p;
    const int64_t nk = p->m - j0 < B->bk ? p->m - j0 : B->bk;
    const int64_t kbytes = p->dk * (int64_t)mha__storage_size(p->k_dt);
    const int64_t vbytes = p->dv * (int64_t)mha__storage_size(p->v_dt);
    for (int64_t j = 0; j < nk; j++) {
        const char *kr = mha__elem(p->k_dt, B->kb, (j0 + j) * p->ks[2]);
        const char *vr = mha__elem(p->v_dt, B->vb, (j0 + j) * p->vs[2]);
        for (int64_t off = 0; keys && off < kbytes; off += 64)
            __builtin_prefetch(kr + off);
        for (int64_t off = 0; off < vbytes; off += 64)
            __builtin_prefetch(vr + off);
    }
}

/* K^T of tile [j0, j0 + nk) into kt: for float32 tiles a half-precision K is widened row by row
 * first (exactly), so every ISA's f32 pack_kt and qk run on float32; bf16 tiles are packed from
 * the storage as it is. */
static void pack_keys(const block *B, int64_t j0, int nk, float *kt) {
    const mha__problem *p = B->p;
    if (p->k_dt == MHA_DTYPE_F32 || B->tile->dt != MHA_DTYPE_F32) {
        B->tile->pack_kt(mha__elem(p->k_dt, B->kb, j0 * p->ks[2]), p->ks[2], nk, p->dk, kt, B->bk);
        return;
    }
    for (int j = 0; j < nk; j++)
        mha__widen_rows(p->k_dt, mha__elem(p->k_dt, B->kb, (j0 + j) * p->ks[2]), B->kw + j * p->dk,
                        p->dk);
    B->tile->pack_kt(B->kw, p->dk, nk, p->dk, kt, B->bk);
}

/* Places the cache's window over the block's tiles [tlo, thi]: kept when they lie in it, else
 * moved to start at tlo and emptied; a block wider than the window (never, within
 * mha__flash_key_span) runs uncached and leaves the cache empty. */
static void cache_window(block *B, int64_t tlo, int64_t thi) {
    B->cached = B->cache_on;
    if (!B->cache_on || thi < tlo)
        return;
    cache_header *hdr = B->hdr;
    if (thi - tlo + 1 > B->ctiles) {
        B->cached = 0;
        hdr->b = hdr->g = -1; /* the packing below overwrites the first tiles */
        return;
    }
    if (tlo < hdr->base || thi >= hdr->base + B->ctiles) {
        memset(B->state, 0, (size_t)B->ctiles);
        hdr->base = tlo;
    }
    B->cbase = hdr->base;
}

/* Scores of the block against key tile t = [j0, j0 + nk) into S. */
static void scores(const block *B, int64_t j0, int nk) {
    const mha__problem *p = B->p;
    const int64_t t = j0 / B->bk - B->cbase;
    float *kt = B->kt;
    if (B->cached) {
        kt += t * p->dk * B->bk;
        if (!(B->state[t] & TILE_PACKED)) {
            pack_keys(B, j0, nk, kt);
            B->state[t] |= TILE_PACKED;
        }
    } else {
        pack_keys(B, j0, nk, kt);
    }
    B->tile->qk(B->qp, B->ldq, (int)B->R, kt, B->bk, nk, p->dk, B->s, B->bk);
}

/* The V rows of tile [j0, j0 + nk), packed contiguous with row stride ldo (see the cache note
 * above): from the cache when it holds them. */
static const float *packed_values(const block *B, int64_t j0, int nk) {
    const mha__problem *p = B->p;
    const int64_t t = j0 / B->bk - B->cbase;
    float *vt = B->vt;
    if (B->cached) {
        vt += t * B->bk * B->ldo;
        if (B->state[t] & TILE_V_PACKED)
            return vt;
        B->state[t] |= TILE_V_PACKED;
    }
    if (B->tile->pack_v) {
        B->tile->pack_v(mha__elem(p->v_dt, B->vb, j0 * p->vs[2]), p->vs[2], nk, p->dv, vt, B->ldo);
        return vt;
    }
    for (int j = 0; j < nk; j++) /* widened exactly when V is half precision */
        mha__widen_rows(p->v_dt, mha__elem(p->v_dt, B->vb, (j0 + j) * p->vs[2]), vt + j * B->ldo,
                        p->dv);
    return vt;
}

static int values_finite(const block *B, int64_t j0, int nk, const float *v) {
    const mha__problem *p = B->p;
    if (!B->cached)
        return B->tile->all_finite(v, B->ldo, nk, p->dv);
    uint8_t *st = B->state + (j0 / B->bk - B->cbase);
    if (!(*st & TILE_FINITE_KNOWN))
        *st |= (uint8_t)(TILE_FINITE_KNOWN |
                         (B->tile->all_finite(v, B->ldo, nk, p->dv) ? TILE_FINITE : 0));
    return (*st & TILE_FINITE) != 0;
}

static void softmax_args(const block *B, int64_t j0, int nk, int vis, mha__flash_softmax *a) {
    const mha__problem *p = B->p;
    memset(a, 0, sizeof *a);
    a->s = B->s;
    a->lds = B->bk;
    a->rows = (int)B->R;
    a->nk = nk;
    a->scale = p->scale;
    a->softcap = p->softcap;
    if ((p->additive.data && B->need_bias) || p->alibi_slopes) {
        build_bias(B, j0, nk);
        a->bias = B->bias;
        a->ldb = B->bk;
    }
    a->vis = vis ? B->vis : NULL;
    a->mu = B->mu;
}

/* ---------------------------------------------------------------------------------------------- */

static void finalize(const block *B) {
    const mha__problem *p = B->p;
    for (int64_t r = 0; r < B->R; r++) {
        const int64_t h = B->h0 + r / B->nq, i = B->i0 + r % B->nq;
        const float m = B->m[r], l = B->l[r];
        const float sink = p->sinks ? p->sinks[h] : -INFINITY;
        void *out = mha__elem_mut(p->o_dt, p->out, B->b * p->os[0] + h * p->os[1] + i * p->os[2]);
        float *o = B->o + r * B->ldo;
        float *lse = p->lse ? p->lse + (B->b * p->H + h) * p->n + i : NULL;
        /* Fully masked: every score -inf, no NaN anywhere (a NaN score makes l NaN). The sink
         * alone does not make a row visible, as in the reference. */
        if (m == -INFINITY && l == 0.0f && !isnan(sink)) {
            for (int64_t d = 0; d < p->dv; d++)
                mha__store(p->o_dt, out, d, 0.0f);
            if (lse)
                *lse = -INFINITY;
            B->mu[r] = 0.0f;
            B->inv_l[r] = 0.0f;
            continue;
        }
        /* The sink joins the max and the sum only now; NaN sinks propagate through expf. */
        const float mfin = sink > m ? sink : m;
        const float mu = mfin == -INFINITY ? 0.0f : mfin;
        const float c = expf(m - mu);
        const float lf = l * c + (p->sinks ? expf(sink - mu) : 0.0f);
        const float inv = 1.0f / lf;
        const float factor = c * inv;
        if (p->o_dt == MHA_DTYPE_F32)
            for (int64_t d = 0; d < p->dv; d++)
                ((float *)out)[d] = o[d] * factor;
        else { /* rounded once, from the float32 value (O is not needed after this) */
            float *os = B->o + r * B->ldo;
            for (int64_t d = 0; d < p->dv; d++)
                os[d] *= factor;
            mha__narrow_rows(p->o_dt, os, out, p->dv);
        }
        if (lse)
            *lse = mu + logf(lf);
        B->mu[r] = mu;
        B->inv_l[r] = inv;
    }
}

/* Second pass when probabilities are requested: P = exp(x - mu) / l per tile, recomputed from
 * the scores with the final max and sum (nothing n x m is kept between passes). */
static void probs_pass(block *B, int64_t tlo, int64_t thi) {
    const mha__problem *p = B->p;
    const int64_t ntiles = (p->m + B->bk - 1) / B->bk;
    const float inv_h = 1.0f / (float)p->H;
    for (int64_t t = 0; t < ntiles; t++) {
        const int64_t j0 = t * B->bk;
        const int nk = (int)(p->m - j0 < B->bk ? p->m - j0 : B->bk);
        int computed = 0;
        if (t >= tlo && t <= thi && build_vis(B, j0, nk, 0) != MHA_TILE_HIDDEN) {
            mha__flash_softmax a;
            scores(B, j0, nk);
            softmax_args(B, j0, nk, 1, &a);
            a.inv_l = B->inv_l;
            B->sm->softmax_final(&a);
            computed = 1;
        }
        for (int64_t r = 0; r < B->R; r++) {
            const int64_t h = B->h0 + r / B->nq, i = B->i0 + r % B->nq;
            const float *pr = B->s + r * B->bk;
            /* 0 * inv_l: zero, or NaN for a NaN row (as the reference's 0 * NaN sum). */
            const float zero = 0.0f * B->inv_l[r];
            if (p->average_probs) {
                float *dst = p->probs + (B->b * p->n + i) * p->m + j0;
                for (int j = 0; j < nk; j++)
                    dst[j] = (h == 0 ? 0.0f : dst[j]) + (computed ? pr[j] : zero) * inv_h;
            } else {
                float *dst = p->probs + ((B->b * p->H + h) * p->n + i) * p->m + j0;
                for (int j = 0; j < nk; j++)
                    dst[j] = computed ? pr[j] : zero;
            }
        }
    }
}

/* Long rows: blocked accumulation. O and l are running sums over key tiles, each tile adding
 * one term per element after rescaling by alpha; over m = 65536 keys that is 1024 sequential
 * float additions, whose rounding grows like sqrt(1024) u (test_extremes measured 1.4x its
 * backstop). So every MHA_FLASH_FOLD_TILES tiles the partial sums (what the tile kernels update,
 * B->o and B->l) are added into O_main and l_main and restarted from zero; beta carries the
 * product of the alphas applied since the last fold, i.e. the rescale O_main still owes:
 *   O = O_main * beta + O_partial,  l = l_main * beta + l_partial  (at every moment)
 * Rows up to 32 tiles (2048 keys) never fold and are bit-identical to the plain recurrence. */
#define MHA_FLASH_FOLD_TILES 32

static void fold_partial(const block *B, int first) {
    if (first) /* O_main starts at 0 (zeroed here, not per block: most blocks never fold) */
        memset(B->o_main, 0, sizeof(float) * (size_t)(B->R * B->ldo));
    for (int64_t r = 0; r < B->R; r++) {
        float *om = B->o_main + r * B->ldo, *o = B->o + r * B->ldo;
        const float beta = B->beta[r];
        for (int64_t d = 0; d < B->p->dv; d++) {
            om[d] = om[d] * beta + o[d];
            o[d] = 0.0f;
        }
        B->l_main[r] = B->l_main[r] * beta + B->l[r];
        B->l[r] = 0.0f;
        B->beta[r] = 1.0f;
    }
}

/* The last step: O and l in B->o and B->l (what finalize reads), after at least one fold. */
static void unfold(const block *B) {
    for (int64_t r = 0; r < B->R; r++) {
        const float *om = B->o_main + r * B->ldo;
        float *o = B->o + r * B->ldo;
        const float beta = B->beta[r];
        for (int64_t d = 0; d < B->p->dv; d++)
            o[d] = om[d] * beta + o[d];
        B->l[r] = B->l_main[r] * beta + B->l[r];
    }
}

static void run_block(block *B) {
    const mha__problem *p = B->p;
    MHA_ASSERT(p->map || !mha__has_element_rules(p)); /* the core builds it (core/mask_map.c) */
    for (int64_t r = 0; r < B->R; r++) {
        const int64_t h = B->h0 + r / B->nq, i = B->i0 + r % B->nq;
        /* Q rows copied together: in place they may sit a power of two apart (4 KiB in the
         * layer's layout), and every key tile rereads them. */
        const void *q = mha__elem(p->q_dt, p->q, B->b * p->qs[0] + h * p->qs[1] + i * p->qs[2]);
        if (B->tile->dt == MHA_DTYPE_F32) {
            mha__widen_rows(p->q_dt, q, (float *)B->qp + r * B->ldq, p->dk);
        } else { /* bf16 rows as they are, a zero appended to complete the last pair */
            uint16_t *qr = (uint16_t *)B->qp + r * B->ldq;
            memcpy(qr, q, sizeof(uint16_t) * (size_t)p->dk);
            if (B->ldq > p->dk)
                qr[p->dk] = 0;
        }
        B->m[r] = -INFINITY;
        B->l[r] = 0.0f;
        B->l_main[r] = 0.0f;
        B->beta[r] = 1.0f;
    }
    memset(B->o, 0, sizeof(float) * (size_t)(B->R * B->ldo));
    int64_t since_fold = 0;
    int folded = 0;

    int64_t lo0, hi0, lo1, hi1, klo, khi;
    mha__flash_key_range(p, B->b, B->i0, &lo0, &hi0);
    mha__flash_key_range(p, B->b, B->i0 + B->nq - 1, &lo1, &hi1);
    /* Tiles [tlo, thi] meet the band and the block mask's span of some row; the others are
     * never read. */
    mha__flash_unit_keys(p, B->b, B->h0, B->h0 + B->nh, B->i0, B->i0 + B->nq, &klo, &khi);
    const int64_t tlo = klo <= khi ? klo / B->bk : 0, thi = klo <= khi ? khi / B->bk : -1;
    cache_window(B, tlo, thi);
    const int elem_masks = p->map != NULL;
    B->need_bias = 0;
    const float keep_scale = p->dropout_on ? 1.0f / (1.0f - p->dropout_p) : 1.0f;

    for (int64_t t = tlo; t <= thi; t++) {
        const int64_t j0 = t * B->bk;
        const int nk = (int)(p->m - j0 < B->bk ? p->m - j0 : B->bk);
        /* Every row sees every key of the tile through causal/window when the latest lower
         * bound and the earliest upper bound enclose it. */
        const int interior = lo1 <= j0 && hi0 >= j0 + nk - 1;
        int vis = elem_masks || !interior;
        if (vis) {
            const mha_tile_class c = build_vis(B, j0, nk, interior);
            if (c == MHA_TILE_HIDDEN)
                continue;
            vis = c == MHA_TILE_MIXED;
        }
        mha__flash_softmax a;
        if (t < thi)
            prefetch_tile(B, j0 + B->bk, !B->cached || !(B->state[t + 1 - B->cbase] & TILE_PACKED));
        scores(B, j0, nk);
        softmax_args(B, j0, nk, vis, &a);
        a.m = B->m;
        a.l = B->l;
        a.alpha = B->alpha;
        if (p->dropout_on) {
            build_keep(B, j0, nk);
            a.keep = B->keep;
            a.keep_scale = keep_scale;
        }
        B->sm->softmax_online(&a);
        const float *v = packed_values(B, j0, nk);
        if (values_finite(B, j0, nk, v))
            B->tile->pv(B->s, B->bk, (int)B->R, nk, v, B->ldo, p->dv, B->alpha, B->o, (int)B->ldo);
        else
            pv_exact(B, j0, nk, B->tile->dt == MHA_DTYPE_F32 ? v : NULL, B->ldo);
        for (int64_t r = 0; r < B->R; r++)
            B->beta[r] *= B->alpha[r];
        if (++since_fold == MHA_FLASH_FOLD_TILES) {
            fold_partial(B, !folded);
            since_fold = 0;
            folded = 1;
        }
    }
    if (folded)
        unfold(B);
    finalize(B);
    if (p->probs)
        probs_pass(B, tlo, thi);
}

void mha__flash_fwd(const mha__flash_softmax_ops *sm,
                    const mha__flash_tile_ops *tile,
                    int bq,
                    int bk,
                    const mha__problem *p,
                    const mha__fwd_unit *u,
                    void *scratch) {
    flash_layout L = {0};
    const bool ok =
        flash_layout_for(bq, bk, p->dk, p->dv, p->m, mha__flash_key_span(p->m, p->chunk, p->causal),
                         p->k_dt != MHA_DTYPE_F32, &L);
    MHA_ASSERT(ok && bk % 16 == 0 && bk <= MHA_FLASH_MAX_BK && bq <= MHA_FLASH_MAX_BQ);
    MHA_ASSERT(tile->dt == MHA_DTYPE_F32 ||
               (p->q_dt == tile->dt && p->k_dt == tile->dt && p->v_dt == tile->dt));
    (void)ok;
    char *base = scratch;
    block B;
    B.sm = sm;
    B.tile = tile;
    B.p = p;
    B.bq = bq;
    B.bk = bk;
    B.b = u->b;
    B.i0 = u->i0;
    B.nq = u->i1 - u->i0;
    B.kt = (float *)(base + L.kt);
    B.vt = (float *)(base + L.vt);
    B.kw = (float *)(base + L.kw);
    B.o_main = (float *)(base + L.o_main);
    B.l_main = (float *)(base + L.l_main);
    B.beta = (float *)(base + L.beta);
    B.qp = base + L.qp; /* bq x dk floats hold bq x round_up(dk, 2) bf16 */
    B.ldq = tile->dt == MHA_DTYPE_F32 ? p->dk : (p->dk + 1) / 2 * 2;
    B.s = (float *)(base + L.s);
    B.o = (float *)(base + L.o);
    B.m = (float *)(base + L.m);
    B.l = (float *)(base + L.l);
    B.alpha = (float *)(base + L.alpha);
    B.mu = (float *)(base + L.mu);
    B.inv_l = (float *)(base + L.inv_l);
    B.bias = (float *)(base + L.bias);
    B.vis = (uint64_t *)(base + L.vis);
    B.keep = (uint64_t *)(base + L.keep);
    B.ldo = L.ldo;
    B.cache_on = B.cached = L.cached;
    B.ctiles = L.ntiles;
    B.cbase = 0;
    B.state = (uint8_t *)(base + L.state);
    cache_header *hdr = (cache_header *)(base + L.header);
    B.hdr = hdr;
    if (u->fresh)
        hdr->b = hdr->g = -1;

    const int64_t hpb = mha__flash_heads_per_block(bq, p->group);
    for (int64_t h = u->h0; h < u->h1;) {
        const int64_t g = h / p->group;
        int64_t hend = h + hpb;
        if (hend > (g + 1) * p->group)
            hend = (g + 1) * p->group;
        if (hend > u->h1)
            hend = u->h1;
        B.g = g;
        B.h0 = h;
        B.nh = hend - h;
        B.R = B.nh * B.nq;
        MHA_ASSERT(B.R <= bq);
        if (B.cache_on && (hdr->b != B.b || hdr->g != g)) {
            memset(B.state, 0, (size_t)L.ntiles);
            hdr->b = B.b;
            hdr->g = g;
            hdr->base = 0;
        }
        B.kb = mha__elem(p->k_dt, p->k, B.b * p->ks[0] + g * p->ks[1]);
        B.vb = mha__elem(p->v_dt, p->v, B.b * p->vs[0] + g * p->vs[1]);
        run_block(&B);
        h = hend;
    }
}
