# SPDX-License-Identifier: MIT
"""`mha run --dtype bf16|f16`: the layer in half precision from the command line (issue 30 §3).

The weights, X (K, V) and Y are stored in the dtype, the arithmetic is float32; x and the
weights both half make a half module, whose Q, K, V and attention output are rounded to the dtype
too (docs/SEMANTICS.md "Half precision in the layer"). Each output is checked against a float64
numpy reference computed on the SAME rounded inputs and weights, rounding its intermediates at
the same points (ref_mha's act), at the half-precision tolerance of tests/common/tolerance.h:
    max|y - ref| <= ((TOL_HALF_C + TOL_HALF_LAYER_TILE_C) u_s + TOL_OUT_REL) max|ref|
with u_s = 2^-8 (bf16), 2^-11 (f16) (the second term: an intermediate that float32 and float64
round to neighbouring halves, and the bf16 tile kernel's P rounding).
Also: the .npy dtypes written (bf16 as ml_dtypes writes it, '<V2'), inputs of another dtype
rounded once, a bf16 .npy with --dtype f32 widened exactly, bf16 safetensors and a bf16 Hugging
Face checkpoint run (that the loaded layer holds the files' bytes is checked in
test_python_half_loaders.py, which loads libmha into Python: not run under sanitizers), the decode
path and the usage errors. Needs numpy and ml_dtypes (torch and transformers for the HF case).
"""
import json
import os
import subprocess

import numpy as np
import pytest
from tolerances import (TOL_HALF_C, TOL_HALF_LAYER_TILE_C, TOL_HALF_U_BF16, TOL_HALF_U_F16,
                        TOL_OUT_REL, TOL_PROBS_ABS)

from test_cli import make_weights, ref_mha, write_safetensors

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)

CLI = os.environ.get("MHA_CLI")
pytestmark = pytest.mark.skipif(not CLI, reason="MHA_CLI (path to the mha program) is not set")

DT = {"bf16": (BF16, TOL_HALF_U_BF16), "f16": (np.dtype(np.float16), TOL_HALF_U_F16)}


def run_cli(*args):
    return subprocess.run([CLI, *[str(a) for a in args]], capture_output=True, text=True,
                          timeout=120)


def load_out(path, dtype):
    """A .npy written by mha: bf16 comes back as numpy's '|V2' and is viewed as bfloat16."""
    y = np.load(path)
    if dtype == BF16:
        assert y.dtype == np.dtype("V2"), y.dtype
        return y.view(BF16)
    return y


def rounded(a, dtype):
    """a rounded once to `dtype` (nearest even), as float64."""
    return np.asarray(a).astype(dtype).astype(np.float64)


def check_half(y, ref, u, module=False):
    """module: a half module's output (its intermediates rounded; the reference rounds them)."""
    y = np.asarray(y, dtype=np.float64)
    assert y.shape == ref.shape
    err, top = np.max(np.abs(y - ref)), np.max(np.abs(ref))
    tol = (TOL_HALF_C + (TOL_HALF_LAYER_TILE_C if module else 0.0)) * u + TOL_OUT_REL
    assert err <= tol * top, f"max error {err:.3g} = {err / top:.3g} max|ref| > {tol:.3g}"
    return err / top


def act(dt):
    """The rounding of a half module's intermediates, for ref_mha."""
    return lambda a: rounded(a, dt)


@pytest.fixture
def half_case(tmp_path):
    rng = np.random.default_rng(30)
    w = make_weights(rng, q_dim=32, heads=4, kv_heads=2)
    write_safetensors(tmp_path / "W.safetensors", w)
    x = rng.standard_normal((2, 9, 32)).astype(np.float32)
    np.save(tmp_path / "X.npy", x)
    return tmp_path, w, x


