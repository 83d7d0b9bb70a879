/* SPDX-License-Identifier: MIT */
/* output_hash.c: the bit-identity check of refactors. Runs a fixed matrix of configurations
 * through the PUBLIC API only (layer forward, attention core with its log-sum-exp, layer and core
 * backward, KV-cache prefill/decode/attention; impl AUTO and REFERENCE; 1 and 2 threads) and
 * prints one FNV-1a 64-bit hash of the output bytes per section and one over everything.
 *
 * A refactor that must keep outputs bit-identical keeps every line of this program's output,
 * under every kernel tier (tools/output_hash.sh runs it with each MHA_MAX_ISA). Hashes depend on
 * the compiler, the flags and the CPU's best tier, so compare runs of one build setup on one
 * host, never against a stored number. */
#include "mha.h"
#include "mha_experimental.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct hash64 {
    uint64_t h;
    int64_t bytes;
} hash64;

static void hash_init(hash64 *s) {
    s->h = 1469598103934665603ull;
    s->bytes = 0;
}

static void hash_bytes(hash64 *s, const void *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    for (size_t i = 0; i < n; ++i) {
        s->h ^= b[i];
        s->h *= 1099511628211ull;
    }
    s->bytes += (int64_t)n;
}

static void hash_floats(hash64 *s, const float *x, int64_t n) {
    if (x)
        hash_bytes(s, x, (size_t)n * sizeof(float));
}

/* Deterministic inputs: a 64-bit LCG mapped to [-1, 1). */
static void fill(float *x, int64_t n, uint64_t seed, float amplitude) {
    uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
    for (int64_t i = 0; i < n; ++i) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = amplitude * ((float)(s >> 40) * (1.0f / 8388608.0f) - 1.0f);
    }
}

static float *new_filled(int64_t n, uint64_t seed, float amplitude) {
    float *x = (float *)calloc((size_t)(n > 0 ? n : 1), sizeof(float));
    if (!x) {
        fprintf(stderr, "output_hash: out of memory\n");
        exit(2);
    }
    fill(x, n, seed, amplitude);
    return x;
}

static void fail(const char *what, const mha_error *err) {
    fprintf(stderr, "output_hash: %s failed: %s\n", what, err->message);
    exit(1);
}

/* Half-precision storage of x in [-1, 1) (inputs only: truncated, which is as good as any rounding
 * for a hash's inputs): bfloat16 = the high half of the float32 bits; float16 built from the
 * exponent and the top 10 mantissa bits (0 below float16's normal range). */
static uint16_t to_half(mha_dtype dt, float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if (dt == MHA_DTYPE_BF16)
        return (uint16_t)(u >> 16);
    const int e = (int)((u >> 23) & 0xff) - 127 + 15;
    return e <= 0 ? (uint16_t)((u >> 16) & 0x8000u)
                  : (uint16_t)(((u >> 16) & 0x8000u) | (uint32_t)e << 10 | ((u >> 13) & 0x3ffu));
}

/* x in storage dt: x itself for F32, else a new half copy (x is freed by the caller). */
static void *stored(mha_dtype dt, float *x, int64_t n) {
    if (dt == MHA_DTYPE_F32)
        return x;
    uint16_t *h = (uint16_t *)calloc((size_t)(n > 0 ? n : 1), sizeof(uint16_t));
    if (!h) {
        fprintf(stderr, "output_hash: out of memory\n");
        exit(2);
    }
    for (int64_t i = 0; i < n; ++i)
        h[i] = to_half(dt, x[i]);
    return h;
}

static void hash_stored(hash64 *s, mha_dtype dt, const void *x, int64_t n) {
    if (x)
        hash_bytes(s, x, (size_t)n * (dt == MHA_DTYPE_F32 ? sizeof(float) : sizeof(uint16_t)));
}

/* ---- the layer configurations ---------------------------------------------------------------- */

typedef struct layer_case {
    const char *name;
    mha_config cfg;
    int64_t batch, n, m; /* m = 0: self-attention */
    int causal, window, bool_mask, key_padding, segments, additive, dropout, probs, explicit_align;
} layer_case;

