# SPDX-License-Identifier: MIT
"""Ring attention over MPI for PyTorch: :func:`ring_attention` (exported as
``mha.torch.ring_attention``), a ``torch.autograd.Function`` whose forward is the NumPy API's
distributed :func:`mha.attention` (mha_ring_attention) and whose backward is the distributed
:func:`mha.attention_backward` (mha_ring_attention_backward), on zero-copy NumPy views of the
CPU float32 tensors. Both are collective over the communicator: every rank runs the forward, and
every rank's ``backward()`` must reach this node (as in any data- or context-parallel training
loop), else the others wait in the ring.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import _api, _mpi

__all__ = ["ring_attention"]

_F32 = torch.float32


def _np(t: Tensor) -> np.ndarray:
    """A NumPy view (no copy) of a CPU tensor; other float dtypes are converted to float32."""
    if not t.is_cpu:
        raise TypeError(f"mha.torch.ring_attention: tensors must be on the CPU, got {t.device}")
    if t.layout is not torch.strided:
        raise TypeError(f"mha.torch.ring_attention: expected dense (strided) tensors, got "
                        f"{t.layout}")
    if not t.is_floating_point():
        raise TypeError(f"mha.torch.ring_attention: expected floating-point tensors, got {t.dtype}")
    return t.detach().to(_F32).numpy()


def _shards(comm: Any, *tensors: Tensor):
    """The NumPy views of this rank's tensors, checked collectively: a tensor refused on one
    rank (wrong device or dtype) raises on every rank instead of leaving the others waiting in
    the ring (one allgather)."""
    _mpi.comm_info(comm)
    return _mpi.collective(comm, lambda: tuple(_np(t) for t in tensors))


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, options: dict, q: Tensor, k: Tensor, v: Tensor):
        out, lse = _api.attention(*_shards(options["comm"], q, k, v), return_lse=True,
                                  **options)
        out_t = torch.from_numpy(out)
        ctx.options = options
        ctx.save_for_backward(q, k, v, out_t, torch.from_numpy(lse))
        return out_t

    @staticmethod
    @once_differentiable  # (mha's backward is not differentiable: a double backward raises)
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        o = dict(ctx.options)
        dq, dk, dv = _api.attention_backward(*_shards(o["comm"], dout, q, k, v), out.numpy(),
                                             lse.numpy(), **o)
        need = ctx.needs_input_grad
        res = [torch.from_numpy(np.ascontiguousarray(g)) if need[i + 1] else None
               for i, g in enumerate((dq, dk, dv))]
        return (None, *res)


def ring_attention(query: Tensor, key: Tensor, value: Tensor, *, comm: Any, seq_len: int,
                   shard_layout: str = "zigzag", is_causal: bool = False,
                   scale: Optional[float] = None, softcap: Optional[float] = None,
                   window: Optional[Tuple[Optional[int], Optional[int]]] = None,
                   alibi: bool = False, threads: int = 0) -> Tensor:
    """Ring attention over MPI (collective over ``comm``, an mpi4py communicator), differentiable
    in query, key and value.

    Each rank passes its shard of a self-attention over ``seq_len`` (N) global rows, the rows
    :func:`mha.shard_rows` gives it for ``shard_layout``: query [B, h, n_local, d], key
    [B, g, n_local, d] and value [B, g, n_local, d_v] (g may divide h: GQA), CPU tensors
    (float32; other float dtypes are computed in float32). Returns the rank's rows of the output
    [B, h, n_local, d_v] (float32), equal to single-process attention on the whole sequence;
    its backward gives the rank's rows of the gradients. ``is_causal``: causal by global
    position; ``window=(left, right)``, ``softcap``, ``alibi`` and ``scale`` (None =
    1/sqrt(d)) as in :func:`mha.attention`. An error on any rank raises on every rank."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"mha.torch.ring_attention: expected [B, heads, n_local, d] tensors, got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    options = dict(comm=comm, seq_len=seq_len, shard_layout=shard_layout, causal=bool(is_causal),
                   scale=scale, softcap=softcap, window=window, alibi=alibi, threads=threads)
    return _RingFunction.apply(options, query, key, value)
