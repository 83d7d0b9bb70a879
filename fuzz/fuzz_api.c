/* SPDX-License-Identifier: MIT */
/* fuzz_api.c: libFuzzer harness for the C API's argument validation and the code behind it.
 *
 * The input drives a random mha_config + weights fed to mha_layer_create() and a random
 * mha_forward_args fed to mha_layer_forward() (mode 0), or a random mha_attention_args fed to
 * mha_attention() (mode 1). Sizes are small (features <= 32, heads <= 4, lengths <= 8, with an
 * occasional d_k = 256 or m = 300) so a run takes microseconds,
 * but any field may instead get a hostile value (negative, 0, > 2^31, INT64_MAX), an enum may be
 * out of range, and floats may be NaN/Inf. Buffers always match the sizes passed (the API trusts
 * pointers and sizes to describe valid memory), except that when a size is hostile the buffer is a
 * small one that the library must not read past before rejecting the call.
 *
 * Invariants: no crash, leak, out-of-bounds access or UB (ASan/UBSan); errors fill mha_error
 * consistently and leave every output untouched; allocations made through the allocators are all
 * given back, also when the k-th allocation fails; on success with finite inputs, the output is
 * finite and the probabilities are in [0, 1] with row sums <= 1.
 */
#include "fuzz_common.h"

#include <math.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CAP_FEAT 32 /* q_dim, k_dim, v_dim, out_dim */
#define CAP_HEAD 16 /* head_dim, v_head_dim */
#define CAP_H    4  /* heads */
#define CAP_B    3
#define CAP_L    8
#define POISON   (-12345.5f)

/* A dimension: mostly in [0, cap], sometimes a hostile value. */
static int64_t pick_dim(fuzz_reader *r, int64_t cap) {
    static const int64_t hostile[] = {
        -1, INT64_MIN, INT64_MAX, ((int64_t)1 << 31) + 1, (int64_t)1 << 40, -((int64_t)1 << 31)};
    const uint8_t sel = fuzz_u8(r);
    if (sel < 244)
        return sel % (cap + 1);
    return hostile[sel % (sizeof hostile / sizeof hostile[0])];
}

static int small_ok(int64_t v, int64_t cap) {
    return v >= 0 && v <= cap;
}

static double pick_f64(fuzz_reader *r, const double *choices, int n) {
    return choices[fuzz_below(r, n)];
}

/* Deterministic values from a seed (xorshift), roughly uniform in [-mag, mag]. */
static void fill(float *x, int64_t n, uint64_t seed, float mag) {
    uint64_t s = seed | 1;
    for (int64_t i = 0; i < n; i++) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        x[i] = mag * ((float)(s >> 40) * 0x1.0p-23f - 1.0f);
    }
}

static float *fbuf(int64_t n) {
    float *p = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
    FUZZ_REQUIRE(p != NULL, "malloc");
    return p;
}

static void poison(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        x[i] = POISON;
}

static int all_poison(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (x[i] != POISON)
            return 0;
    return 1;
}

/* ---- An allocator that counts, and fails its k-th call (k < 0: never). ---------------------- */
typedef struct fail_alloc {
    int64_t calls, live, fail_at;
} fail_alloc;

static void *fa_alloc(void *user, size_t bytes, size_t align) {
    fail_alloc *f = user;
    if (f->calls++ == f->fail_at)
        return NULL;
    void *p = aligned_alloc(align, (bytes + align - 1) / align * align + align);
    if (p)
        f->live++;
    return p;
}

static void fa_free(void *user, void *ptr) {
    fail_alloc *f = user;
    if (ptr)
        f->live--;
    free(ptr);
}

/* ---- Masks ------------------------------------------------------------------------------------
 */
typedef struct owned {
    void *p[16];
    int n;
} owned;

static void *keep(owned *o, void *p) {
    FUZZ_REQUIRE(p != NULL && o->n < 16, "keep");
    o->p[o->n++] = p;
    return p;
}

static void release(owned *o) {
    for (int i = 0; i < o->n; i++)
        free(o->p[i]);
    o->n = 0;
}

