# SPDX-License-Identifier: MIT
"""The PyTorch drop-ins (python/mha/torch.py) against PyTorch itself (torch==2.13.0, pinned in
python/requirements-test.txt).

- mha.torch.MultiheadAttention == torch.nn.MultiheadAttention (run in float64 as the reference):
  outputs, attention weights, gradients of the inputs and of every parameter, over a matrix of
  options: kdim/vdim, bias, batch_first, self/cross attention, bool and float attn_mask (2-D and
  3-D), bool and float key_padding_mask, is_causal, need_weights, average_attn_weights, unbatched.
- mha.torch.scaled_dot_product_attention == F.scaled_dot_product_attention incl. gradients.
- state_dict both ways, training steps, dropout reproducibility, the unsupported options.

Tolerance: max|got - ref| <= 1e-5 * max|ref| per tensor (float32 vs float64).
"""
import itertools
import os
import sys

import numpy as np
import pytest

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))

import torch  # noqa: E402  (required: CI installs python/requirements-test.txt)
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_python_api import assert_gil_released  # noqa: E402  (also builds mha._fastcall)
import mha  # noqa: E402
import mha.torch as mt  # noqa: E402
from mha import _lib  # noqa: E402
from tolerances import TOL_OUT_REL

TOL = TOL_OUT_REL  # tests/common/tolerance.h


def close(got, ref, what="", tol=TOL):
    assert got is not None and ref is not None, what
    got = got.detach().double()
    ref = ref.detach().double()
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    scale = max(ref.abs().max().item(), 1e-30)
    err = (got - ref).abs().max().item()
    assert err <= tol * scale, f"{what}: max|got-ref|={err:.3e} > {tol:g}*{scale:.3e}"


def test_torch_version_is_the_pinned_one():
    assert torch.__version__.split("+")[0] == "2.13.0"


# ------------------------------------------------------------------------------------------------
# nn.MultiheadAttention
# ------------------------------------------------------------------------------------------------
MASKS = ["none", "bool2d", "bool3d", "float2d", "float3d", "kpm_bool", "kpm_float",
         "bool2d+kpm_bool", "float2d+kpm_bool", "bool2d+kpm_float", "causal"]
CASES = []
for kv, bias, bf, mask in itertools.product(["same", "kdim_vdim"], [True, False], [False, True],
                                            MASKS):
    CASES.append((kv, bias, bf, mask))


def make_masks(kind, N, h, L, S, gen):
    am = kpm = None
    causal = False
    if "bool2d" in kind:
        am = torch.rand(L, S, generator=gen) < 0.3
        am[:, 0] = False
    if "bool3d" in kind:
        am = torch.rand(N * h, L, S, generator=gen) < 0.3
        am[:, :, 0] = False
    if "float2d" in kind:
        am = torch.randn(L, S, generator=gen)
    if "float3d" in kind:
        am = torch.randn(N * h, L, S, generator=gen)
    if "kpm_bool" in kind:
        kpm = torch.rand(N, S, generator=gen) < 0.3
        kpm[:, 0] = False
    if "kpm_float" in kind:
        kpm = torch.randn(N, S, generator=gen)
    if kind == "causal":
        am = torch.triu(torch.ones(L, S, dtype=torch.bool), 1)
        causal = True
    return am, kpm, causal


@pytest.mark.parametrize("kv,bias,batch_first,mask", CASES)
def test_multihead_attention_matches_torch(kv, bias, batch_first, mask):
    gen = torch.Generator().manual_seed(hash((kv, bias, batch_first, mask)) % 2**31)
    E, h, N, L = 16, 4, 2, 5
    self_attn = kv == "same" and mask in ("none", "causal", "bool3d")
    S = L if self_attn else 7
    kdim, vdim = (None, None) if kv == "same" else (12, 10)
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, h, bias=bias, kdim=kdim, vdim=vdim,
                                      batch_first=batch_first)
    mine = mt.MultiheadAttention(E, h, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first)
    mine.load_state_dict(ref.state_dict())
    ref = ref.double()

    def shape(len_, feat):
        return (N, len_, feat) if batch_first else (len_, N, feat)

    q = torch.randn(shape(L, E), generator=gen)
    if self_attn:
        k = v = q
    else:
        k = torch.randn(shape(S, kdim or E), generator=gen)
        v = torch.randn(shape(S, vdim or E), generator=gen)
    am, kpm, causal = make_masks(mask, N, h, L, S, gen)
    for need_weights, average in ((True, True), (True, False), (False, True)):
        ins32 = [t.clone().requires_grad_() for t in ((q,) if self_attn else (q, k, v))]
        ins64 = [t.detach().double().requires_grad_() for t in ins32]
        a32 = ins32 * 3 if self_attn else ins32
        a64 = ins64 * 3 if self_attn else ins64
        kw = dict(key_padding_mask=kpm, need_weights=need_weights, average_attn_weights=average,
                  is_causal=causal)
        am64 = am.double() if am is not None and am.is_floating_point() else am
        kpm64 = kpm.double() if kpm is not None and kpm.is_floating_point() else kpm
        y, w = mine(*a32, attn_mask=am, **kw)
        yr, wr = ref(*a64, attn_mask=am64, **{**kw, "key_padding_mask": kpm64})
        close(y, yr, "output")
        if need_weights:
            close(w, wr, "weights", tol=TOL)
        else:
            assert w is None and wr is None
        dy = torch.randn(y.shape, generator=gen)
        mine.zero_grad()
        ref.zero_grad()
        (y * dy).sum().backward()
        (yr * dy.double()).sum().backward()
        for t32, t64 in zip(ins32, ins64):
            close(t32.grad, t64.grad, "input grad")
        for (n1, p1), (n2, p2) in zip(mine.named_parameters(), ref.named_parameters()):
            assert n1 == n2
            close(p1.grad, p2.grad, f"grad {n1}")


