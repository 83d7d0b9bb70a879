# SPDX-License-Identifier: MIT
"""Ring attention from Python with an mpi4py communicator (mha.attention / attention_backward
with comm=, mha.shard_rows, mha.torch.ring_attention), run by ctest under mpirun:

    mpirun -np P python -m pytest -q tests/mpi_python_ring.py      (ctest: py_ring_np2, np3)

(Not named test_*.py: the plain Python tests are collected without mpirun.) Every rank builds
the same seeded global Q, K, V, computes the single-process result on the whole sequence (the
oracle: mha.attention / attention_backward, themselves tested against float64 NumPy; the torch
path against torch's float64 attention), then its shard through the ring, and compares its rows:
max|o - o_1| <= TOL_OUT_REL max|o_1|, |lse - lse_1| <= TOL_OUT_REL max(1, |lse_1|), each gradient
within TOL_GRAD_REL max|g_1| (tests/common/tolerance.h). Every test makes all its collective calls
before asserting, so a failing check on one rank cannot leave the others waiting.
Key padding, segment ids and sinks too (the rank's rows of the first two, the whole sinks).
Also: a bad argument on one rank (found in Python, or in C) raises on every rank; comm= without
libmha_mpi raises on every rank; the Fortran-handle entry points refuse bad handles; shard_rows
tiles the sequence.
"""
import os
import sys

import numpy as np
import pytest

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mpi4py import MPI  # noqa: E402

import mha  # noqa: E402
from mha import _mpi  # noqa: E402
from tolerances import TOL_GRAD_REL, TOL_OUT_REL  # noqa: E402

COMM = MPI.COMM_WORLD
P, RANK = COMM.Get_size(), COMM.Get_rank()


