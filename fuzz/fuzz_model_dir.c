/* SPDX-License-Identifier: MIT */
/* fuzz_model_dir.c: libFuzzer harness for Hugging Face model directories (src/io/hf_config.c).
 *
 * Input: config.json, then optionally a NUL byte and model.safetensors.index.json (absent when
 * empty), then optionally a NUL byte and selector bytes (fuzz_reader: zeros when missing). Each
 * run writes them into a fresh private directory (mkdtemp under $TMPDIR, removed at the end) with
 * the weights the harness generates:
 *   1. a probe model.safetensors holding every architecture's first projection for layers 0 and 1
 *      under one of the two tensor prefix schemes (shape [1, 1]), so that find_prefix succeeds;
 *   2. mha_hf_layer_info_read(dir, 0); when it succeeds with small sizes, the layer's tensors
 *      (layers 0 and 1, realistic names for the model_type, the shapes the info implies, values
 *      k/512 with |k| < 256, exact in every dtype) are written in the dtype the selector picks,
 *      into model.safetensors or the shards the index's weight_map names;
 *   3. for layers 0 and 1: mha_hf_layer_info_read, mha_hf_layer_load (the info's config, or with
 *      the CLI's --heads/--kv-heads overrides), and a forward on a few finite tokens.
 * Invariants: no crash, leak, out-of-bounds access or hang (ASan/UBSan, libFuzzer); errors fill
 * mha_error consistently and leave *out NULL; an info's sizes and scalars are valid and finite; a
 * tensor whose shape the harness made wrong is refused; a loaded layer's weights are the file's
 * values, placed where docs/MODELS.md says (separate and fused layouts except Falcon's, whose
 * order depends on fields the harness does not read; Qwen3-Next's gated q_proj; QK-norm weights)
 * and finite; the forward of a loaded layer
 * with a sane scale/soft-cap (the float32 range that check/layer.c is being taught by issue 28)
 * returns finite outputs when it returns OK.
 */
#define _POSIX_C_SOURCE 200809L

#include "fuzz_common.h"

#include <cjson/cJSON.h>

#include <dirent.h>
#include <float.h>
#include <math.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_TENSORS 24
#define MAX_FILES   4

/* The architectures as docs/MODELS.md lists them: tensor prefixes and stems. Every model_type of
 * src/io/hf_config.c's ARCHS table must be here and have a seed (ctest fuzz_archs). */
typedef enum layout { L_QKVO, L_BERT, L_PHI3, L_GPT2, L_NEOX, L_FALCON } layout;
typedef struct arch {
    const char *type;
    layout lay;
    const char *pre[2][2];
} arch;
#define LLAMA_PRE                                                                                  \
    {                                                                                              \
        {"model.layers.", ".self_attn."}, {                                                        \
            "layers.", ".self_attn."                                                               \
        }                                                                                          \
    }
static const arch ARCHS[] = {
    {"llama", L_QKVO, LLAMA_PRE},
    {"mistral", L_QKVO, LLAMA_PRE},
    {"mixtral", L_QKVO, LLAMA_PRE},
    {"qwen2", L_QKVO, LLAMA_PRE},
    {"qwen3", L_QKVO, LLAMA_PRE},
    {"qwen3_moe", L_QKVO, LLAMA_PRE},
    {"gemma3_text", L_QKVO, LLAMA_PRE},
    {"qwen3_next", L_QKVO, LLAMA_PRE},
    {"olmo2", L_QKVO, LLAMA_PRE},
    {"smollm3", L_QKVO, LLAMA_PRE},
    {"cohere2", L_QKVO, LLAMA_PRE},
    {"llama4_text", L_QKVO, LLAMA_PRE},
    {"gemma", L_QKVO, LLAMA_PRE},
    {"gemma2", L_QKVO, LLAMA_PRE},
    {"gpt_oss", L_QKVO, LLAMA_PRE},
    {"phi3", L_PHI3, LLAMA_PRE},
    {"gpt2", L_GPT2, {{"transformer.h.", ".attn."}, {"h.", ".attn."}}},
    {"gpt_neox", L_NEOX, {{"gpt_neox.layers.", ".attention."}, {"layers.", ".attention."}}},
    {"falcon", L_FALCON, {{"transformer.h.", ".self_attention."}, {"h.", ".self_attention."}}},
    {"bert", L_BERT, {{"bert.encoder.layer.", ".attention."}, {"encoder.layer.", ".attention."}}},
    {"roberta",
     L_BERT,
     {{"roberta.encoder.layer.", ".attention."}, {"encoder.layer.", ".attention."}}},
};
#define N_ARCHS (sizeof ARCHS / sizeof ARCHS[0])
static const char *const STEMS[][4] = {
    [L_QKVO] = {"q_proj", "k_proj", "v_proj", "o_proj"},
    [L_BERT] = {"self.query", "self.key", "self.value", "output.dense"},
    [L_PHI3] = {"qkv_proj", NULL, NULL, "o_proj"},
    [L_GPT2] = {"c_attn", NULL, NULL, "c_proj"},
    [L_NEOX] = {"query_key_value", NULL, NULL, "dense"},
    [L_FALCON] = {"query_key_value", NULL, NULL, "dense"},
};

