/* SPDX-License-Identifier: MIT */
/* test_chunk.c: chunked attention (mha_masking.chunk_size, Llama 4's attention_chunk_size;
 * docs/SEMANTICS.md "Chunked attention"). Query i at p = i + delta sees key j only if
 * floor(j / C) == floor(p / C), ANDed with every other rule.
 *   - forward (fast and reference) and lse vs the float64 oracle, and bit for bit equal to the
 *     same mask given as a bool tensor (the block mask treats both alike);
 *   - backward (dq, dk, dv) vs the float64 analytic backward;
 *   - cases: causal + chunk (n = m, n < m bottom-right, top-left), chunk alone, chunk + window,
 *     chunk + key padding, GQA, C = 1, C >= n (= plain causal);
 *   - tile skipping: mha_attention_mask_summary counts the hidden tiles of the chunk band;
 *   - decode through a chunk cache (a ring of C + max_step_tokens - 1 slots) across chunk
 *     boundaries, split-KV kernel and reference, vs the oracle of the full forward;
 *   - hostile: negative chunk sizes refused naming the field, window + chunk cache refused. */
#include "harness.h"
#include "oracle_f64.h"
#include "oracle_grad_f64.h"
#include "tolerance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct ccase {
    const char *name;
    int64_t B, H, G, n, m, d, C;
    int causal;
    mha_alignment align;
    int64_t wl, wr; /* window; both -2 = none */
    int kpad;
} ccase;

typedef struct cbuf {
    float *q, *k, *v, *dout, *out, *lse;
    uint8_t *kp, *bm;
    int64_t offs[4];
} cbuf;

static void args_of(const ccase *c, cbuf *b, mha_attention_args *a) {
    memset(a, 0, sizeof *a);
    a->batch = c->B;
    a->num_heads = c->H;
    a->num_kv_heads = c->G;
    a->q_len = c->n;
    a->kv_len = c->m;
    a->head_dim = c->d;
    a->q = b->q;
    a->k = b->k;
    a->v = b->v;
    a->out = b->out;
    a->lse = b->lse;
    const int64_t qs[3] = {c->H * c->n * c->d, c->n * c->d, c->d};
    const int64_t ks[3] = {c->G * c->m * c->d, c->m * c->d, c->d};
    memcpy(a->q_strides, qs, sizeof qs);
    memcpy(a->out_strides, qs, sizeof qs);
    memcpy(a->k_strides, ks, sizeof ks);
    memcpy(a->v_strides, ks, sizeof ks);
    a->mask.causal = c->causal;
    a->mask.alignment = c->align;
    if (c->align == MHA_ALIGN_EXPLICIT) {
        for (int64_t i = 0; i < c->B && i < 4; i++)
            b->offs[i] = 3 * i - 2; /* negative and positive diagonals */
        a->mask.align_offsets = b->offs;
    }
    a->mask.window_left = a->mask.window_right = -1;
    if (c->wl != -2) {
        a->mask.use_window = 1;
        a->mask.window_left = c->wl;
        a->mask.window_right = c->wr;
    }
    if (c->kpad)
        a->mask.key_padding = (mha_mask_tensor){b->kp, MHA_DTYPE_U8, 2, {c->B, c->m}};
    a->mask.chunk_size = c->C;
}

static double *to_double(const float *x, int64_t n) {
    double *y = malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n; i++)
        y[i] = (double)x[i];
    return y;
}

/* The chunk rule as a bool tensor [B, 1, n, m] (the other rules stay in args). */
static void chunk_as_tensor(const ccase *c, const mha_attention_args *a, uint8_t *bm) {
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t i = 0; i < c->n; i++) {
            const int64_t delta = c->align == MHA_ALIGN_TOP_LEFT   ? 0
                                  : c->align == MHA_ALIGN_EXPLICIT ? a->mask.align_offsets[b]
                                                                   : c->m - c->n;
            const double p = (double)(i + delta);
            for (int64_t j = 0; j < c->m; j++)
                bm[(b * c->n + i) * c->m + j] =
                    floor((double)j / (double)c->C) == floor(p / (double)c->C);
        }
}

