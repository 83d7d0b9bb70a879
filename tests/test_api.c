/* SPDX-License-Identifier: MIT */
/* test_api.c: every error path of the C API gives its status and a message naming the argument,
 * never a crash, and leaves outputs untouched. Also: status strings, version, NULL handling,
 * workspaces, allocator hooks, the block cache. */
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Checks status and that the message contains `needle`. */
static void expect(
    mha_status got, const mha_error *err, mha_status want, const char *needle, const char *what) {
    CHECK(got == want, "%s: status %s, expected %s (%s)", what, mha_status_string(got),
          mha_status_string(want), err->message);
    CHECK(err->status == got, "%s: err->status not filled", what);
    CHECK(strstr(err->message, needle) != NULL, "%s: message '%s' lacks '%s'", what, err->message,
          needle);
}

static void test_status_strings(void) {
    CHECK(strcmp(mha_status_string(MHA_STATUS_OK), "success") == 0, "OK string");
    CHECK(strcmp(mha_status_string((mha_status)999), "unknown status") == 0, "unknown string");
    CHECK(MHA_STATUS_INVALID_ARG == 1 && MHA_STATUS_INTERNAL == 9, "stable status values");
    char v[32];
    snprintf(v, sizeof v, "%d.%d.%d", MHA_VERSION_MAJOR, MHA_VERSION_MINOR, MHA_VERSION_PATCH);
    CHECK(strcmp(mha_version(), v) == 0, "version %s vs %s", mha_version(), v);
    CHECK(mha_dtype_size(MHA_DTYPE_BF16) == 2 && mha_dtype_size((mha_dtype)77) == 0, "dtype size");
}

static float W[64 * 64];

static mha_weights plain_weights(void) {
    mha_weights w = {0};
    w.w_q = w.w_k = w.w_v = w.w_o = W;
    return w;
}

