#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""bench_qk_norm.py: the cost of QK-norm and of the output gate in the layer forward (issue 31:
<= 3% over the plain layer). Not a test; never run by ctest.

One process, the same input and weights: libmha's layer forward (impl=AUTO, workspace reused)
plain, with each QK-norm kind (rms_head, rms_all, l2_after_rope) and with the Qwen3-Next output
gate (+ rms_head), and beside it torch (F.linear + scaled_dot_product_attention + F.linear) plain
and with F.rms_norm of q and k per head (transformers' Qwen3 arithmetic), and with the gate too. Round-robin: each
round runs every variant once, so a busy neighbour slows all alike; median, min and max of the
rounds; the ratio is each variant's median over the plain layer's median of the same run.

Usage: python3 bench/bench_qk_norm.py [--lib build/libmha.so] [--threads 1,2] [--reps 9]
         [--n 2048] [--d 1024] [--heads 16] [--causal]
"""
import argparse
import ctypes as C
import os
import platform
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_layer import (MHA_DTYPE_F32, Config, Exec, ForwardArgs, Mha, MhaError,  # noqa: E402
                         Weights, fptr)

KINDS = {"plain": (0, 0), "rms_head": (1, 0), "rms_all": (2, 0), "l2_after_rope": (3, 0),
         "gate+rms_head": (1, 1)}


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


class Layer:
    def __init__(self, mha, w, d, h, kind, gate):
        self.mha, self.w = mha, w
        cfg = Config(q_dim=d, num_heads=h, head_dim=d // h, weight_dtype=MHA_DTYPE_F32)
        cfg.rope.style, cfg.rope.theta = 2, 1e4  # half
        cfg.qk_norm.kind, cfg.qk_norm.eps = kind, 1e-6 if kind else 0.0
        cfg.output_gate = gate
        wt = Weights(w_q=fptr(w["wq2"] if gate else w["wq"]), w_k=fptr(w["wk"]),
                     w_v=fptr(w["wv"]), w_o=fptr(w["wo"]))
        if kind in (1, 2):
            wt.q_norm = fptr(w["qn_head"] if kind == 1 else w["qn_all"])
            wt.k_norm = fptr(w["kn_head"] if kind == 1 else w["kn_all"])
        self.handle = C.c_void_p()
        err = MhaError()
        mha.check(mha.lib.mha_layer_create(C.byref(cfg), C.byref(wt), 1, None,
                                           C.byref(self.handle), C.byref(err)), err, "create")
        self.ws = {}  # per thread count (the workspace size depends on it)

    def forward(self, x, out, causal, threads):
        B, n, _ = x.shape
        a = ForwardArgs(batch=B, q_len=n, kv_len=n, query=fptr(x), out=fptr(out))
        a.mask.causal = int(causal)
        ex = Exec(impl=0, n_threads=threads)
        err = MhaError()
        if threads not in self.ws:
            size = C.c_size_t()
            self.mha.check(self.mha.lib.mha_layer_forward_workspace_size(
                self.handle, C.byref(a), C.byref(ex), C.byref(size), C.byref(err)), err, "ws")
            self.ws[threads] = np.zeros(max(1, size.value), np.uint8)
        ws = self.ws[threads]
        ex.workspace, ex.workspace_bytes = ws.ctypes.data, ws.nbytes
        self.mha.check(self.mha.lib.mha_layer_forward(self.handle, C.byref(a), C.byref(ex),
                                                      C.byref(err)), err, "forward")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=os.path.join(HERE, "..", "build", "libmha.so"))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--causal", action="store_true")
    o = ap.parse_args()
    mha = Mha(o.lib)
    n, d, h = o.n, o.d, o.heads
    dk = d // h
    rng = np.random.default_rng(0)
    f = lambda *s: np.ascontiguousarray(rng.standard_normal(s, dtype=np.float32) * 0.03)  # noqa
    w = {"wq": f(d, d), "wk": f(d, d), "wv": f(d, d), "wo": f(d, d)}
    w["wq2"] = np.ascontiguousarray(np.concatenate([w["wq"], f(d, d)]))
    w["qn_head"], w["kn_head"] = 1 + f(dk), 1 + f(dk)
    w["qn_all"], w["kn_all"] = 1 + f(d), 1 + f(d)
    x = np.ascontiguousarray(rng.standard_normal((1, n, d), dtype=np.float32))
    layers = {k: Layer(mha, w, d, h, *v) for k, v in KINDS.items()}
    outs = {k: np.empty((1, n, d), np.float32) for k in KINDS}
    try:
        import torch
        import torch.nn.functional as F
        tw = {k: torch.from_numpy(v) for k, v in w.items()}
        tx = torch.from_numpy(x)
    except ImportError:
        torch = None
    print(f"host: {cpu_name()} ({os.cpu_count()} vCPUs); mha {mha.version}; n={n} d={d} "
          f"heads={h} causal={o.causal}; {o.reps} rounds, median [min, max] ms")

    def torch_layer(norm, gate=False):
        q = F.linear(tx, tw["wq"]).view(1, n, h, dk)
        k = F.linear(tx, tw["wk"]).view(1, n, h, dk)
        v = F.linear(tx, tw["wv"]).view(1, n, h, dk).transpose(1, 2)
        if norm:
            q = F.rms_norm(q, (dk,), tw["qn_head"], 1e-6)
            k = F.rms_norm(k, (dk,), tw["kn_head"], 1e-6)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v,
                                           is_causal=o.causal)
        a = a.transpose(1, 2).reshape(1, n, d)
        if gate:
            a = a * torch.sigmoid(F.linear(tx, tw["wq2"][d:]))
        return F.linear(a, tw["wo"])

    for threads in [int(t) for t in o.threads.split(",")]:
        if torch is not None:
            torch.set_num_threads(threads)
        runs = {k: [] for k in KINDS}
        if torch is not None:
            runs["torch_plain"], runs["torch_rms_head"], runs["torch_gate+rms_head"] = [], [], []
        for r in range(o.reps + 1):  # round 0: warm-up
            for k in runs:
                t0 = time.perf_counter()
                if k.startswith("torch"):
                    with torch.no_grad():
                        torch_layer(k != "torch_plain", k == "torch_gate+rms_head")
                else:
                    layers[k].forward(x, outs[k], o.causal, threads)
                if r:
                    runs[k].append((time.perf_counter() - t0) * 1e3)
        base = np.median(runs["plain"])
        tbase = np.median(runs["torch_plain"]) if torch is not None else None
        print(f"threads {threads}:")
        for k, ts in runs.items():
            med = np.median(ts)
            ref = tbase if k.startswith("torch") else base
            print(f"  {k:16s} {med:8.2f} [{min(ts):8.2f}, {max(ts):8.2f}]  "
                  f"x{med / ref:.3f} of {'torch_plain' if k.startswith('torch') else 'plain'}")


if __name__ == "__main__":
    main()
