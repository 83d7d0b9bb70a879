/* SPDX-License-Identifier: MIT */
/* mla.c: multi-head latent attention (DeepSeek-V2/V3), the expanded form: the low-rank
 * projections, the two RMSNorms and RoPE (mha__mla_project, shared with the compressed-cache
 * decode of decode/mla_decode.c), then the per-head keys and values expanded from the latent and
 * the attention core (mha_attention) on them. Formulas: mha.h "Multi-head latent attention",
 * docs/SEMANTICS.md. */
#include "layer/mla.h"

#include "check/check.h"
#include "kernels/gemm.h"
#include "layer/rope.h"

#include <stdlib.h>
#include <string.h>

/* The weights' float counts, in mha_mla_weights' field order (0: unused by the config). */
static void weight_counts(const mha_mla_config *c, int64_t n[11]) {
    const int64_t h = c->num_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim;
    const int64_t dq = dn + dr, r = c->kv_lora_rank, rq = c->q_lora_rank, E = c->hidden;
    const int lq = rq > 0, b = c->bias;
    const int64_t v[11] = {lq ? 0 : h * dq * E,
                           rq * E,
                           lq && b ? rq : 0,
                           rq,
                           h * dq * rq,
                           (r + dr) * E,
                           b ? r + dr : 0,
                           r,
                           h * (dn + c->v_head_dim) * r,
                           E * h * c->v_head_dim,
                           b ? E : 0};
    memcpy(n, v, sizeof v);
}

/* w_uk_t[h][i][d] = W_kvb[h (dn + dv) + d][i]: each head's k rows of W_kvb, transposed. */
static void transpose_uk(const mha_mla_config *c, const float *w_kv_b, float *w_uk_t) {
    const int64_t dn = c->qk_nope_head_dim, r = c->kv_lora_rank, dnv = dn + c->v_head_dim;
    for (int64_t hh = 0; hh < c->num_heads; hh++)
        for (int64_t i = 0; i < r; i++)
            for (int64_t d = 0; d < dn; d++)
                w_uk_t[(hh * r + i) * dn + d] = w_kv_b[(hh * dnv + d) * r + i];
}

mha_status mha_mla_create(const mha_mla_config *config,
                          const mha_mla_weights *weights,
                          const mha_allocator *allocator,
                          mha_mla **out,
                          mha_error *err) {
    MHA_RETURN_IF(!out, err, INVALID_ARG, "mha_mla_create: out is NULL");
    *out = NULL;
    mha_mla_config cfg;
    MHA_TRY(mha__check_mla_create(config, weights, &cfg, err));
    int64_t n[11], total = 0;
    weight_counts(&cfg, n);
    for (int i = 0; i < 11; i++)
        total += n[i]; /* each < 2^40 (checked): no overflow */
    const int64_t n_uk = cfg.num_heads * cfg.kv_lora_rank * cfg.qk_nope_head_dim;
    total += n_uk;
    mha_mla *m = mha__alloc(allocator, sizeof *m);
    float *mem = m ? mha__alloc_large(allocator, (size_t)total * sizeof(float)) : NULL;
    if (!mem) {
        mha__free(allocator, m);
        return mha__fail(err, MHA_STATUS_NO_MEMORY, "mha_mla_create: cannot allocate %lld floats",
                         (long long)total);
    }
    memset(m, 0, sizeof *m);
    m->cfg = cfg;
    m->mem = mem;
    if (allocator) {
        m->allocator = *allocator;
        m->has_allocator = 1;
    }
    const float *src[11] = {weights->w_q,    weights->w_q_a,  weights->b_q_a,  weights->q_a_norm,
                            weights->w_q_b,  weights->w_kv_a, weights->b_kv_a, weights->kv_a_norm,
                            weights->w_kv_b, weights->w_o,    weights->b_o};
    const float **dst[11] = {&m->w.w_q,    &m->w.w_q_a,  &m->w.b_q_a,  &m->w.q_a_norm,
                             &m->w.w_q_b,  &m->w.w_kv_a, &m->w.b_kv_a, &m->w.kv_a_norm,
                             &m->w.w_kv_b, &m->w.w_o,    &m->w.b_o};
    for (int i = 0; i < 11; i++) {
        if (!n[i])
            continue;
        memcpy(mem, src[i], (size_t)n[i] * sizeof(float));
        *dst[i] = mem;
        mem += n[i];
    }
    m->w_uk_t = mem;
    transpose_uk(&m->cfg, m->w.w_kv_b, m->w_uk_t);
    *out = m;
    mha__ok(err);
    return MHA_STATUS_OK;
}

void mha_mla_destroy(mha_mla *mla) {
    if (!mla)
        return;
    const mha_allocator a = mla->allocator;
    const mha_allocator *ap = mla->has_allocator ? &a : NULL;
    mha__free(ap, mla->mem);
    mha__free(ap, mla);
}

