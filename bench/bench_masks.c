/* SPDX-License-Identifier: MIT */
/* bench_masks.c: `mha_bench_masks`, the attention core forward (mha_attention, impl AUTO) under
 * every form of the same mask, through the public API only: the C counterpart of the docs and
 * padding groups of bench/bench_masks.py (issue 29), without Python or torch in the process.
 * Float32 [B, h, n, d] tensors, h = 16, d = 64. Per case and thread count T (exec.n_threads), the
 * rows of its table run round-robin (every round runs each row once, so a busy neighbour slows
 * them alike), median / min / max of `--reps` (>= 5) timed rounds after one warm-up round. Every
 * row owns its outputs and a workspace (mha_attention_workspace_size), allocated once per table
 * and reused, so no timed call touches a fresh page.
 *
 * docs     B = 1, n = 2048, 8 packed documents (unequal lengths, bench_masks.py's, and 8 x 256),
 *          each non-causal and causal within documents:
 *            none         no mask: all n^2 pairs (the dense cost; another result, not checked)
 *            tensor       bool [n, n], nonzero = may attend: the reference of the checks
 *            fn           the same mask as an mha_mask_fn, visible() only
 *            fn_classify  the same with an exact classify()
 *            segids       q_segment_ids = kv_segment_ids = document index (+ causal)
 * padding  B = 8, lengths PAD_LENS padded to n = 2048:
 *            key_padding  mask.key_padding [B, m] (padded query rows attend: real outputs)
 *            both_mask    bool [B, 1, n, m] = valid_i & valid_j (padded query rows fully masked)
 *            both_segids  q ids 0 / -1 for padding, kv ids 0 / -2
 *            unpadded_sum the sum over b of the forward of sequence b alone (B = 1, n = m = L_b)
 *
 * FLOPs = 2 B h P (d_k + d_v), P = the visible (query, key) pairs per (batch row, head) counted
 * exactly from the mask, summed over batch rows. % of peak divides by the fp32 FMA peak of T
 * threads (bench/fma_peak.h), the best measured so far in this run, re-measured before each
 * table. Checks: every row's output against the reference row (docs: tensor; padding:
 * both_mask, on the valid query rows for key_padding and unpadded_sum), "bit-identical" or the
 * max abs difference; a fn / segids row beyond CHECK_TOL relative makes the exit status 1.
 *
 * Usage: mha_bench_masks [--threads 1,2] [--reps N] [--only docs,padding] [--summary]
 *   --summary: each row's tile classes and block-mask bytes (mha_attention_mask_summary). */
#define _POSIX_C_SOURCE 200809L
#include "fma_peak.h"
#include "mha.h"
#include "mha_experimental.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { HEADS = 16, DIM = 64, N = 2048, NDOCS = 8, PAD_B = 8, MAX_CALLS = 8, MAX_ROWS = 5 };
enum { MAX_THREADS = 16 };
#define CHECK_TOL 1e-6

static const int64_t DOC_LENS[NDOCS] = {123, 100, 714, 115, 128, 69, 477, 322};
static const int64_t PAD_LENS[PAD_B] = {1536, 1024, 256, 1792, 2048, 768, 1280, 512};

typedef struct opts {
    int threads[MAX_THREADS], n_threads, reps, docs, padding, summary;
} opts;

/* One row of a table: `calls` forward calls (unpadded_sum: one per sequence), each with its own
 * output (call[c].out) and workspace. */
typedef struct row {
    const char *name, *note;
    mha_attention_args call[MAX_CALLS];
    int calls;
    void *ws[MAX_CALLS];
    size_t ws_bytes[MAX_CALLS];
    double pairs;   /* P, summed over batch rows */
    int ref;        /* row its output is checked against, -1: none */
    int valid_only; /* compare only the query rows i < len[b] */
    int must_match; /* fn / segids: a difference beyond CHECK_TOL fails the run */
    double *times;  /* [reps] */
} row;

typedef struct table {
    row rows[MAX_ROWS];
    int n_rows;
    int64_t batch, len[PAD_B]; /* the valid query rows per batch row */
} table;

static int g_failed;
static double g_peak[MAX_THREADS + 1];
static char g_summary[8192];

