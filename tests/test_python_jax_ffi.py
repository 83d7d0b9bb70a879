# SPDX-License-Identifier: MIT
"""mha.jax (jax.nn.dot_product_attention through XLA's FFI) and mha.equinox.MultiheadAttention.

Oracles, in float64 (jax_enable_x64) on the float32-rounded inputs and weights, so a comparison
measures mha's float32 error: jax.nn.dot_product_attention (implementation "xla") and
eqx.nn.MultiheadAttention themselves, and for mha's extras (soft-cap, sinks) the formula written
out in jnp. Values under jax.jit, gradients under jax.jit(jax.grad(...)) against jax.grad of the
oracle, vmap against a loop. Tolerances: tests/common/tolerance.h (TOL_OUT_REL, TOL_GRAD_REL)
times max|reference|, as tests/test_python_jax.py.

The FFI handler is the one CMake built (MHA_JAX_FFI, set by ctest), the library MHA_LIBRARY.
"""
import os
import sys

import numpy as np
import pytest

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Most of this file's time is XLA compiling ~60 small programs: without LLVM's optimisations it
# takes ~30% less CPU (the float64 references can only move in their last bits).
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
import jax  # noqa: E402  (required: CI installs python/requirements-test.txt)

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
import equinox as eqx  # noqa: E402

import mha.equinox  # noqa: E402
import mha.jax  # noqa: E402
from half_kernels import assert_tile_close, bf16_tiles_active  # noqa: E402
from tolerances import TOL_GRAD_REL, TOL_OUT_REL  # noqa: E402

F32, F64 = jnp.float32, jnp.float64


def close(got, ref, tol=TOL_OUT_REL):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = np.abs(got - ref).max()
    scale = np.abs(ref).max()
    assert err <= tol * scale, f"max|got-ref|={err:.3e} > {tol:g}*{scale:.3e}"


def rounded(rng, shape):
    """Random normal values exactly representable in float32, as float64."""
    return np.asarray(rng.standard_normal(shape), np.float32).astype(np.float64)


# ------------------------------------------------------------------------------------------------
# mha.jax.dot_product_attention against jax.nn.dot_product_attention
# ------------------------------------------------------------------------------------------------
B, T, S, N, H = 2, 5, 7, 4, 8

CASES = {
    "plain": dict(),
    "causal_rect": dict(is_causal=True),
    "mask_nts": dict(mask=(N, T, S)),
    "bias_1nts": dict(bias=(1, N, T, S)),
    "bias_b11s_mask": dict(bias=(B, 1, 1, S), mask=(1, 1, T, S)),
    "gqa": dict(K=2, is_causal=True, bias=(1, N, T, S)),
    "mqa": dict(K=1, mask=(B, N, T, S)),
    "window": dict(S=T, local_window_size=(2, 1)),
    "window_causal_int": dict(S=T, local_window_size=2, is_causal=True),
    "seq_lengths": dict(q_len=[3, 5], kv_len=[7, 4]),
    "scale_unbatched": dict(scale=0.3, unbatched=True),
}


def make_case(c, seed):
    rng = np.random.default_rng(seed)
    s, k = c.get("S", S), c.get("K", N)
    b = 1 if c.get("unbatched") else B
    q, kk, v = rounded(rng, (b, T, N, H)), rounded(rng, (b, s, k, H)), rounded(rng, (b, s, k, H))
    if c.get("unbatched"):
        q, kk, v = q[0], kk[0], v[0]
    kw = {name: c[name] for name in ("is_causal", "local_window_size", "scale") if name in c}
    if "mask" in c:
        shape = tuple(c["mask"][:-1]) + (s,)
        m = rng.random(shape) < 0.7
        m[..., 0] = True  # no fully masked row (that difference has its own test)
        kw["mask"] = jnp.asarray(m)
    bias = jnp.asarray(rounded(rng, tuple(c["bias"][:-1]) + (s,))) if "bias" in c else None
    if "q_len" in c:
        kw["query_seq_lengths"] = jnp.asarray(c["q_len"], jnp.int32)
        kw["key_value_seq_lengths"] = jnp.asarray(c["kv_len"], jnp.int32)
    return [jnp.asarray(x) for x in (q, kk, v)], bias, kw


