# SPDX-License-Identifier: MIT
"""Nothing lost (issue 13, 5b): every output path of `mha run` is checked before any work.

An output may not be an input (same device and inode: the same name, another spelling, a hard
link) nor another output; an existing output that is not a regular file (symlink, FIFO, device,
directory) is refused and left as it was; the output's directory must exist and be writable; the
plot's type and its --tokens file are checked before the forward. Each case: exit status 1 (2 for usage
errors), one stderr line naming the file, every file in the directory byte-identical, and (for the
checks that come before the work) no time spent on the work: a forward that takes seconds with
--impl reference is refused in well under that.

--verbose reports the stages on stderr. Run by ctest with MHA_CLI=<path to mha>.
"""
import os
import stat
import time

import numpy as np
import pytest
from test_cli import make_weights, run_cli, write_safetensors

CLI = os.environ.get("MHA_CLI")
pytestmark = pytest.mark.skipif(not CLI, reason="MHA_CLI (path to the mha program) is not set")


class Case:
    pass


@pytest.fixture
def case(tmp_path):
    """W.safetensors (q_dim 16, 4 heads) and X.npy [2, 5, 16] in tmp_path."""
    rng = np.random.default_rng(5)
    write_safetensors(tmp_path / "W.safetensors", make_weights(rng))
    np.save(tmp_path / "X.npy", rng.standard_normal((2, 5, 16)).astype(np.float32))
    c = Case()
    c.dir = tmp_path
    c.W, c.X, c.Y = (str(tmp_path / n) for n in ("W.safetensors", "X.npy", "Y.npy"))
    c.base = ["run", "--weights", c.W, "--heads", 4, "--input", c.X]
    return c


def snapshot(d):
    """Every entry of d: name -> (kind, bytes of a regular file)."""
    out = {}
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        st = os.lstat(p)
        content = open(p, "rb").read() if stat.S_ISREG(st.st_mode) else None
        out[name] = (stat.S_IFMT(st.st_mode), content)
    return out


def refused(case, args, needle, status=1):
    before = snapshot(case.dir)
    r = run_cli(*args)
    assert r.returncode == status, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mha: ") and needle in lines[0], r.stderr
    assert snapshot(case.dir) == before, "a file changed"
    return lines[0]


def test_out_is_the_input(case):
    line = refused(case, case.base + ["--out", case.X], "X.npy")
    assert "--input" in line


def test_out_is_the_input_spelled_differently(case):
    other = os.path.join(str(case.dir), ".", "X.npy")
    refused(case, case.base + ["--out", other], "--input")


def test_out_is_a_hard_link_to_the_input(case):
    os.link(case.X, case.dir / "HL.npy")
    refused(case, case.base + ["--out", case.dir / "HL.npy"], "--input")


def test_out_is_the_weights(case):
    refused(case, case.base + ["--out", case.W], "--weights")


def test_attn_is_the_input(case):
    refused(case, case.base + ["--out", case.Y, "--attn", case.X], "--input")


def test_out_is_a_symlink(case):
    os.symlink(case.dir / "target.npy", case.dir / "L.npy")
    line = refused(case, case.base + ["--out", case.dir / "L.npy"], "L.npy")
    assert "symbolic link" in line
    assert not os.path.exists(case.dir / "target.npy")


def test_out_is_a_fifo(case):
    os.mkfifo(case.dir / "F.npy")
    line = refused(case, case.base + ["--out", case.dir / "F.npy"], "F.npy")
    assert "not a regular file" in line


def test_out_is_a_directory(case):
    os.mkdir(case.dir / "D.npy")
    refused(case, case.base + ["--out", case.dir / "D.npy"], "directory")


def test_out_is_dev_null():
    """A device node is never replaced: checked on /dev/null (nothing is written to it)."""
    st = os.stat("/dev/null")
    r = run_cli("run", "--weights", "/nonexistent.safetensors", "--heads", 4, "--input",
                "/nonexistent.npy", "--out", "/dev/null")
    assert r.returncode == 1 and "/dev/null" in r.stderr and "not a regular file" in r.stderr
    assert os.stat("/dev/null").st_rdev == st.st_rdev
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_out_in_missing_directory(case):
    refused(case, case.base + ["--out", case.dir / "nodir" / "Y.npy"], "does not exist")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only directory, so "
                    "the check cannot be observed as root")
def test_out_in_read_only_directory(case):
    ro = case.dir / "ro"
    os.mkdir(ro)
    os.chmod(ro, 0o555)
    try:
        refused(case, case.base + ["--out", ro / "Y.npy"], "not writable")
    finally:
        os.chmod(ro, 0o755)


def test_two_outputs_same_file(case):
    other = os.path.join(str(case.dir), ".", "Y.npy")
    refused(case, case.base + ["--out", case.Y, "--attn", other], "name the same file")


def test_plot_bad_type(case):
    refused(case, case.base + ["--out", case.Y, "--plot", case.dir / "p.jpg"], "p.jpg", status=2)


