/* SPDX-License-Identifier: MIT */
/* bench_layer_parts.c: `mha_bench_parts`, where the time of one layer forward goes. For one
 * self-attention shape it times, round-robin in one process (so a busy neighbour slows every
 * stage alike), each stage of mha_layer_forward on its own and the whole forward two ways:
 *   proj_q       the Q projection alone, x[n, d] W_q^T into a warm buffer (mha__gemm_xwt)
 *   proj_q_fresh the same into a freshly allocated buffer (first-touch page faults included)
 *   core         the attention core alone (mha_attention) on warm Q, K, V, caller workspace
 *   layer_ws     mha_layer_forward with a caller workspace reused across calls
 *   layer        mha_layer_forward with no workspace (the library allocates per call)
 *   qk_norm      the QK-norm step alone (RMS per head, issue 31) on warm Q and K [n, d] each
 *   layer_qkn_ws layer_ws of the same layer with that QK-norm (its cost: layer_qkn_ws / layer_ws)
 *   temperature  temperature tuning's step alone (Llama 4's NoPE layers, issue 31: n factors
 *                tau(p) and Q [n, d] scaled) on the warm Q
 * FLOPs: projection 2 n d^2, attention 2 h P (d_k + d_v) with P the unmasked pairs, the layer
 * four projections plus attention. The FMA peak is measured before and after.
 *
 * Usage: mha_bench_parts [--n N] [--d D] [--heads H] [--causal 0|1] [--threads T] [--reps R] */
#define _POSIX_C_SOURCE 200809L
#include "fma_peak.h"
#include "kernels/gemm.h"
#include "layer/plan.h"
#include "mha.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum {
    STAGE_PROJ,
    STAGE_PROJ_FRESH,
    STAGE_CORE,
    STAGE_LAYER_WS,
    STAGE_LAYER,
    STAGE_QK_NORM,
    STAGE_LAYER_QKN_WS,
    STAGE_TEMPERATURE,
    STAGE_COUNT
};
static const char *const stage_names[STAGE_COUNT] = {"proj_q",       "proj_q_fresh", "core",
                                                     "layer_ws",     "layer",        "qk_norm",
                                                     "layer_qkn_ws", "temperature"};

static float *random_floats(int64_t count, unsigned *seed, float amp) {
    float *p = malloc(sizeof(float) * (size_t)count);
    if (!p)
        return NULL;
    for (int64_t i = 0; i < count; i++) {
        *seed = *seed * 1664525u + 1013904223u;
        p[i] = amp * ((float)(*seed >> 8) / 16777216.0f * 2.0f - 1.0f);
    }
    return p;
}

