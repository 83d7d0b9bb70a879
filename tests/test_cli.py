# SPDX-License-Identifier: MIT
"""Tests of the `mha` program (cli/): demo, info, help, a numpy float64 check of `mha run`, and
every error path of `mha run`: each must exit non-zero with exactly one line on stderr naming the
offending file or flag, and leave no output (and no temporary) file behind.

Run by ctest with MHA_CLI=<path to mha>; needs numpy only (safetensors files are written by the
small writer below, not by the `safetensors` package). Full parity with PyTorch is tested
elsewhere (the golden tests); here the reference is a plain float64 numpy formula.
"""
import json
import os
import re
import struct
import subprocess

import numpy as np
import pytest
from tolerances import TOL_OUT_REL

CLI = os.environ.get("MHA_CLI")
pytestmark = pytest.mark.skipif(not CLI, reason="MHA_CLI (path to the mha program) is not set")

# float32 compute against a float64 reference: the documented tolerance of the project.
TOL = TOL_OUT_REL  # tests/common/tolerance.h


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
def write_safetensors(path, tensors, raw_tail=b""):
    """Minimal safetensors writer: 8-byte little-endian header size, JSON header, raw data."""
    names = {np.dtype("float32"): "F32", np.dtype("float64"): "F64", np.dtype("float16"): "F16"}
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        data = arr.astype(arr.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": names[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs) + raw_tail)


def make_weights(rng, q_dim=16, heads=4, d_k=None, out_dim=None, k_dim=None, v_dim=None,
                 kv_heads=None, bias=True):
    """HF-style tensors (q_proj.weight, ...) for a layer; returns (tensors dict, sizes)."""
    d_k = d_k or q_dim // heads
    out_dim = out_dim or q_dim
    k_dim = k_dim or q_dim
    v_dim = v_dim or k_dim
    g = kv_heads or heads
    t = {
        "q_proj.weight": rng.standard_normal((heads * d_k, q_dim)) / np.sqrt(q_dim),
        "k_proj.weight": rng.standard_normal((g * d_k, k_dim)) / np.sqrt(k_dim),
        "v_proj.weight": rng.standard_normal((g * d_k, v_dim)) / np.sqrt(v_dim),
        "o_proj.weight": rng.standard_normal((out_dim, heads * d_k)) / np.sqrt(heads * d_k),
    }
    if bias:
        for p, rows in (("q", heads * d_k), ("k", g * d_k), ("v", g * d_k), ("o", out_dim)):
            t[p + "_proj.bias"] = 0.1 * rng.standard_normal(rows)
    return {k: v.astype(np.float32) for k, v in t.items()}


def ref_mha(x, w, heads, kv=None, kv_heads=None, causal=False, align="bottom-right",
            offsets=None, window=None, bool_mask=None, additive=None, key_padding=None,
            q_seg=None, kv_seg=None, scale=None, softcap=None, alibi=False, sinks=None,
            act=None):
    """Multi-head attention in float64 (no RoPE), written from the formulas of the issue.
    x: [B, n, q_dim], kv: [B, m, k_dim]; masks broadcast to [B, h, n, m]. Returns (y, p).
    act: a function rounding the intermediates (Q, K, V and the attention output, as a half
    module stores them: docs/SEMANTICS.md "Half precision in the layer"), or None."""
    rnd = act or (lambda a: a)
    f = {k: v.astype(np.float64) for k, v in w.items()}
    x = x.astype(np.float64)
    kv = x if kv is None else kv.astype(np.float64)
    g = kv_heads or heads

    def lin(a, name):
        y = a @ f[name + ".weight"].T
        return y + f[name + ".bias"] if name + ".bias" in f else y

    B, n, _ = x.shape
    m = kv.shape[1]
    q = rnd(lin(x, "q_proj")).reshape(B, n, heads, -1).transpose(0, 2, 1, 3)
    k = rnd(lin(kv, "k_proj")).reshape(B, m, g, -1).transpose(0, 2, 1, 3)
    v = rnd(lin(kv, "v_proj")).reshape(B, m, g, -1).transpose(0, 2, 1, 3)
    k = np.repeat(k, heads // g, axis=1)
    v = np.repeat(v, heads // g, axis=1)
    scale = scale or 1.0 / np.sqrt(q.shape[-1])
    s = q @ k.transpose(0, 1, 3, 2) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    # p = i + delta[b]: the row's diagonal (bottom-right m - n, top-left 0, or explicit).
    if offsets is not None:
        delta = np.asarray(offsets, dtype=np.int64).reshape(B)
    else:
        delta = np.full(B, m - n if align == "bottom-right" else 0, dtype=np.int64)
    i = np.arange(n)[None, None, :, None]
    j = np.arange(m)[None, None, None, :]
    p_diag = i + delta[:, None, None, None]
    allowed = np.ones((B, heads, n, m), dtype=bool)
    if causal:
        allowed &= j <= p_diag
    if window is not None:
        left, right = window
        if left >= 0:
            allowed &= j >= p_diag - left
        if right >= 0:
            allowed &= j <= p_diag + right
    if bool_mask is not None:
        allowed &= np.broadcast_to(bool_mask != 0, allowed.shape)
    if key_padding is not None:
        allowed &= np.broadcast_to(np.asarray(key_padding).reshape(-1, 1, 1, m) != 0,
                                   allowed.shape)
    if q_seg is not None:
        allowed &= (np.asarray(q_seg).reshape(-1, 1, n, 1) ==
                    np.asarray(kv_seg).reshape(-1, 1, 1, m))
    if additive is not None:
        s = s + additive.astype(np.float64)
    if alibi:  # h a power of two here: slope_k = 2^(-8(k+1)/h)
        slopes = 2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)
        s = s - slopes[None, :, None, None] * np.abs(p_diag - j)
    s = np.where(allowed, s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    sink = None
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64).reshape(1, heads, 1, 1)
        mx = np.maximum(mx, sink)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.where(allowed, np.exp(s - mx), 0.0)
    tot = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        tot = tot + np.exp(sink - mx)
    p = np.where(tot > 0, e / np.where(tot > 0, tot, 1), 0.0)
    o = rnd((p @ v).transpose(0, 2, 1, 3).reshape(B, n, -1))
    return lin(o, "o_proj"), p


def run_cli(*args, cwd=None):
    return subprocess.run([CLI, *[str(a) for a in args]], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def close(a, ref):
    a = np.asarray(a, dtype=np.float64)
    assert a.shape == ref.shape, (a.shape, ref.shape)
    err = np.max(np.abs(a - ref))
    assert err <= TOL * max(np.max(np.abs(ref)), 1e-30), f"max error {err:.3g}"


@pytest.fixture
def case(tmp_path):
    """A valid self-attention case in tmp_path: W.safetensors (q_dim 16, 4 heads, biases) and
    X.npy [2, 5, 16]; returns a small namespace with the paths and the arrays."""
    rng = np.random.default_rng(1234)
    w = make_weights(rng)
    write_safetensors(tmp_path / "W.safetensors", w)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    np.save(tmp_path / "X.npy", x)

    class Case:
        pass

    c = Case()
    c.dir, c.w, c.x, c.rng = tmp_path, w, x, rng
    c.W, c.X, c.Y, c.A = (str(tmp_path / n) for n in ("W.safetensors", "X.npy", "Y.npy", "A.npy"))
    c.base = ["run", "--weights", c.W, "--heads", 4, "--input", c.X, "--out", c.Y]
    return c


# ---------------------------------------------------------------------------------------------
# demo, info, help
# ---------------------------------------------------------------------------------------------
def test_demo_default():
    r = run_cli("demo")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    for word in ("the", "cat", "sat", "mat", "because", "tired"):
        assert word in r.stdout
    for h in range(4):
        assert f"head {h}" in r.stdout
    assert "\u2588" in r.stdout  # Unicode blocks by default


def test_demo_ascii_sentence_and_head():
    r = run_cli("demo", "--ascii", "--head", "2", "--sentence", "a dog chased the ball")
    assert r.returncode == 0, r.stderr
    assert "dog" in r.stdout and "ball" in r.stdout
    assert "@" in r.stdout
    assert all(ord(ch) < 128 for ch in r.stdout)


@pytest.mark.parametrize("args", [["--head", "4"], ["--sentence", "   "], ["--bogus"],
                                  ["--sentence", " ".join(["w"] * 33)]])
def test_demo_bad_args(args):
    r = run_cli("demo", *args)
    assert r.returncode == 2
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("mha: ")


def test_info():
    r = run_cli("info")
    assert r.returncode == 0, r.stderr
    assert "threads" in r.stdout and "reference" in r.stdout and "fast" in r.stdout


def test_help_lists_every_contract_flag():
    r = run_cli("run", "--help")
    assert r.returncode == 0
    for flag in ("--weights", "--prefix", "--heads", "--kv-heads", "--input", "--key", "--value",
                 "--causal", "bottom-right", "top-left", "--window", "--mask", "--mask-means",
                 "--key-padding-mask", "--rope-theta", "--rope-style", "--rope-dim",
                 "--positions", "--key-positions", "--scale", "--softcap", "--alibi", "--sinks",
                 "--out", "--attn", "--attn-average", "--threads", "--impl", "--names",
                 "--rope-scaling", "--causal-offsets", "--q-segments", "--kv-segments",
                 "--dropout", "--seed", "Example"):
        assert flag in r.stdout, flag
    top = run_cli("--help")
    assert top.returncode == 0 and "demo" in top.stdout and "run" in top.stdout
    assert run_cli("demo", "--help").returncode == 0
    assert run_cli("--version").returncode == 0


def test_no_arguments_is_a_usage_error():
    r = run_cli()
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and "--help" in r.stderr


# ---------------------------------------------------------------------------------------------
# mha run: results
# ---------------------------------------------------------------------------------------------
def test_run_matches_numpy_3d(case):
    r = run_cli(*case.base, "--attn", case.A)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    y_ref, p_ref = ref_mha(case.x, case.w, 4)
    close(np.load(case.Y), y_ref)
    close(np.load(case.A), p_ref)
    assert np.load(case.Y).dtype == np.float32
    assert sorted(os.listdir(case.dir)) == ["A.npy", "W.safetensors", "X.npy", "Y.npy"]


def test_run_matches_numpy_2d_equals_form_average(case):
    x2 = case.x[1].astype(np.float64)  # float64 input is accepted and converted
    np.save(case.dir / "X2.npy", x2)
    r = run_cli("run", f"--weights={case.W}", "--heads=4", f"--input={case.dir / 'X2.npy'}",
                f"--out={case.Y}", f"--attn={case.A}", "--attn-average", "--threads=2",
                "--impl=reference")
    assert r.returncode == 0, r.stderr
    y_ref, p_ref = ref_mha(x2[None], case.w, 4)
    close(np.load(case.Y), y_ref[0])
    close(np.load(case.A), p_ref.mean(axis=1)[0])


def test_run_cross_attention_causal_and_mask(case):
    """Cross-attention n=5, m=7 with bottom-right/top-left causal and a broadcast bool mask."""
    kv = case.rng.standard_normal((2, 7, 16)).astype(np.float32)
    np.save(case.dir / "K.npy", kv)
    mask = case.rng.random((1, 4, 1, 7)) > 0.3
    mask[..., 0] = True
    np.save(case.dir / "M.npy", mask)
    for align in ("bottom-right", "top-left"):
        r = run_cli(*case.base, "--key", case.dir / "K.npy", "--value", case.dir / "K.npy",
                    "--causal", align, "--mask", case.dir / "M.npy", "--attn", case.A)
        assert r.returncode == 0, r.stderr
        y_ref, p_ref = ref_mha(case.x, case.w, 4, kv=kv, causal=True, align=align,
                               bool_mask=mask)
        close(np.load(case.Y), y_ref)
        close(np.load(case.A), p_ref)


def test_run_mask_block_polarity_and_additive(case):
    blocked = np.zeros((5, 5), dtype=np.uint8)
    blocked[:, 3] = 1
    np.save(case.dir / "M.npy", blocked)
    r = run_cli(*case.base, "--mask", case.dir / "M.npy", "--mask-means", "block")
    assert r.returncode == 0, r.stderr
    close(np.load(case.Y), ref_mha(case.x, case.w, 4, bool_mask=1 - blocked)[0])
    add = case.rng.standard_normal((2, 1, 5, 5)).astype(np.float64)
    np.save(case.dir / "F.npy", add)
    r = run_cli(*case.base, "--mask", case.dir / "F.npy")
    assert r.returncode == 0, r.stderr
    close(np.load(case.Y), ref_mha(case.x, case.w, 4, additive=add)[0])


def test_run_verbose_says_what_the_mask_is(case):
    """--verbose names the built-in rule a --mask equals (issue 29, mha_mask_recognize); the rule
    then runs instead of the tensor, with the same output bit for bit."""
    n = 5
    tril = np.tril(np.ones((n, n), bool))
    runs = {}
    for name, arr, extra in (
            ("bool", tril, []),
            ("block", ~tril, ["--mask-means", "block"]),
            ("float", np.where(tril, 0.0, -np.inf).astype(np.float32), [])):
        np.save(case.dir / "M.npy", arr)
        r = run_cli(*case.base, "--mask", case.dir / "M.npy", *extra, "--verbose")
        assert r.returncode == 0, r.stderr
        assert ("mha: mask: recognised as causal (delta 0): the rule runs, the tensor is not "
                "read per score") in r.stderr, (name, r.stderr)
        runs[name] = np.load(case.Y)
    r = run_cli(*case.base, "--causal", "top-left")
    assert r.returncode == 0, r.stderr
    for name, y in runs.items():
        assert np.array_equal(y, np.load(case.Y)), name
    # A chunked causal mask (Llama 4, chunk 2): the rule causal + chunk_size, bit for bit.
    pos = np.arange(n)
    chunked = tril & (pos[None, :] // 2 == pos[:, None] // 2)
    np.save(case.dir / "M.npy", chunked)
    r = run_cli(*case.base, "--mask", case.dir / "M.npy", "--verbose")
    assert r.returncode == 0, r.stderr
    assert "mask: recognised as causal (delta 0) + chunk 2: the rule runs" in r.stderr, r.stderr
    y = np.load(case.Y)
    r = run_cli(*case.base, "--causal", "top-left", "--chunk-size", "2")
    assert r.returncode == 0, r.stderr
    assert np.array_equal(y, np.load(case.Y))
    close(y, ref_mha(case.x, case.w, 4, bool_mask=chunked)[0])
    # HF's 4-d mask: causal AND left padding (batch row 1's first two keys).
    hf = np.broadcast_to(tril, (2, 1, n, n)).copy()
    hf[1, :, :, :2] = False
    np.save(case.dir / "M.npy", hf)
    r = run_cli(*case.base, "--mask", case.dir / "M.npy", "--verbose")
    assert r.returncode == 0, r.stderr
    assert "mask: recognised as causal (delta 0) + key padding: the rule runs" in r.stderr
    close(np.load(case.Y), ref_mha(case.x, case.w, 4, bool_mask=hf)[0])
    # With a rule of the run's own, the tensor is kept; a mask that is no rule says so.
    r = run_cli(*case.base, "--mask", case.dir / "M.npy", "--causal", "--verbose")
    assert r.returncode == 0, r.stderr
    assert "mask: recognised as causal (delta 0) + key padding, kept as a tensor" in r.stderr
    other = tril.copy()
    other[4, 1] = False
    np.save(case.dir / "M.npy", other)
    r = run_cli(*case.base, "--mask", case.dir / "M.npy", "--verbose")
    assert r.returncode == 0, r.stderr
    assert "mha: mask: no built-in rule (tensor read per tile)" in r.stderr
    close(np.load(case.Y), ref_mha(case.x, case.w, 4, bool_mask=other)[0])
    # ... and how the block mask divides the scores: one 64 x 64 tile per (batch row, head),
    # mixed (the mask hides some of its elements, not all).
    got = re.search(r"mha: block mask: (\d+) tiles of 64 x 64 \(all heads\) hidden \(skipped\), "
                    r"(\d+) visible \(unmasked kernel\), (\d+) mixed; (\d+) bytes", r.stderr)
    assert got, r.stderr
    B = case.x.shape[0] if case.x.ndim == 3 else 1
    assert [int(g) for g in got.groups()[:3]] == [0, 0, B * 4], r.stderr


# Each option of `mha run` against the numpy formula: (id, extra CLI args built in dir d,
# keyword arguments of ref_mha). Self-attention on X [2, 5, 16], 4 heads.
def _opt_cases():
    kp = np.array([[1, 1, 0, 1, 1], [1, 0, 0, 0, 1]], dtype=bool)
    qs = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]], dtype=np.int64)
    sinks = np.array([0.5, -1.0, 2.0, 0.0], dtype=np.float32)
    return [
        ("key-padding", lambda d: ["--key-padding-mask", _np_save(d / "P.npy", kp)],
         dict(key_padding=kp)),
        ("key-padding-1d-int", lambda d: ["--key-padding-mask",
                                          _np_save(d / "P.npy", kp[0].astype(np.int32))],
         dict(key_padding=kp[0])),
        ("window", lambda d: ["--window", "2,0"], dict(window=(2, 0))),
        ("window-top-left-causal", lambda d: ["--window", "1,-1", "--causal", "top-left"],
         dict(window=(1, -1), causal=True, align="top-left")),
        ("causal-offsets-fully-masked-row",
         lambda d: ["--causal", "--causal-offsets",
                    _np_save(d / "O.npy", np.array([0, -1], np.int32))],
         dict(causal=True, offsets=[0, -1])),
        ("offsets-place-window-and-alibi",
         lambda d: ["--window", "1,0", "--alibi", "--causal-offsets",
                    _np_save(d / "O.npy", np.array([2, -1], np.int64))],
         dict(window=(1, 0), alibi=True, offsets=[2, -1])),
        ("segments", lambda d: ["--q-segments", _np_save(d / "Q.npy", qs), "--kv-segments",
                                _np_save(d / "K.npy", qs.astype(np.int32))],
         dict(q_seg=qs, kv_seg=qs)),
        ("segments-1d", lambda d: ["--q-segments", _np_save(d / "Q.npy", qs[1]),
                                   "--kv-segments", _np_save(d / "K.npy", qs[1])],
         dict(q_seg=np.tile(qs[1], (2, 1)), kv_seg=np.tile(qs[1], (2, 1)))),
        ("scale-softcap-alibi", lambda d: ["--scale", "0.7", "--softcap", "0.5", "--alibi"],
         dict(scale=0.7, softcap=0.5, alibi=True)),
        ("sinks", lambda d: ["--sinks", _np_save(d / "S.npy", sinks), "--causal"],
         dict(sinks=sinks, causal=True)),
        ("sinks-float64", lambda d: ["--sinks", _np_save(d / "S.npy", sinks.astype(np.float64))],
         dict(sinks=sinks)),
    ]


@pytest.mark.parametrize("name,extra,kw", _opt_cases(), ids=[c[0] for c in _opt_cases()])
def test_run_option_matches_numpy(case, name, extra, kw):
    r = run_cli(*case.base, *extra(case.dir), "--attn", case.A)
    assert r.returncode == 0, r.stderr
    y_ref, p_ref = ref_mha(case.x, case.w, 4, **kw)
    y = np.load(case.Y)
    assert np.all(np.isfinite(y))
    close(y, y_ref)
    close(np.load(case.A), p_ref)


def test_run_gqa_and_sinks_from_weights_file(case):
    """kv heads inferred from the shapes (GQA, 2 kv heads); a "sinks" tensor in the file is used
    and --sinks overrides it."""
    w = make_weights(case.rng, kv_heads=2)
    sinks = np.array([1.0, -0.5, 0.25, 3.0], dtype=np.float32)
    write_safetensors(case.dir / "G.safetensors", {**w, "sinks": sinks})
    args = ["run", "--weights", case.dir / "G.safetensors", "--heads", 4, "--input", case.X,
            "--out", case.Y]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    close(np.load(case.Y), ref_mha(case.x, w, 4, kv_heads=2, sinks=sinks)[0])
    other = np.zeros(4, dtype=np.float32)
    r = run_cli(*args, "--kv-heads", 2, "--sinks", _np_save(case.dir / "S.npy", other))
    assert r.returncode == 0, r.stderr
    close(np.load(case.Y), ref_mha(case.x, w, 4, kv_heads=2, sinks=other)[0])


def test_run_names_map_and_prefix(case):
    """BERT-style names through --names, under a --prefix."""
    ren = {"q_proj": "attention.self.query", "k_proj": "attention.self.key",
           "v_proj": "attention.self.value", "o_proj": "attention.output.dense"}
    t = {}
    for k, v in case.w.items():
        stem, kind = k.split(".")
        t["encoder.layer.0." + ren[stem] + "." + kind] = v
    write_safetensors(case.dir / "B.safetensors", t)
    r = run_cli("run", "--weights", case.dir / "B.safetensors", "--prefix", "encoder.layer.0.",
                "--names", ",".join(f"{k[0]}={v}" for k, v in ren.items()), "--heads", 4,
                "--input", case.X, "--out", case.Y)
    assert r.returncode == 0, r.stderr
    close(np.load(case.Y), ref_mha(case.x, case.w, 4)[0])


def test_run_dropout_is_deterministic(case):
    outs = {}
    for key, extra in {"a": ["--seed", "7", "--threads", "1"], "b": ["--seed", "7", "--threads",
                                                                     "3"],
                       "c": ["--seed", "8"]}.items():
        r = run_cli(*case.base, "--dropout", "0.5", *extra)
        assert r.returncode == 0, r.stderr
        outs[key] = np.load(case.Y)
    assert np.array_equal(outs["a"], outs["b"])
    assert not np.array_equal(outs["a"], outs["c"])
    r = run_cli(*case.base)
    assert r.returncode == 0
    assert not np.array_equal(outs["a"], np.load(case.Y))


@pytest.mark.parametrize("scaling", [["--rope-scaling", "linear", "--rope-factor", "2"],
                                     ["--rope-scaling", "ntk", "--rope-factor", "4"],
                                     ["--rope-scaling", "llama3", "--rope-factor", "8",
                                      "--rope-original-max", "16", "--rope-low-freq", "1",
                                      "--rope-high-freq", "4"],
                                     ["--rope-scaling", "yarn", "--rope-factor", "4",
                                      "--rope-original-max", "16", "--rope-beta-fast", "32",
                                      "--rope-beta-slow", "1", "--rope-attention-factor", "1.1"]],
                         ids=["linear", "ntk", "llama3", "yarn"])
def test_run_rope_scalings_run(case, scaling):
    r = run_cli(*case.base, "--rope-theta", "500", "--rope-dim", "4", *scaling, "--causal")
    assert r.returncode == 0, r.stderr
    assert np.all(np.isfinite(np.load(case.Y)))


def test_run_rope_dynamic_is_ntk_at_the_call_length(case):
    """--rope-scaling dynamic over n = 5 positions with original max 3: NTK with factor
    3 * 5/3 - (3 - 1) = 3, bit for bit; without --rope-original-max, an error naming it."""
    rope = ["--rope-theta", "500", "--rope-dim", "4", "--causal"]
    outs = []
    for scaling in (["dynamic", "--rope-factor", "3", "--rope-original-max", "3"],
                    ["ntk", "--rope-factor", "3"],
                    ["dynamic", "--rope-factor", "3", "--rope-original-max", "5"],
                    ["none"]):
        r = run_cli(*case.base, *rope, "--rope-scaling", *scaling)
        assert r.returncode == 0, r.stderr
        outs.append(np.load(case.Y))
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[2], outs[3])
    assert not np.array_equal(outs[0], outs[3])
    r = run_cli(*case.base, *rope, "--rope-scaling", "dynamic", "--rope-factor", "3")
    assert r.returncode != 0 and "original_max_position" in r.stderr, r.stderr


