/* SPDX-License-Identifier: MIT */
/* check/rope.c: the checks of an mha_rope (the RoPE calls and the layer's config.rope) and of
 * token positions, with the rope's defaults filled in. Formulas: layer/rope.c, docs/SEMANTICS.md.
 */
#include "check/check.h"

#include <float.h>

static bool finite_positive(double x) {
    return isfinite(x) && x > 0.0;
}

mha_status mha__check_rope(const mha_rope *in, int64_t head_dim, mha_rope *out, mha_error *err) {
    MHA_RETURN_IF(!in, err, INVALID_ARG, "rope is NULL");
    mha_rope r = *in;
    MHA_RETURN_IF(r.style != MHA_ROPE_INTERLEAVED && r.style != MHA_ROPE_HALF, err, INVALID_ARG,
                  "rope.style=%d is not interleaved (1) or half (2)", (int)r.style);
    if (r.theta == 0.0)
        r.theta = 10000.0;
    MHA_RETURN_IF(!isfinite(r.theta) || r.theta <= 1.0, err, INVALID_ARG,
                  "rope.theta=%g must be finite and > 1", r.theta);
    if (r.rotary_dim == 0)
        r.rotary_dim = head_dim;
    MHA_RETURN_IF(r.rotary_dim <= 0 || r.rotary_dim % 2 != 0 || r.rotary_dim > head_dim, err,
                  INVALID_ARG, "rope.rotary_dim=%lld must be even, > 0 and <= head_dim=%lld",
                  (long long)r.rotary_dim, (long long)head_dim);
    switch (r.scaling) {
    case MHA_ROPE_SCALING_NONE:
        break;
    case MHA_ROPE_SCALING_LINEAR:
    case MHA_ROPE_SCALING_NTK:
    case MHA_ROPE_SCALING_YARN:
    case MHA_ROPE_SCALING_DYNAMIC:
    case MHA_ROPE_SCALING_LONGROPE:
        if (r.factor == 0.0)
            r.factor = 1.0;
        break;
    case MHA_ROPE_SCALING_LLAMA3:
        if (r.factor == 0.0)
            r.factor = 8.0;
        break;
    default:
        return mha__fail(err, MHA_STATUS_INVALID_ARG, "rope.scaling=%d is not a known scaling",
                         (int)r.scaling);
    }
    if (r.scaling != MHA_ROPE_SCALING_NONE)
        MHA_RETURN_IF(!finite_positive(r.factor), err, INVALID_ARG,
                      "rope.factor=%g must be finite and > 0", r.factor);
    if (r.scaling == MHA_ROPE_SCALING_NTK || r.scaling == MHA_ROPE_SCALING_DYNAMIC)
        MHA_RETURN_IF(r.rotary_dim <= 2, err, INVALID_ARG,
                      "NTK-aware scaling needs rotary_dim > 2 (got %lld)", (long long)r.rotary_dim);
    if (r.scaling == MHA_ROPE_SCALING_DYNAMIC)
        MHA_RETURN_IF(!finite_positive(r.original_max_position), err, INVALID_ARG,
                      "dynamic scaling needs original_max_position > 0 (transformers' "
                      "max_position_embeddings), got %g",
                      r.original_max_position);
    if (r.scaling == MHA_ROPE_SCALING_LLAMA3) {
        if (r.original_max_position == 0.0)
            r.original_max_position = 8192.0;
        if (r.low_freq_factor == 0.0)
            r.low_freq_factor = 1.0;
        if (r.high_freq_factor == 0.0)
            r.high_freq_factor = 4.0;
        MHA_RETURN_IF(
            !finite_positive(r.original_max_position) || !finite_positive(r.low_freq_factor) ||
                !finite_positive(r.high_freq_factor) || r.high_freq_factor <= r.low_freq_factor,
            err, INVALID_ARG,
            "llama3 scaling needs original_max_position > 0 and "
            "high_freq_factor (%g) > low_freq_factor (%g) > 0",
            r.high_freq_factor, r.low_freq_factor);
    }
    if (r.scaling == MHA_ROPE_SCALING_YARN) {
        if (r.original_max_position == 0.0)
            r.original_max_position = 4096.0;
        if (r.beta_fast == 0.0)
            r.beta_fast = 32.0;
        if (r.beta_slow == 0.0)
            r.beta_slow = 1.0;
        if (r.attention_factor == 0.0)
            r.attention_factor = r.factor <= 1.0 ? 1.0 : 0.1 * log(r.factor) + 1.0;
        MHA_RETURN_IF(!finite_positive(r.original_max_position) || !finite_positive(r.beta_fast) ||
                          !finite_positive(r.beta_slow) || !finite_positive(r.attention_factor),
                      err, INVALID_ARG,
                      "yarn scaling needs original_max_position, beta_fast, beta_slow and "
                      "attention_factor finite and > 0");
    }
    if (r.scaling == MHA_ROPE_SCALING_LONGROPE) {
        MHA_RETURN_IF(!finite_positive(r.original_max_position), err, INVALID_ARG,
                      "longrope scaling needs original_max_position > 0, got %g",
                      r.original_max_position);
        MHA_RETURN_IF(r.rotary_dim / 2 > MHA_ROPE_MAX_PAIRS, err, INVALID_ARG,
                      "longrope scaling has factors for at most %d pairs (rotary_dim %lld)",
                      MHA_ROPE_MAX_PAIRS, (long long)r.rotary_dim);
        for (int64_t k = 0; k < r.rotary_dim / 2; k++)
            MHA_RETURN_IF(!finite_positive(r.short_factor[k]) || !finite_positive(r.long_factor[k]),
                          err, INVALID_ARG,
                          "longrope short_factor[%lld]=%g and long_factor[%lld]=%g must be "
                          "finite and > 0",
                          (long long)k, r.short_factor[k], (long long)k, r.long_factor[k]);
        if (r.attention_factor == 0.0)
            r.attention_factor =
                r.factor <= 1.0 ? 1.0 : sqrt(1.0 + log(r.factor) / log(r.original_max_position));
        MHA_RETURN_IF(!finite_positive(r.attention_factor), err, INVALID_ARG,
                      "longrope attention_factor=%g must be finite and > 0", r.attention_factor);
    }
    /* attention_factor multiplies cos and sin, and the rotated values are rounded to float: a
     * factor beyond float's range makes every rotated element inf. */
    if (r.scaling == MHA_ROPE_SCALING_YARN || r.scaling == MHA_ROPE_SCALING_LONGROPE)
        MHA_RETURN_IF(r.attention_factor > (double)FLT_MAX, err, INVALID_ARG,
                      "rope.attention_factor=%g exceeds float32's range (%g): the rotated "
                      "queries and keys are float32",
                      r.attention_factor, (double)FLT_MAX);
    *out = r;
    mha__ok(err);
    return MHA_STATUS_OK;
}

