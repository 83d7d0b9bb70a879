/* SPDX-License-Identifier: MIT */
/* check/layer.c: the checks of the layer's public calls: the config and weights of
 * mha_layer_create, the inputs of mha_layer_forward* (the core's options are checked by
 * check/attention.c on the core's arguments), the gradient requests of mha_layer_backward. */
#include "check/check.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* config.qk_norm (docs/SEMANTICS.md "QK-norm") and config.output_gate, resolved in place: a kind
 * NONE keeps eps = 0 and unit_offset = 0; unit_offset becomes 0 or 1. */
static mha_status check_qk_norm(mha_config *c, mha_error *err) {
    mha_qk_norm *q = &c->qk_norm;
    MHA_RETURN_IF(q->kind < MHA_QK_NORM_NONE || q->kind > MHA_QK_NORM_L2_AFTER_ROPE, err,
                  INVALID_ARG,
                  "config.qk_norm.kind=%d is not NONE (0), RMS_HEAD (1), RMS_ALL (2) or "
                  "L2_AFTER_ROPE (3)",
                  (int)q->kind);
    if (q->kind == MHA_QK_NORM_NONE) {
        q->eps = 0.0;
        q->unit_offset = 0;
    } else {
        MHA_RETURN_IF(!(q->eps > 0.0 && q->eps <= (double)FLT_MAX), err, INVALID_ARG,
                      "config.qk_norm.eps=%g must be finite and in (0, FLT_MAX]", q->eps);
        MHA_RETURN_IF(q->kind == MHA_QK_NORM_L2_AFTER_ROPE && q->unit_offset, err, INVALID_ARG,
                      "config.qk_norm.unit_offset is set but L2_AFTER_ROPE has no weights");
        q->unit_offset = q->unit_offset != 0;
    }
    c->output_gate = c->output_gate != 0;
    MHA_RETURN_IF(c->output_gate && c->v_head_dim != c->head_dim, err, INVALID_ARG,
                  "config.output_gate multiplies A [h*v_head_dim] by a gate [h*head_dim]: "
                  "v_head_dim=%lld must equal head_dim=%lld",
                  (long long)c->v_head_dim, (long long)c->head_dim);
    int64_t t;
    MHA_RETURN_IF(c->output_gate && (!mha__mul_i64(2 * c->num_heads, c->head_dim, &t) ||
                                     !mha__mul_i64(t, c->q_dim, &t)),
                  err, OVERFLOW, "config: w_q with the output gate's rows overflows int64");
    return MHA_STATUS_OK;
}

/* Temperature tuning (docs/SEMANTICS.md): off, or floor_scale in [2^-32, FLT_MAX] (the float32
 * quotient (p + 1) / floor_scale then stays below 2^64, its log below 45) and attn_scale finite
 * with |attn_scale| <= 2^100 (tau finite in float32). Off zeroes the fields it ignores. */
static mha_status check_temperature(mha_temperature_tuning *t, mha_error *err) {
    if (!t->enabled) {
        memset(t, 0, sizeof *t);
        return MHA_STATUS_OK;
    }
    t->enabled = 1;
    MHA_RETURN_IF(!(t->floor_scale >= 0x1p-32 && t->floor_scale <= (double)FLT_MAX), err,
                  INVALID_ARG,
                  "config.temperature.floor_scale=%g must be in [2^-32, %g]: positions are "
                  "divided by it in float32",
                  t->floor_scale, (double)FLT_MAX);
    MHA_RETURN_IF(!(fabs(t->attn_scale) <= 0x1p100), err, INVALID_ARG,
                  "config.temperature.attn_scale=%g must be finite with |attn_scale| <= 2^100",
                  t->attn_scale);
    return MHA_STATUS_OK;
}

/* config with every default filled in: k_dim = v_dim = q_dim, num_kv_heads = num_heads, head_dim
 * = q_dim / num_heads, v_head_dim = head_dim, out_dim = q_dim, scale = 1/sqrt(head_dim), rope. */
