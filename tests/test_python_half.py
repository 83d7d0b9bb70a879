# SPDX-License-Identifier: MIT
"""Half precision through the Python faces of the attention core (issue 30, docs/PYTHON.md "Half
precision"): the NumPy API on float16 and ml_dtypes.bfloat16 arrays, torch.ops.mha.attention and
the SDPA drop-in on bfloat16/float16 tensors (eager, torch.compile, torch.autocast), and mha.jax
on bfloat16/float16 arrays through the FFI handler.

Every face hands the library its pointers with their storage dtype (no conversion in Python);
the library computes in float32 and rounds each output once. The oracle is PyTorch in float64 on
the SAME rounded inputs (q.to(bf16).double(), ...; the upstream gradient rounded too), forward
and gradients through torch's autograd, and the gate is tests/common/tolerance.h's half-precision
one, per output tensor:

    max|y - ref| <= (TOL_HALF_C * u_s + TOL_OUT_REL) * max|ref|,  u_s = 2^-8 (bf16), 2^-11 (f16)

(for mixed storage dtypes u_s is the coarsest one's). The dtype of every output is checked.
"""
import os
import sys
import tracemalloc

import numpy as np
import pytest

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ml_dtypes  # noqa: E402  (required: CI installs python/requirements-test.txt)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mha  # noqa: E402
import mha.torch as mt  # noqa: E402
from half_kernels import assert_tile_close, bf16_tiles_active  # noqa: E402
from mha import _torch_ops  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from tolerances import TOL_HALF_C, TOL_HALF_U_BF16, TOL_HALF_U_F16, TOL_OUT_REL  # noqa: E402

BF16_NP = np.dtype(ml_dtypes.bfloat16)
F16_NP = np.dtype(np.float16)
TORCH_OF = {BF16_NP: torch.bfloat16, F16_NP: torch.float16, np.dtype(np.float32): torch.float32}
U = {torch.bfloat16: TOL_HALF_U_BF16, torch.float16: TOL_HALF_U_F16, torch.float32: 0.0}
HALVES = [torch.bfloat16, torch.float16]
B, H, N, M, D, DV = 2, 4, 37, 45, 32, 24

# The option sets of the test matrix: (name, kv heads, causal, bool mask, key padding).
CASES = [("plain", H, False, False, False), ("causal", H, True, False, False),
         ("bool_mask", H, False, True, False), ("key_padding", H, False, False, True),
         ("gqa_causal_mask_padding", 2, True, True, True)]


def bound(ref: torch.Tensor, *dtypes) -> float:
    """The half tolerance of an output whose inputs/storage are `dtypes`: the coarsest u_s."""
    return (TOL_HALF_C * max(U[d] for d in dtypes) + TOL_OUT_REL) * ref.abs().max().item()


def close(got, ref: torch.Tensor, *dtypes, what=""):
    g = torch.as_tensor(np.asarray(got, np.float64)) if not isinstance(got, torch.Tensor) \
        else got.double()
    err, tol = (g - ref).abs().max().item(), bound(ref, *dtypes)
    assert err <= tol, f"{what}: max|y - ref| = {err:.3e} > {tol:.3e}"


def make(case, dtype, seed=0):
    """(q, k, v, dout) rounded to dtype, the bool mask [n, m] (True = attend) or None, the key
    padding [B, m] (True = real key) or None, and the case's causal flag and kv heads."""
    _, g, causal, use_mask, use_pad = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=gen).to(dtype)
    k = torch.randn(B, g, M, D, generator=gen).to(dtype)
    v = torch.randn(B, g, M, DV, generator=gen).to(dtype)
    dout = torch.randn(B, H, N, DV, generator=gen).to(dtype)
    mask = pad = None
    if use_mask:
        mask = torch.rand(N, M, generator=gen) > 0.3
        mask[:, 0] = True  # no fully masked row (mha gives 0 there, torch NaN)
    if use_pad:
        pad = torch.ones(B, M, dtype=torch.bool)
        pad[1, M - 9:] = False
    return q, k, v, dout, mask, pad, causal


def visible(mask, pad, causal):
    """The combined attend mask [B, 1, n, m] the reference applies (None: everything)."""
    keep = torch.ones(B, 1, N, M, dtype=torch.bool)
    if causal:  # top-left: key j visible from query i iff j <= i (PyTorch's is_causal)
        keep &= torch.ones(N, M, dtype=torch.bool).tril()
    if mask is not None:
        keep &= mask
    if pad is not None:
        keep &= pad[:, None, None, :]
    return keep


