/* SPDX-License-Identifier: MIT */
/* test_half_layer.c: the layer with half-precision storage (docs/SEMANTICS.md "Half precision"):
 * weights in config.weight_dtype, query/key/value in args.x_dtype, out in args.out_dtype (F32,
 * BF16 or F16, any mix), float32 arithmetic inside.
 *
 * For every case (GQA, RoPE, causal, biases, sinks, cross-attention; bf16 and f16 end to end,
 * f32 weights with bf16 activations = autocast, bf16 weights with an f32 out, f16 weights with
 * bf16 inputs) and both implementations (reference, auto):
 *   1. forward, training forward + backward, mha_layer_project (+ backward) and the decode step
 *      against the float64 oracles given the SAME rounded values (the halves widened), at the
 *      half tolerance of tolerance.h (TOL_HALF_C u_s on a half output, plus the float32 term);
 *   2. bit-identical to the float32 layer run on the widened weights and inputs, its outputs
 *      rounded once to the output dtype: halves are widened exactly where they are read and
 *      nothing else changes (the GEMM widens while packing; the few-rows path in registers);
 *      (except bf16 x with bf16 W under impl=auto where the CPU has the vdpbf16ps pair GEMM:
 *      its projections sum the exact products in pairs, with DAZ/FTZ; pair_gemm() below; the
 *      float64-oracle checks still apply to it, and tests/test_gemm.c checks the kernel itself);
 *      A half module (x_dtype == weight_dtype, bf16 or f16) stores its intermediates in that
 *      dtype (Q, K, V rounded after the projection and again after RoPE, the attention output
 *      rounded): there the twin is the layer composed of its steps with those roundings
 *      (twin_forward: projections, round, RoPE, round, the core on half Q/K/V/out, the output
 *      projection), bit for bit, and the oracle rounds at the same points (oracle_layer_dt);
 *      its gradients are checked against the float64 gradient of the unrounded layer at
 *      TOL_HALF_LAYER_C u_s (the roundings differentiated as the identity);
 *      half modules with a QK-norm (RMS_HEAD, unit offset, RMS_ALL, L2_AFTER_ROPE), temperature
 *      tuning and an output gate, bf16 and f16 (test_stage): each stage's result rounded, G, A
 *      and A sigmoid(G) rounded; forward vs its twin (stage_twin) bit for bit and vs the float64
 *      oracle rounding at the same points, the training forward's bits, the statistics = the
 *      core's on the forward's rounded Q and K (bits), the gradients within TOL_HALF_LAYER_GRAD_C
 *      u_a of the float32 layer's, dw_o = dy^T A_g on the stored A_g (float32 error). Dropping
 *      any one rounding (after the projection, the RMS norm, the L2 norm, of G in the forward or
 *      the training forward, of the training state's A_g, in the statistics) fails;
 *   3. bit-identical for 1 and 2 threads;
 *   4. hostile dtypes refused with a message naming the field; a NaN / Inf half weight refused
 *      with its tensor and index; a COPY layer keeps the weights in their dtype (not widened).
 */
#include "base/internal.h"
#include "harness.h"
#include "kernels/registry.h"
#include "layer/plan.h"
#include "oracle_f64.h"
#include "oracle_grad_f64.h"
#include "tolerance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct spec {
    const char *name;
    int64_t B, n, m; /* m: cross-attention keys (0 = self-attention) */
    int64_t qd, h, g, dk;
    int bias, sinks, causal;
    mha_rope_style rope;
    mha_dtype wdt, xdt, odt;
} spec;

#define F32  MHA_DTYPE_F32
#define BF16 MHA_DTYPE_BF16
#define F16  MHA_DTYPE_F16

// clang-format off
static const spec SPECS[] = {
    /* name                   B  n   m  qd  h  g  dk  bias sinks causal rope               w     x     out */
    {"bf16_end_to_end_gqa",   2, 13, 0, 64, 4, 2, 16, 1,   0,    1,     MHA_ROPE_HALF,     BF16, BF16, BF16},
    {"f16_end_to_end_gqa",    2, 13, 0, 64, 4, 2, 16, 1,   0,    1,     MHA_ROPE_HALF,     F16,  F16,  F16 },
    {"autocast_f32_w",        2, 11, 0, 48, 4, 4, 12, 1,   0,    1,     MHA_ROPE_INTERLEAVED, F32, BF16, BF16},
    {"bf16_w_f32_out",        1, 17, 0, 64, 8, 2, 8,  0,   1,    1,     MHA_ROPE_HALF,     BF16, F32,  F32 },
    {"f16_w_bf16_x_f32_out",  2, 9,  0, 32, 2, 1, 16, 1,   0,    0,     MHA_ROPE_NONE,     F16,  BF16, F32 },
    {"cross_bf16_sinks",      2, 7,  10, 40, 4, 2, 10, 1,  1,    0,     MHA_ROPE_NONE,     BF16, BF16, F16 },
    {"one_row_bf16",          1, 3,  0, 64, 4, 2, 16, 1,   0,    1,     MHA_ROPE_HALF,     BF16, BF16, BF16},
};
// clang-format on
#define N_SPECS ((int)(sizeof SPECS / sizeof SPECS[0]))

static double unit(mha_dtype dt) {
    return dt == BF16 ? TOL_HALF_U_BF16 : dt == F16 ? TOL_HALF_U_F16 : 0.0;
}
static const char *dname(mha_dtype dt) {
    return dt == BF16 ? "bf16" : dt == F16 ? "f16" : "f32";
}

/* A tensor in its storage dtype and its exact float32 widening (the SAME rounded values). */
typedef struct tensor {
    void *st;
    float *f;
    int64_t n;
    mha_dtype dt;
} tensor;

static tensor make_tensor(test_rng *r, mha_dtype dt, int64_t n, float stddev) {
    tensor t = {NULL, NULL, n, dt};
    if (n == 0)
        return t;
    float *raw = malloc(sizeof(float) * (size_t)n);
    test_fill_normal(r, raw, n, stddev);
    t.st = malloc(mha__storage_size(dt) * (size_t)n);
    t.f = malloc(sizeof(float) * (size_t)n);
    mha__narrow(dt, raw, t.st, n);
    mha__widen(dt, t.st, t.f, n);
    free(raw);
    return t;
}

static void free_tensor(tensor *t) {
    free(t->st);
    free(t->f);
}

static double *to_d(const float *x, int64_t n) {
    double *d = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++)
        d[i] = (double)x[i];
    return d;
}

/* A case built: the half layer, the float32 twin on the widened weights, inputs and dy. */
typedef struct built {
    spec s;
    mha_config cfg; /* resolved, of the half layer */
    tensor w[9];    /* w_q w_k w_v w_o b_q b_k b_v b_o sinks, in s.wdt */
    tensor xq, xk, dy;
    mha_layer *L, *L32;
} built;

static int build(const spec *s, uint64_t seed, built *c) {
    memset(c, 0, sizeof *c);
    c->s = *s;
    test_rng r;
    test_rng_seed(&r, seed);
    mha_config cfg = {0};
    cfg.q_dim = s->qd, cfg.num_heads = s->h, cfg.num_kv_heads = s->g, cfg.head_dim = s->dk;
    cfg.bias_q = cfg.bias_k = cfg.bias_v = cfg.bias_o = s->bias;
    cfg.sinks = s->sinks;
    cfg.rope.style = s->rope;
    const int64_t hd = s->h * s->dk, gd = s->g * s->dk;
    const int64_t sizes[9] = {hd * s->qd,       gd * s->qd,          gd * s->qd,
                              s->qd * hd,       s->bias ? hd : 0,    s->bias ? gd : 0,
                              s->bias ? gd : 0, s->bias ? s->qd : 0, s->sinks ? s->h : 0};
    for (int i = 0; i < 9; i++)
        c->w[i] =
            make_tensor(&r, s->wdt, sizes[i], i < 4 ? (float)(1.2 / sqrt((double)s->qd)) : 0.5f);
    const int64_t m = s->m ? s->m : s->n;
    c->xq = make_tensor(&r, s->xdt, s->B * s->n * s->qd, 1.0f);
    c->xk = make_tensor(&r, s->xdt, s->m ? s->B * m * s->qd : 0, 1.0f);
    c->dy = make_tensor(&r, s->odt, s->B * s->n * s->qd, 1.0f);
    mha_weights w = {c->w[0].st, c->w[1].st, c->w[2].st, c->w[3].st, c->w[4].st, c->w[5].st,
                     c->w[6].st, c->w[7].st, c->w[8].st, NULL,       NULL};
    mha_weights w32 = {c->w[0].f, c->w[1].f, c->w[2].f, c->w[3].f, c->w[4].f, c->w[5].f,
                       c->w[6].f, c->w[7].f, c->w[8].f, NULL,      NULL};
    mha_error err = {0};
    cfg.weight_dtype = s->wdt;
    CHECK_OK(mha_layer_create(&cfg, &w, MHA_WEIGHTS_COPY, NULL, &c->L, &err), &err);
    cfg.weight_dtype = F32;
    CHECK_OK(mha_layer_create(&cfg, &w32, MHA_WEIGHTS_BORROW, NULL, &c->L32, &err), &err);
    if (!c->L || !c->L32)
        return 0;
    c->cfg = *mha_layer_config(c->L);
    /* COPY keeps the weights in their dtype: same bytes, the layer's own buffer. */
    const mha_weights *lw = mha_layer_weights(c->L);
    const void *got[9] = {lw->w_q, lw->w_k, lw->w_v, lw->w_o,  lw->b_q,
                          lw->b_k, lw->b_v, lw->b_o, lw->sinks};
    int same = c->cfg.weight_dtype == s->wdt;
    for (int i = 0; i < 9; i++)
        if (sizes[i])
            same &= got[i] != c->w[i].st &&
                    memcmp(got[i], c->w[i].st, mha__storage_size(s->wdt) * (size_t)sizes[i]) == 0;
    CHECK(same, "[%s] a COPY layer keeps its weights in %s, unchanged", s->name, dname(s->wdt));
    return 1;
}

