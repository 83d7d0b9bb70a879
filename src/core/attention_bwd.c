/* SPDX-License-Identifier: MIT */
/* attention_bwd.c: the public backward of the attention core. Validates the forward description
 * (check/: mha__check_attention, the same checks as the forward) and the gradient buffers,
 * picks the implementation, and runs the work units (b, kv head) on threads.
 *
 * Threads: units are disjoint in their outputs (attention_bwd.h), handed out as contiguous
 * ranges of about equal cost (split_units), so no two threads write the same element and the
 * arithmetic of every element is the same for any thread count (bit-identical results). The sink
 * gradient is the one cross-unit sum: units write per-(b, h) partials, reduced here over b in
 * order. Parallelism is B * G units: a single MQA sequence (B = G = 1) runs on one thread.
 */
#include "kernels/attention_bwd.h"
#include "check/check.h"
#include "core/core.h"
#include "core/mask_map.h"
#include "kernels/flash_fwd.h"
#include "kernels/registry.h"

#include <string.h>

/* The backward kernels are the registry's lines of op bwd (kernels/registry.def), in priority
 * order, the reference last; `index` counts those lines only. */
static const mha__kernel_info *bwd_kernel_at(int index) {
    for (int i = 0; i < mha__registry_count(); i++) {
        const mha__kernel_info *k = mha__registry_at(i);
        if (k->op == MHA__OP_bwd && index-- == 0)
            return k;
    }
    return NULL;
}

const char *mha__bwd_kernel_name(int index) {
    const mha__kernel_info *k = bwd_kernel_at(index);
    return k ? k->name : NULL;
}

int mha__bwd_kernel_usable(int index) {
    const mha__kernel_info *k = bwd_kernel_at(index);
    return k && mha__kernel_usable(k, 0);
}

/* The implementation to run: the reference, the best flash backward for this CPU, or (forced >=
 * 0, tests) that bwd line, refused when the CPU cannot run it. */
static mha_status
choose(const mha_exec *exec, int forced, const mha__kernel_info **k, mha_error *err) {
    const mha_impl impl = exec ? exec->impl : MHA_IMPL_AUTO;
    if (forced >= 0) {
        *k = bwd_kernel_at(forced);
        MHA_RETURN_IF(!*k, err, INVALID_ARG, "backward kernel %d does not exist", forced);
        MHA_RETURN_IF(!mha__kernel_usable(*k, 0), err, UNSUPPORTED,
                      "backward kernel %s needs an instruction set this CPU lacks (or "
                      "MHA_MAX_ISA caps)",
                      (*k)->name);
        return MHA_STATUS_OK;
    }
    if (impl == MHA_IMPL_REFERENCE) {
        *k = mha__registry_reference(MHA__OP_bwd);
        return MHA_STATUS_OK;
    }
    MHA_RETURN_IF(impl != MHA_IMPL_AUTO && impl != MHA_IMPL_FAST, err, INVALID_ARG,
                  "exec.impl=%d is not a known implementation", (int)impl);
    /* The flash backward takes every option the forward has, so FAST never fails here: the
     * first flash line whose ISA this CPU has (the generic one always qualifies). */
    *k = mha__registry_best(MHA__OP_bwd);
    MHA_RETURN_IF(!*k, err, INTERNAL, "no usable backward kernel");
    return MHA_STATUS_OK;
}

/* Workspace: [deltas B int64][slopes H float][sink partials B*H float][block mask, flash only]
 * [team.n scratch]. */
typedef struct bwd_layout {
    size_t delta_off, slope_off, sink_off, map_off, map, scratch_off, stride, total;
} bwd_layout;

/* Everything checkable before any work: fills p (whose deltas/slopes point into `tmp_ws`, or
 * into small private arrays while only sizing), the kernel and the layout. */