/* One tensor to write: name, 1-d (cols 0) or 2-d shape, float values. */
typedef struct tensor {
    char name[256];
    int64_t rows, cols;
    float *v;
} tensor;

typedef struct run {
    char dir[512];
    const cJSON *weight_map; /* the harness's own parse of the index, or NULL */
    int dtype;               /* 0 F32, 1 F16, 2 BF16, 3 F64 */
    tensor t[MAX_TENSORS];
    int nt;
} run;

/* ---- files ---------------------------------------------------------------------------------- */

static void write_file(const run *r, const char *name, const void *p, size_t n) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", r->dir, name);
    FILE *f = fopen(path, "wb");
    FUZZ_REQUIRE(f != NULL, "cannot create %s", path);
    FUZZ_REQUIRE(n == 0 || fwrite(p, 1, n, f) == n, "write %s", path);
    FUZZ_REQUIRE(fclose(f) == 0, "close %s", path);
}

static void remove_dir(const char *dir) {
    DIR *d = opendir(dir);
    FUZZ_REQUIRE(d != NULL, "opendir %s", dir);
    struct dirent *e;
    char path[1024];
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        FUZZ_REQUIRE(unlink(path) == 0, "unlink %s", path);
    }
    closedir(d);
    FUZZ_REQUIRE(rmdir(dir) == 0, "rmdir %s", dir);
}

static uint16_t to_f16(float x) { /* exact for the harness's values k/512, |k| < 256 */
    if (x == 0.0f)
        return signbit(x) ? 0x8000u : 0;
    const uint16_t sign = x < 0 ? 0x8000u : 0;
    int e;
    const float m = frexpf(fabsf(x), &e); /* |x| = m 2^e, m in [0.5, 1) */
    if (e - 1 < -14) {                    /* subnormal: |x| = k 2^-24 */
        return (uint16_t)(sign | (uint16_t)lrintf(fabsf(x) * 16777216.0f));
    }
    return (uint16_t)(sign | (uint16_t)((e - 1 + 15) << 10) |
                      (uint16_t)lrintf((m * 2.0f - 1.0f) * 1024.0f));
}

/* A safetensors image of the tensors in idx[0..n) in dtype r->dtype; returns malloc'ed bytes. */
static unsigned char *safetensors_image(const run *r, const int *idx, int n, size_t *len) {
    static const char *const names[] = {"F32", "F16", "BF16", "F64"};
    static const size_t es[] = {4, 2, 2, 8};
    const size_t e = es[r->dtype];
    size_t cap = 256 + (size_t)n * 400, hl = 0, total = 0;
    char *h = malloc(cap);
    FUZZ_REQUIRE(h != NULL, "malloc");
    hl += (size_t)snprintf(h + hl, cap - hl, "{\"__metadata__\":{\"format\":\"pt\"}");
    for (int i = 0; i < n; i++) {
        const tensor *t = &r->t[idx[i]];
        const size_t bytes = (size_t)(t->rows * (t->cols ? t->cols : 1)) * e;
        if (t->cols)
            hl += (size_t)snprintf(h + hl, cap - hl,
                                   ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld,%lld],"
                                   "\"data_offsets\":[%zu,%zu]}",
                                   t->name, names[r->dtype], (long long)t->rows, (long long)t->cols,
                                   total, total + bytes);
        else
            hl += (size_t)snprintf(h + hl, cap - hl,
                                   ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld],"
                                   "\"data_offsets\":[%zu,%zu]}",
                                   t->name, names[r->dtype], (long long)t->rows, total,
                                   total + bytes);
        total += bytes;
    }
    hl += (size_t)snprintf(h + hl, cap - hl, "}");
    FUZZ_REQUIRE(hl < cap, "header buffer");
    while (hl % 8)
        h[hl++] = ' ';
    unsigned char *img = malloc(8 + hl + total);
    FUZZ_REQUIRE(img != NULL, "malloc");
    for (int b = 0; b < 8; b++)
        img[b] = (unsigned char)((uint64_t)hl >> (8 * b));
    memcpy(img + 8, h, hl);
    free(h);
    unsigned char *p = img + 8 + hl;
    for (int i = 0; i < n; i++) {
        const tensor *t = &r->t[idx[i]];
        const int64_t cnt = t->rows * (t->cols ? t->cols : 1);
        for (int64_t k = 0; k < cnt; k++) {
            const float x = t->v[k];
            uint64_t u = 0;
            if (r->dtype == 0) {
                uint32_t w;
                memcpy(&w, &x, 4);
                u = w;
            } else if (r->dtype == 1) {
                u = to_f16(x);
            } else if (r->dtype == 2) {
                uint32_t w;
                memcpy(&w, &x, 4);
                u = w >> 16; /* exact: the values have at most 8 significant bits */
            } else {
                const double dx = (double)x;
                memcpy(&u, &dx, 8);
            }
            for (size_t b = 0; b < e; b++)
                *p++ = (unsigned char)(u >> (8 * b));
        }
    }
    *len = 8 + hl + total;
    return img;
}

