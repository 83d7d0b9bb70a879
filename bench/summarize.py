#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""summarize.py: markdown tables from bench/results/*.jsonl (bench_layer.py and mha_bench_gemm
output), for docs/performance.md.

Usage: python3 bench/summarize.py bench/results/layer-*.jsonl [bench/results/gemm-*.jsonl]
"""
import json
import sys


def main(paths):
    layer, gemm, rss = [], [], []
    for p in paths:
        with open(p) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                r = json.loads(line)
                {"layer": layer, "gemm": gemm, "rss": rss}.get(r.get("bench"), []).append(r)
    if layer:
        impls = ["mha_layer", "mha_core", "mha_layer_ref", "blas_layer", "torch_mha", "torch_sdpa"]
        print("| case | thr | peak | " + " | ".join(impls) + " | mha vs torch_mha | "
              "mha vs torch_sdpa |")
        print("|---" * (len(impls) + 5) + "|")
        seen = {}
        for r in layer:
            seen.setdefault((r["case"], r["threads"]), {})[r["impl"]] = r
        for (case, t), rows in seen.items():
            cells = []
            for i in impls:
                r = rows.get(i)
                cells.append("%.0f ms, %.1f GF/s (%.0f%%)" % (r["median_ms"], r["gflops"],
                                                             r["pct_peak"]) if r else "—")
            base = rows.get("mha_layer")
            ratio = []
            for peer in ("torch_mha", "torch_sdpa"):
                p = rows.get(peer)
                ratio.append("%.2f×" % (p["median_ms"] / base["median_ms"]) if p and base
                             else "—")
            peak = next(iter(rows.values()))["peak_gflops"]
            print("| %s | %d | %.0f | %s | %s |" % (case, t, peak, " | ".join(cells),
                                                   " | ".join(ratio)))
    if gemm:
        print("\n| kernel | M | N | K | thr | median ms | GFLOP/s | % peak (peak) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in gemm:
            print("| %s | %d | %d | %d | %d | %.2f | %.1f | %.0f%% (%.0f) |" % (
                r["kernel"], r["M"], r["N"], r["K"], r["threads"], r["median_ms"], r["gflops"],
                r["pct_peak"], r["peak_gflops"]))
    if rss:
        print("\n| impl | n | peak RSS MB | before forward MB |")
        print("|---|---|---|---|")
        for r in rss:
            print("| %s | %d | %.1f | %.1f |" % (r["impl"], r["n"], r["peak_rss_mb"],
                                                 r["rss_before_forward_mb"]))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
