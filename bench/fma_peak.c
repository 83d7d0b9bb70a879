/* SPDX-License-Identifier: MIT */
/* fma_peak.c: the measured fp32 FMA peak used as the denominator of every "% of peak" in bench/.
 * Per ISA (AVX-512, AVX2+FMA, NEON on aarch64, scalar; what the CPU lacks is skipped), a loop of
 * 16 (AVX2: 12, NEON: 24) independent FMA chains (more than 4-cycle latency x 2 FMA ports; NEON:
 * x 4 pipes of 128 bits on Neoverse V1 / Apple M) runs on 1 thread or on T threads at once (each
 * thread its own chains); FLOPs = 2 x lanes x FMAs. The best of several short repetitions is
 * reported, since a busy neighbour only ever lowers it. Not part of the library (it may create
 * threads and use target attributes freely). */
#define _POSIX_C_SOURCE 200809L
#include "fma_peak.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#    include <immintrin.h>
#    define PEAK_X86 1
#else
#    define PEAK_X86 0
#endif
#if defined(__aarch64__)
#    include <arm_neon.h>
#endif

double bench_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int bench_cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Keeps the result alive so the loop is not optimized away. */
static volatile float g_sink;

typedef double (*fma_loop_fn)(int64_t iters); /* returns FLOPs done */

#if PEAK_X86
/* Explicit variables (not an array) so that every chain lives in a register at -O2. */
#    define PEAK_CHAINS8(V, F)                                                                     \
        V##0 = F(V##0);                                                                            \
        V##1 = F(V##1);                                                                            \
        V##2 = F(V##2);                                                                            \
        V##3 = F(V##3);                                                                            \
        V##4 = F(V##4);                                                                            \
        V##5 = F(V##5);                                                                            \
        V##6 = F(V##6);                                                                            \
        V##7 = F(V##7)

__attribute__((target("avx512f"))) static double loop_avx512(int64_t iters) {
    const __m512 m = _mm512_set1_ps(0.999999f), a = _mm512_set1_ps(1e-6f);
    __m512 c0 = _mm512_set1_ps(1.00f), c1 = _mm512_set1_ps(1.01f), c2 = _mm512_set1_ps(1.02f),
           c3 = _mm512_set1_ps(1.03f), c4 = _mm512_set1_ps(1.04f), c5 = _mm512_set1_ps(1.05f),
           c6 = _mm512_set1_ps(1.06f), c7 = _mm512_set1_ps(1.07f);
    __m512 d0 = _mm512_set1_ps(1.10f), d1 = _mm512_set1_ps(1.11f), d2 = _mm512_set1_ps(1.12f),
           d3 = _mm512_set1_ps(1.13f), d4 = _mm512_set1_ps(1.14f), d5 = _mm512_set1_ps(1.15f),
           d6 = _mm512_set1_ps(1.16f), d7 = _mm512_set1_ps(1.17f);
#    define F512(x) _mm512_fmadd_ps(x, m, a)
    for (int64_t it = 0; it < iters; it++) {
        /* 16 independent chains of 4-cycle FMAs keep 2 FMA ports busy with room to spare. */
        PEAK_CHAINS8(c, F512);
        PEAK_CHAINS8(d, F512);
    }
#    undef F512
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                             _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7)));
    s = _mm512_add_ps(s,
                      _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(d0, d1), _mm512_add_ps(d2, d3)),
                                    _mm512_add_ps(_mm512_add_ps(d4, d5), _mm512_add_ps(d6, d7))));
    g_sink = _mm512_reduce_add_ps(s);
    return (double)iters * 16.0 * 16.0 * 2.0;
}

/* AVX2 has 16 ymm registers: 12 chains + 2 constants fit without spilling. */
__attribute__((target("avx2,fma"))) static double loop_avx2(int64_t iters) {
    const __m256 m = _mm256_set1_ps(0.999999f), a = _mm256_set1_ps(1e-6f);
    __m256 c0 = _mm256_set1_ps(1.00f), c1 = _mm256_set1_ps(1.01f), c2 = _mm256_set1_ps(1.02f),
           c3 = _mm256_set1_ps(1.03f), c4 = _mm256_set1_ps(1.04f), c5 = _mm256_set1_ps(1.05f),
           c6 = _mm256_set1_ps(1.06f), c7 = _mm256_set1_ps(1.07f);
    __m256 d0 = _mm256_set1_ps(1.10f), d1 = _mm256_set1_ps(1.11f), d2 = _mm256_set1_ps(1.12f),
           d3 = _mm256_set1_ps(1.13f);
#    define F256(x) _mm256_fmadd_ps(x, m, a)
    for (int64_t it = 0; it < iters; it++) {
        PEAK_CHAINS8(c, F256);
        d0 = F256(d0);
        d1 = F256(d1);
        d2 = F256(d2);
        d3 = F256(d3);
    }
#    undef F256
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)),
                             _mm256_add_ps(_mm256_add_ps(c4, c5), _mm256_add_ps(c6, c7)));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(d0, d1), _mm256_add_ps(d2, d3)));
    float out[8];
    _mm256_storeu_ps(out, s);
    g_sink = out[0] + out[7];
    return (double)iters * 12.0 * 8.0 * 2.0;
}

