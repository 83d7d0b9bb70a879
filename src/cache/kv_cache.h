/* SPDX-License-Identifier: MIT */
/* kv_cache.h: the KV cache's private layout and the split-KV decode kernels' interface (internal,
 * never installed). Shared by kv_cache.c, decode.c and kernels/{generic,x86}/decode_*.c.
 *
 * Storage: blocks of bs slots of the cache dtype. Logical position p of sequence s lives in slot
 * q = p % slots (without a window slots = max_seq, so the slot is p itself), which is row q % bs
 * of block table[s][q / bs]. A sequence of length L holds positions max(0, L - slots) .. L-1.
 *
 * The contiguous cache (config.block_size 0) is the case bs = slots, one block per sequence,
 * table[s] = {s}: K [batch, g, slots, d_k], V [batch, g, slots, d_v], the layout and bytes of the
 * caches before pages. A paged cache (block_size >= MHA__KV_MIN_BLOCK) stores its pool head-major,
 * K [g, num_blocks, bs, d_k] and V [g, num_blocks, bs, d_v]: a kv head's part of a block is bs
 * rows, and consecutive block ids are adjacent (a sequence whose blocks were taken in order reads
 * each kv head's keys as one run, as in the contiguous cache); block-major, a kv head's parts of
 * the blocks would lie g bs rows apart, at a power-of-two stride that maps every block of a unit
 * to the same cache sets. It allocates blocks from its pool when a row is first written to a
 * table entry, after the sequence's previous block when that one is free (kv_pool.c); blocks are
 * reference-counted (fork shares them) and a write to a shared block copies it first
 * (copy-on-write).
 */
#ifndef MHA_KV_CACHE_H
#define MHA_KV_CACHE_H

#include "base/internal.h"
#include "check/check.h"

/* The free blocks of a paged cache's pool and where the next one is taken (kv_pool.c). */
typedef struct mha__kv_pool_node {
    int64_t pre, suf; /* free blocks at the start / end of the node's range */
    int64_t best, at; /* its longest free run (the leftmost of the longest), its first block */
} mha__kv_pool_node;
typedef struct mha__kv_pool {
    int64_t num_blocks, nwords, leaves; /* leaves: words rounded up to a power of two */
    uint64_t *bits;                     /* [nwords] bit b % 64 of word b / 64: block b is free */
    mha__kv_pool_node *tree;            /* [2 leaves] node 1 the root, i's children 2i, 2i + 1;
                                           leaf of word w at leaves + w */
} mha__kv_pool;

/* Words, leaves and bytes (one allocation) of the pool structure of num_blocks; false on
 * overflow. */
int mha__kv_pool_sizes(int64_t num_blocks, int64_t *nwords, int64_t *leaves, size_t *bytes);
/* Blocks [0, taken) taken, the others free; mem holds mha__kv_pool_sizes's bytes, 8-byte
 * aligned. */
void mha__kv_pool_init(mha__kv_pool *p, void *mem, int64_t num_blocks, int64_t taken);
int mha__kv_pool_is_free(const mha__kv_pool *p, int64_t b);
/* Takes a free block (there is one) for the table entry after the one holding block prev (-1:
 * none): prev + 1 if free, else a new run in the largest free run. */
int64_t mha__kv_pool_take(mha__kv_pool *p, int64_t prev);
/* Block b (taken) is free again. */
void mha__kv_pool_release(mha__kv_pool *p, int64_t b);

struct mha_kv_cache {
    mha_kv_cache_config cfg;        /* resolved */
    int64_t slots;                  /* storage positions per sequence */
    int q8x16;                      /* q8_0 in the key-interleaved order (MHA__Q8X16 below);
                                       0: ggml's rows */
    const mha__kv_dtype_traits *dt; /* the storage dtype's row (base/kv_dtype.c) */
    size_t k_row_bytes;             /* bytes of one K row: dk / block * block_bytes */
    size_t v_row_bytes;             /* bytes of one V row */
    float *k_scale, *v_scale;       /* [g] per-kv-head scales (fp8; 1.0 for every other dtype) */
    void *k, *v;                    /* contiguous K [batch, g, slots, dk], V [.., dv]; paged
                                       K [g, num_blocks, bs, dk], V [.., dv] (mha__kv_slot_row) */
    int64_t *len;                   /* [batch] current lengths */
    int64_t *lo;                    /* [batch] lowest position whose slot is intact (window rings:
                                       grows as the ring wraps; truncate does not lower it) */
    int paged;         /* config.block_size > 0: blocks from a pool, shared, copy-on-write */
    int64_t bs;        /* slots per block (contiguous: slots) */
    int64_t nbs;       /* table entries per sequence: ceil(slots / bs) (a ring's last block
                          may be partly used) */
    int64_t *table;    /* [batch][nbs] block ids, -1 = none (contiguous: table[s] = {s}) */
    int64_t *ref;      /* [num_blocks] reference counts (paged) */
    mha__kv_pool pool; /* free blocks and placement (paged; kv_pool.c) */
    void *pool_mem;    /* its storage */
    int64_t nfree;     /* free blocks (paged) */
    int64_t
        block_rows; /* rows between block b and b + 1 of one kv head: contiguous g bs, paged bs */
    int64_t head_rows; /* rows between kv head g and g + 1 of one block: contiguous bs, paged
                          num_blocks bs */
    mha_allocator allocator;
    int has_allocator;
};

