/* SPDX-License-Identifier: MIT */
/* test_half.c: half-precision storage of the attention core (issue 30; docs/SEMANTICS.md "Half
 * precision"): q, k, v, out, dout, dq, dk, dv in bfloat16 or float16, any mix with float32, and
 * float32 arithmetic.
 *   1. The contract, bit for bit: a call with half tensors equals the float32 call on the same
 *      (exactly widened) values with each output rounded once to its dtype, forward (out; lse
 *      unchanged) and backward (dq, dk, dv; with accumulate the float32 sum old + new rounded
 *      once), for the reference and the fast kernel of the tier MHA_MAX_ISA allows (tools/test.sh
 *      runs this under every tier), over the feature matrix of CORE_SPECS and multi-tile sizes.
 *   2. Against the float64 oracle on the same rounded inputs: max|y - ref| <= (TOL_HALF_C u_s +
 *      TOL_OUT_REL) max|ref| for out; the gradients with the backward's float32 backstop.
 *   3. 1 and 2 threads bit-identical.
 *   4. A dtype that is not a storage of activations is refused naming its field; the statistics
 *      refuse half q and k.
 *   5. The kernels' vector conversions (mha__widen_rows, mha__narrow_rows of the tier allowed)
 *      give the portable conversions' bits on every float32 class: random bit patterns (NaNs
 *      with any payload, infinities, subnormals) and rounding ties.
 * A kernel that computes in bf16 tiles (rounding P: the AVX512-BF16 tier) is exempt from 1 and
 * has its own test (test_half_kernel.c); where AUTO picks one, 1 runs for the reference and the
 * count of exempt cases is printed (tools/test.sh also runs this file with MHA_MAX_ISA=avx512,
 * where every tier's widening kernel is checked).
 */
#include "base/internal.h"
#include "core/core.h"
#include "core_cases.h"
#include "harness.h"
#include "kernels/registry.h"
#include "mha_experimental.h"
#include "oracle_f64.h"
#include "tolerance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The storage of each role of one call. */
typedef struct roles {
    const char *name;
    mha_dtype q, k, v, out, dout, dq, dk, dv;
} roles;

#define F32  MHA_DTYPE_F32
#define BF16 MHA_DTYPE_BF16
#define F16  MHA_DTYPE_F16
static const roles ROLES[] = {
    {"bf16", BF16, BF16, BF16, BF16, BF16, BF16, BF16, BF16},
    {"f16", F16, F16, F16, F16, F16, F16, F16, F16},
    {"mixed", BF16, F16, F32, BF16, F16, F32, BF16, F16},
    {"f32_in_bf16_out", F32, F32, F32, BF16, F32, BF16, F16, F32},
};
#define N_ROLES ((int)(sizeof ROLES / sizeof ROLES[0]))

/* Multi-tile sizes (the CORE_SPECS cases fit in one tile). */
// clang-format off
static const spec TILE_SPECS[] = {
    {"tiles_causal_gqa", 1, 4, 2, 130, 200, 64, 48, 1, BR, 0, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},
    {"tiles_masks", 2, 2, 1, 70, 150, 40, 32, 0, BR, 0, -1, -1, 1, 1, 1, 0, 1, 1, 0, 3.0, 1, 0.2f},
    {"tiles_window_d128", 1, 2, 2, 160, 160, 128, 128, 1, BR, 1, 50, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},
};
// clang-format on
#define N_TILE_SPECS ((int)(sizeof TILE_SPECS / sizeof TILE_SPECS[0]))

static double unit_roundoff(mha_dtype dt) {
    return dt == BF16 ? TOL_HALF_U_BF16 : dt == F16 ? TOL_HALF_U_F16 : 0.0;
}

/* x rounded to dt and back (exact for F32): the values both calls see. */
static void round_through(mha_dtype dt, float *x, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        float y = 0.0f;
        mha__narrow(dt, x + i, &y, 1);
        mha__widen(dt, &y, x + i, 1);
    }
}

/* A copy of x in storage dt (x already representable). */
static void *stored(mha_dtype dt, const float *x, int64_t count) {
    void *s = malloc(mha__storage_size(dt) * (size_t)(count > 0 ? count : 1));
    mha__narrow(dt, x, s, count);
    return s;
}

