/* SPDX-License-Identifier: MIT */
/* ring_layer.c: the whole attention layer over MPI (mha_ring_layer_forward, mha_mpi.h). Each rank
 * holds the rows mha_ring_shard gives it of the layer's input x [B, N, q_dim]; it projects them
 * (mha_layer_project), rotates its Q and K rows at their GLOBAL positions (mha_rope_apply), runs
 * ring attention on the shards (mha_ring_attention) and projects its rows of the attention
 * output (mha_layer_project). The projections are row-wise, so only attention needs the other
 * ranks. Public calls of mha.h and mha_mpi.h only (tests/check_layout.sh).
 *
 * Buffers (floats, from exec->allocator): Q [B, n, h d_k], K [B, n, g d_k], V [B, n, g d_v],
 * A [B, n, h d_v] with n the rank's local rows, plus n int64 positions. */
#include "mha_mpi.h"

#include "dist/dist_util.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Every rank learns whether some rank failed: one MPI_Allreduce (MAX) of P - rank on a failing
 * rank (0 elsewhere) names the first failing rank, which broadcasts its status and message; the
 * others return it as "rank r: <message>". Returns the agreed status. */
static mha_status agree_status(MPI_Comm comm, int p, int rank, mha_status st, mha_error *err) {
    const int mine = st != MHA_STATUS_OK ? p - rank : 0;
    int first = 0;
    if (MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MAX, comm) != MPI_SUCCESS) {
        mha__dist_error(err, MHA_STATUS_INTERNAL, "mha_ring_layer_forward: MPI_Allreduce failed");
        return MHA_STATUS_INTERNAL;
    }
    if (first == 0)
        return MHA_STATUS_OK;
    const int bad = p - first;
    struct {
        int32_t status;
        char message[MHA_ERROR_MESSAGE_SIZE];
    } msg = {(int32_t)st, ""};
    if (rank == bad && err)
        snprintf(msg.message, sizeof msg.message, "%s", err->message);
    if (MPI_Bcast(&msg, (int)sizeof msg, MPI_BYTE, bad, comm) != MPI_SUCCESS) {
        mha__dist_error(err, MHA_STATUS_INTERNAL, "mha_ring_layer_forward: MPI_Bcast failed");
        return MHA_STATUS_INTERNAL;
    }
    if (rank != bad) {
        msg.message[MHA_ERROR_MESSAGE_SIZE - 1] = '\0';
        mha__dist_error(err, (mha_status)msg.status, "rank %d: %s", bad, msg.message);
    }
    return (mha_status)msg.status;
}

/* The rank's buffers and sizes. */
typedef struct layer_call {
    int64_t B, n, h, g, dk, dv;
    float *q, *k, *v, *att;
    int64_t *pos; /* [n] global indices of the local rows (RoPE without caller positions) */
} layer_call;

/* Whether a layer's rope changes with the call's length (DYNAMIC, or LONGROPE whose two lists
 * differ), which no rank knows alone. */
static int rope_depends_on_length(const mha_rope *r) {
    if (r->scaling == MHA_ROPE_SCALING_DYNAMIC)
        return 1;
    if (r->scaling != MHA_ROPE_SCALING_LONGROPE)
        return 0;
    return memcmp(r->short_factor, r->long_factor, sizeof(double) * (size_t)(r->rotary_dim / 2));
}

/* The checks of the rank's arguments, then its buffers. fn: the public call (its name in the
 * messages); the backward does not need a->out. */
