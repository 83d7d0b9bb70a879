#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""bench_backward.py: forward+backward of the attention layer (issue 4). Not a test.

In one process, on the same inputs and weights, times one training step (forward + backward, all
input/weight/bias gradients) of
  mha        mha_layer_forward_train + mha_layer_backward (impl=AUTO: packed GEMM projections,
             flash backward of the core)
  mha_cache  the same with an mha_block_cache as exec.allocator (steps reuse their memory)
  torch_mha  torch.nn.MultiheadAttention (batch_first, causal attn_mask + is_causal), .backward()
  torch_sdpa F.linear + F.scaled_dot_product_attention(is_causal) + F.linear, .backward()
with torch.set_num_threads = mha n_threads, median of >= 3 runs after a warm-up, round robin.

--dtype bf16 (issue 30) adds, on the same bfloat16-rounded inputs and weights (every row gets them):
  mha_bf16_cache      the step with bf16 weights (weight_dtype), bf16 x, y, dy and dx, float32
                      weight gradients (the C contract), block cache allocator
  mha_torch_autocast  mha.torch.MultiheadAttention (float32 parameters) under
                      torch.autocast('cpu', bf16): the drop-in's step as a user runs it (the C
                      layer with the weights in bf16 is built once: the weights do not change)
  torch_mha_autocast  nn.MultiheadAttention under the same autocast, .backward()
  torch_sdpa_autocast F.linear + SDPA + F.linear under the same autocast, .backward()
--out FILE writes one JSON row per (n, threads, impl) with host, tier, dtype, median/min/max ms.

FLOPs (FlashAttention convention, docs/BENCHMARKS.md): attention forward 2*B*h*P*(d_k + d_v) with
P = n(n+1)/2 unmasked pairs (causal), backward = 2.5 x forward; projections 2*rows*in*out forward
and 2x that backward (dX and dW). fwd+bwd = 3.5 x attn_fwd + 3 x proj_fwd.
% of peak uses the FMA peak measured by bench/peak.c (mha_peak) in the same run when found.
Peak RSS of one mha training step is measured in a fresh process per n (VmHWM).

Usage: python3 bench/bench_backward.py [--lib build/libmha.so] [--threads 1,2] [--reps 3]
                                       [--n 2048,8192] [--no-torch] [--peak build/bench/mha_peak]
                                       [--dtype f32|bf16] [--out results.jsonl] [--no-rss]