/* A mask tensor with a random dtype, rank and shape (dims drawn from the real sizes, 1, 0 or
 * junk), filled with random values; `finite` is cleared when a float mask holds NaN or +Inf. */
static void pick_mask(fuzz_reader *r,
                      owned *o,
                      mha_mask_tensor *t,
                      int is_float,
                      int max_ndim,
                      const int64_t *dims,
                      int n_dims,
                      int *finite) {
    memset(t, 0, sizeof *t);
    if (fuzz_u8(r) % 3 != 0)
        return;
    static const mha_dtype float_types[] = {MHA_DTYPE_F32, MHA_DTYPE_F32, MHA_DTYPE_F32,
                                            MHA_DTYPE_F64, (mha_dtype)42};
    static const mha_dtype int_types[] = {MHA_DTYPE_BOOL, MHA_DTYPE_U8,  MHA_DTYPE_I32,
                                          MHA_DTYPE_I64,  MHA_DTYPE_F32, (mha_dtype)-1};
    t->dtype = is_float ? float_types[fuzz_below(r, 5)] : int_types[fuzz_below(r, 6)];
    const uint8_t nsel = fuzz_u8(r);
    t->ndim = nsel < 250 ? (int32_t)(nsel % (max_ndim + 1)) : (nsel & 1 ? -1 : 5);
    int64_t count = 1;
    int sane = t->ndim >= 0 && t->ndim <= MHA_MAX_MASK_DIMS;
    for (int i = 0; sane && i < t->ndim; i++) {
        const uint8_t s = fuzz_u8(r);
        if (s < 200)
            t->shape[i] = dims[s % n_dims];
        else if (s < 240)
            t->shape[i] = 1;
        else if (s < 250)
            t->shape[i] = s % 5;
        else
            t->shape[i] = s & 1 ? -3 : INT64_MAX;
        if (t->shape[i] < 0 || t->shape[i] > 512)
            sane = 0;
        else
            count *= t->shape[i];
    }
    /* A shape that broadcasts to [B, h, n, m] has at most 3 * 4 * 8 * 300 elements; a larger one
     * must be refused, so it gets a 1-element buffer (reading it would be the library's bug). */
    if (count > ((int64_t)1 << 20))
        sane = 0;
    size_t es = mha_dtype_size(t->dtype);
    if (es == 0)
        es = 8;
    const int64_t n = sane ? count : 1;
    unsigned char *buf = keep(o, calloc((size_t)(n > 0 ? n : 1), es));
    t->data = buf;
    const uint64_t seed = fuzz_u64(r);
    if (t->dtype == MHA_DTYPE_F32) {
        float *f = (float *)buf;
        fill(f, n, seed, 4.0f);
        const uint8_t special = fuzz_u8(r);
        for (int64_t i = 0; i < n; i++) {
            if ((i + special) % 3 == 0 && special & 1)
                f[i] = -INFINITY;
            else if ((i + special) % 5 == 0 && special & 2)
                f[i] = -1e30f;
        }
        if (n > 0 && special >= 250) {
            f[special % n] = special & 1 ? NAN : INFINITY;
            *finite = 0;
        }
    } else {
        for (size_t i = 0; i < (size_t)n * es; i++)
            buf[i] = (unsigned char)((seed >> (i % 61)) & 1);
    }
}

