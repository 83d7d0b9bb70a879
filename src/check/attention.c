/* SPDX-License-Identifier: MIT */
/* check/attention.c: the checks of the attention core's public calls (mha_attention*,
 * mha_attention_backward*), resolving mha_attention_args into an mha__problem: sizes, strides,
 * scalars, dropout, and every mask rule (resolved into broadcast strides), before any output is
 * written. */
#include "check/check.h"

#include <float.h>
#include <stdio.h>
#include <string.h>

mha_status
mha__check_scale_softcap(double scale, double softcap, const char *prefix, mha_error *err) {
    const double mag = fabs(scale);
    MHA_RETURN_IF(!(mag >= (double)FLT_MIN && mag <= (double)FLT_MAX), err, INVALID_ARG,
                  "%sscale=%g is outside float32's range: scores are computed in float32, so "
                  "|scale| must be in [%g, %g] (0 = 1/sqrt(head_dim))",
                  prefix, scale, (double)FLT_MIN, (double)FLT_MAX);
    MHA_RETURN_IF(!(softcap == 0.0 || (softcap >= (double)FLT_MIN && softcap <= (double)FLT_MAX)),
                  err, INVALID_ARG,
                  "%ssoftcap=%g must be 0 (off) or in [%g, %g]: the cap is applied in float32",
                  prefix, softcap, (double)FLT_MIN, (double)FLT_MAX);
    return MHA_STATUS_OK;
}

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

/* The same check for a caller outside this file (mha_mask_recognize, core/mask_rule.c). */
mha_status mha__check_mask_broadcast(const mha_mask_tensor *t,
                                     const char *what,
                                     const int64_t target[4],
                                     int64_t strides[4],
                                     mha_error *err) {
    return broadcast_strides(t, what, target, strides, err);
}

/* mha_masking into p: causal alignment (per-batch diagonal offsets in delta_buf [B]), window,
 * masks as broadcast strides over (B, H, n, m), segment ids. */
static mha_status check_masking(const mha_masking *mk,
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
    MHA_RETURN_IF(mk->chunk_size < 0, err, INVALID_ARG,
                  "mask.chunk_size=%lld must be 0 (off) or positive", (long long)mk->chunk_size);
    /* |p| <= 2^32: every chunk size beyond 2^33 puts the rows p < 0 in chunk -1 and the others
     * in chunk 0, as 2^33 does; capping keeps C floor(p / C) + C inside int64. */
    p->chunk = mk->chunk_size > 4 * MHA_MAX_DIM ? 4 * MHA_MAX_DIM : mk->chunk_size;

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
    MHA_RETURN_IF(!mk->mask_fn.visible && (mk->mask_fn.classify || mk->mask_fn.ctx), err,
                  INVALID_ARG, "mask.mask_fn has %s but no visible function",
                  mk->mask_fn.classify ? "a classify function" : "a ctx");
    p->mask_fn = mk->mask_fn;
    p->map = NULL; /* built by the core (core/mask_map.c) when it runs a fast kernel */
    return MHA_STATUS_OK;
}

/* Largest element offset reachable through a [B, H, L, d] view with strides s; false on
 * overflow or a negative stride. */
static bool view_extent_n(const int64_t s[3],
                          int64_t B,
                          int64_t H,
                          int64_t L,
                          int64_t d,
                          const char *name,
                          int64_t *extent,
                          mha_error *err) {
    int64_t a, b, c, total;
    for (int i = 0; i < 3; i++)
        if (s[i] < 0) {
            mha__fail(err, MHA_STATUS_INVALID_ARG, "%s_strides[%d]=%lld is negative", name, i,
                      (long long)s[i]);
            return false;
        }
    if (!mha__mul_i64(B - 1, s[0], &a) || !mha__mul_i64(H - 1, s[1], &b) ||
        !mha__mul_i64(L - 1, s[2], &c) || !mha__add_i64(a, b, &total) ||
        !mha__add_i64(total, c, &total) || !mha__add_i64(total, d, &total)) {
        mha__fail(err, MHA_STATUS_OVERFLOW, "%s: offsets overflow int64 with these strides", name);
        return false;
    }
    if (extent)
        *extent = total;
    return true;
}