def reference(q, k, v, dout, keep):
    """float64 attention on the given (rounded) values: out, and (dq, dk, dv) by autograd."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(group, dim=1) for t in (k64, v64))
    s = q64 @ kk.transpose(-1, -2) / D ** 0.5
    s = s.masked_fill(~keep, float("-inf"))
    out = torch.softmax(s, -1) @ vv
    out.backward(dout.double())
    return out.detach(), (q64.grad, k64.grad, v64.grad)


def np_of(t: torch.Tensor) -> np.ndarray:
    """A torch tensor as a NumPy array of the same storage dtype (bfloat16: ml_dtypes')."""
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16_NP)
    return t.numpy()


# ------------------------------------------------------------------------------------------------
# The NumPy API
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_numpy_forward_backward(case, dtype):
    q, k, v, dout, mask, pad, causal = make(case, dtype)
    ref, ref_grads = reference(q, k, v, dout, visible(mask, pad, causal))
    opts = dict(causal="top-left" if causal else False,
                mask=None if mask is None else mask.numpy(),
                key_padding_mask=None if pad is None else pad.numpy())
    qn, kn, vn, don = (np_of(t) for t in (q, k, v, dout))
    out, lse, probs = mha.attention(qn, kn, vn, return_lse=True, need_weights=True, **opts)
    assert (out.dtype, lse.dtype, probs.dtype) == (qn.dtype, np.float32, np.float32)
    close(out, ref, dtype, what="out")
    grads = mha.attention_backward(don, qn, kn, vn, out, lse, **opts)
    for g, t, r, nm in zip(grads, (qn, kn, vn), ref_grads, ("dq", "dk", "dv")):
        assert g.dtype == t.dtype, nm
        # The backward reads out as stored (rounded once), as every face does.
        close(g, r, dtype, what=nm)


def test_numpy_mixed_dtypes_and_layouts():
    """q bfloat16, k float16, v float32: out in q's dtype, each gradient in its operand's; a
    [B, L, h, d] (blhd) strided view is read in place; float64 is still converted to float32."""
    case = CASES[1]
    q, _, _, dout, _, _, _ = make(case, torch.bfloat16, seed=1)
    _, k, _, _, _, _, _ = make(case, torch.float16, seed=1)
    _, _, v, _, _, _, _ = make(case, torch.float32, seed=1)
    keep = visible(None, None, True)
    ref, ref_grads = reference(q, k, v, dout, keep)
    qn, kn, vn = np_of(q), np_of(k), np_of(v)
    out, lse = mha.attention(qn, kn, vn, causal="top-left", return_lse=True)
    assert out.dtype == BF16_NP
    close(out, ref, torch.bfloat16, torch.float16, what="out")
    grads = mha.attention_backward(np_of(dout), qn, kn, vn, out, lse, causal="top-left")
    assert [g.dtype for g in grads] == [BF16_NP, F16_NP, np.dtype(np.float32)]
    for g, r, nm in zip(grads, ref_grads, ("dq", "dk", "dv")):
        close(g, r, torch.bfloat16, torch.float16, what=nm)
    blhd = [a.transpose(0, 2, 1, 3) for a in (qn, kn, vn)]  # views, not copies
    got = mha.attention(*blhd, layout="blhd", causal="top-left")
    assert got.dtype == BF16_NP
    np.testing.assert_array_equal(got.transpose(0, 2, 1, 3), out)
    assert mha.attention(qn.astype(np.float64), kn, vn).dtype == np.float32


