/* SPDX-License-Identifier: MIT */
/* cli_run_files.c: `mha run`'s files: every input array read and checked (shape, dtype, range)
 * with one error line naming the file, and the outputs written atomically (cli_run_common.h). */
#define _POSIX_C_SOURCE 200809L /* opendir */
#include "cli_run_common.h"

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------- */
/* Files.                                                                                         */
/* ---------------------------------------------------------------------------------------------- */

int read_npy(const char *path, mha__npy *a) {
    mha_error err;
    memset(&err, 0, sizeof err);
    memset(a, 0, sizeof *a);
    if (mha__npy_read(path, a, &err) != MHA_STATUS_OK)
        return cli_lib_fail(path, &err);
    return CLI_OK;
}

int is_float(mha_dtype t) {
    return t == MHA_DTYPE_F32 || t == MHA_DTYPE_F64 || t == MHA_DTYPE_F16 || t == MHA_DTYPE_BF16;
}

int is_integer(mha_dtype t) {
    return t == MHA_DTYPE_BOOL || t == MHA_DTYPE_U8 || t == MHA_DTYPE_I32 || t == MHA_DTYPE_I64;
}

int to_dtype(const char *path, const mha__npy *a, mha_dtype dtype, void **out) {
    if (!is_float(a->dtype))
        return cli_fail("%s: dtype %s is not supported here (expected float32, float64, float16 "
                        "or bfloat16)",
                        path, cli_dtype_name(a->dtype));
    mha_error err;
    memset(&err, 0, sizeof err);
    if (mha__npy_to_dtype(a, dtype, path, out, &err) != MHA_STATUS_OK)
        return cli_lib_fail(path, &err);
    return CLI_OK;
}

int to_f32(const char *path, const mha__npy *a, float **out) {
    void *f = NULL;
    const int rc = to_dtype(path, a, MHA_DTYPE_F32, &f);
    *out = f;
    return rc;
}

/* Formats the multi-index of flat element `k` of a C-order array. */
static const char *
index_str(char *buf, size_t size, int32_t ndim, const int64_t *shape, int64_t k) {
    int64_t idx[MHA_NPY_MAX_DIMS];
    for (int32_t d = ndim - 1; d >= 0; d--) {
        idx[d] = shape[d] ? k % shape[d] : 0;
        k = shape[d] ? k / shape[d] : 0;
    }
    return cli_shape_str(buf, size, ndim, idx);
}

/* Reads an int32/int64 tensor whose values must all lie in [lo, hi]. */
static int read_ints(const char *path, const char *what, int64_t lo, int64_t hi, mha__npy *a) {
    char ib[160];
    int rc = read_npy(path, a);
    if (rc)
        return rc;
    if (a->dtype != MHA_DTYPE_I32 && a->dtype != MHA_DTYPE_I64)
        return cli_fail("%s: dtype %s is not supported (expected int32 or int64)", path,
                        cli_dtype_name(a->dtype));
    for (int64_t k = 0; k < a->count; k++) {
        int64_t val = a->dtype == MHA_DTYPE_I32 ? (int64_t)((const int32_t *)a->data)[k]
                                                : ((const int64_t *)a->data)[k];
        if (val < lo || val > hi)
            return cli_fail("%s: %s %lld at index %s is outside [%lld, %lld]", path, what,
                            (long long)val, index_str(ib, sizeof ib, a->ndim, a->shape, k),
                            (long long)lo, (long long)hi);
    }
    return CLI_OK;
}

/* Copies element k of an int array viewed as [rows, len] (rows 1 broadcasts) to int64 [B, len]. */
static int expand_ints(
    const char *path, const mha__npy *a, int64_t rows, int64_t B, int64_t len, int64_t **out) {
    int64_t total;
    if (!cli_mul(B, len, &total) || total > (int64_t)(SIZE_MAX / 16))
        return cli_fail("%s: size overflow", path);
    *out = malloc(total ? (size_t)total * sizeof(int64_t) : 1); /* 0: a rank without rows */
    if (!*out)
        return cli_fail("%s: out of memory", path);
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < len; t++) {
            int64_t k = (rows == 1 ? 0 : b) * len + t;
            (*out)[b * len + t] = a->dtype == MHA_DTYPE_I32 ? (int64_t)((const int32_t *)a->data)[k]
                                                            : ((const int64_t *)a->data)[k];
        }
    return CLI_OK;
}

/* Per-token integers (positions, segment ids): [len] (broadcast over the batch) or [B, len]
 * ([1, len] broadcasts too) into a new int64 [B, len] array, each value in [lo, hi]. */
