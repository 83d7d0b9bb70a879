/* SPDX-License-Identifier: MIT */
/* mla_bwd.c: the backward of multi-head latent attention's expanded form (mha_mla_backward).
 * The forward is recomputed (its projections, norms, RoPE, expansion and the core with its lse),
 * then, with T tokens and row vectors (docs/SEMANTICS.md "Multi-head latent attention"):
 *   dO = dy W_o, dW_o = dy^T O, db_o = sum dy
 *   dQ, dK, dV = mha_attention_backward(dO)
 *   dkvb_h = [dK_h[:dn], dV_h]; dk_pe = sum_h dK_h[dn:]          (k_pe is shared by the heads)
 *   dW_kvb = dkvb^T c, dc = dkvb W_kvb
 *   RoPE^T: dq_pe, dk_pe rotated by -angle (the rotation is orthogonal up to its factor)
 *   RMSNorm(z; w) = w z inv, inv = (mean(z^2) + eps)^-1/2, n = z inv:
 *     dw = sum_t dy n,  dz = inv (g - n mean(g n)), g = w dy
 *   da = [dz_c, dk_pe]: dW_kva = da^T x, db_kva = sum da, dx = da W_kva
 *   q: dW_q = dq^T x, dx += dq W_q; or dW_qb = dq^T qn, dqn = dq W_qb, RMSNorm^T, dW_qa, db_qa,
 *      dx += dqa W_qa. */
#include "layer/mla.h"

#include "check/check.h"
#include "kernels/gemm.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* y [M, N] = x [M, K] W [K, N] (W stored row-major [K, N], row stride ldw). */
static mha_status gemm_nn(int64_t M,
                          int64_t N,
                          int64_t K,
                          const float *x,
                          int64_t ldx,
                          const float *w,
                          int64_t ldw,
                          float *y,
                          int64_t ldy,
                          mha__team team,
                          mha_error *err) {
    return mha__gemm_op_run(MHA__GEMM_W_T, M, N, K, x, ldx, w, ldw, y, ldy, team, MHA__GEMM_AUTO,
                            NULL, err);
}

/* y [M, N] = x^T W with x stored [K, M] (ldx), W stored [K, N] (ldw): a weight's gradient. */
static mha_status gemm_tn(int64_t M,
                          int64_t N,
                          int64_t K,
                          const float *x,
                          int64_t ldx,
                          const float *w,
                          int64_t ldw,
                          float *y,
                          int64_t ldy,
                          mha__team team,
                          mha_error *err) {
    return mha__gemm_op_run(MHA__GEMM_X_T | MHA__GEMM_W_T, M, N, K, x, ldx, w, ldw, y, ldy, team,
                            MHA__GEMM_AUTO, NULL, err);
}

/* b[j] = sum_t d[t, j] (t < T, row stride ld), summed in double in order. */
static void col_sums(const float *d, int64_t T, int64_t n, int64_t ld, float *b) {
    for (int64_t j = 0; j < n; j++) {
        double s = 0.0;
        for (int64_t t = 0; t < T; t++)
            s += (double)d[t * ld + j];
        b[j] = (float)s;
    }
}

/* RMSNorm's backward, T rows of d values: z the pre-norm rows (row stride ldz), dz the output
 * gradient in (row stride ld), the input gradient out (in place); dw [d] = sum_t dy n. */
static void rms_norm_bwd(const float *z,
                         int64_t ldz,
                         float *dz,
                         int64_t T,
                         int64_t d,
                         int64_t ld,
                         const float *w,
                         double eps,
                         float *dw) {
    double *acc = calloc((size_t)d, sizeof(double));
    for (int64_t t = 0; t < T; t++) {
        const float *zr = z + t * ldz;
        float *g = dz + t * ld;
        double ss = 0.0, gn = 0.0;
        for (int64_t i = 0; i < d; i++)
            ss += (double)zr[i] * (double)zr[i];
        const double inv = 1.0 / sqrt(ss / (double)d + eps);
        for (int64_t i = 0; i < d; i++) {
            const double n = (double)zr[i] * inv;
            if (acc)
                acc[i] += (double)g[i] * n;
            gn += (double)w[i] * (double)g[i] * n;
        }
        gn /= (double)d;
        for (int64_t i = 0; i < d; i++)
            g[i] = (float)(inv * ((double)w[i] * (double)g[i] - (double)zr[i] * inv * gn));
    }
    for (int64_t i = 0; i < d; i++)
        dw[i] = acc ? (float)acc[i] : 0.0f;
    free(acc);
}

