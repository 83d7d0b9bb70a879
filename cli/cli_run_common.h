/* SPDX-License-Identifier: MIT */
/* cli_run_common.h: what the files of `mha run` share (CLI-private): the options, the parsed
 * configuration and the run's state, and the functions one file gives the others.
 *   cli_run.c        options, usage, parsing, the entry points
 *   cli_run_files.c  checking every path, reading the input files (.npy) into checked arrays,
 *                    writing the outputs
 *   cli_run_job.c    the job: the layer forward (run_forward) or the decode loop
 *   cli_run_stats.c  --attn-stats / --stats: the attention statistics and their .npz
 *   cli_run_dist.c   the job under MPI: --distributed ring (run_distributed), when built with MPI
 */
#ifndef MHA_CLI_RUN_COMMON_H
#define MHA_CLI_RUN_COMMON_H

#include "cli.h"
#include "npy.h"

enum {
    O_HELP,
    O_WEIGHTS,
    O_MODEL,
    O_LAYER,
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
    O_CHUNK_SIZE,
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
    O_PLOT_SCALE,
    O_TOKENS,
    O_ATTN_STATS,
    O_STATS,
    O_THREADS,
    O_IMPL,
    O_DECODE,
    O_PREFILL,
    O_CACHE_DTYPE,
    O_VERBOSE,
    O_DISTRIBUTED,
    O_SHARD_LAYOUT,
    O_ALLOW_NONFINITE,
    O_DTYPE,
    O_GGUF,
    O_WEIGHT_DTYPE,
    O_COUNT
};

_Static_assert(O_COUNT <= CLI_MAX_OPTS, "raise CLI_MAX_OPTS");

/* --stats: which statistics (0 = not asked), with their parameters as given (cli_run_stats.c). */
typedef struct cli_stats_spec {
    int received, entropy;
    int64_t topk;                 /* K, 0 = no top-k */
    int64_t pool_rows, pool_cols; /* 0 = no pooled map */
} cli_stats_spec;

/* The statistics computed (NULL = not asked); k, R, C clamped to the map. */
typedef struct cli_stats {
    float *received, *received_total, *entropy, *topk_prob, *pooled, *pooled_visible;
    int64_t *topk_index;
    int64_t k, R, C;
} cli_stats;

/* Everything parsed from the command line. */
typedef struct run_config {
    const char *opt[O_COUNT]; /* raw values (NULL = not given) */
    const cli_opt *flags;     /* the option table (cli_run.c): names for messages */
    const char *wpath;        /* --weights, or the --model directory (messages) */
    int64_t layer;            /* --layer */
    mha_hf_layer_info hf;     /* --model: what the config says, flags applied on top */
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
    int64_t chunk_size; /* --chunk-size, else --model's chunked layer; 0 = none */
    mha_mask_polarity polarity;
    mha_dropout dropout;
    mha_exec exec;
    int average;
    cli_plot_scale plot_scale; /* --plot-scale (default: panel) */
    int decode;                /* --decode */
    int64_t prefill;           /* --prefill, default 1 */
    mha_dtype cache_dtype;     /* --cache-dtype */
    cli_stats_spec stats;      /* --stats (with --attn-stats) */
    int distributed;           /* --distributed ring */
    int zigzag;                /* --shard-layout: 1 zigzag (default), 0 contiguous */
    int shard_files;           /* "{rank}" in --input: per-rank input and output files */
    int allow_nonfinite;       /* --allow-nonfinite: write non-finite outputs, exit 0 */
    mha_dtype dtype;           /* --dtype: weights, X/K/V as the layer reads them, Y (f32) */
    mha_dtype weight_dtype;    /* --weight-dtype q8_0 (--model / --gguf), else dtype */
} run_config;

/* Everything allocated while running; freed once by run_free(). */
typedef struct run_state {
    char *names_buf;
    mha_layer *base, *layer;
    mha__npy x, key, value, mask, kpm, sinks;
    void *xf, *kf, *vf; /* X, K, V in o->dtype (copies or conversions of x, key, value) */
    void *out;          /* Y [B, n, out_dim] in o->dtype */
    float *maskf, *sinksf, *probs;
    void *sinksw; /* the sink logits in o->dtype (the layer's weight_dtype); NULL: sinksf is it */
    int64_t *qpos, *kpos, *offsets;
    uint8_t *rule_keys;    /* --mask recognised with key padding: the key vector [B, m] */
    int64_t *rule_offsets; /* --mask recognised as a band at another delta: [B] */
    int32_t *qseg, *kvseg;
    char *tokens_buf, **tokens;        /* --tokens: the file's text, n labels into it */
    float *plot_pooled, *plot_visible; /* --plot: the pooled map and visible shares [B, h, R, C] */
    double stage_start;                /* --verbose: when the current stage began (seconds) */
    cli_stats stats;                   /* --attn-stats */
    int inputs_nonfinite;              /* X, K, V or a float mask holds NaN / +-inf (-inf in a
                                          mask blocks and counts as finite): then non-finite
                                          outputs are expected and not reported */
} run_state;

/* --model of a multi-head latent attention model (cli_run_mla.c): *handled = 1 when it is one
 * (then the return value is the command's), 0 otherwise (the ordinary layer path runs). */
int cli_run_mla(const run_config *o, int *handled);
/* --verbose: "mha: <what> (<seconds> s)" on stderr as a stage ends (cli_run_job.c). */
void stage_done(const run_config *o, run_state *s, const char *what);
/* Starts the first stage's clock (cli_run_job.c, with stage_done). */
void stage_begin(run_state *s);

/* Input files (cli_run_files.c): each prints one line naming the file and returns CLI_FAIL on a
 * bad file, CLI_OK otherwise. */
