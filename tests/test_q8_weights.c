/* SPDX-License-Identifier: MIT */
/* test_q8_weights.c: the layer with q8_0 projection weights (docs/SEMANTICS.md "q8_0 weights").
 *
 * The q8_0 layer must compute exactly what the float32 layer computes on the dequantised weights
 * (the GEMM dequantises while packing, the few-rows path in registers, in the float32 dot's
 * chains). Checked:
 *   1. the GEMM, every gemm tier of the registry this CPU runs (explicit isa: whatever
 *      MHA_MAX_ISA says) and shapes on both paths (M <= MHA_GEMM_SMALL_M: dot_q8; above: packed),
 *      x float32 and bf16: bit-identical to the same tier's float32 GEMM on the dequantised W
 *      (a tier whose dot_q8 scales block sums, mha__gemm_dot_q8_block_sums, on the dot path: to
 *      a scalar model of the block-sum order), and within the float32 error bound
 *      gamma_{K+1} sum |x w| of the float64 product;
 *   2. the layer (GQA, RoPE, biases, sinks; an output gate with an RMS_HEAD QK-norm; q_dim != out
 *      features), forward (impl auto and reference; bf16 x and out too), the attention
 *      statistics, mha_layer_project, prefill and decode steps
 *      (batch 1 and 3: the dot path) on 1 and 2 threads: bit-identical to the float32 layer built
 *      on the dequantised weights (where the layer's GEMM tier scales block sums, the dot path's
 *      results instead: the projections within the float32 bound of the float64 product, the
 *      decode steps within TOL_OUT_REL of the oracle, the bf16 outputs within a bf16 rounding of
 *      the twin's), and the forward within TOL_OUT_REL of the float64 oracle on them (the decode
 *      steps within TOL_OUT_REL of the oracle's causal forward);
 *   3. mha_q8_0_quantize / _dequantize: the rounding rule, the error bound TOL_Q8_ELEM, bad
 *      arguments refused;
 *   4. bad configs and calls refused with a message: input features not a multiple of 32, a
 *      non-finite scale, Q8_0 as x_dtype / out_dtype, training calls (UNSUPPORTED); a COPY layer
 *      keeps the q8_0 bytes as given.
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

/* q8_0 bytes of n values (a multiple of 32) of x, and their dequantised float32 values. */
static unsigned char *quantise(const float *x, int64_t n, float *deq) {
    mha_error err = {0};
    unsigned char *q = xmalloc((size_t)(n / 32) * 34);
    CHECK_OK(mha_q8_0_quantize(x, n, q, &err), &err);
    CHECK_OK(mha_q8_0_dequantize(q, n, deq, &err), &err);
    return q;
}

static int same_bits(const float *a, const float *b, int64_t n) {
    return memcmp(a, b, sizeof(float) * (size_t)n) == 0;
}

/* max |a - b| <= rel * max |b| (float32 outputs that round differently: the block-sum order). */
static int close_to(const float *a, const float *b, int64_t n, double rel) {
    double e = 0.0, m = 0.0;
    for (int64_t i = 0; i < n; i++) {
        e = fmax(e, fabs((double)a[i] - (double)b[i]));
        m = fmax(m, fabs((double)b[i]));
    }
    return e <= rel * m;
}

/* Two bf16 outputs of float32 values that may differ by rel * max|b|: each pair within one bf16
 * rounding (2 TOL_HALF_U_BF16 of the larger) of each other, plus that float32 difference. */
static int bf16_close(const uint16_t *a, const uint16_t *b, int64_t n, double rel) {
    double m = 0.0;
    for (int64_t i = 0; i < n; i++)
        m = fmax(m, fabs((double)mha__bf16_to_f32(b[i])));
    for (int64_t i = 0; i < n; i++) {
        const double x = (double)mha__bf16_to_f32(a[i]), y = (double)mha__bf16_to_f32(b[i]);
        if (!(fabs(x - y) <= 2.0 * TOL_HALF_U_BF16 * fmax(fabs(x), fabs(y)) + rel * m))
            return 0;
    }
    return 1;
}

/* ---------------------------------------------------------------------------------------------- */
/* 1. The GEMM per tier.                                                                          */
/* ---------------------------------------------------------------------------------------------- */

