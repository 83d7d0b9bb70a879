/* SPDX-License-Identifier: MIT */
/* stats.c: mha_attention_statistics, statistics of the attention probabilities P [B, h, n, m]
 * without storing any n x m matrix (docs/SEMANTICS.md, "Attention statistics").
 *
 * Work unit: one (batch, head) pair, its query rows in tiles of TQ rows, in order. Per row tile:
 *   pass 1, over key tiles of TK keys: scores S = q k^T (the projection GEMM, one thread), then
 *           each element through the forward's rule (scale, softcap, additive mask + ALiBi, -inf
 *           where mha__visible hides the key: the helpers of base/internal.h that the reference
 *           core uses), and an online max / sum per row -> lse_i (with the sink term);
 *   pass 2, the same key tiles again: P_ij = exp(s_ij - lse_i) feeds the requested statistics.
 * Only the key range causal/window leave visible to some row of the tile is visited.
 *
 * Determinism: a unit is computed by one thread; inside it every sum is added in increasing row
 * then key order; the GEMM runs on one thread with a fixed blocking. So every output is
 * bit-identical for any thread count. received_total adds the heads' double sums in head order
 * after the parallel part.
 */
#include "base/internal.h"
#include "check/check.h"
#include "core/core.h"
#include "core/mask_map.h"
#include "kernels/flash_fwd.h"
#include "kernels/gemm.h"

#include <string.h>

#define TQ 64  /* query rows per tile */
#define TK 256 /* keys per tile (a score tile is TQ x TK floats, 64 KB) */

/* Per-thread scratch, offsets in bytes from the thread's block. */
typedef struct stats_layout {
    size_t s, gemm, gemm_bytes, max, sum, lse, ent, cnt, cell, heap_p, heap_i, acc, vis, total;
} stats_layout;

typedef struct stats_ctx {
    const mha__problem *p;
    const mha_attention_stats *st;
    int64_t k, R, C;  /* top-k (0 = none), pool grid (0 = none) */
    double *received; /* [B, H, m] column sums, or NULL */
    char *scratch;
    size_t stride;
    stats_layout L;
} stats_ctx;

/* The state of one thread's unit, pointers into its scratch. */
typedef struct unit {
    const stats_ctx *c;
    int64_t b, h;
    float *s;        /* [TQ][TK] scores */
    void *gemm;      /* GEMM packing buffer */
    float *max;      /* [TQ] running max of the row's key scores (pass 1) */
    double *sum;     /* [TQ] running sum of exp(s - max) */
    float *lse;      /* [TQ]; -inf = fully masked row */
    double *ent;     /* [TQ] entropy accumulators */
    int64_t *cnt;    /* [TQ] entries in each row's top-k heap */
    int32_t *cell;   /* [TK] pool column of each key of the tile */
    float *heap_p;   /* [TQ][k] top-k heaps: probabilities */
    int64_t *heap_i; /* [TQ][k] and key indices */
    double *acc;     /* [R][C] pooled sums of P */
    int64_t *vis;    /* [R][C] visible elements */
} unit;

static bool carve(size_t *cursor, int64_t count, size_t elem, size_t *off) {
    size_t bytes;
    if (!mha__bytes(count, elem, &bytes) || bytes > SIZE_MAX / 2 - *cursor)
        return false;
    *off = *cursor;
    *cursor = mha__align64(*cursor + bytes);
    return true;
}

static mha_status stats_layout_for(stats_ctx *c, mha_error *err) {
    const mha__problem *p = c->p;
    stats_layout *L = &c->L;
    mha_status st = mha__gemm_workspace_size(MHA__GEMM_AUTO, TQ, TK, p->dk, &L->gemm_bytes, err);
    if (st)
        return st;
    size_t cur = 0;
    int64_t heap = 0, grid = 0;
    bool ok = mha__mul_i64(TQ, c->k, &heap) && mha__mul_i64(c->R, c->C, &grid);
    ok = ok && carve(&cur, TQ * TK, sizeof(float), &L->s) &&
         carve(&cur, (int64_t)L->gemm_bytes, 1, &L->gemm) &&
         carve(&cur, TQ, sizeof(float), &L->max) && carve(&cur, TQ, sizeof(double), &L->sum) &&
         carve(&cur, TQ, sizeof(float), &L->lse) && carve(&cur, TQ, sizeof(double), &L->ent) &&
         carve(&cur, TQ, sizeof(int64_t), &L->cnt) && carve(&cur, TK, sizeof(int32_t), &L->cell) &&
         carve(&cur, heap, sizeof(float), &L->heap_p) &&
         carve(&cur, heap, sizeof(int64_t), &L->heap_i) &&
         carve(&cur, grid, sizeof(double), &L->acc) && carve(&cur, grid, sizeof(int64_t), &L->vis);
    MHA_RETURN_IF(!ok, err, OVERFLOW, "statistics scratch size overflows");
    L->total = cur;
    return MHA_STATUS_OK;
}

