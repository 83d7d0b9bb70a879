/* SPDX-License-Identifier: MIT */
/* cli_run_job.c: `mha run`'s job once the options are checked: the weights, the layer with the
 * command-line options, the inputs, masks and positions checked against (B, h, n, m), then the
 * forward (or, with --decode, the prefill and decode steps through a KV cache), then the outputs
 * (cli_run_common.h). */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include "cli_run_common.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* --verbose: "mha: <stage done> (<seconds> s)" on stderr when a stage ends. */
void stage_done(const run_config *o, run_state *s, const char *what) {
    const double now = seconds_now();
    if (o->opt[O_VERBOSE])
        fprintf(stderr, "mha: %s (%.3f s)\n", what, now - s->stage_start);
    s->stage_start = now;
}

void stage_begin(run_state *s) {
    s->stage_start = seconds_now();
}

/* ---------------------------------------------------------------------------------------------- */
/* The run itself.                                                                                */

/* --decode: prefill the first P tokens of every row, then one token per step, through a cache of
 * n positions per row; the rows of Y are written as they come. The decode calls take float32
 * activations (the weights are read in the layer's weight_dtype): with --dtype bf16/f16, X (already
 * rounded to it) is widened exactly per call and each row of Y rounded once to it. */
static int run_decode(const run_config *o, run_state *s, int x_ndim, int64_t B, int64_t n) {
    const mha_config *c = mha_layer_config(s->layer);
    const int64_t qd = c->q_dim, od = c->out_dim, P = o->prefill;
    const size_t es = mha_dtype_size(o->dtype);
    if (P > n)
        return cli_fail("--prefill %lld: larger than the %lld tokens of %s", (long long)P,
                        (long long)n, o->opt[O_INPUT]);
    mha_error err;
    memset(&err, 0, sizeof err);
    mha_kv_cache_config kc;
    memset(&kc, 0, sizeof kc);
    kc.max_seq = n;
    kc.batch = B;
    kc.dtype = o->cache_dtype;
    if (o->use_window && o->window_left >= 0)
        kc.window = o->window_left + 1; /* (L, R): the last L+1 positions; R is moot when causal */
    kc.chunk_size = o->chunk_size;
    mha_kv_cache *cache = NULL;
    if (mha_kv_cache_create(&kc, s->layer, NULL, &cache, &err) != MHA_STATUS_OK)
        return cli_lib_fail(NULL, &err);
    int64_t ycount;
    if (!cli_mul(B, n, &ycount) || !cli_mul(ycount, od, &ycount) ||
        ycount > (int64_t)(SIZE_MAX / 8)) {
        mha_kv_cache_destroy(cache);
        return cli_fail("%s: output size overflows", o->opt[O_INPUT]);
    }
    s->out = malloc((size_t)ycount * es);
    float *xs = malloc(sizeof(float) * (size_t)(B * P * qd));
    float *ys = malloc(sizeof(float) * (size_t)(B * P * od));
    int rc = CLI_OK;
    if (!s->out || !xs || !ys)
        rc = cli_fail("cannot allocate the decode buffers");
    /* One pool for every step: a step is short, starting threads per step would show. */
    mha_exec ex = o->exec;
    if (rc == CLI_OK && mha_threadpool_create(ex.n_threads < 1024 ? ex.n_threads : 1024, NULL,
                                              &ex.pool, &err) != MHA_STATUS_OK)
        rc = cli_lib_fail(NULL, &err);
    const char *xin = s->xf;
    char *yout = s->out;
    for (int64_t t0 = 0; t0 < n && rc == CLI_OK;) {
        const int64_t t = t0 == 0 ? P : 1;
        for (int64_t b = 0; b < B; b++)
            mha__npy_convert(o->dtype, xin + (size_t)((b * n + t0) * qd) * es, MHA_DTYPE_F32,
                             xs + b * t * qd, t * qd);
        mha_decode_args a;
        memset(&a, 0, sizeof a);
        a.num_seqs = B;
        a.num_tokens = t;
        a.x = xs;
        a.out = ys;
        mha_status st = t0 == 0 ? mha_layer_prefill(s->layer, cache, &a, &ex, &err)
                                : mha_layer_decode_step(s->layer, cache, &a, &ex, &err);
        if (st != MHA_STATUS_OK) {
            rc = cli_lib_fail(NULL, &err);
            break;
        }
        for (int64_t b = 0; b < B; b++)
            mha__npy_convert(MHA_DTYPE_F32, ys + b * t * od, o->dtype,
                             yout + (size_t)((b * n + t0) * od) * es, t * od);
        t0 += t;
    }
    mha_threadpool_destroy(ex.pool);
    free(xs);
    free(ys);
    mha_kv_cache_destroy(cache);
    if (rc != CLI_OK)
        return rc;
    stage_done(o, s, "prefill and decode steps computed");
    mha__npy_set_begin();
    rc = finish_outputs(write_outputs(o, s, x_ndim, B, n, n, c->num_heads, od));
    if (rc == CLI_OK)
        stage_done(o, s, "outputs written");
    return rc;
}

