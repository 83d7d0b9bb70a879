/* SPDX-License-Identifier: MIT */
/* test_grad_golden.c: the layer backward against the PyTorch float64 autograd goldens of
 * tests/golden_grad/ (tools/gen_grad_golden.py), for every forward golden case of tests/golden/.
 *
 * Per case: the layer and inputs are loaded exactly as test_golden.c does (case.json "config":
 * safetensors weights, sinks.npy, masks, positions), then mha_layer_forward_train +
 * mha_layer_backward run with MHA_IMPL_REFERENCE and MHA_IMPL_AUTO on the stored dy, and every
 * gradient (d_query, d_key, d_value, dw_*, db_*, d_sinks) is compared:
 *     max|g - g_torch| <= TOL_GRAD_REL * scale,  scale = max|g_torch|
 * (for a bias, max(max|db|, max|dW|) of its projection: db_k is zero in exact arithmetic, since
 * b_k shifts all scores of a row equally, so only rounding of dW's size is left). Prints the
 * worst relative errors per implementation.
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
#define N_GRADS   12

static const char *GRAD_NAMES[N_GRADS] = {"d_query", "d_key", "d_value", "dw_q", "dw_k", "dw_v",
                                          "dw_o",    "db_q",  "db_k",    "db_v", "db_o", "d_sinks"};

static char *read_text(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = NULL;
    if (fseek(f, 0, SEEK_END) == 0) {
        long len = ftell(f);
        if (len >= 0 && fseek(f, 0, SEEK_SET) == 0 && (buf = malloc((size_t)len + 1))) {
            if (fread(buf, 1, (size_t)len, f) == (size_t)len)
                buf[len] = '\0';
            else {
                free(buf);
                buf = NULL;
            }
        }
    }
    fclose(f);
    return buf;
}

static cJSON *read_json(const char *path) {
    char *t = read_text(path);
    cJSON *j = t ? cJSON_Parse(t) : NULL;
    free(t);
    return j;
}

static const char *jstr(const cJSON *o, const char *k) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(it) ? it->valuestring : NULL;
}

static double jnum(const cJSON *o, const char *k) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(it) ? it->valuedouble : 0.0;
}

/* Everything one case allocates. */
typedef struct gcase {
    const char *name;
    char dir[PATH_SIZE / 2], gdir[PATH_SIZE / 2];
    cJSON *json, *gjson;
    mha_layer *layer;
    mha__npy arrays[32];
    int n_arrays;
    float *f32[8];
    int n_f32;
    int64_t *ints[4];
    int n_ints;
} gcase;

static void gcase_free(gcase *c) {
    mha_layer_destroy(c->layer);
    for (int i = 0; i < c->n_arrays; i++)
        mha__npy_free(&c->arrays[i]);
    for (int i = 0; i < c->n_f32; i++)
        free(c->f32[i]);
    for (int i = 0; i < c->n_ints; i++)
        free(c->ints[i]);
    cJSON_Delete(c->json);
    cJSON_Delete(c->gjson);
}

/* Reads dir/file; NULL (and a failed check) on error. */
static mha__npy *npy(gcase *c, const char *dir, const char *file) {
    char path[PATH_SIZE];
    mha_error err = {0};
    const int len = file ? snprintf(path, sizeof path, "%s/%s", dir, file) : -1;
    if (c->n_arrays >= 32 || len < 0 || (size_t)len >= sizeof path) {
        CHECK(0, "[%s] bad file %s", c->name, file ? file : "(null)");
        return NULL;
    }
    mha__npy *a = &c->arrays[c->n_arrays];
    memset(a, 0, sizeof *a);
    mha_status st = mha__npy_read(path, a, &err);
    CHECK(st == MHA_STATUS_OK, "[%s] %s: %s", c->name, file, err.message);
    if (st)
        return NULL;
    c->n_arrays++;
    return a;
}

static float *f32(gcase *c, const char *dir, const char *file) {
    mha__npy *a = npy(c, dir, file);
    float *out = NULL;
    mha_error err = {0};
    if (a && c->n_f32 < 8 && mha__npy_to_f32(a, file, &out, &err) == MHA_STATUS_OK) {
        c->f32[c->n_f32++] = out;
        return out;
    }
    CHECK(0, "[%s] %s: cannot convert to float32", c->name, file);
    return NULL;
}

/* int32/int64 file broadcast to B * len int64 values. */
static int64_t *ints(gcase *c, const char *file, int64_t B, int64_t len) {
    mha__npy *a = npy(c, c->dir, file);
    if (!a || (a->count != len && a->count != B * len) || c->n_ints >= 4)
        return NULL;
    int64_t *v = malloc(sizeof(int64_t) * (size_t)(B * len));
    for (int64_t i = 0; i < B * len; i++) {
        const int64_t k = i % a->count;
        v[i] = a->dtype == MHA_DTYPE_I32 ? ((const int32_t *)a->data)[k]
                                         : ((const int64_t *)a->data)[k];
    }
    c->ints[c->n_ints++] = v;
    return v;
}

