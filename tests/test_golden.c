/* SPDX-License-Identifier: MIT */
/* test_golden.c: the library (no CLI) against the PyTorch goldens of tests/golden/.
 *
 * For every case listed in tests/golden/index.json: reads case.json ("config": the layer options,
 * files and masks in mha_config / mha_masking terms), loads the weights with
 * mha_layer_load_safetensors (plus the sink logits from sinks.npy through mha_layer_create), the
 * tensors with the .npy reader, runs mha_layer_forward with MHA_IMPL_REFERENCE and MHA_IMPL_AUTO
 * and checks max|y - ref| <= TOL_OUT_REL * max|ref| and max|p - p_ref| <= TOL_PROBS_ABS
 * (tests/common/tolerance.h) against the float64 expectations written by tools/gen_golden.py.
 * Prints the worst errors seen. Needs MHA_SOURCE_DIR (set by ctest) or runs from the repo root.
 */
#include "harness.h"
#include "mha.h"
#include "npy.h"
#include "tolerance.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PATH_SIZE 4096

/* ---------------------------------------------------------------------------------------------- */
/* Small helpers: files, JSON                                                                     */
/* ---------------------------------------------------------------------------------------------- */

/* out = a/b; 0 if it does not fit (or b is NULL). */
static int join_path(char *out, size_t size, const char *a, const char *b) {
    if (!b)
        return 0;
    int r = snprintf(out, size, "%s/%s", a, b);
    return r >= 0 && (size_t)r < size;
}

static char *read_text(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = NULL;
    if (fseek(f, 0, SEEK_END) == 0) {
        long len = ftell(f);
        if (len >= 0 && fseek(f, 0, SEEK_SET) == 0) {
            buf = malloc((size_t)len + 1);
            if (buf && fread(buf, 1, (size_t)len, f) == (size_t)len) {
                buf[len] = '\0';
            } else {
                free(buf);
                buf = NULL;
            }
        }
    }
    fclose(f);
    return buf;
}

static cJSON *read_json(const char *path) {
    char *text = read_text(path);
    if (!text)
        return NULL;
    cJSON *j = cJSON_Parse(text);
    free(text);
    return j;
}

/* The string member `key` of `obj`, or NULL when absent or JSON null. */
static const char *jstr(const cJSON *obj, const char *key) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsString(it) ? it->valuestring : NULL;
}

static double jnum(const cJSON *obj, const char *key) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsNumber(it) ? it->valuedouble : 0.0;
}

static int64_t jint(const cJSON *obj, const char *key) {
    return (int64_t)jnum(obj, key);
}

/* ---------------------------------------------------------------------------------------------- */
/* One case                                                                                       */
/* ---------------------------------------------------------------------------------------------- */

/* Everything a case allocates, released by case_free(). */
typedef struct golden_case {
    const char *name;
    char dir[PATH_SIZE];
    cJSON *json;
    mha_layer *layer;
    mha__npy x, key, value, qpos_raw, kpos_raw, offsets_raw, mask, amask, kpm, qseg, kvseg, sinks;
    mha__npy exp_out, exp_probs;
    float *xf, *keyf, *valuef, *sinksf;
    int64_t *qpos, *kpos, *offsets;
    float *out, *probs;
} golden_case;

static void case_free(golden_case *c) {
    mha_layer_destroy(c->layer);
    mha__npy *arrays[] = {&c->x,           &c->key,   &c->value,   &c->qpos_raw, &c->kpos_raw,
                          &c->offsets_raw, &c->mask,  &c->amask,   &c->kpm,      &c->qseg,
                          &c->kvseg,       &c->sinks, &c->exp_out, &c->exp_probs};
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++)
        mha__npy_free(arrays[i]);
    free(c->xf);
    free(c->keyf);
    free(c->valuef);
    free(c->sinksf);
    free(c->qpos);
    free(c->kpos);
    free(c->offsets);
    free(c->out);
    free(c->probs);
    cJSON_Delete(c->json);
}

/* Reads `file` (relative to the case directory) into *a; reports a failed check on error. */
static int load_npy(golden_case *c, const char *file, mha__npy *a) {
    char path[PATH_SIZE];
    mha_error err = {0};
    if (!join_path(path, sizeof path, c->dir, file)) {
        CHECK(0, "[%s] bad file name in case.json", c->name);
        return 0;
    }
    mha_status st = mha__npy_read(path, a, &err);
    CHECK(st == MHA_STATUS_OK, "[%s] reading %s: %s", c->name, file, err.message);
    return st == MHA_STATUS_OK;
}