@pytest.mark.parametrize("name", sorted(CASES))
def test_dot_product_attention_matches_jax(name):
    (q, k, v), bias, kw = make_case(CASES[name], len(name))
    ref = jax.nn.dot_product_attention(q, k, v, bias, **kw)
    got = jax.jit(lambda q, k, v, b: mha.jax.dot_product_attention(q, k, v, b, **kw))(
        q.astype(F32), k.astype(F32), v.astype(F32), None if bias is None else bias.astype(F32))
    assert got.dtype == F32
    close(got, ref)

    # Gradients of <cotangent, out> with respect to q, k, v (and the bias when there is one).
    w = jnp.asarray(rounded(np.random.default_rng(1), ref.shape))
    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)

    def loss(fn, dtype):
        return lambda q, k, v, b: jnp.sum(w.astype(dtype) * fn(q, k, v, b, **kw))

    gref = jax.jit(jax.grad(loss(jax.nn.dot_product_attention, F64), argnums))(q, k, v, bias)
    args = [x if x is None else x.astype(F32) for x in (q, k, v, bias)]
    ggot = jax.jit(jax.grad(loss(mha.jax.dot_product_attention, F32), argnums))(*args)
    for g_got, g_ref in zip(ggot, gref):
        close(g_got, g_ref, TOL_GRAD_REL)


def test_residual_is_jax_log_sum_exp():
    (q, k, v), bias, kw = make_case(dict(is_causal=True, bias=(1, N, T, S)), 3)
    _, lse_ref = jax.nn.dot_product_attention(q, k, v, bias, return_residual=True, **kw)
    out, lse = mha.jax.dot_product_attention(q.astype(F32), k.astype(F32), v.astype(F32),
                                             bias.astype(F32), return_residual=True, **kw)
    assert out.shape == (B, T, N, H) and lse.shape == (B, T, N)
    close(lse, lse_ref)


def test_fully_masked_row_gives_zeros():
    """docs/SEMANTICS.md: a row with every key masked gives 0 and lse = -inf; JAX's XLA
    implementation gives the mean of the values there (its large negative fill is finite)."""
    (q, k, v), _, _ = make_case({}, 4)
    m = np.ones((B, 1, T, S), bool)
    m[1, 0, 2] = False
    m = jnp.asarray(m)
    out, lse = mha.jax.dot_product_attention(q.astype(F32), k.astype(F32), v.astype(F32),
                                             mask=m, return_residual=True)
    ref = jax.nn.dot_product_attention(q, k, v, mask=m)
    assert np.all(np.asarray(out[1, 2]) == 0) and np.all(np.isneginf(np.asarray(lse[1, 2])))
    close(ref[1, 2], jnp.broadcast_to(v[1].mean(axis=0), (N, H)))  # JAX: uniform weights
    keep = np.ones((B, T), bool)
    keep[1, 2] = False
    close(np.asarray(out)[keep], np.asarray(ref)[keep])
    # Its gradient is zero, never NaN.
    g = jax.grad(lambda q: jnp.sum(mha.jax.dot_product_attention(q, k.astype(F32),
                                                                 v.astype(F32), mask=m)))
    dq = np.asarray(g(q.astype(F32)))
    assert np.all(np.isfinite(dq)) and np.all(dq[1, 2] == 0)