@pytest.mark.parametrize("name", ["bf16", "f16"])
def test_run_half_matches_reference(half_case, name):
    d, w, x = half_case
    dt, u = DT[name]
    r = run_cli("run", "--weights", d / "W.safetensors", "--heads", 4, "--input", d / "X.npy",
                "--out", d / "Y.npy", "--attn", d / "A.npy", "--causal", "--dtype", name)
    assert r.returncode == 0, r.stderr
    y = load_out(d / "Y.npy", dt)
    assert y.dtype == dt and y.shape == (2, 9, 32)
    wr = {k: rounded(v, dt) for k, v in w.items()}  # the float32 file rounded once by the loader
    ref, p = ref_mha(rounded(x, dt), wr, 4, kv_heads=2, causal=True, act=act(dt))
    err = check_half(y.astype(np.float64), ref, u, module=True)
    # The probabilities are float32 whatever --dtype (the library's probs), from the same
    # rounded Q and K: float32 accuracy, but for a Q or K element that float32 and float64 round
    # to neighbouring halves (u_s |q_i k_i| in one score: tolerance.h, TOL_HALF_LAYER_TILE_C).
    a = np.load(d / "A.npy")
    assert a.dtype == np.float32 and a.shape == (2, 4, 9, 9)
    assert np.max(np.abs(a - p)) <= TOL_PROBS_ABS + TOL_HALF_LAYER_TILE_C * u
    # The gate can fail: the float32 run's output rounded to the dtype is also within it, but
    # the reference on the UNROUNDED inputs is not (the inputs' rounding is u_s |x| per value).
    ref_unrounded, _ = ref_mha(x, w, 4, kv_heads=2, causal=True)
    assert np.max(np.abs(y.astype(np.float64) - ref_unrounded)) > err * np.max(np.abs(ref))


@pytest.mark.parametrize("name", ["bf16", "f16"])
def test_run_half_with_sinks_and_cross_attention(half_case, name):
    # --sinks (float32 file) rounded once to the weight dtype with the other weights; K given in
    # another dtype than X (each converted once).
    d, w, x = half_case
    dt, u = DT[name]
    sinks = np.array([0.3, -1.1, 2.05, 0.7], np.float32)
    np.save(d / "S.npy", sinks)
    kv = np.random.default_rng(8).standard_normal((2, 6, 32))
    np.save(d / "K.npy", kv)  # float64
    r = run_cli("run", "--weights", d / "W.safetensors", "--heads", 4, "--input", d / "X.npy",
                "--key", d / "K.npy", "--out", d / "Y.npy", "--sinks", d / "S.npy", "--dtype",
                name)
    assert r.returncode == 0, r.stderr
    ref, _ = ref_mha(rounded(x, dt), {k: rounded(v, dt) for k, v in w.items()}, 4,
                     kv=kv.astype(dt).astype(np.float64), kv_heads=2,
                     sinks=rounded(sinks, dt), act=act(dt))
    check_half(load_out(d / "Y.npy", dt).astype(np.float64), ref, u, module=True)


@pytest.mark.parametrize("name", ["bf16", "f16"])
def test_inputs_of_every_float_dtype_are_rounded_once(half_case, name):
    d, w, x = half_case
    dt, _ = DT[name]
    outs = []
    for src in (np.float32, np.float64, np.float16, BF16):
        xs = x.astype(src)
        np.save(d / "Xs.npy", xs)
        r = run_cli("run", "--weights", d / "W.safetensors", "--heads", 4, "--input",
                    d / "Xs.npy", "--out", d / "Y.npy", "--dtype", name)
        assert r.returncode == 0, r.stderr
        # The same run on the input already rounded to the dtype (from the file's values).
        np.save(d / "Xr.npy", xs.astype(np.float64).astype(dt) if src == np.float64
                else xs.astype(np.float32).astype(dt))
        r = run_cli("run", "--weights", d / "W.safetensors", "--heads", 4, "--input",
                    d / "Xr.npy", "--out", d / "Yr.npy", "--dtype", name)
        assert r.returncode == 0, r.stderr
        y, yr = load_out(d / "Y.npy", dt), load_out(d / "Yr.npy", dt)
        assert y.tobytes() == yr.tobytes(), f"{np.dtype(src).name} input"
        outs.append(y)
    assert outs[0].tobytes() == outs[1].tobytes()  # float64 copies of float32 values


