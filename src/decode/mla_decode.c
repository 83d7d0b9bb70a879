/* SPDX-License-Identifier: MIT */
/* mla_decode.c: multi-head latent attention through its compressed cache (mha_mla_cache,
 * mha_mla_decode_step). The cache holds per token only [c, k_pe] (kv_lora_rank + qk_rope_head_dim
 * values); the step absorbs W_uk into the query and W_uv after the attention, so that the
 * attention itself is MQA over the cache rows with d_k = r + dr and d_v = r, the values being the
 * first r columns of the keys (the same rows, read once): the attention core runs it with the h
 * heads of the one kv group as the rows of its query blocks. mha.h has the formulas. */
#include "layer/mla.h"

#include "check/check.h"
#include "kernels/gemm.h"

#include <string.h>

struct mha_mla_cache {
    int64_t batch, max_seq, width; /* width = r + dr values per token */
    mha_dtype dtype;
    void *data;   /* [batch, max_seq, width] of dtype */
    int64_t *len; /* [batch] */
    mha_allocator allocator;
    int has_allocator;
};

mha_status mha_mla_cache_create(const mha_mla *mla,
                                int64_t batch,
                                int64_t max_seq,
                                mha_dtype dtype,
                                const mha_allocator *allocator,
                                mha_mla_cache **out,
                                mha_error *err) {
    MHA_RETURN_IF(!out || !mla, err, INVALID_ARG, "mha_mla_cache_create: mla or out is NULL");
    *out = NULL;
    MHA_RETURN_IF(batch < 1 || batch > MHA_MAX_DIM || max_seq < 1 || max_seq > MHA_MAX_DIM, err,
                  INVALID_ARG,
                  "mha_mla_cache_create: batch=%lld and max_seq=%lld must be in [1, "
                  "2^31]",
                  (long long)batch, (long long)max_seq);
    MHA_RETURN_IF(dtype != MHA_DTYPE_F32 && dtype != MHA_DTYPE_F16 && dtype != MHA_DTYPE_BF16, err,
                  INVALID_ARG, "mha_mla_cache_create: dtype %d is not F32, F16 or BF16",
                  (int)dtype);
    const int64_t width = mla->cfg.kv_lora_rank + mla->cfg.qk_rope_head_dim;
    const int64_t f[3] = {batch, max_seq, width};
    int64_t n;
    size_t bytes;
    MHA_RETURN_IF(!mha__prod_i64(f, 3, &n) || !mha__bytes(n, mha__storage_size(dtype), &bytes), err,
                  OVERFLOW, "mha_mla_cache_create: %lld x %lld x %lld values", (long long)batch,
                  (long long)max_seq, (long long)width);
    mha_mla_cache *c = mha__alloc(allocator, sizeof *c);
    void *data = c ? mha__alloc_large(allocator, bytes) : NULL;
    int64_t *len = data ? mha__alloc(allocator, (size_t)batch * sizeof(int64_t)) : NULL;
    if (!len) {
        mha__free(allocator, data);
        mha__free(allocator, c);
        return mha__fail(err, MHA_STATUS_NO_MEMORY,
                         "mha_mla_cache_create: cannot allocate %zu "
                         "bytes",
                         bytes);
    }
    memset(c, 0, sizeof *c);
    memset(len, 0, (size_t)batch * sizeof(int64_t));
    c->batch = batch;
    c->max_seq = max_seq;
    c->width = width;
    c->dtype = dtype;
    c->data = data;
    c->len = len;
    if (allocator) {
        c->allocator = *allocator;
        c->has_allocator = 1;
    }
    *out = c;
    mha__ok(err);
    return MHA_STATUS_OK;
}

void mha_mla_cache_destroy(mha_mla_cache *c) {
    if (!c)
        return;
    const mha_allocator a = c->allocator;
    const mha_allocator *ap = c->has_allocator ? &a : NULL;
    mha__free(ap, c->data);
    mha__free(ap, c->len);
    mha__free(ap, c);
}

int64_t mha_mla_cache_length(const mha_mla_cache *c, int64_t seq) {
    return c && seq >= 0 && seq < c->batch ? c->len[seq] : -1;
}

int64_t mha_mla_cache_bytes_per_token(const mha_mla_cache *c) {
    return c ? c->width * (int64_t)mha__storage_size(c->dtype) : 0;
}

mha_status mha_mla_cache_reset(mha_mla_cache *c, int64_t seq, mha_error *err) {
    MHA_RETURN_IF(!c || seq < 0 || seq >= c->batch, err, INVALID_ARG,
                  "mha_mla_cache_reset: no sequence %lld in the cache", (long long)seq);
    c->len[seq] = 0;
    mha__ok(err);
    return MHA_STATUS_OK;
}

