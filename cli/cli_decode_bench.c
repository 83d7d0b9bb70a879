/* SPDX-License-Identifier: MIT */
/* cli_decode_bench.c: `mha decode-bench`, autoregressive decoding speed with random weights.
 *
 * Fills a KV cache with --cache-len positions per sequence (random post-RoPE K/V, or a real
 * layer prefill with --prefill-mode layer), then runs --steps decode steps of one token per
 * sequence. Reports, per step: the attention alone (append + split-KV attention over the cache),
 * its effective bandwidth (bytes of K and V read per second), and the whole layer step
 * (projections + RoPE + attention + output projection) as tokens/s. --stream measures this
 * machine's memory read bandwidth in the same run (a read loop over a buffer much larger than the
 * last-level cache); --naive times a plain single-threaded loop over the same cache. --paged BS
 * also fills a paged cache (blocks of BS positions, laid out in the pool as --paged-order says)
 * with the same K/V and times its attention interleaved with the contiguous cache's, step by
 * step.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#define _DEFAULT_SOURCE         /* madvise */

#include "cli.h"
#include "mha_experimental.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

/* The name of the decode kernel the library runs on this CPU (its registry, mha_experimental.h). */
/* The decode kernel a cache of dtype dt runs: the first usable decode line whose dtypes name
 * it (the registry's order is its preference; every decode line takes every cache dtype). */
/* The decode kernel a cache of dtype dt runs here (x16: q8_0 in the key-interleaved order): the
 * first usable decode line whose dtype list holds that dtype's name as an item. */
static const char *decode_kernel_name(mha_dtype dt, int x16) {
    mha_kernel_desc d;
    const char *name = dt == MHA_DTYPE_F16        ? "f16"
                       : dt == MHA_DTYPE_BF16     ? "bf16"
                       : dt == MHA_DTYPE_Q8_0     ? (x16 ? "q8_0x16" : "q8_0")
                       : dt == MHA_DTYPE_FP8_E4M3 ? "fp8_e4m3"
                                                  : "f32";
    const size_t n = strlen(name);
    for (int32_t i = 0; i < mha_experimental_kernel_count(); i++) {
        if (mha_experimental_kernel_describe(i, &d, NULL) != MHA_STATUS_OK || !d.usable ||
            strcmp(d.op, "decode") != 0)
            continue;
        for (const char *at = d.dtypes; (at = strstr(at, name)) != NULL; at += n)
            if ((at == d.dtypes || at[-1] == ',') && (at[n] == ',' || at[n] == '\0'))
                return d.name;
    }
    return "?";
}

enum {
    B_HELP,
    B_HEADS,
    B_KV_HEADS,
    B_HEAD_DIM,
    B_Q_DIM,
    B_CACHE_LEN,
    B_BATCH,
    B_STEPS,
    B_THREADS,
    B_CACHE_DTYPE,
    B_ATTN_ONLY,
    B_PREFILL_MODE,
    B_NAIVE,
    B_STREAM_MB,
    B_JSON,
    B_WEIGHT_DTYPE,
    B_PAGED,
    B_PAGED_ORDER,
    B_PAGED_PEERS,
    B_COMPACT,
    B_DRAFT_TREE,
    B_BATCH_LENGTHS,
    B_WARMUP,
    B_COLD,
    B_Q8_ORDER,
    B_COUNT
};

static const cli_opt bench_flags[B_COUNT] = {
    [B_HELP] = {"--help", CLI_OPT_FLAG},
    [B_HEADS] = {"--heads", CLI_OPT_VALUE},
    [B_KV_HEADS] = {"--kv-heads", CLI_OPT_VALUE},
    [B_HEAD_DIM] = {"--head-dim", CLI_OPT_VALUE},
    [B_Q_DIM] = {"--q-dim", CLI_OPT_VALUE},
    [B_CACHE_LEN] = {"--cache-len", CLI_OPT_VALUE},
    [B_BATCH] = {"--batch", CLI_OPT_VALUE},
    [B_STEPS] = {"--steps", CLI_OPT_VALUE},
    [B_THREADS] = {"--threads", CLI_OPT_VALUE},
    [B_CACHE_DTYPE] = {"--cache-dtype", CLI_OPT_VALUE},
    [B_ATTN_ONLY] = {"--attention-only", CLI_OPT_FLAG},
    [B_PREFILL_MODE] = {"--prefill-mode", CLI_OPT_VALUE},
    [B_NAIVE] = {"--naive", CLI_OPT_FLAG},
    [B_STREAM_MB] = {"--stream", CLI_OPT_VALUE},
    [B_JSON] = {"--json", CLI_OPT_FLAG},
    [B_WEIGHT_DTYPE] = {"--weight-dtype", CLI_OPT_VALUE},
    [B_PAGED] = {"--paged", CLI_OPT_VALUE},
    [B_PAGED_ORDER] = {"--paged-order", CLI_OPT_VALUE},
    [B_PAGED_PEERS] = {"--paged-peers", CLI_OPT_VALUE},
    [B_COMPACT] = {"--compact", CLI_OPT_FLAG},
    [B_DRAFT_TREE] = {"--draft-tree", CLI_OPT_VALUE},
    [B_BATCH_LENGTHS] = {"--batch-lengths", CLI_OPT_VALUE},
    [B_WARMUP] = {"--warmup", CLI_OPT_VALUE},
    [B_COLD] = {"--cold", CLI_OPT_VALUE},
    [B_Q8_ORDER] = {"--q8-order", CLI_OPT_VALUE},
};