"""
import argparse
import ctypes as C
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_layer import (MHA_DTYPE_BF16, MHA_DTYPE_F32, Config, Exec,  # noqa: E402
                         ForwardArgs, MhaError, Weights, fptr, from_bf16, machine_info,
                         measure_peak, to_bf16, vm_hwm_kb)

P_f32 = C.POINTER(C.c_float)


class LayerGrads(C.Structure):
    _fields_ = [(n, P_f32) for n in ("d_query", "d_key", "d_value", "dw_q", "dw_k", "dw_v",
                                     "dw_o", "db_q", "db_k", "db_v", "db_o", "d_sinks")] + \
               [("accumulate", C.c_int32)] + [(n, P_f32) for n in ("d_q_norm", "d_k_norm")]


class Mha:
    def __init__(self, path):
        L = self.lib = C.CDLL(path)
        L.mha_layer_create.argtypes = [C.POINTER(Config), C.POINTER(Weights), C.c_int, C.c_void_p,
                                       C.POINTER(C.c_void_p), C.POINTER(MhaError)]
        L.mha_layer_destroy.argtypes = [C.c_void_p]
        L.mha_layer_forward_train.argtypes = [C.c_void_p, C.POINTER(ForwardArgs),
                                              C.POINTER(Exec), C.POINTER(C.c_void_p),
                                              C.POINTER(MhaError)]
        L.mha_layer_backward.argtypes = [C.c_void_p, C.c_void_p, P_f32, C.POINTER(LayerGrads),
                                         C.POINTER(Exec), C.POINTER(MhaError)]
        L.mha_train_state_destroy.argtypes = [C.c_void_p]
        L.mha_block_cache_create.argtypes = [C.c_size_t, C.POINTER(C.c_void_p),
                                             C.POINTER(MhaError)]
        L.mha_block_cache_allocator.argtypes = [C.c_void_p]
        L.mha_block_cache_allocator.restype = C.c_void_p
        L.mha_block_cache_destroy.argtypes = [C.c_void_p]

    @staticmethod
    def check(st, err, what):
        if st:
            raise RuntimeError(f"{what}: status {st}: {err.message.decode()}")


def make(n, dm, h, seed=1234):
    rng = np.random.default_rng(seed)
    dk = dm // h
    s = 1.0 / np.sqrt(dm)

    def r(*shape, scale=1.0):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
    w = dict(wq=r(dm, dm, scale=s), wk=r(dm, dm, scale=s), wv=r(dm, dm, scale=s),
             wo=r(dm, dm, scale=s), bq=r(dm, scale=0.1), bk=r(dm, scale=0.1),
             bv=r(dm, scale=0.1), bo=r(dm, scale=0.1))
    return r(1, n, dm), r(1, n, dm), w, dk


class MhaStep:
    """One training step of mha; with `cache`, every allocation goes through an mha_block_cache
    (exec.allocator), so steps after the first reuse the first step's memory."""

    def __init__(self, mha, x, dy, w, dm, h, threads, cache=False, dtype=MHA_DTYPE_F32):
        # dtype: of the weights, x, y, dy and dx (bf16: uint16 arrays of bits, to_bf16);
        # the weight gradients are float32 whatever it is.
        self.mha, self.x, self.dy, self.w, self.dtype = mha, x, dy, w, dtype
        cfg = Config(q_dim=dm, num_heads=h, bias_q=1, bias_k=1, bias_v=1, bias_o=1,
                     weight_dtype=dtype)
        wt = Weights(w_q=fptr(w["wq"]), w_k=fptr(w["wk"]), w_v=fptr(w["wv"]), w_o=fptr(w["wo"]),
                     b_q=fptr(w["bq"]), b_k=fptr(w["bk"]), b_v=fptr(w["bv"]), b_o=fptr(w["bo"]))
        self.layer = C.c_void_p()
        err = MhaError()
        mha.check(mha.lib.mha_layer_create(C.byref(cfg), C.byref(wt), 1, None,
                                           C.byref(self.layer), C.byref(err)), err, "create")
        self.y = np.empty_like(x)
        self.g = {k: np.empty(v.shape, np.float32) for k, v in w.items()}
        self.dx = np.empty_like(x)
        self.ex = Exec(impl=0, n_threads=threads)
        self.cache = C.c_void_p()
        if cache:
            mha.check(mha.lib.mha_block_cache_create(0, C.byref(self.cache), C.byref(err)), err,
                      "block cache")
            self.ex.allocator = mha.lib.mha_block_cache_allocator(self.cache)

    def __call__(self):
        B, n, _ = self.x.shape
        a = ForwardArgs(batch=B, q_len=n, kv_len=n, query=fptr(self.x), out=fptr(self.y),
                        x_dtype=self.dtype, out_dtype=self.dtype)
        a.mask.causal = 1
        st, err = C.c_void_p(), MhaError()
        L = self.mha.lib
        self.mha.check(L.mha_layer_forward_train(self.layer, C.byref(a), C.byref(self.ex),
                                                 C.byref(st), C.byref(err)), err, "fwd_train")
        g = self.g
        gr = LayerGrads(d_query=fptr(self.dx), dw_q=fptr(g["wq"]), dw_k=fptr(g["wk"]),
                        dw_v=fptr(g["wv"]), dw_o=fptr(g["wo"]), db_q=fptr(g["bq"]),
                        db_k=fptr(g["bk"]), db_v=fptr(g["bv"]), db_o=fptr(g["bo"]))
        rc = L.mha_layer_backward(self.layer, st, fptr(self.dy), C.byref(gr), C.byref(self.ex),
                                  C.byref(err))
        L.mha_train_state_destroy(st)
        self.mha.check(rc, err, "backward")

    def close(self):
        self.mha.lib.mha_layer_destroy(self.layer)
        self.mha.lib.mha_block_cache_destroy(self.cache)


def torch_steps(torch, x, dy, w, dm, h):
    import torch.nn.functional as F
    n = x.shape[1]
    dk = dm // h
    t = {k: torch.from_numpy(v.copy()).requires_grad_(True) for k, v in w.items()}
    X = torch.from_numpy(x.copy()).requires_grad_(True)
    DY = torch.from_numpy(dy)
    m = torch.nn.MultiheadAttention(dm, h, bias=True, batch_first=True)
    with torch.no_grad():
        m.in_proj_weight.copy_(torch.cat([t["wq"], t["wk"], t["wv"]], 0))
        m.in_proj_bias.copy_(torch.cat([t["bq"], t["bk"], t["bv"]], 0))
        m.out_proj.weight.copy_(t["wo"])
        m.out_proj.bias.copy_(t["bo"])
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)

    def run_mha():
        m.zero_grad(set_to_none=True)
        X.grad = None
        y = m(X, X, X, need_weights=False, attn_mask=mask, is_causal=True)[0]
        y.backward(DY)

    def run_sdpa():
        for v in t.values():
            v.grad = None
        X.grad = None
        q = F.linear(X, t["wq"], t["bq"]).view(1, n, h, dk).transpose(1, 2)
        k = F.linear(X, t["wk"], t["bk"]).view(1, n, h, dk).transpose(1, 2)
        v = F.linear(X, t["wv"], t["bv"]).view(1, n, h, dk).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = F.linear(o.transpose(1, 2).reshape(1, n, dm), t["wo"], t["bo"])
        y.backward(DY)
    return run_mha, run_sdpa