static bool view_extent(const int64_t s[3],
                        int64_t B,
                        int64_t H,
                        int64_t L,
                        int64_t d,
                        const char *name,
                        mha_error *err) {
    return view_extent_n(s, B, H, L, d, name, NULL, err);
}

/* The byte range of a strided [B, heads, L, d] view of dtype dt (its strides already checked). */
static mha__span view_span(const char *name,
                           mha_dtype dt,
                           const void *ptr,
                           const int64_t s[3],
                           int64_t B,
                           int64_t H,
                           int64_t L,
                           int64_t d) {
    int64_t extent = 0;
    if (ptr && !view_extent_n(s, B, H, L, d, name, &extent, NULL))
        extent = INT64_MAX / 8; /* cannot happen: checked before */
    return mha__span_of(name, ptr, extent, mha__storage_size(dt));
}

/* An output [B, heads, L, d] view (strides {b, head, row}, d contiguous; checked by view_extent)
 * whose elements are all at distinct addresses. */
static mha_status view_disjoint(const char *name,
                                const void *ptr,
                                const int64_t s[3],
                                int64_t B,
                                int64_t H,
                                int64_t L,
                                int64_t d,
                                mha_error *err) {
    const int64_t sizes[4] = {B, H, L, d}, strides[4] = {s[0], s[1], s[2], 1};
    return ptr ? mha__check_layout_disjoint(name, sizes, strides, 4, err) : MHA_STATUS_OK;
}

/* A mask tensor's bytes (C-contiguous: the product of its shape); empty when its shape is not
 * valid (then the mask's own check refuses the call before anything is written). */
static mha__span mask_span(const char *name, const mha_mask_tensor *t) {
    int64_t count = t->ndim >= 1 && t->ndim <= MHA_MAX_MASK_DIMS ? 1 : 0;
    for (int d = 0; count && d < t->ndim; d++)
        if (t->shape[d] < 1 || !mha__mul_i64(count, t->shape[d], &count) || count > INT64_MAX / 8)
            count = 0;
    return mha__span_of(name, t->data, count, mha_dtype_size(t->dtype));
}

int mha__masking_spans(
    const mha_masking *mk, int64_t B, int64_t n, int64_t m, int of_forward, mha__span *in) {
    static const char *const names[2][MHA__MASKING_SPANS] = {
        {"mask.additive_mask", "mask.bool_mask", "mask.key_padding", "mask.q_segment_ids",
         "mask.kv_segment_ids", "mask.align_offsets"},
        {"the forward's mask.additive_mask", "the forward's mask.bool_mask",
         "the forward's mask.key_padding", "the forward's mask.q_segment_ids",
         "the forward's mask.kv_segment_ids", "the forward's mask.align_offsets"}};
    const char *const *nm = names[of_forward != 0];
    int k = 0;
    in[k++] = mask_span(nm[0], &mk->additive_mask);
    in[k++] = mask_span(nm[1], &mk->bool_mask);
    in[k++] = mask_span(nm[2], &mk->key_padding);
    in[k++] = mha__span_of(nm[3], mk->q_segment_ids, mha__count3(B, n, 1), sizeof(int32_t));
    in[k++] = mha__span_of(nm[4], mk->kv_segment_ids, mha__count3(B, m, 1), sizeof(int32_t));
    in[k++] = mha__span_of(nm[5], mk->alignment == MHA_ALIGN_EXPLICIT ? mk->align_offsets : NULL, B,
                           sizeof(int64_t));
    return k;
}

