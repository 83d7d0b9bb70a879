# SPDX-License-Identifier: MIT
"""`mha run --plot FILE.svg|FILE.png`: the attention maps as an image, checked against the
probabilities the same run writes with --attn (pixel colours of the PNG, values in the SVG)."""
import os
import re
import struct
import subprocess
import zlib

import numpy as np
import pytest

from test_cli import make_weights, write_safetensors  # the CLI tests' small file writers

CLI = os.environ.get("MHA_CLI", "mha")
# The colour scale of cli/cli_plot.c: 9 stops, linear between them.
SCALE = np.array([[13, 8, 60], [50, 30, 110], [60, 70, 140], [45, 110, 142], [33, 145, 140],
                  [60, 180, 115], [130, 205, 80], [200, 222, 50], [250, 231, 35]], float)


def colour(p):
    x = min(max(p, 0.0), 1.0) * 8.0
    k = min(int(x), 7)
    t = x - k
    return np.floor(SCALE[k] * (1 - t) + SCALE[k + 1] * t + 0.5)


def read_png(path):
    """Minimal PNG reader (8-bit RGB, filter 0), independent of the writer's code."""
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
            assert (depth, ctype) == (8, 2)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)  # checks the Adler-32 too
    rows = np.frombuffer(raw, np.uint8).reshape(h, 1 + 3 * w)
    assert np.all(rows[:, 0] == 0)
    return rows[:, 1:].reshape(h, w, 3)


@pytest.fixture
def case(tmp_path):
    rng = np.random.default_rng(7)
    write_safetensors(tmp_path / "W.safetensors", make_weights(rng))
    np.save(tmp_path / "X.npy", rng.standard_normal((2, 6, 16)).astype(np.float32))
    return tmp_path


def run(case, *extra):
    return subprocess.run([CLI, "run", "--weights", case / "W.safetensors", "--heads", "4",
                           "--input", case / "X.npy", "--out", case / "Y.npy", *extra],
                          capture_output=True, text=True, timeout=60)


def test_png_cells_have_the_colour_of_their_probability(case):
    r = run(case, "--causal", "--attn", case / "A.npy", "--plot", case / "maps.png")
    assert r.returncode == 0, r.stderr
    probs = np.load(case / "A.npy")[0]  # batch row 0: [h, n, m]
    img = read_png(case / "maps.png")
    cell, gap = 16, 12  # n, m <= 32 use 16-pixel cells; 12-pixel gaps
    for h in range(4):
        for i in range(6):
            for j in range(6):
                y = gap + i * cell + cell // 2
                x = gap + h * (6 * cell + gap) + j * cell + cell // 2
                assert np.array_equal(img[y, x], colour(probs[h, i, j])), (h, i, j)


def test_svg_averaged_lists_every_cell_value(case):
    r = run(case, "--attn", case / "A.npy", "--attn-average", "--plot", case / "maps.svg")
    assert r.returncode == 0, r.stderr
    probs = np.load(case / "A.npy")[0]  # [n, m]
    svg = open(case / "maps.svg").read()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    values = [(int(i), int(j), float(p)) for i, j, p in
              re.findall(r"<title>q (\d+), k (\d+): ([0-9.]+)</title>", svg)]
    assert len(values) == 36
    for i, j, p in values:
        assert abs(p - probs[i, j]) <= 5e-5


def test_plot_errors_leave_no_file(case):
    r = run(case, "--plot", case / "maps.jpg")  # a usage error, found before any work
    assert r.returncode == 2 and "maps.jpg" in r.stderr and len(r.stderr.splitlines()) == 1
    r = run(case, "--plot", case / "missing_dir" / "m.svg")
    assert r.returncode == 1 and "m.svg" in r.stderr
    assert sorted(os.listdir(case)) == ["W.safetensors", "X.npy"]
