# SPDX-License-Identifier: MIT
"""A serving trace through one attention layer's KV cache (issue 32 §5, docs/INFERENCE.md
"Serving trace"): requests arrive (Poisson, in decode steps), some share a system prompt (a
prefix held once and shared with ``KVCache.share_prefix``), each is prefilled and then decoded in
continuous batches (every active sequence advances in one ``KVCache.step``), optionally verifying a
draft tree per step (``tree_parents``) and keeping a random accepted path (``KVCache.accept``).
Each cache configuration replays the same trace and reports generated tokens per second, steps,
and the cache bytes: reserved (the storage made at creation) and in use at the peak (a paged
cache: blocks referenced, from ``free_blocks``; a contiguous one reserves every sequence's
``max_seq``). A benchmark, not a test: one layer (projections + attention), random weights and
inputs, the numbers depend on the host (name it with the results).

  python bench/bench_serving.py --configs contig:float32,paged16:bfloat16,paged16:q8_0 \
      --requests 48 --max-batch 16 --threads 2 --draft-tree=-1,0,0,1

ggml has no paged or shared-block cache, so no peer runs here; bench/peer_ggml_decode.c compares
one decode step with ggml (contiguous caches, q8_0 included).
"""
import argparse
import math
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import mha  # noqa: E402

BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "q8_0": 34 / 32, "fp8_e4m3": 1.0}


def make_trace(a, rng):
    """Requests as (arrival step, prompt length, new tokens, shares the system prompt)."""
    t, out = 0.0, []
    for _ in range(a.requests):
        t += rng.exponential(1.0 / a.arrival_rate)
        prompt = int(math.exp(rng.uniform(math.log(a.prompt_min), math.log(a.prompt_max))))
        gen = int(rng.integers(a.gen_min, a.gen_max + 1))
        out.append((int(t), prompt, gen, rng.random() < a.share_frac))
    return out


def path_to(parents, node):
    """The draft indices of the root-to-node path, increasing."""
    p = []
    while node >= 0:
        p.append(node)
        node = parents[node]
    return p[::-1]


def replay(a, layer, trace, kind, dtype, rng):
    """Runs the trace through one cache configuration; returns the measurements."""
    bs = int(kind[5:]) if kind.startswith("paged") else 0
    holder = a.max_batch  # the sequence holding the shared system prompt
    max_seq = a.shared_prefix + a.prompt_max + a.gen_max + 32
    cache = layer.kv_cache(max_seq, a.max_batch + 1, dtype=dtype, block_size=bs,
                           max_step_tokens=32)
    c = layer.config
    row = c.num_kv_heads * (c.head_dim + c.v_head_dim) * BYTES[dtype]  # one position, bytes
    parents = [int(v) for v in a.draft_tree.split(",")] if a.draft_tree else None
    k = len(parents) if parents else 1
    d = c.q_dim
    cache.prefill(rng.standard_normal((a.shared_prefix, d)).astype(np.float32),
                  seq_ids=[holder])
    free0 = cache.free_blocks()
    pending, active = list(trace), {}  # active: seq -> tokens still to generate
    step = generated = steps = 0
    min_free = free0
    t0 = time.perf_counter()
    while pending or active:
        while pending and pending[0][0] <= step and len(active) < a.max_batch:
            _, prompt, gen, shared = pending.pop(0)
            s = next(i for i in range(a.max_batch) if i not in active)
            if shared:
                cache.share_prefix(holder, s, a.shared_prefix)
            else:
                cache.reset(s)
            cache.prefill(rng.standard_normal((prompt, d)).astype(np.float32), seq_ids=[s],
                          threads=a.threads)
            active[s] = gen
        if active:
            seqs = sorted(active)
            x = rng.standard_normal((len(seqs), k, d)).astype(np.float32)
            base = [cache.length(s) for s in seqs]
            cache.step(x, seq_ids=seqs, tree_parents=parents, threads=a.threads)
            for s, b in zip(seqs, base):
                got = 1
                if parents:  # accept a random path (at least the first root: the model's token)
                    node = int(rng.integers(0, k)) if rng.random() < a.accept_rate else 0
                    keep = path_to(parents, node)
                    cache.accept(s, b, keep)
                    got = len(keep)
                active[s] -= got
                generated += got
                if active[s] <= 0:
                    del active[s]
                    cache.reset(s)
            steps += 1
            if bs:
                min_free = min(min_free, cache.free_blocks())
        step += 1
    secs = time.perf_counter() - t0
    # reserved: the storage made at creation (a paged pool of the default size holds the same
    # positions); in use: a paged cache's referenced blocks at the emptiest point of the pool
    reserved = (a.max_batch + 1) * max_seq * row
    peak = (pool_blocks(a, bs, max_seq) - min_free) * bs * row if bs else reserved
    cache.close()
    return {"config": f"{kind}:{dtype}", "tokens": generated, "steps": steps, "secs": secs,
            "tokens_per_s": generated / secs, "reserved_mb": reserved / 1e6,
            "peak_in_use_mb": peak / 1e6}


