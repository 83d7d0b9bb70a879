/* SPDX-License-Identifier: MIT */
/* test_temperature.c: attention temperature tuning (docs/SEMANTICS.md "Temperature tuning",
 * mha_config.temperature; Llama 4's NoPE layers).
 *
 *   1. tau(p) against the float64 oracle (tests/common/oracle_f64.c) at positions 0 .. 2^31,
 *      around the float32 steps beyond 2^24 and at multiples of floor_scale (where the floor
 *      jumps), for floor_scale 8192, 4, 3, 0.5 and attn_scale 0.1, 0.5, -0.3: within one
 *      rounding to float32 (2^-24 relative);
 *   2. the layer forward (no RoPE, and with RoPE and explicit positions; GQA; causal) against
 *      the float64 layer oracle at TOL_OUT_REL * max|ref|, for both implementations; the tuning
 *      must change the output (by more than 100 times the gate), so the check can fail;
 *   3. the training forward's y equals the forward's bit for bit; the backward through tau:
 *      with every query at one position tau is a constant t, and the gradients equal those of
 *      the plain layer with w_q times t (dL/dx equal, dL/dw_q times t) at TOL_GRAD_REL;
 *   4. prefill of 5 tokens then one decode step per token equals the full causal forward (each
 *      query scaled at its cache position) at TOL_OUT_REL;
 *   5. hostile configs refused naming the field (floor_scale 0, negative, NaN, Inf, below 2^-32,
 *      above FLT_MAX; attn_scale NaN, Inf, above 2^100); enabled = 0 ignores (and zeroes) them.
 * Gradients against torch autograd of transformers' Llama4TextAttention are in
 * tests/test_python_hf_models.py (llama4_text layer 1).
 */
#include "harness.h"
#include "oracle_f64.h"
#include "tolerance.h"

#include "layer/plan.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { B = 2, N = 13, E = 32, H = 4, G = 2, DK = 8 };

typedef struct weights {
    float wq[H * DK * E], wk[G * DK * E], wv[G * DK * E], wo[E * H * DK];
} weights;

static void tau_vs_oracle(void) {
    const double fs[4] = {8192.0, 4.0, 3.0, 0.5}, as[3] = {0.1, 0.5, -0.3};
    int64_t pos[64];
    int np = 0;
    for (int64_t p = 0; p < 20; p++)
        pos[np++] = p;
    const int64_t big[] = {
        8190,      8191,          8192,          16383,     (1 << 24) - 2,   (1 << 24) - 1,
        (1 << 24), (1 << 24) + 1, (1 << 24) + 3, 100000007, (1LL << 31) - 1, 1LL << 31};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++)
        pos[np++] = big[i];
    double worst = 0.0;
    for (int f = 0; f < 4; f++)
        for (int a = 0; a < 3; a++) {
            const mha_temperature_tuning t = {1, fs[f], as[a]};
            for (int i = 0; i < np; i++) {
                const double ref = oracle_temperature(&t, pos[i]);
                const double got = (double)mha__temperature_factor(&t, pos[i]);
                const double rel = fabs(got - ref) / fabs(ref);
                worst = fmax(worst, rel);
                CHECK(rel <= 0x1p-24, "tau(%lld) floor_scale %g attn_scale %g: %.9g vs %.17g",
                      (long long)pos[i], fs[f], as[a], got, ref);
            }
        }
    /* The steps of the definition: tau = 1 below floor_scale - 1, jumps at multiples of it. */
    const mha_temperature_tuning t = {1, 4.0, 0.5};
    CHECK(mha__temperature_factor(&t, 2) == 1.0f && mha__temperature_factor(&t, 3) > 1.0f,
          "tau steps at p + 1 = floor_scale");
    CHECK(mha__temperature_factor(&t, 3) == mha__temperature_factor(&t, 6) &&
              mha__temperature_factor(&t, 7) > mha__temperature_factor(&t, 6),
          "tau constant within a step");
    printf("tau vs oracle: worst relative error %.3g (gate 2^-24)\n", worst);
}

static mha_config make_config(int with_rope) {
    mha_config c;
    memset(&c, 0, sizeof c);
    c.q_dim = E, c.num_heads = H, c.num_kv_heads = G, c.head_dim = DK;
    if (with_rope)
        c.rope.style = MHA_ROPE_INTERLEAVED;
    c.temperature.enabled = 1;
    c.temperature.floor_scale = 3.0;
    c.temperature.attn_scale = 0.7;
    return c;
}