/* Every buffer of the backward, floats per token (T rows each). */
enum {
    B_Q,
    B_KV,
    B_QN,
    B_QZ,
    B_KZ,
    B_KVB,
    B_K,
    B_O,
    B_DO,
    B_DQ,
    B_DK,
    B_DV,
    B_DKVB,
    B_DA,
    B_DQN,
    B_DX,
    B_N
};

typedef struct bwd_ctx {
    const struct mha_mla *m;
    const mha_mla_forward_args *a;
    const mha_mla_grads *g;
    const mha_exec *exec;
    mha__team team;
    int64_t T;
    float *b[B_N];
    float *lse; /* [B, h, n] */
    float *wg;  /* scratch for the weight gradients not asked for (the largest one) */
} bwd_ctx;

/* The forward, keeping what the backward reads. */
static mha_status recompute(bwd_ctx *x, mha_attention_args *ca, mha_error *err) {
    const struct mha_mla *m = x->m;
    const mha_mla_config *c = &m->cfg;
    const int64_t T = x->T, E = c->hidden, h = c->num_heads, rq = c->q_lora_rank;
    const int64_t r = c->kv_lora_rank, dr = c->qk_rope_head_dim, dn = c->qk_nope_head_dim;
    const int64_t dnv = dn + c->v_head_dim;
    mha__mla_rows rows = {x->b[B_Q], x->b[B_KV]};
    MHA_TRY(mha__mla_project(m, x->a->batch, x->a->seq_len, x->a->x, x->a->positions, NULL, rows,
                             x->b[B_QN], x->team, err));
    if (rq)
        MHA_TRY(mha__gemm_xwt(T, rq, E, x->a->x, E, m->w.w_q_a, E, m->w.b_q_a, x->b[B_QZ], rq,
                              x->team, MHA__GEMM_AUTO, NULL, err));
    MHA_TRY(mha__gemm_xwt(T, r, E, x->a->x, E, m->w.w_kv_a, E, m->w.b_kv_a ? m->w.b_kv_a : NULL,
                          x->b[B_KZ], r, x->team, MHA__GEMM_AUTO, NULL, err));
    MHA_TRY(mha__gemm_xwt(T, h * dnv, r, rows.kv, r + dr, m->w.w_kv_b, r, NULL, x->b[B_KVB],
                          h * dnv, x->team, MHA__GEMM_AUTO, NULL, err));
    mha__mla_expand_keys(c, T, x->b[B_KVB], rows.kv, x->b[B_K]);
    mha__mla_core_args(m, x->a, rows.q, x->b[B_K], x->b[B_KVB], x->b[B_O], ca);
    ca->lse = x->lse;
    return mha_attention(ca, x->exec, err);
}

/* A weight gradient's destination: the caller's buffer, or scratch. */
static float *dst(const bwd_ctx *x, float *want) {
    return want ? want : x->wg;
}

/* dy -> dO, dW_o, db_o; the core's backward -> dQ, dK, dV. */
static mha_status bwd_out_core(bwd_ctx *x, const mha_attention_args *ca, mha_error *err) {
    const mha_mla_config *c = &x->m->cfg;
    const int64_t T = x->T, E = c->hidden, h = c->num_heads, dv = c->v_head_dim, L = x->a->seq_len;
    const int64_t dq = c->qk_nope_head_dim + c->qk_rope_head_dim;
    const float *dy = x->g->dy;
    if (x->g->w_o)
        MHA_TRY(gemm_tn(E, h * dv, T, dy, E, x->b[B_O], h * dv, x->g->w_o, h * dv, x->team, err));
    if (x->g->b_o)
        col_sums(dy, T, E, E, x->g->b_o);
    MHA_TRY(gemm_nn(T, h * dv, E, dy, E, x->m->w.w_o, h * dv, x->b[B_DO], h * dv, x->team, err));
    mha_attention_grads gr;
    memset(&gr, 0, sizeof gr);
    const int64_t os[3] = {L * h * dv, dv, h * dv}, qs[3] = {L * h * dq, dq, h * dq};
    gr.dout = x->b[B_DO];
    gr.dq = x->b[B_DQ];
    gr.dk = x->b[B_DK];
    gr.dv = x->b[B_DV];
    memcpy(gr.dout_strides, os, sizeof os);
    memcpy(gr.dv_strides, os, sizeof os);
    memcpy(gr.dq_strides, qs, sizeof qs);
    memcpy(gr.dk_strides, qs, sizeof qs);
    return mha_attention_backward(ca, &gr, x->exec, err);
}

