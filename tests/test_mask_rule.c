/* SPDX-License-Identifier: MIT */
/* test_mask_rule.c: mha_mask_recognize (issue 29). Every kind of rule is built as a tensor in
 * every mask dtype, both polarities and the usual broadcast shapes, with n < m, n == m and n > m,
 * and must come back as that rule; the rule's visibility must equal the tensor's element for
 * element; masks that look causal but differ in one element (every position class, one head of
 * many, one batch row of many) and additive masks with a finite "minus infinity" must not be
 * taken for a rule; and mha_attention with the rule (mha_mask_rule_apply) must give the tensor's
 * out and lse bit for bit. Argument checks last. */
#include "harness.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------- */
/* Visibility patterns [B, H, n, m] and their tensors.                                            */

enum { MAXB = 3, MAXM = 4500 };

/* band AND key padding: visible iff (!hi_on || j <= i + hi) && (!lo_on || j >= i + lo) &&
 * keys[b][j]; then `flip` elements are inverted (adversarial cases). */
typedef struct pattern {
    int64_t B, H, n, m;
    int hi_on, lo_on;
    int64_t hi, lo;
    int64_t chunk; /* > 0 (with hi_on): also floor(j / chunk) == floor((i + hi) / chunk) */
    uint8_t keys[MAXB][MAXM];
    int nflip;
    int64_t flip[4][4]; /* (b, h, i, j) */
} pattern;

static pattern pattern_new(int64_t B, int64_t H, int64_t n, int64_t m) {
    pattern p;
    memset(&p, 0, sizeof p);
    p.B = B, p.H = H, p.n = n, p.m = m;
    memset(p.keys, 1, sizeof p.keys);
    return p;
}

/* floor(a / c), c > 0, also for a negative a. */
static int64_t floor_div(int64_t a, int64_t c) {
    return a >= 0 ? a / c : -((-a + c - 1) / c);
}

static int pattern_visible(const pattern *p, int64_t b, int64_t h, int64_t i, int64_t j) {
    int v = (!p->hi_on || j <= i + p->hi) && (!p->lo_on || j >= i + p->lo) && p->keys[b][j];
    if (p->chunk > 0 && floor_div(j, p->chunk) != floor_div(i + p->hi, p->chunk))
        v = 0;
    for (int f = 0; f < p->nflip; f++)
        if (p->flip[f][0] == b && p->flip[f][1] == h && p->flip[f][2] == i && p->flip[f][3] == j)
            v = !v;
    return v;
}

/* What a recognised rule (and its key vector kp [B, m]) says about (b, i, j): mha.h's formula. */
static int rule_visible(
    const mha_mask_rule *r, const uint8_t *kp, int64_t m, int64_t b, int64_t i, int64_t j) {
    const int64_t p = i + r->delta;
    if (r->causal && j > p)
        return 0;
    if (r->use_window && ((r->window_left >= 0 && j < p - r->window_left) ||
                          (r->window_right >= 0 && j > p + r->window_right)))
        return 0;
    if (r->chunk_size > 0 && floor_div(j, r->chunk_size) != floor_div(p, r->chunk_size))
        return 0;
    return kp[b * m + j] != 0;
}

/* A tensor of `shape` (broadcast to the pattern's [B, H, n, m]) holding the pattern. */
typedef struct tensor {
    mha_mask_tensor t;
    void *buf;
    int additive;
    mha_mask_polarity polarity;
} tensor;

static void store(tensor *x, int64_t at, int visible, int64_t salt) {
    if (x->additive) {
        /* Visible elements alternate +0 and -0: both are "no bias". */
        ((float *)x->buf)[at] = visible ? (salt % 2 ? -0.0f : 0.0f) : -INFINITY;
        return;
    }
    const int nonzero = x->polarity == MHA_MASK_ATTEND ? visible : !visible;
    const int64_t v = nonzero ? (salt % 3 == 0 ? -5 : 1 + salt % 7) : 0; /* any nonzero counts */
    switch (x->t.dtype) {
    case MHA_DTYPE_I32:
        ((int32_t *)x->buf)[at] = (int32_t)v;
        break;
    case MHA_DTYPE_I64:
        ((int64_t *)x->buf)[at] = v * ((int64_t)1 << 40);
        break;
    case MHA_DTYPE_U8:
        ((uint8_t *)x->buf)[at] = (uint8_t)(nonzero ? (v & 0xff ? v & 0xff : 1) : 0);
        break;
    default:
        ((uint8_t *)x->buf)[at] = nonzero ? 1 : 0;
        break;
    }
}

static tensor tensor_make(const pattern *p,
                          int ndim,
                          const int64_t *shape,
                          mha_dtype dtype,
                          int additive,
                          mha_mask_polarity polarity) {
    tensor x;
    memset(&x, 0, sizeof x);
    x.t.dtype = additive ? MHA_DTYPE_F32 : dtype;
    x.t.ndim = ndim;
    int64_t count = 1, idx4[4] = {1, 1, 1, 1};
    for (int d = 0; d < ndim; d++) {
        x.t.shape[d] = shape[d];
        idx4[4 - ndim + d] = shape[d];
        count *= shape[d];
    }
    x.additive = additive;
    x.polarity = polarity;
    x.buf = malloc((size_t)count * mha_dtype_size(x.t.dtype));
    x.t.data = x.buf;
    int64_t at = 0;
    for (int64_t b = 0; b < idx4[0]; b++)
        for (int64_t h = 0; h < idx4[1]; h++)
            for (int64_t i = 0; i < idx4[2]; i++)
                for (int64_t j = 0; j < idx4[3]; j++, at++)
                    store(&x, at, pattern_visible(p, b, h, i, j), at);
    return x;
}

