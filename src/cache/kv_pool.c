/* SPDX-License-Identifier: MIT */
/* kv_pool.c: block placement of a paged KV cache's pool (docs/INFERENCE.md "Paged cache",
 * "Block placement").
 *
 * Policy: a table entry that needs a block takes the block right after the block of the
 * sequence's previous table entry when that one is free (a growing sequence continues its run);
 * otherwise it starts a new run in the largest free run of the pool (the leftmost of the
 * longest): at its first block when the run begins at block 0, else at its middle (block
 * at + (len - 1) / 2), so that the sequence that ends just before the run, and the new one, both
 * have room to grow. Sequences growing in lockstep (continuous batching) then each get long runs
 * instead of interleaving block by block, and a sequence prefilled alone into a fresh pool gets
 * blocks 0, 1, 2, ... as before.
 *
 * Structure: a bitmap (bit b % 64 of word b / 64 set = block b free) and a segment tree over its
 * words. Each tree node covers a power-of-two range of words and keeps the free blocks at the
 * start and at the end of its range, its longest free run and that run's first block; a leaf is
 * computed from its word, an inner node from its two children (the longest run is the left
 * child's, the run across the middle, or the right child's, leftmost first). Taking or releasing
 * a block changes one bit and recomputes one leaf (at most 32 runs of the word) and the log2(words)
 * nodes above it; the root gives the largest free run in O(1). Memory: 8 bytes per 64 blocks for
 * the bitmap, 2 x 32 bytes per leaf word for the tree (about 1 byte per block). Everything is
 * deterministic: the same calls give the same block ids.
 */
#include "cache/kv_cache.h"

#include <string.h>

static int64_t ones_at_start(uint64_t x) {
    return ~x == 0 ? 64 : __builtin_ctzll(~x);
}
static int64_t ones_at_end(uint64_t x) {
    return ~x == 0 ? 64 : __builtin_clzll(~x);
}

/* The leaf of word w (blocks 64 w .. 64 w + 63; words past the bitmap have no free block). */
static void pool_leaf(mha__kv_pool *p, int64_t w) {
    const uint64_t x = w < p->nwords ? p->bits[w] : 0;
    mha__kv_pool_node *n = &p->tree[p->leaves + w];
    n->pre = ones_at_start(x);
    n->suf = ones_at_end(x);
    n->best = 0;
    n->at = -1;
    for (uint64_t y = x; y != 0;) { /* the runs of ones of y, lowest first */
        const int s = __builtin_ctzll(y);
        const int64_t len = ones_at_start(y >> s);
        if (len > n->best) {
            n->best = len;
            n->at = 64 * w + s;
        }
        y = len + s >= 64 ? 0 : y & ~(((UINT64_C(1) << len) - 1) << s);
    }
}

/* Node i from its children; child_span = blocks each child covers, first = the first block of
 * the right child. */
static void pool_join(mha__kv_pool *p, int64_t i, int64_t child_span, int64_t first) {
    const mha__kv_pool_node *l = &p->tree[2 * i], *r = &p->tree[2 * i + 1];
    mha__kv_pool_node *n = &p->tree[i];
    n->pre = l->pre == child_span ? child_span + r->pre : l->pre;
    n->suf = r->suf == child_span ? child_span + l->suf : r->suf;
    n->best = l->best;
    n->at = l->at;
    if (l->suf + r->pre > n->best) {
        n->best = l->suf + r->pre;
        n->at = first - l->suf;
    }
    if (r->best > n->best) {
        n->best = r->best;
        n->at = r->at;
    }
}

/* Recomputes the leaf of word w and every node above it. */
static void pool_update(mha__kv_pool *p, int64_t w) {
    pool_leaf(p, w);
    int64_t span = 64, level = p->leaves; /* nodes on the children's level */
    for (int64_t i = (p->leaves + w) / 2; i >= 1; i /= 2) {
        pool_join(p, i, span, (2 * i + 1 - level) * span);
        span *= 2;
        level /= 2;
    }
}

int mha__kv_pool_sizes(int64_t num_blocks, int64_t *nwords, int64_t *leaves, size_t *bytes) {
    *nwords = (num_blocks + 63) / 64;
    *leaves = 1;
    while (*leaves < *nwords)
        *leaves *= 2;
    /* nodes of 4 int64_t, words of 8 bytes; leaves < 2 nwords <= 2^26 */
    return mha__bytes(*nwords + 2 * *leaves * 4, sizeof(int64_t), bytes);
}

void mha__kv_pool_init(mha__kv_pool *p, void *mem, int64_t num_blocks, int64_t taken) {
    size_t unused;
    mha__kv_pool_sizes(num_blocks, &p->nwords, &p->leaves, &unused);
    p->num_blocks = num_blocks;
    p->tree = mem; /* nodes first: 8-byte aligned like the allocation */
    p->bits = (uint64_t *)(p->tree + 2 * p->leaves);
    for (int64_t w = 0; w < p->nwords; w++) { /* word w: blocks 64 w .. 64 w + 63 */
        const int64_t hi = num_blocks - 64 * w, lo = taken - 64 * w; /* free: [lo, hi) */
        const uint64_t below_hi = hi >= 64 ? ~UINT64_C(0) : (UINT64_C(1) << hi) - 1;
        const uint64_t below_lo = lo <= 0 ? 0 : lo >= 64 ? ~UINT64_C(0) : (UINT64_C(1) << lo) - 1;
        p->bits[w] = below_hi & ~below_lo;
    }
    for (int64_t w = 0; w < p->leaves; w++)
        pool_leaf(p, w);
    int64_t span = 64, level = p->leaves;
    for (int64_t i = p->leaves - 1; i >= 1; i--) {
        while (i < level / 2) { /* moved up a level */
            span *= 2;
            level /= 2;
        }
        pool_join(p, i, span, (2 * i + 1 - level) * span);
    }
}

int mha__kv_pool_is_free(const mha__kv_pool *p, int64_t b) {
    return b >= 0 && b < p->num_blocks && (p->bits[b / 64] >> (b % 64) & 1u);
}

int64_t mha__kv_pool_take(mha__kv_pool *p, int64_t prev) {
    int64_t b;
    if (prev >= 0 && mha__kv_pool_is_free(p, prev + 1)) {
        b = prev + 1;
    } else {
        const mha__kv_pool_node *root = &p->tree[1]; /* best >= 1: the caller checked nfree */
        b = root->at == 0 ? 0 : root->at + (root->best - 1) / 2;
    }
    p->bits[b / 64] &= ~(UINT64_C(1) << (b % 64));
    pool_update(p, b / 64);
    return b;
}

void mha__kv_pool_release(mha__kv_pool *p, int64_t b) {
    p->bits[b / 64] |= UINT64_C(1) << (b % 64);
    pool_update(p, b / 64);
}
