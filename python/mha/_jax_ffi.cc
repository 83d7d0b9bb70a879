/* SPDX-License-Identifier: MIT */
/* mha/_jax_ffi.cc: the XLA FFI handlers behind mha.jax (docs/PYTHON.md, "JAX").
 *
 * Two handlers, registered by mha/jax.py with jax.ffi.register_ffi_target (platform "cpu"):
 *   MhaJaxForward:  (q, k, v, bias, mask, kv_pad, sinks) -> (out, lse, probs)
 *   MhaJaxBackward: (q, k, v, bias, mask, kv_pad, sinks, out, lse, dout) -> (dq, dk, dv, dsinks)
 * They run inside the compiled XLA program (no Python, no host callback) and call the public
 * mha.h API, mha_attention and mha_attention_backward, on XLA's own buffers: JAX's layout
 * [B, T, N, H] is mha's [B, heads, L, d] view with strides {T*N*H, H, N*H}, so nothing is copied.
 *
 * Operands (the order mha/jax.py passes them; an absent optional operand is a zero-size array):
 *   q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv], out/dout [B, T, N, Hv]: float32, bfloat16
 *     or float16, each in its own (dq, dk, dv: any of them too); mha reads and writes them as
 *     they are stored (float32 arithmetic, each output rounded once: docs/SEMANTICS.md)
 *   bias: float32, 4 dims broadcasting to [B, N, T, S] (added to the scores)
 *   mask: bool, 4 dims broadcasting to [B, N, T, S] (true = may attend)
 *   kv_pad: bool [B, S] (true = real key)      sinks: float32 [N] (per-head sink logits)
 *   lse: float32 [B, N, T]                      probs: float32 [B, N, T, S] (or absent)
 * Attributes: scale, softcap (f64; 0 = default / off), causal (bool, top-left aligned as in
 * jax.nn.dot_product_attention), window_left / window_right (i64, -1 = unbounded), impl (i64,
 * mha_impl), threads (i64, mha_exec.n_threads).
 *
 * vmap: mha/jax.py calls ffi_call with vmap_method="expand_dims", so under jax.vmap every operand
 * gains the same number of leading dimensions, of the vmapped size or 1 (not vmapped). When every
 * present operand is vmapped the same way (or, for a mask, a bias, the key padding and the sinks,
 * is shared and broadcasts over the batch anyway), the leading dimensions fold into the batch:
 * one library call. Otherwise (a shared [B, ...] mask, per-call sinks, ...) the handler loops over
 * the leading index, broadcasting the size-1 ones (foldable() has the rule). */
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <unistd.h>

#include "mha.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

/* The operands of both handlers and their results, by role. */
enum Operand {
    Q,
    K,
    V,
    BIAS,
    MASK,
    KV_PAD,
    SINKS,
    OUT,
    LSE,
    PROBS,
    DOUT,
    DQ,
    DK,
    DV,
    DSINKS,
    NOPS
};
/* Core (non-vmapped) rank and name of each, in the order of the enum. */
constexpr int kCoreRank[NOPS] = {4, 4, 4, 4, 4, 2, 1, 4, 3, 4, 4, 4, 4, 4, 1};
constexpr const char *kName[NOPS] = {"query",  "key",   "value", "bias", "mask",
                                     "kv_pad", "sinks", "out",   "lse",  "probs",
                                     "dout",   "dq",    "dk",    "dv",   "dsinks"};

/* One operand: its data, dimensions, element size and storage dtype (for the tensors that may
 * be half precision); absent when it has no element. */
struct Tensor {
    char *data = nullptr;
    std::vector<int64_t> dims;
    int64_t elem = 0;
    mha_dtype dtype = MHA_DTYPE_F32;
    bool present = false;
};

/* The operands mha reads or writes in a storage dtype of their own (mha_attention_args.q_dtype,
 * ..., mha_attention_grads.dout_dtype, ...): float32, bfloat16 or float16. */
bool half_capable(Operand which) {
    return which == Q || which == K || which == V || which == OUT || which == DOUT || which == DQ ||
           which == DK || which == DV;
}

