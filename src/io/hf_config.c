/* SPDX-License-Identifier: MIT */
/* hf_config.c: a Hugging Face model directory's attention layer by index (mha_hf_layer_info_read,
 * mha_hf_layer_load). docs/MODELS.md has the table: per config.json `model_type`, the fields read,
 * the tensor names, how fused projections are split, and what is refused.
 *
 * This is the one place where config.json is mapped to mha options (the CLI and Python call it).
 * config.json and the index are untrusted: sizes are capped before allocation, every field is
 * type- and range-checked, shard file names may not leave the directory, and every tensor's
 * shape is checked against the sizes the config implies before a byte of it is used.
 */
#define _POSIX_C_SOURCE 200809L

#include "io/safetensors.h"

#include "io/file.h"

#include "base/internal.h"

#include <cjson/cJSON.h>

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* config.json and the index are a few kilobytes (an index lists a few thousand names). */
#define HF_MAX_JSON  ((long)64 * 1024 * 1024)
#define HF_MAX_PATH  4096
#define HF_MAX_HEADS ((int64_t)1 << 20)
#define HF_MAX_SIZE  ((int64_t)1 << 24) /* hidden size, head_dim */

/* How an architecture stores the four projections of one layer. */
typedef enum hf_layout {
    LAYOUT_QKVO,   /* q_proj, k_proj, v_proj, o_proj (nn.Linear) */
    LAYOUT_BERT,   /* self.query, self.key, self.value, output.dense */
    LAYOUT_PHI3,   /* qkv_proj = [q; k; v] rows, o_proj */
    LAYOUT_GPT2,   /* Conv1D c_attn [in, 3 out] (x W + b), c_proj [in, out] */
    LAYOUT_NEOX,   /* query_key_value rows [h, 3, d]: per head q, k, v; dense */
    LAYOUT_FALCON, /* query_key_value in one of Falcon's three orders; dense */
} hf_layout;

/* The order of the blocks of d rows in a fused qkv matrix. */
typedef enum hf_fused {
    FUSED_CONCAT,    /* [q heads; k heads; v heads] (Phi-3, GPT-2, Falcon multi_query) */
    FUSED_PER_HEAD,  /* [h, 3, d]: q_t, k_t, v_t per head (GPT-NeoX, Falcon classic) */
    FUSED_PER_GROUP, /* [g, h/g + 2, d]: the group's queries, then its k, its v (Falcon new) */
} hf_fused;

typedef struct hf_arch {
    const char *type;
    hf_layout layout;
    const char *prefixes[2][2]; /* tensor prefix: [i][0] + layer + [i][1] */
    const char *layout_text;
} hf_arch;

#define LLAMA_PREFIXES                                                                             \
    {                                                                                              \
        {"model.layers.", ".self_attn."}, {                                                        \
            "layers.", ".self_attn."                                                               \
        }                                                                                          \
    }
static const hf_arch ARCHS[] = {
    {"llama", LAYOUT_QKVO, LLAMA_PREFIXES, "q_proj, k_proj, v_proj, o_proj"},
    {"mistral", LAYOUT_QKVO, LLAMA_PREFIXES, "q_proj, k_proj, v_proj, o_proj"},
    {"mixtral", LAYOUT_QKVO, LLAMA_PREFIXES, "q_proj, k_proj, v_proj, o_proj"},
    {"qwen2", LAYOUT_QKVO, LLAMA_PREFIXES, "q_proj, k_proj, v_proj, o_proj"},
    {"qwen3", LAYOUT_QKVO, LLAMA_PREFIXES, "q_proj, k_proj, v_proj, o_proj, q_norm, k_norm"},
    {"qwen3_moe", LAYOUT_QKVO, LLAMA_PREFIXES, "q_proj, k_proj, v_proj, o_proj, q_norm, k_norm"},
    {"gemma3_text", LAYOUT_QKVO, LLAMA_PREFIXES,
     "q_proj, k_proj, v_proj, o_proj, q_norm, k_norm (1 + w)"},
    {"qwen3_next", LAYOUT_QKVO, LLAMA_PREFIXES,
     "q_proj [h, 2, d]: per head q then gate (split), k_proj, v_proj, o_proj, q_norm, k_norm "
     "(1 + w)"},
    {"olmo2", LAYOUT_QKVO, LLAMA_PREFIXES,
     "q_proj, k_proj, v_proj, o_proj, q_norm, k_norm (whole projection)"},
    {"gemma", LAYOUT_QKVO, LLAMA_PREFIXES, "q_proj, k_proj, v_proj, o_proj"},
    {"gemma2", LAYOUT_QKVO, LLAMA_PREFIXES, "q_proj, k_proj, v_proj, o_proj"},
    {"gpt_oss", LAYOUT_QKVO, LLAMA_PREFIXES, "q_proj, k_proj, v_proj, o_proj, sinks"},
    {"smollm3", LAYOUT_QKVO, LLAMA_PREFIXES, "q_proj, k_proj, v_proj, o_proj"},
    {"cohere2", LAYOUT_QKVO, LLAMA_PREFIXES, "q_proj, k_proj, v_proj, o_proj"},
    {"llama4_text", LAYOUT_QKVO, LLAMA_PREFIXES, "q_proj, k_proj, v_proj, o_proj"},
    {"phi3", LAYOUT_PHI3, LLAMA_PREFIXES, "fused qkv_proj [q; k; v], o_proj"},
    {"gpt2",
     LAYOUT_GPT2,
     {{"transformer.h.", ".attn."}, {"h.", ".attn."}},
     "fused Conv1D c_attn [in, 3 out] (transposed), Conv1D c_proj"},
    {"gpt_neox",
     LAYOUT_NEOX,
     {{"gpt_neox.layers.", ".attention."}, {"layers.", ".attention."}},
     "fused query_key_value, per head [q, k, v], dense"},
    {"falcon",
     LAYOUT_FALCON,
     {{"transformer.h.", ".self_attention."}, {"h.", ".self_attention."}},
     "fused query_key_value, dense"},
    {"bert",
     LAYOUT_BERT,
     {{"bert.encoder.layer.", ".attention."}, {"encoder.layer.", ".attention."}},
     "self.query, self.key, self.value, output.dense"},
    {"roberta",
     LAYOUT_BERT,
     {{"roberta.encoder.layer.", ".attention."}, {"encoder.layer.", ".attention."}},
     "self.query, self.key, self.value, output.dense"},
};
#define N_ARCHS (sizeof ARCHS / sizeof ARCHS[0])

/* The tensor stems (".weight" / ".bias" appended) of q, k, v (or the fused qkv in slot 0) and o. */
static const char *const STEMS[][4] = {
    [LAYOUT_QKVO] = {"q_proj", "k_proj", "v_proj", "o_proj"},
    [LAYOUT_BERT] = {"self.query", "self.key", "self.value", "output.dense"},
    [LAYOUT_PHI3] = {"qkv_proj", NULL, NULL, "o_proj"},
    [LAYOUT_GPT2] = {"c_attn", NULL, NULL, "c_proj"},
    [LAYOUT_NEOX] = {"query_key_value", NULL, NULL, "dense"},
    [LAYOUT_FALCON] = {"query_key_value", NULL, NULL, "dense"},
};

/* ---------------------------------------------------------------------------------------------- */
/* The model directory: config.json, the optional index, the open safetensors file              */
/* ---------------------------------------------------------------------------------------------- */

typedef struct hf_model {
    const char *dir;
    char config_path[HF_MAX_PATH];
    char index_path[HF_MAX_PATH];
    cJSON *config;
    cJSON *index;            /* model.safetensors.index.json, or NULL: one model.safetensors */
    const char *single;      /* the one safetensors file when there is no index */
    const cJSON *weight_map; /* index["weight_map"] */
    mha__st_handle *file;    /* the last file opened */
    char file_name[HF_MAX_PATH];
    const hf_arch *arch;
    char prefix[MHA_HF_TEXT_SIZE];
    /* From the config, for the loader. */
    hf_fused fused;
    int64_t hidden;
} hf_model;

static void model_close(hf_model *m) {
    cJSON_Delete(m->config);
    cJSON_Delete(m->index);
    mha__st_close(m->file);
}

/* Reads a whole JSON file (at most HF_MAX_JSON bytes) into a cJSON tree. *missing is set (and OK
 * returned) when the file does not exist and missing is not NULL. The file is opened as every
 * input is (io/file.h: regular files only, never blocking) and parsed under the one JSON policy
 * (safetensors.h: no duplicate keys, no NUL in a string). */
static mha_status read_json(const char *path, cJSON **out, int *missing, mha_error *err) {
    *out = NULL;
    FILE *f = NULL;
    uint64_t size = 0;
    mha_status st = mha__open_regular(path, &f, &size, missing, err);
    if (st != MHA_STATUS_OK || !f)
        return st;
    char *text = NULL;
    if (size > (uint64_t)HF_MAX_JSON)
        st = mha__fail(err, MHA_STATUS_BAD_FILE, "%s: %llu bytes, more than the limit of %ld", path,
                       (unsigned long long)size, HF_MAX_JSON);
    else if (!(text = malloc((size_t)size + 1)))
        st = mha__fail(err, MHA_STATUS_NO_MEMORY, "%s: out of memory", path);
    else if (fread(text, 1, (size_t)size, f) != (size_t)size)
        st = mha__fail(err, MHA_STATUS_IO, "%s: read error", path);
    fclose(f);
    if (st == MHA_STATUS_OK)
        st = mha__json_check_text(text, (size_t)size, path, err);
    if (st == MHA_STATUS_OK) {
        size_t pos = 0;
        *out = mha__json_parse(text, (size_t)size, &pos);
        if (!*out)
            st = mha__fail(err, MHA_STATUS_BAD_FILE, "%s: not valid JSON (error at byte %zu)", path,
                           pos);
        else if (!cJSON_IsObject(*out))
            st =
                mha__fail(err, MHA_STATUS_BAD_FILE, "%s: the top level is not a JSON object", path);
        else
            st = mha__json_check_keys(*out, path, err);
    }
    free(text);
    return st;
}

static mha_status join(char *buf, const char *dir, const char *name, mha_error *err) {
    int n = snprintf(buf, HF_MAX_PATH, "%s/%s", dir, name);
    MHA_RETURN_IF(n < 0 || n >= HF_MAX_PATH, err, INVALID_ARG, "%s: path too long", dir);
    return MHA_STATUS_OK;
}

static int ends_with(const char *s, const char *tail) {
    const size_t n = strlen(s), t = strlen(tail);
    return n >= t && strcmp(s + n - t, tail) == 0;
}

/* Which weights transformers' from_pretrained reads in a local directory: the file named by
 * config.json's "transformers_weights" when set (a .safetensors file or a .safetensors.index.json
 * index), else model.safetensors when it is a file, else the index model.safetensors.index.json. */
static mha_status model_open(hf_model *m, const char *dir, mha_error *err) {
    memset(m, 0, sizeof *m);
    m->dir = dir;
    m->single = "model.safetensors";
    MHA_TRY(join(m->config_path, dir, "config.json", err));
    MHA_TRY(read_json(m->config_path, &m->config, NULL, err));
    const cJSON *tw = cJSON_GetObjectItemCaseSensitive(m->config, "transformers_weights");
    int missing = 0;
    if (tw && !cJSON_IsNull(tw)) {
        const char *name = cJSON_IsString(tw) ? tw->valuestring : "";
        const int index = ends_with(name, ".safetensors.index.json");
        MHA_RETURN_IF(!name[0] || strchr(name, '/') || strchr(name, '\\') ||
                          strlen(name) >= HF_MAX_PATH / 2 ||
                          !(index || ends_with(name, ".safetensors")),
                      err, BAD_FILE,
                      "%s: \"transformers_weights\" must name a .safetensors file or a "
                      ".safetensors.index.json index in the model directory",
                      m->config_path);
        if (!index) {
            m->single = name;
            return MHA_STATUS_OK;
        }
        MHA_TRY(join(m->index_path, dir, name, err));
        MHA_TRY(read_json(m->index_path, &m->index, NULL, err));
    } else {
        /* model.safetensors first, as transformers (an index beside it is not read) */
        char single[HF_MAX_PATH];
        FILE *f = NULL;
        uint64_t size = 0;
        MHA_TRY(join(single, dir, "model.safetensors", err));
        mha_error ignored;
        if (mha__open_regular(single, &f, &size, &missing, &ignored) == MHA_STATUS_OK && f) {
            fclose(f);
            return MHA_STATUS_OK;
        }
        missing = 0;
        MHA_TRY(join(m->index_path, dir, "model.safetensors.index.json", err));
        MHA_TRY(read_json(m->index_path, &m->index, &missing, err));
        if (missing)
            return MHA_STATUS_OK;
    }
    m->weight_map = cJSON_GetObjectItemCaseSensitive(m->index, "weight_map");
    MHA_RETURN_IF(!cJSON_IsObject(m->weight_map), err, BAD_FILE, "%s: no \"weight_map\" object",
                  m->index_path);
    return MHA_STATUS_OK;
}