static void as_mask(const mha__npy *a, mha_mask_tensor *t) {
    memset(t, 0, sizeof *t);
    t->data = a->data;
    t->dtype = a->dtype;
    t->ndim = a->ndim;
    for (int32_t d = 0; d < a->ndim && d < MHA_MAX_MASK_DIMS; d++)
        t->shape[d] = a->shape[d];
}

static int streq(const char *a, const char *b) {
    return a && strcmp(a, b) == 0;
}

static int make_layer(gcase *c, const cJSON *cfg) {
    mha_config config = {0};
    config.num_heads = (int64_t)jnum(cfg, "num_heads");
    config.num_kv_heads = (int64_t)jnum(cfg, "num_kv_heads");
    config.scale = jnum(cfg, "scale");
    config.softcap = jnum(cfg, "softcap");
    config.alibi = (int32_t)jnum(cfg, "alibi");
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(cfg, "rope");
    const char *style = jstr(r, "style"), *sc = jstr(r, "scaling");
    config.rope.style = streq(style, "INTERLEAVED") ? MHA_ROPE_INTERLEAVED
                        : streq(style, "HALF")      ? MHA_ROPE_HALF
                                                    : MHA_ROPE_NONE;
    config.rope.scaling = streq(sc, "LINEAR")   ? MHA_ROPE_SCALING_LINEAR
                          : streq(sc, "NTK")    ? MHA_ROPE_SCALING_NTK
                          : streq(sc, "LLAMA3") ? MHA_ROPE_SCALING_LLAMA3
                          : streq(sc, "YARN")   ? MHA_ROPE_SCALING_YARN
                                                : MHA_ROPE_SCALING_NONE;
    config.rope.theta = jnum(r, "theta");
    config.rope.rotary_dim = (int64_t)jnum(r, "rotary_dim");
    config.rope.factor = jnum(r, "factor");
    config.rope.original_max_position = jnum(r, "original_max_position");
    config.rope.low_freq_factor = jnum(r, "low_freq_factor");
    config.rope.high_freq_factor = jnum(r, "high_freq_factor");
    config.rope.beta_fast = jnum(r, "beta_fast");
    config.rope.beta_slow = jnum(r, "beta_slow");
    config.rope.attention_factor = jnum(r, "attention_factor");
    mha_name_map names = {0};
    const cJSON *jn = cJSON_GetObjectItemCaseSensitive(cfg, "names");
    if (cJSON_IsObject(jn)) {
        names.q = jstr(jn, "q"), names.k = jstr(jn, "k"), names.v = jstr(jn, "v");
        names.o = jstr(jn, "o");
    }
    char path[PATH_SIZE];
    snprintf(path, sizeof path, "%s/%s", c->dir, jstr(cfg, "weights"));
    mha_error err = {0};
    mha_status st =
        mha_layer_load_safetensors(path, jstr(cfg, "prefix"), cJSON_IsObject(jn) ? &names : NULL,
                                   &config, NULL, &c->layer, &err);
    CHECK(st == MHA_STATUS_OK, "[%s] load: %s", c->name, err.message);
    if (st)
        return 0;
    const char *sinks_file = jstr(cfg, "sinks");
    if (sinks_file) {
        float *sinks = f32(c, c->dir, sinks_file);
        if (!sinks)
            return 0;
        mha_config with = *mha_layer_config(c->layer);
        mha_weights w = *mha_layer_weights(c->layer);
        with.sinks = 1;
        w.sinks = sinks;
        mha_layer *l2 = NULL;
        st = mha_layer_create(&with, &w, MHA_WEIGHTS_COPY, NULL, &l2, &err);
        CHECK(st == MHA_STATUS_OK, "[%s] sinks: %s", c->name, err.message);
        mha_layer_destroy(c->layer);
        c->layer = l2;
        return st == MHA_STATUS_OK;
    }
    return 1;
}

static double g_worst[2];
static const char *g_worst_case[2], *g_worst_grad[2];
static int g_cases_ok;

