/* SPDX-License-Identifier: MIT */
/* fuzz_kv_cache.c: libFuzzer harness for the paged KV cache's block bookkeeping (docs/INFERENCE.md
 * "Paged cache", "Block placement", "Compaction").
 *
 * The input picks a small cache configuration (g, d, dtype, window or chunk ring, max_seq, batch,
 * max_step_tokens, block size, a pool from tight to roomy) and creates it twice: paged, and
 * contiguous (its oracle: docs/SEMANTICS.md says paged results equal the contiguous cache's bit
 * for bit). Then up to 48 operations, each with arguments from the input and sometimes out of
 * range, are applied to both: append (1..max_step tokens to a random set of sequences), copy,
 * share_prefix, truncate, reset, accept, read, attention (t = 1..3, or a draft tree), and
 * compact (paged only).
 *
 * Invariants: no crash, leak or UB (ASan/UBSan); both caches return the same status for every
 * call, except that the paged one may refuse an append or an accept with NO_MEMORY (its pool
 * cannot give the blocks or copies the call needs), which must change nothing (lengths, free
 * blocks); errors fill mha_error; lengths stay equal; reads and
 * attention outputs (and lse) are equal bit for bit; the free-block count equals the pool size
 * minus the distinct blocks the tables hold; after compact the tables' blocks are 0, 1, 2, ... in
 * table order. Allocations through the paged cache's counting allocator are all given back.
 */
#include "fuzz_common.h"

#include "mha_experimental.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum { MAX_B = 4, MAX_T = 8, MAX_G = 2, MAX_D = 64, MAX_H = 4, MAX_SEQ = 160, MAX_OPS = 48 };

typedef struct twin {
    mha_kv_cache *c[2]; /* paged, contiguous */
    int64_t g, d, h, batch, max_step, entries, nblocks;
} twin;

/* Deterministic values in [-2, 2) from a seed (xorshift). */
static void fill(float *x, int64_t n, uint64_t seed) {
    uint64_t s = seed | 1;
    for (int64_t i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        x[i] = (float)(s >> 40) * 0x1.0p-22f - 2.0f;
    }
}

/* Both calls' statuses agree (and errors are well-formed); returns the status. */
static mha_status same(mha_status s0, const mha_error *e0, mha_status s1, const mha_error *e1) {
    if (s0)
        fuzz_check_error(s0, e0);
    if (s1)
        fuzz_check_error(s1, e1);
    FUZZ_REQUIRE(s0 == s1, "paged %d (%s) vs contiguous %d (%s)", (int)s0, s0 ? e0->message : "",
                 (int)s1, s1 ? e1->message : "");
    return s0;
}

/* Distinct blocks the paged tables hold, and whether (after compact) they are 0, 1, ... in
 * table order. */
static int64_t held_blocks(const twin *tw, int *in_order) {
    unsigned char seen[64] = {0}; /* nblocks <= MAX_B (MAX_SEQ / 16 + 1) + 2 */
    int64_t held = 0;
    *in_order = 1;
    for (int64_t s = 0; s < tw->batch; s++)
        for (int64_t e = 0; e < tw->entries; e++) {
            const int64_t b = mha_experimental_kv_cache_block(tw->c[0], s, e);
            FUZZ_REQUIRE(b >= -1 && b < tw->nblocks, "block %lld of %lld", (long long)b,
                         (long long)tw->nblocks);
            if (b < 0 || seen[b])
                continue;
            seen[b] = 1;
            *in_order &= b == held++;
        }
    return held;
}

static void check_state(const twin *tw, int compacted) {
    for (int64_t s = 0; s < tw->batch; s++)
        FUZZ_REQUIRE(mha_kv_cache_length(tw->c[0], s) == mha_kv_cache_length(tw->c[1], s),
                     "length of %lld", (long long)s);
    int in_order;
    const int64_t held = held_blocks(tw, &in_order);
    FUZZ_REQUIRE(mha_kv_cache_free_blocks(tw->c[0]) == tw->nblocks - held,
                 "free %lld, pool %lld, held %lld", (long long)mha_kv_cache_free_blocks(tw->c[0]),
                 (long long)tw->nblocks, (long long)held);
    FUZZ_REQUIRE(!compacted || in_order, "compact left the blocks out of order");
}

