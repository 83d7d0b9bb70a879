/* SPDX-License-Identifier: MIT */
/* test_ring.c: ring attention over MPI (mha_mpi.h), run by ctest as `mpirun -np P` for P = 1..4.
 *
 * Every rank draws the same whole Q, K, V (same seed), computes the single-process result with
 * one mha_attention call over the whole sequence, then runs mha_ring_attention on its shard and
 * checks its output and lse rows against that result within the fast path's tolerance
 * (TOL_OUT_REL: the ring adds only the float32 rounding of the lse merges). Cases: causal and
 * not, CONTIGUOUS and ZIGZAG shards, sequence lengths that do not divide evenly, GQA and MQA,
 * d_k != d_v, sinks with soft-capping. Errors: a rank with bad arguments, or ranks that disagree
 * on the sequence length, make every rank return an error (the test would hang otherwise). */
#include "harness.h"
#include "mha_mpi.h"
#include "tolerance.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_rank, g_ranks;

typedef struct ring_case {
    int64_t B, h, g, N, dk, dv;
    int causal, sinks;
    mha_shard_layout layout;
} ring_case;

/* Copies rows of x [B, heads, N, d] that belong to `rank` into its shard [B, heads, n_local, d]. */
static void take_shard(const float *x,
                       int64_t B,
                       int64_t heads,
                       int64_t N,
                       int64_t d,
                       mha_shard_layout layout,
                       int rank,
                       float *dst) {
    int64_t start[2], count[2], n_local = 0;
    for (int p = 0; p < 2; p++) {
        mha_shard_rows(layout, N, g_ranks, rank, p, &start[p], &count[p], NULL);
        n_local += count[p];
    }
    for (int64_t bh = 0; bh < B * heads; bh++) {
        float *o = dst + bh * n_local * d;
        for (int p = 0; p < 2; p++) {
            memcpy(o, x + (bh * N + start[p]) * d, sizeof(float) * (size_t)(count[p] * d));
            o += count[p] * d;
        }
    }
}

static double max_abs(const float *x, int64_t n) {
    double m = 0.0;
    for (int64_t i = 0; i < n; i++)
        m = fmax(m, fabs((double)x[i]));
    return m;
}

static double max_diff(const float *a, const float *b, int64_t n) {
    double m = 0.0;
    for (int64_t i = 0; i < n; i++)
        m = fmax(m, fabs((double)a[i] - (double)b[i]));
    return m;
}

static void set_core(mha_attention_args *a, const ring_case *c, int64_t n) {
    memset(a, 0, sizeof *a);
    a->batch = c->B, a->num_heads = c->h, a->num_kv_heads = c->g;
    a->q_len = a->kv_len = n, a->head_dim = c->dk, a->v_head_dim = c->dv;
    a->q_strides[0] = c->h * n * c->dk, a->q_strides[1] = n * c->dk, a->q_strides[2] = c->dk;
    a->k_strides[0] = c->g * n * c->dk, a->k_strides[1] = n * c->dk, a->k_strides[2] = c->dk;
    a->v_strides[0] = c->g * n * c->dv, a->v_strides[1] = n * c->dv, a->v_strides[2] = c->dv;
    a->out_strides[0] = c->h * n * c->dv, a->out_strides[1] = n * c->dv, a->out_strides[2] = c->dv;
    a->mask.causal = c->causal;
    if (c->sinks)
        a->softcap = 30.0;
}

