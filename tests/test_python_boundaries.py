# SPDX-License-Identifier: MIT
"""Every place Python hands memory to C (issue 28, "Nothing silent"): wrong dtypes, non-contiguous
views, wrong sizes and other devices are either converted (computed in float32, a correct result)
or refused with a clear TypeError / ValueError before C reads anything; never garbage.

Boundaries: torch.ops.mha.attention / attention_backward (python/mha/_torch_ops.py: the operator
a compiled or exported graph calls, also under autocast), the eager drop-ins (python/mha/torch.py,
which reach C through _marshal.py and the compiled _fastcall.c), the NumPy API (python/mha/_api.py)
and the compiled fast path itself (_fastcall.layer_forward). The JAX FFI handler's checks are in
tests/test_python_jax_ffi.py, the ring's mpi4py path in tests/mpi_python_ring.py.

Oracle: torch's scaled_dot_product_attention in float64 on the values mha was handed (rounded to
the input dtype), tolerance TOL_OUT_REL max|ref| plus the rounding of the output dtype.
"""
import os
import sys

import numpy as np
import pytest

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from test_python_api import load_fastcall_from_source  # noqa: E402,F401  (builds mha._fastcall)
import mha  # noqa: E402
import mha.torch as mt  # noqa: E402
from mha import _lib  # noqa: E402
from half_kernels import assert_tile_close, bf16_tiles_active  # noqa: E402
from tolerances import TOL_OUT_REL  # noqa: E402

OP = torch.ops.mha.attention
OP_BWD = torch.ops.mha.attention_backward
# The rounding of a result returned in each dtype (relative), on top of mha's float32 error.
EPS = {torch.float32: 0.0, torch.float64: 0.0, torch.float16: 2.0 ** -10,
       torch.bfloat16: 2.0 ** -7}


def close(got, ref, tol):
    got, ref = got.detach().double(), ref.detach().double()
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert torch.isfinite(got).all(), "non-finite values"
    scale = max(ref.abs().max().item(), 1e-30)
    err = (got - ref).abs().max().item()
    assert err <= tol * scale, f"max|got-ref|={err:.3e} > {tol:g}*{scale:.3e}"


def qkv(B=1, h=2, n=16, m=16, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, L, d, generator=g).to(dtype) for L in (n, m, m))


def op(q, k, v, attend=None, additive=None, causal=False, sinks=None, need_probs=False):
    return OP(q, k, v, attend, additive, causal, 0.0, 0.0, None, need_probs, False, 1, 0.0, False,
              sinks, -1, -1, False)


def sdpa64(q, k, v, mask=None, causal=False):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                          None if mask is None else
                                          (mask if mask.dtype == torch.bool else mask.double()),
                                          is_causal=causal)