static void unbuild(built *c) {
    for (int i = 0; i < 9; i++)
        free_tensor(&c->w[i]);
    free_tensor(&c->xq);
    free_tensor(&c->xk);
    free_tensor(&c->dy);
    mha_layer_destroy(c->L);
    mha_layer_destroy(c->L32);
}

static mha_forward_args fwd_args(const built *c, int widened, void *out) {
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.batch = c->s.B, a.q_len = c->s.n, a.kv_len = c->s.m;
    a.query = widened ? (const void *)c->xq.f : c->xq.st;
    a.key = c->s.m ? (widened ? (const void *)c->xk.f : c->xk.st) : NULL;
    a.mask.causal = c->s.causal;
    a.out = out;
    a.x_dtype = widened ? F32 : c->s.xdt;
    a.out_dtype = widened ? F32 : c->s.odt;
    return a;
}

/* 1 when impl projects the bf16 inputs with the bf16 weights on the vdpbf16ps pair GEMM
 * (mha_gemm_bf16_*: bf16 x and W, more than MHA_GEMM_SMALL_M rows, a CPU with AVX512-BF16):
 * not the float32 arithmetic (pairs of exact products; DAZ/FTZ), so its results are not the
 * float32 twin's bits. Counted, and printed, never silently skipped. */
static int g_pair_exempt;
/* Worst errors of the half modules, in units of u_a max|ref| (printed: the constants' headroom). */
static double g_worst_fwd, g_worst_fwd_tile, g_worst_grad, g_worst_stats;
static int pair_gemm(const spec *s, mha_impl impl) {
    const int64_t rows = s->B * (s->n > s->m ? s->n : s->m);
    return impl != MHA_IMPL_REFERENCE && s->xdt == BF16 && s->wdt == BF16 &&
           rows > MHA_GEMM_SMALL_M && mha__registry_best_dt(MHA__OP_gemm, MHA_DTS_BF16) != NULL;
}

/* 1 for a half module: its intermediates are stored in its dtype (docs/SEMANTICS.md). */
static int half_act(const spec *s) {
    return s->xdt == s->wdt && s->xdt != F32;
}
static mha_dtype act_dtype(const spec *s) {
    return half_act(s) ? s->xdt : F32;
}

/* 1 when this CPU has a half-only (tile) attention kernel for bf16: AUTO's core may take it. */
static int bf16_tile_cpu(void) {
    const mha__kernel_info *kf = mha__registry_best_dt(MHA__OP_fwd, MHA_DTS_BF16);
    return kf && !(kf->dtypes & MHA_DTS_F32);
}

/* x[0, n) rounded to dt in place (float32 kept). */
static void round_f32(mha_dtype dt, float *x, int64_t n) {
    uint16_t *t = malloc(2 * (size_t)n + 2);
    mha__narrow(dt, x, t, n);
    mha__widen(dt, t, x, n);
    free(t);
}

/* The half module's forward composed of its steps (docs/SEMANTICS.md "Half precision in the
 * layer"), each rounding where the contract says: Q' = round(x W_q^T + b_q) (mha_layer_project
 * on the widened x: the same GEMM arithmetic unless the pair GEMM runs), RoPE in float32, round;
 * V rounded; the core on half Q, K, V into a half A; y = A W_o^T + b_o rounded to out_dtype. */
static void twin_forward(const built *c, mha_impl impl, void *out) {
    const spec *s = &c->s;
    const mha_dtype adt = act_dtype(s);
    const int64_t B = s->B, n = s->n, m = s->m ? s->m : s->n, hd = s->h * s->dk, gd = s->g * s->dk;
    const float *xk = s->m ? c->xk.f : c->xq.f;
    float *q = malloc(sizeof(float) * (size_t)(B * n * hd));
    float *k = malloc(sizeof(float) * (size_t)(B * m * gd));
    float *v = malloc(sizeof(float) * (size_t)(B * m * gd));
    float *a32 = malloc(sizeof(float) * (size_t)(B * n * hd));
    float *y = malloc(sizeof(float) * (size_t)(B * n * s->qd));
    uint16_t *qh = malloc(2 * (size_t)(B * n * hd)), *kh = malloc(2 * (size_t)(B * m * gd));
    uint16_t *vh = malloc(2 * (size_t)(B * m * gd)), *ah = malloc(2 * (size_t)(B * n * hd));
    mha_exec ex = {impl, 2, NULL, 0, NULL, NULL};
    mha_error err = {0};
    CHECK_OK(mha_layer_project(c->L, MHA_PROJ_Q, B * n, c->xq.f, q, &ex, &err), &err);
    CHECK_OK(mha_layer_project(c->L, MHA_PROJ_K, B * m, xk, k, &ex, &err), &err);
    CHECK_OK(mha_layer_project(c->L, MHA_PROJ_V, B * m, xk, v, &ex, &err), &err);
    if (s->rope != MHA_ROPE_NONE) {
        double tab[64 * 3];
        round_f32(adt, q, B * n * hd);
        round_f32(adt, k, B * m * gd);
        const int64_t len = mha__plan_rope_length(&c->cfg.rope, NULL, NULL, NULL, B, n, m);
        mha__plan_rope(&c->cfg.rope, len, tab, q, B, n, s->h, s->dk, NULL, NULL, 1);
        mha__plan_rope(&c->cfg.rope, len, tab, k, B, m, s->g, s->dk, NULL, NULL, 1);
    }
    mha__narrow(adt, q, qh, B * n * hd);
    mha__narrow(adt, k, kh, B * m * gd);
    mha__narrow(adt, v, vh, B * m * gd);
    mha_forward_args fa = fwd_args(c, 0, NULL);
    mha_attention_args core;
    mha__plan_core_args(&c->cfg, c->w[8].f, &fa, m, qh, kh, vh, ah, NULL, adt, &core);
    CHECK_OK(mha_attention(&core, &ex, &err), &err);
    mha__widen(adt, ah, a32, B * n * hd);
    CHECK_OK(mha_layer_project(c->L, MHA_PROJ_O, B * n, a32, y, &ex, &err), &err);
    mha__narrow(s->odt, y, out, B * n * s->qd);
    free(q), free(k), free(v), free(a32), free(y), free(qh), free(kh), free(vh), free(ah);
}

/* out (storage of dtype dt) against the float32 twin's y32 rounded once to dt: same bits. */
static int same_as_rounded(mha_dtype dt, const void *out, const float *y32, int64_t n) {
    void *r = malloc(mha__storage_size(dt) * (size_t)n);
    mha__narrow(dt, y32, r, n);
    const int same = memcmp(r, out, mha__storage_size(dt) * (size_t)n) == 0;
    free(r);
    return same;
}

