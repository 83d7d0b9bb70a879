/* SPDX-License-Identifier: MIT */
/* oracle_grad_f64.h: float64 forward AND analytic backward of the attention core and the layer,
 * with float64 inputs (tests only, never shipped). Its forward takes double inputs so that
 * central finite differences with h = 1e-6 are meaningful (test_grad.c checks the backward
 * against them); the forward is also checked against oracle_f64.c. Written from the formulas
 * of docs/SEMANTICS.md and docs/TRAINING.md; masks are evaluated by their definition here. */
#ifndef MHA_ORACLE_GRAD_F64_H
#define MHA_ORACLE_GRAD_F64_H

#include "mha.h"

/* The core. Tensors contiguous: q [B,H,n,dk], k [B,G,m,dk], v [B,G,m,dv], out/dout [B,H,n,dv],
 * lse [B,H,n]; sinks [H] or NULL. mask/dropout as in mha_attention_args. */
typedef struct og_core {
    int64_t B, H, G, n, m, dk, dv;
    double scale;   /* 0 = 1/sqrt(dk) */
    double softcap; /* 0 = off */
    int alibi;
    const double *sinks;
    const double *q, *k, *v;
    mha_masking mask;
    mha_dropout dropout;
} og_core;

/* out and lse may be NULL. Returns 0. */
int og_core_forward(const og_core *c, double *out, double *lse);
/* og_core_forward plus the probabilities before dropout, [B, H, n, m] (0 in a fully masked row),
 * when probs is not NULL. */
int og_core_forward_probs(const og_core *c, double *out, double *lse, double *probs);
/* Gradients of L = sum(dout * out) + sum(dlse * lse) + sum(dprobs * probs) (dlse [B, H, n],
 * dprobs [B, H, n, m] per head, the probabilities before dropout; NULL = 0); any output may be
 * NULL. Overwrites. Returns 0. */
int og_core_backward(const og_core *c,
                     const double *dout,
                     const double *dlse,
                     const double *dprobs,
                     double *dq,
                     double *dk,
                     double *dv,
                     double *dsinks);

/* The layer. Weights in nn.Linear layout, in double; biases/sinks NULL when absent. */
typedef struct og_weights {
    const double *w_q, *w_k, *w_v, *w_o, *b_q, *b_k, *b_v, *b_o, *sinks;
} og_weights;

typedef struct og_layer_grads {
    double *d_query, *d_key, *d_value; /* self-attention: d_query gets all paths (d_key/d_value
                                          unused); value == NULL: d_key gets both paths */
    double *dw_q, *dw_k, *dw_v, *dw_o, *db_q, *db_k, *db_v, *db_o, *d_sinks;
} og_layer_grads;

/* cfg: a RESOLVED config (mha_layer_config of a layer), so every size is explicit. x_key NULL =
 * self-attention; x_value NULL = x_key. Positions/mask/dropout as in mha_forward_args.
 * og_layer_forward writes y [B, n, out_dim]; og_layer_backward the gradients of sum(dy * y). */
int og_layer_forward(const mha_config *cfg,
                     const og_weights *w,
                     int64_t B,
                     int64_t n,
                     int64_t m,
                     const double *x_query,
                     const double *x_key,
                     const double *x_value,
                     const int64_t *q_pos,
                     const int64_t *k_pos,
                     const mha_masking *mask,
                     const mha_dropout *dropout,
                     double *y);
int og_layer_backward(const mha_config *cfg,
                      const og_weights *w,
                      int64_t B,
                      int64_t n,
                      int64_t m,
                      const double *x_query,
                      const double *x_key,
                      const double *x_value,
                      const int64_t *q_pos,
                      const int64_t *k_pos,
                      const mha_masking *mask,
                      const mha_dropout *dropout,
                      const double *dy,
                      const og_layer_grads *g);

#endif