# ------------------------------------------------------------------------------------------------
# mha's extras: soft-cap, sinks, another value head size, against the formula in float64
# ------------------------------------------------------------------------------------------------
def oracle(q, k, v, sinks, softcap, scale):
    """q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv], sinks [N]; docs/SEMANTICS.md."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = scale * jnp.einsum("btnd,bsnd->bnts", q, k)
    s = softcap * jnp.tanh(s / softcap)
    top = jnp.maximum(s.max(-1, keepdims=True), sinks[None, :, None, None])
    e = jnp.exp(s - top)
    p = e / (jnp.exp(sinks[None, :, None, None] - top) + e.sum(-1, keepdims=True))
    return jnp.einsum("bnts,bsnd->btnd", p, v)


def test_softcap_sinks_gqa_value_size():
    rng = np.random.default_rng(7)
    K, Hv, cap, scale = 2, 6, 1.5, 0.7
    q = jnp.asarray(rounded(rng, (B, T, N, H)) * 2)
    k, v = jnp.asarray(rounded(rng, (B, S, K, H)) * 2), jnp.asarray(rounded(rng, (B, S, K, Hv)))
    sinks = jnp.asarray(rounded(rng, (N,)))
    w = jnp.asarray(rounded(rng, (B, T, N, Hv)))

    def got_fn(q, k, v, s):
        return mha.jax.dot_product_attention(q, k, v, sinks=s, softcap=cap, scale=scale)

    close(jax.jit(got_fn)(q.astype(F32), k.astype(F32), v.astype(F32), sinks.astype(F32)),
          oracle(q, k, v, sinks, cap, scale))
    gref = jax.jit(jax.grad(lambda *a: jnp.sum(w * oracle(*a, cap, scale)), (0, 1, 2, 3)))(
        q, k, v, sinks)
    ggot = jax.jit(jax.grad(lambda *a: jnp.sum(w.astype(F32) * got_fn(*a)), (0, 1, 2, 3)))(
        q.astype(F32), k.astype(F32), v.astype(F32), sinks.astype(F32))
    for g_got, g_ref in zip(ggot, gref):
        close(g_got, g_ref, TOL_GRAD_REL)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float64])
def test_other_dtypes_computed_in_float32(dtype):
    """float16/bfloat16 read as stored, float64 converted: computed in float32 either way, the
    float32 call's result rounded once to the input's dtype."""
    (q, k, v), _, _ = make_case({}, 5)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    got = mha.jax.dot_product_attention(q, k, v, is_causal=True)
    assert got.dtype == dtype
    ref = mha.jax.dot_product_attention(*(x.astype(F32) for x in (q, k, v)), is_causal=True)
    if dtype == jnp.bfloat16 and bf16_tiles_active():  # P rounded: the tile kernel's bound
        assert_tile_close(np.asarray(got.astype(F32)), np.asarray(ref), np.asarray(v.astype(F32)))
        return
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref.astype(dtype)))


# ------------------------------------------------------------------------------------------------
# vmap: folded into the batch, or looped when an operand is shared
# ------------------------------------------------------------------------------------------------
# The handler folds the vmapped dimension into the batch when every operand allows it ("none":
# the sinks shared, "batch1", "mask_batch1": a shared mask of batch 1) and loops otherwise (a
# shared mask of batch B, shared K/V, per-call sinks; the backward with sinks always loops).
@pytest.mark.parametrize("case", ["none", "batch1", "mask_batch1", "mask", "key_value",
                                  "per_call_sinks"])
def test_vmap_equals_loop(case):
    rng = np.random.default_rng(11)
    V = 3
    q = jnp.asarray(rounded(rng, (V, B, T, N, H)), F32)
    k = jnp.asarray(rounded(rng, (V, B, S, 2, H)), F32)
    v = jnp.asarray(rounded(rng, (V, B, S, 2, H)), F32)
    mask = jnp.asarray(rng.random((V, B, 1, T, S)) < 0.8)
    sinks = jnp.asarray(rounded(rng, (V, N)), F32)
    axes = [0, 0, 0, 0, 0]
    if case.endswith("batch1"):  # B = 1: the mask's batch dimension is 1, shared or not
        q, k, v, mask = q[:, :1], k[:, :1], v[:, :1], mask[:, :1]
    if case.startswith("mask"):
        mask, axes[3] = mask[0], None
    elif case == "key_value":
        k, v, axes[1], axes[2] = k[0], v[0], None, None
    if case != "per_call_sinks":
        sinks, axes[4] = sinks[0], None

    def f(q, k, v, m, s):
        return mha.jax.dot_product_attention(q, k, v, mask=m, sinks=s, is_causal=True)

    def pick(x, ax, i):
        return x if ax is None else x[i]

    def each(i):
        return [pick(x, ax, i) for x, ax in zip((q, k, v, mask, sinks), axes)]

    got = jax.jit(jax.vmap(f, in_axes=tuple(axes)))(q, k, v, mask, sinks)
    ref = [f(*each(i)) for i in range(V)]
    np.testing.assert_array_equal(np.asarray(got), np.stack([np.asarray(r) for r in ref]))

    # Gradients of q and the sinks: per call, and summed over the calls for shared sinks.
    def loss(q, k, v, m, s):
        return jnp.sum(jnp.sin(f(q, k, v, m, s)))

    dq, ds = jax.jit(jax.grad(lambda q_, s_: jnp.sum(jax.vmap(loss, in_axes=tuple(axes))(
        q_, k, v, mask, s_)), (0, 1)))(q, sinks)
    per = [jax.grad(loss, (0, 4))(*each(i)) for i in range(V)]
    close(dq, np.stack([np.asarray(g[0]) for g in per]), TOL_GRAD_REL)
    ds_ref = [np.asarray(g[1], np.float64) for g in per]
    close(ds, np.stack(ds_ref) if axes[4] == 0 else np.sum(ds_ref, axis=0), TOL_GRAD_REL)


# ------------------------------------------------------------------------------------------------
# What mha.jax refuses
# ------------------------------------------------------------------------------------------------
def test_errors():
    (q, k, v), _, _ = make_case({}, 6)
    q, k, v = (x.astype(F32) for x in (q, k, v))
    f = mha.jax.dot_product_attention
    with pytest.raises(ValueError, match="implementation='xla'"):
        f(q, k, v, implementation="xla")
    with pytest.raises(ValueError, match="mask must be bool"):
        f(q, k, v, mask=jnp.ones((T, S), jnp.int32))
    with pytest.raises(ValueError, match="bias of shape"):
        f(q, k, v, jnp.ones((1, 3, T, S), F32))
    with pytest.raises(ValueError, match="multiple of"):
        f(q, k[:, :, :3], v[:, :, :3])
    with pytest.raises(ValueError, match="must be > 0"):  # (was a ZeroDivisionError)
        f(q[..., :0], k[..., :0], v)
    with pytest.raises(ValueError, match="local_window_size"):
        f(q, k, v, local_window_size=(-1, 2))
    with pytest.raises(ValueError, match="query_seq_lengths"):
        f(q, k, v, query_seq_lengths=jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match="softcap"):
        f(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match="sinks"):
        f(q, k, v, sinks=jnp.zeros((N + 1,), F32))
    with pytest.raises(TypeError, match="query must be a floating-point"):
        f(q.astype(jnp.int32), k, v)
    with pytest.raises(TypeError, match="scale must be a Python number"):
        jax.jit(lambda s: f(q, k, v, scale=s))(0.5)
    with pytest.raises(ValueError, match="shapes do not agree"):
        f(q, k[:, :, :, :4], v)
    with pytest.raises(ValueError, match="threads"):
        f(q, k, v, threads=-1)
    # beyond the attributes' int64 / mha_exec's int32: ValueError naming them (they were an
    # OverflowError without a name, or threads=2^32 + 1 cast to 1 thread by the handler)
    for t in (2 ** 31, 2 ** 32 + 1, 2 ** 64):
        with pytest.raises(ValueError, match="threads"):
            f(q, k, v, threads=t)
    for w in (2 ** 63, (0, 2 ** 64 + 1)):
        with pytest.raises(ValueError, match="local_window_size"):
            f(q, k, v, local_window_size=w)


def test_handler_refuses_inconsistent_shapes():
    """The FFI target called directly with an output of the wrong shape: an XLA error carrying
    the handler's message, not a write past the buffer."""
    (q, k, v), _, _ = make_case({}, 6)
    q, k, v = (x.astype(F32) for x in (q, k, v))
    st = mha.jax._Static(0.0, 0.0, False, -1, -1, 0, 0)
    shapes = (jax.ShapeDtypeStruct((B, T + 1, N, H), F32), jax.ShapeDtypeStruct((B, N, T), F32),
              jax.ShapeDtypeStruct((0,), F32))
    call = jax.ffi.ffi_call(mha.jax._FORWARD, shapes, vmap_method="expand_dims")
    absent_f, absent_b = jnp.zeros((0,), F32), jnp.zeros((0,), jnp.bool_)
    with pytest.raises(Exception, match="out has the wrong shape"):
        jax.block_until_ready(call(q, k, v, absent_f, absent_b, absent_b, absent_f,
                                   **st.attrs()))


