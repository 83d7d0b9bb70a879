# SPDX-License-Identifier: MIT
"""The NumPy KVCache's core-level calls (mha_kv_cache_append / _attention / _read): a cache made
without a layer (``mha.KVCache(None, ..., num_kv_heads=g, head_dim=d)``), post-RoPE K/V appended
by the caller, and the attention of given queries over it, against a float64 NumPy oracle written
from docs/SEMANTICS.md "Scores, masks and the softmax" over the cache's own stored values
(``read``: exact for float32, the rounded values for the other dtypes, so every dtype is gated at
the float32 arithmetic's TOL_OUT_REL). Options: GQA, scale, softcap, ALiBi, sinks, window and
chunk rings, sequences of different lengths in one call, lse, a draft tree. Paged equals
contiguous bit for bit. Bad input raises, and nothing is appended."""
import os
import sys

import numpy as np
import pytest

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))

import mha  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tolerances import TOL_OUT_REL  # noqa: E402

H, G, D, DV = 4, 2, 32, 64


def slopes(h):
    """ALiBi slopes (docs/SEMANTICS.md): 2^(-8(k+1)/h) for a power of two h."""
    assert h & (h - 1) == 0
    return 2.0 ** (-8.0 * (np.arange(h) + 1) / h)


def oracle(cache, seq, q, *, scale=None, softcap=0.0, alibi=False, sinks=None):
    """float64 attention of q [t, h, d] (the last t positions of `seq`) over the stored K/V."""
    L = cache.length(seq)
    t, h, d = q.shape
    grp = h // cache.num_kv_heads
    W, C = cache.window, cache.chunk_size
    lo = max(0, L - cache.max_seq) if not (W or C) else 0
    keys = {}
    for j in range(lo, L):
        try:
            keys[j] = cache.read(seq, j)
        except mha.MhaError:  # dropped from a ring: must be invisible anyway (checked below)
            pass
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((t, h, cache.v_head_dim))
    lse = np.zeros((h, t))
    for i in range(t):
        p = L - t + i
        vis = [j for j in range(p + 1) if (not W or j > p - W) and (not C or j // C == p // C)]
        assert all(j in keys for j in vis), (p, vis)
        for hh in range(h):
            kv = hh // grp
            K = np.stack([keys[j][0][kv] for j in vis]).astype(np.float64)
            V = np.stack([keys[j][1][kv] for j in vis]).astype(np.float64)
            s = scale * (K @ q[i, hh].astype(np.float64))
            if softcap:
                s = softcap * np.tanh(s / softcap)
            if alibi:
                s = s - slopes(h)[hh] * np.abs(p - np.array(vis))
            m = s.max() if sinks is None else max(s.max(), float(sinks[hh]))
            e = np.exp(s - m)
            den = e.sum() + (0.0 if sinks is None else np.exp(float(sinks[hh]) - m))
            out[i, hh] = (e @ V) / den
            lse[hh, i] = m + np.log(den)
    return out, lse


def fill(cache, rng, lengths, step):
    """Appends random K/V: each sequence to its length, `step` tokens at a time (all listed
    sequences advance together while they can, as a server's batched steps)."""
    n = len(lengths)
    done = [0] * n
    while any(done[s] < lengths[s] for s in range(n)):
        ids = [s for s in range(n) if done[s] < lengths[s]]
        t = min(step, *(lengths[s] - done[s] for s in ids))
        k = rng.standard_normal((len(ids), t, cache.num_kv_heads, cache.head_dim))
        v = rng.standard_normal((len(ids), t, cache.num_kv_heads, cache.v_head_dim))
        cache.append(k.astype(np.float32), v.astype(np.float32), seq_ids=ids)
        for s in ids:
            done[s] += t


OPTIONS = {
    "plain": {},
    "scale_softcap": dict(scale=0.3, softcap=2.0),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=np.array([0.5, -1.0, 2.0, 0.0], np.float32)),
}
CACHES = {
    "f32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "q8_0": dict(dtype="q8_0"),
    "fp8": dict(dtype="fp8_e4m3"),
    "window": dict(dtype="float32", window=7, max_step_tokens=4),
    "chunk": dict(dtype="float16", chunk_size=8, max_step_tokens=4),
    "paged": dict(dtype="float32", block_size=16),
}


@pytest.mark.parametrize("opt", list(OPTIONS))
@pytest.mark.parametrize("kind", list(CACHES))
def test_attention_matches_float64_oracle(opt, kind):
    rng = np.random.default_rng(hash((opt, kind)) % 2**32)
    cache = mha.KVCache(None, 40, 3, num_kv_heads=G, head_dim=D, v_head_dim=DV, **CACHES[kind])
    assert (cache.num_kv_heads, cache.head_dim, cache.v_head_dim) == (G, D, DV)
    lengths = [29, 3, 17]
    fill(cache, rng, lengths, 4)
    assert [cache.length(s) for s in range(3)] == lengths
    for t, ids in ((1, [0, 1, 2]), (3, [2, 0]), (2, [1])):
        q = rng.standard_normal((len(ids), t, H, D)).astype(np.float32)
        out, lse = cache.attention(q, seq_ids=ids, return_lse=True, threads=2, **OPTIONS[opt])
        assert out.shape == (len(ids), t, H, DV) and lse.shape == (len(ids), H, t)
        for n, s in enumerate(ids):
            want, wlse = oracle(cache, s, q[n], **OPTIONS[opt])
            err = np.abs(out[n] - want).max() / np.abs(want).max()
            assert err <= TOL_OUT_REL, (opt, kind, t, s, err)
            assert np.abs(lse[n] - wlse).max() <= TOL_OUT_REL * np.abs(wlse).max() + 1e-6
        # one thread, sequence by sequence: the same bits (split-KV is thread-count independent)
        for n, s in enumerate(ids):
            one = cache.attention(q[n:n + 1], seq_ids=[s], threads=1, **OPTIONS[opt])
            assert np.array_equal(one[0], out[n])
        if 0 in ids:  # q without the sequence axis: sequence 0
            assert np.array_equal(cache.attention(q[ids.index(0)], **OPTIONS[opt]),
                                  out[ids.index(0)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "q8_0"])
def test_paged_equals_contiguous_bit_for_bit(dtype):
    rng = np.random.default_rng(3)
    caches = [mha.KVCache(None, 300, 2, num_kv_heads=G, head_dim=D, dtype=dtype, block_size=b)
              for b in (0, 16, 64)]
    k = rng.standard_normal((2, 280, G, D)).astype(np.float32)
    v = rng.standard_normal((2, 280, G, D)).astype(np.float32)
    q = rng.standard_normal((2, 1, H, D)).astype(np.float32)
    outs = []
    for c in caches:
        c.append(k[:, :200], v[:, :200])
        c.append(k[:1, 200:], v[:1, 200:], seq_ids=[0])  # different lengths
        outs.append(c.attention(q, threads=2))
    assert caches[1].free_blocks() == caches[1].num_blocks - (280 // 16 + 1) - (200 // 16 + 1)
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])