/* The mha_dtype and element size of a half-capable operand's element type; false for others. */
bool storage_dtype(ffi::DataType t, mha_dtype *dtype, int64_t *elem) {
    switch (t) {
    case ffi::DataType::F32:
        *dtype = MHA_DTYPE_F32;
        *elem = 4;
        return true;
    case ffi::DataType::BF16:
        *dtype = MHA_DTYPE_BF16;
        *elem = 2;
        return true;
    case ffi::DataType::F16:
        *dtype = MHA_DTYPE_F16;
        *elem = 2;
        return true;
    default:
        return false;
    }
}

struct Call {
    Tensor op[NOPS];
    std::vector<int64_t> lead; /* the vmapped dimensions (those of the first output) */
    int64_t B = 0, T = 0, S = 0, N = 0, Kh = 0, H = 0, Hv = 0;
};

ffi::Error bad(const std::string &what) {
    return ffi::Error::InvalidArgument("mha.jax: " + what);
}

/* Records buffer `b` as operand `which`, checking its element type (F32, BF16 or F16 for the
 * half-capable tensors, PRED for masks, F32 for the rest). */
ffi::Error take(Call &c, Operand which, const ffi::AnyBuffer &b) {
    Tensor &o = c.op[which];
    auto dims = b.dimensions();
    o.dims.assign(dims.begin(), dims.end());
    o.data = static_cast<char *>(b.untyped_data());
    o.present = b.element_count() > 0;
    if (half_capable(which)) {
        if (!storage_dtype(b.element_type(), &o.dtype, &o.elem) && o.present) {
            return bad(std::string(kName[which]) + " must be float32, bfloat16 or float16");
        }
    } else {
        bool boolean = which == MASK || which == KV_PAD;
        ffi::DataType want = boolean ? ffi::DataType::PRED : ffi::DataType::F32;
        o.elem = boolean ? 1 : 4;
        if (o.present && b.element_type() != want) {
            return bad(std::string(kName[which]) + " must be " + (boolean ? "bool" : "float32"));
        }
    }
    if (o.present && static_cast<int64_t>(o.dims.size()) < kCoreRank[which]) {
        return bad(std::string(kName[which]) + " has too few dimensions");
    }
    return ffi::Error::Success();
}

/* Dimension i of operand `which`'s core shape. */
int64_t core_dim(const Call &c, Operand which, int i) {
    const Tensor &o = c.op[which];
    return o.dims[o.dims.size() - static_cast<size_t>(kCoreRank[which]) + static_cast<size_t>(i)];
}

/* The core shapes every operand must have, given q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv]
 * (-1: any; the masks and the bias broadcast, which the library checks). The handlers write the
 * results and read the operands through these sizes, so a direct ffi_call with inconsistent
 * shapes is refused here instead of overrunning a buffer. Results are never broadcast. */
ffi::Error check_shapes(const Call &c) {
    const int64_t B = c.B, T = c.T, S = c.S, N = c.N, Kh = c.Kh, H = c.H, Hv = c.Hv;
    const std::vector<int64_t> want[NOPS] = {
        {B, T, N, H},  {B, S, Kh, H}, {B, S, Kh, Hv}, {-1, -1, -1, -1}, {-1, -1, -1, -1},
        {B, S},        {N},           {B, T, N, Hv},  {B, N, T},        {B, N, T, S},
        {B, T, N, Hv}, {B, T, N, H},  {B, S, Kh, H},  {B, S, Kh, Hv},   {N}};
    for (int w = 0; w < NOPS; ++w) {
        const Tensor &o = c.op[w];
        if (!o.present) {
            continue;
        }
        for (int i = 0; i < kCoreRank[w]; ++i) {
            int64_t got = core_dim(c, static_cast<Operand>(w), i);
            if (want[w][static_cast<size_t>(i)] >= 0 && got != want[w][static_cast<size_t>(i)]) {
                return bad(std::string(kName[w]) + " has the wrong shape");
            }
        }
        bool result = w == OUT || w == LSE || w == PROBS || w >= DQ;
        for (size_t i = 0; result && i < c.lead.size(); ++i) {
            if (o.dims[i] != c.lead[i]) {
                return bad(std::string(kName[w]) + " (a result) has broadcast vmapped dimensions");
            }
        }
    }
    return ffi::Error::Success();
}

/* The leading (vmapped) dimensions from the first output, sizes from q, k and v, and the check
 * that every present operand has the same number of leading dimensions, each 1 or full. */
