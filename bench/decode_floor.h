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

/* Bytes per cache row of FLOOR_D values (q8_0: 34-byte blocks). */
static inline long row_bytes(int dtype) {
    return dtype == FLOOR_F32    ? 4 * FLOOR_D
           : dtype == FLOOR_BF16 ? 2 * FLOOR_D
           : dtype == FLOOR_Q8_0 ? FLOOR_D / 32 * 34
                                 : FLOOR_D;
}

/* Runs pass 1 (pass = 1) or pass 3 (pass = 3) over the FLOOR_KEYS rows `reps` times; returns a
 * value of the results (so that nothing is left out). Only call where the CPU has the ISA. */
float bench_floor_avx512(const floor_data *fd, int dtype, int pass, int reps);
float bench_floor_avx2(const floor_data *fd, int dtype, int pass, int reps);

/* In an ISA's file, after its inline pass1(DT, fd, reps) and pass3(DT, fd, reps): one
 * non-inlined instance per (pass, dtype), so that each loop is compiled with its dtype constant,
 * and the entry point `entry` (bench_floor_avx512, ...). */
#define FLOOR_ENTRY_(entry)                                                                        \
    FLOOR_FNS_(f32, FLOOR_F32)                                                                     \
    FLOOR_FNS_(bf16, FLOOR_BF16)                                                                   \
    FLOOR_FNS_(q8, FLOOR_Q8_0)                                                                     \
    FLOOR_FNS_(fp8, FLOOR_FP8)                                                                     \
    float entry(const floor_data *fd, int dtype, int pass, int reps) {                             \
        static float (*const p1[FLOOR_NDTYPES])(const floor_data *, int) = {p1_f32, p1_bf16,       \
                                                                            p1_q8, p1_fp8};        \
        static float (*const p3[FLOOR_NDTYPES])(const floor_data *, int) = {p3_f32, p3_bf16,       \
                                                                            p3_q8, p3_fp8};        \
        return (pass == 1 ? p1 : p3)[dtype](fd, reps);                                             \
    }
#define FLOOR_FNS_(tag, dt)                                                                        \
    static __attribute__((noinline)) float p1_##tag(const floor_data *fd, int reps) {              \
        return pass1(dt, fd, reps);                                                                \
    }                                                                                              \
    static __attribute__((noinline)) float p3_##tag(const floor_data *fd, int reps) {              \
        return pass3(dt, fd, reps);                                                                \
    }

#endif
