/* SPDX-License-Identifier: MIT */
/* An out-of-tree user of an installed libmha (tests/install/run.sh builds it through pkg-config
 * and through find_package(mha)): one small causal layer forward, whose output must be finite. */
#include <mha.h>

#include <math.h>
#include <stdio.h>

enum { N = 5, D = 8 };

int main(void) {
    static float w[4][D * D], x[N * D], y[N * D];
    for (int i = 0; i < D * D; ++i)
        for (int t = 0; t < 4; ++t)
            w[t][i] = (float)((i * (t + 3)) % 7 - 3) * 0.1f;
    for (int i = 0; i < N * D; ++i)
        x[i] = (float)(i % 5) * 0.25f - 0.5f;
    mha_config cfg = {0};
    cfg.q_dim = D;
    cfg.num_heads = 2;
    mha_weights wts = {0};
    wts.w_q = w[0];
    wts.w_k = w[1];
    wts.w_v = w[2];
    wts.w_o = w[3];
    mha_layer *layer = NULL;
    mha_error err;
    if (mha_layer_create(&cfg, &wts, MHA_WEIGHTS_BORROW, NULL, &layer, &err) != MHA_STATUS_OK) {
        fprintf(stderr, "consumer: %s\n", err.message);
        return 1;
    }
    mha_forward_args a = {0};
    a.batch = 1;
    a.q_len = N;
    a.query = x;
    a.out = y;
    a.mask.causal = 1;
    mha_status st = mha_layer_forward(layer, &a, NULL, &err);
    mha_layer_destroy(layer);
    if (st != MHA_STATUS_OK) {
        fprintf(stderr, "consumer: %s\n", err.message);
        return 1;
    }
    for (int i = 0; i < N * D; ++i)
        if (!isfinite(y[i]))
            return 1;
    printf("consumer: libmha %s, y[0] = %.6f\n", mha_version(), (double)y[0]);
    return 0;
}
