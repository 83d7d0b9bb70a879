/* SPDX-License-Identifier: MIT */
/* test_threadpool.c: the caller-owned thread pool (mha_threadpool, mha_exec.pool).
 *
 * 1. Arguments: create refuses a negative or too large size, a NULL out and a half-filled
 *    allocator; size 0 means the online CPUs; destroy(NULL) and size(NULL) are harmless.
 * 2. The pool's own memory comes from its allocator, all of it given back at destroy.
 * 3. One pool reused by hundreds of calls (layer forward with probabilities, attention core,
 *    layer backward, decode steps): every result bit-identical to the same call without a pool
 *    and with one thread; exec.n_threads above the pool's size uses the pool's size, and without
 *    a pool above 1024 uses 1024 (n_threads = INT32_MAX: the 1024-thread workspace, the result
 *    of one thread).
 * 4. A call with a workspace and a pool allocates nothing through exec.allocator.
 * 5. One pool shared by four caller threads at once (a ThreadSanitizer target): bit-identical
 *    results. Negative exec.n_threads is INVALID_ARG with and without a pool.
 * 6. The pool's two ways of waiting (src/base/threads.c: poll, then sleep): a pool within the
 *    online CPUs (it polls) and one larger than them (it only sleeps), each running calls back to
 *    back (the workers still polling), calls after pauses longer than the poll (the workers and
 *    the caller asleep), calls with fewer threads than the pool (workers without a part), and
 *    destroyed right after a call: every result bit-identical to one thread.
 */
#define _POSIX_C_SOURCE 200809L

#include "harness.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define E     64 /* q_dim */
#define HEADS 4
#define KVH   2
#define B     2
#define L     37

typedef struct counting {
    int allocs, frees;
} counting;

static void *count_alloc(void *user, size_t bytes, size_t align) {
    ((counting *)user)->allocs++;
    void *p = NULL;
    return posix_memalign(&p, align < sizeof(void *) ? sizeof(void *) : align, bytes ? bytes : 1)
               ? NULL
               : p;
}

static void count_free(void *user, void *ptr) {
    if (ptr)
        ((counting *)user)->frees++;
    free(ptr);
}

static void test_arguments(void) {
    mha_error err;
    mha_threadpool *pool = (mha_threadpool *)&err; /* must be set to NULL on error */
    CHECK(mha_threadpool_create(-1, NULL, &pool, &err) == MHA_STATUS_INVALID_ARG && !pool &&
              strstr(err.message, "n_threads"),
          "negative size: %s", err.message);
    CHECK(mha_threadpool_create(1025, NULL, &pool, &err) == MHA_STATUS_INVALID_ARG,
          "size 1025 must be refused");
    CHECK(mha_threadpool_create(2, NULL, NULL, &err) == MHA_STATUS_INVALID_ARG,
          "NULL out must be refused");
    mha_allocator half = {NULL, count_alloc, NULL};
    CHECK(mha_threadpool_create(2, &half, &pool, &err) == MHA_STATUS_INVALID_ARG,
          "an allocator without free must be refused");
    CHECK_OK(mha_threadpool_create(0, NULL, &pool, &err), &err);
    CHECK(mha_threadpool_size(pool) == mha_default_threads(), "size 0 = %d threads, got %d",
          (int)mha_default_threads(), (int)mha_threadpool_size(pool));
    mha_threadpool_destroy(pool);
    CHECK(mha_threadpool_size(NULL) == 0, "size(NULL) must be 0");
    mha_threadpool_destroy(NULL);

    counting c = {0, 0};
    mha_allocator al = {&c, count_alloc, count_free};
    CHECK_OK(mha_threadpool_create(3, &al, &pool, &err), &err);
    CHECK(mha_threadpool_size(pool) == 3 && c.allocs > 0, "size %d, %d allocations",
          (int)mha_threadpool_size(pool), c.allocs);
    mha_threadpool_destroy(pool);
    CHECK(c.allocs == c.frees, "pool allocator: %d allocations, %d frees", c.allocs, c.frees);
}

/* exec.n_threads beyond 1024 without a pool counts as 1024 (a pool's largest size): each thread
 * has its own scratch, and a tiny call with n_threads = INT32_MAX sized its workspace by it
 * (1.2e14 bytes for the core call below, 1.4e11 for the KV-cache step: NO_MEMORY, or an abort
 * under ASan, for calls that need kilobytes). */