def test_unbatched_and_key_is_value():
    torch.manual_seed(1)
    ref = torch.nn.MultiheadAttention(8, 2, kdim=6, vdim=6)
    mine = mt.MultiheadAttention(8, 2, kdim=6, vdim=6)
    mine.load_state_dict(ref.state_dict())
    ref = ref.double()
    q = torch.randn(3, 8, requires_grad=True)
    kv = torch.randn(5, 6, requires_grad=True)
    y, w = mine(q, kv, kv, average_attn_weights=False)
    q64, kv64 = (t.detach().double().requires_grad_() for t in (q, kv))
    yr, wr = ref(q64, kv64, kv64, average_attn_weights=False)
    close(y, yr)
    close(w, wr)
    y.sum().backward()
    yr.sum().backward()
    close(q.grad, q64.grad)
    close(kv.grad, kv64.grad)


@pytest.mark.parametrize("batch_first,N,self_attn,layout", list(itertools.product(
    [False, True], [1, 3], [True, False], ["contiguous", "strided", "float64"])))
def test_input_layouts_and_batch_sizes(batch_first, N, self_attn, layout):
    """The drop-in reads (L, N, E) with N = 1, batch_first and unbatched inputs in place (no
    transpose, no copy) and writes outputs in the caller's layout; strided inputs are copied,
    float64 ones converted (and their gradients converted back)."""
    gen = torch.Generator().manual_seed(N * 100 + 10 * batch_first + self_attn)
    E, h, L = 12, 3, 5
    S = L if self_attn else 4
    torch.manual_seed(7)
    ref = torch.nn.MultiheadAttention(E, h, batch_first=batch_first)
    mine = mt.MultiheadAttention(E, h, batch_first=batch_first)
    mine.load_state_dict(ref.state_dict())
    ref = ref.double()

    def make(len_):
        shape = (N, len_, E) if batch_first else (len_, N, E)
        if layout == "strided":  # the leaf is wider; the input is every other feature of it
            shape = shape[:2] + (2 * E,)
        t = torch.randn(shape, generator=gen)
        return t.double() if layout == "float64" else t

    def view(t):
        return t[..., ::2] if layout == "strided" else t

    q = make(L)
    ins = [q.requires_grad_()] if self_attn else [q.requires_grad_(), make(S).requires_grad_()]
    ins64 = [t.detach().double().requires_grad_() for t in ins]
    vs, vs64 = [view(t) for t in ins], [view(t) for t in ins64]
    if layout == "strided":
        assert not vs[0].is_contiguous()
    args = vs * 3 if self_attn else [vs[0], vs[1], vs[1]]
    args64 = vs64 * 3 if self_attn else [vs64[0], vs64[1], vs64[1]]
    for need_weights, average in ((True, False), (False, True), (True, True)):
        for t in ins + ins64:
            t.grad = None
        mine.zero_grad()
        ref.zero_grad()
        y, w = mine(*args, need_weights=need_weights, average_attn_weights=average)
        yr, wr = ref(*args64, need_weights=need_weights, average_attn_weights=average)
        assert y.shape == yr.shape and y.dtype == q.dtype
        if not batch_first and N == 1 and layout != "strided":  # mha's memory order: no copy
            assert y.is_contiguous()
        close(y, yr, "output")
        if need_weights:
            assert w.shape == wr.shape
            close(w, wr, "weights")
        else:
            assert w is None
        dy = torch.randn(y.shape, generator=gen)
        (y * dy).sum().backward()
        (yr * dy.double()).sum().backward()
        for t, t64 in zip(ins, ins64):
            assert t.grad.shape == t.shape and t.grad.dtype == t.dtype
            close(t.grad, t64.grad, "input grad")
        for (n1, p1), (_, p2) in zip(mine.named_parameters(), ref.named_parameters()):
            close(p1.grad, p2.grad, f"grad {n1}")
        with torch.no_grad():
            y2, w2 = mine(*args, need_weights=need_weights, average_attn_weights=average)
        assert torch.equal(y2, y.detach()) and (w2 is None or torch.equal(w2, w))


def test_unbatched_self_attention_per_head_weights_and_grads():
    torch.manual_seed(8)
    ref = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    mine = mt.MultiheadAttention(8, 2, batch_first=True)
    mine.load_state_dict(ref.state_dict())
    ref = ref.double()
    x = torch.randn(6, 8, requires_grad=True)
    x64 = x.detach().double().requires_grad_()
    y, w = mine(x, x, x, average_attn_weights=False, is_causal=True,
                attn_mask=torch.triu(torch.ones(6, 6, dtype=torch.bool), 1))
    yr, wr = ref(x64, x64, x64, average_attn_weights=False, is_causal=True,
                 attn_mask=torch.triu(torch.ones(6, 6, dtype=torch.bool), 1))
    assert y.shape == (6, 8) and w.shape == (2, 6, 6)
    close(y, yr)
    close(w, wr)
    y.sum().backward()
    yr.sum().backward()
    close(x.grad, x64.grad)



@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("kind", ["self_causal", "cross_kdim_padding"])
def test_weights_are_differentiable_as_torch(kind, average):
    # A loss that reads the attention weights (attention distillation: MiniLM, TinyBERT) gets
    # their term in every gradient, as nn.MultiheadAttention's (float64 reference); until session
    # 51 the weights were marked non-differentiable and the term was lost silently.
    torch.manual_seed(21)
    E, h, n, m = 16, 4, 6, 9
    cross = kind.startswith("cross")
    kw = dict(kdim=12, vdim=10) if cross else {}
    ref = torch.nn.MultiheadAttention(E, h, batch_first=True, **kw)
    mine = mt.MultiheadAttention(E, h, batch_first=True, **kw)
    mine.load_state_dict(ref.state_dict())
    ref = ref.double()
    x = torch.randn(2, n, E, requires_grad=True)
    if cross:
        key, val = torch.randn(2, m, 12, requires_grad=True), torch.randn(2, m, 10,
                                                                           requires_grad=True)
        opts = dict(key_padding_mask=torch.tensor([[False] * m, [False] * (m - 3) + [True] * 3]))
        ins = (x, key, val)
    else:
        opts = dict(attn_mask=torch.triu(torch.ones(n, n, dtype=torch.bool), 1))
        ins = (x, x, x)
    ins64 = [t.detach().double().requires_grad_() for t in (x,) + ((key, val) if cross else ())]
    y, w = mine(*ins, average_attn_weights=average, **opts)
    yr, wr = ref(*(ins64 if cross else ins64 * 3), average_attn_weights=average, **opts)
    close(w, wr, "weights")
    gy, gw = torch.randn(y.shape, dtype=torch.float64), torch.randn(w.shape, dtype=torch.float64)
    ((y * gy.float()).sum() + (w * gw.float()).sum()).backward()
    ((yr * gy).sum() + (wr * gw).sum()).backward()
    close(x.grad, ins64[0].grad, "d_query")
    if cross:
        close(key.grad, ins64[1].grad, "d_key")
        close(val.grad, ins64[2].grad, "d_value")
    for (nm, a), b in zip(mine.named_parameters(), ref.parameters()):
        close(a.grad, b.grad, nm)