static int load_f32(golden_case *c, const char *file, mha__npy *a, float **out) {
    mha_error err = {0};
    if (!load_npy(c, file, a))
        return 0;
    mha_status st = mha__npy_to_f32(a, file, out, &err);
    CHECK(st == MHA_STATUS_OK, "[%s] converting %s: %s", c->name, file, err.message);
    return st == MHA_STATUS_OK;
}

/* Integer file ([len], [rows, len] or [B]) to a new int64 array of B * len, rows broadcast. */
static int
load_ints(golden_case *c, const char *file, mha__npy *a, int64_t B, int64_t len, int64_t **out) {
    if (!load_npy(c, file, a))
        return 0;
    int ok = (a->dtype == MHA_DTYPE_I32 || a->dtype == MHA_DTYPE_I64) &&
             (a->count == len || a->count == B * len);
    CHECK(ok, "[%s] %s: unexpected dtype/shape (%lld elements)", c->name, file,
          (long long)a->count);
    if (!ok)
        return 0;
    int64_t *v = malloc((size_t)(B * len) * sizeof *v);
    if (!v)
        return 0;
    for (int64_t i = 0; i < B * len; i++) {
        int64_t k = i % a->count;
        v[i] = a->dtype == MHA_DTYPE_I32 ? (int64_t)((const int32_t *)a->data)[k]
                                         : ((const int64_t *)a->data)[k];
    }
    *out = v;
    return 1;
}

static void as_mask_tensor(const mha__npy *a, mha_mask_tensor *t) {
    memset(t, 0, sizeof *t);
    t->data = a->data;
    t->dtype = a->dtype;
    t->ndim = a->ndim;
    for (int32_t d = 0; d < a->ndim && d < MHA_MAX_MASK_DIMS; d++)
        t->shape[d] = a->shape[d];
}

static mha_rope_style parse_style(const char *s) {
    if (s && strcmp(s, "INTERLEAVED") == 0)
        return MHA_ROPE_INTERLEAVED;
    if (s && strcmp(s, "HALF") == 0)
        return MHA_ROPE_HALF;
    return MHA_ROPE_NONE;
}

static mha_rope_scaling_type parse_scaling(const char *s) {
    static const struct {
        const char *name;
        mha_rope_scaling_type type;
    } table[] = {{"LINEAR", MHA_ROPE_SCALING_LINEAR},
                 {"NTK", MHA_ROPE_SCALING_NTK},
                 {"LLAMA3", MHA_ROPE_SCALING_LLAMA3},
                 {"YARN", MHA_ROPE_SCALING_YARN}};
    for (size_t i = 0; s && i < sizeof table / sizeof table[0]; i++)
        if (strcmp(s, table[i].name) == 0)
            return table[i].type;
    return MHA_ROPE_SCALING_NONE;
}

static mha_alignment parse_alignment(const char *s) {
    if (s && strcmp(s, "TOP_LEFT") == 0)
        return MHA_ALIGN_TOP_LEFT;
    if (s && strcmp(s, "EXPLICIT") == 0)
        return MHA_ALIGN_EXPLICIT;
    return MHA_ALIGN_BOTTOM_RIGHT;
}

/* Worst errors over all cases, per implementation (0 = REFERENCE, 1 = AUTO). */
static double g_worst_out[2], g_worst_probs[2];
static const char *g_worst_out_case[2], *g_worst_probs_case[2];
static int g_cases_ok;