static mha_status prepare(const char *fn,
                          const mha_ring_config *cfg,
                          int p,
                          int rank,
                          const mha_layer *layer,
                          const mha_forward_args *a,
                          const mha_allocator *alloc,
                          layer_call *lc,
                          mha_error *err) {
    const int need_out = strcmp(fn, "mha_ring_layer_forward") == 0;
    if (!cfg || !layer || !a) {
        mha__dist_error(err, MHA_STATUS_INVALID_ARG, "%s: %s is NULL", fn,
                        !cfg ? "cfg" : (!layer ? "layer" : "args"));
        return MHA_STATUS_INVALID_ARG;
    }
    if (a->key || a->value || a->probs) {
        mha__dist_error(err, MHA_STATUS_UNSUPPORTED, "%s: %s", fn,
                        a->probs ? "args.probs is not supported (no rank sees a whole row of "
                                   "probabilities)"
                                 : "cross-attention (args.key/value) is not supported: the ring "
                                   "shards one self-attention sequence");
        return MHA_STATUS_UNSUPPORTED;
    }
    if (a->x_dtype != MHA_DTYPE_F32 || a->out_dtype != MHA_DTYPE_F32 ||
        mha_layer_config(layer)->weight_dtype != MHA_DTYPE_F32) {
        mha__dist_error(err, MHA_STATUS_UNSUPPORTED,
                        "%s: %s is not float32: the ring takes float32 layers and tensors", fn,
                        a->x_dtype
                            ? "args.x_dtype"
                            : (a->out_dtype ? "args.out_dtype" : "the layer's weight_dtype"));
        return MHA_STATUS_UNSUPPORTED;
    }
    int32_t chunks;
    int64_t start[2], len[2];
    mha_status st = mha_ring_shard(cfg, p, rank, &chunks, start, len, err);
    if (st)
        return st;
    const mha_config *c = mha_layer_config(layer);
    lc->B = a->batch, lc->n = len[0] + (chunks > 1 ? len[1] : 0);
    lc->h = c->num_heads, lc->g = c->num_kv_heads, lc->dk = c->head_dim, lc->dv = c->v_head_dim;
    /* A rank with an empty shard (N < C) has no rows: its query and out may be NULL. */
    if (a->q_len != lc->n || a->batch < 1 || (lc->n > 0 && (!a->query || (need_out && !a->out)))) {
        mha__dist_error(err, MHA_STATUS_INVALID_ARG,
                        a->q_len != lc->n
                            ? "%s: args.q_len=%lld, but rank %d holds %lld rows of "
                              "seq_len=%lld"
                            : "%s: args.batch or a tensor is missing (q_len=%lld, rank "
                              "%d, %lld rows, seq_len=%lld)",
                        fn, (long long)a->q_len, rank, (long long)lc->n, (long long)cfg->seq_len);
        return MHA_STATUS_INVALID_ARG;
    }
    if (c->rope.style != MHA_ROPE_NONE && rope_depends_on_length(&c->rope)) {
        mha__dist_error(err, MHA_STATUS_UNSUPPORTED,
                        "%s: rope scaling %s is not supported (its length is the whole "
                        "sequence's, no rank's): make the layer with mha_rope_at_length(rope, "
                        "head_dim, seq_len) instead",
                        fn, c->rope.scaling == MHA_ROPE_SCALING_DYNAMIC ? "dynamic" : "longrope");
        return MHA_STATUS_UNSUPPORTED;
    }
    if (c->qk_norm.kind != MHA_QK_NORM_NONE || c->output_gate) {
        mha__dist_error(err, MHA_STATUS_UNSUPPORTED,
                        "%s: config.%s is not supported by the distributed layer (it projects "
                        "and rotates with the public per-projection calls, which do not apply it)",
                        fn, c->output_gate ? "output_gate" : "qk_norm");
        return MHA_STATUS_UNSUPPORTED;
    }
    if (c->temperature.enabled) {
        mha__dist_error(err, MHA_STATUS_UNSUPPORTED,
                        "%s: the layer's temperature tuning (config.temperature) is not "
                        "supported by the ring",
                        fn);
        return MHA_STATUS_UNSUPPORTED;
    }
    if (c->k_dim != c->q_dim || c->v_dim != c->q_dim) {
        mha__dist_error(err, MHA_STATUS_INVALID_ARG,
                        "%s: self-attention needs k_dim = v_dim = q_dim (the layer has %lld, %lld, "
                        "%lld)",
                        fn, (long long)c->k_dim, (long long)c->v_dim, (long long)c->q_dim);
        return MHA_STATUS_INVALID_ARG;
    }
    /* Sizes: B n times the widest row (h d_k, g d_k, g d_v, h d_v), in floats. */
    const int64_t widths[4] = {lc->h * lc->dk, lc->g * lc->dk, lc->g * lc->dv, lc->h * lc->dv};
    float **bufs[4] = {&lc->q, &lc->k, &lc->v, &lc->att};
    const int64_t rows = lc->B * lc->n;
    if (lc->n > 0 && lc->B > INT64_MAX / lc->n) {
        mha__dist_error(err, MHA_STATUS_OVERFLOW, "%s: batch x rows overflows", fn);
        return MHA_STATUS_OVERFLOW;
    }
    for (int i = 0; i < 4; i++) {
        if (widths[i] > 0 && rows > (int64_t)(SIZE_MAX / sizeof(float)) / widths[i]) {
            mha__dist_error(err, MHA_STATUS_OVERFLOW,
                            "%s: buffer %d of %lld x %lld floats overflows", fn, i, (long long)rows,
                            (long long)widths[i]);
            return MHA_STATUS_OVERFLOW;
        }
        *bufs[i] = mha__dist_alloc(alloc, sizeof(float) * (size_t)(rows * widths[i]));
    }
    lc->pos = mha__dist_alloc(alloc, sizeof(int64_t) * (size_t)lc->n);
    if (!lc->q || !lc->k || !lc->v || !lc->att || !lc->pos) {
        mha__dist_error(err, MHA_STATUS_NO_MEMORY, "%s: out of memory (buffers of %lld rows)", fn,
                        (long long)rows);
        return MHA_STATUS_NO_MEMORY;
    }
    /* Local row i of chunk 0 is global row start[0] + i, then chunk 1 continues. */
    for (int64_t i = 0; i < lc->n; i++)
        lc->pos[i] = i < len[0] ? start[0] + i : start[1] + (i - len[0]);
    return MHA_STATUS_OK;
}