/* max|widen(out) - ref| <= (TOL_HALF_C u_s (half out) + f32 term) max|ref|. */
static void check_close(const char *what,
                        const spec *s,
                        const char *impl,
                        mha_dtype dt,
                        const void *out,
                        const double *ref,
                        int64_t n,
                        double f32_rel) {
    float *o = malloc(sizeof(float) * (size_t)n);
    mha__widen(dt, out, o, n);
    const double e = test_max_abs_diff(o, ref, n), scale = test_max_abs(ref, n);
    const double tol = (TOL_HALF_C * unit(dt) + f32_rel) * scale;
    CHECK(e <= tol && scale > 0.0, "[%s] %s %s (%s): max err %.3e > tol %.3e (max|ref| %.3e)",
          s->name, impl, what, dname(dt), e, tol, scale);
    free(o);
}

/* ---------------------------------------------------------------------------------------------- */
/* Forward                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

static void test_forward(const built *c) {
    const spec *s = &c->s;
    const int64_t ny = s->B * s->n * s->qd;
    /* The oracle on the widened weights and inputs. */
    mha_config cf = c->cfg;
    cf.weight_dtype = F32;
    mha_weights w32 = {c->w[0].f, c->w[1].f, c->w[2].f, c->w[3].f, c->w[4].f, c->w[5].f,
                       c->w[6].f, c->w[7].f, c->w[8].f, NULL,      NULL};
    mha_forward_args af = fwd_args(c, 1, NULL);
    double *ref = malloc(sizeof(double) * (size_t)ny);
    CHECK(oracle_layer_dt(&cf, &w32, &af, act_dtype(s), ref, NULL) == 0, "[%s] oracle", s->name);
    const mha_impl impls[2] = {MHA_IMPL_REFERENCE, MHA_IMPL_AUTO};
    void *out = malloc(4 * (size_t)ny), *out1 = malloc(4 * (size_t)ny);
    float *y32 = malloc(sizeof(float) * (size_t)ny);
    mha_error err = {0};
    for (int k = 0; k < 2; k++) {
        const char *iname = k ? "auto" : "reference";
        mha_exec ex = {impls[k], 2, NULL, 0, NULL, NULL};
        mha_forward_args a = fwd_args(c, 0, out);
        CHECK_OK(mha_layer_forward(c->L, &a, &ex, &err), &err);
        /* Half intermediates: the oracle rounds them too, but a float32 value near a rounding
         * boundary may round the other way than the float64 one (one half-ulp of one element),
         * and the bf16 tile kernel (AUTO) rounds P: TOL_HALF_LAYER_C u_a (tolerance.h). */
        const int tile = k && s->xdt == BF16 && bf16_tile_cpu();
        if (half_act(s)) {
            float *o = malloc(sizeof(float) * (size_t)ny);
            mha__widen(s->odt, out, o, ny);
            const double r = test_max_abs_diff(o, ref, ny) / (unit(s->xdt) * test_max_abs(ref, ny));
            if (tile)
                g_worst_fwd_tile = fmax(g_worst_fwd_tile, r);
            else
                g_worst_fwd = fmax(g_worst_fwd, r);
            free(o);
        }
        check_close("forward", s, iname, s->odt, out, ref, ny,
                    TOL_OUT_REL + (half_act(s) ? (tile ? TOL_HALF_LAYER_TILE_C : TOL_HALF_LAYER_C) *
                                                     unit(s->xdt)
                                               : 0.0));
        mha_forward_args a32 = fwd_args(c, 1, y32);
        CHECK_OK(mha_layer_forward(c->L32, &a32, &ex, &err), &err);
        if (pair_gemm(s, impls[k]))
            g_pair_exempt++;
        else if (half_act(s)) {
            twin_forward(c, impls[k], out1);
            CHECK(memcmp(out, out1, mha__storage_size(s->odt) * (size_t)ny) == 0,
                  "[%s] %s forward: not its steps composed with the half roundings (twin)", s->name,
                  iname);
        } else
            CHECK(same_as_rounded(s->odt, out, y32, ny),
                  "[%s] %s forward: not the float32 layer's output on the widened values rounded "
                  "once to %s",
                  s->name, iname, dname(s->odt));
        /* The training forward computes the same output, bit for bit (the half roundings and
         * the core's kernel included). */
        mha_train_state *ts = NULL;
        a.out = out1;
        CHECK_OK(mha_layer_forward_train(c->L, &a, &ex, &ts, &err), &err);
        CHECK(memcmp(out, out1, mha__storage_size(s->odt) * (size_t)ny) == 0,
              "[%s] %s training forward differs from the forward", s->name, iname);
        mha_train_state_destroy(ts);
        a.out = out;
        /* With a caller workspace of the size asked for, the same bits. */
        size_t bytes = 0;
        CHECK_OK(mha_layer_forward_workspace_size(c->L, &a, &ex, &bytes, &err), &err);
        mha_exec exw = ex;
        exw.workspace = malloc(bytes ? bytes : 1);
        exw.workspace_bytes = bytes;
        a.out = out1;
        CHECK_OK(mha_layer_forward(c->L, &a, &exw, &err), &err);
        CHECK(memcmp(out, out1, mha__storage_size(s->odt) * (size_t)ny) == 0,
              "[%s] %s forward with a caller workspace differs", s->name, iname);
        free(exw.workspace);
        /* 1 thread gives the bits of 2. */
        ex.n_threads = 1;
        CHECK_OK(mha_layer_forward(c->L, &a, &ex, &err), &err);
        CHECK(memcmp(out, out1, mha__storage_size(s->odt) * (size_t)ny) == 0,
              "[%s] %s forward: 1 thread differs from 2", s->name, iname);
    }
    free(out), free(out1), free(y32), free(ref);
}

/* ---------------------------------------------------------------------------------------------- */
/* Training forward and backward                                                                  */
/* ---------------------------------------------------------------------------------------------- */

enum { NG = 11 }; /* d_query d_key dw_q dw_k dw_v dw_o db_q db_k db_v db_o d_sinks */

/* Training forward + backward of layer L on a (inputs of a.x_dtype), dy of a.out_dtype; grads
 * g[NG] (d_query / d_key of x_dtype, the rest float32). */
static int run_bwd(const built *c,
                   mha_layer *L,
                   int widened,
                   mha_impl impl,
                   int threads,
                   int accumulate,
                   void **g) {
    const spec *s = &c->s;
    void *y = malloc(4 * (size_t)(s->B * s->n * s->qd));
    mha_forward_args a = fwd_args(c, widened, y);
    mha_exec ex = {impl, threads, NULL, 0, NULL, NULL};
    mha_error err = {0};
    mha_train_state *st = NULL;
    mha_status rc = mha_layer_forward_train(L, &a, &ex, &st, &err);
    CHECK(rc == MHA_STATUS_OK, "[%s] forward_train: %s", s->name, err.message);
    if (!rc) {
        mha_layer_grads gr;
        memset(&gr, 0, sizeof gr);
        gr.d_query = g[0], gr.d_key = g[1];
        gr.dw_q = g[2], gr.dw_k = g[3], gr.dw_v = g[4], gr.dw_o = g[5];
        gr.db_q = g[6], gr.db_k = g[7], gr.db_v = g[8], gr.db_o = g[9], gr.d_sinks = g[10];
        gr.accumulate = accumulate;
        rc = mha_layer_backward(L, st, widened ? (const void *)c->dy.f : c->dy.st, &gr, &ex, &err);
        CHECK(rc == MHA_STATUS_OK, "[%s] backward: %s", s->name, err.message);
    }
    mha_train_state_destroy(st);
    free(y);
    return rc == MHA_STATUS_OK;
}