/* The file the index maps tensor `name` to, when the harness may write it; NULL: nowhere. */
static const char *file_for(const run *r, const char *name) {
    if (!r->weight_map)
        return "model.safetensors";
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(r->weight_map, name);
    if (!f)
        return "model.safetensors";
    if (!cJSON_IsString(f))
        return NULL;
    const char *s = f->valuestring;
    const size_t n = strlen(s);
    if (n == 0 || n > 200 || strchr(s, '/') || strcmp(s, ".") == 0 || strcmp(s, "..") == 0 ||
        strcmp(s, "config.json") == 0 || strcmp(s, "model.safetensors.index.json") == 0)
        return NULL;
    return s;
}

/* Writes r->t[0..nt) grouped by file (at most MAX_FILES files; the rest are left out). */
static void write_tensors(const run *r) {
    const char *files[MAX_FILES];
    int nf = 0;
    for (int i = 0; i < r->nt; i++) {
        const char *f = file_for(r, r->t[i].name);
        int known = !f;
        for (int j = 0; j < nf && !known; j++)
            known = strcmp(files[j], f) == 0;
        if (!known && nf < MAX_FILES)
            files[nf++] = f;
    }
    for (int j = 0; j < nf; j++) {
        int idx[MAX_TENSORS], n = 0;
        for (int i = 0; i < r->nt; i++) {
            const char *f = file_for(r, r->t[i].name);
            if (f && strcmp(f, files[j]) == 0)
                idx[n++] = i;
        }
        size_t len;
        unsigned char *img = safetensors_image(r, idx, n, &len);
        write_file(r, files[j], img, len);
        free(img);
    }
}

static void free_tensors(run *r) {
    for (int i = 0; i < r->nt; i++)
        free(r->t[i].v);
    r->nt = 0;
}

static tensor *add_tensor(run *r,
                          const char *prefix,
                          const char *stem,
                          const char *suffix,
                          int64_t rows,
                          int64_t cols,
                          uint32_t seed) {
    FUZZ_REQUIRE(r->nt < MAX_TENSORS, "too many tensors");
    tensor *t = &r->t[r->nt++];
    snprintf(t->name, sizeof t->name, "%s%s%s", prefix, stem, suffix);
    t->rows = rows;
    t->cols = cols;
    const int64_t n = rows * (cols ? cols : 1);
    t->v = malloc(sizeof(float) * (size_t)(n ? n : 1));
    FUZZ_REQUIRE(t->v != NULL, "malloc");
    uint32_t s = seed * 2654435761u + 12345u;
    for (int64_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        t->v[i] = (float)((int32_t)(s >> 23) - 256) / 512.0f; /* k/512, |k| <= 256 */
        if (t->v[i] <= -0.5f)
            t->v[i] = 0.25f;
    }
    return t;
}

/* ---- the directory -------------------------------------------------------------------------- */

static const arch *arch_of(const char *type) {
    for (size_t i = 0; i < N_ARCHS; i++)
        if (strcmp(ARCHS[i].type, type) == 0)
            return &ARCHS[i];
    return NULL;
}

/* The probe: every architecture's first stem for layers 0 and 1 under prefix scheme `scheme`. */
static void write_probe(run *r, int scheme) {
    for (size_t a = 0; a < N_ARCHS; a++)
        for (int layer = 0; layer < 2; layer++) {
            char pre[128];
            snprintf(pre, sizeof pre, "%s%d%s", ARCHS[a].pre[scheme][0], layer,
                     ARCHS[a].pre[scheme][1]);
            int dup = 0;
            char name[256];
            snprintf(name, sizeof name, "%s%s.weight", pre, STEMS[ARCHS[a].lay][0]);
            for (int i = 0; i < r->nt && !dup; i++)
                dup = strcmp(r->t[i].name, name) == 0;
            if (!dup && r->nt < MAX_TENSORS)
                add_tensor(r, pre, STEMS[ARCHS[a].lay][0], ".weight", 1, 1, 1);
        }
    const cJSON *map = r->weight_map;
    r->weight_map = NULL; /* the probe is one model.safetensors */
    write_tensors(r);
    r->weight_map = map;
    free_tensors(r);
}