static void bench_usage(void) {
    printf("Usage: mha decode-bench [options]\n"
           "\n"
           "Prefill + N decode steps through a KV cache with random weights; reports tokens/s and\n"
           "the effective bandwidth of the attention (bytes of K and V read per second).\n"
           "\n"
           "  --heads H           query heads (default: 32)\n"
           "  --kv-heads G        key/value heads, H %% G == 0 (default: 8)\n"
           "  --head-dim D        d_k = d_v (default: 128)\n"
           "  --q-dim Q           layer width (default: H*D)\n"
           "  --cache-len L       positions in the cache before the first step (default: 4096)\n"
           "  --batch B           sequences decoded together (default: 1)\n"
           "  --steps N           decode steps (default: 32)\n"
           "  --threads T         threads, 0 = every online CPU (default: 0)\n"
           "  --cache-dtype T     f32, f16, bf16, q8_0 (34 bytes per 32 values) or fp8 (e4m3,\n"
           "                      1 byte, scales 1.0) (default: f32)\n"
           "  --prefill-mode M    random: fill the cache with random K/V (default); layer: run\n"
           "                      mha_layer_prefill on random tokens (slow for long caches)\n"
           "  --attention-only    time only the attention (append + split-KV), not the layer\n"
           "  --naive             also time a plain single-threaded loop over the same cache\n"
           "  --stream MB         also measure memory read bandwidth over an MB-megabyte buffer\n"
           "  --json              one JSON line instead of the table\n"
           "  --weight-dtype T    the layer's weights: f32, f16, bf16, q8_0 or q4_0 (the\n"
           "                      projections in q8_0 / q4_0 blocks, quantised by\n"
           "                      mha_q8_0_quantize / mha_q4_0_quantize) (default: f32); the\n"
           "                      layer step then reports the weights' bytes per second\n");
    printf(/* two strings: one would pass C99's 4095 characters */
           "  --paged BS          also a paged cache of BS-position blocks (16..256) holding the\n"
           "                      same K/V, filled one token at a time; its attention is timed\n"
           "                      interleaved with the contiguous one's (paged/contiguous);\n"
           "                      not with --batch-lengths or --prefill-mode layer\n"
           "  --paged-order O     where the measured sequences' blocks lie in the pool:\n"
           "                      lockstep (default): they grow in lockstep with --paged-peers\n"
           "                      other sequences (continuous batching), placed by the pool;\n"
           "                      ordered: alone in a pool of their size (batch 1: in order);\n"
           "                      interleaved: the layout the old free-id stack gave lockstep\n"
           "                      (batch 1: every (1 + peers)-th block); fragmented: the pool\n"
           "                      full, a random half of its blocks freed (scattered runs);\n"
           "                      alternate: every other block free (isolated, ascending)\n"
           "  --paged-peers P     other sequences of lockstep / interleaved (0..64, default: 7)\n"
           "  --q8-order O        q8_0 caches' byte order: auto (default: what "
           "mha_kv_cache_create\n"
           "                      takes here, `mha info`), rows (ggml's) or interleaved (groups "
           "of\n"
           "                      16 keys for VPDPBUSD; paged: --paged a multiple of 16)\n"
           "  --compact           compact the paged cache once it is filled\n"
           "                      (mha_kv_cache_compact; its time and the runs before are\n"
           "                      reported), then time it\n"
           "  --draft-tree P      also time verifying a draft tree of parents P (comma list, -1 =\n"
           "                      a root; at most 16), e.g. -1,0,0,1,1,2,2,3, against a one-token\n"
           "                      step in the same run (attention only), with its GFLOP/s\n"
           "  --batch-lengths S   per-sequence cache lengths instead of --cache-len (attention\n"
           "                      only): a comma list (its size is the batch), or "
           "logu:LO:HI:SEED,\n"
           "                      --batch lengths log-uniform in [LO, HI] from a fixed seed\n"
           "  --warmup MS         untimed attention calls (no append) for MS milliseconds before\n"
           "                      the timed steps (default: 250; 0 = none): the first ~100 ms of\n"
           "                      streaming the cache ran ~10%% slower on AMD Zen 5\n"
           "  --cold MB           read an MB-megabyte buffer before every timed call, so that\n"
           "                      the call finds the cache and the weights in memory, not in an\n"
           "                      L3 that holds them (a model's other layers run in between;\n"
           "                      give about twice the L3: 512 on a 260 MiB L3) (default: 0)\n"
           "\n"
           "Example:\n"
           "  mha decode-bench --heads 32 --kv-heads 8 --head-dim 128 --cache-len 4096 --batch 1 "
           "\\\n"
           "      --steps 64 --threads 2 --cache-dtype bf16 --stream 1024 --naive\n");
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* xorshift64: uniform in [-1, 1) times scale, the run's own generator (seeded once per run). */
static void fill(uint64_t *rng, float *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        x[i] = scale * ((float)(*rng >> 40) * (2.0f / 16777216.0f) - 1.0f);
    }
}

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* ---- STREAM-like read bandwidth. ------------------------------------------------------------- */
/* The read-bandwidth probe: each of `threads` threads sums its contiguous share of the buffer
 * (8 independent chains), started and joined by the CLI itself (the library's threads are not
 * part of its API). */
typedef struct stream_job {
    const uint64_t *buf;
    int64_t begin, end; /* in words */
    uint64_t sum;
    int prefetch; /* also a software prefetch (into the L2) STREAM_PREFETCH bytes ahead */
} stream_job;

/* The prefetched loop's distance: 32 KiB, the distance of the few-rows GEMM's prefetches of
 * bf16 weights 4096 wide (on AMD Zen 5 the loop with it read 1.15-1.2x the plain one; 0.5 KiB
 * 0.45x, 2 KiB 0.9x, 8 KiB as 32 KiB). The address may lie past the buffer: a prefetch never
 * faults (hence the integer arithmetic). */
#define STREAM_PREFETCH 32768

static void *stream_part(void *arg) {
    stream_job *j = arg;
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    for (int64_t i = j->begin; i < j->end; i += 8) {
        if (j->prefetch)
            __builtin_prefetch((const void *)((uintptr_t)(j->buf + i) + STREAM_PREFETCH), 0, 2);
        a0 += j->buf[i];
        a1 += j->buf[i + 1];
        a2 += j->buf[i + 2];
        a3 += j->buf[i + 3];
        a4 += j->buf[i + 4];
        a5 += j->buf[i + 5];
        a6 += j->buf[i + 6];
        a7 += j->buf[i + 7];
    }
    j->sum += a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
    return NULL;
}

/* One pass over words [0, words) on `threads` threads (the caller's included). */
static void
stream_pass(const uint64_t *buf, int64_t words, int threads, int prefetch, stream_job *jobs) {
    pthread_t tid[64];
    int started[64] = {0};
    const int64_t lines = words / 8;
    for (int t = 0; t < threads; t++) {
        jobs[t].buf = buf;
        jobs[t].prefetch = prefetch;
        jobs[t].begin = lines * t / threads * 8;
        jobs[t].end = lines * (t + 1) / threads * 8;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&tid[t], NULL, stream_part, &jobs[t]) == 0;
    stream_part(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else
            stream_part(&jobs[t]);
    }
}

/* GB/s of the best of 5 passes of each loop: best[0] plain, best[1] with software prefetches.
 * CLI_FAIL (one line) when the buffer cannot be allocated: never a silent 0 GB/s. */
static int stream_gbs(int64_t mb, int threads, double best[2]) {
    const int64_t words = mb * 1024 * 1024 / 8;
    /* In 2 MiB pages where the OS gives them, as the library asks for its KV caches: the loop
     * measures the memory, not the page walks of 4 KiB pages. */
    const size_t huge = (size_t)2 << 20;
    const size_t bytes = (sizeof(uint64_t) * (size_t)words + huge - 1) / huge * huge;
    uint64_t *buf = aligned_alloc(huge, bytes);
    best[0] = best[1] = 0.0;
    if (!buf)
        return cli_fail("cannot allocate --stream %lld MB", (long long)mb);
    (void)madvise(buf, bytes, MADV_HUGEPAGE);
    for (int64_t i = 0; i < words; i++)
        buf[i] = (uint64_t)i;
    stream_job jobs[64];
    memset(jobs, 0, sizeof jobs);
    threads = threads < 1 ? 1 : (threads > 64 ? 64 : threads);
    for (int rep = 0; rep < 10; rep++) { /* the two loops alternated: the same load on both */
        const int pf = rep & 1;
        const double t0 = now_s();
        stream_pass(buf, words, threads, pf, jobs);
        const double dt = now_s() - t0;
        const double gbs = (double)(words / 8 * 64) / dt * 1e-9;
        best[pf] = gbs > best[pf] ? gbs : best[pf];
    }
    uint64_t keep = 0;
    for (int t = 0; t < threads; t++)
        keep += jobs[t].sum;
    free(buf);
    if (keep == 1) /* the sum is used, so the loop is not optimised away */
        best[0] = -best[0];
    return CLI_OK;
}

/* Positions per prefill call. */
#define BENCH_CHUNK 256

