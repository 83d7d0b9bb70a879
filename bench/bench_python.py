# SPDX-License-Identifier: MIT
"""Benchmark (not a test): mha.torch.MultiheadAttention against torch.nn.MultiheadAttention on
the same inputs, forward and forward+backward, in microseconds per call, plus the wrapper's own
overhead (the drop-in's time minus the bare C call on the same problem).

    MHA_LIBRARY=build/libmha.so python3 bench/bench_python.py [--threads 1] [--repeat 2000]

Default problem: n = 16 tokens, d = 64 (4 heads of 16), batch 1, self-attention, as issue 6 asks
for the call-overhead measurement; --n/--d/--heads/--batch change it.
"""
import argparse
import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import numpy as np  # noqa: E402
import torch  # noqa: E402

import mha  # noqa: E402
import mha.torch as mt  # noqa: E402
from mha import _lib as L  # noqa: E402


def timeit(fn, repeat):
    for _ in range(max(10, repeat // 10)):
        fn()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeat // 5):
            fn()
        best.append((time.perf_counter() - t0) / (repeat // 5))
    return min(best) * 1e6, sorted(best)[2] * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2000)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(a.d, a.heads, batch_first=True)
    mine = mt.MultiheadAttention(a.d, a.heads, batch_first=True, threads=a.threads)
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(a.batch, a.n, a.d)
    xg = x.clone().requires_grad_()
    print(f"# torch {torch.__version__}, mha {mha.__version__} ({mha.library_path}); "
          f"B={a.batch} n={a.n} d={a.d} h={a.heads} threads={a.threads}; microseconds per call "
          f"(best / median of 5 runs)")
    rows = []
    with torch.no_grad():
        for nm, mod in (("torch.nn.MultiheadAttention", ref), ("mha.torch.MultiheadAttention", mine)):
            rows.append((nm, "forward (no_grad, need_weights=False)",
                         timeit(lambda: mod(x, x, x, need_weights=False), a.repeat)))
    for nm, mod in (("torch.nn.MultiheadAttention", ref), ("mha.torch.MultiheadAttention", mine)):
        def fb(mod=mod):
            y, _ = mod(xg, xg, xg, need_weights=False)
            y.sum().backward()
        rows.append((nm, "forward+backward", timeit(fb, a.repeat // 2)))
    # The bare C forward on the same layer (no Python marshalling beyond one ctypes call).
    layer = mine._mha_layer(mine._params())
    xn = x.numpy()
    out = np.empty_like(xn)
    args = L.mha_forward_args()
    args.batch, args.q_len, args.kv_len = a.batch, a.n, a.n
    args.query, args.out = xn.ctypes.data, out.ctypes.data
    args.mask.window_left = args.mask.window_right = -1
    ex = L.mha_exec()
    ex.n_threads = a.threads
    err = L.mha_error()
    bare = (ctypes.byref(args), ctypes.byref(ex), ctypes.byref(err))
    rows.append(("libmha (one ctypes call)", "mha_layer_forward",
                 timeit(lambda: L.mha_layer_forward(layer._ptr, *bare), a.repeat)))
    rows.append(("mha numpy API", "layer(x)",
                 timeit(lambda: layer(xn, threads=a.threads), a.repeat)))
    for nm, what, (best, med) in rows:
        print(f"{nm:32s} {what:40s} {best:9.1f} {med:9.1f}")
    fwd_mine = rows[1][2][0]
    print(f"# wrapper overhead of the drop-in forward over the bare C call: "
          f"{fwd_mine - rows[4][2][0]:.1f} us; numpy API over bare: "
          f"{rows[5][2][0] - rows[4][2][0]:.1f} us")


if __name__ == "__main__":
    main()