enum { CORE_INPUTS = 4 + MHA__MASKING_SPANS };
/* Every tensor the core reads besides the ones of its outputs (after check_problem resolved p). */
static int core_inputs(const mha_attention_args *a, const mha__problem *p, mha__span *in) {
    int n = 0;
    in[n++] = view_span("q", p->q_dt, a->q, a->q_strides, p->B, p->H, p->n, p->dk);
    in[n++] = view_span("k", p->k_dt, a->k, a->k_strides, p->B, p->G, p->m, p->dk);
    in[n++] = view_span("v", p->v_dt, a->v, a->v_strides, p->B, p->G, p->m, p->dv);
    in[n++] = mha__span_of("sinks", a->sinks, p->H, sizeof(float));
    return n + mha__masking_spans(&a->mask, p->B, p->n, p->m, 0, in + n);
}

mha_status mha__check_storage_dtypes(const char *const *names,
                                     const mha_dtype *dts,
                                     int count,
                                     mha_error *err) {
    for (int t = 0; t < count; t++)
        MHA_RETURN_IF(!mha__is_float_storage(dts[t]), err, INVALID_ARG,
                      "%s=%d is not a storage dtype of activations (MHA_DTYPE_F32, BF16 or F16)",
                      names[t], (int)dts[t]);
    return MHA_STATUS_OK;
}

mha_status mha__check_attention_sizes(const mha_attention_args *a, mha_error *err) {
    const int64_t G = a->num_kv_heads ? a->num_kv_heads : a->num_heads;
    const int64_t dv = a->v_head_dim ? a->v_head_dim : a->head_dim;
    const struct {
        const char *name;
        int64_t value;
    } dims[] = {{"batch", a->batch}, {"num_heads", a->num_heads}, {"num_kv_heads", G},
                {"q_len", a->q_len}, {"kv_len", a->kv_len},       {"head_dim", a->head_dim},
                {"v_head_dim", dv}};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        MHA_RETURN_IF(dims[i].value < 1 || dims[i].value > MHA_MAX_DIM, err, INVALID_ARG,
                      "%s=%lld must be in [1, 2^31]", dims[i].name, (long long)dims[i].value);
    MHA_RETURN_IF(a->num_heads % G != 0, err, INVALID_ARG,
                  "num_heads=%lld is not divisible by num_kv_heads=%lld", (long long)a->num_heads,
                  (long long)G);
    return MHA_STATUS_OK;
}

/* The forward's checks; scores_only (the statistics): v and out may be NULL (they are not read)
 * and are checked only when given. */
