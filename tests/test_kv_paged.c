/* SPDX-License-Identifier: MIT */
/* test_kv_paged.c: the paged KV cache (docs/INFERENCE.md "Paged cache").
 *   1. Paged attention equals the contiguous cache's BIT FOR BIT (same dtype, the tier
 *      MHA_MAX_ISA allows: tools/test.sh runs this test on every tier): f32, f16, bf16, q8_0;
 *      GQA; plain, window ring and chunk caches; t = 1 and 3 (the contiguous and the general
 *      path of the vector kernels); 1 and 2 threads; three sequences of different lengths whose
 *      appends are interleaved (their blocks alternate in the pool); block sizes 16, 48, 256.
 *      mha_kv_cache_read returns the same rows. The contiguous cache is the oracle here: its
 *      attention is checked against float64 by test_kv_cache / test_kv_q8.
 *   2. Fork + copy-on-write, share_prefix, truncate / reset releasing and reusing blocks
 *      (free block counts), pool exhaustion with nothing appended, bad configs refused.
 *   3. Concurrent read-only attention calls on one paged cache whose blocks are shared between
 *      sequences (the test is run under ThreadSanitizer in CI) give the serial results.
 *   4. The layer's prefill, decode steps and a draft-tree step (GQA, RoPE; f32 and q8_0; blocks
 *      of 16 and 48) over a paged cache equal the contiguous cache's bit for bit, across a fork
 *      and a shared prefix.
 */
#include "harness.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct shape {
    int64_t g, h, dk, dv;
} shape;

static mha_kv_cache *make(const shape *sh,
                          mha_dtype dt,
                          int64_t window,
                          int64_t chunk,
                          int64_t bs,
                          int64_t nblocks,
                          int64_t batch) {
    mha_kv_cache_config kc = {0};
    kc.num_kv_heads = sh->g;
    kc.head_dim = sh->dk;
    kc.v_head_dim = sh->dv;
    kc.max_seq = 1024;
    kc.batch = batch;
    kc.dtype = dt;
    kc.window = window;
    kc.chunk_size = chunk;
    kc.max_step_tokens = 8;
    kc.block_size = bs;
    kc.num_blocks = nblocks;
    mha_kv_cache *c = NULL;
    mha_error err;
    CHECK_OK(mha_kv_cache_create(&kc, NULL, NULL, &c, &err), &err);
    return c;
}

/* Appends t random tokens to sequence s of every cache in cs (the same values). */
static void
append_all(mha_kv_cache **cs, int n, const shape *sh, test_rng *r, int64_t s, int64_t t) {
    float *k = malloc(sizeof(float) * (size_t)(t * sh->g * sh->dk));
    float *v = malloc(sizeof(float) * (size_t)(t * sh->g * sh->dv));
    test_fill_normal(r, k, t * sh->g * sh->dk, 1.0f);
    test_fill_normal(r, v, t * sh->g * sh->dv, 1.0f);
    mha_error err;
    for (int i = 0; i < n; i++)
        CHECK_OK(mha_kv_cache_append(cs[i], 1, &s, t, k, v, &err), &err);
    free(k);
    free(v);
}

static void attend(const mha_kv_cache *c,
                   const shape *sh,
                   int64_t S,
                   int64_t t,
                   const float *q,
                   float *out,
                   float *lse,
                   int nt) {
    mha_kv_attention_args a = {0};
    a.num_seqs = S;
    a.num_tokens = t;
    a.num_heads = sh->h;
    a.q = q;
    a.out = out;
    a.lse = lse;
    mha_exec ex = {0};
    ex.n_threads = nt;
    mha_error err;
    CHECK_OK(mha_kv_cache_attention(c, &a, &ex, &err), &err);
}