/* ---------------------------------------------------------------------------------------------- */

/* Steps 1 and 2: the weights (sizes come from the file), then the layer with the command-line
 * options, its weights borrowed from the loaded one. */
int build_layer(const run_config *o, run_state *s) {
    const char *const *v = o->opt;
    const char *wpath = o->wpath;
    mha_error err;
    memset(&err, 0, sizeof err);
    char sb[160];
    int rc;
    mha_config lc;
    memset(&lc, 0, sizeof lc);
    lc.num_heads = o->heads;
    lc.num_kv_heads = o->kv_heads;
    lc.weight_dtype = o->dtype; /* --model: apply_model set o->hf.config's */
    mha_status st;
    if (v[O_MODEL])
        st = mha_hf_layer_load(wpath, o->layer, &o->hf.config, NULL, &s->base, &err);
    else if (v[O_GGUF])
        st = mha_layer_load_gguf(wpath, o->layer, &o->hf.config, NULL, &s->base, &err);
    else
        st = mha_layer_load_safetensors(wpath, v[O_PREFIX], o->use_names ? &o->names : NULL, &lc,
                                        NULL, &s->base, &err);
    if (st != MHA_STATUS_OK)
        return cli_lib_fail(wpath, &err);
    const mha_config *bc = mha_layer_config(s->base);
    const int64_t h = bc->num_heads;
    stage_done(o, s, "weights read");

    if (o->rope.style != MHA_ROPE_NONE && o->rope.rotary_dim > bc->head_dim)
        return cli_fail("--rope-dim %lld: larger than the layer's head_dim %lld (%s)",
                        (long long)o->rope.rotary_dim, (long long)bc->head_dim, wpath);
    mha_config cfg = *bc;
    mha_weights w = *mha_layer_weights(s->base);
    cfg.scale = o->scale;
    cfg.softcap = o->softcap;
    cfg.alibi = o->alibi;
    cfg.rope = o->rope;
    if (v[O_SINKS]) {
        const char *path = v[O_SINKS];
        if ((rc = read_npy(path, &s->sinks)))
            return rc;
        if (s->sinks.ndim != 1 || s->sinks.shape[0] != h)
            return cli_fail("%s: shape %s, expected [%lld] (one sink logit per head)", path,
                            cli_shape_str(sb, sizeof sb, s->sinks.ndim, s->sinks.shape),
                            (long long)h);
        if ((rc = to_f32(path, &s->sinks, &s->sinksf)))
            return rc;
        for (int64_t i = 0; i < h; i++)
            if (!isfinite(s->sinksf[i]))
                return cli_fail("%s: sink logit of head %lld is not finite", path, (long long)i);
        cfg.sinks = 1;
        w.sinks = s->sinksf;
        if (o->dtype != MHA_DTYPE_F32) { /* the layer's weights are all in its weight_dtype */
            if ((rc = to_dtype(path, &s->sinks, o->dtype, &s->sinksw)))
                return rc;
            for (int64_t i = 0; i < h; i++) { /* finite in the file, beyond the dtype's range */
                float f;
                mha__npy_convert(o->dtype,
                                 (const char *)s->sinksw + (size_t)i * mha_dtype_size(o->dtype),
                                 MHA_DTYPE_F32, &f, 1);
                if (!isfinite(f))
                    return cli_fail("%s: sink logit of head %lld (%g) is beyond %s's range "
                                    "(--dtype)",
                                    path, (long long)i, (double)s->sinksf[i],
                                    cli_dtype_name(o->dtype));
            }
            w.sinks = s->sinksw;
        }
    }
    if (mha_layer_create(&cfg, &w, MHA_WEIGHTS_BORROW, NULL, &s->layer, &err) != MHA_STATUS_OK)
        return cli_fail("%s with the given options: %s", wpath,
                        err.message[0] ? err.message : mha_status_string(err.status));

    return CLI_OK;
}