def test_checks_come_before_the_work(tmp_path):
    """A forward of seconds (--impl reference, n = 2048) is refused at once for a bad output,
    and for a --tokens file that does not match the plot (3 lines for n queries), before the
    forward runs. Under valgrind (tools/test.sh) n = 512: the forward of 2048 took 117-119 s
    there (Intel Xeon host, session 42), a third of the valgrind step; 512 is 1/16 of its work
    and still many times a refusal's time."""
    n = 512 if os.environ.get("MHA_VALGRIND_CLI") else 2048
    rng = np.random.default_rng(6)
    write_safetensors(tmp_path / "W.safetensors", make_weights(rng, q_dim=64, heads=4))
    np.save(tmp_path / "X.npy", rng.standard_normal((1, n, 64)).astype(np.float32))
    (tmp_path / "tok.txt").write_text("a\nb\nc\n")
    base = ["run", "--weights", tmp_path / "W.safetensors", "--heads", 4, "--input",
            tmp_path / "X.npy", "--impl", "reference"]
    t0 = time.monotonic()
    r = run_cli(*base, "--out", tmp_path / "Y.npy")
    work = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    os.remove(tmp_path / "Y.npy")
    for extra, needle in (((tmp_path / "nodir" / "Y.npy",), "nodir"),
                          ((tmp_path / "Y.npy", "--plot", tmp_path / "p.png", "--tokens",
                            tmp_path / "tok.txt"), "3 tokens (lines)")):
        t0 = time.monotonic()
        r = run_cli(*base, "--out", *extra)
        spent = time.monotonic() - t0
        assert r.returncode == 1 and needle in r.stderr, r.stderr
        assert spent < 0.5 * work, (spent, work)
        assert not os.path.exists(tmp_path / "Y.npy")


def test_verbose_reports_stages(case):
    r = run_cli(*case.base, "--out", case.Y, "--verbose")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "mha: weights read", "mha: layer built, inputs read",
        "mha: masks and positions read, outputs allocated", "mha: forward computed",
        "mha: outputs written"], lines
    assert all(line.endswith(" s)") for line in lines)
    r = run_cli(*case.base, "--out", case.Y)
    assert r.returncode == 0 and r.stderr == ""


# Nothing silent (issue 28): a non-finite output of finite inputs is an error (exit 3), and the
# scalars of the command line are checked in float32.

def huge_case(case, scale=3e38):
    """The case's weights all multiplied up to about `scale`: finite, but the projections (and so
    the scores) overflow float32."""
    rng = np.random.default_rng(5)
    t = make_weights(rng)
    t = {k: (np.sign(v) * scale).astype(np.float32) for k, v in t.items()}
    write_safetensors(case.dir / "H.safetensors", t)
    return ["run", "--weights", case.dir / "H.safetensors", "--heads", 4, "--input", case.X]


def test_nonfinite_output_of_finite_inputs_is_refused(case):
    base = huge_case(case)
    line = refused(case, base + ["--out", case.Y], "--out", status=3)
    assert "Y.npy" in line and "not finite" in line and "of 160 values" in line, line
    assert "first at [0, 0, 0]" in line and "--allow-nonfinite" in line, line
    # The same with --attn: neither file is written.
    refused(case, base + ["--out", case.Y, "--attn", case.dir / "A.npy"], "not finite", status=3)
    # --attn-stats members are checked before anything is written.
    refused(case, base + ["--out", case.Y, "--attn-stats", case.dir / "S.npz"], "not finite",
            status=3)
    # --decode writes through the same check.
    refused(case, base + ["--out", case.Y, "--decode"], "not finite", status=3)


def test_allow_nonfinite_writes_them(case):
    r = run_cli(*huge_case(case), "--out", case.Y, "--allow-nonfinite")
    assert r.returncode == 0 and r.stderr == "", (r.returncode, r.stderr)
    y = np.load(case.Y)
    assert y.shape == (2, 5, 16) and not np.isfinite(y).any()


def test_nonfinite_inputs_propagate_without_report(case):
    x = np.load(case.X)
    x[1, 2, 3] = np.nan
    np.save(case.dir / "XN.npy", x)
    r = run_cli("run", "--weights", case.W, "--heads", 4, "--input", case.dir / "XN.npy",
                "--out", case.Y)
    assert r.returncode == 0 and r.stderr == "", (r.returncode, r.stderr)
    y = np.load(case.Y)
    assert np.isnan(y[1]).any() and np.isfinite(y[0]).all()
    # -inf in an additive mask blocks a key: a finite outcome, and the check stays on.
    mask = np.zeros((5, 5), np.float32)
    mask[:, 0] = -np.inf
    np.save(case.dir / "M.npy", mask)
    base = huge_case(case)
    refused(case, base + ["--out", case.Y, "--mask", case.dir / "M.npy"], "not finite", status=3)


