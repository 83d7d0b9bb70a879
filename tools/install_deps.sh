#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs what mha's two README commands need on a fresh Debian machine, skipping what is there,
# then CHECKS that every command those scripts call is on PATH (failing with the missing name).
#
#   bash tools/install_deps.sh --build   what tools/demo.sh needs: a C compiler, make, CMake,
#                                        cJSON, cairo for --plot (Debian packages only, no
#                                        Python package)
#   bash tools/install_deps.sh [--test]  everything tools/test.sh needs: the above, clang-14 (+ its
#                                        runtime, for libFuzzer and TSan), clang-format-14, cppcheck,
#                                        valgrind, pkg-config, the aarch64 cross compiler, qemu-user
#                                        and arm64 cJSON, Python's venv and headers, Open MPI
#                                        (mpicc, mpirun: ring attention's tests) and MPICH beside
#                                        it (mpicc.mpich, mpiexec.mpich; Open MPI stays the
#                                        default mpicc/mpirun), and the
#                                        pinned Python test packages (python/requirements-test.txt,
#                                        with mpi4py for ring attention from Python, which runs on
#                                        that Open MPI) in the virtual environment .venv/ of the
#                                        checkout (never the system Python, which Debian marks
#                                        externally managed).
#
# The commands each script calls are declared in that script by lines `# needs: cmd ...`; the
# guard below reads those lines from every script of the mode, so a script that starts calling a
# new command declares it next to its use and a fresh machine reports it by name here.
# Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:---test}
case "$mode" in
--build) scripts=(tools/demo.sh) ;;
--test) scripts=(tools/test.sh tools/cppcheck.sh tools/valgrind_cli.sh fuzz/run.sh fuzz/build.sh
    tests/install/run.sh tests/check_exports.sh tests/check_layout.sh tools/test_aarch64.sh
    tools/test_python_package.sh) ;;
*)
    echo "install_deps.sh: unknown mode '$mode' (use --build or --test)" >&2
    exit 2
    ;;
esac

# Debian package of each command that may be missing on a fresh machine.
declare -A package=(
    [cc]=gcc [gcc]=gcc [c++]=g++ [make]=make [cmake]=cmake [ctest]=cmake [git]=git [nm]=binutils
    [objdump]=binutils [aarch64-linux-gnu-gcc]="gcc-aarch64-linux-gnu libc6-dev-arm64-cross"
    [qemu-aarch64]=qemu-user
    [clang-14]="clang-14 libclang-rt-14-dev" [clang-format-14]=clang-format-14
    [cppcheck]=cppcheck [valgrind]=valgrind [pkg-config]=pkg-config [python3]=python3
    [mpicc]="openmpi-bin libopenmpi-dev" [mpirun]="openmpi-bin libopenmpi-dev"
    [mpicc.mpich]="mpich libmpich-dev" [mpiexec.mpich]="mpich libmpich-dev"
)

need_apt=()
[ -f /usr/include/cjson/cJSON.h ] || need_apt+=(libcjson-dev)
# cairo draws `mha run --plot` (CMake finds it with pkg-config; without it --plot says so).
[ -f /usr/include/cairo/cairo.h ] || need_apt+=(libcairo2-dev pkg-config)
for cmd in $(sed -n 's/^# needs: //p' "${scripts[@]}" | tr ' ' '\n' | sort -u); do
    command -v "$cmd" >/dev/null 2>&1 && continue
    [ -n "${package[$cmd]:-}" ] && need_apt+=(${package[$cmd]})
done
if [ "$mode" = --test ]; then
    # The venv module and Python's headers (the tests compile python/mha/_fastcall.c as
    # `pip install ./python` does). Debian ships them apart from python3.
    if ! command -v python3 >/dev/null 2>&1 || ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
        need_apt+=(python3 python3-venv)
    fi
    if ! command -v python3 >/dev/null 2>&1 || ! python3 -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
        need_apt+=(python3-dev)
    fi
    # libclang-rt-14-dev is clang-14's sanitizer runtime; it can be missing while clang-14 is not.
    ls /usr/lib/llvm-14/lib/clang/*/lib/linux/libclang_rt.tsan-x86_64.a >/dev/null 2>&1 ||
        [ "$(uname -m)" != x86_64 ] || need_apt+=(libclang-rt-14-dev)
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if [ "$mode" = --test ] && [ ! -f /usr/lib/aarch64-linux-gnu/libcjson.so ]; then
    # The aarch64 cross build (tools/test_aarch64.sh) links Debian's arm64 cJSON (multiarch).
    $SUDO dpkg --add-architecture arm64
    need_apt+=(libcjson-dev:arm64)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "install_deps.sh: apt-get install ${need_apt[*]}" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# Open MPI and MPICH both register the alternatives mpi (mpicc, ...), mpirun (mpiexec) and
# mpi-<multiarch> (the mpi.h directory); Debian ranks Open MPI first on amd64, but where an
# install (or an earlier choice) left MPICH there, put Open MPI back: the plain mpicc/mpirun are
# the ones CI's main build uses, mpi4py (below) loads the `mpi` alternative's libmpi, and MPICH is
# always called by its own names (*.mpich).
if [ "$mode" = --test ] && command -v update-alternatives >/dev/null 2>&1; then
    for alt in mpi mpirun "mpi-$(gcc -print-multiarch 2>/dev/null)"; do
        choices=$(update-alternatives --list "$alt" 2>/dev/null) || continue
        want=""
        for c in $choices; do case "$c" in *openmpi*) want=$c ;; esac; done
        have=$(update-alternatives --query "$alt" | sed -n 's/^Value: //p')
        [ -z "$want" ] || [ "$have" = "$want" ] || $SUDO update-alternatives --set "$alt" "$want" >/dev/null
    done
fi

# Python test packages, pinned (torch exactly: any other version pulls gigabytes of CUDA
# packages), in .venv/. Reused when it already satisfies python/requirements-test.txt.
if [ "$mode" = --test ]; then
    [ -x .venv/bin/python ] || python3 -m venv .venv
    .venv/bin/python - <<'PY' || .venv/bin/python -m pip install -q -r python/requirements-test.txt
import importlib.metadata as md, sys
for line in open("python/requirements-test.txt"):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, _, version = line.partition("==")
    name = name.split(">")[0].split("<")[0].strip()
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        sys.exit(1)
    if version and have.split("+")[0] != version.strip():
        sys.exit(1)
PY
fi

# The guard: every declared command must now be on PATH.
missing=()
for cmd in $(sed -n 's/^# needs: //p' "${scripts[@]}" | tr ' ' '\n' | sort -u); do
    command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
[ -f /usr/include/cjson/cJSON.h ] || missing+=("cjson/cJSON.h (libcjson-dev)")
[ -f /usr/include/cairo/cairo.h ] || missing+=("cairo/cairo.h (libcairo2-dev)")
[ "$mode" != --test ] || [ -f /usr/lib/aarch64-linux-gnu/libcjson.so ] ||
    missing+=("arm64 libcjson.so (libcjson-dev:arm64)")
if [ ${#missing[@]} -gt 0 ]; then
    echo "install_deps.sh: still missing after installing: ${missing[*]}" >&2
    exit 1
fi