def err_rel(got, ref, floor=0.0):
    """max|got - ref| / max(floor, max|ref|)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if got.size == 0:  # a rank without rows (N < the chunk count)
        return 0.0
    return np.abs(got - ref).max() / max(floor, np.abs(ref).max(), 1e-30)


def problem(B, h, g, N, d, dv, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, h, N, d)).astype(np.float32)
    k = rng.standard_normal((B, g, N, d)).astype(np.float32)
    v = rng.standard_normal((B, g, N, dv)).astype(np.float32)
    do = rng.standard_normal((B, h, N, dv)).astype(np.float32)
    return q, k, v, do


SHAPES = [  # (B, h, g, N, d, dv): plain; GQA 4:2 with d_v != d_k and an uneven N; MQA 3:1
    (1, 2, 2, 16, 8, 8),
    (2, 4, 2, 37, 8, 6),
    (1, 3, 1, 23, 16, 16),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shard_layout", ["zigzag", "contiguous"])
def test_forward_backward_equal_single_process(shape, causal, shard_layout):
    B, h, g, N, d, dv = shape
    q, k, v, do = problem(*shape)
    o1, l1 = mha.attention(q, k, v, causal=causal, return_lse=True)
    g1 = mha.attention_backward(do, q, k, v, o1, l1, causal=causal)
    rows = mha.shard_rows(N, COMM, shard_layout=shard_layout)
    sh = [x[:, :, rows] for x in (q, k, v, do)]
    o, lse = mha.attention(*sh[:3], causal=causal, return_lse=True, comm=COMM, seq_len=N,
                           shard_layout=shard_layout)
    grads = mha.attention_backward(sh[3], *sh[:3], o, lse, causal=causal, comm=COMM,
                                   seq_len=N, shard_layout=shard_layout)
    assert err_rel(o, o1[:, :, rows]) <= TOL_OUT_REL
    assert err_rel(lse, l1[:, :, rows], floor=1.0) <= TOL_OUT_REL
    for got, ref in zip(grads, g1):
        assert err_rel(got, ref[:, :, rows]) <= TOL_GRAD_REL


def test_options_and_blhd_layout():
    """[B, L, h, d] arrays sharded on axis 1, with a window, softcap and an explicit scale."""
    B, h, g, N, d, dv = 2, 4, 2, 29, 8, 8
    q, k, v, do = (x.transpose(0, 2, 1, 3).copy() for x in problem(B, h, g, N, d, dv, seed=1))
    opts = dict(causal=True, window=(5, 0), softcap=20.0, scale=0.3, layout="blhd")
    o1, l1 = mha.attention(q, k, v, return_lse=True, **opts)
    g1 = mha.attention_backward(do, q, k, v, o1, l1, **opts)
    rows = mha.shard_rows(N, COMM)
    sh = [x[:, rows] for x in (q, k, v, do)]
    o, lse = mha.attention(*sh[:3], return_lse=True, comm=COMM, seq_len=N, **opts)
    grads = mha.attention_backward(sh[3], *sh[:3], o, lse, comm=COMM, seq_len=N, **opts)
    assert err_rel(o, o1[:, rows]) <= TOL_OUT_REL
    assert err_rel(lse, l1[:, :, rows], floor=1.0) <= TOL_OUT_REL
    for got, ref in zip(grads, g1):
        assert err_rel(got, ref[:, rows]) <= TOL_GRAD_REL


def make_layer(E=16, h=4, g=2, d=8, seed=3):
    """A layer with GQA, biases, RoPE (half style) and sinks."""
    rng = np.random.default_rng(seed)
    w = lambda r, c: (rng.standard_normal((r, c)) / np.sqrt(c)).astype(np.float32)  # noqa: E731
    b = lambda r: (0.1 * rng.standard_normal(r)).astype(np.float32)  # noqa: E731
    sinks = rng.standard_normal(h).astype(np.float32)
    return mha.MultiheadAttention(w(h * d, E), w(g * d, E), w(g * d, E), w(E, h * d),
                                  b(h * d), b(g * d), b(g * d), b(E), num_heads=h,
                                  num_kv_heads=g, rope="half", sinks=sinks)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shard_layout", ["zigzag", "contiguous"])
def test_layer_forward_and_backward_equal_single_process(causal, shard_layout):
    """MultiheadAttention with comm= (mha_ring_layer_forward / _backward): each rank's rows of y
    and of dL/dx, and the whole parameter gradients, equal the single-process layer's."""
    layer = make_layer()
    B, N, E = 2, 29, 16
    rng = np.random.default_rng(7)
    x = rng.standard_normal((B, N, E)).astype(np.float32)
    dy = rng.standard_normal((B, N, E)).astype(np.float32)
    y1, st1 = layer.forward_train(x, causal=causal)
    g1 = layer.backward(st1, dy)
    rows = mha.shard_rows(N, COMM, shard_layout=shard_layout)
    y = layer(x[:, rows], causal=causal, comm=COMM, seq_len=N, shard_layout=shard_layout)
    assert err_rel(y, y1[:, rows]) <= TOL_OUT_REL
    y2, st = layer.forward_train(x[:, rows], causal=causal, comm=COMM, seq_len=N,
                                 shard_layout=shard_layout)
    np.testing.assert_array_equal(y2, y)
    grads = layer.backward(st, dy[:, rows])
    assert sorted(grads) == sorted(g1)
    for name, ref in g1.items():
        got = grads[name]
        assert err_rel(got, ref[:, rows] if name == "query" else ref) <= TOL_GRAD_REL, name


def test_layer_bad_argument_on_one_rank_raises_on_every_rank():
    layer = make_layer()
    N = 4 * P
    x = np.ones((1, N, 16), np.float32)
    rows = mha.shard_rows(N, COMM)
    bad = P - 1
    xb = x[:, rows, :8] if RANK == bad else x[:, rows]
    expect_raise_everywhere(lambda: layer(xb, comm=COMM, seq_len=N), bad,
                            (ValueError, mha.MhaError), "")
    expect_raise_everywhere(lambda: layer(x[:, rows], x[:, rows] if RANK == bad else None,
                                          comm=COMM, seq_len=N), bad, ValueError, "self-attention")
    with pytest.raises(ValueError, match="comm"):
        layer(x, seq_len=N)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shard_layout", ["zigzag", "contiguous"])
