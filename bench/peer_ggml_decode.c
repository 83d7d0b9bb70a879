/* SPDX-License-Identifier: MIT */
/* peer_ggml_decode.c: one decode step of attention over a KV cache, mha against ggml (the tensor
 * library llama.cpp runs on), in one process, on the same data (issue 14).
 *
 * Shape (the issue's, and `mha decode-bench`'s defaults): one new query token of batch 1 with
 * h = 32 query heads, g = 8 kv heads (4 query heads per kv head, GQA), d_k = d_v = d = 128,
 * attending to all L cached positions (L = 4096 and 32768), no mask beyond "every key is
 * visible" (the last token of a causal sequence). Cache dtypes f32, f16 and bf16, and q8_0
 * (issue 32): each library quantises the same float32 keys and values into its own q8_0 cache
 * (mha at append, ggml with ggml_quantize_chunk); ggml's flash path reads its GGML_TYPE_Q8_0 K
 * and V, the mul_mat path is not run (llama.cpp's transposed V cache would be quantised along
 * the positions); "err" is then against the float64 attention over the ORIGINAL values, so the
 * two err columns are the two quantisations' errors on the same data.
 *
 * Three ways of computing the same step, timed round-robin (one call of each in turn, rotating
 * the order every repetition, a short pause before each call so that no thread of the previous
 * call is still spinning on the two shared cores):
 *
 *   ggml mul_mat  llama.cpp's graph without flash attention. Its per-layer caches: K is
 *                 [d * g, kv_size] (one row of all kv heads per cell), V is stored transposed,
 *                 [kv_size, d, g] (ggml order: fastest index first), so that
 *                   kq  = mul_mat(K view [d, n_kv, g], q [d, 1, h])      -> [n_kv, 1, h]
 *                   p   = soft_max_ext(kq, mask [n_kv, 1], 1/sqrt(d), 0)
 *                   out = mul_mat(V^T view [n_kv, d, g], p)               -> [d, 1, h]
 *                 then permute + cont to [d * h] (a 16 KB copy), as llama.cpp does. ggml
 *                 broadcasts query head i to kv head i / (h / g), as mha does.
 *   ggml flash    ggml_flash_attn_ext(q, K view, V view, mask (f16), scale) with F32 precision,
 *                 V not transposed ([d * g, kv_size] like K). llama.cpp casts an f32 cache to f16
 *                 before this op every step; we give ggml its f32 cache directly (its CPU kernel
 *                 takes f32, f16 and bf16 K/V), which can only make ggml faster.
 *   mha           mha_kv_cache_attention on an mha_kv_cache (K and V [g, slots, d] per sequence)
 *                 holding the same values, one query token (the last appended position).
 *
 * The ggml graphs and plans are built once per case; a timed ggml call is ggml_graph_compute
 * alone (with a persistent ggml threadpool), a timed mha call is mha_kv_cache_attention alone
 * (with a persistent mha_threadpool). The random K/V are appended to the mha cache first, read
 * back (mha_kv_cache_read, exact) and stored into ggml's tensors, so both libraries see the same
 * rounded values. Each output is compared with a float64 reference over those values: "err" is
 * max |out - ref| / max |ref|. GB/s = bytes of K and V of the visible cache / median step time.
 * The machine's read bandwidth is measured in the same run by a plain read loop (each thread
 * sums its share of a buffer much larger than the last-level cache), at the start and the end.
 *
 * Built only when CMake is given -DMHA_GGML_DIR=<ggml install prefix, or "build dir;source dir">
 * (bench/CMakeLists.txt); never part of the normal build. docs/INFERENCE.md, "Peer: ggml".
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, nanosleep */
#define _DEFAULT_SOURCE         /* madvise */

#include "mha.h"
#include "mha_experimental.h"

#include "peer_util.h"

#include <ggml-cpu.h>
#include <ggml.h>

#include <math.h>

enum { P_MM, P_FA, P_MHA, P_COUNT }; /* ggml mul_mat graph, ggml flash_attn_ext, mha */

#define GGML_CTX_MB 64 /* graph context: tensor records + q, masks, scores, outputs (~9 MB) */

