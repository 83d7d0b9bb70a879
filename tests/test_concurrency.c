/* SPDX-License-Identifier: MIT */
/* test_concurrency.c: the thread-safety promises of mha.h, as a ThreadSanitizer target.
 *
 * 1. Eight threads call mha_layer_forward() on the SAME layer at once, each on its own input
 *    (self-attention with RoPE, causal, probabilities requested, and cross-attention), several
 *    rounds, for impl REFERENCE and AUTO, and AUTO with one mha_block_cache shared by all eight
 *    threads as exec.allocator; every result must be bit-identical to the one computed alone
 *    beforehand (with the default allocator).
 * 2. Four caller threads each run mha_attention() with n_threads = 2 (the library's own threads
 *    nested under the callers' threads); results bit-identical to a single-threaded run.
 * 3. Four threads load the same safetensors file at once (the cJSON parse is serialised) and
 *    every loaded layer gives the same output.
 * Run under TSan: cmake -DMHA_SANITIZE=thread (see SECURITY.md).
 */
#define _POSIX_C_SOURCE 200809L

#include "harness.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define N_THREADS 8
#define E         32 /* q_dim */
#define HEADS     4
#define BATCH     2
#define LQ        9
#define LK        13

static int rounds(void) {
    return test_quick() ? 2 : 6;
}

typedef struct job {
    const mha_layer *layer;
    mha_impl impl;
    const mha_allocator *alloc; /* the threads' allocator (NULL: the default) */
    int cross;
    float x[BATCH * LQ * E], kv[BATCH * LK * E];
    float want_y[BATCH * LQ * E], want_p[BATCH * HEADS * LQ * LK];
    float y[BATCH * LQ * E], p[BATCH * HEADS * LQ * LK];
    int64_t pos[BATCH * LQ];
    int failures;
    pthread_barrier_t *barrier;
} job;

static mha_status forward(job *j, const mha_allocator *alloc, float *y, float *p, mha_error *err) {
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.batch = BATCH;
    a.q_len = LQ;
    a.query = j->x;
    a.out = y;
    a.probs = p;
    if (j->cross) {
        a.kv_len = LK;
        a.key = j->kv;
    } else {
        a.q_positions = j->pos;
        a.mask.causal = 1;
    }
    mha_exec ex = {j->impl, 1, NULL, 0, alloc, NULL};
    return mha_layer_forward(j->layer, &a, &ex, err);
}

static void *forward_thread(void *arg) {
    job *j = arg;
    pthread_barrier_wait(j->barrier);
    for (int r = 0; r < rounds(); r++) {
        mha_error err;
        memset(j->y, 0, sizeof j->y);
        if (forward(j, j->alloc, j->y, j->p, &err) != MHA_STATUS_OK ||
            memcmp(j->y, j->want_y, sizeof j->y) != 0 ||
            (!j->cross && memcmp(j->p, j->want_p, sizeof(float) * BATCH * HEADS * LQ * LQ)) ||
            (j->cross && memcmp(j->p, j->want_p, sizeof j->p) != 0))
            j->failures++;
    }
    return NULL;
}

static mha_layer *make_layer(void) {
    mha_config c;
    memset(&c, 0, sizeof c);
    c.q_dim = E;
    c.num_heads = HEADS;
    c.num_kv_heads = 2;
    c.bias_q = c.bias_o = 1;
    c.rope.style = MHA_ROPE_HALF;
    float *w = malloc(sizeof(float) * 4 * E * E + sizeof(float) * 2 * E);
    test_rng rng;
    test_rng_seed(&rng, 3);
    test_fill_normal(&rng, w, 4 * E * E + 2 * E, 0.2f);
    /* GQA: w_k and w_v have num_kv_heads * head_dim = 16 rows. */
    mha_weights wt = {w,    w + E * E,         w + 2 * E * E, w + 3 * E * E, w + 4 * E * E, NULL,
                      NULL, w + 4 * E * E + E, NULL,          NULL,          NULL};
    mha_layer *L = NULL;
    mha_error err;
    CHECK_OK(mha_layer_create(&c, &wt, MHA_WEIGHTS_COPY, NULL, &L, &err), &err);
    free(w);
    return L;
}