def test_parameter_changes_rebuild_the_c_layer():
    """The C layer is cached by (data_ptr, version) of every parameter: in-place updates,
    ``.data`` replacement and load_state_dict all take effect on the next call."""
    torch.manual_seed(9)
    ref = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    mine = mt.MultiheadAttention(8, 2, batch_first=True)
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 8)

    def check():
        with torch.no_grad():
            close(mine(x, x, x)[0], ref(x, x, x)[0])

    check()
    with torch.no_grad():
        for p1, p2 in zip(mine.parameters(), ref.parameters()):
            p1.mul_(1.5)
            p2.mul_(1.5)
    check()
    w = torch.randn(8, 8)
    mine.out_proj.weight.data = w.clone()
    ref.out_proj.weight.data = w.clone()
    check()
    ref2 = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    mine.load_state_dict(ref2.state_dict())
    ref = ref2
    check()


@pytest.mark.parametrize("opt", ["adamw_fused", "sgd_fused", "adam_foreach"])
def test_fused_optimizer_steps_rebuild_the_c_layer(opt):
    # torch's fused optimizers update the parameters in place without bumping their version
    # counters: until session 51 the cached C layer kept the old weights (an error of the
    # output's size). Every optimizer step now makes the layer rebuild (OPTIMIZER_STEPS).
    torch.manual_seed(12)
    mine = mt.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 5, 8)
    make = {"adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.05, fused=True),
            "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.5, fused=True),
            "adam_foreach": lambda p: torch.optim.Adam(p, lr=0.05, foreach=True)}[opt]
    o = make(mine.parameters())
    for step in range(3):
        mine(x, x, x)[0].square().sum().backward()
        o.step()
        o.zero_grad()
        ref = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        ref.load_state_dict(mine.state_dict())
        with torch.no_grad():
            close(mine(x, x, x)[0], ref(x, x, x)[0], f"{opt} step {step}")  # the fast path
        close(mine(x, x, x)[0], ref(x, x, x)[0], f"{opt} step {step} (grad mode)")


def test_parametrized_weights_are_read_at_every_call():
    # A parametrized weight (LoRA-style) is recomputed at every access, often at the address and
    # version of the previous one: nothing identifies its value, so the layer is rebuilt per call
    # (until session 51 a change of the parametrization's own state was missed).
    from torch.nn.utils import parametrize

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.s = torch.nn.Parameter(torch.ones(()))

        def forward(self, w):
            return w * self.s

    torch.manual_seed(13)
    mine = mt.MultiheadAttention(16, 4).eval()
    ref = torch.nn.MultiheadAttention(16, 4).eval()
    ref.load_state_dict(mine.state_dict())
    for mod in (mine, ref):
        parametrize.register_parametrization(mod, "in_proj_weight", Scale())
    x = torch.randn(5, 2, 16)
    with torch.no_grad():
        for s in (1.0, 2.0, 3.0):
            for mod in (mine, ref):
                mod.parametrizations.in_proj_weight[0].s.fill_(s)
            close(mine(x, x, x)[0], ref(x, x, x)[0], f"scale {s}")
        # The policy itself: no two calls share a cache key (whatever the allocator reuses).
        key = mine._cache_key
        mine(x, x, x)
        assert mine._cache_key != key


def test_state_dict_names_both_ways():
    for kw in ({}, {"kdim": 5, "vdim": 7}, {"bias": False}):
        a = torch.nn.MultiheadAttention(12, 3, **kw)
        b = mt.MultiheadAttention(12, 3, **kw)
        assert list(a.state_dict()) == list(b.state_dict())
        a.load_state_dict(b.state_dict())
        b.load_state_dict(a.state_dict())


def test_unsupported_options_raise_clear_errors():
    with pytest.raises(NotImplementedError, match="add_bias_kv"):
        mt.MultiheadAttention(8, 2, add_bias_kv=True)
    with pytest.raises(NotImplementedError, match="add_zero_attn"):
        mt.MultiheadAttention(8, 2, add_zero_attn=True)
    m = mt.MultiheadAttention(8, 2)
    with pytest.raises(TypeError):
        x = torch.ones(3, 1, 8, dtype=torch.int64)
        m(x, x, x)


def test_training_steps_follow_torch():
    torch.manual_seed(2)
    ref = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    mine = mt.MultiheadAttention(16, 4, batch_first=True)
    mine.load_state_dict(ref.state_dict())
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_m = torch.optim.SGD(mine.parameters(), lr=0.1)
    x = torch.randn(3, 6, 16)
    target = torch.randn(3, 6, 16)
    mask = torch.triu(torch.ones(6, 6, dtype=torch.bool), 1)
    losses = []
    for _ in range(5):
        for mod, opt in ((ref, opt_r), (mine, opt_m)):
            opt.zero_grad()
            y, _ = mod(x, x, x, attn_mask=mask, need_weights=False)
            loss = F.mse_loss(y, target)
            loss.backward()
            opt.step()
            if mod is mine:
                losses.append(loss.item())
    assert losses[-1] < losses[0]
    for (n, p1), (_, p2) in zip(mine.named_parameters(), ref.named_parameters()):
        close(p1, p2, n, tol=1e-5)


