/* SPDX-License-Identifier: MIT */
/* mha_cli.c: entry point of the `mha` program, the top-level usage text and `mha info`.
 *
 * The program is a thin client of mha.h: `mha run` (cli_run.c) runs a layer from a safetensors
 * file on .npy tensors, `mha demo` (cli_demo.c) shows attention maps of a built-in layer, and
 * `mha info` reports the version, threads, CPU features and which implementations can run a few
 * sample problems. Exit status: 0 success, 1 failure, 2 usage error (one line on stderr).
 */
#include "cli.h"
#include "mha_experimental.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(void) {
    printf("Usage: mha <command> [options]\n"
           "\n"
           "Exact multi-head attention on the CPU (libmha %s).\n"
           "\n"
           "Commands:\n"
           "  run     run one attention layer: safetensors weights + .npy inputs -> .npy output\n"
           "  demo    show per-head attention maps of a small built-in layer (no files needed)\n"
           "  info    version, threads, CPU features and available implementations\n"
           "  decode-bench  prefill + N decode steps through a KV cache: tokens/s, bandwidth\n"
           "\n"
           "Options:\n"
           "  --help      this text ('mha <command> --help' for a command's options)\n"
           "  --version   print the version\n"
           "\n"
           "Examples:\n"
           "  mha demo\n"
           "  mha run --weights attn.safetensors --heads 8 --input x.npy --out y.npy --causal\n"
           "  mha run --help\n"
           "\n"
           "Exit status: 0 success, 1 failure (bad file, shapes that do not fit, ...),\n"
           "2 usage error. Every failure prints exactly one line on stderr.\n",
           mha_version());
}

/* ---------------------------------------------------------------------------------------------- */
/* mha info                                                                                       */
/* ---------------------------------------------------------------------------------------------- */

/* The library's own CPU detection (cpuid + XGETBV), before and after the MHA_MAX_ISA cap, and the
 * registry of every op's kernels with what this CPU runs: no second feature list in the CLI. */
static void print_kernels(void) {
    printf("cpu tiers (detected): %s\n", mha_experimental_cpu_isas(0));
    printf("kernel tiers (under MHA_MAX_ISA): %s\n", mha_experimental_cpu_isas(1));
    printf("decode prefetch: fills the L%d (the projection GEMMs' weights: the L%d)\n",
           (int)mha_experimental_cpu_prefetch_level(),
           (int)mha_experimental_cpu_gemm_prefetch_level());
    const int bf16_tier = strstr(mha_experimental_cpu_isas(1), "avx512bf16") != NULL;
    printf("bf16 tiles (vdpbf16ps): %s\n",
           mha_experimental_cpu_bf16_tiles() ? "run for bf16 operands (forward, projections)"
           : bf16_tier ? "passed over: this CPU runs bf16 operands faster on the float32 kernels "
                         "(docs/performance.md); MHA_KERNEL still runs them"
                       : "not on this CPU (or capped by MHA_MAX_ISA)");
    printf("q8_0 KV caches: %s\n",
           mha_experimental_cpu_q8x16()
               ? "key-interleaved order, read by VPDPBUSD (docs/INFERENCE.md)"
               : "ggml's rows (the key-interleaved order's kernel needs AVX-512 VNNI and is "
                 "preferred on AMD Zen 5 and later)");
    printf("amx-bf16: %s\n", mha_experimental_cpu_amx_bf16()
                                 ? "present, unused: no AMX kernel is registered yet (none has "
                                   "passed its tests on an AMX host; docs/KERNELS.md)"
                                 : "absent on this CPU (no AMX kernel is registered yet either)");
    printf("kernels by op, priority order (* = the op's first usable one; the forward's and the\n"
           "decode's choice also depend on the problem: the first usable one whose limits and\n"
           "dtypes take it, a decode line's dtypes being the cache's);\n"
           "columns: op, name, storage dtypes of the activations it takes, status:\n");
    for (int32_t i = 0; i < mha_experimental_kernel_count(); ++i) {
        mha_kernel_desc d;
        if (mha_experimental_kernel_describe(i, &d, NULL) != MHA_STATUS_OK)
            continue;
        const int active = mha_experimental_kernel_active(d.op) == i;
        printf("  %-6s %c %-38s %-12s %s\n", d.op, active ? '*' : ' ', d.name, d.dtypes,
               !d.usable      ? "not on this CPU"
               : d.reference  ? "reference"
               : !d.preferred ? "usable, passed over (bf16 tiles)"
                              : "usable");
    }
}

