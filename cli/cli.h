/* SPDX-License-Identifier: MIT */
/* cli.h: declarations shared by the .c files of the `mha` program in cli/ (never installed).
 *
 * Every subcommand returns its exit status: 0 success, 1 failure (bad file, library error),
 * 2 usage error. The one line on stderr that explains a failure is printed where the failure is
 * found, with cli_fail() / cli_usage() / cli_lib_fail(), so callers only propagate the status.
 */
#ifndef MHA_CLI_H
#define MHA_CLI_H

#include "mha.h"

#include <stdint.h>

enum { CLI_OK = 0, CLI_FAIL = 1, CLI_USAGE = 2 };

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
/* `mha info --model DIR [--layer L]` (cli_model.c); layer_arg NULL = 0. */
int cli_info_model(const char *dir, const char *layer_arg);
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

/* ---- Plots (cli_plot.c). ----------------------------------------------------------------------
 */
/* Writes per-head attention maps probs [heads, n, m] as FILE.svg or FILE.png (by the name's
 * ending), atomically. Returns 1, or 0 with a reason in msg. */
/* Whether cli_plot_write can draw this: the file type (.svg or .png) and the size. 1 = yes; 0 =
 * no, with the reason in msg. */
int cli_plot_check(
    const char *path, int64_t heads, int64_t n, int64_t m, char *msg, size_t msg_size);
int cli_plot_write(const char *path,
                   const float *probs,
                   int64_t heads,
                   int64_t n,
                   int64_t m,
                   const char *title,
                   char *msg,
                   size_t msg_size);

#endif /* MHA_CLI_H */