def test_dropout_train_eval_and_seed():
    m = mt.MultiheadAttention(16, 4, dropout=0.5, batch_first=True)
    x = torch.randn(2, 6, 16)
    m.train()
    torch.manual_seed(3)
    a, _ = m(x, x, x)
    torch.manual_seed(3)
    b, _ = m(x, x, x)
    c, _ = m(x, x, x)
    assert torch.equal(a, b) and not torch.equal(a, c)
    m.eval()
    e1, _ = m(x, x, x)
    m.dropout = 0.0
    e2, _ = m(x, x, x)
    assert torch.equal(e1, e2)
    m.train()
    m.dropout = 0.5
    xr = x.clone().requires_grad_()
    y, _ = m(xr, xr, xr)
    y.sum().backward()
    assert torch.isfinite(xr.grad).all()


def test_no_grad_inference_and_float64_inputs():
    torch.manual_seed(4)
    ref = torch.nn.MultiheadAttention(8, 2)
    mine = mt.MultiheadAttention(8, 2)
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(4, 2, 8, dtype=torch.float64)
    with torch.no_grad():
        y, w = mine(x, x, x)
        yr, wr = ref.double()(x, x, x)
    assert y.dtype == torch.float64
    close(y, yr)
    close(w, wr)


class FastSpy:
    """Wraps mha.torch's compiled fast path, counting the forward calls it served."""

    def __init__(self, monkeypatch):
        assert _lib.fast is not None, "mha._fastcall is not built: the fast path is not tested"
        self.hits = 0
        self._fast = _lib.fast
        monkeypatch.setattr(mt, "_fast", self)

    def layer_call(self, *args):
        self.hits += 1
        return self._fast.layer_call(*args)


@pytest.mark.parametrize("batch_first,shape,need_weights,average", [
    (True, (2, 7, 12), False, True), (True, (2, 7, 12), True, True),
    (True, (1, 7, 12), True, False), (False, (7, 1, 12), True, True),
    (False, (7, 12), True, False), (True, (7, 12), False, True)])
def test_compiled_inference_forward_equals_the_general_path_bit_for_bit(
        batch_first, shape, need_weights, average, monkeypatch):
    """Inference self-attention without masks runs in mha._fastcall; the same call through the
    general (ctypes) path, or on a non-contiguous copy (which the fast path leaves to it), gives
    the same bits, outputs and weights, in the same shapes and layouts."""
    torch.manual_seed(7)
    m = mt.MultiheadAttention(12, 3, batch_first=batch_first).eval()
    x = torch.randn(*shape)
    spy = FastSpy(monkeypatch)
    with torch.no_grad():
        y, w = m(x, x, x, need_weights=need_weights, average_attn_weights=average)
        assert spy.hits == 1
        xs = torch.randn(*shape[:-1], 2 * shape[-1])[..., ::2]
        xs.copy_(x)                                          # strided: the general path
        ys, ws = m(xs, xs, xs, need_weights=need_weights, average_attn_weights=average)
        assert spy.hits == 1
        monkeypatch.setattr(mt, "_fast", None)
        yg, wg = m(x, x, x, need_weights=need_weights, average_attn_weights=average)
    for other in (ys, yg):
        assert other.shape == y.shape and other.stride() == y.stride()
        assert torch.equal(other, y)
    if need_weights:
        for other in (ws, wg):
            assert other.shape == w.shape and torch.equal(other, w)
    else:
        assert w is None and ws is None and wg is None


def test_compiled_inference_forward_scope(monkeypatch):
    """What the fast path leaves to the general path: gradients wanted, masks, is_causal,
    dropout in training, cross-attention, (L, N > 1, E), other dtypes; and its errors."""
    torch.manual_seed(8)
    m = mt.MultiheadAttention(12, 3)
    x = torch.randn(5, 2, 12)
    x1 = torch.randn(5, 1, 12)
    spy = FastSpy(monkeypatch)
    y, _ = m(x1, x1, x1)                                  # parameters require grad: autograd
    y.sum().backward()
    with torch.no_grad():
        m(x, x, x)                                        # (L, N > 1, E): transposed copy
        m(x1, x1, x1, is_causal=True)
        m(x1, x1, x1, attn_mask=torch.zeros(5, 5, dtype=torch.bool))
        m(x1, x1.clone(), x1)
        m(x1.double(), x1.double(), x1.double())
        m.train()
        m.dropout = 0.5
        m(x1, x1, x1)
        assert spy.hits == 0
        m.dropout = 0.0
        m(x1, x1, x1)                                     # train() without dropout: fast
        assert spy.hits == 1
        m.eval()
        with pytest.raises(TypeError):
            m(x1.int(), x1.int(), x1.int())
        with pytest.raises(AssertionError):
            bad = torch.randn(5, 1, 10)
            m(bad, bad, bad)
        empty = torch.randn(0, 1, 12)
        with pytest.raises(mha.MhaError) as e:
            m(empty, empty, empty)                        # the library's error, same exception
        assert e.value.status_name == "INVALID_ARG" and "q_len" in e.value.message
        assert spy.hits == 2
        monkeypatch.setattr(mt, "_fast", None)
        with pytest.raises(mha.MhaError) as e2:
            m(empty, empty, empty)
        assert e2.value.message == e.value.message


def test_compiled_inference_forward_releases_the_gil(monkeypatch):
    torch.manual_seed(9)
    m = mt.MultiheadAttention(128, 2, batch_first=True, threads=1).eval()
    x = torch.randn(1, 2048, 128)

    calls = []

    def call():
        calls.append(1)
        with torch.no_grad():  # grad mode is per thread
            m(x, x, x, need_weights=False)

    spy = FastSpy(monkeypatch)
    assert_gil_released(call)
    # Every call (one timing call, then one per attempt: 1 to 3) went through the fast path.
    assert spy.hits == len(calls) >= 2


