/* SPDX-License-Identifier: MIT */
/* test_kv_cache.c: KV-cache decoding (mha.h, "Inference: KV cache").
 *
 * The oracle is the library's own full causal forward (impl=reference) over the whole sequence:
 * decoding through the cache must give the same rows, for every option that makes sense for
 * causal self-attention (GQA/MQA, RoPE styles, partial rotary, ALiBi, sinks, soft-cap, sliding
 * window with a ring buffer), for float32 / float16 / bfloat16 storage, for prefill + steps of 1
 * or several tokens, for sequences of different lengths in one batch, after truncate / reset /
 * copy. Also: exact merge of partial results, clear errors that change nothing, and results
 * bit-identical for 1, 2 and 3 threads.
 */
#include "harness.h"
#include "tolerance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------- */
/* Helpers.                                                                                       */
/* ---------------------------------------------------------------------------------------------- */

typedef struct opts {
    const char *name;
    int64_t q_dim, h, g, dk;
    mha_rope_style rope;
    int64_t rotary_dim;
    int alibi, sinks;
    double softcap;
    int64_t window; /* 0 = none; else cache window W = full-forward window (W-1, -1) */
    int64_t max_step;
    mha_dtype dtype;
} opts;

static mha_layer *make_layer(const opts *o, uint64_t seed) {
    test_rng r;
    test_rng_seed(&r, seed);
    mha_config c = {0};
    c.q_dim = o->q_dim;
    c.num_heads = o->h;
    c.num_kv_heads = o->g;
    c.head_dim = o->dk;
    c.bias_q = c.bias_k = c.bias_v = c.bias_o = 1;
    c.alibi = o->alibi;
    c.softcap = o->softcap;
    c.sinks = o->sinks;
    c.rope.style = o->rope;
    c.rope.rotary_dim = o->rotary_dim;
    const int64_t hd = o->h * o->dk, gd = o->g * o->dk;
    float *buf = malloc(sizeof(float) * (size_t)(2 * hd * o->q_dim + 2 * gd * o->q_dim + 2 * hd +
                                                 2 * gd + o->q_dim + o->h));
    float *p = buf;
    mha_weights w = {0};
    const float sd = 1.0f / sqrtf((float)o->q_dim);
    float *wq = p;
    p += hd * o->q_dim;
    float *wk = p;
    p += gd * o->q_dim;
    float *wv = p;
    p += gd * o->q_dim;
    float *wo = p;
    p += o->q_dim * hd;
    float *bq = p;
    p += hd;
    float *bk = p;
    p += gd;
    float *bv = p;
    p += gd;
    float *bo = p;
    p += o->q_dim;
    float *sk = p;
    test_fill_normal(&r, wq, hd * o->q_dim, 2.0f * sd); /* larger logits: sharper softmax */
    test_fill_normal(&r, wk, gd * o->q_dim, 2.0f * sd);
    test_fill_normal(&r, wv, gd * o->q_dim, sd);
    test_fill_normal(&r, wo, o->q_dim * hd, 1.0f / sqrtf((float)hd));
    test_fill_normal(&r, bq, hd, 0.1f);
    test_fill_normal(&r, bk, gd, 0.1f);
    test_fill_normal(&r, bv, gd, 0.1f);
    test_fill_normal(&r, bo, o->q_dim, 0.1f);
    test_fill_normal(&r, sk, o->h, 1.0f);
    w.w_q = wq, w.w_k = wk, w.w_v = wv, w.w_o = wo;
    w.b_q = bq, w.b_k = bk, w.b_v = bv, w.b_o = bo;
    w.sinks = o->sinks ? sk : NULL;
    mha_layer *L = NULL;
    mha_error err;
    CHECK_OK(mha_layer_create(&c, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err);
    free(buf);
    return L;
}

/* Full causal forward (reference impl) of x [B, n, q_dim] into y [B, n, out_dim]. */
static void
full_forward(const mha_layer *L, const opts *o, int64_t B, int64_t n, const float *x, float *y) {
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.batch = B;
    a.q_len = n;
    a.query = x;
    a.out = y;
    a.mask.causal = 1;
    a.mask.window_left = a.mask.window_right = -1;
    if (o->window > 0) {
        a.mask.use_window = 1;
        a.mask.window_left = o->window - 1;
    }
    mha_exec ex = {0};
    ex.impl = MHA_IMPL_REFERENCE;
    ex.n_threads = 1;
    mha_error err;
    CHECK_OK(mha_layer_forward(L, &a, &ex, &err), &err);
}

static mha_kv_cache *make_cache(const mha_layer *L, const opts *o, int64_t batch, int64_t max_seq) {
    mha_kv_cache_config kc = {0};
    kc.max_seq = max_seq;
    kc.batch = batch;
    kc.dtype = o->dtype;
    kc.window = o->window;
    kc.max_step_tokens = o->max_step;
    mha_kv_cache *c = NULL;
    mha_error err;
    CHECK_OK(mha_kv_cache_create(&kc, L, NULL, &c, &err), &err);
    return c;
}

/* Feeds x [B, n, q_dim] (all B sequences, from their current length) through the cache: first
 * `prefill` tokens in one call, then steps of `step` tokens; y [B, n, out_dim]. */
static void decode_all(const mha_layer *L,
                       mha_kv_cache *c,
                       int64_t B,
                       int64_t n,
                       int64_t prefill,
                       int64_t step,
                       const float *x,
                       float *y,
                       mha_impl impl,
                       int threads) {
    const mha_config *cfg = mha_layer_config(L);
    const int64_t qd = cfg->q_dim, od = cfg->out_dim;
    mha_exec ex = {0};
    ex.impl = impl;
    ex.n_threads = threads;
    float *xs = malloc(sizeof(float) * (size_t)(B * n * qd));
    float *ys = malloc(sizeof(float) * (size_t)(B * n * od));
    for (int64_t t0 = 0; t0 < n;) {
        const int64_t tc = t0 == 0 ? (prefill < n ? prefill : n) : (step < n - t0 ? step : n - t0);
        for (int64_t b = 0; b < B; b++)
            memcpy(xs + b * tc * qd, x + (b * n + t0) * qd, sizeof(float) * (size_t)(tc * qd));
        mha_decode_args a = {0};
        a.num_seqs = B;
        a.num_tokens = tc;
        a.x = xs;
        a.out = ys;
        mha_error err;
        if (t0 == 0)
            CHECK_OK(mha_layer_prefill(L, c, &a, &ex, &err), &err);
        else
            CHECK_OK(mha_layer_decode_step(L, c, &a, &ex, &err), &err);
        for (int64_t b = 0; b < B; b++)
            memcpy(y + (b * n + t0) * od, ys + b * tc * od, sizeof(float) * (size_t)(tc * od));
        t0 += tc;
    }
    free(xs);
    free(ys);
}

static double max_abs_f(const float *a, int64_t n) {
    double m = 0.0;
    for (int64_t i = 0; i < n; i++)
        m = fmax(m, fabs((double)a[i]));
    return m;
}

static double max_diff_f(const float *a, const float *b, int64_t n) {
    double m = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double d = fabs((double)a[i] - (double)b[i]);
        m = isnan(d) ? (double)INFINITY : fmax(m, d);
        if (isinf(m))
            return m;
    }
    return m;
}

