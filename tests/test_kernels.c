/* SPDX-License-Identifier: MIT */
/* test_kernels.c: every registry kernel this CPU can run, against the float64 oracle and the
 * reference implementation (the error-ratio rule of docs/TESTING.md), over a shape sweep and a
 * feature matrix; bit-identical results for 1, 2 and 3 threads; guard zones around every output,
 * outputs pre-poisoned with NaN, inputs checked unchanged; the vectorised exp/tanh against libm
 * in ULPs; dispatch (impl=fast/auto, unsupported head sizes).
 *
 *   ./test_kernels [--kernel NAME] [--case N] [--quick] [--full]
 * MHA_TEST_QUICK=1 (or a Debug build) runs a subsample of the sweep; MHA_KERNEL=NAME restricts
 * the test to that kernel; MHA_KERNEL_BENCH=1 prints timings (never asserted on).
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include "harness.h"
#include "kernels/kernels.h"
#include "mha_experimental.h"
#include "oracle_f64.h"
#include "tolerance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int g_quick, g_full, g_only_case = -1;
static int g_debug; /* unoptimised (sanitizer) build: the smallest sweep */
static const char *g_only_kernel;

/* ---------------------------------------------------------------------------------------------- */
/* Guarded buffers: canary zones before and after, checked after every call.                      */
/* ---------------------------------------------------------------------------------------------- */

#define GUARD 64
static const uint32_t CANARY = 0x7fb1a5e5u; /* a signalling-NaN pattern nobody writes */

typedef struct gbuf {
    float *base; /* GUARD + count + GUARD floats */
    float *p;    /* base + GUARD */
    int64_t count;
} gbuf;

static void fill_canary(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        memcpy(x + i, &CANARY, sizeof CANARY);
}

static int is_canary(const float *x) {
    uint32_t b;
    memcpy(&b, x, sizeof b);
    return b == CANARY;
}

static gbuf galloc(int64_t count) {
    gbuf g;
    g.count = count;
    g.base = malloc(sizeof(float) * (size_t)(count + 2 * GUARD));
    g.p = g.base + GUARD;
    fill_canary(g.base, count + 2 * GUARD);
    return g;
}

static int guards_intact(const gbuf *g) {
    for (int64_t i = 0; i < GUARD; i++)
        if (!is_canary(g->base + i) || !is_canary(g->p + g->count + i))
            return 0;
    return 1;
}

/* ---------------------------------------------------------------------------------------------- */
/* A test case.                                                                                   */
/* ---------------------------------------------------------------------------------------------- */

enum { LAYOUT_BHLD, LAYOUT_BLHD, LAYOUT_PADDED, LAYOUT_COUNT };
enum {
    SPECIAL_NONE,
    SPECIAL_EMPTY_ROWS,   /* some rows see no key: zeros, lse -inf */
    SPECIAL_NAN_Q,        /* NaN in one query row: that row is NaN */
    SPECIAL_NAN_K,        /* NaN in a visible key: rows that see it are NaN */
    SPECIAL_BAD_V_HIDDEN, /* Inf/NaN in V at a padded key: nobody sees it, output finite */
    SPECIAL_INF_V,        /* +Inf in V at a visible key */
};

typedef struct tcase {
    int64_t B, H, G, n, m, dk, dv;
    int layout;
    int causal, align; /* align: mha_alignment */
    int window;
    int64_t wl, wr;
    int bool_mask, bool_shape, bool_dtype, polarity;
    int additive, add_shape;
    int key_padding, segments, alibi, sinks;
    float softcap, dropout;
    int probs, avg_probs;
    double qscale;
    int special;
    uint64_t seed;
} tcase;

/* Inputs and expected values of a case. */
typedef struct tdata {
    mha_attention_args a;
    float *q, *k, *v, *qkv_copy; /* copy of q, k, v spans to check they are unchanged */
    int64_t q_span, k_span, v_span, o_span;
    void *bool_mask;
    float *add_mask, *sinks;
    uint8_t *kpm;
    int32_t *qseg, *kseg;
    int64_t *offsets;
    double *o_ref, *lse_ref, *p_ref; /* oracle */
    double max_v, max_s;
} tdata;

static void strides_for(
    int layout, int64_t B, int64_t heads, int64_t L, int64_t d, int64_t s[3], int64_t *span) {
    switch (layout) {
    case LAYOUT_BLHD:
        s[0] = L * heads * d, s[1] = d, s[2] = heads * d;
        break;
    case LAYOUT_PADDED: /* rows of d + 3 floats, heads separated by one spare row */
        s[2] = d + 3, s[1] = (L + 1) * (d + 3), s[0] = heads * s[1] + 5;
        break;
    default:
        s[0] = heads * L * d, s[1] = L * d, s[2] = d;
        break;
    }
    *span = (B - 1) * s[0] + (heads - 1) * s[1] + (L - 1) * s[2] + d;
}

static float *alloc_filled(test_rng *r, int64_t count, float stddev) {
    float *x = malloc(sizeof(float) * (size_t)(count > 0 ? count : 1));
    test_fill_normal(r, x, count, stddev);
    return x;
}

static size_t dtype_bytes(mha_dtype t) {
    return mha_dtype_size(t);
}

static void set_int(void *base, mha_dtype t, int64_t idx, int value) {
    switch (t) {
    case MHA_DTYPE_I32:
        ((int32_t *)base)[idx] = value;
        break;
    case MHA_DTYPE_I64:
        ((int64_t *)base)[idx] = value;
        break;
    default:
        ((uint8_t *)base)[idx] = (uint8_t)value;
        break;
    }
}