static mha_status check_config(const mha_config *in, mha_config *c, mha_error *err) {
    MHA_RETURN_IF(!in, err, INVALID_ARG, "config is NULL");
    *c = *in;
    MHA_RETURN_IF(c->q_dim < 1 || c->q_dim > MHA_MAX_DIM, err, INVALID_ARG,
                  "config.q_dim=%lld must be in [1, 2^31]", (long long)c->q_dim);
    MHA_RETURN_IF(c->num_heads < 1 || c->num_heads > MHA_MAX_DIM, err, INVALID_ARG,
                  "config.num_heads=%lld must be in [1, 2^31]", (long long)c->num_heads);
    if (!c->k_dim)
        c->k_dim = c->q_dim;
    if (!c->v_dim)
        c->v_dim = c->k_dim;
    if (!c->num_kv_heads)
        c->num_kv_heads = c->num_heads;
    if (!c->head_dim) {
        MHA_RETURN_IF(c->q_dim % c->num_heads != 0, err, INVALID_ARG,
                      "config.q_dim=%lld is not divisible by num_heads=%lld (set head_dim to "
                      "choose another per-head size)",
                      (long long)c->q_dim, (long long)c->num_heads);
        c->head_dim = c->q_dim / c->num_heads;
    }
    if (!c->v_head_dim)
        c->v_head_dim = c->head_dim;
    if (!c->out_dim)
        c->out_dim = c->q_dim;
    const struct {
        const char *name;
        int64_t v;
    } dims[] = {
        {"k_dim", c->k_dim},       {"v_dim", c->v_dim},           {"num_kv_heads", c->num_kv_heads},
        {"head_dim", c->head_dim}, {"v_head_dim", c->v_head_dim}, {"out_dim", c->out_dim}};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        MHA_RETURN_IF(dims[i].v < 1 || dims[i].v > MHA_MAX_DIM, err, INVALID_ARG,
                      "config.%s=%lld must be in [1, 2^31]", dims[i].name, (long long)dims[i].v);
    MHA_RETURN_IF(c->num_heads % c->num_kv_heads != 0, err, INVALID_ARG,
                  "config.num_heads=%lld is not divisible by num_kv_heads=%lld",
                  (long long)c->num_heads, (long long)c->num_kv_heads);
    int64_t t;
    MHA_RETURN_IF(!mha__mul_i64(c->num_heads, c->head_dim, &t) || !mha__mul_i64(t, c->q_dim, &t) ||
                      !mha__mul_i64(c->num_heads, c->v_head_dim, &t) ||
                      !mha__mul_i64(t, c->out_dim, &t) ||
                      !mha__mul_i64(c->num_kv_heads * c->head_dim, c->k_dim, &t) ||
                      !mha__mul_i64(c->num_kv_heads * c->v_head_dim, c->v_dim, &t),
                  err, OVERFLOW, "config: weight sizes overflow int64");
    if (c->scale == 0.0)
        c->scale = 1.0 / sqrt((double)c->head_dim);
    mha_status sc = mha__check_scale_softcap(c->scale, c->softcap, "config.", err);
    if (sc)
        return sc;
    if (c->rope.style != MHA_ROPE_NONE) {
        mha_status st = mha__check_rope(&in->rope, c->head_dim, &c->rope, err);
        if (st)
            return st;
    }
    c->bias_q = c->bias_q != 0;
    c->bias_k = c->bias_k != 0;
    c->bias_v = c->bias_v != 0;
    c->bias_o = c->bias_o != 0;
    c->sinks = c->sinks != 0;
    c->alibi = c->alibi != 0;
    mha_status qk = check_qk_norm(c, err);
    if (qk)
        return qk;
    mha_status tt = check_temperature(&c->temperature, err);
    if (tt)
        return tt;
    MHA_RETURN_IF(!mha__is_float_storage(c->weight_dtype) && !mha__is_block_weight(c->weight_dtype),
                  err, INVALID_ARG,
                  "config.weight_dtype=%d is not MHA_DTYPE_F32 (0), MHA_DTYPE_BF16, MHA_DTYPE_F16, "
                  "MHA_DTYPE_Q8_0 or MHA_DTYPE_Q4_0",
                  (int)c->weight_dtype);
    if (mha__is_block_weight(c->weight_dtype)) { /* rows of whole 32-value blocks */
        const char *bn = c->weight_dtype == MHA_DTYPE_Q4_0 ? "Q4_0" : "Q8_0";
        const int64_t ins[4] = {c->q_dim, c->k_dim, c->v_dim, c->num_heads * c->v_head_dim};
        const char *names[4] = {"q_dim", "k_dim", "v_dim", "num_heads * v_head_dim"};
        for (int i = 0; i < 4; i++)
            MHA_RETURN_IF(ins[i] % MHA__Q8_BLOCK != 0, err, INVALID_ARG,
                          "config.weight_dtype=MHA_DTYPE_%s needs every projection's input "
                          "features to be a multiple of 32 (whole blocks per row): %s=%lld",
                          bn, names[i], (long long)ins[i]);
    }
    return MHA_STATUS_OK;
}

