/* SPDX-License-Identifier: MIT */
/* test_ring_layer.c: the distributed layer (mha_ring_layer_forward, mha_mpi.h) against the
 * single-process layer. Run by ctest under mpirun with 1 to 3 processes. Every rank makes the
 * same seeded layer and global input x [B, N, q_dim], runs mha_layer_forward on the whole
 * sequence, then its rows through mha_ring_layer_forward, and checks them with the layer's gate
 * (tests/common/tolerance.h): max|y - y_1| <= TOL_OUT_REL max|y_1| over its rows. Cases: both
 * layouts, causal or not, windows, GQA, biases, RoPE (both styles, partial rotary_dim) at global
 * positions and at caller positions, d_v != d_k, learned sinks, uneven N; and the backward
 * (mha_ring_layer_backward vs mha_layer_backward: dx rows, weight and bias gradients, each within
 * TOL_GRAD_REL max|g_1|, and accumulate). Errors: a bad argument on one rank
 * (cross-attention, a wrong local length) gives every rank the same error; key padding: the
 * ring's UNSUPPORTED on every rank, or (once the ring supports it) the single-process result. Each
 * rank prints its "N passed, N failed". */
#include "harness.h"
#include "mha_mpi.h"
#include "tolerance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int g_rank, g_size;

typedef struct layer_case {
    int64_t B, n, q_dim, h, g, dk, dv;
    int bias, causal;
    mha_shard_layout layout;
    mha_rope_style rope;
    int64_t rotary_dim;
    int64_t window[2]; /* use_window when left != -2 */
    int positions;     /* caller positions: global index * 3 + 7 */
    int sinks;         /* the layer has learned sinks */
} layer_case;

