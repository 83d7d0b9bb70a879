/* SPDX-License-Identifier: MIT */
/* check/cache.c: the checks of the KV cache's public calls (mha_kv_cache_*), of the attention over
 * a cache (mha_kv_cache_attention), of the layer through a cache (mha_layer_prefill /
 * mha_layer_decode_step) and of mha_attention_merge. A failing check leaves the cache as it was:
 * every check runs before the call changes anything. */
#include "check/check.h"

/* Default most tokens per append of a window cache: a whole speculative draft or a prompt chunk
 * fits, and the ring grows by only 63 positions over the window. */
#define MHA_KV_DEFAULT_STEP 64

mha_status mha__check_kv_create(const mha_kv_cache_config *in,
                                const mha_config *lc,
                                mha_kv_cache *const *out,
                                mha_kv_cache_config *c,
                                mha_error *err) {
    MHA_RETURN_IF(!out, err, INVALID_ARG, "out (the cache pointer) is NULL");
    MHA_RETURN_IF(!in, err, INVALID_ARG, "config is NULL");
    *c = *in;
    if (lc) {
        const struct {
            const char *name;
            int64_t *field;
            int64_t layer_value;
        } f[] = {{"num_kv_heads", &c->num_kv_heads, lc->num_kv_heads},
                 {"head_dim", &c->head_dim, lc->head_dim},
                 {"v_head_dim", &c->v_head_dim, lc->v_head_dim}};
        for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
            if (*f[i].field == 0)
                *f[i].field = f[i].layer_value;
            MHA_RETURN_IF(*f[i].field != f[i].layer_value, err, INVALID_ARG,
                          "kv cache config.%s=%lld does not match the layer's %lld", f[i].name,
                          (long long)*f[i].field, (long long)f[i].layer_value);
        }
    }
    if (c->v_head_dim == 0)
        c->v_head_dim = c->head_dim;
    if (c->max_step_tokens == 0)
        c->max_step_tokens = MHA_KV_DEFAULT_STEP;
    const struct {
        const char *name;
        int64_t v;
    } dims[] = {{"num_kv_heads", c->num_kv_heads},
                {"head_dim", c->head_dim},
                {"v_head_dim", c->v_head_dim},
                {"max_seq", c->max_seq},
                {"batch", c->batch},
                {"max_step_tokens", c->max_step_tokens}};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        MHA_RETURN_IF(dims[i].v < 1 || dims[i].v > MHA_MAX_DIM, err, INVALID_ARG,
                      "kv cache config.%s=%lld must be in [1, 2^31]", dims[i].name,
                      (long long)dims[i].v);
    MHA_RETURN_IF(c->window < 0 || c->window > MHA_MAX_DIM, err, INVALID_ARG,
                  "kv cache config.window=%lld must be 0 (none) or in [1, 2^31]",
                  (long long)c->window);
    MHA_RETURN_IF(c->chunk_size < 0 || c->chunk_size > MHA_MAX_DIM, err, INVALID_ARG,
                  "kv cache config.chunk_size=%lld must be 0 (none) or in [1, 2^31]",
                  (long long)c->chunk_size);
    MHA_RETURN_IF(c->chunk_size > 0 && c->window > 0, err, UNSUPPORTED,
                  "kv cache config: window=%lld and chunk_size=%lld together are not supported "
                  "(a cache keeps one ring; give one of them)",
                  (long long)c->window, (long long)c->chunk_size);
    const mha__kv_dtype_traits *dt = mha__kv_dtype(c->dtype);
    MHA_RETURN_IF(!dt, err, INVALID_ARG,
                  "kv cache config.dtype=%d must be F32, F16, BF16, Q8_0 or FP8_E4M3",
                  (int)c->dtype);
    /* blocks (q8_0: 32 values) run along the head dimension, never across two rows */
    MHA_RETURN_IF(c->head_dim % dt->block != 0, err, INVALID_ARG,
                  "kv cache config.head_dim=%lld must be a multiple of %lld for dtype %s",
                  (long long)c->head_dim, (long long)dt->block, dt->name);
    MHA_RETURN_IF(c->v_head_dim % dt->block != 0, err, INVALID_ARG,
                  "kv cache config.v_head_dim=%lld must be a multiple of %lld for dtype %s",
                  (long long)c->v_head_dim, (long long)dt->block, dt->name);
    MHA_RETURN_IF(c->block_size != 0 && (c->block_size < MHA__KV_MIN_BLOCK_SIZE ||
                                         c->block_size > MHA__KV_MAX_BLOCK_SIZE),
                  err, INVALID_ARG,
                  "kv cache config.block_size=%lld must be 0 (contiguous) or in [%d, %d] (paged)",
                  (long long)c->block_size, MHA__KV_MIN_BLOCK_SIZE, MHA__KV_MAX_BLOCK_SIZE);
    MHA_RETURN_IF(c->num_blocks < 0 || c->num_blocks > MHA_MAX_DIM, err, INVALID_ARG,
                  "kv cache config.num_blocks=%lld must be 0 (default) or in [1, 2^31]",
                  (long long)c->num_blocks);
    MHA_RETURN_IF(c->block_size == 0 && c->num_blocks != 0, err, INVALID_ARG,
                  "kv cache config.num_blocks=%lld needs a paged cache (block_size > 0)",
                  (long long)c->num_blocks);
    return MHA_STATUS_OK;
}