/* The block-sum order of docs/SEMANTICS.md "q8_0 weights", in scalar float32: per lane l (k = l
 * mod 8) and block b, p_l = x q over the block's k in increasing k (a product, then FMAs), acc_l =
 * fma(p_l, d_b, acc_l) in increasing b, then ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)),
 * then + bias. The test is built with -ffp-contract=off: each * and + rounds. */
static float block_sum_dot(int64_t K, const float *x, const unsigned char *wrow, const float *b) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t k = 0; k < K; k += 32) {
        const unsigned char *blk = wrow + (k / 32) * 34;
        const float d = mha__q8_scale(blk, 0);
        const signed char *q = (const signed char *)blk + 2;
        for (int l = 0; l < 8; l++) {
            float p = x[k + l] * (float)q[l];
            for (int u = 8; u < 32; u += 8)
                p = fmaf(x[k + u + l], (float)q[u + l], p);
            acc[l] = fmaf(p, d, acc[l]);
        }
    }
    const float s =
        ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    return b ? s + *b : s;
}

/* Nonzero when the layer's AUTO GEMM tier (under MHA_MAX_ISA) scales q8_0 block sums on the dot
 * path (at most MHA_GEMM_SMALL_M rows): those results are not the float32 twin's bits. */
static int layer_block_sums(void) {
    const mha__kernel_info *k = mha__registry_best_dt(MHA__OP_gemm, MHA_DTS_F32);
    return k && mha__gemm_dot_q8_block_sums(k->run.gemm);
}

