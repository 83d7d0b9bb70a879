# SPDX-License-Identifier: MIT
"""Tests of `mha run --decode` and `mha decode-bench` (KV-cache decoding, docs/INFERENCE.md).

`mha run --decode` must write the same output file as the full causal forward (`mha run --causal`)
for every option the full forward accepts with --causal; options that make no sense for decoding
are usage errors (exit 2, one line on stderr, no output file). The numpy float64 formula of
test_cli.py is the independent reference for the cases without RoPE.

Run by ctest with MHA_CLI=<path to mha>; needs numpy only.
"""
import json
import os
import subprocess

import numpy as np
import pytest

from test_cli import make_weights, ref_mha, write_safetensors
from tolerances import TOL_OUT_REL, TOL_KV_BF16_REL, TOL_KV_F16_REL, TOL_FP8_REL

CLI = os.environ.get("MHA_CLI")
pytestmark = pytest.mark.skipif(not CLI, reason="MHA_CLI (path to the mha program) is not set")

# float32 cache: the project's float32 tolerance (tests/common/tolerance.h TOL_OUT_REL).
TOL = TOL_OUT_REL  # tests/common/tolerance.h
# float16 / bfloat16 cache: 8 unit roundoffs of the storage type (TOL_KV_F16_REL / BF16_REL).
# fp8: each K/V value within 2^-4 relative (docs/SEMANTICS.md "fp8 KV cache"); the outputs of
# these small cases stay within a few of that relative to their scale (gate 4x)
TOL_DTYPE = {"f32": TOL, "f16": TOL_KV_F16_REL, "bf16": TOL_KV_BF16_REL, "fp8": 4 * TOL_FP8_REL}


def run_cli(*args, cwd=None):
    return subprocess.run([CLI, *[str(a) for a in args]], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def case(tmp_path):
    rng = np.random.default_rng(1234)
    w = make_weights(rng, q_dim=32, heads=4, kv_heads=2)
    write_safetensors(tmp_path / "w.safetensors", w)
    sinks = rng.standard_normal(4).astype(np.float32)
    np.save(tmp_path / "sinks.npy", sinks)
    x3 = rng.standard_normal((3, 13, 32)).astype(np.float32)
    np.save(tmp_path / "x3.npy", x3)
    np.save(tmp_path / "x2.npy", x3[0])
    return {"dir": tmp_path, "w": w, "x3": x3, "sinks": sinks}


def run(c, *extra, x="x3.npy", out="y.npy"):
    return run_cli("run", "--weights", "w.safetensors", "--heads", 4, "--input", x,
                   "--out", out, *extra, cwd=c["dir"])


OPTION_CASES = [
    ("plain", []),
    ("rope-interleaved", ["--rope-theta", "10000"]),
    ("rope-half-partial", ["--rope-style", "half", "--rope-dim", "4"]),
    ("rope-llama3", ["--rope-style", "half", "--rope-scaling", "llama3",
                     "--rope-original-max", "8"]),
    ("window", ["--window", "3,0"]),
    ("window-right-unbounded", ["--window", "4,-1", "--rope-theta", "500"]),
    ("alibi", ["--alibi"]),
    ("sinks", ["--sinks", "sinks.npy"]),
    ("softcap-scale", ["--softcap", "2.5", "--scale", "0.7"]),
    ("everything", ["--rope-style", "half", "--window", "5,0", "--alibi", "--sinks",
                    "sinks.npy", "--softcap", "3"]),
]


@pytest.mark.parametrize("name,extra", OPTION_CASES, ids=[c[0] for c in OPTION_CASES])
@pytest.mark.parametrize("prefill", [None, 5, 13])
def test_decode_equals_full_causal_forward(case, name, extra, prefill):
    r = run(case, "--causal", *extra, out="full.npy")
    assert r.returncode == 0, r.stderr
    pf = [] if prefill is None else ["--prefill", prefill]
    r = run(case, "--decode", *pf, *extra, out="dec.npy")
    assert r.returncode == 0, r.stderr
    full, dec = np.load(case["dir"] / "full.npy"), np.load(case["dir"] / "dec.npy")
    assert dec.shape == full.shape == (3, 13, 32)
    assert np.abs(dec - full).max() <= TOL * np.abs(full).max()


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "fp8"])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_cache_dtypes_against_numpy(case, dtype, threads):
    """Independent float64 reference (no RoPE): GQA + ALiBi + sinks + window."""
    r = run(case, "--decode", "--prefill", "3", "--cache-dtype", dtype, "--threads", threads,
            "--alibi", "--sinks", "sinks.npy", "--window", "6,0")
    assert r.returncode == 0, r.stderr
    y = np.load(case["dir"] / "y.npy")
    ref, _ = ref_mha(case["x3"], case["w"], 4, kv_heads=2, causal=True, alibi=True,
                     sinks=case["sinks"], window=(6, 0))
    assert np.abs(y - ref).max() <= TOL_DTYPE[dtype] * np.abs(ref).max()


