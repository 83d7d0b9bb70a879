/* SPDX-License-Identifier: MIT */
/* fuzz_gguf.c: libFuzzer harness for the GGUF reader (src/io/gguf.c). The input is a whole file
 * image, opened through mha__gguf_open_mem() (the same checks as mha_layer_load_gguf(), through
 * fmemopen); each layer it names (up to 3) has its info read and is loaded in float32, in
 * bfloat16, in q8_0 (Q8_0/Q4_0/Q5_0 blocks converted, other types quantised), in q4_0 (Q4_0
 * blocks kept, other types quantised) and with a config of
 * twice the heads of half the head size, with a counting allocator.
 * Invariants: no crash, leak or out-of-bounds access; errors fill mha_error consistently, name the
 * file and leave *out NULL; every allocation made through the allocator is given back; a loaded
 * layer has the info's sizes, finite weights, and runs a small causal forward.
 */
#include "fuzz_common.h"
#include "io/gguf.h"

#include <math.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static float weight_at(mha_dtype dt, const void *p, int64_t i) {
    if (dt == MHA_DTYPE_F32)
        return ((const float *)p)[i];
    float f = 0.0f;
    mha_half_to_f32(dt, (const uint16_t *)p + i, &f, 1, NULL);
    return f;
}

static void check_error(mha_status st, const mha_error *err, int64_t live) {
    fuzz_check_error(st, err);
    FUZZ_REQUIRE(strncmp(err->message, "fuzz.gguf: ", 11) == 0,
                 "message does not name the file: %s", err->message);
    FUZZ_REQUIRE(live == 0, "%lld allocations leaked on error", (long long)live);
}

/* The layer has the config's sizes (want), its weights are finite and it runs 2 tokens (small
 * layers only). */
static void use_layer(const mha_layer *L, const mha_config *want) {
    const mha_config *c = mha_layer_config(L);
    const mha_dtype wdt = want->weight_dtype;
    FUZZ_REQUIRE(c->num_heads == want->num_heads && c->num_kv_heads == want->num_kv_heads &&
                     c->head_dim == want->head_dim && c->q_dim == want->q_dim &&
                     c->weight_dtype == wdt,
                 "the layer is not the config's");
    const mha_weights *w = mha_layer_weights(L);
    const int64_t counts[4] = {
        c->num_heads * c->head_dim * c->q_dim, c->num_kv_heads * c->head_dim * c->q_dim,
        c->num_kv_heads * c->head_dim * c->q_dim, c->out_dim * c->num_heads * c->head_dim};
    const void *ptrs[4] = {w->w_q, w->w_k, w->w_v, w->w_o};
    for (int t = 0; t < 4 && wdt != MHA_DTYPE_Q8_0 && wdt != MHA_DTYPE_Q4_0;
         t++) /* q8_0, q4_0: scales checked at create */
        for (int64_t i = 0; i < counts[t]; i++)
            FUZZ_REQUIRE(isfinite(weight_at(wdt, ptrs[t], i)), "weight %d[%lld] not finite", t,
                         (long long)i);
    if (c->q_dim > 1024 || c->num_heads * c->head_dim > 4096)
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
    const mha_status st = mha_layer_forward(L, &a, &ex, &err);
    FUZZ_REQUIRE(st == MHA_STATUS_OK, "forward of a loaded layer failed: %s", err.message);
    free(x);
    free(y);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_counting cnt = {0};
    mha_allocator alloc = {&cnt, fuzz_count_alloc, fuzz_count_free};
    mha__gguf *g = (mha__gguf *)&cnt; /* must be overwritten */
    mha_error err;
    memset(&err, 0, sizeof err);
    mha_status st = mha__gguf_open_mem(data, size, "fuzz.gguf", &g, &err);
    if (st != MHA_STATUS_OK) {
        FUZZ_REQUIRE(g == NULL, "handle not NULL on error");
        check_error(st, &err, 0);
        return 0;
    }
    for (int64_t layer = 0; layer < 3; layer++) {
        mha_hf_layer_info info;
        st = mha__gguf_info(g, layer, &info, &err);
        if (st != MHA_STATUS_OK) {
            check_error(st, &err, 0);
            break;
        }
        /* float32, bfloat16, a caller's config of twice the heads of half the file's head size
         * (the same tensor shapes; llama's Q/K un-permutation still uses the file's), q8_0, q4_0 */
        const mha_dtype dts[5] = {MHA_DTYPE_F32, MHA_DTYPE_BF16, MHA_DTYPE_F32, MHA_DTYPE_Q8_0,
                                  MHA_DTYPE_Q4_0};
        for (int k = 0; k < 5; k++) {
            mha_config cfg = info.config;
            cfg.weight_dtype = dts[k];
            if (k == 2) {
                if (cfg.head_dim % 2 != 0)
                    continue;
                cfg.num_heads *= 2, cfg.num_kv_heads *= 2;
                cfg.head_dim /= 2, cfg.v_head_dim /= 2;
                if (cfg.rope.rotary_dim > cfg.head_dim)
                    cfg.rope.rotary_dim = cfg.head_dim - cfg.head_dim % 2;
            }
            mha_layer *L = (mha_layer *)&cnt;
            st = mha__gguf_load(g, layer, &cfg, &alloc, &L, &err);
            if (st != MHA_STATUS_OK) {
                FUZZ_REQUIRE(L == NULL, "*out not NULL on error");
                check_error(st, &err, cnt.live);
                continue;
            }
            FUZZ_REQUIRE(L != NULL && L != (mha_layer *)&cnt, "no layer on success");
            use_layer(L, &cfg);
            mha_layer_destroy(L);
            FUZZ_REQUIRE(cnt.live == 0, "%lld allocations leaked after destroy",
                         (long long)cnt.live);
        }
        if (layer + 1 >= info.num_layers)
            break;
    }
    mha__gguf_close(g);
    return 0;
}
