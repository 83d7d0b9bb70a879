/* SPDX-License-Identifier: MIT */
/* test_kv_q8.c: the q8_0 KV cache (docs/SEMANTICS.md "q8_0 KV cache").
 *   1. The quantizer, bit for bit, against a scalar reference written here (its own float16
 *      rounding from a table of every finite float16): random blocks, exact ties (to even),
 *      saturation (d clamped to 65504), zero / subnormal / tiny blocks, NaN and inf blocks.
 *      Read back through mha_kv_cache_read (q * d as float32).
 *   2. mha_kv_cache_attention (AUTO, the tier MHA_MAX_ISA allows; REFERENCE) against the float64
 *      attention over the DEQUANTISED keys and values: TOL_OUT_REL (float32 accumulation only);
 *      plain and window caches, head sizes 32-192; 1, 2 and 3 threads bit-identical.
 *   3. Every read value within TOL_Q8_ELEM of the original; against the float64 attention over
 *      the ORIGINAL keys and values: the bound from TOL_Q8_ELEM (tests/common/tolerance.h),
 *      computed from the data. 2 and 3: tests/common/kv_quant.c, shared with test_kv_fp8.
 *   4. Hostile: head_dim / v_head_dim not a multiple of 32, Q8_0 in non-cache dtype fields.
 */
#include "harness.h"
#include "kv_quant.h"
#include "tolerance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- scalar reference quantizer ---- */
static float g_f16[0x7C00]; /* every non-negative finite float16, increasing */

static void init_f16(void) {
    mha_error err;
    static uint16_t h[0x7C00];
    for (int i = 0; i < 0x7C00; i++)
        h[i] = (uint16_t)i;
    CHECK_OK(mha_half_to_f32(MHA_DTYPE_F16, h, g_f16, 0x7C00, &err), &err);
}

/* float16 nearest to x >= 0 (ties to the even code), clamped to 65504 (the quantizer's rule). */
static float ref_f16(double x) {
    int lo = 0, hi = 0x7C00 - 1;
    if (x >= (double)g_f16[hi])
        return g_f16[hi];
    while (hi - lo > 1) { /* g_f16[lo] <= x < g_f16[hi] */
        const int mid = (lo + hi) / 2;
        if ((double)g_f16[mid] <= x)
            lo = mid;
        else
            hi = mid;
    }
    const double dl = x - (double)g_f16[lo], dh = (double)g_f16[hi] - x;
    if (dl < dh)
        return g_f16[lo];
    if (dh < dl)
        return g_f16[hi];
    return (lo % 2 == 0) ? g_f16[lo] : g_f16[hi];
}

/* Round to nearest, ties to even, without rintf. */
static float ref_rne(float y) {
    const float f = floorf(y), r = y - f;
    if (r > 0.5f)
        return f + 1.0f;
    if (r < 0.5f)
        return f;
    return fmodf(f, 2.0f) == 0.0f ? f : f + 1.0f;
}

static void ref_block(const float *x, float *out) {
    float a = 0.0f;
    int finite = 1;
    for (int i = 0; i < 32; i++) {
        if (!isfinite(x[i]))
            finite = 0;
        else if (fabsf(x[i]) > a)
            a = fabsf(x[i]);
    }
    if (!finite) {
        for (int i = 0; i < 32; i++)
            out[i] = NAN;
        return;
    }
    const float d = ref_f16((double)(a / 127.0f));
    for (int i = 0; i < 32; i++) {
        float q = d > 0.0f ? ref_rne(x[i] / d) : 0.0f;
        q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
        out[i] = q * d;
    }
}

/* kinds of block: 0 random N(0, s), 1 ties, 2 saturation, 3 zeros, 4 subnormal/tiny, 5 NaN,
 * 6 inf, 7 random with huge range */
static void fill_block(test_rng *r, int kind, float *x) {
    const double s = pow(10.0, 6.0 * test_rng_uniform(r) - 3.0);
    for (int i = 0; i < 32; i++)
        x[i] = (float)(s * test_rng_normal(r));
    if (kind == 1) { /* amax = 127 d with d = 2^-6 exact: x = (k + 1/2) d are exact ties */
        const float d = 0.015625f;
        for (int i = 0; i < 32; i++)
            x[i] = ((float)(i % 9) - 4.0f + 0.5f) * d * (i % 2 ? -1.0f : 1.0f);
        x[0] = 127.0f * d;
    } else if (kind == 2) {
        x[3] = 1.0e7f, x[7] = -3.0e9f, x[8] = 8.3e6f;
    } else if (kind == 3) {
        memset(x, 0, 32 * sizeof *x);
        x[5] = -0.0f;
    } else if (kind == 4) {
        for (int i = 0; i < 32; i++)
            x[i] = (float)(test_rng_normal(r) * (i % 2 ? 1e-40 : 2e-6));
    } else if (kind == 5) {
        x[11] = NAN;
    } else if (kind == 6) {
        x[30] = -INFINITY;
    }
}

