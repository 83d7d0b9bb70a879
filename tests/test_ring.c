/* SPDX-License-Identifier: MIT */
/* test_ring.c: ring attention over MPI (mha_mpi.h) against the single-process core. Run by ctest
 * under mpirun with 1 to 4 processes. Every rank makes the same global Q, K, V (seeded), computes
 * the single-process mha_attention on the whole sequence, then its shard with mha_ring_attention,
 * and checks its rows of the output and lse against the single-process ones with the core's gate
 * (tests/common/tolerance.h): max|o - o_1| <= TOL_OUT_REL max|o_1|, |lse - lse_1| <=
 * TOL_OUT_REL max(1, |lse_1|); then the backward (mha_ring_attention_backward vs
 * mha_attention_backward, each gradient within TOL_GRAD_REL max|g_1|). Also: the shard layouts
 * tile the sequence, and bad arguments on one rank make every rank return that rank's error.
 * Each rank prints its "N passed, N failed". */
#include "harness.h"
#include "mha_mpi.h"
#include "tolerance.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int g_rank, g_size;

/* mha_ring_shard: the chunks of all ranks cover [0, N) once, sizes differ by at most one, and
 * zigzag's rank r holds chunks r and 2P-1-r. */
static void test_shards(void) {
    const int64_t lens[] = {8, 9, 37, 100};
    for (int layout = 0; layout < 2; layout++)
        for (int32_t p = 1; p <= 5; p++)
            for (size_t s = 0; s < sizeof lens / sizeof lens[0]; s++) {
                mha_ring_config cfg = {lens[s], (mha_shard_layout)layout};
                const int64_t chunks = layout ? 2 * p : p;
                if (lens[s] < chunks)
                    continue;
                char *seen = calloc((size_t)lens[s], 1);
                int ok = 1;
                int64_t lo = lens[s], hi = 0;
                for (int32_t r = 0; r < p; r++) {
                    int32_t nc;
                    int64_t start[2], len[2];
                    mha_error err;
                    ok &= mha_ring_shard(&cfg, p, r, &nc, start, len, &err) == MHA_STATUS_OK;
                    ok &= nc == (layout ? 2 : 1);
                    for (int32_t c = 0; c < nc; c++) {
                        for (int64_t i = start[c]; i < start[c] + len[c]; i++)
                            seen[i]++;
                        lo = len[c] < lo ? len[c] : lo;
                        hi = len[c] > hi ? len[c] : hi;
                    }
                    if (layout)
                        ok &= start[0] < start[1];
                }
                for (int64_t i = 0; i < lens[s]; i++)
                    ok &= seen[i] == 1;
                CHECK(ok && hi - lo <= 1, "shards: layout %d, P=%d, N=%lld", layout, (int)p,
                      (long long)lens[s]);
                free(seen);
            }
    /* N < C (docs/distributed.md): the same formula, chunks 0 .. N-1 of one row and the others
     * empty; every row once, and N = 0 refused. Zigzag N = 3 over P = 2: rank 0 holds chunk 0 =
     * [0, 1) and the empty chunk 3 (at 3), rank 1 chunks 1 = [1, 2) and 2 = [2, 3). */
    for (int layout = 0; layout < 2; layout++)
        for (int32_t p = 1; p <= 5; p++)
            for (int64_t n = 1; n < (layout ? 2 : 1) * p; n++) {
                mha_ring_config cfg = {n, (mha_shard_layout)layout};
                int seen[10] = {0}, ok = 1;
                for (int32_t r = 0; r < p; r++) {
                    int32_t nc = 0; /* as if empty when refused (f265811 refused N < C) */
                    int64_t start[2] = {0, 0}, len[2] = {0, 0};
                    mha_error err;
                    ok &= mha_ring_shard(&cfg, p, r, &nc, start, len, &err) == MHA_STATUS_OK;
                    ok &= nc == (layout ? 2 : 1);
                    const int64_t chunk[2] = {r, 2 * (int64_t)p - 1 - r};
                    for (int32_t c = 0; c < nc; c++) {
                        ok &= len[c] == (chunk[c] < n ? 1 : 0);
                        ok &= start[c] == (chunk[c] < n ? chunk[c] : n);
                        for (int64_t i = start[c]; i < start[c] + len[c]; i++)
                            seen[i]++;
                    }
                }
                for (int64_t i = 0; i < n; i++)
                    ok &= seen[i] == 1;
                CHECK(ok, "shards: layout %d, P=%d, N=%lld < C: one row per chunk, then empty",
                      layout, (int)p, (long long)n);
            }
    mha_ring_config small = {3, MHA_SHARD_ZIGZAG};
    int32_t nc;
    int64_t start[2], len[2];
    mha_error err;
    CHECK(mha_ring_shard(&small, 2, 0, &nc, start, len, &err) == MHA_STATUS_OK && nc == 2 &&
              start[0] == 0 && len[0] == 1 && start[1] == 3 && len[1] == 0,
          "N=3 zigzag over 2 ranks: rank 0 holds row 0 and an empty chunk");
    small.seq_len = 0;
    CHECK(mha_ring_shard(&small, 2, 0, &nc, start, len, &err) == MHA_STATUS_INVALID_ARG &&
              strstr(err.message, "seq_len=0"),
          "N=0 is refused: %s", err.message);
}

