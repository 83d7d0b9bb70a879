/* SPDX-License-Identifier: MIT */
/* test_kv_q8x16.c: q8_0 caches in the key-interleaved order
 * (mha_experimental_kv_cache_create_q8_order, cache/kv_cache.h) against ggml's rows. Per
 * configuration (contiguous, window and chunk rings, pages of 16, 32 and 48 slots, d_k != d_v) one
 * rows cache and one interleaved cache take the same random sequence of calls (append with
 * non-finite and all-zero blocks, truncate, accept, copy, share_prefix, reset, compact, attention);
 * after every call:
 *   - both gave the same status;
 *   - every position of every sequence reads back bit-identically (mha_kv_cache_read: the same
 *     status, the same float32 bits): the order changes where bytes lie, not values;
 *   - attention with impl=REFERENCE is bit-identical (the reference core on the dequantised rows),
 *     and AUTO is bit-identical when this run's decode kernel is the generic one (the interleaved
 *     cache always runs it: MHA_MAX_ISA=generic, as tools/test.sh runs every test), else within
 *     TOL_OUT_REL of the REFERENCE result (each order's kernel on this tier).
 * Also: the order is refused for other dtypes and for block sizes that are not multiples of 16;
 * mha_kv_cache_create takes it by itself exactly where mha_experimental_cpu_q8x16() says (never
 * without AVX-512 under MHA_MAX_ISA); and the interleaved order's kernel (AVX-512 VNNI where the
 * CPU has it, else the generic one) over every row count of its blocks of 4 (R = 1 .. 10), units
 * that start inside a group (a window ring), partial groups, pages, soft-cap, ALiBi and sinks
 * stays within TOL_OUT_REL of the REFERENCE result. */
#include "harness.h"
#include "mha.h"
#include "mha_experimental.h"
#include "tolerance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { BATCH = 3, G = 2, H = 4, MAX_T = 4, OPS = 220 };

typedef struct cfg {
    const char *name;
    int64_t dk, dv, max_seq, window, chunk, block, num_blocks;
} cfg;

typedef struct pair {
    mha_kv_cache *rows, *x16;
    const cfg *cf;
} pair;

/* Same status, same message class: a failure on one side only is a difference. */
static void same_status(mha_status a, mha_status b, const char *what, const cfg *cf, int op) {
    CHECK(a == b, "%s op %d %s: rows %d, interleaved %d", cf->name, op, what, (int)a, (int)b);
}

/* Every stored position of every sequence reads the same bits from both caches. */
static void compare_contents(const pair *p, int op) {
    const int64_t dk = p->cf->dk, dv = p->cf->dv;
    float *a = malloc(sizeof(float) * (size_t)(2 * G * (dk + dv)));
    float *ka = a, *va = a + G * dk, *kb = va + G * dv, *vb = kb + G * dk;
    for (int64_t s = 0; s < BATCH; s++) {
        const int64_t L = mha_kv_cache_length(p->rows, s);
        CHECK(L == mha_kv_cache_length(p->x16, s), "%s op %d: seq %lld lengths %lld / %lld",
              p->cf->name, op, (long long)s, (long long)L,
              (long long)mha_kv_cache_length(p->x16, s));
        for (int64_t pos = 0; pos < L; pos++) {
            const mha_status sa = mha_kv_cache_read(p->rows, s, pos, ka, va, NULL);
            const mha_status sb = mha_kv_cache_read(p->x16, s, pos, kb, vb, NULL);
            same_status(sa, sb, "read", p->cf, op);
            if (sa == MHA_STATUS_OK && sb == MHA_STATUS_OK)
                CHECK(!memcmp(ka, kb, sizeof(float) * (size_t)(G * dk)) &&
                          !memcmp(va, vb, sizeof(float) * (size_t)(G * dv)),
                      "%s op %d: seq %lld position %lld reads differently", p->cf->name, op,
                      (long long)s, (long long)pos);
        }
    }
    free(a);
}

/* k or v rows of n tokens: normal values, an all-zero block now and then, rarely a NaN or an
 * infinity (the block then reads as NaN in both orders); `big`: some blocks 1000x larger (values
 * only: large keys make the softmax so steep that float32 rounding of a score moves outputs by
 * more than TOL_OUT_REL, in every kernel). */
