/* SPDX-License-Identifier: MIT */
/* bench_decode_floor.c: `mha_bench_decode_floor`, the instruction floor of the decode step's two
 * passes per (key, kv head), per x86 tier and cache dtype (decode_floor.h): what issue 32's
 * "8-bit caches at >= 80% of the read bandwidth" asks of a core, measured rather than counted
 * (docs/INFERENCE.md, "The instruction floor of the 8-bit caches").
 *
 * Prints, per tier and dtype, pass 1 and pass 3 in ns per (key, kv head), their sum in cycles
 * of the clock measured here (a chain of dependent 64-bit IMULs, 3 cycles each on the Intel and
 * AMD cores of these hosts), and the K + V bytes per second this floor could stream. With
 * --read-gbs G (the read bandwidth, e.g. `mha decode-bench --stream 1024`'s, with prefetch), also
 * the budget of 80% of G per (key, kv head) and the floor as a share of it: above 100%, the
 * target is out of this core's reach even before the sums, the softmax and the memory.
 *
 * Usage: mha_bench_decode_floor [--read-gbs G] [--runs R]   (1 thread; pin it with taskset) */
#define _POSIX_C_SOURCE 200809L
#include "decode_floor.h"
#include "fma_peak.h"

#include <cpuid.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* F16C (CPUID.1:ECX bit 29): clang 14's __builtin_cpu_supports does not know it */
static int has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1);
}

static const char *const dtype_name[FLOOR_NDTYPES] = {"f32", "bf16", "q8_0", "fp8"};

/* finite, normal values of each dtype, FLOOR_KEYS rows (the driver owns the buffers) */
static void
fill(floor_data *fd, void *buf[FLOOR_NDTYPES], float *ks, float *q, float *w, float *o) {
    float *f = buf[FLOOR_F32];
    uint16_t *h = buf[FLOOR_BF16];
    unsigned char *b8 = buf[FLOOR_Q8_0], *e4 = buf[FLOOR_FP8];
    for (int i = 0; i < FLOOR_KEYS * FLOOR_D; i++) {
        f[i] = (float)(i % 13) * 1e-2f - 0.06f;
        h[i] = (uint16_t)(0x3C00 + i % 255);                           /* bfloat16 around 2^-7 */
        e4[i] = (unsigned char)(0x08 + i % 0x70) ^ (i & 1 ? 0x80 : 0); /* normal e4m3, no NaN */
    }
    for (int blk = 0; blk < FLOOR_KEYS * FLOOR_D / 32; blk++) {
        const uint16_t d = (uint16_t)(0x2000 + blk % 1024); /* finite float16 scales */
        memcpy(b8 + blk * 34, &d, 2);
        ks[blk] = (float)(1 + blk % 1024) * 0x1p-17f; /* any finite scales: only the cost counts */
        for (int i = 0; i < 32; i++)
            b8[blk * 34 + 2 + i] = (unsigned char)((blk * 17 + i * 5) % 255);
    }
    for (int i = 0; i < FLOOR_ROWS * FLOOR_D; i++) {
        q[i] = (float)(i % 7 - 3) * 1e-2f;
        o[i] = 0.0f;
    }
    for (int i = 0; i < FLOOR_KEYS * FLOOR_ROWS * 4; i++)
        w[i] = (float)(i % 9 + 1) * 1e-3f;
    for (int t = 0; t < FLOOR_NDTYPES; t++)
        fd->k[t] = buf[t];
    fd->ks = ks;
    fd->q = q;
    fd->w = w;
    fd->o = o;
}

typedef float (*floor_fn)(const floor_data *, int, int, int);

/* median ns per (key, kv head) of `runs` runs of ~20 ms */
static double time_pass(floor_fn fn, const floor_data *fd, int dt, int pass, int runs) {
    enum { REPS = 30000 };
    volatile float sink = 0.0f;
    double t[32];
    fn(fd, dt, pass, REPS / 10); /* warm-up */
    for (int r = 0; r < runs; r++) {
        const double t0 = bench_now_s();
        sink += fn(fd, dt, pass, REPS);
        t[r] = (bench_now_s() - t0) / ((double)REPS * FLOOR_KEYS) * 1e9;
    }
    (void)sink;
    qsort(t, (size_t)runs, sizeof t[0], bench_cmp_double);
    return t[runs / 2];
}

