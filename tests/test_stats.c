/* SPDX-License-Identifier: MIT */
/* test_stats.c: mha_attention_statistics against the same statistics computed in float64 from
 * the dense probabilities of the float64 oracle (tests/common/oracle_f64.c), on small problems
 * over every mask kind (bool both polarities, additive with -inf, key padding, segments),
 * windows, sinks, GQA, the three causal alignments, softcap, ALiBi and scale, with tiles crossed
 * (n > 64 rows, m > 256 keys); top-k ties and short rows as documented in mha.h; bit-identical
 * results for 1, 2 and 3 threads; the argument checks. */
#include "harness.h"
#include "oracle_f64.h"
#include "tolerance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct scase {
    mha_attention_args a;
    float *q, *k, *sinks, *addmask;
    uint8_t *boolmask, *kpm;
    int32_t *qseg, *kseg;
    int64_t *offsets;
} scase;

static void scase_free(scase *c) {
    free(c->q), free(c->k), free(c->sinks), free(c->addmask), free(c->boolmask), free(c->kpm);
    free(c->qseg), free(c->kseg), free(c->offsets);
    memset(c, 0, sizeof *c);
}

/* A random problem, [B, heads, L, d] layout; `f` is a bit set of the features turned on. */
static void scase_make(
    scase *c, test_rng *r, unsigned f, int64_t B, int64_t H, int64_t G, int64_t n, int64_t m) {
    const int64_t dk = 16;
    memset(c, 0, sizeof *c);
    mha_attention_args *a = &c->a;
    a->batch = B, a->num_heads = H, a->num_kv_heads = G, a->q_len = n, a->kv_len = m;
    a->head_dim = dk;
    c->q = malloc(sizeof(float) * (size_t)(B * H * n * dk));
    c->k = malloc(sizeof(float) * (size_t)(B * G * m * dk));
    test_fill_normal(r, c->q, B * H * n * dk, (f & 1u) ? 3.0f : 1.0f);
    test_fill_normal(r, c->k, B * G * m * dk, 1.0f);
    a->q = c->q, a->k = c->k; /* v and out stay NULL: the statistics do not read them */
    const int64_t qs[3] = {H * n * dk, n * dk, dk}, ks[3] = {G * m * dk, m * dk, dk};
    memcpy(a->q_strides, qs, sizeof qs), memcpy(a->k_strides, ks, sizeof ks);
    mha_masking *mk = &a->mask;
    mk->causal = (f & 2u) != 0;
    if (f & 4u)
        mk->alignment = MHA_ALIGN_TOP_LEFT;
    if (f & 8u) {
        mk->alignment = MHA_ALIGN_EXPLICIT;
        c->offsets = malloc(sizeof(int64_t) * (size_t)B);
        for (int64_t b = 0; b < B; b++)
            c->offsets[b] = (int64_t)(test_rng_u64(r) % (uint64_t)(m + 2)) - 1;
        mk->align_offsets = c->offsets;
    }
    if (f & 16u) {
        mk->use_window = 1;
        mk->window_left = (int64_t)(test_rng_u64(r) % 40) - 1;
        mk->window_right = (int64_t)(test_rng_u64(r) % 5) - 1;
    }
    if (f & 32u) { /* [B, 1, n, m], random polarity */
        c->boolmask = malloc((size_t)(B * n * m));
        for (int64_t e = 0; e < B * n * m; e++)
            c->boolmask[e] = test_rng_uniform(r) < 0.7;
        mk->bool_mask = (mha_mask_tensor){c->boolmask, MHA_DTYPE_BOOL, 4, {B, 1, n, m}};
        mk->bool_mask_polarity = (test_rng_u64(r) & 1) ? MHA_MASK_BLOCK : MHA_MASK_ATTEND;
    }
    if (f & 64u) { /* [n, m] with some -inf */
        c->addmask = malloc(sizeof(float) * (size_t)(n * m));
        for (int64_t e = 0; e < n * m; e++)
            c->addmask[e] = test_rng_uniform(r) < 0.1 ? -INFINITY : (float)test_rng_normal(r);
        mk->additive_mask = (mha_mask_tensor){c->addmask, MHA_DTYPE_F32, 2, {n, m}};
    }
    if (f & 128u) {
        c->kpm = malloc((size_t)(B * m));
        for (int64_t e = 0; e < B * m; e++)
            c->kpm[e] = test_rng_uniform(r) < 0.8;
        mk->key_padding = (mha_mask_tensor){c->kpm, MHA_DTYPE_U8, 2, {B, m}};
    }
    if (f & 256u) { /* two documents per row */
        c->qseg = malloc(sizeof(int32_t) * (size_t)(B * n));
        c->kseg = malloc(sizeof(int32_t) * (size_t)(B * m));
        for (int64_t e = 0; e < B * n; e++)
            c->qseg[e] = (e % n) * 2 >= n;
        for (int64_t e = 0; e < B * m; e++)
            c->kseg[e] = (e % m) * 3 >= m;
        mk->q_segment_ids = c->qseg, mk->kv_segment_ids = c->kseg;
    }
    if (f & 512u)
        a->softcap = 5.0 + 20.0 * test_rng_uniform(r);
    if (f & 1024u)
        a->alibi = 1;
    if (f & 2048u) {
        c->sinks = malloc(sizeof(float) * (size_t)H);
        test_fill_normal(r, c->sinks, H, 1.0f);
        a->sinks = c->sinks;
    }
    if (f & 4096u)
        a->scale = 0.05 + test_rng_uniform(r);
}

