/* SPDX-License-Identifier: MIT */
/* cli_run.c: `mha run`, one attention layer from a safetensors file applied to .npy tensors.
 *
 * Order of work: parse and check every option (usage errors, exit 2), load the weights, read every
 * input file and check all shapes against each other and against the layer (exit 1, one line
 * naming the file), run the layer, then write the outputs atomically. When both --out and --attn
 * are given and the second write fails, the first is removed, so nothing half-done is left.
 */
#include "cli_run_common.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const cli_opt run_flags[O_COUNT] = {
    [O_HELP] = {"--help", CLI_OPT_FLAG},
    [O_WEIGHTS] = {"--weights", CLI_OPT_VALUE},
    [O_MODEL] = {"--model", CLI_OPT_VALUE},
    [O_GGUF] = {"--gguf", CLI_OPT_VALUE},
    [O_LAYER] = {"--layer", CLI_OPT_VALUE},
    [O_PREFIX] = {"--prefix", CLI_OPT_VALUE},
    [O_NAMES] = {"--names", CLI_OPT_VALUE},
    [O_HEADS] = {"--heads", CLI_OPT_VALUE},
    [O_KV_HEADS] = {"--kv-heads", CLI_OPT_VALUE},
    [O_INPUT] = {"--input", CLI_OPT_VALUE},
    [O_KEY] = {"--key", CLI_OPT_VALUE},
    [O_VALUE] = {"--value", CLI_OPT_VALUE},
    [O_CAUSAL] = {"--causal", CLI_OPT_OPTIONAL},
    [O_CAUSAL_OFFSETS] = {"--causal-offsets", CLI_OPT_VALUE},
    [O_WINDOW] = {"--window", CLI_OPT_VALUE},
    [O_CHUNK_SIZE] = {"--chunk-size", CLI_OPT_VALUE},
    [O_MASK] = {"--mask", CLI_OPT_VALUE},
    [O_MASK_MEANS] = {"--mask-means", CLI_OPT_VALUE},
    [O_KPM] = {"--key-padding-mask", CLI_OPT_VALUE},
    [O_Q_SEGMENTS] = {"--q-segments", CLI_OPT_VALUE},
    [O_KV_SEGMENTS] = {"--kv-segments", CLI_OPT_VALUE},
    [O_ROPE_THETA] = {"--rope-theta", CLI_OPT_VALUE},
    [O_ROPE_STYLE] = {"--rope-style", CLI_OPT_VALUE},
    [O_ROPE_DIM] = {"--rope-dim", CLI_OPT_VALUE},
    [O_ROPE_SCALING] = {"--rope-scaling", CLI_OPT_VALUE},
    [O_ROPE_FACTOR] = {"--rope-factor", CLI_OPT_VALUE},
    [O_ROPE_ORIGINAL_MAX] = {"--rope-original-max", CLI_OPT_VALUE},
    [O_ROPE_LOW_FREQ] = {"--rope-low-freq", CLI_OPT_VALUE},
    [O_ROPE_HIGH_FREQ] = {"--rope-high-freq", CLI_OPT_VALUE},
    [O_ROPE_BETA_FAST] = {"--rope-beta-fast", CLI_OPT_VALUE},
    [O_ROPE_BETA_SLOW] = {"--rope-beta-slow", CLI_OPT_VALUE},
    [O_ROPE_ATTENTION_FACTOR] = {"--rope-attention-factor", CLI_OPT_VALUE},
    [O_POSITIONS] = {"--positions", CLI_OPT_VALUE},
    [O_KEY_POSITIONS] = {"--key-positions", CLI_OPT_VALUE},
    [O_SCALE] = {"--scale", CLI_OPT_VALUE},
    [O_SOFTCAP] = {"--softcap", CLI_OPT_VALUE},
    [O_ALIBI] = {"--alibi", CLI_OPT_FLAG},
    [O_SINKS] = {"--sinks", CLI_OPT_VALUE},
    [O_DROPOUT] = {"--dropout", CLI_OPT_VALUE},
    [O_SEED] = {"--seed", CLI_OPT_VALUE},
    [O_OUT] = {"--out", CLI_OPT_VALUE},
    [O_ATTN] = {"--attn", CLI_OPT_VALUE},
    [O_ATTN_AVERAGE] = {"--attn-average", CLI_OPT_FLAG},
    [O_PLOT] = {"--plot", CLI_OPT_VALUE},
    [O_PLOT_SCALE] = {"--plot-scale", CLI_OPT_VALUE},
    [O_TOKENS] = {"--tokens", CLI_OPT_VALUE},
    [O_ATTN_STATS] = {"--attn-stats", CLI_OPT_VALUE},
    [O_STATS] = {"--stats", CLI_OPT_VALUE},
    [O_THREADS] = {"--threads", CLI_OPT_VALUE},
    [O_VERBOSE] = {"--verbose", CLI_OPT_FLAG},
    [O_IMPL] = {"--impl", CLI_OPT_VALUE},
    [O_DECODE] = {"--decode", CLI_OPT_FLAG},
    [O_PREFILL] = {"--prefill", CLI_OPT_VALUE},
    [O_CACHE_DTYPE] = {"--cache-dtype", CLI_OPT_VALUE},
    [O_DISTRIBUTED] = {"--distributed", CLI_OPT_VALUE},
    [O_SHARD_LAYOUT] = {"--shard-layout", CLI_OPT_VALUE},
    [O_ALLOW_NONFINITE] = {"--allow-nonfinite", CLI_OPT_FLAG},
    [O_DTYPE] = {"--dtype", CLI_OPT_VALUE},
    [O_WEIGHT_DTYPE] = {"--weight-dtype", CLI_OPT_VALUE},
};