/* Which tensor of the generated set (per layer): 0 q/fused, 1 k, 2 v, 3 o, 4..7 biases, 8 sinks,
 * 9 q_norm, 10 k_norm. */
typedef struct layer_tensors {
    int idx[11]; /* index in r->t, or -1 */
} layer_tensors;

/* Rows of q_proj per query row of the layer: 2 when it holds Qwen3-Next's output gate too. */
static int64_t q_rows_per(const mha_config *c) {
    return c->output_gate ? 2 : 1;
}

/* Sizes of the QK-norm weights (docs/SEMANTICS.md): [d] per head, [h d] and [g d] over the whole
 * projection (OLMo 2), none for the other kinds. */
static int64_t norm_len(const mha_config *c, int key) {
    if (c->qk_norm.kind == MHA_QK_NORM_RMS_HEAD)
        return c->head_dim;
    if (c->qk_norm.kind == MHA_QK_NORM_RMS_ALL)
        return (key ? c->num_kv_heads : c->num_heads) * c->head_dim;
    return 0;
}

/* The layer's tensors with the shapes `info` implies (sizes from info.config). */
static void gen_layer(run *r,
                      const arch *a,
                      const mha_hf_layer_info *info,
                      const char *prefix,
                      int bias_mode,
                      uint32_t seed,
                      layer_tensors *lt) {
    const mha_config *c = &info->config;
    const int64_t h = c->num_heads, g = c->num_kv_heads, d = c->head_dim, hid = c->q_dim;
    const int64_t hd = h * d, gd = g * d, fused = (h + 2 * g) * d;
    for (int i = 0; i < 11; i++)
        lt->idx[i] = -1;
    const char *const *st = STEMS[a->lay];
    const int32_t want[4] = {c->bias_q, c->bias_k, c->bias_v, c->bias_o};
    const int separate = a->lay == L_QKVO || a->lay == L_BERT;
    for (int p = 0; p < 4; p++) {
        if (!st[p])
            continue;
        int64_t rows = p == 0   ? (separate ? q_rows_per(c) * hd : fused)
                       : p == 3 ? hid
                                : gd,
                cols = p == 3 ? hd : hid;
        if (a->lay == L_GPT2) { /* Conv1D [in, out] */
            const int64_t t = rows;
            rows = cols;
            cols = t;
        }
        lt->idx[p] = r->nt;
        add_tensor(r, prefix, st[p], ".weight", rows, cols, seed + (uint32_t)p);
        const int bias = bias_mode == 1 ? 0 : bias_mode == 2 ? 1 : (p == 0 ? c->bias_q : want[p]);
        if (bias) {
            lt->idx[4 + p] = r->nt;
            add_tensor(r, prefix, st[p], ".bias", a->lay == L_GPT2 ? cols : rows, 0,
                       seed + 10u + (uint32_t)p);
        }
    }
    if (c->sinks) {
        lt->idx[8] = r->nt;
        add_tensor(r, prefix, "sinks", "", h, 0, seed + 20u);
    }
    for (int key = 0; key < 2; key++)
        if (norm_len(c, key)) {
            lt->idx[9 + key] = r->nt;
            add_tensor(r, prefix, key ? "k_norm" : "q_norm", ".weight", norm_len(c, key), 0,
                       seed + 30u + (uint32_t)key);
        }
}

/* The block of d rows of a fused [q; k; v] tensor that holds head t of role (0 q, 1 k, 2 v). */
static int64_t fused_block(layout lay, int role, int64_t t, int64_t h, int64_t g) {
    if (lay == L_NEOX)
        return 3 * t + role;
    return role == 0 ? t : role == 1 ? h + t : h + g + t;
}

/* Element (row, col) of a generated matrix as the layer uses it ([out, in]). */
static float elem(const tensor *t, int transposed, int64_t row, int64_t col) {
    return transposed ? t->v[col * t->cols + row] : t->v[row * (t->cols ? t->cols : 1) + col];
}

