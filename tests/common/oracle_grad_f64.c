/* SPDX-License-Identifier: MIT */
/* oracle_grad_f64.c: float64 forward and analytic backward (oracle_grad_f64.h). Naive: one row
 * of scores at a time, every mask rule by its definition, D_i computed as sum_j P_ij dP_ij (not
 * through the dO . O identity the library uses, so the identity itself is under test). */
#include "oracle_grad_f64.h"
#include "oracle_f64.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Dropout's keep decision is a definition shared with the library (Philox, see oracle_f64.c). */
int mha__dropout_keep(uint64_t seed, float p, int64_t b, int64_t h, int64_t i, int64_t j);

static int64_t delta_of(const og_core *c, int64_t b) {
    if (c->mask.alignment == MHA_ALIGN_TOP_LEFT)
        return 0;
    if (c->mask.alignment == MHA_ALIGN_EXPLICIT)
        return c->mask.align_offsets[b];
    return c->m - c->n;
}

/* Scores of row (b, h, i): s[j] (-inf when hidden) and tp[j] = ds/dr. Returns 1 when every
 * score is -inf (fully masked row). */
static int row_scores(const og_core *c, int64_t b, int64_t h, int64_t i, double *s, double *tp) {
    const mha_masking *mk = &c->mask;
    const int64_t g = h / (c->H / c->G), pos = i + delta_of(c, b);
    const double scale = c->scale != 0.0 ? c->scale : 1.0 / sqrt((double)c->dk);
    const double *q = c->q + ((b * c->H + h) * c->n + i) * c->dk;
    int dead = 1;
    for (int64_t j = 0; j < c->m; j++) {
        const int64_t idx[4] = {b, h, i, j};
        int vis = 1;
        if (mk->causal && j > pos)
            vis = 0;
        if (mk->use_window && mk->window_left >= 0 && j < pos - mk->window_left)
            vis = 0;
        if (mk->use_window && mk->window_right >= 0 && j > pos + mk->window_right)
            vis = 0;
        if (mk->chunk_size > 0 && floor((double)j / (double)mk->chunk_size) !=
                                      floor((double)pos / (double)mk->chunk_size))
            vis = 0; /* chunk: same chunk of C positions */
        if (mk->bool_mask.data) {
            const int nz = oracle_mask_elem(&mk->bool_mask, idx) != 0.0;
            if (mk->bool_mask_polarity == MHA_MASK_ATTEND ? !nz : nz)
                vis = 0;
        }
        if (mk->key_padding.data) {
            const int64_t kidx[4] = {0, 0, b, j};
            if (oracle_mask_elem(&mk->key_padding, kidx) == 0.0)
                vis = 0;
        }
        if (mk->q_segment_ids &&
            mk->q_segment_ids[b * c->n + i] != mk->kv_segment_ids[b * c->m + j])
            vis = 0;
        tp[j] = 0.0;
        if (!vis) {
            s[j] = -HUGE_VAL;
            continue;
        }
        const double *k = c->k + ((b * c->G + g) * c->m + j) * c->dk;
        double r = 0.0;
        for (int64_t d = 0; d < c->dk; d++)
            r += q[d] * k[d];
        r *= scale;
        tp[j] = 1.0;
        if (c->softcap > 0.0) {
            const double t = tanh(r / c->softcap);
            r = c->softcap * t;
            tp[j] = 1.0 - t * t;
        }
        if (mk->additive_mask.data)
            r += oracle_mask_elem(&mk->additive_mask, idx);
        if (c->alibi)
            r -= oracle_alibi_slope(c->H, h) * fabs((double)(pos - j));
        s[j] = r;
        if (r != -HUGE_VAL)
            dead = 0;
    }
    return dead;
}

/* Softmax with the sink: p[j] = exp(s_j - lse); returns lse and the sink probability. */
static double row_softmax(const og_core *c, int64_t h, const double *s, double *p, double *psink) {
    double mx = c->sinks ? c->sinks[h] : -HUGE_VAL;
    for (int64_t j = 0; j < c->m; j++)
        if (s[j] > mx)
            mx = s[j];
    double sum = c->sinks ? exp(c->sinks[h] - mx) : 0.0;
    for (int64_t j = 0; j < c->m; j++)
        sum += exp(s[j] - mx);
    const double lse = mx + log(sum);
    for (int64_t j = 0; j < c->m; j++)
        p[j] = exp(s[j] - lse);
    *psink = c->sinks ? exp(c->sinks[h] - lse) : 0.0;
    return lse;
}

