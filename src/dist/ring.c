/* SPDX-License-Identifier: MIT */
/* ring.c: ring attention over MPI (mha_mpi.h), forward and backward. Built into libmha_mpi only,
 * on top of libmha's PUBLIC calls: mha_attention_supported (and the backward's size query) check
 * each rank's local arguments, mha_attention computes every (query chunk, key chunk) partial
 * result with its lse, mha_attention_merge folds the partials into the output exactly, and
 * mha_attention_backward gives each pair's share of the gradients. Nothing here includes the
 * library's internals (tests/check_layout.sh: the dist part includes only the public headers
 * and its own dist_util.h).
 *
 * Buffers (floats): two K/V blocks of the largest shard, B g n_max (d_k + d_v) each (one being
 * computed on while the other is received), the lse of one chunk B h n_max; forward: one partial
 * output B h n_max d_v and the lse accumulator B h n_local when the caller passes no lse;
 * backward: three more K/V-sized blocks (two travelling dK/dV, one received). With key padding or
 * segment ids: two key-side blocks (int32, 2 B n_max each) travelling with the K/V blocks, and the
 * slices of one pair (3 B n_max). With sinks: 4h int64 (their agreement) and h doubles (dsinks). */
#include "mha_mpi.h"

#include "dist/dist_util.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Chunk c of C over N rows: floor(N/C) rows, one more for the first N mod C chunks (so when
 * N < C, chunks 0 .. N-1 hold one row each and the others none). */
static int64_t chunk_start(int64_t n, int64_t c_count, int64_t c) {
    const int64_t base = n / c_count, extra = n % c_count;
    return c * base + (c < extra ? c : extra);
}

mha_status mha_ring_shard(const mha_ring_config *cfg,
                          int32_t num_ranks,
                          int32_t rank,
                          int32_t *num_chunks,
                          int64_t start[2],
                          int64_t len[2],
                          mha_error *err) {
    if (!cfg || !num_chunks || !start || !len) {
        mha__dist_error(err, MHA_STATUS_INVALID_ARG,
                        "mha_ring_shard: cfg, num_chunks, start and len "
                        "must not be NULL");
        return MHA_STATUS_INVALID_ARG;
    }
    if (cfg->layout != MHA_SHARD_CONTIGUOUS && cfg->layout != MHA_SHARD_ZIGZAG) {
        mha__dist_error(err, MHA_STATUS_INVALID_ARG, "mha_ring_config.layout=%d is not a layout",
                        (int)cfg->layout);
        return MHA_STATUS_INVALID_ARG;
    }
    if (num_ranks < 1 || rank < 0 || rank >= num_ranks) {
        mha__dist_error(err, MHA_STATUS_INVALID_ARG, "rank %d of %d ranks", (int)rank,
                        (int)num_ranks);
        return MHA_STATUS_INVALID_ARG;
    }
    const int64_t c_count = cfg->layout == MHA_SHARD_ZIGZAG ? 2 * (int64_t)num_ranks : num_ranks;
    if (cfg->seq_len < 1 || cfg->seq_len > ((int64_t)1 << 31)) {
        mha__dist_error(err, MHA_STATUS_INVALID_ARG,
                        "mha_ring_config.seq_len=%lld must be in [1, 2^31]",
                        (long long)cfg->seq_len);
        return MHA_STATUS_INVALID_ARG;
    }
    const int64_t n = cfg->seq_len;
    const int64_t chunks[2] = {rank, c_count - 1 - rank};
    *num_chunks = cfg->layout == MHA_SHARD_ZIGZAG ? 2 : 1;
    for (int32_t c = 0; c < 2; c++) {
        start[c] = c < *num_chunks ? chunk_start(n, c_count, chunks[c]) : 0;
        len[c] = c < *num_chunks ? chunk_start(n, c_count, chunks[c] + 1) - start[c] : 0;
    }
    return MHA_STATUS_OK;
}

/* The rank's chunks, and the largest local length of any rank (the size of a K/V buffer). */
typedef struct ring_shard {
    int32_t num_chunks;
    int64_t start[2], len[2], n_local;
} ring_shard;

static ring_shard shard_of(const mha_ring_config *cfg, int32_t p, int32_t rank) {
    ring_shard s;
    mha_ring_shard(cfg, p, rank, &s.num_chunks, s.start, s.len, NULL);
    s.n_local = s.len[0] + s.len[1];
    return s;
}

