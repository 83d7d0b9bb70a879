# SPDX-License-Identifier: MIT
"""The 8-bit KV caches through Python (docs/SEMANTICS.md "q8_0 KV cache", "fp8 KV cache"):
``layer.kv_cache(..., dtype="q8_0" | "fp8_e4m3")`` decodes like the float32 cache up to the
quantisation (the numerics against float64 are tested in tests/test_kv_q8.c and test_kv_fp8.c;
here the faces: dtypes accepted, fp8 scales set / refused, outputs near the float32 cache's)."""
import os
import sys

import numpy as np
import pytest

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))

import mha  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tolerances import TOL_FP8_REL  # noqa: E402


def make_layer(rng):
    D, h, g, d = 64, 4, 2, 32
    w = [rng.standard_normal(s).astype(np.float32) * 0.2
         for s in ((h * d, D), (g * d, D), (g * d, D), (D, h * d))]
    return mha.MultiheadAttention(*w, num_heads=h, num_kv_heads=g)


def decode(layer, x, dtype, scales=None):
    cache = layer.kv_cache(x.shape[1], dtype=dtype)
    if scales is not None:
        cache.set_fp8_scales(*scales)
    rows = [cache.prefill(x[0, :20])]
    rows += [cache.step(x[0, i:i + 1]) for i in range(20, x.shape[1])]
    return np.concatenate(rows, 0)


@pytest.mark.parametrize("dtype,scales", [("q8_0", None), ("fp8_e4m3", None),
                                          ("fp8_e4m3", ([0.01, 0.02], [0.005, 0.01]))])
def test_decode_near_float32(dtype, scales):
    rng = np.random.default_rng(7)
    layer = make_layer(rng)
    x = rng.standard_normal((1, 40, 64)).astype(np.float32)
    ref = decode(layer, x, "float32")
    got = decode(layer, x, dtype, scales)
    assert np.all(np.isfinite(got))
    assert not np.array_equal(got, ref)  # the cache did quantise
    # each K/V value within 2^-4 relative (fp8) or 1/254 of its block's max (q8_0): outputs of
    # this size stay within a few of that relative to their scale
    err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
    assert err < 4 * TOL_FP8_REL, err


def test_fp8_scales_refused():
    rng = np.random.default_rng(8)
    layer = make_layer(rng)
    cache = layer.kv_cache(8, dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="k_scales"):
        cache.set_fp8_scales([1.0, 2.0, 3.0])
    with pytest.raises(mha.MhaError, match="v_scales"):
        cache.set_fp8_scales(None, [1.0, 0.0])
    cache.prefill(rng.standard_normal((2, 64)).astype(np.float32))
    with pytest.raises(mha.MhaError, match="holds 2 positions"):
        cache.set_fp8_scales([1.0, 1.0], [1.0, 1.0])
    with pytest.raises(mha.MhaError, match="FP8_E4M3"):
        layer.kv_cache(8, dtype="q8_0").set_fp8_scales([1.0, 1.0])
    with pytest.raises(ValueError, match="dtype"):
        layer.kv_cache(8, dtype="fp8")