/* vdpbf16ps: per lane two bf16 products added into an f32 accumulator, i.e. 2 multiply-adds (4
 * FLOPs) per f32 lane, 64 FLOPs per zmm instruction; 16 independent chains as the FMA loop. */
__attribute__((target("avx512f,avx512bf16"))) static double loop_avx512bf16(int64_t iters) {
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3c00);
    __m512 c0 = _mm512_set1_ps(1.00f), c1 = _mm512_set1_ps(1.01f), c2 = _mm512_set1_ps(1.02f),
           c3 = _mm512_set1_ps(1.03f), c4 = _mm512_set1_ps(1.04f), c5 = _mm512_set1_ps(1.05f),
           c6 = _mm512_set1_ps(1.06f), c7 = _mm512_set1_ps(1.07f);
    __m512 d0 = _mm512_set1_ps(1.10f), d1 = _mm512_set1_ps(1.11f), d2 = _mm512_set1_ps(1.12f),
           d3 = _mm512_set1_ps(1.13f), d4 = _mm512_set1_ps(1.14f), d5 = _mm512_set1_ps(1.15f),
           d6 = _mm512_set1_ps(1.16f), d7 = _mm512_set1_ps(1.17f);
#    define DPBF(x) _mm512_dpbf16_ps(x, a, b)
    for (int64_t it = 0; it < iters; it++) {
        PEAK_CHAINS8(c, DPBF);
        PEAK_CHAINS8(d, DPBF);
    }
#    undef DPBF
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                             _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7)));
    s = _mm512_add_ps(s,
                      _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(d0, d1), _mm512_add_ps(d2, d3)),
                                    _mm512_add_ps(_mm512_add_ps(d4, d5), _mm512_add_ps(d6, d7))));
    g_sink = _mm512_reduce_add_ps(s);
    return (double)iters * 16.0 * 16.0 * 4.0;
}