static layer_case layer_cases[] = {
    {"self_causal_rope_half",
     {.q_dim = 64, .num_heads = 4, .rope = {.style = MHA_ROPE_HALF}},
     2,
     37,
     0,
     1,
     0,
     0,
     0,
     0,
     0,
     0,
     0,
     0},
    {"gqa_window_softcap_llama3",
     {.q_dim = 96,
      .num_heads = 6,
      .num_kv_heads = 2,
      .head_dim = 32,
      .softcap = 30.0,
      .rope = {.style = MHA_ROPE_INTERLEAVED, .scaling = MHA_ROPE_SCALING_LLAMA3}},
     1,
     130,
     0,
     1,
     1,
     0,
     0,
     0,
     0,
     0,
     1,
     0},
    {"cross_masks_dv",
     {.q_dim = 40,
      .k_dim = 24,
      .v_dim = 20,
      .num_heads = 2,
      .head_dim = 24,
      .v_head_dim = 12,
      .out_dim = 16,
      .bias_q = 1,
      .bias_k = 1,
      .bias_v = 1,
      .bias_o = 1},
     2,
     19,
     70,
     0,
     0,
     1,
     1,
     1,
     1,
     0,
     1,
     0},
    {"mqa_alibi_sinks_dropout",
     {.q_dim = 128,
      .num_heads = 4,
      .num_kv_heads = 1,
      .head_dim = 80,
      .alibi = 1,
      .sinks = 1,
      .rope = {.style = MHA_ROPE_HALF,
               .rotary_dim = 40,
               .scaling = MHA_ROPE_SCALING_YARN,
               .factor = 4.0}},
     1,
     75,
     0,
     1,
     0,
     0,
     1,
     0,
     0,
     1,
     1,
     1},
    {"big_head",
     {.q_dim = 256, .num_heads = 2, .rope = {.style = MHA_ROPE_HALF}},
     1,
     96,
     0,
     1,
     0,
     0,
     0,
     0,
     0,
     0,
     0,
     0},
};

typedef struct layer_inputs {
    float *x, *xk, *xv, *wq, *wk, *wv, *wo, *bq, *bk, *bv, *bo, *sinks, *additive;
    unsigned char *bool_mask, *key_padding;
    int32_t *qseg, *kseg;
    int64_t *offsets;
    int64_t m, kd, vd, hdk, gdk, gdv, hdv, od;
} layer_inputs;

static void make_layer_inputs(const layer_case *c, layer_inputs *in) {
    const mha_config *g = &c->cfg;
    int64_t kv = g->num_kv_heads ? g->num_kv_heads : g->num_heads;
    int64_t dk = g->head_dim ? g->head_dim : g->q_dim / g->num_heads;
    int64_t dv = g->v_head_dim ? g->v_head_dim : dk;
    in->kd = g->k_dim ? g->k_dim : g->q_dim;
    in->vd = g->v_dim ? g->v_dim : in->kd;
    in->od = g->out_dim ? g->out_dim : g->q_dim;
    in->hdk = g->num_heads * dk;
    in->gdk = kv * dk;
    in->gdv = kv * dv;
    in->hdv = g->num_heads * dv;
    in->m = c->m ? c->m : c->n;
    in->x = new_filled(c->batch * c->n * g->q_dim, 11, 1.0f);
    in->xk = c->m ? new_filled(c->batch * c->m * in->kd, 12, 1.0f) : NULL;
    in->xv = c->m ? new_filled(c->batch * c->m * in->vd, 13, 1.0f) : NULL;
    in->wq = new_filled(in->hdk * g->q_dim, 21, 0.2f);
    in->wk = new_filled(in->gdk * in->kd, 22, 0.2f);
    in->wv = new_filled(in->gdv * in->vd, 23, 0.2f);
    in->wo = new_filled(in->od * in->hdv, 24, 0.2f);
    in->bq = g->bias_q ? new_filled(in->hdk, 31, 0.1f) : NULL;
    in->bk = g->bias_k ? new_filled(in->gdk, 32, 0.1f) : NULL;
    in->bv = g->bias_v ? new_filled(in->gdv, 33, 0.1f) : NULL;
    in->bo = g->bias_o ? new_filled(in->od, 34, 0.1f) : NULL;
    in->sinks = g->sinks ? new_filled(g->num_heads, 35, 1.0f) : NULL;
    int64_t nm = c->n * in->m;
    in->additive = c->additive ? new_filled(nm, 36, 2.0f) : NULL;
    in->bool_mask = (unsigned char *)calloc((size_t)nm, 1);
    in->key_padding = (unsigned char *)calloc((size_t)(c->batch * in->m), 1);
    in->qseg = (int32_t *)calloc((size_t)(c->batch * c->n), sizeof(int32_t));
    in->kseg = (int32_t *)calloc((size_t)(c->batch * in->m), sizeof(int32_t));
    in->offsets = (int64_t *)calloc((size_t)c->batch, sizeof(int64_t));
    if (!in->bool_mask || !in->key_padding || !in->qseg || !in->kseg || !in->offsets) {
        fprintf(stderr, "output_hash: out of memory\n");
        exit(2);
    }
    for (int64_t i = 0; i < nm; ++i)
        in->bool_mask[i] = (unsigned char)((i * 7 + i / in->m) % 5 != 0);
    for (int64_t b = 0; b < c->batch; ++b) {
        for (int64_t j = 0; j < in->m; ++j)
            in->key_padding[b * in->m + j] = (unsigned char)(j < in->m - 3 * b - 1);
        for (int64_t i = 0; i < c->n; ++i)
            in->qseg[b * c->n + i] = (int32_t)(i * 3 / c->n);
        for (int64_t j = 0; j < in->m; ++j)
            in->kseg[b * in->m + j] = (int32_t)(j * 3 / in->m);
        in->offsets[b] = 5 - 3 * b;
    }
}