const mha_mla_config *mha_mla_get_config(const mha_mla *mla) {
    return mla ? &mla->cfg : NULL;
}

const mha_mla_weights *mha_mla_get_weights(const mha_mla *mla) {
    return mla ? &mla->w : NULL;
}

void mha__mla_rms_norm(float *x, int64_t T, int64_t d, int64_t ld, const float *w, double eps) {
    for (int64_t t = 0; t < T; t++) {
        float *row = x + t * ld;
        double ss = 0.0;
        for (int64_t i = 0; i < d; i++)
            ss += (double)row[i] * (double)row[i];
        const double inv = 1.0 / sqrt(ss / (double)d + eps);
        for (int64_t i = 0; i < d; i++)
            row[i] = (float)((double)w[i] * ((double)row[i] * inv));
    }
}

mha_status mha__mla_rotate(const struct mha_mla *m,
                           int64_t B,
                           int64_t L,
                           const int64_t *pos,
                           const int64_t *base,
                           mha__mla_rows rows,
                           int inverse,
                           mha_error *err) {
    const mha_mla_config *c = &m->cfg;
    const int64_t h = c->num_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim;
    const int64_t dq = dn + dr, r = c->kv_lora_rank, half = dr / 2;
    double *tab = malloc(sizeof(double) * (size_t)(3 * half));
    MHA_RETURN_IF(!tab, err, NO_MEMORY, "mla rope: cannot allocate %lld doubles",
                  (long long)(3 * half));
    double *freqs = tab, *cos_k = tab + half, *sin_k = tab + 2 * half, cs;
    const mha_rope rope = mha__rope_at_length(&c->rope, mha__positions_length(pos, base, B, L, L));
    mha__rope_freqs(&rope, freqs, &cs);
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < L; t++) {
            const int64_t i = b * L + t, p = pos ? pos[i] : (base ? base[b] : 0) + t;
            mha__rope_cos_sin(&rope, freqs, cs, p, cos_k, sin_k);
            for (int64_t k = 0; inverse && k < half; k++)
                sin_k[k] = -sin_k[k]; /* the transpose: rotation by -angle, same factor */
            for (int64_t hh = 0; hh < h; hh++)
                mha__rope_rotate(&rope, cos_k, sin_k, rows.q + (i * h + hh) * dq + dn);
            mha__rope_rotate(&rope, cos_k, sin_k, rows.kv + i * (r + dr) + r);
        }
    free(tab);
    return MHA_STATUS_OK;
}

/* y [M, N] = x [M, K] (row stride ldx) W^T (+ bias), y row stride ldy. */
static mha_status gemm(int64_t M,
                       int64_t N,
                       int64_t K,
                       const float *x,
                       int64_t ldx,
                       const float *w,
                       int64_t ldw,
                       const float *bias,
                       float *y,
                       int64_t ldy,
                       mha__team team,
                       mha_error *err) {
    return mha__gemm_xwt(M, N, K, x, ldx, w, ldw, bias, y, ldy, team, MHA__GEMM_AUTO, NULL, err);
}

mha_status mha__mla_project(const struct mha_mla *m,
                            int64_t B,
                            int64_t L,
                            const float *x,
                            const int64_t *pos,
                            const int64_t *base,
                            mha__mla_rows rows,
                            float *tmp,
                            mha__team team,
                            mha_error *err) {
    const mha_mla_config *c = &m->cfg;
    const int64_t T = B * L, E = c->hidden, h = c->num_heads, rq = c->q_lora_rank;
    const int64_t dq = c->qk_nope_head_dim + c->qk_rope_head_dim, r = c->kv_lora_rank;
    const int64_t dr = c->qk_rope_head_dim;
    if (rq == 0) {
        MHA_TRY(gemm(T, h * dq, E, x, E, m->w.w_q, E, NULL, rows.q, h * dq, team, err));
    } else {
        MHA_TRY(gemm(T, rq, E, x, E, m->w.w_q_a, E, m->w.b_q_a, tmp, rq, team, err));
        mha__mla_rms_norm(tmp, T, rq, rq, m->w.q_a_norm, c->rms_eps);
        MHA_TRY(gemm(T, h * dq, rq, tmp, rq, m->w.w_q_b, rq, NULL, rows.q, h * dq, team, err));
    }
    MHA_TRY(gemm(T, r + dr, E, x, E, m->w.w_kv_a, E, m->w.b_kv_a, rows.kv, r + dr, team, err));
    mha__mla_rms_norm(rows.kv, T, r, r + dr, m->w.kv_a_norm, c->rms_eps);
    return mha__mla_rotate(m, B, L, pos, base, rows, 0, err);
}

