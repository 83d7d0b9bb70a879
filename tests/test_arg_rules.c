/* SPDX-License-Identifier: MIT */
/* test_arg_rules.c: the argument rules a C user relies on (issue 28, "Nothing silent").
 *
 *   - Scalars in the precision they are used in: scale, softcap and RoPE's attention_factor are
 *     doubles in the API but float32 in the kernels. A value beyond float's range (scale 1e39,
 *     softcap 4e38: inf in float) or one that rounds to zero (scale or softcap 1e-300) is refused
 *     by every call that takes it (core, layer config, KV-cache attention), never an all-NaN
 *     result with status OK.
 *   - Aliasing: an output whose byte range overlaps an input or another output is refused
 *     (INVALID_ARG naming both), for the same pointer and for a partial overlap, in every call
 *     with outputs; the documented in-place forms (mha_rope_apply's x, mha_attention_merge's o
 *     exactly o_a) still work, and inputs may share memory. A draft tree's tree_parents is an input
 *     of the KV-cache attention and the layer step. MLA's backward: every gradient against x,
 *     positions, dy, the layer's weights and each other.
 *   - An output whose own strides put two of its elements at one address (a stride of 0, rows
 *     closer than a row) is refused: the core's out, the backward's dq, dk, dv, RoPE's x. Inputs
 *     the checks missed: the layer's out over its masks and weights, the layer backward's
 *     gradients over the forward's positions and masks, MLA's out over its weights and seq_ids.
 *   - mha_error: a successful call clears it; the message is the one the header shows.
 */
#include "harness.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Checks status INVALID_ARG and that the message contains `needle`. */
static void refused(mha_status got, const mha_error *err, const char *needle, const char *what) {
    CHECK(got == MHA_STATUS_INVALID_ARG, "%s: status %s, expected invalid argument (%s)", what,
          mha_status_string(got), err->message);
    CHECK(strstr(err->message, needle) != NULL, "%s: message '%s' lacks '%s'", what, err->message,
          needle);
}

static int all_finite(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return 0;
    return 1;
}

/* A contiguous core problem B = 1, H = 1, n = m = 4, d = 4 over one buffer of 64 floats: q at 0,
 * k at 16, v at 32, out at 48 (so that a test can move one of them onto another). */
static float buf[64 + 64];
static mha_attention_args core_args(void) {
    for (int i = 0; i < 128; i++)
        buf[i] = (float)((i * 37) % 11) / 11.0f - 0.5f;
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = 1, a.num_heads = 1, a.q_len = 4, a.kv_len = 4, a.head_dim = 4;
    a.q = buf, a.k = buf + 16, a.v = buf + 32, a.out = buf + 48;
    const int64_t s[3] = {16, 16, 4};
    memcpy(a.q_strides, s, sizeof s), memcpy(a.k_strides, s, sizeof s);
    memcpy(a.v_strides, s, sizeof s), memcpy(a.out_strides, s, sizeof s);
    return a;
}

static void test_core_scalars(void) {
    mha_error err;
    mha_attention_args a = core_args(), b;
    CHECK_OK(mha_attention(&a, NULL, &err), &err);
    const double bad_scale[] = {1e39, -1e39, 1e150, 1e-300, -1e-300, 1e-39};
    for (size_t i = 0; i < sizeof bad_scale / sizeof bad_scale[0]; i++) {
        b = a, b.scale = bad_scale[i];
        for (int k = 0; k < 16; k++)
            buf[48 + k] = 7.0f;
        refused(mha_attention(&b, NULL, &err), &err, "scale=", "core scale outside float");
        CHECK(buf[48] == 7.0f, "out untouched after a refused scale");
        refused(mha_attention_supported(&b, NULL, &err), &err, "scale=", "supported: scale");
    }
    const double bad_cap[] = {4e38, 1e300, 1e-300, 1e-39, -1.0};
    for (size_t i = 0; i < sizeof bad_cap / sizeof bad_cap[0]; i++) {
        b = a, b.softcap = bad_cap[i];
        refused(mha_attention(&b, NULL, &err), &err, "softcap=", "core softcap outside float");
    }
    /* The limits themselves are valid, and give finite results on these inputs. */
    const double ok_scale[] = {(double)FLT_MAX, -(double)FLT_MIN, (double)FLT_MIN, -2.0};
    for (size_t i = 0; i < sizeof ok_scale / sizeof ok_scale[0]; i++) {
        b = core_args(), b.scale = ok_scale[i], b.softcap = 30.0;
        CHECK_OK(mha_attention(&b, NULL, &err), &err);
        CHECK(all_finite(buf + 48, 16), "scale %g with softcap: finite", ok_scale[i]);
    }
    b = core_args(), b.softcap = (double)FLT_MAX;
    CHECK_OK(mha_attention(&b, NULL, &err), &err);
    b = core_args(), b.softcap = (double)FLT_MIN;
    CHECK_OK(mha_attention(&b, NULL, &err), &err);
    CHECK(all_finite(buf + 48, 16), "softcap FLT_MIN: finite");
}

static float W[1024];

