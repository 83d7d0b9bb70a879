/* SPDX-License-Identifier: MIT */
/* decode.c: attention over a KV cache and the layer's prefill / decode_step, plus the public
 * exact merge of partial attention results (mha.h, "Inference: KV cache").
 *
 * Split-KV decoding: for each (sequence, kv head) the visible keys are cut into fixed blocks of
 * MHA_DEC_BLOCK positions (the cut depends only on the lengths, never on the thread count); the
 * blocks of all sequences and heads are spread over the threads, each gives an unnormalised
 * partial (o, m, l) for every query head of the group and every new token, and the partials are
 * merged in block order. So both threads are busy even for batch 1, every K/V row is read once per
 * group, and the result is bit-identical for any thread count. Long inputs (prefill) and
 * impl=reference go through the attention core on the dequantised cache instead.
 */
#include "cache/kv_cache.h"
#include "kernels/gemm.h"
#include "kernels/registry.h"
#include "layer/plan.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* Above this many new tokens per sequence the attention core's flash kernel (tiled over queries)
 * beats the decode kernel, which recomputes nothing but keeps all R = group * t score rows of a
 * block live; 16 keeps R * MHA_DEC_BLOCK floats of scores within L2 for group <= 8. */
#define MHA_DEC_MAX_TOKENS 16
_Static_assert(MHA__TREE_MAX_TOKENS <= MHA_DEC_MAX_TOKENS && MHA__TREE_MAX_TOKENS <= 32,
               "a draft tree runs on the split-KV kernels, one 32-bit mask per row");

/* ---------------------------------------------------------------------------------------------- */
/* Merge.                                                                                         */
/* ---------------------------------------------------------------------------------------------- */