/* Negates the second member of every rotated pair of x [rows, d] (pairs (2k, 2k+1) or
 * (k, k + R/2), k < R/2): the reflection S with S R(a) S = R(-a), so that the transposed rotation
 * RoPE^T = S RoPE S is made of the public forward rotation. */
static void reflect_pairs(const mha_rope *rope, float *x, int64_t rows, int64_t d) {
    const int64_t half = (rope->rotary_dim ? rope->rotary_dim : d) / 2;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < half; k++) {
            float *v = x + r * d + (rope->style == MHA_ROPE_INTERLEAVED ? 2 * k + 1 : half + k);
            *v = -*v;
        }
}

/* The layer's RoPE on q [B, n, h, d_k] and k [B, n, g, d_k] at the rows' global positions (or
 * the caller's); transposed != 0: the transposed rotation (the backward's, on dQ and dK). */
static mha_status rotate(const mha_layer *layer,
                         const mha_forward_args *a,
                         const layer_call *lc,
                         float *q,
                         float *k,
                         int transposed,
                         mha_error *err) {
    const mha_rope *rope = &mha_layer_config(layer)->rope;
    if (rope->style == MHA_ROPE_NONE)
        return MHA_STATUS_OK;
    /* Positions: the caller's [B, n] rows, else the global index (one row for the batch). */
    const int64_t *qpos = a->q_positions ? a->q_positions : lc->pos;
    const int64_t *kpos = a->k_positions ? a->k_positions : qpos;
    const int64_t qstride = a->q_positions ? lc->n : 0;
    const int64_t kstride = a->k_positions ? lc->n : qstride;
    const int64_t qs[4] = {lc->n * lc->h * lc->dk, lc->h * lc->dk, lc->dk, 1};
    const int64_t ks[4] = {lc->n * lc->g * lc->dk, lc->g * lc->dk, lc->dk, 1};
    const int64_t qrows = lc->B * lc->n * lc->h, krows = lc->B * lc->n * lc->g;
    if (transposed) {
        reflect_pairs(rope, q, qrows, lc->dk);
        reflect_pairs(rope, k, krows, lc->dk);
    }
    mha_status st = mha_rope_apply(rope, lc->B, lc->n, lc->h, lc->dk, q, qs, qpos, qstride, err);
    if (!st)
        st = mha_rope_apply(rope, lc->B, lc->n, lc->g, lc->dk, k, ks, kpos, kstride, err);
    if (transposed) {
        reflect_pairs(rope, q, qrows, lc->dk);
        reflect_pairs(rope, k, krows, lc->dk);
    }
    return st;
}

