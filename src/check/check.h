/* SPDX-License-Identifier: MIT */
/* check.h: the argument checks of every public call, in one place (src/check/), and the
 * resolution of what they check into the library's internal form (an mha__problem, a resolved
 * config, ...). Each public entry point calls its check once, first, before it changes or
 * allocates anything; the parts below the entry points (core, layer, decode, kernels) receive
 * resolved input and never check it again. docs/ARCHITECTURE.md, "Validation", lists which check
 * serves which call.
 *
 * Messages name the argument as the caller spells it (config.q_dim, mask.bool_mask.dtype,
 * grads.dq_strides[1], seq_ids[3], ...). Sizes are range-checked to [1, 2^31] (MHA_MAX_DIM) and
 * every product that sizes a buffer is overflow-checked.
 */
#ifndef MHA_CHECK_H
#define MHA_CHECK_H

#include "base/internal.h"

/* ---------------------------------------------------------------------------------------------- */
/* Scalars (check/attention.c): every double of the API that the kernels use as a float is        */
/* checked in float, the precision it is used in.                                                 */
/* ---------------------------------------------------------------------------------------------- */

/* scale (already resolved: 0 replaced by 1/sqrt(d_k)) and softcap (0 = off) as the kernels use
 * them: |scale| in [FLT_MIN, FLT_MAX] (a larger one is inf in float, a smaller one rounds to 0 or
 * a subnormal), softcap 0 or in [FLT_MIN, FLT_MAX] (1/softcap and s/softcap are taken in float).
 * prefix names the struct in messages ("config.", "" for the core's args). */
mha_status
mha__check_scale_softcap(double scale, double softcap, const char *prefix, mha_error *err);

/* ---------------------------------------------------------------------------------------------- */
/* Aliasing (check/overlap.c): no output may share a byte with an input or another output.        */
/* ---------------------------------------------------------------------------------------------- */

/* A buffer's byte range [lo, hi) and its name as the caller spells it; empty (lo = hi) for a NULL
 * pointer or a zero count. */
typedef struct mha__span {
    const char *name;
    uintptr_t lo, hi;
} mha__span;
/* The range of `count` elements of `elem` bytes at ptr (count: the largest reachable element
 * offset + 1 of a strided view). */
mha__span mha__span_of(const char *name, const void *ptr, int64_t count, size_t elem);
/* a * b * c, or 0 when it overflows (an empty span: the size checks refuse such a call). */
int64_t mha__count3(int64_t a, int64_t b, int64_t c);
/* INVALID_ARG naming both when an output overlaps an input or another output. */
/* Each dts[i] is a storage dtype of activations (F32, BF16 or F16), else INVALID_ARG naming
 * names[i] (docs/SEMANTICS.md "Half precision"). */
mha_status mha__check_storage_dtypes(const char *const *names,
                                     const mha_dtype *dts,
                                     int count,
                                     mha_error *err);
mha_status mha__check_no_overlap(
    const mha__span *outs, int n_out, const mha__span *ins, int n_in, mha_error *err);
/* The byte ranges of a masking's tensors (check/attention.c), in a call of B batches, n queries
 * and m keys: additive_mask, bool_mask, key_padding (their shapes' products; empty while a shape
 * is invalid: the mask check refuses it), q_segment_ids [B, n], kv_segment_ids [B, m] (int32),
 * align_offsets [B] (EXPLICIT alignment only). Named mask.<field>, or "the forward's mask.<field>"
 * when of_forward (mha_layer_backward). Fills MHA__MASKING_SPANS spans; returns their count. */
enum { MHA__MASKING_SPANS = 6 };
int mha__masking_spans(
    const mha_masking *mk, int64_t B, int64_t n, int64_t m, int of_forward, mha__span *in);
/* An output's own layout: its elements, sizes[ndim] with element strides strides[ndim] (|stride|
 * used: a view may run backwards), must be at distinct addresses, else INVALID_ARG naming
 * `name` and `name`_strides. Sufficient rule: the dimensions of more than one element, sorted by
 * |stride|, each have |stride| >= the previous one's |stride| x size (the first >= 1). Inputs
 * are not checked (a broadcast stride of 0 is legitimate for them). The sizes and strides must
 * already be range-checked (the view's extent fits int64); ndim <= 8. */
mha_status mha__check_layout_disjoint(
    const char *name, const int64_t *sizes, const int64_t *strides, int ndim, mha_error *err);

