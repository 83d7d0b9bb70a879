# SPDX-License-Identifier: MIT
"""Attention-map plots (matplotlib, imported only when a plot is drawn)."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

__all__ = ["plot_attention"]


def _pyplot():
    try:
        import matplotlib
        if matplotlib.get_backend().lower() not in ("agg", "svg", "pdf") and \
                not _has_display():
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("mha.plot_attention needs matplotlib: pip install matplotlib "
                          "(or pip install './python[plot]')") from e
    return plt


def _has_display() -> bool:
    import os
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def plot_attention(weights, tokens: Optional[Sequence[str]] = None,
                   key_tokens: Optional[Sequence[str]] = None, *, path: Optional[str] = None,
                   heads: Optional[Sequence[int]] = None, title: Optional[str] = None,
                   cmap: str = "viridis", annotate: Optional[bool] = None, cols: int = 4):
    """Draws one heatmap per head: rows are queries, columns keys, labelled with the tokens.

    weights: [h, n, m] (per head), [n, m] (one map, e.g. averaged), or [1, h, n, m] (batch of
    one), e.g. the probabilities of ``layer(x, need_weights=True)``. tokens: n query labels;
    key_tokens: m key labels (default: tokens when m == n). path: writes the figure there
    (.png, .svg, .pdf, ... by extension). annotate: writes each probability in its cell
    (default: when the maps are at most 12 x 12). Returns the matplotlib Figure.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim == 4:
        if w.shape[0] != 1:
            raise ValueError(f"weights: give one batch row ([h, n, m]), got shape {w.shape}")
        w = w[0]
    if w.ndim == 2:
        w = w[None]
    if w.ndim != 3:
        raise ValueError(f"weights: expected [h, n, m] or [n, m], got shape {np.shape(weights)}")
    h, n, m = w.shape
    if tokens is not None and len(tokens) != n:
        raise ValueError(f"tokens: {len(tokens)} labels for {n} query rows")
    if key_tokens is None and tokens is not None and m == n:
        key_tokens = tokens
    if key_tokens is not None and len(key_tokens) != m:
        raise ValueError(f"key_tokens: {len(key_tokens)} labels for {m} key columns")
    sel = list(range(h)) if heads is None else list(heads)
    if annotate is None:
        annotate = n <= 12 and m <= 12
    plt = _pyplot()
    cols = max(1, min(cols, len(sel)))
    rows = (len(sel) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(0.45 * m * cols + 1.5, 0.45 * n * rows + 1.2),
                             squeeze=False)
    for ax in axes.flat[len(sel):]:
        ax.axis("off")
    for ax, hd in zip(axes.flat, sel):
        im = ax.imshow(w[hd], cmap=cmap, vmin=0.0, vmax=1.0, aspect="equal")
        ax.set_title(f"head {hd}" if h > 1 else "attention")
        ax.set_xticks(range(m))
        ax.set_yticks(range(n))
        ax.set_xticklabels(key_tokens if key_tokens is not None else range(m), rotation=60,
                           ha="right")
        ax.set_yticklabels(tokens if tokens is not None else range(n))
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        if annotate:
            for i in range(n):
                for j in range(m):
                    ax.text(j, i, f"{w[hd, i, j]:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if w[hd, i, j] < 0.6 else "black")
    fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
    if title:
        fig.suptitle(title)
    if path:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    return fig