@pytest.mark.parametrize("np_dtype", [BF16_NP, F16_NP])
def test_numpy_equals_float32_call_rounded_once(np_dtype):
    """The half call is the float32 call on the widened values with the output rounded once
    (bit for bit): no intermediate is rounded to the storage dtype."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 3, 19, 16)).astype(np_dtype) for _ in range(3))
    got = mha.attention(q, k, v, causal=True)
    want = mha.attention(*(a.astype(np.float32) for a in (q, k, v)), causal=True)
    assert got.dtype == np_dtype
    if np_dtype == BF16_NP and bf16_tiles_active():  # P is rounded: the kernel's own bound
        assert_tile_close(got.astype(np.float32), want, v.astype(np.float32))
        return
    np.testing.assert_array_equal(got, want.astype(np_dtype))


def test_numpy_half_is_not_converted():
    """The half operands reach the library as they are: the call allocates its output (as large
    as one operand here) and nothing like a float32 copy (twice the operands' bytes each)."""
    a = np.random.default_rng(3).standard_normal((1, 8, 512, 64)).astype(BF16_NP)
    mha.attention(a, a, a)  # (the first call may allocate the process's pools and caches)
    tracemalloc.start()
    try:
        out = mha.attention(a, a, a)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.dtype == BF16_NP and out.nbytes == a.nbytes
    assert peak < 1.5 * a.nbytes, f"{peak} bytes allocated for a {a.nbytes}-byte output"


# ------------------------------------------------------------------------------------------------
# torch.ops.mha.attention and the SDPA drop-in
# ------------------------------------------------------------------------------------------------
OP = torch.ops.mha.attention


def op_attend(mask, pad):
    """The operator's bool attend mask for the case (broadcasting to [B, h, n, m]), or None."""
    if mask is None and pad is None:
        return None
    keep = torch.ones(B, 1, N, M, dtype=torch.bool)
    if mask is not None:
        keep &= mask
    if pad is not None:
        keep &= pad[:, None, None, :]
    return keep


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_torch_operator(case, dtype):
    q, k, v, dout, mask, pad, causal = make(case, dtype)
    ref, ref_grads = reference(q, k, v, dout, visible(mask, pad, causal))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse, probs = OP(qg, kg, vg, op_attend(mask, pad), None, causal, 0.0, 0.0, None, True,
                         False, 0)
    assert (out.dtype, lse.dtype, probs.dtype) == (dtype, torch.float32, dtype)
    close(out, ref, dtype, what="out")
    out.backward(dout)
    for t, r, nm in zip((qg, kg, vg), ref_grads, ("dq", "dk", "dv")):
        assert t.grad.dtype == dtype, nm
        close(t.grad, r, dtype, what=nm)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_torch_sdpa_dropin(case, dtype):
    q, k, v, dout, mask, pad, causal = make(case, dtype, seed=3)
    ref, ref_grads = reference(q, k, v, dout, visible(mask, pad, causal))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    attend = op_attend(mask, pad)
    if causal and attend is not None:  # (PyTorch's SDPA takes a mask or is_causal, not both)
        attend, causal = visible(mask, pad, causal), False
    out = mt.scaled_dot_product_attention(qg, kg, vg, attn_mask=attend, is_causal=causal,
                                          enable_gqa=case[1] != H)
    assert out.dtype == dtype
    close(out, ref, dtype, what="out")
    out.backward(dout)
    for t, r, nm in zip((qg, kg, vg), ref_grads, ("dq", "dk", "dv")):
        assert t.grad.dtype == dtype, nm
        close(t.grad, r, dtype, what=nm)


def test_torch_half_is_read_natively():
    """The operator's bf16 result is the float32 call's rounded once, bit for bit, and the
    gradients of a bf16 call are those of the float32 backward on the same stored values (out as
    the bf16 call stored it) rounded once: nothing is rounded in between."""
    q, k, v, dout, _, _, _ = make(CASES[1], torch.bfloat16, seed=4)
    out, lse, _ = OP(q, k, v, None, None, True, 0.0, 0.0, None, False, False, 0)
    out32, lse32, _ = OP(q.float(), k.float(), v.float(), None, None, True, 0.0, 0.0, None, False,
                         False, 0)
    if bf16_tiles_active():  # P is rounded, scores summed in another order: the kernel's bound
        assert_tile_close(out.float().numpy(), out32.numpy(), v.float().numpy())
        assert torch.allclose(lse, lse32, rtol=0, atol=TOL_OUT_REL * float(lse32.abs().max()))
    else:
        assert torch.equal(out, out32.bfloat16()) and torch.equal(lse, lse32)
    bw = torch.ops.mha.attention_backward
    grads = bw(dout, q, k, v, out, lse, None, None, True, 0.0, 0.0, None, 0)
    grads32 = bw(dout.float(), q.float(), k.float(), v.float(), out.float(), lse, None, None,
                 True, 0.0, 0.0, None, 0)
    for g, g32 in zip(grads, grads32):
        assert g.dtype == torch.bfloat16 and torch.equal(g, g32.bfloat16())


class _OpLog(TorchDispatchMode):
    """Records the aten operators dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_torch_half_is_not_converted():
    """The operator's implementation and the drop-in on bf16 tensors run no conversion (no
    aten._to_copy): the library reads the tensors and writes out as they are stored."""
    q, k, v, _, _, _, _ = make(CASES[4], torch.bfloat16, seed=9)
    calls = (lambda: _torch_ops._attention_op(q, k, v, None, None, True, 0.0, 0.0, None, False,
                                              False, 0),
             lambda: mt.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    for call in calls:
        with _OpLog() as log:
            call()
        assert log.ops and not [op for op in log.ops if "_to_copy" in op], log.ops


@pytest.mark.parametrize("dtype", HALVES)
def test_torch_compile_fullgraph_equals_eager(dtype):
    """torch.compile(fullgraph=True) of a function calling the operator (and of the drop-in) on
    half tensors gives the eager result, forward and gradients, bit for bit."""
    torch._dynamo.reset()
    q, k, v, dout, mask, pad, _ = make(CASES[4], dtype, seed=5)
    attend = op_attend(mask, pad)

    def f(a, b, c):
        return OP(a, b, c, attend, None, True, 0.0, 0.0, None, False, False, 0)[0]

    def g(a, b, c):
        return mt.scaled_dot_product_attention(a, b, c, attn_mask=visible(mask, pad, True),
                                               enable_gqa=True)

    for fn in (f, g):
        runs = []
        for run in (fn, torch.compile(fn, fullgraph=True)):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = run(*leaves)
            out.backward(dout)
            runs.append([out] + [t.grad for t in leaves])
        for eager, compiled in zip(*runs):
            assert compiled.dtype == dtype and torch.equal(eager, compiled)


# ------------------------------------------------------------------------------------------------
# torch.autocast
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cast", HALVES)
def test_autocast_matches_torch_sdpa_dtypes(cast):
    """Under torch.autocast('cpu', dtype=cast) the operator and the drop-in give what torch's
    scaled_dot_product_attention gives: float32 operands computed in `cast` (out in `cast`, the
    result of the call on q.to(cast), ... bit for bit), float64 ones left alone; the float32
    leaves get float32 gradients, as torch's."""
    q, k, v, dout, _, _, _ = make(CASES[0], torch.float32, seed=6)
    want_out = OP(q.to(cast), k.to(cast), v.to(cast), None, None, True, 0.0, 0.0, None, False,
                  False, 0)[0]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=cast):
        torch_dtype = F.scaled_dot_product_attention(q, k, v).dtype
        torch_dtype64 = F.scaled_dot_product_attention(q.double(), k.double(), v.double()).dtype
        out = OP(*leaves, None, None, True, 0.0, 0.0, None, False, False, 0)[0]
        drop = mt.scaled_dot_product_attention(q, k, v, is_causal=True)
        drop64 = mt.scaled_dot_product_attention(q.double(), k.double(), v.double())
        op64 = OP(q.double(), k.double(), v.double(), None, None, False, 0.0, 0.0, None, False,
                  False, 0)[0]
    assert torch_dtype == cast and torch_dtype64 == torch.float64
    assert out.dtype == cast and drop.dtype == cast
    assert drop64.dtype == torch.float64 and op64.dtype == torch.float64
    assert torch.equal(out, want_out) and torch.equal(drop, want_out)
    out.backward(dout.to(cast))
    assert all(t.grad.dtype == torch.float32 for t in leaves)
    ref, ref_grads = reference(*(t.to(cast) for t in (q, k, v)), dout.to(cast),
                               visible(None, None, True))
    close(out, ref, cast, what="out")
    for t, r, nm in zip(leaves, ref_grads, ("dq", "dk", "dv")):
        close(t.grad, r, cast, what=nm)