void cli_run_usage(void) {
    static const char *const text[] = {
        "Usage: mha run --weights W.safetensors --heads H --input X.npy --out Y.npy [options]",
        "       mha run --model DIR --layer L --input X.npy --out Y.npy [options]",
        "       mha run --gguf FILE.gguf --layer L --input X.npy --out Y.npy [options]",
        "",
        "Runs one multi-head attention layer (projections, RoPE, masks, attention, output",
        "projection) with weights from a safetensors file on tensors from .npy files.",
        "Y.npy has the dtype of --dtype (float32 by default) and X's leading shape: X [n, q_dim]",
        "gives Y [n, out_dim] and X [B, n, q_dim] gives Y [B, n, out_dim]. Options also take the",
        "form --flag=value.",
        "",
        "Weights:",
        "  --weights W.safetensors  weights, F32/F64/F16/BF16 (or --model). Names tried: HF",
        "                           q_proj/k_proj/v_proj/o_proj (.weight, .bias); PyTorch",
        "                           nn.MultiheadAttention (in_proj_weight, out_proj.weight, ...);",
        "                           CS336 (q_proj_weight, ...). Sizes come from the tensor shapes.",
        "  --prefix P               prepended to every tensor name, e.g. model.layers.0.self_attn.",
        "                           (default: none)",
        "  --names q=A,k=B,v=C,o=D  explicit stems, \".weight\"/\".bias\" appended; sinks=NAME",
        "                           names the sink logits (default: the built-in search)",
        "  --model DIR              a Hugging Face model directory (config.json, model.safetensors",
        "                           or model.safetensors.index.json + shards): the layer's",
        "                           weights and every option its config implies (heads, RoPE,",
        "                           causal, sliding window, soft-cap, scale, sinks). Flags given",
        "                           explicitly override it; RoPE flags replace its RoPE. See",
        "                           docs/MODELS.md; `mha info --model DIR` prints what is read.",
        "  --gguf FILE.gguf         a llama.cpp GGUF file (general.architecture llama, mistral,",
        "                           qwen2, qwen3 or phi3) as --model: the layer's attention",
        "                           tensors (F32, F16, BF16, Q8_0, Q4_0, Q5_0 exactly; Q4_1, Q5_1,",
        "                           Q2_K..Q6_K dequantised to float32 as ggml does) and options;",
        "                           llama's permuted Q/K rows are put back, phi3's fused attn_qkv",
        "                           split into q, k, v. docs/MODELS.md",
        "                           \"GGUF\"; `mha info --gguf FILE` prints what is read.",
        "  --layer L                the layer of --model or --gguf, 0-based (default 0)",
        "  --heads H                number of query heads (required with --weights)",
        "  --kv-heads G             key/value heads (GQA/MQA), H % G == 0 (default: from shapes)",
        "",
        "Inputs (float32, float64, float16 or bfloat16 (ml_dtypes, '<V2'), C order). Everything",
        "is computed in float32; X, K, V are stored in --dtype: an input of another dtype is",
        "rounded to it once (nearest even), so with the default f32 a float64 input gives",
        "float32's accuracy (relative error about 1e-7 times the problem's condition), not",
        "float64's, and a bfloat16 input is widened exactly; a value beyond the dtype's range",
        "(3.4e38 for f32 and bf16, 65504 for f16) becomes inf.",
        "  --input X.npy            queries [n, q_dim] or [B, n, q_dim] (required)",
        "  --key K.npy              cross-attention keys [m, k_dim] or [B, m, k_dim] (default: X)",
        "  --value V.npy            values [m, v_dim] or [B, m, v_dim] (default: K)",
        "",
        "Masks (combinable; a query row whose keys are all masked gives zeros, never NaN).",
        "Query i of n and key j of m share the diagonal p = i + m - n (bottom-right alignment):",
        "  --causal [ALIGN]         causal mask, key j visible iff j <= p. ALIGN: bottom-right",
        "                           (default; FlashAttention, ONNX) or top-left (p = i; PyTorch",
        "                           is_causal). ALIGN also places --window and --alibi.",
        "  --causal-offsets OFF.npy explicit diagonal per batch row, int32/int64 [B]:",
        "                           p = i + OFF[b] for --causal (plain), --window and --alibi",
        "  --window L,R             sliding window p-L <= j <= p+R; -1 = unbounded on that side",
        "                           (default: none)",
        "  --chunk-size C           chunked attention (Llama 4): key j visible iff",
        "                           floor(j/C) == floor(p/C); with --causal, Llama 4's mask",
        "  --mask M.npy             any shape that broadcasts to [B, h, n, m]. float: added to the",
        "                           scores (-inf blocks); bool/uint8/int32/int64: see --mask-means",
        "  --mask-means attend|block  nonzero = may attend (attend: SDPA, ONNX) or = masked out",
        "                           (block: nn.MultiheadAttention); a boolean --mask only, a float",
        "                           one is refused with it (default: attend)",
        "  --key-padding-mask P.npy bool/integer [B, m] or [m], nonzero = real token",
        "  --q-segments Q.npy       int32/int64 segment ids [B, n] or [n]; a query sees only keys",
        "                           of its own segment (packed documents). Needs --kv-segments",
        "  --kv-segments S.npy      key segment ids [B, m] or [m]",
        "",
        "RoPE (off unless --rope-theta or --rope-style is given):",
        "  --rope-theta T           base (default: 10000)",
        "  --rope-style S           interleaved: pairs (2i, 2i+1): RoFormer, CS336, Meta's Llama;",
        "                           half: pairs (i, i+R/2): GPT-NeoX, HF Llama",
        "                           (default: interleaved)",
        "  --rope-dim R             rotated dims per head, even; the rest pass (default: head_dim)",
        "  --positions POS.npy      int32/int64 query positions [n] or [B, n], each in [0, 2^31]",
        "                           (default: 0..n-1)",
        "  --key-positions KPOS.npy key positions [m] or [B, m] (default: the query positions for",
        "                           self-attention, 0..m-1 for cross-attention)",
        "  --rope-scaling TYPE      none, linear, ntk, dynamic, llama3 or yarn (default: none)",
        "  --rope-factor F          scaling factor (default: 1 for linear, ntk, dynamic; 8 llama3)",
        "  --rope-original-max N    original context length (default: 8192 llama3, 4096 yarn;",
        "                           dynamic: required, transformers' max_position_embeddings)",
        "  --rope-low-freq F        llama3 low_freq_factor (default: 1)",
        "  --rope-high-freq F       llama3 high_freq_factor (default: 4)",
        "  --rope-beta-fast F       yarn beta_fast (default: 32)",
        "  --rope-beta-slow F       yarn beta_slow (default: 1)",
        "  --rope-attention-factor F  yarn factor on cos and sin (default: 0.1 ln(factor) + 1)",
        "",
        "Scores:",
        "  --scale S                score scale, in [1.2e-38, 3.4e38] (float32's normal range)",
        "                           (default: 1/sqrt(d_k))",
        "  --softcap C              logit soft-capping s = C tanh(s/C), Gemma 2, C in",
        "                           [1.2e-38, 3.4e38] (default: off)",
        "  --alibi                  ALiBi: add -slope_h |p - j| (default: off)",
        "  --sinks S.npy            float [h], one learned sink logit per head, gpt-oss",
        "                           (default: none, or the weights file's \"sinks\" tensor)",
        "  --dropout P              training-mode dropout on the probabilities, 0 <= P < 1",
        "                           (default: off, i.e. inference)",
        "  --seed S                 dropout seed, 0 .. 2^64-1 (default: 0)",
        "",
        "Outputs (each written to a temporary name; all renamed once all are complete, none",
        "if any fails):",
        "  --out Y.npy              output, in --dtype (required)",
        "  --attn A.npy             also write the probabilities [B, h, n, m] ([h, n, m], 2-d X),",
        "                           float32 whatever --dtype (as --attn-stats)",
        "  --attn-average           write their mean over the heads instead: [B, n, m] ([n, m])",
        "  --plot FILE.png|svg|pdf  draw the attention maps of batch row 0, one panel per head",
        "                           (their mean with --attn-average); masked cells hatched grey;",
        "                           maps over 128 queries or keys pooled to 128 x 128 cells",
        "  --plot-scale S           colours: panel (0..99th percentile of each panel) or fixed",
        "                           (0..1) (default: panel)",
        "  --tokens FILE            the plot's labels: one token per line, one line per query",
        "                           (for keys too when there are as many)",
        "  --allow-nonfinite        write outputs holding NaN or inf although every input is",
        "                           finite (default: such an output is reported on stderr --",
        "                           which output, how many values, the first index -- nothing",
        "                           is written and the exit status is 3; docs/FORMATS.md)",
        "  --attn-stats S.npz       attention statistics without any n x m matrix (long inputs),",
        "                           an .npz (docs/FORMATS.md); choose them with --stats",
        "  --stats LIST             comma-separated: received (attention per key, per head and",
        "                           summed over heads), entropy (per query row), topk[=K] (the K",
        "                           most attended keys per row, default 8), pool[=RxC] (the map",
        "                           averaged over an R x C grid, default 256x256, with the",
        "                           visible fraction of each cell). Default: received,entropy",
        "",
        "Execution:",
        "  --threads N              threads; 0 = every online CPU (default: 0)",
        "  --verbose                report each stage and its time on stderr, the built-in",
        "                           rule a --mask equals (then run instead of the tensor) and",
        "                           how the masks divide the scores into hidden, visible and",
        "                           mixed tiles",
        "  --dtype T                f32, bf16 or f16: storage of the weights (a safetensors or",
        "                           --model checkpoint already in T is kept as it is, other",
        "                           tensors are rounded once), of X, K, V and of Y; the",
        "                           arithmetic is float32 (docs/FORMATS.md) (default: f32)",
        "  --weight-dtype T         q8_0 or q4_0, with --model or --gguf (and --dtype f32): the",
        "                           four projection matrices in q8_0 / q4_0 blocks, for",
        "                           inference (a GGUF file's Q8_0, Q4_0 and Q5_0 tensors kept",
        "                           exactly in q8_0, its Q4_0 in q4_0, other tensors quantised",
        "                           at load; docs/MODELS.md \"GGUF files\")",
        "  --impl I                 reference, fast or auto (default: auto); fast fails, naming",
        "                           the option, when it cannot run the request",
        "  --help                   this text",
        "",
        "Decoding through a KV cache (causal self-attention; docs/INFERENCE.md):",
        "  --decode                 run the input as autoregressive decoding: the first P tokens",
        "                           as one prefill, then one token per step, through a KV cache.",
        "                           Y is the full causal forward's output (same options: RoPE,",
        "                           GQA, --window L,R (keeps the last L+1 positions),",
        "                           --chunk-size C (keeps the current chunk), ALiBi,",
        "                           sinks, softcap, scale, batch; but past the original length",
        "                           of --rope-scaling dynamic or a --model's longrope, each step",
        "                           rotates at its own length, as transformers' cache does:",
        "                           docs/MODELS.md). Implies --causal; refuses --key, masks,",
        "                           segments, positions, --causal top-left, --causal-offsets,",
        "                           --attn and --dropout",
        "  --prefill P              tokens in the first (prefill) call, 1 <= P <= n (default: 1)",
        "  --cache-dtype T          cache storage f32, f16, bf16, q8_0 (head sizes multiples of",
        "                           32) or fp8 (e4m3, kv-head scales 1.0) (default: f32)",
        "  A deepseek_v2/v3 --model (multi-head latent attention) decodes through its compressed",
        "  cache ([c, k_pe] per token, mha_mla_decode_step) with --prefill and --cache-dtype",
        "  With --dtype bf16 or f16 the weights are half and X is rounded to it, but the decode",
        "  steps compute on float32 activations (X widened exactly); Y is rounded once to T",
        "",
        "Distributed: ring attention over MPI ranks (docs/distributed.md):",
        "  --distributed ring       run as mpirun -np P mha run --distributed ring ...: every",
        "                           rank reads the inputs and computes its rows of the layer",
        "                           (self-attention, ring attention between the ranks); rank 0",
        "                           gathers Y and writes the file a single-process run writes.",
        "                           Refuses --key, --value, --mask, --causal-offsets, --attn,",
        "                           --plot, --attn-stats, --decode and --dropout. --threads is",
        "                           per rank",
        "  --shard-layout L         zigzag: rank r holds chunks r and 2P-1-r of 2P (equal causal",
        "                           work) or contiguous: chunk r of P (default: zigzag)",
        "  {rank} in --input and --out: per-rank shard files for inputs larger than one machine:",
        "                           rank r reads its own rows of X (the rows --shard-layout gives",
        "                           it, in order; [B, n_r, q_dim]) and writes its own rows of Y.",
        "                           A rank the layout gives no row reads and writes zero-row",
        "                           files ([B, 0, d]). --positions, --key-positions,",
        "                           --key-padding-mask and the segment files are then per rank",
        "                           too (with {rank})",
        "",
        "Examples:",
        "  mha run --weights attn.safetensors --heads 8 --input x.npy --out y.npy",
        "  mha run --weights model.safetensors --prefix model.layers.0.self_attn. --heads 32 \\",
        "      --kv-heads 8 --rope-theta 500000 --rope-style half --causal \\",
        "      --input x.npy --out y.npy --attn a.npy",
        "  mha run --weights bert.safetensors --heads 12 --input x.npy --out y.npy \\",
        "      --names q=attention.self.query,k=attention.self.key,\\",
        "v=attention.self.value,o=attention.output.dense \\",
        "      --key-padding-mask pad.npy",
        "  mpirun -np 4 mha run --distributed ring --weights attn.safetensors --heads 8 \\",
        "      --causal --rope-theta 10000 --input x.npy --out y.npy",
        "",
        "Exit status: 0 success, 1 failure (one line on stderr naming the file), 2 usage error,",
        "3 an output holds NaN or inf although every input is finite (float32 overflow; one line",
        "naming the output, nothing written; --allow-nonfinite writes it and exits 0).",
    };
    for (size_t i = 0; i < sizeof text / sizeof text[0]; i++)
        printf("%s\n", text[i]);
}