int main(int argc, char **argv) {
    double read_gbs = 0.0;
    int runs = 5;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--read-gbs") && i + 1 < argc)
            read_gbs = atof(argv[++i]);
        else if (!strcmp(argv[i], "--runs") && i + 1 < argc)
            runs = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: mha_bench_decode_floor [--read-gbs G] [--runs R]\n");
            return 2;
        }
    }
    if (runs < 1 || runs > 32 || read_gbs < 0.0) {
        fprintf(stderr, "mha_bench_decode_floor: --runs 1..32, --read-gbs >= 0\n");
        return 2;
    }
    __builtin_cpu_init();
    const int has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                       has_f16c();
    const int has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    void *buf[FLOOR_NDTYPES];
    for (int t = 0; t < FLOOR_NDTYPES; t++)
        buf[t] = aligned_alloc(64, 4 * FLOOR_KEYS * FLOOR_D);
    float *ks = aligned_alloc(64, sizeof(float) * FLOOR_KEYS * FLOOR_D / 32);
    float *q = aligned_alloc(64, sizeof(float) * FLOOR_ROWS * FLOOR_D);
    float *w = aligned_alloc(64, sizeof(float) * FLOOR_KEYS * FLOOR_ROWS * 4);
    float *o = aligned_alloc(64, sizeof(float) * FLOOR_ROWS * FLOOR_D);
    floor_data fd;
    fill(&fd, buf, ks, q, w, o);

    char cpu[128];
    bench_cpu_model(cpu, sizeof cpu);
    const double ghz = bench_clock_ghz();
    printf("# %s; clock %.2f GHz (IMUL chain); 1 thread; per (key, kv head): 4 query rows, d 128\n",
           cpu, ghz);
    printf("# FMAs of both passes: 4 x 128 x 2 = 1024 multiply-adds; rows in the L1, no sums, "
           "no softmax, no memory\n");
    if (read_gbs > 0.0)
        printf("# budget: 80%% of %.2f GB/s = the K + V bytes per (key, kv head) / %.2f GB/s\n",
               read_gbs, 0.8 * read_gbs);
    printf("%-7s %-5s %9s %9s %9s %9s %10s", "tier", "cache", "pass1 ns", "pass3 ns", "sum ns",
           "cycles", "GB/s");
    if (read_gbs > 0.0)
        printf(" %10s %8s", "budget ns", "% of it");
    printf("\n");
    const struct {
        const char *name;
        int usable;
        floor_fn fn;
    } tiers[] = {{"avx512", has512, bench_floor_avx512}, {"avx2", has2, bench_floor_avx2}};
    for (size_t i = 0; i < sizeof tiers / sizeof tiers[0]; i++) {
        if (!tiers[i].usable) {
            printf("%-7s (not on this CPU)\n", tiers[i].name);
            continue;
        }
        for (int dt = 0; dt < FLOOR_NDTYPES; dt++) {
            const double p1 = time_pass(tiers[i].fn, &fd, dt, 1, runs),
                         p3 = time_pass(tiers[i].fn, &fd, dt, 3, runs), sum = p1 + p3;
            const double kv_bytes = 2.0 * (double)row_bytes(dt); /* K + V per (key, kv head) */
            printf("%-7s %-5s %9.2f %9.2f %9.2f %9.1f %10.1f", tiers[i].name, dtype_name[dt], p1,
                   p3, sum, sum * ghz, kv_bytes / sum);
            if (read_gbs > 0.0) {
                const double budget = kv_bytes / (0.8 * read_gbs);
                printf(" %10.2f %7.0f%%", budget, 100.0 * sum / budget);
            }
            printf("\n");
        }
    }
    for (int t = 0; t < FLOOR_NDTYPES; t++)
        free(buf[t]);
    free(ks);
    free(q);
    free(w);
    free(o);
    return 0;
}