ffi::Error resolve(Call &c, Operand first_out) {
    const Tensor &f = c.op[first_out];
    /* The vmapped dimensions are read from it: it must have its core rank (an empty one may have
     * any shape, even fewer dimensions). */
    if (!f.present) {
        return bad(std::string(kName[first_out]) + " (a result) must not be empty");
    }
    c.lead.assign(f.dims.begin(), f.dims.end() - kCoreRank[first_out]);
    for (int w = 0; w < NOPS; ++w) {
        const Tensor &o = c.op[w];
        if (!o.present) {
            continue;
        }
        size_t nl = o.dims.size() - static_cast<size_t>(kCoreRank[w]);
        if (nl != c.lead.size()) {
            return bad(std::string(kName[w]) + " has a different number of vmapped dimensions");
        }
        for (size_t i = 0; i < nl; ++i) {
            if (o.dims[i] != 1 && o.dims[i] != c.lead[i]) {
                return bad(std::string(kName[w]) + " has a vmapped dimension of another size");
            }
        }
    }
    c.B = core_dim(c, Q, 0);
    c.T = core_dim(c, Q, 1);
    c.N = core_dim(c, Q, 2);
    c.H = core_dim(c, Q, 3);
    c.S = core_dim(c, K, 1);
    c.Kh = core_dim(c, K, 2);
    c.Hv = core_dim(c, V, 3);
    return check_shapes(c);
}

/* Elements of operand `which`'s core shape. */
int64_t core_elems(const Call &c, Operand which) {
    int64_t n = 1;
    for (int i = 0; i < kCoreRank[which]; ++i) {
        n *= core_dim(c, which, i);
    }
    return n;
}

/* Address of operand `which` for vmapped index `idx` (row-major over c.lead); a size-1 leading
 * dimension broadcasts. */
void *at(const Call &c, Operand which, int64_t idx) {
    const Tensor &o = c.op[which];
    if (!o.present) {
        return nullptr;
    }
    int64_t off = 0, stride = core_elems(c, which);
    for (size_t j = c.lead.size(); j-- > 0;) {
        int64_t coord = idx % c.lead[j];
        idx /= c.lead[j];
        if (o.dims[j] != 1) {
            off += coord * stride;
        }
        stride *= o.dims[j];
    }
    return o.data + off * o.elem;
}

/* True when the vmapped dimensions can fold into the batch (one library call over all of them):
 * q, k, v and the results vmapped on all of them; a mask, bias or key padding either vmapped on
 * all of them with the full batch B, or on none with batch 1 (it then broadcasts over the folded
 * batch as over B); sinks not vmapped, and no sinks gradient (per vmapped call, while a folded
 * call would sum it over them). */
bool foldable(const Call &c) {
    for (int w = 0; w < NOPS; ++w) {
        const Tensor &o = c.op[w];
        if (!o.present) {
            continue;
        }
        bool full = true, ones = true;
        for (size_t i = 0; i < c.lead.size(); ++i) {
            full = full && o.dims[i] == c.lead[i];
            ones = ones && o.dims[i] == 1;
        }
        bool ok;
        if (w == BIAS || w == MASK || w == KV_PAD) {
            int64_t b = core_dim(c, static_cast<Operand>(w), 0);
            ok = (full && b == c.B) || (ones && b == 1);
        } else if (w == SINKS) {
            ok = ones;
        } else {
            ok = full && w != DSINKS;
        }
        if (!ok) {
            return false;
        }
    }
    return true;
}

/* A broadcasting mask tensor over operand `which` (batch dimension times `fold`). */
mha_mask_tensor mask_tensor(const Call &c, Operand which, const void *data, int64_t fold) {
    mha_mask_tensor t{};
    if (data == nullptr) {
        return t;
    }
    t.data = data;
    t.dtype = which == BIAS ? MHA_DTYPE_F32 : MHA_DTYPE_BOOL;
    t.ndim = kCoreRank[which];
    for (int i = 0; i < kCoreRank[which]; ++i) {
        t.shape[i] = core_dim(c, which, i);
    }
    /* Folded: a vmapped operand's batch spans the folded batch; a shared one (batch 1, see
     * foldable()) broadcasts over it as it is. */
    const Tensor &o = c.op[which];
    for (size_t i = 0; i < c.lead.size(); ++i) {
        if (o.dims[i] != 1) {
            t.shape[0] *= fold;
            break;
        }
    }
    return t;
}