mha_status mha_attention_merge(int64_t rows,
                               int64_t dim,
                               const float *o_a,
                               int64_t o_a_stride,
                               const float *lse_a,
                               const float *o_b,
                               int64_t o_b_stride,
                               const float *lse_b,
                               float *o,
                               int64_t o_stride,
                               float *lse,
                               mha_error *err) {
    mha_status st = mha__check_merge(rows, dim, o_a, o_a_stride, lse_a, o_b, o_b_stride, lse_b, o,
                                     o_stride, lse, err);
    if (st)
        return st;
    for (int64_t r = 0; r < rows; r++) {
        const float la = lse_a[r], lb = lse_b[r];
        const float mx = la > lb ? la : lb;
        float wa, wb, out_lse;
        if (mx == -INFINITY) { /* both partials saw no key */
            wa = wb = 0.0f;
            out_lse = -INFINITY;
        } else if (isnan(la) || isnan(lb)) {
            wa = wb = NAN;
            out_lse = NAN;
        } else {
            const float ea = expf(la - mx), eb = expf(lb - mx); /* exp(-inf) = 0 */
            const float sum = ea + eb;
            out_lse = mx + logf(sum);
            wa = ea / sum;
            wb = eb / sum;
        }
        const float *ra = o_a + r * o_a_stride, *rb = o_b + r * o_b_stride;
        float *ro = o + r * o_stride;
        for (int64_t d = 0; d < dim; d++) {
            /* A partial with weight 0 contributes nothing, even if its o is garbage. */
            const float va = wa == 0.0f ? 0.0f : wa * ra[d];
            const float vb = wb == 0.0f ? 0.0f : wb * rb[d];
            ro[d] = va + vb;
        }
        if (lse)
            lse[r] = out_lse;
    }
    mha__ok(err);
    return MHA_STATUS_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* Split-KV driver.                                                                               */
/* ---------------------------------------------------------------------------------------------- */

typedef struct dec_run {
    const mha__dec_problem *p;
    mha__dec_kernel_fn fn;
    const mha__dec_unit *units;
    const int64_t *first; /* [S*G + 1]: units of pair (s, g) are first[s*G+g] .. first[..+1]-1 */
    float *part;          /* per unit: o [R][dv], m [R], l [R] */
    int64_t part_stride;
    float *scratch;
    int64_t scratch_stride;
    const float *sinks;
    float *out; /* element (s, i, h, d) at out[s*o_ss + i*o_ts + h*dv + d] */
    int64_t o_ss, o_ts;
    float *lse; /* [S, H, t] or NULL */
    int64_t n_units, chunk;
    atomic_int_fast64_t *next; /* first unit not yet taken */
    float *merge;              /* per merge part: the rows' max and sum, [2][R] */
    int64_t merge_stride;
} dec_run;

/* One worker (part) of the split-KV pass: takes chunks of `chunk` consecutive units from a shared
 * counter until none is left. Dynamic, not a fixed split: on this shared machine one vCPU often
 * runs at half speed for a while (measured: 10 ms against 24 ms for the two halves of one step);
 * a unit's result does not depend on which thread computes it, so outputs stay bit-identical. */
static void run_units(void *ctx, int part, int64_t begin, int64_t end) {
    (void)begin;
    (void)end;
    const dec_run *r = ctx;
    const int64_t R = r->p->group * r->p->t, dv = r->p->dv;
    float *scratch = r->scratch + part * r->scratch_stride;
    for (;;) {
        const int64_t k0 = atomic_fetch_add_explicit(r->next, r->chunk, memory_order_relaxed);
        if (k0 >= r->n_units)
            break;
        const int64_t k1 = k0 + r->chunk < r->n_units ? k0 + r->chunk : r->n_units;
        for (int64_t k = k0; k < k1; k++) {
            float *o = r->part + k * r->part_stride;
            mha__dec_unit u = r->units[k]; /* with the next unit of this chunk, if any */
            u.next = k + 1 < k1 ? &r->units[k + 1] : NULL;
            r->fn(r->p, &u, o, o + R * dv, o + R * dv + R, scratch);
        }
    }
}

/* Merges the units of pairs (s, g) in [begin, end) into out and lse, in unit order. Units outer,
 * rows inner: each unit's partial is read once, in order (rows outer read a pair's partials R
 * times); every row's max, sum and o[d] see the same operations in the same order either way. */
static void merge_pairs(void *ctx, int part, int64_t begin, int64_t end) {
    const dec_run *r = ctx;
    const mha__dec_problem *p = r->p;
    const int64_t R = p->group * p->t, dv = p->dv;
    float *mx = r->merge + part * r->merge_stride, *sum = mx + R; /* [R] each */
    for (int64_t sg = begin; sg < end; sg++) {
        const int64_t s = sg / p->G, g = sg % p->G;
        const int64_t u0 = r->first[sg], u1 = r->first[sg + 1];
#define ROW_OUT_(row)                                                                              \
    (r->out + s * r->o_ss + (row) / p->group * r->o_ts + (g * p->group + (row) % p->group) * dv)
        for (int64_t row = 0; row < R; row++) {
            const int64_t h = g * p->group + row % p->group;
            mx[row] = r->sinks ? r->sinks[h] : -INFINITY;
        }
        for (int64_t u = u0; u < u1; u++) {
            const float *mu = r->part + u * r->part_stride + R * dv;
            for (int64_t row = 0; row < R; row++)
                if (mu[row] > mx[row] || isnan(mu[row]))
                    mx[row] = mu[row];
        }
        for (int64_t row = 0; row < R; row++) {
            const int64_t h = g * p->group + row % p->group;
            /* nothing visible (cannot happen with causal decoding): o stays 0 */
            sum[row] = r->sinks && mx[row] != -INFINITY ? expf(r->sinks[h] - mx[row]) : 0.0f;
            memset(ROW_OUT_(row), 0, sizeof(float) * (size_t)dv);
        }
        for (int64_t u = u0; u < u1; u++) {
            const float *pu = r->part + u * r->part_stride;
            for (int64_t row = 0; row < R; row++) {
                const float mu = pu[R * dv + row];
                if (mx[row] == -INFINITY || mu == -INFINITY)
                    continue;
                const float w = expf(mu - mx[row]);
                sum[row] += w * pu[R * dv + R + row];
                const float *ou = pu + row * dv;
                float *o = ROW_OUT_(row);
                for (int64_t d = 0; d < dv; d++)
                    o[d] += w * ou[d];
            }
        }
        for (int64_t row = 0; row < R; row++) {
            const int64_t i = row / p->group, h = g * p->group + row % p->group;
            float *lse = r->lse ? r->lse + (s * p->H + h) * p->t + i : NULL;
            if (mx[row] == -INFINITY) {
                if (lse)
                    *lse = -INFINITY;
                continue;
            }
            const float inv = 1.0f / sum[row];
            float *o = ROW_OUT_(row);
            for (int64_t d = 0; d < dv; d++)
                o[d] *= inv;
            if (lse)
                *lse = mx[row] + logf(sum[row]);
        }
#undef ROW_OUT_
    }
}

/* Lowest key any of the last t positions of a sequence of length L can see. */
static int64_t lowest_key(const struct mha_kv_cache *c, int64_t L, int64_t t) {
    return mha__kv_first_key(&c->cfg, L - t); /* a chunk cache: a multiple of C */
}

/* Everything mha__kv_attend needs about the call. */
typedef struct kv_call {
    const struct mha_kv_cache *cache;
    int64_t S;
    const int64_t *seq; /* [S] (never NULL here) */
    int64_t t, H;
    double scale; /* resolved */
    double softcap;
    int alibi;
    const float *sinks;
    const float *q;
    int64_t q_ss, q_ts;
    float *out;
    int64_t o_ss, o_ts;
    float *lse;
    const int64_t *tree_parents; /* [t] or NULL */
} kv_call;

/* The attention core on the dequantised cache, one sequence at a time (impl=reference, and long
 * blocks of new tokens). */
static mha_status attend_core(
    const kv_call *a, mha_impl impl, mha__team team, const mha_allocator *alloc, mha_error *err) {
    const struct mha_kv_cache *c = a->cache;
    const int64_t G = c->cfg.num_kv_heads, dk = c->cfg.head_dim, dv = c->cfg.v_head_dim;
    int64_t max_m = 0;
    for (int64_t s = 0; s < a->S; s++) {
        const int64_t L = c->len[a->seq[s]], m = L - lowest_key(c, L, a->t);
        max_m = m > max_m ? m : max_m;
    }
    size_t bytes;
    MHA_RETURN_IF(!mha__bytes(max_m * G * (dk + dv), sizeof(float), &bytes), err, OVERFLOW,
                  "dequantised cache size overflows");
    float *kbuf = mha__alloc_large(alloc, bytes);
    MHA_RETURN_IF(!kbuf, err, NO_MEMORY, "cannot allocate %zu bytes for the dequantised cache",
                  bytes);
    mha_status st = MHA_STATUS_OK;
    for (int64_t s = 0; s < a->S && !st; s++) {
        const int64_t seq = a->seq[s], L = c->len[seq], lo = lowest_key(c, L, a->t);
        const int64_t m = L - lo;
        float *kb = kbuf, *vb = kbuf + m * G * dk;
        for (int64_t g = 0; g < G; g++)
            for (int64_t j = 0; j < m; j++) {
                mha__kv_get(c, 0, seq, g, lo + j, kb + (g * m + j) * dk);
                mha__kv_get(c, 1, seq, g, lo + j, vb + (g * m + j) * dv);
            }
        mha_attention_args ca;
        memset(&ca, 0, sizeof ca);
        ca.batch = 1;
        ca.num_heads = a->H;
        ca.num_kv_heads = G;
        ca.q_len = a->t;
        ca.kv_len = m;
        ca.head_dim = dk;
        ca.v_head_dim = dv;
        ca.scale = a->scale;
        ca.softcap = a->softcap;
        ca.alibi = a->alibi;
        ca.sinks = a->sinks;
        ca.q = a->q + s * a->q_ss;
        ca.q_strides[0] = a->t * a->q_ts;
        ca.q_strides[1] = dk;
        ca.q_strides[2] = a->q_ts;
        ca.k = kb;
        ca.k_strides[0] = G * m * dk;
        ca.k_strides[1] = m * dk;
        ca.k_strides[2] = dk;
        ca.v = vb;
        ca.v_strides[0] = G * m * dv;
        ca.v_strides[1] = m * dv;
        ca.v_strides[2] = dv;
        ca.out = a->out + s * a->o_ss;
        ca.out_strides[0] = a->t * a->o_ts;
        ca.out_strides[1] = dv;
        ca.out_strides[2] = a->o_ts;
        ca.lse = a->lse ? a->lse + s * a->H * a->t : NULL;
        ca.mask.causal = 1;
        ca.mask.alignment = MHA_ALIGN_BOTTOM_RIGHT;
        ca.mask.window_left = -1;
        ca.mask.window_right = -1;
        if (c->cfg.window > 0) {
            ca.mask.use_window = 1;
            ca.mask.window_left = c->cfg.window - 1;
        }
        /* Local key 0 is position lo, a multiple of C (lowest_key): local chunks are the
         * sequence's. */
        ca.mask.chunk_size = c->cfg.chunk_size;
        mha_exec ex;
        memset(&ex, 0, sizeof ex);
        ex.impl = impl == MHA_IMPL_REFERENCE ? MHA_IMPL_REFERENCE : MHA_IMPL_AUTO;
        ex.n_threads = team.n;
        ex.allocator = alloc;
        ex.pool = team.pool;
        st = mha_attention(&ca, &ex, err);
    }
    mha__free(alloc, kbuf);
    return st;
}

/* The decode kernels' second prefetch distance (mha__dec_problem.prefetch_far) pays where it was
 * measured to: the CPUs of mha__cpu_decode_prefetch_far, float32, float16 and bfloat16 caches
 * (q8_0 no faster; float16 was left out until session 41, measured 10-13% slower then on one
 * thread; with session 40's kernel it runs one thread 0.97-1.03x and two threads 1.1x faster,
 * docs/INFERENCE.md), and calls that read more K and V than MHA__DEC_FAR_MIN_BYTES (with the rows
 * in the L3 it ran the contiguous cache 14-17% slower: the non-temporal hint makes lines read
 * again at the next step leave the caches). */
#define MHA__DEC_FAR_MIN_BYTES ((int64_t)32 << 20)
static int far_prefetch(const struct mha_kv_cache *c, const mha__dec_problem *p) {
    if (!mha__cpu_decode_prefetch_far() ||
        (c->cfg.dtype != MHA_DTYPE_F32 && c->cfg.dtype != MHA_DTYPE_F16 &&
         c->cfg.dtype != MHA_DTYPE_BF16))
        return 0;
    int64_t rows = 0; /* K (and V) rows the call reads, per kv head */
    for (int64_t s = 0; s < p->S; s++) {
        const int64_t L = c->len[p->seq[s]];
        rows += L < c->slots ? L : c->slots;
    }
    const double bytes = (double)rows * (double)p->G * (double)(c->k_row_bytes + c->v_row_bytes);
    return bytes > (double)MHA__DEC_FAR_MIN_BYTES;
}

/* The registry's dtype bit of what the decode kernel reads: the cache's dtype, or the q8_0
 * key-interleaved order (only the lines that hold MHA_DTS_Q8X16 read it). */
static unsigned cache_dts(const struct mha_kv_cache *c) {
    return c->q8x16 ? MHA_DTS_Q8X16 : mha__dts_bit(c->cfg.dtype);
}

/* The split-KV decode kernel over all sequences and kv heads. */
static mha_status
attend_split(const kv_call *a, mha__team team, const mha_allocator *alloc, mha_error *err) {
    const struct mha_kv_cache *c = a->cache;
    mha__dec_problem p;
    memset(&p, 0, sizeof p);
    p.cache = c;
    p.seq = a->seq;
    p.S = a->S;
    p.t = a->t;
    p.H = a->H;
    p.G = c->cfg.num_kv_heads;
    p.group = a->H / p.G;
    p.dk = c->cfg.head_dim;
    p.dv = c->cfg.v_head_dim;
    p.scale = (float)a->scale;
    p.softcap = (float)a->softcap;
    p.window = c->cfg.window;
    p.chunk = c->cfg.chunk_size;
    p.q = a->q;
    p.q_ss = a->q_ss;
    p.q_ts = a->q_ts;
    p.prefetch_l2 = mha__cpu_decode_prefetch_to_l2();
    p.prefetch_far = far_prefetch(c, &p);
    const int64_t R = p.group * p.t, SG = p.S * p.G;

    /* Units: for each (s, g), blocks of MHA_DEC_BLOCK keys from the lowest visible one. */
    int64_t n_units = 0;
    for (int64_t s = 0; s < p.S; s++) {
        const int64_t L = c->len[p.seq[s]], lo = lowest_key(c, L, p.t);
        n_units += p.G * ((L - lo + MHA_DEC_BLOCK - 1) / MHA_DEC_BLOCK);
    }
    const int64_t part_stride = ((R * (p.dv + 2)) + 15) & ~(int64_t)15;
    const int64_t scratch_stride = (mha__dec_scratch_floats(&p) + 15) & ~(int64_t)15;
    const mha__team unit_team = mha__team_at_most(team, n_units);
    const int nt = unit_team.n;
    int64_t fl;
    size_t ub, fb, pb, sb;
    MHA_RETURN_IF(!mha__bytes(n_units, sizeof(mha__dec_unit), &ub) ||
                      !mha__bytes(SG + 1, sizeof(int64_t), &fb) ||
                      !mha__mul_i64(n_units, part_stride, &fl) ||
                      !mha__bytes(fl, sizeof(float), &pb) ||
                      !mha__mul_i64(scratch_stride, nt > 0 ? nt : 1, &fl) ||
                      !mha__bytes(fl, sizeof(float), &sb),
                  err, OVERFLOW, "decode workspace size overflows");
    const int64_t merge_stride = (2 * R + 15) & ~(int64_t)15;
    const int nm = team.n > 0 ? team.n : 1; /* merge parts */
    size_t mb;
    MHA_RETURN_IF(!mha__mul_i64(merge_stride, nm, &fl) || !mha__bytes(fl, sizeof(float), &mb), err,
                  OVERFLOW, "decode workspace size overflows");
    const int64_t ntree = a->tree_parents ? p.t : 0;
    const size_t tb = sizeof(int64_t) * (size_t)ntree + sizeof(uint32_t) * (size_t)(p.S * ntree);
    const size_t total = ub + fb + pb + sb + mb + 6 * 64 + sizeof(float) * (size_t)p.H + tb;
    char *ws = mha__alloc(alloc, total);
    MHA_RETURN_IF(!ws, err, NO_MEMORY, "cannot allocate a %zu-byte decode workspace", total);
    char *cur = ws;
#define TAKE_(ptr, bytes)                                                                          \
    do {                                                                                           \
        (ptr) = (void *)cur;                                                                       \
        cur += ((bytes) + 63) & ~(size_t)63;                                                       \
    } while (0)
    mha__dec_unit *units;
    int64_t *first;
    float *part, *scratch, *slopes, *merge;
    int64_t *depth;
    TAKE_(units, ub);
    TAKE_(first, fb);
    TAKE_(part, pb);
    TAKE_(scratch, sb);
    TAKE_(merge, mb);
    TAKE_(slopes, sizeof(float) * (size_t)p.H);
    TAKE_(depth, tb);
#undef TAKE_
    if (a->tree_parents) { /* depths, then each row's visible drafts (check/: parents[i] < i) */
        uint32_t *vis = (uint32_t *)(depth + p.t);
        for (int64_t i = 0; i < p.t; i++)
            depth[i] = a->tree_parents[i] < 0 ? 0 : depth[a->tree_parents[i]] + 1;
        p.tree_depth = depth;
        for (int64_t s = 0; s < p.S; s++) {
            const int64_t base = c->len[p.seq[s]] - p.t;
            for (int64_t i = 0; i < p.t; i++) {
                uint32_t bits = 0;
                for (int64_t x = i; x >= 0; x = a->tree_parents[x])
                    if (mha__dec_visible(&p, base + depth[i], base + depth[x]))
                        bits |= UINT32_C(1) << x;
                vis[s * p.t + i] = bits;
            }
        }
        p.tree_vis = vis;
    }
    if (a->alibi) {
        mha__alibi_slopes(p.H, slopes);
        p.slopes = slopes;
    }
    int64_t k = 0;
    for (int64_t s = 0; s < p.S; s++) {
        const int64_t L = c->len[p.seq[s]], lo = lowest_key(c, L, p.t);
        for (int64_t g = 0; g < p.G; g++) {
            first[s * p.G + g] = k;
            for (int64_t j = lo; j < L; j += MHA_DEC_BLOCK) {
                units[k].s = s;
                units[k].g = g;
                units[k].j0 = j;
                units[k].j1 = j + MHA_DEC_BLOCK < L ? j + MHA_DEC_BLOCK : L;
                units[k].next = NULL;
                k++;
            }
        }
    }
    first[SG] = k;

    /* Chunks of consecutive units (one (s, g) pair's keys in order, so a unit's prefetch of the
     * next one's first keys is useful): about 8 chunks per thread, at most 16 units each. */
    int64_t chunk = n_units / (8 * (int64_t)(nt > 0 ? nt : 1));
    chunk = chunk < 1 ? 1 : chunk > 16 ? 16 : chunk;
    atomic_int_fast64_t next;
    atomic_init(&next, 0);
    const mha__dec_kernel_fn kernel =
        mha__registry_best_dt(MHA__OP_decode, cache_dts(c))->run.decode;
    dec_run run = {&p,      kernel,         units,    first,  part,    part_stride,
                   scratch, scratch_stride, a->sinks, a->out, a->o_ss, a->o_ts,
                   a->lse,  n_units,        chunk,    &next,  merge,   merge_stride};
    mha_status st = mha__parallel_for(unit_team, nt, run_units, &run, err);
    if (!st)
        st = mha__parallel_for(team, SG, merge_pairs, &run, err);
    mha__free(alloc, ws);
    return st;
}

static mha_status kv_attend(const kv_call *a, const mha_exec *exec, mha_error *err) {
    const mha_impl impl = exec ? exec->impl : MHA_IMPL_AUTO;
    mha__team team;
    mha_status st = mha__exec_team(exec, &team, err);
    if (st)
        return st;
    const mha_allocator *alloc = exec ? exec->allocator : NULL;
    /* a draft tree always runs on the split-KV kernels (check/: t <= MHA__TREE_MAX_TOKENS) */
    if (!a->tree_parents && (impl == MHA_IMPL_REFERENCE || a->t > MHA_DEC_MAX_TOKENS))
        return attend_core(a, impl, team, alloc, err);
    return attend_split(a, team, alloc, err);
}

/* Ids as an array (NULL = 0 .. S-1), in caller-provided storage of S entries. */
static const int64_t *ids_or_iota(const int64_t *ids, int64_t S, int64_t *buf) {
    if (ids)
        return ids;
    for (int64_t i = 0; i < S; i++)
        buf[i] = i;
    return buf;
}

mha_status mha_kv_cache_attention(const mha_kv_cache *cache,
                                  const mha_kv_attention_args *args,
                                  const mha_exec *exec,
                                  mha_error *err) {
    const mha__kv_view view = mha__kv_view_of(cache);
    double scale;
    mha_status st = mha__check_kv_attention(&view, args, exec, &scale, err);
    if (st)
        return st;
    const mha_kv_cache_config *c = &cache->cfg;
    const mha_allocator *alloc = exec ? exec->allocator : NULL;
    int64_t *ids = mha__alloc(alloc, sizeof(int64_t) * (size_t)args->num_seqs);
    MHA_RETURN_IF(!ids, err, NO_MEMORY, "cannot allocate %lld ids", (long long)args->num_seqs);
    const int64_t H = args->num_heads, t = args->num_tokens;
    kv_call a = {cache,
                 args->num_seqs,
                 ids_or_iota(args->seq_ids, args->num_seqs, ids),
                 t,
                 H,
                 scale,
                 args->softcap,
                 args->alibi != 0,
                 args->sinks,
                 args->q,
                 t * H * c->head_dim,
                 H * c->head_dim,
                 args->out,
                 t * H * c->v_head_dim,
                 H * c->v_head_dim,
                 args->lse,
                 args->tree_parents};
    st = kv_attend(&a, exec, err);
    mha__free(alloc, ids);
    if (!st)
        mha__ok(err);
    return st;
}

/* ---------------------------------------------------------------------------------------------- */
/* The layer through a cache: the plan's projections and RoPE (layer/plan.c) around the split-KV */
/* attention. mha_layer_prefill and mha_layer_decode_step are both this function.                 */
/* ---------------------------------------------------------------------------------------------- */

static mha_status layer_step(const mha_layer *layer,
                             mha_kv_cache *cache,
                             const mha_decode_args *args,
                             const mha_exec *exec,
                             mha_error *err) {
    const mha__kv_view view = mha__kv_view_of(cache);
    mha_status st = mha__check_decode(layer ? mha_layer_config(layer) : NULL,
                                      mha_layer_weights(layer), &view, args, exec, err);
    if (!st)
        st = mha__kv_check_pool(cache, args->num_seqs, args->seq_ids, args->num_tokens, err);
    if (st)
        return st;
    const mha_config *c = mha_layer_config(layer);
    const mha__layer_w *w = mha__layer_compute_weights(layer); /* projections in their dtype */
    const mha_dtype wdt = w->wdt, f32 = MHA_DTYPE_F32;
    const mha_kv_cache_config *kc = &cache->cfg;
    const int64_t S = args->num_seqs, t = args->num_tokens;
    const int64_t h = c->num_heads, g = c->num_kv_heads, dk = c->head_dim, dv = c->v_head_dim;
    const int64_t rows = S * t;
    int64_t nq, nk, nv, na;
    size_t bq, bk, bv, ba, bl, br;
    MHA_RETURN_IF(!mha__mul_i64(rows, h * dk, &nq) || !mha__mul_i64(rows, g * dk, &nk) ||
                      !mha__mul_i64(rows, g * dv, &nv) || !mha__mul_i64(rows, h * dv, &na) ||
                      !mha__bytes(nq, sizeof(float), &bq) || !mha__bytes(nk, sizeof(float), &bk) ||
                      !mha__bytes(nv, sizeof(float), &bv) || !mha__bytes(na, sizeof(float), &ba) ||
                      !mha__bytes(2 * S + (args->tree_parents ? rows : 0), sizeof(int64_t), &bl),
                  err, OVERFLOW, "decode buffers overflow");
    br = sizeof(double) * (mha__plan_rope_doubles(&c->rope) + 1);
    const mha_allocator *alloc = exec ? exec->allocator : NULL;
    const mha_impl impl = exec ? exec->impl : MHA_IMPL_AUTO;
    mha__team team;
    st = mha__exec_team(exec, &team, err);
    if (st)
        return st;
    size_t off[7], total = 0;
    const size_t sizes[7] = {bq, bk, bv, ba, bl, br, c->output_gate ? bq : 0}; /* 6: the gate */
    for (int i = 0; i < 7; i++) {
        off[i] = total;
        MHA_RETURN_IF(total > SIZE_MAX - sizes[i] - 64, err, OVERFLOW, "decode buffers overflow");
        total += (sizes[i] + 63) & ~(size_t)63;
    }
    char *ws = mha__alloc(alloc, total);
    MHA_RETURN_IF(!ws, err, NO_MEMORY, "cannot allocate %zu bytes of decode buffers", total);
    float *q = (float *)(ws + off[0]), *k = (float *)(ws + off[1]);
    float *v = (float *)(ws + off[2]), *att = (float *)(ws + off[3]);
    int64_t *ids = (int64_t *)(ws + off[4]), *len0 = ids + S;
    double *tab = (double *)(ws + off[5]);
    const int64_t *seq = ids_or_iota(args->seq_ids, S, ids);
    for (int64_t i = 0; i < S; i++)
        len0[i] = cache->len[seq[i]];
    /* A draft tree: token i of sequence s is at position len0[s] + depth(i) (check/: parents[i] <
     * i); pos [S, t] then replaces len0 + i for RoPE and the temperature. */
    int64_t *pos = NULL;
    if (args->tree_parents) {
        pos = len0 + S;
        for (int64_t i = 0; i < t; i++)
            pos[i] = args->tree_parents[i] < 0 ? 0 : pos[args->tree_parents[i]] + 1;
        for (int64_t sq = S - 1; sq >= 0; sq--)
            for (int64_t i = 0; i < t; i++)
                pos[sq * t + i] = len0[sq] + pos[i];
    }

    /* 1. Projections of the new tokens. */
    st = mha__plan_project(impl, alloc, team, args->x, f32, w->w_q, wdt, w->b_q, q, rows, c->q_dim,
                           h * dk, NULL, 0, err);
    if (!st)
        st = mha__plan_project(impl, alloc, team, args->x, f32, w->w_k, wdt, w->b_k, k, rows,
                               c->q_dim, g * dk, NULL, 0, err);
    if (!st)
        st = mha__plan_project(impl, alloc, team, args->x, f32, w->w_v, wdt, w->b_v, v, rows,
                               c->q_dim, g * dv, NULL, 0, err);

    /* 2. QK-norm and RoPE at the absolute positions len0 + i (a DYNAMIC rope at this call's
     *    length: the cached keys keep the rotation of the call that appended them, as
     *    transformers' do): the cache receives K normed and rotated. */
    if (!st)
        mha__plan_qk_norm_stage(c, w, 0, q, rows, k, rows);
    if (!st && c->rope.style != MHA_ROPE_NONE) {
        const int64_t len = pos ? mha__plan_rope_length(&c->rope, pos, pos, NULL, S, t, t)
                                : mha__plan_rope_length(&c->rope, NULL, NULL, len0, S, t, t);
        mha__plan_rope(&c->rope, len, tab, q, S, t, h, dk, pos, len0, 1);
        mha__plan_rope(&c->rope, len, tab, k, S, t, g, dk, pos, len0, 1);
    }
    if (!st)
        mha__plan_qk_norm_stage(c, w, 1, q, rows, k, rows);
    /* 2b. Temperature tuning: each new query times tau(len0 + i), its cache position. */
    if (!st)
        mha__plan_temperature(&c->temperature, q, S, t, h, dk, pos, len0);

    /* 3. Append and attend, in steps a window ring can hold. */
    const int64_t step = mha__kv_ring_span(kc) > 0 ? kc->max_step_tokens : t;
    for (int64_t c0 = 0; c0 < t && !st; c0 += step) {
        const int64_t tc = t - c0 < step ? t - c0 : step;
        mha__kv_append_raw(cache, S, seq, tc, k + c0 * g * dk, t * g * dk, g * dk, v + c0 * g * dv,
                           t * g * dv, g * dv);
        kv_call a = {cache,
                     S,
                     seq,
                     tc,
                     h,
                     c->scale,
                     c->softcap,
                     c->alibi,
                     w->sinks,
                     q + c0 * h * dk,
                     t * h * dk,
                     h * dk,
                     att + c0 * h * dv,
                     t * h * dv,
                     h * dv,
                     NULL,
                     args->tree_parents};
        st = kv_attend(&a, exec, err);
    }

    /* 4. The output gate (its rows of w_q), then the output projection. */
    if (!st && c->output_gate) {
        float *gate = (float *)(ws + off[6]);
        const void *wg;
        const float *bg;
        mha__plan_gate_weights(c, w, &wg, &bg);
        st = mha__plan_project(impl, alloc, team, args->x, f32, wg, wdt, bg, gate, rows, c->q_dim,
                               h * dk, NULL, 0, err);
        if (!st)
            mha__plan_gate_apply(gate, att, rows * h * dv);
    }
    if (!st)
        st = mha__plan_project(impl, alloc, team, att, f32, w->w_o, wdt, w->b_o, args->out, rows,
                               h * dv, c->out_dim, NULL, 0, err);
    if (st) /* undo the appends (only allocation can fail this late) */
        for (int64_t i = 0; i < S; i++) {
            mha__kv_set_len(cache, seq[i], len0[i]);
            if (cache->lo[seq[i]] > len0[i]) /* a ring overwrote everything it held */
                cache->lo[seq[i]] = len0[i];
        }
    mha__free(alloc, ws);
    if (!st)
        mha__ok(err);
    return st;
}

mha_status mha_layer_prefill(const mha_layer *layer,
                             mha_kv_cache *cache,
                             const mha_decode_args *args,
                             const mha_exec *exec,
                             mha_error *err) {
    return layer_step(layer, cache, args, exec, err);
}

mha_status mha_layer_decode_step(const mha_layer *layer,
                                 mha_kv_cache *cache,
                                 const mha_decode_args *args,
                                 const mha_exec *exec,
                                 mha_error *err) {
    return layer_step(layer, cache, args, exec, err);
}