/* Every statistic of a case, as the library returns them. */
typedef struct souts {
    float *received, *received_total, *entropy, *topk_prob, *pooled, *visible;
    int64_t *topk_index;
    mha_attention_stats s;
} souts;

static void souts_make(souts *o, const mha_attention_args *a, int64_t k, int64_t R, int64_t C) {
    const int64_t B = a->batch, H = a->num_heads, n = a->q_len, m = a->kv_len;
    o->received = malloc(sizeof(float) * (size_t)(B * H * m));
    o->received_total = malloc(sizeof(float) * (size_t)(B * m));
    o->entropy = malloc(sizeof(float) * (size_t)(B * H * n));
    o->topk_prob = malloc(sizeof(float) * (size_t)(B * H * n * k));
    o->topk_index = malloc(sizeof(int64_t) * (size_t)(B * H * n * k));
    o->pooled = malloc(sizeof(float) * (size_t)(B * H * R * C));
    o->visible = malloc(sizeof(float) * (size_t)(B * H * R * C));
    o->s = (mha_attention_stats){o->received,   o->received_total, o->entropy, k,
                                 o->topk_index, o->topk_prob,      R,          C,
                                 o->pooled,     o->visible};
}

static void souts_free(souts *o) {
    free(o->received), free(o->received_total), free(o->entropy), free(o->topk_prob);
    free(o->topk_index), free(o->pooled), free(o->visible);
}

static int souts_equal(const souts *x, const souts *y, const mha_attention_args *a) {
    const size_t B = (size_t)a->batch, H = (size_t)a->num_heads, n = (size_t)a->q_len;
    const size_t m = (size_t)a->kv_len, k = (size_t)x->s.top_k;
    const size_t g = (size_t)(x->s.pool_rows * x->s.pool_cols);
    return !memcmp(x->received, y->received, 4 * B * H * m) &&
           !memcmp(x->received_total, y->received_total, 4 * B * m) &&
           !memcmp(x->entropy, y->entropy, 4 * B * H * n) &&
           !memcmp(x->topk_prob, y->topk_prob, 4 * B * H * n * k) &&
           !memcmp(x->topk_index, y->topk_index, 8 * B * H * n * k) &&
           !memcmp(x->pooled, y->pooled, 4 * B * H * g) &&
           !memcmp(x->visible, y->visible, 4 * B * H * g);
}

static double g_worst[5]; /* received, entropy, top-k P, pooled: error / gate; visible: error */

static void note(int which, double err, double gate) {
    const double ratio = gate > 0.0 ? err / gate : err;
    if (isnan(ratio) || ratio > g_worst[which])
        g_worst[which] = isnan(ratio) ? HUGE_VAL : ratio;
}

