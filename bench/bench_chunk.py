#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""bench_chunk.py: chunked attention (Llama 4's attention_chunk_size; issue 31 §4). Not a test;
never run by ctest.

The forward of the attention core at n = 32768 (default shape (1, 4, 32768, 64), float32,
chunk 8192, causal) in one process, the rows timed round-robin (every round runs every row
once, so a busy neighbour slows all rows alike and the ratios stay meaningful), median [min,
max] of --reps timed rounds after one warm-up:

  mha_chunked        mha.attention(q, k, v, causal=True, chunk_size=8192): the chunk is a band,
                     tiles outside a row block's chunk are skipped
  mha_4x_causal      four independent mha.attention(causal=True) calls on the 8192-long blocks
                     (the work the chunked call should cost)
  mha_full_causal    mha.attention(causal=True) over all 32768 (what no skipping would cost)
  torch_4x_causal    torch F.scaled_dot_product_attention(is_causal=True) on the four blocks
                     (the peer: torch has no chunk rule; the dense [n, n] mask would be 1 GiB)

The chunked output is checked against mha_4x_causal (the same attention: max |a - b| must be
0 up to the blocks' rounding, reported) and torch's.

Usage: python3 bench/bench_chunk.py [--lib build/libmha.so] [--shape 1,4,32768,64]
         [--chunk 8192] [--threads 2] [--reps 5] [--no-torch]
"""
import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np


def cpu_name() -> str:
    """model name (and family, which names the generation: 26 = Zen 5) from /proc/cpuinfo."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                info.setdefault(key.strip(), val.strip())
    except OSError:
        pass
    name = info.get("model name") or platform.processor() or "unknown CPU"
    return f"{name} (family {info['cpu family']})" if "cpu family" in info else name


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=None)
    ap.add_argument("--shape", default="1,4,32768,64")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true")
    a = ap.parse_args()
    if a.lib:
        os.environ["MHA_LIBRARY"] = a.lib
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "python"))
    import mha

    B, h, n, d = (int(x) for x in a.shape.split(","))
    C, T = a.chunk, a.threads
    if n % C:
        raise SystemExit("--shape n must be a multiple of --chunk")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, h, n, d)).astype(np.float32) for _ in range(3))
    blocks = [slice(c, c + C) for c in range(0, n, C)]

    def chunked():
        return mha.attention(q, k, v, causal=True, chunk_size=C, threads=T)

    def four_causal():
        return [mha.attention(q[:, :, s], k[:, :, s], v[:, :, s], causal=True, threads=T)
                for s in blocks]

    def full_causal():
        return mha.attention(q, k, v, causal=True, threads=T)

    rows = {"mha_chunked": chunked, "mha_4x_causal": four_causal, "mha_full_causal": full_causal}
    if not a.no_torch:
        import torch
        import torch.nn.functional as F
        torch.set_num_threads(T)
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))

        def torch_four():
            with torch.no_grad():
                return [F.scaled_dot_product_attention(tq[:, :, s], tk[:, :, s], tv[:, :, s],
                                                       is_causal=True) for s in blocks]
        rows["torch_4x_causal"] = torch_four

    # correctness: the chunked call against the blocks (mha and torch)
    y = chunked()
    y4 = np.concatenate(four_causal(), axis=2)
    err4 = float(np.abs(y - y4).max())
    errt = None
    if "torch_4x_causal" in rows:
        yt = torch.cat(rows["torch_4x_causal"](), dim=2).numpy()
        errt = float(np.abs(y - yt).max())
    times = {name: [] for name in rows}
    for name, fn in rows.items():  # warm-up
        fn()
    for _ in range(a.reps):
        for name, fn in rows.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    print(f"# bench_chunk: (B, h, n, d) = {(B, h, n, d)}, chunk {C}, causal, float32, "
          f"{T} threads, {a.reps} rounds; {cpu_name()}, torch "
          f"{'-' if a.no_torch else torch.__version__}")
    print(f"# chunked vs 4 x causal blocks: max|diff| {err4:.3g}" +
          ("" if errt is None else f"; vs torch's blocks {errt:.3g}"))
    base = statistics.median(times["mha_4x_causal"])
    print(f"{'row':18s} {'median s':>9s} {'[min, max]':>20s} {'/ mha_4x_causal':>16s}")
    for name, ts in times.items():
        md = statistics.median(ts)
        print(f"{name:18s} {md:9.3f} [{min(ts):8.3f}, {max(ts):8.3f}] {md / base:16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