/* ---- Naive decode attention: per sequence and head, three passes, float32, one thread. ------ */
static double
naive_step(const mha_kv_cache *c, int64_t B, int64_t H, const float *q, float *out, float *s) {
    /* Per sequence: scores of every head over every cached position (pass 1 over K), softmax,
     * then pass 2 over V; each position read once per pass through mha_kv_cache_read (float32,
     * all kv heads). s holds [H, L] scores, then one K or V row [G, D]. */
    const mha_kv_cache_config *k = mha_kv_cache_get_config(c);
    const int64_t G = k->num_kv_heads, D = k->head_dim, grp = H / G;
    const float scale = 1.0f / sqrtf((float)D);
    const double t0 = now_s();
    for (int64_t b = 0; b < B; b++) {
        const int64_t L = mha_kv_cache_length(c, b);
        float *row = s + H * L;
        for (int64_t j = 0; j < L; j++) {
            mha_kv_cache_read(c, b, j, row, NULL, NULL);
            for (int64_t h = 0; h < H; h++) {
                const float *qh = q + (b * H + h) * D, *kr = row + (h / grp) * D;
                float dot = 0.0f;
                for (int64_t d = 0; d < D; d++)
                    dot += qh[d] * kr[d];
                s[h * L + j] = dot * scale;
            }
        }
        for (int64_t h = 0; h < H; h++) {
            float mx = -INFINITY, sum = 0.0f;
            for (int64_t j = 0; j < L; j++)
                mx = s[h * L + j] > mx ? s[h * L + j] : mx;
            for (int64_t j = 0; j < L; j++)
                sum += (s[h * L + j] = expf(s[h * L + j] - mx));
            for (int64_t j = 0; j < L; j++)
                s[h * L + j] /= sum;
            memset(out + (b * H + h) * D, 0, sizeof(float) * (size_t)D);
        }
        for (int64_t j = 0; j < L; j++) {
            mha_kv_cache_read(c, b, j, NULL, row, NULL);
            for (int64_t h = 0; h < H; h++) {
                const float p = s[h * L + j], *vr = row + (h / grp) * D;
                float *o = out + (b * H + h) * D;
                for (int64_t d = 0; d < D; d++)
                    o[d] += p * vr[d];
            }
        }
    }
    return now_s() - t0;
}

/* ---- The benchmark. ---------------------------------------------------------------------------
 */
/* What the command line asks for. */
typedef struct bench_opts {
    int64_t H, G, D, Q, L, B, N,
        stream_mb;       /* heads, kv heads, head dim, q_dim, cache, batch, steps */
    int64_t warmup_ms;   /* --warmup */
    int64_t cold_mb;     /* --cold, 0 = none */
    int64_t paged;       /* --paged block size, 0 = none */
    int paged_order;     /* --paged-order: PO_* */
    int64_t paged_peers; /* --paged-peers (lockstep, interleaved; else 0) */
    int compact;         /* --compact */
    int threads;
    mha_dtype dt, wdt;
    const char *dtn, *wdtn; /* the cache's and the weights' dtype names */
    int layer_prefill, attn_only, naive, json;
    int64_t tree[16], tree_t; /* --draft-tree; tree_t = 0 without */
    int64_t *lens;            /* [B] --batch-lengths, else NULL (every sequence --cache-len) */
    int q8_order;             /* --q8-order: -1 auto, 0 rows, 1 interleaved */
} bench_opts;

/* What a run holds (bench_free releases it) and what it measures. */
typedef struct bench_run {
    mha_layer *layer; /* NULL with --attention-only */
    mha_kv_cache *cache;
    mha_kv_cache *paged; /* --paged: the same K/V in blocks */
    float *pkv;          /* --paged: the measured sequences' chunk [B][2][chunk][G][D] */
    float *peer_kv;      /* --paged: zeros, one token of every peer [P][G][D] (K and V) */
    double *ptimes;      /* --paged: its attention times */
    double paged_med, paged_min;
    double compact_s;    /* --compact: the call's time */
    int64_t runs_before; /* --compact: runs of the measured sequences' blocks before */
    mha_exec ex;
    mha_error err;
    uint64_t rng;
    float *wbuf, *kv, *xbuf, *ybuf, *q, *o, *scores;
    uint16_t *whalf; /* the weights rounded to --weight-dtype bf16 / f16 */
    void *wq8;       /* the weights quantised to --weight-dtype q8_0 / q4_0 */
    double *times;
    double prefill_s, attn_med, attn_min, kv_bytes, naive_s, layer_med, layer_min, stream;
    double stream_pf; /* the read loop with software prefetches (stream_gbs) */
    double weight_bytes;
    double tree_med, tree_min, tree_max, one_med, one_min, one_max; /* --draft-tree */
    double tree_flops; /* --draft-tree: a tree call's multiply-adds x 2, the mean over its calls */
    uint64_t *cold;    /* --cold: the buffer read before every timed call */
    volatile uint64_t cold_sum; /* what the reads summed: stored, so they are not dropped */
} bench_run;

/* --cold: one load per 64-byte line of the buffer, which evicts from the L3 what the last call
 * left there (the loads' sum is kept so the compiler cannot drop them). */
static void go_cold(const bench_opts *b, bench_run *r) {
    const size_t n = (size_t)b->cold_mb * (1u << 20) / sizeof(uint64_t);
    uint64_t sum = 0;
    for (size_t i = 0; i < n; i += 64 / sizeof(uint64_t))
        sum += r->cold[i];
    r->cold_sum = r->cold_sum + sum;
}

/* --paged-order values (bench_paged_cache). */
enum { PO_LOCKSTEP, PO_ORDERED, PO_INTERLEAVED, PO_FRAGMENTED, PO_ALTERNATE, PO_COUNT };
static const char *const paged_orders[PO_COUNT] = {"lockstep", "ordered", "interleaved",
                                                   "fragmented", "alternate"};