/* The file holding tensor `name`: the index's weight_map entry (NOT_FOUND when absent; it must
 * be a plain file name: nothing outside the directory), else the one file (model_open). */
static mha_status file_of(const hf_model *m, const char *name, const char **out, mha_error *err) {
    *out = m->single;
    if (!m->weight_map)
        return MHA_STATUS_OK;
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(m->weight_map, name);
    if (!f)
        return MHA_STATUS_NOT_FOUND; /* callers word the message */
    MHA_RETURN_IF(!cJSON_IsString(f) || !f->valuestring[0] || strchr(f->valuestring, '/') ||
                      strcmp(f->valuestring, ".") == 0 || strcmp(f->valuestring, "..") == 0 ||
                      strlen(f->valuestring) >= HF_MAX_PATH / 2,
                  err, BAD_FILE,
                  "%s: \"weight_map\" entry of '%s' is not a file name in the model directory",
                  m->index_path, name);
    *out = f->valuestring;
    return MHA_STATUS_OK;
}

/* Opens the safetensors file holding `name` (or keeps it open). */
static mha_status model_file_for(hf_model *m, const char *name, mha_error *err) {
    const char *file;
    mha_status st = file_of(m, name, &file, err);
    MHA_RETURN_IF(st == MHA_STATUS_NOT_FOUND, err, NOT_FOUND,
                  "%s: no tensor '%s' in \"weight_map\"", m->index_path, name);
    if (st != MHA_STATUS_OK)
        return st;
    if (m->file && strcmp(m->file_name, file) == 0)
        return MHA_STATUS_OK;
    mha__st_close(m->file);
    m->file = NULL;
    char path[HF_MAX_PATH];
    st = join(path, m->dir, file, err);
    if (st == MHA_STATUS_OK)
        st = mha__st_open(path, &m->file, err);
    if (st == MHA_STATUS_OK)
        snprintf(m->file_name, sizeof m->file_name, "%s", file);
    return st;
}

/* 1 when the model has a tensor `name` (in the index, or in model.safetensors). */
static int model_has(hf_model *m, const char *name, mha_status *st, mha_error *err) {
    const char *file;
    *st = file_of(m, name, &file, err);
    if (*st == MHA_STATUS_NOT_FOUND) {
        *st = MHA_STATUS_OK;
        return 0;
    }
    if (*st != MHA_STATUS_OK)
        return 0;
    if (m->weight_map)
        return 1;
    if ((*st = model_file_for(m, name, err)) != MHA_STATUS_OK)
        return 0;
    int32_t nd;
    int64_t shape[8];
    return mha__st_has(m->file, name, &nd, shape);
}

/* prefix + stem + suffix into buf (sized MHA_HF_TEXT_SIZE * 2). */
static void tensor_name(char *buf, const hf_model *m, const char *stem, const char *suffix) {
    snprintf(buf, 2 * MHA_HF_TEXT_SIZE, "%s%s%s", m->prefix, stem, suffix);
}

/* ---------------------------------------------------------------------------------------------- */
/* config.json fields                                                                             */
/* ---------------------------------------------------------------------------------------------- */

/* The field `key` of `obj`, or NULL when absent or JSON null (HF writes null for "not set"). */
static const cJSON *field(const cJSON *obj, const char *key) {
    const cJSON *f = obj ? cJSON_GetObjectItemCaseSensitive(obj, key) : NULL;
    return f && !cJSON_IsNull(f) ? f : NULL;
}

/* 1 when `key` is present as JSON null ("not set", as opposed to absent: the class default). */
static int is_null(const cJSON *obj, const char *key) {
    return cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(obj, key));
}

/* An integer field in [lo, hi]; *out keeps its value (the default) when absent, unless required. */
static mha_status get_int(const hf_model *m,
                          const cJSON *obj,
                          const char *key,
                          int required,
                          int64_t lo,
                          int64_t hi,
                          int64_t *out,
                          mha_error *err) {
    const cJSON *f = field(obj, key);
    MHA_RETURN_IF(!f && required, err, BAD_FILE, "%s: no \"%s\"", m->config_path, key);
    if (!f)
        return MHA_STATUS_OK;
    const double d = cJSON_IsNumber(f) ? f->valuedouble : (double)NAN;
    MHA_RETURN_IF(!(d >= (double)lo && d <= (double)hi) || d != floor(d), err, BAD_FILE,
                  "%s: \"%s\" must be an integer in [%lld, %lld]", m->config_path, key,
                  (long long)lo, (long long)hi);
    *out = (int64_t)d;
    return MHA_STATUS_OK;
}

/* A finite number field in (lo, hi] (lo_open) or [lo, hi]; default kept when absent. */
static mha_status get_num(const hf_model *m,
                          const cJSON *obj,
                          const char *where,
                          const char *key,
                          double lo,
                          int lo_open,
                          double hi,
                          double *out,
                          mha_error *err) {
    const cJSON *f = field(obj, key);
    if (!f)
        return MHA_STATUS_OK;
    const double d = cJSON_IsNumber(f) ? f->valuedouble : (double)NAN;
    MHA_RETURN_IF(!(lo_open ? d > lo : d >= lo) || !(d <= hi), err, BAD_FILE,
                  "%s: \"%s%s\" must be a number in %c%g, %g]", m->config_path, where, key,
                  lo_open ? '(' : '[', lo, hi);
    *out = d;
    return MHA_STATUS_OK;
}

static mha_status
get_bool(const hf_model *m, const cJSON *obj, const char *key, int *out, mha_error *err) {
    const cJSON *f = field(obj, key);
    if (!f)
        return MHA_STATUS_OK;
    MHA_RETURN_IF(!cJSON_IsBool(f), err, BAD_FILE, "%s: \"%s\" must be true or false",
                  m->config_path, key);
    *out = cJSON_IsTrue(f) ? 1 : 0;
    return MHA_STATUS_OK;
}