/* A degenerate pattern (one row or one key) may have two exact descriptions (n = 1: a causal
 * band or key padding hide the same keys); any recognised kind will do there. */
#define ANY_RULE ((mha_mask_rule_kind)-1)

/* Recognises x against the pattern's sizes; checks the kind and that the rule reproduces every
 * element of the pattern (for a recognised kind). Returns the rule; kp gets [B, m]. */
static mha_mask_rule recognise(
    const pattern *p, const tensor *x, mha_mask_rule_kind want, uint8_t *kp, const char *what) {
    mha_mask_rule r;
    mha_error err;
    memset(&r, 0xab, sizeof r);
    CHECK_OK(
        mha_mask_recognize(&x->t, x->additive, x->polarity, p->B, p->H, p->n, p->m, &r, kp, &err),
        &err);
    char desc[160];
    CHECK(want == ANY_RULE ? r.kind != MHA_MASK_RULE_NONE : r.kind == want,
          "%s: kind %d (%s), expected %d", what, (int)r.kind,
          mha_mask_rule_describe(&r, desc, sizeof desc), (int)want);
    if (r.kind == MHA_MASK_RULE_NONE)
        return r;
    int64_t bad = 0;
    for (int64_t b = 0; b < p->B; b++)
        for (int64_t h = 0; h < p->H; h++)
            for (int64_t i = 0; i < p->n; i++)
                for (int64_t j = 0; j < p->m; j++)
                    bad += rule_visible(&r, kp, p->m, b, i, j) != pattern_visible(p, b, h, i, j);
    CHECK(bad == 0, "%s: the rule %s differs from the tensor in %lld elements", what,
          mha_mask_rule_describe(&r, desc, sizeof desc), (long long)bad);
    return r;
}

/* ---------------------------------------------------------------------------------------------- */
/* mha_attention with the tensor vs with the rule: out and lse bit for bit.                       */

static void fill(float *x, int64_t count, uint64_t seed) {
    test_rng r;
    test_rng_seed(&r, seed);
    test_fill_normal(&r, x, count, 1.0f);
}

/* tolerance 0: out and lse bit for bit (memcmp); otherwise max |difference| <= tolerance. */
static void attention_same(const pattern *p,
                           const tensor *x,
                           const mha_mask_rule *r,
                           const uint8_t *kp,
                           mha_impl impl,
                           double tolerance,
                           const char *what) {
    const int64_t B = p->B, H = p->H, n = p->n, m = p->m, d = 24;
    float *q = malloc(sizeof(float) * (size_t)(B * H * n * d));
    float *k = malloc(sizeof(float) * (size_t)(B * H * m * d));
    float *v = malloc(sizeof(float) * (size_t)(B * H * m * d));
    float *out[2], *lse[2];
    for (int t = 0; t < 2; t++) {
        out[t] = malloc(sizeof(float) * (size_t)(B * H * n * d));
        lse[t] = malloc(sizeof(float) * (size_t)(B * H * n));
    }
    fill(q, B * H * n * d, 1), fill(k, B * H * m * d, 2), fill(v, B * H * m * d, 3);
    int64_t offsets[MAXB];
    mha_exec ex;
    memset(&ex, 0, sizeof ex);
    ex.impl = impl;
    ex.n_threads = 2;
    for (int t = 0; t < 2; t++) {
        mha_attention_args a;
        memset(&a, 0, sizeof a);
        a.batch = B, a.num_heads = H, a.q_len = n, a.kv_len = m, a.head_dim = d;
        a.q = q, a.k = k, a.v = v, a.out = out[t], a.lse = lse[t];
        const int64_t qs[3] = {H * n * d, n * d, d}, ks[3] = {H * m * d, m * d, d};
        memcpy(a.q_strides, qs, sizeof qs), memcpy(a.out_strides, qs, sizeof qs);
        memcpy(a.k_strides, ks, sizeof ks), memcpy(a.v_strides, ks, sizeof ks);
        a.mask.window_left = a.mask.window_right = -1;
        mha_error err;
        if (t == 0) { /* the tensor */
            if (x->additive)
                a.mask.additive_mask = x->t;
            else
                a.mask.bool_mask = x->t, a.mask.bool_mask_polarity = x->polarity;
        } else {
            CHECK_OK(mha_mask_rule_apply(r, B, n, m, kp, offsets, &a.mask, &err), &err);
        }
        CHECK_OK(mha_attention(&a, &ex, &err), &err);
    }
    if (tolerance > 0.0) {
        double worst = 0.0;
        for (int64_t e = 0; e < B * H * n * d; e++)
            worst = fmax(worst, fabs((double)out[0][e] - (double)out[1][e]));
        for (int64_t e = 0; e < B * H * n; e++)
            worst = fmax(worst, fabs((double)lse[0][e] - (double)lse[1][e]));
        CHECK(worst <= tolerance, "%s (impl %d): tensor and rule differ by %.3g", what, (int)impl,
              worst);
    } else {
        CHECK(memcmp(out[0], out[1], sizeof(float) * (size_t)(B * H * n * d)) == 0,
              "%s (impl %d): out differs between the tensor and the rule", what, (int)impl);
        CHECK(memcmp(lse[0], lse[1], sizeof(float) * (size_t)(B * H * n)) == 0,
              "%s (impl %d): lse differs between the tensor and the rule", what, (int)impl);
    }
    free(q), free(k), free(v);
    for (int t = 0; t < 2; t++)
        free(out[t]), free(lse[t]);
}