/* Step 3: X (and K, V for cross-attention) read, checked against each other and the layer, and
 * converted to --dtype (a copy when the file has it). */
int read_inputs(const run_config *o, run_state *s, run_dims *d) {
    const char *const *v = o->opt;
    const char *wpath = o->wpath, *xpath = v[O_INPUT];
    const mha_config *bc = mha_layer_config(s->base);
    char sb[160];
    int rc;
    int64_t B, n, feat;
    if ((rc = read_npy(xpath, &s->x)) ||
        (rc = input_shape(xpath, &s->x, o->shard_files, &B, &n, &feat)))
        return rc;
    if (feat != bc->q_dim)
        return cli_fail("%s: last dimension %lld does not match the layer's q_dim %lld (%s)", xpath,
                        (long long)feat, (long long)bc->q_dim, wpath);
    const int x_ndim = s->x.ndim;
    int64_t m = n;
    const int cross = v[O_KEY] != NULL;
    if (!cross) {
        if (bc->k_dim != bc->q_dim || bc->v_dim != bc->q_dim)
            return cli_fail("%s: self-attention needs k_dim = v_dim = q_dim, but %s has "
                            "q_dim %lld, k_dim %lld, v_dim %lld; give --key and --value",
                            xpath, wpath, (long long)bc->q_dim, (long long)bc->k_dim,
                            (long long)bc->v_dim);
    } else {
        const char *kpath = v[O_KEY];
        int64_t kb, kf;
        if ((rc = read_npy(kpath, &s->key)) || (rc = input_shape(kpath, &s->key, 0, &kb, &m, &kf)))
            return rc;
        if (s->key.ndim != x_ndim || kb != B) {
            char xb[160];
            return cli_fail("%s: shape %s does not go with %s %s: expected %s", kpath,
                            cli_shape_str(sb, sizeof sb, s->key.ndim, s->key.shape), xpath,
                            cli_shape_str(xb, sizeof xb, s->x.ndim, s->x.shape),
                            x_ndim == 3 ? "[B, m, k_dim] with the same B" : "[m, k_dim]");
        }
        if (kf != bc->k_dim)
            return cli_fail("%s: last dimension %lld does not match the layer's k_dim %lld (%s)",
                            kpath, (long long)kf, (long long)bc->k_dim, wpath);
        if ((rc = to_dtype(kpath, &s->key, o->dtype, &s->kf)))
            return rc;
        if (v[O_VALUE]) {
            const char *vpath = v[O_VALUE];
            int64_t vb, vm, vf;
            if ((rc = read_npy(vpath, &s->value)) ||
                (rc = input_shape(vpath, &s->value, 0, &vb, &vm, &vf)))
                return rc;
            if (s->value.ndim != x_ndim || vb != B || vm != m) {
                char kb2[160];
                return cli_fail("%s: shape %s does not go with the keys %s %s: expected the same "
                                "leading dimensions",
                                vpath, cli_shape_str(sb, sizeof sb, s->value.ndim, s->value.shape),
                                kpath, cli_shape_str(kb2, sizeof kb2, s->key.ndim, s->key.shape));
            }
            if (vf != bc->v_dim)
                return cli_fail("%s: last dimension %lld does not match the layer's v_dim %lld "
                                "(%s)",
                                vpath, (long long)vf, (long long)bc->v_dim, wpath);
            if ((rc = to_dtype(vpath, &s->value, o->dtype, &s->vf)))
                return rc;
        } else if (bc->v_dim != bc->k_dim) {
            return cli_fail("%s: used as values too, but %s has v_dim %lld != k_dim %lld; "
                            "give --value",
                            kpath, wpath, (long long)bc->v_dim, (long long)bc->k_dim);
        }
    }
    if ((rc = to_dtype(xpath, &s->x, o->dtype, &s->xf)))
        return rc;
    s->inputs_nonfinite = !input_all_finite(&s->x) || (s->kf && !input_all_finite(&s->key)) ||
                          (s->vf && !input_all_finite(&s->value));
    *d = (run_dims){B, n, m, bc->num_heads, x_ndim, cross};
    return CLI_OK;
}

