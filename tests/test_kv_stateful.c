/* SPDX-License-Identifier: MIT */
/* test_kv_stateful.c: a stateful differential test of the KV cache through the public API only.
 *
 * Each case builds several caches of one configuration (dtype f32, f16, bf16, q8_0 or fp8;
 * plain, window ring or chunk ring; g 2, h 4, d_k 32 or 64) that differ only in storage:
 * contiguous, paged with blocks of 16, 17 and 64 slots (the default pool), and paged with blocks
 * of 16 and 17 from a TIGHT pool (appends and accepts then run out of blocks). One random
 * sequence of ~300 operations is applied to every cache: appends of 1..5 tokens to random subsets
 * of the 4 sequences, copy, share_prefix, truncate, reset, drafts appended then accept,
 * compact, reset of every sequence, and mha_kv_cache_attention (1..3 query tokens, chain or draft
 * tree, soft-cap and sinks sometimes) with 1 and 2 threads; some operations are invalid on
 * purpose (too long, beyond a ring's roll-back limit, bad draft indices).
 *
 * Every cache has its own model written from the documented contract (mha.h, docs/INFERENCE.md
 * "Paged cache", docs/SEMANTICS.md): per sequence the length and, per slot (position p lives in
 * slot p mod slots), the position it holds and its K/V rows rounded as the dtype rounds (a fresh
 * one-position cache's read-back), and for a paged cache an abstract block table with reference
 * counts (blocks taken when first written, shared by copy / share_prefix, copied on write,
 * released by reset / truncate). After every operation, for every cache:
 *   - the status is the model's: OK, or INVALID_ARG exactly when the contract refuses, or
 *     NO_MEMORY (paged only) exactly when the free blocks are fewer than the documented need;
 *   - lengths and free_blocks are the model's (free_blocks = pool size once every sequence is
 *     reset); a refused call changed nothing (the model did not move, the cache must not have);
 *   - mha_kv_cache_read of every position below each length succeeds exactly for the positions
 *     the ring still holds, and returns the model's values bit for bit;
 *   - attention outputs and lse are bit-identical for 1 and 2 threads, bit-identical across every
 *     cache of the case whose model is in the same state (paged == contiguous, compaction changes
 *     no result), and within float32 tolerance of a float64 oracle over the model's values.
 * A cache refused with NO_MEMORY while others went on leaves their common state; it is still
 * checked against its own model, and joins the bit-identity comparisons again when its model
 * equals the first cache's (after a reset of every sequence at the latest).
 *
 * Deterministic: seed MHA_KV_STATEFUL_SEED (default below), MHA_KV_STATEFUL_OPS operations per
 * case, MHA_KV_STATEFUL_CASE to run one case. On the first failure of a case the test prints the
 * case, the seed and the operations so far (replay: the same seed and case, fewer ops).
 * 600 operations per case; MHA_TEST_QUICK=1: 200.
 * q8_0 cases add a contiguous and a tight paged-16 cache in the order those storages do not take
 * by themselves (mha_experimental_kv_cache_create_q8_order: ggml's rows where the interleaved
 * order's kernel runs, else the interleaved order), so that both orders run on every tier. Bits
 * are compared between caches of the same order only (the same kernel); every cache is checked
 * against the float64 oracle.
 */
#include "harness.h"
#include "mha_experimental.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum {
    NSEQ = 4,
    MAXSEQ = 200,
    G = 2,
    H = 4,
    TSTEP = 8, /* max_step_tokens */
    MAXD = 64,
    MAXE = 16, /* table entries per sequence: ceil(200 / 16) = 13 */
    MAXPOOL = 64,
    MAXCACHES = 8,
    MAXOPS = 2000
};

typedef struct model {
    int64_t slots, bs, nbs, nblocks;
    int paged;
    int64_t len[NSEQ];
    int64_t owner[NSEQ][MAXSEQ]; /* position held by each slot, -1 none */
    float *k, *v;                /* [NSEQ][MAXSEQ slots][G * d] */
    int64_t tab[NSEQ][MAXE];     /* abstract block ids, -1 none */
    int64_t ref[MAXPOOL];
} model;

typedef struct ent {
    mha_kv_cache *c;
    model m;
    int64_t bs, nblocks;
    char name[32];
} ent;

typedef struct tcase {
    mha_dtype dt;
    int64_t dk, dv, window, chunk;
} tcase;

static int64_t g_dk, g_dv, g_window, g_chunk;

/* ------------------------------------------------------------------------------------------- */
/* The model                                                                                   */

static int64_t first_key(int64_t pos) {
    int64_t lo = 0;
    if (g_window > 0)
        lo = pos - g_window + 1 > 0 ? pos - g_window + 1 : 0;
    if (g_chunk > 0)
        lo = pos - pos % g_chunk;
    return lo;
}
static int ring(void) {
    return g_window > 0 || g_chunk > 0;
}
static int stored(const model *m, int64_t s, int64_t p) {
    return p >= 0 && p < m->len[s] && m->owner[s][p % m->slots] == p;
}
/* The keys the token at position p needs, [first_key(p), p), are all held. */
static int needs_held(const model *m, int64_t s, int64_t p) {
    if (!ring())
        return 1;
    for (int64_t j = first_key(p); j < p; j++)
        if (!stored(m, s, j))
            return 0;
    return 1;
}
static float *krow(const model *m, int64_t s, int64_t slot) {
    return m->k + ((size_t)s * MAXSEQ + (size_t)slot) * (size_t)(G * g_dk);
}
static float *vrow(const model *m, int64_t s, int64_t slot) {
    return m->v + ((size_t)s * MAXSEQ + (size_t)slot) * (size_t)(G * g_dv);
}
static int64_t free_count(const model *m) {
    int64_t n = 0;
    for (int64_t b = 0; b < m->nblocks; b++)
        n += m->ref[b] == 0;
    return n;
}
static void release(model *m, int64_t s, int64_t e) {
    if (m->tab[s][e] >= 0)
        m->ref[m->tab[s][e]]--;
    m->tab[s][e] = -1;
}
/* Entry e of sequence s made private (a new block, or a copy of a shared one). */
static void writable(model *m, int64_t s, int64_t e) {
    if (!m->paged || (m->tab[s][e] >= 0 && m->ref[m->tab[s][e]] == 1))
        return;
    int64_t b = 0;
    while (b < m->nblocks && m->ref[b] != 0)
        b++;
    if (b == m->nblocks) { /* cannot happen after a correct pool check */
        CHECK(0, "model: no free block");
        return;
    }
    release(m, s, e);
    m->ref[b] = 1;
    m->tab[s][e] = b;
}
/* Length of s becomes n: paged blocks holding no position below n are released (entries past
 * ceil(n / bs) when n < slots). */
