/* SPDX-License-Identifier: MIT */
/* test_half_kernel.c: the forward kernels whose tile products run on half precision (registry
 * lines whose dtypes are not f32: today mha_fwd_bf16_flash_q64k64__avx512bf16), each forced
 * (mha_experimental_attention_with_kernel, as test_kernels.c forces every line) on a matrix of
 * the driver's features, against the float64 oracle on the same bf16 inputs:
 *
 *   out:   max|o - o*| <= TOL_HALF_TILE_C u_s (max|V| + max|o*|) + TOL_OUT_REL max|o*|
 *          (P rounded to bf16 before P V: at most u_s relative per probability, so u_s sum_j P_j
 *          |v_j| <= u_s max|V| per output; the output's own rounding to bf16 u_s |o|; the
 *          scores are float32 sums of exact bf16 products, so they add only the f32 term)
 *   lse:   float32 accuracy (no bf16 rounding reaches it): TOL_OUT_REL (1 + max|lse*|)
 *   probs: float32 accuracy: TOL_PROBS_ABS
 *
 * and bit-identical for 1 and 2 threads. Kernels this CPU cannot run are reported as skipped.
 * Also: selection takes the bf16 line for bf16 q/k/v and never for f32 (or mixed) inputs, and
 * forcing it on f32 inputs fails with UNSUPPORTED naming the dtypes.
 */
#include "harness.h"
#include "mha.h"
#include "mha_experimental.h"
#include "oracle_f64.h"
#include "tolerance.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* float -> bf16 bits, round to nearest even (NaN kept quiet). */
static uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static double from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return (double)f;
}

typedef struct hcase {
    const char *label;
    int64_t B, H, G, n, m, dk, dv;
    int causal, window, blhd, block_mask, key_padding, additive, alibi, sinks, probs, avg_probs;
    int64_t wl, wr;
    float softcap, dropout;
    int inf_v;    /* +Inf in V at one key every row sees, NaN at one hidden by padding */
    int out_bf16; /* out stored as bf16 (else float32) */
    double qscale;
} hcase;

typedef struct hdata {
    mha_attention_args a;
    uint16_t *q, *k, *v;
    uint8_t *bmask, *kpm;
    float *add, *sinks;
    int64_t q_n, k_n, v_n, o_n;
    double *o_ref, *lse_ref, *p_ref, max_v, max_o, max_lse;
} hdata;

/* Strides (elements; d is contiguous) of a [B, heads, L, d] tensor stored as [B, heads, L, d] or
 * [B, L, heads, d]. */
static void
strides(int blhd, int64_t B, int64_t heads, int64_t L, int64_t d, int64_t s[3], int64_t *count) {
    if (blhd) {
        s[0] = L * heads * d, s[1] = d, s[2] = heads * d;
    } else {
        s[0] = heads * L * d, s[1] = L * d, s[2] = d;
    }
    *count = B * heads * L * d;
}

static uint16_t *bf16_normal(test_rng *r, int64_t count, double scale) {
    uint16_t *x = malloc(sizeof(uint16_t) * (size_t)count);
    for (int64_t e = 0; e < count; e++)
        x[e] = to_bf16((float)(test_rng_normal(r) * scale));
    return x;
}