/* ---------------------------------------------------------------------------------------------- */
/* Attention core (check/attention.c): mha_attention*, mha_attention_backward*.                   */
/* ---------------------------------------------------------------------------------------------- */

/* Every size of args in [1, 2^31] and num_heads divisible by num_kv_heads. Checked before any
 * workspace is sized (forward and backward), since the kernels' scratch sizes are computed from
 * these fields: an unchecked one could ask for gigabytes before the call is refused. */
mha_status mha__check_attention_sizes(const mha_attention_args *args, mha_error *err);

/* Every check of the forward's args, building the resolved problem p: sizes, pointers, strides,
 * scale, softcap, dropout, masks (causal alignment into delta_buf [B] int64, ALiBi slopes into
 * slope_buf [H] float). p keeps args' pointers; their data is not read. */
mha_status mha__check_attention(const mha_attention_args *args,
                                mha__problem *p,
                                int64_t *delta_buf,
                                float *slope_buf,
                                mha_error *err);

/* The same checks without the aliasing rule, for a caller whose q, k, v and out are placeholders
 * (mha_layer_forward_supported: the layer's scratch does not exist yet). */
mha_status mha__check_attention_layout(const mha_attention_args *args,
                                       mha__problem *p,
                                       int64_t *delta_buf,
                                       float *slope_buf,
                                       mha_error *err);

/* mha_attention_statistics: the forward's checks on args (v and out may be NULL: only the
 * scores are computed; dropout, lse and probs are ignored, cleared in p) and the requested
 * statistics (at least one; top_k in [1, m]; the pool grid in [1, n] x [1, m]). */
mha_status mha__check_attention_stats(const mha_attention_args *args,
                                      const mha_attention_stats *stats,
                                      mha__problem *p,
                                      int64_t *delta_buf,
                                      float *slope_buf,
                                      mha_error *err);

/* The backward's arguments before anything is sized: fwd and grads given, fwd's sizes. */
mha_status mha__check_backward_sizes(const mha_attention_args *fwd,
                                     const mha_attention_grads *grads,
                                     mha_error *err);
/* The gradient side against the forward's resolved problem: lse, dout, dsinks, every stride. */
mha_status mha__check_backward_grads(const mha_attention_args *fwd,
                                     const mha_attention_grads *grads,
                                     const mha__problem *p,
                                     mha_error *err);

/* ---------------------------------------------------------------------------------------------- */
/* RoPE (check/rope.c): mha_rope_frequencies, mha_rope_apply, the layer's config.rope.           */
/* ---------------------------------------------------------------------------------------------- */

/* rope with its defaults filled in (theta 10000, rotary_dim = head_dim, scaling factors). */
mha_status mha__check_rope(const mha_rope *in, int64_t head_dim, mha_rope *out, mha_error *err);
/* Whether a resolved rope's frequencies depend on the call's length (DYNAMIC; LONGROPE whose two
 * lists differ): mha_rope_at_length fixes them. */
bool mha__rope_depends_on_length(const mha_rope *resolved);
/* Every position in [0, 2^31]: positions[b * batch_stride + t], b < B, t < L (NULL = none). */
mha_status mha__check_positions(const int64_t *positions,
                                int64_t B,
                                int64_t L,
                                int64_t batch_stride,
                                const char *name,
                                mha_error *err);
/* mha_rope_at_length's arguments and its resolved rope. */
mha_status mha__check_rope_at_length(
    const mha_rope *rope, int64_t head_dim, int64_t length, mha_rope *resolved, mha_error *err);
/* mha_rope_frequencies' arguments and its resolved rope (a fixed one: not DYNAMIC). */
mha_status mha__check_rope_frequencies(const mha_rope *rope,
                                       int64_t head_dim,
                                       const double *freqs,
                                       const double *cos_sin_factor,
                                       mha_rope *resolved,
                                       mha_error *err);
/* mha_rope_apply's arguments (sizes, strides, positions) and its resolved rope. */
mha_status mha__check_rope_apply(const mha_rope *rope,
                                 int64_t batch,
                                 int64_t seq_len,
                                 int64_t num_heads,
                                 int64_t head_dim,
                                 const float *x,
                                 const int64_t x_strides[4],
                                 const int64_t *positions,
                                 int64_t pos_batch_stride,
                                 mha_rope *resolved,
                                 mha_error *err);

/* ---------------------------------------------------------------------------------------------- */
/* Layer (check/layer.c): mha_layer_create, mha_layer_forward*, mha_layer_backward.              */
/* ---------------------------------------------------------------------------------------------- */

