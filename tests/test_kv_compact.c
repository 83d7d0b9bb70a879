/* SPDX-License-Identifier: MIT */
/* test_kv_compact.c: mha_kv_cache_compact (docs/INFERENCE.md "Compaction").
 *   1. A paged cache churned into a scattered pool (interleaved appends to 5 sequences, a fork
 *      and a shared prefix whose appends copy shared blocks, truncates, a reset and refill) and
 *      its contiguous twin given the same calls: after compaction the paged attention (t = 1 and
 *      3, 1 and 2 threads) and every read-back still equal the twin's bit for bit (the twin is the
 *      oracle; its tie to float64 is test_kv_cache's / test_kv_q8's / test_kv_fp8's); free_blocks
 *      is unchanged; the blocks met walking the tables (sequence by sequence, entry by entry) are
 *      0, 1, 2, ... in that order — each sequence's own blocks consecutive — and every free block
 *      lies after them. Every dtype (f32, f16, bf16, q8_0, fp8 with scales), plain, window ring
 *      and chunk caches, blocks of 16 and 48, GQA with d_v != d_k.
 *   2. The cache keeps working after compaction: appends (copy-on-write of a block shared by a
 *      new fork, new blocks), a truncate and a second compaction: still equal to the twin.
 *   3. NULL is INVALID_ARG; a working-memory allocation that fails is NO_MEMORY with nothing
 *      changed (block ids, results); a contiguous cache is OK and unchanged.
 */
#include "harness.h"

#include "mha_experimental.h"

#include <stdlib.h>
#include <string.h>

typedef struct shape {
    int64_t g, h, dk, dv;
} shape;

enum { NSEQ = 5 };

/* An allocator that fails once `fail` is set (the cache's allocations at creation succeed). */
typedef struct failing {
    int fail;
} failing;
static void *failing_alloc(void *user, size_t bytes, size_t align) {
    if (((failing *)user)->fail)
        return NULL;
    align = align < 64 ? 64 : align;
    return aligned_alloc(align, (bytes + align - 1) / align * align);
}
static void failing_free(void *user, void *p) {
    (void)user;
    free(p);
}

static mha_kv_cache *make(const shape *sh,
                          mha_dtype dt,
                          int64_t window,
                          int64_t chunk,
                          int64_t bs,
                          const mha_allocator *alloc) {
    mha_kv_cache_config kc = {0};
    kc.num_kv_heads = sh->g;
    kc.head_dim = sh->dk;
    kc.v_head_dim = sh->dv;
    kc.max_seq = 512;
    kc.batch = NSEQ;
    kc.dtype = dt;
    kc.window = window;
    kc.chunk_size = chunk;
    kc.max_step_tokens = 8;
    kc.block_size = bs;
    mha_kv_cache *c = NULL;
    mha_error err;
    CHECK_OK(mha_kv_cache_create(&kc, NULL, alloc, &c, &err), &err);
    if (c && dt == MHA_DTYPE_FP8_E4M3) {
        const float ks[2] = {0.02f, 0.05f}, vs[2] = {0.03f, 0.01f};
        CHECK_OK(mha_kv_cache_set_fp8_scales(c, ks, vs, &err), &err);
    }
    return c;
}

/* Appends t random tokens to sequence s of both caches (the same values). */
static void append2(mha_kv_cache **cs, const shape *sh, test_rng *r, int64_t s, int64_t t) {
    float *k = malloc(sizeof(float) * (size_t)(t * sh->g * sh->dk));
    float *v = malloc(sizeof(float) * (size_t)(t * sh->g * sh->dv));
    test_fill_normal(r, k, t * sh->g * sh->dk, 1.0f);
    test_fill_normal(r, v, t * sh->g * sh->dv, 1.0f);
    mha_error err;
    for (int i = 0; i < 2; i++)
        CHECK_OK(mha_kv_cache_append(cs[i], 1, &s, t, k, v, &err), &err);
    free(k);
    free(v);
}

/* Appends of 1..8 tokens round robin over sequences [s0, s1) until each has gained `more`. */
static void
round_robin(mha_kv_cache **cs, const shape *sh, test_rng *r, int64_t s0, int64_t s1, int64_t more) {
    int64_t done[NSEQ] = {0};
    for (int again = 1; again;) {
        again = 0;
        for (int64_t s = s0; s < s1; s++) {
            int64_t t = 1 + (int64_t)(test_rng_uniform(r) * 8);
            t = t < more - done[s] ? t : more - done[s];
            if (t > 0) {
                append2(cs, sh, r, s, t);
                done[s] += t;
                again = 1;
            }
        }
    }
}