int read_npy(const char *path, mha__npy *a);
int is_float(mha_dtype t);
int is_integer(mha_dtype t);
/* A float array as float32 (a new array). */
int to_f32(const char *path, const mha__npy *a, float **out);
/* A float array as `dtype` (a new array; each value rounded once when the dtypes differ). */
int to_dtype(const char *path, const mha__npy *a, mha_dtype dtype, void **out);
/* Integers in [lo, hi] of shape [len] or [B, len] (or broadcastable) into a new int64 [B, len]. */
int read_index(const char *path,
               const char *what,
               int64_t B,
               int64_t len,
               int64_t lo,
               int64_t hi,
               int64_t **out);
/* One integer per batch row (causal offsets): [B], [1] or [] into a new int64 [B] array. */
int read_per_batch(
    const char *path, const char *what, int64_t B, int64_t lo, int64_t hi, int64_t **out);
/* Segment ids into a new int32 [B, len]. */
int read_segments(const char *path, const char *what, int64_t B, int64_t len, int32_t **out);
/* Fills a mha_mask_tensor from a file array after checking that it broadcasts to target. */
int mask_tensor(const char *path,
                const mha__npy *a,
                const void *data,
                mha_dtype dtype,
                int32_t max_ndim,
                const int64_t *target,
                int32_t target_ndim,
                const char *target_desc,
                mha_mask_tensor *t);
/* X, K, V: float, 2-d or 3-d, non-empty; returns B, L, features. empty_rows: L may be 0 (a
 * rank's shard file in shard-file mode, whose rows of the layout are none); every other dimension
 * must still be positive. */
int input_shape(
    const char *path, const mha__npy *a, int empty_rows, int64_t *B, int64_t *L, int64_t *features);
/* Non-finite values in an output of finite inputs (docs/FORMATS.md, "Output check"): when
 * s->inputs_nonfinite is 0 and --allow-nonfinite is not given, the first float array of `count`
 * values holding NaN or +-inf gives one line (the output, how many, the first index) and
 * CLI_NONFINITE. `what` names the output ("--out y.npy"). */
int check_finite_output(const run_config *o,
                        const run_state *s,
                        const char *what,
                        const void *x,
                        mha_dtype dtype,
                        int32_t ndim,
                        const int64_t *shape);
/* Whether every element of a float input is finite, as the file holds it (a finite value that
 * becomes inf when rounded to --dtype still counts as finite: the output check then reports). */
int input_all_finite(const mha__npy *a);
/* A run's outputs are one set, all or nothing: mha__npy_set_begin() (cli/npy.h), then
 * write_outputs (and write_stats) write each output to its temporary name, then
 * finish_outputs(rc) renames them all into place when rc is CLI_OK (CLI_OK, or the failure
 * reported) or, for any failure, removes the temporaries and returns rc: the files at the output
 * paths are then as they were before the run, and no new file appears.
 * write_outputs: Y (and A, and the plot). Checks them first (check_finite_output): CLI_NONFINITE
 * with nothing written. */
int finish_outputs(int rc);
int write_outputs(const run_config *o,
                  const run_state *s,
                  int x_ndim,
                  int64_t B,
                  int64_t n,
                  int64_t m,
                  int64_t h,
                  int64_t out_dim);

/* --attn-stats (cli_run_stats.c). parse_stats_spec: the --stats list (NULL = the default
 * "received,entropy"), CLI_USAGE with a message when it is malformed. compute_stats: the
 * statistics of the forward `fa` into s->stats. write_stats: the .npz, leading B axis only for a
 * 3-d input. stats_free: what compute_stats allocated. */
int parse_stats_spec(const char *spec, cli_stats_spec *sp);
int compute_stats(
    const run_config *o, run_state *s, const mha_forward_args *fa, int64_t h, int64_t n, int64_t m);
int write_stats(const run_config *o,
                const run_state *s,
                int x_ndim,
                int64_t B,
                int64_t h,
                int64_t n,
                int64_t m);
void stats_free(cli_stats *st);
/* check_finite_output on every float member of the statistics (before anything is written). */
int check_stats_finite(const run_config *o,
                       const run_state *s,
                       int x_ndim,
                       int64_t B,
                       int64_t h,
                       int64_t n,
                       int64_t m);

/* Every file `mha run` reads or writes checked by cli_check_outputs() (cli_run_files.c). */
int check_paths(const run_config *o);

/* The sizes every later step checks against. */
typedef struct run_dims {
    int64_t B, n, m, h; /* batch, queries, keys, heads */
    int x_ndim;         /* 3: [B, n, q_dim] input, 2: [n, q_dim] */
    int cross;          /* --key given */
} run_dims;

/* The job's steps (cli_run_job.c), each CLI_OK or the exit status after one line on stderr:
 * the layer (weights and options), the inputs X (K, V) into s->xf..., the masks, offsets,
 * segments and positions into fa->mask and s. */
int build_layer(const run_config *o, run_state *s);
int read_inputs(const run_config *o, run_state *s, run_dims *d);
int read_masks(const run_config *o, run_state *s, const run_dims *d, mha_forward_args *fa);

/* The job (cli_run_job.c): load, read, check, run, write; CLI_OK or the exit status. */
int run_forward(const run_config *o, run_state *s);
/* The job over MPI ranks (cli_run_dist.c): MPI_Init, each rank its rows of the layer
 * (mha_ring_layer_forward), rank 0 gathers and writes Y (or each rank its own shard file),
 * MPI_Finalize. Without MPI: a one-line error. */
int run_distributed(const run_config *o, run_state *s);

#endif /* MHA_CLI_RUN_COMMON_H */
