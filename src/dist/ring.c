/* SPDX-License-Identifier: MIT */
/* ring.c: ring attention over MPI (mha_mpi.h), built on the public attention core only.
 *
 * Rank r holds its shard's rows of Q, K, V: one piece (CONTIGUOUS) or two (ZIGZAG) of global
 * rows. The K/V shards travel around the ring in P steps; at step t rank r holds the shard of
 * rank src = r - t (mod P), packed as K [B, g, n_src, d_k] and V [B, g, n_src, d_v] in one buffer.
 * For every pair (local query piece, held key piece) it computes the partial attention
 *   o_p, lse_p = mha_attention(Q piece, K piece, V piece)
 * with the causal mask in global positions: key j of a piece starting at ks is visible to query i
 * of a piece starting at qs iff ks + j <= qs + i, i.e. the core's causal mask with
 * delta = qs - ks (MHA_ALIGN_EXPLICIT). A pair no row of which sees a key is skipped; a pair every
 * row of which sees every key runs without the mask. The partials are merged into the output by
 * their log-sum-exp:
 *   lse = log(e^lse_a + e^lse_b),  o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b
 * (mha_attention_merge; a partial with lse = -inf contributes nothing). Sinks enter once, with
 * the step-0 pair of a piece with itself (the diagonal pair, which every row of a causal piece
 * sees part of).
 *
 * Backward: the same walk; each pair runs the core's backward with the forward's final lse and O
 * (P = exp(S - lse), D_i = dO_i . O_i are the whole sequence's), so its shares of dQ, dK, dV are
 * exact and add up; dK / dV of the held shard travel with it and reach their owner after P steps.
 *
 * Overlap: at step t the receive of the next shard (from r - 1) and the send of the held one (to
 * r + 1) are posted before the attention on the held shard and completed after it: double
 * buffering, so the transfer runs behind the compute.
 *
 * Failure: every check runs before any communication, and an allreduce agrees on the outcome and
 * on the global sizes; a compute error during the ring (which the checks make unexpected) keeps
 * the communication going and is agreed on at the end, so no rank is left waiting. */
#include "mha_mpi.h"

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { RING_TAG = 0x6d68 }; /* on a duplicate of the caller's communicator: no clash */

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static mha_status
fail(mha_error *err, mha_status status, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        err->status = status;
        vsnprintf(err->message, sizeof err->message, fmt, ap);
        va_end(ap);
    }
    return status;
}

mha_status mha_shard_rows(mha_shard_layout layout,
                          int64_t seq_len,
                          int ranks,
                          int rank,
                          int piece,
                          int64_t *start,
                          int64_t *count,
                          mha_error *err) {
    if (!start || !count)
        return fail(err, MHA_STATUS_INVALID_ARG, "mha_shard_rows: start and count are required");
    if (ranks < 1 || rank < 0 || rank >= ranks || piece < 0 || piece > 1 || seq_len < 0)
        return fail(err, MHA_STATUS_INVALID_ARG,
                    "mha_shard_rows: rank=%d of ranks=%d, piece=%d, seq_len=%lld out of range",
                    rank, ranks, piece, (long long)seq_len);
    if (layout != MHA_SHARD_CONTIGUOUS && layout != MHA_SHARD_ZIGZAG)
        return fail(err, MHA_STATUS_INVALID_ARG, "mha_shard_rows: unknown layout %d", (int)layout);
    /* chunks of N / C rows, the first N % C one longer; chunk c starts at c * base + min(c, rem) */
    const int64_t chunks = layout == MHA_SHARD_ZIGZAG ? 2 * (int64_t)ranks : ranks;
    const int64_t base = seq_len / chunks, rem = seq_len % chunks;
    if (layout == MHA_SHARD_CONTIGUOUS && piece == 1) {
        *start = seq_len, *count = 0;
        return MHA_STATUS_OK;
    }
    const int64_t c = piece == 0 ? rank : chunks - 1 - rank;
    *start = c * base + (c < rem ? c : rem);
    *count = base + (c < rem);
    return MHA_STATUS_OK;
}

/* The (at most two) pieces of a rank's shard: global start, row count, offset in the shard. */
typedef struct shard {
    int64_t start[2], count[2], offset[2];
    int64_t rows;
} shard;

