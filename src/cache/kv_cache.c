/* SPDX-License-Identifier: MIT */
/* kv_cache.c: the KV cache object of mha.h's "Inference: KV cache" section: creation, lengths,
 * reset / truncate / copy of sequences, raw append and read-back. The attention over a cache and
 * the layer calls are in decode.c.
 *
 * Every call checks all of its arguments (check/cache.c) before changing anything, so a failing
 * call leaves the cache exactly as it was. Storage is allocated once at creation; appends never
 * allocate (a paged cache's appends take blocks from the pool allocated at creation).
 */
#include "cache/kv_cache.h"
#include "base/cpu_features.h"
#include "mha_experimental.h"

#include <string.h>

/* mha_kv_cache_create with the q8_0 order chosen: q8x16 = 1 asks for the key-interleaved one
 * (kv_cache.h; a q8_0 cache, contiguous or with block_size % 16 == 0). */
static mha_status create(const mha_kv_cache_config *config,
                         const mha_layer *layer,
                         const mha_allocator *allocator,
                         int q8x16,
                         mha_kv_cache **out,
                         mha_error *err) {
    if (out)
        *out = NULL;
    mha_kv_cache_config c;
    mha_status st =
        mha__check_kv_create(config, layer ? mha_layer_config(layer) : NULL, out, &c, err);
    if (st)
        return st;
    MHA_RETURN_IF(q8x16 && (c.dtype != MHA_DTYPE_Q8_0 || c.block_size % MHA__Q8X16_LANES != 0), err,
                  INVALID_ARG,
                  "the key-interleaved order is a q8_0 cache's, contiguous or with block_size a "
                  "multiple of %d (dtype %d, block_size %lld)",
                  MHA__Q8X16_LANES, (int)c.dtype, (long long)c.block_size);
    int64_t slots = c.max_seq;
    /* A ring of span W (window, or chunk size C: a token sees at most C keys) and steps of at
     * most T tokens: the first token of a step at p needs keys >= p - W + 1, the ring holds the
     * last W + T - 1 positions after the step's append. */
    const int64_t span = mha__kv_ring_span(&c);
    if (span > 0 && span + c.max_step_tokens - 1 < slots)
        slots = span + c.max_step_tokens - 1;
    /* Paged: ceil(slots / bs) table entries per sequence (a ring's last block may be partial:
     * the ring keeps the contiguous cache's slots, so its positions and limits are the same) */
    const int paged = c.block_size > 0;
    const int64_t bs = paged ? c.block_size : slots;
    const int64_t nbs = (slots + bs - 1) / bs;
    int64_t nblocks = c.batch; /* contiguous: one block of `slots` rows per sequence */
    if (paged && c.num_blocks == 0)
        nblocks = c.batch * nbs; /* <= 2^31 x 2^31 / 16 */
    else if (paged)
        nblocks = c.num_blocks;
    if (paged)
        c.num_blocks = nblocks;
    /* rows are d / block blocks (element types: blocks of 1) of block_bytes each */
    const mha__kv_dtype_traits *dt = mha__kv_dtype(c.dtype); /* non-NULL: checked */
    const size_t unit = dt->block_bytes;
    const int64_t per = dt->block;
    /* rows of storage per (block, kv head): bs, or a contiguous interleaved cache's slots rounded
     * up to whole groups */
    const int64_t cap =
        paged || !q8x16 ? bs : (bs + MHA__Q8X16_LANES - 1) / MHA__Q8X16_LANES * MHA__Q8X16_LANES;
    const int64_t kf[4] = {nblocks, c.num_kv_heads, cap, c.head_dim / per};
    const int64_t vf[4] = {nblocks, c.num_kv_heads, cap, c.v_head_dim / per};
    const int64_t mf[2] = {c.batch, nbs};
    int64_t kn, vn, tn, meta, pw, pl;
    size_t kb, vb, lb, sb, pb = 0;
    MHA_RETURN_IF(!mha__prod_i64(kf, 4, &kn) || !mha__prod_i64(vf, 4, &vn) ||
                      !mha__bytes(kn, unit, &kb) || !mha__bytes(vn, unit, &vb) ||
                      !mha__prod_i64(mf, 2, &tn) || !mha__add_i64(tn, 2 * c.batch, &meta) ||
                      !mha__add_i64(meta, nblocks, &meta) ||
                      !mha__bytes(meta, sizeof(int64_t), &lb) ||
                      !mha__bytes(2 * c.num_kv_heads, sizeof(float), &sb) ||
                      (paged && !mha__kv_pool_sizes(nblocks, &pw, &pl, &pb)),
                  err, OVERFLOW,
                  "kv cache of %lld blocks x g=%lld x %lld slots x (d_k=%lld + d_v=%lld) "
                  "overflows",
                  (long long)nblocks, (long long)c.num_kv_heads, (long long)bs,
                  (long long)c.head_dim, (long long)c.v_head_dim);
    mha_kv_cache *kc = mha__alloc(allocator, sizeof *kc);
    MHA_RETURN_IF(!kc, err, NO_MEMORY, "cannot allocate the kv cache");
    memset(kc, 0, sizeof *kc);
    kc->cfg = c;
    kc->slots = slots;
    kc->q8x16 = q8x16;
    kc->dt = dt;
    kc->k_row_bytes = (size_t)(c.head_dim / per) * unit;
    kc->v_row_bytes = (size_t)(c.v_head_dim / per) * unit;
    kc->paged = paged;
    kc->bs = bs;
    kc->nbs = nbs;
    kc->block_rows = paged ? bs : c.num_kv_heads * cap;
    kc->head_rows = paged ? nblocks * bs : cap;
    if (allocator) {
        kc->allocator = *allocator;
        kc->has_allocator = 1;
    }
    kc->k = mha__alloc_large(allocator, kb);
    kc->v = mha__alloc_large(allocator, vb);
    kc->len = mha__alloc(allocator, lb);
    kc->k_scale = mha__alloc(allocator, sb);
    kc->pool_mem = paged ? mha__alloc(allocator, pb) : NULL;
    if (!kc->k || !kc->v || !kc->len || !kc->k_scale || (paged && !kc->pool_mem)) {
        mha_kv_cache_destroy(kc);
        return mha__fail(err, MHA_STATUS_NO_MEMORY,
                         "cannot allocate the kv cache storage (%zu "
                         "bytes)",
                         kb + vb);
    }
    memset(kc->len, 0, 2 * sizeof(int64_t) * (size_t)c.batch);
    kc->lo = kc->len + c.batch;
    kc->v_scale = kc->k_scale + c.num_kv_heads;
    for (int64_t g = 0; g < 2 * c.num_kv_heads; g++)
        kc->k_scale[g] = 1.0f;
    kc->table = kc->lo + c.batch;
    kc->ref = kc->table + tn;
    for (int64_t i = 0; i < tn; i++) /* contiguous: sequence s owns block s for good */
        kc->table[i] = paged ? -1 : i;
    for (int64_t b = 0; b < nblocks; b++)
        kc->ref[b] = paged ? 0 : 1;
    if (paged)
        mha__kv_pool_init(&kc->pool, kc->pool_mem, nblocks, 0);
    kc->nfree = paged ? nblocks : 0;
    *out = kc;
    mha__ok(err);
    return MHA_STATUS_OK;
}