def test_run_overwrites_existing_output(case):
    np.save(case.Y, np.zeros(3))
    r = run_cli(*case.base)
    assert r.returncode == 0, r.stderr
    assert np.load(case.Y).shape == (2, 5, 16)


def test_run_rope_accepts_positions(case):
    """RoPE with explicit positions runs; shifting every position by a constant leaves the
    output unchanged (scores depend only on relative position)."""
    np.save(case.dir / "P0.npy", np.arange(5, dtype=np.int32))
    np.save(case.dir / "P1.npy", np.tile(np.arange(5, dtype=np.int64) + 1000, (2, 1)))
    outs = []
    for p in ("P0.npy", "P1.npy"):
        r = run_cli(*case.base, "--rope-theta", "10000", "--rope-style", "half",
                    "--positions", case.dir / p)
        assert r.returncode == 0, r.stderr
        outs.append(np.load(case.Y))
    assert np.max(np.abs(outs[0] - outs[1])) < 1e-4


# ---------------------------------------------------------------------------------------------
# mha run: every error path
# ---------------------------------------------------------------------------------------------
def _np_save(path, arr):
    np.save(path, arr)
    return str(path)


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def _nan_weights(c):
    w = dict(c.w)
    w["k_proj.weight"] = w["k_proj.weight"].copy()
    w["k_proj.weight"][2, 3] = np.nan
    write_safetensors(c.dir / "NaN.safetensors", w)
    return ["run", "--weights", c.dir / "NaN.safetensors", "--heads", 4, "--input", c.X,
            "--out", c.Y]


