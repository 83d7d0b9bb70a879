/* SPDX-License-Identifier: MIT */
/* bench_ring.c: `mha_bench_ring`, the ring attention benchmark (mha_mpi.h; docs/distributed.md,
 * "Performance"). Run under `mpirun -np P`; tools/bench_ring.sh runs the whole sweep. Not a test.
 *
 * Each rank holds its shard (mha_ring_shard) of one self-attention problem, d_k = d_v = d
 * (--dim), B = 1 by default: q [B, h, n_local, d], k and v [B, g, n_local, d], random in [-1, 1),
 * one thread per rank unless --threads. Three times are measured per repetition, every rank
 * starting together (barrier) and the slowest rank's time kept (MPI_Allreduce MAX), since the
 * ring moves at its slowest rank:
 *   t_total  mha_ring_attention (or _backward) itself;
 *   t_comp   the same local calls with no communication: for every step t the (query chunk, key
 *            chunk) pairs of the block of rank (rank - t) mod P, skipped / unmasked / causal at
 *            offset (query start - key start) exactly as ring.c chooses, with the merges (forward)
 *            or the dK/dV accumulation (backward); on a local K/V block of the same size;
 *   t_comm   the same messages with no compute: the K/V blocks one hop per step (P - 1 hops),
 *            and in the backward the dK/dV blocks too (P hops), MPI_Isend/Irecv as in ring.c.
 *   overlap = (t_comp + t_comm - t_total) / min(t_comp, t_comm): 1 when the shorter of the two
 *            hides entirely behind the other, 0 when they add up (no overlap); outside [0, 1]
 *            is noise (or a ring slower than its parts). Undefined for P = 1 (no messages).
 * FLOPs (global, the whole problem; causal counts half the N^2 pairs, as FlashAttention's
 * benchmarks do; softmax exps not counted):
 *   forward  2 B h N^2 (d_k + d_v)        (S = Q K^T, O = P V)
 *   backward 2 B h N^2 (3 d_k + 2 d_v)    (S again, dP = dO V^T, dV = P^T dO, dQ, dK)
 * GFLOP/s = FLOPs / t_total; % of peak = GFLOP/s / (measured 1-thread FMA peak (--peak, from
 * mha_peak) x min(P x threads, cores)), the cores the job can use. Per-rank rate = FLOPs / P /
 * t_comp (the compute rate of one rank; the cluster model's input). Bytes sent per rank: the
 * floats of every message it sends to another rank x 4: forward (P - 1) K/V blocks of
 * B g n_src (d_k + d_v) floats, backward (P - 1) K/V + P dK/dV blocks; GB/s = bytes / t_comm.
 *
 * Usage: mpirun -np P mha_bench_ring [--n N] [--heads H] [--kv-heads G] [--dim D] [--batch B]
 *          [--mask causal|none] [--layout zigzag|contiguous] [--dir fwd|bwd|both] [--reps R]
 *          [--threads T] [--peak GFLOPS] [--cores C] [--label TEXT] [--header] [--ranks P]
 * --ranks P: fail unless the job has P ranks (a launcher of another MPI than the one the program
 * was built with starts P singletons of 1 rank each).
 * --verify: instead of timing, check that the t_comp replay, run on the true K/V blocks, gives the
 * ring's own forward (out, lse) and dQ, identical to the bit (verify() below). */
#define _POSIX_C_SOURCE 200809L
#include "fma_peak.h"
#include "mha_mpi.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct opts {
    int64_t B, h, g, n, d;
    int causal, bwd, fwd, reps, threads, cores, header, ranks, verify;
    mha_shard_layout layout;
    double peak; /* GFLOP/s of one thread, 0 = not given */
    const char *label;
} opts;

