/* SPDX-License-Identifier: MIT */
/* plan.h: the steps of the layer's plan that the forward (layer.c), the training forward and
 * backward (layer_bwd.c) and the decode step (decode/decode.c) share, written once:
 *
 *   x --project--> Q, K, V --rope--> core --(attention)--> A --project--> y
 *
 * Each driver owns its buffers and its order of calls; these functions own the arithmetic.
 */
#ifndef MHA_LAYER_PLAN_H
#define MHA_LAYER_PLAN_H

#include "base/internal.h"

/* One projection y[rows, out] = x[rows, in] W[out, in]^T (+ bias[out]): the plain loops (one
 * float32 chain per element, c in increasing order, then the bias) for impl=reference, the
 * packed GEMM (the best tier of this CPU) otherwise. x is stored in xdt and W in wdt (F32, BF16
 * or F16, widened exactly where read: the GEMM's packing, the loops' loads); bias and y are
 * float32. pack: W-packing space of mha__gemm_workspace_size_dt() bytes, or NULL to take it from
 * alloc. */
mha_status mha__plan_project(mha_impl impl,
                             const mha_allocator *alloc,
                             mha__team team,
                             const void *x,
                             mha_dtype xdt,
                             const void *w,
                             mha_dtype wdt,
                             const float *bias,
                             float *y,
                             int64_t rows,
                             int64_t in,
                             int64_t out,
                             void *pack,
                             size_t pack_bytes,
                             mha_error *err);

/* The storage dtype of the layer's intermediates (Q and K after each of their stages, V, the gate
 * G, the attention output A and the gated A; docs/SEMANTICS.md "Half precision in the layer"):
 * the half dtype when x and W are both stored in it (a bf16 or f16 module, torch.autocast), else
 * F32. */
static inline mha_dtype mha__plan_act_dtype(mha_dtype xdt, mha_dtype wdt) {
    return xdt == wdt ? xdt : MHA_DTYPE_F32;
}

/* The stages Q and K go through between the projection and the core, in this order (each but the
 * projection only when the layer has it). */
enum {
    MHA__QK_PROJ = 0, /* Q' = x W^T + b */
    MHA__QK_NORM,     /* RMS_HEAD / RMS_ALL QK-norm (before RoPE) */
    MHA__QK_ROPE,     /* RoPE */
    MHA__QK_L2,       /* L2_AFTER_ROPE QK-norm */
    MHA__QK_TEMP      /* temperature tuning (Q only) */
};

/* Half intermediates: Q [nq] and K [nk] rounded to dt in place after `stage` when the layer has
 * that stage and another one follows it (the last stage's rounding is the one into the buffers
 * the core reads, or the statistics' final round). F32, or nothing to round: nothing. A plain
 * layer thus rounds Q' and K' before RoPE only, as it did before these stages existed. */
mha_status mha__plan_round_qk(const mha_config *cfg,
                              int stage,
                              mha__team team,
                              mha_dtype dt,
                              float *q,
                              int64_t nq,
                              float *k,
                              int64_t nk,
                              mha_error *err);

/* x[0, count) rounded to dt's precision in place, x stays float32: x = widen(narrow(x)), the
 * projection's half output as RoPE reads it (F32: nothing). Threads split the range. */
mha_status mha__plan_round(mha__team team, mha_dtype dt, float *x, int64_t count, mha_error *err);
/* dst[i] = src[i] rounded to dt (nearest even), i < count: mha__narrow's bits, threads split the
 * range (F32: a copy). */
mha_status mha__plan_narrow(
    mha__team team, mha_dtype dt, const float *src, void *dst, int64_t count, mha_error *err);

/* Doubles of RoPE tables mha__plan_rope needs: frequencies, cos and sin of one position. */
static inline size_t mha__plan_rope_doubles(const mha_rope *resolved) {
    return (size_t)(3 * (resolved->rotary_dim / 2));
}

/* The length a call's RoPE is taken at, a DYNAMIC or LONGROPE rope's L: 1 + the largest query or
 * key position, positions as mha__plan_rope reads them (q_pos [B, n] and k_pos [B, m], or
 * base[b] + t when NULL, base NULL = 0). 0 for a rope that does not depend on it (no scan). */
int64_t mha__plan_rope_length(const mha_rope *resolved,
                              const int64_t *q_pos,
                              const int64_t *k_pos,
                              const int64_t *base,
                              int64_t B,
                              int64_t n,
                              int64_t m);

/* RoPE over x [B, L, heads, d]: row (b, t) is at position pos[b * L + t] if pos is given, else
 * base[b] + t (base NULL = 0), and is rotated by +angle (sign = 1) or -angle (sign = -1: the
 * transposed rotation, the backward's), with the rope taken at the call's `length`
 * (mha__rope_at_length). tab: mha__plan_rope_doubles() doubles of scratch. */
