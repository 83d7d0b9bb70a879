/* SPDX-License-Identifier: MIT */
/* test_q4_weights.c: the layer with q4_0 projection weights (docs/SEMANTICS.md "q4_0 weights").
 *
 * A q4_0 block holds exactly the values of the q8_0 block with the same scale and int8 q - 8, and
 * every tier must compute a q4_0 layer bit for bit as the q8_0 layer holding those blocks
 * (test_q8_weights.c ties the q8_0 layer to the float32 layer and the float64 oracle). Checked:
 *   1. the GEMM, every gemm tier this CPU runs (explicit isa), both paths (M <= MHA_GEMM_SMALL_M:
 *      dot_q4; above: packed), 1 and 2 threads: the q8_0 GEMM's bits on the converted blocks,
 *      and within the float32 bound gamma_{K+1} sum |x w| of the float64 product over the
 *      dequantised W (so a wrong nibble, offset or scale fails even where both would agree);
 *   2. the layer (GQA, RoPE, biases, sinks; an output gate with QK-norm), forward (impl auto and
 *      reference) and prefill + decode steps (batch 1 and 3: the dot path), 1 and 2 threads: the
 *      q8_0 twin's bits, and the forward within TOL_OUT_REL of the float64 oracle on the
 *      dequantised weights;
 *   3. mha_q4_0_quantize / _dequantize: the nibble layout, the rounding rule (ties to even, the
 *      block's largest-magnitude value at q = 0), the error bound TOL_Q4_ELEM, non-finite
 *      blocks, bad arguments refused;
 *   4. refusals: a non-finite scale, input features not a multiple of 32, Q4_0 as a KV cache
 *      dtype or an activation dtype, training calls (UNSUPPORTED).
 * ctest also runs this binary with MHA_MAX_ISA=avx2 and generic (the layer's AUTO tier).
 */
#include "base/internal.h"
#include "harness.h"
#include "kernels/gemm.h"
#include "kernels/registry.h"
#include "oracle_f64.h"
#include "tolerance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

/* q4_0 bytes of n values (a multiple of 32) of x, their dequantised values (deq) and the q8_0
 * blocks holding the same values (*q8: each block's scale bytes kept, q - 8 as int8). */
static unsigned char *quantise4(const float *x, int64_t n, float *deq, unsigned char **q8) {
    mha_error err = {0};
    unsigned char *q = xmalloc((size_t)(n / 32) * 18);
    CHECK_OK(mha_q4_0_quantize(x, n, q, &err), &err);
    CHECK_OK(mha_q4_0_dequantize(q, n, deq, &err), &err);
    *q8 = xmalloc((size_t)(n / 32) * 34);
    for (int64_t b = 0; b < n / 32; b++) {
        const unsigned char *s = q + b * 18;
        unsigned char *o = *q8 + b * 34;
        o[0] = s[0], o[1] = s[1];
        for (int i = 0; i < 16; i++) {
            o[2 + i] = (unsigned char)(signed char)((s[2 + i] & 15) - 8);
            o[18 + i] = (unsigned char)(signed char)((s[2 + i] >> 4) - 8);
        }
    }
    return q;
}