static void test_absurd_threads(void) {
    enum { H = 2, N = 8, D = 16 };
    static float q[H * N * D], o1[H * N * D], o2[H * N * D];
    test_rng rng;
    test_rng_seed(&rng, 11);
    test_fill_normal(&rng, q, H * N * D, 1.0f);
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = 1, a.num_heads = H, a.q_len = N, a.kv_len = N, a.head_dim = D;
    const int64_t s[3] = {H * N * D, N * D, D};
    a.q = a.k = a.v = q;
    memcpy(a.q_strides, s, sizeof s);
    memcpy(a.k_strides, s, sizeof s);
    memcpy(a.v_strides, s, sizeof s);
    memcpy(a.out_strides, s, sizeof s);
    a.mask.causal = 1;
    mha_error err;
    mha_exec one = {MHA_IMPL_AUTO, 1, NULL, 0, NULL, NULL};
    mha_exec huge = {MHA_IMPL_AUTO, INT32_MAX, NULL, 0, NULL, NULL};
    mha_exec most = {MHA_IMPL_AUTO, 1024, NULL, 0, NULL, NULL};
    size_t b_huge = 0, b_most = 1;
    CHECK_OK(mha_attention_workspace_size(&a, &huge, &b_huge, &err), &err);
    CHECK_OK(mha_attention_workspace_size(&a, &most, &b_most, &err), &err);
    CHECK(b_huge == b_most, "n_threads INT32_MAX: workspace %zu bytes, 1024 threads: %zu", b_huge,
          b_most);
    a.out = o1;
    CHECK_OK(mha_attention(&a, &one, &err), &err);
    a.out = o2;
    CHECK_OK(mha_attention(&a, &huge, &err), &err);
    CHECK(memcmp(o1, o2, sizeof o1) == 0, "core: n_threads INT32_MAX differs from 1 thread");

    mha_kv_cache_config cc;
    memset(&cc, 0, sizeof cc);
    cc.num_kv_heads = 1, cc.head_dim = D, cc.max_seq = 16, cc.batch = 1;
    mha_kv_cache *cache = NULL;
    CHECK_OK(mha_kv_cache_create(&cc, NULL, NULL, &cache, &err), &err);
    if (!cache)
        return;
    CHECK_OK(mha_kv_cache_append(cache, 1, NULL, N, q, q + N * D, &err), &err);
    mha_kv_attention_args ka;
    memset(&ka, 0, sizeof ka);
    ka.num_seqs = 1, ka.num_tokens = 1, ka.num_heads = H, ka.q = q;
    ka.out = o1;
    CHECK_OK(mha_kv_cache_attention(cache, &ka, &one, &err), &err);
    ka.out = o2;
    CHECK_OK(mha_kv_cache_attention(cache, &ka, &huge, &err), &err);
    CHECK(memcmp(o1, o2, H * D * sizeof(float)) == 0,
          "kv attention: n_threads INT32_MAX differs from 1 thread");
    mha_kv_cache_destroy(cache);
}

typedef struct fixture {
    mha_layer *layer;
    float x[B * L * E], y[B * L * E], p[B * HEADS * L * L];
    float dy[B * L * E], dx[B * L * E], dwq[E * E];
} fixture;

static void fixture_init(fixture *f, float *wbuf) {
    test_rng rng;
    test_rng_seed(&rng, 7);
    test_fill_normal(&rng, wbuf, 4 * E * E, 0.1f);
    test_fill_normal(&rng, f->x, B * L * E, 1.0f);
    test_fill_normal(&rng, f->dy, B * L * E, 1.0f);
    mha_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.q_dim = E, cfg.num_heads = HEADS, cfg.num_kv_heads = KVH;
    cfg.rope.style = MHA_ROPE_HALF;
    mha_weights w;
    memset(&w, 0, sizeof w);
    w.w_q = wbuf, w.w_k = wbuf + E * E, w.w_v = wbuf + E * E + E * E / 2;
    w.w_o = wbuf + 2 * E * E;
    mha_error err;
    CHECK_OK(mha_layer_create(&cfg, &w, MHA_WEIGHTS_COPY, NULL, &f->layer, &err), &err);
}

/* Forward (with probabilities), training forward + backward, and 4 decode steps after an
 * 8-token prefill: every output into one buffer, compared bit for bit across execs. */
