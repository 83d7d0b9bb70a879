#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The bit-identity check of a refactor: runs tools/output_hash.c (built as mha_output_hash in the
# given build directory, default build/) under every kernel tier cap, printing one block of hashes
# per cap (the first line of each block names the tiers that really ran: a cap above this CPU's
# best tier repeats that tier). Run it before and after a change that must keep outputs
# bit-identical, with the same build setup on the same host, and `diff` the two outputs.
set -euo pipefail
build=${1:-build}
bin="$build/mha_output_hash"
[ -x "$bin" ] || {
    echo "output_hash.sh: $bin is not built (cmake --build $build --target mha_output_hash)" >&2
    exit 2
}
for isa in avx512bf16 avx512 avx2 neon generic; do
    echo "== MHA_MAX_ISA=$isa"
    MHA_MAX_ISA=$isa "$bin"
done