static double keep_factor(const og_core *c, int64_t b, int64_t h, int64_t i, int64_t j) {
    if (!(c->dropout.training && c->dropout.p > 0.0f))
        return 1.0;
    return mha__dropout_keep(c->dropout.seed, c->dropout.p, b, h, i + c->dropout.row_offset,
                             j + c->dropout.col_offset)
               ? 1.0 / (1.0 - (double)c->dropout.p)
               : 0.0;
}

int og_core_forward(const og_core *c, double *out, double *lse) {
    return og_core_forward_probs(c, out, lse, NULL);
}

int og_core_forward_probs(const og_core *c, double *out, double *lse, double *probs) {
    double *s = malloc(sizeof(double) * (size_t)(3 * c->m));
    if (!s)
        return -1;
    double *tp = s + c->m, *p = tp + c->m;
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t h = 0; h < c->H; h++)
            for (int64_t i = 0; i < c->n; i++) {
                const int64_t row = (b * c->H + h) * c->n + i, g = h / (c->H / c->G);
                const int dead = row_scores(c, b, h, i, s, tp);
                double ps, l = -HUGE_VAL;
                if (!dead)
                    l = row_softmax(c, h, s, p, &ps);
                if (lse)
                    lse[row] = l;
                for (int64_t j = 0; probs && j < c->m; j++) /* before dropout; 0 in a dead row */
                    probs[row * c->m + j] = dead ? 0.0 : p[j];
                if (!out)
                    continue;
                double *o = out + row * c->dv;
                for (int64_t d = 0; d < c->dv; d++)
                    o[d] = 0.0;
                if (dead)
                    continue;
                for (int64_t j = 0; j < c->m; j++) {
                    const double pz = p[j] * keep_factor(c, b, h, i, j);
                    const double *v = c->v + ((b * c->G + g) * c->m + j) * c->dv;
                    for (int64_t d = 0; d < c->dv; d++)
                        o[d] += pz * v[d];
                }
            }
    free(s);
    return 0;
}

int og_core_backward(const og_core *c,
                     const double *dout,
                     const double *dlse,
                     const double *dprobs,
                     double *dq,
                     double *dk,
                     double *dv,
                     double *dsinks) {
    const int64_t B = c->B, H = c->H, G = c->G, n = c->n, m = c->m;
    const double scale = c->scale != 0.0 ? c->scale : 1.0 / sqrt((double)c->dk);
    double *s = malloc(sizeof(double) * (size_t)(4 * m));
    if (!s)
        return -1;
    double *tp = s + m, *p = tp + m, *dp = p + m;
    if (dq)
        memset(dq, 0, sizeof(double) * (size_t)(B * H * n * c->dk));
    if (dk)
        memset(dk, 0, sizeof(double) * (size_t)(B * G * m * c->dk));
    if (dv)
        memset(dv, 0, sizeof(double) * (size_t)(B * G * m * c->dv));
    if (dsinks)
        memset(dsinks, 0, sizeof(double) * (size_t)H);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < n; i++) {
                const int64_t row = (b * H + h) * n + i, g = h / (H / G);
                if (row_scores(c, b, h, i, s, tp))
                    continue; /* fully masked: output is constant 0, gradient 0 */
                double psink;
                row_softmax(c, h, s, p, &psink);
                const double *dO = dout + row * c->dv;
                const double *q = c->q + row * c->dk;
                /* O = sum_j z_j p_j v_j: dv_j += z p dO, dp_j = z dO . v_j. */
                double D = 0.0;
                for (int64_t j = 0; j < m; j++) {
                    const double z = keep_factor(c, b, h, i, j);
                    const double *v = c->v + ((b * G + g) * m + j) * c->dv;
                    double dot = 0.0;
                    for (int64_t d = 0; d < c->dv; d++)
                        dot += dO[d] * v[d];
                    /* dL/dp_j: through O (z dO . v_j) and, when the loss reads the
                     * probabilities (before dropout), directly */
                    dp[j] = z * dot + (dprobs ? dprobs[row * m + j] : 0.0);
                    D += p[j] * dp[j];
                    if (dv)
                        for (int64_t d = 0; d < c->dv; d++)
                            dv[((b * G + g) * m + j) * c->dv + d] += z * p[j] * dO[d];
                }
                /* A loss reading lse_i = log sum_j exp(s_j) (+ the sink) adds dlse_i p_j to
                 * dL/ds_j and dlse_i p_sink to dL/dsink: D -= dlse_i. */
                if (dlse)
                    D -= dlse[row];
                /* softmax (keys + sink whose dp is 0): ds_j = p_j (dp_j - D). */
                for (int64_t j = 0; j < m; j++) {
                    if (p[j] == 0.0)
                        continue;
                    const double dr = scale * p[j] * (dp[j] - D) * tp[j];
                    const double *k = c->k + ((b * G + g) * m + j) * c->dk;
                    for (int64_t d = 0; d < c->dk; d++) {
                        if (dq)
                            dq[row * c->dk + d] += dr * k[d];
                        if (dk)
                            dk[((b * G + g) * m + j) * c->dk + d] += dr * q[d];
                    }
                }
                if (dsinks && c->sinks)
                    dsinks[h] += psink * (0.0 - D);
            }
    free(s);
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* The layer.                                                                                     */
/* ---------------------------------------------------------------------------------------------- */

