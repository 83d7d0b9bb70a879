/* SPDX-License-Identifier: MIT */
/* check/overlap.c: the aliasing rule of every public call. Each output's byte range, from its
 * first to one past its last reachable element (the strides included), must not overlap the
 * range of any input or of another output: a partial overlap is refused as well as the same
 * pointer. The exceptions a call supports are its own (mha_rope_apply rotates x in place,
 * mha_attention_merge writes o over exactly o_a or o_b): docs/SEMANTICS.md, "Aliasing". */
#include "check/check.h"

#include <stdint.h>
#include <stdio.h>

mha__span mha__span_of(const char *name, const void *ptr, int64_t count, size_t elem) {
    mha__span s = {name, 0, 0};
    if (!ptr || count <= 0)
        return s; /* empty: overlaps nothing */
    s.lo = (uintptr_t)ptr;
    if ((uint64_t)count > UINTPTR_MAX / (elem ? elem : 1)) {
        s.hi = UINTPTR_MAX; /* more bytes than an address holds: reaches every later byte */
        return s;
    }
    const uintptr_t bytes = (uintptr_t)count * (uintptr_t)elem;
    s.hi = s.lo + bytes < s.lo ? UINTPTR_MAX : s.lo + bytes;
    return s;
}

int64_t mha__count3(int64_t a, int64_t b, int64_t c) {
    int64_t t;
    return mha__mul_i64(a, b, &t) && mha__mul_i64(t, c, &t) && t <= INT64_MAX / 8 ? t : 0;
}

static bool overlap(const mha__span *a, const mha__span *b) {
    return a->lo < a->hi && b->lo < b->hi && a->lo < b->hi && b->lo < a->hi;
}

mha_status mha__check_no_overlap(
    const mha__span *outs, int n_out, const mha__span *ins, int n_in, mha_error *err) {
    for (int i = 0; i < n_out; i++) {
        for (int j = 0; j < n_in; j++)
            MHA_RETURN_IF(overlap(&outs[i], &ins[j]), err, INVALID_ARG,
                          "%s overlaps %s in memory: an output must not alias an input "
                          "(%s [%p, +%llu bytes), %s [%p, +%llu bytes))",
                          outs[i].name, ins[j].name, outs[i].name, (void *)outs[i].lo,
                          (unsigned long long)(outs[i].hi - outs[i].lo), ins[j].name,
                          (void *)ins[j].lo, (unsigned long long)(ins[j].hi - ins[j].lo));
        for (int j = i + 1; j < n_out; j++)
            MHA_RETURN_IF(overlap(&outs[i], &outs[j]), err, INVALID_ARG,
                          "%s overlaps %s in memory: outputs must not alias each other",
                          outs[i].name, outs[j].name);
    }
    return MHA_STATUS_OK;
}

mha_status mha__check_layout_disjoint(
    const char *name, const int64_t *sizes, const int64_t *strides, int ndim, mha_error *err) {
    enum { MAX_DIMS = 8 };
    int64_t ext[MAX_DIMS], mag[MAX_DIMS];
    int k = 0;
    for (int d = 0; d < ndim && d < MAX_DIMS; d++) {
        if (sizes[d] <= 1)
            continue; /* a dimension of one element never steps: its stride is never used */
        const int64_t m = strides[d] < 0 ? -strides[d] : strides[d]; /* INT64_MIN refused before */
        int i = k++;
        for (; i > 0 && mag[i - 1] > m; i--) /* insertion sort by |stride| */
            ext[i] = ext[i - 1], mag[i] = mag[i - 1];
        ext[i] = sizes[d], mag[i] = m;
    }
    /* need: the least |stride| the next dimension may have (the span of the ones below it) */
    int64_t need = 1;
    for (int i = 0; i < k; i++) {
        if (mag[i] < need) {
            char sz[8 * 22 + 1] = "", st[8 * 22 + 1] = "";
            int ps = 0, pt = 0;
            for (int d = 0; d < ndim && d < MAX_DIMS; d++) { /* 8 x 22 characters at most */
                ps += snprintf(sz + ps, sizeof sz - (size_t)ps, "%s%lld", d ? ", " : "",
                               (long long)sizes[d]);
                pt += snprintf(st + pt, sizeof st - (size_t)pt, "%s%lld", d ? ", " : "",
                               (long long)strides[d]);
            }
            return mha__fail(err, MHA_STATUS_INVALID_ARG,
                             "%s_strides make distinct elements of %s alias: sizes [%s] with "
                             "element strides {%s} reach one address from two elements (an "
                             "output must not overlap itself)",
                             name, name, sz, st);
        }
        if (!mha__mul_i64(mag[i], ext[i], &need))
            need = INT64_MAX; /* nothing can follow (the extent checks refuse such a view) */
    }
    return MHA_STATUS_OK;
}
