/* SPDX-License-Identifier: MIT */
/* attention.c: the public attention core. Validates mha_attention_args once into an
 * mha__problem, sizes the workspace, picks the implementation and splits the work over threads.
 * Implementations: "reference" (src/kernels/ref/attention_ref.c) and the fast kernels (dispatch.c).
 */
#include "base/internal.h"
#include "check/check.h"
#include "core/core.h"
#include "core/mask_map.h"
#include "kernels/registry.h"

#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------- */
/* Implementation selection and running (kernels: dispatch.c, kernels/registry.def).            */
/* ---------------------------------------------------------------------------------------------- */

/* Workspace layout: [deltas: B int64][slopes: H float][block mask, when the kernel reads one]
 * [per-thread kernel scratch]. */
typedef struct ws_layout {
    size_t delta_off, slope_off, map_off, scratch_off, scratch_stride, total;
} ws_layout;

static mha_status core_layout(const mha_attention_args *a,
                              int n_threads,
                              size_t map,
                              size_t scratch,
                              ws_layout *l,
                              mha_error *err) {
    size_t deltas, slopes;
    MHA_RETURN_IF(!mha__bytes(a->batch, sizeof(int64_t), &deltas) ||
                      !mha__bytes(a->num_heads, sizeof(float), &slopes) ||
                      scratch > SIZE_MAX - 64 || map > SIZE_MAX / 4,
                  err, OVERFLOW, "workspace size overflows");
    l->delta_off = 0;
    l->slope_off = mha__align64(deltas);
    l->map_off = l->slope_off + mha__align64(slopes);
    l->scratch_off = l->map_off + mha__align64(map);
    l->scratch_stride = mha__align64(scratch);
    int64_t total;
    MHA_RETURN_IF(l->scratch_stride > INT64_MAX || l->scratch_off > INT64_MAX ||
                      !mha__mul_i64((int64_t)l->scratch_stride, n_threads, &total) ||
                      !mha__add_i64(total, (int64_t)l->scratch_off, &total),
                  err, OVERFLOW, "workspace size overflows");
    l->total = (size_t)total;
    return MHA_STATUS_OK;
}

/* Bytes of the block mask kernel k reads for args (the reference reads the masks themselves). */
static mha_status core_map_bytes(const mha_attention_args *a,
                                 const mha__kernel_info *k,
                                 size_t *bytes,
                                 mha_error *err) {
    *bytes = 0;
    MHA_RETURN_IF(!k->reference && !mha__mask_map_bytes(a, bytes), err, OVERFLOW,
                  "block mask size overflows");
    return MHA_STATUS_OK;
}

static mha_status check_dims_for_layout(const mha_attention_args *a, mha_error *err) {
    MHA_RETURN_IF(!a, err, INVALID_ARG, "args is NULL");
    return mha__check_attention_sizes(a, err);
}

/* The kernel that runs (args, exec): `forced` if given (it must be able to run the problem),
 * else by exec->impl: REFERENCE -> the reference; FAST -> the first fast kernel that takes the
 * problem, or UNSUPPORTED naming the option (never a silent fallback); AUTO -> the first fast
 * kernel that takes it, else the reference. MHA_KERNEL=<name> overrides AUTO and FAST. */
static mha_status choose_kernel(const mha_attention_args *a,
                                const mha_exec *exec,
                                const mha__kernel_info *forced,
                                const mha__kernel_info **k,
                                size_t *scratch,
                                mha_error *err) {
    mha__fwd_shape shape;
    mha__fwd_shape_from_args(a, &shape);
    mha_status st;
    if (forced) {
        *k = forced;
        st = mha__kernel_check(forced, &shape, err);
    } else {
        const mha_impl impl = exec ? exec->impl : MHA_IMPL_AUTO;
        switch (impl) {
        case MHA_IMPL_REFERENCE:
            *k = mha__registry_reference(MHA__OP_fwd);
            st = MHA_STATUS_OK;
            break;
        case MHA_IMPL_AUTO:
        case MHA_IMPL_FAST:
            st = mha__kernel_select(&shape, impl, k, err);
            break;
        default:
            return mha__fail(err, MHA_STATUS_INVALID_ARG,
                             "exec.impl=%d is not a known implementation", (int)impl);
        }
    }
    if (st)
        return st;
    MHA_RETURN_IF(!mha__kernel_scratch_bytes(*k, &shape, scratch), err, OVERFLOW,
                  "kernel scratch size overflows");
    return MHA_STATUS_OK;
}

