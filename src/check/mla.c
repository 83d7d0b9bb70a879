/* SPDX-License-Identifier: MIT */
/* mla.c: the argument checks of the multi-head latent attention calls (mha_mla_*): the config
 * resolved (defaults filled in, rope resolved on the qk_rope_head_dim rotary dimensions), the
 * weights the config uses present and finite, the forward's, the backward's and the decode step's
 * sizes, and the aliasing rule of each. */
#include "check/check.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* A size field in [lo, MHA_MAX_DIM]. */
static mha_status size_in(const char *name, int64_t v, int64_t lo, mha_error *err) {
    MHA_RETURN_IF(v < lo || v > MHA_MAX_DIM, err, INVALID_ARG,
                  "config.%s=%lld must be in [%lld, 2^31]", name, (long long)v, (long long)lo);
    return MHA_STATUS_OK;
}

static mha_status check_sizes(const mha_mla_config *c, mha_error *err) {
    MHA_TRY(size_in("hidden", c->hidden, 1, err));
    MHA_TRY(size_in("num_heads", c->num_heads, 1, err));
    MHA_TRY(size_in("q_lora_rank", c->q_lora_rank, 0, err));
    MHA_TRY(size_in("kv_lora_rank", c->kv_lora_rank, 1, err));
    MHA_TRY(size_in("qk_nope_head_dim", c->qk_nope_head_dim, 1, err));
    MHA_TRY(size_in("qk_rope_head_dim", c->qk_rope_head_dim, 2, err));
    MHA_TRY(size_in("v_head_dim", c->v_head_dim, 1, err));
    MHA_RETURN_IF(c->qk_rope_head_dim % 2 != 0, err, INVALID_ARG,
                  "config.qk_rope_head_dim=%lld must be even (RoPE rotates pairs)",
                  (long long)c->qk_rope_head_dim);
    /* Every weight's element count must fit: the largest are W_q / W_qb [h dq, .], W_kvb
     * [h (dn + dv), r], W_o [hidden, h dv]. */
    const int64_t dq = c->qk_nope_head_dim + c->qk_rope_head_dim;
    const int64_t in_q = c->q_lora_rank ? c->q_lora_rank : c->hidden;
    const int64_t f[][3] = {{c->num_heads, dq, in_q},
                            {c->num_heads, c->qk_nope_head_dim + c->v_head_dim, c->kv_lora_rank},
                            {c->num_heads, c->v_head_dim, c->hidden},
                            {c->kv_lora_rank + c->qk_rope_head_dim, c->hidden, 1},
                            {c->num_heads, c->kv_lora_rank + c->qk_rope_head_dim, 1}};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        int64_t n;
        MHA_RETURN_IF(!mha__prod_i64(f[i], 3, &n) || n > ((int64_t)1 << 40), err, OVERFLOW,
                      "config: a weight of %lld x %lld x %lld elements is too large",
                      (long long)f[i][0], (long long)f[i][1], (long long)f[i][2]);
    }
    return MHA_STATUS_OK;
}

static mha_status check_scalars(const mha_mla_config *c, mha_mla_config *r, mha_error *err) {
    const double s = fabs(c->scale);
    MHA_RETURN_IF(c->scale != 0.0 && !(s >= (double)FLT_MIN && s <= (double)FLT_MAX), err,
                  INVALID_ARG,
                  "config.scale=%g must be 0 (1/sqrt(qk_nope_head_dim + qk_rope_head_dim)) or "
                  "have |scale| in [FLT_MIN, FLT_MAX]",
                  c->scale);
    MHA_RETURN_IF(!(c->rms_eps >= 0.0 && c->rms_eps <= 1.0), err, INVALID_ARG,
                  "config.rms_eps=%g must be in [0, 1] (0 = 1e-6)", c->rms_eps);
    const double dq = (double)(c->qk_nope_head_dim + c->qk_rope_head_dim);
    r->scale = c->scale != 0.0 ? c->scale : 1.0 / sqrt(dq);
    r->rms_eps = c->rms_eps != 0.0 ? c->rms_eps : 1e-6;
    MHA_RETURN_IF(c->rope.style == MHA_ROPE_NONE, err, INVALID_ARG,
                  "config.rope.style is NONE: MLA rotates q_pe and k_pe (INTERLEAVED or HALF)");
    MHA_RETURN_IF(c->rope.rotary_dim != 0 && c->rope.rotary_dim != c->qk_rope_head_dim, err,
                  INVALID_ARG, "config.rope.rotary_dim=%lld must be 0 or qk_rope_head_dim=%lld",
                  (long long)c->rope.rotary_dim, (long long)c->qk_rope_head_dim);
    return mha__check_rope(&c->rope, c->qk_rope_head_dim, &r->rope, err);
}

