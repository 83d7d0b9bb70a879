/* SPDX-License-Identifier: MIT */
/* tolerance.h: THE place where test tolerances live (docs/TESTING.md explains each number).
 *
 * float32 compute against a float64 reference. Unit roundoff u = 2^-24 = 6.0e-8. An attention
 * layer output is a chain of dot products of length K (projections: K = features; scores: d_k;
 * mixing: m; output projection: h*d_v); the worst-case relative error of such sums grows like K*u
 * but the observed one like sqrt(K)*u. For the sizes in the test matrix (K <= 256) that gives
 * ~1e-6 relative to the output's scale; we gate at 1e-5 * max|ref| (about 10x headroom over the
 * worst case measured, recorded in docs/TESTING.md). */
#ifndef MHA_TEST_TOLERANCE_H
#define MHA_TEST_TOLERANCE_H

/* Layer or core output vs float64 reference: max|y - ref| <= TOL_OUT_REL * max|ref|. */
#define TOL_OUT_REL    1e-5
/* Attention probabilities (values in [0, 1]) vs float64: max|p - ref| <= TOL_PROBS_ABS. */
#define TOL_PROBS_ABS  1e-5
/* RoPE alone: an elementwise rotation, error ~ |x| * (angle error + u); CS336's own gate is
 * atol 1e-6 + rtol 1e-4, applied as the suite does. */
#define TOL_CS336_ATOL 1e-6
#define TOL_CS336_RTOL 1e-4

/* KV-cache decoding with a half-precision cache vs the float32 full forward (test_kv_cache.c).
 * K and V are rounded once to the storage type (unit roundoff u_s: float16 2^-11 = 4.9e-4,
 * bfloat16 2^-8 = 3.9e-3); a relative error u_s in every key moves each score by about
 * u_s * |s| and every value by u_s * |v|, so the output moves by a few u_s relative to its scale
 * (more where the softmax is sharp: the scores in these tests reach |s| ~ 8). Gate at 8 u_s;
 * measured worst (printed by the test): see docs/INFERENCE.md. */
#define TOL_KV_F16_REL  (8.0 / 2048.0)
#define TOL_KV_BF16_REL (8.0 / 256.0)

#endif
