# SPDX-License-Identifier: MIT
"""Tests of the Python package's NumPy API (python/mha) against a float64 NumPy formula.

Run by ctest with MHA_LIBRARY=<libmha.so>, MHA_SOURCE_DIR=<repo root>, MHA_CLI=<mha program>;
needs numpy and pytest only. Covers: the ctypes struct layouts against the C compiler, the
version check, the layer (self/cross attention, kdim/vdim, GQA, biases, every mask kind and
polarity, both causal alignments, windows, segment ids, RoPE styles and positions, probabilities,
dropout determinism), the core with strides and layouts, RoPE alone, the CS336 fixtures, errors,
safetensors loading, the backward against finite differences of the float64 formula, KV-cache
decoding, that the GIL is released, and that the CLI and the package agree.

Tolerance: the project's, max|y - ref| <= 1e-5 * max|ref| (float32 compute vs float64 reference).
"""
import atexit
import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time

import numpy as np
import pytest

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))


def load_fastcall_from_source():
    """Registers the compiled extension mha._fastcall before `import mha`.

    Run from the source tree (ctest: python/ on sys.path, MHA_LIBRARY), the package has no built
    extension, and without it every call would take the ctypes path. So it is compiled here from
    python/mha/_fastcall.c as pip builds it, with the project's warnings (CMakeLists.txt
    MHA_WARNINGS) as errors, and registered: the tests then cover the fast path, and the file
    is checked to compile cleanly. A package with the extension built (pip-installed) is left as
    it is."""
    pkg = os.path.dirname(importlib.util.find_spec("mha").origin)   # the mha to be imported
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    if "mha._fastcall" in sys.modules or any(
            f.startswith("_fastcall.") and f.endswith(suffixes) for f in os.listdir(pkg)):
        return
    with open(os.path.join(SRC, "CMakeLists.txt")) as f:
        warnings = re.search(r"set\(MHA_WARNINGS(.*?)\)", f.read(), re.S).group(1).split()
    out = tempfile.mkdtemp(prefix="mha-fastcall-")
    atexit.register(shutil.rmtree, out, True)
    so = os.path.join(out, "_fastcall" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run([os.environ.get("CC", "cc"), "-std=c11", "-O2", "-shared", "-fPIC", *warnings,
                    "-Werror", "-I", os.path.join(SRC, "include"), "-I",
                    sysconfig.get_paths()["include"],
                    os.path.join(SRC, "python", "mha", "_fastcall.c"), "-o", so],
                   check=True)
    spec = importlib.util.spec_from_file_location("mha._fastcall", so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["mha._fastcall"] = module


load_fastcall_from_source()
import mha  # noqa: E402
from mha import _lib  # noqa: E402
from tolerances import TOL_OUT_REL

TOL = TOL_OUT_REL  # tests/common/tolerance.h


def close(got, ref, tol=TOL):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    scale = max(np.abs(ref).max(), 1e-30)
    err = np.abs(got - ref).max()
    assert err <= tol * scale, f"max|got-ref|={err:.3e} > {tol:g}*max|ref|={tol * scale:.3e}"


# ------------------------------------------------------------------------------------------------
# float64 reference (docs/SEMANTICS.md, written from the formulas)
# ------------------------------------------------------------------------------------------------
def ref_rope(x, pos, style, theta=10000.0, rot=None):
    """x [..., L, H, D] float64, pos [..., L] (broadcast)."""
    D = x.shape[-1]
    R = rot or D
    k = np.arange(R // 2)
    f = theta ** (-2.0 * k / R)
    ang = np.asarray(pos, np.float64)[..., None] * f            # [..., L, R/2]
    c, s = np.cos(ang)[..., None, :], np.sin(ang)[..., None, :]  # [..., L, 1, R/2]
    y = x.copy()
    if style == "interleaved":
        a, b = x[..., 0:R:2], x[..., 1:R:2]
        y[..., 0:R:2] = a * c - b * s
        y[..., 1:R:2] = a * s + b * c
    else:
        a, b = x[..., :R // 2], x[..., R // 2:R]
        y[..., :R // 2] = a * c - b * s
        y[..., R // 2:R] = a * s + b * c
    return y


def ref_core(q, k, v, *, scale=None, causal=False, align="bottom-right", mask=None,
             mask_means="attend", bias=None, kpm=None, window=None, qseg=None, kseg=None,
             softcap=None, sinks=None):
    """q [B, h, n, d], k [B, g, m, d], v [B, g, m, dv] float64 -> (out, probs, lse)."""
    B, h, n, d = q.shape
    g, m = k.shape[1], k.shape[2]
    rep = h // g
    k = np.repeat(k, rep, axis=1)
    v = np.repeat(v, rep, axis=1)
    s = np.einsum("bhid,bhjd->bhij", q, k) * (scale or 1 / np.sqrt(d))
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    vis = np.ones((B, h, n, m), bool)
    i = np.arange(n)[:, None]
    j = np.arange(m)[None, :]
    p = i + (m - n if align == "bottom-right" else 0)
    if causal:
        vis &= j <= p
    if window is not None:
        lo, hi = window
        if lo >= 0:
            vis &= j >= p - lo
        if hi >= 0:
            vis &= j <= p + hi
    if mask is not None:
        mb = np.asarray(mask) != 0
        vis &= mb if mask_means == "attend" else ~mb
    if kpm is not None:
        vis &= (np.asarray(kpm) != 0)[:, None, None, :]
    if qseg is not None:
        vis &= (qseg[:, :, None] == kseg[:, None, :])[:, None]
    s = np.where(vis, s, -np.inf)
    mx = s.max(-1, keepdims=True)
    if sinks is not None:
        mx = np.maximum(mx, sinks[None, :, None, None])
    mx = np.where(np.isfinite(mx), mx, 0)
    e = np.exp(s - mx)
    den = e.sum(-1, keepdims=True)
    if sinks is not None:
        den = den + np.exp(sinks[None, :, None, None] - mx)
    pr = np.where(den > 0, e / np.where(den > 0, den, 1), 0)
    lse = np.where(den[..., 0] > 0, np.log(np.where(den[..., 0] > 0, den[..., 0], 1)) + mx[..., 0],
                   -np.inf)
    return pr @ v, pr, lse


def ref_layer(w, x, xk=None, xv=None, *, h, g=None, rope=None, pos=None, kpos=None, **mk):
    """w: dict of float64 weights (w_q, ..., b_* optional). x [B, n, q_dim]."""
    g = g or h
    xk = x if xk is None else xk
    xv = xk if xv is None else xv
    B, n, _ = x.shape
    m = xk.shape[1]
    dk = w["w_q"].shape[0] // h
    dv = w["w_v"].shape[0] // g
    Q = x @ w["w_q"].T + w.get("b_q", 0)
    K = xk @ w["w_k"].T + w.get("b_k", 0)
    V = xv @ w["w_v"].T + w.get("b_v", 0)
    Q = Q.reshape(B, n, h, dk)
    K = K.reshape(B, m, g, dk)
    V = V.reshape(B, m, g, dv)
    if rope:
        pos = np.arange(n) if pos is None else pos
        if kpos is None:
            kpos = pos if xk is x else np.arange(m)
        Q = ref_rope(Q, np.broadcast_to(pos, (B, n)), rope)
        K = ref_rope(K, np.broadcast_to(kpos, (B, m)), rope)
    o, pr, _ = ref_core(Q.transpose(0, 2, 1, 3), K.transpose(0, 2, 1, 3),
                        V.transpose(0, 2, 1, 3), **mk)
    A = o.transpose(0, 2, 1, 3).reshape(B, n, h * dv)
    return A @ w["w_o"].T + w.get("b_o", 0), pr


def make_weights(rng, q_dim, h, dk, *, g=None, k_dim=None, v_dim=None, dv=None, out_dim=None,
                 bias=True):
    g = g or h
    k_dim = k_dim or q_dim
    v_dim = v_dim or k_dim
    dv = dv or dk
    out_dim = out_dim or q_dim
    w = {"w_q": rng.standard_normal((h * dk, q_dim)) / np.sqrt(q_dim),
         "w_k": rng.standard_normal((g * dk, k_dim)) / np.sqrt(k_dim),
         "w_v": rng.standard_normal((g * dv, v_dim)) / np.sqrt(v_dim),
         "w_o": rng.standard_normal((out_dim, h * dv)) / np.sqrt(h * dv)}
    if bias:
        w.update(b_q=rng.standard_normal(h * dk) * 0.1, b_k=rng.standard_normal(g * dk) * 0.1,
                 b_v=rng.standard_normal(g * dv) * 0.1, b_o=rng.standard_normal(out_dim) * 0.1)
    return {k_: v_.astype(np.float32).astype(np.float64) for k_, v_ in w.items()}


def build(w, h, g=None, **kw):
    return mha.MultiheadAttention(w["w_q"], w["w_k"], w["w_v"], w["w_o"], w.get("b_q"),
                                  w.get("b_k"), w.get("b_v"), w.get("b_o"), num_heads=h,
                                  num_kv_heads=g, **kw)


def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------------------------------------
# Binding sanity
# ------------------------------------------------------------------------------------------------
def test_version_is_written_once():
    """include/mha.h is the one place the version is written: the library reports it, the Python
    package's __version__ is the library's, and the build files read it (pyproject.toml through
    python/version_from_header.py, CMakeLists.txt by parsing the header) instead of repeating it."""
    with open(os.path.join(SRC, "include", "mha.h")) as f:
        header = f.read()
    parts = [re.search(rf"^#define MHA_VERSION_{p} (\d+)$", header, re.M).group(1)
             for p in ("MAJOR", "MINOR", "PATCH")]
    assert mha.library_version() == mha.__version__ == ".".join(parts)
    sys.path.insert(0, os.path.join(SRC, "python"))
    try:
        import version_from_header
        cwd = os.getcwd()
        os.chdir(os.path.join(SRC, "python"))
        try:
            assert version_from_header.dynamic_metadata("version", {}) == mha.__version__
        finally:
            os.chdir(cwd)
    finally:
        sys.path.pop(0)
    for build_file in (os.path.join(SRC, "python", "pyproject.toml"),
                       os.path.join(SRC, "CMakeLists.txt")):
        with open(build_file) as f:
            assert mha.__version__ not in f.read(), f"{build_file} repeats the version"


def test_struct_layouts_match_the_c_compiler(tmp_path):
    """Every ctypes struct has the size and field offsets the C compiler gives mha.h's."""
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "mha.h"', 'int main(void) {']
    for st in _lib.STRUCTS:
        lines.append(f'printf("{st.__name__} %zu\\n", sizeof({st.__name__}));')
        for fname, _ in st._fields_:
            lines.append(f'printf("{st.__name__}.{fname} %zu\\n", offsetof({st.__name__}, {fname}));')
    lines.append("return 0; }")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-std=c11", "-I", os.path.join(SRC, "include"), str(src), "-o", str(exe)],
                   check=True)
    got = dict(line.rsplit(" ", 1) for line in
               subprocess.run([str(exe)], check=True, capture_output=True, text=True)
               .stdout.splitlines())
    n = 0
    for st in _lib.STRUCTS:
        assert int(got[st.__name__]) == __import__("ctypes").sizeof(st), st.__name__
        for fname, _ in st._fields_:
            assert int(got[f"{st.__name__}.{fname}"]) == getattr(st, fname).offset, \
                f"{st.__name__}.{fname}"
            n += 1
    assert n > 100


# ------------------------------------------------------------------------------------------------
# The layer
# ------------------------------------------------------------------------------------------------
LAYER_CASES = {
    "self": dict(),
    "self_nobias": dict(bias=False),
    "causal": dict(mk=dict(causal=True)),
    "cross_kdim_vdim": dict(cross=True, k_dim=12, v_dim=20, m=9),
    "cross_causal_br": dict(cross=True, m=11, mk=dict(causal=True)),
    "cross_causal_tl": dict(cross=True, m=11, mk=dict(causal=True, align="top-left")),
    "gqa_dv_out": dict(h=4, g=2, dv=6, out_dim=10),
    "mqa": dict(h=4, g=1),
    "bool_attend": dict(cross=True, m=8, mk=dict(mask="nm")),
    "bool_block_B1nm": dict(cross=True, m=8, mk=dict(mask="B1nm", mask_means="block")),
    "additive_Bhnm": dict(mk=dict(bias="Bhnm")),
    "key_padding": dict(cross=True, m=8, mk=dict(kpm=True)),
    "window": dict(mk=dict(window=(2, 1))),
    "window_causal": dict(mk=dict(window=(3, -1), causal=True)),
    "segments": dict(mk=dict(segments=True)),
    "rope_interleaved": dict(rope="interleaved"),
    "rope_half_positions": dict(rope="half", positions=True, mk=dict(causal=True)),
    "rope_cross": dict(cross=True, m=9, rope="half"),
    "softcap": dict(mk=dict(softcap=2.0)),
    "everything": dict(cross=True, m=10, g=2, rope="half",
                       mk=dict(causal=True, mask="Bhnm", bias="nm", kpm=True, window=(6, 2))),
}


@pytest.mark.parametrize("name", sorted(LAYER_CASES))
@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_layer_vs_numpy_formula(name, impl):
    c = LAYER_CASES[name]
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    B, n, q_dim = 2, 7, 16
    h, g = c.get("h", 4), c.get("g")
    dk = 4
    m = c.get("m", n)
    w = make_weights(rng, q_dim, h, dk, g=g, k_dim=c.get("k_dim"), v_dim=c.get("v_dim"),
                     dv=c.get("dv"), out_dim=c.get("out_dim"), bias=c.get("bias", True))
    x = f32(rng, B, n, q_dim)
    xk = xv = None
    if c.get("cross"):
        xk = f32(rng, B, m, c.get("k_dim", q_dim))
        xv = f32(rng, B, m, c.get("v_dim", c.get("k_dim", q_dim)))
    mk = dict(c.get("mk", {}))
    kw, rk = {}, {}
    if "softcap" in mk:
        kw["softcap"] = rk["softcap"] = mk.pop("softcap")
    fwd, ref = {}, {}
    if mk.get("causal"):
        fwd["causal"] = mk.get("align", "bottom-right")
        ref["causal"], ref["align"] = True, mk.get("align", "bottom-right")
    if "mask" in mk:
        shape = {"nm": (n, m), "B1nm": (B, 1, n, m), "Bhnm": (B, h, n, m)}[mk["mask"]]
        mask = rng.random(shape) < 0.75
        mask[..., 0] = mk.get("mask_means", "attend") == "attend"  # no fully masked row
        fwd["mask"] = ref["mask"] = mask
        fwd["mask_means"] = ref["mask_means"] = mk.get("mask_means", "attend")
    if "bias" in mk:
        shape = {"nm": (n, m), "Bhnm": (B, h, n, m)}[mk["bias"]]
        bias = rng.standard_normal(shape).astype(np.float32)
        fwd["attn_bias"] = bias
        ref["bias"] = bias.astype(np.float64)
    if mk.get("kpm"):
        kpm = rng.random((B, m)) < 0.7
        kpm[:, -1] = True
        fwd["key_padding_mask"] = ref["kpm"] = kpm
    if "window" in mk:
        fwd["window"] = ref["window"] = mk["window"]
    if mk.get("segments"):
        qs = np.sort(rng.integers(0, 3, (B, n)), axis=1).astype(np.int32)
        fwd["q_segment_ids"] = fwd["kv_segment_ids"] = qs
        ref["qseg"] = ref["kseg"] = qs
    pos = None
    if c.get("positions"):
        pos = rng.integers(0, 1000, (B, n))
        fwd["positions"] = pos
    layer = build(w, h, g, rope=c.get("rope"), **kw)
    y, p = layer.forward(x, xk, xv, need_weights=True, impl=impl, **fwd)
    y_ref, p_ref = ref_layer(w, x.astype(np.float64),
                             None if xk is None else xk.astype(np.float64),
                             None if xv is None else xv.astype(np.float64), h=h, g=g,
                             rope=c.get("rope"), pos=pos, **ref, **rk)
    close(y, y_ref)
    assert np.abs(p - p_ref).max() <= 1e-5
    ya, pa = layer.forward(x, xk, xv, need_weights=True, average_attn_weights=True, impl=impl,
                           **fwd)
    np.testing.assert_array_equal(ya, y)
    assert np.abs(pa - p_ref.mean(1)).max() <= 1e-5


def test_layer_config_weights_and_repr():
    rng = np.random.default_rng(1)
    w = make_weights(rng, 16, 4, 4, g=2, k_dim=12, v_dim=8, dv=6, out_dim=10)
    layer = build(w, 4, rope=mha.Rope(style="half", theta=500000.0, rotary_dim=2),
                  softcap=30.0)
    c = layer.config
    assert (c.q_dim, c.k_dim, c.v_dim, c.num_heads, c.num_kv_heads, c.head_dim, c.v_head_dim,
            c.out_dim) == (16, 12, 8, 4, 2, 4, 6, 10)
    assert c.bias_q and c.bias_o and not c.sinks and c.softcap == 30.0
    assert c.rope.style == "half" and c.rope.theta == 500000.0 and c.rope.rotary_dim == 2
    ws = layer.weights
    for k_ in w:
        np.testing.assert_array_equal(ws[k_], w[k_].astype(np.float32))
    assert "num_kv_heads=2" in repr(layer)


def test_layer_inputs_converted_noncontiguous_unbatched():
    rng = np.random.default_rng(2)
    w = make_weights(rng, 16, 4, 4)
    layer = build(w, 4)
    x = f32(rng, 2, 5, 16)
    y = layer(x)
    np.testing.assert_allclose(layer(x.astype(np.float64)), y, rtol=0, atol=0)
    y16 = layer(x.astype(np.float16))  # read as float16, output in it (rounded once)
    assert y16.dtype == np.float16
    np.testing.assert_array_equal(y16, layer(x.astype(np.float16).astype(np.float32))
                                  .astype(np.float16))
    xt = np.asfortranarray(x)                      # another memory order
    np.testing.assert_array_equal(layer(xt), y)
    big = f32(rng, 2, 5, 32)[:, :, ::2]            # strided view
    close(layer(big), ref_layer(w, big.astype(np.float64), h=4)[0])
    y1, p1 = layer(x[0], need_weights=True)        # unbatched [n, q_dim]
    np.testing.assert_array_equal(y1, y[0])
    assert p1.shape == (4, 5, 5)


def test_layer_sinks_and_alibi_run_and_sinks_match_formula():
    rng = np.random.default_rng(3)
    w = make_weights(rng, 16, 4, 4)
    sinks = rng.standard_normal(4).astype(np.float32)
    layer = build(w, 4, sinks=sinks)
    x = f32(rng, 1, 6, 16)
    y = layer(x, causal=True)
    Q = (x @ w["w_q"].T + w["b_q"]).reshape(1, 6, 4, 4).transpose(0, 2, 1, 3)
    K = (x @ w["w_k"].T + w["b_k"]).reshape(1, 6, 4, 4).transpose(0, 2, 1, 3)
    V = (x @ w["w_v"].T + w["b_v"]).reshape(1, 6, 4, 4).transpose(0, 2, 1, 3)
    o, _, _ = ref_core(Q, K, V, causal=True, sinks=sinks.astype(np.float64))
    close(y, o.transpose(0, 2, 1, 3).reshape(1, 6, 16) @ w["w_o"].T + w["b_o"])
    assert np.isfinite(build(w, 4, alibi=True)(x, causal=True)).all()


def test_dropout_is_deterministic_per_seed_and_off_by_default():
    rng = np.random.default_rng(4)
    w = make_weights(rng, 16, 4, 4)
    layer = build(w, 4)
    x = f32(rng, 2, 8, 16)
    a = layer(x, dropout=0.5, seed=7, threads=1)
    b = layer(x, dropout=0.5, seed=7, threads=2)
    c = layer(x, dropout=0.5, seed=8)
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 1e-3
    assert np.abs(a - layer(x)).max() > 1e-3


def test_explicit_alignment_offsets():
    rng = np.random.default_rng(5)
    q, k, v = f32(rng, 2, 2, 3, 4), f32(rng, 2, 2, 6, 4), f32(rng, 2, 2, 6, 4)
    out = mha.attention(q, k, v, causal=True, alignment=[1, 3])
    for b, off in enumerate([1, 3]):
        i = np.arange(3)[:, None]
        j = np.arange(6)[None]
        o, _, _ = ref_core(q[b:b + 1].astype(np.float64), k[b:b + 1].astype(np.float64),
                           v[b:b + 1].astype(np.float64), mask=(j <= i + off))
        close(out[b:b + 1], o)


# ------------------------------------------------------------------------------------------------
# The core and RoPE
# ------------------------------------------------------------------------------------------------
def test_core_layouts_strides_and_lse():
    rng = np.random.default_rng(6)
    B, n, m, h, g, d, dv = 2, 5, 7, 4, 2, 8, 6
    qkv = f32(rng, B, n, 3, h, d)                 # a fused [B, L, 3, h, d] projection
    q = qkv[:, :, 0]                               # [B, n, h, d] view with strides
    k, v = f32(rng, B, m, g, d), f32(rng, B, m, g, dv)
    out, lse, p = mha.attention(q, k, v, layout="blhd", return_lse=True, need_weights=True,
                                causal=True)
    o_ref, p_ref, lse_ref = ref_core(*(t.transpose(0, 2, 1, 3).astype(np.float64)
                                       for t in (q, k, v)), causal=True)
    close(out, o_ref.transpose(0, 2, 1, 3))
    close(lse, lse_ref)
    assert np.abs(p - p_ref).max() <= 1e-5
    # [B, h, L, d] with a non-contiguous last dimension is copied, same result
    qb = np.ascontiguousarray(q.transpose(0, 2, 1, 3))
    qnc = np.repeat(qb, 2, axis=3)[..., ::2]
    out2 = mha.attention(qnc, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
    o_ref2, _, _ = ref_core(*(t.astype(np.float64) for t in
                              (qb, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))))
    close(out2, o_ref2)


def test_core_fully_masked_rows_give_zero():
    rng = np.random.default_rng(7)
    q, k, v = f32(rng, 1, 2, 4, 4), f32(rng, 1, 2, 3, 4), f32(rng, 1, 2, 3, 4)
    out, lse, p = mha.attention(q, k, v, causal=True, return_lse=True, need_weights=True)
    assert (out[:, :, 0] == 0).all() and (p[:, :, 0] == 0).all()
    assert np.isneginf(lse[:, :, 0]).all()
    assert np.isfinite(out).all()


@pytest.mark.parametrize("style", ["interleaved", "half"])
def test_rope_vs_formula(style):
    rng = np.random.default_rng(8)
    x = f32(rng, 2, 5, 3, 8)
    pos = rng.integers(0, 5000, (2, 5))
    y = mha.rope(x, pos, style=style)
    close(y, ref_rope(x.astype(np.float64), pos, style))
    yp = mha.rope(x, pos, style=style, rotary_dim=4)
    close(yp, ref_rope(x.astype(np.float64), pos, style, rot=4))
    yb = mha.rope(x.transpose(0, 2, 1, 3), pos, style=style, layout="bhld")
    np.testing.assert_array_equal(yb.transpose(0, 2, 1, 3), y)
    freqs, fac = mha.rope_frequencies(8, style=style)
    np.testing.assert_allclose(freqs, 10000.0 ** (-np.arange(4) / 4), rtol=1e-12)
    assert fac == 1.0
    freqs2, _ = mha.rope_frequencies(8, scaling="linear", factor=4.0)
    np.testing.assert_allclose(freqs2, freqs / 4, rtol=1e-12)
    # dynamic NTK: unscaled up to the original length, NTK at factor' = 2 * 40/16 - 1 beyond it.
    dyn = dict(scaling="dynamic", factor=2.0, original_max_position=16)
    with pytest.raises(mha.MhaError, match="mha_rope_at_length"):
        mha.rope_frequencies(8, **dyn)
    np.testing.assert_array_equal(mha.rope_frequencies(8, length=16, **dyn)[0], freqs)
    f40, _ = mha.rope_frequencies(8, length=40, **dyn)
    np.testing.assert_allclose(f40, (1e4 * 4.0 ** (8 / 6)) ** (-np.arange(4) / 4), rtol=1e-12)
    pos40 = np.array([[0, 39, 5, 7, 1]] * 2)
    np.testing.assert_array_equal(mha.rope(x, pos40, style=style, **dyn),
                                  mha.rope(x, pos40, style=style, scaling="ntk", factor=4.0))


# ------------------------------------------------------------------------------------------------
# CS336 fixtures through the Python API
# ------------------------------------------------------------------------------------------------
CS336 = os.path.join(SRC, "tests", "fixtures", "cs336")


def load_case(name):
    d = os.path.join(CS336, name)
    with open(os.path.join(d, "case.json")) as f:
        case = json.load(f)
    arrs = {k_: np.load(os.path.join(d, v_["file"])) for k_, v_ in case["files"].items()}
    return case, arrs


@pytest.mark.parametrize("name", ["test_scaled_dot_product_attention",
                                  "test_4d_scaled_dot_product_attention"])
def test_cs336_sdpa(name):
    case, a = load_case(name)
    out = mha.attention(a["Q"], a["K"], a["V"], mask=a["mask_attend"], mask_means="attend")
    t = case["tolerance"]
    np.testing.assert_allclose(out, a["expected"], atol=t["atol"], rtol=t["rtol"])


def test_cs336_rope():
    case, a = load_case("test_rope")
    out = mha.rope(a["x"], a["token_positions"], style="interleaved",
                   theta=case["params"]["theta"])
    t = case["tolerance"]
    np.testing.assert_allclose(out, a["expected"], atol=t["atol"], rtol=t["rtol"])


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------
def test_errors_from_the_library_carry_status_and_message():
    rng = np.random.default_rng(9)
    w = make_weights(rng, 16, 4, 4)
    layer = build(w, 4)
    x = f32(rng, 1, 5, 16)
    with pytest.raises(mha.MhaError) as e:
        build(w, 4, rope="half")(x, positions=np.full((1, 5), -3))
    assert e.value.status == 1 and e.value.status_name == "INVALID_ARG"
    assert "position" in e.value.message
    bad = dict(w)
    bad["w_q"] = w["w_q"].copy()
    bad["w_q"][3, 2] = np.nan
    with pytest.raises(mha.MhaError) as e:
        build(bad, 4)
    assert "w_q" in e.value.message
    with pytest.raises(mha.MhaError) as e:
        mha.MultiheadAttention(w["w_q"], w["w_k"][:12], w["w_v"][:12], w["w_o"],
                               num_heads=4)  # 3 kv heads for 4 query heads
    assert e.value.status == 1
    with pytest.raises(mha.MhaError) as e:
        mha.attention(f32(rng, 1, 1, 2, 4), f32(rng, 1, 1, 3, 4), f32(rng, 1, 1, 3, 4),
                      mask=np.ones((5, 5), bool))
    assert "mask" in e.value.message


def test_python_side_misuse_raises_value_and_type_errors():
    rng = np.random.default_rng(10)
    w = make_weights(rng, 16, 4, 4)
    layer = build(w, 4)
    with pytest.raises(ValueError):
        layer(f32(rng, 1, 5, 15))
    with pytest.raises(TypeError):
        layer(np.ones((1, 5, 16), np.int32))
    with pytest.raises(ValueError):
        build(w, 3)
    with pytest.raises(ValueError):
        layer(f32(rng, 1, 5, 16), mask_means="maybe", mask=np.ones((5, 5), bool))
    with pytest.raises(ValueError):
        layer(f32(rng, 1, 5, 16), impl="fastest")
    with pytest.raises(ValueError):
        layer(f32(rng, 1, 5, 16), q_segment_ids=np.zeros((1, 5), np.int32))
    with pytest.raises(ValueError):
        mha.attention(f32(rng, 1, 2, 3, 4), f32(rng, 1, 2, 3, 5), f32(rng, 1, 2, 3, 4))
    with pytest.raises(TypeError):
        mha.attention(f32(rng, 1, 2, 3, 4), f32(rng, 1, 2, 3, 4), f32(rng, 1, 2, 3, 4),
                      mask=np.array([["a"]]))


def test_fast_paths_keep_semantics():
    """The per-call shortcuts (docs/PYTHON.md, "Overhead"): the data pointer read from the
    ndarray header, shared mha_exec structs, no masking/dropout setup when none is asked for."""
    from mha import _api
    import platform
    base = np.arange(120, dtype=np.float32)
    arrays = [base, base[7:], base.reshape(10, 12)[3:, 2], base.reshape(10, 12).T,
              np.asfortranarray(base.reshape(10, 12)), np.zeros((2, 3), np.int64)[1:],
              np.broadcast_to(base[:4], (5, 4)), np.empty((0, 3), np.float32),
              base.view(np.ndarray).reshape(2, 60)[1], np.asarray(memoryview(bytearray(16)))]
    for a in arrays:
        assert (_api._ptr(a) or 0) == a.__array_interface__["data"][0]  # None = NULL
    assert _api._ptr(None) is None
    if platform.python_implementation() == "CPython":
        assert _api._ptr is not _api._ptr_portable  # the fast path is the one in use
    # mha_exec structs are cached per (impl, threads) and validated the first time.
    assert _api._exec("auto", 1) is _api._exec("auto", 1)
    assert _api._exec("reference", 2).impl == _lib.IMPLS["reference"]
    assert _api._exec("reference", 2).n_threads == 2
    for _ in range(2):
        with pytest.raises(ValueError, match="impl"):
            _api._exec("fastest", 1)
        with pytest.raises(ValueError, match="threads"):
            _api._exec("auto", -1)
    # The layer's defaults (no mask, no dropout) equal the explicit spelling of them.
    rng = np.random.default_rng(12)
    w = make_weights(rng, 16, 4, 4)
    layer = build(w, 4)
    x = f32(rng, 2, 5, 16)
    y = layer(x, threads=1)
    np.testing.assert_array_equal(y, layer(x, causal=False, dropout=0.0, seed=3, threads=1))
    for kw in (dict(window=(None, None)), dict(mask=np.ones((5, 5), bool))):
        np.testing.assert_allclose(layer(x, threads=1, **kw), y, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="dropout"):
        layer(x, dropout=1.5)
    with pytest.raises(ValueError, match="causal"):
        layer(x, causal="")


class FastSpy:
    """Wraps mha._api's compiled fast path (mha._fastcall), counting the calls it served and
    the ones it declined (NotImplemented: the general path ran)."""

    def __init__(self, monkeypatch):
        from mha import _api
        assert _lib.fast is not None, "mha._fastcall is not built: the fast path is not tested"
        self.hits = self.declined = 0
        self.last_args = None
        self._fast = _lib.fast
        monkeypatch.setattr(_api, "_fast", self)

    def layer_forward(self, *args):
        self.last_args = args
        try:
            out = self._fast.layer_forward(*args)
        except Exception:
            self.hits += 1   # served, with an error
            raise
        if out is NotImplemented:
            self.declined += 1
        else:
            self.hits += 1
        return out


FAST_LAYERS = {
    "plain": dict(),
    "gqa_rope_no_bias": dict(g=2, rope="half", bias=False),
    "kdim_dv_sinks": dict(dv=6, out_dim=12, sinks=True, softcap=20.0, alibi=True),
}


@pytest.mark.parametrize("name", sorted(FAST_LAYERS))
def test_compiled_fast_path_equals_the_general_path_bit_for_bit(name, monkeypatch):
    """layer(x) on a float32 C-contiguous input runs in mha._fastcall; the same input forced
    through the general (ctypes) path, or given in another memory order or dtype (which the
    fast path declines and the general path converts), gives the same bits."""
    from mha import _api
    kw = dict(FAST_LAYERS[name])
    rng = np.random.default_rng(30)
    g, sinks, bias = kw.pop("g", None), kw.pop("sinks", False), kw.pop("bias", True)
    w = make_weights(rng, 16, 4, 4, g=g, dv=kw.pop("dv", None), out_dim=kw.pop("out_dim", None),
                     bias=bias)
    if sinks:
        kw["sinks"] = f32(rng, 4)
    layer = build(w, 4, g, **kw)
    for shape, call in (((2, 7, 16), {}), ((7, 16), {}), ((1, 33, 16), dict(threads=2)),
                        ((3, 5, 16), dict(impl="reference", threads=1))):
        x = f32(rng, *shape)
        spy = FastSpy(monkeypatch)
        y = layer(x, **call)
        assert spy.hits == 1 and spy.declined == 0
        assert y.dtype == np.float32 and y.flags.c_contiguous and y.flags.writeable
        assert y.shape == shape[:-1] + (layer.config.out_dim,)
        y_fortran = layer(np.asfortranarray(x), **call)       # declined: not C-contiguous
        y_f64 = layer(x.astype(np.float64), **call)           # declined: converted
        assert spy.declined == 2 and spy.hits == 1
        monkeypatch.setattr(_api, "_fast", None)
        y_general = layer(x, **call)
        for other in (y_fortran, y_f64, y_general):
            np.testing.assert_array_equal(y, other)


def test_compiled_fast_path_inputs_it_declines_or_refuses(monkeypatch):
    """Anything but a float32 C-contiguous [B, n, q_dim] / [n, q_dim] buffer with valid impl and
    threads goes to the general path, which converts or raises the usual errors; library errors
    raise MhaError with the library's message; bad direct calls raise, never crash."""
    rng = np.random.default_rng(31)
    w = make_weights(rng, 16, 4, 4)
    layer = build(w, 4)
    x = f32(rng, 2, 5, 16)
    y = layer(x)
    spy = FastSpy(monkeypatch)
    np.testing.assert_array_equal(layer(x.tolist()), y)           # not a buffer: converted
    np.testing.assert_array_equal(layer(x, threads=np.int64(0)), y)   # not an int: general
    np.testing.assert_array_equal(layer(memoryview(x)), y)          # any float32 buffer
    np.testing.assert_array_equal(layer(x.view(np.ndarray)), y)
    ro = x.copy()
    ro.flags.writeable = False
    np.testing.assert_array_equal(layer(ro), y)                       # read-only input
    big = np.zeros((2, 5, 32), np.float32)
    big[:, :, ::2] = x
    np.testing.assert_array_equal(layer(big[:, :, ::2]), y)          # strided: copied
    assert spy.hits == 3 and spy.declined == 3
    for bad, err in ((f32(rng, 2, 5, 15), ValueError), (f32(rng, 5), ValueError),
                     (f32(rng, 1, 2, 5, 16), ValueError),
                     (np.ones((2, 5, 16), np.int32), TypeError), (x.astype(">f4"), None)):
        if err is None:
            np.testing.assert_array_equal(layer(bad), y)   # big-endian: converted, same values
        else:
            with pytest.raises(err):
                layer(bad)
    with pytest.raises(ValueError, match="impl"):
        layer(x, impl="fastest")
    with pytest.raises(ValueError, match="threads"):
        layer(x, threads=-1)
    with pytest.raises(TypeError):
        layer(x, impl=["auto"])
    cross = build(make_weights(rng, 16, 4, 4, k_dim=8), 4)
    with pytest.raises(ValueError, match="self-attention"):
        cross(x)                                          # declined: k_dim != q_dim
    hits = spy.hits
    for empty in (np.zeros((1, 0, 16), np.float32), np.zeros((0, 3, 16), np.float32)):
        with pytest.raises(mha.MhaError) as e:
            layer(empty)
        assert e.value.status_name == "INVALID_ARG" and "q_len" in e.value.message
    assert spy.hits == hits + 2   # the library's errors, raised from the compiled path
    fc = _lib.fast
    with pytest.raises(TypeError):
        fc.layer_forward(layer._ptr, x)
    with pytest.raises(ValueError, match="NULL"):
        fc.layer_forward(0, x, 0, 0, None, None)
    with pytest.raises(TypeError):
        fc.layer_forward("layer", x, 0, 0, None, None)
    assert fc.layer_forward(layer._ptr, "not a buffer", 0, 0, None, None) is NotImplemented
    assert fc.layer_forward(layer._ptr, x, 0, -1, None, None) is NotImplemented
    assert fc.layer_forward(layer._ptr, x, 2 ** 70, 0, None, None) is NotImplemented
    with pytest.raises(TypeError):
        fc.layer_call(layer._ptr, 1, 5)
    with pytest.raises(TypeError):
        fc.layer_call(layer._ptr, 1, 5, "x", 0, None, False, 0, None, None, 0)
    with pytest.raises(ValueError, match="threads"):
        fc.layer_call(layer._ptr, 1, 5, x.ctypes.data, y.ctypes.data, None, False, 2 ** 40, None, None, 0)
    with pytest.raises(OverflowError):
        fc.layer_call(layer._ptr, 1, 5, x.ctypes.data, y.ctypes.data, None, False, 2 ** 70, None, None, 0)
    with pytest.raises(ValueError, match="NULL"):
        fc.layer_call(None, 1, 5, x.ctypes.data, y.ctypes.data, None, False, 0, None, None, 0)
    with pytest.raises(mha.MhaError, match="x_dtype"):  # not an mha_dtype code
        fc.layer_call(layer._ptr, 1, 5, x.ctypes.data, y.ctypes.data, None, False, 0, None, None,
                      99)
    with pytest.raises(mha.MhaError) as e:
        fc.layer_call(layer._ptr, 1, 5, 0, y.ctypes.data, None, False, 0, None, None, 0)   # NULL query
    assert e.value.status == 1 and e.value.message


def test_impl_fast_reports_unsupported_or_runs():
    rng = np.random.default_rng(11)
    q, k, v = f32(rng, 1, 2, 5, 8), f32(rng, 1, 2, 5, 8), f32(rng, 1, 2, 5, 8)
    try:
        out = mha.attention(q, k, v, impl="fast", dropout=0.3, seed=1)
    except mha.MhaError as e:
        assert e.status_name == "UNSUPPORTED" and e.message
    else:
        assert np.isfinite(out).all()


# ------------------------------------------------------------------------------------------------
# safetensors
# ------------------------------------------------------------------------------------------------
def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr, "<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def torch_mha_tensors(w, E):
    return {"in_proj_weight": np.concatenate([w["w_q"], w["w_k"], w["w_v"]]),
            "in_proj_bias": np.concatenate([w["b_q"], w["b_k"], w["b_v"]]),
            "out_proj.weight": w["w_o"], "out_proj.bias": w["b_o"]}


def test_from_safetensors_names_and_errors(tmp_path):
    rng = np.random.default_rng(12)
    w = make_weights(rng, 16, 4, 4)
    x = f32(rng, 2, 5, 16)
    ref = build(w, 4)(x)
    p1 = tmp_path / "hf.safetensors"
    write_safetensors(p1, {"layers.0." + k_: v_ for k_, v_ in {
        "q_proj.weight": w["w_q"], "k_proj.weight": w["w_k"], "v_proj.weight": w["w_v"],
        "o_proj.weight": w["w_o"], "q_proj.bias": w["b_q"], "k_proj.bias": w["b_k"],
        "v_proj.bias": w["b_v"], "o_proj.bias": w["b_o"]}.items()})
    np.testing.assert_array_equal(
        mha.MultiheadAttention.from_safetensors(p1, 4, prefix="layers.0.")(x), ref)
    p2 = tmp_path / "torch.safetensors"
    write_safetensors(p2, torch_mha_tensors(w, 16))
    np.testing.assert_array_equal(mha.MultiheadAttention.from_safetensors(p2, 4)(x), ref)
    p3 = tmp_path / "bert.safetensors"
    write_safetensors(p3, {"a.q.weight": w["w_q"], "a.k.weight": w["w_k"], "a.v.weight": w["w_v"],
                           "a.o.weight": w["w_o"], "a.q.bias": w["b_q"], "a.k.bias": w["b_k"],
                           "a.v.bias": w["b_v"], "a.o.bias": w["b_o"]})
    lay = mha.MultiheadAttention.from_safetensors(
        p3, 4, names={"q": "a.q", "k": "a.k", "v": "a.v", "o": "a.o"})
    np.testing.assert_array_equal(lay(x), ref)
    with pytest.raises(mha.MhaError) as e:
        mha.MultiheadAttention.from_safetensors(p1, 4)  # no prefix: names not found
    assert e.value.status_name == "NOT_FOUND"
    with pytest.raises(mha.MhaError) as e:
        mha.MultiheadAttention.from_safetensors(tmp_path / "missing.safetensors", 4)
    assert e.value.status_name == "IO"
    # The messages speak of the Python arguments (num_heads, num_kv_heads), not of CLI flags.
    with pytest.raises(mha.MhaError) as e:
        mha.MultiheadAttention.from_safetensors(p2, 3)
    assert "num_heads 3" in str(e.value) and "--" not in str(e.value), str(e.value)
    with pytest.raises(mha.MhaError) as e:
        mha.MultiheadAttention.from_safetensors(p2, 4, num_kv_heads=3)
    assert "num_kv_heads 3 does not divide num_heads 4" in str(e.value), str(e.value)
    assert "--" not in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------------------
# Backward (float64 central differences of the reference formula)
# ------------------------------------------------------------------------------------------------
def num_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        fp = f()
        x[i] = old - eps
        fm = f()
        x[i] = old
        g[i] = (fp - fm) / (2 * eps)
    return g


def test_attention_backward_vs_finite_differences():
    rng = np.random.default_rng(13)
    q, k, v = f32(rng, 1, 2, 3, 4), f32(rng, 1, 1, 5, 4), f32(rng, 1, 1, 5, 3)
    dout = f32(rng, 1, 2, 3, 3)
    opts = dict(causal=True, attn_bias=f32(rng, 3, 5) * 0.3)
    out, lse = mha.attention(q, k, v, return_lse=True, **opts)
    dq, dk, dv = mha.attention_backward(dout, q, k, v, out, lse, **opts)
    Q, K, V = (t.astype(np.float64) for t in (q, k, v))
    bias = opts["attn_bias"].astype(np.float64)

    def loss():
        return (ref_core(Q, K, V, causal=True, bias=bias)[0] * dout).sum()
    for got, var in ((dq, Q), (dk, K), (dv, V)):
        close(got, num_grad(loss, var), tol=1e-4)


def test_layer_backward_vs_finite_differences():
    rng = np.random.default_rng(14)
    w = make_weights(rng, 8, 2, 4, g=1, k_dim=6, v_dim=5, out_dim=7)
    x, xk, xv = f32(rng, 2, 3, 8), f32(rng, 2, 4, 6), f32(rng, 2, 4, 5)
    layer = build(w, 2, rope="half")
    opts = dict(causal=True, key_padding_mask=np.array([[1, 1, 0, 1], [1, 1, 1, 1]], bool))
    y, state = layer.forward_train(x, xk, xv, **opts)
    np.testing.assert_array_equal(y, layer(x, xk, xv, **opts))
    dy = f32(rng, 2, 3, 7)
    grads = layer.backward(state, dy)
    grads2 = layer.backward(state, dy)  # the state can be reused
    np.testing.assert_array_equal(grads["w_q"], grads2["w_q"])
    X, XK, XV = (t.astype(np.float64) for t in (x, xk, xv))

    def loss():
        return (ref_layer(w, X, XK, XV, h=2, g=1, rope="half", causal=True,
                          kpm=opts["key_padding_mask"])[0] * dy).sum()
    for nm, var in (("query", X), ("key", XK), ("value", XV)):
        close(grads[nm], num_grad(loss, var), tol=1e-4)
    for nm in ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"):
        close(grads[nm], num_grad(loss, w[nm]), tol=1e-4)
    state.close()


@pytest.mark.parametrize("average", [False, True])
def test_layer_backward_through_the_weights_vs_finite_differences(average):
    # A loss that reads the attention weights as well (d_weights = its gradient, session 51).
    rng = np.random.default_rng(24)
    w = make_weights(rng, 8, 2, 4, g=1, k_dim=6, v_dim=5, out_dim=7)
    x, xk, xv = f32(rng, 2, 3, 8), f32(rng, 2, 4, 6), f32(rng, 2, 4, 5)
    layer = build(w, 2, rope="half")
    opts = dict(causal=True, key_padding_mask=np.array([[1, 1, 0, 1], [1, 1, 1, 1]], bool))
    y, p, state = layer.forward_train(x, xk, xv, need_weights=True,
                                      average_attn_weights=average, **opts)
    dy, dp = f32(rng, 2, 3, 7), f32(rng, *p.shape)
    grads = layer.backward(state, dy, d_weights=dp)
    X, XK, XV = (t.astype(np.float64) for t in (x, xk, xv))

    def loss():
        yr, pr = ref_layer(w, X, XK, XV, h=2, g=1, rope="half", causal=True,
                           kpm=opts["key_padding_mask"])
        return (yr * dy).sum() + ((pr.mean(1) if average else pr) * dp).sum()
    for nm, var in (("query", X), ("key", XK), ("value", XV)):
        close(grads[nm], num_grad(loss, var), tol=1e-4)
    for nm in ("w_q", "w_k", "w_o", "b_q"):
        close(grads[nm], num_grad(loss, w[nm]), tol=1e-4)
    with pytest.raises(ValueError, match="d_weights"):
        layer.backward(state, dy, d_weights=dp[..., :2])
    y, state = layer.forward_train(x, xk, xv, **opts)
    with pytest.raises(ValueError, match="need_weights"):
        layer.backward(state, dy, d_weights=dp)


def test_layer_backward_self_attention_sums_paths():
    rng = np.random.default_rng(15)
    w = make_weights(rng, 8, 2, 4)
    layer = build(w, 2)
    x = f32(rng, 1, 4, 8)
    y, state = layer.forward_train(x, causal=True)
    dy = f32(rng, 1, 4, 8)
    g = layer.backward(state, dy, params=False)
    assert set(g) == {"query"}
    X = x.astype(np.float64)
    close(g["query"], num_grad(lambda: (ref_layer(w, X, h=2, causal=True)[0] * dy).sum(), X),
          tol=1e-4)


def test_training_calls_reuse_memory_through_the_block_cache():
    """Calls through _marshal.exec_struct allocate through this process's mha_block_cache; the
    training steps it serves give the bits of steps with the default allocator (None)."""
    from mha import _marshal
    alloc = _marshal.block_cache_allocator()
    assert isinstance(alloc, int) and alloc and _marshal.block_cache_allocator() == alloc
    assert _marshal.exec_struct(0, 2).allocator == alloc
    rng = np.random.default_rng(31)
    layer = build(make_weights(rng, 64, 4, 16), 4)
    x, dy = f32(rng, 1, 40, 64), f32(rng, 1, 40, 64)

    def step():
        y, state = layer.forward_train(x, causal=True, threads=2)
        return y, layer.backward(state, dy)
    cached = [step() for _ in range(3)]
    ex = _marshal.exec_struct(0, 2)
    ex.allocator = None
    try:
        y0, g0 = step()
    finally:
        ex.allocator = alloc
    for y, g in cached:
        assert np.array_equal(y, y0) and g.keys() == g0.keys()
        assert all(np.array_equal(g[k], g0[k]) for k in g0)


def test_fast_path_allocates_through_the_block_cache(monkeypatch):
    """layer(x) on the compiled fast path gives the library this process's block cache as its
    allocator (a workspace is then reused, not faulted in fresh every call); the bits are those
    of the same call with the default allocator."""
    from mha import _marshal
    rng = np.random.default_rng(32)
    layer = build(make_weights(rng, 64, 4, 16), 4)
    x = f32(rng, 2, 96, 64)
    spy = FastSpy(monkeypatch)
    y = layer(x, threads=2)
    assert spy.hits == 1 and spy.last_args[-1] == _marshal.block_cache_allocator()
    fc = _lib.fast
    pool = _marshal.pool_for(2)
    y_malloc = fc.layer_forward(layer._ptr, x, 0, 2, pool, None)
    y_cache = fc.layer_forward(layer._ptr, x, 0, 2, pool, _marshal.block_cache_allocator())
    np.testing.assert_array_equal(y, y_malloc)
    np.testing.assert_array_equal(y, y_cache)


# ------------------------------------------------------------------------------------------------
# KV cache
# ------------------------------------------------------------------------------------------------
def test_kv_cache_prefill_and_steps_equal_full_causal_forward():
    rng = np.random.default_rng(16)
    w = make_weights(rng, 16, 4, 4, g=2)
    layer = build(w, 4, rope="half")
    x = f32(rng, 2, 9, 16)
    full = layer(x, causal=True)
    cache = layer.kv_cache(max_seq=16, batch=2)
    out = [cache.prefill(x[:, :5])]
    for t in range(5, 9):
        out.append(cache.step(x[:, t:t + 1]))
    close(np.concatenate(out, axis=1), full)
    assert cache.length(0) == 9 and cache.length(1) == 9
    cache.truncate(1, 4)
    assert cache.length(1) == 4
    with pytest.raises(ValueError):
        cache.length(7)


# ------------------------------------------------------------------------------------------------
# Threads: the GIL is released during the C call
# ------------------------------------------------------------------------------------------------
def assert_gil_released(call, attempts=3):
    """Runs call() in a thread while the main thread counts loop iterations: the count is large
    only if the C call released the GIL. A few attempts: on a loaded machine the main thread may
    not be scheduled at all during one call (a call holding the GIL never passes). The calls take
    ~0.1 s, many scheduler time slices: with 14 ms calls, the main thread woken from its sleep
    waited for a CPU until the call had ended, three times in a row, while another test ran on
    the second core (CI, 2026-11-26)."""
    t0 = time.perf_counter()
    call()
    one = time.perf_counter() - t0
    counts = []
    for _ in range(attempts):
        done = threading.Event()

        def work():
            call()
            done.set()

        th = threading.Thread(target=work)
        count = 0
        th.start()
        time.sleep(0.01)
        while not done.is_set():   # runs only if the C call does not hold the GIL
            count += 1
        th.join()
        counts.append(count)
        if count > 1000:
            break
    print(f"single call {one * 1e3:.1f} ms; python loop iterations during a call: {counts}")
    assert counts[-1] > 1000, "the main thread did not run while the C call ran: the GIL was held"


def test_gil_is_released_during_calls():
    rng = np.random.default_rng(17)
    q, k, v = f32(rng, 1, 2, 1024, 64), f32(rng, 1, 2, 1024, 64), f32(rng, 1, 2, 1024, 64)
    assert_gil_released(lambda: mha.attention(q, k, v, impl="reference", threads=1))


def test_gil_is_released_by_the_fast_layer_forward(monkeypatch):
    rng = np.random.default_rng(19)
    layer = build(make_weights(rng, 128, 2, 64), 2)
    x = f32(rng, 1, 1024, 128)
    calls = []

    def call():
        calls.append(1)
        layer(x, impl="reference", threads=1)

    spy = FastSpy(monkeypatch)
    assert_gil_released(call)
    # Every call (one timing call, then one per attempt: 1 to 3) went through the fast path.
    assert spy.hits == len(calls) >= 2 and spy.declined == 0


def test_concurrent_forward_on_one_layer_is_consistent():
    rng = np.random.default_rng(18)
    w = make_weights(rng, 32, 4, 8)
    layer = build(w, 4)
    xs = [f32(rng, 2, 33, 32) for _ in range(4)]
    expect = [layer(x, causal=True) for x in xs]
    got = [None] * 4

    def run(i):
        for _ in range(5):
            got[i] = layer(xs[i], causal=True, threads=1)

    ths = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    for a, b in zip(got, expect):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# The CLI and the package agree
# ------------------------------------------------------------------------------------------------
def test_cli_and_python_agree(tmp_path):
    cli = os.environ.get("MHA_CLI")
    assert cli and os.path.exists(cli), "MHA_CLI must point at the mha program"
    rng = np.random.default_rng(19)
    w = make_weights(rng, 16, 4, 4, g=2)
    x = f32(rng, 2, 6, 16)
    mask = rng.random((6, 6)) < 0.6
    mask[:, 0] = True
    tensors = {"q_proj.weight": w["w_q"], "k_proj.weight": w["w_k"], "v_proj.weight": w["w_v"],
               "o_proj.weight": w["w_o"], "q_proj.bias": w["b_q"], "k_proj.bias": w["b_k"],
               "v_proj.bias": w["b_v"], "o_proj.bias": w["b_o"]}
    write_safetensors(tmp_path / "w.safetensors", tensors)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "mask.npy", mask)
    subprocess.run([cli, "run", "--weights", str(tmp_path / "w.safetensors"), "--heads", "4",
                    "--input", str(tmp_path / "x.npy"), "--causal", "--rope-style", "half",
                    "--mask", str(tmp_path / "mask.npy"), "--out", str(tmp_path / "y.npy"),
                    "--attn", str(tmp_path / "a.npy")], check=True)
    layer = mha.MultiheadAttention.from_safetensors(tmp_path / "w.safetensors", 4, rope="half")
    y, p = layer(x, causal=True, mask=mask, need_weights=True)
    close(np.load(tmp_path / "y.npy"), y, tol=1e-6)
    assert np.abs(np.load(tmp_path / "a.npy") - p).max() <= 1e-6


# ------------------------------------------------------------------------------------------------
# Plots and the example (matplotlib is in python/requirements-test.txt)
# ------------------------------------------------------------------------------------------------
def test_plot_attention_writes_png_and_svg(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    rng = np.random.default_rng(20)
    p = rng.random((2, 3, 3))
    p /= p.sum(-1, keepdims=True)
    for ext in ("png", "svg"):
        fig = mha.plot_attention(p, ["she", "loves", "cats"], path=str(tmp_path / f"a.{ext}"))
        assert len(fig.axes) >= 2
        assert (tmp_path / f"a.{ext}").stat().st_size > 1000
    with pytest.raises(ValueError):
        mha.plot_attention(p, ["only", "two"])


def test_example_she_loves_cats_runs(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(SRC, "examples", "she_loves_cats.py"),
                          str(tmp_path / "att.png")], check=True, capture_output=True, text=True,
                         env={**os.environ, "MPLBACKEND": "Agg"}).stdout
    assert "head 1" in out and (tmp_path / "att.png").exists()


def test_threads_use_one_persistent_pool():
    """threads=N (N > 1) runs on this process's pool for N threads (mha._marshal.pool_for), made
    once and reused; the result is bit-identical to one thread, through the compiled fast path
    and the general path alike."""
    from mha import _marshal
    rng = np.random.default_rng(3)
    layer = build(make_weights(rng, 32, 4, 8), 4)
    x = rng.standard_normal((2, 9, 32)).astype(np.float32)
    assert _marshal.pool_for(1) is None and _marshal.pool_for(-1) is None
    pool = _marshal.pool_for(2)
    assert isinstance(pool, int) and pool and _marshal.pool_for(2) == pool
    one, one_causal = layer(x, threads=1), layer(x, threads=1, causal=True)
    for _ in range(3):
        assert np.array_equal(layer(x, threads=2), one)                         # fast path
        assert np.array_equal(layer(x, threads=2, causal=True), one_causal)     # general path


def test_int_arguments_beyond_their_c_type_are_refused():
    """Python ints the C structs hold in int64 (window, rope rotary_dim, rope_frequencies' head_dim
    and length) and integer arrays narrowed to int32 (segment ids) raise ValueError instead of
    wrapping (ctypes takes them modulo 2^64, numpy's astype modulo 2^32): window=(2^64 + 1, 0)
    ran as window (1, 0), rotary_dim=2^64 + 4 as 4, segment ids 0 and 2^32 as one segment."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 2, 6, 8)).astype(np.float32) for _ in range(3))
    for w in ((2 ** 64 + 1, 0), (0, 2 ** 63), (-2 ** 63 - 1, 0)):
        with pytest.raises(ValueError, match="window.*outside int64"):
            mha.attention(q, k, v, window=w)
    E = 16
    W = [rng.standard_normal((E, E)).astype(np.float32) * 0.2 for _ in range(4)]
    layer = mha.MultiheadAttention(*W, num_heads=2)
    with pytest.raises(ValueError, match="window.*outside int64"):
        layer(rng.standard_normal((1, 6, E)).astype(np.float32), window=(2 ** 64 + 1, 0))
    x = rng.standard_normal((1, 5, 2, 8)).astype(np.float32)
    with pytest.raises(ValueError, match="rotary_dim.*outside int64"):
        mha.rope(x, rotary_dim=2 ** 64 + 4)
    with pytest.raises(ValueError, match="rotary_dim.*outside int64"):
        mha.MultiheadAttention(*W, num_heads=2, rope=mha.Rope(style="half", rotary_dim=2 ** 64 + 4))
    with pytest.raises(ValueError, match="head_dim.*outside int64"):
        mha.rope_frequencies(2 ** 64 + 8, rotary_dim=8)
    with pytest.raises(ValueError, match="length.*outside int64"):
        mha.rope_frequencies(8, scaling="dynamic", factor=2.0, original_max_position=4,
                             length=2 ** 64 + 3)
    qs, ks = np.zeros((1, 6), np.int64), np.zeros((1, 6), np.int64)
    ks[:, 3:] = 2 ** 32
    with pytest.raises(ValueError, match="kv_segment_ids.*outside int32"):
        mha.attention(q, k, v, q_segment_ids=qs, kv_segment_ids=ks)
    with pytest.raises(ValueError, match="alignment.*outside int64"):
        mha.attention(q, k, v, causal=True, alignment=np.array([2 ** 63 + 1], np.uint64))
    # in range: unchanged (int64 segment ids that fit, numpy integers, a huge-but-int64 window)
    ks[:, 3:] = 2 ** 31 - 1
    vis = np.zeros((6, 6), bool)
    vis[:, :3] = True
    assert np.array_equal(mha.attention(q, k, v, q_segment_ids=qs, kv_segment_ids=ks),
                          mha.attention(q, k, v, mask=vis))
    assert np.array_equal(mha.attention(q, k, v, window=(2 ** 63 - 1, np.int64(0))),
                          mha.attention(q, k, v, causal=True))
    assert np.array_equal(mha.rope(x, rotary_dim=np.int64(4)), mha.rope(x, rotary_dim=4))
    for t in (2 ** 31, 2 ** 32 + 1, 2 ** 64 + 1):  # mha_exec.n_threads is an int32
        with pytest.raises(ValueError, match="threads"):
            mha.attention(q, k, v, threads=t)