static size_t run_all(fixture *f, const mha_exec *ex, float *out, mha_error *err) {
    size_t n = 0;
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.batch = B, a.q_len = L, a.query = f->x, a.out = out + n, a.probs = out + n + B * L * E;
    a.mask.causal = 1;
    if (mha_layer_forward(f->layer, &a, ex, err) != MHA_STATUS_OK)
        return 0;
    n += B * L * E + B * HEADS * L * L;
    a.probs = NULL;
    a.out = out + n; /* the caller's buffer: callers sharing f run at once */
    n += B * L * E;
    mha_train_state *st = NULL;
    if (mha_layer_forward_train(f->layer, &a, ex, &st, err) != MHA_STATUS_OK)
        return 0;
    mha_layer_grads g;
    memset(&g, 0, sizeof g);
    g.d_query = out + n, g.dw_q = out + n + B * L * E;
    mha_status s = mha_layer_backward(f->layer, st, f->dy, &g, ex, err);
    mha_train_state_destroy(st);
    if (s != MHA_STATUS_OK)
        return 0;
    n += B * L * E + E * E;
    mha_kv_cache_config kc;
    memset(&kc, 0, sizeof kc);
    kc.batch = B, kc.max_seq = 16;
    mha_kv_cache *cache = NULL;
    if (mha_kv_cache_create(&kc, f->layer, NULL, &cache, err) != MHA_STATUS_OK)
        return 0;
    mha_decode_args d;
    memset(&d, 0, sizeof d);
    d.num_seqs = B, d.num_tokens = 8, d.x = f->x, d.out = out + n;
    s = mha_layer_prefill(f->layer, cache, &d, ex, err);
    n += B * 8 * E;
    for (int t = 0; t < 4 && s == MHA_STATUS_OK; t++) {
        d.num_tokens = 1, d.x = f->x + (8 + t) * E, d.out = out + n;
        s = mha_layer_decode_step(f->layer, cache, &d, ex, err);
        n += B * E;
    }
    mha_kv_cache_destroy(cache);
    return s == MHA_STATUS_OK ? n : 0;
}

#define OUT_FLOATS (5 * B * L * E + B * HEADS * L * L + E * E + B * 12 * E)

static void test_reuse(fixture *f, mha_threadpool *pool) {
    static float want[OUT_FLOATS], got[OUT_FLOATS];
    mha_error err;
    const mha_exec one = {MHA_IMPL_AUTO, 1, NULL, 0, NULL, NULL};
    const size_t n = run_all(f, &one, want, &err);
    CHECK(n > 0 && n <= OUT_FLOATS, "one thread: %s", err.message);
    const int calls = test_quick() ? 20 : 200;
    int same = 1, ok = 1;
    for (int c = 0; c < calls; c++) {
        /* 0 = the pool's size; 2 = within it; 9 = more than the pool has (uses its 2). */
        const int32_t asked[3] = {0, 2, 9};
        mha_exec ex = {
            c % 3 == 1 ? MHA_IMPL_FAST : MHA_IMPL_AUTO, asked[c % 3], NULL, 0, NULL, pool};
        memset(got, 0xff, sizeof got);
        ok &= run_all(f, &ex, got, &err) == n;
        same &= memcmp(want, got, n * sizeof(float)) == 0;
    }
    CHECK(ok && same, "%d calls on one pool: bit-identical to one thread (%s)", calls,
          ok ? "ok" : err.message);
    const mha_exec two = {MHA_IMPL_AUTO, 2, NULL, 0, NULL, NULL};
    CHECK(run_all(f, &two, got, &err) == n && memcmp(want, got, n * sizeof(float)) == 0,
          "two threads without a pool differ");
    mha_exec neg = {MHA_IMPL_AUTO, -1, NULL, 0, NULL, pool};
    CHECK(run_all(f, &neg, got, &err) == 0 && err.status == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "n_threads"),
          "negative n_threads with a pool: %s", err.message);
    neg.pool = NULL;
    CHECK(run_all(f, &neg, got, &err) == 0 && err.status == MHA_STATUS_INVALID_ARG,
          "negative n_threads without a pool: %s", err.message);
}

