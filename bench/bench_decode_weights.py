# SPDX-License-Identifier: MIT
"""Decode step with f32 / bf16 / f16 / q8_0 / q4_0 WEIGHTS at batch 1: bytes of weights per second.

At batch 1 a layer's decode step is four matrix-vector products over its weights (q, k, v, o:
2 H D Q + 2 G D Q elements) plus attention over a short cache: the weights' bytes bound it, so
half-precision weights should approach half the time, q8_0 (34 bytes per 32 weights) 0.53x the
bf16 time, q4_0 (18 bytes) 0.28x. Runs, interleaved in one process run:
  mha  : `mha decode-bench --weight-dtype T --json` (the whole layer step: projections, RoPE,
         append, split-KV attention over --cache-len positions, output projection);
  torch: the same four products as F.linear on a [1, Q] input with T weights (bf16/f16 torch
         runs them natively; no attention: a lower bound on torch's layer step; no q8_0, q4_0).
Each mha run also measures this machine's memory read bandwidth (`--stream MB`: two read loops
over a buffer far beyond the caches, in 2 MiB pages, on the same thread count, the plain one and
one with software prefetches, the best pass of each; the read bandwidth is the higher of the
two: on AMD Zen 5 the prefetched loop reads 1.1-1.2x the plain one, and the GEMV, which
prefetches, beat the plain loop). decode-bench copies the weights into the layer's own storage,
as the loaders do, also in 2 MiB pages. So `% bw` = weight bytes / median step time / that run's
read bandwidth compares like with like on a shared host (a median step against the best read
pass: conservative). `best %` uses the run's best step instead. `% w+kv` counts the bytes the
step reads from the cache too (weights + K and V of --cache-len positions: what the step must
stream), and `x bf16` / `x q8_0` are the bf16 / q8_0 row's step time over this row's, per repeat
(same tier and threads, runs of one repeat back to back).
`--cold-mb MB` reads an MB-megabyte buffer before every timed step (mha: `decode-bench --cold`;
torch: a sum over a buffer of that size), as a model's other layers would between two steps of
this one: without it a host whose L3 holds the layer's weights (the Intel Xeon of session 42: a
260 MiB L3 against 84 MB of bf16 weights) reads them from the L3 and reports more than the memory's
bandwidth (152% there). `auto` (the default) reads twice the L3 size that
/sys/devices/system/cpu/cpu0/cache gives (0 when it gives none); 0 turns it off.
Reports per (kernel tier, threads, dtype) the median and [min, max] over --repeats runs of the
median step time, GB/s of weight bytes and % of the read bandwidth. The tiers are MHA_MAX_ISA
caps ("default" = none); torch (optional) runs only in the default tier's rows.

  python bench/bench_decode_weights.py --mha build/mha --repeats 5 --tiers default,avx2 \
      --threads 1,2
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import time


FLOATS = ("f32", "bf16", "f16")  # the weight dtypes torch runs too


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def l3_mb():
    """The L3's size in MB as sysfs gives it for CPU 0 (0 when it gives none)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for idx in sorted(os.listdir(base)):
            with open(os.path.join(base, idx, "level")) as f:
                if f.read().strip() != "3":
                    continue
            with open(os.path.join(base, idx, "size")) as f:
                size = f.read().strip()
            scale = {"K": 1 / 1024, "M": 1, "G": 1024}.get(size[-1], 1 / 2 ** 20)
            return int(float(size.rstrip("KMG")) * scale + 0.5)
    except (OSError, ValueError):
        pass
    return 0