static void test_bit_identical(void) {
    const shape shapes[3] = {{2, 8, 64, 64}, {1, 3, 128, 128}, {2, 4, 32, 96}};
    const mha_dtype dts[4] = {MHA_DTYPE_F32, MHA_DTYPE_F16, MHA_DTYPE_BF16, MHA_DTYPE_Q8_0};
    const int64_t rings[3][2] = {{0, 0}, {100, 0}, {0, 64}}; /* window, chunk */
    const int64_t sizes[3] = {16, 48, 256};
    const int64_t lens[3] = {700, 301, 37};
    int cases = 0;
    for (int si = 0; si < 3; si++)
        for (int di = 0; di < 4; di++)
            for (int ri = 0; ri < 3; ri++) {
                const shape *sh = &shapes[si];
                const int64_t bs = sizes[(si + di + ri) % 3];
                mha_kv_cache *cs[2] = {make(sh, dts[di], rings[ri][0], rings[ri][1], 0, 0, 3),
                                       make(sh, dts[di], rings[ri][0], rings[ri][1], bs, 0, 3)};
                if (!cs[0] || !cs[1]) {
                    mha_kv_cache_destroy(cs[0]);
                    mha_kv_cache_destroy(cs[1]);
                    continue;
                }
                test_rng r;
                test_rng_seed(&r, (uint64_t)(100 * si + 10 * di + ri));
                /* appends of 1..8 tokens, round robin over the sequences: their blocks alternate */
                int64_t done[3] = {0, 0, 0};
                for (int more = 1; more;) {
                    more = 0;
                    for (int64_t s = 0; s < 3; s++) {
                        int64_t t = 1 + (int64_t)(test_rng_uniform(&r) * 8);
                        t = t < lens[s] - done[s] ? t : lens[s] - done[s];
                        if (t > 0) {
                            append_all(cs, 2, sh, &r, s, t);
                            done[s] += t;
                            more = 1;
                        }
                    }
                }
                for (int64_t t = 1; t <= 3; t += 2) {
                    const int64_t nq = 3 * t * sh->h * sh->dk, no = 3 * t * sh->h * sh->dv;
                    float *q = malloc(sizeof(float) * (size_t)nq);
                    float *o[2] = {malloc(sizeof(float) * (size_t)no),
                                   malloc(sizeof(float) * (size_t)no)};
                    float l[2][3 * 3 * 8];
                    test_fill_normal(&r, q, nq, 1.0f);
                    for (int nt = 1; nt <= 2; nt++) {
                        for (int i = 0; i < 2; i++)
                            attend(cs[i], sh, 3, t, q, o[i], l[i], nt);
                        CHECK(memcmp(o[0], o[1], sizeof(float) * (size_t)no) == 0 &&
                                  memcmp(l[0], l[1], sizeof(float) * (size_t)(3 * sh->h * t)) == 0,
                              "paged == contiguous bit for bit: shape %d dtype %d ring %d bs %lld "
                              "t %lld threads %d",
                              si, (int)dts[di], ri, (long long)bs, (long long)t, nt);
                    }
                    free(q);
                    free(o[0]);
                    free(o[1]);
                }
                /* read-back of every stored position */
                int same = 1;
                float *kr[2], *vr[2];
                for (int i = 0; i < 2; i++) {
                    kr[i] = malloc(sizeof(float) * (size_t)(sh->g * sh->dk));
                    vr[i] = malloc(sizeof(float) * (size_t)(sh->g * sh->dv));
                }
                for (int64_t s = 0; s < 3; s++)
                    for (int64_t p = 0; p < lens[s]; p++) {
                        mha_error e0, e1;
                        const mha_status s0 = mha_kv_cache_read(cs[0], s, p, kr[0], vr[0], &e0);
                        const mha_status s1 = mha_kv_cache_read(cs[1], s, p, kr[1], vr[1], &e1);
                        same &= s0 == s1; /* the same ring, the same positions stored */
                        if (s0 == MHA_STATUS_OK && s1 == MHA_STATUS_OK)
                            same &=
                                !memcmp(kr[0], kr[1], sizeof(float) * (size_t)(sh->g * sh->dk)) &&
                                !memcmp(vr[0], vr[1], sizeof(float) * (size_t)(sh->g * sh->dv));
                    }
                CHECK(same, "read back: paged == contiguous (shape %d dtype %d ring %d)", si,
                      (int)dts[di], ri);
                for (int i = 0; i < 2; i++) {
                    free(kr[i]);
                    free(vr[i]);
                    mha_kv_cache_destroy(cs[i]);
                }
                cases++;
            }
    CHECK(cases == 36, "all %d cases ran", cases);
}