/* Smallest block size of a paged cache: a unit of MHA_DEC_BLOCK keys then spans at most
 * MHA_DEC_BLOCK / MHA__KV_MIN_BLOCK + 1 blocks, + 1 run where it wraps a ring. */
#define MHA__KV_MIN_BLOCK MHA__KV_MIN_BLOCK_SIZE

/* Row index (in rows of the K or V storage) of (seq, kv head, slot q): row q % bs of block
 * table[s][q / bs]. Contiguous caches give (s g_count + g) slots + q, as before pages; paged ones
 * (g num_blocks + b) bs + q % bs. */
static inline int64_t
mha__kv_slot_row(const struct mha_kv_cache *c, int64_t s, int64_t g, int64_t q) {
    const int64_t b = c->table[s * c->nbs + q / c->bs];
    return b * c->block_rows + g * c->head_rows + q % c->bs;
}

/* Address of K/V row (seq, kv head, logical position p): slot p % slots, through the table. */
static inline const void *
mha__kv_k_row(const struct mha_kv_cache *c, int64_t s, int64_t g, int64_t p) {
    return (const char *)c->k + (size_t)mha__kv_slot_row(c, s, g, p % c->slots) * c->k_row_bytes;
}
static inline const void *
mha__kv_v_row(const struct mha_kv_cache *c, int64_t s, int64_t g, int64_t p) {
    return (const char *)c->v + (size_t)mha__kv_slot_row(c, s, g, p % c->slots) * c->v_row_bytes;
}

/* q8_0 caches in the KEY-INTERLEAVED order (struct mha_kv_cache.q8x16; docs/INFERENCE.md, "A
 * key-interleaved q8_0 layout with VNNI"): the slots of a kv head's block go in groups of 16
 * (slot q: group q / 16, lane q % 16), each group the bytes of its 16 ggml rows reordered for
 * VPDPBUSD (16 x k_row_bytes, so a group sits where its 16 rows would), per q8_0 block b of d / 32:
 *   K: [b][chunk c 0..7][lane][4 bytes: k[lane][32 b + 4 c .. + 3] + 128 (as uint8)], d bytes per
 *      lane in all, then the float16 scales [b][lane];
 *   V: [lane / 4][element 0..d-1][lane % 4: v[lane][element] (int8)], then the scales [b][lane].
 * The values, scales and rounding are ggml's q8_0 (base/q8.c): only the order and K's +128 bias
 * differ. Groups never straddle blocks: paged caches take the order only with block_size % 16 ==
 * 0; a contiguous one rounds each kv head's slots up to a multiple of 16 (storage only: `slots`,
 * the ring and every limit are the rows order's). */
#define MHA__Q8X16_LANES 16

/* Address of the group holding slot q (the address row q & ~15 has in the rows order). */
static inline char *
mha__kv_q8x16_group(const struct mha_kv_cache *c, int v, int64_t s, int64_t g, int64_t q) {
    const int64_t row = mha__kv_slot_row(c, s, g, q & ~(int64_t)(MHA__Q8X16_LANES - 1));
    return (char *)(v ? c->v : c->k) + (size_t)row * (v ? c->v_row_bytes : c->k_row_bytes);
}

/* Position p of sequence s, kv head g, K (v = 0) or V (v = 1): read as float32 (dequantised,
 * fp8 times its scale), written from float32 (rounded to the storage dtype), moved to another
 * position's slot (the stored bytes). Every order and dtype; the generic and reference decode
 * paths, mha_kv_cache_read, append and accept go through them. */
