/* SPDX-License-Identifier: MIT */
/* fuzz_safetensors.c: libFuzzer harness for the safetensors loader. The input is a whole file
 * image, loaded through mha__safetensors_load_mem() (the same checks as
 * mha_layer_load_safetensors(), through fmemopen) with --heads 1 and 2 and a counting allocator.
 * Invariants: no crash, leak or out-of-bounds access; errors fill mha_error consistently and leave
 * *out NULL; every allocation made through the allocator is given back; a loaded layer has
 * finite weights of the sizes its config states and runs a small forward with a finite output.
 */
#include "fuzz_common.h"
#include "io/safetensors.h"

#include <math.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Runs the loaded layer once on a 2-token input; the output must be finite unless a weight is
 * so large (> 1e6) that float32 overflow is the right answer. */
static void run_small_forward(const mha_layer *L, float max_abs_weight) {
    /* (weights in any weight_dtype: the forward widens them; x and y stay float32) */
    const mha_config *c = mha_layer_config(L);
    /* Guard against a (valid) layer too big to run quickly. */
    if (c->q_dim > 4096 || c->out_dim > 4096)
        return;
    const int64_t n = 2;
    float *x = malloc(sizeof(float) * (size_t)(n * c->q_dim));
    float *y = malloc(sizeof(float) * (size_t)(n * c->out_dim));
    FUZZ_REQUIRE(x && y, "malloc");
    for (int64_t i = 0; i < n * c->q_dim; i++)
        x[i] = (float)((i % 7) - 3) * 0.25f;
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.batch = 1;
    a.q_len = n;
    a.query = x;
    a.out = y;
    a.mask.causal = 1;
    mha_exec ex;
    memset(&ex, 0, sizeof ex);
    ex.n_threads = 1;
    mha_error err;
    if (c->k_dim == c->q_dim && c->v_dim == c->q_dim) {
        mha_status st = mha_layer_forward(L, &a, &ex, &err);
        FUZZ_REQUIRE(st == MHA_STATUS_OK, "forward of a loaded layer failed: %s", err.message);
        for (int64_t i = 0; i < n * c->out_dim && max_abs_weight <= 1e6f; i++)
            FUZZ_REQUIRE(isfinite(y[i]), "non-finite output %g at %lld", (double)y[i],
                         (long long)i);
    }
    free(x);
    free(y);
}

/* Element i of a weight tensor stored in `dt` (F32, BF16 or F16), widened. */
static float weight_at(mha_dtype dt, const void *p, int64_t i) {
    if (dt == MHA_DTYPE_F32)
        return ((const float *)p)[i];
    float f = 0.0f;
    mha_half_to_f32(dt, (const uint16_t *)p + i, &f, 1, NULL);
    return f;
}

static void load_once(const uint8_t *data, size_t size, int64_t heads, mha_dtype wdt) {
    fuzz_counting cnt = {0};
    mha_allocator alloc = {&cnt, fuzz_count_alloc, fuzz_count_free};
    mha_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_heads = heads;
    cfg.weight_dtype = wdt;
    mha_layer *L = (mha_layer *)&cnt; /* must be overwritten */
    mha_error err;
    memset(&err, 0, sizeof err);
    mha_status st = mha__safetensors_load_mem(data, size, "fuzz.safetensors", NULL, NULL, &cfg,
                                              &alloc, &L, &err);
    if (st != MHA_STATUS_OK) {
        fuzz_check_error(st, &err);
        FUZZ_REQUIRE(L == NULL, "*out not NULL on error");
        FUZZ_REQUIRE(strncmp(err.message, "fuzz.safetensors", 16) == 0,
                     "message does not name the file: %s", err.message);
        FUZZ_REQUIRE(cnt.live == 0, "%lld allocations leaked on error", (long long)cnt.live);
        return;
    }
    FUZZ_REQUIRE(L != NULL, "no layer on success");
    const mha_config *c = mha_layer_config(L);
    const mha_weights *w = mha_layer_weights(L);
    FUZZ_REQUIRE(c->num_heads == heads && c->num_heads % c->num_kv_heads == 0, "heads");
    FUZZ_REQUIRE(c->weight_dtype == wdt, "weight_dtype %d, asked %d", (int)c->weight_dtype,
                 (int)wdt);
    const int64_t counts[4] = {
        c->num_heads * c->head_dim * c->q_dim, c->num_kv_heads * c->head_dim * c->k_dim,
        c->num_kv_heads * c->v_head_dim * c->v_dim, c->out_dim * c->num_heads * c->v_head_dim};
    const void *ptrs[4] = {w->w_q, w->w_k, w->w_v, w->w_o};
    float max_abs = 0.0f;
    for (int t = 0; t < 4; t++)
        for (int64_t i = 0; i < counts[t]; i++) {
            const float v = weight_at(wdt, ptrs[t], i);
            FUZZ_REQUIRE(isfinite(v), "weight %d[%lld] not finite", t, (long long)i);
            max_abs = fmaxf(max_abs, fabsf(v));
        }
    const void *biases[5] = {w->b_q, w->b_k, w->b_v, w->b_o, w->sinks};
    const int64_t nb[5] = {c->num_heads * c->head_dim, c->num_kv_heads * c->head_dim,
                           c->num_kv_heads * c->v_head_dim, c->out_dim, c->num_heads};
    for (int t = 0; t < 5; t++)
        for (int64_t i = 0; biases[t] && i < nb[t]; i++)
            max_abs = fmaxf(max_abs, fabsf(weight_at(wdt, biases[t], i)));
    run_small_forward(L, max_abs);
    mha_layer_destroy(L);
    FUZZ_REQUIRE(cnt.live == 0, "%lld allocations leaked after destroy", (long long)cnt.live);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    load_once(data, size, 1, MHA_DTYPE_F32);
    load_once(data, size, 2, MHA_DTYPE_F32);
    load_once(data, size, 2, MHA_DTYPE_BF16); /* half weights: tensors kept or rounded once */
    load_once(data, size, 1, MHA_DTYPE_F16);
    return 0;
}