/* With a workspace and a pool, a layer forward and an attention core call allocate nothing. */
static void test_no_allocation(fixture *f, mha_threadpool *pool) {
    counting c = {0, 0};
    mha_allocator al = {&c, count_alloc, count_free};
    mha_exec ex = {MHA_IMPL_AUTO, 0, NULL, 0, &al, pool};
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.batch = B, a.q_len = L, a.query = f->x, a.out = f->y, a.probs = f->p;
    a.mask.causal = 1;
    mha_error err;
    size_t bytes = 0;
    CHECK_OK(mha_layer_forward_workspace_size(f->layer, &a, &ex, &bytes, &err), &err);
    void *ws = malloc(bytes);
    ex.workspace = ws, ex.workspace_bytes = bytes;
    for (int i = 0; i < 5; i++)
        CHECK_OK(mha_layer_forward(f->layer, &a, &ex, &err), &err);
    CHECK(c.allocs == 0, "a forward with workspace and pool allocated %d times", c.allocs);
    free(ws);
}

typedef struct shared_job {
    fixture *f;
    mha_threadpool *pool;
    const float *want;
    size_t n;
    int same;
} shared_job;

static void *shared_main(void *arg) {
    shared_job *j = arg;
    float *got = malloc(sizeof(float) * OUT_FLOATS);
    mha_exec ex = {MHA_IMPL_AUTO, 0, NULL, 0, NULL, j->pool};
    mha_error err;
    j->same = 1;
    for (int r = 0; r < (test_quick() ? 2 : 5); r++)
        j->same &= run_all(j->f, &ex, got, &err) == j->n && memcmp(j->want, got, j->n * 4) == 0;
    free(got);
    return NULL;
}

static void test_shared(fixture *f, mha_threadpool *pool) {
    float *want = malloc(sizeof(float) * OUT_FLOATS);
    mha_error err;
    const mha_exec one = {MHA_IMPL_AUTO, 1, NULL, 0, NULL, NULL};
    const size_t n = run_all(f, &one, want, &err);
    shared_job jobs[4];
    pthread_t tid[4];
    for (int t = 0; t < 4; t++) {
        jobs[t] = (shared_job){f, pool, want, n, 0};
        pthread_create(&tid[t], NULL, shared_main, &jobs[t]);
    }
    for (int t = 0; t < 4; t++) {
        pthread_join(tid[t], NULL);
        CHECK(jobs[t].same, "caller thread %d sharing the pool: results differ", t);
    }
    free(want);
}

/* Section 6: `size` threads, calls at the pauses of `pause_us` (0: back to back). */
static void test_wait_paths(fixture *f, int32_t size) {
    static float want[OUT_FLOATS], got[OUT_FLOATS];
    mha_error err;
    const mha_exec one = {MHA_IMPL_AUTO, 1, NULL, 0, NULL, NULL};
    const size_t n = run_all(f, &one, want, &err);
    const long pause_us[] = {0, 0, 300, 0, 2000, 1, 300};
    for (int rep = 0; rep < (test_quick() ? 1 : 3); rep++) {
        mha_threadpool *pool = NULL;
        CHECK_OK(mha_threadpool_create(size, NULL, &pool, &err), &err);
        for (size_t c = 0; c < sizeof pause_us / sizeof pause_us[0]; c++) {
            const struct timespec ts = {0, pause_us[c] * 1000};
            nanosleep(&ts, NULL);
            /* every other call with 2 threads: with size > 2, workers without a part */
            const mha_exec ex = {MHA_IMPL_AUTO, c % 2 ? 2 : 0, NULL, 0, NULL, pool};
            memset(got, 0xff, sizeof got);
            CHECK(run_all(f, &ex, got, &err) == n && memcmp(want, got, n * sizeof(float)) == 0,
                  "pool of %d, call %zu after %ld us: differs from one thread", (int)size, c,
                  pause_us[c]);
        }
        mha_threadpool_destroy(pool); /* right after a call: the workers may still poll */
    }
}

int main(void) {
    test_arguments();
    test_absurd_threads();
    float *wbuf = malloc(sizeof(float) * 4 * E * E);
    fixture *f = calloc(1, sizeof *f);
    fixture_init(f, wbuf);
    mha_threadpool *pool = NULL;
    mha_error err;
    CHECK_OK(mha_threadpool_create(2, NULL, &pool, &err), &err);
    test_reuse(f, pool);
    test_no_allocation(f, pool);
    test_shared(f, pool);
    mha_threadpool_destroy(pool);
    test_wait_paths(f, 2);
    test_wait_paths(f, mha_default_threads() + 1); /* more threads than CPUs: never polls */
    test_wait_paths(f, 3);
    mha_layer_destroy(f->layer);
    free(f);
    free(wbuf);
    return test_finish();
}
