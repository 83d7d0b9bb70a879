/* SPDX-License-Identifier: MIT */
/* test_block_mask.c: the block mask (docs/SEMANTICS.md "Block masks", "Mask functions").
 *
 *  1. Tile classes (mha_attention_mask_summary): hidden / visible / mixed counts of 64 x 64 tiles
 *     for masks whose classes are known by construction, including adversarial masks that look
 *     causal but differ in one element.
 *  2. The fast kernels, which read only the block mask, against the reference, which reads every
 *     mask element itself: forward (out, lse), backward (dq, dk, dv) and statistics, for tensor
 *     masks, key padding, segment ids, additive masks, mask functions and their combinations with
 *     the causal / window rules; tolerance TOL_OUT_REL of max|ref| (common/tolerance.h).
 *  3. A mask function and the bool tensor it describes give BIT-IDENTICAL results (forward,
 *     backward, statistics): prefix-LM, packed documents, a draft tree.
 */
#include "harness.h"
#include "tolerance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { B = 2, H = 4, D = 32 };

/* One problem: sizes, inputs, and the outputs of one run. */
typedef struct prob {
    int64_t n, m, g;
    float *q, *k, *v, *dout;
    unsigned char *mask; /* [B, n, m] bool, built per case */
} prob;

static void prob_init(prob *P, int64_t n, int64_t m, int64_t g, uint64_t seed) {
    test_rng r;
    test_rng_seed(&r, seed);
    P->n = n, P->m = m, P->g = g;
    P->q = malloc(sizeof(float) * B * H * n * D);
    P->k = malloc(sizeof(float) * B * g * m * D);
    P->v = malloc(sizeof(float) * B * g * m * D);
    P->dout = malloc(sizeof(float) * B * H * n * D);
    P->mask = calloc((size_t)(B * n * m), 1);
    test_fill_normal(&r, P->q, B * H * n * D, 1.0f);
    test_fill_normal(&r, P->k, B * g * m * D, 1.0f);
    test_fill_normal(&r, P->v, B * g * m * D, 1.0f);
    test_fill_normal(&r, P->dout, B * H * n * D, 1.0f);
}

static void prob_free(prob *P) {
    free(P->q), free(P->k), free(P->v), free(P->dout), free(P->mask);
}

/* Core args over P's contiguous [B, heads, L, D] tensors; masks left to the caller. */
static mha_attention_args core_args(const prob *P, float *out, float *lse) {
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = B, a.num_heads = H, a.num_kv_heads = P->g, a.q_len = P->n, a.kv_len = P->m;
    a.head_dim = D;
    a.q = P->q, a.k = P->k, a.v = P->v, a.out = out, a.lse = lse;
    const int64_t qs[3] = {H * P->n * D, P->n * D, D}, ks[3] = {P->g * P->m * D, P->m * D, D};
    memcpy(a.q_strides, qs, sizeof qs);
    memcpy(a.out_strides, qs, sizeof qs);
    memcpy(a.k_strides, ks, sizeof ks);
    memcpy(a.v_strides, ks, sizeof ks);
    return a;
}

static void use_tensor(mha_attention_args *a, const prob *P) {
    a->mask.bool_mask = (mha_mask_tensor){P->mask, MHA_DTYPE_BOOL, 4, {B, 1, P->n, P->m}};
}

/* Outputs of one forward + backward. */
typedef struct result {
    float *out, *lse, *dq, *dk, *dv;
} result;

static void run(const prob *P, const mha_attention_args *tmpl, mha_impl impl, result *R) {
    const int64_t no = B * H * P->n * D, nkv = B * P->g * P->m * D;
    R->out = calloc((size_t)no, sizeof(float));
    R->lse = calloc((size_t)(B * H * P->n), sizeof(float));
    R->dq = calloc((size_t)no, sizeof(float));
    R->dk = calloc((size_t)nkv, sizeof(float));
    R->dv = calloc((size_t)nkv, sizeof(float));
    mha_attention_args a = core_args(P, R->out, R->lse);
    a.mask = tmpl->mask;
    mha_exec ex = {.impl = impl, .n_threads = 2};
    mha_error err;
    CHECK_OK(mha_attention(&a, &ex, &err), &err);
    mha_attention_grads g;
    memset(&g, 0, sizeof g);
    g.dout = P->dout;
    memcpy(g.dout_strides, a.out_strides, sizeof g.dout_strides);
    g.dq = R->dq, g.dk = R->dk, g.dv = R->dv;
    memcpy(g.dq_strides, a.q_strides, sizeof g.dq_strides);
    memcpy(g.dk_strides, a.k_strides, sizeof g.dk_strides);
    memcpy(g.dv_strides, a.v_strides, sizeof g.dv_strides);
    CHECK_OK(mha_attention_backward(&a, &g, &ex, &err), &err);
}