/* Qwen3-Next's gate: w_q's rows [h d, 2 h d) (and b_q's) are q_proj's rows t (2 d) + d + i. */
static void
check_gate(const run *r, const mha_config *c, const mha_weights *w, const layer_tensors *lt) {
    const int64_t h = c->num_heads, d = c->head_dim, hid = c->q_dim;
    const float *wq = w->w_q, *bq = w->b_q;
    const tensor *src = &r->t[lt->idx[0]];
    const tensor *bsrc = lt->idx[4] >= 0 ? &r->t[lt->idx[4]] : NULL;
    for (int64_t t = 0; t < h; t++)
        for (int64_t i = 0; i < d; i++) {
            const int64_t row = h * d + t * d + i, src_row = t * 2 * d + d + i;
            for (int64_t k = 0; k < hid; k++)
                FUZZ_REQUIRE(wq[row * hid + k] == elem(src, 0, src_row, k),
                             "gate (%lld, %lld) is %g, the file has %g", (long long)row,
                             (long long)k, (double)wq[row * hid + k],
                             (double)elem(src, 0, src_row, k));
            if (bsrc)
                FUZZ_REQUIRE(bq[row] == bsrc->v[src_row], "gate bias[%lld]", (long long)row);
        }
}

/* The QK-norm weights are the files' q_norm / k_norm, given exactly when the kind has weights. */
static void
check_norms(const run *r, const mha_config *c, const mha_weights *w, const layer_tensors *lt) {
    const float *got[2] = {w->q_norm, w->k_norm};
    for (int key = 0; key < 2; key++) {
        FUZZ_REQUIRE((got[key] != NULL) == (norm_len(c, key) > 0), "%s presence",
                     key ? "k_norm" : "q_norm");
        for (int64_t i = 0; i < norm_len(c, key); i++)
            FUZZ_REQUIRE(got[key][i] == r->t[lt->idx[9 + key]].v[i], "%s[%lld]",
                         key ? "k_norm" : "q_norm", (long long)i);
    }
}

/* The loaded weights are the generated values, where the layout puts them. */
static void
check_weights(const run *r, const arch *a, const mha_layer *L, const layer_tensors *lt) {
    const mha_config *c = mha_layer_config(L);
    const mha_weights *w = mha_layer_weights(L);
    const int64_t h = c->num_heads, g = c->num_kv_heads, d = c->head_dim, hid = c->q_dim;
    const int gpt2 = a->lay == L_GPT2;
    const float *mats[3] = {w->w_q, w->w_k, w->w_v};
    const float *biases[3] = {w->b_q, w->b_k, w->b_v};
    for (int role = 0; role < 3; role++) {
        const int64_t heads = role == 0 ? h : g;
        for (int64_t t = 0; t < heads; t++)
            for (int64_t i = 0; i < d; i++) {
                const int64_t row = t * d + i;
                int64_t src_row = row;
                const tensor *src = NULL, *bsrc = NULL;
                if (a->lay == L_QKVO || a->lay == L_BERT) {
                    src = &r->t[lt->idx[role]];
                    bsrc = lt->idx[4 + role] >= 0 ? &r->t[lt->idx[4 + role]] : NULL;
                    if (role == 0)
                        src_row = t * q_rows_per(c) * d + i; /* q_proj [h, 1 + gate, d] */
                } else if (a->lay != L_FALCON) {
                    src = &r->t[lt->idx[0]];
                    bsrc = lt->idx[4] >= 0 ? &r->t[lt->idx[4]] : NULL;
                    src_row = fused_block(a->lay, role, t, h, g) * d + i;
                    FUZZ_REQUIRE(src_row < (gpt2 ? src->cols : src->rows),
                                 "%s: loaded with %lld heads and %lld kv heads from a fused "
                                 "tensor of %lld rows: its [h, 3, d] split needs row %lld",
                                 a->type, (long long)h, (long long)g,
                                 (long long)(gpt2 ? src->cols : src->rows), (long long)src_row);
                }
                for (int64_t k = 0; k < hid; k++) {
                    const float got = mats[role][row * hid + k];
                    FUZZ_REQUIRE(isfinite(got), "weight %d[%lld] not finite", role,
                                 (long long)(row * hid + k));
                    if (src)
                        FUZZ_REQUIRE(got == elem(src, gpt2, src_row, k),
                                     "%s: weight %d (%lld, %lld) is %g, the file has %g", a->type,
                                     role, (long long)row, (long long)k, (double)got,
                                     (double)elem(src, gpt2, src_row, k));
                }
                if (src)
                    FUZZ_REQUIRE((biases[role] != NULL) == (bsrc != NULL), "bias %d presence",
                                 role);
                if (bsrc)
                    FUZZ_REQUIRE(biases[role][row] == bsrc->v[src_row], "bias %d[%lld]", role,
                                 (long long)row);
            }
    }
    if (c->output_gate)
        check_gate(r, c, w, lt);
    check_norms(r, c, w, lt);
    const tensor *o = &r->t[lt->idx[3]];
    const float *wo = w->w_o, *bo = w->b_o, *sinks = w->sinks; /* float32: the default dtype */
    for (int64_t row = 0; row < c->out_dim; row++)
        for (int64_t k = 0; k < h * c->v_head_dim; k++)
            FUZZ_REQUIRE(wo[row * h * c->v_head_dim + k] == elem(o, gpt2, row, k),
                         "w_o (%lld, %lld)", (long long)row, (long long)k);
    FUZZ_REQUIRE((w->b_o != NULL) == (lt->idx[7] >= 0), "b_o presence");
    for (int64_t i = 0; w->b_o && i < c->out_dim; i++)
        FUZZ_REQUIRE(bo[i] == r->t[lt->idx[7]].v[i], "b_o[%lld]", (long long)i);
    FUZZ_REQUIRE((w->sinks != NULL) == (lt->idx[8] >= 0), "sinks presence");
    for (int64_t i = 0; w->sinks && i < h; i++)
        FUZZ_REQUIRE(sinks[i] == r->t[lt->idx[8]].v[i], "sinks[%lld]", (long long)i);
}