static void free_layer_inputs(layer_inputs *in) {
    void *all[] = {in->x,        in->xv,        in->xk,          in->wq,   in->wk,   in->wv,
                   in->wo,       in->bq,        in->bk,          in->bv,   in->bo,   in->sinks,
                   in->additive, in->bool_mask, in->key_padding, in->qseg, in->kseg, in->offsets};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i)
        free(all[i]);
}

static void set_masks(const layer_case *c, const layer_inputs *in, mha_masking *mk) {
    memset(mk, 0, sizeof *mk);
    mk->causal = c->causal;
    mk->alignment = c->explicit_align ? MHA_ALIGN_EXPLICIT : MHA_ALIGN_BOTTOM_RIGHT;
    mk->align_offsets = c->explicit_align ? in->offsets : NULL;
    if (c->window) {
        mk->use_window = 1;
        mk->window_left = 17;
        mk->window_right = 0;
    }
    if (c->bool_mask)
        mk->bool_mask = (mha_mask_tensor){in->bool_mask, MHA_DTYPE_BOOL, 2, {c->n, in->m}};
    if (c->key_padding)
        mk->key_padding = (mha_mask_tensor){in->key_padding, MHA_DTYPE_U8, 2, {c->batch, in->m}};
    if (c->additive)
        mk->additive_mask = (mha_mask_tensor){in->additive, MHA_DTYPE_F32, 2, {c->n, in->m}};
    if (c->segments) {
        mk->q_segment_ids = in->qseg;
        mk->kv_segment_ids = in->kseg;
    }
}

/* The layer over in's weights stored in dt (a COPY: the half copies are freed here). */
static mha_layer *make_layer(const layer_case *c, const layer_inputs *in, mha_dtype dt) {
    float *f[9] = {in->wq, in->wk, in->wv, in->wo, in->bq, in->bk, in->bv, in->bo, in->sinks};
    const int64_t n[9] = {in->hdk * c->cfg.q_dim,
                          in->gdk * in->kd,
                          in->gdv * in->vd,
                          in->od * in->hdv,
                          in->hdk,
                          in->gdk,
                          in->gdv,
                          in->od,
                          c->cfg.num_heads};
    const void *h[9];
    for (int i = 0; i < 9; ++i)
        h[i] = f[i] ? stored(dt, f[i], n[i]) : NULL;
    mha_weights w = {h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7], h[8], NULL, NULL};
    mha_config cfg = c->cfg;
    cfg.weight_dtype = dt;
    mha_layer *layer = NULL;
    mha_error err;
    if (mha_layer_create(&cfg, &w, MHA_WEIGHTS_COPY, NULL, &layer, &err) != MHA_STATUS_OK)
        fail(c->name, &err);
    for (int i = 0; dt != MHA_DTYPE_F32 && i < 9; ++i)
        free((void *)h[i]);
    return layer;
}

/* dt: the storage of the weights, inputs, out, dy and the input gradients (F32: the float32
 * hashes of before). */
static void run_layer_case(
    const layer_case *c, mha_dtype dt, mha_impl impl, int threads, hash64 *fwd, hash64 *bwd) {
    layer_inputs in;
    make_layer_inputs(c, &in);
    mha_layer *layer = make_layer(c, &in, dt);
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.batch = c->batch;
    a.q_len = c->n;
    a.kv_len = in.m;
    void *xs = stored(dt, in.x, c->batch * c->n * c->cfg.q_dim);
    void *xks = in.xk ? stored(dt, in.xk, c->batch * c->m * in.kd) : NULL;
    void *xvs = in.xv ? stored(dt, in.xv, c->batch * c->m * in.vd) : NULL;
    a.query = xs;
    a.key = xks;
    a.value = xvs;
    a.x_dtype = a.out_dtype = dt;
    set_masks(c, &in, &a.mask);
    if (c->dropout)
        a.dropout = (mha_dropout){.p = 0.25f, .seed = 1234567ull, .training = 1};
    float *out = new_filled(c->batch * c->n * in.od, 0, 0.0f);
    void *outs = stored(dt, out, c->batch * c->n * in.od);
    float *probs = c->probs ? new_filled(c->batch * c->cfg.num_heads * c->n * in.m, 0, 0.0f) : NULL;
    a.out = outs;
    a.probs = probs;
    mha_exec ex = {impl, threads, NULL, 0, NULL, NULL};
    mha_error err;
    if (mha_layer_forward(layer, &a, &ex, &err) != MHA_STATUS_OK)
        fail(c->name, &err);
    hash_stored(fwd, dt, outs, c->batch * c->n * in.od);
    hash_floats(fwd, probs, probs ? c->batch * c->cfg.num_heads * c->n * in.m : 0);

    /* Training forward + backward of every gradient the layer has. */
    mha_train_state *st = NULL;
    if (mha_layer_forward_train(layer, &a, &ex, &st, &err) != MHA_STATUS_OK)
        fail(c->name, &err);
    hash_stored(fwd, dt, outs, c->batch * c->n * in.od);
    float *dy = new_filled(c->batch * c->n * in.od, 41, 1.0f);
    void *dys = stored(dt, dy, c->batch * c->n * in.od);
    int64_t sizes[12] = {c->batch * c->n * c->cfg.q_dim,
                         c->m ? c->batch * in.m * in.kd : 0,
                         c->m ? c->batch * in.m * in.vd : 0,
                         in.hdk * c->cfg.q_dim,
                         in.gdk * in.kd,
                         in.gdv * in.vd,
                         in.od * in.hdv,
                         in.bq ? in.hdk : 0,
                         in.bk ? in.gdk : 0,
                         in.bv ? in.gdv : 0,
                         in.bo ? in.od : 0,
                         in.sinks ? c->cfg.num_heads : 0};
    float *buf[12];
    void *g[12]; /* the input gradients in dt, the weight gradients float32 */
    for (int i = 0; i < 12; ++i) {
        buf[i] = sizes[i] ? new_filled(sizes[i], 0, 0.0f) : NULL;
        g[i] = buf[i] && i < 3 ? stored(dt, buf[i], sizes[i]) : buf[i];
    }
    mha_layer_grads gr = {g[0], g[1], g[2],  g[3],  g[4], g[5], g[6], g[7],
                          g[8], g[9], g[10], g[11], 0,    NULL, NULL, NULL};
    if (mha_layer_backward(layer, st, dys, &gr, &ex, &err) != MHA_STATUS_OK)
        fail(c->name, &err);
    for (int i = 0; i < 12; ++i) {
        hash_stored(bwd, i < 3 ? dt : MHA_DTYPE_F32, g[i], sizes[i]);
        if (g[i] != buf[i])
            free(g[i]);
        free(buf[i]);
    }
    if (dt != MHA_DTYPE_F32) {
        void *halves[] = {xs, xks, xvs, outs, dys};
        for (size_t i = 0; i < sizeof halves / sizeof halves[0]; ++i)
            free(halves[i]);
    }
    free(dy);
    mha_train_state_destroy(st);
    free(out);
    free(probs);
    mha_layer_destroy(layer);
    free_layer_inputs(&in);
}