/* One weight: present exactly when used, finite. */
static mha_status
check_weight(const char *name, const float *w, int used, int64_t n, mha_error *err) {
    if (!used)
        return MHA_STATUS_OK;
    MHA_RETURN_IF(!w, err, INVALID_ARG, "weights.%s is NULL but the config uses it", name);
    for (int64_t i = 0; i < n; i++)
        MHA_RETURN_IF(!isfinite(w[i]), err, INVALID_ARG,
                      "weights.%s[%lld] is %g: weights must be finite", name, (long long)i,
                      (double)w[i]);
    return MHA_STATUS_OK;
}

mha_status mha__check_mla_create(const mha_mla_config *config,
                                 const mha_mla_weights *w,
                                 mha_mla_config *cfg,
                                 mha_error *err) {
    MHA_RETURN_IF(!config || !w, err, INVALID_ARG, "mha_mla_create: config or weights is NULL");
    MHA_TRY(check_sizes(config, err));
    *cfg = *config;
    cfg->bias = config->bias != 0;
    MHA_TRY(check_scalars(config, cfg, err));
    const mha_mla_config *c = cfg;
    const int64_t h = c->num_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim;
    const int64_t dq = dn + dr, r = c->kv_lora_rank, rq = c->q_lora_rank, E = c->hidden;
    const int lq = rq > 0, b = c->bias;
    MHA_TRY(check_weight("w_q", w->w_q, !lq, h * dq * E, err));
    MHA_TRY(check_weight("w_q_a", w->w_q_a, lq, rq * E, err));
    MHA_TRY(check_weight("b_q_a", w->b_q_a, lq && b, rq, err));
    MHA_TRY(check_weight("q_a_norm", w->q_a_norm, lq, rq, err));
    MHA_TRY(check_weight("w_q_b", w->w_q_b, lq, h * dq * rq, err));
    MHA_TRY(check_weight("w_kv_a", w->w_kv_a, 1, (r + dr) * E, err));
    MHA_TRY(check_weight("b_kv_a", w->b_kv_a, b, r + dr, err));
    MHA_TRY(check_weight("kv_a_norm", w->kv_a_norm, 1, r, err));
    MHA_TRY(check_weight("w_kv_b", w->w_kv_b, 1, h * (dn + c->v_head_dim) * r, err));
    MHA_TRY(check_weight("w_o", w->w_o, 1, E * h * c->v_head_dim, err));
    MHA_TRY(check_weight("b_o", w->b_o, b, E, err));
    return MHA_STATUS_OK;
}

/* The layer's weights (those the config uses) as spans named "the layer's <name>"; the
 * gradient of each (g, may be NULL) as spans named "grads.<name>" into gs, and whether the config
 * has each weight into has (each may be NULL). Returns their count. */
enum { MLA_WEIGHTS = 11 };
static int mla_weight_spans(const mha_mla_config *c,
                            const mha_mla_weights *w,
                            const mha_mla_grads *g,
                            mha__span *ws,
                            mha__span *gs,
                            int *has) {
    const int lq = c->q_lora_rank > 0, b = c->bias;
    const int64_t h = c->num_heads, E = c->hidden, r = c->kv_lora_rank, rq = c->q_lora_rank;
    const int64_t dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dv = c->v_head_dim;
    const int64_t dq = dn + dr;
    /* Each weight's element count (bounded at creation, below 2^40). */
    const struct {
        const char *wname, *gname;
        const float *weight, *grad;
        int has;
        int64_t n;
    } f[MLA_WEIGHTS] = {
        {"the layer's w_q", "grads.w_q", w->w_q, g ? g->w_q : NULL, !lq, h * dq * E},
        {"the layer's w_q_a", "grads.w_q_a", w->w_q_a, g ? g->w_q_a : NULL, lq, rq * E},
        {"the layer's b_q_a", "grads.b_q_a", w->b_q_a, g ? g->b_q_a : NULL, lq && b, rq},
        {"the layer's q_a_norm", "grads.q_a_norm", w->q_a_norm, g ? g->q_a_norm : NULL, lq, rq},
        {"the layer's w_q_b", "grads.w_q_b", w->w_q_b, g ? g->w_q_b : NULL, lq, h * dq * rq},
        {"the layer's w_kv_a", "grads.w_kv_a", w->w_kv_a, g ? g->w_kv_a : NULL, 1, (r + dr) * E},
        {"the layer's b_kv_a", "grads.b_kv_a", w->b_kv_a, g ? g->b_kv_a : NULL, b, r + dr},
        {"the layer's kv_a_norm", "grads.kv_a_norm", w->kv_a_norm, g ? g->kv_a_norm : NULL, 1, r},
        {"the layer's w_kv_b", "grads.w_kv_b", w->w_kv_b, g ? g->w_kv_b : NULL, 1,
         h * (dn + dv) * r},
        {"the layer's w_o", "grads.w_o", w->w_o, g ? g->w_o : NULL, 1, E * h * dv},
        {"the layer's b_o", "grads.b_o", w->b_o, g ? g->b_o : NULL, b, E}};
    for (int i = 0; i < MLA_WEIGHTS; i++) {
        ws[i] = mha__span_of(f[i].wname, f[i].has ? f[i].weight : NULL, f[i].n, sizeof(float));
        if (gs)
            gs[i] = mha__span_of(f[i].gname, f[i].grad, f[i].n, sizeof(float));
        if (has)
            has[i] = f[i].has;
    }
    return MLA_WEIGHTS;
}