static void fill_rows(test_rng *r, float *x, int64_t n, int64_t d, int big) {
    test_fill_normal(r, x, n * d, 1.0f);
    for (int64_t b = 0; b < n * d / 32; b++) {
        const double u = test_rng_uniform(r);
        if (u < 0.05)
            memset(x + 32 * b, 0, sizeof(float) * 32);
        else if (u < 0.07)
            x[32 * b + (int64_t)(test_rng_u64(r) % 32)] = u < 0.06 ? NAN : INFINITY;
        else if (big && u < 0.15)
            for (int i = 0; i < 32; i++)
                x[32 * b + i] *= 1e3f;
    }
}

static void attention(const pair *p, test_rng *r, int op) {
    int64_t ids[BATCH], n = 0, minlen = INT64_MAX;
    for (int64_t s = 0; s < BATCH; s++) {
        const int64_t L = mha_kv_cache_length(p->rows, s);
        if (L > 0 && test_rng_uniform(r) < 0.8) {
            ids[n++] = s;
            minlen = L < minlen ? L : minlen;
        }
    }
    if (n == 0)
        return;
    const int64_t t = 1 + (int64_t)(test_rng_u64(r) % (uint64_t)(minlen < 3 ? minlen : 3));
    const int64_t dk = p->cf->dk, dv = p->cf->dv;
    float *q = malloc(sizeof(float) * (size_t)(n * t * H * dk));
    float *o = calloc((size_t)(4 * n * t * H * dv), sizeof(float));
    test_fill_normal(r, q, n * t * H * dk, 1.0f);
    mha_kv_attention_args a;
    memset(&a, 0, sizeof a);
    a.num_seqs = n, a.seq_ids = ids, a.num_tokens = t, a.num_heads = H, a.q = q;
    const int64_t on = n * t * H * dv;
    mha_exec ex;
    memset(&ex, 0, sizeof ex);
    ex.n_threads = 1 + (int32_t)(test_rng_u64(r) % 2);
    for (int ref = 1; ref >= 0; ref--) {
        ex.impl = ref ? MHA_IMPL_REFERENCE : MHA_IMPL_AUTO;
        a.out = o + (ref ? 0 : 2 * on);
        const mha_status sa = mha_kv_cache_attention(p->rows, &a, &ex, NULL);
        a.out = o + (ref ? on : 3 * on);
        const mha_status sb = mha_kv_cache_attention(p->x16, &a, &ex, NULL);
        same_status(sa, sb, ref ? "attention (REFERENCE)" : "attention (AUTO)", p->cf, op);
        if (sa != MHA_STATUS_OK || sb != MHA_STATUS_OK)
            break;
    }
    const int bits_ref = !memcmp(o, o + on, sizeof(float) * (size_t)on);
    CHECK(bits_ref, "%s op %d: REFERENCE attention differs between the orders", p->cf->name, op);
    if (test_generic_decode()) {
        CHECK(!memcmp(o + 2 * on, o + 3 * on, sizeof(float) * (size_t)on),
              "%s op %d: the generic kernel's attention differs between the orders", p->cf->name,
              op);
    } else { /* each order's kernel on this tier */
        double mx = 0, diff = 0;
        for (int64_t i = 0; i < on; i++) {
            if (!isfinite(o[i]))
                continue; /* a NaN block poisons the same rows in every path */
            const double ref = (double)o[i], rows = (double)o[2 * on + i],
                         x16 = (double)o[3 * on + i];
            mx = fmax(mx, fabs(ref));
            diff = fmax(diff, fmax(fabs(rows - ref), fabs(x16 - ref)));
        }
        CHECK(diff <= TOL_OUT_REL * fmax(mx, 1e-30),
              "%s op %d: AUTO %.3e from REFERENCE (max %.3e)", p->cf->name, op, diff, mx);
    }
    free(q), free(o);
}