bool mha__rope_depends_on_length(const mha_rope *r) {
    if (r->scaling == MHA_ROPE_SCALING_DYNAMIC)
        return true;
    if (r->scaling != MHA_ROPE_SCALING_LONGROPE)
        return false;
    for (int64_t k = 0; k < r->rotary_dim / 2 && k < MHA_ROPE_MAX_PAIRS; k++)
        if (r->short_factor[k] != r->long_factor[k])
            return true;
    return false;
}

mha_status mha__check_positions(const int64_t *pos,
                                int64_t B,
                                int64_t L,
                                int64_t batch_stride,
                                const char *name,
                                mha_error *err) {
    if (!pos)
        return MHA_STATUS_OK;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < L; t++) {
            const int64_t p = pos[b * batch_stride + t];
            MHA_RETURN_IF(p < 0 || p > MHA_MAX_POSITION, err, INVALID_ARG,
                          "%s[%lld][%lld]=%lld outside [0, 2^31]", name, (long long)b, (long long)t,
                          (long long)p);
        }
    return MHA_STATUS_OK;
}

mha_status mha__check_rope_frequencies(const mha_rope *rope,
                                       int64_t head_dim,
                                       const double *freqs,
                                       const double *cos_sin_factor,
                                       mha_rope *resolved,
                                       mha_error *err) {
    MHA_RETURN_IF(head_dim <= 0 || head_dim > MHA_MAX_DIM, err, INVALID_ARG,
                  "head_dim=%lld out of range", (long long)head_dim);
    MHA_RETURN_IF(!freqs || !cos_sin_factor, err, INVALID_ARG, "freqs or cos_sin_factor is NULL");
    const mha__span out[2] = {
        mha__span_of("freqs", freqs,
                     (rope && rope->rotary_dim > 0 && rope->rotary_dim <= head_dim
                          ? rope->rotary_dim
                          : head_dim) /
                         2,
                     sizeof(double)),
        mha__span_of("cos_sin_factor", cos_sin_factor, 1, sizeof(double))};
    mha_status st = mha__check_no_overlap(out, 2, NULL, 0, err);
    if (st)
        return st;
    st = mha__check_rope(rope, head_dim, resolved, err);
    MHA_RETURN_IF(!st && mha__rope_depends_on_length(resolved), err, INVALID_ARG,
                  "%s scaling depends on the call's length: take mha_rope_at_length first",
                  resolved->scaling == MHA_ROPE_SCALING_DYNAMIC ? "dynamic" : "longrope");
    return st;
}