static void result_free(result *R) {
    free(R->out), free(R->lse), free(R->dq), free(R->dk), free(R->dv);
}

/* max|x - y| <= TOL_OUT_REL max|y| (NaN fails); -inf lse must match exactly. */
static int close_to(const float *x, const float *y, int64_t count) {
    double worst = 0.0, scale = 0.0;
    for (int64_t i = 0; i < count; i++) {
        if (isinf(y[i]) || isinf(x[i])) {
            if (x[i] != y[i])
                return 0;
            continue;
        }
        const double d = fabs((double)x[i] - (double)y[i]);
        if (!(d <= worst)) /* catches NaN */
            worst = isnan(d) ? (double)INFINITY : d;
        scale = fmax(scale, fabs((double)y[i]));
    }
    return worst <= TOL_OUT_REL * (scale > 1.0 ? scale : 1.0);
}

/* The fast kernels (AUTO) against the reference for one mask setting. */
static void check_fast_vs_reference(const char *what, const prob *P, const mha_attention_args *t) {
    result f, r;
    run(P, t, MHA_IMPL_AUTO, &f);
    run(P, t, MHA_IMPL_REFERENCE, &r);
    const int64_t no = B * H * P->n * D, nkv = B * P->g * P->m * D;
    CHECK(close_to(f.out, r.out, no), "%s: forward out matches the reference", what);
    CHECK(close_to(f.lse, r.lse, B * H * P->n), "%s: lse matches the reference", what);
    CHECK(close_to(f.dq, r.dq, no), "%s: dq matches the reference", what);
    CHECK(close_to(f.dk, r.dk, nkv), "%s: dk matches the reference", what);
    CHECK(close_to(f.dv, r.dv, nkv), "%s: dv matches the reference", what);
    result_free(&f);
    result_free(&r);
}

/* ---------------------------------------------------------------------------------------------- */
/* Masks.                                                                                         */
/* ---------------------------------------------------------------------------------------------- */

/* Causal tril with diagonal offset delta, every batch row. */
static void fill_causal(prob *P, int64_t delta) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < P->n; i++)
            for (int64_t j = 0; j < P->m; j++)
                P->mask[(b * P->n + i) * P->m + j] = j <= i + delta;
}

/* Packed documents: doc[j] = j / len (the last may be short), batch row b shifted by b * 7. */
static int64_t doc_of(int64_t b, int64_t j, int64_t len) {
    return (j + b * 7) / len;
}

typedef struct docs_ctx {
    int64_t len;
    int causal;
} docs_ctx;

static int32_t docs_visible(void *ctx, int64_t b, int64_t h, int64_t i, int64_t j) {
    const docs_ctx *c = ctx;
    (void)h;
    return doc_of(b, i, c->len) == doc_of(b, j, c->len) && (!c->causal || j <= i);
}

/* Exact per tile: hidden when the row and key ranges share no document. */
static mha_tile_class
docs_classify(void *ctx, int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    const docs_ctx *c = ctx;
    (void)h;
    const int64_t r0 = doc_of(b, i0, c->len), r1 = doc_of(b, i1 - 1, c->len);
    const int64_t k0 = doc_of(b, j0, c->len), k1 = doc_of(b, j1 - 1, c->len);
    if (r1 < k0 || k1 < r0)
        return MHA_TILE_HIDDEN;
    if (r0 == r1 && k0 == k1 && r0 == k0 && (!c->causal || j1 - 1 <= i0))
        return MHA_TILE_VISIBLE;
    return MHA_TILE_MIXED;
}

static void fill_docs(prob *P, const docs_ctx *c) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < P->n; i++)
            for (int64_t j = 0; j < P->m; j++)
                P->mask[(b * P->n + i) * P->m + j] =
                    (unsigned char)docs_visible((void *)c, b, 0, i, j);
}

/* Prefix-LM: the first `prefix` keys are seen by every row, the rest causally. */
static int32_t prefix_visible(void *ctx, int64_t b, int64_t h, int64_t i, int64_t j) {
    (void)b, (void)h;
    return j < *(const int64_t *)ctx || j <= i;
}

