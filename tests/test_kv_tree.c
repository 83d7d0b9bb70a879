/* SPDX-License-Identifier: MIT */
/* test_kv_tree.c: speculative tree verification through a KV cache (docs/SEMANTICS.md "Draft
 * trees", mha_kv_attention_args.tree_parents, mha_kv_cache_accept).
 *   1. mha_kv_cache_attention with a draft tree against a float64 oracle written here from the
 *      definition (its own ancestor walk, positions by depth, window/chunk rule, ALiBi distances by
 *      position) over the cache's own K/V (mha_kv_cache_read: the dequantised rows): f32, f16,
 *      bf16 and q8_0 caches, GQA, window, chunk, ALiBi, soft-cap, several sequences of different
 *      lengths; 1 and 2 threads bit-identical; a chain written as a tree (parents i - 1) gives
 *      exactly the NULL-tree result. The tier is the one MHA_MAX_ISA allows (ctest runs this file
 *      again with MHA_MAX_ISA=avx2 and generic).
 *   2. mha_layer_decode_step with a tree: every draft's row equals the full causal forward
 *      (impl=reference) of prefix + its root-to-node path, at that path's last row.
 *   3. mha_kv_cache_accept of a path, then one more step, equals decoding the path as a chain and
 *      the same step (cache rows and output bit for bit).
 *   4. Bad trees and bad accepts: clear INVALID_ARG, nothing changed.
 */
#include "harness.h"
#include "oracle_f64.h"
#include "tolerance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- the oracle's view of a tree ---- */

static int64_t depth_of(const int64_t *par, int64_t i) {
    int64_t d = 0;
    for (int64_t x = par[i]; x >= 0; x = par[x])
        d++;
    return d;
}

static int is_ancestor_or_self(const int64_t *par, int64_t a, int64_t i) {
    for (int64_t x = i; x >= 0; x = par[x])
        if (x == a)
            return 1;
    return 0;
}

/* The window / chunk rule between positions (causal: kp <= qp). */
static int rule(int64_t qp, int64_t kp, int64_t W, int64_t C) {
    return kp <= qp && (W == 0 || kp > qp - W) && (C == 0 || kp / C == qp / C);
}

/* ---- 1. attention ---- */

typedef struct tcase {
    const char *name;
    int64_t H, G, d;
    mha_dtype dt;
    int64_t window, chunk;
    int alibi;
    double softcap;
    int64_t S;
    int64_t len[3];
    int64_t t;
    int64_t par[16];
} tcase;