mha_status mha__check_kv_seq(const mha__kv_view *c, int64_t seq, const char *name, mha_error *err) {
    MHA_RETURN_IF(!c->cfg, err, INVALID_ARG, "cache is NULL");
    MHA_RETURN_IF(seq < 0 || seq >= c->cfg->batch, err, INVALID_ARG,
                  "%s=%lld is not a sequence of this cache (batch=%lld)", name, (long long)seq,
                  (long long)c->cfg->batch);
    return MHA_STATUS_OK;
}

mha_status mha__check_kv_compact(const mha__kv_view *c, mha_error *err) {
    MHA_RETURN_IF(!c->cfg, err, INVALID_ARG, "cache is NULL");
    return MHA_STATUS_OK;
}

mha_status
mha__check_kv_seqs(const mha__kv_view *c, int64_t S, const int64_t *seq_ids, mha_error *err) {
    MHA_RETURN_IF(!c->cfg, err, INVALID_ARG, "cache is NULL");
    MHA_RETURN_IF(S < 1 || S > c->cfg->batch, err, INVALID_ARG,
                  "num_seqs=%lld must be in [1, %lld] (the cache's batch)", (long long)S,
                  (long long)c->cfg->batch);
    if (!seq_ids)
        return MHA_STATUS_OK;
    for (int64_t i = 0; i < S; i++) {
        MHA_RETURN_IF(seq_ids[i] < 0 || seq_ids[i] >= c->cfg->batch, err, INVALID_ARG,
                      "seq_ids[%lld]=%lld is not a sequence of this cache (batch=%lld)",
                      (long long)i, (long long)seq_ids[i], (long long)c->cfg->batch);
        for (int64_t j = 0; j < i; j++)
            MHA_RETURN_IF(seq_ids[j] == seq_ids[i], err, INVALID_ARG,
                          "seq_ids[%lld] and seq_ids[%lld] are both %lld: ids must be distinct",
                          (long long)j, (long long)i, (long long)seq_ids[i]);
    }
    return MHA_STATUS_OK;
}