static void one_op(const pair *p, test_rng *r, int op) {
    const int64_t s = (int64_t)(test_rng_u64(r) % BATCH), s2 = (int64_t)(test_rng_u64(r) % BATCH);
    const int64_t L = mha_kv_cache_length(p->rows, s);
    const double u = test_rng_uniform(r);
    mha_status sa, sb;
    if (u < 0.45) { /* append to 1 .. BATCH sequences */
        int64_t ids[BATCH], n = 0;
        for (int64_t i = 0; i < BATCH; i++)
            if (test_rng_uniform(r) < 0.6 || (n == 0 && i == BATCH - 1))
                ids[n++] = i;
        const int64_t t = 1 + (int64_t)(test_rng_u64(r) % MAX_T);
        float *k = malloc(sizeof(float) * (size_t)(n * t * G * p->cf->dk));
        float *v = malloc(sizeof(float) * (size_t)(n * t * G * p->cf->dv));
        fill_rows(r, k, n * t * G, p->cf->dk, 0);
        fill_rows(r, v, n * t * G, p->cf->dv, 1);
        sa = mha_kv_cache_append(p->rows, n, ids, t, k, v, NULL);
        sb = mha_kv_cache_append(p->x16, n, ids, t, k, v, NULL);
        same_status(sa, sb, "append", p->cf, op);
        free(k), free(v);
    } else if (u < 0.55) {
        const int64_t nl = L > 0 ? (int64_t)(test_rng_u64(r) % (uint64_t)(L + 1)) : 0;
        same_status(mha_kv_cache_truncate(p->rows, s, nl, NULL),
                    mha_kv_cache_truncate(p->x16, s, nl, NULL), "truncate", p->cf, op);
    } else if (u < 0.68) { /* accept n of the last m positions (drafts) */
        const int64_t m = L < 6 ? L : 6;
        int64_t idx[6], n = 0;
        for (int64_t i = 0; i < m; i++)
            if (test_rng_uniform(r) < 0.5)
                idx[n++] = i;
        same_status(mha_kv_cache_accept(p->rows, s, L - m, n, idx, NULL),
                    mha_kv_cache_accept(p->x16, s, L - m, n, idx, NULL), "accept", p->cf, op);
    } else if (u < 0.74) {
        same_status(mha_kv_cache_copy(p->rows, s, s2, NULL), mha_kv_cache_copy(p->x16, s, s2, NULL),
                    "copy", p->cf, op);
    } else if (u < 0.80) {
        const int64_t len = L > 0 ? (int64_t)(test_rng_u64(r) % (uint64_t)(L + 1)) : 0;
        same_status(mha_kv_cache_share_prefix(p->rows, s, s2, len, NULL),
                    mha_kv_cache_share_prefix(p->x16, s, s2, len, NULL), "share_prefix", p->cf, op);
    } else if (u < 0.84) {
        same_status(mha_kv_cache_reset(p->rows, s, NULL), mha_kv_cache_reset(p->x16, s, NULL),
                    "reset", p->cf, op);
    } else if (u < 0.88) {
        same_status(mha_kv_cache_compact(p->rows, NULL), mha_kv_cache_compact(p->x16, NULL),
                    "compact", p->cf, op);
    } else {
        attention(p, r, op);
    }
    CHECK(mha_kv_cache_free_blocks(p->rows) == mha_kv_cache_free_blocks(p->x16),
          "%s op %d: free blocks %lld / %lld", p->cf->name, op,
          (long long)mha_kv_cache_free_blocks(p->rows),
          (long long)mha_kv_cache_free_blocks(p->x16));
    compare_contents(p, op);
}

