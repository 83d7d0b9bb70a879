# SPDX-License-Identifier: MIT
"""Benchmark (not a test): the Python wrapper's per-call overhead, and mha.torch.MultiheadAttention
against torch.nn.MultiheadAttention on the same inputs (forward, forward+backward).

    python3 bench/bench_python.py [--threads 1] [--samples 300]     # the pip-installed mha
    MHA_LIBRARY=build/libmha.so MHA_PYTHON_DIR=python python3 bench/bench_python.py

The package is imported from MHA_PYTHON_DIR when set, else as installed (`pip install ./python`
builds the compiled fast path, mha._fastcall; a source tree has none, and the header line says
so: then every call takes the ctypes path).

Every variant is timed in samples of back-to-back calls (as many as take ~2 ms, at least 5); the
variants are interleaved round-robin, so drift in the machine's load hits them alike. The clock
is this thread's CPU time by default (--clock wall for elapsed time): on a shared machine, time
spent preempted by other processes does not count (their effect on caches still does). Reported
per call, in microseconds: the median over the samples and the 10th-90th percentile spread.
Overheads are *paired*: in each round the reference sample is subtracted from the sample taken
right next to it, and the median [p10, p90] of those differences is printed.

Variants (self-attention, need_weights=False, batch_first, float32, one thread):
  ctypes floor       mha_layer_destroy(NULL): one ctypes call that does nothing in C
  C forward          mha_layer_forward through ctypes, structs built once, output preallocated
  NumPy API          layer(x) (mha.MultiheadAttention): the compiled fast path (mha._fastcall)
  NumPy API (ctypes) the same call with the fast path switched off: the general ctypes path
  minimal Module     an nn.Module whose forward is torch.empty + the C forward call: the least
                     any torch module around mha pays (module call machinery, one allocation)
  drop-in forward    mha.torch.MultiheadAttention under torch.no_grad() (the fast path)
  drop-in (ctypes)   the same with the fast path switched off
  torch forward      torch.nn.MultiheadAttention under torch.no_grad()
  C fwd+bwd          mha_layer_forward_train + mha_layer_backward + state free, structs built
                     once, gradients (input and every parameter) preallocated
  minimal autograd   an autograd.Function doing only that (output allocated, dy made
                     contiguous, prebuilt gradients returned), y.sum().backward(): the least any
                     autograd op around mha pays
  drop-in fwd+bwd    y, _ = mha(x, x, x, need_weights=False); y.sum().backward()
  torch fwd+bwd      the same with torch.nn.MultiheadAttention

Default problems: n = 16 tokens, d = 64, 4 heads, batch 1 (issue 6's call-overhead size) and
n = 128, d = 256, 8 heads, batch 2; --size N,D,H,B (repeatable) picks others.
"""
import argparse
import ctypes
import os
import statistics
import sys
import time

if os.environ.get("MHA_PYTHON_DIR"):
    sys.path.insert(0, os.environ["MHA_PYTHON_DIR"])
import numpy as np  # noqa: E402
import torch  # noqa: E402

import mha  # noqa: E402
import mha.torch as mt  # noqa: E402
from mha import _api  # noqa: E402
from mha import _lib as L  # noqa: E402


CLOCKS = {"thread": time.thread_time_ns, "wall": time.perf_counter_ns}


def pct(xs, q):
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))
    return xs[i]