def test_key_padding_segments_and_sinks(causal, shard_layout):
    """The per-key and per-row masks of the C ring from Python: each rank passes its rows of
    key_padding_mask and of the segment ids, and the whole sinks [h]; dsinks is the whole
    gradient on every rank."""
    B, h, g, N, d, dv = 2, 4, 2, 26, 8, 8
    q, k, v, do = problem(B, h, g, N, d, dv, seed=3)
    rng = np.random.default_rng(4)
    pad = rng.random((B, N)) > 0.25
    seg = np.sort(rng.integers(0, 3, (B, N)), axis=1).astype(np.int32)
    sinks = rng.standard_normal(h).astype(np.float32)
    opts = dict(causal=causal, sinks=sinks)
    o1, l1 = mha.attention(q, k, v, return_lse=True, key_padding_mask=pad, q_segment_ids=seg,
                           kv_segment_ids=seg, **opts)
    g1 = mha.attention_backward(do, q, k, v, o1, l1, key_padding_mask=pad, q_segment_ids=seg,
                                kv_segment_ids=seg, **opts)
    rows = mha.shard_rows(N, COMM, shard_layout=shard_layout)
    sh = [x[:, :, rows] for x in (q, k, v, do)]
    local = dict(key_padding_mask=pad[:, rows], q_segment_ids=seg[:, rows],
                 kv_segment_ids=seg[:, rows], comm=COMM, seq_len=N, shard_layout=shard_layout)
    o, lse = mha.attention(*sh[:3], return_lse=True, **local, **opts)
    grads = mha.attention_backward(sh[3], *sh[:3], o, lse, **local, **opts)
    assert err_rel(o, o1[:, :, rows]) <= TOL_OUT_REL
    finite = np.isfinite(l1[:, :, rows])  # fully masked rows: -inf in both
    assert np.array_equal(np.isfinite(lse), finite)
    assert err_rel(lse[finite], l1[:, :, rows][finite], floor=1.0) <= TOL_OUT_REL
    for got, ref in zip(grads[:3], g1[:3]):
        assert err_rel(got, ref[:, :, rows]) <= TOL_GRAD_REL
    assert err_rel(grads[3], g1[3]) <= TOL_GRAD_REL  # dsinks: summed over the ranks


SHORT_N = sorted({1, 2, 3, P, 2 * P - 1, 2 * P + 1})  # N < the chunk count and around it


@pytest.mark.parametrize("N", SHORT_N)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shard_layout", ["zigzag", "contiguous"])
def test_short_sequences(N, causal, shard_layout):
    """Fewer rows than chunks (docs/distributed.md): some ranks hold no row and pass empty
    arrays; outputs, lse and gradients (with key padding, segment ids and sinks, then the layer
    forward and backward) still equal the single-process ones."""
    B, h, g, d, dv = 2, 4, 2, 8, 6
    q, k, v, do = problem(B, h, g, N, d, dv, seed=N)
    rng = np.random.default_rng(N)
    pad = rng.random((B, N)) > 0.25
    seg = np.sort(rng.integers(0, 2, (B, N)), axis=1).astype(np.int32)
    sinks = rng.standard_normal(h).astype(np.float32)
    rows = mha.shard_rows(N, COMM, shard_layout=shard_layout)
    ring = dict(comm=COMM, seq_len=N, shard_layout=shard_layout)
    sh = [x[:, :, rows] for x in (q, k, v, do)]
    results = []
    for masks in (False, True):
        opts = dict(causal=causal)
        if masks:
            opts.update(sinks=sinks, window=(2, 0 if causal else 1))
        whole = dict(key_padding_mask=pad, q_segment_ids=seg, kv_segment_ids=seg) if masks \
            else {}
        local = {name: a[:, rows] for name, a in whole.items()}
        o1, l1 = mha.attention(q, k, v, return_lse=True, **whole, **opts)
        g1 = mha.attention_backward(do, q, k, v, o1, l1, **whole, **opts)
        o, lse = mha.attention(*sh[:3], return_lse=True, **local, **opts, **ring)
        grads = mha.attention_backward(sh[3], *sh[:3], o, lse, **local, **opts, **ring)
        results.append((o1, l1, g1, o, lse, grads))
    layer = make_layer()
    E = 16
    x = rng.standard_normal((B, N, E)).astype(np.float32)
    dy = rng.standard_normal((B, N, E)).astype(np.float32)
    y1, st1 = layer.forward_train(x, causal=causal)
    lg1 = layer.backward(st1, dy)
    y, st = layer.forward_train(x[:, rows], causal=causal, **ring)
    lg = layer.backward(st, dy[:, rows])
    for o1, l1, g1, o, lse, grads in results:
        assert o.shape == (B, h, len(rows), dv) and lse.shape == (B, h, len(rows))
        assert err_rel(o, o1[:, :, rows]) <= TOL_OUT_REL
        finite = np.isfinite(l1[:, :, rows])  # fully masked rows: -inf in both
        assert np.array_equal(np.isfinite(lse), finite)
        assert err_rel(lse[finite], l1[:, :, rows][finite], floor=1.0) <= TOL_OUT_REL
        for got, ref in zip(grads[:3], g1[:3]):
            assert err_rel(got, ref[:, :, rows]) <= TOL_GRAD_REL
        if len(grads) > 3:
            assert err_rel(grads[3], g1[3]) <= TOL_GRAD_REL  # dsinks, whole on every rank
    assert y.shape == (B, len(rows), E) and err_rel(y, y1[:, rows]) <= TOL_OUT_REL
    for name, ref in lg1.items():
        assert err_rel(lg[name], ref[:, rows] if name == "query" else ref) <= TOL_GRAD_REL, name