/* Local checks of one rank, before anything is allocated or sent. */
static mha_status check_local(const mha_ring_config *cfg,
                              int32_t p,
                              int32_t rank,
                              const mha_attention_args *a,
                              int bwd,
                              const mha_attention_grads *grads,
                              const mha_exec *exec,
                              mha_error *err) {
    int32_t nc;
    int64_t start[2], len[2];
    if (!a) {
        mha__dist_error(err, MHA_STATUS_INVALID_ARG,
                        "mha_ring_attention: local args must not be NULL");
        return MHA_STATUS_INVALID_ARG;
    }
    mha_status st = mha_ring_shard(cfg, p, rank, &nc, start, len, err);
    if (st != MHA_STATUS_OK)
        return st;
    const int64_t n_local = len[0] + len[1];
    if (a->q_len != n_local || a->kv_len != n_local) {
        mha__dist_error(err, MHA_STATUS_INVALID_ARG,
                        "local q_len=%lld, kv_len=%lld: this rank's shard has %lld rows "
                        "(mha_ring_shard)",
                        (long long)a->q_len, (long long)a->kv_len, (long long)n_local);
        return MHA_STATUS_INVALID_ARG;
    }
    const mha_masking *mk = &a->mask;
    if (n_local == 0 && bwd && !grads) {
        mha__dist_error(err, MHA_STATUS_INVALID_ARG,
                        "mha_ring_attention_backward: grads must not be NULL");
        return MHA_STATUS_INVALID_ARG;
    }
    const char *unsupported = NULL;
    if (mk->alignment == MHA_ALIGN_EXPLICIT)
        unsupported = "mask.alignment=EXPLICIT";
    else if (mk->bool_mask.data || mk->additive_mask.data)
        unsupported = "a boolean or additive mask";
    else if (mk->mask_fn.visible || mk->mask_fn.classify)
        unsupported = "a mask function (mask.mask_fn: it sees each pair's local rows and keys, "
                      "not the sequence's)";
    else if (mk->chunk_size)
        unsupported = "mask.chunk_size (chunked attention: a pair's call numbers its keys from 0, "
                      "not from the sequence's position)";
    else if (a->probs)
        unsupported = "probs (an N x N output)";
    else if (a->q_dtype || a->k_dtype || a->v_dtype || a->out_dtype ||
             (bwd && grads &&
              (grads->dout_dtype || grads->dq_dtype || grads->dk_dtype || grads->dv_dtype)))
        unsupported = "a half-precision tensor (the ring exchanges float32 blocks; every *_dtype "
                      "must be MHA_DTYPE_F32)";
    if (unsupported) {
        mha__dist_error(err, MHA_STATUS_UNSUPPORTED, "mha_ring_attention: %s is not supported",
                        unsupported);
        return MHA_STATUS_UNSUPPORTED;
    }
    /* An empty shard (N < C) computes nothing: it passes the blocks on and sums its (empty)
     * share. Its row tensors (q, k, v, out, lse; dout, dq, dk, dv) are never touched and may be
     * NULL; its sizes and options are agreed with the other ranks (agree), and rank 0, which
     * always holds a row, checks them through the core. */
    if (n_local == 0)
        return MHA_STATUS_OK;
    /* Everything else (sizes, strides, pointers, scalars, exec) is the core's own check. */
    st = mha_attention_supported(a, exec, err);
    if (st != MHA_STATUS_OK || !bwd)
        return st;
    if (!grads || !grads->dout || !a->lse) {
        mha__dist_error(err, MHA_STATUS_INVALID_ARG,
                        "mha_ring_attention_backward: grads, grads.dout and the forward's lse are "
                        "required");
        return MHA_STATUS_INVALID_ARG;
    }
    if (grads->dlse || grads->dprobs) { /* the pairs would need them sliced like lse: not built */
        mha__dist_error(err, MHA_STATUS_UNSUPPORTED,
                        "mha_ring_attention_backward: grads.%s (a loss that reads %s) is not "
                        "supported by the ring backward",
                        grads->dlse ? "dlse" : "dprobs", grads->dlse ? "lse" : "probs");
        return MHA_STATUS_UNSUPPORTED;
    }
    /* The gradients' strides and pointers: the core backward's check (its size query). */
    size_t bytes;
    return mha_attention_backward_workspace_size(a, grads, exec, &bytes, err);
}

/* The values every rank must agree on, in the order of the message that names a mismatch. */
enum {
    AGREE_FAIL,
    AGREE_N,
    AGREE_LAYOUT,
    AGREE_B,
    AGREE_H,
    AGREE_G,
    AGREE_DK,
    AGREE_DV,
    AGREE_CAUSAL,
    AGREE_WINDOW_LEFT,
    AGREE_WINDOW_RIGHT,
    AGREE_ALIBI,
    AGREE_SCALE,
    AGREE_SOFTCAP,
    AGREE_SINKS,
    AGREE_KEY_PADDING,
    AGREE_SEGMENTS,
    AGREE_DROPOUT,
    AGREE_DROPOUT_P,
    AGREE_SEED_LO,
    AGREE_SEED_HI,
    AGREE_COUNT
};
static const char *const agree_name[AGREE_COUNT] = {
    "",          "seq_len",      "layout",      "batch",       "num_heads",    "num_kv_heads",
    "head_dim",  "v_head_dim",   "causal",      "window_left", "window_right", "alibi",
    "scale",     "softcap",      "sinks",       "key_padding", "segment ids",  "dropout",
    "dropout.p", "dropout.seed", "dropout.seed"};

/* The collective agreement: one MPI_Allreduce (MAX) of {v, -v} gives every rank the maximum and
 * the minimum of each value. v[AGREE_FAIL] = P - rank on a failing rank (0 otherwise), so the
 * maximum names the first failing rank, whose status and message are then broadcast. Returns the
 * agreed status; on a failure elsewhere err receives "rank r: <its message>". */
static mha_status agree(MPI_Comm comm,
                        int32_t p,
                        int32_t rank,
                        mha_status local_st,
                        const int64_t values[AGREE_COUNT],
                        mha_error *err) {
    int64_t v[2 * AGREE_COUNT], r[2 * AGREE_COUNT];
    for (int k = 0; k < AGREE_COUNT; k++) {
        v[k] = values[k];
        v[AGREE_COUNT + k] = -values[k];
    }
    v[AGREE_FAIL] = local_st != MHA_STATUS_OK ? (int64_t)(p - rank) : 0;
    v[AGREE_COUNT + AGREE_FAIL] = 0;
    if (MPI_Allreduce(v, r, 2 * AGREE_COUNT, MPI_INT64_T, MPI_MAX, comm) != MPI_SUCCESS) {
        mha__dist_error(err, MHA_STATUS_INTERNAL, "mha_ring_attention: MPI_Allreduce failed");
        return MHA_STATUS_INTERNAL;
    }
    if (r[AGREE_FAIL] > 0) {
        const int32_t bad = p - (int32_t)r[AGREE_FAIL];
        struct {
            int32_t status;
            char message[MHA_ERROR_MESSAGE_SIZE];
        } msg = {(int32_t)local_st, ""};
        if (rank == bad && err)
            snprintf(msg.message, sizeof msg.message, "%s", err->message);
        if (MPI_Bcast(&msg, (int)sizeof msg, MPI_BYTE, bad, comm) != MPI_SUCCESS) {
            mha__dist_error(err, MHA_STATUS_INTERNAL, "mha_ring_attention: MPI_Bcast failed");
            return MHA_STATUS_INTERNAL;
        }
        msg.message[MHA_ERROR_MESSAGE_SIZE - 1] = '\0';
        mha__dist_error(err, (mha_status)msg.status, "rank %d: %s", (int)bad, msg.message);
        return (mha_status)msg.status;
    }
    for (int k = 1; k < AGREE_COUNT; k++)
        if (r[k] != -r[AGREE_COUNT + k]) {
            mha__dist_error(err, MHA_STATUS_INVALID_ARG,
                            "mha_ring_attention: the ranks disagree on %s (from %lld to %lld)",
                            agree_name[k], (long long)-r[AGREE_COUNT + k], (long long)r[k]);
            return MHA_STATUS_INVALID_ARG;
        }
    return MHA_STATUS_OK;
}

/* The sink logits must be the same on every rank (each row's denominator holds exp(sink_h)): one
 * MPI_Allreduce (MAX) of {bits, -bits} of each value, compared bit for bit (so equal NaNs agree).
 * buf: 4h int64 of scratch. Collective; the result is the same on every rank. */