static shard shard_of(mha_shard_layout layout, int64_t seq_len, int ranks, int rank) {
    shard s;
    s.rows = 0;
    for (int p = 0; p < 2; p++) {
        mha_shard_rows(layout, seq_len, ranks, rank, p, &s.start[p], &s.count[p], NULL);
        s.offset[p] = s.rows;
        s.rows += s.count[p];
    }
    return s;
}

/* Everything a rank can check alone, before any communication. */
static mha_status check_local(const mha_ring_args *a,
                              int backward,
                              const mha_attention_grads *grads,
                              const mha_exec *exec,
                              int ranks,
                              int rank,
                              mha_error *err) {
    if (!a)
        return fail(err, MHA_STATUS_INVALID_ARG, "mha_ring_attention: args is NULL");
    if (a->layout != MHA_SHARD_CONTIGUOUS && a->layout != MHA_SHARD_ZIGZAG)
        return fail(err, MHA_STATUS_INVALID_ARG, "mha_ring_attention: unknown layout %d",
                    (int)a->layout);
    const int64_t chunks = a->layout == MHA_SHARD_ZIGZAG ? 2 * (int64_t)ranks : ranks;
    if (a->seq_len < chunks) /* every rank holds at least one row (of each piece) */
        return fail(err, MHA_STATUS_INVALID_ARG,
                    "mha_ring_attention: seq_len=%lld is shorter than the %lld chunks of %d ranks",
                    (long long)a->seq_len, (long long)chunks, ranks);
    const mha_attention_args *l = &a->local;
    const shard s = shard_of(a->layout, a->seq_len, ranks, rank);
    if (l->q_len != s.rows || l->kv_len != s.rows)
        return fail(err, MHA_STATUS_INVALID_ARG,
                    "mha_ring_attention: rank %d holds %lld rows of seq_len=%lld, but local.q_len="
                    "%lld and local.kv_len=%lld",
                    rank, (long long)s.rows, (long long)a->seq_len, (long long)l->q_len,
                    (long long)l->kv_len);
    const mha_masking *m = &l->mask;
    if (m->alignment == MHA_ALIGN_EXPLICIT || m->use_window || m->bool_mask.data ||
        m->additive_mask.data || m->key_padding.data || m->q_segment_ids || m->kv_segment_ids ||
        l->alibi || l->probs || (l->dropout.training && l->dropout.p > 0.0f))
        return fail(err, MHA_STATUS_UNSUPPORTED,
                    "mha_ring_attention: only the causal mask (global positions) is supported; "
                    "explicit alignment, windows, masks, key padding, segments, ALiBi, dropout "
                    "and probabilities are not (yet)");
    if (!backward)
        return mha_attention_supported(l, exec, err);
    if (!grads || !l->out || !l->lse || !grads->dout)
        return fail(err, MHA_STATUS_INVALID_ARG,
                    "mha_ring_attention_backward: grads, grads->dout, and local.out and "
                    "local.lse (the forward's results) are required");
    if (l->num_heads > 1024)
        return fail(err, MHA_STATUS_UNSUPPORTED,
                    "mha_ring_attention_backward: num_heads=%lld > 1024", (long long)l->num_heads);
    size_t bytes = 0; /* checks fwd and grads as mha_attention_backward will */
    return mha_attention_backward_workspace_size(l, grads, exec, &bytes, err);
}

/* Agrees on the outcome and the global sizes: status is the worst of every rank's, and a field
 * that differs between ranks is an INVALID_ARG on all of them. */
static mha_status agree(MPI_Comm comm, mha_status local, const mha_ring_args *a, mha_error *err) {
    enum { F = 9 };
    static const char *const names[F] = {"status",   "seq_len",    "layout",
                                         "batch",    "num_heads",  "num_kv_heads",
                                         "head_dim", "v_head_dim", "mask.causal"};
    const mha_attention_args *l = a ? &a->local : NULL;
    int64_t v[2 * F] = {local};
    if (l) {
        const int64_t f[F] = {local,
                              a->seq_len,
                              a->layout,
                              l->batch,
                              l->num_heads,
                              l->num_kv_heads ? l->num_kv_heads : l->num_heads,
                              l->head_dim,
                              l->v_head_dim ? l->v_head_dim : l->head_dim,
                              l->mask.causal != 0};
        for (int i = 0; i < F; i++)
            v[i] = f[i], v[F + i] = -f[i];
    }
    if (MPI_Allreduce(MPI_IN_PLACE, v, 2 * F, MPI_INT64_T, MPI_MAX, comm) != MPI_SUCCESS)
        return fail(err, MHA_STATUS_INTERNAL, "mha_ring_attention: MPI_Allreduce failed");
    if (local != MHA_STATUS_OK)
        return local; /* this rank's own message stands */
    if (v[0] != MHA_STATUS_OK)
        return fail(err, (mha_status)v[0],
                    "mha_ring_attention: another rank's call failed (%s); see its error",
                    mha_status_string((mha_status)v[0]));
    for (int i = 1; i < F; i++)
        if (v[i] != -v[F + i])
            return fail(err, MHA_STATUS_INVALID_ARG,
                        "mha_ring_attention: ranks disagree on %s (from %lld to %lld)", names[i],
                        (long long)-v[F + i], (long long)v[i]);
    return MHA_STATUS_OK;
}

