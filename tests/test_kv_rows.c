/* SPDX-License-Identifier: MIT */
/* test_kv_rows.c: mha_kv_cache_attention with many query rows per kv head, R = group * t > 4 (the
 * AVX-512 kernel's wide path, decode_avx512.c: float32 from R = 5, the other dtypes from R = 9,
 * below that their groups of 4 rows; the AVX2 kernel's wide path, decode_avx2.c: float32 and fp8
 * from R = 13, q8_0 from 21, float16 / bfloat16 from 25; the generic kernel), against a float64
 * oracle written here from the definition over the cache's own rows (mha_kv_cache_read: the
 * dequantised values, so the tolerance is the float32 one, TOL_OUT_REL):
 *   every cache dtype (f32, f16, bf16, q8_0, fp8 e4m3 with scales), contiguous and paged (blocks
 *   of 16), window rings that wrap (inside a unit too), soft-cap, ALiBi, sinks, chunks, chains and
 *   draft trees, R = 5, 8, 12, 13, 32, 64 and 96, head sizes d_k != d_v and not multiples of 16
 *   (R = 32: nor of 8); 1 and 2 threads bit-identical; and R = 4 over caches of more than 32 MiB
 *   (the far prefetch's instances of the contiguous path on AMD Zen 5; with MHA_TEST_QUICK=1 only
 *   on a CPU that takes that prefetch). The tier is the one
 *   MHA_MAX_ISA allows (ctest runs this file under avx2 and generic too).
 */
#include "base/cpu_features.h"
#include "harness.h"
#include "oracle_f64.h"
#include "tolerance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct rcase {
    int64_t H, G, dk, dv, t;
    int tree; /* 0: a chain (tree_parents NULL); 1: the tree below */
    mha_dtype dt;
    int64_t block; /* 0: contiguous; else paged, blocks of this many slots */
    int64_t window, chunk;
    int alibi, sinks;
    double softcap;
    int64_t len[2]; /* two sequences */
} rcase;

/* a draft tree of up to 16 tokens: 2 roots, then children of earlier drafts */
static const int64_t tree16[16] = {-1, 0, 0, 1, -1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};

static int64_t depth_of(const int64_t *par, int64_t i) {
    int64_t d = 0;
    for (int64_t x = par[i]; x >= 0; x = par[x])
        d++;
    return d;
}

static int is_ancestor_or_self(const int64_t *par, int64_t a, int64_t i) {
    for (int64_t x = i; x >= 0; x = par[x])
        if (x == a)
            return 1;
    return 0;
}

static int rule(int64_t qp, int64_t kp, int64_t W, int64_t C) {
    return kp <= qp && (W == 0 || kp > qp - W) && (C == 0 || kp / C == qp / C);
}

static const char *dt_name(mha_dtype dt) {
    return dt == MHA_DTYPE_F32    ? "f32"
           : dt == MHA_DTYPE_F16  ? "f16"
           : dt == MHA_DTYPE_BF16 ? "bf16"
           : dt == MHA_DTYPE_Q8_0 ? "q8_0"
                                  : "fp8";
}