def test_decode_2d_input_and_explicit_causal(case):
    r = run(case, "--decode", "--causal", "bottom-right", x="x2.npy")
    assert r.returncode == 0, r.stderr
    y = np.load(case["dir"] / "y.npy")
    ref, _ = ref_mha(case["x3"][:1], case["w"], 4, kv_heads=2, causal=True)
    assert y.shape == (13, 32)
    assert np.abs(y - ref[0]).max() <= TOL * np.abs(ref).max()


USAGE_ERRORS = [
    (["--decode", "--key", "x3.npy"], "--key cannot be used with --decode"),
    (["--decode", "--mask", "x3.npy"], "--mask cannot be used with --decode"),
    (["--decode", "--key-padding-mask", "x3.npy"], "--key-padding-mask cannot"),
    (["--decode", "--causal", "top-left"], "--causal top-left cannot be used with --decode"),
    (["--decode", "--attn", "a.npy"], "--attn cannot be used with --decode"),
    (["--decode", "--dropout", "0.1"], "--dropout cannot be used with --decode"),
    (["--decode", "--rope-theta", "100", "--positions", "p.npy"], "--positions cannot"),
    (["--decode", "--prefill", "0"], "--prefill: 0 is out of range"),
    (["--decode", "--cache-dtype", "f8"], "--cache-dtype: 'f8' is not f32, f16, bf16, q8_0 or fp8"),
    (["--prefill", "2"], "--prefill needs --decode"),
    (["--cache-dtype", "f16"], "--cache-dtype needs --decode"),
]


@pytest.mark.parametrize("extra,needle", USAGE_ERRORS, ids=[" ".join(e[0]) for e in USAGE_ERRORS])
def test_decode_usage_errors(case, extra, needle):
    r = run(case, *extra)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
    assert not (case["dir"] / "y.npy").exists()
    assert not [f for f in os.listdir(case["dir"]) if f.startswith("y.npy")]


def test_decode_prefill_longer_than_input(case):
    r = run(case, "--decode", "--prefill", "14")
    assert r.returncode == 1
    assert "--prefill 14: larger than the 13 tokens" in r.stderr
    assert not (case["dir"] / "y.npy").exists()


def test_help_lists_decode_flags():
    r = run_cli("run", "--help")
    assert r.returncode == 0
    for flag in ("--decode", "--prefill P", "--cache-dtype T"):
        assert flag in r.stdout
    r = run_cli("--help")
    assert "decode-bench" in r.stdout


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0", "fp8"])
def test_decode_bench_runs(dtype):
    r = run_cli("decode-bench", "--heads", 4, "--kv-heads", 2, "--head-dim", 32,
                "--cache-len", 300, "--steps", 3, "--threads", 2, "--cache-dtype", dtype,
                "--naive", "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["cache_dtype"] == dtype and rec["attn_tokens_per_s"] > 0
    assert rec["layer_tokens_per_s"] > 0 and rec["naive_s"] > 0
    bytes_per = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32, "fp8": 1}[dtype]
    assert rec["kv_bytes_per_step"] == pytest.approx(2 * 301 * 2 * 32 * bytes_per, rel=0.01)
    r = run_cli("decode-bench", "--steps", 2, "--cache-len", 64, "--heads", 2, "--kv-heads", 1,
                "--head-dim", 16)
    assert r.returncode == 0 and "tokens/s" in r.stdout, r.stderr