/* ---- one case: shapes, dtype, length; mha's cache and ggml's tensors with the same values --- */
typedef struct peer_case {
    int64_t h, g, d, L;
    mha_dtype dtype;
    enum ggml_type gtype;
    size_t elt;     /* bytes per cached element (q8_0: 0, a block type; rows: ggml_row_size) */
    const float *q; /* [h, d], the new token's query (post-RoPE) */
    double *ref;    /* [h, d], float64 reference over the stored (rounded) K/V */
    float *out[P_COUNT];
    mha_kv_cache *cache;
    void *k_buf, *v_buf, *vt_buf; /* ggml: K [d*g, L], V [d*g, L], V^T [L, d, g] */
    struct ggml_context *ctx_cache, *ctx;
    struct ggml_tensor *out_t[2];
    struct ggml_cgraph *graph[2];
} peer_case;

/* Stores float32 values `src` (exactly representable in the dtype) as ggml's type. */
static void to_ggml(enum ggml_type t, const float *src, void *dst, int64_t n) {
    if (t == GGML_TYPE_F32)
        memcpy(dst, src, sizeof(float) * (size_t)n);
    else if (t == GGML_TYPE_F16)
        ggml_fp32_to_fp16_row(src, dst, n);
    else
        ggml_fp32_to_bf16_row(src, dst, n);
}

/* The random K and V rows of positions [p0, p0 + t) into kv (K rows, then V rows from
 * kv + chunk * gd): position-major, K row then V row, as one token. */
static void draw_kv(float *kv, int64_t chunk, int64_t t, int64_t gd) {
    for (int64_t p = 0; p < t; p++) {
        for (int64_t i = 0; i < gd; i++)
            kv[p * gd + i] = rnd();
        for (int64_t i = 0; i < gd; i++)
            kv[(chunk + p) * gd + i] = rnd();
    }
}

/* Fills the mha cache with L random positions, copies them into ggml's three buffers and
 * computes the float64 reference. K/V master values are drawn per position: [g, d] each. */
static int fill_q8_case(peer_case *c);
static int fill_case(peer_case *c) {
    if (c->dtype == MHA_DTYPE_Q8_0)
        return fill_q8_case(c);
    const int64_t L = c->L, gd = c->g * c->d, h = c->h, d = c->d, grp = c->h / c->g;
    const int64_t chunk = 1024;
    float *kv = xalloc(sizeof(float) * (size_t)(2 * chunk * gd));
    mha_error err;
    memset(&err, 0, sizeof err);
    rng_state = 0x9E3779B97F4A7C15ull; /* the same data for every dtype and length prefix */
    for (int64_t p0 = 0; p0 < L; p0 += chunk) {
        const int64_t t = L - p0 < chunk ? L - p0 : chunk;
        draw_kv(kv, chunk, t, gd);
        if (mha_kv_cache_append(c->cache, 1, NULL, t, kv, kv + chunk * gd, &err) != MHA_STATUS_OK) {
            fprintf(stderr, "mha_kv_cache_append: %s\n", err.message);
            free(kv);
            return 1;
        }
    }
    /* Read back the stored values (rounded to the dtype), give them to ggml, and take the
     * reference scores s[head, pos] = q . k / sqrt(d) in float64. */
    double *s = xalloc(sizeof(double) * (size_t)(h * L));
    float *kr = kv, *vr = kv + gd;
    unsigned char *row = xalloc(c->elt * (size_t)gd);
    const double scale = 1.0 / sqrt((double)d);
    for (int64_t p = 0; p < L; p++) {
        mha_kv_cache_read(c->cache, 0, p, kr, vr, NULL);
        to_ggml(c->gtype, kr, (char *)c->k_buf + c->elt * (size_t)(p * gd), gd);
        to_ggml(c->gtype, vr, (char *)c->v_buf + c->elt * (size_t)(p * gd), gd);
        to_ggml(c->gtype, vr, row, gd); /* V^T: element (p, j) of kv head j / d, row j % d */
        for (int64_t j = 0; j < gd; j++)
            memcpy((char *)c->vt_buf + c->elt * (size_t)(j * L + p), row + c->elt * (size_t)j,
                   c->elt);
        for (int64_t hh = 0; hh < h; hh++) {
            const float *qh = c->q + hh * d, *kh = kr + (hh / grp) * d;
            double dot = 0.0;
            for (int64_t i = 0; i < d; i++)
                dot += (double)qh[i] * (double)kh[i];
            s[hh * L + p] = dot * scale;
        }
    }
    for (int64_t hh = 0; hh < h; hh++) { /* softmax per head */
        double mx = -HUGE_VAL, sum = 0.0;
        for (int64_t p = 0; p < L; p++)
            mx = s[hh * L + p] > mx ? s[hh * L + p] : mx;
        for (int64_t p = 0; p < L; p++)
            sum += (s[hh * L + p] = exp(s[hh * L + p] - mx));
        for (int64_t p = 0; p < L; p++)
            s[hh * L + p] /= sum;
    }
    memset(c->ref, 0, sizeof(double) * (size_t)(h * d));
    for (int64_t p = 0; p < L; p++) {
        mha_kv_cache_read(c->cache, 0, p, NULL, vr, NULL);
        for (int64_t hh = 0; hh < h; hh++) {
            const float *vh = vr + (hh / grp) * d;
            for (int64_t i = 0; i < d; i++)
                c->ref[hh * d + i] += s[hh * L + p] * (double)vh[i];
        }
    }
    free(row);
    free(s);
    free(kv);
    return 0;
}

