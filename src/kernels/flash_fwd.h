/* SPDX-License-Identifier: MIT */
/* flash_fwd.h: the FlashAttention-2 forward, split into an ISA-independent driver (flash_fwd.c:
 * tiling, causal/window tile skipping, mask and dropout preparation, the online-softmax
 * bookkeeping, finalisation, probabilities) and the operations that do the arithmetic: the
 * softmax steps (mha__flash_softmax_ops, per ISA: float32 scores whatever the storage) and pack a
 * key tile, S = Q K^T, O = alpha O + P V (mha__flash_tile_ops, per ISA and dtype of the tiles).
 *
 * One query BLOCK is R <= Bq rows: query positions [i0, i1) of nh consecutive query heads of ONE
 * kv group, row r = hh * (i1 - i0) + ii. Every key/value tile is loaded (and K packed) once per
 * block and used by all its rows, i.e. by all query heads of the group (GQA).
 *
 *   q: [B, H, n, dk]  k: [B, G, m, dk]  v: [B, G, m, dv]  out: [B, H, n, dv]
 *   S (scratch): [R][Bk] scores, overwritten by P;  Kt (scratch): [dk][Bk] = K tile transposed
 *   O (scratch): [R][ldo] unnormalised output accumulators, ldo = dv rounded up to 16
 */
#ifndef MHA_FLASH_FWD_H
#define MHA_FLASH_FWD_H

#include "kernels/registry.h"

#define MHA_FLASH_MAX_BK 128 /* key tiles fit two 64-bit visibility words per row */
#define MHA_FLASH_WORDS  (MHA_FLASH_MAX_BK / 64)

/* Arguments of the softmax step over one tile of `rows` rows and nk keys (lanes nk .. Bk-1 of S
 * are ignored and P is 0 there). Per row r and key j the score is transformed exactly as
 * mha__attention_ref does (same operations, same order):
 *     x = scale * S[r][j];  x = softcap * tanh(x / softcap) if softcap > 0;  x += bias[r][j];
 *     x = -inf unless bit j of vis[r] is set (invisible keys never see their score, so a NaN
 *     there cannot leak). */
typedef struct mha__flash_softmax {
    float *s; /* [rows][lds]: scores in, P out */
    int lds, rows, nk;
    float scale, softcap;
    const float *bias; /* NULL or [rows][ldb] */
    int ldb;
    const uint64_t *vis; /* NULL (all nk keys visible) or [rows][MHA_FLASH_WORDS] */
    /* Online step (softmax_online):
     *   m_new = max(m, max_j x_j) (NaN scores do not move the max);  mu = m_new, or 0 if -inf;
     *   alpha = exp(m - mu);  p_j = exp(x_j - mu);  l = l * alpha + sum_j p_j;  m = m_new;
     *   P_j = p_j, or with dropout P_j = keep_j ? p_j * keep_scale : 0 (l uses undropped p). */
    float *m, *l, *alpha;
    const uint64_t *keep; /* NULL or [rows][MHA_FLASH_WORDS] dropout keep bits */
    float keep_scale;
    /* Final probabilities (softmax_final): P_j = exp(x_j - mu[r]) * inv_l[r]. In the online
     * step mu is scratch of `rows` floats (it then receives mu). */
    float *mu;
    const float *inv_l;
} mha__flash_softmax;

/* The operations split by what they depend on (docs/KERNELS.md, "The forward's operations"):
 * the softmax steps and the dropout bits depend on the ISA only (they work on float32 scores);
 * the packing and the tile products depend on the ISA and on the dtype the tiles hold. */
typedef struct mha__flash_softmax_ops {
    void (*softmax_online)(const mha__flash_softmax *a);
    void (*softmax_final)(const mha__flash_softmax *a);
    /* Dropout keep bits of row (b, h, i), keys j0 .. j0+nk-1: bit j of words[] is
     * mha__dropout_keep(seed, p, b, h, i, j0 + j); bits from nk on are 0. */
    void (*dropout_bits)(uint64_t seed,
                         float p,
                         int64_t b,
                         int64_t h,
                         int64_t i,
                         int64_t j0,
                         int nk,
                         uint64_t *words);
} mha__flash_softmax_ops;

