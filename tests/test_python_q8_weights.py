# SPDX-License-Identifier: MIT
"""q8_0 projection weights through the NumPy face (docs/SEMANTICS.md "q8_0 weights"):
``mha.MultiheadAttention(..., weight_dtype="q8_0")`` quantises the four projection matrices to
ggml's q8_0 blocks and computes exactly the float32 layer on the dequantised weights.

Checked: ``weights`` returns the dequantised matrices (and the float32 biases as given); the
forward and the KV-cache prefill + steps are bit-identical to a float32 layer built on those
weights (threads 1 and 2; the steps not where the GEMM tier scales q8_0 block sums, the AVX2
tier: ``mha info`` of MHA_CLI tells) and within TOL_OUT_REL of a float64 NumPy oracle on them; bad
arguments (input features not a multiple of 32, an unknown weight_dtype, forward_train) raise.
The C test tests/test_q8_weights.c checks every GEMM tier and the rounding bound.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_python_api  # noqa: E402,F401  (builds mha._fastcall before mha is imported)

import mha  # noqa: E402
from tolerances import TOL_OUT_REL  # noqa: E402

E, H, G, D, B, N = 128, 4, 2, 32, 2, 13


def make(rng, bias=True):
    w = {"w_q": rng.standard_normal((H * D, E)), "w_k": rng.standard_normal((G * D, E)),
         "w_v": rng.standard_normal((G * D, E)), "w_o": rng.standard_normal((E, H * D))}
    w = {k: (v / np.sqrt(E)).astype(np.float32) for k, v in w.items()}
    if bias:
        for nm, n in (("b_q", H * D), ("b_k", G * D), ("b_v", G * D), ("b_o", E)):
            w[nm] = (0.1 * rng.standard_normal(n)).astype(np.float32)
    return w


def gemm_block_sums():
    """Whether the layer's float32 GEMM tier (the first usable f32 gemm line of ``mha info``,
    under MHA_MAX_ISA) scales each q8_0 block's partial sums on the few-rows path
    (docs/SEMANTICS.md "q8_0 weights": the AVX2 tier), so that decode steps are not the float32
    twin's bits; None without MHA_CLI."""
    cli = os.environ.get("MHA_CLI")
    if not cli:
        return None
    info = subprocess.run([cli, "info"], capture_output=True, text=True, check=True).stdout
    for line in info.splitlines():
        f = line.replace("*", " ").split()
        if len(f) >= 3 and f[0] == "gemm" and "_f32_" in f[1] and f[-1] == "usable":
            return f[1].endswith("__avx2")
    return None


def oracle(w, x):
    """float64 causal GQA layer without RoPE: x [B, N, E]."""
    f = {k: v.astype(np.float64) for k, v in w.items()}
    x = x.astype(np.float64)
    q = x @ f["w_q"].T + f.get("b_q", 0.0)
    k = x @ f["w_k"].T + f.get("b_k", 0.0)
    v = x @ f["w_v"].T + f.get("b_v", 0.0)
    q = q.reshape(B, N, H, D)
    k = np.repeat(k.reshape(B, N, G, D), H // G, axis=2)
    v = np.repeat(v.reshape(B, N, G, D), H // G, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(D)
    s = np.where(np.tril(np.ones((N, N), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    a = np.einsum("bhij,bjhd->bihd", p, v).reshape(B, N, H * D)
    return a @ f["w_o"].T + f.get("b_o", 0.0)


@pytest.mark.parametrize("bias", [True, False])
def test_q8_layer_matches_dequantised_float_layer(bias):
    rng = np.random.default_rng(32 + bias)
    w = make(rng, bias)
    lq = mha.MultiheadAttention(**w, num_heads=H, num_kv_heads=G, weight_dtype="q8_0")
    assert lq.config.weight_dtype == "q8_0"
    deq = lq.weights
    for nm in ("w_q", "w_k", "w_v", "w_o"):
        assert deq[nm].dtype == np.float32 and deq[nm].shape == w[nm].shape
        # per block of 32: |w - deq| <= max|w| / 254 (1 + 2^-11) + 127 2^-25 (TOL_Q8_ELEM)
        blocks = w[nm].astype(np.float64).reshape(-1, 32)
        a = np.abs(blocks).max(axis=1, keepdims=True)
        err = np.abs(blocks - deq[nm].astype(np.float64).reshape(-1, 32))
        assert (err <= a / 254 * (1 + 2.0 ** -11) + 127 * 2.0 ** -25).all()
        assert not np.array_equal(deq[nm], w[nm])  # really quantised
    for nm in ("b_q", "b_k", "b_v", "b_o"):
        if bias:
            assert np.array_equal(deq[nm], w[nm])
    lf = mha.MultiheadAttention(**deq, num_heads=H, num_kv_heads=G)
    x = rng.standard_normal((B, N, E)).astype(np.float32)
    ref = oracle(deq, x)
    bsum = gemm_block_sums()
    for threads in (1, 2):
        yq = lq.forward(x, causal=True, threads=threads)
        yf = lf.forward(x, causal=True, threads=threads)
        assert np.array_equal(yq, yf), "forward: not the float32 twin's bits"
        assert np.abs(yq - ref).max() <= TOL_OUT_REL * np.abs(ref).max()
        outs = []
        for layer in (lq, lf):
            cache = mha.KVCache(layer, max_seq=N, batch=B)
            ys = [cache.prefill(x[:, :5], threads=threads)]
            ys += [cache.step(x[:, t:t + 1], threads=threads) for t in range(5, N)]
            outs.append(np.concatenate(ys, axis=1))
        if bsum is False:
            assert np.array_equal(outs[0], outs[1]), "decode: not the float32 twin's bits"
        elif bsum:  # the steps' projections in the block-sum order: the oracle bound below
            assert not np.array_equal(outs[0], outs[1]), "decode: block sums gave the twin's bits"
        assert np.abs(outs[0] - ref).max() <= TOL_OUT_REL * np.abs(ref).max()


def test_q8_refusals():
    rng = np.random.default_rng(7)
    w = make(rng, False)
    bad = dict(w, w_q=w["w_q"][:, :48], w_k=w["w_k"][:, :48], w_v=w["w_v"][:, :48])
    with pytest.raises(ValueError, match="multiple of 32"):
        mha.MultiheadAttention(**bad, num_heads=H, num_kv_heads=G, weight_dtype="q8_0")
    with pytest.raises(ValueError, match="weight_dtype"):
        mha.MultiheadAttention(**w, num_heads=H, num_kv_heads=G, weight_dtype="q5_0")
    lq = mha.MultiheadAttention(**w, num_heads=H, num_kv_heads=G, weight_dtype="q8_0")
    x = rng.standard_normal((1, 4, E)).astype(np.float32)
    with pytest.raises(mha.MhaError, match="inference only"):
        lq.forward_train(x)