/* The float64 attention of the h query heads over K/V rows supplied position by position:
 * s[hh * L + p] = q . k / sqrt(d) is accumulated by ref_scores, then ref_finish turns s into
 * softmax weights, and ref_values adds weight * v. */
static void ref_scores(const peer_case *c, const float *kr, int64_t p, double *s) {
    const int64_t d = c->d, grp = c->h / c->g;
    const double scale = 1.0 / sqrt((double)d);
    for (int64_t hh = 0; hh < c->h; hh++) {
        const float *qh = c->q + hh * d, *kh = kr + (hh / grp) * d;
        double dot = 0.0;
        for (int64_t i = 0; i < d; i++)
            dot += (double)qh[i] * (double)kh[i];
        s[hh * c->L + p] = dot * scale;
    }
}
static void ref_softmax(const peer_case *c, double *s) {
    const int64_t L = c->L;
    for (int64_t hh = 0; hh < c->h; hh++) {
        double mx = -HUGE_VAL, sum = 0.0;
        for (int64_t p = 0; p < L; p++)
            mx = s[hh * L + p] > mx ? s[hh * L + p] : mx;
        for (int64_t p = 0; p < L; p++)
            sum += (s[hh * L + p] = exp(s[hh * L + p] - mx));
        for (int64_t p = 0; p < L; p++)
            s[hh * L + p] /= sum;
    }
}
static void ref_values(peer_case *c, const float *vr, int64_t p, const double *s) {
    const int64_t d = c->d, grp = c->h / c->g;
    for (int64_t hh = 0; hh < c->h; hh++) {
        const float *vh = vr + (hh / grp) * d;
        for (int64_t i = 0; i < d; i++)
            c->ref[hh * d + i] += s[hh * c->L + p] * (double)vh[i];
    }
}

/* q8_0: the same float32 K/V into mha's cache (quantised at append) and, quantised by
 * ggml_quantize_chunk, into ggml's K and V buffers; the reference over the ORIGINAL values. */
