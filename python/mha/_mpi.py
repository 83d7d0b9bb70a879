# SPDX-License-Identifier: MIT
"""Ring attention over MPI from Python: the ctypes binding of libmha_mpi (include/mha_mpi.h) and
the collective checks of the ``comm=`` path of :func:`mha.attention` and
:func:`mha.attention_backward` (docs/distributed.md, "Python").

The communicator is an mpi4py ``Comm`` (PyPI ``mpi4py``), used by duck typing (``Get_rank``,
``Get_size``, ``allgather``, ``py2f``): this module never imports mpi4py, so ``import mha`` needs
no MPI. It reaches C through its Fortran handle (``comm.py2f()``) and the ``*_fcomm`` entry points,
the one portable route (an ``MPI_Comm`` is a pointer in Open MPI and an int in MPICH).

libmha_mpi is loaded at the first use, found like libmha (mha/_lib.py): ``MHA_MPI_LIBRARY`` if set,
else ``libmha_mpi.so`` next to the loaded libmha (the package directory of a pip install, or
CMake's build directory when ``MHA_LIBRARY`` points there). It links libmha by its SONAME, which the
already loaded libmha answers, so one copy of the library serves both.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys
from ctypes import POINTER, Structure, c_int, c_int32, c_int64
from typing import Callable, List, Optional, Tuple

from . import _lib as L
from ._lib import MhaError

STATUS_INVALID_ARG, STATUS_UNSUPPORTED = 1, 2
# mha_shard_layout
SHARD_LAYOUTS = {"contiguous": 0, "zigzag": 1}


class mha_ring_config(Structure):
    _fields_ = [("seq_len", c_int64), ("layout", c_int)]


def _candidates() -> List[str]:
    env = os.environ.get("MHA_MPI_LIBRARY")
    if env:
        return [env]
    name = "libmha_mpi.dylib" if sys.platform == "darwin" else "libmha_mpi.so"
    return [os.path.join(os.path.dirname(os.path.abspath(L.library_path)), name)]


@functools.lru_cache(maxsize=None)
def library():
    """The loaded libmha_mpi (its functions' types set), loaded once; raises MhaError
    (UNSUPPORTED) naming where it looked when it is absent or cannot be loaded."""
    paths = _candidates()
    for path in paths:
        if not os.path.exists(path):
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise MhaError(STATUS_UNSUPPORTED, f"comm=: could not load libmha_mpi {path}: {e}") \
                from e
        P = POINTER
        lib.mha_ring_shard.argtypes = [P(mha_ring_config), c_int32, c_int32, P(c_int32),
                                       P(c_int64 * 2), P(c_int64 * 2), P(L.mha_error)]
        lib.mha_ring_attention_fcomm.argtypes = [c_int64, P(mha_ring_config),
                                                 P(L.mha_attention_args), P(L.mha_exec),
                                                 P(L.mha_error)]
        lib.mha_ring_attention_backward_fcomm.argtypes = [
            c_int64, P(mha_ring_config), P(L.mha_attention_args), P(L.mha_attention_grads),
            P(L.mha_exec), P(L.mha_error)]
        lib.mha_ring_layer_forward_fcomm.argtypes = [
            c_int64, P(mha_ring_config), ctypes.c_void_p, P(L.mha_forward_args), P(L.mha_exec),
            P(L.mha_error)]
        lib.mha_ring_layer_backward_fcomm.argtypes = [
            c_int64, P(mha_ring_config), ctypes.c_void_p, P(L.mha_forward_args),
            ctypes.c_void_p, P(L.mha_layer_grads), P(L.mha_exec), P(L.mha_error)]
        for f in ("mha_ring_shard", "mha_ring_attention_fcomm",
                  "mha_ring_attention_backward_fcomm", "mha_ring_layer_forward_fcomm",
                  "mha_ring_layer_backward_fcomm"):
            getattr(lib, f).restype = c_int
        return lib
    raise MhaError(STATUS_UNSUPPORTED,
                   "comm=: ring attention needs libmha_mpi, which was not found (looked for: "
                   + ", ".join(paths) + "). Build mha with MPI (CMake finds it, or -DMHA_MPI=ON; "
                   "`pip install ./python` ships it when the machine has MPI) or set "
                   "MHA_MPI_LIBRARY=/path/to/libmha_mpi.so")


def config(seq_len, shard_layout: str) -> mha_ring_config:
    if shard_layout not in SHARD_LAYOUTS:
        raise ValueError(f"shard_layout: expected 'zigzag' or 'contiguous', got {shard_layout!r}")
    if seq_len is None:
        raise ValueError("seq_len: the global sequence length N is required with comm= (each "
                         "rank passes only its shard of the N rows)")
    if type(seq_len) is bool or int(seq_len) != seq_len or not 1 <= seq_len < 2 ** 63:
        # (mha_ring_config.seq_len is an int64_t: ctypes would store 2^64 + 8 as 8)
        raise ValueError(f"seq_len: expected a positive integer below 2^63, got {seq_len!r}")
    c = mha_ring_config()
    c.seq_len = int(seq_len)
    c.layout = SHARD_LAYOUTS[shard_layout]
    return c


def shard_chunks(seq_len: int, num_ranks: int, rank: int,
                 shard_layout: str = "zigzag") -> List[Tuple[int, int]]:
    """The (start, stop) global row ranges that `rank` of `num_ranks` holds, in local order
    (mha_ring_shard: one chunk, or two with 'zigzag'). No communication."""
    num_ranks, rank = L.int_arg(num_ranks, "num_ranks", 32), L.int_arg(rank, "rank", 32)
    lib = library()
    cfg = config(seq_len, shard_layout)
    nc = c_int32()
    start, length = (c_int64 * 2)(), (c_int64 * 2)()
    err = L.mha_error()
    L.check(lib.mha_ring_shard(cfg, num_ranks, rank, ctypes.byref(nc), start, length,
                               err), err)
    return [(start[c], start[c] + length[c]) for c in range(nc.value)]


def comm_info(comm) -> Tuple[int, int]:
    """(size, rank) of an mpi4py communicator; TypeError for anything else."""
    if not all(hasattr(comm, a) for a in ("Get_size", "Get_rank", "allgather", "py2f")):
        raise TypeError(f"comm: expected an mpi4py communicator (mpi4py.MPI.Comm), got "
                        f"{type(comm).__name__}")
    return int(comm.Get_size()), int(comm.Get_rank())


def collective(comm, prepare: Callable[[], object]):
    """Runs prepare() (this rank's checks and marshalling) and agrees on its outcome over comm
    before any rank calls C: if prepare raised on some rank, every rank raises (the failing rank
    its own exception, the others the same type, "rank r: <message>" of the first failing rank),
    so no rank waits in the ring for a peer that has already given up. One allgather (pickled
    by mpi4py) of None or (type, message) per call. Types other than MhaError, TypeError and
    ValueError reach the other ranks as RuntimeError."""
    try:
        result, failure, exc = prepare(), None, None
    except Exception as e:  # any failure, lest the other ranks wait for this one
        result, exc = None, e
        failure = (type(e).__name__, getattr(e, "status", STATUS_INVALID_ARG),
                   getattr(e, "message", str(e)))
    outcomes = comm.allgather(failure)
    for rank, f in enumerate(outcomes):
        if f is None:
            continue
        if exc is not None and rank == comm.Get_rank():
            raise exc
        kind, status, message = f
        text = f"rank {rank}: {message}"
        if kind == "MhaError":
            raise MhaError(status, text)
        raise {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)(text)
    return result


def forward(comm, cfg: mha_ring_config, args: L.mha_attention_args, ex: L.mha_exec) -> None:
    """mha_ring_attention_fcomm (collective); MhaError (the same on every rank) on failure."""
    err = L.mha_error()
    L.check(library().mha_ring_attention_fcomm(int(comm.py2f()), cfg, args, ex, err), err)


def backward(comm, cfg: mha_ring_config, args: L.mha_attention_args,
             grads: L.mha_attention_grads, ex: L.mha_exec) -> None:
    """mha_ring_attention_backward_fcomm (collective); MhaError on failure."""
    err = L.mha_error()
    L.check(library().mha_ring_attention_backward_fcomm(int(comm.py2f()), cfg, args, grads, ex,
                                                        err), err)


def layer_forward(comm, cfg: mha_ring_config, layer: int, args: L.mha_forward_args,
                  ex: L.mha_exec) -> None:
    """mha_ring_layer_forward_fcomm (collective); MhaError (the same on every rank) on failure."""
    err = L.mha_error()
    L.check(library().mha_ring_layer_forward_fcomm(int(comm.py2f()), cfg, layer, args, ex, err),
            err)


def layer_backward(comm, cfg: mha_ring_config, layer: int, args: L.mha_forward_args, dy: int,
                   grads: L.mha_layer_grads, ex: L.mha_exec) -> None:
    """mha_ring_layer_backward_fcomm (collective); MhaError on failure."""
    err = L.mha_error()
    L.check(library().mha_ring_layer_backward_fcomm(int(comm.py2f()), cfg, layer, args, dy, grads,
                                                     ex, err), err)


def shard_rows_of(seq_len: int, comm=None, shard_layout: str = "zigzag",
                  num_ranks: Optional[int] = None, rank: Optional[int] = None):
    """Global row indices of a rank's shard (see mha.shard_rows)."""
    import numpy as np
    if comm is not None:
        if num_ranks is not None or rank is not None:
            raise ValueError("shard_rows: give comm or (num_ranks, rank), not both")
        num_ranks, rank = comm_info(comm)
    elif num_ranks is None or rank is None:
        raise ValueError("shard_rows: give comm, or num_ranks and rank")
    chunks = shard_chunks(seq_len, num_ranks, rank, shard_layout)
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in chunks])