static double max_score(const ccase *c, const cbuf *b) {
    double mx = 0.0;
    for (int64_t bb = 0; bb < c->B; bb++)
        for (int64_t h = 0; h < c->H; h++)
            for (int64_t i = 0; i < c->n; i++)
                for (int64_t j = 0; j < c->m; j++) {
                    const float *q = b->q + ((bb * c->H + h) * c->n + i) * c->d;
                    const float *k = b->k + ((bb * c->G + h / (c->H / c->G)) * c->m + j) * c->d;
                    double s = 0.0;
                    for (int64_t e = 0; e < c->d; e++)
                        s += (double)q[e] * (double)k[e];
                    mx = fmax(mx, fabs(s / sqrt((double)c->d)));
                }
    return mx;
}

static void run_case(const ccase *c, uint64_t seed) {
    test_rng r;
    test_rng_seed(&r, seed);
    const int64_t nq = c->B * c->H * c->n * c->d, nk = c->B * c->G * c->m * c->d;
    const int64_t nl = c->B * c->H * c->n;
    cbuf b = {0};
    b.q = malloc(sizeof(float) * (size_t)nq);
    b.k = malloc(sizeof(float) * (size_t)nk);
    b.v = malloc(sizeof(float) * (size_t)nk);
    b.dout = malloc(sizeof(float) * (size_t)nq);
    b.out = malloc(sizeof(float) * (size_t)nq);
    b.lse = malloc(sizeof(float) * (size_t)nl);
    b.kp = malloc((size_t)(c->B * c->m));
    b.bm = malloc((size_t)(c->B * c->n * c->m));
    test_fill_normal(&r, b.q, nq, 1.0f);
    test_fill_normal(&r, b.k, nk, 1.0f);
    test_fill_normal(&r, b.v, nk, 1.0f);
    test_fill_normal(&r, b.dout, nq, 1.0f);
    for (int64_t e = 0; e < c->B * c->m; e++)
        b.kp[e] = test_rng_uniform(&r) < 0.8;
    mha_attention_args a;
    args_of(c, &b, &a);
    mha_error err;

    /* float64 oracle */
    double *ro = malloc(sizeof(double) * (size_t)nq), *rl = malloc(sizeof(double) * (size_t)nl);
    CHECK(oracle_attention(&a, ro, rl, NULL) == 0, "%s: oracle", c->name);
    const double mref = test_max_abs(ro, nq);

    /* forward, fast and reference */
    float *fast = malloc(sizeof(float) * (size_t)nq);
    for (int impl = 0; impl < 2; impl++) {
        mha_exec ex = {0};
        ex.impl = impl ? MHA_IMPL_REFERENCE : MHA_IMPL_AUTO;
        ex.n_threads = 2;
        CHECK_OK(mha_attention(&a, &ex, &err), &err);
        const double e = test_max_abs_diff(b.out, ro, nq);
        CHECK(e <= TOL_OUT_REL * mref + 1e-30, "%s %s: forward err %.3g (max|ref| %.3g)", c->name,
              impl ? "ref" : "fast", e, mref);
        double le = 0.0;
        for (int64_t i = 0; i < nl; i++)
            if (isfinite(rl[i]) || isfinite(b.lse[i]))
                le = fmax(le, fabs((double)b.lse[i] - rl[i]));
        CHECK(le <= TOL_OUT_REL * (1.0 + max_score(c, &b)), "%s %s: lse err %.3g", c->name,
              impl ? "ref" : "fast", le);
        if (!impl)
            memcpy(fast, b.out, sizeof(float) * (size_t)nq);
    }

    /* the same rule as a bool tensor: the same bits on the fast path */
    {
        mha_attention_args t = a;
        chunk_as_tensor(c, &a, b.bm);
        t.mask.chunk_size = 0;
        t.mask.bool_mask = (mha_mask_tensor){b.bm, MHA_DTYPE_U8, 4, {c->B, 1, c->n, c->m}};
        mha_exec ex = {0};
        ex.n_threads = 2;
        CHECK_OK(mha_attention(&t, &ex, &err), &err);
        CHECK(!memcmp(fast, b.out, sizeof(float) * (size_t)nq),
              "%s: chunk rule and the equal bool tensor give the same bits", c->name);
        CHECK_OK(mha_attention(&a, &ex, &err), &err); /* restore out / lse for the backward */
    }

    /* backward vs the float64 analytic backward */
    {
        og_core oc = {0};
        oc.B = c->B, oc.H = c->H, oc.G = c->G, oc.n = c->n, oc.m = c->m, oc.dk = oc.dv = c->d;
        double *q64 = to_double(b.q, nq), *k64 = to_double(b.k, nk), *v64 = to_double(b.v, nk);
        double *do64 = to_double(b.dout, nq);
        oc.q = q64, oc.k = k64, oc.v = v64, oc.mask = a.mask;
        double *gq = calloc((size_t)nq, sizeof(double)), *gk = calloc((size_t)nk, sizeof(double));
        double *gv = calloc((size_t)nk, sizeof(double));
        og_core_backward(&oc, do64, NULL, NULL, gq, gk, gv, NULL);
        float *dq = malloc(sizeof(float) * (size_t)nq), *dk = malloc(sizeof(float) * (size_t)nk);
        float *dv = malloc(sizeof(float) * (size_t)nk);
        mha_attention_grads g = {0};
        g.dout = b.dout;
        memcpy(g.dout_strides, a.out_strides, sizeof g.dout_strides);
        g.dq = dq;
        memcpy(g.dq_strides, a.q_strides, sizeof g.dq_strides);
        g.dk = dk;
        memcpy(g.dk_strides, a.k_strides, sizeof g.dk_strides);
        g.dv = dv;
        memcpy(g.dv_strides, a.v_strides, sizeof g.dv_strides);
        const double smax = max_score(c, &b);
        for (int impl = 0; impl < 2; impl++) {
            mha_exec ex = {0};
            ex.impl = impl ? MHA_IMPL_REFERENCE : MHA_IMPL_AUTO;
            ex.n_threads = 2;
            CHECK_OK(mha_attention_backward(&a, &g, &ex, &err), &err);
            const struct {
                const char *w;
                const float *x;
                const double *ref;
                int64_t n;
            } t[3] = {{"dq", dq, gq, nq}, {"dk", dk, gk, nk}, {"dv", dv, gv, nk}};
            for (int e = 0; e < 3; e++) {
                /* dq, dk are sums of P (dP - D) with dP = dout.v, D = dout.o: their rounding
                 * is relative to |dout| |v| even where they vanish (C = 1: every row sees one
                 * key, P = 1, dq = dk = 0), so the scale is at least max|dv*| */
                const double mg = fmax(test_max_abs(t[e].ref, t[e].n), test_max_abs(gv, nk));
                const double gate =
                    TOL_BWD_C * TOL_U32 * mg * (1.0 + smax) * sqrt((double)c->m) + 1e-30;
                const double d = test_max_abs_diff(t[e].x, t[e].ref, t[e].n);
                CHECK(d <= gate, "%s %s: %s err %.3g (gate %.3g)", c->name, impl ? "ref" : "fast",
                      t[e].w, d, gate);
            }
        }
        free(q64), free(k64), free(v64), free(do64), free(gq), free(gk), free(gv);
        free(dq), free(dk), free(dv);
    }
    free(ro), free(rl), free(fast);
    free(b.q), free(b.k), free(b.v), free(b.dout), free(b.out), free(b.lse), free(b.kp), free(b.bm);
}