static void test_shared_layer(void) {
    mha_layer *L = make_layer();
    if (!L)
        return;
    const mha_impl impls[] = {MHA_IMPL_REFERENCE, MHA_IMPL_AUTO, MHA_IMPL_AUTO};
    mha_block_cache *cache = NULL;
    mha_error cerr;
    CHECK_OK(mha_block_cache_create(0, &cache, &cerr), &cerr);
    for (int im = 0; im < 3; im++) {
        job *jobs = calloc(N_THREADS, sizeof *jobs);
        pthread_barrier_t barrier;
        pthread_barrier_init(&barrier, NULL, N_THREADS);
        test_rng rng;
        test_rng_seed(&rng, 100 + (uint64_t)im);
        for (int t = 0; t < N_THREADS; t++) {
            job *j = &jobs[t];
            j->layer = L;
            j->impl = impls[im];
            j->alloc = im == 2 ? mha_block_cache_allocator(cache) : NULL;
            j->cross = t % 2;
            j->barrier = &barrier;
            test_fill_normal(&rng, j->x, BATCH * LQ * E, 1.0f);
            test_fill_normal(&rng, j->kv, BATCH * LK * E, 1.0f);
            for (int i = 0; i < BATCH * LQ; i++)
                j->pos[i] = (i % LQ) * (t + 1) + t;
            mha_error err;
            CHECK_OK(forward(j, NULL, j->want_y, j->want_p, &err), &err);
        }
        pthread_t tid[N_THREADS];
        for (int t = 0; t < N_THREADS; t++)
            CHECK(pthread_create(&tid[t], NULL, forward_thread, &jobs[t]) == 0, "pthread_create");
        int failures = 0;
        for (int t = 0; t < N_THREADS; t++) {
            pthread_join(tid[t], NULL);
            failures += jobs[t].failures;
        }
        CHECK(failures == 0, "run %d: %d concurrent forwards differ from the single-threaded run",
              im, failures);
        pthread_barrier_destroy(&barrier);
        free(jobs);
    }
    CHECK(mha_block_cache_bytes(cache) > 0, "the shared block cache served no allocation");
    mha_block_cache_destroy(cache);
    mha_layer_destroy(L);
}

/* ---- mha_attention with its own threads, from several caller threads ------------------------ */
enum { CB = 2, CH = 4, CN = 33, CM = 47, CD = 24, CALLERS = 4 };

typedef struct core_job {
    float q[CB * CH * CN * CD], k[CB * CH * CM * CD], v[CB * CH * CM * CD];
    float want[CB * CH * CN * CD], out[CB * CH * CN * CD], lse[CB * CH * CN];
    mha_impl impl;
    int failures;
} core_job;

static mha_status core_run(core_job *j, float *out, int n_threads, mha_error *err) {
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = CB;
    a.num_heads = CH;
    a.q_len = CN;
    a.kv_len = CM;
    a.head_dim = CD;
    a.q = j->q;
    a.k = j->k;
    a.v = j->v;
    a.out = out;
    a.lse = j->lse;
    const int64_t qs[3] = {CH * CN * CD, CN * CD, CD}, ks[3] = {CH * CM * CD, CM * CD, CD};
    memcpy(a.q_strides, qs, sizeof qs);
    memcpy(a.out_strides, qs, sizeof qs);
    memcpy(a.k_strides, ks, sizeof ks);
    memcpy(a.v_strides, ks, sizeof ks);
    a.mask.causal = 1;
    a.dropout.p = 0.25f;
    a.dropout.training = 1;
    a.dropout.seed = 99;
    mha_exec ex = {j->impl, n_threads, NULL, 0, NULL, NULL};
    return mha_attention(&a, &ex, err);
}

static void *core_thread(void *arg) {
    core_job *j = arg;
    for (int r = 0; r < rounds(); r++) {
        mha_error err;
        if (core_run(j, j->out, 2, &err) != MHA_STATUS_OK ||
            memcmp(j->out, j->want, sizeof j->out) != 0)
            j->failures++;
    }
    return NULL;
}