static void test_attention(const tcase *tc) {
    const int64_t H = tc->H, G = tc->G, d = tc->d, S = tc->S, t = tc->t, grp = H / G;
    int64_t max_len = 0;
    for (int64_t s = 0; s < S; s++)
        max_len = tc->len[s] > max_len ? tc->len[s] : max_len;
    mha_kv_cache_config cc = {0};
    cc.num_kv_heads = G, cc.head_dim = d, cc.max_seq = max_len, cc.batch = S;
    cc.dtype = tc->dt, cc.window = tc->window, cc.chunk_size = tc->chunk;
    cc.max_step_tokens = 32;
    mha_kv_cache *c = NULL;
    mha_error err;
    CHECK_OK(mha_kv_cache_create(&cc, NULL, NULL, &c, &err), &err);
    test_rng r;
    test_rng_seed(&r, 1000 + (uint64_t)(t * 7 + tc->window + tc->chunk));
    float *k = malloc(sizeof(float) * (size_t)(32 * G * d)),
          *v = malloc(sizeof(float) * (size_t)(32 * G * d));
    for (int64_t s = 0; s < S; s++)
        for (int64_t p0 = 0; p0 < tc->len[s]; p0 += 32) {
            const int64_t n = tc->len[s] - p0 < 32 ? tc->len[s] - p0 : 32;
            test_fill_normal(&r, k, n * G * d, 1.0f);
            test_fill_normal(&r, v, n * G * d, 1.0f);
            CHECK_OK(mha_kv_cache_append(c, 1, &s, n, k, v, &err), &err);
        }
    const int64_t nq = S * t * H * d;
    float *q = malloc(sizeof(float) * (size_t)nq);
    float *out[3], *lse[3];
    for (int x = 0; x < 3; x++) {
        out[x] = malloc(sizeof(float) * (size_t)nq);
        lse[x] = malloc(sizeof(float) * (size_t)(S * H * t));
    }
    test_fill_normal(&r, q, nq, 1.0f);
    for (int nt = 1; nt <= 2; nt++) {
        mha_kv_attention_args a = {0};
        a.num_seqs = S, a.num_tokens = t, a.num_heads = H, a.q = q, a.out = out[nt];
        a.lse = lse[nt];
        a.alibi = tc->alibi, a.softcap = tc->softcap, a.tree_parents = tc->par;
        mha_exec ex = {0};
        ex.n_threads = nt;
        CHECK_OK(mha_kv_cache_attention(c, &a, &ex, &err), &err);
    }
    CHECK(memcmp(out[1], out[2], sizeof(float) * (size_t)nq) == 0 &&
              memcmp(lse[1], lse[2], sizeof(float) * (size_t)(S * H * t)) == 0,
          "%s: 2 threads differ from 1", tc->name);

    /* the oracle, row by row */
    const double scale = 1.0 / sqrt((double)d);
    float *kr = malloc(sizeof(float) * (size_t)(G * d)),
          *vr = malloc(sizeof(float) * (size_t)(G * d));
    double *ref = calloc((size_t)nq, sizeof(double)),
           *rl = calloc((size_t)(S * H * t), sizeof(double));
    double *sc = malloc(sizeof(double) * (size_t)(max_len * H));
    double *acc = malloc(sizeof(double) * (size_t)d);
    for (int64_t s = 0; s < S; s++) {
        const int64_t L = tc->len[s], base = L - t;
        for (int64_t i = 0; i < t; i++) {
            const int64_t qp = base + depth_of(tc->par, i);
            for (int64_t h = 0; h < H; h++) {
                const int64_t g = h / grp;
                const float *qr = q + ((s * t + i) * H + h) * d;
                double mx = -(double)INFINITY;
                for (int64_t j = 0; j < L; j++) {
                    sc[j] = -(double)INFINITY;
                    int64_t kp = j;
                    if (j >= base) {
                        if (!is_ancestor_or_self(tc->par, j - base, i))
                            continue;
                        kp = base + depth_of(tc->par, j - base);
                    }
                    if (!rule(qp, kp, tc->window, tc->chunk))
                        continue;
                    CHECK_OK(mha_kv_cache_read(c, s, j, kr, NULL, &err), &err);
                    double dot = 0.0;
                    for (int64_t e = 0; e < d; e++)
                        dot += (double)qr[e] * (double)kr[g * d + e];
                    double x = scale * dot;
                    if (tc->softcap > 0.0)
                        x = tc->softcap * tanh(x / tc->softcap);
                    if (tc->alibi)
                        x -= oracle_alibi_slope(H, h) * (double)(qp - kp);
                    sc[j] = x;
                    mx = x > mx ? x : mx;
                }
                double sum = 0.0;
                for (int64_t e = 0; e < d; e++)
                    acc[e] = 0.0;
                for (int64_t j = 0; j < L; j++) {
                    if (sc[j] == -(double)INFINITY)
                        continue;
                    const double w = exp(sc[j] - mx);
                    sum += w;
                    CHECK_OK(mha_kv_cache_read(c, s, j, NULL, vr, &err), &err);
                    for (int64_t e = 0; e < d; e++)
                        acc[e] += w * (double)vr[g * d + e];
                }
                for (int64_t e = 0; e < d; e++)
                    ref[((s * t + i) * H + h) * d + e] = acc[e] / sum;
                rl[(s * H + h) * t + i] = mx + log(sum);
            }
        }
    }
    const double sref = test_max_abs(ref, nq);
    const double e = test_max_abs_diff(out[1], ref, nq);
    double el = 0.0;
    for (int64_t x = 0; x < S * H * t; x++)
        el = fmax(el, fabs((double)lse[1][x] - rl[x]) / fmax(1.0, fabs(rl[x])));
    CHECK(e <= TOL_OUT_REL * sref, "%s: out vs float64 oracle %.3g (rel)", tc->name, e / sref);
    CHECK(el <= TOL_OUT_REL, "%s: lse vs float64 oracle %.3g", tc->name, el);
    printf("%-28s out err %.3g rel, lse err %.3g\n", tc->name, e / sref, el);

    /* a chain written as a tree is today's chain, bit for bit */
    int64_t chain[16];
    for (int64_t i = 0; i < t; i++)
        chain[i] = i - 1;
    for (int x = 0; x < 2; x++) {
        mha_kv_attention_args a = {0};
        a.num_seqs = S, a.num_tokens = t, a.num_heads = H, a.q = q, a.out = out[x];
        a.alibi = tc->alibi, a.softcap = tc->softcap, a.tree_parents = x ? chain : NULL;
        CHECK_OK(mha_kv_cache_attention(c, &a, NULL, &err), &err);
    }
    CHECK(memcmp(out[0], out[1], sizeof(float) * (size_t)nq) == 0,
          "%s: a chain tree differs from NULL tree_parents", tc->name);
    for (int x = 0; x < 3; x++)
        free(out[x]), free(lse[x]);
    free(k), free(v), free(q), free(kr), free(vr), free(ref), free(rl), free(sc), free(acc);
    mha_kv_cache_destroy(c);
}

