#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Runs each libFuzzer harness for a bounded time and fails (exit 1) on any crash, leak, sanitizer
# report or timeout. Usage: fuzz/run.sh [SECONDS_PER_HARNESS] [BUILD_DIR]
# (defaults: 60 s, build-fuzz/). Builds the harnesses first (fuzz/build.sh). The committed seeds
# (fuzz/corpus/<harness>/) are read but never written: new inputs go to a scratch corpus, and a
# crashing input is saved as BUILD_DIR/crash-<harness>-* for a regression test.
# needs: nproc
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
secs="${1:-60}"
out="${2:-$root/build-fuzz}"
bash "$root/fuzz/build.sh" "$out" >/dev/null
status=0
for h in npy safetensors cli_args api model_dir npz gguf kv_cache; do
    work="$out/corpus-$h"
    mkdir -p "$work"
    extra=()
    [ -f "$root/fuzz/$h.dict" ] && extra+=("-dict=$root/fuzz/$h.dict")
    [ "$h" = cli_args ] && extra+=(-close_fd_mask=2)
    log="$out/fuzz-$h.log"
    echo "== fuzz_$h for ${secs}s"
    if ASAN_OPTIONS=detect_leaks=1:allocator_may_return_null=1 \
        UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
        "$out/fuzz_$h" "${extra[@]}" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
        -max_len=65536 -print_final_stats=1 -artifact_prefix="$out/crash-$h-" \
        "$work" "$root/fuzz/corpus/$h" >"$log" 2>&1; then
        grep -E '^stat::number_of_executed_units|^Done' "$log" | tr '\n' ' '
        echo
    else
        status=1
        echo "fuzz_$h FAILED; log: $log"
        grep -E 'ERROR|invariant|SUMMARY|Test unit written' "$log" | head -20
    fi
done
exit $status