/* Builds inputs (deterministic from c->seed) and runs the oracle. Returns 0 on success. */
static int tdata_make(const tcase *c, tdata *t) {
    memset(t, 0, sizeof *t);
    test_rng r;
    test_rng_seed(&r, c->seed);
    mha_attention_args *a = &t->a;
    a->batch = c->B, a->num_heads = c->H, a->num_kv_heads = c->G, a->q_len = c->n;
    a->kv_len = c->m, a->head_dim = c->dk, a->v_head_dim = c->dv;
    strides_for(c->layout, c->B, c->H, c->n, c->dk, a->q_strides, &t->q_span);
    strides_for(c->layout, c->B, c->G, c->m, c->dk, a->k_strides, &t->k_span);
    strides_for(c->layout, c->B, c->G, c->m, c->dv, a->v_strides, &t->v_span);
    strides_for(c->layout == LAYOUT_BLHD ? LAYOUT_PADDED : c->layout, c->B, c->H, c->n, c->dv,
                a->out_strides, &t->o_span);
    /* +1: base pointers deliberately not 64-byte aligned. */
    t->q = alloc_filled(&r, t->q_span + 1, (float)c->qscale) + 1;
    t->k = alloc_filled(&r, t->k_span + 1, 1.0f) + 1;
    t->v = alloc_filled(&r, t->v_span + 1, 1.0f) + 1;
    a->q = t->q, a->k = t->k, a->v = t->v;

    const int64_t B = c->B, H = c->H, n = c->n, m = c->m;
    mha_masking *mk = &a->mask;
    mk->causal = c->causal;
    mk->alignment = (mha_alignment)c->align;
    if (c->align == MHA_ALIGN_EXPLICIT) {
        t->offsets = malloc(sizeof(int64_t) * (size_t)B);
        for (int64_t b = 0; b < B; b++)
            t->offsets[b] = (int64_t)(test_rng_u64(&r) % (uint64_t)(m + 8)) - 6;
        mk->align_offsets = t->offsets;
    }
    if (c->window) {
        mk->use_window = 1;
        mk->window_left = c->wl;
        mk->window_right = c->wr;
    }
    if (c->bool_mask) {
        static const mha_dtype dts[4] = {MHA_DTYPE_BOOL, MHA_DTYPE_U8, MHA_DTYPE_I32,
                                         MHA_DTYPE_I64};
        const mha_dtype dt = dts[c->bool_dtype & 3];
        mha_mask_tensor *bm = &mk->bool_mask;
        bm->dtype = dt;
        switch (c->bool_shape % 5) {
        case 0:
            bm->ndim = 2, bm->shape[0] = n, bm->shape[1] = m;
            break;
        case 1:
            bm->ndim = 4, bm->shape[0] = B, bm->shape[1] = 1, bm->shape[2] = n, bm->shape[3] = m;
            break;
        case 2:
            bm->ndim = 4, bm->shape[0] = B, bm->shape[1] = H, bm->shape[2] = n, bm->shape[3] = m;
            break;
        case 3:
            bm->ndim = 4, bm->shape[0] = 1, bm->shape[1] = 1, bm->shape[2] = 1, bm->shape[3] = m;
            break;
        default:
            bm->ndim = 3, bm->shape[0] = H, bm->shape[1] = n, bm->shape[2] = 1;
            break;
        }
        int64_t count = 1;
        for (int d = 0; d < bm->ndim; d++)
            count *= bm->shape[d];
        t->bool_mask = malloc(dtype_bytes(dt) * (size_t)count);
        mk->bool_mask_polarity = c->polarity ? MHA_MASK_BLOCK : MHA_MASK_ATTEND;
        for (int64_t e = 0; e < count; e++) {
            int attend = test_rng_uniform(&r) < 0.8;
            set_int(t->bool_mask, dt, e, c->polarity ? !attend : attend);
        }
        bm->data = t->bool_mask;
    }
    if (c->additive) {
        mha_mask_tensor *am = &mk->additive_mask;
        am->dtype = MHA_DTYPE_F32;
        switch (c->add_shape % 3) {
        case 0:
            am->ndim = 2, am->shape[0] = n, am->shape[1] = m;
            break;
        case 1:
            am->ndim = 4, am->shape[0] = B, am->shape[1] = H, am->shape[2] = n, am->shape[3] = m;
            break;
        default:
            am->ndim = 4, am->shape[0] = 1, am->shape[1] = 1, am->shape[2] = 1, am->shape[3] = m;
            break;
        }
        int64_t count = 1;
        for (int d = 0; d < am->ndim; d++)
            count *= am->shape[d];
        t->add_mask = alloc_filled(&r, count, 1.0f);
        for (int64_t e = 0; e < count; e++)
            if (test_rng_uniform(&r) < 0.1)
                t->add_mask[e] = -INFINITY;
        am->data = t->add_mask;
    }
    if (c->key_padding || c->special == SPECIAL_BAD_V_HIDDEN) {
        /* [B, m]: batch row b has its last (b * 3 + 1) % m keys padded, plus random holes. */
        t->kpm = malloc((size_t)(B * m));
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < m; j++)
                t->kpm[b * m + j] =
                    (uint8_t)(j < m - (b * 3 + 1) % (m + 1) && test_rng_uniform(&r) < 0.9);
        if (c->special == SPECIAL_BAD_V_HIDDEN)
            for (int64_t b = 0; b < B; b++)
                t->kpm[b * m + (m - 1) / 2] = 0;
        mk->key_padding = (mha_mask_tensor){t->kpm, MHA_DTYPE_U8, 2, {B, m}};
    }
    if (c->segments) {
        t->qseg = malloc(sizeof(int32_t) * (size_t)(B * n));
        t->kseg = malloc(sizeof(int32_t) * (size_t)(B * m));
        for (int64_t b = 0; b < B; b++) {
            for (int64_t i = 0; i < n; i++)
                t->qseg[b * n + i] = (int32_t)(i * 3 / n);
            for (int64_t j = 0; j < m; j++)
                t->kseg[b * m + j] = (int32_t)(j * 3 / m);
        }
        mk->q_segment_ids = t->qseg;
        mk->kv_segment_ids = t->kseg;
    }
    if (c->special == SPECIAL_EMPTY_ROWS) {
        /* Rows i % 4 == 1 see nothing: a [n, 1] boolean mask (ATTEND polarity). */
        if (!c->bool_mask) {
            uint8_t *bm = malloc((size_t)n);
            for (int64_t i = 0; i < n; i++)
                bm[i] = (uint8_t)(i % 4 != 1);
            t->bool_mask = bm;
            mk->bool_mask = (mha_mask_tensor){bm, MHA_DTYPE_U8, 2, {n, 1}};
            mk->bool_mask_polarity = MHA_MASK_ATTEND;
        }
    }
    if (c->sinks) {
        t->sinks = alloc_filled(&r, H, 2.0f);
        a->sinks = t->sinks;
    }
    a->softcap = (double)c->softcap;
    a->alibi = c->alibi;
    if (c->dropout > 0.0f)
        a->dropout = (mha_dropout){.p = c->dropout, .seed = test_rng_u64(&r), .training = 1};

    /* Specials that edit inputs. */
    if (c->special == SPECIAL_NAN_Q) {
        const int64_t b = c->B - 1, h = c->H / 2, i = c->n / 2;
        t->q[b * a->q_strides[0] + h * a->q_strides[1] + i * a->q_strides[2]] = NAN;
    }
    if (c->special == SPECIAL_NAN_K)
        t->k[(c->m / 3) * a->k_strides[2] + c->dk / 2] = NAN;
    if (c->special == SPECIAL_BAD_V_HIDDEN)
        for (int64_t b = 0; b < B; b++)
            for (int64_t g = 0; g < c->G; g++) {
                float *vr = t->v + b * a->v_strides[0] + g * a->v_strides[1] +
                            ((m - 1) / 2) * a->v_strides[2];
                vr[0] = INFINITY;
                vr[c->dv - 1] = NAN;
            }
    if (c->special == SPECIAL_INF_V)
        t->v[0 * a->v_strides[2] + c->dv / 2] = INFINITY;

    /* Keep copies of the inputs. */
    t->qkv_copy = malloc(sizeof(float) * (size_t)(t->q_span + t->k_span + t->v_span));
    memcpy(t->qkv_copy, t->q, sizeof(float) * (size_t)t->q_span);
    memcpy(t->qkv_copy + t->q_span, t->k, sizeof(float) * (size_t)t->k_span);
    memcpy(t->qkv_copy + t->q_span + t->k_span, t->v, sizeof(float) * (size_t)t->v_span);

    /* Scales for the tolerances: max|V| (finite) and a bound on max|S|. */
    double max_v = 0.0;
    for (int64_t e = 0; e < t->v_span; e++)
        if (isfinite(t->v[e]))
            max_v = fmax(max_v, fabs((double)t->v[e]));
    double max_q = 0.0, max_k = 0.0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < n; i++) {
                const float *qr =
                    t->q + b * a->q_strides[0] + h * a->q_strides[1] + i * a->q_strides[2];
                double s2 = 0.0;
                for (int64_t d = 0; d < c->dk; d++)
                    s2 += (double)qr[d] * (double)qr[d];
                if (isfinite(s2))
                    max_q = fmax(max_q, sqrt(s2));
            }
    for (int64_t b = 0; b < B; b++)
        for (int64_t g = 0; g < c->G; g++)
            for (int64_t j = 0; j < m; j++) {
                const float *kr =
                    t->k + b * a->k_strides[0] + g * a->k_strides[1] + j * a->k_strides[2];
                double s2 = 0.0;
                for (int64_t d = 0; d < c->dk; d++)
                    s2 += (double)kr[d] * (double)kr[d];
                if (isfinite(s2))
                    max_k = fmax(max_k, sqrt(s2));
            }
    double max_s = max_q * max_k / sqrt((double)c->dk);
    if (c->softcap > 0.0f)
        max_s = fmin(max_s, (double)c->softcap);
    double max_add = 0.0;
    if (t->add_mask) {
        const mha_mask_tensor *am = &mk->additive_mask;
        int64_t count = 1;
        for (int d = 0; d < am->ndim; d++)
            count *= am->shape[d];
        for (int64_t e = 0; e < count; e++)
            if (isfinite(t->add_mask[e]))
                max_add = fmax(max_add, fabs((double)t->add_mask[e]));
    }
    max_s += max_add + (c->alibi ? 0.5 * (double)(n + m + 16) : 0.0);
    if (t->sinks)
        for (int64_t h = 0; h < H; h++)
            max_s = fmax(max_s, fabs((double)t->sinks[h]));
    t->max_v = max_v;
    t->max_s = max_s;

    t->o_ref = malloc(sizeof(double) * (size_t)(B * H * n * c->dv));
    t->lse_ref = malloc(sizeof(double) * (size_t)(B * H * n));
    t->p_ref = c->probs ? malloc(sizeof(double) * (size_t)(B * H * n * m)) : NULL;
    return oracle_attention(a, t->o_ref, t->lse_ref, t->p_ref);
}

