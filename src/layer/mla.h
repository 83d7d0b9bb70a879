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

#endif /* MHA_LAYER_MLA_H */