/* Paged attention and read-back equal the twin's bit for bit. */
static int same_as_twin(mha_kv_cache **cs, const shape *sh, test_rng *r) {
    int same = 1;
    for (int64_t t = 1; t <= 3; t += 2) {
        const int64_t nq = NSEQ * t * sh->h * sh->dk, no = NSEQ * t * sh->h * sh->dv;
        float *q = malloc(sizeof(float) * (size_t)nq);
        float *o[2] = {malloc(sizeof(float) * (size_t)no), malloc(sizeof(float) * (size_t)no)};
        float l[2][NSEQ * 3 * 8];
        test_fill_normal(r, q, nq, 1.0f);
        for (int nt = 1; nt <= 2; nt++) {
            for (int i = 0; i < 2; i++) {
                mha_kv_attention_args a = {0};
                a.num_seqs = NSEQ;
                a.num_tokens = t;
                a.num_heads = sh->h;
                a.q = q;
                a.out = o[i];
                a.lse = l[i];
                mha_exec ex = {0};
                ex.n_threads = nt;
                mha_error err;
                CHECK_OK(mha_kv_cache_attention(cs[i], &a, &ex, &err), &err);
            }
            same &= !memcmp(o[0], o[1], sizeof(float) * (size_t)no) &&
                    !memcmp(l[0], l[1], sizeof(float) * (size_t)(NSEQ * sh->h * t));
        }
        free(q);
        free(o[0]);
        free(o[1]);
    }
    float k[2][2 * 128], v[2][2 * 128];
    for (int64_t s = 0; s < NSEQ; s++)
        for (int64_t p = 0; p < mha_kv_cache_length(cs[0], s); p++) {
            mha_error e0, e1;
            const mha_status s0 = mha_kv_cache_read(cs[0], s, p, k[0], v[0], &e0);
            const mha_status s1 = mha_kv_cache_read(cs[1], s, p, k[1], v[1], &e1);
            same &= s0 == s1;
            if (s0 == MHA_STATUS_OK && s1 == MHA_STATUS_OK)
                same &= !memcmp(k[0], k[1], sizeof(float) * (size_t)(sh->g * sh->dk)) &&
                        !memcmp(v[0], v[1], sizeof(float) * (size_t)(sh->g * sh->dv));
        }
    return same;
}

/* Blocks met walking the tables that are not the next id (0 when the pool is compact); *free_after:
 * whether every block from the number met on is free. */
static int64_t misplaced(const mha_kv_cache *c, int *free_after) {
    const int64_t nb = mha_kv_cache_get_config(c)->num_blocks;
    const int64_t entries = (mha_kv_cache_slots(c) + mha_kv_cache_get_config(c)->block_size - 1) /
                            mha_kv_cache_get_config(c)->block_size;
    unsigned char *seen = calloc((size_t)nb, 1);
    int64_t next = 0, bad = 0;
    for (int64_t s = 0; s < NSEQ; s++)
        for (int64_t e = 0; e < entries; e++) {
            const int64_t b = mha_experimental_kv_cache_block(c, s, e);
            if (b < 0 || seen[b])
                continue;
            seen[b] = 1;
            bad += b != next++;
        }
    *free_after = mha_kv_cache_free_blocks(c) == nb - next;
    free(seen);
    return bad;
}

/* Every table entry's block of c, in order, into ids (NSEQ * entries of them). */
static void block_ids(const mha_kv_cache *c, int64_t *ids, int64_t entries) {
    for (int64_t s = 0; s < NSEQ; s++)
        for (int64_t e = 0; e < entries; e++)
            ids[s * entries + e] = mha_experimental_kv_cache_block(c, s, e);
}