/* Causal + chunk at n = m = 512, C = 128: of the 8 x 8 tiles of 64, a chunk holds 2 x 2 tiles,
 * 2 visible-or-mixed rows of them: per chunk 2 mixed (diagonal) + 1 visible, the other 52 hidden
 * (plain causal: 28 hidden). The kernels skip exactly these (mha__rows_class). */
static void tile_counts(void) {
    mha_attention_args a = {0};
    a.batch = 1, a.num_heads = 1, a.q_len = a.kv_len = 512, a.head_dim = 64;
    a.mask.causal = 1;
    a.mask.chunk_size = 128;
    mha_mask_summary s;
    mha_error err;
    CHECK_OK(mha_attention_mask_summary(&a, NULL, &s, &err), &err);
    CHECK(s.tiles_hidden == 52 && s.tiles_visible == 4 && s.tiles_mixed == 8,
          "chunk tiles: hidden %lld visible %lld mixed %lld (want 52 4 8)",
          (long long)s.tiles_hidden, (long long)s.tiles_visible, (long long)s.tiles_mixed);
    a.mask.chunk_size = 0;
    CHECK_OK(mha_attention_mask_summary(&a, NULL, &s, &err), &err);
    CHECK(s.tiles_hidden == 28, "causal tiles hidden %lld (want 28)", (long long)s.tiles_hidden);
}