static mha_status validate(const mha_attention_args *a,
                           const mha_attention_grads *g,
                           const mha_exec *exec,
                           int forced,
                           mha__team *team,
                           const mha__kernel_info **k,
                           bwd_layout *l,
                           mha_error *err) {
    mha_status st = mha__check_backward_sizes(a, g, err);
    if (st)
        return st;
    st = mha__exec_team(exec, team, err);
    if (st)
        return st;
    if (!exec || exec->n_threads == 0) /* the library's choice: no more than the flops keep busy */
        *team = mha__team_for_flops(
            *team, 2.0 * (double)a->batch * (double)a->num_heads * (double)a->q_len *
                       (double)a->kv_len *
                       (3.0 * (double)a->head_dim +
                        2.0 * (double)(a->v_head_dim ? a->v_head_dim : a->head_dim)));
    st = choose(exec, forced, k, err);
    if (st)
        return st;
    size_t deltas, slopes, sinks, scratch;
    int64_t bh;
    MHA_RETURN_IF(!mha__mul_i64(a->batch, a->num_heads, &bh) ||
                      !mha__bytes(a->batch, sizeof(int64_t), &deltas) ||
                      !mha__bytes(a->num_heads, sizeof(float), &slopes) ||
                      !mha__bytes(bh, sizeof(float), &sinks),
                  err, OVERFLOW, "backward workspace size overflows");
    /* Scratch depends on sizes only (checked above): a throwaway problem with them filled in. */
    mha__problem sz;
    memset(&sz, 0, sizeof sz);
    sz.n = a->q_len;
    sz.m = a->kv_len;
    sz.dk = a->head_dim;
    sz.dv = a->v_head_dim ? a->v_head_dim : sz.dk;
    sz.H = a->num_heads;
    sz.G = a->num_kv_heads ? a->num_kv_heads : sz.H;
    sz.group = sz.H / sz.G;
    const bool ok = (*k)->reference ? mha__attention_bwd_ref_scratch(&sz, &scratch)
                                    : mha__bwd_flash_scratch(&sz, &scratch);
    MHA_RETURN_IF(!ok || scratch > SIZE_MAX / 2, err, OVERFLOW, "backward scratch overflows");
    l->map = 0;
    MHA_RETURN_IF(!(*k)->reference && (!mha__mask_map_bytes(a, &l->map) || l->map > SIZE_MAX / 4),
                  err, OVERFLOW, "block mask size overflows");
    l->delta_off = 0;
    l->slope_off = mha__align64(deltas);
    l->sink_off = l->slope_off + mha__align64(slopes);
    l->map_off = l->sink_off + mha__align64(sinks);
    l->scratch_off = l->map_off + mha__align64(l->map);
    l->stride = mha__align64(scratch);
    int64_t total;
    MHA_RETURN_IF(l->stride > INT64_MAX || l->scratch_off > INT64_MAX ||
                      !mha__mul_i64((int64_t)l->stride, team->n, &total) ||
                      !mha__add_i64(total, (int64_t)l->scratch_off, &total),
                  err, OVERFLOW, "backward workspace size overflows");
    l->total = (size_t)total;
    return MHA_STATUS_OK;
}

mha_status mha_attention_backward_workspace_size(const mha_attention_args *fwd,
                                                 const mha_attention_grads *grads,
                                                 const mha_exec *exec,
                                                 size_t *bytes,
                                                 mha_error *err) {
    MHA_RETURN_IF(!bytes, err, INVALID_ARG, "bytes is NULL");
    const mha__kernel_info *k = NULL;
    bwd_layout l = {0};
    mha__team team;
    mha_status st = validate(fwd, grads, exec, -1, &team, &k, &l, err);
    if (st)
        return st;
    MHA_RETURN_IF(!mha__workspace_bytes(l.total, bytes), err, OVERFLOW, "workspace size overflows");
    mha__ok(err);
    return MHA_STATUS_OK;
}

#define MHA_BWD_MAX_PARTS 1024 /* the largest team (mha_threadpool's limit) */

typedef struct bwd_job {
    const mha__bwd_problem *bp;
    mha__bwd_fn fn;
    char *scratch;
    size_t stride;
    int64_t first[MHA_BWD_MAX_PARTS + 1]; /* part t runs units [first[t], first[t + 1]) */
} bwd_job;

static void run_units(void *ctx, int part, int64_t begin, int64_t end) {
    const bwd_job *job = ctx;
    (void)begin, (void)end;
    void *scratch = job->scratch + (size_t)part * job->stride;
    for (int64_t u = job->first[part]; u < job->first[part + 1]; u++)
        job->fn(job->bp, u / job->bp->p->G, u % job->bp->p->G, scratch);
}

/* The relative cost of unit (b, g): the keys its rows may see (the causal / window band
 * narrowed by the block mask's row spans), plus a fixed 64 keys' worth per row. */
static double unit_cost(const mha__problem *p, int64_t b, int64_t g) {
    const mha__mask_map *mm = p->map;
    double first_head = 0.0, total = 0.0;
    for (int64_t h = g * p->group; h < (g + 1) * p->group; h++) {
        if (h > g * p->group && !(mm && mm->span_h)) { /* the same rows as the first head */
            total += first_head;
            continue;
        }
        double c = 0.0;
        for (int64_t i = 0; i < p->n; i++) {
            int64_t lo, hi, f, l;
            mha__flash_key_range(p, b, i, &lo, &hi);
            if (mm) {
                mha__map_span(mm, b, h, i, &f, &l);
                lo = f > lo ? f : lo;
                hi = l < hi ? l : hi;
            }
            c += 64.0 + (lo <= hi ? (double)(hi - lo + 1) : 0.0);
        }
        first_head = c;
        total += c;
    }
    return total;
}

/* Contiguous ranges of units of about equal cost, one per part (masked units differ: key
 * padding, documents, windows). Which thread runs a unit changes no result. */
