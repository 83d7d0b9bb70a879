# SPDX-License-Identifier: MIT
"""Half precision through the Python faces of the LAYER (issue 30, docs/PYTHON.md "Half
precision"): mha.torch.MultiheadAttention with bfloat16/float16 parameters and inputs, and under
torch.autocast('cpu'); the NumPy mha.MultiheadAttention with float16 / ml_dtypes.bfloat16 weights
and inputs.

The library reads the weights and inputs in their storage dtype, computes in float32 and rounds
each output once (docs/SEMANTICS.md "Half precision in the layer"). The oracle is torch's
nn.MultiheadAttention in float64 (or, for GQA, the same layer in float64 torch ops) with the SAME
rounded weights and inputs (and the same rounded upstream gradient), forward and gradients through
torch's autograd; the gate is tests/common/tolerance.h's half-precision one, per tensor:

    max|y - ref| <= (TOL_HALF_C * u_s + TOL_OUT_REL) * max|ref|,  u_s = 2^-8 (bf16), 2^-11 (f16)

with u_s = 0 for a tensor the library returns in float32 (autocast's weight gradients, the
NumPy layer's parameter gradients: only the float32 error is left). A half module (inputs and
weights in the same half dtype: a bf16/f16 module, autocast) stores Q, K, V and the attention
output in that dtype: the NumPy GQA oracle rounds them too (ste, straight through in the
backward); where the oracle is torch's unrounded float64 module, the float32 gradients get
TOL_HALF_LAYER_GRAD_C u_s more (tolerance.h). The bit-exact check of those roundings (and that
a missing one fails) is tests/test_half_layer.c's twin. Output and gradient dtypes
are checked against torch's own module under the same autocast.
"""
import os
import sys

import numpy as np
import pytest

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ml_dtypes  # noqa: E402  (required: CI installs python/requirements-test.txt)
import test_python_api  # noqa: E402,F401  (builds mha._fastcall before mha is imported)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mha  # noqa: E402
import mha.torch as mt  # noqa: E402
from tolerances import (TOL_HALF_C, TOL_HALF_LAYER_GRAD_C, TOL_HALF_LAYER_TILE_C,  # noqa: E402
                        TOL_HALF_U_BF16, TOL_HALF_U_F16, TOL_OUT_REL)

BF16_NP = np.dtype(ml_dtypes.bfloat16)
U = {torch.bfloat16: TOL_HALF_U_BF16, torch.float16: TOL_HALF_U_F16, torch.float32: 0.0}
HALVES = [torch.bfloat16, torch.float16]
E, H, N, S, KDIM, VDIM, BATCH = 64, 4, 29, 37, 48, 40, 2

# (name, cross-attention with kdim/vdim, is_causal, bool attn_mask, key padding)
CASES = [("self", False, False, False, False), ("causal", False, True, False, False),
         ("attn_mask", False, False, True, False), ("key_padding", False, False, False, True),
         ("cross_mask_padding", True, False, True, True)]


def bound(ref: torch.Tensor, dtype) -> float:
    return (TOL_HALF_C * U[dtype] + TOL_OUT_REL) * ref.abs().max().item()


def close(got: torch.Tensor, ref: torch.Tensor, dtype, what: str, scale=None, act=None,
          c_act=TOL_HALF_LAYER_GRAD_C) -> None:
    """The half gate relative to max|ref|, or to max|scale| (a reference that is 0); act: a half
    module's intermediate dtype, adding c_act u_a (tolerance.h: TOL_HALF_LAYER_*)."""
    top = (ref if scale is None else scale).abs().max().item()
    err = (got.double() - ref).abs().max().item()
    tol = bound(ref if scale is None else scale, dtype) + (c_act * U[act] * top if act else 0.0)
    assert err <= tol, f"{what}: max|y - ref| = {err:.3e} > {tol:.3e}"


def make(case, seed=0):
    """(query, key, value, attn_mask, key_padding_mask, is_causal) in float32, batch_first;
    masks in torch's polarity (True = not allowed / padding), no fully masked row."""
    _, cross, causal, use_mask, use_pad = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, N, E, generator=gen)
    m = S if cross else N
    k = torch.randn(BATCH, m, KDIM if cross else E, generator=gen) if cross else q
    v = torch.randn(BATCH, m, VDIM if cross else E, generator=gen) if cross else q
    am = kp = None
    if use_mask:
        am = torch.rand(N, m, generator=gen) < 0.3
        am[:, 0] = False
    if causal:  # torch's module needs the mask with is_causal; mha is given is_causal alone
        am = torch.ones(N, m, dtype=torch.bool).triu(1)
    if use_pad:
        kp = torch.zeros(BATCH, m, dtype=torch.bool)
        kp[1, m - 7:] = True
    return q, k, v, am, kp, causal