/* ---- the attention core with its log-sum-exp, and its backward ---------------------------------
 */

typedef struct core_case {
    const char *name;
    int64_t batch, h, g, n, m, dk, dv;
    int causal, window, softcap, alibi, sinks, top_left;
} core_case;

static const core_case core_cases[] = {
    {"core_causal_d64", 2, 4, 4, 150, 150, 64, 64, 1, 0, 0, 0, 0, 0},
    {"core_gqa_d128_window", 1, 8, 2, 70, 210, 128, 128, 1, 1, 0, 0, 0, 0},
    {"core_tail_d20_dv36", 1, 3, 1, 33, 65, 20, 36, 0, 0, 1, 1, 1, 0},
    {"core_topleft_d80", 1, 2, 2, 90, 40, 80, 80, 1, 0, 0, 0, 0, 1},
};

/* dt: the storage of q, k, v, out, dout and the gradients (F32: the float32 hashes of before). */
static void run_core_case(
    const core_case *c, mha_dtype dt, mha_impl impl, int threads, hash64 *fwd, hash64 *bwd) {
    int64_t nq = c->batch * c->h * c->n * c->dk, nk = c->batch * c->g * c->m * c->dk;
    int64_t nv = c->batch * c->g * c->m * c->dv, no = c->batch * c->h * c->n * c->dv;
    float *q = new_filled(nq, 51, 1.0f), *k = new_filled(nk, 52, 1.0f);
    float *v = new_filled(nv, 53, 1.0f), *o = new_filled(no, 0, 0.0f);
    void *qs_ = stored(dt, q, nq), *ks_ = stored(dt, k, nk), *vs_ = stored(dt, v, nv);
    void *os_ = stored(dt, o, no);
    float *lse = new_filled(c->batch * c->h * c->n, 0, 0.0f);
    float *sinks = c->sinks ? new_filled(c->h, 54, 1.0f) : NULL;
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = c->batch;
    a.num_heads = c->h;
    a.num_kv_heads = c->g;
    a.q_len = c->n;
    a.kv_len = c->m;
    a.head_dim = c->dk;
    a.v_head_dim = c->dv;
    a.softcap = c->softcap ? 20.0 : 0.0;
    a.alibi = c->alibi;
    a.sinks = sinks;
    a.q = qs_;
    a.k = ks_;
    a.v = vs_;
    a.out = os_;
    a.q_dtype = a.k_dtype = a.v_dtype = a.out_dtype = dt;
    a.lse = lse;
    /* [B, heads, L, d] contiguous */
    int64_t qs[3] = {c->h * c->n * c->dk, c->n * c->dk, c->dk};
    int64_t ks[3] = {c->g * c->m * c->dk, c->m * c->dk, c->dk};
    int64_t vs[3] = {c->g * c->m * c->dv, c->m * c->dv, c->dv};
    int64_t os[3] = {c->h * c->n * c->dv, c->n * c->dv, c->dv};
    memcpy(a.q_strides, qs, sizeof qs);
    memcpy(a.k_strides, ks, sizeof ks);
    memcpy(a.v_strides, vs, sizeof vs);
    memcpy(a.out_strides, os, sizeof os);
    a.mask.causal = c->causal;
    a.mask.alignment = c->top_left ? MHA_ALIGN_TOP_LEFT : MHA_ALIGN_BOTTOM_RIGHT;
    if (c->window) {
        a.mask.use_window = 1;
        a.mask.window_left = 40;
        a.mask.window_right = 3;
    }
    mha_exec ex = {impl, threads, NULL, 0, NULL, NULL};
    mha_error err;
    if (mha_attention(&a, &ex, &err) != MHA_STATUS_OK)
        fail(c->name, &err);
    hash_stored(fwd, dt, os_, no);
    hash_floats(fwd, lse, c->batch * c->h * c->n);

    float *dout = new_filled(no, 55, 1.0f);
    float *dq = new_filled(nq, 0, 0.0f), *dk = new_filled(nk, 0, 0.0f);
    float *dv = new_filled(nv, 0, 0.0f), *ds = sinks ? new_filled(c->h, 0, 0.0f) : NULL;
    void *dos_ = stored(dt, dout, no), *dqs_ = stored(dt, dq, nq), *dks_ = stored(dt, dk, nk);
    void *dvs_ = stored(dt, dv, nv);
    mha_attention_grads gr;
    memset(&gr, 0, sizeof gr);
    gr.dout_dtype = gr.dq_dtype = gr.dk_dtype = gr.dv_dtype = dt;
    gr.dout = dos_;
    memcpy(gr.dout_strides, os, sizeof os);
    gr.dq = dqs_;
    memcpy(gr.dq_strides, qs, sizeof qs);
    gr.dk = dks_;
    memcpy(gr.dk_strides, ks, sizeof ks);
    gr.dv = dvs_;
    memcpy(gr.dv_strides, vs, sizeof vs);
    gr.dsinks = ds;
    if (mha_attention_backward(&a, &gr, &ex, &err) != MHA_STATUS_OK)
        fail(c->name, &err);
    hash_stored(bwd, dt, dqs_, nq);
    hash_stored(bwd, dt, dks_, nk);
    hash_stored(bwd, dt, dvs_, nv);
    hash_floats(bwd, ds, ds ? c->h : 0);
    if (dt != MHA_DTYPE_F32) {
        void *halves[] = {qs_, ks_, vs_, os_, dos_, dqs_, dks_, dvs_};
        for (size_t i = 0; i < sizeof halves / sizeof halves[0]; ++i)
            free(halves[i]);
    }
    float *all[] = {q, k, v, o, lse, sinks, dout, dq, dk, dv, ds};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i)
        free(all[i]);
}

