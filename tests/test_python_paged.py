# SPDX-License-Identifier: MIT
"""The paged KV cache from Python (``KVCache(..., block_size=, num_blocks=)``, docs/INFERENCE.md
"Paged cache"): prefill and decode steps through a paged cache equal the contiguous cache's bit
for bit and the full causal forward (float64 of the same layer) within TOL_OUT_REL; fork and
share_prefix share blocks (free_blocks) without one sequence seeing the other's appends; an
exhausted pool refuses an append with nothing appended; bad sizes are refused naming the field.
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

D, H, G, DH = 64, 4, 2, 16


def make_layer(seed=3):
    rng = np.random.default_rng(seed)
    w = [rng.standard_normal(s).astype(np.float32) * 0.2
         for s in ((H * DH, D), (G * DH, D), (G * DH, D), (D, H * DH))]
    return mha.MultiheadAttention(*w, num_heads=H, num_kv_heads=G), rng


def close(got, ref):
    err = np.abs(np.asarray(got, np.float64) - ref).max()
    assert err <= TOL_OUT_REL * max(np.abs(ref).max(), 1.0), err


@pytest.mark.parametrize("dtype,window", [("float32", 0), ("bfloat16", 0), ("float16", 24)])
def test_paged_equals_contiguous(dtype, window):
    layer, rng = make_layer()
    n = 70
    x = rng.standard_normal((2, n, D)).astype(np.float32)
    caches = [layer.kv_cache(n, 2, dtype=dtype, window=window, max_step_tokens=8),
              layer.kv_cache(n, 2, dtype=dtype, window=window, max_step_tokens=8,
                             block_size=16)]
    outs = [[], []]
    for ci, c in enumerate(caches):
        # sequence 0: a 37-token prompt, sequence 1: 21 tokens; then steps of 1 token
        outs[ci].append(c.prefill(x[0, :37], seq_ids=[0]))
        outs[ci].append(c.prefill(x[1, :21], seq_ids=[1]))
        for i in range(21, 37):
            outs[ci].append(c.step(x[1, i:i + 1], seq_ids=[1]))
        for i in range(37, n):
            outs[ci].append(c.step(x[:, i:i + 1]))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    if dtype == "float32" and window == 0:
        full = layer(x, causal=True).astype(np.float64)
        close(np.concatenate([o[0] for o in outs[1][-(n - 37):]], 0), full[0, 37:])


def test_fork_share_prefix_and_pool():
    layer, rng = make_layer(4)
    x = rng.standard_normal((3, 40, D)).astype(np.float32)
    c = layer.kv_cache(64, 3, block_size=16, num_blocks=8)
    ref = layer.kv_cache(64, 3)
    assert c.free_blocks() == 8 and ref.free_blocks() == 0
    for cache in (c, ref):
        cache.prefill(x[0, :20], seq_ids=[0])
    assert c.free_blocks() == 6
    c.fork(0, 1)
    ref.fork(0, 1)
    assert c.free_blocks() == 6 and c.length(1) == 20
    # the fork's step copies the shared last block; the parent's next step is unchanged
    np.testing.assert_array_equal(c.step(x[1, 20:21], seq_ids=[1]),
                                  ref.step(x[1, 20:21], seq_ids=[1]))
    assert c.free_blocks() == 5
    np.testing.assert_array_equal(c.step(x[0, 20:21], seq_ids=[0]),
                                  ref.step(x[0, 20:21], seq_ids=[0]))
    c.share_prefix(0, 2, 16)
    ref.share_prefix(0, 2, 16)
    assert c.length(2) == 16 and c.free_blocks() == 5
    np.testing.assert_array_equal(c.step(x[2, 16:18], seq_ids=[2]),
                                  ref.step(x[2, 16:18], seq_ids=[2]))
    assert c.free_blocks() == 4
    # exhaustion: 30 more positions for each sequence need 2 + 2 + 1 blocks, 4 are free
    with pytest.raises(mha.MhaError, match="pool exhausted"):
        c.prefill(np.zeros((3, 30, D), np.float32))
    assert [c.length(s) for s in range(3)] == [21, 21, 18]
    assert c.length(2) == 18 and c.free_blocks() == 4
    for s in range(3):
        c.reset(s)
    assert c.free_blocks() == 8


def test_compact_changes_no_result():
    layer, rng = make_layer(6)
    x = rng.standard_normal((3, 60, D)).astype(np.float32)
    c = layer.kv_cache(64, 3, block_size=16)
    ref = layer.kv_cache(64, 3)
    for cache in (c, ref):  # lockstep growth, a fork and a reset: a scattered pool
        cache.prefill(x[:, :5])
        for i in range(5, 40):
            cache.step(x[:, i:i + 1])
        cache.fork(1, 2)
        cache.reset(0)
        cache.prefill(x[0, :20], seq_ids=[0])
    free = c.free_blocks()
    c.compact()
    ref.compact()  # a contiguous cache: nothing to do
    assert c.free_blocks() == free
    for i in range(40, 50):  # steps after the compaction, the fork copying its shared block
        np.testing.assert_array_equal(c.step(x[:, i:i + 1]), ref.step(x[:, i:i + 1]))
    for s in range(3):
        np.testing.assert_array_equal(c.read(s, 3)[0], ref.read(s, 3)[0])


def test_refused():
    layer, _ = make_layer()
    with pytest.raises(mha.MhaError, match="block_size"):
        layer.kv_cache(64, block_size=8)
    with pytest.raises(mha.MhaError, match="num_blocks"):
        layer.kv_cache(64, num_blocks=4)


def test_integer_arguments_checked():
    # ctypes passes a Python int modulo 2^64: 2^64 + 3 would be 3, another length or sequence
    # without a word; accept() would cast float draft indices to int64 (0.9 -> 0). Both refused.
    c = mha.KVCache(None, 64, 2, num_kv_heads=1, head_dim=16, block_size=16)
    k = np.random.default_rng(0).standard_normal((1, 8, 1, 16)).astype(np.float32)
    c.append(k, k, seq_ids=[0])
    for call in (lambda: c.truncate(0, 2 ** 64 + 3), lambda: c.read(2 ** 64, 1),
                 lambda: c.fork(0, 2 ** 64 + 1), lambda: c.length(2 ** 64),
                 lambda: c.share_prefix(0, 1, 2 ** 64 + 2), lambda: c.reset(-2 ** 64)):
        with pytest.raises(ValueError, match="outside int64"):
            call()
    with pytest.raises(TypeError, match="draft_idx"):
        c.accept(0, 2, [0.9, 2.7])
    with pytest.raises(TypeError, match="pos"):
        c.read(0, 1.5)
    assert c.length(0) == 8 and c.length(1) == 0
    np.testing.assert_array_equal(c.read(0, 7)[0], k[0, 7])
    c.accept(0, 2, np.array([1, 3], np.uint8))  # integer arrays of any width
    assert c.length(0) == 4
    np.testing.assert_array_equal(c.read(0, 3)[0], k[0, 5])
