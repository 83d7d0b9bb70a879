/* SPDX-License-Identifier: MIT */
/* cli_run_stats.c: `mha run ... --attn-stats STATS.npz [--stats LIST]`: the layer's attention
 * statistics (mha_layer_attention_statistics: no n x m matrix) written as an .npz
 * (docs/FORMATS.md). LIST: comma-separated received, entropy, topk[=K], pool[=RxC]; default
 * "received,entropy"; K defaults to 8, the grid to 256x256, both clamped to the map (K <= m,
 * R <= n, C <= m) so that one command line serves any length. */
#include "cli_run_common.h"

#include "npz.h"

#include <stdlib.h>
#include <string.h>

/* One statistic of the list: its name and, for topk and pool, the text after '='. */
static int stats_item(const char *item, size_t len, cli_stats_spec *sp) {
    const char *eq = memchr(item, '=', len);
    const size_t name_len = eq ? (size_t)(eq - item) : len;
    char value[64] = "";
    if (eq) {
        const size_t vl = len - name_len - 1;
        if (vl == 0 || vl >= sizeof value)
            return cli_usage("--stats: cannot read '%.*s'", (int)len, item);
        memcpy(value, eq + 1, vl);
    }
#define IS(word) (name_len == strlen(word) && strncmp(item, word, name_len) == 0)
    if ((IS("received") || IS("entropy")) && eq)
        return cli_usage("--stats: %.*s takes no value", (int)name_len, item);
    if (IS("received")) {
        sp->received = 1;
    } else if (IS("entropy")) {
        sp->entropy = 1;
    } else if (IS("topk")) {
        if (!sp->topk) /* a bare topk keeps an earlier topk=K (as Python's "topk=3,topk") */
            sp->topk = 8;
        if (eq && cli_parse_i64("--stats topk", value, 1, (int64_t)1 << 31, &sp->topk))
            return CLI_USAGE;
    } else if (IS("pool")) {
        if (!sp->pool_rows) /* a bare pool keeps an earlier pool=RxC */
            sp->pool_rows = sp->pool_cols = 256;
        char *x = eq ? strchr(value, 'x') : NULL;
        if (eq && !x)
            return cli_usage("--stats pool=%s: expected RxC, e.g. pool=256x256", value);
        if (x) {
            *x = '\0';
            if (cli_parse_i64("--stats pool rows", value, 1, (int64_t)1 << 31, &sp->pool_rows) ||
                cli_parse_i64("--stats pool columns", x + 1, 1, (int64_t)1 << 31, &sp->pool_cols))
                return CLI_USAGE;
        }
    } else {
        return cli_usage("--stats: unknown statistic '%.*s' (known: received, entropy, "
                         "topk[=K], pool[=RxC])",
                         (int)len, item);
    }
#undef IS
    return CLI_OK;
}

int parse_stats_spec(const char *spec, cli_stats_spec *sp) {
    memset(sp, 0, sizeof *sp);
    if (!spec)
        spec = "received,entropy";
    for (const char *p = spec;;) {
        const char *comma = strchr(p, ',');
        const size_t len = comma ? (size_t)(comma - p) : strlen(p);
        if (len == 0)
            return cli_usage("--stats '%s': empty item", spec);
        int rc = stats_item(p, len, sp);
        if (rc)
            return rc;
        if (!comma)
            return CLI_OK;
        p = comma + 1;
    }
}

void stats_free(cli_stats *st) {
    free(st->received);
    free(st->received_total);
    free(st->entropy);
    free(st->topk_index);
    free(st->topk_prob);
    free(st->pooled);
    free(st->pooled_visible);
    memset(st, 0, sizeof *st);
}

/* calloc of count elements of size, refusing products that overflow. */
static void *alloc_n(int64_t a, int64_t b, int64_t c, int64_t d, size_t size) {
    int64_t n;
    if (!cli_mul(a, b, &n) || !cli_mul(n, c, &n) || !cli_mul(n, d, &n) ||
        n > (int64_t)(SIZE_MAX / 16))
        return NULL;
    return calloc((size_t)n, size);
}

