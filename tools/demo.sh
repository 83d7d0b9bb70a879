#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The main job on its embedded default: builds mha if needed and runs `mha demo`, which shows the
# per-head attention maps of a small causal RoPE layer on a built-in sentence. Installs only what
# building needs (no Python package).
# needs: cc cmake make nproc
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh --build >/dev/null
if [ ! -x build/mha ]; then
    cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build build -j "$(nproc 2>/dev/null || echo 2)" --target mha >/dev/null
fi
exec build/mha demo "$@"
