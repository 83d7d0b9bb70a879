/* SPDX-License-Identifier: MIT */
/* util.c: status strings, error messages, overflow-checked size arithmetic and allocation.
 * Nothing here keeps state: errors go into the caller's mha_error. */
#define _DEFAULT_SOURCE /* madvise, MADV_HUGEPAGE */
#include "base/internal.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#    include <sys/mman.h>
#endif

const char *mha_version(void) {
#define MHA_STR_(x)  #x
#define MHA_XSTR_(x) MHA_STR_(x)
    return MHA_XSTR_(MHA_VERSION_MAJOR) "." MHA_XSTR_(MHA_VERSION_MINOR) "." MHA_XSTR_(
        MHA_VERSION_PATCH);
#undef MHA_XSTR_
#undef MHA_STR_
}

const char *mha_status_string(mha_status status) {
    switch (status) {
#define MHA_STATUS_CASE_(name, value, text)                                                        \
    case MHA_STATUS_##name:                                                                        \
        return text;
        MHA_STATUS_MAP(MHA_STATUS_CASE_)
#undef MHA_STATUS_CASE_
    }
    return "unknown status";
}

size_t mha_dtype_size(mha_dtype dtype) {
    switch (dtype) {
    case MHA_DTYPE_F32:
        return 4;
    case MHA_DTYPE_F64:
        return 8;
    case MHA_DTYPE_F16:
        return 2;
    case MHA_DTYPE_BF16:
        return 2;
    case MHA_DTYPE_BOOL:
        return 1;
    case MHA_DTYPE_U8:
        return 1;
    case MHA_DTYPE_I32:
        return 4;
    case MHA_DTYPE_I64:
        return 8;
    case MHA_DTYPE_Q8_0: /* a block type: 34 bytes per 32 values, no element size */
        return 0;
    case MHA_DTYPE_Q4_0: /* a block type: 18 bytes per 32 values */
        return 0;
    case MHA_DTYPE_FP8_E4M3:
        return 1;
    }
    return 0;
}

mha_status mha__fail(mha_error *err, mha_status status, const char *fmt, ...) {
    if (err) {
        err->status = status;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof err->message, fmt, ap);
        va_end(ap);
    }
    return status;
}

void mha__ok(mha_error *err) {
    if (err) {
        err->status = MHA_STATUS_OK;
        err->message[0] = '\0';
    }
}

bool mha__mul_i64(int64_t a, int64_t b, int64_t *out) {
    if (a < 0 || b < 0)
        return false;
    if (a != 0 && b > INT64_MAX / a)
        return false;
    *out = a * b;
    return true;
}

bool mha__add_i64(int64_t a, int64_t b, int64_t *out) {
    if (a < 0 || b < 0 || a > INT64_MAX - b)
        return false;
    *out = a + b;
    return true;
}

bool mha__prod_i64(const int64_t *factors, int n, int64_t *out) {
    int64_t acc = 1;
    for (int i = 0; i < n; i++)
        if (!mha__mul_i64(acc, factors[i], &acc))
            return false;
    *out = acc;
    return true;
}

bool mha__bytes(int64_t count, size_t elem_size, size_t *out) {
    int64_t bytes;
    if (elem_size > (size_t)INT64_MAX || !mha__mul_i64(count, (int64_t)elem_size, &bytes) ||
        (uint64_t)bytes > (uint64_t)PTRDIFF_MAX)
        return false;
    *out = (size_t)bytes;
    return true;
}

void *mha__alloc(const mha_allocator *a, size_t bytes) {
    if (bytes == 0)
        bytes = 1;
    if (a && a->alloc)
        return a->alloc(a->user, bytes, 64);
    /* Round up so aligned_alloc's size rule (a multiple of the alignment) holds. */
    if (bytes > SIZE_MAX - 63)
        return NULL;
    return aligned_alloc(64, (bytes + 63) & ~(size_t)63);
}

static void advise_huge_pages(void *p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20;
    const uintptr_t begin = ((uintptr_t)p + huge - 1) & ~(huge - 1);
    const uintptr_t end = ((uintptr_t)p + bytes) & ~(huge - 1);
    if (end > begin)
        (void)madvise((void *)begin, (size_t)(end - begin), MADV_HUGEPAGE);
#else
    (void)p;
    (void)bytes;
#endif
}

void *mha__alloc_large(const mha_allocator *a, size_t bytes) {
    void *p = mha__alloc(a, bytes);
    if (p && !(a && a->alloc))
        advise_huge_pages(p, bytes);
    return p;
}

void mha__free(const mha_allocator *a, void *ptr) {
    if (!ptr)
        return;
    if (a && a->alloc) {
        if (a->free)
            a->free(a->user, ptr);
        return;
    }
    free(ptr);
}

bool mha__workspace_bytes(size_t need, size_t *out) {
    if (need > SIZE_MAX - MHA_WORKSPACE_SLACK)
        return false;
    *out = need + MHA_WORKSPACE_SLACK;
    return true;
}

mha_status mha__workspace_take(
    const mha_exec *exec, size_t need, const char *what, char **ws, char **owned, mha_error *err) {
    *owned = NULL;
    if (exec && exec->workspace) {
        const uintptr_t at = (uintptr_t)exec->workspace;
        const size_t skip = (size_t)(((at + 63) & ~(uintptr_t)63) - at);
        MHA_RETURN_IF(exec->workspace_bytes < skip || exec->workspace_bytes - skip < need, err,
                      WORKSPACE_TOO_SMALL,
                      "exec.workspace_bytes=%zu, %s needs %zu (the size its workspace query "
                      "reports)",
                      exec->workspace_bytes, what, need + MHA_WORKSPACE_SLACK);
        *ws = (char *)exec->workspace + skip;
        return MHA_STATUS_OK;
    }
    *ws = *owned = mha__alloc_large(exec ? exec->allocator : NULL, need);
    MHA_RETURN_IF(!*ws, err, NO_MEMORY, "cannot allocate a %zu-byte workspace for %s", need, what);
    return MHA_STATUS_OK;
}