int compute_stats(const run_config *o,
                  run_state *s,
                  const mha_forward_args *fa,
                  int64_t h,
                  int64_t n,
                  int64_t m) {
    const cli_stats_spec *sp = &o->stats;
    cli_stats *st = &s->stats;
    const int64_t B = fa->batch;
    st->k = sp->topk < m ? sp->topk : m;
    st->R = sp->pool_rows < n ? sp->pool_rows : n;
    st->C = sp->pool_cols < m ? sp->pool_cols : m;
    int ok = 1;
    if (sp->received) {
        ok &= (st->received = alloc_n(B, h, m, 1, sizeof(float))) != NULL;
        ok &= (st->received_total = alloc_n(B, m, 1, 1, sizeof(float))) != NULL;
    }
    if (sp->entropy)
        ok &= (st->entropy = alloc_n(B, h, n, 1, sizeof(float))) != NULL;
    if (sp->topk) {
        ok &= (st->topk_index = alloc_n(B, h, n, st->k, sizeof(int64_t))) != NULL;
        ok &= (st->topk_prob = alloc_n(B, h, n, st->k, sizeof(float))) != NULL;
    }
    if (sp->pool_rows) {
        ok &= (st->pooled = alloc_n(B, h, st->R, st->C, sizeof(float))) != NULL;
        ok &= (st->pooled_visible = alloc_n(B, h, st->R, st->C, sizeof(float))) != NULL;
    }
    if (!ok)
        return cli_fail("%s: cannot allocate the statistics", o->opt[O_ATTN_STATS]);
    const mha_attention_stats req = {st->received,   st->received_total, st->entropy, st->k,
                                     st->topk_index, st->topk_prob,      st->R,       st->C,
                                     st->pooled,     st->pooled_visible};
    mha_error err;
    memset(&err, 0, sizeof err);
    if (mha_layer_attention_statistics(s->layer, fa, &req, &o->exec, &err) != MHA_STATUS_OK)
        return cli_lib_fail(o->opt[O_ATTN_STATS], &err);
    return CLI_OK;
}

/* Member `name` of shape (B,) + dims when the input had a batch axis, else dims alone. */
static mha__npz_member member(const char *name,
                              mha_dtype dtype,
                              const void *data,
                              int batched,
                              int64_t B,
                              int32_t nd,
                              const int64_t *dims) {
    mha__npz_member mb;
    memset(&mb, 0, sizeof mb);
    mb.name = name;
    mb.dtype = dtype;
    mb.data = data;
    if (batched)
        mb.shape[mb.ndim++] = B;
    for (int32_t i = 0; i < nd; i++)
        mb.shape[mb.ndim++] = dims[i];
    return mb;
}

/* The .npz's members (at most 7) into mb; returns their number. */
static int stats_members(const run_state *s,
                         int x_ndim,
                         int64_t B,
                         int64_t h,
                         int64_t n,
                         int64_t m,
                         mha__npz_member *mb) {
    const cli_stats *st = &s->stats;
    const int bat = x_ndim == 3;
    int count = 0;
    const int64_t hm[2] = {h, m}, hn[2] = {h, n}, hnk[3] = {h, n, st->k},
                  grid[3] = {h, st->R, st->C};
    if (st->received) {
        mb[count++] = member("received", MHA_DTYPE_F32, st->received, bat, B, 2, hm);
        mb[count++] = member("received_total", MHA_DTYPE_F32, st->received_total, bat, B, 1, &m);
    }
    if (st->entropy)
        mb[count++] = member("entropy", MHA_DTYPE_F32, st->entropy, bat, B, 2, hn);
    if (st->topk_index) {
        mb[count++] = member("topk_index", MHA_DTYPE_I64, st->topk_index, bat, B, 3, hnk);
        mb[count++] = member("topk_prob", MHA_DTYPE_F32, st->topk_prob, bat, B, 3, hnk);
    }
    if (st->pooled) {
        mb[count++] = member("pooled", MHA_DTYPE_F32, st->pooled, bat, B, 3, grid);
        mb[count++] = member("pooled_visible", MHA_DTYPE_F32, st->pooled_visible, bat, B, 3, grid);
    }
    return count;
}

int check_stats_finite(const run_config *o,
                       const run_state *s,
                       int x_ndim,
                       int64_t B,
                       int64_t h,
                       int64_t n,
                       int64_t m) {
    mha__npz_member mb[7];
    const int count = stats_members(s, x_ndim, B, h, n, m, mb);
    for (int i = 0; i < count; i++) {
        if (mb[i].dtype != MHA_DTYPE_F32)
            continue;
        char what[64 + 4096];
        snprintf(what, sizeof what, "--attn-stats %s (member %s)", o->opt[O_ATTN_STATS],
                 mb[i].name);
        const int rc =
            check_finite_output(o, s, what, mb[i].data, MHA_DTYPE_F32, mb[i].ndim, mb[i].shape);
        if (rc)
            return rc;
    }
    return CLI_OK;
}

int write_stats(const run_config *o,
                const run_state *s,
                int x_ndim,
                int64_t B,
                int64_t h,
                int64_t n,
                int64_t m) {
    mha__npz_member mb[7];
    const int count = stats_members(s, x_ndim, B, h, n, m, mb);
    mha_error err;
    memset(&err, 0, sizeof err);
    if (mha__npz_write(o->opt[O_ATTN_STATS], mb, count, &err) != MHA_STATUS_OK)
        return cli_lib_fail(NULL, &err);
    return CLI_OK;
}