enum { INFO_B = 1, INFO_H = 8, INFO_N = 64, INFO_D = 64 };

/* One sample problem per row: the options layered on a plain self-attention call. */
static void info_problem(int variant, mha_attention_args *a, const char **label) {
    switch (variant) {
    case 0:
        *label = "plain";
        break;
    case 1:
        *label = "causal";
        a->mask.causal = 1;
        break;
    case 2:
        *label = "causal, probabilities returned";
        a->mask.causal = 1;
        break;
    case 3:
        *label = "GQA (8 query / 2 kv heads)";
        a->num_kv_heads = 2;
        break;
    case 4:
        *label = "sliding window (16, 0)";
        a->mask.use_window = 1;
        a->mask.window_left = 16;
        a->mask.window_right = 0;
        break;
    case 5:
        *label = "ALiBi + soft-cap 30";
        a->alibi = 1;
        a->softcap = 30.0;
        break;
    default:
        *label = "dropout 0.1 (training)";
        a->dropout.training = 1;
        a->dropout.p = 0.1f;
        a->dropout.seed = 1;
        break;
    }
}

int cli_info_main(int argc, char **argv) {
    static const cli_opt opts[] = {{"--help", CLI_OPT_FLAG},
                                   {"--model", CLI_OPT_VALUE},
                                   {"--layer", CLI_OPT_VALUE},
                                   {"--gguf", CLI_OPT_VALUE}};
    cli_args args;
    int rc = cli_parse(argc, argv, opts, 4, &args);
    if (rc)
        return rc;
    if (args.given[0]) {
        printf(
            "Usage: mha info [--model DIR | --gguf FILE [--layer L]]\n\nPrints the version, the "
            "number of "
            "threads used by default (--threads 0),\nthe kernel tiers this CPU has, the "
            "forward kernels, and which implementations (--impl) can run a few sample\n"
            "problems. With --model: what a Hugging Face model directory's layer L (default "
            "0)\nmeans to mha (the options `mha run --model DIR --layer L` uses). With --gguf: the "
            "same for a\nllama.cpp GGUF file (`mha run --gguf FILE --layer L`).\n");
        return CLI_OK;
    }
    if (args.given[1] && args.given[3])
        return cli_usage("--model and --gguf exclude each other");
    if (args.given[2] && !args.given[1] && !args.given[3])
        return cli_usage("--layer needs --model or --gguf");
    if (args.given[1] || args.given[3])
        return cli_info_model(args.given[1] ? args.value[1] : args.value[3],
                              args.given[2] ? args.value[2] : NULL, !args.given[1]);

    printf("mha %s (libmha %s)\n", MHA_CLI_VERSION_STRING, mha_version());
    printf("threads: %d (online CPUs; used by --threads 0)\n", mha_default_threads());
    const char *cairo = cli_plot_cairo_version();
    printf("plots (run --plot): %s%s\n", cairo ? "cairo " : "unavailable, built without cairo",
           cairo ? cairo : "");
    print_kernels();

    const size_t elems = (size_t)INFO_B * INFO_H * INFO_N * INFO_D;
    float *buf = calloc(elems * 4 + (size_t)INFO_B * INFO_H * INFO_N * INFO_N, sizeof(float));
    if (!buf)
        return cli_fail("out of memory");
    printf("implementations (--impl) on sample problems, B=%d h=%d n=m=%d d_k=d_v=%d:\n", INFO_B,
           INFO_H, INFO_N, INFO_D);
    static const struct {
        mha_impl impl;
        const char *name;
    } impls[] = {
        {MHA_IMPL_REFERENCE, "reference"}, {MHA_IMPL_FAST, "fast"}, {MHA_IMPL_AUTO, "auto"}};
    enum { N_IMPLS = 3, N_VARIANTS = 7, MAX_NOTES = N_IMPLS * N_VARIANTS };
    char(*notes)[MHA_ERROR_MESSAGE_SIZE] = calloc(MAX_NOTES, sizeof *notes);
    if (!notes) {
        free(buf);
        return cli_fail("out of memory");
    }
    int n_notes = 0;
    printf("  %-32s %-10s %-10s %s\n", "problem", "reference", "fast", "auto");
    for (int variant = 0; variant < N_VARIANTS; variant++) {
        mha_attention_args a;
        memset(&a, 0, sizeof a);
        a.batch = INFO_B;
        a.num_heads = INFO_H;
        a.q_len = INFO_N;
        a.kv_len = INFO_N;
        a.head_dim = INFO_D;
        const int64_t s[3] = {(int64_t)INFO_H * INFO_N * INFO_D, (int64_t)INFO_N * INFO_D, INFO_D};
        a.q = buf;
        a.k = buf + elems;
        a.v = buf + 2 * elems;
        a.out = buf + 3 * elems;
        memcpy(a.q_strides, s, sizeof s);
        memcpy(a.k_strides, s, sizeof s);
        memcpy(a.v_strides, s, sizeof s);
        memcpy(a.out_strides, s, sizeof s);
        const char *label = "";
        info_problem(variant, &a, &label);
        if (a.num_kv_heads == 2) /* kv tensors are [B, 2, n, d] */
            a.k_strides[0] = a.v_strides[0] = 2LL * INFO_N * INFO_D;
        if (variant == 2)
            a.probs = buf + 4 * elems;
        printf("  %-32s", label);
        for (int i = 0; i < N_IMPLS; i++) {
            mha_exec ex;
            memset(&ex, 0, sizeof ex);
            ex.impl = impls[i].impl;
            mha_error err;
            memset(&err, 0, sizeof err);
            mha_status st = mha_attention_supported(&a, &ex, &err);
            char cell[16];
            if (st == MHA_STATUS_OK) {
                snprintf(cell, sizeof cell, "yes");
            } else { /* a footnote per distinct reason */
                const char *why = err.message[0] ? err.message : mha_status_string(st);
                int k = 0;
                while (k < n_notes && strcmp(notes[k], why) != 0)
                    k++;
                if (k == n_notes)
                    snprintf(notes[n_notes++], sizeof notes[0], "%s", why);
                snprintf(cell, sizeof cell, "no [%d]", k + 1);
            }
            printf(i + 1 < N_IMPLS ? " %-10s" : " %s\n", cell);
        }
    }
    for (int k = 0; k < n_notes; k++)
        printf("  [%d] %s\n", k + 1, notes[k]);
    free(notes);
    free(buf);
    return CLI_OK;
}

