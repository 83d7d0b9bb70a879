/* SPDX-License-Identifier: MIT */
/* attention_bwd.h: internal interface of the attention backward (never installed).
 *
 * attention_bwd.c validates mha_attention_args + mha_attention_grads into an mha__bwd_problem and
 * cuts it into WORK UNITS, one per (batch row b, kv head g). A unit owns every output it touches:
 * dK and dV of kv head g, dQ of the h/g query heads that read it, and the sink partial sums of
 * those heads in batch row b. Units therefore never share an output element (no atomics, no
 * races), and each unit's arithmetic does not depend on which thread runs it, so results are
 * bit-identical for any thread count.
 *
 *   q: [B, H, n, dk]  k: [B, G, m, dk]  v: [B, G, m, dv]  out, dout: [B, H, n, dv]  lse: [B, H, n]
 *   dq: [B, H, n, dk] dk: [B, G, m, dk] dv: [B, G, m, dv] (each optional)
 */
#ifndef MHA_ATTENTION_BWD_H
#define MHA_ATTENTION_BWD_H

#include "base/internal.h"

typedef struct mha__bwd_problem {
    const mha__problem *p; /* the forward problem: sizes, q, k, v, out, lse, masks, dropout */
    const void *dout;
    int64_t dos[3];
    void *dq, *dk, *dv; /* NULL = not wanted */
    int64_t dqs[3], dks[3], dvs[3];
    mha_dtype do_dt, dq_dt, dk_dt, dv_dt; /* storage dtypes (F32, BF16, F16) */
    const float *dlse;                    /* [B, H, n] dL/dlse (grads->dlse), or NULL (0) */
    const float *dprobs; /* dL/dprobs (grads->dprobs) in p->probs' layout, or NULL (0) */
    float *sink_part;    /* [B * H] per (b, h) partial dL/dsink, or NULL (no sinks wanted) */
    int accumulate;
} mha__bwd_problem;

/* Row i of head h's dL/dprobs in batch row b (mha_attention_grads.dprobs, in p->probs' layout):
 * G_ij = row[j] * mha__probs_grad_scale(p), since the head average's gradient reaches each of the
 * H heads times 1 / H. */
static inline const float *
mha__probs_grad_row(const mha__problem *p, const float *dprobs, int64_t b, int64_t h, int64_t i) {
    return dprobs + ((p->average_probs ? b * p->n : (b * p->H + h) * p->n) + i) * p->m;
}
static inline float mha__probs_grad_scale(const mha__problem *p) {
    return p->average_probs ? 1.0f / (float)p->H : 1.0f;
}

/* One unit (b, g) with `scratch` of the kernel's scratch size. */
typedef void (*mha__bwd_fn)(const mha__bwd_problem *bp, int64_t b, int64_t g, void *scratch);

/* The reference backward (src/kernels/ref/attention_bwd_ref.c): plain loops, row by row. */
bool mha__attention_bwd_ref_scratch(const mha__problem *p, size_t *bytes);

/* FlashAttention-2 style backward (src/kernels/generic/attn_bwd_flash_generic.c and the per-ISA
 * instantiations): key tiles of MHA__BWD_BK keys, query blocks of MHA__BWD_BQ rows. */
#define MHA__BWD_BQ 32
#define MHA__BWD_BK 64
bool mha__bwd_flash_scratch(const mha__problem *p, size_t *bytes);

#endif /* MHA_ATTENTION_BWD_H */