static mha_status
agree_sinks(MPI_Comm comm, int64_t h, const float *sinks, int64_t *buf, mha_error *err) {
    for (int64_t i = 0; i < h; i++) {
        uint32_t bits;
        memcpy(&bits, &sinks[i], sizeof bits);
        buf[i] = bits, buf[h + i] = -(int64_t)bits;
    }
    if (MPI_Allreduce(buf, buf + 2 * h, (int)(2 * h), MPI_INT64_T, MPI_MAX, comm) != MPI_SUCCESS) {
        mha__dist_error(err, MHA_STATUS_INTERNAL, "mha_ring_attention: MPI_Allreduce failed");
        return MHA_STATUS_INTERNAL;
    }
    for (int64_t i = 0; i < h; i++)
        if (buf[2 * h + i] != -buf[3 * h + i]) {
            mha__dist_error(err, MHA_STATUS_INVALID_ARG,
                            "mha_ring_attention: the ranks disagree on sinks[%lld]", (long long)i);
            return MHA_STATUS_INVALID_ARG;
        }
    return MHA_STATUS_OK;
}

/* The state of one call: sizes, the buffers, and the rank's accumulator. */
typedef struct ring_call {
    const mha_attention_args *a;
    mha_exec inner; /* the caller's exec without its workspace, for the local calls */
    int64_t B, h, g, dk, dv, n_max;
    ring_shard mine;
    float *kv[2];    /* [B, g, n_src, d_k] then [B, g, n_src, d_v], packed */
    float *part;     /* partial output [B, h, n_chunk, d_v] */
    float *part_lse; /* its lse [B, h, n_chunk] */
    float *lse;      /* the accumulator [B, h, n_local]: the caller's or lse_own */
    float *lse_own;
    int64_t *offs; /* [B] explicit causal offsets of a diagonal pair */
    /* Key padding / segment ids: the key-side arrays of a block travel with it, as int32
     * [B, n_src] "is a real key" (1 without key padding) then [B, n_src] kv segment ids. */
    int keys;            /* nonzero: key padding or segment ids are given */
    int32_t *kinfo[2];   /* the key side of kv[0], kv[1] */
    const int32_t *held; /* the key side of the block being attended to */
    int32_t *slice;      /* one pair's [B, nk] padding, [B, nk] kv and [B, nq] q segment ids */
    int64_t *sink_bits;  /* [4h] scratch of agree_sinks */
    double *dsinks;      /* [h] backward: this rank's share of dL/dsinks, then the sum */
    /* The step's messages in flight (poked between local calls: progress), NULL when none. */
    MPI_Request *kv_req, *dkv_req; /* [4] K/V + key side; [3] dK/dV (backward) */
    /* Backward only: */
    const mha_attention_grads *grads;
    float *acc[2]; /* dK/dV of the block being held, [B, g, n_src, d_k] then [.., d_v] */
    float *din;    /* the block's dK/dV from the ranks before this one */
} ring_call;

/* Packs the caller's K and V (any strides) into a K/V block buffer. */
static void pack_kv(const ring_call *c, float *dst) {
    const mha_attention_args *a = c->a;
    const int64_t n = c->mine.n_local;
    float *dk_dst = dst, *dv_dst = dst + c->B * c->g * n * c->dk;
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t j = 0; j < c->g; j++)
            for (int64_t i = 0; i < n; i++) {
                memcpy(dk_dst + ((b * c->g + j) * n + i) * c->dk,
                       (const float *)a->k + b * a->k_strides[0] + j * a->k_strides[1] +
                           i * a->k_strides[2],
                       sizeof(float) * (size_t)c->dk);
                memcpy(dv_dst + ((b * c->g + j) * n + i) * c->dv,
                       (const float *)a->v + b * a->v_strides[0] + j * a->v_strides[1] +
                           i * a->v_strides[2],
                       sizeof(float) * (size_t)c->dv);
            }
}

/* Reads element (b, j) of the caller's key padding ([B, n] or [n], or [1, n]: broadcast over the
 * batch; BOOL/U8/I32/I64 as checked by the core) as 0 or 1. */
static int32_t key_real(const mha_mask_tensor *kp, int64_t b, int64_t j) {
    const int64_t n = kp->shape[kp->ndim - 1];
    const int64_t e = (kp->ndim == 2 && kp->shape[0] != 1 ? b * n : 0) + (n != 1 ? j : 0);
    switch (kp->dtype) {
    case MHA_DTYPE_I32:
        return ((const int32_t *)kp->data)[e] != 0;
    case MHA_DTYPE_I64:
        return ((const int64_t *)kp->data)[e] != 0;
    default: /* BOOL, U8: one byte */
        return ((const uint8_t *)kp->data)[e] != 0;
    }
}

/* Packs the key side of the caller's rows (the kinfo layout) into dst. */
static void pack_keys(const ring_call *c, int32_t *dst) {
    const mha_masking *mk = &c->a->mask;
    const int64_t n = c->mine.n_local;
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t j = 0; j < n; j++) {
            dst[b * n + j] = mk->key_padding.data ? key_real(&mk->key_padding, b, j) : 1;
            dst[(c->B + b) * n + j] = mk->kv_segment_ids ? mk->kv_segment_ids[b * n + j] : 0;
        }
}

/* The key padding and segment ids of a pair: query rows [q_off, q_off + nq) of the caller's
 * q_segment_ids [B, n_local], key rows [k_off, k_off + nk) of the held block's key side, copied
 * contiguous ([B, nk], [B, nq]: the layouts the core reads) into c->slice. */
static void pair_keys(ring_call *c,
                      int64_t n_src,
                      int64_t q_off,
                      int64_t nq,
                      int64_t k_off,
                      int64_t nk,
                      mha_attention_args *p) {
    const mha_masking *mk = &c->a->mask;
    int32_t *kp = c->slice, *kseg = kp + c->B * nk, *qseg = kseg + c->B * nk;
    for (int64_t b = 0; b < c->B; b++) {
        memcpy(kp + b * nk, c->held + b * n_src + k_off, sizeof(int32_t) * (size_t)nk);
        memcpy(kseg + b * nk, c->held + (c->B + b) * n_src + k_off, sizeof(int32_t) * (size_t)nk);
        if (mk->q_segment_ids)
            memcpy(qseg + b * nq, mk->q_segment_ids + b * c->mine.n_local + q_off,
                   sizeof(int32_t) * (size_t)nq);
    }
    if (mk->key_padding.data) {
        memset(&p->mask.key_padding, 0, sizeof p->mask.key_padding);
        p->mask.key_padding.data = kp;
        p->mask.key_padding.dtype = MHA_DTYPE_I32;
        p->mask.key_padding.ndim = 2;
        p->mask.key_padding.shape[0] = c->B, p->mask.key_padding.shape[1] = nk;
    }
    if (mk->q_segment_ids)
        p->mask.q_segment_ids = qseg, p->mask.kv_segment_ids = kseg;
}