static void test_gemm(test_rng *rng) {
    const int64_t Ms[] = {1, 2, 3, 4, 5, 17}, Ns[] = {1, 5, 33, 64}, Ks[] = {32, 96, 288};
    int tiers = 0;
    for (int r = 0; r < mha__registry_count(); r++) {
        const mha__kernel_info *k = mha__registry_at(r);
        if (k->op != MHA__OP_gemm || k->run.gemm->pack_pairs || !mha__kernel_usable(k, 1))
            continue;
        tiers++;
        for (size_t a = 0; a < sizeof Ms / sizeof *Ms; a++)
            for (size_t b = 0; b < sizeof Ns / sizeof *Ns; b++)
                for (size_t c = 0; c < sizeof Ks / sizeof *Ks; c++)
                    for (int xbf = 0; xbf < 2; xbf++) {
                        const int64_t M = Ms[a], N = Ns[b], K = Ks[c];
                        float *x = xmalloc(sizeof(float) * (size_t)(M * K));
                        uint16_t *xh = xmalloc(sizeof(uint16_t) * (size_t)(M * K));
                        float *w = xmalloc(sizeof(float) * (size_t)(N * K));
                        float *wd = xmalloc(sizeof(float) * (size_t)(N * K));
                        float *bias = xmalloc(sizeof(float) * (size_t)N);
                        float *y = xmalloc(sizeof(float) * (size_t)(M * N));
                        float *y32 = xmalloc(sizeof(float) * (size_t)(M * N));
                        test_fill_normal(rng, x, M * K, 1.0f);
                        test_fill_normal(rng, w, N * K, 0.3f);
                        test_fill_normal(rng, bias, N, 1.0f);
                        if (xbf) { /* x rounded to bf16: the float32 twin reads the widened x */
                            mha__narrow(MHA_DTYPE_BF16, x, xh, M * K);
                            mha__widen(MHA_DTYPE_BF16, xh, x, M * K);
                        }
                        unsigned char *wq = quantise(w, N * K, wd);
                        const void *xin = xbf ? (const void *)xh : (const void *)x;
                        const mha_dtype xdt = xbf ? MHA_DTYPE_BF16 : MHA_DTYPE_F32;
                        mha_error err = {0};
                        const int model =
                            M <= MHA_GEMM_SMALL_M && mha__gemm_dot_q8_block_sums(k->run.gemm);
                        if (model) /* the twin: the scalar model of the block-sum order */
                            for (int64_t i = 0; i < M; i++)
                                for (int64_t o = 0; o < N; o++)
                                    y32[i * N + o] = block_sum_dot(
                                        K, x + i * K, wq + o * (K / 32) * 34, bias + o);
                        for (int t = 1; t <= 2; t++) {
                            CHECK_OK(mha__gemm_run_dt(MHA__GEMM_OP_N, M, N, K, xin, xdt, K, wq,
                                                      MHA_DTYPE_Q8_0, K, bias, y, N,
                                                      mha__team_of(t), k, NULL, 0, NULL, &err),
                                     &err);
                            if (!model)
                                CHECK_OK(mha__gemm_run_dt(MHA__GEMM_OP_N, M, N, K, x, MHA_DTYPE_F32,
                                                          K, wd, MHA_DTYPE_F32, K, bias, y32, N,
                                                          mha__team_of(t), k, NULL, 0, NULL, &err),
                                         &err);
                            CHECK(same_bits(y, y32, M * N),
                                  "gemm %s q8 %lldx%lldx%lld x%s %d threads: not the %s's bits",
                                  k->name, (long long)M, (long long)N, (long long)K,
                                  xbf ? "bf16" : "f32", t,
                                  model ? "block-sum model" : "float32 GEMM on the dequantised W");
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
                                bad += !(fabs((double)y[i * N + o] - ref) <= gamma * mag);
                            }
                        CHECK(bad == 0,
                              "gemm %s q8 %lldx%lldx%lld: %lld outputs beyond the float32 "
                              "bound",
                              k->name, (long long)M, (long long)N, (long long)K, (long long)bad);
                        free(x), free(xh), free(w), free(wd), free(bias), free(y), free(y32);
                        free(wq);
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
    int64_t qd, h, g, dk, out;
    int bias, sinks, gate, qknorm;
} lcase;

/* The weights of a case: float32 random, then q8_0 (+ the dequantised float32 copy). */
typedef struct lweights {
    float *f[11];         /* float32 originals (projections) / the float32 small tensors */
    float *deq[4];        /* dequantised projections */
    unsigned char *q8[4]; /* q8_0 projections */
    mha_weights wq, wf;   /* the q8_0 layer's and the float32 twin's */
} lweights;

static void make_config(const lcase *lc, mha_config *c) {
    memset(c, 0, sizeof *c);
    c->q_dim = lc->qd;
    c->num_heads = lc->h;
    c->num_kv_heads = lc->g;
    c->head_dim = lc->dk;
    c->out_dim = lc->out;
    c->bias_q = c->bias_k = c->bias_v = c->bias_o = lc->bias;
    c->sinks = lc->sinks;
    c->output_gate = lc->gate;
    c->rope.style = MHA_ROPE_HALF;
    c->rope.theta = 10000.0;
    if (lc->qknorm) {
        c->qk_norm.kind = MHA_QK_NORM_RMS_HEAD;
        c->qk_norm.eps = 1e-6;
    }
}

static void make_weights(test_rng *rng, const lcase *lc, lweights *W) {
    memset(W, 0, sizeof *W);
    const int64_t h = lc->h, g = lc->g, dk = lc->dk, qd = lc->qd, gq = lc->gate ? 2 : 1;
    const int64_t out = lc->out ? lc->out : qd;
    const int64_t cnt[11] = {
        gq * h * dk * qd, g * dk * qd, g * dk * qd, out * h * dk, gq * h * dk, g * dk,
        g * dk,           out,         h,           dk,           dk};
    const int present[11] = {1,        1,        1,         1,          lc->bias,  lc->bias,
                             lc->bias, lc->bias, lc->sinks, lc->qknorm, lc->qknorm};
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
            W->q8[i] = quantise(W->f[i], cnt[i], W->deq[i]);
        }
    }
    const void **pq[11] = {&W->wq.w_q,   &W->wq.w_k,    &W->wq.w_v,   &W->wq.w_o,
                           &W->wq.b_q,   &W->wq.b_k,    &W->wq.b_v,   &W->wq.b_o,
                           &W->wq.sinks, &W->wq.q_norm, &W->wq.k_norm};
    const void **pf[11] = {&W->wf.w_q,   &W->wf.w_k,    &W->wf.w_v,   &W->wf.w_o,
                           &W->wf.b_q,   &W->wf.b_k,    &W->wf.b_v,   &W->wf.b_o,
                           &W->wf.sinks, &W->wf.q_norm, &W->wf.k_norm};
    for (int i = 0; i < 11; i++) {
        *pq[i] = i < 4 ? (const void *)W->q8[i] : (const void *)W->f[i];
        *pf[i] = i < 4 ? (const void *)W->deq[i] : (const void *)W->f[i];
    }
}

