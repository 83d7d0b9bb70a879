/* SPDX-License-Identifier: MIT */
/* bench_stats.c: `mha_bench_stats`, the cost of the streamed attention statistics
 * (mha_attention_statistics) on a long input, relative to one forward, and the peak memory of
 * each, through the public API only. One process measures ONE thing (--only forward|stats), so
 * that its peak resident set (VmHWM, /proc/self/status; ru_maxrss where /proc is absent) is that
 * call's plus the inputs':
 *   forward  mha_attention (impl auto) with out and lse: q, k, v, out [1, h, n, d] float32
 *   stats    mha_attention_statistics with received (+ total), entropy, top-k (K) and the map
 *            pooled to R x C (with its visible fraction): q, k [1, h, n, d] and the outputs
 * Dense probabilities would be h n^2 float32 (8 x 32768^2 x 4 B = 32 GiB at the defaults).
 * Usage: mha_bench_stats --only forward|stats [--n N] [--heads H] [--d D] [--threads T]
 *        [--causal] [--topk K] [--pool R]   (defaults: n 32768, h 8, d 64, T 0, K 8, R 256)
 * Prints one line: what, shape, threads, seconds, peak RSS in MiB, input MiB. */
#define _POSIX_C_SOURCE 200809L
#include "mha.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Peak resident set in MiB: VmHWM of /proc/self/status, else getrusage's ru_maxrss (KiB). */
static double peak_rss_mib(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long kib = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "VmHWM: %ld kB", &kib) == 1)
            break;
    if (f)
        fclose(f);
    if (kib < 0) {
        struct rusage ru;
        getrusage(RUSAGE_SELF, &ru);
        kib = ru.ru_maxrss;
    }
    return (double)kib / 1024.0;
}

static float *fill_new(int64_t count, uint64_t seed) {
    float *x = malloc(sizeof(float) * (size_t)count);
    if (!x) {
        fprintf(stderr, "mha_bench_stats: cannot allocate %lld floats\n", (long long)count);
        exit(1);
    }
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
    for (int64_t i = 0; i < count; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)(s >> 40) / (float)(1 << 24) - 0.5f;
    }
    return x;
}

static int64_t arg_i64(int argc, char **argv, const char *flag, int64_t def) {
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], flag) == 0)
            return strtoll(argv[i + 1], NULL, 10);
    return def;
}

static const char *arg_str(int argc, char **argv, const char *flag) {
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], flag) == 0)
            return argv[i + 1];
    return NULL;
}

int main(int argc, char **argv) {
    const char *only = arg_str(argc, argv, "--only");
    const int64_t n = arg_i64(argc, argv, "--n", 32768), h = arg_i64(argc, argv, "--heads", 8);
    const int64_t d = arg_i64(argc, argv, "--d", 64), k = arg_i64(argc, argv, "--topk", 8);
    const int64_t R = arg_i64(argc, argv, "--pool", 256);
    int causal = 0;
    for (int i = 1; i < argc; i++)
        causal |= strcmp(argv[i], "--causal") == 0;
    if (!only || (strcmp(only, "forward") && strcmp(only, "stats")) || n < 1 || h < 1 || d < 1) {
        fprintf(stderr, "usage: mha_bench_stats --only forward|stats [--n N] [--heads H] [--d D] "
                        "[--threads T] [--causal] [--topk K] [--pool R]\n");
        return 2;
    }
    const int fwd = strcmp(only, "forward") == 0;
    mha_exec ex = {MHA_IMPL_AUTO, (int32_t)arg_i64(argc, argv, "--threads", 0), NULL, 0, NULL,
                   NULL};
    const int64_t count = h * n * d;
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = 1, a.num_heads = h, a.q_len = n, a.kv_len = n, a.head_dim = d;
    a.mask.causal = causal;
    const int64_t st[3] = {count, n * d, d};
    float *q = fill_new(count, 1), *kk = fill_new(count, 2), *v = NULL, *out = NULL, *lse = NULL;
    a.q = q, a.k = kk;
    memcpy(a.q_strides, st, sizeof st), memcpy(a.k_strides, st, sizeof st);
    double in_mib = 2.0 * (double)count * 4.0 / 1048576.0;
    mha_attention_stats s;
    memset(&s, 0, sizeof s);
    if (fwd) {
        v = fill_new(count, 3), out = fill_new(count, 4), lse = fill_new(h * n, 5);
        a.v = v, a.out = out, a.lse = lse;
        memcpy(a.v_strides, st, sizeof st), memcpy(a.out_strides, st, sizeof st);
        in_mib += 2.0 * (double)count * 4.0 / 1048576.0;
    } else {
        s.received = fill_new(h * n, 6), s.received_total = fill_new(n, 7);
        s.entropy = fill_new(h * n, 8);
        s.top_k = k, s.topk_index = calloc((size_t)(h * n * k), sizeof(int64_t));
        s.topk_prob = fill_new(h * n * k, 9);
        s.pool_rows = s.pool_cols = R < n ? R : n;
        s.pooled = fill_new(h * s.pool_rows * s.pool_cols, 10);
        s.pooled_visible = fill_new(h * s.pool_rows * s.pool_cols, 11);
        if (!s.topk_index)
            return 1;
        in_mib +=
            (double)(h * n * (3 + 3 * k) + n + 2 * h * s.pool_rows * s.pool_cols) * 4.0 / 1048576.0;
    }
    const double rss_before = peak_rss_mib();
    mha_error err;
    const double t0 = now_s();
    const mha_status rc =
        fwd ? mha_attention(&a, &ex, &err) : mha_attention_statistics(&a, &s, &ex, &err);
    const double t = now_s() - t0;
    if (rc != MHA_STATUS_OK) {
        fprintf(stderr, "mha_bench_stats: %s\n", err.message);
        return 1;
    }
    printf("%s n=m=%lld h=%lld d=%lld %s threads=%d: %.2f s, peak RSS %.0f MiB (before the call "
           "%.0f MiB; inputs and outputs %.0f MiB)\n",
           fwd ? "forward (mha_attention, out + lse)"
               : "statistics (received, entropy, top-k, pooled)",
           (long long)n, (long long)h, (long long)d, causal ? "causal" : "full", (int)ex.n_threads,
           t, peak_rss_mib(), rss_before, in_mib);
    free(q), free(kk), free(v), free(out), free(lse);
    free(s.received), free(s.received_total), free(s.entropy), free(s.topk_index);
    free(s.topk_prob), free(s.pooled), free(s.pooled_visible);
    return 0;
}
