# SPDX-License-Identifier: MIT
"""Decode step with f32 / bf16 / f16 WEIGHTS at batch 1: bytes of weights per second.

At batch 1 a layer's decode step is four matrix-vector products over its weights (q, k, v, o:
2 H D Q + 2 G D Q elements) plus attention over a short cache: the weights' bytes bound it, so
half-precision weights should approach half the time. Runs, interleaved in one process run:
  mha  : `mha decode-bench --weight-dtype T --json` (the whole layer step: projections, RoPE,
         append, split-KV attention over --cache-len positions, output projection);
  torch: the same four products as F.linear on a [1, Q] input with T weights (bf16/f16 torch
         runs them natively; no attention: a lower bound on torch's layer step).
Reports per dtype the median and [min, max] over --repeats runs of the median step time, and
GB/s of weight bytes. One thread by default (torch.set_num_threads, mha --threads).

  python bench/bench_decode_weights.py --mha build/mha --repeats 5
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import time


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def mha_run(exe, dtype, a):
    cmd = [exe, "decode-bench", "--heads", str(a.heads), "--kv-heads", str(a.kv_heads),
           "--head-dim", str(a.head_dim), "--cache-len", str(a.cache_len), "--batch", "1",
           "--steps", str(a.steps), "--threads", str(a.threads), "--weight-dtype", dtype,
           "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def torch_run(torch, dtype, a):
    dt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    q = a.heads * a.head_dim
    kv = a.kv_heads * a.head_dim
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, q, generator=g).mul_(q ** -0.5).to(dt) for n in (q, kv, kv)]
    wo = torch.randn(q, q, generator=g).mul_(q ** -0.5).to(dt)
    x = torch.randn(1, q, generator=g).to(dt)
    f = torch.nn.functional.linear
    times = []
    with torch.inference_mode():
        for _ in range(3):
            for w in ws:
                f(x, w)
            f(x, wo)
        for _ in range(a.steps):
            t0 = time.perf_counter()
            for w in ws:
                f(x, w)
            f(x, wo)
            times.append(time.perf_counter() - t0)
    nbytes = sum(w.numel() * w.element_size() for w in ws) + wo.numel() * wo.element_size()
    return statistics.median(times), nbytes


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mha", default="build/mha")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--cache-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtypes", default="f32,bf16,f16")
    p.add_argument("--no-torch", action="store_true")
    a = p.parse_args()
    torch = None
    if not a.no_torch:
        import torch as _t
        torch = _t
        torch.set_num_threads(a.threads)
    dtypes = a.dtypes.split(",")
    res = {(who, d): [] for who in ("mha", "torch") for d in dtypes}
    nbytes = {}
    for _ in range(a.repeats):  # interleaved: the shared host's load hits every row alike
        for d in dtypes:
            j = mha_run(a.mha, d, a)
            res[("mha", d)].append(j["layer_median_s"])
            nbytes[("mha", d)] = j["weight_bytes"]
            if torch is not None:
                t, nb = torch_run(torch, d, a)
                res[("torch", d)].append(t)
                nbytes[("torch", d)] = nb
    print(f"# host: {cpu_name()}, {os.cpu_count()} CPUs; threads {a.threads}; "
          f"torch {torch.__version__ if torch else '-'}")
    print(f"# layer h={a.heads} g={a.kv_heads} d={a.head_dim} q_dim={a.heads * a.head_dim} "
          f"cache_len={a.cache_len} batch=1; median step over {a.steps} steps, "
          f"{a.repeats} repeats: median [min, max]")
    print(f"{'who':6} {'weights':8} {'MB':>7} {'step ms':>22} {'GB/s of weights':>24}")
    for who in ("mha", "torch"):
        for d in dtypes:
            ts = res[(who, d)]
            if not ts:
                continue
            mb = nbytes[(who, d)] * 1e-6
            med, lo, hi = statistics.median(ts), min(ts), max(ts)
            gb = lambda t: nbytes[(who, d)] / t * 1e-9  # noqa: E731
            print(f"{who:6} {d:8} {mb:7.1f} {med * 1e3:8.3f} [{lo * 1e3:.3f}, {hi * 1e3:.3f}]"
                  f" {gb(med):8.1f} [{gb(hi):.1f}, {gb(lo):.1f}]")


if __name__ == "__main__":
    main()