static void tdata_free(tdata *t) {
    free(t->q - 1), free(t->k - 1), free(t->v - 1), free(t->qkv_copy), free(t->bool_mask);
    free(t->add_mask), free(t->sinks), free(t->kpm), free(t->qseg), free(t->kseg);
    free(t->offsets), free(t->o_ref), free(t->lse_ref), free(t->p_ref);
}

static void describe(const tcase *c, char *buf, size_t size) {
    static const char *layouts[] = {"bhld", "blhd", "padded"};
    snprintf(buf, size,
             "seed=%llu shape=%lld,%lld,%lld,%lld,%lld,%lld,%lld layout=%s causal=%d align=%d "
             "window=%d(%lld,%lld) bool=%d/%d/%d/%d add=%d/%d kpm=%d seg=%d softcap=%g alibi=%d "
             "sinks=%d dropout=%g probs=%d/%d qscale=%g special=%d",
             (unsigned long long)c->seed, (long long)c->B, (long long)c->H, (long long)c->G,
             (long long)c->n, (long long)c->m, (long long)c->dk, (long long)c->dv,
             layouts[c->layout], c->causal, c->align, c->window, (long long)c->wl, (long long)c->wr,
             c->bool_mask, c->bool_shape, c->bool_dtype, c->polarity, c->additive, c->add_shape,
             c->key_padding, c->segments, (double)c->softcap, c->alibi, c->sinks,
             (double)c->dropout, c->probs, c->avg_probs, c->qscale, c->special);
}

/* ---------------------------------------------------------------------------------------------- */
/* Running one implementation on a case.                                                          */
/* ---------------------------------------------------------------------------------------------- */

typedef struct result {
    gbuf out, lse, probs;
    unsigned char *is_out; /* o_span flags: 1 where out has an element */
    int ok;
} result;

static void result_free(result *r) {
    free(r->out.base), free(r->lse.base), free(r->probs.base), free(r->is_out);
}

static int64_t probs_count(const tcase *c) {
    return c->B * (c->avg_probs ? 1 : c->H) * c->n * c->m;
}

/* Runs kernel `index` with n_threads; checks guards and inputs. */
static result
run_kernel(const tcase *c, tdata *t, int index, int n_threads, const char *what, const char *desc) {
    result r;
    memset(&r, 0, sizeof r);
    r.out = galloc(t->o_span);
    r.lse = galloc(c->B * c->H * c->n);
    r.probs = galloc(c->probs ? probs_count(c) : 1);
    r.is_out = calloc((size_t)t->o_span, 1);
    mha_attention_args *a = &t->a;
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t h = 0; h < c->H; h++)
            for (int64_t i = 0; i < c->n; i++)
                for (int64_t d = 0; d < c->dv; d++) {
                    const int64_t e =
                        b * a->out_strides[0] + h * a->out_strides[1] + i * a->out_strides[2] + d;
                    r.out.p[e] = NAN; /* poisoned: a skipped element stays NaN */
                    r.is_out[e] = 1;
                }
    for (int64_t e = 0; e < r.lse.count; e++)
        r.lse.p[e] = NAN;
    if (c->probs)
        for (int64_t e = 0; e < r.probs.count; e++)
            r.probs.p[e] = NAN;
    a->out = r.out.p;
    a->lse = r.lse.p;
    a->probs = c->probs ? r.probs.p : NULL;
    a->average_probs = c->avg_probs;
    mha_exec ex = {MHA_IMPL_AUTO, n_threads, NULL, 0, NULL, NULL};
    mha_error err;
    const mha_status st = mha_experimental_attention_with_kernel(index, a, &ex, &err);
    CHECK(st == MHA_STATUS_OK, "%s threads=%d: status %s (%s) %s", what, n_threads,
          mha_status_string(st), err.message, desc);
    r.ok = st == MHA_STATUS_OK;
    int intact = guards_intact(&r.out) && guards_intact(&r.lse) && guards_intact(&r.probs);
    for (int64_t e = 0; e < t->o_span; e++)
        if (!r.is_out[e] && !is_canary(r.out.p + e))
            intact = 0;
    CHECK(intact, "%s threads=%d: wrote outside its outputs %s", what, n_threads, desc);
    const int same =
        memcmp(t->qkv_copy, t->q, sizeof(float) * (size_t)t->q_span) == 0 &&
        memcmp(t->qkv_copy + t->q_span, t->k, sizeof(float) * (size_t)t->k_span) == 0 &&
        memcmp(t->qkv_copy + t->q_span + t->k_span, t->v, sizeof(float) * (size_t)t->v_span) == 0;
    CHECK(same, "%s threads=%d: modified its inputs %s", what, n_threads, desc);
    return r;
}

/* Error statistics of a result against the oracle. NaN/Inf must match the oracle's class. */
typedef struct errs {
    double out, lse, probs;     /* max abs error over finite oracle values */
    double out_backstop_excess; /* max of err - allowed, per element (<= 0 passes) */
    double nmse_num, nmse_den;
    int64_t worst_index;
    int64_t class_mismatch; /* finite vs NaN vs +-Inf disagreements */
} errs;

static int fclass(double x) {
    return isnan(x) ? 3 : isinf(x) ? (x > 0 ? 1 : 2) : 0;
}

static errs measure(const tcase *c, const tdata *t, const result *r) {
    errs e;
    memset(&e, 0, sizeof e);
    e.out_backstop_excess = -HUGE_VAL;
    const mha_attention_args *a = &t->a;
    const double tol_scale = TOL_OUT_BACKSTOP_C * TOL_U32 * t->max_v * (1.0 + t->max_s);
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t h = 0; h < c->H; h++)
            for (int64_t i = 0; i < c->n; i++) {
                const int64_t row = (b * c->H + h) * c->n + i;
                for (int64_t d = 0; d < c->dv; d++) {
                    const double want = t->o_ref[row * c->dv + d];
                    const double got =
                        (double)r->out.p[b * a->out_strides[0] + h * a->out_strides[1] +
                                         i * a->out_strides[2] + d];
                    if (fclass(want) != fclass(got)) {
                        e.class_mismatch++;
                        continue;
                    }
                    if (fclass(want))
                        continue;
                    const double err = fabs(got - want);
                    if (err > e.out) {
                        e.out = err;
                        e.worst_index = row * c->dv + d;
                    }
                    e.out_backstop_excess =
                        fmax(e.out_backstop_excess, err - (tol_scale + TOL_U32 * fabs(want)));
                    e.nmse_num += err * err;
                    e.nmse_den += want * want;
                }
                const double lw = t->lse_ref[row], lg = (double)r->lse.p[row];
                if (fclass(lw) != fclass(lg))
                    e.class_mismatch++;
                else if (!fclass(lw))
                    e.lse = fmax(e.lse, fabs(lg - lw));
            }
    if (c->probs) {
        const int64_t nm = c->n * c->m;
        for (int64_t b = 0; b < c->B; b++)
            for (int64_t h = 0; h < (c->avg_probs ? 1 : c->H); h++)
                for (int64_t x = 0; x < nm; x++) {
                    double want = 0.0;
                    if (c->avg_probs) {
                        for (int64_t hh = 0; hh < c->H; hh++)
                            want += t->p_ref[(b * c->H + hh) * nm + x];
                        want /= (double)c->H;
                    } else {
                        want = t->p_ref[(b * c->H + h) * nm + x];
                    }
                    const double got =
                        (double)r->probs.p[(b * (c->avg_probs ? 1 : c->H) + h) * nm + x];
                    if (fclass(want) != fclass(got))
                        e.class_mismatch++;
                    else if (!fclass(want))
                        e.probs = fmax(e.probs, fabs(got - want));
                }
    }
    return e;
}

/* ---------------------------------------------------------------------------------------------- */
/* Checking one kernel on one case.                                                               */
/* ---------------------------------------------------------------------------------------------- */

typedef struct kstats {
    int cases;
    double worst_ratio;    /* max over cases of err_kernel / err_ref (out) */
    double worst_backstop; /* max over elements of err / allowed */
    double worst_probs_ratio;
    double worst_err, worst_err_ref; /* of the worst-ratio case */
    char worst_desc[640];
    double worst_perr, worst_perr_ref; /* of the worst probabilities ratio */
} kstats;

static int g_ref_index;

