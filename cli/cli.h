/* SPDX-License-Identifier: MIT */
/* cli.h: declarations shared by the .c files of the `mha` program in cli/ (never installed).
 *
 * Every subcommand returns its exit status: 0 success, 1 failure (bad file, library error),
 * 2 usage error, 3 a non-finite value in an output computed from finite inputs (`mha run`, unless
 * --allow-nonfinite; nothing is written). The one line on stderr that explains a failure is printed
 * where the failure is found, with cli_fail() / cli_usage() / cli_lib_fail(), so callers only
 * propagate the status.
 */
#ifndef MHA_CLI_H
#define MHA_CLI_H

#include "mha.h"

#include <stdint.h>

enum { CLI_OK = 0, CLI_FAIL = 1, CLI_USAGE = 2, CLI_NONFINITE = 3 };

/* Version the program was built with (mha_version() gives the library actually linked). */
#define CLI_STR_(x)  #x
#define CLI_XSTR_(x) CLI_STR_(x)
#define MHA_CLI_VERSION_STRING                                                                     \
    CLI_XSTR_(MHA_VERSION_MAJOR) "." CLI_XSTR_(MHA_VERSION_MINOR) "." CLI_XSTR_(MHA_VERSION_PATCH)

/* ---- Subcommands (argv[0] is the subcommand name). ------------------------------------------ */
int cli_run_main(int argc, char **argv);
int cli_demo_main(int argc, char **argv);
int cli_info_main(int argc, char **argv);
int cli_decode_bench_main(int argc, char **argv); /* cli_decode_bench.c */
/* `mha info --model DIR [--layer L]` or, gguf nonzero, `mha info --gguf FILE [--layer L]`
 * (cli_model.c); layer_arg NULL = 0. */
int cli_info_model(const char *dir, const char *layer_arg, int gguf);
void cli_run_usage(void); /* prints `mha run --help` to stdout */
/* `mha run` option checking only (no file is touched): CLI_OK or CLI_USAGE. For the fuzzer. */
int cli_run_check_args(int argc, char **argv);
void cli_demo_usage(void); /* prints `mha demo --help` to stdout */

/* ---- Error lines. ---------------------------------------------------------------------------- */
/* Sets the command named in usage hints: "run" gives "try 'mha run --help'", NULL 'mha --help'. */
void cli_set_help_command(const char *command);
/* A distributed run (--distributed): every later line reads "mha: rank r of P: <message>" (no
 * prefix when size is 1), so that the lines of several ranks say which rank failed. */