static double tol_for(mha_dtype dt) {
    return dt == MHA_DTYPE_F16    ? TOL_KV_F16_REL
           : dt == MHA_DTYPE_BF16 ? TOL_KV_BF16_REL
                                  : TOL_OUT_REL;
}

static const char *dt_name(mha_dtype dt) {
    return dt == MHA_DTYPE_F16 ? "f16" : dt == MHA_DTYPE_BF16 ? "bf16" : "f32";
}

static double g_worst[3]; /* worst error / max|ref| seen per dtype (f32, f16, bf16) */

static void record_worst(mha_dtype dt, double rel) {
    const int i = dt == MHA_DTYPE_F16 ? 1 : dt == MHA_DTYPE_BF16 ? 2 : 0;
    g_worst[i] = fmax(g_worst[i], rel);
}

/* ---------------------------------------------------------------------------------------------- */
/* 1. Decoding equals the full causal forward.                                                    */
/* ---------------------------------------------------------------------------------------------- */

static void test_decode_matches_full(void) {
    static const opts base[] = {
        {"mha", 16, 4, 4, 4, MHA_ROPE_NONE, 0, 0, 0, 0.0, 0, 0, MHA_DTYPE_F32},
        {"gqa+rope", 32, 4, 2, 8, MHA_ROPE_INTERLEAVED, 0, 0, 0, 0.0, 0, 0, MHA_DTYPE_F32},
        {"mqa+half-rope-partial", 32, 4, 1, 8, MHA_ROPE_HALF, 4, 0, 0, 0.0, 0, 0, MHA_DTYPE_F32},
        {"alibi+sinks+softcap", 24, 3, 3, 8, MHA_ROPE_NONE, 0, 1, 1, 5.0, 0, 0, MHA_DTYPE_F32},
        {"window-ring", 32, 4, 2, 8, MHA_ROPE_HALF, 0, 1, 0, 0.0, 5, 3, MHA_DTYPE_F32},
        {"window-wide", 16, 2, 1, 8, MHA_ROPE_INTERLEAVED, 0, 0, 1, 0.0, 7, 0, MHA_DTYPE_F32},
        {"everything", 32, 4, 2, 8, MHA_ROPE_HALF, 6, 1, 1, 3.0, 4, 2, MHA_DTYPE_F32},
        {"d=20 (vector + tail)", 40, 4, 2, 20, MHA_ROPE_INTERLEAVED, 0, 1, 0, 0.0, 0, 0,
         MHA_DTYPE_F32},
        /* d = 64 with <= 4 query rows per kv head and call: the kernel's contiguous path */
        {"d=64 mha", 64, 2, 2, 64, MHA_ROPE_HALF, 0, 1, 1, 3.0, 0, 0, MHA_DTYPE_F32},
        {"d=64 gqa2 window-ring", 64, 4, 2, 64, MHA_ROPE_INTERLEAVED, 0, 0, 0, 0.0, 5, 3,
         MHA_DTYPE_F32},
        {"d=64 gqa4 sinks", 64, 4, 1, 64, MHA_ROPE_NONE, 0, 0, 1, 0.0, 0, 0, MHA_DTYPE_F32},
    };
    static const mha_dtype dts[] = {MHA_DTYPE_F32, MHA_DTYPE_F16, MHA_DTYPE_BF16};
    const int64_t B = 2, n = 23;
    for (size_t ci = 0; ci < sizeof base / sizeof base[0]; ci++)
        for (size_t di = 0; di < 3; di++) {
            opts o = base[ci];
            o.dtype = dts[di];
            mha_layer *L = make_layer(&o, 100 + ci);
            const mha_config *cfg = mha_layer_config(L);
            test_rng r;
            test_rng_seed(&r, 7 + ci);
            float *x = malloc(sizeof(float) * (size_t)(B * n * o.q_dim));
            float *ref = malloc(sizeof(float) * (size_t)(B * n * cfg->out_dim));
            float *y = malloc(sizeof(float) * (size_t)(B * n * cfg->out_dim));
            test_fill_normal(&r, x, B * n * o.q_dim, 1.0f);
            full_forward(L, &o, B, n, x, ref);
            const double scale = max_abs_f(ref, B * n * cfg->out_dim);
            /* prefill, step: 1-token steps, 3-token steps, long prefill through the core */
            static const int64_t plans[][2] = {{1, 1}, {5, 3}, {20, 1}};
            static const mha_impl impls[] = {MHA_IMPL_AUTO, MHA_IMPL_REFERENCE};
            for (size_t pi = 0; pi < 3; pi++)
                for (size_t ii = 0; ii < 2; ii++) {
                    mha_kv_cache *c = make_cache(L, &o, B, 32);
                    for (int64_t k = 0; k < B * n * cfg->out_dim; k++)
                        y[k] = NAN;
                    decode_all(L, c, B, n, plans[pi][0], plans[pi][1], x, y, impls[ii], 2);
                    const double e = max_diff_f(y, ref, B * n * cfg->out_dim);
                    record_worst(o.dtype, e / scale);
                    CHECK(e <= tol_for(o.dtype) * scale,
                          "decode %s %s prefill=%lld step=%lld impl=%d: max err %.3g, max|ref| "
                          "%.3g, rel %.3g > %.3g",
                          o.name, dt_name(o.dtype), (long long)plans[pi][0],
                          (long long)plans[pi][1], (int)impls[ii], e, scale, e / scale,
                          tol_for(o.dtype));
                    CHECK(mha_kv_cache_length(c, 0) == n && mha_kv_cache_length(c, 1) == n,
                          "lengths after decode");
                    mha_kv_cache_destroy(c);
                }
            free(x);
            free(ref);
            free(y);
            mha_layer_destroy(L);
        }
}