def _direct_forward(q, k, v, out_shape, out_dtype=F32, bias=None, mask=None):
    """The forward FFI target called directly (no mha.jax checks or conversions in between)."""
    st = mha.jax._Static(0.0, 0.0, False, -1, -1, 0, 0)
    shapes = (jax.ShapeDtypeStruct(out_shape, out_dtype), jax.ShapeDtypeStruct((B, N, T), F32),
              jax.ShapeDtypeStruct((0,), F32))
    call = jax.ffi.ffi_call(mha.jax._FORWARD, shapes, vmap_method="expand_dims")
    absent_f, absent_b = jnp.zeros((0,), F32), jnp.zeros((0,), jnp.bool_)
    return jax.block_until_ready(call(q, k, v, absent_f if bias is None else bias,
                                      absent_b if mask is None else mask, absent_b, absent_f,
                                      **st.attrs()))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float64, jnp.int32])
def test_handler_refuses_element_types(dtype):
    """The handler reads q, k, v and out as float32, bfloat16 or float16 (each as it is stored;
    tests/test_python_half.py), the bias as float32 and masks as bool: any other element type it
    is handed, operand or result, is an XLA error naming it, not a reinterpretation of the
    buffer."""
    (q, k, v), _, _ = make_case({}, 6)
    q, k, v = (x.astype(F32) for x in (q, k, v))
    if dtype not in (jnp.bfloat16, jnp.float16):
        storage = "must be float32, bfloat16 or float16"
        with pytest.raises(Exception, match=f"query {storage}"):
            _direct_forward(q.astype(dtype), k, v, (B, T, N, H))
        with pytest.raises(Exception, match=f"value {storage}"):
            _direct_forward(q, k, v.astype(dtype), (B, T, N, H))
        with pytest.raises(Exception, match=f"out {storage}"):
            _direct_forward(q, k, v, (B, T, N, H), dtype)
    with pytest.raises(Exception, match="bias must be float32"):
        _direct_forward(q, k, v, (B, T, N, H), bias=jnp.zeros((1, 1, T, S), dtype))
    with pytest.raises(Exception, match="mask must be bool"):
        _direct_forward(q, k, v, (B, T, N, H), mask=jnp.ones((1, 1, T, S), dtype))