static void make(const hcase *c, uint64_t seed, hdata *t) {
    memset(t, 0, sizeof *t);
    test_rng r;
    test_rng_seed(&r, seed);
    mha_attention_args *a = &t->a;
    a->batch = c->B, a->num_heads = c->H, a->num_kv_heads = c->G, a->q_len = c->n;
    a->kv_len = c->m, a->head_dim = c->dk, a->v_head_dim = c->dv;
    strides(c->blhd, c->B, c->H, c->n, c->dk, a->q_strides, &t->q_n);
    strides(c->blhd, c->B, c->G, c->m, c->dk, a->k_strides, &t->k_n);
    strides(c->blhd, c->B, c->G, c->m, c->dv, a->v_strides, &t->v_n);
    strides(0, c->B, c->H, c->n, c->dv, a->out_strides, &t->o_n);
    t->q = bf16_normal(&r, t->q_n, c->qscale);
    t->k = bf16_normal(&r, t->k_n, 1.0);
    t->v = bf16_normal(&r, t->v_n, 1.0);
    a->q = t->q, a->k = t->k, a->v = t->v;
    a->q_dtype = a->k_dtype = a->v_dtype = MHA_DTYPE_BF16;
    a->out_dtype = c->out_bf16 ? MHA_DTYPE_BF16 : MHA_DTYPE_F32;
    mha_masking *mk = &a->mask;
    mk->causal = c->causal;
    if (c->window) {
        mk->use_window = 1;
        mk->window_left = c->wl;
        mk->window_right = c->wr;
    }
    if (c->block_mask) {
        /* [n, m] in 64 x 64 tiles (the kernel's Bq x Bk): tile (ti, tj) hidden, visible or mixed
         * by (ti + 2 tj) % 3, so the driver skips hidden tiles, runs visible ones unmasked and
         * masks the mixed ones element by element. */
        t->bmask = malloc((size_t)(c->n * c->m));
        for (int64_t i = 0; i < c->n; i++)
            for (int64_t j = 0; j < c->m; j++) {
                const int cls = (int)((i / 64 + 2 * (j / 64)) % 3);
                t->bmask[i * c->m + j] =
                    (uint8_t)(cls == 1 || (cls == 2 && test_rng_uniform(&r) < 0.7));
            }
        mk->bool_mask = (mha_mask_tensor){t->bmask, MHA_DTYPE_U8, 2, {c->n, c->m}};
        mk->bool_mask_polarity = MHA_MASK_ATTEND;
    }
    if (c->key_padding || c->inf_v) {
        t->kpm = malloc((size_t)(c->B * c->m));
        for (int64_t e = 0; e < c->B * c->m; e++)
            t->kpm[e] = (uint8_t)(!c->key_padding || test_rng_uniform(&r) < 0.85);
        mk->key_padding = (mha_mask_tensor){t->kpm, MHA_DTYPE_U8, 2, {c->B, c->m}};
    }
    if (c->additive) {
        t->add = malloc(sizeof(float) * (size_t)(c->n * c->m));
        for (int64_t e = 0; e < c->n * c->m; e++)
            t->add[e] = test_rng_uniform(&r) < 0.1 ? -INFINITY : (float)test_rng_normal(&r);
        mk->additive_mask = (mha_mask_tensor){t->add, MHA_DTYPE_F32, 2, {c->n, c->m}};
    }
    if (c->sinks) {
        t->sinks = malloc(sizeof(float) * (size_t)c->H);
        for (int64_t h = 0; h < c->H; h++)
            t->sinks[h] = (float)(2.0 * test_rng_normal(&r));
        a->sinks = t->sinks;
    }
    a->softcap = (double)c->softcap;
    a->alibi = c->alibi;
    if (c->dropout > 0.0f)
        a->dropout = (mha_dropout){.p = c->dropout, .seed = test_rng_u64(&r), .training = 1};
    if (c->inf_v) /* key 1 of every (b, g): visible unless masked; key m - 2 padded away */
        for (int64_t b = 0; b < c->B; b++)
            for (int64_t g = 0; g < c->G; g++) {
                uint16_t *v = t->v + b * a->v_strides[0] + g * a->v_strides[1];
                v[1 * a->v_strides[2] + 0] = 0x7f80;                  /* +Inf */
                v[(c->m - 2) * a->v_strides[2] + c->dv - 1] = 0x7fc0; /* NaN */
                t->kpm[b * c->m + 1] = 1;
                t->kpm[b * c->m + c->m - 2] = 0;
            }
    const int64_t no = c->B * c->H * c->n;
    t->o_ref = malloc(sizeof(double) * (size_t)(no * c->dv));
    t->lse_ref = malloc(sizeof(double) * (size_t)no);
    t->p_ref = c->probs ? malloc(sizeof(double) * (size_t)(no * c->m)) : NULL;
    CHECK(oracle_attention(a, t->o_ref, t->lse_ref, t->p_ref) == 0, "%s: oracle refused", c->label);
    for (int64_t e = 0; e < t->v_n; e++) {
        const double x = fabs(from_bf16(t->v[e]));
        if (isfinite(x) && x > t->max_v)
            t->max_v = x;
    }
    for (int64_t e = 0; e < no * c->dv; e++)
        if (isfinite(t->o_ref[e]) && fabs(t->o_ref[e]) > t->max_o)
            t->max_o = fabs(t->o_ref[e]);
    for (int64_t e = 0; e < no; e++)
        if (isfinite(t->lse_ref[e]) && fabs(t->lse_ref[e]) > t->max_lse)
            t->max_lse = fabs(t->lse_ref[e]);
}

