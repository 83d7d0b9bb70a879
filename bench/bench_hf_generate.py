# SPDX-License-Identifier: MIT
"""Greedy `model.generate` tokens/s of a small random transformers decoder (Qwen2-shaped:
hidden 256, 4 layers, 8 query heads / 2 KV heads of 32, vocab 1024; float32; no hub) with
attn_implementation="sdpa" against "mha" (mha.torch.register_hf_attention) with transformers'
DynamicCache, and "mha" with mha.torch.MhaCache (mha's C KV cache, --cache-dtypes, contiguous), at
1 and 2 threads (torch.set_num_threads for the whole model, the same count for mha's calls), same
process, runs interleaved. End to end: the projections, MLPs and sampling loop are torch's in
all, so the ratio is bounded by the attention's share. Prints median [min, max] of --repeat runs
and the ratio of medians to sdpa's. Not a test.

  MHA_LIBRARY=build/libmha.so PYTHONPATH=python python bench/bench_hf_generate.py
"""
import argparse
import statistics
import time

import torch
import transformers as T

import mha.torch as mt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--cache-dtypes", default="float32,bfloat16",
                    help="MhaCache storage dtypes to time (comma-separated; '' for none)")
    a = ap.parse_args()
    cfg = T.Qwen2Config(vocab_size=1024, hidden_size=256, intermediate_size=512,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                        max_position_embeddings=4096)
    torch.manual_seed(0)
    model = T.Qwen2ForCausalLM(cfg).eval()
    ids = torch.randint(1, 1024, (a.batch, a.prompt))  # (no pad_token_id 0: no padding)
    kw = dict(max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False, pad_token_id=0)
    print(f"greedy generate: batch {a.batch}, prompt {a.prompt}, {a.new} new tokens, float32, "
          f"median [min, max] of {a.repeat}")
    for t in (int(x) for x in a.threads.split(",")):
        torch.set_num_threads(t)
        name = mt.register_hf_attention(f"mha_{t}t", threads=t)
        impls = {"sdpa": ("sdpa", None), "mha": (name, None)}
        for dt in filter(None, a.cache_dtypes.split(",")):
            impls[f"mha+MhaCache({dt})"] = (name, dt)
        times = {k: [] for k in impls}
        toks = {}
        for r in range(a.repeat + 1):  # the first round warms up
            for k, (impl, dt) in impls.items():
                model.set_attn_implementation(impl)
                extra = {} if dt is None else {
                    "cache": mt.MhaCache(model.config, max_seq=a.prompt + a.new, dtype=dt)}
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(ids, **kw, **extra)
                dt = time.perf_counter() - t0
                if r:
                    times[k].append(a.batch * a.new / dt)
                toks[k] = out
        med = {k: statistics.median(v) for k, v in times.items()}
        for k, v in times.items():
            same = torch.equal(toks["sdpa"], toks[k])
            print(f"  threads {t} {k:22s}: {med[k]:8.1f} tokens/s [{min(v):.1f}, {max(v):.1f}]"
                  f"  {med[k] / med['sdpa']:.2f}x sdpa (same tokens: {same})")


if __name__ == "__main__":
    main()