/* A string field, or NULL when absent; BAD_FILE when present and not a string. */
static mha_status
get_str(const hf_model *m, const cJSON *obj, const char *key, const char **out, mha_error *err) {
    const cJSON *f = field(obj, key);
    *out = NULL;
    if (!f)
        return MHA_STATUS_OK;
    MHA_RETURN_IF(!cJSON_IsString(f), err, BAD_FILE, "%s: \"%s\" must be a string", m->config_path,
                  key);
    *out = f->valuestring;
    return MHA_STATUS_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* Sizes, biases, scale, soft-cap, sinks                                                          */
/* ---------------------------------------------------------------------------------------------- */

static int is_type(const hf_model *m, const char *type) {
    return strcmp(m->arch->type, type) == 0;
}

/* hidden size, heads, kv heads, head_dim, layers; Falcon's fused order. */
static mha_status read_sizes(hf_model *m, mha_hf_layer_info *info, mha_error *err) {
    const cJSON *c = m->config;
    const int gpt2 = is_type(m, "gpt2");
    mha_config *cfg = &info->config;
    int64_t hidden = 0, h = 0, layers = 0;
    MHA_TRY(get_int(m, c, gpt2 ? "n_embd" : "hidden_size", 1, 1, HF_MAX_SIZE, &hidden, err));
    MHA_TRY(get_int(m, c, gpt2 ? "n_head" : "num_attention_heads", 1, 1, HF_MAX_HEADS, &h, err));
    MHA_TRY(get_int(m, c, gpt2 ? "n_layer" : "num_hidden_layers", 1, 1, INT32_MAX, &layers, err));
    MHA_RETURN_IF(info->layer < 0 || info->layer >= layers, err, INVALID_ARG,
                  "%s: layer %lld does not exist (num_hidden_layers = %lld: 0 .. %lld)",
                  m->config_path, (long long)info->layer, (long long)layers, (long long)layers - 1);
    int64_t d = 0, g = h;
    if (m->arch->layout == LAYOUT_QKVO || m->arch->layout == LAYOUT_PHI3) {
        MHA_TRY(get_int(m, c, "head_dim", 0, 1, HF_MAX_SIZE, &d, err));
        MHA_TRY(get_int(m, c, "num_key_value_heads", 0, 1, HF_MAX_HEADS, &g, err));
    }
    m->fused = m->arch->layout == LAYOUT_NEOX ? FUSED_PER_HEAD : FUSED_CONCAT;
    if (m->arch->layout == LAYOUT_FALCON) {
        int new_arch = 0, multi_query = 1; /* FalconConfig's defaults */
        MHA_TRY(get_bool(m, c, "new_decoder_architecture", &new_arch, err));
        MHA_TRY(get_bool(m, c, "multi_query", &multi_query, err));
        if (new_arch) {
            MHA_TRY(get_int(m, c, "num_kv_heads", 0, 1, HF_MAX_HEADS, &g, err));
            m->fused = FUSED_PER_GROUP;
        } else if (multi_query) {
            g = 1;
        } else {
            m->fused = FUSED_PER_HEAD;
        }
    }
    if (d == 0) {
        MHA_RETURN_IF(hidden % h != 0, err, BAD_FILE,
                      "%s: hidden size %lld is not divisible by %lld attention heads",
                      m->config_path, (long long)hidden, (long long)h);
        d = hidden / h;
    }
    if (m->arch->layout == LAYOUT_NEOX) {
        /* GPTNeoX's projections split hidden_size / heads per head, but transformers' RoPE takes
         * a config's head_dim for its frequencies and rotated width: no layer mha builds */
        int64_t rope_d = d;
        MHA_TRY(get_int(m, c, "head_dim", 0, 1, HF_MAX_SIZE, &rope_d, err));
        MHA_RETURN_IF(
            rope_d != d, err, UNSUPPORTED,
            "%s: \"head_dim\" %lld differs from hidden_size / num_attention_heads = %lld: "
            "transformers' GPT-NeoX takes it for the rotary frequencies only; not "
            "supported",
            m->config_path, (long long)rope_d, (long long)d);
    }
    MHA_RETURN_IF(h % g != 0, err, BAD_FILE,
                  "%s: %lld key/value heads do not divide %lld attention heads", m->config_path,
                  (long long)g, (long long)h);
    info->num_layers = layers;
    cfg->q_dim = cfg->k_dim = cfg->v_dim = cfg->out_dim = hidden;
    cfg->num_heads = h;
    cfg->num_kv_heads = g;
    cfg->head_dim = cfg->v_head_dim = d;
    m->hidden = hidden;
    return MHA_STATUS_OK;
}

/* Bias flags as the architecture builds its projections. */
static mha_status read_biases(hf_model *m, mha_config *cfg, mha_error *err) {
    const cJSON *c = m->config;
    int b = 0;
    switch (m->arch->layout) {
    case LAYOUT_QKVO:
        if (is_type(m, "qwen2")) { /* q, k, v biased, o not: Qwen2Attention */
            cfg->bias_q = cfg->bias_k = cfg->bias_v = 1;
            return MHA_STATUS_OK;
        }
        b = is_type(m, "gpt_oss"); /* GptOssConfig's default */
        if (!is_type(m, "mistral") && !is_type(m, "mixtral"))
            MHA_TRY(get_bool(m, c, "attention_bias", &b, err));
        break;
    case LAYOUT_BERT:
    case LAYOUT_GPT2:
        b = 1;
        break;
    case LAYOUT_PHI3:
        b = 0;
        break;
    case LAYOUT_NEOX:
        b = 1; /* GPTNeoXConfig's default */
        MHA_TRY(get_bool(m, c, "attention_bias", &b, err));
        break;
    case LAYOUT_FALCON:
        MHA_TRY(get_bool(m, c, "bias", &b, err));
        break;
    }
    cfg->bias_q = cfg->bias_k = cfg->bias_v = cfg->bias_o = b;
    return MHA_STATUS_OK;
}

/* Fields that change the attention in ways mha's layer cannot express: refused by name. */
static mha_status refuse_unsupported(hf_model *m, mha_error *err) {
    const cJSON *c = m->config;
    const char *t = m->arch->type;
    int bidi = 0;
    if (is_type(m, "gemma3_text"))
        MHA_TRY(get_bool(m, c, "use_bidirectional_attention", &bidi, err));
    MHA_RETURN_IF(bidi, err, UNSUPPORTED,
                  "%s: \"use_bidirectional_attention\": true (Gemma 3 as an encoder, with its "
                  "own window rule) is not supported by mha",
                  m->config_path);
    const char *pe = NULL;
    MHA_TRY(get_str(m, c, "position_embedding_type", &pe, err));
    MHA_RETURN_IF(pe && strcmp(pe, "absolute") != 0, err, UNSUPPORTED,
                  "%s: \"position_embedding_type\": \"%s\" (relative position scores inside the "
                  "attention) is not supported by mha (only \"absolute\", which is outside it)",
                  m->config_path, pe);
    int alibi = 0;
    if (is_type(m, "falcon"))
        MHA_TRY(get_bool(m, c, "alibi", &alibi, err));
    MHA_RETURN_IF(alibi, err, UNSUPPORTED,
                  "%s: \"alibi\": true: Falcon adds ALiBi before the 1/sqrt(d) scaling (slopes "
                  "scaled by 1/sqrt(head_dim)), which mha's ALiBi (after scaling) does not match",
                  m->config_path);
    /* gemma3_text has the field but Gemma3Attention never applies it (transformers 5.24): read
     * and ignored, as there. */
    if (strcmp(t, "gemma2") != 0 && strcmp(t, "gemma3_text") != 0) {
        const cJSON *sc = field(c, "attn_logit_softcapping");
        MHA_RETURN_IF(sc, err, UNSUPPORTED,
                      "%s: \"attn_logit_softcapping\" is only read for gemma2, not %s",
                      m->config_path, t);
    }
    return MHA_STATUS_OK;
}

/* QK-norm (docs/SEMANTICS.md): RMSNorm per head (Qwen3, Qwen3-MoE; Gemma 3 with 1 + w) or over
 * the whole projection (OLMo 2), eps = rms_norm_eps (the config class's default when absent). */
static mha_status read_qk_norm(hf_model *m, mha_config *cfg, mha_error *err) {
    mha_qk_norm *q = &cfg->qk_norm;
    if (is_type(m, "qwen3") || is_type(m, "qwen3_moe") || is_type(m, "gemma3_text") ||
        is_type(m, "qwen3_next")) {
        q->kind = MHA_QK_NORM_RMS_HEAD;
        q->eps = 1e-6;
        q->unit_offset = is_type(m, "gemma3_text") || is_type(m, "qwen3_next");
        cfg->output_gate = is_type(m, "qwen3_next"); /* Qwen3NextAttention's gated output */
    } else if (is_type(m, "olmo2")) {
        q->kind = MHA_QK_NORM_RMS_ALL;
        q->eps = 1e-5;
    } else {
        return MHA_STATUS_OK;
    }
    MHA_TRY(get_num(m, m->config, "", "rms_norm_eps", 0.0, 1, (double)FLT_MAX, &q->eps, err));
    return MHA_STATUS_OK;
}

static mha_status read_scores(hf_model *m, mha_hf_layer_info *info, mha_error *err) {
    const cJSON *c = m->config;
    mha_config *cfg = &info->config;
    const double d = (double)cfg->head_dim;
    cfg->scale = 1.0 / sqrt(d);
    if (is_type(m, "gemma3_text")) { /* Gemma3TextConfig's default 256; no soft-cap */
        double qpas = 256.0;
        MHA_TRY(get_num(m, c, "", "query_pre_attn_scalar", 0.0, 1, 1e300, &qpas, err));
        cfg->scale = 1.0 / sqrt(qpas);
        MHA_RETURN_IF(!(cfg->scale >= (double)FLT_MIN && cfg->scale <= (double)FLT_MAX), err,
                      BAD_FILE,
                      "%s: \"query_pre_attn_scalar\" %g gives the scale 1/sqrt(%g) = %g, outside "
                      "float's range [%g, %g]",
                      m->config_path, qpas, qpas, cfg->scale, (double)FLT_MIN, (double)FLT_MAX);
    }
    if (is_type(m, "gemma2")) { /* absent: Gemma2Config's defaults 256 and 50; null: none */
        double qpas = 256.0, cap = is_null(c, "attn_logit_softcapping") ? 0.0 : 50.0;
        MHA_TRY(get_num(m, c, "", "query_pre_attn_scalar", 0.0, 1, 1e300, &qpas, err));
        cfg->scale = 1.0 / sqrt(qpas);
        /* Both are used in float arithmetic: outside float's normal range they give inf or 0
         * there (NaN outputs), so they are refused here, naming the field. */
        MHA_RETURN_IF(!(cfg->scale >= (double)FLT_MIN && cfg->scale <= (double)FLT_MAX), err,
                      BAD_FILE,
                      "%s: \"query_pre_attn_scalar\" %g gives the scale 1/sqrt(%g) = %g, outside "
                      "float's range [%g, %g]",
                      m->config_path, qpas, qpas, cfg->scale, (double)FLT_MIN, (double)FLT_MAX);
        MHA_TRY(get_num(m, c, "", "attn_logit_softcapping", 0.0, 1, 1e300, &cap, err));
        MHA_RETURN_IF(cap != 0.0 && !(cap >= (double)FLT_MIN && cap <= (double)FLT_MAX), err,
                      BAD_FILE,
                      "%s: \"attn_logit_softcapping\" %g is outside float's range [%g, %g]",
                      m->config_path, cap, (double)FLT_MIN, (double)FLT_MAX);
        cfg->softcap = cap;
    }
    if (is_type(m, "gpt2")) {
        int by_sqrt = 1, by_layer = 0;
        MHA_TRY(get_bool(m, c, "scale_attn_weights", &by_sqrt, err));
        MHA_TRY(get_bool(m, c, "scale_attn_by_inverse_layer_idx", &by_layer, err));
        cfg->scale = by_sqrt ? 1.0 / sqrt(d) : 1.0;
        if (by_layer)
            cfg->scale /= (double)(info->layer + 1);
    }
    cfg->sinks = is_type(m, "gpt_oss");
    MHA_TRY(read_qk_norm(m, cfg, err));
    info->causal = m->arch->layout != LAYOUT_BERT;
    if (m->arch->layout == LAYOUT_BERT) {
        int dec = 0;
        MHA_TRY(get_bool(m, c, "is_decoder", &dec, err));
        info->causal = dec;
    }
    return MHA_STATUS_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* RoPE                                                                                           */
/* ---------------------------------------------------------------------------------------------- */

static int uses_rope(const hf_model *m) {
    return m->arch->layout != LAYOUT_BERT && m->arch->layout != LAYOUT_GPT2;
}

/* The RoPE parameter object of this layer: transformers 5's "rope_parameters" (flat, or one per
 * layer type), else the config itself (4.x: rope_theta, rope_scaling, partial_rotary_factor at the
 * top level). *where names it for messages. */
static mha_status rope_params(const hf_model *m,
                              const char *layer_type,
                              const cJSON **params,
                              const cJSON **scaling,
                              const char **where,
                              mha_error *err) {
    const cJSON *rp = field(m->config, "rope_parameters");
    *params = m->config;
    *scaling = field(m->config, "rope_scaling");
    *where = "rope_scaling.";
    /* transformers: rope_parameters = rope_scaling or rope_parameters (a non-empty rope_scaling
     * replaces rope_parameters whole; its rope_theta is then the top-level one). */
    const int scaling_set = cJSON_IsObject(*scaling) && (*scaling)->child;
    /* Gemma3TextConfig instead merges rope_scaling into rope_parameters.full_attention. */
    MHA_RETURN_IF(rp && scaling_set && is_type(m, "gemma3_text"), err, UNSUPPORTED,
                  "%s: both \"rope_parameters\" and \"rope_scaling\": Gemma 3 merges "
                  "rope_scaling into rope_parameters.full_attention, which mha does not: give one",
                  m->config_path);
    if (!rp || scaling_set)
        return MHA_STATUS_OK;
    MHA_RETURN_IF(!cJSON_IsObject(rp), err, BAD_FILE, "%s: \"rope_parameters\" is not an object",
                  m->config_path);
    /* Gemma3TextConfig reads only rope_parameters.sliding_attention / .full_attention (a flat
     * object's keys are ignored there): refused rather than read as either. */
    MHA_RETURN_IF(is_type(m, "gemma3_text") && !field(rp, "sliding_attention") &&
                      !field(rp, "full_attention"),
                  err, UNSUPPORTED,
                  "%s: \"rope_parameters\" of gemma3_text must hold \"sliding_attention\" and "
                  "\"full_attention\" objects (transformers ignores a flat one)",
                  m->config_path);
    if (!field(rp, "rope_type") && !field(rp, "rope_theta") && layer_type &&
        field(rp, layer_type)) {
        rp = field(rp, layer_type);
        MHA_RETURN_IF(!cJSON_IsObject(rp), err, BAD_FILE,
                      "%s: \"rope_parameters.%s\" is not an object", m->config_path, layer_type);
    }
    *params = rp;
    *scaling = rp;
    *where = "rope_parameters.";
    return MHA_STATUS_OK;
}

/* YaRN's cos/sin factor as transformers computes it: 0.1 ln(s) + 1 (1 for s <= 1), or the ratio
 * of that with mscale and with mscale_all_dim when both are given. */
static double yarn_mscale(double factor, double mscale) {
    return factor <= 1.0 ? 1.0 : 0.1 * mscale * log(factor) + 1.0;
}

/* original_max_position_embeddings of a llama3 / yarn / longrope scaling `s`, as transformers'
 * standardize_rope_params sets it: a top-level value (Phi-3 keeps it there) wins over the one in
 * a flat rope_parameters / rope_scaling object; per-layer-type objects keep their own. *orig is
 * left as it is when neither is given. */
static mha_status read_original_len(
    const hf_model *m, const cJSON *s, const char *where, double *orig, mha_error *err) {
    MHA_TRY(get_num(m, s, where, "original_max_position_embeddings", 0.0, 1, 1e15, orig, err));
    const int flat =
        s == field(m->config, "rope_parameters") || s == field(m->config, "rope_scaling");
    if (flat)
        MHA_TRY(
            get_num(m, m->config, "", "original_max_position_embeddings", 0.0, 1, 1e15, orig, err));
    return MHA_STATUS_OK;
}

static mha_status
read_yarn(const hf_model *m, const cJSON *s, const char *where, mha_rope *r, mha_error *err) {
    double maxpos = 0.0, orig = 0.0, factor = 0.0, af = 0.0, ms = 0.0, msa = 0.0;
    MHA_TRY(get_num(m, m->config, "", "max_position_embeddings", 0.0, 1, 1e15, &maxpos, err));
    orig = maxpos;
    MHA_TRY(read_original_len(m, s, where, &orig, err));
    MHA_RETURN_IF(orig <= 0.0, err, BAD_FILE,
                  "%s: YaRN needs \"%soriginal_max_position_embeddings\" or "
                  "\"max_position_embeddings\"",
                  m->config_path, where);
    factor = maxpos / orig;
    MHA_TRY(get_num(m, s, where, "factor", 0.0, 1, 1e15, &factor, err));
    MHA_RETURN_IF(factor <= 0.0, err, BAD_FILE, "%s: YaRN needs \"%sfactor\"", m->config_path,
                  where);
    MHA_TRY(get_num(m, s, where, "mscale", 0.0, 0, 1e15, &ms, err));
    MHA_TRY(get_num(m, s, where, "mscale_all_dim", 0.0, 0, 1e15, &msa, err));
    af = ms != 0.0 && msa != 0.0 ? yarn_mscale(factor, ms) / yarn_mscale(factor, msa)
                                 : yarn_mscale(factor, 1.0);
    MHA_TRY(get_num(m, s, where, "attention_factor", 0.0, 1, 1e15, &af, err));
    r->beta_fast = 32.0;
    r->beta_slow = 1.0;
    MHA_TRY(get_num(m, s, where, "beta_fast", 0.0, 1, 1e15, &r->beta_fast, err));
    MHA_TRY(get_num(m, s, where, "beta_slow", 0.0, 1, 1e15, &r->beta_slow, err));
    int truncate = 1;
    MHA_TRY(get_bool(m, s, "truncate", &truncate, err));
    r->yarn_no_truncate = !truncate;
    r->scaling = MHA_ROPE_SCALING_YARN;
    r->factor = factor;
    r->original_max_position = orig;
    r->attention_factor = af;
    return MHA_STATUS_OK;
}

static mha_status
read_llama3(const hf_model *m, const cJSON *s, const char *where, mha_rope *r, mha_error *err) {
    static const char *const keys[] = {"factor", "low_freq_factor", "high_freq_factor",
                                       "original_max_position_embeddings"};
    double *dst[] = {&r->factor, &r->low_freq_factor, &r->high_freq_factor,
                     &r->original_max_position};
    for (int i = 0; i < 4; i++) {
        *dst[i] = 0.0;
        if (i == 3)
            MHA_TRY(read_original_len(m, s, where, dst[i], err));
        else
            MHA_TRY(get_num(m, s, where, keys[i], 0.0, 1, 1e15, dst[i], err));
        MHA_RETURN_IF(*dst[i] == 0.0, err, BAD_FILE, "%s: llama3 RoPE scaling needs \"%s%s\"",
                      m->config_path, where, keys[i]);
    }
    MHA_RETURN_IF(r->high_freq_factor <= r->low_freq_factor, err, BAD_FILE,
                  "%s: \"%shigh_freq_factor\" must exceed \"%slow_freq_factor\"", m->config_path,
                  where, where);
    r->scaling = MHA_ROPE_SCALING_LLAMA3;
    return MHA_STATUS_OK;
}

/* transformers' "dynamic" NTK: the length it compares with is max_position_embeddings (not an
 * original_max_position_embeddings); the layer takes the rope at each call's length. */
static mha_status
read_dynamic(const hf_model *m, const cJSON *s, const char *where, mha_rope *r, mha_error *err) {
    r->factor = 0.0;
    MHA_TRY(get_num(m, s, where, "factor", 0.0, 1, 1e15, &r->factor, err));
    MHA_RETURN_IF(r->factor == 0.0, err, BAD_FILE, "%s: dynamic RoPE scaling needs \"%sfactor\"",
                  m->config_path, where);
    r->original_max_position = 0.0;
    MHA_TRY(get_num(m, m->config, "", "max_position_embeddings", 0.0, 1, 1e15,
                    &r->original_max_position, err));
    MHA_RETURN_IF(r->original_max_position == 0.0, err, BAD_FILE,
                  "%s: dynamic RoPE scaling needs \"max_position_embeddings\"", m->config_path);
    r->scaling = MHA_ROPE_SCALING_DYNAMIC;
    return MHA_STATUS_OK;
}

/* One of LongRoPE's factor lists: exactly rotary_dim / 2 numbers, each finite and > 0. */
static mha_status read_factor_list(const hf_model *m,
                                   const cJSON *s,
                                   const char *where,
                                   const char *key,
                                   int64_t pairs,
                                   double *out,
                                   mha_error *err) {
    const cJSON *f = field(s, key);
    MHA_RETURN_IF(!cJSON_IsArray(f) || cJSON_GetArraySize(f) != pairs, err, BAD_FILE,
                  "%s: \"%s%s\" must be a list of %lld numbers (rotary_dim / 2)", m->config_path,
                  where, key, (long long)pairs);
    int64_t k = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, f) {
        const double v = cJSON_IsNumber(e) ? e->valuedouble : (double)NAN;
        MHA_RETURN_IF(!isfinite(v) || v <= 0.0, err, BAD_FILE,
                      "%s: \"%s%s\"[%lld] must be a finite number > 0", m->config_path, where, key,
                      (long long)k);
        out[k++] = v;
    }
    return MHA_STATUS_OK;
}

/* transformers' "longrope" (_compute_longrope_parameters): per-pair divisors, the long list for
 * calls longer than original_max_position_embeddings; factor defaults to max_position_embeddings
 * / original, the attention factor to sqrt(1 + ln(factor) / ln(original)) (1 if factor <= 1). */
static mha_status
read_longrope(const hf_model *m, const cJSON *s, const char *where, mha_rope *r, mha_error *err) {
    const int64_t pairs = r->rotary_dim / 2;
    MHA_RETURN_IF(pairs > MHA_ROPE_MAX_PAIRS, err, UNSUPPORTED,
                  "%s: longrope RoPE over %lld pairs: mha keeps factors for at most %d",
                  m->config_path, (long long)pairs, MHA_ROPE_MAX_PAIRS);
    MHA_TRY(read_factor_list(m, s, where, "short_factor", pairs, r->short_factor, err));
    MHA_TRY(read_factor_list(m, s, where, "long_factor", pairs, r->long_factor, err));
    double maxpos = 0.0, orig = 0.0, factor = 0.0, af = 0.0;
    MHA_TRY(get_num(m, m->config, "", "max_position_embeddings", 0.0, 1, 1e15, &maxpos, err));
    MHA_TRY(
        get_num(m, m->config, "", "original_max_position_embeddings", 0.0, 1, 1e15, &orig, err));
    MHA_TRY(read_original_len(m, s, where, &orig, err));
    MHA_RETURN_IF(orig == 0.0, err, BAD_FILE,
                  "%s: longrope RoPE scaling needs \"%soriginal_max_position_embeddings\"",
                  m->config_path, where);
    /* A context length; ln(original) divides the attention factor: 1 gave inf, < 1 NaN. */
    MHA_RETURN_IF(orig <= 1.0, err, BAD_FILE,
                  "%s: longrope \"%soriginal_max_position_embeddings\" %g must be > 1 (a context "
                  "length; ln of it divides the attention factor)",
                  m->config_path, where, orig);
    MHA_TRY(get_num(m, s, where, "factor", 0.0, 1, 1e15, &factor, err));
    MHA_RETURN_IF(factor == 0.0 && maxpos == 0.0, err, BAD_FILE,
                  "%s: longrope RoPE scaling needs \"%sfactor\" or \"max_position_embeddings\"",
                  m->config_path, where);
    MHA_TRY(get_num(m, s, where, "attention_factor", 0.0, 1, 1e15, &af, err));
    r->scaling = MHA_ROPE_SCALING_LONGROPE;
    r->factor = factor != 0.0 ? factor : maxpos / orig;
    r->original_max_position = orig;
    r->attention_factor = af != 0.0 ? af
                          : r->factor <= 1.0
                              ? 1.0
                              : sqrt(1.0 + log(r->factor) / log(orig)); /* as transformers */
    return MHA_STATUS_OK;
}

/* No non-finite number lands in the info: the scaling's numbers computed above (factor /
 * original, attention factors, ...) must be finite, and finite in float, where the RoPE tables
 * use them. */
static mha_status check_rope_floats(const hf_model *m, const mha_rope *r, mha_error *err) {
    const struct {
        const char *name;
        double v;
    } vals[] = {
        {"factor", r->factor},
        {"original_max_position_embeddings", r->original_max_position},
        {"attention_factor", r->attention_factor},
        {"low_freq_factor", r->low_freq_factor},
        {"high_freq_factor", r->high_freq_factor},
        {"beta_fast", r->beta_fast},
        {"beta_slow", r->beta_slow},
    };
    for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++)
        MHA_RETURN_IF(!isfinite(vals[i].v) || fabs(vals[i].v) > (double)FLT_MAX, err, BAD_FILE,
                      "%s: the RoPE scaling's %s is %g (from the config), not finite in float",
                      m->config_path, vals[i].name, vals[i].v);
    return MHA_STATUS_OK;
}

