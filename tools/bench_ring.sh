#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Ring attention benchmark (not a test; docs/distributed.md, "Performance"): builds mha_peak and
# mha_bench_ring (Release, in build-bench/), then runs under `mpirun -np P`, P = 1, 2, 4:
#   strong scaling: N fixed (default 8192), causal zig-zag, causal contiguous, not causal;
#   weak scaling:   N = 2048 P, causal zig-zag and not causal;
# forward and backward each, h = 8, g = 8, d = 64, B = 1, one thread per rank. Every row states
# its times (median of the slowest rank over the repetitions, and their spread), GFLOP/s, % of
# this host's measured 1-thread FMA peak (mha_peak) times the cores the job can use, the
# compute/communication overlap fraction and the bytes each rank sends (bench/bench_ring.c's top
# comment defines each column). Then the cluster model (bench/ring_model.py) from the per-rank
# rates measured at P = 1 (strong, causal zig-zag), a 25 GB/s link and 5 us per message.
# All output also goes to bench_ring.txt in the build tree.
#
#   bash tools/bench_ring.sh            the full sweep (about 20 minutes on a quiet 2-core host,
#                                       estimated from the dry run)
#   bash tools/bench_ring.sh --quick    N = 2048 strong, 512 P weak, 3 repetitions (a dry run)
# Environment: MPIRUN (default mpirun; mpiexec.mpich runs MPICH, built in build-bench-mpich/),
# MHA_BENCH_BUILD (default build-bench/, a tree configured with MPI), MHA_BENCH_REPS,
# MHA_BENCH_N, MHA_BENCH_WEAK_N (rows per rank), MHA_BENCH_HEADS, MHA_BENCH_KV_HEADS,
# MHA_BENCH_DIM, MHA_BENCH_BW (GB/s), MHA_BENCH_LATENCY (us).
# With P > cores (4 ranks on 2 cores here) the ranks share cores: time-sliced, not parallel.
# needs: cmake mpirun python3 nproc
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
case "${1:-}" in
--quick) quick=1 ;;
"") ;;
*)
    echo "usage: bash tools/bench_ring.sh [--quick]" >&2
    exit 2
    ;;
esac
mpirun=${MPIRUN:-mpirun}
# The tree is built with the launcher's own MPI: Open MPI's (the default mpicc) or MPICH's.
mpi_flags=()
build_default=build-bench
if "$mpirun" --version 2>/dev/null | grep -q 'HYDRA'; then
    mpi_flags=(-DMPI_C_COMPILER=mpicc.mpich -DMPIEXEC_EXECUTABLE="$(command -v "$mpirun")")
    build_default=build-bench-mpich
fi
build=${MHA_BENCH_BUILD:-$build_default}
reps=${MHA_BENCH_REPS:-$([ $quick = 1 ] && echo 3 || echo 5)}
n_strong=${MHA_BENCH_N:-$([ $quick = 1 ] && echo 2048 || echo 8192)}
n_weak=${MHA_BENCH_WEAK_N:-$([ $quick = 1 ] && echo 512 || echo 2048)}
heads=${MHA_BENCH_HEADS:-8}
kv_heads=${MHA_BENCH_KV_HEADS:-8}
dim=${MHA_BENCH_DIM:-64}
cores=$(nproc 2>/dev/null || echo 1)

if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DMHA_MPI=ON -DMHA_BUILD_TESTS=OFF \
        "${mpi_flags[@]}" >/dev/null
fi
cmake --build "$build" -j "$cores" --target mha_bench_ring mha_peak >/dev/null || {
    echo "bench_ring.sh: cannot build mha_bench_ring in $build (is it configured with MPI, -DMHA_MPI=ON?)" >&2
    exit 1
}
out="$build/bench_ring.txt"
: >"$out"
say() { echo "$@" | tee -a "$out"; }

# Open MPI needs these to run as root and to start more processes than cores; pinning is off so
# that P = 1, 2 and 4 run alike (the OS places the ranks).
flags=()
if "$mpirun" --version 2>/dev/null | grep -q 'Open MPI\|OpenRTE'; then
    flags=(--allow-run-as-root --oversubscribe --bind-to none)
fi