/* Decode through a chunk cache: tokens appended in steps of `step` (crossing chunk boundaries),
 * each step's attention vs the oracle of the full causal + chunk forward's last rows. */
static void decode_case(int64_t C, int64_t step, int64_t T, mha_impl impl, uint64_t seed) {
    const int64_t H = 4, G = 2, d = 16;
    test_rng r;
    test_rng_seed(&r, seed);
    float *q = malloc(sizeof(float) * (size_t)(T * H * d));
    float *k = malloc(sizeof(float) * (size_t)(T * G * d));
    float *v = malloc(sizeof(float) * (size_t)(T * G * d));
    test_fill_normal(&r, q, T * H * d, 1.0f);
    test_fill_normal(&r, k, T * G * d, 1.0f);
    test_fill_normal(&r, v, T * G * d, 1.0f);
    mha_kv_cache_config cfg = {0};
    cfg.num_kv_heads = G, cfg.head_dim = d, cfg.max_seq = T, cfg.batch = 1;
    cfg.max_step_tokens = step, cfg.chunk_size = C;
    mha_kv_cache *kc = NULL;
    mha_error err;
    CHECK_OK(mha_kv_cache_create(&cfg, NULL, NULL, &kc, &err), &err);
    if (!kc)
        return;
    const int64_t want_slots = C + step - 1 < T ? C + step - 1 : T;
    CHECK(mha_kv_cache_slots(kc) == want_slots, "chunk cache slots %lld (want %lld)",
          (long long)mha_kv_cache_slots(kc), (long long)want_slots);
    /* k, v as [G, T, d] for the oracle; q rows of a step as [1, H, t, d] */
    float *k4 = malloc(sizeof(float) * (size_t)(G * T * d)),
          *v4 = malloc(sizeof(float) * (size_t)(G * T * d));
    for (int64_t j = 0; j < T; j++)
        for (int64_t g = 0; g < G; g++)
            for (int64_t e = 0; e < d; e++) {
                k4[(g * T + j) * d + e] = k[(j * G + g) * d + e];
                v4[(g * T + j) * d + e] = v[(j * G + g) * d + e];
            }
    float *qs = malloc(sizeof(float) * (size_t)(H * step * d));
    float *out = malloc(sizeof(float) * (size_t)(H * step * d));
    double *ro = malloc(sizeof(double) * (size_t)(H * step * d));
    double worst = 0.0;
    int fails = 0;
    for (int64_t L = 0; L < T; L += step) {
        const int64_t t = T - L < step ? T - L : step;
        CHECK_OK(mha_kv_cache_append(kc, 1, NULL, t, k + L * G * d, v + L * G * d, &err), &err);
        mha_kv_attention_args ka = {0};
        ka.num_seqs = 1, ka.num_tokens = t, ka.num_heads = H;
        ka.q = q + L * H * d;
        ka.out = out;
        mha_exec ex = {0};
        ex.impl = impl;
        ex.n_threads = 2;
        CHECK_OK(mha_kv_cache_attention(kc, &ka, &ex, &err), &err);
        /* oracle: rows L .. L+t-1 against keys 0 .. L+t-1, bottom-right, causal + chunk */
        for (int64_t i = 0; i < t; i++)
            for (int64_t h = 0; h < H; h++)
                memcpy(qs + (h * t + i) * d, q + ((L + i) * H + h) * d, sizeof(float) * d);
        mha_attention_args a = {0};
        a.batch = 1, a.num_heads = H, a.num_kv_heads = G, a.q_len = t, a.kv_len = L + t;
        a.head_dim = d;
        a.q = qs, a.k = k4, a.v = v4;
        const int64_t qst[3] = {H * t * d, t * d, d}, kst[3] = {G * T * d, T * d, d};
        memcpy(a.q_strides, qst, sizeof qst);
        memcpy(a.k_strides, kst, sizeof kst);
        memcpy(a.v_strides, kst, sizeof kst);
        a.mask.causal = 1;
        a.mask.chunk_size = C;
        oracle_attention(&a, ro, NULL, NULL);
        double mref = 0.0, e = 0.0;
        for (int64_t i = 0; i < t; i++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t x = 0; x < d; x++) {
                    const double rv = ro[(h * t + i) * d + x];
                    const float o = out[(i * H + h) * d + x];
                    mref = fmax(mref, fabs(rv));
                    e = isnan(o) ? (double)INFINITY : fmax(e, fabs((double)o - rv));
                }
        worst = fmax(worst, e / mref);
        fails += !(e <= TOL_OUT_REL * mref);
    }
    CHECK(fails == 0, "decode C=%lld step=%lld T=%lld %s: %d steps off, worst rel err %.3g",
          (long long)C, (long long)step, (long long)T,
          impl == MHA_IMPL_REFERENCE ? "ref" : "split-KV", fails, worst);
    /* the old chunk is gone from the ring: position 0 no longer readable past slots */
    if (T > want_slots)
        CHECK(mha_kv_cache_read(kc, 0, 0, NULL, NULL, &err) == MHA_STATUS_INVALID_ARG,
              "position 0 evicted from the chunk ring");
    mha_kv_cache_destroy(kc);
    free(q), free(k), free(v), free(k4), free(v4), free(qs), free(out), free(ro);
}

