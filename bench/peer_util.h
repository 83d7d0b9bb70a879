/* SPDX-License-Identifier: MIT */
/* peer_util.h: what the ggml peer benchmarks (peer_ggml_decode.c, peer_ggml_gemv.c) share: the
 * clock, a seeded random stream, medians, a bounded list parser and the machine's read bandwidth
 * (each thread sums its contiguous share of a buffer far beyond the caches, in 2 MiB pages where
 * the OS gives them, as mha's caches and weights are). Benchmarks only: never part of the
 * library. */
#ifndef MHA_BENCH_PEER_UTIL_H
#define MHA_BENCH_PEER_UTIL_H

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define MAX_REPS    64
#define MAX_LIST    8
#define MAX_THREADS 64

/* ---- small helpers -------------------------------------------------------------------------- */
static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline void pause_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static inline float rnd(void) { /* uniform in [-1, 1), xorshift64 */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)(rng_state >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

static inline int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct stats {
    double med, min, max;
} stats;

static inline stats summarize(const double *t, int n) {
    double s[MAX_REPS];
    memcpy(s, t, sizeof(double) * (size_t)n);
    qsort(s, (size_t)n, sizeof(double), cmp_d);
    stats r = {n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]), s[0], s[n - 1]};
    return r;
}

static inline void *xalloc(size_t bytes) { /* 64-byte aligned, zeroed; exits on failure */
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) {
        fprintf(stderr, "peer: out of memory (%zu bytes)\n", bytes);
        exit(1);
    }
    memset(p, 0, bytes);
    return p;
}

/* Parses "a,b,c" into at most MAX_LIST integers; returns the count (0 on a bad list). */
static inline int parse_list(const char *s, int64_t *out) {
    int n = 0;
    while (*s && n < MAX_LIST) {
        char *end;
        const long long v = strtoll(s, &end, 10);
        if (end == s || v <= 0)
            return 0;
        out[n++] = v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',')
            return 0;
    }
    return n;
}

/* ---- read bandwidth: each thread sums its contiguous share of a large buffer ---------------- */
typedef struct stream_job {
    const uint64_t *p;
    size_t words;
    uint64_t sum;
} stream_job;

static inline void *stream_part(void *arg) {
    stream_job *j = arg;
    uint64_t a[8] = {0};
    for (size_t i = 0; i + 8 <= j->words; i += 8)
        for (int u = 0; u < 8; u++)
            a[u] += j->p[i + (size_t)u]; /* 8 independent chains */
    for (int u = 0; u < 8; u++)
        j->sum += a[u];
    return NULL;
}

/* One timed pass over the buffer on `threads` threads (the caller's included): GB/s. */
static inline double stream_pass(const uint64_t *buf, size_t words, int threads) {
    stream_job jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    const size_t lines = words / 8;
    for (int t = 0; t < threads; t++) {
        jobs[t].p = buf + lines * (size_t)t / (size_t)threads * 8;
        jobs[t].words =
            (lines * (size_t)(t + 1) / (size_t)threads - lines * (size_t)t / (size_t)threads) * 8;
        jobs[t].sum = 0;
    }
    const double t0 = now_s();
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&tid[t], NULL, stream_part, &jobs[t]) == 0;
    stream_part(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else
            stream_part(&jobs[t]); /* no thread: the caller reads that share too */
    }
    const double dt = now_s() - t0;
    volatile uint64_t keep = 0; /* the sums are used: the loads stay */
    for (int t = 0; t < threads; t++)
        keep += jobs[t].sum;
    (void)keep;
    return (double)(lines * 64) / dt * 1e-9;
}

/* Median, min and max GB/s of `passes` passes. */
static inline stats stream_gbs(int64_t mb, int threads, int passes) {
    const size_t words = (size_t)mb * 1024 * 1024 / 8;
    /* in 2 MiB pages where the OS gives them, as mha asks for its KV caches (mha decode-bench's
     * read loop does the same) */
    const size_t huge = (size_t)2 << 20, bytes = (words * 8 + huge - 1) / huge * huge;
    uint64_t *buf = aligned_alloc(huge, bytes);
    if (!buf) {
        fprintf(stderr, "peer: cannot allocate %zu bytes\n", bytes);
        exit(1);
    }
    (void)madvise(buf, bytes, MADV_HUGEPAGE);
    for (size_t i = 0; i < words; i++)
        buf[i] = i;
    double g[MAX_REPS];
    passes = passes > MAX_REPS ? MAX_REPS : passes;
    for (int i = 0; i < passes; i++)
        g[i] = stream_pass(buf, words, threads);
    free(buf);
    return summarize(g, passes);
}

/* max |o - ref| / max |ref| (a NaN in o counts as the largest difference). */
static inline double rel_err(const float *o, const double *ref, int64_t n) {
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double diff = fabs((double)o[i] - ref[i]);
        num = diff > num || diff != diff ? diff : num;
        den = fabs(ref[i]) > den ? fabs(ref[i]) : den;
    }
    return num / den;
}

#endif
