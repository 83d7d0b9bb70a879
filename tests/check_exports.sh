#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The shared library exports the public API only: every defined dynamic symbol of $1 (libmha.so)
# starts with mha_ (internal functions are mha__*, hidden). Prints "N passed, N failed".
# needs: nm
set -euo pipefail
syms=$(nm -D --defined-only "$1" | awk '{print $3}')
bad=$(printf '%s\n' "$syms" | grep -v '^mha_[a-z]' || true)
internal=$(printf '%s\n' "$syms" | grep '^mha__' || true)
count=$(printf '%s\n' "$syms" | grep -c . || true)
if [ -n "$bad$internal" ] || [ "$count" -lt 40 ]; then
    echo "unexpected exports (or too few: $count):"
    printf '%s\n' "$bad" "$internal"
    echo "0 passed, 1 failed"
    exit 1
fi
echo "$count symbols, all mha_*"
echo "1 passed, 0 failed"