/* The attributes every call shares. */
struct Attrs {
    double scale, softcap;
    bool causal;
    int64_t window_left, window_right, impl, threads;
};

/* mha_attention_args for vmapped index `idx` over `batch` rows (B, or all of them folded). */
mha_attention_args forward_args(const Call &c, const Attrs &a, int64_t idx, int64_t fold) {
    mha_attention_args args{};
    args.batch = c.B * fold;
    args.num_heads = c.N;
    args.num_kv_heads = c.Kh;
    args.q_len = c.T;
    args.kv_len = c.S;
    args.head_dim = c.H;
    args.v_head_dim = c.Hv;
    args.scale = a.scale;
    args.softcap = a.softcap;
    args.sinks = static_cast<const float *>(at(c, SINKS, idx));
    /* [B, L, heads, d] row-major seen as [B, heads, L, d]: strides {L*heads*d, d, heads*d}. */
    const int64_t q_s[3] = {c.T * c.N * c.H, c.H, c.N * c.H};
    const int64_t k_s[3] = {c.S * c.Kh * c.H, c.H, c.Kh * c.H};
    const int64_t v_s[3] = {c.S * c.Kh * c.Hv, c.Hv, c.Kh * c.Hv};
    const int64_t o_s[3] = {c.T * c.N * c.Hv, c.Hv, c.N * c.Hv};
    args.q = at(c, Q, idx);
    args.k = at(c, K, idx);
    args.v = at(c, V, idx);
    args.out = at(c, OUT, idx);
    args.q_dtype = c.op[Q].dtype;
    args.k_dtype = c.op[K].dtype;
    args.v_dtype = c.op[V].dtype;
    args.out_dtype = c.op[OUT].dtype;
    std::memcpy(args.q_strides, q_s, sizeof q_s);
    std::memcpy(args.k_strides, k_s, sizeof k_s);
    std::memcpy(args.v_strides, v_s, sizeof v_s);
    std::memcpy(args.out_strides, o_s, sizeof o_s);
    args.lse = static_cast<float *>(at(c, LSE, idx));
    args.probs = static_cast<float *>(at(c, PROBS, idx));
    args.mask.causal = a.causal ? 1 : 0;
    args.mask.alignment = MHA_ALIGN_TOP_LEFT;
    args.mask.use_window = (a.window_left >= 0 || a.window_right >= 0) ? 1 : 0;
    args.mask.window_left = a.window_left;
    args.mask.window_right = a.window_right;
    args.mask.additive_mask = mask_tensor(c, BIAS, at(c, BIAS, idx), fold);
    args.mask.bool_mask = mask_tensor(c, MASK, at(c, MASK, idx), fold);
    args.mask.bool_mask_polarity = MHA_MASK_ATTEND;
    args.mask.key_padding = mask_tensor(c, KV_PAD, at(c, KV_PAD, idx), fold);
    return args;
}

/* The pool of every call with threads = 0 (all cores): made at the first such call, kept for the
 * life of the process and shared by every compiled program (the library lets callers of one pool
 * take turns), as mha/_marshal.py's pool_for does for the NumPy API. Without it each call would
 * start and join its threads: ~100 us, more than a small attention costs. NULL (threads started
 * per call) if it cannot be made, and in a child made by fork(), where the parent's workers do
 * not exist. Never destroyed: programs may run until exit. */
struct SharedPool {
    mha_threadpool *pool;
    pid_t owner;
};

mha_threadpool *shared_pool() {
    static const SharedPool shared = [] {
        mha_threadpool *p = nullptr;
        bool ok = mha_threadpool_create(0, nullptr, &p, nullptr) == MHA_STATUS_OK;
        return SharedPool{ok ? p : nullptr, getpid()};
    }();
    return shared.owner == getpid() ? shared.pool : nullptr;
}

mha_exec make_exec(const Attrs &a) {
    mha_exec e{};
    e.impl = static_cast<mha_impl>(a.impl);
    e.n_threads = static_cast<int32_t>(a.threads);
    e.pool = a.threads == 0 ? shared_pool() : nullptr;
    return e;
}