/* ---- 2 and 3. the layer ---- */

#define E  64
#define NH 4
#define NG 2
#define DK 16
#define P  37
#define NS 2

static mha_layer *make_layer(int alibi, uint64_t seed) {
    test_rng r;
    test_rng_seed(&r, seed);
    mha_config c = {0};
    c.q_dim = E, c.num_heads = NH, c.num_kv_heads = NG, c.head_dim = DK;
    c.alibi = alibi;
    c.rope.style = alibi ? MHA_ROPE_NONE : MHA_ROPE_HALF;
    static float wq[NH * DK * E], wk[NG * DK * E], wv[NG * DK * E], wo[E * NH * DK];
    test_fill_normal(&r, wq, NH * DK * E, 2.0f / sqrtf((float)E));
    test_fill_normal(&r, wk, NG * DK * E, 2.0f / sqrtf((float)E));
    test_fill_normal(&r, wv, NG * DK * E, 1.0f / sqrtf((float)E));
    test_fill_normal(&r, wo, E * NH * DK, 1.0f / sqrtf((float)(NH * DK)));
    mha_weights w = {0};
    w.w_q = wq, w.w_k = wk, w.w_v = wv, w.w_o = wo;
    mha_layer *L = NULL;
    mha_error err;
    CHECK_OK(mha_layer_create(&c, &w, MHA_WEIGHTS_COPY, NULL, &L, &err), &err);
    return L;
}

static void forward(const mha_layer *L, int64_t n, const float *x, float *y, int64_t window) {
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.batch = 1, a.q_len = n, a.query = x, a.out = y;
    a.mask.causal = 1;
    a.mask.window_left = a.mask.window_right = -1;
    if (window > 0)
        a.mask.use_window = 1, a.mask.window_left = window - 1;
    mha_exec ex = {0};
    ex.impl = MHA_IMPL_REFERENCE;
    mha_error err;
    CHECK_OK(mha_layer_forward(L, &a, &ex, &err), &err);
}

