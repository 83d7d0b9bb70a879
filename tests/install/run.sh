#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs the build tree given as $1 into a temporary prefix with `cmake --install`, then builds
# tests/install/consumer.c against that prefix four ways and runs each: pkg-config (shared, and
# --static against the archive with Libs.private) and find_package(mha) (mha::mha, mha::mha_static).
# When the build has libmha_mpi (ring attention over MPI), also consumer_mpi.c through pkg-config
# mha_mpi and find_package(mha COMPONENTS mpi) (mha::mha_mpi), each run under mpirun -np 2 (the
# launcher CMake found, with Open MPI's --oversubscribe and, as root, --allow-run-as-root).
# Prints the plain closing line "N passed, N failed".
# needs: cmake pkg-config cc objdump timeout
set -euo pipefail
build=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
libdir=$(dirname "$(find "$tmp/prefix" -name mha.pc | head -1)")/..
export PKG_CONFIG_PATH="$libdir/pkgconfig"
passed=0 failed=0
check() { # name command...
    local name=$1
    shift
    if "$@" >"$tmp/$name.log" 2>&1; then
        passed=$((passed + 1))
        echo "ok: $name: $(tail -1 "$tmp/$name.log")"
    else
        failed=$((failed + 1))
        echo "FAILED: $name"
        cat "$tmp/$name.log"
    fi
}
build_pc_shared() {
    cc -o "$tmp/pc_shared" "$here/consumer.c" $(pkg-config --cflags --libs mha) -lm &&
        LD_LIBRARY_PATH="$libdir" "$tmp/pc_shared"
}
build_pc_static() {
    cc -static-libgcc -o "$tmp/pc_static" "$here/consumer.c" $(pkg-config --cflags mha) \
        "$libdir/libmha.a" $(pkg-config --static --libs-only-l mha | sed 's/-lmha//') &&
        "$tmp/pc_static"
}
have_mpi=OFF
[ -f "$libdir/pkgconfig/mha_mpi.pc" ] && have_mpi=ON
build_cmake() {
    cmake -S "$here" -B "$tmp/cm" -DCMAKE_PREFIX_PATH="$tmp/prefix" -DMHA_CONSUMER_MPI=$have_mpi &&
        cmake --build "$tmp/cm" && LD_LIBRARY_PATH="$libdir" "$tmp/cm/consumer_shared" &&
        "$tmp/cm/consumer_static"
}
mpirun_2() { # program: under the build's MPI launcher with 2 processes, a minute at most
    local launcher flags=()
    launcher=$(sed -n 's/^MPIEXEC_EXECUTABLE:FILEPATH=//p' "$build/CMakeCache.txt")
    launcher=${launcher:-mpirun}
    case $("$launcher" --version 2>&1 || true) in
    *"Open MPI"* | *OpenRTE*)
        flags=(--oversubscribe)
        [ "$(id -u)" -ne 0 ] || flags+=(--allow-run-as-root)
        ;;
    esac
    LD_LIBRARY_PATH="$libdir" timeout 60 "$launcher" -np 2 "${flags[@]}" "$@"
}
build_pc_mpi() {
    cc -o "$tmp/pc_mpi" "$here/consumer_mpi.c" $(pkg-config --cflags --libs mha_mpi) -lm &&
        mpirun_2 "$tmp/pc_mpi"
}
check pkg-config-shared build_pc_shared
check pkg-config-static build_pc_static
check find_package build_cmake
if [ $have_mpi = ON ]; then
    check pkg-config-mpi build_pc_mpi
    check find_package-mpi mpirun_2 "$tmp/cm/consumer_mpi"
fi
# The installed shared library has the installed SONAME.
check soname sh -c "objdump -p '$libdir/libmha.so' | grep -q 'SONAME *libmha.so.0'"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
