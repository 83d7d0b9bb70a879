/* SPDX-License-Identifier: MIT */
/* dist_util.h: what ring.c and ring_layer.c share (internal to libmha_mpi): setting an mha_error,
 * and scratch from the caller's allocator (mha_exec.allocator, or malloc when it is NULL). */
#ifndef MHA_DIST_UTIL_H
#define MHA_DIST_UTIL_H

#include "mha.h"

#include <stddef.h>

/* err->status = status, err->message = the formatted text (err may be NULL). */
void mha__dist_error(mha_error *err, mha_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* `bytes` from a (64-byte aligned), or malloc without one; NULL when out of memory. bytes = 0
 * (a rank with an empty shard) asks for 1 byte: never NULL but for lack of memory. */
void *mha__dist_alloc(const mha_allocator *a, size_t bytes);

/* Frees what mha__dist_alloc returned (NULL is a no-op). */
void mha__dist_free(const mha_allocator *a, void *p);

#endif /* MHA_DIST_UTIL_H */
