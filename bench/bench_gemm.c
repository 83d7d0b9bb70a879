/* SPDX-License-Identifier: MIT */
/* bench_gemm.c: `mha_bench_gemm`, the projection GEMM y = x W^T (+ b) of src/kernels/gemm.c per
 * kernel tier, against OpenBLAS cblas_sgemm (loaded with dlopen when libopenblas is installed;
 * never a build dependency) on the same inputs, with the machine's FMA peak measured in the same
 * run. FLOPs = 2 M N K. Each row: median, min and max of R timed runs after 2 warm-ups.
 * bf16 (issue 30): the pair kernel (vdpbf16ps) runs on bf16 copies of x and W, and each float32
 * tier also on those copies ("+bf16w": widened while packing, the path bf16 took before it).
 *
 * Usage: mha_bench_gemm [--threads 1,2] [--reps R] [--shape M,N,K]... [--jsonl FILE]
 *        mha_bench_gemm --ukr   (each tier's micro-kernel alone: micro_kernel_ceiling)
 *        mha_bench_gemm --dot   (each tier's decode dot products alone: dot_ceiling)
 * OpenBLAS is run with openblas_set_num_threads(T) and its own core detection (we never set
 * OPENBLAS_CORETYPE); its detected core name is printed. */
#define _POSIX_C_SOURCE 200809L
#include "fma_peak.h"
#include "kernels/registry.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* cblas_sgemm(order, transA, transB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc) */
typedef void (*sgemm_fn)(int,
                         int,
                         int,
                         int,
                         int,
                         int,
                         float,
                         const float *,
                         int,
                         const float *,
                         int,
                         float,
                         float *,
                         int);
typedef void (*set_threads_fn)(int);
typedef char *(*corename_fn)(void);

typedef struct blas {
    sgemm_fn sgemm;
    set_threads_fn set_threads;
    corename_fn corename;
} blas;

static int load_openblas(blas *b) {
    const char *names[] = {"libopenblas.so.0", "libopenblas.so"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        void *h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (!h)
            continue;
        /* POSIX guarantees data <-> function pointer round trips through dlsym. */
        void *s = dlsym(h, "cblas_sgemm"), *t = dlsym(h, "openblas_set_num_threads"),
             *c = dlsym(h, "openblas_get_corename");
        if (!s)
            continue;
        memcpy(&b->sgemm, &s, sizeof s);
        memcpy(&b->set_threads, &t, sizeof t);
        memcpy(&b->corename, &c, sizeof c);
        return 1;
    }
    return 0;
}

typedef struct stats {
    double med, min, max;
} stats;

typedef struct run_ctx {
    int64_t M, N, K;
    const float *x, *w, *b;
    const uint16_t *xh, *wh; /* x, W rounded to bf16 */
    int half;                /* run on xh, wh (mha__gemm_run_dt) */
    float *y;
    int threads;
    const mha__kernel_info *kern; /* an mha GEMM tier (registry line); NULL: OpenBLAS */
    const blas *bl;
} run_ctx;

static void run_once(const run_ctx *r) {
    if (r->kern && r->half) {
        mha_error err;
        if (mha__gemm_run_dt(MHA__GEMM_OP_N, r->M, r->N, r->K, r->xh, MHA_DTYPE_BF16, r->K, r->wh,
                             MHA_DTYPE_BF16, r->K, r->b, r->y, r->N, mha__team_of(r->threads),
                             r->kern, NULL, 0, NULL, &err) != MHA_STATUS_OK) {
            fprintf(stderr, "gemm failed: %s\n", err.message);
            exit(1);
        }
    } else if (r->kern) {
        mha_error err;
        if (mha__gemm_xwt(r->M, r->N, r->K, r->x, r->K, r->w, r->K, r->b, r->y, r->N,
                          mha__team_of(r->threads), r->kern, NULL, &err) != MHA_STATUS_OK) {
            fprintf(stderr, "gemm failed: %s\n", err.message);
            exit(1);
        }
    } else {
        /* y = x W^T: row-major, A = x (no trans), B = W (trans); the bias is added after, as
         * a BLAS caller would (101 = RowMajor, 111 = NoTrans, 112 = Trans). */
        r->bl->sgemm(101, 111, 112, (int)r->M, (int)r->N, (int)r->K, 1.0f, r->x, (int)r->K, r->w,
                     (int)r->K, 0.0f, r->y, (int)r->N);
        if (r->b)
            for (int64_t i = 0; i < r->M; i++)
                for (int64_t o = 0; o < r->N; o++)
                    r->y[i * r->N + o] += r->b[o];
    }
}