/* The order a q8_0 cache takes by itself: the key-interleaved one where its kernel runs (it needs
 * MHA_ISA_AVX512VNNI under MHA_MAX_ISA: its registry line) and was measured faster than the rows
 * kernel (mha__cpu_q8x16_preferred), and the storage allows it. test_kv_q8x16 checks this rule
 * against the registry (mha_experimental_cpu_q8x16). */
static int auto_q8x16(const mha_kv_cache_config *config) {
    return config && config->dtype == MHA_DTYPE_Q8_0 &&
           config->block_size % MHA__Q8X16_LANES == 0 &&
           (mha__cpu_isa() & MHA_ISA_AVX512VNNI) != 0 && mha__cpu_q8x16_preferred();
}

mha_status mha_kv_cache_create(const mha_kv_cache_config *config,
                               const mha_layer *layer,
                               const mha_allocator *allocator,
                               mha_kv_cache **out,
                               mha_error *err) {
    return create(config, layer, allocator, auto_q8x16(config), out, err);
}

mha_status mha_experimental_kv_cache_create_q8_order(const mha_kv_cache_config *config,
                                                     const mha_layer *layer,
                                                     const mha_allocator *allocator,
                                                     int32_t interleaved,
                                                     mha_kv_cache **out,
                                                     mha_error *err) {
    return create(config, layer, allocator, interleaved != 0, out, err);
}

