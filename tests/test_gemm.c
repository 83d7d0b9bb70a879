/* SPDX-License-Identifier: MIT */
/* test_gemm.c: the projection GEMM (src/kernels/gemm.c) against a float64 loop, for every kernel
 * tier this CPU can run (generic, avx2, avx512 are each forced through the `isa` argument).
 *
 * Tolerance: y[i][o] = b[o] + sum_k x[i][k] W[o][k] is a sum of K+1 terms computed in float32 in
 * some order (one FMA or mul+add chain per K block, blocks added in order, bias first). The
 * classical bound for any such summation (Higham, Accuracy and Stability, eq. 3.5) is
 *   |y - y*| <= gamma_{K+1} (|b[o]| + sum_k |x[i][k] W[o][k]|),  gamma_n = n u / (1 - n u),
 * with u = 2^-24 (the products' own rounding is included). It is checked per element with no
 * fudge factor; typical errors are ~sqrt(K) smaller and the max ratio is printed.
 * Also: guard zones and row-stride gaps are never written, inputs are not modified, and results
 * are bit-identical for 1, 2, 3 and 4 threads (threads split rows or columns, never K). Calls with
 * M <= MHA_GEMM_SMALL_M take the unpacked dot path; both paths are covered. MHA_TEST_QUICK=1
 * (the sanitizer run) checks 1 and 3 threads only.
 * A line whose dtypes lack F32 (the vdpbf16ps pair kernel, bf16 x and W only) refuses float32
 * operands and runs the same shapes on bf16 operands (mha__gemm_run_dt) against float64 on the
 * same bf16 values, at the same gamma_{K+1} bound: the bf16 products are exact in float32 and
 * only the order of the K additions (in pairs) differs; DAZ/FTZ does not matter for these
 * normal-sized values.
 */
#include "harness.h"
#include "kernels/registry.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GUARD 64
static const uint32_t CANARY = 0x7fc0dead; /* a NaN bit pattern no computation produces */

typedef struct shape {
    int64_t M, N, K;
    int64_t ldx_pad, ldy_pad; /* extra elements per row (strided views) */
} shape;

static float *alloc_canary(int64_t n) {
    float *p = malloc(sizeof(float) * (size_t)(n + 2 * GUARD));
    for (int64_t i = 0; i < n + 2 * GUARD; i++)
        memcpy(&p[i], &CANARY, 4);
    return p;
}

static int64_t canary_damage(const float *p, int64_t lo, int64_t hi) {
    int64_t bad = 0;
    for (int64_t i = lo; i < hi; i++) {
        uint32_t u;
        memcpy(&u, &p[i], 4);
        bad += u != CANARY;
    }
    return bad;
}

static double worst_ratio_seen = 0.0;

/* The i-th GEMM line of the kernel registry (the tiers, best first), NULL past the last. */
static const mha__kernel_info *gemm_tier(int i) {
    for (int r = 0; r < mha__registry_count(); r++) {
        const mha__kernel_info *k = mha__registry_at(r);
        if (k->op == MHA__OP_gemm && i-- == 0)
            return k;
    }
    return NULL;
}

