#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""mha.torch.MLA per call (issue 31 §2): a DeepSeek-V2-Lite-shaped layer (hidden 2048, 16 heads,
no q_lora_rank, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128: 14.2 M float32 weights),
batch 1, float32, in one process:
  - mha eager with the C layer cached (torch.ops.mha.mla, the default);
  - mha eager rebuilding the C layer at every call (mla_cache_clear() before each: what the
    module did before the cache, mha_mla_create copying and checking the weights);
  - mha under torch.compile(fullgraph=True) (aot_eager);
  - torch 2.13 running transformers' DeepseekV3Attention (eager attention) on the same weights;
forward for n = 1, 16, 128 tokens and forward + backward for n = 128. Median [min, max] of --reps.

Usage: python3 bench/bench_mla_torch.py [--reps 9] [--threads 1]
"""
import argparse
import statistics
import time

import torch
import transformers as T

import mha.torch as mt
from mha import _torch_ops as O


def timed(fn, reps):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, min(ts) * 1e3, max(ts) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = T.DeepseekV3Config(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                             q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128, num_hidden_layers=1,
                             rope_interleave=True, vocab_size=64, intermediate_size=64,
                             moe_intermediate_size=64, n_routed_experts=2, num_experts_per_tok=1,
                             n_group=1, topk_group=1)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = T.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(cfg, 0).eval()
    rot = T.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.02)
        hf.kv_a_layernorm.weight.fill_(1.0)
    import tempfile

    from safetensors.torch import save_file
    d = tempfile.mkdtemp()
    cfg.save_pretrained(d)
    save_file({f"model.layers.0.self_attn.{k}": v.contiguous()
               for k, v in hf.state_dict().items()}, f"{d}/model.safetensors")
    mod = mt.MLA.from_pretrained(d, 0, threads=a.threads)
    comp = torch.compile(mod, fullgraph=True, backend="aot_eager")
    print(f"threads {a.threads}, reps {a.reps}: median [min, max] ms per call")
    for n in (1, 16, 128):
        x = torch.randn(1, n, 2048) * 0.5
        pe = rot(x, torch.arange(n)[None])
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]

        def rebuild():
            O.mla_cache_clear()
            mod(x)
        rows = {"mha cached": lambda: mod(x), "mha rebuilt per call": rebuild,
                "mha compiled": lambda: comp(x),
                "torch HF module": lambda: hf(x, pe, mask)[0]}
        with torch.no_grad():
            for k, f in rows.items():
                print(f"  n={n:4d} forward  {k:22s} %.2f [%.2f, %.2f]" % timed(f, a.reps))
    x = (torch.randn(1, 128, 2048) * 0.5).requires_grad_()
    dy = torch.randn(1, 128, 2048)
    pe = rot(x, torch.arange(128)[None])
    mask = torch.full((128, 128), float("-inf")).triu(1)[None, None]

    def step_rebuild():
        O.mla_cache_clear()
        mod(x).backward(dy)
    rows = {"mha cached": lambda: mod(x).backward(dy), "mha rebuilt per call": step_rebuild,
            "mha compiled": lambda: comp(x).backward(dy),
            "torch HF module": lambda: hf(x, pe, mask)[0].backward(dy)}
    for k, f in rows.items():
        print(f"  n= 128 fwd+bwd  {k:22s} %.2f [%.2f, %.2f]" % timed(f, a.reps))


if __name__ == "__main__":
    main()