static float *widened(mha_dtype dt, const void *x, int64_t count) {
    float *w = malloc(sizeof(float) * (size_t)(count > 0 ? count : 1));
    mha__widen(dt, x, w, count);
    return w;
}

/* 1 when the half tensor h equals x rounded to dt, bit for bit. */
static int equals_rounded(mha_dtype dt, const void *h, const float *x, int64_t count) {
    void *r = stored(dt, x, count);
    const int same = memcmp(r, h, mha__storage_size(dt) * (size_t)count) == 0;
    free(r);
    return same;
}

typedef struct sizes {
    int64_t nq, nk, nv, no, nl;
} sizes;

static sizes sizes_of(const spec *s) {
    const sizes z = {s->B * s->H * s->n * s->dk, s->B * s->G * s->m * s->dk,
                     s->B * s->G * s->m * s->dv, s->B * s->H * s->n * s->dv, s->B * s->H * s->n};
    return z;
}

/* One case in one storage mix: the inputs rounded (c's float tensors now hold the values both
 * calls see) and their half copies. */
typedef struct half_case {
    built c;
    roles r;
    sizes z;
    void *q, *k, *v, *dout;
} half_case;

static void half_case_make(const spec *s, const roles *r, uint64_t seed, half_case *hc) {
    build(s, seed, &hc->c);
    hc->r = *r;
    hc->z = sizes_of(s);
    round_through(r->q, hc->c.q, hc->z.nq);
    round_through(r->k, hc->c.k, hc->z.nk);
    round_through(r->v, hc->c.v, hc->z.nv);
    round_through(r->dout, hc->c.dout, hc->z.no);
    hc->q = stored(r->q, hc->c.q, hc->z.nq);
    hc->k = stored(r->k, hc->c.k, hc->z.nk);
    hc->v = stored(r->v, hc->c.v, hc->z.nv);
    hc->dout = stored(r->dout, hc->c.dout, hc->z.no);
}

static void half_case_free(half_case *hc) {
    free(hc->q), free(hc->k), free(hc->v), free(hc->dout);
    built_free(&hc->c);
}

/* The half call's args: c's shapes and masks over the half tensors. */
static void half_args(const half_case *hc, void *out, float *lse, mha_attention_args *a) {
    core_args(&hc->c, NULL, lse, a);
    a->q = hc->q, a->k = hc->k, a->v = hc->v, a->out = out;
    a->q_dtype = hc->r.q, a->k_dtype = hc->r.k, a->v_dtype = hc->r.v;
    a->out_dtype = hc->r.out;
}

static mha_status forward(const mha_attention_args *a, mha_impl impl, int threads, mha_error *e) {
    const mha_exec ex = {impl, threads, NULL, 0, NULL, NULL};
    return mha_attention(a, &ex, e);
}

/* Gradient buffers of one call (float32 or the roles' storage), preset to `init` widened. */
typedef struct grads_buf {
    void *dq, *dk, *dv;
    float ds[8];
} grads_buf;

static void grads_make(const half_case *hc, int half, const float *init[3], grads_buf *g) {
    const mha_dtype dt[3] = {half ? hc->r.dq : F32, half ? hc->r.dk : F32, half ? hc->r.dv : F32};
    const int64_t n[3] = {hc->z.nq, hc->z.nk, hc->z.nv};
    void **dst[3] = {&g->dq, &g->dk, &g->dv};
    for (int t = 0; t < 3; t++)
        *dst[t] = stored(dt[t], init[t], n[t]);
}

static void grads_free(grads_buf *g) {
    free(g->dq), free(g->dk), free(g->dv);
}

static mha_status backward(const half_case *hc,
                           const mha_attention_args *fwd,
                           int half,
                           grads_buf *g,
                           int accumulate,
                           mha_impl impl,
                           int threads,
                           mha_error *e) {
    mha_attention_grads gr;
    memset(&gr, 0, sizeof gr);
    gr.dout = half ? hc->dout : hc->c.dout;
    gr.dout_dtype = half ? hc->r.dout : F32;
    memcpy(gr.dout_strides, fwd->out_strides, sizeof gr.dout_strides);
    gr.dq = g->dq, gr.dk = g->dk, gr.dv = g->dv;
    gr.dq_dtype = half ? hc->r.dq : F32;
    gr.dk_dtype = half ? hc->r.dk : F32;
    gr.dv_dtype = half ? hc->r.dv : F32;
    memcpy(gr.dq_strides, fwd->q_strides, sizeof gr.dq_strides);
    memcpy(gr.dk_strides, fwd->k_strides, sizeof gr.dk_strides);
    memcpy(gr.dv_strides, fwd->v_strides, sizeof gr.dv_strides);
    gr.dsinks = hc->c.sinks ? g->ds : NULL;
    gr.accumulate = accumulate;
    const mha_exec ex = {impl, threads, NULL, 0, NULL, NULL};
    return mha_attention_backward(fwd, &gr, &ex, e);
}