/* --mask recognised as a built-in rule (mha_mask_recognize, docs/SEMANTICS.md "Recognised
 * masks"): the rule replaces the tensor when the run has no rule of its own for it to combine
 * with (--causal, --window, --causal-offsets, --key-padding-mask, ALiBi, which the alignment
 * places); the outputs are then the tensor's bit for bit. --verbose says which. */
static int recognise_mask(const run_config *o, run_state *s, const run_dims *d, mha_masking *mk) {
    const char *const *v = o->opt;
    const int additive = mk->additive_mask.data != NULL;
    const mha_mask_tensor *t = additive ? &mk->additive_mask : &mk->bool_mask;
    mha_mask_rule rule;
    mha_error err;
    char desc[160];
    s->rule_keys = malloc((size_t)(d->B * d->m));
    s->rule_offsets = malloc(sizeof(int64_t) * (size_t)d->B);
    if (!s->rule_keys || !s->rule_offsets)
        return cli_fail("cannot allocate the mask's key vector (%lld bytes)",
                        (long long)(d->B * d->m));
    if (mha_mask_recognize(t, additive, mk->bool_mask_polarity, d->B, d->h, d->n, d->m, &rule,
                           s->rule_keys, &err))
        return cli_fail("%s: %s", v[O_MASK], err.message);
    mha_mask_rule_describe(&rule, desc, sizeof desc);
    if (rule.kind == MHA_MASK_RULE_NONE) {
        if (o->opt[O_VERBOSE])
            fprintf(stderr, "mha: mask: no built-in rule (tensor read per tile)\n");
        return CLI_OK;
    }
    const int own_rule =
        o->causal || o->use_window || o->chunk_size || v[O_CAUSAL_OFFSETS] || v[O_KPM] || o->alibi;
    if (own_rule) {
        if (o->opt[O_VERBOSE])
            fprintf(stderr,
                    "mha: mask: recognised as %s, kept as a tensor (read per tile): the run has "
                    "its own --causal, --window, --chunk-size, --causal-offsets, "
                    "--key-padding-mask or ALiBi\n",
                    desc);
        return CLI_OK;
    }
    mha_masking with = *mk;
    with.bool_mask.data = NULL;
    with.additive_mask.data = NULL;
    if (mha_mask_rule_apply(&rule, d->B, d->n, d->m, s->rule_keys, s->rule_offsets, &with, &err))
        return cli_fail("%s: %s", v[O_MASK], err.message);
    *mk = with;
    if (o->opt[O_VERBOSE])
        fprintf(stderr,
                "mha: mask: recognised as %s: the rule runs, the tensor is not read per score\n",
                desc);
    return CLI_OK;
}