/* The call's threads: exec's; with n_threads = 0 (the library's choice) no more than the flops
 * keep busy, 2 B h n m (d_k + d_v) (masks not counted): a tiny call runs on the caller's thread
 * instead of waking the pool. Results do not depend on the thread count. */
static mha_status
core_team(const mha_attention_args *a, const mha_exec *exec, mha__team *team, mha_error *err) {
    mha_status st = mha__exec_team(exec, team, err);
    if (st || (exec && exec->n_threads != 0))
        return st;
    const double dv = (double)(a->v_head_dim ? a->v_head_dim : a->head_dim);
    *team = mha__team_for_flops(*team, 2.0 * (double)a->batch * (double)a->num_heads *
                                           (double)a->q_len * (double)a->kv_len *
                                           ((double)a->head_dim + dv));
    return st;
}

mha_status mha__attention_workspace(const mha_attention_args *args,
                                    const mha_exec *exec,
                                    const mha__kernel_info *forced,
                                    size_t *bytes,
                                    mha_error *err) {
    MHA_RETURN_IF(!bytes, err, INVALID_ARG, "bytes is NULL");
    mha_status st = check_dims_for_layout(args, err);
    if (st)
        return st;
    const mha__kernel_info *k;
    size_t scratch;
    st = choose_kernel(args, exec, forced, &k, &scratch, err);
    if (st)
        return st;
    mha__team team;
    st = core_team(args, exec, &team, err);
    if (st)
        return st;
    size_t map;
    ws_layout l;
    st = core_map_bytes(args, k, &map, err);
    if (!st)
        st = core_layout(args, team.n, map, scratch, &l, err);
    if (st)
        return st;
    MHA_RETURN_IF(!mha__workspace_bytes(l.total, bytes), err, OVERFLOW, "workspace size overflows");
    mha__ok(err);
    return MHA_STATUS_OK;
}

mha_status mha_attention_workspace_size(const mha_attention_args *args,
                                        const mha_exec *exec,
                                        size_t *bytes,
                                        mha_error *err) {
    return mha__attention_workspace(args, exec, NULL, bytes, err);
}

/* mha_attention_supported: every check of mha_attention, nothing run; the validation's scratch
 * (B int64 and, at the next 64-byte boundary, H floats) comes from exec->allocator. */
static mha_status attention_check(const mha_attention_args *args,
                                  const mha_exec *exec,
                                  int placeholders,
                                  mha_error *err) {
    mha_status st = check_dims_for_layout(args, err);
    if (st)
        return st;
    /* Validation resolves the per-batch causal offsets and the ALiBi slopes, which need room:
     * deltas [B] int64 at 0, slopes [H] float at mha__align64(8 B) -- the core workspace's layout.
     */
    const mha_allocator *alloc = exec ? exec->allocator : NULL;
    const size_t slope_off = mha__align64(sizeof(int64_t) * (size_t)args->batch);
    char *scratch = mha__alloc(alloc, slope_off + sizeof(float) * (size_t)args->num_heads);
    mha__problem p;
    if (!scratch)
        st = mha__fail(err, MHA_STATUS_NO_MEMORY, "cannot allocate validation scratch");
    else if (placeholders)
        st = mha__check_attention_layout(args, &p, (int64_t *)scratch,
                                         (float *)((char *)scratch + slope_off), err);
    else
        st = mha__check_attention(args, &p, (int64_t *)scratch,
                                  (float *)((char *)scratch + slope_off), err);
    mha__free(alloc, scratch);
    if (st == MHA_STATUS_OK) {
        /* Then the implementation: impl=fast says here which option it cannot do. */
        const mha__kernel_info *k;
        size_t kernel_scratch;
        st = choose_kernel(args, exec, NULL, &k, &kernel_scratch, err);
    }
    if (st == MHA_STATUS_OK)
        mha__ok(err);
    return st;
}

