# SPDX-License-Identifier: MIT
"""`mpirun -np P mha run --distributed ring` (cli/cli_run_dist.c) against the single-process
`mha run` on the same files: the output file must equal it within the layer's tolerance
(TOL_OUT_REL * max|y|) for causal and not, RoPE, GQA, windows, segment ids with sinks, key
padding, both shard layouts, uneven sequence lengths, and the per-rank shard-file mode ({rank} in
the names); errors on the ranks (a missing or wrong file on one rank, an option that cannot run
distributed) end every rank with a non-zero status and a line naming the problem, within a timeout
(no rank hangs), and leave no output file.

Run by ctest with MHA_CLI=<mha> and, when libmha_mpi is built, MHA_MPIEXEC (the launcher) and
MHA_MPIEXEC_FLAGS (space-separated: --allow-run-as-root --oversubscribe for Open MPI). Without
MPI only the "built without MPI" error is checked. MHA_TEST_QUICK=1 (the sanitizer runs) keeps
one case of each kind.
"""
import os
import subprocess

import numpy as np
import pytest
from test_cli import make_weights, write_safetensors
from tolerances import TOL_OUT_REL

CLI = os.environ.get("MHA_CLI")
MPIEXEC = os.environ.get("MHA_MPIEXEC")
MPIFLAGS = os.environ.get("MHA_MPIEXEC_FLAGS", "").split()
pytestmark = pytest.mark.skipif(not CLI, reason="MHA_CLI (path to the mha program) is not set")
needs_mpi = pytest.mark.skipif(not MPIEXEC, reason="mha built without MPI (MHA_MPIEXEC unset)")
TIMEOUT = 120  # seconds; a hang fails the test instead of blocking CI
# MHA_TEST_QUICK (the sanitizer runs): one case of each kind, each mpirun costs seconds there.
slow = pytest.mark.skipif(bool(os.environ.get("MHA_TEST_QUICK")), reason="MHA_TEST_QUICK")