/* ---------------------------------------------------------------------------------------------- */
/* Every kind x dtype x polarity x shape x (n, m).                                                */

typedef struct kind_case {
    const char *name;
    mha_mask_rule_kind kind;
    void (*setup)(pattern *p);
} kind_case;

static void causal_top_left(pattern *p) {
    p->hi_on = 1, p->hi = 0;
}
static void causal_bottom_right(pattern *p) {
    p->hi_on = 1, p->hi = p->m - p->n;
}
static void tril_plus2(pattern *p) { /* torch.tril(ones, 2) */
    p->hi_on = 1, p->hi = 2;
}
static void tril_minus1(pattern *p) { /* torch.tril(ones, -1): row 0 sees nothing */
    p->hi_on = 1, p->hi = -1;
}
static void causal_window(pattern *p) { /* Mistral: causal, 3 keys back */
    p->hi_on = 1, p->hi = p->m - p->n, p->lo_on = 1, p->lo = p->m - p->n - 3;
}
static void lower_edge_only(pattern *p) { /* torch.triu(ones, -2): j >= i - 2 */
    p->lo_on = 1, p->lo = -2;
}
static void padding_only(pattern *p) { /* batch row b: its last b + 1 keys are padding */
    for (int64_t b = 0; b < p->B; b++)
        for (int64_t j = p->m - 1 - b > 0 ? p->m - 1 - b : 0; j < p->m; j++)
            p->keys[b][j] = 0;
}
static void hf_left_padded(pattern *p) { /* HF: causal (bottom-right) AND left padding */
    causal_bottom_right(p);
    for (int64_t b = 0; b < p->B; b++)
        for (int64_t j = 0; j < 2 * b + 1 && j < p->m; j++)
            p->keys[b][j] = 0;
}
static void hf_right_padded(pattern *p) { /* causal (top-left) AND right padding, sparse too */
    causal_top_left(p);
    p->keys[0][p->m - 1] = 0;
    p->keys[p->B - 1][1] = 0;
}
static void all_visible(pattern *p) {
    (void)p;
}
static void all_hidden(pattern *p) {
    memset(p->keys, 0, sizeof p->keys);
}

static const kind_case KINDS[] = {
    {"causal top-left", MHA_MASK_RULE_BAND, causal_top_left},
    {"causal bottom-right", MHA_MASK_RULE_BAND, causal_bottom_right},
    {"tril(+2)", MHA_MASK_RULE_BAND, tril_plus2},
    {"tril(-1)", MHA_MASK_RULE_BAND, tril_minus1},
    {"causal window", MHA_MASK_RULE_BAND, causal_window},
    {"lower edge only", MHA_MASK_RULE_BAND, lower_edge_only},
    {"key padding", MHA_MASK_RULE_KEY_PADDING, padding_only},
    {"HF left padded", MHA_MASK_RULE_BAND_AND_KEY_PADDING, hf_left_padded},
    {"HF right padded", MHA_MASK_RULE_BAND_AND_KEY_PADDING, hf_right_padded},
    {"all visible", MHA_MASK_RULE_ALL_VISIBLE, all_visible},
    {"all hidden", MHA_MASK_RULE_KEY_PADDING, all_hidden},
};

/* The kind a pattern must give in a shape that cannot hold per-batch keys, and whether the
 * pattern fits that shape (per-batch keys need a batch dimension of B). */
static int fits(const kind_case *k, int per_batch_shape) {
    return per_batch_shape ||
           !(k->setup == padding_only || k->setup == hf_left_padded || k->setup == hf_right_padded);
}

/* Some (n, m) make a pattern degenerate (a band that hides nothing): then the expected kind
 * changes, and is derived from the pattern itself. */
static mha_mask_rule_kind expected_kind(const kind_case *k, const pattern *p) {
    int any_hidden_by_band = 0, any_padding = 0, any_visible = 0;
    for (int64_t b = 0; b < p->B; b++)
        for (int64_t j = 0; j < p->m; j++)
            for (int64_t i = 0; i < p->n; i++) {
                const int band = (!p->hi_on || j <= i + p->hi) && (!p->lo_on || j >= i + p->lo);
                any_hidden_by_band |= !band;
                any_padding |= band && !p->keys[b][j]; /* padding that hides something */
                any_visible |= band && p->keys[b][j];
            }
    if (k->setup == all_hidden || !any_visible)
        return MHA_MASK_RULE_KEY_PADDING;
    if (any_hidden_by_band)
        return any_padding ? MHA_MASK_RULE_BAND_AND_KEY_PADDING : MHA_MASK_RULE_BAND;
    return any_padding ? MHA_MASK_RULE_KEY_PADDING : MHA_MASK_RULE_ALL_VISIBLE;
}