mha_status
mha_attention_supported(const mha_attention_args *args, const mha_exec *exec, mha_error *err) {
    return attention_check(args, exec, 0, err);
}

mha_status mha__attention_supported_layout(const mha_attention_args *args,
                                           const mha_exec *exec,
                                           mha_error *err) {
    return attention_check(args, exec, 1, err);
}

mha_status mha__core_prepare(const mha_attention_args *args,
                             const mha_exec *exec,
                             const mha__kernel_info *forced,
                             const mha_block_mask *built,
                             mha__core_call *call,
                             mha_error *err) {
    memset(call, 0, sizeof *call);
    mha_status st = check_dims_for_layout(args, err);
    if (st)
        return st;
    size_t scratch;
    st = choose_kernel(args, exec, forced, &call->k, &scratch, err);
    if (st)
        return st;
    st = core_team(args, exec, &call->team, err);
    if (st)
        return st;
    call->alloc = exec ? exec->allocator : NULL;
    size_t map;
    ws_layout l;
    st = core_map_bytes(args, call->k, &map, err);
    if (!st)
        st = core_layout(args, call->team.n, built ? 0 : map, scratch, &l, err);
    if (st)
        return st;
    char *ws;
    st = mha__workspace_take(exec, l.total, "this attention call", &ws, &call->owned, err);
    if (st)
        return st;
    st = mha__check_attention(args, &call->p, (int64_t *)(ws + l.delta_off),
                              (float *)(ws + l.slope_off), err);
    if (!st && map && built)
        st = mha__block_mask_use(built, args, &call->p, err);
    else if (!st && map)
        st = mha__mask_map_build(&call->p, ws + l.map_off, call->team, err);
    call->scratch = ws + l.scratch_off;
    call->stride = l.scratch_stride;
    if (st)
        mha__core_finish(call, 0, NULL);
    return st;
}

mha_status mha__core_finish(mha__core_call *call, int run, mha_error *err) {
    /* Work units, their split over threads and the bit-identical-for-any-thread-count
     * guarantee: mha__kernel_run (dispatch.c). */
    mha_status st = MHA_STATUS_OK;
    if (run)
        st = mha__kernel_run(call->k, &call->p, call->team, call->scratch, call->stride, err);
    mha__free(call->alloc, call->owned);
    call->owned = NULL;
    if (run && st == MHA_STATUS_OK)
        mha__ok(err);
    return st;
}

/* The core in one step: prepared (with the caller's block mask, if any) and run. */
static mha_status core_run(const mha_attention_args *args,
                           const mha_exec *exec,
                           const mha__kernel_info *forced,
                           const mha_block_mask *built,
                           mha_error *err) {
    mha__core_call call;
    mha_status st = mha__core_prepare(args, exec, forced, built, &call, err);
    return st ? st : mha__core_finish(&call, 1, err);
}

mha_status mha__attention_run(const mha_attention_args *args,
                              const mha_exec *exec,
                              const mha__kernel_info *forced,
                              mha_error *err) {
    return core_run(args, exec, forced, NULL, err);
}

mha_status mha_attention(const mha_attention_args *args, const mha_exec *exec, mha_error *err) {
    return mha__attention_run(args, exec, NULL, err);
}

/* ---------------------------------------------------------------------------------------------- */
/* The block mask's summary.                                                                      */
/* ---------------------------------------------------------------------------------------------- */

/* The sizes checked, exec's threads and the bytes of args' block mask. */
static mha_status masks_sizes(const mha_attention_args *args,
                              const mha_exec *exec,
                              mha__team *team,
                              size_t *map,
                              mha_error *err) {
    mha_status st = check_dims_for_layout(args, err);
    if (!st)
        st = mha__exec_team(exec, team, err);
    MHA_RETURN_IF(!st && !mha__mask_map_bytes(args, map), err, OVERFLOW,
                  "block mask size overflows");
    return st;
}

