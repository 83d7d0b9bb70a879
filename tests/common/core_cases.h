/* SPDX-License-Identifier: MIT */
/* core_cases.h: the attention core's test cases, shared by test_grad.c (backward) and test_half.c
 * (half precision): a case description (spec), its tensors and masks built from a seed (built),
 * the core args over them, and the feature matrix CORE_SPECS (small sizes: every case is also
 * finite-differenced by test_grad.c). */
#ifndef MHA_TEST_CORE_CASES_H
#define MHA_TEST_CORE_CASES_H

#include "mha.h"
#include "oracle_grad_f64.h"

#include <stdint.h>

typedef struct spec {
    const char *name;
    int64_t B, H, G, n, m, dk, dv;
    int causal;
    mha_alignment align;
    int window;
    int64_t wl, wr;
    int boolmask; /* 1 = [B,1,n,m] bool, 2 = [n,m] int32 BLOCK polarity */
    int addmask;  /* [B,H,n,m] float with some -inf */
    int kpad, seg, alibi, sinks, dead;
    double softcap, qscale;
    float dropout;
} spec;

typedef struct built {
    spec s;
    float *q, *k, *v, *sinks, *dout;
    float *dlse; /* [B, H, n] after build_dlse (the loss also reads lse), else NULL */
    /* after build_dprobs (the loss also reads the probabilities): [B, H, n, m], or [B, n, m] for
     * the head average (dprobs_average); else NULL */
    float *dprobs;
    int dprobs_average;
    uint8_t *bmask;
    int32_t *imask;
    float *amask;
    uint8_t *kpm;
    int32_t *qseg, *kvseg;
    int64_t offsets[4];
    mha_masking mask;
    mha_dropout drop;
} built;

void build(const spec *s, uint64_t seed, built *c);
/* c->dlse, normal values from a stream of its own (c's other tensors stay those of the seed). */
void build_dlse(built *c, uint64_t seed);
/* c->dprobs likewise, per head or for the head average. */
void build_dprobs(built *c, uint64_t seed, int average);
/* c->dprobs as the float64 oracle takes it: per head [B, H, n, m] (the average's G / H), or NULL.
 */
double *dprobs_per_head(const built *c);
void built_free(built *c);
/* Contiguous [B, heads, L, d] core args over c's tensors. */
void core_args(const built *c, float *out, float *lse, mha_attention_args *a);
double *to_d(const float *x, int64_t count);
void og_from(const built *c, og_core *o, double *q, double *k, double *v, double *sk);
double dsum(const double *a, const double *b, int64_t count);
/* Max |S| of the case, S = scale q.k in double (the backstops' score term), capped by softcap. */
double max_score(const built *c);

#define BR MHA_ALIGN_BOTTOM_RIGHT
#define TL MHA_ALIGN_TOP_LEFT
#define EX MHA_ALIGN_EXPLICIT
extern const spec CORE_SPECS[];
extern const int N_CORE_SPECS;

#endif
