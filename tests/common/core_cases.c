/* SPDX-License-Identifier: MIT */
/* core_cases.c: the attention core's shared test cases (core_cases.h). */
#include "core_cases.h"

#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void build(const spec *s, uint64_t seed, built *c) {
    memset(c, 0, sizeof *c);
    c->s = *s;
    test_rng r;
    test_rng_seed(&r, seed);
    const int64_t B = s->B, H = s->H, G = s->G, n = s->n, m = s->m;
    c->q = malloc(sizeof(float) * (size_t)(B * H * n * s->dk));
    c->k = malloc(sizeof(float) * (size_t)(B * G * m * s->dk));
    c->v = malloc(sizeof(float) * (size_t)(B * G * m * s->dv));
    c->dout = malloc(sizeof(float) * (size_t)(B * H * n * s->dv));
    const float qs = (float)(s->qscale > 0.0 ? s->qscale : 1.0);
    test_fill_normal(&r, c->q, B * H * n * s->dk, qs);
    test_fill_normal(&r, c->k, B * G * m * s->dk, 1.0f);
    test_fill_normal(&r, c->v, B * G * m * s->dv, 1.0f);
    test_fill_normal(&r, c->dout, B * H * n * s->dv, 1.0f);
    mha_masking *mk = &c->mask;
    mk->causal = s->causal;
    mk->alignment = s->align;
    if (s->align == MHA_ALIGN_EXPLICIT) {
        for (int64_t b = 0; b < B && b < 4; b++)
            c->offsets[b] = (b * 3) % (m + 1) - 1 > 0 ? (b * 3) % (m + 1) - 1 : 1;
        mk->align_offsets = c->offsets;
    }
    mk->use_window = s->window;
    mk->window_left = s->wl;
    mk->window_right = s->wr;
    if (s->boolmask == 1 || s->dead) {
        c->bmask = malloc((size_t)(B * n * m));
        for (int64_t e = 0; e < B * n * m; e++)
            c->bmask[e] = test_rng_uniform(&r) < (s->boolmask == 1 ? 0.7 : 1.1);
        if (s->dead) /* row n-1 of batch 0 sees nothing: zero gradient, never NaN */
            for (int64_t j = 0; j < m; j++)
                c->bmask[(n - 1) * m + j] = 0;
        mk->bool_mask = (mha_mask_tensor){c->bmask, MHA_DTYPE_BOOL, 4, {B, 1, n, m}};
    } else if (s->boolmask == 2) {
        c->imask = malloc(sizeof(int32_t) * (size_t)(n * m));
        for (int64_t e = 0; e < n * m; e++)
            c->imask[e] = test_rng_uniform(&r) < 0.25 ? 7 : 0;
        mk->bool_mask = (mha_mask_tensor){c->imask, MHA_DTYPE_I32, 2, {n, m}};
        mk->bool_mask_polarity = MHA_MASK_BLOCK;
    }
    if (s->addmask) {
        c->amask = malloc(sizeof(float) * (size_t)(B * H * n * m));
        for (int64_t e = 0; e < B * H * n * m; e++)
            c->amask[e] =
                test_rng_uniform(&r) < 0.15 ? -INFINITY : (float)(test_rng_normal(&r) * 1.5);
        mk->additive_mask = (mha_mask_tensor){c->amask, MHA_DTYPE_F32, 4, {B, H, n, m}};
    }
    if (s->kpad) {
        c->kpm = malloc((size_t)(B * m));
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < m; j++)
                c->kpm[b * m + j] = j < m - 1 - b;
        mk->key_padding = (mha_mask_tensor){c->kpm, MHA_DTYPE_U8, 2, {B, m}};
    }
    if (s->seg) {
        c->qseg = malloc(sizeof(int32_t) * (size_t)(B * n));
        c->kvseg = malloc(sizeof(int32_t) * (size_t)(B * m));
        for (int64_t e = 0; e < B * n; e++)
            c->qseg[e] = (int32_t)((e % n) * 2 / n);
        for (int64_t e = 0; e < B * m; e++)
            c->kvseg[e] = (int32_t)((e % m) * 2 / m);
        mk->q_segment_ids = c->qseg;
        mk->kv_segment_ids = c->kvseg;
    }
    if (s->sinks) {
        c->sinks = malloc(sizeof(float) * (size_t)H);
        test_fill_normal(&r, c->sinks, H, 1.0f);
    }
    if (s->dropout > 0.0f) {
        c->drop.p = s->dropout;
        c->drop.seed = 0x5eed0000u + seed;
        c->drop.training = 1;
        /* Odd seeds: the call as a block of a larger attention (dropout row/col offsets). */
        c->drop.row_offset = (seed & 1u) ? 1000 + seed : 0;
        c->drop.col_offset = (seed & 1u) ? 37 * (int64_t)seed : 0;
    }
}