/* A seeded layer of case c (the same on every rank). */
static mha_layer *make_layer(const layer_case *c, float **wbuf) {
    mha_config cfg = {0};
    cfg.q_dim = c->q_dim, cfg.num_heads = c->h, cfg.num_kv_heads = c->g;
    cfg.head_dim = c->dk, cfg.v_head_dim = c->dv;
    cfg.bias_q = cfg.bias_k = cfg.bias_v = cfg.bias_o = c->bias;
    cfg.rope.style = c->rope, cfg.rope.rotary_dim = c->rotary_dim;
    const int64_t sz[9] = {c->h * c->dk * c->q_dim,
                           c->g * c->dk * c->q_dim,
                           c->g * c->dv * c->q_dim,
                           c->q_dim * c->h * c->dv,
                           c->h * c->dk,
                           c->g * c->dk,
                           c->g * c->dv,
                           c->q_dim,
                           c->h};
    int64_t total = 0;
    for (int i = 0; i < 9; i++)
        total += sz[i];
    *wbuf = malloc(sizeof(float) * (size_t)total);
    test_rng rng;
    test_rng_seed(&rng, 1234);
    test_fill_normal(&rng, *wbuf, total, 0.3f);
    const float *p[9];
    int64_t off = 0;
    for (int i = 0; i < 9; i++)
        p[i] = *wbuf + off, off += sz[i];
    mha_weights w = {p[0], p[1], p[2], p[3], NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    if (c->bias)
        w.b_q = p[4], w.b_k = p[5], w.b_v = p[6], w.b_o = p[7];
    if (c->sinks)
        w.sinks = p[8];
    cfg.sinks = c->sinks;
    mha_layer *layer = NULL;
    mha_error err;
    CHECK_OK(mha_layer_create(&cfg, &w, MHA_WEIGHTS_BORROW, NULL, &layer, &err), &err);
    return layer;
}

/* max|a - b| <= TOL_GRAD_REL max|b| over count elements; prints the gradient's name. */
static void
check_grad(const char *what, const layer_case *c, const float *a, const float *b, int64_t count) {
    double worst = 0.0, scale = 0.0;
    for (int64_t i = 0; i < count; i++) {
        scale = fmax(scale, fabs((double)b[i]));
        worst = fmax(worst, fabs((double)a[i] - (double)b[i]));
    }
    /* A zero reference proves nothing, except where zero is the exact answer: with one row
     * (n = 1) each query sees one key, its probability is 1 whatever the score, so every gradient
     * through the scores (dw_q, dw_k, db_q, db_k) is 0; the generic tier computes it exactly 0,
     * the SIMD tiers as rounding noise. */
    const int exact_zero = c->n == 1 && worst == 0.0;
    CHECK(worst <= TOL_GRAD_REL * scale && (scale > 0.0 || count == 0 || exact_zero),
          "ring layer backward %s, P=%d rank %d, n=%lld h=%lld g=%lld rope=%d causal=%d "
          "layout=%d: max err %.3g > %.3g",
          what, g_size, g_rank, (long long)c->n, (long long)c->h, (long long)c->g, (int)c->rope,
          c->causal, (int)c->layout, worst, TOL_GRAD_REL * scale);
}

/* The backward: mha_ring_layer_backward against mha_layer_backward of the whole sequence for the
 * same random dy: the rank's rows of dx, every weight and bias gradient (summed over the ranks);
 * then accumulate adds the same dw_q again. fa: the whole-sequence forward, la: the rank's. */
static void check_backward(const layer_case *c,
                           const mha_layer *layer,
                           const mha_forward_args *fa,
                           const mha_forward_args *la,
                           const int64_t start[2],
                           const int64_t len[2],
                           int32_t nc) {
    const int64_t B = c->B, n = c->n, nl = la->q_len, qd = c->q_dim;
    const int64_t hk = c->h * c->dk, gk = c->g * c->dk, gv = c->g * c->dv, hv = c->h * c->dv;
    const int64_t wl[8] = {hk * qd, gk * qd, gv * qd, qd * hv, hk, gk, gv, qd};
    float *dy = malloc(sizeof(float) * (size_t)(B * n * qd));
    float *dyl = malloc(sizeof(float) * (size_t)(B * nl * qd));
    float *dx1 = malloc(sizeof(float) * (size_t)(B * n * qd));
    float *dxl = malloc(sizeof(float) * (size_t)(B * nl * qd));
    float *w1[8], *wr[8];
    for (int i = 0; i < 8; i++) {
        w1[i] = malloc(sizeof(float) * (size_t)wl[i]);
        wr[i] = malloc(sizeof(float) * (size_t)wl[i]);
    }
    test_rng rng;
    test_rng_seed(&rng, 7 + (uint64_t)n);
    test_fill_normal(&rng, dy, B * n * qd, 1.0f);
    for (int64_t b = 0; b < B; b++) {
        int64_t li = 0;
        for (int32_t k = 0; k < nc; k++)
            for (int64_t i = start[k]; i < start[k] + len[k]; i++, li++)
                memcpy(dyl + (b * nl + li) * qd, dy + (b * n + i) * qd, sizeof(float) * (size_t)qd);
    }
    mha_error err;
    mha_train_state *state = NULL;
    CHECK_OK(mha_layer_forward_train(layer, fa, NULL, &state, &err), &err);
    mha_layer_grads g1 = {dx1,
                          NULL,
                          NULL,
                          w1[0],
                          w1[1],
                          w1[2],
                          w1[3],
                          c->bias ? w1[4] : NULL,
                          c->bias ? w1[5] : NULL,
                          c->bias ? w1[6] : NULL,
                          c->bias ? w1[7] : NULL,
                          NULL,
                          0,
                          NULL,
                          NULL,
                          NULL};
    float ds1[8] = {0}, dsr[8] = {0}; /* h <= 8 */
    g1.d_sinks = c->sinks ? ds1 : NULL;
    if (state)
        CHECK_OK(mha_layer_backward(layer, state, dy, &g1, NULL, &err), &err);
    mha_train_state_destroy(state);
    mha_forward_args lb = *la; /* the backward reads no output */
    lb.out = NULL;
    const float *dy_local = nl > 0 ? dyl : NULL; /* a rank without rows passes no dy */
    mha_layer_grads gr = g1;
    gr.d_query = dxl;
    float **slot[8] = {&gr.dw_q, &gr.dw_k, &gr.dw_v, &gr.dw_o,
                       &gr.db_q, &gr.db_k, &gr.db_v, &gr.db_o};
    for (int i = 0; i < 8; i++)
        *slot[i] = *slot[i] ? wr[i] : NULL; /* gr is a copy of g1: the same requests */
    gr.d_sinks = c->sinks ? dsr : NULL;
    CHECK_OK(mha_ring_layer_backward(MPI_COMM_WORLD, &(mha_ring_config){n, c->layout}, layer, &lb,
                                     dy_local, &gr, NULL, &err),
             &err);
    /* The rank's rows of dx, in global order. */
    float *dx1l = malloc(sizeof(float) * (size_t)(B * nl * qd));
    for (int64_t b = 0; b < B; b++) {
        int64_t li = 0;
        for (int32_t k = 0; k < nc; k++)
            for (int64_t i = start[k]; i < start[k] + len[k]; i++, li++)
                memcpy(dx1l + (b * nl + li) * qd, dx1 + (b * n + i) * qd,
                       sizeof(float) * (size_t)qd);
    }
    check_grad("dx", c, dxl, dx1l, B * nl * qd);
    static const char *const names[8] = {"dw_q", "dw_k", "dw_v", "dw_o",
                                         "db_q", "db_k", "db_v", "db_o"};
    for (int i = 0; i < (c->bias ? 8 : 4); i++)
        check_grad(names[i], c, wr[i], w1[i], wl[i]);
    if (c->sinks)
        check_grad("d_sinks", c, dsr, ds1, c->h);
    /* accumulate: dw_q receives the same gradient once more. */
    mha_layer_grads acc = {0};
    acc.dw_q = wr[0], acc.accumulate = 1;
    for (int64_t e = 0; e < wl[0]; e++)
        w1[0][e] *= 2.0f;
    CHECK_OK(mha_ring_layer_backward(MPI_COMM_WORLD, &(mha_ring_config){n, c->layout}, layer, &lb,
                                     dy_local, &acc, NULL, &err),
             &err);
    check_grad("dw_q accumulated", c, wr[0], w1[0], wl[0]);
    for (int i = 0; i < 8; i++)
        free(w1[i]), free(wr[i]);
    free(dy), free(dyl), free(dx1), free(dxl), free(dx1l);
}

static void run_case(const layer_case *c) {
    float *wbuf;
    mha_layer *layer = make_layer(c, &wbuf);
    if (!layer) {
        free(wbuf);
        return;
    }
    const int64_t B = c->B, n = c->n, qd = c->q_dim;
    float *x = malloc(sizeof(float) * (size_t)(B * n * qd));
    float *y1 = malloc(sizeof(float) * (size_t)(B * n * qd));
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(B * n));
    test_rng rng;
    test_rng_seed(&rng, 99 + (uint64_t)n);
    test_fill_normal(&rng, x, B * n * qd, 1.0f);
    for (int64_t i = 0; i < B * n; i++)
        pos[i] = (i % n) * 3 + 7 + i / n; /* differs per batch row too */

    /* 1. The single-process layer on the whole sequence. */
    mha_forward_args fa = {0};
    fa.batch = B, fa.q_len = fa.kv_len = n, fa.query = x, fa.out = y1;
    fa.q_positions = c->positions ? pos : NULL;
    fa.mask.causal = c->causal;
    fa.mask.use_window = c->window[0] != -2;
    fa.mask.window_left = c->window[0], fa.mask.window_right = c->window[1];
    mha_error err;
    CHECK_OK(mha_layer_forward(layer, &fa, NULL, &err), &err);

    /* 2. This rank's rows through the ring. */
    mha_ring_config rc = {n, c->layout};
    int32_t nc = 1; /* an empty shard if mha_ring_shard fails */
    int64_t start[2] = {0, 0}, len[2] = {0, 0};
    CHECK_OK(mha_ring_shard(&rc, g_size, g_rank, &nc, start, len, &err), &err);
    const int64_t nl = len[0] + (nc > 1 ? len[1] : 0);
    float *xl = malloc(sizeof(float) * (size_t)(B * nl * qd));
    float *yl = malloc(sizeof(float) * (size_t)(B * nl * qd));
    int64_t *pl = malloc(sizeof(int64_t) * (size_t)(B * nl));
    for (int64_t b = 0; b < B; b++) {
        int64_t li = 0;
        for (int32_t k = 0; k < nc; k++)
            for (int64_t i = start[k]; i < start[k] + len[k]; i++, li++) {
                memcpy(xl + (b * nl + li) * qd, x + (b * n + i) * qd, sizeof(float) * (size_t)qd);
                pl[b * nl + li] = pos[b * n + i];
            }
    }
    mha_forward_args la = fa;
    la.q_len = la.kv_len = nl, la.query = xl, la.out = yl;
    la.q_positions = c->positions ? pl : NULL;
    if (nl == 0) /* a rank without rows (N < C) may pass no row tensor at all */
        la.query = NULL, la.out = NULL, la.q_positions = NULL;
    CHECK_OK(mha_ring_layer_forward(MPI_COMM_WORLD, &rc, layer, &la, NULL, &err), &err);

    /* 3. Its rows against the single-process ones. */
    double worst = 0.0, scale = 0.0;
    for (int64_t i = 0; i < B * n * qd; i++)
        scale = fmax(scale, fabs((double)y1[i]));
    for (int64_t b = 0; b < B; b++) {
        int64_t li = 0;
        for (int32_t k = 0; k < nc; k++)
            for (int64_t i = start[k]; i < start[k] + len[k]; i++, li++)
                for (int64_t e = 0; e < qd; e++)
                    worst = fmax(worst, fabs((double)yl[(b * nl + li) * qd + e] -
                                             (double)y1[(b * n + i) * qd + e]));
    }
    CHECK(worst <= TOL_OUT_REL * scale,
          "ring layer P=%d rank %d: B=%lld n=%lld h=%lld g=%lld dk=%lld dv=%lld bias=%d causal=%d "
          "layout=%d rope=%d/%lld window=(%lld,%lld) positions=%d: max|y - y1| = %.3g > %.3g",
          g_size, g_rank, (long long)B, (long long)n, (long long)c->h, (long long)c->g,
          (long long)c->dk, (long long)c->dv, c->bias, c->causal, (int)c->layout, (int)c->rope,
          (long long)c->rotary_dim, (long long)c->window[0], (long long)c->window[1], c->positions,
          worst, TOL_OUT_REL * scale);
    check_backward(c, layer, &fa, &la, start, len, nc);
    free(xl), free(yl), free(pl), free(x), free(y1), free(pos), free(wbuf);
    mha_layer_destroy(layer);
}