/* Q, K, V of the rank's rows, Q and K rotated at their global positions (or the caller's). */
static mha_status project_rotate(const mha_layer *layer,
                                 const mha_forward_args *a,
                                 const layer_call *lc,
                                 const mha_exec *exec,
                                 mha_error *err) {
    const int64_t rows = lc->B * lc->n;
    mha_status st = mha_layer_project(layer, MHA_PROJ_Q, rows, a->query, lc->q, exec, err);
    if (!st)
        st = mha_layer_project(layer, MHA_PROJ_K, rows, a->query, lc->k, exec, err);
    if (!st)
        st = mha_layer_project(layer, MHA_PROJ_V, rows, a->query, lc->v, exec, err);
    return st ? st : rotate(layer, a, lc, lc->q, lc->k, 0, err);
}

/* The core arguments over the rank's buffers: [B, n, heads, d] seen as [B, heads, n, d]. */
static void core_args(const mha_layer *layer,
                      const mha_forward_args *a,
                      const layer_call *lc,
                      mha_attention_args *core) {
    const mha_config *c = mha_layer_config(layer);
    memset(core, 0, sizeof *core);
    core->batch = lc->B;
    core->num_heads = lc->h;
    core->num_kv_heads = lc->g;
    core->q_len = core->kv_len = lc->n;
    core->head_dim = lc->dk;
    core->v_head_dim = lc->dv;
    core->scale = c->scale;
    core->softcap = c->softcap;
    core->alibi = c->alibi;
    core->sinks = c->sinks ? mha_layer_weights(layer)->sinks : NULL;
    const int64_t n = lc->n;
    const struct {
        float *p;
        int64_t heads, d;
    } t[4] = {{lc->q, lc->h, lc->dk},
              {lc->k, lc->g, lc->dk},
              {lc->v, lc->g, lc->dv},
              {lc->att, lc->h, lc->dv}};
    int64_t *strides[4] = {core->q_strides, core->k_strides, core->v_strides, core->out_strides};
    for (int i = 0; i < 4; i++) {
        strides[i][0] = n * t[i].heads * t[i].d;
        strides[i][1] = t[i].d;
        strides[i][2] = t[i].heads * t[i].d;
    }
    core->q = lc->q, core->k = lc->k, core->v = lc->v, core->out = lc->att;
    core->mask = a->mask;
    core->dropout = a->dropout;
}

mha_status mha_ring_layer_forward(MPI_Comm comm,
                                  const mha_ring_config *cfg,
                                  const mha_layer *layer,
                                  const mha_forward_args *local,
                                  const mha_exec *exec,
                                  mha_error *err) {
    int p = 0, rank = 0;
    if (MPI_Comm_size(comm, &p) != MPI_SUCCESS || MPI_Comm_rank(comm, &rank) != MPI_SUCCESS) {
        mha__dist_error(err, MHA_STATUS_INVALID_ARG,
                        "mha_ring_layer_forward: comm is not a communicator");
        return MHA_STATUS_INVALID_ARG;
    }
    const mha_allocator *alloc = exec ? exec->allocator : NULL;
    layer_call lc;
    memset(&lc, 0, sizeof lc);

    /* 1. Local work: checks, buffers, projections and RoPE; then every rank agrees on it. */
    mha_status st = prepare("mha_ring_layer_forward", cfg, p, rank, layer, local, alloc, &lc, err);
    if (!st)
        st = project_rotate(layer, local, &lc, exec, err);
    st = agree_status(comm, p, rank, st, err);

    /* 2. Ring attention on the shards (it agrees on its own arguments and result). */
    if (!st) {
        mha_attention_args core;
        core_args(layer, local, &lc, &core);
        st = mha_ring_attention(comm, cfg, &core, exec, err);
    }

    /* 3. The output projection of the rank's rows, then the final agreement (out of memory). */
    if (!st) {
        st = mha_layer_project(layer, MHA_PROJ_O, lc.B * lc.n, lc.att, local->out, exec, err);
        st = agree_status(comm, p, rank, st, err);
    }
    mha__dist_free(alloc, lc.q);
    mha__dist_free(alloc, lc.k);
    mha__dist_free(alloc, lc.v);
    mha__dist_free(alloc, lc.att);
    mha__dist_free(alloc, lc.pos);
    if (!st && err) {
        err->status = MHA_STATUS_OK;
        err->message[0] = '\0';
    }
    return st;
}