static void free_weights(lweights *W) {
    for (int i = 0; i < 11; i++)
        free(W->f[i]);
    for (int i = 0; i < 4; i++) {
        free(W->deq[i]);
        free(W->q8[i]);
    }
}

/* Prefill `pre` tokens then decode steps of one token, B sequences, out [B, N, out] (rows of a
 * sequence in order). */
static void run_decode(const mha_layer *L,
                       const float *x,
                       int64_t B,
                       int64_t N,
                       int64_t qd,
                       int64_t od,
                       int64_t pre,
                       int threads,
                       float *y) {
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
    float *xs = xmalloc(sizeof(float) * (size_t)(B * N * qd));
    float *ys = xmalloc(sizeof(float) * (size_t)(B * N * od));
    for (int64_t p = 0; p < N;) {
        const int64_t t = p == 0 ? pre : 1;
        for (int64_t b = 0; b < B; b++)
            memcpy(xs + b * t * qd, x + (b * N + p) * qd, sizeof(float) * (size_t)(t * qd));
        mha_decode_args da = {B, NULL, t, xs, ys, NULL};
        CHECK_OK(p == 0 ? mha_layer_prefill(L, cache, &da, &ex, &err)
                        : mha_layer_decode_step(L, cache, &da, &ex, &err),
                 &err);
        for (int64_t b = 0; b < B; b++)
            memcpy(y + (b * N + p) * od, ys + b * t * od, sizeof(float) * (size_t)(t * od));
        p += t;
    }
    free(xs);
    free(ys);
    mha_kv_cache_destroy(cache);
}