static void check_case(const tcase *c, int kindex, const char *kname, kstats *ks) {
    char desc[640];
    describe(c, desc, sizeof desc);
    tdata t;
    if (tdata_make(c, &t) != 0) {
        CHECK(0, "oracle refused the case %s", desc);
        tdata_free(&t);
        return;
    }
    result ref = run_kernel(c, &t, g_ref_index, 1, "reference", desc);
    const errs er = measure(c, &t, &ref);
    CHECK(er.class_mismatch == 0, "reference: %lld NaN/Inf/finite mismatches vs oracle %s",
          (long long)er.class_mismatch, desc);
    const double slack = TOL_U32 * t.max_v;
    result first;
    memset(&first, 0, sizeof first);
    const int max_threads = g_quick ? 2 : 3;
    for (int th = 1; th <= max_threads; th++) {
        char what[160];
        snprintf(what, sizeof what, "kernel %s", kname);
        result r = run_kernel(c, &t, kindex, th, what, desc);
        if (!r.ok) {
            result_free(&r);
            break;
        }
        if (th == 1) {
            const errs ek = measure(c, &t, &r);
            CHECK(ek.class_mismatch == 0,
                  "%s: %lld NaN/Inf/finite mismatches vs oracle (reference: %lld) %s\n  repro: "
                  "./test_kernels --kernel %s --case %d",
                  kname, (long long)ek.class_mismatch, (long long)er.class_mismatch, desc, kname,
                  g_only_case);
            /* Ratio rule: at most twice the reference's error, plus u max|V|. */
            CHECK(ek.out <= 2.0 * er.out + slack,
                  "%s: max|o - o*| = %.3g > 2 x reference's %.3g + %.3g (index %lld, NMSE %.3g, "
                  "max|V| %.3g, max|S| <= %.3g) %s",
                  kname, ek.out, er.out, slack, (long long)ek.worst_index,
                  ek.nmse_den > 0 ? ek.nmse_num / ek.nmse_den : 0.0, t.max_v, t.max_s, desc);
            CHECK(ek.out_backstop_excess <= 0.0,
                  "%s: element error exceeds the backstop %g u max|V| (1 + max|S|) + u|o*| by "
                  "%.3g %s",
                  kname, TOL_OUT_BACKSTOP_C, ek.out_backstop_excess, desc);
            CHECK(er.out_backstop_excess <= 0.0, "reference exceeds the backstop by %.3g %s",
                  er.out_backstop_excess, desc);
            const double lse_slack = TOL_U32 * (1.0 + t.max_s + log((double)c->m + 1.0));
            CHECK(ek.lse <= 2.0 * er.lse + lse_slack,
                  "%s: max|lse - lse*| = %.3g > 2 x reference's %.3g + %.3g %s", kname, ek.lse,
                  er.lse, lse_slack, desc);
            if (c->probs)
                CHECK(ek.probs <= 2.0 * er.probs + TOL_U32 &&
                          ek.probs <= TOL_OUT_BACKSTOP_C * TOL_U32 * (1.0 + t.max_s),
                      "%s: max|p - p*| = %.3g (reference %.3g) %s", kname, ek.probs, er.probs,
                      desc);
            if (er.out > 0.0 && ek.out / er.out > ks->worst_ratio) {
                ks->worst_ratio = ek.out / er.out;
                ks->worst_err = ek.out;
                ks->worst_err_ref = er.out;
                snprintf(ks->worst_desc, sizeof ks->worst_desc, "%s", desc);
            }
            if (c->probs && er.probs > 0.0 && ek.probs / er.probs > ks->worst_probs_ratio) {
                ks->worst_probs_ratio = ek.probs / er.probs;
                ks->worst_perr = ek.probs;
                ks->worst_perr_ref = er.probs;
            }
            const double allowed = TOL_OUT_BACKSTOP_C * TOL_U32 * t.max_v * (1.0 + t.max_s);
            if (allowed > 0.0)
                ks->worst_backstop = fmax(ks->worst_backstop, ek.out / allowed);
            first = r;
            continue;
        }
        /* Bit-identical for every thread count. */
        int same = memcmp(first.out.base, r.out.base,
                          sizeof(float) * (size_t)(t.o_span + 2 * GUARD)) == 0 &&
                   memcmp(first.lse.base, r.lse.base,
                          sizeof(float) * (size_t)(r.lse.count + 2 * GUARD)) == 0 &&
                   memcmp(first.probs.base, r.probs.base,
                          sizeof(float) * (size_t)(r.probs.count + 2 * GUARD)) == 0;
        CHECK(same, "%s: threads=%d differs from threads=1 %s", kname, th, desc);
        result_free(&r);
    }
    result_free(&first);
    result_free(&ref);
    tdata_free(&t);
    ks->cases++;
}

/* ---------------------------------------------------------------------------------------------- */
/* The sweeps.                                                                                    */
/* ---------------------------------------------------------------------------------------------- */

static tcase base_case(uint64_t seed) {
    tcase c;
    memset(&c, 0, sizeof c);
    c.B = 1, c.H = 2, c.G = 2, c.n = 8, c.m = 8, c.dk = 16, c.dv = 16;
    c.qscale = 1.0;
    c.seed = seed;
    return c;
}

static int g_case_counter;

static void run(const tcase *c, int kindex, const char *kname, kstats *ks) {
    const int id = g_case_counter++;
    if (g_only_case >= 0 && id != g_only_case)
        return;
    const int saved = g_only_case;
    g_only_case = id; /* for the repro line */
    check_case(c, kindex, kname, ks);
    g_only_case = saved;
}

/* d x n x m with causal/GQA/layout/batch cycled through the cases. */
static void shape_sweep(int kindex, const char *kname, int bq, int bk, kstats *ks) {
    static const int64_t ds[] = {8, 32, 40, 64, 72, 80, 96, 128, 256};
    const int64_t ns[] = {1, 3, bq - 1, bq, bq + 1, 75};
    const int64_t ms[] = {1, bk - 1, bk, bk + 1, 113, 300};
    int idx = 0;
    for (size_t di = 0; di < sizeof ds / sizeof ds[0]; di++)
        for (size_t ni = 0; ni < 6; ni++)
            for (size_t mi = 0; mi < 6; mi++, idx++) {
                if ((g_quick && idx % 5 != 0) || (g_debug && idx % 12 != 0))
                    continue;
                tcase c = base_case(1000u + (uint64_t)idx);
                c.dk = ds[di];
                c.dv = (idx % 4 == 3) ? ds[(di + 3) % 9] : ds[di]; /* d_v != d_k sometimes */
                c.n = ns[ni];
                c.m = ms[mi];
                if (c.n < 1)
                    c.n = 1;
                if (c.m < 1)
                    c.m = 1;
                const int gqa = idx % 2;
                c.H = gqa ? 4 : 2;
                c.G = gqa ? 1 : 2;
                c.B = (idx % 3 == 0) ? 2 : 1;
                c.causal = (idx / 2) % 3 != 0;
                c.align = (idx / 2) % 3 == 2 ? MHA_ALIGN_TOP_LEFT : MHA_ALIGN_BOTTOM_RIGHT;
                c.layout = (idx / 3) % LAYOUT_COUNT;
                c.qscale = idx % 7 == 0 ? 8.0 : 1.0;
                run(&c, kindex, kname, ks);
            }
}

