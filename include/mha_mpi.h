/* SPDX-License-Identifier: MIT */
/* mha_mpi.h: optional public header of libmha_mpi, ring attention over MPI (context parallelism:
 * the sequence dimension is sharded across the ranks of a communicator). Built only when CMake
 * finds MPI (option MHA_MPI); libmha itself never depends on MPI. docs/distributed.md has the
 * algorithm, the shard layouts and what is supported.
 *
 * The caller owns MPI: it passes a communicator and calls MPI_Init/MPI_Finalize itself; nothing
 * here calls MPI_Init, MPI_Abort, exit() or abort(). Every call below that takes a communicator is
 * COLLECTIVE over it: every rank must make the same call, with the same config and sizes.
 */
#ifndef MHA_MPI_H
#define MHA_MPI_H

#include "mha.h"

#include <mpi.h>

#ifdef __cplusplus
extern "C" {
#endif

/** How the global sequence of N rows is cut among P ranks. The sequence is split into C chunks
 *  (C = P contiguous, 2P zigzag), chunk c having floor(N/C) + (c < N mod C) rows, in order.
 *  Any N >= 1 works: when N < C, chunks 0 .. N-1 hold one row each and the others none (an empty
 *  chunk starts at N), so a rank may hold no row at all; it still takes part in every
 *  collective call, with an empty shard (local length 0).
 *    CONTIGUOUS: rank r holds chunk r.
 *    ZIGZAG:     rank r holds chunks r and 2P-1-r (in that order): under a causal mask every rank
 *                then does the same work (one early and one late chunk), where with CONTIGUOUS
 *                the last rank does about 2P-1 times the work of the first. */
typedef enum mha_shard_layout {
    MHA_SHARD_CONTIGUOUS = 0,
    MHA_SHARD_ZIGZAG = 1,
} mha_shard_layout;

/** The distributed problem: the global sequence length and its layout (same on every rank). */
typedef struct mha_ring_config {
    int64_t seq_len; /* N >= 1, global rows of Q, K and V (N < C leaves some chunks empty) */
    mha_shard_layout layout;
} mha_ring_config;

/** The rows of the global sequence that rank `rank` of `num_ranks` holds: *num_chunks (1 or 2)
 *  chunks, chunk c being global rows [start[c], start[c] + len[c]); the rank's local rows are
 *  these chunks one after the other (local length len[0] + len[1], which is 0 for a rank whose
 *  chunks are empty, N < C). No communication.
 *  @return MHA_STATUS_OK, or INVALID_ARG (bad layout, rank, or N outside [1, 2^31]) with outputs
 *  untouched. */
MHA_API mha_status mha_ring_shard(const mha_ring_config *cfg,
                                  int32_t num_ranks,
                                  int32_t rank,
                                  int32_t *num_chunks,
                                  int64_t start[2],
                                  int64_t len[2],
                                  mha_error *err);

/** Ring attention, forward, over the ranks of `comm` (collective). `local` is the rank's shard of
 *  a self-attention core call (mha.h, mha_attention_args) with q_len = kv_len = the rank's local
 *  length (mha_ring_shard): q [B, h, n_local, d_k], k [B, g, n_local, d_k], v [B, g, n_local,
 *  d_v], out [B, h, n_local, d_v] (any strides, last dimension contiguous) and the optional lse
 *  [B, h, n_local]. A rank whose shard is empty (n_local = 0, when N < C) passes q_len = kv_len
 *  = 0 and the same sizes and options as the others (its key padding and segment-id pointers
 *  non-NULL when the others give them, though nothing is read); its row tensors (q, k, v, out,
 *  lse) are never touched and may be NULL; it only passes the K/V blocks on. The result, rows of
 *  the rank's chunks, equals mha_attention on the whole
 *  sequence (N rows of Q, K, V gathered in global order):
 *    O_i = sum_j softmax_j(scale q_i . k_j [+ softcap]) v_j,  j over all N keys (j <= i if causal)
 *  computed as P steps: at step t the rank attends to the K/V shard of rank (rank - t) mod P
 *  while that shard's successor travels one hop (MPI_Isend to rank + 1, MPI_Irecv from rank - 1;
 *  only the g kv heads travel) and merges the partial results exactly by their log-sum-exp
 *  (mha_attention_merge). Causal masks, windows and ALiBi use global positions: a (query chunk,
 *  key chunk) pair the mask hides entirely is skipped, one whose keys every row sees runs
 *  unmasked, others run with the explicit alignment delta = query start - key start.
 *  Supported: batch, GQA/MQA, d_v != d_k, scale, softcap, mask.causal, mask.use_window
 *  (window_left/right), alibi (alignment BOTTOM_RIGHT or TOP_LEFT, the same when n = m), and the
 *  masks that are per key or per row, each given for the RANK'S OWN rows (local order: its
 *  chunks one after the other):
 *    sinks [h]: the same values on every rank (checked); each row's denominator holds exp(sink_h)
 *      once: the pairs run without sinks and the sink is folded in after the ring,
 *      lse' = log(e^lse + e^sink_h), O' = e^(lse - lse') O;
 *    mask.key_padding: [B, n_local] or [n_local] (or [1, n_local]), BOOL, U8, I32 or I64,
 *      nonzero = real key, as in the core;
 *    mask.q_segment_ids, mask.kv_segment_ids: int32 [B, n_local] each, both or neither.
 *  The key side (padding, kv segment ids) travels around the ring beside its K/V block (int32
 *  [B, n] each, a parallel message), so every pair sees the padding and segments of the keys it
 *  attends to. Rows that see no key at all keep the core's contract: O = 0, lse = -inf (also
 *  with sinks). Dropout in training draws the single-process mask exactly (each pair at its global
 *  rows and columns: mha_dropout.row_offset, col_offset). Every rank must give the same options
 *  (sinks, key padding, segment ids, dropout p and seed: agreed).
 *  Still MHA_STATUS_UNSUPPORTED, with a message naming the option: EXPLICIT alignment,
 *  boolean/additive masks (N x N), probs.
 *  Errors are agreed collectively: the arguments of every rank are checked (and the ranks'
 *  configs and sizes compared) before any data moves, then one MPI_Allreduce tells every rank;
 *  if any rank failed, every rank returns the first failing rank's status and message (prefixed
 *  by "rank r: "), with its outputs untouched, and none waits on a peer. A failure inside the
 *  ring (out of memory in a local call) is agreed the same way at the end; outputs are then
 *  partly written.
 *  exec is used for the local attention calls (threads, pool, impl, allocator), except
 *  exec->workspace: scratch (two K/V buffers of the largest shard, one partial output; with key
 *  padding or segment ids two key sides and one pair's slices, 7 B n_max int32; with sinks 4h
 *  int64 and h doubles) comes from exec->allocator. Traffic goes over a duplicate of comm, so
 *  the caller's own messages on comm never match the ring's. MPI errors return
 *  MHA_STATUS_INTERNAL only if comm's error handler returns (MPI's default handler aborts).
 *  @return MHA_STATUS_OK, or an error (the same on every rank) with outputs untouched. */
MHA_API mha_status mha_ring_attention(MPI_Comm comm,
                                      const mha_ring_config *cfg,
                                      const mha_attention_args *local,
                                      const mha_exec *exec,
                                      mha_error *err);

/** Ring attention, backward (collective): the gradients of mha_ring_attention, equal to those of
 *  mha_attention_backward on the whole sequence. `local` describes the forward exactly as it ran
 *  on this rank (every mask and the sinks included), with its results: local->out (O) and
 *  local->lse (REQUIRED), the rows mha_ring_attention wrote. grads (mha.h, mha_attention_grads)
 *  are the rank's rows: dout [B, h, n_local, d_v] (required), dq [B, h, n_local, d_k], dk [B, g,
 *  n_local, d_k], dv [B, g, n_local, d_v] (each may be NULL); dsinks [h] (with sinks, may be
 *  NULL) receives the WHOLE gradient on every rank, -sum_{b,i} exp(sink_h - lse_i) dO_i . O_i
 *  over all N rows (each rank's rows, summed by MPI_Allreduce); accumulate as in
 *  mha_attention_backward. grads.dlse and grads.dprobs must be NULL (MHA_STATUS_UNSUPPORTED): the
 *  ring backward takes no gradient of lse or of the probabilities.
 *  The K/V blocks travel the ring as in the forward; each rank adds its share of dQ locally and its
 *  share of the block's dK/dV (mha_attention_backward on each pair, with P = exp(S - lse) from the
 *  global lse) into a dK/dV block that travels one step behind its K/V; after P steps each block's
 *  sum reaches its owner. Scratch: five K/V-sized blocks. The same support, errors and exec as
 *  mha_ring_attention; a rank with an empty shard passes grads (its dout, dq, dk, dv and its
 *  out and lse may be NULL: there are no rows) and gets dsinks like the others. */
MHA_API mha_status mha_ring_attention_backward(MPI_Comm comm,
                                               const mha_ring_config *cfg,
                                               const mha_attention_args *local,
                                               const mha_attention_grads *grads,
                                               const mha_exec *exec,
                                               mha_error *err);

/** The two calls above with the communicator given by its Fortran handle (MPI_Comm_c2f(comm);
 *  mpi4py: comm.py2f()), widened to int64_t, for bindings through a foreign-function interface
 *  (the Python package's ctypes): an MPI_Comm is a pointer in Open MPI and an int in MPICH, so
 *  it cannot be passed portably from outside C, while the Fortran handle is an integer in every
 *  MPI (and int64_t spares the caller MPI_Fint's width). The handle is converted with
 *  MPI_Comm_f2c; then everything is as in mha_ring_attention / mha_ring_attention_backward.
 *  @return as those, or INVALID_ARG, on this rank alone (there is no communicator to agree
 *  over), when MPI is not initialized, comm_f does not fit MPI_Fint or is MPI_COMM_NULL's. */
MHA_API mha_status mha_ring_attention_fcomm(int64_t comm_f,
                                            const mha_ring_config *cfg,
                                            const mha_attention_args *local,
                                            const mha_exec *exec,
                                            mha_error *err);
MHA_API mha_status mha_ring_attention_backward_fcomm(int64_t comm_f,
                                                     const mha_ring_config *cfg,
                                                     const mha_attention_args *local,
                                                     const mha_attention_grads *grads,
                                                     const mha_exec *exec,
                                                     mha_error *err);

/** The whole layer (mha.h, mha_layer_forward) over the ranks of `comm` (collective), for
 *  self-attention: the global input x [B, N, q_dim] is sharded by rows, rank r holding the rows
 *  mha_ring_shard gives it, one chunk after the other. `local` is the rank's part of a
 *  mha_forward_args: batch B (the same on every rank), q_len = the rank's local length,
 *  query = its rows of x [B, n_local, q_dim], out = its rows of y [B, n_local, out_dim];
 *  key = value = probs = NULL. Each rank projects its rows (mha_layer_project), applies the
 *  layer's RoPE to Q and K at GLOBAL positions (its rows' indices in the whole sequence, or, when
 *  given, local->q_positions / k_positions [B, n_local]: the positions of its rows), runs
 *  mha_ring_attention on the shards with local->mask and local->dropout, and projects its rows
 *  of the attention output:
 *    y = (concat_h Attn_h(RoPE(x W_q^T + b_q), RoPE(x W_k^T + b_k), x W_v^T + b_v)) W_o^T + b_o
 *  on the whole sequence, i.e. mha_layer_forward of the gathered x, row for row. The masks,
 *  scores options and what is UNSUPPORTED are those of mha_ring_attention (causal and windows
 *  use global rows; the layer's sinks, key padding [B, n_local] and segment ids [B, n_local] of
 *  the rank's rows, dropout in training: as the ring supports them). Errors are agreed as in
 *  mha_ring_attention: every rank returns the same status, with out untouched unless a failure
 *  happens after the attention (out of memory in the output projection). A rank with an empty
 *  shard (N < C) passes q_len = 0; its query, out and positions may be NULL. Scratch: Q, K, V and
 *  the attention output of the rank's rows, from exec->allocator (exec->workspace is unused).
 *  @return MHA_STATUS_OK, or an error, the same on every rank. */
MHA_API mha_status mha_ring_layer_forward(MPI_Comm comm,
                                          const mha_ring_config *cfg,
                                          const mha_layer *layer,
                                          const mha_forward_args *local,
                                          const mha_exec *exec,
                                          mha_error *err);

/** Backward of mha_ring_layer_forward (collective): the gradients of the layer on the whole
 *  sequence, equal to mha_layer_backward's, each rank getting its share. `local` is the forward's
 *  call on this rank exactly as it ran (the same x rows, positions, masks); dy [B, n_local,
 *  out_dim] is dL/dy of the rank's rows; grads (mha.h, mha_layer_grads):
 *    d_query [B, n_local, q_dim]: dL/dx of the rank's rows (every input path: Q, K and V);
 *    dw_q, dw_k, dw_v, dw_o and db_* (only the biases the layer has): the WHOLE gradient, summed
 *    over the ranks (one MPI_Allreduce), the same on every rank;
 *    d_sinks [h] (only if the layer has sinks): the whole gradient, the same on every rank;
 *    d_key, d_value: NULL (self-attention); d_probs: NULL (MHA_STATUS_UNSUPPORTED);
 *  each may be NULL (not wanted), written (accumulate == 0) or added. The forward is recomputed
 *  (nothing is kept between the calls, at the cost of one more forward), then: dA = dy W_o, the
 *  ring backward (mha_ring_attention_backward) to dQ, dK, dV, RoPE's transposed rotation, and
 *  dx = dQ W_q + dK W_k + dV W_v, dW = dQ^T x, ... (mha_layer_project_backward). Errors are
 *  agreed as in the forward, with every gradient untouched (they are written last). On a rank
 *  with an empty shard dy and d_query may be NULL; it receives the summed weight gradients too.
 *  @return MHA_STATUS_OK, or an error, the same on every rank. */
MHA_API mha_status mha_ring_layer_backward(MPI_Comm comm,
                                           const mha_ring_config *cfg,
                                           const mha_layer *layer,
                                           const mha_forward_args *local,
                                           const float *dy,
                                           const mha_layer_grads *grads,
                                           const mha_exec *exec,
                                           mha_error *err);

/** mha_ring_layer_forward and mha_ring_layer_backward with the communicator given by its Fortran
 *  handle, as mha_ring_attention_fcomm (for ctypes: Python's MultiheadAttention with comm=). */
MHA_API mha_status mha_ring_layer_forward_fcomm(int64_t comm_f,
                                                const mha_ring_config *cfg,
                                                const mha_layer *layer,
                                                const mha_forward_args *local,
                                                const mha_exec *exec,
                                                mha_error *err);
MHA_API mha_status mha_ring_layer_backward_fcomm(int64_t comm_f,
                                                 const mha_ring_config *cfg,
                                                 const mha_layer *layer,
                                                 const mha_forward_args *local,
                                                 const float *dy,
                                                 const mha_layer_grads *grads,
                                                 const mha_exec *exec,
                                                 mha_error *err);

#ifdef __cplusplus
}
#endif
#endif /* MHA_MPI_H */