static void test_kinds(void) {
    static const int64_t sizes[][2] = {{6, 6}, {4, 9}, {9, 4}, {1, 7}, {7, 1}};
    static const mha_dtype dtypes[] = {MHA_DTYPE_BOOL, MHA_DTYPE_U8, MHA_DTYPE_I32, MHA_DTYPE_I64};
    const int64_t B = 3, H = 2;
    int attention_runs = 0;
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        const int64_t n = sizes[s][0], m = sizes[s][1];
        /* Shapes: [n, m], [1, 1, n, m], [B, 1, n, m], [B, H, n, m] (equal heads), [B, 1, 1, m]
         * for row-independent patterns. */
        const int64_t shapes[5][4] = {
            {n, m}, {1, 1, n, m}, {B, 1, n, m}, {B, H, n, m}, {B, 1, 1, m}};
        const int ndims[5] = {2, 4, 4, 4, 4};
        for (size_t kc = 0; kc < sizeof KINDS / sizeof KINDS[0]; kc++) {
            const kind_case *k = &KINDS[kc];
            for (int sh = 0; sh < 5; sh++) {
                const int per_batch = sh >= 2;
                if (!fits(k, per_batch))
                    continue;
                pattern p = pattern_new(B, H, n, m);
                k->setup(&p);
                if (sh == 4 && (p.hi_on || p.lo_on))
                    continue; /* a band varies along the rows */
                const mha_mask_rule_kind want =
                    (n == 1 || m == 1) ? ANY_RULE : expected_kind(k, &p);
                for (int dt = 0; dt < 5; dt++) {
                    for (int pol = 0; pol < (dt < 4 ? 2 : 1); pol++) {
                        const int additive = dt == 4;
                        tensor x = tensor_make(&p, ndims[sh], shapes[sh],
                                               additive ? MHA_DTYPE_F32 : dtypes[dt], additive,
                                               pol ? MHA_MASK_BLOCK : MHA_MASK_ATTEND);
                        char what[200];
                        snprintf(what, sizeof what, "%s n=%lld m=%lld shape#%d dtype#%d pol %d",
                                 k->name, (long long)n, (long long)m, sh, dt, pol);
                        uint8_t kp[MAXB * MAXM];
                        const mha_mask_rule r = recognise(&p, &x, want, kp, what);
                        /* Bit-identical outputs: every shape of one (kind, n, m) in the first
                         * dtype, and the additive form (the float path differs most). */
                        if (r.kind != MHA_MASK_RULE_NONE && pol == 0 && (dt == 0 || additive)) {
                            attention_same(&p, &x, &r, kp, MHA_IMPL_AUTO, 0.0, what);
                            attention_runs++;
                            if (sh == 3)
                                attention_same(&p, &x, &r, kp, MHA_IMPL_REFERENCE, 0.0, what);
                        }
                        free(x.buf);
                    }
                }
            }
        }
    }
    CHECK(attention_runs > 100, "only %d tensor-vs-rule attention comparisons", attention_runs);
}

/* The fields of the usual masks, exactly. */
static void test_fields(void) {
    struct {
        const char *name;
        void (*setup)(pattern *p);
        int64_t n, m;
        int causal, use_window;
        int64_t delta, left, right;
    } want[] = {
        {"tril n == m", causal_top_left, 6, 6, 1, 0, 0, -1, -1},
        {"bottom-right n < m", causal_bottom_right, 4, 9, 1, 0, 5, -1, -1},
        {"bottom-right n > m", causal_bottom_right, 9, 4, 1, 0, -5, -1, -1},
        {"top-left n < m", causal_top_left, 4, 9, 1, 0, 0, -1, -1},
        {"tril(2)", tril_plus2, 6, 6, 1, 0, 2, -1, -1},
        {"tril(-1)", tril_minus1, 6, 6, 1, 0, -1, -1, -1},
        {"causal window 3", causal_window, 6, 8, 1, 1, 2, 3, 0},
        {"triu(-2)", lower_edge_only, 6, 6, 0, 1, -2, 0, -1},
    };
    for (size_t c = 0; c < sizeof want / sizeof want[0]; c++) {
        pattern p = pattern_new(1, 1, want[c].n, want[c].m);
        want[c].setup(&p);
        const int64_t shape[2] = {p.n, p.m};
        tensor x = tensor_make(&p, 2, shape, MHA_DTYPE_BOOL, 0, MHA_MASK_ATTEND);
        uint8_t kp[MAXM];
        const mha_mask_rule r = recognise(&p, &x, MHA_MASK_RULE_BAND, kp, want[c].name);
        CHECK(r.causal == want[c].causal && r.use_window == want[c].use_window &&
                  r.delta == want[c].delta && r.window_left == want[c].left &&
                  r.window_right == want[c].right,
              "%s: causal %d window %d delta %lld (%lld, %lld)", want[c].name, r.causal,
              r.use_window, (long long)r.delta, (long long)r.window_left,
              (long long)r.window_right);
        free(x.buf);
    }
    char desc[160];
    mha_mask_rule r = {MHA_MASK_RULE_BAND, 1, 0, 0, -1, -1, 0};
    CHECK(strcmp(mha_mask_rule_describe(&r, desc, sizeof desc), "causal (delta 0)") == 0, "%s",
          desc);
    r = (mha_mask_rule){MHA_MASK_RULE_BAND_AND_KEY_PADDING, 1, 2, 1, 5, 0, 0};
    CHECK(strcmp(mha_mask_rule_describe(&r, desc, sizeof desc),
                 "causal (delta 2) + window (5, 0) + key padding") == 0,
          "%s", desc);
    r.kind = MHA_MASK_RULE_NONE;
    CHECK(strcmp(mha_mask_rule_describe(&r, desc, sizeof desc), "no built-in rule") == 0, "%s",
          desc);
}

