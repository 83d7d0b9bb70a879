# SPDX-License-Identifier: MIT
"""The attention statistics from Python (mha.attention_stats) and from the CLI (mha run
--attn-stats S.npz --stats ...) against the same statistics computed in float64 NumPy from the
dense probabilities of the reference path (mha.attention(..., need_weights=True,
impl="reference"); the CLI's own --attn A.npy with --impl reference), over every mask kind,
window, sinks, GQA, the causal alignments, softcap and ALiBi; top-k ties; 1 and 2 threads give
the same bits; bad --stats lists are usage errors and leave no file.

Tolerances: tests/common/tolerance.h (via tests/tolerances.py), as in tests/test_stats.c: a
probability is within TOL_PROBS_ABS, so a sum of n of them within n TOL_PROBS_ABS; an entropy
within the backstop TOL_OUT_BACKSTOP_C u (1 + max|ln p|) (1 + H).
"""
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mha  # noqa: E402
from test_cli import make_weights, write_safetensors  # noqa: E402
from tolerances import TOL_OUT_BACKSTOP_C, TOL_PROBS_ABS, TOL_U32  # noqa: E402

CLI = os.environ.get("MHA_CLI")


def dense_stats(P, k, R, C):
    """Every statistic from dense probabilities P [B, h, n, m] (float64), as mha.h defines them."""
    P = P.astype(np.float64)
    B, h, n, m = P.shape
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(P > 0, P * np.log(np.where(P > 0, P, 1.0)), 0.0)
    sink = np.clip(1.0 - P.sum(-1), 0.0, 1.0)  # the sink's share (0 without sinks, up to rounding)
    with np.errstate(divide="ignore", invalid="ignore"):
        slog = np.where(sink > 1e-6, sink * np.log(np.where(sink > 0, sink, 1.0)), 0.0)
    out = {"received": P.sum(2), "received_total": P.sum((1, 2)),
           "entropy": -plogp.sum(-1) - slog}
    # Top-k: P descending, equal P by the lower index; hidden keys (P = 0 exactly) never listed.
    order = np.lexsort((np.broadcast_to(np.arange(m), P.shape), -P), axis=-1)[..., :k]
    prob = np.take_along_axis(P, order, -1)
    out["topk_index"] = np.where(prob > 0, order, -1)
    out["topk_prob"] = prob
    rows, cols = np.arange(n) * R // n, np.arange(m) * C // m
    cells = np.bincount(rows, minlength=R)[:, None] * np.bincount(cols, minlength=C)[None, :]
    pooled = np.zeros((B, h, R, C))
    visible = np.zeros((B, h, R, C))
    np.add.at(pooled, (slice(None), slice(None), rows[:, None], cols[None, :]), P)
    np.add.at(visible, (slice(None), slice(None), rows[:, None], cols[None, :]), P > 0)
    out["pooled"], out["pooled_visible"] = pooled / cells, visible / cells
    return out


def check_stats(got, P, k, R, C):
    ref = dense_stats(P, k, R, C)
    n = P.shape[2]
    assert np.abs(got["received"] - ref["received"]).max() <= TOL_PROBS_ABS * n
    assert np.abs(got["received_total"] - ref["received_total"]).max() <= \
        TOL_PROBS_ABS * n * P.shape[1]
    with np.errstate(divide="ignore"):
        lnp = np.where(P > 0, np.abs(np.log(np.where(P > 0, P, 1.0))), 0.0).max(-1)
    gate = TOL_OUT_BACKSTOP_C * TOL_U32 * (1 + lnp) * (1 + np.abs(ref["entropy"]))
    assert (np.abs(got["entropy"] - ref["entropy"]) <= gate).all()
    assert np.abs(got["topk_prob"] - ref["topk_prob"]).max() <= TOL_PROBS_ABS
    idx, want = got["topk_index"], ref["topk_index"]
    assert ((idx == -1) == (want == -1)).all()
    # An index may differ from the dense one only between near-equal probabilities.
    differ = idx != want
    if differ.any():
        p_got = np.take_along_axis(P, np.maximum(idx, 0), -1)[differ]
        assert np.abs(p_got - ref["topk_prob"][differ]).max() <= 2 * TOL_PROBS_ABS
    assert np.abs(got["pooled"] - ref["pooled"]).max() <= TOL_PROBS_ABS
    np.testing.assert_array_equal(got["pooled_visible"],
                                  ref["pooled_visible"].astype(np.float32))