/* args' masks checked and resolved into p (its deltas and slopes in ws at l's offsets) and, when
 * map_mem is not NULL, its block mask built there. The tensors are not read: NULL ones are
 * replaced by a placeholder for the checks. */
static mha_status masks_only(const mha_attention_args *args,
                             const ws_layout *l,
                             char *ws,
                             void *map_mem,
                             mha__team team,
                             mha__problem *p,
                             mha_error *err) {
    static const float placeholder;
    mha_attention_args a = *args;
    a.q = a.q ? a.q : &placeholder;
    a.k = a.k ? a.k : &placeholder;
    a.v = a.v ? a.v : &placeholder;
    a.out = a.out ? a.out : (float *)&placeholder;
    mha_status st = mha__check_attention_layout(&a, p, (int64_t *)(ws + l->delta_off),
                                                (float *)(ws + l->slope_off), err);
    if (!st && map_mem)
        st = mha__mask_map_build(p, map_mem, team, err);
    return st;
}

/* Counts the classes of p's 64 x 64 tiles (p->map built, or no element rule). */
static void count_tiles(const mha__problem *p, mha_mask_summary *out) {
    for (int64_t b = 0; b < p->B; b++)
        for (int64_t h = 0; h < p->H; h++)
            for (int64_t i0 = 0; i0 < p->n; i0 += 64)
                for (int64_t j0 = 0; j0 < p->m; j0 += 64) {
                    const int64_t i1 = i0 + 64 < p->n ? i0 + 64 : p->n;
                    const int nk = (int)(p->m - j0 < 64 ? p->m - j0 : 64);
                    switch (mha__tile_class(p, b, h, i0, i1, j0, nk)) {
                    case MHA_TILE_HIDDEN:
                        out->tiles_hidden++;
                        break;
                    case MHA_TILE_VISIBLE:
                        out->tiles_visible++;
                        break;
                    default:
                        out->tiles_mixed++;
                    }
                }
}

mha_status mha_attention_mask_summary(const mha_attention_args *args,
                                      const mha_exec *exec,
                                      mha_mask_summary *out,
                                      mha_error *err) {
    MHA_RETURN_IF(!out, err, INVALID_ARG, "out is NULL");
    memset(out, 0, sizeof *out);
    mha__team team;
    size_t map;
    mha_status st = masks_sizes(args, exec, &team, &map, err);
    if (st)
        return st;
    ws_layout l;
    st = core_layout(args, 0, map, 0, &l, err);
    if (st)
        return st;
    const mha_allocator *alloc = exec ? exec->allocator : NULL;
    char *ws = mha__alloc(alloc, l.total ? l.total : 1);
    MHA_RETURN_IF(!ws, err, NO_MEMORY, "cannot allocate %zu bytes for the block mask", l.total);
    mha__problem p;
    st = masks_only(args, &l, ws, map ? ws + l.map_off : NULL, team, &p, err);
    if (!st) {
        count_tiles(&p, out);
        if (p.map) {
            out->map_bytes = (int64_t)map;
            out->map_rows = p.map->word_k;
            out->map_planes = (p.map->plane_b ? p.B : 1) * (p.map->plane_h ? p.H : 1);
        }
        mha__ok(err);
    }
    mha__free(alloc, ws);
    return st;
}

/* ---------------------------------------------------------------------------------------------- */
/* Block masks built once, used by several calls (the forward and the backward of a step).       */
/* ---------------------------------------------------------------------------------------------- */

struct mha_block_mask {
    mha_masking rules; /* the element rules it was built from (the caller's pointers) */
    int64_t B, H, n, m;
    const mha__mask_map *map; /* in mem; NULL: no element rule */
    void *mem;
    mha_allocator allocator;
    int has_allocator;
};

void mha_block_mask_destroy(mha_block_mask *bm) {
    if (!bm)
        return;
    mha_allocator a = bm->allocator;
    const mha_allocator *ap = bm->has_allocator ? &a : NULL;
    mha__free(ap, bm->mem);
    mha__free(ap, bm);
}