/* ---------------------------------------------------------------------------------------------- */
/* Backward                                                                                       */
/* ---------------------------------------------------------------------------------------------- */

/* The backward's buffers: the forward's lse, the gradients of the rank's rows dQ, dK, dV (like Q,
 * K, V), dA (like A) and dX [B, n, q_dim], and the weight gradients of the rank's rows packed in
 * one array (summed over the ranks by one MPI_Allreduce): dW_q, dW_k, dW_v, dW_o, then the biases
 * the layer has. */
typedef struct bwd_call {
    float *lse, *dq, *dk, *dv, *da, *dx, *pack;
    float *dsinks; /* [h], the whole gradient (the ring sums it), with sinks only */
    int64_t off[8], len[8], pack_len; /* dw_q, dw_k, dw_v, dw_o, db_q, db_k, db_v, db_o */
} bwd_call;

static void bwd_free(const mha_allocator *alloc, bwd_call *bc) {
    float *bufs[8] = {bc->lse, bc->dq, bc->dk, bc->dv, bc->da, bc->dx, bc->pack, bc->dsinks};
    for (int i = 0; i < 8; i++)
        mha__dist_free(alloc, bufs[i]);
}

/* The backward's own checks and buffers (after prepare()). */
static mha_status bwd_prepare(const mha_layer *layer,
                              const layer_call *lc,
                              const float *dy,
                              const mha_layer_grads *gr,
                              const mha_allocator *alloc,
                              bwd_call *bc,
                              mha_error *err) {
    const char *fn = "mha_ring_layer_backward";
    const mha_config *c = mha_layer_config(layer);
    /* dy may be NULL on a rank without rows (N < C). */
    const int missing = !gr || (!dy && lc->n > 0);
    if (missing || gr->d_key || gr->d_value || (gr->d_sinks && !c->sinks)) {
        mha__dist_error(err, MHA_STATUS_INVALID_ARG, "%s: %s", fn,
                        missing       ? "dy and grads must not be NULL"
                        : gr->d_sinks ? "grads.d_sinks is given but the layer has no sinks"
                                      : "self-attention: d_query receives every input path; d_key "
                                        "and d_value must be NULL");
        return MHA_STATUS_INVALID_ARG;
    }
    if ((gr->db_q && !c->bias_q) || (gr->db_k && !c->bias_k) || (gr->db_v && !c->bias_v) ||
        (gr->db_o && !c->bias_o)) {
        mha__dist_error(err, MHA_STATUS_INVALID_ARG,
                        "%s: a bias gradient is requested for a bias the layer lacks", fn);
        return MHA_STATUS_INVALID_ARG;
    }
    if (gr->d_probs) { /* the ring forward writes no probabilities */
        mha__dist_error(err, MHA_STATUS_UNSUPPORTED,
                        "%s: grads.d_probs (a loss that reads the probabilities) is not supported "
                        "by the ring",
                        fn);
        return MHA_STATUS_UNSUPPORTED;
    }
    const int64_t hk = lc->h * lc->dk, gk = lc->g * lc->dk, gv = lc->g * lc->dv;
    const int64_t hv = lc->h * lc->dv, qd = c->q_dim, od = c->out_dim;
    const int64_t lens[8] = {hk * qd,
                             gk * qd,
                             gv * qd,
                             od * hv,
                             c->bias_q ? hk : 0,
                             c->bias_k ? gk : 0,
                             c->bias_v ? gv : 0,
                             c->bias_o ? od : 0};
    bc->pack_len = 0;
    for (int i = 0; i < 8; i++) {
        bc->off[i] = bc->pack_len, bc->len[i] = lens[i];
        bc->pack_len += lens[i];
    }
    const int64_t rows = lc->B * lc->n;
    const size_t fb = sizeof(float);
    bc->lse = mha__dist_alloc(alloc, fb * (size_t)(lc->B * lc->h * lc->n));
    bc->dq = mha__dist_alloc(alloc, fb * (size_t)(rows * hk));
    bc->dk = mha__dist_alloc(alloc, fb * (size_t)(rows * gk));
    bc->dv = mha__dist_alloc(alloc, fb * (size_t)(rows * gv));
    bc->da = mha__dist_alloc(alloc, fb * (size_t)(rows * hv));
    bc->dx = mha__dist_alloc(alloc, fb * (size_t)(rows * qd));
    bc->pack = mha__dist_alloc(alloc, fb * (size_t)bc->pack_len);
    if (c->sinks)
        bc->dsinks = mha__dist_alloc(alloc, fb * (size_t)lc->h);
    if (!bc->lse || !bc->dq || !bc->dk || !bc->dv || !bc->da || !bc->dx || !bc->pack ||
        (c->sinks && !bc->dsinks)) {
        mha__dist_error(err, MHA_STATUS_NO_MEMORY, "%s: out of memory (gradients of %lld rows)", fn,
                        (long long)rows);
        return MHA_STATUS_NO_MEMORY;
    }
    memset(bc->dx, 0, fb * (size_t)(rows * qd));
    memset(bc->pack, 0, fb * (size_t)bc->pack_len);
    return MHA_STATUS_OK;
}

