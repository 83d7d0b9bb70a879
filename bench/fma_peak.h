/* SPDX-License-Identifier: MIT */
/* fma_peak.h: measured fp32 FMA peak of this machine, shared by the bench programs. */
#ifndef MHA_BENCH_FMA_PEAK_H
#define MHA_BENCH_FMA_PEAK_H

#include <stddef.h>

/* ISAs in decreasing order of width ("avx512", "avx2" on x86, "neon" on aarch64, "scalar"), some
 * maybe unusable here. */
int bench_peak_isa_count(void);
const char *bench_peak_isa_name(int i);
int bench_peak_isa_usable(int i);
/* GFLOP/s of `threads` threads running ISA i's FMA loop at once, best of `reps` runs of ~ms. */
double bench_peak_gflops(int i, int threads, double ms, int reps);
/* The bf16 dot-product peak (AVX512-BF16 vdpbf16ps: 4 FLOPs per f32 lane and instruction) of
 * `threads` threads, or 0 when the CPU lacks it: the denominator of the bf16-tile kernels'
 * "% of peak" (the FMA peak stays the f32 kernels'). */
double bench_peak_bf16_gflops(int threads, double ms, int reps);
/* The same for the widest usable ISA; *isa (if not NULL) gets its name. */
double bench_peak_best_gflops(int threads, double ms, int reps, const char **isa);
/* Monotonic clock in seconds, and a qsort comparator of doubles (for medians), shared by the
 * bench programs. */
double bench_now_s(void);
int bench_cmp_double(const void *a, const void *b);
/* The core clock in GHz, by a chain of 3 x 2^20 dependent 64-bit IMULs (3 cycles each on the
 * Intel and AMD cores of these hosts), best of 25 runs of ~1 ms (runs of ~17 ms on a shared host
 * read 1.7 instead of 3.0 GHz: preempted); 0 where the CPU is not x86-64. */
double bench_clock_ghz(void);
/* "model name" of /proc/cpuinfo, or "unknown". */
void bench_cpu_model(char *buf, size_t n);

#endif
