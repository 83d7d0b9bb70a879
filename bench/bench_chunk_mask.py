#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""bench_chunk_mask.py: a chunked causal mask TENSOR (Llama 4's chunked layers as transformers
builds them, or a user's explicit mask) through the PyTorch SDPA drop-in, recognised as the rule
causal + chunk_size (issue 31) against the same tensor run as a tensor (recognition off: what
main did before; its block mask built once and cached, python/mha/_mask_rule.py). Not a test;
never run by ctest.

Forward of the attention core, default (1, 8, 4096, 64) float32, chunk 1024, top-left causal
(p = i). Rows, timed round-robin in one process (every round runs every row once, so a busy
neighbour slows all rows alike), median [min, max] of --reps rounds after one warm-up:

  mha_bool_rule       mha.torch.scaled_dot_product_attention(attn_mask=bool mask): recognised
                      (cached after the first call), runs causal + chunk_size
  mha_bool_tensor     the same with _mask_rule.enabled = False (the tensor + its cached block mask)
  mha_float_rule      the additive 0 / -inf form, recognised
  mha_float_tensor    the additive form as a tensor
  mha_bool_rule_cold  a fresh copy of the mask every call (transformers builds its mask tensor
                      anew each forward): recognition (one pass over the [n, m] mask) + the rule
  mha_bool_tensor_cold the same, recognition off: the block mask's build + the tensor run
  mha_float_rule_cold, mha_float_tensor_cold: the same with the additive form
(the copy is made outside the timed region)
  torch_bool          F.scaled_dot_product_attention with the bool mask (the peer)

Every mha row is compared with torch_bool (max |a - b|, printed).

Usage: python3 bench/bench_chunk_mask.py [--shape 1,8,4096,64] [--chunk 1024] [--threads 2]
         [--reps 7]
"""
import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import mha.torch as mt
from mha import _mask_rule


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1,8,4096,64")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    B, h, n, d = (int(x) for x in args.shape.split(","))
    C, T = args.chunk, args.threads
    torch.set_num_threads(T)
    g = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(B, h, n, d, generator=g) for _ in range(3))
    i = torch.arange(n).view(n, 1)
    j = torch.arange(n).view(1, n)
    vis = (j <= i) & (j // C == i // C)
    add = torch.zeros(n, n).masked_fill(~vis, float("-inf"))

    fresh = {}  # row name -> the copy its next call takes (cold rows)

    def sdpa(mask, rules, cold=False):
        def run(name=None):
            _mask_rule.enabled = rules
            try:
                m = fresh.pop(name) if cold else mask
                return mt.scaled_dot_product_attention(q, k, v, attn_mask=m, threads=T)
            finally:
                _mask_rule.enabled = True
        run.prep = (lambda: mask.clone()) if cold else None
        return run

    rows = {
        "mha_bool_rule": sdpa(vis, True),
        "mha_bool_tensor": sdpa(vis, False),
        "mha_float_rule": sdpa(add, True),
        "mha_float_tensor": sdpa(add, False),
        "mha_bool_rule_cold": sdpa(vis, True, True),
        "mha_bool_tensor_cold": sdpa(vis, False, True),
        "mha_float_rule_cold": sdpa(add, True, True),
        "mha_float_tensor_cold": sdpa(add, False, True),
        "torch_bool": lambda name=None: F.scaled_dot_product_attention(q, k, v, attn_mask=vis),
    }

    def call(name):
        prep = getattr(rows[name], "prep", None)
        if prep is not None:
            fresh[name] = prep()
        t0 = time.perf_counter()
        out = rows[name](name)
        return out, time.perf_counter() - t0

    ref = call("torch_bool")[0]
    for name in rows:
        out = call(name)[0]  # warm-up (fills the caches of the warm rows)
        if name != "torch_bool":
            print(f"# {name}: max|mha - torch| = {(out - ref).abs().max().item():.3g}")
    rule = _mask_rule.lookup(vis, vis, False, 0, B, h, n, n)
    print(f"# recognised: hi={rule.hi} lo={rule.lo} chunk={rule.chunk}")
    times = {name: [] for name in rows}
    for _ in range(args.reps):
        for name in rows:
            times[name].append(call(name)[1])
    print(f"# {cpu_name()}, threads {T}, shape {(B, h, n, d)}, chunk {C}, reps {args.reps}, "
          f"torch {torch.__version__}")
    base = statistics.median(times["mha_bool_tensor"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:22s} {med * 1e3:9.2f} ms [{min(ts) * 1e3:.2f}, {max(ts) * 1e3:.2f}]"
              f"  x{base / med:.2f} vs mha_bool_tensor")


if __name__ == "__main__":
    main()
