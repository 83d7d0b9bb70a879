/* SPDX-License-Identifier: MIT */
/* kv_quant.c: see kv_quant.h. */
#include "kv_quant.h"

#include "harness.h"
#include "oracle_f64.h"
#include "tolerance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int kvq_same_bits(float a, float b) {
    if (isnan(a) || isnan(b))
        return isnan(a) && isnan(b);
    return memcmp(&a, &b, sizeof a) == 0;
}

void kvq_expect_refused(mha_status st, const mha_error *err, const char *needle, const char *what) {
    CHECK(st != MHA_STATUS_OK, "%s: accepted", what);
    CHECK(strstr(err->message, needle) != NULL, "%s: message '%s' lacks '%s'", what, err->message,
          needle);
}

void kvq_core_args_1x1(mha_attention_args *a, const float *x, float *o) {
    memset(a, 0, sizeof *a);
    a->batch = 1, a->num_heads = 1, a->q_len = 1, a->kv_len = 1, a->head_dim = 64;
    a->q = a->k = a->v = x, a->out = o;
    a->mask.window_left = a->mask.window_right = -1;
}

/* The maxima below are branches, not fmax: an fmax reduction over float values widened to double
 * stops aarch64 gcc 12 at -O3 with an internal compiler error (in vect_transform_reduction). */

double kvq_max_abs(const float *a, int64_t n) {
    double e = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double ai = fabs((double)a[i]);
        if (!(ai <= e))
            e = ai;
    }
    return e;
}

/* max_i |a_i - b_i|, NaN when any difference is NaN (a NaN output then fails every bound). */
static double max_abs_diff(const float *a, const double *b, int64_t n) {
    double e = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double di = fabs((double)a[i] - b[i]);
        if (!(di <= e))
            e = di;
    }
    return e;
}

/* The float64 attention of one query row per head over kk, vv [G, m, d]. */
static void oracle(
    const kvq_case *ac, int64_t m, const float *q, const float *kk, const float *vv, double *out) {
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = 1, a.num_heads = ac->H, a.num_kv_heads = ac->G, a.q_len = 1, a.kv_len = m;
    a.head_dim = ac->d;
    a.q = q, a.k = kk, a.v = vv;
    const int64_t sq[3] = {ac->H * ac->d, ac->d, ac->d},
                  sk[3] = {ac->G * m * ac->d, m * ac->d, ac->d};
    memcpy(a.q_strides, sq, sizeof sq);
    memcpy(a.out_strides, sq, sizeof sq);
    memcpy(a.k_strides, sk, sizeof sk);
    memcpy(a.v_strides, sk, sizeof sk);
    a.mask.window_left = a.mask.window_right = -1;
    CHECK(oracle_attention(&a, out, NULL, NULL) == 0, "oracle");
}