static void split_units(const mha__problem *p, int parts, bwd_job *job) {
    const int64_t count = p->B * p->G;
    double all = 0.0, prefix = 0.0;
    for (int64_t u = 0; u < count; u++)
        all += unit_cost(p, u / p->G, u % p->G);
    int t = 0;
    job->first[0] = 0;
    for (int64_t u = 0; u < count; u++) {
        const double c = unit_cost(p, u / p->G, u % p->G);
        /* the unit goes to the part its cost midpoint falls in */
        int owner = all > 0.0 ? (int)((prefix + 0.5 * c) / all * parts) : 0;
        owner = owner >= parts ? parts - 1 : owner;
        while (t < owner)
            job->first[++t] = u;
        prefix += c;
    }
    while (t < parts)
        job->first[++t] = count;
}

/* The backward; kernel >= 0 forces that line; built: the caller's block mask, or NULL. */
static mha_status backward(const mha_attention_args *fwd,
                           const mha_attention_grads *grads,
                           const mha_exec *exec,
                           int kernel,
                           const mha_block_mask *built,
                           const char **name_out,
                           mha_error *err) {
    mha__team team;
    const mha__kernel_info *k = NULL;
    bwd_layout l = {0};
    mha_status st = validate(fwd, grads, exec, kernel, &team, &k, &l, err);
    if (st)
        return st;
    const mha_allocator *alloc = exec ? exec->allocator : NULL;
    char *ws, *owned;
    st = mha__workspace_take(exec, l.total, "this backward", &ws, &owned, err);
    if (st)
        return st;
    mha__problem p;
    st = mha__check_attention(fwd, &p, (int64_t *)(ws + l.delta_off), (float *)(ws + l.slope_off),
                              err);
    if (!st)
        st = mha__check_backward_grads(fwd, grads, &p, err);
    if (!st && l.map && built)
        st = mha__block_mask_use(built, fwd, &p, err);
    else if (!st && l.map)
        st = mha__mask_map_build(&p, ws + l.map_off, team, err);
    if (!st) {
        mha__bwd_problem bp;
        memset(&bp, 0, sizeof bp);
        bp.p = &p;
        bp.dout = grads->dout;
        memcpy(bp.dos, grads->dout_strides, sizeof bp.dos);
        bp.dq = grads->dq;
        bp.dk = grads->dk;
        bp.dv = grads->dv;
        memcpy(bp.dqs, grads->dq_strides, sizeof bp.dqs);
        memcpy(bp.dks, grads->dk_strides, sizeof bp.dks);
        memcpy(bp.dvs, grads->dv_strides, sizeof bp.dvs);
        bp.do_dt = grads->dout_dtype;
        bp.dq_dt = grads->dq_dtype;
        bp.dk_dt = grads->dk_dtype;
        bp.dv_dt = grads->dv_dtype;
        bp.dlse = grads->dlse;
        bp.dprobs = grads->dprobs;
        bp.sink_part = grads->dsinks ? (float *)(ws + l.sink_off) : NULL;
        bp.accumulate = grads->accumulate != 0;
        bwd_job job = {
            .bp = &bp, .fn = k->run.bwd, .scratch = ws + l.scratch_off, .stride = l.stride};
        team = mha__team_at_most(team, p.B * p.G);
        split_units(&p, team.n, &job);
        st = mha__parallel_for(team, team.n, run_units, &job, err);
        if (!st && grads->dsinks)
            for (int64_t h = 0; h < p.H; h++) {
                float s = 0.0f;
                for (int64_t b = 0; b < p.B; b++)
                    s += bp.sink_part[b * p.H + h];
                grads->dsinks[h] = bp.accumulate ? grads->dsinks[h] + s : s;
            }
    }
    mha__free(alloc, owned);
    if (!st) {
        if (name_out)
            *name_out = k->name;
        mha__ok(err);
    }
    return st;
}

mha_status mha__attention_backward_run(const mha_attention_args *fwd,
                                       const mha_attention_grads *grads,
                                       const mha_exec *exec,
                                       int kernel,
                                       const char **name_out,
                                       mha_error *err) {
    return backward(fwd, grads, exec, kernel, NULL, name_out, err);
}

mha_status mha_attention_backward_masked(const mha_attention_args *fwd,
                                         const mha_attention_grads *grads,
                                         const mha_block_mask *mask,
                                         const mha_exec *exec,
                                         mha_error *err) {
    MHA_RETURN_IF(!mask, err, INVALID_ARG, "mask (the block mask) is NULL");
    return backward(fwd, grads, exec, -1, mask, NULL, err);
}

mha_status mha_attention_backward(const mha_attention_args *fwd,
                                  const mha_attention_grads *grads,
                                  const mha_exec *exec,
                                  mha_error *err) {
    return backward(fwd, grads, exec, -1, NULL, NULL, err);
}