/* y[r, o] = sum_c x[r, c] W[o, c] + b[o]. */
static void lin(const double *x,
                const double *W,
                const double *bias,
                double *y,
                int64_t rows,
                int64_t in,
                int64_t out) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < out; o++) {
            double acc = bias ? bias[o] : 0.0;
            for (int64_t c = 0; c < in; c++)
                acc += x[r * in + c] * W[o * in + c];
            y[r * out + o] = acc;
        }
}

/* Backward of lin: dx (+=), dW (+=), db (+=) from dy; each may be NULL. */
static void lin_back(const double *x,
                     const double *W,
                     const double *dy,
                     int64_t rows,
                     int64_t in,
                     int64_t out,
                     double *dx,
                     double *dW,
                     double *db) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < out; o++) {
            const double g = dy[r * out + o];
            if (db)
                db[o] += g;
            for (int64_t c = 0; c < in; c++) {
                if (dx)
                    dx[r * in + c] += g * W[o * in + c];
                if (dW)
                    dW[o * in + c] += g * x[r * in + c];
            }
        }
}

/* RoPE on [B, L, heads, d] by +angle (sign 1) or its transpose (sign -1). */
static void rope(const mha_rope *r,
                 int64_t d,
                 double *x,
                 int64_t B,
                 int64_t L,
                 int64_t heads,
                 const int64_t *pos,
                 int sign) {
    if (r->style == MHA_ROPE_NONE)
        return;
    const int64_t R = r->rotary_dim ? r->rotary_dim : d, half = R / 2;
    double freqs[512], cs = 1.0;
    mha_rope_frequencies(r, d, freqs, &cs, NULL);
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < L; t++)
            for (int64_t hh = 0; hh < heads; hh++) {
                double *v = x + ((b * L + t) * heads + hh) * d;
                const double ps = (double)(pos ? pos[b * L + t] : t);
                for (int64_t k = 0; k < half; k++) {
                    const double co = cs * cos(ps * freqs[k]);
                    const double si = (double)sign * cs * sin(ps * freqs[k]);
                    const int64_t ia = r->style == MHA_ROPE_INTERLEAVED ? 2 * k : k;
                    const int64_t ib = r->style == MHA_ROPE_INTERLEAVED ? 2 * k + 1 : k + half;
                    const double xa = v[ia], xb = v[ib];
                    v[ia] = xa * co - xb * si;
                    v[ib] = xa * si + xb * co;
                }
            }
}

/* [B, L, heads, d] <-> [B, heads, L, d]. */
static void
to_bhld(const double *x, double *y, int64_t B, int64_t L, int64_t Hh, int64_t d, int back) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < L; t++)
            for (int64_t h = 0; h < Hh; h++)
                for (int64_t e = 0; e < d; e++) {
                    const int64_t a = ((b * L + t) * Hh + h) * d + e;
                    const int64_t c = ((b * Hh + h) * L + t) * d + e;
                    if (back)
                        y[a] = x[c];
                    else
                        y[c] = x[a];
                }
}