mha_status mha__check_kv_append(const mha__kv_view *c,
                                int64_t S,
                                const int64_t *seq_ids,
                                int64_t t,
                                const float *k,
                                const float *v,
                                mha_error *err) {
    mha_status st = mha__check_kv_seqs(c, S, seq_ids, err);
    if (st)
        return st;
    MHA_RETURN_IF(t < 1 || t > MHA_MAX_DIM, err, INVALID_ARG,
                  "num_tokens=%lld must be in [1, 2^31]", (long long)t);
    MHA_RETURN_IF(mha__kv_ring_span(c->cfg) > 0 && t > c->cfg->max_step_tokens, err, INVALID_ARG,
                  "num_tokens=%lld exceeds the ring cache's max_step_tokens=%lld", (long long)t,
                  (long long)c->cfg->max_step_tokens);
    for (int64_t i = 0; i < S; i++) {
        const int64_t s = seq_ids ? seq_ids[i] : i;
        MHA_RETURN_IF(c->len[s] + t > c->cfg->max_seq, err, INVALID_ARG,
                      "kv cache overflow: sequence %lld has %lld positions, %lld more exceed "
                      "max_seq=%lld",
                      (long long)s, (long long)c->len[s], (long long)t, (long long)c->cfg->max_seq);
    }
    MHA_RETURN_IF(!k || !v, err, INVALID_ARG, "k and v must not be NULL");
    return MHA_STATUS_OK;
}

mha_status mha__check_kv_truncate(const mha__kv_view *c,
                                  int64_t seq,
                                  int64_t new_len,
                                  const char *fn,
                                  const char *arg,
                                  mha_error *err) {
    mha_status st = mha__check_kv_seq(c, seq, "seq", err);
    if (st)
        return st;
    const int64_t L = c->len[seq];
    MHA_RETURN_IF(new_len < 0 || new_len > L, err, INVALID_ARG,
                  "%s: %s=%lld must be in [0, %lld] (the length of sequence %lld)", fn, arg,
                  (long long)new_len, (long long)L, (long long)seq);
    /* A ring (window or chunk) holds the positions >= lo[seq]; the next token at new_len needs
     * the keys mha__kv_first_key(new_len) .. new_len - 1 (none at a chunk's start). */
    if (mha__kv_ring_span(c->cfg) > 0 && new_len > 0) {
        const int64_t need = mha__kv_first_key(c->cfg, new_len);
        MHA_RETURN_IF(
            need < c->lo[seq] &&
                    need<new_len, err, INVALID_ARG,
                         "%s: sequence %lld of a %s-%lld cache cannot roll back to %lld: "
                         "its keys below position %lld are overwritten (a ring can roll back at "
                         "most max_step_tokens=%lld positions from its furthest length)",
                         fn, (long long)seq, c->cfg->window> 0
                ? "window"
                : "chunk",
            (long long)mha__kv_ring_span(c->cfg), (long long)new_len, (long long)c->lo[seq],
            (long long)c->cfg->max_step_tokens);
    }
    return MHA_STATUS_OK;
}

mha_status mha__check_kv_fp8_scales(const mha__kv_view *c,
                                    const float *k_scales,
                                    const float *v_scales,
                                    mha_error *err) {
    MHA_RETURN_IF(!c->cfg, err, INVALID_ARG, "cache is NULL");
    MHA_RETURN_IF(c->cfg->dtype != MHA_DTYPE_FP8_E4M3, err, INVALID_ARG,
                  "set_fp8_scales: the cache's dtype is %d, not FP8_E4M3", (int)c->cfg->dtype);
    for (int64_t s = 0; s < c->cfg->batch; s++)
        MHA_RETURN_IF(c->len[s] > 0, err, INVALID_ARG,
                      "set_fp8_scales: sequence %lld holds %lld positions (scales are set before "
                      "the first append, or after resetting every sequence)",
                      (long long)s, (long long)c->len[s]);
    const float *sc[2] = {k_scales, v_scales};
    for (int i = 0; i < 2; i++)
        for (int64_t g = 0; sc[i] && g < c->cfg->num_kv_heads; g++)
            /* the range keeps 448 s and the kernels' 2^8 s (kv_cache.h) far from overflow */
            MHA_RETURN_IF(!(sc[i][g] >= 0x1p-100f && sc[i][g] <= 0x1p100f), err, INVALID_ARG,
                          "set_fp8_scales: %s_scales[%lld]=%g must be in [2^-100, 2^100]",
                          i ? "v" : "k", (long long)g, (double)sc[i][g]);
    return MHA_STATUS_OK;
}