# ------------------------------------------------------------------------------------------------
# torch.ops.mha.attention: the issue's repro and every wrong input
# ------------------------------------------------------------------------------------------------
def test_issue_repro_bf16_operator_is_not_garbage():
    q = torch.randn(1, 2, 64, 32).bfloat16()
    out, lse, probs = OP(q, q, q, None, None, False, 0.0, 0.0, None, False, True, 0, 0.0, False,
                         None, -1, -1, False)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert not torch.isnan(out.float()).any()
    close(out, sdpa64(q, q, q), TOL_OUT_REL + EPS[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_operator_converts_float_dtypes(dtype):
    q, k, v = qkv(dtype=dtype, seed=1)
    out, lse, probs = op(q, k, v, causal=True, need_probs=True)
    assert (out.dtype, lse.dtype, probs.dtype) == (dtype, torch.float32, dtype)
    close(out, sdpa64(q, k, v, causal=True), TOL_OUT_REL + EPS[dtype])
    # The float32 call on the same (rounded) values gives the same lse.
    ref_out, ref_lse, _ = op(*(t.float() for t in (q, k, v)), causal=True)
    if dtype == torch.bfloat16 and bf16_tiles_active():  # P rounded: the tile kernel's bound
        assert_tile_close(out.float().numpy(), ref_out.numpy(), v.float().numpy())
        return
    assert torch.equal(lse, ref_lse)
    assert torch.equal(out, ref_out.to(dtype))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_operator_refuses_non_float_operands(dtype):
    q, k, v = qkv()
    bad = torch.ones(q.shape, dtype=dtype)
    for args in ((bad, k, v), (q, bad, v), (q, k, bad)):
        with pytest.raises(TypeError, match="must be floating point"):
            op(*args)


def test_operator_refuses_mixed_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="same dtype"):
        op(q.bfloat16(), k, v)


def test_operator_masks():
    q, k, v = qkv(n=8, m=12, seed=2)
    keep = torch.rand(8, 12, generator=torch.Generator().manual_seed(3)) > 0.3
    keep[:, 0] = True
    # A bool mask is the attend mask; any other dtype there is refused.
    close(op(q, k, v, attend=keep)[0], sdpa64(q, k, v, keep), TOL_OUT_REL)
    for dt in (torch.float32, torch.int32, torch.uint8, torch.int64):
        with pytest.raises(TypeError, match="attend must be a bool mask"):
            op(q, k, v, attend=keep.to(dt))
    # A float additive mask of any float dtype is converted; integer/bool ones are refused.
    add = torch.randn(8, 12, dtype=torch.float64)
    for dt in (torch.float64, torch.float16, torch.bfloat16):
        a = add.to(dt)
        close(op(q, k, v, additive=a)[0], sdpa64(q, k, v, a), TOL_OUT_REL)
    for dt in (torch.int32, torch.bool):
        with pytest.raises(TypeError, match="additive must be floating point"):
            op(q, k, v, additive=torch.zeros(8, 12, dtype=dt))
    # A mask that does not broadcast to [B, h, n, m] (a too-short buffer): refused by the library.
    with pytest.raises(mha.MhaError, match="does not broadcast"):
        op(q, k, v, attend=keep[:, :11])
    with pytest.raises(mha.MhaError, match="does not broadcast"):
        op(q, k, v, additive=add[:7].float())
    with pytest.raises(ValueError, match="1 to 4 dimensions"):
        op(q, k, v, additive=torch.zeros(1, 1, 1, 8, 12))
    # A non-contiguous mask (a transposed view) is read in its own order.
    add_t = torch.randn(12, 8).t()
    close(op(q, k, v, additive=add_t)[0], sdpa64(q, k, v, add_t), TOL_OUT_REL)


def test_operator_non_contiguous_views():
    q, k, v = qkv(n=16, m=16, d=8, seed=4)
    ref = sdpa64(q, k, v)
    # Last dimension strided (a transposed buffer), and slices with gaps in every other stride.
    qt, kt, vt = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v))
    assert qt.stride(-1) != 1
    close(op(qt, kt, vt)[0], ref, TOL_OUT_REL)
    big = [torch.zeros(2, 4, 32, 16) for _ in range(3)]
    for b, t in zip(big, (q, k, v)):
        b[1:, 1:3, ::2, 4:12] = t
    qs, ks, vs = (b[1:, 1:3, ::2, 4:12] for b in big)
    assert not qs.is_contiguous()
    assert torch.equal(op(qs, ks, vs)[0], op(q, k, v)[0])
    # Expanded (stride 0) operands.
    qe = q[:, :1].expand(1, 2, 16, 8)
    close(op(qe, k, v)[0], sdpa64(qe, k, v), TOL_OUT_REL)