/* The weight tensors of a resolved config, in one table: name, pointer slot in w, element count,
 * whether the config has it. */
typedef struct mha__weight_slot {
    const char *name;
    const void **ptr;
    int64_t count;
    int present;
} mha__weight_slot;
/* w_q w_k w_v w_o | b_q b_k b_v b_o sinks q_norm k_norm: from slot 4 on, the small tensors that a
 * half layer widens once to float32 (layer.c). */
enum { MHA__WEIGHT_SLOTS = 11, MHA__SMALL_SLOT0 = 4 };
void mha__layer_weight_slots(const mha_config *c,
                             mha_weights *w,
                             mha__weight_slot slots[MHA__WEIGHT_SLOTS]);

/* The byte ranges of the layer's weights w (of the resolved config c: weight_dtype's bytes, a
 * q8_0 / q4_0 layer's small tensors float32), named as the slots; NULL for a weight the config
 * lacks. Fills MHA__WEIGHT_SLOTS spans; returns their count. */
int mha__layer_weight_spans(const mha_config *c, const mha_weights *w, mha__span *in);

/* mha_layer_create: out given (the caller clears *out), config resolved into *cfg (every default
 * filled in, rope resolved), ownership known, every weight the config has given and finite, no
 * weight it lacks; *total = the weights' float count. */
mha_status mha__check_layer_create(const mha_config *config,
                                   const mha_weights *weights,
                                   mha_ownership ownership,
                                   mha_layer *const *out,
                                   mha_config *cfg,
                                   int64_t *total,
                                   mha_error *err);

/* Training entry points (mha_layer_forward_train, mha_layer_project_backward): UNSUPPORTED for a
 * layer with q8_0 weights (inference only; `what` names the caller). */
mha_status mha__check_layer_trainable(const mha_config *c, const char *what, mha_error *err);

/* The forward's arguments against the layer's resolved config (NULL: the layer is): batch, lengths,
 * inputs (self or cross attention, value = key), positions, and the aliasing rule: out and probs
 * against query, key, value, the positions, the masks' tensors and the layer's weights w (NULL:
 * not checked). *kv_len = the key length (q_len for self-attention). The core's options (masks'
 * shapes, dropout, probs) are the core's check (mha__check_attention). */
mha_status mha__check_forward_args(const mha_config *cfg,
                                   const mha_weights *w,
                                   const mha_forward_args *args,
                                   int64_t *kv_len,
                                   mha_error *err);

/* mha_layer_attention_statistics: the same checks, except that out may be NULL (not written;
 * probs and dropout are ignored too). */
mha_status mha__check_layer_stats_args(const mha_config *cfg,
                                       const mha_weights *w,
                                       const mha_forward_args *args,
                                       const mha_attention_stats *stats,
                                       int64_t *kv_len,
                                       mha_error *err);

/* One projection of mha_layer_project, resolved: y[rows, out] = x[rows, in] w^T (+ bias). */
typedef struct mha__projection {
    const void *w; /* of dtype wdt (the layer's weight_dtype) */
    mha_dtype wdt;
    const float *bias; /* float32 (mha__layer_w) */
    int64_t in, out;
} mha__projection;
/* mha_layer_project's arguments (layer, which, rows, x, y, exec->impl) into its projection. */
mha_status mha__check_layer_project(const mha_config *c,
                                    const mha__layer_w *w,
                                    mha_projection which,
                                    int64_t rows,
                                    const float *x,
                                    const float *y,
                                    const mha_exec *exec,
                                    mha__projection *p,
                                    mha_error *err);
/* mha_layer_project_backward's arguments: the projection's, dy, and db only with a bias. */
mha_status mha__check_layer_project_backward(const mha_config *c,
                                             const mha__layer_w *w,
                                             mha_projection which,
                                             int64_t rows,
                                             const float *x,
                                             const float *dy,
                                             const float *dx,
                                             const float *dw,
                                             const float *db,
                                             const mha_exec *exec,
                                             mha__projection *p,
                                             mha_error *err);

/* What the backward's check reads of a training state (layer/layer_bwd.c). */
typedef struct mha__train_view {
    const mha_layer *layer;       /* the layer that made it */
    int self;                     /* the forward was self-attention */
    int value_given;              /* the forward had its own value input */
    const mha_forward_args *args; /* the forward's arguments (its input pointers) */
    int64_t B, n, m;              /* its batch, query and key lengths */
} mha__train_view;
/* mha_layer_backward: layer, state (NULL when the caller's is), dy and grads given, the state made
 * with this layer, and every gradient requested one the layer and the forward have. cfg and w:
 * the layer's resolved config and weights (the gradients must not overlap the weights). */
