/* SPDX-License-Identifier: MIT */
/* peer_ggml_gemv.c: the four projections of one decode step at batch 1 (issue 32 §4, "weights as
 * llama.cpp users have them"), mha against ggml in one process, on the same weights.
 *
 * Shape (`mha decode-bench`'s default layer): q_dim 4096, h 32, g 8, d 128, so
 *   W_q [4096, 4096], W_k [1024, 4096], W_v [1024, 4096], W_o [4096, 4096]: 41.9 M weights,
 * one token: y_q = W_q x, y_k = W_k x, y_v = W_v x, y_o = W_o a (x, a: [4096] float32).
 *
 *   mha   mha_layer_project(Q, K, V on x, O on a) with rows = 1: the few-rows dot path the
 *         layer's decode step runs (the weights widened in registers, float32 activations and
 *         sums), on a layer made with MHA_WEIGHTS_COPY (its own storage, as the loaders make).
 *   ggml  one graph of the four ggml_mul_mat(W, x), as llama.cpp's graph projects at batch 1.
 *         ggml first converts x to its vec_dot_type: for Q8_0 / Q4_0 weights x is quantised to
 *         Q8_0 (integer dot products, VNNI where the CPU has it), for BF16 / F16 weights x is
 *         rounded to that type; that rounding is in ggml's err column.
 *
 * The same weights: float32 draws (scaled 1/sqrt(q_dim)) rounded by ggml to bf16 / f16, or
 * quantised once by mha_q8_0_quantize / mha_q4_0_quantize, whose blocks are ggml's Q8_0 / Q4_0
 * blocks byte for byte (docs/SEMANTICS.md "q8_0 weights", "q4_0 weights"); both libraries get
 * these bytes. err = max |y - ref| / max |ref| over the four outputs, ref the float64 products
 * over the weights' exact values (widened / dequantised). GB/s = weight bytes / median time; the
 * read bandwidth (bench/peer_util.h) is measured in the same run, before and after the rows.
 * Timed round-robin, the order rotating each repetition, a pause before each call.
 *
 * Built only when CMake is given -DMHA_GGML_DIR (bench/CMakeLists.txt), like peer_ggml_decode.c;
 * docs/INFERENCE.md "Peer: ggml, projections".
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, nanosleep */
#define _DEFAULT_SOURCE         /* madvise */

#include "mha.h"

#include "peer_util.h"

#include <ggml-cpu.h>
#include <ggml.h>

#include <math.h>

enum { W_F32, W_F16, W_BF16, W_Q8_0, W_Q4_0, W_COUNT };
static const char *const wnames[W_COUNT] = {"f32", "f16", "bf16", "q8_0", "q4_0"};
static const mha_dtype wmha[W_COUNT] = {MHA_DTYPE_F32, MHA_DTYPE_F16, MHA_DTYPE_BF16,
                                        MHA_DTYPE_Q8_0, MHA_DTYPE_Q4_0};
static const enum ggml_type wggml[W_COUNT] = {GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16,
                                              GGML_TYPE_Q8_0, GGML_TYPE_Q4_0};

/* The four matrices: rows (outputs) and where each starts among the nw weights. */
typedef struct shape {
    int64_t q, h, g, d;
    int64_t rows[4], first[4], nw, ny;
} shape;

static shape make_shape(int64_t q, int64_t h, int64_t g, int64_t d) {
    shape s = {q, h, g, d, {h * d, g * d, g * d, q}, {0}, 0, 0};
    for (int m = 0; m < 4; m++) {
        s.first[m] = s.nw;
        s.nw += s.rows[m] * q; /* W_o: [q, h d], h d = q here (checked in main) */
        s.ny += s.rows[m];
    }
    return s;
}

/* One weight dtype: the bytes both libraries get, their exact values, the float64 outputs. */
typedef struct wcase {
    int w;
    size_t bytes;       /* of all four matrices */
    unsigned char *buf; /* ggml's copy (mha copies into its layer) */
    double *ref;        /* [ny]: y_q, y_k, y_v, y_o */
    mha_layer *layer;
    struct ggml_context *ctx_w, *ctx; /* the weight tensors (no data of their own); the rest */
    struct ggml_tensor *out[4];
    struct ggml_cgraph *graph;
    float *y[2]; /* [ny]: ggml's, mha's */
} wcase;

