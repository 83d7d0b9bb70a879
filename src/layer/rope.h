/* SPDX-License-Identifier: MIT */
/* rope.h: rotary position embeddings (layer/rope.c): the tables and the rotation of one head
 * vector, shared by the layer's plan (plan.c), the public mha_rope_* calls and the tests. */
#ifndef MHA_LAYER_ROPE_H
#define MHA_LAYER_ROPE_H

#include "base/internal.h"

/* RoPE tables: inverse frequencies [R/2] and the cos/sin factor, from a resolved mha_rope
 * (check/: mha__check_rope). */
void mha__rope_freqs(const mha_rope *resolved, double *freqs, double *cs_factor);
/* The fixed rope `resolved` becomes for a call of `length` = 1 + its largest position: DYNAMIC
 * becomes NTK at that length (or unscaled up to original_max_position); LONGROPE gets that
 * length's list in both lists; the others are unchanged. */
mha_rope mha__rope_at_length(const mha_rope *resolved, int64_t length);
/* 1 + the largest position rotated: positions pos[b * batch_stride + t] (b < B, t < L), or
 * base[b] + t without pos (base NULL: t); 0 when there are none. */
int64_t mha__positions_length(
    const int64_t *pos, const int64_t *base, int64_t B, int64_t L, int64_t batch_stride);
/* cos/sin of every pair for one position: cos_out[k] = cs_factor * cos(pos * freqs[k]). */
void mha__rope_cos_sin(const mha_rope *resolved,
                       const double *freqs,
                       double cs_factor,
                       int64_t position,
                       double *cos_out,
                       double *sin_out);
/* Rotates one head vector x[0..D) in place with the pairs' cos/sin (pairing from the style). */
void mha__rope_rotate(const mha_rope *resolved, const double *cos_k, const double *sin_k, float *x);

#endif /* MHA_LAYER_ROPE_H */