mha_status mha__check_tree(const int64_t *tree_parents, int64_t t, mha_error *err) {
    if (!tree_parents)
        return MHA_STATUS_OK;
    MHA_RETURN_IF(t > MHA__TREE_MAX_TOKENS, err, INVALID_ARG,
                  "tree_parents: a draft tree has at most %d tokens, num_tokens=%lld",
                  MHA__TREE_MAX_TOKENS, (long long)t);
    for (int64_t i = 0; i < t; i++)
        MHA_RETURN_IF(
            tree_parents[i] < -1 || tree_parents[i] >= i, err, INVALID_ARG,
            "tree_parents[%lld]=%lld must be -1 (a root) or an earlier draft in [0, %lld)",
            (long long)i, (long long)tree_parents[i], (long long)i);
    return MHA_STATUS_OK;
}

mha_status mha__check_kv_accept(const mha__kv_view *c,
                                int64_t seq,
                                int64_t base_len,
                                int64_t n,
                                const int64_t *draft_idx,
                                mha_error *err) {
    mha_status st = mha__check_kv_seq(c, seq, "seq", err);
    if (st)
        return st;
    const int64_t L = c->len[seq];
    MHA_RETURN_IF(base_len < 0 || base_len > L, err, INVALID_ARG,
                  "accept: base_len=%lld must be in [0, %lld] (the length of sequence %lld)",
                  (long long)base_len, (long long)L, (long long)seq);
    MHA_RETURN_IF(n < 0 || n > L - base_len, err, INVALID_ARG,
                  "accept: n=%lld must be in [0, %lld] (the drafts after base_len)", (long long)n,
                  (long long)(L - base_len));
    MHA_RETURN_IF(n > 0 && !draft_idx, err, INVALID_ARG, "accept: draft_idx is NULL");
    for (int64_t k = 0; k < n; k++)
        MHA_RETURN_IF(draft_idx[k] < (k > 0 ? draft_idx[k - 1] + 1 : 0) ||
                          draft_idx[k] >= L - base_len,
                      err, INVALID_ARG,
                      "accept: draft_idx[%lld]=%lld must be in [%lld, %lld) (strictly increasing "
                      "draft indices)",
                      (long long)k, (long long)draft_idx[k],
                      (long long)(k > 0 ? draft_idx[k - 1] + 1 : 0), (long long)(L - base_len));
    /* the rows moved must still be stored: a ring holds the positions >= lo[seq] (the truncate
     * rule below implies base_len >= lo[seq] for base_len > 0, not for base_len = 0) */
    MHA_RETURN_IF(n > 0 && base_len < c->lo[seq], err, INVALID_ARG,
                  "accept: the drafts of sequence %lld from base_len=%lld are not all held: its "
                  "ring holds positions >= %lld only (the older ones are overwritten)",
                  (long long)seq, (long long)base_len, (long long)c->lo[seq]);
    /* the next token needs what truncate would */
    return mha__check_kv_truncate(c, seq, base_len, "accept", "base_len", err);
}

mha_status mha__check_kv_read(const mha__kv_view *c,
                              int64_t seq,
                              int64_t pos,
                              const float *k,
                              const float *v,
                              mha_error *err) {
    mha_status st = mha__check_kv_seq(c, seq, "seq", err);
    if (st)
        return st;
    const int64_t L = c->len[seq];
    MHA_RETURN_IF(pos < 0 || pos >= L || pos < c->lo[seq], err, INVALID_ARG,
                  "read: position %lld of sequence %lld is not stored (length %lld, slots %lld)",
                  (long long)pos, (long long)seq, (long long)L, (long long)c->slots);
    const int64_t G = c->cfg->num_kv_heads;
    const mha__span out[2] = {mha__span_of("k", k, G * c->cfg->head_dim, sizeof(float)),
                              mha__span_of("v", v, G * c->cfg->v_head_dim, sizeof(float))};
    return mha__check_no_overlap(out, 2, NULL, 0, err);
}