/* The projection's weight (and bias) gradient slots in the pack: i = 0..3 for Q, K, V, O. */
static float *pack_w(const bwd_call *bc, int i) {
    return bc->pack + bc->off[i];
}
static float *pack_b(const bwd_call *bc, int i) {
    return bc->len[4 + i] ? bc->pack + bc->off[4 + i] : NULL;
}

/* The rank's share, projections after the ring backward: dQ, dK rotated back (RoPE^T), then
 * dX = dQ W_q + dK W_k + dV W_v and dW_q = dQ^T X, ... added into the zeroed dx and pack. */
static mha_status input_grads(const mha_layer *layer,
                              const mha_forward_args *a,
                              const layer_call *lc,
                              const bwd_call *bc,
                              const mha_exec *exec,
                              mha_error *err) {
    mha_status st = rotate(layer, a, lc, bc->dq, bc->dk, 1, err);
    const float *d[3] = {bc->dq, bc->dk, bc->dv};
    const mha_projection which[3] = {MHA_PROJ_Q, MHA_PROJ_K, MHA_PROJ_V};
    /* A rank without rows (N < C) has no share: its dx is empty and its pack stays zero. */
    for (int i = 0; i < 3 && !st && lc->n > 0; i++)
        st = mha_layer_project_backward(layer, which[i], lc->B * lc->n, a->query, d[i], bc->dx,
                                        pack_w(bc, i), pack_b(bc, i), 1, exec, err);
    return st;
}

/* Sums the pack over the ranks (in place, in pieces of at most INT_MAX floats). */
static mha_status sum_pack(MPI_Comm comm, const bwd_call *bc, mha_error *err) {
    for (int64_t at = 0; at < bc->pack_len;) {
        const int64_t part = bc->pack_len - at < INT32_MAX ? bc->pack_len - at : INT32_MAX;
        if (MPI_Allreduce(MPI_IN_PLACE, bc->pack + at, (int)part, MPI_FLOAT, MPI_SUM, comm) !=
            MPI_SUCCESS) {
            mha__dist_error(err, MHA_STATUS_INTERNAL,
                            "mha_ring_layer_backward: MPI_Allreduce failed");
            return MHA_STATUS_INTERNAL;
        }
        at += part;
    }
    return MHA_STATUS_OK;
}

/* Writes (or adds) the rank's dX and the summed weight gradients into the caller's buffers. */
static void
deliver_grads(const layer_call *lc, const bwd_call *bc, int64_t q_dim, const mha_layer_grads *gr) {
    float *dst[10] = {gr->dw_q, gr->dw_k, gr->dw_v, gr->dw_o,    gr->db_q,
                      gr->db_k, gr->db_v, gr->db_o, gr->d_query, gr->d_sinks};
    for (int i = 0; i < 10; i++) {
        if (!dst[i])
            continue;
        const float *src = i < 8 ? bc->pack + bc->off[i] : (i == 8 ? bc->dx : bc->dsinks);
        const int64_t len = i < 8 ? bc->len[i] : (i == 8 ? lc->B * lc->n * q_dim : lc->h);
        for (int64_t e = 0; e < len; e++)
            dst[i][e] = gr->accumulate ? dst[i][e] + src[e] : src[e];
    }
}