def test_handler_refuses_empty_or_short_results():
    """A result of zero size or fewer dimensions than the handler reads its sizes from: refused
    (the handler used to take the vmapped dimensions from it before any check)."""
    (q, k, v), _, _ = make_case({}, 6)
    q, k, v = (x.astype(F32) for x in (q, k, v))
    for shape in ((0,), (B, 0, N, H), (T, N, H)):
        with pytest.raises(Exception, match="out"):
            _direct_forward(q, k, v, shape)
    with pytest.raises(Exception, match="key has the wrong shape"):  # too short for q's H
        _direct_forward(q, k[:, :, :, :4], v, (B, T, N, H))
    with pytest.raises(Exception, match="too few dimensions"):
        _direct_forward(q[0], k, v, (B, T, N, H))
    # The backward: every gradient and its inputs out, lse, dout must be there.
    st = mha.jax._Static(0.0, 0.0, False, -1, -1, 0, 0)
    out, lse = mha.jax._attention(st, q, k, v, None, None, None, None)
    absent_f, absent_b = jnp.zeros((0,), F32), jnp.zeros((0,), jnp.bool_)
    for dq_shape, lse_in, what in (((0,), lse, "dq"), (q.shape, absent_f, "lse")):
        shapes = (jax.ShapeDtypeStruct(dq_shape, F32), jax.ShapeDtypeStruct(k.shape, F32),
                  jax.ShapeDtypeStruct(v.shape, F32), jax.ShapeDtypeStruct((0,), F32))
        call = jax.ffi.ffi_call(mha.jax._BACKWARD, shapes, vmap_method="expand_dims")
        with pytest.raises(Exception, match=f"{what}.*must not be empty"):
            jax.block_until_ready(call(q, k, v, absent_f, absent_b, absent_b, absent_f, out,
                                       lse_in, out, **st.attrs()))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float64])