/* ---- KV-cache decoding -------------------------------------------------------------------------
 */

static void run_decode_case(mha_dtype dtype,
                            int64_t window,
                            int64_t head_dim,
                            int alibi,
                            mha_impl impl,
                            int threads,
                            hash64 *dec) {
    layer_case c = {"decode",
                    {.q_dim = 4 * head_dim,
                     .num_heads = 4,
                     .num_kv_heads = 1,
                     .head_dim = head_dim,
                     .alibi = alibi,
                     .sinks = alibi,
                     .softcap = alibi ? 25 : 0,
                     .rope = {.style = MHA_ROPE_HALF}},
                    2,
                    1,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0};
    layer_inputs in;
    make_layer_inputs(&c, &in);
    mha_layer *layer = make_layer(&c, &in, MHA_DTYPE_F32);
    mha_kv_cache_config kc = {0};
    kc.max_seq = 400;
    kc.batch = 2;
    kc.dtype = dtype;
    kc.window = window;
    mha_kv_cache *cache = NULL;
    mha_error err;
    if (mha_kv_cache_create(&kc, layer, NULL, &cache, &err) != MHA_STATUS_OK)
        fail("kv cache", &err);
    mha_exec ex = {impl, threads, NULL, 0, NULL, NULL};
    int64_t q_dim = c.cfg.q_dim;
    float *x = new_filled(2 * 300 * q_dim, 61, 1.0f);
    float *out = new_filled(2 * 300 * q_dim, 0, 0.0f);
    /* A 300-token prompt, then steps of 1, 1, 3 and 1 tokens. */
    const int64_t steps[] = {300, 1, 1, 3, 1};
    for (size_t s = 0; s < sizeof steps / sizeof steps[0]; ++s) {
        int64_t t = steps[s];
        float *xs = new_filled(2 * t * q_dim, 62 + (uint64_t)s, 1.0f);
        if (s == 0)
            memcpy(xs, x, (size_t)(2 * t * q_dim) * sizeof(float));
        mha_decode_args d = {2, NULL, t, xs, out, NULL};
        mha_status st = s == 0 ? mha_layer_prefill(layer, cache, &d, &ex, &err)
                               : mha_layer_decode_step(layer, cache, &d, &ex, &err);
        if (st != MHA_STATUS_OK)
            fail("decode step", &err);
        hash_floats(dec, out, 2 * t * q_dim);
        free(xs);
    }
    /* Core-level attention over the cache with the log-sum-exp. */
    int64_t h = 4, t = 2;
    float *q = new_filled(2 * t * h * head_dim, 70, 1.0f);
    float *o = new_filled(2 * t * h * head_dim, 0, 0.0f);
    float *lse = new_filled(2 * h * t, 0, 0.0f);
    mha_kv_attention_args ka;
    memset(&ka, 0, sizeof ka);
    ka.num_seqs = 2;
    ka.num_tokens = t;
    ka.num_heads = h;
    ka.alibi = alibi;
    ka.softcap = alibi ? 25 : 0;
    ka.sinks = in.sinks;
    ka.q = q;
    ka.out = o;
    ka.lse = lse;
    if (mha_kv_cache_attention(cache, &ka, &ex, &err) != MHA_STATUS_OK)
        fail("kv attention", &err);
    hash_floats(dec, o, 2 * t * h * head_dim);
    hash_floats(dec, lse, 2 * h * t);
    free(q);
    free(o);
    free(lse);
    free(x);
    free(out);
    mha_kv_cache_destroy(cache);
    mha_layer_destroy(layer);
    free_layer_inputs(&in);
}