int read_index(const char *path,
               const char *what,
               int64_t B,
               int64_t len,
               int64_t lo,
               int64_t hi,
               int64_t **out) {
    mha__npy a;
    char sb[160];
    int rc = read_ints(path, what, lo, hi, &a);
    if (!rc) {
        int64_t rows = 0;
        if (a.ndim == 1 && a.shape[0] == len)
            rows = 1;
        else if (a.ndim == 2 && (a.shape[0] == B || a.shape[0] == 1) && a.shape[1] == len)
            rows = a.shape[0];
        if (rows == 0)
            rc = cli_fail("%s: shape %s does not fit: expected [%lld] or [%lld, %lld] (%ss)", path,
                          cli_shape_str(sb, sizeof sb, a.ndim, a.shape), (long long)len,
                          (long long)B, (long long)len, what);
        else
            rc = expand_ints(path, &a, rows, B, len, out);
    }
    mha__npy_free(&a);
    return rc;
}

/* One integer per batch row (causal offsets): [B], [1] or [] into a new int64 [B] array. */
int read_per_batch(
    const char *path, const char *what, int64_t B, int64_t lo, int64_t hi, int64_t **out) {
    mha__npy a;
    char sb[160];
    int rc = read_ints(path, what, lo, hi, &a);
    if (!rc) {
        int64_t rows = 0;
        if (a.ndim == 0 || (a.ndim == 1 && a.shape[0] == 1))
            rows = 1;
        else if (a.ndim == 1 && a.shape[0] == B)
            rows = B;
        if (rows == 0)
            rc = cli_fail("%s: shape %s does not fit: expected [%lld] (one %s per batch row)", path,
                          cli_shape_str(sb, sizeof sb, a.ndim, a.shape), (long long)B, what);
        else
            rc = expand_ints(path, &a, rows, B, 1, out);
    }
    mha__npy_free(&a);
    return rc;
}

int read_segments(const char *path, const char *what, int64_t B, int64_t len, int32_t **out) {
    int64_t *wide = NULL;
    int rc = read_index(path, what, B, len, INT32_MIN, INT32_MAX, &wide);
    if (rc)
        return rc;
    const size_t count = (size_t)(B * len); /* 0: a rank without rows, malloc(1) then */
    *out = malloc(count ? count * sizeof(int32_t) : 1);
    if (!*out) {
        free(wide);
        return cli_fail("%s: out of memory", path);
    }
    for (int64_t k = 0; k < B * len; k++)
        (*out)[k] = (int32_t)wide[k];
    free(wide);
    return CLI_OK;
}

/* Fills a mha_mask_tensor from a file array after checking that it broadcasts to target. */
int mask_tensor(const char *path,
                const mha__npy *a,
                const void *data,
                mha_dtype dtype,
                int32_t max_ndim,
                const int64_t *target,
                int32_t target_ndim,
                const char *target_desc,
                mha_mask_tensor *t) {
    char sb[160], tb[160];
    int ok = a->ndim <= max_ndim && a->ndim <= MHA_MAX_MASK_DIMS;
    for (int32_t d = 0; ok && d < a->ndim; d++) {
        int64_t dim = a->shape[a->ndim - 1 - d];
        int64_t want = target[target_ndim - 1 - d];
        ok = dim == want || dim == 1;
    }
    if (!ok)
        return cli_fail("%s: shape %s does not broadcast to %s = %s", path,
                        cli_shape_str(sb, sizeof sb, a->ndim, a->shape), target_desc,
                        cli_shape_str(tb, sizeof tb, target_ndim, target));
    memset(t, 0, sizeof *t);
    t->data = data;
    t->dtype = dtype;
    if (a->ndim == 0) { /* a scalar broadcasts like shape [1] */
        t->ndim = 1;
        t->shape[0] = 1;
    } else {
        t->ndim = a->ndim;
        for (int32_t d = 0; d < a->ndim; d++)
            t->shape[d] = a->shape[d];
    }
    return CLI_OK;
}

/* X, K, V: float, 2-d or 3-d, non-empty (but for zero rows when empty_rows is set); returns B, L,
 * features. */