static int same_bits(const float *a, const float *b, int64_t n) {
    return memcmp(a, b, sizeof(float) * (size_t)n) == 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* 1. The GEMM per tier.                                                                          */
/* ---------------------------------------------------------------------------------------------- */

static void test_gemm(test_rng *rng) {
    const int64_t Ms[] = {1, 2, 3, 4, 5, 17}, Ns[] = {1, 5, 33}, Ks[] = {32, 96, 288};
    int tiers = 0;
    for (int r = 0; r < mha__registry_count(); r++) {
        const mha__kernel_info *k = mha__registry_at(r);
        if (k->op != MHA__OP_gemm || k->run.gemm->pack_pairs || !mha__kernel_usable(k, 1))
            continue;
        tiers++;
        for (size_t a = 0; a < sizeof Ms / sizeof *Ms; a++)
            for (size_t b = 0; b < sizeof Ns / sizeof *Ns; b++)
                for (size_t c = 0; c < sizeof Ks / sizeof *Ks; c++) {
                    const int64_t M = Ms[a], N = Ns[b], K = Ks[c];
                    float *x = xmalloc(sizeof(float) * (size_t)(M * K));
                    float *w = xmalloc(sizeof(float) * (size_t)(N * K));
                    float *wd = xmalloc(sizeof(float) * (size_t)(N * K));
                    float *bias = xmalloc(sizeof(float) * (size_t)N);
                    float *y4 = xmalloc(sizeof(float) * (size_t)(M * N));
                    float *y8 = xmalloc(sizeof(float) * (size_t)(M * N));
                    test_fill_normal(rng, x, M * K, 1.0f);
                    test_fill_normal(rng, w, N * K, 0.3f);
                    test_fill_normal(rng, bias, N, 1.0f);
                    unsigned char *w8 = NULL, *w4 = quantise4(w, N * K, wd, &w8);
                    mha_error err = {0};
                    for (int t = 1; t <= 2; t++) {
                        CHECK_OK(mha__gemm_run_dt(MHA__GEMM_OP_N, M, N, K, x, MHA_DTYPE_F32, K, w4,
                                                  MHA_DTYPE_Q4_0, K, bias, y4, N, mha__team_of(t),
                                                  k, NULL, 0, NULL, &err),
                                 &err);
                        CHECK_OK(mha__gemm_run_dt(MHA__GEMM_OP_N, M, N, K, x, MHA_DTYPE_F32, K, w8,
                                                  MHA_DTYPE_Q8_0, K, bias, y8, N, mha__team_of(t),
                                                  k, NULL, 0, NULL, &err),
                                 &err);
                        CHECK(same_bits(y4, y8, M * N),
                              "gemm %s q4 %lldx%lldx%lld %d threads: not the q8_0 GEMM's bits",
                              k->name, (long long)M, (long long)N, (long long)K, t);
                    }
                    /* The float64 product: |y - ref| <= gamma_{K+1} (|b| + sum |x w|). */
                    const double u = ldexp(1.0, -24), n1 = (double)(K + 1);
                    const double gamma = n1 * u / (1.0 - n1 * u);
                    int64_t bad = 0;
                    for (int64_t i = 0; i < M; i++)
                        for (int64_t o = 0; o < N; o++) {
                            double ref = (double)bias[o], mag = fabs((double)bias[o]);
                            for (int64_t kk = 0; kk < K; kk++) {
                                const double p = (double)x[i * K + kk] * (double)wd[o * K + kk];
                                ref += p;
                                mag += fabs(p);
                            }
                            bad += !(fabs((double)y4[i * N + o] - ref) <= gamma * mag);
                        }
                    CHECK(bad == 0, "gemm %s q4 %lldx%lldx%lld: %lld outputs beyond the bound",
                          k->name, (long long)M, (long long)N, (long long)K, (long long)bad);
                    free(x), free(w), free(wd), free(bias), free(y4), free(y8), free(w4), free(w8);
                }
    }
    CHECK(tiers >= 1, "no usable gemm tier");
    printf("gemm: %d tiers checked\n", tiers);
}

/* ---------------------------------------------------------------------------------------------- */
/* 2. The layer.                                                                                  */
/* ---------------------------------------------------------------------------------------------- */

typedef struct lcase {
    const char *name;
    int64_t qd, h, g, dk;
    int bias, sinks, gate;
} lcase;

typedef struct lweights {
    float *f[11];         /* float32 originals / the float32 small tensors */
    float *deq[4];        /* dequantised projections */
    unsigned char *q4[4]; /* q4_0 projections */
    unsigned char *q8[4]; /* the q8_0 blocks of the same values */
    mha_weights w4, w8, wf;
} lweights;

static void make_config(const lcase *lc, mha_config *c) {
    memset(c, 0, sizeof *c);
    c->q_dim = lc->qd;
    c->num_heads = lc->h;
    c->num_kv_heads = lc->g;
    c->head_dim = lc->dk;
    c->bias_q = c->bias_k = c->bias_v = c->bias_o = lc->bias;
    c->sinks = lc->sinks;
    c->output_gate = lc->gate;
    c->rope.style = MHA_ROPE_HALF;
    c->rope.theta = 10000.0;
    if (lc->gate) {
        c->qk_norm.kind = MHA_QK_NORM_RMS_HEAD;
        c->qk_norm.eps = 1e-6;
    }
}

static void make_weights(test_rng *rng, const lcase *lc, lweights *W) {
    memset(W, 0, sizeof *W);
    const int64_t h = lc->h, g = lc->g, dk = lc->dk, qd = lc->qd, gq = lc->gate ? 2 : 1;
    const int64_t cnt[11] = {
        gq * h * dk * qd, g * dk * qd, g * dk * qd, qd * h * dk, gq * h * dk, g * dk,
        g * dk,           qd,          h,           dk,          dk};
    const int present[11] = {1,        1,        1,         1,        lc->bias, lc->bias,
                             lc->bias, lc->bias, lc->sinks, lc->gate, lc->gate};
    for (int i = 0; i < 11; i++) {
        if (!present[i])
            continue;
        W->f[i] = xmalloc(sizeof(float) * (size_t)cnt[i]);
        test_fill_normal(rng, W->f[i], cnt[i], i < 4 ? 1.0f / sqrtf((float)qd) : 0.5f);
        if (i >= 9) /* norm weights around 1 */
            for (int64_t e = 0; e < cnt[i]; e++)
                W->f[i][e] += 1.0f;
        if (i < 4) {
            W->deq[i] = xmalloc(sizeof(float) * (size_t)cnt[i]);
            W->q4[i] = quantise4(W->f[i], cnt[i], W->deq[i], &W->q8[i]);
        }
    }
    mha_weights *ws[3] = {&W->w4, &W->w8, &W->wf};
    for (int k = 0; k < 3; k++) {
        const void *m[4] = {k == 0   ? W->q4[0]
                            : k == 1 ? (void *)W->q8[0]
                                     : (void *)W->deq[0],
                            k == 0   ? W->q4[1]
                            : k == 1 ? (void *)W->q8[1]
                                     : (void *)W->deq[1],
                            k == 0   ? W->q4[2]
                            : k == 1 ? (void *)W->q8[2]
                                     : (void *)W->deq[2],
                            k == 0   ? W->q4[3]
                            : k == 1 ? (void *)W->q8[3]
                                     : (void *)W->deq[3]};
        const mha_weights w = {m[0],    m[1],    m[2],    m[3],    W->f[4], W->f[5],
                               W->f[6], W->f[7], W->f[8], W->f[9], W->f[10]};
        *ws[k] = w;
    }
}

static void free_weights(lweights *W) {
    for (int i = 0; i < 11; i++)
        free(W->f[i]);
    for (int i = 0; i < 4; i++)
        free(W->deq[i]), free(W->q4[i]), free(W->q8[i]);
}

/* Prefill `pre` tokens then decode steps of one token for B sequences; y [B, N, qd]. */
static void run_decode(
    const mha_layer *L, const float *x, int64_t B, int64_t N, int64_t qd, int threads, float *y) {
    mha_error err = {0};
    mha_kv_cache_config kc;
    memset(&kc, 0, sizeof kc);
    kc.max_seq = N;
    kc.batch = B;
    mha_kv_cache *cache = NULL;
    CHECK_OK(mha_kv_cache_create(&kc, L, NULL, &cache, &err), &err);
    if (!cache)
        return;
    mha_exec ex = {0};
    ex.n_threads = threads;
    const int64_t pre = 5;
    float *xs = xmalloc(sizeof(float) * (size_t)(B * N * qd));
    float *ys = xmalloc(sizeof(float) * (size_t)(B * N * qd));
    for (int64_t p = 0; p < N;) {
        const int64_t t = p == 0 ? pre : 1;
        for (int64_t b = 0; b < B; b++)
            memcpy(xs + b * t * qd, x + (b * N + p) * qd, sizeof(float) * (size_t)(t * qd));
        mha_decode_args da = {B, NULL, t, xs, ys, NULL};
        CHECK_OK(p == 0 ? mha_layer_prefill(L, cache, &da, &ex, &err)
                        : mha_layer_decode_step(L, cache, &da, &ex, &err),
                 &err);
        for (int64_t b = 0; b < B; b++)
            memcpy(y + (b * N + p) * qd, ys + b * t * qd, sizeof(float) * (size_t)(t * qd));
        p += t;
    }
    free(xs), free(ys);
    mha_kv_cache_destroy(cache);
}

static void test_layer(test_rng *rng, const lcase *lc) {
    mha_config c;
    make_config(lc, &c);
    lweights W;
    make_weights(rng, lc, &W);
    mha_error err = {0};
    mha_layer *L4 = NULL, *L8 = NULL;
    c.weight_dtype = MHA_DTYPE_Q4_0;
    CHECK_OK(mha_layer_create(&c, &W.w4, MHA_WEIGHTS_COPY, NULL, &L4, &err), &err);
    c.weight_dtype = MHA_DTYPE_Q8_0;
    CHECK_OK(mha_layer_create(&c, &W.w8, MHA_WEIGHTS_COPY, NULL, &L8, &err), &err);
    if (!L4 || !L8) {
        mha_layer_destroy(L4), mha_layer_destroy(L8);
        free_weights(&W);
        return;
    }
    const int64_t gq = lc->gate ? 2 : 1, qd = lc->qd;
    CHECK(memcmp(mha_layer_weights(L4)->w_q, W.q4[0],
                 (size_t)(gq * lc->h * lc->dk * qd / 32 * 18)) == 0,
          "%s: the COPY layer keeps the q4_0 bytes", lc->name);
    CHECK(mha_layer_config(L4)->weight_dtype == MHA_DTYPE_Q4_0, "%s: config keeps Q4_0", lc->name);

    /* Forward, causal: the q8_0 twin's bits, within TOL_OUT_REL of the float64 oracle. */
    const int64_t B = 2, n = 11;
    float *x = xmalloc(sizeof(float) * (size_t)(B * n * qd));
    float *y4 = xmalloc(sizeof(float) * (size_t)(B * n * qd));
    float *y8 = xmalloc(sizeof(float) * (size_t)(B * n * qd));
    double *ref = xmalloc(sizeof(double) * (size_t)(B * n * qd));
    test_fill_normal(rng, x, B * n * qd, 1.0f);
    mha_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.batch = B;
    fa.q_len = n;
    fa.query = x;
    fa.mask.causal = 1;
    c.weight_dtype = MHA_DTYPE_F32;
    CHECK(oracle_layer(&c, &W.wf, &fa, ref, NULL) == 0, "%s: oracle", lc->name);
    const double scale = test_max_abs(ref, B * n * qd);
    for (int impl = 0; impl < 2; impl++)
        for (int t = 1; t <= 2; t++)
            for (int rows = 0; rows < 2; rows++) { /* all rows (packed), then 1 x 3 (dot) */
                mha_exec ex = {0};
                ex.impl = impl ? MHA_IMPL_REFERENCE : MHA_IMPL_AUTO;
                ex.n_threads = t;
                mha_forward_args a = fa;
                a.batch = rows ? 1 : B;
                a.q_len = rows ? 3 : n;
                a.out = y8;
                CHECK_OK(mha_layer_forward(L8, &a, &ex, &err), &err);
                a.out = y4;
                CHECK_OK(mha_layer_forward(L4, &a, &ex, &err), &err);
                const int64_t no = a.batch * a.q_len * qd;
                CHECK(same_bits(y4, y8, no),
                      "%s: forward (%s, %d threads, %lld rows) not the q8_0 twin's bits", lc->name,
                      impl ? "reference" : "auto", t, (long long)(a.batch * a.q_len));
                if (!rows) {
                    const double e = test_max_abs_diff(y4, ref, no);
                    CHECK(e <= TOL_OUT_REL * scale, "%s: forward vs float64: %g > %g", lc->name, e,
                          TOL_OUT_REL * scale);
                }
            }

    /* Prefill + decode steps, batch 1 and 3 (the dot path), 1 and 2 threads: the twin's bits. */
    for (int64_t Bd = 1; Bd <= 3; Bd += 2)
        for (int t = 1; t <= 2; t++) {
            const int64_t N = 9;
            float *xd = xmalloc(sizeof(float) * (size_t)(Bd * N * qd));
            float *d4 = xmalloc(sizeof(float) * (size_t)(Bd * N * qd));
            float *d8 = xmalloc(sizeof(float) * (size_t)(Bd * N * qd));
            test_fill_normal(rng, xd, Bd * N * qd, 1.0f);
            run_decode(L4, xd, Bd, N, qd, t, d4);
            run_decode(L8, xd, Bd, N, qd, t, d8);
            CHECK(same_bits(d4, d8, Bd * N * qd),
                  "%s: decode (batch %lld, %d threads) not the q8_0 twin's bits", lc->name,
                  (long long)Bd, t);
            free(xd), free(d4), free(d8);
        }
    free(x), free(y4), free(y8), free(ref);
    mha_layer_destroy(L4), mha_layer_destroy(L8);
    free_weights(&W);
}

/* ---------------------------------------------------------------------------------------------- */
/* 3. Quantise / dequantise.                                                                      */
/* ---------------------------------------------------------------------------------------------- */

static void test_quantise(test_rng *rng) {
    mha_error err = {0};
    const int64_t n = 32 * 64;
    float *x = xmalloc(sizeof(float) * (size_t)n), *d = xmalloc(sizeof(float) * (size_t)n);
    test_fill_normal(rng, x, n, 2.0f);
    for (int i = 0; i < 32; i++) /* block 0: exact ties (m = -8: d = 1, x / d = k + 0.5) */
        x[i] = i == 0 ? -8.0f : (float)(i % 15) - 7.0f + 0.5f * (float)(i % 2);
    for (int i = 32; i < 64; i++) /* block 1: all zero */
        x[i] = 0.0f;
    unsigned char *q8 = NULL, *q = quantise4(x, n, d, &q8);
    /* the rule, against a scalar model in double */
    int64_t bad = 0, badb = 0;
    for (int64_t b = 0; b < n / 32; b++) {
        double m = 0.0, a = 0.0;
        for (int i = 0; i < 32; i++)
            if (fabs((double)x[b * 32 + i]) > a)
                a = fabs((double)x[b * 32 + i]), m = (double)x[b * 32 + i];
        const float df = mha__f16_to_f32(mha__f32_to_f16((float)m / -8.0f));
        for (int i = 0; i < 32; i++) {
            const double v = (double)x[b * 32 + i];
            double qq = df == 0.0f ? 8.0 : nearbyint((double)(x[b * 32 + i] / df)) + 8.0;
            qq = qq < 0.0 ? 0.0 : qq > 15.0 ? 15.0 : qq;
            const int nib = i < 16 ? q[b * 18 + 2 + i] & 15 : q[b * 18 + 2 + i - 16] >> 4;
            bad += nib != (int)qq || d[b * 32 + i] != (float)((qq - 8.0) * (double)df);
            badb += !(fabs(v - (double)d[b * 32 + i]) <= TOL_Q4_ELEM(a));
        }
    }
    CHECK(bad == 0, "q4_0 quantise: %lld values off the rule", (long long)bad);
    CHECK(badb == 0, "q4_0 quantise: %lld values beyond TOL_Q4_ELEM", (long long)badb);
    CHECK(d[0] == -8.0f && d[1] == -6.0f && d[3] == -4.0f && d[5] == -2.0f,
          "block 0 ties to even: %g %g %g %g", (double)d[0], (double)d[1], (double)d[3],
          (double)d[5]);
    CHECK(d[40] == 0.0f && (q[18 + 2] == 0x88), "zero block: q = 8, value 0");
    /* Hand-made block: d = 0.5, byte i = (i & 15) | (15 - (i & 15)) << 4. */
    unsigned char blk[18] = {0x00, 0x38};
    for (int i = 0; i < 16; i++)
        blk[2 + i] = (unsigned char)(i | (15 - i) << 4);
    float v[32];
    CHECK_OK(mha_q4_0_dequantize(blk, 32, v, &err), &err);
    CHECK(v[0] == -4.0f && v[15] == 3.5f && v[16] == 3.5f && v[31] == -4.0f,
          "q4_0 dequantise nibble order: %g %g %g %g", (double)v[0], (double)v[15], (double)v[16],
          (double)v[31]);
    /* A non-finite block: NaN scale, q = 8. */
    float nb[32] = {0};
    nb[7] = INFINITY;
    unsigned char qb[18];
    CHECK_OK(mha_q4_0_quantize(nb, 32, qb, &err), &err);
    CHECK(isnan(mha__q8_scale(qb, 0)) && qb[2] == 0x88, "non-finite block: NaN scale, q 8");
    CHECK(mha_q4_0_quantize(x, 33, q, &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "q4_0"),
          "quantise count 33 refused: %s", err.message);
    CHECK(mha_q4_0_quantize(NULL, 32, q, &err) == MHA_STATUS_INVALID_ARG, "NULL src refused");
    CHECK(mha_q4_0_dequantize(q, 64, (float *)(q + 10), &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "18 bytes"),
          "dequantise into its own blocks refused: %s", err.message);
    CHECK(mha_dtype_size(MHA_DTYPE_Q4_0) == 0, "a block type has no element size");
    free(x), free(d), free(q), free(q8);
}

/* ---------------------------------------------------------------------------------------------- */
/* 4. Refusals.                                                                                   */
/* ---------------------------------------------------------------------------------------------- */

static void test_refusals(test_rng *rng) {
    mha_error err = {0};
    const lcase ok = {"ok", 64, 2, 2, 32, 0, 0, 0};
    lweights W;
    make_weights(rng, &ok, &W);
    mha_config c;
    make_config(&ok, &c);
    c.weight_dtype = MHA_DTYPE_Q4_0;
    mha_layer *L = NULL;
    mha_config b = c;
    b.k_dim = 40;
    mha_status st = mha_layer_create(&b, &W.w4, MHA_WEIGHTS_BORROW, NULL, &L, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "k_dim=40") &&
              strstr(err.message, "Q4_0"),
          "k_dim 40 refused: %s", err.message);
    unsigned char save[2];
    memcpy(save, W.q4[1] + 18, 2);
    W.q4[1][18] = 0x00, W.q4[1][19] = 0x7E; /* block 1 of w_k: NaN */
    st = mha_layer_create(&c, &W.w4, MHA_WEIGHTS_COPY, NULL, &L, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "w_k block 1") &&
              strstr(err.message, "q4_0") && !L,
          "NaN scale refused: %s", err.message);
    memcpy(W.q4[1] + 18, save, 2);
    CHECK_OK(mha_layer_create(&c, &W.w4, MHA_WEIGHTS_COPY, NULL, &L, &err), &err);
    float x[2 * 64], y[2 * 64];
    test_fill_normal(rng, x, 2 * 64, 1.0f);
    mha_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.batch = 1;
    fa.q_len = 2;
    fa.query = x;
    fa.out = y;
    fa.x_dtype = MHA_DTYPE_Q4_0;
    st = mha_layer_forward(L, &fa, NULL, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "x_dtype"),
          "x_dtype Q4_0 refused: %s", err.message);
    fa.x_dtype = MHA_DTYPE_F32;
    CHECK_OK(mha_layer_forward(L, &fa, NULL, &err), &err);
    mha_train_state *ts = NULL;
    st = mha_layer_forward_train(L, &fa, NULL, &ts, &err);
    CHECK(st == MHA_STATUS_UNSUPPORTED && strstr(err.message, "q4_0"), "training refused: %s",
          err.message);
    mha_layer_destroy(L);
    /* Q4_0 is a weight type only: a KV cache refuses it. */
    mha_kv_cache_config kc;
    memset(&kc, 0, sizeof kc);
    kc.num_kv_heads = 2, kc.head_dim = 32, kc.max_seq = 8, kc.batch = 1;
    kc.dtype = MHA_DTYPE_Q4_0;
    mha_kv_cache *cache = NULL;
    st = mha_kv_cache_create(&kc, NULL, NULL, &cache, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && !cache, "KV cache dtype Q4_0 refused: %s", err.message);
    free_weights(&W);
}

int main(void) {
    test_rng rng;
    test_rng_seed(&rng, 0x9404);
    test_gemm(&rng);
    const lcase cases[] = {
        /* name        qd  h  g  dk bias sinks gate */
        {"gqa", 128, 4, 2, 32, 1, 1, 0},
        {"gate-qknorm", 64, 2, 1, 32, 1, 0, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        test_layer(&rng, &cases[i]);
    test_quantise(&rng);
    test_refusals(&rng);
    return test_finish();
}
