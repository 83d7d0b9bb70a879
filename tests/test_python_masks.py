# SPDX-License-Identifier: MIT
"""Mask tensors recognised as built-in rules in the PyTorch drop-ins (issue 29,
python/mha/_mask_rule.py): the usual PyTorch masks (tril / triu bool masks, nn.Transformer's
float -inf/0 mask, HF's 4-d causal AND padding masks, sliding windows) give the same outputs and
gradients bit for bit as the tensor path (recognition off), and PyTorch's within the tolerance;
the per-process cache is hit on a repeated call, re-checks a tensor edited in place, is never
fooled by a freed tensor's address being reused, and stays bounded.
"""
import gc
import os
import sys

import pytest

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mha.torch as mt  # noqa: E402
from mha import _mask_rule  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tolerances import TOL_OUT_REL  # noqa: E402


def close(got, ref):
    err = (got.double() - ref.double()).abs().max().item()
    assert err <= TOL_OUT_REL * max(ref.abs().max().item(), 1.0), err


@pytest.fixture(autouse=True)
def fresh_cache():
    _mask_rule.clear()
    _mask_rule.enabled = True
    yield
    _mask_rule.enabled = True
    _mask_rule.clear()


def qkv(B=2, h=3, n=9, m=9, d=16, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(B, h, L, d, generator=g) for L in (n, m, m)]
    return [t.requires_grad_(grad) for t in ts]


SUBSTITUTED = []  # what _mask_rule.substitute answered during the last both_paths


def both_paths(fn):
    """fn() with recognition on (the rule runs) and off (the tensor runs)."""
    _mask_rule.enabled = True
    SUBSTITUTED.clear()
    real = _mask_rule.substitute

    def spy(*args):
        SUBSTITUTED.append(real(*args))
        return SUBSTITUTED[-1]
    _mask_rule.substitute = spy
    try:
        ruled = fn()
    finally:
        _mask_rule.substitute = real
    _mask_rule.enabled = False
    tensor = fn()
    _mask_rule.enabled = True
    return ruled, tensor


def hf_mask(B, n, m, pad):
    """HF's 4-d bool mask [B, 1, n, m]: bottom-right causal AND left padding of pad[b] keys."""
    i = torch.arange(n).view(n, 1)
    j = torch.arange(m).view(1, m)
    causal = j <= i + (m - n)
    keys = torch.stack([torch.arange(m) >= p for p in pad])  # [B, m]
    return (causal.unsqueeze(0) & keys.view(B, 1, m)).unsqueeze(1)


def chunk_mask(n, m, C, delta=0):
    """Chunked causal (Llama 4): key j visible from row i iff j <= p and j // C == p // C,
    p = i + delta."""
    p = torch.arange(n).view(n, 1) + delta
    j = torch.arange(m).view(1, m)
    return (j <= p) & (torch.div(j, C, rounding_mode="floor") ==
                       torch.div(p, C, rounding_mode="floor"))


def additive(visible):
    return torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))