/* |got - want| <= TOL_GRAD_REL max|want| for a gradient's rows of this rank. */
static void check_grad(const char *name,
                       const float *whole,
                       int64_t heads,
                       int64_t d,
                       const float *got,
                       const ring_case *c) {
    const int64_t n = c->B * heads * c->N * d;
    int64_t rows = 0;
    for (int p = 0; p < 2; p++) {
        int64_t s, k;
        mha_shard_rows(c->layout, c->N, g_ranks, g_rank, p, &s, &k, NULL);
        rows += k;
    }
    float *want = malloc(sizeof(float) * (size_t)(c->B * heads * rows * d));
    take_shard(whole, c->B, heads, c->N, d, c->layout, g_rank, want);
    const double e = max_diff(got, want, c->B * heads * rows * d), sc = max_abs(whole, n);
    CHECK(e <= TOL_GRAD_REL * sc,
          "rank %d/%d %s causal=%d N=%lld g=%lld sinks=%d: ring backward %s vs one call: %.3g "
          "(max %.3g)",
          g_rank, g_ranks, c->layout == MHA_SHARD_ZIGZAG ? "zigzag" : "contiguous", c->causal,
          (long long)c->N, (long long)c->g, c->sinks, name, e, sc);
    free(want);
}

/* The ring backward (from the ring forward's out and lse) against one mha_attention_backward
 * over the whole sequence: dQ, dK, dV rows of this rank and dsinks (summed over the ranks). */
static void check_backward(const ring_case *c,
                           const mha_attention_args *whole,
                           const mha_ring_args *ring,
                           test_rng *r) {
    const int64_t B = c->B, h = c->h, g = c->g, N = c->N, dk = c->dk, dv = c->dv;
    const int64_t n = ring->local.q_len;
    float *dout = malloc(sizeof(float) * (size_t)(B * h * N * dv));
    test_fill_normal(r, dout, B * h * N * dv, 1.0f);
    float *dq = malloc(sizeof(float) * (size_t)(B * h * N * dk));
    float *dk_ = malloc(sizeof(float) * (size_t)(B * g * N * dk));
    float *dv_ = malloc(sizeof(float) * (size_t)(B * g * N * dv));
    float ds[8] = {0}, lds[8] = {0};
    mha_attention_grads gw = {0};
    gw.dout = dout, gw.dq = dq, gw.dk = dk_, gw.dv = dv_, gw.dsinks = c->sinks ? ds : NULL;
    memcpy(gw.dout_strides, whole->out_strides, sizeof gw.dout_strides);
    memcpy(gw.dq_strides, whole->q_strides, sizeof gw.dq_strides);
    memcpy(gw.dk_strides, whole->k_strides, sizeof gw.dk_strides);
    memcpy(gw.dv_strides, whole->v_strides, sizeof gw.dv_strides);
    mha_exec ex = {0};
    ex.n_threads = 1;
    mha_error err;
    CHECK_OK(mha_attention_backward(whole, &gw, &ex, &err), &err);
    float *ldout = malloc(sizeof(float) * (size_t)(B * h * n * dv));
    float *ldq = malloc(sizeof(float) * (size_t)(B * h * n * dk));
    float *ldk = malloc(sizeof(float) * (size_t)(B * g * n * dk));
    float *ldv = malloc(sizeof(float) * (size_t)(B * g * n * dv));
    take_shard(dout, B, h, N, dv, c->layout, g_rank, ldout);
    mha_attention_grads gl = {0};
    gl.dout = ldout, gl.dq = ldq, gl.dk = ldk, gl.dv = ldv, gl.dsinks = c->sinks ? lds : NULL;
    memcpy(gl.dout_strides, ring->local.out_strides, sizeof gl.dout_strides);
    memcpy(gl.dq_strides, ring->local.q_strides, sizeof gl.dq_strides);
    memcpy(gl.dk_strides, ring->local.k_strides, sizeof gl.dk_strides);
    memcpy(gl.dv_strides, ring->local.v_strides, sizeof gl.dv_strides);
    CHECK_OK(mha_ring_attention_backward(MPI_COMM_WORLD, ring, &gl, &ex, &err), &err);
    check_grad("dQ", dq, h, dk, ldq, c);
    check_grad("dK", dk_, g, dk, ldk, c);
    check_grad("dV", dv_, g, dv, ldv, c);
    if (c->sinks)
        CHECK(max_diff(lds, ds, h) <= TOL_GRAD_REL * max_abs(ds, h),
              "rank %d/%d: ring dsinks vs one call: %.3g", g_rank, g_ranks, max_diff(lds, ds, h));
    free(dout), free(dq), free(dk_), free(dv_), free(ldout), free(ldq), free(ldk), free(ldv);
}

