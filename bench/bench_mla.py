#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""MLA decode benchmark (issue 31 §4): one decode step of a DeepSeek-V3-shaped layer (h = 128,
kv_lora_rank 512, qk_rope 64, qk_nope 128, v_head 128, hidden 7168, q_lora_rank 1536) at batch 1
over L cached tokens, in one run:
  - the host's memory read bandwidth (`mha decode-bench --stream MB`, 2 threads) and FMA peaks
    (`mha_peak`);
  - mha (`mha_bench_mla`): the absorbed attention over the compressed cache (the call
    mha_mla_decode_step makes; f32 queries, and bf16 queries for the bf16 tile kernel), the
    whole step (--step), and the same attention through an expanded per-head cache (--expanded);
  - torch 2.13 running transformers' DeepseekV3Attention with its DynamicCache (which holds the
    compressed latent and expands it with kv_b_proj at every step), at --torch-len tokens.

Usage: python3 bench/bench_mla.py [--build build] [--len 32768] [--torch-len 8192] [--reps 5]
Needs torch and transformers (the pinned versions); installs nothing.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd}: {r.stderr.strip()}")
    return r.stdout


def torch_step(L, reps, threads, dtype):
    import torch
    import transformers as T
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as MD
    torch.set_num_threads(threads)
    cfg = T.DeepseekV3Config(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
                             q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128, num_hidden_layers=1,
                             vocab_size=16, max_position_embeddings=L + 16,
                             rope_parameters=dict(rope_type="default", rope_theta=1e4))
    cfg._attn_implementation = "sdpa"
    tdt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    attn = MD.DeepseekV3Attention(cfg, 0).to(tdt).eval()
    rot = MD.DeepseekV3RotaryEmbedding(cfg)
    cache = T.DynamicCache(config=cfg)
    with torch.inference_mode():
        c = torch.randn(1, 1, L - 1, 512, dtype=tdt)
        k = torch.randn(1, 1, L - 1, 64, dtype=tdt)
        cache.update(c, k, 0)
        x = torch.randn(1, 1, 7168, dtype=tdt)
        pos = torch.tensor([[L - 1]])
        pe = rot(x, pos)
        times = []
        for _ in range(reps + 1):
            if cache.get_seq_length() > L - 1:
                cache.crop(-1)
            t0 = time.perf_counter()
            attn(x, pe, None, cache=cache)
            times.append(time.perf_counter() - t0)
    return [1e3 * t for t in sorted(times[1:])]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(here, "..", "build"))
    ap.add_argument("--len", type=int, default=32768)
    ap.add_argument("--torch-len", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-expanded", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    a = ap.parse_args()
    print("# CPU:", next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                          if ln.startswith("model name")), "unknown"),
          f"| load average {os.getloadavg()[0]:.1f}")
    bw = json.loads(run([os.path.join(a.build, "mha"), "decode-bench", "--cache-len", "64",
                         "--steps", "1", "--threads", str(a.threads), "--stream", "2048",
                         "--json", "--attention-only"]))
    print("# read bandwidth:", {k: v for k, v in bw.items() if "stream" in k or "bw" in k})
    print(run([os.path.join(a.build, "bench", "mha_peak"), "--threads", str(a.threads),
               "--reps", "3"]).strip())
    for dtype, extra in (("bf16", [] if a.no_expanded else ["--expanded"]), ("f32", [])):
        print(run([os.path.join(a.build, "bench", "mha_bench_mla"), "--len", str(a.len),
                   "--reps", str(a.reps), "--threads", str(a.threads), "--dtype", dtype,
                   "--step", *extra]).strip())
    if not a.no_torch:
        for L in sorted({a.torch_len}):
            for dtype in ("f32", "bf16"):
                t = torch_step(L, max(2, a.reps // 2), a.threads, dtype)
                print(f"torch {dtype} L={L}: DeepseekV3Attention step median "
                      f"{statistics.median(t):.1f} ms [{t[0]:.1f}, {t[-1]:.1f}]")
            print(run([os.path.join(a.build, "bench", "mha_bench_mla"), "--len", str(L),
                       "--reps", str(a.reps), "--threads", str(a.threads), "--dtype", "bf16",
                       "--step"]).strip())


if __name__ == "__main__":
    sys.exit(main())