/* One (b, h) pair of the case against the oracle's probabilities pr [n, m] and lse [n]. */
static void check_pair(const souts *o,
                       const mha_attention_args *a,
                       int64_t b,
                       int64_t h,
                       const double *pr,
                       const double *lse,
                       const char *label) {
    const int64_t H = a->num_heads, n = a->q_len, m = a->kv_len, k = o->s.top_k;
    const int64_t R = o->s.pool_rows, C = o->s.pool_cols, bh = b * H + h;
    /* Received: n probabilities, each within TOL_PROBS_ABS. */
    for (int64_t j = 0; j < m; j++) {
        double ref = 0.0;
        for (int64_t i = 0; i < n; i++)
            ref += pr[i * m + j];
        note(0, fabs((double)o->received[bh * m + j] - ref), TOL_PROBS_ABS * (double)n);
    }
    for (int64_t i = 0; i < n; i++) {
        const double *row = pr + i * m;
        /* Entropy, with the sink as one more outcome. A probability's relative error is about
         * u (1 + |s|) (the backstop of tolerance.h), which moves H by at most that times
         * sum_j p_j |ln p_j + 1| <= (1 + H) ... plus the sink's share. */
        double ent = 0.0, smax = 0.0;
        for (int64_t j = 0; j < m; j++)
            if (row[j] > 0.0) {
                ent -= row[j] * log(row[j]);
                smax = fmax(smax, fabs(log(row[j]) + lse[i]));
            }
        if (a->sinks && isfinite(lse[i])) {
            const double ps = exp((double)a->sinks[h] - lse[i]);
            ent -= ps * log(ps);
        }
        const double gate = TOL_OUT_BACKSTOP_C * TOL_U32 * (1.0 + smax) * (1.0 + fabs(ent));
        note(1, fabs((double)o->entropy[bh * n + i] - ent), gate);
        /* Top-k: the oracle's order (P descending, lower index first); an index may differ from
         * the oracle's only where the two oracle probabilities are closer than the gate. */
        int64_t visible = 0;
        for (int64_t j = 0; j < m; j++)
            visible += row[j] > 0.0;
        char *used = calloc((size_t)m, 1);
        for (int64_t t = 0; t < k; t++) {
            int64_t best = -1;
            for (int64_t j = 0; j < m; j++)
                if (!used[j] && row[j] > 0.0 && (best < 0 || row[j] > row[best]))
                    best = j;
            const int64_t got = o->topk_index[(bh * n + i) * k + t];
            const float gotp = o->topk_prob[(bh * n + i) * k + t];
            if (best < 0) {
                CHECK(got == -1 && gotp == 0.0f,
                      "%s: top-k (%lld,%lld,%lld) slot %lld: %lld %g, "
                      "expected -1 0 (%lld visible keys)",
                      label, (long long)b, (long long)h, (long long)i, (long long)t, (long long)got,
                      (double)gotp, (long long)visible);
                continue;
            }
            used[best] = 1;
            note(2, fabs((double)gotp - row[best]), TOL_PROBS_ABS);
            const int ok = got == best || (got >= 0 && got < m && row[got] > 0.0 &&
                                           fabs(row[got] - row[best]) <= 2 * TOL_PROBS_ABS);
            CHECK(ok, "%s: top-k (%lld,%lld,%lld) slot %lld: key %lld, oracle %lld", label,
                  (long long)b, (long long)h, (long long)i, (long long)t, (long long)got,
                  (long long)best);
        }
        free(used);
    }
    /* Pooled mean and visible fraction (visible = oracle probability > 0: no score here is low
     * enough to underflow a double). */
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = 0; c < C; c++) {
            double sum = 0.0;
            int64_t cells = 0, vis = 0;
            for (int64_t i = 0; i < n; i++)
                for (int64_t j = 0; j < m; j++)
                    if (i * R / n == r && j * C / m == c) {
                        sum += pr[i * m + j];
                        cells++;
                        vis += pr[i * m + j] > 0.0;
                    }
            const int64_t at = bh * R * C + r * C + c;
            note(3, fabs((double)o->pooled[at] - sum / (double)cells), TOL_PROBS_ABS);
            const float want = (float)((double)vis / (double)cells);
            CHECK(o->visible[at] == want, "%s: visible fraction (%lld,%lld,%lld,%lld) %g != %g",
                  label, (long long)b, (long long)h, (long long)r, (long long)c,
                  (double)o->visible[at], (double)want);
        }
}