SDPA_MASKS = {
    "tril bool": lambda n, m, B: torch.tril(torch.ones(n, m, dtype=torch.bool)),
    "tril(2) bool": lambda n, m, B: torch.tril(torch.ones(n, m, dtype=torch.bool), 2),
    "tril(-1) bool": lambda n, m, B: torch.tril(torch.ones(n, m, dtype=torch.bool), -1),
    "window bool": lambda n, m, B: (torch.tril(torch.ones(n, m, dtype=torch.bool)) &
                                    torch.triu(torch.ones(n, m, dtype=torch.bool), -3)),
    "float causal": lambda n, m, B: torch.zeros(n, m).masked_fill(
        torch.ones(n, m, dtype=torch.bool).triu(1), float("-inf")),
    "HF causal+padding": lambda n, m, B: hf_mask(B, n, m, [0, 2][:B] + [1] * (B - 2)),
    # Float (0 / -inf) masks hiding keys before visible ones (a window's lower edge, left
    # padding): substituted too, the block mask skipping their hidden tiles as the rule does.
    "float window": lambda n, m, B: torch.zeros(n, m).masked_fill(
        ~(torch.tril(torch.ones(n, m, dtype=torch.bool)) &
          torch.triu(torch.ones(n, m, dtype=torch.bool), -3)), float("-inf")),
    "float HF causal+padding": lambda n, m, B: torch.zeros(B, 1, n, m).masked_fill(
        ~hf_mask(B, n, m, [0, 2][:B] + [1] * (B - 2)), float("-inf")),
    # Chunked causal (Llama 4's chunked layers): recognised as causal + chunk_size.
    "chunked bool": lambda n, m, B: chunk_mask(n, m, 3),
    "chunked bool bottom-right 4-D": lambda n, m, B: chunk_mask(n, m, 4, m - n).view(1, 1, n, m),
    "float chunked": lambda n, m, B: additive(chunk_mask(n, m, 3)),
    "float chunked+padding 4-D": lambda n, m, B: additive(
        chunk_mask(n, m, 4, m - n) & (torch.arange(m) < m - 1 - torch.arange(B).view(B, 1, 1))
    ).view(B, 1, n, m),
    "chunked, one element flipped (no rule)": lambda n, m, B: chunk_mask(n, m, 3) ^ (
        (torch.arange(n).view(n, 1) == min(n, m) - 1) &
        (torch.arange(m) == (min(n, m) - 1) // 3 * 3)),  # a row's chunk start hidden
    "all true": lambda n, m, B: torch.ones(1, 1, n, m, dtype=torch.bool),
    "not a rule (random)": lambda n, m, B: torch.rand(
        n, m, generator=torch.Generator().manual_seed(3)) > .3,
}


@pytest.mark.parametrize("name", sorted(SDPA_MASKS))
@pytest.mark.parametrize("n,m", [(9, 9), (5, 11), (11, 5)])
def test_sdpa_rule_equals_tensor(name, n, m):
    B = 2
    mask = SDPA_MASKS[name](n, m, B)
    q, k, v = qkv(B=B, n=n, m=m, grad=True)

    def run():
        out = mt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        return (out.detach(),) + grads

    ruled, tensor = both_paths(run)
    assert SUBSTITUTED == ["no rule" not in name] * len(SUBSTITUTED), name
    for a, b in zip(ruled, tensor):
        assert torch.equal(a, b), name
    # Against PyTorch (rows every key of which is hidden: mha gives 0, PyTorch NaN).
    ref = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), attn_mask=mask)
    ok = ~torch.isnan(ref)
    close(ruled[0][ok], ref[ok])


def test_traced_operator_rule_equals_tensor():
    """torch.ops.mha.attention (the compiled / exported path) with the call's own rules: causal
    flag, the model's window and bottom-right alignment, ALiBi (which keeps the call's delta)."""
    n, m = 8, 12
    q, k, v = qkv(n=n, m=m)
    tril = torch.tril(torch.ones(n, m, dtype=torch.bool), m - n)
    window = tril & torch.triu(torch.ones(n, m, dtype=torch.bool), m - n - 4)
    for attend in (tril, window, torch.tril(torch.ones(n, m, dtype=torch.bool), 1)):
        for causal in (False, True):
            for model in ((0.0, False, None, -1, -1, False), (0.0, False, None, 2, 0, True),
                          (0.0, True, None, -1, -1, True), (0.0, True, None, 3, 1, False)):
                ruled, tensor = both_paths(lambda: torch.ops.mha.attention(
                    q, k, v, attend, None, causal, 0.25, 0.0, None, False, False, 0, *model))
                assert torch.equal(ruled[0], tensor[0]) and torch.equal(ruled[1], tensor[1]), \
                    (causal, model)