int input_shape(const char *path,
                const mha__npy *a,
                int empty_rows,
                int64_t *B,
                int64_t *L,
                int64_t *features) {
    char sb[160];
    if (!is_float(a->dtype))
        return cli_fail("%s: dtype %s is not supported (expected float32, float64, float16 or "
                        "bfloat16)",
                        path, cli_dtype_name(a->dtype));
    if (a->ndim != 2 && a->ndim != 3)
        return cli_fail("%s: shape %s has %d dimensions, expected 2 ([n, d]) or 3 ([B, n, d])",
                        path, cli_shape_str(sb, sizeof sb, a->ndim, a->shape), (int)a->ndim);
    for (int32_t d = 0; d < a->ndim; d++)
        if (a->shape[d] == 0 && !(empty_rows && d == a->ndim - 2))
            return cli_fail("%s: shape %s is empty", path,
                            cli_shape_str(sb, sizeof sb, a->ndim, a->shape));
    *B = a->ndim == 3 ? a->shape[0] : 1;
    *L = a->shape[a->ndim - 2];
    *features = a->shape[a->ndim - 1];
    return CLI_OK;
}

/* Whether element i of a float array (F32 F64 F16 BF16) is finite: from its bits for the halves
 * (exponent field all ones = inf or NaN). */
static int elem_finite(mha_dtype dt, const void *data, int64_t i) {
    switch (dt) {
    case MHA_DTYPE_F64:
        return isfinite(((const double *)data)[i]);
    case MHA_DTYPE_F32:
        return isfinite(((const float *)data)[i]);
    case MHA_DTYPE_F16:
        return (((const uint16_t *)data)[i] & 0x7c00u) != 0x7c00u;
    default:
        return (((const uint16_t *)data)[i] & 0x7f80u) != 0x7f80u;
    }
}

/* Element i of a float array as a double, for messages. */
static double elem_value(mha_dtype dt, const void *data, int64_t i) {
    double d = 0.0;
    mha__npy_convert(dt, mha_dtype_size(dt) * (size_t)i + (const char *)data, MHA_DTYPE_F64, &d, 1);
    return d;
}

int input_all_finite(const mha__npy *a) {
    for (int64_t i = 0; i < a->count; i++)
        if (!elem_finite(a->dtype, a->data, i))
            return 0;
    return 1; /* a finite value beyond --dtype's range is inf once converted: still a finite input
               */
}

int check_finite_output(const run_config *o,
                        const run_state *s,
                        const char *what,
                        const void *x,
                        mha_dtype dtype,
                        int32_t ndim,
                        const int64_t *shape) {
    if (o->allow_nonfinite || s->inputs_nonfinite || !x)
        return CLI_OK;
    int64_t count = 1;
    for (int32_t d = 0; d < ndim; d++)
        count *= shape[d];
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < count; i++)
        if (!elem_finite(dtype, x, i) && bad++ == 0)
            first = i;
    if (!bad)
        return CLI_OK;
    char idx[160];
    cli_fail("%s: %lld of %lld values are not finite (NaN or inf), the first at %s = %g, although "
             "every input is finite: %s overflowed (scores or values beyond %s?); nothing written "
             "(--allow-nonfinite writes the outputs anyway)",
             what, (long long)bad, (long long)count, index_str(idx, sizeof idx, ndim, shape, first),
             elem_value(dtype, x, first), cli_dtype_name(dtype),
             dtype == MHA_DTYPE_F16 ? "65504" : "3.4e38");
    return CLI_NONFINITE;
}

/* Writes Y (and A, and the plot) into the open output set (the caller's mha__npy_set_begin;
 * finish_outputs renames them, or removes them all if any fails). */
int write_outputs(const run_config *o,
                  const run_state *s,
                  int x_ndim,
                  int64_t B,
                  int64_t n,
                  int64_t m,
                  int64_t h,
                  int64_t out_dim) {
    mha_error err;
    memset(&err, 0, sizeof err);
    const char *ypath = o->opt[O_OUT], *apath = o->opt[O_ATTN];
    int64_t yshape[3], ashape[4];
    int32_t ynd = 0, and_ = 0;
    if (x_ndim == 3)
        yshape[ynd++] = B;
    yshape[ynd++] = n;
    yshape[ynd++] = out_dim;
    if (x_ndim == 3)
        ashape[and_++] = B;
    if (!o->average)
        ashape[and_++] = h;
    ashape[and_++] = n;
    ashape[and_++] = m;
    char what[64 + 4096];
    snprintf(what, sizeof what, "--out %s", ypath);
    int rc = check_finite_output(o, s, what, s->out, o->dtype, ynd, yshape);
    if (!rc && apath) {
        snprintf(what, sizeof what, "--attn %s", apath);
        rc = check_finite_output(o, s, what, s->probs, MHA_DTYPE_F32, and_, ashape);
    }
    if (rc)
        return rc;
    if (mha__npy_write(ypath, o->dtype, s->out, ynd, yshape, &err) != MHA_STATUS_OK)
        return cli_lib_fail(ypath, &err);
    if (!apath && !o->opt[O_PLOT])
        return CLI_OK;
    if (apath && mha__npy_write_f32(apath, s->probs, and_, ashape, &err) != MHA_STATUS_OK)
        return cli_lib_fail(apath, &err);
    const char *plot = o->opt[O_PLOT];
    if (plot) {
        char why[256], title[160];
        snprintf(title, sizeof title,
                 "attention probabilities, batch row 0 (%lld queries x %lld keys)", (long long)n,
                 (long long)m);
        cli_plot_map map;
        memset(&map, 0, sizeof map);
        map.panels = o->average ? 1 : h, map.n = n, map.m = m;
        map.q_labels = (const char *const *)s->tokens;
        map.k_labels = m == n ? map.q_labels : NULL;
        map.title = title, map.panels_are_heads = !o->average, map.scale = o->plot_scale;
        if (!cli_plot_write(plot, s->plot_pooled, s->plot_visible, h, &map, why, sizeof why))
            return cli_fail("%s: %s", plot, why);
    }
    return CLI_OK;
}