/* exec's implementation is one the decode calls know, and its threads resolve. */
static mha_status check_exec(const mha_exec *exec, mha_error *err) {
    if (!exec)
        return MHA_STATUS_OK;
    MHA_RETURN_IF(exec->impl != MHA_IMPL_AUTO && exec->impl != MHA_IMPL_REFERENCE &&
                      exec->impl != MHA_IMPL_FAST,
                  err, INVALID_ARG, "exec.impl=%d is not a known implementation", (int)exec->impl);
    mha__team team;
    return mha__exec_team(exec, &team, err);
}

mha_status mha__check_kv_attention(const mha__kv_view *c,
                                   const mha_kv_attention_args *args,
                                   const mha_exec *exec,
                                   double *scale,
                                   mha_error *err) {
    MHA_RETURN_IF(!args, err, INVALID_ARG, "args is NULL");
    mha_status st = mha__check_kv_seqs(c, args->num_seqs, args->seq_ids, err);
    if (!st)
        st = check_exec(exec, err);
    if (st)
        return st;
    const mha_kv_cache_config *kc = c->cfg;
    MHA_RETURN_IF(!args->q || !args->out, err, INVALID_ARG, "q and out must not be NULL");
    MHA_RETURN_IF(args->num_heads < 1 || args->num_heads > MHA_MAX_DIM ||
                      args->num_heads % kc->num_kv_heads != 0,
                  err, INVALID_ARG,
                  "num_heads=%lld must be a positive multiple of the cache's "
                  "num_kv_heads=%lld",
                  (long long)args->num_heads, (long long)kc->num_kv_heads);
    MHA_RETURN_IF(args->num_tokens < 1, err, INVALID_ARG, "num_tokens=%lld must be >= 1",
                  (long long)args->num_tokens);
    for (int64_t i = 0; i < args->num_seqs; i++) {
        const int64_t s = args->seq_ids ? args->seq_ids[i] : i;
        MHA_RETURN_IF(args->num_tokens > c->len[s], err, INVALID_ARG,
                      "num_tokens=%lld exceeds the length %lld of sequence %lld (append the "
                      "new tokens' K and V first)",
                      (long long)args->num_tokens, (long long)c->len[s], (long long)s);
        MHA_RETURN_IF(mha__kv_ring_span(kc) > 0 && args->num_tokens > kc->max_step_tokens, err,
                      INVALID_ARG, "num_tokens=%lld exceeds the ring cache's max_step_tokens=%lld",
                      (long long)args->num_tokens, (long long)kc->max_step_tokens);
        /* A ring holds the positions >= lo[s]: the first query (position L - t, a draft tree's
         * roots too) must not see a key the ring overwrote (after a truncate / accept / share
         * that rolled the sequence back, before the next append). */
        if (mha__kv_ring_span(kc) > 0) {
            const int64_t p0 = c->len[s] - args->num_tokens;
            MHA_RETURN_IF(mha__kv_first_key(kc, p0) < c->lo[s], err, INVALID_ARG,
                          "num_tokens=%lld: the query at position %lld of sequence %lld sees "
                          "keys from %lld, but its %s-%lld ring holds positions >= %lld only (the "
                          "older ones are overwritten; attend after appending new tokens, or "
                          "with fewer tokens)",
                          (long long)args->num_tokens, (long long)p0, (long long)s,
                          (long long)mha__kv_first_key(kc, p0), kc->window > 0 ? "window" : "chunk",
                          (long long)mha__kv_ring_span(kc), (long long)c->lo[s]);
        }
    }
    st = mha__check_tree(args->tree_parents, args->num_tokens, err);
    if (st)
        return st;
    const int64_t S = args->num_seqs, t = args->num_tokens, h = args->num_heads;
    const mha__span in[4] = {
        mha__span_of("q", args->q, mha__count3(S * t, h, kc->head_dim), sizeof(float)),
        mha__span_of("sinks", args->sinks, h, sizeof(float)),
        mha__span_of("seq_ids", args->seq_ids, S, sizeof(int64_t)),
        mha__span_of("tree_parents", args->tree_parents, t, sizeof(int64_t))};
    const mha__span out[2] = {
        mha__span_of("out", args->out, mha__count3(S * t, h, kc->v_head_dim), sizeof(float)),
        mha__span_of("lse", args->lse, mha__count3(S, h, t), sizeof(float))};
    st = mha__check_no_overlap(out, 2, in, 4, err);
    if (st)
        return st;
    *scale = args->scale == 0.0 ? 1.0 / sqrt((double)kc->head_dim) : args->scale;
    return mha__check_scale_softcap(*scale, args->softcap, "args.", err);
}