typedef struct fwd_bufs {
    double *qp, *kp, *vp, *q, *k, *v, *o, *a;
} fwd_bufs;

static void bufs_free(fwd_bufs *f) {
    free(f->qp), free(f->kp), free(f->vp), free(f->q), free(f->k), free(f->v), free(f->o),
        free(f->a);
}

static int layer_fwd(const mha_config *cfg,
                     const og_weights *w,
                     int64_t B,
                     int64_t n,
                     int64_t m,
                     const double *xq,
                     const double *xk,
                     const double *xv,
                     const int64_t *qpos,
                     const int64_t *kpos,
                     const mha_masking *mask,
                     const mha_dropout *dropout,
                     fwd_bufs *f,
                     og_core *core,
                     double *y) {
    const int64_t H = cfg->num_heads, G = cfg->num_kv_heads, dk = cfg->head_dim;
    const int64_t dv = cfg->v_head_dim;
    memset(f, 0, sizeof *f);
    f->qp = malloc(sizeof(double) * (size_t)(B * n * H * dk));
    f->kp = malloc(sizeof(double) * (size_t)(B * m * G * dk));
    f->vp = malloc(sizeof(double) * (size_t)(B * m * G * dv));
    f->q = malloc(sizeof(double) * (size_t)(B * n * H * dk));
    f->k = malloc(sizeof(double) * (size_t)(B * m * G * dk));
    f->v = malloc(sizeof(double) * (size_t)(B * m * G * dv));
    f->o = malloc(sizeof(double) * (size_t)(B * n * H * dv));
    f->a = malloc(sizeof(double) * (size_t)(B * n * H * dv));
    if (!f->qp || !f->kp || !f->vp || !f->q || !f->k || !f->v || !f->o || !f->a)
        return -1;
    lin(xq, w->w_q, w->b_q, f->qp, B * n, cfg->q_dim, H * dk);
    lin(xk, w->w_k, w->b_k, f->kp, B * m, cfg->k_dim, G * dk);
    lin(xv, w->w_v, w->b_v, f->vp, B * m, cfg->v_dim, G * dv);
    rope(&cfg->rope, dk, f->qp, B, n, H, qpos, 1);
    rope(&cfg->rope, dk, f->kp, B, m, G, kpos, 1);
    to_bhld(f->qp, f->q, B, n, H, dk, 0);
    to_bhld(f->kp, f->k, B, m, G, dk, 0);
    to_bhld(f->vp, f->v, B, m, G, dv, 0);
    memset(core, 0, sizeof *core);
    core->B = B, core->H = H, core->G = G, core->n = n, core->m = m, core->dk = dk, core->dv = dv;
    core->scale = cfg->scale, core->softcap = cfg->softcap, core->alibi = cfg->alibi;
    core->sinks = w->sinks, core->q = f->q, core->k = f->k, core->v = f->v;
    core->mask = *mask;
    if (dropout)
        core->dropout = *dropout;
    og_core_forward(core, f->o, NULL);
    to_bhld(f->o, f->a, B, n, H, dv, 1);
    if (y)
        lin(f->a, w->w_o, w->b_o, y, B * n, H * dv, cfg->out_dim);
    return 0;
}

int og_layer_forward(const mha_config *cfg,
                     const og_weights *w,
                     int64_t B,
                     int64_t n,
                     int64_t m,
                     const double *x_query,
                     const double *x_key,
                     const double *x_value,
                     const int64_t *q_pos,
                     const int64_t *k_pos,
                     const mha_masking *mask,
                     const mha_dropout *dropout,
                     double *y) {
    const int self = x_key == NULL;
    const double *xk = self ? x_query : x_key;
    const double *xv = self ? x_query : (x_value ? x_value : x_key);
    const int64_t *kp = k_pos ? k_pos : (self ? q_pos : NULL);
    fwd_bufs f;
    og_core core;
    int rc = layer_fwd(cfg, w, B, n, self ? n : m, x_query, xk, xv, q_pos, kp, mask, dropout, &f,
                       &core, y);
    bufs_free(&f);
    return rc;
}

static double *zeros(int64_t count) {
    return calloc((size_t)(count > 0 ? count : 1), sizeof(double));
}