static stats time_runs(const run_ctx *r, int reps) {
    double *t = malloc(sizeof(double) * (size_t)reps);
    run_once(r);
    run_once(r);
    for (int i = 0; i < reps; i++) {
        double t0 = bench_now_s();
        run_once(r);
        t[i] = bench_now_s() - t0;
    }
    qsort(t, (size_t)reps, sizeof(double), bench_cmp_double);
    stats s = {t[reps / 2], t[0], t[reps - 1]};
    free(t);
    return s;
}

/* --ukr: the micro-kernel of every GEMM tier this CPU has, alone on one thread, its operands
 * reused from cache: one MR x KC panel of x against one KC x NR panel of packed W (all in L1), and
 * against the NC / NR panels of one KC x NC block (W from L2, as in a GEMM). The ceiling of the
 * whole GEMM: what it loses beyond this is packing, C traffic and page faults (performance.md). */
static void micro_kernel_ceiling(void) {
    const char *pisa = "";
    const double peak = bench_peak_best_gflops(1, 100.0, 5, &pisa);
    printf("# micro-kernel alone, 1 thread, operands reused from cache; %s FMA peak %.1f GFLOP/s\n",
           pisa, peak);
    printf("%-28s %-22s %9s %7s\n", "kernel", "W panels", "GFLOP/s", "%peak");
    for (int i = 0; i < mha__registry_count(); i++) {
        const mha__kernel_info *kern = mha__registry_at(i);
        if (kern->op != MHA__OP_gemm || !kern->isa || !mha__kernel_usable(kern, 1))
            continue;
        const mha__gemm_kernel *kr = kern->run.gemm;
        const int64_t kc = kr->kc, ncp = kr->nc / kr->nr > 0 ? kr->nc / kr->nr : 1;
        float *a = aligned_alloc(64, sizeof(float) * (size_t)(kr->mr * kc));
        float *bp = aligned_alloc(64, sizeof(float) * (size_t)(kc * kr->nr * ncp));
        float *c = aligned_alloc(64, sizeof(float) * (size_t)(kr->mr * kr->nr * ncp));
        for (int64_t j = 0; j < kr->mr * kc; j++)
            a[j] = (float)(j % 7) * 1e-3f;
        for (int64_t j = 0; j < kc * kr->nr * ncp; j++)
            bp[j] = (float)(j % 5) * 1e-3f;
        memset(c, 0, sizeof(float) * (size_t)(kr->mr * kr->nr * ncp));
        for (int l2 = 0; l2 < 2; l2++) {
            const int64_t npan = l2 ? ncp : 1, calls = 200000 / npan;
            double best = 1e30;
            for (int rep = 0; rep < 5; rep++) {
                const double t0 = bench_now_s();
                for (int64_t it = 0; it < calls; it++)
                    for (int64_t p = 0; p < npan; p++)
                        kr->ukr(kc, a, bp + p * kc * kr->nr, c + p * kr->nr, kr->nr * npan, kr->mr,
                                kr->nr, NULL, 0);
                const double t = bench_now_s() - t0;
                best = t < best ? t : best;
            }
            const double gf =
                2.0 * kr->mr * kr->nr * (double)kc * (double)(npan * calls) / best * 1e-9;
            char what[48] = "1 (L1)";
            if (l2)
                snprintf(what, sizeof what, "%lld (KC x NC, L2)", (long long)npan);
            printf("%-28s %-22s %9.1f %6.0f%%\n", kern->name, what, gf, 100.0 * gf / peak);
        }
        free(a);
        free(bp);
        free(c);
    }
}

/* --dot: the few-rows path of every float32 GEMM tier this CPU has (the decode step's GEMV at batch
 * 1), alone on one thread: dot_q8 and dot_h (bf16) on 64 rows of K = 4096 (W in the L2, 278 KiB
 * of q8_0, 512 KiB of bf16), m = 1, blocks of MHA_GEMM_DOT_N rows as gemm.c runs them; best of 5
 * runs of 500 passes. Per 32 weights and row: ns, and the W bytes per second this rate would
 * stream (the compute ceiling of the decode step's projections: performance.md "q8_0 weights"). */
