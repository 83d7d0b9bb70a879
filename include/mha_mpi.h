/* SPDX-License-Identifier: MIT */
/* mha_mpi.h: ring attention over MPI (context parallelism), library libmha_mpi.
 *
 * The sequence dimension of a self-attention core is sharded over the P ranks of a communicator:
 * every rank holds its rows of Q, K and V, the K/V shards travel around the ring (rank r sends to
 * r + 1 and receives from r - 1, non-blocking, overlapped with the attention on the shard already
 * received), and every rank merges its partial results exactly by their log-sum-exp
 * (mha_attention_merge), so its output rows equal those of one mha_attention call over the whole
 * sequence (up to float32 rounding of the merge, tested).
 *
 * The caller owns MPI: it initialises it (MPI_Init_thread) and passes the communicator; the
 * library never calls MPI_Init, MPI_Finalize or MPI_Abort. Every rank of the communicator must
 * make the same call with the same global sizes and options. Arguments are checked before any
 * communication and the result is agreed on by every rank (an allreduce), so a rank with bad
 * arguments makes every rank return an error instead of leaving its peers waiting.
 *
 * This header needs <mpi.h>; libmha itself never depends on MPI (see docs/distributed.md). */
#ifndef MHA_MPI_H
#define MHA_MPI_H

#include <mpi.h>

#include "mha.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Which global rows a rank holds (N rows, P ranks).
 *    CONTIGUOUS: rank r holds one run of rows, [s_r, s_r + n_r) with n_r = N / P (+1 for the first
 *                N % P ranks). With a causal mask the last rank does about P times the work of
 *                the first.
 *    ZIGZAG:     the rows are cut into 2P chunks of N / (2P) rows (+1 for the first N % (2P)
 *                chunks); rank r holds chunks r and 2P - 1 - r, in that order (its local rows are
 *                chunk r's, then chunk 2P - 1 - r's). Every rank then does the same causal work. */
typedef enum mha_shard_layout {
    MHA_SHARD_CONTIGUOUS = 0,
    MHA_SHARD_ZIGZAG = 1,
} mha_shard_layout;

/** Rows [*start, *start + *count) of piece `piece` (0 or 1) of rank `rank`'s shard, in global
 *  row numbers; *count is 0 for piece 1 of a CONTIGUOUS shard. The local rows of a rank are its
 *  pieces one after the other. */
MHA_API mha_status mha_shard_rows(mha_shard_layout layout,
                                  int64_t seq_len,
                                  int ranks,
                                  int rank,
                                  int piece,
                                  int64_t *start,
                                  int64_t *count,
                                  mha_error *err);

/** One rank's part of a ring-attention call. `local` describes this rank's shard exactly as an
 *  mha_attention call would (q_len = kv_len = this rank's row count, from mha_shard_rows; q, k, v,
 *  out and the optional lse in their usual layouts), except:
 *    - mask.causal is the causal mask of the whole sequence (global positions); alignment must be
 *      BOTTOM_RIGHT or TOP_LEFT (identical for self-attention);
 *    - no other mask, window, ALiBi, dropout or probabilities yet (UNSUPPORTED): see
 *      docs/distributed.md;
 *    - GQA / MQA, d_k != d_v, scale, soft-cap and sinks work as in mha_attention. */
typedef struct mha_ring_args {
    mha_attention_args local;
    int64_t seq_len;         /* N, the global sequence length (the same on every rank; at least
                                one row per chunk: N >= P, ZIGZAG N >= 2P) */
    mha_shard_layout layout; /* the same on every rank */
} mha_ring_args;

/** Ring attention forward over `comm` (every rank calls it). exec applies to this rank's local
 *  attention calls (threads, implementation, allocator). Writes local.out (and local.lse). */
MHA_API mha_status mha_ring_attention(MPI_Comm comm,
                                      const mha_ring_args *args,
                                      const mha_exec *exec,
                                      mha_error *err);

/** Backward of mha_ring_attention over `comm` (every rank calls it): `args` as in the forward,
 *  with local.out and local.lse the forward's results for this rank's rows (both required);
 *  `grads` this rank's rows of dout (required), dq, and dk / dv of this rank's K / V rows, as in
 *  mha_attention_backward (each of dq, dk, dv, dsinks may be NULL; accumulate as there). dsinks
 *  receives the sum over every rank's rows, on every rank. Equals mha_attention_backward over the
 *  whole sequence up to float32 rounding (tested). dq accumulates in place during the ring: after
 *  an error found once the ring has started (the checks before it make one unexpected), dq may be
 *  partly written; dk, dv and dsinks are not. */
MHA_API mha_status mha_ring_attention_backward(MPI_Comm comm,
                                               const mha_ring_args *args,
                                               const mha_attention_grads *grads,
                                               const mha_exec *exec,
                                               mha_error *err);

#ifdef __cplusplus
}
#endif

#endif /* MHA_MPI_H */