void mha__layer_weight_slots(const mha_config *c,
                             mha_weights *w,
                             mha__weight_slot slots[MHA__WEIGHT_SLOTS]) {
    const int64_t h = c->num_heads, g = c->num_kv_heads;
    const int norm_w =
        c->qk_norm.kind == MHA_QK_NORM_RMS_HEAD || c->qk_norm.kind == MHA_QK_NORM_RMS_ALL;
    const int64_t gq = c->output_gate ? 2 : 1; /* w_q, b_q: the query's rows, then the gate's */
    const mha__weight_slot s[MHA__WEIGHT_SLOTS] = {
        {"w_q", &w->w_q, gq * h * c->head_dim * c->q_dim, 1},
        {"w_k", &w->w_k, g * c->head_dim * c->k_dim, 1},
        {"w_v", &w->w_v, g * c->v_head_dim * c->v_dim, 1},
        {"w_o", &w->w_o, c->out_dim * h * c->v_head_dim, 1},
        {"b_q", &w->b_q, gq * h * c->head_dim, c->bias_q},
        {"b_k", &w->b_k, g * c->head_dim, c->bias_k},
        {"b_v", &w->b_v, g * c->v_head_dim, c->bias_v},
        {"b_o", &w->b_o, c->out_dim, c->bias_o},
        {"sinks", &w->sinks, h, c->sinks},
        {"q_norm", &w->q_norm,
         c->qk_norm.kind == MHA_QK_NORM_RMS_ALL ? h * c->head_dim : c->head_dim, norm_w},
        {"k_norm", &w->k_norm,
         c->qk_norm.kind == MHA_QK_NORM_RMS_ALL ? g * c->head_dim : c->head_dim, norm_w},
    };
    memcpy(slots, s, sizeof s);
}

int mha__layer_weight_spans(const mha_config *c, const mha_weights *w, mha__span *in) {
    mha_weights wc = *w; /* the slots point into their struct */
    mha__weight_slot slots[MHA__WEIGHT_SLOTS];
    mha__layer_weight_slots(c, &wc, slots);
    const mha_dtype dt = c->weight_dtype;
    for (int i = 0; i < MHA__WEIGHT_SLOTS; i++) {
        /* q8_0 / q4_0: the projections in blocks, the small tensors float32 beside them */
        const int64_t bytes = mha__is_block_weight(dt) && i >= MHA__SMALL_SLOT0
                                  ? slots[i].count * (int64_t)sizeof(float)
                                  : (int64_t)mha__weight_bytes(dt, slots[i].count);
        in[i] = mha__span_of(slots[i].name, slots[i].present ? *slots[i].ptr : NULL, bytes, 1);
    }
    return MHA__WEIGHT_SLOTS;
}