/* Runs one shape on one tier with the given thread counts; checks accuracy on the first. */
static void run_case(test_rng *rng,
                     const shape *s,
                     int with_bias,
                     mha__gemm_isa isa,
                     const int *threads,
                     int n_counts) {
    const int64_t M = s->M, N = s->N, K = s->K;
    const int64_t ldx = K + s->ldx_pad, ldy = N + s->ldy_pad;
    const int64_t nx = M * ldx, nw = N * K, ny = M * ldy;
    float *x = malloc(sizeof(float) * (size_t)(nx > 0 ? nx : 1));
    float *w = malloc(sizeof(float) * (size_t)(nw > 0 ? nw : 1));
    float *b = with_bias ? malloc(sizeof(float) * (size_t)N) : NULL;
    test_fill_normal(rng, x, nx, 1.0f);
    test_fill_normal(rng, w, nw, 0.5f);
    if (b)
        test_fill_normal(rng, b, N, 1.0f);
    float *x0 = malloc(sizeof(float) * (size_t)(nx > 0 ? nx : 1));
    float *w0 = malloc(sizeof(float) * (size_t)(nw > 0 ? nw : 1));
    memcpy(x0, x, sizeof(float) * (size_t)nx);
    memcpy(w0, w, sizeof(float) * (size_t)nw);

    float *first = NULL;
    const char *iname = isa->name;
    for (int c = 0; c < n_counts; c++) {
        float *yb = alloc_canary(ny);
        float *y = yb + GUARD;
        mha_error err = {0};
        mha_status st = mha__gemm_xwt(M, N, K, x, ldx, w, K, b, y, ldy, mha__team_of(threads[c]),
                                      isa, NULL, &err);
        CHECK(st == MHA_STATUS_OK, "gemm %s %lldx%lldx%lld: %s", iname, (long long)M, (long long)N,
              (long long)K, err.message);
        /* Guards and the stride gaps (columns N .. ldy-1) untouched. */
        int64_t bad = canary_damage(yb, 0, GUARD) + canary_damage(yb, GUARD + ny, ny + 2 * GUARD);
        for (int64_t i = 0; i < M; i++)
            bad += canary_damage(y, i * ldy + N, i * ldy + ldy);
        CHECK(bad == 0, "gemm %s %lldx%lldx%lld ldy=%lld: %lld guard floats overwritten", iname,
              (long long)M, (long long)N, (long long)K, (long long)ldy, (long long)bad);
        if (c == 0) {
            /* Accuracy against float64, element by element. */
            const double u = ldexp(1.0, -24), n1 = (double)(K + 1);
            const double gamma = n1 * u / (1.0 - n1 * u);
            double worst = 0.0;
            int64_t nfail = 0, wi = 0, wo = 0;
            for (int64_t i = 0; i < M; i++)
                for (int64_t o = 0; o < N; o++) {
                    double ref = b ? (double)b[o] : 0.0, mag = b ? fabs((double)b[o]) : 0.0;
                    for (int64_t k = 0; k < K; k++) {
                        const double t = (double)x[i * ldx + k] * (double)w[o * K + k];
                        ref += t;
                        mag += fabs(t);
                    }
                    const double e = fabs((double)y[i * ldy + o] - ref);
                    const double bound = gamma * mag;
                    if (!(e <= bound))
                        nfail++;
                    const double r = bound > 0 ? e / bound : (e > 0 ? (double)INFINITY : 0.0);
                    if (r > worst || r != r) {
                        worst = r;
                        wi = i;
                        wo = o;
                    }
                }
            CHECK(nfail == 0,
                  "gemm %s %lldx%lldx%lld bias=%d: %lld elements beyond gamma_{K+1} bound, "
                  "worst error/bound=%.3g at (%lld,%lld)",
                  iname, (long long)M, (long long)N, (long long)K, with_bias, (long long)nfail,
                  worst, (long long)wi, (long long)wo);
            if (worst > worst_ratio_seen)
                worst_ratio_seen = worst;
            first = yb;
        } else {
            /* Bit-identical to the first thread count. */
            int64_t diff = 0;
            for (int64_t i = 0; i < M; i++)
                diff +=
                    memcmp(first + GUARD + i * ldy, y + i * ldy, sizeof(float) * (size_t)N) != 0;
            CHECK(diff == 0,
                  "gemm %s %lldx%lldx%lld: %d threads differ from %d threads in %lld rows", iname,
                  (long long)M, (long long)N, (long long)K, threads[c], threads[0],
                  (long long)diff);
            free(yb);
        }
    }
    CHECK(memcmp(x, x0, sizeof(float) * (size_t)nx) == 0 &&
              memcmp(w, w0, sizeof(float) * (size_t)nw) == 0,
          "gemm %s %lldx%lldx%lld modified its inputs", iname, (long long)M, (long long)N,
          (long long)K);
    free(first);
    free(x);
    free(w);
    free(b);
    free(x0);
    free(w0);
}

/* run_case for a pair kernel: x [M, ldx] and W [N, K] stored as bf16 (rounded from normal
 * values), y float32; float64 on the same bf16 values at the gamma_{K+1} bound; bit-identical
 * for every thread count; guards untouched. Float32 operands are refused by name. */
