/* SPDX-License-Identifier: MIT */
/* cli_run_mla.c: `mha run --model DIR --layer L` for a multi-head latent attention model
 * (deepseek_v2, deepseek_v3: mha_hf_mla_load): the layer's causal expanded forward
 * (mha_mla_forward) of --input [n, hidden] or [B, n, hidden] into --out (float32), with
 * --positions and --threads; with --decode (--prefill P, --cache-dtype T) the same rows through
 * the compressed cache (mha_mla_cache, mha_mla_decode_step: the absorbed form): the first P tokens
 * of every sequence in one call, then one token per call. The output is checked as the ordinary
 * path checks it (check_paths; a non-finite output of finite inputs is exit 3, nothing written,
 * unless --allow-nonfinite). Every other option of `mha run` is refused naming it (docs/MODELS.md
 * "Multi-head latent attention"). */
#include "cli_run_common.h"

#include "npy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The options an MLA layer takes; any other given one is a usage error naming it. */
static int check_mla_options(const run_config *o) {
    static const int ok[] = {O_MODEL,   O_LAYER,       O_INPUT,          O_OUT,
                             O_THREADS, O_POSITIONS,   O_VERBOSE,        O_DECODE,
                             O_PREFILL, O_CACHE_DTYPE, O_ALLOW_NONFINITE};
    for (int i = 0; i < O_COUNT; i++) {
        int allowed = i == O_HELP;
        for (size_t k = 0; k < sizeof ok / sizeof ok[0]; k++)
            allowed |= ok[k] == i;
        if (o->opt[i] && !allowed)
            return cli_usage("%s is not supported with a multi-head latent attention model "
                             "(--model %s)",
                             o->flags[i].name, o->opt[O_MODEL]);
    }
    return CLI_OK;
}

/* --decode: a cache of n tokens per sequence (o->cache_dtype), the first P = o->prefill tokens of
 * every sequence in one mha_mla_decode_step, then one token per step; y [B, n, hidden] gets each
 * call's rows. One thread pool for every step (a step is short: starting threads would show). */
static int run_decode(const run_config *o,
                      const mha_mla *m,
                      const mha_mla_forward_args *fa,
                      float *y,
                      const mha_exec *exec,
                      mha_error *err) {
    const int64_t B = fa->batch, n = fa->seq_len, E = mha_mla_get_config(m)->hidden;
    const int64_t P = o->prefill;
    if (P > n)
        return cli_fail("--prefill %lld: larger than the %lld tokens of %s", (long long)P,
                        (long long)n, o->opt[O_INPUT]);
    mha_mla_cache *cache = NULL;
    mha_exec ex = *exec;
    float *xs = malloc(sizeof(float) * (size_t)(B * P * E)); /* B P E <= x's count: no overflow */
    float *ys = malloc(sizeof(float) * (size_t)(B * P * E));
    int rc = xs && ys ? CLI_OK : cli_fail("cannot allocate the decode buffers");
    if (!rc &&
        (mha_mla_cache_create(m, B, n, o->cache_dtype, NULL, &cache, err) ||
         mha_threadpool_create(ex.n_threads < 1024 ? ex.n_threads : 1024, NULL, &ex.pool, err)))
        rc = cli_lib_fail(o->opt[O_MODEL], err);
    for (int64_t t0 = 0; t0 < n && !rc;) {
        const int64_t t = t0 == 0 ? P : 1;
        for (int64_t b = 0; b < B; b++)
            memcpy(xs + b * t * E, fa->x + (b * n + t0) * E, sizeof(float) * (size_t)(t * E));
        mha_decode_args a;
        memset(&a, 0, sizeof a);
        a.num_seqs = B;
        a.num_tokens = t;
        a.x = xs;
        a.out = ys;
        if (mha_mla_decode_step(m, cache, &a, &ex, err) != MHA_STATUS_OK) {
            rc = cli_lib_fail(o->opt[O_MODEL], err);
            break;
        }
        for (int64_t b = 0; b < B; b++)
            memcpy(y + (b * n + t0) * E, ys + b * t * E, sizeof(float) * (size_t)(t * E));
        t0 += t;
    }
    mha_threadpool_destroy(ex.pool);
    mha_mla_cache_destroy(cache);
    free(xs);
    free(ys);
    return rc;
}

/* x [B, n, hidden] (2-d: B = 1) as float32; positions [B, n] or [n] int64 when given. s: the
 * --verbose clock and the inputs' finiteness. */