/* ---------------------------------------------------------------------------------------------- */
/* 1 + 3: the contract, bit for bit, and threads.                                                 */
/* ---------------------------------------------------------------------------------------------- */

static int g_tile_exempt;

/* 1 when impl runs a kernel that computes in half-precision tiles for a's dtypes (the registry
 * line takes no float32: it does not widen). */
static int tile_kernel(const mha_attention_args *a, mha_impl impl) {
    if (impl == MHA_IMPL_REFERENCE)
        return 0;
    mha__fwd_shape shape;
    mha__fwd_shape_from_args(a, &shape);
    const mha__kernel_info *k = NULL;
    mha_error e = {0};
    return mha__kernel_select(&shape, impl, &k, &e) == MHA_STATUS_OK && !(k->dtypes & MHA_DTS_F32);
}

static void contract(const spec *s, const roles *r, uint64_t seed, mha_impl impl) {
    half_case hc;
    half_case_make(s, r, seed, &hc);
    const sizes z = hc.z;
    const char *iname = impl == MHA_IMPL_REFERENCE ? "reference" : "auto";
    mha_error e = {0};
    /* Forward: half call (1 and 2 threads), then the float32 call on the same values. */
    void *out_h = malloc(mha__storage_size(r->out) * (size_t)z.no);
    void *out_h2 = malloc(mha__storage_size(r->out) * (size_t)z.no);
    float *lse_h = malloc(sizeof(float) * (size_t)z.nl),
          *lse_h2 = malloc(sizeof(float) * (size_t)z.nl);
    float *out32 = malloc(sizeof(float) * (size_t)z.no),
          *lse32 = malloc(sizeof(float) * (size_t)z.nl);
    mha_attention_args ah, ah2, a32;
    half_args(&hc, out_h, lse_h, &ah);
    half_args(&hc, out_h2, lse_h2, &ah2);
    core_args(&hc.c, out32, lse32, &a32);
    CHECK_OK(forward(&ah, impl, 1, &e), &e);
    CHECK_OK(forward(&ah2, impl, 2, &e), &e);
    CHECK_OK(forward(&a32, impl, 1, &e), &e);
    if (tile_kernel(&ah, impl)) { /* not the float32 arithmetic: test_half_kernel.c */
        g_tile_exempt++;
        free(out_h), free(out_h2), free(lse_h), free(lse_h2), free(out32), free(lse32);
        half_case_free(&hc);
        return;
    }
    const size_t ob = mha__storage_size(r->out) * (size_t)z.no;
    CHECK(equals_rounded(r->out, out_h, out32, z.no),
          "[%s %s %s] out = the float32 out rounded once to its dtype", s->name, r->name, iname);
    CHECK(memcmp(lse_h, lse32, sizeof(float) * (size_t)z.nl) == 0, "[%s %s %s] lse unchanged",
          s->name, r->name, iname);
    CHECK(memcmp(out_h, out_h2, ob) == 0 &&
              memcmp(lse_h, lse_h2, sizeof(float) * (size_t)z.nl) == 0,
          "[%s %s %s] 1 and 2 threads bit-identical", s->name, r->name, iname);

    /* Backward: it reads O as stored (the half out, widened, for the float32 call), writes or
     * adds each gradient rounded once. */
    float *o_w = widened(r->out, out_h, z.no);
    a32.out = o_w;
    test_rng rng;
    test_rng_seed(&rng, seed ^ 0xacc);
    float *init[3];
    const int64_t n[3] = {z.nq, z.nk, z.nv};
    const mha_dtype gdt[3] = {r->dq, r->dk, r->dv};
    for (int t = 0; t < 3; t++) {
        init[t] = malloc(sizeof(float) * (size_t)n[t]);
        test_fill_normal(&rng, init[t], n[t], 1.0f);
        round_through(gdt[t], init[t], n[t]);
    }
    for (int acc = 0; acc < 2; acc++) {
        grads_buf gh, gh2, g32;
        grads_make(&hc, 1, (const float **)init, &gh);
        grads_make(&hc, 1, (const float **)init, &gh2);
        grads_make(&hc, 0, (const float **)init, &g32);
        CHECK_OK(backward(&hc, &ah, 1, &gh, acc, impl, 1, &e), &e);
        CHECK_OK(backward(&hc, &ah, 1, &gh2, acc, impl, 2, &e), &e);
        CHECK_OK(backward(&hc, &a32, 0, &g32, acc, impl, 1, &e), &e);
        const void *h[3] = {gh.dq, gh.dk, gh.dv}, *h2[3] = {gh2.dq, gh2.dk, gh2.dv};
        const float *f[3] = {g32.dq, g32.dk, g32.dv};
        const char *names[3] = {"dq", "dk", "dv"};
        for (int t = 0; t < 3; t++) {
            CHECK(equals_rounded(gdt[t], h[t], f[t], n[t]),
                  "[%s %s %s] %s = the float32 gradient rounded once (accumulate %d)", s->name,
                  r->name, iname, names[t], acc);
            CHECK(memcmp(h[t], h2[t], mha__storage_size(gdt[t]) * (size_t)n[t]) == 0,
                  "[%s %s %s] %s: 1 and 2 threads bit-identical", s->name, r->name, iname,
                  names[t]);
        }
        grads_free(&gh), grads_free(&gh2), grads_free(&g32);
    }
    for (int t = 0; t < 3; t++)
        free(init[t]);
    free(out_h), free(out_h2), free(lse_h), free(lse_h2), free(out32), free(lse32), free(o_w);
    half_case_free(&hc);
}