/* Position p of sequence s of c read as float32 equals position p of sequence s2 of c2. */
static int same_row(const mha_kv_cache *c, int64_t s, int64_t s2, int64_t p, const shape *sh) {
    float a[2 * 64], b[2 * 64], va[2 * 64], vb[2 * 64];
    mha_error err;
    if (mha_kv_cache_read(c, s, p, a, va, &err) || mha_kv_cache_read(c, s2, p, b, vb, &err))
        return 0;
    return !memcmp(a, b, sizeof(float) * (size_t)(sh->g * sh->dk)) &&
           !memcmp(va, vb, sizeof(float) * (size_t)(sh->g * sh->dv));
}

static void test_blocks(void) {
    const shape sh = {2, 4, 64, 64};
    mha_kv_cache *c = make(&sh, MHA_DTYPE_F32, 0, 0, 16, 20, 4);
    mha_kv_cache *ref = make(&sh, MHA_DTYPE_F32, 0, 0, 0, 0, 4); /* holds the original rows */
    if (!c || !ref)
        return;
    mha_kv_cache *both[2] = {c, ref};
    mha_error err;
    test_rng r;
    test_rng_seed(&r, 5);
    CHECK(mha_kv_cache_free_blocks(c) == 20 && mha_kv_cache_free_blocks(ref) == 0 &&
              mha_kv_cache_free_blocks(NULL) == -1,
          "free blocks of a new cache");
    append_all(both, 2, &sh, &r, 0, 40); /* 3 blocks, the last holds 8 rows */
    CHECK(mha_kv_cache_free_blocks(c) == 17, "40 positions take 3 blocks (%lld free)",
          (long long)mha_kv_cache_free_blocks(c));

    /* fork: no block taken; an append to the fork copies the shared partial block */
    CHECK_OK(mha_kv_cache_copy(c, 0, 1, &err), &err);
    CHECK(mha_kv_cache_free_blocks(c) == 17 && mha_kv_cache_length(c, 1) == 40,
          "fork shares the blocks");
    append_all(&c, 1, &sh, &r, 1, 1);
    CHECK(mha_kv_cache_free_blocks(c) == 16, "append to a fork copies its shared last block");
    append_all(&c, 1, &sh, &r, 0, 3);
    CHECK(mha_kv_cache_free_blocks(c) == 16, "the parent's last block is its own again");
    int ok = mha_kv_cache_length(c, 0) == 43 && mha_kv_cache_length(c, 1) == 41;
    for (int64_t p = 0; p < 40; p++)
        ok &= same_row(c, 0, 1, p, &sh);
    ok &= !same_row(c, 0, 1, 40, &sh); /* different tokens appended at 40 */
    CHECK(ok, "fork + copy-on-write: the shared prefix is the same, the appends apart");
    /* the parent's rows 0..39 are the originals */
    float a[128], b[128];
    ok = 1;
    for (int64_t p = 0; p < 40; p++) {
        ok &= mha_kv_cache_read(c, 0, p, a, NULL, &err) == MHA_STATUS_OK &&
              mha_kv_cache_read(ref, 0, p, b, NULL, &err) == MHA_STATUS_OK &&
              !memcmp(a, b, sizeof a);
    }
    CHECK(ok, "appending to a fork does not change the parent");

    /* share_prefix: dst keeps src's first len positions, blocks shared */
    CHECK_OK(mha_kv_cache_share_prefix(c, 0, 2, 20, &err), &err);
    CHECK(mha_kv_cache_length(c, 2) == 20 && mha_kv_cache_free_blocks(c) == 16,
          "share_prefix: length 20, no block taken");
    append_all(&c, 1, &sh, &r, 2, 1); /* position 20: block 1 is shared with seq 0 */
    CHECK(mha_kv_cache_free_blocks(c) == 15, "append after a shared prefix copies the block");
    ok = 1;
    for (int64_t p = 0; p < 40; p++)
        ok &= mha_kv_cache_read(c, 0, p, a, NULL, &err) == MHA_STATUS_OK &&
              mha_kv_cache_read(ref, 0, p, b, NULL, &err) == MHA_STATUS_OK &&
              !memcmp(a, b, sizeof a);
    for (int64_t p = 0; p < 20; p++)
        ok &= same_row(c, 0, 2, p, &sh);
    CHECK(ok, "share_prefix + append leave the source as it was");
    CHECK(mha_kv_cache_share_prefix(c, 0, 3, 44, &err) == MHA_STATUS_INVALID_ARG &&
              mha_kv_cache_length(c, 3) == 0,
          "share_prefix beyond the source's length is refused: %s", err.message);

    /* truncate and reset release blocks; released blocks are reused */
    CHECK_OK(mha_kv_cache_truncate(c, 0, 16, &err), &err); /* blocks 1, 2 of seq 0 */
    CHECK(mha_kv_cache_free_blocks(c) == 16, "truncate releases the blocks past the length (%lld)",
          (long long)mha_kv_cache_free_blocks(c));
    for (int64_t s = 0; s < 4; s++)
        CHECK_OK(mha_kv_cache_reset(c, s, &err), &err);
    CHECK(mha_kv_cache_free_blocks(c) == 20, "reset returns every block");
    append_all(&c, 1, &sh, &r, 3, 320); /* the whole pool */
    CHECK(mha_kv_cache_free_blocks(c) == 0 && mha_kv_cache_length(c, 3) == 320,
          "the released blocks are reused");

    /* exhaustion: nothing appended, clear message */
    float k[2 * 2 * 64] = {0}, v[2 * 2 * 64] = {0};
    int64_t s1 = 1;
    mha_status st = mha_kv_cache_append(c, 1, &s1, 1, k, v, &err);
    CHECK(st == MHA_STATUS_NO_MEMORY && strstr(err.message, "pool exhausted") &&
              mha_kv_cache_length(c, 1) == 0,
          "pool exhaustion: %s, nothing appended (%s)", mha_status_string(st), err.message);
    CHECK_OK(mha_kv_cache_truncate(c, 3, 304, &err), &err); /* frees one block */
    const int64_t ids[2] = {3, 1};
    st = mha_kv_cache_append(c, 2, ids, 1, k, v, &err); /* needs 2, 1 free */
    CHECK(st == MHA_STATUS_NO_MEMORY && mha_kv_cache_length(c, 3) == 304 &&
              mha_kv_cache_length(c, 1) == 0 && mha_kv_cache_free_blocks(c) == 1,
          "an append to two sequences that needs 2 blocks with 1 free: nothing appended");
    st = mha_kv_cache_append(c, 1, &s1, 1, k, v, &err);
    CHECK(st == MHA_STATUS_OK && mha_kv_cache_free_blocks(c) == 0, "one block: appended");
    mha_kv_cache_destroy(c);
    mha_kv_cache_destroy(ref);

    /* a window ring: a fork's wrap into shared blocks copies them */
    mha_kv_cache *w = make(&sh, MHA_DTYPE_F32, 24, 0, 16, 0, 2); /* 24 + 7 = 31 slots */
    if (!w)
        return;
    CHECK(mha_kv_cache_slots(w) == 31 && mha_kv_cache_free_blocks(w) == 4,
          "window ring: 31 slots in 2 blocks per sequence (%lld slots)",
          (long long)mha_kv_cache_slots(w));
    for (int i = 0; i < 5; i++)
        append_all(&w, 1, &sh, &r, 0, 8);
    CHECK_OK(mha_kv_cache_copy(w, 0, 1, &err), &err);
    for (int i = 0; i < 3; i++)
        append_all(&w, 1, &sh, &r, 1, 8);
    ok = mha_kv_cache_free_blocks(w) == 0;
    for (int64_t p = 17; p < 40; p++)
        ok &= mha_kv_cache_read(w, 0, p, a, NULL, &err) == MHA_STATUS_OK;
    CHECK(ok, "ring fork: the parent keeps its window while the fork wraps (%lld free)",
          (long long)mha_kv_cache_free_blocks(w));
    mha_kv_cache_destroy(w);
}