/* Every feature on a few shapes, alone and in random combinations. */
static void feature_matrix(int kindex, const char *kname, int bq, int bk, kstats *ks) {
    const int64_t shapes[][7] = {
        /* B H G n m dk dv */
        {2, 4, 2, 75, 113, 64, 64},
        {1, 4, 1, 37, 300, 40, 72},
        {1, 2, 2, bq + 1, 2 * bk + 3, 128, 128},
        {2, 8, 2, 1, 113, 72, 72},
        {1, 3, 3, 130, 50, 96, 80},
        {1, 4, 4, 20, 20, 256, 256},
    };
    const int nshapes = (int)(sizeof shapes / sizeof shapes[0]);
    test_rng r;
    test_rng_seed(&r, 4242);
    const int combos = g_debug ? 2 : g_quick ? 12 : (g_full ? 120 : 40);
    for (int s = 0; s < nshapes; s++) {
        if (g_debug && s % 2 == 1)
            continue;
        for (int f = 0; f < 16 + combos; f++) {
            tcase c = base_case(50000u + (uint64_t)(s * 1000 + f));
            c.B = shapes[s][0], c.H = shapes[s][1], c.G = shapes[s][2], c.n = shapes[s][3];
            c.m = shapes[s][4], c.dk = shapes[s][5], c.dv = shapes[s][6];
            c.layout = f % LAYOUT_COUNT;
            /* f < 16: one feature at a time; then random combinations. */
            const uint32_t bits = f < 16 ? (1u << f) : (uint32_t)test_rng_u64(&r);
            if (bits & 1u)
                c.causal = 1, c.align = MHA_ALIGN_BOTTOM_RIGHT;
            if (bits & 2u)
                c.causal = 1, c.align = MHA_ALIGN_TOP_LEFT;
            if (bits & 4u) {
                static const int64_t w[4][2] = {{16, 0}, {8, 8}, {-1, 4}, {20, -1}};
                c.window = 1, c.wl = w[(f / 3) % 4][0], c.wr = w[(f / 3) % 4][1];
            }
            if (bits & 8u)
                c.bool_mask = 1, c.bool_shape = f % 5, c.bool_dtype = (f / 5) % 4,
                c.polarity = f % 2;
            if (bits & 16u)
                c.additive = 1, c.add_shape = f % 3;
            if (bits & 32u)
                c.key_padding = 1;
            if (bits & 64u)
                c.segments = 1;
            if (bits & 128u)
                c.softcap = 5.0f;
            if (bits & 256u)
                c.alibi = 1;
            if (bits & 512u)
                c.sinks = 1;
            if (bits & 1024u)
                c.dropout = 0.2f;
            if (bits & 2048u)
                c.probs = 1, c.avg_probs = (f / 2) % 2;
            if (bits & 4096u)
                c.qscale = 8.0;
            if (bits & 8192u)
                c.align = MHA_ALIGN_EXPLICIT, c.causal = (f % 2);
            if (bits & 16384u)
                c.special = SPECIAL_EMPTY_ROWS;
            if (bits & 32768u)
                c.probs = 1, c.avg_probs = 1;
            run(&c, kindex, kname, ks);
        }
    }
}

static void special_cases(int kindex, const char *kname, kstats *ks) {
    for (int sp = SPECIAL_EMPTY_ROWS; sp <= SPECIAL_INF_V; sp++)
        for (int variant = 0; variant < 4; variant++) {
            if (g_debug && variant % 2 != sp % 2)
                continue;
            tcase c = base_case(90000u + (uint64_t)(sp * 10 + variant));
            c.B = 2, c.H = 4, c.G = variant % 2 ? 1 : 4, c.n = 70, c.m = 90;
            c.dk = variant < 2 ? 64 : 40, c.dv = c.dk;
            c.causal = variant >= 2;
            c.probs = variant == 1 || variant == 3;
            c.avg_probs = variant == 3;
            c.sinks = variant == 2;
            c.special = sp;
            run(&c, kindex, kname, ks);
        }
    /* Head sizes that are not multiples of 4 (the sweep's are multiples of 8): the run-time-D
     * path's tails (NEON: the Q K^T d tail, K^T packing of a partial 4 x 4 block, O += P V
     * column groups ending in a partial vector of 1, 2 or 3 floats, the finiteness scan's tail),
     * with key tiles that end in a partial vector too. */
    const int64_t odd[][4] = {{19, 35, 70, 90}, {5, 13, 33, 113}, {30, 6, 65, 39}, {1, 1, 9, 70}};
    for (int v = 0; v < 4; v++) {
        tcase c = base_case(93000u + (uint64_t)v);
        c.B = 1 + v % 2, c.H = 4, c.G = v % 2 ? 1 : 2;
        c.dk = odd[v][0], c.dv = odd[v][1], c.n = odd[v][2], c.m = odd[v][3];
        c.causal = v % 2 == 0;
        c.probs = v == 1;
        c.sinks = v == 2;
        run(&c, kindex, kname, ks);
    }
    /* A kv head too long for the per-thread K^T cache (> 8 MiB packed): tiles packed one at a
     * time; with a window, most tiles are skipped. */
    for (int v = 0; v < 3; v++) {
        tcase c = base_case(92000u + (uint64_t)v);
        c.B = 1, c.H = 2, c.G = 1, c.n = 5, c.m = 33000, c.dk = 72, c.dv = 40;
        c.causal = v == 1;
        c.window = v == 2, c.wl = 300, c.wr = 40;
        c.align = MHA_ALIGN_TOP_LEFT;
        c.probs = v == 0 && !g_debug;
        run(&c, kindex, kname, ks);
    }
    /* Causal with n > m bottom-right (empty leading rows) and n < m top-left, every block
     * boundary; explicit offsets that hide everything. */
    const int64_t nm[][2] = {{130, 20}, {20, 130}, {65, 64}, {64, 65}, {200, 200}};
    for (int s = 0; s < 5; s++)
        for (int al = 0; al < 3; al++) {
            tcase c = base_case(91000u + (uint64_t)(s * 3 + al));
            c.n = nm[s][0], c.m = nm[s][1], c.dk = c.dv = 32, c.causal = 1, c.align = al;
            c.B = 3;
            c.probs = s == 0;
            run(&c, kindex, kname, ks);
            if (g_debug && (s + al) % 2)
                continue;
            c.window = 1, c.wl = 5, c.wr = 2;
            c.seed += 100;
            run(&c, kindex, kname, ks);
        }
}

/* ---------------------------------------------------------------------------------------------- */
/* Vectorised exp and tanh, in ULPs.                                                              */
/* ---------------------------------------------------------------------------------------------- */

static int64_t ulp_distance(float a, float b) {
    if (isnan(a) || isnan(b))
        return (isnan(a) && isnan(b)) ? 0 : INT64_MAX;
    int32_t ia, ib;
    memcpy(&ia, &a, 4), memcpy(&ib, &b, 4);
    /* map to a monotonic integer line */
    const int64_t la = ia < 0 ? (int64_t)INT32_MIN - ia : ia;
    const int64_t lb = ib < 0 ? (int64_t)INT32_MIN - ib : ib;
    return la > lb ? la - lb : lb - la;
}

typedef void (*vfn)(const float *, float *, int64_t);

/* Max ULP error of f against the double function g rounded to float, over floats in [lo, hi]
 * visited with a stride over their bit patterns. */
static int64_t
ulp_sweep(vfn f, double (*g)(double), float lo, float hi, uint32_t stride, float *worst_x) {
    enum { CHUNK = 4096 };
    float *x = malloc(sizeof(float) * CHUNK), *y = malloc(sizeof(float) * CHUNK);
    int64_t worst = 0;
    int cnt = 0;
    /* walk from lo to hi along the monotonic integer line */
    int32_t ilo, ihi;
    memcpy(&ilo, &lo, 4), memcpy(&ihi, &hi, 4);
    const int64_t a = ilo < 0 ? (int64_t)INT32_MIN - ilo : ilo;
    const int64_t b = ihi < 0 ? (int64_t)INT32_MIN - ihi : ihi;
    for (int64_t l = a; l <= b; l += stride) {
        const int32_t bits = l < 0 ? (int32_t)((int64_t)INT32_MIN - l) : (int32_t)l;
        memcpy(&x[cnt], &bits, 4);
        if (++cnt == CHUNK || l + stride > b) {
            f(x, y, cnt);
            for (int i = 0; i < cnt; i++) {
                const int64_t u = ulp_distance(y[i], (float)g((double)x[i]));
                if (u > worst) {
                    worst = u;
                    *worst_x = x[i];
                }
            }
            cnt = 0;
        }
    }
    free(x), free(y);
    return worst;
}

static void check_specials(vfn f, const char *name) {
    const float in[] = {-INFINITY, NAN,    0.0f,    -0.0f, -104.0f,
                        -200.0f,   -87.5f, -100.0f, 89.0f, INFINITY};
    float out[10];
    f(in, out, 10);
    CHECK(out[0] == 0.0f && isnan(out[1]) && out[2] == 1.0f && out[3] == 1.0f && out[4] == 0.0f &&
              out[5] == 0.0f && out[6] > 0.0f && out[6] < 0x1p-126f && out[7] > 0.0f &&
              isinf(out[8]) && isinf(out[9]),
          "%s specials: exp(-inf)=%g exp(nan)=%g exp(0)=%g exp(-104)=%g exp(-87.5)=%g "
          "exp(-100)=%g exp(89)=%g",
          name, (double)out[0], (double)out[1], (double)out[2], (double)out[4], (double)out[6],
          (double)out[7], (double)out[8]);
}