static void test_quantizer(void) {
    enum { D = 64, N = 64 };
    mha_kv_cache_config cc = {0};
    cc.num_kv_heads = 1, cc.head_dim = D, cc.max_seq = N, cc.batch = 1;
    cc.dtype = MHA_DTYPE_Q8_0;
    mha_kv_cache *c = NULL;
    mha_error err;
    CHECK_OK(mha_kv_cache_create(&cc, NULL, NULL, &c, &err), &err);
    static float k[N * D], v[N * D];
    test_rng r;
    test_rng_seed(&r, 7);
    for (int b = 0; b < N * D / 32; b++) {
        fill_block(&r, b % 8, k + b * 32);
        fill_block(&r, (b + 3) % 8, v + b * 32);
    }
    CHECK_OK(mha_kv_cache_append(c, 1, NULL, N, k, v, &err), &err);
    int64_t bad = 0;
    for (int p = 0; p < N; p++) {
        float kr[D], vr[D], ke[D], ve[D];
        CHECK_OK(mha_kv_cache_read(c, 0, p, kr, vr, &err), &err);
        for (int b = 0; b < D / 32; b++) {
            ref_block(k + p * D + b * 32, ke + b * 32);
            ref_block(v + p * D + b * 32, ve + b * 32);
        }
        for (int i = 0; i < D; i++)
            bad += !kvq_same_bits(kr[i], ke[i]) + !kvq_same_bits(vr[i], ve[i]);
    }
    CHECK(bad == 0, "quantizer: %lld values differ from the scalar reference", (long long)bad);
    /* the specific cases, spelled out */
    float kr[D], vr[D];
    CHECK_OK(mha_kv_cache_read(c, 0, 0, kr, vr, &err), &err);
    /* block 1 of row 0 is kind 1: x[1] = -(-3 + 0.5) d = 2.5 d -> 2 d (ties to even, ggml 3 d) */
    CHECK(kr[32 + 1] == 2.0f * 0.015625f, "tie 2.5 d -> 2 d: %g", (double)kr[32 + 1]);
    CHECK(kr[32 + 2] == -2.0f * 0.015625f, "tie -1.5 d -> -2 d: %g", (double)kr[32 + 2]);
    CHECK_OK(mha_kv_cache_read(c, 0, 1, kr, vr, &err), &err); /* blocks 2, 3: kinds 2, 3 */
    CHECK(kr[7] == -127.0f * 65504.0f && kr[3] == 127.0f * 65504.0f, "saturation: %g %g",
          (double)kr[7], (double)kr[3]);
    CHECK(kr[32 + 5] == 0.0f && kr[32] == 0.0f, "zero block");
    mha_kv_cache_destroy(c);
}

/* ---- attention against the float64 oracle (tests/common/kv_quant.c) ---- */
/* TOL_Q8_ELEM of the amax of each value's block of 32 */
static void
q8_bound(const float *row, int64_t d, int64_t g, int is_v, const void *ctx, double *bd) {
    (void)g, (void)is_v, (void)ctx;
    for (int64_t b = 0; b < d / 32; b++) {
        const double a = kvq_max_abs(row + b * 32, 32);
        for (int i = 0; i < 32; i++)
            bd[b * 32 + i] = TOL_Q8_ELEM(a);
    }
}

static void test_attention(const kvq_case *ac) {
    const int64_t H = ac->H, G = ac->G, d = ac->d, L = ac->L;
    mha_kv_cache_config cc = {0};
    cc.num_kv_heads = G, cc.head_dim = d, cc.max_seq = L, cc.batch = 1, cc.window = ac->window;
    cc.dtype = MHA_DTYPE_Q8_0;
    mha_kv_cache *c = NULL;
    mha_error err;
    CHECK_OK(mha_kv_cache_create(&cc, NULL, NULL, &c, &err), &err);
    float *k = malloc(sizeof(float) * (size_t)(L * G * d)),
          *v = malloc(sizeof(float) * (size_t)(L * G * d));
    float *q = malloc(sizeof(float) * (size_t)(H * d));
    test_rng r;
    test_rng_seed(&r, (uint64_t)(L + ac->window));
    test_fill_normal(&r, k, L * G * d, 1.0f);
    test_fill_normal(&r, v, L * G * d, 1.0f);
    test_fill_normal(&r, q, H * d, 1.0f);
    kvq_check_attention(c, ac, k, v, q, q8_bound, NULL, "q8_0");
    free(k), free(v), free(q);
    mha_kv_cache_destroy(c);
}

/* copy / truncate / re-append move whole rows (row bytes, not elements): a copied sequence reads
 * the source's values, a truncated one re-appended reads the new ones. */