def test_operator_wrong_shapes():
    q, k, v = qkv(d=8)
    cases = [((q[0], k, v), "4 dimensions"), ((q, k[..., :4], v), "shapes do not agree"),
             ((q, k, v[:, :, :5]), "shapes do not agree"), ((q, k[:1, :1].expand(2, 1, 16, 8),
                                                            v), "shapes do not agree")]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            op(*args)
    q3 = torch.randn(1, 3, 16, 8)
    with pytest.raises(ValueError, match="shapes do not agree"):  # 3 heads over 2 kv heads
        op(q3, k, v)
    # sinks are read as one float per query head: a shorter (or longer) tensor is refused.
    for s in (torch.zeros(1), torch.zeros(3), torch.zeros(1, 2)):
        with pytest.raises(ValueError, match="sinks must have shape"):
            op(q, k, v, sinks=s)
    with pytest.raises(TypeError, match="sinks must be floating point"):
        op(q, k, v, sinks=torch.zeros(2, dtype=torch.int32))


def test_operator_seed_checked():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="needs a seed"):
        OP(q, k, v, None, None, False, 0.0, 0.5, None, False, False, 1)
    with pytest.raises(TypeError, match="seed must be an int64"):
        OP(q, k, v, None, None, False, 0.0, 0.5, torch.zeros(2, dtype=torch.int64), False, False, 1)
    with pytest.raises(TypeError, match="seed must be an int64"):
        OP(q, k, v, None, None, False, 0.0, 0.5, torch.zeros(1), False, False, 1)


