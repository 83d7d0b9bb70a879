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


# Every input the CLI reads is opened without blocking and refused unless it is a regular file
# (issue 28: a FIFO without a writer blocked the open forever). Each case puts a FIFO (or a
# device) where one input goes; the subprocess timeout turns a hang into a failure.
FIFO_ARGS = {
    "input": ["--input", "{F}"],
    "weights": ["--weights", "{F}"],
    "mask": ["--mask", "{F}"],
    "key_padding_mask": ["--key-padding-mask", "{F}"],
    "tokens": ["--plot", "{D}/p.png", "--tokens", "{F}"],
}


def _run_args(args, tmp_path):
    weights = os.path.join(HOSTILE, "valid_weights.safetensors")
    x = os.path.join(HOSTILE, "valid_input.npy")
    base = {"--weights": weights, "--input": x}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    cmd = [CLI, "run", "--heads", "2", "--out", str(tmp_path / "out" / "y.npy")]
    for k, v in base.items():
        cmd += [k, v]
    return cmd


@pytest.mark.parametrize("kind", sorted(FIFO_ARGS))
@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_special_file_input_is_refused(kind, special, tmp_path):
    (tmp_path / "out").mkdir()
    if special == "fifo":
        f = str(tmp_path / "in.fifo")
        os.mkfifo(f)
        want = "not a regular file (a FIFO)"
    else:
        f = special
        want = "not a regular file (a device or socket)"
    args = [a.format(F=f, D=str(tmp_path / "out")) for a in FIFO_ARGS[kind]]
    proc = subprocess.run(_run_args(args, tmp_path), capture_output=True, timeout=30)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 1, "exit %d, stderr %r" % (proc.returncode, err)
    assert len(err.splitlines()) == 1 and f in err and want in err, err
    assert os.listdir(str(tmp_path / "out")) == [], os.listdir(str(tmp_path / "out"))


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json",
                                  "model.safetensors"])
def test_special_file_in_model_directory_is_refused(name, tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    if name != "config.json":
        (d / "config.json").write_text(json.dumps(
            {"model_type": "gpt2", "n_embd": 8, "n_head": 2, "n_layer": 1}))
    os.mkfifo(str(d / name))
    for cmd in (["info", "--model", str(d)],
                ["run", "--model", str(d), "--input", os.path.join(HOSTILE, "valid_input.npy"),
                 "--out", str(tmp_path / "y.npy")]):
        proc = subprocess.run([CLI] + cmd, capture_output=True, timeout=30)
        err = proc.stderr.decode("utf-8", "replace")
        assert proc.returncode == 1, "exit %d, stderr %r" % (proc.returncode, err)
        assert name + ": not a regular file (a FIFO)" in err, err
    assert not (tmp_path / "y.npy").exists()


# One JSON policy (issue 28): cJSON took the first of duplicate keys (Python's json, and so
# transformers, the last) and cut strings at a NUL; both are refused naming the key.
GPT2_CONFIG = '"model_type": "gpt2", "n_embd": 8, "n_head": 2, "n_layer": 1'
JSON_CASES = {
    "duplicate": ('{%s, "n_head": 4}' % GPT2_CONFIG, 'duplicate key "n_head"'),
    "nested_duplicate": ('{%s, "rope_scaling": {"type": "linear", "type": "yarn"}}' % GPT2_CONFIG,
                         'duplicate key "type" (in "rope_scaling")'),
    "nul_key": ('{%s, "n_head\\u0000x": 4}' % GPT2_CONFIG, 'key "n_head\\u0000x" contains a NUL'),
    "nul_value": ('{"model_type": "gpt2\\u0000evil", "n_embd": 8, "n_head": 2, "n_layer": 1}',
                  'the value of "model_type" contains a NUL'),
}


@pytest.mark.parametrize("case", sorted(JSON_CASES))
def test_config_json_policy(case, tmp_path):
    text, want = JSON_CASES[case]
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(text)
    proc = subprocess.run([CLI, "info", "--model", str(d)], capture_output=True, timeout=30)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 1 and len(err.splitlines()) == 1, err
    assert "config.json" in err and want in err, err
