/* SPDX-License-Identifier: MIT */
/* bench_q8_interleaved.c: `mha_bench_q8_interleaved`, a KEY-INTERLEAVED q8_0 KV-cache layout
 * decoded with AVX-512 VNNI (VPDPBUSD), to float32 accuracy: how close an 8-bit cache decode step
 * can come to the read bandwidth (issue 32: "q8_0 cache decode >= 80% of read bandwidth") when
 * the cache is laid out for the instruction. A prototype for a later kernel: the library's q8_0
 * cache keeps q8_0 rows and its kernel widens them to float32 (docs/INFERENCE.md);
 * `mha_bench_decode_floor` measures that kernel's floor (20.4 ns per (key, kv head) on the
 * Emerald Rapids host, bench/results/decode-floor-20261129-emr-s44.txt).
 *
 * Shape (decode, issue 32): per kv head 4 query rows (grouped-query attention), d = 128, q8_0
 * blocks of 32 values with a float16 scale; K + V = 2 x 136 = 272 bytes per (key, kv head).
 *
 * Layouts, per kv head, in superblocks of 16 keys, 2176 bytes each (= 16 q8_0 rows):
 *   K: [block b 0..3][group j 0..7][key 0..15][k[key][32b + 4j .. +3]] (2048 bytes), then the
 *      scales [b][key] (128 bytes). The bytes are stored biased, k + 128 as u8. One 64-byte load
 *      holds 4 d of 16 keys: a VPDPBUSD against a broadcast dword of 4 query values gives 16
 *      keys' partial dot products, no horizontal sums.
 *   V: [group g of 4 keys][d 0..127][v[4g + t][d], t 0..3] (2048 bytes), then the scales
 *      [b][key]. One 64-byte load holds 4 keys of 16 d: a VPDPBUSD against a broadcast dword of
 *      the 4 keys' weights adds 4 keys into 16 outputs. Signed (plain pass 3) or biased (S).
 *
 * The digit split (VPDPBUSD multiplies u8 by s8 bytes, so a float32 operand goes in as three):
 *   pass 1: row x's q is scaled by 2^e (max |q| 2^e at most 127 (2^16 + 2^8 + 1)) and rounded,
 *     Q = round(q 2^e) = h 2^16 + m 2^8 + l with balanced digits h, m, l in [-128, 127] (signed,
 *     the broadcast operand); per block, acc_digit = sum (k + 128) digit - 128 sum digit (the
 *     offset precomputed per query), exact in int32; score = 2^-e sum_b scale_kb (acc_h 2^16 +
 *     (acc_m 2^8 + acc_l)) in float32 (12 VPDPBUSD chains, 4 rows x 3 digits, 8 steps per block).
 *   pass 3, plain: w = p scale_vb per (key, block), p the softmax weight in (0, 1]; per chunk and
 *     block, W = round(w 2^e_b) < 2^24 (e_b from the chunk's largest scale), its 3 bytes unsigned
 *     digits (VPERMB) against signed v; o += 2^-e_b (acc_h 2^16 + acc_m 2^8 + acc_l).
 *   pass 3, variant S: the same W + 0x808080 (one FMA), bytes ^ 0x80 = balanced signed digits,
 *     broadcast from memory inside the VPDPBUSD (no VPBROADCASTD), v biased u8; the offset
 *     128 sum digit comes from a VPDPBUSD of the digits against ones.
 *   So the scores and outputs carry ~24 bits: checked against float64 below (FAIL > 2^-20).
 *
 * What it runs (1 thread; pin it with taskset):
 *   the check: pass 1 and both pass 3 variants against float64 on 4096 and 256 keys (and a
 *     float32 FMA loop for comparison), and the same passes over ggml's q8_0 rows reordered in
 *     registers (pass1_rows, pass3_rows_chunk) against the interleaved ones bit for bit; exits 1
 *     on FAIL.
 *   default, the L1 floor: 64 keys reused, ns per (key, kv head) of pass 1, pass 3 (chunks of 64
 *     keys with the final conversion, a long chunk, its weight building and dot products apart),
 *     pass 3 S the same, best and median of 61 runs, cycles at the clock measured here
 *     (bench_clock_ghz); comparable with `mha_bench_decode_floor`'s q8_0 pass 1 + pass 3.
 *   --big: the whole step (pass 1, the online softmax, pass 3 per chunk of keys) over a cache of
 *     --keys keys (default 131072) x --heads kv heads (8: 285 MB), beside a plain read loop of
 *     the same bytes in the same run (interleaved, 9 runs, medians): GB/s, ns and cycles per
 *     (key, kv head), and the read loop's time as a share of the step's. The software prefetch
 *     is split by phase: a chunk's V during its pass 1, the next chunk's K during pass 3
 *     (--no-prefetch drops it); --chunk C keys per chunk (64), --pass3-s runs variant S,
 *     --rows reads ggml's q8_0 rows (136 bytes per key and kv head, K rows then V rows per kv
 *     head) and reorders them in registers instead: can the library keep its rows?
 *     (docs/INFERENCE.md: no, 59-72% of the read loop against 81-83%).
 *     --threads 2 splits the kv heads (and the read loop's bytes) between two threads.
 *
 * Usage: mha_bench_q8_interleaved [--big [--keys N] [--heads H] [--chunk C] [--pass3-s]
 *                                  [--no-prefetch] [--rows] [--threads 1|2]]
 * Needs AVX512F/BW/VL, AVX512-VNNI, AVX512-VBMI (VPERMB) and F16C (Intel Ice Lake and later
 * servers, AMD Zen 4 and later); elsewhere it prints "skipped" and exits 0. */