/* Scores of rows [i0, i0 + rows), keys [j0, j0 + nk) into u->s (row stride TK), each through the
 * forward's per-element rule (mha__attention_ref's order: scale, softcap, bias; -inf where a
 * boolean rule hides the key). */
static void score_tile(const unit *u, int64_t i0, int rows, int64_t j0, int nk) {
    const mha__problem *p = u->c->p;
    const int64_t b = u->b, h = u->h;
    /* float32 only (mha__check_attention_stats) */
    const float *q = (const float *)p->q + b * p->qs[0] + h * p->qs[1] + i0 * p->qs[2];
    const float *k = (const float *)p->k + b * p->ks[0] + (h / p->group) * p->ks[1] + j0 * p->ks[2];
    /* One thread, a caller buffer large enough for TQ x TK: this cannot fail. */
    mha_status st =
        mha__gemm_xwt_ws(rows, nk, p->dk, q, p->qs[2], k, p->ks[2], NULL, u->s, TK, mha__team_of(1),
                         MHA__GEMM_AUTO, u->gemm, u->c->L.gemm_bytes, NULL, NULL);
    MHA_ASSERT(st == MHA_STATUS_OK);
    (void)st;
    /* Causal and window as the row's key range (the flash kernels' rule); the other boolean
     * rules and the bias per element only when the problem has them. */
    const mha__mask_map *mm = p->map; /* the element rules, a bit per score */
    const int bias = p->additive.data || p->alibi_slopes;
    for (int r = 0; r < rows; r++) {
        float *s = u->s + (size_t)r * TK;
        const int64_t i = i0 + r;
        const int64_t at = mm ? mha__map_at(mm, b, h, i) : 0;
        int64_t lo, hi;
        mha__flash_key_range(p, b, i, &lo, &hi);
        for (int jj = 0; jj < nk; jj++) {
            const int64_t j = j0 + jj;
            if (j < lo || j > hi ||
                (mm && !((mm->vis[at + (j >> 6) * mm->word_k] >> (j & 63)) & 1))) {
                s[jj] = -INFINITY;
                continue;
            }
            float x = p->scale * s[jj];
            if (p->softcap > 0.0f)
                x = p->softcap * tanhf(x / p->softcap);
            s[jj] = bias ? x + mha__score_bias(p, b, h, i, j) : x;
        }
    }
}

/* Pass 1 step: the online max / sum of one tile's rows (NaN scores do not move the max; they
 * reach the sum and so the row's lse, as in the forward). */
static void lse_step(const unit *u, int rows, int nk) {
    for (int r = 0; r < rows; r++) {
        const float *s = u->s + (size_t)r * TK;
        float tmax = -INFINITY;
        for (int jj = 0; jj < nk; jj++)
            if (s[jj] > tmax)
                tmax = s[jj];
        if (tmax > u->max[r]) {
            u->sum[r] *= exp((double)u->max[r] - (double)tmax);
            u->max[r] = tmax;
        }
        if (u->max[r] == -INFINITY)
            continue;
        double sum = 0.0;
        for (int jj = 0; jj < nk; jj++)
            sum += (double)expf(s[jj] - u->max[r]);
        u->sum[r] += sum;
    }
}

/* lse_r = log(exp(sink_h) + sum_j exp(s_j)) from the running max / sum; -inf for a fully masked
 * row (every key score -inf: zero probabilities, as in the forward, even with a sink). */
static void lse_final(const unit *u, int rows) {
    const mha__problem *p = u->c->p;
    for (int r = 0; r < rows; r++) {
        const double mx = (double)u->max[r];
        if (mx == -(double)INFINITY) {
            u->lse[r] = -INFINITY;
            continue;
        }
        double top = mx, tot = u->sum[r];
        if (p->sinks) {
            const double sink = (double)p->sinks[u->h];
            top = sink > mx ? sink : mx;
            tot = u->sum[r] * exp(mx - top) + exp(sink - top);
        }
        u->lse[r] = (float)(top + log(tot));
    }
}

/* Heap order of the top-k: a is worse than b when its probability is lower, or equal with a
 * higher key index. The heap's root is its worst entry. */