/* A draft tree (speculative decoding): rows/keys >= root form a tree, parent[t] < t; a tree node
 * sees the prefix [0, root) and its ancestors (itself included); prefix rows are causal. */
typedef struct tree_ctx {
    int64_t root;
    const int64_t *parent; /* [n], -1 for the prefix and the root */
} tree_ctx;

static int32_t tree_visible(void *ctx, int64_t b, int64_t h, int64_t i, int64_t j) {
    const tree_ctx *t = ctx;
    (void)b, (void)h;
    if (j < t->root)
        return j <= i;
    for (int64_t a = i; a >= t->root; a = t->parent[a])
        if (a == j)
            return 1;
    return 0;
}

static void fill_fn(prob *P, int32_t (*fn)(void *, int64_t, int64_t, int64_t, int64_t), void *ctx) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < P->n; i++)
            for (int64_t j = 0; j < P->m; j++)
                P->mask[(b * P->n + i) * P->m + j] = (unsigned char)(fn(ctx, b, 0, i, j) != 0);
}

/* ---------------------------------------------------------------------------------------------- */
/* 1. Tile classes.                                                                               */
/* ---------------------------------------------------------------------------------------------- */

static mha_mask_summary summary_of(const prob *P, const mha_attention_args *t) {
    mha_attention_args a = core_args(P, NULL, NULL);
    a.mask = t->mask;
    mha_mask_summary s;
    mha_error err;
    CHECK_OK(mha_attention_mask_summary(&a, NULL, &s, &err), &err);
    return s;
}

static void expect_classes(const char *what,
                           const prob *P,
                           const mha_attention_args *t,
                           int64_t hidden,
                           int64_t visible,
                           int64_t mixed) {
    const mha_mask_summary s = summary_of(P, t);
    const int64_t planes = B * H; /* tile counts are over every (b, h) */
    CHECK(s.tiles_hidden == hidden * planes && s.tiles_visible == visible * planes &&
              s.tiles_mixed == mixed * planes,
          "%s: %lld hidden, %lld visible, %lld mixed tiles (expected %lld, %lld, %lld per plane)",
          what, (long long)s.tiles_hidden, (long long)s.tiles_visible, (long long)s.tiles_mixed,
          (long long)hidden, (long long)visible, (long long)mixed);
}

/* The classes of P->mask's tiles (every rule in the tensor), counted element by element over
 * every batch row and multiplied by the H heads: the summary must agree. */
static void expect_brute(const char *what, const prob *P, const mha_attention_args *t) {
    int64_t cnt[3] = {0, 0, 0};
    for (int64_t b = 0; b < B; b++)
        for (int64_t i0 = 0; i0 < P->n; i0 += 64)
            for (int64_t j0 = 0; j0 < P->m; j0 += 64) {
                int64_t seen = 0, all = 0;
                for (int64_t i = i0; i < i0 + 64 && i < P->n; i++)
                    for (int64_t j = j0; j < j0 + 64 && j < P->m; j++, all++)
                        seen += P->mask[(b * P->n + i) * P->m + j] != 0;
                cnt[seen == 0 ? 0 : seen == all ? 1 : 2] += H;
            }
    const mha_mask_summary s = summary_of(P, t);
    CHECK(s.tiles_hidden == cnt[0] && s.tiles_visible == cnt[1] && s.tiles_mixed == cnt[2],
          "%s: %lld hidden, %lld visible, %lld mixed tiles (counted: %lld, %lld, %lld)", what,
          (long long)s.tiles_hidden, (long long)s.tiles_visible, (long long)s.tiles_mixed,
          (long long)cnt[0], (long long)cnt[1], (long long)cnt[2]);
}