static void run_free(run_state *s) {
    free(s->names_buf);
    mha_layer_destroy(s->layer);
    mha_layer_destroy(s->base);
    mha__npy_free(&s->x);
    mha__npy_free(&s->key);
    mha__npy_free(&s->value);
    mha__npy_free(&s->mask);
    mha__npy_free(&s->kpm);
    mha__npy_free(&s->sinks);
    free(s->xf);
    free(s->kf);
    free(s->vf);
    free(s->maskf);
    free(s->sinksf);
    free(s->out);
    free(s->sinksw);
    free(s->probs);
    free(s->qpos);
    free(s->kpos);
    free(s->offsets);
    free(s->rule_keys);
    free(s->rule_offsets);
    free(s->qseg);
    free(s->kvseg);
    free(s->tokens_buf);
    free(s->tokens);
    free(s->plot_pooled);
    free(s->plot_visible);
    stats_free(&s->stats);
}

/* ---------------------------------------------------------------------------------------------- */
/* Option checking (usage errors).                                                                */
/* ---------------------------------------------------------------------------------------------- */

static int pos_f64(const run_config *o, int id, double *out) {
    return cli_parse_f64(run_flags[id].name, o->opt[id], 0.0, 1, HUGE_VAL, 0, out);
}

/* A positive value the library uses as a float32 (--scale, --softcap, --rope-attention-factor):
 * in [FLT_MIN, FLT_MAX], so that it is neither inf nor rounded to 0 in float. */