/* Positions in [0, MHA_MAX_POSITION]. */
static mha_status check_positions(const int64_t *pos, int64_t n, mha_error *err) {
    for (int64_t i = 0; pos && i < n; i++)
        MHA_RETURN_IF(pos[i] < 0 || pos[i] > MHA_MAX_POSITION, err, INVALID_ARG,
                      "args.positions[%lld]=%lld is outside [0, 2^31]", (long long)i,
                      (long long)pos[i]);
    return MHA_STATUS_OK;
}

mha_status mha__check_mla_forward(const mha_mla_config *c,
                                  const mha_mla_weights *w,
                                  const mha_mla_forward_args *a,
                                  mha_error *err) {
    MHA_RETURN_IF(!a, err, INVALID_ARG, "mha_mla_forward: args is NULL");
    MHA_RETURN_IF(a->batch < 1 || a->batch > MHA_MAX_DIM || a->seq_len < 1 ||
                      a->seq_len > MHA_MAX_DIM,
                  err, INVALID_ARG, "args.batch=%lld and args.seq_len=%lld must be in [1, 2^31]",
                  (long long)a->batch, (long long)a->seq_len);
    MHA_RETURN_IF(!a->x || !a->out, err, INVALID_ARG, "args.x or args.out is NULL");
    const int64_t n = mha__count3(a->batch, a->seq_len, c->hidden);
    MHA_RETURN_IF(n == 0 || n > ((int64_t)1 << 40), err, OVERFLOW,
                  "args: batch x seq_len x hidden is too large");
    MHA_TRY(check_positions(a->positions, a->batch * a->seq_len, err));
    const mha__span outs[] = {mha__span_of("args.out", a->out, n, sizeof(float))};
    mha__span ins[2 + MLA_WEIGHTS];
    int n_in = 0;
    ins[n_in++] = mha__span_of("args.x", a->x, n, sizeof(float));
    ins[n_in++] = mha__span_of("args.positions", a->positions,
                               a->positions ? a->batch * a->seq_len : 0, sizeof(int64_t));
    if (w) /* the output projection reads w_o while it writes out */
        n_in += mla_weight_spans(c, w, NULL, ins + n_in, NULL, NULL);
    return mha__check_no_overlap(outs, 1, ins, n_in, err);
}

mha_status mha__check_mla_backward(const mha_mla_config *c,
                                   const mha_mla_weights *w,
                                   const mha_mla_forward_args *a,
                                   const mha_mla_grads *g,
                                   mha_error *err) {
    MHA_RETURN_IF(!g || !g->dy, err, INVALID_ARG, "mha_mla_backward: grads or grads.dy is NULL");
    mha__span ins[3 + MLA_WEIGHTS], outs[1 + MLA_WEIGHTS];
    int has[MLA_WEIGHTS];
    mla_weight_spans(c, w, g, ins + 3, outs + 1, has);
    const float *const grad[MLA_WEIGHTS] = {g->w_q,    g->w_q_a,  g->b_q_a,  g->q_a_norm,
                                            g->w_q_b,  g->w_kv_a, g->b_kv_a, g->kv_a_norm,
                                            g->w_kv_b, g->w_o,    g->b_o};
    for (int i = 0; i < MLA_WEIGHTS; i++) /* outs[1 + i].name is "grads.<name>" */
        MHA_RETURN_IF(grad[i] && !has[i], err, INVALID_ARG, "%s is given but the config has no %s",
                      outs[1 + i].name, outs[1 + i].name + 6);
    mha_mla_forward_args probe = *a;
    probe.out = (float *)g->dy; /* dy must not overlap x either; out is not written */
    MHA_TRY(mha__check_mla_forward(c, NULL, &probe, err));
    /* Every gradient against x, positions, dy, the layer's weights and each other: the backward
     * reads x, dy and the weights after it has written some gradients. */
    const int64_t T = a->batch * a->seq_len, E = c->hidden; /* checked by the forward's check */
    ins[0] = mha__span_of("args.x", a->x, T * E, sizeof(float));
    ins[1] = mha__span_of("args.positions", a->positions, a->positions ? T : 0, sizeof(int64_t));
    ins[2] = mha__span_of("grads.dy", g->dy, T * E, sizeof(float));
    outs[0] = mha__span_of("grads.dx", g->dx, T * E, sizeof(float));
    return mha__check_no_overlap(outs, 1 + MLA_WEIGHTS, ins, 3 + MLA_WEIGHTS, err);
}