def pool_blocks(a, bs, max_seq):
    """The pool's size: the default num_blocks (every sequence at max_seq)."""
    return (a.max_batch + 1) * -(-max_seq // bs)


def cpu_name():
    try:
        info = {}
        with open("/proc/cpuinfo") as f:
            for ln in f:
                key, _, val = ln.partition(":")
                info.setdefault(key.strip(), val.strip())
        return f"{info.get('model name', '?')} (family {info.get('cpu family', '?')})"
    except OSError:
        return platform.machine()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="contig:float32,paged16:float32,paged16:bfloat16,"
                   "paged16:q8_0,paged16:fp8_e4m3")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--arrival-rate", type=float, default=0.5, help="requests per decode step")
    p.add_argument("--prompt-min", type=int, default=64)
    p.add_argument("--prompt-max", type=int, default=2048)
    p.add_argument("--gen-min", type=int, default=16)
    p.add_argument("--gen-max", type=int, default=64)
    p.add_argument("--shared-prefix", type=int, default=512)
    p.add_argument("--share-frac", type=float, default=0.5)
    p.add_argument("--draft-tree", default="", help="parents, e.g. --draft-tree=-1,0,0,1 (empty: no drafts)")
    p.add_argument("--accept-rate", type=float, default=0.6)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    rng = np.random.default_rng(a.seed)
    d, h, g, hd = a.heads * a.head_dim, a.heads, a.kv_heads, a.head_dim
    w = [rng.standard_normal(s).astype(np.float32) * (1 / math.sqrt(d))
         for s in ((h * hd, d), (g * hd, d), (g * hd, d), (d, h * hd))]
    layer = mha.MultiheadAttention(*w, num_heads=h, num_kv_heads=g)
    trace = make_trace(a, rng)
    print(f"# host {cpu_name()}; {a.requests} requests, max batch {a.max_batch}, prompts {a.prompt_min}..{a.prompt_max}"
          f" (shared prefix {a.shared_prefix} for {a.share_frac:.0%}), new tokens "
          f"{a.gen_min}..{a.gen_max}, drafts {a.draft_tree or 'none'}, threads {a.threads}")
    print(f"{'config':24} {'tokens':>7} {'steps':>6} {'secs':>7} {'tok/s':>8} "
          f"{'reserved MB':>12} {'peak in use MB':>15}")
    first = a.configs.split(",")[0].split(":")  # warm-up: page faults, thread pool, caches
    replay(a, layer, trace, first[0], first[1], np.random.default_rng(a.seed + 1))
    for spec in a.configs.split(","):
        kind, dtype = spec.split(":")
        r = replay(a, layer, trace, kind, dtype, np.random.default_rng(a.seed + 1))
        print(f"{r['config']:24} {r['tokens']:7d} {r['steps']:6d} {r['secs']:7.2f} "
              f"{r['tokens_per_s']:8.1f} {r['reserved_mb']:12.1f} {r['peak_in_use_mb']:15.1f}")


if __name__ == "__main__":
    main()