static int pos_f32(const run_config *o, int id, double *out) {
    return cli_parse_f64(run_flags[id].name, o->opt[id], (double)FLT_MIN, 0, (double)FLT_MAX, 0,
                         out);
}

static int parse_window(const char *s, int64_t *left, int64_t *right) {
    const char *comma = strchr(s, ',');
    if (!comma || strchr(comma + 1, ','))
        return cli_usage("--window: '%s' is not LEFT,RIGHT (two integers, -1 = unbounded)", s);
    char l[64], r[64];
    size_t ll = (size_t)(comma - s), rl = strlen(comma + 1);
    if (ll == 0 || rl == 0 || ll >= sizeof l || rl >= sizeof r)
        return cli_usage("--window: '%s' is not LEFT,RIGHT (two integers, -1 = unbounded)", s);
    memcpy(l, s, ll);
    l[ll] = '\0';
    memcpy(r, comma + 1, rl + 1);
    int rc = cli_parse_i64("--window LEFT", l, -1, INT32_MAX, left);
    if (!rc)
        rc = cli_parse_i64("--window RIGHT", r, -1, INT32_MAX, right);
    return rc;
}

/* --names q=A,k=B,v=C,o=D[,sinks=S]: pointers into a private copy of the argument. */
static int parse_names(const char *s, run_state *st, mha_name_map *names) {
    size_t len = strlen(s);
    st->names_buf = malloc(len + 1);
    if (!st->names_buf)
        return cli_fail("out of memory");
    memcpy(st->names_buf, s, len + 1);
    memset(names, 0, sizeof *names);
    char *p = st->names_buf;
    while (p) {
        char *next = strchr(p, ',');
        if (next)
            *next++ = '\0';
        char *eq = strchr(p, '=');
        if (!eq || eq == p || eq[1] == '\0')
            return cli_usage("--names: '%s' is not KEY=NAME (keys q, k, v, o, sinks)", p);
        *eq = '\0';
        const char **slot = NULL;
        if (strcmp(p, "q") == 0)
            slot = &names->q;
        else if (strcmp(p, "k") == 0)
            slot = &names->k;
        else if (strcmp(p, "v") == 0)
            slot = &names->v;
        else if (strcmp(p, "o") == 0)
            slot = &names->o;
        else if (strcmp(p, "sinks") == 0)
            slot = &names->sinks;
        if (!slot)
            return cli_usage("--names: unknown key '%s' (keys q, k, v, o, sinks)", p);
        if (*slot)
            return cli_usage("--names: key '%s' given twice", p);
        *slot = eq + 1;
        p = next;
    }
    return CLI_OK;
}

