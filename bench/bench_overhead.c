/* SPDX-License-Identifier: MIT */
/* bench_overhead.c: `mha_bench_overhead`, the per-call cost of threading, through the public API
 * only. Three small or short calls where starting threads is a visible part of the time, each run
 * in one process with 1 thread, with 2 threads started per parallel region (no pool, the only way
 * before mha_threadpool), and with 2 threads of one persistent pool:
 *   layer16   mha_layer_forward, B = 1, n = 16, q_dim 512, 8 heads (4 kv heads), causal, RoPE
 *   step64    mha_layer_decode_step, batch 1, cache of 64 positions, q_dim 512, 8/4 heads
 *   step32k   mha_kv_cache_attention for one new token over a cache of 32768 positions,
 *             h = 32, g = 8, d = 128, float32 (what `mha decode-bench --attention-only` times)
 * Prints the median and the spread (min..max) of R repetitions of each, in microseconds.
 * Usage: mha_bench_overhead [--reps R] */
#define _POSIX_C_SOURCE 200809L
#include "mha.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec * 1e-3;
}

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void fill(float *x, int64_t n, float scale) {
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (int64_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = scale * ((float)(s >> 40) / (float)(1 << 24) - 0.5f);
    }
}

static void die(const char *what, const mha_error *err) {
    fprintf(stderr, "mha_bench_overhead: %s: %s\n", what, err->message);
    exit(1);
}

typedef enum { LAYER16, STEP64, STEP32K } call_kind;

typedef struct setup {
    mha_layer *layer;
    mha_kv_cache *cache;
    float *x, *y, *q, *o;
    int64_t L;
} setup;

static mha_layer *make_layer(int64_t q_dim, int64_t h, int64_t g, float *w) {
    mha_config c;
    memset(&c, 0, sizeof c);
    c.q_dim = q_dim, c.num_heads = h, c.num_kv_heads = g;
    c.rope.style = MHA_ROPE_HALF;
    const int64_t d = q_dim / h;
    fill(w, 2 * q_dim * q_dim + 2 * g * d * q_dim, 1.0f / sqrtf((float)q_dim));
    mha_weights wt;
    memset(&wt, 0, sizeof wt);
    wt.w_q = w, wt.w_k = w + q_dim * q_dim, wt.w_v = w + q_dim * q_dim + g * d * q_dim;
    wt.w_o = w + q_dim * q_dim + 2 * g * d * q_dim;
    mha_layer *layer = NULL;
    mha_error err;
    if (mha_layer_create(&c, &wt, MHA_WEIGHTS_COPY, NULL, &layer, &err))
        die("layer", &err);
    return layer;
}

/* One timed call; the cache is truncated back after a decode step so every step sees L. */
static double run_once(call_kind kind, setup *s, const mha_exec *ex) {
    mha_error err;
    mha_status st;
    const double t0 = now_us();
    if (kind == LAYER16) {
        mha_forward_args a;
        memset(&a, 0, sizeof a);
        a.batch = 1, a.q_len = 16, a.query = s->x, a.out = s->y;
        a.mask.causal = 1;
        st = mha_layer_forward(s->layer, &a, ex, &err);
    } else if (kind == STEP64) {
        mha_decode_args d;
        memset(&d, 0, sizeof d);
        d.num_seqs = 1, d.num_tokens = 1, d.x = s->x, d.out = s->y;
        st = mha_layer_decode_step(s->layer, s->cache, &d, ex, &err);
    } else {
        mha_kv_attention_args a;
        memset(&a, 0, sizeof a);
        a.num_seqs = 1, a.num_tokens = 1, a.num_heads = 32, a.q = s->q, a.out = s->o;
        st = mha_kv_cache_attention(s->cache, &a, ex, &err);
    }
    const double dt = now_us() - t0;
    if (st)
        die("call", &err);
    if (kind == STEP64)
        mha_kv_cache_truncate(s->cache, 0, s->L, &err);
    return dt;
}

