#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Decode-step benchmark of the KV cache (issue 5): mha's split-KV attention vs PyTorch vs a naive
loop, as % of this machine's measured memory read bandwidth, in one run.

For every shape (h = 32, d_k = d_v = 128, g in {8, 32}, cache length in {512, 4096, 32768},
batch in {1, 8}, threads in {1, 2}) it measures one decode step (one new query token per sequence
attending to the whole cache):
  - mha: `mha decode-bench --attention-only --json` (append one token's K/V + split-KV attention,
    median over --steps steps);
  - PyTorch: F.scaled_dot_product_attention(q [B, h, 1, d], K [B, g, L, d], V, enable_gqa=True) on
    a cache of the same shape and dtype, median over the same number of calls,
    torch.set_num_threads(threads);
  - naive: the plain single-threaded C loop of `mha decode-bench --naive` (same cache);
  - memory bandwidth: `mha decode-bench --stream MB`, a read loop over a buffer much larger than
    the last-level cache, with the same thread count.
Effective bandwidth = bytes of K and V in the cache / step time.

Usage: python3 bench/bench_decode.py [--mha build/mha] [--steps 20] [--dtypes f32,bf16]
                                     [--quick] [--markdown out.md]
       (--lengths 32768 --kv-heads 8 --batches 1 --threads 1,2: the issue's shape only)
Needs torch (2.13.0 here) and numpy; nothing is installed by this script.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def mha_run(mha, *args):
    r = subprocess.run([mha, "decode-bench", *map(str, args)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip())
    return json.loads(r.stdout)


def torch_step(torch, B, h, g, L, d, dtype, threads, steps):
    import torch.nn.functional as F
    torch.set_num_threads(threads)
    tdt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    k = torch.randn(B, g, L, d, dtype=tdt)
    v = torch.randn(B, g, L, d, dtype=tdt)
    q = torch.randn(B, h, 1, d, dtype=tdt)
    with torch.inference_mode():
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # warm-up
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            times.append(time.perf_counter() - t0)
    del k, v, q
    return statistics.median(times)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mha", default=os.path.join(here, "..", "build", "mha"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtypes", default="f32")
    ap.add_argument("--stream-mb", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="cache lengths 512 and 4096 only")
    ap.add_argument("--lengths", help="cache lengths, comma separated (default 512,4096,32768)")
    ap.add_argument("--kv-heads", default="8,32", help="kv heads g, comma separated")
    ap.add_argument("--batches", default="1,8", help="batch sizes B, comma separated")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma separated")
    ap.add_argument("--no-naive", action="store_true")
    ap.add_argument("--markdown", help="also write the table to this file")
    args = ap.parse_args()
    import torch

    h, d = 32, 128
    lengths = [512, 4096] if args.quick else [512, 4096, 32768]
    if args.lengths:
        lengths = [int(x) for x in args.lengths.split(",")]
    threads = [int(x) for x in args.threads.split(",")]
    stream = {}
    for t in threads:
        stream[t] = mha_run(args.mha, "--attention-only", "--json", "--heads", 2, "--kv-heads", 1,
                            "--head-dim", 16, "--cache-len", 16, "--steps", 1, "--threads", t,
                            "--stream", args.stream_mb)["stream_gbs"]
    header = (f"# decode step, h={h}, d={d}; torch {torch.__version__}; memory read bandwidth "
              f"(--stream {args.stream_mb} MB): " +
              ", ".join(f"{t} thread(s) {stream[t]:.1f} GB/s" for t in threads))
    print(header)
    cols = ("dtype", "g", "L", "B", "thr", "KV MB", "mha ms", "GB/s", "%bw", "torch ms",
            "x torch", "naive ms", "x naive")
    print(" | ".join(cols))
    rows = []
    for dtype in args.dtypes.split(","):
        for g in (int(x) for x in args.kv_heads.split(",")):
            for L in lengths:
                for B in (int(x) for x in args.batches.split(",")):
                    for t in threads:
                        kv_bytes = B * g * L * 2 * d * (4 if dtype == "f32" else 2)
                        naive = not args.no_naive and t == 1
                        rec = mha_run(args.mha, "--attention-only", "--json", "--heads", h,
                                      "--kv-heads", g, "--head-dim", d, "--cache-len", L,
                                      "--batch", B, "--steps", args.steps, "--threads", t,
                                      "--cache-dtype", dtype, *(["--naive"] if naive else []))
                        mha_s = rec["attn_median_s"]
                        try:
                            torch_s = torch_step(torch, B, h, g, L, d, dtype, t, args.steps)
                        except RuntimeError as e:  # out of memory, unsupported dtype
                            print(f"torch failed: {e}", file=sys.stderr)
                            torch_s = float("nan")
                        gbs = kv_bytes / mha_s * 1e-9
                        row = (dtype, g, L, B, t, f"{kv_bytes / 1e6:.0f}", f"{mha_s * 1e3:.3f}",
                               f"{gbs:.1f}", f"{100 * gbs / stream[t]:.0f}",
                               f"{torch_s * 1e3:.3f}", f"{torch_s / mha_s:.2f}",
                               f"{rec['naive_s'] * 1e3:.1f}" if naive else "-",
                               f"{rec['naive_s'] / mha_s:.1f}" if naive else "-")
                        rows.append(row)
                        print(" | ".join(map(str, row)), flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(header + "\n\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n")
            for row in rows:
                f.write("| " + " | ".join(map(str, row)) + " |\n")


if __name__ == "__main__":
    main()
