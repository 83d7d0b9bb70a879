/* SPDX-License-Identifier: MIT */
/* harness.h: the shared test harness. Every test binary counts checks with CHECK(), ends with
 * test_finish(), which prints the plain closing line "N passed, N failed" and returns the exit
 * code. Counters are per process (tests are single-threaded programs). */
#ifndef MHA_TEST_HARNESS_H
#define MHA_TEST_HARNESS_H

#include "mha.h"

#include <stdint.h>
#include <stdio.h>

void test_record(int ok, const char *file, int line, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
/* Prints "N passed, N failed" and returns 0 when nothing failed, 1 otherwise. */
int test_finish(void);

#define CHECK(cond, ...) test_record((cond) ? 1 : 0, __FILE__, __LINE__, __VA_ARGS__)
/* Checks that a call returned MHA_STATUS_OK and prints its message if not. */
#define CHECK_OK(call, errp)                                                                       \
    do {                                                                                           \
        mha_status st_ = (call);                                                                   \
        test_record(st_ == MHA_STATUS_OK, __FILE__, __LINE__, "%s -> %s: %s", #call,               \
                    mha_status_string(st_), (errp)->message);                                      \
    } while (0)

/* MHA_TEST_QUICK set to a value that does not start with '0' (tools/test.sh sets it to 1 for the
 * sanitizer, valgrind and qemu runs): tests take their documented smaller sweeps. */
int test_quick(void);

/* 1 when this run's split-KV decode kernel (under MHA_MAX_ISA) is the generic one, the only
 * kernel on every tier that reads q8_0 caches in the key-interleaved order (cache/kv_cache.h):
 * results of the two orders are then bit-identical. */
int test_generic_decode(void);

/* Seeded xoshiro256** generator (deterministic across platforms). */
typedef struct test_rng {
    uint64_t s[4];
} test_rng;
void test_rng_seed(test_rng *r, uint64_t seed);
uint64_t test_rng_u64(test_rng *r);
double test_rng_uniform(test_rng *r); /* [0, 1) */
double test_rng_normal(test_rng *r);  /* N(0, 1) */
void test_fill_normal(test_rng *r, float *x, int64_t n, float stddev);

/* Path under the source tree (env MHA_SOURCE_DIR, set by ctest); returns a static-free buffer
 * the caller frees. */
char *test_source_path(const char *relative);

/* Max |a - b| and max |b| over n elements (NaN in a counts as infinite error). */
double test_max_abs_diff(const float *a, const double *b, int64_t n);
double test_max_abs(const double *b, int64_t n);

/* Runs self-attention layer L (q_dim = out_dim = E) over x [B, N, E] through a float32 KV cache:
 * mha_layer_prefill of the first `prefill` tokens, then mha_layer_decode_step one token at a
 * time, each step's output written at its rows of y [B, N, E]. A failing call is a failed check
 * (its rows of y are left as they were). */
void test_layer_decode_steps(
    mha_layer *L, const float *x, int64_t B, int64_t N, int64_t E, int64_t prefill, float *y);

#endif