/* Many query rows per kv head (the decode kernels' wide paths, docs/INFERENCE.md "Draft tree"):
 * 2 sequences of 600 and 437 positions (appended 8 at a time) in a cache of 2 kv heads, then
 * core-level attention with 16 query heads (8 per kv head) over t = 4 chained tokens (R = 32)
 * and over a draft tree of 8 (R = 64), out and lse hashed. Paged caches (block_size 16) equal
 * contiguous ones bit for bit, so they hash the same bytes through the block tables. */
static void run_rows_case(
    mha_dtype dtype, int64_t head_dim, int64_t window, int64_t block_size, int threads, hash64 *h) {
    mha_kv_cache_config kc = {0};
    kc.num_kv_heads = 2;
    kc.head_dim = head_dim;
    kc.max_seq = 700;
    kc.batch = 2;
    kc.dtype = dtype;
    kc.window = window;
    kc.max_step_tokens = 8;
    kc.block_size = block_size;
    mha_kv_cache *cache = NULL;
    mha_error err;
    if (mha_kv_cache_create(&kc, NULL, NULL, &cache, &err) != MHA_STATUS_OK)
        fail("rows cache", &err);
    const float scales[2] = {0.05f, 0.5f};
    if (dtype == MHA_DTYPE_FP8_E4M3 &&
        mha_kv_cache_set_fp8_scales(cache, scales, scales, &err) != MHA_STATUS_OK)
        fail("fp8 scales", &err);
    const int64_t gd = 2 * head_dim, lens[2] = {600, 437};
    float *kv = new_filled(2 * 8 * gd, 0, 0.0f);
    for (int64_t s = 0; s < 2; s++)
        for (int64_t p = 0; p < lens[s]; p += 8) {
            const int64_t t = lens[s] - p < 8 ? lens[s] - p : 8;
            fill(kv, 2 * t * gd, 80 + (uint64_t)(s * 1000 + p), 1.0f);
            if (mha_kv_cache_append(cache, 1, &s, t, kv, kv + t * gd, &err) != MHA_STATUS_OK)
                fail("rows append", &err);
        }
    static const int64_t tree[8] = {-1, 0, 0, 1, 1, 2, 2, 3};
    const int64_t nh = 16;
    mha_exec ex = {MHA_IMPL_AUTO, threads, NULL, 0, NULL, NULL};
    for (int64_t t = 4; t <= 8; t += 4) {
        float *q = new_filled(2 * t * nh * head_dim, 90 + (uint64_t)t, 1.0f);
        float *o = new_filled(2 * t * nh * head_dim, 0, 0.0f);
        float *lse = new_filled(2 * nh * t, 0, 0.0f);
        mha_kv_attention_args ka;
        memset(&ka, 0, sizeof ka);
        ka.num_seqs = 2, ka.num_tokens = t, ka.num_heads = nh;
        ka.q = q, ka.out = o, ka.lse = lse;
        ka.tree_parents = t == 8 ? tree : NULL;
        if (mha_kv_cache_attention(cache, &ka, &ex, &err) != MHA_STATUS_OK)
            fail("rows attention", &err);
        hash_floats(h, o, 2 * t * nh * head_dim);
        hash_floats(h, lse, 2 * nh * t);
        free(q);
        free(o);
        free(lse);
    }
    free(kv);
    mha_kv_cache_destroy(cache);
}

/* q8_0 (or q4_0: wdt) projection weights (docs/SEMANTICS.md "q8_0 weights", "q4_0 weights"): the
 * decode layer of run_decode_case with its four matrices quantised (mha_q8_0_quantize /
 * mha_q4_0_quantize; the sinks float32), the forward over a 300-token prompt, then prefill +
 * steps of 1, 3 and 1 tokens (the dot path). */