/* Tile operations for tiles of dtype dt. Element types of q, k, kt, v below:
 *   dt = MHA_DTYPE_F32:  float. The driver widens half-precision Q, K and V rows exactly before
 *                        they reach these (Q rows and V tiles into its buffers, K rows into a
 *                        row buffer that pack_kt transposes); pack_v is NULL (the driver's V
 *                        buffer is the packed tile: rows of ldv floats).
 *   dt = MHA_DTYPE_BF16: uint16_t bf16 bits, the storage of q, k and v as the caller gave them
 *                        (the kernel's registry line takes BF16 only). Q rows are copied with a
 *                        zero appended when dk is odd (ldq = dk rounded up to even); K^T and V are
 *                        packed as bf16 PAIRS (uint32_t: low half the even element), see
 *                        attn_fwd_flash_avx512bf16.c. The f32 scores and P stay float32. */
typedef struct mha__flash_tile_ops {
    mha_dtype dt;
    /* F32: Kt[d * ldk + j] = k[j * ks + d] for d < dk, j < nk; lanes nk .. round_up(nk, 16) - 1
     * are zeroed so that S stays finite there. BF16: the pairs of d, Kt2[d/2 * ldk + j]. */
    void (*pack_kt)(const void *k, int64_t ks, int nk, int64_t dk, void *kt, int ldk);
    /* S[r * lds + j] = sum_d q[r * ldq + d] * Kt[d][j] for r < rows, j < nk (lanes up to
     * round_up(nk, 16) may be written). */
    void (*qk)(const void *q,
               int64_t ldq,
               int rows,
               const void *kt,
               int ldk,
               int nk,
               int64_t dk,
               float *s,
               int lds);
    /* The V tile rows [0, nk) (v[j * vs + d]) into the layout pv reads, rows of ldv elements
     * (ldv >= dv, a multiple of 16; lanes beyond dv and rows beyond nk zeroed). NULL: F32. */
    void (*pack_v)(const void *v, int64_t vs, int nk, int64_t dv, void *vt, int64_t ldv);
    /* O[r][:dv] = O[r][:dv] * alpha[r] + sum_{j < nk} P[r][j] * V[j][:dv] (V packed, vs = its
     * row stride: ldv). */
    void (*pv)(const float *pm,
               int lds,
               int rows,
               int nk,
               const void *v,
               int64_t vs,
               int64_t dv,
               const float *alpha,
               float *o,
               int ldo);
    /* 1 when V[j][d] of the packed tile is finite for every j < nk, d < dv. A tile with Inf/NaN
     * values goes through the driver's exact path, which skips P = 0 terms as the reference
     * does. */
    int (*all_finite)(const void *v, int64_t vs, int nk, int64_t dv);
} mha__flash_tile_ops;

/* Largest Bq of a forward line (registry.c checks it): the f32 adapter's row pointers. */
#define MHA_FLASH_MAX_BQ 64

/* The tile operations of a float32 kernel file, from its static float-typed pack_kt, qk (rows by
 * pointer), pv and all_finite: thin adapters, so the f32 kernels' code is unchanged. */
