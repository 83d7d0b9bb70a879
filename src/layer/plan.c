/* SPDX-License-Identifier: MIT */
/* plan.c: the projection and RoPE steps of the layer's plan (plan.h), shared by the forward, the
 * backward and the decode step. */
#include "layer/plan.h"
#include "check/check.h"
#include "layer/rope.h"

#include "kernels/gemm.h"
#include "kernels/kernels.h"

#include <math.h>
#include <string.h>

/* y[r, o] = sum_c x[r, c] W[o, c] + b[o] for rows [r0, r1): the reference projection. */
typedef struct proj_job {
    const void *x, *w; /* of dtypes xdt, wdt */
    mha_dtype xdt, wdt;
    const float *bias;
    float *y;
    int64_t in, out;
} proj_job;

static void project_rows(void *ctx, int part, int64_t r0, int64_t r1) {
    (void)part;
    const proj_job *j = ctx;
    for (int64_t r = r0; r < r1; r++) {
        float *y = j->y + r * j->out;
        for (int64_t o = 0; o < j->out; o++) {
            float acc = 0.0f;
            for (int64_t c = 0; c < j->in; c++)
                acc += mha__load(j->xdt, j->x, r * j->in + c) *
                       (mha__is_block_weight(j->wdt) ? mha__block_load(j->wdt, j->w, o * j->in + c)
                                                     : mha__load(j->wdt, j->w, o * j->in + c));
            y[o] = j->bias ? acc + j->bias[o] : acc;
        }
    }
}

mha_status mha__plan_project(mha_impl impl,
                             const mha_allocator *alloc,
                             mha__team team,
                             const void *x,
                             mha_dtype xdt,
                             const void *w,
                             mha_dtype wdt,
                             const float *bias,
                             float *y,
                             int64_t rows,
                             int64_t in,
                             int64_t out,
                             void *pack,
                             size_t pack_bytes,
                             mha_error *err) {
    if (impl != MHA_IMPL_REFERENCE)
        return mha__gemm_run_dt(MHA__GEMM_OP_N, rows, out, in, x, xdt, in, w, wdt, in, bias, y, out,
                                team, MHA__GEMM_AUTO, pack, pack_bytes, alloc, err);
    proj_job job = {x, w, xdt, wdt, bias, y, in, out};
    return mha__parallel_for(team, rows, project_rows, &job, err);
}

/* Rounding the intermediates, in chunks of CHUNK elements the threads share out. */
enum { CHUNK = 4096 };
typedef struct round_job {
    mha_dtype dt;
    const float *src;
    void *dst; /* NULL: round src in place (through a stack chunk) */
    int64_t count;
} round_job;

static void round_chunks(void *ctx, int part, int64_t c0, int64_t c1) {
    (void)part;
    const round_job *j = ctx;
    uint16_t tmp[CHUNK];
    for (int64_t c = c0; c < c1; c++) {
        const int64_t i = c * CHUNK, len = j->count - i < CHUNK ? j->count - i : CHUNK;
        if (j->dst) {
            mha__narrow_rows(j->dt, j->src + i, (char *)j->dst + i * 2, len);
        } else {
            mha__narrow_rows(j->dt, j->src + i, tmp, len);
            mha__widen_rows(j->dt, tmp, (float *)j->src + i, len);
        }
    }
}

mha_status mha__plan_round(mha__team team, mha_dtype dt, float *x, int64_t count, mha_error *err) {
    if (dt == MHA_DTYPE_F32)
        return MHA_STATUS_OK;
    round_job j = {dt, x, NULL, count};
    return mha__parallel_for(team, (count + CHUNK - 1) / CHUNK, round_chunks, &j, err);
}

mha_status mha__plan_narrow(
    mha__team team, mha_dtype dt, const float *src, void *dst, int64_t count, mha_error *err) {
    if (dt == MHA_DTYPE_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)count);
        return MHA_STATUS_OK;
    }
    round_job j = {dt, src, dst, count};
    return mha__parallel_for(team, (count + CHUNK - 1) / CHUNK, round_chunks, &j, err);
}

mha_status mha__plan_round_qk(const mha_config *cfg,
                              int stage,
                              mha__team team,
                              mha_dtype dt,
                              float *q,
                              int64_t nq,
                              float *k,
                              int64_t nk,
                              mha_error *err) {
    if (dt == MHA_DTYPE_F32)
        return MHA_STATUS_OK;
    const int has[5] = {1, mha__plan_qk_norm_at(cfg, 0), cfg->rope.style != MHA_ROPE_NONE,
                        mha__plan_qk_norm_at(cfg, 1), cfg->temperature.enabled};
    int follows = 0;
    for (int i = stage + 1; i < 5; i++)
        follows |= has[i];
    if (!has[stage] || !follows)
        return MHA_STATUS_OK;
    mha_status st = mha__plan_round(team, dt, q, nq, err);
    return st ? st : mha__plan_round(team, dt, k, nk, err);
}

