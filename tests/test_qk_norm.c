/* SPDX-License-Identifier: MIT */
/* test_qk_norm.c: QK-norm in the layer (docs/SEMANTICS.md "QK-norm").
 *
 * For each kind (RMS_HEAD with w and with 1 + w, RMS_ALL, L2_AFTER_ROPE), with GQA, RoPE and a
 * causal mask, and for both implementations (reference, auto):
 *   1. the forward against the float64 oracle (tests/common/oracle_f64.c, its own norm in
 *      double) at TOL_OUT_REL * max|ref|; the norm must change the output (the same layer without
 *      it differs from the oracle by more than the gate), so the check can fail;
 *   2. the training forward's y equals the forward's, bit for bit;
 *   3. prefill of 5 tokens then one decode step per token equals the full causal forward (the
 *      cache holds K normed and rotated) at TOL_OUT_REL;
 *   4. a bf16 layer equals the float32 layer given the same bf16-rounded weights, widened;
 * The output gate (Qwen3-Next: A * sigmoid(x W_gate^T + b_gate), W_gate the second half of w_q)
 * with and without the norm runs through the same checks 1 to 4.
 *   5. hostile configs refused, naming the field: kind out of range, eps 0, negative, NaN, Inf,
 *      unit_offset with L2, absent norm weights, norm weights the kind does not have, a NaN norm
 *      weight, a norm-weight gradient for a layer without norm weights.
 * Gradients (the norm's backward and d_q_norm / d_k_norm) are checked against torch autograd of
 * the transformers modules in tests/test_python_hf_models.py.
 */
#include "harness.h"
#include "oracle_f64.h"
#include "tolerance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { B = 2, N = 11, E = 32, H = 4, G = 2, DK = 8 };

typedef struct kcase {
    const char *name;
    mha_qk_norm_kind kind;
    int unit_offset;
    int output_gate;
} kcase;

static const kcase CASES[] = {
    {"rms_head", MHA_QK_NORM_RMS_HEAD, 0, 0},
    {"rms_head_unit_offset", MHA_QK_NORM_RMS_HEAD, 1, 0},
    {"rms_all", MHA_QK_NORM_RMS_ALL, 0, 0},
    {"l2_after_rope", MHA_QK_NORM_L2_AFTER_ROPE, 0, 0},
    {"gate_rms_head_unit_offset", MHA_QK_NORM_RMS_HEAD, 1, 1}, /* Qwen3-Next */
    {"gate_only", MHA_QK_NORM_NONE, 0, 1},
};

/* wq and bq hold the gate's rows after the query's (used with output_gate only). */
typedef struct weights {
    float wq[2 * H * DK * E], wk[G * DK * E], wv[G * DK * E], wo[E * H * DK];
    float bq[2 * H * DK], qn[H * DK], kn[G * DK];
} weights;

static mha_config make_config(const kcase *k) {
    mha_config c;
    memset(&c, 0, sizeof c);
    c.q_dim = E, c.num_heads = H, c.num_kv_heads = G, c.head_dim = DK;
    c.bias_q = 1;
    c.rope.style = MHA_ROPE_HALF;
    c.qk_norm.kind = k->kind;
    c.qk_norm.eps = 1e-6;
    c.qk_norm.unit_offset = k->unit_offset;
    c.qk_norm.eps = k->kind ? c.qk_norm.eps : 0.0;
    c.output_gate = k->output_gate;
    return c;
}

static mha_weights weights_of(const mha_config *c, const weights *w) {
    const int has =
        c->qk_norm.kind == MHA_QK_NORM_RMS_HEAD || c->qk_norm.kind == MHA_QK_NORM_RMS_ALL;
    mha_weights mw;
    memset(&mw, 0, sizeof mw);
    mw.w_q = w->wq, mw.w_k = w->wk, mw.w_v = w->wv, mw.w_o = w->wo, mw.b_q = w->bq;
    mw.q_norm = has ? w->qn : NULL;
    mw.k_norm = has ? w->kn : NULL;
    return mw;
}

static mha_forward_args args_of(const float *x, float *y) {
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.batch = B, a.q_len = N, a.query = x, a.out = y;
    a.mask.causal = 1;
    return a;
}