# ------------------------------------------------------------------------------------------------
# Python
# ------------------------------------------------------------------------------------------------
B, H, G, N, M, D = 2, 4, 2, 37, 300, 8
RNG = np.random.default_rng(17)
OPTIONS = {
    "plain": {},
    "causal bottom-right": dict(causal=True),
    "causal top-left": dict(causal="top-left"),
    "explicit offsets + window": dict(alignment=np.array([5, 250]), window=(20, 3)),
    "bool mask block": dict(mask=RNG.random((B, 1, N, M)) < 0.3, mask_means="block"),
    "additive": dict(attn_bias=np.where(RNG.random((N, M)) < 0.1, -np.inf,
                                        RNG.standard_normal((N, M))).astype(np.float32)),
    "key padding": dict(key_padding_mask=RNG.random((B, M)) < 0.8),
    "segments": dict(q_segment_ids=np.repeat([[0, 1]], [20, 17], 1).repeat(B, 0),
                     kv_segment_ids=np.repeat([[0, 1]], [100, 200], 1).repeat(B, 0)),
    "sinks + softcap + alibi": dict(sinks=RNG.standard_normal(H).astype(np.float32),
                                    softcap=7.0, alibi=True, causal=True),
    "scale + sinks + window": dict(scale=0.9, sinks=np.ones(H, np.float32), window=(5, -1)),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_python_stats_match_dense_reference(name):
    kw = OPTIONS[name]
    if "alignment" in kw:
        kw = dict(kw, causal=True)
    q = RNG.standard_normal((B, H, N, D)).astype(np.float32) * 2
    k = RNG.standard_normal((B, G, M, D)).astype(np.float32)
    v = np.zeros((B, G, M, 1), np.float32)
    _, P = mha.attention(q, k, v, need_weights=True, impl="reference", **kw)
    kk, R, C = 7, 5, 31
    got = mha.attention_stats(q, k, stats=f"received,entropy,topk={kk},pool={R}x{C}", threads=1,
                              **kw)
    check_stats(got, P, kk, R, C)
    two = mha.attention_stats(q, k, stats=["received", "entropy", "topk", "pool"], top_k=kk,
                              pool=(R, C), threads=2, **kw)
    for key in got:
        assert got[key].tobytes() == two[key].tobytes(), key


def test_python_layouts_shapes_and_clamping():
    q = RNG.standard_normal((3, 6, 4)).astype(np.float32)  # [B, L, d]: one head
    k = RNG.standard_normal((3, 5, 4)).astype(np.float32)
    s = mha.attention_stats(q, k, stats="received,entropy,topk=99,pool=256x256")
    assert s["received"].shape == (3, 5) and s["received_total"].shape == (3, 5)
    assert s["entropy"].shape == (3, 6) and s["topk_index"].shape == (3, 6, 5)
    assert s["pooled"].shape == (3, 6, 5) and s["topk_index"].dtype == np.int64
    s2 = mha.attention_stats(q[0], k[0], stats="entropy")
    np.testing.assert_array_equal(s2["entropy"], s["entropy"][0])
    q4 = RNG.standard_normal((1, 7, 2, 4)).astype(np.float32)  # [B, L, h, d]
    k4 = RNG.standard_normal((1, 9, 2, 4)).astype(np.float32)
    a = mha.attention_stats(q4, k4, layout="blhd", stats="received")
    b = mha.attention_stats(q4.transpose(0, 2, 1, 3), k4.transpose(0, 2, 1, 3), stats="received")
    np.testing.assert_array_equal(a["received"], b["received"])
    with pytest.raises(ValueError, match="unknown statistic"):
        mha.attention_stats(q, k, stats="received,bogus")
    with pytest.raises(ValueError, match="cannot read"):
        mha.attention_stats(q, k, stats="pool=3by4")
    # top_k=2.5 listed 2 keys, pool=(2.5, 3) made 2 rows, pool=(2, 3, 4) dropped the 4, True was 1.
    for kw in (dict(top_k=2.5), dict(top_k=True), dict(pool=(2.5, 3))):
        with pytest.raises(TypeError, match="must be an integer"):
            mha.attention_stats(q, k, stats="topk,pool", **kw)
    with pytest.raises(ValueError, match="pool must be"):
        mha.attention_stats(q, k, stats="pool", pool=(2, 3, 4))
    s3 = mha.attention_stats(q, k, stats="topk,pool", top_k=np.int64(3), pool=(np.int32(2), 3))
    assert s3["topk_index"].shape == (3, 6, 3) and s3["pooled"].shape == (3, 2, 3)


def test_python_topk_ties_lower_index_first():
    q = np.array([[1, 0, 0, 0]], np.float32)
    k = np.array([[0, 0, 0, 0], [2, 0, 0, 0], [1, 1, 0, 0], [2, 0, 0, 0], [2, 0, 0, 0]],
                 np.float32)
    s = mha.attention_stats(q, k, stats="topk=5", key_padding_mask=np.array([1, 1, 0, 1, 1]))
    assert s["topk_index"][0].tolist() == [1, 3, 4, 0, -1]
    p = s["topk_prob"][0]
    assert p[0] == p[1] == p[2] > p[3] > 0 and p[4] == 0


def test_python_minus_inf_sink_is_no_sink():
    """A sink of -inf takes no mass (the forward's probabilities are those without it): the
    entropy is the plain softmax's, not 0 * -inf = NaN (it was NaN)."""
    q = RNG.standard_normal((1, 2, 9, 4)).astype(np.float32)
    k = RNG.standard_normal((1, 2, 11, 4)).astype(np.float32)
    sinks = np.array([-np.inf, 0.5], np.float32)
    got = mha.attention_stats(q, k, stats="received,entropy,topk=3", sinks=sinks, causal=True)
    plain = mha.attention_stats(q, k, stats="received,entropy,topk=3", causal=True)
    assert np.isfinite(got["entropy"]).all()
    for key in ("received", "entropy", "topk_index", "topk_prob"):  # head 0, the -inf one
        np.testing.assert_array_equal(got[key][:, 0], plain[key][:, 0], err_msg=key)
    _, P = mha.attention(q, k, np.zeros((1, 2, 11, 1), np.float32), need_weights=True,
                         impl="reference", sinks=sinks, causal=True)
    ref = dense_stats(P, 3, 1, 1)
    np.testing.assert_allclose(got["entropy"], ref["entropy"], atol=1e-5)


def test_python_layer_stats_match_its_dense_weights():
    rng = np.random.default_rng(8)
    w = make_weights(rng, q_dim=16, heads=4, kv_heads=2)
    layer = mha.MultiheadAttention(w["q_proj.weight"], w["k_proj.weight"], w["v_proj.weight"],
                                   w["o_proj.weight"], w["q_proj.bias"], w["k_proj.bias"],
                                   w["v_proj.bias"], w["o_proj.bias"], num_heads=4,
                                   num_kv_heads=2, rope="half")
    x = rng.standard_normal((2, 70, 16)).astype(np.float32)
    kw = dict(causal=True, window=(30, 0), key_padding_mask=rng.random((2, 70)) < 0.9)
    _, P = layer(x, need_weights=True, impl="reference", **kw)
    got = layer.attention_stats(x, stats="received,entropy,topk=5,pool=6x7", **kw)
    check_stats(got, P, 5, 6, 7)
    one = layer.attention_stats(x[1], stats="entropy", causal=True, window=(30, 0),
                                key_padding_mask=kw["key_padding_mask"][1])
    np.testing.assert_array_equal(one["entropy"], got["entropy"][1])


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def run_cli(*args):
    return subprocess.run([CLI, *[str(a) for a in args]], capture_output=True, text=True,
                          timeout=120)


needs_cli = pytest.mark.skipif(not CLI, reason="MHA_CLI (path to the mha program) is not set")

CLI_OPTIONS = {
    "plain": [],
    "causal top-left + sinks": ["--causal", "top-left", "--sinks", "SINKS"],
    "window + alibi + softcap": ["--window", "6,1", "--alibi", "--softcap", "4"],
    "mask + key padding + rope": ["--mask", "MASK", "--key-padding-mask", "KPM",
                                  "--rope-theta", "10000"],
}


@needs_cli
@pytest.mark.parametrize("name", sorted(CLI_OPTIONS))
def test_cli_stats_match_its_dense_probabilities(tmp_path, name):
    rng = np.random.default_rng(3)
    w = make_weights(rng, q_dim=16, heads=4, kv_heads=2)
    write_safetensors(tmp_path / "W.safetensors", w)
    x = rng.standard_normal((2, 40, 16)).astype(np.float32)
    np.save(tmp_path / "X.npy", x)
    np.save(tmp_path / "SINKS.npy", rng.standard_normal(4).astype(np.float32))
    np.save(tmp_path / "MASK.npy", rng.random((40, 40)) < 0.7)
    np.save(tmp_path / "KPM.npy", rng.random((2, 40)) < 0.9)
    extra = [str(tmp_path / f"{a}.npy") if a in ("SINKS", "MASK", "KPM") else a
             for a in CLI_OPTIONS[name]]
    base = ["run", "--weights", tmp_path / "W.safetensors", "--heads", 4, "--input",
            tmp_path / "X.npy", "--out", tmp_path / "Y.npy", *extra]
    r = run_cli(*base, "--impl", "reference", "--attn", tmp_path / "A.npy")
    assert r.returncode == 0, r.stderr
    P = np.load(tmp_path / "A.npy")
    outs = []
    for threads in (1, 2):
        npz = tmp_path / f"S{threads}.npz"
        r = run_cli(*base, "--threads", threads, "--attn-stats", npz,
                    "--stats", "received,entropy,topk=6,pool=7x9")
        assert r.returncode == 0, r.stderr
        assert zipfile.ZipFile(npz).testzip() is None  # every member's CRC-32 checks
        outs.append(dict(np.load(npz)))
    assert sorted(outs[0]) == sorted(["received", "received_total", "entropy", "topk_index",
                                      "topk_prob", "pooled", "pooled_visible"])
    check_stats(outs[0], P, 6, 7, 9)
    for key in outs[0]:
        assert outs[0][key].tobytes() == outs[1][key].tobytes(), key


@needs_cli
def test_cli_stats_default_2d_input_and_errors(tmp_path):
    rng = np.random.default_rng(4)
    write_safetensors(tmp_path / "W.safetensors", make_weights(rng))
    np.save(tmp_path / "X.npy", rng.standard_normal((5, 16)).astype(np.float32))
    base = ["run", "--weights", tmp_path / "W.safetensors", "--heads", 4, "--input",
            tmp_path / "X.npy", "--out", tmp_path / "Y.npy"]
    r = run_cli(*base, "--attn-stats", tmp_path / "S.npz")
    assert r.returncode == 0, r.stderr
    s = np.load(tmp_path / "S.npz")
    assert sorted(s.files) == ["entropy", "received", "received_total"]  # the default list
    assert s["received"].shape == (4, 5) and s["entropy"].shape == (4, 5)  # no batch axis
    np.testing.assert_allclose(s["received_total"].sum(), 4 * 5, rtol=1e-5)  # rows sum to 1
    for bad, why in ((["--stats", "received"], "--stats needs --attn-stats"),
                     (["--attn-stats", tmp_path / "T.npz", "--stats", "bogus"], "unknown"),
                     (["--attn-stats", tmp_path / "T.npz", "--stats", "pool=4"], "RxC"),
                     (["--attn-stats", tmp_path / "T.npz", "--stats", "topk=0"], "topk"),
                     (["--attn-stats", tmp_path / "Y.npy"], "same")):
        r = run_cli(*base, *bad)
        assert r.returncode != 0 and why in r.stderr, (bad, r.stderr)
    assert not (tmp_path / "T.npz").exists()
    # A bare topk / pool after topk=K / pool=RxC keeps them, as in Python (the CLI reset them to
    # 8 and 256x256: k 8 for "topk=3,topk").
    r = run_cli(*base, "--attn-stats", tmp_path / "K.npz", "--stats", "topk=3,topk,pool=2x3,pool")
    assert r.returncode == 0, r.stderr
    s = np.load(tmp_path / "K.npz")
    q = rng.standard_normal((5, 4)).astype(np.float32)
    py = mha.attention_stats(q, q, stats="topk=3,topk,pool=2x3,pool")
    assert s["topk_index"].shape == (4, 5, 3) and py["topk_index"].shape[-1] == 3
    assert s["pooled"].shape == (4, 2, 3) and py["pooled"].shape == (2, 3)
    r = run_cli(*base, "--decode", "--attn-stats", tmp_path / "T.npz")
    assert r.returncode != 0 and "--decode" in r.stderr
