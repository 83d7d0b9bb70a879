/* SPDX-License-Identifier: MIT */
/* layer_bwd.c: training forward and backward of the layer (docs/TRAINING.md).
 *
 * Forward (as layer.c, keeping what backward needs in an mha_train_state):
 *   Q = RoPE(x_q W_q^T + b_q)  K = RoPE(x_k W_k^T + b_k)  V = x_v W_v^T + b_v
 *   A = core(Q, K, V) (+ lse)   y = A W_o^T + b_o
 * Backward, each line the transpose of the forward line it differentiates:
 *   "y = A W_o^T + b_o":      dA = dy W_o,   dW_o = dy^T A,   db_o = sum_rows dy
 *   "A = core(Q, K, V)":      dQ, dK, dV = mha_attention_backward (attention_bwd.c)
 *   "Q = RoPE(Q')":           dQ' = R(-angle) dQ  (the rotation's transpose; YaRN's cos/sin
 *                             factor is part of R, so it multiplies the transpose too)
 *   "Q' = x_q W_q^T + b_q":   dx_q = dQ' W_q,  dW_q = dQ'^T x_q,  db_q = sum_rows dQ'   (K, V same)
 * impl=reference uses plain loops for the products; fast/auto the packed GEMM of gemm.c (on
 * transposed copies: everything transposed is O((n + m) d) or a weight). Threads never split a
 * sum, so results are bit-identical for any thread count.
 */
#include "check/check.h"
#include "core/core.h"
#include "kernels/attention_bwd.h"
#include "kernels/gemm.h"
#include "kernels/kernels.h"
#include "layer/plan.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct mha_train_state {
    const mha_layer *layer;
    mha_forward_args args; /* by value: the caller's input pointers; out/probs cleared */
    int64_t B, n, m;
    int self;
    float *q, *k, *v, *a, *lse; /* [B,n,h*dk] [B,m,g*dk] [B,m,g*dv] [B,n,h*dv] [B,h,n] */
    float *qx, *kx;             /* QK-norm: the norm's inputs, [B,n,h*dk] [B,m,g*dk] (else NULL) */
    float *g, *ag; /* output gate: G [B,n,h*dk] and A * sigmoid(G) [B,n,h*dv] (else NULL) */
    void *block;
    mha_block_mask *mask; /* the forward's block mask, kept for the backward */
    mha_allocator allocator;
    int has_allocator;
};

void mha_train_state_destroy(mha_train_state *s) {
    if (!s)
        return;
    mha_allocator a = s->allocator;
    const mha_allocator *ap = s->has_allocator ? &a : NULL;
    mha__free(ap, s->block);
    mha_block_mask_destroy(s->mask);
    mha__free(ap, s);
}

/* ---------------------------------------------------------------------------------------------- */
/* Products.                                                                                      */
/* ---------------------------------------------------------------------------------------------- */

/* t[c, r] = x[r, c]: x [rows, cols] of dtype dt -> t [cols, rows] float32 (widened). */
static void transpose(const void *x, mha_dtype dt, float *t, int64_t rows, int64_t cols) {
    const int64_t BS = 32;
    for (int64_t r0 = 0; r0 < rows; r0 += BS)
        for (int64_t c0 = 0; c0 < cols; c0 += BS)
            for (int64_t r = r0; r < rows && r < r0 + BS; r++)
                for (int64_t c = c0; c < cols && c < c0 + BS; c++)
                    t[c * rows + r] = mha__load(dt, x, r * cols + c);
}

/* ---------------------------------------------------------------------------------------------- */
/* RoPE and its transpose.                                                                        */
/* ---------------------------------------------------------------------------------------------- */

/* RoPE (sign = 1) or its transpose (sign = -1, the backward's) over a [B, L, heads, d] buffer
 * (layer/plan.c), with its tables from the call's allocator. */
static mha_status rope_buffer(const mha_rope *r,
                              int64_t length,
                              const mha_allocator *alloc,
                              float *x,
                              int64_t B,
                              int64_t Lk,
                              int64_t heads,
                              int64_t d,
                              const int64_t *pos,
                              int sign,
                              mha_error *err) {
    double *tab = mha__alloc(alloc, sizeof(double) * mha__plan_rope_doubles(r));
    MHA_RETURN_IF(!tab, err, NO_MEMORY, "cannot allocate RoPE tables");
    mha__plan_rope(r, length, tab, x, B, Lk, heads, d, pos, NULL, sign);
    mha__free(alloc, tab);
    return MHA_STATUS_OK;
}

/* The QK-norm's inputs (Q and K as the norm receives them at its stage) copied into the state:
 * the backward differentiates the norm at them. */