@pytest.mark.parametrize("N", [4 * P + 3] + SHORT_N)  # uneven, and fewer rows than chunks
@pytest.mark.parametrize("shard_layout", ["zigzag", "contiguous"])
def test_shard_rows_tile_the_sequence(N, shard_layout):
    rows = mha.shard_rows(N, COMM, shard_layout=shard_layout)
    every = COMM.allgather(rows)
    assert np.array_equal(np.sort(np.concatenate(every)), np.arange(N))
    assert all(np.array_equal(every[r], mha.shard_rows(N, num_ranks=P, rank=r,
                                                       shard_layout=shard_layout))
               for r in range(P))
    chunks = _mpi.shard_chunks(N, P, RANK, shard_layout)
    C = 2 * P if shard_layout == "zigzag" else P
    starts = [c * (N // C) + min(c, N % C) for c in range(C + 1)]  # docs/distributed.md
    mine = [RANK, C - 1 - RANK] if shard_layout == "zigzag" else [RANK]
    assert chunks == [(starts[c], starts[c + 1]) for c in mine]


def test_shard_rows_refuses_ints_ctypes_would_wrap():
    """num_ranks and rank (int32_t) and seq_len (int64_t) outside their C type raise instead of
    going through ctypes modulo 2^32 / 2^64 (num_ranks=2^32+2 sharded for 2 ranks, rank=2^32+1
    gave rank 1's rows, seq_len=2^64+8 sharded and ran 8 rows); floats and bools are not counts."""
    for num_ranks, rank in ((2 ** 32 + 2, 0), (2, 2 ** 32 + 1), (-2 ** 31 - 1, 0)):
        with pytest.raises(ValueError, match="outside int32"):
            mha.shard_rows(8, num_ranks=num_ranks, rank=rank)
    for num_ranks, rank in ((2.7, 0), (True, 0), (2, 1.0)):
        with pytest.raises(TypeError, match="expected an integer"):
            mha.shard_rows(8, num_ranks=num_ranks, rank=rank)
    assert mha.shard_rows(8, num_ranks=np.int64(2), rank=np.int32(1)).tolist() == [2, 3, 4, 5]
    for N in (2 ** 64 + 8, 2 ** 63):
        with pytest.raises(ValueError, match="below 2\\^63"):
            mha.shard_rows(N, COMM)
        x = np.zeros((1, 1, 4, 2), np.float32)
        with pytest.raises(ValueError, match="below 2\\^63"):  # the same on every rank
            mha.attention(x, x, x, comm=COMM, seq_len=N)


def expect_raise_everywhere(call, bad_rank, kind, text):
    """call() raises `kind` on every rank: on bad_rank with its own message, elsewhere naming
    bad_rank; then a good collective call still works."""
    with pytest.raises(kind) as e:
        call()
    msg = str(e.value)
    if RANK != bad_rank:
        assert msg.startswith(f"rank {bad_rank}: ") or f"rank {bad_rank}: " in msg, msg
    assert text in msg, msg


def test_bad_argument_on_one_rank_raises_on_every_rank():
    N = 16
    q, k, v, _ = problem(1, 2, 2, N, 8, 8)
    rows = mha.shard_rows(N, COMM)
    sh = [x[:, :, rows] for x in (q, k, v)]
    bad = P - 1
    # Found in Python (before any C call): an integer array on one rank.
    vb = sh[2].astype(np.int64) if RANK == bad else sh[2]
    expect_raise_everywhere(lambda: mha.attention(sh[0], sh[1], vb, comm=COMM, seq_len=N),
                            bad, TypeError, "floating-point")
    # Found in Python: no seq_len on one rank.
    nb = None if RANK == bad else N
    expect_raise_everywhere(lambda: mha.attention(*sh, comm=COMM, seq_len=nb), bad, ValueError,
                            "seq_len")
    # Found in C and agreed there: one row too few on one rank.
    qb = sh[0][:, :, :-1] if RANK == bad else sh[0]
    expect_raise_everywhere(lambda: mha.attention(qb, sh[1], sh[2], comm=COMM, seq_len=N), bad,
                            mha.MhaError, "q_len")
    # The backward without the forward's rows of lse on one rank.
    o, lse = mha.attention(*sh, return_lse=True, comm=COMM, seq_len=N)
    lb = lse[:, :, :-1] if RANK == bad else lse
    expect_raise_everywhere(lambda: mha.attention_backward(o, *sh, o, lb, comm=COMM, seq_len=N),
                            bad, ValueError, "lse")
    # A good call afterwards succeeds.
    o2 = mha.attention(*sh, comm=COMM, seq_len=N)
    assert np.array_equal(o2, o)


def test_ring_arguments_without_comm():
    x = np.zeros((1, 1, 4, 2), np.float32)
    with pytest.raises(ValueError, match="go with comm="):
        mha.attention(x, x, x, seq_len=4)
    with pytest.raises(ValueError, match="go with comm="):
        mha.attention_backward(x, x, x, x, x, x[..., 0], shard_layout="contiguous")


def test_not_a_communicator():
    with pytest.raises(TypeError, match="mpi4py"):
        mha.attention(np.zeros((1, 1, 4, 2), np.float32), np.zeros((1, 1, 4, 2), np.float32),
                      np.zeros((1, 1, 4, 2), np.float32), comm=object(), seq_len=4)


@pytest.mark.parametrize("handle, why", [(MPI.COMM_NULL.py2f(), "MPI_COMM_NULL"),
                                         (1 << 40, "does not fit MPI_Fint")])
def test_fortran_handle_entry_points_refuse_a_bad_handle(handle, why):
    """mha_ring_attention[_backward]_fcomm (the route from Python) check the handle before
    converting it (a local error: with no communicator there is no one to wait for)."""
    from mha import _lib
    lib = _mpi.library()
    for fn, extra in ((lib.mha_ring_attention_fcomm, ()),
                      (lib.mha_ring_attention_backward_fcomm, (None,))):
        err = _lib.mha_error()
        status = fn(handle, None, None, *extra, None, err)
        assert _lib.STATUS_NAMES[status] == "INVALID_ARG"
        assert why in err.message.decode(), err.message


def test_without_libmha_mpi_raises_on_every_rank(monkeypatch):
    """libmha_mpi missing (here on the last rank only): MhaError UNSUPPORTED everywhere."""
    bad = P - 1
    if RANK == bad:
        monkeypatch.setenv("MHA_MPI_LIBRARY", os.path.join(SRC, "no-such-dir", "libmha_mpi.so"))
    _mpi.library.cache_clear()
    try:
        x = np.zeros((1, 1, 8, 2), np.float32)
        rows = np.arange(8)[RANK::P]  # any local arrays: the library is looked for first
        with pytest.raises(mha.MhaError) as e:
            mha.attention(x[:, :, rows], x[:, :, rows], x[:, :, rows], comm=COMM, seq_len=8)
    finally:
        monkeypatch.delenv("MHA_MPI_LIBRARY", raising=False)
        _mpi.library.cache_clear()
    assert e.value.status_name == "UNSUPPORTED"
    assert "libmha_mpi" in str(e.value) and "no-such-dir" in str(e.value)


@pytest.mark.parametrize("shard_layout", ["zigzag", "contiguous"])
def test_torch_autograd(shard_layout, N=21, whole_scale=False):
    """mha.torch.ring_attention forward and backward against torch's float64 attention on the
    whole sequence (causal, GQA 4:2). whole_scale: each gradient's error against the largest
    entry of the three whole gradients (a short sequence's rows may have a vanishing dq, dk: a
    single key leaves the softmax no gradient, and float32 rounding is all there is)."""
    torch = pytest.importorskip("torch")
    import mha.torch as mt
    B, h, g, d, dv = 2, 4, 2, 8, 8
    q, k, v, do = (torch.from_numpy(x) for x in problem(B, h, g, N, d, dv, seed=2))
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q64, k64.repeat_interleave(h // g, 1), v64.repeat_interleave(h // g, 1), is_causal=True)
    ref.backward(do.double())
    rows = torch.from_numpy(mha.shard_rows(N, COMM, shard_layout=shard_layout))
    ql, kl, vl = (t[:, :, rows].clone().requires_grad_() for t in (q, k, v))
    out = mt.ring_attention(ql, kl, vl, comm=COMM, seq_len=N, shard_layout=shard_layout,
                            is_causal=True)
    out.backward(do[:, :, rows])
    assert err_rel(out.detach(), ref.detach()[:, :, rows]) <= TOL_OUT_REL
    floor = max(float(t.grad.abs().max()) for t in (q64, k64, v64)) if whole_scale else 0.0
    for got, full in ((ql, q64), (kl, k64), (vl, v64)):
        assert err_rel(got.grad, full.grad[:, :, rows], floor=floor) <= TOL_GRAD_REL


@pytest.mark.parametrize("N", [1, 2, 3])  # at 2 processes: fewer rows than chunks
@pytest.mark.parametrize("shard_layout", ["zigzag", "contiguous"])
def test_torch_autograd_short(shard_layout, N):
    test_torch_autograd(shard_layout, N, whole_scale=True)


def test_torch_shards_checked_on_every_rank():
    """mha.torch.ring_attention's shards (the mpi4py path's torch boundary): a shard C cannot
    read on one rank (a meta tensor, an integer one) raises on every rank (the others used to
    wait in the ring); a bfloat16 or non-contiguous shard is converted to float32 and gives the
    result of the float32 shards."""
    torch = pytest.importorskip("torch")
    import mha.torch as mt
    N = 12
    q, k, v, _ = (torch.from_numpy(x) for x in problem(1, 2, 2, N, 8, 8, seed=3))
    rows = torch.from_numpy(mha.shard_rows(N, COMM))
    ql, kl, vl = (t[:, :, rows].contiguous() for t in (q, k, v))
    ref = mt.ring_attention(ql, kl, vl, comm=COMM, seq_len=N)
    bad = P - 1
    for wrong, text in ((vl.to("meta"), "must be on the CPU"),
                        (vl.to(torch.int32), "floating-point")):
        vb = wrong if RANK == bad else vl
        expect_raise_everywhere(lambda: mt.ring_attention(ql, kl, vb, comm=COMM, seq_len=N), bad,
                                TypeError, text)
    # bfloat16 values (rounded) on one rank, a strided view on another: converted.
    qb = ql.bfloat16() if RANK == bad else ql
    kt = kl.transpose(-1, -2).contiguous().transpose(-1, -2)
    out = mt.ring_attention(qb, kt, vl, comm=COMM, seq_len=N)
    ref_b = mt.ring_attention(qb.float(), kl, vl, comm=COMM, seq_len=N)
    assert out.dtype == torch.float32 and torch.equal(out, ref_b)
    assert RANK == bad or torch.equal(out, ref)