static void test_backward(const built *c) {
    const spec *s = &c->s;
    const mha_config *cfg = &c->cfg;
    const int64_t B = s->B, n = s->n, m = s->m ? s->m : s->n;
    const int64_t counts[NG] = {B * n * s->qd, s->m ? B * m * s->qd : 0,
                                c->w[0].n,     c->w[1].n,
                                c->w[2].n,     c->w[3].n,
                                c->w[4].n,     c->w[5].n,
                                c->w[6].n,     c->w[7].n,
                                c->w[8].n};
    const char *names[NG] = {"d_query", "d_key", "dw_q", "dw_k", "dw_v",   "dw_o",
                             "db_q",    "db_k",  "db_v", "db_o", "d_sinks"};
    /* The float64 oracle on the widened values. */
    double *wd[9];
    for (int i = 0; i < 9; i++)
        wd[i] = c->w[i].n ? to_d(c->w[i].f, c->w[i].n) : NULL;
    double *xq = to_d(c->xq.f, c->xq.n), *xk = s->m ? to_d(c->xk.f, c->xk.n) : NULL;
    double *dy = to_d(c->dy.f, c->dy.n);
    og_weights ow = {wd[0], wd[1], wd[2], wd[3], wd[4], wd[5], wd[6], wd[7], wd[8]};
    double *og[NG];
    for (int t = 0; t < NG; t++)
        og[t] = counts[t] ? malloc(sizeof(double) * (size_t)counts[t]) : NULL;
    og_layer_grads ogr = {og[0], og[1], NULL,  og[2], og[3], og[4],
                          og[5], og[6], og[7], og[8], og[9], og[10]};
    mha_masking mask = {0};
    mask.causal = s->causal;
    mha_dropout drop = {0};
    og_layer_backward(cfg, &ow, B, n, m, xq, xk, NULL, NULL, NULL, &mask, &drop, dy, &ogr);

    void *g[3][NG];
    for (int k = 0; k < 3; k++)
        for (int t = 0; t < NG; t++)
            g[k][t] = counts[t] ? calloc((size_t)counts[t], 4) : NULL;
    const mha_impl impls[2] = {MHA_IMPL_REFERENCE, MHA_IMPL_AUTO};
    for (int k = 0; k < 2; k++) {
        const char *iname = k ? "auto" : "reference";
        if (!run_bwd(c, c->L, 0, impls[k], 2, 0, g[0]) ||
            !run_bwd(c, c->L32, 1, impls[k], 2, 0, g[1]))
            continue;
        for (int t = 0; t < NG; t++) {
            if (!counts[t])
                continue;
            const mha_dtype dt = t < 2 ? s->xdt : F32; /* the inputs' gradients: their dtype */
            double scale = test_max_abs(og[t], counts[t]);
            if (t >= 6 && t <= 9 && og[t - 4]) /* a bias gradient: scale of its weight's */
                scale = fmax(scale, test_max_abs(og[t - 4], counts[t - 4]));
            float *gf = malloc(sizeof(float) * (size_t)counts[t]);
            mha__widen(dt, g[0][t], gf, counts[t]);
            const double e = test_max_abs_diff(gf, og[t], counts[t]);
            /* A half module: against the gradient of the unrounded layer (tolerance.h). */
            const double tol = (TOL_HALF_C * unit(dt) + TOL_HALF_LAYER_GRAD_C * unit(act_dtype(s)) +
                                TOL_GRAD_REL) *
                               scale;
            CHECK(e <= tol, "[%s] %s %s (%s): max err %.3e > tol %.3e", s->name, iname, names[t],
                  dname(dt), e, tol);
            if (half_act(s))
                g_worst_grad = fmax(g_worst_grad, e / (unit(act_dtype(s)) * scale));
            free(gf);
            if (!pair_gemm(s, impls[k]) && !half_act(s))
                CHECK(same_as_rounded(dt, g[0][t], g[1][t], counts[t]),
                      "[%s] %s %s: not the float32 layer's gradient on the widened values", s->name,
                      iname, names[t]);
        }
    }
    /* 1 thread gives the bits of 2 (auto). */
    if (run_bwd(c, c->L, 0, MHA_IMPL_AUTO, 1, 0, g[2])) {
        int same = 1;
        for (int t = 0; t < NG; t++)
            if (counts[t])
                same &= memcmp(g[0][t], g[2][t],
                               (t < 2 ? mha__storage_size(s->xdt) : 4) * (size_t)counts[t]) == 0;
        CHECK(same, "[%s] backward: 1 thread differs from 2", s->name);
    }
    /* accumulate into ones: a half input gradient is 1 + g in float32 rounded once, i.e. the
     * float32 layer's 1 + g rounded to the dtype (g[0], g[1] reused; auto, 2 threads). */
    for (int k = 0; k < 2; k++)
        for (int t = 0; t < NG; t++) {
            const mha_dtype dt = t < 2 && k == 0 ? s->xdt : F32;
            for (int64_t e = 0; e < counts[t]; e++)
                mha__store(dt, g[k][t], e, 1.0f);
        }
    if (pair_gemm(s, MHA_IMPL_AUTO) || half_act(s)) {
        /* A half module has no float32 twin: its float32 gradients are 1 + g exactly. */
        g_pair_exempt += pair_gemm(s, MHA_IMPL_AUTO);
        void *g0[NG];
        for (int t = 0; t < NG; t++)
            g0[t] = counts[t] ? calloc((size_t)counts[t], 4) : NULL;
        if (run_bwd(c, c->L, 0, MHA_IMPL_AUTO, 2, 0, g0) &&
            run_bwd(c, c->L, 0, MHA_IMPL_AUTO, 2, 1, g[0])) {
            int same = 1;
            for (int t = 2; t < NG; t++)
                for (int64_t e = 0; e < counts[t]; e++)
                    same &= ((float *)g[0][t])[e] == 1.0f + ((float *)g0[t])[e];
            CHECK(same, "[%s] backward accumulate: the float32 gradients are not 1 + g", s->name);
        }
        for (int t = 0; t < NG; t++)
            free(g0[t]);
    } else if (run_bwd(c, c->L, 0, MHA_IMPL_AUTO, 2, 1, g[0]) &&
               run_bwd(c, c->L32, 1, MHA_IMPL_AUTO, 2, 1, g[1])) {
        int same = 1;
        for (int t = 0; t < NG; t++)
            if (counts[t])
                same &= same_as_rounded(t < 2 ? s->xdt : F32, g[0][t], g[1][t], counts[t]);
        CHECK(same, "[%s] backward accumulate: not the float32 layer's 1 + g rounded once",
              s->name);
    }
    for (int k = 0; k < 3; k++)
        for (int t = 0; t < NG; t++)
            free(g[k][t]);
    for (int t = 0; t < NG; t++)
        free(og[t]);
    for (int i = 0; i < 9; i++)
        free(wd[i]);
    free(xq), free(xk), free(dy);
}

/* The layer's attention statistics with half inputs and weights: the float32 twin's on the
 * widened values, bit for bit (Q and K are projected into float32). */
static void test_stats(const built *c) {
    const spec *s = &c->s;
    const int64_t m = s->m ? s->m : s->n, cnt = s->B * s->h * s->n;
    float *ent = malloc(sizeof(float) * (size_t)cnt), *ent32 = malloc(sizeof(float) * (size_t)cnt);
    float *rec = malloc(sizeof(float) * (size_t)(s->B * s->h * m));
    float *rec32 = malloc(sizeof(float) * (size_t)(s->B * s->h * m));
    mha_attention_stats st = {0}, st32 = {0};
    st.entropy = ent, st.received = rec;
    st32.entropy = ent32, st32.received = rec32;
    mha_forward_args a = fwd_args(c, 0, NULL), a32 = fwd_args(c, 1, NULL);
    mha_error err = {0};
    CHECK_OK(mha_layer_attention_statistics(c->L, &a, &st, NULL, &err), &err);
    CHECK_OK(mha_layer_attention_statistics(c->L32, &a32, &st32, NULL, &err), &err);
    if (pair_gemm(s, MHA_IMPL_AUTO) || half_act(s)) {
        /* Q and K from the pair GEMM: the float32 twin's statistics up to float32 rounding; a
         * half module rounds Q and K (u_a relative each): up to TOL_HALF_LAYER_GRAD_C u_a. */
        g_pair_exempt += pair_gemm(s, MHA_IMPL_AUTO);
        double e = 0.0, sc = 0.0;
        for (int64_t i = 0; i < cnt; i++)
            e = fmax(e, fabs((double)ent[i] - (double)ent32[i])),
            sc = fmax(sc, fabs((double)ent32[i]));
        for (int64_t i = 0; i < s->B * s->h * m; i++)
            e = fmax(e, fabs((double)rec[i] - (double)rec32[i])),
            sc = fmax(sc, fabs((double)rec32[i]));
        const double u = unit(act_dtype(s));
        if (half_act(s))
            g_worst_stats = fmax(g_worst_stats, e / (u * sc));
        CHECK(e <= (TOL_OUT_REL + TOL_HALF_LAYER_GRAD_C * u) * sc,
              "[%s] attention statistics: %.3e from the float32 layer's", s->name, e);
    } else {
        CHECK(memcmp(ent, ent32, sizeof(float) * (size_t)cnt) == 0 &&
                  memcmp(rec, rec32, sizeof(float) * (size_t)(s->B * s->h * m)) == 0,
              "[%s] attention statistics differ from the float32 layer's", s->name);
    }
    free(ent), free(ent32), free(rec), free(rec32);
}