def test_other_dtypes_against_float64(dtype):
    """bf16 / f16 / f64 (x64 on) into dot_product_attention: computed in float32 (bf16 / f16 read
    as stored, f64 converted), a correct result in the input's dtype (against JAX's float64
    attention on the same values)."""
    (q, k, v), _, _ = make_case({}, 7)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    got = mha.jax.dot_product_attention(q, k, v)
    assert got.dtype == dtype
    ref = jax.nn.dot_product_attention(*(x.astype(F64) for x in (q, k, v)), implementation="xla")
    eps = {jnp.float16: 2.0 ** -10, jnp.bfloat16: 2.0 ** -7, jnp.float64: 0.0}[dtype]
    close(got, ref, TOL_OUT_REL + eps)
    with pytest.raises(TypeError, match="floating-point"):
        mha.jax.dot_product_attention(q, k, v, bias=jnp.zeros((1, 1, T, S), jnp.int32))
    with pytest.raises(ValueError, match="mask must be bool"):
        mha.jax.dot_product_attention(q, k, v, mask=jnp.ones((T, S), jnp.float32))


def test_other_backend_refused(monkeypatch):
    """Under jit the arrays are tracers: the default backend decides, and anything but the CPU is
    refused with a message (no GPU here, so the backend is faked)."""
    (q, k, v), _, _ = make_case({}, 6)
    monkeypatch.setattr(mha.jax.jax, "default_backend", lambda: "gpu")
    with pytest.raises(RuntimeError, match="CPU only"):
        jax.jit(mha.jax.dot_product_attention)(q.astype(F32), k.astype(F32), v.astype(F32))


# ------------------------------------------------------------------------------------------------
# mha.equinox.MultiheadAttention against eqx.nn.MultiheadAttention
# ------------------------------------------------------------------------------------------------
EQX_CASES = {
    "cross_sizes_bias": dict(h=2, q=12, k=10, v=6, out=9, qk=5, vo=7, bias=True, n=5, m=8),
    "mask_per_head": dict(h=3, q=12, n=5, m=7, mask="3d", qk=6),
    "causal_tril": dict(h=4, q=16, n=7, m=7, mask="tril", bias=True),
}


def eqx_pair(c, seed, dtype=F32):
    """The Equinox layer (float64, the oracle) and the drop-in (float32), same weights."""
    h, qs = c["h"], c["q"]
    ks, vs = c.get("k", qs), c.get("v", c.get("k", qs))
    bias = c.get("bias", False)
    kw = dict(key_size=ks, value_size=vs, output_size=c.get("out"), qk_size=c.get("qk"),
              vo_size=c.get("vo"), use_query_bias=bias, use_key_bias=bias, use_value_bias=bias,
              use_output_bias=bias, key=jax.random.PRNGKey(seed))
    ref = eqx.nn.MultiheadAttention(h, qs, **kw)
    got = mha.equinox.MultiheadAttention(h, qs, **kw)

    def cast(t):
        return jax.tree_util.tree_map(lambda x: jnp.asarray(x, np.float32).astype(t)
                                      if eqx.is_array(x) else x, got if t == F32 else ref)
    return cast(F64), cast(dtype), (qs, ks, vs)


def eqx_mask(c, rng, n, m):
    if c.get("mask") == "3d":
        mask = rng.random((c["h"], n, m)) < 0.6
        mask[..., 0] = True
    elif c.get("mask") == "tril":
        mask = np.tril(np.ones((n, m), bool))
    else:
        return None
    return jnp.asarray(mask)