/* Whether the mask depends on positions: then the pairs are chunk by chunk, with global
 * positions. */
static int positional(const mha_attention_args *a) {
    return a->mask.causal || a->mask.use_window || a->alibi;
}

static int64_t float_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits;
}

static int dropout_on(const mha_attention_args *a) {
    return a->dropout.training && a->dropout.p > 0.0f;
}

/* The core's arguments for the rank's query rows [q_off, q_off + nq) (global rows [qs, qe], qe =
 * qs + nq - 1) against key rows [k_off, k_off + nk) (global [ks, ke]) of the block `blk` of n_src
 * rows. Returns 0 when the mask hides the whole pair: the keys some row of the pair may see are
 * [qs - left, qe + right] (window sides, -1 = unbounded), at most qe if causal, and the pair is
 * skipped when that range misses [ks, ke]. A pair every key of which every row sees (causal or
 * window, no ALiBi) runs unmasked; otherwise the rules are placed by the explicit alignment
 * delta = qs - ks (local key j vs local row i + delta <=> global key vs global row).
 * Key padding and segment ids are the pair's slices (pair_keys); sinks are left out (fold_sinks,
 * sink_grads); dropout draws the whole sequence's mask at the pair's global rows and columns
 * (mha_dropout.row_offset, col_offset). out and lse are left to the caller. */
static int pair_args(ring_call *c,
                     const float *blk,
                     int64_t n_src,
                     int64_t q_off,
                     int64_t nq,
                     int64_t qs,
                     int64_t k_off,
                     int64_t nk,
                     int64_t ks,
                     mha_attention_args *p) {
    const mha_attention_args *a = c->a;
    const mha_masking *mk = &a->mask;
    *p = *a;
    if (positional(a)) {
        const int64_t qe = qs + nq - 1, ke = ks + nk - 1;
        /* A side longer than any sequence (N <= 2^31) is unbounded (and cannot overflow). */
        const int64_t far = (int64_t)1 << 32;
        const int win = mk->use_window != 0;
        const int64_t left = win && mk->window_left <= far ? mk->window_left : -1;
        const int64_t right = win && mk->window_right <= far ? mk->window_right : -1;
        int64_t hi = right < 0 ? INT64_MAX : qe + right;
        if (mk->causal && hi > qe)
            hi = qe;
        const int64_t lo = left < 0 ? INT64_MIN : qs - left;
        if (ks > hi || ke < lo)
            return 0;
        /* Every row sees every key: key range within [qe - left, qs + right] (and <= qs). */
        int64_t all_hi = right < 0 ? INT64_MAX : qs + right;
        if (mk->causal && all_hi > qs)
            all_hi = qs;
        const int64_t all_lo = left < 0 ? INT64_MIN : qe - left;
        if (!a->alibi && ks >= all_lo && ke <= all_hi) {
            p->mask.causal = 0;
            p->mask.use_window = 0;
        } else {
            /* One offset per batch row, all equal: global positions do not depend on b. */
            for (int64_t b = 0; b < c->B; b++)
                c->offs[b] = qs - ks;
            p->mask.alignment = MHA_ALIGN_EXPLICIT;
            p->mask.align_offsets = c->offs;
        }
    }
    /* The sink joins each row's denominator once: folded in after the ring (fold_sinks). */
    p->sinks = NULL;
    p->dropout.row_offset = a->dropout.row_offset + qs;
    p->dropout.col_offset = a->dropout.col_offset + ks;
    if (c->keys)
        pair_keys(c, n_src, q_off, nq, k_off, nk, p);
    p->q_len = nq;
    p->kv_len = nk;
    p->q = (const float *)a->q + q_off * a->q_strides[2];
    p->k = blk + k_off * c->dk;
    p->k_strides[0] = c->g * n_src * c->dk, p->k_strides[1] = n_src * c->dk;
    p->k_strides[2] = c->dk;
    p->v = blk + c->B * c->g * n_src * c->dk + k_off * c->dv;
    p->v_strides[0] = c->g * n_src * c->dv, p->v_strides[1] = n_src * c->dv;
    p->v_strides[2] = c->dv;
    return 1;
}

/* Forward of one pair (pair_args): the partial (O_p, lse_p) into the scratch, merged into the
 * rows it covers. A row that sees no key of the pair has lse_p = -inf; the merge leaves it. */
static mha_status attend_pair(ring_call *c,
                              const float *blk,
                              int64_t n_src,
                              int64_t q_off,
                              int64_t nq,
                              int64_t qs,
                              int64_t k_off,
                              int64_t nk,
                              int64_t ks,
                              mha_error *err) {
    const mha_attention_args *a = c->a;
    mha_attention_args p;
    if (!pair_args(c, blk, n_src, q_off, nq, qs, k_off, nk, ks, &p))
        return MHA_STATUS_OK;
    p.out = c->part;
    p.out_strides[0] = c->h * nq * c->dv, p.out_strides[1] = nq * c->dv, p.out_strides[2] = c->dv;
    p.lse = c->part_lse;
    mha_status st = mha_attention(&p, &c->inner, err);
    if (st != MHA_STATUS_OK)
        return st;
    /* Merge per (b, head): nq rows of d_v, the accumulator in place. */
    const int64_t n = c->mine.n_local;
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t hh = 0; hh < c->h; hh++) {
            float *o = (float *)a->out + b * a->out_strides[0] + hh * a->out_strides[1] +
                       q_off * a->out_strides[2];
            float *l = c->lse + (b * c->h + hh) * n + q_off;
            const float *po = c->part + (b * c->h + hh) * nq * c->dv;
            const float *pl = c->part_lse + (b * c->h + hh) * nq;
            st = mha_attention_merge(nq, c->dv, o, a->out_strides[2], l, po, c->dv, pl, o,
                                     a->out_strides[2], l, err);
            if (st != MHA_STATUS_OK)
                return st;
        }
    return MHA_STATUS_OK;
}

