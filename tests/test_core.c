/* SPDX-License-Identifier: MIT */
/* test_core.c: the attention core and RoPE against the float64 oracle, the CS336 fixtures, the
 * Philox known answers, and the properties of issue 2 (causality, permutation equivariance,
 * relative position, h = 1, dropout, thread determinism, fully masked rows). */
#include "harness.h"
#include "npy.h"
#include "oracle_f64.h"
#include "tolerance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void mha__philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);
int mha__dropout_keep(uint64_t seed, float p, int64_t b, int64_t h, int64_t i, int64_t j);

/* ---------------------------------------------------------------------------------------------- */
static void test_philox_known_answers(void) {
    /* Known-answer vectors published with Random123 (kat_vectors, philox4x32_10). */
    const struct {
        uint32_t ctr[4], key[2], out[4];
    } kat[] = {
        {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
        {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
         {0xffffffffu, 0xffffffffu},
         {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
        {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
         {0xa4093822u, 0x299f31d0u},
         {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
    };
    for (size_t t = 0; t < sizeof kat / sizeof kat[0]; t++) {
        uint32_t out[4];
        mha__philox4x32_10(kat[t].ctr, kat[t].key, out);
        CHECK(memcmp(out, kat[t].out, sizeof out) == 0, "philox KAT %zu: got %08x %08x %08x %08x",
              t, out[0], out[1], out[2], out[3]);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Random core problems covering every feature, vs the oracle.                                    */

typedef struct core_case {
    mha_attention_args a;
    float *q, *k, *v, *out, *lse, *probs, *sinks, *addmask;
    uint8_t *boolmask, *kpm;
    int32_t *qseg, *kseg;
    int64_t *offsets;
} core_case;

static void case_free(core_case *c) {
    free(c->q), free(c->k), free(c->v), free(c->out), free(c->lse), free(c->probs);
    free(c->sinks), free(c->addmask), free(c->boolmask), free(c->kpm), free(c->qseg);
    free(c->kseg), free(c->offsets);
    memset(c, 0, sizeof *c);
}

/* Builds a random problem; `features` is a bit set choosing what to turn on. */
static void case_make(core_case *c,
                      test_rng *r,
                      unsigned features,
                      int64_t B,
                      int64_t H,
                      int64_t G,
                      int64_t n,
                      int64_t m,
                      int64_t dk,
                      int64_t dv,
                      int blhd) {
    memset(c, 0, sizeof *c);
    mha_attention_args *a = &c->a;
    a->batch = B, a->num_heads = H, a->num_kv_heads = G, a->q_len = n, a->kv_len = m;
    a->head_dim = dk, a->v_head_dim = dv;
    c->q = malloc(sizeof(float) * (size_t)(B * H * n * dk));
    c->k = malloc(sizeof(float) * (size_t)(B * G * m * dk));
    c->v = malloc(sizeof(float) * (size_t)(B * G * m * dv));
    c->out = malloc(sizeof(float) * (size_t)(B * H * n * dv));
    c->lse = malloc(sizeof(float) * (size_t)(B * H * n));
    c->probs = malloc(sizeof(float) * (size_t)(B * H * n * m));
    test_fill_normal(r, c->q, B * H * n * dk, (features & 1u) ? 3.0f : 1.0f); /* big logits */
    test_fill_normal(r, c->k, B * G * m * dk, 1.0f);
    test_fill_normal(r, c->v, B * G * m * dv, 1.0f);
    a->q = c->q, a->k = c->k, a->v = c->v, a->out = c->out, a->lse = c->lse, a->probs = c->probs;
    if (blhd) { /* [B, L, heads, d] */
        const int64_t qs[3] = {n * H * dk, dk, H * dk}, ks[3] = {m * G * dk, dk, G * dk};
        const int64_t vs[3] = {m * G * dv, dv, G * dv}, os[3] = {n * H * dv, dv, H * dv};
        memcpy(a->q_strides, qs, sizeof qs), memcpy(a->k_strides, ks, sizeof ks);
        memcpy(a->v_strides, vs, sizeof vs), memcpy(a->out_strides, os, sizeof os);
    } else { /* [B, heads, L, d] */
        const int64_t qs[3] = {H * n * dk, n * dk, dk}, ks[3] = {G * m * dk, m * dk, dk};
        const int64_t vs[3] = {G * m * dv, m * dv, dv}, os[3] = {H * n * dv, n * dv, dv};
        memcpy(a->q_strides, qs, sizeof qs), memcpy(a->k_strides, ks, sizeof ks);
        memcpy(a->v_strides, vs, sizeof vs), memcpy(a->out_strides, os, sizeof os);
    }
    mha_masking *mk = &a->mask;
    if (features & 2u)
        mk->causal = 1;
    if (features & 4u)
        mk->alignment = MHA_ALIGN_TOP_LEFT;
    if (features & 8u) {
        mk->alignment = MHA_ALIGN_EXPLICIT;
        c->offsets = malloc(sizeof(int64_t) * (size_t)B);
        for (int64_t b = 0; b < B; b++)
            c->offsets[b] = (int64_t)(test_rng_u64(r) % (uint64_t)(m + 2)) - 1;
        mk->align_offsets = c->offsets;
    }
    if (features & 16u) {
        mk->use_window = 1;
        mk->window_left = (int64_t)(test_rng_u64(r) % 4) - 1;
        mk->window_right = (int64_t)(test_rng_u64(r) % 3) - 1;
    }
    if (features & 32u) { /* bool mask [B, 1, n, m] broadcast over heads, random polarity */
        c->boolmask = malloc((size_t)(B * n * m));
        for (int64_t e = 0; e < B * n * m; e++)
            c->boolmask[e] = test_rng_uniform(r) < 0.7;
        mk->bool_mask = (mha_mask_tensor){c->boolmask, MHA_DTYPE_BOOL, 4, {B, 1, n, m}};
        mk->bool_mask_polarity = (test_rng_u64(r) & 1) ? MHA_MASK_BLOCK : MHA_MASK_ATTEND;
    }
    if (features & 64u) { /* additive [n, m] with some -inf */
        c->addmask = malloc(sizeof(float) * (size_t)(n * m));
        for (int64_t e = 0; e < n * m; e++)
            c->addmask[e] = test_rng_uniform(r) < 0.1 ? -INFINITY : (float)test_rng_normal(r);
        mk->additive_mask = (mha_mask_tensor){c->addmask, MHA_DTYPE_F32, 2, {n, m}};
    }
    if (features & 128u) { /* key padding [B, m] */
        c->kpm = malloc((size_t)(B * m));
        for (int64_t e = 0; e < B * m; e++)
            c->kpm[e] = test_rng_uniform(r) < 0.8;
        mk->key_padding = (mha_mask_tensor){c->kpm, MHA_DTYPE_U8, 2, {B, m}};
    }
    if (features & 256u) { /* segments: two documents per row */
        c->qseg = malloc(sizeof(int32_t) * (size_t)(B * n));
        c->kseg = malloc(sizeof(int32_t) * (size_t)(B * m));
        for (int64_t e = 0; e < B * n; e++)
            c->qseg[e] = (e % n) * 2 >= n;
        for (int64_t e = 0; e < B * m; e++)
            c->kseg[e] = (e % m) * 2 >= m;
        mk->q_segment_ids = c->qseg, mk->kv_segment_ids = c->kseg;
    }
    if (features & 512u)
        a->softcap = 5.0 + 20.0 * test_rng_uniform(r);
    if (features & 1024u)
        a->alibi = 1;
    if (features & 2048u) {
        c->sinks = malloc(sizeof(float) * (size_t)H);
        test_fill_normal(r, c->sinks, H, 1.0f);
        a->sinks = c->sinks;
    }
    if (features & 4096u) { /* half the cases as a block of a larger attention (offsets) */
        a->dropout = (mha_dropout){0.3f, test_rng_u64(r), 1, 0, 0};
        if (test_rng_u64(r) & 1)
            a->dropout.row_offset = (int64_t)(test_rng_u64(r) % 5000),
            a->dropout.col_offset = (int64_t)(test_rng_u64(r) % 5000);
    }
    if (features & 8192u)
        a->scale = 0.05 + test_rng_uniform(r);
}

/* Worst errors seen over the random cases (printed, recorded in docs/TESTING.md). */
static double g_worst_out_rel, g_worst_probs;

/* Runs the case through the library and the oracle, checks outputs, lse and probs. */
static void case_check(core_case *c, mha_impl impl, int threads, const char *label) {
    const mha_attention_args *a = &c->a;
    const int64_t B = a->batch, H = a->num_heads, n = a->q_len, m = a->kv_len;
    const int64_t dv = a->v_head_dim;
    mha_exec ex = {impl, threads, NULL, 0, NULL, NULL};
    mha_error err;
    mha_status st = mha_attention(a, &ex, &err);
    CHECK(st == MHA_STATUS_OK, "%s: mha_attention: %s", label, err.message);
    if (st != MHA_STATUS_OK)
        return;
    double *o = malloc(sizeof(double) * (size_t)(B * H * n * dv));
    double *lse = malloc(sizeof(double) * (size_t)(B * H * n));
    double *pr = malloc(sizeof(double) * (size_t)(B * H * n * m));
    CHECK(oracle_attention(a, o, lse, pr) == 0, "%s: oracle", label);
    /* The library's out may be strided: gather it to [B, H, n, dv]. */
    double worst = 0.0, scale = 0.0, worst_p = 0.0, worst_lse = 0.0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < n; i++) {
                const float *row = (float *)a->out + b * a->out_strides[0] + h * a->out_strides[1] +
                                   i * a->out_strides[2];
                for (int64_t d = 0; d < dv; d++) {
                    const double ref = o[((b * H + h) * n + i) * dv + d];
                    double e = fabs((double)row[d] - ref);
                    if (isnan(e))
                        e = HUGE_VAL;
                    worst = fmax(worst, e);
                    scale = fmax(scale, fabs(ref));
                }
                const double l_ref = lse[(b * H + h) * n + i];
                const double l = (double)a->lse[(b * H + h) * n + i];
                /* lse is a log-sum: its float error scales with max(1, |lse|). */
                const double el =
                    (isinf(l_ref) && l == l_ref) ? 0.0 : fabs(l - l_ref) / fmax(1.0, fabs(l_ref));
                worst_lse = fmax(worst_lse, isnan(el) ? HUGE_VAL : el);
            }
    for (int64_t e = 0; e < B * H * n * m; e++) {
        double d = fabs((double)a->probs[e] - pr[e]);
        worst_p = fmax(worst_p, isnan(d) ? HUGE_VAL : d);
    }
    g_worst_out_rel = fmax(g_worst_out_rel, worst / fmax(scale, 1e-30));
    g_worst_probs = fmax(g_worst_probs, worst_p);
    CHECK(worst <= TOL_OUT_REL * fmax(scale, 1e-30) + 1e-30, "%s: max|o-ref|=%.3g, max|ref|=%.3g",
          label, worst, scale);
    CHECK(worst_p <= TOL_PROBS_ABS, "%s: max|p-ref|=%.3g", label, worst_p);
    CHECK(worst_lse <= TOL_OUT_REL, "%s: max|lse-ref|/max(1,|ref|)=%.3g", label, worst_lse);
    free(o), free(lse), free(pr);
}

static void test_core_vs_oracle(void) {
    test_rng r;
    test_rng_seed(&r, 1234);
    const int64_t shapes[][7] = {
        /* B H G n m dk dv */
        {1, 1, 1, 1, 1, 8, 8},     {2, 4, 2, 5, 7, 16, 8},   {1, 4, 1, 9, 9, 8, 12},
        {2, 3, 3, 6, 4, 5, 5},     {1, 8, 2, 1, 17, 32, 32}, {3, 2, 1, 11, 3, 4, 16},
        {1, 2, 2, 33, 40, 64, 64},
    };
    int count = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (unsigned f = 0; f < 40; f++) {
            const int64_t *sh = shapes[s];
            const unsigned features = f == 0 ? 0u : (unsigned)(test_rng_u64(&r) & 0x3fffu);
            core_case c;
            case_make(&c, &r, features, sh[0], sh[1], sh[2], sh[3], sh[4], sh[5], sh[6],
                      (int)(f & 1u));
            char label[160];
            snprintf(label, sizeof label, "shape#%zu features=0x%x blhd=%u", s, features, f & 1u);
            case_check(&c, MHA_IMPL_REFERENCE, 1 + (int)(f % 3), label);
            case_free(&c);
            count++;
        }
    printf("core vs oracle: %d random cases, worst max|o-ref|/max|ref| = %.3g, worst "
           "max|p-ref| = %.3g\n",
           count, g_worst_out_rel, g_worst_probs);
}

/* Averaged probabilities equal the mean over heads of the per-head ones. */
static void test_average_probs(void) {
    test_rng r;
    test_rng_seed(&r, 99);
    core_case c;
    case_make(&c, &r, 2u | 32u, 2, 4, 2, 5, 6, 8, 8, 0);
    mha_error err;
    CHECK_OK(mha_attention(&c.a, NULL, &err), &err);
    float *per_head = malloc(sizeof(float) * (size_t)(2 * 4 * 5 * 6));
    memcpy(per_head, c.probs, sizeof(float) * (size_t)(2 * 4 * 5 * 6));
    c.a.average_probs = 1;
    CHECK_OK(mha_attention(&c.a, NULL, &err), &err);
    double worst = 0.0;
    for (int64_t b = 0; b < 2; b++)
        for (int64_t e = 0; e < 30; e++) {
            double mean = 0.0;
            for (int64_t h = 0; h < 4; h++)
                mean += (double)per_head[(b * 4 + h) * 30 + e];
            worst = fmax(worst, fabs(mean / 4.0 - (double)c.probs[b * 30 + e]));
        }
    CHECK(worst <= 1e-6, "averaged probs differ from the mean over heads by %.3g", worst);
    free(per_head);
    case_free(&c);
}

/* Fully masked rows: zero output, zero probabilities, lse = -inf, no NaN. */
static void test_fully_masked_rows(void) {
    test_rng r;
    test_rng_seed(&r, 5);
    core_case c;
    case_make(&c, &r, 2048u, 1, 2, 2, 4, 5, 8, 8, 0); /* with sinks too */
    uint8_t kpm[5] = {0, 0, 0, 0, 0};
    c.a.mask.key_padding = (mha_mask_tensor){kpm, MHA_DTYPE_BOOL, 1, {5}};
    mha_error err;
    CHECK_OK(mha_attention(&c.a, NULL, &err), &err);
    int bad = 0;
    for (int64_t e = 0; e < 2 * 4 * 8; e++)
        bad += c.out[e] != 0.0f;
    for (int64_t e = 0; e < 2 * 4 * 5; e++)
        bad += c.probs[e] != 0.0f;
    for (int64_t e = 0; e < 2 * 4; e++)
        bad += !(isinf(c.lse[e]) && c.lse[e] < 0.0f);
    CHECK(bad == 0, "fully masked rows: %d elements are not 0 / -inf", bad);
    /* Causal top-left with n > m leaves no row empty; bottom-right with n > m empties the first
     * n - m rows: those are zero, the others are not. */
    case_free(&c);
    case_make(&c, &r, 2u, 1, 1, 1, 6, 3, 4, 4, 0);
    CHECK_OK(mha_attention(&c.a, NULL, &err), &err);
    int zero_rows = 0;
    for (int64_t i = 0; i < 6; i++)
        zero_rows += c.out[i * 4] == 0.0f && c.out[i * 4 + 1] == 0.0f;
    CHECK(zero_rows == 3, "bottom-right causal, n=6 m=3: %d zero rows, expected 3", zero_rows);
    case_free(&c);
}

/* NaN in a key propagates to the rows that see it and nowhere else; never a crash. */
static void test_nan_propagation(void) {
    test_rng r;
    test_rng_seed(&r, 6);
    core_case c;
    case_make(&c, &r, 2u, 1, 1, 1, 4, 4, 4, 4, 0);
    c.k[2 * 4 + 1] = NAN; /* key 2: rows 2 and 3 see it under causal masking */
    mha_error err;
    CHECK_OK(mha_attention(&c.a, NULL, &err), &err);
    CHECK(!isnan(c.out[0]) && !isnan(c.out[4]), "rows 0, 1 must not see the NaN key");
    CHECK(isnan(c.out[8]) && isnan(c.out[12]), "rows 2, 3 must propagate the NaN key");
    case_free(&c);
}

/* Same output bit for bit for 1, 2 and 3 threads, dropout on. */
static void test_thread_determinism(void) {
    test_rng r;
    test_rng_seed(&r, 7);
    core_case c;
    case_make(&c, &r, 2u | 4096u | 1024u, 2, 4, 2, 9, 9, 8, 8, 0);
    const size_t bytes = sizeof(float) * 2 * 4 * 9 * 8;
    float *first = malloc(bytes);
    mha_error err;
    for (int t = 1; t <= 3; t++) {
        mha_exec ex = {MHA_IMPL_AUTO, t, NULL, 0, NULL, NULL};
        CHECK_OK(mha_attention(&c.a, &ex, &err), &err);
        if (t == 1)
            memcpy(first, c.out, bytes);
        else
            CHECK(memcmp(first, c.out, bytes) == 0, "threads=%d differs from threads=1", t);
    }
    free(first);
    case_free(&c);
}

/* Dropout: the kept fraction is 1-p within 4 sigma; inference mode never drops; the same seed
 * reproduces, another seed differs; E[output] equals the undropped output (mean over seeds). */
static void test_dropout_statistics(void) {
    const float p = 0.25f;
    int64_t kept = 0, total = 0;
    for (int64_t j = 0; j < 200000; j++) {
        kept += mha__dropout_keep(42, p, j % 3, j % 5, j / 7, j);
        total++;
    }
    const double frac = (double)kept / (double)total;
    const double sigma = sqrt(0.75 * 0.25 / (double)total);
    CHECK(fabs(frac - 0.75) < 4.0 * sigma, "dropout kept fraction %.5f, expected 0.75", frac);

    test_rng r;
    test_rng_seed(&r, 8);
    core_case c;
    case_make(&c, &r, 0u, 1, 2, 2, 3, 64, 8, 8, 0);
    const int64_t cnt = 2 * 3 * 8;
    float *plain = malloc(sizeof(float) * (size_t)cnt);
    double *mean = calloc((size_t)cnt, sizeof(double));
    mha_error err;
    CHECK_OK(mha_attention(&c.a, NULL, &err), &err);
    memcpy(plain, c.out, sizeof(float) * (size_t)cnt);
    c.a.dropout = (mha_dropout){.p = 0.5f, .seed = 1, .training = 0}; /* inference: p ignored */
    CHECK_OK(mha_attention(&c.a, NULL, &err), &err);
    CHECK(memcmp(plain, c.out, sizeof(float) * (size_t)cnt) == 0, "inference mode dropped");
    const int seeds = 400;
    for (int s = 0; s < seeds; s++) {
        c.a.dropout = (mha_dropout){.p = 0.5f, .seed = (uint64_t)s * 7919u + 1u, .training = 1};
        CHECK_OK(mha_attention(&c.a, NULL, &err), &err);
        for (int64_t e = 0; e < cnt; e++)
            mean[e] += (double)c.out[e] / seeds;
    }
    double worst = 0.0, scale = 0.0;
    for (int64_t e = 0; e < cnt; e++) {
        worst = fmax(worst, fabs(mean[e] - (double)plain[e]));
        scale = fmax(scale, fabs((double)plain[e]));
    }
    /* Each output is a sum of 64 terms p_j v_j z_j/(1-p), z ~ Bernoulli: its std over seeds is
     * about |v| sqrt(sum p_j^2) <= ~0.3 here; the mean of 400 draws is within ~0.06 (4 sigma). */
    CHECK(worst < 0.1, "dropout mean over %d seeds differs from the plain output by %.3g", seeds,
          worst);
    free(plain), free(mean);
    case_free(&c);
}

/* ---------------------------------------------------------------------------------------------- */
/* CS336 fixtures.                                                                                */

static int load(const char *rel, mha__npy *a) {
    char *path = test_source_path(rel);
    mha_error err;
    mha_status st = mha__npy_read(path, a, &err);
    CHECK(st == MHA_STATUS_OK, "load %s: %s", path, err.message);
    free(path);
    return st == MHA_STATUS_OK;
}

static void check_allclose(const float *got, const float *want, int64_t count, const char *what) {
    int64_t bad = 0;
    double worst = 0.0;
    for (int64_t e = 0; e < count; e++) {
        const double d = fabs((double)got[e] - (double)want[e]);
        worst = fmax(worst, d);
        if (!(d <= TOL_CS336_ATOL + TOL_CS336_RTOL * fabs((double)want[e])))
            bad++;
    }
    CHECK(bad == 0, "%s: %lld elements outside atol+rtol (max abs diff %.3g)", what, (long long)bad,
          worst);
    printf("%s: max abs diff %.3g\n", what, worst);
}

static void cs336_sdpa(const char *dir, int four_d) {
    char rel[256];
    mha__npy Q, K, V, M, E;
    snprintf(rel, sizeof rel, "tests/fixtures/cs336/%s/Q.npy", dir);
    if (!load(rel, &Q))
        return;
    snprintf(rel, sizeof rel, "tests/fixtures/cs336/%s/K.npy", dir);
    load(rel, &K);
    snprintf(rel, sizeof rel, "tests/fixtures/cs336/%s/V.npy", dir);
    load(rel, &V);
    snprintf(rel, sizeof rel, "tests/fixtures/cs336/%s/mask_attend.npy", dir);
    load(rel, &M);
    snprintf(rel, sizeof rel, "tests/fixtures/cs336/%s/expected.npy", dir);
    load(rel, &E);
    /* 3-d: leading dim is a batch with one head; 4-d: (batch, head). */
    const int64_t B = Q.shape[0], H = four_d ? Q.shape[1] : 1;
    const int64_t n = Q.shape[Q.ndim - 2], d = Q.shape[Q.ndim - 1], m = K.shape[K.ndim - 2];
    float *out = malloc(sizeof(float) * (size_t)(B * H * n * d));
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = B, a.num_heads = H, a.q_len = n, a.kv_len = m, a.head_dim = d;
    a.q = Q.data, a.k = K.data, a.v = V.data, a.out = out;
    const int64_t qs[3] = {H * n * d, n * d, d}, ks[3] = {H * m * d, m * d, d};
    memcpy(a.q_strides, qs, sizeof qs), memcpy(a.out_strides, qs, sizeof qs);
    memcpy(a.k_strides, ks, sizeof ks), memcpy(a.v_strides, ks, sizeof ks);
    /* mask_attend: 1 = may attend, the library's default polarity. */
    a.mask.bool_mask = (mha_mask_tensor){M.data, MHA_DTYPE_U8, 4, {B, H, n, m}};
    const mha_impl impls[2] = {MHA_IMPL_REFERENCE, MHA_IMPL_AUTO};
    for (int t = 0; t < 2; t++) {
        mha_exec ex = {impls[t], 0, NULL, 0, NULL, NULL};
        mha_error err;
        CHECK_OK(mha_attention(&a, &ex, &err), &err);
        char what[128];
        snprintf(what, sizeof what, "cs336 %s (%s)", dir, t ? "auto" : "reference");
        check_allclose(out, E.data, B * H * n * d, what);
    }
    /* The polarity is what the fixture pins down: the opposite reading must fail. */
    a.mask.bool_mask_polarity = MHA_MASK_BLOCK;
    mha_error err;
    CHECK_OK(mha_attention(&a, NULL, &err), &err);
    double worst = 0.0;
    for (int64_t e = 0; e < B * H * n * d; e++)
        worst = fmax(worst, fabs((double)out[e] - (double)((float *)E.data)[e]));
    CHECK(worst > 0.5, "flipped mask polarity should miss the expected output (got %.3g)", worst);
    free(out);
    mha__npy_free(&Q), mha__npy_free(&K), mha__npy_free(&V), mha__npy_free(&M);
    mha__npy_free(&E);
}

static void cs336_rope(void) {
    mha__npy X, P, E;
    if (!load("tests/fixtures/cs336/test_rope/x.npy", &X))
        return;
    load("tests/fixtures/cs336/test_rope/token_positions.npy", &P);
    load("tests/fixtures/cs336/test_rope/expected.npy", &E);
    const int64_t B = X.shape[0], L = X.shape[1], D = X.shape[2];
    int64_t pos[64];
    for (int64_t t = 0; t < L && t < 64; t++)
        pos[t] = ((const int32_t *)P.data)[t];
    mha_rope rope = {0};
    rope.style = MHA_ROPE_INTERLEAVED;
    rope.theta = 10000.0;
    const int64_t strides[4] = {L * D, D, D, 1};
    mha_error err;
    float *x = malloc(sizeof(float) * (size_t)(B * L * D));
    memcpy(x, X.data, sizeof(float) * (size_t)(B * L * D));
    CHECK_OK(mha_rope_apply(&rope, B, L, 1, D, x, strides, pos, 0, &err), &err);
    check_allclose(x, E.data, B * L * D, "cs336 rope (interleaved)");
    /* The other pairing must miss: the fixture pins the convention down. */
    memcpy(x, X.data, sizeof(float) * (size_t)(B * L * D));
    rope.style = MHA_ROPE_HALF;
    CHECK_OK(mha_rope_apply(&rope, B, L, 1, D, x, strides, pos, 0, &err), &err);
    double worst = 0.0;
    for (int64_t e = 0; e < B * L * D; e++)
        worst = fmax(worst, fabs((double)x[e] - (double)((float *)E.data)[e]));
    CHECK(worst > 0.5, "rotate-half pairing should miss the interleaved fixture (got %.3g)", worst);
    free(x);
    mha__npy_free(&X), mha__npy_free(&P), mha__npy_free(&E);
}

/* ---------------------------------------------------------------------------------------------- */
/* Layer properties.                                                                              */

typedef struct layer_fixture {
    mha_config cfg;
    float *w_q, *w_k, *w_v, *w_o, *b_q, *b_k, *b_v, *b_o;
    mha_weights w;
    mha_layer *layer;
} layer_fixture;

static void layer_make(layer_fixture *f, test_rng *r, const mha_config *cfg) {
    memset(f, 0, sizeof *f);
    f->cfg = *cfg;
    const int64_t q = cfg->q_dim, H = cfg->num_heads;
    const int64_t G = cfg->num_kv_heads ? cfg->num_kv_heads : H;
    const int64_t dk = cfg->head_dim ? cfg->head_dim : q / H;
    const int64_t dv = cfg->v_head_dim ? cfg->v_head_dim : dk;
    const int64_t kd = cfg->k_dim ? cfg->k_dim : q, vd = cfg->v_dim ? cfg->v_dim : kd;
    const int64_t od = cfg->out_dim ? cfg->out_dim : q;
    const float sc = 1.0f / sqrtf((float)q);
    f->w_q = malloc(sizeof(float) * (size_t)(H * dk * q));
    f->w_k = malloc(sizeof(float) * (size_t)(G * dk * kd));
    f->w_v = malloc(sizeof(float) * (size_t)(G * dv * vd));
    f->w_o = malloc(sizeof(float) * (size_t)(od * H * dv));
    test_fill_normal(r, f->w_q, H * dk * q, sc);
    test_fill_normal(r, f->w_k, G * dk * kd, sc);
    test_fill_normal(r, f->w_v, G * dv * vd, sc);
    test_fill_normal(r, f->w_o, od * H * dv, sc);
    f->w.w_q = f->w_q, f->w.w_k = f->w_k, f->w.w_v = f->w_v, f->w.w_o = f->w_o;
    if (cfg->bias_q) {
        f->b_q = malloc(sizeof(float) * (size_t)(H * dk));
        test_fill_normal(r, f->b_q, H * dk, 0.1f);
        f->w.b_q = f->b_q;
    }
    if (cfg->bias_o) {
        f->b_o = malloc(sizeof(float) * (size_t)od);
        test_fill_normal(r, f->b_o, od, 0.1f);
        f->w.b_o = f->b_o;
    }
    mha_error err;
    CHECK_OK(mha_layer_create(cfg, &f->w, MHA_WEIGHTS_COPY, NULL, &f->layer, &err), &err);
}

static void layer_free(layer_fixture *f) {
    mha_layer_destroy(f->layer);
    free(f->w_q), free(f->w_k), free(f->w_v), free(f->w_o), free(f->b_q), free(f->b_k);
    free(f->b_v), free(f->b_o);
}

static double max_diff(const float *a, const float *b, int64_t count) {
    double w = 0.0;
    for (int64_t e = 0; e < count; e++)
        w = fmax(w, fabs((double)a[e] - (double)b[e]));
    return w;
}

/* The layer against the float64 layer oracle, with and without RoPE, GQA, cross-attention. */
static void test_layer_vs_oracle(void) {
    test_rng r;
    test_rng_seed(&r, 31);
    for (int variant = 0; variant < 6; variant++) {
        mha_config cfg = {0};
        cfg.q_dim = 24, cfg.num_heads = 4, cfg.bias_q = 1, cfg.bias_o = 1;
        if (variant & 1)
            cfg.rope.style = variant & 2 ? MHA_ROPE_HALF : MHA_ROPE_INTERLEAVED;
        if (variant >= 2)
            cfg.num_kv_heads = 2, cfg.head_dim = 8, cfg.v_head_dim = 4, cfg.out_dim = 10;
        if (variant >= 4)
            cfg.k_dim = 12, cfg.v_dim = 20, cfg.rope.rotary_dim = cfg.rope.style ? 4 : 0;
        layer_fixture f;
        layer_make(&f, &r, &cfg);
        const int cross = variant >= 4;
        const int64_t B = 2, n = 5, m = cross ? 7 : 5;
        const mha_config *rc = mha_layer_config(f.layer);
        float *x = malloc(sizeof(float) * (size_t)(B * n * 24));
        float *xk = malloc(sizeof(float) * (size_t)(B * m * 12));
        float *xv = malloc(sizeof(float) * (size_t)(B * m * 20));
        float *y = malloc(sizeof(float) * (size_t)(B * n * rc->out_dim));
        double *ref = malloc(sizeof(double) * (size_t)(B * n * rc->out_dim));
        test_fill_normal(&r, x, B * n * 24, 1.0f);
        test_fill_normal(&r, xk, B * m * 12, 1.0f);
        test_fill_normal(&r, xv, B * m * 20, 1.0f);
        int64_t qpos[10], kpos[14];
        for (int e = 0; e < 10; e++)
            qpos[e] = 3 + 2 * e;
        for (int e = 0; e < 14; e++)
            kpos[e] = e;
        mha_forward_args a = {0};
        a.batch = B, a.q_len = n, a.kv_len = m, a.query = x, a.out = y;
        if (cross)
            a.key = xk, a.value = xv, a.k_positions = kpos;
        a.q_positions = qpos;
        a.mask.causal = 1;
        mha_error err;
        CHECK_OK(mha_layer_forward(f.layer, &a, NULL, &err), &err);
        CHECK(oracle_layer(rc, mha_layer_weights(f.layer), &a, ref, NULL) == 0, "oracle_layer");
        const double worst = test_max_abs_diff(y, ref, B * n * rc->out_dim);
        const double scale = test_max_abs(ref, B * n * rc->out_dim);
        CHECK(worst <= TOL_OUT_REL * scale, "layer variant %d: max|y-ref|=%.3g max|ref|=%.3g",
              variant, worst, scale);
        free(x), free(xk), free(xv), free(y), free(ref);
        layer_free(&f);
    }
}

static void test_layer_properties(void) {
    test_rng r;
    test_rng_seed(&r, 77);
    const int64_t n = 8, D = 16;
    mha_error err;

    /* Causality: changing future tokens leaves earlier outputs unchanged (bit for bit). */
    {
        mha_config cfg = {0};
        cfg.q_dim = D, cfg.num_heads = 2, cfg.rope.style = MHA_ROPE_HALF;
        layer_fixture f;
        layer_make(&f, &r, &cfg);
        float x[8 * 16], y1[8 * 16], y2[8 * 16];
        test_fill_normal(&r, x, n * D, 1.0f);
        mha_forward_args a = {0};
        a.batch = 1, a.q_len = n, a.query = x, a.out = y1, a.mask.causal = 1;
        CHECK_OK(mha_layer_forward(f.layer, &a, NULL, &err), &err);
        for (int64_t e = 5 * D; e < n * D; e++)
            x[e] += 1.0f;
        a.out = y2;
        CHECK_OK(mha_layer_forward(f.layer, &a, NULL, &err), &err);
        CHECK(memcmp(y1, y2, sizeof(float) * 5 * D) == 0, "causality: rows 0-4 changed");
        CHECK(max_diff(y1 + 5 * D, y2 + 5 * D, 3 * D) > 1e-3, "rows 5-7 should change");
        layer_free(&f);
    }
    /* Permutation equivariance without mask and RoPE. */
    {
        mha_config cfg = {0};
        cfg.q_dim = D, cfg.num_heads = 4, cfg.bias_q = 1, cfg.bias_o = 1;
        layer_fixture f;
        layer_make(&f, &r, &cfg);
        float x[8 * 16], xp[8 * 16], y[8 * 16], yp[8 * 16];
        const int perm[8] = {3, 7, 0, 5, 1, 6, 2, 4};
        test_fill_normal(&r, x, n * D, 1.0f);
        for (int i = 0; i < 8; i++)
            memcpy(xp + i * D, x + perm[i] * D, sizeof(float) * D);
        mha_forward_args a = {0};
        a.batch = 1, a.q_len = n, a.query = x, a.out = y;
        CHECK_OK(mha_layer_forward(f.layer, &a, NULL, &err), &err);
        a.query = xp, a.out = yp;
        CHECK_OK(mha_layer_forward(f.layer, &a, NULL, &err), &err);
        double worst = 0.0;
        for (int i = 0; i < 8; i++)
            worst = fmax(worst, max_diff(yp + i * D, y + perm[i] * D, D));
        CHECK(worst <= 1e-5, "permutation equivariance: max diff %.3g", worst);
        layer_free(&f);
    }
    /* RoPE: scores depend only on relative positions: shifting every position by 1000 keeps the
     * output (up to the float rounding of the rotated vectors). */
    for (int style = 1; style <= 2; style++) {
        mha_config cfg = {0};
        cfg.q_dim = D, cfg.num_heads = 2, cfg.rope.style = (mha_rope_style)style;
        layer_fixture f;
        layer_make(&f, &r, &cfg);
        float x[8 * 16], y1[8 * 16], y2[8 * 16];
        float probs1[2 * 64], probs2[2 * 64];
        int64_t pos[8];
        test_fill_normal(&r, x, n * D, 1.0f);
        mha_forward_args a = {0};
        a.batch = 1, a.q_len = n, a.query = x, a.out = y1, a.probs = probs1;
        CHECK_OK(mha_layer_forward(f.layer, &a, NULL, &err), &err);
        for (int i = 0; i < 8; i++)
            pos[i] = i + 1000;
        a.q_positions = pos, a.out = y2, a.probs = probs2;
        CHECK_OK(mha_layer_forward(f.layer, &a, NULL, &err), &err);
        CHECK(max_diff(probs1, probs2, 2 * 64) <= 1e-5,
              "rope style %d: probabilities changed under a position shift (%.3g)", style,
              max_diff(probs1, probs2, 2 * 64));
        /* ... while a non-uniform change of positions does change them. */
        pos[0] = 0;
        CHECK_OK(mha_layer_forward(f.layer, &a, NULL, &err), &err);
        CHECK(max_diff(probs1, probs2, 2 * 64) > 1e-4, "rope style %d: positions ignored?", style);
        layer_free(&f);
    }
    /* h = 1 equals single-head attention written out: softmax(QK^T/sqrt(d)) V W_o^T. */
    {
        mha_config cfg = {0};
        cfg.q_dim = D, cfg.num_heads = 1;
        layer_fixture f;
        layer_make(&f, &r, &cfg);
        float x[8 * 16], y[8 * 16];
        test_fill_normal(&r, x, n * D, 1.0f);
        mha_forward_args a = {0};
        a.batch = 1, a.q_len = n, a.query = x, a.out = y;
        CHECK_OK(mha_layer_forward(f.layer, &a, NULL, &err), &err);
        double Q[8][16], K[8][16], V[8][16], A[8][16], ref[8 * 16];
        for (int i = 0; i < n; i++)
            for (int o = 0; o < D; o++) {
                Q[i][o] = K[i][o] = V[i][o] = 0.0;
                for (int c = 0; c < D; c++) {
                    Q[i][o] += (double)x[i * D + c] * (double)f.w_q[o * D + c];
                    K[i][o] += (double)x[i * D + c] * (double)f.w_k[o * D + c];
                    V[i][o] += (double)x[i * D + c] * (double)f.w_v[o * D + c];
                }
            }
        for (int i = 0; i < n; i++) {
            double s[8], mx = -(double)INFINITY, sum = 0.0;
            for (int j = 0; j < n; j++) {
                s[j] = 0.0;
                for (int c = 0; c < D; c++)
                    s[j] += Q[i][c] * K[j][c] / 4.0; /* sqrt(16) */
                mx = fmax(mx, s[j]);
            }
            for (int j = 0; j < n; j++)
                sum += (s[j] = exp(s[j] - mx));
            for (int c = 0; c < D; c++) {
                A[i][c] = 0.0;
                for (int j = 0; j < n; j++)
                    A[i][c] += s[j] / sum * V[j][c];
            }
            for (int o = 0; o < D; o++) {
                ref[i * D + o] = 0.0;
                for (int c = 0; c < D; c++)
                    ref[i * D + o] += A[i][c] * (double)f.w_o[o * D + c];
            }
        }
        const double worst = test_max_abs_diff(y, ref, n * D);
        CHECK(worst <= TOL_OUT_REL * test_max_abs(ref, n * D), "h=1: max diff %.3g", worst);
        layer_free(&f);
    }
}

int main(void) {
    test_philox_known_answers();
    test_core_vs_oracle();
    test_average_probs();
    test_fully_masked_rows();
    test_nan_propagation();
    test_thread_determinism();
    test_dropout_statistics();
    cs336_sdpa("test_scaled_dot_product_attention", 0);
    cs336_sdpa("test_4d_scaled_dot_product_attention", 1);
    cs336_rope();
    test_layer_vs_oracle();
    test_layer_properties();
    return test_finish();
}
