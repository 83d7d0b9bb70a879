#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Runs every test of mha: installs missing dependencies, then
#   0. the clang-format check of every C file, and cppcheck over src/ cli/ tests/
#      (tools/cppcheck.sh, suppressions with reasons in tools/cppcheck-suppressions.txt);
#   1. a Release build with warnings as errors and libmha_mpi (MHA_MPI=ON), all tests (ctest),
#      ring attention under mpirun with 1 to 4 processes among them (Open MPI); then libmha_mpi
#      and test_ring alone built against MPICH (build-mpich/), ring_np1..4 under mpiexec.mpich
#      (MHA_TEST_QUICK=1);
#   1b. the Python package as users install it: sdist, a wheel built from it and repaired into a
#      manylinux wheel, installed into a fresh venv; an editable install without cJSON
#      (tools/test_python_package.sh);
#   2. every C test again with each lower kernel tier forced (MHA_MAX_ISA=generic, avx2 on an
#      AVX-512 host, avx512 on an AVX512-BF16 host), so every kernel of every op (forward, backward,
#      decode, GEMM) runs here;
#   3. a clang-14 Release build with warnings as errors, the C tests (MHA_TEST_QUICK=1);
#   4. an AddressSanitizer + UndefinedBehaviorSanitizer build, all tests again;
#   5. a ThreadSanitizer build without MPI (MHA_MPI=OFF: also the check that everything builds
#      and tests without it), every C test but the per-tier reruns (MHA_TEST_QUICK=1);
#   6. valgrind memcheck of the CLI tests: every `mha` the pytest CLI tests start runs under
#      valgrind (tools/valgrind_cli.sh), Debug build without sanitizers;
#   7. an aarch64 cross build (gcc-aarch64-linux-gnu, -Werror) and every C test under qemu-user
#      (tools/test_aarch64.sh, MHA_TEST_QUICK=1);
#   8. every libFuzzer harness for MHA_FUZZ_SECONDS (default 20) seconds (clang-14).
# Exit status is non-zero if anything fails. Build trees: build/, build-mpich/, build-clang/,
# build-asan/, build-tsan/, build-valgrind/, build-aarch64/, build-fuzz/, build-python-package/.
# Python runs from the virtual environment .venv/
# that tools/install_deps.sh creates (never the system Python).
# needs: cc cmake ctest make git xargs nproc clang-14 clang-format-14 python3 pkg-config nm
# needs: mpicc mpirun mpicc.mpich mpiexec.mpich
# (c++: mha.jax's XLA FFI handler, python/mha/_jax_ffi.cc, which test_python_jax_ffi.py loads)
# needs: c++
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_deps.sh --test
jobs=$(nproc 2>/dev/null || echo 2)
py="$PWD/.venv/bin/python"

# step "title": prints the time the previous step took and the total so far (CI's budget is 45
# minutes; these lines show where it goes), then the title.
step_start=$SECONDS
step() {
    [ "$step_start" -eq "$SECONDS" ] || echo "   (step took $((SECONDS - step_start)) s; total $((SECONDS / 60)) min $((SECONDS % 60)) s)"
    step_start=$SECONDS
    echo "== $*"
}

step "Format check (clang-format-14, .clang-format)"
git ls-files -z '*.c' '*.h' 2>/dev/null | xargs -0 -r clang-format-14 --dry-run -Werror

step "Static analysis (cppcheck, tools/cppcheck-suppressions.txt)"
bash tools/cppcheck.sh "$jobs"

step "Release build (-Werror)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DMHA_WERROR=ON -DMHA_MPI=ON \
    -DPython3_EXECUTABLE="$py" >/dev/null
cmake --build build -j "$jobs"
ctest --test-dir build --output-on-failure -j "$jobs"

step "MPICH: libmha_mpi and test_ring against MPICH (-Werror), ring_np1..4 under mpiexec.mpich"
# The same ring tests with the other MPI of Debian (Open MPI is the default mpicc/mpirun, above).
# Only the targets the ring tests need, and MHA_TEST_QUICK=1 (the shapes' full sweep ran above with
# Open MPI; here it is the MPI layer under test: messages, agreements, errors), to keep CI's time
# down: MPICH polls busily and 4 ranks on 2 cores cost it several times what they cost Open MPI.
cmake -S . -B build-mpich -DCMAKE_BUILD_TYPE=Release -DMHA_WERROR=ON -DMHA_MPI=ON \
    -DMPI_C_COMPILER=mpicc.mpich -DMPIEXEC_EXECUTABLE="$(command -v mpiexec.mpich)" \
    -DPython3_EXECUTABLE="$py" >/dev/null
cmake --build build-mpich -j "$jobs" --target test_ring
MHA_TEST_QUICK=1 ctest --test-dir build-mpich --output-on-failure -j "$jobs" -R '^ring_np'

