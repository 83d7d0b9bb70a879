/* SPDX-License-Identifier: MIT */
/* bench_half.c: `mha_bench_half`, the attention core forward (mha_attention, impl AUTO) with bf16
 * q, k, v (and out) against float32, through the public API only (issue 30): which kernel each
 * dtype runs is printed (mha_experimental_attention_select). Shape (B, h, n, d) = (1, 16, 2048,
 * 64) by default, [B, h, n, d] contiguous, n = m; non-causal and causal; 1 and 2 threads.
 * Per (causal, threads) the two rows run round-robin (every round runs each once, so a busy
 * neighbour slows them alike), median / min / max of --reps (>= 5) timed rounds after one warm-up
 * round; outputs and workspaces are allocated once and reused.
 *
 * FLOPs = 2 B h P (d_k + d_v), P = the visible (query, key) pairs per (batch row, head): n m, or
 * n (n + 1) / 2 causal. % of peak, measured in this run on T threads (bench/fma_peak.h): of the
 * float32 FMA peak for a float32-arithmetic kernel, of the vdpbf16ps peak for a bf16-tile kernel
 * (whose line takes no float32), the float32 FMA peak where the CPU lacks AVX512-BF16.
 * Check: the bf16 output (rounded to bf16) against the float32 one on the same (bf16-rounded)
 * inputs, max|diff| / max|f32| (expected: a few bf16 ulps, 2^-8 = 3.9e-3).
 * torch beside it, in one process: bench/bench_half.py.
 *
 * Usage: mha_bench_half [--reps N] [--n N] [--heads H] [--dim D] [--threads 1,2] */
#define _POSIX_C_SOURCE 200809L
#include "fma_peak.h"
#include "mha.h"
#include "mha_experimental.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { MAX_REPS = 101 };

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint16_t to_bf16(float x) { /* nearest even; inputs here are finite */
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One row: a dtype's call, its output and workspace, its times. */
typedef struct row {
    const char *name;
    mha_attention_args a;
    mha_exec ex;
    void *out;
    double t[MAX_REPS];
} row;

static int cmp_double(const void *x, const void *y) {
    const double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

static const char *kernel_of(const mha_attention_args *a, const mha_exec *ex) {
    int32_t idx = -1;
    mha_kernel_desc d;
    if (mha_experimental_attention_select(a, ex, &idx, NULL) != MHA_STATUS_OK ||
        mha_experimental_kernel_describe(idx, &d, NULL) != MHA_STATUS_OK)
        return "?";
    return d.name;
}

static void cpu_name(char *buf, size_t n) {
    char line[512];
    FILE *f = fopen("/proc/cpuinfo", "r");
    snprintf(buf, n, "?");
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "model name", 10) == 0) {
            const char *c = strchr(line, ':');
            if (c) {
                c += 2;
                snprintf(buf, n, "%.*s", (int)strcspn(c, "\n"), c);
            }
            break;
        }
    if (f)
        fclose(f);
}

