#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""bench_layer_bf16.py: the issue-30 layer comparison in bfloat16, a stopgap until bench_layer.py's
documented `--dtype bf16` is wired into its argument parser (it is not yet: only the docstring).

Layer (B=1, n=2048, d_model=1024, h=16, d_k=64) causal, impl=AUTO, in one process, round robin:
  mha_layer_bf16   bf16 weights (weight_dtype), bf16 query and out (x_dtype, out_dtype)
  mha_layer_f32    mha's float32 layer on the same bf16-rounded values widened
  torch_sdpa_bf16  F.linear + F.scaled_dot_product_attention + F.linear on bf16 tensors
median, min, max of `reps` rounds after one warm-up (bench_layer.time_round_robin), and the
largest difference of each bf16 output from mha's float32 one. Reuses bench_layer.py's ctypes
binding of include/mha.h.

Usage: python3 bench/bench_layer_bf16.py build/libmha.so THREADS REPS
"""
import ctypes as C
import os
import sys

import ml_dtypes
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_layer as bl  # noqa: E402

lib, T, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(T)
mha = bl.Mha(lib)
B, n, dm, h, g, dk, causal = 1, 2048, 1024, 16, 16, 64, True
rng = np.random.default_rng(0)
BF = ml_dtypes.bfloat16


def r(shape, s):
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(s)).astype(BF)


wb = {k: r((dm, dm), dm ** -0.5) for k in ("wq", "wk", "wv", "wo")}
wb.update({k: r((dm,), 0.02) for k in ("bq", "bk", "bv", "bo")})
wf = {k: v.astype(np.float32) for k, v in wb.items()}
xb = r((B, n, dm), 1.0)
xf = xb.astype(np.float32)


def vp(a):
    return C.cast(C.c_void_p(a.ctypes.data), bl.P_f32)


f32_layer = bl.MhaLayer(mha, wf, dm, h, g, dk)
cfg = bl.Config(q_dim=dm, num_heads=h, num_kv_heads=g, head_dim=dk, bias_q=1, bias_k=1, bias_v=1,
                bias_o=1, weight_dtype=3)
wt = bl.Weights(w_q=vp(wb["wq"]), w_k=vp(wb["wk"]), w_v=vp(wb["wv"]), w_o=vp(wb["wo"]),
                b_q=vp(wb["bq"]), b_k=vp(wb["bk"]), b_v=vp(wb["bv"]), b_o=vp(wb["bo"]))
hb = C.c_void_p()
err = bl.MhaError()
mha.check(mha.lib.mha_layer_create(C.byref(cfg), C.byref(wt), 1, None, C.byref(hb),
                                   C.byref(err)), err, "create bf16")
outb = np.zeros((B, n, dm), BF)
outf = np.zeros((B, n, dm), np.float32)
a = bl.ForwardArgs(batch=B, q_len=n, kv_len=n, query=vp(xb), out=vp(outb), x_dtype=3, out_dtype=3)
a.mask.causal = 1
ex = bl.Exec(impl=0, n_threads=T)
size = C.c_size_t()
mha.check(mha.lib.mha_layer_forward_workspace_size(hb, C.byref(a), C.byref(ex), C.byref(size),
                                                   C.byref(err)), err, "ws")
ws = np.zeros(max(1, size.value), np.uint8)
ex.workspace, ex.workspace_bytes = ws.ctypes.data, ws.nbytes


def run_bf16():
    mha.check(mha.lib.mha_layer_forward(hb, C.byref(a), C.byref(ex), C.byref(err)), err, "fwd")


def run_f32():
    f32_layer.forward(xf, outf, causal, 0, T)


import torch.nn.functional as F  # noqa: E402

tw = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in wf.items()}
tx = torch.from_numpy(xf).to(torch.bfloat16)


def run_torch():
    with torch.inference_mode():
        q = F.linear(tx, tw["wq"], tw["bq"]).view(B, n, h, dk).transpose(1, 2)
        k = F.linear(tx, tw["wk"], tw["bk"]).view(B, n, g, dk).transpose(1, 2)
        v = F.linear(tx, tw["wv"], tw["bv"]).view(B, n, g, dk).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.linear(o.transpose(1, 2).reshape(B, n, h * dk), tw["wo"], tw["bo"])


res = bl.time_round_robin([run_bf16, run_f32, run_torch], reps)
yt = run_torch().float().numpy()
rel = float(np.abs(outb.astype(np.float32) - outf).max() / np.abs(outf).max())
relt = float(np.abs(yt - outf).max() / np.abs(outf).max())
print("threads=%d reps=%d torch %s, %s" % (T, reps, torch.__version__, mha.version))
for name, s in zip(("mha_layer_bf16", "mha_layer_f32", "torch_sdpa_bf16"), res):
    print("%-16s median %8.2f ms  min %8.2f  max %8.2f" % (name, s["median_ms"], s["min_ms"],
                                                          s["max_ms"]))
print("speedup bf16 vs mha f32: %.2fx; vs torch bf16: %.2fx" %
      (res[1]["median_ms"] / res[0]["median_ms"], res[2]["median_ms"] / res[0]["median_ms"]))
print("max|bf16 - f32| / max|f32| = %.2e (torch bf16: %.2e)" % (rel, relt))
mha.lib.mha_layer_destroy(hb)