say "# tools/bench_ring.sh $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
say "# host: $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $cores core(s); load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
load=$(cut -d' ' -f1 /proc/loadavg)
if awk -v l="$load" -v c="$cores" 'BEGIN { exit !(l > 0.5 * c) }'; then
    say "# WARNING: load average $load on $cores core(s): other work is running, the times below are not reliable"
fi
peak=$("$build/bench/mha_peak" --threads 1 | awk '$1 !~ /^#/ && $2 == 1 { print $3; exit }')
say "# measured 1-thread fp32 FMA peak (mha_peak, widest ISA): $peak GFLOP/s"

common=(--heads "$heads" --kv-heads "$kv_heads" --dim "$dim" --reps "$reps" --peak "$peak"
        --cores "$cores" --dir both)
header=(--header)
run() { # run P label N mask layout
    "$mpirun" "${flags[@]}" -np "$1" "$build/bench/mha_bench_ring" "${common[@]}" "${header[@]}" \
        --ranks "$1" --label "$2" --n "$3" --mask "$4" --layout "$5" | tee -a "$out"
    header=()
}
# First the replay's check: t_comp's calls, run on the true K/V blocks, must give the ring's own
# out, lse and dQ to the bit (mha_bench_ring --verify; small uneven N), or the sweep stops.
for p in 1 2 4; do
    for m in "causal zigzag" "causal contiguous" "none contiguous"; do
        read -r mask layout <<<"$m"
        "$mpirun" "${flags[@]}" -np $p "$build/bench/mha_bench_ring" --verify --ranks $p --n 203 \
            --heads "$heads" --kv-heads "$kv_heads" --dim "$dim" --mask "$mask" --layout "$layout" |
            tee -a "$out"
    done
done
for p in 1 2 4; do
    run $p strong "$n_strong" causal zigzag
    run $p strong "$n_strong" causal contiguous
    run $p strong "$n_strong" none contiguous
done
for p in 1 2 4; do
    run $p weak $((n_weak * p)) causal zigzag
    run $p weak $((n_weak * p)) none contiguous
done
say "# finished $(date -u '+%H:%M UTC'); load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

# Scaling against P = 1 from the rows above (the ideal: strong t_1 / P, weak P t_1, since N = P N_1
# makes each rank's FLOPs grow as P).
say ""
say "# scaling vs P = 1 (t = t_total). strong: speedup t1/tP, efficiency t1/(P tP); weak (N = P N_1:"
say "# FLOPs grow as P^2, each rank's as P): efficiency P t1/tP. Per-core efficiency: the same with"
say "# the P ranks on C = min(P, $cores) cores (oversubscribed ranks share them): t1/(C tP), P^2 t1/(C tP)"
scaling=$(awk -v cores="$cores" '$1 == "strong" || $1 == "weak" {
    key = $1 " " $5 " " $6 " " $7
    if ($2 == 1) t1[key] = $8
    if ($2 > 1 && t1[key] > 0) {
        c = $2 < cores ? $2 : cores
        if ($1 == "strong")
            printf "%-6s P=%d %-6s %-10s %s  speedup %5.2f  efficiency %4.0f%%  per-core %4.0f%%\n",
                $1, $2, $5, $6, $7, t1[key] / $8, 100 * t1[key] / ($2 * $8), 100 * t1[key] / (c * $8)
        else
            printf "%-6s P=%d %-6s %-10s %s  efficiency %4.0f%%  per-core %4.0f%%\n", $1, $2, $5, $6,
                $7, 100 * $2 * t1[key] / $8, 100 * $2 * $2 * t1[key] / (c * $8)
    }
}' "$out")
say "$scaling"

# The model's rates: one rank's GFLOP/s (last column) at P = 1, strong, causal zig-zag.
rate() { awk -v d="$1" '$1 == "strong" && $2 == 1 && $5 == "causal" && $6 == "zigzag" &&
    $7 == d { print $NF; exit }' "$out"; }
say ""
python3 bench/ring_model.py --rate-fwd "$(rate fwd)" --rate-bwd "$(rate bwd)" \
    --bw "${MHA_BENCH_BW:-25}" --latency "${MHA_BENCH_LATENCY:-5}" | tee -a "$out"
