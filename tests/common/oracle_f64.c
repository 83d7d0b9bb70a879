/* SPDX-License-Identifier: MIT */
/* oracle_f64.c: float64 reference of the attention core and layer, for tests. Deliberately
 * naive: materialises every score, computes every mask rule by its definition. */
#include "oracle_f64.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Dropout's random stream is a definition shared with the library (Philox4x32-10, tested against
 * the published known-answer vectors in test_core.c), not a computation under test. */
int mha__dropout_keep(uint64_t seed, float p, int64_t b, int64_t h, int64_t i, int64_t j);

double oracle_mask_elem(const mha_mask_tensor *t, const int64_t idx[4]) {
    /* NumPy broadcasting: align on the right, size-1 dims repeat. */
    int64_t off = 0, stride = 1;
    for (int d = t->ndim - 1, k = 3; d >= 0; d--, k--) {
        int64_t i = t->shape[d] == 1 ? 0 : idx[k];
        off += i * stride;
        stride *= t->shape[d];
    }
    switch (t->dtype) {
    case MHA_DTYPE_F32:
        return (double)((const float *)t->data)[off];
    case MHA_DTYPE_BOOL:
    case MHA_DTYPE_U8:
        return ((const uint8_t *)t->data)[off];
    case MHA_DTYPE_I32:
        return ((const int32_t *)t->data)[off];
    case MHA_DTYPE_I64:
        return (double)((const int64_t *)t->data)[off];
    default:
        return 0.0;
    }
}

double oracle_elem(mha_dtype dt, const void *base, int64_t off) {
    if (dt == MHA_DTYPE_F32)
        return (double)((const float *)base)[off];
    const uint16_t h = ((const uint16_t *)base)[off];
    if (dt == MHA_DTYPE_BF16) { /* the top half of a float32 */
        const uint32_t u = (uint32_t)h << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return (double)f;
    }
    /* IEEE binary16 by its definition (independent of the library's bit manipulation). */
    const int sign = h >> 15, e = (h >> 10) & 31, f = h & 1023;
    double x;
    if (e == 31)
        x = f ? (double)NAN : (double)INFINITY;
    else
        x = e == 0 ? ldexp((double)f, -24) : ldexp(1.0 + f / 1024.0, e - 15);
    return sign ? -x : x;
}

double oracle_alibi_slope(int64_t H, int64_t h) {
    int64_t c = 1;
    while (c * 2 <= H)
        c *= 2;
    if (h < c)
        return pow(2.0, -8.0 * (double)(h + 1) / (double)c);
    return pow(2.0, -8.0 * (double)(2 * (h - c) + 1) / (double)(2 * c));
}