int32_t mha_experimental_kv_cache_q8x16(const mha_kv_cache *cache) {
    return cache ? cache->q8x16 : -1;
}

void mha_kv_cache_destroy(mha_kv_cache *cache) {
    if (!cache)
        return;
    const mha_allocator copy = cache->allocator;
    const mha_allocator *a = cache->has_allocator ? &copy : NULL;
    mha__free(a, cache->k);
    mha__free(a, cache->v);
    mha__free(a, cache->len);
    mha__free(a, cache->k_scale);
    mha__free(a, cache->pool_mem);
    mha__free(a, cache);
}

const mha_kv_cache_config *mha_kv_cache_get_config(const mha_kv_cache *cache) {
    return cache ? &cache->cfg : NULL;
}

int64_t mha_kv_cache_slots(const mha_kv_cache *cache) {
    return cache ? cache->slots : -1;
}

int64_t mha_kv_cache_length(const mha_kv_cache *cache, int64_t seq) {
    if (!cache || seq < 0 || seq >= cache->cfg.batch)
        return -1;
    return cache->len[seq];
}

/* Drops one reference to block b of a paged cache; the last returns it to the pool. */
static void release_block(mha_kv_cache *c, int64_t b) {
    if (--c->ref[b] == 0) {
        mha__kv_pool_release(&c->pool, b);
        c->nfree++;
    }
}

/* Kv head g's part of block b in the K (v = 0) or V (v = 1) storage: bs rows, part_bytes long. */
static size_t part_bytes(const mha_kv_cache *c, int v) {
    return (size_t)c->bs * (v ? c->v_row_bytes : c->k_row_bytes);
}
static char *block_part(const mha_kv_cache *c, int v, int64_t b, int64_t g) {
    return (char *)(v ? c->v : c->k) +
           (size_t)(b * c->block_rows + g * c->head_rows) * (v ? c->v_row_bytes : c->k_row_bytes);
}

/* Table entry e of sequence s of a paged cache, made writable: a block taken from the pool when
 * there is none, a private copy when the block is shared; placed after the block of entry e - 1
 * when it can be (kv_pool.c). The pool check (mha__kv_check_pool) ran first, so the pool is not
 * empty here. */
static void writable_entry(mha_kv_cache *c, int64_t s, int64_t e) {
    int64_t *slot = &c->table[s * c->nbs + e];
    if (*slot >= 0 && c->ref[*slot] == 1)
        return;
    const int64_t b = mha__kv_pool_take(&c->pool, e > 0 ? slot[-1] : -1);
    c->nfree--;
    c->ref[b] = 1;
    if (*slot >= 0) { /* copy-on-write: every row, written or not (rows past the length are
                         never read) */
        for (int v = 0; v < 2; v++)
            for (int64_t g = 0; g < c->cfg.num_kv_heads; g++)
                memcpy(block_part(c, v, b, g), block_part(c, v, *slot, g), part_bytes(c, v));
        release_block(c, *slot);
    }
    *slot = b;
}

void mha__kv_set_len(mha_kv_cache *c, int64_t s, int64_t new_len) {
    c->len[s] = new_len;
    if (c->lo[s] > new_len) /* nothing below new_len is held (length 0, or a ring rolled back to
                               a chunk's start it had overwritten): the next appends are */
        c->lo[s] = new_len;
    if (!c->paged || new_len >= c->slots)
        return; /* a full ring: every slot may hold a position below new_len */
    /* positions < new_len < slots live in slots [0, new_len): later entries hold none */
    for (int64_t e = (new_len + c->bs - 1) / c->bs; e < c->nbs; e++) {
        int64_t *slot = &c->table[s * c->nbs + e];
        if (*slot >= 0)
            release_block(c, *slot);
        *slot = -1;
    }
}