/* MHA_FUZZ_VERBOSE=1 prints what each step of a run gave (to check what a seed reaches). */
static void note(const char *step, int64_t layer, mha_status st, const mha_error *err) {
    static int verbose = -1;
    if (verbose < 0)
        verbose = getenv("MHA_FUZZ_VERBOSE") != NULL;
    if (verbose)
        fprintf(stderr, "  %s layer %lld: %s %s\n", step, (long long)layer, mha_status_string(st),
                st == MHA_STATUS_OK ? "" : err->message);
}

/* Scale and soft-cap in the range where float32 attention of |scores| <= 64 cannot overflow. */
static int sane_scalars(const mha_config *c) {
    const double sc = c->scale == 0.0 ? 1.0 / sqrt((double)c->head_dim) : c->scale;
    return isfinite(sc) && fabs(sc) <= 1e6 && (fabs(sc) >= 1e-30 || sc == 0.0) &&
           (c->softcap == 0.0 || (c->softcap >= 1e-30 && c->softcap <= 1e30));
}

static void forward(const mha_layer *L, const mha_hf_layer_info *info, int64_t n) {
    const mha_config *c = mha_layer_config(L);
    float *x = malloc(sizeof(float) * (size_t)(n * c->q_dim));
    float *y = malloc(sizeof(float) * (size_t)(n * c->out_dim));
    FUZZ_REQUIRE(x && y, "malloc");
    for (int64_t i = 0; i < n * c->q_dim; i++)
        x[i] = (float)((i % 7) - 3) * 0.25f;
    for (int64_t i = 0; i < n * c->out_dim; i++)
        y[i] = 12345.0f;
    mha_forward_args fa;
    memset(&fa, 0, sizeof fa);
    fa.batch = 1;
    fa.q_len = n;
    fa.query = x;
    fa.out = y;
    fa.mask.causal = info->causal;
    fa.mask.use_window = info->use_window;
    fa.mask.window_left = info->window_left;
    fa.mask.window_right = info->window_right;
    mha_exec ex;
    memset(&ex, 0, sizeof ex);
    ex.n_threads = 1;
    mha_error err;
    memset(&err, 0, sizeof err);
    const mha_status st = mha_layer_forward(L, &fa, &ex, &err);
    note("forward", info->layer, st, &err);
    if (st != MHA_STATUS_OK) {
        fuzz_check_error(st, &err);
    } else if (sane_scalars(c)) {
        for (int64_t i = 0; i < n * c->out_dim; i++)
            FUZZ_REQUIRE(isfinite(y[i]),
                         "%s layer %lld: OK with a non-finite output %g at %lld (finite weights "
                         "and inputs; scale %g, softcap %g, rope scaling %d)",
                         info->model_type, (long long)info->layer, (double)y[i], (long long)i,
                         c->scale, c->softcap, (int)c->rope.scaling);
    }
    free(x);
    free(y);
}