/* The frequency scaling named by rope_type (or 4.x's "type"). */
static mha_status
read_scaling(const hf_model *m, const cJSON *s, const char *where, mha_rope *r, mha_error *err) {
    const char *type = NULL;
    if (s && s != m->config) {
        MHA_RETURN_IF(!cJSON_IsObject(s), err, BAD_FILE, "%s: \"rope_scaling\" is not an object",
                      m->config_path);
        MHA_TRY(get_str(m, s, "rope_type", &type, err));
        if (!type)
            MHA_TRY(get_str(m, s, "type", &type, err));
    }
    if (!type || strcmp(type, "default") == 0)
        return MHA_STATUS_OK;
    if (is_type(m, "phi3")) {
        /* Phi3Config reads the older names "su" and "yarn" as longrope and refuses any other */
        if (strcmp(type, "su") == 0 || strcmp(type, "yarn") == 0)
            type = "longrope";
        MHA_RETURN_IF(strcmp(type, "longrope") != 0, err, UNSUPPORTED,
                      "%s: \"%srope_type\": \"%s\": Phi-3 takes default or longrope (\"su\" and "
                      "\"yarn\" are read as longrope, as transformers' Phi3Config)",
                      m->config_path, where, type);
    }
    if (strcmp(type, "linear") == 0) {
        r->factor = 0.0;
        MHA_TRY(get_num(m, s, where, "factor", 0.0, 1, 1e15, &r->factor, err));
        MHA_RETURN_IF(r->factor == 0.0, err, BAD_FILE, "%s: linear RoPE scaling needs \"%sfactor\"",
                      m->config_path, where);
        r->scaling = MHA_ROPE_SCALING_LINEAR;
        return MHA_STATUS_OK;
    }
    if (strcmp(type, "llama3") == 0)
        return read_llama3(m, s, where, r, err);
    if (strcmp(type, "yarn") == 0)
        return read_yarn(m, s, where, r, err);
    if (strcmp(type, "dynamic") == 0)
        return read_dynamic(m, s, where, r, err);
    if (strcmp(type, "longrope") == 0)
        return read_longrope(m, s, where, r, err);
    return mha__fail(err, MHA_STATUS_UNSUPPORTED,
                     "%s: \"%srope_type\": \"%s\" is not supported by mha (supported: default, "
                     "linear, dynamic, llama3, yarn, longrope)",
                     m->config_path, where, type);
}

static mha_status
read_rope(hf_model *m, const char *layer_type, int rope, mha_hf_layer_info *info, mha_error *err) {
    mha_rope *r = &info->config.rope;
    memset(r, 0, sizeof *r);
    if (!rope) /* no RoPE in the architecture, or a NoPE layer */
        return MHA_STATUS_OK;
    const cJSON *p, *s;
    const char *where;
    MHA_TRY(rope_params(m, layer_type, &p, &s, &where, err));
    const char *pw = p == m->config ? "" : "rope_parameters.";
    /* transformers' rotate_half, except Cohere2 (its rotate_half pairs x[2k], x[2k+1]) and
     * Llama 4 (complex multiplication over adjacent pairs) */
    r->style =
        is_type(m, "cohere2") || is_type(m, "llama4_text") ? MHA_ROPE_INTERLEAVED : MHA_ROPE_HALF;
    /* rope_theta when the config leaves it out: the transformers config class's default_theta */
    r->theta = is_type(m, "mixtral")       ? 1e6
               : is_type(m, "gpt_oss")     ? 150000.0
               : is_type(m, "smollm3")     ? 2e6
               : is_type(m, "llama4_text") ? 500000.0
                                           : 10000.0;
    /* Gemma 3: sliding layers rotate at rope_local_base_freq (10^4) without scaling, full ones at
     * rope_theta (10^6) with rope_scaling; transformers 5 writes one rope_parameters per type. */
    const int gemma3_local =
        is_type(m, "gemma3_text") && layer_type && strcmp(layer_type, "sliding_attention") == 0;
    if (is_type(m, "gemma3_text") && !gemma3_local)
        r->theta = 1e6;
    MHA_TRY(get_num(m, p, pw, "rotary_emb_base", 1.0, 1, 1e300, &r->theta, err)); /* NeoX, 4.x */
    if (gemma3_local && p == m->config) {
        MHA_TRY(get_num(m, p, pw, "rope_local_base_freq", 1.0, 1, 1e300, &r->theta, err));
        s = NULL; /* 4.x's rope_scaling is the full layers' */
    } else {
        /* null is not "absent" here: transformers keeps None and fails computing frequencies */
        MHA_RETURN_IF(is_null(p, "rope_theta"), err, BAD_FILE,
                      "%s: \"%srope_theta\" is null: give a number (transformers' RoPE fails on "
                      "it; leave it out for the class default)",
                      m->config_path, pw);
        MHA_TRY(get_num(m, p, pw, "rope_theta", 1.0, 1, 1e300, &r->theta, err));
    }
    /* Only GPT-NeoX, Phi-3 and Qwen3-Next rotate part of each head (their modules split q and k
     * at rotary_dim); the other architectures' modules rotate the whole head and transformers
     * ignores a partial_rotary_factor there (or fails on it), so mha ignores it too. */
    double frac = is_type(m, "gpt_neox") ? 0.25 : 1.0; /* GPTNeoXConfig: rotary_pct 0.25 */
    if (is_type(m, "gpt_neox") || is_type(m, "phi3") || is_type(m, "qwen3_next")) {
        MHA_TRY(get_num(m, p, pw, "rotary_pct", 0.0, 1, 1.0, &frac, err)); /* NeoX, 4.x */
        MHA_TRY(get_num(m, p, pw, "partial_rotary_factor", 0.0, 1, 1.0, &frac, err));
    }
    const int64_t d = info->config.head_dim;
    const int64_t rd = (int64_t)((double)d * frac); /* transformers: int(head_dim * factor) */
    MHA_RETURN_IF(rd < 2 || rd % 2 != 0, err, UNSUPPORTED,
                  "%s: \"%spartial_rotary_factor\" %g of head_dim %lld rotates %lld dimensions: "
                  "mha rotates an even number >= 2",
                  m->config_path, pw, frac, (long long)d, (long long)rd);
    r->rotary_dim = rd;
    MHA_TRY(read_scaling(m, s, where, r, err));
    return check_rope_floats(m, r, err);
}