/* ---------------------------------------------------------------------------------------------- */
/* 2: against the float64 oracle on the same rounded inputs.                                     */
/* ---------------------------------------------------------------------------------------------- */

static double g_worst_fwd, g_worst_bwd;

static double max_err(mha_dtype dt, const void *y, const double *ref, int64_t count) {
    float *w = widened(dt, y, count);
    const double err = test_max_abs_diff(w, ref, count);
    free(w);
    return err;
}

static void vs_oracle(const spec *s, const roles *r, uint64_t seed) {
    half_case hc;
    half_case_make(s, r, seed, &hc);
    const sizes z = hc.z;
    mha_error e = {0};
    /* Forward. */
    void *out = malloc(mha__storage_size(r->out) * (size_t)z.no);
    float *lse = malloc(sizeof(float) * (size_t)z.nl);
    double *ref = malloc(sizeof(double) * (size_t)z.no);
    mha_attention_args a;
    half_args(&hc, out, lse, &a);
    CHECK_OK(forward(&a, MHA_IMPL_AUTO, 2, &e), &e);
    oracle_attention(&a, ref, NULL, NULL);
    const double scale = test_max_abs(ref, z.no);
    const double err = max_err(r->out, out, ref, z.no);
    const double gate = (TOL_HALF_C * unit_roundoff(r->out) + TOL_OUT_REL) * scale;
    if (scale > 0.0 && err / scale > g_worst_fwd)
        g_worst_fwd = err / scale;
    CHECK(err <= gate, "[%s %s] out vs float64: %.3g > gate %.3g (max|ref| %.3g)", s->name, r->name,
          err, gate, scale);

    /* Backward, from a forward whose out is float32 (the oracle's D = dO . O is exact; with a half
     * out the library reads O as stored, which 1. checks bit for bit). */
    float *out32 = malloc(sizeof(float) * (size_t)z.no);
    a.out = out32, a.out_dtype = F32;
    CHECK_OK(forward(&a, MHA_IMPL_AUTO, 2, &e), &e);
    const float *zero[3];
    float *zbuf =
        calloc((size_t)(z.nq > z.nk ? (z.nq > z.nv ? z.nq : z.nv) : (z.nk > z.nv ? z.nk : z.nv)),
               sizeof(float));
    zero[0] = zero[1] = zero[2] = zbuf;
    grads_buf g;
    grads_make(&hc, 1, zero, &g);
    CHECK_OK(backward(&hc, &a, 1, &g, 0, MHA_IMPL_AUTO, 2, &e), &e);
    double *q = to_d(hc.c.q, z.nq), *k = to_d(hc.c.k, z.nk), *v = to_d(hc.c.v, z.nv);
    double *dO = to_d(hc.c.dout, z.no), *sk = hc.c.sinks ? to_d(hc.c.sinks, s->H) : NULL;
    double *gq = malloc(sizeof(double) * (size_t)z.nq), *gk = malloc(sizeof(double) * (size_t)z.nk);
    double *gv = malloc(sizeof(double) * (size_t)z.nv);
    og_core o;
    og_from(&hc.c, &o, q, k, v, sk);
    og_core_backward(&o, dO, NULL, NULL, gq, gk, gv, NULL);
    const double f32_term = TOL_BWD_C * TOL_U32 * (1.0 + max_score(&hc.c)) * sqrt((double)s->m);
    const void *gl[3] = {g.dq, g.dk, g.dv};
    const double *gr[3] = {gq, gk, gv};
    const int64_t n[3] = {z.nq, z.nk, z.nv};
    const mha_dtype gdt[3] = {r->dq, r->dk, r->dv};
    const char *names[3] = {"dq", "dk", "dv"};
    for (int t = 0; t < 3; t++) {
        const double gs = test_max_abs(gr[t], n[t]), ge = max_err(gdt[t], gl[t], gr[t], n[t]);
        const double ggate = (TOL_HALF_C * unit_roundoff(gdt[t]) + f32_term) * gs;
        if (gs > 0.0 && ge / gs > g_worst_bwd)
            g_worst_bwd = ge / gs;
        CHECK(ge <= ggate, "[%s %s] %s vs float64: %.3g > gate %.3g (max|ref| %.3g)", s->name,
              r->name, names[t], ge, ggate, gs);
    }
    free(q), free(k), free(v), free(dO), free(sk), free(gq), free(gk), free(gv), free(zbuf);
    grads_free(&g);
    free(out), free(lse), free(ref), free(out32);
    half_case_free(&hc);
}

