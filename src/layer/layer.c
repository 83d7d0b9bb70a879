/* SPDX-License-Identifier: MIT */
/* layer.c: the multi-head attention layer: config validation, weight ownership, and the forward
 *   Q = x_q W_q^T + b_q   [B, n, h*dk]      K = x_k W_k^T + b_k   [B, m, g*dk]
 *   V = x_v W_v^T + b_v   [B, m, g*dv]      RoPE(Q), RoPE(K) at their token positions
 *   A = attention core(Q, K, V)  [B, n, h*dv]   (heads side by side: the "concat")
 *   y = A W_o^T + b_o     [B, n, out_dim]
 * Projections: impl=reference runs the plain loops below; fast/auto run the packed GEMM of
 * gemm.c (same math, blocked sums; bit-identical for any thread count). */
#include "base/internal.h"
#include "check/check.h"
#include "core/core.h"
#include "kernels/gemm.h"
#include "layer/plan.h"

#include <stdlib.h>
#include <string.h>

struct mha_layer {
    mha_config cfg;   /* resolved: every default filled in */
    mha_weights w;    /* the pointers in use (own copy or borrowed), in cfg.weight_dtype */
    mha__layer_w cw;  /* what the arithmetic reads: w's projections, float32 biases and sinks */
    void *owned;      /* the copy, when MHA_WEIGHTS_COPY, in cfg.weight_dtype (not widened) */
    float *small_f32; /* half weights: biases and sinks widened once (else NULL: w's own) */
    mha_allocator allocator;
    int has_allocator;
};

const mha__layer_w *mha__layer_compute_weights(const mha_layer *layer) {
    return layer ? &layer->cw : NULL;
}

/* The arithmetic's view of the weights: half biases, sinks and QK-norm weights widened into
 * L->small_f32 (slots 4..10: b_q b_k b_v b_o sinks q_norm k_norm), projections as stored. */
static mha_status compute_view(mha_layer *L, const mha_allocator *allocator, mha_error *err) {
    const mha_dtype dt = L->cfg.weight_dtype;
    mha_weights w = L->w;
    mha__weight_slot slots[MHA__WEIGHT_SLOTS];
    mha__layer_weight_slots(&L->cfg, &w, slots);
    const float *small[MHA__WEIGHT_SLOTS - MHA__SMALL_SLOT0] = {NULL};
    int64_t count = 0;
    for (int i = MHA__SMALL_SLOT0; i < MHA__WEIGHT_SLOTS; i++)
        count += slots[i].present ? slots[i].count : 0;
    /* q8_0 / q4_0 projections come with float32 biases, sinks and norms (docs/SEMANTICS.md). */
    const mha_dtype sdt = mha__is_block_weight(dt) ? MHA_DTYPE_F32 : dt;
    if (sdt != MHA_DTYPE_F32 && count > 0) {
        L->small_f32 = mha__alloc(allocator, sizeof(float) * (size_t)count);
        MHA_RETURN_IF(!L->small_f32, err, NO_MEMORY, "cannot allocate %lld bias/sink floats",
                      (long long)count);
    }
    float *dst = L->small_f32;
    for (int i = MHA__SMALL_SLOT0; i < MHA__WEIGHT_SLOTS; i++) {
        if (!slots[i].present)
            continue;
        if (sdt == MHA_DTYPE_F32) {
            small[i - MHA__SMALL_SLOT0] = *slots[i].ptr;
            continue;
        }
        mha__widen(sdt, *slots[i].ptr, dst, slots[i].count);
        small[i - MHA__SMALL_SLOT0] = dst;
        dst += slots[i].count;
    }
    L->cw = (mha__layer_w){w.w_q,    w.w_k,    w.w_v,    w.w_o,    dt,       small[0],
                           small[1], small[2], small[3], small[4], small[5], small[6]};
    return MHA_STATUS_OK;
}