typedef struct ring_case {
    int64_t B, h, g, n, dk, dv;
    int causal;
    mha_shard_layout layout;
    int blhd;           /* local tensors as [B, L, h, d] (else [B, h, L, d]) */
    double softcap;     /* 0 = off */
    int accumulate_too; /* also check the backward's accumulate */
    int64_t window[2];  /* use_window with (left, right) when either is not -2 */
    int alibi;
    int sinks;       /* learned sink logits */
    int key_padding; /* 0: none, 1: I64 [B, N], 2: BOOL [N], 3: U8 [1, N] */
    int segments;    /* q and kv segment ids [B, N] */
    int dropout;     /* dropout in training, p = 0.25 */
} ring_case;

/* The masks of a case, global ([B, N] / [N] / [h]) and this rank's rows. */
typedef struct case_masks {
    float sinks[8];
    int64_t *kp64;
    uint8_t *kp8;
    int32_t *qseg, *kseg;
} case_masks;

/* Global masks: key padding hides key 0 on batch row 0 (a causal row 0 there is fully masked),
 * every 5th key and, on batch row 1, the last 3; segments of 5 queries and 7 keys, so some rows
 * see no key of their segment (fully masked). */
static void make_masks(const ring_case *rc, test_rng *r, case_masks *m) {
    const int64_t B = rc->B, n = rc->n;
    memset(m, 0, sizeof *m);
    test_fill_normal(r, m->sinks, rc->h, 1.0f);
    if (rc->key_padding == 1) {
        m->kp64 = malloc(sizeof(int64_t) * (size_t)(B * n));
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < n; j++)
                m->kp64[b * n + j] = (j + b) % 5 != 0 && !(b == 1 && j >= n - 3) ? 7 : 0;
    } else if (rc->key_padding >= 2) {
        m->kp8 = malloc((size_t)n);
        for (int64_t j = 0; j < n; j++)
            m->kp8[j] = j % 4 != 0;
    }
    if (rc->segments) {
        m->qseg = malloc(sizeof(int32_t) * (size_t)(B * n));
        m->kseg = malloc(sizeof(int32_t) * (size_t)(B * n));
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < n; i++) {
                m->qseg[b * n + i] = (int32_t)((i + b) / 5);
                m->kseg[b * n + i] = (int32_t)((i + b) / 7);
            }
    }
}

static void free_masks(case_masks *m) {
    free(m->kp64), free(m->kp8), free(m->qseg), free(m->kseg);
}

/* Copies the rank's rows of per-row arrays [rows, N] of `size`-byte elements into [rows, nl]. */
static void gather_ids(const void *g,
                       size_t size,
                       int64_t rows,
                       int64_t n,
                       void *l,
                       int32_t nc,
                       const int64_t start[2],
                       const int64_t len[2]) {
    const int64_t nl = len[0] + (nc > 1 ? len[1] : 0);
    for (int64_t b = 0; b < rows; b++) {
        int64_t li = 0;
        for (int32_t c = 0; c < nc; c++)
            for (int64_t i = start[c]; i < start[c] + len[c]; i++, li++)
                memcpy((char *)l + (size_t)(b * nl + li) * size,
                       (const char *)g + (size_t)(b * n + i) * size, size);
    }
}

/* Sets the masks of `m` on args of `rows` sequence rows (the global call: the arrays of m; the
 * local one: their rows gathered into `local`, freed by the caller). */
static void set_masks(const ring_case *rc,
                      const case_masks *m,
                      mha_attention_args *a,
                      int32_t nc,
                      const int64_t start[2],
                      const int64_t len[2],
                      void *local[3]) {
    const int64_t B = rc->B, n = rc->n, rows = a->q_len;
    mha_masking *mk = &a->mask;
    a->sinks = rc->sinks ? m->sinks : NULL;
    if (rc->dropout) /* the whole sequence's mask: the ring places each pair (row/col offsets) */
        a->dropout.p = 0.25f, a->dropout.seed = 0x5eed0000abcdull, a->dropout.training = 1;
    if (rc->key_padding) {
        const int wide = rc->key_padding == 1;
        const size_t size = wide ? sizeof(int64_t) : 1;
        const void *g = wide ? (const void *)m->kp64 : (const void *)m->kp8;
        mk->key_padding.data = g;
        if (local) {
            local[0] = malloc(size * (size_t)((wide ? B : 1) * rows));
            gather_ids(g, size, wide ? B : 1, n, local[0], nc, start, len);
            mk->key_padding.data = local[0];
        }
        const int one_row = rc->key_padding == 3; /* [1, N]: broadcast over the batch */
        mk->key_padding.dtype = wide ? MHA_DTYPE_I64 : one_row ? MHA_DTYPE_U8 : MHA_DTYPE_BOOL;
        mk->key_padding.ndim = wide || one_row ? 2 : 1;
        mk->key_padding.shape[0] = wide ? B : one_row ? 1 : rows;
        mk->key_padding.shape[1] = rows;
    }
    if (rc->segments) {
        mk->q_segment_ids = m->qseg, mk->kv_segment_ids = m->kseg;
        if (local) {
            local[1] = malloc(sizeof(int32_t) * (size_t)(B * rows));
            local[2] = malloc(sizeof(int32_t) * (size_t)(B * rows));
            gather_ids(m->qseg, sizeof(int32_t), B, n, local[1], nc, start, len);
            gather_ids(m->kseg, sizeof(int32_t), B, n, local[2], nc, start, len);
            mk->q_segment_ids = local[1], mk->kv_segment_ids = local[2];
        }
    }
}

/* Strides of a [B, heads, L, d] view stored as [B, L, heads, d] (blhd) or [B, heads, L, d]. */
static void strides_of(int blhd, int64_t heads, int64_t len, int64_t d, int64_t s[3]) {
    s[0] = heads * len * d;
    s[1] = blhd ? d : len * d;
    s[2] = blhd ? heads * d : d;
}