/* The buffers of one call: two K/V shard buffers (double buffering), one partial (o, lse) of a
 * query piece, and the running lse when the caller does not want it. */
typedef struct ring_buffers {
    float *kv[2];
    float *dkv[2]; /* backward: the held shard's dK, then dV, travelling with it */
    float *part_o, *part_lse, *own_lse;
    int64_t *delta; /* [B]: a pair's causal offset, one per batch row */
} ring_buffers;

static void free_buffers(ring_buffers *b) {
    for (int i = 0; i < 2; i++) {
        free(b->kv[i]);
        free(b->dkv[i]);
    }
    free(b->part_o);
    free(b->part_lse);
    free(b->own_lse);
    free(b->delta);
}

/* Sizes: the largest shard (chunk sizes differ by at most one row per chunk). */
static mha_status
alloc_buffers(const mha_ring_args *a, int ranks, int backward, ring_buffers *b, mha_error *err) {
    const mha_attention_args *l = &a->local;
    const int64_t g = l->num_kv_heads ? l->num_kv_heads : l->num_heads;
    const int64_t dv = l->v_head_dim ? l->v_head_dim : l->head_dim;
    int64_t rows = 0; /* the largest shard */
    for (int r = 0; r < ranks; r++) {
        const int64_t n = shard_of(a->layout, a->seq_len, ranks, r).rows;
        rows = n > rows ? n : rows;
    }
    memset(b, 0, sizeof *b);
    const double kvf = (double)l->batch * (double)g * (double)rows * (double)(l->head_dim + dv);
    const double of = (double)l->batch * (double)l->num_heads * (double)rows * (double)dv;
    if (kvf > (double)INT_MAX) /* MPI counts are int */
        return fail(err, MHA_STATUS_OVERFLOW,
                    "mha_ring_attention: a K/V shard of %.0f floats exceeds one MPI message "
                    "(INT_MAX elements)",
                    kvf);
    /* of <= B h N d_v, which the caller's own output of the whole sequence would hold */
    const size_t lse_n = (size_t)(l->batch * l->num_heads * rows);
    b->kv[0] = malloc(sizeof(float) * (size_t)kvf);
    b->kv[1] = malloc(sizeof(float) * (size_t)kvf);
    b->part_o = malloc(sizeof(float) * (size_t)of);
    b->part_lse = malloc(sizeof(float) * lse_n);
    b->own_lse = l->lse ? NULL : malloc(sizeof(float) * lse_n);
    b->delta = malloc(sizeof(int64_t) * (size_t)l->batch);
    for (int i = 0; i < 2 && backward; i++)
        b->dkv[i] = malloc(sizeof(float) * (size_t)kvf);
    if (!b->kv[0] || !b->kv[1] || !b->part_o || !b->part_lse || (!l->lse && !b->own_lse) ||
        !b->delta || (backward && (!b->dkv[0] || !b->dkv[1]))) {
        free_buffers(b);
        return fail(err, MHA_STATUS_NO_MEMORY, "mha_ring_attention: out of memory (%.0f floats)",
                    2 * kvf + of);
    }
    return MHA_STATUS_OK;
}