static mha_status check_problem(const mha_attention_args *a,
                                int scores_only,
                                int check_alias,
                                mha__problem *p,
                                int64_t *delta_buf,
                                float *slope_buf,
                                mha_error *err) {
    MHA_RETURN_IF(!a, err, INVALID_ARG, "args is NULL");
    memset(p, 0, sizeof *p);
    mha_status st = mha__check_attention_sizes(a, err);
    if (st)
        return st;
    const int64_t G = a->num_kv_heads ? a->num_kv_heads : a->num_heads;
    if (scores_only)
        MHA_RETURN_IF(!a->q || !a->k, err, INVALID_ARG, "q and k must not be NULL");
    else
        MHA_RETURN_IF(!a->q || !a->k || !a->v || !a->out, err, INVALID_ARG,
                      "q, k, v and out must not be NULL");
    p->B = a->batch;
    p->H = a->num_heads;
    p->G = G;
    p->group = a->num_heads / G;
    p->n = a->q_len;
    p->m = a->kv_len;
    p->dk = a->head_dim;
    p->dv = a->v_head_dim ? a->v_head_dim : a->head_dim;

    int64_t probs_count;
    const int64_t pf[4] = {p->B, a->average_probs ? 1 : p->H, p->n, p->m};
    MHA_RETURN_IF(!mha__prod_i64(pf, 4, &probs_count) || probs_count > INT64_MAX / 8, err, OVERFLOW,
                  "B*h*n*m overflows int64");
    if (!view_extent(a->q_strides, p->B, p->H, p->n, p->dk, "q", err) ||
        !view_extent(a->k_strides, p->B, p->G, p->m, p->dk, "k", err) ||
        (a->v && !view_extent(a->v_strides, p->B, p->G, p->m, p->dv, "v", err)) ||
        (a->out && !view_extent(a->out_strides, p->B, p->H, p->n, p->dv, "out", err)))
        return err ? err->status : MHA_STATUS_INVALID_ARG;

    double scale = a->scale == 0.0 ? 1.0 / sqrt((double)p->dk) : a->scale;
    st = mha__check_scale_softcap(scale, a->softcap, "", err);
    if (st)
        return st;
    p->scale = (float)scale;
    p->softcap = (float)a->softcap;
    p->sinks = a->sinks;
    if (a->alibi) {
        mha__alibi_slopes(p->H, slope_buf);
        p->alibi_slopes = slope_buf;
    }

    memcpy(p->qs, a->q_strides, sizeof p->qs);
    memcpy(p->ks, a->k_strides, sizeof p->ks);
    memcpy(p->vs, a->v_strides, sizeof p->vs);
    memcpy(p->os, a->out_strides, sizeof p->os);
    p->q = a->q;
    p->k = a->k;
    p->v = a->v;
    p->out = a->out;
    const char *names[4] = {"q_dtype", "k_dtype", "v_dtype", "out_dtype"};
    const mha_dtype dts[4] = {a->q_dtype, a->k_dtype, a->v_dtype, a->out_dtype};
    st = mha__check_storage_dtypes(names, dts, 4, err);
    if (st)
        return st;
    p->q_dt = a->q_dtype;
    p->k_dt = a->k_dtype;
    p->v_dt = a->v_dtype;
    p->o_dt = a->out_dtype;
    p->lse = a->lse;
    p->probs = a->probs;
    p->average_probs = a->average_probs != 0;

    MHA_RETURN_IF(!(a->dropout.p >= 0.0f && a->dropout.p < 1.0f), err, INVALID_ARG,
                  "dropout.p=%g must be in [0, 1)", (double)a->dropout.p);
    p->dropout_on = a->dropout.training && a->dropout.p > 0.0f;
    p->dropout_p = a->dropout.p;
    p->dropout_seed = a->dropout.seed;
    /* The counter holds I = i + row_offset and J = j + col_offset as 32-bit words. */
    const int64_t counter_end = (int64_t)1 << 32;
    MHA_RETURN_IF(a->dropout.row_offset < 0 || a->dropout.row_offset > counter_end - p->n, err,
                  INVALID_ARG, "dropout.row_offset=%lld must be in [0, 2^32 - q_len]",
                  (long long)a->dropout.row_offset);
    MHA_RETURN_IF(a->dropout.col_offset < 0 || a->dropout.col_offset > counter_end - p->m, err,
                  INVALID_ARG, "dropout.col_offset=%lld must be in [0, 2^32 - kv_len]",
                  (long long)a->dropout.col_offset);
    p->dropout_row0 = a->dropout.row_offset;
    p->dropout_col0 = a->dropout.col_offset;

    st = check_masking(&a->mask, p->B, p->H, p->n, p->m, p, delta_buf, err);
    if (st || scores_only || !check_alias) /* the statistics check their own outputs */
        return st;
    st = view_disjoint("out", a->out, a->out_strides, p->B, p->H, p->n, p->dv, err);
    if (st)
        return st;
    mha__span in[CORE_INPUTS];
    const int n_in = core_inputs(a, p, in);
    const mha__span out[3] = {
        view_span("out", p->o_dt, a->out, a->out_strides, p->B, p->H, p->n, p->dv),
        mha__span_of("lse", a->lse, p->B * p->H * p->n, sizeof(float)),
        mha__span_of("probs", a->probs, probs_count, sizeof(float))};
    return mha__check_no_overlap(out, 3, in, n_in, err);
}

mha_status mha__check_attention(const mha_attention_args *a,
                                mha__problem *p,
                                int64_t *delta_buf,
                                float *slope_buf,
                                mha_error *err) {
    return check_problem(a, 0, 1, p, delta_buf, slope_buf, err);
}