/* ---------------------------------------------------------------------------------------------- */
/* 4: errors.                                                                                     */
/* ---------------------------------------------------------------------------------------------- */

static void errors(void) {
    half_case hc;
    half_case_make(&CORE_SPECS[0], &ROLES[0], 7, &hc);
    uint16_t out[512];
    float lse[64];
    mha_error e = {0};
    mha_attention_args a;
    half_args(&hc, out, lse, &a);
    a.k_dtype = MHA_DTYPE_BOOL;
    CHECK(forward(&a, MHA_IMPL_AUTO, 1, &e) == MHA_STATUS_INVALID_ARG &&
              strstr(e.message, "k_dtype"),
          "k_dtype BOOL refused naming it: %s", e.message);
    a.k_dtype = (mha_dtype)99;
    CHECK(mha_attention_supported(&a, NULL, &e) == MHA_STATUS_INVALID_ARG &&
              strstr(e.message, "k_dtype"),
          "k_dtype 99 refused by _supported: %s", e.message);
    a.k_dtype = BF16;
    CHECK(mha_attention_supported(&a, NULL, &e) == MHA_STATUS_OK, "bf16 supported: %s", e.message);
    CHECK_OK(forward(&a, MHA_IMPL_AUTO, 1, &e), &e);
    grads_buf g;
    const float *init[3] = {hc.c.q, hc.c.k, hc.c.v};
    grads_make(&hc, 1, init, &g);
    mha_attention_grads gr;
    memset(&gr, 0, sizeof gr);
    gr.dout = hc.dout, gr.dout_dtype = BF16;
    memcpy(gr.dout_strides, a.out_strides, sizeof gr.dout_strides);
    gr.dq = g.dq, gr.dq_dtype = MHA_DTYPE_I32;
    memcpy(gr.dq_strides, a.q_strides, sizeof gr.dq_strides);
    CHECK(mha_attention_backward(&a, &gr, NULL, &e) == MHA_STATUS_INVALID_ARG &&
              strstr(e.message, "grads.dq_dtype"),
          "grads.dq_dtype I32 refused naming it: %s", e.message);
    float received[64];
    const mha_attention_stats st = {.received = received};
    CHECK(mha_attention_statistics(&a, &st, NULL, &e) == MHA_STATUS_UNSUPPORTED &&
              strstr(e.message, "float32"),
          "statistics refuse half q/k: %s", e.message);
    grads_free(&g);
    half_case_free(&hc);
}

