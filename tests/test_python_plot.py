# SPDX-License-Identifier: MIT
"""mha.plot_attention (matplotlib): the labelled 10-token example and a 4096-token pooled map
written as PNG, SVG and PDF parse, have the expected pixel size and panel count and stay small;
masked cells are hatched (transparent over the hatched patch, never annotated "0.00"); pooling
equals the block means computed here; token labels do not reach the neighbouring panel; the
statistics strips have one bar per key / query; the streamed statistics (mha.attention_stats)
draw like the dense map; bad arguments raise."""
import os
import re
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import mha  # noqa: E402
from mha.plot import pool_map  # noqa: E402
from tolerances import TOL_PROBS_ABS  # noqa: E402

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
TOKENS = "The quick brown fox jumps over the lazy dog .".split()


def causal_probs(rng, h, n, dtype=np.float64):
    s = rng.standard_normal((h, n, n)) * 2
    s[:, np.triu(np.ones((n, n), bool), 1)] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)).astype(dtype)


def png_size(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def map_axes(fig):
    return [ax for ax in fig.axes if ax.get_images()]


def test_labelled_example_in_every_format(tmp_path):
    p = causal_probs(np.random.default_rng(1), 2, 10)
    fig = mha.plot_attention(p, TOKENS, path=str(tmp_path / "a.png"))
    assert len(map_axes(fig)) == 2
    for ext in ("png", "svg", "pdf"):
        if ext != "png":
            fig.savefig(tmp_path / f"a.{ext}", dpi=100)
        assert (tmp_path / f"a.{ext}").stat().st_size < 300_000
    w, h = png_size(tmp_path / "a.png")
    fw, fh = fig.get_size_inches() * 100  # dpi 100
    assert (w, h) == (round(fw), round(fh)) and w < 3000 and h < 3000
    root = ET.parse(tmp_path / "a.svg").getroot()  # well-formed XML
    # One image per head and one per colour bar (the per-panel scale gives each head its own).
    assert len([e for e in root.iter() if e.tag.endswith("image")]) == 2 * 2
    pdf = open(tmp_path / "a.pdf", "rb").read()
    assert pdf.startswith(b"%PDF-") and pdf.rstrip().endswith(b"%%EOF")
    # In the PDF each map also has its soft mask (the alpha that makes masked cells transparent).
    assert len(re.findall(rb"/Subtype\s*/Image", pdf)) == 2 * 3
    ax = map_axes(fig)[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == TOKENS
    assert [t.get_text() for t in ax.get_xticklabels()] == TOKENS


def test_masked_cells_are_hatched_not_zero(tmp_path):
    p = causal_probs(np.random.default_rng(2), 1, 6)
    p[0, 5, 2] = 0.0  # a real zero below the diagonal: drawn as masked unless masked= says
    fig = mha.plot_attention(p, annotate=True)
    ax = map_axes(fig)[0]
    alpha = ax.get_images()[0].get_alpha()
    masked = np.triu(np.ones((6, 6), bool), 1)
    assert np.all(alpha[masked] == 0) and alpha[5, 2] == 0
    assert any(patch.get_hatch() for patch in ax.patches)
    texts = [t.get_text() for t in ax.texts]
    assert len(texts) == 21 - 1  # visible cells only: masked ones are not "0.00"
    mask = np.triu(np.ones((6, 6), bool), 1)  # the true mask: the real zero is a visible 0.00
    fig = mha.plot_attention(p, masked=mask, annotate=True)
    ax = map_axes(fig)[0]
    assert ax.get_images()[0].get_alpha()[5, 2] == 1 and len(ax.texts) == 21


def test_long_map_is_pooled_bounded_and_small(tmp_path):
    p = causal_probs(np.random.default_rng(3), 1, 4096, np.float32)
    fig = mha.plot_attention(p, path=str(tmp_path / "long.png"))
    for ext in ("png", "svg", "pdf"):
        if ext != "png":
            fig.savefig(tmp_path / f"long.{ext}", dpi=100)
        assert (tmp_path / f"long.{ext}").stat().st_size < 500_000
    assert map_axes(fig)[0].get_images()[0].get_array().shape == (128, 128)
    w, h = png_size(tmp_path / "long.png")
    assert w < 1200 and h < 1200  # was 18899 x 8644 px for n = 256, 2 heads
    root = ET.parse(tmp_path / "long.svg").getroot()
    assert len([e for e in root.iter() if e.tag.endswith("image")]) == 2  # map + colour bar
    # n = 256, 2 heads (the case): bounded too.
    mha.plot_attention(causal_probs(np.random.default_rng(4), 2, 256), path=str(tmp_path / "b.png"))
    assert max(png_size(tmp_path / "b.png")) < 2000


def test_pool_map_is_the_mean_of_visible_cells():
    """30 x 30 maps into 8 x 8 cells, cell r holding the queries i with floor(8 i / 30) = r."""
    rng = np.random.default_rng(5)
    p = causal_probs(rng, 2, 30)
    value, frac = pool_map(p, p == 0, max_cells=8)
    assert value.shape == frac.shape == (2, 8, 8)
    cell_of = np.arange(30) * 8 // 30
    for hd, r, c in [(0, 0, 0), (1, 3, 2), (0, 7, 7), (1, 7, 0), (0, 2, 5), (1, 4, 4)]:
        b = p[hd][np.ix_(cell_of == r, cell_of == c)]
        vis = b[b != 0]
        assert frac[hd, r, c] == pytest.approx(1 - vis.size / b.size)
        assert value[hd, r, c] == pytest.approx(vis.mean() if vis.size else 0.0)


def test_pooled_map_given_with_its_visible_share():
    """The streamed statistics' pooled map (mean over all elements) and visible share draw as the
    dense map pooled here: the same cells, the same masked fractions."""
    p = causal_probs(np.random.default_rng(9), 2, 300)
    value, frac = pool_map(p, p == 0)
    vis = 1.0 - frac
    fig = mha.plot_attention(value * vis, visible=vis, size=(300, 300))
    dense = mha.plot_attention(p)
    for a, b in zip(map_axes(fig), map_axes(dense)):
        ia, ib = a.get_images()[0], b.get_images()[0]
        assert np.allclose(ia.get_array(), ib.get_array())
        assert np.allclose(ia.get_alpha(), ib.get_alpha())
        assert [t.get_text() for t in a.get_yticklabels()] == \
            [t.get_text() for t in b.get_yticklabels()]
    with pytest.raises(ValueError, match="size"):
        mha.plot_attention(value, visible=vis)


def test_streamed_statistics_draw_like_the_dense_map():
    """mha.attention_stats' pooled map (no n x m matrix) drawn with visible= equals the dense
    probabilities of mha.attention pooled here, with the exact mask (a window: masked cells are
    known, not guessed from zeros); received and entropy go to the strips."""
    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal((1, 2, 300, 8)).astype(np.float32) for _ in range(3))
    opts = dict(causal=True, window=(40, 0))
    st = mha.attention_stats(q, k, stats="received,entropy,pool=128x128", **opts)
    _, p = mha.attention(q, k, v, need_weights=True, **opts)
    fig = mha.plot_attention(st["pooled"][0], visible=st["pooled_visible"][0], size=(300, 300),
                             received=st["received"][0], entropy=st["entropy"][0])
    dense = mha.plot_attention(p[0])
    for hd, (a, b) in enumerate(zip(map_axes(fig), map_axes(dense))):
        ia, ib = a.get_images()[0], b.get_images()[0]
        vis = st["pooled_visible"][0, hd].astype(np.float64)
        # Each probability is within TOL_PROBS_ABS on both paths; the streamed mean over all the
        # cell's elements is divided by its visible share to give the mean over the visible ones.
        bound = TOL_PROBS_ABS * (1 + 1 / np.where(vis > 0, vis, 1))
        assert np.all(np.abs(np.asarray(ia.get_array()) - np.asarray(ib.get_array())) <= bound)
        # The same masked shares (the statistics give them in float32: its rounding only).
        assert np.abs(ia.get_alpha() - ib.get_alpha()).max() <= np.finfo(np.float32).eps
        assert len(a.child_axes) == 2


def test_labels_stay_in_their_panel(tmp_path):
    long_tokens = [f"token_number_{i}_is_long" for i in range(12)]
    p = causal_probs(np.random.default_rng(6), 4, 12)
    fig = mha.plot_attention(p, long_tokens, scale="fixed")
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    boxes = [ax.get_tightbbox(r) for ax in map_axes(fig)]
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            assert not boxes[i].overlaps(boxes[j]), (i, j)


def test_statistics_strips():
    rng = np.random.default_rng(7)
    p = causal_probs(rng, 2, 10)
    ent = -(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0)).sum(-1)
    fig = mha.plot_attention(p, TOKENS, received=p.sum(1), entropy=ent)
    bars = [len(s.patches) for ax in map_axes(fig) for s in ax.child_axes]  # the strips
    assert sorted(bars) == [10, 10, 10, 10]  # per head: 10 keys, 10 queries
    with pytest.raises(ValueError, match="received"):
        mha.plot_attention(p, received=np.ones(9))


