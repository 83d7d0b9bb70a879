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
#define TOL_KV_F16_REL     (8.0 / 2048.0)
#define TOL_KV_BF16_REL    (8.0 / 256.0)
/* A whole (tiny, 2-layer) transformers model decoded through mha.torch.MhaCache with a rounded
 * cache, against its float64 full forward (tests/test_python_hf_cache.py): every layer reads K/V
 * of unit roundoff u (float16 2^-11, bfloat16 2^-8, q8_0 1/254 of its block's max, fp8_e4m3
 * 2^-4); each layer's attention output moves by a few u of its scale (above), and the RMS norms,
 * residual sums and the LM head carry that to the logits without amplifying it much at these
 * sizes. Gate: max|logits - ref| <= TOL_KV_MODEL_C u max|ref|; measured worst over 7
 * architectures (llama, qwen2, mistral, gemma2, gpt_oss, cohere2, llama4_text): 2.1 u (q8_0),
 * 1.3 u (bfloat16), 0.8 u (float16), 0.6 u (fp8). */
#define TOL_KV_MODEL_C     4.0
/* q8_0 caches (docs/SEMANTICS.md "q8_0 KV cache"), per element of a block with a = max|x| (a/127
 * below 65504): d = f16(a/127) <= (a/127)(1 + 2^-11) when normal, |d - a/127| <= 2^-25 when
 * subnormal. Unsaturated, |x - q d| <= d/2; saturated (|x/d| > 127.5 only if d < a/127),
 * |x| - 127 d <= 127 |a/127 - d| <= a 2^-11 or 127 2^-25. So
 *   |x - q d| <= a/254 (1 + 2^-11) + 127 2^-25.
 * Attention: keys off by e_k per element shift each score by at most Delta = scale ||q||_1 e_k,
 * each softmax weight by a factor in [e^-2Delta, e^2Delta], so with values off by e_v
 *   |o - o*| <= (exp(2 Delta) - 1) max|v| + e_v   (+ the float32 term TOL_OUT_REL max|o|).
 * tests/test_kv_q8.c computes it per head from the data. */
#define TOL_Q8_ELEM(a)     ((a) / 254.0 * (1.0 + 0x1p-11) + 127.0 * 0x1p-25)
/* q4_0 weights (docs/SEMANTICS.md "q4_0 weights"), per element of a block with max |x| = a
 * (a / 8 <= 65504): d = f16(m / -8) has |d| within (a/8)(1 +- 2^-11) (normal) or 2^-25 of a/8
 * (subnormal). Unclamped, |x - (q-8) d| <= |d| / 2; the value of the other sign past 7.5 |d|
 * clamps to 7 |d|: |x| - 7 |d| <= a - 7 (a/8)(1 - 2^-11) = a/8 (1 + 7 2^-11), or a/8 + 7 2^-25
 * subnormal; the clamp at q = 0 only for a subnormal d, within 8 2^-25. So
 *   |x - x^| <= a/8 (1 + 7 2^-11) + 7 2^-25   (+ 2^-25: the subnormal q = 0 case). */
#define TOL_Q4_ELEM(a)     ((a) / 8.0 * (1.0 + 7.0 * 0x1p-11) + 8.0 * 0x1p-25)
/* fp8 e4m3 caches (docs/SEMANTICS.md "fp8 KV cache"), per element x of a kv head with scale s,
 * |x / s| <= 448 (no saturation): y = fl(x / s) is rounded to the nearest e4m3 value, 3
 * mantissa bits: |y - e4m3(y)| <= |y| 2^-4 for normals (|y| >= 2^-6), <= 2^-10 (half the
 * subnormal spacing 2^-9) below. The read value e4m3(y) s is one more float32 rounding and y
 * one before, so
 *   |x - e4m3(y) s| <= (|x| 2^-4 + s 2^-10) (1 + 2^-18).
 * Attention: the same propagation as q8_0 (Delta from e_k, then (exp(2 Delta) - 1) max|v| + e_v);
 * tests/test_kv_fp8.c computes it per head from the data. */
#define TOL_FP8_REL        0x1p-4
#define TOL_FP8_SUB_ABS    0x1p-10
#define TOL_FP8_ELEM(a, s) (((a)*TOL_FP8_REL + (s)*TOL_FP8_SUB_ABS) * (1.0 + 0x1p-18))
/* MLA's compressed-cache decode (tests/test_python_mla.py) uses the same three: TOL_OUT_REL for
 * a float32 cache (the absorbed form is the expanded one with its products summed in another
 * order: float32 rounding, measured <= 4e-7), TOL_KV_F16_REL / TOL_KV_BF16_REL for half caches
 * (each cached [c, k_pe] value rounded once, as K and V are here; measured 2.3e-4 and 1.8e-3). */

/* Unit roundoff of float32, the u of the backstops below. */
#define TOL_U32 0x1.0p-24