void cli_set_rank(int rank, int size);
/* Prints "mha: <message>" as one line (control characters replaced) and returns CLI_FAIL. */
int cli_fail(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
/* Prints "mha: <message>; try 'mha <cmd> --help'" as one line and returns CLI_USAGE. */
int cli_usage(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
/* Prints a library error as "mha: <file>: <message>" (the file is not repeated when the message
 * already starts with it) and returns CLI_FAIL. file may be NULL. */
int cli_lib_fail(const char *file, const mha_error *err);

/* ---- Command-line options. ------------------------------------------------------------------- */
typedef enum cli_opt_kind {
    CLI_OPT_FLAG,     /* --alibi: takes no value */
    CLI_OPT_VALUE,    /* --heads 8 or --heads=8 */
    CLI_OPT_OPTIONAL, /* --causal [top-left]: takes the next argument unless it starts with "--" */
} cli_opt_kind;

typedef struct cli_opt {
    const char *name; /* with the leading "--" */
    cli_opt_kind kind;
} cli_opt;

/* Parsed options: value[i] / given[i] for opts[i]. A FLAG, or an OPTIONAL option given without a
 * value, has value "" . */
#define CLI_MAX_OPTS 64
typedef struct cli_args {
    const char *value[CLI_MAX_OPTS];
    int given[CLI_MAX_OPTS];
} cli_args;

/* Parses argv[1..argc) against opts (n_opts <= CLI_MAX_OPTS). Rejects unknown options, stray
 * arguments, missing values, a value on a flag and an option given twice. Returns CLI_OK or
 * CLI_USAGE (after printing the line). */
int cli_parse(int argc, char **argv, const cli_opt *opts, int n_opts, cli_args *out);

/* Strict numbers: the whole string must be consumed, no leading blanks. Each prints a usage line
 * naming `flag` and returns CLI_USAGE on failure. */
int cli_parse_i64(const char *flag, const char *s, int64_t min, int64_t max, int64_t *out);
int cli_parse_u64(const char *flag, const char *s, uint64_t *out);
/* Finite double in [min, max]; min_open / max_open make that end exclusive. */
int cli_parse_f64(const char *flag,
                  const char *s,
                  double min,
                  int min_open,
                  double max,
                  int max_open,
                  double *out);

/* ---- Small helpers. -------------------------------------------------------------------------- */
const char *cli_dtype_name(mha_dtype dtype); /* NumPy-style: "float32", "bool", ... */
/* Formats "[2, 5, 16]" into buf. */
const char *cli_shape_str(char *buf, size_t size, int32_t ndim, const int64_t *shape);
/* a * b for non-negative sizes; 0 on overflow (returns 1 on success). */
int cli_mul(int64_t a, int64_t b, int64_t *out);

/* ---- Output safety (cli_paths.c). -------------------------------------------------------------
 * A file named on the command line, with the flag that named it (NULL path = not given). */
typedef struct cli_path {
    const char *flag;
    const char *path;
} cli_path;
/* Checks, before any work, that no output is an input or another output (same device and inode,
 * or the same name in the same directory), that an existing output is a regular file (links,
 * FIFOs, devices and directories are refused, never replaced) and that each output's directory
 * exists and is writable. Prints the reason and returns CLI_FAIL, or CLI_OK. */
int cli_check_outputs(const cli_path *inputs, int n_in, const cli_path *outputs, int n_out);

/* ---- Plots (cli_plot.c: files, pooling, checks; cli_plot_cairo.c: drawing through cairo). --- */
/* Colour scale of each panel: fixed 0..1 (heads comparable) or 0..the panel's largest value (a
 * diffuse long map, whose probabilities are about 1/m, stays readable). */
typedef enum cli_plot_scale { CLI_PLOT_SCALE_PANEL, CLI_PLOT_SCALE_FIXED } cli_plot_scale;

enum {
    CLI_PLOT_MAX_CELLS = 128, /* cells per axis of a panel: beyond, the map is pooled into blocks */
    CLI_PLOT_MAX_PANELS = 64, /* heads drawn at most (the figure stays bounded: <= 8 x 8 panels) */
};

/* What the renderer draws, whatever computed it (the dense probabilities pooled by
 * cli_plot_write, or the streamed pooled map of mha_attention_statistics). Per panel a grid of
 * rows x cols cells (rows <= n, cols <= m); cell (r, c) holds the queries i with
 * floor(i rows / n) = r and the keys j with floor(j cols / m) = c, the partition of
 * mha_attention_stats.pooled (cells differ by at most one row or key).
 *   value  [panels, rows, cols]: mean probability over the cell's VISIBLE elements (any value
 *          when the cell is fully masked);
 *   masked [panels, rows, cols]: fraction 0..1 of the cell's elements that are masked (NULL:
 *          none).
 * From mha_attention_stats (pooled = mean over all elements, masked ones counting 0; and
 * pooled_visible): value = pooled / pooled_visible (where > 0), masked = 1 - pooled_visible.
 * Labels: n query labels and m key labels, or NULL for indices; tokens are drawn only on an axis
 * that is not pooled (rows == n, cols == m), indices otherwise. */
typedef struct cli_plot_map {
    int64_t panels, rows, cols;
    int64_t n, m;
    const float *value, *masked;
    const char *const *q_labels, *const *k_labels;
    const char *title;    /* the figure's title line */
    int panels_are_heads; /* 1: panel p is "head p"; 0: one panel, the mean over heads */
    cli_plot_scale scale;
} cli_plot_map;

/* 1 when this program was built with cairo (--plot works), 0 otherwise. */
int cli_plot_available(void);
/* The version of the cairo this program runs with, or NULL when built without cairo. */
const char *cli_plot_cairo_version(void);
/* Whether --plot can draw heads maps of n x m into path: cairo present, the file type (.png, .svg
 * or .pdf by the name's ending), at most CLI_PLOT_MAX_PANELS heads. 1 = yes; 0 = no, reason in
 * msg. The size is never refused: large maps are pooled. */
int cli_plot_check(
    const char *path, int64_t heads, int64_t n, int64_t m, char *msg, size_t msg_size);
/* The grid an n x m map is drawn as: min(n, CLI_PLOT_MAX_CELLS) x min(m, CLI_PLOT_MAX_CELLS). */
void cli_plot_grid(int64_t n, int64_t m, int64_t *rows, int64_t *cols);
/* Reads --tokens FILE: one token per line (a final newline optional, CR LF accepted), exactly
 * count lines, each valid UTF-8 without control characters, the file at most 16 MiB. On success
 * *buf holds the text and *labels the count pointers into it (free both); on failure returns
 * CLI_FAIL after printing one line naming the file, the line and the problem. */
int cli_plot_read_tokens(const char *path, int64_t count, char **buf, char ***labels);
/* Draws map into path (type by the name's ending) through a temporary name renamed at the end:
 * no half-written file. Returns 1, or 0 with the reason in msg. cli_plot_cairo.c. */
int cli_plot_render(const char *path, const cli_plot_map *map, char *msg, size_t msg_size);
/* `mha run --plot`: batch row 0 of the streamed statistics' pooled map, pooled and visible
 * [heads, R, C] with R x C = cli_plot_grid(n, m) (the grid and partition of cli_plot_map). The
 * caller fills map's panels (heads, or 1 for the mean over heads), n, m, labels, title,
 * panels_are_heads and scale; this converts to the renderer's input (value = pooled / visible,
 * masked = 1 - visible) and renders. The mean over heads: value = mean_h pooled / max_h visible,
 * masked = 1 - max_h visible (exact when every head has the same mask, as the mean's masked
 * elements are those no head sees). Returns 1, or 0 with the reason in msg. */
int cli_plot_write(const char *path,
                   const float *pooled,
                   const float *visible,
                   int64_t heads,
                   cli_plot_map *map,
                   char *msg,
                   size_t msg_size);

#endif /* MHA_CLI_H */