/* Row pos of sequence s: [c, k_pe] in the cache's dtype. */
static void *row_of(const mha_mla_cache *c, int64_t s, int64_t pos) {
    return mha__elem_mut(c->dtype, c->data, (s * c->max_seq + pos) * c->width);
}

mha_status mha_mla_cache_append(mha_mla_cache *c,
                                int64_t num_seqs,
                                const int64_t *ids,
                                int64_t t,
                                const float *rows,
                                mha_error *err) {
    MHA_RETURN_IF(!c, err, INVALID_ARG, "mha_mla_cache_append: cache is NULL");
    MHA_TRY(mha__check_mla_append(c->batch, c->len, c->max_seq, num_seqs, ids, t, rows, err));
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t s = ids ? ids[i] : i;
        mha__narrow(c->dtype, rows + i * t * c->width, row_of(c, s, c->len[s]), t * c->width);
        c->len[s] += t;
    }
    mha__ok(err);
    return MHA_STATUS_OK;
}

/* Scratch of a step of T = S t tokens. */
typedef struct step_bufs {
    mha__mla_rows rows; /* q [T, h, dq], kv [T, r + dr] */
    float *tmp;         /* [T, q_lora_rank] */
    float *qa;          /* [T, h, r + dr]: the absorbed queries [q_lat_h, q_pe_h] */
    float *olat;        /* [T, h, r] */
    float *o;           /* [T, h, dv] */
    uint16_t *qh;       /* [T, h, r + dr]: qa rounded to bfloat16 (a bfloat16 cache only) */
} step_bufs;

/* qa[t, h] = [q_nope_h W_uk,h (r values), q_pe_h]. */
static mha_status
absorb_q(const struct mha_mla *m, int64_t T, step_bufs *b, mha__team team, mha_error *err) {
    const mha_mla_config *c = &m->cfg;
    const int64_t h = c->num_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim;
    const int64_t dq = dn + dr, r = c->kv_lora_rank, w = r + dr;
    for (int64_t hh = 0; hh < h; hh++)
        MHA_TRY(mha__gemm_xwt(T, r, dn, b->rows.q + hh * dq, h * dq, m->w_uk_t + hh * r * dn, dn,
                              NULL, b->qa + hh * w, h * w, team, MHA__GEMM_AUTO, NULL, err));
    for (int64_t t = 0; t < T; t++)
        for (int64_t hh = 0; hh < h; hh++)
            memcpy(b->qa + (t * h + hh) * w + r, b->rows.q + (t * h + hh) * dq + dn,
                   (size_t)dr * sizeof(float));
    return MHA_STATUS_OK;
}

/* olat rows of sequence row i (cache id s, length L after the append): MQA over its cache rows,
 * causal bottom-right, the values the first r columns of the keys. */
static mha_status attend_seq(const struct mha_mla *m,
                             const mha_mla_cache *c,
                             int64_t i,
                             int64_t s,
                             int64_t t,
                             const step_bufs *b,
                             const mha_exec *exec,
                             mha_error *err) {
    const mha_mla_config *cf = &m->cfg;
    const int64_t h = cf->num_heads, r = cf->kv_lora_rank, w = c->width, L = c->len[s] + t;
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = 1;
    a.num_heads = h;
    a.num_kv_heads = 1;
    a.q_len = t;
    a.kv_len = L;
    a.head_dim = w;
    a.v_head_dim = r;
    a.scale = cf->scale;
    a.q = b->qa + i * t * h * w;
    /* all three bf16: the bf16 tile kernel where the CPU prefers it (SEMANTICS.md) */
    if (c->dtype == MHA_DTYPE_BF16) {
        a.q = b->qh + i * t * h * w;
        a.q_dtype = MHA_DTYPE_BF16;
    }
    a.k = a.v = row_of(c, s, 0);
    a.k_dtype = a.v_dtype = c->dtype;
    a.out = b->olat + i * t * h * r;
    const int64_t qs[3] = {t * h * w, w, h * w}, ks[3] = {L * w, w, w},
                  os[3] = {t * h * r, r, h * r};
    memcpy(a.q_strides, qs, sizeof qs);
    memcpy(a.k_strides, ks, sizeof ks);
    memcpy(a.v_strides, ks, sizeof ks);
    memcpy(a.out_strides, os, sizeof os);
    a.mask.causal = 1;
    a.mask.window_left = a.mask.window_right = -1;
    return mha_attention(&a, exec, err);
}

/* o[t, h] = olat[t, h] W_uv,h^T; out = o W_o^T + b_o. */
static mha_status unabsorb(const struct mha_mla *m,
                           int64_t T,
                           const step_bufs *b,
                           float *out,
                           mha__team team,
                           mha_error *err) {
    const mha_mla_config *c = &m->cfg;
    const int64_t h = c->num_heads, dn = c->qk_nope_head_dim, dv = c->v_head_dim;
    const int64_t r = c->kv_lora_rank, E = c->hidden;
    for (int64_t hh = 0; hh < h; hh++)
        MHA_TRY(mha__gemm_xwt(T, dv, r, b->olat + hh * r, h * r,
                              m->w.w_kv_b + (hh * (dn + dv) + dn) * r, r, NULL, b->o + hh * dv,
                              h * dv, team, MHA__GEMM_AUTO, NULL, err));
    return mha__gemm_xwt(T, E, h * dv, b->o, h * dv, m->w.w_o, h * dv, m->w.b_o, out, E, team,
                         MHA__GEMM_AUTO, NULL, err);
}

