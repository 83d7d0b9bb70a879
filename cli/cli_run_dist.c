/* SPDX-License-Identifier: MIT */
/* cli_run_dist.c: `mpirun -np P mha run --distributed ring ...` (cli_run_common.h). Every rank
 * parses the same options, loads the weights and either reads the whole input and keeps its rows
 * (the rows mha_ring_shard gives it), or, with {rank} in the file names, reads only its own rows.
 * It runs its rows of the layer with mha_ring_layer_forward (libmha_mpi: projections of its rows,
 * RoPE at global positions, ring attention), then rank 0 gathers Y and writes the file a
 * single-process run writes (atomically, as ever), or each rank writes its own rows.
 *
 * Errors: every step that can fail on one rank alone (a file, an allocation) ends with an
 * agreement (one MPI_Allreduce), so a failure anywhere stops every rank with a non-zero status and
 * no rank waits on a peer that already stopped; the failing rank prints its line ("mha: rank r of
 * P: ..."), rank 0 says which rank stopped the run. MPI_Abort only when MPI itself fails. */
#include "cli_run_common.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if !defined(MHA_CLI_MPI)

int run_distributed(const run_config *o, run_state *s) {
    (void)o;
    (void)s;
    return cli_fail("--distributed: this mha was built without MPI (install an MPI, e.g. "
                    "Debian's libopenmpi-dev, and build with -DMHA_MPI=ON)");
}

#else
#    include "mha_mpi.h"

/* This rank and its rows of the global sequence. */
typedef struct dist {
    int rank, size;
    mha_ring_config cfg;
    int32_t nc;
    int64_t start[2], len[2], n_local;
} dist;

/* A line on rank 0 only, for failures every rank finds alike (sizes all ranks compute). */
static int fail0(const dist *d, const char *fmt, ...)
#    if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#    endif
    ;
static int fail0(const dist *d, const char *fmt, ...) {
    if (d->rank != 0)
        return CLI_FAIL;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return cli_fail("%s", msg);
}

/* The agreement after a step: one MPI_Allreduce (MAX) of {P - rank if this rank failed, its
 * status}. Every rank returns CLI_OK, or the largest exit status of the failed ranks; rank 0 names
 * the first failed rank when it did not fail itself (the failed ranks printed their own line). */
static int agree(const dist *d, int rc) {
    const int mine[2] = {rc ? d->size - d->rank : 0, rc};
    int all[2] = {0, 0};
    if (MPI_Allreduce(mine, all, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD) != MPI_SUCCESS) {
        cli_fail("MPI_Allreduce failed: stopping every rank");
        MPI_Abort(MPI_COMM_WORLD, CLI_FAIL);
    }
    if (!all[0])
        return CLI_OK;
    if (!rc && d->rank == 0)
        cli_fail("stopped: rank %d failed (its message is above)", d->size - all[0]);
    return rc ? rc : all[1];
}

static const char *layout_name(const dist *d) {
    return d->cfg.layout == MHA_SHARD_ZIGZAG ? "zigzag" : "contiguous";
}

/* Global row of local row li: the rank's chunks one after the other. */
static int64_t global_row(const dist *d, int64_t li) {
    return li < d->len[0] ? d->start[0] + li : d->start[1] + (li - d->len[0]);
}

/* The rank's chunks of an N-row sequence (any N >= 1: with fewer rows than chunks, some ranks
 * hold none); fails on every rank alike otherwise. */
static int set_shard(dist *d, int64_t N, const char *what) {
    d->cfg.seq_len = N;
    mha_error err;
    if (mha_ring_shard(&d->cfg, d->size, d->rank, &d->nc, d->start, d->len, &err) != MHA_STATUS_OK)
        return fail0(d, "%s: %lld rows cannot be sharded over %d ranks (%s layout): %s", what,
                     (long long)N, d->size, layout_name(d), err.message);
    if (d->nc < 2)
        d->len[1] = 0;
    d->n_local = d->len[0] + d->len[1];
    return CLI_OK;
}

/* Shard files: the global length is the sum of the ranks' rows (a rank may hold none: a zero-row
 * file); the ranks must agree on the batch and rank of their files, and each must hold exactly its
 * rows of the layout. "Every input finite" is agreed here too (the largest inputs_nonfinite), so
 * that no rank reports a NaN that came through the ring from another rank's input as overflow
 * (--mask, the only other input that sets it, is refused with --distributed). */