mha_status mha__check_layer_create(const mha_config *config,
                                   const mha_weights *weights,
                                   mha_ownership ownership,
                                   mha_layer *const *out,
                                   mha_config *c,
                                   int64_t *total,
                                   mha_error *err) {
    MHA_RETURN_IF(!out, err, INVALID_ARG, "out (the layer pointer) is NULL");
    MHA_RETURN_IF(!weights, err, INVALID_ARG, "weights is NULL");
    MHA_RETURN_IF(ownership != MHA_WEIGHTS_COPY && ownership != MHA_WEIGHTS_BORROW, err,
                  INVALID_ARG, "ownership=%d is not COPY or BORROW", (int)ownership);
    mha_status st = check_config(config, c, err);
    if (st)
        return st;
    mha_weights w = *weights;
    mha__weight_slot slots[MHA__WEIGHT_SLOTS];
    mha__layer_weight_slots(c, &w, slots);
    *total = 0;
    const mha_dtype dt = c->weight_dtype;
    for (int i = 0; i < MHA__WEIGHT_SLOTS; i++) {
        const void *ptr = *slots[i].ptr;
        if (!slots[i].present) {
            MHA_RETURN_IF(ptr != NULL, err, INVALID_ARG,
                          "weights.%s is given but the config does not enable it", slots[i].name);
            continue;
        }
        MHA_RETURN_IF(!ptr, err, INVALID_ARG, "weights.%s is NULL", slots[i].name);
        if (mha__is_block_weight(dt) && i >= MHA__SMALL_SLOT0) { /* float32 beside blocks */
            for (int64_t e = 0; e < slots[i].count; e++)
                MHA_RETURN_IF(!isfinite(((const float *)ptr)[e]), err, INVALID_ARG,
                              "weights.%s[%lld] is %g: weights must be finite", slots[i].name,
                              (long long)e, (double)((const float *)ptr)[e]);
        } else if (mha__is_block_weight(dt)) { /* the q are integers: the scales must be finite */
            const size_t bb = mha__block_bytes(dt);
            for (int64_t b = 0; b < slots[i].count / MHA__Q8_BLOCK; b++) {
                const float dh = mha__q8_scale((const char *)ptr + (size_t)b * bb, 0);
                MHA_RETURN_IF(!isfinite(dh), err, INVALID_ARG,
                              "weights.%s block %lld has the scale %g: %s scales must be finite",
                              slots[i].name, (long long)b, (double)dh,
                              dt == MHA_DTYPE_Q4_0 ? "q4_0" : "q8_0");
            }
        } else {
            for (int64_t e = 0; e < slots[i].count; e++) /* halves read as halves (widened) */
                MHA_RETURN_IF(!isfinite(mha__load(dt, ptr, e)), err, INVALID_ARG,
                              "weights.%s[%lld] is %g: weights must be finite", slots[i].name,
                              (long long)e, (double)mha__load(dt, ptr, e));
        }
        MHA_RETURN_IF(!mha__add_i64(*total, slots[i].count, total), err, OVERFLOW,
                      "weights: total size overflows");
    }
    return MHA_STATUS_OK;
}

mha_status mha__check_layer_trainable(const mha_config *c, const char *what, mha_error *err) {
    MHA_RETURN_IF(c && mha__is_block_weight(c->weight_dtype), err, UNSUPPORTED,
                  "%s: a layer with %s weights (config.weight_dtype=MHA_DTYPE_%s) is for "
                  "inference only (forward, project, prefill, decode step); dequantise its weights "
                  "into a float layer to train",
                  what, c->weight_dtype == MHA_DTYPE_Q4_0 ? "q4_0" : "q8_0",
                  c->weight_dtype == MHA_DTYPE_Q4_0 ? "Q4_0" : "Q8_0");
    return MHA_STATUS_OK;
}

/* The forward's arguments; need_out = 0 (the statistics): out is not written, may be NULL, and
 * the outputs are the statistics' (st, checked against the inputs when not NULL). */
