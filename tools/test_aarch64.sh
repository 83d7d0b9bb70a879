#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The aarch64 build: cross-compiles mha with Debian's gcc-aarch64-linux-gnu (warnings as errors,
# cmake/aarch64-linux-gnu.cmake) and runs every C test under qemu-user (MHA_TEST_QUICK=1: the
# sweeps are emulated, about 20x slower), once with the best tier (neon) and once capped to the
# generic tier (MHA_MAX_ISA=generic). Build tree: build-aarch64/. tools/install_deps.sh --test
# installs the compiler, qemu-user and the arm64 cJSON. Without libmha_mpi (MHA_MPI=OFF): the
# host's MPI is not the target's; without cairo (MHA_CAIRO=OFF) for the same reason.
# needs: aarch64-linux-gnu-gcc qemu-aarch64 cmake ctest
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${1:-$(nproc 2>/dev/null || echo 2)}
cmake -S . -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
    -DCMAKE_BUILD_TYPE=Release -DMHA_WERROR=ON -DMHA_MPI=OFF -DMHA_CAIRO=OFF >/dev/null
cmake --build build-aarch64 -j "$jobs"
qemu-aarch64 -L / build-aarch64/mha info | sed -n '1,3p'
for isa in neon generic; do
    echo "== aarch64, MHA_MAX_ISA=$isa"
    MHA_MAX_ISA=$isa MHA_TEST_QUICK=1 ctest --test-dir build-aarch64 --output-on-failure -j "$jobs" \
        -E '^py_'
done