static void test_matches_single_process(void) {
    /* B, n, q_dim, h, g, dk, dv, bias, causal, layout, rope, rotary_dim, window, positions */
    const layer_case base[] = {
        {1, 12, 16, 2, 2, 8, 8, 0, 0, MHA_SHARD_ZIGZAG, MHA_ROPE_NONE, 0, {-2, -2}, 0, 0},
        {2, 23, 24, 4, 2, 6, 6, 1, 1, MHA_SHARD_ZIGZAG, MHA_ROPE_INTERLEAVED, 0, {-2, -2}, 0, 0},
        {1, 37, 16, 4, 1, 8, 4, 1, 1, MHA_SHARD_ZIGZAG, MHA_ROPE_HALF, 4, {5, 0}, 0, 0},
        {2, 19, 12, 3, 3, 4, 4, 0, 0, MHA_SHARD_ZIGZAG, MHA_ROPE_HALF, 0, {3, 2}, 1, 0},
        {1, 70, 32, 4, 2, 8, 8, 1, 1, MHA_SHARD_ZIGZAG, MHA_ROPE_INTERLEAVED, 0, {-2, -2}, 1, 0},
        {2, 23, 24, 4, 2, 6, 6, 1, 1, MHA_SHARD_ZIGZAG, MHA_ROPE_INTERLEAVED, 0, {4, 0}, 0, 1},
    };
    /* MHA_TEST_QUICK=1 (sanitizer builds): the GQA + RoPE shape causal and the caller-positions
     * + window shape not, in both layouts (each kind of work once, a fifth of the time). */
    const int only_some = test_quick();
    for (size_t i = 0; i < sizeof base / sizeof base[0]; i++)
        for (int layout = 0; layout < 2; layout++)
            for (int causal = 0; causal < 2; causal++) {
                if (only_some && !(i == 1 && causal) && !(i == 3 && !causal))
                    continue;
                layer_case c = base[i];
                c.layout = (mha_shard_layout)layout;
                c.causal = causal;
                run_case(&c);
            }
}