static void check_case(scase *c, int64_t k, int64_t R, int64_t C, const char *label) {
    const mha_attention_args *a = &c->a;
    const int64_t B = a->batch, H = a->num_heads, n = a->q_len, m = a->kv_len;
    souts o[3];
    mha_error err;
    for (int t = 0; t < 3; t++) {
        souts_make(&o[t], a, k, R, C);
        mha_exec ex = {MHA_IMPL_AUTO, t + 1, NULL, 0, NULL, NULL};
        CHECK_OK(mha_attention_statistics(a, &o[t].s, &ex, &err), &err);
    }
    CHECK(souts_equal(&o[0], &o[1], a) && souts_equal(&o[0], &o[2], a),
          "%s: 1, 2 and 3 threads give different bits", label);

    /* The oracle needs v and out: a zero value of size 1. */
    mha_attention_args oa = *a;
    float *v = calloc((size_t)(B * a->num_kv_heads * m), sizeof(float));
    oa.v_head_dim = 1, oa.v = v;
    const int64_t vs[3] = {a->num_kv_heads * m, m, 1};
    memcpy(oa.v_strides, vs, sizeof vs);
    double *out = malloc(sizeof(double) * (size_t)(B * H * n));
    double *lse = malloc(sizeof(double) * (size_t)(B * H * n));
    double *pr = malloc(sizeof(double) * (size_t)(B * H * n * m));
    CHECK(oracle_attention(&oa, out, lse, pr) == 0, "%s: oracle", label);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            check_pair(&o[0], a, b, h, pr + (b * H + h) * n * m, lse + (b * H + h) * n, label);
    /* received_total: the heads' received summed. */
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j < m; j++) {
            double ref = 0.0;
            for (int64_t h = 0; h < H; h++)
                for (int64_t i = 0; i < n; i++)
                    ref += pr[((b * H + h) * n + i) * m + j];
            note(0, fabs((double)o[0].received_total[b * m + j] - ref),
                 TOL_PROBS_ABS * (double)(n * H));
        }
    free(v), free(out), free(lse), free(pr);
    for (int t = 0; t < 3; t++)
        souts_free(&o[t]);
}

static void test_random_cases(void) {
    test_rng r;
    test_rng_seed(&r, 17);
    const unsigned features[] = {
        0,   1,    2,        2 | 4, 2 | 8,          16,   16 | 2 | 4, 32,      64, 128, 256,
        512, 1024, 1024 | 2, 2048,  2048 | 2 | 128, 4096, 8191,       8191 ^ 8};
    const struct {
        int64_t B, H, G, n, m, k, R, C;
    } shapes[] = {
        {2, 4, 2, 9, 13, 3, 3, 4}, {1, 2, 1, 70, 300, 8, 7, 30}, {1, 3, 3, 13, 9, 9, 13, 9}};
    char label[96];
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (size_t fi = 0; fi < sizeof features / sizeof features[0]; fi++) {
            scase c;
            scase_make(&c, &r, features[fi], shapes[s].B, shapes[s].H, shapes[s].G, shapes[s].n,
                       shapes[s].m);
            snprintf(label, sizeof label, "shape %zu features %u", s, features[fi]);
            check_case(&c, shapes[s].k, shapes[s].R, shapes[s].C, label);
            scase_free(&c);
        }
    for (int w = 0; w < 4; w++)
        CHECK(g_worst[w] <= 1.0, "worst error / gate of statistic %d: %.3g", w, g_worst[w]);
    printf("worst error / gate: received %.3g, entropy %.3g, top-k P %.3g, pooled %.3g\n",
           g_worst[0], g_worst[1], g_worst[2], g_worst[3]);
}