/* Flash kernels and extreme inputs vs the float64 oracle (test_kernels.c, test_extremes.c),
 * absolute backstop per output element:
 *   |o - o*| <= TOL_OUT_BACKSTOP_C * u * max|V| * (1 + max|S|)  (+ u |o*| in test_kernels.c)
 * An output is a convex combination of V rows (error ~ u max|V| per rounding of the sum); a
 * relative score error u |S| moves a probability by about u |S|, hence the (1 + max|S|). The
 * constant covers the few roundings per element (exp, scale, the rescaling of the online
 * softmax); docs/TESTING.md records the worst measured excess. */
#define TOL_OUT_BACKSTOP_C 16.0

/* Backward vs the float64 oracle (test_grad.c), per gradient tensor:
 *   max|g - g*| <= TOL_BWD_C * u * max|g*| * (1 + max|S|) * sqrt(m)
 * sqrt(m): dK/dV/dQ are sums over up to m (or n x group) terms whose rounding errors add like a
 * random walk. Calibrated on test_grad's sweep; the worst value of the left side divided by the
 * right side without TOL_BWD_C is printed ("worst backstop c") and recorded in docs/TRAINING.md. */
#define TOL_BWD_C  32.0
/* Finite differences of the float64 oracle (test_grad.c): step h and the relative gate of the
 * central difference (error O(h^2) of the third derivative plus u_64 / h roundoff). */
#define TOL_FD_H   1e-6
#define TOL_FD_REL 1e-6

/* float32 layer gradients vs float64 torch goldens (test_grad_golden.c): measured worst 1.7e-6
 * (docs/TRAINING.md); the gate is the forward's TOL_OUT_REL, ~6x the worst case seen. */
#define TOL_GRAD_REL TOL_OUT_REL

/* Half-precision storage (bf16 / f16 inputs and outputs, float32 arithmetic) vs the float64
 * oracle on the SAME rounded inputs (test_half.c, and the Python faces), per output tensor:
 *   max|y - ref| <= TOL_HALF_C * u_s * max|ref| + TOL_OUT_REL * max|ref|
 * u_s is the storage's unit roundoff (bfloat16 2^-8 = 3.9e-3, float16 2^-11 = 4.9e-4). Because the
 * oracle sees the same rounded inputs, the only storage error left is the ONE rounding of each
 * output to its dtype: at most u_s |y| <= u_s max|ref| (round to nearest: half an ulp, i.e. u_s
 * relative). The float32 arithmetic adds the f32 term (TOL_OUT_REL). TOL_HALF_C = 2 leaves 2x over
 * that bound; a kernel that rounded an intermediate (Q K^T scores or P to bf16, as FlashAttention
 * does) would add about u_s |S| and fail it, which is the point: such a kernel must say so and use
 * TOL_HALF_TILE_C instead. Gradients: the same with TOL_OUT_REL replaced by the backward's f32
 * backstop (tests compute both and take the sum). */
#define TOL_HALF_C            2.0
#define TOL_HALF_U_BF16       0x1.0p-8
#define TOL_HALF_U_F16        0x1.0p-11
/* A kernel that rounds P to the storage before P V (bf16 dot products: AVX512-BF16, AMX) adds up
 * to u_s p_j per probability, i.e. at most u_s max|V| per output (sum_j p_j = 1); Q K^T on bf16
 * inputs is exact products with float32 sums (no u_s term); the output's own rounding adds
 * u_s |o|. test_half_kernel.c gates
 *   max|o - o*| <= TOL_HALF_TILE_C u_s (max|V| + max|o*|) + TOL_OUT_REL max|o*|
 * (measured worst 0.39 of the u_s (max|V| + max|o*|) unit: about 10x headroom). */
#define TOL_HALF_TILE_C       4.0
/* The layer of a half module (x_dtype == weight_dtype half): Q, K, V, RoPE's results and the
 * attention output A are stored in that dtype (docs/SEMANTICS.md "Half precision in the layer").
 * The float64 oracle rounds at the same points (oracle_layer_dt), so what is left beyond the
 * output's own rounding (TOL_HALF_C u_s) is (a) an element whose float32 and float64 values fall
 * on the two sides of a rounding boundary: a difference of one half-ulp (2 u_a |e|) in it, which
 * reaches y through one row of W_o (or one score), and (b) with the bf16 tile kernel (AUTO on an
 * AVX512-BF16 CPU) its P rounding, u_a max|V| per element of A, summed through W_o's row.
 *   max|y - ref| <= (TOL_HALF_C u_out + C u_a + TOL_OUT_REL) max|ref|
 * with C = TOL_HALF_LAYER_C without the tile kernel and TOL_HALF_LAYER_TILE_C with it (measured
 * worst in test_half_layer, printed by it: see the constants' values for the headroom).
 * Gradients of a half module against the float64 gradient of the UNROUNDED layer (the roundings
 * are differentiated as the identity, so the gradient sees the forward's rounding errors: every
 * rounded intermediate perturbs it by about u_a relative): TOL_HALF_LAYER_GRAD_C u_a. */
#define TOL_HALF_LAYER_C      1.0
#define TOL_HALF_LAYER_TILE_C 4.0
#define TOL_HALF_LAYER_GRAD_C 8.0

#endif