#define MHA_FLASH_F32_TILE_OPS(name)                                                               \
    static void name##_pack_kt(const void *k, int64_t ks, int nk, int64_t dk, void *kt, int ldk) { \
        pack_kt(k, ks, nk, dk, kt, ldk);                                                           \
    }                                                                                              \
    static void name##_qk(const void *q, int64_t ldq, int rows, const void *kt, int ldk, int nk,   \
                          int64_t dk, float *s, int lds) {                                         \
        const float *qr[MHA_FLASH_MAX_BQ];                                                         \
        for (int r = 0; r < rows; r++)                                                             \
            qr[r] = (const float *)q + r * ldq;                                                    \
        qk(qr, rows, kt, ldk, nk, dk, s, lds);                                                     \
    }                                                                                              \
    static void name##_pv(const float *pm, int lds, int rows, int nk, const void *v, int64_t vs,   \
                          int64_t dv, const float *alpha, float *o, int ldo) {                     \
        pv(pm, lds, rows, nk, v, vs, dv, alpha, o, ldo);                                           \
    }                                                                                              \
    static int name##_all_finite(const void *v, int64_t vs, int nk, int64_t dv) {                  \
        return all_finite(v, vs, nk, dv);                                                          \
    }                                                                                              \
    static const mha__flash_tile_ops name = {MHA_DTYPE_F32, name##_pack_kt, name##_qk,             \
                                             NULL,          name##_pv,      name##_all_finite};

#if defined(__x86_64__) || defined(__i386__)
/* The AVX-512 softmax steps (attn_fwd_flash_avx512.c), shared by the AVX512-BF16 kernel. */
extern const mha__flash_softmax_ops mha__flash_softmax_avx512;
#endif

/* The keep test of mha__dropout_keep as an integer compare on Philox word 0: u = (w >> 8) 2^-24
 * >= p  <=>  w >= ceil(p 2^24) 2^8 (p 2^24 is exact; p < 1 keeps the bound below 2^32). */
static inline uint32_t mha__dropout_threshold(float p) {
    return (uint32_t)ceilf(p * 0x1.0p24f) << 8;
}

/* Query heads of one kv group handled together in a block, and query positions per block. */
static inline int64_t mha__flash_heads_per_block(int64_t bq, int64_t group) {
    return group < bq ? group : bq;
}
static inline int64_t mha__flash_rows_per_block(int64_t bq, int64_t group) {
    const int64_t q = bq / mha__flash_heads_per_block(bq, group);
    return q < 1 ? 1 : q;
}

/* Scratch bytes of the driver for blocks of Bq rows and key tiles of Bk, kv length m (false on
 * overflow). Scratch carries packed K tiles from one unit to the next of the same thread; a unit
 * with `fresh` set starts from nothing. widen_k: K is half precision (a row buffer widens it). */
bool mha__flash_scratch_bytes(
    int bq, int bk, int64_t dk, int64_t dv, int64_t m, int64_t span, int widen_k, size_t *bytes);

/* Most keys one query block (<= MHA_FLASH_MAX_BQ rows) may see with chunk size `chunk` (0 =
 * none): its rows' chunks are one or two consecutive ones, and with causal the last row sees no
 * key past its own position, so C + Bq keys (causal) or 2C + Bq; m without a chunk (or C >= m).
 * The size of the flash kernels' K/V tile cache (flash_fwd.c). */
static inline int64_t mha__flash_key_span(int64_t m, int64_t chunk, int causal) {
    if (chunk <= 0 || chunk >= m)
        return m;
    const int64_t span = (causal ? chunk : 2 * chunk) + MHA_FLASH_MAX_BQ;
    return span < m ? span : m;
}

/* Visible key range [lo, hi] of query row i of batch row b from causal, window and chunk alone
 * (empty when lo > hi). Clipped to [0, m - 1]. Both edges grow with i (the chunk's start
 * C floor(pos / C) and end too), which the tile skipping of every caller relies on. */
static inline void
mha__flash_key_range(const mha__problem *p, int64_t b, int64_t i, int64_t *lo, int64_t *hi) {
    /* |pos| <= 2^32 (indices and offsets are bounded by MHA_MAX_DIM); the window sides may be
     * anything up to INT64_MAX, so they are only ever compared, never added to pos unchecked. */
    const int64_t pos = i + p->delta[b];
    int64_t l = 0, h = p->m - 1;
    if (p->causal && pos < h)
        h = pos;
    if (p->use_window) {
        if (p->window_left >= 0 && pos > p->window_left) /* pos - left > 0 */
            l = pos - p->window_left;
        if (p->window_right >= 0 && p->window_right < h - pos) /* pos + right < h */
            h = pos + p->window_right;
    }
    if (p->chunk) { /* keys [c0, c0 + C - 1]: |c0| <= |pos| + C, C <= 2^33 (check/attention.c) */
        const int64_t c0 = mha__chunk_start(pos, p->chunk);
        if (c0 > l)
            l = c0;
        if (c0 + p->chunk - 1 < h)
            h = c0 + p->chunk - 1;
    }
    *lo = l;
    *hi = h;
}

/* Keys [lo, hi] that some row of rows [i0, i1) of heads [h0, h1) of batch row b may see: the
 * causal / window band's union narrowed by the block mask's row spans (empty when lo > hi). */
void mha__flash_unit_keys(const mha__problem *p,
                          int64_t b,
                          int64_t h0,
                          int64_t h1,
                          int64_t i0,
                          int64_t i1,
                          int64_t *lo,
                          int64_t *hi);

/* The band [lo, hi] of one row (mha__flash_key_range) as the bits of keys j0 .. j0 + nk - 1
 * (nk <= 64): bit t set when lo <= j0 + t <= hi. */
static inline uint64_t mha__band_word(int64_t lo, int64_t hi, int64_t j0, int64_t nk) {
    lo = lo > j0 ? lo - j0 : 0;
    hi = hi < j0 + nk - 1 ? hi - j0 : nk - 1;
    return lo > hi ? 0 : (~(uint64_t)0 >> (63 - (hi - lo))) << lo;
}

/* The class of rows [i0, i0 + R) of (b, h) against keys [j0, j0 + nk) (nk <= 64) under every
 * rule: the band (mha__flash_key_range) AND the block mask (p->map, when built). vis (NULL: not
 * wanted) receives each row's word; *bias is set when the additive mask is not 0 there. */
static inline mha_tile_class mha__rows_class(const mha__problem *p,
                                             int64_t b,
                                             int64_t h,
                                             int64_t i0,
                                             int64_t R,
                                             int64_t j0,
                                             int nk,
                                             uint64_t *vis,
                                             int *bias) {
    const uint64_t full = nk == 64 ? ~(uint64_t)0 : (((uint64_t)1 << nk) - 1);
    int any = 0, all = 1;
    for (int64_t r = 0; r < R; r++) {
        int64_t lo, hi;
        mha__flash_key_range(p, b, i0 + r, &lo, &hi);
        uint64_t w = mha__band_word(lo, hi, j0, nk);
        mha_tile_class c = w == full ? MHA_TILE_VISIBLE : w ? MHA_TILE_MIXED : MHA_TILE_HIDDEN;
        if (p->map)
            c = mha__map_row_words(p->map, b, h, i0 + r, j0, nk, 1, &w, bias);
        if (vis)
            vis[r] = w;
        any |= c != MHA_TILE_HIDDEN;
        all &= c == MHA_TILE_VISIBLE;
    }
    return !any ? MHA_TILE_HIDDEN : all ? MHA_TILE_VISIBLE : MHA_TILE_MIXED;
}

/* Number of key tiles of width bk in mha__flash_unit_keys (the cost model of dispatch.c). */
int64_t mha__flash_visible_tiles(
    const mha__problem *p, int64_t b, int64_t h0, int64_t h1, int64_t i0, int64_t i1, int bk);

/* Runs one work unit (kernels.h) with the given softmax and tile operations. */
void mha__flash_fwd(const mha__flash_softmax_ops *sm,
                    const mha__flash_tile_ops *tile,
                    int bq,
                    int bk,
                    const mha__problem *p,
                    const mha__fwd_unit *u,
                    void *scratch);

#endif /* MHA_FLASH_FWD_H */
