#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""bench_temperature.py: the cost of attention temperature tuning (issue 31, Llama 4's NoPE
layers: mha_config.temperature) on the layer forward. Not a test; never run by ctest.

In one process, on the same input and weights, round-robin (each round runs every variant once,
so a busy neighbour slows all alike) after one warm-up, it times mha_layer_forward (impl=AUTO,
causal, self-attention, float32) of
  plain        the layer without RoPE
  temperature  the same layer with temperature tuning (floor_scale 8192, attn_scale 0.1: the
               per-row factor is computed and Q scaled, whatever its value)
  rope         the layer with RoPE (half), for scale: what a RoPE layer costs
  rope_l2      RoPE + the weightless L2 QK-norm after it (Llama 4's RoPE layers), if the library
               has it
and prints the median, min and max of --reps runs per variant and each variant's median over
plain's median (the 3% target of issue 31 is temperature / plain <= 1.03).

Usage: MHA_LIBRARY=build/libmha.so PYTHONPATH=python python3 bench/bench_temperature.py
         [--n 2048] [--dim 1024] [--heads 16] [--threads 2] [--reps 15]
"""
import argparse
import platform
import statistics
import time

import numpy as np

import mha


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    E = a.dim
    w = [(rng.standard_normal((E, E)) * E ** -0.5).astype(np.float32) for _ in range(4)]
    x = rng.standard_normal((a.batch, a.n, E)).astype(np.float32)
    variants = {
        "plain": mha.MultiheadAttention(*w, num_heads=a.heads),
        "temperature": mha.MultiheadAttention(*w, num_heads=a.heads, temperature=(8192, 0.1)),
        "rope": mha.MultiheadAttention(*w, num_heads=a.heads, rope="half"),
    }
    try:
        variants["rope_l2"] = mha.MultiheadAttention(
            *w, num_heads=a.heads, rope="half", qk_norm={"kind": "l2_after_rope", "eps": 1e-5})
    except (TypeError, ValueError, mha.MhaError):
        pass
    times = {k: [] for k in variants}
    for r in range(a.reps + 1):
        for k, layer in variants.items():
            t0 = time.perf_counter()
            layer(x, causal=True, threads=a.threads)
            dt = time.perf_counter() - t0
            if r:
                times[k].append(dt)
    base = statistics.median(times["plain"])
    print(f"# CPU: {cpu_name()}; layer forward B={a.batch} n={a.n} E={E} h={a.heads} "
          f"causal, float32, {a.threads} threads, {a.reps} rounds (round-robin)")
    for k, ts in times.items():
        med = statistics.median(ts)
        print(f"{k:12s} median {med * 1e3:8.2f} ms  [min {min(ts) * 1e3:8.2f}, "
              f"max {max(ts) * 1e3:8.2f}]  / plain {med / base:.4f}")


if __name__ == "__main__":
    main()
