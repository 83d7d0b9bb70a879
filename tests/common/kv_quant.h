/* SPDX-License-Identifier: MIT */
/* kv_quant.h: the checks the 8-bit KV caches' tests share (test_kv_q8.c, test_kv_fp8.c): an
 * 8-bit cache's attention against the float64 attention over the values it stores (dequantised)
 * and over the original ones, with the quantisation's bound computed from the data. */
#ifndef MHA_TEST_KV_QUANT_H
#define MHA_TEST_KV_QUANT_H

#include "mha.h"

#include <stdint.h>

/* h query heads over g kv heads of head_dim d, L tokens, window (0 = none). */
typedef struct kvq_case {
    int64_t H, G, d, L, window;
} kvq_case;

/* The dtype's bound on |read - original| of each value of one stored row: row [d] of kv head g
 * (is_v: a value row, else a key row) into bound [d]. ctx: the test's own data (scales). */
typedef void (*kvq_bound_fn)(
    const float *row, int64_t d, int64_t g, int is_v, const void *ctx, double *bound);

/* Appends k and v ([L, G, d] each; appends of <= 50 tokens) to sequence 0 of the empty 8-bit
 * cache c, then checks, for the visible keys (the last `window` under a window):
 *   1. every read value within bound() of the original;
 *   2. mha_kv_cache_attention of q [H, d] (AUTO, the tier MHA_MAX_ISA allows; REFERENCE) against
 *      the float64 attention over the READ (dequantised) values: TOL_OUT_REL of max|o|, and 1, 2
 *      and 3 threads bit-identical;
 *   3. against the float64 attention over the ORIGINAL values, per head: with
 *      Delta = scale ||q_h||_1 max e_k, |o - o*| <= (exp(2 Delta) - 1) max|v| + max e_v
 *      (e_k, e_v the bounds of 1.), plus TOL_OUT_REL of max|o|.
 * Prints one line, prefixed by label, with the worst ratios. */
void kvq_check_attention(mha_kv_cache *c,
                         const kvq_case *ac,
                         const float *k,
                         const float *v,
                         const float *q,
                         kvq_bound_fn bound,
                         const void *ctx,
                         const char *label);

/* max_i |a_i| in double, NaN when some a_i is NaN. */
double kvq_max_abs(const float *a, int64_t n);

/* Both NaN, or the same bits. */
int kvq_same_bits(float a, float b);

/* *a = the core's arguments of one query over one key (1 head of d = 64), q = k = v = x [64],
 * out o [64], no mask: for the refusals of a cache-only dtype in the core's dtype fields. */
void kvq_core_args_1x1(mha_attention_args *a, const float *x, float *o);

/* st is an error whose message contains needle. */
void kvq_expect_refused(mha_status st, const mha_error *err, const char *needle, const char *what);

#endif
