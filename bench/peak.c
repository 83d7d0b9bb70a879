/* SPDX-License-Identifier: MIT */
/* peak.c: `mha_peak` prints this machine's measured fp32 FMA peak per ISA on 1 and T threads
 * (fma_peak.c has the method). bench/bench_layer.py runs it in the same run as the kernels.
 *
 * Usage: mha_peak [--threads T] [--ms MS] [--reps R] [--isa avx512|avx2|neon|scalar] [--json] */
#define _POSIX_C_SOURCE 200809L
#include "fma_peak.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = ncpu > 0 ? (int)ncpu : 1;
    double ms = 150.0;
    int reps = 5;
    const char *only = NULL;
    int json = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ms") && i + 1 < argc)
            ms = atof(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--isa") && i + 1 < argc)
            only = argv[++i];
        else if (!strcmp(argv[i], "--json"))
            json = 1;
        else {
            fprintf(stderr,
                    "usage: mha_peak [--threads T] [--ms MS] [--reps R] [--isa NAME] [--json]\n"
                    "  measures fp32 FMA throughput (GFLOP/s) per ISA on 1 and T threads\n"
                    "  (default T = online CPUs = %ld, MS = 150 per repetition, R = 5;\n"
                    "  --isa avx512|avx2|neon|scalar measures only that ISA)\n",
                    ncpu);
            return 2;
        }
    }
    if (threads < 1)
        threads = 1;
    char model[256];
    bench_cpu_model(model, sizeof model);
    const int nl = bench_peak_isa_count();
    if (json)
        printf("{\"cpu\": \"%s\", \"threads\": %d, \"peak\": [", model, threads);
    else
        printf("# fp32 FMA peak, measured (best of %d x %.0f ms), CPU: %s\n"
               "# FLOPs = 2 x lanes x FMAs; 16 (AVX2: 12) independent chains per thread\n"
               "%-8s %8s %12s\n",
               reps, ms, model, "isa", "threads", "GFLOP/s");
    int first = 1;
    for (int l = 0; l < nl; l++) {
        if (!bench_peak_isa_usable(l) || (only && strcmp(only, bench_peak_isa_name(l))))
            continue;
        int counts[2] = {1, threads};
        for (int c = 0; c < (threads > 1 ? 2 : 1); c++) {
            double g = bench_peak_gflops(l, counts[c], ms, reps < 1 ? 1 : reps);
            if (json)
                printf("%s{\"isa\": \"%s\", \"threads\": %d, \"gflops\": %.2f}", first ? "" : ", ",
                       bench_peak_isa_name(l), counts[c], g);
            else
                printf("%-8s %8d %12.1f\n", bench_peak_isa_name(l), counts[c], g);
            first = 0;
        }
    }
    /* The bf16 dot-product peak (what the bf16-tile kernels are measured against). */
    for (int c = 0; c < (threads > 1 ? 2 : 1) && !only; c++) {
        const int t = c ? threads : 1;
        const double g = bench_peak_bf16_gflops(t, ms, reps < 1 ? 1 : reps);
        if (g <= 0.0)
            break;
        if (json)
            printf(", {\"isa\": \"avx512bf16-dot\", \"threads\": %d, \"gflops\": %.2f}", t, g);
        else
            printf("%-8s %8d %12.1f  (vdpbf16ps: 4 FLOPs per lane)\n", "bf16dot", t, g);
    }
    if (json)
        printf("]}\n");
    return 0;
}