def cast(ts, fn):
    """fn of each tensor (None and bool masks kept), keeping which of them are the same tensor
    (self-attention's query is key is value)."""
    done = {}
    for t in ts:
        if t is not None and t.is_floating_point() and id(t) not in done:
            done[id(t)] = fn(t)
    return [done.get(id(t), t) for t in ts]


def modules(case, dtype, seed=1):
    """(mha module in dtype, torch's nn.MultiheadAttention in float64 with the same rounded
    parameters); biases made nonzero so their gradients mean something."""
    cross = case[1]
    kw = dict(kdim=KDIM, vdim=VDIM) if cross else {}
    torch.manual_seed(seed)
    ours = mt.MultiheadAttention(E, H, batch_first=True, dtype=dtype, **kw)
    with torch.no_grad():
        for p in ours.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape) * 0.1)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64, **kw)
    ref.load_state_dict({k: t.double() for k, t in ours.state_dict().items()})
    return ours, ref


def run(mod, q, k, v, am, kp, causal, dy, mha_call: bool):
    """Forward (attn output, averaged weights) and gradients of (query[, key, value]) and the
    parameters for upstream gradient dy. mha is given is_causal without a mask (its rule), torch
    the mask with the hint."""
    ins = [t.detach().clone().requires_grad_() for t in ((q,) if k is q else (q, k, v))]
    qq, kk, vv = (ins * 3) if len(ins) == 1 else ins
    if mha_call and causal:
        y, w = mod(qq, kk, vv, key_padding_mask=kp, is_causal=True)
    else:
        y, w = mod(qq, kk, vv, key_padding_mask=kp, attn_mask=am, is_causal=causal)
    y.backward(dy.to(y.dtype))
    return y.detach(), w.detach(), [t.grad for t in ins], \
        {n: p.grad for n, p in mod.named_parameters()}


# ------------------------------------------------------------------------------------------------
# mha.torch.MultiheadAttention with half parameters and inputs
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_half_module_vs_float64(case, dtype):
    q, k, v, am, kp, causal = make(case)
    q, k, v = cast((q, k, v), lambda t: t.to(dtype))
    ours, ref = modules(case, dtype)
    dy = torch.randn(BATCH, N, E, generator=torch.Generator().manual_seed(7)).to(dtype)
    y, w, gin, gp = run(ours, q, k, v, am, kp, causal, dy, True)
    y64, w64, gin64, gp64 = run(ref, *cast((q, k, v, am, kp), torch.Tensor.double), causal,
                                dy.double(), False)
    assert y.dtype is dtype and w.dtype is dtype  # torch's module gives both in its dtype
    close(y, y64, dtype, "output")
    close(w, w64, dtype, "weights")
    for i, (g, g64) in enumerate(zip(gin, gin64)):
        assert g.dtype is dtype
        close(g, g64, dtype, f"d input {i}")
    for n, g in gp.items():
        assert g.dtype is dtype, n  # each parameter gets its own dtype's gradient
        close(g, gp64[n], dtype, f"d {n}")


@pytest.mark.parametrize("dtype", HALVES)
def test_half_module_keeps_its_dtype(dtype):
    """dtype= and .to() keep the parameters in the half dtype (the C layer too), after a step of
    an optimizer as well; the C layer's weights are the parameters' bits."""
    m = mt.MultiheadAttention(E, H, batch_first=True).to(dtype)
    assert all(p.dtype is dtype for p in m.parameters())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(BATCH, N, E).to(dtype)
    for _ in range(2):
        y, _ = m(x, x, x, need_weights=False)
        y.float().square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert all(p.dtype is dtype for p in m.parameters())
    m(x, x, x)
    assert m._layer.config.weight_dtype == {torch.bfloat16: "bfloat16",
                                            torch.float16: "float16"}[dtype]
    w = m._layer.weights["w_q"]
    got = torch.from_numpy(np.asarray(w, np.float32))
    assert torch.equal(got, m.in_proj_weight.detach()[:E].float())