static int shard_sizes(const run_config *o, run_state *s, dist *d, const run_dims *dm) {
    const char *xpath = o->opt[O_INPUT];
    int64_t v[5] = {dm->B, -dm->B, dm->x_ndim, -dm->x_ndim, s->inputs_nonfinite}, r[5];
    int64_t n = dm->n, total = 0;
    if (MPI_Allreduce(v, r, 5, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD) != MPI_SUCCESS ||
        MPI_Allreduce(&n, &total, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD) != MPI_SUCCESS) {
        cli_fail("MPI_Allreduce failed: stopping every rank");
        MPI_Abort(MPI_COMM_WORLD, CLI_FAIL);
    }
    s->inputs_nonfinite = r[4] != 0;
    if (r[0] != -r[1] || r[2] != -r[3])
        return cli_fail("%s: the ranks' input files disagree (batch %lld to %lld, %lld to %lld "
                        "dimensions); each must be [B, n_r, q_dim] with the same B",
                        xpath, (long long)-r[1], (long long)r[0], (long long)-r[3],
                        (long long)r[2]);
    if (total == 0)
        return fail0(d,
                     "%s: the ranks' input files hold no rows (each has zero rows); the "
                     "sequence needs at least one",
                     xpath);
    int rc = set_shard(d, total, "the ranks' input files together");
    if (rc)
        return rc;
    if (d->n_local != n)
        return cli_fail("%s: %lld rows, but rank %d of %d holds %lld rows of the %lld-row sequence "
                        "(%s layout: rows [%lld, %lld) then [%lld, %lld))",
                        xpath, (long long)n, d->rank, d->size, (long long)d->n_local,
                        (long long)total, layout_name(d), (long long)d->start[0],
                        (long long)(d->start[0] + d->len[0]), (long long)d->start[1],
                        (long long)(d->start[1] + d->len[1]));
    return CLI_OK;
}

/* malloc that answers a rank without rows (n_local = 0) with a pointer too (malloc(0) may be
 * NULL). */
static void *alloc_rows(size_t bytes) {
    return malloc(bytes ? bytes : 1);
}

/* This rank's rows of a [B, N, w] array of `elem`-byte elements, as a new [B, n_local, w] one. */
static void *
take_rows(const dist *d, const void *src, int64_t B, int64_t N, int64_t w, size_t elem) {
    char *dst = alloc_rows(elem * (size_t)(B * d->n_local * w));
    if (!dst)
        return NULL;
    const size_t row = elem * (size_t)w;
    for (int64_t b = 0; b < B; b++)
        for (int64_t li = 0; li < d->n_local; li++)
            memcpy(dst + (size_t)(b * d->n_local + li) * row,
                   (const char *)src + (size_t)(b * N + global_row(d, li)) * row, row);
    return dst;
}

/* Key padding [B, N] or [N] (broadcast over the batch) at this rank's keys, as uint8 [B, n]. */
static uint8_t *take_padding(const dist *d, const mha_mask_tensor *t, int64_t B, int64_t N) {
    uint8_t *dst = alloc_rows((size_t)(B * d->n_local));
    if (!dst)
        return NULL;
    const int per_batch = t->ndim == 2 && t->shape[0] > 1;
    for (int64_t b = 0; b < B; b++)
        for (int64_t li = 0; li < d->n_local; li++) {
            const int64_t k = (per_batch ? b * N : 0) + global_row(d, li);
            int64_t val;
            if (t->dtype == MHA_DTYPE_I32)
                val = ((const int32_t *)t->data)[k];
            else if (t->dtype == MHA_DTYPE_I64)
                val = ((const int64_t *)t->data)[k];
            else
                val = ((const uint8_t *)t->data)[k];
            dst[b * d->n_local + li] = val != 0;
        }
    return dst;
}

/* The rank's buffers: its rows of X and of the per-row inputs (whole-input mode), Y. */
typedef struct dist_bufs {
    float *x, *y, *stage; /* stage: rank 0's receive buffer of the largest shard's Y */
    int64_t *qpos, *kpos;
    int32_t *qseg, *kvseg;
    uint8_t *pad;
} dist_bufs;

static void free_bufs(dist_bufs *b) {
    free(b->x), free(b->y), free(b->stage), free(b->qpos), free(b->kpos);
    free(b->qseg), free(b->kvseg), free(b->pad);
}

/* Whole-input mode: this rank's rows of X, the positions, the key padding and the segments
 * (fa's pointers are moved to them). */
