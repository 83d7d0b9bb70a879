# SPDX-License-Identifier: MIT
"""`mha run --plot FILE.png|.svg|.pdf` (drawn through cairo): the files parse (PNG signature, IHDR,
CRCs and zlib stream; SVG as XML; PDF header and trailer), have the expected size and one panel per
head, stay small and bounded for a 4096-token map (pooled), cells have the colour of their
probability (checked against --attn, pooled in NumPy with the causal mask for long maps: the
CLI draws the streamed statistics' pooled map), masked cells are hatched grey (a colour no
probability maps to), and bad --tokens files, a missing cairo and bad options
give one clear line and no file."""
import os
import re
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib

import numpy as np
import pytest

from test_cli import make_weights, write_safetensors  # the CLI tests' small file writers

CLI = os.environ.get("MHA_CLI", "mha")
# The colour scale of cli/cli_plot_cairo.c: 9 stops, linear between them; masked cells are
# hatched with these two greys.
SCALE = np.array([[13, 8, 60], [50, 30, 110], [60, 70, 140], [45, 110, 142], [33, 145, 140],
                  [60, 180, 115], [130, 205, 80], [200, 222, 50], [250, 231, 35]], float)
HATCH = (150, 215)
TOKENS = "The quick brown fox jumps over the lazy dog .".split()


def colour(p):
    x = min(max(p, 0.0), 1.0) * 8.0
    k = min(int(x), 7)
    t = x - k
    return SCALE[k] * (1 - t) + SCALE[k + 1] * t


def read_png(path):
    """Checks the PNG container (signature, chunk CRCs, IHDR, the zlib stream of the IDAT chunks)
    independently of the writer; the pixels are decoded by Pillow (matplotlib's dependency), whose
    decoder is not cairo's encoder. Returns pixels [h, w, 3]."""
    from PIL import Image
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w, h = 8, b"", None, None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        if kind == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and ctype in (2, 6)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert len(zlib.decompress(idat)) == h * (1 + w * (3 if ctype == 2 else 4))
    img = np.asarray(Image.open(path).convert("RGB")).astype(np.int32)
    assert img.shape == (h, w, 3)
    return img


def svg_info(path):
    root = ET.parse(path).getroot()  # well-formed XML or an exception
    assert root.tag.endswith("svg")
    w, h = (float(v) for v in root.get("viewBox").split()[2:])
    images = [e for e in root.iter() if e.tag.endswith("image")]
    return (w, h), len(images)


def pdf_info(path):
    data = open(path, "rb").read()
    assert data.startswith(b"%PDF-1.") and data.rstrip().endswith(b"%%EOF")
    assert b"startxref" in data[-200:]
    box = re.search(rb"/MediaBox \[ *0 0 ([0-9.]+) ([0-9.]+) *\]", data)
    return (float(box.group(1)), float(box.group(2))), len(re.findall(rb"/Subtype /Image", data))


@pytest.fixture
def case(tmp_path):
    rng = np.random.default_rng(7)
    write_safetensors(tmp_path / "W.safetensors", make_weights(rng))
    np.save(tmp_path / "X.npy", rng.standard_normal((1, 10, 16)).astype(np.float32))
    (tmp_path / "tok.txt").write_text("\n".join(TOKENS) + "\n")
    return tmp_path


def run(case, *extra, cli=CLI, x="X.npy", weights="W.safetensors", heads="4"):
    return subprocess.run([cli, "run", "--weights", case / weights, "--heads", heads,
                           "--input", case / x, "--out", case / "Y.npy", *extra],
                          capture_output=True, text=True, timeout=300)