/* Packs this rank's K and V ([B, g, n, d] through the caller's strides) into buf. */
static void pack_kv(const mha_attention_args *l, float *buf) {
    const int64_t g = l->num_kv_heads ? l->num_kv_heads : l->num_heads;
    const int64_t dk = l->head_dim, dv = l->v_head_dim ? l->v_head_dim : dk, n = l->kv_len;
    float *vbuf = buf + l->batch * g * n * dk;
    for (int64_t b = 0; b < l->batch; b++)
        for (int64_t h = 0; h < g; h++)
            for (int64_t i = 0; i < n; i++) {
                const float *kr =
                    l->k + b * l->k_strides[0] + h * l->k_strides[1] + i * l->k_strides[2];
                const float *vr =
                    l->v + b * l->v_strides[0] + h * l->v_strides[1] + i * l->v_strides[2];
                memcpy(buf + ((b * g + h) * n + i) * dk, kr, sizeof(float) * (size_t)dk);
                memcpy(vbuf + ((b * g + h) * n + i) * dv, vr, sizeof(float) * (size_t)dv);
            }
}

/* One pair: query piece qp of this rank against key piece kp of the held shard (of rank src,
 * `held` packed rows). */
typedef struct ring_pair {
    const mha_ring_args *a;
    const shard *mine, *held;
    const float *kv; /* the held shard's packed K, then V */
    int qp, kp;
    int with_sinks;
} ring_pair;

/* The core arguments of pair p: Q rows of the query piece (the caller's strides), K / V rows of
 * the key piece (packed strides), the causal mask in global positions (delta [B] is filled when
 * it is needed); out and lse are left to the caller. Returns 0 when no row sees a key. */
static int pair_args(const ring_pair *p, int64_t *delta, mha_attention_args *c) {
    const mha_attention_args *l = &p->a->local;
    const int64_t qs = p->mine->start[p->qp], nq = p->mine->count[p->qp];
    const int64_t ks = p->held->start[p->kp], nk = p->held->count[p->kp];
    if (nq == 0 || nk == 0 || (l->mask.causal && ks > qs + nq - 1))
        return 0;
    const int64_t B = l->batch, g = l->num_kv_heads ? l->num_kv_heads : l->num_heads;
    const int64_t dk = l->head_dim, dv = l->v_head_dim ? l->v_head_dim : dk, n = p->held->rows;
    const int64_t k0 = p->held->offset[p->kp];
    *c = *l;
    c->q = l->q + p->mine->offset[p->qp] * l->q_strides[2];
    c->q_len = nq, c->kv_len = nk;
    c->k = p->kv + k0 * dk;
    c->k_strides[0] = g * n * dk, c->k_strides[1] = n * dk, c->k_strides[2] = dk;
    c->v = p->kv + B * g * n * dk + k0 * dv;
    c->v_strides[0] = g * n * dv, c->v_strides[1] = n * dv, c->v_strides[2] = dv;
    c->sinks = p->with_sinks ? l->sinks : NULL;
    memset(&c->mask, 0, sizeof c->mask);
    if (l->mask.causal && ks + nk - 1 > qs) { /* else row 0 already sees every key */
        for (int64_t i = 0; i < B; i++)
            delta[i] = qs - ks; /* key j visible to row i iff j <= i + qs - ks */
        c->mask.causal = 1, c->mask.alignment = MHA_ALIGN_EXPLICIT, c->mask.align_offsets = delta;
    }
    return 1;
}

/* Forward of pair p, merged into the rank's out / lse rows. */
static mha_status
attend_pair(const ring_pair *p, ring_buffers *b, float *lse, const mha_exec *exec, mha_error *err) {
    mha_attention_args c;
    if (!pair_args(p, b->delta, &c))
        return MHA_STATUS_OK;
    const mha_attention_args *l = &p->a->local;
    const int64_t h = l->num_heads, dv = l->v_head_dim ? l->v_head_dim : l->head_dim;
    const int64_t nq = c.q_len, q0 = p->mine->offset[p->qp], n_local = p->mine->rows;
    c.out = b->part_o;
    c.out_strides[0] = h * nq * dv, c.out_strides[1] = nq * dv, c.out_strides[2] = dv;
    c.lse = b->part_lse;
    mha_status st = mha_attention(&c, exec, err);
    for (int64_t bi = 0; st == MHA_STATUS_OK && bi < l->batch; bi++)
        for (int64_t hi = 0; st == MHA_STATUS_OK && hi < h; hi++) {
            float *o =
                l->out + bi * l->out_strides[0] + hi * l->out_strides[1] + q0 * l->out_strides[2];
            float *ls = lse + (bi * h + hi) * n_local + q0;
            const float *po = b->part_o + (bi * h + hi) * nq * dv;
            st = mha_attention_merge(nq, dv, o, l->out_strides[2], ls, po, dv,
                                     b->part_lse + (bi * h + hi) * nq, o, l->out_strides[2], ls,
                                     err);
        }
    return st;
}