static int take_local(const run_state *s,
                      const dist *d,
                      const run_dims *dm,
                      int64_t q_dim,
                      mha_forward_args *fa,
                      dist_bufs *bf) {
    const int64_t B = dm->B, N = dm->n;
    int ok = (bf->x = take_rows(d, s->xf, B, N, q_dim, sizeof(float))) != NULL;
    if (s->qpos)
        ok &= (bf->qpos = take_rows(d, s->qpos, B, N, 1, sizeof(int64_t))) != NULL;
    if (s->kpos)
        ok &= (bf->kpos = take_rows(d, s->kpos, B, N, 1, sizeof(int64_t))) != NULL;
    if (s->qseg)
        ok &= (bf->qseg = take_rows(d, s->qseg, B, N, 1, sizeof(int32_t))) != NULL &&
              (bf->kvseg = take_rows(d, s->kvseg, B, N, 1, sizeof(int32_t))) != NULL;
    if (fa->mask.key_padding.data)
        ok &= (bf->pad = take_padding(d, &fa->mask.key_padding, B, N)) != NULL;
    if (!ok)
        return cli_fail("cannot allocate this rank's %lld rows of the inputs",
                        (long long)d->n_local);
    fa->query = bf->x;
    fa->q_positions = bf->qpos;
    fa->k_positions = bf->kpos;
    fa->mask.q_segment_ids = bf->qseg;
    fa->mask.kv_segment_ids = bf->kvseg;
    if (bf->pad)
        fa->mask.key_padding = (mha_mask_tensor){bf->pad, MHA_DTYPE_U8, 2, {B, d->n_local, 0, 0}};
    return CLI_OK;
}

/* Rank 0 receives every rank's rows of Y [B, n_r, od] and puts them at their global rows of
 * y [B, N, od]; the other ranks send theirs. Sizes were checked to fit one message each. */