/* Copies global rows of a [B, heads, N, d] contiguous tensor into the local view. */
static void gather_rows(const float *g,
                        int64_t B,
                        int64_t heads,
                        int64_t n,
                        int64_t d,
                        float *l,
                        const int64_t ls[3],
                        int32_t nc,
                        const int64_t start[2],
                        const int64_t len[2]) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t hh = 0; hh < heads; hh++) {
            int64_t li = 0;
            for (int32_t c = 0; c < nc; c++)
                for (int64_t i = start[c]; i < start[c] + len[c]; i++, li++)
                    memcpy(l + b * ls[0] + hh * ls[1] + li * ls[2],
                           g + ((b * heads + hh) * n + i) * d, sizeof(float) * (size_t)d);
        }
}

/* max |local - global| over this rank's rows of a [B, heads, N, d] tensor. */
static double worst_rows(const float *l,
                         const int64_t ls[3],
                         const float *g,
                         int64_t B,
                         int64_t heads,
                         int64_t n,
                         int64_t d,
                         int32_t nc,
                         const int64_t start[2],
                         const int64_t len[2]) {
    double worst = 0.0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t hh = 0; hh < heads; hh++) {
            int64_t li = 0;
            for (int32_t c = 0; c < nc; c++)
                for (int64_t i = start[c]; i < start[c] + len[c]; i++, li++)
                    for (int64_t e = 0; e < d; e++) {
                        const double x = fabs((double)l[b * ls[0] + hh * ls[1] + li * ls[2] + e] -
                                              (double)g[((b * heads + hh) * n + i) * d + e]);
                        worst = fmax(worst, isnan(x) ? HUGE_VAL : x);
                    }
        }
    return worst;
}

static double max_abs(const float *x, int64_t count) {
    double m = 0.0;
    for (int64_t e = 0; e < count; e++)
        m = fmax(m, fabs((double)x[e]));
    return m;
}