/* One rank's problem and scratch (floats, contiguous [B, heads, rows, d]). */
typedef struct bench {
    opts o;
    int32_t p, rank;
    mha_ring_config cfg;
    mha_attention_args a;
    mha_attention_grads gr;
    mha_exec exec;
    int64_t n_local, n_max;
    float *q, *k, *v, *out, *lse, *dout, *dq, *dk, *dv;
    float *kv[2], *acc[2], *din, *part, *part_lse;
    int64_t *offs;
} bench;

static void die(const char *what, const mha_error *err) {
    fprintf(stderr, "mha_bench_ring: %s: %s\n", what, err ? err->message : "out of memory");
    MPI_Abort(MPI_COMM_WORLD, 1);
}

static float *alloc_fill(int64_t count, uint64_t seed) {
    float *x = malloc(sizeof(float) * (size_t)(count > 0 ? count : 1));
    if (!x)
        die("malloc", NULL);
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
    for (int64_t i = 0; i < count; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)(s >> 40) / (float)(1 << 23) - 1.0f;
    }
    return x;
}

static int parse(int argc, char **argv, opts *o) {
    *o = (opts){1, 8, 0, 8192, 64, 1, 1, 1, 5, 1, 0, 0, 0, 0, MHA_SHARD_ZIGZAG, 0.0, "-"};
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(k, "--header") || !strcmp(k, "--verify")) {
            *(k[2] == 'h' ? &o->header : &o->verify) = 1;
            continue;
        }
        if (!v)
            return 0;
        i++;
        if (!strcmp(k, "--n"))
            o->n = atoll(v);
        else if (!strcmp(k, "--heads"))
            o->h = atoll(v);
        else if (!strcmp(k, "--kv-heads"))
            o->g = atoll(v);
        else if (!strcmp(k, "--dim"))
            o->d = atoll(v);
        else if (!strcmp(k, "--batch"))
            o->B = atoll(v);
        else if (!strcmp(k, "--mask") && (!strcmp(v, "causal") || !strcmp(v, "none")))
            o->causal = !strcmp(v, "causal");
        else if (!strcmp(k, "--layout") && (!strcmp(v, "zigzag") || !strcmp(v, "contiguous")))
            o->layout = !strcmp(v, "zigzag") ? MHA_SHARD_ZIGZAG : MHA_SHARD_CONTIGUOUS;
        else if (!strcmp(k, "--dir") &&
                 (!strcmp(v, "fwd") || !strcmp(v, "bwd") || !strcmp(v, "both")))
            o->fwd = strcmp(v, "bwd") != 0, o->bwd = strcmp(v, "fwd") != 0;
        else if (!strcmp(k, "--reps"))
            o->reps = atoi(v);
        else if (!strcmp(k, "--threads"))
            o->threads = atoi(v);
        else if (!strcmp(k, "--peak"))
            o->peak = atof(v);
        else if (!strcmp(k, "--cores"))
            o->cores = atoi(v);
        else if (!strcmp(k, "--ranks"))
            o->ranks = atoi(v);
        else if (!strcmp(k, "--label"))
            o->label = v;
        else
            return 0;
    }
    if (!o->g)
        o->g = o->h;
    return o->B > 0 && o->h > 0 && o->g > 0 && o->h % o->g == 0 && o->d > 0 && o->n > 0 &&
           o->reps > 0 && o->threads > 0;
}

/* Rank r's K and V are alloc_fill(.., 1000 r + SEED_K / SEED_V): --verify regenerates them. */
enum { SEED_K = 2, SEED_V = 3 };