/* A set of distinct sequence ids (1..batch of them) into ids; its size. */
static int64_t pick_seqs(fuzz_reader *r, const twin *tw, int64_t *ids) {
    const int64_t n = 1 + fuzz_below(r, tw->batch);
    int64_t k = 0;
    const int64_t first = fuzz_below(r, tw->batch);
    for (int64_t i = 0; i < tw->batch && k < n; i++)
        ids[k++] = (first + i) % tw->batch;
    return k;
}

/* The paged cache refused a call with NO_MEMORY (its pool): nothing may have changed since
 * len / nfree were taken; the twin is not called. Returns whether that was the case. */
static int pool_refused(
    const twin *tw, mha_status st, const mha_error *err, const int64_t *len, int64_t nfree) {
    if (st != MHA_STATUS_NO_MEMORY)
        return 0;
    fuzz_check_error(st, err);
    FUZZ_REQUIRE(mha_kv_cache_free_blocks(tw->c[0]) == nfree, "NO_MEMORY took blocks");
    for (int64_t s = 0; s < tw->batch; s++)
        FUZZ_REQUIRE(mha_kv_cache_length(tw->c[0], s) == len[s], "NO_MEMORY changed a length");
    return 1;
}

static int64_t lengths(const twin *tw, int64_t *len) {
    for (int64_t s = 0; s < tw->batch; s++)
        len[s] = mha_kv_cache_length(tw->c[0], s);
    return mha_kv_cache_free_blocks(tw->c[0]);
}

static void op_append(fuzz_reader *r, twin *tw) {
    int64_t ids[MAX_B];
    const int64_t S = pick_seqs(r, tw, ids), t = 1 + fuzz_below(r, tw->max_step + 1);
    static float k[MAX_B * (MAX_T + 1) * MAX_G * MAX_D], v[MAX_B * (MAX_T + 1) * MAX_G * MAX_D];
    fill(k, S * t * tw->g * tw->d, fuzz_u64(r));
    fill(v, S * t * tw->g * tw->d, fuzz_u64(r));
    int64_t len[MAX_B];
    const int64_t nfree = lengths(tw, len);
    mha_error e0, e1;
    const mha_status s0 = mha_kv_cache_append(tw->c[0], S, ids, t, k, v, &e0);
    if (!pool_refused(tw, s0, &e0, len, nfree))
        same(s0, &e0, mha_kv_cache_append(tw->c[1], S, ids, t, k, v, &e1), &e1);
}

/* A sequence id, sometimes out of range. */
static int64_t pick_seq(fuzz_reader *r, const twin *tw) {
    const uint8_t sel = fuzz_u8(r);
    return sel < 240 ? sel % tw->batch : sel % 2 ? -1 : tw->batch;
}

/* A length near sequence s's (0 .. len + 1), sometimes hostile. */
static int64_t pick_len(fuzz_reader *r, const twin *tw, int64_t s) {
    const int64_t len = s >= 0 && s < tw->batch ? mha_kv_cache_length(tw->c[1], s) : 4;
    const uint8_t sel = fuzz_u8(r);
    return sel < 250 ? (int64_t)(sel % (len + 2)) : sel % 2 ? -1 : INT64_MAX;
}

static void op_accept(fuzz_reader *r, twin *tw) {
    const int64_t s = pick_seq(r, tw);
    const int64_t base = pick_len(r, tw, s);
    int64_t idx[MAX_T], n = 0;
    for (int64_t i = 0, m = fuzz_below(r, 256); i < MAX_T; i++) /* a bit mask of drafts */
        if (m >> i & 1)
            idx[n++] = i;
    if (fuzz_u8(r) < 16 && n > 1) /* not increasing */
        idx[0] = idx[n - 1];
    int64_t len[MAX_B];
    const int64_t nfree = lengths(tw, len);
    mha_error e0, e1;
    const mha_status s0 = mha_kv_cache_accept(tw->c[0], s, base, n, idx, &e0);
    if (!pool_refused(tw, s0, &e0, len, nfree))
        same(s0, &e0, mha_kv_cache_accept(tw->c[1], s, base, n, idx, &e1), &e1);
}

