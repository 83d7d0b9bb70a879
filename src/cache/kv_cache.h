/* SPDX-License-Identifier: MIT */
/* kv_cache.h: the KV cache's private layout and the split-KV decode kernels' interface (internal,
 * never installed). Shared by kv_cache.c, decode.c and kernels/{generic,x86}/decode_*.c.
 *
 * Storage: K [batch, g, slots, d_k] and V [batch, g, slots, d_v] of the cache dtype. Logical
 * position p of a sequence lives in slot p % slots; without a window slots = max_seq, so the slot
 * is p itself. A sequence of length L holds positions max(0, L - slots) .. L-1.
 */
#ifndef MHA_KV_CACHE_H
#define MHA_KV_CACHE_H

#include "base/internal.h"
#include "check/check.h"

struct mha_kv_cache {
    mha_kv_cache_config cfg; /* resolved */
    int64_t slots;           /* storage positions per sequence */
    size_t elem;             /* bytes per stored element (4 or 2; 0 for Q8_0, a block type) */
    size_t k_row_bytes;      /* bytes of one K row: dk * elem, or dk / 32 * 34 for Q8_0 */
    size_t v_row_bytes;      /* bytes of one V row */
    void *k, *v;             /* K [batch, g, slots, dk], V [batch, g, slots, dv] */
    int64_t *len;            /* [batch] current lengths */
    int64_t *lo;             /* [batch] lowest position whose slot is intact (window rings:
                                grows as the ring wraps; truncate does not lower it) */
    mha_allocator allocator;
    int has_allocator;
};

/* Address of K/V row (seq, kv head, logical position p): slot p % slots. */
static inline const void *
mha__kv_k_row(const struct mha_kv_cache *c, int64_t s, int64_t g, int64_t p) {
    const int64_t row = (s * c->cfg.num_kv_heads + g) * c->slots + p % c->slots;
    return (const char *)c->k + (size_t)row * c->k_row_bytes;
}
static inline const void *
mha__kv_v_row(const struct mha_kv_cache *c, int64_t s, int64_t g, int64_t p) {
    const int64_t row = (s * c->cfg.num_kv_heads + g) * c->slots + p % c->slots;
    return (const char *)c->v + (size_t)row * c->v_row_bytes;
}

/* Row of d values (d = dk or dv) stored at src in the cache's dtype, widened to float32 (Q8_0:
 * dequantised). The generic kernel, the reference path and mha_kv_cache_read all read through it.
 */
void mha__kv_load_row(const struct mha_kv_cache *c, const void *src, int64_t d, float *dst);

/* What the argument checks (check/cache.c) read of a cache; NULL gives cfg == NULL. */
static inline mha__kv_view mha__kv_view_of(const struct mha_kv_cache *c) {
    mha__kv_view v = {NULL, NULL, NULL, 0};
    if (c) {
        v.cfg = &c->cfg;
        v.len = c->len;
        v.lo = c->lo;
        v.slots = c->slots;
    }
    return v;
}

/* Appends t rows per sequence without checks (check/: mha__check_kv_append or _decode first):
 * element (s, i, g, d) of k at k[s*seq_stride + i*tok_stride + g*dk + d] (v likewise with dv). */
void mha__kv_append_raw(struct mha_kv_cache *c,
                        int64_t S,
                        const int64_t *seq_ids,
                        int64_t t,
                        const float *k,
                        int64_t k_seq_stride,
                        int64_t k_tok_stride,
                        const float *v,
                        int64_t v_seq_stride,
                        int64_t v_tok_stride);
/* ---------------------------------------------------------------------------------------------- */
/* Split-KV decode kernels.                                                                       */
/* ---------------------------------------------------------------------------------------------- */

/* One decode problem: the last t positions of S sequences attend to their caches. Query row
 * r = i * group + gh (token i of the call, head gh within the kv group) of (seq row s, kv head g)
 * is query head g * group + gh at position p = len[s] - t + i. */
typedef struct mha__dec_problem {
    const struct mha_kv_cache *cache;
    const int64_t *seq; /* [S] cache ids */
    int64_t S, t, H, G, group, dk, dv;
    float scale, softcap; /* softcap 0 = off */
    const float *slopes;  /* [H] ALiBi slopes or NULL */
    int64_t window;       /* 0 = none */
    int64_t chunk;        /* 0 = none; C > 0: keys C floor(pos / C) .. pos */
    const float *q;       /* element (s, i, h, d) at q[s*q_ss + i*q_ts + h*dk + d] */
    int64_t q_ss, q_ts;
    int prefetch_l2; /* software prefetches fill the L2, not the L1 (mha__cpu_prefetch_to_l2) */
    /* Draft tree (mha_kv_attention_args.tree_parents), NULL = a chain: depth [t] of each draft,
     * and vis [S][t], bit a of row (s, i) = draft a (key L - t + a) is an ancestor-or-self of
     * draft i visible under the window/chunk rule. Read through the mha__dec_tree_* helpers. */
    const int64_t *tree_depth;
    const uint32_t *tree_vis;
} mha__dec_problem;

/* A work unit: keys [j0, j1) (logical positions) of kv head g of seq row s. */
typedef struct mha__dec_unit {
    int64_t s, g, j0, j1;
} mha__dec_unit;