/* ---------------------------------------------------------------------------------------------- */
/* mha_layer_project and its backward (float32 x, y; the layer's weights in their dtype)          */
/* ---------------------------------------------------------------------------------------------- */

static void test_project(const built *c) {
    const spec *s = &c->s;
    const int64_t hd = s->h * s->dk, gd = s->g * s->dk;
    const int64_t ins[4] = {s->qd, s->qd, s->qd, hd}, outs[4] = {hd, gd, gd, s->qd};
    test_rng r;
    test_rng_seed(&r, 99);
    mha_error err = {0};
    for (int p = 0; p < 4; p++)
        for (int64_t rows = 2; rows <= 20; rows += 18) { /* the few-rows path, then packed */
            const int64_t in = ins[p], out = outs[p];
            float *x = malloc(sizeof(float) * (size_t)(rows * in));
            float *dy = malloc(sizeof(float) * (size_t)(rows * out));
            float *y = malloc(sizeof(float) * (size_t)(rows * out));
            float *y32 = malloc(sizeof(float) * (size_t)(rows * out));
            float *dx = malloc(sizeof(float) * (size_t)(rows * in));
            float *dx32 = malloc(sizeof(float) * (size_t)(rows * in));
            test_fill_normal(&r, x, rows * in, 1.0f);
            test_fill_normal(&r, dy, rows * out, 1.0f);
            for (int k = 0; k < 2; k++) {
                mha_exec ex = {k ? MHA_IMPL_AUTO : MHA_IMPL_REFERENCE, 2, NULL, 0, NULL, NULL};
                CHECK_OK(mha_layer_project(c->L, (mha_projection)p, rows, x, y, &ex, &err), &err);
                CHECK_OK(mha_layer_project(c->L32, (mha_projection)p, rows, x, y32, &ex, &err),
                         &err);
                CHECK(memcmp(y, y32, sizeof(float) * (size_t)(rows * out)) == 0,
                      "[%s] project %d rows %lld impl %d: differs from the float32 layer", s->name,
                      p, (long long)rows, k);
                /* Against float64 on the widened weights. */
                const float *wf = c->w[p].f, *bf = c->w[4 + p].f;
                double *ref = malloc(sizeof(double) * (size_t)(rows * out));
                for (int64_t i = 0; i < rows; i++)
                    for (int64_t o = 0; o < out; o++) {
                        double acc = bf ? (double)bf[o] : 0.0;
                        for (int64_t e = 0; e < in; e++)
                            acc += (double)x[i * in + e] * (double)wf[o * in + e];
                        ref[i * out + o] = acc;
                    }
                check_close("project", s, k ? "auto" : "reference", F32, y, ref, rows * out,
                            TOL_OUT_REL);
                free(ref);
                CHECK_OK(mha_layer_project_backward(c->L, (mha_projection)p, rows, x, dy, dx, NULL,
                                                    NULL, 0, &ex, &err),
                         &err);
                CHECK_OK(mha_layer_project_backward(c->L32, (mha_projection)p, rows, x, dy, dx32,
                                                    NULL, NULL, 0, &ex, &err),
                         &err);
                CHECK(memcmp(dx, dx32, sizeof(float) * (size_t)(rows * in)) == 0,
                      "[%s] project_backward %d rows %lld impl %d: dx differs from float32",
                      s->name, p, (long long)rows, k);
            }
            free(x), free(dy), free(y), free(y32), free(dx), free(dx32);
        }
}

/* ---------------------------------------------------------------------------------------------- */
/* Decode step with half weights                                                                  */
/* ---------------------------------------------------------------------------------------------- */

static void test_decode(const built *c) {
    const spec *s = &c->s;
    if (s->m) /* the decode step is causal self-attention */
        return;
    const int64_t S = s->B, L = s->n, prompt = L - 2, qd = s->qd;
    mha_error err = {0};
    mha_kv_cache_config kc = {0};
    kc.max_seq = L;
    kc.batch = S;
    mha_kv_cache *cache = NULL, *cache32 = NULL;
    CHECK_OK(mha_kv_cache_create(&kc, c->L, NULL, &cache, &err), &err);
    CHECK_OK(mha_kv_cache_create(&kc, c->L32, NULL, &cache32, &err), &err);
    float *x = malloc(sizeof(float) * (size_t)(S * L * qd));
    float *out = malloc(sizeof(float) * (size_t)(S * L * qd));
    float *out32 = malloc(sizeof(float) * (size_t)(S * L * qd));
    float *tmp = malloc(sizeof(float) * (size_t)(S * L * qd));
    /* x: the widened query rows (so the oracle's full forward sees the same tokens). */
    mha__widen(s->xdt, c->xq.st, x, S * L * qd);
    if (!cache || !cache32)
        goto done;
    for (int64_t t0 = 0; t0 < L;) {
        const int64_t t = t0 == 0 ? prompt : 1;
        for (int64_t b = 0; b < S; b++)
            memcpy(tmp + b * t * qd, x + (b * L + t0) * qd, sizeof(float) * (size_t)(t * qd));
        mha_decode_args d = {S, NULL, t, tmp, NULL, NULL};
        float *o = malloc(sizeof(float) * (size_t)(S * t * qd));
        float *o32 = malloc(sizeof(float) * (size_t)(S * t * qd));
        mha_exec ex = {MHA_IMPL_AUTO, 2, NULL, 0, NULL, NULL};
        d.out = o;
        CHECK_OK(t0 ? mha_layer_decode_step(c->L, cache, &d, &ex, &err)
                    : mha_layer_prefill(c->L, cache, &d, &ex, &err),
                 &err);
        d.out = o32;
        CHECK_OK(t0 ? mha_layer_decode_step(c->L32, cache32, &d, &ex, &err)
                    : mha_layer_prefill(c->L32, cache32, &d, &ex, &err),
                 &err);
        CHECK(memcmp(o, o32, sizeof(float) * (size_t)(S * t * qd)) == 0,
              "[%s] decode at %lld: differs from the float32 layer", s->name, (long long)t0);
        for (int64_t b = 0; b < S; b++) {
            memcpy(out + (b * L + t0) * qd, o + b * t * qd, sizeof(float) * (size_t)(t * qd));
            memcpy(out32 + (b * L + t0) * qd, o32 + b * t * qd, sizeof(float) * (size_t)(t * qd));
        }
        free(o), free(o32);
        t0 += t;
    }
    {
        /* Against the float64 oracle of the full causal forward over the whole sequence. */
        mha_config cf = c->cfg;
        cf.weight_dtype = F32;
        mha_weights w32 = {c->w[0].f, c->w[1].f, c->w[2].f, c->w[3].f, c->w[4].f, c->w[5].f,
                           c->w[6].f, c->w[7].f, c->w[8].f, NULL,      NULL};
        mha_forward_args a;
        memset(&a, 0, sizeof a);
        a.batch = S, a.q_len = L, a.query = x, a.mask.causal = 1;
        double *ref = malloc(sizeof(double) * (size_t)(S * L * qd));
        CHECK(oracle_layer(&cf, &w32, &a, ref, NULL) == 0, "[%s] oracle", s->name);
        check_close("decode", s, "auto", F32, out, ref, S * L * qd, TOL_OUT_REL);
        free(ref);
    }
done:
    free(x), free(out), free(out32), free(tmp);
    mha_kv_cache_destroy(cache);
    mha_kv_cache_destroy(cache32);
}

/* ---------------------------------------------------------------------------------------------- */
/* Half modules with QK-norm, temperature tuning or an output gate                                */
/* ---------------------------------------------------------------------------------------------- */

/* A half module (x, W and out in dt) with the extra stages: each stage's result is rounded to dt
 * (docs/SEMANTICS.md "Half precision in the layer"). */
typedef struct stage_spec {
    const char *name;
    mha_qk_norm_kind nrm;
    int unit_offset, temp, gate;
    mha_rope_style rope;
    mha_dtype dt;
} stage_spec;