# ------------------------------------------------------------------------------------------------
# F.scaled_dot_product_attention
# ------------------------------------------------------------------------------------------------
SDPA_CASES = {
    "plain": dict(),
    "causal_square": dict(causal=True, L=6, S=6),
    "causal_rect": dict(causal=True, L=4, S=7),
    "bool_mask": dict(mask="bool"),
    "bool_mask_bcast": dict(mask="bool_b1"),
    "float_mask": dict(mask="float"),
    "scale": dict(scale=0.3),
    "gqa": dict(h=4, hkv=2, gqa=True),
    "mqa_dv": dict(h=4, hkv=1, gqa=True, Ev=6),
    "3d": dict(ndim=3, mask="bool"),
    "5d": dict(ndim=5, mask="float"),
    "blhd_strides": dict(transposed=True),
}


@pytest.mark.parametrize("name", sorted(SDPA_CASES))
def test_sdpa_matches_torch(name):
    c = SDPA_CASES[name]
    gen = torch.Generator().manual_seed(len(name) * 7919)
    N, h, hkv = 2, c.get("h", 3), c.get("hkv", c.get("h", 3))
    L, S, E, Ev = c.get("L", 5), c.get("S", 7), 8, c.get("Ev", 8)
    nd = c.get("ndim", 4)
    if nd == 3:
        qs, ks, vs = (N, L, E), (N, S, E), (N, S, Ev)
    elif nd == 5:
        qs, ks, vs = (N, 2, h, L, E), (N, 2, h, S, E), (N, 2, h, S, Ev)
    elif c.get("transposed"):
        qs, ks, vs = (N, L, h, E), (N, S, hkv, E), (N, S, hkv, Ev)
    else:
        qs, ks, vs = (N, h, L, E), (N, hkv, S, E), (N, hkv, S, Ev)
    q, k, v = (torch.randn(s, generator=gen) for s in (qs, ks, vs))
    if c.get("transposed"):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [N, h, L, E] views, strided
    lead = q.shape[:-2]
    mask = None
    if c.get("mask") == "bool":
        mask = torch.rand(lead + (L, S), generator=gen) < 0.7
        mask[..., 0] = True
    elif c.get("mask") == "bool_b1":
        mask = torch.rand((N, 1, L, S), generator=gen) < 0.7
        mask[..., 0] = True
    elif c.get("mask") == "float":
        mask = torch.randn((L, S), generator=gen)
    kw = dict(attn_mask=mask, is_causal=c.get("causal", False), scale=c.get("scale"),
              enable_gqa=c.get("gqa", False))
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    ins64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    m64 = mask.double() if mask is not None and mask.is_floating_point() else mask
    out = mt.scaled_dot_product_attention(*ins, **kw)
    ref = F.scaled_dot_product_attention(*ins64, **{**kw, "attn_mask": m64})
    close(out, ref, "output")
    do = torch.randn(out.shape, generator=gen)
    g = torch.autograd.grad((out * do).sum(), ins)
    gr = torch.autograd.grad((ref * do.double()).sum(), ins64)
    for a, b, nm in zip(g, gr, "qkv"):
        close(a, b, "d" + nm)


def test_sdpa_errors_and_dropout():
    q = torch.randn(1, 4, 3, 8)
    k = torch.randn(1, 2, 5, 8)
    with pytest.raises(RuntimeError, match="enable_gqa"):
        mt.scaled_dot_product_attention(q, k, k)
    with pytest.raises(RuntimeError):
        mt.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool),
                                        is_causal=True)
    torch.manual_seed(5)
    a = mt.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    torch.manual_seed(5)
    b = mt.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert torch.equal(a, b)
    assert not torch.equal(a, mt.scaled_dot_product_attention(q, q, q))
    with pytest.raises(mha.MhaError):
        mt.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(2, 7, 7, dtype=torch.bool))


@pytest.mark.parametrize("p", [-0.1, float("nan"), 1.0, 1.5])
def test_dropout_outside_0_1_raises(p):
    # (a negative or NaN probability silently meant no dropout until session 47)
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        mt.scaled_dot_product_attention(q, q, q, dropout_p=p)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        torch.ops.mha.attention(q, q, q, None, None, False, 0.5, p, None, False, False, 1,
                                0.0, False, None)
    with pytest.raises(ValueError, match="dropout must be in"):
        mt.MultiheadAttention(8, 2, dropout=p)
    m = mt.MultiheadAttention(8, 2).train()
    m.dropout = p
    x = torch.randn(3, 1, 8)
    with pytest.raises(ValueError, match="dropout must be in"):
        m(x, x, x)


@pytest.mark.parametrize("window", [(-5, -5), (-2, 0), (3, -7)])
def test_window_below_minus_one_raises(window):
    # (-1 is unbounded; both below it were taken as no window, silently, until session 47)
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises((ValueError, mha.MhaError), match="window"):
        torch.ops.mha.attention(q, q, q, None, None, False, 0.5, 0.0, None, False, False, 1,
                                0.0, False, None, *window)


def test_double_backward_raises_instead_of_dropping_second_order_terms():
    # mha's backward is not itself differentiable. A gradient penalty (create_graph=True) used to
    # get gradients without a graph, so loss.backward() silently left out the penalty's terms
    # (q.grad off by ~100% of its size); the backward is now once_differentiable: it raises.
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    x = torch.randn(1, 4, 8)
    layer = mt.MultiheadAttention(8, 2, batch_first=True)
    for name, fn, inp in (
            ("sdpa", lambda t: mt.scaled_dot_product_attention(t, k, v), q),
            ("MultiheadAttention", lambda t: layer(t, t, t, need_weights=False)[0], x)):
        t = inp.clone().requires_grad_()
        o = fn(t)
        g, = torch.autograd.grad(o.pow(2).sum(), t, create_graph=True)
        with pytest.raises(RuntimeError, match="differentiate twice"):
            (o.sum() + g.pow(2).sum()).backward()
        # first-order gradients are unchanged
        t2 = inp.clone().requires_grad_()
        fn(t2).pow(2).sum().backward()
        assert torch.equal(t2.grad, g.detach()), name