mha_status mha__check_decode(const mha_config *lc,
                             const mha_weights *w,
                             const mha__kv_view *c,
                             const mha_decode_args *args,
                             const mha_exec *exec,
                             mha_error *err) {
    MHA_RETURN_IF(!lc, err, INVALID_ARG, "layer is NULL");
    MHA_RETURN_IF(!args, err, INVALID_ARG, "args is NULL");
    mha_status st = mha__check_kv_seqs(c, args->num_seqs, args->seq_ids, err);
    if (!st)
        st = check_exec(exec, err);
    if (st)
        return st;
    const mha_kv_cache_config *kc = c->cfg;
    MHA_RETURN_IF(kc->num_kv_heads != lc->num_kv_heads || kc->head_dim != lc->head_dim ||
                      kc->v_head_dim != lc->v_head_dim,
                  err, INVALID_ARG,
                  "the cache holds g=%lld kv heads of d_k=%lld, d_v=%lld; the layer needs "
                  "g=%lld, d_k=%lld, d_v=%lld",
                  (long long)kc->num_kv_heads, (long long)kc->head_dim, (long long)kc->v_head_dim,
                  (long long)lc->num_kv_heads, (long long)lc->head_dim, (long long)lc->v_head_dim);
    MHA_RETURN_IF(lc->k_dim != lc->q_dim || lc->v_dim != lc->q_dim, err, INVALID_ARG,
                  "decoding is self-attention: it needs k_dim = v_dim = q_dim, the layer has "
                  "q_dim=%lld k_dim=%lld v_dim=%lld",
                  (long long)lc->q_dim, (long long)lc->k_dim, (long long)lc->v_dim);
    MHA_RETURN_IF(!args->x || !args->out, err, INVALID_ARG, "x and out must not be NULL");
    const int64_t t = args->num_tokens;
    MHA_RETURN_IF(t < 1 || t > MHA_MAX_DIM, err, INVALID_ARG,
                  "num_tokens=%lld must be in [1, 2^31]", (long long)t);
    st = mha__check_tree(args->tree_parents, t, err);
    if (st)
        return st;
    MHA_RETURN_IF(args->tree_parents && mha__kv_ring_span(kc) > 0 && t > kc->max_step_tokens, err,
                  INVALID_ARG,
                  "a draft tree of num_tokens=%lld exceeds the ring cache's max_step_tokens=%lld",
                  (long long)t, (long long)kc->max_step_tokens);
    for (int64_t i = 0; i < args->num_seqs; i++) {
        const int64_t s = args->seq_ids ? args->seq_ids[i] : i;
        MHA_RETURN_IF(c->len[s] + t > kc->max_seq, err, INVALID_ARG,
                      "kv cache overflow: sequence %lld has %lld positions, %lld more exceed "
                      "max_seq=%lld",
                      (long long)s, (long long)c->len[s], (long long)t, (long long)kc->max_seq);
        MHA_RETURN_IF(c->len[s] + t - 1 > MHA_MAX_POSITION, err, INVALID_ARG,
                      "positions of sequence %lld would exceed 2^31", (long long)s);
    }
    const int64_t S = args->num_seqs;
    /* the layer's weights are read by the output projection while it writes out */
    mha__span in[3 + MHA__WEIGHT_SLOTS];
    int n_in = 0;
    in[n_in++] = mha__span_of("x", args->x, mha__count3(S, t, lc->q_dim), sizeof(float));
    in[n_in++] = mha__span_of("seq_ids", args->seq_ids, S, sizeof(int64_t));
    in[n_in++] = mha__span_of("tree_parents", args->tree_parents, t, sizeof(int64_t));
    if (w)
        n_in += mha__layer_weight_spans(lc, w, in + n_in);
    const mha__span out =
        mha__span_of("out", args->out, mha__count3(S, t, lc->out_dim), sizeof(float));
    return mha__check_no_overlap(&out, 1, in, n_in, err);
}