/* Blocks an append of t tokens to sequence s takes from the pool: each table entry the new
 * positions touch that has no block or a shared one (counted once even when a ring's range comes
 * back to its first entry). */
static int64_t blocks_needed(const mha_kv_cache *c, int64_t s, int64_t t) {
    const int64_t n = t < c->slots ? t : c->slots;
    int64_t need = 0, q = c->len[s] % c->slots, first = -1;
    for (int64_t k = 0; k < n;) {
        const int64_t e = q / c->bs, b = c->table[s * c->nbs + e];
        if (e == first)
            break;
        if (first < 0)
            first = e;
        need += b < 0 || c->ref[b] > 1;
        const int64_t to_block_end = c->bs - q % c->bs;
        const int64_t adv = to_block_end < c->slots - q ? to_block_end : c->slots - q;
        k += adv;
        q = q + adv == c->slots ? 0 : q + adv;
    }
    return need;
}

mha_status mha__kv_check_pool(
    const mha_kv_cache *c, int64_t S, const int64_t *seq_ids, int64_t t, mha_error *err) {
    if (!c->paged)
        return MHA_STATUS_OK;
    int64_t need = 0;
    for (int64_t i = 0; i < S; i++)
        need += blocks_needed(c, seq_ids ? seq_ids[i] : i, t);
    MHA_RETURN_IF(need > c->nfree, err, NO_MEMORY,
                  "kv cache pool exhausted: appending %lld tokens to %lld sequences needs %lld "
                  "free blocks of %lld slots, %lld of %lld are free (nothing appended; reset or "
                  "truncate sequences, or create the cache with more num_blocks)",
                  (long long)t, (long long)S, (long long)need, (long long)c->bs,
                  (long long)c->nfree, (long long)c->cfg.num_blocks);
    return MHA_STATUS_OK;
}

mha_status mha_kv_cache_reset(mha_kv_cache *cache, int64_t seq, mha_error *err) {
    const mha__kv_view view = mha__kv_view_of(cache);
    mha_status st = mha__check_kv_seq(&view, seq, "seq", err);
    if (st)
        return st;
    mha__kv_set_len(cache, seq, 0);
    cache->lo[seq] = 0;
    mha__ok(err);
    return MHA_STATUS_OK;
}

mha_status
mha_kv_cache_truncate(mha_kv_cache *cache, int64_t seq, int64_t new_len, mha_error *err) {
    const mha__kv_view view = mha__kv_view_of(cache);
    mha_status st = mha__check_kv_truncate(&view, seq, new_len, "truncate", "new_len", err);
    if (st)
        return st;
    mha__kv_set_len(cache, seq, new_len);
    mha__ok(err);
    return MHA_STATUS_OK;
}

/* A paged cache: the blocks mha_kv_cache_accept writes into must not be shared (copy-on-write
 * takes a free block for each shared one): NO_MEMORY with nothing moved when the pool is short. */
static mha_status accept_pool(const mha_kv_cache *c,
                              int64_t seq,
                              int64_t base_len,
                              int64_t n,
                              const int64_t *draft_idx,
                              mha_error *err) {
    if (!c->paged)
        return MHA_STATUS_OK;
    int64_t need = 0, last = -1;
    for (int64_t k = 0; k < n; k++) {
        const int64_t to = base_len + k, e = to % c->slots / c->bs;
        const int64_t b = c->table[seq * c->nbs + e];
        if (base_len + draft_idx[k] == to || e == last)
            continue;
        last = e;
        need += b < 0 || c->ref[b] > 1;
    }
    MHA_RETURN_IF(need > c->nfree, err, NO_MEMORY,
                  "kv cache pool exhausted: accept needs %lld free blocks (copies of shared "
                  "blocks), %lld are free (nothing moved)",
                  (long long)need, (long long)c->nfree);
    return MHA_STATUS_OK;
}