static void run_case(const ring_case *rc, uint64_t seed) {
    const int64_t B = rc->B, h = rc->h, g = rc->g, n = rc->n, dk = rc->dk, dv = rc->dv;
    test_rng r;
    test_rng_seed(&r, seed);
    float *q = malloc(sizeof(float) * (size_t)(B * h * n * dk));
    float *k = malloc(sizeof(float) * (size_t)(B * g * n * dk));
    float *v = malloc(sizeof(float) * (size_t)(B * g * n * dv));
    float *o1 = malloc(sizeof(float) * (size_t)(B * h * n * dv));
    float *lse1 = malloc(sizeof(float) * (size_t)(B * h * n));
    test_fill_normal(&r, q, B * h * n * dk, 1.0f);
    test_fill_normal(&r, k, B * g * n * dk, 1.0f);
    test_fill_normal(&r, v, B * g * n * dv, 1.0f);

    /* The single-process call on the whole sequence, [B, heads, N, d] contiguous. */
    mha_attention_args a = {0};
    a.batch = B, a.num_heads = h, a.num_kv_heads = g, a.q_len = n, a.kv_len = n;
    a.head_dim = dk, a.v_head_dim = dv, a.softcap = rc->softcap;
    a.q = q, a.k = k, a.v = v, a.out = o1, a.lse = lse1;
    strides_of(0, h, n, dk, a.q_strides);
    strides_of(0, g, n, dk, a.k_strides);
    strides_of(0, g, n, dv, a.v_strides);
    strides_of(0, h, n, dv, a.out_strides);
    a.mask.causal = rc->causal;
    a.mask.use_window = rc->window[0] != -2 || rc->window[1] != -2;
    a.mask.window_left = rc->window[0], a.mask.window_right = rc->window[1];
    a.alibi = rc->alibi;
    case_masks cm;
    make_masks(rc, &r, &cm);
    set_masks(rc, &cm, &a, 0, NULL, NULL, NULL);
    mha_error err;
    CHECK_OK(mha_attention(&a, NULL, &err), &err);

    /* This rank's shard. */
    mha_ring_config cfg = {n, rc->layout};
    int32_t nc = 1; /* an empty shard if mha_ring_shard fails */
    int64_t start[2] = {0, 0}, len[2] = {0, 0};
    CHECK_OK(mha_ring_shard(&cfg, g_size, g_rank, &nc, start, len, &err), &err);
    const int64_t nl = len[0] + (nc > 1 ? len[1] : 0);
    mha_attention_args l = a;
    l.q_len = l.kv_len = nl;
    float *lq = malloc(sizeof(float) * (size_t)(B * h * nl * dk));
    float *lk = malloc(sizeof(float) * (size_t)(B * g * nl * dk));
    float *lv = malloc(sizeof(float) * (size_t)(B * g * nl * dv));
    float *lo = malloc(sizeof(float) * (size_t)(B * h * nl * dv));
    float *llse = malloc(sizeof(float) * (size_t)(B * h * nl));
    strides_of(rc->blhd, h, nl, dk, l.q_strides);
    strides_of(rc->blhd, g, nl, dk, l.k_strides);
    strides_of(rc->blhd, g, nl, dv, l.v_strides);
    strides_of(rc->blhd, h, nl, dv, l.out_strides);
    gather_rows(q, B, h, n, dk, lq, l.q_strides, nc, start, len);
    gather_rows(k, B, g, n, dk, lk, l.k_strides, nc, start, len);
    gather_rows(v, B, g, n, dv, lv, l.v_strides, nc, start, len);
    l.q = lq, l.k = lk, l.v = lv, l.out = lo, l.lse = llse;
    if (nl == 0) { /* a rank without rows (N < C) may pass no row tensor at all */
        l.q = l.k = l.v = NULL;
        l.out = l.lse = NULL;
    }
    void *lmask[3] = {NULL, NULL, NULL};
    set_masks(rc, &cm, &l, nc, start, len, lmask);
    mha_exec ex = {MHA_IMPL_AUTO, 1, NULL, 0, NULL, NULL};
    CHECK_OK(mha_ring_attention(MPI_COMM_WORLD, &cfg, &l, &ex, &err), &err);

    /* With sinks, the fold also runs on the ring's own lse (the caller passes none): the same
     * output bits. */
    if (rc->sinks) {
        float *lo2 = malloc(sizeof(float) * (size_t)(B * h * nl * dv));
        mha_attention_args l2 = l;
        l2.out = lo2, l2.lse = NULL;
        CHECK_OK(mha_ring_attention(MPI_COMM_WORLD, &cfg, &l2, &ex, &err), &err);
        CHECK(memcmp(lo, lo2, sizeof(float) * (size_t)(B * h * nl * dv)) == 0,
              "rank %d/%d: sinks without the caller's lse give the same output", g_rank, g_size);
        free(lo2);
    }
    /* Compare this rank's rows with the single-process ones. */
    const double scale = max_abs(o1, B * h * n * dv);
    const double worst = worst_rows(lo, l.out_strides, o1, B, h, n, dv, nc, start, len);
    double worst_lse = 0.0;
    for (int64_t bh = 0; bh < B * h; bh++) {
        int64_t li = 0;
        for (int32_t c = 0; c < nc; c++)
            for (int64_t i = start[c]; i < start[c] + len[c]; i++, li++) {
                const double l_ref = (double)lse1[bh * n + i], l_got = (double)llse[bh * nl + li];
                /* equal infinities (fully masked rows: -inf) agree */
                const double el =
                    l_got == l_ref ? 0.0 : fabs(l_got - l_ref) / fmax(1.0, fabs(l_ref));
                worst_lse = fmax(worst_lse, isnan(el) ? HUGE_VAL : el);
            }
    }
    CHECK(worst <= TOL_OUT_REL * scale,
          "rank %d/%d %s %s B=%lld h=%lld g=%lld N=%lld: max|o-o1|=%.3g, max|o1|=%.3g", g_rank,
          g_size, rc->layout ? "zigzag" : "contiguous", rc->causal ? "causal" : "full",
          (long long)B, (long long)h, (long long)g, (long long)n, worst, scale);
    CHECK(worst_lse <= TOL_OUT_REL, "rank %d/%d %s %s N=%lld: max|lse-lse1|/max(1,|lse1|)=%.3g",
          g_rank, g_size, rc->layout ? "zigzag" : "contiguous", rc->causal ? "causal" : "full",
          (long long)n, worst_lse);

    /* Backward: the single-process gradients of a random dO, then the ring's. */
    float *dout = malloc(sizeof(float) * (size_t)(B * h * n * dv));
    float *dq1 = malloc(sizeof(float) * (size_t)(B * h * n * dk));
    float *dk1 = malloc(sizeof(float) * (size_t)(B * g * n * dk));
    float *dv1 = malloc(sizeof(float) * (size_t)(B * g * n * dv));
    test_fill_normal(&r, dout, B * h * n * dv, 1.0f);
    mha_attention_grads g1 = {0};
    float dsinks1[8] = {0}, ldsinks[8] = {0};
    g1.dout = dout, g1.dq = dq1, g1.dk = dk1, g1.dv = dv1, g1.dsinks = rc->sinks ? dsinks1 : NULL;
    memcpy(g1.dout_strides, a.out_strides, sizeof a.out_strides);
    memcpy(g1.dq_strides, a.q_strides, sizeof a.q_strides);
    memcpy(g1.dk_strides, a.k_strides, sizeof a.k_strides);
    memcpy(g1.dv_strides, a.v_strides, sizeof a.v_strides);
    CHECK_OK(mha_attention_backward(&a, &g1, NULL, &err), &err);
    float *ldout = malloc(sizeof(float) * (size_t)(B * h * nl * dv));
    float *ldq = malloc(sizeof(float) * (size_t)(B * h * nl * dk));
    float *ldk = malloc(sizeof(float) * (size_t)(B * g * nl * dk));
    float *ldv = malloc(sizeof(float) * (size_t)(B * g * nl * dv));
    gather_rows(dout, B, h, n, dv, ldout, l.out_strides, nc, start, len);
    mha_attention_grads lg = {0};
    lg.dout = ldout, lg.dq = ldq, lg.dk = ldk, lg.dv = ldv, lg.dsinks = rc->sinks ? ldsinks : NULL;
    if (nl == 0)
        lg.dout = NULL, lg.dq = lg.dk = lg.dv = NULL;
    memcpy(lg.dout_strides, l.out_strides, sizeof l.out_strides);
    memcpy(lg.dq_strides, l.q_strides, sizeof l.q_strides);
    memcpy(lg.dk_strides, l.k_strides, sizeof l.k_strides);
    memcpy(lg.dv_strides, l.v_strides, sizeof l.v_strides);
    CHECK_OK(mha_ring_attention_backward(MPI_COMM_WORLD, &cfg, &l, &lg, &ex, &err), &err);
    const struct {
        const char *name;
        const float *local, *global;
        const int64_t *ls;
        int64_t heads, d;
    } gt[3] = {{"dq", ldq, dq1, l.q_strides, h, dk},
               {"dk", ldk, dk1, l.k_strides, g, dk},
               {"dv", ldv, dv1, l.v_strides, g, dv}};
    for (int t = 0; t < 3; t++) {
        const double gs = max_abs(gt[t].global, B * gt[t].heads * n * gt[t].d);
        const double gw = worst_rows(gt[t].local, gt[t].ls, gt[t].global, B, gt[t].heads, n,
                                     gt[t].d, nc, start, len);
        CHECK(gw <= TOL_GRAD_REL * gs, "rank %d/%d %s %s N=%lld: max|%s-%s1|=%.3g, max|%s1|=%.3g",
              g_rank, g_size, rc->layout ? "zigzag" : "contiguous", rc->causal ? "causal" : "full",
              (long long)n, gt[t].name, gt[t].name, gw, gt[t].name, gs);
    }
    if (rc->sinks) { /* summed over every rank's rows: the whole dsinks on every rank */
        const double ds = max_abs(dsinks1, h);
        double dw = 0.0;
        for (int64_t e = 0; e < h; e++) {
            const double x = fabs((double)ldsinks[e] - (double)dsinks1[e]);
            dw = fmax(dw, isnan(x) ? HUGE_VAL : x);
        }
        CHECK(dw <= TOL_GRAD_REL * ds,
              "rank %d/%d %s %s N=%lld: max|dsinks-dsinks1|=%.3g, max=%.3g", g_rank, g_size,
              rc->layout ? "zigzag" : "contiguous", rc->causal ? "causal" : "full", (long long)n,
              dw, ds);
    }
    /* accumulate: a second call adds the same gradients (dq, dk, dv become 2x, exactly up to the
     * one rounding of the sum: the second call's sums are the first's bits). */
    if (rc->accumulate_too) {
        lg.accumulate = 1;
        float *copy = malloc(sizeof(float) * (size_t)(B * g * nl * dk));
        memcpy(copy, ldk, sizeof(float) * (size_t)(B * g * nl * dk));
        CHECK_OK(mha_ring_attention_backward(MPI_COMM_WORLD, &cfg, &l, &lg, &ex, &err), &err);
        int same = 1;
        for (int64_t e = 0; e < B * g * nl * dk; e++)
            same &= ldk[e] == 2.0f * copy[e];
        CHECK(same, "rank %d/%d: accumulate adds the same dk", g_rank, g_size);
        free(copy);
    }
    free(dout), free(dq1), free(dk1), free(dv1), free(ldout), free(ldq), free(ldk), free(ldv);
    free(q), free(k), free(v), free(o1), free(lse1);
    free(lq), free(lk), free(lv), free(lo), free(llse);
    free(lmask[0]), free(lmask[1]), free(lmask[2]);
    free_masks(&cm);
}