/* Step 4: the masks, causal offsets, segment ids and positions, checked against (B, h, n, m). */
/* --verbose: how the call's masks divide its scores (mha_attention_mask_summary). */
static void print_block_mask(const run_state *s, const run_dims *d, const mha_masking *mk) {
    const mha_config *c = mha_layer_config(s->base);
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = d->B, a.num_heads = d->h, a.num_kv_heads = c->num_kv_heads;
    a.q_len = d->n, a.kv_len = d->m, a.head_dim = c->head_dim, a.v_head_dim = c->v_head_dim;
    a.mask = *mk;
    mha_mask_summary sm;
    mha_error err;
    if (mha_attention_mask_summary(&a, NULL, &sm, &err)) {
        fprintf(stderr, "mha: block mask: %s\n", err.message);
        return;
    }
    fprintf(stderr,
            "mha: block mask: %lld tiles of 64 x 64 (all heads) hidden (skipped), %lld visible "
            "(unmasked kernel), %lld mixed; %lld bytes for the element rules\n",
            (long long)sm.tiles_hidden, (long long)sm.tiles_visible, (long long)sm.tiles_mixed,
            (long long)sm.map_bytes);
}

int read_masks(const run_config *o, run_state *s, const run_dims *d, mha_forward_args *fa) {
    const char *const *v = o->opt;
    const int64_t B = d->B, h = d->h, n = d->n, m = d->m;
    char sb[160];
    int rc;
    mha_masking *mk = &fa->mask;
    mk->causal = o->causal;
    mk->alignment = o->alignment;
    mk->use_window = o->use_window;
    mk->window_left = o->use_window ? o->window_left : -1;
    mk->window_right = o->use_window ? o->window_right : -1;
    mk->chunk_size = o->chunk_size;
    const int64_t target4[4] = {B, h, n, m};
    if (v[O_MASK]) {
        const char *path = v[O_MASK];
        if ((rc = read_npy(path, &s->mask)))
            return rc;
        if (is_float(s->mask.dtype)) {
            if (v[O_MASK_MEANS]) /* it would have no effect: the float values are added */
                return cli_fail("%s: --mask-means %s is for a boolean mask, but this one is %s, "
                                "an additive mask (its values are added to the scores, -inf "
                                "blocks); save it as bool, or drop --mask-means",
                                path, v[O_MASK_MEANS], cli_dtype_name(s->mask.dtype));
            if ((rc = mask_tensor(path, &s->mask, NULL, MHA_DTYPE_F32, 4, target4, 4,
                                  "[B, h, n, m]", &mk->additive_mask)) ||
                (rc = to_f32(path, &s->mask, &s->maskf)))
                return rc;
            mk->additive_mask.data = s->maskf;
            for (int64_t i = 0; i < s->mask.count; i++) /* -inf blocks: a finite outcome */
                if (isnan(s->maskf[i]) || s->maskf[i] == INFINITY)
                    s->inputs_nonfinite = 1;
        } else if (is_integer(s->mask.dtype)) {
            if ((rc = mask_tensor(path, &s->mask, s->mask.data, s->mask.dtype, 4, target4, 4,
                                  "[B, h, n, m]", &mk->bool_mask)))
                return rc;
            mk->bool_mask_polarity = o->polarity;
        } else {
            return cli_fail("%s: dtype %s is not a mask type (float: additive; bool, uint8, "
                            "int32, int64: boolean)",
                            path, cli_dtype_name(s->mask.dtype));
        }
    }
    if (v[O_KPM]) {
        const char *path = v[O_KPM];
        const int64_t target2[2] = {B, m};
        if ((rc = read_npy(path, &s->kpm)))
            return rc;
        if (!is_integer(s->kpm.dtype))
            return cli_fail("%s: dtype %s is not supported for a key padding mask (expected "
                            "bool, uint8, int32 or int64; nonzero = real token)",
                            path, cli_dtype_name(s->kpm.dtype));
        if (s->kpm.ndim < 1 || s->kpm.ndim > 2 || s->kpm.shape[s->kpm.ndim - 1] != m)
            return cli_fail("%s: shape %s, expected [B, m] or [m] = [%lld, %lld] or [%lld]", path,
                            cli_shape_str(sb, sizeof sb, s->kpm.ndim, s->kpm.shape), (long long)B,
                            (long long)m, (long long)m);
        if ((rc = mask_tensor(path, &s->kpm, s->kpm.data, s->kpm.dtype, 2, target2, 2, "[B, m]",
                              &mk->key_padding)))
            return rc;
    }
    if (v[O_CAUSAL_OFFSETS]) {
        if ((rc = read_per_batch(v[O_CAUSAL_OFFSETS], "causal offset", B, -MHA_MAX_POSITION,
                                 MHA_MAX_POSITION, &s->offsets)))
            return rc;
        mk->align_offsets = s->offsets;
    }
    if (v[O_Q_SEGMENTS]) {
        if ((rc = read_segments(v[O_Q_SEGMENTS], "query segment id", B, n, &s->qseg)) ||
            (rc = read_segments(v[O_KV_SEGMENTS], "key segment id", B, m, &s->kvseg)))
            return rc;
        mk->q_segment_ids = s->qseg;
        mk->kv_segment_ids = s->kvseg;
    }
    if (v[O_MASK] && (rc = recognise_mask(o, s, d, mk)))
        return rc;
    if (o->opt[O_VERBOSE] &&
        (mk->causal || mk->use_window || mk->chunk_size || mk->bool_mask.data ||
         mk->additive_mask.data || mk->key_padding.data || mk->q_segment_ids))
        print_block_mask(s, d, mk);
    if (v[O_POSITIONS] &&
        (rc = read_index(v[O_POSITIONS], "position", B, n, 0, MHA_MAX_POSITION, &s->qpos)))
        return rc;
    if (v[O_KEY_POSITIONS] &&
        (rc = read_index(v[O_KEY_POSITIONS], "position", B, m, 0, MHA_MAX_POSITION, &s->kpos)))
        return rc;

    return CLI_OK;
}