static void test_nested_threads(void) {
    const mha_impl impls[] = {MHA_IMPL_REFERENCE, MHA_IMPL_AUTO};
    for (int im = 0; im < 2; im++) {
        core_job *jobs = calloc(CALLERS, sizeof *jobs);
        test_rng rng;
        test_rng_seed(&rng, 200 + (uint64_t)im);
        for (int t = 0; t < CALLERS; t++) {
            core_job *j = &jobs[t];
            j->impl = impls[im];
            test_fill_normal(&rng, j->q, CB * CH * CN * CD, 1.0f);
            test_fill_normal(&rng, j->k, CB * CH * CM * CD, 1.0f);
            test_fill_normal(&rng, j->v, CB * CH * CM * CD, 1.0f);
            mha_error err;
            CHECK_OK(core_run(j, j->want, 1, &err), &err);
        }
        pthread_t tid[CALLERS];
        for (int t = 0; t < CALLERS; t++)
            CHECK(pthread_create(&tid[t], NULL, core_thread, &jobs[t]) == 0, "pthread_create");
        int failures = 0;
        for (int t = 0; t < CALLERS; t++) {
            pthread_join(tid[t], NULL);
            failures += jobs[t].failures;
        }
        CHECK(failures == 0,
              "impl %d: %d runs with n_threads=2 from %d callers differ from n_threads=1",
              (int)impls[im], failures, CALLERS);
        free(jobs);
    }
}

/* ---- concurrent safetensors loads --------------------------------------------------------------
 */
static char g_st_path[64];

static void *load_thread(void *arg) {
    float *y = arg;
    mha_config c;
    memset(&c, 0, sizeof c);
    c.num_heads = 2;
    mha_layer *L = NULL;
    mha_error err;
    for (int r = 0; r < rounds(); r++) {
        if (mha_layer_load_safetensors(g_st_path, NULL, NULL, &c, NULL, &L, &err) != MHA_STATUS_OK)
            return NULL;
        float x[8 * 3];
        for (int i = 0; i < 24; i++)
            x[i] = (float)i * 0.1f;
        mha_forward_args a;
        memset(&a, 0, sizeof a);
        a.batch = 1;
        a.q_len = 3;
        a.query = x;
        a.out = y;
        mha_exec ex = {MHA_IMPL_REFERENCE, 1, NULL, 0, NULL, NULL};
        mha_layer_forward(L, &a, &ex, &err);
        mha_layer_destroy(L);
    }
    return NULL;
}

static void test_concurrent_loads(void) {
    snprintf(g_st_path, sizeof g_st_path, "/tmp/mha_conc_%ld.safetensors", (long)getpid());
    const char *json = "{\"q_proj.weight\": {\"dtype\": \"F32\", \"shape\": [8, 8], "
                       "\"data_offsets\": [0, 256]}, \"k_proj.weight\": {\"dtype\": \"F32\", "
                       "\"shape\": [8, 8], \"data_offsets\": [256, 512]}, \"v_proj.weight\": "
                       "{\"dtype\": \"F32\", \"shape\": [8, 8], \"data_offsets\": [512, 768]}, "
                       "\"o_proj.weight\": {\"dtype\": \"F32\", \"shape\": [8, 8], "
                       "\"data_offsets\": [768, 1024]}}";
    const uint64_t n = strlen(json);
    float w[256];
    test_rng rng;
    test_rng_seed(&rng, 8);
    test_fill_normal(&rng, w, 256, 0.3f);
    FILE *f = fopen(g_st_path, "wb");
    CHECK(f != NULL, "create %s", g_st_path);
    if (!f)
        return;
    unsigned char len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)(n >> (8 * i));
    fwrite(len8, 1, 8, f);
    fwrite(json, 1, n, f);
    fwrite(w, sizeof(float), 256, f);
    fclose(f);
    float y[CALLERS][24];
    memset(y, 0, sizeof y);
    pthread_t tid[CALLERS];
    for (int t = 0; t < CALLERS; t++)
        CHECK(pthread_create(&tid[t], NULL, load_thread, y[t]) == 0, "pthread_create");
    for (int t = 0; t < CALLERS; t++)
        pthread_join(tid[t], NULL);
    for (int t = 1; t < CALLERS; t++)
        CHECK(memcmp(y[t], y[0], sizeof y[0]) == 0, "concurrent load %d differs", t);
    int nonzero = 0;
    for (int i = 0; i < 24; i++)
        nonzero |= y[0][i] != 0.0f;
    CHECK(nonzero, "concurrent loads produced no output");
    remove(g_st_path);
}

int main(void) {
    test_shared_layer();
    test_nested_threads();
    test_concurrent_loads();
    return test_finish();
}