static int fill_q8_case(peer_case *c) {
    const int64_t L = c->L, gd = c->g * c->d, chunk = 1024;
    const size_t rowb = ggml_row_size(GGML_TYPE_Q8_0, gd);
    float *kv = xalloc(sizeof(float) * (size_t)(2 * chunk * gd));
    double *s = xalloc(sizeof(double) * (size_t)(c->h * L));
    mha_error err;
    memset(&err, 0, sizeof err);
    memset(c->ref, 0, sizeof(double) * (size_t)(c->h * c->d));
    for (int pass = 0; pass < 2; pass++) { /* scores, then (the same draws again) values */
        rng_state = 0x9E3779B97F4A7C15ull;
        for (int64_t p0 = 0; p0 < L; p0 += chunk) {
            const int64_t t = L - p0 < chunk ? L - p0 : chunk;
            draw_kv(kv, chunk, t, gd);
            if (pass == 0) {
                if (mha_kv_cache_append(c->cache, 1, NULL, t, kv, kv + chunk * gd, &err) !=
                    MHA_STATUS_OK) {
                    fprintf(stderr, "mha_kv_cache_append: %s\n", err.message);
                    free(kv);
                    free(s);
                    return 1;
                }
                ggml_quantize_chunk(GGML_TYPE_Q8_0, kv, (char *)c->k_buf + rowb * (size_t)p0, 0, t,
                                    gd, NULL);
                ggml_quantize_chunk(GGML_TYPE_Q8_0, kv + chunk * gd,
                                    (char *)c->v_buf + rowb * (size_t)p0, 0, t, gd, NULL);
                for (int64_t p = 0; p < t; p++)
                    ref_scores(c, kv + p * gd, p0 + p, s);
            } else {
                for (int64_t p = 0; p < t; p++)
                    ref_values(c, kv + (chunk + p) * gd, p0 + p, s);
            }
        }
        if (pass == 0)
            ref_softmax(c, s);
    }
    free(s);
    free(kv);
    return 0;
}

/* ggml tensors over the caller's buffers and the two graphs (llama.cpp's shapes, see top). */
static int build_ggml(peer_case *c) {
    const int64_t L = c->L, g = c->g, d = c->d, h = c->h;
    /* bytes of one kv head's row, and of one cell (all kv heads) */
    const size_t rh = ggml_row_size(c->gtype, d), rc = ggml_row_size(c->gtype, d * g);
    const size_t e = c->elt ? c->elt : sizeof(float); /* V^T (q8_0: an unused f32 stand-in) */
    struct ggml_init_params cp = {ggml_tensor_overhead() * 8, NULL, true};
    c->ctx_cache = ggml_init(cp); /* no_alloc: the cache tensors point at our buffers */
    struct ggml_init_params gp = {(size_t)GGML_CTX_MB << 20, NULL, false};
    c->ctx = ggml_init(gp);
    if (!c->ctx_cache || !c->ctx)
        return 1;
    struct ggml_tensor *k_cache = ggml_new_tensor_2d(c->ctx_cache, c->gtype, d * g, L);
    struct ggml_tensor *v_cache = ggml_new_tensor_2d(c->ctx_cache, c->gtype, d * g, L);
    struct ggml_tensor *vt_cache =
        ggml_new_tensor_2d(c->ctx_cache, c->elt ? c->gtype : GGML_TYPE_F32, L, d * g);
    k_cache->data = c->k_buf;
    v_cache->data = c->v_buf;
    vt_cache->data = c->vt_buf;

    struct ggml_context *x = c->ctx;
    /* q as llama.cpp has it after the projection: [d, h, n_tokens = 1], then [d, 1, h]. */
    struct ggml_tensor *q = ggml_new_tensor_3d(x, GGML_TYPE_F32, d, h, 1);
    memcpy(q->data, c->q, sizeof(float) * (size_t)(h * d));
    q = ggml_permute(x, q, 0, 2, 1, 3);
    /* K: the cells' rows seen as [d, g, n_kv], permuted to [d, n_kv, g]; same for V (flash). */
    struct ggml_tensor *k =
        ggml_permute(x, ggml_view_3d(x, k_cache, d, g, L, rh, rc, 0), 0, 2, 1, 3);
    struct ggml_tensor *v =
        ggml_permute(x, ggml_view_3d(x, v_cache, d, g, L, rh, rc, 0), 0, 2, 1, 3);
    /* V^T: [n_kv, g, d] with strides (kv_size * d, kv_size), permuted to [n_kv, d, g]. */
    struct ggml_tensor *vt = ggml_permute(
        x, ggml_view_3d(x, vt_cache, L, g, d, e * (size_t)(L * d), e * (size_t)L, 0), 0, 2, 1, 3);
    /* Masks: every key visible (zeros); f32 for soft_max_ext, f16 for flash attention. */
    struct ggml_tensor *mask32 = ggml_new_tensor_2d(x, GGML_TYPE_F32, L, 1);
    struct ggml_tensor *mask16 = ggml_new_tensor_2d(x, GGML_TYPE_F16, L, 1);
    memset(mask32->data, 0, ggml_nbytes(mask32));
    memset(mask16->data, 0, ggml_nbytes(mask16));
    const float scale = 1.0f / sqrtf((float)d);

    struct ggml_tensor *kq = ggml_mul_mat(x, k, q); /* [n_kv, 1, h] */
    ggml_mul_mat_set_prec(kq, GGML_PREC_F32);
    kq = ggml_soft_max_ext(x, kq, mask32, scale, 0.0f);
    struct ggml_tensor *kqv = ggml_mul_mat(x, vt, kq); /* [d, 1, h] */
    c->out_t[P_MM] = ggml_cont_2d(x, ggml_permute(x, kqv, 0, 2, 1, 3), d * h, 1);

    struct ggml_tensor *fa = ggml_flash_attn_ext(x, q, k, v, mask16, scale, 0.0f, 0.0f);
    ggml_flash_attn_ext_set_prec(fa, GGML_PREC_F32);
    c->out_t[P_FA] = ggml_reshape_2d(x, fa, d * h, 1); /* [d, h, 1] is already contiguous */

    for (int i = 0; i < 2; i++) {
        c->graph[i] = ggml_new_graph(x);
        ggml_build_forward_expand(c->graph[i], c->out_t[i]);
    }
    return 0;
}

