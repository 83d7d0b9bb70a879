#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Runs every test of mha: installs missing dependencies, then
#   0. the clang-format check of every C file;
#   1. a Release build with warnings as errors, all tests (ctest);
#   2. the same tests with each lower kernel tier forced (MHA_MAX_ISA), so every dispatch
#      variant runs on this machine;
#   3. an AddressSanitizer + UndefinedBehaviorSanitizer build, all tests again;
#   4. a ThreadSanitizer build of the concurrency test;
#   5. every libFuzzer harness for MHA_FUZZ_SECONDS (default 20) seconds (clang-14).
# Exit status is non-zero if anything fails. Build trees: build/, build-asan/, build-tsan/,
# build-fuzz/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh
jobs=$(nproc 2>/dev/null || echo 2)

echo "== Format check (clang-format-14, .clang-format)"
git ls-files -z '*.c' '*.h' 2>/dev/null | xargs -0 -r clang-format-14 --dry-run -Werror

echo "== Release build (-Werror)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DMHA_WERROR=ON >/dev/null
cmake --build build -j "$jobs"
ctest --test-dir build --output-on-failure -j "$jobs"

if [ -x build/tests/test_kernels ]; then
    for isa in generic avx2; do
        echo "== Kernel tests with MHA_MAX_ISA=$isa"
        MHA_MAX_ISA=$isa ctest --test-dir build --output-on-failure -R 'kernels|golden' -j "$jobs"
    done
fi

echo "== AddressSanitizer + UndefinedBehaviorSanitizer build"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DMHA_WERROR=ON \
    -DMHA_SANITIZE=address,undefined >/dev/null
cmake --build build-asan -j "$jobs"
MHA_TEST_QUICK=1 ASAN_OPTIONS=detect_leaks=1 ctest --test-dir build-asan --output-on-failure -j "$jobs"
echo "== ThreadSanitizer: many threads on one layer (test_concurrency)"
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DMHA_WERROR=ON -DMHA_SANITIZE=thread >/dev/null
cmake --build build-tsan -j "$jobs" --target test_concurrency
MHA_TEST_QUICK=1 TSAN_OPTIONS=halt_on_error=1 build-tsan/tests/test_concurrency

echo "== Fuzzing: each libFuzzer harness for a bounded time (fuzz/run.sh)"
bash fuzz/run.sh "${MHA_FUZZ_SECONDS:-20}"
echo "== all tests passed"
