/* SPDX-License-Identifier: MIT */
/* threads.c: the only file that creates threads. A fork-join over an index range: the range is
 * cut into n contiguous parts, part 0 runs on the calling thread. Parts never share outputs, so
 * results do not depend on the thread count, nor on which thread runs a part.
 *
 * Two ways to run the other parts:
 *   - a caller-owned mha_threadpool: size - 1 workers started once. A region publishes (fn, ctx,
 *     count) and then stores the atomic `region` word, its serial number and part count
 *     (release); worker w runs part w if w < parts and counts `pending` down; the caller runs
 *     part 0 and waits for pending == 0. A worker that has no part reads nothing but the word:
 *     the next region may rewrite the fields while it looks.
 *     Regions of one pool are serialised by `turn`, so several callers may share a pool. No
 *     allocation and no thread start per region.
 *     Waiting spins first, then sleeps: a worker polls `region` (and the caller `pending`)
 *     for up to MHA__SPIN_NS before it sleeps on a condition variable. A decode step is several
 *     short regions back to back (the q, k, v projections, the attention, the o projection, each
 *     ~0.1-1 ms), and a wake-up through the kernel costs tens of microseconds on these VMs, paid
 *     once per region by a pool that only sleeps. The sleeper counts (`sleeping`,
 *     `caller_sleeping`) tell the other side whether a signal is needed: each side stores its
 *     own flag and then reads the other's (sequentially consistent, so one of the two sees the
 *     other), and a sleeper re-checks its condition under the lock before it waits, so no wake-up
 *     is lost. A pool with more threads than online CPUs never spins (a spinning thread would
 *     take the CPU the one it waits for needs).
 *   - no pool: threads started and joined per region (~20-50 us each here), their records
 *     calloc'ed: the behaviour before pools existed, kept for calls that give none.
 * Nested regions never happen: no part function starts a region of its own.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */

#include "base/internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#    include <immintrin.h>
#    define MHA__CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#    define MHA__CPU_RELAX() __asm__ __volatile__("yield")
#else
#    define MHA__CPU_RELAX() ((void)0)
#endif

/* How long a waiting thread polls before it sleeps. Intel Xeon host, decode steps on 2 threads
 * (docs/performance.md "Thread pool: spin, then sleep"): 20 us gained 12-18% on a quiet host,
 * as much as 100 us (13-25%), but lost only 0-10% where 100 us lost 13-21% when another process
 * kept one core busy (a polling thread uses up its share of the CPU, so the scheduler no longer
 * runs it first when the region arrives). */
#define MHA__SPIN_NS 20000

/* mha_threadpool.region: the part count in the low bits (a pool has at most 1024 threads). */
#define REGION_SHIFT       16
#define REGION_PARTS(word) ((int)((word) & ((1u << REGION_SHIFT) - 1)))

struct mha_threadpool {
    int size; /* threads in all, the caller's included */
    pthread_t *workers;
    mha_allocator allocator;
    int has_allocator;
    int64_t spin_ns;         /* MHA__SPIN_NS, or 0 when size > online CPUs */
    pthread_mutex_t turn;    /* held by the caller of the current region */
    pthread_mutex_t lock;    /* taken to sleep on, and to signal, the two condition variables */
    pthread_cond_t wake;     /* workers wait here for a new region */
    pthread_cond_t done;     /* the caller waits here for pending == 0 */
    _Atomic uint64_t region; /* serial << REGION_SHIFT | parts of the latest region */
    atomic_int stop;
    atomic_int sleeping;        /* workers asleep on `wake` (or about to be) */
    atomic_int caller_sleeping; /* the caller is asleep on `done` (or about to be) */
    /* The region, written before the store of `region`, read (by the workers with a part) after
     * its acquire load. */
    mha__range_fn fn;
    void *ctx;
    int64_t count;
    atomic_int pending; /* parts 1 .. parts-1 not yet finished */
};