static void test_layer_scalars(void) {
    mha_error err;
    mha_config c;
    memset(&c, 0, sizeof c);
    c.q_dim = 8, c.num_heads = 2;
    mha_weights w = {W, W, W, W, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    mha_layer *L = NULL;
    mha_config b = c;
    b.scale = 1e39;
    refused(mha_layer_create(&b, &w, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err,
            "config.scale=", "layer scale 1e39");
    CHECK(L == NULL, "no layer");
    b = c, b.scale = 1e150; /* query_pre_attn_scalar 1e-300 */
    refused(mha_layer_create(&b, &w, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err,
            "config.scale=", "layer scale 1e150");
    b = c, b.softcap = 4e38;
    refused(mha_layer_create(&b, &w, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err,
            "config.softcap=", "layer softcap 4e38");
    b = c, b.softcap = 1e-300;
    refused(mha_layer_create(&b, &w, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err,
            "config.softcap=", "layer softcap 1e-300 (0 in float: silently off)");
    b = c, b.rope.style = MHA_ROPE_HALF, b.rope.scaling = MHA_ROPE_SCALING_YARN;
    b.rope.factor = 4.0, b.rope.attention_factor = 1e39;
    refused(mha_layer_create(&b, &w, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err, "attention_factor",
            "yarn attention_factor beyond float");
    b.rope.attention_factor = 2.0;
    CHECK_OK(mha_layer_create(&b, &w, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err);
    mha_layer_destroy(L);
    L = NULL;

    /* The KV-cache attention takes its own scale and softcap. */
    CHECK_OK(mha_layer_create(&c, &w, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err);
    mha_kv_cache_config kc;
    memset(&kc, 0, sizeof kc);
    kc.max_seq = 8, kc.batch = 1;
    mha_kv_cache *cache = NULL;
    CHECK_OK(mha_kv_cache_create(&kc, L, NULL, &cache, &err), &err);
    float kv[2 * 4] = {0.5f, -1, 2, 0, 1, 1, 0, -0.5f}, q[2 * 4] = {1, 2, 3, 4, 5, 6, 7, 8};
    float o[8];
    CHECK_OK(mha_kv_cache_append(cache, 1, NULL, 1, kv, kv, &err), &err);
    mha_kv_attention_args ka;
    memset(&ka, 0, sizeof ka);
    ka.num_seqs = 1, ka.num_tokens = 1, ka.num_heads = 2, ka.q = q, ka.out = o;
    CHECK_OK(mha_kv_cache_attention(cache, &ka, NULL, &err), &err);
    mha_kv_attention_args kb = ka;
    kb.scale = 1e39;
    refused(mha_kv_cache_attention(cache, &kb, NULL, &err), &err, "scale=", "kv scale 1e39");
    kb = ka, kb.softcap = 4e38;
    refused(mha_kv_cache_attention(cache, &kb, NULL, &err), &err, "softcap=", "kv softcap 4e38");

    /* Aliasing through the cache calls. */
    kb = ka, kb.out = q; /* out == q */
    refused(mha_kv_cache_attention(cache, &kb, NULL, &err), &err, "overlaps", "kv out == q");
    kb = ka, kb.lse = o + 1; /* lse inside out */
    refused(mha_kv_cache_attention(cache, &kb, NULL, &err), &err, "overlaps", "kv lse in out");
    float x[8] = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f, 0.7f, 0.8f};
    mha_decode_args da = {1, NULL, 1, x, x, NULL};
    refused(mha_layer_decode_step(L, cache, &da, NULL, &err), &err, "overlaps", "decode out == x");
    CHECK(mha_kv_cache_length(cache, 0) == 1, "nothing appended by a refused step");
    da.out = x + 4; /* partial overlap */
    refused(mha_layer_prefill(L, cache, &da, NULL, &err), &err, "overlaps", "prefill out in x");
    /* tree_parents is an input of both: an out (or lse) over it is refused before anything is
     * written or appended (a draft tree's parents read while out is written) */
    union {
        int64_t p[8];
        float f[16];
    } tp = {{-1}}; /* one draft, a root; room for an out of 8 floats anywhere in it */
    kb = ka, kb.tree_parents = tp.p;
    CHECK_OK(mha_kv_cache_attention(cache, &kb, NULL, &err), &err); /* a tree of one token */
    kb.out = tp.f;
    refused(mha_kv_cache_attention(cache, &kb, NULL, &err), &err, "out overlaps tree_parents",
            "kv out over tree_parents");
    CHECK(tp.p[0] == -1, "tree_parents untouched by a refused call");
    kb.out = o, kb.lse = tp.f + 1;
    refused(mha_kv_cache_attention(cache, &kb, NULL, &err), &err, "lse overlaps tree_parents",
            "kv lse in tree_parents");
    da.out = tp.f + 1, da.tree_parents = tp.p; /* out [1, 9) floats over parents [0, 2) */
    refused(mha_layer_decode_step(L, cache, &da, NULL, &err), &err, "out overlaps tree_parents",
            "decode out over tree_parents");
    refused(mha_layer_prefill(L, cache, &da, NULL, &err), &err, "out overlaps tree_parents",
            "prefill out over tree_parents");
    CHECK(mha_kv_cache_length(cache, 0) == 1 && tp.p[0] == -1,
          "nothing appended or written by a refused tree step");
    da.out = o, da.tree_parents = NULL;
    CHECK_OK(mha_layer_decode_step(L, cache, &da, NULL, &err), &err);
    float kr[16];
    CHECK_OK(mha_kv_cache_read(cache, 0, 0, kr, kr + 8, &err), &err); /* g d_k = g d_v = 8 */
    refused(mha_kv_cache_read(cache, 0, 0, kr, kr + 4, &err), &err, "k overlaps v",
            "read: v inside k");
    mha_kv_cache_destroy(cache);
    mha_layer_destroy(L);
}

static void test_core_aliasing(void) {
    mha_error err;
    mha_attention_args a = core_args(), b;
    /* out == q, out == k, out == v: the same pointer. */
    const float *in[3] = {buf, buf + 16, buf + 32};
    const char *names[3] = {"q", "k", "v"};
    for (int i = 0; i < 3; i++) {
        b = a, b.out = (float *)in[i];
        refused(mha_attention(&b, NULL, &err), &err, names[i], "out aliases an input");
        CHECK(strstr(err.message, "out overlaps") != NULL, "message names out: %s", err.message);
    }
    /* Partial overlap: out starts inside v (its last rows) or ends inside q. */
    b = a, b.out = buf + 40;
    refused(mha_attention(&b, NULL, &err), &err, "out overlaps v", "out over the end of v");
    b = a, b.q = buf + 56; /* q [56, 72) overlaps out [48, 64) */
    refused(mha_attention(&b, NULL, &err), &err, "out overlaps q", "q over the end of out");
    /* A strided view: out rows every 8 floats reach past 16 floats. */
    b = a, b.out = buf + 64, b.out_strides[2] = 8; /* [64, 92) */
    b.q = buf + 88;
    refused(mha_attention(&b, NULL, &err), &err, "out overlaps q", "strided out reaches q");
    /* lse and probs against the inputs and each other. */
    b = a, b.lse = (float *)buf + 2;
    refused(mha_attention(&b, NULL, &err), &err, "lse overlaps q", "lse in q");
    b = a, b.probs = buf + 64, b.lse = buf + 70;
    refused(mha_attention(&b, NULL, &err), &err, "overlaps", "lse in probs");
    b = a, b.probs = buf + 56; /* probs [56, 72) over out [48, 64) */
    refused(mha_attention(&b, NULL, &err), &err, "out overlaps probs", "probs over out");
    /* Inputs may share memory (self-attention on one tensor), and adjacent ranges are fine. */
    b = a, b.k = b.v = b.q;
    CHECK_OK(mha_attention(&b, NULL, &err), &err);
    b = a, b.lse = buf + 64, b.probs = buf + 68;
    CHECK_OK(mha_attention(&b, NULL, &err), &err);

    /* Statistics: outputs against q, k. */
    float recv[4], ent[4];
    mha_attention_stats st;
    memset(&st, 0, sizeof st);
    st.received = recv, st.entropy = ent;
    CHECK_OK(mha_attention_statistics(&a, &st, NULL, &err), &err);
    st.entropy = buf + 17;
    refused(mha_attention_statistics(&a, &st, NULL, &err), &err, "stats.entropy overlaps k",
            "stats in k");
    st.entropy = recv + 2;
    refused(mha_attention_statistics(&a, &st, NULL, &err), &err, "overlaps", "stats in stats");

    /* Backward: gradients against every forward tensor, dout and each other. */
    float lse[4], dq[16], dk[16], dv[16], dout[16];
    for (int i = 0; i < 16; i++)
        dout[i] = 0.25f * (float)(i % 5) - 0.5f;
    b = a, b.lse = lse;
    CHECK_OK(mha_attention(&b, NULL, &err), &err);
    mha_attention_grads g;
    memset(&g, 0, sizeof g);
    const int64_t s[3] = {16, 16, 4};
    g.dout = dout, g.dq = dq, g.dk = dk, g.dv = dv;
    memcpy(g.dout_strides, s, sizeof s), memcpy(g.dq_strides, s, sizeof s);
    memcpy(g.dk_strides, s, sizeof s), memcpy(g.dv_strides, s, sizeof s);
    CHECK_OK(mha_attention_backward(&b, &g, NULL, &err), &err);
    mha_attention_grads h = g;
    h.dq = (float *)dout;
    refused(mha_attention_backward(&b, &h, NULL, &err), &err, "grads.dq overlaps grads.dout",
            "dq == dout");
    h = g, h.dk = buf + 20; /* inside k */
    refused(mha_attention_backward(&b, &h, NULL, &err), &err, "grads.dk overlaps k", "dk in k");
    h = g, h.dv = b.out;
    refused(mha_attention_backward(&b, &h, NULL, &err), &err, "fwd.out", "dv == out");
    h = g, h.dv = dk + 8;
    refused(mha_attention_backward(&b, &h, NULL, &err), &err, "overlaps", "dv in dk");
    h = g, h.dq = lse - 0; /* dq [lse, +16) covers lse */
    refused(mha_attention_backward(&b, &h, NULL, &err), &err, "fwd.lse", "dq over lse");
}

/* The layer the layer tests share: q_dim 8, 2 heads, its four projections borrowed from W (so
 * that an output over a weight is an overlap the checks must see); NULL if creation failed. */
static mha_layer *borrowed_layer(void) {
    mha_error err;
    for (int i = 0; i < 1024; i++)
        W[i] = (float)((i * 13) % 7) / 7.0f - 0.4f;
    mha_config c;
    memset(&c, 0, sizeof c);
    c.q_dim = 8, c.num_heads = 2;
    mha_weights w = {W, W + 64, W + 128, W + 192, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    mha_layer *L = NULL;
    CHECK_OK(mha_layer_create(&c, &w, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err);
    return L;
}

static void test_layer_aliasing(void) {
    mha_error err;
    mha_layer *L = borrowed_layer();
    float x[3 * 8], y[3 * 8], p[2 * 9];
    for (int i = 0; i < 24; i++)
        x[i] = 0.1f * (float)(i % 9) - 0.3f;
    mha_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.batch = 1, fa.q_len = 3, fa.query = x, fa.out = y;
    CHECK_OK(mha_layer_forward(L, &fa, NULL, &err), &err);
    mha_forward_args fb = fa;
    fb.out = x; /* the case: out == query returned OK */
    for (int i = 0; i < 24; i++)
        x[i] = 0.1f * (float)(i % 9) - 0.3f;
    refused(mha_layer_forward(L, &fb, NULL, &err), &err, "out overlaps query", "out == query");
    CHECK(x[0] == -0.3f && x[23] == 0.1f * 5 - 0.3f, "query untouched");
    fb = fa, fb.out = x + 8;
    refused(mha_layer_forward(L, &fb, NULL, &err), &err, "out overlaps query", "out in query");
    fb = fa, fb.probs = y + 4;
    refused(mha_layer_forward(L, &fb, NULL, &err), &err, "overlaps", "probs in out");
    fb = fa, fb.probs = p;
    CHECK_OK(mha_layer_forward(L, &fb, NULL, &err), &err);
    /* Cross-attention: out against key and value. */
    float kx[3 * 8] = {0}; /* room for out's 3 rows: out must reach nothing but the key */
    fb = fa, fb.key = kx, fb.kv_len = 2, fb.out = kx;
    refused(mha_layer_forward(L, &fb, NULL, &err), &err, "out overlaps key", "out == key");

    /* Projections. */
    float yq[3 * 8];
    CHECK_OK(mha_layer_project(L, MHA_PROJ_Q, 3, x, yq, NULL, &err), &err);
    refused(mha_layer_project(L, MHA_PROJ_Q, 3, x, x, NULL, &err), &err, "y overlaps x", "y == x");
    refused(mha_layer_project(L, MHA_PROJ_Q, 3, x, x + 8, NULL, &err), &err, "y overlaps x",
            "y in x");
    refused(mha_layer_project(L, MHA_PROJ_Q, 3, x, W + 60, NULL, &err), &err, "weight",
            "y over a borrowed weight");
    float dx[3 * 8], dw[64];
    CHECK_OK(mha_layer_project_backward(L, MHA_PROJ_Q, 3, x, yq, dx, dw, NULL, 0, NULL, &err),
             &err);
    refused(mha_layer_project_backward(L, MHA_PROJ_Q, 3, x, yq, yq, dw, NULL, 0, NULL, &err), &err,
            "dx overlaps dy", "dx == dy");
    refused(mha_layer_project_backward(L, MHA_PROJ_Q, 3, x, yq, dx, x, NULL, 0, NULL, &err), &err,
            "dw overlaps x", "dw == x");

    /* Layer backward: gradients against dy, the forward's inputs, the weights, each other. */
    mha_train_state *state = NULL;
    CHECK_OK(mha_layer_forward_train(L, &fa, NULL, &state, &err), &err);
    float dy[24], dq[24], dwq[64];
    for (int i = 0; i < 24; i++)
        dy[i] = 0.05f * (float)(i % 7);
    mha_layer_grads gr;
    memset(&gr, 0, sizeof gr);
    gr.d_query = dq, gr.dw_q = dwq;
    CHECK_OK(mha_layer_backward(L, state, dy, &gr, NULL, &err), &err);
    mha_layer_grads gb = gr;
    gb.d_query = dy;
    refused(mha_layer_backward(L, state, dy, &gb, NULL, &err), &err, "grads.d_query overlaps dy",
            "d_query == dy");
    gb = gr, gb.d_query = x;
    refused(mha_layer_backward(L, state, dy, &gb, NULL, &err), &err, "query", "d_query == query");
    gb = gr, gb.dw_q = W + 32;
    refused(mha_layer_backward(L, state, dy, &gb, NULL, &err), &err, "grads.dw_q overlaps w_",
            "dw_q over a borrowed weight");
    gb = gr, gb.dw_o = dwq + 8;
    refused(mha_layer_backward(L, state, dy, &gb, NULL, &err), &err, "overlaps", "dw_o in dw_q");
    mha_train_state_destroy(state);

    /* The layer's statistics: their outputs against the layer's inputs. */
    float recv[2 * 3], ent[2 * 3];
    mha_attention_stats st;
    memset(&st, 0, sizeof st);
    st.received = recv, st.entropy = ent;
    fb = fa, fb.out = NULL;
    CHECK_OK(mha_layer_attention_statistics(L, &fb, &st, NULL, &err), &err);
    st.entropy = x + 3;
    refused(mha_layer_attention_statistics(L, &fb, &st, NULL, &err), &err,
            "stats.entropy overlaps query", "layer stats over the query");
    mha_layer_destroy(L);
}

static void test_small_calls_aliasing(void) {
    mha_error err;
    /* Half to float: dst (4 bytes an element) must not overlap src (2 bytes). */
    union {
        uint16_t h[8];
        float f[4];
    } hv = {{0x3c00, 0x4000, 0, 0, 0, 0, 0, 0}};
    float hf[4];
    CHECK_OK(mha_half_to_f32(MHA_DTYPE_F16, hv.h, hf, 2, &err), &err);
    CHECK(hf[0] == 1.0f && hf[1] == 2.0f, "half_to_f32 values");
    refused(mha_half_to_f32(MHA_DTYPE_F16, hv.h + 2, hv.f, 2, &err), &err, "dst overlaps src",
            "half_to_f32 dst over src");

    /* Merge: o may be exactly o_a (same stride), never shifted into it or over an lse. */
    float oa[8] = {1, 2, 3, 4, 5, 6, 7, 8}, ob[8] = {8, 7, 6, 5, 4, 3, 2, 1};
    float la[2] = {0.5f, -1}, lb[2] = {0, 0}, o[8], l[2];
    CHECK_OK(mha_attention_merge(2, 4, oa, 4, la, ob, 4, lb, o, 4, l, &err), &err);
    CHECK_OK(mha_attention_merge(2, 4, oa, 4, la, ob, 4, lb, oa, 4, la, &err), &err);
    refused(mha_attention_merge(2, 4, oa, 4, la, ob, 4, lb, oa + 1, 4, NULL, &err), &err,
            "o overlaps o_a", "merge o shifted into o_a");
    refused(mha_attention_merge(2, 4, oa, 4, la, ob, 4, lb, o, 4, (float *)ob + 6, &err), &err,
            "lse overlaps o_b", "merge lse in o_b");
    refused(mha_attention_merge(2, 4, oa, 4, la, ob, 4, lb, o, 4, o + 2, &err), &err, "overlaps",
            "merge lse in o");
    /* Row extents beyond int64 are OVERFLOW (rows 2^40 x stride 2^40 was a signed overflow in
     * the check itself: undefined behaviour, a wrapped range compared). */
    const int64_t big = (int64_t)1 << 40;
    mha_status mst = mha_attention_merge(big, 4, oa, big, la, ob, 4, lb, o, 4, l, &err);
    CHECK(mst == MHA_STATUS_OVERFLOW && strstr(err.message, "merge") != NULL,
          "merge rows 2^40 x stride 2^40: %s (%s)", mha_status_string(mst), err.message);

    /* RoPE: frequencies' two outputs; apply's in-place x (allowed) against its positions. */
    mha_rope r;
    memset(&r, 0, sizeof r);
    r.style = MHA_ROPE_HALF;
    double f[4];
    refused(mha_rope_frequencies(&r, 8, f, f + 3, &err), &err, "overlaps",
            "cos_sin_factor inside freqs");
    double cs;
    CHECK_OK(mha_rope_frequencies(&r, 8, f, &cs, &err), &err);
    union {
        int64_t pos[16];
        float x[32];
    } u;
    memset(&u, 0, sizeof u);
    const int64_t xs[4] = {16, 8, 8, 1};
    float xr[16] = {1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8};
    CHECK_OK(mha_rope_apply(&r, 1, 2, 1, 8, xr, xs, NULL, 0, &err), &err);
    refused(mha_rope_apply(&r, 1, 2, 1, 8, u.x, xs, u.pos, 2, &err), &err, "x overlaps positions",
            "rope x over its positions");
    /* A view running backwards (negative stride) is allowed and rotates the same rows; its range
     * [x - 16, x + 8) is checked too (it was not: a backward x over its positions passed). */
    float xb[16] = {1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8};
    const int64_t xs_back[4] = {16, -8, 8, 1};
    CHECK_OK(mha_rope_apply(&r, 1, 2, 1, 8, xb + 8, xs_back, NULL, 0, &err), &err);
    CHECK(memcmp(xb + 8, xr, 8 * sizeof(float)) == 0 && memcmp(xb, xr + 8, 8 * sizeof(float)) == 0,
          "rope: a backward view rotates its rows as a forward one");
    const int64_t pos2[2] = {0, 1};
    memset(&u, 0, sizeof u);
    memcpy(u.pos + 4, pos2, sizeof pos2); /* positions at u.x + 8, x's row 0 at u.x + 16 */
    refused(mha_rope_apply(&r, 1, 2, 1, 8, u.x + 16, xs_back, u.pos + 4, 2, &err), &err,
            "x overlaps positions", "rope backward x over its positions");
    /* Offsets beyond int64 are OVERFLOW before anything is read (they were accepted, and the
     * rotation's b * stride overflowed: undefined behaviour, a wild write). */
    const int64_t xs_huge[4] = {(int64_t)1 << 62, 8, 8, 1};
    mha_status st = mha_rope_apply(&r, 3, 1, 1, 8, xr, xs_huge, NULL, 0, &err);
    CHECK(st == MHA_STATUS_OVERFLOW && strstr(err.message, "x_strides") != NULL,
          "rope x_strides[0]=2^62, batch 3: %s (%s)", mha_status_string(st), err.message);
    const int64_t xs_neg[4] = {INT64_MIN, 8, 8, 1};
    st = mha_rope_apply(&r, 2, 1, 1, 8, xr, xs_neg, NULL, 0, &err);
    CHECK(st == MHA_STATUS_OVERFLOW, "rope x_strides[0]=INT64_MIN: %s (%s)", mha_status_string(st),
          err.message);
    st = mha_rope_apply(&r, 3, 2, 1, 8, xr, xs, pos2, INT64_MAX / 2 + 1, &err);
    CHECK(st == MHA_STATUS_OVERFLOW && strstr(err.message, "pos_batch_stride") != NULL,
          "rope pos_batch_stride=2^62, batch 3: %s (%s)", mha_status_string(st), err.message);
}

/* MLA's backward writes gradients while it still reads x, dy and the layer's weights: every
 * gradient is checked against them and against each other (it was not: grads.dx = args.x gave a
 * wrong grads.w_q with status OK). */
static void test_mla_backward_aliasing(void) {
    enum { E = 16, HH = 2, R = 8, DN = 4, DR = 4, DV = 4, DQ = DN + DR, T = 5 };
    static float wq[HH * DQ * E], wkva[(R + DR) * E], kvn[R], wkvb[HH * (DN + DV) * R],
        wo[E * HH * DV];
    test_rng rng;
    test_rng_seed(&rng, 48);
    test_fill_normal(&rng, wq, HH * DQ * E, 0.3f);
    test_fill_normal(&rng, wkva, (R + DR) * E, 0.3f);
    test_fill_normal(&rng, wkvb, HH * (DN + DV) * R, 0.3f);
    test_fill_normal(&rng, wo, E * HH * DV, 0.3f);
    for (int i = 0; i < R; i++)
        kvn[i] = 1.0f;
    mha_mla_config c;
    memset(&c, 0, sizeof c);
    c.hidden = E, c.num_heads = HH, c.kv_lora_rank = R, c.qk_nope_head_dim = DN;
    c.qk_rope_head_dim = DR, c.v_head_dim = DV, c.rope.style = MHA_ROPE_INTERLEAVED;
    mha_mla_weights w;
    memset(&w, 0, sizeof w);
    w.w_q = wq, w.w_kv_a = wkva, w.kv_a_norm = kvn, w.w_kv_b = wkvb, w.w_o = wo;
    mha_error err;
    mha_mla *m = NULL;
    CHECK_OK(mha_mla_create(&c, &w, NULL, &m, &err), &err);
    if (!m)
        return;
    static float x[T * E + 64], dy[T * E + HH * DQ * E], dx[T * E + HH * DQ * E], dwq[HH * DQ * E],
        ref[HH * DQ * E];
    test_fill_normal(&rng, x, T * E, 1.0f);
    test_fill_normal(&rng, dy, T * E, 1.0f);
    mha_mla_forward_args a = {1, T, x, NULL, 1, NULL};
    mha_mla_grads g;
    memset(&g, 0, sizeof g);
    g.dy = dy, g.dx = dx, g.w_q = ref;
    CHECK_OK(mha_mla_backward(m, &a, &g, NULL, &err), &err);
    g.dx = x; /* dx over x: x is still read for the weight gradients after dx is written */
    g.w_q = dwq;
    memset(dwq, 0, sizeof dwq);
    refused(mha_mla_backward(m, &a, &g, NULL, &err), &err, "grads.dx overlaps args.x",
            "mla dx == x");
    CHECK(dwq[0] == 0.0f, "mla dx == x: grads.w_q written on error");
    g.dx = dx, g.w_q = NULL, g.w_o = dy + 8; /* a weight gradient starting inside dy */
    refused(mha_mla_backward(m, &a, &g, NULL, &err), &err, "grads.w_o overlaps grads.dy",
            "mla w_o inside dy");
    g.w_o = NULL, g.w_q = dx + 4; /* two gradients overlapping */
    refused(mha_mla_backward(m, &a, &g, NULL, &err), &err, "overlaps", "mla dx over w_q");
    g.w_q = (float *)mha_mla_get_weights(m)->w_q; /* the layer's own weight */
    refused(mha_mla_backward(m, &a, &g, NULL, &err), &err, "grads.w_q overlaps the layer's w_q",
            "mla w_q grad over the layer's w_q");
    int64_t pos[1 + T * E / 2]; /* room for dx at pos + 1 */
    for (int i = 0; i < T; i++)
        pos[i] = i;
    a.positions = pos;
    g.w_q = NULL, g.dx = (float *)(void *)(pos + 1);
    refused(mha_mla_backward(m, &a, &g, NULL, &err), &err, "grads.dx overlaps args.positions",
            "mla dx over positions");
    a.positions = NULL;
    g.dx = dx, g.w_q = dwq; /* the same call without aliasing */
    CHECK_OK(mha_mla_backward(m, &a, &g, NULL, &err), &err);
    CHECK(memcmp(dwq, ref, sizeof dwq) == 0, "mla w_q gradient differs from the first call");
    /* The forward and the decode step read the layer's weights while writing out (out over the
     * layer's own w_o was accepted and rewrote the layer's weights). */
    float *own_wo = (float *)mha_mla_get_weights(m)->w_o;
    const float wo0 = own_wo[0];
    mha_mla_forward_args fa = {1, T, x, NULL, 1, own_wo};
    refused(mha_mla_forward(m, &fa, NULL, &err), &err, "args.out overlaps the layer's w_o",
            "mla forward out over w_o");
    CHECK(own_wo[0] == wo0, "mla w_o untouched by a refused forward");
    mha_mla_cache *mc = NULL;
    CHECK_OK(mha_mla_cache_create(m, 1, 8, MHA_DTYPE_F32, NULL, &mc, &err), &err);
    mha_decode_args da = {1, NULL, 1, x, own_wo, NULL};
    refused(mha_mla_decode_step(m, mc, &da, NULL, &err), &err, "args.out overlaps the layer's w_o",
            "mla decode out over w_o");
    CHECK(own_wo[0] == wo0, "mla w_o untouched by a refused decode step");
    union {
        int64_t id[2];
        float f[E + 4];
    } ids = {{0}}; /* seq_ids [1] at its start, room for an out of E floats after it */
    da.seq_ids = ids.id, da.out = ids.f + 1;
    refused(mha_mla_decode_step(m, mc, &da, NULL, &err), &err, "args.out overlaps args.seq_ids",
            "mla decode out over seq_ids");
    CHECK(ids.id[0] == 0 && mha_mla_cache_length(mc, 0) == 0,
          "seq_ids untouched, nothing appended by a refused decode step");
    da.out = ids.f + 2; /* just past the id */
    CHECK_OK(mha_mla_decode_step(m, mc, &da, NULL, &err), &err);
    mha_mla_cache_destroy(mc);
    mha_mla_destroy(m);
}

/* An output's own strides must not make two of its elements share an address: they were
 * accepted (a stride of 0 put every row of out on the same floats, the last one written winning,
 * with status OK). A layout that tiles the output without overlap (heads interleaved with rows)
 * is accepted with the same values; inputs may still broadcast (stride 0). */
static void test_output_self_overlap(void) {
    mha_error err;
    static float q[32], k[32], v[32], o[64], ref[32], lse[8], dout[32], dq[64], dk[64], dv[64];
    for (int i = 0; i < 32; i++) {
        q[i] = 0.1f * (float)(i % 7) - 0.3f;
        k[i] = 0.2f * (float)(i % 5) - 0.4f;
        v[i] = 0.05f * (float)(i % 9);
        dout[i] = 0.25f * (float)(i % 3) - 0.2f;
    }
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = 1, a.num_heads = 2, a.q_len = 4, a.kv_len = 4, a.head_dim = 4;
    a.q = q, a.k = k, a.v = v, a.out = ref;
    const int64_t s[3] = {32, 16, 4};
    memcpy(a.q_strides, s, sizeof s), memcpy(a.k_strides, s, sizeof s);
    memcpy(a.v_strides, s, sizeof s), memcpy(a.out_strides, s, sizeof s);
    CHECK_OK(mha_attention(&a, NULL, &err), &err);
    mha_attention_args b = a;
    b.out = o, b.out_strides[1] = 4, b.out_strides[2] = 8; /* heads interleaved with rows */
    CHECK_OK(mha_attention(&b, NULL, &err), &err);
    int same = 1;
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 4; i++)
            for (int e = 0; e < 4; e++)
                same &= o[h * 4 + i * 8 + e] == ref[h * 16 + i * 4 + e];
    CHECK(same, "interleaved out: the values of the contiguous one");
    b = a, b.out = o, b.out_strides[0] = 0; /* batch of extent 1: its stride is never used */
    CHECK_OK(mha_attention(&b, NULL, &err), &err);
    b = a, b.out = o, b.k_strides[1] = 0, b.v_strides[1] = 0; /* inputs may broadcast */
    CHECK_OK(mha_attention(&b, NULL, &err), &err);
    const struct {
        int64_t s[3];
        const char *what;
    } bad[] = {{{32, 16, 0}, "out: every row on one row"},
               {{32, 0, 4}, "out: both heads on one head"},
               {{32, 16, 2}, "out: rows half over each other"},
               {{32, 4, 4}, "out: heads interleaved with rows too closely"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        b = a, b.out = o;
        memcpy(b.out_strides, bad[i].s, sizeof bad[i].s);
        for (int e = 0; e < 64; e++)
            o[e] = 7.0f;
        refused(mha_attention(&b, NULL, &err), &err, "make distinct elements of out alias",
                bad[i].what);
        CHECK(strstr(err.message, "out_strides") != NULL, "%s: names out_strides: %s", bad[i].what,
              err.message);
        CHECK(o[0] == 7.0f && o[63] == 7.0f, "%s: out untouched", bad[i].what);
        refused(mha_attention_supported(&b, NULL, &err), &err,
                "make distinct elements of out alias", bad[i].what);
    }

    /* Backward: dq, dk, dv are strided outputs too; dout (an input) may broadcast. */
    a.lse = lse;
    CHECK_OK(mha_attention(&a, NULL, &err), &err);
    mha_attention_grads g;
    memset(&g, 0, sizeof g);
    g.dout = dout, g.dq = dq, g.dk = dk, g.dv = dv;
    memcpy(g.dout_strides, s, sizeof s), memcpy(g.dq_strides, s, sizeof s);
    memcpy(g.dk_strides, s, sizeof s), memcpy(g.dv_strides, s, sizeof s);
    CHECK_OK(mha_attention_backward(&a, &g, NULL, &err), &err);
    mha_attention_grads h = g;
    h.dout_strides[1] = 0;
    CHECK_OK(mha_attention_backward(&a, &h, NULL, &err), &err);
    h = g, h.dq_strides[2] = 0;
    refused(mha_attention_backward(&a, &h, NULL, &err), &err,
            "make distinct elements of grads.dq alias", "dq rows on one row");
    h = g, h.dk_strides[1] = 0;
    refused(mha_attention_backward(&a, &h, NULL, &err), &err,
            "make distinct elements of grads.dk alias", "dk heads on one head");
    h = g, h.dv_strides[2] = 3;
    refused(mha_attention_backward(&a, &h, NULL, &err), &err,
            "make distinct elements of grads.dv alias", "dv rows over each other");

    /* mha_rope_apply rotates x in place: two of its elements on one address would be rotated
     * twice. A backward view (negative stride) is judged on |stride|. */
    mha_rope r;
    memset(&r, 0, sizeof r);
    r.style = MHA_ROPE_HALF;
    float x[32];
    for (int i = 0; i < 32; i++)
        x[i] = (float)(i % 8);
    const int64_t xs0[4] = {32, 0, 8, 1};
    refused(mha_rope_apply(&r, 1, 2, 1, 8, x, xs0, NULL, 0, &err), &err,
            "make distinct elements of x alias", "rope x rows on one row");
    CHECK(x[1] == 1.0f, "rope: x untouched");
    const int64_t xs_back[4] = {32, -4, 8, 1};
    refused(mha_rope_apply(&r, 1, 2, 1, 8, x + 8, xs_back, NULL, 0, &err), &err,
            "make distinct elements of x alias", "rope backward rows half over each other");
    const int64_t xs_heads[4] = {64, 16, 8, 1}; /* two heads of 8 between rows 16 apart */
    CHECK_OK(mha_rope_apply(&r, 1, 2, 2, 8, x, xs_heads, NULL, 0, &err), &err);
}

/* Inputs the layer reads while (or after) it writes its outputs, which the checks missed: the
 * forward's out over a mask or over the layer's borrowed weights (the output projection reads
 * w_o while writing out), the backward's gradients over the forward's positions and masks (the
 * backward reads them again). Each was accepted with status OK. */
static void test_layer_read_inputs(void) {
    mha_error err;
    mha_layer *L = borrowed_layer();
    if (!L)
        return;
    float x[3 * 8], y[3 * 8];
    for (int i = 0; i < 24; i++)
        x[i] = 0.1f * (float)(i % 9) - 0.3f;
    static union {
        float f[64];
        int64_t i[32];
        int32_t s[64];
        uint8_t u[256];
    } mb; /* a mask at its start, room for an out of 24 floats after any offset below 40 */
    memset(&mb, 0, sizeof mb);
    mha_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.batch = 1, fa.q_len = 3, fa.query = x, fa.out = y;
    const mha_mask_tensor am = {mb.f, MHA_DTYPE_F32, 2, {3, 3}};
    const mha_mask_tensor bm = {mb.u, MHA_DTYPE_U8, 2, {3, 3}};
    const mha_mask_tensor kp = {mb.u, MHA_DTYPE_U8, 2, {1, 3}};
    mha_forward_args fb = fa;
    fb.mask.additive_mask = am;
    CHECK_OK(mha_layer_forward(L, &fb, NULL, &err), &err);
    fb.out = mb.f + 4; /* out [4, 28) floats over the mask [0, 9) */
    refused(mha_layer_forward(L, &fb, NULL, &err), &err, "out overlaps mask.additive_mask",
            "layer out over its additive mask");
    CHECK(mb.f[4] == 0.0f && mb.f[27] == 0.0f, "mask untouched by a refused forward");
    mha_train_state *state = NULL;
    refused(mha_layer_forward_train(L, &fb, NULL, &state, &err), &err,
            "out overlaps mask.additive_mask", "training forward out over its additive mask");
    CHECK(state == NULL, "no state from a refused training forward");
    fb = fa, fb.mask.bool_mask = bm, fb.out = mb.f + 2;
    refused(mha_layer_forward(L, &fb, NULL, &err), &err, "out overlaps mask.bool_mask",
            "layer out over its bool mask");
    fb = fa, fb.mask.key_padding = kp, fb.mask.key_padding.data = mb.u + 1, fb.out = mb.f;
    refused(mha_layer_forward(L, &fb, NULL, &err), &err, "out overlaps mask.key_padding",
            "layer out over its key padding");
    fb = fa, fb.mask.q_segment_ids = mb.s + 60, fb.mask.kv_segment_ids = mb.s + 10, fb.out = mb.f;
    refused(mha_layer_forward(L, &fb, NULL, &err), &err, "out overlaps mask.kv_segment_ids",
            "layer out over its kv segment ids");
    fb = fa, fb.mask.causal = 1, fb.mask.alignment = MHA_ALIGN_EXPLICIT;
    fb.mask.align_offsets = mb.i + 5, fb.out = mb.f;
    refused(mha_layer_forward(L, &fb, NULL, &err), &err, "out overlaps mask.align_offsets",
            "layer out over its align offsets");
    /* The layer's borrowed weights: out over w_o, probs over w_q. */
    fb = fa, fb.out = W + 200;
    refused(mha_layer_forward(L, &fb, NULL, &err), &err, "out overlaps w_o", "layer out over w_o");
    fb = fa, fb.probs = W + 10;
    refused(mha_layer_forward(L, &fb, NULL, &err), &err, "probs overlaps w_q",
            "layer probs over w_q");

    /* The backward reads the forward's positions and masks again. */
    static union {
        int64_t i[16];
        float f[32];
    } pu; /* positions at its start, room for a d_query of 24 floats at pu.f + 4 */
    for (int i = 0; i < 3; i++)
        pu.i[i] = i + 2;
    static float mk[72]; /* an additive mask [3, 3] at its start, then d_query or dw_q over it */
    memset(mk, 0, sizeof mk);
    fb = fa, fb.q_positions = pu.i, fb.mask.additive_mask = am, fb.mask.additive_mask.data = mk;
    CHECK_OK(mha_layer_forward_train(L, &fb, NULL, &state, &err), &err);
    float dy[24], dq[24], dwq[64];
    for (int i = 0; i < 24; i++)
        dy[i] = 0.05f * (float)(i % 7);
    mha_layer_grads gr;
    memset(&gr, 0, sizeof gr);
    gr.d_query = dq, gr.dw_q = dwq;
    CHECK_OK(mha_layer_backward(L, state, dy, &gr, NULL, &err), &err);
    mha_layer_grads gb = gr;
    gb.d_query = pu.f + 4;
    refused(mha_layer_backward(L, state, dy, &gb, NULL, &err), &err,
            "grads.d_query overlaps the forward's q_positions", "d_query over q_positions");
    CHECK(pu.i[2] == 4, "positions untouched by a refused backward");
    gb = gr, gb.d_query = mk + 8;
    refused(mha_layer_backward(L, state, dy, &gb, NULL, &err), &err,
            "grads.d_query overlaps the forward's mask.additive_mask", "d_query over the mask");
    gb = gr, gb.dw_q = mk;
    refused(mha_layer_backward(L, state, dy, &gb, NULL, &err), &err,
            "grads.dw_q overlaps the forward's mask.additive_mask", "dw_q over the mask");
    mha_train_state_destroy(state);

    /* The layer's decode step and prefill read its weights while writing out. */
    mha_kv_cache_config kc;
    memset(&kc, 0, sizeof kc);
    kc.max_seq = 8, kc.batch = 1;
    mha_kv_cache *cache = NULL;
    CHECK_OK(mha_kv_cache_create(&kc, L, NULL, &cache, &err), &err);
    mha_decode_args da = {1, NULL, 1, x, W + 196, NULL};
    refused(mha_layer_decode_step(L, cache, &da, NULL, &err), &err, "out overlaps w_o",
            "decode out over w_o");
    refused(mha_layer_prefill(L, cache, &da, NULL, &err), &err, "out overlaps w_o",
            "prefill out over w_o");
    CHECK(mha_kv_cache_length(cache, 0) == 0, "nothing appended by a refused step");
    mha_kv_cache_destroy(cache);
    mha_layer_destroy(L);
}

static void test_error_contract(void) {
    mha_error err;
    mha_config c;
    memset(&c, 0, sizeof c);
    c.q_dim = 24, c.num_heads = 12, c.num_kv_heads = 5;
    mha_weights w = {W, W, W, W, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    mha_layer *L = NULL;
    CHECK(mha_layer_create(&c, &w, MHA_WEIGHTS_BORROW, NULL, &L, &err) == MHA_STATUS_INVALID_ARG,
          "12 heads over 5 kv heads");
    /* The header's example, verbatim. */
    CHECK(strcmp(err.message, "config.num_heads=12 is not divisible by num_kv_heads=5") == 0,
          "message '%s'", err.message);
    CHECK(err.status == MHA_STATUS_INVALID_ARG, "status filled");

    /* A successful call clears a previous error, for every kind of call. */
    c.num_kv_heads = 4;
    CHECK_OK(mha_layer_create(&c, &w, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err);
    CHECK(err.status == MHA_STATUS_OK && err.message[0] == '\0', "create cleared err: '%s'",
          err.message);
    mha_error stale;
    float x[2 * 24], y[2 * 24];
    memset(x, 0, sizeof x);
    mha_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.batch = 1, fa.q_len = 2, fa.query = x, fa.out = y;
    stale.status = MHA_STATUS_INTERNAL, strcpy(stale.message, "stale");
    CHECK_OK(mha_layer_forward(L, &fa, NULL, &stale), &stale);
    CHECK(stale.status == MHA_STATUS_OK && stale.message[0] == '\0', "forward cleared err");
    mha_attention_args a = core_args();
    stale.status = MHA_STATUS_INTERNAL, strcpy(stale.message, "stale");
    CHECK_OK(mha_attention(&a, NULL, &stale), &stale);
    CHECK(stale.status == MHA_STATUS_OK && stale.message[0] == '\0', "attention cleared err");
    mha_rope r;
    memset(&r, 0, sizeof r);
    r.style = MHA_ROPE_HALF;
    const int64_t xs[4] = {24, 24, 2, 1};
    stale.status = MHA_STATUS_INTERNAL, strcpy(stale.message, "stale");
    CHECK_OK(mha_rope_apply(&r, 1, 2, 12, 2, x, xs, NULL, 0, &stale), &stale);
    CHECK(stale.status == MHA_STATUS_OK && stale.message[0] == '\0', "rope_apply cleared err");
    float oa[4] = {1, 2, 3, 4}, la[1] = {0}, o[4];
    stale.status = MHA_STATUS_INTERNAL, strcpy(stale.message, "stale");
    CHECK_OK(mha_attention_merge(1, 4, oa, 4, la, oa, 4, la, o, 4, NULL, &stale), &stale);
    CHECK(stale.status == MHA_STATUS_OK && stale.message[0] == '\0', "merge cleared err");

    /* The rest of the API: each call after a stale error. */
#define CLEARS(call)                                                                               \
    do {                                                                                           \
        stale.status = MHA_STATUS_INTERNAL;                                                        \
        strcpy(stale.message, "stale");                                                            \
        CHECK_OK(call, &stale);                                                                    \
        CHECK(stale.status == MHA_STATUS_OK && stale.message[0] == '\0', "%s left '%s'", #call,    \
              stale.message);                                                                      \
    } while (0)
    float lse[4], dq[16], dout[16] = {0}, recv[4], yq[2 * 24];
    a.lse = lse;
    CLEARS(mha_attention(&a, NULL, &stale));
    mha_attention_grads g;
    memset(&g, 0, sizeof g);
    const int64_t s4[3] = {16, 16, 4};
    g.dout = dout, g.dq = dq;
    memcpy(g.dout_strides, s4, sizeof s4), memcpy(g.dq_strides, s4, sizeof s4);
    CLEARS(mha_attention_backward(&a, &g, NULL, &stale));
    mha_attention_stats st;
    memset(&st, 0, sizeof st);
    st.received = recv;
    CLEARS(mha_attention_statistics(&a, &st, NULL, &stale));
    CLEARS(mha_layer_project(L, MHA_PROJ_Q, 2, x, yq, NULL, &stale));
    double freqs[2], cs;
    CLEARS(mha_rope_frequencies(&r, 2, freqs, &cs, &stale));
    mha_train_state *state = NULL;
    CLEARS(mha_layer_forward_train(L, &fa, NULL, &state, &stale));
    mha_layer_grads gr;
    memset(&gr, 0, sizeof gr);
    gr.d_query = yq;
    CLEARS(mha_layer_backward(L, state, y, &gr, NULL, &stale));
    mha_train_state_destroy(state);
    mha_kv_cache_config kc;
    memset(&kc, 0, sizeof kc);
    kc.max_seq = 8, kc.batch = 1;
    mha_kv_cache *cache = NULL;
    CLEARS(mha_kv_cache_create(&kc, L, NULL, &cache, &stale));
    mha_decode_args da = {1, NULL, 1, x, y, NULL};
    CLEARS(mha_layer_prefill(L, cache, &da, NULL, &stale));
    CLEARS(mha_layer_decode_step(L, cache, &da, NULL, &stale));
    float kv[4 * 2];
    memset(kv, 0, sizeof kv);
    CLEARS(mha_kv_cache_append(cache, 1, NULL, 1, kv, kv, &stale));
    mha_kv_attention_args ka;
    memset(&ka, 0, sizeof ka);
    ka.num_seqs = 1, ka.num_tokens = 1, ka.num_heads = 12, ka.q = yq, ka.out = y;
    CLEARS(mha_kv_cache_attention(cache, &ka, NULL, &stale));
    CLEARS(mha_kv_cache_read(cache, 0, 0, kv, NULL, &stale));
    CLEARS(mha_kv_cache_truncate(cache, 0, 1, &stale));
    mha_kv_cache_destroy(cache);
#undef CLEARS
    mha_layer_destroy(L);
}

int main(void) {
    test_core_scalars();
    test_layer_scalars();
    test_core_aliasing();
    test_layer_aliasing();
    test_small_calls_aliasing();
    test_mla_backward_aliasing();
    test_output_self_overlap();
    test_layer_read_inputs();
    test_error_contract();
    return test_finish();
}