/* A dynamic NTK rope is taken at each call's length (docs/MODELS.md): a prefill of the whole
 * sequence equals the full forward (one length, n); 1-token steps past the original length 8
 * rotate each new key at its own step's length, as transformers' cache does, so they differ. */
static void test_decode_dynamic_rope(void) {
    const opts o = {"dynamic", 32, 4, 2, 8, MHA_ROPE_HALF, 0, 0, 0, 0.0, 0, 0, MHA_DTYPE_F32};
    const int64_t B = 2, n = 23;
    mha_layer *plain = make_layer(&o, 99);
    mha_config cfg = *mha_layer_config(plain);
    cfg.rope.scaling = MHA_ROPE_SCALING_DYNAMIC; /* factor 4 over an original length of 8 */
    cfg.rope.factor = 4.0, cfg.rope.original_max_position = 8.0;
    mha_layer *L = NULL;
    mha_error err;
    CHECK_OK(mha_layer_create(&cfg, mha_layer_weights(plain), MHA_WEIGHTS_COPY, NULL, &L, &err),
             &err);
    mha_layer_destroy(plain);
    const int64_t od = cfg.out_dim;
    test_rng r;
    test_rng_seed(&r, 5);
    float *x = malloc(sizeof(float) * (size_t)(B * n * o.q_dim));
    float *ref = malloc(sizeof(float) * (size_t)(B * n * od));
    float *y = malloc(sizeof(float) * (size_t)(B * n * od));
    test_fill_normal(&r, x, B * n * o.q_dim, 1.0f);
    full_forward(L, &o, B, n, x, ref);
    const double scale = max_abs_f(ref, B * n * od);
    for (int steps = 0; steps < 2; steps++) {
        mha_kv_cache *c = make_cache(L, &o, B, 32);
        decode_all(L, c, B, n, steps ? 1 : n, 1, x, y, MHA_IMPL_AUTO, 2);
        const double e = max_diff_f(y, ref, B * n * od) / scale;
        CHECK(steps ? e > 100 * tol_for(o.dtype) : e <= tol_for(o.dtype),
              "dynamic rope decode, %s: relative error %.3g", steps ? "1-token steps" : "prefill",
              e);
        mha_kv_cache_destroy(c);
    }
    free(x);
    free(ref);
    free(y);
    mha_layer_destroy(L);
}

/* ---------------------------------------------------------------------------------------------- */
/* 2. Mixed lengths; truncate, reset, copy.                                                       */
/* ---------------------------------------------------------------------------------------------- */

static void
run_one(const mha_layer *L, mha_kv_cache *c, int64_t seq, int64_t t, const float *x, float *y) {
    mha_decode_args a = {0};
    a.num_seqs = 1;
    a.seq_ids = &seq;
    a.num_tokens = t;
    a.x = x;
    a.out = y;
    mha_error err;
    CHECK_OK(mha_layer_decode_step(L, c, &a, NULL, &err), &err);
}

static void test_mixed_and_edit(void) {
    const opts o = {"mixed", 32, 4, 2, 8, MHA_ROPE_HALF, 0, 1, 1, 0.0, 0, 0, MHA_DTYPE_F32};
    mha_layer *L = make_layer(&o, 42);
    const int64_t qd = 32, od = 32, n0 = 9, n1 = 4, steps = 5;
    test_rng r;
    test_rng_seed(&r, 5);
    /* Two independent token streams. */
    float x0[20 * 32], x1[20 * 32], ref0[20 * 32], ref1[20 * 32], y[2 * 32];
    test_fill_normal(&r, x0, 20 * qd, 1.0f);
    test_fill_normal(&r, x1, 20 * qd, 1.0f);
    full_forward(L, &o, 1, n0 + steps, x0, ref0);
    full_forward(L, &o, 1, n1 + steps, x1, ref1);
    const double s0 = max_abs_f(ref0, (n0 + steps) * od), s1 = max_abs_f(ref1, (n1 + steps) * od);
    mha_kv_cache *c = make_cache(L, &o, 3, 32);
    /* Different prompt lengths, then batched steps: sequence ids {2, 0} in that order. */
    float yp[20 * 32];
    run_one(L, c, 2, n0, x0, yp);
    CHECK(max_diff_f(yp, ref0, n0 * od) <= TOL_OUT_REL * s0, "mixed: prefill of sequence 2");
    run_one(L, c, 0, n1, x1, yp);
    CHECK(max_diff_f(yp, ref1, n1 * od) <= TOL_OUT_REL * s1, "mixed: prefill of sequence 0");
    CHECK(mha_kv_cache_length(c, 1) == 0, "untouched sequence 1 stays empty");
    for (int64_t k = 0; k < steps; k++) {
        float xs[2 * 32];
        memcpy(xs, x0 + (n0 + k) * qd, sizeof(float) * (size_t)qd);
        memcpy(xs + qd, x1 + (n1 + k) * qd, sizeof(float) * (size_t)qd);
        const int64_t ids[2] = {2, 0};
        mha_decode_args a = {0};
        a.num_seqs = 2;
        a.seq_ids = ids;
        a.num_tokens = 1;
        a.x = xs;
        a.out = y;
        mha_error err;
        CHECK_OK(mha_layer_decode_step(L, c, &a, NULL, &err), &err);
        CHECK(max_diff_f(y, ref0 + (n0 + k) * od, od) <= TOL_OUT_REL * s0,
              "mixed lengths: step %lld of sequence 2 (len %lld)", (long long)k,
              (long long)(n0 + k));
        CHECK(max_diff_f(y + od, ref1 + (n1 + k) * od, od) <= TOL_OUT_REL * s1,
              "mixed lengths: step %lld of sequence 0 (len %lld)", (long long)k,
              (long long)(n1 + k));
    }

    /* Truncate: roll sequence 2 back to n0 + 2, then feed stream 1's tokens as the continuation;
     * reference: the full forward of x0[0 : n0+2] ++ x1[..]. */
    mha_error err;
    CHECK_OK(mha_kv_cache_truncate(c, 2, n0 + 2, &err), &err);
    CHECK(mha_kv_cache_length(c, 2) == n0 + 2, "length after truncate");
    float xa[20 * 32], refa[20 * 32];
    memcpy(xa, x0, sizeof(float) * (size_t)((n0 + 2) * qd));
    memcpy(xa + (n0 + 2) * qd, x1, sizeof(float) * (size_t)(3 * qd));
    full_forward(L, &o, 1, n0 + 5, xa, refa);
    const double sa = max_abs_f(refa, (n0 + 5) * od);
    run_one(L, c, 2, 3, x1, yp);
    CHECK(max_diff_f(yp, refa + (n0 + 2) * od, 3 * od) <= TOL_OUT_REL * sa,
          "truncate then continue equals the full forward of the edited sequence");

    /* Copy: fork sequence 2 (length n0 + 5) into 1, continue both differently. */
    CHECK_OK(mha_kv_cache_copy(c, 2, 1, &err), &err);
    CHECK(mha_kv_cache_length(c, 1) == n0 + 5, "length after copy");
    float xb[20 * 32], refb[20 * 32];
    memcpy(xb, xa, sizeof(float) * (size_t)((n0 + 5) * qd));
    memcpy(xb + (n0 + 5) * qd, x0 + 15 * qd, sizeof(float) * (size_t)(2 * qd));
    full_forward(L, &o, 1, n0 + 7, xb, refb);
    const double sb = max_abs_f(refb, (n0 + 7) * od);
    run_one(L, c, 1, 2, x0 + 15 * qd, yp);
    CHECK(max_diff_f(yp, refb + (n0 + 5) * od, 2 * od) <= TOL_OUT_REL * sb,
          "copy (fork) then continue equals the full forward");
    memcpy(xb + (n0 + 5) * qd, x1 + 10 * qd, sizeof(float) * (size_t)qd);
    full_forward(L, &o, 1, n0 + 6, xb, refb);
    run_one(L, c, 2, 1, x1 + 10 * qd, yp);
    CHECK(max_diff_f(yp, refb + (n0 + 5) * od, od) <= TOL_OUT_REL * max_abs_f(refb, (n0 + 6) * od),
          "the source of a copy is unaffected by the fork's appends");

    /* Reset: sequence 2 starts over and equals a fresh run. */
    CHECK_OK(mha_kv_cache_reset(c, 2, &err), &err);
    CHECK(mha_kv_cache_length(c, 2) == 0, "length after reset");
    run_one(L, c, 2, n0 + steps, x0, yp);
    CHECK(max_diff_f(yp, ref0, (n0 + steps) * od) <= TOL_OUT_REL * s0,
          "reset then prefill equals the full forward");
    mha_kv_cache_destroy(c);
    mha_layer_destroy(L);
}