/* ---------------------------------------------------------------------------------------------- */
/* Sliding windows                                                                                */
/* ---------------------------------------------------------------------------------------------- */

/* "sliding_attention", "full_attention" or NULL (no layer_types) for this layer. */
static mha_status
layer_type_of(const hf_model *m, const mha_hf_layer_info *info, const char **out, mha_error *err) {
    *out = NULL;
    const cJSON *lt = field(m->config, "layer_types");
    if (!lt && is_type(m, "gemma3_text")) { /* 4.x: every sliding_window_pattern-th is full */
        int64_t pattern = 6;
        MHA_TRY(get_int(m, m->config, "sliding_window_pattern", 0, 1, INT32_MAX, &pattern, err));
        *out = (info->layer + 1) % pattern ? "sliding_attention" : "full_attention";
        return MHA_STATUS_OK;
    }
    /* transformers' configs of the other architectures have no layer_types (Mistral's warns
     * and ignores it): their modules slide by the architecture's rule whatever the list says. */
    static const char *const with_types[] = {"qwen2",       "qwen3",       "gemma2",
                                             "gemma3_text", "gpt_oss",     "smollm3",
                                             "cohere2",     "llama4_text", "qwen3_next"};
    int has_types = 0;
    for (size_t i = 0; i < sizeof with_types / sizeof with_types[0]; i++)
        has_types |= is_type(m, with_types[i]);
    if (!lt || !has_types)
        return MHA_STATUS_OK;
    MHA_RETURN_IF(!cJSON_IsArray(lt) || cJSON_GetArraySize(lt) != info->num_layers, err, BAD_FILE,
                  "%s: \"layer_types\" must be a list of num_hidden_layers (%lld) strings",
                  m->config_path, (long long)info->num_layers);
    const cJSON *t = cJSON_GetArrayItem(lt, (int)info->layer);
    MHA_RETURN_IF(!cJSON_IsString(t), err, BAD_FILE, "%s: \"layer_types[%lld]\" is not a string",
                  m->config_path, (long long)info->layer);
    /* Llama4TextModel makes full and chunked masks only; the others full and sliding ones. */
    const int l4 = is_type(m, "llama4_text");
    const char *other = l4 ? "chunked_attention" : "sliding_attention";
    MHA_RETURN_IF(strcmp(t->valuestring, other) != 0 &&
                      strcmp(t->valuestring, "full_attention") != 0,
                  err, UNSUPPORTED,
                  "%s: \"layer_types[%lld]\": \"%s\" is not supported by mha for %s (only "
                  "\"full_attention\" and \"%s\")",
                  m->config_path, (long long)info->layer, t->valuestring, m->arch->type, other);
    *out = t->valuestring;
    return MHA_STATUS_OK;
}

/* SmolLM3 and Llama 4: whether layer L rotates q and k. no_rope_layers[L] is 1 for a RoPE layer
 * and 0 for a NoPE one, despite its name (transformers: use_rope = no_rope_layers[layer_idx]);
 * absent (or, for llama4_text, empty: Llama4TextConfig falls back on a falsy list), every
 * no_rope_layer_interval-th layer (default 4) is NoPE: L uses RoPE iff (L + 1) % interval != 0. */
static mha_status
nope_list_has_rope(const hf_model *m, const mha_hf_layer_info *info, int *rope, mha_error *err) {
    const cJSON *l = field(m->config, "no_rope_layers");
    if (l && !(is_type(m, "llama4_text") && cJSON_IsArray(l) && cJSON_GetArraySize(l) == 0)) {
        MHA_RETURN_IF(!cJSON_IsArray(l) || cJSON_GetArraySize(l) != info->num_layers, err, BAD_FILE,
                      "%s: \"no_rope_layers\" must be a list of num_hidden_layers (%lld) "
                      "entries 0 or 1",
                      m->config_path, (long long)info->num_layers);
        const cJSON *e = cJSON_GetArrayItem(l, (int)info->layer);
        const int is_int = cJSON_IsNumber(e) && (e->valuedouble == 0.0 || e->valuedouble == 1.0);
        MHA_RETURN_IF(!is_int && !cJSON_IsBool(e), err, BAD_FILE,
                      "%s: \"no_rope_layers[%lld]\" must be 0 (NoPE) or 1 (RoPE)", m->config_path,
                      (long long)info->layer);
        *rope = is_int ? e->valuedouble == 1.0 : cJSON_IsTrue(e);
        return MHA_STATUS_OK;
    }
    int64_t interval = 4;
    MHA_TRY(get_int(m, m->config, "no_rope_layer_interval", 0, 1, INT32_MAX, &interval, err));
    *rope = (info->layer + 1) % interval != 0;
    return MHA_STATUS_OK;
}

/* Whether this layer slides, for configs without layer_types (transformers 4.x rules). */
static mha_status slides_without_types(const hf_model *m,
                                       const mha_hf_layer_info *info,
                                       int *slides,
                                       mha_error *err) {
    const int64_t L = info->layer;
    *slides = 0;
    if (is_type(m, "mistral") || is_type(m, "mixtral") || is_type(m, "phi3")) {
        *slides = 1;
    } else if (is_type(m, "qwen3_moe")) { /* Qwen3MoeAttention: every layer when enabled */
        MHA_TRY(get_bool(m, m->config, "use_sliding_window", slides, err));
    } else if (is_type(m, "qwen2") || is_type(m, "qwen3")) {
        int use = 0;
        int64_t max_window_layers = 28; /* Qwen2Config / Qwen3Config's default */
        MHA_TRY(get_bool(m, m->config, "use_sliding_window", &use, err));
        MHA_TRY(
            get_int(m, m->config, "max_window_layers", 0, 0, INT32_MAX, &max_window_layers, err));
        *slides = use && L >= max_window_layers;
    } else if (is_type(m, "gemma2") || is_type(m, "gpt_oss")) {
        *slides = L % 2 == 0; /* even layers slide */
    } else if (is_type(m, "cohere2")) {
        /* Cohere2Config without layer_types: sliding_window_pattern (default 4), every
         * pattern-th layer full */
        int64_t pattern = 4;
        MHA_TRY(get_int(m, m->config, "sliding_window_pattern", 0, 1, INT32_MAX, &pattern, err));
        *slides = (L + 1) % pattern != 0;
    } else if (is_type(m, "smollm3")) {
        /* SmolLM3Config without layer_types: the NoPE layers slide when use_sliding_window and
         * sliding_window are set */
        int use = 0, rope = 1;
        MHA_TRY(get_bool(m, m->config, "use_sliding_window", &use, err));
        MHA_TRY(nope_list_has_rope(m, info, &rope, err));
        *slides = use && !rope && field(m->config, "sliding_window") != NULL;
    }
    return MHA_STATUS_OK;
}

/* sliding_window when config.json leaves it out: the transformers config class's default. */
static int64_t default_window(const hf_model *m) {
    if (is_type(m, "mistral") || is_type(m, "gemma2") || is_type(m, "qwen2") ||
        is_type(m, "gemma3_text") || is_type(m, "cohere2"))
        return 4096;
    return is_type(m, "gpt_oss") ? 128 : 0;
}