def test_operator_meta_device():
    q, k, v = qkv(dtype=torch.bfloat16)
    qm, km, vm = (t.to("meta") for t in (q, k, v))
    # All on meta: the fake kernel gives the shapes and dtypes the CPU kernel returns.
    out, lse, probs = op(qm, km, vm, need_probs=True)
    real = op(q, k, v, need_probs=True)
    for m_, r in zip((out, lse, probs), real):
        assert m_.device.type == "meta" and m_.shape == r.shape and m_.dtype == r.dtype
    # Meta among CPU tensors: refused (torch would otherwise send the call to the fake kernel
    # and return uninitialised CPU memory).
    for args in ((q, k, vm), (qm, k, v)):
        with pytest.raises(TypeError, match="one device"):
            op(*args)
    with pytest.raises(TypeError, match="one device"):
        op(q, k, v, attend=torch.ones(16, 16, dtype=torch.bool, device="meta"))
    # The eager drop-ins refuse a meta tensor with a clear message.
    with pytest.raises(TypeError, match="must be a CPU tensor"):
        mt.scaled_dot_product_attention(qm, km, vm)
    layer = mt.MultiheadAttention(16, 2, batch_first=True)
    with pytest.raises(TypeError, match="must be a CPU tensor"):
        layer(torch.randn(1, 4, 16, device="meta"), torch.randn(1, 4, 16, device="meta"),
              torch.randn(1, 4, 16, device="meta"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_operator_autograd_converts(dtype):
    q, k, v = (t.requires_grad_() for t in qkv(dtype=dtype, seed=5))
    out = op(q, k, v, causal=True)[0]
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(dtype)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    sdpa64(q64, k64, v64, causal=True).backward(dout.double())
    tol = 1e-4 + 4 * EPS[dtype]  # the gradient goes through out rounded to dtype
    for got, ref in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert got.dtype == dtype
        close(got, ref, tol)


def test_backward_operator_checks():
    q, k, v = qkv(seed=7)
    out, lse, _ = op(q, k, v)
    dout = torch.randn(out.shape)
    args = (None, None, False, 0.0, 0.0, None, 1)
    ref = OP_BWD(dout, q, k, v, out, lse, *args)
    # Other float dtypes of out / dout / lse are converted.
    got = OP_BWD(dout.double(), q, k, v, out.double(), lse.double(), *args)
    for g_, r in zip(got, ref):
        close(g_, r, 1e-6)
    with pytest.raises(ValueError, match="lse"):
        OP_BWD(dout, q, k, v, out, lse[:, :, :-1], *args)  # a too-short lse
    with pytest.raises(ValueError, match="out and dout"):
        OP_BWD(dout[:, :, :-1], q, k, v, out, lse, *args)
    with pytest.raises(TypeError, match="lse must be floating point"):
        OP_BWD(dout, q, k, v, out, lse.int(), *args)
    with pytest.raises(TypeError, match="one device"):
        OP_BWD(dout, q, k, v, out, lse.to("meta"), *args)


# ------------------------------------------------------------------------------------------------
# The drop-ins under torch.compile and autocast (the issue's second repro)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_layer_under_autocast(backend):
    torch.manual_seed(0)
    torch._dynamo.reset()
    layer = mt.MultiheadAttention(32, 2, batch_first=True).eval()
    x = torch.randn(2, 24, 32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, w = torch.compile(layer, backend=backend, fullgraph=True)(x, x, x)
        ref_layer = torch.nn.MultiheadAttention(32, 2, batch_first=True).eval()
        ref_layer.load_state_dict(layer.state_dict())
    # torch's module answers in the autocast dtype under autocast (issue 30), and so does mha's
    assert got.dtype == torch.bfloat16 and not torch.isnan(got).any()
    # The reference: torch's layer in float64 on the parameters autocast rounds to bfloat16.
    ref_layer = ref_layer.double()
    with torch.no_grad():
        for p in ref_layer.parameters():
            p.copy_(p.bfloat16().double())
        ref = ref_layer(x.bfloat16().double(), x.bfloat16().double(), x.bfloat16().double())[0]
    close(got, ref, 0.05)  # bfloat16 projections: a few bf16 ulps of the largest value


def test_compiled_sdpa_under_autocast():
    q, k, v = qkv(seed=8)
    f = torch.compile(lambda a, b, c: mt.scaled_dot_product_attention(a.bfloat16(), b, c),
                      backend="aot_eager", fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = f(q, k.bfloat16(), v.bfloat16())
    assert got.dtype == torch.bfloat16
    close(got, sdpa64(q.bfloat16(), k.bfloat16(), v.bfloat16()), TOL_OUT_REL + EPS[torch.bfloat16])


# ------------------------------------------------------------------------------------------------
# The eager drop-ins (torch.py -> _marshal.py / _fastcall.c)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_drop_ins_convert_float_dtypes(dtype):
    q, k, v = qkv(dtype=dtype, seed=9)
    got = mt.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert got.dtype == dtype
    close(got, sdpa64(q, k, v, causal=True), TOL_OUT_REL + EPS[dtype])
    torch.manual_seed(1)
    layer = mt.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(2, 8, 16).to(dtype)
    with torch.no_grad():
        got, _ = layer(x, x, x)  # the compiled fast path declines: the general path converts
        ref, _ = layer(x.float(), x.float(), x.float())
    assert got.dtype == dtype
    assert torch.equal(got, ref.to(dtype))


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_drop_ins_refuse_non_float(dtype):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="floating point"):
        mt.scaled_dot_product_attention(q.to(dtype), k, v)
    layer = mt.MultiheadAttention(16, 2, batch_first=True)
    x = torch.ones(1, 4, 16, dtype=dtype)
    with pytest.raises(TypeError, match="floating-point"):
        layer(x, x, x)


def test_drop_ins_non_contiguous_and_masks():
    torch.manual_seed(2)
    layer = mt.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(8, 2, 16).transpose(0, 1)  # [2, 8, 16], not contiguous
    with torch.no_grad():
        assert torch.equal(layer(x, x, x)[0], layer(x.contiguous(), x.contiguous(),
                                                    x.contiguous())[0])
        with pytest.raises(TypeError, match="only bool and floating types"):
            layer(x, x, x, attn_mask=torch.zeros(8, 8, dtype=torch.int32))
        with pytest.raises(RuntimeError, match="shape of the 2D attn_mask"):
            layer(x, x, x, attn_mask=torch.zeros(8, 7))
    q, k, v = qkv(seed=10)
    with pytest.raises(TypeError, match="only bool and floating types"):
        mt.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(16, 16, dtype=torch.int64))
    am = torch.randn(16, 16, dtype=torch.float64)
    close(mt.scaled_dot_product_attention(q, k, v, attn_mask=am), sdpa64(q, k, v, am), TOL_OUT_REL)
    # a learned bias passed as a mask: no gradient flows into masks, so it is refused while grad
    # mode is on (it was detached: bias.grad stayed None, where torch's sdpa trains it); detached
    # or under no_grad it is a constant
    bias = torch.randn(16, 16, requires_grad=True)
    with pytest.raises(ValueError, match="attn_mask requires grad"):
        mt.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    with pytest.raises(ValueError, match="attn_mask requires grad"):
        layer(x, x, x, attn_mask=bias[:8, :8])
    with torch.no_grad():
        close(mt.scaled_dot_product_attention(q, k, v, attn_mask=bias),
              sdpa64(q, k, v, bias.detach()), TOL_OUT_REL)
    mt.scaled_dot_product_attention(q, k, v, attn_mask=bias.detach())


def test_fastcall_declines_what_it_cannot_read():
    """_fastcall.layer_forward reads a C-contiguous native float32 [B, n, q_dim] / [n, q_dim]
    buffer only; anything else returns NotImplemented (the general path converts or raises)."""
    fast = _lib.fast
    assert fast is not None, "mha._fastcall is not built"
    from mha import _marshal as M
    rng = np.random.default_rng(0)
    w = {nm: rng.standard_normal((16, 16)).astype(np.float32) for nm in ("q", "k", "v", "o")}
    layer = mha.MultiheadAttention(w["q"], w["k"], w["v"], w["o"], num_heads=2)
    x = rng.standard_normal((2, 6, 16)).astype(np.float32)
    ok = fast.layer_forward(layer._ptr, x, 0, 1, None, None)
    assert isinstance(ok, np.ndarray) and ok.shape == (2, 6, 16)
    declined = [x.astype(np.float64), x.astype(np.float16), x.astype(np.int32),
                x.astype(">f4"), x[:, ::2], x.transpose(1, 0, 2), x[..., :8], x[0, 0],
                x[None], bytearray(x.tobytes())]
    for bad in declined:
        assert fast.layer_forward(layer._ptr, bad, 0, 1, None, None) is NotImplemented
    # The public call on each of them: converted (float; float16 is read as it is stored and
    # answered in: the float32 result rounded once) or refused (TypeError / ValueError).
    for bad in declined[:2] + declined[3:6]:
        want = layer.forward(np.array(bad, np.float32))
        if np.asarray(bad).dtype == np.float16:
            want = want.astype(np.float16)
        got = layer.forward(bad)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match="floating-point"):
        layer.forward(declined[2])
    with pytest.raises((ValueError, mha.MhaError)):
        layer.forward(x[..., :8])
    del M


# ------------------------------------------------------------------------------------------------
# The NumPy API (_api.py)
# ------------------------------------------------------------------------------------------------
def np_qkv(seed=0, B=1, h=2, n=8, m=8, d=4):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, h, L, d)).astype(np.float32) for L in (n, m, m))


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_numpy_converts_float_dtypes(dtype):
    """float64 is converted to float32 (a float32 result); float16 is a storage dtype: read as it
    is, the result in float16, the float32 call's result rounded once (tests/test_python_half.py
    has the rest)."""
    q, k, v = (a.astype(dtype) for a in np_qkv(1))
    got = mha.attention(q, k, v)
    want = mha.attention(*(a.astype(np.float32) for a in (q, k, v)))
    assert got.dtype == (np.float16 if dtype == np.float16 else np.float32)
    np.testing.assert_array_equal(got, want.astype(got.dtype))