static void test_vector_math(void) {
    const char *isas = mha_experimental_cpu_isas(0);
    struct {
        const char *isa;
        vfn exp_fn, tanh_fn;
    } fns[] = {
#if defined(__x86_64__) || defined(__i386__)
        {"avx512", mha__vexp_avx512, mha__vtanh_avx512},
        {"avx2", mha__vexp_avx2, mha__vtanh_avx2},
#endif
#if defined(__aarch64__)
        {"neon", mha__vexp_neon, mha__vtanh_neon},
#endif
        {NULL, NULL, NULL},
    };
    const uint32_t stride = g_quick ? 1009 : 61;
    for (int i = 0; fns[i].isa; i++) {
        if (!strstr(isas, fns[i].isa)) {
            printf("vector math %s: skipped (CPU lacks it)\n", fns[i].isa);
            continue;
        }
        float wx = 0.0f, wt = 0.0f, wpos = 0.0f, wsub = 0.0f;
        const int64_t ue = ulp_sweep(fns[i].exp_fn, exp, -87.3f, -0.0f, stride, &wx);
        const int64_t upos = ulp_sweep(fns[i].exp_fn, exp, 0.0f, 88.7f, stride, &wpos);
        /* subnormal results: ULPs of the subnormal grid */
        const int64_t usub = ulp_sweep(fns[i].exp_fn, exp, -103.9f, -87.34f, 1, &wsub);
        const int64_t ut = ulp_sweep(fns[i].tanh_fn, tanh, -20.0f, 20.0f, stride, &wt);
        printf("vector math %s: exp max %lld ULP on [-87.3, 0] (at %a), %lld ULP on [0, 88.7], "
               "%lld ULP (subnormal) on [-103.9, -87.34]; tanh max %lld ULP on [-20, 20] (at "
               "%a)\n",
               fns[i].isa, (long long)ue, (double)wx, (long long)upos, (long long)usub,
               (long long)ut, (double)wt);
        CHECK(ue <= 1, "%s exp: %lld ULP at x=%a (stated: 1)", fns[i].isa, (long long)ue,
              (double)wx);
        CHECK(upos <= 2, "%s exp: %lld ULP at x=%a for x > 0", fns[i].isa, (long long)upos,
              (double)wpos);
        CHECK(usub <= 1, "%s exp: %lld subnormal ULP at x=%a", fns[i].isa, (long long)usub,
              (double)wsub);
        CHECK(ut <= 2, "%s tanh: %lld ULP at x=%a (stated: 2)", fns[i].isa, (long long)ut,
              (double)wt);
        check_specials(fns[i].exp_fn, fns[i].isa);
    }
}

/* The kernels' vectorised Philox: keep bits equal to the reference's decision, element for element
 * (counter words near 2^31, thresholds at both ends of [0, 1)). */
int mha__dropout_keep(uint64_t seed, float p, int64_t b, int64_t h, int64_t i, int64_t j);
void mha__philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);

static void test_dropout_bits(void) {
    typedef void (*bits_fn)(uint64_t, float, int64_t, int64_t, int64_t, int64_t, int, uint64_t *);
    struct {
        const char *isa;
        bits_fn fn;
    } fns[] = {
#if defined(__x86_64__) || defined(__i386__)
        {"avx512", mha__dropout_bits_avx512},
        {"avx2", mha__dropout_bits_avx2},
#endif
#if defined(__aarch64__)
        {"neon", mha__dropout_bits_neon},
#endif
        {NULL, NULL},
    };
    const char *isas = mha_experimental_cpu_isas(0);
    static const float ps[] = {0x1p-24f, 1e-3f, 0.1f, 0.5f, 0.9f, 1.0f - 0x1p-24f};
    for (int f = 0; fns[f].isa; f++) {
        if (!strstr(isas, fns[f].isa))
            continue;
        test_rng r;
        test_rng_seed(&r, 77);
        int64_t bad = 0, total = 0;
        for (int t = 0; t < (g_debug ? 200 : 3000); t++) {
            const uint64_t seed = test_rng_u64(&r);
            const float p = ps[t % 6];
            const int64_t big = (int64_t)1 << 31;
            const int64_t b = t % 3 == 0 ? big - 1 - t % 7 : (int64_t)(test_rng_u64(&r) % 64);
            const int64_t h = t % 5 == 0 ? big - 2 : (int64_t)(test_rng_u64(&r) % 64);
            const int64_t i = (int64_t)(test_rng_u64(&r) % (uint64_t)big);
            const int64_t j0 = t % 4 == 0 ? big - 64 : (int64_t)(test_rng_u64(&r) % 100000);
            const int nk = 1 + (int)(test_rng_u64(&r) % 128);
            uint64_t w[2] = {~(uint64_t)0, ~(uint64_t)0};
            fns[f].fn(seed, p, b, h, i, j0, nk, w);
            for (int j = 0; j < 128; j++) {
                const int got = (int)((w[j >> 6] >> (j & 63)) & 1);
                const int want = j < nk ? mha__dropout_keep(seed, p, b, h, i, j0 + j) : 0;
                bad += got != want;
                total++;
            }
        }
        /* At the threshold: p = u exactly keeps, the next float up drops. */
        for (int t = 0; t < 64; t++) {
            const uint64_t seed = test_rng_u64(&r);
            const int64_t b = t, h = 3 * t, i = 1000 + t, j = 77 + t;
            const uint32_t ctr[4] = {(uint32_t)j, (uint32_t)i, (uint32_t)h, (uint32_t)b};
            const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
            uint32_t out[4];
            mha__philox4x32_10(ctr, key, out);
            const float u = (float)(out[0] >> 8) * 0x1.0p-24f;
            if (u <= 0.0f || u >= 1.0f - 0x1p-24f)
                continue;
            uint64_t w[2];
            fns[f].fn(seed, u, b, h, i, j, 1, w);
            CHECK((w[0] & 1) == 1, "%s: p = u must keep", fns[f].isa);
            fns[f].fn(seed, nextafterf(u, 1.0f), b, h, i, j, 1, w);
            CHECK((w[0] & 1) == 0, "%s: p just above u must drop", fns[f].isa);
        }
        CHECK(bad == 0, "%s dropout keep bits: %lld of %lld differ from mha__dropout_keep",
              fns[f].isa, (long long)bad, (long long)total);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Dispatch through the public API.                                                               */
/* ---------------------------------------------------------------------------------------------- */

/* The registry as mha_experimental.h shows it: every op's lines, named mha_<op>_..._<isa>, a
 * generic kernel for every op, exactly one reference for fwd and bwd (the last line of its op),
 * and the kernel each op runs here. */
/* The prefetch levels this CPU should report, from /proc/cpuinfo's first vendor_id and cpu family
 * (not the library's cpuid code): the GEMMs' L2 on AMD with AVX-512, the decode kernels' L2 on
 * such a CPU of family < 26 (0x1A, Zen 5) only. 0 when /proc/cpuinfo cannot be read. */
static int expected_prefetch_levels(int *decode, int *gemm) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return 0;
    char line[512], vendor[64] = "";
    int family = -1;
    while (fgets(line, sizeof line, f) && (!vendor[0] || family < 0)) {
        if (!vendor[0] && sscanf(line, "vendor_id : %63s", vendor) == 1)
            continue;
        if (family < 0 && sscanf(line, "cpu family : %d", &family) == 1)
            continue;
    }
    fclose(f);
    const int amd512 =
        strcmp(vendor, "AuthenticAMD") == 0 && strstr(mha_experimental_cpu_isas(0), "avx512");
    *gemm = amd512 ? 2 : 1;
    *decode = amd512 && family >= 0 && family < 26 ? 2 : 1;
    return 1;
}

static void test_registry(void) {
    /* the prefetch levels: the L2 only on a CPU with AVX-512 (AMD's); the decode kernels' never
     * beyond the GEMMs' (Zen 5: the L1 for the decode kernels, the L2 for the GEMMs) */
    const int32_t level = mha_experimental_cpu_prefetch_level();
    const int32_t glevel = mha_experimental_cpu_gemm_prefetch_level();
    CHECK((level == 1 || level == 2) && (glevel == 1 || glevel == 2) && level <= glevel &&
              (glevel == 1 || strstr(mha_experimental_cpu_isas(0), "avx512")),
          "prefetch levels: decode %d, gemm %d on a CPU with %s", (int)level, (int)glevel,
          mha_experimental_cpu_isas(0));
    int want_decode, want_gemm;
    if (expected_prefetch_levels(&want_decode, &want_gemm))
        CHECK(level == want_decode && glevel == want_gemm,
              "prefetch levels: decode %d, gemm %d; /proc/cpuinfo says %d, %d", (int)level,
              (int)glevel, want_decode, want_gemm);
    printf("prefetch levels: decode kernels L%d, GEMMs L%d\n", (int)level, (int)glevel);
    const int32_t count = mha_experimental_kernel_count();
    const char *ops[] = {"fwd", "bwd", "decode", "gemm"};
    for (int o = 0; o < 4; o++) {
        int lines = 0, refs = 0, last_is_ref = 0, generic = 0;
        char prefix[16];
        snprintf(prefix, sizeof prefix, "mha_%s_", ops[o]);
        for (int32_t i = 0; i < count; i++) {
            mha_kernel_desc d;
            mha_error err;
            CHECK_OK(mha_experimental_kernel_describe(i, &d, &err), &err);
            if (strcmp(d.op, ops[o]) != 0)
                continue;
            lines++;
            refs += d.reference != 0;
            last_is_ref = d.reference != 0;
            generic += strcmp(d.isa, "generic") == 0;
            CHECK(strncmp(d.name, prefix, strlen(prefix)) == 0, "kernel %s of op %s", d.name, d.op);
            CHECK(mha_experimental_kernel_find(d.name) == i, "find(%s) != %d", d.name, (int)i);
            CHECK(strstr(d.name, "__") && strcmp(strstr(d.name, "__") + 2, d.isa) == 0,
                  "kernel %s: isa %s is not its name's suffix", d.name, d.isa);
            if (strcmp(d.isa, "generic") == 0 || d.reference)
                CHECK(d.usable, "%s must be usable everywhere", d.name);
            /* The generic tier and the references compute in float32 from any storage dtype
             * (the generic decode kernel also reads the 8-bit caches, q8_0 in either order). */
            CHECK(d.dtypes && (!(strcmp(d.isa, "generic") == 0 || d.reference) ||
                               strcmp(d.dtypes, o == 3   ? "f32"
                                                : o == 2 ? "f32,bf16,f16,q8_0,fp8_e4m3,q8_0x16"
                                                         : "f32,bf16,f16") == 0),
                  "kernel %s: dtypes %s", d.name, d.dtypes ? d.dtypes : "NULL");
            if (strcmp(d.op, "fwd") != 0) { /* only forward kernels run through this API */
                const mha_status st = mha_experimental_attention_with_kernel(i, NULL, NULL, &err);
                CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, d.name),
                      "attention_with_kernel(%s): %s %s", d.name, mha_status_string(st),
                      err.message);
            }
        }
        CHECK(lines >= 1 && generic == 1, "op %s: %d lines, %d generic", ops[o], lines, generic);
        if (o < 2)
            CHECK(refs == 1 && last_is_ref, "op %s: exactly one reference, its last line", ops[o]);
        else
            CHECK(refs == 0, "op %s has no reference line", ops[o]);
        if (o > 0) {
            mha_kernel_desc d;
            const int32_t active = mha_experimental_kernel_active(ops[o]);
            CHECK(mha_experimental_kernel_describe(active, &d, NULL) == MHA_STATUS_OK &&
                      strcmp(d.op, ops[o]) == 0 && d.usable && !d.reference,
                  "op %s: active kernel %d", ops[o], (int)active);
        }
    }
    CHECK(mha_experimental_kernel_active("no_such_op") == -1, "active(unknown op) must be -1");
    CHECK(mha_experimental_kernel_find("no_such_kernel") == -1, "find(unknown) must be -1");
}