/* num_seqs in [1, batch], t in [1, max_seq], seq ids distinct and in the cache, room for t more
 * tokens in each. */
static mha_status check_seqs(int64_t batch,
                             const int64_t *len,
                             int64_t max_seq,
                             int64_t num_seqs,
                             const int64_t *ids,
                             int64_t t,
                             mha_error *err) {
    MHA_RETURN_IF(num_seqs < 1 || num_seqs > batch, err, INVALID_ARG,
                  "num_seqs=%lld must be in [1, the cache's batch %lld]", (long long)num_seqs,
                  (long long)batch);
    MHA_RETURN_IF(t < 1 || t > max_seq, err, INVALID_ARG,
                  "num_tokens=%lld must be in [1, max_seq %lld]", (long long)t, (long long)max_seq);
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t s = ids ? ids[i] : i;
        MHA_RETURN_IF(s < 0 || s >= batch, err, INVALID_ARG,
                      "seq_ids[%lld]=%lld is not a sequence of the cache (batch %lld)",
                      (long long)i, (long long)s, (long long)batch);
        for (int64_t j = 0; j < i && ids; j++)
            MHA_RETURN_IF(ids[j] == s, err, INVALID_ARG, "seq_ids lists sequence %lld twice",
                          (long long)s);
        MHA_RETURN_IF(len[s] + t > max_seq, err, INVALID_ARG,
                      "sequence %lld: %lld + %lld tokens exceed the cache's max_seq %lld",
                      (long long)s, (long long)len[s], (long long)t, (long long)max_seq);
    }
    return MHA_STATUS_OK;
}

mha_status mha__check_mla_decode(const mha_mla_config *c,
                                 const mha_mla_weights *w,
                                 int64_t batch,
                                 const int64_t *len,
                                 int64_t max_seq,
                                 const mha_decode_args *a,
                                 mha_error *err) {
    MHA_RETURN_IF(!a, err, INVALID_ARG, "mha_mla_decode_step: args is NULL");
    MHA_TRY(check_seqs(batch, len, max_seq, a->num_seqs, a->seq_ids, a->num_tokens, err));
    MHA_RETURN_IF(!a->x || !a->out, err, INVALID_ARG, "args.x or args.out is NULL");
    MHA_RETURN_IF(a->tree_parents, err, INVALID_ARG,
                  "mha_mla_decode_step: args.tree_parents (draft trees) is not supported for MLA");
    const int64_t n = mha__count3(a->num_seqs, a->num_tokens, c->hidden);
    MHA_RETURN_IF(n == 0 || n > ((int64_t)1 << 40), err, OVERFLOW,
                  "args: num_seqs x num_tokens x hidden is too large");
    const mha__span outs[] = {mha__span_of("args.out", a->out, n, sizeof(float))};
    mha__span ins[2 + MLA_WEIGHTS];
    ins[0] = mha__span_of("args.x", a->x, n, sizeof(float));
    ins[1] = mha__span_of("args.seq_ids", a->seq_ids, a->num_seqs, sizeof(int64_t));
    mla_weight_spans(c, w, NULL, ins + 2, NULL, NULL); /* read while out is written */
    return mha__check_no_overlap(outs, 1, ins, 2 + MLA_WEIGHTS, err);
}

mha_status mha__check_mla_append(int64_t batch,
                                 const int64_t *len,
                                 int64_t max_seq,
                                 int64_t num_seqs,
                                 const int64_t *ids,
                                 int64_t t,
                                 const float *rows,
                                 mha_error *err) {
    MHA_TRY(check_seqs(batch, len, max_seq, num_seqs, ids, t, err));
    MHA_RETURN_IF(!rows, err, INVALID_ARG, "mha_mla_cache_append: rows is NULL");
    return MHA_STATUS_OK;
}