/* ---------------------------------------------------------------------------------------------- */
/* 3. GQA equals MHA with repeated K/V heads.                                                     */
/* ---------------------------------------------------------------------------------------------- */

static void test_gqa_equals_repeated(void) {
    const opts og = {"gqa", 32, 4, 2, 8, MHA_ROPE_INTERLEAVED, 0, 0, 0, 0.0, 0, 0, MHA_DTYPE_F32};
    mha_layer *Lg = make_layer(&og, 77);
    const mha_weights *wg = mha_layer_weights(Lg);
    const mha_config *cg = mha_layer_config(Lg);
    /* MHA layer: kv head i of 4 = rows of GQA kv head i / 2. */
    const int64_t qd = 32, dk = 8;
    float wk[4 * 8 * 32], wv[4 * 8 * 32], bk[32], bv[32];
    for (int64_t i = 0; i < 4; i++) {
        memcpy(wk + i * dk * qd, (const float *)wg->w_k + (i / 2) * dk * qd,
               sizeof(float) * (size_t)(dk * qd));
        memcpy(wv + i * dk * qd, (const float *)wg->w_v + (i / 2) * dk * qd,
               sizeof(float) * (size_t)(dk * qd));
        memcpy(bk + i * dk, (const float *)wg->b_k + (i / 2) * dk, sizeof(float) * (size_t)dk);
        memcpy(bv + i * dk, (const float *)wg->b_v + (i / 2) * dk, sizeof(float) * (size_t)dk);
    }
    mha_config cm = *cg;
    cm.num_kv_heads = 4;
    mha_weights wm = *wg;
    wm.w_k = wk, wm.w_v = wv, wm.b_k = bk, wm.b_v = bv;
    mha_layer *Lm = NULL;
    mha_error err;
    CHECK_OK(mha_layer_create(&cm, &wm, MHA_WEIGHTS_COPY, NULL, &Lm, &err), &err);
    opts om = og;
    om.g = 4;
    const int64_t n = 12;
    float x[12 * 32], yg[12 * 32], ym[12 * 32];
    test_rng r;
    test_rng_seed(&r, 9);
    test_fill_normal(&r, x, n * qd, 1.0f);
    mha_kv_cache *c1 = make_cache(Lg, &og, 1, 16), *c2 = make_cache(Lm, &om, 1, 16);
    CHECK(mha_kv_cache_get_config(c1)->num_kv_heads == 2, "GQA cache stores only g heads");
    decode_all(Lg, c1, 1, n, 3, 1, x, yg, MHA_IMPL_AUTO, 1);
    decode_all(Lm, c2, 1, n, 3, 1, x, ym, MHA_IMPL_AUTO, 1);
    const double e = max_diff_f(yg, ym, n * qd);
    CHECK(e <= TOL_OUT_REL * max_abs_f(ym, n * qd), "GQA decode vs MHA with repeated kv: %.3g", e);
    mha_kv_cache_destroy(c1);
    mha_kv_cache_destroy(c2);
    mha_layer_destroy(Lg);
    mha_layer_destroy(Lm);
}

/* ---------------------------------------------------------------------------------------------- */
/* 4. Merge of partial results.                                                                   */
/* ---------------------------------------------------------------------------------------------- */

static void core(int64_t n,
                 int64_t m,
                 int64_t d,
                 const float *q,
                 const float *k,
                 const float *v,
                 float *o,
                 float *lse,
                 const uint8_t *kpm) {
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = 1, a.num_heads = 1, a.q_len = n, a.kv_len = m, a.head_dim = d;
    a.q = q, a.k = k, a.v = v, a.out = o, a.lse = lse;
    const int64_t sq[3] = {n * d, n * d, d}, sk[3] = {m * d, m * d, d};
    memcpy(a.q_strides, sq, sizeof sq);
    memcpy(a.out_strides, sq, sizeof sq);
    memcpy(a.k_strides, sk, sizeof sk);
    memcpy(a.v_strides, sk, sizeof sk);
    a.mask.window_left = a.mask.window_right = -1;
    if (kpm) {
        a.mask.key_padding.data = kpm;
        a.mask.key_padding.dtype = MHA_DTYPE_U8;
        a.mask.key_padding.ndim = 1;
        a.mask.key_padding.shape[0] = m;
    }
    mha_exec ex = {0};
    ex.impl = MHA_IMPL_REFERENCE;
    mha_error err;
    CHECK_OK(mha_attention(&a, &ex, &err), &err);
}