static mha_status
read_window(hf_model *m, const char *layer_type, mha_hf_layer_info *info, mha_error *err) {
    int64_t w = is_null(m->config, "sliding_window") ? 0 : default_window(m);
    MHA_TRY(get_int(m, m->config, "sliding_window", 0, 1, INT32_MAX, &w, err));
    int slides = 0;
    if (layer_type)
        slides = strcmp(layer_type, "sliding_attention") == 0;
    else
        MHA_TRY(slides_without_types(m, info, &slides, err));
    if (!info->causal || !slides || w == 0) {
        MHA_RETURN_IF(slides && layer_type && w == 0, err, BAD_FILE,
                      "%s: layer %lld is \"sliding_attention\" but \"sliding_window\" is not set",
                      m->config_path, (long long)info->layer);
        return MHA_STATUS_OK;
    }
    /* transformers: key j is visible from query i iff i - j < sliding_window. */
    info->use_window = 1;
    info->window_left = w - 1;
    info->window_right = 0;
    return MHA_STATUS_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* NoPE layers, Llama 4's QK-norm, chunks and temperature                                         */
/* ---------------------------------------------------------------------------------------------- */

/* Whether this layer has RoPE: SmolLM3 and Llama 4 by no_rope_layers, Cohere2 on its sliding
 * layers only (Cohere2Attention rotates iff the layer has a sliding window), every other
 * architecture with RoPE on every layer. */
static mha_status layer_has_rope(const hf_model *m,
                                 const mha_hf_layer_info *info,
                                 const char *layer_type,
                                 int *rope,
                                 mha_error *err) {
    *rope = uses_rope(m);
    if (is_type(m, "smollm3") || is_type(m, "llama4_text"))
        return nope_list_has_rope(m, info, rope, err);
    if (!is_type(m, "cohere2"))
        return MHA_STATUS_OK;
    if (layer_type) {
        *rope = strcmp(layer_type, "sliding_attention") == 0;
        return MHA_STATUS_OK;
    }
    return slides_without_types(m, info, rope, err);
}

/* Llama 4 (Llama4TextAttention): RoPE layers take the weightless L2 norm of q and k after RoPE
 * (use_qk_norm, default true; eps = rms_norm_eps, default 1e-5) and, when chunked
 * (layer_types[L] "chunked_attention"; without layer_types the RoPE layers when
 * attention_chunk_size, default 8192, is not null), the chunked causal mask; NoPE layers scale q
 * by the temperature (attn_temperature_tuning, default true; floor_scale 8192, attn_scale 0.1). */
static mha_status read_llama4(
    hf_model *m, const char *layer_type, int rope, mha_hf_layer_info *info, mha_error *err) {
    const cJSON *c = m->config;
    mha_config *cfg = &info->config;
    int64_t chunk = is_null(c, "attention_chunk_size") ? 0 : 8192;
    MHA_TRY(get_int(m, c, "attention_chunk_size", 0, 1, INT32_MAX, &chunk, err));
    const int chunked = layer_type ? strcmp(layer_type, "chunked_attention") == 0 : rope && chunk;
    MHA_RETURN_IF(chunked && chunk == 0, err, BAD_FILE,
                  "%s: layer %lld is \"chunked_attention\" but \"attention_chunk_size\" is null",
                  m->config_path, (long long)info->layer);
    info->chunk_size = chunked ? chunk : 0;
    if (rope) {
        int qk = 1;
        double eps = 1e-5;
        MHA_TRY(get_bool(m, c, "use_qk_norm", &qk, err));
        MHA_TRY(get_num(m, c, "", "rms_norm_eps", 0.0, 1, (double)FLT_MAX, &eps, err));
        cfg->qk_norm.kind = qk ? MHA_QK_NORM_L2_AFTER_ROPE : MHA_QK_NORM_NONE;
        cfg->qk_norm.eps = qk ? eps : 0.0;
        return MHA_STATUS_OK;
    }
    int tune = 1;
    double floor_scale = 8192.0, attn_scale = 0.1;
    MHA_TRY(get_bool(m, c, "attn_temperature_tuning", &tune, err));
    MHA_TRY(get_num(m, c, "", "floor_scale", 0x1p-32, 0, (double)FLT_MAX, &floor_scale, err));
    MHA_TRY(get_num(m, c, "", "attn_scale", -0x1p100, 0, 0x1p100, &attn_scale, err));
    cfg->temperature.enabled = tune;
    cfg->temperature.floor_scale = tune ? floor_scale : 0.0;
    cfg->temperature.attn_scale = tune ? attn_scale : 0.0;
    return MHA_STATUS_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* Reading the config                                                                             */
/* ---------------------------------------------------------------------------------------------- */

static mha_status find_arch(hf_model *m, mha_hf_layer_info *info, mha_error *err) {
    const char *type = NULL;
    MHA_TRY(get_str(m, m->config, "model_type", &type, err));
    MHA_RETURN_IF(!type, err, BAD_FILE, "%s: no \"model_type\"", m->config_path);
    for (size_t i = 0; i < N_ARCHS; i++)
        if (strcmp(ARCHS[i].type, type) == 0)
            m->arch = &ARCHS[i];
    MHA_RETURN_IF(!m->arch &&
                      (strcmp(type, "deepseek_v2") == 0 || strcmp(type, "deepseek_v3") == 0),
                  err, UNSUPPORTED,
                  "%s: \"model_type\": \"%s\" is multi-head latent attention, which is not an "
                  "mha_layer: load it with mha_hf_mla_load (Python mha.MLA.from_pretrained)",
                  m->config_path, type);
    MHA_RETURN_IF(!m->arch, err, UNSUPPORTED,
                  "%s: \"model_type\": \"%.64s\" is not supported (supported: llama, mistral, "
                  "mixtral, qwen2, qwen3, qwen3_moe, qwen3_next, gemma, gemma2, gemma3_text, "
                  "olmo2, gpt_oss, smollm3, cohere2, llama4_text, phi3, gpt2, gpt_neox, falcon, "
                  "bert, roberta)",
                  m->config_path, type);
    snprintf(info->model_type, sizeof info->model_type, "%s", type);
    snprintf(info->layout, sizeof info->layout, "%s", m->arch->layout_text);
    return MHA_STATUS_OK;
}

/* The first of the architecture's prefixes under which the layer's first projection exists. */
static mha_status find_prefix(hf_model *m, int64_t layer, mha_error *err) {
    char name[2 * MHA_HF_TEXT_SIZE], tried[4 * MHA_HF_TEXT_SIZE] = "";
    const char *stem = STEMS[m->arch->layout][0];
    for (int i = 0; i < 2; i++) {
        snprintf(m->prefix, sizeof m->prefix, "%s%lld%s", m->arch->prefixes[i][0], (long long)layer,
                 m->arch->prefixes[i][1]);
        tensor_name(name, m, stem, ".weight");
        mha_status st;
        if (model_has(m, name, &st, err))
            return MHA_STATUS_OK;
        if (st != MHA_STATUS_OK)
            return st;
        size_t used = strlen(tried);
        snprintf(tried + used, sizeof tried - used, "%s'%s'", i ? ", " : "", name);
    }
    return mha__fail(err, MHA_STATUS_NOT_FOUND, "%s: layer %lld of model_type %s: tried %s",
                     m->weight_map ? m->index_path : m->dir, (long long)layer, m->arch->type,
                     tried);
}

static mha_status read_info(hf_model *m, int64_t layer, mha_hf_layer_info *info, mha_error *err) {
    memset(info, 0, sizeof *info);
    info->layer = layer;
    info->window_left = info->window_right = -1;
    MHA_TRY(find_arch(m, info, err));
    MHA_TRY(refuse_unsupported(m, err));
    MHA_TRY(read_sizes(m, info, err));
    MHA_TRY(read_biases(m, &info->config, err));
    MHA_TRY(read_scores(m, info, err));
    const char *layer_type = NULL;
    int rope = 0;
    MHA_TRY(layer_type_of(m, info, &layer_type, err));
    MHA_TRY(layer_has_rope(m, info, layer_type, &rope, err));
    MHA_TRY(read_rope(m, layer_type, rope, info, err));
    MHA_TRY(read_window(m, layer_type, info, err));
    if (is_type(m, "llama4_text"))
        MHA_TRY(read_llama4(m, layer_type, rope, info, err));
    MHA_TRY(find_prefix(m, layer, err));
    snprintf(info->prefix, sizeof info->prefix, "%s", m->prefix);
    return MHA_STATUS_OK;
}

mha_status
mha_hf_layer_info_read(const char *dir, int64_t layer, mha_hf_layer_info *info, mha_error *err) {
    MHA_RETURN_IF(!dir || !info, err, INVALID_ARG, "mha_hf_layer_info_read: dir or info is NULL");
    hf_model m;
    mha_status st = model_open(&m, dir, err);
    if (st == MHA_STATUS_OK)
        st = read_info(&m, layer, info, err);
    model_close(&m);
    if (st == MHA_STATUS_OK)
        mha__ok(err);
    return st;
}

/* ---------------------------------------------------------------------------------------------- */
/* Loading and splitting the weights                                                              */
/* ---------------------------------------------------------------------------------------------- */

/* The projections being assembled: w_q w_k w_v w_o b_q b_k b_v b_o sinks (allocator's), in the
 * config's weight_dtype (a tensor already in it is its file bytes: no widening). */
typedef struct hf_bufs {
    void *p[11]; /* ... sinks, q_norm, k_norm */
} hf_bufs;

/* Reads prefix + stem + suffix, which must have exactly `rows` x `cols` elements (cols 0: 1-d),
 * in the storage dtype `to` (mha__st_read). */
static mha_status read_exact(hf_model *m,
                             const char *stem,
                             const char *suffix,
                             int64_t rows,
                             int64_t cols,
                             mha_dtype to,
                             const mha_allocator *a,
                             void **out,
                             mha_error *err) {
    char name[2 * MHA_HF_TEXT_SIZE];
    tensor_name(name, m, stem, suffix);
    MHA_TRY(model_file_for(m, name, err));
    int64_t shape[2];
    MHA_TRY(mha__st_read(m->file, name, cols ? 2 : 1, to, a, out, shape, err));
    /* (a 1-d tensor's shape is printed [n]: its second number is left out, not printed 0) */
    char got[48] = "", want[48] = "";
    if (cols) {
        snprintf(got, sizeof got, ", %lld", (long long)shape[1]);
        snprintf(want, sizeof want, ", %lld", (long long)cols);
    }
    MHA_RETURN_IF(shape[0] != rows || (cols && shape[1] != cols), err, BAD_FILE,
                  "%s: tensor '%s' has shape [%lld%s], expected [%lld%s] (from %s)", m->file_name,
                  name, (long long)shape[0], got, (long long)rows, want, m->config_path);
    return MHA_STATUS_OK;
}

/* Whether the layer has the bias prefix + stem + ".bias": exactly when the config implies it
 * (`wanted`), as transformers builds the module; then the tensor must exist. A bias tensor the
 * config does not imply is not read: transformers does not build that bias and ignores the
 * tensor, so mha does too and the outputs agree (docs/MODELS.md, "Biases"). */
static mha_status has_bias(hf_model *m, const char *stem, int wanted, int *out, mha_error *err) {
    *out = 0;
    if (!wanted)
        return MHA_STATUS_OK;
    char name[2 * MHA_HF_TEXT_SIZE];
    tensor_name(name, m, stem, ".bias");
    mha_status st;
    *out = model_has(m, name, &st, err);
    if (st != MHA_STATUS_OK)
        return st;
    MHA_RETURN_IF(!*out, err, NOT_FOUND, "%s: no tensor '%s' (%s implies a bias)", m->dir, name,
                  m->config_path);
    return MHA_STATUS_OK;
}

/* In-place transpose of a [rows, cols] matrix of `es`-byte elements into [cols, rows] through a
 * scratch copy (elements moved as bytes: any storage dtype). */
static mha_status
transpose(void *x, int64_t rows, int64_t cols, size_t es, const mha_allocator *a, mha_error *err) {
    size_t bytes;
    MHA_RETURN_IF(!mha__bytes(rows * cols, es, &bytes), err, OVERFLOW, "too large");
    char *t = mha__alloc(a, bytes);
    MHA_RETURN_IF(!t, err, NO_MEMORY, "cannot allocate %zu bytes", bytes);
    const char *src = x;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++)
            memcpy(t + (size_t)(c * rows + r) * es, src + (size_t)(r * cols + c) * es, es);
    memcpy(x, t, bytes);
    mha__free(a, t);
    return MHA_STATUS_OK;
}

/* The fused block (of d rows) that holds head t of role (0 q, 1 k, 2 v). */
static int64_t fused_block(hf_fused f, int role, int64_t t, int64_t h, int64_t g) {
    const int64_t r = h / g;
    switch (f) {
    case FUSED_PER_HEAD:
        return 3 * t + role;
    case FUSED_PER_GROUP:
        return role == 0 ? (t / r) * (r + 2) + t % r : t * (r + 2) + r + role - 1;
    default:
        return role == 0 ? t : role == 1 ? h + t : h + g + t;
    }
}

/* Splits a fused [fused_rows, cols] matrix (cols 1: a bias), named `name`, in c->weight_dtype,
 * into new q [h d], k [g d], v [g d]. Every block read is checked against fused_rows, the
 * tensor's own row count, whatever the sizes in `c` say (they may come from flags or the
 * caller's config). */
static mha_status split_fused(const hf_model *m,
                              const char *name,
                              const void *fused,
                              int64_t fused_rows,
                              int64_t cols,
                              const mha_config *c,
                              const mha_allocator *a,
                              void **dst,
                              mha_error *err) {
    const int64_t h = c->num_heads, g = c->num_kv_heads, d = c->head_dim;
    const size_t es = mha__storage_size(c->weight_dtype);
    for (int role = 0; role < 3; role++) {
        const int64_t heads = role == 0 ? h : g;
        size_t bytes;
        MHA_RETURN_IF(!mha__bytes(heads * d * cols, es, &bytes), err, OVERFLOW,
                      "%s: projection too large", m->dir);
        dst[role] = mha__alloc(a, bytes);
        MHA_RETURN_IF(!dst[role], err, NO_MEMORY, "%s: out of memory", m->dir);
        for (int64_t t = 0; t < heads; t++) {
            const int64_t b = fused_block(m->fused, role, t, h, g);
            MHA_RETURN_IF(b < 0 || b >= fused_rows / d, err, BAD_FILE,
                          "%s: tensor '%s' has %lld rows, but %lld heads and %lld key/value "
                          "heads of %lld rows read its row block %lld",
                          m->file_name, name, (long long)fused_rows, (long long)h, (long long)g,
                          (long long)d, (long long)b);
            memcpy((char *)dst[role] + (size_t)(t * d * cols) * es,
                   (const char *)fused + (size_t)(b * d * cols) * es, (size_t)(d * cols) * es);
        }
    }
    return MHA_STATUS_OK;
}

/* q, k, v (and biases) from a fused tensor: Phi-3, GPT-2 (transposed), NeoX, Falcon. */
static mha_status
load_fused(hf_model *m, const mha_config *c, const mha_allocator *a, hf_bufs *b, mha_error *err) {
    const char *stem = STEMS[m->arch->layout][0];
    const int gpt2 = m->arch->layout == LAYOUT_GPT2;
    char wname[2 * MHA_HF_TEXT_SIZE], bname[2 * MHA_HF_TEXT_SIZE];
    tensor_name(wname, m, stem, ".weight");
    tensor_name(bname, m, stem, ".bias");
    /* [h, 3, d] holds one k and one v per query head: no override can make it grouped. */
    MHA_RETURN_IF(m->fused == FUSED_PER_HEAD && c->num_kv_heads != c->num_heads, err, BAD_FILE,
                  "%s: tensor '%s' stores q, k, v per head ([h, 3, d], %s): num_kv_heads must "
                  "equal num_heads %lld, not %lld",
                  m->dir, wname, m->config_path, (long long)c->num_heads,
                  (long long)c->num_kv_heads);
    int64_t rows; /* (h + 2g) d */
    MHA_RETURN_IF(!mha__mul_i64(c->num_heads + 2 * c->num_kv_heads, c->head_dim, &rows), err,
                  OVERFLOW, "%s: sizes overflow", m->config_path);
    const mha_dtype dt = c->weight_dtype;
    void *fused = NULL, *fused_bias = NULL;
    int bias = 0;
    mha_status st = gpt2 ? read_exact(m, stem, ".weight", m->hidden, rows, dt, a, &fused, err)
                         : read_exact(m, stem, ".weight", rows, m->hidden, dt, a, &fused, err);
    if (st == MHA_STATUS_OK && gpt2) /* Conv1D keeps [in, out]: y = x W */
        st = transpose(fused, m->hidden, rows, mha__storage_size(dt), a, err);
    if (st == MHA_STATUS_OK)
        st = split_fused(m, wname, fused, rows, m->hidden, c, a, b->p, err);
    if (st == MHA_STATUS_OK)
        st = has_bias(m, stem, c->bias_q, &bias, err);
    if (st == MHA_STATUS_OK && bias)
        st = read_exact(m, stem, ".bias", rows, 0, dt, a, &fused_bias, err);
    if (st == MHA_STATUS_OK && bias)
        st = split_fused(m, bname, fused_bias, rows, 1, c, a, b->p + 4, err);
    mha__free(a, fused);
    mha__free(a, fused_bias);
    return st;
}

/* Qwen3-Next's q_proj rows [h, 2, d] (head i's query rows, then its gate rows; cols 1: the
 * bias) reordered in place into [q (h d); gate (h d)], the layer's output_gate layout. */
static mha_status ungate_interleave(void *x,
                                    int64_t h,
                                    int64_t d,
                                    int64_t cols,
                                    size_t es,
                                    const mha_allocator *a,
                                    mha_error *err) {
    size_t bytes;
    MHA_RETURN_IF(!mha__bytes(2 * h * d * cols, es, &bytes), err, OVERFLOW, "too large");
    char *t = mha__alloc(a, bytes);
    MHA_RETURN_IF(!t, err, NO_MEMORY, "cannot allocate %zu bytes", bytes);
    const size_t blk = (size_t)(d * cols) * es;
    for (int64_t i = 0; i < h; i++)
        for (int part = 0; part < 2; part++)
            memcpy(t + (size_t)(part * h + i) * blk, (const char *)x + (size_t)(2 * i + part) * blk,
                   blk);
    memcpy(x, t, bytes);
    mha__free(a, t);
    return MHA_STATUS_OK;
}

static mha_status load_separate(
    hf_model *m, const mha_config *c, const mha_allocator *a, hf_bufs *b, mha_error *err) {
    const int64_t gq = c->output_gate ? 2 : 1; /* q_proj holds the gate's rows too */
    const int64_t rows[3] = {gq * c->num_heads * c->head_dim, c->num_kv_heads * c->head_dim,
                             c->num_kv_heads * c->head_dim};
    const int32_t want[3] = {c->bias_q, c->bias_k, c->bias_v};
    for (int r = 0; r < 3; r++) {
        const char *stem = STEMS[m->arch->layout][r];
        int bias = 0;
        MHA_TRY(
            read_exact(m, stem, ".weight", rows[r], m->hidden, c->weight_dtype, a, &b->p[r], err));
        MHA_TRY(has_bias(m, stem, want[r], &bias, err));
        if (bias)
            MHA_TRY(
                read_exact(m, stem, ".bias", rows[r], 0, c->weight_dtype, a, &b->p[4 + r], err));
    }
    const size_t es = mha__storage_size(c->weight_dtype);
    if (c->output_gate)
        MHA_TRY(ungate_interleave(b->p[0], c->num_heads, c->head_dim, m->hidden, es, a, err));
    if (c->output_gate && b->p[4])
        MHA_TRY(ungate_interleave(b->p[4], c->num_heads, c->head_dim, 1, es, a, err));
    return MHA_STATUS_OK;
}

static mha_status
load_output(hf_model *m, const mha_config *c, const mha_allocator *a, hf_bufs *b, mha_error *err) {
    const char *stem = STEMS[m->arch->layout][3];
    const int64_t hd = c->num_heads * c->v_head_dim;
    const mha_dtype dt = c->weight_dtype;
    int bias = 0;
    if (m->arch->layout == LAYOUT_GPT2) {
        MHA_TRY(read_exact(m, stem, ".weight", hd, m->hidden, dt, a, &b->p[3], err));
        MHA_TRY(transpose(b->p[3], hd, m->hidden, mha__storage_size(dt), a, err));
    } else {
        MHA_TRY(read_exact(m, stem, ".weight", m->hidden, hd, dt, a, &b->p[3], err));
    }
    MHA_TRY(has_bias(m, stem, c->bias_o, &bias, err));
    if (bias)
        MHA_TRY(read_exact(m, stem, ".bias", m->hidden, 0, dt, a, &b->p[7], err));
    if (c->sinks)
        MHA_TRY(read_exact(m, "sinks", "", c->num_heads, 0, dt, a, &b->p[8], err));
    /* QK-norm weights: [head_dim] (per head) or [heads * head_dim] (OLMo 2). */
    const mha_qk_norm_kind nk = c->qk_norm.kind;
    if (nk == MHA_QK_NORM_RMS_HEAD || nk == MHA_QK_NORM_RMS_ALL) {
        const int64_t all = nk == MHA_QK_NORM_RMS_ALL;
        MHA_TRY(read_exact(m, "q_norm", ".weight", all ? c->num_heads * c->head_dim : c->head_dim,
                           0, dt, a, &b->p[9], err));
        MHA_TRY(read_exact(m, "k_norm", ".weight",
                           all ? c->num_kv_heads * c->head_dim : c->head_dim, 0, dt, a, &b->p[10],
                           err));
    }
    return MHA_STATUS_OK;
}

/* A block-weight layer (config.weight_dtype Q8_0 / Q4_0): the four float32 matrices read into b
 * (w_q [(1 + gate) h d, hidden], w_k and w_v [g d, hidden], w_o [hidden, h d]) replaced by their
 * blocks, quantised by mha_q8_0_quantize / mha_q4_0_quantize (docs/SEMANTICS.md "q8_0 weights",
 * "q4_0 weights"); biases, sinks and norms stay float32, as such a layer takes them. */
static mha_status quantize_matrices(
    hf_model *m, const mha_config *c, const mha_allocator *a, hf_bufs *b, mha_error *err) {
    const int64_t h = c->num_heads, g = c->num_kv_heads, d = c->head_dim, hid = m->hidden;
    const int64_t count[4] = {(c->output_gate ? 2 : 1) * h * d * hid, g * d * hid, g * d * hid,
                              hid * h * d}; /* <= 2^20 * 2^24 each (checked sizes) */
    MHA_RETURN_IF(hid % MHA__Q8_BLOCK != 0 || (h * d) % MHA__Q8_BLOCK != 0, err, INVALID_ARG,
                  "%s: %s weights need hidden_size (%lld) and heads * head_dim (%lld) to be "
                  "multiples of 32",
                  m->dir, c->weight_dtype == MHA_DTYPE_Q4_0 ? "q4_0" : "q8_0", (long long)hid,
                  (long long)(h * d));
    for (int i = 0; i < 4; i++) {
        void *q = mha__alloc(a, mha__weight_bytes(c->weight_dtype, count[i]));
        MHA_RETURN_IF(!q, err, NO_MEMORY, "%s: cannot allocate the quantised weights", m->dir);
        if (c->weight_dtype == MHA_DTYPE_Q4_0)
            mha__q4_quantize(b->p[i], count[i], q);
        else
            mha__q8_quantize(b->p[i], count[i], q);
        mha__free(a, b->p[i]);
        b->p[i] = q;
    }
    return MHA_STATUS_OK;
}

static mha_status load_layer(hf_model *m,
                             const mha_config *given,
                             const mha_allocator *a,
                             hf_bufs *b,
                             mha_layer **out,
                             mha_error *err) {
    mha_config c = *given;
    MHA_RETURN_IF(c.num_heads < 1 || c.num_heads > HF_MAX_HEADS || c.num_kv_heads < 1 ||
                      c.num_heads % c.num_kv_heads != 0 || c.head_dim < 1 ||
                      c.head_dim > HF_MAX_SIZE,
                  err, INVALID_ARG,
                  "%s: config: num_heads %lld, num_kv_heads %lld, head_dim %lld are not valid",
                  m->dir, (long long)c.num_heads, (long long)c.num_kv_heads, (long long)c.head_dim);
    const mha_dtype to = c.weight_dtype;
    MHA_RETURN_IF(!mha__is_float_storage(to) && !mha__is_block_weight(to), err, INVALID_ARG,
                  "%s: config.weight_dtype=%d is not MHA_DTYPE_F32 (0), MHA_DTYPE_BF16, "
                  "MHA_DTYPE_F16, MHA_DTYPE_Q8_0 or MHA_DTYPE_Q4_0",
                  m->dir, (int)to);
    if (mha__is_block_weight(to)) /* read in float32, the projections quantised below */
        c.weight_dtype = MHA_DTYPE_F32;
    c.v_head_dim = c.head_dim;
    MHA_RETURN_IF(c.output_gate && m->arch->layout != LAYOUT_QKVO, err, INVALID_ARG,
                  "%s: config.output_gate: the gate's rows are read from a separate q_proj, which "
                  "model_type %s does not have",
                  m->dir, m->arch->type);
    if (m->arch->layout == LAYOUT_QKVO || m->arch->layout == LAYOUT_BERT)
        MHA_TRY(load_separate(m, &c, a, b, err));
    else
        MHA_TRY(load_fused(m, &c, a, b, err));
    MHA_TRY(load_output(m, &c, a, b, err));
    c.q_dim = c.k_dim = c.v_dim = c.out_dim = m->hidden;
    c.bias_q = b->p[4] != NULL;
    c.bias_k = b->p[5] != NULL;
    c.bias_v = b->p[6] != NULL;
    c.bias_o = b->p[7] != NULL;
    c.sinks = b->p[8] != NULL;
    /* c.weight_dtype: the caller's (info's: float32); every tensor was read in it above, but
     * for the block types: read in float32, the four matrices quantised here. */
    if (mha__is_block_weight(to)) {
        c.weight_dtype = to;
        MHA_TRY(quantize_matrices(m, &c, a, b, err));
    }
    const mha_weights w = {b->p[0], b->p[1], b->p[2], b->p[3], b->p[4], b->p[5],
                           b->p[6], b->p[7], b->p[8], b->p[9], b->p[10]};
    mha_status st = mha_layer_create(&c, &w, MHA_WEIGHTS_COPY, a, out, err);
    if (st != MHA_STATUS_OK && err) {
        char msg[MHA_ERROR_MESSAGE_SIZE];
        memcpy(msg, err->message, sizeof msg);
        msg[sizeof msg - 1] = '\0';
        mha__fail(err, st, "%s: %s", m->dir, msg);
    }
    return st;
}

mha_status mha_hf_layer_load(const char *dir,
                             int64_t layer,
                             const mha_config *config,
                             const mha_allocator *allocator,
                             mha_layer **out,
                             mha_error *err) {
    MHA_RETURN_IF(!out, err, INVALID_ARG, "mha_hf_layer_load: out is NULL");
    *out = NULL;
    MHA_RETURN_IF(!dir, err, INVALID_ARG, "mha_hf_layer_load: dir is NULL");
    hf_model m;
    mha_hf_layer_info info;
    hf_bufs b;
    memset(&b, 0, sizeof b);
    mha_status st = model_open(&m, dir, err);
    if (st == MHA_STATUS_OK)
        st = read_info(&m, layer, &info, err);
    if (st == MHA_STATUS_OK)
        st = load_layer(&m, config ? config : &info.config, allocator, &b, out, err);
    for (int i = 0; i < 11; i++)
        mha__free(allocator, b.p[i]);
    model_close(&m);
    if (st == MHA_STATUS_OK)
        mha__ok(err);
    return st;
}

/* ---------------------------------------------------------------------------------------------- */
/* Multi-head latent attention: deepseek_v2, deepseek_v3 (docs/MODELS.md)                         */
/* ---------------------------------------------------------------------------------------------- */

static const hf_arch MLA_ARCHS[] = {
    {"deepseek_v2", LAYOUT_QKVO, LLAMA_PREFIXES,
     "MLA: q_a_proj, q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_a_layernorm, "
     "kv_b_proj, o_proj"},
    {"deepseek_v3", LAYOUT_QKVO, LLAMA_PREFIXES,
     "MLA: q_a_proj, q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_a_layernorm, "
     "kv_b_proj, o_proj"},
};

/* The MLA sizes, biases and layer count of config.json (each rank and head size an integer
 * >= 1, q_lora_rank null or absent = plain q_proj). */
static mha_status
mla_sizes(hf_model *m, mha_hf_layer_info *info, mha_mla_config *c, mha_error *err) {
    const cJSON *j = m->config;
    int64_t layers = 0;
    MHA_TRY(get_int(m, j, "hidden_size", 1, 1, HF_MAX_SIZE, &c->hidden, err));
    MHA_TRY(get_int(m, j, "num_attention_heads", 1, 1, HF_MAX_HEADS, &c->num_heads, err));
    MHA_TRY(get_int(m, j, "num_hidden_layers", 1, 1, INT32_MAX, &layers, err));
    MHA_RETURN_IF(info->layer < 0 || info->layer >= layers, err, INVALID_ARG,
                  "%s: layer %lld does not exist (num_hidden_layers = %lld: 0 .. %lld)",
                  m->config_path, (long long)info->layer, (long long)layers, (long long)layers - 1);
    info->num_layers = layers;
    /* transformers' class defaults (DeepSeek-V2/V3 sizes) when a field is absent. */
    c->q_lora_rank = is_null(j, "q_lora_rank") ? 0 : 1536;
    c->kv_lora_rank = 512;
    c->qk_nope_head_dim = 128;
    c->qk_rope_head_dim = 64;
    c->v_head_dim = 128;
    MHA_TRY(get_int(m, j, "q_lora_rank", 0, 1, HF_MAX_SIZE, &c->q_lora_rank, err));
    MHA_TRY(get_int(m, j, "kv_lora_rank", 0, 1, HF_MAX_SIZE, &c->kv_lora_rank, err));
    MHA_TRY(get_int(m, j, "qk_nope_head_dim", 0, 1, HF_MAX_SIZE, &c->qk_nope_head_dim, err));
    MHA_TRY(get_int(m, j, "qk_rope_head_dim", 0, 2, HF_MAX_SIZE, &c->qk_rope_head_dim, err));
    MHA_TRY(get_int(m, j, "v_head_dim", 0, 1, HF_MAX_SIZE, &c->v_head_dim, err));
    MHA_RETURN_IF(c->qk_rope_head_dim % 2 != 0, err, BAD_FILE,
                  "%s: \"qk_rope_head_dim\" %lld must be even (RoPE rotates pairs)", m->config_path,
                  (long long)c->qk_rope_head_dim);
    int bias = 0;
    MHA_TRY(get_bool(m, j, "attention_bias", &bias, err));
    c->bias = bias;
    m->hidden = c->hidden;
    return MHA_STATUS_OK;
}

/* RoPE on the qk_rope_head_dim dimensions (read_rope's parameters), interleaved pairs unless
 * deepseek_v3's rope_interleave is false (then transformers' rotate_half), and the softmax scale
 * dq^-1/2 times mscale(factor, mscale_all_dim)^2 when the rope is scaled and mscale_all_dim set
 * (transformers' yarn_apply_mscale). */
static mha_status mla_rope(hf_model *m, mha_mla_config *c, mha_error *err) {
    mha_hf_layer_info tmp;
    memset(&tmp, 0, sizeof tmp);
    tmp.config.head_dim = c->qk_rope_head_dim;
    MHA_TRY(read_rope(m, NULL, 1, &tmp, err));
    c->rope = tmp.config.rope;
    /* DeepseekV3Attention tests `if config.rope_interleave:` (bool | None, default true): null is
     * falsy there, rotate_half as false (absent is the default, true). */
    int interleave = 1;
    if (is_type(m, "deepseek_v3") && is_null(m->config, "rope_interleave"))
        interleave = 0;
    if (is_type(m, "deepseek_v3"))
        MHA_TRY(get_bool(m, m->config, "rope_interleave", &interleave, err));
    c->rope.style = interleave ? MHA_ROPE_INTERLEAVED : MHA_ROPE_HALF;
    c->scale = 1.0 / sqrt((double)(c->qk_nope_head_dim + c->qk_rope_head_dim));
    const cJSON *p, *s;
    const char *where;
    MHA_TRY(rope_params(m, NULL, &p, &s, &where, err));
    double msa = 0.0, factor = 0.0;
    if (c->rope.scaling == MHA_ROPE_SCALING_NONE || !s || s == m->config)
        return MHA_STATUS_OK;
    MHA_TRY(get_num(m, s, where, "mscale_all_dim", 0.0, 0, 1e15, &msa, err));
    if (msa == 0.0)
        return MHA_STATUS_OK;
    MHA_TRY(get_num(m, s, where, "factor", 0.0, 1, 1e15, &factor, err));
    MHA_RETURN_IF(factor == 0.0, err, BAD_FILE, "%s: \"%smscale_all_dim\" needs \"%sfactor\"",
                  m->config_path, where, where);
    const double ms = yarn_mscale(factor, msa);
    c->scale *= ms * ms;
    MHA_RETURN_IF(!(c->scale >= (double)FLT_MIN && c->scale <= (double)FLT_MAX), err, BAD_FILE,
                  "%s: the softmax scale %g (from \"%smscale_all_dim\") is not a normal float",
                  m->config_path, c->scale, where);
    return MHA_STATUS_OK;
}

/* Tensor stems of mha_mla_weights' fields, in order; suffix ".weight" or ".bias". */
static const struct {
    const char *stem, *suffix;
} MLA_TENSORS[11] = {{"q_proj", ".weight"},
                     {"q_a_proj", ".weight"},
                     {"q_a_proj", ".bias"},
                     {"q_a_layernorm", ".weight"},
                     {"q_b_proj", ".weight"},
                     {"kv_a_proj_with_mqa", ".weight"},
                     {"kv_a_proj_with_mqa", ".bias"},
                     {"kv_a_layernorm", ".weight"},
                     {"kv_b_proj", ".weight"},
                     {"o_proj", ".weight"},
                     {"o_proj", ".bias"}};

/* Reads the tensors the config uses, each of exactly its shape (rows x cols, cols 0: 1-d). */
static mha_status mla_read(
    hf_model *m, const mha_mla_config *c, const mha_allocator *a, float *p[11], mha_error *err) {
    const int64_t h = c->num_heads, dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim;
    const int64_t dq = dn + dr, r = c->kv_lora_rank, rq = c->q_lora_rank, E = c->hidden;
    const int lq = rq > 0, b = c->bias;
    const int64_t shape[11][3] = {{!lq, h * dq, E},
                                  {lq, rq, E},
                                  {lq && b, rq, 0},
                                  {lq, rq, 0},
                                  {lq, h * dq, rq},
                                  {1, r + dr, E},
                                  {b, r + dr, 0},
                                  {1, r, 0},
                                  {1, h * (dn + c->v_head_dim), r},
                                  {1, E, h * c->v_head_dim},
                                  {b, E, 0}};
    for (int i = 0; i < 11; i++)
        if (shape[i][0])
            MHA_TRY(read_exact(m, MLA_TENSORS[i].stem, MLA_TENSORS[i].suffix, shape[i][1],
                               shape[i][2], MHA_DTYPE_F32, a, (void **)&p[i], err));
    return MHA_STATUS_OK;
}

/* deepseek_v3's head_dim (checked after the tensors' shapes, which name the size that
 * contradicts them first). */
static mha_status mla_head_dim(hf_model *m, const mha_mla_config *c, mha_error *err) {
    if (!is_type(m, "deepseek_v3"))
        return MHA_STATUS_OK;
    /* DeepseekV3Config keeps a config.json "head_dim" (it sets head_dim = qk_rope_head_dim before
     * reading the file's extra keys) and its rotary embedding takes its frequencies from head_dim
     * (null: hidden_size / num_attention_heads): another width rotates q_pe and k_pe with other
     * frequencies (2: one frequency for every pair) or fails there. DeepseekV2Config overwrites
     * head_dim. */
    int64_t hd = is_null(m->config, "head_dim") ? c->hidden / c->num_heads : c->qk_rope_head_dim;
    MHA_TRY(get_int(m, m->config, "head_dim", 0, 1, HF_MAX_SIZE, &hd, err));
    MHA_RETURN_IF(hd != c->qk_rope_head_dim, err, UNSUPPORTED,
                  "%s: \"head_dim\" %lld%s is not \"qk_rope_head_dim\" %lld: deepseek_v3's "
                  "rotary embedding takes its frequencies from head_dim, which mha does not",
                  m->config_path, (long long)hd,
                  is_null(m->config, "head_dim") ? " (null: hidden_size / num_attention_heads)"
                                                 : "",
                  (long long)c->qk_rope_head_dim);
    return MHA_STATUS_OK;
}

static mha_status mla_find(hf_model *m, mha_hf_layer_info *info, mha_error *err) {
    const char *type = NULL;
    MHA_TRY(get_str(m, m->config, "model_type", &type, err));
    MHA_RETURN_IF(!type, err, BAD_FILE, "%s: no \"model_type\"", m->config_path);
    for (size_t i = 0; i < sizeof MLA_ARCHS / sizeof MLA_ARCHS[0]; i++)
        if (strcmp(MLA_ARCHS[i].type, type) == 0)
            m->arch = &MLA_ARCHS[i];
    MHA_RETURN_IF(!m->arch, err, UNSUPPORTED,
                  "%s: \"model_type\": \"%.64s\" is not a multi-head latent attention model mha "
                  "loads (deepseek_v2, deepseek_v3)",
                  m->config_path, type);
    snprintf(info->model_type, sizeof info->model_type, "%s", type);
    snprintf(info->layout, sizeof info->layout, "%s", m->arch->layout_text);
    return MHA_STATUS_OK;
}

/* The first of the prefixes under which the layer's kv_a_proj_with_mqa exists. */
static mha_status mla_prefix(hf_model *m, int64_t layer, mha_error *err) {
    char name[2 * MHA_HF_TEXT_SIZE];
    for (int i = 0; i < 2; i++) {
        snprintf(m->prefix, sizeof m->prefix, "%s%lld%s", m->arch->prefixes[i][0], (long long)layer,
                 m->arch->prefixes[i][1]);
        tensor_name(name, m, "kv_a_proj_with_mqa", ".weight");
        mha_status st;
        if (model_has(m, name, &st, err))
            return MHA_STATUS_OK;
        if (st != MHA_STATUS_OK)
            return st;
    }
    return mha__fail(
        err, MHA_STATUS_NOT_FOUND,
        "%s: layer %lld of model_type %s: no tensor "
        "'model.layers.%lld.self_attn.kv_a_proj_with_mqa.weight' (nor 'layers.%lld...')",
        m->weight_map ? m->index_path : m->dir, (long long)layer, m->arch->type, (long long)layer,
        (long long)layer);
}

static mha_status mla_load(hf_model *m,
                           int64_t layer,
                           const mha_allocator *a,
                           float *p[11],
                           mha_mla **out,
                           mha_hf_layer_info *info,
                           mha_error *err) {
    memset(info, 0, sizeof *info);
    info->layer = layer;
    info->causal = 1;
    info->window_left = info->window_right = -1;
    mha_mla_config c;
    memset(&c, 0, sizeof c);
    MHA_TRY(mla_find(m, info, err));
    MHA_TRY(mla_sizes(m, info, &c, err));
    MHA_TRY(mla_rope(m, &c, err));
    MHA_TRY(mla_prefix(m, layer, err));
    snprintf(info->prefix, sizeof info->prefix, "%s", m->prefix);
    MHA_TRY(mla_read(m, &c, a, p, err));
    MHA_TRY(mla_head_dim(m, &c, err));
    const mha_mla_weights w = {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9], p[10]};
    mha_status st = mha_mla_create(&c, &w, a, out, err);
    if (st != MHA_STATUS_OK && err) {
        char msg[MHA_ERROR_MESSAGE_SIZE];
        memcpy(msg, err->message, sizeof msg);
        msg[sizeof msg - 1] = '\0';
        mha__fail(err, st, "%s: %s", m->dir, msg);
    }
    return st;
}

mha_status mha_hf_mla_load(const char *dir,
                           int64_t layer,
                           const mha_allocator *allocator,
                           mha_mla **out,
                           mha_hf_layer_info *info,
                           mha_error *err) {
    MHA_RETURN_IF(!out, err, INVALID_ARG, "mha_hf_mla_load: out is NULL");
    *out = NULL;
    MHA_RETURN_IF(!dir, err, INVALID_ARG, "mha_hf_mla_load: dir is NULL");
    hf_model m;
    mha_hf_layer_info tmp;
    float *p[11] = {0};
    mha_status st = model_open(&m, dir, err);
    if (st == MHA_STATUS_OK)
        st = mla_load(&m, layer, allocator, p, out, info ? info : &tmp, err);
    for (int i = 0; i < 11; i++)
        mha__free(allocator, p[i]);
    model_close(&m);
    if (st == MHA_STATUS_OK)
        mha__ok(err);
    return st;
}