/* The rank's tensors, the forward's args, and the replay's scratch (the ring's own sizes). */
static void setup(bench *b) {
    const opts *o = &b->o;
    mha_error err;
    int32_t nc;
    int64_t start[2], len[2];
    b->cfg = (mha_ring_config){o->n, o->layout};
    if (mha_ring_shard(&b->cfg, b->p, b->rank, &nc, start, len, &err) != MHA_STATUS_OK)
        die("mha_ring_shard", &err);
    b->n_local = len[0] + len[1];
    b->n_max = 0;
    for (int32_t r = 0; r < b->p; r++) {
        mha_ring_shard(&b->cfg, b->p, r, &nc, start, len, NULL);
        b->n_max = len[0] + len[1] > b->n_max ? len[0] + len[1] : b->n_max;
    }
    const int64_t B = o->B, h = o->h, g = o->g, n = b->n_local, d = o->d;
    const uint64_t seed = 1000u * (uint64_t)b->rank;
    b->q = alloc_fill(B * h * n * d, seed + 1), b->k = alloc_fill(B * g * n * d, seed + SEED_K);
    b->v = alloc_fill(B * g * n * d, seed + SEED_V), b->out = alloc_fill(B * h * n * d, 0);
    b->lse = alloc_fill(B * h * n, 0), b->dout = alloc_fill(B * h * n * d, seed + 4);
    b->dq = alloc_fill(B * h * n * d, 0), b->dk = alloc_fill(B * g * n * d, 0);
    b->dv = alloc_fill(B * g * n * d, 0);
    const int64_t blk = B * g * b->n_max * 2 * d;
    for (int i = 0; i < 2; i++)
        b->kv[i] = alloc_fill(blk, seed + 5 + (uint64_t)i), b->acc[i] = alloc_fill(blk, 0);
    b->din = alloc_fill(blk, 0);
    b->part = alloc_fill(B * h * b->n_max * d, 0), b->part_lse = alloc_fill(B * h * b->n_max, 0);
    b->offs = malloc(sizeof(int64_t) * (size_t)B);
    if (!b->offs)
        die("malloc", NULL);
    mha_attention_args *a = &b->a;
    memset(a, 0, sizeof *a);
    a->batch = B, a->num_heads = h, a->num_kv_heads = g, a->q_len = a->kv_len = n;
    a->head_dim = d;
    a->q = b->q, a->k = b->k, a->v = b->v, a->out = b->out, a->lse = b->lse;
    const int64_t sq[3] = {h * n * d, n * d, d}, skv[3] = {g * n * d, n * d, d};
    memcpy(a->q_strides, sq, sizeof sq), memcpy(a->out_strides, sq, sizeof sq);
    memcpy(a->k_strides, skv, sizeof skv), memcpy(a->v_strides, skv, sizeof skv);
    a->mask.causal = o->causal;
    mha_attention_grads *gr = &b->gr;
    memset(gr, 0, sizeof *gr);
    gr->dout = b->dout, gr->dq = b->dq, gr->dk = b->dk, gr->dv = b->dv;
    memcpy(gr->dout_strides, sq, sizeof sq), memcpy(gr->dq_strides, sq, sizeof sq);
    memcpy(gr->dk_strides, skv, sizeof skv), memcpy(gr->dv_strides, skv, sizeof skv);
    memset(&b->exec, 0, sizeof b->exec);
    b->exec.n_threads = o->threads;
}

static void teardown(bench *b) {
    float *all[] = {b->q,  b->k,     b->v,     b->out,    b->lse,    b->dout, b->dq,   b->dk,
                    b->dv, b->kv[0], b->kv[1], b->acc[0], b->acc[1], b->din,  b->part, b->part_lse};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        free(all[i]);
    free(b->offs);
}

/* ------------------------------------------------------------------------------------------ */
/* t_comp: the ring's local calls, no messages                                                */
/* ------------------------------------------------------------------------------------------ */

/* The shard of rank r: chunks, their global starts and lengths, local length. */
typedef struct shard {
    int32_t nc;
    int64_t start[2], len[2], n;
} shard;

static shard shard_of(const bench *b, int32_t r) {
    shard s;
    mha_ring_shard(&b->cfg, b->p, r, &s.nc, s.start, s.len, NULL);
    s.n = s.len[0] + s.len[1];
    return s;
}

/* The core's args for query rows [q_off, q_off + nq) (global start qs) against key rows
 * [k_off, k_off + nk) (global start ks) of a packed K/V block of n_src rows, as ring.c's
 * pair_args decides for a causal mask: skipped (0) when every key follows every query, unmasked
 * when every key precedes or is the first query, else causal at offset qs - ks. */