static int create_case(
    peer_case *c, const float *q, int64_t h, int64_t g, int64_t d, int64_t L, mha_dtype dtype) {
    memset(c, 0, sizeof *c);
    c->h = h, c->g = g, c->d = d, c->L = L, c->dtype = dtype, c->q = q;
    c->gtype = dtype == MHA_DTYPE_F32    ? GGML_TYPE_F32
               : dtype == MHA_DTYPE_F16  ? GGML_TYPE_F16
               : dtype == MHA_DTYPE_BF16 ? GGML_TYPE_BF16
                                         : GGML_TYPE_Q8_0;
    c->elt = mha_dtype_size(dtype);
    const size_t cache_bytes = ggml_row_size(c->gtype, g * d) * (size_t)L;
    c->k_buf = xalloc(cache_bytes);
    c->v_buf = xalloc(cache_bytes);
    c->vt_buf = xalloc(c->elt ? cache_bytes : 64); /* q8_0: no mul_mat path */
    c->ref = xalloc(sizeof(double) * (size_t)(h * d));
    for (int p = 0; p < P_COUNT; p++)
        c->out[p] = xalloc(sizeof(float) * (size_t)(h * d));
    mha_kv_cache_config kc;
    memset(&kc, 0, sizeof kc);
    kc.num_kv_heads = g, kc.head_dim = d, kc.max_seq = L, kc.batch = 1, kc.dtype = dtype;
    mha_error err;
    memset(&err, 0, sizeof err);
    if (mha_kv_cache_create(&kc, NULL, NULL, &c->cache, &err) != MHA_STATUS_OK) {
        fprintf(stderr, "mha_kv_cache_create: %s\n", err.message);
        return 1;
    }
    return fill_case(c) || build_ggml(c);
}

static void destroy_case(peer_case *c) {
    mha_kv_cache_destroy(c->cache);
    if (c->ctx)
        ggml_free(c->ctx);
    if (c->ctx_cache)
        ggml_free(c->ctx_cache);
    free(c->k_buf);
    free(c->v_buf);
    free(c->vt_buf);
    free(c->ref);
    for (int p = 0; p < P_COUNT; p++)
        free(c->out[p]);
}

/* Per thread count: the persistent pools and ggml's plans (work buffer allocated once). */
typedef struct runner {
    int threads;
    mha_threadpool *mha_pool;
    struct ggml_threadpool *ggml_pool;
    struct ggml_cplan plan[2];
    void *work;
} runner;