static mha_status run_step(const struct mha_mla *m,
                           mha_mla_cache *c,
                           const mha_decode_args *a,
                           const int64_t *ids,
                           int64_t *base,
                           step_bufs *b,
                           const mha_exec *exec,
                           mha_error *err) {
    const int64_t S = a->num_seqs, t = a->num_tokens, T = S * t;
    mha__team team;
    MHA_TRY(mha__exec_team(exec, &team, err));
    MHA_TRY(mha__mla_project(m, S, t, a->x, NULL, base, b->rows, b->tmp, team, err));
    for (int64_t i = 0; i < S; i++)
        for (int64_t j = 0; j < t; j++)
            mha__narrow(c->dtype, b->rows.kv + (i * t + j) * c->width,
                        row_of(c, ids[i], base[i] + j), c->width);
    MHA_TRY(absorb_q(m, T, b, team, err));
    if (c->dtype == MHA_DTYPE_BF16)
        mha__narrow(MHA_DTYPE_BF16, b->qa, b->qh, T * m->cfg.num_heads * c->width);
    for (int64_t i = 0; i < S; i++)
        MHA_TRY(attend_seq(m, c, i, ids[i], t, b, exec, err));
    return unabsorb(m, T, b, a->out, team, err);
}

mha_status mha_mla_decode_step(const mha_mla *m,
                               mha_mla_cache *c,
                               const mha_decode_args *a,
                               const mha_exec *exec,
                               mha_error *err) {
    MHA_RETURN_IF(!m || !c, err, INVALID_ARG, "mha_mla_decode_step: mla or cache is NULL");
    MHA_RETURN_IF(c->width != m->cfg.kv_lora_rank + m->cfg.qk_rope_head_dim, err, INVALID_ARG,
                  "mha_mla_decode_step: the cache holds %lld values per token, the layer's "
                  "kv_lora_rank + qk_rope_head_dim is %lld",
                  (long long)c->width, (long long)(m->cfg.kv_lora_rank + m->cfg.qk_rope_head_dim));
    MHA_TRY(mha__check_mla_decode(&m->cfg, &m->w, c->batch, c->len, c->max_seq, a, err));
    const mha_mla_config *cf = &m->cfg;
    const int64_t S = a->num_seqs, T = S * a->num_tokens, h = cf->num_heads;
    const int64_t dq = cf->qk_nope_head_dim + cf->qk_rope_head_dim, r = cf->kv_lora_rank;
    const int64_t per = h * dq + c->width + cf->q_lora_rank + h * c->width + h * r +
                        h * cf->v_head_dim + (h * c->width + 1) / 2; /* qh: bf16 halves */
    int64_t total;
    size_t bytes;
    MHA_RETURN_IF(!mha__mul_i64(per, T, &total) || !mha__add_i64(total, 2 * S, &total) ||
                      !mha__bytes(total, sizeof(float), &bytes),
                  err, OVERFLOW, "mha_mla_decode_step: scratch too large");
    const mha_allocator *al = exec ? exec->allocator : NULL;
    bytes = mha__align64(bytes);
    float *buf = mha__alloc(al, bytes + 2 * (size_t)S * sizeof(int64_t));
    MHA_RETURN_IF(!buf, err, NO_MEMORY, "mha_mla_decode_step: cannot allocate %zu bytes", bytes);
    step_bufs b;
    b.rows.q = buf;
    b.rows.kv = b.rows.q + T * h * dq;
    b.tmp = b.rows.kv + T * c->width;
    b.qa = b.tmp + T * cf->q_lora_rank;
    b.olat = b.qa + T * h * c->width;
    b.o = b.olat + T * h * r;
    b.qh = (uint16_t *)(void *)(b.o + T * h * cf->v_head_dim);
    int64_t *ids = (int64_t *)(void *)((char *)buf + bytes), *base = ids + S;
    for (int64_t i = 0; i < S; i++) {
        ids[i] = a->seq_ids ? a->seq_ids[i] : i;
        base[i] = c->len[ids[i]];
    }
    const mha_status st = run_step(m, c, a, ids, base, &b, exec, err);
    if (st == MHA_STATUS_OK) {
        for (int64_t i = 0; i < S; i++)
            c->len[ids[i]] += a->num_tokens;
        mha__ok(err);
    }
    mha__free(al, buf);
    return st;
}