#define _POSIX_C_SOURCE 200809L
#include "fma_peak.h"
#include "q8_interleaved.h"

#include <cpuid.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* F16C (CPUID.1:ECX bit 29): clang 14's __builtin_cpu_supports does not know it */
static int has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1);
}

static int usage(void) {
    fprintf(stderr, "usage: mha_bench_q8_interleaved [--big [--keys N] [--heads H] [--chunk C] "
                    "[--pass3-s] [--no-prefetch] [--rows] [--threads 1|2]]\n");
    return 2;
}

int main(int argc, char **argv) {
    int big = 0, keys = 131072, heads = 8, chunk = 64, pass3_s = 0, prefetch = 1, rows = 0,
        threads = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--big"))
            big = 1;
        else if (!strcmp(argv[i], "--keys") && i + 1 < argc)
            keys = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--heads") && i + 1 < argc)
            heads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--chunk") && i + 1 < argc)
            chunk = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--pass3-s"))
            pass3_s = 1;
        else if (!strcmp(argv[i], "--no-prefetch"))
            prefetch = 0;
        else if (!strcmp(argv[i], "--rows"))
            rows = 1;
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else
            return usage();
    }
    /* chunk: whole superblocks, at most 65536 keys (the int32 digit sums of pass 3) */
    if (chunk < 16 || chunk > 65536 || chunk % 16 || keys < chunk || keys % chunk || heads < 1 ||
        threads < 1 || threads > 2 || (double)keys * heads * 272 > 0x1p40) {
        fprintf(stderr, "mha_bench_q8_interleaved: --chunk a multiple of 16 up to 65536, --keys a "
                        "multiple of it, --heads >= 1, --threads 1 or 2\n");
        return 2;
    }
    __builtin_cpu_init();
    const struct {
        const char *name;
        int has;
    } need[] = {{"avx512f", __builtin_cpu_supports("avx512f")},
                {"avx512bw", __builtin_cpu_supports("avx512bw")},
                {"avx512vl", __builtin_cpu_supports("avx512vl")},
                {"avx512vnni", __builtin_cpu_supports("avx512vnni")},
                {"avx512vbmi", __builtin_cpu_supports("avx512vbmi")},
                {"f16c", has_f16c()}};
    const char *missing = NULL;
    for (size_t i = 0; i < sizeof need / sizeof need[0] && !missing; i++)
        if (!need[i].has)
            missing = need[i].name;
    if (missing) {
        printf("mha_bench_q8_interleaved: skipped: no AVX512-VNNI (needs AVX512F/BW/VL/VNNI/VBMI "
               "and F16C; this CPU lacks %s)\n",
               missing);
        return 0;
    }
    char cpu[128];
    bench_cpu_model(cpu, sizeof cpu);
    const double ghz = bench_clock_ghz();
    printf("# %s; clock %.2f GHz (IMUL chain); 1 thread; per (key, kv head): 4 query rows, d 128, "
           "q8_0 K and V interleaved for VPDPBUSD\n",
           cpu, ghz);
    if (q8i_check())
        return 1;
    if (!big) {
        q8i_floor(ghz);
        return 0;
    }
    return q8i_big(keys, heads, chunk, pass3_s, prefetch, rows, threads, ghz);
}