static void run_case(const ring_case *c) {
    const int64_t B = c->B, h = c->h, g = c->g, N = c->N, dk = c->dk, dv = c->dv;
    test_rng r;
    test_rng_seed(&r, 1234 + (uint64_t)N);
    float *q = malloc(sizeof(float) * (size_t)(B * h * N * dk));
    float *k = malloc(sizeof(float) * (size_t)(B * g * N * dk));
    float *v = malloc(sizeof(float) * (size_t)(B * g * N * dv));
    float *out = malloc(sizeof(float) * (size_t)(B * h * N * dv));
    float *lse = malloc(sizeof(float) * (size_t)(B * h * N));
    float sinks[8];
    test_fill_normal(&r, q, B * h * N * dk, 1.0f);
    test_fill_normal(&r, k, B * g * N * dk, 1.0f);
    test_fill_normal(&r, v, B * g * N * dv, 1.0f);
    test_fill_normal(&r, sinks, 8, 1.0f);
    mha_exec ex = {0};
    ex.n_threads = 1;
    mha_error err;
    mha_attention_args whole;
    set_core(&whole, c, N);
    whole.q = q, whole.k = k, whole.v = v, whole.out = out, whole.lse = lse;
    whole.sinks = c->sinks ? sinks : NULL;
    CHECK_OK(mha_attention(&whole, &ex, &err), &err);

    int64_t n_local = 0;
    for (int p = 0; p < 2; p++) {
        int64_t s, n;
        mha_shard_rows(c->layout, N, g_ranks, g_rank, p, &s, &n, NULL);
        n_local += n;
    }
    float *lq = malloc(sizeof(float) * (size_t)(B * h * n_local * dk));
    float *lk = malloc(sizeof(float) * (size_t)(B * g * n_local * dk));
    float *lv = malloc(sizeof(float) * (size_t)(B * g * n_local * dv));
    float *lo = malloc(sizeof(float) * (size_t)(B * h * n_local * dv));
    float *ll = malloc(sizeof(float) * (size_t)(B * h * n_local));
    float *want_o = malloc(sizeof(float) * (size_t)(B * h * n_local * dv));
    float *want_l = malloc(sizeof(float) * (size_t)(B * h * n_local));
    take_shard(q, B, h, N, dk, c->layout, g_rank, lq);
    take_shard(k, B, g, N, dk, c->layout, g_rank, lk);
    take_shard(v, B, g, N, dv, c->layout, g_rank, lv);
    take_shard(out, B, h, N, dv, c->layout, g_rank, want_o);
    take_shard(lse, B, h, N, 1, c->layout, g_rank, want_l);

    mha_ring_args ra;
    memset(&ra, 0, sizeof ra);
    set_core(&ra.local, c, n_local);
    ra.local.q = lq, ra.local.k = lk, ra.local.v = lv, ra.local.out = lo, ra.local.lse = ll;
    ra.local.sinks = c->sinks ? sinks : NULL;
    ra.seq_len = N, ra.layout = c->layout;
    CHECK_OK(mha_ring_attention(MPI_COMM_WORLD, &ra, &ex, &err), &err);
    const double e = max_diff(lo, want_o, B * h * n_local * dv);
    const double el = max_diff(ll, want_l, B * h * n_local);
    CHECK(e <= TOL_OUT_REL * max_abs(want_o, B * h * n_local * dv) &&
              el <= TOL_OUT_REL * max_abs(want_l, B * h * n_local),
          "rank %d/%d %s causal=%d B=%lld h=%lld g=%lld N=%lld dk=%lld dv=%lld sinks=%d: ring vs "
          "one call: out %.3g, lse %.3g",
          g_rank, g_ranks, c->layout == MHA_SHARD_ZIGZAG ? "zigzag" : "contiguous", c->causal,
          (long long)B, (long long)h, (long long)g, (long long)N, (long long)dk, (long long)dv,
          c->sinks, e, el);
    check_backward(c, &whole, &ra, &r);
    free(q), free(k), free(v), free(out), free(lse);
    free(lq), free(lk), free(lv), free(lo), free(ll), free(want_o), free(want_l);
}