@pytest.mark.parametrize("n,m,C,delta", [(16, 16, 4, 0), (17, 17, 5, 0), (6, 20, 8, 14),
                                         (20, 12, 4, -8), (9, 9, 1, 0), (8, 8, 8, 0),
                                         (200, 200, 64, 0)])
@pytest.mark.parametrize("form", ["bool", "float"])
def test_chunk_mask_is_recognised(n, m, C, delta, form):
    """The rule the C recogniser answers, as _mask_rule's Rule: causal at delta with the chunk
    (C = 1 is the diagonal band; a chunk holding every key is plain causal), and SDPA with it
    equals the tensor path bit for bit and PyTorch within the tolerance."""
    vis = chunk_mask(n, m, C, delta)
    mask = vis if form == "bool" else additive(vis)
    B, h = 2, 2
    rule = _mask_rule.lookup(mask, mask, form == "float", 0, B, h, n, m)
    assert rule is not None and rule.hi == delta and rule.keys is None
    if C == 1:
        assert (rule.lo, rule.chunk) == (delta, 0)
    elif C >= m and delta == 0:
        assert (rule.lo, rule.chunk) == (None, 0)
    else:
        assert (rule.lo, rule.chunk) == (None, C)
    q, k, v = qkv(B=B, h=h, n=n, m=m, grad=True)

    def run():
        out = mt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return (out.detach(),) + torch.autograd.grad(out.sum(), (q, k, v))

    ruled, tensor = both_paths(run)
    assert SUBSTITUTED == [True] * len(SUBSTITUTED) and SUBSTITUTED
    for a, b in zip(ruled, tensor):
        assert torch.equal(a, b)
    ref = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), attn_mask=mask)
    ok = ~torch.isnan(ref)
    close(ruled[0][ok], ref[ok])


def test_chunk_rule_with_the_calls_own_chunk():
    """torch.ops.mha.attention with a model chunk_size (Llama 4) and a chunked tensor: the rule
    replaces the tensor when it is the model's own chunk at the same diagonal, or when the call
    has none; a different C or diagonal keeps the tensor; the results equal the tensor's."""
    n, m = 12, 20
    q, k, v = qkv(n=n, m=m)
    for C, delta in ((4, m - n), (4, 0), (8, m - n), (3, m - n), (None, 0), (None, m - n)):
        # C None: a plain causal tensor, whose rule must not move the model's chunk either
        attend = chunk_mask(n, m, C or 2 * m, delta)
        for model_chunk in (0, 4):
            model = (0.0, False, None, -1, -1, True, model_chunk)  # bottom-right
            ruled, tensor = both_paths(lambda: torch.ops.mha.attention(
                q, k, v, attend, None, False, 0.25, 0.0, None, False, False, 0, *model))
            assert torch.equal(ruled[0], tensor[0]) and torch.equal(ruled[1], tensor[1]), \
                (C, delta, model_chunk)
            want = model_chunk == 0 or (C in (None, model_chunk) and delta == m - n)
            assert SUBSTITUTED == [want], (C, delta, model_chunk, SUBSTITUTED)


def test_multihead_attention_chunk_mask():
    """mha.torch.MultiheadAttention with nn.MHA's block mask (True = masked) of a chunked causal
    mask, bool and float: substituted, equal to the tensor path and to torch.nn's."""
    torch.manual_seed(0)
    B, n, E, h = 2, 13, 24, 4
    layer = mt.MultiheadAttention(E, h, batch_first=True)
    ref_layer = torch.nn.MultiheadAttention(E, h, batch_first=True)
    ref_layer.load_state_dict(layer.state_dict())
    x = torch.randn(B, n, E)
    vis = chunk_mask(n, n, 4)
    for am in (~vis, additive(vis)):
        ruled, tensor = both_paths(lambda: layer(x, x, x, attn_mask=am))
        assert SUBSTITUTED == [True]
        assert torch.equal(ruled[0], tensor[0]) and torch.equal(ruled[1], tensor[1])
        with torch.no_grad():
            ref = ref_layer(x, x, x, attn_mask=am)
        close(ruled[0], ref[0])


