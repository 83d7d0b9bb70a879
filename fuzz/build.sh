#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Builds the libFuzzer harnesses of fuzz/ with clang (not part of the CMake build, which uses
# gcc): the library sources, the CLI's option code and each harness, all with
# -fsanitize=fuzzer,address,undefined. Needs clang-14 and libclang-rt-14-dev (Debian), and
# libcjson-dev. Usage: fuzz/build.sh [BUILD_DIR]   (default: build-fuzz/ at the repo root).
# The harness binaries are BUILD_DIR/fuzz_npy, fuzz_safetensors, fuzz_cli_args, fuzz_api,
# fuzz_model_dir, fuzz_npz, fuzz_gguf, fuzz_kv_cache.
# needs: clang-14 nproc find
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/build-fuzz}"
CC="${CC:-$(command -v clang-14 || command -v clang)}"
mkdir -p "$out/obj"

# Same language and numerics flags as CMakeLists.txt; warnings are errors in the harnesses only
# (the library's own -Werror run is the gcc build).
common=(-std=c11 -O1 -g -fno-omit-frame-pointer -ffp-contract=off -fno-math-errno
        -fsanitize=address,undefined -fno-sanitize-recover=all
        -I"$root/include" -I"$root/src" -I"$root/cli" -I/usr/include/cjson)
warn=(-Wall -Wextra -Wpedantic -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Wvla
      -Wdouble-promotion -Wundef -Wformat=2 -Wimplicit-fallthrough)

# Per file: the ISA flags of the SIMD kernel files (src/kernels/x86/*_avx2.c, *_avx512.c,
# *_avx512bf16.c, *_avx512vnni.c), which are also built at -O0: clang-14 at -O1 with ASan + UBSan + coverage took
# 303 s on decode_avx512.c alone (its always-inline instances; 25 s at -O0; Intel Xeon host,
# session 43), most of CI's fuzzing step. The harnesses fuzz the parsers, the loaders and the
# API's checks; the kernels run on the small shapes those accept, at -O0 still under both
# sanitizers (and at -O1 in the ctest ASan + UBSan build).
file_flags() {
    local avx512="-mavx512f -mavx512dq -mavx512bw -mavx512vl -mfma -mavx2 -mf16c"
    case "$1" in
    *_avx512.c) echo "-O0 $avx512" ;;
    *_avx512bf16.c) echo "-O0 $avx512 -mavx512bf16" ;;
    *_avx512vnni.c) echo "-O0 $avx512 -mavx512vnni -mavx512vbmi" ;;
    *_avx2.c) echo "-O0 -mavx2 -mfma -mf16c" ;;
    *) echo "" ;;
    esac
}

# Library + CLI objects, instrumented for coverage (fuzzer-no-link); rebuilt when newer.
# Every cli/*.c except the one with main() (cli_run.c may call helpers of the other files).
# The loader's stand-in for builds without cJSON (safetensors_off.c) is left out: fuzzing needs
# the real one.
# src/dist/ is libmha_mpi (ring attention over MPI), not libmha: it needs mpi.h and is not fuzzed.
srcs=$(cd "$root" && find src -name '*.c' ! -name safetensors_off.c ! -path 'src/dist/*' | sort
    find cli -name '*.c' ! -name mha_cli.c | sort)
objs=()
for s in $srcs; do
    o="$out/obj/$(echo "$s" | tr '/' '_').o"
    objs+=("$o")
    if [ ! -f "$o" ] || [ "$root/$s" -nt "$o" ] || [ -n "$(find "$root/src" "$root/cli" -name '*.h' -newer "$o" 2>/dev/null | head -1)" ]; then
        echo "$CC -c $s"
        # shellcheck disable=SC2046
        "$CC" "${common[@]}" -fsanitize=fuzzer-no-link $(file_flags "$s") -c "$root/$s" -o "$o" &
        while [ "$(jobs -rp | wc -l)" -ge "$(nproc 2>/dev/null || echo 2)" ]; do wait -n; done
    fi
done
wait
lib_objs=()
cli_objs=()
for o in "${objs[@]}"; do
    case "$o" in
    */cli_*) cli_objs+=("$o") ;;
    *) lib_objs+=("$o") ;;
    esac
done

for h in fuzz_npy fuzz_safetensors fuzz_api fuzz_cli_args fuzz_model_dir fuzz_npz fuzz_gguf \
    fuzz_kv_cache; do
    extra=()
    [ "$h" = fuzz_cli_args ] && extra=("${cli_objs[@]}")
    [ "$h" = fuzz_npy ] && extra=("$out/obj/cli_npy.c.o") # the .npy reader is the CLI's
    [ "$h" = fuzz_npz ] && extra=("$out/obj/cli_npz.c.o" "$out/obj/cli_npy.c.o") # and the .npz writer
    echo "$CC -o $out/$h"
    "$CC" "${common[@]}" "${warn[@]}" -Werror -fsanitize=fuzzer "$root/fuzz/$h.c" \
        "${extra[@]}" "${lib_objs[@]}" -lcjson -lpthread -lm -o "$out/$h"
done
echo "fuzzers built in $out"