/* Posts the receive of the next shard's n_in floats from prev into `in` and the send of the held
 * shard's n_out floats from `out` to next. */
static mha_status shift(MPI_Comm comm,
                        const float *out,
                        int64_t n_out,
                        float *in,
                        int64_t n_in,
                        int next,
                        int prev,
                        MPI_Request req[2],
                        mha_error *err) {
    if (MPI_Irecv(in, (int)n_in, MPI_FLOAT, prev, RING_TAG, comm, &req[0]) != MPI_SUCCESS ||
        MPI_Isend(out, (int)n_out, MPI_FLOAT, next, RING_TAG, comm, &req[1]) != MPI_SUCCESS)
        return fail(err, MHA_STATUS_INTERNAL, "mha_ring_attention: MPI_Isend/Irecv failed");
    return MHA_STATUS_OK;
}

static mha_status wait2(MPI_Request req[2], mha_error *err) {
    if (MPI_Waitall(2, req, MPI_STATUSES_IGNORE) != MPI_SUCCESS)
        return fail(err, MHA_STATUS_INTERNAL, "mha_ring_attention: MPI_Waitall failed");
    return MHA_STATUS_OK;
}

/* One call: who this rank is in the ring, the arguments, and this rank's rows. */
typedef struct ring_call {
    MPI_Comm comm; /* a duplicate of the caller's */
    int ranks, rank, next, prev;
    const mha_ring_args *a;
    const mha_attention_grads *grads; /* backward only */
    shard mine;
} ring_call;

/* Floats of rank src's packed shard (K then V, or dK then dV). */
static int64_t shard_floats(const ring_call *r, int src) {
    const mha_attention_args *l = &r->a->local;
    const int64_t g = l->num_kv_heads ? l->num_kv_heads : l->num_heads;
    const int64_t d = l->head_dim + (l->v_head_dim ? l->v_head_dim : l->head_dim);
    return l->batch * g * shard_of(r->a->layout, r->a->seq_len, r->ranks, src).rows * d;
}

/* Backward of pair p: dQ rows of the query piece and the held shard's dK / dV rows of the key
 * piece accumulate. P is recomputed from the forward's final lse and D_i = dO_i . O_i from its
 * final O, so every pair's share is exact and the shares add up. */
static mha_status grad_pair(const ring_pair *p,
                            const mha_attention_grads *grads,
                            ring_buffers *b,
                            float *dkv,
                            float *dsinks,
                            const mha_exec *exec,
                            mha_error *err) {
    mha_attention_args c;
    if (!pair_args(p, b->delta, &c))
        return MHA_STATUS_OK;
    const mha_attention_args *l = &p->a->local;
    const int64_t h = l->num_heads, g = l->num_kv_heads ? l->num_kv_heads : h;
    const int64_t dk = l->head_dim, dv = l->v_head_dim ? l->v_head_dim : dk;
    const int64_t nq = c.q_len, q0 = p->mine->offset[p->qp], n_local = p->mine->rows;
    const int64_t n = p->held->rows, k0 = p->held->offset[p->kp];
    c.out = l->out + q0 * l->out_strides[2];
    for (int64_t bh = 0; bh < l->batch * h; bh++) /* the piece's lse rows, contiguous */
        memcpy(b->part_lse + bh * nq, l->lse + bh * n_local + q0, sizeof(float) * (size_t)nq);
    c.lse = b->part_lse;
    mha_attention_grads gr = *grads;
    gr.dout = grads->dout + q0 * grads->dout_strides[2];
    gr.dq = grads->dq ? grads->dq + q0 * grads->dq_strides[2] : NULL;
    gr.dk = dkv + k0 * dk;
    gr.dk_strides[0] = g * n * dk, gr.dk_strides[1] = n * dk, gr.dk_strides[2] = dk;
    gr.dv = dkv + l->batch * g * n * dk + k0 * dv;
    gr.dv_strides[0] = g * n * dv, gr.dv_strides[1] = n * dv, gr.dv_strides[2] = dv;
    gr.dsinks = c.sinks ? dsinks : NULL;
    gr.accumulate = 1;
    return mha_attention_backward(&c, &gr, exec, err);
}