static void run_case(const char *golden, const char *grad_root, const char *name) {
    gcase c;
    memset(&c, 0, sizeof c);
    c.name = name;
    char path[PATH_SIZE];
    if (strlen(golden) + strlen(grad_root) + 2 * strlen(name) + 64 > PATH_SIZE / 2) {
        CHECK(0, "[%s] path too long", name);
        return;
    }
    snprintf(c.dir, sizeof c.dir, "%s/%s", golden, name);
    snprintf(c.gdir, sizeof c.gdir, "%s/%s", grad_root, name);
    snprintf(path, sizeof path, "%s/case.json", c.dir);
    c.json = read_json(path);
    snprintf(path, sizeof path, "%s/grad.json", c.gdir);
    c.gjson = read_json(path);
    CHECK(c.json && c.gjson, "[%s] cannot read case.json / grad.json", name);
    if (!c.json || !c.gjson) {
        gcase_free(&c);
        return;
    }
    const cJSON *cfg = cJSON_GetObjectItemCaseSensitive(c.json, "config");
    const cJSON *sizes = cJSON_GetObjectItemCaseSensitive(c.json, "sizes");
    const cJSON *jm = cJSON_GetObjectItemCaseSensitive(cfg, "masking");
    const int64_t B = (int64_t)jnum(sizes, "batch"), n = (int64_t)jnum(sizes, "q_len");
    const int64_t m = (int64_t)jnum(sizes, "kv_len");
    int ok = make_layer(&c, cfg);
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.batch = B, a.q_len = n, a.kv_len = m;
    const char *f;
    if (ok)
        ok = (a.query = f32(&c, c.dir, jstr(cfg, "input"))) != NULL;
    if (ok && (f = jstr(cfg, "key")))
        ok = (a.key = f32(&c, c.dir, f)) && (a.value = f32(&c, c.dir, jstr(cfg, "value")));
    if (ok && (f = jstr(cfg, "q_positions")))
        ok = (a.q_positions = ints(&c, f, B, n)) != NULL;
    if (ok && (f = jstr(cfg, "k_positions")))
        ok = (a.k_positions = ints(&c, f, B, m)) != NULL;
    mha_masking *mk = &a.mask;
    mk->causal = (int32_t)jnum(jm, "causal");
    const char *al = jstr(jm, "alignment");
    mk->alignment = streq(al, "TOP_LEFT")   ? MHA_ALIGN_TOP_LEFT
                    : streq(al, "EXPLICIT") ? MHA_ALIGN_EXPLICIT
                                            : MHA_ALIGN_BOTTOM_RIGHT;
    mk->use_window = (int32_t)jnum(jm, "use_window");
    mk->window_left = (int64_t)jnum(jm, "window_left");
    mk->window_right = (int64_t)jnum(jm, "window_right");
    mk->bool_mask_polarity =
        streq(jstr(jm, "bool_mask_polarity"), "BLOCK") ? MHA_MASK_BLOCK : MHA_MASK_ATTEND;
    mha__npy *t;
    if (ok && (f = jstr(jm, "align_offsets")))
        ok = (mk->align_offsets = ints(&c, f, 1, B)) != NULL;
    if (ok && (f = jstr(jm, "bool_mask")) && (ok = (t = npy(&c, c.dir, f)) != NULL))
        as_mask(t, &mk->bool_mask);
    if (ok && (f = jstr(jm, "additive_mask")) && (ok = (t = npy(&c, c.dir, f)) != NULL))
        as_mask(t, &mk->additive_mask);
    if (ok && (f = jstr(jm, "key_padding")) && (ok = (t = npy(&c, c.dir, f)) != NULL))
        as_mask(t, &mk->key_padding);
    if (ok && (f = jstr(jm, "q_segment_ids"))) {
        mha__npy *qs = npy(&c, c.dir, f), *ks = npy(&c, c.dir, jstr(jm, "kv_segment_ids"));
        ok = qs && ks;
        if (ok)
            mk->q_segment_ids = qs->data, mk->kv_segment_ids = ks->data;
    }
    float *dy = ok ? f32(&c, c.gdir, "dy.npy") : NULL;
    if (!ok || !dy) {
        gcase_free(&c);
        return;
    }
    const mha_config *lc = mha_layer_config(c.layer);
    const int self = a.key == NULL;
    const int64_t mm = self ? n : m;
    const int64_t counts[N_GRADS] = {B * n * lc->q_dim,
                                     self ? 0 : B * mm * lc->k_dim,
                                     self ? 0 : B * mm * lc->v_dim,
                                     lc->num_heads * lc->head_dim * lc->q_dim,
                                     lc->num_kv_heads * lc->head_dim * lc->k_dim,
                                     lc->num_kv_heads * lc->v_head_dim * lc->v_dim,
                                     lc->out_dim * lc->num_heads * lc->v_head_dim,
                                     lc->bias_q ? lc->num_heads * lc->head_dim : 0,
                                     lc->bias_k ? lc->num_kv_heads * lc->head_dim : 0,
                                     lc->bias_v ? lc->num_kv_heads * lc->v_head_dim : 0,
                                     lc->bias_o ? lc->out_dim : 0,
                                     lc->sinks ? lc->num_heads : 0};
    const double *expect[N_GRADS] = {0};
    const cJSON *gfiles = cJSON_GetObjectItemCaseSensitive(c.gjson, "grads");
    for (int k = 0; k < N_GRADS; k++) {
        if (!counts[k])
            continue;
        mha__npy *e = npy(&c, c.gdir, jstr(gfiles, GRAD_NAMES[k]));
        ok &= e && e->dtype == MHA_DTYPE_F64 && e->count == counts[k];
        CHECK(ok, "[%s] %s: missing or wrong size", name, GRAD_NAMES[k]);
        if (!ok)
            break;
        expect[k] = e->data;
    }
    float *res[N_GRADS] = {0};
    for (int k = 0; ok && k < N_GRADS; k++)
        if (counts[k])
            res[k] = malloc(sizeof(float) * (size_t)counts[k]);
    float *y = malloc(sizeof(float) * (size_t)(B * n * lc->out_dim));
    a.out = y;
    const mha_impl impls[2] = {MHA_IMPL_REFERENCE, MHA_IMPL_AUTO};
    int all_ok = ok;
    for (int w = 0; ok && w < 2; w++) {
        for (int k = 0; k < N_GRADS; k++)
            for (int64_t e = 0; e < counts[k]; e++)
                res[k][e] = NAN;
        mha_exec ex = {impls[w], 0, NULL, 0, NULL, NULL};
        mha_error err = {0};
        mha_train_state *st = NULL;
        mha_status rc = mha_layer_forward_train(c.layer, &a, &ex, &st, &err);
        CHECK(rc == MHA_STATUS_OK, "[%s] forward_train: %s", name, err.message);
        mha_layer_grads g = {res[0], res[1], res[2],  res[3],  res[4], res[5], res[6], res[7],
                             res[8], res[9], res[10], res[11], 0,      NULL,   NULL,   NULL};
        if (!rc) {
            rc = mha_layer_backward(c.layer, st, dy, &g, &ex, &err);
            CHECK(rc == MHA_STATUS_OK, "[%s] backward: %s", name, err.message);
        }
        mha_train_state_destroy(st);
        if (rc) {
            all_ok = 0;
            continue;
        }
        for (int k = 0; k < N_GRADS; k++) {
            if (!counts[k])
                continue;
            double scale = test_max_abs(expect[k], counts[k]);
            if (k >= 7 && k <= 10)
                scale = fmax(scale, test_max_abs(expect[k - 4], counts[k - 4]));
            const double e = test_max_abs_diff(res[k], expect[k], counts[k]);
            const double rel = e / (scale > 0.0 ? scale : 1.0);
            const int good = rel <= TOL_GRAD_REL;
            CHECK(good, "[%s] impl %s %s: max err %.3e, rel %.3e > %g (scale %.3e)", name,
                  w ? "auto" : "reference", GRAD_NAMES[k], e, rel, TOL_GRAD_REL, scale);
            all_ok &= good;
            if (rel > g_worst[w] || !g_worst_case[w]) {
                g_worst[w] = rel;
                g_worst_case[w] = name;
                g_worst_grad[w] = GRAD_NAMES[k];
            }
        }
    }
    g_cases_ok += all_ok;
    for (int k = 0; k < N_GRADS; k++)
        free(res[k]);
    free(y);
    gcase_free(&c);
}

