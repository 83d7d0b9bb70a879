#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Writes the seed corpora of the fuzzers (fuzz/corpus/<harness>/), small valid and invalid
inputs, a few KB per harness. Deterministic; standard library only. Rerun after changing it:
    python3 fuzz/make_seeds.py
"""
import json
import os
import random
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def out(harness, name, data):
    d = os.path.join(HERE, "corpus", harness)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def npy(descr, shape, data, major=1, fortran=False, pad=True):
    shape_text = "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
    d = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (descr, fortran, shape_text)
    pre = 10 if major == 1 else 12
    if pad:
        total = (pre + len(d) + 1 + 63) // 64 * 64
        d = d + " " * (total - pre - len(d) - 1) + "\n"
    h = d.encode("latin1")
    ln = struct.pack("<H", len(h)) if major == 1 else struct.pack("<I", len(h))
    return b"\x93NUMPY" + bytes([major, 0]) + ln + h + data


def safetensors(tensors, meta=True, pad=True):
    header, blob = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(blob), len(blob) + len(raw)]}
        blob += raw
    if meta:
        header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + blob


def f32(vals):
    return struct.pack("<%df" % len(vals), *vals)


def main():
    rng = random.Random(7)
    # ---- npy
    out("npy", "f32_2x3", npy("<f4", (2, 3), f32([0.5 * i for i in range(6)])))
    out("npy", "f64_4", npy("<f8", (4,), struct.pack("<4d", 1, 2, 3, 4)))
    out("npy", "f16_scalar", npy("<f2", (), struct.pack("<e", 1.5)))
    out("npy", "bool_3", npy("|b1", (3,), b"\x01\x00\x01"))
    out("npy", "i64_2x1", npy("<i8", (2, 1), struct.pack("<2q", -1, 7)))
    out("npy", "i32_v2", npy("<i4", (2,), struct.pack("<2i", 3, 4), major=2))
    out("npy", "u8_v3_raw", npy("|u1", (0, 5), b"", major=3, pad=False))
    out("npy", "fortran", npy("<f4", (2, 2), f32([1, 2, 3, 4]), fortran=True))
    out("npy", "bigendian", npy(">f4", (1,), b"\0\0\x80\x3f"))
    out("npy", "truncated", npy("<f4", (4, 4), f32([1] * 5)))
    out("npy", "bad_magic", b"\x93NUMPX\x01\x00\x10\x00{}")
    # ---- safetensors: small layers under each naming scheme (q_dim 4; --heads 1 or 2)
    def w(rows, cols):
        return ("F32", [rows, cols], f32([rng.uniform(-0.5, 0.5) for _ in range(rows * cols)]))

    out("safetensors", "hf", safetensors({"q_proj.weight": w(4, 4), "k_proj.weight": w(4, 4),
                                          "v_proj.weight": w(4, 4), "o_proj.weight": w(4, 4),
                                          "q_proj.bias": ("F32", [4], f32([0.1] * 4))}))
    out("safetensors", "torch_packed", safetensors({"in_proj_weight": w(12, 4),
                                                    "in_proj_bias": ("F32", [12], f32([0] * 12)),
                                                    "out_proj.weight": w(4, 4),
                                                    "out_proj.bias": ("F32", [4], f32([0] * 4))}))
    out("safetensors", "cs336_f16", safetensors({
        "q_proj_weight": ("F16", [2, 2], struct.pack("<4e", 1, 0.5, -1, 2)),
        "k_proj_weight": ("BF16", [2, 2], b"\x80\x3f\x00\x40\x00\xbf\x00\x00"),
        "v_proj_weight": ("F64", [2, 2], struct.pack("<4d", 1, 2, 3, 4)),
        "o_proj_weight": ("F32", [2, 2], f32([1, 0, 0, 1])), "sinks": ("F32", [1], f32([0.5]))},
        meta=False))
    out("safetensors", "gqa", safetensors({"q_proj.weight": w(4, 2), "k_proj.weight": w(2, 2),
                                           "v_proj.weight": w(2, 2), "o_proj.weight": w(2, 4)}))
    out("safetensors", "overlap", safetensors({"q_proj.weight": w(1, 1)})[:-4] + b"{}")
    out("safetensors", "empty_header", struct.pack("<Q", 2) + b"{}")
    out("safetensors", "not_json", struct.pack("<Q", 5) + b"[1,2]")
    # ---- CLI argument vectors (NUL-separated, without the leading "run")
    vecs = [
        ["--weights", "w.st", "--heads", "8", "--input", "x.npy", "--out", "y.npy"],
        ["--weights=w", "--heads=4", "--kv-heads", "2", "--input", "x", "--out", "y", "--causal",
         "top-left", "--window", "3,-1", "--alibi", "--scale", "0.5", "--softcap", "30"],
        ["--weights", "w", "--heads", "2", "--input", "x", "--out", "y", "--rope-theta", "500000",
         "--rope-style", "half", "--rope-scaling", "yarn", "--rope-factor", "4",
         "--rope-beta-fast", "32", "--positions", "p.npy"],
        ["--weights", "w", "--heads", "2", "--input", "x", "--out", "y", "--names",
         "q=a,k=b,v=c,o=d,sinks=s", "--mask", "m.npy", "--mask-means", "block", "--dropout",
         "0.1", "--seed", "18446744073709551615", "--attn", "a.npy", "--attn-average",
         "--threads", "2", "--impl", "reference"],
        ["--weights", "w", "--heads", "-1", "--input", "x", "--out", "y", "--causal-offsets",
         "o.npy", "--q-segments", "q", "--kv-segments", "k", "--key", "k", "--value", "v"],
        ["--help"],
    ]
    for i, v in enumerate(vecs):
        out("cli_args", "args%d" % i, "\0".join(v).encode())
    # ---- API: bytes that decode to small valid shapes (mode 0 = layer, 1 = core)
    for i in range(12):
        b = bytes([i % 2]) + bytes(rng.randrange(0, 200) for _ in range(160))
        out("api", "seed%02d" % i, b)
    out("api", "layer_plain", bytes([0, 8, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]) + bytes(120))
    out("api", "core_plain", bytes([1, 1, 2, 0, 3, 3, 4, 0, 0, 0]) + bytes(120))


if __name__ == "__main__":
    main()