/* dst (strided [B, g, n, d]) = (or +=) the packed src [B, g, n, d]. */
static void unpack_rows(const float *src,
                        int64_t B,
                        int64_t g,
                        int64_t n,
                        int64_t d,
                        float *dst,
                        const int64_t strides[3],
                        int accumulate) {
    for (int64_t bi = 0; bi < B; bi++)
        for (int64_t hi = 0; hi < g; hi++)
            for (int64_t i = 0; i < n; i++) {
                float *o = dst + bi * strides[0] + hi * strides[1] + i * strides[2];
                const float *x = src + ((bi * g + hi) * n + i) * d;
                for (int64_t e = 0; e < d; e++)
                    o[e] = accumulate ? o[e] + x[e] : x[e];
            }
}

/* The P steps of either direction; returns this rank's compute status (the communication
 * always completes unless MPI itself fails). At step t rank r holds rank r - t's K/V (the
 * backward: and its dK / dV, to which every holder adds); the next shard is posted before the
 * compute on the held one and completed after. The backward then passes the held shard's dK / dV
 * on to r + 1: its next holder, or after the last step (rank r then holds rank r + 1's shard) its
 * owner. */
static mha_status ring_walk(const ring_call *r,
                            ring_buffers *b,
                            float *lse,
                            float *dsinks,
                            const mha_exec *exec,
                            mha_error *err) {
    pack_kv(&r->a->local, b->kv[0]);
    if (r->grads)
        memset(b->dkv[0], 0, sizeof(float) * (size_t)shard_floats(r, r->rank));
    mha_status st = MHA_STATUS_OK;
    for (int t = 0; t < r->ranks; t++) {
        const int src = (r->rank - t + r->ranks) % r->ranks, in = (src + r->ranks - 1) % r->ranks;
        const shard held = shard_of(r->a->layout, r->a->seq_len, r->ranks, src);
        const int more = t + 1 < r->ranks;
        MPI_Request req[2];
        if (more && shift(r->comm, b->kv[t % 2], shard_floats(r, src), b->kv[(t + 1) % 2],
                          shard_floats(r, in), r->next, r->prev, req, err) != MHA_STATUS_OK)
            return MHA_STATUS_INTERNAL;
        for (int qp = 0; qp < 2 && st == MHA_STATUS_OK; qp++)
            for (int kp = 0; kp < 2 && st == MHA_STATUS_OK; kp++) {
                const ring_pair pair = {r->a, &r->mine,          &held, b->kv[t % 2], qp,
                                        kp,   t == 0 && qp == kp};
                st = r->grads ? grad_pair(&pair, r->grads, b, b->dkv[t % 2], dsinks, exec, err)
                              : attend_pair(&pair, b, lse, exec, err);
            }
        if (more && wait2(req, err) != MHA_STATUS_OK)
            return MHA_STATUS_INTERNAL;
        if (r->grads && r->ranks > 1 &&
            (shift(r->comm, b->dkv[t % 2], shard_floats(r, src), b->dkv[(t + 1) % 2],
                   shard_floats(r, in), r->next, r->prev, req, err) != MHA_STATUS_OK ||
             wait2(req, err) != MHA_STATUS_OK))
            return MHA_STATUS_INTERNAL;
    }
    return st;
}

/* Forward: lse starts at -inf (nothing merged yet: the output rows are ignored until then). */
static mha_status
ring_forward(const ring_call *r, ring_buffers *b, const mha_exec *exec, mha_error *err) {
    const mha_attention_args *l = &r->a->local;
    float *lse = l->lse ? l->lse : b->own_lse;
    for (int64_t i = 0; i < l->batch * l->num_heads * r->mine.rows; i++)
        lse[i] = -INFINITY;
    return ring_walk(r, b, lse, NULL, exec, err);
}

/* Backward: dQ starts at 0 unless accumulating; after the walk this rank's own dK / dV are
 * written (or added) to the caller's, and dsinks is summed over the ranks. */