static void test_matches_single_process(void) {
    /* B h g N d_k d_v: GQA (h/g = 2, MQA), N divisible by no chunk count (uneven shards), 1 row
     * per chunk at the smallest, and a longer sequence whose blocks exceed the kernels' tiles. */
    const int64_t shapes[][6] = {
        {2, 4, 2, 37, 16, 8}, {1, 3, 1, 8, 8, 12}, {1, 2, 2, 203, 64, 64}, {2, 2, 1, 16, 32, 32}};
    /* MHA_TEST_QUICK=1 (sanitizer builds): without the long sequence, fewer window cases. */
    const int skip_long = test_quick();
    uint64_t seed = 1;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int layout = 0; layout < 2; layout++)
            for (int causal = 0; causal < 2; causal++) {
                const int64_t *sh = shapes[s];
                if (sh[3] < (layout ? 2 : 1) * g_size || (skip_long && sh[3] > 100))
                    continue;
                const ring_case rc = {sh[0],
                                      sh[1],
                                      sh[2],
                                      sh[3],
                                      sh[4],
                                      sh[5],
                                      causal,
                                      (mha_shard_layout)layout,
                                      (int)(s & 1u),
                                      s == 3 ? 20.0 : 0.0,
                                      s == 0,
                                      {-2, -2},
                                      0,
                                      0,
                                      0,
                                      0,
                                      0};
                run_case(&rc, seed++);
            }
    /* Windows and ALiBi (placed by global positions too), on two shapes (MHA_TEST_QUICK: the
     * smaller one). */
    const struct {
        int64_t left, right;
        int alibi;
    } extra[] = {{3, 0, 0}, {5, 2, 0}, {-1, 4, 0}, {-2, -2, 1}, {6, -1, 1}};
    for (size_t s = skip_long ? 1 : 0; s < 2; s++)
        for (int layout = 0; layout < 2; layout++)
            for (int causal = 0; causal < 2; causal++)
                for (size_t x = 0; x < sizeof extra / sizeof extra[0]; x++) {
                    const int64_t *sh = shapes[s];
                    if (sh[3] < (layout ? 2 : 1) * g_size)
                        continue;
                    const ring_case rc = {sh[0],
                                          sh[1],
                                          sh[2],
                                          sh[3],
                                          sh[4],
                                          sh[5],
                                          causal,
                                          (mha_shard_layout)layout,
                                          (int)(s & 1u),
                                          0.0,
                                          0,
                                          {extra[x].left, extra[x].right},
                                          extra[x].alibi,
                                          0,
                                          0,
                                          0,
                                          0};
                    run_case(&rc, seed++);
                }
    /* Sinks, key padding (I64 [B, N], BOOL [N], U8 [1, N]), segment ids and dropout (the whole
     * sequence's mask, drawn pair by pair at global rows and columns), alone and with a window or
     * ALiBi, on the same two shapes; all of them on the long one. MHA_TEST_QUICK: the two
     * combinations on the first shape (B = 2, GQA). */
    const struct {
        int sinks, key_padding, segments;
        int64_t left, right;
        int alibi, dropout;
    } masks[] = {{1, 0, 0, -2, -2, 0, 0}, {0, 1, 0, -2, -2, 0, 0}, {0, 2, 0, -2, -2, 0, 0},
                 {0, 0, 1, -2, -2, 0, 0}, {0, 0, 0, -2, -2, 0, 1}, {1, 1, 1, 4, 3, 0, 1},
                 {1, 3, 0, -2, -2, 1, 0}};
    for (size_t s = 0; s < 3; s++)
        for (int layout = 0; layout < 2; layout++)
            for (int causal = 0; causal < 2; causal++)
                for (size_t x = 0; x < sizeof masks / sizeof masks[0]; x++) {
                    const int64_t *sh = shapes[s];
                    if (sh[3] < (layout ? 2 : 1) * g_size || (skip_long && (s != 0 || x < 5)) ||
                        (s == 2 && x != 5))
                        continue;
                    const ring_case rc = {.B = sh[0],
                                          .h = sh[1],
                                          .g = sh[2],
                                          .n = sh[3],
                                          .dk = sh[4],
                                          .dv = sh[5],
                                          .causal = causal,
                                          .layout = (mha_shard_layout)layout,
                                          .blhd = (int)(s & 1u),
                                          .window = {masks[x].left, masks[x].right},
                                          .alibi = masks[x].alibi,
                                          .sinks = masks[x].sinks,
                                          .key_padding = masks[x].key_padding,
                                          .segments = masks[x].segments,
                                          .dropout = masks[x].dropout};
                    run_case(&rc, seed++);
                }
}

