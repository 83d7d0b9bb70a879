#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""bench_half.py: the attention core forward in bf16 and float32, mha beside torch's SDPA, in
one process (issue 30). Not a test; never run by ctest.

Shape (B, h, n, d) = (1, 16, 2048, 64) by default, [B, h, n, d] contiguous, n = m, non-causal and
causal, 1 and 2 threads. Rows, run round-robin (every round runs each row once, so a busy
neighbour slows them alike), median [min, max] of --reps (>= 5) timed rounds after 1 warm-up:

  mha_f32     mha_attention (libmha through ctypes: mha._lib), float32 q/k/v/out
  mha_bf16    the same with q/k/v/out bf16 (uint16 buffers, MHA_DTYPE_BF16): on an AVX512-BF16
              CPU the kernel mha_fwd_bf16_flash_q64k64__avx512bf16
  torch_f32   torch.nn.functional.scaled_dot_product_attention, float32
  torch_bf16  the same in bfloat16 (torch.set_num_threads(T))

All rows see the same bf16-rounded inputs. GFLOP/s = 2 h P (2 d) / time, P = n^2 or n (n + 1) / 2
(causal). Usage (from the build tree):
  MHA_LIBRARY=build/libmha.so PYTHONPATH=python .venv/bin/python bench/bench_half.py [--reps 5]
"""
import argparse
import ctypes
import platform
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from mha import _lib as L


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def mha_call(q, k, v, out, dtype, causal, threads):
    """A closure running mha_attention on the [1, h, n, d] numpy buffers (float32 or uint16)."""
    _, h, n, d = q.shape
    a = L.mha_attention_args()
    a.batch, a.num_heads, a.num_kv_heads, a.q_len, a.kv_len = 1, h, h, n, n
    a.head_dim = a.v_head_dim = d
    for name, arr in (("q", q), ("k", k), ("v", v), ("out", out)):
        setattr(a, name, arr.ctypes.data)
        getattr(a, name + "_strides")[:] = (h * n * d, n * d, d)  # [B, h, n, d]
    a.q_dtype = a.k_dtype = a.v_dtype = a.out_dtype = dtype
    a.mask.causal = int(causal)
    ex = L.mha_exec()
    ex.impl, ex.n_threads = 0, threads
    err = L.mha_error()
    size = ctypes.c_size_t()
    if L.lib.mha_attention_workspace_size(ctypes.byref(a), ctypes.byref(ex), ctypes.byref(size),
                                          ctypes.byref(err)):
        raise RuntimeError(err.message.decode())
    ws = np.empty(size.value + 64, np.uint8)
    ex.workspace, ex.workspace_bytes = ws.ctypes.data, size.value

    def run():
        if L.mha_attention(ctypes.byref(a), ctypes.byref(ex), ctypes.byref(err)):
            raise RuntimeError(err.message.decode())
    run.keep = (a, ex, ws, err)  # the buffers the struct points to
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    assert args.reps >= 5
    h, n, d = args.heads, args.n, args.dim
    g = torch.Generator().manual_seed(0)
    qkv_bf = [torch.rand(1, h, n, d, generator=g).mul_(2).sub_(1).bfloat16() for _ in range(3)]
    qkv_f = [x.float().contiguous() for x in qkv_bf]
    qkv_h = [x.view(torch.int16).numpy().view(np.uint16).copy() for x in qkv_bf]
    qkv_np = [x.numpy() for x in qkv_f]
    print(f"# bench_half.py: core forward B=1 h={h} n=m={n} d={d}; mha "
          f"{L.mha_version().decode()} ({L.library_path}), torch {torch.__version__}")
    isas = L.lib.mha_experimental_cpu_isas
    isas.restype, isas.argtypes = ctypes.c_char_p, [ctypes.c_int32]
    print(f"# CPU: {cpu_name()}; mha kernel tiers: {isas(1).decode()}")
    print(f"# median [min, max] ms of {args.reps} round-robin rounds after 1 warm-up")
    print(f"{'causal':6} {'T':>2} {'row':11} {'median ms':>10} {'[min, max]':>20} {'GFLOP/s':>8}")
    for causal in (False, True):
        for T in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(T)
            out_f = np.empty((1, h, n, d), np.float32)
            out_h = np.empty((1, h, n, d), np.uint16)
            rows = {
                "mha_f32": mha_call(*qkv_np, out_f, L.DTYPE_F32, causal, T),
                "mha_bf16": mha_call(*qkv_h, out_h, L.DTYPE_BF16, causal, T),
                "torch_f32": lambda: F.scaled_dot_product_attention(*qkv_f, is_causal=causal),
                "torch_bf16": lambda: F.scaled_dot_product_attention(*qkv_bf, is_causal=causal),
            }
            times = {k: [] for k in rows}
            for r in range(args.reps + 1):
                for name, fn in rows.items():
                    t0 = time.perf_counter()
                    fn()
                    if r:
                        times[name].append(time.perf_counter() - t0)
            pairs = n * (n + 1) / 2 if causal else n * n
            flop = 2 * h * pairs * 2 * d
            med = {}
            for name, ts in times.items():
                med[name] = statistics.median(ts)
                print(f"{'yes' if causal else 'no':6} {T:2} {name:11} {1e3 * med[name]:10.2f} "
                      f"{1e3 * min(ts):9.2f}, {1e3 * max(ts):8.2f} {flop / med[name] * 1e-9:8.1f}")
            # bf16 output of mha against torch's bf16 and mha's f32 (same rounded inputs)
            ref = torch.from_numpy(out_f)
            mine = torch.from_numpy(out_h.view(np.int16)).view(torch.bfloat16).float()
            tb = F.scaled_dot_product_attention(*qkv_bf, is_causal=causal).float()
            scale = ref.abs().max().item()
            print(f"       ratios: mha_f32/mha_bf16 {med['mha_f32'] / med['mha_bf16']:.2f}x, "
                  f"torch_bf16/mha_bf16 {med['torch_bf16'] / med['mha_bf16']:.2f}x, "
                  f"torch_f32/mha_f32 {med['torch_f32'] / med['mha_f32']:.2f}x; "
                  f"max|diff|/max|f32|: mha_bf16 {(mine - ref).abs().max().item() / scale:.1e}, "
                  f"torch_bf16 {(tb - ref).abs().max().item() / scale:.1e}")


if __name__ == "__main__":
    main()
