# SPDX-License-Identifier: MIT
"""Speculative tree verification from Python (docs/SEMANTICS.md "Draft trees"):
``KVCache.step(x, tree_parents=...)`` equals a NumPy float64 oracle of the layer written from the
definition (positions by depth, ancestors-or-self visible, ALiBi distances by position), and
``KVCache.accept`` + a step equals the oracle over the accepted path. Bad trees are refused.
"""
import os
import sys

import numpy as np
import pytest

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))

import mha  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tolerances import TOL_KV_BF16_REL, TOL_OUT_REL  # noqa: E402

D, H, G, DK = 32, 4, 2, 8


def oracle(w, x, pos, vis):
    """float64 layer without RoPE, ALiBi on: x [n, D], pos [n], vis [n, n] (query, key)."""
    wq, wk, wv, wo = (a.astype(np.float64) for a in w)
    x = x.astype(np.float64)
    q = (x @ wq.T).reshape(-1, H, DK)
    k = (x @ wk.T).reshape(-1, G, DK)
    v = (x @ wv.T).reshape(-1, G, DK)
    slopes = 2.0 ** (-8.0 / H * np.arange(1, H + 1))
    out = np.zeros((x.shape[0], H, DK))
    for h in range(H):
        g = h // (H // G)
        s = q[:, h] @ k[:, g].T / np.sqrt(DK) - slopes[h] * (pos[:, None] - pos[None, :])
        s = np.where(vis, s, -np.inf)
        p = np.exp(s - s.max(1, keepdims=True))
        out[:, h] = (p / p.sum(1, keepdims=True)) @ v[:, g]
    return out.reshape(x.shape[0], -1) @ wo.T


def tree_rows(n0, parents):
    """Positions and visibility of a prefix of n0 tokens followed by the drafts."""
    t = len(parents)
    depth = [0] * t
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    pos = np.concatenate([np.arange(n0), n0 + np.array(depth)])
    vis = np.tril(np.ones((n0 + t, n0 + t), bool))
    vis[n0:, n0:] = False
    for i in range(t):
        a = i
        while a >= 0:
            vis[n0 + i, n0 + a] = True
            a = parents[a]
    return pos, vis


def close(got, ref):
    err = np.abs(np.asarray(got, np.float64) - ref).max()
    assert err <= TOL_OUT_REL * max(np.abs(ref).max(), 1.0), err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tree_step_and_accept(dtype):
    rng = np.random.default_rng(3)
    w = [rng.standard_normal(s).astype(np.float32) * 0.3
         for s in ((H * DK, D), (G * DK, D), (G * DK, D), (D, H * DK))]
    layer = mha.MultiheadAttention(*w, num_heads=H, num_kv_heads=G, alibi=True)
    parents = [-1, 0, 0, 1, 1, 2, -1, 6]
    n0, t = 29, len(parents)
    x = rng.standard_normal((n0 + t, D)).astype(np.float32)
    cache = layer.kv_cache(64, dtype=dtype)
    cache.prefill(x[:n0])
    got = cache.step(x[n0:], tree_parents=parents, threads=2)
    pos, vis = tree_rows(n0, parents)
    ref = oracle(w, x, pos, vis)[n0:]
    if dtype == "float32":
        close(got, ref)
    else:  # K/V rounded to bfloat16
        assert np.abs(got - ref).max() <= TOL_KV_BF16_REL * np.abs(ref).max()
    # keep the path 0 -> 2 -> 5, then one more token: the oracle over prefix + path + token
    cache.accept(0, n0, [0, 2, 5])
    assert cache.length(0) == n0 + 3
    xn = rng.standard_normal((1, D)).astype(np.float32)
    y = cache.step(xn)
    xs = np.concatenate([x[:n0], x[n0 + np.array([0, 2, 5])], xn])
    n = xs.shape[0]
    ref = oracle(w, xs, np.arange(n), np.tril(np.ones((n, n), bool)))[-1:]
    tol = TOL_OUT_REL if dtype == "float32" else TOL_KV_BF16_REL
    assert np.abs(y - ref).max() <= tol * max(np.abs(ref).max(), 1.0)


def test_refused():
    rng = np.random.default_rng(4)
    w = [rng.standard_normal(s).astype(np.float32)
         for s in ((H * DK, D), (G * DK, D), (G * DK, D), (D, H * DK))]
    layer = mha.MultiheadAttention(*w, num_heads=H, num_kv_heads=G)
    cache = layer.kv_cache(64)
    x = rng.standard_normal((3, D)).astype(np.float32)
    with pytest.raises(mha.MhaError, match="tree_parents"):
        cache.step(x, tree_parents=[-1, 1, 0])
    assert cache.length(0) == 0
    cache.step(x, tree_parents=[-1, 0, 0])
    with pytest.raises(mha.MhaError, match="draft_idx"):
        cache.accept(0, 0, [1, 1])
    assert cache.length(0) == 3