mha_status mha__check_rope_at_length(
    const mha_rope *rope, int64_t head_dim, int64_t length, mha_rope *resolved, mha_error *err) {
    MHA_RETURN_IF(head_dim <= 0 || head_dim > MHA_MAX_DIM, err, INVALID_ARG,
                  "head_dim=%lld out of range", (long long)head_dim);
    MHA_RETURN_IF(length < 0 || length > MHA_MAX_POSITION + 1, err, INVALID_ARG,
                  "length=%lld outside [0, 2^31 + 1]", (long long)length);
    return mha__check_rope(rope, head_dim, resolved, err);
}

mha_status mha__check_rope_apply(const mha_rope *rope,
                                 int64_t batch,
                                 int64_t seq_len,
                                 int64_t num_heads,
                                 int64_t head_dim,
                                 const float *x,
                                 const int64_t x_strides[4],
                                 const int64_t *positions,
                                 int64_t pos_batch_stride,
                                 mha_rope *resolved,
                                 mha_error *err) {
    MHA_RETURN_IF(batch < 0 || seq_len < 0 || num_heads < 0 || batch > MHA_MAX_DIM ||
                      seq_len > MHA_MAX_DIM || num_heads > MHA_MAX_DIM,
                  err, INVALID_ARG, "batch=%lld, seq_len=%lld, num_heads=%lld out of range",
                  (long long)batch, (long long)seq_len, (long long)num_heads);
    MHA_RETURN_IF(head_dim <= 0 || head_dim > MHA_MAX_DIM, err, INVALID_ARG,
                  "head_dim=%lld out of range", (long long)head_dim);
    MHA_RETURN_IF(!x_strides, err, INVALID_ARG, "x_strides is NULL");
    MHA_RETURN_IF(x_strides[3] != 1, err, INVALID_ARG,
                  "x_strides[3]=%lld: the head dimension must be contiguous (stride 1)",
                  (long long)x_strides[3]);
    MHA_RETURN_IF(pos_batch_stride < 0, err, INVALID_ARG, "pos_batch_stride=%lld is negative",
                  (long long)pos_batch_stride);
    mha_status st = mha__check_rope(rope, head_dim, resolved, err);
    if (st != MHA_STATUS_OK || batch == 0 || seq_len == 0 || num_heads == 0)
        return st; /* nothing to rotate: x and positions are not read */
    MHA_RETURN_IF(!x, err, INVALID_ARG, "x is NULL");
    /* The element offsets the view reaches, [-back, fwd) from x (a negative stride runs
     * backwards), and the positions' extent: each product and sum must fit int64. */
    int64_t back = 0, fwd = head_dim, t, count, pos_n = 0;
    const int64_t f[3] = {batch - 1, seq_len - 1, num_heads - 1};
    for (int i = 0; i < 3; i++) {
        const int64_t s = x_strides[i];
        MHA_RETURN_IF(s == INT64_MIN || !mha__mul_i64(f[i], s < 0 ? -s : s, &t) ||
                          !mha__add_i64(s < 0 ? back : fwd, t, s < 0 ? &back : &fwd) ||
                          !mha__add_i64(back, fwd, &count),
                      err, OVERFLOW, "x: offsets overflow int64 with x_strides {%lld, %lld, %lld}",
                      (long long)x_strides[0], (long long)x_strides[1], (long long)x_strides[2]);
    }
    MHA_RETURN_IF(positions && (!mha__mul_i64(batch - 1, pos_batch_stride, &pos_n) ||
                                !mha__add_i64(pos_n, seq_len, &pos_n)),
                  err, OVERFLOW, "positions: offsets overflow int64 with pos_batch_stride=%lld",
                  (long long)pos_batch_stride);
    st = mha__check_positions(positions, batch, seq_len, pos_batch_stride, "positions", err);
    if (st)
        return st;
    /* x is rotated in place (its only output): no two of its elements at one address, and it
     * must not overlap the positions it reads. */
    const int64_t sizes[4] = {batch, seq_len, num_heads, head_dim};
    st = mha__check_layout_disjoint("x", sizes, x_strides, 4, err);
    if (st)
        return st;
    const mha__span in = mha__span_of("positions", positions, pos_n, sizeof(int64_t));
    const mha__span out = mha__span_of("x", x - back, count, sizeof(float));
    return mha__check_no_overlap(&out, 1, &in, 1, err);
}
