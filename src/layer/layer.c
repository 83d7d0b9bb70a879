/* SPDX-License-Identifier: MIT */
/* layer.c: the multi-head attention layer: config validation, weight ownership, and the forward
 *   Q = x_q W_q^T + b_q   [B, n, h*dk]      K = x_k W_k^T + b_k   [B, m, g*dk]
 *   V = x_v W_v^T + b_v   [B, m, g*dv]      RoPE(Q), RoPE(K) at their token positions
 *   A = attention core(Q, K, V)  [B, n, h*dv]   (heads side by side: the "concat")
 *   y = A W_o^T + b_o     [B, n, out_dim]
 * Projections: impl=reference runs the plain loops below; fast/auto run the packed GEMM of
 * gemm.c (same math, blocked sums; bit-identical for any thread count). */
#include "base/internal.h"
#include "core/core.h"
#include "kernels/gemm.h"
#include "layer/plan.h"

#include <stdlib.h>
#include <string.h>

struct mha_layer {
    mha_config cfg; /* resolved: every default filled in */
    mha_weights w;  /* the pointers in use (own copy or borrowed) */
    float *owned;   /* the copy, when MHA_WEIGHTS_COPY */
    mha_allocator allocator;
    int has_allocator;
};

static mha_status resolve_config(const mha_config *in, mha_config *c, mha_error *err) {
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
        mha_status st = mha__rope_resolve(&in->rope, c->head_dim, &c->rope, err);
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

/* The weight tensors of a config, in one table: name, pointer slot, element count. */
typedef struct weight_slot {
    const char *name;
    const float **ptr;
    int64_t count;
    int present;
} weight_slot;

static int weight_slots(const mha_config *c, mha_weights *w, weight_slot slots[9]) {
    const int64_t h = c->num_heads, g = c->num_kv_heads;
    weight_slot s[9] = {
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
    return 9;
}

mha_status mha_layer_create(const mha_config *config,
                            const mha_weights *weights,
                            mha_ownership ownership,
                            const mha_allocator *allocator,
                            mha_layer **out,
                            mha_error *err) {
    MHA_RETURN_IF(!out, err, INVALID_ARG, "out (the layer pointer) is NULL");
    *out = NULL;
    MHA_RETURN_IF(!weights, err, INVALID_ARG, "weights is NULL");
    MHA_RETURN_IF(ownership != MHA_WEIGHTS_COPY && ownership != MHA_WEIGHTS_BORROW, err,
                  INVALID_ARG, "ownership=%d is not COPY or BORROW", (int)ownership);
    mha_config c;
    mha_status st = resolve_config(config, &c, err);
    if (st)
        return st;

    mha_weights w = *weights;
    weight_slot slots[9];
    const int ns = weight_slots(&c, &w, slots);
    int64_t total = 0;
    for (int i = 0; i < ns; i++) {
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
        MHA_RETURN_IF(!mha__add_i64(total, slots[i].count, &total), err, OVERFLOW,
                      "weights: total size overflows");
    }

    mha_layer *L = mha__alloc(allocator, sizeof *L);
    MHA_RETURN_IF(!L, err, NO_MEMORY, "cannot allocate the layer");
    memset(L, 0, sizeof *L);
    if (allocator) {
        L->allocator = *allocator;
        L->has_allocator = 1;
    }
    L->cfg = c;
    if (ownership == MHA_WEIGHTS_COPY) {
        size_t bytes;
        if (!mha__bytes(total, sizeof(float), &bytes) ||
            !(L->owned = mha__alloc(allocator, bytes))) {
            mha__free(allocator, L);
            return mha__fail(err, MHA_STATUS_NO_MEMORY, "cannot allocate %lld weight floats",
                             (long long)total);
        }
        float *dst = L->owned;
        for (int i = 0; i < ns; i++) {
            if (!slots[i].present)
                continue;
            memcpy(dst, *slots[i].ptr, sizeof(float) * (size_t)slots[i].count);
            *slots[i].ptr = dst;
            dst += slots[i].count;
        }
    }
    L->w = w;
    *out = L;
    mha__ok(err);
    return MHA_STATUS_OK;
}

void mha_layer_destroy(mha_layer *layer) {
    if (!layer)
        return;
    const mha_allocator *a = layer->has_allocator ? &layer->allocator : NULL;
    mha_allocator copy = layer->allocator;
    mha__free(a, layer->owned);
    mha__free(a ? &copy : NULL, layer);
}

const mha_config *mha_layer_config(const mha_layer *layer) {
    return layer ? &layer->cfg : NULL;
}

const mha_weights *mha_layer_weights(const mha_layer *layer) {
    return layer ? &layer->w : NULL;
}

/* ---------------------------------------------------------------------------------------------- */
/* Forward                                                                                        */
/* ---------------------------------------------------------------------------------------------- */

/* Workspace: Q [B,n,h*dk] | K [B,m,g*dk] | V [B,m,g*dv] | A [B,n,h*dv] | rope tables |
 * GEMM packing buffer (the largest of the four projections'; they run one after the other) |
 * core ws. With a caller workspace the forward allocates nothing. */
typedef struct fwd_layout {
    int64_t m;
    size_t q_off, k_off, v_off, a_off, rope_off, pack_off, core_off, total;
    size_t pack_bytes, core_bytes;
} fwd_layout;

static void core_args_for(const mha_layer *L,
                          const mha_forward_args *a,
                          int64_t m,
                          float *q,
                          float *k,
                          float *v,
                          float *att,
                          mha_attention_args *c) {
    const mha_config *cfg = &L->cfg;
    const int64_t h = cfg->num_heads, g = cfg->num_kv_heads, n = a->q_len;
    memset(c, 0, sizeof *c);
    c->batch = a->batch;
    c->num_heads = h;
    c->num_kv_heads = g;
    c->q_len = n;
    c->kv_len = m;
    c->head_dim = cfg->head_dim;
    c->v_head_dim = cfg->v_head_dim;
    c->scale = cfg->scale;
    c->softcap = cfg->softcap;
    c->alibi = cfg->alibi;
    c->sinks = L->w.sinks;
    /* [B, L, heads, d] buffers seen as [B, heads, L, d]. */
    c->q = q;
    c->q_strides[0] = n * h * cfg->head_dim;
    c->q_strides[1] = cfg->head_dim;
    c->q_strides[2] = h * cfg->head_dim;
    c->k = k;
    c->k_strides[0] = m * g * cfg->head_dim;
    c->k_strides[1] = cfg->head_dim;
    c->k_strides[2] = g * cfg->head_dim;
    c->v = v;
    c->v_strides[0] = m * g * cfg->v_head_dim;
    c->v_strides[1] = cfg->v_head_dim;
    c->v_strides[2] = g * cfg->v_head_dim;
    c->out = att;
    c->out_strides[0] = n * h * cfg->v_head_dim;
    c->out_strides[1] = cfg->v_head_dim;
    c->out_strides[2] = h * cfg->v_head_dim;
    c->probs = a->probs;
    c->average_probs = a->average_probs;
    c->mask = a->mask;
    c->dropout = a->dropout;
}

static mha_status
check_positions(const int64_t *pos, int64_t B, int64_t L, const char *name, mha_error *err) {
    if (!pos)
        return MHA_STATUS_OK;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < L; t++)
            MHA_RETURN_IF(pos[b * L + t] < 0 || pos[b * L + t] > MHA_MAX_POSITION, err, INVALID_ARG,
                          "%s[%lld][%lld]=%lld outside [0, 2^31]", name, (long long)b, (long long)t,
                          (long long)pos[b * L + t]);
    return MHA_STATUS_OK;
}

/* Everything about the call that can be checked without running it. */
static mha_status validate_forward(const mha_layer *L,
                                   const mha_forward_args *a,
                                   const mha_exec *exec,
                                   fwd_layout *l,
                                   mha_error *err) {
    MHA_RETURN_IF(!L, err, INVALID_ARG, "layer is NULL");
    MHA_RETURN_IF(!a, err, INVALID_ARG, "args is NULL");
    const mha_config *c = &L->cfg;
    MHA_RETURN_IF(a->batch < 1 || a->batch > MHA_MAX_DIM || a->q_len < 1 || a->q_len > MHA_MAX_DIM,
                  err, INVALID_ARG, "batch=%lld and q_len=%lld must be in [1, 2^31]",
                  (long long)a->batch, (long long)a->q_len);
    MHA_RETURN_IF(!a->query || !a->out, err, INVALID_ARG, "query and out must not be NULL");
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
    mha_status st = check_positions(a->q_positions, a->batch, a->q_len, "q_positions", err);
    if (!st)
        st = check_positions(a->k_positions, a->batch, m, "k_positions", err);
    if (st)
        return st;

    /* Sizes of the intermediate buffers, overflow-checked. */
    const int64_t B = a->batch, n = a->q_len, h = c->num_heads, g = c->num_kv_heads;
    int64_t cnt[4];
    const int64_t f[4][4] = {{B, n, h, c->head_dim},
                             {B, m, g, c->head_dim},
                             {B, m, g, c->v_head_dim},
                             {B, n, h, c->v_head_dim}};
    size_t bytes[4];
    for (int i = 0; i < 4; i++)
        MHA_RETURN_IF(!mha__prod_i64(f[i], 4, &cnt[i]) ||
                          !mha__bytes(cnt[i], sizeof(float), &bytes[i]),
                      err, OVERFLOW, "intermediate tensor %d of the forward overflows", i);
    size_t rope_bytes = 0;
    if (c->rope.style != MHA_ROPE_NONE)
        rope_bytes = sizeof(double) * mha__plan_rope_doubles(&c->rope);

    /* The projections' packing buffer: impl=reference runs plain loops and packs nothing. */
    l->pack_bytes = 0;
    if (!exec || exec->impl != MHA_IMPL_REFERENCE) {
        const int64_t proj[4][3] = {{B * n, h * c->head_dim, c->q_dim},
                                    {B * m, g * c->head_dim, c->k_dim},
                                    {B * m, g * c->v_head_dim, c->v_dim},
                                    {B * n, c->out_dim, h * c->v_head_dim}};
        for (int i = 0; i < 4; i++) {
            size_t pb;
            st = mha__gemm_workspace_size(MHA__GEMM_AUTO, proj[i][0], proj[i][1], proj[i][2], &pb,
                                          err);
            if (st)
                return st;
            l->pack_bytes = pb > l->pack_bytes ? pb : l->pack_bytes;
        }
    }

    mha_attention_args core;
    core_args_for(L, a, m, (float *)a->out, (float *)a->out, (float *)a->out, a->out, &core);
    mha_exec core_exec = exec ? *exec : (mha_exec){0};
    core_exec.workspace = NULL;
    st = mha_attention_workspace_size(&core, &core_exec, &l->core_bytes, err);
    if (st)
        return st;

    l->m = m;
    l->q_off = 0;
    l->k_off = l->q_off + mha__align64(bytes[0]);
    l->v_off = l->k_off + mha__align64(bytes[1]);
    l->a_off = l->v_off + mha__align64(bytes[2]);
    l->rope_off = l->a_off + mha__align64(bytes[3]);
    l->pack_off = l->rope_off + mha__align64(rope_bytes);
    MHA_RETURN_IF(l->pack_bytes > SIZE_MAX - 64 - l->pack_off, err, OVERFLOW,
                  "forward workspace size overflows");
    l->core_off = l->pack_off + mha__align64(l->pack_bytes);
    MHA_RETURN_IF(l->core_off > SIZE_MAX - l->core_bytes, err, OVERFLOW,
                  "forward workspace size overflows");
    l->total = l->core_off + l->core_bytes;
    return MHA_STATUS_OK;
}

mha_status mha_layer_forward_workspace_size(const mha_layer *layer,
                                            const mha_forward_args *args,
                                            const mha_exec *exec,
                                            size_t *bytes,
                                            mha_error *err) {
    MHA_RETURN_IF(!bytes, err, INVALID_ARG, "bytes is NULL");
    fwd_layout l;
    mha_status st = validate_forward(layer, args, exec, &l, err);
    if (st)
        return st;
    MHA_RETURN_IF(!mha__workspace_bytes(l.total, bytes), err, OVERFLOW,
                  "forward workspace size overflows");
    mha__ok(err);
    return MHA_STATUS_OK;
}

mha_status mha_layer_forward_supported(const mha_layer *layer,
                                       const mha_forward_args *args,
                                       const mha_exec *exec,
                                       mha_error *err) {
    fwd_layout l;
    mha_status st = validate_forward(layer, args, exec, &l, err);
    if (st)
        return st;
    mha_attention_args core;
    core_args_for(layer, args, l.m, (float *)args->out, (float *)args->out, (float *)args->out,
                  args->out, &core);
    return mha_attention_supported(&core, exec, err);
}

mha_status mha_layer_forward(const mha_layer *layer,
                             const mha_forward_args *args,
                             const mha_exec *exec,
                             mha_error *err) {
    fwd_layout l;
    mha_status st = validate_forward(layer, args, exec, &l, err);
    if (st)
        return st;
    const mha_config *c = &layer->cfg;
    const mha_weights *w = &layer->w;
    const int64_t B = args->batch, n = args->q_len, m = l.m;
    const int64_t h = c->num_heads, g = c->num_kv_heads;
    const int self = args->key == NULL;

    /* The workspace, then the core (sizes, masks, the implementation) is validated before any
     * work, on the region of the workspace it will run in. */
    const mha_allocator *alloc = exec ? exec->allocator : NULL;
    char *ws, *owned;
    st = mha__workspace_take(exec, l.total, "this forward", &ws, &owned, err);
    if (st)
        return st;
    float *q = (float *)(ws + l.q_off), *k = (float *)(ws + l.k_off);
    float *v = (float *)(ws + l.v_off), *att = (float *)(ws + l.a_off);
    /* The core is validated here, once, on the buffers the projections will fill, and run
     * after them (mha__core_prepare / mha__core_finish). */
    mha_attention_args core;
    core_args_for(layer, args, m, q, k, v, att, &core);
    mha_exec core_exec = exec ? *exec : (mha_exec){0};
    core_exec.workspace = ws + l.core_off;
    core_exec.workspace_bytes = l.core_bytes;
    mha__core_call call;
    st = mha__core_prepare(&core, &core_exec, NULL, &call, err);
    if (st) {
        mha__free(alloc, owned);
        return st;
    }
    const mha__team team = call.team;
    const mha_impl impl = exec ? exec->impl : MHA_IMPL_AUTO;

    const float *xk = self ? args->query : args->key;
    const float *xv = self ? args->query : (args->value ? args->value : args->key);
    /* Everything comes from the one workspace taken above, so nothing can fail for want of
     * memory after the core has written args->probs. */
    void *pack = ws + l.pack_off;
    st = mha__plan_project(impl, alloc, team, args->query, w->w_q, w->b_q, q, B * n, c->q_dim,
                           h * c->head_dim, pack, l.pack_bytes, err);
    if (!st)
        st = mha__plan_project(impl, alloc, team, xk, w->w_k, w->b_k, k, B * m, c->k_dim,
                               g * c->head_dim, pack, l.pack_bytes, err);
    if (!st)
        st = mha__plan_project(impl, alloc, team, xv, w->w_v, w->b_v, v, B * m, c->v_dim,
                               g * c->v_head_dim, pack, l.pack_bytes, err);

    if (!st && c->rope.style != MHA_ROPE_NONE) {
        double *tab = (double *)(ws + l.rope_off);
        const int64_t *kpos =
            args->k_positions ? args->k_positions : (self ? args->q_positions : NULL);
        mha__plan_rope(&c->rope, tab, q, B, n, h, c->head_dim, args->q_positions, NULL, 1);
        mha__plan_rope(&c->rope, tab, k, B, m, g, c->head_dim, kpos, NULL, 1);
    }

    const mha_status core_st = mha__core_finish(&call, !st, err);
    if (!st)
        st = core_st;
    if (!st)
        st = mha__plan_project(impl, alloc, team, att, w->w_o, w->b_o, args->out, B * n,
                               h * c->v_head_dim, c->out_dim, pack, l.pack_bytes, err);
    mha__free(alloc, owned);
    if (!st)
        mha__ok(err);
    return st;
}
