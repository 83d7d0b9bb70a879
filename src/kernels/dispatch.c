/* SPDX-License-Identifier: MIT */
/* dispatch.c: selection of the attention forward's kernel from the registry
 * (kernels/registry.def, op fwd), with its debug override MHA_KERNEL (cpu_features.h), and the
 * threaded driver that cuts a problem into work units and hands them to threads.
 */
#include "kernels/flash_fwd.h"
#include "kernels/registry.h"

#include <stdlib.h>
#include <string.h>

/* The reference as a registry entry: one unit is whole heads [h0, h1) of batch row b. */
void mha_fwd_f32_naive__ref(const mha__kernel_info *k,
                            const mha__problem *p,
                            const mha__fwd_unit *u,
                            void *scratch) {
    (void)k;
    MHA_ASSERT(u->i0 == 0 && u->i1 == p->n);
    mha__attention_ref(p, u->b * p->H + u->h0, u->b * p->H + u->h1, scratch);
}

/* ---------------------------------------------------------------------------------------------- */
/* Selection.                                                                                     */
/* ---------------------------------------------------------------------------------------------- */

void mha__fwd_shape_from_args(const mha_attention_args *a, mha__fwd_shape *s) {
    /* Unvalidated: clamp to >= 1 so sizes stay meaningful; validation reports the real error. */
    const int64_t H = a->num_heads > 0 ? a->num_heads : 1;
    const int64_t G = a->num_kv_heads > 0 ? a->num_kv_heads : H;
    s->H = H;
    s->G = G;
    s->group = (G <= H && H % G == 0) ? H / G : 1;
    s->n = a->q_len > 0 ? a->q_len : 1;
    s->m = a->kv_len > 0 ? a->kv_len : 1;
    s->dk = a->head_dim > 0 ? a->head_dim : 1;
    s->dv = a->v_head_dim > 0 ? a->v_head_dim : s->dk;
    s->q_dt = a->q_dtype;
    s->k_dt = a->k_dtype;
    s->v_dt = a->v_dtype;
    /* as check/attention.c resolves it (capped; negative is refused there) */
    s->chunk = a->mask.chunk_size > 0 ? a->mask.chunk_size : 0;
    s->causal = a->mask.causal != 0;
}

mha_status mha__kernel_check(const mha__kernel_info *k, const mha__fwd_shape *s, mha_error *err) {
    if (k->op != MHA__OP_fwd)
        return mha__fail(err, MHA_STATUS_UNSUPPORTED,
                         "kernel %s is not an attention forward kernel", k->name);
    if (!mha__kernel_usable(k, 0))
        return mha__fail(err, MHA_STATUS_UNSUPPORTED,
                         "kernel %s needs the %s instruction set, which this CPU %s", k->name,
                         mha__kernel_tier(k),
                         mha__kernel_usable(k, 1) ? "has but MHA_MAX_ISA caps" : "does not have");
    if (!(mha__dts_bit(s->q_dt) & k->dtypes) || !(mha__dts_bit(s->k_dt) & k->dtypes) ||
        !(mha__dts_bit(s->v_dt) & k->dtypes))
        return mha__fail(err, MHA_STATUS_UNSUPPORTED, "q/k/v dtypes %s/%s/%s: kernel %s takes %s",
                         mha__dts_name(mha__dts_bit(s->q_dt)), mha__dts_name(mha__dts_bit(s->k_dt)),
                         mha__dts_name(mha__dts_bit(s->v_dt)), k->name, mha__dts_name(k->dtypes));
    if (k->max_d && (s->dk > k->max_d || s->dv > k->max_d))
        return mha__fail(err, MHA_STATUS_UNSUPPORTED,
                         "head_dim=%lld, v_head_dim=%lld: kernel %s takes head sizes up to %lld",
                         (long long)s->dk, (long long)s->dv, k->name, (long long)k->max_d);
    size_t bytes;
    if (!mha__kernel_scratch_bytes(k, s, &bytes))
        return mha__fail(err, MHA_STATUS_OVERFLOW, "kernel %s: scratch size overflows", k->name);
    return MHA_STATUS_OK;
}

