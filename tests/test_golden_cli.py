# SPDX-License-Identifier: MIT
"""test_golden_cli.py: the `mha` program against the PyTorch goldens of tests/golden/.

For every case directory, runs `$MHA_CLI run <cli_args> --out Y.npy [--attn A.npy] --impl IMPL`
with the case directory as working directory (cli_args name files relative to it), for IMPL in
{reference, auto}, and checks
    max|y - ref| <= TOL_OUT_REL * max|ref|      and     max|p - p_ref| <= TOL_PROBS_ABS
with the two constants read from tests/common/tolerance.h (the one place where tolerances live).
Run by ctest with MHA_CLI (the program) and MHA_SOURCE_DIR (the repository root) set; needs only
numpy and pytest. The generator is tools/gen_golden.py; tests/golden/README.md has the layout.
"""

import json
import os
import re
import subprocess

import numpy as np
import pytest

SOURCE_DIR = os.environ.get("MHA_SOURCE_DIR") or os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
GOLDEN_DIR = os.path.join(SOURCE_DIR, "tests", "golden")
CLI = os.environ.get("MHA_CLI")
IMPLS = ("reference", "auto")


def read_tolerances():
    path = os.path.join(SOURCE_DIR, "tests", "common", "tolerance.h")
    with open(path) as fh:
        text = fh.read()
    out = {}
    for name in ("TOL_OUT_REL", "TOL_PROBS_ABS"):
        m = re.search(r"^\s*#\s*define\s+" + name + r"\s+\(?\s*([-+0-9.eE]+)\s*\)?\s*(?:/[*/].*)?$",
                      text, re.M)
        if not m:
            raise RuntimeError(f"{path}: no numeric #define {name}")
        out[name] = float(m.group(1))
    return out["TOL_OUT_REL"], out["TOL_PROBS_ABS"]


TOL_OUT_REL, TOL_PROBS_ABS = read_tolerances()


def load_index():
    with open(os.path.join(GOLDEN_DIR, "index.json")) as fh:
        return json.load(fh)


CASES = load_index()["cases"]

# worst errors seen, per implementation: (value, case)
WORST = {impl: {"out_rel": (0.0, None), "probs_abs": (0.0, None)} for impl in IMPLS}
COUNTS = {impl: 0 for impl in IMPLS}


@pytest.fixture(scope="module", autouse=True)
def summary(request):
    yield
    capman = request.config.pluginmanager.getplugin("capturemanager")
    lines = [f"golden CLI: {len(CASES)} cases, tolerances TOL_OUT_REL={TOL_OUT_REL:g} "
             f"TOL_PROBS_ABS={TOL_PROBS_ABS:g} (tests/common/tolerance.h)"]
    for impl in IMPLS:
        o, p = WORST[impl]["out_rel"], WORST[impl]["probs_abs"]
        lines.append(f"  --impl {impl:9s}: {COUNTS[impl]} cases checked, worst out rel error "
                     f"{o[0]:.3e} ({o[1]}), worst probs abs error {p[0]:.3e} ({p[1]})")
    text = "\n".join(lines)
    if capman is not None:
        with capman.global_and_fixture_disabled():
            print("\n" + text)
    else:
        print("\n" + text)


def test_index_matches_directories():
    dirs = sorted(d for d in os.listdir(GOLDEN_DIR)
                  if os.path.isfile(os.path.join(GOLDEN_DIR, d, "case.json")))
    assert dirs == sorted(CASES), \
        "tests/golden/index.json is out of date: rerun tools/gen_golden.py"
    assert len(CASES) >= 60


def test_tolerances_parsed():
    assert 0 < TOL_OUT_REL < 1e-3 and 0 < TOL_PROBS_ABS < 1e-3


def _note(impl, key, value, name):
    if value > WORST[impl][key][0] or WORST[impl][key][1] is None:
        WORST[impl][key] = (value, name)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", CASES)
def test_golden_case(name, impl, tmp_path):
    if not CLI:
        pytest.skip("MHA_CLI is not set (ctest sets it to the mha program)")
    case_dir = os.path.join(GOLDEN_DIR, name)
    with open(os.path.join(case_dir, "case.json")) as fh:
        meta = json.load(fh)
    y_path = tmp_path / "y.npy"
    a_path = tmp_path / "a.npy"
    cmd = [CLI, "run", *meta["cli_args"], "--out", str(y_path), "--impl", impl]
    if meta.get("expected_probs"):
        cmd += ["--attn", str(a_path)]
    shown = " ".join(cmd)
    proc = subprocess.run(cmd, cwd=case_dir, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"[{name}] exit {proc.returncode}: {proc.stderr.strip()}\n"
                                  f"  (cd {case_dir} && {shown})")

    ref = np.load(os.path.join(case_dir, meta["expected_out"]))
    y = np.load(y_path)
    assert y.dtype == np.float32, f"[{name}] output dtype {y.dtype}, expected float32"
    assert y.shape == ref.shape, f"[{name}] output shape {y.shape}, expected {ref.shape}"
    assert np.all(np.isfinite(y)), f"[{name}] non-finite output"
    scale = float(np.max(np.abs(ref)))
    err = float(np.max(np.abs(y.astype(np.float64) - ref)))
    rel = err / scale if scale > 0 else err
    _note(impl, "out_rel", rel, name)
    assert err <= TOL_OUT_REL * scale, (
        f"[{name}] --impl {impl}: max|y-ref| = {err:.3e} > {TOL_OUT_REL:g} * max|ref| "
        f"({scale:.3e}); rel {rel:.3e}; worst index "
        f"{np.unravel_index(np.argmax(np.abs(y - ref)), ref.shape)}\n  (cd {case_dir} && {shown})")

    if meta.get("expected_probs"):
        pref = np.load(os.path.join(case_dir, meta["expected_probs"]))
        a = np.load(a_path)
        assert a.dtype == np.float32, f"[{name}] probabilities dtype {a.dtype}"
        # A 2-D input [n, d] has no batch axis; its probabilities may come without one.
        ok_shape = a.shape == pref.shape or (pref.shape[0] == 1 and a.shape == pref.shape[1:])
        assert ok_shape, f"[{name}] probabilities shape {a.shape}, expected {pref.shape}"
        a = a.reshape(pref.shape)
        assert np.all(np.isfinite(a)), f"[{name}] non-finite probabilities"
        perr = float(np.max(np.abs(a.astype(np.float64) - pref)))
        _note(impl, "probs_abs", perr, name)
        assert perr <= TOL_PROBS_ABS, (
            f"[{name}] --impl {impl}: max|p-ref| = {perr:.3e} > {TOL_PROBS_ABS:g}; worst index "
            f"{np.unravel_index(np.argmax(np.abs(a - pref)), pref.shape)}\n"
            f"  (cd {case_dir} && {shown})")
    COUNTS[impl] += 1
