/* SPDX-License-Identifier: MIT */
/* masking.c: validation of mha_masking and its resolution into broadcast strides, plus the ALiBi
 * slopes. Every mask rule is checked here, once, before any output is written. */
#include "base/internal.h"

#include <stdio.h>

static bool is_bool_dtype(mha_dtype t) {
    return t == MHA_DTYPE_BOOL || t == MHA_DTYPE_U8 || t == MHA_DTYPE_I32 || t == MHA_DTYPE_I64;
}

/* Resolves a C-contiguous tensor broadcast (NumPy rules, right-aligned) to `target` (rank 4).
 * Writes element strides for the target's dims (0 where broadcast). */
static mha_status broadcast_strides(const mha_mask_tensor *t,
                                    const char *what,
                                    const int64_t target[4],
                                    int64_t strides[4],
                                    mha_error *err) {
    MHA_RETURN_IF(t->ndim < 1 || t->ndim > 4, err, INVALID_ARG, "%s.ndim=%d must be 1..4", what,
                  (int)t->ndim);
    int64_t count = 1;
    for (int d = 0; d < t->ndim; d++) {
        MHA_RETURN_IF(t->shape[d] < 1 || t->shape[d] > MHA_MAX_DIM, err, INVALID_ARG,
                      "%s.shape[%d]=%lld out of range", what, d, (long long)t->shape[d]);
        MHA_RETURN_IF(!mha__mul_i64(count, t->shape[d], &count), err, OVERFLOW,
                      "%s: element count overflows", what);
    }
    int64_t stride = 1;
    for (int k = 3; k >= 0; k--) {
        const int d = t->ndim - 4 + k; /* the tensor dim aligned with target dim k */
        if (d < 0) {
            strides[k] = 0;
            continue;
        }
        const int64_t size = t->shape[d];
        if (size != target[k] && size != 1) {
            char shape[128] = "", *p = shape;
            for (int e = 0; e < t->ndim; e++)
                p += snprintf(p, sizeof shape - (size_t)(p - shape), "%s%lld", e ? ", " : "",
                              (long long)t->shape[e]);
            return mha__fail(err, MHA_STATUS_INVALID_ARG,
                             "%s of shape (%s) does not broadcast to (%lld, %lld, %lld, %lld): "
                             "dimension %d is %lld, expected %lld or 1",
                             what, shape, (long long)target[0], (long long)target[1],
                             (long long)target[2], (long long)target[3], d, (long long)size,
                             (long long)target[k]);
        }
        strides[k] = (size == 1) ? 0 : stride;
        stride *= size;
    }
    return MHA_STATUS_OK;
}