mha_status mha__kernel_select(const mha__fwd_shape *s,
                              mha_impl impl,
                              const mha__kernel_info **out,
                              mha_error *err) {
    const char *forced_name = mha__cpu_forced_kernel();
    if (forced_name) {
        const mha__kernel_info *forced = mha__registry_find(forced_name);
        if (forced && forced->op == MHA__OP_fwd) {
            *out = forced;
            mha_status st = mha__kernel_check(forced, s, err);
            if (st && err) {
                char msg[MHA_ERROR_MESSAGE_SIZE];
                memcpy(msg, err->message, sizeof msg);
                mha__fail(err, st, "MHA_KERNEL=%s: %.400s", forced_name, msg);
            }
            return st;
        }
        return mha__fail(err, MHA_STATUS_UNSUPPORTED,
                         "MHA_KERNEL=%.100s is not a forward kernel of this build (`mha info` "
                         "lists them)",
                         forced_name);
    }
    mha_status last = MHA_STATUS_UNSUPPORTED;
    for (int i = 0; i < mha__registry_count(); i++) {
        const mha__kernel_info *k = mha__registry_at(i);
        if (k->op != MHA__OP_fwd)
            continue;
        if (k->reference) {
            if (impl == MHA_IMPL_AUTO) {
                *out = k;
                return MHA_STATUS_OK;
            }
            continue;
        }
        if (!mha__kernel_preferred(k))
            continue;
        last = mha__kernel_check(k, s, err);
        if (last == MHA_STATUS_OK) {
            *out = k;
            return MHA_STATUS_OK;
        }
    }
    /* impl=fast and no fast kernel takes the problem: the last check's message names why. */
    if (err && last != MHA_STATUS_UNSUPPORTED) /* e.g. OVERFLOW */
        return last;
    if (err) {
        char msg[MHA_ERROR_MESSAGE_SIZE];
        memcpy(msg, err->message, sizeof msg);
        return mha__fail(err, MHA_STATUS_UNSUPPORTED,
                         "impl=fast: no fast kernel runs this problem (%.400s); use impl=auto or "
                         "reference",
                         msg);
    }
    return MHA_STATUS_UNSUPPORTED;
}

bool mha__kernel_scratch_bytes(const mha__kernel_info *k, const mha__fwd_shape *s, size_t *bytes) {
    if (k->reference) /* the row's scores, one block sum of O and O (attention_ref.c) */
        return s->dv <= (INT64_MAX - s->m) / 2 &&
               mha__bytes(s->m + 2 * s->dv, sizeof(float), bytes);
    return mha__flash_scratch_bytes(k->bq, k->bk, s->dk, s->dv, s->m,
                                    mha__flash_key_span(s->m, s->chunk, s->causal),
                                    s->k_dt != MHA_DTYPE_F32, bytes);
}

/* ---------------------------------------------------------------------------------------------- */
/* Work units and threads.                                                                        */
/* ---------------------------------------------------------------------------------------------- */

/* Units in order b, kv group, head block, query block (consecutive units share K/V in cache).
 * With averaged probabilities one unit takes every head of its query block, so that each
 * element of the [B, n, m] map is summed by one thread, over heads in order. */
typedef struct unit_space {
    const mha__kernel_info *k;
    const mha__problem *p;
    int64_t hpb, nq;     /* heads per block, query rows per block */
    int64_t head_blocks; /* per batch row: G * ceil(group / hpb), or 1 */
    int64_t q_blocks;    /* ceil(n / nq) */
    int64_t count;
    int averaged;
    char *scratch;
    size_t scratch_stride;
    int parts;
    double total;
} unit_space;