static void run_case_bf16(test_rng *rng,
                          const shape *s,
                          int with_bias,
                          mha__gemm_isa isa,
                          const int *threads,
                          int n_counts) {
    const int64_t M = s->M, N = s->N, K = s->K;
    const int64_t ldx = K + s->ldx_pad, ldy = N + s->ldy_pad;
    const int64_t nx = M * ldx, nw = N * K, ny = M * ldy;
    float *xf = malloc(sizeof(float) * (size_t)(nx + 1)),
          *wf = malloc(sizeof(float) * (size_t)(nw + 1));
    uint16_t *x = malloc(2 * (size_t)(nx + 1)), *w = malloc(2 * (size_t)(nw + 1));
    float *b = with_bias ? malloc(sizeof(float) * (size_t)N) : NULL;
    test_fill_normal(rng, xf, nx, 1.0f);
    test_fill_normal(rng, wf, nw, 0.5f);
    if (b)
        test_fill_normal(rng, b, N, 1.0f);
    mha__narrow(MHA_DTYPE_BF16, xf, x, nx);
    mha__narrow(MHA_DTYPE_BF16, wf, w, nw);
    mha__widen(MHA_DTYPE_BF16, x, xf, nx); /* the values the kernel multiplies */
    mha__widen(MHA_DTYPE_BF16, w, wf, nw);
    float *first = NULL;
    for (int c = 0; c < n_counts; c++) {
        float *yb = alloc_canary(ny);
        float *y = yb + GUARD;
        mha_error err = {0};
        CHECK_OK(mha__gemm_run_dt(MHA__GEMM_OP_N, M, N, K, x, MHA_DTYPE_BF16, ldx, w,
                                  MHA_DTYPE_BF16, K, b, y, ldy, mha__team_of(threads[c]), isa, NULL,
                                  0, NULL, &err),
                 &err);
        int64_t bad = canary_damage(yb, 0, GUARD) + canary_damage(yb, GUARD + ny, ny + 2 * GUARD);
        for (int64_t i = 0; i < M; i++)
            bad += canary_damage(y, i * ldy + N, i * ldy + ldy);
        CHECK(bad == 0, "gemm %s bf16 %lldx%lldx%lld: %lld guard floats overwritten", isa->name,
              (long long)M, (long long)N, (long long)K, (long long)bad);
        if (c == 0) {
            const double u = ldexp(1.0, -24), n1 = (double)(K + 1);
            const double gamma = n1 * u / (1.0 - n1 * u);
            int64_t nfail = 0;
            double worst = 0.0;
            for (int64_t i = 0; i < M; i++)
                for (int64_t o = 0; o < N; o++) {
                    double ref = b ? (double)b[o] : 0.0, mag = b ? fabs((double)b[o]) : 0.0;
                    for (int64_t k = 0; k < K; k++) {
                        const double t = (double)xf[i * ldx + k] * (double)wf[o * K + k];
                        ref += t;
                        mag += fabs(t);
                    }
                    const double e = fabs((double)y[i * ldy + o] - ref), bound = gamma * mag;
                    nfail += !(e <= bound);
                    const double r = bound > 0 ? e / bound : (e > 0 ? (double)INFINITY : 0.0);
                    worst = r > worst || r != r ? r : worst;
                }
            CHECK(nfail == 0,
                  "gemm %s bf16 %lldx%lldx%lld bias=%d: %lld elements beyond gamma_{K+1} bound, "
                  "worst error/bound=%.3g",
                  isa->name, (long long)M, (long long)N, (long long)K, with_bias, (long long)nfail,
                  worst);
            if (worst > worst_ratio_seen)
                worst_ratio_seen = worst;
            first = yb;
        } else {
            int64_t diff = 0;
            for (int64_t i = 0; i < M; i++)
                diff +=
                    memcmp(first + GUARD + i * ldy, y + i * ldy, sizeof(float) * (size_t)N) != 0;
            CHECK(diff == 0, "gemm %s bf16 %lldx%lldx%lld: %d threads differ from %d in %lld rows",
                  isa->name, (long long)M, (long long)N, (long long)K, threads[c], threads[0],
                  (long long)diff);
            free(yb);
        }
    }
    if (M > 0 && N > 0 && K > 0) {
        mha_error err = {0};
        float *y = malloc(sizeof(float) * (size_t)ny);
        CHECK(mha__gemm_xwt(M, N, K, xf, ldx, wf, K, b, y, ldy, mha__team_of(1), isa, NULL, &err) ==
                      MHA_STATUS_INVALID_ARG &&
                  strstr(err.message, isa->name),
              "%s must refuse float32 operands by name", isa->name);
        CHECK(mha__gemm_run_dt(MHA__GEMM_OP_N, M, N, K, x, MHA_DTYPE_BF16, ldx, xf, MHA_DTYPE_F32,
                               K, b, y, ldy, mha__team_of(1), isa, NULL, 0, NULL,
                               &err) == MHA_STATUS_INVALID_ARG,
              "%s must refuse a float32 W", isa->name);
        free(y);
    }
    free(first);
    free(xf), free(wf), free(x), free(w), free(b);
}