/* dK, dV -> dkvb, dW_kvb, dc and dk_pe (in da = [dc, dk_pe]), RoPE^T on dk_pe and dq_pe. */
static mha_status bwd_kv(bwd_ctx *x, mha_error *err) {
    const mha_mla_config *c = &x->m->cfg;
    const int64_t T = x->T, h = c->num_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim;
    const int64_t dv = c->v_head_dim, dq = dn + dr, dnv = dn + dv, r = c->kv_lora_rank;
    float *dkvb = x->b[B_DKVB], *da = x->b[B_DA];
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < dr; i++)
            da[t * (r + dr) + r + i] = 0.0f;
        for (int64_t hh = 0; hh < h; hh++) {
            const float *dk = x->b[B_DK] + (t * h + hh) * dq;
            memcpy(dkvb + (t * h + hh) * dnv, dk, (size_t)dn * sizeof(float));
            memcpy(dkvb + (t * h + hh) * dnv + dn, x->b[B_DV] + (t * h + hh) * dv,
                   (size_t)dv * sizeof(float));
            for (int64_t i = 0; i < dr; i++)
                da[t * (r + dr) + r + i] += dk[dn + i];
        }
    }
    if (x->g->w_kv_b)
        MHA_TRY(gemm_tn(h * dnv, r, T, dkvb, h * dnv, x->b[B_KV], r + dr, x->g->w_kv_b, r, x->team,
                        err));
    MHA_TRY(gemm_nn(T, r, h * dnv, dkvb, h * dnv, x->m->w.w_kv_b, r, da, r + dr, x->team, err));
    mha__mla_rows rows = {x->b[B_DQ], da};
    return mha__mla_rotate(x->m, x->a->batch, x->a->seq_len, x->a->positions, NULL, rows, 1, err);
}

/* dx += d [T, n] W [n, E]. */
static mha_status add_dx(bwd_ctx *x, const float *d, int64_t n, const float *w, mha_error *err) {
    const int64_t T = x->T, E = x->m->cfg.hidden;
    float *tmp = x->b[B_DX];
    MHA_TRY(gemm_nn(T, E, n, d, n, w, E, tmp, E, x->team, err));
    if (x->g->dx)
        for (int64_t i = 0; i < T * E; i++)
            x->g->dx[i] += tmp[i];
    return MHA_STATUS_OK;
}