/* The rules a block mask holds: everything of mha_masking but the bands (causal, window,
 * alignment), which stay rules of each call. */
static bool same_element_rules(const mha_masking *a, const mha_masking *b) {
    return !memcmp(&a->bool_mask, &b->bool_mask, sizeof a->bool_mask) &&
           (!a->bool_mask.data || a->bool_mask_polarity == b->bool_mask_polarity) &&
           !memcmp(&a->additive_mask, &b->additive_mask, sizeof a->additive_mask) &&
           !memcmp(&a->key_padding, &b->key_padding, sizeof a->key_padding) &&
           a->q_segment_ids == b->q_segment_ids && a->kv_segment_ids == b->kv_segment_ids &&
           a->mask_fn.visible == b->mask_fn.visible && a->mask_fn.classify == b->mask_fn.classify &&
           a->mask_fn.ctx == b->mask_fn.ctx && a->mask_fn.per_batch == b->mask_fn.per_batch &&
           a->mask_fn.per_head == b->mask_fn.per_head;
}

mha_status mha__block_mask_use(const mha_block_mask *bm,
                               const mha_attention_args *args,
                               mha__problem *p,
                               mha_error *err) {
    MHA_RETURN_IF(bm->B != p->B || bm->H != p->H || bm->n != p->n || bm->m != p->m, err,
                  INVALID_ARG,
                  "block mask: built for (B, h, n, m) = (%lld, %lld, %lld, %lld), the call is "
                  "(%lld, %lld, %lld, %lld)",
                  (long long)bm->B, (long long)bm->H, (long long)bm->n, (long long)bm->m,
                  (long long)p->B, (long long)p->H, (long long)p->n, (long long)p->m);
    MHA_RETURN_IF(!same_element_rules(&bm->rules, &args->mask), err, INVALID_ARG,
                  "block mask: built from other masks (bool mask, additive mask, key padding, "
                  "segment ids or mask function) than the call's");
    p->map = bm->map;
    return MHA_STATUS_OK;
}

mha_status mha_block_mask_create(const mha_attention_args *args,
                                 const mha_exec *exec,
                                 mha_block_mask **out,
                                 mha_error *err) {
    MHA_RETURN_IF(!out, err, INVALID_ARG, "out is NULL");
    *out = NULL;
    mha__team team;
    size_t map;
    mha_status st = masks_sizes(args, exec, &team, &map, err);
    if (st)
        return st;
    ws_layout l;
    st = core_layout(args, 0, 0, 0, &l, err); /* deltas and slopes of the check */
    if (st)
        return st;
    const mha_allocator *alloc = exec ? exec->allocator : NULL;
    mha_block_mask *bm = mha__alloc(alloc, sizeof *bm);
    char *tmp = mha__alloc(alloc, l.total ? l.total : 1);
    if (bm) {
        memset(bm, 0, sizeof *bm);
        if (alloc)
            bm->allocator = *alloc, bm->has_allocator = 1;
        bm->mem = map ? mha__alloc(alloc, map) : NULL;
    }
    if (!bm || !tmp || (map && !bm->mem)) {
        mha__free(alloc, tmp);
        mha_block_mask_destroy(bm);
        return mha__fail(err, MHA_STATUS_NO_MEMORY, "cannot allocate %zu bytes of block mask", map);
    }
    mha__problem p;
    st = masks_only(args, &l, tmp, bm->mem, team, &p, err);
    mha__free(alloc, tmp);
    if (st) {
        mha_block_mask_destroy(bm);
        return st;
    }
    bm->rules = args->mask;
    bm->B = p.B, bm->H = p.H, bm->n = p.n, bm->m = p.m;
    bm->map = p.map;
    *out = bm;
    mha__ok(err);
    return MHA_STATUS_OK;
}

mha_status mha_attention_masked(const mha_attention_args *args,
                                const mha_block_mask *mask,
                                const mha_exec *exec,
                                mha_error *err) {
    MHA_RETURN_IF(!mask, err, INVALID_ARG, "mask (the block mask) is NULL");
    return core_run(args, exec, NULL, mask, err);
}