// clang-format off
static const stage_spec STAGES[] = {
    /* name                     norm                        offset temp gate rope             dtype */
    {"bf16_rms_head_rope",      MHA_QK_NORM_RMS_HEAD,      0,     0,   0,   MHA_ROPE_HALF,   BF16},
    {"f16_rms_head_rope",       MHA_QK_NORM_RMS_HEAD,      0,     0,   0,   MHA_ROPE_HALF,   F16 },
    {"bf16_rms_head_offset",    MHA_QK_NORM_RMS_HEAD,      1,     0,   0,   MHA_ROPE_HALF,   BF16},
    {"bf16_rms_all_rope",       MHA_QK_NORM_RMS_ALL,       0,     0,   0,   MHA_ROPE_HALF,   BF16},
    {"f16_rms_all_nope",        MHA_QK_NORM_RMS_ALL,       0,     0,   0,   MHA_ROPE_NONE,   F16 },
    {"bf16_l2_rope",            MHA_QK_NORM_L2_AFTER_ROPE, 0,     0,   0,   MHA_ROPE_HALF,   BF16},
    {"f16_l2_rope",             MHA_QK_NORM_L2_AFTER_ROPE, 0,     0,   0,   MHA_ROPE_HALF,   F16 },
    {"bf16_temp_nope",          MHA_QK_NORM_NONE,          0,     1,   0,   MHA_ROPE_NONE,   BF16},
    {"f16_temp_nope",           MHA_QK_NORM_NONE,          0,     1,   0,   MHA_ROPE_NONE,   F16 },
    {"bf16_l2_temp_nope",       MHA_QK_NORM_L2_AFTER_ROPE, 0,     1,   0,   MHA_ROPE_NONE,   BF16},
    {"bf16_gate_rms_head_rope", MHA_QK_NORM_RMS_HEAD,      1,     0,   1,   MHA_ROPE_HALF,   BF16},
    {"f16_gate_rope",           MHA_QK_NORM_NONE,          0,     0,   1,   MHA_ROPE_HALF,   F16 },
    {"bf16_gate_nope",          MHA_QK_NORM_NONE,          0,     0,   1,   MHA_ROPE_NONE,   BF16},
    {"f16_all_stages",          MHA_QK_NORM_L2_AFTER_ROPE, 0,     1,   1,   MHA_ROPE_HALF,   F16 },
    {"bf16_all_stages",         MHA_QK_NORM_RMS_HEAD,      0,     1,   1,   MHA_ROPE_HALF,   BF16},
};
// clang-format on
#define N_STAGES ((int)(sizeof STAGES / sizeof STAGES[0]))

/* The stage cases' shape: self-attention, GQA, causal, biases. */
enum { SB = 2, SN = 9, SQD = 32, SH = 4, SG = 2, SDK = 8 };

/* The stage module's forward composed of its steps, each result rounded to dt (round_f32 is
 * idempotent, so rounding after every step is the contract's "each stored result rounded"):
 * projections, [RMS norm], [RoPE], [L2 norm], [temperature], the core on half Q, K, V into a half
 * A, [A = round(A sigmoid(round(G)))], y = A W_o^T + b_o rounded to dt. */
static void stage_twin(mha_layer *L,
                       const stage_spec *s,
                       const void *x,
                       mha_impl impl,
                       void *out,
                       float *q_core,
                       float *k_core,
                       float *a_proj) {
    const mha_config *cfg = mha_layer_config(L);
    const mha__layer_w *cw = mha__layer_compute_weights(L);
    const mha_dtype dt = s->dt;
    const int64_t B = SB, n = SN, hd = SH * SDK, gd = SG * SDK;
    float *q = malloc(sizeof(float) * B * n * hd), *k = malloc(sizeof(float) * B * n * gd);
    float *v = malloc(sizeof(float) * B * n * gd), *a32 = malloc(sizeof(float) * B * n * hd);
    float *gt = malloc(sizeof(float) * B * n * hd), *y = malloc(sizeof(float) * B * n * SQD);
    uint16_t *qh = malloc(2 * B * n * hd), *kh = malloc(2 * B * n * gd);
    uint16_t *vh = malloc(2 * B * n * gd), *ah = malloc(2 * B * n * hd);
    const mha__team team = {1, NULL};
    mha_error err = {0};
    CHECK_OK(mha__plan_project(impl, NULL, team, x, dt, cw->w_q, dt, cw->b_q, q, B * n, SQD, hd,
                               NULL, 0, &err),
             &err);
    CHECK_OK(mha__plan_project(impl, NULL, team, x, dt, cw->w_k, dt, cw->b_k, k, B * n, SQD, gd,
                               NULL, 0, &err),
             &err);
    CHECK_OK(mha__plan_project(impl, NULL, team, x, dt, cw->w_v, dt, cw->b_v, v, B * n, SQD, gd,
                               NULL, 0, &err),
             &err);
    round_f32(dt, q, B * n * hd);
    round_f32(dt, k, B * n * gd);
    mha__plan_qk_norm_stage(cfg, cw, 0, q, B * n, k, B * n);
    round_f32(dt, q, B * n * hd);
    round_f32(dt, k, B * n * gd);
    if (s->rope != MHA_ROPE_NONE) {
        double tab[64 * 3];
        const int64_t len = mha__plan_rope_length(&cfg->rope, NULL, NULL, NULL, B, n, n);
        mha__plan_rope(&cfg->rope, len, tab, q, B, n, SH, SDK, NULL, NULL, 1);
        mha__plan_rope(&cfg->rope, len, tab, k, B, n, SG, SDK, NULL, NULL, 1);
        round_f32(dt, q, B * n * hd);
        round_f32(dt, k, B * n * gd);
    }
    mha__plan_qk_norm_stage(cfg, cw, 1, q, B * n, k, B * n);
    round_f32(dt, q, B * n * hd);
    round_f32(dt, k, B * n * gd);
    mha__plan_temperature(&cfg->temperature, q, B, n, SH, SDK, NULL, NULL);
    mha__narrow(dt, q, qh, B * n * hd);
    mha__narrow(dt, k, kh, B * n * gd);
    mha__narrow(dt, v, vh, B * n * gd);
    mha__widen(dt, qh, q_core, B * n * hd); /* what the core reads, for the statistics */
    mha__widen(dt, kh, k_core, B * n * gd);
    mha_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.batch = B, fa.q_len = n, fa.query = x, fa.x_dtype = dt, fa.out_dtype = dt;
    fa.mask.causal = 1;
    mha_attention_args core;
    mha__plan_core_args(cfg, cw->sinks, &fa, n, qh, kh, vh, ah, NULL, dt, &core);
    mha_exec ex = {impl, 2, NULL, 0, NULL, NULL};
    CHECK_OK(mha_attention(&core, &ex, &err), &err);
    if (s->gate) {
        const void *wg;
        const float *bg;
        mha__plan_gate_weights(cfg, cw, &wg, &bg);
        CHECK_OK(mha__plan_project(impl, NULL, team, x, dt, wg, dt, bg, gt, B * n, SQD, hd, NULL, 0,
                                   &err),
                 &err);
        round_f32(dt, gt, B * n * hd);
        mha__widen(dt, ah, a32, B * n * hd);
        mha__plan_gate_apply(gt, a32, B * n * hd);
        mha__narrow(dt, a32, ah, B * n * hd);
    }
    mha__widen(dt, ah, a_proj, B * n * hd); /* what the output projection reads */
    CHECK_OK(mha__plan_project(impl, NULL, team, ah, dt, cw->w_o, dt, cw->b_o, y, B * n, hd, SQD,
                               NULL, 0, &err),
             &err);
    mha__narrow(dt, y, out, B * n * SQD);
    free(q), free(k), free(v), free(a32), free(gt), free(y), free(qh), free(kh), free(vh), free(ah);
}

/* One stage case: the forward against its twin (bits) and the float64 oracle rounding at the same
 * points (TOL_HALF_C u + TOL_HALF_LAYER_C u (+ tile) + TOL_OUT_REL), the training forward's bits,
 * 1 thread = 2 threads, and the backward's gradients against the float32 layer's on the same
 * (widened) values at TOL_HALF_LAYER_GRAD_C u (each rounding differentiated as the identity). */