def _truncated_weights(c):
    data = open(c.W, "rb").read()
    _write(c.dir / "T.safetensors", data[: len(data) - 100])
    return ["run", "--weights", c.dir / "T.safetensors", "--heads", 4, "--input", c.X,
            "--out", c.Y]


def _misnamed_weights(c):
    w = {("query." + k if k.startswith("q_") else k): v for k, v in c.w.items()}
    write_safetensors(c.dir / "M.safetensors", w)
    return ["run", "--weights", c.dir / "M.safetensors", "--heads", 4, "--input", c.X,
            "--out", c.Y]


def _with(*extra):
    return lambda c: c.base + [e(c) if callable(e) else e for e in extra]


def _replace_input(make):
    def f(c):
        args = list(c.base)
        args[args.index("--input") + 1] = make(c)
        return args

    return f


# (id, builder of the argument list, expected exit status, text the stderr line must contain)
ERRORS = [
    ("unknown-flag", _with("--bogus", "1"), 2, "--bogus"),
    ("unknown-command", lambda c: ["frobnicate"], 2, "frobnicate"),
    ("missing-heads", lambda c: ["run", "--weights", c.W, "--input", c.X, "--out", c.Y], 2,
     "--heads"),
    ("missing-out", lambda c: ["run", "--weights", c.W, "--heads", 4, "--input", c.X], 2,
     "--out"),
    ("heads-zero", lambda c: [a if a != 4 else 0 for a in c.base], 2, "--heads"),
    ("heads-negative", lambda c: [a if a != 4 else -1 for a in c.base], 2, "--heads"),
    ("heads-abc", lambda c: [a if a != 4 else "abc" for a in c.base], 2, "--heads"),
    ("heads-trailing-junk", lambda c: [a if a != 4 else "4x" for a in c.base], 2, "--heads"),
    ("heads-not-dividing", lambda c: [a if a != 4 else 3 for a in c.base], 1, "W.safetensors"),
    ("kv-heads-not-dividing", _with("--kv-heads", "3"), 2, "--kv-heads"),
    ("kv-heads-mismatch", _with("--kv-heads", "2"), 1, "W.safetensors"),
    ("value-missing", lambda c: c.base[:-2] + ["--out"], 2, "--out"),
    ("given-twice", _with("--heads", "4"), 2, "--heads"),
    ("flag-with-value", _with("--alibi=yes"), 2, "--alibi"),
    ("stray-argument", _with("extra"), 2, "extra"),
    ("missing-weights-file",
     lambda c: ["run", "--weights", c.dir / "nope.safetensors", "--heads", 4, "--input", c.X,
                "--out", c.Y], 1, "nope.safetensors"),
    ("weights-is-directory",
     lambda c: ["run", "--weights", c.dir, "--heads", 4, "--input", c.X, "--out", c.Y], 1,
     "<the directory>"),
    ("truncated-weights", _truncated_weights, 1, "T.safetensors"),
    ("garbage-weights",
     lambda c: ["run", "--weights", _write(c.dir / "G.safetensors", b"\xff" * 64), "--heads", 4,
                "--input", c.X, "--out", c.Y], 1, "G.safetensors"),
    ("misnamed-weights", _misnamed_weights, 1, "M.safetensors"),
    ("nan-in-weights", _nan_weights, 1, "NaN.safetensors"),
    ("names-bad-key", _with("--names", "q=a,x=b"), 2, "--names"),
    ("names-no-equals", _with("--names", "q"), 2, "--names"),
    ("names-not-found", _with("--names", "q=a,k=b,v=c,o=d"), 1, "W.safetensors"),
    ("missing-input-file", _replace_input(lambda c: str(c.dir / "none.npy")), 1, "none.npy"),
    ("corrupt-npy", _replace_input(lambda c: _write(c.dir / "C.npy", b"\x93NUMPY\x01\x00garbage")),
     1, "C.npy"),
    ("truncated-npy",
     _replace_input(lambda c: _write(c.dir / "C.npy", open(c.X, "rb").read()[:-7])), 1, "C.npy"),
    ("input-last-dim", _replace_input(lambda c: _np_save(c.dir / "I.npy",
                                                         np.zeros((2, 5, 10), np.float32))),
     1, "I.npy"),
    ("input-1d", _replace_input(lambda c: _np_save(c.dir / "I.npy", np.zeros(16, np.float32))), 1,
     "I.npy"),
    ("input-4d", _replace_input(lambda c: _np_save(c.dir / "I.npy",
                                                   np.zeros((1, 2, 5, 16), np.float32))), 1,
     "I.npy"),
    ("input-empty", _replace_input(lambda c: _np_save(c.dir / "I.npy",
                                                      np.zeros((0, 16), np.float32))), 1, "I.npy"),
    ("input-complex", _replace_input(lambda c: _np_save(c.dir / "I.npy",
                                                        np.zeros((5, 16), np.complex64))), 1,
     "I.npy"),
    ("input-string", _replace_input(lambda c: _np_save(c.dir / "I.npy",
                                                       np.array([["abc"] * 16] * 5))), 1, "I.npy"),
    ("input-int32", _replace_input(lambda c: _np_save(c.dir / "I.npy",
                                                      np.zeros((5, 16), np.int32))), 1, "I.npy"),
    ("key-batch-mismatch",
     _with("--key", lambda c: _np_save(c.dir / "K.npy", np.zeros((3, 7, 16), np.float32))), 1,
     "K.npy"),
    ("key-2d-for-3d-input",
     _with("--key", lambda c: _np_save(c.dir / "K.npy", np.zeros((7, 16), np.float32))), 1,
     "K.npy"),
    ("value-length-mismatch",
     _with("--key", lambda c: _np_save(c.dir / "K.npy", np.zeros((2, 7, 16), np.float32)),
           "--value", lambda c: _np_save(c.dir / "V.npy", np.zeros((2, 6, 16), np.float32))), 1,
     "V.npy"),
    ("value-without-key",
     _with("--value", lambda c: _np_save(c.dir / "V.npy", np.zeros((2, 5, 16), np.float32))), 2,
     "--value"),
    ("mask-not-broadcastable",
     _with("--mask", lambda c: _np_save(c.dir / "M.npy", np.ones((3, 5), bool))), 1, "M.npy"),
    ("mask-batch-mismatch",
     _with("--mask", lambda c: _np_save(c.dir / "M.npy", np.ones((3, 4, 5, 5), bool))), 1,
     "M.npy"),
    ("mask-5d",
     _with("--mask", lambda c: _np_save(c.dir / "M.npy", np.ones((1, 1, 1, 5, 5), bool))), 1,
     "M.npy"),
    ("mask-complex",
     _with("--mask", lambda c: _np_save(c.dir / "M.npy", np.ones((5, 5), np.complex64))), 1,
     "M.npy"),
    ("mask-means-bogus",
     _with("--mask", lambda c: _np_save(c.dir / "M.npy", np.ones((5, 5), bool)), "--mask-means",
           "maybe"), 2, "--mask-means"),
    ("mask-means-without-mask", _with("--mask-means", "block"), 2, "--mask-means"),
    # A float mask is additive: --mask-means had no effect on it (a 0/1 float mask "block" ran
    # as +0 / +1 added to the scores, exit 0); now refused naming the file.
    ("mask-means-float-mask",
     _with("--mask", lambda c: _np_save(c.dir / "M.npy", np.eye(5, dtype=np.float32)),
           "--mask-means", "block"), 1, "M.npy: --mask-means block is for a boolean mask"),
    ("key-padding-wrong-shape",
     _with("--key-padding-mask", lambda c: _np_save(c.dir / "P.npy", np.ones((2, 4), bool))), 1,
     "P.npy"),
    ("key-padding-float",
     _with("--key-padding-mask", lambda c: _np_save(c.dir / "P.npy", np.ones((2, 5)))), 1,
     "P.npy"),
    ("positions-negative",
     _with("--rope-theta", "10000", "--positions",
           lambda c: _np_save(c.dir / "POS.npy", np.array([0, 1, -2, 3, 4], np.int64))), 1,
     "POS.npy"),
    ("positions-too-large",
     _with("--rope-theta", "10000", "--positions",
           lambda c: _np_save(c.dir / "POS.npy", np.array([0, 1, 2, 3, 2**31 + 1], np.int64))), 1,
     "POS.npy"),
    ("positions-absurd",
     _with("--rope-theta", "10000", "--positions",
           lambda c: _np_save(c.dir / "POS.npy", np.full(5, 2**62, np.int64))), 1, "POS.npy"),
    ("positions-wrong-length",
     _with("--rope-theta", "10000", "--positions",
           lambda c: _np_save(c.dir / "POS.npy", np.arange(4, dtype=np.int32))), 1, "POS.npy"),
    ("positions-float",
     _with("--rope-theta", "10000", "--positions",
           lambda c: _np_save(c.dir / "POS.npy", np.arange(5, dtype=np.float32))), 1, "POS.npy"),
    ("key-positions-wrong-batch",
     _with("--rope-style", "half", "--key-positions",
           lambda c: _np_save(c.dir / "KP.npy", np.zeros((3, 5), np.int32))), 1, "KP.npy"),
    ("positions-without-rope",
     _with("--positions", lambda c: _np_save(c.dir / "POS.npy", np.arange(5, dtype=np.int32))),
     2, "--positions"),
    ("window-one-number", _with("--window", "3"), 2, "--window"),
    ("window-letters", _with("--window", "a,b"), 2, "--window"),
    ("window-three", _with("--window", "1,2,3"), 2, "--window"),
    ("window-below-minus-one", _with("--window", "-2,0"), 2, "--window"),
    ("window-empty-side", _with("--window", ",4"), 2, "--window"),
    ("rope-dim-odd", _with("--rope-theta", "10000", "--rope-dim", "3"), 2, "--rope-dim"),
    ("rope-dim-too-large", _with("--rope-theta", "10000", "--rope-dim", "8"), 1, "--rope-dim"),
    ("rope-theta-nan", _with("--rope-theta", "nan"), 2, "--rope-theta"),
    ("rope-style-bogus", _with("--rope-style", "spiral"), 2, "--rope-style"),
    ("rope-scaling-bogus", _with("--rope-theta", "1e4", "--rope-scaling", "quadratic"), 2,
     "--rope-scaling"),
    ("rope-factor-without-scaling", _with("--rope-theta", "1e4", "--rope-factor", "2"), 2,
     "--rope-factor"),
    ("rope-ntk-needs-more-dims",
     _with("--rope-theta", "1e4", "--rope-dim", "2", "--rope-scaling", "ntk"), 1,
     "W.safetensors"),
    ("impl-bogus", _with("--impl", "turbo"), 2, "--impl"),
    ("causal-bogus", _with("--causal", "sideways"), 2, "--causal"),
    ("causal-equals-bogus", _with("--causal=diagonal"), 2, "--causal"),
    ("scale-inf", _with("--scale", "inf"), 2, "--scale"),
    ("scale-zero", _with("--scale", "0"), 2, "--scale"),
    ("softcap-negative", _with("--softcap", "-1"), 2, "--softcap"),
    ("threads-negative", _with("--threads", "-1"), 2, "--threads"),
    ("dropout-one", _with("--dropout", "1"), 2, "--dropout"),
    ("dropout-negative", _with("--dropout", "-0.1"), 2, "--dropout"),
    ("seed-without-dropout", _with("--seed", "5"), 2, "--seed"),
    ("seed-negative", _with("--dropout", "0.1", "--seed", "-5"), 2, "--seed"),
    ("attn-average-without-attn", _with("--attn-average"), 2, "--attn-average"),
    ("sinks-wrong-shape",
     _with("--sinks", lambda c: _np_save(c.dir / "S.npy", np.zeros(3, np.float32))), 1, "S.npy"),
    ("sinks-nan",
     _with("--sinks", lambda c: _np_save(c.dir / "S.npy", np.array([0, np.nan, 0, 0]))), 1,
     "S.npy"),
    ("segments-one-side",
     _with("--q-segments", lambda c: _np_save(c.dir / "QS.npy", np.zeros(5, np.int32))), 2,
     "--q-segments"),
    ("segments-wrong-shape",
     _with("--q-segments", lambda c: _np_save(c.dir / "QS.npy", np.zeros(5, np.int32)),
           "--kv-segments", lambda c: _np_save(c.dir / "KS.npy", np.zeros(6, np.int32))), 1,
     "KS.npy"),
    ("segments-out-of-int32",
     _with("--q-segments", lambda c: _np_save(c.dir / "QS.npy", np.full(5, 2**40, np.int64)),
           "--kv-segments", lambda c: _np_save(c.dir / "KS.npy", np.zeros(5, np.int32))), 1,
     "QS.npy"),
    ("causal-offsets-alone",
     _with("--causal-offsets", lambda c: _np_save(c.dir / "OFF.npy", np.zeros(2, np.int64))), 2,
     "--causal-offsets"),
    ("causal-offsets-wrong-shape",
     _with("--causal", "--causal-offsets",
           lambda c: _np_save(c.dir / "OFF.npy", np.zeros(3, np.int64))), 1,
     "OFF.npy"),
    ("causal-offsets-with-alignment",
     _with("--causal", "top-left", "--causal-offsets",
           lambda c: _np_save(c.dir / "OFF.npy", np.zeros(2, np.int64))), 2, "--causal"),
    ("out-and-attn-same-file", lambda c: c.base + ["--attn", c.Y], 2, "--attn"),
]