static void plan_ggml(runner *r, peer_case *c) {
    size_t work = 0;
    for (int i = 0; i < 2; i++) {
        r->plan[i] = ggml_graph_plan(c->graph[i], r->threads, r->ggml_pool);
        work = r->plan[i].work_size > work ? r->plan[i].work_size : work;
    }
    free(r->work);
    r->work = xalloc(work + 64);
    for (int i = 0; i < 2; i++)
        r->plan[i].work_data = r->work;
}

/* One call of path `p`; returns its wall time in seconds (negative on failure). */
static double run_path(runner *r, peer_case *c, int p) {
    double t0, t1;
    if (p == P_MHA) {
        mha_kv_attention_args a;
        memset(&a, 0, sizeof a);
        a.num_seqs = 1, a.num_tokens = 1, a.num_heads = c->h, a.q = c->q, a.out = c->out[P_MHA];
        mha_exec ex;
        memset(&ex, 0, sizeof ex);
        ex.n_threads = r->threads, ex.pool = r->mha_pool;
        mha_error err;
        t0 = now_s();
        const mha_status st = mha_kv_cache_attention(c->cache, &a, &ex, &err);
        t1 = now_s();
        if (st != MHA_STATUS_OK) {
            fprintf(stderr, "mha_kv_cache_attention: %s\n", err.message);
            return -1.0;
        }
    } else {
        t0 = now_s();
        const enum ggml_status st = ggml_graph_compute(c->graph[p], &r->plan[p]);
        t1 = now_s();
        if (st != GGML_STATUS_SUCCESS)
            return -1.0;
        memcpy(c->out[p], c->out_t[p]->data, sizeof(float) * (size_t)(c->h * c->d));
    }
    return t1 - t0;
}

static const char *dtype_name(mha_dtype t) {
    return t == MHA_DTYPE_F32    ? "f32"
           : t == MHA_DTYPE_F16  ? "f16"
           : t == MHA_DTYPE_BF16 ? "bf16"
                                 : "q8_0";
}

static void usage(void) {
    printf("Usage: mha_peer_ggml_decode [options]\n"
           "One decode step (batch 1, one new token) over a KV cache: ggml's mul_mat graph,\n"
           "ggml's flash_attn_ext and mha_kv_cache_attention on the same data, round-robin.\n"
           "  --heads H         query heads (default 32)\n"
           "  --kv-heads G      kv heads (default 8)\n"
           "  --head-dim D      d_k = d_v (default 128)\n"
           "  --lengths L,...   cache lengths (default 4096,32768)\n"
           "  --dtypes T,...    f32, f16, bf16, q8_0 (default f32,f16,bf16)\n"
           "  --threads T,...   thread counts (default 1,2)\n"
           "  --reps N          timed calls of each path per row (default 7, at most %d)\n"
           "  --stream MB       read-bandwidth buffer, 0 = skip (default 1024)\n"
           "  --pause MS        sleep before each timed call (default 20)\n",
           MAX_REPS);
}