static mha_weights weights_of(const weights *w) {
    mha_weights mw;
    memset(&mw, 0, sizeof mw);
    mw.w_q = w->wq, mw.w_k = w->wk, mw.w_v = w->wv, mw.w_o = w->wo;
    return mw;
}

static mha_forward_args args_of(const float *x, float *y, const int64_t *pos) {
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.batch = B, a.q_len = N, a.query = x, a.out = y, a.q_positions = pos;
    a.mask.causal = 1;
    return a;
}

static void forward_vs_oracle(const weights *w, const float *x, int with_rope, const int64_t *pos) {
    const char *name = with_rope ? (pos ? "rope+positions" : "rope") : "nope";
    mha_config c = make_config(with_rope);
    const mha_weights mw = weights_of(w);
    mha_error err;
    mha_layer *L = NULL;
    CHECK_OK(mha_layer_create(&c, &mw, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err);
    if (!L)
        return;
    double ref[B * N * E], plain[B * N * E];
    float y[B * N * E], y2[B * N * E];
    mha_forward_args a = args_of(x, y, pos);
    CHECK(oracle_layer(mha_layer_config(L), &mw, &a, ref, NULL) == 0, "[%s] oracle", name);
    mha_config c0 = *mha_layer_config(L);
    c0.temperature.enabled = 0;
    CHECK(oracle_layer(&c0, &mw, &a, plain, NULL) == 0, "[%s] oracle without tuning", name);
    const double gate = TOL_OUT_REL * test_max_abs(ref, B * N * E);
    double changed = 0.0;
    for (int i = 0; i < B * N * E; i++)
        changed = fmax(changed, fabs(ref[i] - plain[i]));
    CHECK(changed > 100 * gate, "[%s] the tuning changes the output (%g vs gate %g)", name, changed,
          gate);
    const mha_impl impls[2] = {MHA_IMPL_REFERENCE, MHA_IMPL_AUTO};
    for (int i = 0; i < 2; i++) {
        mha_exec ex;
        memset(&ex, 0, sizeof ex);
        ex.impl = impls[i];
        CHECK_OK(mha_layer_forward(L, &a, &ex, &err), &err);
        const double e = test_max_abs_diff(y, ref, B * N * E);
        CHECK(e <= gate, "[%s impl %d] forward vs oracle: %g > %g", name, i, e, gate);
        mha_train_state *st = NULL;
        mha_forward_args a2 = args_of(x, y2, pos);
        CHECK_OK(mha_layer_forward_train(L, &a2, &ex, &st, &err), &err);
        CHECK(memcmp(y, y2, sizeof y) == 0, "[%s impl %d] training forward == forward", name, i);
        mha_train_state_destroy(st);
    }
    mha_layer_destroy(L);
}

/* Decode: prefill 5 tokens, then one token per step (positions = cache positions), against the
 * full causal forward's oracle. */
static void decode_vs_oracle(const weights *w, const float *x, int with_rope) {
    mha_config c = make_config(with_rope);
    const mha_weights mw = weights_of(w);
    mha_error err;
    mha_layer *L = NULL;
    CHECK_OK(mha_layer_create(&c, &mw, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err);
    if (!L)
        return;
    double ref[B * N * E];
    float y[B * N * E];
    mha_forward_args a = args_of(x, y, NULL);
    CHECK(oracle_layer(mha_layer_config(L), &mw, &a, ref, NULL) == 0, "decode oracle");
    float yd[B * N * E];
    test_layer_decode_steps(L, x, B, N, E, 5, yd);
    const double gate = TOL_OUT_REL * test_max_abs(ref, B * N * E);
    const double ed = test_max_abs_diff(yd, ref, B * N * E);
    CHECK(ed <= gate, "[rope %d] decode vs oracle: %g > %g", with_rope, ed, gate);
    mha_layer_destroy(L);
}

/* The backward through tau: with every query at one position P (q_positions), tau is one
 * constant t and the tuned layer is the plain layer with w_q' = t w_q; so dL/dx must agree (within
 * float rounding) and dL/dw_q = t dL/dw_q'. A backward that forgot dQ' = tau dQ is off by t. */
static void backward_scaled(const weights *w, const float *x) {
    mha_config c = make_config(0), c0 = c;
    c0.temperature.enabled = 0;
    int64_t pos[B * N];
    for (int i = 0; i < B * N; i++)
        pos[i] = 10;
    const float t = mha__temperature_factor(&c.temperature, 10); /* ln(4) 0.7 + 1 */
    const double td = (double)t;
    weights w0 = *w;
    for (int i = 0; i < H * DK * E; i++)
        w0.wq[i] = w->wq[i] * t;
    const mha_weights mw = weights_of(w), mw0 = weights_of(&w0);
    mha_error err;
    mha_layer *L = NULL, *L0 = NULL;
    CHECK_OK(mha_layer_create(&c, &mw, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err);
    CHECK_OK(mha_layer_create(&c0, &mw0, MHA_WEIGHTS_BORROW, NULL, &L0, &err), &err);
    if (!L || !L0) {
        mha_layer_destroy(L);
        mha_layer_destroy(L0);
        return;
    }
    static float y[B * N * E], dy[B * N * E], dx[2][B * N * E], dwq[2][H * DK * E];
    for (int i = 0; i < B * N * E; i++)
        dy[i] = (float)((i * 37) % 11 - 5) * 0.1f;
    mha_layer *Ls[2] = {L, L0};
    for (int k = 0; k < 2; k++) {
        mha_forward_args a = args_of(x, y, pos);
        mha_train_state *st = NULL;
        CHECK_OK(mha_layer_forward_train(Ls[k], &a, NULL, &st, &err), &err);
        mha_layer_grads gr;
        memset(&gr, 0, sizeof gr);
        gr.d_query = dx[k], gr.dw_q = dwq[k];
        CHECK_OK(mha_layer_backward(Ls[k], st, dy, &gr, NULL, &err), &err);
        mha_train_state_destroy(st);
    }
    double ex = 0.0, mx = 0.0, ew = 0.0, mw_ = 0.0;
    for (int i = 0; i < B * N * E; i++) {
        ex = fmax(ex, fabs((double)dx[0][i] - (double)dx[1][i]));
        mx = fmax(mx, fabs((double)dx[1][i]));
    }
    for (int i = 0; i < H * DK * E; i++) {
        ew = fmax(ew, fabs((double)dwq[0][i] - td * (double)dwq[1][i]));
        mw_ = fmax(mw_, fabs(td * (double)dwq[1][i]));
    }
    CHECK(ex <= TOL_GRAD_REL * mx, "d_query with tau %g: %g > %g", td, ex, TOL_GRAD_REL * mx);
    CHECK(ew <= TOL_GRAD_REL * mw_, "dw_q with tau %g: %g > %g", td, ew, TOL_GRAD_REL * mw_);
    mha_layer_destroy(L);
    mha_layer_destroy(L0);
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
    const mha_weights mw = weights_of(w);
    const double bad_fs[6] = {0.0, -8192.0, (double)NAN, (double)INFINITY, 1e-12, 1e39};
    for (int i = 0; i < 6; i++) {
        mha_config c = make_config(0);
        c.temperature.floor_scale = bad_fs[i];
        refused("bad floor_scale", &c, &mw, "config.temperature.floor_scale");
    }
    const double bad_as[4] = {(double)NAN, (double)INFINITY, -(double)INFINITY, 2e30};
    for (int i = 0; i < 4; i++) {
        mha_config c = make_config(0);
        c.temperature.attn_scale = bad_as[i];
        refused("bad attn_scale", &c, &mw, "config.temperature.attn_scale");
    }
    mha_config c = make_config(0);
    c.temperature.enabled = 0;
    c.temperature.floor_scale =
        (double)NAN; /* ignored when off, and zeroed in the resolved config */
    mha_error err;
    mha_layer *L = NULL;
    CHECK_OK(mha_layer_create(&c, &mw, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err);
    if (L)
        CHECK(mha_layer_config(L)->temperature.floor_scale == 0.0, "off: fields zeroed");
    mha_layer_destroy(L);
}

int main(void) {
    test_rng r;
    test_rng_seed(&r, 31);
    weights w;
    test_fill_normal(&r, (float *)&w, (int64_t)(sizeof w / sizeof(float)), 0.3f);
    float x[B * N * E];
    test_fill_normal(&r, x, B * N * E, 1.0f);
    int64_t pos[B * N];
    for (int i = 0; i < B * N; i++)
        pos[i] = 40 + 3 * i; /* tau from ln(14) 0.7 + 1 upward, one step every position */
    tau_vs_oracle();
    forward_vs_oracle(&w, x, 0, NULL);
    forward_vs_oracle(&w, x, 1, NULL);
    forward_vs_oracle(&w, x, 1, pos);
    decode_vs_oracle(&w, x, 0);
    decode_vs_oracle(&w, x, 1);
    backward_scaled(&w, x);
    hostile(&w);
    return test_finish();
}