/* Backward of one pair (pair_args) with the forward's global out and lse rows:
 *   dQ rows += dS K (into the caller's dq), dK/dV rows of the block += (into acc)
 * the pair's share of the sums of mha_attention_backward (P = exp(S - lse) with the GLOBAL lse
 * is the pair's exact share of the probabilities; D_i = dO_i . O_i with the global O). */
static mha_status bwd_pair(ring_call *c,
                           const float *blk,
                           float *acc,
                           int64_t n_src,
                           int64_t q_off,
                           int64_t nq,
                           int64_t qs,
                           int64_t k_off,
                           int64_t nk,
                           int64_t ks,
                           mha_error *err) {
    const mha_attention_args *a = c->a;
    const mha_attention_grads *gr = c->grads;
    mha_attention_args p;
    if (!pair_args(c, blk, n_src, q_off, nq, qs, k_off, nk, ks, &p))
        return MHA_STATUS_OK;
    p.out = (float *)a->out + q_off * a->out_strides[2];
    /* The core reads lse contiguous [B, h, nq]: copy the chunk's rows. */
    for (int64_t bh = 0; bh < c->B * c->h; bh++)
        memcpy(c->part_lse + bh * nq, a->lse + bh * c->mine.n_local + q_off,
               sizeof(float) * (size_t)nq);
    p.lse = c->part_lse;
    mha_attention_grads g = *gr;
    g.dout = (const float *)gr->dout + q_off * gr->dout_strides[2];
    g.dq = gr->dq ? (float *)gr->dq + q_off * gr->dq_strides[2] : NULL;
    g.dk = acc + k_off * c->dk;
    memcpy(g.dk_strides, p.k_strides, sizeof g.dk_strides);
    g.dv = acc + c->B * c->g * n_src * c->dk + k_off * c->dv;
    memcpy(g.dv_strides, p.v_strides, sizeof g.dv_strides);
    g.dsinks = NULL;
    g.accumulate = 1;
    return mha_attention_backward(&p, &g, &c->inner, err);
}

/* Progress: most MPI libraries move a message only inside an MPI call (Open MPI's shared-memory
 * and TCP transports, MPICH without its progress thread), so a transfer posted before a long local
 * computation would otherwise wait for MPI_Waitall and not overlap it. Testing the step's
 * requests between local calls lets them advance (completed ones become MPI_REQUEST_NULL, which
 * the later waits accept). */
static void progress(const ring_call *c) {
    int done;
    if (c->kv_req)
        MPI_Testall(4, c->kv_req, &done, MPI_STATUSES_IGNORE);
    if (c->dkv_req)
        MPI_Testall(3, c->dkv_req, &done, MPI_STATUSES_IGNORE);
}

/* While messages are in flight, a pair's query rows run in up to RING_SLICES local calls (each of
 * at least RING_MIN_SLICE rows) with progress() between them. A row's result does not depend on
 * the other rows of its call, so the slices compute what one call would. */
#define RING_SLICES    4
#define RING_MIN_SLICE 128

/* Every pair of a query chunk of this rank and a key chunk of src (without a positional mask or
 * dropout, the whole shards at once: the positions do not matter); acc == NULL is the forward. */
static mha_status
block_pairs(ring_call *c, const float *blk, float *acc, const ring_shard *src, mha_error *err) {
    const int chunked = positional(c->a) || dropout_on(c->a);
    const int32_t nqc = chunked ? c->mine.num_chunks : 1, nkc = chunked ? src->num_chunks : 1;
    const int in_flight = c->kv_req || c->dkv_req;
    int64_t q_off = 0;
    for (int32_t qc = 0; qc < nqc; qc++) {
        const int64_t nq = chunked ? c->mine.len[qc] : c->mine.n_local;
        int64_t slice = in_flight ? (nq + RING_SLICES - 1) / RING_SLICES : nq;
        slice = slice < RING_MIN_SLICE ? RING_MIN_SLICE : slice;
        int64_t k_off = 0;
        for (int32_t kc = 0; kc < nkc; kc++) {
            const int64_t nk = chunked ? src->len[kc] : src->n_local;
            const int64_t qs = chunked ? c->mine.start[qc] : 0, ks = chunked ? src->start[kc] : 0;
            /* An empty chunk (N < C) forms no pair: nq = 0 loops no row, nk = 0 is skipped. */
            for (int64_t r0 = 0; nk > 0 && r0 < nq; r0 += slice) {
                const int64_t rows = nq - r0 < slice ? nq - r0 : slice;
                mha_status st = acc ? bwd_pair(c, blk, acc, src->n_local, q_off + r0, rows, qs + r0,
                                               k_off, nk, ks, err)
                                    : attend_pair(c, blk, src->n_local, q_off + r0, rows, qs + r0,
                                                  k_off, nk, ks, err);
                if (st != MHA_STATUS_OK)
                    return st;
                progress(c);
            }
            k_off += nk;
        }
        q_off += nq;
    }
    return MHA_STATUS_OK;
}

/* The ring: P steps; at step t the rank holds the K/V block of rank s = (rank - t) mod P in
 * kv[t % 2], sends it on to rank + 1 and receives the next one (rank s - 1's) from rank - 1 into
 * kv[(t + 1) % 2] while it computes on kv[t % 2].
 * Backward: block s's dK/dV travels one step behind its K/V. The rank computes its share into
 * acc[t % 2] (zeroed) while the share of the ranks before it arrives in din (sent by rank - 1 at
 * the end of its step t - 1), adds din, and sends the sum on to rank + 1 (the send overlapping the
 * next step). After P steps every rank has added its share, and the sum of rank r's block arrives
 * at its owner from rank r - 1: the last din.
 * With key padding or segment ids the block's key side (kinfo) travels beside it the same way.
 * After a local failure the rank keeps passing blocks on (so no peer waits forever) and reports
 * the failure at the final agreement. */