static void op_read(fuzz_reader *r, const twin *tw) {
    const int64_t s = pick_seq(r, tw), p = pick_len(r, tw, s);
    float k[2][MAX_G * MAX_D], v[2][MAX_G * MAX_D];
    mha_error e0, e1;
    if (same(mha_kv_cache_read(tw->c[0], s, p, k[0], v[0], &e0), &e0,
             mha_kv_cache_read(tw->c[1], s, p, k[1], v[1], &e1), &e1) == MHA_STATUS_OK)
        FUZZ_REQUIRE(!memcmp(k[0], k[1], sizeof(float) * (size_t)(tw->g * tw->d)) &&
                         !memcmp(v[0], v[1], sizeof(float) * (size_t)(tw->g * tw->d)),
                     "read (%lld, %lld) differs", (long long)s, (long long)p);
}

static void op_attention(fuzz_reader *r, const twin *tw) {
    int64_t ids[MAX_B];
    const int64_t S = pick_seqs(r, tw, ids), t = 1 + fuzz_below(r, 3);
    static const int64_t tree[3] = {-1, 0, 0};
    static float q[MAX_B * 3 * MAX_H * MAX_D], o[2][MAX_B * 3 * MAX_H * MAX_D];
    float lse[2][MAX_B * MAX_H * 3];
    fill(q, S * t * tw->h * tw->d, fuzz_u64(r));
    mha_kv_attention_args a;
    memset(&a, 0, sizeof a);
    a.num_seqs = S, a.seq_ids = ids, a.num_tokens = t, a.num_heads = tw->h, a.q = q;
    a.tree_parents = t == 3 && fuzz_u8(r) < 64 ? tree : NULL;
    mha_exec ex;
    memset(&ex, 0, sizeof ex);
    ex.n_threads = 1 + fuzz_below(r, 2);
    mha_status st[2];
    mha_error err[2];
    for (int i = 0; i < 2; i++) {
        a.out = o[i], a.lse = lse[i];
        st[i] = mha_kv_cache_attention(tw->c[i], &a, &ex, &err[i]);
    }
    if (same(st[0], &err[0], st[1], &err[1]) == MHA_STATUS_OK)
        FUZZ_REQUIRE(!memcmp(o[0], o[1], sizeof(float) * (size_t)(S * t * tw->h * tw->d)) &&
                         !memcmp(lse[0], lse[1], sizeof(float) * (size_t)(S * t * tw->h)),
                     "attention differs (S %lld, t %lld)", (long long)S, (long long)t);
}

/* One operation; returns whether it compacted. */
static int op(fuzz_reader *r, twin *tw) {
    mha_error e0, e1;
    const int64_t a = pick_seq(r, tw), b = pick_seq(r, tw);
    switch (fuzz_below(r, 10)) {
    case 0:
    case 1:
        op_append(r, tw);
        return 0;
    case 2:
        same(mha_kv_cache_copy(tw->c[0], a, b, &e0), &e0, mha_kv_cache_copy(tw->c[1], a, b, &e1),
             &e1);
        return 0;
    case 3: {
        const int64_t len = pick_len(r, tw, a);
        same(mha_kv_cache_share_prefix(tw->c[0], a, b, len, &e0), &e0,
             mha_kv_cache_share_prefix(tw->c[1], a, b, len, &e1), &e1);
        return 0;
    }
    case 4: {
        const int64_t len = pick_len(r, tw, a);
        same(mha_kv_cache_truncate(tw->c[0], a, len, &e0), &e0,
             mha_kv_cache_truncate(tw->c[1], a, len, &e1), &e1);
        return 0;
    }
    case 5:
        same(mha_kv_cache_reset(tw->c[0], a, &e0), &e0, mha_kv_cache_reset(tw->c[1], a, &e1), &e1);
        return 0;
    case 6:
        op_accept(r, tw);
        return 0;
    case 7:
        op_read(r, tw);
        return 0;
    case 8:
        op_attention(r, tw);
        return 0;
    default:
        FUZZ_REQUIRE(mha_kv_cache_compact(tw->c[0], &e0) == MHA_STATUS_OK, "compact: %s",
                     e0.message);
        return 1;
    }
}