@pytest.mark.parametrize("name,build,status,needle", ERRORS, ids=[e[0] for e in ERRORS])
def test_run_error(case, name, build, status, needle):
    args = build(case)
    if name == "weights-is-directory":
        needle = str(case.dir)
    before = sorted(os.listdir(case.dir))
    r = run_cli(*args)
    assert r.returncode == status, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("mha: "), lines[0]
    assert needle in lines[0], lines[0]
    if status == 2:
        assert "--help" in lines[0]
    assert r.stdout == ""
    # Nothing written: no output, no temporary file.
    assert sorted(os.listdir(case.dir)) == before


@pytest.mark.parametrize("impl", ["reference", "fast", "auto"])
def test_run_impl(case, impl):
    """--impl fast either runs and agrees, or fails naming --impl, before writing anything."""
    before = sorted(os.listdir(case.dir))
    r = run_cli(*case.base, "--impl", impl, "--causal")
    y_ref = ref_mha(case.x, case.w, 4, causal=True)[0]
    if r.returncode == 0:
        close(np.load(case.Y), y_ref)
    else:
        assert impl == "fast", r.stderr
        assert r.returncode == 1
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and "--impl fast" in lines[0], r.stderr
        assert sorted(os.listdir(case.dir)) == before


def test_out_into_missing_directory(case):
    before = sorted(os.listdir(case.dir))
    out = case.dir / "nodir" / "Y.npy"
    r = run_cli("run", "--weights", case.W, "--heads", 4, "--input", case.X, "--out", out)
    assert r.returncode == 1
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "nodir" in lines[0], r.stderr
    assert sorted(os.listdir(case.dir)) == before