static void set_len(model *m, int64_t s, int64_t n) {
    m->len[s] = n;
    if (m->paged && n < m->slots)
        for (int64_t e = (n + m->bs - 1) / m->bs; e < m->nbs; e++)
            release(m, s, e);
}
/* Blocks an append of t tokens to s needs: the distinct entries its slots reach that have no
 * block or a shared one. */
static int64_t append_need(const model *m, int64_t s, int64_t t) {
    int seen[MAXE] = {0};
    int64_t need = 0;
    for (int64_t i = 0; i < t; i++) {
        const int64_t e = (m->len[s] + i) % m->slots / m->bs;
        if (seen[e])
            continue;
        seen[e] = 1;
        need += m->tab[s][e] < 0 || m->ref[m->tab[s][e]] > 1;
    }
    return need;
}
static void copy_seq(model *m, int64_t src, int64_t dst) {
    if (src == dst)
        return;
    m->len[dst] = m->len[src];
    memcpy(m->owner[dst], m->owner[src], sizeof m->owner[dst]);
    memcpy(krow(m, dst, 0), krow(m, src, 0), sizeof(float) * (size_t)(MAXSEQ * G * g_dk));
    memcpy(vrow(m, dst, 0), vrow(m, src, 0), sizeof(float) * (size_t)(MAXSEQ * G * g_dv));
    if (m->paged)
        for (int64_t e = 0; e < m->nbs; e++) {
            if (m->tab[src][e] >= 0)
                m->ref[m->tab[src][e]]++;
            release(m, dst, e);
            m->tab[dst][e] = m->tab[src][e];
        }
}
/* Two models hold the same values at the same positions (their caches must then agree). */
static int same_state(const model *a, const model *b, int64_t s) {
    if (a->len[s] != b->len[s])
        return 0;
    for (int64_t p = 0; p < a->len[s]; p++) {
        const int sa = stored(a, s, p);
        if (sa != stored(b, s, p))
            return 0;
        if (sa && (memcmp(krow(a, s, p % a->slots), krow(b, s, p % b->slots),
                          sizeof(float) * (size_t)(G * g_dk)) ||
                   memcmp(vrow(a, s, p % a->slots), vrow(b, s, p % b->slots),
                          sizeof(float) * (size_t)(G * g_dv))))
            return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------------------------------- */
/* Operations                                                                                  */

typedef enum op_kind {
    OP_APPEND,
    OP_COPY,
    OP_SHARE,
    OP_TRUNCATE,
    OP_RESET,
    OP_DRAFTS, /* an append of drafts to one sequence (then OP_ACCEPT) */
    OP_ACCEPT,
    OP_COMPACT,
    OP_RESET_ALL,
    OP_ATTN
} op_kind;

typedef struct op {
    op_kind kind;
    int64_t ns, seqs[NSEQ], t; /* append / attention */
    int64_t a, b, n;           /* src, dst, len / seq, len / seq, base_len, n */
    int64_t idx[TSTEP + 2];
    int tree, softcap, sinks;
    uint64_t data_seed;
} op;

static void print_op(const op *o, int i) {
    char buf[256];
    int k = 0;
    switch (o->kind) {
    case OP_APPEND:
    case OP_DRAFTS:
    case OP_ATTN:
        k += snprintf(buf + k, sizeof buf - (size_t)k, "%s t=%lld seqs={",
                      o->kind == OP_APPEND   ? "append"
                      : o->kind == OP_DRAFTS ? "drafts"
                                             : "attention",
                      (long long)o->t);
        for (int64_t i2 = 0; i2 < o->ns; i2++)
            k += snprintf(buf + k, sizeof buf - (size_t)k, "%s%lld", i2 ? "," : "",
                          (long long)o->seqs[i2]);
        k += snprintf(buf + k, sizeof buf - (size_t)k, "}");
        if (o->kind == OP_ATTN)
            k += snprintf(buf + k, sizeof buf - (size_t)k, " tree=%d softcap=%d sinks=%d", o->tree,
                          o->softcap, o->sinks);
        break;
    case OP_COPY:
        k += snprintf(buf, sizeof buf, "copy src=%lld dst=%lld", (long long)o->a, (long long)o->b);
        break;
    case OP_SHARE:
        k += snprintf(buf, sizeof buf, "share_prefix src=%lld dst=%lld len=%lld", (long long)o->a,
                      (long long)o->b, (long long)o->n);
        break;
    case OP_TRUNCATE:
        k += snprintf(buf, sizeof buf, "truncate seq=%lld len=%lld", (long long)o->a,
                      (long long)o->n);
        break;
    case OP_RESET:
        k += snprintf(buf, sizeof buf, "reset seq=%lld", (long long)o->a);
        break;
    case OP_ACCEPT:
        k += snprintf(buf, sizeof buf, "accept seq=%lld base_len=%lld n=%lld idx={",
                      (long long)o->a, (long long)o->b, (long long)o->n);
        for (int64_t i2 = 0; i2 < o->n; i2++)
            k += snprintf(buf + k, sizeof buf - (size_t)k, "%s%lld", i2 ? "," : "",
                          (long long)o->idx[i2]);
        k += snprintf(buf + k, sizeof buf - (size_t)k, "}");
        break;
    case OP_COMPACT:
        k += snprintf(buf, sizeof buf, "compact");
        break;
    case OP_RESET_ALL:
        k += snprintf(buf, sizeof buf, "reset every sequence");
        break;
    }
    (void)k;
    printf("    op %3d: %s\n", i, buf);
}

static int64_t pick(test_rng *r, int64_t n) { /* [0, n) */
    return (int64_t)(test_rng_uniform(r) * (double)n);
}

/* A random operation for the state of model m (the first cache's). */
static op gen_op(test_rng *r, const model *m, const op *prev) {
    op o;
    memset(&o, 0, sizeof o);
    o.data_seed = test_rng_u64(r);
    if (prev && prev->kind == OP_DRAFTS && test_rng_uniform(r) < 0.9) {
        /* keep a path of the drafts just appended: base_len = the length before them */
        o.kind = OP_ACCEPT;
        o.a = prev->seqs[0];
        const int64_t L = m->len[o.a], nd = prev->t;
        o.b = L - nd;
        if (o.b < 0 || test_rng_uniform(r) < 0.1) /* the drafts were refused, or a stranger base */
            o.b = L > 0 ? pick(r, L + 1) : 0;
        const int64_t room = L - o.b;
        int64_t n = 0;
        for (int64_t i = 0; i < room && n < TSTEP; i++)
            if (test_rng_uniform(r) < 0.5)
                o.idx[n++] = i;
        o.n = n;
        if (n > 0 && test_rng_uniform(r) < 0.05)
            o.idx[n - 1] = room; /* out of range */
        return o;
    }
    const double u = test_rng_uniform(r);
    if (u < 0.33) {
        o.kind = OP_APPEND;
        o.t = 1 + pick(r, 5);
        if (ring() && test_rng_uniform(r) < 0.02)
            o.t = TSTEP + 1; /* refused by a ring */
    } else if (u < 0.48) {
        o.kind = OP_ATTN;
        o.t = 1 + pick(r, 3);
        o.tree = o.t > 1 && test_rng_uniform(r) < 0.3;
        o.softcap = test_rng_uniform(r) < 0.25;
        o.sinks = test_rng_uniform(r) < 0.25;
        if (o.tree)
            for (int64_t i = 0; i < o.t; i++)
                o.idx[i] = pick(r, i + 1) - 1; /* parent in [-1, i) */
    } else if (u < 0.58) {
        o.kind = OP_TRUNCATE;
        o.a = pick(r, NSEQ);
        const int64_t L = m->len[o.a];
        o.n = test_rng_uniform(r) < 0.6 ? L - pick(r, TSTEP + 2) : pick(r, L + 2);
        if (o.n < 0)
            o.n = 0;
    } else if (u < 0.64) {
        o.kind = OP_COPY;
        o.a = pick(r, NSEQ);
        o.b = pick(r, NSEQ);
    } else if (u < 0.72) {
        o.kind = OP_SHARE;
        o.a = pick(r, NSEQ);
        o.b = pick(r, NSEQ);
        const int64_t L = m->len[o.a];
        o.n = test_rng_uniform(r) < 0.5 ? L - pick(r, TSTEP + 2) : pick(r, L + 2);
        if (o.n < 0)
            o.n = 0;
    } else if (u < 0.77) {
        o.kind = OP_RESET;
        o.a = pick(r, NSEQ);
    } else if (u < 0.90) {
        o.kind = OP_DRAFTS;
        o.t = 1 + pick(r, TSTEP);
        o.ns = 1;
        o.seqs[0] = pick(r, NSEQ);
        return o;
    } else if (u < 0.96) {
        o.kind = OP_COMPACT;
        return o;
    } else if (u < 0.975) {
        o.kind = OP_RESET_ALL;
        return o;
    } else {
        /* an accept of a random sequence's tail */
        o.kind = OP_ACCEPT;
        o.a = pick(r, NSEQ);
        const int64_t L = m->len[o.a];
        o.b = L - pick(r, TSTEP + 1);
        if (o.b < 0)
            o.b = 0;
        int64_t n = 0;
        for (int64_t i = 0; i < L - o.b && n < TSTEP; i++)
            if (test_rng_uniform(r) < 0.4)
                o.idx[n++] = i;
        o.n = n;
        return o;
    }
    if (o.kind == OP_APPEND || o.kind == OP_ATTN) {
        /* a random nonempty subset, in random order */
        int64_t perm[NSEQ] = {0, 1, 2, 3};
        for (int64_t i = NSEQ - 1; i > 0; i--) {
            const int64_t j = pick(r, i + 1), x = perm[i];
            perm[i] = perm[j];
            perm[j] = x;
        }
        o.ns = 1 + pick(r, NSEQ);
        for (int64_t i = 0; i < o.ns; i++)
            o.seqs[i] = perm[i];
    }
    return o;
}

/* ------------------------------------------------------------------------------------------- */
/* Applying an operation to one cache and its model                                            */

/* The values of an append: k [ns, t, G, dk], v likewise (float32), and their rounded copies. */
typedef struct data {
    float *k, *v, *kr, *vr;
} data;

static mha_kv_cache *g_rounder; /* contiguous, max_seq 1: the dtype's rounding of one row */

static void make_data(const op *o, data *d) {
    test_rng r;
    test_rng_seed(&r, o->data_seed);
    const int64_t nk = o->ns * o->t * G * g_dk, nv = o->ns * o->t * G * g_dv;
    const float sd = test_rng_uniform(&r) < 0.1 ? 40.0f : 1.0f;
    test_fill_normal(&r, d->k, nk, sd);
    test_fill_normal(&r, d->v, nv, sd);
    if (test_rng_uniform(&r) < 0.05) /* a block of zeros (q8_0: a zero scale) */
        memset(d->k, 0, sizeof(float) * (size_t)(g_dk < nk ? g_dk : nk));
    mha_error err;
    for (int64_t i = 0; i < o->ns * o->t; i++) {
        mha_status st = mha_kv_cache_append(g_rounder, 1, NULL, 1, d->k + i * G * g_dk,
                                            d->v + i * G * g_dv, &err);
        if (!st)
            st = mha_kv_cache_read(g_rounder, 0, 0, d->kr + i * G * g_dk, d->vr + i * G * g_dv,
                                   &err);
        CHECK(st == MHA_STATUS_OK, "rounder: %s", err.message);
        mha_kv_cache_reset(g_rounder, 0, &err);
    }
}

/* The status the contract gives op o on model m (a paged model also checks the pool). */
static mha_status predict(const model *m, const op *o) {
    switch (o->kind) {
    case OP_APPEND:
    case OP_DRAFTS: {
        if (ring() && o->t > TSTEP)
            return MHA_STATUS_INVALID_ARG;
        int64_t need = 0;
        for (int64_t i = 0; i < o->ns; i++) {
            if (m->len[o->seqs[i]] + o->t > MAXSEQ)
                return MHA_STATUS_INVALID_ARG;
            if (m->paged)
                need += append_need(m, o->seqs[i], o->t);
        }
        return m->paged && need > free_count(m) ? MHA_STATUS_NO_MEMORY : MHA_STATUS_OK;
    }
    case OP_COPY:
    case OP_RESET:
    case OP_COMPACT:
    case OP_RESET_ALL:
        return MHA_STATUS_OK;
    case OP_SHARE:
    case OP_TRUNCATE:
        if (o->n < 0 || o->n > m->len[o->a] || !needs_held(m, o->a, o->n))
            return MHA_STATUS_INVALID_ARG;
        return MHA_STATUS_OK;
    case OP_ACCEPT: {
        const int64_t s = o->a, L = m->len[s], base = o->b;
        if (base < 0 || base > L || o->n < 0 || o->n > L - base || !needs_held(m, s, base))
            return MHA_STATUS_INVALID_ARG;
        for (int64_t k = 0; k < o->n; k++)
            if (o->idx[k] < (k ? o->idx[k - 1] + 1 : 0) || o->idx[k] >= L - base)
                return MHA_STATUS_INVALID_ARG;
        /* the drafts base .. L-1 must all be held (a ring may have dropped them when base = 0) */
        for (int64_t p = base; o->n > 0 && p < L; p++)
            if (!stored(m, s, p))
                return MHA_STATUS_INVALID_ARG;
        if (m->paged) {
            int seen[MAXE] = {0};
            int64_t need = 0;
            for (int64_t k = 0; k < o->n; k++) {
                const int64_t to = base + k, e = to % m->slots / m->bs;
                if (o->idx[k] == k || seen[e])
                    continue;
                seen[e] = 1;
                need += m->tab[s][e] < 0 || m->ref[m->tab[s][e]] > 1;
            }
            if (need > free_count(m))
                return MHA_STATUS_NO_MEMORY;
        }
        return MHA_STATUS_OK;
    }
    case OP_ATTN:
        for (int64_t i = 0; i < o->ns; i++) {
            const int64_t s = o->seqs[i], L = m->len[s];
            if (o->t > L)
                return MHA_STATUS_INVALID_ARG;
            /* the ring holds every key the first query sees */
            const int64_t p0 = L - o->t;
            for (int64_t j = first_key(p0); j < L; j++)
                if (!stored(m, s, j))
                    return MHA_STATUS_INVALID_ARG;
        }
        return MHA_STATUS_OK;
    }
    return MHA_STATUS_OK;
}

/* Updates model m for op o (predicted OK). */
static void apply_model(model *m, const op *o, const data *d) {
    switch (o->kind) {
    case OP_APPEND:
    case OP_DRAFTS:
        for (int64_t i = 0; i < o->ns; i++) {
            const int64_t s = o->seqs[i];
            for (int64_t tok = 0; tok < o->t; tok++) {
                const int64_t p = m->len[s] + tok, slot = p % m->slots;
                writable(m, s, slot / m->bs);
                m->owner[s][slot] = p;
                memcpy(krow(m, s, slot), d->kr + (i * o->t + tok) * G * g_dk,
                       sizeof(float) * (size_t)(G * g_dk));
                memcpy(vrow(m, s, slot), d->vr + (i * o->t + tok) * G * g_dv,
                       sizeof(float) * (size_t)(G * g_dv));
            }
            m->len[s] += o->t;
        }
        break;
    case OP_COPY:
        copy_seq(m, o->a, o->b);
        break;
    case OP_SHARE:
        copy_seq(m, o->a, o->b);
        set_len(m, o->b, o->n);
        break;
    case OP_TRUNCATE:
        set_len(m, o->a, o->n);
        break;
    case OP_RESET:
        set_len(m, o->a, 0);
        break;
    case OP_RESET_ALL:
        for (int64_t s = 0; s < NSEQ; s++)
            set_len(m, s, 0);
        break;
    case OP_ACCEPT: {
        const int64_t s = o->a;
        for (int64_t k = 0; k < o->n; k++) {
            const int64_t from = o->b + o->idx[k], to = o->b + k;
            if (from == to)
                continue;
            const int64_t fs = from % m->slots, ts = to % m->slots;
            writable(m, s, ts / m->bs);
            memcpy(krow(m, s, ts), krow(m, s, fs), sizeof(float) * (size_t)(G * g_dk));
            memcpy(vrow(m, s, ts), vrow(m, s, fs), sizeof(float) * (size_t)(G * g_dv));
            m->owner[s][ts] = to;
        }
        set_len(m, s, o->b + o->n);
        break;
    }
    case OP_COMPACT:
    case OP_ATTN:
        break;
    }
}

static mha_status apply_cache(mha_kv_cache *c, const op *o, const data *d, mha_error *err) {
    switch (o->kind) {
    case OP_APPEND:
    case OP_DRAFTS:
        return mha_kv_cache_append(c, o->ns, o->seqs, o->t, d->k, d->v, err);
    case OP_COPY:
        return mha_kv_cache_copy(c, o->a, o->b, err);
    case OP_SHARE:
        return mha_kv_cache_share_prefix(c, o->a, o->b, o->n, err);
    case OP_TRUNCATE:
        return mha_kv_cache_truncate(c, o->a, o->n, err);
    case OP_RESET:
        return mha_kv_cache_reset(c, o->a, err);
    case OP_RESET_ALL:
        for (int64_t s = 0; s < NSEQ; s++) {
            mha_status st = mha_kv_cache_reset(c, s, err);
            if (st)
                return st;
        }
        return MHA_STATUS_OK;
    case OP_ACCEPT:
        return mha_kv_cache_accept(c, o->a, o->b, o->n, o->idx, err);
    case OP_COMPACT:
        return mha_kv_cache_compact(c, err);
    case OP_ATTN:
        break;
    }
    return MHA_STATUS_OK;
}

/* ------------------------------------------------------------------------------------------- */
/* Attention                                                                                   */

/* Float64 attention of op o over model m: out [ns, t, H, dv], lse [ns, H, t]. */
static void oracle(const model *m,
                   const op *o,
                   const float *q,
                   const float *sinks,
                   double softcap,
                   double *out,
                   double *lse) {
    const int64_t t = o->t, hg = H / G;
    const double scale = 1.0 / sqrt((double)g_dk);
    double sc[MAXSEQ + 8];
    for (int64_t i = 0; i < o->ns; i++) {
        const int64_t s = o->seqs[i], L = m->len[s], base = L - t;
        for (int64_t r = 0; r < t; r++) {
            /* the row's position and the drafts it sees (a chain: r = depth, every earlier) */
            int64_t depth = 0, anc[8] = {0};
            if (o->tree) {
                for (int64_t a = r; a >= 0; a = o->idx[a])
                    anc[a] = 1, depth += a != r;
            } else {
                for (int64_t a = 0; a <= r; a++)
                    anc[a] = 1;
                depth = r;
            }
            const int64_t pos = base + depth;
            for (int64_t h = 0; h < H; h++) {
                const int64_t gk = h / hg;
                const float *qr = q + ((i * t + r) * H + h) * g_dk;
                double mx = -HUGE_VAL;
                int64_t nk = 0;
                for (int64_t j = 0; j < L; j++) {
                    int64_t kp; /* the key's position */
                    if (j < base) {
                        kp = j;
                    } else {
                        const int64_t a = j - base;
                        if (!anc[a]) {
                            sc[j] = -HUGE_VAL;
                            continue;
                        }
                        int64_t da = 0;
                        if (o->tree)
                            for (int64_t x = o->idx[a]; x >= 0; x = o->idx[x])
                                da++;
                        else
                            da = a;
                        kp = base + da;
                    }
                    if (kp > pos || kp < first_key(pos)) {
                        sc[j] = -HUGE_VAL;
                        continue;
                    }
                    const float *kr = krow(m, s, j % m->slots) + gk * g_dk;
                    double dot = 0;
                    for (int64_t x = 0; x < g_dk; x++)
                        dot += (double)qr[x] * (double)kr[x];
                    dot *= scale;
                    if (softcap > 0)
                        dot = softcap * tanh(dot / softcap);
                    sc[j] = dot;
                    if (dot > mx)
                        mx = dot;
                    nk++;
                }
                if (sinks && (double)sinks[h] > mx)
                    mx = (double)sinks[h];
                double sum = sinks ? exp((double)sinks[h] - mx) : 0.0;
                for (int64_t j = 0; j < L; j++)
                    if (sc[j] > -HUGE_VAL)
                        sum += exp(sc[j] - mx);
                double *orow = out + ((i * t + r) * H + h) * g_dv;
                for (int64_t x = 0; x < g_dv; x++)
                    orow[x] = 0;
                for (int64_t j = 0; j < L; j++)
                    if (sc[j] > -HUGE_VAL) {
                        const double p = exp(sc[j] - mx) / sum;
                        const float *vr = vrow(m, s, j % m->slots) + gk * g_dv;
                        for (int64_t x = 0; x < g_dv; x++)
                            orow[x] += p * (double)vr[x];
                    }
                lse[(i * H + h) * t + r] = nk ? mx + log(sum) : -HUGE_VAL;
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------- */
/* One case                                                                                    */

static int g_case_failed;
static int64_t g_nchecks;

#define EXPECT(cond, ...)                                                                          \
    do {                                                                                           \
        g_nchecks++;                                                                               \
        if (!(cond)) {                                                                             \
            if (!g_case_failed)                                                                    \
                CHECK(0, __VA_ARGS__);                                                             \
            g_case_failed++;                                                                       \
        }                                                                                          \
    } while (0)

/* Every invariant of cache e against its model. */
static void check_state(ent *e, int opi, float *kb, float *vb) {
    const model *m = &e->m;
    mha_error err;
    for (int64_t s = 0; s < NSEQ; s++)
        EXPECT(mha_kv_cache_length(e->c, s) == m->len[s],
               "op %d, %s: length of seq %lld is %lld, model %lld", opi, e->name, (long long)s,
               (long long)mha_kv_cache_length(e->c, s), (long long)m->len[s]);
    const int64_t fb = mha_kv_cache_free_blocks(e->c);
    EXPECT(fb == (m->paged ? free_count(m) : 0), "op %d, %s: free_blocks %lld, model %lld", opi,
           e->name, (long long)fb, (long long)(m->paged ? free_count(m) : 0));
    for (int64_t s = 0; s < NSEQ; s++) {
        const int64_t L = mha_kv_cache_length(e->c, s);
        for (int64_t p = 0; p <= L && p <= m->len[s]; p++) {
            const mha_status st = mha_kv_cache_read(e->c, s, p, kb, vb, &err);
            const int want = stored(m, s, p);
            EXPECT((st == MHA_STATUS_OK) == want,
                   "op %d, %s: read seq %lld pos %lld (length %lld) -> %s, model: %s (%s)", opi,
                   e->name, (long long)s, (long long)p, (long long)m->len[s], mha_status_string(st),
                   want ? "stored" : "not stored", err.message);
            if (st == MHA_STATUS_OK && want) {
                const int64_t slot = p % m->slots;
                const int same =
                    !memcmp(kb, krow(m, s, slot), sizeof(float) * (size_t)(G * g_dk)) &&
                    !memcmp(vb, vrow(m, s, slot), sizeof(float) * (size_t)(G * g_dv));
                EXPECT(same, "op %d, %s: read seq %lld pos %lld differs from the model", opi,
                       e->name, (long long)s, (long long)p);
            }
        }
    }
}

static void attention_op(ent *es, int nc, const op *o, int opi) {
    test_rng r;
    test_rng_seed(&r, o->data_seed);
    const int64_t t = o->t, ns = o->ns;
    const size_t nq = (size_t)(ns * t * H * g_dk), no = (size_t)(ns * t * H * g_dv);
    const size_t nl = (size_t)(ns * H * t);
    float *q = malloc(sizeof(float) * nq), sinks[H];
    float *out = malloc(sizeof(float) * no * 2 * (size_t)nc);
    float *lse = malloc(sizeof(float) * nl * 2 * (size_t)nc);
    double *ro = malloc(sizeof(double) * no), *rl = malloc(sizeof(double) * nl);
    test_fill_normal(&r, q, (int64_t)nq, 1.0f);
    test_fill_normal(&r, sinks, H, 1.0f);
    const double softcap = o->softcap ? 2.0 : 0.0;
    mha_status st0[2] = {MHA_STATUS_OK, MHA_STATUS_OK}; /* per q8_0 order: its first cache's */
    int first[2] = {-1, -1};
    for (int ci = 0; ci < nc; ci++) {
        const int order = mha_experimental_kv_cache_q8x16(es[ci].c) == 1;
        const int ref = first[order];
        if (ref < 0)
            first[order] = ci;
        const mha_status want = predict(&es[ci].m, o);
        for (int th = 0; th < 2; th++) {
            mha_kv_attention_args a;
            memset(&a, 0, sizeof a);
            a.num_seqs = ns;
            a.seq_ids = o->seqs;
            a.num_tokens = t;
            a.num_heads = H;
            a.softcap = softcap;
            a.sinks = o->sinks ? sinks : NULL;
            a.q = q;
            a.out = out + ((size_t)ci * 2 + (size_t)th) * no;
            a.lse = lse + ((size_t)ci * 2 + (size_t)th) * nl;
            a.tree_parents = o->tree ? o->idx : NULL;
            mha_exec ex;
            memset(&ex, 0, sizeof ex);
            ex.n_threads = th + 1;
            mha_error err;
            const mha_status st = mha_kv_cache_attention(es[ci].c, &a, &ex, &err);
            EXPECT(st == want, "op %d, %s: attention (%d threads) -> %s, model %s (%s)", opi,
                   es[ci].name, th + 1, mha_status_string(st), mha_status_string(want),
                   err.message);
            if (ref < 0 && th == 0)
                st0[order] = st;
            if (st != MHA_STATUS_OK || want != MHA_STATUS_OK)
                goto next_cache;
        }
        EXPECT(!memcmp(out + (size_t)ci * 2 * no, out + ((size_t)ci * 2 + 1) * no,
                       sizeof(float) * no) &&
                   !memcmp(lse + (size_t)ci * 2 * nl, lse + ((size_t)ci * 2 + 1) * nl,
                           sizeof(float) * nl),
               "op %d, %s: attention differs between 1 and 2 threads", opi, es[ci].name);
        {
            oracle(&es[ci].m, o, q, o->sinks ? sinks : NULL, softcap, ro, rl);
            double mx = 1e-3, worst = 0, worst_l = 0;
            for (size_t i = 0; i < no; i++)
                mx = fabs(ro[i]) > mx ? fabs(ro[i]) : mx;
            for (size_t i = 0; i < no; i++) {
                const double dd = fabs((double)out[(size_t)ci * 2 * no + i] - ro[i]);
                worst = dd > worst || dd != dd ? dd : worst;
            }
            for (size_t i = 0; i < nl; i++) {
                const double a = (double)lse[(size_t)ci * 2 * nl + i], b = rl[i];
                const double dd = a == b ? 0 : fabs(a - b);
                worst_l = dd > worst_l || dd != dd ? dd : worst_l;
            }
            EXPECT(worst <= 2e-5 * mx && worst_l <= 1e-4,
                   "op %d, %s: attention vs the float64 oracle: out error %.3g (max |out| %.3g), "
                   "lse error %.3g",
                   opi, es[ci].name, worst, mx, worst_l);
        }
        /* bit-identical to the first cache of the same q8_0 order (the same kernel) when the
         * models agree on the attended sequences */
        if (ref >= 0 && st0[order] == MHA_STATUS_OK) {
            int same = 1;
            for (int64_t i = 0; i < ns; i++)
                same &= same_state(&es[ref].m, &es[ci].m, o->seqs[i]);
            if (same)
                EXPECT(!memcmp(out + (size_t)ref * 2 * no, out + (size_t)ci * 2 * no,
                               sizeof(float) * no) &&
                           !memcmp(lse + (size_t)ref * 2 * nl, lse + (size_t)ci * 2 * nl,
                                   sizeof(float) * nl),
                       "op %d, %s: attention differs from %s's (same stored state)", opi,
                       es[ci].name, es[ref].name);
        }
    next_cache:;
    }
    free(q);
    free(out);
    free(lse);
    free(ro);
    free(rl);
}

static const char *dt_name(mha_dtype dt) {
    switch (dt) {
    case MHA_DTYPE_F32:
        return "f32";
    case MHA_DTYPE_F16:
        return "f16";
    case MHA_DTYPE_BF16:
        return "bf16";
    case MHA_DTYPE_Q8_0:
        return "q8_0";
    default:
        return "fp8";
    }
}

static int64_t g_total_ops, g_nomem;

static void run_case(int ci, const tcase *tc, uint64_t base_seed, int nops) {
    const uint64_t seed = base_seed + (uint64_t)ci * 0x9e3779b97f4a7c15ull;
    g_dk = tc->dk;
    g_dv = tc->dv;
    g_window = tc->window;
    g_chunk = tc->chunk;
    g_case_failed = 0;
    mha_error err;
    mha_kv_cache_config kc;
    memset(&kc, 0, sizeof kc);
    kc.num_kv_heads = G;
    kc.head_dim = tc->dk;
    kc.v_head_dim = tc->dv;
    kc.dtype = tc->dt;
    kc.max_seq = 1;
    kc.batch = 1;
    g_rounder = NULL;
    CHECK_OK(mha_kv_cache_create(&kc, NULL, NULL, &g_rounder, &err), &err);
    kc.max_seq = MAXSEQ;
    kc.batch = NSEQ;
    kc.window = tc->window;
    kc.chunk_size = tc->chunk;
    kc.max_step_tokens = TSTEP;

    /* storage variants: contiguous, paged 16 / 17 / 64 (default pool), 16 / 17 tight; q8_0:
     * contiguous and paged 16 tight in the other order too */
    const int64_t slots_ring = tc->window  ? tc->window + TSTEP - 1
                               : tc->chunk ? tc->chunk + TSTEP - 1
                                           : MAXSEQ;
    const int64_t slots = slots_ring < MAXSEQ ? slots_ring : MAXSEQ;
    const int64_t vbs[MAXCACHES] = {0, 16, 17, 64, 16, 17, 0, 16};
    const int variants = tc->dt == MHA_DTYPE_Q8_0 ? 8 : 6;
    int auto_x16 = 0; /* the order the contiguous cache took by itself */
    ent es[MAXCACHES];
    memset(es, 0, sizeof es);
    int nc = 0;
    for (int v = 0; v < variants; v++) {
        const int other = v >= 6;
        ent *e = &es[nc];
        const int64_t bs = vbs[v], nbs = bs ? (slots + bs - 1) / bs : 1;
        int64_t nb = 0;
        if (v >= 4 && bs) /* tight: about 40% of the full pool, at least two sequences' worth */
            nb = NSEQ * nbs * 2 / 5 > 2 * nbs ? NSEQ * nbs * 2 / 5 : 2 * nbs;
        kc.block_size = bs;
        kc.num_blocks = nb;
        e->c = NULL;
        CHECK_OK(other ? mha_experimental_kv_cache_create_q8_order(&kc, NULL, NULL, !auto_x16,
                                                                   &e->c, &err)
                       : mha_kv_cache_create(&kc, NULL, NULL, &e->c, &err),
                 &err);
        if (!e->c)
            continue;
        if (v == 0)
            auto_x16 = mha_experimental_kv_cache_q8x16(e->c) == 1;
        CHECK(mha_kv_cache_slots(e->c) == slots, "slots %lld, expected %lld",
              (long long)mha_kv_cache_slots(e->c), (long long)slots);
        model *m = &e->m;
        m->slots = slots;
        m->paged = bs > 0;
        m->bs = bs ? bs : slots;
        m->nbs = nbs;
        m->nblocks = bs ? mha_kv_cache_get_config(e->c)->num_blocks : 0;
        CHECK(m->nblocks <= MAXPOOL, "pool too large for the model");
        for (int64_t s = 0; s < NSEQ; s++) {
            for (int64_t x = 0; x < MAXSEQ; x++)
                m->owner[s][x] = -1;
            for (int64_t x = 0; x < MAXE; x++)
                m->tab[s][x] = -1;
        }
        m->k = calloc((size_t)(NSEQ * MAXSEQ * G * g_dk), sizeof(float));
        m->v = calloc((size_t)(NSEQ * MAXSEQ * G * g_dv), sizeof(float));
        snprintf(e->name, sizeof e->name, "%s%s%lld%s", bs ? "paged" : "contiguous", bs ? "" : "",
                 (long long)bs, nb ? " tight" : "");
        if (!bs)
            snprintf(e->name, sizeof e->name, "contiguous");
        if (tc->dt == MHA_DTYPE_Q8_0)
            strncat(e->name, mha_experimental_kv_cache_q8x16(e->c) == 1 ? " interleaved" : " rows",
                    sizeof e->name - strlen(e->name) - 1);
        nc++;
    }

    test_rng r;
    test_rng_seed(&r, seed);
    op *log = malloc(sizeof(op) * (size_t)nops);
    data d;
    const size_t mk = (size_t)(NSEQ * TSTEP * 2 * G * MAXD);
    d.k = malloc(sizeof(float) * mk);
    d.v = malloc(sizeof(float) * mk);
    d.kr = malloc(sizeof(float) * mk);
    d.vr = malloc(sizeof(float) * mk);
    float *kb = malloc(sizeof(float) * G * MAXD), *vb = malloc(sizeof(float) * G * MAXD);
    for (int i = 0; i < nc; i++)
        check_state(&es[i], -1, kb, vb);
    int done = 0;
    for (int i = 0; i < nops && !g_case_failed; i++) {
        op *o = &log[i];
        *o = gen_op(&r, &es[0].m, i ? &log[i - 1] : NULL);
        done++;
        if (o->kind == OP_ATTN) {
            attention_op(es, nc, o, i);
        } else {
            if (o->kind == OP_APPEND || o->kind == OP_DRAFTS)
                make_data(o, &d);
            for (int c = 0; c < nc; c++) {
                const mha_status want = predict(&es[c].m, o);
                const mha_status st = apply_cache(es[c].c, o, &d, &err);
                EXPECT(st == want, "op %d, %s: -> %s, model %s (%s)", i, es[c].name,
                       mha_status_string(st), mha_status_string(want), err.message);
                EXPECT(st != MHA_STATUS_NO_MEMORY || es[c].m.paged,
                       "op %d, %s: NO_MEMORY from a contiguous cache", i, es[c].name);
                g_nomem += st == MHA_STATUS_NO_MEMORY;
                if (st == MHA_STATUS_OK && want == MHA_STATUS_OK)
                    apply_model(&es[c].m, o, &d);
            }
        }
        for (int c = 0; c < nc; c++)
            check_state(&es[c], i, kb, vb);
    }
    g_total_ops += done;
    /* the end: every sequence reset, every pool whole again */
    if (!g_case_failed) {
        op o;
        memset(&o, 0, sizeof o);
        o.kind = OP_RESET_ALL;
        for (int c = 0; c < nc; c++) {
            EXPECT(apply_cache(es[c].c, &o, &d, &err) == MHA_STATUS_OK, "final reset: %s",
                   err.message);
            EXPECT(mha_kv_cache_free_blocks(es[c].c) == (es[c].m.paged ? es[c].m.nblocks : 0),
                   "%s: after resetting every sequence free_blocks %lld of %lld", es[c].name,
                   (long long)mha_kv_cache_free_blocks(es[c].c), (long long)es[c].m.nblocks);
        }
    }
    if (g_case_failed) {
        fflush(stdout);
        printf("FAILED case %d (%s, d_k %lld, d_v %lld, window %lld, chunk %lld), seed %llu "
               "(MHA_KV_STATEFUL_CASE=%d MHA_KV_STATEFUL_SEED=%llu MHA_KV_STATEFUL_OPS=%d); "
               "%d failed checks; the operations:\n",
               ci, dt_name(tc->dt), (long long)tc->dk, (long long)tc->dv, (long long)tc->window,
               (long long)tc->chunk, (unsigned long long)seed, ci, (unsigned long long)base_seed,
               done, g_case_failed);
        for (int i = 0; i < done; i++)
            print_op(&log[i], i);
    }
    CHECK(!g_case_failed, "case %d (%s window %lld chunk %lld): %d ops, all invariants", ci,
          dt_name(tc->dt), (long long)tc->window, (long long)tc->chunk, done);
    for (int c = 0; c < nc; c++) {
        mha_kv_cache_destroy(es[c].c);
        free(es[c].m.k);
        free(es[c].m.v);
    }
    mha_kv_cache_destroy(g_rounder);
    free(log);
    free(d.k);
    free(d.v);
    free(d.kr);
    free(d.vr);
    free(kb);
    free(vb);
}

int main(void) {
    const char *se = getenv("MHA_KV_STATEFUL_SEED"), *so = getenv("MHA_KV_STATEFUL_OPS");
    const char *sc = getenv("MHA_KV_STATEFUL_CASE");
    const uint64_t seed = se ? strtoull(se, NULL, 0) : 0x5eed4901u;
    int nops = so ? atoi(so) : test_quick() ? 200 : 600;
    if (nops > MAXOPS)
        nops = MAXOPS;
    const int only = sc ? atoi(sc) : -1;
    const mha_dtype dts[5] = {MHA_DTYPE_F32, MHA_DTYPE_F16, MHA_DTYPE_BF16, MHA_DTYPE_Q8_0,
                              MHA_DTYPE_FP8_E4M3};
    printf("test_kv_stateful: seed %llu, %d operations per case\n", (unsigned long long)seed, nops);
    int ci = 0;
    for (int di = 0; di < 5; di++)
        for (int ri = 0; ri < 3; ri++, ci++) {
            tcase tc;
            tc.dt = dts[di];
            tc.dk = (di + ri) % 2 ? 64 : 32;
            tc.dv = ri == 1 ? 32 : tc.dk;
            tc.window = ri == 1 ? 13 : 0;
            tc.chunk = ri == 2 ? 24 : 0;
            if (only >= 0 && ci != only)
                continue;
            run_case(ci, &tc, seed, nops);
        }
    printf("test_kv_stateful: %lld operations over %d cases, %lld invariant checks, %lld "
           "NO_MEMORY refusals\n",
           (long long)g_total_ops, only >= 0 ? 1 : ci, (long long)g_nchecks, (long long)g_nomem);
    return test_finish();
}