/* Step 5: the outputs allocated, and the plot's size checked (before the work, not after). */
static int alloc_outputs(const run_config *o, run_state *s, const run_dims *d) {
    const char *const *v = o->opt;
    const int64_t B = d->B, h = d->h, n = d->n, m = d->m;
    const mha_config *bc = mha_layer_config(s->base);
    char sb[160];
    int64_t ycount, pcount = 0;
    if (!cli_mul(B, n, &ycount) || !cli_mul(ycount, bc->out_dim, &ycount) ||
        ycount > (int64_t)(SIZE_MAX / 8))
        return cli_fail("%s: output size overflows", v[O_INPUT]);
    s->out = malloc((size_t)ycount * mha_dtype_size(o->dtype));
    if (!s->out)
        return cli_fail("cannot allocate the output (%lld values)", (long long)ycount);
    if (v[O_PLOT] && !cli_plot_check(v[O_PLOT], o->average ? 1 : h, n, m, sb, sizeof sb))
        return cli_fail("%s: %s", v[O_PLOT], sb);
    int rc;
    if (v[O_TOKENS] && (rc = cli_plot_read_tokens(v[O_TOKENS], n, &s->tokens_buf, &s->tokens)))
        return rc;
    if (v[O_ATTN]) { /* --plot needs no n x m array: it draws the streamed pooled map */
        if (!cli_mul(B, o->average ? 1 : h, &pcount) || !cli_mul(pcount, n, &pcount) ||
            !cli_mul(pcount, m, &pcount) || pcount > (int64_t)(SIZE_MAX / 8))
            return cli_fail("%s: probabilities [B, h, n, m] = [%lld, %lld, %lld, %lld] are too "
                            "large",
                            v[O_ATTN], (long long)B, (long long)h, (long long)n, (long long)m);
        s->probs = malloc((size_t)pcount * sizeof(float));
        if (!s->probs)
            return cli_fail("%s: cannot allocate the probabilities (%lld floats)", v[O_ATTN],
                            (long long)pcount);
    }

    return CLI_OK;
}