def map_origin(img, cols):
    """Where the map of a single causal panel is: the hatched (fully masked) cells of query row 0
    are key columns 1..cols-1, so the first pixel row with a long run of hatching gives the cell
    size and the map's origin."""
    grey = (img[:, :, 0] == img[:, :, 1]) & (img[:, :, 1] == img[:, :, 2]) & \
        np.isin(img[:, :, 0], HATCH)
    y0 = np.nonzero(grey.sum(axis=1) >= 20)[0].min()
    run_start, best = None, (0, 0)
    for x in range(img.shape[1] + 1):  # the longest run of hatched pixels on that row
        if x < img.shape[1] and grey[y0, x]:
            run_start = x if run_start is None else run_start
        elif run_start is not None:
            best = max(best, (x - run_start, run_start))
            run_start = None
    width, start = best
    assert width % (cols - 1) == 0, (width, cols)
    cell = width // (cols - 1)
    return start - cell, y0, cell


def test_labelled_example_in_every_format(case):
    sizes = {}
    for ext in ("png", "svg", "pdf"):
        r = run(case, "--causal", "--plot", case / f"maps.{ext}", "--tokens", case / "tok.txt")
        assert r.returncode == 0, r.stderr
        assert os.path.getsize(case / f"maps.{ext}") < 300_000  # compressed (was 530 KB)
    img = read_png(case / "maps.png")
    sizes["png"] = (img.shape[1], img.shape[0])
    sizes["svg"], svg_panels = svg_info(case / "maps.svg")
    sizes["pdf"], pdf_panels = pdf_info(case / "maps.pdf")
    assert svg_panels == pdf_panels == 4  # one image per head
    assert sizes["png"] == sizes["svg"] == sizes["pdf"]  # one layout, 1 px = 1 pt
    w, h = sizes["png"]
    assert 4 * 300 < w < 2400 and 300 < h < 700  # four 10 x 10 panels in a row
    # Without --tokens: index labels, a narrower label margin (tokens are wider than "0".."9").
    r = run(case, "--causal", "--plot", case / "idx.png")
    assert r.returncode == 0, r.stderr
    assert read_png(case / "idx.png").shape[1] < w