mha_status mha__check_attention_layout(const mha_attention_args *a,
                                       mha__problem *p,
                                       int64_t *delta_buf,
                                       float *slope_buf,
                                       mha_error *err) {
    return check_problem(a, 0, 0, p, delta_buf, slope_buf, err);
}

/* Element count of a [B, h, x, y] statistic, false on overflow (kept below INT64_MAX / 8 so its
 * bytes fit too). */
static bool stat_count(int64_t B, int64_t H, int64_t x, int64_t y) {
    const int64_t f[4] = {B, H, x, y};
    int64_t count;
    return mha__prod_i64(f, 4, &count) && count <= INT64_MAX / 8;
}

mha_status mha__check_attention_stats(const mha_attention_args *a,
                                      const mha_attention_stats *s,
                                      mha__problem *p,
                                      int64_t *delta_buf,
                                      float *slope_buf,
                                      mha_error *err) {
    MHA_RETURN_IF(!s, err, INVALID_ARG, "stats is NULL");
    mha_status st = check_problem(a, 1, 1, p, delta_buf, slope_buf, err);
    if (!st && (p->q_dt != MHA_DTYPE_F32 || p->k_dt != MHA_DTYPE_F32))
        MHA_RETURN_IF(1, err, UNSUPPORTED,
                      "the statistics take float32 q and k (q_dtype=%d, k_dtype=%d): widen them "
                      "first (mha_half_to_f32)",
                      (int)p->q_dt, (int)p->k_dt);
    if (st)
        return st;
    p->out = NULL; /* never written: the statistics go to `s` */
    p->lse = NULL;
    p->probs = NULL;
    p->dropout_on = 0;
    const int topk = s->topk_index || s->topk_prob, pool = s->pooled || s->pooled_visible;
    MHA_RETURN_IF(!topk && !pool && !s->received && !s->received_total && !s->entropy, err,
                  INVALID_ARG, "stats: no statistic requested (every output is NULL)");
    if (topk) {
        MHA_RETURN_IF(s->top_k < 1 || s->top_k > p->m, err, INVALID_ARG,
                      "stats.top_k=%lld must be in [1, kv_len=%lld]", (long long)s->top_k,
                      (long long)p->m);
        MHA_RETURN_IF(!stat_count(p->B, p->H, p->n, s->top_k), err, OVERFLOW,
                      "stats: B*h*n*top_k overflows int64");
    }
    if (pool) {
        MHA_RETURN_IF(s->pool_rows < 1 || s->pool_rows > p->n, err, INVALID_ARG,
                      "stats.pool_rows=%lld must be in [1, q_len=%lld]", (long long)s->pool_rows,
                      (long long)p->n);
        MHA_RETURN_IF(s->pool_cols < 1 || s->pool_cols > p->m, err, INVALID_ARG,
                      "stats.pool_cols=%lld must be in [1, kv_len=%lld]", (long long)s->pool_cols,
                      (long long)p->m);
        MHA_RETURN_IF(!stat_count(p->B, p->H, s->pool_rows, s->pool_cols), err, OVERFLOW,
                      "stats: B*h*pool_rows*pool_cols overflows int64");
    }
    mha__span in[CORE_INPUTS];
    const int n_in = core_inputs(a, p, in);
    const int64_t B = p->B, H = p->H, k = topk ? s->top_k : 0;
    const int64_t cells = pool ? s->pool_rows * s->pool_cols : 0;
    const mha__span out[7] = {
        mha__span_of("stats.received", s->received, B * H * p->m, sizeof(float)),
        mha__span_of("stats.received_total", s->received_total, B * p->m, sizeof(float)),
        mha__span_of("stats.entropy", s->entropy, B * H * p->n, sizeof(float)),
        mha__span_of("stats.topk_index", s->topk_index, B * H * p->n * k, sizeof(int64_t)),
        mha__span_of("stats.topk_prob", s->topk_prob, B * H * p->n * k, sizeof(float)),
        mha__span_of("stats.pooled", s->pooled, B * H * cells, sizeof(float)),
        mha__span_of("stats.pooled_visible", s->pooled_visible, B * H * cells, sizeof(float))};
    return mha__check_no_overlap(out, 7, in, n_in, err);
}

