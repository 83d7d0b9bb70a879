/* SPDX-License-Identifier: MIT */
/* test_kv_place.c: block placement in a paged KV cache's pool (docs/INFERENCE.md "Block
 * placement"; src/cache/kv_pool.c). The block ids are read with mha_experimental_kv_cache_block.
 *   1. A sequence growing alone in a fresh pool takes blocks 0, 1, 2, ... (one run).
 *   2. Sequences growing in lockstep, one token at a time, each get one run (the old stack of
 *      free ids interleaved them block by block), at the places the policy names.
 *   3. Released blocks coalesce: after every sequence is reset, one sequence gets the whole pool
 *      as one run again.
 *   4. A pool fragmented into isolated free blocks still serves every free block (each once),
 *      and an append is NO_MEMORY exactly when the free blocks are fewer than it needs, with
 *      nothing appended.
 *   5. The free-run structure against a brute-force oracle (a plain array of free flags): random
 *      takes and releases on pools of 1000 and 300007 blocks; after each step (large pool: every
 *      1000th) its longest free run, the block a take chooses, and the free flags agree.
 *   6. A pool initialised with its first blocks taken (mha_kv_cache_compact's result) has
 *      exactly the others free, as one run.
 */
#include "harness.h"

#include "cache/kv_cache.h"
#include "mha_experimental.h"

#include <stdlib.h>
#include <string.h>

enum { BS = 16, G = 2, D = 32 };

static mha_kv_cache *make(int64_t nblocks, int64_t batch) {
    mha_kv_cache_config kc = {0};
    kc.num_kv_heads = G;
    kc.head_dim = D;
    kc.max_seq = 64 * BS; /* 64 table entries */
    kc.batch = batch;
    kc.max_step_tokens = 64;
    kc.block_size = BS;
    kc.num_blocks = nblocks;
    mha_kv_cache *c = NULL;
    mha_error err;
    CHECK_OK(mha_kv_cache_create(&kc, NULL, NULL, &c, &err), &err);
    return c;
}

static mha_status append(mha_kv_cache *c, int64_t s, int64_t t, mha_error *err) {
    static float kv[2 * 64 * G * D]; /* zeros: placement only */
    return mha_kv_cache_append(c, 1, &s, t, kv, kv + t * G * D, err);
}

/* Number of runs of consecutive block ids in sequence s's first n table entries (0 if one is
 * missing). */
static int runs_of(const mha_kv_cache *c, int64_t s, int64_t n) {
    int runs = 0;
    for (int64_t e = 0; e < n; e++) {
        const int64_t b = mha_experimental_kv_cache_block(c, s, e);
        if (b < 0)
            return 0;
        runs += e == 0 || b != mha_experimental_kv_cache_block(c, s, e - 1) + 1;
    }
    return runs;
}

static void test_alone_and_lockstep(void) {
    mha_error err;
    mha_kv_cache *c = make(64, 4);
    for (int64_t p = 0; p < 10 * BS; p++)
        CHECK_OK(append(c, 0, 1, &err), &err);
    int ok = 1;
    for (int64_t e = 0; e < 10; e++)
        ok &= mha_experimental_kv_cache_block(c, 0, e) == e;
    CHECK(ok && mha_experimental_kv_cache_block(c, 0, 10) == -1,
          "a sequence growing alone in a fresh pool takes blocks 0..9");
    CHECK(mha_experimental_kv_cache_block(c, 4, 0) == -1 &&
              mha_experimental_kv_cache_block(c, 0, 64) == -1 &&
              mha_experimental_kv_cache_block(NULL, 0, 0) == -1,
          "block ids of bad arguments are -1");
    CHECK_OK(mha_kv_cache_reset(c, 0, &err), &err);

    /* 4 sequences, one token each per step, 8 blocks each: seq 0 starts at 0, seq 1 in the
     * middle of [1, 64): 32, seq 2 in the middle of [1, 32) (the leftmost of two runs of 31):
     * 16, seq 3 in the middle of [33, 64): 48; each then has room for 16 blocks. */
    for (int64_t p = 0; p < 8 * BS; p++)
        for (int64_t s = 0; s < 4; s++)
            CHECK_OK(append(c, s, 1, &err), &err);
    const int64_t start[4] = {0, 32, 16, 48};
    for (int64_t s = 0; s < 4; s++)
        CHECK(runs_of(c, s, 8) == 1 && mha_experimental_kv_cache_block(c, s, 0) == start[s],
              "lockstep: sequence %lld holds one run from block %lld (%d runs, first %lld)",
              (long long)s, (long long)start[s], runs_of(c, s, 8),
              (long long)mha_experimental_kv_cache_block(c, s, 0));
    /* sequence 0 grows into block 16 (sequence 3's): it starts a second run, in the middle of
     * the largest free run [24, 32) x [40, 48) x [56, 64) (all 8 long, leftmost): 27 */
    for (int64_t p = 0; p < 9 * BS; p++)
        CHECK_OK(append(c, 0, 1, &err), &err);
    CHECK(runs_of(c, 0, 17) == 2 && mha_experimental_kv_cache_block(c, 0, 16) == 27,
          "a sequence that reaches a neighbour's run starts a new one in the largest free run "
          "(block %lld)",
          (long long)mha_experimental_kv_cache_block(c, 0, 16));
    mha_kv_cache_destroy(c);
}