static void test_tile_classes(void) {
    prob P;
    prob_init(&P, 256, 256, H, 1);
    mha_attention_args t;
    memset(&t, 0, sizeof t);

    /* The built-in rule and the same rule as a tensor: 4 x 4 tiles, diagonal mixed. */
    t.mask.causal = 1;
    expect_classes("causal rule", &P, &t, 6, 6, 4);
    CHECK(summary_of(&P, &t).map_bytes == 0, "a rule alone builds no block mask");
    memset(&t.mask, 0, sizeof t.mask);
    fill_causal(&P, 0);
    use_tensor(&t, &P);
    expect_classes("causal tensor", &P, &t, 6, 6, 4);
    const mha_mask_summary s = summary_of(&P, &t);
    CHECK(s.map_planes == B && s.map_rows == 256 && s.map_bytes > 0,
          "a [B, 1, n, m] mask: %lld planes of %lld rows", (long long)s.map_planes,
          (long long)s.map_rows);

    /* Adversarial: causal but for one element. A visible element in a hidden tile makes that
     * tile mixed; a hidden one in a visible tile, likewise; on the diagonal nothing changes
     * class (the tile was mixed) but the kernels must still see it (part 2). */
    P.mask[10 * 256 + 200] = 1; /* (b 0, i 10, j 200): tile (0, 3) */
    P.mask[(256 + 10) * 256 + 200] = 1;
    expect_classes("causal + one visible far corner", &P, &t, 5, 6, 5);
    fill_causal(&P, 0);
    P.mask[255 * 256 + 3] = 0; /* (i 255, j 3): tile (3, 0) */
    P.mask[(256 + 255) * 256 + 3] = 0;
    expect_classes("causal - one element in the last row", &P, &t, 6, 5, 5);

    /* Key padding: 100 real keys of 256 -> key tiles 0 visible, 1 mixed, 2-3 hidden. */
    memset(&t.mask, 0, sizeof t.mask);
    unsigned char kp[B * 256];
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j < 256; j++)
            kp[b * 256 + j] = j < 100;
    t.mask.key_padding = (mha_mask_tensor){kp, MHA_DTYPE_U8, 2, {B, 256}};
    expect_classes("key padding 100 of 256", &P, &t, 8, 4, 4);
    CHECK(summary_of(&P, &t).map_rows == 1, "key padding alone stores one row per plane");

    /* Packed documents of 64 tokens, tile-aligned (no shift): block diagonal, nothing mixed. */
    int32_t seg[B * 256];
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j < 256; j++)
            seg[b * 256 + j] = (int32_t)(j / 64);
    memset(&t.mask, 0, sizeof t.mask);
    t.mask.q_segment_ids = t.mask.kv_segment_ids = seg;
    expect_classes("4 documents of 64 as segment ids", &P, &t, 12, 4, 0);

    /* An additive causal mask (0 / -inf) classifies as the causal rule; a finite value in a
     * visible tile keeps it visible (the bias is added there, nothing is hidden). */
    float *add = malloc(sizeof(float) * 256 * 256);
    for (int64_t i = 0; i < 256; i++)
        for (int64_t j = 0; j < 256; j++)
            add[i * 256 + j] = j <= i ? 0.0f : -INFINITY;
    memset(&t.mask, 0, sizeof t.mask);
    t.mask.additive_mask = (mha_mask_tensor){add, MHA_DTYPE_F32, 2, {256, 256}};
    expect_classes("additive causal", &P, &t, 6, 6, 4);
    add[200 * 256 + 5] = 0.5f;
    expect_classes("additive causal with one bias", &P, &t, 6, 6, 4);
    CHECK(summary_of(&P, &t).map_planes == 1, "a [n, m] mask is one plane for every (b, h)");
    free(add);

    /* A mask function with exact classify: the documents' classes. */
    docs_ctx dc = {64, 0};
    memset(&t.mask, 0, sizeof t.mask);
    t.mask.mask_fn = (mha_mask_fn){docs_visible, docs_classify, &dc, 1, 0};
    fill_docs(&P, &dc); /* batch row 1's documents are shifted by 7: mixed tiles there */
    expect_brute("documents as a function", &P, &t);
    use_tensor(&t, &P);
    expect_brute("documents as a function and the same tensor", &P, &t);
    dc.causal = 1;
    fill_docs(&P, &dc);
    expect_brute("causal documents as a function and tensor", &P, &t);
    prob_free(&P);
}

/* ---------------------------------------------------------------------------------------------- */
/* 2. Fast kernels vs the reference.                                                              */
/* ---------------------------------------------------------------------------------------------- */

