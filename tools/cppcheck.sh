#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Static analysis: cppcheck (Debian's 2.10) over src/, cli/ and tests/, checks warning,
# portability and performance (style is left out: its findings are mostly taste), for the x86-64
# GCC/clang configuration the project builds. Checked false positives are suppressed, each with
# its reason, in tools/cppcheck-suppressions.txt. Exit status 1 on any finding.
# Usage: tools/cppcheck.sh [JOBS]
# needs: cppcheck
set -euo pipefail
cd "$(dirname "$0")/.."
exec cppcheck --enable=warning,portability,performance --std=c11 --library=posix \
    --inline-suppr --suppressions-list=tools/cppcheck-suppressions.txt --error-exitcode=1 -q \
    -j "${1:-2}" -Iinclude -Isrc -Icli -Itests/common -D__x86_64__ -D__GNUC__ \
    --template='{file}:{line}:{column}: {severity}: {message} [{id}]' src cli tests