def test_cells_have_the_colour_of_their_probability_and_masked_cells_are_hatched(case):
    r = run(case, "--causal", "--attn", case / "A.npy", "--attn-average", "--plot-scale", "fixed",
            "--plot", case / "mean.png", "--tokens", case / "tok.txt")
    assert r.returncode == 0, r.stderr
    p = np.load(case / "A.npy")[0]  # [n, m], the mean over heads
    img = read_png(case / "mean.png")
    x0, y0, cell = map_origin(img, 10)
    assert cell >= 20
    for i in range(10):
        for j in range(10):
            px = img[y0 + i * cell + cell // 2, x0 + j * cell + cell // 2]
            if j <= i:
                assert np.abs(px - colour(p[i, j])).max() <= 1, (i, j, px, p[i, j])
            else:  # masked: hatched grey, not the colour of probability 0
                assert px[0] == px[1] == px[2] and px[0] in HATCH, (i, j, px)
    # Without a mask no cell is hatched: only the legend's swatch has those greys.
    r = run(case, "--attn-average", "--plot", case / "full.png")
    assert r.returncode == 0, r.stderr
    img = read_png(case / "full.png")
    grey = (img[:, :, 0] == img[:, :, 1]) & np.isin(img[:, :, 0], HATCH)
    assert grey.sum() < 300


@pytest.mark.skipif(bool(os.environ.get("MHA_VALGRIND_CLI")),
                    reason="minutes under valgrind; the pooling's code runs in the n = 300 test")
def test_long_map_is_pooled_bounded_and_small(case):
    rng = np.random.default_rng(3)
    write_safetensors(case / "W2.safetensors", make_weights(rng, heads=2))
    np.save(case / "X4k.npy", rng.standard_normal((4096, 16)).astype(np.float32))
    for ext in ("png", "svg", "pdf"):
        r = run(case, "--causal", "--plot", case / f"long.{ext}", x="X4k.npy",
                weights="W2.safetensors", heads="2")
        assert r.returncode == 0, r.stderr
        assert os.path.getsize(case / f"long.{ext}") < 400_000
    img = read_png(case / "long.png")
    w, h = img.shape[1], img.shape[0]
    assert (w, h) == svg_info(case / "long.svg")[0] == pdf_info(case / "long.pdf")[0]
    assert svg_info(case / "long.svg")[1] == pdf_info(case / "long.pdf")[1] == 2
    assert w < 1400 and h < 700  # two panels of at most 384 x 384, whatever n is


def test_pooled_cells_have_the_colour_of_their_visible_mean(case):
    """n = 300 pools into 128 x 128 cells, cell r holding the queries i with floor(128 i / 300) = r
    (2 or 3 of them; the partition of mha_attention_stats' pooled map); a cell's colour is the
    mean of its visible probabilities (from --attn, in NumPy), blended toward the hatching by its
    masked share."""
    rng = np.random.default_rng(5)
    np.save(case / "X300.npy", rng.standard_normal((300, 16)).astype(np.float32))
    r = run(case, "--causal", "--attn", case / "A.npy", "--attn-average", "--plot-scale", "fixed",
            "--plot", case / "pooled.png", x="X300.npy")
    assert r.returncode == 0, r.stderr
    p = np.load(case / "A.npy").astype(np.float64)  # [300, 300]
    img = read_png(case / "pooled.png")
    x0, y0, cell = map_origin(img, 128)
    assert cell == 3
    cell_of = np.arange(300) * 128 // 300
    for r_, c_ in [(0, 0), (5, 2), (50, 49), (127, 0), (127, 126), (70, 30), (30, 30), (64, 64)]:
        rows, cols = np.nonzero(cell_of == r_)[0], np.nonzero(cell_of == c_)[0]
        b = p[np.ix_(rows, cols)]
        vis = b[cols[None, :] <= rows[:, None]]  # the causal mask itself, not the zeros of p
        f = 1 - vis.size / b.size
        y, x = y0 + r_ * cell, x0 + c_ * cell  # the block's top-left pixel
        g = HATCH[0] if (x - x0 + y - y0) % 8 < 2 else HATCH[1]
        want = (1 - f) * colour(vis.mean()) + f * g
        assert np.abs(img[y, x] - want).max() <= 1, (r_, c_, img[y, x], want)


def test_average_of_heads_with_their_own_masks(case):
    """--attn-average with a --mask that differs between heads (head 0 sees the even keys, head 1
    the odd ones): an element of the mean is visible when some head sees it, so no pooled cell of
    the causal map's lower triangle is masked. The plot took each cell's largest per-head
    visible share instead: (70, 30) was drawn half hatched at twice its mean (0.0060 for 0.0030)."""
    rng = np.random.default_rng(5)
    write_safetensors(case / "W2.safetensors", make_weights(rng, heads=2))
    np.save(case / "X300.npy", rng.standard_normal((300, 16)).astype(np.float32))
    j = np.arange(300)
    for dtype, means in ((bool, "attend"), (np.float32, None), (np.int32, "block")):
        head0 = j % 2 == 0 if means != "block" else j % 2 == 1  # head 0 sees the even keys
        mask = np.stack([np.broadcast_to(head0, (300, 300)), np.broadcast_to(~head0, (300, 300))])
        if dtype is np.float32:
            mask = np.where(mask, 0.0, -np.inf)
        np.save(case / "M.npy", mask.astype(dtype))
        extra = ("--mask-means", means) if means else ()
        r = run(case, "--causal", "--mask", case / "M.npy", *extra, "--attn", case / "A.npy",
                "--attn-average", "--plot-scale", "fixed", "--plot", case / "mean.png",
                x="X300.npy", weights="W2.safetensors", heads="2")
        assert r.returncode == 0, r.stderr
        p = np.load(case / "A.npy").astype(np.float64)
        img = read_png(case / "mean.png")
        x0, y0, cell = map_origin(img, 128)
        cell_of = np.arange(300) * 128 // 300
        for r_, c_ in [(5, 2), (50, 49), (70, 30), (127, 0), (100, 100)]:
            rows, cols = np.nonzero(cell_of == r_)[0], np.nonzero(cell_of == c_)[0]
            b = p[np.ix_(rows, cols)]
            vis = cols[None, :] <= rows[:, None]  # causal only: every key is some head's
            f = 1 - vis.mean()
            y, x = y0 + r_ * cell, x0 + c_ * cell
            g = HATCH[0] if (x - x0 + y - y0) % 8 < 2 else HATCH[1]
            want = (1 - f) * colour(b[vis].mean()) + f * g
            assert np.abs(img[y, x] - want).max() <= 1, (dtype, r_, c_, img[y, x], want)


def test_tokens_file_errors(case):
    bad = {
        "short.txt": (b"a\nb\n", "2 tokens (lines), but the map has 10 queries"),
        "long.txt": ("\n".join(TOKENS + ["extra"]).encode(), "11 tokens"),
        "utf8.txt": (b"\n".join([b"ok"] * 3 + [b"\xff\xfe"] + [b"ok"] * 6), "line 4"),
        "ctrl.txt": (b"\n".join([b"ok"] * 5 + [b"a\x1b[31mred"] + [b"ok"] * 4), "line 6"),
        "nul.txt": (b"\n".join([b"ok"] * 9 + [b"a\x00b"]), "NUL"),
    }
    for name, (data, why) in bad.items():
        (case / name).write_bytes(data)
        r = run(case, "--plot", case / "maps.png", "--tokens", case / name)
        assert r.returncode == 1 and name in r.stderr and why in r.stderr, (name, r.stderr)
        assert len(r.stderr.splitlines()) == 1 and "\x1b" not in r.stderr
        assert not (case / "maps.png").exists() and not (case / "Y.npy").exists()
    r = run(case, "--plot", case / "maps.png", "--tokens", case / "missing.txt")
    assert r.returncode == 1 and "missing.txt" in r.stderr
    # CR LF line ends and no final newline are accepted; UTF-8 tokens too.
    (case / "crlf.txt").write_bytes("\r\n".join(TOKENS[:9] + ["chat\u00e9"]).encode())
    r = run(case, "--plot", case / "maps.png", "--tokens", case / "crlf.txt")
    assert r.returncode == 0, r.stderr


def test_plot_option_errors_leave_no_file(case):
    r = run(case, "--plot", case / "maps.jpg")  # a usage error, found before any work
    assert r.returncode == 2 and "maps.jpg" in r.stderr and len(r.stderr.splitlines()) == 1
    r = run(case, "--plot", case / "missing_dir" / "m.svg")
    assert r.returncode == 1 and "m.svg" in r.stderr
    r = run(case, "--tokens", case / "tok.txt")
    assert r.returncode == 2 and "--tokens needs --plot" in r.stderr
    r = run(case, "--plot", case / "m.png", "--plot-scale", "log")
    assert r.returncode == 2 and "'log' is not panel or fixed" in r.stderr
    r = run(case, "--plot", case / "tok.txt", "--tokens", case / "tok.txt")  # output = input
    assert r.returncode != 0 and "tok.txt" in r.stderr
    assert sorted(os.listdir(case)) == ["W.safetensors", "X.npy", "tok.txt"]


def test_plot_without_cairo_says_so(case):
    """The program built without cairo (MHA_CLI_NOCAIRO, built beside the usual one) refuses
    --plot up front, naming the reason; everything else still works."""
    cli = os.environ.get("MHA_CLI_NOCAIRO")
    if not cli:
        pytest.skip("no program built without cairo (MHA_CLI_NOCAIRO)")
    r = run(case, "--plot", case / "maps.png", cli=cli)
    assert r.returncode == 2 and "built without cairo" in r.stderr and "maps.png" in r.stderr
    assert len(r.stderr.splitlines()) == 1
    assert sorted(os.listdir(case)) == ["W.safetensors", "X.npy", "tok.txt"]
    assert run(case, cli=cli).returncode == 0
    info = subprocess.run([cli, "info"], capture_output=True, text=True, timeout=60).stdout
    assert "plots (run --plot): unavailable, built without cairo" in info
    info = subprocess.run([CLI, "info"], capture_output=True, text=True, timeout=600).stdout
    assert "plots (run --plot): cairo 1." in info