/* --decode and its options; the options that make no sense when decoding are usage errors. */
static int parse_decode(run_config *o) {
    const char *const *v = o->opt;
    if (!v[O_DECODE]) {
        if (v[O_PREFILL] || v[O_CACHE_DTYPE])
            return cli_usage("%s needs --decode", v[O_PREFILL] ? "--prefill" : "--cache-dtype");
        return CLI_OK;
    }
    static const struct {
        int id;
        const char *why;
    } refused[] = {
        {O_KEY, "decoding is self-attention"},
        {O_VALUE, "decoding is self-attention"},
        {O_MASK, "decoding masks are causal only"},
        {O_KPM, "decoding masks are causal only"},
        {O_Q_SEGMENTS, "decoding masks are causal only"},
        {O_KV_SEGMENTS, "decoding masks are causal only"},
        {O_CAUSAL_OFFSETS, "decoding is bottom-right aligned"},
        {O_POSITIONS, "decoding places token t at position t"},
        {O_KEY_POSITIONS, "decoding places token t at position t"},
        {O_ATTN, "decoding does not keep the probabilities"},
        {O_PLOT, "decoding does not keep the probabilities"},
        {O_ATTN_STATS, "decoding does not keep the probabilities"},
        {O_DROPOUT, "decoding is inference"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++)
        if (v[refused[i].id])
            return cli_usage("%s cannot be used with --decode (%s)", run_flags[refused[i].id].name,
                             refused[i].why);
    if (v[O_CAUSAL] && o->alignment != MHA_ALIGN_BOTTOM_RIGHT)
        return cli_usage("--causal %s cannot be used with --decode (a cache is bottom-right "
                         "aligned)",
                         v[O_CAUSAL]);
    o->causal = 1;
    o->alignment = MHA_ALIGN_BOTTOM_RIGHT;
    o->decode = 1;
    o->prefill = 1;
    if (v[O_PREFILL]) {
        int rc = cli_parse_i64("--prefill", v[O_PREFILL], 1, INT32_MAX, &o->prefill);
        if (rc)
            return rc;
    }
    o->cache_dtype = MHA_DTYPE_F32;
    if (v[O_CACHE_DTYPE]) {
        const char *t = v[O_CACHE_DTYPE];
        if (strcmp(t, "f32") == 0)
            o->cache_dtype = MHA_DTYPE_F32;
        else if (strcmp(t, "f16") == 0)
            o->cache_dtype = MHA_DTYPE_F16;
        else if (strcmp(t, "bf16") == 0)
            o->cache_dtype = MHA_DTYPE_BF16;
        else if (strcmp(t, "q8_0") == 0)
            o->cache_dtype = MHA_DTYPE_Q8_0;
        else if (strcmp(t, "fp8") == 0 || strcmp(t, "fp8_e4m3") == 0)
            o->cache_dtype = MHA_DTYPE_FP8_E4M3;
        else
            return cli_usage("--cache-dtype: '%s' is not f32, f16, bf16, q8_0 or fp8", t);
    }
    return CLI_OK;
}

/* --dtype f32|bf16|f16: the storage of the weights, of X, K, V as the layer reads them and of Y
 * (docs/FORMATS.md "Half precision"). After parse_decode and parse_distributed: the ring runs in
 * float32 only. */
static int parse_dtype(run_config *o) {
    const char *t = o->opt[O_DTYPE];
    o->dtype = MHA_DTYPE_F32;
    if (!t)
        return CLI_OK;
    if (strcmp(t, "bf16") == 0)
        o->dtype = MHA_DTYPE_BF16;
    else if (strcmp(t, "f16") == 0)
        o->dtype = MHA_DTYPE_F16;
    else if (strcmp(t, "f32") != 0)
        return cli_usage("--dtype: '%s' is not f32, bf16 or f16", t);
    if (o->distributed && o->dtype != MHA_DTYPE_F32)
        return cli_usage("--dtype %s cannot be used with --distributed (the ring layer runs in "
                         "float32 only)",
                         t);
    return CLI_OK;
}

/* --weight-dtype q8_0 | q4_0: the projections of a --model / --gguf layer in q8_0 / q4_0 blocks
 * (docs/SEMANTICS.md "q8_0 weights", "q4_0 weights"; X and Y stay float32). After parse_dtype. */
static int parse_weight_dtype(run_config *o) {
    const char *t = o->opt[O_WEIGHT_DTYPE];
    o->weight_dtype = o->dtype;
    if (!t)
        return CLI_OK;
    if (strcmp(t, "q8_0") != 0 && strcmp(t, "q4_0") != 0)
        return cli_usage("--weight-dtype: '%s' is not q8_0 or q4_0 (--dtype sets f32, bf16 or "
                         "f16)",
                         t);
    if (!o->opt[O_MODEL] && !o->opt[O_GGUF])
        return cli_usage("--weight-dtype %s needs --model or --gguf", t);
    if (o->dtype != MHA_DTYPE_F32 || o->distributed)
        return cli_usage("--weight-dtype %s cannot be used with %s (a %s layer reads and writes "
                         "float32 and runs on one process)",
                         t, o->distributed ? "--distributed" : "--dtype bf16 / f16", t);
    o->weight_dtype = strcmp(t, "q4_0") == 0 ? MHA_DTYPE_Q4_0 : MHA_DTYPE_Q8_0;
    return CLI_OK;
}

/* --distributed ring and its options; what cannot run distributed is a usage error. */
static int parse_distributed(run_config *o) {
    const char *const *v = o->opt;
    if (!v[O_DISTRIBUTED])
        return v[O_SHARD_LAYOUT] ? cli_usage("--shard-layout needs --distributed ring") : CLI_OK;
    if (strcmp(v[O_DISTRIBUTED], "ring") != 0)
        return cli_usage("--distributed: '%s' is not ring (the one distributed algorithm)",
                         v[O_DISTRIBUTED]);
    static const struct {
        int id;
        const char *why;
    } refused[] = {
        {O_KEY, "the ring shards one self-attention sequence"},
        {O_VALUE, "the ring shards one self-attention sequence"},
        {O_MASK, "a dense mask is not cut into the ring's blocks; use --causal, --window or "
                 "--key-padding-mask"},
        {O_CAUSAL_OFFSETS, "the ring places the diagonal by global rows"},
        {O_CHUNK_SIZE, "a pair's call numbers its keys from 0, not from the sequence's position"},
        {O_ATTN, "no rank holds a whole row of probabilities"},
        {O_PLOT, "no rank holds a whole row of probabilities"},
        {O_ATTN_STATS, "no rank holds a whole row of probabilities"},
        {O_DECODE, "decoding runs in one process"},
        {O_DROPOUT, "distributed runs are inference"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++)
        if (v[refused[i].id])
            return cli_usage("%s cannot be used with --distributed (%s)",
                             run_flags[refused[i].id].name, refused[i].why);
    o->distributed = 1;
    o->zigzag = 1;
    if (v[O_SHARD_LAYOUT]) {
        if (strcmp(v[O_SHARD_LAYOUT], "contiguous") == 0)
            o->zigzag = 0;
        else if (strcmp(v[O_SHARD_LAYOUT], "zigzag") != 0)
            return cli_usage("--shard-layout: '%s' is not zigzag or contiguous", v[O_SHARD_LAYOUT]);
    }
    /* Shard-file mode: {rank} in --input and --out, and then in every per-row file. */
    o->shard_files = strstr(v[O_INPUT], "{rank}") != NULL;
    if (o->shard_files != (strstr(v[O_OUT], "{rank}") != NULL))
        return cli_usage("per-rank shard files need {rank} in both --input and --out (got it in "
                         "%s only)",
                         o->shard_files ? "--input" : "--out");
    static const int per_row[] = {O_POSITIONS, O_KEY_POSITIONS, O_KPM, O_Q_SEGMENTS, O_KV_SEGMENTS};
    for (size_t i = 0; i < sizeof per_row / sizeof per_row[0]; i++)
        if (v[per_row[i]] && o->shard_files != (strstr(v[per_row[i]], "{rank}") != NULL))
            return cli_usage("%s %s: %s", run_flags[per_row[i]].name, v[per_row[i]],
                             o->shard_files ? "with per-rank input files it is per rank too: "
                                              "put {rank} in its name"
                                            : "{rank} in its name needs per-rank --input and "
                                              "--out files");
    return CLI_OK;
}

/* --weights (with --heads), --model or --gguf (with --layer): exactly one source of weights. */
static int parse_model(run_config *o) {
    const char *const *v = o->opt;
    const int sources = !!v[O_WEIGHTS] + !!v[O_MODEL] + !!v[O_GGUF];
    if (sources != 1)
        return cli_usage(sources ? "--weights, --model and --gguf exclude each other"
                                 : "--weights (with --heads), --model or --gguf is required");
    if (v[O_WEIGHTS]) {
        if (v[O_LAYER])
            return cli_usage("--layer needs --model or --gguf");
        if (!v[O_HEADS])
            return cli_usage("--heads is required with --weights");
        o->wpath = v[O_WEIGHTS];
        return CLI_OK;
    }
    if (v[O_PREFIX] || v[O_NAMES])
        return cli_usage("%s cannot be used with %s (the names come from its architecture)",
                         v[O_PREFIX] ? "--prefix" : "--names", v[O_MODEL] ? "--model" : "--gguf");
    o->wpath = v[O_MODEL] ? v[O_MODEL] : v[O_GGUF];
    if (v[O_LAYER])
        return cli_parse_i64("--layer", v[O_LAYER], 0, INT32_MAX, &o->layer);
    return CLI_OK;
}

/* --model, --gguf: reads the layer's options from the model directory or GGUF file (exit 1
 * naming the file or the field) and takes each one the command line does not give. */
static int apply_model(run_config *o) {
    const char *const *v = o->opt;
    if (!v[O_MODEL] && !v[O_GGUF])
        return CLI_OK;
    mha_error err;
    memset(&err, 0, sizeof err);
    const mha_status st = v[O_MODEL] ? mha_hf_layer_info_read(v[O_MODEL], o->layer, &o->hf, &err)
                                     : mha_gguf_layer_info_read(v[O_GGUF], o->layer, &o->hf, &err);
    if (st != MHA_STATUS_OK)
        return cli_lib_fail(o->wpath, &err);
    mha_config *c = &o->hf.config;
    c->weight_dtype = o->weight_dtype; /* tensors already in it are kept as they are */
    if (v[O_HEADS])
        c->num_heads = o->heads;
    if (v[O_KV_HEADS])
        c->num_kv_heads = o->kv_heads;
    if (c->num_heads % c->num_kv_heads != 0)
        return cli_usage("--heads %lld is not a multiple of the model's %lld kv heads (give "
                         "--kv-heads)",
                         (long long)c->num_heads, (long long)c->num_kv_heads);
    o->heads = c->num_heads;
    o->kv_heads = c->num_kv_heads;
    if (!v[O_SCALE])
        o->scale = c->scale;
    if (!v[O_SOFTCAP])
        o->softcap = c->softcap;
    if (!v[O_ALIBI])
        o->alibi = c->alibi;
    if (!v[O_ROPE_THETA] && !v[O_ROPE_STYLE])
        o->rope = c->rope;
    if ((v[O_POSITIONS] || v[O_KEY_POSITIONS]) && o->rope.style == MHA_ROPE_NONE &&
        !(v[O_POSITIONS] && c->temperature.enabled))
        return cli_usage("%s has no effect: the model has no RoPE",
                         v[O_POSITIONS] ? "--positions" : "--key-positions");
    if (!v[O_CAUSAL] && !o->decode && o->hf.causal) {
        o->causal = 1;
        if (o->alignment != MHA_ALIGN_EXPLICIT)
            o->alignment = MHA_ALIGN_BOTTOM_RIGHT;
    }
    if (!v[O_CHUNK_SIZE]) /* Llama 4's chunked layers */
        o->chunk_size = o->hf.chunk_size;
    if (!v[O_WINDOW] && o->hf.use_window) {
        o->use_window = 1;
        o->window_left = o->hf.window_left;
        o->window_right = o->hf.window_right;
    }
    return CLI_OK;
}

/* --causal, --causal-offsets, --window, --mask-means and the segments. */
static int parse_masks(run_config *o) {
    const char *const *v = o->opt;
    int rc;
    if (v[O_CAUSAL]) {
        o->causal = 1;
        const char *c = v[O_CAUSAL];
        if (c[0] == '\0' || strcmp(c, "bottom-right") == 0)
            o->alignment = MHA_ALIGN_BOTTOM_RIGHT;
        else if (strcmp(c, "top-left") == 0)
            o->alignment = MHA_ALIGN_TOP_LEFT;
        else
            return cli_usage("--causal: '%s' is not bottom-right or top-left", c);
        if (v[O_CAUSAL_OFFSETS] && c[0] != '\0')
            return cli_usage("--causal %s conflicts with --causal-offsets", c);
    }
    if (v[O_CAUSAL_OFFSETS]) { /* the diagonal of --causal, --window and --alibi */
        if (!v[O_CAUSAL] && !v[O_WINDOW] && !v[O_ALIBI] && !v[O_CHUNK_SIZE])
            return cli_usage("--causal-offsets has no effect without --causal, --window, "
                             "--chunk-size or --alibi");
        o->alignment = MHA_ALIGN_EXPLICIT;
    }
    if (v[O_WINDOW]) {
        if ((rc = parse_window(v[O_WINDOW], &o->window_left, &o->window_right)))
            return rc;
        o->use_window = 1;
    }
    if (v[O_CHUNK_SIZE] &&
        (rc = cli_parse_i64("--chunk-size", v[O_CHUNK_SIZE], 1, INT32_MAX, &o->chunk_size)))
        return rc;
    if (v[O_MASK_MEANS]) {
        if (!v[O_MASK])
            return cli_usage("--mask-means needs --mask");
        if (strcmp(v[O_MASK_MEANS], "attend") == 0)
            o->polarity = MHA_MASK_ATTEND;
        else if (strcmp(v[O_MASK_MEANS], "block") == 0)
            o->polarity = MHA_MASK_BLOCK;
        else
            return cli_usage("--mask-means: '%s' is not attend or block", v[O_MASK_MEANS]);
    }
    if (!v[O_Q_SEGMENTS] != !v[O_KV_SEGMENTS])
        return cli_usage("%s needs %s", v[O_Q_SEGMENTS] ? "--q-segments" : "--kv-segments",
                         v[O_Q_SEGMENTS] ? "--kv-segments" : "--q-segments");
    return CLI_OK;
}

/* RoPE: --rope-theta or --rope-style turns it on; the other --rope-* options and --positions /
 * --key-positions need it (the positions also serve --model). */
static int parse_rope(run_config *o) {
    const char *const *v = o->opt;
    int rc;
    const int rope_on = v[O_ROPE_THETA] || v[O_ROPE_STYLE];
    static const int rope_only[] = {O_ROPE_DIM,       O_ROPE_SCALING,         O_POSITIONS,
                                    O_KEY_POSITIONS,  O_ROPE_FACTOR,          O_ROPE_ORIGINAL_MAX,
                                    O_ROPE_LOW_FREQ,  O_ROPE_HIGH_FREQ,       O_ROPE_BETA_FAST,
                                    O_ROPE_BETA_SLOW, O_ROPE_ATTENTION_FACTOR};
    for (size_t i = 0; i < sizeof rope_only / sizeof rope_only[0]; i++)
        if (v[rope_only[i]] && !rope_on &&
            !((v[O_MODEL] || v[O_GGUF]) &&
              (rope_only[i] == O_POSITIONS || rope_only[i] == O_KEY_POSITIONS)))
            return cli_usage("%s has no effect without RoPE (give --rope-theta or --rope-style)",
                             run_flags[rope_only[i]].name);
    if (rope_on) {
        o->rope.style = MHA_ROPE_INTERLEAVED;
        o->rope.theta = 10000.0;
        if (v[O_ROPE_STYLE]) {
            if (strcmp(v[O_ROPE_STYLE], "interleaved") == 0)
                o->rope.style = MHA_ROPE_INTERLEAVED;
            else if (strcmp(v[O_ROPE_STYLE], "half") == 0)
                o->rope.style = MHA_ROPE_HALF;
            else
                return cli_usage("--rope-style: '%s' is not interleaved or half", v[O_ROPE_STYLE]);
        }
        if (v[O_ROPE_THETA] && (rc = pos_f64(o, O_ROPE_THETA, &o->rope.theta)))
            return rc;
        if (v[O_ROPE_DIM]) {
            if ((rc =
                     cli_parse_i64("--rope-dim", v[O_ROPE_DIM], 1, INT32_MAX, &o->rope.rotary_dim)))
                return rc;
            if (o->rope.rotary_dim % 2 != 0)
                return cli_usage("--rope-dim: %lld is odd (RoPE rotates pairs)",
                                 (long long)o->rope.rotary_dim);
        }
        o->rope.scaling = MHA_ROPE_SCALING_NONE;
        if (v[O_ROPE_SCALING]) {
            static const struct {
                const char *name;
                mha_rope_scaling_type type;
            } kinds[] = {{"none", MHA_ROPE_SCALING_NONE}, {"linear", MHA_ROPE_SCALING_LINEAR},
                         {"ntk", MHA_ROPE_SCALING_NTK},   {"llama3", MHA_ROPE_SCALING_LLAMA3},
                         {"yarn", MHA_ROPE_SCALING_YARN}, {"dynamic", MHA_ROPE_SCALING_DYNAMIC}};
            size_t k = 0;
            while (k < sizeof kinds / sizeof kinds[0] && strcmp(kinds[k].name, v[O_ROPE_SCALING]))
                k++;
            if (k == sizeof kinds / sizeof kinds[0])
                return cli_usage("--rope-scaling: '%s' is not none, linear, ntk, dynamic, "
                                 "llama3 or yarn",
                                 v[O_ROPE_SCALING]);
            o->rope.scaling = kinds[k].type;
        }
        static const int scaling_only[] = {
            O_ROPE_FACTOR,    O_ROPE_ORIGINAL_MAX, O_ROPE_LOW_FREQ,        O_ROPE_HIGH_FREQ,
            O_ROPE_BETA_FAST, O_ROPE_BETA_SLOW,    O_ROPE_ATTENTION_FACTOR};
        double *fields[] = {&o->rope.factor,          &o->rope.original_max_position,
                            &o->rope.low_freq_factor, &o->rope.high_freq_factor,
                            &o->rope.beta_fast,       &o->rope.beta_slow,
                            &o->rope.attention_factor};
        for (size_t i = 0; i < sizeof scaling_only / sizeof scaling_only[0]; i++) {
            int id = scaling_only[i];
            if (!v[id])
                continue;
            if (o->rope.scaling == MHA_ROPE_SCALING_NONE)
                return cli_usage("%s needs --rope-scaling", run_flags[id].name);
            if ((rc = (id == O_ROPE_ATTENTION_FACTOR ? pos_f32 : pos_f64)(o, id, fields[i])))
                return rc;
        }
    }
    return CLI_OK;
}

/* --scale, --softcap, --alibi, --dropout and --seed. */
static int parse_scores(run_config *o) {
    const char *const *v = o->opt;
    int rc;
    if (v[O_SCALE] && (rc = pos_f32(o, O_SCALE, &o->scale)))
        return rc;
    if (v[O_SOFTCAP] && (rc = pos_f32(o, O_SOFTCAP, &o->softcap)))
        return rc;
    o->alibi = v[O_ALIBI] != NULL;
    o->allow_nonfinite = v[O_ALLOW_NONFINITE] != NULL;
    if (v[O_DROPOUT]) {
        double p;
        if ((rc = cli_parse_f64("--dropout", v[O_DROPOUT], 0.0, 0, 1.0, 1, &p)))
            return rc;
        o->dropout.p = (float)p;
        if (o->dropout.p >= 1.0f) /* p just below 1 that rounds to 1 in float */
            return cli_usage("--dropout: %s rounds to 1 in float32", v[O_DROPOUT]);
        o->dropout.training = 1;
    }
    if (v[O_SEED]) {
        if (!v[O_DROPOUT])
            return cli_usage("--seed needs --dropout");
        if ((rc = cli_parse_u64("--seed", v[O_SEED], &o->dropout.seed)))
            return rc;
    }
    return CLI_OK;
}

/* The outputs (--attn, --plot, --attn-stats and what goes with them) and the execution (--threads,
 * --decode, --distributed, --impl). */
static int parse_outputs(run_config *o) {
    const char *const *v = o->opt;
    int rc;
    if (v[O_ATTN_AVERAGE] && !v[O_ATTN] && !v[O_PLOT])
        return cli_usage("--attn-average needs --attn or --plot");
    o->average = v[O_ATTN_AVERAGE] != NULL;
    if (v[O_ATTN] && strcmp(v[O_ATTN], v[O_OUT]) == 0)
        return cli_usage("--attn and --out name the same file '%s'", v[O_OUT]);
    if (v[O_PLOT] &&
        (strcmp(v[O_PLOT], v[O_OUT]) == 0 || (v[O_ATTN] && !strcmp(v[O_PLOT], v[O_ATTN]))))
        return cli_usage("--plot names the same file as another output: '%s'", v[O_PLOT]);
    if (v[O_STATS] && !v[O_ATTN_STATS])
        return cli_usage("--stats needs --attn-stats");
    if (v[O_ATTN_STATS] && (rc = parse_stats_spec(v[O_STATS], &o->stats)))
        return rc;
    char why[160];
    if (v[O_PLOT] && !cli_plot_check(v[O_PLOT], 1, 1, 1, why, sizeof why))
        return cli_usage("--plot %s: %s", v[O_PLOT], why);
    if ((v[O_TOKENS] || v[O_PLOT_SCALE]) && !v[O_PLOT])
        return cli_usage("%s needs --plot", v[O_TOKENS] ? "--tokens" : "--plot-scale");
    o->plot_scale = CLI_PLOT_SCALE_PANEL;
    if (v[O_PLOT_SCALE] && strcmp(v[O_PLOT_SCALE], "fixed") == 0)
        o->plot_scale = CLI_PLOT_SCALE_FIXED;
    else if (v[O_PLOT_SCALE] && strcmp(v[O_PLOT_SCALE], "panel") != 0)
        return cli_usage("--plot-scale: '%s' is not panel or fixed", v[O_PLOT_SCALE]);
    if (v[O_THREADS]) {
        int64_t t;
        if ((rc = cli_parse_i64("--threads", v[O_THREADS], 0, 4096, &t)))
            return rc;
        o->exec.n_threads = (int32_t)t;
    }
    if ((rc = parse_decode(o)) || (rc = parse_distributed(o)) || (rc = parse_dtype(o)) ||
        (rc = parse_weight_dtype(o)))
        return rc;
    o->exec.impl = MHA_IMPL_AUTO;
    if (v[O_IMPL]) {
        if (strcmp(v[O_IMPL], "auto") == 0)
            o->exec.impl = MHA_IMPL_AUTO;
        else if (strcmp(v[O_IMPL], "reference") == 0)
            o->exec.impl = MHA_IMPL_REFERENCE;
        else if (strcmp(v[O_IMPL], "fast") == 0)
            o->exec.impl = MHA_IMPL_FAST;
        else
            return cli_usage("--impl: '%s' is not reference, fast or auto", v[O_IMPL]);
    }
    return CLI_OK;
}

/* Every option of `mha run` into o: CLI_OK, or CLI_USAGE after one line. The model, the required
 * options, heads and names, then the masks, RoPE, the scores and the outputs, in this order: the
 * first problem found is the one reported. */
static int parse_options(const cli_args *a, run_config *o, run_state *st) {
    int rc;
    memset(o, 0, sizeof *o);
    for (int i = 0; i < O_COUNT; i++)
        o->opt[i] = a->given[i] ? a->value[i] : NULL;
    o->flags = run_flags;
    const char *const *v = o->opt;

    if ((rc = parse_model(o)))
        return rc;
    static const int required[] = {O_INPUT, O_OUT};
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++)
        if (!v[required[i]])
            return cli_usage("%s is required", run_flags[required[i]].name);

    if (v[O_HEADS] && (rc = cli_parse_i64("--heads", v[O_HEADS], 1, INT32_MAX, &o->heads)))
        return rc;
    if (v[O_KV_HEADS]) {
        if ((rc = cli_parse_i64("--kv-heads", v[O_KV_HEADS], 1, INT32_MAX, &o->kv_heads)))
            return rc;
        if (o->heads && o->heads % o->kv_heads != 0)
            return cli_usage("--kv-heads %lld does not divide --heads %lld", (long long)o->kv_heads,
                             (long long)o->heads);
    }
    if (v[O_NAMES]) {
        if ((rc = parse_names(v[O_NAMES], st, &o->names)))
            return rc;
        o->use_names = 1;
    }
    if (v[O_VALUE] && !v[O_KEY])
        return cli_usage("--value needs --key (cross-attention)");

    if ((rc = parse_masks(o)) || (rc = parse_rope(o)) || (rc = parse_scores(o)) ||
        (rc = parse_outputs(o)))
        return rc;
    return CLI_OK;
}

int cli_run_main(int argc, char **argv) {
    cli_args args;
    int rc = cli_parse(argc, argv, run_flags, O_COUNT, &args);
    if (rc)
        return rc;
    if (args.given[O_HELP]) {
        cli_run_usage();
        return CLI_OK;
    }
    run_config o;
    run_state s;
    memset(&s, 0, sizeof s);
    rc = parse_options(&args, &o, &s);
    int mla = 0;
    if (!rc)
        rc = cli_run_mla(&o, &mla);
    if (mla) {
        run_free(&s);
        return rc;
    }
    if (!rc)
        rc = apply_model(&o);
    stage_begin(&s);
    if (!rc && o.distributed) /* its own path checks, per rank */
        rc = run_distributed(&o, &s);
    else if (!rc && !(rc = check_paths(&o)))
        rc = run_forward(&o, &s);
    run_free(&s);
    return rc;
}

/* Parses and checks `mha run`'s arguments exactly as cli_run_main() does, without reading or
 * writing any file (the entry point of fuzz/fuzz_cli_args.c). Returns CLI_OK or CLI_USAGE. */
int cli_run_check_args(int argc, char **argv) {
    cli_args args;
    int rc = cli_parse(argc, argv, run_flags, O_COUNT, &args);
    if (rc || args.given[O_HELP])
        return rc;
    run_config o;
    run_state s;
    memset(&s, 0, sizeof s);
    rc = parse_options(&args, &o, &s);
    run_free(&s);
    return rc;
}