static void dot_ceiling(void) {
    enum { ROWS = 64, K = 4096, PASSES = 500 };
    const int64_t ldq = K / 32 * 34;
    unsigned char *wq = aligned_alloc(64, (size_t)(ROWS * ldq));
    uint16_t *wh = aligned_alloc(64, sizeof(uint16_t) * ROWS * K);
    float *x = aligned_alloc(64, sizeof(float) * K), y[ROWS];
    for (int64_t r = 0; r < ROWS; r++)
        for (int64_t b = 0; b < K / 32; b++) {
            unsigned char *blk = wq + r * ldq + b * 34;
            const uint16_t d = (uint16_t)(0x2000 + (r * 7 + b) % 1024); /* finite f16 scales */
            memcpy(blk, &d, 2);
            for (int i = 0; i < 32; i++)
                blk[2 + i] = (unsigned char)((r * 31 + b * 17 + i * 5) % 255);
        }
    for (int64_t j = 0; j < ROWS * K; j++)
        wh[j] = (uint16_t)(0x3c00 + j % 255);
    for (int64_t j = 0; j < K; j++)
        x[j] = (float)(j % 13) * 1e-2f - 0.06f;
    printf("# decode dot products alone, 1 thread, m = 1, %d rows x K = %d (W in L2)\n", ROWS, K);
    printf("%-28s %-6s %14s %12s\n", "kernel", "W", "ns/32w/row", "GB/s of W");
    for (int i = 0; i < mha__registry_count(); i++) {
        const mha__kernel_info *kern = mha__registry_at(i);
        if (kern->op != MHA__OP_gemm || kern->run.gemm->pack_pairs || !mha__kernel_usable(kern, 1))
            continue;
        const mha__gemm_kernel *kr = kern->run.gemm;
        for (int q8 = 1; q8 >= 0; q8--) {
            double best = 1e30;
            for (int rep = 0; rep < 5; rep++) {
                const double t0 = bench_now_s();
                for (int it = 0; it < PASSES; it++)
                    for (int r = 0; r < ROWS; r += MHA_GEMM_DOT_N) {
                        if (q8)
                            (kr->dot_q8 ? kr->dot_q8 : mha__gemm_dot_q8_ref)(
                                K, x, K, 1, wq + r * ldq, ldq, MHA_GEMM_DOT_N, NULL, y + r, 1);
                        else
                            (kr->dot_h ? kr->dot_h : mha__gemm_dot_h_ref)(
                                K, x, K, 1, wh + r * K, 1, K, MHA_GEMM_DOT_N, NULL, y + r, 1);
                    }
                const double t = bench_now_s() - t0;
                best = t < best ? t : best;
            }
            const double ns = best / ((double)PASSES * ROWS * (K / 32)) * 1e9;
            printf("%-28s %-6s %14.3f %12.1f\n", kern->name, q8 ? "q8_0" : "bf16", ns,
                   (q8 ? 34.0 : 64.0) / ns);
        }
    }
    free(wq);
    free(wh);
    free(x);
}