static void release(hdata *t) {
    free(t->q), free(t->k), free(t->v), free(t->bmask), free(t->kpm), free(t->add);
    free(t->sinks), free(t->o_ref), free(t->lse_ref), free(t->p_ref);
}

typedef struct hout {
    void *out;
    float *lse, *probs;
    int64_t out_bytes, probs_n;
} hout;

/* Runs kernel `index` forced, or (index < 0) mha_attention with impl AUTO. */
static int run(const hcase *c, hdata *t, int32_t index, int threads, hout *r) {
    const int64_t no = c->B * c->H * c->n;
    r->out_bytes = t->o_n * (c->out_bf16 ? 2 : 4);
    r->probs_n = c->probs ? c->B * (c->avg_probs ? 1 : c->H) * c->n * c->m : 0;
    r->out = malloc((size_t)r->out_bytes);
    r->lse = malloc(sizeof(float) * (size_t)no);
    r->probs = c->probs ? malloc(sizeof(float) * (size_t)r->probs_n) : NULL;
    memset(r->out, 0xff, (size_t)r->out_bytes); /* NaN: an element never written stays NaN */
    t->a.out = r->out;
    t->a.lse = r->lse;
    t->a.probs = r->probs;
    t->a.average_probs = c->avg_probs;
    mha_exec ex = {MHA_IMPL_AUTO, threads, NULL, 0, NULL, NULL};
    mha_error err;
    const mha_status st = index < 0
                              ? mha_attention(&t->a, &ex, &err)
                              : mha_experimental_attention_with_kernel(index, &t->a, &ex, &err);
    CHECK(st == MHA_STATUS_OK, "%s threads=%d: %s (%s)", c->label, threads, mha_status_string(st),
          err.message);
    return st == MHA_STATUS_OK;
}

static void hout_free(hout *r) {
    free(r->out), free(r->lse), free(r->probs);
}

static int same_class(double x, double ref) {
    if (isnan(ref))
        return isnan(x);
    if (isinf(ref))
        return x == ref;
    return isfinite(x);
}

static double g_worst_out; /* max over cases of err / (u_s (max|V| + max|o*|)) */