/* Transposed operands (mha__gemm_op_run) give exactly the bits of the plain layout on explicit
 * transposed copies, on every tier and for 1 and 3 threads: the packers change, not the sums. */
static void test_transposed_operands(test_rng *rng) {
    const int64_t sizes[][3] = {{1, 1, 1}, {15, 33, 257}, {2, 3, 5}, {200, 129, 96}, {5, 70, 600}};
    for (int tier = 0; gemm_tier(tier); tier++) {
        const mha__gemm_isa isa = gemm_tier(tier);
        if (!mha__kernel_usable(isa, 1) || !(isa->dtypes & MHA_DTS_F32))
            continue; /* a pair kernel packs row-major bf16 only */
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
            const int64_t M = sizes[s][0], N = sizes[s][1], K = sizes[s][2];
            float *x = malloc(sizeof(float) * M * K), *xt = malloc(sizeof(float) * M * K);
            float *w = malloc(sizeof(float) * N * K), *wt = malloc(sizeof(float) * N * K);
            float *y0 = malloc(sizeof(float) * M * N), *y1 = malloc(sizeof(float) * M * N);
            test_fill_normal(rng, x, M * K, 1.0f);
            test_fill_normal(rng, w, N * K, 1.0f);
            for (int64_t i = 0; i < M; i++)
                for (int64_t k = 0; k < K; k++)
                    xt[k * M + i] = x[i * K + k];
            for (int64_t j = 0; j < N; j++)
                for (int64_t k = 0; k < K; k++)
                    wt[k * N + j] = w[j * K + k];
            mha_error err = {0};
            /* The plain layout on the packed path: for M <= MHA_GEMM_SMALL_M (which the plain
             * layout runs as dot products) on x padded with zero rows to one row more; each row
             * of y is its own chain, so the first M rows are the reference. */
            const int64_t Mp = M > MHA_GEMM_SMALL_M ? M : MHA_GEMM_SMALL_M + 1;
            float *xp = calloc((size_t)(Mp * K), sizeof(float));
            float *yp = malloc(sizeof(float) * Mp * N);
            memcpy(xp, x, sizeof(float) * M * K);
            CHECK_OK(mha__gemm_op_run(MHA__GEMM_OP_N, Mp, N, K, xp, K, w, K, yp, N, mha__team_of(1),
                                      isa, NULL, &err),
                     &err);
            memcpy(y0, yp, sizeof(float) * M * N);
            free(xp), free(yp);
            const int ops[3] = {MHA__GEMM_X_T, MHA__GEMM_W_T, MHA__GEMM_X_T | MHA__GEMM_W_T};
            for (int o = 0; o < 3; o++)
                for (int t = 1; t <= 3; t += 2) {
                    const int xt_on = ops[o] & MHA__GEMM_X_T, wt_on = ops[o] & MHA__GEMM_W_T;
                    memset(y1, 0, sizeof(float) * M * N);
                    CHECK_OK(mha__gemm_op_run((mha__gemm_op)ops[o], M, N, K, xt_on ? xt : x,
                                              xt_on ? M : K, wt_on ? wt : w, wt_on ? N : K, y1, N,
                                              mha__team_of(t), isa, NULL, &err),
                             &err);
                    int same = 1;
                    for (int64_t i = 0; i < M * N; i++)
                        same &= y0[i] == y1[i];
                    CHECK(same, "%s op %d %lldx%lldx%lld threads %d: differs from the plain layout",
                          isa->name, ops[o], (long long)M, (long long)N, (long long)K, t);
                }
            free(x), free(xt), free(w), free(wt), free(y0), free(y1);
        }
    }
}

