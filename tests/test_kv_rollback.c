/* SPDX-License-Identifier: MIT */
/* test_kv_rollback.c: regressions found by test_kv_stateful in the roll-back calls of ring
 * caches (window, chunk), each on a contiguous and a paged cache:
 *   1. A ring that has wrapped, rolled back to length 0 (truncate to 0, share_prefix of length 0,
 *      accept with base_len 0 and n 0), then appended to: the new positions read back and are
 *      attended (until session 49 the ring's lowest held position stayed where the wrap had put
 *      it: read refused the new positions and attention refused the sequence).
 *   2. accept at base_len 0 on a ring that has wrapped, keeping "drafts" the ring no longer holds
 *      (or moving rows onto slots it still has to read): INVALID_ARG, nothing changed (until
 *      session 49 it moved the overwritten slots' rows, other positions' keys, to 0 .. n-1).
 *   3. A chunk ring rolled back to the start of a chunk it has overwritten (truncate,
 *      share_prefix): the token there needs no key, so the call is valid like a roll-back to 0
 *      (until session 49 it was refused, "cannot roll back"), and the positions appended after
 *      it read back and are attended. Into the middle of such a chunk stays refused.
 */
#include "harness.h"

#include <string.h>

enum { G = 1, D = 4 };

static mha_kv_cache *ring_cache(int64_t window, int64_t chunk, int64_t bs) {
    mha_kv_cache_config kc;
    memset(&kc, 0, sizeof kc);
    kc.num_kv_heads = G, kc.head_dim = D, kc.max_seq = 64, kc.batch = 2;
    kc.window = window, kc.chunk_size = chunk, kc.max_step_tokens = 2, kc.block_size = bs;
    mha_kv_cache *c = NULL;
    mha_error err;
    CHECK_OK(mha_kv_cache_create(&kc, NULL, NULL, &c, &err), &err);
    return c;
}

/* Appends n tokens one by one to seq, the values of token i all i + base. */
static void fill(mha_kv_cache *c, int64_t seq, int n, float base) {
    mha_error err;
    for (int i = 0; i < n; i++) {
        float k[G * D];
        for (int x = 0; x < G * D; x++)
            k[x] = base + (float)i;
        CHECK_OK(mha_kv_cache_append(c, 1, &seq, 1, k, k, &err), &err);
    }
}

/* Sequence seq of c has length len and its last position holds value `want`: it reads back and
 * attention over the last token is OK (one key visible at least: its own). */
static void check_tail(mha_kv_cache *c, int64_t seq, int64_t len, float want, const char *what) {
    mha_error err;
    CHECK(mha_kv_cache_length(c, seq) == len, "%s: length %lld, expected %lld", what,
          (long long)mha_kv_cache_length(c, seq), (long long)len);
    float k[G * D] = {0}, v[G * D] = {0};
    mha_status st = mha_kv_cache_read(c, seq, len - 1, k, v, &err);
    CHECK(st == MHA_STATUS_OK && k[0] == want && v[D - 1] == want,
          "%s: read of position %lld -> %s (%s), k %g, expected %g", what, (long long)(len - 1),
          mha_status_string(st), err.message, (double)k[0], (double)want);
    float q[G * D] = {1, 0, 0, 0}, out[G * D];
    mha_kv_attention_args a;
    memset(&a, 0, sizeof a);
    a.num_seqs = 1, a.seq_ids = &seq, a.num_tokens = 1, a.num_heads = G, a.q = q, a.out = out;
    st = mha_kv_cache_attention(c, &a, NULL, &err);
    CHECK(st == MHA_STATUS_OK, "%s: attention -> %s (%s)", what, mha_status_string(st),
          err.message);
}