static mha_status
ring_backward(const ring_call *r, ring_buffers *b, const mha_exec *exec, mha_error *err) {
    const mha_attention_args *l = &r->a->local;
    const mha_attention_grads *gr = r->grads;
    const int64_t h = l->num_heads, g = l->num_kv_heads ? l->num_kv_heads : h;
    const int64_t dk = l->head_dim, dv = l->v_head_dim ? l->v_head_dim : dk, n = r->mine.rows;
    if (gr->dq && !gr->accumulate)
        for (int64_t bi = 0; bi < l->batch; bi++)
            for (int64_t hi = 0; hi < h; hi++)
                for (int64_t i = 0; i < n; i++)
                    memset(gr->dq + bi * gr->dq_strides[0] + hi * gr->dq_strides[1] +
                               i * gr->dq_strides[2],
                           0, sizeof(float) * (size_t)dk);
    float dsinks[1024] = {0}; /* h <= 1024 (checked) */
    const mha_status st = ring_walk(r, b, NULL, dsinks, exec, err);
    /* this rank's own dK / dV: the last shift received them into dkv[P % 2]; with P = 1 they
     * never moved from dkv[0] */
    const float *own = b->dkv[r->ranks > 1 ? r->ranks % 2 : 0];
    if (st == MHA_STATUS_OK && gr->dk)
        unpack_rows(own, l->batch, g, n, dk, gr->dk, gr->dk_strides, gr->accumulate);
    if (st == MHA_STATUS_OK && gr->dv)
        unpack_rows(own + l->batch * g * n * dk, l->batch, g, n, dv, gr->dv, gr->dv_strides,
                    gr->accumulate);
    if (l->sinks &&
        MPI_Allreduce(MPI_IN_PLACE, dsinks, (int)h, MPI_FLOAT, MPI_SUM, r->comm) != MPI_SUCCESS)
        return fail(err, MHA_STATUS_INTERNAL, "mha_ring_attention_backward: MPI_Allreduce failed");
    for (int64_t i = 0; st == MHA_STATUS_OK && gr->dsinks && i < h; i++)
        gr->dsinks[i] = gr->accumulate ? gr->dsinks[i] + dsinks[i] : dsinks[i];
    return st;
}

/* Both entry points: the checks, the buffers and their agreement, the ring on a duplicate of
 * comm, then the agreement on the outcome (a compute error on one rank is everyone's). */
static mha_status ring_run(MPI_Comm comm,
                           const mha_ring_args *args,
                           int backward,
                           const mha_attention_grads *grads,
                           const mha_exec *exec,
                           mha_error *err) {
    ring_call r;
    memset(&r, 0, sizeof r);
    r.a = args, r.grads = grads;
    if (MPI_Comm_size(comm, &r.ranks) != MPI_SUCCESS || MPI_Comm_rank(comm, &r.rank) != MPI_SUCCESS)
        return fail(err, MHA_STATUS_INVALID_ARG, "mha_ring_attention: not a valid communicator");
    r.next = (r.rank + 1) % r.ranks, r.prev = (r.rank + r.ranks - 1) % r.ranks;
    ring_buffers b;
    memset(&b, 0, sizeof b);
    mha_status st = check_local(args, backward, grads, exec, r.ranks, r.rank, err);
    if (st == MHA_STATUS_OK) {
        r.mine = shard_of(args->layout, args->seq_len, r.ranks, r.rank);
        st = alloc_buffers(args, r.ranks, backward, &b, err);
    }
    st = agree(comm, st, args, err);
    if (st == MHA_STATUS_OK && MPI_Comm_dup(comm, &r.comm) != MPI_SUCCESS)
        st = fail(err, MHA_STATUS_INTERNAL, "mha_ring_attention: MPI_Comm_dup failed");
    if (st != MHA_STATUS_OK) {
        free_buffers(&b);
        return st;
    }
    st = backward ? ring_backward(&r, &b, exec, err) : ring_forward(&r, &b, exec, err);
    int worst = (int)st;
    MPI_Allreduce(MPI_IN_PLACE, &worst, 1, MPI_INT, MPI_MAX, r.comm);
    MPI_Comm_free(&r.comm);
    free_buffers(&b);
    if (st == MHA_STATUS_OK && worst != MHA_STATUS_OK)
        return fail(err, (mha_status)worst, "mha_ring_attention: another rank's call failed (%s)",
                    mha_status_string((mha_status)worst));
    return st;
}

mha_status
mha_ring_attention(MPI_Comm comm, const mha_ring_args *args, const mha_exec *exec, mha_error *err) {
    return ring_run(comm, args, 0, NULL, exec, err);
}

mha_status mha_ring_attention_backward(MPI_Comm comm,
                                       const mha_ring_args *args,
                                       const mha_attention_grads *grads,
                                       const mha_exec *exec,
                                       mha_error *err) {
    return ring_run(comm, args, 1, grads, exec, err);
}
