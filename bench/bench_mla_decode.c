/* SPDX-License-Identifier: MIT */
/* bench_mla_decode.c: one decode step of multi-head latent attention (DeepSeek-V3 shapes by
 * default) at batch 1 over a cache of L tokens, public API only (bench/bench_mla.py drives it
 * beside the read-bandwidth probe and torch):
 *   absorbed   the attention part of mha_mla_decode_step, the very call it makes: mha_attention
 *              as MQA (h heads, one kv head, d_k = r + dr, d_v = r) over the compressed cache
 *              [L, r + dr], V = the first r columns of the same rows;
 *   step       the whole mha_mla_decode_step (projections, absorption, attention, o_proj) with
 *              random weights (--step; hidden 7168 and q_lora_rank 1536: ~0.8 GB of weights);
 *   expanded   the same layer decoded through an expanded per-head cache (--expanded):
 *              mha_kv_cache_attention, g = h kv heads of d_k = dn + dr, d_v = dv, L tokens.
 * Each: median, min and max over --reps steps (after one warm-up), bytes of cache read per
 * step and the resulting GB/s, and GFLOP/s (2 h (d_k + d_v) L flops).
 *
 * Usage: mha_bench_mla [--len L] [--heads H] [--dtype f32|bf16] [--reps R] [--threads T]
 *                      [--step] [--expanded] */