int main(int argc, char **argv) {
    if (argc < 2)
        return cli_usage("no command given (commands: run, demo, info, decode-bench)");
    const char *cmd = argv[1];
    if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "-h") == 0 || strcmp(cmd, "help") == 0) {
        usage();
        return CLI_OK;
    }
    if (strcmp(cmd, "--version") == 0) {
        printf("mha %s (libmha %s)\n", MHA_CLI_VERSION_STRING, mha_version());
        return CLI_OK;
    }
    if (strcmp(cmd, "run") == 0) {
        cli_set_help_command("run");
        return cli_run_main(argc - 1, argv + 1);
    }
    if (strcmp(cmd, "demo") == 0) {
        cli_set_help_command("demo");
        return cli_demo_main(argc - 1, argv + 1);
    }
    if (strcmp(cmd, "decode-bench") == 0) {
        cli_set_help_command("decode-bench");
        return cli_decode_bench_main(argc - 1, argv + 1);
    }
    if (strcmp(cmd, "info") == 0) {
        cli_set_help_command("info");
        return cli_info_main(argc - 1, argv + 1);
    }
    if (strncmp(cmd, "--", 2) == 0)
        return cli_usage("unknown option '%s' (commands: run, demo, info, decode-bench)", cmd);
    return cli_usage("unknown command '%s' (commands: run, demo, info, decode-bench)", cmd);
}