mha_status mha_layer_create(const mha_config *config,
                            const mha_weights *weights,
                            mha_ownership ownership,
                            const mha_allocator *allocator,
                            mha_layer **out,
                            mha_error *err) {
    if (out)
        *out = NULL;
    mha_config c;
    int64_t total;
    mha_status st = mha__check_layer_create(config, weights, ownership, out, &c, &total, err);
    if (st)
        return st;
    mha_weights w = *weights;
    mha__weight_slot slots[MHA__WEIGHT_SLOTS];
    mha__layer_weight_slots(&c, &w, slots);

    mha_layer *L = mha__alloc(allocator, sizeof *L);
    MHA_RETURN_IF(!L, err, NO_MEMORY, "cannot allocate the layer");
    memset(L, 0, sizeof *L);
    if (allocator) {
        L->allocator = *allocator;
        L->has_allocator = 1;
    }
    L->cfg = c;
    /* Each tensor's bytes: q8_0 / q4_0 projections (34 / 18 bytes per 32 values, <= 4 bytes per
     * value) come with float32 small tensors; total floats of 4 bytes bound every dtype's bytes. */
    const int q8 = mha__is_block_weight(c.weight_dtype);
    size_t sbytes[MHA__WEIGHT_SLOTS], step[MHA__WEIGHT_SLOTS];
    for (int i = 0; i < MHA__WEIGHT_SLOTS; i++) {
        sbytes[i] = !slots[i].present ? 0
                    : q8 && i >= MHA__SMALL_SLOT0
                        ? sizeof(float) * (size_t)slots[i].count
                        : mha__weight_bytes(c.weight_dtype, slots[i].count);
        /* block types: each tensor 64-byte aligned (34- or 18-byte blocks would misalign the
         * float32 tensors after them); the other dtypes keep their packed layout. */
        step[i] = q8 ? (sbytes[i] + 63) & ~(size_t)63 : sbytes[i];
    }
    if (ownership == MHA_WEIGHTS_COPY) {
        size_t bytes = 0;
        /* The bound total * 4 + 11 * 64 >= the sum of the steps cannot overflow. */
        const int ok =
            mha__bytes(total, sizeof(float), &bytes) && bytes <= SIZE_MAX - 64 * MHA__WEIGHT_SLOTS;
        bytes = 0;
        for (int i = 0; i < MHA__WEIGHT_SLOTS; i++)
            bytes += step[i];
        if (!ok || !(L->owned = mha__alloc_large(allocator, bytes))) {
            mha__free(allocator, L);
            return mha__fail(err, MHA_STATUS_NO_MEMORY, "cannot allocate %lld weights",
                             (long long)total);
        }
        char *dst = L->owned;
        for (int i = 0; i < MHA__WEIGHT_SLOTS; i++) {
            if (!slots[i].present)
                continue;
            memcpy(dst, *slots[i].ptr, sbytes[i]);
            *slots[i].ptr = dst;
            dst += step[i];
        }
    }
    L->w = w;
    mha_status st2 = compute_view(L, allocator, err);
    if (st2) {
        mha__free(allocator, L->owned);
        mha__free(allocator, L);
        return st2;
    }
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
    mha__free(a, layer->small_f32);
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

/* Workspace: Q [B,n,h*dk] | K [B,m,g*dk] | V [B,m,g*dv] (float32, the projections' results) |
 * A [B,n,h*dv] (in the intermediates' dtype adt) | Q, K, V in adt (half intermediates only: what
 * the core reads) | rope tables | GEMM packing buffer (the largest of the four projections'; they
 * run one after the other) | core ws | Y [B,n,out_dim] float32 when out is half (the output
 * projection's result, rounded once into out). With a caller workspace the forward allocates
 * nothing. */
typedef struct fwd_layout {
    int64_t m;
    mha_dtype adt; /* the intermediates' dtype: mha__plan_act_dtype(x_dtype, weight_dtype) */
    size_t q_off, k_off, v_off, a_off, qh_off, kh_off, vh_off, rope_off, pack_off, core_off, y_off,
        g_off, total;
    size_t pack_bytes, core_bytes;
} fwd_layout;

/* The forward's checks (check/: its arguments) and its workspace layout, before any work. */
static mha_status plan_forward(const mha_layer *L,
                               const mha_forward_args *a,
                               const mha_exec *exec,
                               fwd_layout *l,
                               mha_error *err) {
    int64_t m;
    mha_status st = mha__check_forward_args(L ? &L->cfg : NULL, mha_layer_weights(L), a, &m, err);
    if (st)
        return st;
    const mha_config *c = &L->cfg;

    /* Sizes of the intermediate buffers, overflow-checked. */
    const int64_t B = a->batch, n = a->q_len, h = c->num_heads, g = c->num_kv_heads;
    const mha_dtype adt = mha__plan_act_dtype(a->x_dtype, c->weight_dtype);
    const size_t hsize = adt == MHA_DTYPE_F32 ? 0 : mha__storage_size(adt);
    int64_t cnt[4];
    const int64_t f[4][4] = {{B, n, h, c->head_dim},
                             {B, m, g, c->head_dim},
                             {B, m, g, c->v_head_dim},
                             {B, n, h, c->v_head_dim}};
    size_t bytes[4], hbytes[3] = {0, 0, 0};
    for (int i = 0; i < 4; i++)
        MHA_RETURN_IF(!mha__prod_i64(f[i], 4, &cnt[i]) ||
                          !mha__bytes(cnt[i], sizeof(float), &bytes[i]) ||
                          (i < 3 && !mha__bytes(cnt[i], hsize, &hbytes[i])),
                      err, OVERFLOW, "intermediate tensor %d of the forward overflows", i);
    if (hsize)
        bytes[3] /= 2; /* A in adt */
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
            st = mha__gemm_workspace_size_dt(MHA__GEMM_AUTO, proj[i][0], proj[i][1], proj[i][2],
                                             i < 3 ? a->x_dtype : adt, &pb, err);
            if (st)
                return st;
            l->pack_bytes = pb > l->pack_bytes ? pb : l->pack_bytes;
        }
    }

    mha_attention_args core;
    mha__plan_core_args(c, L->cw.sinks, a, m, a->out, a->out, a->out, a->out, NULL, adt, &core);
    mha_exec core_exec = exec ? *exec : (mha_exec){0};
    core_exec.workspace = NULL;
    st = mha_attention_workspace_size(&core, &core_exec, &l->core_bytes, err);
    if (st)
        return st;

    l->m = m;
    l->adt = adt;
    l->q_off = 0;
    l->k_off = l->q_off + mha__align64(bytes[0]);
    l->v_off = l->k_off + mha__align64(bytes[1]);
    l->a_off = l->v_off + mha__align64(bytes[2]);
    l->qh_off = l->a_off + mha__align64(bytes[3]);
    l->kh_off = l->qh_off + mha__align64(hbytes[0]);
    l->vh_off = l->kh_off + mha__align64(hbytes[1]);
    l->rope_off = l->vh_off + mha__align64(hbytes[2]);
    l->pack_off = l->rope_off + mha__align64(rope_bytes);
    MHA_RETURN_IF(l->pack_bytes > SIZE_MAX - 64 - l->pack_off, err, OVERFLOW,
                  "forward workspace size overflows");
    l->core_off = l->pack_off + mha__align64(l->pack_bytes);
    MHA_RETURN_IF(l->core_off > SIZE_MAX - 64 - l->core_bytes, err, OVERFLOW,
                  "forward workspace size overflows");
    l->y_off = l->core_off + mha__align64(l->core_bytes);
    size_t y_bytes = 0;
    int64_t ycnt;
    if (a->out_dtype != MHA_DTYPE_F32)
        MHA_RETURN_IF(!mha__mul_i64(B * n, c->out_dim, &ycnt) ||
                          !mha__bytes(ycnt, sizeof(float), &y_bytes) ||
                          l->y_off > SIZE_MAX - y_bytes,
                      err, OVERFLOW, "forward workspace size overflows");
    l->total = a->out_dtype != MHA_DTYPE_F32 ? l->y_off + y_bytes : l->core_off + l->core_bytes;
    /* The output gate's G [B, n, h*dk] (config.output_gate), at the end. */
    l->g_off = mha__align64(l->total);
    if (c->output_gate)
        MHA_RETURN_IF(l->g_off < l->total || l->g_off > SIZE_MAX - bytes[0], err, OVERFLOW,
                      "forward workspace size overflows");
    if (c->output_gate)
        l->total = l->g_off + bytes[0];
    return MHA_STATUS_OK;
}