int main(void) {
    char *golden = test_source_path("tests/golden");
    char *grads = test_source_path("tests/golden_grad");
    char path[PATH_SIZE];
    snprintf(path, sizeof path, "%s/index.json", grads);
    cJSON *index = read_json(path);
    CHECK(index != NULL, "cannot read %s (set MHA_SOURCE_DIR to the repository root)", path);
    const cJSON *cases = cJSON_GetObjectItemCaseSensitive(index, "cases"), *it;
    const int count = cJSON_GetArraySize(cases);
    CHECK(count >= 60, "only %d gradient golden cases", count);
    cJSON_ArrayForEach(it, cases) {
        if (cJSON_IsString(it))
            run_case(golden, grads, it->valuestring);
    }
    printf("gradient goldens: %d of %d cases within TOL_GRAD_REL %g\n", g_cases_ok, count,
           TOL_GRAD_REL);
    const char *impl_names[2] = {"reference", "auto"};
    for (int w = 0; w < 2; w++)
        printf("  impl %-9s: worst rel error %.3e (%s, %s)\n", impl_names[w], g_worst[w],
               g_worst_case[w] ? g_worst_case[w] : "-", g_worst_grad[w] ? g_worst_grad[w] : "-");
    cJSON_Delete(index);
    free(golden);
    free(grads);
    return test_finish();
}