static int parse_bench(const cli_args *args, bench_opts *b) {
    int rc;
    int64_t T = 0;
    *b = (bench_opts){.H = 32,
                      .G = 8,
                      .D = 128,
                      .L = 4096,
                      .B = 1,
                      .N = 32,
                      .dt = MHA_DTYPE_F32,
                      .dtn = "f32",
                      .wdt = MHA_DTYPE_F32,
                      .wdtn = "f32",
                      .paged_peers = 7,
                      .warmup_ms = 250,
                      .q8_order = -1};
    const struct {
        int id;
        int64_t *dst, lo, hi;
    } ints[] = {{B_HEADS, &b->H, 1, 4096},
                {B_KV_HEADS, &b->G, 1, 4096},
                {B_HEAD_DIM, &b->D, 1, 4096},
                {B_Q_DIM, &b->Q, 1, 1 << 20},
                {B_CACHE_LEN, &b->L, 1, 1 << 24},
                {B_BATCH, &b->B, 1, 4096},
                {B_STEPS, &b->N, 1, 1 << 20},
                {B_THREADS, &T, 0, 4096},
                {B_STREAM_MB, &b->stream_mb, 1, 1 << 20},
                {B_PAGED, &b->paged, 16, 256},
                {B_PAGED_PEERS, &b->paged_peers, 0, 64},
                {B_WARMUP, &b->warmup_ms, 0, 60000},
                {B_COLD, &b->cold_mb, 0, 1 << 20}};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        if (args->given[ints[i].id] &&
            (rc = cli_parse_i64(bench_flags[ints[i].id].name, args->value[ints[i].id], ints[i].lo,
                                ints[i].hi, ints[i].dst)))
            return rc;
    if (b->H % b->G != 0)
        return cli_usage("--kv-heads %lld does not divide --heads %lld", (long long)b->G,
                         (long long)b->H);
    if (b->Q == 0)
        b->Q = b->H * b->D;
    if (args->given[B_CACHE_DTYPE]) {
        b->dtn = args->value[B_CACHE_DTYPE];
        if (strcmp(b->dtn, "f16") == 0)
            b->dt = MHA_DTYPE_F16;
        else if (strcmp(b->dtn, "bf16") == 0)
            b->dt = MHA_DTYPE_BF16;
        else if (strcmp(b->dtn, "q8_0") == 0)
            b->dt = MHA_DTYPE_Q8_0;
        else if (strcmp(b->dtn, "fp8") == 0 || strcmp(b->dtn, "fp8_e4m3") == 0)
            b->dt = MHA_DTYPE_FP8_E4M3;
        else if (strcmp(b->dtn, "f32") != 0)
            return cli_usage("--cache-dtype: '%s' is not f32, f16, bf16, q8_0 or fp8", b->dtn);
    }
    if (args->given[B_Q8_ORDER]) {
        const char *o = args->value[B_Q8_ORDER];
        b->q8_order = strcmp(o, "rows") == 0 ? 0 : strcmp(o, "interleaved") == 0 ? 1 : -2;
        if (b->q8_order == -2 && strcmp(o, "auto") != 0)
            return cli_usage("--q8-order: '%s' is not auto, rows or interleaved", o);
        b->q8_order = b->q8_order == -2 ? -1 : b->q8_order;
        if (b->q8_order >= 0 && b->dt != MHA_DTYPE_Q8_0)
            return cli_usage("--q8-order needs --cache-dtype q8_0");
    }
    if (args->given[B_WEIGHT_DTYPE]) {
        b->wdtn = args->value[B_WEIGHT_DTYPE];
        if (strcmp(b->wdtn, "f16") == 0)
            b->wdt = MHA_DTYPE_F16;
        else if (strcmp(b->wdtn, "bf16") == 0)
            b->wdt = MHA_DTYPE_BF16;
        else if (strcmp(b->wdtn, "q8_0") == 0)
            b->wdt = MHA_DTYPE_Q8_0;
        else if (strcmp(b->wdtn, "q4_0") == 0)
            b->wdt = MHA_DTYPE_Q4_0;
        else if (strcmp(b->wdtn, "f32") != 0)
            return cli_usage("--weight-dtype: '%s' is not f32, f16, bf16, q8_0 or q4_0", b->wdtn);
    }
    if (args->given[B_PREFILL_MODE]) {
        if (strcmp(args->value[B_PREFILL_MODE], "layer") == 0)
            b->layer_prefill = 1;
        else if (strcmp(args->value[B_PREFILL_MODE], "random") != 0)
            return cli_usage("--prefill-mode: '%s' is not random or layer",
                             args->value[B_PREFILL_MODE]);
    }
    if (args->given[B_PAGED_ORDER]) {
        b->paged_order = PO_COUNT;
        for (int i = 0; i < PO_COUNT; i++)
            if (strcmp(args->value[B_PAGED_ORDER], paged_orders[i]) == 0)
                b->paged_order = i;
        if (b->paged_order == PO_COUNT)
            return cli_usage("--paged-order: '%s' is not lockstep, ordered, interleaved, "
                             "fragmented or alternate",
                             args->value[B_PAGED_ORDER]);
        if (!b->paged)
            return cli_usage("--paged-order needs --paged");
    }
    if (args->given[B_PAGED_PEERS] && !b->paged)
        return cli_usage("--paged-peers needs --paged");
    b->compact = args->given[B_COMPACT];
    if (b->compact && !b->paged)
        return cli_usage("--compact needs --paged");
    if (b->paged_order != PO_LOCKSTEP && b->paged_order != PO_INTERLEAVED)
        b->paged_peers = 0;
    b->attn_only = args->given[B_ATTN_ONLY];
    if (b->layer_prefill && b->attn_only)
        return cli_usage("--prefill-mode layer needs the layer (drop --attention-only)");
    b->threads = T > 0 ? (int)T : mha_default_threads();
    b->naive = args->given[B_NAIVE];
    b->json = args->given[B_JSON];
    if (args->given[B_DRAFT_TREE]) {
        const char *c = args->value[B_DRAFT_TREE];
        while (*c) {
            char *end;
            const long long v = strtoll(c, &end, 10);
            if (end == c || b->tree_t == 16 || v < -1 || v >= b->tree_t)
                return cli_usage("--draft-tree: '%s' is not a list of at most 16 parents, each -1 "
                                 "or an earlier index",
                                 args->value[B_DRAFT_TREE]);
            b->tree[b->tree_t++] = v;
            c = *end == ',' ? end + 1 : end;
            if (*end && *end != ',')
                return cli_usage("--draft-tree: '%s': expected a comma list",
                                 args->value[B_DRAFT_TREE]);
        }
        if (b->tree_t == 0)
            return cli_usage("--draft-tree: empty list");
    }
    if (args->given[B_BATCH_LENGTHS]) {
        const char *c = args->value[B_BATCH_LENGTHS];
        if (!b->attn_only)
            return cli_usage("--batch-lengths needs --attention-only");
        long long lo, hi, seed;
        int logu = strncmp(c, "logu:", 5) == 0, used = 0;
        if (logu && (sscanf(c + 5, "%lld:%lld:%lld%n", &lo, &hi, &seed, &used) != 3 ||
                     c[5 + used] != '\0')) /* all of it: "logu:1:10:5xyz" is no list */
            return cli_usage("--batch-lengths: '%s' is not logu:LO:HI:SEED", c);
        if (logu && (lo < 1 || hi < lo || hi > (1 << 24)))
            return cli_usage("--batch-lengths: need 1 <= LO <= HI <= 2^24");
        if (!logu) { /* the batch is the list's size */
            b->B = 1;
            for (const char *x = c; *x; x++)
                b->B += *x == ',';
        }
        if (b->B > 4096)
            return cli_usage("--batch-lengths: at most 4096 sequences");
        b->lens = malloc(sizeof(int64_t) * (size_t)b->B);
        if (!b->lens)
            return cli_fail("out of memory");
        uint64_t rng = 0x2545F4914F6CDD1Dull ^ (uint64_t)(logu ? seed : 0);
        b->L = 0;
        for (int64_t i = 0; i < b->B; i++) {
            if (logu) {
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                const double u = (double)(rng >> 11) * 0x1p-53;
                b->lens[i] = (int64_t)llround(exp(log((double)lo) + u * log((double)hi / lo)));
            } else {
                char *end;
                const long long v = strtoll(c, &end, 10);
                if (end == c || v < 1 || v > (1 << 24) || (*end && *end != ',')) {
                    free(b->lens);
                    b->lens = NULL;
                    return cli_usage("--batch-lengths: '%s' is not a list of lengths in [1, 2^24]",
                                     args->value[B_BATCH_LENGTHS]);
                }
                b->lens[i] = v;
                c = *end ? end + 1 : end;
            }
            b->L = b->lens[i] > b->L ? b->lens[i] : b->L; /* --cache-len: the longest */
        }
    }
    /* The paged copy is filled token by token from the random K/V of --cache-len positions per
     * sequence (bench_prefill): without this refusal it stayed almost empty and was timed so. */
    if (b->paged && (b->lens || b->layer_prefill)) {
        const int lens = b->lens != NULL;
        free(b->lens);
        b->lens = NULL;
        return cli_usage("--paged cannot be combined with %s (the paged copy holds the random K/V "
                         "of --cache-len positions per sequence)",
                         lens ? "--batch-lengths" : "--prefill-mode layer");
    }
    return CLI_OK;
}

/* float32 to bfloat16 / float16, round to nearest even (finite inputs; the library's own
 * conversions are internal: the CLI stands on the public API). */
static uint16_t round_half(float f, int bf16) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (bf16)
        return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t a = u & 0x7fffffffu;
    if (a >= 0x47800000u) /* beyond float16's range */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) /* subnormal: |f| 2^24 is exact, lrintf rounds it to nearest even */
        return (uint16_t)(sign | (uint16_t)lrintf(fabsf(f) * 16777216.0f));
    uint32_t v = a - (112u << 23);
    v += 0xfffu + ((v >> 13) & 1u);
    return (uint16_t)(sign | (v >> 13));
}