/* ---------------------------------------------------------------------------------------------- */
/* 5: vector conversions = portable conversions, bit for bit.                                     */
/* ---------------------------------------------------------------------------------------------- */

static void conversions(void) {
    enum { N = 1 << 16 };
    uint32_t *bits = malloc(sizeof(uint32_t) * N);
    uint16_t *a = malloc(sizeof(uint16_t) * N), *b = malloc(sizeof(uint16_t) * N);
    float *fa = malloc(sizeof(float) * N), *fb = malloc(sizeof(float) * N);
    test_rng r;
    test_rng_seed(&r, 0xc0ffee);
    for (int i = 0; i < N; i++) {
        bits[i] = (uint32_t)test_rng_u64(&r);
        if (i % 4 == 1) /* ties and near-ties of both roundings: low bits 0x8000 / 0x1000 */
            bits[i] = (bits[i] & 0xffff0000u) | 0x8000u | (uint32_t)(i & 8) << 12;
        if (i % 4 == 2) /* the f16 range, where float16 is normal, subnormal or overflows */
            bits[i] = (bits[i] & 0x8fffffffu) | 0x30000000u;
    }
    const mha_dtype dts[2] = {BF16, F16};
    for (int t = 0; t < 2; t++) {
        for (int64_t len = N; len >= N - 7; len -= 7) { /* vector bodies and every tail length */
            mha__narrow_rows(dts[t], (const float *)(const void *)bits, a, len);
            mha__narrow(dts[t], (const float *)(const void *)bits, b, len);
            CHECK(memcmp(a, b, sizeof(uint16_t) * (size_t)len) == 0,
                  "narrow_rows = narrow, %s, %lld values", dts[t] == BF16 ? "bf16" : "f16",
                  (long long)len);
        }
        const uint16_t *h = (const uint16_t *)(const void *)bits;
        mha__widen_rows(dts[t], h, fa, N - 3);
        mha__widen(dts[t], h, fb, N - 3);
        CHECK(memcmp(fa, fb, sizeof(float) * (N - 3)) == 0, "widen_rows = widen, %s",
              dts[t] == BF16 ? "bf16" : "f16");
    }
    free(bits), free(a), free(b), free(fa), free(fb);
}

int main(void) {
    const int q = test_quick();
    for (int r = 0; r < N_ROLES; r++) {
        for (int i = 0; i < N_CORE_SPECS; i++)
            for (int impl = 0; impl < 2; impl++)
                contract(&CORE_SPECS[i], &ROLES[r], 100 + (uint64_t)i,
                         impl ? MHA_IMPL_AUTO : MHA_IMPL_REFERENCE);
        for (int i = 0; i < (q ? 1 : N_TILE_SPECS); i++)
            for (int impl = 0; impl < 2; impl++)
                contract(&TILE_SPECS[i], &ROLES[r], 200 + (uint64_t)i,
                         impl ? MHA_IMPL_AUTO : MHA_IMPL_REFERENCE);
        for (int i = 0; i < N_CORE_SPECS; i++)
            vs_oracle(&CORE_SPECS[i], &ROLES[r], 300 + (uint64_t)i);
        for (int i = 0; i < (q ? 1 : N_TILE_SPECS); i++)
            vs_oracle(&TILE_SPECS[i], &ROLES[r], 400 + (uint64_t)i);
    }
    printf("half precision vs float64 (same rounded inputs): worst out err / max|ref| %.3g, "
           "worst gradient err / max|ref| %.3g (bf16 u = %.3g, f16 u = %.3g)\n",
           g_worst_fwd, g_worst_bwd, TOL_HALF_U_BF16, TOL_HALF_U_F16);
    /* No AMX kernel exists yet (docs/KERNELS.md, "Waiting for hardware"): say what this CPU has,
     * so a run on an AMX host shows that its tiles went unused. */
    printf("AMX tier: not built (no AMX kernel is registered); this CPU %s AMX-BF16\n",
           mha_experimental_cpu_amx_bf16() ? "HAS" : "has no");
    if (g_tile_exempt)
        printf("%d cases of AUTO ran a bf16-tile kernel (checked by test_half_kernel, not here)\n",
               g_tile_exempt);
    errors();
    conversions();
    return test_finish();
}