static int worse(float pa, int64_t ia, float pb, int64_t ib) {
    return pa < pb || (pa == pb && ia > ib);
}

static void sift_down(float *hp, int64_t *hi, int64_t count, int64_t at) {
    for (;;) {
        int64_t w = at;
        const int64_t l = 2 * at + 1, r = l + 1;
        if (l < count && worse(hp[l], hi[l], hp[w], hi[w]))
            w = l;
        if (r < count && worse(hp[r], hi[r], hp[w], hi[w]))
            w = r;
        if (w == at)
            return;
        const float tp = hp[at];
        const int64_t ti = hi[at];
        hp[at] = hp[w];
        hi[at] = hi[w];
        hp[w] = tp;
        hi[w] = ti;
        at = w;
    }
}

static void heap_push(float *hp, int64_t *hi, int64_t *count, int64_t k, float pr, int64_t j) {
    if (*count == k) {
        /* Keys arrive in increasing j: an equal probability never displaces the root. */
        if (!worse(hp[0], hi[0], pr, j))
            return;
        hp[0] = pr;
        hi[0] = j;
        sift_down(hp, hi, k, 0);
        return;
    }
    int64_t at = (*count)++;
    hp[at] = pr;
    hi[at] = j;
    while (at > 0) {
        const int64_t up = (at - 1) / 2;
        if (!worse(hp[at], hi[at], hp[up], hi[up]))
            break;
        const float tp = hp[at];
        const int64_t ti = hi[at];
        hp[at] = hp[up];
        hi[at] = hi[up];
        hp[up] = tp;
        hi[up] = ti;
        at = up;
    }
}

/* Pass 2 step: every visible element of the tile into the requested statistics. */
static void stats_step(const unit *u, int64_t i0, int rows, int64_t j0, int nk) {
    const stats_ctx *c = u->c;
    const mha__problem *p = c->p;
    double *recv = c->received ? c->received + (u->b * p->H + u->h) * p->m + j0 : NULL;
    if (c->R)
        for (int jj = 0; jj < nk; jj++)
            u->cell[jj] = (int32_t)((j0 + jj) * c->C / p->m);
    for (int r = 0; r < rows; r++) {
        const float lse = u->lse[r];
        if (lse == -INFINITY)
            continue;
        const float *s = u->s + (size_t)r * TK;
        double ent = 0.0;
        float *hp = u->heap_p + r * c->k;
        int64_t *hi = u->heap_i + r * c->k;
        double *acc = c->R ? u->acc + ((i0 + r) * c->R / p->n) * c->C : NULL;
        int64_t *vis = c->R ? u->vis + ((i0 + r) * c->R / p->n) * c->C : NULL;
        for (int jj = 0; jj < nk; jj++) {
            if (s[jj] == -INFINITY)
                continue;
            const float d = s[jj] - lse; /* ln P_ij */
            const float pr = expf(d);
            ent -= (double)pr * (double)d;
            if (recv)
                recv[jj] += (double)pr;
            /* A full heap keeps its root against an equal P (keys arrive in increasing j). */
            if (c->k && (u->cnt[r] < c->k || pr > hp[0]))
                heap_push(hp, hi, &u->cnt[r], c->k, pr, j0 + jj);
            if (acc) {
                acc[u->cell[jj]] += (double)pr;
                vis[u->cell[jj]]++;
            }
        }
        u->ent[r] += ent;
    }
}

/* The end of a row tile: entropy (with the sink's term) and the sorted top-k lists. */
static void rows_out(const unit *u, int64_t i0, int rows) {
    const stats_ctx *c = u->c;
    const mha__problem *p = c->p;
    const int64_t row0 = (u->b * p->H + u->h) * p->n + i0;
    for (int r = 0; r < rows; r++) {
        const float lse = u->lse[r];
        if (c->st->entropy) {
            double ent = u->ent[r];
            /* A sink of -inf takes no mass: its term is 0 ln 0 = 0, not 0 * -inf. */
            if (p->sinks && lse != -INFINITY && p->sinks[u->h] != -INFINITY) {
                const double d = (double)p->sinks[u->h] - (double)lse;
                ent -= exp(d) * d;
            }
            c->st->entropy[row0 + r] = (float)ent;
        }
        if (!c->k)
            continue;
        float *hp = u->heap_p + r * c->k;
        int64_t *hi = u->heap_i + r * c->k;
        /* Heap sort: the worst entry moves to the back each time, leaving best-first order. */
        for (int64_t end = u->cnt[r] - 1; end > 0; end--) {
            const float tp = hp[0];
            const int64_t ti = hi[0];
            hp[0] = hp[end];
            hi[0] = hi[end];
            hp[end] = tp;
            hi[end] = ti;
            sift_down(hp, hi, end, 0);
        }
        const int64_t out = (row0 + r) * c->k;
        for (int64_t t = 0; t < c->k; t++) {
            const int have = t < u->cnt[r];
            if (c->st->topk_index)
                c->st->topk_index[out + t] = have ? hi[t] : -1;
            if (c->st->topk_prob)
                c->st->topk_prob[out + t] = have ? hp[t] : 0.0f;
        }
    }
}