int main(int argc, char **argv) {
    int reps = 301;
    for (int i = 1; i + 1 < argc; i += 2)
        if (strcmp(argv[i], "--reps") == 0)
            reps = atoi(argv[i + 1]);
    mha_error err;
    mha_threadpool *pool = NULL;
    if (mha_threadpool_create(2, NULL, &pool, &err))
        die("pool", &err);
    float *w_small = malloc(sizeof(float) * 4 * 512 * 512);
    float *buf = calloc(16 * 4096 + 2 * 32 * 128, sizeof(float));
    setup small = {make_layer(512, 8, 4, w_small), NULL, buf, buf + 16 * 512, NULL, NULL, 64};
    mha_kv_cache_config kc;
    memset(&kc, 0, sizeof kc);
    kc.batch = 1, kc.max_seq = 128;
    if (mha_kv_cache_create(&kc, small.layer, NULL, &small.cache, &err))
        die("cache", &err);
    fill(buf, 16 * 512, 1.0f);
    float *prompt = malloc(sizeof(float) * 64 * 512);
    float *pout = malloc(sizeof(float) * 64 * 512);
    fill(prompt, 64 * 512, 1.0f);
    mha_decode_args d = {1, NULL, 64, prompt, pout, NULL};
    if (mha_layer_prefill(small.layer, small.cache, &d, NULL, &err))
        die("prefill", &err);

    /* The 32k cache: core level (no layer weights needed), random K/V appended in chunks. */
    mha_kv_cache_config big_c;
    memset(&big_c, 0, sizeof big_c);
    big_c.batch = 1, big_c.max_seq = 32768, big_c.num_kv_heads = 8, big_c.head_dim = 128;
    setup big = {NULL, NULL, NULL, NULL, buf + 16 * 4096, buf + 16 * 4096 + 32 * 128, 32768};
    if (mha_kv_cache_create(&big_c, NULL, NULL, &big.cache, &err))
        die("32k cache", &err);
    float *kv = malloc(sizeof(float) * 1024 * 8 * 128);
    fill(kv, 1024 * 8 * 128, 1.0f);
    for (int c = 0; c < 32; c++)
        if (mha_kv_cache_append(big.cache, 1, NULL, 1024, kv, kv, &err))
            die("append", &err);
    fill(big.q, 32 * 128, 1.0f);

    const struct {
        const char *name;
        call_kind kind;
        setup *s;
        int reps_div;
    } calls[3] = {{"layer16", LAYER16, &small, 1},
                  {"step64", STEP64, &small, 1},
                  {"step32k", STEP32K, &big, 10}};
    const struct {
        const char *name;
        mha_exec ex;
    } modes[3] = {{"1 thread", {MHA_IMPL_AUTO, 1, NULL, 0, NULL, NULL}},
                  {"2 threads, no pool", {MHA_IMPL_AUTO, 2, NULL, 0, NULL, NULL}},
                  {"2 threads, pool", {MHA_IMPL_AUTO, 2, NULL, 0, NULL, pool}}};
    double *t = malloc(sizeof(double) * (size_t)reps);
    printf("%-8s %-20s %10s %10s %10s   (microseconds, %d reps)\n", "call", "threads", "median",
           "min", "max", reps);
    for (int c = 0; c < 3; c++)
        for (int m = 0; m < 3; m++) {
            const int r = reps / calls[c].reps_div > 5 ? reps / calls[c].reps_div : 5;
            for (int i = 0; i < 3; i++) /* warm-up */
                run_once(calls[c].kind, calls[c].s, &modes[m].ex);
            for (int i = 0; i < r; i++)
                t[i] = run_once(calls[c].kind, calls[c].s, &modes[m].ex);
            qsort(t, (size_t)r, sizeof(double), cmp_d);
            printf("%-8s %-20s %10.1f %10.1f %10.1f\n", calls[c].name, modes[m].name, t[r / 2],
                   t[0], t[r - 1]);
            fflush(stdout);
        }
    free(t);
    free(kv);
    free(prompt);
    free(pout);
    mha_kv_cache_destroy(big.cache);
    mha_kv_cache_destroy(small.cache);
    mha_layer_destroy(small.layer);
    free(w_small);
    free(buf);
    mha_threadpool_destroy(pool);
    return 0;
}