def torch_autocast_steps(torch, x, dy, w, dm, h, lib):
    """(mha.torch drop-in step, nn.MultiheadAttention step, SDPA step), each under
    torch.autocast('cpu', bf16) with float32 parameters holding w."""
    import torch.nn.functional as F
    os.environ.setdefault("MHA_LIBRARY", lib)
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import mha.torch as mt
    n = x.shape[1]
    dk = dm // h
    t = {k: torch.from_numpy(v.copy()).requires_grad_(True) for k, v in w.items()}
    X = torch.from_numpy(x.copy()).requires_grad_(True)
    DY = torch.from_numpy(dy).to(torch.bfloat16)
    mods = []
    for cls in (mt.MultiheadAttention, torch.nn.MultiheadAttention):
        m = cls(dm, h, bias=True, batch_first=True)
        with torch.no_grad():
            m.in_proj_weight.copy_(torch.cat([t["wq"], t["wk"], t["wv"]], 0))
            m.in_proj_bias.copy_(torch.cat([t["bq"], t["bk"], t["bv"]], 0))
            m.out_proj.weight.copy_(t["wo"])
            m.out_proj.bias.copy_(t["bo"])
        mods.append(m)
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)

    def module_step(m, ours):
        def run():
            m.zero_grad(set_to_none=True)
            X.grad = None
            with torch.autocast("cpu", dtype=torch.bfloat16):
                if ours:  # (mha's is_causal is its rule; torch's module needs the mask)
                    y = m(X, X, X, need_weights=False, is_causal=True)[0]
                else:
                    y = m(X, X, X, need_weights=False, attn_mask=mask, is_causal=True)[0]
            y.backward(DY)
        return run

    def run_sdpa():
        for v in t.values():
            v.grad = None
        X.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            q = F.linear(X, t["wq"], t["bq"]).view(1, n, h, dk).transpose(1, 2)
            k = F.linear(X, t["wk"], t["bk"]).view(1, n, h, dk).transpose(1, 2)
            v = F.linear(X, t["wv"], t["bv"]).view(1, n, h, dk).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y = F.linear(o.transpose(1, 2).reshape(1, n, dm), t["wo"], t["bo"])
        y.backward(DY)
    return module_step(mods[0], True), module_step(mods[1], False), run_sdpa