mha_status mha_kv_cache_accept(mha_kv_cache *cache,
                               int64_t seq,
                               int64_t base_len,
                               int64_t n,
                               const int64_t *draft_idx,
                               mha_error *err) {
    const mha__kv_view view = mha__kv_view_of(cache);
    mha_status st = mha__check_kv_accept(&view, seq, base_len, n, draft_idx, err);
    if (!st)
        st = accept_pool(cache, seq, base_len, n, draft_idx, err);
    if (st)
        return st;
    /* Row k moves from base_len + draft_idx[k] >= base_len + k (strictly increasing indices), so
     * in increasing k no move overwrites a row still to be moved. */
    for (int64_t g = 0; g < cache->cfg.num_kv_heads; g++)
        for (int64_t k = 0; k < n; k++) {
            const int64_t from = base_len + draft_idx[k], to = base_len + k;
            if (from == to)
                continue;
            if (cache->paged)
                writable_entry(cache, seq, to % cache->slots / cache->bs);
            mha__kv_move(cache, seq, g, from, to);
        }
    mha__kv_set_len(cache, seq, base_len + n); /* a paged cache releases the blocks past it */
    mha__ok(err);
    return MHA_STATUS_OK;
}

/* dst becomes a copy of src (src != dst, both checked). */
static void copy_seq(mha_kv_cache *cache, int64_t src_seq, int64_t dst_seq) {
    const int64_t L = cache->len[src_seq];
    if (cache->paged) { /* share src's blocks: references first, then drop dst's own */
        int64_t *ts = cache->table + src_seq * cache->nbs,
                *td = cache->table + dst_seq * cache->nbs;
        for (int64_t e = 0; e < cache->nbs; e++) {
            if (ts[e] >= 0)
                cache->ref[ts[e]]++;
            if (td[e] >= 0)
                release_block(cache, td[e]);
            td[e] = ts[e];
        }
    } else {
        const int64_t G = cache->cfg.num_kv_heads, slots = cache->slots;
        int64_t n = L < slots ? L : slots; /* slots in use */
        if (cache->q8x16)                  /* whole groups (within the rounded-up storage) */
            n = (n + MHA__Q8X16_LANES - 1) / MHA__Q8X16_LANES * MHA__Q8X16_LANES;
        for (int64_t g = 0; g < G; g++) {
            /* Copying slots [0, n) covers every stored position, ring or not. */
            const size_t kb = (size_t)n * cache->k_row_bytes;
            const size_t vb = (size_t)n * cache->v_row_bytes;
            memcpy((void *)mha__kv_k_row(cache, dst_seq, g, 0), mha__kv_k_row(cache, src_seq, g, 0),
                   kb);
            memcpy((void *)mha__kv_v_row(cache, dst_seq, g, 0), mha__kv_v_row(cache, src_seq, g, 0),
                   vb);
        }
    }
    cache->len[dst_seq] = L;
    cache->lo[dst_seq] = cache->lo[src_seq];
}

mha_status
mha_kv_cache_copy(mha_kv_cache *cache, int64_t src_seq, int64_t dst_seq, mha_error *err) {
    const mha__kv_view view = mha__kv_view_of(cache);
    mha_status st = mha__check_kv_seq(&view, src_seq, "src_seq", err);
    if (!st)
        st = mha__check_kv_seq(&view, dst_seq, "dst_seq", err);
    if (st)
        return st;
    if (src_seq != dst_seq)
        copy_seq(cache, src_seq, dst_seq);
    mha__ok(err);
    return MHA_STATUS_OK;
}

mha_status mha_kv_cache_set_fp8_scales(mha_kv_cache *cache,
                                       const float *k_scales,
                                       const float *v_scales,
                                       mha_error *err) {
    const mha__kv_view view = mha__kv_view_of(cache);
    mha_status st = mha__check_kv_fp8_scales(&view, k_scales, v_scales, err);
    if (st)
        return st;
    const int64_t G = cache->cfg.num_kv_heads;
    if (k_scales)
        memcpy(cache->k_scale, k_scales, sizeof(float) * (size_t)G);
    if (v_scales)
        memcpy(cache->v_scale, v_scales, sizeof(float) * (size_t)G);
    mha__ok(err);
    return MHA_STATUS_OK;
}

