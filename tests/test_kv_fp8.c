/* SPDX-License-Identifier: MIT */
/* test_kv_fp8.c: the fp8 e4m3 KV cache (docs/SEMANTICS.md "fp8 KV cache").
 *   1. The quantiser, bit for bit, against a reference written here from the format's definition
 *      (the 254 finite e4m3 values computed in double, nearest with ties to the even code):
 *      random values over the whole range with per-kv-head scales, exact ties, subnormals,
 *      saturation (+-448, infinities), NaN. Read back through mha_kv_cache_read (e4m3 * scale).
 *   2. mha_kv_cache_attention (AUTO, the tier MHA_MAX_ISA allows; REFERENCE) against the float64
 *      attention over the DEQUANTISED keys and values: TOL_OUT_REL; plain and window caches,
 *      scales != 1 per kv head, 1, 2 and 3 threads bit-identical.
 *   3. Against the float64 attention over the ORIGINAL keys and values: the bound from
 *      TOL_FP8_ELEM (tests/common/tolerance.h), computed from the data, which also bounds every
 *      read value. 2 and 3: tests/common/kv_quant.c, shared with test_kv_q8.
 *   4. NaN: a NaN key or value stored reads NaN and makes the rows that see it NaN (every tier).
 *   5. mha_kv_cache_set_fp8_scales: refused after an append, for another dtype, for scales <= 0,
 *      NaN or infinite; accepted again after every sequence was reset. Hostile dtype fields.
 */
#include "harness.h"
#include "kv_quant.h"
#include "tolerance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- reference e4m3, from the definition ---- */
static double g_val[128]; /* value of code c (sign clear), c < 127; c = 127 is NaN */

static void init_e4m3(void) {
    for (int c = 0; c < 127; c++) {
        const int E = c >> 3, M = c & 7;
        g_val[c] = E == 0 ? ldexp(M, -9) : ldexp(8 + M, E - 10);
    }
}

/* e4m3 code of y: nearest, ties to the even code, saturating at 448 (code 126), NaN 127. */
static unsigned ref_code(float y) {
    const unsigned sign = signbit(y) ? 0x80u : 0u;
    if (isnan(y))
        return sign | 0x7Fu;
    const double a = fabs((double)y);
    if (a >= 448.0)
        return sign | 126u;
    int best = 0;
    for (int c = 1; c < 127; c++) {
        const double dc = fabs(g_val[c] - a), db = fabs(g_val[best] - a);
        if (dc < db || (dc == db && c % 2 == 0))
            best = c;
    }
    return sign | (unsigned)best;
}

static float ref_read(unsigned code, float scale) {
    if ((code & 0x7Fu) == 0x7Fu)
        return NAN;
    const float v = (float)g_val[code & 0x7Fu];
    return (code & 0x80u ? -v : v) * scale;
}

static unsigned u32(test_rng *r) {
    return (unsigned)(test_rng_u64(r) >> 32);
}

static mha_kv_cache *make_cache(int64_t G, int64_t d, int64_t L, int64_t window) {
    mha_kv_cache_config cc = {0};
    cc.num_kv_heads = G, cc.head_dim = d, cc.max_seq = L, cc.batch = 1, cc.window = window;
    cc.dtype = MHA_DTYPE_FP8_E4M3;
    mha_kv_cache *c = NULL;
    mha_error err;
    CHECK_OK(mha_kv_cache_create(&cc, NULL, NULL, &c, &err), &err);
    return c;
}