@pytest.mark.parametrize("name,bits", [("bf16", 0x3F81), ("f16", 0x3C01)])
def test_float64_input_rounded_once_not_through_float32(tmp_path, name, bits):
    # 1 + half an ulp of the dtype + 2^-30: float32 cannot tell it from the midpoint (a round
    # through float32 ties to even: 1.0); rounded once it is 1 + 1 ulp. The run with that value
    # equals the run with 1 + 1 ulp given in the dtype, and differs from the run with 1.0.
    dt, _ = DT[name]
    rng = np.random.default_rng(5)
    w = make_weights(rng, q_dim=8, heads=2, bias=False)
    write_safetensors(tmp_path / "W.safetensors", w)
    x = rng.standard_normal((3, 8))
    half_ulp = 2.0 ** (-8 if name == "bf16" else -11)
    x[0, 0] = 1.0 + half_ulp + 2.0 ** -30
    np.save(tmp_path / "X.npy", x)
    outs = {}
    for tag, first in (("x64", None), ("up", np.array([bits], np.uint16).view(dt)[0]),
                       ("down", dt.type(1.0))):
        xi = x if first is None else x.astype(dt)
        if first is not None:
            xi[0, 0] = first
        np.save(tmp_path / f"{tag}.npy", xi)
        r = run_cli("run", "--weights", tmp_path / "W.safetensors", "--heads", 2, "--input",
                    tmp_path / f"{tag}.npy", "--out", tmp_path / f"y_{tag}.npy", "--dtype", name)
        assert r.returncode == 0, r.stderr
        outs[tag] = load_out(tmp_path / f"y_{tag}.npy", dt).tobytes()
    assert outs["x64"] == outs["up"] and outs["x64"] != outs["down"]


@pytest.mark.parametrize("name", ["bf16", "f16"])
def test_weights_rounded_once_by_the_loader(half_case, name):
    # --dtype sets the layer's weight_dtype: the float32 file, the same values pre-rounded to the
    # dtype (still float32), and a file in the dtype itself give byte-identical outputs; with
    # --dtype f32 the first two differ (so the equality is not vacuous).
    d, w, x = half_case
    dt, _ = DT[name]
    write_safetensors(d / "Wr.safetensors", {k: v.astype(dt).astype(np.float32)
                                             for k, v in w.items()})
    files = ["W.safetensors", "Wr.safetensors"]
    if name == "f16":  # test_cli's writer knows F16; BF16 files are tested below
        write_safetensors(d / "Wh.safetensors", {k: v.astype(dt) for k, v in w.items()})
        files.append("Wh.safetensors")
    outs = {}
    for dtype in (name, "f32"):
        for f in files:
            out = d / f"Y_{dtype}_{f}.npy"
            r = run_cli("run", "--weights", d / f, "--heads", 4, "--input", d / "X.npy",
                        "--out", out, "--dtype", dtype)
            assert r.returncode == 0, r.stderr
            outs[dtype, f] = open(out, "rb").read()
    assert len({outs[name, f] for f in files}) == 1
    assert outs["f32", "W.safetensors"] != outs["f32", "Wr.safetensors"]


def test_bf16_npy_with_dtype_f32_is_widened_exactly(half_case):
    d, w, x = half_case
    xb = x.astype(BF16)
    np.save(d / "Xb.npy", xb)
    np.save(d / "Xw.npy", xb.astype(np.float32))
    for src, out in (("Xb.npy", "Yb.npy"), ("Xw.npy", "Yw.npy")):
        r = run_cli("run", "--weights", d / "W.safetensors", "--heads", 4, "--input", d / src,
                    "--out", d / out)  # --dtype f32, the default
        assert r.returncode == 0, r.stderr
    yb, yw = np.load(d / "Yb.npy"), np.load(d / "Yw.npy")
    assert yb.dtype == np.float32 and yb.tobytes() == yw.tobytes()