#define RING_TAG_KV   15
#define RING_TAG_DKV  16
#define RING_TAG_KEYS 17
static mha_status run_ring(ring_call *c,
                           MPI_Comm comm,
                           const mha_ring_config *cfg,
                           int32_t p,
                           int32_t rank,
                           mha_error *err) {
    const int32_t right = (rank + 1) % p, left = (rank + p - 1) % p;
    const int bwd = c->grads != NULL;
    mha_status st = MHA_STATUS_OK;
    MPI_Request dreq[3] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    int mpi_ok = 1;
    for (int32_t t = 0; t < p && mpi_ok; t++) {
        const ring_shard src = shard_of(cfg, p, (rank - t + p) % p);
        const ring_shard next = shard_of(cfg, p, (rank - t - 1 + 2 * p) % p);
        const int src_count = (int)(c->B * c->g * src.n_local * (c->dk + c->dv));
        MPI_Request req[4] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL, MPI_REQUEST_NULL,
                              MPI_REQUEST_NULL};
        if (t + 1 < p) {
            const int next_count = (int)(c->B * c->g * next.n_local * (c->dk + c->dv));
            mpi_ok &= MPI_Irecv(c->kv[(t + 1) % 2], next_count, MPI_FLOAT, left, RING_TAG_KV, comm,
                                &req[0]) == MPI_SUCCESS;
            mpi_ok &= MPI_Isend(c->kv[t % 2], src_count, MPI_FLOAT, right, RING_TAG_KV, comm,
                                &req[1]) == MPI_SUCCESS;
            if (c->keys) { /* the block's key side, a parallel message */
                mpi_ok &= MPI_Irecv(c->kinfo[(t + 1) % 2], (int)(2 * c->B * next.n_local),
                                    MPI_INT32_T, left, RING_TAG_KEYS, comm, &req[2]) == MPI_SUCCESS;
                mpi_ok &= MPI_Isend(c->kinfo[t % 2], (int)(2 * c->B * src.n_local), MPI_INT32_T,
                                    right, RING_TAG_KEYS, comm, &req[3]) == MPI_SUCCESS;
            }
        }
        c->held = c->kinfo[t % 2];
        float *acc = NULL;
        if (bwd) {
            /* acc[t % 2] was last sent at step t - 2 (dreq[t % 2]). */
            acc = c->acc[t % 2];
            mpi_ok &= MPI_Wait(&dreq[t % 2], MPI_STATUS_IGNORE) == MPI_SUCCESS;
            memset(acc, 0, sizeof(float) * (size_t)src_count);
        }
        c->kv_req = t + 1 < p ? req : NULL;
        c->dkv_req = bwd && t > 0 ? dreq : NULL;
        if (st == MHA_STATUS_OK)
            st = block_pairs(c, c->kv[t % 2], acc, &src, err);
        c->kv_req = c->dkv_req = NULL;
        if (bwd) {
            if (t > 0) {
                mpi_ok &= MPI_Wait(&dreq[2], MPI_STATUS_IGNORE) == MPI_SUCCESS;
                for (int64_t e = 0; e < src_count; e++)
                    acc[e] += c->din[e];
            }
            mpi_ok &= MPI_Isend(acc, src_count, MPI_FLOAT, right, RING_TAG_DKV, comm,
                                &dreq[t % 2]) == MPI_SUCCESS;
            /* Next: the block of rank s - 1 (or, after the last step, this rank's own). */
            const ring_shard nd = t + 1 < p ? next : c->mine;
            const int nd_count = (int)(c->B * c->g * nd.n_local * (c->dk + c->dv));
            mpi_ok &= MPI_Irecv(c->din, nd_count, MPI_FLOAT, left, RING_TAG_DKV, comm, &dreq[2]) ==
                      MPI_SUCCESS;
        }
        mpi_ok &= MPI_Waitall(4, req, MPI_STATUSES_IGNORE) == MPI_SUCCESS;
    }
    if (bwd)
        mpi_ok &= MPI_Waitall(3, dreq, MPI_STATUSES_IGNORE) == MPI_SUCCESS;
    if (!mpi_ok) {
        mha__dist_error(err, MHA_STATUS_INTERNAL,
                        "mha_ring_attention: an MPI call of the ring failed");
        return MHA_STATUS_INTERNAL;
    }
    return st;
}

/* The backward's result: din holds this rank's dK/dV [B, g, n_local, d_k] ++ [.., d_v]; written
 * to (or added to, with accumulate) the caller's dk and dv, either of which may be NULL. */
static void unpack_dkv(const ring_call *c) {
    const mha_attention_grads *gr = c->grads;
    const int64_t n = c->mine.n_local;
    const float *sk = c->din, *sv = c->din + c->B * c->g * n * c->dk;
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t j = 0; j < c->g; j++)
            for (int64_t i = 0; i < n; i++) {
                const int64_t r = (b * c->g + j) * n + i;
                if (gr->dk) {
                    float *d = (float *)gr->dk + b * gr->dk_strides[0] + j * gr->dk_strides[1] +
                               i * gr->dk_strides[2];
                    for (int64_t e = 0; e < c->dk; e++)
                        d[e] = gr->accumulate ? d[e] + sk[r * c->dk + e] : sk[r * c->dk + e];
                }
                if (gr->dv) {
                    float *d = (float *)gr->dv + b * gr->dv_strides[0] + j * gr->dv_strides[1] +
                               i * gr->dv_strides[2];
                    for (int64_t e = 0; e < c->dv; e++)
                        d[e] = gr->accumulate ? d[e] + sv[r * c->dv + e] : sv[r * c->dv + e];
                }
            }
}

/* Forward with sinks: the pairs ran without them, so lse holds log sum_j exp(s_j) over all N keys;
 * the sink joins each row's denominator once here:
 *   lse' = log(e^lse + e^sink_h),   O' = e^(lse - lse') O   (the merge with an empty partial).
 * A fully masked row (lse = -inf) keeps O = 0, lse = -inf, as the core gives it. */
static void fold_sinks(const ring_call *c) {
    const mha_attention_args *a = c->a;
    const int64_t n = c->mine.n_local;
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t hh = 0; hh < c->h; hh++)
            for (int64_t i = 0; i < n; i++) {
                float *l = c->lse + (b * c->h + hh) * n + i;
                if (*l == -INFINITY)
                    continue;
                const double old = (double)*l, sink = (double)a->sinks[hh],
                             top = old > sink ? old : sink;
                const double lse = top + log(exp(old - top) + exp(sink - top));
                const float r = (float)exp(old - lse);
                float *o = (float *)a->out + b * a->out_strides[0] + hh * a->out_strides[1] +
                           i * a->out_strides[2];
                for (int64_t e = 0; e < c->dv; e++)
                    o[e] *= r;
                *l = (float)lse;
            }
}

/* Backward with sinks: the pairs ran without them (their P = exp(S - lse) already uses the global
 * lse), and dL/dsink_h = -sum_{b,i} exp(sink_h - lse_i) D_i, D_i = dO_i . O_i, is summed here once
 * per row over this rank's rows, then over the ranks (MPI_Allreduce, collective: called by every
 * rank, whatever its local status) and written (or added) to grads->dsinks when st is OK. */