static void test_against_reference(int64_t n, int64_t m, int64_t g) {
    prob P;
    prob_init(&P, n, m, g, 100 + (uint64_t)n);
    mha_attention_args t;
    char what[128];

    memset(&t, 0, sizeof t);
    fill_causal(&P, m - n);
    use_tensor(&t, &P);
    snprintf(what, sizeof what, "n=%lld m=%lld g=%lld bool causal", (long long)n, (long long)m,
             (long long)g);
    check_fast_vs_reference(what, &P, &t);

    /* One element away from causal, at each kind of place: the fast result must follow it. */
    const int64_t at[4][2] = {{0, m - 1}, {n - 1, 0}, {n / 2, n / 2 + m - n}, {n / 3, m / 2}};
    for (int c = 0; c < 4; c++) {
        fill_causal(&P, m - n);
        unsigned char *e = &P.mask[(1 * n + at[c][0]) * m + at[c][1]];
        *e = !*e;
        snprintf(what, sizeof what, "n=%lld m=%lld causal with (1, %lld, %lld) flipped",
                 (long long)n, (long long)m, (long long)at[c][0], (long long)at[c][1]);
        check_fast_vs_reference(what, &P, &t);
    }

    /* A U8 mask whose nonzero bytes are not all 1 (2, 128, 255: the block mask reads nonzero,
     * not the low bit), mostly visible with hidden runs. */
    test_rng rr;
    test_rng_seed(&rr, 5);
    static const unsigned char bytes[5] = {0, 1, 2, 128, 255};
    for (int64_t e = 0; e < B * n * m; e++)
        P.mask[e] = (e / 97) % 4 == 0 ? 0 : bytes[1 + test_rng_u64(&rr) % 4];
    for (int64_t e = 0; e < B * n * m; e += 13)
        P.mask[e] = 0;
    t.mask.bool_mask.dtype = MHA_DTYPE_U8;
    snprintf(what, sizeof what, "n=%lld m=%lld u8 mask of 0, 1, 2, 128, 255", (long long)n,
             (long long)m);
    check_fast_vs_reference(what, &P, &t);
    t.mask.bool_mask.dtype = MHA_DTYPE_BOOL;

    /* Documents as a tensor, with the window rule on top, and as segment ids with causal. */
    docs_ctx dc = {50, 1};
    fill_docs(&P, &dc);
    t.mask.use_window = 1, t.mask.window_left = 40, t.mask.window_right = 3;
    snprintf(what, sizeof what, "n=%lld m=%lld documents + window", (long long)n, (long long)m);
    check_fast_vs_reference(what, &P, &t);

    /* An additive mask: -inf blocks, finite values in some tiles, zeros elsewhere; plus key
     * padding and ALiBi-free causal. */
    float *add = malloc(sizeof(float) * (size_t)(n * m));
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < m; j++)
            add[i * m + j] = (j / 64 + i / 64) % 3 == 0 ? -INFINITY
                             : (i + j) % 5 == 0         ? 0.25f * (float)((i * j) % 7)
                                                        : 0.0f;
    unsigned char kp[B * 512];
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j < m; j++)
            kp[b * m + j] = j < m - 37 * b - 5;
    memset(&t, 0, sizeof t);
    t.mask.additive_mask = (mha_mask_tensor){add, MHA_DTYPE_F32, 2, {n, m}};
    t.mask.key_padding = (mha_mask_tensor){kp, MHA_DTYPE_U8, 2, {B, m}};
    t.mask.causal = 1;
    snprintf(what, sizeof what, "n=%lld m=%lld additive + key padding + causal", (long long)n,
             (long long)m);
    check_fast_vs_reference(what, &P, &t);
    free(add);

    /* A per-head, per-batch mask function without classify. */
    int64_t prefix = n / 3;
    memset(&t, 0, sizeof t);
    t.mask.mask_fn = (mha_mask_fn){prefix_visible, NULL, &prefix, 0, 0};
    snprintf(what, sizeof what, "n=%lld m=%lld prefix-LM function", (long long)n, (long long)m);
    check_fast_vs_reference(what, &P, &t);
    prob_free(&P);
}

/* ---------------------------------------------------------------------------------------------- */
/* 3. A function and its tensor: bit-identical.                                                   */
/* ---------------------------------------------------------------------------------------------- */

static int same_bits(const float *x, const float *y, int64_t count) {
    return memcmp(x, y, sizeof(float) * (size_t)count) == 0;
}