static void test_layer(int alibi, int64_t window, mha_dtype dt) {
    const int64_t par[8] = {-1, 0, 0, 1, 1, 2, -1, 6}, t = 8, S = NS;
    mha_layer *L = make_layer(alibi, 77);
    mha_kv_cache_config cc = {0};
    cc.max_seq = 128, cc.batch = S, cc.dtype = dt, cc.window = window, cc.max_step_tokens = 16;
    mha_kv_cache *c = NULL, *c2 = NULL;
    mha_error err;
    CHECK_OK(mha_kv_cache_create(&cc, L, NULL, &c, &err), &err);
    CHECK_OK(mha_kv_cache_create(&cc, L, NULL, &c2, &err), &err);
    test_rng r;
    test_rng_seed(&r, 5);
    /* sequence s: a prefix of P + 5 s tokens, then the tree's 8 drafts */
    static float xp[NS * (P + 5) * E], xd[NS * 8 * E], yd[NS * 8 * E], ypre[(P + 5) * E];
    static float xf[(P + 5 + 8) * E], yf[(P + 5 + 8) * E];
    test_fill_normal(&r, xp, S * (P + 5) * E, 1.0f);
    test_fill_normal(&r, xd, S * 8 * E, 1.0f);
    for (int64_t s = 0; s < S; s++) {
        mha_decode_args a = {1, &s, P + 5 * s, xp + s * (P + 5) * E, ypre, NULL};
        CHECK_OK(mha_layer_prefill(L, c, &a, NULL, &err), &err);
    }
    mha_decode_args a = {S, NULL, t, xd, yd, par};
    mha_exec ex = {0};
    ex.n_threads = 2;
    CHECK_OK(mha_layer_decode_step(L, c, &a, &ex, &err), &err);
    const double tol = dt == MHA_DTYPE_BF16  ? TOL_KV_BF16_REL
                       : dt == MHA_DTYPE_F16 ? TOL_KV_F16_REL
                                             : TOL_OUT_REL;
    double worst = 0.0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t np = P + 5 * s;
        for (int64_t i = 0; i < t; i++) { /* prefix + root..i, forward, last row */
            int64_t path[8], n = 0;
            for (int64_t x = i; x >= 0; x = par[x])
                path[n++] = x;
            memcpy(xf, xp + s * (P + 5) * E, sizeof(float) * (size_t)(np * E));
            for (int64_t k = 0; k < n; k++)
                memcpy(xf + (np + k) * E, xd + (s * t + path[n - 1 - k]) * E, sizeof(float) * E);
            forward(L, np + n, xf, yf, window);
            double e = 0.0, m = 0.0;
            for (int64_t x = 0; x < E; x++) {
                e = fmax(e,
                         fabs((double)yd[(s * t + i) * E + x] - (double)yf[(np + n - 1) * E + x]));
                m = fmax(m, fabs((double)yf[(np + n - 1) * E + x]));
            }
            CHECK(e <= tol * m, "layer alibi=%d W=%lld dt=%d: seq %lld draft %lld: %.3g rel", alibi,
                  (long long)window, (int)dt, (long long)s, (long long)i, e / m);
            worst = fmax(worst, e / m);
        }
    }
    printf("layer tree alibi=%d W=%lld dtype=%d: worst %.3g rel vs the path's full forward\n",
           alibi, (long long)window, (int)dt, worst);

    /* 3. accept path 0 -> 2 -> 5 of sequence 1 (and nothing of sequence 0), one more step */
    const int64_t acc[3] = {0, 2, 5};
    const int64_t s1 = 1, s0 = 0, np1 = P + 5;
    /* the drafts' rows before the accept: the accept moves them bit for bit */
    static float kd[3][NG * DK], vd[3][NG * DK], k1[NG * DK], v1[NG * DK], k2[NG * DK], v2[NG * DK];
    for (int64_t k = 0; k < 3; k++)
        CHECK_OK(mha_kv_cache_read(c, s1, np1 + acc[k], kd[k], vd[k], &err), &err);
    CHECK_OK(mha_kv_cache_accept(c, s1, np1, 3, acc, &err), &err);
    CHECK_OK(mha_kv_cache_accept(c, s0, P, 0, NULL, &err), &err);
    CHECK(mha_kv_cache_length(c, s1) == np1 + 3 && mha_kv_cache_length(c, s0) == P, "lengths");
    int moved = 1;
    for (int64_t k = 0; k < 3; k++) {
        CHECK_OK(mha_kv_cache_read(c, s1, np1 + k, k1, v1, &err), &err);
        moved &= memcmp(k1, kd[k], sizeof k1) == 0 && memcmp(v1, vd[k], sizeof v1) == 0;
    }
    CHECK(moved, "accept: the accepted rows are not the drafts' rows");
    /* the same through c2: prefixes, then the path as a chain (its projections run over other
     * row counts, so equal within float32 rounding, not bit for bit) */
    static float xc[3 * E], yc[3 * E];
    for (int64_t s = 0; s < S; s++) {
        mha_decode_args b = {1, &s, P + 5 * s, xp + s * (P + 5) * E, ypre, NULL};
        CHECK_OK(mha_layer_prefill(L, c2, &b, NULL, &err), &err);
    }
    for (int64_t k = 0; k < 3; k++)
        memcpy(xc + k * E, xd + (s1 * t + acc[k]) * E, sizeof(float) * E);
    mha_decode_args b = {1, &s1, 3, xc, yc, NULL};
    CHECK_OK(mha_layer_decode_step(L, c2, &b, NULL, &err), &err);
    double ek = 0.0, mk = 0.0;
    for (int64_t s = 0; s < S; s++)
        for (int64_t p = 0; p < mha_kv_cache_length(c2, s); p++) {
            if (window > 0 && p < mha_kv_cache_length(c2, s) - window)
                continue;
            CHECK_OK(mha_kv_cache_read(c, s, p, k1, v1, &err), &err);
            CHECK_OK(mha_kv_cache_read(c2, s, p, k2, v2, &err), &err);
            for (int64_t x = 0; x < NG * DK; x++) {
                ek = fmax(ek, fmax(fabs((double)k1[x] - (double)k2[x]),
                                   fabs((double)v1[x] - (double)v2[x])));
                mk = fmax(mk, fmax(fabs((double)k2[x]), fabs((double)v2[x])));
            }
        }
    CHECK(ek <= tol * mk, "accept (alibi=%d W=%lld): cache rows vs the path decoded directly %.3g",
          alibi, (long long)window, ek / mk);
    static float xn[NS * E], yn1[NS * E], yn2[NS * E];
    test_fill_normal(&r, xn, S * E, 1.0f);
    mha_decode_args n1 = {S, NULL, 1, xn, yn1, NULL}, n2 = {S, NULL, 1, xn, yn2, NULL};
    CHECK_OK(mha_layer_decode_step(L, c, &n1, NULL, &err), &err);
    CHECK_OK(mha_layer_decode_step(L, c2, &n2, NULL, &err), &err);
    double en = 0.0, mn = 0.0;
    for (int64_t x = 0; x < S * E; x++) {
        en = fmax(en, fabs((double)yn1[x] - (double)yn2[x]));
        mn = fmax(mn, fabs((double)yn2[x]));
    }
    CHECK(en <= tol * mn, "accept + step vs the path + step: %.3g", en / mn);
    printf("accept alibi=%d W=%lld: rows %.3g rel, next step %.3g rel\n", alibi, (long long)window,
           ek / mk, en / mn);
    mha_kv_cache_destroy(c);
    mha_kv_cache_destroy(c2);
    mha_layer_destroy(L);
}