static void test_compact(void) {
    const shape shapes[2] = {{2, 8, 64, 64}, {2, 4, 32, 96}};
    const mha_dtype dts[5] = {MHA_DTYPE_F32, MHA_DTYPE_F16, MHA_DTYPE_BF16, MHA_DTYPE_Q8_0,
                              MHA_DTYPE_FP8_E4M3};
    const int64_t rings[3][2] = {{0, 0}, {100, 0}, {0, 64}}; /* window, chunk */
    int cases = 0;
    for (int si = 0; si < 2; si++)
        for (int di = 0; di < 5; di++)
            for (int ri = 0; ri < 3; ri++) {
                const shape *sh = &shapes[si];
                if (dts[di] == MHA_DTYPE_Q8_0 && sh->dv % 32)
                    continue; /* q8_0 rows are blocks of 32 */
                const int64_t bs = (si + di + ri) % 2 ? 48 : 16;
                mha_kv_cache *cs[2] = {make(sh, dts[di], rings[ri][0], rings[ri][1], bs, NULL),
                                       make(sh, dts[di], rings[ri][0], rings[ri][1], 0, NULL)};
                if (!cs[0] || !cs[1]) {
                    mha_kv_cache_destroy(cs[0]);
                    mha_kv_cache_destroy(cs[1]);
                    continue;
                }
                test_rng r;
                test_rng_seed(&r, (uint64_t)(100 * si + 10 * di + ri));
                mha_error err;
                /* churn: interleaved appends, a fork, a shared prefix, truncates, a reset */
                round_robin(cs, sh, &r, 0, 3, 150);
                for (int i = 0; i < 2; i++) {
                    CHECK_OK(mha_kv_cache_copy(cs[i], 0, 3, &err), &err);
                    CHECK_OK(mha_kv_cache_share_prefix(cs[i], 1, 4, 146, &err), &err);
                    CHECK_OK(mha_kv_cache_truncate(cs[i], 0, 145, &err), &err);
                    CHECK_OK(mha_kv_cache_reset(cs[i], 2, &err), &err);
                }
                round_robin(cs, sh, &r, 1, 5, 40);
                int free_after;
                const int64_t before = misplaced(cs[0], &free_after);
                const int64_t nfree = mha_kv_cache_free_blocks(cs[0]);
                CHECK_OK(mha_kv_cache_compact(cs[0], &err), &err);
                const int64_t after = misplaced(cs[0], &free_after);
                CHECK(before > 0 && after == 0 && free_after &&
                          mha_kv_cache_free_blocks(cs[0]) == nfree,
                      "compact: %lld misplaced blocks before, %lld after, free blocks %lld -> "
                      "%lld, all after the held ones: %d (shape %d dtype %d ring %d bs %lld)",
                      (long long)before, (long long)after, (long long)nfree,
                      (long long)mha_kv_cache_free_blocks(cs[0]), free_after, si, (int)dts[di], ri,
                      (long long)bs);
                CHECK(same_as_twin(cs, sh, &r),
                      "compacted paged == contiguous bit for bit (shape %d dtype %d ring %d)", si,
                      (int)dts[di], ri);
                /* it keeps working: a fork whose appends copy shared blocks, new blocks */
                for (int i = 0; i < 2; i++)
                    CHECK_OK(mha_kv_cache_copy(cs[i], 4, 2, &err), &err);
                round_robin(cs, sh, &r, 0, 5, 30);
                for (int i = 0; i < 2; i++)
                    CHECK_OK(
                        mha_kv_cache_truncate(cs[i], 3, mha_kv_cache_length(cs[i], 3) - 5, &err),
                        &err);
                CHECK(same_as_twin(cs, sh, &r),
                      "appends after compaction: paged == contiguous (shape %d dtype %d ring %d)",
                      si, (int)dts[di], ri);
                CHECK_OK(mha_kv_cache_compact(cs[0], &err), &err);
                CHECK(misplaced(cs[0], &free_after) == 0 && free_after && same_as_twin(cs, sh, &r),
                      "a second compaction (shape %d dtype %d ring %d)", si, (int)dts[di], ri);
                mha_kv_cache_destroy(cs[0]);
                mha_kv_cache_destroy(cs[1]);
                cases++;
            }
    CHECK(cases == 30, "all %d cases ran", cases);
}

static void test_refusals(void) {
    const shape sh = {2, 4, 64, 64};
    mha_error err;
    CHECK(mha_kv_cache_compact(NULL, &err) == MHA_STATUS_INVALID_ARG && strstr(err.message, "NULL"),
          "NULL cache: %s", err.message);
    failing f = {0};
    const mha_allocator a = {&f, failing_alloc, failing_free};
    mha_kv_cache *cs[2] = {make(&sh, MHA_DTYPE_BF16, 0, 0, 16, &a),
                           make(&sh, MHA_DTYPE_BF16, 0, 0, 0, NULL)};
    if (!cs[0] || !cs[1])
        return;
    test_rng r;
    test_rng_seed(&r, 9);
    round_robin(cs, &sh, &r, 0, NSEQ, 100);
    const int64_t entries = 512 / 16;
    int64_t ids[2][NSEQ * 512 / 16];
    block_ids(cs[0], ids[0], entries);
    f.fail = 1;
    const mha_status st = mha_kv_cache_compact(cs[0], &err);
    block_ids(cs[0], ids[1], entries);
    CHECK(st == MHA_STATUS_NO_MEMORY && strstr(err.message, "nothing moved") &&
              !memcmp(ids[0], ids[1], sizeof ids[0]) && same_as_twin(cs, &sh, &r),
          "failed working-memory allocation: %s (%s), nothing changed", mha_status_string(st),
          err.message);
    f.fail = 0;
    CHECK_OK(mha_kv_cache_compact(cs[0], &err), &err);
    int free_after;
    CHECK(misplaced(cs[0], &free_after) == 0 && same_as_twin(cs, &sh, &r),
          "compaction through the cache's allocator");
    CHECK_OK(mha_kv_cache_compact(cs[1], &err), &err); /* contiguous: nothing to do */
    CHECK(same_as_twin(cs, &sh, &r), "a contiguous cache is unchanged");
    mha_kv_cache_destroy(cs[0]);
    mha_kv_cache_destroy(cs[1]);
}

int main(void) {
    test_compact();
    test_refusals();
    return test_finish();
}