/* Sequences shorter than the chunk count (N < C: some chunks empty, some ranks without any row)
 * and the lengths around it: N = 1, 2, 3, P, 2P - 1, 2P, 2P + 1, both layouts, causal and not,
 * the forward and the backward against the single-process calls; plain (with accumulate), with
 * every per-row mask at once (sinks, key padding I64 [B, N], segment ids, a window, dropout) and
 * with ALiBi, softcap and key padding U8 [1, N]. The masks leave some rows no key (lse = -inf).
 * MHA_TEST_QUICK=1: the masks' kind at every N, the other two at N = 1 only. */
static void test_short_sequences(void) {
    const int64_t p = g_size, lens[] = {1, 2, 3, p, 2 * p - 1, 2 * p, 2 * p + 1};
    const int few = test_quick();
    uint64_t seed = 1000;
    for (size_t s = 0; s < sizeof lens / sizeof lens[0]; s++) {
        int again = 0;
        for (size_t t = 0; t < s; t++)
            again |= lens[t] == lens[s];
        for (int layout = 0; layout < 2 && !again; layout++)
            for (int causal = 0; causal < 2; causal++)
                for (int kind = 0; kind < 3; kind++) {
                    if (few && kind != 1 && lens[s] != 1)
                        continue;
                    ring_case rc = {.B = 2,
                                    .h = 2,
                                    .g = 1,
                                    .n = lens[s],
                                    .dk = 8,
                                    .dv = 4,
                                    .causal = causal,
                                    .layout = (mha_shard_layout)layout,
                                    .blhd = kind == 1,
                                    .accumulate_too = kind == 0,
                                    .window = {-2, -2}};
                    if (kind == 1) {
                        rc.sinks = 1, rc.key_padding = 1, rc.segments = 1, rc.dropout = 1;
                        rc.window[0] = 2, rc.window[1] = causal ? 0 : 1;
                    } else if (kind == 2) {
                        rc.alibi = 1, rc.key_padding = 3, rc.softcap = 5.0;
                    }
                    run_case(&rc, seed++);
                }
    }
}

/* One rank with bad arguments: every rank returns that rank's status, with its message. */