def test_bf16_npy_round_trip(half_case):
    # mha writes bf16 as ml_dtypes does ('<V2'), reads it back, and numpy + ml_dtypes read it.
    d, w, x = half_case
    r = run_cli("run", "--weights", d / "W.safetensors", "--heads", 4, "--input", d / "X.npy",
                "--out", d / "Y.npy", "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    with open(d / "Y.npy", "rb") as f:
        head = f.read(128)
    assert b"'descr': '<V2'" in head
    np.save(d / "ref.npy", np.zeros((1,), BF16))
    with open(d / "ref.npy", "rb") as f:
        assert b"'descr': '<V2'" in f.read(128)  # what ml_dtypes writes: the contract
    y = load_out(d / "Y.npy", BF16)
    np.save(d / "Y2.npy", y)  # numpy + ml_dtypes write it again: byte-identical file
    assert open(d / "Y.npy", "rb").read() == open(d / "Y2.npy", "rb").read()
    # Y as the next input (q_dim = out_dim here): read as it is.
    r = run_cli("run", "--weights", d / "W.safetensors", "--heads", 4, "--input", d / "Y.npy",
                "--out", d / "Z.npy", "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    np.save(d / "Yf.npy", y.astype(np.float32))
    r = run_cli("run", "--weights", d / "W.safetensors", "--heads", 4, "--input", d / "Yf.npy",
                "--out", d / "Zf.npy", "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    assert open(d / "Z.npy", "rb").read() == open(d / "Zf.npy", "rb").read()


def test_plain_void_npy_is_refused(tmp_path, half_case):
    d, _, _ = half_case
    np.save(tmp_path / "V.npy", np.zeros((9, 32), dtype="V2"))  # '|V2': not bfloat16
    r = run_cli("run", "--weights", d / "W.safetensors", "--heads", 4, "--input",
                tmp_path / "V.npy", "--out", tmp_path / "Y.npy", "--dtype", "bf16")
    assert r.returncode == 1 and "unsupported dtype '|V2'" in r.stderr
    assert not os.path.exists(tmp_path / "Y.npy")


def bf16_safetensors(path, rng):
    """A BF16 safetensors file written by safetensors.numpy (q_dim 32, 4 heads); its weights."""
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    w = {k: v.astype(BF16) for k, v in make_weights(rng, q_dim=32, heads=4, bias=False).items()}
    safetensors_numpy.save_file(w, str(path))
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        assert all(e["dtype"] == "BF16" for k, e in json.loads(f.read(n)).items()
                   if k != "__metadata__")
    return w


def test_bf16_safetensors_file(tmp_path):
    # The CLI on a BF16 file, against the reference with those exact weights (that the layer
    # holds the file's bytes is test_python_half_loaders.py's: it loads libmha in Python).
    rng = np.random.default_rng(7)
    p = tmp_path / "Wb.safetensors"
    w = bf16_safetensors(p, rng)
    x = rng.standard_normal((7, 32)).astype(np.float32)
    np.save(tmp_path / "X.npy", x)
    r = run_cli("run", "--weights", p, "--heads", 4, "--input", tmp_path / "X.npy", "--out",
                tmp_path / "Y.npy", "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    ref, _ = ref_mha(rounded(x, BF16)[None], {k: v.astype(np.float64) for k, v in w.items()}, 4,
                     act=act(BF16))
    check_half(load_out(tmp_path / "Y.npy", BF16).astype(np.float64), ref[0], TOL_HALF_U_BF16,
               module=True)


@pytest.mark.parametrize("name", ["bf16", "f16"])
def test_decode_in_half(half_case, name):
    # --decode with --dtype: half weights, float32 activations inside the steps (X rounded to
    # the dtype, widened exactly), Y rounded once: the causal reference on the rounded inputs.
    d, w, x = half_case
    dt, u = DT[name]
    r = run_cli("run", "--weights", d / "W.safetensors", "--heads", 4, "--input", d / "X.npy",
                "--out", d / "Y.npy", "--decode", "--prefill", 3, "--dtype", name)
    assert r.returncode == 0, r.stderr
    y = load_out(d / "Y.npy", dt)
    assert y.dtype == dt
    ref, _ = ref_mha(rounded(x, dt), {k: rounded(v, dt) for k, v in w.items()}, 4, kv_heads=2,
                     causal=True)
    check_half(y.astype(np.float64), ref, u)


def test_attn_stats_in_half_are_float32(half_case):
    d, w, x = half_case
    r = run_cli("run", "--weights", d / "W.safetensors", "--heads", 4, "--input", d / "X.npy",
                "--out", d / "Y.npy", "--attn-stats", d / "S.npz", "--causal", "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    s = np.load(d / "S.npz")
    assert s["entropy"].dtype == np.float32
    # The statistics see Q and K as the bf16 module rounds them (the reference too).
    _, p = ref_mha(rounded(x, BF16), {k: rounded(v, BF16) for k, v in w.items()}, 4,
                   kv_heads=2, causal=True, act=act(BF16))
    ent = -(p * np.log(np.where(p > 0, p, 1.0))).sum(-1)
    assert np.max(np.abs(s["entropy"] - ent)) <= 1e-4 + TOL_HALF_LAYER_TILE_C * TOL_HALF_U_BF16


def test_f16_overflow_of_an_input_is_reported(half_case):
    # 1e5 is finite in the file but beyond float16: inf once converted; the output is then not
    # finite and the run says so (exit 3, nothing written), naming float16.
    d, w, x = half_case
    x = x.copy()
    x[0, 0, 0] = 1e5
    np.save(d / "Xo.npy", x)
    r = run_cli("run", "--weights", d / "W.safetensors", "--heads", 4, "--input", d / "Xo.npy",
                "--out", d / "Y.npy", "--dtype", "f16")
    assert r.returncode == 3, r.stderr
    assert "float16 overflowed" in r.stderr and not os.path.exists(d / "Y.npy")


def test_f16_overflow_of_a_sink_logit_names_the_sinks_file(half_case):
    # A sink logit of 1e5 is finite in the file but inf in float16: the run is refused naming
    # the --sinks file and the head (it named the weights file, "weights.sinks[0] is inf").
    d, w, x = half_case
    np.save(d / "S.npy", np.array([1e5, 0.0, 0.0, 0.0], np.float32))
    r = run_cli("run", "--weights", d / "W.safetensors", "--heads", 4, "--input", d / "X.npy",
                "--out", d / "Y.npy", "--dtype", "f16", "--sinks", d / "S.npy")
    assert r.returncode == 1, r.stderr
    assert len(r.stderr.splitlines()) == 1 and "S.npy: sink logit of head 0" in r.stderr
    assert "float16" in r.stderr and not os.path.exists(d / "Y.npy")


@pytest.mark.parametrize("value", ["bfloat16", "F16", "f64", "", "fp16"])
def test_bad_dtype_is_a_usage_error(half_case, value):
    d, _, _ = half_case
    r = run_cli("run", "--weights", d / "W.safetensors", "--heads", 4, "--input", d / "X.npy",
                "--out", d / "Y.npy", "--dtype", value)
    assert r.returncode == 2
    want = f"--dtype: '{value}' is not f32, bf16 or f16" if value else "--dtype needs a"
    assert want in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not os.path.exists(d / "Y.npy")


def test_dtype_half_with_distributed_is_a_usage_error(half_case):
    d, _, _ = half_case
    r = run_cli("run", "--distributed", "ring", "--weights", d / "W.safetensors", "--heads", 4,
                "--input", d / "X.npy", "--out", d / "Y.npy", "--dtype", "bf16")
    assert r.returncode == 2 and "float32 only" in r.stderr


def test_help_documents_dtype():
    r = run_cli("run", "--help")
    assert r.returncode == 0 and "--dtype T" in r.stdout and "f32, bf16 or f16" in r.stdout


def llama_bf16(d):
    """A tiny Llama (hidden 32, 4 heads, 2 kv heads) saved by transformers in bfloat16
    (torch_dtype=bfloat16, as most checkpoints) in directory d."""
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    torch.manual_seed(3)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = T.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for prm in model.parameters():
            prm.normal_(0.0, 0.2)
    model.to(torch.bfloat16).save_pretrained(d)
    conf = json.load(open(os.path.join(d, "config.json")))
    assert "bfloat16" in (conf.get("torch_dtype"), conf.get("dtype"))


def test_hf_bf16_checkpoint(tmp_path):
    # --dtype bf16 loads a bf16 checkpoint as it is (its bytes: test_python_half_loaders.py); the
    # run equals the float32 run of the same checkpoint (weights widened exactly) on the same
    # bf16 input within the half tolerance, and the f32 run is the float64 transformers oracle's
    # (test_cli_hf_models.py).
    d = tmp_path / "llama_bf16"
    llama_bf16(d)
    x = np.random.default_rng(9).standard_normal((2, 12, 32)).astype(BF16)
    np.save(tmp_path / "X.npy", x)
    ys = {}
    for name in ("bf16", "f32"):
        r = run_cli("run", "--model", d, "--input", tmp_path / "X.npy", "--out",
                    tmp_path / f"Y{name}.npy", "--dtype", name)
        assert r.returncode == 0, r.stderr
        ys[name] = load_out(tmp_path / f"Y{name}.npy", BF16 if name == "bf16" else np.float32)
    assert ys["bf16"].dtype == BF16 and ys["f32"].dtype == np.float32
    check_half(ys["bf16"].astype(np.float64), ys["f32"].astype(np.float64), TOL_HALF_U_BF16)