static void check_case(const hcase *c, int32_t index, uint64_t seed) {
    hdata t;
    make(c, seed, &t);
    hout r1, r2, r3;
    const int ok1 = run(c, &t, index, 1, &r1), ok2 = run(c, &t, index, 2, &r2);
    /* The public call (impl AUTO: selection, or MHA_KERNEL when set) runs the same kernel where
     * this CPU prefers the bf16 tiles (elsewhere AUTO takes a float32 line: selection below). */
    const int ok3 = run(c, &t, -1, 2, &r3);
    if (ok1 && ok3 && (mha_experimental_cpu_bf16_tiles() || getenv("MHA_KERNEL")))
        CHECK(memcmp(r1.out, r3.out, (size_t)r1.out_bytes) == 0,
              "%s: mha_attention (impl AUTO) differs from the forced kernel", c->label);
    if (ok1 && ok2) {
        CHECK(
            memcmp(r1.out, r2.out, (size_t)r1.out_bytes) == 0 &&
                memcmp(r1.lse, r2.lse, sizeof(float) * (size_t)(c->B * c->H * c->n)) == 0 &&
                (!c->probs || memcmp(r1.probs, r2.probs, sizeof(float) * (size_t)r1.probs_n) == 0),
            "%s: 1 and 2 threads differ", c->label);
        const double u = TOL_HALF_U_BF16, scale = u * (t.max_v + t.max_o);
        const double tol_o = TOL_HALF_TILE_C * scale + TOL_OUT_REL * t.max_o;
        double eo = 0.0, el = 0.0, ep = 0.0;
        int64_t bad_class = 0;
        const mha_attention_args *a = &t.a;
        for (int64_t b = 0; b < c->B; b++)
            for (int64_t h = 0; h < c->H; h++)
                for (int64_t i = 0; i < c->n; i++) {
                    const int64_t row = (b * c->H + h) * c->n + i;
                    for (int64_t d = 0; d < c->dv; d++) {
                        const int64_t e = b * a->out_strides[0] + h * a->out_strides[1] +
                                          i * a->out_strides[2] + d;
                        const double x = c->out_bf16 ? from_bf16(((uint16_t *)r1.out)[e])
                                                     : (double)((float *)r1.out)[e];
                        const double ref = t.o_ref[row * c->dv + d];
                        if (!same_class(x, ref))
                            bad_class++;
                        else if (isfinite(ref) && fabs(x - ref) > eo)
                            eo = fabs(x - ref);
                    }
                    const double lr = t.lse_ref[row], l = (double)r1.lse[row];
                    if (!same_class(l, lr))
                        bad_class++;
                    else if (isfinite(lr) && fabs(l - lr) > el)
                        el = fabs(l - lr);
                }
        if (c->probs) {
            for (int64_t e = 0; e < r1.probs_n; e++) {
                double ref;
                if (c->avg_probs) { /* [B, n, m]: the mean over heads of the oracle's */
                    const int64_t b = e / (c->n * c->m), im = e % (c->n * c->m);
                    ref = 0.0;
                    for (int64_t h = 0; h < c->H; h++)
                        ref += t.p_ref[(b * c->H + h) * c->n * c->m + im];
                    ref /= (double)c->H;
                } else {
                    ref = t.p_ref[e];
                }
                const double pe = (double)r1.probs[e];
                if (!same_class(pe, ref))
                    bad_class++;
                else if (isfinite(ref) && fabs(pe - ref) > ep)
                    ep = fabs(pe - ref);
            }
        }
        if (scale > 0.0 && eo / scale > g_worst_out)
            g_worst_out = eo / scale;
        printf("  %-34s out err %.2e (gate %.2e, %.2f u_s(max|V|+max|o|)) lse %.1e probs %.1e\n",
               c->label, eo, tol_o, scale > 0.0 ? eo / scale : 0.0, el, ep);
        CHECK(bad_class == 0, "%s: %lld NaN/Inf disagreements with the oracle", c->label,
              (long long)bad_class);
        CHECK(eo <= tol_o, "%s: out error %.3e > %.3e", c->label, eo, tol_o);
        CHECK(el <= TOL_OUT_REL * (1.0 + t.max_lse), "%s: lse error %.3e", c->label, el);
        CHECK(ep <= TOL_PROBS_ABS, "%s: probs error %.3e", c->label, ep);
    }
    hout_free(&r1), hout_free(&r2), hout_free(&r3);
    release(&t);
}

/* The feature matrix: every option of the driver, alone and in a few combinations, at sizes that
 * leave partial tiles (n, m not multiples of 64; odd m, odd dk, odd dv). */