mha_status mha__check_layer_backward(const mha_layer *layer,
                                     const mha_config *cfg,
                                     const mha_weights *w,
                                     const mha__train_view *state,
                                     const void *dy,
                                     const mha_layer_grads *grads,
                                     mha_error *err);

/* ---------------------------------------------------------------------------------------------- */
/* KV cache and decoding (check/cache.c): mha_kv_cache_*, mha_kv_cache_attention,                 */
/* mha_layer_prefill / mha_layer_decode_step, mha_attention_merge.                                */
/* ---------------------------------------------------------------------------------------------- */

/* What the cache checks read of a cache (cache/kv_cache.h: mha__kv_view_of); cfg == NULL: the
 * cache pointer was NULL. */
/* The span a ring cache keeps per token: the window W, or the chunk size C (a token at p sees at
 * most C keys, C floor(p / C) .. p); 0 = no ring (slots = max_seq). Never both (check_kv_create).
 */
static inline int64_t mha__kv_ring_span(const mha_kv_cache_config *c) {
    return c->window > 0 ? c->window : c->chunk_size;
}

/* The lowest key a token at position pos of a cache with config c sees (window, chunk). */
static inline int64_t mha__kv_first_key(const mha_kv_cache_config *c, int64_t pos) {
    if (c->window > 0)
        return pos - c->window + 1 > 0 ? pos - c->window + 1 : 0;
    if (c->chunk_size > 0)
        return pos - pos % c->chunk_size; /* pos >= 0 */
    return 0;
}

/* Block sizes of a paged cache (mha_kv_cache_config.block_size); cache/kv_cache.h relies on the
 * minimum (MHA__KV_MIN_BLOCK). */
#define MHA__KV_MIN_BLOCK_SIZE 16
#define MHA__KV_MAX_BLOCK_SIZE 65536

typedef struct mha__kv_view {
    const mha_kv_cache_config *cfg; /* resolved */
    const int64_t *len, *lo;        /* [batch]: lengths, lowest intact positions */
    int64_t slots;
} mha__kv_view;

/* mha_kv_cache_create: out given (the caller clears *out), config resolved into *cfg (defaults
 * filled in; against layer_cfg, the layer's, when not NULL). */
mha_status mha__check_kv_create(const mha_kv_cache_config *config,
                                const mha_config *layer_cfg,
                                mha_kv_cache *const *out,
                                mha_kv_cache_config *cfg,
                                mha_error *err);
/* mha_kv_cache_compact: the cache exists. */
mha_status mha__check_kv_compact(const mha__kv_view *c, mha_error *err);
/* seq is a sequence of the cache; name: how the caller calls it. */
mha_status mha__check_kv_seq(const mha__kv_view *c, int64_t seq, const char *name, mha_error *err);
/* seq_ids (NULL = 0 .. S-1): S in [1, batch], in range, distinct. */
mha_status
mha__check_kv_seqs(const mha__kv_view *c, int64_t S, const int64_t *seq_ids, mha_error *err);
/* mha_kv_cache_append: the sequences, t tokens fitting in every one (max_seq, a window cache's
 * max_step_tokens), k and v given. */
mha_status mha__check_kv_append(const mha__kv_view *c,
                                int64_t S,
                                const int64_t *seq_ids,
                                int64_t t,
                                const float *k,
                                const float *v,
                                mha_error *err);
/* truncate, share_prefix and accept: new_len in [0, len[seq]] and, for a ring, its keys still
 * stored; messages name the call fn and its argument arg. */
mha_status mha__check_kv_truncate(const mha__kv_view *c,
                                  int64_t seq,
                                  int64_t new_len,
                                  const char *fn,
                                  const char *arg,
                                  mha_error *err);
/* mha_kv_cache_set_fp8_scales: an FP8_E4M3 cache holding no positions; scales in
 * [2^-100, 2^100]. */
mha_status mha__check_kv_fp8_scales(const mha__kv_view *c,
                                    const float *k_scales,
                                    const float *v_scales,
                                    mha_error *err);
/* mha_kv_cache_read: pos stored in seq; k [g, d_k] and v [g, d_v] (either NULL) do not overlap. */
mha_status mha__check_kv_read(const mha__kv_view *c,
                              int64_t seq,
                              int64_t pos,
                              const float *k,
                              const float *v,
                              mha_error *err);

