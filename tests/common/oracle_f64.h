/* SPDX-License-Identifier: MIT */
/* oracle_f64.h: the float64 oracle (tests only, never shipped). Written from the formulas of
 * docs/SEMANTICS.md independently of src/: its own mask broadcasting, its own softmax, in double.
 */
#ifndef MHA_ORACLE_F64_H
#define MHA_ORACLE_F64_H

#include "mha.h"

/* Element idx = (b, h, i, j) of a mask broadcast NumPy-style to [B, h, n, m], as a double. */
double oracle_mask_elem(const mha_mask_tensor *t, const int64_t idx[4]);
/* ALiBi slope of head h of H (powers of two; BLOOM's interpolation otherwise). */
/* Element off of a tensor of dtype dt (F32, BF16 or F16), exactly, as a double. */
double oracle_elem(mha_dtype dt, const void *base, int64_t off);
double oracle_alibi_slope(int64_t H, int64_t h);

/* The attention core in float64. Same inputs as mha_attention (args->out/lse/probs ignored);
 * writes out [B, H, n, dv], lse [B, H, n] and probs [B, H, n, m] (never averaged; NULL to skip),
 * all contiguous. Returns 0, or -1 if args are outside what the oracle handles. */
int oracle_attention(const mha_attention_args *args, double *out, double *lse, double *probs);

/* Temperature tuning's tau(p) in double (the float32 floor of the definition included). */
double oracle_temperature(const mha_temperature_tuning *t, int64_t p);

/* The layer in float64 (RoPE without frequency scaling only): x_q [B, n, q_dim], x_k/x_v as in
 * mha_forward_args; out [B, n, out_dim], probs [B, H, n, m] (NULL to skip). */
int oracle_layer(const mha_config *cfg,
                 const mha_weights *w,
                 const mha_forward_args *args,
                 double *out,
                 double *probs);
/* oracle_layer with the layer's intermediates stored in act (docs/SEMANTICS.md "Half precision
 * in the layer"): the projections, RoPE's results and the attention output rounded to act
 * (F32: as oracle_layer, which this is with act = F32). */
int oracle_layer_dt(const mha_config *cfg,
                    const mha_weights *w,
                    const mha_forward_args *a,
                    mha_dtype act,
                    double *out,
                    double *probs);

#endif