/* da -> kv_a_norm, W_kva, b_kva, dx; dq -> the q chain's gradients, dx. */
static mha_status bwd_inputs(bwd_ctx *x, mha_error *err) {
    const struct mha_mla *m = x->m;
    const mha_mla_config *c = &m->cfg;
    const int64_t T = x->T, E = c->hidden, h = c->num_heads, rq = c->q_lora_rank;
    const int64_t r = c->kv_lora_rank, dr = c->qk_rope_head_dim;
    const int64_t dq = c->qk_nope_head_dim + dr;
    const float *xin = x->a->x;
    float *da = x->b[B_DA], *dqb = x->b[B_DQ];
    rms_norm_bwd(x->b[B_KZ], r, da, T, r, r + dr, m->w.kv_a_norm, c->rms_eps,
                 dst(x, x->g->kv_a_norm));
    if (x->g->w_kv_a)
        MHA_TRY(gemm_tn(r + dr, E, T, da, r + dr, xin, E, x->g->w_kv_a, E, x->team, err));
    if (x->g->b_kv_a)
        col_sums(da, T, r + dr, r + dr, x->g->b_kv_a);
    if (x->g->dx)
        memset(x->g->dx, 0, sizeof(float) * (size_t)(T * E));
    MHA_TRY(add_dx(x, da, r + dr, m->w.w_kv_a, err));
    if (rq == 0) {
        if (x->g->w_q)
            MHA_TRY(gemm_tn(h * dq, E, T, dqb, h * dq, xin, E, x->g->w_q, E, x->team, err));
        return add_dx(x, dqb, h * dq, m->w.w_q, err);
    }
    float *dqn = x->b[B_DQN];
    if (x->g->w_q_b)
        MHA_TRY(gemm_tn(h * dq, rq, T, dqb, h * dq, x->b[B_QN], rq, x->g->w_q_b, rq, x->team, err));
    MHA_TRY(gemm_nn(T, rq, h * dq, dqb, h * dq, m->w.w_q_b, rq, dqn, rq, x->team, err));
    rms_norm_bwd(x->b[B_QZ], rq, dqn, T, rq, rq, m->w.q_a_norm, c->rms_eps, dst(x, x->g->q_a_norm));
    if (x->g->w_q_a)
        MHA_TRY(gemm_tn(rq, E, T, dqn, rq, xin, E, x->g->w_q_a, E, x->team, err));
    if (x->g->b_q_a)
        col_sums(dqn, T, rq, rq, x->g->b_q_a);
    return add_dx(x, dqn, rq, m->w.w_q_a, err);
}

static mha_status run(bwd_ctx *x, mha_error *err) {
    mha_attention_args ca;
    MHA_TRY(recompute(x, &ca, err));
    MHA_TRY(bwd_out_core(x, &ca, err));
    MHA_TRY(bwd_kv(x, err));
    return bwd_inputs(x, err);
}

mha_status mha_mla_backward(const mha_mla *m,
                            const mha_mla_forward_args *a,
                            const mha_mla_grads *g,
                            const mha_exec *exec,
                            mha_error *err) {
    MHA_RETURN_IF(!m || !a, err, INVALID_ARG, "mha_mla_backward: mla or args is NULL");
    MHA_TRY(mha__check_mla_backward(&m->cfg, &m->w, a, g, err));
    const mha_mla_config *c = &m->cfg;
    const int64_t T = a->batch * a->seq_len, h = c->num_heads, E = c->hidden;
    const int64_t dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dv = c->v_head_dim;
    const int64_t r = c->kv_lora_rank, rq = c->q_lora_rank, dq = dn + dr;
    const int64_t per[B_N] = {h * dq,        r + dr, rq,     rq,     r,      h * (dn + dv),
                              h * dq,        h * dv, h * dv, h * dq, h * dq, h * dv,
                              h * (dn + dv), r + dr, rq,     E};
    const int64_t wmax = (E > rq ? E : rq) > r ? (E > rq ? E : rq) : r;
    int64_t total = h * T + wmax;
    for (int i = 0; i < B_N; i++)
        total += per[i] * T; /* sizes checked at creation and by the forward's check */
    size_t bytes;
    MHA_RETURN_IF(!mha__bytes(total, sizeof(float), &bytes), err, OVERFLOW,
                  "mha_mla_backward: scratch of %lld floats", (long long)total);
    const mha_allocator *al = exec ? exec->allocator : NULL;
    float *buf = mha__alloc_large(al, bytes);
    MHA_RETURN_IF(!buf, err, NO_MEMORY, "mha_mla_backward: cannot allocate %zu bytes", bytes);
    bwd_ctx x = {m, a, g, exec, {0, NULL}, T, {0}, NULL, NULL};
    float *p = buf;
    for (int i = 0; i < B_N; i++) {
        x.b[i] = p;
        p += per[i] * T;
    }
    x.lse = p;
    x.wg = p + h * T;
    mha_status st = mha__exec_team(exec, &x.team, err);
    if (st == MHA_STATUS_OK)
        st = run(&x, err);
    mha__free(al, buf);
    if (st == MHA_STATUS_OK)
        mha__ok(err);
    return st;
}