int64_t mha__plan_rope_length(const mha_rope *resolved,
                              const int64_t *q_pos,
                              const int64_t *k_pos,
                              const int64_t *base,
                              int64_t B,
                              int64_t n,
                              int64_t m) {
    if (!mha__rope_depends_on_length(resolved))
        return 0;
    const int64_t lq = mha__positions_length(q_pos, base, B, n, n);
    const int64_t lk = mha__positions_length(k_pos, base, B, m, m);
    return lq > lk ? lq : lk;
}

void mha__plan_rope(const mha_rope *resolved,
                    int64_t length,
                    double *tab,
                    float *x,
                    int64_t B,
                    int64_t L,
                    int64_t heads,
                    int64_t d,
                    const int64_t *pos,
                    const int64_t *base,
                    int sign) {
    /* The transpose of (x_a, x_b) -> f (x_a cos - x_b sin, x_a sin + x_b cos) is the same map with
     * sin negated. */
    const int64_t half = resolved->rotary_dim / 2;
    double *freqs = tab, *cos_k = tab + half, *sin_k = tab + 2 * half, cs;
    const mha_rope r = mha__rope_at_length(resolved, length);
    mha__rope_freqs(&r, freqs, &cs);
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < L; t++) {
            const int64_t p = pos ? pos[b * L + t] : (base ? base[b] : 0) + t;
            mha__rope_cos_sin(&r, freqs, cs, p, cos_k, sin_k);
            if (sign < 0)
                for (int64_t k = 0; k < half; k++)
                    sin_k[k] = -sin_k[k];
            for (int64_t hh = 0; hh < heads; hh++)
                mha__rope_rotate(&r, cos_k, sin_k, x + ((b * L + t) * heads + hh) * d);
        }
}

/* sum(x[0..G)^2) in double: four chains (an order that depends on G only), then their sum. */
static double sum_squares(const float *x, int64_t G) {
    double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
    int64_t j = 0;
    for (; j + 4 <= G; j += 4) {
        a0 += (double)x[j] * (double)x[j];
        a1 += (double)x[j + 1] * (double)x[j + 1];
        a2 += (double)x[j + 2] * (double)x[j + 2];
        a3 += (double)x[j + 3] * (double)x[j + 3];
    }
    for (; j < G; j++)
        a0 += (double)x[j] * (double)x[j];
    return (a0 + a1) + (a2 + a3);
}

/* The group size and the number of groups of a [rows, heads * d] buffer. */
static int64_t norm_group(const mha_qk_norm *nrm, int64_t heads, int64_t d) {
    return nrm->kind == MHA_QK_NORM_RMS_ALL ? heads * d : d;
}

static float norm_rstd(const mha_qk_norm *nrm, const float *x, int64_t G) {
    return (float)(1.0 / sqrt(sum_squares(x, G) / (double)G + nrm->eps));
}

void mha__plan_qk_norm(
    const mha_qk_norm *nrm, const float *w, float *x, int64_t rows, int64_t heads, int64_t d) {
    const int64_t G = norm_group(nrm, heads, d), groups = rows * heads * d / G;
    const float off = nrm->unit_offset ? 1.0f : 0.0f;
    for (int64_t i = 0; i < groups; i++) {
        float *xg = x + i * G;
        const float r = norm_rstd(nrm, xg, G);
        if (w)
            for (int64_t j = 0; j < G; j++)
                xg[j] = (xg[j] * r) * (off + w[j]);
        else
            for (int64_t j = 0; j < G; j++)
                xg[j] *= r;
    }
}

int mha__plan_qk_norm_at(const mha_config *cfg, int after_rope) {
    const mha_qk_norm_kind kind = cfg->qk_norm.kind;
    return after_rope ? kind == MHA_QK_NORM_L2_AFTER_ROPE
                      : kind == MHA_QK_NORM_RMS_HEAD || kind == MHA_QK_NORM_RMS_ALL;
}

void mha__plan_qk_norm_stage(const mha_config *cfg,
                             const mha__layer_w *w,
                             int after_rope,
                             float *q,
                             int64_t rows_q,
                             float *k,
                             int64_t rows_k) {
    if (!mha__plan_qk_norm_at(cfg, after_rope))
        return;
    if (q)
        mha__plan_qk_norm(&cfg->qk_norm, w->q_norm, q, rows_q, cfg->num_heads, cfg->head_dim);
    if (k)
        mha__plan_qk_norm(&cfg->qk_norm, w->k_norm, k, rows_k, cfg->num_kv_heads, cfg->head_dim);
}