/* Bytes of n weights of kind w (n a multiple of 32 for the block types). */
static size_t wbytes(int w, int64_t n) {
    return w == W_Q8_0   ? (size_t)(n / 32) * 34
           : w == W_Q4_0 ? (size_t)(n / 32) * 18
           : w == W_F32  ? sizeof(float) * (size_t)n
                         : 2 * (size_t)n;
}

/* The stored bytes of the float32 draws wf in kind w, and their exact values back in wv. */
static int encode(int w, const float *wf, int64_t n, unsigned char *dst, float *wv) {
    mha_error err;
    switch (w) {
    case W_F32:
        memcpy(dst, wf, sizeof(float) * (size_t)n);
        memcpy(wv, wf, sizeof(float) * (size_t)n);
        return 0;
    case W_F16:
        ggml_fp32_to_fp16_row(wf, (ggml_fp16_t *)dst, n);
        ggml_fp16_to_fp32_row((const ggml_fp16_t *)dst, wv, n);
        return 0;
    case W_BF16:
        ggml_fp32_to_bf16_row(wf, (ggml_bf16_t *)dst, n);
        ggml_bf16_to_fp32_row((const ggml_bf16_t *)dst, wv, n);
        return 0;
    default: {
        const int q4 = w == W_Q4_0;
        if ((q4 ? mha_q4_0_quantize : mha_q8_0_quantize)(wf, n, dst, &err) != MHA_STATUS_OK ||
            (q4 ? mha_q4_0_dequantize : mha_q8_0_dequantize)(dst, n, wv, &err) != MHA_STATUS_OK) {
            fprintf(stderr, "peer_ggml_gemv: %s\n", err.message);
            return 1;
        }
        return 0;
    }
    }
}

/* y = W v in float64 for the four matrices (v = x for Q, K, V; a for O). */
static void
reference(const shape *s, const float *wv, const float *x, const float *a, double *ref) {
    int64_t at = 0;
    for (int m = 0; m < 4; m++) {
        const float *in = m == 3 ? a : x;
        for (int64_t r = 0; r < s->rows[m]; r++) {
            const float *row = wv + s->first[m] + r * s->q;
            double acc = 0.0;
            for (int64_t k = 0; k < s->q; k++)
                acc += (double)row[k] * (double)in[k];
            ref[at++] = acc;
        }
    }
}

static int make_layer(const shape *s, wcase *c) {
    mha_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.q_dim = s->q, cfg.num_heads = s->h, cfg.num_kv_heads = s->g, cfg.head_dim = s->d;
    cfg.weight_dtype = wmha[c->w];
    mha_weights wt;
    memset(&wt, 0, sizeof wt);
    const void **ptr[4] = {&wt.w_q, &wt.w_k, &wt.w_v, &wt.w_o};
    for (int m = 0; m < 4; m++)
        *ptr[m] = c->buf + wbytes(c->w, s->first[m]);
    mha_error err;
    if (mha_layer_create(&cfg, &wt, MHA_WEIGHTS_COPY, NULL, &c->layer, &err) != MHA_STATUS_OK) {
        fprintf(stderr, "mha_layer_create: %s\n", err.message);
        return 1;
    }
    return 0;
}

/* ggml's weight tensors over c->buf, x and a, and the graph of the four products. */
static int build_ggml(const shape *s, wcase *c, const float *x, const float *a) {
    struct ggml_init_params pw = {ggml_tensor_overhead() * 4, NULL, true};
    struct ggml_init_params p = {ggml_tensor_overhead() * 16 + ggml_graph_overhead() +
                                     sizeof(float) * (size_t)(2 * s->q + s->ny) + 4096,
                                 NULL, false};
    c->ctx_w = ggml_init(pw);
    c->ctx = ggml_init(p);
    if (!c->ctx_w || !c->ctx)
        return 1;
    struct ggml_tensor *in[2] = {ggml_new_tensor_1d(c->ctx, GGML_TYPE_F32, s->q),
                                 ggml_new_tensor_1d(c->ctx, GGML_TYPE_F32, s->q)};
    memcpy(in[0]->data, x, sizeof(float) * (size_t)s->q);
    memcpy(in[1]->data, a, sizeof(float) * (size_t)s->q);
    c->graph = ggml_new_graph(c->ctx);
    for (int m = 0; m < 4; m++) {
        /* a weight tensor without data of its own: it points into c->buf */
        struct ggml_tensor *w = ggml_new_tensor_2d(c->ctx_w, wggml[c->w], s->q, s->rows[m]);
        w->data = c->buf + wbytes(c->w, s->first[m]);
        c->out[m] = ggml_mul_mat(c->ctx, w, in[m == 3]);
        ggml_build_forward_expand(c->graph, c->out[m]);
    }
    return 0;
}