/* Sequences shorter than the chunk count (N < C: some chunks empty, some ranks without any row)
 * and the lengths around it: N = 1, 2, 3, P, 2P - 1, 2P, 2P + 1, both layouts, causal and not,
 * forward and backward: GQA with biases and RoPE at global positions, then caller positions with
 * a window and sinks. MHA_TEST_QUICK=1: one of the two kinds per N, in turn. */
static void test_short_sequences(void) {
    const int64_t p = g_size, lens[] = {1, 2, 3, p, 2 * p - 1, 2 * p, 2 * p + 1};
    const int few = test_quick();
    for (size_t s = 0; s < sizeof lens / sizeof lens[0]; s++) {
        int again = 0;
        for (size_t t = 0; t < s; t++)
            again |= lens[t] == lens[s];
        for (int layout = 0; layout < 2 && !again; layout++)
            for (int causal = 0; causal < 2; causal++)
                for (int kind = 0; kind < 2; kind++) {
                    if (few && kind != (int)(s % 2))
                        continue;
                    layer_case c = {2,
                                    lens[s],
                                    12,
                                    4,
                                    2,
                                    4,
                                    4,
                                    1,
                                    causal,
                                    (mha_shard_layout)layout,
                                    MHA_ROPE_INTERLEAVED,
                                    0,
                                    {-2, -2},
                                    0,
                                    0};
                    if (kind == 1) {
                        c.bias = 0, c.rope = MHA_ROPE_HALF, c.positions = 1, c.sinks = 1;
                        c.window[0] = 1, c.window[1] = causal ? 0 : 2;
                    }
                    run_case(&c);
                }
    }
}