void mha__plan_qk_norm_backward(const mha_qk_norm *nrm,
                                const float *w,
                                const float *x,
                                float *g,
                                double *dw,
                                int64_t rows,
                                int64_t heads,
                                int64_t d) {
    const int64_t G = norm_group(nrm, heads, d), groups = rows * heads * d / G;
    const float off = nrm->unit_offset ? 1.0f : 0.0f;
    for (int64_t i = 0; i < groups; i++) {
        const float *xg = x + i * G;
        float *gg = g + i * G;
        const float r = norm_rstd(nrm, xg, G);
        double tu = 0.0; /* sum(t u) */
        for (int64_t j = 0; j < G; j++) {
            const float u = xg[j] * r, t = w ? gg[j] * (off + w[j]) : gg[j];
            tu += (double)t * (double)u;
            if (dw)
                dw[j] += (double)gg[j] * (double)u;
        }
        const float c = (float)(tu / (double)G);
        for (int64_t j = 0; j < G; j++) {
            const float u = xg[j] * r, t = w ? gg[j] * (off + w[j]) : gg[j];
            gg[j] = r * (t - u * c);
        }
    }
}

float mha__temperature_factor(const mha_temperature_tuning *t, int64_t p) {
    /* transformers: torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) *
     * attn_scale + 1.0; float32 up to the floor, whose result (an integer < 2^64) is exact in
     * double. */
    const float k = floorf(((float)p + 1.0f) / (float)t->floor_scale);
    return (float)(log1p((double)k) * t->attn_scale + 1.0);
}

void mha__plan_temperature(const mha_temperature_tuning *t,
                           float *x,
                           int64_t B,
                           int64_t L,
                           int64_t heads,
                           int64_t d,
                           const int64_t *pos,
                           const int64_t *base) {
    if (!t->enabled)
        return;
    const int64_t row = heads * d;
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < L; i++) {
            const int64_t p = pos ? pos[b * L + i] : (base ? base[b] : 0) + i;
            const float tau = mha__temperature_factor(t, p);
            float *xr = x + (b * L + i) * row;
            for (int64_t e = 0; e < row; e++)
                xr[e] *= tau;
        }
}

void mha__plan_gate_weights(const mha_config *cfg,
                            const mha__layer_w *w,
                            const void **w_gate,
                            const float **b_gate) {
    const int64_t rows = cfg->num_heads * cfg->head_dim;
    *w_gate = (const char *)w->w_q + mha__weight_bytes(w->wdt, rows * cfg->q_dim);
    *b_gate = w->b_q ? w->b_q + rows : NULL;
}

void mha__plan_gate_apply(const float *g, float *a, int64_t count) {
    for (int64_t i = 0; i < count; i++)
        a[i] *= 1.0f / (1.0f + expf(-g[i]));
}

void mha__plan_gate_apply_dt(mha_dtype dt, const float *g, void *a, int64_t count) {
    if (dt == MHA_DTYPE_F32) {
        mha__plan_gate_apply(g, a, count);
        return;
    }
    /* A half: widen a block, gate it in float32, round it back (2-byte storage). */
    uint16_t *ah = a;
    float buf[256];
    for (int64_t i = 0; i < count; i += 256) {
        const int64_t c = count - i < 256 ? count - i : 256;
        mha__widen(dt, ah + i, buf, c);
        mha__plan_gate_apply(g + i, buf, c);
        mha__narrow(dt, buf, ah + i, c);
    }
}

void mha__plan_core_args(const mha_config *cfg,
                         const float *sinks,
                         const mha_forward_args *a,
                         int64_t m,
                         const void *q,
                         const void *k,
                         const void *v,
                         void *att,
                         float *lse,
                         mha_dtype dt,
                         mha_attention_args *c) {
    const int64_t h = cfg->num_heads, g = cfg->num_kv_heads, n = a->q_len;
    const int64_t dk = cfg->head_dim, dv = cfg->v_head_dim;
    memset(c, 0, sizeof *c);
    c->batch = a->batch;
    c->num_heads = h;
    c->num_kv_heads = g;
    c->q_len = n;
    c->kv_len = m;
    c->head_dim = dk;
    c->v_head_dim = dv;
    c->scale = cfg->scale;
    c->softcap = cfg->softcap;
    c->alibi = cfg->alibi;
    c->sinks = sinks;
    c->q = q;
    c->q_strides[0] = n * h * dk, c->q_strides[1] = dk, c->q_strides[2] = h * dk;
    c->k = k;
    c->k_strides[0] = m * g * dk, c->k_strides[1] = dk, c->k_strides[2] = g * dk;
    c->v = v;
    c->v_strides[0] = m * g * dv, c->v_strides[1] = dv, c->v_strides[2] = g * dv;
    c->out = att;
    c->out_strides[0] = n * h * dv, c->out_strides[1] = dv, c->out_strides[2] = h * dv;
    c->q_dtype = c->k_dtype = c->v_dtype = c->out_dtype = dt;
    c->lse = lse;
    c->probs = a->probs;
    c->average_probs = a->average_probs;
    c->mask = a->mask;
    c->dropout = a->dropout;
}