static void test_layer(test_rng *rng, const lcase *lc) {
    mha_config c;
    make_config(lc, &c);
    lweights W;
    make_weights(rng, lc, &W);
    mha_error err = {0};
    mha_layer *Lq = NULL, *Lf = NULL, *Lb = NULL;
    c.weight_dtype = MHA_DTYPE_Q8_0;
    CHECK_OK(mha_layer_create(&c, &W.wq, MHA_WEIGHTS_COPY, NULL, &Lq, &err), &err);
    CHECK_OK(mha_layer_create(&c, &W.wq, MHA_WEIGHTS_BORROW, NULL, &Lb, &err), &err);
    c.weight_dtype = MHA_DTYPE_F32;
    CHECK_OK(mha_layer_create(&c, &W.wf, MHA_WEIGHTS_COPY, NULL, &Lf, &err), &err);
    if (!Lq || !Lf || !Lb) {
        mha_layer_destroy(Lq), mha_layer_destroy(Lf), mha_layer_destroy(Lb);
        free_weights(&W);
        return;
    }
    const int bsum = layer_block_sums();
    /* The COPY keeps the q8_0 bytes as given. */
    const mha_weights *kept = mha_layer_weights(Lq);
    const int64_t gq = lc->gate ? 2 : 1, od = lc->out ? lc->out : lc->qd;
    CHECK(memcmp(kept->w_q, W.q8[0], (size_t)(gq * lc->h * lc->dk * lc->qd / 32 * 34)) == 0 &&
              memcmp(kept->w_o, W.q8[3], (size_t)(od * lc->h * lc->dk / 32 * 34)) == 0 &&
              kept->w_q != W.wq.w_q,
          "%s: the COPY layer's q8_0 bytes", lc->name);
    CHECK(mha_layer_config(Lq)->weight_dtype == MHA_DTYPE_Q8_0, "%s: config keeps Q8_0", lc->name);

    /* Forward, self-attention, causal: bit-identical to the twin, within TOL_OUT_REL of float64. */
    const int64_t B = 2, n = 11, qd = lc->qd;
    float *x = xmalloc(sizeof(float) * (size_t)(B * n * qd));
    float *yq = xmalloc(sizeof(float) * (size_t)(B * n * od));
    float *yf = xmalloc(sizeof(float) * (size_t)(B * n * od));
    double *ref = xmalloc(sizeof(double) * (size_t)(B * n * od));
    test_fill_normal(rng, x, B * n * qd, 1.0f);
    mha_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.batch = B;
    fa.q_len = n;
    fa.query = x;
    fa.mask.causal = 1;
    c.weight_dtype = MHA_DTYPE_F32;
    CHECK(oracle_layer(&c, &W.wf, &fa, ref, NULL) == 0, "%s: oracle", lc->name);
    const double scale = test_max_abs(ref, B * n * od);
    for (int impl = 0; impl < 2; impl++)
        for (int t = 1; t <= 2; t++) {
            mha_exec ex = {0};
            ex.impl = impl ? MHA_IMPL_REFERENCE : MHA_IMPL_AUTO;
            ex.n_threads = t;
            const mha_layer *Ls[2] = {Lq, Lb};
            fa.out = yf;
            CHECK_OK(mha_layer_forward(Lf, &fa, &ex, &err), &err);
            for (int l = 0; l < 2; l++) {
                fa.out = yq;
                CHECK_OK(mha_layer_forward(Ls[l], &fa, &ex, &err), &err);
                CHECK(same_bits(yq, yf, B * n * od),
                      "%s: forward (%s, %s, %d threads) not the float32 twin's bits", lc->name,
                      l ? "borrow" : "copy", impl ? "reference" : "auto", t);
                const double e = test_max_abs_diff(yq, ref, B * n * od);
                CHECK(e <= TOL_OUT_REL * scale, "%s: forward %s vs float64: %g > %g", lc->name,
                      impl ? "reference" : "auto", e, TOL_OUT_REL * scale);
            }
        }

    /* bf16 x and a bf16 out (x_dtype, out_dtype): the intermediates stay float32 (Q8_0 is never
     * an activation dtype); the twin's bits. */
    {
        uint16_t *xh = xmalloc(sizeof(uint16_t) * (size_t)(B * n * qd));
        uint16_t *o1 = xmalloc(sizeof(uint16_t) * (size_t)(B * n * od));
        uint16_t *o2 = xmalloc(sizeof(uint16_t) * (size_t)(B * n * od));
        mha__narrow(MHA_DTYPE_BF16, x, xh, B * n * qd);
        mha_forward_args ha = fa;
        ha.query = xh;
        ha.x_dtype = ha.out_dtype = MHA_DTYPE_BF16;
        for (int rows = 0; rows < 2; rows++) { /* all rows (packed), then 1 x 2 rows (dot) */
            ha.batch = rows ? 1 : B;
            ha.q_len = rows ? 2 : n;
            ha.out = o1;
            CHECK_OK(mha_layer_forward(Lq, &ha, NULL, &err), &err);
            ha.out = o2;
            CHECK_OK(mha_layer_forward(Lf, &ha, NULL, &err), &err);
            const int64_t no = ha.batch * ha.q_len * od;
            if (rows && bsum) /* the dot path in the block-sum order */
                CHECK(bf16_close(o1, o2, no, TOL_OUT_REL),
                      "%s: bf16 x / out forward (2 rows) beyond a bf16 rounding of the twin",
                      lc->name);
            else
                CHECK(memcmp(o1, o2, sizeof(uint16_t) * (size_t)no) == 0,
                      "%s: bf16 x / out forward (%lld rows) not the twin's bits", lc->name,
                      (long long)(ha.batch * ha.q_len));
        }
        free(xh), free(o1), free(o2);
    }

    /* mha_layer_attention_statistics: the twin's entropies and received mass, bit for bit. */
    {
        float *e1 = xmalloc(sizeof(float) * (size_t)(B * lc->h * n)),
              *e2 = xmalloc(sizeof(float) * (size_t)(B * lc->h * n)),
              *r1 = xmalloc(sizeof(float) * (size_t)(B * lc->h * n)),
              *r2 = xmalloc(sizeof(float) * (size_t)(B * lc->h * n));
        mha_attention_stats s1 = {0}, s2 = {0};
        s1.entropy = e1, s1.received = r1, s2.entropy = e2, s2.received = r2;
        CHECK_OK(mha_layer_attention_statistics(Lq, &fa, &s1, NULL, &err), &err);
        CHECK_OK(mha_layer_attention_statistics(Lf, &fa, &s2, NULL, &err), &err);
        CHECK(same_bits(e1, e2, B * lc->h * n) && same_bits(r1, r2, B * lc->h * n),
              "%s: attention statistics not the twin's bits", lc->name);
        free(e1), free(e2), free(r1), free(r2);
    }

    /* mha_layer_project: each of the four maps, 3 rows (dot path) and 40 rows (packed). */
    for (int which = 0; which < 4; which++)
        for (int rows = 3; rows <= 40; rows += 37) {
            const int64_t in = which == 3 ? lc->h * lc->dk : qd;
            const int64_t outf = which == 0 ? lc->h * lc->dk : which == 3 ? od : lc->g * lc->dk;
            float *px = xmalloc(sizeof(float) * (size_t)(rows * in));
            float *p1 = xmalloc(sizeof(float) * (size_t)(rows * outf));
            float *p2 = xmalloc(sizeof(float) * (size_t)(rows * outf));
            test_fill_normal(rng, px, rows * in, 1.0f);
            CHECK_OK(mha_layer_project(Lq, (mha_projection)which, rows, px, p1, NULL, &err), &err);
            CHECK_OK(mha_layer_project(Lf, (mha_projection)which, rows, px, p2, NULL, &err), &err);
            if (rows <= MHA_GEMM_SMALL_M && bsum) /* the dot path in the block-sum order */
                CHECK(close_to(p1, p2, rows * outf, TOL_OUT_REL),
                      "%s: project %d, %d rows: beyond TOL_OUT_REL of the twin", lc->name, which,
                      rows);
            else
                CHECK(same_bits(p1, p2, rows * outf),
                      "%s: project %d, %d rows: not the twin's bits", lc->name, which, rows);
            free(px), free(p1), free(p2);
        }

    /* Prefill + decode steps: batch 1 and 3 (the dot path), 1 and 2 threads; the twin's bits,
     * and the float64 causal forward within TOL_OUT_REL. */
    const int64_t N = 9, pre = 4;
    for (int64_t Bd = 1; Bd <= 3; Bd += 2) {
        float *xd = xmalloc(sizeof(float) * (size_t)(Bd * N * qd));
        float *dq = xmalloc(sizeof(float) * (size_t)(Bd * N * od));
        float *df = xmalloc(sizeof(float) * (size_t)(Bd * N * od));
        double *dref = xmalloc(sizeof(double) * (size_t)(Bd * N * od));
        test_fill_normal(rng, xd, Bd * N * qd, 1.0f);
        mha_forward_args da;
        memset(&da, 0, sizeof da);
        da.batch = Bd;
        da.q_len = N;
        da.query = xd;
        da.mask.causal = 1;
        CHECK(oracle_layer(&c, &W.wf, &da, dref, NULL) == 0, "%s: decode oracle", lc->name);
        const double ds = test_max_abs(dref, Bd * N * od);
        for (int t = 1; t <= 2; t++) {
            memset(dq, 0, sizeof(float) * (size_t)(Bd * N * od));
            run_decode(Lq, xd, Bd, N, qd, od, pre, t, dq);
            run_decode(Lf, xd, Bd, N, qd, od, pre, t, df);
            if (!bsum) /* block sums: the steps' projections round differently (oracle below) */
                CHECK(same_bits(dq, df, Bd * N * od),
                      "%s: prefill + decode (batch %lld, %d threads) not the float32 twin's bits",
                      lc->name, (long long)Bd, t);
            const double e = test_max_abs_diff(dq, dref, Bd * N * od);
            CHECK(e <= TOL_OUT_REL * ds, "%s: decode (batch %lld) vs float64: %g > %g", lc->name,
                  (long long)Bd, e, TOL_OUT_REL * ds);
        }
        free(xd), free(dq), free(df), free(dref);
    }

    /* Training is refused. */
    mha_train_state *state = NULL;
    fa.out = yq;
    mha_status st = mha_layer_forward_train(Lq, &fa, NULL, &state, &err);
    CHECK(st == MHA_STATUS_UNSUPPORTED && strstr(err.message, "inference only") && !state,
          "%s: forward_train refused (%s: %s)", lc->name, mha_status_string(st), err.message);
    float *dxb = xmalloc(sizeof(float) * (size_t)(4 * qd)),
          *dyb = xmalloc(sizeof(float) * (size_t)(4 * lc->h * lc->dk));
    test_fill_normal(rng, dyb, 4 * lc->h * lc->dk, 1.0f);
    st = mha_layer_project_backward(Lq, MHA_PROJ_Q, 4, NULL, dyb, dxb, NULL, NULL, 0, NULL, &err);
    CHECK(st == MHA_STATUS_UNSUPPORTED && strstr(err.message, "q8_0"),
          "%s: project_backward refused (%s: %s)", lc->name, mha_status_string(st), err.message);
    free(dxb), free(dyb);

    free(x), free(yq), free(yf), free(ref);
    mha_layer_destroy(Lq), mha_layer_destroy(Lf), mha_layer_destroy(Lb);
    free_weights(&W);
}

