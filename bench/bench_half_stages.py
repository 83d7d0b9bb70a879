#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""bench_half_stages.py: a bf16 Qwen3 attention layer (QK-norm RMS_HEAD + RoPE) or Qwen3-Next
full-attention layer (+ output gate), E = 1024, 16 heads, 8 kv heads, d = 64, causal, batch 1,
n tokens, through the torch drop-in (mha.torch.MultiheadAttention.from_pretrained(...).to(bf16),
the library named by MHA_LIBRARY) beside transformers' own module in bf16 (SDPA), 1 thread, in one
process. Prints one JSON row: median, min, max ms of 7 repeats each, and the largest difference
of the two outputs relative to max|torch|. Not a test; never run by ctest. Compare two libraries
(before/after a change) by running it once per library, interleaved.

Usage: MHA_LIBRARY=build/libmha.so PYTHONPATH=python python3 bench/bench_half_stages.py
         qwen3|qwen3_next [n]
"""
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import torch  # noqa: E402
import transformers as T  # noqa: E402

import mha.torch as mt  # noqa: E402

torch.set_num_threads(1)
name = sys.argv[1]
kw = dict(vocab_size=64, num_hidden_layers=1, hidden_size=1024, intermediate_size=64,
          num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096)
if name == "qwen3":
    cfg = T.Qwen3Config(**kw)
    model = T.Qwen3ForCausalLM(cfg)
    attn = model.model.layers[0].self_attn
else:
    cfg = T.Qwen3NextConfig(**kw, layer_types=["full_attention"], num_experts=2,
                            num_experts_per_tok=1, moe_intermediate_size=64,
                            shared_expert_intermediate_size=64)
    model = T.Qwen3NextForCausalLM(cfg)
    attn = model.model.layers[0].self_attn
torch.manual_seed(0)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0.0, 0.03)
model = model.to(torch.bfloat16).eval()
d = tempfile.mkdtemp()
model.save_pretrained(d)
t = mt.MultiheadAttention.from_pretrained(d, 0, batch_first=True, threads=1).to(torch.bfloat16)
n = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
x = torch.randn(1, n, 1024).to(torch.bfloat16)
def med(f, reps=7):
    f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); f(); ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return ts[len(ts) // 2], ts[0], ts[-1]
model.config._attn_implementation = "sdpa"
attn.config._attn_implementation = "sdpa"
pos = torch.arange(n)[None]
with torch.no_grad():
    pe = model.model.rotary_emb(x, pos)
    y_t = attn(hidden_states=x, position_embeddings=pe, attention_mask=None)[0]
    y_m = t(x, x, x, need_weights=False)[0]
    rel = ((y_m.double() - y_t.double()).abs().max() / y_t.double().abs().max()).item()
    m = med(lambda: t(x, x, x, need_weights=False))
    tt = med(lambda: attn(hidden_states=x, position_embeddings=pe, attention_mask=None))
cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")), "?") if os.path.exists("/proc/cpuinfo") else "?"
print(json.dumps({"model": name, "n": n, "lib": os.environ.get("MHA_LIBRARY"), "cpu": cpu,
                  "threads": 1, "mha_ms": m, "torch_bf16_sdpa_ms": tt,
                  "max_rel_diff_vs_torch": rel}))