@pytest.mark.parametrize("kind", ["bool 2-D", "bool 3-D", "float 2-D"])
@pytest.mark.parametrize("kpm", [None, "bool", "float"])
def test_multihead_attention_rule_equals_tensor(kind, kpm):
    torch.manual_seed(0)
    B, n, E, h = 3, 7, 24, 4
    layer = mt.MultiheadAttention(E, h, batch_first=True)
    ref_layer = torch.nn.MultiheadAttention(E, h, batch_first=True)
    ref_layer.load_state_dict(layer.state_dict())
    x = torch.randn(B, n, E)
    block = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)  # True = masked (nn.MHA)
    if kind == "bool 3-D":
        am = block.expand(B * h, n, n).contiguous()
    elif kind == "float 2-D":
        am = torch.nn.Transformer.generate_square_subsequent_mask(n)
    else:
        am = block
    pad = torch.zeros(B, n, dtype=torch.bool)
    pad[1, :2] = True  # left padding of batch row 1: its first query rows see no key
    kp = None if kpm is None else (pad if kpm == "bool" else
                                   torch.zeros(B, n).masked_fill(pad, float("-inf")))
    ruled, tensor = both_paths(lambda: layer(x, x, x, key_padding_mask=kp, attn_mask=am))
    assert SUBSTITUTED == [True]  # causal, bool or float
    assert torch.equal(ruled[0], tensor[0]) and torch.equal(ruled[1], tensor[1])
    with torch.no_grad():
        ref = ref_layer(x, x, x, key_padding_mask=kp, attn_mask=am)
    ok = ~torch.isnan(ref[0])
    close(ruled[0][ok], ref[0][ok])


def test_cache_hit_on_the_second_call():
    q, k, v = qkv()
    mask = torch.tril(torch.ones(9, 9, dtype=torch.bool))
    before = _mask_rule.recognize_calls
    first = mt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert _mask_rule.recognize_calls == before + 1
    second = mt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert _mask_rule.recognize_calls == before + 1  # the cache answered
    assert torch.equal(first, second)
    # A different view of the same memory is a different key (its shape and strides differ).
    mt.scaled_dot_product_attention(q, k, v, attn_mask=mask.view(1, 1, 9, 9))
    assert _mask_rule.recognize_calls == before + 2


def test_in_place_edit_is_seen():
    q, k, v = qkv()
    mask = torch.tril(torch.ones(9, 9, dtype=torch.bool))
    mt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    calls = _mask_rule.recognize_calls
    mask[3, 5] = True  # one key above the diagonal: no rule any more (version bumped)
    got = mt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert _mask_rule.recognize_calls == calls + 1
    close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    _mask_rule.enabled = False
    assert torch.equal(got, mt.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_freed_tensor_is_not_confused():
    q, k, v = qkv()
    causal = torch.tril(torch.ones(9, 9, dtype=torch.bool))
    mask = causal.clone()
    ptr = mask.data_ptr()
    mt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert len(_mask_rule._cache) == 1
    del mask
    gc.collect()
    assert len(_mask_rule._cache) == 0  # the entry died with the tensor
    # A new tensor, likely at the freed address (same size), with other contents.
    other = torch.ones(9, 9, dtype=torch.bool)
    other[4, 2] = False
    got = mt.scaled_dot_product_attention(q, k, v, attn_mask=other)
    close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=other))
    assert not torch.equal(got, mt.scaled_dot_product_attention(q, k, v, is_causal=True))
    print("address reused:", other.data_ptr() == ptr)


def test_cache_is_bounded():
    q, k, v = qkv()
    masks = [torch.tril(torch.ones(9, 9, dtype=torch.bool), d % 5) for d in range(50)]
    for mk in masks:
        mt.scaled_dot_product_attention(q, k, v, attn_mask=mk)
    assert len(_mask_rule._cache) == _mask_rule.CACHE_SIZE
    # The most recent ones are still cached.
    calls = _mask_rule.recognize_calls
    mt.scaled_dot_product_attention(q, k, v, attn_mask=masks[-1])
    assert _mask_rule.recognize_calls == calls