static void test_bad_configs(void) {
    const struct {
        int64_t bs, nb;
    } bad[] = {{8, 0}, {15, 0}, {65537, 0}, {-16, 0}, {0, 4}, {16, -1}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        mha_kv_cache_config kc = {0};
        kc.num_kv_heads = 1;
        kc.head_dim = 32;
        kc.max_seq = 64;
        kc.batch = 1;
        kc.block_size = bad[i].bs;
        kc.num_blocks = bad[i].nb;
        mha_kv_cache *c = NULL;
        mha_error err;
        const mha_status st = mha_kv_cache_create(&kc, NULL, NULL, &c, &err);
        CHECK(st == MHA_STATUS_INVALID_ARG && c == NULL && err.message[0] &&
                  (strstr(err.message, "block_size") || strstr(err.message, "num_blocks")),
              "block_size=%lld num_blocks=%lld refused: %s", (long long)bad[i].bs,
              (long long)bad[i].nb, err.message);
    }
}

typedef struct job {
    const mha_kv_cache *c;
    const shape *sh;
    const float *q;
    float *out;
    int failed; /* checked by the main thread (the harness is not thread-safe) */
} job;

static void *run_job(void *arg) {
    job *j = arg;
    mha_kv_attention_args a = {0};
    a.num_seqs = 3;
    a.num_tokens = 1;
    a.num_heads = j->sh->h;
    a.q = j->q;
    a.out = j->out;
    mha_exec ex = {0};
    ex.n_threads = 1;
    for (int rep = 0; rep < 3; rep++)
        j->failed |= mha_kv_cache_attention(j->c, &a, &ex, NULL) != MHA_STATUS_OK;
    return NULL;
}

