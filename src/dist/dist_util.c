/* SPDX-License-Identifier: MIT */
/* dist_util.c: the helpers of dist_util.h. */
#include "dist/dist_util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

void mha__dist_error(mha_error *err, mha_status status, const char *fmt, ...) {
    if (!err)
        return;
    err->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
}

void *mha__dist_alloc(const mha_allocator *a, size_t bytes) {
    if (bytes == 0) /* a rank with an empty shard: a valid pointer all the same */
        bytes = 1;
    if (a && a->alloc)
        return a->alloc(a->user, bytes, 64);
    return malloc(bytes);
}

void mha__dist_free(const mha_allocator *a, void *p) {
    if (!p)
        return;
    if (a && a->free)
        a->free(a->user, p);
    else
        free(p);
}
