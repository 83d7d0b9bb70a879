#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The architecture's arrows (docs/ARCHITECTURE.md): every #include "..." of a file under src/<part>/
# must name its own part, a part below it in the table, or the public headers; anything else is
# printed and fails. The table is the one in docs/ARCHITECTURE.md. Prints "N passed, N failed".
# needs: find grep sed
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
declare -A may=(
    [base]="base"
    [check]="base check"
    [cache]="base check cache"
    [kernels]="base check cache kernels"
    [core]="base check kernels core"
    [layer]="base check kernels core layer"
    [decode]="base check cache kernels core layer decode"
    [io]="base check io"
    [api]="base check kernels core api"
    [dist]="dist"
)
bad=0 checked=0
while IFS= read -r file; do
    rel=${file#"$root"/src/}
    part=${rel%%/*}
    [ -n "${may[$part]:-}" ] || {
        echo "src/$rel: part '$part' is not in the table"
        bad=$((bad + 1))
        continue
    }
    while IFS= read -r inc; do
        checked=$((checked + 1))
        case "$inc" in
        mha.h | mha_experimental.h | mha_mpi.h) continue ;;
        */*) target=${inc%%/*} ;;
        *)
            echo "src/$rel: #include \"$inc\" is not spelled from src/ (part/file.h)"
            bad=$((bad + 1))
            continue
            ;;
        esac
        case " ${may[$part]} " in
        *" $target "*) ;;
        *)
            echo "src/$rel: $part may not include $inc ($part -> $target is not an arrow)"
            bad=$((bad + 1))
            ;;
        esac
    done < <(sed -n 's/^[[:space:]]*#[[:space:]]*include "\([^"]*\)".*/\1/p' "$file")
done < <(find "$root/src" -type f \( -name '*.c' -o -name '*.h' -o -name '*.def' \) | sort)
echo "$checked includes checked"
if [ "$bad" -eq 0 ]; then echo "1 passed, 0 failed"; else echo "0 passed, 1 failed"; exit 1; fi
