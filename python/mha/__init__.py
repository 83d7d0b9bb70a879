# SPDX-License-Identifier: MIT
"""mha: exact and fast multi-head attention on the CPU, from Python.

NumPy API (float32; float64/float16 inputs are converted; any memory order):

    import mha
    layer = mha.MultiheadAttention(w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o, num_heads=8)
    y = layer(x, causal=True)                        # [B, n, q_dim] -> [B, n, out_dim]
    y, w = layer(x, need_weights=True)               # attention weights [B, h, n, m]
    o = mha.attention(q, k, v, mask=m)               # the core on projected Q/K/V [B, h, L, d]
    st = mha.attention_stats(q, k, stats="received,entropy,topk=8,pool=256x256")  # no n x m
    x2 = mha.rope(x, positions, style="half")        # RoPE alone
    o = mha.attention(q_shard, k_shard, v_shard, comm=MPI.COMM_WORLD, seq_len=N)  # ring (MPI)

PyTorch drop-ins (optional, imported lazily): ``mha.torch.MultiheadAttention`` and
``mha.torch.scaled_dot_product_attention``. JAX (optional, lazily, through XLA's FFI):
``mha.jax.dot_product_attention`` and ``mha.equinox.MultiheadAttention``. Plots:
``mha.plot_attention`` (matplotlib).
The contract (mask polarity, causal alignment, RoPE styles, ...) is docs/SEMANTICS.md; the
Python API is docs/PYTHON.md. Errors from the library raise :class:`MhaError`.
"""
from __future__ import annotations

import importlib
from typing import Any

from . import _lib
from ._api import (Config, KVCache, MultiheadAttention, QKNorm, Rope, TrainState, attention,
                   attention_backward, attention_stats, rope, rope_frequencies, shard_rows)
from ._lib import MhaError

# The version is written once, in include/mha.h; the package's is the library's (the wheel's
# metadata reads the same header at build time: python/version_from_header.py).
__version__: str = _lib.version()

library_path: str = _lib.library_path


def library_version() -> str:
    """Version of the loaded C library (``__version__``)."""
    return _lib.version()


def plot_attention(*args: Any, **kwargs: Any):
    """Per-head attention heatmaps with token labels; see :func:`mha.plot.plot_attention`."""
    from .plot import plot_attention as _plot
    return _plot(*args, **kwargs)


def __getattr__(name: str):
    # `mha.torch`, `mha.jax`, `mha.equinox` and `mha.plot` are imported on first use, so that
    # neither torch, jax nor matplotlib is needed to import mha.
    if name in ("torch", "jax", "equinox", "plot"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'mha' has no attribute {name!r}")


__all__ = ["MhaError", "Config", "Rope", "QKNorm", "MultiheadAttention", "TrainState", "KVCache",
           "attention", "attention_backward", "attention_stats", "rope", "rope_frequencies",
           "shard_rows",
           "plot_attention",
           "library_version", "library_path", "__version__"]