static void run_config(const cfg *cf, uint64_t seed) {
    mha_kv_cache_config cc;
    memset(&cc, 0, sizeof cc);
    cc.num_kv_heads = G, cc.head_dim = cf->dk, cc.v_head_dim = cf->dv, cc.max_seq = cf->max_seq;
    cc.batch = BATCH, cc.dtype = MHA_DTYPE_Q8_0, cc.window = cf->window;
    cc.chunk_size = cf->chunk, cc.max_step_tokens = MAX_T, cc.block_size = cf->block;
    cc.num_blocks = cf->num_blocks;
    pair p = {NULL, NULL, cf};
    mha_error err;
    CHECK_OK(mha_experimental_kv_cache_create_q8_order(&cc, NULL, NULL, 0, &p.rows, &err), &err);
    CHECK_OK(mha_experimental_kv_cache_create_q8_order(&cc, NULL, NULL, 1, &p.x16, &err), &err);
    if (!p.rows || !p.x16)
        return;
    CHECK(mha_experimental_kv_cache_q8x16(p.x16) == 1 &&
              mha_experimental_kv_cache_q8x16(p.rows) == 0,
          "%s: the caches' orders", cf->name);
    CHECK(mha_kv_cache_slots(p.rows) == mha_kv_cache_slots(p.x16), "%s: slots %lld / %lld",
          cf->name, (long long)mha_kv_cache_slots(p.rows), (long long)mha_kv_cache_slots(p.x16));
    test_rng r;
    test_rng_seed(&r, seed);
    for (int op = 0; op < OPS; op++)
        one_op(&p, &r, op);
    mha_kv_cache_destroy(p.rows);
    mha_kv_cache_destroy(p.x16);
}

/* The order is a q8_0 cache's, contiguous or in pages of a multiple of 16 slots. */
static void test_refused(void) {
    mha_kv_cache_config cc;
    memset(&cc, 0, sizeof cc);
    cc.num_kv_heads = 1, cc.head_dim = 32, cc.max_seq = 64, cc.batch = 1;
    const struct {
        mha_dtype dt;
        int64_t block;
    } bad[] = {{MHA_DTYPE_F16, 0}, {MHA_DTYPE_F32, 16}, {MHA_DTYPE_Q8_0, 17}, {MHA_DTYPE_Q8_0, 40}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cc.dtype = bad[i].dt, cc.block_size = bad[i].block;
        mha_kv_cache *c = (mha_kv_cache *)&cc; /* must come back NULL */
        mha_error err;
        const mha_status st =
            mha_experimental_kv_cache_create_q8_order(&cc, NULL, NULL, 1, &c, &err);
        CHECK(st == MHA_STATUS_INVALID_ARG && c == NULL && strstr(err.message, "interleaved"),
              "dtype %d block %lld: status %d (%s)", (int)bad[i].dt, (long long)bad[i].block,
              (int)st, err.message);
        mha_kv_cache_destroy(c == (mha_kv_cache *)&cc ? NULL : c);
    }
}

/* mha_kv_cache_create's own order: interleaved exactly where mha_experimental_cpu_q8x16() says,
 * for contiguous caches and pages of a multiple of 16 slots; rows for other pages and without
 * AVX-512 (a cap to avx2 or generic). */
static void test_auto_order(void) {
    const int want = mha_experimental_cpu_q8x16() == 1;
    CHECK(!want || strstr(mha_experimental_cpu_isas(1), "avx512"),
          "the interleaved order chosen without AVX-512 (%s)", mha_experimental_cpu_isas(1));
    const int64_t blocks[] = {0, 16, 32, 17, 24};
    for (size_t i = 0; i < sizeof blocks / sizeof blocks[0]; i++) {
        mha_kv_cache_config cc;
        memset(&cc, 0, sizeof cc);
        cc.num_kv_heads = 1, cc.head_dim = 32, cc.max_seq = 64, cc.batch = 1;
        cc.dtype = MHA_DTYPE_Q8_0, cc.block_size = blocks[i];
        mha_kv_cache *c = NULL;
        mha_error err;
        CHECK_OK(mha_kv_cache_create(&cc, NULL, NULL, &c, &err), &err);
        const int x16 = blocks[i] % 16 == 0 && want;
        CHECK(c && mha_experimental_kv_cache_q8x16(c) == x16, "block_size %lld: order %d, want %d",
              (long long)blocks[i], c ? (int)mha_experimental_kv_cache_q8x16(c) : -1, x16);
        mha_kv_cache_destroy(c);
    }
}

/* One interleaved cache (dk 64, dv 96: 2 and 3 blocks), one sequence of L positions; AUTO against
 * REFERENCE for g query heads per kv head and t tokens (R = g t rows). */