/* mha_kv_cache_attention's arguments; *scale = the resolved scale (0 = 1/sqrt(d_k)). */
/* Draft trees (tree_parents of mha_kv_attention_args / mha_decode_args): at most this many
 * drafts (the split-KV kernels' per-row bitmask; decode.c's MHA_DEC_MAX_TOKENS). */
#define MHA__TREE_MAX_TOKENS 16
/* tree_parents [t] (NULL passes): t <= MHA__TREE_MAX_TOKENS, parents[i] in [-1, i). */
mha_status mha__check_tree(const int64_t *tree_parents, int64_t t, mha_error *err);
/* mha_kv_cache_accept's arguments. */
mha_status mha__check_kv_accept(const mha__kv_view *c,
                                int64_t seq,
                                int64_t base_len,
                                int64_t n,
                                const int64_t *draft_idx,
                                mha_error *err);
mha_status mha__check_kv_attention(const mha__kv_view *c,
                                   const mha_kv_attention_args *args,
                                   const mha_exec *exec,
                                   double *scale,
                                   mha_error *err);
/* mha_layer_prefill / mha_layer_decode_step: layer_cfg is NULL when the layer pointer is; out
 * must not overlap x, seq_ids, tree_parents or the layer's weights w. */
mha_status mha__check_decode(const mha_config *layer_cfg,
                             const mha_weights *w,
                             const mha__kv_view *c,
                             const mha_decode_args *args,
                             const mha_exec *exec,
                             mha_error *err);

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
                            mha_error *err);

/* ---------------------------------------------------------------------------------------------- */
/* Mask tensors (check/attention.c), for mha_mask_recognize (core/mask_rule.c).                   */
/* ---------------------------------------------------------------------------------------------- */

/* A C-contiguous mask tensor t (1 to 4 dims, each in [1, 2^31], element count in int64) that
 * broadcasts, NumPy style, to target[4]: its element strides over the target's dims (0 where
 * broadcast). `what` names it in messages. */
mha_status mha__check_mask_broadcast(const mha_mask_tensor *t,
                                     const char *what,
                                     const int64_t target[4],
                                     int64_t strides[4],
                                     mha_error *err);

/* ---------------------------------------------------------------------------------------------- */
/* Multi-head latent attention (check/mla.c): mha_mla_create, _forward, _backward, the decode step.
 */
/* ---------------------------------------------------------------------------------------------- */

/* config resolved into *cfg (scale, rms_eps, rope), every weight the config uses given and
 * finite. */
mha_status mha__check_mla_create(const mha_mla_config *config,
                                 const mha_mla_weights *weights,
                                 mha_mla_config *cfg,
                                 mha_error *err);
/* The forward's sizes, pointers, positions and the aliasing rule: out against x, the positions
 * and the layer's weights w (NULL: not checked, for the backward's use with dy as out). */
mha_status mha__check_mla_forward(const mha_mla_config *cfg,
                                  const mha_mla_weights *w,
                                  const mha_mla_forward_args *args,
                                  mha_error *err);
/* mha_mla_backward: grads and grads.dy given, no gradient of a tensor the config lacks, the
 * forward's checks on args (dy in place of out), and the aliasing rule: every gradient against
 * args.x, args.positions, grads.dy, the layer's weights w and every other gradient. */
mha_status mha__check_mla_backward(const mha_mla_config *cfg,
                                   const mha_mla_weights *w,
                                   const mha_mla_forward_args *args,
                                   const mha_mla_grads *grads,
                                   mha_error *err);
/* The decode step's sequences (ids distinct, room in a cache of `batch` sequences of max_seq
 * tokens, lengths len[]), x and out (against x, seq_ids and the layer's weights w). */
mha_status mha__check_mla_decode(const mha_mla_config *cfg,
                                 const mha_mla_weights *w,
                                 int64_t batch,
                                 const int64_t *len,
                                 int64_t max_seq,
                                 const mha_decode_args *args,
                                 mha_error *err);
/* mha_mla_cache_append: the sequences as the decode step's, rows given. */
mha_status mha__check_mla_append(int64_t batch,
                                 const int64_t *len,
                                 int64_t max_seq,
                                 int64_t num_seqs,
                                 const int64_t *ids,
                                 int64_t t,
                                 const float *rows,
                                 mha_error *err);

#endif /* MHA_CHECK_H */
