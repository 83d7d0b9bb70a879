# SPDX-License-Identifier: MIT
"""Benchmark (not a test): a jit-compiled mha.jax.dot_product_attention call (the C library
through XLA's FFI) against jax.nn.dot_product_attention (XLA's own implementation) on the same
inputs, forward and forward+backward.

    python3 bench/bench_jax.py [--samples 30] [--threads 0] [--size B,T,N,H ...]
    MHA_LIBRARY=build/libmha.so MHA_JAX_FFI=build/tests/_jax_ffi.so MHA_PYTHON_DIR=python \\
        python3 bench/bench_jax.py

Variants, each a function compiled once with jax.jit (the first call, compilation included, is
not timed), float32, self-attention shapes [B, T, N, H], causal:
  empty jit    jit(lambda q: q + 0): what any compiled call costs (dispatch, one output)
  jax.nn       jit(jax.nn.dot_product_attention)
  mha.jax      jit(mha.jax.dot_product_attention): one FFI custom call inside the program
  jax.nn grad  jit(grad(sum(dot_product_attention(q, k, v) * w))) w.r.t. q, k, v
  mha.jax grad the same through mha's custom_vjp (mha's backward, fed the forward's lse)

Timing: wall clock (XLA and mha both run on their own threads, so thread CPU time would miss
them), each sample a batch of back-to-back calls lasting ~2 ms (at least 3) ended by
block_until_ready; variants interleaved round-robin so drift in the machine's load hits them
alike; per call in microseconds, median [p10, p90] over the samples. "mha - jax.nn" is the paired
difference (samples taken next to each other). Default sizes: 1,16,4,16 (the fixed overhead) and
2,512,8,64 (throughput). On a machine shared with other jobs the numbers are a dry run: say so
(--note) when reporting them.
"""
import argparse
import os
import statistics
import sys
import time

if os.environ.get("MHA_PYTHON_DIR"):
    sys.path.insert(0, os.environ["MHA_PYTHON_DIR"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import mha.jax  # noqa: E402


def per_call_us(fn, args, min_calls=3, target_s=2e-3):
    """Calls per sample so that one sample lasts about target_s."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = max(time.perf_counter() - t0, 1e-7)
    return max(min_calls, int(target_s / once))


def sample(fn, args, calls):
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls * 1e6


def quantiles(xs):
    xs = sorted(xs)
    pick = lambda f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    return statistics.median(xs), pick(0.1), pick(0.9)


def bench_size(b, t, n, h, samples, threads):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32) for _ in range(3))
    w = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)

    def mha_fn(q, k, v):
        return mha.jax.dot_product_attention(q, k, v, is_causal=True, threads=threads)

    def jax_fn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    def grad_of(f):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * w), (0, 1, 2)))

    variants = {"empty jit": (jax.jit(lambda q: q + 0), (q,)),
                "jax.nn": (jax.jit(jax_fn), (q, k, v)), "mha.jax": (jax.jit(mha_fn), (q, k, v)),
                "jax.nn grad": (grad_of(jax_fn), (q, k, v)),
                "mha.jax grad": (grad_of(mha_fn), (q, k, v))}
    calls = {name: per_call_us(f, a) for name, (f, a) in variants.items()}
    times = {name: [] for name in variants}
    for _ in range(samples):
        for name, (f, a) in variants.items():
            times[name].append(sample(f, a, calls[name]))
    print(f"shape B={b} T=S={t} N={n} H={h}, causal, float32, mha threads={threads or 'all'}")
    for name, xs in times.items():
        med, p10, p90 = quantiles(xs)
        print(f"  {name:<13} {med:10.1f} us/call  [{p10:.1f}, {p90:.1f}]")
    for what, ref in (("mha.jax", "jax.nn"), ("mha.jax grad", "jax.nn grad")):
        med, p10, p90 = quantiles([a - r for a, r in zip(times[what], times[ref])])
        print(f"  {what + ' - ' + ref:<26} {med:+10.1f} us  [{p10:+.1f}, {p90:+.1f}]")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--threads", type=int, default=0, help="mha's threads (0 = all cores)")
    ap.add_argument("--size", action="append", help="B,T,N,H (repeatable)")
    ap.add_argument("--note", default="", help="printed in the header, e.g. 'dry run, loaded'")
    a = ap.parse_args()
    sizes = [tuple(int(x) for x in s.split(",")) for s in (a.size or ["1,16,4,16", "2,512,8,64"])]
    print(f"# bench_jax: jax {jax.__version__}, mha {mha.library_version()} "
          f"({mha.library_path}), {os.cpu_count()} CPUs, samples={a.samples}"
          + (f", NOTE: {a.note}" if a.note else ""))
    for s in sizes:
        bench_size(*s, a.samples, a.threads)


if __name__ == "__main__":
    main()