static void feature_matrix(int32_t index) {
    const hcase base = {.label = "plain",
                        .B = 2,
                        .H = 4,
                        .G = 4,
                        .n = 150,
                        .m = 200,
                        .dk = 64,
                        .dv = 64,
                        .qscale = 1.0};
    hcase cs[32];
    int nc = 0;
    cs[nc++] = base;
#define VARIANT(lbl, ...)                                                                          \
    do {                                                                                           \
        hcase x = base;                                                                            \
        x.label = lbl;                                                                             \
        __VA_ARGS__;                                                                               \
        cs[nc++] = x;                                                                              \
    } while (0)
    VARIANT("causal", x.causal = 1);
    VARIANT("causal, n > m", x.causal = 1, x.n = 260, x.m = 190);
    VARIANT("window (40, 7)", x.window = 1, x.wl = 40, x.wr = 7);
    VARIANT("GQA 8/2", x.H = 8, x.G = 2);
    VARIANT("MQA 6/1, causal", x.H = 6, x.G = 1, x.causal = 1);
    VARIANT("softcap 20, qscale 3", x.softcap = 20.0f, x.qscale = 3.0);
    VARIANT("ALiBi", x.alibi = 1);
    VARIANT("sinks", x.sinks = 1);
    VARIANT("dropout 0.2", x.dropout = 0.2f);
    VARIANT("probs + lse", x.probs = 1);
    VARIANT("averaged probs, GQA", x.probs = 1, x.avg_probs = 1, x.H = 4, x.G = 2);
    VARIANT("block mask 64x64 tiles", x.block_mask = 1, x.n = 256, x.m = 320);
    VARIANT("block mask + causal", x.block_mask = 1, x.causal = 1, x.n = 256, x.m = 256);
    VARIANT("key padding + additive", x.key_padding = 1, x.additive = 1);
    VARIANT("Inf/NaN in V (exact path)", x.inf_v = 1);
    VARIANT("bf16 out", x.out_bf16 = 1);
    VARIANT("[B, L, H, d] layout, GQA", x.blhd = 1, x.H = 8, x.G = 4);
    VARIANT("odd m=77, dk=33, dv=47", x.m = 77, x.dk = 33, x.dv = 47, x.causal = 1);
    VARIANT("dk=dv=128", x.dk = 128, x.dv = 128, x.causal = 1);
    VARIANT("dk=96 dv=80, m=1", x.dk = 96, x.dv = 80, x.m = 1);
    VARIANT("long m=2500 (fold), n=70", x.n = 70, x.m = 2500, x.B = 1, x.H = 2, x.G = 2);
    VARIANT("all of it", x.causal = 1, x.H = 8, x.G = 2, x.softcap = 30.0f, x.alibi = 1,
            x.sinks = 1, x.dropout = 0.1f, x.probs = 1, x.block_mask = 1, x.key_padding = 1,
            x.out_bf16 = 1, x.n = 192, x.m = 256);
#undef VARIANT
    for (int i = 0; i < nc; i++)
        check_case(&cs[i], index, 0x5eed0000u + (uint64_t)i);
}

/* Selection: bf16 q/k/v pick the half line (the first usable one) where this CPU prefers the
 * bf16 tiles (mha_experimental_cpu_bf16_tiles: AMD), and a float32 line elsewhere (Intel: the
 * float32 kernels ran bf16 faster); f32 or mixed never do; forcing it on f32 inputs is refused
 * with the dtypes in the message. */