/* Builds the layer of case `c` (weights file, then sinks if any). */
static int make_layer(golden_case *c, const cJSON *cfg) {
    mha_config config = {0};
    config.num_heads = jint(cfg, "num_heads");
    config.num_kv_heads = jint(cfg, "num_kv_heads");
    config.scale = jnum(cfg, "scale");
    config.softcap = jnum(cfg, "softcap");
    config.alibi = (int32_t)jint(cfg, "alibi");
    const cJSON *rope = cJSON_GetObjectItemCaseSensitive(cfg, "rope");
    config.rope.style = parse_style(jstr(rope, "style"));
    config.rope.theta = jnum(rope, "theta");
    config.rope.rotary_dim = jint(rope, "rotary_dim");
    config.rope.scaling = parse_scaling(jstr(rope, "scaling"));
    config.rope.factor = jnum(rope, "factor");
    config.rope.original_max_position = jnum(rope, "original_max_position");
    config.rope.low_freq_factor = jnum(rope, "low_freq_factor");
    config.rope.high_freq_factor = jnum(rope, "high_freq_factor");
    config.rope.beta_fast = jnum(rope, "beta_fast");
    config.rope.beta_slow = jnum(rope, "beta_slow");
    config.rope.attention_factor = jnum(rope, "attention_factor");

    mha_name_map names = {0};
    const cJSON *jn = cJSON_GetObjectItemCaseSensitive(cfg, "names");
    const mha_name_map *names_p = NULL;
    if (cJSON_IsObject(jn)) {
        names.q = jstr(jn, "q");
        names.k = jstr(jn, "k");
        names.v = jstr(jn, "v");
        names.o = jstr(jn, "o");
        names_p = &names;
    }
    char path[PATH_SIZE];
    mha_error err = {0};
    if (!join_path(path, sizeof path, c->dir, jstr(cfg, "weights"))) {
        CHECK(0, "[%s] bad weights file name in case.json", c->name);
        return 0;
    }
    mha_status st = mha_layer_load_safetensors(path, jstr(cfg, "prefix"), names_p, &config, NULL,
                                               &c->layer, &err);
    CHECK(st == MHA_STATUS_OK, "[%s] mha_layer_load_safetensors: %s", c->name, err.message);
    if (st != MHA_STATUS_OK)
        return 0;

    const char *sinks_file = jstr(cfg, "sinks");
    if (sinks_file) {
        /* The sink logits come from their own file (as with `mha run --sinks`): a new layer with
         * the loaded weights and options plus the sinks. */
        if (!load_f32(c, sinks_file, &c->sinks, &c->sinksf))
            return 0;
        CHECK(c->sinks.count == config.num_heads, "[%s] sinks.npy has %lld values", c->name,
              (long long)c->sinks.count);
        mha_config with_sinks = *mha_layer_config(c->layer);
        mha_weights w = *mha_layer_weights(c->layer);
        with_sinks.sinks = 1;
        w.sinks = c->sinksf;
        mha_layer *l2 = NULL;
        st = mha_layer_create(&with_sinks, &w, MHA_WEIGHTS_COPY, NULL, &l2, &err);
        CHECK(st == MHA_STATUS_OK, "[%s] mha_layer_create with sinks: %s", c->name, err.message);
        mha_layer_destroy(c->layer);
        c->layer = l2;
        if (st != MHA_STATUS_OK)
            return 0;
    }
    return 1;
}

