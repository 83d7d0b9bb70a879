/* SPDX-License-Identifier: MIT */
/* threads.c: the only file that creates threads. A plain fork-join over an index range: the
 * range is cut into n contiguous parts, part 0 runs on the calling thread. Parts never share
 * outputs, so results do not depend on the thread count. No pool is kept between calls (no
 * global state); thread start-up costs ~20 us, small next to the work we split. */
#include "internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

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

int mha__default_threads(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : (n > 1024 ? 1024 : (int)n);
}

mha_status
mha__parallel_for(int n_threads, int64_t count, mha__range_fn fn, void *ctx, mha_error *err) {
    if (count <= 0)
        return MHA_STATUS_OK;
    if (n_threads <= 0)
        n_threads = mha__default_threads();
    if ((int64_t)n_threads > count)
        n_threads = (int)count;
    if (n_threads == 1) {
        fn(ctx, 0, 0, count);
        return MHA_STATUS_OK;
    }
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
        /* Even split without forming count * t (which could overflow). */
        const int64_t base = count / n_threads, extra = count % n_threads;
        jobs[t].begin = base * t + (t < extra ? t : extra);
        jobs[t].end = jobs[t].begin + base + (t < extra ? 1 : 0);
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