static void *xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "mha_bench_masks: cannot allocate %zu bytes\n", bytes);
        exit(1);
    }
    return p;
}

static float *random_floats(int64_t count, unsigned seed) {
    float *p = xmalloc(sizeof(float) * (size_t)count);
    for (int64_t i = 0; i < count; i++) {
        seed = seed * 1664525u + 1013904223u;
        p[i] = (float)(seed >> 8) / 16777216.0f * 2.0f - 1.0f;
    }
    return p;
}

static void check_status(mha_status st, const mha_error *err, const char *what) {
    if (st != MHA_STATUS_OK) {
        fprintf(stderr, "mha_bench_masks: %s: %s\n", what, err->message);
        exit(1);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Host                                                                                       */
/* ------------------------------------------------------------------------------------------ */

/* The value of the first line of /proc/cpuinfo whose key is `key` (only blanks between it and
 * the colon, so "model" is not "model name"), or "?". */
static void cpuinfo_field(const char *key, char *buf, size_t n) {
    snprintf(buf, n, "?");
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    while (f && fgets(line, sizeof line, f)) {
        char *c = strchr(line, ':');
        if (!c || strncmp(line, key, strlen(key)) != 0 ||
            strspn(line + strlen(key), " \t") != (size_t)(c - line - strlen(key)))
            continue;
        c += 1 + strspn(c + 1, " \t");
        c[strcspn(c, "\n")] = 0;
        snprintf(buf, n, "%s", c);
        break;
    }
    if (f)
        fclose(f);
}

/* The best fp32 FMA peak of T threads measured so far in this run, after one more measurement
 * (a busy neighbour only ever lowers a measurement). */
static double peak_of(int T, const char **isa) {
    const double p = bench_peak_best_gflops(T, 20.0, 5, isa);
    if (p > g_peak[T])
        g_peak[T] = p;
    return g_peak[T];
}

static void print_header(const opts *o) {
    char model[256], family[64], mdl[64];
    cpuinfo_field("model name", model, sizeof model);
    cpuinfo_field("cpu family", family, sizeof family);
    cpuinfo_field("model", mdl, sizeof mdl);
    printf("# mha_bench_masks: mha %s, core forward (mha_attention, impl AUTO), float32, h=%d "
           "d=%d\n",
           mha_version(), HEADS, DIM);
    printf("# CPU: %s (cpu family %s, model %s); kernel ISAs (mha_experimental_cpu_isas(1)): %s\n",
           model, family, mdl, mha_experimental_cpu_isas(1));
    for (int t = 0; t < o->n_threads; t++) {
        const char *isa = "";
        const double p = peak_of(o->threads[t], &isa);
        printf("# fp32 FMA peak, %d thread(s): %.1f GFLOP/s (%s)\n", o->threads[t], p, isa);
    }
    printf("# median/min/max of %d round-robin runs after 1 warm-up; check: against the "
           "reference row (bit-identical, or max|diff| and that over max|ref|)\n",
           o->reps);
}

/* ------------------------------------------------------------------------------------------ */
/* Calls                                                                                      */
/* ------------------------------------------------------------------------------------------ */

/* A forward on contiguous [B, h, n, d] q, k, v (n = m) into a fresh output, no mask. */
static mha_attention_args
make_call(int64_t B, int64_t n, const float *q, const float *k, const float *v) {
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = B, a.num_heads = HEADS, a.q_len = n, a.kv_len = n, a.head_dim = DIM;
    const int64_t st[3] = {HEADS * n * DIM, n * DIM, DIM};
    a.q = q, a.k = k, a.v = v;
    a.out = xmalloc(sizeof(float) * (size_t)(B * HEADS * n * DIM));
    memset(a.out, 0, sizeof(float) * (size_t)(B * HEADS * n * DIM));
    memcpy(a.q_strides, st, sizeof st), memcpy(a.k_strides, st, sizeof st);
    memcpy(a.v_strides, st, sizeof st), memcpy(a.out_strides, st, sizeof st);
    return a;
}

static row *
add_row(table *t, const char *name, const char *note, mha_attention_args a, double pairs) {
    row *r = &t->rows[t->n_rows++];
    memset(r, 0, sizeof *r);
    r->name = name, r->note = note, r->call[0] = a, r->calls = 1, r->pairs = pairs, r->ref = -1;
    return r;
}

/* Each call's workspace for T threads, reallocated only when it grows; untouched until the
 * warm-up round. */
static void prepare_workspaces(table *t, const mha_exec *ex) {
    for (int i = 0; i < t->n_rows; i++)
        for (int c = 0; c < t->rows[i].calls; c++) {
            row *r = &t->rows[i];
            size_t bytes = 0;
            mha_error err;
            check_status(mha_attention_workspace_size(&r->call[c], ex, &bytes, &err), &err,
                         r->name);
            if (bytes > r->ws_bytes[c] || !r->ws[c]) {
                free(r->ws[c]);
                r->ws[c] = xmalloc(bytes);
                r->ws_bytes[c] = bytes;
            }
        }
}

static void run_row(row *r, mha_exec ex) {
    mha_error err;
    for (int c = 0; c < r->calls; c++) {
        ex.workspace = r->ws[c], ex.workspace_bytes = r->ws_bytes[c];
        check_status(mha_attention(&r->call[c], &ex, &err), &err, r->name);
    }
}

/* Round r = -1 is the warm-up; rounds 0 .. reps-1 are timed, every row once per round. */
static void time_round_robin(table *t, int T, int reps) {
    mha_exec ex = {MHA_IMPL_AUTO, T, NULL, 0, NULL, NULL};
    prepare_workspaces(t, &ex);
    for (int i = 0; i < t->n_rows; i++) {
        free(t->rows[i].times);
        t->rows[i].times = xmalloc(sizeof(double) * (size_t)reps);
    }
    for (int r = -1; r < reps; r++)
        for (int i = 0; i < t->n_rows; i++) {
            const double t0 = bench_now_s();
            run_row(&t->rows[i], ex);
            if (r >= 0)
                t->rows[i].times[r] = bench_now_s() - t0;
        }
    for (int i = 0; i < t->n_rows; i++)
        qsort(t->rows[i].times, (size_t)reps, sizeof(double), bench_cmp_double);
}

static double median_ms(const row *r, int reps) {
    return 1e3 * r->times[reps / 2];
}

/* ------------------------------------------------------------------------------------------ */
/* Checks                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* The output of batch row b of a row, and its strides {head, row}. */
static const float *out_of(const row *r, int64_t b, const int64_t **st) {
    if (r->calls > 1) {
        *st = r->call[b].out_strides + 1;
        return r->call[b].out;
    }
    *st = r->call[0].out_strides + 1;
    return (float *)r->call[0].out + b * r->call[0].out_strides[0];
}

/* Compares row x with its reference over every head, query row i < rows(b) and column:
 * returns 1 when bit-identical; *max_abs = max |x - ref|, *max_ref = max |ref|. */
static int compare_rows(const table *t, const row *x, double *max_abs, double *max_ref) {
    const row *ref = &t->rows[x->ref];
    int same = 1;
    *max_abs = 0, *max_ref = 0;
    for (int64_t b = 0; b < t->batch; b++) {
        const int64_t *sx, *sr;
        const float *px = out_of(x, b, &sx), *pr = out_of(ref, b, &sr);
        const int64_t rows = x->valid_only ? t->len[b] : ref->call[0].q_len;
        for (int64_t h = 0; h < HEADS; h++)
            for (int64_t i = 0; i < rows; i++) {
                const float *a = px + h * sx[0] + i * sx[1], *e = pr + h * sr[0] + i * sr[1];
                same &= memcmp(a, e, sizeof(float) * DIM) == 0;
                for (int c = 0; c < DIM; c++) {
                    *max_abs = fmax(*max_abs, fabs((double)a[c] - (double)e[c]));
                    *max_ref = fmax(*max_ref, fabs((double)e[c]));
                }
            }
    }
    return same;
}

/* The check column of row x; records a failure of a must_match row beyond CHECK_TOL. */
static void check_text(const table *t, const row *x, char *buf, size_t n) {
    if (x->ref < 0) {
        snprintf(buf, n, "-");
        return;
    }
    double max_abs, max_ref;
    if (compare_rows(t, x, &max_abs, &max_ref)) {
        snprintf(buf, n, "bit-identical");
        return;
    }
    const double rel = max_abs / (max_ref > 0 ? max_ref : 1e-30);
    const int bad = x->must_match && !(rel <= CHECK_TOL);
    g_failed |= bad;
    snprintf(buf, n, "max_abs %.1e rel %.1e%s", max_abs, rel, bad ? " FAIL" : "");
}

/* ------------------------------------------------------------------------------------------ */
/* Reporting                                                                                  */
/* ------------------------------------------------------------------------------------------ */

/* Tile classes and block-mask bytes of each row (summed over its calls), 1 thread. */
static void print_mask_summaries(const table *t) {
    const mha_exec ex = {MHA_IMPL_AUTO, 1, NULL, 0, NULL, NULL};
    for (int i = 0; i < t->n_rows; i++) {
        const row *r = &t->rows[i];
        mha_mask_summary s, sum = {0};
        for (int c = 0; c < r->calls; c++) {
            mha_error err;
            check_status(mha_attention_mask_summary(&r->call[c], &ex, &s, &err), &err, r->name);
            sum.tiles_hidden += s.tiles_hidden, sum.tiles_visible += s.tiles_visible;
            sum.tiles_mixed += s.tiles_mixed, sum.map_bytes += s.map_bytes;
        }
        printf("  summary %-12s tiles hidden %7lld visible %7lld mixed %7lld, map_bytes %lld",
               r->name, (long long)sum.tiles_hidden, (long long)sum.tiles_visible,
               (long long)sum.tiles_mixed, (long long)sum.map_bytes);
        if (r->calls > 1)
            printf(" (summed over its %d calls)\n", r->calls);
        else if (s.map_bytes)
            printf(" (planes %lld, rows %lld)\n", (long long)s.map_planes, (long long)s.map_rows);
        else
            printf(" (no block mask)\n");
    }
}

/* GFLOP of a row: 2 h P (d_k + d_v), P summed over batch rows. */
static double row_gflop(const row *r) {
    return 2.0 * HEADS * r->pairs * (2.0 * DIM) * 1e-9;
}

static void print_table(const table *t, int T, int reps, double peak) {
    printf("%-12s %3s %9s %9s %9s %8s %6s  %-30s %s\n", "row", "thr", "med_ms", "min_ms", "max_ms",
           "GFLOP/s", "%peak", "check", "what");
    for (int i = 0; i < t->n_rows; i++) {
        const row *r = &t->rows[i];
        const double med = r->times[reps / 2], gf = row_gflop(r) / med;
        char chk[96];
        check_text(t, r, chk, sizeof chk);
        printf("%-12s %3d %9.2f %9.2f %9.2f %8.1f %5.1f%%  %-30s %s\n", r->name, T, 1e3 * med,
               1e3 * r->times[0], 1e3 * r->times[reps - 1], gf, 100.0 * gf / peak, chk, r->note);
    }
}

static const row *find_row(const table *t, const char *name) {
    for (int i = 0; i < t->n_rows; i++)
        if (!strcmp(t->rows[i].name, name))
            return &t->rows[i];
    return NULL;
}

/* Prints "num/den" time ratios (pairs of row names) and appends the medians and the ratios to
 * the summary printed at the end. */
static void print_ratios(
    const table *t, const char *label, int T, int reps, const char *const *pairs, int n_pairs) {
    char line[1024];
    int at = snprintf(line, sizeof line, "%-26s T=%d:", label, T);
    for (int i = 0; i < t->n_rows && at < (int)sizeof line; i++)
        at += snprintf(line + at, sizeof line - (size_t)at, " %s %.1f", t->rows[i].name,
                       median_ms(&t->rows[i], reps));
    printf("   ratios:");
    for (int p = 0; p < n_pairs; p++) {
        const row *a = find_row(t, pairs[2 * p]), *b = find_row(t, pairs[2 * p + 1]);
        const double v = median_ms(a, reps) / median_ms(b, reps);
        printf("%s %s/%s %.2fx", p ? "," : "", a->name, b->name, v);
        if (at < (int)sizeof line)
            at += snprintf(line + at, sizeof line - (size_t)at, "%s %s/%s %.2fx", p ? "," : " |",
                           a->name, b->name, v);
    }
    printf("\n");
    const size_t used = strlen(g_summary);
    snprintf(g_summary + used, sizeof g_summary - used, "%s\n", line);
}

/* Times the table on every thread count, prints it and its ratios. */
static void run_table(table *t,
                      const opts *o,
                      const char *label,
                      const char *const *pairs,
                      int n_pairs,
                      const char *extra) {
    for (int k = 0; k < o->n_threads; k++) {
        const int T = o->threads[k];
        const char *isa = "";
        const double peak = peak_of(T, &isa);
        printf("\n### %s, threads=%d (peak %.1f GFLOP/s, %s)\n", label, T, peak, isa);
        time_round_robin(t, T, o->reps);
        print_table(t, T, o->reps, peak);
        print_ratios(t, label, T, o->reps, pairs, n_pairs);
        if (extra)
            printf("   %s\n", extra);
        fflush(stdout);
    }
}

static void free_table(table *t) {
    for (int i = 0; i < t->n_rows; i++) {
        for (int c = 0; c < t->rows[i].calls; c++)
            free(t->rows[i].call[c].out), free(t->rows[i].ws[c]);
        free(t->rows[i].times);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* docs: packed documents                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* Documents are contiguous and in order: doc[t] is token t's document. */
typedef struct docs_ctx {
    const int32_t *doc;
    int causal;
} docs_ctx;

/* Visible iff doc[i] == doc[j] (and j <= i when causal). */
static int32_t docs_visible(void *ctx, int64_t b, int64_t h, int64_t i, int64_t j) {
    const docs_ctx *c = ctx;
    (void)b, (void)h;
    return c->doc[i] == c->doc[j] && (!c->causal || j <= i);
}

/* Rows [i0, i1) span documents doc[i0] .. doc[i1 - 1], keys [j0, j1) doc[j0] .. doc[j1 - 1]:
 *   HIDDEN   the two ranges do not meet, or (causal) every key is after every row: j0 > i1 - 1
 *   VISIBLE  all four are one document and (causal) every key is at or before every row:
 *            j1 - 1 <= i0
 *   MIXED    otherwise. Exact for HIDDEN and VISIBLE. */
static mha_tile_class
docs_classify(void *ctx, int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    const docs_ctx *c = ctx;
    const int32_t ra = c->doc[i0], rb = c->doc[i1 - 1], ka = c->doc[j0], kb = c->doc[j1 - 1];
    (void)b, (void)h;
    if (rb < ka || kb < ra || (c->causal && j0 > i1 - 1))
        return MHA_TILE_HIDDEN;
    if (ra == rb && ka == kb && ra == ka && (!c->causal || j1 - 1 <= i0))
        return MHA_TILE_VISIBLE;
    return MHA_TILE_MIXED;
}

/* doc[t] for the lengths; attend[i n + j] = doc[i] == doc[j] (&& j <= i); returns P. */
static double docs_masks(const int64_t *lens, int causal, int32_t *doc, uint8_t *attend) {
    for (int64_t d = 0, t = 0; d < NDOCS; d++)
        for (int64_t e = 0; e < lens[d]; e++)
            doc[t++] = (int32_t)d;
    double pairs = 0;
    for (int64_t i = 0; i < N; i++)
        for (int64_t j = 0; j < N; j++) {
            attend[i * N + j] = doc[i] == doc[j] && (!causal || j <= i);
            pairs += attend[i * N + j];
        }
    return pairs;
}

static void docs_rows(table *t,
                      const float *const qkv[3],
                      const uint8_t *attend,
                      const int32_t *doc,
                      docs_ctx *ctx,
                      int causal,
                      double pairs) {
    const float *q = qkv[0], *k = qkv[1], *v = qkv[2];
    memset(t, 0, sizeof *t);
    t->batch = 1, t->len[0] = N;
    add_row(t, "none", "no mask: all n^2 pairs (another result)", make_call(1, N, q, k, v),
            (double)N * N);
    mha_attention_args a = make_call(1, N, q, k, v);
    a.mask.bool_mask = (mha_mask_tensor){attend, MHA_DTYPE_BOOL, 2, {N, N}};
    add_row(t, "tensor", "bool [n, n], nonzero = attend", a, pairs);
    a = make_call(1, N, q, k, v);
    a.mask.mask_fn = (mha_mask_fn){docs_visible, NULL, ctx, 0, 0};
    add_row(t, "fn", "mha_mask_fn visible()", a, pairs);
    a = make_call(1, N, q, k, v);
    a.mask.mask_fn = (mha_mask_fn){docs_visible, docs_classify, ctx, 0, 0};
    add_row(t, "fn_classify", "mha_mask_fn visible() + classify()", a, pairs);
    a = make_call(1, N, q, k, v);
    a.mask.q_segment_ids = a.mask.kv_segment_ids = doc;
    a.mask.causal = causal;
    add_row(t, "segids", causal ? "segment ids + causal" : "segment ids", a, pairs);
    t->rows[0].ref = 1; /* another result: its difference is shown, never a failure */
    for (int i = 2; i < t->n_rows; i++)
        t->rows[i].ref = 1, t->rows[i].must_match = 1;
}

static void bench_docs(const opts *o) {
    static const char *const pairs[] = {"none",   "tensor",      "tensor", "fn",
                                        "tensor", "fn_classify", "tensor", "segids"};
    const int64_t count = HEADS * N * DIM;
    const float *const qkv[3] = {random_floats(count, 1), random_floats(count, 2),
                                 random_floats(count, 3)};
    int32_t *doc = xmalloc(sizeof(int32_t) * N);
    uint8_t *attend = xmalloc((size_t)N * N);
    int64_t equal[NDOCS];
    for (int d = 0; d < NDOCS; d++)
        equal[d] = N / NDOCS;
    for (int eq = 0; eq < 2; eq++)
        for (int causal = 0; causal < 2; causal++) {
            const int64_t *lens = eq ? equal : DOC_LENS;
            const double pairs_ = docs_masks(lens, causal, doc, attend);
            docs_ctx ctx = {doc, causal};
            table t;
            docs_rows(&t, qkv, attend, doc, &ctx, causal, pairs_);
            char label[64];
            snprintf(label, sizeof label, "docs %s%s", eq ? "8x256" : "unequal",
                     causal ? " causal" : "");
            printf("\n## %s: B=1 n=%d h=%d d=%d, lengths", label, N, HEADS, DIM);
            for (int d = 0; d < NDOCS; d++)
                printf("%s%lld", d ? "," : " ", (long long)lens[d]);
            printf(" | P = %.0f visible pairs (%.1f%% of n^2), GFLOP %.3f (no mask %.3f)\n", pairs_,
                   100.0 * pairs_ / N / N, row_gflop(&t.rows[1]), row_gflop(&t.rows[0]));
            if (o->summary)
                print_mask_summaries(&t);
            run_table(&t, o, label, pairs, 4, NULL);
            free_table(&t);
        }
    free(doc), free(attend);
    for (int i = 0; i < 3; i++)
        free((void *)qkv[i]);
}

/* ------------------------------------------------------------------------------------------ */
/* padding: a key-padding batch                                                               */
/* ------------------------------------------------------------------------------------------ */

typedef struct pad_data {
    const float *qkv[3];  /* [B, h, n, d] */
    float *seq[PAD_B][3]; /* sequence b alone: [1, h, L_b, d] */
    uint8_t *valid;       /* [B, n] */
    uint8_t *both;        /* [B, 1, n, m] */
    int32_t *qseg, *kseg; /* [B, n] */
    double sum_l, sum_l2; /* sum L_b, sum L_b^2 */
} pad_data;

static void pad_data_make(pad_data *p) {
    const int64_t count = PAD_B * HEADS * N * DIM;
    for (int x = 0; x < 3; x++)
        p->qkv[x] = random_floats(count, 11 + (unsigned)x);
    p->valid = xmalloc(PAD_B * N), p->both = xmalloc((size_t)PAD_B * N * N);
    p->qseg = xmalloc(sizeof(int32_t) * PAD_B * N), p->kseg = xmalloc(sizeof(int32_t) * PAD_B * N);
    p->sum_l = p->sum_l2 = 0;
    for (int64_t b = 0; b < PAD_B; b++) {
        const int64_t L = PAD_LENS[b];
        p->sum_l += (double)L, p->sum_l2 += (double)L * (double)L;
        for (int64_t i = 0; i < N; i++) {
            p->valid[b * N + i] = i < L;
            p->qseg[b * N + i] = i < L ? 0 : -1, p->kseg[b * N + i] = i < L ? 0 : -2;
            for (int64_t j = 0; j < N; j++)
                p->both[(b * N + i) * N + j] = i < L && j < L;
        }
        for (int x = 0; x < 3; x++) { /* rows [0, L) of every head, contiguous */
            p->seq[b][x] = xmalloc(sizeof(float) * (size_t)(HEADS * L * DIM));
            for (int64_t h = 0; h < HEADS; h++)
                memcpy(p->seq[b][x] + h * L * DIM, p->qkv[x] + (b * HEADS + h) * N * DIM,
                       sizeof(float) * (size_t)(L * DIM));
        }
    }
}

static void pad_data_free(pad_data *p) {
    for (int x = 0; x < 3; x++) {
        free((void *)p->qkv[x]);
        for (int b = 0; b < PAD_B; b++)
            free(p->seq[b][x]);
    }
    free(p->valid), free(p->both), free(p->qseg), free(p->kseg);
}

/* Counts P exactly from the [B, n, m] bool (both sides) and the [B, m] key padding. */
static void pad_pairs(const pad_data *p, double *both, double *keypad) {
    *both = 0, *keypad = 0;
    for (int64_t e = 0; e < (int64_t)PAD_B * N * N; e++)
        *both += p->both[e];
    for (int64_t e = 0; e < (int64_t)PAD_B * N; e++)
        *keypad += (double)N * p->valid[e]; /* every query row sees the valid keys */
}

static void padding_rows(table *t, const pad_data *p) {
    const float *q = p->qkv[0], *k = p->qkv[1], *v = p->qkv[2];
    double both, keypad;
    pad_pairs(p, &both, &keypad);
    memset(t, 0, sizeof *t);
    t->batch = PAD_B;
    memcpy(t->len, PAD_LENS, sizeof PAD_LENS);
    mha_attention_args a = make_call(PAD_B, N, q, k, v);
    a.mask.key_padding = (mha_mask_tensor){p->valid, MHA_DTYPE_BOOL, 2, {PAD_B, N}};
    row *r = add_row(t, "key_padding", "key_padding [B, m] (padded query rows attend)", a, keypad);
    r->ref = 1, r->valid_only = 1;
    a = make_call(PAD_B, N, q, k, v);
    a.mask.bool_mask = (mha_mask_tensor){p->both, MHA_DTYPE_BOOL, 4, {PAD_B, 1, N, N}};
    add_row(t, "both_mask", "bool [B, 1, n, m] = valid_i & valid_j", a, both);
    a = make_call(PAD_B, N, q, k, v);
    a.mask.q_segment_ids = p->qseg, a.mask.kv_segment_ids = p->kseg;
    r = add_row(t, "both_segids", "segment ids: q 0 / -1, kv 0 / -2", a, both);
    r->ref = 1, r->must_match = 1;
    r = add_row(t, "unpadded_sum", "sum over b of B=1, n=m=L_b",
                make_call(1, PAD_LENS[0], p->seq[0][0], p->seq[0][1], p->seq[0][2]), p->sum_l2);
    for (int b = 1; b < PAD_B; b++)
        r->call[r->calls++] = make_call(1, PAD_LENS[b], p->seq[b][0], p->seq[b][1], p->seq[b][2]);
    r->ref = 1, r->valid_only = 1;
}

static void bench_padding(const opts *o) {
    static const char *const pairs[] = {"key_padding",  "unpadded_sum", "both_mask",
                                        "unpadded_sum", "both_segids",  "unpadded_sum"};
    pad_data p;
    pad_data_make(&p);
    table t;
    padding_rows(&t, &p);
    printf("\n## padding: B=%d h=%d d=%d, lengths", PAD_B, HEADS, DIM);
    for (int b = 0; b < PAD_B; b++)
        printf("%s%lld", b ? "," : " ", (long long)PAD_LENS[b]);
    printf(" padded to n=%d | GFLOP: key padding %.2f, both sides = unpadded sum %.2f, dense "
           "%.2f\n",
           N, row_gflop(&t.rows[0]), row_gflop(&t.rows[1]),
           2.0 * HEADS * PAD_B * (double)N * N * 2 * DIM * 1e-9);
    printf("   checks: against both_mask (key_padding and unpadded_sum on the valid query rows "
           "only)\n");
    if (o->summary)
        print_mask_summaries(&t);
    /* Key padding: n sum(L) pairs against the unpadded sum(L^2) at equal speed per pair. */
    char extra[128];
    snprintf(extra, sizeof extra, "ideal key_padding/unpadded_sum = n sum(L) / sum(L^2) = %.2fx",
             (double)N * p.sum_l / p.sum_l2);
    run_table(&t, o, "padding", pairs, 3, extra);
    free_table(&t);
    pad_data_free(&p);
}

/* ------------------------------------------------------------------------------------------ */
/* Main                                                                                       */
/* ------------------------------------------------------------------------------------------ */

static int usage(void) {
    fprintf(stderr, "usage: mha_bench_masks [--threads 1,2] [--reps N (>= 5)] "
                    "[--only docs,padding] [--summary]\n");
    return 2;
}

/* A comma-separated list of thread counts; 0 on a bad one. */
static int parse_threads(const char *s, opts *o) {
    o->n_threads = 0;
    for (char *end; *s && o->n_threads < MAX_THREADS; s = *end ? end + 1 : end) {
        const long v = strtol(s, &end, 10);
        if (end == s || v < 1 || v > MAX_THREADS || (*end && *end != ','))
            return 0;
        o->threads[o->n_threads++] = (int)v;
    }
    return o->n_threads > 0;
}

/* A comma-separated list of groups (docs, padding); 0 on an unknown one. */
static int parse_only(const char *s, opts *o) {
    o->docs = o->padding = 0;
    while (*s) {
        const size_t len = strcspn(s, ",");
        if (len == 4 && !strncmp(s, "docs", 4))
            o->docs = 1;
        else if (len == 7 && !strncmp(s, "padding", 7))
            o->padding = 1;
        else
            return 0;
        s += len + (s[len] == ',');
    }
    return o->docs || o->padding;
}

static int parse_args(int argc, char **argv, opts *o) {
    memset(o, 0, sizeof *o);
    o->threads[0] = 1, o->threads[1] = 2, o->n_threads = 2, o->reps = 7;
    o->docs = o->padding = 1;
    for (int i = 1; i < argc; i++) {
        const char *val = i + 1 < argc ? argv[i + 1] : "";
        int ok = 1;
        if (!strcmp(argv[i], "--summary")) {
            o->summary = 1;
            continue;
        }
        if (!strcmp(argv[i], "--threads"))
            ok = parse_threads(val, o);
        else if (!strcmp(argv[i], "--reps"))
            o->reps = atoi(val);
        else if (!strcmp(argv[i], "--only"))
            ok = parse_only(val, o);
        else
            ok = 0;
        if (!ok)
            return 0;
        i++;
    }
    return o->reps >= 5 && o->reps <= 1000;
}

int main(int argc, char **argv) {
    opts o;
    if (!parse_args(argc, argv, &o))
        return usage();
    print_header(&o);
    if (o.docs)
        bench_docs(&o);
    if (o.padding)
        bench_padding(&o);
    printf("\n## summary: medians (ms) and ratios\n%s", g_summary);
    if (g_failed)
        printf("# FAILED: a mask-function / segment-id row differs from its reference beyond "
               "%g relative\n",
               CHECK_TOL);
    else
        printf("# every mask-function / segment-id row matches its reference (within %g)\n",
               CHECK_TOL);
    return g_failed ? 1 : 0;
}