void mha__kv_get(const struct mha_kv_cache *c, int v, int64_t s, int64_t g, int64_t p, float *dst);
void mha__kv_put(struct mha_kv_cache *c, int v, int64_t s, int64_t g, int64_t p, const float *src);
void mha__kv_move(struct mha_kv_cache *c, int64_t s, int64_t g, int64_t from, int64_t to);

/* Row of d values (d = dk or dv) stored at src in the cache's dtype, widened to float32 (Q8_0:
 * dequantised; FP8: times scale, the row's kv head's mha__kv_k_scale / _v_scale). The generic
 * kernel, the reference path and mha_kv_cache_read all read through it. */
static inline void mha__kv_load_row(
    const struct mha_kv_cache *c, const void *src, int64_t d, float *dst, float scale) {
    c->dt->to_f32(src, d, dst, scale);
}
static inline float mha__kv_k_scale(const struct mha_kv_cache *c, int64_t g) {
    return c->k_scale[g];
}
static inline float mha__kv_v_scale(const struct mha_kv_cache *c, int64_t g) {
    return c->v_scale[g];
}

/* fp8 caches in the vector kernels: they widen e4m3 values times 2^-8 (a float16 exponent
 * rebias, simd_*.h *_fp8_widen) and apply 2^8 and kv head g's scales once per unit: the scores'
 * scale times mha__kv_fp8_factor(k_scale), each row of the unit's o times (v_scale). *p is
 * copied into *tmp with the score scale changed; returns the problem the kernel then runs. */
static inline float mha__kv_fp8_factor(float scale) {
    return 256.0f * scale;
}
static inline const struct mha__dec_problem *
mha__kv_fp8_problem(const struct mha__dec_problem *p, int64_t g, struct mha__dec_problem *tmp);
static inline void
mha__kv_fp8_scale_o(const struct mha_kv_cache *c, int64_t g, float *o, int64_t rows, int64_t dv) {
    const float f = mha__kv_fp8_factor(c->v_scale[g]);
    for (int64_t i = 0; i < rows * dv; i++)
        o[i] *= f;
}

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
/* A paged cache's pool holds the blocks an append of t tokens to the S listed sequences needs
 * (new ones, copies of shared ones); NO_MEMORY with a message otherwise. OK for a contiguous
 * cache. Callers run it after the argument checks, before changing anything. */
mha_status mha__kv_check_pool(
    const struct mha_kv_cache *c, int64_t S, const int64_t *seq_ids, int64_t t, mha_error *err);
/* Sets sequence s's length (<= its length) and releases a paged cache's blocks that hold no
 * position below it; lo drops to new_len when above it (nothing below new_len is held). */
void mha__kv_set_len(struct mha_kv_cache *c, int64_t s, int64_t new_len);

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
    int prefetch_far; /* a second, longer prefetch distance (mha__cpu_decode_prefetch_far) */
} mha__dec_problem;

/* A work unit: keys [j0, j1) (logical positions) of kv head g of seq row s; next: the unit the
 * same thread computes next when that is not the following unit of the same (s, g) (a kernel may
 * prefetch its first rows; never read otherwise), or NULL. */
typedef struct mha__dec_unit {
    int64_t s, g, j0, j1;
    const struct mha__dec_unit *next;
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
 * or the generic kernel's dequantised K and V row, rows padded to 16 floats; for R > 4 at least
 * the AVX-512 kernel's wide path (decode_avx512.c): the query rows transposed [dk][rp] (rp = R
 * rounded up to 16), a score tile [16][rp], 16 widened K rows [16][dk rounded up to 16] and 16 V
 * rows [16][dv rounded up to 64], and the AVX2 kernel's (decode_avx2.c), whose pass 3 widens 64
 * V rows [64][dv rounded up to 16] at once. */