static int pair(bench *b,
                const float *blk,
                int64_t n_src,
                int64_t q_off,
                int64_t nq,
                int64_t qs,
                int64_t k_off,
                int64_t nk,
                int64_t ks,
                mha_attention_args *p) {
    const int64_t B = b->o.B, g = b->o.g, d = b->o.d;
    *p = b->a;
    if (b->o.causal) {
        if (ks > qs + nq - 1)
            return 0;
        p->mask.causal = ks + nk - 1 > qs;
        for (int64_t i = 0; i < B; i++)
            b->offs[i] = qs - ks;
        p->mask.alignment = p->mask.causal ? MHA_ALIGN_EXPLICIT : p->mask.alignment;
        p->mask.align_offsets = p->mask.causal ? b->offs : NULL;
    }
    p->q_len = nq, p->kv_len = nk;
    p->q = b->q + q_off * d;
    p->k = blk + k_off * d;
    p->v = blk + B * g * n_src * d + k_off * d;
    const int64_t s[3] = {g * n_src * d, n_src * d, d};
    memcpy(p->k_strides, s, sizeof s), memcpy(p->v_strides, s, sizeof s);
    return 1;
}

/* Forward of one pair: partial (O_p, lse_p), merged into out and lse per (b, head). */
static void fwd_pair(bench *b, const mha_attention_args *p, int64_t q_off, int64_t nq) {
    const int64_t h = b->o.h, d = b->o.d, n = b->n_local;
    mha_attention_args pp = *p;
    mha_error err;
    pp.out = b->part, pp.lse = b->part_lse;
    const int64_t s[3] = {h * nq * d, nq * d, d};
    memcpy(pp.out_strides, s, sizeof s);
    if (mha_attention(&pp, &b->exec, &err) != MHA_STATUS_OK)
        die("mha_attention", &err);
    for (int64_t bh = 0; bh < b->o.B * h; bh++) {
        float *o = b->out + (bh * n + q_off) * d, *l = b->lse + bh * n + q_off;
        if (mha_attention_merge(nq, d, o, d, l, b->part + bh * nq * d, d, b->part_lse + bh * nq, o,
                                d, l, &err) != MHA_STATUS_OK)
            die("mha_attention_merge", &err);
    }
}

/* Backward of one pair into acc (the block's dK/dV), with the chunk's rows of the global lse. */
static void bwd_pair(bench *b,
                     const mha_attention_args *p,
                     float *acc,
                     int64_t n_src,
                     int64_t q_off,
                     int64_t nq,
                     int64_t k_off) {
    const int64_t h = b->o.h, g = b->o.g, d = b->o.d, n = b->n_local;
    mha_attention_args pp = *p;
    mha_error err;
    pp.out = b->out + q_off * d;
    for (int64_t bh = 0; bh < b->o.B * h; bh++)
        memcpy(b->part_lse + bh * nq, b->lse + bh * n + q_off, sizeof(float) * (size_t)nq);
    pp.lse = b->part_lse;
    mha_attention_grads gg = b->gr;
    gg.dout = b->dout + q_off * d, gg.dq = b->dq + q_off * d;
    gg.dk = acc + k_off * d, gg.dv = acc + b->o.B * g * n_src * d + k_off * d;
    memcpy(gg.dk_strides, pp.k_strides, sizeof gg.dk_strides);
    memcpy(gg.dv_strides, pp.v_strides, sizeof gg.dv_strides);
    gg.accumulate = 1;
    if (mha_attention_backward(&pp, &gg, &b->exec, &err) != MHA_STATUS_OK)
        die("mha_attention_backward", &err);
}

/* Every (query chunk, key chunk) pair of this rank against the block of src (without a causal
 * mask the whole shard against the whole block, as in ring.c); acc == NULL is the forward. */