typedef struct worker_arg {
    mha_threadpool *pool;
    int index; /* 1 .. size-1: the part this worker runs */
} worker_arg;

int mha__default_threads(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (n > MHA__MAX_THREADS ? MHA__MAX_THREADS : (int)n);
}

int32_t mha_default_threads(void) {
    return mha__default_threads();
}

/* Part t of `parts` over [0, count): an even split, without forming count * t (overflow). */
static void part_range(int64_t count, int parts, int t, int64_t *begin, int64_t *end) {
    const int64_t base = count / parts, extra = count % parts;
    *begin = base * t + (t < extra ? t : extra);
    *end = *begin + base + (t < extra ? 1 : 0);
}

/* ---------------------------------------------------------------------------------------------- */
/* The pool.                                                                                      */
/* ---------------------------------------------------------------------------------------------- */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* What the two sides wait for: a region after `seen` (or stop), and the workers' parts done. */
static int region_moved(mha_threadpool *pool, uint64_t seen) {
    return atomic_load_explicit(&pool->region, memory_order_acquire) != seen ||
           atomic_load_explicit(&pool->stop, memory_order_acquire);
}
static int parts_done(mha_threadpool *pool, uint64_t unused) {
    (void)unused;
    return atomic_load_explicit(&pool->pending, memory_order_acquire) == 0;
}

/* Polls ready(pool, seen) for up to spin_ns (the clock read every 64 polls); whether it held. */
static int poll_for(mha_threadpool *pool, int (*ready)(mha_threadpool *, uint64_t), uint64_t seen) {
    const int64_t until = pool->spin_ns ? now_ns() + pool->spin_ns : 0;
    for (int i = 1; until; i++) {
        if (ready(pool, seen))
            return 1;
        MHA__CPU_RELAX();
        if (i % 64 == 0 && now_ns() > until)
            break;
    }
    return 0;
}

/* A worker's wait for a region after `seen` (or stop): polls, then sleeps. */
static void worker_wait(mha_threadpool *pool, uint64_t seen) {
    if (poll_for(pool, region_moved, seen))
        return;
    pthread_mutex_lock(&pool->lock);
    atomic_fetch_add(&pool->sleeping, 1);
    while (atomic_load(&pool->region) == seen && !atomic_load(&pool->stop))
        pthread_cond_wait(&pool->wake, &pool->lock);
    atomic_fetch_sub(&pool->sleeping, 1);
    pthread_mutex_unlock(&pool->lock);
}

static void *worker_main(void *arg) {
    mha_threadpool *pool = ((worker_arg *)arg)->pool;
    const int index = ((worker_arg *)arg)->index;
    uint64_t seen = 0;
    for (;;) {
        worker_wait(pool, seen);
        if (atomic_load_explicit(&pool->stop, memory_order_acquire))
            break;
        seen = atomic_load_explicit(&pool->region, memory_order_acquire);
        const int parts = REGION_PARTS(seen);
        if (index >= parts)
            continue;
        int64_t begin, end;
        part_range(pool->count, parts, index, &begin, &end);
        pool->fn(pool->ctx, index, begin, end);
        /* The last part done wakes the caller if it sleeps (it re-checks under the lock). */
        if (atomic_fetch_sub(&pool->pending, 1) == 1 && atomic_load(&pool->caller_sleeping)) {
            pthread_mutex_lock(&pool->lock);
            pthread_cond_signal(&pool->done);
            pthread_mutex_unlock(&pool->lock);
        }
    }
    return NULL;
}

/* The caller's wait for pending == 0: polls, then sleeps. */
static void caller_wait(mha_threadpool *pool) {
    if (poll_for(pool, parts_done, 0))
        return;
    pthread_mutex_lock(&pool->lock);
    atomic_store(&pool->caller_sleeping, 1);
    while (atomic_load(&pool->pending) > 0)
        pthread_cond_wait(&pool->done, &pool->lock);
    atomic_store(&pool->caller_sleeping, 0);
    pthread_mutex_unlock(&pool->lock);
}