def test_attn_write_failure_removes_out(case):
    before = sorted(os.listdir(case.dir))
    attn = case.dir / "nodir" / "A.npy"
    r = run_cli(*case.base, "--attn", attn)
    assert r.returncode == 1
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "A.npy" in lines[0], r.stderr
    assert not os.path.exists(case.Y)
    assert sorted(os.listdir(case.dir)) == before


def _has_cairo():
    return "--plot" not in run_cli("run", "--weights", "w", "--heads", 1, "--input", "x",
                                   "--out", "y.npy", "--plot", "p.png").stderr


@pytest.mark.parametrize("failing", ["--attn", "--plot", "--attn-stats"])
def test_outputs_are_all_or_nothing(case, failing):
    """A run's outputs (--out, --attn, --plot, --attn-stats, written in that order) are one set:
    each is written to its temporary name, and they are renamed into place only when all are
    complete. Here a later output fails after the checks that come before the work (its
    temporary name <path>.tmp.<pid> is taken: a directory planted there by the child before it
    becomes mha), so the earlier ones were already written: exit 1 with one line naming the
    failing file and the problem, every file at an output path byte-identical to what it held
    before the run, and no temporary left. Until session 49 the earlier outputs were renamed into
    place as they were written and removed again on the failure: the files that had been at
    those paths were gone."""
    cairo = _has_cairo()
    if failing == "--plot" and not cairo:
        pytest.skip("built without cairo")
    outs = {"--out": case.Y, "--attn": case.A, "--attn-stats": str(case.dir / "S.npz")}
    if cairo:
        outs["--plot"] = str(case.dir / "P.png")
    for flag, path in outs.items():  # the previous run's files, with known content
        with open(path, "wb") as f:
            f.write(f"old {flag}".encode())
    before = {name: open(case.dir / name, "rb").read() for name in os.listdir(case.dir)}
    args = [CLI, *(str(a) for a in case.base[:-2])]
    for flag, path in outs.items():
        args += [flag, path]
    err = case.dir.parent / f"stderr-{case.dir.name}.txt"
    pid = os.fork()
    if pid == 0:  # the child takes the failing output's temporary name, then becomes mha
        try:
            os.mkdir(f"{outs[failing]}.tmp.{os.getpid()}")
            fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 2)
            os.execv(CLI, args)
        finally:
            os._exit(127)
    _, status = os.waitpid(pid, 0)
    lines = err.read_text().splitlines()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 1, (status, lines)
    assert len(lines) == 1 and os.path.basename(outs[failing]) in lines[0], lines
    assert f"cannot create '{outs[failing]}.tmp.{pid}'" in lines[0], lines
    planted = os.path.basename(outs[failing]) + f".tmp.{pid}"
    os.rmdir(case.dir / planted)  # (ours: left as it was)
    assert sorted(os.listdir(case.dir)) == sorted(before), "a file appeared or disappeared"
    for name, data in before.items():
        assert open(case.dir / name, "rb").read() == data, f"{name} changed"
    # Without the obstacle the same run replaces every one of them.
    r = run_cli(*args[1:])
    assert r.returncode == 0, r.stderr
    for flag, path in outs.items():
        assert open(path, "rb").read() != f"old {flag}".encode(), flag
    assert sorted(os.listdir(case.dir)) == sorted(before)


def test_error_line_has_no_control_characters(case):
    """A file name with a newline still gives exactly one stderr line."""
    r = run_cli("run", "--weights", str(case.dir / "bad\nname.safetensors"), "--heads", 4,
                "--input", case.X, "--out", case.Y)
    assert r.returncode == 1
    assert len(r.stderr.splitlines()) == 1, r.stderr