/* First index of block r of `count` items cut into `blocks` (item i is in floor(i blocks /
 * count)): ceil(r count / blocks). */
static int64_t block_start(int64_t r, int64_t count, int64_t blocks) {
    return (r * count + blocks - 1) / blocks;
}

/* The pooled grid of the unit: sums divided by each cell's element count. */
static void pool_out(const unit *u) {
    const stats_ctx *c = u->c;
    const mha__problem *p = c->p;
    const int64_t base = (u->b * p->H + u->h) * c->R * c->C;
    for (int64_t r = 0; r < c->R; r++) {
        const int64_t nr = block_start(r + 1, p->n, c->R) - block_start(r, p->n, c->R);
        for (int64_t col = 0; col < c->C; col++) {
            const int64_t nc = block_start(col + 1, p->m, c->C) - block_start(col, p->m, c->C);
            const double cells = (double)nr * (double)nc;
            const int64_t at = r * c->C + col;
            if (c->st->pooled)
                c->st->pooled[base + at] = (float)(u->acc[at] / cells);
            if (c->st->pooled_visible)
                c->st->pooled_visible[base + at] = (float)((double)u->vis[at] / cells);
        }
    }
}

static void run_unit(unit *u) {
    const stats_ctx *c = u->c;
    const mha__problem *p = c->p;
    if (c->R) {
        memset(u->acc, 0, sizeof(double) * (size_t)(c->R * c->C));
        memset(u->vis, 0, sizeof(int64_t) * (size_t)(c->R * c->C));
    }
    for (int64_t i0 = 0; i0 < p->n; i0 += TQ) {
        const int rows = (int)(p->n - i0 < TQ ? p->n - i0 : TQ);
        for (int r = 0; r < rows; r++) {
            u->max[r] = -INFINITY;
            u->sum[r] = 0.0;
            u->ent[r] = 0.0;
            u->cnt[r] = 0;
        }
        /* Keys [lo, hi] some row of the tile may see: the causal / window band narrowed by the
         * block mask's row spans (keys outside are hidden from every row: P = 0, no term). */
        int64_t lo, hi;
        mha__flash_unit_keys(p, u->b, u->h, u->h + 1, i0, i0 + rows, &lo, &hi);
        for (int64_t j0 = lo; j0 <= hi; j0 += TK) {
            const int nk = (int)(hi + 1 - j0 < TK ? hi + 1 - j0 : TK);
            score_tile(u, i0, rows, j0, nk);
            lse_step(u, rows, nk);
        }
        lse_final(u, rows);
        for (int64_t j0 = lo; j0 <= hi; j0 += TK) {
            const int nk = (int)(hi + 1 - j0 < TK ? hi + 1 - j0 : TK);
            score_tile(u, i0, rows, j0, nk);
            stats_step(u, i0, rows, j0, nk);
        }
        rows_out(u, i0, rows);
    }
    if (c->R)
        pool_out(u);
}

static void stats_range(void *ctx, int part, int64_t begin, int64_t end) {
    const stats_ctx *c = ctx;
    char *base = c->scratch + (size_t)part * c->stride;
    const stats_layout *L = &c->L;
    unit u = {c,
              0,
              0,
              (float *)(base + L->s),
              base + L->gemm,
              (float *)(base + L->max),
              (double *)(base + L->sum),
              (float *)(base + L->lse),
              (double *)(base + L->ent),
              (int64_t *)(base + L->cnt),
              (int32_t *)(base + L->cell),
              (float *)(base + L->heap_p),
              (int64_t *)(base + L->heap_i),
              (double *)(base + L->acc),
              (int64_t *)(base + L->vis)};
    for (int64_t bh = begin; bh < end; bh++) {
        u.b = bh / c->p->H;
        u.h = bh % c->p->H;
        run_unit(&u);
    }
}