static mha_status sink_grads(const ring_call *c, MPI_Comm comm, mha_status st, mha_error *err) {
    const mha_attention_args *a = c->a;
    const mha_attention_grads *gr = c->grads;
    const int64_t n = c->mine.n_local;
    for (int64_t hh = 0; hh < c->h; hh++)
        c->dsinks[hh] = 0.0;
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t hh = 0; hh < c->h; hh++)
            for (int64_t i = 0; i < n; i++) {
                const double l = (double)a->lse[(b * c->h + hh) * n + i];
                if (l == -(double)INFINITY) /* fully masked rows contribute nothing */
                    continue;
                const float *o = (float *)a->out + b * a->out_strides[0] + hh * a->out_strides[1] +
                                 i * a->out_strides[2];
                const float *d = (const float *)gr->dout + b * gr->dout_strides[0] +
                                 hh * gr->dout_strides[1] + i * gr->dout_strides[2];
                double dot = 0.0;
                for (int64_t e = 0; e < c->dv; e++)
                    dot += (double)d[e] * (double)o[e];
                c->dsinks[hh] -= exp((double)a->sinks[hh] - l) * dot;
            }
    if (MPI_Allreduce(MPI_IN_PLACE, c->dsinks, (int)c->h, MPI_DOUBLE, MPI_SUM, comm) !=
        MPI_SUCCESS) {
        mha__dist_error(err, MHA_STATUS_INTERNAL,
                        "mha_ring_attention_backward: MPI_Allreduce failed");
        return MHA_STATUS_INTERNAL;
    }
    if (st == MHA_STATUS_OK && gr->dsinks)
        for (int64_t hh = 0; hh < c->h; hh++)
            gr->dsinks[hh] =
                (float)(gr->accumulate ? (double)gr->dsinks[hh] + c->dsinks[hh] : c->dsinks[hh]);
    return st;
}

/* The call's sizes (from the checked local arguments), the limits of one MPI message, and the
 * scratch: two K/V blocks, the partial lse, the offsets, the key side when key padding or segment
 * ids are given, the sinks' bits and gradient, and the forward's partial output and lse or the
 * backward's dK/dV accumulators. */
static mha_status ring_setup(ring_call *c,
                             const mha_ring_config *cfg,
                             int32_t p,
                             int32_t rank,
                             int bwd,
                             const mha_allocator *alloc,
                             const char *fn,
                             mha_error *err) {
    const mha_attention_args *a = c->a;
    c->B = a->batch, c->h = a->num_heads, c->g = a->num_kv_heads ? a->num_kv_heads : a->num_heads;
    c->dk = a->head_dim, c->dv = a->v_head_dim ? a->v_head_dim : a->head_dim;
    c->mine = shard_of(cfg, p, rank);
    c->n_max = 0;
    for (int32_t r = 0; r < p; r++) {
        const int64_t n_r = shard_of(cfg, p, r).n_local;
        c->n_max = n_r > c->n_max ? n_r : c->n_max;
    }
    const int64_t blk = c->B * c->g * c->n_max * (c->dk + c->dv);
    if (blk > INT_MAX) {
        mha__dist_error(err, MHA_STATUS_UNSUPPORTED,
                        "%s: a K/V block of %lld floats exceeds one MPI message (INT_MAX elements)",
                        fn, (long long)blk);
        return MHA_STATUS_UNSUPPORTED;
    }
    if (a->sinks && 2 * c->h > INT_MAX) {
        mha__dist_error(err, MHA_STATUS_UNSUPPORTED,
                        "%s: with sinks, num_heads=%lld exceeds one MPI message", fn,
                        (long long)c->h);
        return MHA_STATUS_UNSUPPORTED;
    }
    const size_t fb = sizeof(float);
    int ok = 1;
    for (int i = 0; i < 2; i++)
        ok &= (c->kv[i] = mha__dist_alloc(alloc, fb * (size_t)blk)) != NULL;
    ok &= (c->part_lse = mha__dist_alloc(alloc, fb * (size_t)(c->B * c->h * c->n_max))) != NULL;
    ok &= (c->offs = mha__dist_alloc(alloc, sizeof(int64_t) * (size_t)c->B)) != NULL;
    c->keys = a->mask.key_padding.data || a->mask.q_segment_ids;
    const size_t kb = sizeof(int32_t) * (size_t)(c->B * c->n_max);
    for (int i = 0; i < 2 && c->keys; i++)
        ok &= (c->kinfo[i] = mha__dist_alloc(alloc, 2 * kb)) != NULL;
    if (c->keys)
        ok &= (c->slice = mha__dist_alloc(alloc, 3 * kb)) != NULL;
    if (a->sinks) {
        ok &= (c->sink_bits = mha__dist_alloc(alloc, sizeof(int64_t) * 4 * (size_t)c->h)) != NULL;
        ok &= (c->dsinks = mha__dist_alloc(alloc, sizeof(double) * (size_t)c->h)) != NULL;
    }
    if (bwd) {
        for (int i = 0; i < 2; i++)
            ok &= (c->acc[i] = mha__dist_alloc(alloc, fb * (size_t)blk)) != NULL;
        ok &= (c->din = mha__dist_alloc(alloc, fb * (size_t)blk)) != NULL;
    } else {
        ok &= (c->part = mha__dist_alloc(alloc, fb * (size_t)(c->B * c->h * c->n_max * c->dv))) !=
              NULL;
        c->lse = a->lse;
        if (!c->lse)
            ok &= (c->lse = c->lse_own = mha__dist_alloc(
                       alloc, fb * (size_t)(c->B * c->h * c->mine.n_local))) != NULL;
    }
    if (!ok) {
        mha__dist_error(err, MHA_STATUS_NO_MEMORY,
                        "%s: out of memory (scratch of %d blocks of %lld floats)", fn, bwd ? 5 : 2,
                        (long long)blk);
        return MHA_STATUS_NO_MEMORY;
    }
    return MHA_STATUS_OK;
}

