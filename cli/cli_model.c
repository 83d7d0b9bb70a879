/* SPDX-License-Identifier: MIT */
/* cli_model.c: `mha info --model DIR [--layer L]` (and --gguf FILE), what libmha understood of a
 * Hugging Face model directory (mha_hf_layer_info_read) or a GGUF file (mha_gguf_layer_info_read):
 * the options `mha run --model DIR --layer L` (--gguf FILE) would use. */
#include "cli.h"

#include <stdio.h>
#include <string.h>

static const char *rope_style_name(mha_rope_style s) {
    return s == MHA_ROPE_HALF ? "half" : s == MHA_ROPE_INTERLEAVED ? "interleaved" : "none";
}

static const char *rope_scaling_name(mha_rope_scaling_type t) {
    static const char *const names[] = {"none", "linear",  "ntk",     "llama3",
                                        "yarn", "dynamic", "longrope"};
    return (unsigned)t < sizeof names / sizeof names[0] ? names[t] : "?";
}

static void print_rope(const mha_rope *r) {
    if (r->style == MHA_ROPE_NONE) {
        printf("rope: none\n");
        return;
    }
    printf("rope: style %s, theta %g, rotary_dim %lld, scaling %s", rope_style_name(r->style),
           r->theta, (long long)r->rotary_dim, rope_scaling_name(r->scaling));
    if (r->scaling == MHA_ROPE_SCALING_LINEAR)
        printf(" (factor %g)", r->factor);
    else if (r->scaling == MHA_ROPE_SCALING_LONGROPE)
        printf(" (factor %g, original_max %g, attention_factor %g, short_factor[0..%lld] %g .. %g, "
               "long_factor %g .. %g: the long list beyond original_max)",
               r->factor, r->original_max_position, r->attention_factor,
               (long long)(r->rotary_dim / 2 - 1), r->short_factor[0],
               r->short_factor[r->rotary_dim / 2 - 1], r->long_factor[0],
               r->long_factor[r->rotary_dim / 2 - 1]);
    else if (r->scaling == MHA_ROPE_SCALING_DYNAMIC)
        printf(" (factor %g, original_max %g: NTK at each call's length beyond it)", r->factor,
               r->original_max_position);
    else if (r->scaling == MHA_ROPE_SCALING_LLAMA3)
        printf(" (factor %g, low_freq_factor %g, high_freq_factor %g, original_max %g)", r->factor,
               r->low_freq_factor, r->high_freq_factor, r->original_max_position);
    else if (r->scaling == MHA_ROPE_SCALING_YARN)
        printf(" (factor %g, original_max %g, beta_fast %g, beta_slow %g, attention_factor %g, "
               "truncate %s)",
               r->factor, r->original_max_position, r->beta_fast, r->beta_slow, r->attention_factor,
               r->yarn_no_truncate ? "no" : "yes");
    printf("\n");
}

/* "qk-norm: rms per head (eps 1e-06, scale 1 + w), before RoPE" (docs/SEMANTICS.md). */
static void print_qk_norm(const mha_qk_norm *q) {
    static const char *const what[] = {"none", "rms per head, before RoPE",
                                       "rms over the projection, before RoPE",
                                       "l2 per head (no weights), after RoPE"};
    if (q->kind <= MHA_QK_NORM_NONE || q->kind > MHA_QK_NORM_L2_AFTER_ROPE) {
        printf("qk-norm: none\n");
        return;
    }
    printf("qk-norm: %s (eps %g%s)\n", what[q->kind], q->eps,
           q->unit_offset ? ", scale 1 + w" : "");
}

/* A multi-head latent attention model (mha_hf_mla_load): *handled = 1 when the directory's
 * model_type is one (then its layer is printed, or the loader's error). */