mha_status mha__validate_masking(const mha_masking *mk,
                                 int64_t B,
                                 int64_t H,
                                 int64_t n,
                                 int64_t m,
                                 mha__problem *p,
                                 int64_t *delta_buf,
                                 mha_error *err) {
    mha_status st;
    p->causal = mk->causal != 0;
    switch (mk->alignment) {
    case MHA_ALIGN_BOTTOM_RIGHT:
    case MHA_ALIGN_TOP_LEFT:
        for (int64_t b = 0; b < B; b++)
            delta_buf[b] = mk->alignment == MHA_ALIGN_TOP_LEFT ? 0 : m - n;
        break;
    case MHA_ALIGN_EXPLICIT:
        MHA_RETURN_IF(!mk->align_offsets, err, INVALID_ARG,
                      "mask.alignment is EXPLICIT but mask.align_offsets is NULL");
        for (int64_t b = 0; b < B; b++) {
            const int64_t off = mk->align_offsets[b];
            MHA_RETURN_IF(off < -MHA_MAX_DIM || off > MHA_MAX_DIM, err, INVALID_ARG,
                          "mask.align_offsets[%lld]=%lld outside [-2^31, 2^31]", (long long)b,
                          (long long)off);
            delta_buf[b] = off;
        }
        break;
    default:
        return mha__fail(err, MHA_STATUS_INVALID_ARG, "mask.alignment=%d is not a known alignment",
                         (int)mk->alignment);
    }
    p->delta = delta_buf;

    p->use_window = mk->use_window != 0;
    p->window_left = mk->window_left;
    p->window_right = mk->window_right;
    if (p->use_window)
        MHA_RETURN_IF(mk->window_left < -1 || mk->window_right < -1, err, INVALID_ARG,
                      "mask.window (%lld, %lld): each side must be >= 0, or -1 for unbounded",
                      (long long)mk->window_left, (long long)mk->window_right);
    /* A side longer than any |i + delta - j| (< 2^33 within the size limits) is unbounded: map it
     * to -1 so that i + delta + side cannot overflow int64 in any kernel. */
    if (p->window_left > 4 * MHA_MAX_DIM)
        p->window_left = -1;
    if (p->window_right > 4 * MHA_MAX_DIM)
        p->window_right = -1;

    const int64_t target[4] = {B, H, n, m};
    p->bool_mask.data = NULL;
    if (mk->bool_mask.data) {
        MHA_RETURN_IF(!is_bool_dtype(mk->bool_mask.dtype), err, INVALID_ARG,
                      "mask.bool_mask.dtype=%d must be BOOL, U8, I32 or I64 "
                      "(a float mask goes in additive_mask)",
                      (int)mk->bool_mask.dtype);
        MHA_RETURN_IF(mk->bool_mask_polarity != MHA_MASK_ATTEND &&
                          mk->bool_mask_polarity != MHA_MASK_BLOCK,
                      err, INVALID_ARG, "mask.bool_mask_polarity=%d is not ATTEND or BLOCK",
                      (int)mk->bool_mask_polarity);
        st = broadcast_strides(&mk->bool_mask, "bool mask", target, p->bool_mask.strides, err);
        if (st)
            return st;
        p->bool_mask.data = mk->bool_mask.data;
        p->bool_mask.dtype = mk->bool_mask.dtype;
    }
    p->bool_polarity = mk->bool_mask_polarity;

    p->additive.data = NULL;
    if (mk->additive_mask.data) {
        MHA_RETURN_IF(mk->additive_mask.dtype != MHA_DTYPE_F32, err, INVALID_ARG,
                      "mask.additive_mask.dtype=%d must be F32", (int)mk->additive_mask.dtype);
        st = broadcast_strides(&mk->additive_mask, "additive mask", target, p->additive.strides,
                               err);
        if (st)
            return st;
        p->additive.data = mk->additive_mask.data;
        p->additive.dtype = MHA_DTYPE_F32;
    }

    p->key_padding.data = NULL;
    if (mk->key_padding.data) {
        MHA_RETURN_IF(!is_bool_dtype(mk->key_padding.dtype), err, INVALID_ARG,
                      "mask.key_padding.dtype=%d must be BOOL, U8, I32 or I64",
                      (int)mk->key_padding.dtype);
        MHA_RETURN_IF(mk->key_padding.ndim < 1 || mk->key_padding.ndim > 2, err, INVALID_ARG,
                      "key padding mask must be [B, m] or [m], got %d dimensions",
                      (int)mk->key_padding.ndim);
        /* View [B, m] as [B, 1, 1, m] (and [m] as [1, 1, 1, m]); same bytes, C order. */
        mha_mask_tensor as4 = mk->key_padding;
        if (as4.ndim == 2) {
            as4.ndim = 4;
            as4.shape[3] = mk->key_padding.shape[1];
            as4.shape[0] = mk->key_padding.shape[0];
            as4.shape[1] = as4.shape[2] = 1;
        }
        const int64_t target_kp[4] = {B, 1, 1, m};
        st = broadcast_strides(&as4, "key padding mask", target_kp, p->key_padding.strides, err);
        if (st)
            return st;
        p->key_padding.data = mk->key_padding.data;
        p->key_padding.dtype = mk->key_padding.dtype;
    }

    MHA_RETURN_IF((mk->q_segment_ids == NULL) != (mk->kv_segment_ids == NULL), err, INVALID_ARG,
                  "mask.q_segment_ids and mask.kv_segment_ids must be given together");
    p->q_seg = mk->q_segment_ids;
    p->kv_seg = mk->kv_segment_ids;
    return MHA_STATUS_OK;
}

void mha__alibi_slopes(int64_t h, float *slopes) {
    /* Press et al. (ALiBi): for h a power of two, slope_k = 2^(-8(k+1)/h). Otherwise (BLOOM):
     * the c = 2^floor(log2 h) slopes of c heads, then the first h - c odd-indexed slopes of the
     * 2c-head sequence, 2^(-8(2k+1)/(2c)). */
    int64_t c = 1;
    while (c * 2 <= h)
        c *= 2;
    for (int64_t k = 0; k < c && k < h; k++)
        slopes[k] = (float)pow(2.0, -8.0 * (double)(k + 1) / (double)c);
    for (int64_t k = 0; k < h - c; k++)
        slopes[c + k] = (float)pow(2.0, -8.0 * (double)(2 * k + 1) / (double)(2 * c));
}