/* A mask function for the refusal check (the ring never calls it). */
static int32_t ring_fn_visible(void *ctx, int64_t b, int64_t h, int64_t i, int64_t j) {
    (void)ctx, (void)b, (void)h;
    return j <= i;
}
static void test_collective_errors(void) {
    const int64_t B = 1, h = 2, n = 4 * (int64_t)g_size, d = 8;
    mha_ring_config cfg = {n, MHA_SHARD_ZIGZAG};
    int32_t nc;
    int64_t start[2], len[2];
    mha_error err;
    mha_ring_shard(&cfg, g_size, g_rank, &nc, start, len, &err);
    const int64_t nl = len[0] + len[1];
    float *x = calloc((size_t)(B * h * nl * d), sizeof(float));
    float *o = calloc((size_t)(B * h * nl * d), sizeof(float));
    mha_attention_args a = {0};
    a.batch = B, a.num_heads = h, a.q_len = a.kv_len = nl, a.head_dim = d;
    a.q = a.k = a.v = x, a.out = o;
    strides_of(0, h, nl, d, a.q_strides);
    memcpy(a.k_strides, a.q_strides, sizeof a.q_strides);
    memcpy(a.v_strides, a.q_strides, sizeof a.q_strides);
    memcpy(a.out_strides, a.q_strides, sizeof a.q_strides);
    const int bad = g_size - 1;

    /* A NULL query on the last rank: INVALID_ARG everywhere, "rank P-1: ..." everywhere. */
    mha_attention_args b = a;
    if (g_rank == bad)
        b.q = NULL;
    mha_status st = mha_ring_attention(MPI_COMM_WORLD, &cfg, &b, NULL, &err);
    char prefix[32];
    snprintf(prefix, sizeof prefix, "rank %d: ", bad);
    CHECK(st == MHA_STATUS_INVALID_ARG && strncmp(err.message, prefix, strlen(prefix)) == 0,
          "NULL q on rank %d: rank %d got %s: %s", bad, g_rank, mha_status_string(st), err.message);
    /* An unsupported option on the last rank (probs): UNSUPPORTED everywhere, the message naming
     * the option. */
    float *probs = calloc((size_t)(B * h * nl * nl), sizeof(float));
    b = a;
    if (g_rank == bad)
        b.probs = probs;
    st = mha_ring_attention(MPI_COMM_WORLD, &cfg, &b, NULL, &err);
    CHECK(st == MHA_STATUS_UNSUPPORTED && strncmp(err.message, prefix, strlen(prefix)) == 0 &&
              strstr(err.message, "probs"),
          "probs on rank %d: rank %d got %s: %s", bad, g_rank, mha_status_string(st), err.message);
    free(probs);
    /* A mask function (issue 29) on every rank: UNSUPPORTED, the message naming it. */
    b = a;
    b.mask.mask_fn.visible = ring_fn_visible;
    st = mha_ring_attention(MPI_COMM_WORLD, &cfg, &b, NULL, &err);
    CHECK(st == MHA_STATUS_UNSUPPORTED && strstr(err.message, "mask function"),
          "mask_fn: rank %d got %s: %s", g_rank, mha_status_string(st), err.message);
    /* A chunk size (issue 31) on every rank: UNSUPPORTED, the message naming it. */
    b = a;
    b.mask.chunk_size = 4;
    st = mha_ring_attention(MPI_COMM_WORLD, &cfg, &b, NULL, &err);
    CHECK(st == MHA_STATUS_UNSUPPORTED && strstr(err.message, "chunk_size"),
          "chunk_size: rank %d got %s: %s", g_rank, mha_status_string(st), err.message);
    /* Masks that differ between ranks (each valid alone): sinks on one rank only, other sink
     * values on one rank, key padding or segment ids on one rank only, dropout on one rank only or
     * with another seed there, another scale or softcap there (each rank's rows used their own:
     * an output no single-process call gives). INVALID_ARG everywhere, naming the option. */
    if (g_size > 1) {
        const float sinks[2] = {0.5f, -1.0f}, other[2] = {0.5f, -1.5f};
        const uint8_t kp[64] = {1};
        int32_t seg[64] = {0};
        for (int opt = 0; opt < 8; opt++) {
            b = a;
            if (opt == 4 || opt == 5) /* dropout on the last rank only; another seed there */
                b.dropout.p = 0.1f, b.dropout.seed = 7, b.dropout.training = g_rank == bad;
            if (opt == 5)
                b.dropout.training = 1, b.dropout.seed = g_rank == bad ? 8 : 7;
            b.sinks = opt == 1 ? sinks : NULL;
            if (g_rank == bad && opt == 0)
                b.sinks = sinks;
            if (g_rank == bad && opt == 1)
                b.sinks = other;
            if (g_rank == bad && opt == 2) {
                b.mask.key_padding.data = kp;
                b.mask.key_padding.dtype = MHA_DTYPE_U8;
                b.mask.key_padding.ndim = 1;
                b.mask.key_padding.shape[0] = nl;
            }
            if (g_rank == bad && opt == 3)
                b.mask.q_segment_ids = b.mask.kv_segment_ids = seg;
            if (g_rank == bad && opt == 6)
                b.scale = 0.5;
            if (opt == 7)
                b.softcap = g_rank == bad ? 5.0 : 4.0;
            const char *name[8] = {"sinks",   "sinks[1]",     "key_padding", "segment ids",
                                   "dropout", "dropout.seed", "scale",       "softcap"};
            st = mha_ring_attention(MPI_COMM_WORLD, &cfg, &b, NULL, &err);
            CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, name[opt]),
                  "%s differ on rank %d: rank %d got %s: %s", name[opt], bad, g_rank,
                  mha_status_string(st), err.message);
        }
    }
    /* The default scale (0) on some ranks and its value 1/sqrt(d_k) on others agree. */
    b = a;
    if (g_rank == bad)
        b.scale = 1.0 / sqrt((double)d);
    CHECK_OK(mha_ring_attention(MPI_COMM_WORLD, &cfg, &b, NULL, &err), &err);
    /* A wrong local length on rank 0. */
    b = a;
    if (g_rank == 0)
        b.q_len = nl + 1;
    st = mha_ring_attention(MPI_COMM_WORLD, &cfg, &b, NULL, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strncmp(err.message, "rank 0: ", 8) == 0,
          "q_len on rank 0: rank %d got %s: %s", g_rank, mha_status_string(st), err.message);
    /* Ranks that disagree on the head count (each valid alone). */
    if (g_size > 1) {
        b = a;
        if (g_rank == bad)
            b.num_heads = 1;
        st = mha_ring_attention(MPI_COMM_WORLD, &cfg, &b, NULL, &err);
        CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "num_heads"),
              "num_heads differs on rank %d: rank %d got %s: %s", bad, g_rank,
              mha_status_string(st), err.message);
    }
    /* The backward without the forward's lse on the last rank. */
    float *lse = malloc(sizeof(float) * (size_t)(B * h * nl));
    float *dq = malloc(sizeof(float) * (size_t)(B * h * nl * d));
    b = a;
    b.lse = lse;
    CHECK_OK(mha_ring_attention(MPI_COMM_WORLD, &cfg, &b, NULL, &err), &err);
    mha_attention_grads gr = {0};
    gr.dout = x, gr.dq = dq;
    memcpy(gr.dout_strides, a.q_strides, sizeof a.q_strides);
    memcpy(gr.dq_strides, a.q_strides, sizeof a.q_strides);
    if (g_rank == bad)
        b.lse = NULL;
    st = mha_ring_attention_backward(MPI_COMM_WORLD, &cfg, &b, &gr, NULL, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strncmp(err.message, prefix, strlen(prefix)) == 0,
          "backward without lse on rank %d: rank %d got %s: %s", bad, g_rank, mha_status_string(st),
          err.message);
    /* A gradient of lse on the last rank: the ring backward takes none (UNSUPPORTED everywhere). */
    b.lse = lse;
    if (g_rank == bad)
        gr.dlse = lse;
    st = mha_ring_attention_backward(MPI_COMM_WORLD, &cfg, &b, &gr, NULL, &err);
    CHECK(st == MHA_STATUS_UNSUPPORTED && strncmp(err.message, prefix, strlen(prefix)) == 0 &&
              (g_rank != bad || strstr(err.message, "dlse")),
          "backward with dlse on rank %d: rank %d got %s: %s", bad, g_rank, mha_status_string(st),
          err.message);
    gr.dlse = NULL;
    if (g_rank == bad) /* and of the probabilities */
        gr.dprobs = lse;
    st = mha_ring_attention_backward(MPI_COMM_WORLD, &cfg, &b, &gr, NULL, &err);
    CHECK(st == MHA_STATUS_UNSUPPORTED && strncmp(err.message, prefix, strlen(prefix)) == 0 &&
              (g_rank != bad || strstr(err.message, "dprobs")),
          "backward with dprobs on rank %d: rank %d got %s: %s", bad, g_rank, mha_status_string(st),
          err.message);
    gr.dprobs = NULL;
    free(lse), free(dq);
    /* And the same call with good arguments still works afterwards, without lse. */
    st = mha_ring_attention(MPI_COMM_WORLD, &cfg, &a, NULL, &err);
    CHECK(st == MHA_STATUS_OK, "good call after errors: rank %d got %s: %s", g_rank,
          mha_status_string(st), err.message);
    free(x), free(o);
}