static void test_coalesce(void) {
    mha_error err;
    mha_kv_cache *c = make(64, 9);
    for (int64_t p = 0; p < 7 * BS; p++) /* 8 sequences x 7 blocks, lockstep */
        for (int64_t s = 0; s < 8; s++)
            CHECK_OK(append(c, s, 1, &err), &err);
    const int64_t order[8] = {3, 0, 6, 1, 7, 2, 5, 4};
    for (int i = 0; i < 8; i++)
        CHECK_OK(mha_kv_cache_reset(c, order[i], &err), &err);
    CHECK(mha_kv_cache_free_blocks(c) == 64 && c->pool.tree[1].best == 64 &&
              c->pool.tree[1].at == 0,
          "released blocks coalesce into one free run of 64 (%lld at %lld)",
          (long long)c->pool.tree[1].best, (long long)c->pool.tree[1].at);
    for (int64_t k = 0; k < 4; k++)
        CHECK_OK(append(c, 8, 64, &err), &err);
    CHECK(runs_of(c, 8, 16) == 1 && mha_experimental_kv_cache_block(c, 8, 0) == 0,
          "after the resets a new sequence is one run from block 0");
    /* truncate releases the tail; the sequence grows back into the same blocks */
    CHECK_OK(mha_kv_cache_truncate(c, 8, 5 * BS + 3, &err), &err);
    CHECK(mha_kv_cache_free_blocks(c) == 64 - 6, "truncate keeps 6 blocks");
    CHECK_OK(append(c, 8, 64, &err), &err); /* 147 positions: 10 blocks */
    CHECK(runs_of(c, 8, 10) == 1 && mha_kv_cache_free_blocks(c) == 64 - 10,
          "after truncate the sequence continues its run");
    mha_kv_cache_destroy(c);
}

static void test_fragmented(void) {
    mha_error err;
    enum { N = 64 };
    mha_kv_cache *c = make(N, N + 1);
    for (int64_t s = 0; s < N; s++) /* every block held by one scratch sequence */
        CHECK_OK(append(c, s, 1, &err), &err);
    CHECK(mha_kv_cache_free_blocks(c) == 0, "pool full");
    int is_freed[N] = {0};
    int64_t nfreed = 0;
    for (int64_t s = 0; s < N; s++) {
        const int64_t b = mha_experimental_kv_cache_block(c, s, 0);
        if (b % 2 == 1 || b == 10) { /* isolated free blocks, and a run 9..11 */
            CHECK_OK(mha_kv_cache_reset(c, s, &err), &err);
            is_freed[b] = 1;
            nfreed++;
        }
    }
    CHECK(mha_kv_cache_free_blocks(c) == nfreed, "%lld free", (long long)nfreed);
    /* 33 free blocks */
    mha_status st = append(c, N, 64, &err);
    for (int k = 0; k < 7 && !st; k++) /* 512 positions = 32 blocks */
        st = append(c, N, 64, &err);
    CHECK(st == MHA_STATUS_OK && mha_kv_cache_free_blocks(c) == nfreed - 32,
          "a fragmented pool serves 32 blocks");
    st = append(c, N, 32, &err); /* 2 blocks, 1 free */
    CHECK(st == MHA_STATUS_NO_MEMORY && mha_kv_cache_length(c, N) == 512 &&
              mha_kv_cache_free_blocks(c) == 1,
          "NO_MEMORY when free < need, nothing appended");
    st = append(c, N, 16, &err); /* 1 block, 1 free */
    CHECK(st == MHA_STATUS_OK && mha_kv_cache_free_blocks(c) == 0,
          "an append needing exactly the free blocks succeeds");
    int seen[N] = {0}, ok = 1;
    for (int64_t e = 0; e < 33; e++) {
        const int64_t b = mha_experimental_kv_cache_block(c, N, e);
        ok &= b >= 0 && b < N && is_freed[b] && !seen[b];
        if (b >= 0 && b < N)
            seen[b] = 1;
    }
    CHECK(ok, "every freed block taken once");
    /* the middle of the run 9..11, then 11, then isolated blocks leftmost first: 1, 3, 5 */
    const int64_t first[5] = {10, 11, 1, 3, 5};
    for (int64_t e = 0; e < 5; e++)
        CHECK(mha_experimental_kv_cache_block(c, N, e) == first[e],
              "fragmented: entry %lld in block %lld (want %lld)", (long long)e,
              (long long)mha_experimental_kv_cache_block(c, N, e), (long long)first[e]);
    mha_kv_cache_destroy(c);
}