static int info_mla(const char *dir, int64_t layer, int *handled) {
    mha_hf_layer_info info = {0};
    mha_error err;
    mha_mla *m = NULL;
    const mha_status st = mha_hf_mla_load(dir, layer, NULL, &m, &info, &err);
    *handled = info.model_type[0] != '\0';
    if (!*handled || st != MHA_STATUS_OK)
        return *handled ? cli_lib_fail(dir, &err) : CLI_FAIL;
    const mha_mla_config *c = mha_mla_get_config(m);
    printf("model: %s\nmodel_type: %s (multi-head latent attention)\n", dir, info.model_type);
    printf("layer: %lld of %lld\n", (long long)info.layer, (long long)info.num_layers);
    printf("tensors: %s* (%s)\n", info.prefix, info.layout);
    printf("hidden size: %lld, heads: %lld\n", (long long)c->hidden, (long long)c->num_heads);
    printf("q_lora_rank: %lld%s, kv_lora_rank: %lld\n", (long long)c->q_lora_rank,
           c->q_lora_rank ? "" : " (plain q_proj)", (long long)c->kv_lora_rank);
    printf("qk_nope_head_dim: %lld, qk_rope_head_dim: %lld, v_head_dim: %lld\n",
           (long long)c->qk_nope_head_dim, (long long)c->qk_rope_head_dim,
           (long long)c->v_head_dim);
    printf("biases: %s\nrms_eps: %g\nscale: %.17g\n", c->bias ? "yes" : "no", c->rms_eps, c->scale);
    print_rope(&c->rope);
    printf("causal: yes\ncompressed cache: %lld values per token\n",
           (long long)(c->kv_lora_rank + c->qk_rope_head_dim));
    mha_mla_destroy(m);
    return CLI_OK;
}

int cli_info_model(const char *dir, const char *layer_arg, int gguf) {
    int64_t layer = 0;
    int rc;
    if (layer_arg && (rc = cli_parse_i64("--layer", layer_arg, 0, INT32_MAX, &layer)))
        return rc;
    mha_hf_layer_info info;
    mha_error err;
    if (gguf) {
        if (mha_gguf_layer_info_read(dir, layer, &info, &err) != MHA_STATUS_OK)
            return cli_lib_fail(dir, &err);
    } else if (mha_hf_layer_info_read(dir, layer, &info, &err) != MHA_STATUS_OK) {
        int handled = 0;
        rc = info_mla(dir, layer, &handled);
        return handled ? rc : cli_lib_fail(dir, &err);
    }
    const mha_config *c = &info.config;
    printf("model: %s\n", dir);
    printf("%s: %s\n", gguf ? "architecture" : "model_type", info.model_type);
    printf("layer: %lld of %lld\n", (long long)info.layer, (long long)info.num_layers);
    printf("tensors: %s* (%s)\n", info.prefix, info.layout);
    printf("hidden size: %lld\n", (long long)c->q_dim);
    printf("heads: %lld, kv heads: %lld, head_dim: %lld\n", (long long)c->num_heads,
           (long long)c->num_kv_heads, (long long)c->head_dim);
    printf("biases: q %d, k %d, v %d, o %d\n", c->bias_q != 0, c->bias_k != 0, c->bias_v != 0,
           c->bias_o != 0);
    printf("scale: %.17g\n", c->scale);
    printf("softcap: %g\n", c->softcap);
    printf("sinks: %s\n", c->sinks ? "yes" : "no");
    print_qk_norm(&c->qk_norm);
    if (c->output_gate)
        printf("output gate: A * sigmoid(x W_gate^T + b_gate) (w_q rows %lld..%lld)\n",
               (long long)(c->num_heads * c->head_dim),
               (long long)(2 * c->num_heads * c->head_dim - 1));
    const int nope_model = !strcmp(info.model_type, "smollm3") ||
                           !strcmp(info.model_type, "cohere2") ||
                           !strcmp(info.model_type, "llama4_text");
    if (nope_model && c->rope.style == MHA_ROPE_NONE)
        printf("rope: none (a NoPE layer: this model's other layers may rotate)\n");
    else
        print_rope(&c->rope);
    printf("causal: %s\n", info.causal ? "yes (bottom-right)" : "no");
    if (info.use_window)
        printf("window: %lld,%lld (--window)\n", (long long)info.window_left,
               (long long)info.window_right);
    else
        printf("window: none\n");
    if (info.chunk_size > 0)
        printf("chunked attention: %lld (keys of the query's chunk of %lld positions)\n",
               (long long)info.chunk_size, (long long)info.chunk_size);
    if (c->temperature.enabled)
        printf("temperature tuning: q times ln(floor((p + 1) / %g) + 1) * %g + 1\n",
               c->temperature.floor_scale, c->temperature.attn_scale);
    else
        printf("temperature tuning: none\n");
    return CLI_OK;
}
