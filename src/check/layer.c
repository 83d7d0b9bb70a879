/* SPDX-License-Identifier: MIT */
/* check/layer.c: the checks of the layer's public calls: the config and weights of
 * mha_layer_create, the inputs of mha_layer_forward* (the core's options are checked by
 * check/attention.c on the core's arguments), the gradient requests of mha_layer_backward. */
#include "check/check.h"

#include <string.h>

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
    MHA_RETURN_IF(!isfinite(c->scale), err, INVALID_ARG, "config.scale=%g is not finite", c->scale);
    MHA_RETURN_IF(!isfinite(c->softcap) || c->softcap < 0.0, err, INVALID_ARG,
                  "config.softcap=%g must be finite and >= 0 (0 = off)", c->softcap);
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
    return MHA_STATUS_OK;
}

void mha__layer_weight_slots(const mha_config *c,
                             mha_weights *w,
                             mha__weight_slot slots[MHA__WEIGHT_SLOTS]) {
    const int64_t h = c->num_heads, g = c->num_kv_heads;
    const mha__weight_slot s[MHA__WEIGHT_SLOTS] = {
        {"w_q", &w->w_q, h * c->head_dim * c->q_dim, 1},
        {"w_k", &w->w_k, g * c->head_dim * c->k_dim, 1},
        {"w_v", &w->w_v, g * c->v_head_dim * c->v_dim, 1},
        {"w_o", &w->w_o, c->out_dim * h * c->v_head_dim, 1},
        {"b_q", &w->b_q, h * c->head_dim, c->bias_q},
        {"b_k", &w->b_k, g * c->head_dim, c->bias_k},
        {"b_v", &w->b_v, g * c->v_head_dim, c->bias_v},
        {"b_o", &w->b_o, c->out_dim, c->bias_o},
        {"sinks", &w->sinks, h, c->sinks},
    };
    memcpy(slots, s, sizeof s);
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
    for (int i = 0; i < MHA__WEIGHT_SLOTS; i++) {
        const float *ptr = *slots[i].ptr;
        if (!slots[i].present) {
            MHA_RETURN_IF(ptr != NULL, err, INVALID_ARG,
                          "weights.%s is given but the config does not enable it", slots[i].name);
            continue;
        }
        MHA_RETURN_IF(!ptr, err, INVALID_ARG, "weights.%s is NULL", slots[i].name);
        for (int64_t e = 0; e < slots[i].count; e++)
            MHA_RETURN_IF(!isfinite(ptr[e]), err, INVALID_ARG,
                          "weights.%s[%lld] is %g: weights must be finite", slots[i].name,
                          (long long)e, (double)ptr[e]);
        MHA_RETURN_IF(!mha__add_i64(*total, slots[i].count, total), err, OVERFLOW,
                      "weights: total size overflows");
    }
    return MHA_STATUS_OK;
}

/* The forward's arguments; need_out = 0 (the statistics): out is not written, may be NULL. */
static mha_status check_forward(
    const mha_config *c, const mha_forward_args *a, int need_out, int64_t *kv_len, mha_error *err) {
    MHA_RETURN_IF(!c, err, INVALID_ARG, "layer is NULL");
    MHA_RETURN_IF(!a, err, INVALID_ARG, "args is NULL");
    MHA_RETURN_IF(a->batch < 1 || a->batch > MHA_MAX_DIM || a->q_len < 1 || a->q_len > MHA_MAX_DIM,
                  err, INVALID_ARG, "batch=%lld and q_len=%lld must be in [1, 2^31]",
                  (long long)a->batch, (long long)a->q_len);
    if (need_out)
        MHA_RETURN_IF(!a->query || !a->out, err, INVALID_ARG, "query and out must not be NULL");
    else
        MHA_RETURN_IF(!a->query, err, INVALID_ARG, "query must not be NULL");
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
    return st;
}

mha_status mha__check_layer_backward(const mha_layer *layer,
                                     const mha_config *c,
                                     const mha__train_view *s,
                                     const float *dy,
                                     const mha_layer_grads *gr,
                                     mha_error *err) {
    MHA_RETURN_IF(!layer || !s || !dy || !gr, err, INVALID_ARG,
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
    return MHA_STATUS_OK;
}

mha_status mha__check_forward_args(const mha_config *c,
                                   const mha_forward_args *a,
                                   int64_t *kv_len,
                                   mha_error *err) {
    return check_forward(c, a, 1, kv_len, err);
}

mha_status mha__check_layer_stats_args(const mha_config *c,
                                       const mha_forward_args *a,
                                       int64_t *kv_len,
                                       mha_error *err) {
    return check_forward(c, a, 0, kv_len, err);
}