static void pick_masking(fuzz_reader *r,
                         owned *o,
                         mha_masking *mk,
                         int64_t B,
                         int64_t H,
                         int64_t n,
                         int64_t m,
                         int *finite) {
    memset(mk, 0, sizeof *mk);
    const uint8_t flags = fuzz_u8(r);
    mk->causal = flags & 1;
    static const mha_alignment aligns[] = {MHA_ALIGN_BOTTOM_RIGHT, MHA_ALIGN_TOP_LEFT,
                                           MHA_ALIGN_EXPLICIT, (mha_alignment)9};
    mk->alignment = aligns[(flags >> 1) & 3];
    const int sane_b = small_ok(B, CAP_B), sane_n = small_ok(n, CAP_L), sane_m = small_ok(m, 512);
    if (flags & 8) {
        int64_t *off = keep(o, calloc((size_t)(sane_b && B > 0 ? B : 1), sizeof *off));
        for (int64_t b = 0; sane_b && b < B; b++) {
            const uint8_t s = fuzz_u8(r);
            off[b] = s < 250 ? (int64_t)(s % 17) - 8 : (s & 1 ? INT64_MAX : INT64_MIN);
        }
        mk->align_offsets = off;
    }
    mk->use_window = (flags >> 4) & 1;
    /* INT64_MAX is tested by tests/test_hostile.c (it overflowed i + delta + window). */
    static const int64_t win[] = {-1, 0, 1, 2, 3, 7, -2, (int64_t)1 << 40};
    mk->window_left = win[fuzz_below(r, 8)];
    mk->window_right = win[fuzz_below(r, 8)];
    const int64_t dims[] = {B, H, n, m, 1};
    pick_mask(r, o, &mk->bool_mask, 0, 4, dims, 5, finite);
    static const mha_mask_polarity pol[] = {MHA_MASK_ATTEND, MHA_MASK_BLOCK, (mha_mask_polarity)3};
    mk->bool_mask_polarity = pol[fuzz_below(r, 3)];
    pick_mask(r, o, &mk->additive_mask, 1, 4, dims, 5, finite);
    const int64_t kdims[] = {B, m, 1};
    pick_mask(r, o, &mk->key_padding, 0, 2, kdims, 3, finite);
    const uint8_t seg = fuzz_u8(r);
    if (seg % 4 != 0) {
        const int64_t qn = sane_b && sane_n ? B * n : 1, kn = sane_b && sane_m ? B * m : 1;
        int32_t *qs = keep(o, calloc((size_t)(qn > 0 ? qn : 1), sizeof *qs));
        int32_t *ks = keep(o, calloc((size_t)(kn > 0 ? kn : 1), sizeof *ks));
        for (int64_t i = 0; i < qn; i++)
            qs[i] = (int32_t)((seg >> (i % 5)) & 1);
        for (int64_t i = 0; i < kn; i++)
            ks[i] = (int32_t)((seg >> ((i + 2) % 5)) & 1);
        mk->q_segment_ids = seg % 4 != 3 ? qs : NULL;
        mk->kv_segment_ids = seg % 4 != 2 ? ks : NULL;
    }
}

static void pick_dropout(fuzz_reader *r, mha_dropout *d) {
    static const double ps[] = {0.0, 0.0, 0.1, 0.5, 0.99, 1.0, -0.1, (double)NAN};
    d->p = (float)ps[fuzz_below(r, 8)];
    d->training = fuzz_u8(r) & 1;
    d->seed = fuzz_u64(r);
}

static void pick_exec(fuzz_reader *r, mha_exec *ex, fail_alloc *fa, mha_allocator *al) {
    memset(ex, 0, sizeof *ex);
    static const mha_impl impls[] = {MHA_IMPL_AUTO, MHA_IMPL_REFERENCE, MHA_IMPL_FAST, (mha_impl)7};
    ex->impl = impls[fuzz_below(r, 4)];
    static const int32_t threads[] = {1, 1, 2, 0, 3, -3};
    ex->n_threads = threads[fuzz_below(r, 6)];
    const uint8_t a = fuzz_u8(r);
    fa->calls = fa->live = 0;
    fa->fail_at = a < 128 ? -1 : a % 4;
    al->user = fa;
    al->alloc = fa_alloc;
    al->free = fa_free;
    ex->allocator = a & 1 ? al : NULL;
}

/* Checks probabilities: each in [0, 1], each row summing to at most 1 (rows of length m). */
static void check_probs(const float *p, int64_t rows, int64_t m) {
    for (int64_t i = 0; i < rows; i++) {
        double s = 0.0;
        for (int64_t j = 0; j < m; j++) {
            const float v = p[i * m + j];
            FUZZ_REQUIRE(v >= 0.0f && v <= 1.0f + 1e-6f, "prob %g at row %lld", (double)v,
                         (long long)i);
            s += (double)v;
        }
        FUZZ_REQUIRE(s <= 1.0 + 1e-4, "row %lld sums to %g", (long long)i, s);
    }
}