static void test_layer_create_errors(void) {
    mha_error err;
    mha_layer *L = (mha_layer *)&err; /* must be reset to NULL on error */
    mha_weights w = plain_weights();
    mha_config c = {0};
    c.q_dim = 16, c.num_heads = 4;

    expect(mha_layer_create(NULL, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "config is NULL", "NULL config");
    CHECK(L == NULL, "out reset to NULL on error");
    expect(mha_layer_create(&c, NULL, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "weights is NULL", "NULL weights");
    expect(mha_layer_create(&c, &w, MHA_WEIGHTS_COPY, NULL, NULL, &err), &err,
           MHA_STATUS_INVALID_ARG, "out", "NULL out");
    expect(mha_layer_create(&c, &w, (mha_ownership)5, NULL, &L, &err), &err, MHA_STATUS_INVALID_ARG,
           "ownership", "bad ownership");

    mha_config bad = c;
    bad.q_dim = 0;
    expect(mha_layer_create(&bad, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "q_dim=0", "q_dim 0");
    bad = c, bad.num_heads = -3;
    expect(mha_layer_create(&bad, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "num_heads=-3", "negative heads");
    bad = c, bad.num_heads = 5;
    expect(mha_layer_create(&bad, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "not divisible by num_heads=5", "q_dim % heads");
    bad = c, bad.num_kv_heads = 3;
    expect(mha_layer_create(&bad, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "num_kv_heads=3", "heads % kv heads");
    bad = c, bad.head_dim = (int64_t)1 << 40;
    expect(mha_layer_create(&bad, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "head_dim", "absurd head_dim");
    bad = c, bad.num_heads = (int64_t)1 << 30, bad.head_dim = (int64_t)1 << 30,
    bad.q_dim = (int64_t)1 << 30;
    expect(mha_layer_create(&bad, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err, MHA_STATUS_OVERFLOW,
           "overflow", "weight size overflow");
    bad = c, bad.scale = (double)NAN;
    expect(mha_layer_create(&bad, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "scale", "NaN scale");
    bad = c, bad.softcap = -1.0;
    expect(mha_layer_create(&bad, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "softcap", "negative softcap");
    bad = c, bad.rope.style = MHA_ROPE_HALF, bad.rope.rotary_dim = 3;
    expect(mha_layer_create(&bad, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "rotary_dim=3", "odd rotary dim");
    bad = c, bad.rope.style = MHA_ROPE_HALF, bad.rope.rotary_dim = 8;
    expect(mha_layer_create(&bad, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "rotary_dim=8", "rotary dim > head dim");
    bad = c, bad.rope.style = (mha_rope_style)9;
    expect(mha_layer_create(&bad, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "rope.style", "bad rope style");
    bad = c, bad.rope.style = MHA_ROPE_HALF, bad.rope.theta = -5.0;
    expect(mha_layer_create(&bad, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "theta", "bad theta");
    bad = c, bad.rope.style = MHA_ROPE_HALF, bad.rope.scaling = MHA_ROPE_SCALING_LLAMA3,
    bad.rope.low_freq_factor = 4.0, bad.rope.high_freq_factor = 2.0;
    expect(mha_layer_create(&bad, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "high_freq_factor", "llama3 factors");
    bad = c, bad.rope.style = MHA_ROPE_HALF, bad.rope.scaling = MHA_ROPE_SCALING_LINEAR,
    bad.rope.factor = -2.0;
    expect(mha_layer_create(&bad, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "factor", "negative factor");
    bad = c, bad.rope.style = MHA_ROPE_HALF, bad.rope.scaling = (mha_rope_scaling_type)12;
    expect(mha_layer_create(&bad, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "scaling", "unknown scaling");

    mha_weights ww = w;
    ww.w_k = NULL;
    expect(mha_layer_create(&c, &ww, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "weights.w_k is NULL", "missing w_k");
    bad = c, bad.bias_v = 1;
    expect(mha_layer_create(&bad, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "weights.b_v is NULL", "missing bias");
    ww = w, ww.b_o = W;
    expect(mha_layer_create(&c, &ww, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "b_o is given but the config does not enable it",
           "unexpected bias");
    static float nan_w[16 * 16];
    nan_w[37] = NAN;
    ww = w, ww.w_o = nan_w;
    expect(mha_layer_create(&c, &ww, MHA_WEIGHTS_COPY, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "weights.w_o[37] is nan", "NaN weight");
    nan_w[37] = INFINITY;
    expect(mha_layer_create(&c, &ww, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err,
           MHA_STATUS_INVALID_ARG, "weights.w_o[37] is inf", "Inf weight");
    mha_layer_destroy(NULL); /* no-op */
    CHECK(mha_layer_config(NULL) == NULL && mha_layer_weights(NULL) == NULL, "NULL getters");
}

/* A failing allocator: allocation failure is a status, not a crash, and nothing leaks. */
static void *failing_alloc(void *user, size_t bytes, size_t align) {
    (void)bytes, (void)align;
    int *budget = user;
    if (*budget <= 0)
        return NULL;
    (*budget)--;
    return aligned_alloc(64, (bytes + 63) & ~(size_t)63);
}
static void plain_free(void *user, void *p) {
    (void)user;
    free(p);
}

static void test_forward_errors(void) {
    mha_error err;
    mha_weights w = plain_weights();
    mha_config c = {0};
    c.q_dim = 16, c.num_heads = 4;
    mha_layer *L;
    CHECK_OK(mha_layer_create(&c, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err);
    float x[3 * 16], y[3 * 16];
    for (int i = 0; i < 48; i++)
        x[i] = (float)i * 0.01f, y[i] = 12345.0f;
    mha_forward_args a = {0};
    a.batch = 1, a.q_len = 3, a.query = x, a.out = y;

    mha_forward_args b = a;
    b.batch = 0;
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "batch=0",
           "batch 0");
    b = a, b.query = NULL;
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "query", "NULL q");
    expect(mha_layer_forward(NULL, &a, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "layer is NULL",
           "NULL layer");
    b = a, b.value = x;
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "value is given",
           "value without key");
    b = a, b.key = x, b.kv_len = 0;
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "kv_len=0",
           "cross kv_len 0");
    int64_t pos[3] = {0, -1, 2};
    b = a, b.q_positions = pos;
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_INVALID_ARG,
           "q_positions[0][1]=-1", "negative position");
    pos[1] = (int64_t)1 << 40;
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_INVALID_ARG,
           "q_positions[0][1]=1099511627776", "absurd position");
    b = a, b.q_len = (int64_t)1 << 31, b.batch = (int64_t)1 << 31;
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_OVERFLOW, "overflow",
           "overflowing B*n*h*d");
    b = a, b.dropout.p = 1.0f, b.dropout.training = 1;
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "dropout.p=1",
           "dropout 1");
    b = a, b.mask.alignment = (mha_alignment)7;
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "alignment=7",
           "bad alignment");
    b = a, b.mask.alignment = MHA_ALIGN_EXPLICIT;
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "align_offsets",
           "explicit without offsets");
    b = a, b.mask.use_window = 1, b.mask.window_left = -2;
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "window",
           "bad window");
    uint8_t m8[12] = {1};
    b = a, b.mask.bool_mask = (mha_mask_tensor){m8, MHA_DTYPE_U8, 2, {4, 3}};
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "does not broadcast",
           "mask shape");
    b = a, b.mask.bool_mask = (mha_mask_tensor){m8, MHA_DTYPE_F32, 2, {3, 3}};
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "bool_mask.dtype",
           "float bool mask");
    b = a, b.mask.bool_mask = (mha_mask_tensor){m8, MHA_DTYPE_U8, 5, {1, 1, 1, 3}};
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "ndim=5",
           "mask ndim");
    b = a, b.mask.bool_mask = (mha_mask_tensor){m8, MHA_DTYPE_U8, 4, {1, 1, 3, 3}};
    b.mask.bool_mask_polarity = (mha_mask_polarity)3;
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "polarity",
           "bad polarity");
    b = a, b.mask.additive_mask = (mha_mask_tensor){m8, MHA_DTYPE_U8, 2, {3, 3}};
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "must be F32",
           "int additive mask");
    b = a, b.mask.key_padding = (mha_mask_tensor){m8, MHA_DTYPE_U8, 2, {2, 3}};
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "key padding",
           "key padding batch");
    b = a, b.mask.key_padding = (mha_mask_tensor){m8, MHA_DTYPE_U8, 3, {1, 1, 3}};
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "[B, m] or [m]",
           "key padding ndim");
    int32_t seg[3] = {0};
    b = a, b.mask.q_segment_ids = seg;
    expect(mha_layer_forward(L, &b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "together",
           "one segment array");
    mha_exec ex = {(mha_impl)8, 1, NULL, 0, NULL, NULL};
    expect(mha_layer_forward(L, &a, &ex, &err), &err, MHA_STATUS_INVALID_ARG, "impl=8",
           "unknown impl");
    char small[16];
    ex = (mha_exec){MHA_IMPL_AUTO, 1, small, sizeof small, NULL, NULL};
    expect(mha_layer_forward(L, &a, &ex, &err), &err, MHA_STATUS_WORKSPACE_TOO_SMALL,
           "workspace_bytes=16", "workspace too small");
    int budget = 0;
    mha_allocator failing = {&budget, failing_alloc, plain_free};
    ex = (mha_exec){MHA_IMPL_AUTO, 1, NULL, 0, &failing, NULL};
    expect(mha_layer_forward(L, &a, &ex, &err), &err, MHA_STATUS_NO_MEMORY, "allocate",
           "allocation failure");

    int untouched = 1;
    for (int i = 0; i < 48; i++)
        untouched &= y[i] == 12345.0f;
    CHECK(untouched, "outputs must be untouched after failing calls");

    /* The workspace the size query announces is enough, and a caller workspace is used. */
    size_t need = 0;
    CHECK_OK(mha_layer_forward_workspace_size(L, &a, NULL, &need, &err), &err);
    char *ws = malloc(need);
    ex = (mha_exec){MHA_IMPL_REFERENCE, 1, ws, need, NULL, NULL};
    CHECK_OK(mha_layer_forward(L, &a, &ex, &err), &err);
    free(ws);
    CHECK_OK(mha_layer_forward_supported(L, &a, NULL, &err), &err);
    mha_layer_destroy(L);

    /* Layer creation through a failing allocator. */
    budget = 0;
    expect(mha_layer_create(&c, &w, MHA_WEIGHTS_COPY, &failing, &L, &err), &err,
           MHA_STATUS_NO_MEMORY, "layer", "create with no memory");
    budget = 1; /* the layer struct, then the weight copy fails */
    expect(mha_layer_create(&c, &w, MHA_WEIGHTS_COPY, &failing, &L, &err), &err,
           MHA_STATUS_NO_MEMORY, "weight", "weight copy with no memory");
}

static void test_attention_errors(void) {
    float q[16] = {0}, o[16];
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = 1, a.num_heads = 1, a.q_len = 2, a.kv_len = 2, a.head_dim = 4;
    a.q = a.k = a.v = q, a.out = o;
    const int64_t s[3] = {8, 8, 4};
    memcpy(a.q_strides, s, sizeof s), memcpy(a.k_strides, s, sizeof s);
    memcpy(a.v_strides, s, sizeof s), memcpy(a.out_strides, s, sizeof s);
    mha_error err;
    CHECK_OK(mha_attention(&a, NULL, &err), &err);
    mha_attention_args b = a;
    b.q_strides[1] = -1;
    expect(mha_attention(&b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "q_strides[1]=-1",
           "negative stride");
    b = a, b.k_strides[0] = INT64_MAX / 2;
    b.batch = 3;
    expect(mha_attention(&b, NULL, &err), &err, MHA_STATUS_OVERFLOW, "k: offsets overflow",
           "stride overflow");
    b = a, b.num_kv_heads = 3, b.num_heads = 4;
    expect(mha_attention(&b, NULL, &err), &err, MHA_STATUS_INVALID_ARG,
           "num_heads=4 is not divisible by num_kv_heads=3", "gqa divisibility");
    b = a, b.head_dim = 0;
    expect(mha_attention(&b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "head_dim=0", "head_dim 0");
    b = a, b.softcap = (double)INFINITY;
    expect(mha_attention(&b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "softcap", "inf cap");
    b = a, b.out = NULL;
    expect(mha_attention(&b, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "must not be NULL",
           "NULL out");
    expect(mha_attention(NULL, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "args is NULL",
           "NULL args");
    /* err may be NULL: the status alone still comes back. */
    CHECK(mha_attention(NULL, NULL, NULL) == MHA_STATUS_INVALID_ARG, "NULL err");
    size_t bytes;
    CHECK_OK(mha_attention_workspace_size(&a, NULL, &bytes, &err), &err);
    CHECK_OK(mha_attention_supported(&a, NULL, &err), &err);
    /* Every size is checked before the workspace is sized or allocated: an out-of-range
     * v_head_dim once sized the reference's scratch at 8 GiB before the call was refused
     * (found by fuzz_api; its input is fuzz/corpus/api/regress-oom-v-head-dim). */
    {
        int none = 0;
        mha_allocator no_memory = {&none, failing_alloc, plain_free};
        mha_exec ref = {MHA_IMPL_REFERENCE, 1, NULL, 0, &no_memory, NULL};
        b = a, b.v_head_dim = ((int64_t)1 << 31) + 1;
        expect(mha_attention(&b, &ref, &err), &err, MHA_STATUS_INVALID_ARG,
               "v_head_dim=", "huge v_head_dim refused before allocating");
        expect(mha_attention_workspace_size(&b, &ref, &bytes, &err), &err, MHA_STATUS_INVALID_ARG,
               "v_head_dim=", "huge v_head_dim refused by the size query");
        b = a, b.head_dim = -((int64_t)1 << 31);
        expect(mha_attention(&b, &ref, &err), &err, MHA_STATUS_INVALID_ARG,
               "head_dim=", "negative head_dim refused before allocating");
        /* The backward too (its flash scratch holds n * d_k floats per thread). */
        float lse[2] = {0}, dq[16];
        mha_attention_grads gr;
        memset(&gr, 0, sizeof gr);
        gr.dout = q, gr.dq = dq, gr.dk = dq, gr.dv = dq;
        b = a, b.lse = lse, b.q_len = (int64_t)1 << 40;
        mha_exec fast = {MHA_IMPL_AUTO, 1, NULL, 0, &no_memory, NULL};
        expect(mha_attention_backward(&b, &gr, &fast, &err), &err, MHA_STATUS_INVALID_ARG,
               "q_len=", "huge q_len refused by the backward before allocating");
        expect(mha_attention_backward_workspace_size(&b, &gr, &fast, &bytes, &err), &err,
               MHA_STATUS_INVALID_ARG, "q_len=", "huge q_len refused by the backward size query");
    }

    /* RoPE API errors. */
    mha_rope r = {0};
    r.style = MHA_ROPE_INTERLEAVED;
    const int64_t xs[4] = {8, 4, 4, 1}, xs_bad[4] = {8, 4, 4, 2};
    int64_t pos[2] = {0, -4};
    expect(mha_rope_apply(&r, 1, 2, 1, 4, q, xs_bad, NULL, 0, &err), &err, MHA_STATUS_INVALID_ARG,
           "contiguous", "rope stride");
    expect(mha_rope_apply(&r, 1, 2, 1, 4, q, xs, pos, 0, &err), &err, MHA_STATUS_INVALID_ARG,
           "positions[0][1]=-4", "rope negative position");
    expect(mha_rope_apply(&r, 1, 2, 1, 0, q, xs, NULL, 0, &err), &err, MHA_STATUS_INVALID_ARG,
           "head_dim=0", "rope head_dim 0");
    r.rotary_dim = 6;
    expect(mha_rope_apply(&r, 1, 2, 1, 4, q, xs, NULL, 0, &err), &err, MHA_STATUS_INVALID_ARG,
           "rotary_dim=6", "rope rotary > head");
    double freqs[2], cs;
    r.rotary_dim = 0;
    CHECK_OK(mha_rope_frequencies(&r, 4, freqs, &cs, &err), &err);
    CHECK(freqs[0] == 1.0 && fabs(freqs[1] - 0.01) < 1e-15 && cs == 1.0, "rope freqs %g %g",
          freqs[0], freqs[1]);
}

/* A caller workspace of exactly the reported size works at any alignment (the query includes
 * slack for rounding up to 64 bytes), gives the same result as a library-allocated one, and with
 * it the call allocates nothing: a failing allocator is never asked. Fast kernels (AVX-512
 * aligned stores) ran here; a malloc'd workspace at an odd offset once crashed them. */
static void test_workspace_alignment(void) {
    enum { N = 40, D = 64, H = 4, DK = D / H };
    static float x[N * D], wts[4 * D * D], y_ref[N * D], y[N * D];
    for (int i = 0; i < N * D; i++)
        x[i] = (float)((i * 37 % 101) - 50) / 50.0f;
    for (int i = 0; i < 4 * D * D; i++)
        wts[i] = (float)((i * 53 % 97) - 48) / 400.0f;
    mha_config c = {0};
    c.q_dim = D, c.num_heads = H;
    mha_weights w = {0};
    w.w_q = wts, w.w_k = wts + D * D, w.w_v = wts + 2 * D * D, w.w_o = wts + 3 * D * D;
    mha_error err;
    mha_layer *L = NULL;
    CHECK_OK(mha_layer_create(&c, &w, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err);
    mha_forward_args a = {0};
    a.batch = 1, a.q_len = N, a.query = x, a.mask.causal = 1;
    a.out = y_ref;
    CHECK_OK(mha_layer_forward(L, &a, NULL, &err), &err);
    int budget = 0;
    mha_allocator failing = {&budget, failing_alloc, plain_free};
    mha_exec ex = {MHA_IMPL_AUTO, 2, NULL, 0, &failing, NULL};
    size_t need = 0;
    CHECK_OK(mha_layer_forward_workspace_size(L, &a, &ex, &need, &err), &err);
    char *buf = malloc(need + 64);
    CHECK(buf != NULL, "workspace malloc");
    for (int off = 0; buf && off < 64; off += 7) {
        ex.workspace = buf + off, ex.workspace_bytes = need;
        a.out = y;
        CHECK_OK(mha_layer_forward(L, &a, &ex, &err), &err);
        CHECK(!memcmp(y, y_ref, sizeof y), "layer forward with a workspace at offset %d", off);
        ex.workspace_bytes = need - 64; /* below the aligned layout whatever the offset */
        expect(mha_layer_forward(L, &a, &ex, &err), &err, MHA_STATUS_WORKSPACE_TOO_SMALL,
               "workspace_bytes", "workspace too small after alignment");
    }
    free(buf);
    mha_layer_destroy(L);

    /* The core and its backward, on [1, N, H, DK] views. */
    static float q[N * D], k[N * D], v[N * D], o_ref[N * D], o[N * D], lse[H * N], dq[N * D],
        dk[N * D], dv[N * D], dq_ref[N * D];
    for (int i = 0; i < N * D; i++)
        q[i] = x[i], k[i] = x[(i + 5) % (N * D)], v[i] = x[(i + 11) % (N * D)];
    mha_attention_args at = {0};
    at.batch = 1, at.num_heads = H, at.q_len = at.kv_len = N, at.head_dim = DK;
    const int64_t s[3] = {N * D, DK, D};
    at.q = q, at.k = k, at.v = v, at.out = o_ref, at.lse = lse, at.mask.causal = 1;
    memcpy(at.q_strides, s, sizeof s), memcpy(at.k_strides, s, sizeof s);
    memcpy(at.v_strides, s, sizeof s), memcpy(at.out_strides, s, sizeof s);
    CHECK_OK(mha_attention(&at, NULL, &err), &err);
    mha_attention_grads g = {0};
    g.dout = x, g.dq = dq_ref, g.dk = dk, g.dv = dv;
    memcpy(g.dout_strides, s, sizeof s), memcpy(g.dq_strides, s, sizeof s);
    memcpy(g.dk_strides, s, sizeof s), memcpy(g.dv_strides, s, sizeof s);
    CHECK_OK(mha_attention_backward(&at, &g, NULL, &err), &err);
    size_t need_f = 0, need_b = 0;
    ex = (mha_exec){MHA_IMPL_AUTO, 2, NULL, 0, &failing, NULL};
    CHECK_OK(mha_attention_workspace_size(&at, &ex, &need_f, &err), &err);
    CHECK_OK(mha_attention_backward_workspace_size(&at, &g, &ex, &need_b, &err), &err);
    buf = malloc((need_f > need_b ? need_f : need_b) + 64);
    CHECK(buf != NULL, "workspace malloc");
    for (int off = 1; buf && off < 64; off += 9) {
        ex.workspace = buf + off, ex.workspace_bytes = need_f;
        at.out = o;
        CHECK_OK(mha_attention(&at, &ex, &err), &err);
        CHECK(!memcmp(o, o_ref, sizeof o), "attention with a workspace at offset %d", off);
        at.out = o_ref;
        ex.workspace_bytes = need_b;
        g.dq = dq;
        CHECK_OK(mha_attention_backward(&at, &g, &ex, &err), &err);
        CHECK(!memcmp(dq, dq_ref, sizeof dq), "backward with a workspace at offset %d", off);
        g.dq = dq_ref;
    }
    free(buf);
}

/* The loader with and without safetensors support (-DMHA_SAFETENSORS=OFF): a missing file is an
 * I/O error naming it, or UNSUPPORTED saying how the library was built; *out is NULL either way. */
static void test_safetensors_switch(void) {
    mha_layer *layer = (mha_layer *)&layer;
    mha_error err;
    mha_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_heads = 4;
    const mha_status st = mha_layer_load_safetensors("no/such/file.safetensors", NULL, NULL, &cfg,
                                                     NULL, &layer, &err);
#if MHA_TEST_SAFETENSORS
    CHECK(st == MHA_STATUS_IO && strstr(err.message, "no/such/file.safetensors") && !layer,
          "missing file: %s %s", mha_status_string(st), err.message);
#else
    CHECK(st == MHA_STATUS_UNSUPPORTED && strstr(err.message, "MHA_SAFETENSORS=OFF") && !layer,
          "built without safetensors: %s %s", mha_status_string(st), err.message);
#endif
}

/* mha_layer_project: each map equals y = x W^T + b computed in double (a 3 x 5 -> 4-head
 * layer: Q, K, V [3, 4], O [3, 4]), with y untouched on every error. */
static void test_layer_project(void) {
    float w[4][16], b[4][4], x[3 * 4];
    for (int i = 0; i < 4; i++) {
        for (int j = 0; j < 16; j++)
            w[i][j] = (float)((i + 1) * (j % 5) - 3) * 0.125f;
        for (int j = 0; j < 4; j++)
            b[i][j] = (float)(j - i) * 0.5f;
    }
    for (int i = 0; i < 12; i++)
        x[i] = (float)(i % 7) - 2.5f;
    mha_config cfg = {0};
    cfg.q_dim = 4, cfg.num_heads = 2, cfg.bias_q = cfg.bias_k = cfg.bias_v = cfg.bias_o = 1;
    mha_weights wt = {w[0], w[1], w[2], w[3], b[0], b[1], b[2], b[3], NULL, NULL, NULL};
    mha_layer *layer = NULL;
    mha_error err;
    CHECK_OK(mha_layer_create(&cfg, &wt, MHA_WEIGHTS_BORROW, NULL, &layer, &err), &err);
    if (!layer)
        return;
    for (int which = 0; which < 4; which++)
        for (int impl = 0; impl < 3; impl++) {
            float y[12];
            mha_exec ex = {0};
            ex.impl = (mha_impl)impl;
            CHECK_OK(mha_layer_project(layer, (mha_projection)which, 3, x, y, &ex, &err), &err);
            double worst = 0.0;
            for (int r = 0; r < 3; r++)
                for (int o = 0; o < 4; o++) {
                    double ref = (double)b[which][o];
                    for (int c = 0; c < 4; c++)
                        ref += (double)x[r * 4 + c] * (double)w[which][o * 4 + c];
                    worst = fmax(worst, fabs(ref - (double)y[r * 4 + o]));
                }
            CHECK(worst <= 1e-5, "mha_layer_project which=%d impl=%d: max error %.3g", which, impl,
                  worst);
        }
    float y[12] = {0}, zero[12] = {0};
    CHECK(mha_layer_project(NULL, MHA_PROJ_Q, 3, x, y, NULL, &err) == MHA_STATUS_INVALID_ARG,
          "mha_layer_project: NULL layer");
    CHECK(mha_layer_project(layer, (mha_projection)4, 3, x, y, NULL, &err) ==
              MHA_STATUS_INVALID_ARG,
          "mha_layer_project: which=4");
    CHECK(mha_layer_project(layer, MHA_PROJ_Q, -1, x, y, NULL, &err) == MHA_STATUS_INVALID_ARG,
          "mha_layer_project: negative rows");
    CHECK(mha_layer_project(layer, MHA_PROJ_Q, 3, NULL, y, NULL, &err) == MHA_STATUS_INVALID_ARG,
          "mha_layer_project: NULL x");
    CHECK(mha_layer_project(layer, MHA_PROJ_Q, INT64_MAX / 2, x, y, NULL, &err) ==
              MHA_STATUS_OVERFLOW,
          "mha_layer_project: rows overflow");
    CHECK(memcmp(y, zero, sizeof y) == 0, "mha_layer_project: y untouched on errors");

    /* The backward: dx = dy W, dW = dy^T x, db = column sums of dy, written then accumulated. */
    float dy[12], dx[12], dw[16], db[4];
    for (int i = 0; i < 12; i++)
        dy[i] = (float)((i * 5) % 11) * 0.25f - 1.0f;
    for (int which = 0; which < 4; which++)
        for (int impl = 0; impl < 3; impl++)
            for (int acc = 0; acc < 2; acc++) {
                mha_exec ex = {0};
                ex.impl = (mha_impl)impl;
                const float base = acc ? 1.0f : 0.0f;
                for (int i = 0; i < 16; i++)
                    dw[i] = base, dx[i % 12] = base, db[i % 4] = base;
                CHECK_OK(mha_layer_project_backward(layer, (mha_projection)which, 3, x, dy, dx, dw,
                                                    db, acc, &ex, &err),
                         &err);
                double worst = 0.0;
                for (int o = 0; o < 4; o++) {
                    double sb = (double)base;
                    for (int r = 0; r < 3; r++)
                        sb += (double)dy[r * 4 + o];
                    worst = fmax(worst, fabs(sb - (double)db[o]));
                    for (int c = 0; c < 4; c++) {
                        double sw = (double)base;
                        for (int r = 0; r < 3; r++)
                            sw += (double)dy[r * 4 + o] * (double)x[r * 4 + c];
                        worst = fmax(worst, fabs(sw - (double)dw[o * 4 + c]));
                    }
                }
                for (int r = 0; r < 3; r++)
                    for (int c = 0; c < 4; c++) {
                        double sx = (double)base;
                        for (int o = 0; o < 4; o++)
                            sx += (double)dy[r * 4 + o] * (double)w[which][o * 4 + c];
                        worst = fmax(worst, fabs(sx - (double)dx[r * 4 + c]));
                    }
                CHECK(worst <= 1e-5, "mha_layer_project_backward which=%d impl=%d acc=%d: %.3g",
                      which, impl, acc, worst);
            }
    float keep[16];
    memcpy(keep, dw, sizeof keep);
    CHECK(mha_layer_project_backward(layer, MHA_PROJ_Q, 3, NULL, dy, NULL, dw, NULL, 0, NULL,
                                     &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "x is NULL"),
          "mha_layer_project_backward: dw without x");
    CHECK(mha_layer_project_backward(layer, MHA_PROJ_Q, 3, x, NULL, dx, NULL, NULL, 0, NULL,
                                     &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "dy is NULL"),
          "mha_layer_project_backward: NULL dy");
    CHECK(memcmp(keep, dw, sizeof keep) == 0, "mha_layer_project_backward: untouched on errors");
    mha_layer_destroy(layer);
    /* db for a projection without a bias. */
    cfg.bias_o = 0, wt.b_o = NULL;
    CHECK_OK(mha_layer_create(&cfg, &wt, MHA_WEIGHTS_BORROW, NULL, &layer, &err), &err);
    CHECK(mha_layer_project_backward(layer, MHA_PROJ_O, 3, x, dy, NULL, NULL, db, 0, NULL, &err) ==
              MHA_STATUS_INVALID_ARG,
          "mha_layer_project_backward: db without a bias");
    mha_layer_destroy(layer);
}

/* Dynamic NTK RoPE (docs/SEMANTICS.md, "RoPE"): mha_rope_at_length against the formula written
 * out here; mha_rope_apply and the layer's forward and backward take the rope at the call's length
 * (1 + the largest position): bit-identical to the same calls with the fixed rope it becomes. */
static void test_dynamic_rope(void) {
    enum { N = 40, D = 16, H = 2, DK = 8 };
    mha_error err;
    mha_rope dyn = {0}, at, fixed;
    dyn.style = MHA_ROPE_HALF, dyn.scaling = MHA_ROPE_SCALING_DYNAMIC, dyn.factor = 4.0;
    expect(mha_rope_at_length(&dyn, DK, N, &at, &err), &err, MHA_STATUS_INVALID_ARG,
           "original_max_position", "dynamic rope without its original length");
    dyn.original_max_position = 16.0;
    double freqs[DK / 2], cs;
    expect(mha_rope_frequencies(&dyn, DK, freqs, &cs, &err), &err, MHA_STATUS_INVALID_ARG,
           "mha_rope_at_length", "a dynamic rope has no frequencies of its own");
    CHECK_OK(mha_rope_at_length(&dyn, DK, 16, &at, &err), &err);
    CHECK(at.scaling == MHA_ROPE_SCALING_NONE, "dynamic rope at its original length: unscaled");
    CHECK_OK(mha_rope_at_length(&dyn, DK, N, &at, &err), &err);
    CHECK(at.scaling == MHA_ROPE_SCALING_NTK && at.factor == 4.0 * N / 16.0 - 3.0,
          "dynamic rope at %d: scaling %d factor %g", N, (int)at.scaling, at.factor);
    CHECK_OK(mha_rope_frequencies(&at, DK, freqs, &cs, &err), &err);
    const double theta = 10000.0 * pow(7.0, DK / (DK - 2.0)); /* factor 4 * 40/16 - 3 = 7 */
    for (int k = 0; k < DK / 2; k++)
        CHECK(fabs(freqs[k] - pow(theta, -2.0 * k / DK)) <= 1e-15 * freqs[k],
              "dynamic rope f_%d = %.17g", k, freqs[k]);

    /* mha_rope_apply: positions up to 39 (length 40), then up to 15 (unscaled). */
    static float x[N * D], y[N * D], wts[4 * D * D], out_d[N * D], out_f[N * D];
    for (int i = 0; i < N * D; i++)
        x[i] = (float)((i * 37 % 101) - 50) / 50.0f;
    const int64_t xs[4] = {5 * DK, DK, DK, 1};
    int64_t pos[5] = {0, 3, 39, 7, 2};
    mha_rope plain = dyn;
    plain.scaling = MHA_ROPE_SCALING_NONE;
    for (int round = 0; round < 2; round++) {
        memcpy(y, x, sizeof(float) * 5 * DK);
        CHECK_OK(mha_rope_apply(&dyn, 1, 5, 1, DK, y, xs, pos, 0, &err), &err);
        memcpy(out_f, x, sizeof(float) * 5 * DK);
        CHECK_OK(mha_rope_apply(round ? &plain : &at, 1, 5, 1, DK, out_f, xs, pos, 0, &err), &err);
        CHECK(!memcmp(y, out_f, sizeof(float) * 5 * DK), "dynamic mha_rope_apply, round %d", round);
        pos[2] = 15;
    }

    /* The layer, causal self-attention over positions 0 .. N-1: forward and backward. */
    for (int i = 0; i < 4 * D * D; i++)
        wts[i] = (float)((i * 53 % 97) - 48) / 400.0f;
    mha_weights w = {0};
    w.w_q = wts, w.w_k = wts + D * D, w.w_v = wts + 2 * D * D, w.w_o = wts + 3 * D * D;
    CHECK_OK(mha_rope_at_length(&dyn, DK, N, &fixed, &err), &err);
    const mha_rope *ropes[2] = {&dyn, &fixed};
    static float grads[2][3][N * D];
    for (int i = 0; i < 2; i++) {
        mha_config c = {0};
        c.q_dim = D, c.num_heads = H, c.rope = *ropes[i];
        mha_layer *L = NULL;
        CHECK_OK(mha_layer_create(&c, &w, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err);
        mha_forward_args a = {0};
        a.batch = 1, a.q_len = N, a.query = x, a.mask.causal = 1;
        a.out = i ? out_f : out_d;
        mha_train_state *st = NULL;
        CHECK_OK(mha_layer_forward_train(L, &a, NULL, &st, &err), &err);
        mha_layer_grads g = {0};
        g.d_query = grads[i][0], g.dw_q = grads[i][1], g.dw_k = grads[i][2];
        CHECK_OK(mha_layer_backward(L, st, x, &g, NULL, &err), &err);
        mha_train_state_destroy(st);
        mha_layer_destroy(L);
    }
    CHECK(!memcmp(out_d, out_f, sizeof out_d), "dynamic rope layer forward == fixed rope at N");
    CHECK(!memcmp(grads[0], grads[1], sizeof grads[0]), "dynamic rope layer backward == fixed");
}

/* LongRoPE: per-pair divisors, the long list for calls longer than original_max_position, cos and
 * sin times the attention factor (default sqrt(1 + ln(factor) / ln(original_max))). */
static void test_longrope(void) {
    enum { DK = 8 };
    mha_error err;
    mha_rope lr = {0}, at;
    lr.style = MHA_ROPE_HALF, lr.scaling = MHA_ROPE_SCALING_LONGROPE;
    lr.factor = 8.0, lr.original_max_position = 16.0;
    const double shrt[DK / 2] = {1.0, 1.5, 2.0, 3.0}, lng[DK / 2] = {1.0, 2.0, 4.0, 8.0};
    memcpy(lr.short_factor, shrt, sizeof shrt);
    expect(mha_rope_at_length(&lr, DK, 20, &at, &err), &err, MHA_STATUS_INVALID_ARG,
           "long_factor[0]=0", "longrope without its long list");
    memcpy(lr.long_factor, lng, sizeof lng);
    double freqs[DK / 2], cs;
    expect(mha_rope_frequencies(&lr, DK, freqs, &cs, &err), &err, MHA_STATUS_INVALID_ARG,
           "mha_rope_at_length", "longrope frequencies depend on the length");
    for (int len = 16; len <= 17; len++) {
        CHECK_OK(mha_rope_at_length(&lr, DK, len, &at, &err), &err);
        CHECK_OK(mha_rope_frequencies(&at, DK, freqs, &cs, &err), &err);
        const double *ext = len > 16 ? lng : shrt;
        for (int k = 0; k < DK / 2; k++)
            CHECK(fabs(freqs[k] - pow(10000.0, -2.0 * k / DK) / ext[k]) <= 1e-15 * freqs[k],
                  "longrope at %d: f_%d = %.17g", len, k, freqs[k]);
        CHECK(fabs(cs - sqrt(1.0 + log(8.0) / log(16.0))) < 1e-15, "longrope factor %.17g", cs);
    }
    /* mha_rope_apply takes the list of its positions' length. */
    float x[3 * DK], y[3 * DK];
    for (int i = 0; i < 3 * DK; i++)
        x[i] = (float)(i % 7) - 3.0f;
    const int64_t xs[4] = {3 * DK, DK, DK, 1};
    const int64_t pos[3] = {2, 19, 5};
    memcpy(y, x, sizeof x);
    CHECK_OK(mha_rope_apply(&lr, 1, 3, 1, DK, y, xs, pos, 0, &err), &err);
    CHECK_OK(mha_rope_at_length(&lr, DK, 20, &at, &err), &err);
    CHECK_OK(mha_rope_apply(&at, 1, 3, 1, DK, x, xs, pos, 0, &err), &err);
    CHECK(!memcmp(x, y, sizeof x), "longrope mha_rope_apply takes the long list at length 20");
}

/* mha_block_cache: a training step (forward_train + backward, 2 threads) through the cache gives
 * the bits of the default allocator; the blocks of one step are reused by the next (the bytes held
 * stop growing); with a 1-byte idle cap every freed block goes back to the system. */
enum { BC_D = 64, BC_N = 48 };
static void block_cache_step(const mha_layer *L, const mha_allocator *alloc, float *out) {
    static float x[BC_N * BC_D], dy[BC_N * BC_D];
    for (int i = 0; i < BC_N * BC_D; i++) {
        x[i] = (float)((i * 37 % 101) - 50) / 50.0f;
        dy[i] = (float)((i * 59 % 89) - 44) / 44.0f;
    }
    mha_error err;
    mha_exec ex = {0};
    ex.n_threads = 2, ex.allocator = alloc;
    mha_forward_args a = {0};
    a.batch = 1, a.q_len = BC_N, a.query = x, a.out = out, a.mask.causal = 1;
    mha_train_state *st = NULL;
    CHECK_OK(mha_layer_forward_train(L, &a, &ex, &st, &err), &err);
    mha_layer_grads g = {0};
    g.d_query = out + BC_N * BC_D, g.dw_q = out + 2 * BC_N * BC_D;
    g.dw_o = out + 2 * BC_N * BC_D + BC_D * BC_D;
    CHECK_OK(mha_layer_backward(L, st, dy, &g, &ex, &err), &err);
    mha_train_state_destroy(st);
}

static void test_block_cache(void) {
    enum { OUT = 2 * BC_N * BC_D + 2 * BC_D * BC_D };
    static float wts[4 * BC_D * BC_D], ref[OUT], got[OUT];
    for (int i = 0; i < 4 * BC_D * BC_D; i++)
        wts[i] = (float)((i * 53 % 97) - 48) / 800.0f;
    mha_weights w = {0};
    w.w_q = wts, w.w_k = wts + BC_D * BC_D, w.w_v = wts + 2 * BC_D * BC_D;
    w.w_o = wts + 3 * BC_D * BC_D;
    mha_config c = {0};
    c.q_dim = BC_D, c.num_heads = 4;
    mha_error err;
    mha_layer *L = NULL;
    CHECK_OK(mha_layer_create(&c, &w, MHA_WEIGHTS_BORROW, NULL, &L, &err), &err);
    block_cache_step(L, NULL, ref);

    mha_block_cache *cache = NULL;
    CHECK_OK(mha_block_cache_create(0, &cache, &err), &err);
    const mha_allocator *alloc = mha_block_cache_allocator(cache);
    size_t held[4];
    for (int step = 0; step < 4; step++) {
        memset(got, 0, sizeof got);
        block_cache_step(L, alloc, got);
        CHECK(!memcmp(got, ref, sizeof ref), "block cache step %d: outputs differ", step);
        held[step] = mha_block_cache_bytes(cache);
    }
    CHECK(held[0] > 0, "block cache holds the first step's blocks");
    CHECK(held[3] == held[1] && held[2] == held[1], "block cache: steady state (%zu %zu %zu %zu)",
          held[0], held[1], held[2], held[3]);
    mha_block_cache_destroy(cache);

    CHECK_OK(mha_block_cache_create(1, &cache, &err), &err); /* idle cap 1 byte: keeps nothing */
    block_cache_step(L, mha_block_cache_allocator(cache), got);
    CHECK(!memcmp(got, ref, sizeof ref), "block cache with a 1-byte cap: outputs differ");
    CHECK(mha_block_cache_bytes(cache) == 0, "a 1-byte cap holds %zu bytes",
          mha_block_cache_bytes(cache));
    mha_block_cache_destroy(cache);
    mha_layer_destroy(L);

    expect(mha_block_cache_create(0, NULL, &err), &err, MHA_STATUS_INVALID_ARG, "out",
           "block cache without out");
    CHECK(mha_block_cache_allocator(NULL) == NULL && mha_block_cache_bytes(NULL) == 0,
          "block cache NULL handling");
    mha_block_cache_destroy(NULL);
}

int main(void) {
    test_safetensors_switch();
    test_status_strings();
    test_layer_create_errors();
    test_forward_errors();
    test_attention_errors();
    test_workspace_alignment();
    test_layer_project();
    test_dynamic_rope();
    test_longrope();
    test_block_cache();
    return test_finish();
}