@pytest.mark.parametrize("dtype", [np.int32, np.bool_, np.complex64, object, "U1"])
def test_numpy_refuses_non_float(dtype):
    q, k, v = np_qkv(2)
    bad = np.ones(q.shape, dtype=dtype) if dtype != "U1" else np.full(q.shape, "a")
    for args in ((bad, k, v), (q, k, bad)):
        with pytest.raises(TypeError, match="floating-point"):
            mha.attention(*args)


def test_numpy_masks_and_sizes():
    q, k, v = np_qkv(3)
    with pytest.raises(TypeError, match="bool or integer"):
        mha.attention(q, k, v, mask=np.ones((8, 8), np.complex64))
    with pytest.raises(TypeError, match="floating-point"):
        mha.attention(q, k, v, attn_bias=np.ones((8, 8), np.int32))
    with pytest.raises(mha.MhaError, match="does not broadcast"):
        mha.attention(q, k, v, mask=np.ones((8, 7), bool))
    with pytest.raises(ValueError, match="sinks"):
        mha.attention(q, k, v, sinks=np.zeros(1, np.float32))
    # a float mask is added: mask_means="block" was ignored (a 0/1 float mask "blocking" the
    # ones ran as the mask added, the output of mask_means="attend")
    with pytest.raises(ValueError, match="mask_means='block' with a float mask"):
        mha.attention(q, k, v, mask=np.eye(8, dtype=np.float32), mask_means="block")
    with pytest.raises(ValueError, match="do not agree"):
        mha.attention(q, k[..., :3], v)
    out, lse = mha.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="lse"):  # a too-short lse buffer
        mha.attention_backward(out, q, k, v, out, lse[:, :, :-1])
    if lse.shape[1] != lse.shape[2]:  # the right size in another shape (session 47: it was read
        with pytest.raises(ValueError, match="lse: expected shape"):  # as [B, h, n])
            mha.attention_backward(out, q, k, v, out, np.ascontiguousarray(lse.transpose(0, 2, 1)))
    with pytest.raises(ValueError, match="out and dout"):
        mha.attention_backward(out[:, :, :-1], q, k, v, out, lse)