/* ---- 4. hostile ---- */

static void expect_invalid(mha_status st, const mha_error *err, const char *what) {
    CHECK(st == MHA_STATUS_INVALID_ARG, "%s: status %d (%s)", what, (int)st, err->message);
}

static void test_hostile(void) {
    mha_kv_cache_config cc = {0};
    cc.num_kv_heads = 1, cc.head_dim = 8, cc.max_seq = 64, cc.batch = 1;
    mha_kv_cache *c = NULL;
    mha_error err;
    CHECK_OK(mha_kv_cache_create(&cc, NULL, NULL, &c, &err), &err);
    float k[20 * 8] = {0}, q[20 * 8] = {0}, o[20 * 8];
    CHECK_OK(mha_kv_cache_append(c, 1, NULL, 20, k, k, &err), &err);
    const int64_t self[2] = {-1, 1}, below[2] = {-1, -2}, fwd[3] = {-1, 2, 0};
    int64_t big[17];
    for (int i = 0; i < 17; i++)
        big[i] = i - 1;
    const int64_t *bad[4] = {self, below, fwd, big};
    const int64_t bt[4] = {2, 2, 3, 17};
    for (int x = 0; x < 4; x++) {
        mha_kv_attention_args a = {0};
        a.num_seqs = 1, a.num_tokens = bt[x], a.num_heads = 1, a.q = q, a.out = o;
        a.tree_parents = bad[x];
        expect_invalid(mha_kv_cache_attention(c, &a, NULL, &err), &err, "bad tree");
    }
    const int64_t dup[2] = {1, 1}, neg[1] = {-1}, past[1] = {5};
    expect_invalid(mha_kv_cache_accept(c, 0, 16, 2, dup, &err), &err, "accept: not increasing");
    expect_invalid(mha_kv_cache_accept(c, 0, 16, 1, neg, &err), &err, "accept: negative");
    expect_invalid(mha_kv_cache_accept(c, 0, 16, 1, past, &err), &err, "accept: past the length");
    expect_invalid(mha_kv_cache_accept(c, 0, 16, 5, past, &err), &err, "accept: n too large");
    expect_invalid(mha_kv_cache_accept(c, 0, 21, 0, NULL, &err), &err, "accept: base_len");
    expect_invalid(mha_kv_cache_accept(c, 0, 16, 1, NULL, &err), &err, "accept: NULL");
    expect_invalid(mha_kv_cache_accept(c, 1, 16, 0, NULL, &err), &err, "accept: bad seq");
    CHECK(mha_kv_cache_length(c, 0) == 20, "a refused accept changed the length");
    mha_kv_cache_destroy(c);
}