/* An info that mha_hf_layer_info_read returned OK. */
static void check_info(const mha_hf_layer_info *info, int64_t layer) {
    const mha_config *c = &info->config;
    FUZZ_REQUIRE(info->layer == layer && layer < info->num_layers, "layer");
    FUZZ_REQUIRE(memchr(info->model_type, '\0', sizeof info->model_type) &&
                     memchr(info->prefix, '\0', sizeof info->prefix) &&
                     memchr(info->layout, '\0', sizeof info->layout),
                 "unterminated text");
    FUZZ_REQUIRE(arch_of(info->model_type) != NULL, "model_type '%s' accepted", info->model_type);
    FUZZ_REQUIRE(c->num_heads >= 1 && c->num_kv_heads >= 1 && c->num_heads % c->num_kv_heads == 0,
                 "heads %lld / %lld", (long long)c->num_heads, (long long)c->num_kv_heads);
    FUZZ_REQUIRE(c->head_dim >= 1 && c->q_dim >= 1 && c->v_head_dim == c->head_dim, "sizes");
    FUZZ_REQUIRE(isfinite(c->scale) && c->scale > 0.0, "scale %g", c->scale);
    FUZZ_REQUIRE(isfinite(c->softcap) && c->softcap >= 0.0, "softcap %g", c->softcap);
    const mha_rope *p = &c->rope;
    if (p->style != MHA_ROPE_NONE) {
        FUZZ_REQUIRE(p->rotary_dim >= 2 && p->rotary_dim % 2 == 0 && p->rotary_dim <= c->head_dim,
                     "rotary_dim %lld", (long long)p->rotary_dim);
        const double v[] = {p->theta,
                            p->factor,
                            p->original_max_position,
                            p->attention_factor,
                            p->low_freq_factor,
                            p->high_freq_factor,
                            p->beta_fast,
                            p->beta_slow};
        for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
            FUZZ_REQUIRE(isfinite(v[i]), "rope parameter %zu is %g (scaling %d)", i, v[i],
                         (int)p->scaling);
    }
    if (info->use_window)
        FUZZ_REQUIRE(info->window_left >= 0 && info->window_right == 0, "window");
}

static void load_and_run(run *r,
                         const arch *a,
                         int64_t layer,
                         const mha_config *override,
                         int perturbed,
                         const layer_tensors *lt,
                         int64_t n) {
    mha_hf_layer_info info;
    mha_error err;
    memset(&err, 0, sizeof err);
    mha_status st = mha_hf_layer_info_read(r->dir, layer, &info, &err);
    note("info", layer, st, &err);
    if (st != MHA_STATUS_OK) {
        fuzz_check_error(st, &err);
        return;
    }
    check_info(&info, layer);
    mha_config cfg = info.config;
    if (override) {
        cfg.num_heads = override->num_heads ? override->num_heads : cfg.num_heads;
        cfg.num_kv_heads = override->num_kv_heads ? override->num_kv_heads : cfg.num_kv_heads;
        if (cfg.num_heads % cfg.num_kv_heads != 0)
            return; /* the CLI refuses it before loading */
    }
    mha_layer *L = (mha_layer *)&cfg; /* must be overwritten */
    memset(&err, 0, sizeof err);
    st = mha_hf_layer_load(r->dir, layer, override ? &cfg : NULL, NULL, &L, &err);
    note("load", layer, st, &err);
    if (st != MHA_STATUS_OK) {
        fuzz_check_error(st, &err);
        FUZZ_REQUIRE(L == NULL, "*out not NULL on error");
        return;
    }
    FUZZ_REQUIRE(L != NULL, "no layer on success");
    FUZZ_REQUIRE(!perturbed,
                 "%s layer %lld loaded although the harness gave a tensor a wrong "
                 "shape",
                 info.model_type, (long long)layer);
    const mha_config *c = mha_layer_config(L);
    FUZZ_REQUIRE(c->num_heads == cfg.num_heads && c->num_kv_heads == cfg.num_kv_heads &&
                     c->head_dim == cfg.head_dim && c->q_dim == cfg.q_dim,
                 "loaded sizes differ from the config");
    if (lt && a)
        check_weights(r, a, L, lt);
    forward(L, &info, n);
    mha_layer_destroy(L);
}

/* Small enough to generate and run quickly. */
static int small(const mha_config *c) {
    return c->q_dim <= 64 && c->num_heads <= 16 && c->head_dim <= 32 &&
           (c->num_heads + 2 * c->num_kv_heads) * c->head_dim <= 256;
}