@pytest.mark.parametrize("dtype", HALVES)
def test_half_module_inference_equals_training_forward(dtype, monkeypatch):
    """The inference path (no autograd node: the compiled fast path, given the storage dtype)
    and the training forward give the same bits, and the output's dtype is the input's."""
    case = CASES[0]
    q, _, _, _, _, _ = make(case, seed=3)
    x = q.to(dtype)
    ours, _ = modules(case, dtype)
    fast, calls = mt._fast, []
    assert fast is not None, "mha._fastcall is not built: the fast path is not tested"

    class Spy:
        def layer_call(self, *args):
            calls.append(args[-1])
            return fast.layer_call(*args)

    monkeypatch.setattr(mt, "_fast", Spy())
    with torch.no_grad():
        y0, w0 = ours(x, x, x)
    codes = {torch.bfloat16: mha._lib.DTYPE_BF16, torch.float16: mha._lib.DTYPE_F16}
    assert calls == [codes[dtype]]  # served by the fast path, told the dtype
    y1, w1 = ours(x, x, x.clone())  # (not the same tensor: the general path, with autograd)
    assert y0.dtype is dtype and w0.dtype is dtype
    assert torch.equal(y0, y1.detach()) and torch.equal(w0, w1.detach())


def test_float32_module_reads_half_input_natively():
    """A float32 module given bfloat16 input reads it as it is (x_dtype) and writes its output in
    it: the float32 layer on the widened input, rounded once (torch's module refuses the mix)."""
    ours, _ = modules(CASES[0], torch.float32)
    x = make(CASES[0], seed=4)[0].to(torch.bfloat16)
    with torch.no_grad():
        y, _ = ours(x, x, x, need_weights=False)
        y32, _ = ours(x.float(), x.float(), x.float(), need_weights=False)
    assert y.dtype is torch.bfloat16
    assert torch.equal(y, y32.to(torch.bfloat16))


def test_bad_parameter_dtypes():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        mt.MultiheadAttention(E, H, dtype=torch.float64)
    m = mt.MultiheadAttention(E, H, batch_first=True)
    m.out_proj.to(torch.bfloat16)  # in_proj float32, out_proj bfloat16
    x = torch.randn(1, 4, E)
    with pytest.raises(TypeError, match="share one dtype"):
        m(x, x, x)


# ------------------------------------------------------------------------------------------------
# torch.autocast('cpu') with float32 parameters
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_autocast_vs_float64(case, dtype):
    """Under autocast the layer reads the inputs and the weights rounded to the autocast dtype
    (as torch's autocast runs its linear ops) and writes its output in it; the float64 oracle
    runs on those rounded values. Input gradients are rounded once to the autocast dtype (then
    widened by autograd to the float32 inputs'), weight gradients are float32 (not rounded)."""
    q, k, v, am, kp, causal = make(case, seed=11)
    ours, ref = modules(case, torch.float32, seed=12)
    ref.load_state_dict({n: t.to(dtype).double() for n, t in ours.state_dict().items()})
    dy = torch.randn(BATCH, N, E, generator=torch.Generator().manual_seed(13)).to(dtype)
    with torch.autocast("cpu", dtype=dtype):
        y, w, gin, gp = run(ours, q, k, v, am, kp, causal, dy, True)
    y64, w64, gin64, gp64 = run(ref, *cast((q, k, v, am, kp), lambda t: t.to(dtype).double()),
                                causal, dy.double(), False)
    assert y.dtype is dtype and w.dtype is dtype
    close(y, y64, dtype, "output")
    close(w, w64, dtype, "weights")
    for i, (g, g64) in enumerate(zip(gin, gin64)):
        assert g.dtype is torch.float32
        close(g, g64, dtype, f"d input {i}")
    for n, g in gp.items():
        assert g.dtype is torch.float32, n
        # Autocast makes a half module (inputs and weights both in dtype): its intermediates are
        # rounded, which torch's float64 module does not do, so the float32 gradients carry
        # those roundings (tolerance.h, TOL_HALF_LAYER_GRAD_C u_a).
        close(g, gp64[n], torch.float32, f"d {n}", act=dtype)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("need_weights", [True, False])
