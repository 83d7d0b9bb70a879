/* SPDX-License-Identifier: MIT */
/* cli_run.c: `mha run`, one attention layer from a safetensors file applied to .npy tensors.
 *
 * Order of work: parse and check every option (usage errors, exit 2), load the weights, read every
 * input file and check all shapes against each other and against the layer (exit 1, one line
 * naming the file), run the layer, then write the outputs atomically. When both --out and --attn
 * are given and the second write fails, the first is removed, so nothing half-done is left.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include "cli.h"
#include "npy.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum {
    O_HELP,
    O_WEIGHTS,
    O_PREFIX,
    O_NAMES,
    O_HEADS,
    O_KV_HEADS,
    O_INPUT,
    O_KEY,
    O_VALUE,
    O_CAUSAL,
    O_CAUSAL_OFFSETS,
    O_WINDOW,
    O_MASK,
    O_MASK_MEANS,
    O_KPM,
    O_Q_SEGMENTS,
    O_KV_SEGMENTS,
    O_ROPE_THETA,
    O_ROPE_STYLE,
    O_ROPE_DIM,
    O_ROPE_SCALING,
    O_ROPE_FACTOR,
    O_ROPE_ORIGINAL_MAX,
    O_ROPE_LOW_FREQ,
    O_ROPE_HIGH_FREQ,
    O_ROPE_BETA_FAST,
    O_ROPE_BETA_SLOW,
    O_ROPE_ATTENTION_FACTOR,
    O_POSITIONS,
    O_KEY_POSITIONS,
    O_SCALE,
    O_SOFTCAP,
    O_ALIBI,
    O_SINKS,
    O_DROPOUT,
    O_SEED,
    O_OUT,
    O_ATTN,
    O_ATTN_AVERAGE,
    O_PLOT,
    O_THREADS,
    O_IMPL,
    O_DECODE,
    O_PREFILL,
    O_CACHE_DTYPE,
    O_VERBOSE,
    O_COUNT
};

_Static_assert(O_COUNT <= CLI_MAX_OPTS, "raise CLI_MAX_OPTS");

static const cli_opt run_flags[O_COUNT] = {
    [O_HELP] = {"--help", CLI_OPT_FLAG},
    [O_WEIGHTS] = {"--weights", CLI_OPT_VALUE},
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
    [O_THREADS] = {"--threads", CLI_OPT_VALUE},
    [O_VERBOSE] = {"--verbose", CLI_OPT_FLAG},
    [O_IMPL] = {"--impl", CLI_OPT_VALUE},
    [O_DECODE] = {"--decode", CLI_OPT_FLAG},
    [O_PREFILL] = {"--prefill", CLI_OPT_VALUE},
    [O_CACHE_DTYPE] = {"--cache-dtype", CLI_OPT_VALUE},
};

void cli_run_usage(void) {
    static const char *const text[] = {
        "Usage: mha run --weights W.safetensors --heads H --input X.npy --out Y.npy [options]",
        "",
        "Runs one multi-head attention layer (projections, RoPE, masks, attention, output",
        "projection) with weights from a safetensors file on tensors from .npy files.",
        "Y.npy is float32 with X's leading shape: X [n, q_dim] gives Y [n, out_dim] and",
        "X [B, n, q_dim] gives Y [B, n, out_dim]. Options also take the form --flag=value.",
        "",
        "Weights:",
        "  --weights W.safetensors  weights, F32/F64/F16/BF16 (required). Names tried: HF",
        "                           q_proj/k_proj/v_proj/o_proj (.weight, .bias); PyTorch",
        "                           nn.MultiheadAttention (in_proj_weight, out_proj.weight, ...);",
        "                           CS336 (q_proj_weight, ...). Sizes come from the tensor shapes.",
        "  --prefix P               prepended to every tensor name, e.g. model.layers.0.self_attn.",
        "                           (default: none)",
        "  --names q=A,k=B,v=C,o=D  explicit stems, \".weight\"/\".bias\" appended; sinks=NAME",
        "                           names the sink logits (default: the built-in search)",
        "  --heads H                number of query heads (required)",
        "  --kv-heads G             key/value heads (GQA/MQA), H % G == 0 (default: from shapes)",
        "",
        "Inputs (float32, float64 or float16, C order):",
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
        "  --mask M.npy             any shape that broadcasts to [B, h, n, m]. float: added to the",
        "                           scores (-inf blocks); bool/uint8/int32/int64: see --mask-means",
        "  --mask-means attend|block  nonzero = may attend (attend: SDPA, ONNX) or = masked out",
        "                           (block: nn.MultiheadAttention) (default: attend)",
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
        "  --rope-scaling TYPE      none, linear, ntk, llama3 or yarn (default: none)",
        "  --rope-factor F          scaling factor (default: 1 for linear and ntk, 8 for llama3)",
        "  --rope-original-max N    original context length (default: 8192 llama3, 4096 yarn)",
        "  --rope-low-freq F        llama3 low_freq_factor (default: 1)",
        "  --rope-high-freq F       llama3 high_freq_factor (default: 4)",
        "  --rope-beta-fast F       yarn beta_fast (default: 32)",
        "  --rope-beta-slow F       yarn beta_slow (default: 1)",
        "  --rope-attention-factor F  yarn factor on cos and sin (default: 0.1 ln(factor) + 1)",
        "",
        "Scores:",
        "  --scale S                score scale (default: 1/sqrt(d_k))",
        "  --softcap C              logit soft-capping s = C tanh(s/C), Gemma 2 (default: off)",
        "  --alibi                  ALiBi: add -slope_h |p - j| (default: off)",
        "  --sinks S.npy            float [h], one learned sink logit per head, gpt-oss",
        "                           (default: none, or the weights file's \"sinks\" tensor)",
        "  --dropout P              training-mode dropout on the probabilities, 0 <= P < 1",
        "                           (default: off, i.e. inference)",
        "  --seed S                 dropout seed, 0 .. 2^64-1 (default: 0)",
        "",
        "Outputs (written to a temporary name, then renamed):",
        "  --out Y.npy              output, float32 (required)",
        "  --attn A.npy             also write the probabilities [B, h, n, m] ([h, n, m], 2-d X)",
        "  --attn-average           write their mean over the heads instead: [B, n, m] ([n, m])",
        "  --plot FILE.svg|FILE.png draw the attention maps of batch row 0, one per head (or their",
        "                           mean with --attn-average); SVG has labels and hover values",
        "",
        "Execution:",
        "  --threads N              threads; 0 = every online CPU (default: 0)",
        "  --verbose                report each stage and its time on stderr",
        "  --impl I                 reference, fast or auto (default: auto); fast fails, naming",
        "                           the option, when it cannot run the request",
        "  --help                   this text",
        "",
        "Decoding through a KV cache (causal self-attention; docs/INFERENCE.md):",
        "  --decode                 run the input as autoregressive decoding: the first P tokens",
        "                           as one prefill, then one token per step, through a KV cache.",
        "                           Y is the full causal forward's output (same options: RoPE,",
        "                           GQA, --window L,R (keeps the last L+1 positions), ALiBi,",
        "                           sinks, softcap, scale, batch). Implies --causal; refuses",
        "                           --key, masks, segments, positions, --causal top-left,",
        "                           --causal-offsets, --attn and --dropout",
        "  --prefill P              tokens in the first (prefill) call, 1 <= P <= n (default: 1)",
        "  --cache-dtype T          cache storage f32, f16 or bf16 (default: f32)",
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
        "",
        "Exit status: 0 success, 1 failure (one line on stderr naming the file), 2 usage error.",
    };
    for (size_t i = 0; i < sizeof text / sizeof text[0]; i++)
        printf("%s\n", text[i]);
}

/* Everything parsed from the command line. */
typedef struct run_config {
    const char *opt[O_COUNT]; /* raw values (NULL = not given) */
    int64_t heads, kv_heads;
    mha_name_map names;
    int use_names;
    double scale, softcap;
    int alibi;
    mha_rope rope;
    int causal;
    mha_alignment alignment;
    int use_window;
    int64_t window_left, window_right;
    mha_mask_polarity polarity;
    mha_dropout dropout;
    mha_exec exec;
    int average;
    int decode;            /* --decode */
    int64_t prefill;       /* --prefill, default 1 */
    mha_dtype cache_dtype; /* --cache-dtype */
} run_config;