/* Equal probabilities: the lower key index first; fewer visible keys than k: -1 and 0. */
static void test_topk_ties(void) {
    const int64_t n = 2, m = 6, d = 4, k = 5;
    /* Keys 1, 3, 4 are the same vector (equal scores, equal P); key 5 is hidden by padding. */
    float q[2 * 4] = {1, 0, 0, 0, 0, 1, 0, 0};
    float kk[6 * 4] = {0, 0, 0, 0, 2, 0, 0, 0, 1, 1, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 9, 9, 9, 9};
    uint8_t pad[6] = {1, 1, 0, 1, 1, 0};
    mha_attention_args a = {0};
    a.batch = 1, a.num_heads = 1, a.q_len = n, a.kv_len = m, a.head_dim = d;
    a.q = q, a.k = kk;
    const int64_t qs[3] = {n * d, n * d, d}, ks[3] = {m * d, m * d, d};
    memcpy(a.q_strides, qs, sizeof qs), memcpy(a.k_strides, ks, sizeof ks);
    a.mask.key_padding = (mha_mask_tensor){pad, MHA_DTYPE_U8, 1, {m}};
    int64_t idx[2 * 5] = {0};
    float p[2 * 5] = {0}; /* outputs: written through s */
    mha_attention_stats s = {0};
    s.top_k = k, s.topk_index = idx, s.topk_prob = p;
    mha_error err;
    CHECK_OK(mha_attention_statistics(&a, &s, NULL, &err), &err);
    /* Row 0 (q = e0): keys 1, 3, 4 score 1, key 0 scores 0; key 2 is padded, 5 padded. */
    const int64_t want0[5] = {1, 3, 4, 0, -1};
    /* Row 1 (q = e1): keys 0, 1, 3, 4 score 0 (all tied). */
    const int64_t want1[5] = {0, 1, 3, 4, -1};
    for (int t = 0; t < 5; t++) {
        CHECK(idx[t] == want0[t], "ties row 0 slot %d: %lld, want %lld", t, (long long)idx[t],
              (long long)want0[t]);
        CHECK(idx[5 + t] == want1[t], "ties row 1 slot %d: %lld, want %lld", t,
              (long long)idx[5 + t], (long long)want1[t]);
    }
    CHECK(p[0] == p[1] && p[1] == p[2] && p[2] > p[3] && p[4] == 0.0f,
          "ties row 0 P %g %g %g %g %g", (double)p[0], (double)p[1], (double)p[2], (double)p[3],
          (double)p[4]);
    CHECK(p[5] == p[6] && p[6] == p[7] && p[7] == p[8] && fabsf(p[5] - 0.25f) < 1e-6f &&
              p[9] == 0.0f,
          "ties row 1 P %g %g %g %g %g", (double)p[5], (double)p[6], (double)p[7], (double)p[8],
          (double)p[9]);
}

/* Fully masked rows: entropy 0, no top-k entry, nothing received, visible fraction 0. */
static void test_fully_masked(void) {
    test_rng r;
    test_rng_seed(&r, 5);
    scase c;
    scase_make(&c, &r, 2048, 1, 2, 2, 4, 4);
    c.a.mask.causal = 1; /* bottom-right with n = 6 > m = 4: rows 0, 1 see nothing */
    c.a.q_len = 6;
    free(c.q);
    c.q = malloc(sizeof(float) * 2 * 6 * 16);
    test_fill_normal(&r, c.q, 2 * 6 * 16, 1.0f);
    c.a.q = c.q;
    const int64_t qs[3] = {2 * 6 * 16, 6 * 16, 16};
    memcpy(c.a.q_strides, qs, sizeof qs);
    float ent[12] = {0}, pool[2 * 6 * 4] = {0}, vis[2 * 6 * 4] = {0}; /* outputs */
    int64_t idx[12 * 2] = {0};
    mha_attention_stats s = {0};
    s.entropy = ent, s.top_k = 2, s.topk_index = idx, s.pool_rows = 6, s.pool_cols = 4;
    s.pooled = pool, s.pooled_visible = vis;
    mha_error err;
    CHECK_OK(mha_attention_statistics(&c.a, &s, NULL, &err), &err);
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 2; i++) {
            CHECK(ent[h * 6 + i] == 0.0f, "masked row entropy %g", (double)ent[h * 6 + i]);
            CHECK(idx[(h * 6 + i) * 2] == -1 && idx[(h * 6 + i) * 2 + 1] == -1, "masked row top-k");
            for (int j = 0; j < 4; j++)
                CHECK(pool[(h * 6 + i) * 4 + j] == 0.0f && vis[(h * 6 + i) * 4 + j] == 0.0f,
                      "masked row pooled");
        }
    /* Row 2 sees key 0 only: P_0 = 1 - P_sink, entropy of {P_0, P_sink} > 0. */
    CHECK(ent[2] > 0.0f && idx[2 * 2] == 0 && idx[2 * 2 + 1] == -1, "row 2: %g %lld %lld",
          (double)ent[2], (long long)idx[4], (long long)idx[5]);
    scase_free(&c);
}