static void test_dispatch(void) {
    const int32_t count = mha_experimental_kernel_count();

    /* A tiny problem with a head size beyond every fast kernel: FAST refuses naming head_dim,
     * AUTO runs the reference, REFERENCE runs. */
    const int64_t D = 5000;
    float *q = calloc(D, sizeof(float)), *k = calloc(2 * D, sizeof(float));
    float *v = calloc(2 * D, sizeof(float)), out[5000];
    for (int64_t d = 0; d < D; d++)
        v[d] = 1.0f, v[D + d] = 3.0f;
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = 1, a.num_heads = 1, a.q_len = 1, a.kv_len = 2, a.head_dim = D;
    a.q = q, a.k = k, a.v = v, a.out = out;
    const int64_t qs[3] = {D, D, D}, ks[3] = {2 * D, 2 * D, D};
    memcpy(a.q_strides, qs, sizeof qs), memcpy(a.k_strides, ks, sizeof ks);
    memcpy(a.v_strides, ks, sizeof ks), memcpy(a.out_strides, qs, sizeof qs);
    mha_error err;
    const char *forced = getenv("MHA_KERNEL");
    mha_exec fast = {MHA_IMPL_FAST, 1, NULL, 0, NULL, NULL},
             autox = {MHA_IMPL_AUTO, 1, NULL, 0, NULL, NULL};
    if (!forced) {
        mha_status st = mha_attention_supported(&a, &fast, &err);
        CHECK(st == MHA_STATUS_UNSUPPORTED && strstr(err.message, "head_dim"),
              "impl=fast with head_dim=5000: %s (%s)", mha_status_string(st), err.message);
        out[0] = -1.0f;
        st = mha_attention(&a, &fast, &err);
        CHECK(st == MHA_STATUS_UNSUPPORTED && out[0] == -1.0f,
              "impl=fast must refuse before writing: %s", mha_status_string(st));
        int32_t idx = -1;
        CHECK_OK(mha_experimental_attention_select(&a, &autox, &idx, &err), &err);
        mha_kernel_desc d;
        mha_experimental_kernel_describe(idx, &d, NULL);
        CHECK(d.reference, "impl=auto with head_dim=5000 selects %s, expected the reference",
              d.name);
        CHECK_OK(mha_attention(&a, &autox, &err), &err);
        CHECK(out[0] == 2.0f && out[D - 1] == 2.0f, "auto fallback result %g", (double)out[0]);
        /* A normal head size: FAST selects a fast kernel. */
        a.head_dim = 64;
        CHECK_OK(mha_experimental_attention_select(&a, &fast, &idx, &err), &err);
        mha_experimental_kernel_describe(idx, &d, NULL);
        CHECK(!d.reference && d.usable, "impl=fast selected %s", d.name);
        /* The first usable fast kernel in registry order. */
        for (int32_t i = 0; i < count; i++) {
            mha_kernel_desc e;
            mha_experimental_kernel_describe(i, &e, NULL);
            if (strcmp(e.op, "fwd") == 0 && e.usable && !e.reference && strstr(e.dtypes, "f32")) {
                CHECK(i == idx, "impl=fast selected %s, not the first usable %s", d.name, e.name);
                break;
            }
        }
    } else {
        /* MHA_KERNEL forces AUTO and FAST to that kernel. */
        int32_t idx = -1;
        a.head_dim = 64;
        const mha_status st = mha_experimental_attention_select(&a, &autox, &idx, &err);
        const int32_t want = mha_experimental_kernel_find(forced);
        mha_kernel_desc d;
        /* (a's q, k, v are float32: a forced line must take f32 to run it) */
        if (want >= 0 && mha_experimental_kernel_describe(want, &d, NULL) == 0 && d.usable &&
            strstr(d.dtypes, "f32"))
            CHECK(st == MHA_STATUS_OK && idx == want, "MHA_KERNEL=%s: selected %d", forced,
                  (int)idx);
        else
            CHECK(st == MHA_STATUS_UNSUPPORTED && strstr(err.message, "MHA_KERNEL"),
                  "MHA_KERNEL=%s (not usable): %s %s", forced, mha_status_string(st), err.message);
    }
    /* A kernel whose ISA this CPU lacks is refused by name. */
    for (int32_t i = 0; i < count; i++) {
        mha_kernel_desc d;
        mha_experimental_kernel_describe(i, &d, NULL);
        if (strcmp(d.op, "fwd") == 0 && !d.usable) {
            a.head_dim = 64;
            const mha_status st = mha_experimental_attention_with_kernel(i, &a, &autox, &err);
            CHECK(st == MHA_STATUS_UNSUPPORTED && strstr(err.message, d.name),
                  "unusable kernel %s: %s %s", d.name, mha_status_string(st), err.message);
        }
    }
    free(q), free(k), free(v);
}