static void hostile(void) {
    float x[64] = {0};
    mha_attention_args a = {0};
    a.batch = a.num_heads = 1, a.q_len = a.kv_len = 4, a.head_dim = 4;
    a.q = a.k = a.v = x;
    a.out = x + 16; /* distinct from the inputs */
    const int64_t s[3] = {16, 16, 4};
    memcpy(a.q_strides, s, sizeof s), memcpy(a.k_strides, s, sizeof s);
    memcpy(a.v_strides, s, sizeof s), memcpy(a.out_strides, s, sizeof s);
    a.mask.chunk_size = -1;
    mha_error err;
    mha_status st = mha_attention(&a, NULL, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "chunk_size"),
          "chunk_size -1 refused naming the field: %s", err.message);
    mha_kv_cache_config cfg = {0};
    cfg.num_kv_heads = 1, cfg.head_dim = 4, cfg.max_seq = 8, cfg.batch = 1, cfg.chunk_size = -3;
    mha_kv_cache *kc = NULL;
    st = mha_kv_cache_create(&cfg, NULL, NULL, &kc, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "chunk_size") && !kc,
          "cache chunk_size -3 refused: %s", err.message);
    /* truncate on a chunk ring: back to 16 of 20 keeps chunk [16, 24) (slots 8 + 2 - 1 = 9 hold
     * positions 11 .. 19); back to 12 would need chunk [8, 16), partly overwritten: refused */
    cfg.chunk_size = 8, cfg.max_step_tokens = 2, cfg.max_seq = 32;
    CHECK_OK(mha_kv_cache_create(&cfg, NULL, NULL, &kc, &err), &err);
    if (kc) {
        for (int i = 0; i < 20; i++)
            CHECK_OK(mha_kv_cache_append(kc, 1, NULL, 1, x, x, &err), &err);
        CHECK_OK(mha_kv_cache_truncate(kc, 0, 16, &err), &err);
        st = mha_kv_cache_truncate(kc, 0, 12, &err);
        CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "chunk-8"),
              "chunk cache truncate into an overwritten chunk refused: %s", err.message);
        CHECK(mha_kv_cache_length(kc, 0) == 16, "length unchanged by the refused truncate");
        mha_kv_cache_destroy(kc);
        kc = NULL;
    }
    cfg.chunk_size = 4, cfg.window = 2;
    st = mha_kv_cache_create(&cfg, NULL, NULL, &kc, &err);
    CHECK(st == MHA_STATUS_UNSUPPORTED && strstr(err.message, "chunk_size") && !kc,
          "cache window + chunk_size refused: %s", err.message);
}

