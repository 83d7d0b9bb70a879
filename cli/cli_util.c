/* SPDX-License-Identifier: MIT */
/* cli_util.c: option parsing, strict number parsing and the one-line error messages of the `mha`
 * program. Numbers are parsed with strtoll/strtoull/strtod and must consume the whole argument;
 * every message is printed as a single line (control characters in file names are replaced), so
 * a script reading stderr always gets exactly one line per failure.
 */
#include "cli.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *help_command; /* set once by main() before any subcommand runs */
static char rank_prefix[48];     /* "rank r of P: " once a distributed run knows its rank */

void cli_set_help_command(const char *command) {
    help_command = command;
}

void cli_set_rank(int rank, int size) {
    if (size > 1)
        snprintf(rank_prefix, sizeof rank_prefix, "rank %d of %d: ", rank, size);
    else
        rank_prefix[0] = '\0';
}

/* Prints "mha: " + text + suffix + "\n" with control characters (a newline in a file name, say)
 * turned into '?', so the message stays on one line. */
static void print_line(const char *text, const char *suffix) {
    char line[2048];
    snprintf(line, sizeof line, "mha: %s%s%s", rank_prefix, text, suffix);
    for (char *c = line; *c; c++)
        if ((unsigned char)*c < 0x20 || *c == 0x7f)
            *c = '?';
    fprintf(stderr, "%s\n", line);
    fflush(stderr);
}

int cli_fail(const char *fmt, ...) {
    char msg[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    print_line(msg, "");
    return CLI_FAIL;
}

int cli_usage(const char *fmt, ...) {
    char msg[1536], hint[64];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (help_command)
        snprintf(hint, sizeof hint, "; try 'mha %s --help'", help_command);
    else
        snprintf(hint, sizeof hint, "; try 'mha --help'");
    print_line(msg, hint);
    return CLI_USAGE;
}

int cli_lib_fail(const char *file, const mha_error *err) {
    const char *msg = err->message[0] ? err->message : mha_status_string(err->status);
    size_t flen = file ? strlen(file) : 0;
    if (!file || (strncmp(msg, file, flen) == 0 && (msg[flen] == ':' || msg[flen] == ' ')))
        return cli_fail("%s", msg);
    return cli_fail("%s: %s", file, msg);
}

int cli_parse(int argc, char **argv, const cli_opt *opts, int n_opts, cli_args *out) {
    memset(out, 0, sizeof *out);
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (strncmp(arg, "--", 2) != 0 || arg[2] == '\0')
            return cli_usage("unexpected argument '%s'", arg);
        const char *eq = strchr(arg, '=');
        size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
        int k = -1;
        for (int j = 0; j < n_opts; j++)
            if (strlen(opts[j].name) == len && strncmp(opts[j].name, arg, len) == 0)
                k = j;
        if (k < 0)
            return cli_usage("unknown option '%.*s'", (int)len, arg);
        const char *name = opts[k].name;
        if (out->given[k])
            return cli_usage("%s given twice", name);
        out->given[k] = 1;
        switch (opts[k].kind) {
        case CLI_OPT_FLAG:
            if (eq)
                return cli_usage("%s takes no value (got '%s')", name, eq + 1);
            out->value[k] = "";
            break;
        case CLI_OPT_VALUE:
            if (eq) {
                out->value[k] = eq + 1;
            } else {
                if (i + 1 >= argc || strncmp(argv[i + 1], "--", 2) == 0)
                    return cli_usage("%s needs a value", name);
                out->value[k] = argv[++i];
            }
            if (out->value[k][0] == '\0')
                return cli_usage("%s needs a non-empty value", name);
            break;
        case CLI_OPT_OPTIONAL:
            if (eq)
                out->value[k] = eq + 1;
            else if (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0)
                out->value[k] = argv[++i];
            else
                out->value[k] = "";
            break;
        }
    }
    return CLI_OK;
}

int cli_parse_i64(const char *flag, const char *s, int64_t min, int64_t max, int64_t *out) {
    char *end = NULL;
    errno = 0;
    long long v = (*s && !isspace((unsigned char)*s)) ? strtoll(s, &end, 10) : 0;
    if (!end || end == s || *end != '\0')
        return cli_usage("%s: '%s' is not an integer", flag, s);
    if (errno == ERANGE || v < min || v > max) {
        if (max == INT64_MAX)
            return cli_usage("%s: %s is out of range (must be >= %lld)", flag, s, (long long)min);
        return cli_usage("%s: %s is out of range [%lld, %lld]", flag, s, (long long)min,
                         (long long)max);
    }
    *out = (int64_t)v;
    return CLI_OK;
}

int cli_parse_u64(const char *flag, const char *s, uint64_t *out) {
    char *end = NULL;
    errno = 0;
    unsigned long long v = 0;
    if (isdigit((unsigned char)*s))
        v = strtoull(s, &end, 10);
    if (!end || end == s || *end != '\0')
        return cli_usage("%s: '%s' is not a non-negative integer", flag, s);
    if (errno == ERANGE)
        return cli_usage("%s: %s does not fit in 64 bits", flag, s);
    *out = (uint64_t)v;
    return CLI_OK;
}

int cli_parse_f64(const char *flag,
                  const char *s,
                  double min,
                  int min_open,
                  double max,
                  int max_open,
                  double *out) {
    char *end = NULL;
    errno = 0;
    double v = (*s && !isspace((unsigned char)*s)) ? strtod(s, &end) : 0.0;
    if (!end || end == s || *end != '\0')
        return cli_usage("%s: '%s' is not a number", flag, s);
    if (!isfinite(v) || errno == ERANGE)
        return cli_usage("%s: %s is not a finite number", flag, s);
    int below = min_open ? !(v > min) : !(v >= min);
    int above = max_open ? !(v < max) : !(v <= max);
    if (below || above) {
        if (isinf(max))
            return cli_usage("%s: %s must be %s %g", flag, s, min_open ? ">" : ">=", min);
        return cli_usage("%s: %s is outside %c%g, %g%c", flag, s, min_open ? '(' : '[', min, max,
                         max_open ? ')' : ']');
    }
    *out = v;
    return CLI_OK;
}

const char *cli_dtype_name(mha_dtype dtype) {
    switch (dtype) {
    case MHA_DTYPE_F32:
        return "float32";
    case MHA_DTYPE_F64:
        return "float64";
    case MHA_DTYPE_F16:
        return "float16";
    case MHA_DTYPE_BF16:
        return "bfloat16";
    case MHA_DTYPE_BOOL:
        return "bool";
    case MHA_DTYPE_U8:
        return "uint8";
    case MHA_DTYPE_I32:
        return "int32";
    case MHA_DTYPE_I64:
        return "int64";
    case MHA_DTYPE_Q8_0:
        return "q8_0";
    case MHA_DTYPE_Q4_0:
        return "q4_0";
    case MHA_DTYPE_FP8_E4M3:
        return "fp8_e4m3";
    }
    return "unknown";
}

const char *cli_shape_str(char *buf, size_t size, int32_t ndim, const int64_t *shape) {
    size_t used = 0;
    buf[0] = '\0';
    used += (size_t)snprintf(buf, size, "[");
    for (int32_t d = 0; d < ndim && used < size; d++)
        used +=
            (size_t)snprintf(buf + used, size - used, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (used < size)
        snprintf(buf + used, size - used, "]");
    return buf;
}

int cli_mul(int64_t a, int64_t b, int64_t *out) {
    if (a < 0 || b < 0 || (a != 0 && b > INT64_MAX / a))
        return 0;
    *out = a * b;
    return 1;
}