def test_autocast_dtypes_equal_torch(dtype, param_dtype, need_weights):
    """Output, attention weights, input and parameter gradient dtypes under autocast are those of
    torch's nn.MultiheadAttention under the same autocast (float32 or bfloat16 parameters,
    float32 input), in training and in inference."""
    got = {}
    for cls in (mt.MultiheadAttention, torch.nn.MultiheadAttention):
        torch.manual_seed(0)
        m = cls(E, H, batch_first=True, dtype=param_dtype)
        x = torch.randn(BATCH, N, E, requires_grad=True)
        with torch.autocast("cpu", dtype=dtype):
            y, w = m(x, x, x, need_weights=need_weights)
            m.eval()
            with torch.no_grad():
                yi, wi = m(x, x, x, need_weights=need_weights)
        y.float().sum().backward()
        got[cls] = (y.dtype, None if w is None else w.dtype, yi.dtype,
                    None if wi is None else wi.dtype, x.grad.dtype,
                    tuple((n, p.grad.dtype) for n, p in m.named_parameters()))
    assert got[mt.MultiheadAttention] == got[torch.nn.MultiheadAttention]


@pytest.mark.parametrize("dtype", HALVES)
def test_autocast_compiled_equals_eager(dtype):
    """torch.compile(fullgraph=True) with autocast: the traced path (torch's linear ops, which
    round Q, K, V and the attention output to the autocast dtype, and the operator) gives the
    eager result within the half tolerance of those extra roundings (4 of them, each <= u_s
    relative: 4 TOL_HALF_C u_s max|y|), with the same output dtype, and trains (float32 input
    and weight gradients)."""
    torch._dynamo.reset()
    case = CASES[3]
    q, _, _, _, kp, _ = make(case, seed=21)
    ours, _ = modules(case, torch.float32, seed=22)

    def f(x):
        with torch.autocast("cpu", dtype=dtype):
            return ours(x, x, x, key_padding_mask=kp, need_weights=False)[0]

    outs = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        x = q.clone().requires_grad_()
        y = fn(x)
        y.float().sum().backward()
        assert y.dtype is dtype and x.grad.dtype is torch.float32
        assert ours.in_proj_weight.grad.dtype is torch.float32
        outs.append((y.detach().double(), x.grad.double()))
        ours.zero_grad()
    (y0, g0), (y1, g1) = outs
    for a, b, what in ((y0, y1, "output"), (g0, g1, "d query")):
        err = (a - b).abs().max().item()
        tol = 4 * TOL_HALF_C * U[dtype] * a.abs().max().item()
        assert err <= tol, f"{what}: compiled vs eager {err:.3e} > {tol:.3e}"


@pytest.mark.parametrize("dtype", HALVES)
def test_half_module_compiled_equals_eager(dtype):
    """torch.compile(fullgraph=True) of a half module (no autocast): the traced path computes in
    float32 on the widened parameters and inputs and rounds the output once, as the eager layer."""
    torch._dynamo.reset()
    case = CASES[0]
    x = make(case, seed=23)[0].to(dtype)
    ours, ref = modules(case, dtype, seed=24)

    def f(t):
        return ours(t, t, t, need_weights=False)[0]

    with torch.no_grad():
        y0, y1 = f(x), torch.compile(f, fullgraph=True)(x)
        y64 = ref(*(x.double(),) * 3, need_weights=False)[0]
    assert y0.dtype is dtype and y1.dtype is dtype
    close(y0, y64, dtype, "eager")
    close(y1, y64, dtype, "compiled")


# ------------------------------------------------------------------------------------------------
# The NumPy layer
# ------------------------------------------------------------------------------------------------
def np_of(t: torch.Tensor) -> np.ndarray:
    """A torch tensor as a NumPy array of the same storage dtype (bfloat16: ml_dtypes')."""
    if t.dtype is torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(BF16_NP)
    return t.contiguous().numpy()


def ste(t: torch.Tensor, act) -> torch.Tensor:
    """t rounded to act in the forward, the identity in the backward (a half module's
    intermediates: docs/SEMANTICS.md "Half precision in the layer"); act None: t."""
    return t if act is None else t + (t.to(act).double() - t).detach()


def reference_gqa(x, ws, h, g, causal, dy, act=None):
    """The layer in float64 torch ops (x W^T + b, GQA attention, output projection), with
    autograd: (y, {name: gradient}); act: the dtype a half module rounds Q, K, V and the
    attention output to (straight through in the backward, as mha differentiates them)."""
    x = x.double().requires_grad_()
    ws = {n: t.double().requires_grad_() for n, t in ws.items()}
    B, n, _ = x.shape

    def heads(w, b, nh):
        return ste(F.linear(x, w, b), act).view(B, n, nh, -1).transpose(1, 2)

    qh, kh, vh = (heads(ws["w_" + c], ws["b_" + c], nh) for c, nh in (("q", h), ("k", g),
                                                                       ("v", g)))
    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=True)
    y = F.linear(ste(o.transpose(1, 2).reshape(B, n, -1), act), ws["w_o"], ws["b_o"])
    y.backward(dy.double())
    return y.detach(), dict({n: t.grad for n, t in ws.items()}, query=x.grad)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("causal", [False, True])