static void forward_vs_oracle(const kcase *k, const weights *w, const float *x) {
    mha_config c = make_config(k);
    mha_weights mw = weights_of(&c, w);
    mha_error err;
    mha_layer *L = NULL;
    CHECK_OK(mha_layer_create(&c, &mw, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err);
    if (!L)
        return;
    double ref[B * N * E], plain[B * N * E];
    float y[B * N * E], y2[B * N * E];
    mha_forward_args a = args_of(x, y);
    CHECK(oracle_layer(mha_layer_config(L), &mw, &a, ref, NULL) == 0, "[%s] oracle", k->name);
    mha_config c0 = *mha_layer_config(L);
    c0.qk_norm.kind = MHA_QK_NORM_NONE;
    c0.output_gate = 0;
    CHECK(oracle_layer(&c0, &mw, &a, plain, NULL) == 0, "[%s] oracle without norm", k->name);
    const double gate = TOL_OUT_REL * test_max_abs(ref, B * N * E);
    double changed = 0.0;
    for (int i = 0; i < B * N * E; i++)
        changed = fmax(changed, fabs(ref[i] - plain[i]));
    CHECK(changed > 100 * gate, "[%s] the norm changes the output (%g vs gate %g)", k->name,
          changed, gate);
    const mha_impl impls[2] = {MHA_IMPL_REFERENCE, MHA_IMPL_AUTO};
    for (int i = 0; i < 2; i++) {
        mha_exec ex;
        memset(&ex, 0, sizeof ex);
        ex.impl = impls[i];
        CHECK_OK(mha_layer_forward(L, &a, &ex, &err), &err);
        const double e = test_max_abs_diff(y, ref, B * N * E);
        CHECK(e <= gate, "[%s impl %d] forward vs oracle: %g > %g", k->name, i, e, gate);
        mha_train_state *st = NULL;
        mha_forward_args a2 = args_of(x, y2);
        CHECK_OK(mha_layer_forward_train(L, &a2, &ex, &st, &err), &err);
        CHECK(memcmp(y, y2, sizeof y) == 0, "[%s impl %d] training forward == forward", k->name, i);
        mha_train_state_destroy(st);
    }

    /* Decode: prefill 5 tokens, then one token per step, against the full causal forward. */
    float yd[B * N * E];
    test_layer_decode_steps(L, x, B, N, E, 5, yd);
    const double ed = test_max_abs_diff(yd, ref, B * N * E);
    CHECK(ed <= gate, "[%s] decode vs oracle: %g > %g", k->name, ed, gate);
    mha_layer_destroy(L);
}

/* A bf16 layer equals the float32 layer on the same (bf16-rounded) weights. */
static void half_weights(const kcase *k, const weights *w, const float *x) {
    mha_config c = make_config(k);
    weights r = *w; /* rounded to bf16 values (truncation is fine: any bf16 values do) */
    float *all = (float *)&r;
    uint16_t hb[sizeof r / sizeof(float)];
    for (size_t i = 0; i < sizeof r / sizeof(float); i++) {
        uint32_t u;
        memcpy(&u, &all[i], 4);
        u &= 0xffff0000u;
        memcpy(&all[i], &u, 4);
        hb[i] = (uint16_t)(u >> 16);
    }
    mha_weights w32 = weights_of(&c, &r), w16 = w32;
    const char *base = (const char *)&r;
    const void **slots[7] = {&w16.w_q, &w16.w_k,    &w16.w_v,   &w16.w_o,
                             &w16.b_q, &w16.q_norm, &w16.k_norm};
    for (int i = 0; i < 7; i++)
        if (*slots[i]) /* weights_of points into r: the offset of that tensor in r */
            *slots[i] = hb + ((uintptr_t)*slots[i] - (uintptr_t)base) / 4;
    mha_error err;
    mha_layer *L32 = NULL, *L16 = NULL;
    CHECK_OK(mha_layer_create(&c, &w32, MHA_WEIGHTS_BORROW, NULL, &L32, &err), &err);
    c.weight_dtype = MHA_DTYPE_BF16;
    CHECK_OK(mha_layer_create(&c, &w16, MHA_WEIGHTS_COPY, NULL, &L16, &err), &err);
    float y32[B * N * E], y16[B * N * E];
    mha_forward_args a = args_of(x, y32);
    mha_exec ex;
    memset(&ex, 0, sizeof ex);
    ex.impl = MHA_IMPL_REFERENCE;
    CHECK_OK(mha_layer_forward(L32, &a, &ex, &err), &err);
    a.out = y16;
    CHECK_OK(mha_layer_forward(L16, &a, &ex, &err), &err);
    CHECK(memcmp(y32, y16, sizeof y32) == 0, "[%s] bf16 weights == float32 on the same values",
          k->name);
    mha_layer_destroy(L32);
    mha_layer_destroy(L16);
}

/* create must fail with INVALID_ARG and a message containing `field`. */
static void
refused(const char *what, const mha_config *c, const mha_weights *w, const char *field) {
    mha_error err;
    memset(&err, 0, sizeof err);
    mha_layer *L = NULL;
    const mha_status st = mha_layer_create(c, w, MHA_WEIGHTS_BORROW, NULL, &L, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && L == NULL && strstr(err.message, field) != NULL,
          "%s: refused naming %s (status %d: %s)", what, field, (int)st, err.message);
    mha_layer_destroy(L);
}

static void hostile(const weights *w) {
    const kcase head = CASES[0], l2 = CASES[3];
    mha_config c = make_config(&head);
    mha_weights mw = weights_of(&c, w);
    mha_config b = c;
    b.qk_norm.kind = (mha_qk_norm_kind)7;
    refused("kind 7", &b, &mw, "config.qk_norm.kind");
    const double bad_eps[4] = {0.0, -1e-6, (double)NAN, (double)INFINITY};
    for (int i = 0; i < 4; i++) {
        b = c;
        b.qk_norm.eps = bad_eps[i];
        refused("bad eps", &b, &mw, "config.qk_norm.eps");
    }
    mha_config cl = make_config(&l2);
    mha_weights wl = weights_of(&cl, w);
    b = cl;
    b.qk_norm.unit_offset = 1;
    refused("unit_offset with L2", &b, &wl, "config.qk_norm.unit_offset");
    refused("L2 with norm weights", &cl, &mw, "weights.q_norm");
    mha_weights m2 = mw;
    m2.k_norm = NULL;
    refused("absent k_norm", &c, &m2, "weights.k_norm");
    m2 = mw;
    m2.q_norm = NULL;
    refused("absent q_norm", &c, &m2, "weights.q_norm");
    b = c;
    b.qk_norm.kind = MHA_QK_NORM_NONE;
    refused("no norm but weights", &b, &mw, "weights.q_norm");
    weights bad = *w;
    bad.kn[3] = NAN;
    mha_weights wb = weights_of(&c, &bad);
    refused("NaN norm weight", &c, &wb, "weights.k_norm[3]");
    b = c;
    b.output_gate = 1;
    b.v_head_dim = DK / 2;
    refused("gate with v_head_dim != head_dim", &b, &mw, "config.output_gate");
    weights bg = *w;
    bg.wq[2 * H * DK * E - 1] = NAN; /* the gate's last weight */
    mha_weights wbg = weights_of(&c, &bg);
    b = c;
    b.output_gate = 1;
    refused("NaN gate weight", &b, &wbg, "weights.w_q[2047]");

    /* A norm-weight gradient for a layer without norm weights. */
    mha_error err;
    mha_layer *L = NULL;
    CHECK_OK(mha_layer_create(&cl, &wl, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err);
    float x[B * N * E], y[B * N * E], dq[DK];
    for (int i = 0; i < B * N * E; i++)
        x[i] = (float)((i % 7) - 3) * 0.1f;
    mha_forward_args a = args_of(x, y);
    mha_train_state *st = NULL;
    CHECK_OK(mha_layer_forward_train(L, &a, NULL, &st, &err), &err);
    mha_layer_grads gr;
    memset(&gr, 0, sizeof gr);
    gr.d_q_norm = dq;
    const mha_status s = mha_layer_backward(L, st, y, &gr, NULL, &err);
    CHECK(s == MHA_STATUS_INVALID_ARG && strstr(err.message, "grads.d_q_norm"),
          "d_q_norm without norm weights refused (%d: %s)", (int)s, err.message);
    mha_train_state_destroy(st);
    mha_layer_destroy(L);
}

int main(void) {
    test_rng r;
    test_rng_seed(&r, 31);
    weights w;
    float *all = (float *)&w;
    test_fill_normal(&r, all, (int64_t)(sizeof w / sizeof(float)), 0.3f);
    for (int i = 0; i < H * DK; i++) /* norm weights around 1, as trained ones are */
        w.qn[i] += 1.0f;
    for (int i = 0; i < G * DK; i++)
        w.kn[i] += 1.0f;
    float x[B * N * E];
    test_fill_normal(&r, x, B * N * E, 1.0f);
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
        forward_vs_oracle(&CASES[i], &w, x);
        half_weights(&CASES[i], &w, x);
    }
    hostile(&w);
    return test_finish();
}