/* What every rank must agree on (agree fills slot AGREE_FAIL with the local status). */
static void
agreement_values(const ring_call *c, const mha_ring_config *cfg, int64_t values[AGREE_COUNT]) {
    const mha_attention_args *a = c->a;
    /* The scale as the core uses it (0 = 1/sqrt(d_k)): a float32, compared bit for bit. */
    const float scale = (float)(a->scale == 0.0 ? 1.0 / sqrt((double)c->dk) : a->scale);
    const int64_t mine[AGREE_COUNT] = {0,
                                       cfg->seq_len,
                                       cfg->layout,
                                       c->B,
                                       c->h,
                                       c->g,
                                       c->dk,
                                       c->dv,
                                       a->mask.causal != 0,
                                       a->mask.use_window ? a->mask.window_left : -1,
                                       a->mask.use_window ? a->mask.window_right : -1,
                                       a->alibi != 0,
                                       float_bits(scale),
                                       float_bits((float)a->softcap),
                                       a->sinks != NULL,
                                       a->mask.key_padding.data != NULL,
                                       a->mask.q_segment_ids != NULL,
                                       dropout_on(a),
                                       dropout_on(a) ? float_bits(a->dropout.p) : 0,
                                       dropout_on(a) ? (int64_t)(a->dropout.seed & 0xffffffffu) : 0,
                                       dropout_on(a) ? (int64_t)(a->dropout.seed >> 32) : 0};
    memcpy(values, mine, sizeof mine);
}

/* Before the ring: the forward's O = 0 and lse = -inf (every partial merges into them); the
 * backward's dQ = 0 unless accumulating (every pair adds its share). */
static void zero_outputs(const ring_call *c, int bwd) {
    const mha_attention_args *a = c->a;
    const mha_attention_grads *grads = c->grads;
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t hh = 0; hh < c->h; hh++)
            for (int64_t i = 0; i < c->mine.n_local; i++) {
                if (!bwd) {
                    memset((float *)a->out + b * a->out_strides[0] + hh * a->out_strides[1] +
                               i * a->out_strides[2],
                           0, sizeof(float) * (size_t)c->dv);
                    c->lse[(b * c->h + hh) * c->mine.n_local + i] = -INFINITY;
                } else if (grads->dq && !grads->accumulate) {
                    memset((float *)grads->dq + b * grads->dq_strides[0] +
                               hh * grads->dq_strides[1] + i * grads->dq_strides[2],
                           0, sizeof(float) * (size_t)c->dk);
                }
            }
}

static void ring_free(ring_call *c, const mha_allocator *alloc) {
    for (int i = 0; i < 2; i++) {
        mha__dist_free(alloc, c->kv[i]);
        mha__dist_free(alloc, c->acc[i]);
        mha__dist_free(alloc, c->kinfo[i]);
    }
    mha__dist_free(alloc, c->slice);
    mha__dist_free(alloc, c->sink_bits);
    mha__dist_free(alloc, c->dsinks);
    mha__dist_free(alloc, c->din);
    mha__dist_free(alloc, c->part);
    mha__dist_free(alloc, c->part_lse);
    mha__dist_free(alloc, c->lse_own);
    mha__dist_free(alloc, c->offs);
}

/* Both entry points (bwd: the backward, with grads). */
static mha_status ring_entry(MPI_Comm comm,
                             const mha_ring_config *cfg,
                             const mha_attention_args *local,
                             int bwd,
                             const mha_attention_grads *grads,
                             const mha_exec *exec,
                             mha_error *err) {
    const char *fn = bwd ? "mha_ring_attention_backward" : "mha_ring_attention";
    int p_int = 0, rank_int = 0;
    if (MPI_Comm_size(comm, &p_int) != MPI_SUCCESS ||
        MPI_Comm_rank(comm, &rank_int) != MPI_SUCCESS) {
        mha__dist_error(err, MHA_STATUS_INVALID_ARG, "%s: comm is not a communicator", fn);
        return MHA_STATUS_INVALID_ARG;
    }
    const int32_t p = p_int, rank = rank_int;
    const mha_allocator *alloc = exec ? exec->allocator : NULL;

    /* 1. Local checks and scratch, before any data moves. */
    ring_call c;
    memset(&c, 0, sizeof c);
    c.a = local;
    c.grads = grads;
    if (exec)
        c.inner = *exec;
    c.inner.workspace = NULL, c.inner.workspace_bytes = 0;
    int64_t values[AGREE_COUNT] = {0};
    mha_status st = check_local(cfg, p, rank, local, bwd, grads, exec, err);
    if (st == MHA_STATUS_OK) {
        st = ring_setup(&c, cfg, p, rank, bwd, alloc, fn, err);
        agreement_values(&c, cfg, values);
    }

    /* 2. Agreement; a private communicator for the ring's messages. */
    MPI_Comm ring = MPI_COMM_NULL;
    if (st == MHA_STATUS_OK)
        st = agree(comm, p, rank, st, values, err);
    else
        agree(comm, p, rank, st, values, err);
    if (st == MHA_STATUS_OK && local->sinks) /* the same on every rank: agreed above */
        st = agree_sinks(comm, c.h, local->sinks, c.sink_bits, err);
    if (st == MHA_STATUS_OK && MPI_Comm_dup(comm, &ring) != MPI_SUCCESS) {
        st = MHA_STATUS_INTERNAL;
        mha__dist_error(err, st, "%s: MPI_Comm_dup failed", fn);
    }

    /* 3. The ring. */
    if (st == MHA_STATUS_OK) {
        zero_outputs(&c, bwd);
        pack_kv(&c, c.kv[0]);
        if (c.keys)
            pack_keys(&c, c.kinfo[0]);
        st = run_ring(&c, ring, cfg, p, rank, err);
        if (bwd && st == MHA_STATUS_OK)
            unpack_dkv(&c);
        if (!bwd && local->sinks && st == MHA_STATUS_OK)
            fold_sinks(&c);
        if (bwd && local->sinks)
            st = sink_grads(&c, ring, st, err);
        /* A local call that failed mid-ring (out of memory) is reported to every rank. */
        const mha_status ring_st = agree(ring, p, rank, st, values, err);
        st = st != MHA_STATUS_OK ? st : ring_st;
    }
    if (ring != MPI_COMM_NULL)
        MPI_Comm_free(&ring);
    ring_free(&c, alloc);
    return st;
}

mha_status mha_ring_attention(MPI_Comm comm,
                              const mha_ring_config *cfg,
                              const mha_attention_args *local,
                              const mha_exec *exec,
                              mha_error *err) {
    return ring_entry(comm, cfg, local, 0, NULL, exec, err);
}

mha_status mha_ring_attention_backward(MPI_Comm comm,
                                       const mha_ring_config *cfg,
                                       const mha_attention_args *local,
                                       const mha_attention_grads *grads,
                                       const mha_exec *exec,
                                       mha_error *err) {
    return ring_entry(comm, cfg, local, 1, grads, exec, err);
}