def random_mask(n=9, m=9, seed=3):
    """A bool mask that is no rule (random holes), every row seeing its diagonal."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(n, m, generator=g) > 0.4
    mask |= torch.eye(n, m, dtype=torch.bool)
    return mask


@pytest.mark.parametrize("contiguous", [True, False])
def test_block_mask_built_once_per_tensor(contiguous):
    """A mask tensor that is no rule: its block mask (mha_block_mask) is built once and serves
    the forward, the backward and the next step with the same tensor; results bit for bit those
    of the calls that build their own (block_masks off), and PyTorch's within the tolerance."""
    mask = random_mask() if contiguous else random_mask().t().contiguous().t()
    assert mask.is_contiguous() == contiguous

    def step():
        q, k, v = qkv(grad=True)
        out = mt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return (out.detach(),) + torch.autograd.grad(out.sum(), (q, k, v))

    builds = _mask_rule.block_mask_builds
    first = step()
    assert _mask_rule.block_mask_builds == builds + 1  # forward and backward: one build
    second = step()
    # The next step: none for a contiguous tensor. A strided one reaches the operator as a new
    # contiguous copy per call (the drop-in's conversion), which the cache cannot tell from a new
    # tensor: its forward and backward still share one build.
    assert _mask_rule.block_mask_builds == builds + (1 if contiguous else 2)
    _mask_rule.block_masks = False
    try:
        own = step()
    finally:
        _mask_rule.block_masks = True
    for a, b, c in zip(first, second, own):
        assert torch.equal(a, b) and torch.equal(a, c)
    q, k, v = qkv()
    close(first[0], F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_block_mask_follows_in_place_edits_and_frees():
    q, k, v = qkv()
    mask = random_mask()
    mt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    builds = _mask_rule.block_mask_builds
    mask[2, 7] = not mask[2, 7]  # version bumped: rebuilt
    got = mt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert _mask_rule.block_mask_builds == builds + 1
    close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    del mask
    gc.collect()
    assert len(_mask_rule._blocks) == 0  # the entries died with the tensor


@pytest.mark.parametrize("right_pad", [False, True])
def test_transformers_chunked_mask(right_pad):
    """Llama 4's chunked mask as the installed transformers builds it (sdpa_mask with
    chunked_causal_mask_function, [B, 1, n, m]; right padding in batch row 1): recognised as
    causal + chunk (+ key padding), SDPA bit for bit equal to the tensor path."""
    mu = pytest.importorskip("transformers.masking_utils")
    B, h, n, C = 2, 2, 24, 8
    am = torch.ones(B, n, dtype=torch.long)
    if right_pad:
        am[1, -3:] = 0
    fn = mu.chunked_causal_mask_function(C, torch.zeros(B, dtype=torch.long))
    mask = mu.sdpa_mask(batch_size=B, q_length=n, kv_length=n, mask_function=fn,
                        attention_mask=am, allow_is_causal_skip=False).bool()
    assert tuple(mask.shape) == (B, 1, n, n)
    rule = _mask_rule.lookup(mask, mask, False, 0, B, h, n, n)
    assert rule is not None and (rule.lo, rule.hi, rule.chunk) == (None, 0, C)
    assert (rule.keys is not None) == right_pad
    q, k, v = qkv(B=B, h=h, n=n, m=n, grad=True)

    def run():
        out = mt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return (out.detach(),) + torch.autograd.grad(out.sum(), (q, k, v))

    ruled, tensor = both_paths(run)
    assert SUBSTITUTED and SUBSTITUTED == [True] * len(SUBSTITUTED)
    for a, b in zip(ruled, tensor):
        assert torch.equal(a, b)