def test_autocast_compiled_equals_eager():
    """torch.compile(fullgraph=True) under autocast (bf16) gives the eager autocast result: the
    operator's autocast rule is traced like torch's own ops'."""
    torch._dynamo.reset()
    q, k, v, dout, _, _, _ = make(CASES[0], torch.float32, seed=7)

    def f(a, b, c):
        return OP(a, b, c, None, None, True, 0.0, 0.0, None, False, False, 0)[0]

    runs = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(*leaves)
        out.backward(dout.bfloat16())
        runs.append([out] + [t.grad for t in leaves])
    assert runs[1][0].dtype == torch.bfloat16
    for eager, compiled in zip(*runs):
        assert eager.dtype == compiled.dtype and torch.equal(eager, compiled)


# ------------------------------------------------------------------------------------------------
# mha.jax (the FFI handler CMake built: MHA_JAX_FFI, set by ctest)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def jx():
    if not os.environ.get("MHA_JAX_FFI"):
        pytest.skip("MHA_JAX_FFI is not set (the handler is built by CMake; ctest sets it)")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    import mha.jax
    return jax, jnp, mha.jax


@pytest.mark.parametrize("dtype", HALVES)
def test_jax_half_through_the_handler(jx, dtype):
    """bf16/f16 arrays reach the handler as they are (the lowered program converts nothing), out
    and the gradients come back in the operands' dtypes, within the half tolerance."""
    jax, jnp, mj = jx
    q, k, v, dout, mask, pad, causal = make(CASES[4], dtype, seed=8)
    ref, ref_grads = reference(q, k, v, dout, visible(mask, pad, causal))
    jdt = jnp.bfloat16 if dtype is torch.bfloat16 else jnp.float16
    # JAX's layout is [B, T, N, H].
    qj, kj, vj, dj = (jnp.asarray(np_of(t.transpose(1, 2).contiguous())).astype(jdt)
                      for t in (q, k, v, dout))
    mj_mask = jnp.asarray(mask.numpy())[None, None]
    lengths = jnp.asarray(pad.sum(-1).numpy().astype(np.int32))

    def f(a, b, c):
        return mj.dot_product_attention(a, b, c, mask=mj_mask, is_causal=True,
                                        key_value_seq_lengths=lengths)

    out, vjp = jax.vjp(jax.jit(f), qj, kj, vj)
    assert out.dtype == jdt
    close(np.asarray(out.astype(jnp.float32)).transpose(0, 2, 1, 3), ref, dtype, what="out")
    grads = vjp(dj)
    for g, r, nm in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert g.dtype == jdt, nm
        close(np.asarray(g.astype(jnp.float32)).transpose(0, 2, 1, 3), r, dtype, what=nm)
    # The program hands its half arguments to the handler as they are: no convert anywhere.
    hlo = jax.jit(f).lower(qj, kj, vj).as_text()
    assert "custom_call @mha_attention_forward(%arg0, %arg1, %arg2," in hlo
    assert "convert" not in hlo