int main(void) {
    test_rng rng;
    test_rng_seed(&rng, 20240603);
    /* Tails of every tile size in use (MR 4/6/14, NR 16/32, KC 256): 1x1, odd sizes, one past and
     * one short of each, K spanning several K blocks, strided x and y, K = 0. */
    const shape shapes[] = {
        {1, 1, 1, 0, 0},
        {1, 1, 7, 0, 0},
        {3, 5, 2, 0, 0},
        {2, 3, 0, 0, 0},
        {14, 32, 256, 0, 0},
        {15, 33, 257, 0, 0},
        {13, 31, 255, 0, 0},
        {6, 16, 8, 0, 0},
        {7, 17, 9, 0, 0},
        {5, 15, 7, 0, 0},
        {4, 48, 33, 0, 0},
        {29, 65, 513, 0, 0},
        {1, 100, 300, 0, 0},
        {100, 1, 300, 0, 0},
        {37, 70, 129, 5, 3},
        {28, 64, 64, 1, 16},
        {57, 40, 600, 0, 0},
        {200, 129, 96, 0, 0},
        {3, 1000, 40, 0, 0},
        {1030, 9, 20, 0, 0},
        /* M <= MHA_GEMM_SMALL_M takes the unpacked dot path: K tails of 8/16/32, strides. */
        {2, 37, 45, 3, 5},
        {4, 5, 33, 0, 0},
        {1, 9, 31, 1, 1},
        {3, 3, 64, 0, 0},
        {1, 1, 1000, 0, 0},
        {2, 6, 17, 0, 2},
    };
    /* Large enough that every thread count really splits the work (rows, then columns). */
    const shape thread_shapes[] = {
        {301, 203, 517, 0, 0},
        {5, 1100, 900, 0, 0},
        {64, 96, 1000, 3, 5},
        {3, 1500, 1200, 0, 0}, /* dot path, split over columns */
    };
    const int one[] = {1};
    const int counts[] = {1, 2, 3, 4};
    /* MHA_TEST_QUICK=1 (sanitizer runs): 1 and 3 threads only. */
    const int quick = test_quick();
    const int quick_counts[] = {1, 3};
    int tiers = 0;
    const mha__kernel_info *generic = NULL;
    for (int t = 0; gemm_tier(t); t++) {
        const mha__gemm_isa isa = gemm_tier(t);
        const mha__gemm_kernel *kr = isa->run.gemm;
        /* The registry line's p1, p2 are the kernel's register tile (written in both places). */
        CHECK(kr->mr == isa->bq && kr->nr == isa->bk,
              "%s: registry says %dx%d, the kernel is %dx%d", isa->name, isa->bq, isa->bk, kr->mr,
              kr->nr);
        if (!isa->isa)
            generic = isa;
        if (!mha__kernel_usable(isa, 1)) {
            printf("skip: %s GEMM kernel not usable on this CPU\n", isa->name);
            continue;
        }
        if (!(isa->dtypes & MHA_DTS_F32)) { /* the pair kernel: bf16 operands */
            printf("tier %s (bf16 x and W): MR=%d NR=%d KC=%lld NC=%lld\n", isa->name, kr->mr,
                   kr->nr, (long long)kr->kc, (long long)kr->nc);
            for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
                for (int bias = 0; bias < 2; bias++)
                    run_case_bf16(&rng, &shapes[s], bias, isa, one, 1);
            for (size_t s = 0; s < sizeof thread_shapes / sizeof thread_shapes[0]; s++)
                run_case_bf16(&rng, &thread_shapes[s], (int)(s & 1), isa,
                              quick ? quick_counts : counts, quick ? 2 : 4);
            continue;
        }
        tiers++;
        printf("tier %s: MR=%d NR=%d KC=%lld NC=%lld\n", isa->name, kr->mr, kr->nr,
               (long long)kr->kc, (long long)kr->nc);
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (int bias = 0; bias < 2; bias++)
                run_case(&rng, &shapes[s], bias, isa, one, 1);
        for (size_t s = 0; s < sizeof thread_shapes / sizeof thread_shapes[0]; s++)
            run_case(&rng, &thread_shapes[s], (int)(s & 1), isa, quick ? quick_counts : counts,
                     quick ? 2 : 4);
    }
    CHECK(tiers >= 1, "no GEMM tier usable (generic must always be)");
    CHECK(generic && mha__kernel_usable(generic, 0), "the generic tier must always be usable");
    const mha__gemm_isa best = mha__registry_best_dt(MHA__OP_gemm, MHA_DTS_F32);
    CHECK(best && mha__kernel_usable(best, 0), "the AUTO tier must be usable");

    /* AUTO gives exactly the bits of the tier it picks. */
    {
        const int64_t M = 50, N = 70, K = 300;
        float *x = malloc(sizeof(float) * M * K), *w = malloc(sizeof(float) * N * K);
        float *y1 = malloc(sizeof(float) * M * N), *y2 = malloc(sizeof(float) * M * N);
        test_fill_normal(&rng, x, M * K, 1.0f);
        test_fill_normal(&rng, w, N * K, 1.0f);
        mha_error err = {0};
        CHECK_OK(mha__gemm_xwt(M, N, K, x, K, w, K, NULL, y1, N, mha__team_of(1), MHA__GEMM_AUTO,
                               NULL, &err),
                 &err);
        CHECK_OK(mha__gemm_xwt(M, N, K, x, K, w, K, NULL, y2, N, mha__team_of(2), best, NULL, &err),
                 &err);
        CHECK(memcmp(y1, y2, sizeof(float) * M * N) == 0, "AUTO differs from %s", best->name);
        /* Caller-provided packing buffer (deliberately misaligned): same bits; too small is
         * refused before anything is written. */
        size_t need = 0;
        CHECK_OK(mha__gemm_workspace_size(MHA__GEMM_AUTO, M, N, K, &need, &err), &err);
        CHECK(need > 0, "a %lldx%lldx%lld GEMM needs packing space", (long long)M, (long long)N,
              (long long)K);
        char *ws = malloc(need + 4);
        float *y3 = malloc(sizeof(float) * M * N);
        CHECK_OK(mha__gemm_xwt_ws(M, N, K, x, K, w, K, NULL, y3, N, mha__team_of(2), MHA__GEMM_AUTO,
                                  ws + 4, need, NULL, &err),
                 &err);
        CHECK(memcmp(y1, y3, sizeof(float) * M * N) == 0, "workspace variant differs");
        memset(y3, 0, sizeof(float) * M * N);
        CHECK(mha__gemm_xwt_ws(M, N, K, x, K, w, K, NULL, y3, N, mha__team_of(2), MHA__GEMM_AUTO,
                               ws, need - 1, NULL, &err) == MHA_STATUS_WORKSPACE_TOO_SMALL,
              "a workspace one byte short must be refused");
        int untouched = 1;
        for (int64_t i = 0; i < M * N; i++)
            untouched &= y3[i] == 0.0f;
        CHECK(untouched, "output written although the workspace was too small");
        /* Pre-packed W (constant weights): same bits for 1 and 3 threads, no allocation. */
        size_t pbytes = 0;
        CHECK_OK(mha__gemm_pack_w_size(MHA__GEMM_AUTO, N, K, &pbytes, &err), &err);
        char *pbuf = malloc(pbytes);
        mha__gemm_packed_w pw;
        CHECK(mha__gemm_pack_w(MHA__GEMM_AUTO, N, K, w, K, pbuf, pbytes - 1, mha__team_of(1), &pw,
                               &err) == MHA_STATUS_WORKSPACE_TOO_SMALL,
              "a packed-W buffer one byte short must be refused");
        CHECK_OK(
            mha__gemm_pack_w(MHA__GEMM_AUTO, N, K, w, K, pbuf, pbytes, mha__team_of(2), &pw, &err),
            &err);
        for (int t = 1; t <= 3; t += 2) {
            memset(y3, 0, sizeof(float) * M * N);
            CHECK_OK(mha__gemm_xwt_packed(M, x, K, &pw, NULL, y3, N, mha__team_of(t), &err), &err);
            CHECK(memcmp(y1, y3, sizeof(float) * M * N) == 0,
                  "pre-packed W with %d threads differs", t);
        }
        free(pbuf);
        free(ws);
        free(y3);
        /* Bad arguments are refused, not crashed on. */
        CHECK(mha__gemm_xwt(-1, N, K, x, K, w, K, NULL, y1, N, mha__team_of(1), MHA__GEMM_AUTO,
                            NULL, &err) == MHA_STATUS_INVALID_ARG,
              "negative M must be refused");
        CHECK(mha__gemm_xwt(M, N, K, x, K, w, K, NULL, y1, N, mha__team_of(1),
                            mha__registry_reference(MHA__OP_fwd), NULL,
                            &err) == MHA_STATUS_INVALID_ARG,
              "a registry line that is not a GEMM kernel must be refused");
        for (int t = 0; gemm_tier(t); t++)
            if (!mha__kernel_usable(gemm_tier(t), 1))
                CHECK(mha__gemm_xwt(M, N, K, x, K, w, K, NULL, y1, N, mha__team_of(1), gemm_tier(t),
                                    NULL, &err) == MHA_STATUS_UNSUPPORTED &&
                          strstr(err.message, gemm_tier(t)->name),
                      "a tier this CPU lacks must be refused by name");
        free(x);
        free(w);
        free(y1);
        free(y2);
    }
    test_transposed_operands(&rng);
    printf("worst error / gamma_{K+1} bound over all cases: %.3g\n", worst_ratio_seen);
    return test_finish();
}