static void pool_run(mha_threadpool *pool, int parts, int64_t count, mha__range_fn fn, void *ctx) {
    pthread_mutex_lock(&pool->turn);
    pool->fn = fn;
    pool->ctx = ctx;
    pool->count = count;
    atomic_store_explicit(&pool->pending, parts - 1, memory_order_relaxed);
    const uint64_t serial =
        (atomic_load_explicit(&pool->region, memory_order_relaxed) >> REGION_SHIFT) + 1;
    atomic_store(&pool->region, serial << REGION_SHIFT | (uint64_t)parts); /* publishes them */
    if (atomic_load(&pool->sleeping)) {
        pthread_mutex_lock(&pool->lock);
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->lock);
    }
    int64_t begin, end;
    part_range(count, parts, 0, &begin, &end);
    fn(ctx, 0, begin, end);
    caller_wait(pool);
    pthread_mutex_unlock(&pool->turn);
}

/* Stops the first `started` workers and frees the pool. */
static void pool_free(mha_threadpool *pool, int started) {
    pthread_mutex_lock(&pool->lock);
    atomic_store(&pool->stop, 1);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    for (int w = 0; w < started; w++)
        pthread_join(pool->workers[w], NULL);
    pthread_cond_destroy(&pool->done);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->lock);
    pthread_mutex_destroy(&pool->turn);
    const mha_allocator *alloc = pool->has_allocator ? &pool->allocator : NULL;
    mha__free(alloc, pool->workers);
    mha__free(alloc, pool);
}

mha_status mha_threadpool_create(int32_t n_threads,
                                 const mha_allocator *allocator,
                                 mha_threadpool **out,
                                 mha_error *err) {
    MHA_RETURN_IF(!out, err, INVALID_ARG, "out is NULL");
    *out = NULL;
    MHA_RETURN_IF(n_threads < 0 || n_threads > MHA__MAX_THREADS, err, INVALID_ARG,
                  "n_threads=%d is outside [0, %d]", (int)n_threads, MHA__MAX_THREADS);
    MHA_RETURN_IF(allocator && (!allocator->alloc || !allocator->free), err, INVALID_ARG,
                  "allocator has a NULL alloc or free function");
    const int size = n_threads ? n_threads : mha__default_threads();
    mha_threadpool *pool = mha__alloc(allocator, sizeof *pool);
    MHA_RETURN_IF(!pool, err, NO_MEMORY, "cannot allocate the thread pool");
    memset(pool, 0, sizeof *pool);
    atomic_init(&pool->region, 0);
    atomic_init(&pool->stop, 0);
    atomic_init(&pool->sleeping, 0);
    atomic_init(&pool->caller_sleeping, 0);
    atomic_init(&pool->pending, 0);
    pool->size = size;
    pool->spin_ns = size <= mha__default_threads() ? MHA__SPIN_NS : 0;
    pool->has_allocator = allocator != NULL;
    if (allocator)
        pool->allocator = *allocator;
    /* Each worker's argument lives after its pthread_t, in one block. */
    pool->workers = mha__alloc(allocator, (size_t)size * (sizeof(pthread_t) + sizeof(worker_arg)));
    if (!pool->workers) {
        mha__free(allocator, pool);
        return mha__fail(err, MHA_STATUS_NO_MEMORY, "cannot allocate %d thread records", size);
    }
    worker_arg *args = (worker_arg *)(pool->workers + size);
    pthread_mutex_init(&pool->turn, NULL);
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    for (int w = 0; w < size - 1; w++) {
        args[w].pool = pool;
        args[w].index = w + 1;
        if (pthread_create(&pool->workers[w], NULL, worker_main, &args[w]) != 0) {
            pool_free(pool, w);
            return mha__fail(err, MHA_STATUS_NO_MEMORY, "cannot start thread %d of %d", w + 2,
                             size);
        }
    }
    *out = pool;
    mha__ok(err);
    return MHA_STATUS_OK;
}