static void test_stage(const stage_spec *s, uint64_t seed) {
    test_rng r;
    test_rng_seed(&r, seed);
    const mha_dtype dt = s->dt;
    const int64_t hd = SH * SDK, gd = SG * SDK, qrows = s->gate ? 2 * hd : hd;
    const int64_t nw = s->nrm == MHA_QK_NORM_RMS_HEAD ? SDK : s->nrm == MHA_QK_NORM_RMS_ALL ? 1 : 0;
    const int64_t sizes[11] = {qrows * SQD,
                               gd * SQD,
                               gd * SQD,
                               SQD * hd,
                               qrows,
                               gd,
                               gd,
                               SQD,
                               0,
                               nw == SDK ? SDK
                               : nw      ? hd
                                         : 0,
                               nw == SDK ? SDK
                               : nw      ? gd
                                         : 0};
    tensor t[11];
    for (int i = 0; i < 11; i++)
        t[i] = make_tensor(&r, dt, sizes[i], i < 4 ? (float)(1.2 / sqrt((double)SQD)) : 0.5f);
    for (int i = 9; i < 11; i++) /* norm weights near 1 (0 with the unit offset) */
        for (int64_t j = 0; j < sizes[i] && !s->unit_offset; j++) {
            float one = 1.0f + 0.25f * t[i].f[j];
            mha__narrow(dt, &one, (char *)t[i].st + 2 * j, 1);
            mha__widen(dt, (char *)t[i].st + 2 * j, &t[i].f[j], 1);
        }
    const int64_t ny = SB * SN * SQD;
    tensor x = make_tensor(&r, dt, ny, 1.0f), dy = make_tensor(&r, dt, ny, 1.0f);
    mha_config cfg = {0};
    cfg.q_dim = SQD, cfg.num_heads = SH, cfg.num_kv_heads = SG, cfg.head_dim = SDK;
    cfg.bias_q = cfg.bias_k = cfg.bias_v = cfg.bias_o = 1;
    cfg.rope.style = s->rope;
    cfg.qk_norm.kind = s->nrm, cfg.qk_norm.eps = 1e-6, cfg.qk_norm.unit_offset = s->unit_offset;
    cfg.temperature.enabled = s->temp, cfg.temperature.floor_scale = 4.0;
    cfg.temperature.attn_scale = 0.3;
    cfg.output_gate = s->gate;
    const void *p[11], *p32[11];
    for (int i = 0; i < 11; i++)
        p[i] = sizes[i] ? t[i].st : NULL, p32[i] = sizes[i] ? t[i].f : NULL;
    mha_weights w = {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], NULL, p[9], p[10]};
    mha_weights w32 = {p32[0], p32[1], p32[2], p32[3], p32[4], p32[5],
                       p32[6], p32[7], NULL,   p32[9], p32[10]};
    mha_error err = {0};
    mha_layer *L = NULL, *L32 = NULL;
    cfg.weight_dtype = dt;
    CHECK_OK(mha_layer_create(&cfg, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err);
    cfg.weight_dtype = F32;
    CHECK_OK(mha_layer_create(&cfg, &w32, MHA_WEIGHTS_BORROW, NULL, &L32, &err), &err);
    if (!L || !L32)
        goto done;

    /* The oracle on the widened weights and input, rounding at the same points. */
    mha_config cf = *mha_layer_config(L32);
    mha_forward_args af;
    memset(&af, 0, sizeof af);
    af.batch = SB, af.q_len = SN, af.query = x.f, af.mask.causal = 1;
    double *ref = malloc(sizeof(double) * ny);
    CHECK(oracle_layer_dt(&cf, &w32, &af, dt, ref, NULL) == 0, "[%s] oracle", s->name);
    void *out = malloc(2 * ny), *out1 = malloc(2 * ny);
    float *o = malloc(sizeof(float) * ny);
    float *qc = malloc(sizeof(float) * SB * SN * hd), *kc = malloc(sizeof(float) * SB * SN * gd);
    float *ac = malloc(sizeof(float) * SB * SN * hd);
    const mha_impl impls[2] = {MHA_IMPL_REFERENCE, MHA_IMPL_AUTO};
    for (int k = 0; k < 2; k++) {
        const char *iname = k ? "auto" : "reference";
        mha_exec ex = {impls[k], 2, NULL, 0, NULL, NULL};
        mha_forward_args a = af;
        a.query = x.st, a.x_dtype = dt, a.out_dtype = dt, a.out = out;
        CHECK_OK(mha_layer_forward(L, &a, &ex, &err), &err);
        stage_twin(L, s, x.st, impls[k], out1, qc, kc, ac);
        CHECK(memcmp(out, out1, 2 * ny) == 0,
              "[%s] %s forward: not its steps composed with the half roundings (twin)", s->name,
              iname);
        /* The layer's statistics: the core's statistics on the twin's rounded Q and K, bits. */
        {
            float ent[SB * SH * SN] = {0}, rec[SB * SH * SN] = {0}, ent1[SB * SH * SN] = {0},
                                rec1[SB * SH * SN] = {0};
            mha_attention_stats st = {0}, st1 = {0};
            st.entropy = ent, st.received = rec, st1.entropy = ent1, st1.received = rec1;
            CHECK_OK(mha_layer_attention_statistics(L, &a, &st, &ex, &err), &err);
            mha_attention_args core;
            mha__plan_core_args(mha_layer_config(L), mha__layer_compute_weights(L)->sinks, &af, SN,
                                qc, kc, NULL, NULL, NULL, F32, &core);
            CHECK_OK(mha_attention_statistics(&core, &st1, &ex, &err), &err);
            CHECK(memcmp(ent, ent1, sizeof ent) == 0 && memcmp(rec, rec1, sizeof rec) == 0,
                  "[%s] %s statistics: not the core's on the forward's rounded Q and K", s->name,
                  iname);
        }
        const int tile = k && dt == BF16 && bf16_tile_cpu();
        mha__widen(dt, out, o, ny);
        const double e = test_max_abs_diff(o, ref, ny), scale = test_max_abs(ref, ny);
        const double c = tile ? TOL_HALF_LAYER_TILE_C : TOL_HALF_LAYER_C;
        if (tile)
            g_worst_fwd_tile = fmax(g_worst_fwd_tile, e / (unit(dt) * scale));
        else
            g_worst_fwd = fmax(g_worst_fwd, e / (unit(dt) * scale));
        const double tol = ((TOL_HALF_C + c) * unit(dt) + TOL_OUT_REL) * scale;
        CHECK(e <= tol && scale > 0.0, "[%s] %s forward vs oracle: max err %.3e > tol %.3e",
              s->name, iname, e, tol);
        /* The training forward's bits; 1 thread's bits. */
        mha_train_state *ts = NULL;
        a.out = out1;
        CHECK_OK(mha_layer_forward_train(L, &a, &ex, &ts, &err), &err);
        CHECK(memcmp(out, out1, 2 * ny) == 0, "[%s] %s training forward differs from the forward",
              s->name, iname);
        ex.n_threads = 1;
        memset(out1, 0, 2 * ny);
        CHECK_OK(mha_layer_forward(L, &a, &ex, &err), &err);
        CHECK(memcmp(out, out1, 2 * ny) == 0, "[%s] %s forward: 1 thread differs from 2", s->name,
              iname);
        /* The backward against the float32 layer's (unrounded intermediates) on the same values:
         * d_query, dw_q, dw_o and the norm weights' gradients. */
        mha_train_state *ts32 = NULL;
        float *y32 = malloc(sizeof(float) * ny);
        mha_forward_args a32 = af;
        a32.out = y32;
        CHECK_OK(mha_layer_forward_train(L32, &a32, &ex, &ts32, &err), &err);
        const int64_t gn[4] = {ny, qrows * SQD, SQD * hd, sizes[9] ? sizes[9] : 1};
        float *gh[4], *gf[4];
        void *dq = malloc(2 * ny);
        for (int i = 0; i < 4; i++)
            gh[i] = calloc((size_t)gn[i], sizeof(float)), gf[i] = calloc((size_t)gn[i], 4);
        mha_layer_grads gr, gr32;
        memset(&gr, 0, sizeof gr);
        gr.d_query = dq, gr.dw_q = gh[1], gr.dw_o = gh[2], gr.d_q_norm = sizes[9] ? gh[3] : NULL;
        memset(&gr32, 0, sizeof gr32);
        gr32.d_query = gf[0], gr32.dw_q = gf[1], gr32.dw_o = gf[2];
        gr32.d_q_norm = sizes[9] ? gf[3] : NULL;
        if (ts && ts32) {
            CHECK_OK(mha_layer_backward(L, ts, dy.st, &gr, &ex, &err), &err);
            CHECK_OK(mha_layer_backward(L32, ts32, dy.f, &gr32, &ex, &err), &err);
            mha__widen(dt, dq, gh[0], ny);
            const char *gname[4] = {"d_query", "dw_q", "dw_o", "d_q_norm"};
            for (int i = 0; i < (sizes[9] ? 4 : 3); i++) {
                double *gd64 = to_d(gf[i], gn[i]);
                const double ge = test_max_abs_diff(gh[i], gd64, gn[i]);
                const double gs = test_max_abs(gd64, gn[i]);
                /* d_query is stored in dt: its own rounding too. */
                const double gtol =
                    ((TOL_HALF_LAYER_GRAD_C + (i == 0 ? TOL_HALF_C : 0.0)) * unit(dt) +
                     TOL_OUT_REL) *
                    gs;
                g_worst_grad = fmax(g_worst_grad, ge / (unit(dt) * gs));
                CHECK(ge <= gtol && gs > 0.0, "[%s] %s %s: max err %.3e > tol %.3e", s->name, iname,
                      gname[i], ge, gtol);
                free(gd64);
            }
        }
        /* dw_o = dy^T A_g reads the stored (rounded) A_g the forward projected: float64 on the
         * twin's A_g, float32 error only (an unrounded A_g would be u_a off). */
        if (ts && ts32) {
            double ew = 0.0, sc = 0.0;
            for (int64_t oo = 0; oo < SQD; oo++)
                for (int64_t j = 0; j < hd; j++) {
                    double acc = 0.0, mag = 0.0;
                    for (int64_t rr = 0; rr < SB * SN; rr++) {
                        const double term = (double)dy.f[rr * SQD + oo] * (double)ac[rr * hd + j];
                        acc += term;
                        mag += fabs(term);
                    }
                    ew = fmax(ew, fabs((double)gh[2][oo * hd + j] - acc));
                    sc = fmax(sc, mag);
                }
            CHECK(ew <= TOL_OUT_REL * sc, "[%s] %s dw_o: %.3e from dy^T A_g (stored A_g) > %.3e",
                  s->name, iname, ew, TOL_OUT_REL * sc);
        }
        for (int i = 0; i < 4; i++)
            free(gh[i]), free(gf[i]);
        free(dq), free(y32);
        mha_train_state_destroy(ts);
        mha_train_state_destroy(ts32);
    }
    free(out), free(out1), free(o), free(ref), free(qc), free(kc), free(ac);
done:
    for (int i = 0; i < 11; i++)
        free_tensor(&t[i]);
    free_tensor(&x);
    free_tensor(&dy);
    mha_layer_destroy(L);
    mha_layer_destroy(L32);
}