@pytest.mark.parametrize("wdt,bytes_per", [("bf16", 2.0), ("q8_0", 34 / 32)])
def test_decode_bench_weight_dtype(wdt, bytes_per):
    # The layer's weights in --weight-dtype: weight_bytes counts the four matrices in it (q8_0:
    # 34 bytes per 32 weights, docs/SEMANTICS.md "q8_0 weights").
    r = run_cli("decode-bench", "--heads", 4, "--kv-heads", 2, "--head-dim", 32,
                "--cache-len", 40, "--steps", 3, "--weight-dtype", wdt, "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["weight_dtype"] == wdt and rec["layer_tokens_per_s"] > 0
    q = 4 * 32
    assert rec["weight_bytes"] == pytest.approx((2 * q * q + 2 * 64 * q) * bytes_per)


# Blocks of the measured sequence (100 + 2 x 3 + 16 slots = 8 blocks of 16; 7 filled) and
# its runs of consecutive blocks per --paged-order (docs/INFERENCE.md "Block placement"): alone
# or in lockstep with the pool's placement one run; the old stack's lockstep layout and a pool
# with every other block free one run per block.
@pytest.mark.parametrize("order,runs", [("lockstep", 1), ("ordered", 1), ("interleaved", 7),
                                        ("alternate", 7), ("fragmented", None)])
def test_decode_bench_paged(order, runs):
    # --paged: the same K/V in a paged cache of blocks of 16 laid out as --paged-order says
    # (docs/INFERENCE.md "Paged vs contiguous, measured"), timed with the contiguous one.
    r = run_cli("decode-bench", "--heads", 4, "--kv-heads", 2, "--head-dim", 32,
                "--cache-len", 100, "--steps", 3, "--attention-only", "--paged", 16,
                "--paged-order", order, "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["paged_block"] == 16 and rec["paged_order"] == order
    assert rec["paged_median_s"] > 0
    assert rec["paged_blocks"] == 7
    assert rec["paged_peers"] == (7 if order in ("lockstep", "interleaved") else 0)
    if runs is not None:
        assert rec["paged_runs"] == runs
    else:
        assert 1 <= rec["paged_runs"] <= 7


@pytest.mark.parametrize("order", ["rows", "interleaved", "auto"])
def test_decode_bench_q8_order(order):
    # --q8-order: a q8_0 cache in ggml's rows or the key-interleaved order (docs/SEMANTICS.md
    # "Storage order"), paged too; the kernel the run names reads that order (the rows one is never
    # the interleaved order's kernel; the interleaved order runs the VNNI kernel or the generic one)
    r = run_cli("decode-bench", "--heads", 4, "--kv-heads", 2, "--head-dim", 32, "--cache-len", 100,
                "--steps", 3, "--attention-only", "--cache-dtype", "q8_0", "--q8-order", order,
                "--paged", 32, "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["paged_median_s"] > 0 and rec["attn_median_s"] > 0
    if order == "rows":
        assert "q8x16" not in rec["kernel"], rec["kernel"]
    elif order == "interleaved":
        assert rec["kernel"] in ("mha_decode_q8x16_splitkv__avx512",
                                 "mha_decode_f32acc_splitkv__generic"), rec["kernel"]


def test_decode_bench_paged_compact():
    # --compact: the alternate pool's 7 runs (one per block) become one before the steps; the
    # 3 steps stay in the last block
    r = run_cli("decode-bench", "--heads", 4, "--kv-heads", 2, "--head-dim", 32,
                "--cache-len", 100, "--steps", 3, "--attention-only", "--paged", 16,
                "--paged-order", "alternate", "--compact", "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["paged_runs_before_compact"] == 7 and rec["paged_runs"] == 1
    assert rec["compact_s"] > 0 and rec["paged_blocks"] == 7


def test_decode_bench_cold_and_tree_json():
    # --cold MB: a buffer read before every timed call (docs/INFERENCE.md "Cold caches"), reported
    # as cold_mb; --draft-tree's times are in the JSON line too (tree and one-token step).
    r = run_cli("decode-bench", "--heads", 4, "--kv-heads", 2, "--head-dim", 32,
                "--cache-len", 100, "--steps", 3, "--attention-only", "--cold", 4,
                "--draft-tree", "-1,0,0", "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["cold_mb"] == 4 and rec["attn_median_s"] > 0
    assert rec["tree_median_s"] > 0 and rec["tree_one_median_s"] > 0
    # GFLOP/s over the tree call's arithmetic: 4 heads x 3 drafts, each against every key of the
    # call, 2 (d_k + d_v) FLOPs per key; the keys: 100 cached + 3 steps + (0, 1, 2) one-token steps
    # of the earlier pairs + 3 drafts, 107 on average (to %.6g's rounding)
    flops = 2.0 * 4 * 3 * 107 * (32 + 32)
    assert abs(rec["tree_gflops"] * rec["tree_median_s"] * 1e9 - flops) < 1e-4 * flops, rec
    r = run_cli("decode-bench", "--heads", 4, "--kv-heads", 2, "--head-dim", 32,
                "--cache-len", 40, "--steps", 2, "--cold", 2, "--weight-dtype", "bf16")
    assert r.returncode == 0 and "--cold: 2 MB read before every timed call" in r.stdout, r.stderr
    rec = json.loads(run_cli("decode-bench", "--steps", 2, "--cache-len", 40, "--heads", 2,
                             "--kv-heads", 1, "--head-dim", 16, "--json").stdout)
    assert rec["cold_mb"] == 0 and rec["tree_median_s"] == 0


def test_decode_bench_layer_prefill():
    # The cache filled by the layer's own prefill, in calls of up to 256 positions: q_dim 512 (more
    # than one call's positions) and 300 positions (a full call and a partial one), 2 sequences.
    # The input buffer once held only 2 q_dim rows when q_dim > 256, and this run crashed. Also the
    # read-bandwidth probe (--stream, 8 MB).
    r = run_cli("decode-bench", "--prefill-mode", "layer", "--q-dim", 512, "--heads", 8,
                "--kv-heads", 2, "--head-dim", 64, "--cache-len", 300, "--batch", 2,
                "--steps", 2, "--stream", 8, "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["batch"] == 2 and rec["cache_len"] == 300 and rec["prefill_s"] > 0
    assert rec["layer_tokens_per_s"] > 0 and rec["stream_gbs"] > 0
    r = run_cli("decode-bench", "--prefill-mode", "layer", "--attention-only")
    assert r.returncode == 2 and "needs the layer" in r.stderr, r.stderr


@pytest.mark.skipif(bool(os.environ.get("MHA_TEST_QUICK")),
                    reason="sanitizer runs: an address-space limit breaks the sanitizer itself")
def test_decode_bench_stream_buffer_not_allocated_is_an_error():
    # --stream MB whose buffer cannot be allocated (address space limited to 2 GiB here): one
    # line naming --stream and exit 1. Before, the measurement was skipped and the report said
    # nothing ("stream_gbs": 0 in the JSON line) with exit 0.
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    r = subprocess.run([CLI, "decode-bench", "--stream", "4096", "--heads", "2", "--kv-heads",
                        "1", "--head-dim", "8", "--cache-len", "8", "--steps", "1", "--warmup",
                        "0", "--json"], capture_output=True, text=True, timeout=300,
                       preexec_fn=limit)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stderr == "mha: cannot allocate --stream 4096 MB\n" and r.stdout == ""


@pytest.mark.parametrize("args,needle", [
    (["--heads", "6", "--kv-heads", "4"], "--kv-heads 4 does not divide --heads 6"),
    (["--cache-dtype", "int8"], "--cache-dtype: 'int8'"),
    (["--weight-dtype", "q5_0"], "--weight-dtype: 'q5_0' is not f32, f16, bf16, q8_0 or q4_0"),
    (["--weight-dtype", "q8_0", "--q-dim", "48"], "--weight-dtype q8_0 needs"),
    (["--bogus"], "unknown option '--bogus'"),
    (["--cold", "-1"], "--cold: -1 is out of range"),
    (["--attention-only", "--batch-lengths", "logu:1:10:5xyz"],  # was read as seed 5, exit 0
     "--batch-lengths: 'logu:1:10:5xyz' is not logu:LO:HI:SEED"),
    (["--steps", "0"], "--steps: 0 is out of range"),
    (["--paged-order", "ordered"], "--paged-order needs --paged"),
    (["--paged", "16", "--paged-order", "random"], "--paged-order: 'random' is not lockstep"),
    (["--paged-peers", "3"], "--paged-peers needs --paged"),
    (["--compact"], "--compact needs --paged"),
    (["--paged", "16", "--attention-only", "--batch-lengths", "64,128"],
     "--paged cannot be combined with --batch-lengths"),
    (["--paged", "16", "--prefill-mode", "layer"], "--paged cannot be combined with --prefill-mode"),
    (["--paged", "16", "--paged-peers", "65"], "--paged-peers"),
    (["--q8-order", "rows"], "--q8-order needs --cache-dtype q8_0"),
    (["--cache-dtype", "q8_0", "--q8-order", "ggml"], "--q8-order: 'ggml' is not auto"),
])
def test_decode_bench_usage_errors(args, needle):
    r = run_cli("decode-bench", *args)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