/* Draws the case's weights (the same float32 draws for every dtype), encodes them, computes the
 * reference and makes both libraries' objects. */
static int
create_case(const shape *s, int w, const float *wf, const float *x, const float *a, wcase *c) {
    memset(c, 0, sizeof *c);
    c->w = w;
    c->bytes = wbytes(w, s->nw);
    c->buf = xalloc(c->bytes);
    c->ref = xalloc(sizeof(double) * (size_t)s->ny);
    c->y[0] = xalloc(sizeof(float) * (size_t)s->ny);
    c->y[1] = xalloc(sizeof(float) * (size_t)s->ny);
    float *wv = xalloc(sizeof(float) * (size_t)s->nw);
    const int bad = encode(w, wf, s->nw, c->buf, wv);
    if (!bad)
        reference(s, wv, x, a, c->ref);
    free(wv);
    return bad || make_layer(s, c) || build_ggml(s, c, x, a);
}

static void destroy_case(wcase *c) {
    mha_layer_destroy(c->layer);
    if (c->ctx)
        ggml_free(c->ctx);
    if (c->ctx_w)
        ggml_free(c->ctx_w);
    free(c->buf);
    free(c->ref);
    free(c->y[0]);
    free(c->y[1]);
}

/* Per thread count: both libraries' persistent pools, ggml's plan and work buffer. */
typedef struct runner {
    int threads;
    mha_threadpool *mha_pool;
    struct ggml_threadpool *ggml_pool;
    struct ggml_cplan plan;
    void *work;
} runner;

static void plan_ggml(runner *r, wcase *c) {
    r->plan = ggml_graph_plan(c->graph, r->threads, r->ggml_pool);
    free(r->work);
    r->work = xalloc(r->plan.work_size + 64);
    r->plan.work_data = r->work;
}

/* One call: ggml's graph (lib 0) or mha's four projections (lib 1); its wall time in seconds,
 * negative on failure. */
static double
run_lib(runner *r, const shape *s, wcase *c, int lib, const float *x, const float *a) {
    double t0, t1;
    if (lib == 0) {
        t0 = now_s();
        const enum ggml_status st = ggml_graph_compute(c->graph, &r->plan);
        t1 = now_s();
        if (st != GGML_STATUS_SUCCESS)
            return -1.0;
        for (int64_t m = 0, at = 0; m < 4; at += s->rows[m], m++)
            memcpy(c->y[0] + at, c->out[m]->data, sizeof(float) * (size_t)s->rows[m]);
        return t1 - t0;
    }
    mha_exec ex;
    memset(&ex, 0, sizeof ex);
    ex.n_threads = r->threads, ex.pool = r->mha_pool;
    mha_error err;
    mha_status st = MHA_STATUS_OK;
    t0 = now_s();
    for (int64_t m = 0, at = 0; m < 4 && !st; at += s->rows[m], m++)
        st = mha_layer_project(c->layer, (mha_projection)m, 1, m == 3 ? a : x, c->y[1] + at, &ex,
                               &err);
    t1 = now_s();
    if (st != MHA_STATUS_OK) {
        fprintf(stderr, "mha_layer_project: %s\n", err.message);
        return -1.0;
    }
    return t1 - t0;
}

static void usage(void) {
    printf("Usage: mha_peer_ggml_gemv [options]\n"
           "The four projections of a decode step at batch 1 (q, k, v, o of one token): ggml's\n"
           "mul_mat graph and mha_layer_project on the same weights, round-robin.\n"
           "  --q-dim Q         model width = heads x head-dim (default 4096)\n"
           "  --heads H         query heads (default 32)\n"
           "  --kv-heads G      kv heads (default 8)\n"
           "  --dtypes T,...    f32, f16, bf16, q8_0, q4_0 (default bf16,q8_0,q4_0)\n"
           "  --threads T,...   thread counts (default 1,2)\n"
           "  --reps N          timed calls of each library per row (default 15, at most %d)\n"
           "  --stream MB       read-bandwidth buffer, 0 = skip (default 1024)\n"
           "  --pause MS        sleep before each timed call (default 5)\n",
           MAX_REPS);
}