/* ---------------------------------------------------------------------------------------------- */
/* Hostile dtypes and half weights that are not finite                                            */
/* ---------------------------------------------------------------------------------------------- */

static void test_hostile(void) {
    mha_config cfg = {0};
    cfg.q_dim = 8, cfg.num_heads = 2, cfg.bias_q = 1;
    uint16_t w[64], b[8];
    for (int i = 0; i < 64; i++)
        w[i] = mha__f32_to_bf16(0.01f * (float)(i % 7));
    for (int i = 0; i < 8; i++)
        b[i] = mha__f32_to_bf16(0.5f);
    mha_weights wt = {w, w, w, w, b, NULL, NULL, NULL, NULL, NULL, NULL};
    mha_layer *L = NULL;
    mha_error err = {0};
    const mha_dtype bad[4] = {MHA_DTYPE_F64, MHA_DTYPE_BOOL, MHA_DTYPE_I32, (mha_dtype)99};
    for (int i = 0; i < 4; i++) {
        cfg.weight_dtype = bad[i];
        const mha_status st = mha_layer_create(&cfg, &wt, MHA_WEIGHTS_BORROW, NULL, &L, &err);
        CHECK(st == MHA_STATUS_INVALID_ARG && !L && strstr(err.message, "config.weight_dtype"),
              "weight_dtype %d refused naming the field: %s", (int)bad[i], err.message);
    }
    /* A NaN bf16 weight and an Inf f16 bias, read as halves: refused with tensor and index. */
    cfg.weight_dtype = BF16;
    w[37] = 0x7FC1;
    CHECK(mha_layer_create(&cfg, &wt, MHA_WEIGHTS_BORROW, NULL, &L, &err) ==
                  MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "weights.w_q[37]"),
          "a NaN bf16 weight is refused: %s", err.message);
    w[37] = mha__f32_to_bf16(0.25f);
    uint16_t wf16[64], bf16_inf[8];
    for (int i = 0; i < 64; i++)
        wf16[i] = mha__f32_to_f16(0.01f * (float)(i % 5));
    for (int i = 0; i < 8; i++)
        bf16_inf[i] = mha__f32_to_f16(-65504.0f); /* finite: the largest f16 */
    bf16_inf[5] = 0xFC00;                         /* -Inf in f16 */
    mha_weights wh = {wf16, wf16, wf16, wf16, bf16_inf, NULL, NULL, NULL, NULL, NULL, NULL};
    cfg.weight_dtype = F16;
    CHECK(mha_layer_create(&cfg, &wh, MHA_WEIGHTS_BORROW, NULL, &L, &err) ==
                  MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "weights.b_q[5]"),
          "an Inf f16 bias is refused: %s", err.message);
    bf16_inf[5] = mha__f32_to_f16(1.0f);
    CHECK_OK(mha_layer_create(&cfg, &wh, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err);
    if (!L)
        return;
    /* Activation dtypes. */
    uint16_t x[2 * 3 * 8] = {0}, out[2 * 3 * 8];
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.batch = 2, a.q_len = 3, a.query = x, a.out = out, a.x_dtype = BF16, a.out_dtype = F16;
    CHECK_OK(mha_layer_forward(L, &a, NULL, &err), &err);
    for (int i = 0; i < 4; i++) {
        a.x_dtype = bad[i];
        CHECK(mha_layer_forward(L, &a, NULL, &err) == MHA_STATUS_INVALID_ARG &&
                  strstr(err.message, "args.x_dtype"),
              "x_dtype %d refused naming the field: %s", (int)bad[i], err.message);
        a.x_dtype = BF16;
        a.out_dtype = bad[i];
        CHECK(mha_layer_forward(L, &a, NULL, &err) == MHA_STATUS_INVALID_ARG &&
                  strstr(err.message, "args.out_dtype"),
              "out_dtype %d refused naming the field: %s", (int)bad[i], err.message);
        a.out_dtype = F16;
    }
    /* A half out of n*out_dim halves may sit right after the input (no overlap); one element
     * into it is an overlap. */
    uint16_t buf[2 * 2 * 3 * 8];
    a.query = buf, a.out = buf + 2 * 3 * 8;
    CHECK_OK(mha_layer_forward(L, &a, NULL, &err), &err);
    a.out = buf + 2 * 3 * 8 - 1;
    CHECK(mha_layer_forward(L, &a, NULL, &err) == MHA_STATUS_INVALID_ARG,
          "out overlapping a half query by one element is refused: %s", err.message);
    mha_layer_destroy(L);
}

int main(void) {
    for (int i = 0; i < N_SPECS; i++) {
        built c;
        if (build(&SPECS[i], 1000 + (uint64_t)i, &c)) {
            test_forward(&c);
            test_backward(&c);
            test_stats(&c);
            test_project(&c);
            test_decode(&c);
        }
        unbuild(&c);
    }
    const double worst_plain[3] = {g_worst_fwd, g_worst_fwd_tile, g_worst_grad};
    g_worst_fwd = g_worst_fwd_tile = g_worst_grad = 0.0;
    for (int i = 0; i < N_STAGES; i++)
        test_stage(&STAGES[i], 2000 + (uint64_t)i);
    printf("half modules with QK-norm / temperature / gate, worst error / (u_a max|ref|): forward "
           "%.3f, with the bf16 tile kernel %.3f, gradients (vs the float32 layer) %.3f\n",
           g_worst_fwd, g_worst_fwd_tile, g_worst_grad);
    g_worst_fwd = fmax(g_worst_fwd, worst_plain[0]);
    g_worst_fwd_tile = fmax(g_worst_fwd_tile, worst_plain[1]);
    g_worst_grad = fmax(g_worst_grad, worst_plain[2]);
    test_hostile();
    if (g_pair_exempt)
        printf("%d bf16-bf16 checks of AUTO ran the vdpbf16ps pair GEMM: float64 oracle only, "
               "not the float32 twin's bits (the kernel: test_gemm)\n",
               g_pair_exempt);
    printf("half modules, worst error / (u_a max|ref|): forward %.3f (bound TOL_HALF_C + "
           "TOL_HALF_LAYER_C = %.1f), with the bf16 tile kernel %.3f (%.1f), gradients %.3f "
           "(TOL_HALF_LAYER_GRAD_C %.1f), statistics %.3f\n",
           g_worst_fwd, TOL_HALF_C + TOL_HALF_LAYER_C, g_worst_fwd_tile,
           TOL_HALF_C + TOL_HALF_LAYER_TILE_C, g_worst_grad, TOL_HALF_LAYER_GRAD_C, g_worst_stats);
    return test_finish();
}