/* Element i of an integer mask is nonzero. */
static int mask_nonzero(const mha_mask_tensor *t, int64_t i) {
    switch (t->dtype) {
    case MHA_DTYPE_I32:
        return ((const int32_t *)t->data)[i] != 0;
    case MHA_DTYPE_I64:
        return ((const int64_t *)t->data)[i] != 0;
    default: /* bool, uint8 */
        return ((const uint8_t *)t->data)[i] != 0;
    }
}

/* --attn-average's visible share: an element of the mean over the heads is visible when some head
 * sees it, which the heads' own shares do not tell when the --mask differs between heads (a cell
 * half visible in each of two heads can be all visible in their mean). The mask's head axis
 * collapsed (additive: its maximum; boolean: seen by some head) gives every head that union, so
 * the statistics' pooled_visible of the call with it is the mean's share. NULL data: no --mask
 * with a head axis, nothing to collapse. */
static int union_mask(const mha_masking *mk, mha_masking *out, void **buf) {
    *out = *mk, *buf = NULL;
    const int additive = mk->additive_mask.data != NULL;
    const mha_mask_tensor *t = additive ? &mk->additive_mask : &mk->bool_mask;
    if (!t->data || t->ndim < 3 || t->shape[t->ndim - 3] < 2)
        return CLI_OK;
    int64_t outer = 1;
    for (int32_t k = 0; k < t->ndim - 3; k++)
        outer *= t->shape[k];
    const int64_t heads = t->shape[t->ndim - 3];
    const int64_t inner = t->shape[t->ndim - 2] * t->shape[t->ndim - 1];
    *buf = malloc((size_t)(outer * inner) * (additive ? sizeof(float) : 1));
    if (!*buf)
        return cli_fail("cannot allocate the mask of the heads' mean (%lld elements)",
                        (long long)(outer * inner));
    const int block = mk->bool_mask_polarity == MHA_MASK_BLOCK;
    for (int64_t a = 0; a < outer; a++)
        for (int64_t e = 0; e < inner; e++) {
            float best = -INFINITY;
            int any = 0, all = 1;
            for (int64_t hh = 0; hh < heads; hh++) {
                const int64_t i = (a * heads + hh) * inner + e;
                if (additive) {
                    const float x = ((const float *)t->data)[i];
                    best = x > best || isnan(x) ? x : best;
                } else {
                    const int nz = mask_nonzero(t, i);
                    any |= nz, all &= nz;
                }
            }
            if (additive)
                ((float *)*buf)[a * inner + e] = best;
            else /* attend: seen when some head attends; block: hidden when every head blocks */
                ((uint8_t *)*buf)[a * inner + e] = (uint8_t)(block ? all : any);
        }
    mha_mask_tensor *u = additive ? &out->additive_mask : &out->bool_mask;
    u->data = *buf;
    u->dtype = additive ? MHA_DTYPE_F32 : MHA_DTYPE_U8;
    u->shape[t->ndim - 3] = 1;
    return CLI_OK;
}

/* --plot: the map pooled to the plot's grid [B, h, R, C] (mean over each cell's elements and its
 * visible share) by the streamed statistics, with every mask exactly as the forward applies it
 * and no n x m array, so a 32k-token map plots in O(grid) memory. With --attn-average the
 * visible shares are those of the heads' mean (union_mask). */