static void
run_q8_case(mha_dtype wdt, int64_t head_dim, int alibi, mha_impl impl, int threads, hash64 *h) {
    layer_case c = {"q8",
                    {.q_dim = 4 * head_dim,
                     .num_heads = 4,
                     .num_kv_heads = 1,
                     .head_dim = head_dim,
                     .alibi = alibi,
                     .sinks = alibi,
                     .rope = {.style = MHA_ROPE_HALF},
                     .weight_dtype = wdt},
                    2,
                    1,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0,
                    0};
    layer_inputs in;
    make_layer_inputs(&c, &in);
    float *f[4] = {in.wq, in.wk, in.wv, in.wo};
    const int64_t n[4] = {in.hdk * c.cfg.q_dim, in.gdk * in.kd, in.gdv * in.vd, in.od * in.hdv};
    void *q[4];
    mha_error err;
    for (int i = 0; i < 4; ++i) {
        const int q4 = wdt == MHA_DTYPE_Q4_0;
        q[i] = malloc((size_t)(n[i] / 32) * (q4 ? 18 : 34));
        if (!q[i] ||
            (q4 ? mha_q4_0_quantize : mha_q8_0_quantize)(f[i], n[i], q[i], &err) != MHA_STATUS_OK)
            fail("q8 quantize", &err);
    }
    mha_weights w = {q[0], q[1], q[2], q[3], NULL, NULL, NULL, NULL, in.sinks, NULL, NULL};
    mha_layer *layer = NULL;
    if (mha_layer_create(&c.cfg, &w, MHA_WEIGHTS_COPY, NULL, &layer, &err) != MHA_STATUS_OK)
        fail("q8 layer", &err);
    for (int i = 0; i < 4; ++i)
        free(q[i]);
    const int64_t q_dim = c.cfg.q_dim;
    mha_exec ex = {impl, threads, NULL, 0, NULL, NULL};
    float *x = new_filled(2 * 300 * q_dim, 71, 1.0f);
    float *out = new_filled(2 * 300 * q_dim, 0, 0.0f);
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.batch = 2;
    a.q_len = 300;
    a.query = x;
    a.out = out;
    a.mask.causal = 1;
    if (mha_layer_forward(layer, &a, &ex, &err) != MHA_STATUS_OK)
        fail("q8 forward", &err);
    hash_floats(h, out, 2 * 300 * q_dim);
    mha_kv_cache_config kc = {0};
    kc.max_seq = 400;
    kc.batch = 2;
    mha_kv_cache *cache = NULL;
    if (mha_kv_cache_create(&kc, layer, NULL, &cache, &err) != MHA_STATUS_OK)
        fail("q8 kv cache", &err);
    const int64_t steps[] = {300, 1, 3, 1};
    for (size_t s = 0; s < sizeof steps / sizeof steps[0]; ++s) {
        const int64_t t = steps[s];
        float *xs = s == 0 ? x : new_filled(2 * t * q_dim, 72 + (uint64_t)s, 1.0f);
        mha_decode_args d = {2, NULL, t, xs, out, NULL};
        mha_status st = s == 0 ? mha_layer_prefill(layer, cache, &d, &ex, &err)
                               : mha_layer_decode_step(layer, cache, &d, &ex, &err);
        if (st != MHA_STATUS_OK)
            fail("q8 decode step", &err);
        hash_floats(h, out, 2 * t * q_dim);
        if (s > 0)
            free(xs);
    }
    free(x);
    free(out);
    mha_kv_cache_destroy(cache);
    mha_layer_destroy(layer);
    free_layer_inputs(&in);
}

static void report(const char *section, const hash64 *s, hash64 *total) {
    printf("%-14s %016llx  (%lld bytes)\n", section, (unsigned long long)s->h, (long long)s->bytes);
    hash_bytes(total, &s->h, sizeof s->h);
}