int oracle_attention(const mha_attention_args *a, double *out, double *lse, double *probs) {
    const int64_t B = a->batch, H = a->num_heads, G = a->num_kv_heads ? a->num_kv_heads : H;
    const int64_t n = a->q_len, m = a->kv_len, dk = a->head_dim;
    const int64_t dv = a->v_head_dim ? a->v_head_dim : dk;
    const mha_masking *mk = &a->mask;
    const double scale = a->scale != 0.0 ? a->scale : 1.0 / sqrt((double)dk);
    double *s = malloc(sizeof(double) * (size_t)m);
    if (!s)
        return -1;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t g = h / (H / G);
            int64_t delta = m - n;
            if (mk->alignment == MHA_ALIGN_TOP_LEFT)
                delta = 0;
            if (mk->alignment == MHA_ALIGN_EXPLICIT)
                delta = mk->align_offsets[b];
            for (int64_t i = 0; i < n; i++) {
                const int64_t q0 = b * a->q_strides[0] + h * a->q_strides[1] + i * a->q_strides[2];
                double mx = -HUGE_VAL;
                int any_nan = 0;
                for (int64_t j = 0; j < m; j++) {
                    const int64_t idx[4] = {b, h, i, j};
                    const int64_t pos = i + delta;
                    int visible = 1;
                    if (mk->causal && j > pos)
                        visible = 0;
                    if (mk->use_window && mk->window_left >= 0 && j < pos - mk->window_left)
                        visible = 0;
                    if (mk->use_window && mk->window_right >= 0 && j > pos + mk->window_right)
                        visible = 0;
                    /* chunk: same chunk of C positions, floor division written in doubles */
                    if (mk->chunk_size > 0 && floor((double)j / (double)mk->chunk_size) !=
                                                  floor((double)pos / (double)mk->chunk_size))
                        visible = 0;
                    if (mk->bool_mask.data) {
                        const int nz = oracle_mask_elem(&mk->bool_mask, idx) != 0.0;
                        if (mk->bool_mask_polarity == MHA_MASK_ATTEND ? !nz : nz)
                            visible = 0;
                    }
                    if (mk->key_padding.data) {
                        const int64_t kidx[4] = {0, 0, b, j}; /* [B, m] right-aligned */
                        if (oracle_mask_elem(&mk->key_padding, kidx) == 0.0)
                            visible = 0;
                    }
                    if (mk->q_segment_ids &&
                        mk->q_segment_ids[b * n + i] != mk->kv_segment_ids[b * m + j])
                        visible = 0;
                    if (!visible) {
                        s[j] = -HUGE_VAL;
                        continue;
                    }
                    const int64_t k0 =
                        b * a->k_strides[0] + g * a->k_strides[1] + j * a->k_strides[2];
                    double dot = 0.0;
                    for (int64_t d = 0; d < dk; d++)
                        dot += oracle_elem(a->q_dtype, a->q, q0 + d) *
                               oracle_elem(a->k_dtype, a->k, k0 + d);
                    double sj = scale * dot;
                    if (a->softcap > 0.0)
                        sj = a->softcap * tanh(sj / a->softcap);
                    if (mk->additive_mask.data)
                        sj += oracle_mask_elem(&mk->additive_mask, idx);
                    if (a->alibi)
                        sj -= oracle_alibi_slope(H, h) * fabs((double)(i + delta - j));
                    s[j] = sj;
                    any_nan |= isnan(sj);
                    if (sj > mx)
                        mx = sj;
                }
                const double sink = a->sinks ? (double)a->sinks[h] : -HUGE_VAL;
                double *o = out + ((b * H + h) * n + i) * dv;
                double *prow = probs ? probs + ((b * H + h) * n + i) * m : NULL;
                if (mx == -HUGE_VAL && !any_nan && !isnan(sink)) {
                    memset(o, 0, sizeof(double) * (size_t)dv);
                    if (prow)
                        memset(prow, 0, sizeof(double) * (size_t)m);
                    if (lse)
                        lse[(b * H + h) * n + i] = -HUGE_VAL;
                    continue;
                }
                if (sink > mx)
                    mx = sink;
                double sum = a->sinks ? exp(sink - mx) : 0.0;
                for (int64_t j = 0; j < m; j++)
                    sum += exp(s[j] - mx);
                if (lse)
                    lse[(b * H + h) * n + i] = mx + log(sum);
                for (int64_t d = 0; d < dv; d++)
                    o[d] = 0.0;
                const int drop = a->dropout.training && a->dropout.p > 0.0f;
                for (int64_t j = 0; j < m; j++) {
                    const double p = exp(s[j] - mx) / sum;
                    if (prow)
                        prow[j] = p;
                    double pd = p;
                    if (drop)
                        pd = mha__dropout_keep(a->dropout.seed, a->dropout.p, b, h,
                                               i + a->dropout.row_offset, j + a->dropout.col_offset)
                                 ? p / (1.0 - (double)a->dropout.p)
                                 : 0.0;
                    if (pd == 0.0)
                        continue;
                    const int64_t v0 =
                        b * a->v_strides[0] + g * a->v_strides[1] + j * a->v_strides[2];
                    for (int64_t d = 0; d < dv; d++)
                        o[d] += pd * oracle_elem(a->v_dtype, a->v, v0 + d);
                }
            }
        }
    free(s);
    return 0;
}