def test_float64_input_beyond_float32_is_reported(case):
    """A float64 value of 1e39 is finite in the file and inf in float32: the output's NaN is the
    float32 computation's, so it is reported."""
    x = np.load(case.X).astype(np.float64)
    x[0, 0, 0] = 1e39
    np.save(case.dir / "X64.npy", x)
    refused(case, ["run", "--weights", case.W, "--heads", 4, "--input", case.dir / "X64.npy",
                   "--out", case.Y], "not finite", status=3)


@pytest.mark.parametrize("flag,value", [("--softcap", "4e38"), ("--scale", "1e39"),
                                        ("--scale", "1e-300"), ("--softcap", "1e-300"),
                                        ("--scale", "3.5e38")])
def test_scalars_checked_in_float32(case, flag, value):
    line = refused(case, case.base + ["--out", case.Y, flag, value], flag, status=2)
    assert value in line, line


def test_scalar_limits_accepted(case):
    r = run_cli(*case.base, "--out", case.Y, "--scale", "3.4e38", "--allow-nonfinite")
    assert r.returncode == 0, r.stderr
    r = run_cli(*case.base, "--out", case.Y, "--softcap", "3.4e38")
    assert r.returncode == 0 and np.isfinite(np.load(case.Y)).all(), r.stderr


def test_help_says_float32_and_exit_3():
    r = run_cli("run", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "Everything is computed in float32" in text and "1e-7" in text, text
    assert "--allow-nonfinite" in text and "3 an output holds NaN or inf" in text


def gemma2_dir(d, **fields):
    """A one-layer gemma2 model directory (hidden 16, 4 heads, 2 kv heads) with config fields
    replaced by `fields`."""
    import json
    d.mkdir()
    cfg = {"model_type": "gemma2", "hidden_size": 16, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 4, "num_hidden_layers": 1,
           "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0, "rope_theta": 10000.0,
           "sliding_window": 8, "max_position_embeddings": 64}
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    p = "model.layers.0.self_attn."
    shapes = {"q_proj": (16, 16), "k_proj": (8, 16), "v_proj": (8, 16), "o_proj": (16, 16)}
    write_safetensors(d / "model.safetensors",
                      {p + k + ".weight": rng.standard_normal(s).astype(np.float32)
                       for k, s in shapes.items()})
    return d


@pytest.mark.parametrize("field,value,needle", [("attn_logit_softcapping", 4e38, "softcap"),
                                                ("query_pre_attn_scalar", 1e-300, "scal")])
def test_model_config_scalars_beyond_float32(case, field, value, needle):
    """From config.json: a soft-cap of 4e38 (inf in float32) or query_pre_attn_scalar 1e-300
    (scale 1e150) gave an all-NaN Y with exit 0; the layer's own check refuses them (the loader
    may already), exit 1 naming the field."""
    d = gemma2_dir(case.dir / "g2", **{field: value})
    r = run_cli("run", "--model", d, "--layer", 0, "--input", case.X, "--out", case.Y)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert needle in r.stderr and not os.path.exists(case.Y), r.stderr
    ok = gemma2_dir(case.dir / "g2ok")
    r = run_cli("run", "--model", ok, "--layer", 0, "--input", case.X, "--out", case.Y)
    assert r.returncode == 0 and np.isfinite(np.load(case.Y)).all(), r.stderr


def _has_cairo():
    return "--plot" not in run_cli("run", "--weights", "w", "--heads", 1, "--input", "x",
                                   "--out", "y.npy", "--plot", "p.png").stderr


@pytest.mark.parametrize("flag,name", [("--out", "Y.npy"), ("--attn-stats", "S.npz"),
                                       ("--plot", "P.png")])
def test_never_writes_through_a_link_at_the_temporary_name(case, flag, name):
    """Outputs are written to <path>.tmp.<pid>, then renamed. A symbolic link planted at that
    name (the pid is easy to guess in a shared directory) is never written through: the run
    fails (exit 1, naming the temporary), the link's target is left as it was and no output
    appears. Before, fopen followed the link (the target truncated and overwritten with the
    output) and the rename made the output itself a link to it."""
    if flag == "--plot" and not _has_cairo():
        pytest.skip("built without cairo")
    victim = case.dir / "victim.txt"
    victim.write_bytes(b"kept")
    out = str(case.dir / name)
    args = [CLI, *map(str, case.base), flag, out] + ([] if flag == "--out" else ["--out", case.Y])
    err = case.dir / "stderr.txt"
    pid = os.fork()
    if pid == 0:  # the child plants the link at its own pid's name, then becomes mha
        try:
            os.symlink(victim, f"{out}.tmp.{os.getpid()}")
            fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 2)
            os.execv(CLI, args)
        finally:
            os._exit(127)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 1, (status, err.read_text())
    lines = err.read_text().splitlines()
    assert len(lines) == 1 and f"cannot create '{out}.tmp.{pid}'" in lines[0], lines
    assert victim.read_bytes() == b"kept"
    assert not os.path.lexists(out)
    assert os.path.islink(f"{out}.tmp.{pid}")  # not ours: left as it was