mha_status mha_kv_cache_share_prefix(
    mha_kv_cache *cache, int64_t src_seq, int64_t dst_seq, int64_t len, mha_error *err) {
    const mha__kv_view view = mha__kv_view_of(cache);
    mha_status st = mha__check_kv_seq(&view, dst_seq, "dst_seq", err);
    if (!st) /* src could be truncated to len: then the fork can */
        st = mha__check_kv_truncate(&view, src_seq, len, "share_prefix", "len", err);
    if (st)
        return st;
    if (src_seq != dst_seq)
        copy_seq(cache, src_seq, dst_seq);
    mha__kv_set_len(cache, dst_seq, len);
    mha__ok(err);
    return MHA_STATUS_OK;
}

int64_t mha_kv_cache_free_blocks(const mha_kv_cache *cache) {
    return cache ? cache->nfree : -1;
}

/* mha_kv_cache_compact's new id of every block, a permutation of the pool: the blocks sequences
 * hold get 0, 1, ... in the order the sequences (by id) reach them through their tables (a shared
 * block once), the free blocks the rest in id order. Returns how many are held. */
static int64_t compact_dest(const mha_kv_cache *c, int64_t *dest) {
    const int64_t nb = c->cfg.num_blocks;
    for (int64_t b = 0; b < nb; b++)
        dest[b] = -1;
    int64_t next = 0;
    for (int64_t i = 0; i < c->cfg.batch * c->nbs; i++) {
        const int64_t b = c->table[i];
        if (b >= 0 && dest[b] < 0)
            dest[b] = next++;
    }
    const int64_t held = next;
    for (int64_t b = 0; b < nb; b++)
        if (dest[b] < 0)
            dest[b] = next++;
    return held;
}

/* Moves the contents and reference counts of the blocks of the cycle of dest through b0 (block b
 * goes to dest[b]), one part (kv head, K or V) at a time: the part of b0 is carried, and at each
 * block of the cycle it is written there after that block's own part is picked up. Free blocks'
 * contents are never read, so they are neither carried nor written. bufs: two parts. */
static void compact_cycle(mha_kv_cache *c, const int64_t *dest, int64_t b0, char *bufs) {
    const size_t half = part_bytes(c, 0) > part_bytes(c, 1) ? part_bytes(c, 0) : part_bytes(c, 1);
    for (int v = 0; v < 2; v++)
        for (int64_t g = 0; g < c->cfg.num_kv_heads; g++) {
            char *carry = bufs, *spare = bufs + half;
            const size_t bytes = part_bytes(c, v);
            int full = c->ref[b0] > 0; /* the carried part is a held block's */
            if (full)
                memcpy(carry, block_part(c, v, b0, g), bytes);
            for (int64_t b = dest[b0];; b = dest[b]) {
                char *at = block_part(c, v, b, g);
                const int next_full = b != b0 && c->ref[b] > 0;
                if (next_full)
                    memcpy(spare, at, bytes);
                if (full)
                    memcpy(at, carry, bytes);
                if (b == b0)
                    break;
                char *t = carry;
                carry = spare;
                spare = t;
                full = next_full;
            }
        }
    int64_t ref = c->ref[b0]; /* the counts last: the parts' loops read them */
    for (int64_t b = dest[b0];; b = dest[b]) {
        const int64_t own = c->ref[b];
        c->ref[b] = ref;
        ref = own;
        if (b == b0)
            break;
    }
}

mha_status mha_kv_cache_compact(mha_kv_cache *cache, mha_error *err) {
    const mha__kv_view view = mha__kv_view_of(cache);
    mha_status st = mha__check_kv_compact(&view, err);
    if (st || !cache->paged)
        return st;
    const int64_t nb = cache->cfg.num_blocks;
    const size_t row =
        cache->k_row_bytes > cache->v_row_bytes ? cache->k_row_bytes : cache->v_row_bytes;
    size_t ids, parts;
    MHA_RETURN_IF(!mha__bytes(nb, sizeof(int64_t), &ids) ||
                      !mha__bytes(2 * cache->bs, row, &parts) || ids > SIZE_MAX - parts,
                  err, OVERFLOW, "kv cache compaction: working memory for %lld blocks overflows",
                  (long long)nb);
    const mha_allocator *a = cache->has_allocator ? &cache->allocator : NULL;
    int64_t *dest = mha__alloc(a, ids + parts);
    MHA_RETURN_IF(!dest, err, NO_MEMORY,
                  "kv cache compaction: cannot allocate %zu bytes of working memory (nothing "
                  "moved)",
                  ids + parts);
    const int64_t held = compact_dest(cache, dest);
    for (int64_t i = 0; i < cache->cfg.batch * cache->nbs; i++)
        if (cache->table[i] >= 0)
            cache->table[i] = dest[cache->table[i]];
    for (int64_t b0 = 0; b0 < nb; b0++) {
        if (dest[b0] == b0)
            continue; /* in place, or its cycle is done */
        compact_cycle(cache, dest, b0, (char *)(dest + nb));
        for (int64_t b = b0; dest[b] != b;) {
            const int64_t next = dest[b];
            dest[b] = b;
            b = next;
        }
    }
    mha__free(a, dest);
    mha__kv_pool_init(&cache->pool, cache->pool_mem, nb, held);
    mha__ok(err);
    return MHA_STATUS_OK;
}