void mha__plan_rope(const mha_rope *resolved,
                    int64_t length,
                    double *tab,
                    float *x,
                    int64_t B,
                    int64_t L,
                    int64_t heads,
                    int64_t d,
                    const int64_t *pos,
                    const int64_t *base,
                    int sign);

/* QK-norm (docs/SEMANTICS.md "QK-norm") of x [rows, heads * d] in place: groups of d values (each
 * head's; RMS_HEAD, L2_AFTER_ROPE) or heads * d (the whole row; RMS_ALL), each scaled by
 * r = 1 / sqrt(sum(x^2) / G + eps) (sum of squares in double), then by w, 1 + w (unit_offset) or
 * nothing (w NULL); w float32 [d] or [heads * d]. */
void mha__plan_qk_norm(
    const mha_qk_norm *nrm, const float *w, float *x, int64_t rows, int64_t heads, int64_t d);

/* The layer's QK-norm at one stage of the plan: after_rope = 0 right after the projections (the
 * RMS kinds), 1 after RoPE (L2_AFTER_ROPE); nothing when the layer's kind is not of that stage.
 * q [rows_q, h*dk], k [rows_k, g*dk] (either may be NULL: not normed). */
void mha__plan_qk_norm_stage(const mha_config *cfg,
                             const mha__layer_w *w,
                             int after_rope,
                             float *q,
                             int64_t rows_q,
                             float *k,
                             int64_t rows_k);

/* 1 when the layer's QK-norm runs at that stage (see mha__plan_qk_norm_stage). */
int mha__plan_qk_norm_at(const mha_config *cfg, int after_rope);

/* The transpose of mha__plan_qk_norm: x [rows, heads * d] is the norm's INPUT, g holds dL/dy on
 * entry and dL/dx on return; dw (NULL = not wanted) accumulates dL/dw in double, [G] (the
 * weight's length), with u = x r and t = g s: dx = r (t - u sum(t u) / G), dw += g u. */
void mha__plan_qk_norm_backward(const mha_qk_norm *nrm,
                                const float *w,
                                const float *x,
                                float *g,
                                double *dw,
                                int64_t rows,
                                int64_t heads,
                                int64_t d);
/* Temperature tuning's factor at position p (docs/SEMANTICS.md):
 * tau(p) = ln(floor((fl32(p) + 1) / fl32(floor_scale)) + 1) * attn_scale + 1, the sum, quotient
 * and floor in float32 (transformers'), the rest in double rounded once. */
float mha__temperature_factor(const mha_temperature_tuning *t, int64_t p);

/* Temperature tuning over x [B, L, heads, d] (Q after RoPE, or dQ in the backward): row (b, t)
 * times tau(its position), positions as mha__plan_rope reads them (pos [B, L], or base[b] + t
 * when NULL, base NULL = 0). Nothing when t->enabled is 0. */
void mha__plan_temperature(const mha_temperature_tuning *t,
                           float *x,
                           int64_t B,
                           int64_t L,
                           int64_t heads,
                           int64_t d,
                           const int64_t *pos,
                           const int64_t *base);

/* The output gate's weights (config.output_gate, docs/SEMANTICS.md): rows h*d_k .. 2*h*d_k of
 * w_q (stored in w->wdt) and of the float32 b_q (NULL without bias). */
void mha__plan_gate_weights(const mha_config *cfg,
                            const mha__layer_w *w,
                            const void **w_gate,
                            const float **b_gate);

/* a[i] *= sigmoid(g[i]) for i < count: the gate on the attention output, in float32. */
void mha__plan_gate_apply(const float *g, float *a, int64_t count);
/* The same on a stored in dt: a[i] = round_dt(widen(a[i]) * sigmoid(g[i])), the product in
 * float32 rounded once (F32: mha__plan_gate_apply). */
void mha__plan_gate_apply_dt(mha_dtype dt, const float *g, void *a, int64_t count);

/* The core's arguments over the plan's buffers: Q [B, n, h, dk], K [B, m, g, dk], V [B, m, g, dv],
 * A [B, n, h, dv] ([B, L, heads, d] seen as [B, heads, L, d]), all four stored in dt (the
 * intermediates' dtype, mha__plan_act_dtype), the layer's scale, softcap, ALiBi and sinks, the
 * call's masks, dropout and probabilities; lse [B, h, n] or NULL. */
void mha__plan_core_args(const mha_config *cfg,
                         const float *sinks,
                         const mha_forward_args *a,
                         int64_t m,
                         const void *q,
                         const void *k,
                         const void *v,
                         void *att,
                         float *lse,
                         mha_dtype dt,
                         mha_attention_args *c);

#endif /* MHA_LAYER_PLAN_H */