static void step_pairs(bench *b, const float *blk, float *acc, const shard *src) {
    const shard me = shard_of(b, b->rank);
    const int chunked = b->o.causal;
    int64_t q_off = 0;
    for (int32_t qc = 0; qc < (chunked ? me.nc : 1); qc++) {
        const int64_t nq = chunked ? me.len[qc] : me.n;
        int64_t k_off = 0;
        for (int32_t kc = 0; kc < (chunked ? src->nc : 1); kc++) {
            const int64_t nk = chunked ? src->len[kc] : src->n;
            mha_attention_args p;
            if (pair(b, blk, src->n, q_off, nq, chunked ? me.start[qc] : 0, k_off, nk,
                     chunked ? src->start[kc] : 0, &p)) {
                if (acc)
                    bwd_pair(b, &p, acc, src->n, q_off, nq, k_off);
                else
                    fwd_pair(b, &p, q_off, nq);
            }
            k_off += nk;
        }
        q_off += nq;
    }
}

/* The packed K/V block of rank r ([B, g, n_r, d] K then V, as ring.c packs it: the rank's
 * contiguous K and V one after the other), regenerated from r's seeds into dst. */
static void load_block(const bench *b, int32_t r, float *dst) {
    const int64_t count = b->o.B * b->o.g * shard_of(b, r).n * b->o.d;
    for (int kv = 0; kv < 2; kv++) {
        float *x = alloc_fill(count, 1000u * (uint64_t)r + (kv ? SEED_V : SEED_K));
        memcpy(dst + kv * count, x, sizeof(float) * (size_t)count);
        free(x);
    }
}

/* All P steps' compute: the forward's merges into out/lse (restored by the next ring call), the
 * backward's zeroed acc, pairs, and the add of the travelling dK/dV (din). With `real`, each
 * step first loads the true block of its source rank (--verify; not timed). */
static void compute_only(bench *b, int bwd, int real) {
    for (int32_t t = 0; t < b->p; t++) {
        const shard src = shard_of(b, (b->rank - t + b->p) % b->p);
        const int64_t count = b->o.B * b->o.g * src.n * 2 * b->o.d;
        float *acc = bwd ? b->acc[t % 2] : NULL;
        if (real)
            load_block(b, (b->rank - t + b->p) % b->p, b->kv[t % 2]);
        if (bwd)
            memset(acc, 0, sizeof(float) * (size_t)count);
        step_pairs(b, b->kv[t % 2], acc, &src);
        if (bwd && t > 0)
            for (int64_t e = 0; e < count; e++)
                acc[e] += b->din[e];
    }
}

/* --verify: the replay on the true blocks must give the ring's own results: the forward's out and
 * lse, and the backward's dQ (its dK/dV need the other ranks' shares, which the replay does not
 * have). Same calls in the same order on one thread: the differences should be exactly 0. Prints
 * the largest difference over all ranks; returns nonzero if any. */
