/* SPDX-License-Identifier: MIT */
/* threads.c: the only file that creates threads. A fork-join over an index range: the range is
 * cut into n contiguous parts, part 0 runs on the calling thread. Parts never share outputs, so
 * results do not depend on the thread count, nor on which thread runs a part.
 *
 * Two ways to run the other parts:
 *   - a caller-owned mha_threadpool: size - 1 workers started once, asleep on a condition
 *     variable between regions. A region publishes (fn, ctx, count, parts) under the pool's lock,
 *     bumps the generation and wakes the workers; worker w runs part w if w < parts, and the last
 *     one to finish wakes the caller. Regions of one pool are serialised by `turn`, so several
 *     callers may share a pool. No allocation and no thread start per region.
 *   - no pool: threads started and joined per region (~20-50 us each here), their records
 *     calloc'ed: the behaviour before pools existed, kept for calls that give none.
 * Nested regions never happen: no part function starts a region of its own.
 */
#include "base/internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct mha_threadpool {
    int size; /* threads in all, the caller's included */
    pthread_t *workers;
    mha_allocator allocator;
    int has_allocator;
    pthread_mutex_t turn; /* held by the caller of the current region */
    pthread_mutex_t lock; /* guards everything below */
    pthread_cond_t wake;  /* workers wait here for a new generation */
    pthread_cond_t done;  /* the caller waits here for pending == 0 */
    uint64_t generation;
    int stop;
    mha__range_fn fn;
    void *ctx;
    int64_t count;
    int parts;
    int pending; /* parts 1 .. parts-1 not yet finished */
};

typedef struct worker_arg {
    mha_threadpool *pool;
    int index; /* 1 .. size-1: the part this worker runs */
} worker_arg;

int mha__default_threads(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (n > 1024 ? 1024 : (int)n);
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

static void *worker_main(void *arg) {
    mha_threadpool *pool = ((worker_arg *)arg)->pool;
    const int index = ((worker_arg *)arg)->index;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool->lock);
    for (;;) {
        while (pool->generation == seen && !pool->stop)
            pthread_cond_wait(&pool->wake, &pool->lock);
        if (pool->stop)
            break;
        seen = pool->generation;
        if (index >= pool->parts)
            continue;
        const mha__range_fn fn = pool->fn;
        void *ctx = pool->ctx;
        int64_t begin, end;
        part_range(pool->count, pool->parts, index, &begin, &end);
        pthread_mutex_unlock(&pool->lock);
        fn(ctx, index, begin, end);
        pthread_mutex_lock(&pool->lock);
        if (--pool->pending == 0)
            pthread_cond_signal(&pool->done);
    }
    pthread_mutex_unlock(&pool->lock);
    return NULL;
}

static void pool_run(mha_threadpool *pool, int parts, int64_t count, mha__range_fn fn, void *ctx) {
    pthread_mutex_lock(&pool->turn);
    pthread_mutex_lock(&pool->lock);
    pool->fn = fn;
    pool->ctx = ctx;
    pool->count = count;
    pool->parts = parts;
    pool->pending = parts - 1;
    pool->generation++;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    int64_t begin, end;
    part_range(count, parts, 0, &begin, &end);
    fn(ctx, 0, begin, end);
    pthread_mutex_lock(&pool->lock);
    while (pool->pending > 0)
        pthread_cond_wait(&pool->done, &pool->lock);
    pthread_mutex_unlock(&pool->lock);
    pthread_mutex_unlock(&pool->turn);
}

/* Stops the first `started` workers and frees the pool. */
static void pool_free(mha_threadpool *pool, int started) {
    pthread_mutex_lock(&pool->lock);
    pool->stop = 1;
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
    MHA_RETURN_IF(n_threads < 0 || n_threads > 1024, err, INVALID_ARG,
                  "n_threads=%d is outside [0, 1024]", (int)n_threads);
    MHA_RETURN_IF(allocator && (!allocator->alloc || !allocator->free), err, INVALID_ARG,
                  "allocator has a NULL alloc or free function");
    const int size = n_threads ? n_threads : mha__default_threads();
    mha_threadpool *pool = mha__alloc(allocator, sizeof *pool);
    MHA_RETURN_IF(!pool, err, NO_MEMORY, "cannot allocate the thread pool");
    memset(pool, 0, sizeof *pool);
    pool->size = size;
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
    const int limit = team->pool ? team->pool->size : 0;
    team->n = asked > 0 ? asked : (limit ? limit : mha__default_threads());
    if (limit && team->n > limit)
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
