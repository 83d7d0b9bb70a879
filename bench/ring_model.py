# SPDX-License-Identifier: MIT
"""ring_model.py: a model of ring attention's scaling on a real cluster (docs/distributed.md,
"Performance"), from a measured per-rank compute rate and a stated link bandwidth and latency.
Standard library only; tools/bench_ring.sh runs it with the rates mha_bench_ring measured.

One rank per machine, P machines in a ring, causal zig-zag shards (every step of every rank does
the same work: half of an n x n block, n = N / P local rows), B = 1:
  forward step   compute  c = f 2 h n^2 (d_k + d_v) / R            f = 1/2 causal, 1 otherwise
                 transfer m = alpha + 4 g n (d_k + d_v) / BW       one K/V block of the g kv heads
  backward step  compute  c = f 2 h n^2 (3 d_k + 2 d_v) / R_bwd
                 transfer m = 2 alpha + 2 x 4 g n (d_k + d_v) / BW  K/V and dK/dV blocks, one link
A step takes max(c, m) when the next block travels while this one is computed (double buffering,
as ring.c does): T = (P - 1) max(c, m) + c (+ the last dK/dV hop alpha + 4 g n (d_k + d_v) / BW in
the backward). The ideal is the compute alone, T_1 / P with T_1 = P^2 c the one-machine time, and
the efficiency is E = (T_1 / P) / T. Communication hides behind compute once c >= m, i.e. for
n >= n* = (b + sqrt(b^2 + 4 a alpha)) / (2 a), a = c / n^2, b = the bandwidth term of m / n:
without latency n* = 2 g R / (f h BW) x (forward). R is one machine's attention rate: the model
assumes it does not depend on n (true above a few hundred rows; the kernels' rate falls for small
blocks, and memory must hold the blocks).
"""
import argparse
import math


def step_times(n, a):
    """Per-step compute and transfer seconds of the forward and the backward at n local rows."""
    f = 0.5 if a.causal else 1.0
    blk = 4.0 * a.batch * a.kv_heads * n * (a.dk + a.dv)  # bytes of one K/V block
    bw = a.bw * 1e9
    fwd_c = f * 2.0 * a.batch * a.heads * n * n * (a.dk + a.dv) / (a.rate_fwd * 1e9)
    bwd_c = f * 2.0 * a.batch * a.heads * n * n * (3 * a.dk + 2 * a.dv) / (a.rate_bwd * 1e9)
    lat = a.latency * 1e-6
    return fwd_c, lat + blk / bw, bwd_c, 2 * lat + 2 * blk / bw, lat + blk / bw


def hide_size(a, bwd):
    """Smallest n with compute >= transfer per step (solving a n^2 = b n + alpha)."""
    c1, m1, c1b, m1b, _ = step_times(1.0, a)
    lat = a.latency * 1e-6
    if bwd:
        qa, qb, qc = c1b, m1b - 2 * lat, 2 * lat
    else:
        qa, qb, qc = c1, m1 - lat, lat
    return (qb + math.sqrt(qb * qb + 4 * qa * qc)) / (2 * qa)


def predict(a, p):
    """(forward seconds, efficiency, backward seconds, efficiency) on p machines."""
    n = a.n / p
    c, m, cb, mb, last = step_times(n, a)
    t_f = (p - 1) * max(c, m) + c
    t_b = (p - 1) * max(cb, mb) + cb + (last if p > 1 else 0.0)
    return t_f, p * c / t_f, t_b, p * cb / t_b


def fmt_t(s):
    if s >= 3600:
        return "%.2f h" % (s / 3600)
    if s >= 1:
        return "%.1f s" % s
    if s >= 1e-3:
        return "%.2f ms" % (s * 1e3)
    return "%.1f us" % (s * 1e6)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate-fwd", type=float, required=True, help="GFLOP/s of one rank, forward")
    ap.add_argument("--rate-bwd", type=float, required=True, help="GFLOP/s of one rank, backward")
    ap.add_argument("--bw", type=float, default=25.0, help="link bandwidth, GB/s (default 25)")
    ap.add_argument("--latency", type=float, default=5.0, help="per message, us (default 5)")
    ap.add_argument("--n", type=int, default=1 << 20, help="global sequence length (2^20)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--no-causal", dest="causal", action="store_false")
    ap.add_argument("--machines", default="8,64")
    a = ap.parse_args()
    print("# cluster model (bench/ring_model.py): one rank per machine, R = %.1f GFLOP/s forward,"
          " %.1f backward (measured per rank), link %.0f GB/s, latency %.0f us per message"
          % (a.rate_fwd, a.rate_bwd, a.bw, a.latency))
    print("# problem: N = %d, B = %d, h = %d, g = %d, d_k = %d, d_v = %d, %s"
          % (a.n, a.batch, a.heads, a.kv_heads, a.dk, a.dv,
             "causal zig-zag (half of every block)" if a.causal else "not causal"))
    print("# per step vs local rows n: compute c, transfer m (forward: one K/V block; backward:"
          " K/V + dK/dV)")
    print("%9s %12s %12s %7s %12s %12s %7s" % ("n_local", "fwd c", "fwd m", "c/m", "bwd c",
                                              "bwd m", "c/m"))
    n = 64
    while n <= a.n:
        c, m, cb, mb, _ = step_times(n, a)
        print("%9d %12s %12s %7.1f %12s %12s %7.1f" % (n, fmt_t(c), fmt_t(m), c / m, fmt_t(cb),
                                                      fmt_t(mb), cb / mb))
        n *= 4
    nf, nb = hide_size(a, False), hide_size(a, True)
    print("# communication hides behind compute for n_local >= %.0f rows (forward), %.0f"
          " (backward): up to P = N / n* = %.0f machines for this N" % (nf, nb, a.n / max(nf, nb)))
    base = (a.rate_fwd, a.rate_bwd)
    for k in (10, 100, 1000):
        a.rate_fwd, a.rate_bwd = base[0] * k, base[1] * k
        print("#   a machine %4dx faster (R = %.0f GFLOP/s): n* = %.0f forward, %.0f backward"
              % (k, a.rate_fwd, hide_size(a, False), hide_size(a, True)))
    a.rate_fwd, a.rate_bwd = base
    print("%9s %9s %12s %7s %12s %7s" % ("machines", "n_local", "fwd time", "eff", "bwd time",
                                         "eff"))
    for p in [1] + [int(x) for x in a.machines.split(",")]:
        t_f, e_f, t_b, e_b = predict(a, p)
        print("%9d %9d %12s %6.0f%% %12s %6.0f%%" % (p, a.n // p, fmt_t(t_f), 100 * e_f,
                                                     fmt_t(t_b), 100 * e_b))


if __name__ == "__main__":
    main()