static void test_quantizer(void) {
    enum { G = 2, D = 64, N = 64 };
    mha_kv_cache *c = make_cache(G, D, N, 0);
    mha_error err;
    const float ks[G] = {1.0f, 0.0371f}, vs[G] = {3.5f, 1.0f};
    CHECK_OK(mha_kv_cache_set_fp8_scales(c, ks, vs, &err), &err);
    static float k[N * G * D], v[N * G * D];
    test_rng r;
    test_rng_seed(&r, 8);
    for (int i = 0; i < N * G * D; i++) {
        const int kind = (int)(u32(&r) % 8);
        const float u = (float)(test_rng_uniform(&r) * 2.0 - 1.0);
        float x = u * ldexpf(1.0f, (int)(u32(&r) % 24) - 14); /* 2^-14 .. 2^9 */
        if (kind == 0) /* exact ties between neighbours, and the values themselves */
            x = (float)(g_val[u32(&r) % 126] + (u32(&r) % 2 ? g_val[u32(&r) % 126] : 0.0)) /
                (u32(&r) % 2 ? 2.0f : 1.0f);
        if (kind == 1) /* saturation */
            x = (u32(&r) % 2 ? 1.0f : -1.0f) * (float)(448.0 + 100.0 * test_rng_uniform(&r));
        if (kind == 2) /* subnormals and below */
            x = u * ldexpf(1.0f, -7 - (int)(u32(&r) % 6));
        k[i] = x;
        v[i] = -x * 1.7f;
    }
    k[5] = INFINITY, k[6] = -INFINITY, k[7] = NAN, k[8] = -0.0f, k[9] = 464.0f, k[10] = 447.99f;
    CHECK_OK(mha_kv_cache_append(c, 1, NULL, N, k, v, &err), &err);
    int bad = 0;
    for (int p = 0; p < N; p++) {
        float a[G * D], b[G * D];
        CHECK_OK(mha_kv_cache_read(c, 0, p, a, b, &err), &err);
        for (int g = 0; g < G; g++)
            for (int i = 0; i < D; i++) {
                const int at = (p * G + g) * D + i;
                const float ek = ref_read(ref_code(k[at] / ks[g]), ks[g]);
                const float ev = ref_read(ref_code(v[at] / vs[g]), vs[g]);
                if (!kvq_same_bits(a[g * D + i], ek) || !kvq_same_bits(b[g * D + i], ev)) {
                    if (bad++ < 5)
                        printf("  p=%d g=%d i=%d: k %a -> %a (ref %a), v %a -> %a (ref %a)\n", p, g,
                               i, (double)k[at], (double)a[g * D + i], (double)ek, (double)v[at],
                               (double)b[g * D + i], (double)ev);
                }
            }
    }
    CHECK(bad == 0, "quantiser: %d values differ from the reference", bad);
    mha_kv_cache_destroy(c);
}

/* TOL_FP8_ELEM of each value with its kv head's scale; ctx: the scales, k [8] then v [8]. */
static void
fp8_bound(const float *row, int64_t d, int64_t g, int is_v, const void *ctx, double *bd) {
    const double s = (double)((const float *)ctx)[8 * is_v + g];
    for (int64_t i = 0; i < d; i++)
        bd[i] = TOL_FP8_ELEM(fabs((double)row[i]), s);
}

/* 2, 3: tests/common/kv_quant.c, with scales != 1 per kv head and some subnormal e4m3 values */
static void test_attention(const kvq_case *ac) {
    const int64_t H = ac->H, G = ac->G, d = ac->d, L = ac->L;
    mha_kv_cache *c = make_cache(G, d, L, ac->window);
    mha_error err;
    float sc[16];                   /* k scales [8], v scales [8] */
    for (int64_t g = 0; g < G; g++) /* data ~N(0, 1), |x| < 5.5: no saturation; the scales put
                                       |x / s| over the e4m3 range (1.0: many subnormals) */
        sc[g] = 0.0125f * (float)(g + 1), sc[8 + g] = g % 2 ? 1.0f : 0.0125f;
    CHECK_OK(mha_kv_cache_set_fp8_scales(c, sc, sc + 8, &err), &err);
    const size_t nkv = (size_t)(L * G * d);
    float *k = malloc(sizeof(float) * nkv), *v = malloc(sizeof(float) * nkv);
    float *q = malloc(sizeof(float) * (size_t)(H * d));
    test_rng r;
    test_rng_seed(&r, (uint64_t)(L + ac->window + 3));
    test_fill_normal(&r, k, L * G * d, 1.0f);
    test_fill_normal(&r, v, L * G * d, 1.0f);
    test_fill_normal(&r, q, H * d, 1.0f);
    for (size_t i = 0; i < nkv; i += 7) /* some small values: subnormal e4m3 */
        k[i] *= 1e-3f, v[i] *= 1e-4f;
    kvq_check_attention(c, ac, k, v, q, fp8_bound, sc, "fp8");
    free(k), free(v), free(q);
    mha_kv_cache_destroy(c);
}

/* 4: a NaN key of kv head 0 at position 3 and a NaN value of kv head 1 at position 5: the
 * heads of those kv heads read NaN (every element for the key: the score is NaN; the value's
 * column for the value), the others stay finite. */