/* ---- Mode 0: the layer ------------------------------------------------------------------------
 */
static void fuzz_layer(fuzz_reader *r) {
    static const double scales[] = {
        0.0, 0.0, 0.1, 1.0, 10.0, 1e30, -1.0, (double)NAN, (double)INFINITY};
    static const double softcaps[] = {0.0, 0.0, 5.0, 30.0, -1.0, (double)NAN, (double)INFINITY};
    mha_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.q_dim = pick_dim(r, CAP_FEAT);
    cfg.k_dim = pick_dim(r, CAP_FEAT);
    cfg.v_dim = pick_dim(r, CAP_FEAT);
    cfg.num_heads = pick_dim(r, CAP_H);
    cfg.num_kv_heads = pick_dim(r, CAP_H);
    cfg.head_dim = pick_dim(r, CAP_HEAD);
    cfg.v_head_dim = pick_dim(r, CAP_HEAD);
    cfg.out_dim = pick_dim(r, CAP_FEAT);
    const uint8_t bits = fuzz_u8(r);
    cfg.bias_q = bits & 1;
    cfg.bias_k = (bits >> 1) & 1;
    cfg.bias_v = (bits >> 2) & 1;
    cfg.bias_o = (bits >> 3) & 1;
    cfg.sinks = (bits >> 4) & 1;
    cfg.alibi = (bits >> 5) & 1;
    cfg.scale = pick_f64(r, scales, 9);
    cfg.softcap = pick_f64(r, softcaps, 7);
    const uint8_t rope = fuzz_u8(r);
    if (rope & 1) {
        static const mha_rope_style styles[] = {MHA_ROPE_INTERLEAVED, MHA_ROPE_HALF,
                                                (mha_rope_style)7};
        static const double thetas[] = {0.0, 10000.0, 1e6, -1.0, (double)NAN, 1.0};
        static const int64_t rdims[] = {0, 2, 4, 3, 1000, -2};
        static const double factors[] = {0.0, 2.0, 8.0, -1.0, (double)NAN, 1e-30};
        cfg.rope.style = styles[fuzz_below(r, 3)];
        cfg.rope.theta = pick_f64(r, thetas, 6);
        cfg.rope.rotary_dim = rdims[fuzz_below(r, 6)];
        cfg.rope.scaling = (mha_rope_scaling_type)fuzz_below(r, 6);
        cfg.rope.factor = pick_f64(r, factors, 6);
        cfg.rope.original_max_position = pick_f64(r, factors, 6);
        cfg.rope.low_freq_factor = pick_f64(r, factors, 6);
        cfg.rope.high_freq_factor = pick_f64(r, factors, 6);
        cfg.rope.beta_fast = pick_f64(r, factors, 6);
        cfg.rope.beta_slow = pick_f64(r, factors, 6);
        cfg.rope.attention_factor = pick_f64(r, factors, 6);
    }

    /* The sizes as the library should resolve them (defaults filled in). */
    const int64_t q = cfg.q_dim, h = cfg.num_heads;
    const int64_t k = cfg.k_dim ? cfg.k_dim : q, v = cfg.v_dim ? cfg.v_dim : k;
    const int64_t g = cfg.num_kv_heads ? cfg.num_kv_heads : h;
    const int64_t dk = cfg.head_dim ? cfg.head_dim : (h > 0 && q > 0 && q % h == 0 ? q / h : -1);
    const int64_t dv = cfg.v_head_dim ? cfg.v_head_dim : dk, od = cfg.out_dim ? cfg.out_dim : q;
    const int sane = small_ok(q, CAP_FEAT) && small_ok(k, CAP_FEAT) && small_ok(v, CAP_FEAT) &&
                     small_ok(h, CAP_H) && small_ok(g, CAP_H) && small_ok(dk, CAP_FEAT) &&
                     small_ok(dv, CAP_FEAT) && small_ok(od, CAP_FEAT);
    const int64_t big = 4096; /* more than any weight of in-range sizes */
    const int64_t nw[9] = {
        sane ? h * dk * q : big,  sane ? g * dk * k : big, sane ? g * dv * v : big,
        sane ? od * h * dv : big, sane ? h * dk : big,     sane ? g * dk : big,
        sane ? g * dv : big,      sane ? od : big,         sane ? h : big};
    float *wb[9];
    const uint64_t wseed = fuzz_u64(r);
    for (int i = 0; i < 9; i++) {
        wb[i] = fbuf(nw[i]);
        fill(wb[i], nw[i], wseed + (uint64_t)i, 0.4f);
    }
    const uint8_t wbad = fuzz_u8(r);
    int weights_finite = 1;
    if (wbad >= 248 && nw[wbad % 4] > 0) {
        wb[wbad % 4][(wbad * 7) % nw[wbad % 4]] = wbad & 1 ? NAN : -INFINITY;
        weights_finite = 0;
    }
    const uint8_t present = fuzz_u8(r);
    mha_weights w = {wb[0],
                     wb[1],
                     wb[2],
                     wb[3],
                     cfg.bias_q ? wb[4] : NULL,
                     cfg.bias_k ? wb[5] : NULL,
                     cfg.bias_v ? wb[6] : NULL,
                     cfg.bias_o ? wb[7] : NULL,
                     cfg.sinks ? wb[8] : NULL,
                     NULL,
                     NULL};
    if (present >= 250) /* a missing or an unexpected tensor */
        switch (present % 3) {
        case 0:
            w.w_v = NULL;
            break;
        case 1:
            w.b_o = w.b_o ? NULL : wb[7];
            break;
        default:
            w.sinks = w.sinks ? NULL : wb[8];
            break;
        }
    static const mha_ownership owns[] = {MHA_WEIGHTS_COPY, MHA_WEIGHTS_BORROW, (mha_ownership)5};
    const mha_ownership own = owns[fuzz_below(r, 3)];
    fail_alloc cfa = {0, 0, -1};
    const uint8_t ca = fuzz_u8(r);
    cfa.fail_at = ca < 200 ? -1 : ca % 3;
    mha_allocator calloc_ = {&cfa, fa_alloc, fa_free};
    mha_layer *L = NULL;
    mha_error err;
    memset(&err, 0, sizeof err);
    mha_status st = mha_layer_create(&cfg, &w, own, ca & 1 ? &calloc_ : NULL, &L, &err);
    if (st != MHA_STATUS_OK) {
        fuzz_check_error(st, &err);
        FUZZ_REQUIRE(L == NULL, "layer set on error");
        FUZZ_REQUIRE(cfa.live == 0, "create leaked %lld", (long long)cfa.live);
        goto done;
    }
    FUZZ_REQUIRE(weights_finite, "a non-finite weight was accepted");
    FUZZ_REQUIRE(sane, "hostile sizes accepted: q %lld k %lld v %lld h %lld g %lld dk %lld",
                 (long long)q, (long long)k, (long long)v, (long long)h, (long long)g,
                 (long long)dk);
    {
        const mha_config *c = mha_layer_config(L);
        FUZZ_REQUIRE(c->q_dim == q && c->k_dim == k && c->v_dim == v && c->num_heads == h &&
                         c->num_kv_heads == g && c->head_dim == dk && c->v_head_dim == dv &&
                         c->out_dim == od,
                     "resolved config differs from the documented defaults");
        /* The forward call. */
        mha_forward_args a;
        memset(&a, 0, sizeof a);
        a.batch = pick_dim(r, CAP_B);
        a.q_len = pick_dim(r, CAP_L);
        a.kv_len = pick_dim(r, CAP_L);
        const uint8_t f = fuzz_u8(r);
        const int cross = f & 1;
        const int sb = small_ok(a.batch, CAP_B), sn = small_ok(a.q_len, CAP_L),
                  sm = small_ok(a.kv_len, CAP_L);
        const int64_t B = a.batch, n = a.q_len, m = cross ? a.kv_len : a.q_len;
        owned o = {{0}, 0};
        const int64_t nx = sb && sn ? B * n * q : 1, nk = sb && sm ? B * a.kv_len * k : 1,
                      nv = sb && sm ? B * a.kv_len * v : 1;
        const int64_t ny = sb && sn ? B * n * od : 1;
        float *x = keep(&o, fbuf(nx)), *xk = keep(&o, fbuf(nk)), *xv = keep(&o, fbuf(nv));
        static const float mags[] = {1.0f, 10.0f, 100.0f, 1e-3f};
        const float mag = mags[fuzz_below(r, 4)];
        fill(x, nx, fuzz_u64(r), mag);
        fill(xk, nk, fuzz_u64(r), mag);
        fill(xv, nv, fuzz_u64(r), mag);
        int finite = 1;
        const uint8_t xbad = fuzz_u8(r);
        if (xbad >= 250 && nx > 0) {
            x[xbad % nx] = xbad & 1 ? NAN : INFINITY;
            finite = 0;
        }
        a.query = (f & 2) && fuzz_u8(r) >= 250 ? NULL : x;
        if (cross) {
            a.key = xk;
            a.value = (f & 4) ? NULL : xv;
        } else if ((f & 4) && fuzz_u8(r) >= 240) {
            a.value = xv; /* value without key: invalid */
        }
        int64_t *qp = NULL, *kp = NULL;
        if (f & 8) {
            const int64_t np = sb && sn ? B * n : 1;
            qp = keep(&o, calloc((size_t)(np > 0 ? np : 1), sizeof *qp));
            const uint8_t s = fuzz_u8(r);
            for (int64_t i = 0; i < np; i++)
                qp[i] = i + s % 50;
            if (s >= 250 && np > 0)
                qp[s % np] = s & 1 ? -1 : MHA_MAX_POSITION + 1;
            a.q_positions = qp;
        }
        if (f & 16) {
            const int64_t np = sb && small_ok(m, CAP_L) ? B * m : 1;
            kp = keep(&o, calloc((size_t)(np > 0 ? np : 1), sizeof *kp));
            for (int64_t i = 0; i < np; i++)
                kp[i] = i;
            a.k_positions = kp;
        }
        pick_masking(r, &o, &a.mask, B, h, n, m, &finite);
        pick_dropout(r, &a.dropout);
        a.average_probs = (f >> 5) & 1;
        const int64_t np =
            sb && sn && small_ok(m, CAP_L) ? B * (a.average_probs ? 1 : h) * n * m : 1;
        float *y = keep(&o, fbuf(ny)), *pr = keep(&o, fbuf(np));
        poison(y, ny);
        poison(pr, np);
        a.out = (f & 64) && fuzz_u8(r) > 250 ? NULL : y;
        a.probs = (f & 128) ? pr : NULL;
        mha_exec ex;
        fail_alloc fa;
        mha_allocator al;
        pick_exec(r, &ex, &fa, &al);
        const uint8_t wsel = fuzz_u8(r);
        size_t need = 0;
        mha_error werr;
        if (wsel & 1 &&
            mha_layer_forward_workspace_size(L, &a, &ex, &need, &werr) == MHA_STATUS_OK) {
            const size_t give = wsel & 2 ? need : (need > 0 ? need - 1 : 0);
            ex.workspace = keep(&o, malloc(give + 64));
            ex.workspace_bytes = give;
        }
        const int use_ex = fuzz_u8(r) != 255;
        st = mha_layer_forward(L, &a, use_ex ? &ex : NULL, &err);
        FUZZ_REQUIRE(fa.live == 0, "forward leaked %lld allocations", (long long)fa.live);
        if (st != MHA_STATUS_OK) {
            fuzz_check_error(st, &err);
            FUZZ_REQUIRE(all_poison(y, ny), "out written on error (%s)", err.message);
            FUZZ_REQUIRE(all_poison(pr, np), "probs written on error (%s)", err.message);
        } else {
            FUZZ_REQUIRE(sb && sn && (!cross || sm), "hostile forward sizes accepted");
            /* With -inf/-1e30 masks allowed, the output is finite whenever the inputs are. */
            if (finite)
                for (int64_t i = 0; i < ny; i++)
                    FUZZ_REQUIRE(isfinite(y[i]), "output[%lld] = %g from finite inputs",
                                 (long long)i, (double)y[i]);
            if (finite && a.probs)
                check_probs(pr, np / (m > 0 ? m : 1), m);
        }
        release(&o);
    }
    mha_layer_destroy(L);
    FUZZ_REQUIRE(cfa.live == 0, "layer allocations leaked: %lld", (long long)cfa.live);
done:
    for (int i = 0; i < 9; i++)
        free(wb[i]);
}