mha_status mha__check_merge(int64_t rows,
                            int64_t dim,
                            const float *o_a,
                            int64_t o_a_stride,
                            const float *lse_a,
                            const float *o_b,
                            int64_t o_b_stride,
                            const float *lse_b,
                            const float *o,
                            int64_t o_stride,
                            const float *lse,
                            mha_error *err) {
    MHA_RETURN_IF(rows < 0 || dim < 1 || dim > MHA_MAX_DIM, err, INVALID_ARG,
                  "merge: rows=%lld must be >= 0 and dim=%lld in [1, 2^31]", (long long)rows,
                  (long long)dim);
    MHA_RETURN_IF(!o_a || !o_b || !o || !lse_a || !lse_b, err, INVALID_ARG,
                  "merge: o_a, lse_a, o_b, lse_b and o must not be NULL");
    MHA_RETURN_IF(o_a_stride < dim || o_b_stride < dim || o_stride < dim, err, INVALID_ARG,
                  "merge: row strides (%lld, %lld, %lld) must be >= dim=%lld",
                  (long long)o_a_stride, (long long)o_b_stride, (long long)o_stride,
                  (long long)dim);
    MHA_RETURN_IF((o == o_a && o_stride != o_a_stride) || (o == o_b && o_stride != o_b_stride), err,
                  INVALID_ARG, "merge: in-place o must have the stride of the input it is");
    /* In place means exactly: o is o_a or o_b (same pointer and stride), lse is lse_a or lse_b;
     * every other overlap (a shifted row, o over an lse) is refused. */
    const int64_t strides[3] = {o_a_stride, o_b_stride, o_stride};
    int64_t ext[3] = {0, 0, 0}; /* elements each of o_a, o_b, o reaches */
    for (int i = 0; i < 3 && rows > 0; i++)
        MHA_RETURN_IF(!mha__mul_i64(rows - 1, strides[i], &ext[i]) ||
                          !mha__add_i64(ext[i], dim, &ext[i]) ||
                          ext[i] > (int64_t)(SIZE_MAX / sizeof(float)),
                      err, OVERFLOW, "merge: rows=%lld with row stride %lld overflows",
                      (long long)rows, (long long)strides[i]);
    const int64_t n_a = ext[0], n_b = ext[1], n_o = ext[2];
    const mha__span in[4] = {
        mha__span_of("o_a", o == o_a ? NULL : o_a, n_a, sizeof(float)),
        mha__span_of("o_b", o == o_b ? NULL : o_b, n_b, sizeof(float)),
        mha__span_of("lse_a", lse == lse_a ? NULL : lse_a, rows, sizeof(float)),
        mha__span_of("lse_b", lse == lse_b ? NULL : lse_b, rows, sizeof(float))};
    const mha__span out[2] = {mha__span_of("o", o, n_o, sizeof(float)),
                              mha__span_of("lse", lse, rows, sizeof(float))};
    return mha__check_no_overlap(out, 2, in, 4, err);
}