int64_t mha_experimental_kv_cache_block(const mha_kv_cache *cache, int64_t seq, int64_t entry) {
    if (!cache || !cache->paged || seq < 0 || seq >= cache->cfg.batch || entry < 0 ||
        entry >= cache->nbs)
        return -1;
    return cache->table[seq * cache->nbs + entry];
}

mha_status mha_kv_cache_read(
    const mha_kv_cache *cache, int64_t seq, int64_t pos, float *k, float *v, mha_error *err) {
    const mha__kv_view view = mha__kv_view_of(cache);
    mha_status st = mha__check_kv_read(&view, seq, pos, k, v, err);
    if (st)
        return st;
    const int64_t G = cache->cfg.num_kv_heads, dk = cache->cfg.head_dim;
    const int64_t dv = cache->cfg.v_head_dim;
    for (int64_t g = 0; g < G; g++) {
        if (k)
            mha__kv_get(cache, 0, seq, g, pos, k + g * dk);
        if (v)
            mha__kv_get(cache, 1, seq, g, pos, v + g * dv);
    }
    mha__ok(err);
    return MHA_STATUS_OK;
}

void mha__kv_append_raw(mha_kv_cache *c,
                        int64_t S,
                        const int64_t *seq_ids,
                        int64_t t,
                        const float *k,
                        int64_t k_seq_stride,
                        int64_t k_tok_stride,
                        const float *v,
                        int64_t v_seq_stride,
                        int64_t v_tok_stride) {
    const int64_t G = c->cfg.num_kv_heads, dk = c->cfg.head_dim, dv = c->cfg.v_head_dim;
    for (int64_t i = 0; i < S; i++) {
        const int64_t s = seq_ids ? seq_ids[i] : i;
        for (int64_t tok = 0; tok < t; tok++) {
            const int64_t p = c->len[s] + tok;
            if (c->paged)
                writable_entry(c, s, p % c->slots / c->bs);
            for (int64_t g = 0; g < G; g++) {
                mha__kv_put(c, 0, s, g, p, k + i * k_seq_stride + tok * k_tok_stride + g * dk);
                mha__kv_put(c, 1, s, g, p, v + i * v_seq_stride + tok * v_tok_stride + g * dv);
            }
        }
        c->len[s] += t;
        if (c->len[s] - c->slots > c->lo[s])
            c->lo[s] = c->len[s] - c->slots;
    }
}

mha_status mha_kv_cache_append(mha_kv_cache *cache,
                               int64_t num_seqs,
                               const int64_t *seq_ids,
                               int64_t t,
                               const float *k,
                               const float *v,
                               mha_error *err) {
    const mha__kv_view view = mha__kv_view_of(cache);
    mha_status st = mha__check_kv_append(&view, num_seqs, seq_ids, t, k, v, err);
    if (!st)
        st = mha__kv_check_pool(cache, num_seqs, seq_ids, t, err);
    if (st)
        return st;
    const int64_t G = cache->cfg.num_kv_heads;
    const int64_t kt = G * cache->cfg.head_dim, vt = G * cache->cfg.v_head_dim;
    mha__kv_append_raw(cache, num_seqs, seq_ids, t, k, t * kt, kt, v, t * vt, vt);
    mha__ok(err);
    return MHA_STATUS_OK;
}