@pytest.mark.parametrize("name", sorted(EQX_CASES))
def test_equinox_drop_in(name):
    c = EQX_CASES[name]
    ref, got, (qs, ks, vs) = eqx_pair(c, len(name))
    rng = np.random.default_rng(len(name))
    n, m, batch = c.get("n", 6), c.get("m", c.get("n", 6)), 3
    xq, xk, xv = (jnp.asarray(rounded(rng, (batch, L, d))) for L, d in ((n, qs), (m, ks), (m, vs)))
    mask = eqx_mask(c, rng, n, m)
    w = jnp.asarray(rounded(rng, (batch, n, ref.output_size)))

    def loss(layer, q, k, v):  # vmap over the batch, as Equinox models do
        y = jax.vmap(lambda a, b, c_: layer(a, b, c_, mask))(q, k, v)
        return jnp.sum(w.astype(y.dtype) * y), y

    # Values and gradients (parameters and inputs) under jit(grad): the trainable leaves are
    # the arguments of jax.grad, the rest of the module is closed over.
    def grads(layer, dtype):
        params, static = eqx.partition(layer, eqx.is_inexact_array)
        fn = jax.jit(jax.grad(lambda p, *x: loss(eqx.combine(p, static), *x), (0, 1, 2, 3),
                              has_aux=True))
        return fn(params, *(x.astype(dtype) for x in (xq, xk, xv)))

    g_ref, y_ref = grads(ref, F64)
    g_got, y_got = grads(got, F32)
    assert y_got.dtype == F32
    close(y_got, y_ref)
    leaves_ref, leaves_got = jax.tree_util.tree_leaves(g_ref), jax.tree_util.tree_leaves(g_got)
    assert len(leaves_ref) == len(leaves_got) > 3
    # One scale for the parameters' gradients: the key bias's is zero analytically (a shift of
    # a row's scores), so its own max|ref| is rounding noise.
    scale = max(np.abs(np.asarray(x)).max() for x in leaves_ref[:-3])
    for a, b in zip(leaves_got[:-3], leaves_ref[:-3]):
        assert np.abs(np.asarray(a, np.float64) - np.asarray(b)).max() <= TOL_GRAD_REL * scale
    for a, b in zip(leaves_got[-3:], leaves_ref[-3:]):  # the inputs' gradients
        close(a, b, TOL_GRAD_REL)


def test_equinox_same_module():
    kw = dict(key_size=10, qk_size=5, use_key_bias=True, key=jax.random.PRNGKey(3))
    a = eqx.nn.MultiheadAttention(2, 12, **kw)
    b = mha.equinox.MultiheadAttention(2, 12, **kw)
    assert isinstance(b, eqx.nn.MultiheadAttention)
    ta, tb = jax.tree_util.tree_flatten(a), jax.tree_util.tree_flatten(b)
    assert len(ta[0]) == len(tb[0])
    for x, y in zip(ta[0], tb[0]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for f in ("num_heads", "query_size", "key_size", "value_size", "output_size", "qk_size",
              "vo_size", "use_query_bias", "use_key_bias", "use_value_bias", "use_output_bias"):
        assert getattr(a, f) == getattr(b, f), f


def test_equinox_fully_masked_row():
    """Equinox fills masked scores with finfo.min, so a row with no visible key attends
    uniformly (the mean of the value heads); mha gives zeros (docs/SEMANTICS.md), so the layer
    returns output_proj(0) = its output bias there. Every other row agrees."""
    c = dict(h=2, q=8, bias=True)
    ref, got, _ = eqx_pair(c, 9)
    rng = np.random.default_rng(9)
    x = jnp.asarray(rounded(rng, (5, 8)))
    mask = np.ones((5, 5), bool)
    mask[3] = False
    mask = jnp.asarray(mask)
    y_got = np.asarray(got(x.astype(F32), x.astype(F32), x.astype(F32), mask))
    y_ref = np.asarray(ref(x, x, x, mask))
    np.testing.assert_array_equal(y_got[3], np.asarray(got.output_proj.bias))
    mean_v = jax.vmap(ref.value_proj)(x).mean(axis=0)
    close(y_ref[3], ref.output_proj(mean_v))
    close(np.delete(y_got, 3, axis=0), np.delete(y_ref, 3, axis=0))


def test_equinox_refusals():
    layer = mha.equinox.MultiheadAttention(2, 8, dropout_p=0.1, key=jax.random.PRNGKey(0))
    x = jnp.ones((4, 8), F32)
    with pytest.raises(NotImplementedError, match="dropout"):
        layer(x, x, x, key=jax.random.PRNGKey(1))
    layer(x, x, x, inference=True)  # no dropout: runs
    with pytest.raises(ValueError, match="mask must have shape"):
        layer(x, x, x, jnp.ones((4, 3), bool), inference=True)
    with pytest.raises(ValueError, match="process_heads"):
        layer(x, x, x, inference=True, process_heads=lambda q, k, v: (q[:2], k, v))