def test_numpy_gqa_layer_vs_float64(dtype, causal):
    """mha.MultiheadAttention with half weights and inputs (GQA: 4 query heads, 2 kv heads):
    weights kept in their dtype, output and input gradient in the input's dtype, parameter
    gradients float32 (docs/SEMANTICS.md), each vs float64 torch on the same rounded values."""
    gen = torch.Generator().manual_seed(31)
    h, g, d = 4, 2, 16
    shapes = {"w_q": (h * d, E), "w_k": (g * d, E), "w_v": (g * d, E), "w_o": (E, h * d),
              "b_q": (h * d,), "b_k": (g * d,), "b_v": (g * d,), "b_o": (E,)}
    ws = {n: (torch.randn(s, generator=gen) * 0.2).to(dtype) for n, s in shapes.items()}
    x = torch.randn(BATCH, N, E, generator=gen).to(dtype)
    dy = torch.randn(BATCH, N, E, generator=gen).to(dtype)
    layer = mha.MultiheadAttention(**{n: np_of(t) for n, t in ws.items()}, num_heads=h,
                                   num_kv_heads=g)
    assert layer.config.weight_dtype == str(dtype).split(".")[1]
    y, st = layer.forward_train(np_of(x), causal=causal)
    grads = layer.backward(st, np_of(dy))
    y64, g64 = reference_gqa(x, ws, h, g, causal, dy, act=dtype)
    want = BF16_NP if dtype is torch.bfloat16 else np.dtype(np.float16)
    assert y.dtype == want and grads["query"].dtype == want
    # The reference rounds the intermediates as the half module does (ste): the output is then
    # within its own rounding plus TOL_HALF_LAYER_TILE_C u_a (a float32 value rounding the other
    # way; the bf16 tile kernel's P); the gradients within TOL_HALF_LAYER_GRAD_C u_a (the
    # backward reads the rounded attention output in D = dO.O where autograd of the float64
    # SDPA reads its unrounded one; the tile kernel's A).
    close(torch.from_numpy(y.astype(np.float64)), y64, dtype, "output", act=dtype,
          c_act=TOL_HALF_LAYER_TILE_C)
    for n, ref in g64.items():
        got = grads[n]
        assert got.dtype == (want if n == "query" else np.float32), n
        # (d b_k is 0: a key bias adds q.b_k to a whole row of scores, which softmax ignores;
        # its float32 noise is gated at the scale of d b_q)
        close(torch.from_numpy(got.astype(np.float64)), ref,
              dtype if n == "query" else torch.float32, f"d {n}",
              g64["b_q"] if n == "b_k" else None, act=dtype)
    y_inf = layer(np_of(x), causal=causal)
    assert y_inf.dtype == want and np.array_equal(y_inf.view(np.uint16), y.view(np.uint16))


def test_numpy_dtype_rules():
    """Weights of mixed dtypes are all converted to float32 (nothing rounded); inputs of mixed
    dtypes are read as float32 and the output has query's dtype; float64 input gives float32."""
    rng = np.random.default_rng(5)
    w = {n: (rng.standard_normal((E, E)) * 0.1).astype(np.float32)
         for n in ("w_q", "w_k", "w_v", "w_o")}
    mixed = dict(w, w_o=w["w_o"].astype(BF16_NP))
    assert mha.MultiheadAttention(**mixed, num_heads=H).config.weight_dtype == "float32"
    assert mha.MultiheadAttention(**{n: a.astype(np.float16) for n, a in w.items()},
                                  num_heads=H).config.weight_dtype == "float16"
    layer = mha.MultiheadAttention(**w, num_heads=H)
    x = rng.standard_normal((1, 8, E)).astype(np.float32)
    y32 = layer(x, x, x)
    assert layer(x.astype(np.float64)).dtype == np.float32
    y_mixed = layer(x.astype(BF16_NP), x.astype(np.float16), x)
    assert y_mixed.dtype == BF16_NP
    ref = layer(x.astype(BF16_NP).astype(np.float32), x.astype(np.float16).astype(np.float32), x)
    assert np.array_equal(y_mixed.view(np.uint16), ref.astype(BF16_NP).view(np.uint16))
    assert np.allclose(y32, layer(x))
