# SPDX-License-Identifier: MIT
"""mha against the JAX libraries: Equinox's eqx.nn.MultiheadAttention (separate query/key/value
sizes, qk_size/vo_size, per-projection biases) and Haiku's hk.MultiHeadAttention. Their parameters
are mapped into an mha layer and the outputs compared over several configurations each,
including masks (both libraries: bool, True = may attend, mha's default polarity).

Versions are pinned in python/requirements-test.txt. Tolerance: 1e-5 * max|ref|; the references
run in float64 (jax_enable_x64) so the comparison measures mha's float32 error.
"""
import os
import sys

import numpy as np
import pytest

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402  (required: CI installs python/requirements-test.txt)

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
import equinox as eqx  # noqa: E402
import haiku as hk  # noqa: E402

import mha  # noqa: E402
from tolerances import TOL_OUT_REL

TOL = TOL_OUT_REL  # tests/common/tolerance.h


def close(got, ref, tol=TOL):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = np.abs(got - ref).max()
    scale = np.abs(ref).max()
    assert err <= tol * scale, f"max|got-ref|={err:.3e} > {tol:g}*{scale:.3e}"


def f32(x):
    """Rounds to float32 and back: both sides then see the same inputs and weights."""
    return np.asarray(x, np.float32).astype(np.float64)


# ------------------------------------------------------------------------------------------------
# Equinox
# ------------------------------------------------------------------------------------------------
EQX_CASES = {
    "self_nobias": dict(h=4, q=16),
    "cross_sizes_bias": dict(h=2, q=12, k=10, v=6, out=9, qk=5, vo=7, bias=True, n=5, m=8),
    "mask_2d": dict(h=4, q=16, n=6, m=9, mask="2d", bias=True),
    "mask_per_head": dict(h=3, q=12, n=5, m=7, mask="3d", qk=6),
    "causal_tril": dict(h=4, q=16, n=7, m=7, mask="tril", bias=True),
}


@pytest.mark.parametrize("name", sorted(EQX_CASES))
def test_equinox_multihead_attention(name):
    c = EQX_CASES[name]
    h, qs = c["h"], c["q"]
    ks, vs = c.get("k", qs), c.get("v", c.get("k", qs))
    n, m = c.get("n", 6), c.get("m", c.get("n", 6))
    bias = c.get("bias", False)
    att = eqx.nn.MultiheadAttention(
        h, qs, key_size=ks, value_size=vs, output_size=c.get("out"), qk_size=c.get("qk"),
        vo_size=c.get("vo"), use_query_bias=bias, use_key_bias=bias, use_value_bias=bias,
        use_output_bias=bias, key=jax.random.PRNGKey(len(name)))
    att = jax.tree_util.tree_map(lambda x: jnp.asarray(f32(x)) if eqx.is_array(x) else x, att)
    rng = np.random.default_rng(len(name))
    B = 2
    xq = f32(rng.standard_normal((B, n, qs)))
    xk = f32(rng.standard_normal((B, m, ks)))
    xv = f32(rng.standard_normal((B, m, vs)))
    mask = None
    if c.get("mask") == "2d":
        mask = rng.random((n, m)) < 0.6
        mask[:, 0] = True
    elif c.get("mask") == "3d":
        mask = rng.random((h, n, m)) < 0.6
        mask[..., 0] = True
    elif c.get("mask") == "tril":
        mask = np.tril(np.ones((n, m), bool))
    ref = np.stack([np.asarray(att(xq[b], xk[b], xv[b], mask=None if mask is None else
                                   jnp.asarray(mask))) for b in range(B)])
    w = {"w_q": att.query_proj.weight, "w_k": att.key_proj.weight,
         "w_v": att.value_proj.weight, "w_o": att.output_proj.weight}
    if bias:
        w.update(b_q=att.query_proj.bias, b_k=att.key_proj.bias, b_v=att.value_proj.bias,
                 b_o=att.output_proj.bias)
    layer = mha.MultiheadAttention(**{k_: np.asarray(v_) for k_, v_ in w.items()}, num_heads=h)
    got = layer(xq, xk, xv, mask=mask)  # mask: True = may attend (mha's default polarity)
    close(got, ref)
    if c.get("mask") == "tril":
        close(layer(xq, xk, xv, causal=True), ref)