void kvq_check_attention(mha_kv_cache *c,
                         const kvq_case *ac,
                         const float *k,
                         const float *v,
                         const float *q,
                         kvq_bound_fn bound,
                         const void *ctx,
                         const char *label) {
    const int64_t H = ac->H, G = ac->G, d = ac->d, L = ac->L;
    mha_error err;
    for (int64_t t0 = 0; t0 < L; t0 += 50) { /* appends of <= 50 tokens (window: max_step 64) */
        const int64_t n = L - t0 < 50 ? L - t0 : 50;
        CHECK_OK(mha_kv_cache_append(c, 1, NULL, n, k + t0 * G * d, v + t0 * G * d, &err), &err);
    }
    /* read (dequantised) and original K/V of the visible keys as [G, m], their bounds */
    const int64_t m = ac->window > 0 && ac->window < L ? ac->window : L, lo = L - m;
    const size_t nm = (size_t)(m * G * d);
    float *kq = malloc(sizeof(float) * nm), *vq = malloc(sizeof(float) * nm);
    float *ko = malloc(sizeof(float) * nm), *vo = malloc(sizeof(float) * nm);
    double *ek = malloc(sizeof(double) * nm), *ev = malloc(sizeof(double) * nm);
    float *kr = malloc(sizeof(float) * (size_t)(G * d)),
          *vr = malloc(sizeof(float) * (size_t)(G * d));
    float(*out)[128 * 8] = malloc(sizeof *out * 4);
    double *ref = malloc(sizeof(double) * (size_t)(H * d)),
           *refo = malloc(sizeof(double) * (size_t)(H * d));
    CHECK(H * d <= 128 * 8, "kvq_check_attention: H d = %lld > 1024", (long long)(H * d));
    for (int64_t j = 0; j < m; j++) {
        CHECK_OK(mha_kv_cache_read(c, 0, lo + j, kr, vr, &err), &err);
        for (int64_t g = 0; g < G; g++) {
            const size_t at = (size_t)((g * m + j) * d), sz = sizeof(float) * (size_t)d;
            memcpy(kq + at, kr + g * d, sz);
            memcpy(vq + at, vr + g * d, sz);
            memcpy(ko + at, k + ((lo + j) * G + g) * d, sz);
            memcpy(vo + at, v + ((lo + j) * G + g) * d, sz);
            bound(ko + at, d, g, 0, ctx, ek + at);
            bound(vo + at, d, g, 1, ctx, ev + at);
        }
    }
    /* 1: every read value within its stated bound of the original (docs/SEMANTICS.md) */
    int64_t far = 0;
    for (size_t i = 0; i < nm; i++) /* (a branch: aarch64 gcc 12 -O3 fails to vectorise a sum of
                                       comparisons here with an internal compiler error) */
        if (fabs((double)kq[i] - (double)ko[i]) > ek[i] ||
            fabs((double)vq[i] - (double)vo[i]) > ev[i])
            far++;
    CHECK(far == 0, "%s L=%lld: %lld values beyond the per-value bound", label, (long long)L,
          (long long)far);
    /* 2: against the dequantised values */
    oracle(ac, m, q, kq, vq, ref);
    oracle(ac, m, q, ko, vo, refo);
    double sref = 0.0;
    for (int64_t i = 0; i < H * d; i++)
        sref = fabs(ref[i]) > sref ? fabs(ref[i]) : sref;
    const mha_impl impls[2] = {MHA_IMPL_AUTO, MHA_IMPL_REFERENCE};
    double worst_dq = 0.0;
    for (int ii = 0; ii < 2; ii++)
        for (int nt = 1; nt <= 3; nt++) {
            mha_kv_attention_args ka = {0};
            ka.num_seqs = 1, ka.num_tokens = 1, ka.num_heads = H, ka.q = q;
            ka.out = out[nt];
            mha_exec ex = {0};
            ex.impl = impls[ii], ex.n_threads = nt;
            CHECK_OK(mha_kv_cache_attention(c, &ka, &ex, &err), &err);
            const double e = max_abs_diff(out[nt], ref, H * d);
            CHECK(e <= TOL_OUT_REL * sref, "%s L=%lld W=%lld impl=%d nt=%d: vs dequantised %.3g",
                  label, (long long)L, (long long)ac->window, ii, nt, e / sref);
            worst_dq = fmax(worst_dq, e / sref);
            if (nt > 1)
                CHECK(memcmp(out[nt], out[1], sizeof(float) * (size_t)(H * d)) == 0,
                      "%s L=%lld impl=%d: %d threads differ from 1", label, (long long)L, ii, nt);
        }
    /* 3: against the original values, per head */
    const double scale = 1.0 / sqrt((double)d);
    double worst = 0.0;
    for (int64_t h = 0; h < H; h++) {
        const int64_t g = h / (H / G);
        double q1 = 0.0, ekm = 0.0, evm = 0.0, vmax = 0.0;
        for (int64_t i = 0; i < d; i++)
            q1 += fabs((double)q[h * d + i]);
        for (int64_t j = g * m * d; j < (g + 1) * m * d; j++) {
            ekm = fmax(ekm, ek[j]);
            evm = fmax(evm, ev[j]);
        }
        vmax = kvq_max_abs(vo + g * m * d, m * d);
        const double b = expm1(2.0 * scale * q1 * ekm) * vmax + evm + TOL_OUT_REL * sref;
        const double e = max_abs_diff(out[1] + h * d, refo + h * d, d);
        CHECK(e <= b, "%s L=%lld head %lld: vs original %.3g > bound %.3g", label, (long long)L,
              (long long)h, e, b);
        worst = fmax(worst, e / b);
    }
    printf("%s L=%lld W=%lld: vs dequantised %.2g of max|o|; vs original <= %.4f of the bound\n",
           label, (long long)L, (long long)ac->window, worst_dq, worst);
    free(kq), free(vq), free(ko), free(vo), free(ek), free(ev), free(kr), free(vr), free(out);
    free(ref), free(refo);
}