# ------------------------------------------------------------------------------------------------
# torch.ops.mha.attention with learned sinks: their gradient
# ------------------------------------------------------------------------------------------------
def eager_attention_with_sinks(q, k, v, sinks, scale, attend=None, additive=None, causal=False,
                               softcap=0.0):
    """float64 eager reference (docs/SEMANTICS.md): the sink is one more logit per head in each
    row's softmax and takes no value; GQA query head i reads kv head i // (h / g)."""
    B, h, n, _ = q.shape
    g, m = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1)
    s = scale * q @ k.transpose(-1, -2)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if additive is not None:
        s = s + additive
    if causal:  # top-left, as the operator's flag
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1), float("-inf"))
    if attend is not None:
        s = s.masked_fill(~attend, float("-inf"))
    full = torch.cat([s, sinks.view(1, h, 1, 1).expand(B, h, n, 1)], -1)
    p = torch.softmax(full, -1)[..., :m].nan_to_num(0.0)  # (a row of -inf only: 0, as mha)
    return p @ v, torch.logsumexp(full, -1), p


def op_case(name: str, shapes: tuple, c: dict, salt: int):
    """The operands of one case of SINK_CASES / LSE_CASES / PROBS_CASES, float64, from a seed of
    its name: q, k, v, sinks (all -inf without sinks: the eager reference's "no sink"), attend (a
    bool mask with fully masked rows, or None) and additive (or None)."""
    B, h, g, n, m, d, dv = shapes
    gen = torch.Generator().manual_seed(len(name) * salt)
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float64)
               for s in ((B, h, n, d), (B, g, m, d), (B, g, m, dv)))
    sinks = torch.randn(h, generator=gen, dtype=torch.float64) * c.get("sink_scale", 1.0)
    if not c.get("sinks", True):
        sinks = torch.full((h,), float("-inf"), dtype=torch.float64)
    attend = additive = None
    if c.get("mask") == "bool_empty_rows":
        attend = torch.rand(B, 1, n, m, generator=gen) < 0.6
        attend[..., 0] = True
        attend[0, 0, 2] = False  # fully masked rows: out = 0, lse = -inf, no sink gradient
        attend[1, 0, n - 1] = False
    elif c.get("mask") == "float":
        additive = torch.randn(n, m, generator=gen, dtype=torch.float64)
    return (q, k, v, sinks, attend, additive), gen


SINK_CASES = {
    # (B, h, g, n, m, d, dv), options
    "plain": ((2, 3, 3, 5, 7, 8, 8), {}),
    "gqa": ((2, 4, 2, 6, 9, 8, 5), {}),
    "mqa_causal": ((1, 4, 1, 7, 7, 16, 16), dict(causal=True)),
    "causal_n_lt_m": ((2, 2, 2, 4, 9, 8, 8), dict(causal=True)),
    "fully_masked_rows": ((2, 4, 2, 6, 8, 8, 8), dict(mask="bool_empty_rows")),
    "additive_softcap": ((2, 2, 1, 5, 6, 8, 4), dict(mask="float", softcap=2.0)),
    "large_sinks": ((1, 3, 3, 4, 5, 8, 8), dict(sink_scale=6.0)),
    "float64_operands": ((2, 2, 2, 3, 4, 8, 8), dict(dtype=torch.float64)),
}


@pytest.mark.parametrize("name", sorted(SINK_CASES))
def test_op_sinks_gradient_matches_float64_eager(name):
    # torch.ops.mha.attention returns dL/d sinks when the sinks require grad (gpt-oss's learned
    # sinks): d out_i / d sink_h = -p_sink,i out_i. Until session 49 the operator took the sinks
    # as constants: torch.autograd.grad raised "One of the differentiated Tensors appears to not
    # have been used in the graph" (the sinks got None); only the HF path added the term itself.
    (B, h, g, n, m, d, dv), c = SINK_CASES[name]
    (q, k, v, sinks, attend, additive), gen = op_case(name, SINK_CASES[name][0], c, 1009)
    dt = c.get("dtype", torch.float32)
    scale, softcap, causal = 0.35, c.get("softcap", 0.0), c.get("causal", False)
    ins = [t.to(dt).requires_grad_() for t in (q, k, v, sinks)]
    ins64 = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse, _ = torch.ops.mha.attention(
        ins[0], ins[1], ins[2], attend, None if additive is None else additive.float(), causal,
        scale, 0.0, None, False, False, 1, softcap, False, ins[3])
    ref = eager_attention_with_sinks(*ins64, scale, attend, additive, causal, softcap)[0]
    close(out, ref, "output")
    if attend is not None:
        assert torch.isneginf(lse[0, :, 2]).all() and not out[0, :, 2].any()
    do = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out * do.to(dt)).sum(), ins)
    refs = torch.autograd.grad((ref * do).sum(), ins64)
    for a, b, nm in zip(grads, refs, ("dq", "dk", "dv", "dsinks")):
        assert a.dtype == dt, (nm, a.dtype)
        close(a, b, f"{name}: {nm}")


LSE_CASES = {**SINK_CASES, "no_sinks_gqa_causal": ((2, 4, 2, 5, 8, 8, 6),
                                                   dict(causal=True, sinks=False))}


