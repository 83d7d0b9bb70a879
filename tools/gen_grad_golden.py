#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""gen_grad_golden.py: writes the PyTorch GRADIENT goldens of tests/golden_grad/ (issue 4).

For every forward golden case of tests/golden/ (written by tools/gen_golden.py, whose case list,
weight reader, input loader, RoPE, ALiBi slopes and projections are imported from it), this
computes, in float64 with torch autograd, the gradients of L = sum(dy * y) with respect to the
layer inputs (query; key and value for cross-attention), every weight and bias and the sink
logits, for a fixed upstream gradient dy (seeded by crc32(name) + 1, rounded to float32 and
stored). The layer is written with explicit ops (matmul, masked_fill, softmax) exactly as
gen_golden.reference(), except that fully masked rows get finite scores before the softmax (then
zero probabilities), so that their gradient is 0 instead of NaN (our documented semantics). Its
output must match the committed expected_out.npy to 1e-12 before anything is written.

No case of the forward set uses dropout (torch's RNG is not Philox); dropout gradients are
checked against the float64 oracle and finite differences in tests/test_grad.c.

    pip install -r tools/requirements-golden.txt && python3 tools/gen_grad_golden.py
    python3 tools/gen_grad_golden.py --check    # regenerate into a temp dir, compare bytes
"""
import argparse
import filecmp
import json
import math
import os
import shutil
import sys
import tempfile
import zlib

import numpy as np
import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_golden as G  # noqa: E402

F64 = torch.float64
GOLDEN = os.path.normpath(os.path.join(HERE, "..", "tests", "golden"))
DEFAULT_OUT = os.path.normpath(os.path.join(HERE, "..", "tests", "golden_grad"))
FORMAT_VERSION = 1


def layer(s, W, Bs, inp, allowed):
    """The float64 layer as gen_golden.reference(), differentiable through fully masked rows."""
    B, n, M, h, g = s.B, s.n, s.M, s.h, s.G
    Q, K, V = G.project(s, W, Bs, inp)
    rep = h // g
    Kh, Vh = K.repeat_interleave(rep, dim=1), V.repeat_interleave(rep, dim=1)
    scale = s.scale if s.scale is not None else 1.0 / math.sqrt(s.DK)
    S = scale * torch.matmul(Q, Kh.transpose(-1, -2))
    if s.softcap is not None:
        S = s.softcap * torch.tanh(S / s.softcap)
    i = torch.arange(n).view(1, 1, n, 1)
    j = torch.arange(M).view(1, 1, 1, M)
    p = i + G.deltas(s, inp).view(B, 1, 1, 1)
    if s.mask is not None and s.mask["kind"] == "add":
        S = S + torch.from_numpy(inp["mask"].astype(np.float64))
    if s.alibi:
        slopes = torch.tensor(G.alibi_slopes(h), dtype=F64).view(1, h, 1, 1)
        S = S - slopes * (p - j).abs().to(F64)
    blocked = ~allowed | torch.isneginf(S.detach())
    dead = blocked.all(dim=-1)
    S = S.masked_fill(blocked, float("-inf")).masked_fill(dead[..., None], 0.0)
    if s.sinks:
        sink = inp["sinks_t"].view(1, h, 1, 1)
        P = torch.softmax(torch.cat([S, sink.expand(B, h, n, 1)], dim=-1), dim=-1)[..., :M]
    else:
        P = torch.softmax(S, dim=-1)
    P = torch.where(dead[..., None], torch.zeros_like(P), P)
    O = torch.matmul(P, Vh)
    out = torch.matmul(O.transpose(1, 2).reshape(B, n, h * s.DV), W["o"].T)
    return out + Bs["o"] if Bs["o"] is not None else out


def save(d, name, arr):
    np.save(os.path.join(d, name), np.ascontiguousarray(arr), allow_pickle=False)


def write_case(s, root):
    src = os.path.join(GOLDEN, s.name)
    W, Bs = G.read_weights(s, load_file(os.path.join(src, "weights.safetensors")))
    inp = G.load_inputs(s, src)
    ref = G.reference(s, W, Bs, inp)
    leaves = {}

    def leaf(name, t):
        t = t.detach().clone().requires_grad_(True)
        leaves[name] = t
        return t

    W = {r: leaf("dw_" + r, W[r]) for r in "qkvo"}
    Bs = {r: (leaf("db_" + r, Bs[r]) if Bs[r] is not None else None) for r in "qkvo"}
    inp = dict(inp)
    inp["x"] = leaf("d_query", inp["x"])
    if s.cross:
        inp["key"] = leaf("d_key", inp["key"])
        inp["value"] = leaf("d_value", inp["value"])
    if s.sinks:
        inp["sinks_t"] = leaf("d_sinks", torch.from_numpy(inp["sinks"].astype(np.float64)))
    out = layer(s, W, Bs, inp, ref["allowed"])
    expected = np.load(os.path.join(src, "expected_out.npy")).reshape(out.shape)
    err = np.abs(out.detach().numpy() - expected).max() / max(1.0, np.abs(expected).max())
    assert err <= 1e-12, (s.name, err)
    gen = torch.Generator().manual_seed(zlib.crc32(s.name.encode()) + 1)
    dy = torch.randn(out.shape, generator=gen, dtype=F64).to(torch.float32)
    (out * dy.to(F64)).sum().backward()
    d = os.path.join(root, s.name)
    os.makedirs(d)
    save(d, "dy.npy", dy.numpy())
    files = {}
    for name, t in leaves.items():
        gr = t.grad if t.grad is not None else torch.zeros_like(t)
        assert torch.isfinite(gr).all(), (s.name, name)
        save(d, name + ".npy", gr.numpy())
        files[name] = name + ".npy"
    meta = {"format_version": FORMAT_VERSION, "name": s.name, "generator":
            "tools/gen_grad_golden.py", "torch_version": torch.__version__,
            "forward_case": "tests/golden/" + s.name, "loss": "sum(dy * y)",
            "dy": "dy.npy", "grads": files,
            "max_abs": {k: float(v.grad.abs().max()) if v.grad is not None else 0.0
                        for k, v in leaves.items()},
            "tags": list(s.tags)}
    with open(os.path.join(d, "grad.json"), "w") as fh:
        json.dump(meta, fh, indent=1)
        fh.write("\n")
    return meta


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--allow-torch-version", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            import subprocess
            cmd = [sys.executable, os.path.abspath(__file__), "--out", tmp]
            if args.allow_torch_version:
                cmd.append("--allow-torch-version")
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            bad = []
            for dirpath, _, files in os.walk(tmp):
                for f in files:
                    rel = os.path.relpath(os.path.join(dirpath, f), tmp)
                    mine = os.path.join(args.out, rel)
                    if not os.path.exists(mine) or not filecmp.cmp(os.path.join(tmp, rel), mine,
                                                                   shallow=False):
                        bad.append(rel)
            if bad:
                sys.exit(f"gen_grad_golden.py --check: {len(bad)} files differ, e.g. {bad[:5]}")
            print(f"gen_grad_golden.py --check: {args.out} is reproducible")
        return
    if torch.__version__.split("+")[0] != G.TORCH_VERSION and not args.allow_torch_version:
        sys.exit(f"gen_grad_golden.py: torch {G.TORCH_VERSION} required, found {torch.__version__}")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    G.build_cases()
    with open(os.path.join(GOLDEN, "index.json")) as fh:
        names = json.load(fh)["cases"]
    by_name = {c.name: c for c in G.CASES}
    root = args.out
    if os.path.isdir(root):
        for entry in os.listdir(root):
            p = os.path.join(root, entry)
            if os.path.isdir(p) and os.path.exists(os.path.join(p, "grad.json")):
                shutil.rmtree(p)
    os.makedirs(root, exist_ok=True)
    metas = [write_case(by_name[nm], root) for nm in names]
    tags = {}
    for m in metas:
        for t in m["tags"]:
            tags[t] = tags.get(t, 0) + 1
    with open(os.path.join(root, "index.json"), "w") as fh:
        json.dump({"format_version": FORMAT_VERSION, "torch_version": torch.__version__,
                   "cases": [m["name"] for m in metas],
                   "feature_counts": dict(sorted(tags.items()))}, fh, indent=1)
        fh.write("\n")
    total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(root) for f in fs)
    print(f"{len(metas)} gradient cases in {root}, {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