/* Brute force: the longest free run (leftmost) of flags[0..n). */
static void oracle_best(const unsigned char *flags, int64_t n, int64_t *best, int64_t *at) {
    *best = 0, *at = -1;
    for (int64_t i = 0; i < n;) {
        if (!flags[i]) {
            i++;
            continue;
        }
        int64_t j = i;
        while (j < n && flags[j])
            j++;
        if (j - i > *best)
            *best = j - i, *at = i;
        i = j;
    }
}

static uint64_t next_rand(uint64_t *x) {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

static void test_structure(int64_t n, int64_t steps, int64_t check_every) {
    int64_t nw, nl;
    size_t bytes;
    CHECK(mha__kv_pool_sizes(n, &nw, &nl, &bytes), "pool sizes of %lld blocks", (long long)n);
    void *mem = malloc(bytes);
    unsigned char *flags = malloc((size_t)n);
    int64_t *held = malloc(sizeof(int64_t) * (size_t)n); /* taken blocks, any order */
    if (!mem || !flags || !held) {
        CHECK(0, "out of memory");
        return;
    }
    mha__kv_pool p;
    mha__kv_pool_init(&p, mem, n, 0);
    memset(flags, 1, (size_t)n);
    int64_t nheld = 0, bad = 0, last = -1;
    uint64_t x = 0x9E3779B97F4A7C15u;
    for (int64_t step = 0; step < steps && bad < 5; step++) {
        /* mostly takes until 90% full, then a mix: the pool fragments */
        const int take = nheld < n && (nheld < n / 2 || next_rand(&x) % 100 < 50);
        const int check = step % check_every == 0 || step == steps - 1;
        if (take) {
            int64_t best = 0, at = -1;
            if (check)
                oracle_best(flags, n, &best, &at);
            const int64_t prev = next_rand(&x) % 4 == 0 ? -1 : last;
            const int64_t want = prev >= 0 && prev + 1 < n && flags[prev + 1]
                                     ? prev + 1
                                     : (at == 0 ? 0 : at + (best - 1) / 2);
            const int64_t b = mha__kv_pool_take(&p, prev);
            if ((check && b != want) || b < 0 || b >= n || !flags[b]) {
                bad++;
                CHECK(0, "take after %lld: block %lld, oracle %lld (n %lld, step %lld)",
                      (long long)prev, (long long)b, (long long)want, (long long)n,
                      (long long)step);
            }
            flags[b] = 0;
            held[nheld++] = b;
            last = b;
        } else {
            const int64_t i = (int64_t)(next_rand(&x) % (uint64_t)nheld), b = held[i];
            held[i] = held[--nheld];
            mha__kv_pool_release(&p, b);
            flags[b] = 1;
        }
        if (check) {
            int64_t best, at;
            oracle_best(flags, n, &best, &at);
            int same = p.tree[1].best == best && (best == 0 || p.tree[1].at == at);
            for (int64_t b = 0; b < n && same; b++)
                same = mha__kv_pool_is_free(&p, b) == flags[b];
            if (!same) {
                bad++;
                CHECK(0, "step %lld: longest free run %lld at %lld, oracle %lld at %lld",
                      (long long)step, (long long)p.tree[1].best, (long long)p.tree[1].at,
                      (long long)best, (long long)at);
            }
        }
    }
    CHECK(bad == 0, "pool of %lld blocks: %lld random takes/releases agree with the oracle",
          (long long)n, (long long)steps);
    free(mem);
    free(flags);
    free(held);
}

/* A pool initialised with blocks [0, taken) taken: exactly the others are free, and the root's
 * largest free run is [taken, n). */
static void test_init_taken(int64_t n) {
    int64_t nw, nl;
    size_t bytes;
    CHECK(mha__kv_pool_sizes(n, &nw, &nl, &bytes), "pool sizes of %lld blocks", (long long)n);
    void *mem = malloc(bytes);
    if (!mem) {
        CHECK(0, "out of memory");
        return;
    }
    const int64_t takens[7] = {0, 1, 63, 64, 65, n - 1, n};
    for (int i = 0; i < 7; i++) {
        const int64_t taken = takens[i];
        mha__kv_pool p;
        mha__kv_pool_init(&p, mem, n, taken);
        int64_t wrong = 0;
        for (int64_t b = 0; b < n; b++)
            wrong += mha__kv_pool_is_free(&p, b) != (b >= taken);
        CHECK(wrong == 0 && p.tree[1].best == n - taken && (taken == n || p.tree[1].at == taken),
              "pool of %lld, %lld taken: %lld wrong flags, longest free run %lld at %lld",
              (long long)n, (long long)taken, (long long)wrong, (long long)p.tree[1].best,
              (long long)p.tree[1].at);
    }
    free(mem);
}

int main(void) {
    test_alone_and_lockstep();
    test_coalesce();
    test_fragmented();
    test_structure(1000, 20000, 1);
    test_structure(64, 5000, 1);
    test_structure(300007, 400000, 1000);
    test_init_taken(1000);
    test_init_taken(130);
    return test_finish();
}