/* --paged: a cache of the same sizes in blocks of b->paged positions. Its sequences 0 .. B-1
 * receive the contiguous cache's K/V one token at a time (bench_prefill, bench_attention);
 * where their blocks lie depends on --paged-order:
 *   lockstep: sequences B .. B+P-1 (the peers, zeros) grow with them, one token each after each
 *     token of theirs, in a pool with room for all at full length: the pool's placement policy
 *     (docs/INFERENCE.md "Block placement") decides;
 *   ordered: no peers, a pool of B x blocks-per-sequence (batch 1: blocks 0, 1, 2, ...);
 *   interleaved: the layout the free-id stack (before session 40) gave lockstep growth of
 *     N = B + P sequences: one-block scratch sequences fill the pool, then the scratch holding
 *     the blocks b with b % N < B are reset; the policy takes isolated free blocks leftmost
 *     first, so with batch 1 sequence 0 gets blocks 0, N, 2N, ... as the stack gave it;
 *   fragmented / alternate: a pool of 2 B x blocks-per-sequence filled by scratch sequences,
 *     then a random half of its blocks (fragmented: runs of random length, taken largest first,
 *     so scattered across the pool) or every other block (alternate: isolated blocks, taken in
 *     increasing order, 2 blocks apart) freed: what the policy cannot fix. */
/* mha_kv_cache_create, or with the q8_0 order --q8-order asks for. */
static mha_status bench_cache_create(const bench_opts *b,
                                     const mha_kv_cache_config *kc,
                                     const mha_layer *layer,
                                     mha_kv_cache **out,
                                     mha_error *err) {
    return b->q8_order < 0
               ? mha_kv_cache_create(kc, layer, NULL, out, err)
               : mha_experimental_kv_cache_create_q8_order(kc, layer, NULL, b->q8_order, out, err);
}

static int bench_paged_cache(const bench_opts *b, const mha_kv_cache_config *kc, bench_run *r) {
    const int64_t nbs = (kc->max_seq + b->paged - 1) / b->paged, B = b->B, P = b->paged_peers;
    const int po = b->paged_order;
    const int64_t n = (po == PO_FRAGMENTED || po == PO_ALTERNATE ? 2 * B : B + P) * nbs;
    const int64_t scratch = po == PO_LOCKSTEP || po == PO_ORDERED ? 0 : n;
    mha_kv_cache_config pc = *kc;
    pc.batch = B + P + scratch;
    pc.block_size = b->paged;
    pc.num_blocks = n;
    if (bench_cache_create(b, &pc, r->layer, &r->paged, &r->err) != MHA_STATUS_OK)
        return cli_lib_fail(NULL, &r->err);
    r->ptimes = malloc(sizeof(double) * (size_t)b->N);
    r->pkv = malloc(sizeof(float) * (size_t)(B * 2 * BENCH_CHUNK * b->G * b->D));
    r->peer_kv = calloc((size_t)(2 * (P > 0 ? P : 1) * b->G * b->D), sizeof(float));
    int64_t *owner = scratch ? malloc(sizeof(int64_t) * (size_t)n) : NULL;
    if (!r->ptimes || !r->pkv || !r->peer_kv || (scratch && !owner)) {
        free(owner);
        return cli_fail("out of memory");
    }
    mha_status st = MHA_STATUS_OK;
    for (int64_t i = 0; i < scratch && !st; i++) { /* every block held by a scratch sequence */
        const int64_t seq = B + P + i;
        st = mha_kv_cache_append(r->paged, 1, &seq, 1, r->peer_kv, r->peer_kv + b->G * b->D,
                                 &r->err);
        if (!st)
            owner[mha_experimental_kv_cache_block(r->paged, seq, 0)] = seq;
    }
    if (scratch && po == PO_FRAGMENTED) {     /* free the first half of a shuffle of the blocks */
        for (int64_t i = n - 1; i > 0; i--) { /* Fisher-Yates */
            r->rng ^= r->rng << 13;
            r->rng ^= r->rng >> 7;
            r->rng ^= r->rng << 17;
            const int64_t j = (int64_t)(r->rng % (uint64_t)(i + 1)), t = owner[i];
            owner[i] = owner[j];
            owner[j] = t;
        }
        for (int64_t i = 0; i < n / 2 && !st; i++)
            st = mha_kv_cache_reset(r->paged, owner[i], &r->err);
    } else {
        for (int64_t blk = 0; blk < scratch && !st; blk++)
            if (po == PO_ALTERNATE ? blk % 2 == 0 : blk % (B + P) < B)
                st = mha_kv_cache_reset(r->paged, owner[blk], &r->err);
    }
    free(owner);
    return st ? cli_lib_fail(NULL, &r->err) : CLI_OK;
}

/* --paged: token `tok` of every measured sequence (from r->pkv, chunk of tc tokens), then
 * (lockstep) one token of every peer: the lockstep growth of a continuous batch. */
static mha_status bench_paged_token(const bench_opts *b, bench_run *r, int64_t tc, int64_t tok) {
    const int64_t GD = b->G * b->D;
    mha_status st = MHA_STATUS_OK;
    for (int64_t seq = 0; seq < b->B && !st; seq++) {
        const float *k = r->pkv + seq * 2 * BENCH_CHUNK * GD + tok * GD;
        st = mha_kv_cache_append(r->paged, 1, &seq, 1, k, k + tc * GD, &r->err);
    }
    if (b->paged_order == PO_LOCKSTEP && b->paged_peers > 0 && !st) {
        int64_t ids[64];
        for (int64_t i = 0; i < b->paged_peers; i++)
            ids[i] = b->B + i;
        st = mha_kv_cache_append(r->paged, b->paged_peers, ids, 1, r->peer_kv,
                                 r->peer_kv + b->paged_peers * GD, &r->err);
    }
    return st;
}

/* The layer with random weights (scaled like a trained one: unit-variance activations), unless
 * --attention-only; the cache; the thread pool; the buffers. */