static void check_fn_equals_tensor(const char *what, prob *P, mha_mask_fn fn) {
    fill_fn(P, fn.visible, fn.ctx);
    mha_attention_args tf, tt;
    memset(&tf, 0, sizeof tf);
    memset(&tt, 0, sizeof tt);
    tf.mask.mask_fn = fn;
    use_tensor(&tt, P);
    const int64_t no = B * H * P->n * D, nkv = B * P->g * P->m * D;
    for (int impl = 0; impl < 2; impl++) {
        result a, b;
        const mha_impl im = impl ? MHA_IMPL_REFERENCE : MHA_IMPL_AUTO;
        run(P, &tf, im, &a);
        run(P, &tt, im, &b);
        const int ok = same_bits(a.out, b.out, no) && same_bits(a.lse, b.lse, B * H * P->n) &&
                       same_bits(a.dq, b.dq, no) && same_bits(a.dk, b.dk, nkv) &&
                       same_bits(a.dv, b.dv, nkv);
        CHECK(ok, "%s (%s): function and tensor give bit-identical out, lse, dq, dk, dv", what,
              impl ? "reference" : "fast");
        result_free(&a);
        result_free(&b);
    }
    /* Statistics: entropy and received attention. */
    float ent[2][B * H * 256], rec[2][B * H * 256];
    for (int w = 0; w < 2; w++) {
        mha_attention_args a = core_args(P, NULL, NULL);
        a.mask = w ? tt.mask : tf.mask;
        mha_attention_stats s;
        memset(&s, 0, sizeof s);
        s.entropy = ent[w];
        s.received = rec[w];
        mha_error err;
        CHECK_OK(mha_attention_statistics(&a, &s, NULL, &err), &err);
    }
    CHECK(same_bits(ent[0], ent[1], B * H * P->n) && same_bits(rec[0], rec[1], B * H * P->m),
          "%s: statistics bit-identical", what);
}

static void test_functions(void) {
    prob P;
    prob_init(&P, 200, 200, 2, 7);
    int64_t prefix = 70;
    check_fn_equals_tensor("prefix-LM", &P, (mha_mask_fn){prefix_visible, NULL, &prefix, 0, 0});
    docs_ctx dc = {45, 1};
    check_fn_equals_tensor("packed documents (classify)", &P,
                           (mha_mask_fn){docs_visible, docs_classify, &dc, 1, 0});
    check_fn_equals_tensor("packed documents (no classify)", &P,
                           (mha_mask_fn){docs_visible, NULL, &dc, 1, 0});
    int64_t parent[200];
    for (int64_t t = 0; t < 200; t++)
        parent[t] = t <= 150 ? -1 : 150 + (t - 151) / 3; /* a ternary tree under node 150 */
    tree_ctx tc = {150, parent};
    check_fn_equals_tensor("draft tree", &P, (mha_mask_fn){tree_visible, NULL, &tc, 0, 0});

    /* A classify without visible is refused with a message. */
    mha_attention_args a = core_args(&P, NULL, NULL);
    a.mask.mask_fn.classify = docs_classify;
    mha_mask_summary s;
    mha_error err;
    CHECK(mha_attention_mask_summary(&a, NULL, &s, &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "mask_fn"),
          "classify without visible: INVALID_ARG naming mask_fn (%s)", err.message);
    prob_free(&P);
}

/* An additive -inf hides its key as a bool mask does (docs/SEMANTICS.md, "Mask polarity"): a NaN
 * key behind it reaches no row. Before issue 29 it was added like a bias (NaN + -inf = NaN): every
 * row of that head came out NaN. Fast and reference, against the same key hidden by a bool mask. */
static void test_additive_inf_hides(void) {
    prob P;
    prob_init(&P, 70, 90, 2, 13);
    const int64_t hidden = 37;
    for (int64_t d = 0; d < D; d++) /* key 37 of batch row 0, kv head 0 */
        P.k[hidden * D + d] = NAN;
    float *add = calloc((size_t)(P.n * P.m), sizeof(float));
    for (int64_t i = 0; i < P.n; i++) {
        add[i * P.m + hidden] = -INFINITY;
        add[i * P.m + (i * 7) % P.m] += 0.5f; /* a bias elsewhere: the tiles stay mixed */
    }
    for (int64_t e = 0; e < B * P.n * P.m; e++)
        P.mask[e] = e % P.m != hidden;
    const int64_t no = B * H * P.n * D;
    for (int impl = 0; impl < 2; impl++) {
        const mha_impl im = impl ? MHA_IMPL_REFERENCE : MHA_IMPL_AUTO;
        mha_attention_args ta, tb;
        memset(&ta, 0, sizeof ta);
        ta.mask.additive_mask = (mha_mask_tensor){add, MHA_DTYPE_F32, 2, {P.n, P.m}};
        tb = ta;
        use_tensor(&tb, &P); /* the bool mask on top: the same key hidden twice */
        result ra, rb;
        run(&P, &ta, im, &ra);
        run(&P, &tb, im, &rb);
        int finite = 1;
        for (int64_t e = 0; e < no; e++)
            finite &= isfinite(ra.out[e]) != 0 && isfinite(ra.dq[e]) != 0;
        CHECK(finite && same_bits(ra.out, rb.out, no) && same_bits(ra.lse, rb.lse, B * H * P.n),
              "%s: an additive -inf hides a NaN key as a bool mask does (finite out and dq, the "
              "same bits as with the bool mask)",
              impl ? "reference" : "fast");
        result_free(&ra);
        result_free(&rb);
    }
    free(add);
    prob_free(&P);
}