void mha_threadpool_destroy(mha_threadpool *pool) {
    if (pool)
        pool_free(pool, pool->size - 1);
}

int32_t mha_threadpool_size(const mha_threadpool *pool) {
    return pool ? pool->size : 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* Teams and regions.                                                                             */
/* ---------------------------------------------------------------------------------------------- */

mha_status mha__exec_team(const mha_exec *exec, mha__team *team, mha_error *err) {
    team->pool = exec ? exec->pool : NULL;
    const int32_t asked = exec ? exec->n_threads : 0;
    MHA_RETURN_IF(asked < 0, err, INVALID_ARG, "exec.n_threads=%d is negative", (int)asked);
    /* At most a pool's size, and never more than MHA__MAX_THREADS (a pool's largest size): each
     * thread has its own scratch, so an absurd count would size a workspace by it. */
    const int limit = team->pool ? team->pool->size : MHA__MAX_THREADS;
    team->n = asked > 0 ? asked : (team->pool ? limit : mha__default_threads());
    if (team->n > limit)
        team->n = limit;
    return MHA_STATUS_OK;
}

mha__team mha__team_at_most(mha__team team, int64_t n) {
    if (n < team.n)
        team.n = n < 1 ? 1 : (int)n;
    return team;
}

mha__team mha__team_for_flops(mha__team team, double flops) {
    if (team.n < 1)
        team.n = 1;
    if (flops < (double)MHA__MIN_FLOPS_PER_THREAD * (double)team.n)
        team = mha__team_at_most(team, (int64_t)(flops / (double)MHA__MIN_FLOPS_PER_THREAD));
    return team;
}

typedef struct range_job {
    mha__range_fn fn;
    void *ctx;
    int part;
    int64_t begin, end;
} range_job;

static void *run_job(void *arg) {
    range_job *job = arg;
    job->fn(job->ctx, job->part, job->begin, job->end);
    return NULL;
}

/* Without a pool: start, run, join. */
static mha_status
fork_join(int n_threads, int64_t count, mha__range_fn fn, void *ctx, mha_error *err) {
    range_job *jobs = calloc((size_t)n_threads, sizeof *jobs);
    pthread_t *tids = calloc((size_t)n_threads, sizeof *tids);
    char *started = calloc((size_t)n_threads, 1);
    if (!jobs || !tids || !started) {
        free(jobs);
        free(tids);
        free(started);
        return mha__fail(err, MHA_STATUS_NO_MEMORY, "cannot allocate %d thread records", n_threads);
    }
    for (int t = 0; t < n_threads; t++) {
        jobs[t].fn = fn;
        jobs[t].ctx = ctx;
        jobs[t].part = t;
        part_range(count, n_threads, t, &jobs[t].begin, &jobs[t].end);
    }
    /* A part whose thread cannot start runs on the caller: slower, never wrong. */
    for (int t = 1; t < n_threads; t++)
        started[t] = pthread_create(&tids[t], NULL, run_job, &jobs[t]) == 0;
    run_job(&jobs[0]);
    for (int t = 1; t < n_threads; t++) {
        if (started[t])
            pthread_join(tids[t], NULL);
        else
            run_job(&jobs[t]);
    }
    free(jobs);
    free(tids);
    free(started);
    return MHA_STATUS_OK;
}

mha_status
mha__parallel_for(mha__team team, int64_t count, mha__range_fn fn, void *ctx, mha_error *err) {
    if (count <= 0)
        return MHA_STATUS_OK;
    int n = team.n < 1 ? 1 : team.n;
    if ((int64_t)n > count)
        n = (int)count;
    if (n == 1) {
        fn(ctx, 0, 0, count);
        return MHA_STATUS_OK;
    }
    if (team.pool && n <= team.pool->size) {
        pool_run(team.pool, n, count, fn, ctx);
        return MHA_STATUS_OK;
    }
    return fork_join(n, count, fn, ctx, err);
}