# Lower tiers: each tier below this CPU's best one (`mha info` names the tiers it has).
tiers=$(build/mha info | sed -n 's/^kernel tiers[^:]*: *//p')
[ -n "$tiers" ] || { echo "test.sh: 'mha info' printed no kernel tiers line"; exit 1; }
for isa in avx512 avx2 generic; do
    case " $tiers " in *" $isa "*) ;; *) continue ;; esac
    [ "$isa" = "${tiers%% *}" ] && continue # the best tier ran above
    step "every C test with MHA_MAX_ISA=$isa"
    # Without the per-tier twins (*_avx2, *_generic: their own MHA_MAX_ISA overrides this one, so
    # they are the Release step's runs again: 138 -> 98 s over the three steps, Intel Xeon host).
    MHA_MAX_ISA=$isa ctest --test-dir build --output-on-failure -j "$jobs" \
        -E '^py_|^install|^exported|_avx2$|_generic$'
done

step "Python package: sdist, manylinux wheels (mha.jax under jit and grad in a fresh venv), editable install (tools/test_python_package.sh)"
bash tools/test_python_package.sh "$py"

step "clang-14 build (-Werror), C tests (MHA_TEST_QUICK=1)"
CC=clang-14 cmake -S . -B build-clang -DCMAKE_BUILD_TYPE=Release -DMHA_WERROR=ON >/dev/null
cmake --build build-clang -j "$jobs"
MHA_TEST_QUICK=1 ctest --test-dir build-clang --output-on-failure -j "$jobs" -E '^py_'

step "AddressSanitizer + UndefinedBehaviorSanitizer build"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DMHA_WERROR=ON \
    -DMHA_SANITIZE=address,undefined -DPython3_EXECUTABLE="$py" >/dev/null
cmake --build build-asan -j "$jobs"
MHA_TEST_QUICK=1 ASAN_OPTIONS=detect_leaks=1 ctest --test-dir build-asan --output-on-failure -j "$jobs"
step "ThreadSanitizer build, every C test but the per-tier reruns (MHA_TEST_QUICK=1)"
# The Python tests are left out: test_python_* cannot load a TSan library into the interpreter,
# and the CLI tests' code paths are the C tests' (they run under valgrind below).
# -O1 keeps the assertions and smallest sweeps of a Debug build at about half the -O0 time.
# Without MPI: the MPI library is not instrumented (and the ring's local calls are the core's,
# tested here); this build is also the one that proves MPI optional.
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS_DEBUG="-g -O1" -DMHA_WERROR=ON \
    -DMHA_SANITIZE=thread -DMHA_MPI=OFF >/dev/null
cmake --build build-tsan -j "$jobs"
# The per-tier reruns (*_avx2, *_generic: the same tests under MHA_MAX_ISA) are left out here: they
# check the kernels' arithmetic (the Release tier steps and ASan run them) through the same
# threading code, and under TSan they took ~5 of its 11 minutes on the Intel Xeon host.
MHA_TEST_QUICK=1 TSAN_OPTIONS=halt_on_error=1 \
    ctest --test-dir build-tsan --output-on-failure -j "$jobs" -E '^py_|_avx2$|_generic$'

step "valgrind memcheck: the CLI tests with every mha run under valgrind (Debug build)"
# All of test_cli.py, test_hostile_cli.py, test_cli_plot.py and test_cli_outputs.py; of test_cli_decode.py's 33
# decode-vs-full-forward cases the plain and everything ones (the rest takes minutes under
# valgrind and runs the same code). The golden CLI tests are left to the Release and ASan runs.
cmake -S . -B build-valgrind -DCMAKE_BUILD_TYPE=Debug -DMHA_WERROR=ON >/dev/null
cmake --build build-valgrind -j "$jobs" --target mha
vg_logs="$PWD/build-valgrind/vg-logs"
rm -rf "$vg_logs"
vg_env=(MHA_CLI="$PWD/tools/valgrind_cli.sh" MHA_VALGRIND_CLI="$PWD/build-valgrind/mha"
        MHA_VALGRIND_LOGS="$vg_logs" MHA_SOURCE_DIR="$PWD")
vg_pytest=("$py" -m pytest -q -p no:cacheprovider)
vg_status=0
env "${vg_env[@]}" "${vg_pytest[@]}" tests/test_cli.py >build-valgrind/pytest-cli.log 2>&1 &
vg_pid=$!
env "${vg_env[@]}" "${vg_pytest[@]}" tests/test_hostile_cli.py tests/test_cli_plot.py \
    tests/test_cli_outputs.py tests/test_cli_decode.py -k 'not equals_full_causal_forward or plain or everything' \
    >build-valgrind/pytest-other.log 2>&1 || vg_status=1
wait "$vg_pid" || vg_status=1
tail -n 3 build-valgrind/pytest-cli.log build-valgrind/pytest-other.log
if [ -n "$(find "$vg_logs" -type f -size +0 2>/dev/null)" ]; then
    vg_status=1
    find "$vg_logs" -type f -size +0 -exec cat {} + | head -200 || true
fi
if [ "$vg_status" -ne 0 ]; then
    echo "valgrind memcheck step FAILED (logs: build-valgrind/pytest-*.log, $vg_logs)"
    grep -h -B2 -A30 -E '^(FAILED|E  )' build-valgrind/pytest-*.log | head -100 || true
    exit 1
fi

step "aarch64: cross build (-Werror), every C test under qemu-user (tools/test_aarch64.sh)"
bash tools/test_aarch64.sh "$jobs"

step "Fuzzing: each libFuzzer harness for a bounded time (fuzz/run.sh)"
bash fuzz/run.sh "${MHA_FUZZ_SECONDS:-20}"
step "all tests passed"