static mha_status check_forward(const mha_config *c,
                                const mha_weights *w,
                                const mha_forward_args *a,
                                int need_out,
                                const mha_attention_stats *st_out,
                                int64_t *kv_len,
                                mha_error *err) {
    MHA_RETURN_IF(!c, err, INVALID_ARG, "layer is NULL");
    MHA_RETURN_IF(!a, err, INVALID_ARG, "args is NULL");
    MHA_RETURN_IF(a->batch < 1 || a->batch > MHA_MAX_DIM || a->q_len < 1 || a->q_len > MHA_MAX_DIM,
                  err, INVALID_ARG, "batch=%lld and q_len=%lld must be in [1, 2^31]",
                  (long long)a->batch, (long long)a->q_len);
    if (need_out)
        MHA_RETURN_IF(!a->query || !a->out, err, INVALID_ARG, "query and out must not be NULL");
    else
        MHA_RETURN_IF(!a->query, err, INVALID_ARG, "query must not be NULL");
    MHA_RETURN_IF(!mha__is_float_storage(a->x_dtype), err, INVALID_ARG,
                  "args.x_dtype=%d is not MHA_DTYPE_F32 (0), MHA_DTYPE_BF16 or MHA_DTYPE_F16",
                  (int)a->x_dtype);
    MHA_RETURN_IF(need_out && !mha__is_float_storage(a->out_dtype), err, INVALID_ARG,
                  "args.out_dtype=%d is not MHA_DTYPE_F32 (0), MHA_DTYPE_BF16 or MHA_DTYPE_F16",
                  (int)a->out_dtype);
    const int self = a->key == NULL;
    const int64_t m = self ? a->q_len : a->kv_len;
    MHA_RETURN_IF(!self && (m < 1 || m > MHA_MAX_DIM), err, INVALID_ARG,
                  "kv_len=%lld must be in [1, 2^31] for cross-attention", (long long)m);
    MHA_RETURN_IF(self && a->value, err, INVALID_ARG,
                  "value is given without key: pass key too (or neither for self-attention)");
    MHA_RETURN_IF(self && (c->k_dim != c->q_dim || c->v_dim != c->q_dim), err, INVALID_ARG,
                  "self-attention (key = NULL) needs k_dim = v_dim = q_dim, the layer has "
                  "q_dim=%lld k_dim=%lld v_dim=%lld",
                  (long long)c->q_dim, (long long)c->k_dim, (long long)c->v_dim);
    MHA_RETURN_IF(!self && !a->value && c->v_dim != c->k_dim, err, INVALID_ARG,
                  "value = NULL means value = key, but v_dim=%lld differs from k_dim=%lld",
                  (long long)c->v_dim, (long long)c->k_dim);
    mha_status st =
        mha__check_positions(a->q_positions, a->batch, a->q_len, a->q_len, "q_positions", err);
    if (!st)
        st = mha__check_positions(a->k_positions, a->batch, m, m, "k_positions", err);
    *kv_len = m;
    if (st || (!need_out && !st_out))
        return st;
    const int64_t B = a->batch, n = a->q_len;
    const size_t xs = mha__storage_size(a->x_dtype);
    /* Every input: the masks are read by the attention, the weights by the output projection
     * while it writes out. */
    mha__span in[5 + MHA__MASKING_SPANS + MHA__WEIGHT_SLOTS];
    int n_in = 0;
    in[n_in++] = mha__span_of("query", a->query, mha__count3(B, n, c->q_dim), xs);
    in[n_in++] = mha__span_of("key", a->key, mha__count3(B, m, c->k_dim), xs);
    in[n_in++] = mha__span_of("value", a->value, mha__count3(B, m, c->v_dim), xs);
    in[n_in++] = mha__span_of("q_positions", a->q_positions, mha__count3(B, n, 1), sizeof(int64_t));
    in[n_in++] = mha__span_of("k_positions", a->k_positions, mha__count3(B, m, 1), sizeof(int64_t));
    n_in += mha__masking_spans(&a->mask, B, n, m, 0, in + n_in);
    if (w)
        n_in += mha__layer_weight_spans(c, w, in + n_in);
    if (!need_out) { /* the statistics' outputs (their sizes are the core's check, later) */
        const int64_t h = c->num_heads, k = st_out->top_k > 0 ? st_out->top_k : 0;
        const int64_t cells = st_out->pool_rows > 0 && st_out->pool_cols > 0
                                  ? mha__count3(st_out->pool_rows, st_out->pool_cols, 1)
                                  : 0;
        const mha__span so[7] = {
            mha__span_of("stats.received", st_out->received, mha__count3(B, h, m), sizeof(float)),
            mha__span_of("stats.received_total", st_out->received_total, mha__count3(B, m, 1),
                         sizeof(float)),
            mha__span_of("stats.entropy", st_out->entropy, mha__count3(B, h, n), sizeof(float)),
            mha__span_of("stats.topk_index", st_out->topk_index, mha__count3(B * h, n, k),
                         sizeof(int64_t)),
            mha__span_of("stats.topk_prob", st_out->topk_prob, mha__count3(B * h, n, k),
                         sizeof(float)),
            mha__span_of("stats.pooled", st_out->pooled, mha__count3(B, h, cells), sizeof(float)),
            mha__span_of("stats.pooled_visible", st_out->pooled_visible, mha__count3(B, h, cells),
                         sizeof(float))};
        return mha__check_no_overlap(so, 7, in, n_in, err);
    }
    const int64_t heads = a->average_probs ? 1 : c->num_heads;
    const mha__span out[2] = {
        mha__span_of("out", a->out, mha__count3(B, n, c->out_dim), mha__storage_size(a->out_dtype)),
        mha__span_of("probs", a->probs, mha__count3(B * heads, n, m), sizeof(float))};
    return mha__check_no_overlap(out, 2, in, n_in, err);
}