/* received [B, H, m] and received_total [B, m] from the double column sums. */
static void received_out(const stats_ctx *c) {
    const mha__problem *p = c->p;
    for (int64_t b = 0; b < p->B; b++)
        for (int64_t j = 0; j < p->m; j++) {
            double total = 0.0;
            for (int64_t h = 0; h < p->H; h++) {
                const int64_t at = (b * p->H + h) * p->m + j;
                total += c->received[at];
                if (c->st->received)
                    c->st->received[at] = (float)c->received[at];
            }
            if (c->st->received_total)
                c->st->received_total[b * p->m + j] = (float)total;
        }
}

/* The units over the team's threads, then the column sums out. */
static mha_status stats_run(stats_ctx *c, mha__team team, mha_error *err) {
    const mha__problem *p = c->p;
    if (c->received)
        memset(c->received, 0, sizeof(double) * (size_t)(p->B * p->H * p->m));
    mha_status st = mha__parallel_for(team, p->B * p->H, stats_range, c, err);
    if (st == MHA_STATUS_OK && c->received)
        received_out(c);
    return st;
}

mha_status mha__attention_stats_run(const mha__problem *p,
                                    const mha_attention_stats *stats,
                                    const mha_exec *exec,
                                    mha_error *err) {
    mha__team team;
    mha_status st = mha__exec_team(exec, &team, err);
    if (st)
        return st;
    team = mha__team_at_most(team, p->B * p->H);
    stats_ctx c;
    memset(&c, 0, sizeof c);
    c.p = p;
    c.st = stats;
    c.k = (stats->topk_index || stats->topk_prob) ? stats->top_k : 0;
    if (stats->pooled || stats->pooled_visible) {
        c.R = stats->pool_rows;
        c.C = stats->pool_cols;
    }
    st = stats_layout_for(&c, err);
    if (st)
        return st;
    /* One block: [received: B H m doubles][block mask][team.n per-thread blocks of c.stride]. */
    c.stride = c.L.total;
    size_t recv_bytes = 0, map_bytes = 0, total;
    int64_t all;
    const bool ok = (!(stats->received || stats->received_total) ||
                     mha__bytes(p->B * p->H * p->m, sizeof(double), &recv_bytes)) &&
                    mha__mask_map_problem_bytes(p, &map_bytes) && c.stride <= INT64_MAX &&
                    mha__mul_i64((int64_t)c.stride, team.n, &all) &&
                    mha__add_i64(all, (int64_t)mha__align64(recv_bytes), &all) &&
                    mha__add_i64(all, (int64_t)mha__align64(map_bytes), &all) &&
                    mha__bytes(all, 1, &total);
    MHA_RETURN_IF(!ok, err, OVERFLOW, "statistics scratch size overflows");
    const mha_allocator *alloc = exec ? exec->allocator : NULL;
    char *block = mha__alloc(alloc, total);
    MHA_RETURN_IF(!block, err, NO_MEMORY, "cannot allocate %zu bytes of statistics scratch", total);
    c.received = recv_bytes ? (double *)block : NULL;
    mha__problem with_map = *p;
    st = mha__mask_map_build(&with_map, block + mha__align64(recv_bytes), team, err);
    c.p = &with_map;
    c.scratch = block + mha__align64(recv_bytes) + mha__align64(map_bytes);
    if (!st)
        st = stats_run(&c, team, err);
    mha__free(alloc, block);
    if (st == MHA_STATUS_OK)
        mha__ok(err);
    return st;
}

mha_status mha_attention_statistics(const mha_attention_args *args,
                                    const mha_attention_stats *stats,
                                    const mha_exec *exec,
                                    mha_error *err) {
    MHA_RETURN_IF(!args, err, INVALID_ARG, "args is NULL");
    mha_status st = mha__check_attention_sizes(args, err);
    if (st)
        return st;
    /* The check resolves the causal offsets [B] and the ALiBi slopes [H] into this block (the
     * sizes are checked, so both are small). */
    const mha_allocator *alloc = exec ? exec->allocator : NULL;
    const size_t slope_off = mha__align64(sizeof(int64_t) * (size_t)args->batch);
    char *head = mha__alloc(alloc, slope_off + sizeof(float) * (size_t)args->num_heads);
    MHA_RETURN_IF(!head, err, NO_MEMORY, "cannot allocate the statistics' problem");
    mha__problem p;
    st = mha__check_attention_stats(args, stats, &p, (int64_t *)head, (float *)(head + slope_off),
                                    err);
    if (st == MHA_STATUS_OK)
        st = mha__attention_stats_run(&p, stats, exec, err);
    mha__free(alloc, head);
    return st;
}