/* --dtypes: a comma list of wnames; the count, 0 on a bad list. */
static int parse_dtypes(const char *v, int *out) {
    char buf[64];
    snprintf(buf, sizeof buf, "%s", v);
    int n = 0;
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        int w = 0;
        while (w < W_COUNT && strcmp(tok, wnames[w]))
            w++;
        if (w == W_COUNT || n == MAX_LIST) {
            fprintf(stderr,
                    "peer_ggml_gemv: dtype '%s' is not f32, f16, bf16, q8_0 or q4_0 (or "
                    "too many)\n",
                    tok);
            return 0;
        }
        out[n++] = w;
    }
    return n;
}

/* One markdown row per thread count of case c. */
static int time_case(const shape *s,
                     wcase *c,
                     runner *run,
                     int n_thr,
                     const stats *bw,
                     int64_t reps,
                     int64_t pause,
                     const float *x,
                     const float *a) {
    for (int t = 0; t < n_thr; t++) {
        runner *r = &run[t];
        plan_ggml(r, c);
        double times[2][MAX_REPS];
        for (int lib = 0; lib < 2; lib++) /* warm-up: page faults, first touch */
            if (run_lib(r, s, c, lib, x, a) < 0.0)
                return 1;
        for (int rep = 0; rep < reps; rep++)
            for (int k = 0; k < 2; k++) {
                const int lib = (rep + k) % 2; /* rotate who goes first */
                pause_ms((int)pause);
                if ((times[lib][rep] = run_lib(r, s, c, lib, x, a)) < 0.0)
                    return 1;
            }
        const stats g = summarize(times[0], (int)reps), m = summarize(times[1], (int)reps);
        const double gbs = (double)c->bytes / m.med * 1e-9;
        printf("| %s | %d | %.1f | %.3f [%.3f, %.3f] | %.3f [%.3f, %.3f] | %.1f | ", wnames[c->w],
               r->threads, (double)c->bytes * 1e-6, g.med * 1e3, g.min * 1e3, g.max * 1e3,
               m.med * 1e3, m.min * 1e3, m.max * 1e3, gbs);
        if (bw[t].med > 0.0)
            printf("%.0f | ", 100.0 * gbs / bw[t].med);
        else
            printf("- | ");
        printf("%.1f | %.2f | %.1e | %.1e |\n", (double)c->bytes / g.med * 1e-9, g.med / m.med,
               rel_err(c->y[0], c->ref, s->ny), rel_err(c->y[1], c->ref, s->ny));
        fflush(stdout);
    }
    return 0;
}

