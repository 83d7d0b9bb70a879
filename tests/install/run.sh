#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Installs the build tree given as $1 into a temporary prefix with `cmake --install`, then builds
# tests/install/consumer.c against that prefix four ways and runs each: the README's two
# `cc app.c ...` lines as written (pkg-config mha with the rpath, run without LD_LIBRARY_PATH;
# pkg-config mha-static, which must not need libmha.so) and find_package(mha) (mha::mha,
# mha::mha_static).
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
# The README's lines (section "Build by hand"), each run as written in a directory of its own
# where consumer.c is app.c, the program a.out.
readme=$here/../../README.md
mapfile -t readme_cc < <(grep -E '^cc app\.c ' "$readme" | sed 's/ *#.*$//')
[ "${#readme_cc[@]}" -eq 2 ] || { echo "README.md: expected 2 'cc app.c' lines"; exit 1; }
readme_line() { # index: build with the README's line, run the program without LD_LIBRARY_PATH
    local dir=$tmp/readme$1
    mkdir -p "$dir" && cp "$here/consumer.c" "$dir/app.c" &&
        (cd "$dir" && echo "${readme_cc[$1]}" && eval "${readme_cc[$1]}" &&
            env -u LD_LIBRARY_PATH ./a.out)
}
build_pc_shared() { # the first line: linked to the installed libmha.so.0, found through the rpath
    readme_line 0 && objdump -p "$tmp/readme0/a.out" | grep -q 'NEEDED *libmha\.so\.0'
}
build_pc_static() { # the second: libmha.a inside, no libmha.so needed
    readme_line 1 && ! objdump -p "$tmp/readme1/a.out" | grep -q 'NEEDED *libmha'
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
check readme-pkg-config-shared build_pc_shared
check readme-pkg-config-static build_pc_static
check find_package build_cmake
if [ $have_mpi = ON ]; then
    check pkg-config-mpi build_pc_mpi
    check find_package-mpi mpirun_2 "$tmp/cm/consumer_mpi"
fi
# The installed shared library has the installed SONAME.
check soname sh -c "objdump -p '$libdir/libmha.so' | grep -q 'SONAME *libmha.so.0'"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
