#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The aarch64 build: cross-compiles mha with Debian's gcc-aarch64-linux-gnu (warnings as errors,
# cmake/aarch64-linux-gnu.cmake) and runs every C test under qemu-user (MHA_TEST_QUICK=1: the
# sweeps are emulated, about 20x slower), once with the best tier (neon) and, for the tests whose
# kernels the dispatcher picks, once capped to the generic tier (MHA_MAX_ISA=generic). Build tree: build-aarch64/. tools/install_deps.sh --test
# installs the compiler, qemu-user and the arm64 cJSON. MHA_MPI and MHA_CAIRO are left at AUTO, as
# a user's cross build has them: the toolchain file finds only arm64 libraries, so the host's
# x86-64 cairo (and MPI) are not taken (a link error before), cairo is used when
# libcairo2-dev:arm64 is installed, and the configure summary line says what was built.
# needs: aarch64-linux-gnu-gcc qemu-aarch64 cmake ctest
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${1:-$(nproc 2>/dev/null || echo 2)}
cmake -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
    -DCMAKE_BUILD_TYPE=Release -DMHA_WERROR=ON | grep "mha: configuration"
cmake --build build-aarch64 -j "$jobs"
qemu-aarch64 -L / build-aarch64/mha info | sed -n '1,3p'
echo "== aarch64, best tier (neon): every C test"
MHA_TEST_QUICK=1 ctest --test-dir build-aarch64 --output-on-failure -j "$jobs" -E '^py_'
# Capped to generic: only the tests whose calls go through the dispatcher's choice (the core, the
# layer, gradients, decode, goldens, extremes, concurrency). test_kernels and test_gemm already ran
# every generic kernel above (they walk every registry line the CPU can run), and the API, I/O,
# hostile-input and thread-pool tests do not depend on the kernel tier. test_kv_rows and
# test_kv_tree ran capped to generic above too (their *_generic twins, left out here with them:
# four runs of ~90 s each under qemu before). This keeps CI's budget.
echo "== aarch64, MHA_MAX_ISA=generic: the dispatch-dependent tests"
MHA_MAX_ISA=generic MHA_TEST_QUICK=1 ctest --test-dir build-aarch64 --output-on-failure -j "$jobs" \
    -E '^py_|^layout_arrows$|^test_(kernels|gemm|api|io|hostile|threadpool|kv_rows|kv_tree)$|_generic$'

