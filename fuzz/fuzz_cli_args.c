/* SPDX-License-Identifier: MIT */
/* fuzz_cli_args.c: libFuzzer harness for the `mha` command-line parsing. The input is split on
 * NUL bytes into an argument vector for `mha run` and checked with cli_run_check_args() (every
 * option and value check of `mha run`, no file access); each argument is also fed to the strict
 * number parsers and the one-line error printer. Invariants: no crash or out-of-bounds access;
 * the status is CLI_OK or CLI_USAGE; the arguments are not modified.
 * Run with -close_fd_mask=2: every rejected input prints one usage line on stderr.
 */
#include "cli.h"
#include "fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_ARGS 64

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 4096)
        return 0;
    char *text = malloc(size + 1);
    char *copy = malloc(size + 1);
    FUZZ_REQUIRE(text && copy, "malloc");
    memcpy(text, data, size);
    text[size] = '\0';
    memcpy(copy, text, size + 1);
    char *argv[MAX_ARGS + 2];
    int argc = 0;
    argv[argc++] = "run";
    for (size_t i = 0; i <= size && argc < MAX_ARGS + 1;) {
        argv[argc++] = text + i;
        i += strlen(text + i) + 1;
    }
    argv[argc] = NULL;

    cli_set_help_command("run");
    const int rc = cli_run_check_args(argc, argv);
    FUZZ_REQUIRE(rc == CLI_OK || rc == CLI_USAGE, "status %d", rc);
    FUZZ_REQUIRE(memcmp(text, copy, size + 1) == 0, "argv modified");

    for (int i = 1; i < argc && i < 4; i++) {
        int64_t i64;
        uint64_t u64;
        double f64;
        int r1 = cli_parse_i64("--x", argv[i], -5, INT64_MAX, &i64);
        int r2 = cli_parse_u64("--x", argv[i], &u64);
        int r3 = cli_parse_f64("--x", argv[i], 0.0, 1, 1.0, 1, &f64);
        FUZZ_REQUIRE(r1 != CLI_OK || i64 >= -5, "i64 range");
        FUZZ_REQUIRE(r3 != CLI_OK || (f64 > 0.0 && f64 < 1.0), "f64 range");
        (void)r2;
        FUZZ_REQUIRE(cli_fail("%s: x", argv[i]) == CLI_FAIL, "cli_fail");
    }
    free(text);
    free(copy);
    return 0;
}