int main(int argc, char **argv) {
    int threads_list[8] = {1, 2}, n_threads = 2, reps = 7;
    int64_t shapes[32][3];
    int n_shapes = 0;
    const char *jsonl = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            n_threads = 0;
            for (char *tok = strtok(argv[++i], ","); tok && n_threads < 8; tok = strtok(NULL, ","))
                threads_list[n_threads++] = atoi(tok);
        } else if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
            reps = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--shape") && i + 1 < argc && n_shapes < 32) {
            long long m, n, k;
            if (sscanf(argv[++i], "%lld,%lld,%lld", &m, &n, &k) != 3) {
                fprintf(stderr, "--shape M,N,K\n");
                return 2;
            }
            shapes[n_shapes][0] = m;
            shapes[n_shapes][1] = n;
            shapes[n_shapes][2] = k;
            n_shapes++;
        } else if (!strcmp(argv[i], "--jsonl") && i + 1 < argc) {
            jsonl = argv[++i];
        } else if (!strcmp(argv[i], "--ukr")) {
            micro_kernel_ceiling();
            return 0;
        } else if (!strcmp(argv[i], "--dot")) {
            dot_ceiling();
            return 0;
        } else {
            fprintf(stderr, "usage: mha_bench_gemm [--threads 1,2] [--reps 7] [--shape M,N,K]... "
                            "[--jsonl FILE] | --ukr | --dot\n");
            return 2;
        }
    }
    if (reps < 1)
        reps = 1;
    if (n_shapes == 0) {
        /* The layer's projections in the benchmark shapes: (rows = B*n, out, in). */
        const int64_t def[][3] = {{512, 768, 768},    {2048, 1024, 1024}, {2048, 4096, 4096},
                                  {8192, 1024, 1024}, {2048, 1024, 4096}, {2048, 768, 768}};
        n_shapes = (int)(sizeof def / sizeof def[0]);
        memcpy(shapes, def, sizeof def);
    }
    blas bl;
    memset(&bl, 0, sizeof bl);
    const int have_blas = load_openblas(&bl);
    char model[256];
    bench_cpu_model(model, sizeof model);
    FILE *jf = jsonl ? fopen(jsonl, "a") : NULL;

    printf("# projection GEMM y = x W^T + b, FLOPs = 2*M*N*K; CPU: %s\n", model);
    printf("# OpenBLAS: %s%s\n", have_blas ? "loaded, core " : "not found",
           have_blas && bl.corename ? bl.corename() : "");
    for (int ti = 0; ti < n_threads; ti++) {
        const int T = threads_list[ti];
        const char *pisa = "";
        const double peak = bench_peak_best_gflops(T, 100.0, 5, &pisa);
        printf("# threads=%d: measured %s FMA peak %.1f GFLOP/s\n", T, pisa, peak);
        printf("%-36s %6s %6s %6s %8s %8s %8s %9s %7s\n", "kernel", "M", "N", "K", "med_ms",
               "min_ms", "max_ms", "GFLOP/s", "%peak");
        for (int s = 0; s < n_shapes; s++) {
            const int64_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
            float *x = malloc(sizeof(float) * (size_t)(M * K)),
                  *w = malloc(sizeof(float) * (size_t)(N * K));
            float *b = malloc(sizeof(float) * (size_t)N),
                  *y = malloc(sizeof(float) * (size_t)(M * N));
            for (int64_t i = 0; i < M * K; i++)
                x[i] = (float)((i * 7919) % 1000) * 1e-3f - 0.5f;
            for (int64_t i = 0; i < N * K; i++)
                w[i] = (float)((i * 104729) % 1000) * 1e-3f - 0.5f;
            for (int64_t i = 0; i < N; i++)
                b[i] = 0.01f * (float)i;
            uint16_t *xh = malloc(2 * (size_t)(M * K)), *wh = malloc(2 * (size_t)(N * K));
            mha__narrow(MHA_DTYPE_BF16, x, xh, M * K);
            mha__narrow(MHA_DTYPE_BF16, w, wh, N * K);
            const double flops = 2.0 * (double)M * (double)N * (double)K;
            /* Every GEMM line of the registry this CPU has, best first, then OpenBLAS. */
            for (int row = 0; row <= 2 * mha__registry_count(); row++) {
                const int i = row / 2, half = row % 2;
                const mha__kernel_info *kern = mha__registry_at(i);
                if (!kern && half)
                    continue;
                /* The pair kernel takes bf16 only; float32 tiers both (bf16 widened). */
                if (kern && kern->op == MHA__OP_gemm && !(kern->dtypes & MHA_DTS_F32) && !half)
                    continue;
                if (kern && (kern->op != MHA__OP_gemm || !mha__kernel_usable(kern, 1)))
                    continue;
                if (kern && !kern->isa && flops > 2e10)
                    continue; /* minutes; the portable tier is for correctness */
                if (!kern && !have_blas)
                    continue;
                if (!kern && bl.set_threads)
                    bl.set_threads(T);
                run_ctx r = {M, N, K, x, w, b, xh, wh, half, y, T, kern, &bl};
                const stats st = time_runs(&r, reps);
                char name[96];
                snprintf(name, sizeof name, "%s%s", kern ? kern->name : "openblas_sgemm+bias",
                         half && (kern->dtypes & MHA_DTS_F32) ? "+bf16w" : "");
                const double gf = flops / st.med * 1e-9;
                printf("%-36s %6lld %6lld %6lld %8.2f %8.2f %8.2f %9.1f %6.0f%%\n", name,
                       (long long)M, (long long)N, (long long)K, st.med * 1e3, st.min * 1e3,
                       st.max * 1e3, gf, 100.0 * gf / peak);
                fflush(stdout);
                if (jf)
                    fprintf(jf,
                            "{\"bench\": \"gemm\", \"kernel\": \"%s\", \"M\": %lld, \"N\": %lld, "
                            "\"K\": %lld, \"threads\": %d, \"median_ms\": %.4f, \"min_ms\": %.4f, "
                            "\"max_ms\": %.4f, \"gflops\": %.2f, \"peak_gflops\": %.2f, "
                            "\"peak_isa\": \"%s\", \"pct_peak\": %.1f, \"blas_core\": \"%s\"}\n",
                            name, (long long)M, (long long)N, (long long)K, T, st.med * 1e3,
                            st.min * 1e3, st.max * 1e3, gf, peak, pisa, 100.0 * gf / peak,
                            !kern && bl.corename ? bl.corename() : "");
            }
            free(x);
            free(w);
            free(xh);
            free(wh);
            free(b);
            free(y);
        }
    }
    if (jf)
        fclose(jf);
    return 0;
}