static inline int64_t mha__dec_scratch_floats(const mha__dec_problem *p) {
    const int64_t R = p->group * p->t, d = p->dk > p->dv ? p->dk : p->dv;
    const int64_t rp = (R + 15) & ~(int64_t)15;
    const int64_t rows = R * MHA_DEC_BLOCK + (R > 2 ? R : 2) * (d + 16) + 32;
    const int64_t wide = R * MHA_DEC_BLOCK + rp * (p->dk + 16) +
                         16 * ((p->dk + 15) & ~(int64_t)15) + 64 * ((p->dv + 63) & ~(int64_t)63) +
                         32;
    /* the interleaved q8_0 kernel (decode_q8x16_avx512vnni.c): scores [R][BLOCK + 32], 2^-e, the
     * digit corrections and digits per block of 4 rows (a multiple of 16 floats), the weight
     * digits of a chunk's 4 groups for 4 rows (room for d_v <= 512), 16 floats per row */
    const int64_t R4 = (R + 3) / 4;
    const int64_t q8x16 = R * (MHA_DEC_BLOCK + 32) + 4 * R4 + R4 * (p->dk / 32) * (12 + 96) +
                          4 * 4 * 16 * 16 + 16 * R + 16;
    const int64_t vec = R > 4 && wide > rows ? wide : rows;
    return p->cache->q8x16 && q8x16 > vec ? q8x16 : vec;
}

static inline const struct mha__dec_problem *
mha__kv_fp8_problem(const struct mha__dec_problem *p, int64_t g, struct mha__dec_problem *tmp) {
    *tmp = *p;
    tmp->scale = p->scale * mha__kv_fp8_factor(p->cache->k_scale[g]);
    return tmp;
}

/* The kernels (one line each in kernels/registry.def, op decode) are declared by registry.h. */

/* A run of consecutive cache rows of a unit: unit keys [y0, y0 + n) at K rows k + y k_row_bytes,
 * V rows v + y v_row_bytes (y < n). */
typedef struct mha__kv_run {
    int64_t y0, n;
    const char *k, *v;
} mha__kv_run;

/* Most runs of a unit of <= MHA_DEC_BLOCK keys: a contiguous cache gives one, or two when the
 * unit wraps its ring; a paged one one per block, plus one where it wraps its ring. */
#define MHA__KV_MAX_RUNS (MHA_DEC_BLOCK / MHA__KV_MIN_BLOCK + 2)

/* The runs of keys [j0, j0 + nb) (logical positions, nb <= min(slots, MHA_DEC_BLOCK)) of kv head
 * g of sequence seq, in key order; returns their number (<= MHA__KV_MAX_RUNS). The one place
 * that knows where the decode kernels' rows are (rings and pages). Consecutive blocks that are
 * adjacent in the pool (taken in order: head-major, a kv head's rows continue) make one run. */
static inline int mha__kv_runs(const struct mha_kv_cache *c,
                               int64_t seq,
                               int64_t g,
                               int64_t j0,
                               int64_t nb,
                               mha__kv_run runs[MHA__KV_MAX_RUNS]) {
    int nr = 0;
    for (int64_t y = 0, q = j0 % c->slots; y < nb && nr < MHA__KV_MAX_RUNS;) {
        int64_t left = c->bs - q % c->bs; /* slots left in q's block (and ring) */
        left = left < c->slots - q ? left : c->slots - q;
        const int64_t n = nb - y < left ? nb - y : left;
        const int64_t row = mha__kv_slot_row(c, seq, g, q);
        const char *k = (const char *)c->k + (size_t)row * c->k_row_bytes,
                   *v = (const char *)c->v + (size_t)row * c->v_row_bytes;
        mha__kv_run *last = nr > 0 ? &runs[nr - 1] : NULL;
        if (last && last->k + (size_t)last->n * c->k_row_bytes == k &&
            last->v + (size_t)last->n * c->v_row_bytes == v) {
            last->n += n;
        } else {
            runs[nr].y0 = y;
            runs[nr].n = n;
            runs[nr].k = k;
            runs[nr].v = v;
            nr++;
        }
        y += n;
        q += n;
        if (q == c->slots)
            q = 0;
    }
    return nr;
}

/* The address of every K and V row of keys [j0, j0 + nb) (kernels that walk rows one by one):
 * krows[y], vrows[y] for y < nb. */
static inline void mha__kv_unit_rows(const struct mha_kv_cache *c,
                                     int64_t seq,
                                     int64_t g,
                                     int64_t j0,
                                     int64_t nb,
                                     const char *krows[MHA_DEC_BLOCK],
                                     const char *vrows[MHA_DEC_BLOCK]) {
    mha__kv_run runs[MHA__KV_MAX_RUNS];
    const int nr = mha__kv_runs(c, seq, g, j0, nb, runs);
    for (int r = 0; r < nr; r++)
        for (int64_t y = 0; y < runs[r].n; y++) {
            krows[runs[r].y0 + y] = runs[r].k + (size_t)y * c->k_row_bytes;
            vrows[runs[r].y0 + y] = runs[r].v + (size_t)y * c->v_row_bytes;
        }
}

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