/* y[r, o] = sum_c x[r, c] W[o, c] + b[o], in double. */
static void project(const double *x,
                    const float *w,
                    const float *bias,
                    double *y,
                    int64_t rows,
                    int64_t in,
                    int64_t out) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < out; o++) {
            double acc = bias ? (double)bias[o] : 0.0;
            for (int64_t c = 0; c < in; c++)
                acc += x[r * in + c] * (double)w[o * in + c];
            y[r * out + o] = acc;
        }
}

static void rope(const mha_rope *r,
                 int64_t head_dim,
                 double *x,
                 int64_t B,
                 int64_t L,
                 int64_t heads,
                 const int64_t *pos) {
    const double theta = r->theta != 0.0 ? r->theta : 10000.0;
    const int64_t R = r->rotary_dim ? r->rotary_dim : head_dim, half = R / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < L; t++)
            for (int64_t hh = 0; hh < heads; hh++) {
                double *v = x + ((b * L + t) * heads + hh) * head_dim;
                const double p = (double)(pos ? pos[b * L + t] : t);
                for (int64_t k = 0; k < half; k++) {
                    const double ang = p * pow(theta, -2.0 * (double)k / (double)R);
                    const int64_t ia = r->style == MHA_ROPE_INTERLEAVED ? 2 * k : k;
                    const int64_t ib = r->style == MHA_ROPE_INTERLEAVED ? 2 * k + 1 : k + half;
                    const double xa = v[ia], xb = v[ib];
                    v[ia] = xa * cos(ang) - xb * sin(ang);
                    v[ib] = xa * sin(ang) + xb * cos(ang);
                }
            }
}

static double *to_double(const float *x, int64_t count) {
    double *d = malloc(sizeof(double) * (size_t)count);
    if (d)
        for (int64_t i = 0; i < count; i++)
            d[i] = (double)x[i];
    return d;
}

/* QK-norm (docs/SEMANTICS.md) of x [rows, heads * d] in double: groups of d (per head) or
 * heads * d (RMS_ALL), y = x / sqrt(mean(x^2) + eps) * s, s = w, 1 + w or 1. */
static void
qk_norm(const mha_qk_norm *nrm, const float *w, double *x, int64_t rows, int64_t heads, int64_t d) {
    const int64_t G = nrm->kind == MHA_QK_NORM_RMS_ALL ? heads * d : d;
    for (int64_t i = 0; i < rows * heads * d / G; i++) {
        double ss = 0.0, *xg = x + i * G;
        for (int64_t j = 0; j < G; j++)
            ss += xg[j] * xg[j];
        const double r = 1.0 / sqrt(ss / (double)G + nrm->eps);
        for (int64_t j = 0; j < G; j++)
            xg[j] *= r * (w ? (nrm->unit_offset ? 1.0 : 0.0) + (double)w[j] : 1.0);
    }
}

double oracle_temperature(const mha_temperature_tuning *t, int64_t p) {
    /* docs/SEMANTICS.md: the sum, quotient and floor in float32 (transformers' positions.float()),
     * ln(k + 1) attn_scale + 1 in double, not rounded. */
    const float k = floorf(((float)p + 1.0f) / (float)t->floor_scale);
    return log((double)k + 1.0) * t->attn_scale + 1.0;
}

/* x rounded to dt (nearest even; subnormals, overflow to inf), from double: x / ulp is exact
 * (ulp a power of two), so nearbyint's nearest-even rounding is the storage's. F32: to float. */
static double round_to(mha_dtype dt, double x) {
    if (dt == MHA_DTYPE_F32)
        return (double)(float)x;
    if (!isfinite(x) || x == 0.0)
        return x;
    const int p = dt == MHA_DTYPE_BF16 ? 8 : 11, emin = dt == MHA_DTYPE_BF16 ? -126 : -14;
    const double max = dt == MHA_DTYPE_BF16 ? 0x1.fep127 : 65504.0;
    int e;
    frexp(x, &e); /* |x| in [2^(e-1), 2^e) */
    const int lead = e - 1 < emin ? emin : e - 1;
    const double ulp = ldexp(1.0, lead - (p - 1)), r = nearbyint(x / ulp) * ulp;
    return fabs(r) > max ? copysign((double)INFINITY, r) : r;
}