int finish_outputs(int rc) {
    if (rc != CLI_OK) {
        mha__npy_set_abort();
        return rc;
    }
    mha_error err;
    memset(&err, 0, sizeof err);
    if (mha__npy_set_commit(&err) != MHA_STATUS_OK)
        return cli_lib_fail(NULL, &err);
    return CLI_OK;
}

/* Whether name ends in suffix. */
static int has_suffix(const char *name, const char *suffix) {
    const size_t a = strlen(name), b = strlen(suffix);
    return a >= b && strcmp(name + a - b, suffix) == 0;
}

/* Every file `mha run` reads or writes, for cli_check_outputs() before any work. */
int check_paths(const run_config *o) {
    const char *const *v = o->opt;
    static const int in_ids[] = {O_WEIGHTS,        O_GGUF,      O_INPUT,         O_KEY,
                                 O_VALUE,          O_MASK,      O_KPM,           O_Q_SEGMENTS,
                                 O_KV_SEGMENTS,    O_POSITIONS, O_KEY_POSITIONS, O_SINKS,
                                 O_CAUSAL_OFFSETS, O_TOKENS};
    enum { N_IDS = sizeof in_ids / sizeof in_ids[0] };
    static const int out_ids[] = {O_OUT, O_ATTN, O_PLOT, O_ATTN_STATS};
    enum { N_OUT = sizeof out_ids / sizeof out_ids[0] };
    /* --model: every .json and .safetensors file of the directory is an input too (its config,
     * the single file or the index and every shard it names). */
    char **model_paths = NULL;
    int n_model = 0, cap = 0, rc = CLI_OK;
    DIR *dir = v[O_MODEL] ? opendir(v[O_MODEL]) : NULL;
    for (struct dirent *e; dir && rc == CLI_OK && (e = readdir(dir)) != NULL;) {
        if (!has_suffix(e->d_name, ".json") && !has_suffix(e->d_name, ".safetensors"))
            continue;
        if (n_model == cap) {
            cap = cap ? 2 * cap : 16;
            char **grown = realloc(model_paths, sizeof *model_paths * (size_t)cap);
            if (!grown) {
                rc = cli_fail("out of memory");
                break;
            }
            model_paths = grown;
        }
        const size_t len = strlen(v[O_MODEL]) + 1 + strlen(e->d_name) + 1;
        if (!(model_paths[n_model] = malloc(len))) {
            rc = cli_fail("out of memory");
            break;
        }
        snprintf(model_paths[n_model++], len, "%s/%s", v[O_MODEL], e->d_name);
    }
    if (dir)
        closedir(dir);
    cli_path *in = rc ? NULL : malloc(sizeof *in * (size_t)(N_IDS + n_model));
    if (!rc && !in)
        rc = cli_fail("out of memory");
    if (!rc) {
        cli_path out[N_OUT];
        int n_in = 0;
        for (int i = 0; i < N_IDS; i++)
            in[n_in++] = (cli_path){o->flags[in_ids[i]].name, v[in_ids[i]]};
        for (int i = 0; i < n_model; i++)
            in[n_in++] = (cli_path){"--model", model_paths[i]};
        for (int i = 0; i < N_OUT; i++)
            out[i] = (cli_path){o->flags[out_ids[i]].name, v[out_ids[i]]};
        rc = cli_check_outputs(in, n_in, out, N_OUT);
    }
    free(in);
    for (int i = 0; i < n_model; i++)
        free(model_paths[i]);
    free(model_paths);
    return rc;
}