static void test_merge(void) {
    enum { N = 5, M = 40, D = 16, MA = 13 };
    test_rng r;
    test_rng_seed(&r, 11);
    float q[N * D], k[M * D], v[M * D], o[N * D], lse[N], oa[N * D], la[N], ob[N * D], lb[N];
    float om[N * D], lm[N];
    test_fill_normal(&r, q, N * D, 1.0f);
    test_fill_normal(&r, k, M * D, 1.0f);
    test_fill_normal(&r, v, M * D, 1.0f);
    core(N, M, D, q, k, v, o, lse, NULL);
    core(N, MA, D, q, k, v, oa, la, NULL);
    core(N, M - MA, D, q, k + MA * D, v + MA * D, ob, lb, NULL);
    mha_error err;
    CHECK_OK(mha_attention_merge(N, D, oa, D, la, ob, D, lb, om, D, lm, &err), &err);
    CHECK(max_diff_f(om, o, N * D) <= TOL_OUT_REL * max_abs_f(o, N * D), "merge equals unsplit");
    CHECK(max_diff_f(lm, lse, N) <= TOL_OUT_REL * max_abs_f(lse, N), "merged lse equals unsplit");
    /* In place into o_a. */
    CHECK_OK(mha_attention_merge(N, D, oa, D, la, ob, D, lb, oa, D, la, &err), &err);
    CHECK(max_diff_f(oa, o, N * D) <= TOL_OUT_REL * max_abs_f(o, N * D), "in-place merge");
    /* A fully masked partial (lse = -inf, output 0) contributes nothing. */
    uint8_t none[M];
    memset(none, 0, sizeof none);
    core(N, M, D, q, k, v, ob, lb, none);
    CHECK(isinf(lb[0]) && lb[0] < 0 && ob[0] == 0.0f, "fully masked partial: lse -inf, o 0");
    for (int i = 0; i < N * D; i++)
        ob[i] = NAN; /* even garbage in a -inf partial is ignored */
    CHECK_OK(mha_attention_merge(N, D, o, D, lse, ob, D, lb, om, D, lm, &err), &err);
    CHECK(max_diff_f(om, o, N * D) == 0.0 && max_diff_f(lm, lse, N) == 0.0,
          "merge with a fully masked partial is the identity");
    /* Both masked: zero output, lse -inf. */
    float ob2[N * D], lb2[N];
    memcpy(ob2, ob, sizeof ob2);
    memcpy(lb2, lb, sizeof lb2);
    CHECK_OK(mha_attention_merge(N, D, ob2, D, lb2, ob, D, lb, om, D, lm, &err), &err);
    CHECK(max_abs_f(om, N * D) == 0.0 && isinf(lm[0]) && lm[0] < 0,
          "both partials masked: o 0, lse -inf, no NaN");
    mha_status st = mha_attention_merge(N, D, oa, 3, la, ob, D, lb, om, D, lm, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "stride"), "bad stride: %s",
          err.message);
    st = mha_attention_merge(N, D, NULL, D, la, ob, D, lb, om, D, lm, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG, "NULL o_a refused");

    /* Split-KV inside the cache equals one pass: mha_kv_cache_attention vs the reference, over
     * a cache long enough for several blocks. */
}

/* ---------------------------------------------------------------------------------------------- */
/* 5. Errors change nothing.                                                                      */
/* ---------------------------------------------------------------------------------------------- */

static void expect_err(mha_status st, const mha_error *err, const char *needle, const char *what) {
    CHECK(st == MHA_STATUS_INVALID_ARG, "%s: status %s (%s)", what, mha_status_string(st),
          err->message);
    CHECK(strstr(err->message, needle) != NULL, "%s: message '%s' lacks '%s'", what, err->message,
          needle);
}

