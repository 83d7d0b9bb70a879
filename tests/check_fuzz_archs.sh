#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The model-directory fuzzer knows every architecture the loader accepts: each model_type of
# src/io/hf_config.c's ARCHS table is in fuzz/fuzz_model_dir.c's ARCHS table (else the harness
# reports it as "accepted although unknown", as CI's fuzz run did for cohere2 in session 41) and
# has a seed in fuzz/corpus/model_dir/ (so the corpus reaches its loader from the first run), and
# the harness names no architecture the loader lacks. Prints "N passed, N failed".
# needs: grep sed sort
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# The model_type strings that open the rows of a file's ARCHS table ({"type", ...).
names() { sed -n "/^static const $2 ARCHS\[\] = {/,/^};/s/^ *{\"\([a-z0-9_]*\)\",.*/\1/p" "$1" | sort -u; }
lib=$(names "$root/src/io/hf_config.c" hf_arch)
harness=$(names "$root/fuzz/fuzz_model_dir.c" arch)
pass=0 fail=0
for t in $lib; do
    if ! grep -qx "$t" <<<"$harness"; then
        echo "FAIL: model_type '$t' is loaded by src/io/hf_config.c but not in fuzz/fuzz_model_dir.c's ARCHS"
        fail=$((fail + 1))
    elif ! grep -lq "\"model_type\": \"$t\"" "$root"/fuzz/corpus/model_dir/*; then
        echo "FAIL: model_type '$t' has no seed in fuzz/corpus/model_dir (fuzz/make_seeds.py)"
        fail=$((fail + 1))
    else
        pass=$((pass + 1))
    fi
done
for t in $harness; do
    grep -qx "$t" <<<"$lib" && continue
    echo "FAIL: fuzz/fuzz_model_dir.c names model_type '$t', which src/io/hf_config.c does not load"
    fail=$((fail + 1))
done
[ -n "$lib" ] || { echo "FAIL: no architecture found in src/io/hf_config.c"; fail=$((fail + 1)); }
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