/* 1. Roll back to 0 after a wrap. Window 4, steps of 2: 5 slots; 9 tokens wrap the ring. */
static void test_rollback_to_zero(int64_t window, int64_t chunk, int64_t bs) {
    char what[96];
    for (int how = 0; how < 3; how++) {
        mha_kv_cache *c = ring_cache(window, chunk, bs);
        if (!c)
            return;
        mha_error err;
        fill(c, 0, 9, 100.0f);
        fill(c, 1, 9, 200.0f);
        int64_t dst = 0;
        if (how == 0) {
            CHECK_OK(mha_kv_cache_truncate(c, 0, 0, &err), &err);
        } else if (how == 1) {
            dst = 1; /* a fork of length 0 of a wrapped sequence */
            CHECK_OK(mha_kv_cache_share_prefix(c, 0, 1, 0, &err), &err);
        } else {
            CHECK_OK(mha_kv_cache_accept(c, 0, 0, 0, NULL, &err), &err);
        }
        fill(c, dst, 1, 7.0f);
        snprintf(what, sizeof what, "window %lld chunk %lld block %lld, %s then 1 append",
                 (long long)window, (long long)chunk, (long long)bs,
                 how == 0   ? "truncate to 0"
                 : how == 1 ? "share_prefix of length 0"
                            : "accept of 0 at base_len 0");
        check_tail(c, dst, 1, 7.0f, what);
        fill(c, dst, 2, 8.0f);
        check_tail(c, dst, 3, 9.0f, what);
        mha_kv_cache_destroy(c);
    }
}

/* 2. accept(base_len 0, n > 0) after a wrap: positions 0 .. 3 are overwritten (9 tokens, 5
 * slots: 4 .. 8 held). */
static void test_accept_dropped(int64_t window, int64_t chunk, int64_t bs) {
    mha_kv_cache *c = ring_cache(window, chunk, bs);
    if (!c)
        return;
    mha_error err;
    fill(c, 0, 9, 100.0f);
    const int64_t free0 = mha_kv_cache_free_blocks(c);
    const int64_t dropped[1] = {1}, held[2] = {5, 6};
    for (int i = 0; i < 2; i++) {
        const mha_status st = mha_kv_cache_accept(c, 0, 0, i ? 2 : 1, i ? held : dropped, &err);
        CHECK(st == MHA_STATUS_INVALID_ARG,
              "window %lld chunk %lld block %lld: accept at base_len 0 of %s -> %s (%s)",
              (long long)window, (long long)chunk, (long long)bs,
              i ? "held rows below the ring's span" : "an overwritten row", mha_status_string(st),
              err.message);
    }
    CHECK(mha_kv_cache_free_blocks(c) == free0 && mha_kv_cache_length(c, 0) == 9,
          "refused accepts changed nothing");
    check_tail(c, 0, 9, 108.0f, "after the refused accepts");
    mha_kv_cache_destroy(c);
}

/* 3. Chunk 4, steps of 2 (5 slots), 13 tokens: positions 8 .. 12 held; roll back to 4. */
static void test_chunk_start(int64_t bs) {
    for (int how = 0; how < 2; how++) {
        mha_kv_cache *c = ring_cache(0, 4, bs);
        if (!c)
            return;
        mha_error err;
        fill(c, 0, 13, 100.0f);
        mha_status st = how ? mha_kv_cache_share_prefix(c, 0, 1, 5, &err)
                            : mha_kv_cache_truncate(c, 0, 5, &err);
        CHECK(st == MHA_STATUS_INVALID_ARG, "block %lld: roll back into an overwritten chunk -> %s",
              (long long)bs, mha_status_string(st));
        const int64_t dst = how ? 1 : 0;
        st = how ? mha_kv_cache_share_prefix(c, 0, 1, 4, &err)
                 : mha_kv_cache_truncate(c, 0, 4, &err);
        CHECK(st == MHA_STATUS_OK, "block %lld: %s to the start of an overwritten chunk -> %s (%s)",
              (long long)bs, how ? "share_prefix" : "truncate", mha_status_string(st), err.message);
        if (st == MHA_STATUS_OK) {
            fill(c, dst, 3, 40.0f);
            check_tail(c, dst, 7, 42.0f, "after a roll-back to a chunk's start");
            float k[G * D];
            CHECK(mha_kv_cache_read(c, dst, 3, k, NULL, &err) == MHA_STATUS_INVALID_ARG,
                  "position 3 (overwritten) is not read");
        }
        mha_kv_cache_destroy(c);
    }
}

int main(void) {
    const int64_t bss[2] = {0, 16};
    for (int b = 0; b < 2; b++) {
        test_rollback_to_zero(4, 0, bss[b]);
        test_rollback_to_zero(0, 4, bss[b]);
        test_accept_dropped(4, 0, bss[b]);
        test_accept_dropped(0, 4, bss[b]);
        test_chunk_start(bss[b]);
    }
    return test_finish();
}