/* ---- Mode 1: the attention core -----------------------------------------------------------------
 */
static void fuzz_core(fuzz_reader *r) {
    mha_attention_args a;
    memset(&a, 0, sizeof a);
    a.batch = pick_dim(r, CAP_B);
    a.num_heads = pick_dim(r, CAP_H);
    a.num_kv_heads = pick_dim(r, CAP_H);
    a.q_len = pick_dim(r, CAP_L);
    a.kv_len = fuzz_u8(r) >= 240 ? 300 : pick_dim(r, CAP_L);
    a.head_dim = fuzz_u8(r) >= 245 ? 256 : pick_dim(r, 20);
    a.v_head_dim = pick_dim(r, 20);
    static const double scales[] = {0.0, 0.0, 0.5, 3.0, 1e30, -2.0, (double)NAN, -(double)INFINITY};
    static const double softcaps[] = {0.0, 0.0, 5.0, -1.0, (double)NAN};
    a.scale = pick_f64(r, scales, 8);
    a.softcap = pick_f64(r, softcaps, 5);
    const uint8_t f = fuzz_u8(r);
    a.alibi = f & 1;
    const int64_t B = a.batch, H = a.num_heads, G = a.num_kv_heads ? a.num_kv_heads : H;
    const int64_t n = a.q_len, m = a.kv_len, dk = a.head_dim, dv = a.v_head_dim ? a.v_head_dim : dk;
    const int sane = small_ok(B, CAP_B) && small_ok(H, CAP_H) && small_ok(G, CAP_H) &&
                     small_ok(n, CAP_L) && small_ok(m, 300) && small_ok(dk, 256) &&
                     small_ok(dv, 256);
    owned o = {{0}, 0};
    /* Layout: BHLD (contiguous) or BLHD (heads interleaved), padded rows when f & 4. */
    const int blhd = (f >> 1) & 1;
    const int64_t pad = (f & 4) ? 3 : 0;
    int64_t nq = 1, nk = 1, nv = 1, no = 1;
    if (sane) {
        const int64_t rq = dk + pad, rk = dk + pad, rv = dv + pad, ro = dv + pad;
        nq = B * H * n * rq;
        nk = B * G * m * rk;
        nv = B * G * m * rv;
        no = B * H * n * ro;
        if (blhd) {
            const int64_t qs[3] = {n * H * rq, rq, H * rq}, ks[3] = {m * G * rk, rk, G * rk},
                          vs[3] = {m * G * rv, rv, G * rv}, os[3] = {n * H * ro, ro, H * ro};
            memcpy(a.q_strides, qs, sizeof qs);
            memcpy(a.k_strides, ks, sizeof ks);
            memcpy(a.v_strides, vs, sizeof vs);
            memcpy(a.out_strides, os, sizeof os);
        } else {
            const int64_t qs[3] = {H * n * rq, n * rq, rq}, ks[3] = {G * m * rk, m * rk, rk},
                          vs[3] = {G * m * rv, m * rv, rv}, os[3] = {H * n * ro, n * ro, ro};
            memcpy(a.q_strides, qs, sizeof qs);
            memcpy(a.k_strides, ks, sizeof ks);
            memcpy(a.v_strides, vs, sizeof vs);
            memcpy(a.out_strides, os, sizeof os);
        }
    }
    if (fuzz_u8(r) >= 250) /* a hostile stride */
        a.k_strides[fuzz_below(r, 3)] = fuzz_u8(r) & 1 ? -1 : -((int64_t)1 << 40);
    float *qb = keep(&o, fbuf(nq)), *kb = keep(&o, fbuf(nk)), *vb = keep(&o, fbuf(nv));
    float *ob = keep(&o, fbuf(no));
    static const float mags[] = {1.0f, 10.0f, 100.0f, 1e-3f, 1e-38f};
    const float mag = mags[fuzz_below(r, 5)];
    fill(qb, nq, fuzz_u64(r), mag);
    fill(kb, nk, fuzz_u64(r), mag);
    fill(vb, nv, fuzz_u64(r), 1.0f);
    int finite = isfinite(a.scale) || a.scale == 0.0;
    const uint8_t bad = fuzz_u8(r);
    if (bad >= 248 && (bad % 3 == 0 ? nq : bad % 3 == 1 ? nk : nv) > 0) {
        float *t = bad % 3 == 0 ? qb : bad % 3 == 1 ? kb : vb;
        const int64_t tn = bad % 3 == 0 ? nq : bad % 3 == 1 ? nk : nv;
        t[(bad * 13) % tn] = bad & 1 ? NAN : -INFINITY;
        finite = 0;
    }
    poison(ob, no);
    a.q = qb;
    a.k = kb;
    a.v = vb;
    a.out = (f & 8) && fuzz_u8(r) >= 250 ? NULL : ob;
    const int64_t nl = sane ? B * H * n : 1;
    float *lse = keep(&o, fbuf(nl));
    poison(lse, nl);
    a.lse = (f & 16) ? lse : NULL;
    a.average_probs = (f >> 5) & 1;
    const int64_t np = sane ? B * (a.average_probs ? 1 : H) * n * m : 1;
    float *pr = keep(&o, fbuf(np));
    poison(pr, np);
    a.probs = (f & 64) ? pr : NULL;
    const int64_t ns = sane ? H : 1;
    float *sinks = keep(&o, fbuf(ns));
    fill(sinks, ns, 77, 2.0f);
    a.sinks = (f & 128) ? sinks : NULL;
    pick_masking(r, &o, &a.mask, B, H, n, m, &finite);
    pick_dropout(r, &a.dropout);
    mha_exec ex;
    fail_alloc fa;
    mha_allocator al;
    pick_exec(r, &ex, &fa, &al);
    mha_error err;
    memset(&err, 0, sizeof err);
    mha_status st = mha_attention(&a, &ex, &err);
    FUZZ_REQUIRE(fa.live == 0, "attention leaked %lld allocations", (long long)fa.live);
    if (st != MHA_STATUS_OK) {
        fuzz_check_error(st, &err);
        FUZZ_REQUIRE(all_poison(ob, no) && all_poison(lse, nl) && all_poison(pr, np),
                     "outputs written on error (%s)", err.message);
    } else {
        FUZZ_REQUIRE(sane, "hostile sizes accepted");
        if (finite && sane) {
            /* Every element of every output row (padding excluded) is finite. */
            for (int64_t b = 0; b < B; b++)
                for (int64_t hh = 0; hh < H; hh++)
                    for (int64_t i = 0; i < n; i++)
                        for (int64_t d = 0; d < dv; d++) {
                            const float y = ob[b * a.out_strides[0] + hh * a.out_strides[1] +
                                               i * a.out_strides[2] + d];
                            FUZZ_REQUIRE(isfinite(y), "out[%lld,%lld,%lld,%lld] = %g", (long long)b,
                                         (long long)hh, (long long)i, (long long)d, (double)y);
                        }
            if (a.probs)
                check_probs(pr, np / (m > 0 ? m : 1), m);
        }
    }
    release(&o);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_reader r = {data, size, 0};
    if (fuzz_u8(&r) & 1)
        fuzz_core(&r);
    else
        fuzz_layer(&r);
    return 0;
}