void build_dlse(built *c, uint64_t seed) {
    const int64_t count = c->s.B * c->s.H * c->s.n;
    test_rng r;
    test_rng_seed(&r, seed ^ 0xd15eull);
    c->dlse = malloc(sizeof(float) * (size_t)count);
    test_fill_normal(&r, c->dlse, count, 1.0f);
}

void build_dprobs(built *c, uint64_t seed, int average) {
    const int64_t count = c->s.B * (average ? 1 : c->s.H) * c->s.n * c->s.m;
    test_rng r;
    test_rng_seed(&r, seed ^ 0xd9b5ull);
    c->dprobs = malloc(sizeof(float) * (size_t)count);
    test_fill_normal(&r, c->dprobs, count, 1.0f);
    c->dprobs_average = average;
}

double *dprobs_per_head(const built *c) {
    if (!c->dprobs)
        return NULL;
    const int64_t B = c->s.B, H = c->s.H, nm = c->s.n * c->s.m;
    double *g = malloc(sizeof(double) * (size_t)(B * H * nm));
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t e = 0; e < nm; e++)
                g[(b * H + h) * nm + e] = c->dprobs_average
                                              ? (double)c->dprobs[b * nm + e] / (double)H
                                              : (double)c->dprobs[(b * H + h) * nm + e];
    return g;
}

void built_free(built *c) {
    free(c->q), free(c->k), free(c->v), free(c->sinks), free(c->dout), free(c->dlse);
    free(c->dprobs), free(c->bmask);
    free(c->imask), free(c->amask), free(c->kpm), free(c->qseg), free(c->kvseg);
}

/* Contiguous [B, heads, L, d] core args over c's tensors. */
void core_args(const built *c, float *out, float *lse, mha_attention_args *a) {
    const spec *s = &c->s;
    memset(a, 0, sizeof *a);
    a->batch = s->B, a->num_heads = s->H, a->num_kv_heads = s->G, a->q_len = s->n;
    a->kv_len = s->m, a->head_dim = s->dk, a->v_head_dim = s->dv;
    a->softcap = s->softcap, a->alibi = s->alibi, a->sinks = c->sinks;
    a->q = c->q, a->k = c->k, a->v = c->v, a->out = out, a->lse = lse;
    const int64_t qs[3] = {s->H * s->n * s->dk, s->n * s->dk, s->dk};
    const int64_t ks[3] = {s->G * s->m * s->dk, s->m * s->dk, s->dk};
    const int64_t vs[3] = {s->G * s->m * s->dv, s->m * s->dv, s->dv};
    const int64_t os[3] = {s->H * s->n * s->dv, s->n * s->dv, s->dv};
    memcpy(a->q_strides, qs, sizeof qs), memcpy(a->k_strides, ks, sizeof ks);
    memcpy(a->v_strides, vs, sizeof vs), memcpy(a->out_strides, os, sizeof os);
    a->mask = c->mask;
    a->dropout = c->drop;
}

double *to_d(const float *x, int64_t count) {
    double *d = malloc(sizeof(double) * (size_t)(count > 0 ? count : 1));
    for (int64_t i = 0; i < count; i++)
        d[i] = (double)x[i];
    return d;
}

void og_from(const built *c, og_core *o, double *q, double *k, double *v, double *sk) {
    const spec *s = &c->s;
    memset(o, 0, sizeof *o);
    o->B = s->B, o->H = s->H, o->G = s->G, o->n = s->n, o->m = s->m, o->dk = s->dk;
    o->dv = s->dv, o->softcap = s->softcap, o->alibi = s->alibi;
    o->sinks = c->sinks ? sk : NULL;
    o->q = q, o->k = k, o->v = v, o->mask = c->mask, o->dropout = c->drop;
}