def test_bad_arguments_raise():
    p = causal_probs(np.random.default_rng(8), 2, 3)
    with pytest.raises(ValueError, match="tokens"):
        mha.plot_attention(p, ["only", "two"])
    with pytest.raises(ValueError, match="scale"):
        mha.plot_attention(p, scale="log")
    with pytest.raises(ValueError, match="heads"):
        mha.plot_attention(p, heads=[2])
    # An empty list was a ZeroDivisionError; 1.7 drew head 1; max_cells=2.5 pooled into floor
    # division cells of a grid no integer gives.
    with pytest.raises(ValueError, match="heads: no head"):
        mha.plot_attention(p, heads=[])
    with pytest.raises(TypeError, match="heads"):
        mha.plot_attention(p, heads=[1.7])
    with pytest.raises(ValueError, match="max_cells"):
        mha.plot_attention(p, max_cells=2.5)
    # pool_map itself: max_cells=0 returned an empty grid, 2.5 a 3 x 3 grid other than 3's.
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="max_cells"):
            pool_map(p, max_cells=bad)
    assert [a.get_title() for a in map_axes(mha.plot_attention(p, heads=[np.int64(1)]))] == \
        ["head 1"]
    with pytest.raises(ValueError, match="weights"):
        mha.plot_attention(np.zeros((2, 1, 3, 3)))


def test_readme_example_saves_a_figure(tmp_path):
    """The README's lines, run as a script: plot_attention(w[0], tokens, path=...) writes it."""
    script = tmp_path / "readme.py"
    script.write_text(
        "import sys, numpy as np\n"
        f"sys.path.insert(0, {os.path.join(SRC, 'python')!r})\n"
        "import mha\n"
        "tokens = ['she', 'loves', 'cats']\n"
        "w = np.random.default_rng(0).dirichlet(np.ones(3), size=(1, 2, 3))\n"
        "mha.plot_attention(w[0], tokens, path='attention.png')\n")
    subprocess.run([sys.executable, str(script)], cwd=tmp_path, check=True,
                   env={k: v for k, v in os.environ.items() if k != "MPLBACKEND"})
    assert png_size(tmp_path / "attention.png")[0] > 100