def mha_run(exe, dtype, tier, threads, a):
    cmd = [exe, "decode-bench", "--heads", str(a.heads), "--kv-heads", str(a.kv_heads),
           "--head-dim", str(a.head_dim), "--cache-len", str(a.cache_len), "--batch", "1",
           "--steps", str(a.steps), "--threads", str(threads), "--weight-dtype", dtype,
           "--stream", str(a.stream_mb), "--json"] + (["--cold", str(a.cold)] if a.cold else [])
    env = dict(os.environ)
    env.pop("MHA_MAX_ISA", None)
    if tier != "default":
        env["MHA_MAX_ISA"] = tier
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
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
    cold = torch.ones(a.cold << 18, dtype=torch.float32) if a.cold else None  # 4 bytes each
    with torch.inference_mode():
        for _ in range(3):
            for w in ws:
                f(x, w)
            f(x, wo)
        for _ in range(a.steps):
            if cold is not None:
                cold.sum()
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
    p.add_argument("--threads", default="1", help="comma-separated thread counts")
    p.add_argument("--tiers", default="default",
                   help="comma-separated MHA_MAX_ISA caps, 'default' = none (e.g. default,avx2)")
    p.add_argument("--stream-mb", type=int, default=1024,
                   help="the read-bandwidth loop's buffer (MB), measured in every mha run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtypes", default="f32,bf16,f16,q8_0,q4_0")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--cold-mb", default="auto",
                   help="MB read before every timed step (see above); 'auto': 2x the L3")
    p.add_argument("--base", default=None,
                   help="another mha program (e.g. a build before a change): its rows interleaved")
    a = p.parse_args()
    a.cold = 2 * l3_mb() if a.cold_mb == "auto" else int(a.cold_mb)
    threads = [int(t) for t in a.threads.split(",")]
    tiers = a.tiers.split(",")
    torch = None
    if not a.no_torch:
        import torch as _t
        torch = _t
    dtypes = a.dtypes.split(",")
    whos = [("mha", a.mha)] + ([("base", a.base)] if a.base else [])
    rows = [(who, tier, t, d) for t in threads for tier in tiers for d in dtypes for who, _ in whos]
    exe = dict(whos)
    res = {r: [] for r in rows}  # (median step s, read bandwidth GB/s, best step s) per run
    kvb = {}  # K + V bytes a step reads
    tres = {(t, d): [] for t in threads for d in dtypes}
    nbytes, kernel = {}, {}
    for _ in range(a.repeats):  # interleaved: the shared host's load hits every row alike
        for r in rows:
            who, tier, t, d = r
            j = mha_run(exe[who], d, tier, t, a)
            bw = max(j["stream_gbs"], j.get("stream_pf_gbs", 0.0))
            res[r].append((j["layer_median_s"], bw, j["layer_min_s"]))
            nbytes[d] = j["weight_bytes"]
            kvb[d] = j["kv_bytes_per_step"]
            kernel[tier] = j["kernel"].rsplit("__", 1)[-1]
            if torch is not None and tier == tiers[0] and who == "mha" and d in FLOATS:
                torch.set_num_threads(t)
                tm, nb = torch_run(torch, d, a)
                tres[(t, d)].append(tm)
                nbytes[("torch", d)] = nb
    print(f"# host: {cpu_name()}, {os.cpu_count()} CPUs; "
          f"torch {torch.__version__ if torch else '-'}")
    print(f"# layer h={a.heads} g={a.kv_heads} d={a.head_dim} q_dim={a.heads * a.head_dim} "
          f"cache_len={a.cache_len} batch=1; median step over {a.steps} steps, "
          f"{a.repeats} repeats: median [min, max]; read bw: --stream {a.stream_mb} in each run; "
          f"--cold {a.cold} MB before every timed step")
    print(f"{'tier':8} {'thr':>3} {'who':6} {'weights':7} {'MB':>6} {'step ms':>22} "
          f"{'GB/s of weights':>20} {'read bw GB/s':>20} {'% of read bw':>18} {'best %':>16} "
          f"{'% w+kv':>16} {'x bf16':>20} {'x q8_0':>20}")

    def cell(v, fmt):
        return f"{fmt.format(statistics.median(v))} [{fmt.format(min(v))}, {fmt.format(max(v))}]"

    for t in threads:
        for tier, d, who in [(tr, d, w) for tr in tiers for d in dtypes for w, _ in whos]:
            runs = res[(who, tier, t, d)]
            nb = nbytes[d]
            ms = [s * 1e3 for s, _, _ in runs]
            gbs = [nb / s * 1e-9 for s, _, _ in runs]
            bw = [b for _, b, _ in runs]
            pct = [100.0 * nb / s * 1e-9 / b for s, b, _ in runs]
            best = [100.0 * nb / s * 1e-9 / b for _, b, s in runs]
            wkv = [100.0 * (nb + kvb[d]) / s * 1e-9 / b for s, b, _ in runs]
            xs = []
            for base in ("bf16", "q8_0"):
                ref = res.get((who, tier, t, base))
                xs.append(cell([r[0] / s for r, (s, _, _) in zip(ref, runs)], '{:.2f}')
                          if ref else "-")
            print(f"{kernel[tier]:8} {t:3} {who:6} {d:7} {nb * 1e-6:6.1f} {cell(ms, '{:.3f}'):>22} "
                  f"{cell(gbs, '{:.1f}'):>20} {cell(bw, '{:.1f}'):>20} {cell(pct, '{:.0f}'):>18} "
                  f"{cell(best, '{:.0f}'):>16} {cell(wkv, '{:.0f}'):>16} {xs[0]:>20} {xs[1]:>20}")
        for d in dtypes:
            ts = tres[(t, d)]
            if not ts:
                continue
            nb = nbytes[("torch", d)]
            ms = [s * 1e3 for s in ts]
            gbs = [nb / s * 1e-9 for s in ts]
            print(f"{'-':8} {t:3} {'torch':6} {d:7} {nb * 1e-6:6.1f} {cell(ms, '{:.3f}'):>22} "
                  f"{cell(gbs, '{:.1f}'):>20}")


if __name__ == "__main__":
    main()
