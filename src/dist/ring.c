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
static mha_status
check_local(const mha_ring_args *a, const mha_exec *exec, int ranks, int rank, mha_error *err) {
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
    return mha_attention_supported(l, exec, err);
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
    float *part_o, *part_lse, *own_lse;
} ring_buffers;

static void free_buffers(ring_buffers *b) {
    free(b->kv[0]);
    free(b->kv[1]);
    free(b->part_o);
    free(b->part_lse);
    free(b->own_lse);
}

/* Sizes: the largest shard (chunk sizes differ by at most one row per chunk). */
static mha_status
alloc_buffers(const mha_ring_args *a, int ranks, ring_buffers *b, mha_error *err) {
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
    if (!b->kv[0] || !b->kv[1] || !b->part_o || !b->part_lse || (!l->lse && !b->own_lse)) {
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
 * `held` packed rows), merged into out / lse. */
typedef struct ring_pair {
    const mha_ring_args *a;
    const shard *mine, *held;
    const float *kv; /* the held shard's packed K, then V */
    int qp, kp;
    int with_sinks;
} ring_pair;

static mha_status
attend_pair(const ring_pair *p, ring_buffers *b, float *lse, const mha_exec *exec, mha_error *err) {
    const mha_attention_args *l = &p->a->local;
    const int64_t qs = p->mine->start[p->qp], nq = p->mine->count[p->qp];
    const int64_t ks = p->held->start[p->kp], nk = p->held->count[p->kp];
    if (nq == 0 || nk == 0 || (l->mask.causal && ks > qs + nq - 1))
        return MHA_STATUS_OK; /* no row of the piece sees a key of the other */
    const int64_t B = l->batch, h = l->num_heads;
    const int64_t g = l->num_kv_heads ? l->num_kv_heads : h;
    const int64_t dk = l->head_dim, dv = l->v_head_dim ? l->v_head_dim : dk, n = p->held->rows;
    const int64_t q0 = p->mine->offset[p->qp], k0 = p->held->offset[p->kp];
    mha_attention_args c = *l;
    c.q = l->q + q0 * l->q_strides[2];
    c.q_len = nq, c.kv_len = nk;
    c.k = p->kv + k0 * dk;
    c.k_strides[0] = g * n * dk, c.k_strides[1] = n * dk, c.k_strides[2] = dk;
    c.v = p->kv + B * g * n * dk + k0 * dv;
    c.v_strides[0] = g * n * dv, c.v_strides[1] = n * dv, c.v_strides[2] = dv;
    c.out = b->part_o;
    c.out_strides[0] = h * nq * dv, c.out_strides[1] = nq * dv, c.out_strides[2] = dv;
    c.lse = b->part_lse;
    c.sinks = p->with_sinks ? l->sinks : NULL;
    int64_t *delta = NULL;
    const int every_key = !l->mask.causal || ks + nk - 1 <= qs; /* row 0 already sees them all */
    memset(&c.mask, 0, sizeof c.mask);
    if (!every_key) {
        delta = malloc(sizeof(int64_t) * (size_t)B);
        if (!delta)
            return fail(err, MHA_STATUS_NO_MEMORY, "mha_ring_attention: out of memory");
        for (int64_t i = 0; i < B; i++)
            delta[i] = qs - ks; /* key j visible to row i iff j <= i + qs - ks */
        c.mask.causal = 1, c.mask.alignment = MHA_ALIGN_EXPLICIT, c.mask.align_offsets = delta;
    }
    mha_status st = mha_attention(&c, exec, err);
    free(delta);
    const int64_t n_local = p->mine->rows;
    for (int64_t bi = 0; st == MHA_STATUS_OK && bi < B; bi++)
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

/* The P steps of the ring; returns this rank's compute status (communication always completes
 * unless MPI itself fails). */
static mha_status run_ring(MPI_Comm comm,
                           int ranks,
                           int rank,
                           const mha_ring_args *a,
                           ring_buffers *b,
                           const mha_exec *exec,
                           mha_error *err) {
    const mha_attention_args *l = &a->local;
    const shard mine = shard_of(a->layout, a->seq_len, ranks, rank);
    float *lse = l->lse ? l->lse : b->own_lse;
    for (int64_t i = 0; i < l->batch * l->num_heads * mine.rows; i++)
        lse[i] = -INFINITY; /* nothing merged yet: the output rows are ignored until then */
    pack_kv(l, b->kv[0]);
    const int64_t g = l->num_kv_heads ? l->num_kv_heads : l->num_heads;
    const int64_t d = l->head_dim + (l->v_head_dim ? l->v_head_dim : l->head_dim);
    const int next = (rank + 1) % ranks, prev = (rank + ranks - 1) % ranks;
    mha_status st = MHA_STATUS_OK;
    for (int t = 0; t < ranks; t++) {
        const int src = (rank - t + ranks) % ranks;
        const shard held = shard_of(a->layout, a->seq_len, ranks, src);
        MPI_Request req[2];
        int nreq = 0;
        if (t + 1 < ranks) { /* the next shard comes from prev: it is rank src - 1's */
            const shard incoming =
                shard_of(a->layout, a->seq_len, ranks, (src + ranks - 1) % ranks);
            const int n_in = (int)(l->batch * g * incoming.rows * d);
            const int n_out = (int)(l->batch * g * held.rows * d);
            if (MPI_Irecv(b->kv[(t + 1) % 2], n_in, MPI_FLOAT, prev, RING_TAG, comm, &req[0]) !=
                    MPI_SUCCESS ||
                MPI_Isend(b->kv[t % 2], n_out, MPI_FLOAT, next, RING_TAG, comm, &req[1]) !=
                    MPI_SUCCESS)
                return fail(err, MHA_STATUS_INTERNAL, "mha_ring_attention: MPI_Isend/Irecv failed");
            nreq = 2;
        }
        for (int qp = 0; qp < 2 && st == MHA_STATUS_OK; qp++)
            for (int kp = 0; kp < 2 && st == MHA_STATUS_OK; kp++) {
                const ring_pair pair = {a, &mine, &held, b->kv[t % 2], qp, kp, t == 0 && qp == kp};
                st = attend_pair(&pair, b, lse, exec, err);
            }
        if (nreq && MPI_Waitall(nreq, req, MPI_STATUSES_IGNORE) != MPI_SUCCESS)
            return fail(err, MHA_STATUS_INTERNAL, "mha_ring_attention: MPI_Waitall failed");
    }
    return st;
}

mha_status
mha_ring_attention(MPI_Comm comm, const mha_ring_args *args, const mha_exec *exec, mha_error *err) {
    int ranks = 0, rank = 0;
    if (MPI_Comm_size(comm, &ranks) != MPI_SUCCESS || MPI_Comm_rank(comm, &rank) != MPI_SUCCESS)
        return fail(err, MHA_STATUS_INVALID_ARG, "mha_ring_attention: not a valid communicator");
    ring_buffers b;
    memset(&b, 0, sizeof b);
    mha_status st = check_local(args, exec, ranks, rank, err);
    if (st == MHA_STATUS_OK)
        st = alloc_buffers(args, ranks, &b, err);
    st = agree(comm, st, args, err);
    if (st != MHA_STATUS_OK) {
        free_buffers(&b);
        return st;
    }
    MPI_Comm ring;
    if (MPI_Comm_dup(comm, &ring) != MPI_SUCCESS) {
        free_buffers(&b);
        return fail(err, MHA_STATUS_INTERNAL, "mha_ring_attention: MPI_Comm_dup failed");
    }
    st = run_ring(ring, ranks, rank, args, &b, exec, err);
    /* a compute error on one rank (unexpected after the checks) is everyone's */
    int worst = (int)st;
    MPI_Allreduce(MPI_IN_PLACE, &worst, 1, MPI_INT, MPI_MAX, ring);
    MPI_Comm_free(&ring);
    free_buffers(&b);
    if (st == MHA_STATUS_OK && worst != MHA_STATUS_OK)
        return fail(err, (mha_status)worst,
                    "mha_ring_attention: another rank's attention failed (%s)",
                    mha_status_string((mha_status)worst));
    return st;
}
