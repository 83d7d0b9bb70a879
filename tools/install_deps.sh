#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs what building and testing mha needs on a fresh Debian machine, skipping what is
# already there: a C compiler, CMake, cJSON (safetensors headers), and for the Python-driven
# tests python3 with numpy and pytest. Safe to run repeatedly.
set -euo pipefail

need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(gcc)
command -v make >/dev/null 2>&1 || need_apt+=(make)
[ -f /usr/include/cjson/cJSON.h ] || need_apt+=(libcjson-dev)
command -v python3 >/dev/null 2>&1 || need_apt+=(python3 python3-pip)
if [ ${#need_apt[@]} -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi
command -v cmake >/dev/null 2>&1 || python3 -m pip install -q cmake
python3 - <<'PY' || python3 -m pip install -q "numpy>=1.24" "pytest>=7"
import numpy, pytest  # noqa: F401
PY