mha_status mha__check_backward_sizes(const mha_attention_args *a,
                                     const mha_attention_grads *g,
                                     mha_error *err) {
    MHA_RETURN_IF(!a, err, INVALID_ARG, "fwd (the forward's args) is NULL");
    MHA_RETURN_IF(!g, err, INVALID_ARG, "grads is NULL");
    return mha__check_attention_sizes(a, err);
}

mha_status mha__check_backward_grads(const mha_attention_args *a,
                                     const mha_attention_grads *g,
                                     const mha__problem *p,
                                     mha_error *err) {
    MHA_RETURN_IF(!a->lse, err, INVALID_ARG,
                  "fwd.lse is NULL: the backward needs the log-sum-exp saved by the forward");
    MHA_RETURN_IF(!g->dout, err, INVALID_ARG, "grads.dout is NULL");
    MHA_RETURN_IF(g->dsinks && !a->sinks, err, INVALID_ARG,
                  "grads.dsinks is given but the forward has no sinks");
    if (!view_extent(g->dout_strides, p->B, p->H, p->n, p->dv, "grads.dout", err) ||
        (g->dq && !view_extent(g->dq_strides, p->B, p->H, p->n, p->dk, "grads.dq", err)) ||
        (g->dk && !view_extent(g->dk_strides, p->B, p->G, p->m, p->dk, "grads.dk", err)) ||
        (g->dv && !view_extent(g->dv_strides, p->B, p->G, p->m, p->dv, "grads.dv", err)))
        return err ? err->status : MHA_STATUS_INVALID_ARG;
    const char *names[4] = {"grads.dout_dtype", "grads.dq_dtype", "grads.dk_dtype",
                            "grads.dv_dtype"};
    const mha_dtype dts[4] = {g->dout_dtype, g->dq_dtype, g->dk_dtype, g->dv_dtype};
    mha_status st = mha__check_storage_dtypes(names, dts, 4, err);
    if (st)
        return st;
    st = view_disjoint("grads.dq", g->dq, g->dq_strides, p->B, p->H, p->n, p->dk, err);
    if (!st)
        st = view_disjoint("grads.dk", g->dk, g->dk_strides, p->B, p->G, p->m, p->dk, err);
    if (!st)
        st = view_disjoint("grads.dv", g->dv, g->dv_strides, p->B, p->G, p->m, p->dv, err);
    if (st)
        return st;
    mha__span in[CORE_INPUTS + 5];
    int n_in = core_inputs(a, p, in);
    in[n_in++] = view_span("fwd.out", p->o_dt, a->out, a->out_strides, p->B, p->H, p->n, p->dv);
    in[n_in++] = mha__span_of("fwd.lse", a->lse, p->B * p->H * p->n, sizeof(float));
    in[n_in++] = mha__span_of("grads.dlse", g->dlse, p->B * p->H * p->n, sizeof(float));
    /* (B (or 1) h n m was checked for overflow with fwd->probs' size) */
    in[n_in++] = mha__span_of("grads.dprobs", g->dprobs,
                              p->B * (p->average_probs ? 1 : p->H) * p->n * p->m, sizeof(float));
    in[n_in++] =
        view_span("grads.dout", g->dout_dtype, g->dout, g->dout_strides, p->B, p->H, p->n, p->dv);
    const mha__span out[4] = {
        view_span("grads.dq", g->dq_dtype, g->dq, g->dq_strides, p->B, p->H, p->n, p->dk),
        view_span("grads.dk", g->dk_dtype, g->dk, g->dk_strides, p->B, p->G, p->m, p->dk),
        view_span("grads.dv", g->dv_dtype, g->dv, g->dv_strides, p->B, p->G, p->m, p->dv),
        mha__span_of("grads.dsinks", g->dsinks, p->H, sizeof(float))};
    return mha__check_no_overlap(out, 4, in, n_in, err);
}
