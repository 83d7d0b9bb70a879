# SPDX-License-Identifier: MIT
"""`mha run` on every file of the hostile set (tests/data/hostile/expected.json): a bad .npy as
--input (with valid weights) or a bad safetensors file as --weights (with a valid input) must exit
with status 1, print exactly one line on stderr that names the file, and leave no output (and no
temporary) file behind. Files the readers accept (NaN/Inf activations, by the NaN policy) must run.

Run by ctest with MHA_CLI=<path to mha> and MHA_SOURCE_DIR; standard library + pytest only.
"""
import json
import os
import subprocess

import pytest

CLI = os.environ.get("MHA_CLI")
SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
HOSTILE = os.path.join(SRC, "tests", "data", "hostile")
pytestmark = pytest.mark.skipif(not CLI, reason="MHA_CLI (path to the mha program) is not set")

with open(os.path.join(HOSTILE, "expected.json")) as f:
    CASES = json.load(f)["cases"]


def run_cli(case, out_dir):
    path = os.path.join(HOSTILE, case["file"])
    weights = os.path.join(HOSTILE, "valid_weights.safetensors")
    x = os.path.join(HOSTILE, "valid_input.npy")
    if case["kind"] == "npy":
        x = path
    else:
        weights = path
    out = os.path.join(out_dir, "y.npy")
    proc = subprocess.run([CLI, "run", "--weights", weights, "--heads", "2", "--input", x,
                           "--out", out, "--attn", os.path.join(out_dir, "a.npy")],
                          capture_output=True, timeout=60)
    return proc, path, out


@pytest.mark.parametrize("case", [c for c in CASES if c["status"] != "OK"],
                         ids=lambda c: c["file"])
def test_bad_file(case, tmp_path):
    proc, path, _ = run_cli(case, str(tmp_path))
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 1, "exit %d, stderr %r" % (proc.returncode, err)
    lines = err.splitlines()
    assert len(lines) == 1, "stderr is not one line: %r" % err
    assert path in lines[0], "the message does not name %s: %r" % (path, lines[0])
    assert case["message"] in lines[0], "%r lacks %r" % (lines[0], case["message"])
    assert proc.stdout == b""
    assert os.listdir(str(tmp_path)) == [], "files left behind: %s" % os.listdir(str(tmp_path))


@pytest.mark.parametrize("case", [c for c in CASES if c["status"] == "OK"],
                         ids=lambda c: c["file"])
def test_accepted_file(case, tmp_path):
    proc, _, out = run_cli(case, str(tmp_path))
    assert proc.returncode == 0, proc.stderr.decode("utf-8", "replace")
    assert os.path.exists(out)


def test_case_list_is_complete():
    listed = {c["file"] for c in CASES}
    on_disk = {f for f in os.listdir(HOSTILE) if f.endswith((".npy", ".safetensors"))}
    assert on_disk - listed == {"valid_weights.safetensors", "valid_input.npy"}
    assert len(CASES) >= 50