static void test_concurrent(void) {
    const shape sh = {2, 8, 64, 64};
    mha_kv_cache *c = make(&sh, MHA_DTYPE_F16, 0, 0, 16, 0, 3);
    if (!c)
        return;
    test_rng r;
    test_rng_seed(&r, 11);
    append_all(&c, 1, &sh, &r, 0, 300);
    mha_error err;
    CHECK_OK(mha_kv_cache_copy(c, 0, 1, &err), &err);
    CHECK_OK(mha_kv_cache_share_prefix(c, 0, 2, 150, &err), &err);
    append_all(&c, 1, &sh, &r, 1, 5);
    append_all(&c, 1, &sh, &r, 2, 9);
    const int64_t nq = 3 * sh.h * sh.dk, no = 3 * sh.h * sh.dv;
    float *q = malloc(sizeof(float) * (size_t)nq), *want = malloc(sizeof(float) * (size_t)no);
    float *outs = calloc((size_t)(4 * no), sizeof(float));
    test_fill_normal(&r, q, nq, 1.0f);
    attend(c, &sh, 3, 1, q, want, NULL, 1);
    pthread_t th[4];
    job jobs[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (job){c, &sh, q, outs + i * no, 0};
        pthread_create(&th[i], NULL, run_job, &jobs[i]);
    }
    int ok = 1;
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        ok &= !jobs[i].failed && !memcmp(outs + i * no, want, sizeof(float) * (size_t)no);
    }
    CHECK(ok, "concurrent attention on shared blocks == serial");
    free(q);
    free(want);
    free(outs);
    mha_kv_cache_destroy(c);
}