/* ---------------------------------------------------------------------------------------------- */
/* One element off: never taken for a rule it is not.                                             */

static void test_adversarial(void) {
    const int64_t B = 3, H = 4;
    static const int64_t sizes[][2] = {{8, 8}, {5, 9}, {9, 5}};
    static const mha_dtype dtypes[] = {MHA_DTYPE_BOOL, MHA_DTYPE_I64, MHA_DTYPE_F32};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        const int64_t n = sizes[s][0], m = sizes[s][1], d = m - n; /* bottom-right causal */
        const int64_t r0 = d < 0 ? -d : 0; /* the first row that sees a key */
        /* (b, h, i, j) flipped, each NONE: a visible element hidden or a hidden one shown. */
        const int64_t flips[][4] = {
            {0, 0, r0, 0},                    /* first visible row, its only key */
            {0, 0, r0, 1},                    /* first visible row, the next key */
            {0, 0, 0, m - 1},                 /* far corner, top right */
            {0, 0, n - 1, m / 2},             /* last row, middle */
            {0, 0, n - 1, m - 1},             /* last row, its diagonal */
            {0, 0, n / 2 + 1, n / 2 + 1 + d}, /* diagonal */
            {0, 0, n / 2, n / 2 + d + 1},     /* just above the diagonal */
            {2, 3, n / 2, 0},                 /* one head of many, one batch row of many */
            {1, 0, n / 2, 0},                 /* one batch row of many, in every head */
            {0, 2, n - 1, 0},                 /* the far corner of one head only */
        };
        for (size_t f = 0; f < sizeof flips / sizeof flips[0]; f++) {
            pattern p = pattern_new(B, H, n, m);
            causal_bottom_right(&p);
            p.nflip = 1;
            memcpy(p.flip[0], flips[f], sizeof flips[f]);
            if (f == 8) { /* the same element in every head of batch row 1 */
                p.nflip = 4;
                for (int h = 0; h < 4; h++) {
                    memcpy(p.flip[h], flips[f], sizeof flips[f]);
                    p.flip[h][1] = h;
                }
            }
            for (size_t dt = 0; dt < 3; dt++) {
                const int64_t shape[4] = {B, H, n, m};
                tensor x = tensor_make(&p, 4, shape, dtypes[dt], dtypes[dt] == MHA_DTYPE_F32,
                                       MHA_MASK_ATTEND);
                char what[160];
                snprintf(what, sizeof what,
                         "causal n=%lld m=%lld, flip #%zu (%lld, %lld, %lld, "
                         "%lld), dtype %d",
                         (long long)n, (long long)m, f, (long long)flips[f][0],
                         (long long)flips[f][1], (long long)flips[f][2], (long long)flips[f][3],
                         (int)dtypes[dt]);
                uint8_t kp[MAXB * MAXM];
                recognise(&p, &x, MHA_MASK_RULE_NONE, kp, what);
                free(x.buf);
            }
        }
        /* The far corner bottom-left of a square causal mask hidden is a real rule: causal with
         * a window of n - 2 keys back (row n - 1 sees keys 1 .. n - 1), and is found as one. */
        if (n == m) {
            pattern p = pattern_new(1, 1, n, m);
            causal_bottom_right(&p);
            p.lo_on = 1, p.lo = -(n - 2);
            const int64_t shape[2] = {n, m};
            tensor x = tensor_make(&p, 2, shape, MHA_DTYPE_BOOL, 0, MHA_MASK_ATTEND);
            uint8_t kp[MAXM];
            const mha_mask_rule r = recognise(&p, &x, MHA_MASK_RULE_BAND, kp, "corner");
            CHECK(r.causal && r.use_window && r.window_left == n - 2, "corner: window %lld",
                  (long long)r.window_left);
            free(x.buf);
        }
    }
    /* Additive masks: a finite stand-in for -inf, or a real bias, is not a rule. */
    const float others[] = {-1e30f, -FLT_MAX, 0.5f, NAN, INFINITY};
    for (size_t o = 0; o < sizeof others / sizeof others[0]; o++) {
        pattern p = pattern_new(1, 1, 6, 6);
        causal_top_left(&p);
        const int64_t shape[2] = {6, 6};
        tensor x = tensor_make(&p, 2, shape, MHA_DTYPE_F32, 1, MHA_MASK_ATTEND);
        ((float *)x.buf)[o == 2 ? 6 : 5] = others[o]; /* (0, 5) hidden or (1, 0) visible */
        uint8_t kp[MAXM];
        recognise(&p, &x, MHA_MASK_RULE_NONE, kp, "additive with a non-rule value");
        free(x.buf);
    }
}