static void round_all(mha_dtype dt, double *x, int64_t count) {
    for (int64_t i = 0; dt != MHA_DTYPE_F32 && i < count; i++)
        x[i] = round_to(dt, x[i]);
}

int oracle_layer(const mha_config *cfg,
                 const mha_weights *w,
                 const mha_forward_args *a,
                 double *out,
                 double *probs) {
    return oracle_layer_dt(cfg, w, a, MHA_DTYPE_F32, out, probs);
}

int oracle_layer_dt(const mha_config *cfg,
                    const mha_weights *w,
                    const mha_forward_args *a,
                    mha_dtype act,
                    double *out,
                    double *probs) {
    if (cfg->rope.scaling != MHA_ROPE_SCALING_NONE)
        return -1;
    const int self = a->key == NULL;
    const int64_t B = a->batch, n = a->q_len, m = self ? n : a->kv_len;
    const int64_t qd = cfg->q_dim, kd = cfg->k_dim ? cfg->k_dim : qd;
    const int64_t vd = cfg->v_dim ? cfg->v_dim : kd;
    const int64_t H = cfg->num_heads, G = cfg->num_kv_heads ? cfg->num_kv_heads : H;
    const int64_t dk = cfg->head_dim ? cfg->head_dim : qd / H;
    const int64_t dv = cfg->v_head_dim ? cfg->v_head_dim : dk;
    const int64_t od = cfg->out_dim ? cfg->out_dim : qd;
    const float *xkf = self ? a->query : a->key;
    const float *xvf = self ? a->query : (a->value ? a->value : a->key);
    double *xq = to_double(a->query, B * n * qd), *xk = to_double(xkf, B * m * kd);
    double *xv = to_double(xvf, B * m * vd);
    double *q = malloc(sizeof(double) * (size_t)(B * n * H * dk));
    double *k = malloc(sizeof(double) * (size_t)(B * m * G * dk));
    double *v = malloc(sizeof(double) * (size_t)(B * m * G * dv));
    double *att = malloc(sizeof(double) * (size_t)(B * H * n * dv));
    double *cat = malloc(sizeof(double) * (size_t)(B * n * H * dv));
    float *qf = malloc(sizeof(float) * (size_t)(B * n * H * dk));
    float *kf = malloc(sizeof(float) * (size_t)(B * m * G * dk));
    float *vf = malloc(sizeof(float) * (size_t)(B * m * G * dv));
    int rc = -1;
    if (!xq || !xk || !xv || !q || !k || !v || !att || !cat || !qf || !kf || !vf)
        goto done;
    project(xq, w->w_q, w->b_q, q, B * n, qd, H * dk);
    project(xk, w->w_k, w->b_k, k, B * m, kd, G * dk);
    project(xv, w->w_v, w->b_v, v, B * m, vd, G * dv);
    /* Half intermediates (act): each step's result rounded to act (Q', K', V; after the RMS norm,
     * RoPE, the L2 norm, temperature; G, A, A sigmoid(G)), the next step on the rounded ones. */
    round_all(act, q, B * n * H * dk);
    round_all(act, k, B * m * G * dk);
    round_all(act, v, B * m * G * dv);
    const mha_qk_norm_kind nk = cfg->qk_norm.kind;
    if (nk == MHA_QK_NORM_RMS_HEAD || nk == MHA_QK_NORM_RMS_ALL) {
        qk_norm(&cfg->qk_norm, w->q_norm, q, B * n, H, dk);
        qk_norm(&cfg->qk_norm, w->k_norm, k, B * m, G, dk);
        round_all(act, q, B * n * H * dk);
        round_all(act, k, B * m * G * dk);
    }
    if (cfg->rope.style != MHA_ROPE_NONE) {
        const int64_t *kpos = a->k_positions ? a->k_positions : (self ? a->q_positions : NULL);
        rope(&cfg->rope, dk, q, B, n, H, a->q_positions);
        rope(&cfg->rope, dk, k, B, m, G, kpos);
        round_all(act, q, B * n * H * dk);
        round_all(act, k, B * m * G * dk);
    }
    if (nk == MHA_QK_NORM_L2_AFTER_ROPE) {
        qk_norm(&cfg->qk_norm, NULL, q, B * n, H, dk);
        qk_norm(&cfg->qk_norm, NULL, k, B * m, G, dk);
        round_all(act, q, B * n * H * dk);
        round_all(act, k, B * m * G * dk);
    }
    if (cfg->temperature.enabled) /* each query row times tau(its position), in double */
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < n; i++) {
                const int64_t p = a->q_positions ? a->q_positions[b * n + i] : i;
                const double tau = oracle_temperature(&cfg->temperature, p);
                for (int64_t e = 0; e < H * dk; e++)
                    q[(b * n + i) * H * dk + e] *= tau;
            }
    round_all(act, q, B * n * H * dk); /* Q after its last stage (all roundings idempotent) */
    /* The core oracle takes float inputs, so Q, K, V are rounded once to float here. That adds
     * a relative error of 2^-24 to each, two orders of magnitude below the 1e-5 gate this layer
     * oracle is used with (tolerance.h); the PyTorch goldens check the layer in pure float64. */
    for (int64_t i = 0; i < B * n * H * dk; i++)
        qf[i] = (float)q[i];
    for (int64_t i = 0; i < B * m * G * dk; i++)
        kf[i] = (float)k[i];
    for (int64_t i = 0; i < B * m * G * dv; i++)
        vf[i] = (float)v[i];
    mha_attention_args c;
    memset(&c, 0, sizeof c);
    c.batch = B, c.num_heads = H, c.num_kv_heads = G, c.q_len = n, c.kv_len = m;
    c.head_dim = dk, c.v_head_dim = dv, c.scale = cfg->scale, c.softcap = cfg->softcap;
    c.alibi = cfg->alibi, c.sinks = w->sinks;
    c.q = qf, c.q_strides[0] = n * H * dk, c.q_strides[1] = dk, c.q_strides[2] = H * dk;
    c.k = kf, c.k_strides[0] = m * G * dk, c.k_strides[1] = dk, c.k_strides[2] = G * dk;
    c.v = vf, c.v_strides[0] = m * G * dv, c.v_strides[1] = dv, c.v_strides[2] = G * dv;
    c.mask = a->mask;
    c.dropout = a->dropout;
    if (oracle_attention(&c, att, NULL, probs) != 0)
        goto done;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < n; i++)
                for (int64_t d = 0; d < dv; d++)
                    cat[((b * n + i) * H + h) * dv + d] = att[((b * H + h) * n + i) * dv + d];
    if (cfg->output_gate) { /* cat *= sigmoid(x_q W_gate^T + b_gate), W_gate = w_q's 2nd half */
        double *gate = malloc(sizeof(double) * (size_t)(B * n * H * dk));
        if (!gate)
            goto done;
        const float *wq = w->w_q, *bq = w->b_q;
        project(xq, wq + H * dk * qd, bq ? bq + H * dk : NULL, gate, B * n, qd, H * dk);
        round_all(act, gate, B * n * H * dk); /* G and A stored in act, then A sigmoid(G) */
        round_all(act, cat, B * n * H * dv);
        for (int64_t i = 0; i < B * n * H * dv; i++)
            cat[i] *= 1.0 / (1.0 + exp(-gate[i]));
        free(gate);
    }
    round_all(act, cat, B * n * H * dv);
    project(cat, w->w_o, w->b_o, out, B * n, H * dv, od);
    rc = 0;
done:
    free(xq), free(xk), free(xv), free(q), free(k), free(v), free(att), free(cat);
    free(qf), free(kf), free(vf);
    return rc;
}