static int run_layer(const run_config *o, const mha_mla *m, run_state *s, mha_error *err) {
    mha__npy x = {0};
    float *xf = NULL, *y = NULL;
    int64_t *pos = NULL;
    int rc = CLI_FAIL;
    const int64_t E = mha_mla_get_config(m)->hidden;
    if (mha__npy_read(o->opt[O_INPUT], &x, err) != MHA_STATUS_OK ||
        mha__npy_to_f32(&x, "--input", &xf, err) != MHA_STATUS_OK) {
        rc = cli_lib_fail(o->opt[O_INPUT], err);
        goto done;
    }
    if ((x.ndim != 2 && x.ndim != 3) || x.shape[x.ndim - 1] != E) {
        char sb[160];
        rc = cli_fail("%s: shape %s does not fit: expected [n, %lld] or [B, n, %lld] (hidden_size "
                      "%lld)",
                      o->opt[O_INPUT], cli_shape_str(sb, sizeof sb, x.ndim, x.shape), (long long)E,
                      (long long)E, (long long)E);
        goto done;
    }
    mha_mla_forward_args a;
    memset(&a, 0, sizeof a);
    a.batch = x.ndim == 3 ? x.shape[0] : 1;
    a.seq_len = x.shape[x.ndim - 2];
    a.x = xf;
    a.causal = 1;
    /* int32/int64 [n] or [B, n] in [0, 2^31], as the ordinary path reads them (not any array of
     * B n values: a transposed [n, B] file is refused, not read as [B, n]). */
    if (o->opt[O_POSITIONS] && (rc = read_index(o->opt[O_POSITIONS], "position", a.batch, a.seq_len,
                                                0, MHA_MAX_POSITION, &pos)))
        goto done;
    a.positions = pos;
    stage_done(o, s, "inputs read");
    y = malloc(sizeof(float) * (size_t)x.count);
    a.out = y;
    mha_exec ex;
    memset(&ex, 0, sizeof ex);
    ex.n_threads = o->opt[O_THREADS] ? atoi(o->opt[O_THREADS]) : 0;
    if (!y)
        rc = cli_fail("out of memory");
    else if (o->decode)
        rc = run_decode(o, m, &a, y, &ex, err);
    else
        rc = mha_mla_forward(m, &a, &ex, err) == MHA_STATUS_OK ? CLI_OK
                                                               : cli_lib_fail(o->opt[O_MODEL], err);
    if (rc)
        goto done;
    stage_done(o, s, o->decode ? "prefill and decode steps computed" : "forward computed");
    /* Exit 3, nothing written, when finite inputs gave NaN or inf (docs/FORMATS.md). */
    s->inputs_nonfinite = !input_all_finite(&x);
    char what[64 + 4096];
    snprintf(what, sizeof what, "--out %s", o->opt[O_OUT]);
    if ((rc = check_finite_output(o, s, what, y, MHA_DTYPE_F32, x.ndim, x.shape)))
        goto done;
    if (mha__npy_write_f32(o->opt[O_OUT], y, x.ndim, x.shape, err) != MHA_STATUS_OK) {
        rc = cli_lib_fail(o->opt[O_OUT], err);
    } else {
        rc = CLI_OK;
        stage_done(o, s, "outputs written");
    }
done:
    free(xf);
    free(y);
    mha__npy_free(&x);
    free(pos);
    return rc;
}

int cli_run_mla(const run_config *o, int *handled) {
    *handled = 0;
    if (!o->opt[O_MODEL])
        return CLI_OK;
    mha_hf_layer_info info;
    memset(&info, 0, sizeof info);
    mha_error err;
    memset(&err, 0, sizeof err);
    mha_mla *m = NULL;
    run_state s;
    memset(&s, 0, sizeof s);
    stage_begin(&s);
    const mha_status st = mha_hf_mla_load(o->opt[O_MODEL], o->layer, NULL, &m, &info, &err);
    if (st != MHA_STATUS_OK && !info.model_type[0])
        return CLI_OK; /* not an MLA model_type: the ordinary layer path reads it */
    *handled = 1;
    if (st != MHA_STATUS_OK)
        return cli_lib_fail(o->opt[O_MODEL], &err);
    int rc = check_mla_options(o);
    if (!rc) /* as the ordinary path: no output may be an input (or a model file) or a link */
        rc = check_paths(o);
    if (!rc)
        stage_done(o, &s, "weights read");
    if (!rc)
        rc = run_layer(o, m, &s, &err);
    mha_mla_destroy(m);
    return rc;
}