mha_status mha_layer_forward_workspace_size(const mha_layer *layer,
                                            const mha_forward_args *args,
                                            const mha_exec *exec,
                                            size_t *bytes,
                                            mha_error *err) {
    MHA_RETURN_IF(!bytes, err, INVALID_ARG, "bytes is NULL");
    fwd_layout l;
    mha_status st = plan_forward(layer, args, exec, &l, err);
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
    mha_status st = plan_forward(layer, args, exec, &l, err);
    if (st)
        return st;
    mha_attention_args core;
    mha__plan_core_args(&layer->cfg, layer->cw.sinks, args, l.m, args->out, args->out, args->out,
                        args->out, NULL, l.adt, &core);
    return mha__attention_supported_layout(&core, exec, err); /* core's buffers: placeholders */
}

mha_status mha_layer_forward(const mha_layer *layer,
                             const mha_forward_args *args,
                             const mha_exec *exec,
                             mha_error *err) {
    fwd_layout l;
    mha_status st = plan_forward(layer, args, exec, &l, err);
    if (st)
        return st;
    const mha_config *c = &layer->cfg;
    const mha__layer_w *w = &layer->cw;
    const int64_t B = args->batch, n = args->q_len, m = l.m;
    const mha_dtype xdt = args->x_dtype, wdt = w->wdt;
    const int64_t h = c->num_heads, g = c->num_kv_heads;
    const int self = args->key == NULL;

    /* The workspace, then the core (sizes, masks, the implementation) is validated before any
     * work, on the region of the workspace it will run in. */
    const mha_allocator *alloc = exec ? exec->allocator : NULL;
    char *ws, *owned;
    st = mha__workspace_take(exec, l.total, "this forward", &ws, &owned, err);
    if (st)
        return st;
    const mha_dtype adt = l.adt;
    const int half_act = adt != MHA_DTYPE_F32;
    float *q = (float *)(ws + l.q_off), *k = (float *)(ws + l.k_off);
    float *v = (float *)(ws + l.v_off);
    void *att = ws + l.a_off;
    /* What the core reads: the float32 buffers, or their copies rounded to a half adt. */
    void *cq = half_act ? (void *)(ws + l.qh_off) : q, *ck = half_act ? (void *)(ws + l.kh_off) : k;
    void *cv = half_act ? (void *)(ws + l.vh_off) : v;
    /* The core is validated here, once, on the buffers the projections will fill, and run
     * after them (mha__core_prepare / mha__core_finish). */
    mha_attention_args core;
    mha__plan_core_args(c, w->sinks, args, m, cq, ck, cv, att, NULL, adt, &core);
    mha_exec core_exec = exec ? *exec : (mha_exec){0};
    core_exec.workspace = ws + l.core_off;
    core_exec.workspace_bytes = l.core_bytes;
    mha__core_call call;
    st = mha__core_prepare(&core, &core_exec, NULL, NULL, &call, err);
    if (st) {
        mha__free(alloc, owned);
        return st;
    }
    const mha__team team = call.team;
    const mha_impl impl = exec ? exec->impl : MHA_IMPL_AUTO;

    const void *xk = self ? args->query : args->key;
    const void *xv = self ? args->query : (args->value ? args->value : args->key);
    /* Everything comes from the one workspace taken above, so nothing can fail for want of
     * memory after the core has written args->probs. */
    void *pack = ws + l.pack_off;
    st = mha__plan_project(impl, alloc, team, args->query, xdt, w->w_q, wdt, w->b_q, q, B * n,
                           c->q_dim, h * c->head_dim, pack, l.pack_bytes, err);
    if (!st)
        st = mha__plan_project(impl, alloc, team, xk, xdt, w->w_k, wdt, w->b_k, k, B * m, c->k_dim,
                               g * c->head_dim, pack, l.pack_bytes, err);
    if (!st)
        st = mha__plan_project(impl, alloc, team, xv, xdt, w->w_v, wdt, w->b_v, v, B * m, c->v_dim,
                               g * c->v_head_dim, pack, l.pack_bytes, err);

    /* Q and K through their stages; with half intermediates each stage's result is rounded to
     * adt (mha__plan_round_qk: the last one by the narrow below), as torch stores them. */
    const int64_t nq = B * n * h * c->head_dim, nk = B * m * g * c->head_dim;
    if (!st)
        st = mha__plan_round_qk(c, MHA__QK_PROJ, team, adt, q, nq, k, nk, err);
    if (!st)
        mha__plan_qk_norm_stage(c, w, 0, q, B * n, k, B * m);
    if (!st)
        st = mha__plan_round_qk(c, MHA__QK_NORM, team, adt, q, nq, k, nk, err);
    if (!st && c->rope.style != MHA_ROPE_NONE) {
        double *tab = (double *)(ws + l.rope_off);
        const int64_t *kpos =
            args->k_positions ? args->k_positions : (self ? args->q_positions : NULL);
        const int64_t len = mha__plan_rope_length(&c->rope, args->q_positions, kpos, NULL, B, n, m);
        mha__plan_rope(&c->rope, len, tab, q, B, n, h, c->head_dim, args->q_positions, NULL, 1);
        mha__plan_rope(&c->rope, len, tab, k, B, m, g, c->head_dim, kpos, NULL, 1);
        st = mha__plan_round_qk(c, MHA__QK_ROPE, team, adt, q, nq, k, nk, err);
    }
    if (!st)
        mha__plan_qk_norm_stage(c, w, 1, q, B * n, k, B * m);
    if (!st)
        st = mha__plan_round_qk(c, MHA__QK_L2, team, adt, q, nq, k, nk, err);
    if (!st) /* temperature tuning: Q's rows times tau(position) */
        mha__plan_temperature(&c->temperature, q, B, n, h, c->head_dim, args->q_positions, NULL);

    float *gate = c->output_gate ? (float *)(ws + l.g_off) : NULL;
    if (!st && gate) { /* G = round_adt(x W_gate^T + b_gate) */
        const void *wg;
        const float *bg;
        mha__plan_gate_weights(c, w, &wg, &bg);
        st = mha__plan_project(impl, alloc, team, args->query, xdt, wg, wdt, bg, gate, B * n,
                               c->q_dim, h * c->head_dim, pack, l.pack_bytes, err);
        if (!st)
            st = mha__plan_round(team, adt, gate, B * n * h * c->head_dim, err);
    }
    /* Half intermediates: Q and K (after their last stage) and V rounded to adt, into the buffers
     * the core reads. */
    if (!st && half_act)
        st = mha__plan_narrow(team, adt, q, cq, nq, err);
    if (!st && half_act)
        st = mha__plan_narrow(team, adt, k, ck, nk, err);
    if (!st && half_act)
        st = mha__plan_narrow(team, adt, v, cv, B * m * g * c->v_head_dim, err);

    const mha_status core_st = mha__core_finish(&call, !st, err);
    if (!st)
        st = core_st;
    if (!st && gate) /* A = round_adt(A * sigmoid(G)) */
        mha__plan_gate_apply_dt(adt, gate, att, B * n * h * c->v_head_dim);
    /* The output projection into out, or into float32 Y rounded once into a half out. */
    const int half_out = args->out_dtype != MHA_DTYPE_F32;
    float *y = half_out ? (float *)(ws + l.y_off) : args->out;
    if (!st)
        st = mha__plan_project(impl, alloc, team, att, adt, w->w_o, wdt, w->b_o, y, B * n,
                               h * c->v_head_dim, c->out_dim, pack, l.pack_bytes, err);
    if (!st && half_out)
        st = mha__plan_narrow(team, args->out_dtype, y, args->out, B * n * c->out_dim, err);
    mha__free(alloc, owned);
    if (!st)
        mha__ok(err);
    return st;
}

