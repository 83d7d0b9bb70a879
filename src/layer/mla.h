/* SPDX-License-Identifier: MIT */
/* mla.h: the multi-head latent attention layer's private form (layer/mla.c), shared with its
 * compressed-cache decode (decode/mla_decode.c). */
#ifndef MHA_LAYER_MLA_H
#define MHA_LAYER_MLA_H

#include "base/internal.h"

struct mha_mla {
    mha_mla_config cfg; /* resolved */
    mha_mla_weights w;  /* pointers into `mem` */
    float *mem;         /* one block holding every weight */
    float *w_uk_t;      /* [h, r, dn]: W_uk,h^T, the k rows of W_kvb per head transposed (the
                           absorbed decode's q_lat_h = q_nope_h W_uk,h is then a GEMM) */
    mha_allocator allocator;
    int has_allocator;
};

/* Scratch of the projections for T = rows tokens (floats, mha__mla_project). */
typedef struct mha__mla_rows {
    float *q;  /* [T, h, dq]: [q_nope, q_pe] per head, q_pe rotated */
    float *kv; /* [T, r + dr]: [c (normed), k_pe (rotated)] */
} mha__mla_rows;

/* q and [c, k_pe] of T = batch * seq tokens x [T, hidden] at positions pos[b * seq + t] (NULL:
 * base[b] + t, base NULL: t): the projections, both RMSNorms and RoPE. tmp: at least
 * max(q_lora_rank, 1) * T floats. */
mha_status mha__mla_project(const struct mha_mla *m,
                            int64_t batch,
                            int64_t seq,
                            const float *x,
                            const int64_t *pos,
                            const int64_t *base,
                            mha__mla_rows rows,
                            float *tmp,
                            mha__team team,
                            mha_error *err);

/* RMSNorm of T rows of d values at x (row stride ld), in place: x = w * x / sqrt(mean(x^2) +
 * eps). The mean is summed in double (in order), the products rounded once to float. */
void mha__mla_rms_norm(float *x, int64_t T, int64_t d, int64_t ld, const float *w, double eps);
/* RoPE on q_pe (the last dr values of each head's dq in rows.q) and k_pe (the last dr of each
 * rows.kv row) of T = B * L tokens at positions pos[b L + t], or base[b] + t; inverse != 0
 * applies the transpose (rotation by -angle), the backward's. */
mha_status mha__mla_rotate(const struct mha_mla *m,
                           int64_t B,
                           int64_t L,
                           const int64_t *pos,
                           const int64_t *base,
                           mha__mla_rows rows,
                           int inverse,
                           mha_error *err);
/* The expanded keys: k [T, h, dq] = [k_nope_h (from kvb [T, h, dn + dv]), k_pe (kv's, shared)]. */
void mha__mla_expand_keys(
    const mha_mla_config *c, int64_t T, const float *kvb, const float *kv, float *k);
/* The core's arguments of the expanded form: q, k [B, L, h, dq], v = kvb + dn ([B, L, h, dn +
 * dv] rows), o [B, L, h, dv]; causal as args; lse not set. */
void mha__mla_core_args(const struct mha_mla *m,
                        const mha_mla_forward_args *a,
                        const float *q,
                        const float *k,
                        const float *kvb,
                        float *o,
                        mha_attention_args *out);

#endif /* MHA_LAYER_MLA_H */