static void test_errors(void) {
    const opts o = {"err", 16, 4, 2, 4, MHA_ROPE_INTERLEAVED, 0, 0, 0, 0.0, 0, 0, MHA_DTYPE_F32};
    mha_layer *L = make_layer(&o, 3);
    mha_kv_cache *c = make_cache(L, &o, 2, 4);
    mha_error err;
    float x[8 * 16], y[8 * 16];
    test_rng r;
    test_rng_seed(&r, 1);
    test_fill_normal(&r, x, 8 * 16, 1.0f);
    for (int i = 0; i < 8 * 16; i++)
        y[i] = NAN;
    mha_decode_args a = {0};
    a.num_seqs = 2, a.num_tokens = 3, a.x = x, a.out = y;
    CHECK_OK(mha_layer_prefill(L, c, &a, NULL, &err), &err);
    float k_before[8], v_before[8];
    CHECK_OK(mha_kv_cache_read(c, 1, 2, k_before, v_before, &err), &err);
    for (int i = 0; i < 8 * 16; i++)
        y[i] = NAN;
    /* Overflow: 3 + 2 > max_seq = 4. */
    a.num_tokens = 2;
    expect_err(mha_layer_decode_step(L, c, &a, NULL, &err), &err, "overflow",
               "append past max_seq");
    CHECK(mha_kv_cache_length(c, 0) == 3 && mha_kv_cache_length(c, 1) == 3,
          "overflow changes no length");
    CHECK(isnan(y[0]) && isnan(y[2 * 16 - 1]), "overflow leaves out untouched");
    float kk[8 * 4], vv[8 * 4];
    test_fill_normal(&r, kk, 32, 1.0f);
    test_fill_normal(&r, vv, 32, 1.0f);
    expect_err(mha_kv_cache_append(c, 2, NULL, 2, kk, vv, &err), &err, "max_seq",
               "raw append past max_seq");
    /* Bad ids. */
    int64_t ids[2] = {1, 5};
    a.num_tokens = 1;
    a.seq_ids = ids;
    expect_err(mha_layer_decode_step(L, c, &a, NULL, &err), &err, "seq_ids[1]=5", "bad seq id");
    ids[1] = 1;
    expect_err(mha_layer_decode_step(L, c, &a, NULL, &err), &err, "distinct", "duplicate id");
    a.seq_ids = NULL;
    a.num_seqs = 3;
    expect_err(mha_layer_decode_step(L, c, &a, NULL, &err), &err, "num_seqs=3", "too many seqs");
    CHECK(isnan(y[0]), "bad ids leave out untouched");
    expect_err(mha_kv_cache_truncate(c, 0, 4, &err), &err, "new_len=4", "truncate longer");
    expect_err(mha_kv_cache_truncate(c, 0, -1, &err), &err, "new_len=-1", "truncate negative");
    expect_err(mha_kv_cache_truncate(c, 2, 0, &err), &err, "seq=2", "truncate bad seq");
    expect_err(mha_kv_cache_share_prefix(c, 0, 1, 4, &err), &err, "share_prefix: len=4",
               "share_prefix longer than src");
    expect_err(mha_kv_cache_accept(c, 0, 4, 0, NULL, &err), &err, "accept: base_len=4",
               "accept past the length");
    expect_err(mha_kv_cache_reset(c, -1, &err), &err, "seq=-1", "reset bad seq");
    expect_err(mha_kv_cache_copy(c, 0, 9, &err), &err, "dst_seq=9", "copy bad dst");
    expect_err(mha_kv_cache_read(c, 0, 3, kk, vv, &err), &err, "not stored", "read past length");
    CHECK(mha_kv_cache_length(c, 7) == -1 && mha_kv_cache_length(NULL, 0) == -1,
          "length of a bad id is -1");
    float k_after[8], v_after[8];
    CHECK_OK(mha_kv_cache_read(c, 1, 2, k_after, v_after, &err), &err);
    CHECK(memcmp(k_before, k_after, sizeof k_after) == 0 &&
              memcmp(v_before, v_after, sizeof v_after) == 0 && mha_kv_cache_length(c, 0) == 3,
          "failed calls changed nothing");

    /* Wrong dims: a cache for another head size. */
    mha_kv_cache_config kc = {0};
    kc.num_kv_heads = 2, kc.head_dim = 8, kc.max_seq = 8, kc.batch = 1;
    mha_kv_cache *other = NULL;
    CHECK_OK(mha_kv_cache_create(&kc, NULL, NULL, &other, &err), &err);
    a.num_seqs = 1;
    expect_err(mha_layer_decode_step(L, other, &a, NULL, &err), &err, "d_k=8", "wrong dims");
    mha_kv_cache_destroy(other);
    expect_err(mha_kv_cache_create(&kc, L, NULL, &other, &err), &err, "head_dim=8",
               "cache dims vs layer");
    CHECK(other == NULL, "failed create gives NULL");
    kc.head_dim = 4, kc.dtype = MHA_DTYPE_I32;
    expect_err(mha_kv_cache_create(&kc, L, NULL, &other, &err), &err, "dtype", "bad dtype");
    kc.dtype = MHA_DTYPE_F32, kc.max_seq = 0;
    expect_err(mha_kv_cache_create(&kc, L, NULL, &other, &err), &err, "max_seq=0", "max_seq 0");
    kc.max_seq = 8, kc.window = -2;
    expect_err(mha_kv_cache_create(&kc, L, NULL, &other, &err), &err, "window=-2", "window<0");

    /* Window ring: rollback beyond the slack is refused. */
    kc.window = 3, kc.max_step_tokens = 2, kc.max_seq = 100;
    CHECK_OK(mha_kv_cache_create(&kc, L, NULL, &other, &err), &err);
    CHECK(mha_kv_cache_slots(other) == 4, "ring of W + step - 1 = 4 slots, got %lld",
          (long long)mha_kv_cache_slots(other));
    float xx[10 * 16], yy[10 * 16];
    test_fill_normal(&r, xx, 160, 1.0f);
    a.num_seqs = 1, a.num_tokens = 10, a.x = xx, a.out = yy;
    CHECK_OK(mha_layer_prefill(L, other, &a, NULL, &err), &err);
    expect_err(mha_kv_cache_truncate(other, 0, 7, &err), &err, "roll back at most",
               "ring rollback too far");
    CHECK_OK(mha_kv_cache_truncate(other, 0, 8, &err), &err);
    expect_err(mha_kv_cache_read(other, 0, 3, kk, vv, &err), &err, "not stored",
               "read of a position dropped from the ring");
    /* The core attention of the last position (7) right after the rollback would see keys 5 ..
     * 7; the ring holds positions >= 6 (slot 5 % 4 holds position 9 now): refused, not computed
     * over the overwritten slot. */
    {
        mha_kv_attention_args ra = {0};
        float rq[4 * 4], ro[4 * 4];
        test_fill_normal(&r, rq, 16, 1.0f);
        ra.num_seqs = 1, ra.num_tokens = 1, ra.num_heads = 4, ra.q = rq, ra.out = ro;
        expect_err(mha_kv_cache_attention(other, &ra, NULL, &err), &err, "holds positions >= 6",
                   "attention after a rollback reaching an overwritten slot");
    }
    /* Stepwise rollback cannot get below what the ring still holds (positions >= 6). */
    expect_err(mha_kv_cache_truncate(other, 0, 7, &err), &err, "cannot roll back to 7",
               "second rollback past the ring's furthest length");
    expect_err(mha_kv_cache_read(other, 0, 5, kk, vv, &err), &err, "not stored",
               "read of an overwritten slot after truncate");
    /* Continue after the rollback: equals the full forward of the edited sequence. */
    {
        opts ow = o;
        ow.window = 3;
        float xe[11 * 16], ye[11 * 16], re[11 * 16];
        memcpy(xe, xx, sizeof(float) * 8 * 16);
        test_fill_normal(&r, xe + 8 * 16, 3 * 16, 1.0f);
        full_forward(L, &ow, 1, 11, xe, re);
        a.num_tokens = 3, a.x = xe + 8 * 16, a.out = ye;
        CHECK_OK(mha_layer_decode_step(L, other, &a, NULL, &err), &err);
        CHECK(max_diff_f(ye, re + 8 * 16, 3 * 16) <= TOL_OUT_REL * max_abs_f(re, 11 * 16),
              "window ring: rollback then 3 new tokens equals the full forward");
        a.x = xx, a.out = yy;
    }
    mha_kv_cache_destroy(other);

    /* Core attention misuse. */
    mha_kv_attention_args ka = {0};
    ka.num_seqs = 1, ka.num_tokens = 5, ka.num_heads = 4, ka.q = x, ka.out = y;
    expect_err(mha_kv_cache_attention(c, &ka, NULL, &err), &err, "exceeds the length",
               "attention of more tokens than stored");
    ka.num_tokens = 1, ka.num_heads = 3;
    expect_err(mha_kv_cache_attention(c, &ka, NULL, &err), &err, "num_heads=3",
               "heads not a multiple of g");
    mha_kv_cache_destroy(c);
    mha_layer_destroy(L);
}