mha_status mha_ring_layer_backward(MPI_Comm comm,
                                   const mha_ring_config *cfg,
                                   const mha_layer *layer,
                                   const mha_forward_args *local,
                                   const float *dy,
                                   const mha_layer_grads *grads,
                                   const mha_exec *exec,
                                   mha_error *err) {
    int p = 0, rank = 0;
    if (MPI_Comm_size(comm, &p) != MPI_SUCCESS || MPI_Comm_rank(comm, &rank) != MPI_SUCCESS) {
        mha__dist_error(err, MHA_STATUS_INVALID_ARG,
                        "mha_ring_layer_backward: comm is not a communicator");
        return MHA_STATUS_INVALID_ARG;
    }
    const mha_allocator *alloc = exec ? exec->allocator : NULL;
    layer_call lc;
    bwd_call bc;
    memset(&lc, 0, sizeof lc);
    memset(&bc, 0, sizeof bc);

    /* 1. The forward recomputed (activation recomputation: nothing is kept between the calls):
     * checks, buffers, Q, K, V, then ring attention with its lse. */
    mha_status st = prepare("mha_ring_layer_backward", cfg, p, rank, layer, local, alloc, &lc, err);
    if (!st)
        st = bwd_prepare(layer, &lc, dy, grads, alloc, &bc, err);
    if (!st)
        st = project_rotate(layer, local, &lc, exec, err);
    st = agree_status(comm, p, rank, st, err);
    mha_attention_args core;
    if (!st) {
        core_args(layer, local, &lc, &core);
        core.lse = bc.lse;
        st = mha_ring_attention(comm, cfg, &core, exec, err);
    }

    /* 2. dA = dY W_o (and dW_o, db_o), the ring backward to dQ, dK, dV of the rank's rows. */
    if (!st) {
        memset(bc.da, 0, sizeof(float) * (size_t)(lc.B * lc.n * lc.h * lc.dv));
        if (lc.n > 0) /* without rows: no share of dW_o, db_o (dy may be NULL) */
            st = mha_layer_project_backward(layer, MHA_PROJ_O, lc.B * lc.n, lc.att, dy, bc.da,
                                            pack_w(&bc, 3), pack_b(&bc, 3), 1, exec, err);
        st = agree_status(comm, p, rank, st, err);
    }
    if (!st) {
        mha_attention_grads g;
        memset(&g, 0, sizeof g);
        g.dout = bc.da, g.dq = bc.dq, g.dk = bc.dk, g.dv = bc.dv, g.dsinks = bc.dsinks;
        memcpy(g.dout_strides, core.out_strides, sizeof g.dout_strides);
        memcpy(g.dq_strides, core.q_strides, sizeof g.dq_strides);
        memcpy(g.dk_strides, core.k_strides, sizeof g.dk_strides);
        memcpy(g.dv_strides, core.v_strides, sizeof g.dv_strides);
        st = mha_ring_attention_backward(comm, cfg, &core, &g, exec, err);
    }

    /* 3. The rank's input gradients and weight shares, the weights' sum over the ranks. */
    if (!st) {
        st = input_grads(layer, local, &lc, &bc, exec, err);
        st = agree_status(comm, p, rank, st, err);
    }
    if (!st)
        st = sum_pack(comm, &bc, err);
    if (!st)
        deliver_grads(&lc, &bc, mha_layer_config(layer)->q_dim, grads);
    mha__dist_free(alloc, lc.q);
    mha__dist_free(alloc, lc.k);
    mha__dist_free(alloc, lc.v);
    mha__dist_free(alloc, lc.att);
    mha__dist_free(alloc, lc.pos);
    bwd_free(alloc, &bc);
    if (!st && err) {
        err->status = MHA_STATUS_OK;
        err->message[0] = '\0';
    }
    return st;
}
