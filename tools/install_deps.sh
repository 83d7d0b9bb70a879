#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs what building and testing mha needs on a fresh Debian machine, skipping what is
# already there: a C compiler, CMake, cJSON (safetensors headers), clang-14, cppcheck, valgrind,
# and for the Python-driven tests python3, its headers and the packages of
# python/requirements-test.txt.
# Safe to run repeatedly.
set -euo pipefail

need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(gcc)
command -v make >/dev/null 2>&1 || need_apt+=(make)
[ -f /usr/include/cjson/cJSON.h ] || need_apt+=(libcjson-dev)
# clang-14 + its runtime: libFuzzer harnesses (fuzz/) and ThreadSanitizer's runtime for gcc too.
command -v clang-14 >/dev/null 2>&1 || need_apt+=(clang-14 libclang-rt-14-dev)
command -v python3 >/dev/null 2>&1 || need_apt+=(python3 python3-pip python3-dev)
# Python's headers (Python.h): the Python tests compile the extension python/mha/_fastcall.c, as
# `pip install ./python` does.
if command -v python3 >/dev/null 2>&1 && ! python3 -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
    need_apt+=(python3-dev)
fi
# Static analysis (tools/cppcheck.sh) and valgrind memcheck of the CLI tests (tools/test.sh).
command -v cppcheck >/dev/null 2>&1 || need_apt+=(cppcheck)
command -v valgrind >/dev/null 2>&1 || need_apt+=(valgrind)
if [ ${#need_apt[@]} -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi
command -v cmake >/dev/null 2>&1 || python3 -m pip install -q cmake
# Python test dependencies (NumPy, pytest, PyTorch 2.13.0 CPU, JAX/Equinox/Haiku, matplotlib):
# pinned in python/requirements-test.txt. torch is pinned exactly: any other version pulls
# gigabytes of CUDA packages.
python3 - <<'PY' || python3 -m pip install -q -r python/requirements-test.txt
import importlib.metadata as md, sys
pins = {}
for line in open("python/requirements-test.txt"):
    line = line.split("#")[0].strip()
    if "==" in line:
        name, version = line.split("==")
        pins[name.strip()] = version.strip()
    elif line:
        pins[line.split(">")[0].split("<")[0].strip()] = None
for name, version in pins.items():
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        sys.exit(1)
    if version and have.split("+")[0] != version:
        sys.exit(1)
PY