def test_numpy_non_contiguous_and_read_only():
    q, k, v = np_qkv(4, n=8, m=8, d=4)
    ref = mha.attention(q, k, v)
    views = []
    for a in (q, k, v):
        big = np.zeros((2, 4, 16, 8), np.float32)
        big[1:, 1:3, ::2, 2:6] = a
        views.append(big[1:, 1:3, ::2, 2:6])
    np.testing.assert_array_equal(mha.attention(*views), ref)
    tr = [np.ascontiguousarray(a.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2) for a in (q, k, v)]
    np.testing.assert_array_equal(mha.attention(*tr), ref)  # last dimension strided: copied
    ro = [a.copy() for a in (q, k, v)]
    for a in ro:
        a.flags.writeable = False
    np.testing.assert_array_equal(mha.attention(*ro), ref)  # inputs are only read
    out = mha.attention(q, k, v)
    assert out.flags.writeable and out.flags.c_contiguous


def test_numpy_bfloat16_and_float8_converted():
    """ml_dtypes' bfloat16 / float8 arrays (kind 'V'; what np.asarray gives for JAX bfloat16) are
    floats: the core reads bfloat16 as it is (a bfloat16 result, the float32 result rounded
    once), float8 is converted to float32; additive masks of either are converted to float32;
    the layer reads bfloat16 input as it is too (its result the float32 one rounded once) and
    converts float8 input to float32; other 'V' dtypes (ml_dtypes' int4, a structured dtype) are refused."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = np_qkv(5)
    for dt in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn):
        r = [a.astype(dt) for a in (q, k, v)]
        got = mha.attention(*r)
        want = mha.attention(*(a.astype(np.float32) for a in r))
        assert got.dtype == (np.dtype(dt) if dt is ml_dtypes.bfloat16 else np.float32)
        if dt is ml_dtypes.bfloat16 and bf16_tiles_active():  # P rounded: the kernel's bound
            assert_tile_close(got.astype(np.float32), want, r[2].astype(np.float32))
            continue
        np.testing.assert_array_equal(got, want.astype(got.dtype))
    bias = np.random.default_rng(6).standard_normal((8, 8)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(mha.attention(q, k, v, mask=bias),
                                  mha.attention(q, k, v, attn_bias=bias.astype(np.float32)))
    np.testing.assert_array_equal(mha.attention(q, k, v, attn_bias=bias),
                                  mha.attention(q, k, v, attn_bias=bias.astype(np.float32)))
    for bad in (q.astype(ml_dtypes.int4), np.zeros(q.shape, [("a", np.float32)])):
        with pytest.raises(TypeError, match="floating-point"):
            mha.attention(bad, k, v)
    rng = np.random.default_rng(7)
    w = [rng.standard_normal((16, 16)).astype(np.float32) for _ in range(4)]
    layer = mha.MultiheadAttention(*w, num_heads=2)
    x = rng.standard_normal((2, 5, 16)).astype(ml_dtypes.bfloat16)
    got = layer.forward(x)
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(got, layer.forward(x.astype(np.float32)).astype(x.dtype))
    x8 = x.astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(layer.forward(x8), layer.forward(x8.astype(np.float32)))


def test_torch_layouts_and_traced_mask_dtypes():
    """Sparse and mkldnn tensors (no strided memory C could read) are refused with TypeError by
    the drop-ins; the traced layer refuses an integer mask as the eager one does (it was added
    to the scores as a float mask)."""
    q, k, v = qkv()
    layer = mt.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(1, 4, 16)
    for t in (q.to_sparse(), q.to_mkldnn()):
        with pytest.raises(TypeError, match="dense \\(strided\\)"):
            mt.scaled_dot_product_attention(t, k, v)
    for t in (x.to_sparse(), x.to_mkldnn()):
        with pytest.raises(TypeError, match="dense \\(strided\\)"):
            with torch.no_grad():
                layer(t, t, t)
    with pytest.raises(TypeError, match="dense \\(strided\\)"):
        mt.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(16, 16).to_sparse())
    f = torch.compile(layer, backend="eager", fullgraph=True)
    with torch.no_grad(), pytest.raises(Exception, match="only bool and floating types"):
        f(x, x, x, attn_mask=torch.zeros(4, 4, dtype=torch.int32))
    xi = torch.ones(1, 4, 16, dtype=torch.int32)  # converted by .to(float32) before
    with torch.no_grad(), pytest.raises(Exception, match="query must be a floating-point"):
        f(xi, xi, xi)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_opcheck_other_dtypes(dtype):
    """torch.library.opcheck with bfloat16 / float64 operands: the fake kernel's dtypes and shapes
    agree with the real one's, and the autograd formula's (what aot_eager checked and failed)."""
    q, k, v = (t.requires_grad_() for t in qkv(dtype=dtype, seed=11))
    add = torch.randn(16, 16, dtype=dtype)
    args = (q, k, v, None, add, True, 0.0, 0.0, None, True, False, 1)
    torch.library.opcheck(OP.default, args)


def test_compiled_layer_under_autocast_trains():
    """The backward of the compiled layer under autocast (aot_eager): bfloat16 gradients of the
    operator's operands flow back, finite and close to PyTorch's float64 layer."""
    torch.manual_seed(3)
    torch._dynamo.reset()
    layer = mt.MultiheadAttention(32, 2, batch_first=True)
    ref_layer = torch.nn.MultiheadAttention(32, 2, batch_first=True).double()
    ref_layer.load_state_dict(layer.state_dict())
    x = torch.randn(2, 12, 32).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.compile(layer, backend="aot_eager", fullgraph=True)(x, x, x,
                                                                       need_weights=False)[0]
    out.float().square().sum().backward()
    x64 = x.detach().bfloat16().double().requires_grad_()
    with torch.no_grad():
        for p in ref_layer.parameters():
            p.copy_(p.bfloat16().double())
    ref_layer(x64, x64, x64, need_weights=False)[0].square().sum().backward()
    assert x.grad.dtype == torch.float32
    close(x.grad, x64.grad, 0.1)  # bfloat16 projections forward and backward
    close(layer.in_proj_weight.grad, ref_layer.in_proj_weight.grad, 0.1)