static void run_case(const char *golden_dir, const char *name) {
    golden_case c;
    memset(&c, 0, sizeof c);
    c.name = name;
    char path[PATH_SIZE];
    if (!join_path(c.dir, sizeof c.dir, golden_dir, name) ||
        !join_path(path, sizeof path, c.dir, "case.json")) {
        CHECK(0, "[%s] path too long", name);
        return;
    }
    c.json = read_json(path);
    CHECK(c.json != NULL, "[%s] cannot read or parse %s", name, path);
    if (!c.json)
        return;
    const cJSON *cfg = cJSON_GetObjectItemCaseSensitive(c.json, "config");
    const cJSON *sizes = cJSON_GetObjectItemCaseSensitive(c.json, "sizes");
    const cJSON *jm = cJSON_GetObjectItemCaseSensitive(cfg, "masking");
    const int64_t B = jint(sizes, "batch"), n = jint(sizes, "q_len"), m = jint(sizes, "kv_len");
    const int64_t h = jint(sizes, "num_heads");
    int ok = make_layer(&c, cfg);

    /* Inputs. */
    const char *key_file = jstr(cfg, "key"), *value_file = jstr(cfg, "value");
    ok = ok && load_f32(&c, jstr(cfg, "input"), &c.x, &c.xf);
    if (ok && key_file)
        ok = load_f32(&c, key_file, &c.key, &c.keyf) &&
             load_f32(&c, value_file, &c.value, &c.valuef);
    const mha_config *lc = ok ? mha_layer_config(c.layer) : NULL;
    if (ok) {
        CHECK(c.x.count == B * n * lc->q_dim, "[%s] x.npy size %lld != B*n*q_dim", name,
              (long long)c.x.count);
        CHECK(lc->num_heads == h && lc->out_dim == jint(sizes, "out_dim") &&
                  lc->head_dim == jint(sizes, "head_dim") &&
                  lc->v_head_dim == jint(sizes, "v_head_dim") &&
                  lc->num_kv_heads == jint(sizes, "num_kv_heads"),
              "[%s] loaded layer sizes differ from case.json sizes", name);
        ok = c.x.count == B * n * lc->q_dim;
    }
    const char *f;
    if (ok && (f = jstr(cfg, "q_positions")))
        ok = load_ints(&c, f, &c.qpos_raw, B, n, &c.qpos);
    if (ok && (f = jstr(cfg, "k_positions")))
        ok = load_ints(&c, f, &c.kpos_raw, B, m, &c.kpos);

    /* Masking. */
    mha_masking mk;
    memset(&mk, 0, sizeof mk);
    mk.causal = (int32_t)jint(jm, "causal");
    mk.alignment = parse_alignment(jstr(jm, "alignment"));
    mk.use_window = (int32_t)jint(jm, "use_window");
    mk.window_left = jint(jm, "window_left");
    mk.window_right = jint(jm, "window_right");
    mk.bool_mask_polarity =
        strcmp(jstr(jm, "bool_mask_polarity") ? jstr(jm, "bool_mask_polarity") : "", "BLOCK") == 0
            ? MHA_MASK_BLOCK
            : MHA_MASK_ATTEND;
    if (ok && (f = jstr(jm, "align_offsets"))) {
        ok = load_ints(&c, f, &c.offsets_raw, 1, B, &c.offsets);
        mk.align_offsets = c.offsets;
    }
    if (ok && (f = jstr(jm, "bool_mask"))) {
        ok = load_npy(&c, f, &c.mask);
        as_mask_tensor(&c.mask, &mk.bool_mask);
    }
    if (ok && (f = jstr(jm, "additive_mask"))) {
        ok = load_npy(&c, f, &c.amask);
        CHECK(c.amask.dtype == MHA_DTYPE_F32, "[%s] additive mask is not float32", name);
        as_mask_tensor(&c.amask, &mk.additive_mask);
    }
    if (ok && (f = jstr(jm, "key_padding"))) {
        ok = load_npy(&c, f, &c.kpm);
        as_mask_tensor(&c.kpm, &mk.key_padding);
    }
    if (ok && (f = jstr(jm, "q_segment_ids"))) {
        ok = load_npy(&c, f, &c.qseg) && load_npy(&c, jstr(jm, "kv_segment_ids"), &c.kvseg);
        ok = ok && c.qseg.dtype == MHA_DTYPE_I32 && c.kvseg.dtype == MHA_DTYPE_I32 &&
             c.qseg.count == B * n && c.kvseg.count == B * m;
        CHECK(ok, "[%s] segment id files are not int32 [B, n] / [B, m]", name);
        mk.q_segment_ids = c.qseg.data;
        mk.kv_segment_ids = c.kvseg.data;
    }

    /* Expectations. */
    const int want_probs = (int)jint(cfg, "probs"), average = (int)jint(cfg, "average_probs");
    ok = ok && load_npy(&c, jstr(c.json, "expected_out"), &c.exp_out);
    if (ok && want_probs)
        ok = load_npy(&c, jstr(c.json, "expected_probs"), &c.exp_probs);
    if (!ok) {
        case_free(&c);
        return;
    }
    const int64_t out_count = B * n * lc->out_dim;
    const int64_t probs_count = average ? B * n * m : B * h * n * m;
    CHECK(c.exp_out.dtype == MHA_DTYPE_F64 && c.exp_out.count == out_count,
          "[%s] expected_out.npy: %lld elements, want %lld float64", name,
          (long long)c.exp_out.count, (long long)out_count);
    if (want_probs)
        CHECK(c.exp_probs.dtype == MHA_DTYPE_F64 && c.exp_probs.count == probs_count,
              "[%s] expected_probs.npy: %lld elements, want %lld float64", name,
              (long long)c.exp_probs.count, (long long)probs_count);
    if (c.exp_out.count != out_count || (want_probs && c.exp_probs.count != probs_count)) {
        case_free(&c);
        return;
    }
    c.out = malloc((size_t)out_count * sizeof(float));
    c.probs = want_probs ? malloc((size_t)probs_count * sizeof(float)) : NULL;
    if (!c.out || (want_probs && !c.probs)) {
        CHECK(0, "[%s] out of memory", name);
        case_free(&c);
        return;
    }

    const double *ref = c.exp_out.data;
    const double *pref = want_probs ? c.exp_probs.data : NULL;
    const double scale = test_max_abs(ref, out_count);
    const mha_impl impls[2] = {MHA_IMPL_REFERENCE, MHA_IMPL_AUTO};
    const char *impl_names[2] = {"reference", "auto"};
    int all_ok = 1;
    for (int k = 0; k < 2; k++) {
        for (int64_t i = 0; i < out_count; i++)
            c.out[i] = NAN; /* an element the library skips fails the check */
        for (int64_t i = 0; want_probs && i < probs_count; i++)
            c.probs[i] = NAN;
        mha_forward_args args;
        memset(&args, 0, sizeof args);
        args.batch = B;
        args.q_len = n;
        args.kv_len = m;
        args.query = c.xf;
        args.key = c.keyf;
        args.value = c.valuef;
        args.q_positions = c.qpos;
        args.k_positions = c.kpos;
        args.mask = mk;
        args.out = c.out;
        args.probs = c.probs;
        args.average_probs = average;
        mha_exec exec;
        memset(&exec, 0, sizeof exec);
        exec.impl = impls[k];
        mha_error err = {0};
        mha_status st = mha_layer_forward(c.layer, &args, &exec, &err);
        CHECK(st == MHA_STATUS_OK, "[%s] impl %s: mha_layer_forward: %s: %s", name, impl_names[k],
              mha_status_string(st), err.message);
        if (st != MHA_STATUS_OK) {
            all_ok = 0;
            continue;
        }
        double e = test_max_abs_diff(c.out, ref, out_count);
        double rel = scale > 0.0 ? e / scale : e;
        int good = e <= TOL_OUT_REL * scale;
        CHECK(good, "[%s] impl %s: max|y-ref| = %.3e > %g * max|ref| (%.3e), rel %.3e", name,
              impl_names[k], e, TOL_OUT_REL, scale, rel);
        all_ok &= good;
        if (rel > g_worst_out[k] || !g_worst_out_case[k]) {
            g_worst_out[k] = rel;
            g_worst_out_case[k] = name;
        }
        if (want_probs) {
            double pe = test_max_abs_diff(c.probs, pref, probs_count);
            good = pe <= TOL_PROBS_ABS;
            CHECK(good, "[%s] impl %s: max|p-ref| = %.3e > %g", name, impl_names[k], pe,
                  TOL_PROBS_ABS);
            all_ok &= good;
            if (pe > g_worst_probs[k] || !g_worst_probs_case[k]) {
                g_worst_probs[k] = pe;
                g_worst_probs_case[k] = name;
            }
        }
    }
    g_cases_ok += all_ok;
    case_free(&c);
}