/* mha_layer_project's checks but the aliasing rule, shared with the backward. */
static mha_status resolve_projection(const mha_config *c,
                                     const mha__layer_w *w,
                                     mha_projection which,
                                     int64_t rows,
                                     const float *x,
                                     const float *y,
                                     const mha_exec *exec,
                                     mha__projection *p,
                                     mha_error *err) {
    MHA_RETURN_IF(!c || !w, err, INVALID_ARG, "layer is NULL");
    MHA_RETURN_IF(rows < 0, err, INVALID_ARG, "rows=%lld is negative", (long long)rows);
    MHA_RETURN_IF(rows > 0 && (!x || !y), err, INVALID_ARG, "%s is NULL", !x ? "x" : "y");
    switch (which) {
    case MHA_PROJ_Q:
        *p = (mha__projection){w->w_q, w->wdt, w->b_q, c->q_dim, c->num_heads * c->head_dim};
        break;
    case MHA_PROJ_K:
        *p = (mha__projection){w->w_k, w->wdt, w->b_k, c->k_dim, c->num_kv_heads * c->head_dim};
        break;
    case MHA_PROJ_V:
        *p = (mha__projection){w->w_v, w->wdt, w->b_v, c->v_dim, c->num_kv_heads * c->v_head_dim};
        break;
    case MHA_PROJ_O:
        *p = (mha__projection){w->w_o, w->wdt, w->b_o, c->num_heads * c->v_head_dim, c->out_dim};
        break;
    default:
        return mha__fail(err, MHA_STATUS_INVALID_ARG, "which=%d is not a projection", (int)which);
    }
    const int64_t wide = p->in > p->out ? p->in : p->out;
    int64_t cnt;
    MHA_RETURN_IF(!mha__mul_i64(rows, wide, &cnt) || cnt > (int64_t)(SIZE_MAX / sizeof(float)), err,
                  OVERFLOW, "rows=%lld x %lld features overflows", (long long)rows,
                  (long long)wide);
    const mha_impl impl = exec ? exec->impl : MHA_IMPL_AUTO;
    MHA_RETURN_IF(impl != MHA_IMPL_AUTO && impl != MHA_IMPL_REFERENCE && impl != MHA_IMPL_FAST, err,
                  INVALID_ARG, "exec.impl=%d is not a known implementation", (int)impl);
    return MHA_STATUS_OK;
}

mha_status mha__check_layer_project(const mha_config *c,
                                    const mha__layer_w *w,
                                    mha_projection which,
                                    int64_t rows,
                                    const float *x,
                                    const float *y,
                                    const mha_exec *exec,
                                    mha__projection *p,
                                    mha_error *err) {
    mha_status st = resolve_projection(c, w, which, rows, x, y, exec, p, err);
    if (st)
        return st;
    const mha__span in[3] = {mha__span_of("x", x, rows * p->in, sizeof(float)),
                             mha__span_of("the layer's weight", p->w,
                                          (int64_t)mha__weight_bytes(p->wdt, p->in * p->out), 1),
                             mha__span_of("the layer's bias", p->bias, p->out, sizeof(float))};
    const mha__span out = mha__span_of("y", y, rows * p->out, sizeof(float));
    return mha__check_no_overlap(&out, 1, in, 3, err);
}