# ------------------------------------------------------------------------------------------------
# Haiku
# ------------------------------------------------------------------------------------------------
HK_CASES = {
    "self": dict(h=4, d=16, ksz=4),
    "value_size_model_size": dict(h=2, d=12, ksz=5, vsz=3, model=10, n=5, m=8),
    "no_bias_mask": dict(h=4, d=16, ksz=4, bias=False, mask="2d", n=6, m=9),
    "mask_B_h": dict(h=3, d=12, ksz=4, mask="4d", n=5, m=7),
    "causal": dict(h=2, d=8, ksz=4, mask="tril", n=7, m=7),
}


@pytest.mark.parametrize("name", sorted(HK_CASES))
def test_haiku_multihead_attention(name):
    c = HK_CASES[name]
    h, d, ksz = c["h"], c["d"], c["ksz"]
    n, m = c.get("n", 6), c.get("m", c.get("n", 6))
    bias = c.get("bias", True)
    B = 2

    def fwd(q, k, v, mask):
        return hk.MultiHeadAttention(num_heads=h, key_size=ksz, value_size=c.get("vsz"),
                                     model_size=c.get("model"), with_bias=bias,
                                     w_init=hk.initializers.VarianceScaling(1.0))(q, k, v, mask)

    f = hk.without_apply_rng(hk.transform(fwd))
    rng = np.random.default_rng(len(name) + 100)
    xq = f32(rng.standard_normal((B, n, d)))
    xk = f32(rng.standard_normal((B, m, d)))
    xv = f32(rng.standard_normal((B, m, d)))
    mask = None
    if c.get("mask") == "2d":
        mask = rng.random((n, m)) < 0.6
        mask[:, 0] = True
    elif c.get("mask") == "4d":
        mask = rng.random((B, h, n, m)) < 0.6
        mask[..., 0] = True
    elif c.get("mask") == "tril":
        mask = np.tril(np.ones((n, m), bool))
    # Haiku wants the mask with the logits' rank [B, h, n, m]; mha broadcasts [n, m] itself.
    hk_mask = None if mask is None else jnp.asarray(mask.reshape((1,) * (4 - mask.ndim)
                                                                 + mask.shape))
    params = f.init(jax.random.PRNGKey(1), xq, xk, xv, hk_mask)
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(f32(x)), params)
    if bias:  # haiku initialises biases to zero: make them nonzero so they are tested
        params = {mod: {**p, **({"b": jnp.asarray(f32(rng.standard_normal(p["b"].shape) * 0.1))}
                                if "b" in p else {})} for mod, p in params.items()}
    ref = np.asarray(f.apply(params, xq, xk, xv, hk_mask))
    name_of = {k_.split("/")[-1]: v_ for k_, v_ in params.items()}
    # Haiku's hk.Linear keeps w as [in, out]: mha (nn.Linear layout) takes its transpose.
    w = {"w_q": name_of["query"]["w"].T, "w_k": name_of["key"]["w"].T,
         "w_v": name_of["value"]["w"].T, "w_o": name_of["linear"]["w"].T}
    if bias:
        w.update(b_q=name_of["query"]["b"], b_k=name_of["key"]["b"],
                 b_v=name_of["value"]["b"], b_o=name_of["linear"]["b"])
    layer = mha.MultiheadAttention(**{k_: np.asarray(v_) for k_, v_ in w.items()}, num_heads=h)
    got = layer(xq, xk, xv, mask=mask)
    close(got, ref)
    if c.get("mask") == "tril":
        close(layer(xq, xk, xv, causal=True), ref)