ffi::Error status(mha_status s, const mha_error &err) {
    if (s == MHA_STATUS_OK) {
        return ffi::Error::Success();
    }
    std::string msg(err.message, strnlen(err.message, sizeof err.message));
    return ffi::Error(s == MHA_STATUS_INVALID_ARG ? ffi::ErrorCode::kInvalidArgument
                                                  : ffi::ErrorCode::kInternal,
                      "mha: " + msg + " [" + mha_status_string(s) + "]");
}

/* Product of the vmapped dimensions. */
int64_t lead_count(const Call &c) {
    int64_t n = 1;
    for (int64_t d : c.lead) {
        n *= d;
    }
    return n;
}

/* Runs `one(idx, fold)` once with everything folded, or once per vmapped index. */
template <typename F> ffi::Error run(const Call &c, F one) {
    int64_t count = lead_count(c);
    if (count == 0 || c.B == 0) {
        return ffi::Error::Success();
    }
    if (foldable(c)) {
        return one(0, count);
    }
    for (int64_t idx = 0; idx < count; ++idx) {
        ffi::Error e = one(idx, 1);
        if (e.failure()) {
            return e;
        }
    }
    return ffi::Error::Success();
}

ffi::Error take_inputs(Call &c,
                       ffi::AnyBuffer q,
                       ffi::AnyBuffer k,
                       ffi::AnyBuffer v,
                       ffi::AnyBuffer bias,
                       ffi::AnyBuffer mask,
                       ffi::AnyBuffer kv_pad,
                       ffi::AnyBuffer sinks) {
    const ffi::AnyBuffer *in[] = {&q, &k, &v, &bias, &mask, &kv_pad, &sinks};
    for (int w = Q; w <= SINKS; ++w) {
        ffi::Error e = take(c, static_cast<Operand>(w), *in[w]);
        if (e.failure()) {
            return e;
        }
    }
    if (!c.op[Q].present || !c.op[K].present || !c.op[V].present) {
        return bad("query, key and value must not be empty");
    }
    return ffi::Error::Success();
}

ffi::Error forward_impl(ffi::AnyBuffer q,
                        ffi::AnyBuffer k,
                        ffi::AnyBuffer v,
                        ffi::AnyBuffer bias,
                        ffi::AnyBuffer mask,
                        ffi::AnyBuffer kv_pad,
                        ffi::AnyBuffer sinks,
                        ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> lse,
                        ffi::Result<ffi::AnyBuffer> probs,
                        double scale,
                        double softcap,
                        bool causal,
                        int64_t window_left,
                        int64_t window_right,
                        int64_t impl,
                        int64_t threads) {
    Call c;
    ffi::Error e = take_inputs(c, q, k, v, bias, mask, kv_pad, sinks);
    if (e.success()) {
        e = take(c, OUT, *out);
    }
    if (e.success()) {
        e = take(c, LSE, *lse);
    }
    if (e.success()) {
        e = take(c, PROBS, *probs);
    }
    if (e.success()) {
        e = resolve(c, OUT);
    }
    if (e.failure()) {
        return e;
    }
    const Attrs a{scale, softcap, causal, window_left, window_right, impl, threads};
    const mha_exec ex = make_exec(a);
    return run(c, [&](int64_t idx, int64_t fold) {
        mha_attention_args args = forward_args(c, a, idx, fold);
        mha_error err{};
        return status(mha_attention(&args, &ex, &err), err);
    });
}