/* ---------------------------------------------------------------------------------------------- */
/* 6. Split-KV over long caches: equals the reference, bit-identical for 1, 2, 3 threads. */
/* ---------------------------------------------------------------------------------------------- */

static void test_threads_and_long(void) {
    static const mha_dtype dts[] = {MHA_DTYPE_F32, MHA_DTYPE_F16, MHA_DTYPE_BF16};
    /* (G, H, t, dk, dv, W): R = H / G * t query rows per kv head = 8 (the AVX-512 kernel's
     * general path; two groups of 4 rows in the AVX2 one), 4, 3, 2, 1 (the AVX-512 contiguous
     * path; t = 2 has rows that do not see every key); dk != dv, and dk = 48 (the contiguous path
     * for float32 / float16, the general one for bfloat16). Then for the AVX2 kernel: R = 5 (a
     * group of 4 rows and one of 1) with head sizes 72 and 40 (whole 16-element groups, then one
     * vector of 8), head sizes 20 and 36 (a partial vector: masked float32 loads, float16 /
     * bfloat16 copied), and windowed ring buffers (W = 200 of 215 slots, 16 tokens per append)
     * whose units wrap from the last slot to slot 0 (each wrapping unit is two runs of rows).
     * dk = 18, dv = 72: tails (NEON: a K tail of 2 and a V column group of 8); dk = 15, dv = 35
     * and dk = 17, dv = 33: K tails of 3 and 1, V column groups ending in a partial vector of 3
     * and 1 (R = 6: row groups of 4 and 2; R = 3). dk = 576, dv = 512, one kv head: multi-head
     * latent attention's absorbed decode (issue 31: [c, k_pe] keys, c values). */
    static const int64_t shapes[][6] = {
        {2, 8, 2, 64, 64, 0},    {2, 8, 1, 64, 64, 0},  {2, 6, 1, 32, 64, 0},
        {2, 4, 2, 48, 128, 0},   {4, 4, 1, 64, 64, 0},  {2, 8, 1, 128, 64, 0},
        {2, 10, 1, 72, 40, 0},   {2, 4, 1, 20, 36, 0},  {2, 8, 2, 64, 64, 200},
        {2, 10, 1, 72, 40, 200}, {2, 6, 1, 18, 72, 0},  {2, 6, 2, 15, 35, 0},
        {2, 6, 1, 17, 33, 0},    {1, 8, 1, 576, 512, 0}};
    for (int di = 0; di < 3; di++)
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            const int64_t G = shapes[si][0], H = shapes[si][1], t = shapes[si][2],
                          dk = shapes[si][3], dv = shapes[si][4], W = shapes[si][5], B = 3,
                          Lmax = 1100;
            const int64_t D = dk > dv ? dk : dv; /* K and V are read from one buffer */
            mha_kv_cache_config kc = {0};
            kc.num_kv_heads = G, kc.head_dim = dk, kc.v_head_dim = dv, kc.max_seq = Lmax;
            kc.batch = B;
            kc.dtype = dts[di];
            kc.window = W, kc.max_step_tokens = W ? 16 : 0;
            mha_kv_cache *c = NULL;
            mha_error err;
            CHECK_OK(mha_kv_cache_create(&kc, NULL, NULL, &c, &err), &err);
            test_rng r;
            test_rng_seed(&r, 99);
            const int64_t lens[3] = {1037, 300, 2};
            float *kv = malloc(sizeof(float) * (size_t)(Lmax * G * D));
            for (int64_t s = 0; s < B; s++) {
                test_fill_normal(&r, kv, lens[s] * G * D, 1.0f);
                const int64_t step = W ? 16 : lens[s]; /* a window cache takes <= 16 per call */
                for (int64_t j = 0; j < lens[s]; j += step) {
                    const int64_t n = lens[s] - j < step ? lens[s] - j : step;
                    CHECK_OK(
                        mha_kv_cache_append(c, 1, &s, n, kv + j * G * dk, kv + j * G * dv, &err),
                        &err);
                }
            }
            const int64_t qn = B * t * H * dk, on = B * t * H * dv;
            float *q = malloc(sizeof(float) * (size_t)qn);
            test_fill_normal(&r, q, qn, 1.0f);
            float *o[4], lse[4][3 * 10 * 2];
            memset(lse, 0, sizeof lse);
            for (int k = 0; k < 4; k++)
                o[k] = malloc(sizeof(float) * (size_t)on);
            float sinks[10]; /* one per query head: H <= 10 */
            test_fill_normal(&r, sinks, 10, 1.0f);
            mha_kv_attention_args a = {0};
            a.num_seqs = B, a.num_tokens = t, a.num_heads = H, a.q = q, a.alibi = 1;
            a.softcap = 20.0, a.sinks = sinks;
            for (int k = 0; k < 4; k++) {
                mha_exec ex = {0};
                ex.impl = k == 3 ? MHA_IMPL_REFERENCE : MHA_IMPL_AUTO;
                ex.n_threads = k == 3 ? 1 : k + 1;
                a.out = o[k];
                a.lse = lse[k];
                CHECK_OK(mha_kv_cache_attention(c, &a, &ex, &err), &err);
            }
            CHECK(memcmp(o[0], o[1], sizeof(float) * (size_t)on) == 0 &&
                      memcmp(o[0], o[2], sizeof(float) * (size_t)on) == 0 &&
                      memcmp(lse[0], lse[1], sizeof lse[0]) == 0 &&
                      memcmp(lse[0], lse[2], sizeof lse[0]) == 0,
                  "%s G=%lld H=%lld t=%lld dk=%lld dv=%lld W=%lld: split-KV outputs bit-identical "
                  "for 1, 2, 3 threads",
                  dt_name(dts[di]), (long long)G, (long long)H, (long long)t, (long long)dk,
                  (long long)dv, (long long)W);
            const double e = max_diff_f(o[0], o[3], on), sc = max_abs_f(o[3], on);
            CHECK(e <= TOL_OUT_REL * sc,
                  "%s G=%lld H=%lld t=%lld dk=%lld dv=%lld W=%lld: split-KV vs reference over "
                  "1037 keys: %.3g (max %.3g)",
                  dt_name(dts[di]), (long long)G, (long long)H, (long long)t, (long long)dk,
                  (long long)dv, (long long)W, e, sc);
            CHECK(max_diff_f(lse[0], lse[3], B * H * t) <=
                      TOL_OUT_REL * max_abs_f(lse[3], B * H * t),
                  "%s G=%lld H=%lld t=%lld: split-KV lse vs reference", dt_name(dts[di]),
                  (long long)G, (long long)H, (long long)t);
            for (int k = 0; k < 4; k++)
                free(o[k]);
            free(q);
            free(kv);
            mha_kv_cache_destroy(c);
        }
    /* The layer too: 1, 2, 3 threads give the same bits. */
    const opts o = {"thr", 32, 4, 2, 8, MHA_ROPE_HALF, 0, 1, 1, 4.0, 0, 0, MHA_DTYPE_BF16};
    mha_layer *L = make_layer(&o, 8);
    const int64_t n = 300, B = 2;
    float *x = malloc(sizeof(float) * (size_t)(B * n * 32));
    float *y[3];
    test_rng r;
    test_rng_seed(&r, 4);
    test_fill_normal(&r, x, B * n * 32, 1.0f);
    for (int k = 0; k < 3; k++) {
        y[k] = malloc(sizeof(float) * (size_t)(B * n * 32));
        mha_kv_cache *c = make_cache(L, &o, B, n);
        decode_all(L, c, B, n, 280, 4, x, y[k], MHA_IMPL_AUTO, k + 1);
        mha_kv_cache_destroy(c);
    }
    CHECK(memcmp(y[0], y[1], sizeof(float) * (size_t)(B * n * 32)) == 0 &&
              memcmp(y[0], y[2], sizeof(float) * (size_t)(B * n * 32)) == 0,
          "layer decode bit-identical for 1, 2, 3 threads");
    for (int k = 0; k < 3; k++)
        free(y[k]);
    free(x);
    mha_layer_destroy(L);
}