static void unit_at(const unit_space *us, int64_t u, mha__fwd_unit *out) {
    const mha__problem *p = us->p;
    const int64_t qb = u % us->q_blocks, hb = (u / us->q_blocks) % us->head_blocks;
    out->b = u / (us->q_blocks * us->head_blocks);
    out->fresh = 0;
    out->i0 = qb * us->nq;
    out->i1 = out->i0 + us->nq < p->n ? out->i0 + us->nq : p->n;
    if (us->averaged) {
        out->h0 = 0;
        out->h1 = p->H;
        return;
    }
    const int64_t per_group = (p->group + us->hpb - 1) / us->hpb;
    const int64_t g = hb / per_group, c = hb % per_group;
    out->h0 = g * p->group + c * us->hpb;
    out->h1 = out->h0 + us->hpb < (g + 1) * p->group ? out->h0 + us->hpb : (g + 1) * p->group;
}

/* Relative cost of a unit: rows x key tiles visited (+1 tile of per-row overhead). */
static double unit_cost(const unit_space *us, const mha__fwd_unit *u) {
    const double rows = (double)(u->h1 - u->h0) * (double)(u->i1 - u->i0);
    if (us->k->reference)
        return rows * (double)us->p->m;
    return rows *
           (double)(mha__flash_visible_tiles(us->p, u->b, u->h0, u->h1, u->i0, u->i1, us->k->bk) +
                    1);
}

/* Part t runs the units whose cost midpoint falls in its share [t/T, (t+1)/T) of the total:
 * contiguous ranges with balanced cost (causal blocks late in the sequence cost more). */
static void run_part(void *ctx, int part, int64_t begin, int64_t end) {
    const unit_space *us = ctx;
    (void)begin, (void)end;
    void *scratch = us->scratch + (size_t)part * us->scratch_stride;
    double prefix = 0.0;
    int fresh = 1;
    for (int64_t u = 0; u < us->count; u++) {
        mha__fwd_unit unit;
        unit_at(us, u, &unit);
        const double c = unit_cost(us, &unit);
        int owner = (int)((prefix + 0.5 * c) / us->total * (double)us->parts);
        if (owner >= us->parts)
            owner = us->parts - 1;
        prefix += c;
        if (owner == part) {
            unit.fresh = fresh;
            fresh = 0;
            us->k->run.fwd(us->k, us->p, &unit, scratch);
        } else if (owner > part) {
            break;
        }
    }
}

mha_status mha__kernel_run(const mha__kernel_info *k,
                           const mha__problem *p,
                           mha__team team,
                           char *scratch,
                           size_t scratch_stride,
                           mha_error *err) {
    unit_space us;
    memset(&us, 0, sizeof us);
    us.k = k;
    us.p = p;
    us.averaged = p->probs && p->average_probs;
    if (k->reference) {
        us.hpb = 1;
        us.nq = p->n;
        us.head_blocks = us.averaged ? 1 : p->H;
    } else {
        us.hpb = mha__flash_heads_per_block(k->bq, p->group);
        us.nq = mha__flash_rows_per_block(k->bq, p->group);
        us.head_blocks = us.averaged ? 1 : p->G * ((p->group + us.hpb - 1) / us.hpb);
    }
    us.q_blocks = (p->n + us.nq - 1) / us.nq;
    us.count = p->B * us.head_blocks * us.q_blocks;
    us.scratch = scratch;
    us.scratch_stride = scratch_stride;
    team = mha__team_at_most(team, us.count);
    us.parts = team.n;
    for (int64_t u = 0; u < us.count; u++) {
        mha__fwd_unit unit;
        unit_at(&us, u, &unit);
        us.total += unit_cost(&us, &unit);
    }
    if (us.parts <= 1) {
        us.parts = 1;
        for (int64_t u = 0; u < us.count; u++) {
            mha__fwd_unit unit;
            unit_at(&us, u, &unit);
            unit.fresh = u == 0;
            k->run.fwd(k, p, &unit, scratch);
        }
        return MHA_STATUS_OK;
    }
    return mha__parallel_for(team, us.parts, run_part, &us, err);
}