static void run_case(const rcase *tc, int id) {
    const int64_t H = tc->H, G = tc->G, dk = tc->dk, dv = tc->dv, t = tc->t, S = 2;
    const int64_t grp = H / G;
    int64_t par[16];
    for (int64_t i = 0; i < t; i++)
        par[i] = tc->tree ? tree16[i] : i - 1;
    const int64_t max_len = tc->len[0] > tc->len[1] ? tc->len[0] : tc->len[1];
    mha_kv_cache_config cc = {0};
    cc.num_kv_heads = G, cc.head_dim = dk, cc.v_head_dim = dv, cc.max_seq = max_len;
    cc.batch = S, cc.dtype = tc->dt, cc.window = tc->window, cc.chunk_size = tc->chunk;
    cc.max_step_tokens = 32, cc.block_size = tc->block;
    mha_kv_cache *c = NULL;
    mha_error err;
    CHECK_OK(mha_kv_cache_create(&cc, NULL, NULL, &c, &err), &err);
    test_rng r;
    test_rng_seed(&r, 7000 + (uint64_t)id);
    if (tc->dt == MHA_DTYPE_FP8_E4M3) {
        float ks[8], vs[8];
        for (int64_t g = 0; g < G; g++)
            ks[g] = 0.01f * (float)(g + 1), vs[g] = 0.02f * (float)(g + 2);
        CHECK_OK(mha_kv_cache_set_fp8_scales(c, ks, vs, &err), &err);
    }
    float *k = malloc(sizeof(float) * (size_t)(32 * G * dk)),
          *v = malloc(sizeof(float) * (size_t)(32 * G * dv));
    for (int64_t s = 0; s < S; s++)
        for (int64_t p0 = 0; p0 < tc->len[s]; p0 += 32) {
            const int64_t n = tc->len[s] - p0 < 32 ? tc->len[s] - p0 : 32;
            test_fill_normal(&r, k, n * G * dk, 1.0f);
            test_fill_normal(&r, v, n * G * dv, 1.0f);
            CHECK_OK(mha_kv_cache_append(c, 1, &s, n, k, v, &err), &err);
        }
    const int64_t nq = S * t * H * dk, no = S * t * H * dv;
    float *q = malloc(sizeof(float) * (size_t)nq), sinks[64];
    float *out[3], *lse[3];
    for (int x = 0; x < 3; x++) {
        out[x] = malloc(sizeof(float) * (size_t)no);
        lse[x] = malloc(sizeof(float) * (size_t)(S * H * t));
    }
    test_fill_normal(&r, q, nq, 1.0f);
    test_fill_normal(&r, sinks, H, 1.0f);
    for (int nt = 1; nt <= 2; nt++) {
        mha_kv_attention_args a = {0};
        a.num_seqs = S, a.num_tokens = t, a.num_heads = H, a.q = q, a.out = out[nt];
        a.lse = lse[nt], a.alibi = tc->alibi, a.softcap = tc->softcap;
        a.sinks = tc->sinks ? sinks : NULL, a.tree_parents = tc->tree ? par : NULL;
        mha_exec ex = {0};
        ex.n_threads = nt;
        CHECK_OK(mha_kv_cache_attention(c, &a, &ex, &err), &err);
    }
    char name[160];
    snprintf(name, sizeof name,
             "%s R=%lld (H %lld G %lld t %lld%s) dk %lld dv %lld%s W %lld C %lld%s%s%s",
             dt_name(tc->dt), (long long)(grp * t), (long long)H, (long long)G, (long long)t,
             tc->tree ? " tree" : "", (long long)dk, (long long)dv, tc->block ? " paged" : "",
             (long long)tc->window, (long long)tc->chunk, tc->alibi ? " alibi" : "",
             tc->sinks ? " sinks" : "", tc->softcap > 0.0 ? " softcap" : "");
    CHECK(memcmp(out[1], out[2], sizeof(float) * (size_t)no) == 0 &&
              memcmp(lse[1], lse[2], sizeof(float) * (size_t)(S * H * t)) == 0,
          "%s: 2 threads differ from 1", name);

    const double scale = 1.0 / sqrt((double)dk);
    float *kr = malloc(sizeof(float) * (size_t)(G * dk)),
          *vr = malloc(sizeof(float) * (size_t)(G * dv));
    double *ref = calloc((size_t)no, sizeof(double)),
           *rl = calloc((size_t)(S * H * t), sizeof(double));
    double *sc = malloc(sizeof(double) * (size_t)max_len),
           *acc = malloc(sizeof(double) * (size_t)dv);
    for (int64_t s = 0; s < S; s++) {
        const int64_t L = tc->len[s], base = L - t;
        for (int64_t i = 0; i < t; i++) {
            const int64_t qp = base + depth_of(par, i);
            for (int64_t h = 0; h < H; h++) {
                const int64_t g = h / grp;
                const float *qr = q + ((s * t + i) * H + h) * dk;
                double mx = tc->sinks ? (double)sinks[h] : -(double)INFINITY;
                for (int64_t j = 0; j < L; j++) {
                    sc[j] = -(double)INFINITY;
                    int64_t kp = j;
                    if (j >= base) {
                        if (!is_ancestor_or_self(par, j - base, i))
                            continue;
                        kp = base + depth_of(par, j - base);
                    }
                    if (!rule(qp, kp, tc->window, tc->chunk))
                        continue;
                    CHECK_OK(mha_kv_cache_read(c, s, j, kr, NULL, &err), &err);
                    double dot = 0.0;
                    for (int64_t e = 0; e < dk; e++)
                        dot += (double)qr[e] * (double)kr[g * dk + e];
                    double x = scale * dot;
                    if (tc->softcap > 0.0)
                        x = tc->softcap * tanh(x / tc->softcap);
                    if (tc->alibi)
                        x -= oracle_alibi_slope(H, h) * (double)(qp - kp);
                    sc[j] = x;
                    mx = x > mx ? x : mx;
                }
                double sum = tc->sinks ? exp((double)sinks[h] - mx) : 0.0;
                for (int64_t e = 0; e < dv; e++)
                    acc[e] = 0.0;
                for (int64_t j = 0; j < L; j++) {
                    if (sc[j] == -(double)INFINITY)
                        continue;
                    const double w = exp(sc[j] - mx);
                    sum += w;
                    CHECK_OK(mha_kv_cache_read(c, s, j, NULL, vr, &err), &err);
                    for (int64_t e = 0; e < dv; e++)
                        acc[e] += w * (double)vr[g * dv + e];
                }
                for (int64_t e = 0; e < dv; e++)
                    ref[((s * t + i) * H + h) * dv + e] = acc[e] / sum;
                rl[(s * H + h) * t + i] = mx + log(sum);
            }
        }
    }
    const double sref = test_max_abs(ref, no);
    const double e = test_max_abs_diff(out[1], ref, no);
    double el = 0.0;
    for (int64_t x = 0; x < S * H * t; x++)
        el = fmax(el, fabs((double)lse[1][x] - rl[x]) / fmax(1.0, fabs(rl[x])));
    CHECK(e <= TOL_OUT_REL * sref, "%s: out vs float64 oracle %.3g (rel)", name, e / sref);
    CHECK(el <= TOL_OUT_REL, "%s: lse vs float64 oracle %.3g", name, el);
    printf("%-90s out %.2g lse %.2g\n", name, e / sref, el);
    for (int x = 0; x < 3; x++)
        free(out[x]), free(lse[x]);
    free(k), free(v), free(q), free(kr), free(vr), free(ref), free(rl), free(sc), free(acc);
    mha_kv_cache_destroy(c);
}