static void
gather_y(const dist *d, const float *yl, float *y, float *stage, int64_t B, int64_t od) {
    if (d->rank != 0) {
        MPI_Send(yl, (int)(B * d->n_local * od), MPI_FLOAT, 0, 0, MPI_COMM_WORLD);
        return;
    }
    const int64_t N = d->cfg.seq_len;
    for (int r = 0; r < d->size; r++) {
        dist dr = *d;
        dr.rank = r;
        mha_error err;
        mha_ring_shard(&dr.cfg, dr.size, r, &dr.nc, dr.start, dr.len, &err);
        dr.len[1] = dr.nc > 1 ? dr.len[1] : 0;
        dr.n_local = dr.len[0] + dr.len[1];
        const float *src = yl;
        if (r != 0) {
            MPI_Recv(stage, (int)(B * dr.n_local * od), MPI_FLOAT, r, 0, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
            src = stage;
        }
        for (int64_t b = 0; b < B; b++)
            for (int64_t li = 0; li < dr.n_local; li++)
                memcpy(y + (b * N + global_row(&dr, li)) * od, src + (b * dr.n_local + li) * od,
                       sizeof(float) * (size_t)od);
    }
}

/* Y's buffers: this rank's rows, and on rank 0 (whole-input mode) the whole Y and a receive
 * buffer of the largest shard. Every Y message must fit MPI's int count. */
static int
alloc_y(const run_config *o, run_state *s, const dist *d, int64_t B, int64_t od, dist_bufs *bf) {
    const int64_t N = d->cfg.seq_len;
    const int64_t n_max = N / (d->nc > 1 ? 2 * d->size : d->size) * d->nc + d->nc;
    if (!o->shard_files && (B * n_max > INT32_MAX / od || B * N > INT64_MAX / 8 / od))
        return fail0(d,
                     "%s: Y has %lld floats per rank, more than one MPI message carries; use "
                     "per-rank shard files ({rank} in --input and --out)",
                     o->opt[O_INPUT], (long long)(B * n_max * od));
    const size_t fb = sizeof(float);
    int ok = (bf->y = alloc_rows(fb * (size_t)(B * d->n_local * od))) != NULL;
    if (!o->shard_files && d->rank == 0) {
        ok &= (s->out = malloc(fb * (size_t)(B * N * od))) != NULL;
        ok &= (bf->stage = malloc(fb * (size_t)(B * n_max * od))) != NULL;
    }
    return ok ? CLI_OK : cli_fail("cannot allocate the output of %lld rows", (long long)N);
}

/* Writes Y: rank 0 the gathered file (its status broadcast), or every rank its own file, all or
 * nothing: each rank writes its temporary, and they are renamed into place only when every rank's
 * write succeeded (else removed: every file at an output path stays as it was). */
static int write_y(const run_config *o,
                   run_state *s,
                   const dist *d,
                   const run_dims *dm,
                   int64_t od,
                   dist_bufs *bf) {
    if (o->shard_files) {
        s->out = bf->y;
        bf->y = NULL;
        mha__npy_set_begin();
        const int rc =
            agree(d, write_outputs(o, s, dm->x_ndim, dm->B, d->n_local, d->n_local, dm->h, od));
        if (rc)
            return finish_outputs(rc); /* the temporaries removed */
        return agree(d, finish_outputs(CLI_OK));
    }
    gather_y(d, bf->y, s->out, bf->stage, dm->B, od);
    int rc = CLI_OK;
    if (d->rank == 0) {
        mha__npy_set_begin();
        rc = finish_outputs(write_outputs(o, s, dm->x_ndim, dm->B, dm->n, dm->n, dm->h, od));
    }
    if (MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
        MPI_Abort(MPI_COMM_WORLD, CLI_FAIL);
    return rc;
}

/* Inputs, this rank's rows, the ring layer, Y. */
static int dist_forward(const run_config *o, run_state *s, dist *d) {
    run_dims dm = {0, 0, 0, 0, 0, 0};
    mha_forward_args fa;
    memset(&fa, 0, sizeof fa);
    dist_bufs bf;
    memset(&bf, 0, sizeof bf);
    int rc = agree(d, read_inputs(o, s, &dm));
    if (!rc)
        rc = agree(d, o->shard_files ? shard_sizes(o, s, d, &dm)
                                     : set_shard(d, dm.n, o->opt[O_INPUT]));
    if (!rc)
        rc = agree(d, read_masks(o, s, &dm, &fa));
    const mha_config *c = rc ? NULL : mha_layer_config(s->layer);
    if (!rc) {
        fa.query = s->xf, fa.q_positions = s->qpos, fa.k_positions = s->kpos;
        fa.mask.q_segment_ids = s->qseg, fa.mask.kv_segment_ids = s->kvseg;
        int mine = o->shard_files ? CLI_OK : take_local(s, d, &dm, c->q_dim, &fa, &bf);
        if (!mine)
            mine = alloc_y(o, s, d, dm.B, c->out_dim, &bf);
        rc = agree(d, mine);
    }
    if (!rc) {
        stage_done(o, s, "layer built, inputs read, rows taken");
        fa.batch = dm.B;
        fa.q_len = fa.kv_len = d->n_local;
        fa.out = bf.y;
        mha_error err;
        memset(&err, 0, sizeof err);
        /* Collective; its errors are agreed: the same status and message on every rank. */
        if (mha_ring_layer_forward(MPI_COMM_WORLD, &d->cfg, s->layer, &fa, &o->exec, &err) !=
            MHA_STATUS_OK)
            rc = d->rank == 0
                     ? cli_fail("--distributed ring: %s",
                                err.message[0] ? err.message : mha_status_string(err.status))
                     : CLI_FAIL;
    }
    if (!rc) {
        stage_done(o, s, "distributed forward computed");
        rc = write_y(o, s, d, &dm, c->out_dim, &bf);
        if (!rc)
            stage_done(o, s, "outputs written");
    }
    free_bufs(&bf);
    return rc;
}

/* o with "{rank}" in each option value replaced by the rank (new strings in names[]); --verbose
 * on rank 0 only. */
static int rank_paths(const run_config *o, int rank, run_config *ro, char *names[O_COUNT]) {
    *ro = *o;
    if (rank != 0)
        ro->opt[O_VERBOSE] = NULL;
    char num[16];
    const int nl = snprintf(num, sizeof num, "%d", rank);
    for (int id = 0; id < O_COUNT; id++) {
        const char *v = o->opt[id];
        if (!v || !strstr(v, "{rank}"))
            continue;
        size_t count = 0;
        for (const char *p = strstr(v, "{rank}"); p; p = strstr(p + 6, "{rank}"))
            count++;
        char *out = malloc(strlen(v) + count * (size_t)nl + 1);
        if (!out)
            return cli_fail("out of memory");
        char *w = out;
        for (const char *p = v; *p;) {
            if (strncmp(p, "{rank}", 6) == 0) {
                memcpy(w, num, (size_t)nl);
                w += nl, p += 6;
            } else {
                *w++ = *p++;
            }
        }
        *w = '\0';
        names[id] = out;
        ro->opt[id] = out;
    }
    return CLI_OK;
}

int run_distributed(const run_config *o, run_state *s) {
    if (MPI_Init(NULL, NULL) != MPI_SUCCESS)
        return cli_fail("--distributed: MPI_Init failed (run it under mpirun)");
    dist d;
    memset(&d, 0, sizeof d);
    MPI_Comm_rank(MPI_COMM_WORLD, &d.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &d.size);
    d.cfg.layout = o->zigzag ? MHA_SHARD_ZIGZAG : MHA_SHARD_CONTIGUOUS;
    cli_set_rank(d.rank, d.size);

    /* Paths (each rank's own names; the outputs checked where they are written), the layer. */
    run_config ro;
    char *names[O_COUNT] = {NULL};
    int rc = rank_paths(o, d.rank, &ro, names);
    if (!rc && (o->shard_files || d.rank == 0))
        rc = check_paths(&ro);
    rc = agree(&d, rc);
    if (!rc)
        rc = agree(&d, build_layer(&ro, s));
    if (!rc)
        rc = dist_forward(&ro, s, &d);
    for (int i = 0; i < O_COUNT; i++)
        free(names[i]);
    MPI_Finalize();
    return rc;
}

#endif /* MHA_CLI_MPI */