def run_single(*args, cwd):
    return subprocess.run([CLI, "run", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=TIMEOUT)


def run_mpi(np_, *args, cwd):
    cmd = [MPIEXEC, "-np", str(np_), *MPIFLAGS, CLI, "run", "--distributed", "ring",
           *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT)


def shard_rows(n, p, rank, layout):
    """Global rows of rank `rank` (docs/distributed.md): C = P (contiguous) or 2P (zigzag)
    chunks, chunk c of floor(n/C) + (c < n mod C) rows; zigzag rank r holds chunks r, 2P-1-r."""
    c = 2 * p if layout == "zigzag" else p
    start = [i * (n // c) + min(i, n % c) for i in range(c + 1)]
    chunks = [rank, 2 * p - 1 - rank] if layout == "zigzag" else [rank]
    return np.concatenate([np.arange(start[k], start[k + 1]) for k in chunks])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    rng = np.random.default_rng(15)
    write_safetensors(d / "w.safetensors", make_weights(rng, q_dim=16, heads=4, kv_heads=2))
    np.save(d / "x.npy", rng.standard_normal((2, 23, 16)).astype(np.float32))  # uneven: 23 rows
    np.save(d / "x2d.npy", rng.standard_normal((19, 16)).astype(np.float32))
    np.save(d / "pos.npy", (np.arange(23) * 2 + 5).astype(np.int64))
    np.save(d / "seg.npy", np.array([[0] * 9 + [1] * 14, [0] * 15 + [2] * 8], np.int32))
    np.save(d / "sinks.npy", np.array([0.5, -1.0, 2.0, 0.0], np.float32))
    return d


def assert_close(y, ref):
    assert y.shape == ref.shape and y.dtype == np.float32
    err = float(np.max(np.abs(y.astype(np.float64) - ref)))
    assert err <= TOL_OUT_REL * float(np.max(np.abs(ref))), err


BASE = ["--weights", "w.safetensors", "--heads", "4"]
CASES = [  # (P, layout, input, options)
    pytest.param(2, "zigzag", "x.npy", [], marks=slow),
    (3, "zigzag", "x.npy", ["--causal", "--rope-theta", "10000"]),
    (2, "contiguous", "x.npy", ["--causal", "--rope-style", "half", "--window", "5,0"]),
    pytest.param(3, "contiguous", "x.npy", ["--window", "3,2", "--rope-theta", "500",
                                            "--positions", "pos.npy"], marks=slow),
    pytest.param(3, "zigzag", "x2d.npy", ["--causal", "top-left", "--kv-heads", "2", "--scale",
                                          "0.3"], marks=slow),
    (3, "zigzag", "x.npy", ["--causal", "--q-segments", "seg.npy", "--kv-segments", "seg.npy",
                            "--sinks", "sinks.npy", "--rope-theta", "10000"]),
]


@needs_mpi
@pytest.mark.parametrize("p,layout,x,opts", CASES)
def test_equals_single_process(files, p, layout, x, opts):
    r1 = run_single(*BASE, "--input", x, "--out", "y1.npy", *opts, cwd=files)
    assert r1.returncode == 0, r1.stderr
    rp = run_mpi(p, *BASE, "--shard-layout", layout, "--input", x, "--out", "yp.npy", *opts,
                 cwd=files)
    assert rp.returncode == 0, rp.stderr
    assert_close(np.load(files / "yp.npy"), np.load(files / "y1.npy").astype(np.float64))
    assert not [f for f in os.listdir(files) if f.startswith(".") or ".tmp" in f]


SHORT = [  # (P, layout, N, options): fewer rows than chunks, some ranks hold none
    (3, "zigzag", 5, ["--causal", "--rope-theta", "10000"]),  # the report: 5 rows, 6 chunks
    (3, "zigzag", 1, ["--causal"]),  # a single token: ranks 1 and 2 hold nothing
    pytest.param(2, "zigzag", 3, ["--causal", "--q-segments", "seg_short.npy", "--kv-segments",
                                  "seg_short.npy", "--sinks", "sinks.npy"], marks=slow),
    pytest.param(4, "zigzag", 7, ["--window", "2,1", "--rope-theta", "500"], marks=slow),
    pytest.param(4, "contiguous", 2, ["--causal", "--rope-theta", "10000"], marks=slow),
    pytest.param(4, "contiguous", 4, [], marks=slow),
    pytest.param(2, "contiguous", 1, [], marks=slow),
    pytest.param(1, "zigzag", 1, ["--causal"], marks=slow),
]


@needs_mpi
@pytest.mark.parametrize("p,layout,n,opts", SHORT)
def test_short_sequences(files, p, layout, n, opts):
    """N < the chunk count (P contiguous, 2P zigzag) and around it: the ranks without rows take
    part with an empty shard and the output equals the single-process run's."""
    x = np.load(files / "x.npy")[:, :n]
    np.save(files / f"x_short{n}.npy", x)
    np.save(files / "seg_short.npy", np.array([[0, 0, 1][:n]] * 2, np.int32)[:, :n])
    io = ["--input", f"x_short{n}.npy"]
    r1 = run_single(*BASE, *io, "--out", "y1s.npy", *opts, cwd=files)
    assert r1.returncode == 0, r1.stderr
    rp = run_mpi(p, *BASE, "--shard-layout", layout, *io, "--out", "yps.npy", *opts, cwd=files)
    assert rp.returncode == 0, rp.stderr
    assert_close(np.load(files / "yps.npy"), np.load(files / "y1s.npy").astype(np.float64))


@needs_mpi
@pytest.mark.parametrize("p,layout", [(2, "zigzag"), pytest.param(3, "contiguous", marks=slow)])
def test_shard_files(files, p, layout):
    """Each rank reads x_{rank}.npy (its rows, in order) and writes y_{rank}.npy; reassembled,
    they equal the single-process output."""
    opts = ["--causal", "--rope-theta", "10000"]
    x = np.load(files / "x.npy")
    rows = [shard_rows(x.shape[1], p, r, layout) for r in range(p)]
    for r in range(p):
        np.save(files / f"xs_{r}.npy", x[:, rows[r]])
    r1 = run_single(*BASE, "--input", "x.npy", "--out", "y1.npy", *opts, cwd=files)
    assert r1.returncode == 0, r1.stderr
    rp = run_mpi(p, *BASE, "--shard-layout", layout, "--input", "xs_{rank}.npy", "--out",
                 "ys_{rank}.npy", *opts, cwd=files)
    assert rp.returncode == 0, rp.stderr
    y = np.empty((x.shape[0], x.shape[1], 16), np.float32)
    for r in range(p):
        y[:, rows[r]] = np.load(files / f"ys_{r}.npy")
        os.remove(files / f"ys_{r}.npy")
    assert_close(y, np.load(files / "y1.npy").astype(np.float64))


def shard_case_params():
    """N = 1, 2 and 2P - 1 for P = 2, 3 in both layouts: ranks whose shard file has no rows
    (N = 1 over any P, N = 2 over 3 ranks, ...), next to ranks that hold some. MHA_TEST_QUICK keeps
    two (a 3-d and a 2-d input, each with empty shards)."""
    quick = {(3, "zigzag", 1), (2, "contiguous", 1)}
    for p in (2, 3):
        for layout in ("zigzag", "contiguous"):
            for n in (1, 2, 2 * p - 1):
                ndim = 2 if layout == "contiguous" and n == 1 else 3
                marks = () if (p, layout, n) in quick else (slow,)
                yield pytest.param(p, layout, n, ndim, marks=marks,
                                   id=f"P{p}-{layout}-N{n}-{ndim}d")


@needs_mpi
@pytest.mark.parametrize("p,layout,n,ndim", list(shard_case_params()))
def test_shard_files_without_rows(files, p, layout, n, ndim):
    """Shard-file mode with a rank whose rows are none: its files are zero-row .npy ([B, 0, F] or
    [0, F] for X, [0] or [B, 0] for the per-row files), it takes part in the ring with an empty
    shard and writes a zero-row Y ([B, 0, out_dim] or [0, out_dim]); the ranks' outputs put
    together equal the single-process run on the N rows."""
    x = np.load(files / "x.npy")[:, :n]
    pos = (np.arange(n) * 3 + 2).astype(np.int64)
    seg = np.array([[0, 1, 1, 1, 2][:n], [0, 0, 0, 3, 3][:n]], np.int32)
    opts = ["--causal", "--rope-theta", "10000"]
    per_rank = []
    if ndim == 2:
        x = x[0]
    else:
        per_rank = ["--positions", "pp_{rank}.npy", "--q-segments", "sg_{rank}.npy",
                    "--kv-segments", "sg_{rank}.npy", "--sinks", "sinks.npy"]
        np.save(files / "pp.npy", pos)
        np.save(files / "sg.npy", seg)
    np.save(files / "xz.npy", x)
    rows = [shard_rows(n, p, r, layout) for r in range(p)]
    for r in range(p):
        np.save(files / f"xz_{r}.npy", np.ascontiguousarray(x[..., rows[r], :]))
        np.save(files / f"pp_{r}.npy", pos[rows[r]])
        np.save(files / f"sg_{r}.npy", np.ascontiguousarray(seg[:, rows[r]]))
    single = [a.replace("_{rank}", "") for a in per_rank]
    r1 = run_single(*BASE, "--input", "xz.npy", "--out", "yz1.npy", *opts, *single, cwd=files)
    assert r1.returncode == 0, r1.stderr
    rp = run_mpi(p, *BASE, "--shard-layout", layout, "--input", "xz_{rank}.npy", "--out",
                 "yz_{rank}.npy", *opts, *per_rank, cwd=files)
    assert rp.returncode == 0, rp.stderr
    ref = np.load(files / "yz1.npy")
    y = np.full(ref.shape, np.nan, np.float32)
    for r in range(p):
        yr = np.load(files / f"yz_{r}.npy")
        assert yr.shape == ref[..., rows[r], :].shape and yr.dtype == np.float32, (r, yr.shape)
        y[..., rows[r], :] = yr
        os.remove(files / f"yz_{r}.npy")
    assert_close(y, ref.astype(np.float64))


@needs_mpi
def test_empty_input_refused_outside_shard_files(files):
    """A zero-row X is a rank's empty shard only in shard-file mode: as the whole input of a
    distributed run it is refused ("is empty", exit 1, no output), and so are shard files that
    hold no row at all (no sequence), or a zero-row file where the layout gives the rank rows."""
    np.save(files / "x0.npy", np.zeros((2, 0, 16), np.float32))
    r = run_mpi(2, *BASE, "--input", "x0.npy", "--out", "ye.npy", cwd=files)
    assert r.returncode != 0 and "x0.npy: shape [2, 0, 16] is empty" in r.stderr, r.stderr
    assert not os.path.exists(files / "ye.npy")
    for rk in range(2):
        np.save(files / f"x0_{rk}.npy", np.zeros((2, 0, 16), np.float32))
    r = run_mpi(2, *BASE, "--input", "x0_{rank}.npy", "--out", "ye_{rank}.npy", cwd=files)
    assert r.returncode != 0 and "no rows" in r.stderr, r.stderr
    x = np.load(files / "x.npy")
    np.save(files / "x0_0.npy", x[:, :3])  # 3 rows: rank 1 of 2 (zigzag) holds 2 of them
    r = run_mpi(2, *BASE, "--input", "x0_{rank}.npy", "--out", "ye_{rank}.npy", cwd=files)
    assert r.returncode != 0 and "x0_1.npy: 0 rows, but rank 1 of 2 holds 2 rows" in r.stderr, \
        r.stderr
    # A zero-row array stays an error everywhere else: the single-process run.
    r = run_single(*BASE, "--input", "x0_1.npy", "--out", "ye.npy", cwd=files)
    assert r.returncode == 1 and "is empty" in r.stderr, r.stderr
    assert not [f for f in os.listdir(files) if f.startswith("ye")]


@needs_mpi
def test_shard_files_nonfinite_input_on_another_rank(files):
    """The output check (docs/FORMATS.md) judges "every input finite" over all ranks' inputs:
    a NaN in rank 1's shard only reaches rank 0's rows of Y through the ring (no causal mask),
    which is the expected propagation, not float32 overflow: every rank writes, exit 0. With
    finite shards the run exits 0 with finite outputs, and huge finite weights still fail with
    exit 3 on every rank, writing nothing."""
    x = np.load(files / "x.npy")
    rows = [shard_rows(23, 2, r, "zigzag") for r in range(2)]
    np.save(files / "xn_0.npy", x[:, rows[0]])
    x1 = x[:, rows[1]].copy()
    x1[0, 2, 5] = np.nan
    np.save(files / "xn_1.npy", x1)
    io = ["--input", "xn_{rank}.npy", "--out", "yn_{rank}.npy"]
    r = run_mpi(2, *BASE, *io, cwd=files)
    assert r.returncode == 0 and "mha:" not in r.stderr, (r.returncode, r.stderr)
    y0 = np.load(files / "yn_0.npy")
    assert np.isnan(y0[0]).all() and np.isfinite(y0[1]).all()
    np.save(files / "xn_1.npy", x[:, rows[1]])
    r = run_mpi(2, *BASE, *io, cwd=files)
    assert r.returncode == 0 and "mha:" not in r.stderr, (r.returncode, r.stderr)
    assert all(np.isfinite(np.load(files / f"yn_{rk}.npy")).all() for rk in range(2))
    for rk in range(2):
        os.remove(files / f"yn_{rk}.npy")
    rng = np.random.default_rng(5)
    huge = {k: (np.sign(v) * 3e38).astype(np.float32)
            for k, v in make_weights(rng, q_dim=16, heads=4, kv_heads=2).items()}
    write_safetensors(files / "wh.safetensors", huge)
    r = run_mpi(2, "--weights", "wh.safetensors", "--heads", "4", *io, cwd=files)
    assert r.returncode != 0 and "although every input is finite" in r.stderr, r.stderr
    assert "exit code:    3" in r.stderr.lower() or r.returncode == 3, r.stderr
    assert not [f for f in os.listdir(files) if f.startswith("yn_")]


@needs_mpi
def test_shard_file_errors(files):
    """A missing file on rank 2 only, then files with the wrong rows for the layout: every rank
    stops (non-zero), the line names the file, and no rank leaves its output behind."""
    x = np.load(files / "x.npy")
    for r in range(2):
        np.save(files / f"xe_{r}.npy", x[:, shard_rows(23, 2, r, "zigzag")])
    r = run_mpi(3, *BASE, "--input", "xe_{rank}.npy", "--out", "ye_{rank}.npy", cwd=files)
    assert r.returncode != 0
    assert "rank 2 of 3: xe_2.npy: cannot open" in r.stderr
    assert "stopped: rank 2 failed" in r.stderr
    np.save(files / "xe_1.npy", x[:, :5])  # 5 rows: of the 16 in all, rank 1 of 2 holds 8
    r = run_mpi(2, *BASE, "--input", "xe_{rank}.npy", "--out", "ye_{rank}.npy", cwd=files)
    assert r.returncode != 0
    assert "xe_1.npy: 5 rows, but rank 1 of 2 holds" in r.stderr
    assert not [f for f in os.listdir(files) if f.startswith("ye_")]


@needs_mpi
@pytest.mark.parametrize("opts,code,text", [
    (["--input", "missing.npy"], 1, "missing.npy: cannot open"),
    pytest.param(["--input", "w.safetensors"], 1, "w.safetensors", marks=slow),
    (["--input", "x.npy", "--attn", "a.npy"], 2, "--attn cannot be used with --distributed"),
    (["--input", "x.npy", "--attn-stats", "s.npz"], 2,
     "--attn-stats cannot be used with --distributed"),
    pytest.param(["--input", "x.npy", "--key", "x.npy"], 2,
                 "--key cannot be used with --distributed", marks=slow),
    pytest.param(["--input", "x.npy", "--shard-layout", "stripes"], 2,
                 "is not zigzag or contiguous", marks=slow),
    pytest.param(["--input", "x_{rank}.npy"], 2, "need {rank} in both --input and --out",
                 marks=slow),
])
def test_errors(files, opts, code, text):
    r = run_mpi(2, *BASE, "--out", "ye.npy", *opts, cwd=files)
    assert r.returncode != 0 and text in r.stderr, r.stderr
    assert ("exit code:    %d" % code) in r.stderr.lower() or r.returncode == code, r.stderr
    assert not os.path.exists(files / "ye.npy")


def test_without_mpi_or_usage(files):
    """Without MPI --distributed is one clear error; either way a usage error comes first."""
    r = run_single(*BASE, "--input", "x.npy", "--out", "ye.npy", "--shard-layout", "zigzag",
                   cwd=files)
    assert r.returncode == 2 and "--shard-layout needs --distributed ring" in r.stderr
    if not MPIEXEC:
        r = run_single(*BASE, "--input", "x.npy", "--out", "ye.npy", "--distributed", "ring",
                       cwd=files)
        assert r.returncode == 1 and "built without MPI" in r.stderr, r.stderr
    assert not os.path.exists(files / "ye.npy")


@needs_mpi
def test_key_padding(files):
    """--key-padding-mask: every rank gets its keys' slice. While the ring refuses key padding the
    run fails on every rank with the library's message naming it and leaves no output; once it
    supports it (docs/distributed.md), the output must equal the single-process one."""
    pad = (np.arange(2 * 23).reshape(2, 23) % 5) != 3
    np.save(files / "pad.npy", pad)
    opts = ["--input", "x.npy", "--causal", "--key-padding-mask", "pad.npy"]
    rp = run_mpi(2, *BASE, "--out", "yk.npy", *opts, cwd=files)
    if rp.returncode != 0:
        assert "key_padding" in rp.stderr and "not supported" in rp.stderr, rp.stderr
        assert not os.path.exists(files / "yk.npy")
        return
    r1 = run_single(*BASE, "--out", "y1.npy", *opts, cwd=files)
    assert r1.returncode == 0, r1.stderr
    assert_close(np.load(files / "yk.npy"), np.load(files / "y1.npy").astype(np.float64))