/* The configuration; 0 when the caches could not be made (a refused configuration). */
static int make(fuzz_reader *r, twin *tw, const mha_allocator *alloc) {
    static const mha_dtype dts[5] = {MHA_DTYPE_F32, MHA_DTYPE_F16, MHA_DTYPE_BF16, MHA_DTYPE_Q8_0,
                                     MHA_DTYPE_FP8_E4M3};
    static const int64_t sizes[4] = {16, 32, 48, 8 /* refused */};
    mha_kv_cache_config kc;
    memset(&kc, 0, sizeof kc);
    kc.num_kv_heads = tw->g = 1 + fuzz_below(r, MAX_G);
    kc.head_dim = tw->d = fuzz_u8(r) % 2 ? 64 : 32;
    kc.dtype = dts[fuzz_below(r, 5)];
    const uint8_t ring = fuzz_u8(r);
    kc.window = ring % 4 == 1 ? 20 + ring % 40 : 0;
    kc.chunk_size = ring % 4 == 2 ? 16 + ring % 32 : 0;
    kc.max_seq = 16 + fuzz_below(r, MAX_SEQ - 15);
    kc.batch = tw->batch = 1 + fuzz_below(r, MAX_B);
    kc.max_step_tokens = tw->max_step = 1 + fuzz_below(r, MAX_T);
    tw->h = tw->g * (1 + fuzz_below(r, MAX_H / tw->g));
    mha_error err;
    mha_status st = mha_kv_cache_create(&kc, NULL, NULL, &tw->c[1], &err);
    if (st) {
        fuzz_check_error(st, &err);
        return 0;
    }
    kc.block_size = sizes[fuzz_below(r, 4)];
    const int64_t slots = mha_kv_cache_slots(tw->c[1]);
    tw->entries = (slots + kc.block_size - 1) / kc.block_size;
    kc.num_blocks = 1 + fuzz_below(r, kc.batch * tw->entries + 2); /* tight to roomy */
    st = mha_kv_cache_create(&kc, NULL, alloc, &tw->c[0], &err);
    if (st) {
        fuzz_check_error(st, &err);
        return 0;
    }
    tw->nblocks = mha_kv_cache_get_config(tw->c[0])->num_blocks;
    if (kc.dtype == MHA_DTYPE_FP8_E4M3) {
        const float ks[MAX_G] = {0.05f, 0.5f}, vs[MAX_G] = {0.25f, 0.02f};
        for (int i = 0; i < 2; i++) {
            st = mha_kv_cache_set_fp8_scales(tw->c[i], ks, vs, &err);
            FUZZ_REQUIRE(st == MHA_STATUS_OK, "fp8 scales: %s", err.message);
        }
    }
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_reader r = {data, size, 0};
    fuzz_counting count = {0};
    const mha_allocator alloc = {&count, fuzz_count_alloc, fuzz_count_free};
    twin tw;
    memset(&tw, 0, sizeof tw);
    if (make(&r, &tw, &alloc)) {
        const int64_t ops = 1 + fuzz_below(&r, MAX_OPS);
        for (int64_t i = 0; i < ops && r.pos < r.size; i++)
            check_state(&tw, op(&r, &tw));
    }
    mha_kv_cache_destroy(tw.c[0]);
    mha_kv_cache_destroy(tw.c[1]);
    FUZZ_REQUIRE(count.live == 0, "%lld allocations not given back", (long long)count.live);
    return 0;
}