/* ---------------------------------------------------------------------------------------------- */
/* Attention statistics of the layer                                                              */
/* ---------------------------------------------------------------------------------------------- */

mha_status mha_layer_attention_statistics(const mha_layer *layer,
                                          const mha_forward_args *args,
                                          const mha_attention_stats *stats,
                                          const mha_exec *exec,
                                          mha_error *err) {
    int64_t m;
    mha_status st = mha__check_layer_stats_args(layer ? &layer->cfg : NULL,
                                                mha_layer_weights(layer), args, stats, &m, err);
    if (st)
        return st;
    const mha_config *c = &layer->cfg;
    const int64_t B = args->batch, n = args->q_len, h = c->num_heads, g = c->num_kv_heads;
    /* Block: Q [B, n, h*dk] | K [B, m, g*dk] | RoPE table | deltas [B] int64 | slopes [h]. */
    const int64_t fq[4] = {B, n, h, c->head_dim}, fk[4] = {B, m, g, c->head_dim};
    int64_t cq, ck;
    size_t bq, bk;
    MHA_RETURN_IF(!mha__prod_i64(fq, 4, &cq) || !mha__prod_i64(fk, 4, &ck) ||
                      !mha__bytes(cq, sizeof(float), &bq) || !mha__bytes(ck, sizeof(float), &bk) ||
                      bq > SIZE_MAX / 4 || bk > SIZE_MAX / 4,
                  err, OVERFLOW, "Q or K of the statistics overflows");
    const size_t k_off = mha__align64(bq), rope_off = k_off + mha__align64(bk);
    const size_t delta_off =
        rope_off + mha__align64(sizeof(double) * mha__plan_rope_doubles(&c->rope));
    const size_t slope_off = delta_off + mha__align64(sizeof(int64_t) * (size_t)B);
    const mha_allocator *alloc = exec ? exec->allocator : NULL;
    char *ws = mha__alloc(alloc, slope_off + sizeof(float) * (size_t)h);
    MHA_RETURN_IF(!ws, err, NO_MEMORY, "cannot allocate Q and K for the statistics");
    float *q = (float *)ws, *k = (float *)(ws + k_off);
    mha_attention_args core;
    mha__plan_core_args(c, layer->cw.sinks, args, m, q, k, NULL, NULL, NULL, MHA_DTYPE_F32, &core);
    mha__problem p;
    st = mha__check_attention_stats(&core, stats, &p, (int64_t *)(ws + delta_off),
                                    (float *)(ws + slope_off), err);
    mha__team team = {1, NULL};
    if (!st)
        st = mha__exec_team(exec, &team, err);
    const mha_impl impl = exec ? exec->impl : MHA_IMPL_AUTO;
    const int self = args->key == NULL;
    const mha__layer_w *w = &layer->cw;
    if (!st)
        st = mha__plan_project(impl, alloc, team, args->query, args->x_dtype, w->w_q, w->wdt,
                               w->b_q, q, B * n, c->q_dim, h * c->head_dim, NULL, 0, err);
    if (!st)
        st = mha__plan_project(impl, alloc, team, self ? args->query : args->key, args->x_dtype,
                               w->w_k, w->wdt, w->b_k, k, B * m, c->k_dim, g * c->head_dim, NULL, 0,
                               err);
    /* Half intermediates (the forward's): Q and K rounded as the forward rounds them, kept in
     * float32 (the statistics read float32). */
    const mha_dtype adt = mha__plan_act_dtype(args->x_dtype, w->wdt);
    if (!st)
        st = mha__plan_round_qk(c, MHA__QK_PROJ, team, adt, q, cq, k, ck, err);
    if (!st)
        mha__plan_qk_norm_stage(c, w, 0, q, B * n, k, B * m);
    if (!st)
        st = mha__plan_round_qk(c, MHA__QK_NORM, team, adt, q, cq, k, ck, err);
    if (!st && c->rope.style != MHA_ROPE_NONE) {
        double *tab = (double *)(ws + rope_off);
        const int64_t *kpos =
            args->k_positions ? args->k_positions : (self ? args->q_positions : NULL);
        const int64_t len = mha__plan_rope_length(&c->rope, args->q_positions, kpos, NULL, B, n, m);
        mha__plan_rope(&c->rope, len, tab, q, B, n, h, c->head_dim, args->q_positions, NULL, 1);
        mha__plan_rope(&c->rope, len, tab, k, B, m, g, c->head_dim, kpos, NULL, 1);
        st = mha__plan_round_qk(c, MHA__QK_ROPE, team, adt, q, cq, k, ck, err);
    }
    if (!st)
        mha__plan_qk_norm_stage(c, w, 1, q, B * n, k, B * m);
    if (!st)
        st = mha__plan_round_qk(c, MHA__QK_L2, team, adt, q, cq, k, ck, err);
    if (!st) /* temperature tuning: Q's rows times tau(position) */
        mha__plan_temperature(&c->temperature, q, B, n, h, c->head_dim, args->q_positions, NULL);
    if (!st) /* the last stage's rounding (the forward's narrow into the core's buffers) */
        st = mha__plan_round(team, adt, q, cq, err);
    if (!st)
        st = mha__plan_round(team, adt, k, ck, err);
    if (!st)
        st = mha__attention_stats_run(&p, stats, exec, err);
    mha__free(alloc, ws);
    return st;
}