int main(int argc, char **argv) {
    int64_t q = 4096, h = 32, g = 8, reps = 15, stream_mb = 1024, pause = 5;
    int64_t threads[MAX_LIST] = {1, 2};
    int n_thr = 2, n_dt = 3, dts[MAX_LIST] = {W_BF16, W_Q8_0, W_Q4_0};
    for (int i = 1; i < argc; i += 2) { /* --option value pairs */
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int64_t *scalar = !strcmp(o, "--q-dim")      ? &q
                          : !strcmp(o, "--heads")    ? &h
                          : !strcmp(o, "--kv-heads") ? &g
                          : !strcmp(o, "--reps")     ? &reps
                          : !strcmp(o, "--stream")   ? &stream_mb
                          : !strcmp(o, "--pause")    ? &pause
                                                     : NULL;
        if (!strcmp(o, "--help")) {
            usage();
            return 0;
        } else if (!v) {
            fprintf(stderr, "peer_ggml_gemv: bad or incomplete option '%s' (--help)\n", o);
            return 2;
        } else if (scalar) {
            *scalar = strtoll(v, NULL, 10);
        } else if (!strcmp(o, "--threads")) {
            n_thr = parse_list(v, threads);
        } else if (!strcmp(o, "--dtypes")) {
            n_dt = parse_dtypes(v, dts);
        } else {
            fprintf(stderr, "peer_ggml_gemv: unknown option '%s' (--help)\n", o);
            return 2;
        }
    }
    if (q < 32 || q % 32 || h < 1 || q % h || (q / h) % 2 || g < 1 || h % g || reps < 1 ||
        reps > MAX_REPS || !n_thr || !n_dt || stream_mb < 0 || pause < 0) {
        fprintf(stderr, "peer_ggml_gemv: bad arguments (q-dim a multiple of 32 and of heads; "
                        "--help)\n");
        return 2;
    }
    for (int t = 0; t < n_thr; t++)
        if (threads[t] > MAX_THREADS) {
            fprintf(stderr, "peer_ggml_gemv: at most %d threads\n", MAX_THREADS);
            return 2;
        }
    const shape s = make_shape(q, h, g, q / h);
    ggml_cpu_init();
    printf("# projections of one decode step: q_dim=%lld h=%lld g=%lld d=%lld, %lld weights; mha "
           "%d.%d.%d; ggml %s (commit %s, AVX2 %d AVX512 %d AVX512_VNNI %d AVX512_BF16 %d); "
           "%lld reps\n",
           (long long)q, (long long)h, (long long)g, (long long)(q / h), (long long)s.nw,
           MHA_VERSION_MAJOR, MHA_VERSION_MINOR, MHA_VERSION_PATCH, ggml_version(), ggml_commit(),
           ggml_cpu_has_avx2(), ggml_cpu_has_avx512(), ggml_cpu_has_avx512_vnni(),
           ggml_cpu_has_avx512_bf16(), (long long)reps);
    stats bw[MAX_LIST];
    for (int t = 0; t < n_thr; t++) {
        bw[t] = stream_mb ? stream_gbs(stream_mb, (int)threads[t], 7) : (stats){0, 0, 0};
        printf("# read bandwidth, %lld MB buffer, %lld thread(s): median %.1f GB/s [%.1f, %.1f]\n",
               (long long)stream_mb, (long long)threads[t], bw[t].med, bw[t].min, bw[t].max);
    }
    runner run[MAX_LIST];
    memset(run, 0, sizeof run);
    for (int t = 0; t < n_thr; t++) {
        run[t].threads = (int)threads[t];
        struct ggml_threadpool_params tp = ggml_threadpool_params_default((int)threads[t]);
        run[t].ggml_pool = ggml_threadpool_new(&tp);
        if (!run[t].ggml_pool || mha_threadpool_create((int32_t)threads[t], NULL, &run[t].mha_pool,
                                                       NULL) != MHA_STATUS_OK) {
            fprintf(stderr, "peer_ggml_gemv: cannot create the thread pools\n");
            return 1;
        }
    }
    float *wf = xalloc(sizeof(float) * (size_t)s.nw);
    float *x = xalloc(sizeof(float) * (size_t)q), *a = xalloc(sizeof(float) * (size_t)q);
    rng_state = 0x9E3779B97F4A7C15ull;
    const float ws = 1.0f / sqrtf((float)q);
    for (int64_t i = 0; i < s.nw; i++)
        wf[i] = rnd() * ws;
    for (int64_t i = 0; i < q; i++)
        x[i] = rnd(), a[i] = rnd();
    printf("\n| weights | thr | MB | ggml ms | mha ms | mha GB/s | %%bw | ggml GB/s | x ggml | "
           "err ggml | err mha |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    int rc = 0;
    for (int i = 0; i < n_dt && !rc; i++) {
        wcase c;
        rc = create_case(&s, dts[i], wf, x, a, &c) ||
             time_case(&s, &c, run, n_thr, bw, reps, pause, x, a);
        if (rc)
            fprintf(stderr, "peer_ggml_gemv: the %s case failed\n", wnames[dts[i]]);
        destroy_case(&c);
    }
    for (int t = 0; t < n_thr && stream_mb && !rc; t++) {
        const stats b = stream_gbs(stream_mb, (int)threads[t], 7);
        printf("# read bandwidth after the rows, %lld thread(s): median %.1f GB/s [%.1f, %.1f]\n",
               (long long)threads[t], b.med, b.min, b.max);
    }
    printf("# columns: ms = median [min, max] of the timed calls (mha: its four "
           "mha_layer_project calls; ggml: one graph of four mul_mat); GB/s = weight bytes / "
           "median; %%bw = mha GB/s / read bandwidth (start); x ggml = ggml median / mha median; "
           "err = max |y - ref| / max |ref| (float64 over the weights' exact values)\n");
    for (int t = 0; t < n_thr; t++) {
        mha_threadpool_destroy(run[t].mha_pool);
        ggml_threadpool_free(run[t].ggml_pool);
        free(run[t].work);
    }
    free(wf);
    free(x);
    free(a);
    return rc;
}