/* One rank with bad arguments: every rank returns its error, "rank r: ..." on the others. */
static void test_collective_errors(void) {
    const layer_case c = {1, 12,       16, 2, 2, 8, 8, 0, 1, MHA_SHARD_ZIGZAG, MHA_ROPE_NONE,
                          0, {-2, -2}, 0,  0};
    float *wbuf;
    mha_layer *layer = make_layer(&c, &wbuf);
    mha_ring_config rc = {c.n, c.layout};
    int32_t nc;
    int64_t start[2], len[2];
    mha_error err;
    CHECK_OK(mha_ring_shard(&rc, g_size, g_rank, &nc, start, len, &err), &err);
    const int64_t nl = len[0] + (nc > 1 ? len[1] : 0);
    float *x = calloc((size_t)(nl * c.q_dim), sizeof(float));
    float *y = calloc((size_t)(nl * c.q_dim), sizeof(float));
    mha_forward_args a = {0};
    a.batch = 1, a.q_len = nl, a.query = x, a.out = y;
    const int bad = g_size - 1;
    char prefix[32];
    snprintf(prefix, sizeof prefix, "rank %d: ", bad);

    mha_forward_args b = a;
    if (g_rank == bad)
        b.key = x;
    mha_status st = mha_ring_layer_forward(MPI_COMM_WORLD, &rc, layer, &b, NULL, &err);
    CHECK(st == MHA_STATUS_UNSUPPORTED &&
              (g_rank == bad || strncmp(err.message, prefix, strlen(prefix)) == 0),
          "cross-attention on rank %d: rank %d got %s: %s", bad, g_rank, mha_status_string(st),
          err.message);
    b = a;
    if (g_rank == 0)
        b.q_len = nl + 1;
    st = mha_ring_layer_forward(MPI_COMM_WORLD, &rc, layer, &b, NULL, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "q_len"),
          "q_len on rank 0: rank %d got %s: %s", g_rank, mha_status_string(st), err.message);
    st = mha_ring_layer_forward(MPI_COMM_WORLD, &rc, layer, &a, NULL, &err);
    CHECK(st == MHA_STATUS_OK, "good call after errors: rank %d got %s: %s", g_rank,
          mha_status_string(st), err.message);
    /* A gradient of the probabilities on the last rank: the ring writes none (UNSUPPORTED). */
    float *dx = calloc((size_t)(nl * c.q_dim), sizeof(float));
    mha_layer_grads lg = {0};
    lg.d_query = dx;
    if (g_rank == bad)
        lg.d_probs = dx;
    st = mha_ring_layer_backward(MPI_COMM_WORLD, &rc, layer, &a, y, &lg, NULL, &err);
    CHECK(st == MHA_STATUS_UNSUPPORTED && (g_rank != bad || strstr(err.message, "d_probs")),
          "d_probs on rank %d: rank %d got %s: %s", bad, g_rank, mha_status_string(st),
          err.message);
    free(dx);
    /* A dynamic rope's length is the whole sequence's: refused on every rank, before any message
     * (the weights are the first layer's: same sizes). */
    mha_config dyn = *mha_layer_config(layer);
    dyn.rope.style = MHA_ROPE_HALF, dyn.rope.scaling = MHA_ROPE_SCALING_DYNAMIC;
    dyn.rope.original_max_position = 4.0;
    mha_layer *dyn_layer = NULL;
    CHECK_OK(
        mha_layer_create(&dyn, mha_layer_weights(layer), MHA_WEIGHTS_COPY, NULL, &dyn_layer, &err),
        &err);
    st = mha_ring_layer_forward(MPI_COMM_WORLD, &rc, dyn_layer, &a, NULL, &err);
    CHECK(st == MHA_STATUS_UNSUPPORTED && strstr(err.message, "dynamic"),
          "dynamic rope: rank %d got %s: %s", g_rank, mha_status_string(st), err.message);
    mha_layer_destroy(dyn_layer);
    /* LongRoPE too, unless its two lists are the same (mha_rope_at_length's fixed form). */
    dyn.rope.scaling = MHA_ROPE_SCALING_LONGROPE;
    dyn.rope.original_max_position = 4.0, dyn.rope.factor = 2.0;
    for (int k = 0; k < MHA_ROPE_MAX_PAIRS; k++)
        dyn.rope.short_factor[k] = 1.0, dyn.rope.long_factor[k] = 1.0 + k;
    for (int fixed = 0; fixed < 2; fixed++) {
        if (fixed)
            CHECK_OK(mha_rope_at_length(&dyn.rope, dyn.head_dim, rc.seq_len, &dyn.rope, &err),
                     &err);
        CHECK_OK(mha_layer_create(&dyn, mha_layer_weights(layer), MHA_WEIGHTS_COPY, NULL,
                                  &dyn_layer, &err),
                 &err);
        st = mha_ring_layer_forward(MPI_COMM_WORLD, &rc, dyn_layer, &a, NULL, &err);
        CHECK(fixed ? st == MHA_STATUS_OK
                    : st == MHA_STATUS_UNSUPPORTED && strstr(err.message, "longrope"),
              "longrope (fixed %d): rank %d got %s: %s", fixed, g_rank, mha_status_string(st),
              err.message);
        mha_layer_destroy(dyn_layer);
    }
    free(x), free(y), free(wbuf);
    mha_layer_destroy(layer);
}