void mha__mla_expand_keys(
    const mha_mla_config *c, int64_t T, const float *kvb, const float *kv, float *k) {
    const int64_t h = c->num_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim;
    const int64_t dq = dn + dr, dnv = dn + c->v_head_dim, r = c->kv_lora_rank;
    for (int64_t t = 0; t < T; t++)
        for (int64_t hh = 0; hh < h; hh++) {
            float *row = k + (t * h + hh) * dq;
            memcpy(row, kvb + (t * h + hh) * dnv, (size_t)dn * sizeof(float));
            memcpy(row + dn, kv + t * (r + dr) + r, (size_t)dr * sizeof(float));
        }
}

void mha__mla_core_args(const struct mha_mla *m,
                        const mha_mla_forward_args *a,
                        const float *q,
                        const float *k,
                        const float *kvb,
                        float *o,
                        mha_attention_args *out) {
    const mha_mla_config *c = &m->cfg;
    const int64_t h = c->num_heads, dn = c->qk_nope_head_dim, dv = c->v_head_dim;
    const int64_t dq = dn + c->qk_rope_head_dim, dnv = dn + dv, L = a->seq_len;
    mha_attention_args ca;
    memset(&ca, 0, sizeof ca);
    ca.batch = a->batch;
    ca.num_heads = ca.num_kv_heads = h;
    ca.q_len = ca.kv_len = L;
    ca.head_dim = dq;
    ca.v_head_dim = dv;
    ca.scale = c->scale;
    ca.q = q;
    ca.k = k;
    ca.v = kvb + dn;
    ca.out = o;
    const int64_t qs[3] = {L * h * dq, dq, h * dq}, vs[3] = {L * h * dnv, dnv, h * dnv},
                  os[3] = {L * h * dv, dv, h * dv};
    memcpy(ca.q_strides, qs, sizeof qs);
    memcpy(ca.k_strides, qs, sizeof qs);
    memcpy(ca.v_strides, vs, sizeof vs);
    memcpy(ca.out_strides, os, sizeof os);
    ca.mask.causal = a->causal != 0;
    ca.mask.window_left = ca.mask.window_right = -1;
    *out = ca;
}

mha_status mha_mla_forward(const mha_mla *m,
                           const mha_mla_forward_args *a,
                           const mha_exec *exec,
                           mha_error *err) {
    MHA_RETURN_IF(!m, err, INVALID_ARG, "mha_mla_forward: mla is NULL");
    MHA_TRY(mha__check_mla_forward(&m->cfg, &m->w, a, err));
    mha__team team;
    MHA_TRY(mha__exec_team(exec, &team, err));
    const mha_mla_config *c = &m->cfg;
    const int64_t T = a->batch * a->seq_len, h = c->num_heads, dn = c->qk_nope_head_dim;
    const int64_t dq = dn + c->qk_rope_head_dim, dv = c->v_head_dim, r = c->kv_lora_rank;
    const int64_t f[] = {h * dq, r + c->qk_rope_head_dim, c->q_lora_rank, h * (dn + dv), h * dq,
                         h * dv};
    int64_t per = 0, total;
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        per += f[i];
    size_t bytes;
    MHA_RETURN_IF(!mha__mul_i64(per, T, &total) || !mha__bytes(total, sizeof(float), &bytes), err,
                  OVERFLOW, "mha_mla_forward: scratch of %lld x %lld floats", (long long)per,
                  (long long)T);
    const mha_allocator *al = exec ? exec->allocator : NULL;
    float *buf = mha__alloc_large(al, bytes);
    MHA_RETURN_IF(!buf, err, NO_MEMORY, "mha_mla_forward: cannot allocate %zu bytes", bytes);
    mha__mla_rows rows = {buf, buf + T * f[0]};
    float *tmp = rows.kv + T * f[1], *kvb = tmp + T * f[2], *k = kvb + T * f[3], *o = k + T * f[4];
    mha_status st =
        mha__mla_project(m, a->batch, a->seq_len, a->x, a->positions, NULL, rows, tmp, team, err);
    if (st == MHA_STATUS_OK)
        st = gemm(T, h * (dn + dv), r, rows.kv, r + c->qk_rope_head_dim, m->w.w_kv_b, r, NULL, kvb,
                  h * (dn + dv), team, err);
    if (st == MHA_STATUS_OK) {
        mha__mla_expand_keys(c, T, kvb, rows.kv, k);
        mha_attention_args ca;
        mha__mla_core_args(m, a, rows.q, k, kvb, o, &ca);
        st = mha_attention(&ca, exec, err);
    }
    if (st == MHA_STATUS_OK)
        st = gemm(T, c->hidden, h * dv, o, h * dv, m->w.w_o, h * dv, m->w.b_o, a->out, c->hidden,
                  team, err);
    mha__free(al, buf);
    if (st == MHA_STATUS_OK)
        mha__ok(err);
    return st;
}