static int bench_setup(const bench_opts *b, bench_run *r) {
    const int64_t H = b->H, G = b->G, D = b->D, Q = b->Q, L = b->L, B = b->B, N = b->N;
    mha_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.q_dim = Q, cfg.num_heads = H, cfg.num_kv_heads = G, cfg.head_dim = D;
    cfg.rope.style = MHA_ROPE_HALF;
    cfg.rope.theta = 500000.0;
    if (!b->attn_only) {
        const int64_t nw = 2 * H * D * Q + 2 * G * D * Q;
        r->wbuf = malloc(sizeof(float) * (size_t)nw);
        if (!r->wbuf)
            return cli_fail("cannot allocate %lld weights", (long long)nw);
        fill(&r->rng, r->wbuf, nw, 1.0f / sqrtf((float)Q));
        cfg.weight_dtype = b->wdt;
        const char *base = (const char *)r->wbuf;
        size_t es = sizeof(float);
        const int q4 = b->wdt == MHA_DTYPE_Q4_0;
        const size_t block = q4 ? 18 : 34;    /* bytes per 32 weights of a block type */
        if (b->wdt == MHA_DTYPE_Q8_0 || q4) { /* each matrix's rows: Q (a multiple of 32) values */
            if (Q % 32 != 0 || (H * D) % 32 != 0)
                return cli_usage("--weight-dtype %s needs --q-dim and heads * head-dim "
                                 "multiples of 32",
                                 b->wdtn);
            r->wq8 = malloc((size_t)(nw / 32) * block);
            if (!r->wq8)
                return cli_fail("cannot allocate %lld weights", (long long)nw);
            if ((q4 ? mha_q4_0_quantize : mha_q8_0_quantize)(r->wbuf, nw, r->wq8, &r->err) !=
                MHA_STATUS_OK)
                return cli_lib_fail(NULL, &r->err);
            base = (const char *)r->wq8;
        } else if (b->wdt != MHA_DTYPE_F32) {
            r->whalf = malloc(sizeof(uint16_t) * (size_t)nw);
            if (!r->whalf)
                return cli_fail("cannot allocate %lld weights", (long long)nw);
            for (int64_t i = 0; i < nw; i++)
                r->whalf[i] = round_half(r->wbuf[i], b->wdt == MHA_DTYPE_BF16);
            base = (const char *)r->whalf;
            es = sizeof(uint16_t);
        }
        /* Bytes of the first `count` weights (q8_0 / q4_0: 34 / 18 per 32, every matrix whole
         * blocks). */
#define WBYTES_(count)                                                                             \
    (b->wdt == MHA_DTYPE_Q8_0 || q4 ? (size_t)((count) / 32) * block : es * (size_t)(count))
        r->weight_bytes = (double)WBYTES_(nw);
        mha_weights w;
        memset(&w, 0, sizeof w);
        w.w_q = base;
        w.w_k = base + WBYTES_(H * D * Q);
        w.w_v = base + WBYTES_(H * D * Q + G * D * Q);
        w.w_o = base + WBYTES_(H * D * Q + 2 * G * D * Q);
#undef WBYTES_
        /* Copied, as the safetensors and Hugging Face loaders do: the layer's own storage (in 2
         * MiB pages where the OS gives them, like the read loop of --stream). */
        if (mha_layer_create(&cfg, &w, MHA_WEIGHTS_COPY, NULL, &r->layer, &r->err) != MHA_STATUS_OK)
            return cli_lib_fail(NULL, &r->err);
        free(r->wbuf);
        free(r->whalf);
        free(r->wq8);
        r->wbuf = NULL;
        r->whalf = NULL;
        r->wq8 = NULL;
    }
    mha_kv_cache_config kc;
    memset(&kc, 0, sizeof kc);
    kc.num_kv_heads = G, kc.head_dim = D, kc.max_seq = L + 2 * N + 16, kc.batch = B;
    kc.dtype = b->dt;
    if (bench_cache_create(b, &kc, r->layer, &r->cache, &r->err) != MHA_STATUS_OK)
        return cli_lib_fail(NULL, &r->err);
    if (b->paged && bench_paged_cache(b, &kc, r) != CLI_OK)
        return CLI_FAIL;
    r->ex.n_threads = b->threads;
    if (mha_threadpool_create(b->threads, NULL, &r->ex.pool, &r->err) != MHA_STATUS_OK)
        return cli_lib_fail(NULL, &r->err);
    const int64_t chunk = BENCH_CHUNK;
    r->kv = malloc(sizeof(float) * (size_t)((chunk > 16 ? chunk : 16) * G * D * 2));
    /* The layer's input and output: [B, chunk, Q] for a prefill call, [B, 1, Q] for a step. */
    const int64_t rows = B * (b->layer_prefill ? chunk : 1);
    r->xbuf = malloc(sizeof(float) * (size_t)(rows * Q));
    r->ybuf = malloc(sizeof(float) * (size_t)(rows * Q));
    r->q = malloc(sizeof(float) * (size_t)(B * 16 * H * D)); /* up to 16 draft tokens */
    r->o = malloc(sizeof(float) * (size_t)(B * 16 * H * D));
    /* The naive loop's scores [H, L + N] and one K/V row [G, D]. */
    r->scores = malloc(sizeof(float) * (size_t)(H * (L + 2 * N) + G * D));
    r->times = malloc(sizeof(double) * (size_t)N);
    if (b->cold_mb) { /* written once, so that its pages exist */
        r->cold = malloc((size_t)b->cold_mb << 20);
        if (!r->cold)
            return cli_fail("cannot allocate --cold %lld MB", (long long)b->cold_mb);
        memset(r->cold, 1, (size_t)b->cold_mb << 20);
    }
    if (!r->kv || !r->xbuf || !r->ybuf || !r->q || !r->o || !r->scores || !r->times)
        return cli_fail("out of memory");
    return CLI_OK;
}

/* --cache-len positions per sequence, in chunks: random post-RoPE K/V, or the layer's prefill. */
static int bench_prefill(const bench_opts *b, bench_run *r) {
    const int64_t G = b->G, D = b->D, Q = b->Q, L = b->L, B = b->B, chunk = BENCH_CHUNK;
    const double t0 = now_s();
    for (int64_t p0 = 0; p0 < L; p0 += chunk) {
        const int64_t tc = L - p0 < chunk ? L - p0 : chunk;
        mha_status st = MHA_STATUS_OK;
        if (b->lens) { /* --batch-lengths: each sequence to its own length */
            for (int64_t seq = 0; seq < B && !st; seq++) {
                const int64_t n = b->lens[seq] - p0 < tc ? b->lens[seq] - p0 : tc;
                if (n <= 0)
                    continue;
                fill(&r->rng, r->kv, 2 * n * G * D, 1.0f);
                st = mha_kv_cache_append(r->cache, 1, &seq, n, r->kv, r->kv + n * G * D, &r->err);
            }
            if (st != MHA_STATUS_OK)
                return cli_lib_fail(NULL, &r->err);
            continue;
        }
        if (b->layer_prefill) {
            fill(&r->rng, r->xbuf, B * tc * Q, 1.0f);
            mha_decode_args a = {B, NULL, tc, r->xbuf, r->ybuf, NULL};
            st = mha_layer_prefill(r->layer, r->cache, &a, &r->ex, &r->err);
        } else {
            for (int64_t seq = 0; seq < B && !st; seq++) {
                /* --paged: kept for the paged cache's token-by-token appends */
                float *kv = r->paged ? r->pkv + seq * 2 * chunk * G * D : r->kv;
                fill(&r->rng, kv, 2 * tc * G * D, 1.0f);
                st = mha_kv_cache_append(r->cache, 1, &seq, tc, kv, kv + tc * G * D, &r->err);
            }
            for (int64_t tok = 0; r->paged && tok < tc && !st; tok++)
                st = bench_paged_token(b, r, tc, tok);
        }
        if (st != MHA_STATUS_OK)
            return cli_lib_fail(NULL, &r->err);
    }
    r->prefill_s = now_s() - t0;
    return CLI_OK;
}

/* --steps attention-only steps: append one token's K/V per sequence, attend (timed); the median
 * and minimum, and the K and V bytes a step reads on average. */