int main(int argc, char **argv) {
    int64_t n = 2048, d = 1024, h = 16;
    int causal = 1, threads = 1, reps = 7;
    for (int i = 1; i + 1 < argc; i += 2) {
        const long long v = atoll(argv[i + 1]);
        if (!strcmp(argv[i], "--n"))
            n = v;
        else if (!strcmp(argv[i], "--d"))
            d = v;
        else if (!strcmp(argv[i], "--heads"))
            h = v;
        else if (!strcmp(argv[i], "--causal"))
            causal = (int)v;
        else if (!strcmp(argv[i], "--threads"))
            threads = (int)v;
        else if (!strcmp(argv[i], "--reps"))
            reps = (int)v;
        else {
            fprintf(stderr, "mha_bench_parts: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (n < 1 || d < 1 || h < 1 || d % h || threads < 1 || reps < 1 || reps > 1000) {
        fprintf(stderr, "mha_bench_parts: bad sizes\n");
        return 2;
    }
    const int64_t dk = d / h;
    unsigned seed = 12345u;
    const float amp = 1.0f / sqrtf((float)d);
    float *x = random_floats(n * d, &seed, 1.0f);
    float *wts = random_floats(4 * d * d, &seed, amp);
    float *qkv = malloc(sizeof(float) * (size_t)(4 * n * d));
    float *out = malloc(sizeof(float) * (size_t)(n * d));
    if (!x || !wts || !qkv || !out) {
        fprintf(stderr, "mha_bench_parts: out of memory\n");
        return 1;
    }
    memset(qkv, 0, sizeof(float) * (size_t)(4 * n * d));

    mha_config cfg = {0};
    cfg.q_dim = d;
    cfg.num_heads = h;
    mha_weights w = {0};
    w.w_q = wts;
    w.w_k = wts + d * d;
    w.w_v = wts + 2 * d * d;
    w.w_o = wts + 3 * d * d;
    mha_error err;
    mha_layer *layer = NULL;
    if (mha_layer_create(&cfg, &w, MHA_WEIGHTS_BORROW, NULL, &layer, &err)) {
        fprintf(stderr, "mha_bench_parts: %s\n", err.message);
        return 1;
    }
    mha_forward_args fa = {0};
    fa.batch = 1;
    fa.q_len = n;
    fa.query = x;
    fa.out = out;
    fa.mask.causal = causal;
    mha_exec ex = {0};
    ex.n_threads = threads;
    size_t layer_ws_bytes = 0;
    if (mha_layer_forward_workspace_size(layer, &fa, &ex, &layer_ws_bytes, &err)) {
        fprintf(stderr, "mha_bench_parts: %s\n", err.message);
        return 1;
    }
    void *layer_ws = malloc(layer_ws_bytes);
    /* The same layer with QK-norm (RMS per head, weights around 1) and its own workspace. */
    float *norm_w = random_floats(dk, &seed, 0.1f);
    for (int64_t i = 0; norm_w && i < dk; i++)
        norm_w[i] += 1.0f;
    mha_config cfg_n = cfg;
    cfg_n.qk_norm.kind = MHA_QK_NORM_RMS_HEAD;
    cfg_n.qk_norm.eps = 1e-6;
    mha_weights w_n = w;
    w_n.q_norm = w_n.k_norm = norm_w;
    mha_layer *layer_n = NULL;
    size_t layer_n_ws_bytes = 0;
    if (!norm_w || mha_layer_create(&cfg_n, &w_n, MHA_WEIGHTS_BORROW, NULL, &layer_n, &err) ||
        mha_layer_forward_workspace_size(layer_n, &fa, &ex, &layer_n_ws_bytes, &err)) {
        fprintf(stderr, "mha_bench_parts: QK-norm layer: %s\n", err.message);
        return 1;
    }
    void *layer_n_ws = malloc(layer_n_ws_bytes);
    const mha_qk_norm *qkn = &mha_layer_config(layer_n)->qk_norm;
    const mha_temperature_tuning temp = {1, 8192.0, 0.1}; /* Llama 4's */

    /* The core on [1, n, h, dk] buffers (the layer's layout), strides {b, head, row}. */
    mha_attention_args ca = {0};
    ca.batch = 1;
    ca.num_heads = h;
    ca.q_len = ca.kv_len = n;
    ca.head_dim = dk;
    const int64_t strides[3] = {n * d, dk, d};
    ca.q = qkv;
    ca.k = qkv + n * d;
    ca.v = qkv + 2 * n * d;
    ca.out = qkv + 3 * n * d;
    memcpy(ca.q_strides, strides, sizeof strides);
    memcpy(ca.k_strides, strides, sizeof strides);
    memcpy(ca.v_strides, strides, sizeof strides);
    memcpy(ca.out_strides, strides, sizeof strides);
    ca.mask.causal = causal;
    for (int64_t i = 0; i < 3 * n * d; i++)
        qkv[i] = x[i % (n * d)];
    size_t core_ws_bytes = 0;
    if (mha_attention_workspace_size(&ca, &ex, &core_ws_bytes, &err)) {
        fprintf(stderr, "mha_bench_parts: %s\n", err.message);
        return 1;
    }
    void *core_ws = malloc(core_ws_bytes ? core_ws_bytes : 1);
    if (!layer_ws || !core_ws || !layer_n_ws) {
        fprintf(stderr, "mha_bench_parts: out of memory\n");
        return 1;
    }

    const double pairs = causal ? (double)n * (double)(n + 1) / 2.0 : (double)n * (double)n;
    const double proj_gflop = 2.0 * (double)n * (double)d * (double)d * 1e-9;
    const double attn_gflop = 2.0 * (double)h * pairs * (double)(2 * dk) * 1e-9;
    const double gflop[STAGE_COUNT] = {proj_gflop,
                                       proj_gflop,
                                       attn_gflop,
                                       4 * proj_gflop + attn_gflop,
                                       4 * proj_gflop + attn_gflop,
                                       0.0,
                                       4 * proj_gflop + attn_gflop,
                                       0.0};
    const char *isa = "";
    const double peak0 = bench_peak_best_gflops(threads, 20.0, 5, &isa);
    double *times = malloc(sizeof(double) * (size_t)(STAGE_COUNT * reps));
    if (!times)
        return 1;
    for (int r = -1; r < reps; r++) /* r = -1: warm-up */
        for (int s = 0; s < STAGE_COUNT; s++) {
            const double t0 = bench_now_s();
            mha_status st = MHA_STATUS_OK;
            ex.workspace = NULL;
            ex.workspace_bytes = 0;
            switch (s) {
            case STAGE_PROJ:
                st = mha__gemm_xwt(n, d, d, x, d, w.w_q, d, NULL, qkv, d, mha__team_of(threads),
                                   MHA__GEMM_AUTO, NULL, &err);
                break;
            case STAGE_PROJ_FRESH: {
                float *fresh = malloc(sizeof(float) * (size_t)(n * d));
                st = fresh ? mha__gemm_xwt(n, d, d, x, d, w.w_q, d, NULL, fresh, d,
                                           mha__team_of(threads), MHA__GEMM_AUTO, NULL, &err)
                           : MHA_STATUS_NO_MEMORY;
                free(fresh);
                break;
            }
            case STAGE_CORE:
                ex.workspace = core_ws;
                ex.workspace_bytes = core_ws_bytes;
                st = mha_attention(&ca, &ex, &err);
                break;
            case STAGE_LAYER_WS:
                ex.workspace = layer_ws;
                ex.workspace_bytes = layer_ws_bytes;
                st = mha_layer_forward(layer, &fa, &ex, &err);
                break;
            case STAGE_QK_NORM: /* on the warm Q and K buffers, as the forward runs it */
                mha__plan_qk_norm(qkn, norm_w, qkv, n, h, dk);
                mha__plan_qk_norm(qkn, norm_w, qkv + n * d, n, h, dk);
                break;
            case STAGE_TEMPERATURE: /* on the warm Q, as the forward runs it */
                mha__plan_temperature(&temp, qkv, 1, n, h, dk, NULL, NULL);
                break;
            case STAGE_LAYER_QKN_WS:
                ex.workspace = layer_n_ws;
                ex.workspace_bytes = layer_n_ws_bytes;
                st = mha_layer_forward(layer_n, &fa, &ex, &err);
                break;
            default:
                st = mha_layer_forward(layer, &fa, &ex, &err);
                break;
            }
            if (st) {
                fprintf(stderr, "mha_bench_parts: %s: %s\n", stage_names[s], err.message);
                return 1;
            }
            if (r >= 0)
                times[s * reps + r] = bench_now_s() - t0;
        }
    const double peak1 = bench_peak_best_gflops(threads, 20.0, 5, NULL);
    const double peak = peak0 > peak1 ? peak0 : peak1;
    printf("# n=%lld d=%lld h=%lld causal=%d threads=%d; FMA peak (%s) %.1f / %.1f GFLOP/s "
           "before / after; median, min, max of %d round-robin runs\n",
           (long long)n, (long long)d, (long long)h, causal, threads, isa, peak0, peak1, reps);
    printf("%-13s %9s %9s %9s %8s %6s\n", "stage", "med_ms", "min_ms", "max_ms", "GFLOP/s",
           "%peak");
    double med_of[STAGE_COUNT];
    for (int s = 0; s < STAGE_COUNT; s++) {
        double *t = times + s * reps;
        qsort(t, (size_t)reps, sizeof *t, bench_cmp_double);
        const double med = t[reps / 2];
        med_of[s] = med;
        printf("%-13s %9.2f %9.2f %9.2f %8.1f %5.1f%%\n", stage_names[s], 1e3 * med, 1e3 * t[0],
               1e3 * t[reps - 1], gflop[s] / med, 100.0 * gflop[s] / med / peak);
    }
    printf("# QK-norm: qk_norm / layer_ws = %.2f%%, layer_qkn_ws / layer_ws = %.3f (medians)\n",
           100.0 * med_of[STAGE_QK_NORM] / med_of[STAGE_LAYER_WS],
           med_of[STAGE_LAYER_QKN_WS] / med_of[STAGE_LAYER_WS]);
    printf("# temperature: temperature / layer_ws = %.3f%% (medians)\n",
           100.0 * med_of[STAGE_TEMPERATURE] / med_of[STAGE_LAYER_WS]);
    free(times);
    free(core_ws);
    free(layer_ws);
    free(layer_n_ws);
    free(norm_w);
    mha_layer_destroy(layer);
    mha_layer_destroy(layer_n);
    free(out);
    free(qkv);
    free(wts);
    free(x);
    return 0;
}