@pytest.mark.parametrize("dtype", HALVES)
def test_jax_half_bias_gradient(jx, dtype):
    """The float32 bias's gradient with bf16/f16 q, k, v: dS = P (dP - D) in float32, as the
    library's own dS (until session 48 dP = dO V and D = dO . O were rounded to the operands'
    dtype and cancelled: max|dbias - ref| was 5.5e-3 (bf16) and 1.3e-3 (f16) of max|ref| here).
    Reference: float64 on the same rounded values, D = dO . O with O as mha returned it (the
    library's D reads the output as stored, docs/TRAINING.md); gate: the float32 one,
    TOL_OUT_REL max|ref|."""
    jax, jnp, mj = jx
    q, k, v, dout, mask, pad, causal = make(CASES[4], dtype, seed=9)
    gen = torch.Generator().manual_seed(19)
    bias = torch.randn(1, H, N, M, generator=gen)
    jdt = jnp.bfloat16 if dtype is torch.bfloat16 else jnp.float16
    qj, kj, vj, dj = (jnp.asarray(np_of(t.transpose(1, 2).contiguous())).astype(jdt)
                      for t in (q, k, v, dout))

    def f(a, b, c, bb):
        return mj.dot_product_attention(a, b, c, bb, is_causal=True)

    out, vjp = jax.vjp(jax.jit(f), qj, kj, vj, jnp.asarray(bias.numpy()))
    dbias = torch.from_numpy(np.asarray(vjp(dj)[3], np.float64))
    group = H // k.shape[1]
    kk, vv = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    s = q.double() @ kk.transpose(-1, -2) / D ** 0.5 + bias.double()
    s = s.masked_fill(~visible(None, None, True), float("-inf"))
    p = torch.softmax(s, -1)
    o_stored = torch.from_numpy(np.asarray(out.astype(jnp.float32), np.float64)).transpose(1, 2)
    dp = dout.double() @ vv.transpose(-1, -2)
    ref = (p * (dp - (dout.double() * o_stored).sum(-1, keepdim=True))).sum(0, keepdim=True)
    close(dbias, ref, torch.float32, what="dbias")