static void fuzz_dir(run *r,
                     const uint8_t *cfg,
                     size_t cfg_len,
                     const uint8_t *idx,
                     size_t idx_len,
                     fuzz_reader *sel) {
    const uint8_t s0 = fuzz_u8(sel), s1 = fuzz_u8(sel), s2 = fuzz_u8(sel), s3 = fuzz_u8(sel);
    write_file(r, "config.json", cfg, cfg_len);
    cJSON *index = NULL;
    if (idx_len) {
        write_file(r, "model.safetensors.index.json", idx, idx_len);
        index = cJSON_ParseWithLength((const char *)idx, idx_len);
        r->weight_map = cJSON_GetObjectItemCaseSensitive(index, "weight_map");
        if (!cJSON_IsObject(r->weight_map))
            r->weight_map = NULL;
    }
    r->dtype = 0;
    write_probe(r, s0 & 1);
    mha_hf_layer_info info;
    mha_error err;
    memset(&err, 0, sizeof err);
    mha_status st = mha_hf_layer_info_read(r->dir, 0, &info, &err);
    note("probe info", 0, st, &err);
    const arch *a = st == MHA_STATUS_OK ? arch_of(info.model_type) : NULL;
    if (st != MHA_STATUS_OK) {
        fuzz_check_error(st, &err);
    } else {
        check_info(&info, 0);
        FUZZ_REQUIRE(a != NULL, "unknown model_type '%s' accepted", info.model_type);
    }
    const int64_t n = 1 + (s0 >> 6); /* tokens: 1 .. 4 */
    if (!a || !small(&info.config)) {
        load_and_run(r, NULL, 0, NULL, 1, NULL, n); /* the probe's [1, 1] tensors: must fail */
        cJSON_Delete(index);
        return;
    }
    r->dtype = (s0 >> 1) & 3;
    const int bias_mode = (s0 >> 3) & 3; /* 0 as the config says, 1 none, 2 all, 3 as config */
    const int perturb = (s0 & 0x20) != 0;
    layer_tensors lt[2];
    char prefix[2][MHA_HF_TEXT_SIZE];
    snprintf(prefix[0], sizeof prefix[0], "%s", info.prefix);
    snprintf(prefix[1], sizeof prefix[1], "%s", info.prefix);
    char *z = strstr(prefix[1], ".0.");
    FUZZ_REQUIRE(z != NULL, "prefix '%s' has no layer number", info.prefix);
    z[1] = '1';
    /* The CLI's --heads / --kv-heads (0: keep); bit 7: the tensors are sized by the overridden
     * config (the file agrees with the override), else by config.json (they contradict it). */
    mha_config ov;
    memset(&ov, 0, sizeof ov);
    ov.num_heads = s2 & 7;
    ov.num_kv_heads = (s2 >> 3) & 7;
    const int use_ov = (s2 & 0x40) != 0;
    mha_hf_layer_info gen = info;
    int sized_by_ov = 0;
    if (use_ov && (s2 & 0x80)) {
        gen.config.num_heads = ov.num_heads ? ov.num_heads : gen.config.num_heads;
        gen.config.num_kv_heads = ov.num_kv_heads ? ov.num_kv_heads : gen.config.num_kv_heads;
        sized_by_ov = gen.config.num_heads % gen.config.num_kv_heads == 0 && small(&gen.config);
        if (!sized_by_ov)
            gen = info;
    }
    for (int layer = 0; layer < 2; layer++)
        gen_layer(r, a, &gen, prefix[layer], bias_mode == 3 ? 0 : bias_mode,
                  (uint32_t)(7 + 31 * layer + s3), &lt[layer]);
    int perturbed[2] = {0, 0};
    if (perturb) { /* one weight matrix of one layer gets a wrong shape */
        const int layer = s1 & 1, p = (s1 >> 1) & 3;
        const int t = lt[layer].idx[p] >= 0 ? lt[layer].idx[p] : lt[layer].idx[0];
        if (s1 & 8)
            r->t[t].rows += 1 + (s1 >> 4);
        else
            r->t[t].cols += 1 + (s1 >> 4);
        float *v = realloc(r->t[t].v, sizeof(float) * (size_t)(r->t[t].rows * r->t[t].cols));
        FUZZ_REQUIRE(v != NULL, "realloc");
        for (int64_t i = 0; i < r->t[t].rows * r->t[t].cols; i++)
            v[i] = 0.125f;
        r->t[t].v = v;
        perturbed[layer] = 1;
    }
    write_tensors(r);
    const int matches = !use_ov || sized_by_ov; /* the file has the shapes the load asks for */
    for (int layer = 0; layer < 2; layer++)
        load_and_run(r, a, layer, use_ov ? &ov : NULL, perturbed[layer] && matches,
                     (bias_mode == 0 || bias_mode == 3) && matches ? &lt[layer] : NULL, n);
    free_tensors(r);
    cJSON_Delete(index);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 1 << 20)
        return 0;
    const uint8_t *nul = memchr(data, 0, size);
    const size_t cfg_len = nul ? (size_t)(nul - data) : size;
    const uint8_t *idx = nul ? nul + 1 : NULL;
    size_t idx_len = 0;
    fuzz_reader sel = {NULL, 0, 0};
    if (idx) {
        const size_t rest = size - cfg_len - 1;
        const uint8_t *nul2 = memchr(idx, 0, rest);
        idx_len = nul2 ? (size_t)(nul2 - idx) : rest;
        if (nul2)
            sel = (fuzz_reader){nul2 + 1, rest - idx_len - 1, 0};
    }
    run r;
    memset(&r, 0, sizeof r);
    const char *tmp = getenv("TMPDIR");
    snprintf(r.dir, sizeof r.dir, "%s/mha-fuzz-model-XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
    FUZZ_REQUIRE(mkdtemp(r.dir) != NULL, "mkdtemp %s", r.dir);
    fuzz_dir(&r, data, cfg_len, idx, idx_len, &sel);
    remove_dir(r.dir);
    return 0;
}