/* A rank without rows (N = 1: every rank but 0) is still checked: its local length must be 0,
 * and its sizes and options must agree with the others' (here: another head count, or no key
 * padding where rank 0 gives it), each an error on every rank; a good call afterwards works. */
static void test_empty_rank_errors(void) {
    if (g_size < 2)
        return;
    const int64_t B = 1, h = 2, d = 8;
    mha_ring_config cfg = {1, MHA_SHARD_ZIGZAG};
    const int64_t nl = g_rank == 0 ? 1 : 0;
    float x[16] = {0}, o[16] = {0};
    const uint8_t kp[1] = {1};
    mha_attention_args a = {0};
    a.batch = B, a.num_heads = h, a.q_len = a.kv_len = nl, a.head_dim = d;
    a.q = a.k = a.v = x, a.out = o;
    strides_of(0, h, 1, d, a.q_strides);
    memcpy(a.k_strides, a.q_strides, sizeof a.q_strides);
    memcpy(a.v_strides, a.q_strides, sizeof a.q_strides);
    memcpy(a.out_strides, a.q_strides, sizeof a.q_strides);
    const int bad = g_size - 1;
    char prefix[32];
    snprintf(prefix, sizeof prefix, "rank %d: ", bad);
    mha_error err;
    mha_attention_args b = a;
    if (g_rank == bad)
        b.q_len = b.kv_len = 1;
    mha_status st = mha_ring_attention(MPI_COMM_WORLD, &cfg, &b, NULL, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, prefix) &&
              strstr(err.message, "q_len"),
          "N=1, one row on empty rank %d: rank %d got %s: %s", bad, g_rank, mha_status_string(st),
          err.message);
    b = a;
    if (g_rank == bad)
        b.num_heads = 1;
    st = mha_ring_attention(MPI_COMM_WORLD, &cfg, &b, NULL, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "num_heads"),
          "N=1, num_heads differs on empty rank %d: rank %d got %s: %s", bad, g_rank,
          mha_status_string(st), err.message);
    b = a;
    if (g_rank == 0) {
        b.mask.key_padding.data = kp;
        b.mask.key_padding.dtype = MHA_DTYPE_U8;
        b.mask.key_padding.ndim = 1;
        b.mask.key_padding.shape[0] = 1;
    }
    st = mha_ring_attention(MPI_COMM_WORLD, &cfg, &b, NULL, &err);
    CHECK(st == MHA_STATUS_INVALID_ARG && strstr(err.message, "key_padding"),
          "N=1, key padding on rank 0 only: rank %d got %s: %s", g_rank, mha_status_string(st),
          err.message);
    b = a;
    if (g_rank != 0)
        b.q = b.k = b.v = NULL, b.out = NULL;
    st = mha_ring_attention(MPI_COMM_WORLD, &cfg, &b, NULL, &err);
    CHECK(st == MHA_STATUS_OK, "N=1, good call: rank %d got %s: %s", g_rank, mha_status_string(st),
          err.message);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    test_shards();
    test_matches_single_process();
    test_short_sequences();
    test_collective_errors();
    test_empty_rank_errors();
    const int rc = test_finish();
    MPI_Finalize();
    return rc;
}