static void keep_norm_input(const mha_config *c, mha_train_state *s, int after_rope) {
    if (!mha__plan_qk_norm_at(c, after_rope))
        return;
    const int64_t dk = c->head_dim;
    memcpy(s->qx, s->q, sizeof(float) * (size_t)(s->B * s->n * c->num_heads * dk));
    memcpy(s->kx, s->k, sizeof(float) * (size_t)(s->B * s->m * c->num_kv_heads * dk));
}

/* ---------------------------------------------------------------------------------------------- */
/* Training forward.                                                                              */
/* ---------------------------------------------------------------------------------------------- */

mha_status mha_layer_forward_train(const mha_layer *layer,
                                   const mha_forward_args *args,
                                   const mha_exec *exec,
                                   mha_train_state **state,
                                   mha_error *err) {
    MHA_RETURN_IF(!state, err, INVALID_ARG, "state (the output pointer) is NULL");
    *state = NULL;
    /* The layer's checks here, the core's (sizes, masks, implementation) once below, on the
     * state's buffers, before any projection runs. */
    int64_t m;
    const mha_config *c = layer ? mha_layer_config(layer) : NULL;
    mha_status st = mha__check_forward_args(c, mha_layer_weights(layer), args, &m, err);
    if (!st)
        st = mha__check_layer_trainable(c, "mha_layer_forward_train", err);
    if (st)
        return st;
    const mha__layer_w *w = mha__layer_compute_weights(layer);
    const int self = args->key == NULL;
    const int64_t B = args->batch, n = args->q_len;
    const mha_dtype xdt = args->x_dtype, wdt = w->wdt;
    const int64_t h = c->num_heads, g = c->num_kv_heads, dk = c->head_dim, dv = c->v_head_dim;
    /* The state, then (a half out only) Y [B*n, out_dim] float32 for the output projection,
     * then (QK-norm only) the norm's inputs Q_x [B*n, h*dk] and K_x [B*m, g*dk]. */
    const int half_out = args->out_dtype != MHA_DTYPE_F32;
    const int64_t has_norm = c->qk_norm.kind != MHA_QK_NORM_NONE, gated = c->output_gate;
    const int64_t f[10][3] = {{B * n, h, dk},
                              {B * m, g, dk},
                              {B * m, g, dv},
                              {B * n, h, dv},
                              {B, h, n},
                              {B * n, c->out_dim, half_out},
                              {B * n, h, dk * has_norm},
                              {B * m, g, dk * has_norm},
                              {B * n, h, dk * gated},
                              {B * n, h, dv * gated}};
    const int nparts = 10;
    int64_t cnt[10], total = 0;
    for (int i = 0; i < nparts; i++)
        MHA_RETURN_IF(!mha__prod_i64(f[i], 3, &cnt[i]) || !mha__add_i64(total, cnt[i], &total), err,
                      OVERFLOW, "training state size overflows");
    size_t bytes;
    MHA_RETURN_IF(!mha__bytes(total, sizeof(float), &bytes), err, OVERFLOW,
                  "training state size overflows");
    mha__team team;
    st = mha__exec_team(exec, &team, err);
    if (st)
        return st;
    const mha_allocator *alloc = exec ? exec->allocator : NULL;
    mha_train_state *s = mha__alloc(alloc, sizeof *s);
    MHA_RETURN_IF(!s, err, NO_MEMORY, "cannot allocate the training state");
    memset(s, 0, sizeof *s);
    if (alloc) {
        s->allocator = *alloc;
        s->has_allocator = 1;
    }
    s->block = mha__alloc_large(alloc, bytes);
    if (!s->block) {
        mha_train_state_destroy(s);
        return mha__fail(err, MHA_STATUS_NO_MEMORY, "cannot allocate %zu bytes of training state",
                         bytes);
    }
    s->layer = layer;
    s->args = *args;
    s->args.out = NULL;
    s->args.probs = NULL;
    s->B = B, s->n = n, s->m = m, s->self = self;
    s->q = s->block;
    s->k = s->q + cnt[0];
    s->v = s->k + cnt[1];
    s->a = s->v + cnt[2];
    s->lse = s->a + cnt[3];
    s->qx = has_norm ? s->lse + cnt[4] + cnt[5] : NULL;
    s->kx = has_norm ? s->qx + cnt[6] : NULL;
    s->g = gated ? s->lse + cnt[4] + cnt[5] + cnt[6] + cnt[7] : NULL;
    s->ag = gated ? s->g + cnt[8] : NULL;

    /* Half intermediates (mha__plan_act_dtype): the core reads and writes copies in adt, as the
     * inference forward does (same kernel, same bits); the state keeps their float32 widening. */
    const mha_dtype adt = mha__plan_act_dtype(xdt, wdt);
    const int half_act = adt != MHA_DTYPE_F32;
    uint16_t *hb = NULL;
    if (half_act &&
        !(hb = mha__alloc_large(alloc, 2 * (size_t)(cnt[0] + cnt[1] + cnt[2] + cnt[3])))) {
        mha_train_state_destroy(s);
        return mha__fail(err, MHA_STATUS_NO_MEMORY, "cannot allocate the half Q, K, V, A");
    }
    void *cq = half_act ? (void *)hb : s->q, *ck = half_act ? (void *)(hb + cnt[0]) : s->k;
    void *cv = half_act ? (void *)(hb + cnt[0] + cnt[1]) : s->v;
    void *ca = half_act ? (void *)(hb + cnt[0] + cnt[1] + cnt[2]) : s->a;
    mha_attention_args core;
    mha__plan_core_args(c, w->sinks, args, m, cq, ck, cv, ca, s->lse, adt, &core);
    mha_exec ce = exec ? *exec : (mha_exec){0};
    ce.workspace = NULL;
    ce.workspace_bytes = 0;
    /* The block mask lives in the state: built once here, read again by the backward. */
    mha__core_call call;
    st = mha_block_mask_create(&core, &ce, &s->mask, err);
    if (!st)
        st = mha__core_prepare(&core, &ce, NULL, s->mask, &call, err);
    if (st) {
        mha__free(alloc, hb);
        mha_train_state_destroy(s);
        return st;
    }

    const mha_impl impl = exec ? exec->impl : MHA_IMPL_AUTO;
    const void *xk = self ? args->query : args->key;
    const void *xv = self ? args->query : (args->value ? args->value : args->key);
    st = mha__plan_project(impl, alloc, team, args->query, xdt, w->w_q, wdt, w->b_q, s->q, B * n,
                           c->q_dim, h * dk, NULL, 0, err);
    if (!st)
        st = mha__plan_project(impl, alloc, team, xk, xdt, w->w_k, wdt, w->b_k, s->k, B * m,
                               c->k_dim, g * dk, NULL, 0, err);
    if (!st)
        st = mha__plan_project(impl, alloc, team, xv, xdt, w->w_v, wdt, w->b_v, s->v, B * m,
                               c->v_dim, g * dv, NULL, 0, err);
    /* Q and K through their stages, rounded as the inference forward rounds them (layer.c); the
     * norms' inputs are kept as stored (rounded), as the backward reads them. */
    if (!st)
        st = mha__plan_round_qk(c, MHA__QK_PROJ, team, adt, s->q, cnt[0], s->k, cnt[1], err);
    if (!st)
        keep_norm_input(c, s, 0);
    if (!st)
        mha__plan_qk_norm_stage(c, w, 0, s->q, B * n, s->k, B * m);
    if (!st)
        st = mha__plan_round_qk(c, MHA__QK_NORM, team, adt, s->q, cnt[0], s->k, cnt[1], err);
    if (!st && c->rope.style != MHA_ROPE_NONE) {
        const int64_t *kpos =
            args->k_positions ? args->k_positions : (self ? args->q_positions : NULL);
        const int64_t len = mha__plan_rope_length(&c->rope, args->q_positions, kpos, NULL, B, n, m);
        st = rope_buffer(&c->rope, len, alloc, s->q, B, n, h, dk, args->q_positions, 1, err);
        if (!st)
            st = rope_buffer(&c->rope, len, alloc, s->k, B, m, g, dk, kpos, 1, err);
        if (!st)
            st = mha__plan_round_qk(c, MHA__QK_ROPE, team, adt, s->q, cnt[0], s->k, cnt[1], err);
    }
    if (!st)
        keep_norm_input(c, s, 1);
    if (!st)
        mha__plan_qk_norm_stage(c, w, 1, s->q, B * n, s->k, B * m);
    if (!st)
        st = mha__plan_round_qk(c, MHA__QK_L2, team, adt, s->q, cnt[0], s->k, cnt[1], err);
    if (!st) /* temperature tuning: Q's rows times tau(position) */
        mha__plan_temperature(&c->temperature, s->q, B, n, h, dk, args->q_positions, NULL);
    if (!st && gated) { /* G = round_adt(x W_gate^T + b_gate) (the gate's rows of w_q) */
        const void *wg;
        const float *bg;
        mha__plan_gate_weights(c, w, &wg, &bg);
        st = mha__plan_project(impl, alloc, team, args->query, xdt, wg, wdt, bg, s->g, B * n,
                               c->q_dim, h * dk, NULL, 0, err);
        if (!st)
            st = mha__plan_round(team, adt, s->g, cnt[8], err);
    }
    /* Half intermediates: the state's Q, K, V rounded in place, and copied (exactly) into the
     * half buffers the core reads. */
    float *sv[3] = {s->q, s->k, s->v};
    void *hv[3] = {cq, ck, cv};
    for (int i = 0; half_act && i < 3; i++) {
        if (!st)
            st = mha__plan_round(team, adt, sv[i], cnt[i], err);
        if (!st)
            st = mha__plan_narrow(team, adt, sv[i], hv[i], cnt[i], err);
    }
    const mha_status core_st = mha__core_finish(&call, !st, err);
    if (!st)
        st = core_st;
    if (!st && half_act)
        mha__widen_rows(adt, ca, s->a, cnt[3]);
    /* The gate: A_g = round_adt(A * sigmoid(G)) in float32 (the inference forward's bits); with
     * half intermediates its half copy goes into ca (A itself is kept in s->a), which the output
     * projection reads. */
    if (!st && gated) {
        memcpy(s->ag, s->a, sizeof(float) * (size_t)cnt[9]);
        mha__plan_gate_apply(s->g, s->ag, cnt[9]);
        if (half_act)
            st = mha__plan_round(team, adt, s->ag, cnt[9], err);
        if (!st && half_act)
            st = mha__plan_narrow(team, adt, s->ag, ca, cnt[9], err);
    }
    /* A half out: the float32 projection goes to the block after lse, rounded once into out. */
    float *y = half_out ? s->lse + cnt[4] : args->out;
    const void *ain = gated && !half_act ? (const void *)s->ag : ca;
    if (!st)
        st = mha__plan_project(impl, alloc, team, ain, adt, w->w_o, wdt, w->b_o, y, B * n, h * dv,
                               c->out_dim, NULL, 0, err);
    if (!st && half_out)
        st = mha__plan_narrow(team, args->out_dtype, y, args->out, cnt[5], err);
    mha__free(alloc, hb);
    if (st) {
        mha_train_state_destroy(s);
        return st;
    }
    *state = s;
    mha__ok(err);
    return MHA_STATUS_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* Backward.                                                                                      */
/* ---------------------------------------------------------------------------------------------- */

typedef struct bwd_ctx {
    mha_impl impl;
    const mha_allocator *alloc;
    mha__team team;
    int accumulate;
    float *tmp1, *tmp2; /* transposes (impl=reference), each >= max(rows, weight) elements */
} bwd_ctx;

/* Writes (or adds) src[0..count) into dst; dst NULL = not wanted. */
static void deliver(float *dst, const float *src, int64_t count, int accumulate) {
    if (!dst)
        return;
    for (int64_t i = 0; i < count; i++)
        dst[i] = accumulate ? dst[i] + src[i] : src[i];
}

/* deliver into dst of dtype dt: the float32 value (dst + src when accumulating, dst widened)
 * rounded once to dt. */
static void deliver_dt(void *dst, mha_dtype dt, const float *src, int64_t count, int accumulate) {
    if (!dst || dt == MHA_DTYPE_F32) {
        deliver(dst, src, count, accumulate);
        return;
    }
    for (int64_t i = 0; i < count; i++)
        mha__store(dt, dst, i, accumulate ? mha__load(dt, dst, i) + src[i] : src[i]);
}

/* C[M, N] = A[M, K] B[K, N], B of dtype bdt (a weight: widened in the GEMM's packing, or by
 * the transpose into tmp for the reference's x W^T product). */
static mha_status mm_ab(const bwd_ctx *x,
                        const float *A,
                        const void *Bm,
                        mha_dtype bdt,
                        float *C,
                        int64_t M,
                        int64_t N,
                        int64_t K,
                        float *tmp,
                        mha_error *err) {
    if (x->impl != MHA_IMPL_REFERENCE) /* B read in place as a transposed W */
        return mha__gemm_run_dt(MHA__GEMM_W_T, M, N, K, A, MHA_DTYPE_F32, K, Bm, bdt, N, NULL, C, N,
                                x->team, MHA__GEMM_AUTO, NULL, 0, x->alloc, err);
    transpose(Bm, bdt, tmp, K, N); /* tmp [N, K] */
    return mha__plan_project(x->impl, x->alloc, x->team, A, MHA_DTYPE_F32, tmp, MHA_DTYPE_F32, NULL,
                             C, M, K, N, NULL, 0, err);
}

/* C[M, N] = A[K, M]^T B[K, N], B of dtype bdt (a forward input). */
static mha_status mm_atb(const bwd_ctx *x,
                         const float *A,
                         const void *Bm,
                         mha_dtype bdt,
                         float *C,
                         int64_t M,
                         int64_t N,
                         int64_t K,
                         mha_error *err) {
    if (x->impl != MHA_IMPL_REFERENCE) /* both read in place */
        return mha__gemm_run_dt((mha__gemm_op)(MHA__GEMM_X_T | MHA__GEMM_W_T), M, N, K, A,
                                MHA_DTYPE_F32, M, Bm, bdt, N, NULL, C, N, x->team, MHA__GEMM_AUTO,
                                NULL, 0, x->alloc, err);
    transpose(A, MHA_DTYPE_F32, x->tmp1, K, M); /* [M, K] */
    transpose(Bm, bdt, x->tmp2, K, N);          /* [N, K] */
    return mha__plan_project(x->impl, x->alloc, x->team, x->tmp1, MHA_DTYPE_F32, x->tmp2,
                             MHA_DTYPE_F32, NULL, C, M, K, N, NULL, 0, err);
}

static void col_sums(const float *x, int64_t rows, int64_t cols, float *out) {
    for (int64_t c = 0; c < cols; c++)
        out[c] = 0.0f;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            out[c] += x[r * cols + c];
}

/* One projection "P = x W^T + b" given dP [rows, out]: dW, db delivered, dx written to dx_out
 * (a scratch buffer [rows, in]) when dx_out != NULL. wbuf: scratch >= out*in and >= in. */
static mha_status proj_backward(const bwd_ctx *x,
                                const float *dP,
                                const void *xin,
                                mha_dtype xdt,
                                const void *W,
                                mha_dtype wdt,
                                int64_t rows,
                                int64_t in,
                                int64_t out,
                                float *dW,
                                float *db,
                                float *dx_out,
                                float *wbuf,
                                mha_error *err) {
    mha_status st = MHA_STATUS_OK;
    if (dW) {
        st = mm_atb(x, dP, xin, xdt, wbuf, out, in, rows, err);
        if (st)
            return st;
        deliver(dW, wbuf, out * in, x->accumulate);
    }
    if (db) {
        col_sums(dP, rows, out, wbuf);
        deliver(db, wbuf, out, x->accumulate);
    }
    if (dx_out)
        st = mm_ab(x, dP, W, wdt, dx_out, rows, in, out, x->tmp1, err);
    return st;
}

/* The backward's scratch, one allocation (floats): dA [rq, h dv]; dQ [rq, h dk]; dK [rk, g dk];
 * dV [rk, g dv]; the input gradients of the q, k and v paths [rq, qd], [rk, kd], [rk, vd]; two
 * transpose buffers (the reference products only: the packed GEMM reads transposed operands in
 * place); one weight-sized buffer; dy widened [rq, od] (a half dy only: the products and column
 * sums that read dy then read float32). Each part is followed by 16 floats of slack. */
enum { SCRATCH_PARTS = 13 };
typedef struct bwd_scratch {
    int64_t sizes[SCRATCH_PARTS];
    size_t bytes;
    float *buf;
    float *dA, *dQ, *dK, *dV, *dxq, *dxk, *dxv, *tmp1, *tmp2, *wbuf, *dy32;
    float *dG, *dxg; /* output gate: dL/dG [rq, h dk] and the gate path's dx [rq, qd] */
} bwd_scratch;

/* The parts' sizes and the total bytes (OVERFLOW when they do not fit). */
static mha_status scratch_size(
    const mha_config *c, const mha_train_state *s, mha_impl impl, bwd_scratch *sc, mha_error *err) {
    const int64_t h = c->num_heads, g = c->num_kv_heads, dk = c->head_dim, dv = c->v_head_dim;
    const int64_t od = c->out_dim, qd = c->q_dim, kd = c->k_dim, vd = c->v_dim;
    const int64_t rq = s->B * s->n, rk = s->B * s->m;
    const int64_t wmax_parts[] = {h * dk * qd, g * dk * kd, g * dv * vd, od * h * dv};
    int64_t wmax = od;
    for (int i = 0; i < 4; i++)
        wmax = wmax_parts[i] > wmax ? wmax_parts[i] : wmax;
    int64_t tmax = wmax;
    const int64_t act[] = {rq * od,     rq * h * dv, rq * h * dk, rk * g * dk,
                           rk * g * dv, rq * qd,     rk * kd,     rk * vd};
    for (int i = 0; i < 8; i++)
        tmax = act[i] > tmax ? act[i] : tmax;
    const int64_t tsz = impl == MHA_IMPL_REFERENCE ? tmax : 0;
    const int64_t dysz = s->args.out_dtype != MHA_DTYPE_F32 ? rq * od : 0;
    const int64_t gsz = c->output_gate ? rq * h * dk : 0, gxsz = c->output_gate ? rq * qd : 0;
    const int64_t sizes[SCRATCH_PARTS] = {
        rq * h * dv, rq * h * dk, rk * g * dk, rk * g * dv, rq * qd, rk * kd, rk * vd,
        tsz,         tsz,         wmax,        dysz,        gsz,     gxsz};
    int64_t total = 0;
    for (int i = 0; i < SCRATCH_PARTS; i++) {
        sc->sizes[i] = sizes[i];
        MHA_RETURN_IF(!mha__add_i64(total, sizes[i] + 16, &total), err, OVERFLOW,
                      "backward scratch overflows");
    }
    MHA_RETURN_IF(!mha__bytes(total, sizeof(float), &sc->bytes), err, OVERFLOW,
                  "backward scratch overflows");
    return MHA_STATUS_OK;
}

/* Allocates the scratch sized by scratch_size and points its parts into it. */
static mha_status scratch_alloc(const mha_allocator *alloc, bwd_scratch *sc, mha_error *err) {
    sc->buf = mha__alloc_large(alloc, sc->bytes);
    MHA_RETURN_IF(!sc->buf, err, NO_MEMORY, "cannot allocate %zu bytes of backward scratch",
                  sc->bytes);
    float **parts[SCRATCH_PARTS] = {&sc->dA,   &sc->dQ,  &sc->dK,   &sc->dV,   &sc->dxq,
                                    &sc->dxk,  &sc->dxv, &sc->tmp1, &sc->tmp2, &sc->wbuf,
                                    &sc->dy32, &sc->dG,  &sc->dxg};
    float *cur = sc->buf;
    for (int i = 0; i < SCRATCH_PARTS; i++) {
        *parts[i] = cur;
        cur += sc->sizes[i] + 16;
    }
    return MHA_STATUS_OK;
}

/* "y = A W_o^T + b_o": dA = dy W_o, then the core backward of dA into dQ, dK, dV and, when the
 * caller wants it, the sinks' gradient into a small private buffer (*dsinks, freed by the caller).
 * The core validates first (masks, dropout, lse): on its error no gradient buffer is touched. */
static mha_status core_backward(const mha_config *c,
                                const mha__layer_w *w,
                                const mha_train_state *s,
                                const float *dy,
                                const mha_layer_grads *gr,
                                const mha_exec *exec,
                                const bwd_ctx *x,
                                const bwd_scratch *sc,
                                float **dsinks,
                                mha_error *err) {
    const int64_t h = c->num_heads, dv = c->v_head_dim;
    mha_attention_args core;
    /* The saved Q, K, V, A are float32 (holding the rounded values of half intermediates): the
     * float32 core backward differentiates through the roundings as the identity. */
    mha__plan_core_args(c, w->sinks, &s->args, s->m, s->q, s->k, s->v, s->a, s->lse, MHA_DTYPE_F32,
                        &core);
    core.probs = NULL;
    mha_status st =
        mm_ab(x, dy, w->w_o, w->wdt, sc->dA, s->B * s->n, h * dv, c->out_dim, x->tmp1, err);
    if (st)
        return st;
    if (c->output_gate) /* "A_g = A * sigmoid(G)": dG = dA_g A s (1 - s), dA = dA_g s */
        for (int64_t i = 0; i < s->B * s->n * h * dv; i++) {
            const float sg = 1.0f / (1.0f + expf(-s->g[i]));
            sc->dG[i] = sc->dA[i] * s->a[i] * (sg * (1.0f - sg));
            sc->dA[i] *= sg;
        }
    mha_attention_grads cg;
    memset(&cg, 0, sizeof cg);
    cg.dout = sc->dA;
    memcpy(cg.dout_strides, core.out_strides, sizeof cg.dout_strides);
    cg.dq = sc->dQ;
    memcpy(cg.dq_strides, core.q_strides, sizeof cg.dq_strides);
    cg.dk = sc->dK;
    memcpy(cg.dk_strides, core.k_strides, sizeof cg.dk_strides);
    cg.dv = sc->dV;
    memcpy(cg.dv_strides, core.v_strides, sizeof cg.dv_strides);
    cg.dprobs = gr->d_probs; /* (core.average_probs is the forward's: mha__plan_core_args) */
    mha_exec ce = exec ? *exec : (mha_exec){0};
    ce.workspace = NULL;
    ce.workspace_bytes = 0;
    if (gr->d_sinks) {
        *dsinks = malloc(sizeof(float) * (size_t)h);
        if (!*dsinks)
            return mha__fail(err, MHA_STATUS_NO_MEMORY, "cannot allocate %lld floats",
                             (long long)h);
        cg.dsinks = *dsinks;
    }
    return mha_attention_backward_masked(&core, &cg, s->mask, &ce, err);
}

/* The output projection's gradients (dW_o = dy^T A, db_o = column sums of dy) and the sinks'. */
static mha_status out_grads(const mha_train_state *s,
                            const mha_config *c,
                            const float *dy,
                            const mha_layer_grads *gr,
                            const bwd_ctx *x,
                            const float *dsinks,
                            float *wbuf,
                            mha_error *err) {
    const int64_t rq = s->B * s->n, od = c->out_dim, hdv = c->num_heads * c->v_head_dim;
    if (gr->dw_o) {
        const float *a_in = c->output_gate ? s->ag : s->a; /* the output projection's input */
        const mha_status st = mm_atb(x, dy, a_in, MHA_DTYPE_F32, wbuf, od, hdv, rq, err);
        if (st)
            return st;
        deliver(gr->dw_o, wbuf, od * hdv, x->accumulate);
    }
    if (gr->db_o) {
        col_sums(dy, rq, od, wbuf);
        deliver(gr->db_o, wbuf, od, x->accumulate);
    }
    if (gr->d_sinks)
        deliver(gr->d_sinks, dsinks, c->num_heads, x->accumulate);
    return MHA_STATUS_OK;
}

/* "Q = norm(Q_x)", "K = norm(K_x)" at one stage of the plan (mha__plan_qk_norm_stage): dQ and dK
 * (scratch) become the gradients of the norm's inputs; the weights' gradients are summed in
 * double and delivered into grads.d_q_norm / d_k_norm. */
static mha_status norm_backward(const mha_config *c,
                                const mha__layer_w *w,
                                const mha_train_state *s,
                                const mha_layer_grads *gr,
                                const bwd_ctx *x,
                                const bwd_scratch *sc,
                                int after_rope,
                                mha_error *err) {
    if (!mha__plan_qk_norm_at(c, after_rope))
        return MHA_STATUS_OK;
    const mha_qk_norm *nrm = &c->qk_norm;
    const int64_t h = c->num_heads, g = c->num_kv_heads, dk = c->head_dim;
    const int64_t nq = nrm->kind == MHA_QK_NORM_RMS_ALL ? h * dk : dk;
    const int64_t nk = nrm->kind == MHA_QK_NORM_RMS_ALL ? g * dk : dk;
    double *acc = NULL;
    if (gr->d_q_norm || gr->d_k_norm) {
        acc = mha__alloc(x->alloc, sizeof(double) * (size_t)(nq + nk));
        MHA_RETURN_IF(!acc, err, NO_MEMORY, "cannot allocate %lld doubles", (long long)(nq + nk));
        memset(acc, 0, sizeof(double) * (size_t)(nq + nk));
    }
    mha__plan_qk_norm_backward(nrm, w->q_norm, s->qx, sc->dQ, gr->d_q_norm ? acc : NULL,
                               s->B * s->n, h, dk);
    mha__plan_qk_norm_backward(nrm, w->k_norm, s->kx, sc->dK, gr->d_k_norm ? acc + nq : NULL,
                               s->B * s->m, g, dk);
    for (int64_t j = 0; gr->d_q_norm && j < nq; j++)
        gr->d_q_norm[j] = x->accumulate ? gr->d_q_norm[j] + (float)acc[j] : (float)acc[j];
    for (int64_t j = 0; gr->d_k_norm && j < nk; j++)
        gr->d_k_norm[j] = x->accumulate ? gr->d_k_norm[j] + (float)acc[nq + j] : (float)acc[nq + j];
    mha__free(x->alloc, acc);
    return MHA_STATUS_OK;
}

/* The input gradients, each path's dx computed by proj_backward: one input that fed all three
 * projections gets their sum in the order q, k, v; a key that also served as the value gets
 * k + v; otherwise each input its own. */
static void deliver_inputs(const mha_train_state *s,
                           const mha_config *c,
                           const mha_layer_grads *gr,
                           const bwd_ctx *x,
                           const bwd_scratch *sc) {
    const int64_t rq = s->B * s->n, rk = s->B * s->m;
    const int64_t qd = c->q_dim, kd = c->k_dim, vd = c->v_dim;
    const mha_dtype dt = s->args.x_dtype; /* the gradients have their inputs' dtype */
    if (s->self) {
        if (gr->d_query) {
            for (int64_t i = 0; i < rq * qd; i++)
                sc->dxq[i] = (sc->dxq[i] + sc->dxk[i]) + sc->dxv[i];
            deliver_dt(gr->d_query, dt, sc->dxq, rq * qd, x->accumulate);
        }
        return;
    }
    deliver_dt(gr->d_query, dt, sc->dxq, rq * qd, x->accumulate);
    if (!s->args.value) {
        if (gr->d_key) {
            for (int64_t i = 0; i < rk * kd; i++)
                sc->dxk[i] += sc->dxv[i];
            deliver_dt(gr->d_key, dt, sc->dxk, rk * kd, x->accumulate);
        }
    } else {
        deliver_dt(gr->d_key, dt, sc->dxk, rk * kd, x->accumulate);
        deliver_dt(gr->d_value, dt, sc->dxv, rk * vd, x->accumulate);
    }
}

mha_status mha_layer_backward(const mha_layer *layer,
                              const mha_train_state *s,
                              const void *dy_in,
                              const mha_layer_grads *gr,
                              const mha_exec *exec,
                              mha_error *err) {
    const mha_config *c = layer ? mha_layer_config(layer) : NULL;
    const mha__train_view view = {
        s ? s->layer : NULL, s ? s->self : 0, s ? s->args.value != NULL : 0,
        s ? &s->args : NULL, s ? s->B : 0,    s ? s->n : 0,
        s ? s->m : 0};
    mha_status st = mha__check_layer_backward(layer, c, mha_layer_weights(layer), s ? &view : NULL,
                                              dy_in, gr, err);
    if (st)
        return st;
    const mha_forward_args *a = &s->args;
    const int64_t B = s->B, n = s->n, m = s->m, h = c->num_heads, g = c->num_kv_heads;
    const int64_t dk = c->head_dim, dv = c->v_head_dim;
    const int64_t rq = B * n, rk = B * m;
    const mha_impl impl = exec ? exec->impl : MHA_IMPL_AUTO;
    bwd_scratch sc;
    memset(&sc, 0, sizeof sc);
    st = scratch_size(c, s, impl, &sc, err);
    mha__team team;
    if (!st)
        st = mha__exec_team(exec, &team, err);
    const mha_allocator *alloc = exec ? exec->allocator : NULL;
    if (!st)
        st = scratch_alloc(alloc, &sc, err);
    if (st)
        return st;
    const bwd_ctx x = {impl, alloc, team, gr->accumulate != 0, sc.tmp1, sc.tmp2};
    const mha__layer_w *w = mha__layer_compute_weights(layer);
    const mha_dtype xdt = a->x_dtype;
    /* A half dy is widened once: every product and sum below reads float32 dy. */
    const float *dy = dy_in;
    if (a->out_dtype != MHA_DTYPE_F32) {
        mha__widen(a->out_dtype, dy_in, sc.dy32, rq * c->out_dim);
        dy = sc.dy32;
    }

    float *dsinks = NULL;
    st = core_backward(c, w, s, dy, gr, exec, &x, &sc, &dsinks, err);
    /* From here on nothing can fail but allocation inside the GEMM. */
    if (!st)
        st = out_grads(s, c, dy, gr, &x, dsinks, sc.wbuf, err);
    /* "Q = tau(p) Q'": dQ' = tau(p) dQ, a constant per row (before or after RoPE's transpose:
     * a scalar per row commutes with the rotation). */
    if (!st)
        mha__plan_temperature(&c->temperature, sc.dQ, B, n, h, dk, a->q_positions, NULL);
    /* "Q = norm(Q')" after RoPE (L2_AFTER_ROPE), "Q = RoPE(Q')": the transposed rotation, then
     * "Q = norm(Q')" before RoPE (the RMS kinds). */
    if (!st)
        st = norm_backward(c, w, s, gr, &x, &sc, 1, err);
    if (!st && c->rope.style != MHA_ROPE_NONE) {
        const int64_t *kpos = a->k_positions ? a->k_positions : (s->self ? a->q_positions : NULL);
        const int64_t len = mha__plan_rope_length(&c->rope, a->q_positions, kpos, NULL, B, n, m);
        st = rope_buffer(&c->rope, len, x.alloc, sc.dQ, B, n, h, dk, a->q_positions, -1, err);
        if (!st)
            st = rope_buffer(&c->rope, len, x.alloc, sc.dK, B, m, g, dk, kpos, -1, err);
    }
    if (!st)
        st = norm_backward(c, w, s, gr, &x, &sc, 0, err);
    const void *xq = a->query;
    const void *xk = s->self ? a->query : a->key;
    const void *xv = s->self ? a->query : (a->value ? a->value : a->key);
    const int want_q = gr->d_query != NULL;
    const int want_k = s->self ? want_q : gr->d_key != NULL;
    const int want_v = s->self ? want_q : (a->value ? gr->d_value != NULL : gr->d_key != NULL);
    if (!st)
        st = proj_backward(&x, sc.dQ, xq, xdt, w->w_q, w->wdt, rq, c->q_dim, h * dk, gr->dw_q,
                           gr->db_q, want_q ? sc.dxq : NULL, sc.wbuf, err);
    if (!st)
        st = proj_backward(&x, sc.dK, xk, xdt, w->w_k, w->wdt, rk, c->k_dim, g * dk, gr->dw_k,
                           gr->db_k, want_k ? sc.dxk : NULL, sc.wbuf, err);
    if (!st)
        st = proj_backward(&x, sc.dV, xv, xdt, w->w_v, w->wdt, rk, c->v_dim, g * dv, gr->dw_v,
                           gr->db_v, want_v ? sc.dxv : NULL, sc.wbuf, err);
    if (!st && c->output_gate) { /* "G = x_q W_gate^T + b_gate": the gate's rows of w_q, b_q */
        const void *wg;
        const float *bg;
        mha__plan_gate_weights(c, w, &wg, &bg);
        const int64_t off = h * dk;
        st = proj_backward(&x, sc.dG, xq, xdt, wg, w->wdt, rq, c->q_dim, h * dk,
                           gr->dw_q ? gr->dw_q + off * c->q_dim : NULL,
                           gr->db_q ? gr->db_q + off : NULL, want_q ? sc.dxg : NULL, sc.wbuf, err);
        for (int64_t i = 0; !st && want_q && i < rq * c->q_dim; i++)
            sc.dxq[i] += sc.dxg[i];
    }
    if (!st)
        deliver_inputs(s, c, gr, &x, &sc);
    free(dsinks);
    mha__free(alloc, sc.buf);
    if (!st)
        mha__ok(err);
    return st;
}