@pytest.mark.parametrize("name", sorted(LSE_CASES))
def test_op_gradient_through_lse_matches_float64_eager(name):
    # A loss that reads lse as well as out (merging partial attentions by their lse, a
    # log-partition term): until session 51 the operator dropped dL/dlse, and every gradient
    # came out silently wrong. lse_i = log(exp(sink) + sum_j exp(s_ij)) gives d lse_i / d s_ij =
    # p_ij and d lse_i / d sink = p_sink,i. Rows that see no key (lse = -inf, the contract) are
    # left out of both losses (the eager lse keeps the sink there).
    (B, h, g, n, m, d, dv), c = LSE_CASES[name]
    (q, k, v, sinks, attend, additive), gen = op_case(name, LSE_CASES[name][0], c, 7919)
    dt = c.get("dtype", torch.float32)
    with_sinks = c.get("sinks", True)
    scale, softcap, causal = 0.35, c.get("softcap", 0.0), c.get("causal", False)
    ins = [t.to(dt).requires_grad_() for t in (q, k, v)] + (
        [sinks.to(dt).requires_grad_()] if with_sinks else [])
    ins64 = [t.clone().requires_grad_() for t in (q, k, v)] + (
        [sinks.clone().requires_grad_()] if with_sinks else [])
    out, lse, _ = torch.ops.mha.attention(
        *ins[:3], attend, None if additive is None else additive.float(), causal, scale, 0.0,
        None, False, False, 1, softcap, False, ins[3] if with_sinks else None)
    ref, ref_lse, _ = eager_attention_with_sinks(*ins64[:3], ins64[3] if with_sinks else sinks,
                                                 scale, attend, additive, causal, softcap)
    seen = torch.isfinite(lse.detach())
    close(lse.where(seen, 0), ref_lse.where(seen, 0), "lse")
    do = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    dl = torch.randn(lse.shape, generator=gen, dtype=torch.float64) * 3.0
    grads = torch.autograd.grad(
        (out * do.to(dt)).sum() + (lse.where(seen, 0) * dl.to(lse.dtype)).sum(), ins)
    refs = torch.autograd.grad((ref * do).sum() + (ref_lse.where(seen, 0) * dl).sum(), ins64)
    for a, b, nm in zip(grads, refs, ("dq", "dk", "dv", "dsinks")):
        close(a, b, f"{name}: {nm}")
    # The NumPy face takes the same dlse (mha.attention_backward(..., dlse=)).
    got = mha.attention_backward(
        do.to(dt).numpy(), *(t.detach().numpy() for t in ins[:3]), out.detach().numpy(),
        lse.detach().numpy(), scale=scale, causal="top-left" if causal else False,
        softcap=softcap or None, mask=None if attend is None else attend.numpy(),
        attn_bias=None if additive is None else additive.float().numpy(),
        sinks=ins[3].detach().numpy() if with_sinks else None,
        dlse=(dl * seen).to(dt).numpy())
    for a, b, nm in zip(got, refs, ("dq", "dk", "dv", "dsinks")):
        close(torch.from_numpy(a), b, f"{name} (NumPy): {nm}")


PROBS_CASES = {"plain": ((2, 3, 3, 5, 7, 8, 8), {}),
               "gqa_sinks_causal": ((2, 4, 2, 6, 9, 8, 5), dict(causal=True, sinks=True)),
               "empty_rows_sinks": ((2, 4, 2, 6, 8, 8, 8), dict(mask="bool_empty_rows",
                                                                 sinks=True)),
               "additive_softcap": ((2, 2, 1, 5, 6, 8, 4), dict(mask="float", softcap=2.0)),
               "averaged_gqa": ((2, 4, 2, 5, 6, 8, 8), dict(average=True, sinks=True)),
               "bfloat16": ((1, 2, 2, 4, 6, 16, 16), dict(dtype=torch.bfloat16))}


@pytest.mark.parametrize("name", sorted(PROBS_CASES))
def test_op_gradient_through_probs_matches_float64_eager(name):
    # A loss on the returned probabilities (attention distillation: MiniLM, TinyBERT) as well as
    # on out and lse: until session 51 their gradient was dropped silently. The reference is
    # float64 eager softmax attention; rows that see no key are left out of the lse term.
    (B, h, g, n, m, d, dv), c = PROBS_CASES[name]
    c = {"sinks": False, **c}
    (*x64, sinks, attend, additive), gen = op_case(name, PROBS_CASES[name][0], c, 104729)
    dt = c.get("dtype", torch.float32)
    with_sinks = c["sinks"]
    scale, softcap, causal, avg = 0.35, c.get("softcap", 0.0), c.get("causal", False), \
        c.get("average", False)
    if dt is torch.bfloat16:  # the reference starts from the values the operator reads
        x64 = [t.to(dt).double() for t in x64]
    ins = [t.to(dt).requires_grad_() for t in x64] + (
        [sinks.to(dt).requires_grad_()] if with_sinks else [])
    ins64 = [t.clone().requires_grad_() for t in x64] + (
        [sinks.clone().requires_grad_()] if with_sinks else [])
    out, lse, probs = torch.ops.mha.attention(
        *ins[:3], attend, None if additive is None else additive.float(), causal, scale, 0.0,
        None, True, avg, 1, softcap, False, ins[3] if with_sinks else None)
    assert probs.requires_grad
    ref_out, ref_lse, ref_p = eager_attention_with_sinks(
        *ins64[:3], ins64[3] if with_sinks else sinks, scale, attend, additive, causal, softcap)
    ref_probs = ref_p.mean(1) if avg else ref_p
    close(probs, ref_probs, "probs", tol=TOL if dt is not torch.bfloat16 else 2 ** -7)
    seen = torch.isfinite(lse.detach())
    do, dl, gp = (torch.randn(t.shape, generator=gen, dtype=torch.float64)
                  for t in (out, lse, probs))
    loss = (out * do.to(dt)).sum() + (lse.where(seen, 0) * dl.float()).sum() + \
        (probs * gp.to(dt)).sum()
    ref = (ref_out * do).sum() + (ref_lse.where(seen, 0) * dl).sum() + (ref_probs * gp).sum()
    grads = torch.autograd.grad(loss, ins)
    refs = torch.autograd.grad(ref, ins64)
    for a, b, nm in zip(grads, refs, ("dq", "dk", "dv", "dsinks")):
        close(a, b, f"{name}: {nm}", tol=TOL if dt is not torch.bfloat16 else 2 ** -6)
    if dt is torch.bfloat16:
        return
    # The NumPy face takes the same gradients (mha.attention_backward(..., dlse=, dprobs=)).
    got = mha.attention_backward(
        do.float().numpy(), *(t.detach().numpy() for t in ins[:3]), out.detach().numpy(),
        lse.detach().numpy(), scale=scale, causal="top-left" if causal else False,
        softcap=softcap or None, mask=None if attend is None else attend.numpy(),
        attn_bias=None if additive is None else additive.float().numpy(),
        sinks=ins[3].detach().numpy() if with_sinks else None,
        dlse=(dl * seen).float().numpy(), dprobs=gp.float().numpy())
    for a, b, nm in zip(got, refs, ("dq", "dk", "dv", "dsinks")):
        close(torch.from_numpy(a), b, f"{name} (NumPy): {nm}")