/* ---------------------------------------------------------------------------------------------- */
/* 3. Quantise / dequantise.                                                                      */
/* ---------------------------------------------------------------------------------------------- */

static void test_quantise(test_rng *rng) {
    mha_error err = {0};
    const int64_t n = 32 * 40;
    float *x = xmalloc(sizeof(float) * (size_t)n), *d = xmalloc(sizeof(float) * (size_t)n);
    test_fill_normal(rng, x, n, 2.0f);
    x[5] = 0.5f * 127.0f; /* ties and exact values in block 0 */
    unsigned char *q = quantise(x, n, d);
    int64_t bad = 0;
    for (int64_t b = 0; b < n / 32; b++) {
        double a = 0.0;
        for (int i = 0; i < 32; i++)
            a = fmax(a, fabs((double)x[b * 32 + i]));
        for (int i = 0; i < 32; i++)
            bad += !(fabs((double)x[b * 32 + i] - (double)d[b * 32 + i]) <= TOL_Q8_ELEM(a));
    }
    CHECK(bad == 0, "q8_0 quantise: %lld values beyond TOL_Q8_ELEM", (long long)bad);
    /* Hand-made block: d = 1 (f16 0x3C00), q = -3 .. 28, -128 at the end. */
    unsigned char blk[34] = {0x00, 0x3C};
    for (int i = 0; i < 32; i++)
        blk[2 + i] = (unsigned char)(signed char)(i == 31 ? -128 : i - 3);
    float v[32];
    CHECK_OK(mha_q8_0_dequantize(blk, 32, v, &err), &err);
    CHECK(v[0] == -3.0f && v[30] == 27.0f && v[31] == -128.0f, "q8_0 dequantise values");
    CHECK(mha_q8_0_quantize(x, 33, q, &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "multiple of 32"),
          "quantise count 33 refused: %s", err.message);
    CHECK(mha_q8_0_quantize(x, -32, q, &err) == MHA_STATUS_INVALID_ARG, "negative count refused");
    CHECK(mha_q8_0_quantize(NULL, 32, q, &err) == MHA_STATUS_INVALID_ARG, "NULL src refused");
    CHECK(mha_q8_0_dequantize(q, 64, (float *)(q + 10), &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "overlaps"),
          "dequantise into its own blocks refused: %s", err.message);
    CHECK_OK(mha_q8_0_quantize(x, 0, NULL, &err), &err);
    free(x), free(d), free(q);
}

