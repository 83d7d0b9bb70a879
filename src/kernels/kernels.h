/* SPDX-License-Identifier: MIT */
/* kernels.h: the attention forward's work units and its dispatch (dispatch.c); the kernels'
 * prototypes come from the registry (kernels/registry.h).
 *
 * Every attention forward kernel has one signature: it computes one WORK UNIT, i.e. query rows
 * [i0, i1) of query heads [h0, h1) of batch row b (outputs, lse, probs of exactly those rows), with
 * per-thread scratch of mha__kernel_scratch_bytes() bytes. Kernels do not allocate, do not start
 * threads and read no globals; dispatch.c cuts the problem into units and hands them to threads.
 */
#ifndef MHA_KERNELS_H
#define MHA_KERNELS_H

#include "base/internal.h"

#include "base/cpu_features.h"

/* One unit of work. Flash kernels require [h0, h1) to be a whole number of head blocks (see
 * mha__flash_heads_per_block) and (h1 - h0 within a kv group) x (i1 - i0) <= Bq rows per block;
 * the reference requires i0 = 0, i1 = n. */
typedef struct mha__fwd_unit {
    int64_t b;
    int64_t h0, h1;
    int64_t i0, i1;
    int fresh; /* first unit of this scratch in this call: nothing in scratch is valid */
} mha__fwd_unit;

/* A registry line (kernels/registry.h). A forward kernel reads its blocking (bq, bk) from its line,
 * so that the block sizes are written only in registry.def. */
typedef struct mha__kernel_info mha__kernel_info;
typedef void (*mha__fwd_fn)(const mha__kernel_info *k,
                            const mha__problem *p,
                            const mha__fwd_unit *u,
                            void *scratch);

/* The plain reference core: rows [row_begin, row_end) of the flattened (b, h) pairs.
 * Uses `scratch` of m + 2 d_v floats per call. */
void mha__attention_ref(const mha__problem *p, int64_t bh_begin, int64_t bh_end, float *scratch);

/* ---------------------------------------------------------------------------------------------- */
/* Dispatch (dispatch.c).                                                                         */
/* ---------------------------------------------------------------------------------------------- */

/* The sizes selection and scratch depend on, read from (unvalidated) public args. */
typedef struct mha__fwd_shape {
    int64_t H, G, group, n, m, dk, dv;
    mha_dtype q_dt, k_dt, v_dt; /* storage of the inputs */
    int64_t chunk;              /* mask.chunk_size (0 = none; its key span sizes the scratch) */
    int causal;
} mha__fwd_shape;
void mha__fwd_shape_from_args(const mha_attention_args *a, mha__fwd_shape *s);

/* MHA_STATUS_OK when kernel k can run a problem of this shape on this CPU; otherwise
 * UNSUPPORTED with a message naming the reason. */
mha_status mha__kernel_check(const mha__kernel_info *k, const mha__fwd_shape *s, mha_error *err);
/* impl = AUTO or FAST: the kernel to run (honours MHA_KERNEL=<name>). FAST never returns the
 * reference unless MHA_KERNEL names it; fails with UNSUPPORTED and a message instead. */
mha_status mha__kernel_select(const mha__fwd_shape *s,
                              mha_impl impl,
                              const mha__kernel_info **out,
                              mha_error *err);
/* Per-thread scratch bytes kernel k needs for shape s (false on overflow). */
bool mha__kernel_scratch_bytes(const mha__kernel_info *k, const mha__fwd_shape *s, size_t *bytes);
/* Runs the whole problem with kernel k on team's threads. scratch holds team.n blocks of
 * scratch_stride bytes (>= mha__kernel_scratch_bytes). Balanced: units are assigned to threads by
 * their cost (causal/window tiles skipped), each output element is computed by one thread in an
 * order that does not depend on the thread count, so results are bit-identical for any count. */
mha_status mha__kernel_run(const mha__kernel_info *k,
                           const mha__problem *p,
                           mha__team team,
                           char *scratch,
                           size_t scratch_stride,
                           mha_error *err);

/* ---------------------------------------------------------------------------------------------- */
/* Vectorised elementwise primitives, exported for their ULP tests (tests/test_kernels.c).        */
/* y[i] = exp(x[i]) / tanh(x[i]) for i < count, with the kernels' own inline code. */
/* ---------------------------------------------------------------------------------------------- */
/* dst[i] = src[i] (dtype dt) widened to float32, i < count, exactly: mha__widen in the widest
 * vector form this CPU has under MHA_MAX_ISA (half_rows.c). */
void mha__widen_rows(mha_dtype dt, const void *src, float *dst, int64_t count);
/* dst[i] = src[i] rounded to dt (nearest even), i < count: mha__narrow's bits, vectorised. */
void mha__narrow_rows(mha_dtype dt, const float *src, void *dst, int64_t count);
#if defined(__x86_64__) || defined(__i386__)
void mha__widen_avx2(mha_dtype dt, const void *src, float *dst, int64_t count);
void mha__narrow_avx2(mha_dtype dt, const float *src, void *dst, int64_t count);
#elif defined(__aarch64__)
void mha__widen_neon(mha_dtype dt, const void *src, float *dst, int64_t count);
void mha__narrow_neon(mha_dtype dt, const float *src, void *dst, int64_t count);
#endif

#if defined(__x86_64__) || defined(__i386__)
void mha__vexp_avx512(const float *x, float *y, int64_t count);
void mha__vtanh_avx512(const float *x, float *y, int64_t count);
void mha__vexp_avx2(const float *x, float *y, int64_t count);
void mha__vtanh_avx2(const float *x, float *y, int64_t count);
/* The kernels' vectorised dropout keep bits (bit j = mha__dropout_keep(..., j0 + j), j < nk). */
void mha__dropout_bits_avx512(
    uint64_t seed, float p, int64_t b, int64_t h, int64_t i, int64_t j0, int nk, uint64_t *words);
void mha__dropout_bits_avx2(
    uint64_t seed, float p, int64_t b, int64_t h, int64_t i, int64_t j0, int nk, uint64_t *words);
#endif
#if defined(__aarch64__)
void mha__vexp_neon(const float *x, float *y, int64_t count);
void mha__vtanh_neon(const float *x, float *y, int64_t count);
void mha__dropout_bits_neon(
    uint64_t seed, float p, int64_t b, int64_t h, int64_t i, int64_t j0, int nk, uint64_t *words);
#endif

#endif /* MHA_KERNELS_H */