static void test_bad_args(void) {
    test_rng r;
    test_rng_seed(&r, 9);
    scase c;
    scase_make(&c, &r, 0, 1, 2, 1, 5, 7);
    float ent[10] = {0};
    int64_t idx[5 * 2 * 8] = {0};
    float pool[64] = {0};
    mha_attention_stats s = {0};
    mha_error err;
    CHECK(mha_attention_statistics(&c.a, &s, NULL, &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "no statistic"),
          "nothing requested: %s", err.message);
    CHECK(mha_attention_statistics(&c.a, NULL, NULL, &err) == MHA_STATUS_INVALID_ARG,
          "stats NULL: %s", err.message);
    s.topk_index = idx;
    s.top_k = 8;
    CHECK(mha_attention_statistics(&c.a, &s, NULL, &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "top_k=8"),
          "k > m: %s", err.message);
    s.topk_index = NULL;
    s.pooled = pool, s.pool_rows = 6, s.pool_cols = 2;
    CHECK(mha_attention_statistics(&c.a, &s, NULL, &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "pool_rows=6"),
          "R > n: %s", err.message);
    s.pool_rows = 2, s.pool_cols = 0;
    CHECK(mha_attention_statistics(&c.a, &s, NULL, &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "pool_cols=0"),
          "C = 0: %s", err.message);
    s.pooled = NULL, s.entropy = ent;
    c.a.k = NULL;
    CHECK(mha_attention_statistics(&c.a, &s, NULL, &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "q and k"),
          "k NULL: %s", err.message);
    c.a.k = c.k;
    mha_exec ex = {MHA_IMPL_AUTO, -1, NULL, 0, NULL, NULL};
    CHECK(mha_attention_statistics(&c.a, &s, &ex, &err) == MHA_STATUS_INVALID_ARG,
          "negative threads: %s", err.message);
    c.a.mask.bool_mask = (mha_mask_tensor){ent, MHA_DTYPE_F32, 1, {7}};
    CHECK(mha_attention_statistics(&c.a, &s, NULL, &err) == MHA_STATUS_INVALID_ARG,
          "float bool mask: %s", err.message);
    scase_free(&c);
}

/* The layer's statistics (projections, RoPE, GQA, causal) against the statistics of the probs
 * the layer forward returns (reference implementation); out may be NULL. */
static void test_layer(void) {
    test_rng r;
    test_rng_seed(&r, 23);
    const int64_t B = 2, n = 70, q_dim = 16, H = 4, G = 2, d = 4;
    mha_config cfg = {0};
    cfg.q_dim = q_dim, cfg.num_heads = H, cfg.num_kv_heads = G, cfg.bias_q = cfg.bias_k = 1;
    cfg.rope.style = MHA_ROPE_HALF;
    float *w = malloc(sizeof(float) * 4096), *x = malloc(sizeof(float) * (size_t)(B * n * q_dim));
    test_fill_normal(&r, w, 4096, 0.5f);
    test_fill_normal(&r, x, B * n * q_dim, 1.0f);
    mha_weights wt = {w,    w + 1024, w + 2048, w + 3072, w + 3900, w + 3950,
                      NULL, NULL,     NULL,     NULL,     NULL};
    (void)d;
    mha_layer *layer = NULL;
    mha_error err;
    CHECK_OK(mha_layer_create(&cfg, &wt, MHA_WEIGHTS_BORROW, NULL, &layer, &err), &err);
    float *y = malloc(sizeof(float) * (size_t)(B * n * q_dim));
    float *probs = malloc(sizeof(float) * (size_t)(B * H * n * n));
    mha_forward_args fa = {0};
    fa.batch = B, fa.q_len = n, fa.query = x, fa.out = y, fa.probs = probs;
    fa.mask.causal = 1;
    mha_exec ref = {MHA_IMPL_REFERENCE, 1, NULL, 0, NULL, NULL};
    CHECK_OK(mha_layer_forward(layer, &fa, &ref, &err), &err);
    souts o;
    mha_attention_args shape = {0};
    shape.batch = B, shape.num_heads = H, shape.q_len = n, shape.kv_len = n;
    souts_make(&o, &shape, 5, 6, 9);
    fa.out = NULL, fa.probs = NULL;
    CHECK_OK(mha_layer_attention_statistics(layer, &fa, &o.s, NULL, &err), &err);
    double *pr = malloc(sizeof(double) * (size_t)(B * H * n * n));
    double *lse = calloc((size_t)n, sizeof(double)); /* no sinks: only used for |s| bounds */
    for (int64_t e = 0; e < B * H * n * n; e++)
        pr[e] = (double)probs[e];
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            check_pair(&o, &shape, b, h, pr + (b * H + h) * n * n, lse, "layer");
    mha_attention_stats none = {0};
    CHECK(mha_layer_attention_statistics(layer, &fa, &none, NULL, &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "no statistic"),
          "layer, nothing requested: %s", err.message);
    souts_free(&o);
    free(pr), free(lse), free(probs), free(y), free(x), free(w);
    mha_layer_destroy(layer);
}

int main(void) {
    test_layer();
    test_random_cases();
    test_topk_ties();
    test_fully_masked();
    test_bad_args();
    return test_finish();
}
