# SPDX-License-Identifier: MIT
"""Attention-map plots (matplotlib, imported only when a plot is drawn).

The same picture as ``mha run --plot`` (cli/cli_plot_cairo.c): one panel per head, token labels,
a colour bar with its scale, masked cells hatched grey (never the colour of probability 0), and a
bounded figure: maps with more than ``max_cells`` queries or keys are pooled into blocks (the mean
of the block's visible probabilities; a block's masked share shows as the hatching through it).
"""
from __future__ import annotations

import math
import operator
from typing import Optional, Sequence

import numpy as np

__all__ = ["plot_attention", "pool_map"]

MASKED_FACE = "#d7d7d7"  # the hatching's greys, as in the CLI's pictures
MASKED_HATCH = "#969696"
MAX_FIGURE_INCHES = 30.0  # per side: at dpi 100 a saved figure is at most 3000 x 3000 px


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


def _check_max_cells(max_cells) -> None:
    """An integer >= 1 (2.5 would cut the rows at floor(2.5 i / n): 3 cells, not the grid of 3)."""
    if isinstance(max_cells, bool) or not isinstance(max_cells, (int, np.integer)) or \
            max_cells < 1:
        raise ValueError(f"max_cells: expected an integer >= 1, got {max_cells!r}")


def pool_map(weights, masked=None, max_cells: int = 128):
    """Pools maps [h, n, m] into a grid of R = min(n, max_cells) x C = min(m, max_cells) cells:
    cell (r, c) holds the queries i with floor(i R / n) = r and the keys j with
    floor(j C / m) = c (the partition of the streamed statistics' pooled map, and of the CLI's).

    Returns (value, masked_fraction): value [h, R, C] is the mean of each cell's visible
    probabilities (0 where the cell is fully masked), masked_fraction [h, R, C] the share of its
    elements that are masked. masked: bool [h, n, m] (True = masked) or None (no mask). From the
    statistics' pooled (mean over all elements) and pooled_visible: value = pooled /
    pooled_visible, masked_fraction = 1 - pooled_visible."""
    _check_max_cells(max_cells)
    w = np.asarray(weights)
    h, n, m = w.shape
    R, C = min(n, max_cells), min(m, max_cells)
    row_start = np.searchsorted(np.arange(n) * R // n, np.arange(R))
    col_start = np.searchsorted(np.arange(m) * C // m, np.arange(C))
    mk = np.zeros((1, n, m), bool) if masked is None else np.broadcast_to(masked, w.shape)

    def cell_sums(a):
        return np.add.reduceat(np.add.reduceat(a, row_start, axis=1), col_start, axis=2)

    total = cell_sums(np.where(mk, 0.0, w).astype(np.float64))
    n_vis = cell_sums((~mk).astype(np.int64))
    rows, cols = np.diff(np.append(row_start, n)), np.diff(np.append(col_start, m))
    n_cells = rows[:, None] * cols[None, :]
    value = np.where(n_vis > 0, total / np.maximum(n_vis, 1), 0.0)
    return value, np.broadcast_to(1.0 - n_vis / n_cells, value.shape)


def _as_maps(weights):
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim == 4:
        if w.shape[0] != 1:
            raise ValueError(f"weights: give one batch row ([h, n, m]), got shape {w.shape}")
        w = w[0]
    if w.ndim == 2:
        w = w[None]
    if w.ndim != 3 or 0 in w.shape:
        raise ValueError(f"weights: expected [h, n, m] or [n, m], got shape {np.shape(weights)}")
    return w


def _head(i, h):
    """A head index of `heads`: an integer (1.7 is not head 1) in [0, h)."""
    if isinstance(i, bool):
        raise TypeError("heads: expected integers, got bool")
    try:
        i = operator.index(i)
    except TypeError:
        raise TypeError(f"heads: expected integers, got {type(i).__name__}") from None
    if not 0 <= i < h:
        raise ValueError(f"heads: {i} is not a head of {h}")
    return i


def _per_head(name, a, h, length):
    """A statistic given per head [h, length] or for all heads [length] -> [h, length]."""
    if a is None:
        return None
    a = np.asarray(a, dtype=np.float64)
    if a.ndim == 1:
        a = np.broadcast_to(a, (h, a.shape[0]))
    if a.shape != (h, length):
        raise ValueError(f"{name}: expected [{length}] or [{h}, {length}], got shape {a.shape}")
    return a


def _cell_mean(a, cells):
    """[h, L] -> [h, cells]: the mean over each cell of the pooling (floor(i cells / L) = cell)."""
    L = a.shape[1]
    start = np.searchsorted(np.arange(L) * cells // L, np.arange(cells))
    return np.add.reduceat(a, start, axis=1) / np.diff(np.append(start, L))


def _ticks(length, cells, labels, max_labels=32):
    """Tick positions (in cells) and texts: every label when they fit, else thinned; token labels
    only when the axis is not pooled (cells == length), indices 1, 2, 5 x 10^k apart otherwise."""
    if labels is not None and cells == length:
        step = max(1, -(-length // max_labels))
        idx = np.arange(0, length, step)
        return idx, [str(labels[i]) for i in idx]
    step = 1
    while -(-length // step) > max_labels:
        lead, decade = int(str(step)[0]), 10 ** (len(str(step)) - 1)
        step = (2 if lead == 1 else 5 if lead == 2 else 10) * decade
    idx = np.arange(0, length, step)
    return (idx + 0.5) * cells / length - 0.5, [str(i) for i in idx]


def _scale_top(value, frac, scale):
    if scale == "fixed":
        return 1.0, False
    vis = value[frac < 1.0]
    if vis.size == 0:
        return 1.0, False
    top = float(np.percentile(vis, 99, method="lower"))
    return (top if top > 0 else 1.0), bool(vis.max() > top)


def plot_attention(weights, tokens: Optional[Sequence[str]] = None,
                   key_tokens: Optional[Sequence[str]] = None, *, path: Optional[str] = None,
                   heads: Optional[Sequence[int]] = None, title: Optional[str] = None,
                   cmap: str = "viridis", annotate: Optional[bool] = None, cols: int = 4,
                   scale: str = "panel", masked=None, max_cells: int = 128,
                   received=None, entropy=None, visible=None, size=None, dpi: int = 100):
    """Draws one heatmap per head: rows are queries, columns keys, labelled with the tokens.

    weights: [h, n, m] (per head), [n, m] (one map, e.g. averaged), or [1, h, n, m] (batch of
    one), e.g. the probabilities of ``layer(x, need_weights=True)``. tokens: n query labels;
    key_tokens: m key labels (default: tokens when m == n). path: writes the figure there
    (.png, .svg, .pdf, ... by extension; at most 3000 x 3000 px at the default dpi 100).
    heads: which heads to draw. annotate: writes each probability in its cell (default: when the
    maps are at most 12 x 12). scale: "panel" (colours 0..the 99th percentile of each panel,
    larger values clipped to the top colour: a long diffuse map stays readable) or "fixed" (0..1,
    heads comparable). masked: bool, broadcastable to weights, True = masked; None takes the
    cells whose probability is exactly 0 as masked (the probabilities cannot tell a masked cell
    from an underflowed one); False: none. Masked cells are hatched grey. max_cells: maps with
    more queries or keys are pooled into blocks (see :func:`pool_map`). received: attention
    received per key, [m] or [h, m], drawn as a bar strip under each map; entropy: per query,
    [n] or [h, n], drawn as a bar strip right of each map (e.g. from the attention statistics).
    visible and size: weights is then a pooled map [h, R, C] of means over all the cell's elements
    (masked ones counting 0), visible [h, R, C] the visible share of each cell, and size = (n, m)
    the map's queries and keys (the "pooled", "pooled_visible" of ``mha.attention_stats``).
    Returns the matplotlib Figure (call ``.show()`` or ``.savefig()`` on it, or pass path).
    """
    if scale not in ("panel", "fixed"):
        raise ValueError(f"scale: '{scale}' is not 'panel' or 'fixed'")
    _check_max_cells(max_cells)
    w = _as_maps(weights)
    h, n, m = w.shape
    if visible is not None:
        if size is None or len(size) != 2 or not (size[0] >= n and size[1] >= m):
            raise ValueError(f"size: give the pooled map's (n, m), at least {(n, m)}, got {size}")
        vis = _as_maps(visible)
        if vis.shape != w.shape:
            raise ValueError(f"visible: expected shape {w.shape}, got {vis.shape}")
        n, m = int(size[0]), int(size[1])
    if tokens is not None and len(tokens) != n:
        raise ValueError(f"tokens: {len(tokens)} labels for {n} query rows")
    if key_tokens is None and tokens is not None and m == n:
        key_tokens = tokens
    if key_tokens is not None and len(key_tokens) != m:
        raise ValueError(f"key_tokens: {len(key_tokens)} labels for {m} key columns")
    if visible is not None:
        mk = None
    elif masked is None:
        mk = w == 0.0
    elif masked is False:
        mk = np.zeros(w.shape, bool)
    else:
        mk = np.broadcast_to(_as_maps(masked).astype(bool), w.shape)
    received = _per_head("received", received, h, m)
    entropy = _per_head("entropy", entropy, h, n)
    sel = list(range(h)) if heads is None else [_head(i, h) for i in heads]
    if not sel:
        raise ValueError("heads: no head to draw (an empty list)")
    if visible is None:
        value, frac = pool_map(w[sel], mk[sel], max_cells)
    else:  # already pooled: the mean over the visible elements, and the masked share
        v = vis[sel]
        value, frac = np.where(v > 0, w[sel] / np.where(v > 0, v, 1.0), 0.0), 1.0 - v
    R, C = value.shape[1:]
    if annotate is None:
        annotate = R <= 12 and C <= 12

    plt = _pyplot()
    cols = max(1, min(cols, len(sel)))
    rows = -(-len(sel) // cols)
    # A panel's inches grow with the grid up to 4.5 (then pooling bounds the cells), shrink so the
    # whole figure stays within MAX_FIGURE_INCHES; room for labels, bar, strips and the title.
    side = min(4.5, max(2.5, 0.32 * max(R, C)))
    extra_w = 1.6 + (1.0 if entropy is not None else 0.0) + (0.8 if scale == "panel" else 0.0)
    extra_h = 1.6 + (1.0 if received is not None else 0.0)
    side = min(side, MAX_FIGURE_INCHES / cols - extra_w, MAX_FIGURE_INCHES / rows - extra_h)
    side = max(side, 1.0)
    fig = plt.figure(figsize=(cols * (side + extra_w) + (0.8 if scale == "fixed" else 0.0),
                              rows * (side + extra_h) + (0.6 if title else 0.2)),
                     layout="constrained")
    outer = fig.add_gridspec(rows, cols)
    image = None
    for k, hd in enumerate(sel):
        image = _panel(fig, outer[k // cols, k % cols], hd, h, value[k], frac[k], n, m,
                       tokens, key_tokens, cmap, scale, annotate,
                       None if received is None else _cell_mean(received[hd:hd + 1], C)[0],
                       None if entropy is None else _cell_mean(entropy[hd:hd + 1], R)[0])
    if scale == "fixed":
        fig.colorbar(image, ax=fig.axes, shrink=0.8, label="probability")
    fig.suptitle(title or f"attention, {n} queries x {m} keys\n"
                 + (f"pooled: each cell the mean of ~{n / R:.3g} x {m / C:.3g}; "
                    if R < n or C < m else "")
                 + "hatched: masked", fontsize=11)
    if path:
        fig.savefig(path, dpi=dpi)
    return fig


def _panel(fig, spec, hd, h, value, frac, n, m, tokens, key_tokens, cmap, scale,
           annotate, received, entropy):
    """One head: the map (hatched background where masked), its ticks, optional strips."""
    from matplotlib.patches import Rectangle
    R, C = value.shape
    ax = fig.add_subplot(spec)
    top, clipped = _scale_top(value, frac, scale)
    # Masked cells: transparent over a hatched grey background; partly masked (pooled) blocks
    # let the hatching through in proportion to their masked share.
    ax.add_patch(Rectangle((-0.5, -0.5), C, R, facecolor=MASKED_FACE, edgecolor=MASKED_HATCH,
                           hatch="///", linewidth=0, zorder=0))
    alpha = np.clip(1.0 - frac, 0.0, 1.0)
    image = ax.imshow(value, cmap=cmap, vmin=0.0, vmax=top, alpha=alpha, aspect="equal",
                      interpolation="nearest", zorder=1)
    ax.set_title(f"head {hd}" if h > 1 else "attention", fontsize=11)
    yt, yl = _ticks(n, R, tokens)
    xt, xl = _ticks(m, C, key_tokens)
    ax.set_yticks(yt, yl, fontsize=8)
    ax.set_ylabel("query")
    if annotate:
        for i in range(R):
            for j in range(C):
                if frac[i, j] < 1.0:
                    ax.text(j, i, f"{value[i, j]:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if value[i, j] < 0.6 * top else "black", zorder=2)
    # The strips are inset axes of the map, so they keep its drawn width (or height) whatever
    # the aspect ratio does to it, and the layout makes room for them as for its labels.
    if received is not None:
        strip = ax.inset_axes([0.0, -0.27, 1.0, 0.22], sharex=ax)
        strip.bar(np.arange(C), received, width=1.0, color="#3b528b")
        strip.set_ylabel("received", fontsize=8)
        strip.tick_params(labelsize=7)
        ax.tick_params(labelbottom=False)
        strip.set_xticks(xt, xl, rotation=90, fontsize=8)
        strip.set_xlabel("key")
    else:
        ax.set_xticks(xt, xl, rotation=90, fontsize=8)
        ax.set_xlabel("key")
    if entropy is not None:
        strip = ax.inset_axes([1.03, 0.0, 0.22, 1.0], sharey=ax)
        strip.barh(np.arange(R), entropy, height=1.0, color="#21918c")
        strip.set_xlabel("entropy", fontsize=8)
        strip.tick_params(labelleft=False, labelsize=7)
    if scale == "panel":
        fig.colorbar(image, ax=ax, shrink=0.9, pad=0.2 if entropy is not None else 0.05,
                     label="probability" + (" (larger: top colour)" if clipped else ""))
    return image