mha_status mha__check_layer_project_backward(const mha_config *c,
                                             const mha__layer_w *w,
                                             mha_projection which,
                                             int64_t rows,
                                             const float *x,
                                             const float *dy,
                                             const float *dx,
                                             const float *dw,
                                             const float *db,
                                             const mha_exec *exec,
                                             mha__projection *p,
                                             mha_error *err) {
    MHA_RETURN_IF(rows > 0 && !dy, err, INVALID_ARG, "dy is NULL");
    /* The forward's checks with dy as the input and dx as the output (x only matters for dW). */
    mha_status st = resolve_projection(c, w, which, rows, dy, dx ? dx : dy, exec, p, err);
    if (!st)
        st = mha__check_layer_trainable(c, "mha_layer_project_backward", err);
    if (st)
        return st;
    MHA_RETURN_IF(rows > 0 && dw && !x, err, INVALID_ARG, "x is NULL (needed for dw)");
    MHA_RETURN_IF(db && !p->bias, err, INVALID_ARG, "db is given but the projection has no bias");
    /* dy is [rows, out] and x, dx [rows, in]: the forward's names swapped. */
    const mha__span in[4] = {mha__span_of("x", dw ? x : NULL, rows * p->in, sizeof(float)),
                             mha__span_of("dy", dy, rows * p->out, sizeof(float)),
                             mha__span_of("the layer's weight", p->w,
                                          (int64_t)mha__weight_bytes(p->wdt, p->in * p->out), 1),
                             mha__span_of("the layer's bias", p->bias, p->out, sizeof(float))};
    const mha__span out[3] = {mha__span_of("dx", dx, rows * p->in, sizeof(float)),
                              mha__span_of("dw", dw, p->in * p->out, sizeof(float)),
                              mha__span_of("db", db, p->out, sizeof(float))};
    return mha__check_no_overlap(out, 3, in, 4, err);
}