/* ---------------------------------------------------------------------------------------------- */
/* 4. Bad configs and calls.                                                                      */
/* ---------------------------------------------------------------------------------------------- */

static void test_refusals(test_rng *rng) {
    mha_error err = {0};
    const lcase ok = {"ok", 64, 2, 2, 32, 0, 1, 0, 0, 0};
    lweights W;
    make_weights(rng, &ok, &W);
    mha_config c;
    make_config(&ok, &c);
    c.weight_dtype = MHA_DTYPE_Q8_0;
    mha_layer *L = NULL;
    /* q_dim 48 (h 2, dk 32 set explicitly): not whole blocks. */
    mha_config b = c;
    b.q_dim = 48;
    mha_status st = mha_layer_create(&b, &W.wq, MHA_WEIGHTS_COPY, NULL, &L, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "q_dim=48") && !L,
          "q_dim 48 refused: %s", err.message);
    b = c;
    b.head_dim = 16; /* h * v_head_dim = 32: fine; q_dim 64 fine */
    b.num_heads = 3;
    b.num_kv_heads = 3;
    st = mha_layer_create(&b, &W.wq, MHA_WEIGHTS_BORROW, NULL, &L, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "num_heads * v_head_dim=48"),
          "h * dv 48 refused: %s", err.message);
    mha_layer_destroy(L);
    L = NULL;
    b = c;
    b.k_dim = 40;
    st = mha_layer_create(&b, &W.wq, MHA_WEIGHTS_BORROW, NULL, &L, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "k_dim=40"), "k_dim 40 refused: %s",
          err.message);
    /* A NaN scale (block 1 of w_k). */
    unsigned char save[2];
    memcpy(save, W.q8[1] + 34, 2);
    W.q8[1][34] = 0x00, W.q8[1][35] = 0x7E;
    st = mha_layer_create(&c, &W.wq, MHA_WEIGHTS_COPY, NULL, &L, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "w_k block 1") && !L,
          "NaN scale refused: %s", err.message);
    W.q8[1][34] = 0x00, W.q8[1][35] = 0x7C; /* +inf */
    st = mha_layer_create(&c, &W.wq, MHA_WEIGHTS_COPY, NULL, &L, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "w_k block 1"),
          "inf scale refused: %s", err.message);
    memcpy(W.q8[1] + 34, save, 2);
    /* A NaN bias (float32 beside q8_0). */
    const float keep = W.f[5][3];
    W.f[5][3] = NAN;
    st = mha_layer_create(&c, &W.wq, MHA_WEIGHTS_COPY, NULL, &L, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "b_k[3]"), "NaN bias refused: %s",
          err.message);
    W.f[5][3] = keep;
    CHECK_OK(mha_layer_create(&c, &W.wq, MHA_WEIGHTS_COPY, NULL, &L, &err), &err);
    /* Q8_0 as an activation dtype. */
    float x[2 * 64], y[2 * 64];
    test_fill_normal(rng, x, 2 * 64, 1.0f);
    mha_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.batch = 1;
    fa.q_len = 2;
    fa.query = x;
    fa.out = y;
    fa.x_dtype = MHA_DTYPE_Q8_0;
    st = mha_layer_forward(L, &fa, NULL, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "x_dtype"),
          "x_dtype Q8_0 refused: %s", err.message);
    fa.x_dtype = MHA_DTYPE_F32;
    fa.out_dtype = MHA_DTYPE_Q8_0;
    st = mha_layer_forward(L, &fa, NULL, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "out_dtype"),
          "out_dtype Q8_0 refused: %s", err.message);
    fa.out_dtype = MHA_DTYPE_F32;
    CHECK_OK(mha_layer_forward(L, &fa, NULL, &err), &err);
    mha_layer_destroy(L);
    /* weight_dtype past the known ones. */
    b = c;
    b.weight_dtype = (mha_dtype)9;
    L = NULL;
    st = mha_layer_create(&b, &W.wq, MHA_WEIGHTS_COPY, NULL, &L, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "weight_dtype=9"),
          "weight_dtype 9 refused: %s", err.message);
    free_weights(&W);
}

int main(void) {
    test_rng rng;
    test_rng_seed(&rng, 0x9808);
    test_gemm(&rng);
    const lcase cases[] = {
        /* name        qd   h  g  dk  out bias sinks gate qknorm */
        {"gqa", 128, 4, 2, 32, 0, 1, 1, 0, 0},
        {"gate-qknorm", 64, 2, 1, 32, 0, 1, 0, 1, 1},
        {"out-96", 96, 2, 2, 64, 96, 0, 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        test_layer(&rng, &cases[i]);
    test_quantise(&rng);
    test_refusals(&rng);
    return test_finish();
}