/* ---- 4. the layer's step (prefill, decode step, draft tree) through a paged cache ---- */

enum { LH = 4, LG = 2, LD = 32, LQ = 128 }; /* GQA: 4 heads over 2 kv heads of 32, width 128 */

static mha_layer *make_layer(test_rng *r) {
    mha_config c = {0};
    c.q_dim = LQ, c.num_heads = LH, c.num_kv_heads = LG, c.head_dim = LD;
    c.bias_q = c.bias_k = c.bias_v = c.bias_o = 1;
    c.rope.style = MHA_ROPE_HALF; /* positions matter: a wrong slot or position shows */
    const int64_t n[8] = {LH * LD * LQ, LG * LD * LQ, LG * LD * LQ, LQ * LH * LD,
                          LH * LD,      LG * LD,      LG * LD,      LQ};
    float *p[8];
    for (int i = 0; i < 8; i++) {
        p[i] = malloc(sizeof(float) * (size_t)n[i]);
        test_fill_normal(r, p[i], n[i], i < 4 ? 2.0f / sqrtf((float)LQ) : 0.1f);
    }
    mha_weights w = {0};
    w.w_q = p[0], w.w_k = p[1], w.w_v = p[2], w.w_o = p[3];
    w.b_q = p[4], w.b_k = p[5], w.b_v = p[6], w.b_o = p[7];
    mha_layer *L = NULL;
    mha_error err;
    CHECK_OK(mha_layer_create(&c, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err);
    for (int i = 0; i < 8; i++)
        free(p[i]);
    return L;
}

/* One layer call (prefill when prefill, else a decode step; tree: draft-tree parents or NULL) of
 * S sequences (seq_ids, NULL = 0 .. S-1) x t random tokens on both caches: the same out bits. */
static void layer_call(const mha_layer *L,
                       mha_kv_cache *cs[2],
                       int prefill,
                       int64_t S,
                       const int64_t *seq_ids,
                       int64_t t,
                       const int64_t *tree,
                       test_rng *r,
                       const char *what) {
    float *x = malloc(sizeof(float) * (size_t)(S * t * LQ));
    float *o[2] = {malloc(sizeof(float) * (size_t)(S * t * LQ)),
                   malloc(sizeof(float) * (size_t)(S * t * LQ))};
    test_fill_normal(r, x, S * t * LQ, 1.0f);
    mha_decode_args a = {0};
    a.num_seqs = S, a.seq_ids = seq_ids, a.num_tokens = t, a.x = x, a.tree_parents = tree;
    mha_exec ex = {0};
    ex.n_threads = 2;
    mha_error err;
    for (int i = 0; i < 2; i++) {
        a.out = o[i];
        CHECK_OK(prefill ? mha_layer_prefill(L, cs[i], &a, &ex, &err)
                         : mha_layer_decode_step(L, cs[i], &a, &ex, &err),
                 &err);
    }
    const mha_kv_cache_config *pc = mha_kv_cache_get_config(cs[1]);
    CHECK(memcmp(o[0], o[1], sizeof(float) * (size_t)(S * t * LQ)) == 0,
          "layer %s: paged (block %lld, dtype %d) == contiguous bit for bit", what,
          (long long)pc->block_size, (int)pc->dtype);
    free(x), free(o[0]), free(o[1]);
}

/* The layer's prefill and decode steps (t = 1 and 3, a draft tree) of three sequences over a
 * paged cache give the contiguous cache's outputs bit for bit (the contiguous layer step is checked
 * against the full causal forward by test_kv_cache), across a fork
 * (mha_kv_cache_copy: copy-on-write of the partial block by the next step) and a shared prefix
 * (mha_kv_cache_share_prefix), for f32 and q8_0 caches, blocks of 16 and 48; every stored
 * position reads back the same. */
static void test_layer_step(void) {
    test_rng r;
    test_rng_seed(&r, 38);
    mha_layer *L = make_layer(&r);
    if (!L)
        return;
    const mha_dtype dts[2] = {MHA_DTYPE_F32, MHA_DTYPE_Q8_0};
    const int64_t sizes[2] = {16, 48};
    for (int di = 0; di < 2; di++)
        for (int bi = 0; bi < 2; bi++) {
            mha_kv_cache *cs[2] = {NULL, NULL};
            mha_error err;
            for (int i = 0; i < 2; i++) {
                mha_kv_cache_config kc = {0};
                kc.max_seq = 256, kc.batch = 3, kc.dtype = dts[di];
                kc.block_size = i ? sizes[bi] : 0;
                CHECK_OK(mha_kv_cache_create(&kc, L, NULL, &cs[i], &err), &err);
            }
            if (!cs[0] || !cs[1]) {
                mha_kv_cache_destroy(cs[0]);
                mha_kv_cache_destroy(cs[1]);
                continue;
            }
            const int64_t s0 = 0, s1 = 1, s20[2] = {2, 0}, s1only = 1;
            layer_call(L, cs, 1, 1, &s0, 37, NULL, &r, "prefill seq 0");
            layer_call(L, cs, 1, 1, &s1, 20, NULL, &r, "prefill seq 1");
            for (int k = 0; k < 5; k++)
                layer_call(L, cs, 0, 2, NULL, 1, NULL, &r, "step seqs 0, 1");
            for (int i = 0; i < 2; i++) /* fork: seq 2 shares seq 0's blocks */
                CHECK_OK(mha_kv_cache_copy(cs[i], 0, 2, &err), &err);
            for (int k = 0; k < 4; k++)
                layer_call(L, cs, 0, 3, NULL, 1, NULL, &r, "step after fork");
            layer_call(L, cs, 0, 2, s20, 3, NULL, &r, "3-token step seqs 2, 0");
            for (int i = 0; i < 2; i++) /* seq 1 := the first 30 positions of seq 2 */
                CHECK_OK(mha_kv_cache_share_prefix(cs[i], 2, 1, 30, &err), &err);
            for (int k = 0; k < 4; k++)
                layer_call(L, cs, 0, 3, NULL, 1, NULL, &r, "step after share_prefix");
            const int64_t tree[4] = {-1, 0, 0, 1};
            layer_call(L, cs, 0, 1, &s1only, 4, tree, &r, "draft tree seq 1");
            layer_call(L, cs, 1, 3, NULL, 9, NULL, &r, "prefill 9 more on every seq");
            int same = 1;
            float k0[LG * LD], v0[LG * LD], k1[LG * LD], v1[LG * LD];
            for (int64_t s = 0; s < 3; s++) {
                same &= mha_kv_cache_length(cs[0], s) == mha_kv_cache_length(cs[1], s);
                for (int64_t p = 0; p < mha_kv_cache_length(cs[0], s); p++) {
                    CHECK_OK(mha_kv_cache_read(cs[0], s, p, k0, v0, &err), &err);
                    CHECK_OK(mha_kv_cache_read(cs[1], s, p, k1, v1, &err), &err);
                    same &= !memcmp(k0, k1, sizeof k0) && !memcmp(v0, v1, sizeof v0);
                }
            }
            CHECK(same, "layer steps: paged (block %lld, dtype %d) reads back the contiguous rows",
                  (long long)sizes[bi], (int)dts[di]);
            mha_kv_cache_destroy(cs[0]);
            mha_kv_cache_destroy(cs[1]);
        }
    mha_layer_destroy(L);
}

int main(void) {
    test_bit_identical();
    test_blocks();
    test_bad_configs();
    test_concurrent();
    test_layer_step();
    return test_finish();
}