static int bench_attention(const bench_opts *b, bench_run *r) {
    const int64_t H = b->H, G = b->G, D = b->D, L = b->L, B = b->B, N = b->N;
    fill(&r->rng, r->q, B * H * D, 1.0f);
    mha_kv_attention_args ka;
    memset(&ka, 0, sizeof ka);
    ka.num_seqs = B, ka.num_tokens = 1, ka.num_heads = H, ka.q = r->q, ka.out = r->o;
    /* --warmup: the same call, untimed, the cache unchanged (see the usage text) */
    const double w0 = now_s();
    while (now_s() - w0 < 1e-3 * (double)b->warmup_ms)
        for (int k = 0; k < (r->paged ? 2 : 1); k++)
            if (mha_kv_cache_attention(k ? r->paged : r->cache, &ka, &r->ex, &r->err) !=
                MHA_STATUS_OK)
                return cli_lib_fail(NULL, &r->err);
    double kv_bytes = 0.0;
    for (int64_t s = 0; s < N; s++) {
        fill(&r->rng, r->kv, 2 * G * D, 1.0f);
        mha_status st = MHA_STATUS_OK;
        for (int64_t seq = 0; seq < B && !st; seq++) {
            st = mha_kv_cache_append(r->cache, 1, &seq, 1, r->kv, r->kv + G * D, &r->err);
            if (r->paged) /* the same token for the paged cache's bench_paged_token */
                memcpy(r->pkv + seq * 2 * BENCH_CHUNK * G * D, r->kv,
                       sizeof(float) * (size_t)(2 * G * D));
        }
        if (!st && r->paged)
            st = bench_paged_token(b, r, 1, 0);
        /* --paged: both caches each step, which first alternating */
        for (int k = 0; k < (r->paged ? 2 : 1) && !st; k++) {
            const int pg = r->paged && (k ^ (int)(s & 1));
            go_cold(b, r);
            const double ts = now_s();
            st = mha_kv_cache_attention(pg ? r->paged : r->cache, &ka, &r->ex, &r->err);
            (pg ? r->ptimes : r->times)[s] = now_s() - ts;
        }
        if (st != MHA_STATUS_OK)
            return cli_lib_fail(NULL, &r->err);
        /* bytes per value: the element size, or 34 / 32 for q8_0 blocks */
        const double per = b->dt == MHA_DTYPE_Q8_0 ? 34.0 / 32.0 : (double)mha_dtype_size(b->dt);
        for (int64_t seq = 0; seq < B; seq++)
            kv_bytes +=
                (double)G * (double)((b->lens ? b->lens[seq] : L) + s + 1) * (double)(2 * D) * per;
    }
    r->kv_bytes = kv_bytes / (double)N;
    qsort(r->times, (size_t)N, sizeof(double), cmp_d);
    r->attn_med = r->times[N / 2], r->attn_min = r->times[0];
    if (r->paged) {
        qsort(r->ptimes, (size_t)N, sizeof(double), cmp_d);
        r->paged_med = r->ptimes[N / 2], r->paged_min = r->ptimes[0];
    }
    return CLI_OK;
}

/* --draft-tree: --steps pairs of (a) the tree's t drafts appended and verified (timed), dropped
 * again, (b) one token appended and attended (timed), the cache growing by one per pair. */
static int bench_tree(const bench_opts *b, bench_run *r) {
    const int64_t H = b->H, G = b->G, D = b->D, B = b->B, N = b->N, t = b->tree_t;
    fill(&r->rng, r->q, B * t * H * D, 1.0f);
    double *one = malloc(sizeof(double) * (size_t)N);
    if (!one)
        return cli_fail("out of memory");
    for (int64_t s = 0; s < N; s++) {
        mha_status st = MHA_STATUS_OK;
        for (int pass = 0; pass < 2 && !st; pass++) {
            const int64_t n = pass == 0 ? t : 1;
            mha_kv_attention_args ka;
            memset(&ka, 0, sizeof ka);
            ka.num_seqs = B, ka.num_tokens = n, ka.num_heads = H, ka.q = r->q, ka.out = r->o;
            ka.tree_parents = pass == 0 ? b->tree : NULL;
            fill(&r->rng, r->kv, 2 * n * G * D, 1.0f);
            int64_t len0[4096];
            for (int64_t seq = 0; seq < B && !st; seq++) {
                len0[seq] = mha_kv_cache_length(r->cache, seq);
                st = mha_kv_cache_append(r->cache, 1, &seq, n, r->kv, r->kv + n * G * D, &r->err);
                /* the kernels' arithmetic: every query row (H x t) against every key it is given
                 * (the cache and all t drafts; the masks act after), d_k + d_v FMAs each */
                if (pass == 0)
                    r->tree_flops += 2.0 * (double)(H * t) * (double)(len0[seq] + t) *
                                     (double)(2 * D) / (double)N;
            }
            go_cold(b, r);
            const double ts = now_s();
            if (!st)
                st = mha_kv_cache_attention(r->cache, &ka, &r->ex, &r->err);
            (pass == 0 ? r->times : one)[s] = now_s() - ts;
            for (int64_t seq = 0; seq < B && !st && pass == 0; seq++)
                st = mha_kv_cache_truncate(r->cache, seq, len0[seq], &r->err);
        }
        if (st != MHA_STATUS_OK) {
            free(one);
            return cli_lib_fail(NULL, &r->err);
        }
    }
    qsort(r->times, (size_t)N, sizeof(double), cmp_d);
    qsort(one, (size_t)N, sizeof(double), cmp_d);
    r->tree_med = r->times[N / 2], r->tree_min = r->times[0], r->tree_max = r->times[N - 1];
    r->one_med = one[N / 2], r->one_min = one[0], r->one_max = one[N - 1];
    free(one);
    return CLI_OK;
}

/* --steps whole layer steps (projections + RoPE + attention) from the cache cut back to
 * --cache-len; the median. */
static int bench_layer(const bench_opts *b, bench_run *r) {
    for (int64_t seq = 0; seq < b->B; seq++)
        mha_kv_cache_truncate(r->cache, seq, b->L, NULL);
    for (int64_t s = 0; s < b->N; s++) {
        fill(&r->rng, r->xbuf, b->B * b->Q, 1.0f);
        mha_decode_args a = {b->B, NULL, 1, r->xbuf, r->ybuf, NULL};
        go_cold(b, r);
        const double ts = now_s();
        mha_status st = mha_layer_decode_step(r->layer, r->cache, &a, &r->ex, &r->err);
        r->times[s] = now_s() - ts;
        if (st != MHA_STATUS_OK)
            return cli_lib_fail(NULL, &r->err);
    }
    qsort(r->times, (size_t)b->N, sizeof(double), cmp_d);
    r->layer_med = r->times[b->N / 2];
    r->layer_min = r->times[0];
    return CLI_OK;
}

/* --paged: runs of consecutive block ids over the measured sequences' tables (*blocks: their
 * blocks): 1 per sequence when every sequence's blocks are in order. */
static int64_t paged_runs(const bench_opts *b, const bench_run *r, int64_t *blocks) {
    int64_t runs = 0;
    *blocks = 0;
    for (int64_t s = 0; s < b->B; s++)
        for (int64_t e = 0, prev = -2;; e++) {
            const int64_t blk = mha_experimental_kv_cache_block(r->paged, s, e);
            if (blk < 0)
                break;
            runs += blk != prev + 1;
            ++*blocks;
            prev = blk;
        }
    return runs;
}

/* --compact: compacts the filled paged cache (timed), before the attention steps. */
static int bench_compact(const bench_opts *b, bench_run *r) {
    if (!b->compact)
        return CLI_OK;
    int64_t blocks;
    r->runs_before = paged_runs(b, r, &blocks);
    const double t0 = now_s();
    if (mha_kv_cache_compact(r->paged, &r->err) != MHA_STATUS_OK)
        return cli_lib_fail(NULL, &r->err);
    r->compact_s = now_s() - t0;
    return CLI_OK;
}