/* Everything allocated while running; freed once by run_free(). */
typedef struct run_state {
    char *names_buf;
    mha_layer *base, *layer;
    mha__npy x, key, value, mask, kpm, sinks;
    float *xf, *kf, *vf, *maskf, *sinksf, *out, *probs;
    int64_t *qpos, *kpos, *offsets;
    int32_t *qseg, *kvseg;
    double stage_start; /* --verbose: when the current stage began (seconds) */
} run_state;

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* --verbose: "mha: <stage done> (<seconds> s)" on stderr when a stage ends. */
static void stage_done(const run_config *o, run_state *s, const char *what) {
    const double now = seconds_now();
    if (o->opt[O_VERBOSE])
        fprintf(stderr, "mha: %s (%.3f s)\n", what, now - s->stage_start);
    s->stage_start = now;
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
    free(s->probs);
    free(s->qpos);
    free(s->kpos);
    free(s->offsets);
    free(s->qseg);
    free(s->kvseg);
}

/* ---------------------------------------------------------------------------------------------- */
/* Option checking (usage errors).                                                                */
/* ---------------------------------------------------------------------------------------------- */

static int pos_f64(const run_config *o, int id, double *out) {
    return cli_parse_f64(run_flags[id].name, o->opt[id], 0.0, 1, HUGE_VAL, 0, out);
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
        else
            return cli_usage("--cache-dtype: '%s' is not f32, f16 or bf16", t);
    }
    return CLI_OK;
}