/* Computes the unnormalised partial of a unit for its R = group * t rows:
 *   m[r] = max_j s_rj over visible keys (-inf if none), l[r] = sum_j exp(s_rj - m[r]),
 *   o[r][0:dv) = sum_j exp(s_rj - m[r]) v_j   (0 when nothing is visible).
 * scratch: mha__dec_scratch_floats() floats, 64-byte aligned. */
typedef void (*mha__dec_kernel_fn)(const mha__dec_problem *p,
                                   const mha__dec_unit *u,
                                   float *o,
                                   float *m,
                                   float *l,
                                   float *scratch);

/* Keys per unit: large enough that a unit's K and V stream from memory in long runs and the
 * per-unit overhead (q loads, the merge) is small; small enough that batch 1 with g = 8 and a
 * 4096-long cache still gives 64 units for 2 threads, and a block's K (256 x 128 x 4 B = 128 KiB)
 * stays in this machine's 2 MiB L2 between the K and V passes. */
#define MHA_DEC_BLOCK 256

/* Scratch floats a kernel needs: scores [R][BLOCK], then the query rows [R][dk] (vector kernels)
 * or the generic kernel's dequantised K and V row, rows padded to 16 floats. */
static inline int64_t mha__dec_scratch_floats(const mha__dec_problem *p) {
    const int64_t R = p->group * p->t, d = p->dk > p->dv ? p->dk : p->dv;
    return R * MHA_DEC_BLOCK + (R > 2 ? R : 2) * (d + 16) + 32;
}

/* The kernels (one line each in kernels/registry.def, op decode) are declared by registry.h. */

/* Visibility of logical key j for the query at position pos >= 0 (causal, window, chunk). */
static inline int mha__dec_visible(const mha__dec_problem *p, int64_t pos, int64_t j) {
    return j <= pos && (p->window == 0 || j > pos - p->window) &&
           (p->chunk == 0 || j >= pos - pos % p->chunk);
}

/* The lowest logical key the query at position pos >= 0 may see (window, chunk; else 0): with
 * causal the visible keys are [mha__dec_first_key, pos]. */
static inline int64_t mha__dec_first_key(const mha__dec_problem *p, int64_t pos) {
    int64_t lo = p->window > 0 ? pos - p->window + 1 : 0;
    if (p->chunk > 0 && pos - pos % p->chunk > lo)
        lo = pos - pos % p->chunk;
    return lo;
}

/* Draft trees. Every kernel's masking step: the row's position, then its visible keys are
 * [first_key(pos), mha__dec_tree_last_key] ANDed with the lanes of mha__dec_tree_lanes; ALiBi
 * distances are pos - mha__dec_tree_key_pos(j) (mha__dec_tree_shift: the difference to j). Without
 * a tree these reduce to today's pos = L - t + i, hi = pos, all lanes, distance pos - j. */

/* Position of token i of a sequence of length L. */
static inline int64_t mha__dec_tree_pos(const mha__dec_problem *p, int64_t L, int64_t i) {
    return L - p->t + (p->tree_depth ? p->tree_depth[i] : i);
}

/* The highest key the row at position pos may see (with a tree: up to the last draft). */
static inline int64_t mha__dec_tree_last_key(const mha__dec_problem *p, int64_t L, int64_t pos) {
    return p->tree_vis ? L - 1 : pos;
}

/* Bit x: the tree lets row (s, i) see key jabs + x (x < 32; jabs < L): every key before the
 * drafts, and the drafts of the row's visibility mask. All ones without a tree. */
static inline uint32_t
mha__dec_tree_lanes(const mha__dec_problem *p, int64_t s, int64_t i, int64_t L, int64_t jabs) {
    if (!p->tree_vis)
        return 0xFFFFFFFFu;
    const uint64_t v = p->tree_vis[s * p->t + i];
    const int64_t sh = jabs - (L - p->t); /* draft index of lane 0 (< t) */
    if (sh >= 0)
        return (uint32_t)(v >> sh);
    if (sh <= -32)
        return 0xFFFFFFFFu;
    return (uint32_t)((v << -sh) | ((UINT64_C(1) << -sh) - 1));
}

/* Position of key j (a draft's is L - t + its depth, not its slot). */
static inline int64_t mha__dec_tree_key_pos(const mha__dec_problem *p, int64_t L, int64_t j) {
    if (!p->tree_depth || j < L - p->t)
        return j;
    return L - p->t + p->tree_depth[j - (L - p->t)];
}

/* j - mha__dec_tree_key_pos(j) for keys jabs .. jabs + n - 1 (n <= 16), as floats: a vector
 * kernel adds slope * shift to its slope * (pos - j) ALiBi term. */
static inline void
mha__dec_tree_shift(const mha__dec_problem *p, int64_t L, int64_t jabs, int64_t n, float *shift) {
    for (int64_t x = 0; x < n; x++)
        shift[x] = (float)(jabs + x - mha__dec_tree_key_pos(p, L, jabs + x));
}

/* Scalar kernels: is key j visible to row (s, i) at position pos? */
static inline int mha__dec_tree_visible(
    const mha__dec_problem *p, int64_t s, int64_t i, int64_t L, int64_t pos, int64_t j) {
    if (!p->tree_vis || j < L - p->t)
        return mha__dec_visible(p, pos, j);
    return (int)((p->tree_vis[s * p->t + i] >> (j - (L - p->t))) & 1u);
}

#endif /* MHA_KV_CACHE_H */