int main(void) {
    const mha_alignment BR = MHA_ALIGN_BOTTOM_RIGHT, TL = MHA_ALIGN_TOP_LEFT;
    const mha_alignment EX = MHA_ALIGN_EXPLICIT;
    /* name, B, H, G, n, m, d, C, causal, align, window, kpad: sizes past a 64-key tile, chunk
     * sizes not multiples of the tiles, so tiles are hidden, visible and mixed */
    const ccase cases[] = {
        {"causal_chunk", 1, 2, 2, 200, 200, 16, 48, 1, BR, -2, -2, 0},
        {"causal_chunk_tile", 1, 1, 1, 300, 300, 32, 64, 1, BR, -2, -2, 0},
        {"causal_chunk_n_lt_m", 2, 2, 1, 70, 230, 16, 40, 1, BR, -2, -2, 0},
        {"causal_chunk_top_left", 1, 2, 2, 150, 100, 8, 33, 1, TL, -2, -2, 0},
        {"causal_chunk_explicit", 2, 1, 1, 90, 100, 8, 17, 1, EX, -2, -2, 0},
        {"chunk_alone", 1, 2, 2, 130, 130, 16, 50, 0, BR, -2, -2, 0},
        {"chunk_window", 1, 2, 2, 160, 160, 16, 64, 1, BR, 20, 0, 0},
        {"chunk_window_both_sides", 1, 1, 1, 100, 120, 8, 30, 0, BR, 10, 5, 0},
        {"chunk_keypad", 2, 2, 2, 140, 140, 16, 45, 1, BR, -2, -2, 1},
        {"chunk_gqa", 1, 8, 2, 100, 100, 16, 32, 1, BR, -2, -2, 0},
        {"chunk_1", 1, 2, 2, 70, 70, 8, 1, 1, BR, -2, -2, 0},
        {"chunk_ge_n", 1, 2, 2, 90, 90, 8, 1000, 1, BR, -2, -2, 0},
        {"chunk_bottom_right_dead", 1, 1, 1, 100, 60, 8, 25, 0, BR, -2, -2, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_case(&cases[i], 100 + i);

    /* C >= n is plain causal, bit for bit */
    {
        const int64_t n = 90, d = 8;
        float *q = malloc(sizeof(float) * n * d * 3), *o1 = malloc(sizeof(float) * n * d);
        float *o2 = malloc(sizeof(float) * n * d);
        test_rng r;
        test_rng_seed(&r, 7);
        test_fill_normal(&r, q, n * d * 3, 1.0f);
        mha_attention_args a = {0};
        a.batch = a.num_heads = 1, a.q_len = a.kv_len = n, a.head_dim = d;
        a.q = q, a.k = q + n * d, a.v = q + 2 * n * d, a.out = o1;
        const int64_t s[3] = {n * d, n * d, d};
        memcpy(a.q_strides, s, sizeof s), memcpy(a.k_strides, s, sizeof s);
        memcpy(a.v_strides, s, sizeof s), memcpy(a.out_strides, s, sizeof s);
        a.mask.causal = 1;
        mha_error err;
        CHECK_OK(mha_attention(&a, NULL, &err), &err);
        a.mask.chunk_size = n;
        a.out = o2;
        CHECK_OK(mha_attention(&a, NULL, &err), &err);
        CHECK(!memcmp(o1, o2, sizeof(float) * n * d), "chunk_size = n equals plain causal");
        free(q), free(o1), free(o2);
    }
    tile_counts();
    decode_case(16, 1, 53, MHA_IMPL_AUTO, 11);
    decode_case(16, 5, 61, MHA_IMPL_AUTO, 12);
    decode_case(16, 5, 61, MHA_IMPL_REFERENCE, 13);
    decode_case(300, 64, 700, MHA_IMPL_AUTO, 14); /* units of 256 keys, two ring wraps */
    decode_case(1, 3, 20, MHA_IMPL_AUTO, 15);
    hostile();
    return test_finish();
}