/* A block mask built once (mha_block_mask_create) and used by the forward and the backward:
 * the same bits as the calls that build their own; refused for other masks or sizes. */
static void test_block_mask_handle(void) {
    prob P;
    prob_init(&P, 150, 170, 2, 11);
    docs_ctx dc = {40, 1};
    fill_docs(&P, &dc);
    mha_attention_args t;
    memset(&t, 0, sizeof t);
    use_tensor(&t, &P);
    t.mask.use_window = 1, t.mask.window_left = 50, t.mask.window_right = 0;
    result own;
    run(&P, &t, MHA_IMPL_AUTO, &own);

    const int64_t no = B * H * P.n * D, nkv = B * P.g * P.m * D;
    result R = {calloc((size_t)no, 4), calloc((size_t)(B * H * P.n), 4), calloc((size_t)no, 4),
                calloc((size_t)nkv, 4), calloc((size_t)nkv, 4)};
    mha_attention_args a = core_args(&P, R.out, R.lse);
    a.mask = t.mask;
    mha_block_mask *bm = NULL;
    mha_error err;
    CHECK_OK(mha_block_mask_create(&a, NULL, &bm, &err), &err);
    mha_exec ex = {.impl = MHA_IMPL_AUTO, .n_threads = 2};
    CHECK_OK(mha_attention_masked(&a, bm, &ex, &err), &err);
    mha_attention_grads g;
    memset(&g, 0, sizeof g);
    g.dout = P.dout;
    memcpy(g.dout_strides, a.out_strides, sizeof g.dout_strides);
    g.dq = R.dq, g.dk = R.dk, g.dv = R.dv;
    memcpy(g.dq_strides, a.q_strides, sizeof g.dq_strides);
    memcpy(g.dk_strides, a.k_strides, sizeof g.dk_strides);
    memcpy(g.dv_strides, a.v_strides, sizeof g.dv_strides);
    CHECK_OK(mha_attention_backward_masked(&a, &g, bm, &ex, &err), &err);
    CHECK(same_bits(R.out, own.out, no) && same_bits(R.lse, own.lse, B * H * P.n) &&
              same_bits(R.dq, own.dq, no) && same_bits(R.dk, own.dk, nkv) &&
              same_bits(R.dv, own.dv, nkv),
          "a block mask built once: forward and backward bit-identical to building per call");

    /* Other masks (another tensor, another polarity) or other sizes: refused, nothing run. */
    mha_attention_args other = a;
    other.mask.bool_mask_polarity = MHA_MASK_BLOCK;
    CHECK(mha_attention_masked(&other, bm, &ex, &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "other masks"),
          "a block mask used with another polarity: INVALID_ARG (%s)", err.message);
    other = a;
    other.q_len = P.n - 1;
    CHECK(mha_attention_backward_masked(&other, &g, bm, &ex, &err) == MHA_STATUS_INVALID_ARG,
          "a block mask used for other sizes: INVALID_ARG (%s)", err.message);
    CHECK(mha_attention_masked(&a, NULL, &ex, &err) == MHA_STATUS_INVALID_ARG,
          "a NULL block mask: INVALID_ARG");
    mha_block_mask_destroy(bm);
    mha_block_mask_destroy(NULL);
    result_free(&own);
    result_free(&R);
    prob_free(&P);
}

int main(void) {
    test_tile_classes();
    test_against_reference(150, 200, H);
    test_against_reference(256, 256, 2);
    test_against_reference(130, 70, 1);
    test_functions();
    test_block_mask_handle();
    test_additive_inf_hides();
    return test_finish();
}
