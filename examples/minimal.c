/* SPDX-License-Identifier: MIT */
/* minimal.c: the smallest complete use of libmha: a causal self-attention layer with RoPE. */
#include <mha.h>
#include <stdio.h>

int main(void) {
    enum { B = 1, N = 4, D = 8, H = 2 };
    static float w_q[D * D], w_k[D * D], w_v[D * D], w_o[D * D], x[B * N * D], y[B * N * D];
    for (int i = 0; i < D * D; i++) { /* any weights: a scaled identity plus a ripple */
        w_q[i] = w_k[i] = w_v[i] = w_o[i] =
            (i % (D + 1) == 0 ? 1.0f : 0.0f) + 0.01f * (float)(i % 7);
    }
    for (int i = 0; i < B * N * D; i++)
        x[i] = (float)(i % 5) - 2.0f;

    mha_config cfg = {0};
    cfg.q_dim = D;
    cfg.num_heads = H;
    cfg.rope.style = MHA_ROPE_HALF; /* theta 10000, full rotary dim */
    mha_weights w = {0};
    w.w_q = w_q, w.w_k = w_k, w.w_v = w_v, w.w_o = w_o;

    mha_error err;
    mha_layer *layer;
    if (mha_layer_create(&cfg, &w, MHA_WEIGHTS_BORROW, NULL, &layer, &err) != MHA_STATUS_OK) {
        fprintf(stderr, "mha: %s\n", err.message);
        return 1;
    }
    mha_forward_args args = {0};
    args.batch = B, args.q_len = N, args.query = x, args.out = y;
    args.mask.causal = 1; /* bottom-right alignment by default; n == m here */
    mha_status st = mha_layer_forward(layer, &args, NULL, &err);
    if (st != MHA_STATUS_OK)
        fprintf(stderr, "mha: %s\n", err.message);
    else
        printf("y[0][0..3] = %.5f %.5f %.5f %.5f\n", (double)y[0], (double)y[1], (double)y[2],
               (double)y[3]);
    mha_layer_destroy(layer);
    return st == MHA_STATUS_OK ? 0 : 1;
}