static void bench_report(const bench_opts *b, const bench_run *r) {
    int64_t pblocks = 0;
    const int64_t pruns = r->paged ? paged_runs(b, r, &pblocks) : 0;
    const double gbs = r->kv_bytes / r->attn_med * 1e-9, B = (double)b->B;
    if (b->json) {
        printf("{\"kernel\": \"%s\", \"heads\": %lld, \"kv_heads\": %lld, \"head_dim\": %lld, "
               "\"cache_len\": %lld, \"batch\": %lld, \"steps\": %lld, \"threads\": %d, "
               "\"cache_dtype\": \"%s\", \"prefill_s\": %.6g, \"attn_median_s\": %.6g, "
               "\"attn_min_s\": %.6g, \"kv_bytes_per_step\": %.6g, \"attn_gbs\": %.6g, "
               "\"attn_tokens_per_s\": %.6g, \"layer_median_s\": %.6g, "
               "\"layer_tokens_per_s\": %.6g, \"naive_s\": %.6g, \"stream_gbs\": %.6g, "
               "\"weight_dtype\": \"%s\", \"weight_bytes\": %.6g, \"layer_min_s\": %.6g, "
               "\"layer_weight_gbs\": %.6g, \"stream_pf_gbs\": %.6g, \"paged_block\": %lld, "
               "\"paged_median_s\": %.6g, \"paged_min_s\": %.6g, \"paged_order\": \"%s\", "
               "\"paged_peers\": %lld, \"paged_blocks\": %lld, \"paged_runs\": %lld, "
               "\"compact_s\": %.6g, \"paged_runs_before_compact\": %lld, "
               "\"tree_median_s\": %.6g, \"tree_one_median_s\": %.6g, \"tree_gflops\": %.6g, "
               "\"cold_mb\": %lld}\n",
               decode_kernel_name(b->dt, mha_experimental_kv_cache_q8x16(r->cache) == 1),
               (long long)b->H, (long long)b->G, (long long)b->D, (long long)b->L, (long long)b->B,
               (long long)b->N, b->threads, b->dtn, r->prefill_s, r->attn_med, r->attn_min,
               r->kv_bytes, gbs, B / r->attn_med, r->layer_med,
               r->layer_med > 0.0 ? B / r->layer_med : 0.0, r->naive_s, r->stream, b->wdtn,
               r->weight_bytes, r->layer_min,
               r->layer_med > 0.0 ? r->weight_bytes / r->layer_med * 1e-9 : 0.0, r->stream_pf,
               (long long)b->paged, r->paged_med, r->paged_min, paged_orders[b->paged_order],
               (long long)b->paged_peers, (long long)pblocks, (long long)pruns, r->compact_s,
               (long long)(b->compact ? r->runs_before : pruns), r->tree_med, r->one_med,
               r->tree_med > 0.0 ? r->tree_flops / r->tree_med * 1e-9 : 0.0, (long long)b->cold_mb);
        return;
    }
    printf("decode-bench: h=%lld g=%lld d=%lld q_dim=%lld cache_len=%lld batch=%lld "
           "threads=%d cache=%s kernel=%s\n",
           (long long)b->H, (long long)b->G, (long long)b->D, (long long)b->Q, (long long)b->L,
           (long long)b->B, b->threads, b->dtn,
           decode_kernel_name(b->dt, mha_experimental_kv_cache_q8x16(r->cache) == 1));
    if (b->cold_mb)
        printf("  --cold: %lld MB read before every timed call\n", (long long)b->cold_mb);
    if (b->lens) {
        double tot = 0.0;
        for (int64_t i = 0; i < b->B; i++)
            tot += (double)b->lens[i];
        printf("  --batch-lengths: %lld sequences, %.0f positions in all, longest %lld\n",
               (long long)b->B, tot, (long long)b->L);
    }
    printf("  prefill (%s): %.3f s for %lld positions x %lld sequences\n",
           b->layer_prefill ? "layer" : "random K/V", r->prefill_s, (long long)b->L,
           (long long)b->B);
    printf("  attention step: median %.3f ms, min %.3f ms, %.0f tokens/s, K+V read %.1f MB "
           "-> %.1f GB/s\n",
           r->attn_med * 1e3, r->attn_min * 1e3, B / r->attn_med, r->kv_bytes * 1e-6, gbs);
    if (r->paged)
        printf("  paged (blocks of %lld, %s, %lld peers), interleaved: median %.3f ms, min %.3f "
               "ms, %.1f GB/s; paged / contiguous %.3f (medians)\n",
               (long long)b->paged, paged_orders[b->paged_order], (long long)b->paged_peers,
               r->paged_med * 1e3, r->paged_min * 1e3, r->kv_bytes / r->paged_med * 1e-9,
               r->paged_med / r->attn_med);
    if (r->paged)
        printf("  paged layout: %lld blocks in %lld runs of consecutive blocks\n",
               (long long)pblocks, (long long)pruns);
    if (b->compact)
        printf("  compaction (mha_kv_cache_compact) before the steps: %.3f ms; %lld runs before\n",
               r->compact_s * 1e3, (long long)r->runs_before);
    if (r->naive_s > 0.0)
        printf("  naive loop (1 thread): %.3f ms per step (%.1fx slower)\n", r->naive_s * 1e3,
               r->naive_s / r->attn_med);
    if (!b->attn_only)
        printf("  layer step (projections + RoPE + attention): median %.3f ms, %.1f tokens/s; "
               "%s weights %.1f MB -> %.1f GB/s\n",
               r->layer_med * 1e3, B / r->layer_med, b->wdtn, r->weight_bytes * 1e-6,
               r->weight_bytes / r->layer_med * 1e-9);
    if (r->tree_med > 0.0)
        printf("  draft tree of %lld tokens: median %.3f ms [%.3f, %.3f], %.1f GFLOP/s; one-token "
               "step in the same run: median %.3f ms [%.3f, %.3f]; tree / one = %.2fx\n",
               (long long)b->tree_t, r->tree_med * 1e3, r->tree_min * 1e3, r->tree_max * 1e3,
               r->tree_flops / r->tree_med * 1e-9, r->one_med * 1e3, r->one_min * 1e3,
               r->one_max * 1e3, r->tree_med / r->one_med);
    if (r->stream > 0.0)
        printf("  memory read bandwidth (%lld MB buffer, %d threads): %.1f GB/s; attention "
               "reaches %.0f%%\n",
               (long long)b->stream_mb, b->threads, r->stream, 100.0 * gbs / r->stream);
    if (r->stream_pf > 0.0)
        printf("  the same with software prefetches %d KiB ahead: %.1f GB/s\n",
               STREAM_PREFETCH / 1024, r->stream_pf);
}

static void bench_free(bench_run *r) {
    mha_threadpool_destroy(r->ex.pool);
    free(r->kv);
    free(r->xbuf);
    free(r->ybuf);
    free(r->q);
    free(r->o);
    free(r->scores);
    free(r->times);
    free(r->ptimes);
    free(r->pkv);
    free(r->peer_kv);
    mha_kv_cache_destroy(r->cache);
    mha_kv_cache_destroy(r->paged);
    mha_layer_destroy(r->layer);
    free(r->wbuf);
    free(r->whalf);
    free(r->wq8);
    free(r->cold);
}

int cli_decode_bench_main(int argc, char **argv) {
    cli_args args;
    int rc = cli_parse(argc, argv, bench_flags, B_COUNT, &args);
    if (rc)
        return rc;
    if (args.given[B_HELP]) {
        bench_usage();
        return CLI_OK;
    }
    bench_opts b;
    if ((rc = parse_bench(&args, &b)))
        return rc;
    bench_run r;
    memset(&r, 0, sizeof r);
    r.rng = 0x9E3779B97F4A7C15ull;
    if (!(rc = bench_setup(&b, &r)) && !(rc = bench_prefill(&b, &r)) &&
        !(rc = bench_compact(&b, &r)) && !(rc = bench_attention(&b, &r))) {
        if (b.naive)
            r.naive_s = naive_step(r.cache, b.B, b.H, r.q, r.o, r.scores);
        if (!b.attn_only)
            rc = bench_layer(&b, &r);
        if (!rc && b.tree_t > 0)
            rc = bench_tree(&b, &r);
    }
    if (!rc) {
        double best[2] = {0.0, 0.0};
        if (b.stream_mb)
            rc = stream_gbs(b.stream_mb, b.threads, best);
        r.stream = best[0], r.stream_pf = best[1];
        if (!rc)
            bench_report(&b, &r);
    }
    bench_free(&r);
    free(b.lens);
    return rc;
}