def flops(n, dm, h):
    dk = dm // h
    attn_fwd = 2 * h * (n * (n + 1) // 2) * (dk + dk)
    proj_fwd = 4 * 2 * n * dm * dm
    return 3.5 * attn_fwd + 3 * proj_fwd


def timeit(fns, reps):
    for f in fns:
        f()
    ts = [[] for _ in fns]
    for _ in range(reps):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            f()
            ts[i].append(time.perf_counter() - t0)
    return [dict(median=sorted(t)[len(t) // 2], min=min(t), max=max(t)) for t in ts]


def rss_child(lib, n, dm, h, threads):
    mha = Mha(lib)
    x, dy, w, _ = make(n, dm, h)
    step = MhaStep(mha, x, dy, w, dm, h, threads)
    step()
    print(json.dumps({"n": n, "vm_hwm_kb": vm_hwm_kb()}))


def find(cands):
    for c in cands:
        if c and os.path.exists(c):
            return c
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lib", default=None)
    ap.add_argument("--peak", default=None)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--n", default="2048,8192")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--dtype", default="f32", choices=("f32", "bf16"))
    ap.add_argument("--out", default=None, help="JSONL file for the rows")
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS child runs")
    ap.add_argument("--rss-child", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    bf16 = args.dtype == "bf16"
    lib = find([args.lib, os.path.join(ROOT, "build", "libmha.so"),
                os.path.join(ROOT, "build-bwd", "libmha.so")])
    dm, h = 1024, 16
    if args.rss_child:
        rss_child(lib, args.rss_child, dm, h, int(args.threads.split(",")[0]))
        return
    threads = [int(t) for t in args.threads.split(",")]
    ns = [int(v) for v in args.n.split(",")]
    info = machine_info()
    print(f"# {info.get('cpu', '?')} | {info.get('simd_flags', '')} | lib {lib}")
    peak = {}
    pb = find([args.peak, os.path.join(ROOT, "build", "bench", "mha_peak"),
               os.path.join(ROOT, "build-bwd", "bench", "mha_peak")])
    if pb:
        try:
            _, peak = measure_peak(pb, threads)
        except Exception as e:  # noqa: BLE001
            print(f"# peak measurement failed: {e}")
    torch = None
    if not args.no_torch:
        try:
            import torch as _t
            torch = _t
        except ImportError:
            print("# torch not importable: no PyTorch columns")
    mha = Mha(lib)
    host = "%s (%s)" % (info.get("cpu"), platform.node())
    tier = os.environ.get("MHA_MAX_ISA") or (peak[threads[0]][0] if peak else None)
    fout = open(args.out, "a") if args.out else None
    print("# FLOPs: 3.5 x attention forward (2*h*n(n+1)/2*(dk+dv)) + 3 x projection forward "
          "(8*n*d^2); B=1, d_model=1024, h=16, d_k=64, causal, all gradients")
    print(f"{'n':>6} {'thr':>3} {'impl':>19} {'ms':>10} {'min':>8} {'max':>8} {'GFLOP/s':>8} "
          f"{'%peak':>6} {'mha, mha_cache speed-up':>23}")
    rows = []
    for n in ns:
        x, dy, w, _ = make(n, dm, h)
        if bf16:  # every row gets the same bf16-rounded values (float32 rows: widened)
            xb, dyb, wb = to_bf16(x), to_bf16(dy), {k: to_bf16(v) for k, v in w.items()}
            x, dy, w = from_bf16(xb), from_bf16(dyb), {k: from_bf16(v) for k, v in wb.items()}
        fl = flops(n, dm, h)
        for t in threads:
            step = MhaStep(mha, x, dy, w, dm, h, t)
            cached = MhaStep(mha, x, dy, w, dm, h, t, cache=True)
            fns, names, steps = [step, cached], ["mha", "mha_cache"], [step, cached]
            if bf16:
                sb = MhaStep(mha, xb, dyb, wb, dm, h, t, cache=True, dtype=MHA_DTYPE_BF16)
                fns.append(sb)
                steps.append(sb)
                names.append("mha_bf16_cache")
            if torch is not None:
                torch.set_num_threads(t)
                a, b = torch_steps(torch, x, dy, w, dm, h)
                fns += [a, b]
                names += ["torch_mha", "torch_sdpa"]
                if bf16:
                    fns += list(torch_autocast_steps(torch, x, dy, w, dm, h, lib))
                    names += ["mha_torch_autocast", "torch_mha_autocast", "torch_sdpa_autocast"]
            ts = timeit(fns, args.reps)
            for st in steps:
                st.close()
            pk = peak.get(t, (None, None))[1]
            for name, tt in zip(names, ts):
                s = tt["median"]
                gf = fl / s / 1e9
                pct = f"{100 * gf / pk:5.1f}" if pk else "   - "
                sp = (f"{s / ts[0]['median']:6.2f}x {s / ts[1]['median']:5.2f}x"
                      if name.startswith("torch") else f"{'':>14}")
                print(f"{n:>6} {t:>3} {name:>19} {1e3 * s:10.1f} {1e3 * tt['min']:8.1f} "
                      f"{1e3 * tt['max']:8.1f} {gf:8.1f} {pct:>6} {sp}")
                r = dict(bench="train_step", host=host, tier=tier, dtype=args.dtype, n=n,
                         d_model=dm, h=h, causal=True, threads=t, impl=name, ms=1e3 * s,
                         median_ms=1e3 * s, min_ms=1e3 * tt["min"], max_ms=1e3 * tt["max"],
                         runs=args.reps, gflops=gf)
                rows.append(r)
                if fout:
                    fout.write(json.dumps(r) + "\n")
                    fout.flush()
    for n in ([] if args.no_rss else ns):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--lib", lib,
                              "--rss-child", str(n), "--threads", str(threads[0])],
                             capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"# peak RSS of one mha training step (fresh process), n={n}: "
              f"{r['vm_hwm_kb'] / 1024:.0f} MiB")
    if peak:
        print("# measured FMA peak (GFLOP/s): " +
              ", ".join(f"{t} thr {v[1]:.0f} ({v[0]})" for t, v in sorted(peak.items())))


if __name__ == "__main__":
    main()
