/* SPDX-License-Identifier: MIT */
/* q8_interleaved.h: the AVX-512 VNNI part of `mha_bench_q8_interleaved` (q8_interleaved_vnni.c,
 * compiled with its ISA flags; bench_q8_interleaved.c checks the CPU before calling it). */
#ifndef MHA_BENCH_Q8_INTERLEAVED_H
#define MHA_BENCH_Q8_INTERLEAVED_H

/* The float64 reference check of pass 1 and both pass 3 variants; prints the errors, returns 0
 * when every VNNI error is within 2^-20 relative, 1 otherwise. */
int q8i_check(void);
/* The L1-resident floor: ns per (key, kv head) of each pass, cycles at `ghz`. */
void q8i_floor(double ghz);
/* The whole step over a cache of keys x heads (kv heads) beside a plain read loop of the same
 * bytes: chunk keys per chunk, pass3_s: pass 3 variant S, prefetch: the phase-split software
 * prefetch, rows: ggml's q8_0 rows reordered in registers (pass1_rows, pass3_rows_chunk) in place
 * of the interleaved layout, threads: 1 or 2 (the kv heads split between them; the read loop
 * likewise). Returns 0, or 1 when the step's sanity check fails. */
int q8i_big(
    int keys, int heads, int chunk, int pass3_s, int prefetch, int rows, int threads, double ghz);

#endif