static int parse_options(const cli_args *a, run_config *o, run_state *st) {
    int rc;
    memset(o, 0, sizeof *o);
    for (int i = 0; i < O_COUNT; i++)
        o->opt[i] = a->given[i] ? a->value[i] : NULL;
    const char *const *v = o->opt;

    static const int required[] = {O_WEIGHTS, O_HEADS, O_INPUT, O_OUT};
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++)
        if (!v[required[i]])
            return cli_usage("%s is required", run_flags[required[i]].name);

    if ((rc = cli_parse_i64("--heads", v[O_HEADS], 1, INT32_MAX, &o->heads)))
        return rc;
    if (v[O_KV_HEADS]) {
        if ((rc = cli_parse_i64("--kv-heads", v[O_KV_HEADS], 1, INT32_MAX, &o->kv_heads)))
            return rc;
        if (o->heads % o->kv_heads != 0)
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

    /* Masks. */
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
        if (!v[O_CAUSAL] && !v[O_WINDOW] && !v[O_ALIBI])
            return cli_usage("--causal-offsets has no effect without --causal, --window or "
                             "--alibi");
        o->alignment = MHA_ALIGN_EXPLICIT;
    }
    if (v[O_WINDOW]) {
        if ((rc = parse_window(v[O_WINDOW], &o->window_left, &o->window_right)))
            return rc;
        o->use_window = 1;
    }
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

    /* RoPE. */
    const int rope_on = v[O_ROPE_THETA] || v[O_ROPE_STYLE];
    static const int rope_only[] = {O_ROPE_DIM,       O_ROPE_SCALING,         O_POSITIONS,
                                    O_KEY_POSITIONS,  O_ROPE_FACTOR,          O_ROPE_ORIGINAL_MAX,
                                    O_ROPE_LOW_FREQ,  O_ROPE_HIGH_FREQ,       O_ROPE_BETA_FAST,
                                    O_ROPE_BETA_SLOW, O_ROPE_ATTENTION_FACTOR};
    for (size_t i = 0; i < sizeof rope_only / sizeof rope_only[0]; i++)
        if (v[rope_only[i]] && !rope_on)
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
            } kinds[] = {{"none", MHA_ROPE_SCALING_NONE},
                         {"linear", MHA_ROPE_SCALING_LINEAR},
                         {"ntk", MHA_ROPE_SCALING_NTK},
                         {"llama3", MHA_ROPE_SCALING_LLAMA3},
                         {"yarn", MHA_ROPE_SCALING_YARN}};
            size_t k = 0;
            while (k < sizeof kinds / sizeof kinds[0] && strcmp(kinds[k].name, v[O_ROPE_SCALING]))
                k++;
            if (k == sizeof kinds / sizeof kinds[0])
                return cli_usage("--rope-scaling: '%s' is not none, linear, ntk, llama3 or yarn",
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
            if ((rc = pos_f64(o, id, fields[i])))
                return rc;
        }
    }

    /* Scores. */
    if (v[O_SCALE] && (rc = pos_f64(o, O_SCALE, &o->scale)))
        return rc;
    if (v[O_SOFTCAP] && (rc = pos_f64(o, O_SOFTCAP, &o->softcap)))
        return rc;
    o->alibi = v[O_ALIBI] != NULL;
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

    /* Outputs and execution. */
    if (v[O_ATTN_AVERAGE] && !v[O_ATTN] && !v[O_PLOT])
        return cli_usage("--attn-average needs --attn or --plot");
    o->average = v[O_ATTN_AVERAGE] != NULL;
    if (v[O_ATTN] && strcmp(v[O_ATTN], v[O_OUT]) == 0)
        return cli_usage("--attn and --out name the same file '%s'", v[O_OUT]);
    if (v[O_PLOT] &&
        (strcmp(v[O_PLOT], v[O_OUT]) == 0 || (v[O_ATTN] && !strcmp(v[O_PLOT], v[O_ATTN]))))
        return cli_usage("--plot names the same file as another output: '%s'", v[O_PLOT]);
    char why[160];
    if (v[O_PLOT] && !cli_plot_check(v[O_PLOT], 1, 1, 1, why, sizeof why))
        return cli_usage("--plot %s: %s", v[O_PLOT], why);
    if (v[O_THREADS]) {
        int64_t t;
        if ((rc = cli_parse_i64("--threads", v[O_THREADS], 0, 4096, &t)))
            return rc;
        o->exec.n_threads = (int32_t)t;
    }
    if ((rc = parse_decode(o)))
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