/* Key padding [B, N] (every fifth key of each row padded, shifted per row): the rank passes its
 * keys' slice [B, n_local]. While the ring refuses key padding, every rank must get UNSUPPORTED
 * naming it; once it supports it (docs/distributed.md), the rows must equal the single-process
 * layer with the whole mask. */
static void test_key_padding(void) {
    const layer_case c = {2, 23,       16, 4, 2, 4, 4, 1, 1, MHA_SHARD_ZIGZAG, MHA_ROPE_HALF,
                          0, {-2, -2}, 0,  0};
    float *wbuf;
    mha_layer *layer = make_layer(&c, &wbuf);
    const int64_t B = c.B, n = c.n, qd = c.q_dim;
    float *x = malloc(sizeof(float) * (size_t)(B * n * qd));
    float *y1 = malloc(sizeof(float) * (size_t)(B * n * qd));
    uint8_t *pad = malloc((size_t)(B * n));
    test_rng rng;
    test_rng_seed(&rng, 5);
    test_fill_normal(&rng, x, B * n * qd, 1.0f);
    for (int64_t i = 0; i < B * n; i++)
        pad[i] = (uint8_t)((i % n + i / n) % 5 != 3);
    mha_forward_args fa = {0};
    fa.batch = B, fa.q_len = fa.kv_len = n, fa.query = x, fa.out = y1;
    fa.mask.causal = c.causal;
    fa.mask.key_padding = (mha_mask_tensor){pad, MHA_DTYPE_U8, 2, {B, n, 0, 0}};
    mha_error err;
    CHECK_OK(mha_layer_forward(layer, &fa, NULL, &err), &err);
    mha_ring_config rc = {n, c.layout};
    int32_t nc;
    int64_t start[2], len[2];
    CHECK_OK(mha_ring_shard(&rc, g_size, g_rank, &nc, start, len, &err), &err);
    const int64_t nl = len[0] + (nc > 1 ? len[1] : 0);
    float *xl = malloc(sizeof(float) * (size_t)(B * nl * qd));
    float *yl = malloc(sizeof(float) * (size_t)(B * nl * qd));
    uint8_t *pl = malloc((size_t)(B * nl));
    for (int64_t b = 0; b < B; b++) {
        int64_t li = 0;
        for (int32_t k = 0; k < nc; k++)
            for (int64_t i = start[k]; i < start[k] + len[k]; i++, li++) {
                memcpy(xl + (b * nl + li) * qd, x + (b * n + i) * qd, sizeof(float) * (size_t)qd);
                pl[b * nl + li] = pad[b * n + i];
            }
    }
    mha_forward_args la = fa;
    la.q_len = la.kv_len = nl, la.query = xl, la.out = yl;
    la.mask.key_padding = (mha_mask_tensor){pl, MHA_DTYPE_U8, 2, {B, nl, 0, 0}};
    const mha_status st = mha_ring_layer_forward(MPI_COMM_WORLD, &rc, layer, &la, NULL, &err);
    if (st == MHA_STATUS_UNSUPPORTED) {
        CHECK(strstr(err.message, "key_padding") != NULL, "key padding refused: rank %d: %s",
              g_rank, err.message);
    } else {
        CHECK(st == MHA_STATUS_OK, "key padding: rank %d got %s: %s", g_rank, mha_status_string(st),
              err.message);
        double worst = 0.0, scale = 0.0;
        for (int64_t i = 0; i < B * n * qd; i++)
            scale = fmax(scale, fabs((double)y1[i]));
        for (int64_t b = 0; b < B; b++) {
            int64_t li = 0;
            for (int32_t k = 0; k < nc; k++)
                for (int64_t i = start[k]; i < start[k] + len[k]; i++, li++)
                    for (int64_t e = 0; e < qd; e++)
                        worst = fmax(worst, fabs((double)yl[(b * nl + li) * qd + e] -
                                                 (double)y1[(b * n + i) * qd + e]));
        }
        CHECK(worst <= TOL_OUT_REL * scale, "key padding, P=%d rank %d: %.3g > %.3g", g_size,
              g_rank, worst, TOL_OUT_REL * scale);
    }
    free(x), free(y1), free(pad), free(xl), free(yl), free(pl), free(wbuf);
    mha_layer_destroy(layer);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    test_matches_single_process();
    test_short_sequences();
    test_collective_errors();
    test_key_padding();
    const int rc = test_finish();
    MPI_Finalize();
    return rc;
}