/* Non-finite cache entries: a NaN key a query sees makes its row NaN (as in the full forward);
 * a NaN key and an infinite value it does not see (a later token of the same call) change
 * nothing. Head sizes 16, 20, 24, 64 and 72 take the split-KV kernels' load paths: whole vectors,
 * a masked (float16 / bfloat16: copied) tail, AVX2's vector of 8 after whole groups of 16, the
 * AVX-512 contiguous path; for the NEON kernel 18 has a K tail (d % 4 = 2), 20 and 72 a partial
 * 16-column group of V. 2 or 3 query heads per kv head and 2 tokens give 4 or 6 rows (AVX2: one
 * group of 4 rows, or 4 + 2). The non-finite entries sit in the first and the last 8 elements of
 * the row. */
static void test_nonfinite_keys(void) {
    static const mha_dtype dts[] = {MHA_DTYPE_F32, MHA_DTYPE_F16, MHA_DTYPE_BF16};
    static const int64_t dims[] = {16, 18, 20, 24, 64, 72};
    for (int di = 0; di < 3; di++)
        for (int dd = 0; dd < 12; dd++) {
            const int64_t G = 1, H = 2 + dd % 2, n = 40, t = 2, D = dims[dd / 2];
            mha_kv_cache_config kc = {0};
            kc.num_kv_heads = G, kc.head_dim = D, kc.max_seq = n, kc.batch = 2;
            kc.dtype = dts[di];
            mha_kv_cache *c = NULL;
            mha_error err;
            CHECK_OK(mha_kv_cache_create(&kc, NULL, NULL, &c, &err), &err);
            test_rng r;
            test_rng_seed(&r, 7);
            float k[40 * 72], v[40 * 72], q[2 * 2 * 3 * 72], out[2][2 * 2 * 3 * 72];
            test_fill_normal(&r, k, n * D, 1.0f);
            test_fill_normal(&r, v, n * D, 1.0f);
            test_fill_normal(&r, q, 2 * t * H * D, 1.0f);
            for (int64_t s = 0; s < 2; s++)
                CHECK_OK(mha_kv_cache_append(c, 1, &s, n, k, v, &err), &err);
            mha_kv_attention_args a = {0};
            a.num_seqs = 2, a.num_tokens = t, a.num_heads = H, a.q = q;
            a.out = out[0];
            CHECK_OK(mha_kv_cache_attention(c, &a, NULL, &err), &err);
            /* Sequence 1: NaN key and infinite value at the last position (seen only by token 1).
             */
            const int64_t s1 = 1;
            CHECK_OK(mha_kv_cache_truncate(c, s1, n - 1, &err), &err);
            k[(n - 1) * D + 3] = k[(n - 1) * D + D - 2] = NAN;
            v[(n - 1) * D + 5] = v[(n - 1) * D + D - 1] = INFINITY;
            CHECK_OK(mha_kv_cache_append(c, 1, &s1, 1, k + (n - 1) * D, v + (n - 1) * D, &err),
                     &err);
            a.out = out[1];
            CHECK_OK(mha_kv_cache_attention(c, &a, NULL, &err), &err);
            const int64_t row = H * D; /* one token's outputs */
            int token0_same = 1, token1_nan = 1;
            for (int64_t e = 0; e < row; e++) {
                const float *o1 = out[1] + t * row; /* sequence 1 */
                token0_same &= memcmp(&o1[e], &out[0][t * row + e], sizeof(float)) == 0;
                token1_nan &= isnan(o1[row + e]);
            }
            CHECK(token0_same, "%s d=%lld H=%lld: a hidden NaN key / Inf value changes nothing",
                  dt_name(dts[di]), (long long)D, (long long)H);
            CHECK(token1_nan, "%s d=%lld H=%lld: a visible NaN key makes the row NaN",
                  dt_name(dts[di]), (long long)D, (long long)H);
            mha_kv_cache_destroy(c);
        }
}

int main(void) {
    test_decode_matches_full();
    test_decode_dynamic_rope();
    test_mixed_and_edit();
    test_gqa_equals_repeated();
    test_merge();
    test_errors();
    test_threads_and_long();
    test_nonfinite_keys();
    printf("worst decode error / max|ref|: f32 %.3g, f16 %.3g, bf16 %.3g\n", g_worst[0], g_worst[1],
           g_worst[2]);
    return test_finish();
}