double dsum(const double *a, const double *b, int64_t count) {
    double s = 0.0;
    for (int64_t i = 0; i < count; i++)
        s += a[i] * b[i];
    return s;
}

/* Max |S| of the case (for the backstop), from the oracle's raw scores. */
double max_score(const built *c) {
    const spec *s = &c->s;
    double mx = 0.0;
    const double scale = 1.0 / sqrt((double)s->dk);
    for (int64_t b = 0; b < s->B; b++)
        for (int64_t h = 0; h < s->H; h++)
            for (int64_t i = 0; i < s->n; i++)
                for (int64_t j = 0; j < s->m; j++) {
                    const float *q = c->q + ((b * s->H + h) * s->n + i) * s->dk;
                    const float *k = c->k + ((b * s->G + h / (s->H / s->G)) * s->m + j) * s->dk;
                    double d = 0.0;
                    for (int64_t e = 0; e < s->dk; e++)
                        d += (double)q[e] * (double)k[e];
                    mx = fmax(mx, fabs(scale * d));
                }
    return s->softcap > 0.0 ? fmin(mx, s->softcap) : mx;
}

/* name, B, H, G, n, m, dk, dv, causal, align, window, wl, wr, boolmask, addmask, kpad, seg,
 * alibi, sinks, dead, softcap, qscale, dropout */
// clang-format off
const spec CORE_SPECS[] = {
    {"plain", 1, 2, 2, 4, 5, 4, 4, 0, BR, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},
    {"dk_ne_dv", 2, 2, 2, 3, 6, 5, 3, 0, BR, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},
    {"causal_br_n_lt_m", 1, 2, 2, 4, 7, 4, 4, 1, BR, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},
    {"causal_tl_n_lt_m", 1, 2, 2, 4, 7, 4, 4, 1, TL, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},
    {"causal_tl_n_gt_m", 1, 2, 2, 7, 4, 4, 4, 1, TL, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},
    {"causal_br_n_gt_m_dead", 1, 1, 1, 7, 4, 4, 4, 1, BR, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},
    {"causal_explicit", 2, 2, 1, 4, 6, 4, 4, 1, EX, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},
    {"window", 1, 2, 2, 6, 6, 4, 4, 0, BR, 1, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},
    {"window_causal", 1, 2, 2, 6, 8, 4, 4, 1, BR, 1, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},
    {"boolmask", 2, 2, 2, 4, 5, 4, 4, 0, BR, 0, -1, -1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0},
    {"intmask_block", 1, 2, 2, 4, 5, 4, 4, 0, BR, 0, -1, -1, 2, 0, 0, 0, 0, 0, 0, 0, 1, 0},
    {"addmask", 2, 2, 2, 4, 5, 4, 4, 0, BR, 0, -1, -1, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0},
    {"keypad", 2, 2, 2, 3, 5, 4, 4, 0, BR, 0, -1, -1, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0},
    {"segments", 2, 2, 2, 4, 6, 4, 4, 0, BR, 0, -1, -1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0},
    {"softcap", 1, 2, 2, 4, 5, 4, 4, 0, BR, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 2.0, 2, 0},
    {"alibi_h3", 1, 3, 3, 4, 6, 4, 4, 1, BR, 0, -1, -1, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0},
    {"sinks", 2, 2, 2, 4, 5, 4, 4, 0, BR, 0, -1, -1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0},
    {"sinks_causal_dead", 1, 2, 1, 4, 5, 4, 4, 1, BR, 0, -1, -1, 0, 0, 0, 0, 0, 1, 1, 0, 1, 0},
    {"gqa", 2, 4, 2, 3, 5, 4, 4, 0, BR, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},
    {"mqa", 1, 4, 1, 3, 5, 4, 3, 1, BR, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},
    {"dropout", 2, 2, 1, 4, 6, 4, 4, 0, BR, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0.3f},
    {"dead_row", 1, 2, 2, 4, 5, 4, 4, 0, BR, 0, -1, -1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0},
    {"everything", 2, 4, 2, 5, 7, 4, 3, 1, BR, 1, 4, -1, 1, 1, 1, 0, 1, 1, 1, 3.0, 1.5, 0.2f},
};
// clang-format on
const int N_CORE_SPECS = (int)(sizeof CORE_SPECS / sizeof CORE_SPECS[0]);