/* One rank's bad arguments (rank P-1: a wrong local length; no grads and no lse in the backward;
 * a different seq_len) make every rank fail: a rank that returned early while its peers wait
 * would hang the test. */
static void test_errors_agreed(void) {
    const ring_case c = {1, 2, 2, 16, 8, 8, 1, 0, MHA_SHARD_CONTIGUOUS};
    int64_t s, n;
    mha_shard_rows(c.layout, c.N, g_ranks, g_rank, 0, &s, &n, NULL);
    float *buf = calloc((size_t)(4 * 2 * c.N * 8), sizeof(float));
    for (int variant = 0; variant < 2; variant++) {
        mha_ring_args ra;
        memset(&ra, 0, sizeof ra);
        set_core(&ra.local, &c, n);
        ra.local.q = ra.local.k = ra.local.v = buf;
        ra.local.out = buf + 2 * 2 * c.N * 8;
        ra.seq_len = c.N, ra.layout = c.layout;
        const int culprit = g_rank == g_ranks - 1;
        if (culprit && variant == 0)
            ra.local.q_len = ra.local.kv_len = n + 1;
        if (culprit && variant == 1 && g_ranks > 1) {
            ra.seq_len = c.N + g_ranks; /* its own rows may still fit: the allreduce must see it */
            int64_t s2, n2;
            mha_shard_rows(c.layout, ra.seq_len, g_ranks, g_rank, 0, &s2, &n2, NULL);
            ra.local.q_len = ra.local.kv_len = n2;
        }
        mha_error err = {0};
        mha_status st = mha_ring_attention(MPI_COMM_WORLD, &ra, NULL, &err);
        if (variant == 0) { /* the backward: no lse and no grads on the culprit */
            float lse[2 * 16] = {0};
            ra.local.lse = culprit ? NULL : lse;
            ra.local.q_len = ra.local.kv_len = n;
            mha_attention_grads gr = {0};
            gr.dout = buf, gr.dq = buf + 2 * 2 * c.N * 8;
            memcpy(gr.dout_strides, ra.local.out_strides, sizeof gr.dout_strides);
            memcpy(gr.dq_strides, ra.local.q_strides, sizeof gr.dq_strides);
            mha_error err2 = {0};
            const mha_status st2 =
                mha_ring_attention_backward(MPI_COMM_WORLD, &ra, culprit ? NULL : &gr, NULL, &err2);
            CHECK(st2 == MHA_STATUS_INVALID_ARG && err2.message[0],
                  "rank %d/%d: the backward fails on every rank (status %d: %s)", g_rank, g_ranks,
                  (int)st2, err2.message);
        }
        if (variant == 0 || g_ranks > 1)
            CHECK(st == MHA_STATUS_INVALID_ARG && err.message[0],
                  "rank %d/%d variant %d: every rank fails (status %d: %s)", g_rank, g_ranks,
                  variant, (int)st, err.message);
    }
    free(buf);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_ranks);
    static const ring_case shapes[] = {
        {2, 4, 2, 37, 16, 24, 0, 0, MHA_SHARD_CONTIGUOUS}, /* GQA, d_k != d_v, N % P != 0 */
        {1, 4, 1, 64, 32, 32, 0, 1, MHA_SHARD_CONTIGUOUS}, /* MQA, sinks + soft-cap */
        {2, 3, 3, 29, 8, 8, 0, 0, MHA_SHARD_CONTIGUOUS},   /* MHA, 29 rows */
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (int causal = 0; causal < 2; causal++)
            for (int zz = 0; zz < 2; zz++) {
                ring_case c = shapes[i];
                c.causal = causal;
                c.layout = zz ? MHA_SHARD_ZIGZAG : MHA_SHARD_CONTIGUOUS;
                run_case(&c);
            }
    test_errors_agreed();
    const int failed = test_finish();
    MPI_Finalize();
    return failed;
}