ffi::Error backward_impl(ffi::AnyBuffer q,
                         ffi::AnyBuffer k,
                         ffi::AnyBuffer v,
                         ffi::AnyBuffer bias,
                         ffi::AnyBuffer mask,
                         ffi::AnyBuffer kv_pad,
                         ffi::AnyBuffer sinks,
                         ffi::AnyBuffer out,
                         ffi::AnyBuffer lse,
                         ffi::AnyBuffer dout,
                         ffi::Result<ffi::AnyBuffer> dq,
                         ffi::Result<ffi::AnyBuffer> dk,
                         ffi::Result<ffi::AnyBuffer> dv,
                         ffi::Result<ffi::AnyBuffer> dsinks,
                         double scale,
                         double softcap,
                         bool causal,
                         int64_t window_left,
                         int64_t window_right,
                         int64_t impl,
                         int64_t threads) {
    Call c;
    ffi::Error e = take_inputs(c, q, k, v, bias, mask, kv_pad, sinks);
    const std::pair<Operand, const ffi::AnyBuffer *> rest[] = {
        {OUT, &out}, {LSE, &lse}, {DOUT, &dout},     {DQ, &*dq},
        {DK, &*dk},  {DV, &*dv},  {DSINKS, &*dsinks}};
    for (const auto &r : rest) {
        if (e.success()) {
            e = take(c, r.first, *r.second);
        }
    }
    for (Operand w : {OUT, LSE, DOUT, DK, DV}) {
        if (e.success() && !c.op[w].present) {
            e = bad(std::string(kName[w]) + " must not be empty");
        }
    }
    if (e.success()) {
        e = resolve(c, DQ);
    }
    if (e.failure()) {
        return e;
    }
    const Attrs a{scale, softcap, causal, window_left, window_right, impl, threads};
    const mha_exec ex = make_exec(a);
    return run(c, [&](int64_t idx, int64_t fold) {
        mha_attention_args args = forward_args(c, a, idx, fold);
        /* Gradients share the layouts of the tensors they differentiate. */
        mha_attention_grads g{};
        g.dout = at(c, DOUT, idx);
        std::memcpy(g.dout_strides, args.out_strides, sizeof g.dout_strides);
        g.dq = at(c, DQ, idx);
        std::memcpy(g.dq_strides, args.q_strides, sizeof g.dq_strides);
        g.dk = at(c, DK, idx);
        std::memcpy(g.dk_strides, args.k_strides, sizeof g.dk_strides);
        g.dv = at(c, DV, idx);
        std::memcpy(g.dv_strides, args.v_strides, sizeof g.dv_strides);
        g.dout_dtype = c.op[DOUT].dtype;
        g.dq_dtype = c.op[DQ].dtype;
        g.dk_dtype = c.op[DK].dtype;
        g.dv_dtype = c.op[DV].dtype;
        g.dsinks = static_cast<float *>(at(c, DSINKS, idx));
        mha_error err{};
        return status(mha_attention_backward(&args, &g, &ex, &err), err);
    });
}

} // namespace

/* The binding: operands in order, then results, then the named attributes. */
#define MHA_JAX_INPUTS(B)                                                                          \
    B.Arg<ffi::AnyBuffer>()                                                                        \
        .Arg<ffi::AnyBuffer>()                                                                     \
        .Arg<ffi::AnyBuffer>()                                                                     \
        .Arg<ffi::AnyBuffer>()                                                                     \
        .Arg<ffi::AnyBuffer>()                                                                     \
        .Arg<ffi::AnyBuffer>()                                                                     \
        .Arg<ffi::AnyBuffer>()
#define MHA_JAX_ATTRS(B)                                                                           \
    B.Attr<double>("scale")                                                                        \
        .Attr<double>("softcap")                                                                   \
        .Attr<bool>("causal")                                                                      \
        .Attr<int64_t>("window_left")                                                              \
        .Attr<int64_t>("window_right")                                                             \
        .Attr<int64_t>("impl")                                                                     \
        .Attr<int64_t>("threads")

XLA_FFI_DEFINE_HANDLER_SYMBOL(MhaJaxForward,
                              forward_impl,
                              MHA_JAX_ATTRS(MHA_JAX_INPUTS(ffi::Ffi::Bind())
                                                .Ret<ffi::AnyBuffer>()
                                                .Ret<ffi::AnyBuffer>()
                                                .Ret<ffi::AnyBuffer>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MhaJaxBackward,
                              backward_impl,
                              MHA_JAX_ATTRS(MHA_JAX_INPUTS(ffi::Ffi::Bind())
                                                .Arg<ffi::AnyBuffer>()
                                                .Arg<ffi::AnyBuffer>()
                                                .Arg<ffi::AnyBuffer>()
                                                .Ret<ffi::AnyBuffer>()
                                                .Ret<ffi::AnyBuffer>()
                                                .Ret<ffi::AnyBuffer>()
                                                .Ret<ffi::AnyBuffer>()));