static int cpu_has_avx512f(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}
static int cpu_has_avx2_fma(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif

#if defined(__aarch64__)
/* NEON (baseline on aarch64): 24 chains of 4-lane FMLA + 2 constants in the 32 registers. */
static double loop_neon(int64_t iters) {
    const float32x4_t m = vdupq_n_f32(0.999999f), a = vdupq_n_f32(1e-6f);
    float32x4_t c[24];
    for (int i = 0; i < 24; i++)
        c[i] = vdupq_n_f32(1.0f + (float)i * 0.01f);
    for (int64_t it = 0; it < iters; it++) {
#    pragma GCC unroll 24
        for (int i = 0; i < 24; i++)
            c[i] = vfmaq_f32(a, c[i], m);
    }
    float32x4_t s = c[0];
    for (int i = 1; i < 24; i++)
        s = vaddq_f32(s, c[i]);
    g_sink = vaddvq_f32(s);
    return (double)iters * 24.0 * 4.0 * 2.0;
}
#endif

/* Portable scalar loop: what the "generic" tier can hope for (no FMA contraction). */
static double loop_scalar(int64_t iters) {
    float c[8];
    for (int i = 0; i < 8; i++)
        c[i] = 1.0f + (float)i * 1e-3f;
    for (int64_t it = 0; it < iters; it++)
        for (int i = 0; i < 8; i++)
            c[i] = c[i] * 0.999999f + 1e-6f;
    g_sink = c[0] + c[7];
    return (double)iters * 8.0 * 2.0;
}

typedef struct worker {
    fma_loop_fn fn;
    int64_t iters;
    double flops;
    pthread_barrier_t *start;
} worker;

static void *run_worker(void *arg) {
    worker *w = arg;
    pthread_barrier_wait(w->start);
    w->flops = w->fn(w->iters);
    return NULL;
}

/* GFLOP/s of `threads` threads running fn concurrently, best of `reps`. */
static double measure(fma_loop_fn fn, int threads, double target_ms, int reps) {
    /* Calibrate the iteration count on one thread for ~target_ms. */
    int64_t iters = 1 << 16;
    for (;;) {
        double t0 = bench_now_s();
        fn(iters);
        double dt = bench_now_s() - t0;
        if (dt > 0.02 || iters > ((int64_t)1 << 40)) {
            iters = (int64_t)((double)iters * (target_ms * 1e-3) / (dt > 0 ? dt : 1e-9));
            break;
        }
        iters *= 4;
    }
    if (iters < 1)
        iters = 1;
    double best = 0.0;
    for (int r = 0; r < reps; r++) {
        pthread_barrier_t start;
        pthread_barrier_init(&start, NULL, (unsigned)threads + 1);
        worker *ws = calloc((size_t)threads, sizeof *ws);
        pthread_t *tid = calloc((size_t)threads, sizeof *tid);
        if (!ws || !tid) {
            free(ws);
            free(tid);
            return 0.0;
        }
        for (int t = 0; t < threads; t++) {
            ws[t] = (worker){fn, iters, 0.0, &start};
            pthread_create(&tid[t], NULL, run_worker, &ws[t]);
        }
        pthread_barrier_wait(&start);
        double t0 = bench_now_s();
        double flops = 0.0;
        for (int t = 0; t < threads; t++) {
            pthread_join(tid[t], NULL);
            flops += ws[t].flops;
        }
        double dt = bench_now_s() - t0;
        pthread_barrier_destroy(&start);
        free(ws);
        free(tid);
        double g = flops / dt * 1e-9;
        if (g > best)
            best = g;
    }
    return best;
}

double bench_clock_ghz(void) {
#if defined(__x86_64__)
    double best = 1e30;
    for (int run = 0; run < 25; run++) {
        uint64_t x = 3;
        const double t0 = bench_now_s();
        for (int i = 0; i < (1 << 20); i++)
            __asm__ volatile("imul %0, %0\n\timul %0, %0\n\timul %0, %0" : "+r"(x));
        const double t = bench_now_s() - t0;
        best = t < best ? t : best;
    }
    return 9.0 * (double)(1 << 20) / best * 1e-9;
#else
    return 0.0;
#endif
}

void bench_cpu_model(char *buf, size_t n) {
    snprintf(buf, n, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10) == 0) {
            char *c = strchr(line, ':');
            if (c) {
                c++;
                while (*c == ' ')
                    c++;
                c[strcspn(c, "\n")] = 0;
                snprintf(buf, n, "%s", c);
            }
            break;
        }
    }
    fclose(f);
}

typedef struct peak_loop {
    const char *isa;
    fma_loop_fn fn;
} peak_loop;

static const peak_loop loops[] = {
#if PEAK_X86
    {"avx512", loop_avx512},
    {"avx2", loop_avx2},
#endif
#if defined(__aarch64__)
    {"neon", loop_neon},
#endif
    {"scalar", loop_scalar},
};

int bench_peak_isa_count(void) {
    return (int)(sizeof loops / sizeof loops[0]);
}

const char *bench_peak_isa_name(int i) {
    return i >= 0 && i < bench_peak_isa_count() ? loops[i].isa : NULL;
}

int bench_peak_isa_usable(int i) {
    if (i < 0 || i >= bench_peak_isa_count())
        return 0;
#if PEAK_X86
    if (!strcmp(loops[i].isa, "avx512"))
        return cpu_has_avx512f();
    if (!strcmp(loops[i].isa, "avx2"))
        return cpu_has_avx2_fma();
#endif
    return 1;
}

double bench_peak_gflops(int i, int threads, double ms, int reps) {
    if (!bench_peak_isa_usable(i) || threads < 1)
        return 0.0;
    return measure(loops[i].fn, threads, ms, reps);
}

double bench_peak_bf16_gflops(int threads, double ms, int reps) {
#if PEAK_X86
    __builtin_cpu_init();
    if (threads >= 1 && __builtin_cpu_supports("avx512bf16"))
        return measure(loop_avx512bf16, threads, ms, reps);
#endif
    (void)threads, (void)ms, (void)reps;
    return 0.0;
}

double bench_peak_best_gflops(int threads, double ms, int reps, const char **isa) {
    for (int i = 0; i < bench_peak_isa_count(); i++)
        if (bench_peak_isa_usable(i)) {
            if (isa)
                *isa = loops[i].isa;
            return measure(loops[i].fn, threads, ms, reps);
        }
    return 0.0;
}