int main(void) {
    const tcase cases[] = {
        {"f32 gqa 1 seq",
         8,
         2,
         64,
         MHA_DTYPE_F32,
         0,
         0,
         0,
         0.0,
         1,
         {700},
         8,
         {-1, 0, 0, 1, 1, 2, 2, 3}},
        {"f32 3 seqs roots",
         4,
         4,
         32,
         MHA_DTYPE_F32,
         0,
         0,
         0,
         0.0,
         3,
         {300, 9, 513},
         9,
         {-1, -1, 0, 1, -1, 4, 2, 6, 3}},
        {"f16 alibi softcap",
         8,
         1,
         64,
         MHA_DTYPE_F16,
         0,
         0,
         1,
         20.0,
         2,
         {260, 777},
         6,
         {-1, -1, -1, 2, 0, 3}},
        {"bf16 window",
         8,
         2,
         64,
         MHA_DTYPE_BF16,
         5,
         0,
         1,
         0.0,
         2,
         {400, 31},
         8,
         {-1, 0, 1, 2, 3, 4, 0, 6}},
        {"q8_0 gqa",
         8,
         2,
         64,
         MHA_DTYPE_Q8_0,
         0,
         0,
         0,
         0.0,
         2,
         {600, 70},
         16,
         {-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7}},
        {"f32 chunk alibi",
         4,
         2,
         32,
         MHA_DTYPE_F32,
         0,
         6,
         1,
         0.0,
         2,
         {302, 203},
         7,
         {-1, 0, 1, 2, 3, 0, 5}},
        {"q8_0 window 2 seqs",
         4,
         2,
         64,
         MHA_DTYPE_Q8_0,
         260,
         0,
         1,
         0.0,
         2,
         {900, 330},
         5,
         {-1, 0, 0, 2, -1}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        test_attention(&cases[i]);
    test_layer(0, 0, MHA_DTYPE_F32);
    test_layer(1, 0, MHA_DTYPE_F32);
    test_layer(0, 20, MHA_DTYPE_BF16);
    test_hostile();
    return test_finish();
}