def run(size, threads, samples, clock):
    n, d, h, b = size
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(d, h, batch_first=True)
    mine = mt.MultiheadAttention(d, h, batch_first=True, threads=threads)
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(b, n, d)
    xg = x.clone().requires_grad_()
    layer = mine._mha_layer(mine._params())
    xn = x.numpy()

    # The bare C calls on the same layer: structs built once, buffers preallocated.
    out = np.empty_like(xn)
    fa = L.mha_forward_args()
    fa.batch, fa.q_len, fa.kv_len = b, n, n
    fa.query, fa.out = xn.ctypes.data, out.ctypes.data
    fa.mask.window_left = fa.mask.window_right = -1
    ex = L.mha_exec()
    ex.n_threads = threads
    err = L.mha_error()
    lp = layer._ptr
    fwd_c, train_c, bwd_c, free_c = (L.mha_layer_forward, L.mha_layer_forward_train,
                                     L.mha_layer_backward, L.mha_train_state_destroy)
    destroy = L.mha_layer_destroy
    dy = np.ones_like(xn)
    grads = L.mha_layer_grads()
    gbufs = {"d_query": np.empty_like(xn), "dw_q": np.empty((3 * d, d), np.float32),
             "dw_o": np.empty((d, d), np.float32), "db_q": np.empty(3 * d, np.float32),
             "db_o": np.empty(d, np.float32)}
    for f, arr in gbufs.items():
        setattr(grads, f, arr.ctypes.data)
    grads.dw_k, grads.dw_v = grads.dw_q + 4 * d * d, grads.dw_q + 8 * d * d
    grads.db_k, grads.db_v = grads.db_q + 4 * d, grads.db_q + 8 * d
    dyp = dy.ctypes.data
    st = ctypes.c_void_p()

    def c_fb():
        train_c(lp, fa, ex, st, err)
        bwd_c(lp, st.value, dyp, grads, ex, err)
        free_c(st.value)

    class MinimalModule(torch.nn.Module):
        """The least a torch module around mha can do: allocate the output, one ctypes call."""

        def forward(self, q, k, v):
            o = torch.empty(b, n, d)
            fa_m.out = o.data_ptr()
            fwd_c(lp, fa_m, ex, err)
            return o, None

    class MinimalOp(torch.autograd.Function):
        """The least an autograd op around mha can do: allocate the output, mha's training
        forward; in backward make dy contiguous, mha's backward into preallocated gradients,
        free the state, return them (autograd accumulates them into .grad)."""

        @staticmethod
        def forward(ctx, xx, *params):
            o = torch.empty(b, n, d)
            fa_m.out = o.data_ptr()
            train_c(lp, fa_m, ex, st, err)
            ctx.st = st.value
            return o

        @staticmethod
        def backward(ctx, gy):
            gy = gy.contiguous()
            bwd_c(lp, ctx.st, gy.data_ptr(), grads, ex, err)
            free_c(ctx.st)
            return grad_tensors

    fa_m = L.mha_forward_args()
    fa_m.batch, fa_m.q_len, fa_m.kv_len = b, n, n
    fa_m.query = x.data_ptr()
    fa_m.mask.window_left = fa_m.mask.window_right = -1
    minimal = MinimalModule()
    params = list(mine.parameters())  # in_proj_weight, in_proj_bias, out_proj.weight, .bias
    grad_tensors = tuple(torch.from_numpy(gbufs[f]) for f in
                         ("d_query", "dw_q", "db_q", "dw_o", "db_o"))

    def minimal_fb():
        y = MinimalOp.apply(xg, *params)
        y.sum().backward()

    def mine_fb():
        y, _ = mine(xg, xg, xg, need_weights=False)
        y.sum().backward()

    def ref_fb():
        y, _ = ref(xg, xg, xg, need_weights=False)
        y.sum().backward()

    def numpy_ctypes():
        _api._fast = None
        layer(xn, threads=threads)
        _api._fast = L.fast

    def mine_ctypes():
        mt._fast = None
        mine(x, x, x, need_weights=False)
        mt._fast = L.fast

    nograd = torch.no_grad()
    variants = [
        ("ctypes floor", lambda: destroy(None), False),
        ("C forward", lambda: fwd_c(lp, fa, ex, err), False),
        ("NumPy API", lambda: layer(xn, threads=threads), False),
        ("NumPy API (ctypes)", numpy_ctypes, False),
        ("minimal Module", lambda: minimal(x, x, x), True),
        ("drop-in forward", lambda: mine(x, x, x, need_weights=False), True),
        ("drop-in (ctypes)", mine_ctypes, True),
        ("torch forward", lambda: ref(x, x, x, need_weights=False), True),
        ("C fwd+bwd", c_fb, False),
        ("minimal autograd", minimal_fb, False),
        ("drop-in fwd+bwd", mine_fb, False),
        ("torch fwd+bwd", ref_fb, False),
    ]
    # Same results first (a benchmark of a wrong answer is worthless).
    with torch.no_grad():
        y_ref = ref(x, x, x, need_weights=False)[0]
        assert torch.allclose(mine(x, x, x, need_weights=False)[0], y_ref, atol=1e-5)
        assert np.allclose(layer(xn, threads=threads), y_ref.numpy(), atol=1e-5)

    def sample(fn, ng, k):
        if ng:
            with nograd:
                t0 = clock()
                for _ in range(k):
                    fn()
                t1 = clock()
        else:
            t0 = clock()
            for _ in range(k):
                fn()
            t1 = clock()
        return (t1 - t0) / k / 1e3

    # Warm-up and calibration: each variant makes `inner` calls per sample, so that a sample
    # takes ~2 ms (caches and branch predictors are warm after the first few calls).
    inner = {}
    for nm, fn, ng in variants:
        sample(fn, ng, 50)
        inner[nm] = max(5, min(5000, int(2000 / min(sample(fn, ng, 20) for _ in range(3)))))
    res = {nm: [] for nm, _, _ in variants}
    for _ in range(samples):
        for nm, fn, ng in variants:
            res[nm].append(sample(fn, ng, inner[nm]))
        mine.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        xg.grad = None
    return res, inner


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", action="append", default=None,
                    help="N,D,H,B (tokens, model dim, heads, batch); repeatable")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="thread",
                    help="thread: this thread's CPU time (default; time spent preempted by other "
                         "processes on a shared machine does not count); wall: elapsed time")
    a = ap.parse_args()
    sizes = [tuple(int(v) for v in s.split(",")) for s in a.size] if a.size else \
        [(16, 64, 4, 1), (128, 256, 8, 2)]
    torch.set_num_threads(a.threads)
    print(f"# torch {torch.__version__}, numpy {np.__version__}, mha {mha.__version__} "
          f"({mha.library_path}), python {sys.version.split()[0]}; threads={a.threads}, "
          f"clock={a.clock}")
    print(f"# fast path: {L.fast.__file__ if L.fast else 'not built (ctypes only)'}")
    print("# microseconds per call: median [p10, p90] over the samples; overhead = paired "
          "difference with the C-only variant")
    for size in sizes:
        res, inner = run(size, a.threads, a.samples, CLOCKS[a.clock])
        n, d, h, b = size
        print(f"\n## n={n} d={d} h={h} batch={b}: {a.samples} samples of "
              f"{min(inner.values())}-{max(inner.values())} calls each")
        for nm, xs in res.items():
            print(f"{nm:38s} {statistics.median(xs):9.2f}  [{pct(xs, .1):8.2f}, "
                  f"{pct(xs, .9):8.2f}]")
        for nm, base in (("NumPy API", "C forward"), ("NumPy API (ctypes)", "C forward"),
                         ("drop-in forward", "C forward"),
                         ("drop-in forward", "minimal Module"),
                         ("drop-in (ctypes)", "minimal Module"),
                         ("minimal Module", "C forward"),
                         ("drop-in fwd+bwd", "C fwd+bwd"),
                         ("drop-in fwd+bwd", "minimal autograd"),
                         ("minimal autograd", "C fwd+bwd"),
                         ("drop-in forward", "torch forward"),
                         ("drop-in fwd+bwd", "torch fwd+bwd")):
            diff = [u - v for u, v in zip(res[nm], res[base])]
            label = f"{nm} - {base}"
            print(f"{label:38s} {statistics.median(diff):+9.2f}  "
                  f"[{pct(diff, .1):+8.2f}, {pct(diff, .9):+8.2f}]")


if __name__ == "__main__":
    main()