static int
plot_statistics(const run_config *o, run_state *s, const mha_forward_args *fa, const run_dims *d) {
    mha_attention_stats req;
    memset(&req, 0, sizeof req);
    cli_plot_grid(d->n, d->m, &req.pool_rows, &req.pool_cols);
    const size_t count = (size_t)d->B * (size_t)d->h * (size_t)(req.pool_rows * req.pool_cols);
    s->plot_pooled = malloc(count * sizeof(float));
    s->plot_visible = malloc(count * sizeof(float));
    if (!s->plot_pooled || !s->plot_visible)
        return cli_fail("%s: cannot allocate the pooled map", o->opt[O_PLOT]);
    req.pooled = s->plot_pooled, req.pooled_visible = s->plot_visible;
    mha_error err;
    memset(&err, 0, sizeof err);
    if (mha_layer_attention_statistics(s->layer, fa, &req, &o->exec, &err) != MHA_STATUS_OK)
        return cli_lib_fail(o->opt[O_PLOT], &err);
    if (!o->average)
        return CLI_OK;
    mha_forward_args mean = *fa;
    void *buf;
    int rc = union_mask(&fa->mask, &mean.mask, &buf);
    if (rc || !buf)
        return rc;
    req.pooled = NULL; /* only the visible shares, overwritten with the mean's */
    const mha_status st = mha_layer_attention_statistics(s->layer, &mean, &req, &o->exec, &err);
    free(buf);
    return st == MHA_STATUS_OK ? CLI_OK : cli_lib_fail(o->opt[O_PLOT], &err);
}

int run_forward(const run_config *o, run_state *s) {
    const char *const *v = o->opt;
    run_dims d = {0, 0, 0, 0, 0, 0};
    mha_forward_args fa;
    memset(&fa, 0, sizeof fa);
    int rc = build_layer(o, s);
    if (!rc)
        rc = read_inputs(o, s, &d);
    if (!rc && o->decode)
        return run_decode(o, s, d.x_ndim, d.B, d.n);
    if (!rc)
        stage_done(o, s, "layer built, inputs read");
    if (!rc)
        rc = read_masks(o, s, &d, &fa);
    if (!rc)
        rc = alloc_outputs(o, s, &d);
    if (rc)
        return rc;
    stage_done(o, s, "masks and positions read, outputs allocated");

    /* Step 6: the forward. */
    mha_error err;
    memset(&err, 0, sizeof err);
    fa.batch = d.B;
    fa.q_len = d.n;
    fa.kv_len = d.m;
    fa.query = s->xf;
    fa.key = d.cross ? s->kf : NULL;
    fa.value = d.cross ? (s->vf ? s->vf : s->kf) : NULL;
    fa.q_positions = s->qpos;
    fa.k_positions = s->kpos;
    fa.dropout = o->dropout;
    fa.out = s->out;
    fa.probs = s->probs;
    fa.average_probs = o->average;
    fa.x_dtype = o->dtype;
    fa.out_dtype = o->dtype;
    mha_status st = mha_layer_forward(s->layer, &fa, &o->exec, &err);
    if (st == MHA_STATUS_UNSUPPORTED) /* the library's message as it is, after the flag */
        return cli_fail("--impl %s: %s", v[O_IMPL] ? v[O_IMPL] : "auto",
                        err.message[0] ? err.message : mha_status_string(st));
    if (st != MHA_STATUS_OK)
        return cli_lib_fail(NULL, &err);

    stage_done(o, s, "forward computed");
    if (v[O_PLOT]) {
        if ((rc = plot_statistics(o, s, &fa, &d)))
            return rc;
        stage_done(o, s, "plot's pooled map computed");
    }
    if (v[O_ATTN_STATS]) { /* before any output is written: a failure leaves no file */
        if ((rc = compute_stats(o, s, &fa, d.h, d.n, d.m)))
            return rc;
        stage_done(o, s, "attention statistics computed");
    }

    if (v[O_ATTN_STATS] && (rc = check_stats_finite(o, s, d.x_ndim, d.B, d.h, d.n, d.m)))
        return rc; /* nothing written */

    /* Step 7: the outputs, all or nothing: each to its temporary name, then all renamed. */
    mha__npy_set_begin();
    rc = write_outputs(o, s, d.x_ndim, d.B, d.n, d.m, d.h, mha_layer_config(s->layer)->out_dim);
    if (rc == CLI_OK && v[O_ATTN_STATS])
        rc = write_stats(o, s, d.x_ndim, d.B, d.h, d.n, d.m);
    rc = finish_outputs(rc);
    if (rc == CLI_OK)
        stage_done(o, s, "outputs written");
    return rc;
}