int main(void) {
    hash64 fwd, bwd, core_fwd, core_bwd, dec, total, half_fwd[2], half_bwd[2], lhalf_fwd[2],
        lhalf_bwd[2];
    hash_init(&fwd);
    hash_init(&bwd);
    hash_init(&core_fwd);
    hash_init(&core_bwd);
    for (int i = 0; i < 2; ++i) {
        hash_init(&half_fwd[i]);
        hash_init(&half_bwd[i]);
        hash_init(&lhalf_fwd[i]);
        hash_init(&lhalf_bwd[i]);
    }
    hash_init(&dec);
    hash_init(&total);
    printf("tiers          %s\n", mha_experimental_cpu_isas(1));
    const mha_impl impls[] = {MHA_IMPL_AUTO, MHA_IMPL_REFERENCE};
    const int thread_counts[] = {1, 2};
    const mha_dtype dtypes[] = {MHA_DTYPE_F32, MHA_DTYPE_F16, MHA_DTYPE_BF16};
    for (int ii = 0; ii < 2; ++ii)
        for (int ti = 0; ti < 2; ++ti) {
            for (size_t c = 0; c < sizeof layer_cases / sizeof layer_cases[0]; ++c) {
                run_layer_case(&layer_cases[c], MHA_DTYPE_F32, impls[ii], thread_counts[ti], &fwd,
                               &bwd);
                for (int hi = 0; hi < 2; ++hi) /* dtypes[1 + hi]: F16, BF16 */
                    run_layer_case(&layer_cases[c], dtypes[1 + hi], impls[ii], thread_counts[ti],
                                   &lhalf_fwd[hi], &lhalf_bwd[hi]);
            }
            for (size_t c = 0; c < sizeof core_cases / sizeof core_cases[0]; ++c) {
                run_core_case(&core_cases[c], MHA_DTYPE_F32, impls[ii], thread_counts[ti],
                              &core_fwd, &core_bwd);
                for (int hi = 0; hi < 2; ++hi) /* dtypes[1 + hi]: F16, BF16 */
                    run_core_case(&core_cases[c], dtypes[1 + hi], impls[ii], thread_counts[ti],
                                  &half_fwd[hi], &half_bwd[hi]);
            }
            for (int di = 0; di < 3; ++di)
                for (int wi = 0; wi < 2; ++wi) {
                    run_decode_case(dtypes[di], wi ? 100 : 0, 64, wi, impls[ii], thread_counts[ti],
                                    &dec);
                    run_decode_case(dtypes[di], wi ? 0 : 120, 128, 0, impls[ii], thread_counts[ti],
                                    &dec);
                    run_decode_case(dtypes[di], 0, 20, wi, impls[ii], thread_counts[ti], &dec);
                }
        }
    report("layer_fwd", &fwd, &total);
    report("layer_bwd", &bwd, &total);
    report("core_fwd", &core_fwd, &total);
    report("core_bwd", &core_bwd, &total);
    report("layer_f16_fwd", &lhalf_fwd[0], &total);
    report("layer_f16_bwd", &lhalf_bwd[0], &total);
    report("layer_bf16_fwd", &lhalf_fwd[1], &total);
    report("layer_bf16_bwd", &lhalf_bwd[1], &total);
    report("core_f16_fwd", &half_fwd[0], &total);
    report("core_f16_bwd", &half_bwd[0], &total);
    report("core_bf16_fwd", &half_fwd[1], &total);
    report("core_bf16_bwd", &half_bwd[1], &total);
    report("decode", &dec, &total);
    report("all", &total, &total);
    /* Sections added after "all" (kept out of it, so that it stays comparable with before). */
    hash64 q8, after;
    hash_init(&q8);
    hash_init(&after);
    for (int ii = 0; ii < 2; ++ii)
        for (int ti = 0; ti < 2; ++ti)
            for (int hd = 64; hd <= 128; hd += 64)
                run_q8_case(MHA_DTYPE_Q8_0, hd, hd == 128, impls[ii], thread_counts[ti], &q8);
    report("layer_q8w", &q8, &after);
    /* 8-bit KV caches (docs/SEMANTICS.md "q8_0 KV cache", "fp8 KV cache"): the decode cases of
     * head sizes 64 and 128 (multiples of q8_0's block of 32), with and without a window. */
    hash64 kv8;
    hash_init(&kv8);
    const mha_dtype kv8_dtypes[] = {MHA_DTYPE_Q8_0, MHA_DTYPE_FP8_E4M3};
    for (int ii = 0; ii < 2; ++ii)
        for (int ti = 0; ti < 2; ++ti)
            for (int di = 0; di < 2; ++di)
                for (int wi = 0; wi < 2; ++wi) {
                    run_decode_case(kv8_dtypes[di], wi ? 100 : 0, 64, wi, impls[ii],
                                    thread_counts[ti], &kv8);
                    run_decode_case(kv8_dtypes[di], wi ? 0 : 120, 128, 0, impls[ii],
                                    thread_counts[ti], &kv8);
                }
    report("decode_kv8", &kv8, &after);
    hash64 q4;
    hash_init(&q4);
    for (int ii = 0; ii < 2; ++ii)
        for (int ti = 0; ti < 2; ++ti)
            for (int hd = 64; hd <= 128; hd += 64)
                run_q8_case(MHA_DTYPE_Q4_0, hd, hd == 128, impls[ii], thread_counts[ti], &q4);
    report("layer_q4w", &q4, &after);
    hash64 rows;
    hash_init(&rows);
    const mha_dtype row_dtypes[] = {MHA_DTYPE_F32, MHA_DTYPE_F16, MHA_DTYPE_BF16, MHA_DTYPE_Q8_0,
                                    MHA_DTYPE_FP8_E4M3};
    for (int di = 0; di < 5; ++di)
        for (int hd = 64; hd <= 128; hd += 64)
            for (int wi = 0; wi < 2; ++wi)
                for (int bi = 0; bi < 2; ++bi)
                    for (int ti = 0; ti < 2; ++ti)
                        run_rows_case(row_dtypes[di], hd, wi ? 100 : 0, bi ? 16 : 0,
                                      thread_counts[ti], &rows);
    report("decode_rows", &rows, &after);
    return 0;
}