int main(void) {
    /* shapes: H, G, dk, dv, t, tree (R = H / G * t) */
    static const int64_t shapes[][6] = {
        {5, 1, 40, 24, 1, 0},    /* R 5, one token, head sizes not multiples of 16 */
        {13, 1, 24, 40, 1, 0},   /* R 13: AVX2 wide path for float32 and fp8 */
        {16, 1, 20, 36, 2, 0},   /* R 32, head sizes not multiples of 8 */
        {8, 8, 64, 64, 8, 1},    /* R 8: group 1, 8 drafts */
        {6, 2, 48, 80, 4, 0},    /* R 12, chain of 4 */
        {16, 4, 128, 128, 8, 1}, /* R 32: the 8-draft tree of issue 32 */
        {16, 2, 96, 64, 8, 0},   /* R 64 */
        {12, 2, 32, 32, 16, 1},  /* R 96, 16 drafts */
    };
    static const mha_dtype dts[] = {MHA_DTYPE_F32, MHA_DTYPE_F16, MHA_DTYPE_BF16, MHA_DTYPE_Q8_0,
                                    MHA_DTYPE_FP8_E4M3};
    int id = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++)
        for (size_t di = 0; di < sizeof dts / sizeof *dts; di++)
            for (int64_t paged = 0; paged < 2; paged++) {
                const int64_t *sh = shapes[si];
                rcase tc = {0};
                tc.H = sh[0], tc.G = sh[1], tc.dk = sh[2], tc.dv = sh[3], tc.t = sh[4];
                tc.tree = (int)sh[5], tc.dt = dts[di], tc.block = paged ? 16 : 0;
                if (tc.dt == MHA_DTYPE_Q8_0) { /* whole blocks of 32 */
                    tc.dk = (tc.dk + 31) / 32 * 32;
                    tc.dv = (tc.dv + 31) / 32 * 32;
                }
                /* options by case number, so every one meets every shape and dtype */
                const int v = id % 5;
                tc.window = v == 1 ? 40 : v == 3 ? 300 : 0; /* rings of 71 and 331 slots */
                tc.chunk = v == 4 ? 50 : 0;
                tc.alibi = v == 2 || v == 3;
                tc.sinks = v == 0 || v == 3;
                tc.softcap = v == 1 || v == 4 ? 15.0 : 0.0;
                tc.len[0] = 530 + 3 * (int64_t)si, tc.len[1] = tc.t + 21;
                run_case(&tc, id++);
            }
    /* Calls that read more than 32 MiB of K and V (decode.c MHA__DEC_FAR_MIN_BYTES), R = 4: on
     * AMD Zen 5 the AVX-512 contiguous path with the far prefetch (float32, float16, bfloat16:
     * its own instances of the passes, decode_avx512.c), elsewhere the same path as above. Their
     * 68 M random values are most of this test's time (per tier, Intel Xeon host: Release 6.8 s
     * with them, 2.7 without; ASan 56 / 18 s; qemu aarch64 90 / 33 s), so MHA_TEST_QUICK=1
     * (sanitizers, qemu) runs them only on a CPU that takes the far prefetch; the Release runs
     * take them everywhere. */
    const int far = !test_quick() || mha__cpu_decode_prefetch_far();
    static const mha_dtype far_dts[] = {MHA_DTYPE_F32, MHA_DTYPE_F16, MHA_DTYPE_BF16};
    for (size_t di = 0; far && di < sizeof far_dts / sizeof *far_dts; di++) {
        rcase tc = {0};
        tc.H = 32, tc.G = 8, tc.dk = 128, tc.dv = 128, tc.t = 1, tc.dt = far_dts[di];
        tc.sinks = 1, tc.len[0] = 8300, tc.len[1] = 300; /* 16-bit: 35 MB of K and V */
        run_case(&tc, id++);
    }
    return test_finish();
}