int main(int argc, char **argv) {
    int reps = 5, threads[8] = {1, 2}, nthreads = 2;
    int64_t n = 2048, H = 16, D = 64;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--reps"))
            reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--n"))
            n = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--heads"))
            H = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--dim"))
            D = atoll(argv[i + 1]);
        else if (!strcmp(argv[i], "--threads")) {
            nthreads = 0;
            for (char *s = argv[i + 1]; *s && nthreads < 8; s += strcspn(s, ","), s += *s == ',')
                threads[nthreads++] = atoi(s);
        } else {
            fprintf(stderr, "mha_bench_half: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (reps < 5 || reps > MAX_REPS || n < 1 || H < 1 || D < 1) {
        fprintf(stderr, "mha_bench_half: --reps 5..%d, positive sizes\n", MAX_REPS);
        return 2;
    }
    const int64_t cnt = H * n * D;
    float *qf = malloc(sizeof(float) * (size_t)cnt * 3);
    uint16_t *qh = malloc(sizeof(uint16_t) * (size_t)cnt * 3);
    uint64_t s = 42;
    for (int64_t e = 0; e < 3 * cnt; e++) { /* uniform(-1, 1), rounded to bf16 for both rows */
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        qh[e] = to_bf16((float)((double)(s >> 11) * 0x1.0p-52 - 1.0));
        qf[e] = from_bf16(qh[e]);
    }
    char cpu[256];
    cpu_name(cpu, sizeof cpu);
    printf("# mha_bench_half: mha %s, core forward, B=1 h=%lld n=m=%lld d=%lld, bf16 vs f32\n",
           mha_version(), (long long)H, (long long)n, (long long)D);
    printf("# CPU: %s; kernel tiers: %s\n", cpu, mha_experimental_cpu_isas(1));
    printf("# median [min, max] of %d round-robin rounds after 1 warm-up\n", reps);
    printf("%-7s %-2s %-5s %-40s %10s %20s %8s %7s\n", "causal", "T", "dtype", "kernel",
           "median ms", "[min, max] ms", "GFLOP/s", "% peak");
    for (int causal = 0; causal <= 1; causal++)
        for (int ti = 0; ti < nthreads; ti++) {
            const int T = threads[ti];
            const char *isa = "";
            const double peak = bench_peak_best_gflops(T, 20.0, 3, &isa);
            const double bf16_peak = bench_peak_bf16_gflops(T, 20.0, 3);
            row rows[2];
            memset(rows, 0, sizeof rows);
            for (int r = 0; r < 2; r++) {
                row *w = &rows[r];
                const int half = r == 1;
                w->name = half ? "bf16" : "f32";
                mha_attention_args *a = &w->a;
                a->batch = 1, a->num_heads = H, a->num_kv_heads = H, a->q_len = n;
                a->kv_len = n, a->head_dim = D, a->v_head_dim = D;
                a->mask.causal = causal;
                const int64_t st[3] = {H * n * D, n * D, D}; /* [B, h, n, d] */
                memcpy(a->q_strides, st, sizeof st), memcpy(a->k_strides, st, sizeof st);
                memcpy(a->v_strides, st, sizeof st), memcpy(a->out_strides, st, sizeof st);
                if (half) {
                    a->q = qh, a->k = qh + cnt, a->v = qh + 2 * cnt;
                    a->q_dtype = a->k_dtype = a->v_dtype = a->out_dtype = MHA_DTYPE_BF16;
                } else {
                    a->q = qf, a->k = qf + cnt, a->v = qf + 2 * cnt;
                }
                w->out = malloc((half ? 2 : 4) * (size_t)cnt);
                a->out = w->out;
                w->ex = (mha_exec){MHA_IMPL_AUTO, T, NULL, 0, NULL, NULL};
                mha_error err;
                if (mha_attention_workspace_size(a, &w->ex, &w->ex.workspace_bytes, &err) ||
                    !(w->ex.workspace = malloc(w->ex.workspace_bytes + 1))) {
                    fprintf(stderr, "mha_bench_half: %s\n", err.message);
                    return 1;
                }
            }
            for (int k = -1; k < reps; k++)
                for (int r = 0; r < 2; r++) {
                    mha_error err;
                    const double t0 = now_s();
                    if (mha_attention(&rows[r].a, &rows[r].ex, &err)) {
                        fprintf(stderr, "mha_bench_half: %s\n", err.message);
                        return 1;
                    }
                    if (k >= 0)
                        rows[r].t[k] = now_s() - t0;
                }
            const double pairs = causal ? (double)n * (double)(n + 1) / 2 : (double)n * (double)n;
            const double flop = 2.0 * (double)H * pairs * (double)(2 * D);
            double med[2];
            for (int r = 0; r < 2; r++) {
                row *w = &rows[r];
                qsort(w->t, (size_t)reps, sizeof(double), cmp_double);
                med[r] = w->t[reps / 2];
                const char *kn = kernel_of(&w->a, &w->ex);
                const double pk = strstr(kn, "_bf16_") && bf16_peak > 0.0 ? bf16_peak : peak;
                printf("%-7s %-2d %-5s %-40s %10.2f %9.2f, %8.2f %8.1f %6.1f%%\n",
                       causal ? "yes" : "no", T, w->name, kn, 1e3 * med[r], 1e3 * w->t[0],
                       1e3 * w->t[reps - 1], flop / med[r] * 1e-9,
                       100.0 * flop / med[r] * 1e-9 / pk);
            }
            double dmax = 0.0, fmax_ = 0.0;
            for (int64_t e = 0; e < cnt; e++) {
                const double f = (double)((float *)rows[0].out)[e];
                const double h = (double)from_bf16(((uint16_t *)rows[1].out)[e]);
                dmax = fabs(h - f) > dmax ? fabs(h - f) : dmax;
                fmax_ = fabs(f) > fmax_ ? fabs(f) : fmax_;
            }
            printf("        f32/bf16 time %.2fx; bf16 vs f32 output max|diff|/max|f32| %.2e; fp32 "
                   "FMA peak %d thread(s) %.1f GFLOP/s (%s), bf16 dot peak %.1f\n",
                   med[0] / med[1], dmax / fmax_, T, peak, isa, bf16_peak);
            for (int r = 0; r < 2; r++)
                free(rows[r].out), free(rows[r].ex.workspace);
        }
    free(qf), free(qh);
    return 0;
}
