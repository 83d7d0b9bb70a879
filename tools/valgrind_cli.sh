#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Runs the mha program under valgrind memcheck. The pytest CLI tests invoke whatever MHA_CLI
# names, so pointing MHA_CLI at this script puts every invocation under valgrind:
#   MHA_CLI=tools/valgrind_cli.sh MHA_VALGRIND_CLI=build-valgrind/mha \
#   MHA_VALGRIND_LOGS=build-valgrind/vg-logs python3 -m pytest tests/test_cli.py
# Any memcheck error (invalid read/write, use of uninitialised values, bad free, a definitely
# lost block) makes the program exit 99, which fails the test, and leaves a non-empty report in
# MHA_VALGRIND_LOGS/vg.<pid>.log (valgrind writes there, not to stderr, so the tests' checks of
# the program's stderr are unaffected); tools/test.sh also fails on any non-empty report.
# Use a build without sanitizers (Debug gives line numbers).
# needs: valgrind
set -euo pipefail
: "${MHA_VALGRIND_CLI:?MHA_VALGRIND_CLI must name the mha program to run}"
: "${MHA_VALGRIND_LOGS:?MHA_VALGRIND_LOGS must name a directory for the reports}"
mkdir -p "$MHA_VALGRIND_LOGS"
exec valgrind -q --tool=memcheck --error-exitcode=99 --leak-check=full \
    --errors-for-leak-kinds=definite --show-leak-kinds=definite \
    --num-callers=30 --suppressions="$(dirname "$0")/valgrind_cairo.supp" ${MHA_VALGRIND_FLAGS:-} --log-file="$MHA_VALGRIND_LOGS/vg.%p.log" "$MHA_VALGRIND_CLI" "$@"