static void test_copy_truncate(void) {
    enum { D = 96, G = 2, N = 40 };
    mha_kv_cache_config cc = {0};
    cc.num_kv_heads = G, cc.head_dim = D, cc.v_head_dim = 32, cc.max_seq = N, cc.batch = 2;
    cc.dtype = MHA_DTYPE_Q8_0;
    mha_kv_cache *c = NULL;
    mha_error err;
    CHECK_OK(mha_kv_cache_create(&cc, NULL, NULL, &c, &err), &err);
    static float k[N * G * D], v[N * G * 32], k2[N * G * D], v2[N * G * 32];
    test_rng r;
    test_rng_seed(&r, 11);
    test_fill_normal(&r, k, N * G * D, 1.0f), test_fill_normal(&r, v, N * G * 32, 1.0f);
    test_fill_normal(&r, k2, N * G * D, 2.0f), test_fill_normal(&r, v2, N * G * 32, 2.0f);
    CHECK_OK(mha_kv_cache_append(c, 1, NULL, N, k, v, &err), &err);
    CHECK_OK(mha_kv_cache_copy(c, 0, 1, &err), &err);
    CHECK_OK(mha_kv_cache_truncate(c, 1, 10, &err), &err);
    const int64_t one = 1;
    CHECK_OK(mha_kv_cache_append(c, 1, &one, N - 10, k2 + 10 * G * D, v2 + 10 * G * 32, &err),
             &err);
    int bad = 0;
    for (int p = 0; p < N; p++) {
        float a[G * D], b[G * 32], e[G * D], f[G * 32];
        CHECK_OK(mha_kv_cache_read(c, 1, p, a, b, &err), &err);
        const float *ks = p < 10 ? k : k2, *vs = p < 10 ? v : v2;
        for (int g = 0; g < G * D / 32; g++)
            ref_block(ks + p * G * D + g * 32, e + g * 32);
        for (int g = 0; g < G; g++)
            ref_block(vs + p * G * 32 + g * 32, f + g * 32);
        bad += memcmp(a, e, sizeof a) != 0 || memcmp(b, f, sizeof b) != 0;
    }
    CHECK(bad == 0, "copy + truncate + append: %d rows differ", bad);
    mha_kv_cache_destroy(c);
}

/* ---- hostile ---- */
static void test_hostile(void) {
    mha_kv_cache_config cc = {0};
    cc.num_kv_heads = 1, cc.head_dim = 48, cc.v_head_dim = 64, cc.max_seq = 8, cc.batch = 1;
    cc.dtype = MHA_DTYPE_Q8_0;
    mha_kv_cache *c = NULL;
    mha_error err;
    kvq_expect_refused(mha_kv_cache_create(&cc, NULL, NULL, &c, &err), &err, "config.head_dim=48",
                       "d=48");
    CHECK(c == NULL, "no cache on error");
    cc.head_dim = 64, cc.v_head_dim = 16;
    kvq_expect_refused(mha_kv_cache_create(&cc, NULL, NULL, &c, &err), &err, "v_head_dim=16",
                       "dv=16");
    cc.v_head_dim = 0, cc.dtype = (mha_dtype)10;
    kvq_expect_refused(mha_kv_cache_create(&cc, NULL, NULL, &c, &err), &err, "config.dtype",
                       "dtype 10");
    /* Q8_0 in a non-cache role: the core's q dtype, the layer's weight dtype, mha_half_to_f32 */
    float x[64] = {0}, o[64];
    mha_attention_args a;
    kvq_core_args_1x1(&a, x, o);
    a.q_dtype = MHA_DTYPE_Q8_0;
    kvq_expect_refused(mha_attention(&a, NULL, &err), &err, "q_dtype", "core q_dtype=Q8_0");
    a.q_dtype = MHA_DTYPE_F32, a.out_dtype = MHA_DTYPE_Q8_0;
    kvq_expect_refused(mha_attention(&a, NULL, &err), &err, "out_dtype", "core out_dtype=Q8_0");
    a.out_dtype = MHA_DTYPE_F32;
    const uint8_t kp[1] = {1};
    a.mask.key_padding.data = kp, a.mask.key_padding.dtype = MHA_DTYPE_Q8_0;
    a.mask.key_padding.ndim = 1, a.mask.key_padding.shape[0] = 1;
    kvq_expect_refused(mha_attention(&a, NULL, &err), &err, "key_padding",
                       "key_padding dtype=Q8_0");
    uint16_t h[2] = {0, 0};
    kvq_expect_refused(mha_half_to_f32(MHA_DTYPE_Q8_0, h, o, 2, &err), &err, "", "mha_half_to_f32");
}

int main(void) {
    init_f16();
    test_quantizer();
    /* d 192 (6 blocks of 32; R 4 and 3): the AVX-512 contiguous path's q8_0 scales in groups of
     * 4 blocks with a partial second group, and 3 column groups of 64 in its pass 3 */
    const kvq_case cases[] = {{8, 2, 64, 700, 0},
                              {4, 4, 32, 300, 0},
                              {8, 1, 128, 600, 257},
                              {4, 1, 192, 333, 0},
                              {3, 1, 192, 290, 70}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        test_attention(&cases[i]);
    test_copy_truncate();
    test_hostile();
    return test_finish();
}