int main(int argc, char **argv) {
    int64_t h = 32, g = 8, d = 128, reps = 7, stream_mb = 1024, pause = 20;
    int64_t lengths[MAX_LIST] = {4096, 32768}, threads[MAX_LIST] = {1, 2};
    int n_len = 2, n_thr = 2, n_dt = 3;
    mha_dtype dtypes[MAX_LIST] = {MHA_DTYPE_F32, MHA_DTYPE_F16, MHA_DTYPE_BF16};
    for (int i = 1; i < argc; i += 2) { /* --option value pairs */
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int64_t *scalar = !strcmp(a, "--heads")      ? &h
                          : !strcmp(a, "--kv-heads") ? &g
                          : !strcmp(a, "--head-dim") ? &d
                          : !strcmp(a, "--reps")     ? &reps
                          : !strcmp(a, "--stream")   ? &stream_mb
                          : !strcmp(a, "--pause")    ? &pause
                                                     : NULL;
        if (!strcmp(a, "--help")) {
            usage();
            return 0;
        } else if (!v) {
            fprintf(stderr, "peer_ggml_decode: bad or incomplete option '%s' (--help)\n", a);
            return 2;
        } else if (scalar) {
            *scalar = strtoll(v, NULL, 10);
        } else if (!strcmp(a, "--lengths")) {
            n_len = parse_list(v, lengths);
        } else if (!strcmp(a, "--threads")) {
            n_thr = parse_list(v, threads);
        } else if (!strcmp(a, "--dtypes")) {
            char buf[64];
            snprintf(buf, sizeof buf, "%s", v);
            n_dt = 0;
            for (char *tok = strtok(buf, ","); tok && n_dt < MAX_LIST; tok = strtok(NULL, ",")) {
                if (strcmp(tok, "f32") && strcmp(tok, "f16") && strcmp(tok, "bf16") &&
                    strcmp(tok, "q8_0")) {
                    fprintf(stderr, "peer_ggml_decode: dtype '%s' is not f32, f16, bf16 or q8_0\n",
                            tok);
                    return 2;
                }
                dtypes[n_dt++] = !strcmp(tok, "f32")    ? MHA_DTYPE_F32
                                 : !strcmp(tok, "f16")  ? MHA_DTYPE_F16
                                 : !strcmp(tok, "bf16") ? MHA_DTYPE_BF16
                                                        : MHA_DTYPE_Q8_0;
            }
        } else {
            fprintf(stderr, "peer_ggml_decode: unknown option '%s' (--help)\n", a);
            return 2;
        }
    }
    if (h < 1 || g < 1 || h % g || d < 1 || reps < 1 || reps > MAX_REPS || !n_len || !n_thr ||
        !n_dt || stream_mb < 0 || pause < 0) {
        fprintf(stderr, "peer_ggml_decode: bad arguments (--help)\n");
        return 2;
    }
    for (int t = 0; t < n_thr; t++)
        if (threads[t] > MAX_THREADS) {
            fprintf(stderr, "peer_ggml_decode: at most %d threads\n", MAX_THREADS);
            return 2;
        }
    ggml_cpu_init();

    mha_kernel_desc kd;
    const char *kernel = mha_experimental_kernel_describe(mha_experimental_kernel_active("decode"),
                                                          &kd, NULL) == MHA_STATUS_OK
                             ? kd.name
                             : "?";
    printf("# decode step: h=%lld g=%lld d=%lld batch 1, 1 new token; mha %d.%d.%d (first decode "
           "kernel %s; q8_0 caches in %s); "
           "ggml %s (commit %s, AVX2 %d FMA %d F16C %d AVX512 %d, OpenMP threads); %lld reps\n",
           (long long)h, (long long)g, (long long)d, MHA_VERSION_MAJOR, MHA_VERSION_MINOR,
           MHA_VERSION_PATCH, kernel,
           mha_experimental_cpu_q8x16() ? "the key-interleaved order" : "ggml's rows",
           ggml_version(), ggml_commit(), ggml_cpu_has_avx2(), ggml_cpu_has_fma(),
           ggml_cpu_has_f16c(), ggml_cpu_has_avx512(), (long long)reps);
    fflush(stdout);

    /* Read bandwidth at each thread count, before the cases (and again after them). */
    stats bw_start[MAX_LIST];
    for (int t = 0; t < n_thr; t++) {
        bw_start[t] = stream_mb ? stream_gbs(stream_mb, (int)threads[t], 7) : (stats){0, 0, 0};
        printf("# read bandwidth, %lld MB buffer, %lld thread(s): median %.1f GB/s [%.1f, %.1f]\n",
               (long long)stream_mb, (long long)threads[t], bw_start[t].med, bw_start[t].min,
               bw_start[t].max);
    }

    runner run[MAX_LIST];
    memset(run, 0, sizeof run);
    for (int t = 0; t < n_thr; t++) {
        run[t].threads = (int)threads[t];
        struct ggml_threadpool_params tp = ggml_threadpool_params_default((int)threads[t]);
        run[t].ggml_pool = ggml_threadpool_new(&tp);
        if (mha_threadpool_create((int32_t)threads[t], NULL, &run[t].mha_pool, NULL) !=
                MHA_STATUS_OK ||
            !run[t].ggml_pool) {
            fprintf(stderr, "peer_ggml_decode: cannot create the thread pools\n");
            return 1;
        }
    }

    float *q = xalloc(sizeof(float) * (size_t)(h * d));
    rng_state = 0x2545F4914F6CDD1Dull;
    for (int64_t i = 0; i < h * d; i++)
        q[i] = rnd();

    printf("\n| dtype | L | thr | KV MB | ggml mul_mat ms | ggml flash ms | mha ms | mha GB/s | "
           "%%bw | ggml best GB/s | x ggml best | err mul_mat | err flash | err mha |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    fflush(stdout);
    int rc = 0;
    for (int li = 0; li < n_len && !rc; li++) {
        for (int di = 0; di < n_dt && !rc; di++) {
            peer_case c;
            if (create_case(&c, q, h, g, d, lengths[li], dtypes[di])) {
                destroy_case(&c);
                rc = 1;
                break;
            }
            const double kv_bytes = 2.0 * (double)ggml_row_size(c.gtype, g * d) * (double)c.L;
            const int q8 = c.dtype == MHA_DTYPE_Q8_0; /* no mul_mat path (see the top) */
            for (int t = 0; t < n_thr && !rc; t++) {
                runner *r = &run[t];
                plan_ggml(r, &c);
                double times[P_COUNT][MAX_REPS];
                for (int p = 0; p < P_COUNT; p++) /* warm-up: page faults, first-touch */
                    rc |= !(q8 && p == P_MM) && run_path(r, &c, p) < 0.0;
                for (int rep = 0; rep < reps && !rc; rep++)
                    for (int k = 0; k < P_COUNT && !rc; k++) {
                        const int p = (rep + k) % P_COUNT; /* rotate who goes first */
                        if (q8 && p == P_MM) {
                            times[p][rep] = HUGE_VAL;
                            continue;
                        }
                        pause_ms((int)pause);
                        times[p][rep] = run_path(r, &c, p);
                        rc |= times[p][rep] < 0.0;
                    }
                if (rc) {
                    fprintf(stderr, "peer_ggml_decode: a call failed\n");
                    break;
                }
                stats st[P_COUNT];
                for (int p = 0; p < P_COUNT; p++)
                    st[p] = summarize(times[p], (int)reps);
                const double best = st[P_MM].med < st[P_FA].med ? st[P_MM].med : st[P_FA].med;
                const double gbs = kv_bytes / st[P_MHA].med * 1e-9;
                printf("| %s | %lld | %d | %.0f |", dtype_name(c.dtype), (long long)c.L, r->threads,
                       kv_bytes * 1e-6);
                for (int p = 0; p < P_COUNT; p++)
                    printf(" %.2f [%.2f, %.2f] |", st[p].med * 1e3, st[p].min * 1e3,
                           st[p].max * 1e3);
                printf(" %.1f |", gbs);
                if (bw_start[t].med > 0.0)
                    printf(" %.0f |", 100.0 * gbs / bw_start[t].med);
                else
                    printf(" - |"); /* --stream 0: no bandwidth measured */
                printf(" %.1f | %.2f | %.1e | %.1e | %.1e |\n", kv_bytes / best * 1e-9,
                       best / st[P_MHA].med, rel_err(c.out[P_MM], c.ref, h * d),
                       rel_err(c.out[P_FA], c.ref, h * d), rel_err(c.out[P_MHA], c.ref, h * d));
                fflush(stdout);
            }
            destroy_case(&c);
        }
    }
    printf("\n");
    for (int t = 0; t < n_thr && stream_mb && !rc; t++) {
        const stats bw = stream_gbs(stream_mb, (int)threads[t], 7);
        printf("# read bandwidth after the cases, %lld thread(s): median %.1f GB/s [%.1f, %.1f]\n",
               (long long)threads[t], bw.med, bw.min, bw.max);
    }
    printf("# columns: ms = median [min, max] of the timed calls; GB/s = K+V bytes of the cache "
           "/ median; %%bw = mha GB/s / read bandwidth (start); x ggml best = the faster ggml "
           "path's median / mha's median; err = max |out - ref| / max |ref| (float64 "
           "reference)\n");
    for (int t = 0; t < n_thr; t++) {
        mha_threadpool_destroy(run[t].mha_pool);
        ggml_threadpool_free(run[t].ggml_pool);
        free(run[t].work);
    }
    free(q);
    return rc;
}