def test_op_gradient_through_probs_ignores_dropout_and_ring_refuses_dlse():
    # probs are taken before dropout, so a loss on them alone has the same gradient with and
    # without dropout (out's gradient is 0 there).
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=gen) for _ in range(3))
    gp = torch.randn(1, 2, 5, 5, generator=gen)
    grads = []
    for p, seed in ((0.0, None), (0.3, torch.tensor([7], dtype=torch.int64))):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        probs = torch.ops.mha.attention(*ins, None, None, True, 0.4, p, seed, True, False, 1)[2]
        grads.append(torch.autograd.grad((probs * gp).sum(), ins, allow_unused=True))
    for a, b, nm in zip(*grads, ("dq", "dk", "dv")):
        assert torch.equal(a, b), nm
    assert not grads[0][2].any()
    x = np.zeros((1, 2, 4, 8), np.float32)
    with pytest.raises(ValueError, match="dlse"):
        mha.attention_backward(x, x, x, x, x, np.zeros((1, 2, 4), np.float32), comm=object(),
                               dlse=np.zeros((1, 2, 4), np.float32))
    with pytest.raises(ValueError, match="dlse"):
        mha.attention_backward(x, x, x, x, x, np.zeros((1, 2, 4), np.float32),
                               dlse=np.zeros((1, 4, 2), np.float32))


@pytest.mark.parametrize("bottom_right", [False, True])
def test_op_bottom_right_places_window_alibi_and_chunks_without_causal(bottom_right):
    # The operator's bottom_right flag aligns the window, ALiBi and chunks to the last key
    # (delta = m - n) or the first (delta = 0) also without the causal flag; until session 51 a
    # call without causal always took bottom-right (the C default), whatever the flag said.
    gen = torch.Generator().manual_seed(5)
    B, h, n, m, d = 1, 4, 4, 10, 8
    q, k, v = (torch.randn(B, h, L, d, generator=gen, dtype=torch.float64) for L in (n, m, m))
    delta = m - n if bottom_right else 0
    p = torch.arange(n).view(n, 1) + delta
    j = torch.arange(m).view(1, m)
    slopes = torch.tensor([2.0 ** (-8 * (x + 1) / h) for x in range(h)], dtype=torch.float64)
    cases = {"window": (dict(window_left=1, window_right=2), (j >= p - 1) & (j <= p + 2), 0.0),
             "chunk": (dict(chunk_size=4), j // 4 == p // 4, 0.0),
             "alibi": (dict(alibi=True), torch.ones(n, m, dtype=torch.bool),
                       -slopes.view(h, 1, 1) * (p - j).abs())}
    for name, (opt, vis, bias) in cases.items():
        o = {**dict(softcap=0.0, alibi=False, sinks=None, window_left=-1, window_right=-1,
                    chunk_size=0), **opt}
        out = torch.ops.mha.attention(
            q.float(), k.float(), v.float(), None, None, False, 0.0, 0.0, None, False, False, 1,
            o["softcap"], o["alibi"], o["sinks"], o["window_left"], o["window_right"],
            bottom_right, o["chunk_size"])[0]
        s = (q @ k.transpose(-1, -2)) * d ** -0.5 + bias
        ref = torch.softmax(s.masked_fill(~vis, float("-inf")), -1) @ v
        close(out, ref, f"{name}, bottom_right={bottom_right}")


def test_op_sinks_gradient_with_dropout_equals_the_c_backward():
    # With dropout no eager reference draws mha's mask; d out_i / d sink_h = -p_sink,i out_i holds
    # all the same (the mask scales out_i and every p_ij alike): the operator's dsinks equals
    # mha_attention_backward's own (mha.attention_backward, the same seed).
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    sinks = torch.randn(4, generator=gen).requires_grad_()
    seed = torch.tensor([4242], dtype=torch.int64)
    out, lse, _ = torch.ops.mha.attention(q, k, v, None, None, True, 0.3, 0.25, seed, False,
                                          False, 1, 0.0, False, sinks)
    do = torch.randn(out.shape, generator=gen)
    dsinks, = torch.autograd.grad((out * do).sum(), sinks)
    *_, ref = mha.attention_backward(do.numpy(), q.numpy(), k.numpy(), v.numpy(),
                                     out.detach().numpy(), lse.detach().numpy(), scale=0.3,
                                     causal="top-left", dropout=0.25, seed=4242,
                                     sinks=sinks.detach().numpy())
    close(dsinks, torch.from_numpy(ref), "dsinks with dropout")


def test_op_sinks_without_grad_stay_constant():
    # Sinks that do not require grad get none (and the other gradients are unchanged).
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=gen).requires_grad_() for _ in range(3))
    sinks = torch.randn(2, generator=gen)
    out = torch.ops.mha.attention(q, k, v, None, None, False, 0.3, 0.0, None, False, False, 1,
                                  0.0, False, sinks)[0]
    ref = eager_attention_with_sinks(*(t.detach().double().requires_grad_() for t in (q, k, v)),
                                     sinks.double(), 0.3)[0]
    g = torch.autograd.grad(out.sum(), (q, k, v))
    assert sinks.grad is None and all(t is not None for t in g)
    close(out, ref, "output")