static void test_nan(void) {
    enum { H = 4, G = 2, D = 64, L = 40 };
    mha_kv_cache *c = make_cache(G, D, L, 0);
    mha_error err;
    static float k[L * G * D], v[L * G * D], q[H * D], o[H * D];
    test_rng r;
    test_rng_seed(&r, 4);
    test_fill_normal(&r, k, L * G * D, 1.0f);
    test_fill_normal(&r, v, L * G * D, 1.0f);
    test_fill_normal(&r, q, H * D, 1.0f);
    k[(3 * G + 0) * D + 7] = NAN;
    v[(5 * G + 1) * D + 9] = NAN;
    CHECK_OK(mha_kv_cache_append(c, 1, NULL, L, k, v, &err), &err);
    mha_kv_attention_args ka = {0};
    ka.num_seqs = 1, ka.num_tokens = 1, ka.num_heads = H, ka.q = q, ka.out = o;
    CHECK_OK(mha_kv_cache_attention(c, &ka, NULL, &err), &err);
    for (int h = 0; h < H; h++)
        for (int i = 0; i < D; i++) {
            const int want_nan = h < 2 || i == 9;
            CHECK((isnan(o[h * D + i]) != 0) == want_nan, "NaN: head %d column %d reads %g", h, i,
                  (double)o[h * D + i]);
        }
    mha_kv_cache_destroy(c);
}

static void test_scales_api(void) {
    enum { G = 2, D = 32 };
    mha_kv_cache *c = make_cache(G, D, 8, 0);
    mha_error err;
    float bad[G] = {1.0f, 0.0f}, ok[G] = {2.0f, 0.5f}, x[G * D] = {0};
    kvq_expect_refused(mha_kv_cache_set_fp8_scales(c, bad, NULL, &err), &err, "k_scales[1]", "0");
    bad[1] = -1.0f;
    kvq_expect_refused(mha_kv_cache_set_fp8_scales(c, NULL, bad, &err), &err, "v_scales[1]", "-1");
    bad[1] = NAN;
    kvq_expect_refused(mha_kv_cache_set_fp8_scales(c, bad, ok, &err), &err, "k_scales[1]", "NaN");
    bad[1] = INFINITY;
    kvq_expect_refused(mha_kv_cache_set_fp8_scales(c, ok, bad, &err), &err, "v_scales[1]", "inf");
    kvq_expect_refused(mha_kv_cache_set_fp8_scales(NULL, ok, ok, &err), &err, "NULL", "NULL cache");
    CHECK_OK(mha_kv_cache_set_fp8_scales(c, ok, NULL, &err), &err);
    x[0] = 3.0f;
    CHECK_OK(mha_kv_cache_append(c, 1, NULL, 1, x, x, &err), &err);
    kvq_expect_refused(mha_kv_cache_set_fp8_scales(c, ok, ok, &err), &err, "holds 1",
                       "after append");
    float a[G * D], b[G * D];
    CHECK_OK(mha_kv_cache_read(c, 0, 0, a, b, &err), &err);
    CHECK(a[0] == 3.0f && b[0] == 3.0f, "read back %g %g", (double)a[0], (double)b[0]);
    CHECK_OK(mha_kv_cache_reset(c, 0, &err), &err);
    CHECK_OK(mha_kv_cache_set_fp8_scales(c, ok, ok, &err), &err);
    mha_kv_cache_destroy(c);

    /* another dtype's cache */
    mha_kv_cache_config cc = {0};
    cc.num_kv_heads = G, cc.head_dim = D, cc.max_seq = 8, cc.batch = 1, cc.dtype = MHA_DTYPE_F16;
    CHECK_OK(mha_kv_cache_create(&cc, NULL, NULL, &c, &err), &err);
    kvq_expect_refused(mha_kv_cache_set_fp8_scales(c, ok, ok, &err), &err, "FP8_E4M3", "f16 cache");
    mha_kv_cache_destroy(c);

    /* FP8 in a non-cache role */
    float xx[64] = {0}, o[64];
    mha_attention_args at;
    kvq_core_args_1x1(&at, xx, o);
    at.k_dtype = MHA_DTYPE_FP8_E4M3;
    kvq_expect_refused(mha_attention(&at, NULL, &err), &err, "k_dtype", "core k_dtype=FP8");
    uint16_t h[2] = {0, 0};
    kvq_expect_refused(mha_half_to_f32(MHA_DTYPE_FP8_E4M3, h, o, 2, &err), &err, "", "half_to_f32");
    CHECK(mha_dtype_size(MHA_DTYPE_FP8_E4M3) == 1, "mha_dtype_size(FP8_E4M3)");
}

int main(void) {
    init_e4m3();
    test_quantizer();
    const kvq_case cases[] = {
        {8, 2, 64, 700, 0}, {4, 4, 32, 300, 0}, {8, 1, 128, 600, 257}, {4, 4, 48, 130, 0}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        test_attention(&cases[i]);
    test_nan();
    test_scales_api();
    return test_finish();
}