static void selection(int32_t index, const char *name) {
    if (getenv("MHA_KERNEL")) { /* selection is the forced kernel's, or a refusal */
        printf("selection checks skipped: MHA_KERNEL=%s\n", getenv("MHA_KERNEL"));
        return;
    }
    uint16_t h[64 * 4] = {0};
    float f[64 * 4] = {0}, o[64 * 4];
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = 1, a.num_heads = 1, a.q_len = 4, a.kv_len = 4, a.head_dim = 64;
    a.q = h, a.k = h, a.v = h, a.out = o;
    const int64_t s[3] = {4 * 64, 4 * 64, 64}; /* contiguous: out's rows must not coincide */
    memcpy(a.q_strides, s, sizeof s), memcpy(a.k_strides, s, sizeof s);
    memcpy(a.v_strides, s, sizeof s), memcpy(a.out_strides, s, sizeof s);
    a.q_dtype = a.k_dtype = a.v_dtype = MHA_DTYPE_BF16;
    int32_t got = -1;
    mha_error err;
    CHECK_OK(mha_experimental_attention_select(&a, NULL, &got, &err), &err);
    if (mha_experimental_cpu_bf16_tiles())
        CHECK(got == index, "bf16 q/k/v select kernel %d, not %s (%d)", (int)got, name, (int)index);
    else
        CHECK(got != index, "bf16 q/k/v selected %s where the bf16 tiles are passed over", name);
    printf("bf16 q/k/v select %s (bf16 tiles %s on this CPU)\n",
           got == index ? name : "a float32 line",
           mha_experimental_cpu_bf16_tiles() ? "preferred" : "passed over");
    a.v = f, a.v_dtype = MHA_DTYPE_F32; /* mixed */
    CHECK_OK(mha_experimental_attention_select(&a, NULL, &got, &err), &err);
    CHECK(got != index, "mixed bf16/f32 inputs selected %s", name);
    a.q = f, a.k = f, a.q_dtype = a.k_dtype = MHA_DTYPE_F32;
    CHECK_OK(mha_experimental_attention_select(&a, NULL, &got, &err), &err);
    CHECK(got != index, "f32 inputs selected %s", name);
    const mha_status st = mha_experimental_attention_with_kernel(index, &a, NULL, &err);
    CHECK(st == MHA_STATUS_UNSUPPORTED && strstr(err.message, "dtypes") &&
              strstr(err.message, name),
          "forcing %s on f32 inputs: %s (%s)", name, mha_status_string(st), err.message);
}

/* A half kernel this CPU cannot run (index < 0: this build has none): forcing it is refused by
 * name, and bf16 inputs still run (on a float32 line, which widens them). */
static void unusable(int32_t index, const char *name) {
    uint16_t h[64 * 4] = {0};
    float o[64 * 4];
    for (int e = 0; e < 64 * 4; e++) /* not 0: the call must write its zeros */
        o[e] = 1.0f;
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = 1, a.num_heads = 1, a.q_len = 4, a.kv_len = 4, a.head_dim = 64;
    a.q = h, a.k = h, a.v = h, a.out = o;
    const int64_t s[3] = {4 * 64, 4 * 64, 64}; /* contiguous: out's rows must not coincide */
    memcpy(a.q_strides, s, sizeof s), memcpy(a.k_strides, s, sizeof s);
    memcpy(a.v_strides, s, sizeof s), memcpy(a.out_strides, s, sizeof s);
    a.q_dtype = a.k_dtype = a.v_dtype = MHA_DTYPE_BF16;
    mha_error err;
    if (index >= 0) {
        const mha_status st = mha_experimental_attention_with_kernel(index, &a, NULL, &err);
        CHECK(st == MHA_STATUS_UNSUPPORTED && strstr(err.message, name),
              "forcing unusable %s: %s (%s)", name, mha_status_string(st), err.message);
    }
    if (!getenv("MHA_KERNEL")) {
        CHECK_OK(mha_attention(&a, NULL, &err), &err);
        CHECK(o[0] == 0.0f, "bf16 zeros in, %g out", (double)o[0]);
    }
}

int main(void) {
    int ran = 0, lines = 0;
    for (int32_t i = 0; i < mha_experimental_kernel_count(); i++) {
        mha_kernel_desc d;
        if (mha_experimental_kernel_describe(i, &d, NULL) != MHA_STATUS_OK ||
            strcmp(d.op, "fwd") != 0 || strstr(d.dtypes, "f32"))
            continue;
        lines++;
        if (!d.usable) {
            printf("kernel %s (%s): skipped, this CPU (under MHA_MAX_ISA) lacks %s\n", d.name,
                   d.dtypes, d.isa);
            unusable(i, d.name);
            continue;
        }
        printf("kernel %s (dtypes %s):\n", d.name, d.dtypes);
        selection(i, d.name);
        feature_matrix(i);
        ran++;
    }
    if (lines == 0) {
        printf("this build has no half-tile forward kernel (x86-64 has the AVX512-BF16 one)\n");
        unusable(-1, "");
    }
    printf("half-tile kernels run: %d; worst out error %.2f u_s (max|V| + max|o*|) (gate %.1f)\n",
           ran, g_worst_out, TOL_HALF_TILE_C);
    return test_finish();
}