/* ---------------------------------------------------------------------------------------------- */
/* Files.                                                                                         */
/* ---------------------------------------------------------------------------------------------- */

static int read_npy(const char *path, mha__npy *a) {
    mha_error err;
    memset(&err, 0, sizeof err);
    memset(a, 0, sizeof *a);
    if (mha__npy_read(path, a, &err) != MHA_STATUS_OK)
        return cli_lib_fail(path, &err);
    return CLI_OK;
}

static int is_float(mha_dtype t) {
    return t == MHA_DTYPE_F32 || t == MHA_DTYPE_F64 || t == MHA_DTYPE_F16;
}

static int is_integer(mha_dtype t) {
    return t == MHA_DTYPE_BOOL || t == MHA_DTYPE_U8 || t == MHA_DTYPE_I32 || t == MHA_DTYPE_I64;
}

static int to_f32(const char *path, const mha__npy *a, float **out) {
    if (!is_float(a->dtype))
        return cli_fail("%s: dtype %s is not supported here (expected float32, float64 or "
                        "float16)",
                        path, cli_dtype_name(a->dtype));
    mha_error err;
    memset(&err, 0, sizeof err);
    if (mha__npy_to_f32(a, path, out, &err) != MHA_STATUS_OK)
        return cli_lib_fail(path, &err);
    return CLI_OK;
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
    *out = malloc((size_t)total * sizeof(int64_t));
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
static int read_index(const char *path,
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
static int read_per_batch(
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

static int
read_segments(const char *path, const char *what, int64_t B, int64_t len, int32_t **out) {
    int64_t *wide = NULL;
    int rc = read_index(path, what, B, len, INT32_MIN, INT32_MAX, &wide);
    if (rc)
        return rc;
    *out = malloc((size_t)(B * len) * sizeof(int32_t));
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
static int mask_tensor(const char *path,
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

/* X, K, V: float, 2-d or 3-d, non-empty; returns B, L, features. */
static int
input_shape(const char *path, const mha__npy *a, int64_t *B, int64_t *L, int64_t *features) {
    char sb[160];
    if (!is_float(a->dtype))
        return cli_fail("%s: dtype %s is not supported (expected float32, float64 or float16)",
                        path, cli_dtype_name(a->dtype));
    if (a->ndim != 2 && a->ndim != 3)
        return cli_fail("%s: shape %s has %d dimensions, expected 2 ([n, d]) or 3 ([B, n, d])",
                        path, cli_shape_str(sb, sizeof sb, a->ndim, a->shape), (int)a->ndim);
    for (int32_t d = 0; d < a->ndim; d++)
        if (a->shape[d] == 0)
            return cli_fail("%s: shape %s is empty", path,
                            cli_shape_str(sb, sizeof sb, a->ndim, a->shape));
    *B = a->ndim == 3 ? a->shape[0] : 1;
    *L = a->shape[a->ndim - 2];
    *features = a->shape[a->ndim - 1];
    return CLI_OK;
}

/* Writes Y (and A); removes Y again if A cannot be written. */
static int write_outputs(const run_config *o,
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
    if (mha__npy_write_f32(ypath, s->out, ynd, yshape, &err) != MHA_STATUS_OK)
        return cli_lib_fail(ypath, &err);
    if (!apath && !o->opt[O_PLOT])
        return CLI_OK;
    if (x_ndim == 3)
        ashape[and_++] = B;
    if (!o->average)
        ashape[and_++] = h;
    ashape[and_++] = n;
    ashape[and_++] = m;
    if (apath && mha__npy_write_f32(apath, s->probs, and_, ashape, &err) != MHA_STATUS_OK) {
        int rc = cli_lib_fail(apath, &err);
        remove(ypath);
        return rc;
    }
    const char *plot = o->opt[O_PLOT];
    if (plot) {
        char why[256], title[160];
        snprintf(title, sizeof title,
                 "attention probabilities, batch row 0 (%lld queries x %lld keys)", (long long)n,
                 (long long)m);
        if (!cli_plot_write(plot, s->probs, o->average ? 1 : h, n, m, title, why, sizeof why)) {
            remove(ypath);
            if (apath)
                remove(apath);
            return cli_fail("%s: %s", plot, why);
        }
    }
    return CLI_OK;
}

/* --decode: prefill the first P tokens of every row, then one token per step, through a cache of
 * n positions per row; the rows of Y are written as they come. */
static int run_decode(const run_config *o, run_state *s, int x_ndim, int64_t B, int64_t n) {
    const mha_config *c = mha_layer_config(s->layer);
    const int64_t qd = c->q_dim, od = c->out_dim, P = o->prefill;
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
    mha_kv_cache *cache = NULL;
    if (mha_kv_cache_create(&kc, s->layer, NULL, &cache, &err) != MHA_STATUS_OK)
        return cli_lib_fail(NULL, &err);
    int64_t ycount;
    if (!cli_mul(B, n, &ycount) || !cli_mul(ycount, od, &ycount) ||
        ycount > (int64_t)(SIZE_MAX / 8)) {
        mha_kv_cache_destroy(cache);
        return cli_fail("%s: output size overflows", o->opt[O_INPUT]);
    }
    s->out = malloc((size_t)ycount * sizeof(float));
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
    for (int64_t t0 = 0; t0 < n && rc == CLI_OK;) {
        const int64_t t = t0 == 0 ? P : 1;
        for (int64_t b = 0; b < B; b++)
            memcpy(xs + b * t * qd, s->xf + (b * n + t0) * qd, sizeof(float) * (size_t)(t * qd));
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
            memcpy(s->out + (b * n + t0) * od, ys + b * t * od, sizeof(float) * (size_t)(t * od));
        t0 += t;
    }
    mha_threadpool_destroy(ex.pool);
    free(xs);
    free(ys);
    mha_kv_cache_destroy(cache);
    if (rc != CLI_OK)
        return rc;
    stage_done(o, s, "prefill and decode steps computed");
    rc = write_outputs(o, s, x_ndim, B, n, n, c->num_heads, od);
    if (rc == CLI_OK)
        stage_done(o, s, "outputs written");
    return rc;
}

/* ---------------------------------------------------------------------------------------------- */
/* The run itself.                                                                                */
/* ---------------------------------------------------------------------------------------------- */

static int run(const run_config *o, run_state *s) {
    const char *const *v = o->opt;
    const char *wpath = v[O_WEIGHTS], *xpath = v[O_INPUT];
    mha_error err;
    memset(&err, 0, sizeof err);
    char sb[160];
    int rc;

    /* 1. Weights: sizes come from the file, every other option is applied in step 2. */
    mha_config lc;
    memset(&lc, 0, sizeof lc);
    lc.num_heads = o->heads;
    lc.num_kv_heads = o->kv_heads;
    if (mha_layer_load_safetensors(wpath, v[O_PREFIX], o->use_names ? &o->names : NULL, &lc, NULL,
                                   &s->base, &err) != MHA_STATUS_OK)
        return cli_lib_fail(wpath, &err);
    const mha_config *bc = mha_layer_config(s->base);
    const int64_t h = bc->num_heads;

    stage_done(o, s, "weights read");

    /* 2. The layer with the command-line options (weights borrowed from the loaded one). */
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
    }
    if (mha_layer_create(&cfg, &w, MHA_WEIGHTS_BORROW, NULL, &s->layer, &err) != MHA_STATUS_OK)
        return cli_fail("%s with the given options: %s", wpath,
                        err.message[0] ? err.message : mha_status_string(err.status));

    /* 3. Inputs. */
    int64_t B, n, feat;
    if ((rc = read_npy(xpath, &s->x)) || (rc = input_shape(xpath, &s->x, &B, &n, &feat)))
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
        if ((rc = read_npy(kpath, &s->key)) || (rc = input_shape(kpath, &s->key, &kb, &m, &kf)))
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
        if ((rc = to_f32(kpath, &s->key, &s->kf)))
            return rc;
        if (v[O_VALUE]) {
            const char *vpath = v[O_VALUE];
            int64_t vb, vm, vf;
            if ((rc = read_npy(vpath, &s->value)) ||
                (rc = input_shape(vpath, &s->value, &vb, &vm, &vf)))
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
            if ((rc = to_f32(vpath, &s->value, &s->vf)))
                return rc;
        } else if (bc->v_dim != bc->k_dim) {
            return cli_fail("%s: used as values too, but %s has v_dim %lld != k_dim %lld; "
                            "give --value",
                            kpath, wpath, (long long)bc->v_dim, (long long)bc->k_dim);
        }
    }
    if ((rc = to_f32(xpath, &s->x, &s->xf)))
        return rc;

    if (o->decode)
        return run_decode(o, s, x_ndim, B, n);

    stage_done(o, s, "layer built, inputs read");

    /* 4. Masks and positions, checked against (B, h, n, m). */
    mha_forward_args fa;
    memset(&fa, 0, sizeof fa);
    mha_masking *mk = &fa.mask;
    mk->causal = o->causal;
    mk->alignment = o->alignment;
    mk->use_window = o->use_window;
    mk->window_left = o->use_window ? o->window_left : -1;
    mk->window_right = o->use_window ? o->window_right : -1;
    const int64_t target4[4] = {B, h, n, m};
    if (v[O_MASK]) {
        const char *path = v[O_MASK];
        if ((rc = read_npy(path, &s->mask)))
            return rc;
        if (is_float(s->mask.dtype)) {
            if ((rc = mask_tensor(path, &s->mask, NULL, MHA_DTYPE_F32, 4, target4, 4,
                                  "[B, h, n, m]", &mk->additive_mask)) ||
                (rc = to_f32(path, &s->mask, &s->maskf)))
                return rc;
            mk->additive_mask.data = s->maskf;
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
    if (v[O_POSITIONS] &&
        (rc = read_index(v[O_POSITIONS], "position", B, n, 0, MHA_MAX_POSITION, &s->qpos)))
        return rc;
    if (v[O_KEY_POSITIONS] &&
        (rc = read_index(v[O_KEY_POSITIONS], "position", B, m, 0, MHA_MAX_POSITION, &s->kpos)))
        return rc;

    /* 5. Outputs. */
    int64_t ycount, pcount = 0;
    if (!cli_mul(B, n, &ycount) || !cli_mul(ycount, bc->out_dim, &ycount) ||
        ycount > (int64_t)(SIZE_MAX / 8))
        return cli_fail("%s: output size overflows", xpath);
    s->out = malloc((size_t)ycount * sizeof(float));
    if (!s->out)
        return cli_fail("cannot allocate the output (%lld floats)", (long long)ycount);
    if (v[O_PLOT] && !cli_plot_check(v[O_PLOT], o->average ? 1 : h, n, m, sb, sizeof sb))
        return cli_fail("%s: %s", v[O_PLOT], sb); /* before the work, not after */
    if (v[O_ATTN] || v[O_PLOT]) {
        if (!cli_mul(B, o->average ? 1 : h, &pcount) || !cli_mul(pcount, n, &pcount) ||
            !cli_mul(pcount, m, &pcount) || pcount > (int64_t)(SIZE_MAX / 8))
            return cli_fail("%s: probabilities [B, h, n, m] = [%lld, %lld, %lld, %lld] are too "
                            "large",
                            v[O_ATTN] ? v[O_ATTN] : v[O_PLOT], (long long)B, (long long)h,
                            (long long)n, (long long)m);
        s->probs = malloc((size_t)pcount * sizeof(float));
        if (!s->probs)
            return cli_fail("%s: cannot allocate the probabilities (%lld floats)",
                            v[O_ATTN] ? v[O_ATTN] : v[O_PLOT], (long long)pcount);
    }

    stage_done(o, s, "masks and positions read, outputs allocated");

    /* 6. Run. */
    fa.batch = B;
    fa.q_len = n;
    fa.kv_len = m;
    fa.query = s->xf;
    fa.key = cross ? s->kf : NULL;
    fa.value = cross ? (s->vf ? s->vf : s->kf) : NULL;
    fa.q_positions = s->qpos;
    fa.k_positions = s->kpos;
    fa.dropout = o->dropout;
    fa.out = s->out;
    fa.probs = s->probs;
    fa.average_probs = o->average;
    mha_status st = mha_layer_forward(s->layer, &fa, &o->exec, &err);
    if (st == MHA_STATUS_UNSUPPORTED) /* the library's message as it is, after the flag */
        return cli_fail("--impl %s: %s", v[O_IMPL] ? v[O_IMPL] : "auto",
                        err.message[0] ? err.message : mha_status_string(st));
    if (st != MHA_STATUS_OK)
        return cli_lib_fail(NULL, &err);

    stage_done(o, s, "forward computed");

    /* 7. Write. */
    rc = write_outputs(o, s, x_ndim, B, n, m, h, bc->out_dim);
    if (rc == CLI_OK)
        stage_done(o, s, "outputs written");
    return rc;
}

/* Every file `mha run` reads or writes, for cli_check_outputs() before any work. */
static int check_paths(const run_config *o) {
    const char *const *v = o->opt;
    static const int in_ids[] = {O_WEIGHTS,   O_INPUT,         O_KEY,        O_VALUE,
                                 O_MASK,      O_KPM,           O_Q_SEGMENTS, O_KV_SEGMENTS,
                                 O_POSITIONS, O_KEY_POSITIONS, O_SINKS,      O_CAUSAL_OFFSETS};
    static const int out_ids[] = {O_OUT, O_ATTN, O_PLOT};
    cli_path in[sizeof in_ids / sizeof in_ids[0]], out[3];
    const int n_in = (int)(sizeof in_ids / sizeof in_ids[0]);
    for (int i = 0; i < n_in; i++)
        in[i] = (cli_path){run_flags[in_ids[i]].name, v[in_ids[i]]};
    for (int i = 0; i < 3; i++)
        out[i] = (cli_path){run_flags[out_ids[i]].name, v[out_ids[i]]};
    return cli_check_outputs(in, n_in, out, 3);
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
    if (!rc)
        rc = check_paths(&o);
    s.stage_start = seconds_now();
    if (!rc)
        rc = run(&o, &s);
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