def test_bad_input_raises_and_appends_nothing():
    rng = np.random.default_rng(5)
    cache = mha.KVCache(None, 8, 2, num_kv_heads=G, head_dim=D)
    k = rng.standard_normal((2, 6, G, D)).astype(np.float32)
    cache.append(k, k)
    with pytest.raises(mha.MhaError, match="max_seq"):
        cache.append(k[:, :3], k[:, :3])  # 6 + 3 > 8
    assert cache.length(0) == cache.length(1) == 6
    with pytest.raises(ValueError, match="k: expected"):
        cache.append(k[..., :16], k)
    with pytest.raises(ValueError, match="v: expected"):
        cache.append(k, k[:, :5])
    with pytest.raises(ValueError, match="q: expected"):
        cache.attention(np.zeros((2, 1, H, 16), np.float32))
    with pytest.raises(mha.MhaError):  # t beyond a sequence's length
        cache.attention(np.zeros((2, 7, H, D), np.float32))
    with pytest.raises(mha.MhaError):  # h not a multiple of g
        cache.attention(np.zeros((2, 1, 3, D), np.float32))
    with pytest.raises(ValueError, match="sinks"):
        cache.attention(np.zeros((2, 1, H, D), np.float32), sinks=[1.0])
    with pytest.raises(ValueError, match="scale"):
        cache.attention(np.zeros((2, 1, H, D), np.float32), scale=0.0)
    with pytest.raises(mha.MhaError):
        cache.attention(np.zeros((1, 1, H, D), np.float32), seq_ids=[2])
    with pytest.raises(ValueError, match="num_kv_heads"):
        mha.KVCache(None, 8, 1, head_dim=D)
    with pytest.raises(ValueError, match="no layer"):
        cache.step(np.zeros((1, 64), np.float32))
    with pytest.raises(mha.MhaError):
        cache.read(0, 6)
    assert cache.length(0) == cache.length(1) == 6


def test_draft_tree_attention():
    # tree_parents: the last t positions are drafts; draft i sees the keys before the drafts and
    # its ancestors-or-self (docs/SEMANTICS.md "Draft trees"). A chain given as a tree is the
    # plain call, bit for bit.
    rng = np.random.default_rng(11)
    cache = mha.KVCache(None, 64, 2, num_kv_heads=G, head_dim=D, block_size=16)
    fill(cache, rng, [30, 21], 8)
    parents = [-1, 0, 0, 1, 3]
    t = len(parents)
    q = rng.standard_normal((2, t, H, D)).astype(np.float32)
    out = cache.attention(q, tree_parents=parents, sinks=OPTIONS["sinks"]["sinks"])
    chain = cache.attention(q, tree_parents=[-1, 0, 1, 2, 3])
    assert np.array_equal(chain, cache.attention(q))
    plain = cache.attention(q, sinks=OPTIONS["sinks"]["sinks"])
    assert np.array_equal(out[:, :2], plain[:, :2]) and not np.array_equal(out[:, 2:], plain[:, 2:])
    for s in range(2):
        L = cache.length(s)
        base = L - t
        keys = [cache.read(s, j) for j in range(L)]
        for i in range(t):
            anc, a = [], i
            while a >= 0:
                anc.append(a)
                a = parents[a]
            vis = list(range(base)) + [base + a for a in sorted(anc)]
            for hh in range(H):
                K = np.stack([keys[j][0][hh // (H // G)] for j in vis]).astype(np.float64)
                V = np.stack([keys[j][1][hh // (H // G)] for j in vis]).astype(np.float64)
                sc = (K @ q[s, i, hh].astype(np.float64)) / np.sqrt(D)
                sink = float(OPTIONS["sinks"]["sinks"][hh])
                m = max(sc.max(), sink)
                e = np.exp(sc - m)
                want = (e @ V) / (e.sum() + np.exp(sink - m))
                err = np.abs(out[s, i, hh] - want).max() / np.abs(want).max()
                assert err <= TOL_OUT_REL, (s, i, hh, err)