/* ---------------------------------------------------------------------------------------------- */
/* Optional timing mode (MHA_KERNEL_BENCH=1): never asserted on.                                  */
/* ---------------------------------------------------------------------------------------------- */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#if defined(__x86_64__) && defined(__GNUC__)
#    include <immintrin.h>
/* Single-thread fp32 FMA peak with 512-bit FMAs: 12 independent chains. */
__attribute__((target("avx512f,fma"))) static double fma_peak_avx512(void) {
    __m512 acc[12];
    const __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < 12; i++)
        acc[i] = _mm512_set1_ps((float)i);
    const long iters = 20000000;
    const double t0 = now_s();
    for (long it = 0; it < iters; it++) {
        acc[0] = _mm512_fmadd_ps(acc[0], x, y), acc[1] = _mm512_fmadd_ps(acc[1], x, y);
        acc[2] = _mm512_fmadd_ps(acc[2], x, y), acc[3] = _mm512_fmadd_ps(acc[3], x, y);
        acc[4] = _mm512_fmadd_ps(acc[4], x, y), acc[5] = _mm512_fmadd_ps(acc[5], x, y);
        acc[6] = _mm512_fmadd_ps(acc[6], x, y), acc[7] = _mm512_fmadd_ps(acc[7], x, y);
        acc[8] = _mm512_fmadd_ps(acc[8], x, y), acc[9] = _mm512_fmadd_ps(acc[9], x, y);
        acc[10] = _mm512_fmadd_ps(acc[10], x, y), acc[11] = _mm512_fmadd_ps(acc[11], x, y);
    }
    const double t = now_s() - t0;
    float sink = 0.0f;
    for (int i = 0; i < 12; i++)
        sink += _mm512_reduce_add_ps(acc[i]);
    return sink == 12345.0f ? 0.0 : (double)iters * 12.0 * 32.0 / t * 1e-9;
}
#endif

static void bench_mode(void) {
    double peak = 0.0;
#if defined(__x86_64__) && defined(__GNUC__)
    if (strstr(mha_experimental_cpu_isas(0), "avx512"))
        peak = fma_peak_avx512();
#endif
    printf("bench: measured 1-thread fp32 FMA peak (zmm) %.1f GFLOP/s\n", peak);
    const int32_t count = mha_experimental_kernel_count();
    const int64_t n = getenv("MHA_BENCH_N") ? atoll(getenv("MHA_BENCH_N")) : 2048;
    const int64_t H = getenv("MHA_BENCH_H") ? atoll(getenv("MHA_BENCH_H")) : 4;
    for (int32_t ki = 0; ki < count; ki++) {
        mha_kernel_desc kd;
        mha_experimental_kernel_describe(ki, &kd, NULL);
        if (strcmp(kd.op, "fwd") != 0 || !kd.usable || kd.reference || !strstr(kd.dtypes, "f32") ||
            (g_only_kernel && strcmp(g_only_kernel, kd.name)))
            continue;
        for (int di = 0; di < 2; di++)
            for (int causal = 1; causal >= 0; causal--)
                for (int th = 1; th <= 2; th++) {
                    const int64_t D = di ? 128 : 64;
                    test_rng r;
                    test_rng_seed(&r, 1);
                    float *q = alloc_filled(&r, H * n * D, 1.0f);
                    float *k = alloc_filled(&r, H * n * D, 1.0f);
                    float *v = alloc_filled(&r, H * n * D, 1.0f);
                    float *o = malloc(sizeof(float) * (size_t)(H * n * D));
                    mha_attention_args a;
                    memset(&a, 0, sizeof a);
                    a.batch = 1, a.num_heads = H, a.q_len = n, a.kv_len = n, a.head_dim = D;
                    a.q = q, a.k = k, a.v = v, a.out = o;
                    const int64_t s[3] = {H * n * D, n * D, D};
                    memcpy(a.q_strides, s, sizeof s), memcpy(a.k_strides, s, sizeof s);
                    memcpy(a.v_strides, s, sizeof s), memcpy(a.out_strides, s, sizeof s);
                    a.mask.causal = causal;
                    mha_exec ex = {MHA_IMPL_AUTO, th, NULL, 0, NULL, NULL};
                    mha_error err;
                    double best = HUGE_VAL;
                    for (int rep = 0; rep < 4; rep++) {
                        const double t0 = now_s();
                        mha_experimental_attention_with_kernel(ki, &a, &ex, &err);
                        best = fmin(best, now_s() - t0);
                    }
                    /* FlashAttention's FLOP count: 4 n m d per head, causal: exact pairs. */
                    const double pairs =
                        causal ? (double)n * (double)(n + 1) / 2.0 : (double)n * (double)n;
                    const double gf = 4.0 * pairs * (double)D * (double)H / best * 1e-9;
                    printf("bench: %-36s d=%-3lld n=%lld H=%lld causal=%d threads=%d: %7.2f ms "
                           "%6.1f GFLOP/s  %5.1f%% of 1-thread peak\n",
                           kd.name, (long long)D, (long long)n, (long long)H, causal, th,
                           best * 1e3, gf, peak > 0 ? 100.0 * gf / peak : 0.0);
                    free(q), free(k), free(v), free(o);
                }
    }
}

/* ---------------------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
    g_quick = test_quick();
#ifndef NDEBUG
    g_quick = g_debug = 1; /* Debug/sanitizer builds: the smallest subsample */
#endif
    g_full = getenv("MHA_TEST_FULL") != NULL;
    g_only_kernel = getenv("MHA_KERNEL");
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--kernel") == 0 && i + 1 < argc)
            g_only_kernel = argv[++i];
        else if (strcmp(argv[i], "--case") == 0 && i + 1 < argc)
            g_only_case = atoi(argv[++i]);
        else if (strcmp(argv[i], "--quick") == 0)
            g_quick = 1;
        else if (strcmp(argv[i], "--full") == 0)
            g_full = 1, g_quick = g_debug = 0;
    }
    if (getenv("MHA_KERNEL_BENCH")) {
        bench_mode();
        return 0;
    }
    g_ref_index = -1;
    for (int32_t i = 0; i < mha_experimental_kernel_count(); i++) {
        mha_kernel_desc d;
        mha_experimental_kernel_describe(i, &d, NULL);
        if (d.reference && strcmp(d.op, "fwd") == 0)
            g_ref_index = i;
    }
    printf("CPU: %s (under MHA_MAX_ISA: %s)%s\n", mha_experimental_cpu_isas(0),
           mha_experimental_cpu_isas(1),
           g_debug   ? ", smallest sweep (debug build)"
           : g_quick ? ", quick sweep"
                     : "");
    test_registry();
    test_dispatch();
    test_vector_math();
    test_dropout_bits();
    for (int32_t ki = 0; ki < mha_experimental_kernel_count(); ki++) {
        mha_kernel_desc d;
        mha_experimental_kernel_describe(ki, &d, NULL);
        if (strcmp(d.op, "fwd") != 0 || (g_only_kernel && strcmp(g_only_kernel, d.name) != 0))
            continue;
        if (!d.usable) {
            printf("kernel %s: skipped (no %s here, or MHA_MAX_ISA caps it)\n", d.name, d.isa);
            continue;
        }
        if (!strstr(d.dtypes, "f32")) { /* this sweep's inputs are float32 */
            printf("kernel %s: takes %s inputs only, tested by test_half_kernel\n", d.name,
                   d.dtypes);
            continue;
        }
        kstats ks;
        memset(&ks, 0, sizeof ks);
        g_case_counter = 0;
        const int bq = d.block_q ? d.block_q : 32, bk = d.block_k ? d.block_k : 32;
        const double t0 = now_s();
        shape_sweep(ki, d.name, bq, bk, &ks);
        feature_matrix(ki, d.name, bq, bk, &ks);
        special_cases(ki, d.name, &ks);
        printf("kernel %s: %d cases, worst error ratio vs reference %.3f (probs %.3f), worst "
               "error / backstop %.3g, %.1f s\n",
               d.name, ks.cases, ks.worst_ratio, ks.worst_probs_ratio, ks.worst_backstop,
               now_s() - t0);
        printf("  worst ratio: kernel %.3g vs reference %.3g at %s; probabilities: %.3g vs %.3g\n",
               ks.worst_err, ks.worst_err_ref, ks.worst_desc, ks.worst_perr, ks.worst_perr_ref);
    }
    return test_finish();
}