/* ---------------------------------------------------------------------------------------------- */

static void test_arguments(void) {
    uint8_t mask[4 * 5];
    memset(mask, 1, sizeof mask);
    mha_mask_tensor t = {mask, MHA_DTYPE_BOOL, 2, {4, 5, 0, 0}};
    mha_mask_rule r, before;
    memset(&r, 0x5a, sizeof r);
    before = r;
    mha_error err;
    uint8_t kp[5];
#define REFUSED(call, status, text)                                                                \
    do {                                                                                           \
        const mha_status st_ = (call);                                                             \
        CHECK(st_ == MHA_STATUS_##status && strstr(err.message, text) != NULL,                     \
              "%s -> %d '%s', expected %s '%s'", #call, (int)st_, err.message, #status, text);     \
        CHECK(memcmp(&r, &before, sizeof r) == 0, "%s wrote the rule on error", #call);            \
    } while (0)
    REFUSED(mha_mask_recognize(NULL, 0, MHA_MASK_ATTEND, 1, 1, 4, 5, &r, kp, &err), INVALID_ARG,
            "NULL");
    REFUSED(mha_mask_recognize(&t, 0, MHA_MASK_ATTEND, 1, 1, 4, 5, NULL, kp, &err), INVALID_ARG,
            "NULL");
    REFUSED(mha_mask_recognize(&t, 0, MHA_MASK_ATTEND, 0, 1, 4, 5, &r, kp, &err), INVALID_ARG,
            "batch=0");
    REFUSED(
        mha_mask_recognize(&t, 0, MHA_MASK_ATTEND, 1, 1, 4, ((int64_t)1 << 31) + 1, &r, NULL, &err),
        INVALID_ARG, "kv_len=");
    REFUSED(mha_mask_recognize(&t, 0, MHA_MASK_ATTEND, 1, 1, 4, 6, &r, NULL, &err), INVALID_ARG,
            "does not broadcast");
    REFUSED(mha_mask_recognize(&t, 1, MHA_MASK_ATTEND, 1, 1, 4, 5, &r, kp, &err), INVALID_ARG,
            "must be F32");
    REFUSED(mha_mask_recognize(&t, 0, (mha_mask_polarity)7, 1, 1, 4, 5, &r, kp, &err), INVALID_ARG,
            "polarity=7");
    REFUSED(mha_mask_recognize(&t, 0, MHA_MASK_ATTEND, 1, 1, 4, 5, &r, mask + 3, &err), INVALID_ARG,
            "overlaps");
    mha_mask_tensor f = t;
    f.dtype = MHA_DTYPE_F32;
    REFUSED(mha_mask_recognize(&f, 0, MHA_MASK_ATTEND, 1, 1, 4, 5, &r, kp, &err), INVALID_ARG,
            "is_additive");
    mha_mask_tensor none = t;
    none.data = NULL;
    REFUSED(mha_mask_recognize(&none, 0, MHA_MASK_ATTEND, 1, 1, 4, 5, &r, kp, &err), INVALID_ARG,
            "mask.data");
    mha_mask_tensor five = t;
    five.ndim = 5;
    REFUSED(mha_mask_recognize(&five, 0, MHA_MASK_ATTEND, 1, 1, 4, 5, &r, kp, &err), INVALID_ARG,
            "ndim=5");
#undef REFUSED
    /* Success clears a stale message; the rule of an all-ones mask. */
    CHECK_OK(mha_mask_recognize(&t, 0, MHA_MASK_ATTEND, 2, 3, 4, 5, &r, NULL, &err), &err);
    CHECK(r.kind == MHA_MASK_RULE_ALL_VISIBLE && err.message[0] == 0, "all ones: kind %d '%s'",
          (int)r.kind, err.message);

    /* mha_mask_rule_apply's checks. */
    mha_masking mk;
    memset(&mk, 0, sizeof mk);
    mha_mask_rule band = {MHA_MASK_RULE_BAND, 1, 3, 0, -1, -1, 0};
    CHECK(mha_mask_rule_apply(&band, 2, 4, 5, NULL, NULL, &mk, &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "align_offsets"),
          "delta 3 without offsets: '%s'", err.message);
    mha_mask_rule none_rule = {MHA_MASK_RULE_NONE, 0, 0, 0, -1, -1, 0};
    CHECK(mha_mask_rule_apply(&none_rule, 2, 4, 5, NULL, NULL, &mk, &err) == MHA_STATUS_INVALID_ARG,
          "NONE applied: '%s'", err.message);
    mha_mask_rule pad = {MHA_MASK_RULE_KEY_PADDING, 0, 0, 0, -1, -1, 0};
    CHECK(mha_mask_rule_apply(&pad, 2, 4, 5, NULL, NULL, &mk, &err) == MHA_STATUS_INVALID_ARG,
          "key padding without the vector: '%s'", err.message);
    mk.causal = 1;
    CHECK(mha_mask_rule_apply(&band, 2, 4, 5, NULL, NULL, &mk, &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "already"),
          "masking with causal: '%s'", err.message);
    memset(&mk, 0, sizeof mk);
    int64_t off[2] = {0, 0};
    CHECK_OK(mha_mask_rule_apply(&band, 2, 4, 5, NULL, off, &mk, &err), &err);
    CHECK(mk.alignment == MHA_ALIGN_EXPLICIT && off[0] == 3 && off[1] == 3 && mk.causal,
          "delta 3: alignment %d offsets %lld %lld", (int)mk.alignment, (long long)off[0],
          (long long)off[1]);
    memset(&mk, 0, sizeof mk);
    band.delta = 1; /* m - n */
    CHECK_OK(mha_mask_rule_apply(&band, 2, 4, 5, NULL, NULL, &mk, &err), &err);
    CHECK(mk.alignment == MHA_ALIGN_BOTTOM_RIGHT, "delta m-n: alignment %d", (int)mk.alignment);
}

/* Long rows (more key tiles than the flash kernel accumulates before it folds its partial sums,
 * 32). A mask's hidden tiles, bool or additive, are skipped as the rule's are (the block mask):
 * bit for bit, left padding included (docs/SEMANTICS.md, "Recognised masks"). */
static void test_long_rows(void) {
    static uint8_t kp[MAXB * MAXM];
    for (int c = 0; c < 4; c++) {
        const int additive = c >= 1, left_padded = c == 0 || c == 3;
        pattern p = pattern_new(2, 2, 40, MAXM);
        if (left_padded) {
            hf_left_padded(&p);
            for (int64_t j = 0; j < 1500; j++)
                p.keys[1][j] = 0;
        } else if (c == 1) {
            causal_top_left(&p);
        } else {
            causal_bottom_right(&p);
        }
        const int64_t shape[4] = {2, 1, p.n, p.m};
        tensor x = tensor_make(&p, 4, shape, MHA_DTYPE_BOOL, additive, MHA_MASK_ATTEND);
        const mha_mask_rule r =
            recognise(&p, &x, left_padded ? MHA_MASK_RULE_BAND_AND_KEY_PADDING : MHA_MASK_RULE_BAND,
                      kp, "long rows");
        attention_same(&p, &x, &r, kp, MHA_IMPL_AUTO, 0.0, "long rows");
        free(x.buf);
    }
}

/* Chunked causal masks (Llama 4's chunked layers): recognised as causal + chunk_size C with the
 * causal delta, in every dtype / polarity / broadcast shape; the rule reproduces every element
 * (recognise) and gives the tensor's out and lse bit for bit; a chunk that hides nothing is plain
 * causal, C = 1 is the diagonal band; one flipped element anywhere gives NONE. */
typedef struct chunk_case {
    const char *name;
    int64_t n, m, hi, C, want_chunk; /* want_chunk -1: a band without a chunk */
    int pad;                         /* 1: right padding per batch row; 2: leading keys padded */
} chunk_case;

static void test_chunks(void) {
    static const chunk_case cases[] = {
        {"n=m=16 C=4", 16, 16, 0, 4, 4, 0},
        {"n=m=17 C=5 (ragged last chunk)", 17, 17, 0, 5, 5, 0},
        {"bottom-right n<m C=6", 12, 20, 8, 6, 6, 0},
        {"bottom-right n<m, row 0 past chunk 0", 5, 23, 18, 7, 7, 0},
        {"bottom-right n>m C=4", 20, 12, -8, 4, 4, 0},
        {"tril(+3) C=4", 12, 16, 3, 4, 4, 0},
        {"right padded C=4", 16, 16, 0, 4, 4, 1},
        {"leading keys padded C=4", 16, 16, 0, 4, 4, 2},
        {"tiles: n=m=200 C=64", 200, 200, 0, 64, 64, 0},
        {"tiles: bottom-right 130 x 300 C=48", 130, 300, 170, 48, 48, 1},
        {"C=1: the diagonal (a band)", 9, 9, 0, 1, -1, 0},
        {"C >= m: plain causal", 8, 8, 0, 8, -1, 0},
    };
    static const mha_dtype dtypes[] = {MHA_DTYPE_BOOL, MHA_DTYPE_U8, MHA_DTYPE_I32, MHA_DTYPE_I64};
    const int64_t B = 2, H = 2;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const chunk_case *k = &cases[c];
        pattern p = pattern_new(B, H, k->n, k->m);
        p.hi_on = 1, p.hi = k->hi, p.chunk = k->C;
        for (int64_t b = 0; b < B && k->pad; b++)
            for (int64_t j = 0; j < k->m; j++)
                p.keys[b][j] = k->pad == 1 ? j < k->m - 1 - 3 * b : j > 4 + b;
        const int64_t shapes[4][4] = {
            {k->n, k->m}, {1, 1, k->n, k->m}, {B, 1, k->n, k->m}, {B, H, k->n, k->m}};
        const int ndims[4] = {2, 4, 4, 4};
        for (int sh = k->pad ? 2 : 0; sh < 4; sh++) {
            for (int dt = 0; dt < 5; dt++) {
                for (int pol = 0; pol < (dt < 4 ? 2 : 1); pol++) {
                    const int additive = dt == 4;
                    tensor x = tensor_make(&p, ndims[sh], shapes[sh],
                                           additive ? MHA_DTYPE_F32 : dtypes[dt], additive,
                                           pol ? MHA_MASK_BLOCK : MHA_MASK_ATTEND);
                    char what[200];
                    snprintf(what, sizeof what, "%s shape#%d dtype#%d pol %d", k->name, sh, dt,
                             pol);
                    uint8_t kp[MAXB * MAXM];
                    const mha_mask_rule r = recognise(&p, &x, ANY_RULE, kp, what);
                    const int64_t want = k->want_chunk < 0 ? 0 : k->want_chunk;
                    const mha_mask_rule_kind kind =
                        k->pad ? MHA_MASK_RULE_BAND_AND_KEY_PADDING : MHA_MASK_RULE_BAND;
                    CHECK(r.kind == kind && r.causal && r.chunk_size == want &&
                              (want == 0 || (r.delta == k->hi && !r.use_window)),
                          "%s: kind %d causal %d delta %lld chunk %lld window %d", what,
                          (int)r.kind, r.causal, (long long)r.delta, (long long)r.chunk_size,
                          r.use_window);
                    if (pol == 0 && (dt == 0 || additive)) {
                        attention_same(&p, &x, &r, kp, MHA_IMPL_AUTO, 0.0, what);
                        if (sh == 3)
                            attention_same(&p, &x, &r, kp, MHA_IMPL_REFERENCE, 0.0, what);
                    }
                    free(x.buf);
                }
            }
        }
        if (k->want_chunk < 0)
            continue;
        /* Near misses: one element flipped (a visible one inside a chunk, the hidden one just
         * before a chunk's start, the first hidden one after the diagonal, the last row's chunk
         * start), in one head of the last batch row. */
        const int64_t i1 = k->n - 1, p1 = i1 + k->hi, start = floor_div(p1, k->C) * k->C;
        const int64_t flips[4][2] = {
            {i1, start + 1 < p1 ? start + 1 : start}, {i1, start - 1}, {0, k->hi + 1}, {i1, start}};
        for (int f = 0; f < 4; f++) {
            const int64_t fi = flips[f][0], fj = flips[f][1];
            if (fj < 0 || fj >= k->m || fi + k->hi < 0)
                continue;
            pattern q = p;
            q.nflip = 1;
            q.flip[0][0] = B - 1, q.flip[0][1] = H - 1, q.flip[0][2] = fi, q.flip[0][3] = fj;
            const int64_t shape[4] = {B, H, k->n, k->m};
            for (int additive = 0; additive < 2; additive++) {
                tensor x = tensor_make(&q, 4, shape, MHA_DTYPE_BOOL, additive, MHA_MASK_ATTEND);
                char what[200];
                snprintf(what, sizeof what, "%s, element (%lld, %lld) flipped, additive %d",
                         k->name, (long long)fi, (long long)fj, additive);
                uint8_t kp[MAXB * MAXM];
                recognise(&q, &x, MHA_MASK_RULE_NONE, kp, what);
                free(x.buf);
            }
        }
    }
    /* mha_mask_rule_apply carries the chunk; refuses one on a masking with its own chunk, or on
     * a rule without causal. */
    mha_error err;
    mha_masking mk;
    memset(&mk, 0, sizeof mk);
    mha_mask_rule r = {MHA_MASK_RULE_BAND, 1, 0, 0, -1, -1, 4};
    CHECK_OK(mha_mask_rule_apply(&r, 1, 8, 10, NULL, NULL, &mk, &err), &err);
    CHECK(mk.causal && mk.chunk_size == 4 && mk.alignment == MHA_ALIGN_TOP_LEFT,
          "applied chunk rule: causal %d chunk %lld", mk.causal, (long long)mk.chunk_size);
    memset(&mk, 0, sizeof mk);
    mk.chunk_size = 8;
    CHECK(mha_mask_rule_apply(&r, 1, 8, 8, NULL, NULL, &mk, &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "chunk_size"),
          "a second chunk: '%s'", err.message);
    memset(&mk, 0, sizeof mk);
    r.causal = 0;
    CHECK(mha_mask_rule_apply(&r, 1, 8, 8, NULL, NULL, &mk, &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "chunk_size"),
          "a chunk without causal: '%s'", err.message);
    char desc[160];
    r.causal = 1, r.delta = 2;
    CHECK(strcmp(mha_mask_rule_describe(&r, desc, sizeof desc), "causal (delta 2) + chunk 4") == 0,
          "%s", desc);
}

int main(void) {
    test_long_rows();
    test_kinds();
    test_fields();
    test_chunks();
    test_adversarial();
    test_arguments();
    return test_finish();
}