int main(void) {
    char *golden_dir = test_source_path("tests/golden");
    char path[PATH_SIZE];
    cJSON *index = NULL;
    if (join_path(path, sizeof path, golden_dir ? golden_dir : ".", "index.json"))
        index = read_json(path);
    CHECK(index != NULL, "cannot read %s (set MHA_SOURCE_DIR to the repository root)", path);
    const cJSON *cases = cJSON_GetObjectItemCaseSensitive(index, "cases");
    int count = cJSON_GetArraySize(cases);
    CHECK(count >= 60, "only %d golden cases", count);
    /* Case names stay valid until the index is deleted: the worst-case pointers use them. */
    const cJSON *it;
    cJSON_ArrayForEach(it, cases) {
        if (cJSON_IsString(it))
            run_case(golden_dir, it->valuestring);
    }
    printf("golden: %d of %d cases within tolerance (TOL_OUT_REL %g, TOL_PROBS_ABS %g)\n",
           g_cases_ok, count, TOL_OUT_REL, TOL_PROBS_ABS);
    const char *impl_names[2] = {"reference", "auto"};
    for (int k = 0; k < 2; k++)
        printf("  impl %-9s: worst out rel error %.3e (%s), worst probs abs error %.3e (%s)\n",
               impl_names[k], g_worst_out[k], g_worst_out_case[k] ? g_worst_out_case[k] : "-",
               g_worst_probs[k], g_worst_probs_case[k] ? g_worst_probs_case[k] : "-");
    cJSON_Delete(index);
    free(golden_dir);
    return test_finish();
}