int og_layer_backward(const mha_config *cfg,
                      const og_weights *w,
                      int64_t B,
                      int64_t n,
                      int64_t m,
                      const double *x_query,
                      const double *x_key,
                      const double *x_value,
                      const int64_t *q_pos,
                      const int64_t *k_pos,
                      const mha_masking *mask,
                      const mha_dropout *dropout,
                      const double *dy,
                      const og_layer_grads *g) {
    const int self = x_key == NULL;
    if (self)
        m = n;
    const double *xk = self ? x_query : x_key;
    const double *xv = self ? x_query : (x_value ? x_value : x_key);
    const int64_t *kp = k_pos ? k_pos : (self ? q_pos : NULL);
    const int64_t H = cfg->num_heads, G = cfg->num_kv_heads, dk = cfg->head_dim;
    const int64_t dv = cfg->v_head_dim, od = cfg->out_dim;
    const int64_t qd = cfg->q_dim, kd = cfg->k_dim, vd = cfg->v_dim;
    fwd_bufs f;
    og_core core;
    int rc = layer_fwd(cfg, w, B, n, m, x_query, xk, xv, q_pos, kp, mask, dropout, &f, &core, NULL);
    double *dA = zeros(B * n * H * dv), *dO = zeros(B * n * H * dv);
    double *dq = zeros(B * n * H * dk), *dk_ = zeros(B * m * G * dk), *dv_ = zeros(B * m * G * dv);
    double *dqp = zeros(B * n * H * dk), *dkp = zeros(B * m * G * dk), *dvp = zeros(B * m * G * dv);
    double *dxq = zeros(B * n * qd), *dxk = zeros(B * m * kd), *dxv = zeros(B * m * vd);
    if (rc || !dA || !dO || !dq || !dk_ || !dv_ || !dqp || !dkp || !dvp || !dxq || !dxk || !dxv) {
        rc = -1;
        goto done;
    }
    double *zero_targets[] = {g->dw_q, g->dw_k, g->dw_v, g->dw_o,   g->db_q,
                              g->db_k, g->db_v, g->db_o, g->d_sinks};
    const int64_t zero_counts[] = {
        H * dk * qd, G * dk * kd, G * dv * vd, od * H * dv, H * dk, G * dk, G * dv, od, H};
    for (int i = 0; i < 9; i++)
        if (zero_targets[i])
            memset(zero_targets[i], 0, sizeof(double) * (size_t)zero_counts[i]);
    /* y = A W_o^T + b_o */
    lin_back(f.a, w->w_o, dy, B * n, H * dv, od, dA, g->dw_o, g->db_o);
    to_bhld(dA, dO, B, n, H, dv, 0);
    og_core_backward(&core, dO, NULL, NULL, dq, dk_, dv_, g->d_sinks);
    to_bhld(dq, dqp, B, n, H, dk, 1);
    to_bhld(dk_, dkp, B, m, G, dk, 1);
    to_bhld(dv_, dvp, B, m, G, dv, 1);
    rope(&cfg->rope, dk, dqp, B, n, H, q_pos, -1);
    rope(&cfg->rope, dk, dkp, B, m, G, kp, -1);
    lin_back(x_query, w->w_q, dqp, B * n, qd, H * dk, dxq, g->dw_q, g->db_q);
    lin_back(xk, w->w_k, dkp, B * m, kd, G * dk, dxk, g->dw_k, g->db_k);
    lin_back(xv, w->w_v, dvp, B * m, vd, G * dv, dxv, g->dw_v, g->db_v);
    if (self) {
        if (g->d_query)
            for (int64_t i = 0; i < B * n * qd; i++)
                g->d_query[i] = dxq[i] + dxk[i] + dxv[i];
    } else {
        if (g->d_query)
            memcpy(g->d_query, dxq, sizeof(double) * (size_t)(B * n * qd));
        if (!x_value) {
            if (g->d_key)
                for (int64_t i = 0; i < B * m * kd; i++)
                    g->d_key[i] = dxk[i] + dxv[i];
        } else {
            if (g->d_key)
                memcpy(g->d_key, dxk, sizeof(double) * (size_t)(B * m * kd));
            if (g->d_value)
                memcpy(g->d_value, dxv, sizeof(double) * (size_t)(B * m * vd));
        }
    }
done:
    bufs_free(&f);
    free(dA), free(dO), free(dq), free(dk_), free(dv_), free(dqp), free(dkp), free(dvp);
    free(dxq), free(dxk), free(dxv);
    return rc;
}