mha_status mha__check_layer_backward(const mha_layer *layer,
                                     const mha_config *c,
                                     const mha_weights *w,
                                     const mha__train_view *s,
                                     const void *dy,
                                     const mha_layer_grads *gr,
                                     mha_error *err) {
    MHA_RETURN_IF(!layer || !w || !s || !dy || !gr, err, INVALID_ARG,
                  "layer, state, dy and grads must not be NULL");
    MHA_RETURN_IF(s->layer != layer, err, INVALID_ARG,
                  "state was made by mha_layer_forward_train with another layer");
    MHA_RETURN_IF(s->self && (gr->d_key || gr->d_value), err, INVALID_ARG,
                  "self-attention: d_query receives all three input paths; d_key and d_value "
                  "must be NULL");
    MHA_RETURN_IF(!s->self && !s->value_given && gr->d_value, err, INVALID_ARG,
                  "value = key in the forward: d_key receives both paths; d_value must be NULL");
    MHA_RETURN_IF((gr->db_q && !c->bias_q) || (gr->db_k && !c->bias_k) ||
                      (gr->db_v && !c->bias_v) || (gr->db_o && !c->bias_o),
                  err, INVALID_ARG, "a bias gradient is requested for a bias the layer lacks");
    MHA_RETURN_IF(gr->d_sinks && !c->sinks, err, INVALID_ARG,
                  "grads.d_sinks is given but the layer has no sinks");
    const int norm_w =
        c->qk_norm.kind == MHA_QK_NORM_RMS_HEAD || c->qk_norm.kind == MHA_QK_NORM_RMS_ALL;
    MHA_RETURN_IF((gr->d_q_norm || gr->d_k_norm) && !norm_w, err, INVALID_ARG,
                  "grads.d_%s_norm is given but the layer has no QK-norm weights",
                  gr->d_q_norm ? "q" : "k");
    const int64_t nq =
        c->qk_norm.kind == MHA_QK_NORM_RMS_ALL ? c->num_heads * c->head_dim : c->head_dim;
    const int64_t nk =
        c->qk_norm.kind == MHA_QK_NORM_RMS_ALL ? c->num_kv_heads * c->head_dim : c->head_dim;
    /* Every gradient against dy, the forward's inputs, the layer's weights and each other. */
    const int64_t B = s->B, n = s->n, m = s->m, h = c->num_heads, g = c->num_kv_heads;
    const int64_t dk = c->head_dim, dv = c->v_head_dim, gq = c->output_gate ? 2 : 1;
    const mha_forward_args *a = s->args;
    mha__span in[6 + MHA__MASKING_SPANS + MHA__WEIGHT_SLOTS];
    int n_in = 0;
    /* dy has the forward's out_dtype, the inputs and their gradients its x_dtype. */
    const size_t ys = mha__storage_size(a ? a->out_dtype : MHA_DTYPE_F32);
    const size_t xs = mha__storage_size(a ? a->x_dtype : MHA_DTYPE_F32);
    in[n_in++] = mha__span_of("dy", dy, mha__count3(B, n, c->out_dim), ys);
    in[n_in++] =
        mha__span_of("the forward's query", a ? a->query : NULL, mha__count3(B, n, c->q_dim), xs);
    in[n_in++] =
        mha__span_of("the forward's key", a ? a->key : NULL, mha__count3(B, m, c->k_dim), xs);
    in[n_in++] =
        mha__span_of("the forward's value", a ? a->value : NULL, mha__count3(B, m, c->v_dim), xs);
    /* The backward reads the forward's positions (RoPE) and masks again. */
    in[n_in++] = mha__span_of("the forward's q_positions", a ? a->q_positions : NULL,
                              mha__count3(B, n, 1), sizeof(int64_t));
    in[n_in++] = mha__span_of("the forward's k_positions", a ? a->k_positions : NULL,
                              mha__count3(B, m, 1), sizeof(int64_t));
    if (a)
        n_in += mha__masking_spans(&a->mask, B, n, m, 1, in + n_in);
    n_in += mha__layer_weight_spans(c, w, in + n_in);
    const mha__span out[14] = {
        mha__span_of("grads.d_query", gr->d_query, mha__count3(B, n, c->q_dim), xs),
        mha__span_of("grads.d_key", gr->d_key, mha__count3(B, m, c->k_dim), xs),
        mha__span_of("grads.d_value", gr->d_value, mha__count3(B, m, c->v_dim), xs),
        mha__span_of("grads.dw_q", gr->dw_q, mha__count3(gq * h, dk, c->q_dim), sizeof(float)),
        mha__span_of("grads.dw_k", gr->dw_k, mha__count3(g, dk, c->k_dim), sizeof(float)),
        mha__span_of("grads.dw_v", gr->dw_v, mha__count3(g, dv, c->v_dim), sizeof(float)),
        mha__span_of("grads.dw_o", gr->dw_o, mha__count3(c->out_dim, h, dv), sizeof(float)),
        mha__span_of("grads.db_q", gr->db_q, gq * h * dk, sizeof(float)),
        mha__span_of("grads.db_k", gr->db_k, g * dk, sizeof(float)),
        mha__span_of("grads.db_v", gr->db_v, g * dv, sizeof(float)),
        mha__span_of("grads.db_o", gr->db_o, c->out_dim, sizeof(float)),
        mha__span_of("grads.d_sinks", gr->d_sinks, h, sizeof(float)),
        mha__span_of("grads.d_q_norm", gr->d_q_norm, nq, sizeof(float)),
        mha__span_of("grads.d_k_norm", gr->d_k_norm, nk, sizeof(float))};
    return mha__check_no_overlap(out, 14, in, n_in, err);
}

mha_status mha__check_forward_args(const mha_config *c,
                                   const mha_weights *w,
                                   const mha_forward_args *a,
                                   int64_t *kv_len,
                                   mha_error *err) {
    return check_forward(c, w, a, 1, NULL, kv_len, err);
}

mha_status mha__check_layer_stats_args(const mha_config *c,
                                       const mha_weights *w,
                                       const mha_forward_args *a,
                                       const mha_attention_stats *stats,
                                       int64_t *kv_len,
                                       mha_error *err) {
    return check_forward(c, w, a, 0, stats, kv_len, err);
}
