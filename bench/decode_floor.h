/* SPDX-License-Identifier: MIT */
/* decode_floor.h: the instruction floor of the decode kernels' two passes (bench_decode_floor.c).
 * Per (key, kv head) of the issue-32 shape (4 query rows per kv head, d = 128): pass 1 widens
 * the key's 128 values as the kernel does and takes 4 x 128 FMAs into 8 accumulator chains (no
 * horizontal sums), pass 3 widens the value's 128 values and takes 4 x 128 FMAs with the weights
 * broadcast from memory (16 accumulators per 64 columns, as the kernel's pass 3). The rows sit in
 * the L1 and are reused: no memory traffic, no softmax, no sums, no prefetch, no loop over units.
 * So a whole decode step can not run faster than pass 1 + pass 3 of this, per key and kv head. */
#ifndef MHA_BENCH_DECODE_FLOOR_H
#define MHA_BENCH_DECODE_FLOOR_H

enum { FLOOR_F32, FLOOR_BF16, FLOOR_Q8_0, FLOOR_FP8, FLOOR_NDTYPES };
enum { FLOOR_KEYS = 64, FLOOR_D = 128, FLOOR_ROWS = 4 };

/* The L1-resident operands, filled by the driver (finite, normal values of each dtype). */
typedef struct floor_data {
    const void *k[FLOOR_NDTYPES]; /* FLOOR_KEYS rows of the dtype (q8_0: 34-byte blocks) */
    const float *ks;              /* q8_0: the FLOOR_KEYS x 4 block scales as float32 */
    const float *q;               /* FLOOR_ROWS x FLOOR_D */
    const float *w;               /* FLOOR_KEYS x FLOOR_ROWS x 4 (q8_0: a weight per block) */
    float *o;                     /* FLOOR_ROWS x FLOOR_D */
} floor_data;

/* Runs pass 1 (pass = 1) or pass 3 (pass = 3) over the FLOOR_KEYS rows `reps` times; returns a
 * value of the results (so that nothing is left out). Only call where the CPU has the ISA. */
float bench_floor_avx512(const floor_data *fd, int dtype, int pass, int reps);
float bench_floor_avx2(const floor_data *fd, int dtype, int pass, int reps);

#endif