#define _POSIX_C_SOURCE 200809L
#include "mha.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define R_KV 512
#define D_R  64
#define D_N  128
#define D_V  128

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static uint64_t rng = 88172645463325252ull;
static float rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((double)(rng >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

static void fill(float *x, int64_t n, float s) {
    for (int64_t i = 0; i < n; i++)
        x[i] = s * rnd();
}

static void die(mha_status st, const mha_error *e, const char *what) {
    if (st != MHA_STATUS_OK) {
        fprintf(stderr, "%s: %s\n", what, e->message);
        exit(1);
    }
}

typedef mha_status (*run_fn)(void *ctx);

/* Median, min, max in ms of reps runs after a warm-up. */
static void timeit(run_fn f, void *ctx, int reps, double out[3]) {
    double *t = malloc(sizeof(double) * (size_t)reps);
    (void)f(ctx);
    for (int i = 0; i < reps; i++) {
        const double t0 = now_s();
        (void)f(ctx);
        t[i] = 1e3 * (now_s() - t0);
    }
    qsort(t, (size_t)reps, sizeof *t, cmp_d);
    out[0] = t[reps / 2];
    out[1] = t[0];
    out[2] = t[reps - 1];
    free(t);
}

typedef struct attn_ctx {
    mha_attention_args a;
    mha_exec ex;
    mha_error e;
} attn_ctx;

static mha_status run_attn(void *p) {
    attn_ctx *c = p;
    return mha_attention(&c->a, &c->ex, &c->e);
}

static void report(const char *what, const double t[3], double bytes, double flops) {
    printf("%-10s median %9.3f ms  [%9.3f, %9.3f]  cache %9.1f MB  %7.1f GB/s  %7.1f GFLOP/s\n",
           what, t[0], t[1], t[2], bytes * 1e-6, bytes / (t[0] * 1e-3) * 1e-9,
           flops / (t[0] * 1e-3) * 1e-9);
}

/* The absorbed attention over a compressed cache of L rows [c, k_pe] in dt. */
static void bench_absorbed(int64_t L, int64_t h, mha_dtype dt, int q_bf16, int reps, mha_exec ex) {
    const int64_t w = R_KV + D_R;
    const size_t es = mha_dtype_size(dt);
    float *rows = malloc(sizeof(float) * (size_t)(w * 4096));
    void *cache = aligned_alloc(64, (size_t)(L * w) * es);
    mha_error e;
    for (int64_t j0 = 0; j0 < L; j0 += 4096) {
        const int64_t n = L - j0 < 4096 ? L - j0 : 4096;
        fill(rows, n * w, 1.0f);
        if (dt == MHA_DTYPE_F32) {
            memcpy((float *)cache + j0 * w, rows, sizeof(float) * (size_t)(n * w));
        } else { /* bf16 by truncation: random data, only the bytes matter here */
            for (int64_t i = 0; i < n * w; i++) {
                float x = rows[i];
                uint32_t u;
                memcpy(&u, &x, 4);
                ((uint16_t *)cache)[j0 * w + i] = (uint16_t)(u >> 16);
            }
        }
    }
    float *q = malloc(sizeof(float) * (size_t)(h * w)),
          *o = malloc(sizeof(float) * (size_t)(h * R_KV));
    fill(q, h * w, 0.05f);
    attn_ctx c;
    memset(&c, 0, sizeof c);
    c.ex = ex;
    c.a.batch = 1;
    c.a.num_heads = h;
    c.a.num_kv_heads = 1;
    c.a.q_len = 1;
    c.a.kv_len = L;
    c.a.head_dim = w;
    c.a.v_head_dim = R_KV;
    c.a.q = q;
    uint16_t *qh = malloc(sizeof(uint16_t) * (size_t)(h * w));
    if (q_bf16 && dt == MHA_DTYPE_BF16) { /* q rounded to bf16 too: the bf16 tile kernel */
        for (int64_t i = 0; i < h * w; i++) {
            uint32_t u;
            memcpy(&u, &q[i], 4);
            qh[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        }
        c.a.q = qh;
        c.a.q_dtype = MHA_DTYPE_BF16;
    }
    c.a.k = c.a.v = cache;
    c.a.k_dtype = c.a.v_dtype = dt;
    const int64_t qs[3] = {h * w, w, h * w}, ks[3] = {L * w, L * w, w},
                  os[3] = {h * R_KV, R_KV, h * R_KV};
    memcpy(c.a.q_strides, qs, sizeof qs);
    memcpy(c.a.k_strides, ks, sizeof ks);
    memcpy(c.a.v_strides, ks, sizeof ks);
    memcpy(c.a.out_strides, os, sizeof os);
    c.a.mask.causal = 1;
    c.a.mask.window_left = c.a.mask.window_right = -1;
    c.a.out = o;
    die(run_attn(&c), &c.e, "absorbed attention");
    double t[3];
    timeit(run_attn, &c, reps, t);
    report(c.a.q_dtype == MHA_DTYPE_BF16 ? "absorb-qbf" : "absorbed", t,
           (double)(L * w) * (double)es, 2.0 * (double)h * (double)(w + R_KV) * (double)L);
    free(rows), free(cache), free(q), free(o), free(qh);
    (void)e;
}

typedef struct kv_ctx {
    mha_kv_cache *cache;
    mha_kv_attention_args a;
    mha_exec ex;
    mha_error e;
} kv_ctx;

static mha_status run_kv(void *p) {
    kv_ctx *c = p;
    return mha_kv_cache_attention(c->cache, &c->a, &c->ex, &c->e);
}

/* The same layer through an expanded per-head cache: g = h heads of K (dn + dr) and V (dv). */
static void bench_expanded(int64_t L, int64_t h, mha_dtype dt, int reps, mha_exec ex) {
    const int64_t dk = D_N + D_R, chunk = 64;
    mha_kv_cache_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_kv_heads = h;
    cfg.head_dim = dk;
    cfg.v_head_dim = D_V;
    cfg.max_seq = L;
    cfg.batch = 1;
    cfg.dtype = dt;
    kv_ctx c;
    memset(&c, 0, sizeof c);
    die(mha_kv_cache_create(&cfg, NULL, NULL, &c.cache, &c.e), &c.e, "expanded cache");
    float *k = malloc(sizeof(float) * (size_t)(chunk * h * dk));
    float *v = malloc(sizeof(float) * (size_t)(chunk * h * D_V));
    for (int64_t j0 = 0; j0 < L; j0 += chunk) {
        fill(k, chunk * h * dk, 1.0f);
        fill(v, chunk * h * D_V, 1.0f);
        die(mha_kv_cache_append(c.cache, 1, NULL, chunk, k, v, &c.e), &c.e, "append");
    }
    float *q = malloc(sizeof(float) * (size_t)(h * dk)),
          *o = malloc(sizeof(float) * (size_t)(h * D_V));
    fill(q, h * dk, 0.05f);
    c.ex = ex;
    c.a.num_seqs = 1;
    c.a.num_tokens = 1;
    c.a.num_heads = h;
    c.a.q = q;
    c.a.out = o;
    die(run_kv(&c), &c.e, "expanded attention");
    double t[3];
    timeit(run_kv, &c, reps, t);
    report("expanded", t, (double)(L * h * (dk + D_V)) * (double)mha_dtype_size(dt),
           2.0 * (double)h * (double)(dk + D_V) * (double)L);
    mha_kv_cache_destroy(c.cache);
    free(k), free(v), free(q), free(o);
}

typedef struct step_ctx {
    mha_mla *mla;
    mha_mla_cache *cache;
    mha_decode_args a;
    mha_exec ex;
    mha_error e;
} step_ctx;

/* The whole decode step, DeepSeek-V3's layer (hidden 7168, q_lora_rank 1536). Each timed step
 * resets the sequence and appends L - 1 rows first (untimed), so the step attends to L keys. */
static void bench_step(int64_t L, int64_t h, mha_dtype dt, int reps, mha_exec ex) {
    const int64_t E = 7168, rq = 1536, dq = D_N + D_R, w = R_KV + D_R;
    mha_mla_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.hidden = E;
    cfg.num_heads = h;
    cfg.q_lora_rank = rq;
    cfg.kv_lora_rank = R_KV;
    cfg.qk_nope_head_dim = D_N;
    cfg.qk_rope_head_dim = D_R;
    cfg.v_head_dim = D_V;
    cfg.rope.style = MHA_ROPE_INTERLEAVED;
    const int64_t n[] = {rq * E, rq, h * dq * rq, w * E, R_KV, h * (D_N + D_V) * R_KV, E * h * D_V};
    float *p[7];
    for (int i = 0; i < 7; i++) {
        p[i] = malloc(sizeof(float) * (size_t)n[i]);
        fill(p[i], n[i], i == 1 || i == 4 ? 1.0f : 0.02f);
    }
    mha_mla_weights wt;
    memset(&wt, 0, sizeof wt);
    wt.w_q_a = p[0], wt.q_a_norm = p[1], wt.w_q_b = p[2], wt.w_kv_a = p[3], wt.kv_a_norm = p[4];
    wt.w_kv_b = p[5], wt.w_o = p[6];
    step_ctx c;
    memset(&c, 0, sizeof c);
    die(mha_mla_create(&cfg, &wt, NULL, &c.mla, &c.e), &c.e, "mla");
    for (int i = 0; i < 7; i++)
        free(p[i]);
    die(mha_mla_cache_create(c.mla, 1, L, dt, NULL, &c.cache, &c.e), &c.e, "mla cache");
    float *rows = malloc(sizeof(float) * (size_t)(w * 4096));
    float *x = malloc(sizeof(float) * (size_t)E), *y = malloc(sizeof(float) * (size_t)E);
    fill(x, E, 1.0f);
    c.ex = ex;
    c.a.num_seqs = 1;
    c.a.num_tokens = 1;
    c.a.x = x;
    c.a.out = y;
    double *t = malloc(sizeof(double) * (size_t)(reps + 1));
    for (int r = 0; r <= reps; r++) {
        die(mha_mla_cache_reset(c.cache, 0, &c.e), &c.e, "reset");
        for (int64_t j0 = 0; j0 < L - 1; j0 += 4096) {
            const int64_t k = L - 1 - j0 < 4096 ? L - 1 - j0 : 4096;
            if (r == 0)
                fill(rows, k * w, 1.0f);
            die(mha_mla_cache_append(c.cache, 1, NULL, k, rows, &c.e), &c.e, "append");
        }
        const double t0 = now_s();
        die(mha_mla_decode_step(c.mla, c.cache, &c.a, &c.ex, &c.e), &c.e, "step");
        t[r] = 1e3 * (now_s() - t0);
    }
    qsort(t + 1, (size_t)reps, sizeof *t, cmp_d);
    const double s[3] = {t[1 + reps / 2], t[1], t[reps]};
    report("step", s, (double)(L * w) * (double)mha_dtype_size(dt),
           2.0 * (double)h * (double)(w + R_KV) * (double)L);
    mha_mla_cache_destroy(c.cache);
    mha_mla_destroy(c.mla);
    free(rows), free(x), free(y), free(t);
}

int main(int argc, char **argv) {
    int64_t L = 32768, h = 128;
    int reps = 7, threads = 0, step = 0, expanded = 0;
    mha_dtype dt = MHA_DTYPE_BF16;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--len") && i + 1 < argc)
            L = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--heads") && i + 1 < argc)
            h = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--dtype") && i + 1 < argc) {
            const char *d = argv[++i];
            dt = !strcmp(d, "f32")   ? MHA_DTYPE_F32
                 : !strcmp(d, "f16") ? MHA_DTYPE_F16
                                     : MHA_DTYPE_BF16;
        } else if (!strcmp(argv[i], "--step"))
            step = 1;
        else if (!strcmp(argv[i], "--expanded"))
            expanded = 1;
        else {
            fprintf(stderr, "usage: mha_bench_mla [--len L] [--heads H] [--dtype f32|bf16] "
                            "[--reps R] [--threads T] [--step] [--expanded]\n");
            return 2;
        }
    }
    if (reps < 1 || L < 1 || h < 1)
        return 2;
    mha_exec ex;
    memset(&ex, 0, sizeof ex);
    ex.n_threads = threads;
    mha_threadpool *pool = NULL;
    mha_error e;
    die(mha_threadpool_create(threads, NULL, &pool, &e), &e, "pool");
    ex.pool = pool;
    printf("# MLA decode step, batch 1, L=%lld cached tokens, h=%lld, r=%d, dr=%d, dn=%d, dv=%d, "
           "cache %s, %d thread(s)\n",
           (long long)L, (long long)h, R_KV, D_R, D_N, D_V, dt == MHA_DTYPE_F32 ? "f32" : "bf16",
           mha_threadpool_size(pool));
    bench_absorbed(L, h, dt, 0, reps, ex);
    if (dt == MHA_DTYPE_BF16)
        bench_absorbed(L, h, dt, 1, reps, ex);
    if (step)
        bench_step(L, h, dt, reps, ex);
    if (expanded)
        bench_expanded(L, h, dt, reps, ex);
    mha_threadpool_destroy(pool);
    return 0;
}