static void kernel_shape(const char *name, int64_t window, int64_t block, int64_t L, test_rng *r) {
    enum { KG = 2, DK = 64, DV = 96 };
    mha_kv_cache_config cc;
    memset(&cc, 0, sizeof cc);
    cc.num_kv_heads = KG, cc.head_dim = DK, cc.v_head_dim = DV, cc.max_seq = 700, cc.batch = 1;
    cc.dtype = MHA_DTYPE_Q8_0, cc.window = window, cc.block_size = block, cc.max_step_tokens = 64;
    mha_kv_cache *c = NULL;
    mha_error err;
    CHECK_OK(mha_experimental_kv_cache_create_q8_order(&cc, NULL, NULL, 1, &c, &err), &err);
    if (!c)
        return;
    float *k = malloc(sizeof(float) * 64 * KG * DK), *v = malloc(sizeof(float) * 64 * KG * DV);
    for (int64_t at = 0; at < L; at += 64) {
        const int64_t n = L - at < 64 ? L - at : 64;
        test_fill_normal(r, k, n * KG * DK, 1.0f);
        test_fill_normal(r, v, n * KG * DV, 1.0f);
        CHECK_OK(mha_kv_cache_append(c, 1, NULL, n, k, v, &err), &err);
    }
    const int64_t gs[] = {1, 3, 4, 5}, ts[] = {1, 2};
    for (size_t gi = 0; gi < 4; gi++)
        for (size_t ti = 0; ti < 2; ti++) {
            const int64_t nh = KG * gs[gi], t = ts[ti], nq = t * nh * DK, no = t * nh * DV;
            float *q = malloc(sizeof(float) * (size_t)nq), *o = malloc(sizeof(float) * 2 * no);
            float sinks[2 * 5];
            test_fill_normal(r, q, nq, 1.0f);
            test_fill_normal(r, sinks, nh, 1.0f);
            mha_kv_attention_args a;
            memset(&a, 0, sizeof a);
            a.num_seqs = 1, a.num_tokens = t, a.num_heads = nh, a.q = q;
            a.softcap = gi == 1 ? 3.0 : 0.0, a.alibi = gi == 2, a.sinks = gi == 3 ? sinks : NULL;
            mha_exec ex;
            memset(&ex, 0, sizeof ex);
            for (int ref = 0; ref < 2; ref++) {
                ex.impl = ref ? MHA_IMPL_REFERENCE : MHA_IMPL_AUTO;
                a.out = o + ref * no;
                CHECK_OK(mha_kv_cache_attention(c, &a, &ex, &err), &err);
            }
            double mx = 0, diff = 0;
            for (int64_t i = 0; i < no; i++) {
                mx = fmax(mx, fabs((double)o[no + i]));
                diff = fmax(diff, fabs((double)o[i] - (double)o[no + i]));
            }
            CHECK(diff <= TOL_OUT_REL * mx,
                  "%s, L %lld, g %lld, t %lld: AUTO %.3e from REFERENCE "
                  "(max %.3e)",
                  name, (long long)L, (long long)gs[gi], (long long)t, diff, mx);
            free(q), free(o);
        }
    free(k), free(v);
    mha_kv_cache_destroy(c);
}

static void test_kernel_shapes(void) {
    test_rng r;
    test_rng_seed(&r, 77);
    kernel_shape("contiguous", 0, 0, 600, &r);   /* units of 256, 256, 88 keys */
    kernel_shape("contiguous", 0, 0, 37, &r);    /* one partial group after two whole ones */
    kernel_shape("window 100", 100, 0, 517, &r); /* units start inside groups; the ring wraps */
    kernel_shape("paged 32", 0, 32, 301, &r);
    kernel_shape("paged 16, window 70", 70, 16, 333, &r);
}

int main(void) {
    test_refused();
    test_auto_order();
    test_kernel_shapes();
    const cfg cfgs[] = {
        {"contiguous, 75 slots", 64, 32, 75, 0, 0, 0, 0},
        {"contiguous window 20 (ring of 23)", 32, 64, 120, 20, 0, 0, 0},
        {"contiguous chunk 16 (ring)", 64, 64, 90, 0, 16, 0, 0},
        {"paged 16, tight pool", 64, 32, 75, 0, 0, 16, 11},
        {"paged 32, window 20", 32, 32, 120, 20, 0, 32, 0},
        {"paged 48", 96, 32, 100, 0, 0, 48, 0},
    };
    for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++)
        run_config(&cfgs[i], 1000 + i);
    return test_finish();
}