static int verify(bench *b) {
    const int64_t no = b->o.B * b->o.h * b->n_local * b->o.d, nl = b->o.B * b->o.h * b->n_local;
    float *ref = malloc(sizeof(float) * (size_t)(2 * no + nl));
    mha_error err;
    if (!ref)
        die("malloc", NULL);
    if (mha_ring_attention(MPI_COMM_WORLD, &b->cfg, &b->a, &b->exec, &err) != MHA_STATUS_OK)
        die("mha_ring_attention", &err);
    memcpy(ref, b->out, sizeof(float) * (size_t)no);
    memcpy(ref + no, b->lse, sizeof(float) * (size_t)nl);
    if (mha_ring_attention_backward(MPI_COMM_WORLD, &b->cfg, &b->a, &b->gr, &b->exec, &err) !=
        MHA_STATUS_OK)
        die("mha_ring_attention_backward", &err);
    memcpy(ref + no + nl, b->dq, sizeof(float) * (size_t)no);
    for (int64_t i = 0; i < no; i++)
        b->out[i] = 0.0f, b->dq[i] = 0.0f;
    for (int64_t i = 0; i < nl; i++)
        b->lse[i] = -INFINITY;
    compute_only(b, 0, 1);
    double worst[3] = {0.0, 0.0, 0.0}, all[3];
    for (int64_t i = 0; i < no; i++)
        worst[0] = fmax(worst[0], fabs((double)b->out[i] - (double)ref[i]));
    for (int64_t i = 0; i < nl; i++)
        worst[1] = fmax(worst[1], fabs((double)b->lse[i] - (double)ref[no + i]));
    /* The backward replay reads the forward's results: the ring's. */
    memcpy(b->out, ref, sizeof(float) * (size_t)no);
    memcpy(b->lse, ref + no, sizeof(float) * (size_t)nl);
    compute_only(b, 1, 1);
    for (int64_t i = 0; i < no; i++)
        worst[2] = fmax(worst[2], fabs((double)b->dq[i] - (double)ref[no + nl + i]));
    free(ref);
    MPI_Allreduce(worst, all, 3, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    const int same = all[0] == 0.0 && all[1] == 0.0 && all[2] == 0.0;
    if (b->rank == 0)
        printf("verify P=%d N=%lld %s %s: replay vs ring, max |diff| out %g, lse %g, dQ %g: %s\n",
               (int)b->p, (long long)b->o.n, b->o.causal ? "causal" : "none",
               b->o.layout == MHA_SHARD_ZIGZAG ? "zigzag" : "contiguous", all[0], all[1], all[2],
               same ? "identical" : "DIFFERENT");
    return !same;
}

/* ------------------------------------------------------------------------------------------ */
/* t_comm: the ring's messages, no compute                                                    */
/* ------------------------------------------------------------------------------------------ */

/* The message pattern of ring.c's run_ring: per step the next K/V block from the left and this
 * one to the right; in the backward also the dK/dV block sent on after the step and the next one
 * received. Returns the bytes this rank sent to another rank. */
static double comm_only(bench *b, MPI_Comm comm, int bwd) {
    const int32_t p = b->p, right = (b->rank + 1) % p, left = (b->rank + p - 1) % p;
    const int64_t per_row = b->o.B * b->o.g * 2 * b->o.d;
    MPI_Request dreq[3] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    MPI_Status stat[3];
    double bytes = 0.0;
    for (int32_t t = 0; t < p; t++) {
        const int cnt = (int)(per_row * shard_of(b, (b->rank - t + p) % p).n);
        const int nxt = (int)(per_row * shard_of(b, (b->rank - t - 1 + 2 * p) % p).n);
        MPI_Request req[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
        if (t + 1 < p) {
            MPI_Irecv(b->kv[(t + 1) % 2], nxt, MPI_FLOAT, left, 15, comm, &req[0]);
            MPI_Isend(b->kv[t % 2], cnt, MPI_FLOAT, right, 15, comm, &req[1]);
            bytes += right != b->rank ? 4.0 * cnt : 0.0;
        }
        if (bwd) {
            MPI_Wait(&dreq[t % 2], &stat[0]);
            if (t > 0)
                MPI_Wait(&dreq[2], &stat[0]);
            MPI_Isend(b->acc[t % 2], cnt, MPI_FLOAT, right, 16, comm, &dreq[t % 2]);
            bytes += right != b->rank ? 4.0 * cnt : 0.0;
            const int nd = t + 1 < p ? nxt : (int)(per_row * b->n_local);
            MPI_Irecv(b->din, nd, MPI_FLOAT, left, 16, comm, &dreq[2]);
        }
        MPI_Waitall(2, req, stat);
    }
    if (bwd)
        MPI_Waitall(3, dreq, stat);
    return bytes;
}

/* ------------------------------------------------------------------------------------------ */
/* Timing and the report                                                                      */
/* ------------------------------------------------------------------------------------------ */

typedef enum { RUN_RING, RUN_COMP, RUN_COMM } run_kind;

/* One timed run of `kind`, every rank starting together; the slowest rank's seconds. */
static double timed(bench *b, MPI_Comm comm, run_kind kind, int bwd, double *bytes) {
    mha_error err;
    MPI_Barrier(comm);
    const double t0 = bench_now_s();
    if (kind == RUN_RING) {
        const mha_status st =
            bwd ? mha_ring_attention_backward(comm, &b->cfg, &b->a, &b->gr, &b->exec, &err)
                : mha_ring_attention(comm, &b->cfg, &b->a, &b->exec, &err);
        if (st != MHA_STATUS_OK)
            die(bwd ? "mha_ring_attention_backward" : "mha_ring_attention", &err);
    } else if (kind == RUN_COMP) {
        compute_only(b, bwd, 0);
    } else {
        *bytes = comm_only(b, comm, bwd);
    }
    double t = bench_now_s() - t0, worst = 0.0;
    MPI_Allreduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, comm);
    return worst;
}

static double median(double *x, int n) {
    qsort(x, (size_t)n, sizeof *x, bench_cmp_double);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

/* The three times, interleaved per repetition (so that a busy neighbour hits all three alike),
 * after one warm-up repetition; medians, and the spread (max - min) / median of t_total. */
static void
measure(bench *b, MPI_Comm comm, int bwd, double med[3], double *spread, double *bytes) {
    const int reps = b->o.reps;
    double *t = malloc(sizeof(double) * 3 * (size_t)reps);
    if (!t)
        die("malloc", NULL);
    for (int r = -1; r < reps; r++)
        for (int k = 0; k < 3; k++) {
            const double s = timed(b, comm, (run_kind)k, bwd, bytes);
            if (r >= 0)
                t[k * reps + r] = s;
        }
    for (int k = 0; k < 3; k++)
        med[k] = median(t + k * reps, reps);
    *spread = (t[reps - 1] - t[0]) / med[0]; /* sorted by median() */
    free(t);
}

static void header(const bench *b) {
    char cpu[256], lib[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    bench_cpu_model(cpu, sizeof cpu);
    MPI_Get_library_version(lib, &len);
    lib[strcspn(lib, "\n,")] = '\0'; /* the first line: "Open MPI v4.1.4", "MPICH Version: 4.0.2" */
    for (char *c = lib; *c; c++)
        *c = *c == '\t' ? ' ' : *c;
    printf("# mha_bench_ring: ring attention (mha_ring_attention / _backward), %s\n"
           "# CPU: %s; MPI: %s; %d thread(s) per rank; 1-thread FMA peak %.1f GFLOP/s "
           "(mha_peak), %d core(s)\n"
           "# FLOPs: fwd 2BhN^2(dk+dv), bwd 2BhN^2(3dk+2dv), causal x 1/2; %%peak of peak x "
           "min(P*threads, cores)\n"
           "# t_* = median of the slowest rank over reps; spread = (max-min)/median of t_total;\n"
           "# overlap = (t_comp + t_comm - t_total) / min(t_comp, t_comm); MB and GB/s: bytes "
           "each rank sends to another rank, / t_comm\n"
           "%-7s %2s %7s %6s %-6s %-10s %-3s %9s %6s %8s %6s %9s %9s %7s %9s %7s %9s\n",
           "one job per row; P > cores is oversubscribed", cpu, lib, b->o.threads, b->o.peak,
           b->o.cores, "label", "P", "N", "n_loc", "mask", "layout", "dir", "t_tot_ms", "spread",
           "GFLOP/s", "%peak", "t_comp_ms", "t_comm_ms", "overlap", "MB/rank", "GB/s", "rank_GF/s");
}

static void report(bench *b, MPI_Comm comm, int bwd) {
    const opts *o = &b->o;
    double med[3], spread, bytes = 0.0, most = 0.0;
    measure(b, comm, bwd, med, &spread, &bytes);
    MPI_Allreduce(&bytes, &most, 1, MPI_DOUBLE, MPI_MAX, comm);
    const double nn = (double)o->n * (double)o->n, dd = bwd ? 5.0 * (double)o->d : 2.0 * o->d;
    const double flops = 2.0 * (double)(o->B * o->h) * nn * dd * (o->causal ? 0.5 : 1.0);
    const int used = b->p * o->threads < o->cores || !o->cores ? b->p * o->threads : o->cores;
    const double gf = flops / med[0] * 1e-9, peak = o->peak * used;
    char ov[16] = "n/a", pk[16] = "n/a";
    const double lo = med[1] < med[2] ? med[1] : med[2];
    if (b->p > 1 && lo > 0.0)
        snprintf(ov, sizeof ov, "%.2f", (med[1] + med[2] - med[0]) / lo);
    if (peak > 0.0)
        snprintf(pk, sizeof pk, "%.1f", 100.0 * gf / peak);
    if (b->rank == 0)
        printf("%-7s %2d %7lld %6lld %-6s %-10s %-3s %9.1f %5.0f%% %8.2f %6s %9.1f %9.2f %7s "
               "%9.2f %7.2f %9.2f\n",
               o->label, (int)b->p, (long long)o->n, (long long)b->n_max,
               o->causal ? "causal" : "none",
               o->layout == MHA_SHARD_ZIGZAG ? "zigzag" : "contiguous", bwd ? "bwd" : "fwd",
               1e3 * med[0], 100.0 * spread, gf, pk, 1e3 * med[1], 1e3 * med[2], ov, most * 1e-6,
               med[2] > 0.0 ? most / med[2] * 1e-9 : 0.0, flops / b->p / med[1] * 1e-9);
    fflush(stdout);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    bench b;
    memset(&b, 0, sizeof b);
    int p = 1, rank = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &p);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    b.p = p, b.rank = rank;
    if (!parse(argc, argv, &b.o)) {
        if (rank == 0)
            fprintf(stderr, "usage: mpirun -np P mha_bench_ring [--n N] [--heads H] "
                            "[--kv-heads G] [--dim D] [--batch B] [--mask causal|none]\n"
                            "  [--layout zigzag|contiguous] [--dir fwd|bwd|both] [--reps R] "
                            "[--threads T] [--peak GFLOPS] [--cores C] [--label TEXT] "
                            "[--header] [--ranks P] [--verify]\n  (the file's top comment defines "
                            "every column)\n");
        MPI_Finalize();
        return 2;
    }
    if (b.o.ranks && b.o.ranks != p) {
        fprintf(stderr,
                "mha_bench_ring: %d rank(s) in MPI_COMM_WORLD, --ranks %d expected: is the "
                "launcher the one of the MPI this program was built with?\n",
                p, b.o.ranks);
        MPI_Finalize();
        return 1;
    }
    setup(&b);
    if (b.o.verify) {
        const int bad = verify(&b);
        teardown(&b);
        MPI_Finalize();
        return bad;
    }
    if (b.o.header && rank == 0)
        header(&b);
    /* The backward needs the forward's out and lse; the forward's timed runs rewrite them. */
    mha_error err;
    if (mha_ring_attention(MPI_COMM_WORLD, &b.cfg, &b.a, &b.exec, &err) != MHA_STATUS_OK)
        die("mha_ring_attention", &err);
    if (b.o.fwd)
        report(&b, MPI_COMM_WORLD, 0);
    /* t_comp's forward merges again into out and lse: the backward gets a fresh forward. */
    if (b.o.bwd && b.o.fwd &&
        mha_ring_attention(MPI_COMM_WORLD, &b.cfg, &b.a, &b.exec, &err) != MHA_STATUS_OK)
        die("mha_ring_attention", &err);
    if (b.o.bwd)
        report(&b, MPI_COMM_WORLD, 1);
    teardown(&b);
    MPI_Finalize();
    return 0;
}
