# SPDX-License-Identifier: MIT
"""Chunked attention from Python (``chunk_size=``, Llama 4's attention_chunk_size; docs/SEMANTICS.md
"Chunked attention"): mha.attention, attention_backward, MultiheadAttention.forward and the
KV cache equal the same attention with the rule written out as an explicit boolean mask (NumPy),
the mask equals transformers' own chunked causal mask (masking_utils, at the cache positions of
a decode step too), and the outputs equal float64 torch on that mask. Bad values are refused
naming chunk_size.
"""
import os
import sys

import numpy as np
import pytest

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))

import mha  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tolerances import TOL_OUT_REL  # noqa: E402


def chunk_mask(n, m, C, causal=True, delta=None):
    """[n, m] bool: query i (p = i + delta, bottom-right delta = m - n) sees key j."""
    delta = m - n if delta is None else delta
    p = np.arange(n)[:, None] + delta
    j = np.arange(m)[None, :]
    vis = (j // C) == (p // C)  # floor division, also for p < 0
    return vis & (j <= p) if causal else vis


def rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def close(got, ref):
    err = np.abs(np.asarray(got, np.float64) - ref).max()
    assert err <= TOL_OUT_REL * max(np.abs(ref).max(), 1.0), err


@pytest.mark.parametrize("n,m,C,causal", [(200, 200, 48, True), (70, 230, 40, True),
                                          (130, 130, 50, False), (64, 64, 1, True),
                                          (90, 90, 1000, True)])
def test_attention_equals_explicit_mask(n, m, C, causal):
    q, k, v = rand((2, 4, n, 16), 1), rand((2, 2, m, 16), 2), rand((2, 2, m, 16), 3)
    got, lse = mha.attention(q, k, v, causal=causal, chunk_size=C, return_lse=True)
    msk = chunk_mask(n, m, C, causal)
    ref, lse_ref = mha.attention(q, k, v, mask=msk, return_lse=True)
    np.testing.assert_array_equal(got, ref)  # the rule and its tensor: the same tiles, bits
    np.testing.assert_array_equal(lse, lse_ref)
    # float64 torch on the explicit mask (an independent computation)
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    t = [torch.from_numpy(x).double() for x in (q, k, v)]
    kk, vv = (x.repeat_interleave(2, dim=1) for x in t[1:])
    mt = torch.from_numpy(msk)
    o = F.scaled_dot_product_attention(t[0], kk, vv, attn_mask=mt)
    o = torch.where(mt.any(-1)[..., None], o, torch.zeros_like(o))  # fully masked rows: 0
    close(got, o.numpy())


def test_backward_equals_explicit_mask():
    n, C = 150, 40
    q, k, v, do = (rand((1, 2, n, 8), s) for s in range(4))
    out, lse = mha.attention(q, k, v, causal=True, chunk_size=C, return_lse=True)
    g = mha.attention_backward(do, q, k, v, out, lse, causal=True, chunk_size=C)
    msk = chunk_mask(n, n, C)
    out2, lse2 = mha.attention(q, k, v, mask=msk, return_lse=True)
    g2 = mha.attention_backward(do, q, k, v, out2, lse2, mask=msk)
    for a, b in zip(g, g2):
        np.testing.assert_array_equal(a, b)


def test_matches_transformers_chunked_causal_mask():
    """transformers' Llama 4 mask (masking_utils: causal AND chunked_overlay) at the cache
    positions of a prefill and of a later step: kv_idx // C == q_idx // C with q_idx the cache
    position, i.e. our rule with bottom-right alignment."""
    torch = pytest.importorskip("torch")
    mu = pytest.importorskip("transformers.masking_utils")
    C = 8
    for n, m in [(20, 20), (5, 27), (1, 17)]:
        cache_pos = torch.arange(m - n, m)
        fn = mu.and_masks(mu.causal_mask_function,
                          mu.chunked_overlay(C, torch.zeros(1, dtype=torch.long)))
        zero = torch.tensor(0)
        hf = fn(zero, zero, cache_pos[:, None], torch.arange(m)[None, :]).numpy()
        np.testing.assert_array_equal(hf, chunk_mask(n, m, C))


def test_layer_forward_and_kv_cache():
    rng = np.random.default_rng(5)
    D, h, g, d = 32, 4, 2, 8
    w = [rng.standard_normal(s).astype(np.float32) * 0.2
         for s in ((h * d, D), (g * d, D), (g * d, D), (D, h * d))]
    layer = mha.MultiheadAttention(*w, num_heads=h, num_kv_heads=g)
    n, C = 45, 16
    x = rng.standard_normal((1, n, D)).astype(np.float32)
    y = layer(x, causal=True, chunk_size=C)
    close(y, layer(x, mask=chunk_mask(n, n, C)).astype(np.float64))
    # decode through a chunk cache, token by token and in steps of 5: the full forward's rows
    for step in (1, 5):
        cache = layer.kv_cache(n, chunk_size=C, max_step_tokens=step)
        rows = [cache.step(x[0, i:i + step]) for i in range(0, n, step)]
        close(np.concatenate(rows, 0), y[0].astype(np.float64))


def test_refused():
    q = rand((1, 1, 4, 4), 0)
    with pytest.raises(mha.MhaError, match="chunk_size"):
        mha.attention(q, q, q, chunk_size=-1)
    with pytest.raises(TypeError, match="chunk_size"):
        mha.attention(q, q, q, chunk_size=1.5)
    layer = mha.MultiheadAttention(*(rand((8, 8), i) for i in range(4)), num_heads=2)
    with pytest.raises(mha.MhaError, match="chunk_size"):
        layer.kv_cache(16, chunk_size=-4)
    with pytest.raises(mha.MhaError, match="chunk_size"):
        layer.kv_cache(16, chunk_size=4, window=2)


def test_cli_chunk_size(tmp_path):
    """mha run --chunk-size C (forward and --decode) equals the same run with the explicit mask
    (--mask) and the Python layer; a bad value is refused naming --chunk-size."""
    import subprocess
    from test_cli import make_weights, write_safetensors
    cli = os.environ.get("MHA_CLI")
    if not cli:
        pytest.skip("MHA_CLI not set")
    rng = np.random.default_rng(3)
    w = make_weights(rng)
    w = {k: v.astype(np.float32) for k, v in w.items()}
    write_safetensors(tmp_path / "W.safetensors", w)
    n, C = 37, 8
    x = rng.standard_normal((1, n, 16)).astype(np.float32)
    np.save(tmp_path / "X.npy", x)
    np.save(tmp_path / "M.npy", chunk_mask(n, n, C))

    def run(*extra):
        out = tmp_path / "Y.npy"
        r = subprocess.run([cli, "run", "--weights", str(tmp_path / "W.safetensors"), "--heads",
                            "4", "--input", str(tmp_path / "X.npy"), "--out", str(out),
                            *extra], capture_output=True, text=True, timeout=120)
        return r, (np.load(out) if r.returncode == 0 else None)

    r1, y1 = run("--causal", "--chunk-size", str(C))
    assert r1.returncode == 0, r1.stderr
    r2, y2 = run("--mask", str(tmp_path / "M.npy"))
    assert r2.returncode == 0, r2.stderr
    np.testing.assert_array_equal(y1, y2)
    r3, y3 = run("--decode", "--prefill", "3", "--chunk-size", str(C))
    assert r3.returncode == 0, r3.stderr
    close(y3, y1.astype(np.float64))
    for bad in ("0", "-2", "x"):
        r, _ = run("--causal", "--chunk-size", bad)
        assert r.returncode != 0 and "--chunk-size" in r.stderr, r.stderr


def test_torch_op_chunk_size():
    """torch.ops.mha.attention(..., chunk_size=C): output and autograd gradients equal those of
    the same call with the chunk rule as its attend mask (bit for bit)."""
    torch = pytest.importorskip("torch")
    import mha.torch  # noqa: F401  (registers the operators)
    n, C = 96, 24
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(1, 2, n, 16, generator=g) for _ in range(3)]
    mask = torch.from_numpy(chunk_mask(n, n, C))

    def run(attend, chunk):
        q, k, v = (t.clone().requires_grad_() for t in base)
        o = torch.ops.mha.attention(q, k, v, attend, None, attend is None, 0.0, 0.0, None,
                                    False, False, 0, 0.0, False, None, -1, -1, True, chunk)[0]
        o.sum().backward()
        return [o.detach(), q.grad, k.grad, v.grad]

    for a, b in zip(run(None, C), run(mask, 0)):
        assert torch.equal(a, b)


def test_attention_stats_equal_explicit_mask():
    """The statistics (no n x m matrix) with chunk_size equal those with the explicit mask."""
    n, C = 160, 40
    q, k = rand((1, 2, n, 16), 7), rand((1, 2, n, 16), 8)
    a = mha.attention_stats(q, k, stats="received,entropy,topk=4", causal=True, chunk_size=C)
    b = mha.attention_stats(q, k, stats="received,entropy,topk=4", mask=chunk_mask(n, n, C))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
