# SPDX-License-Identifier: MIT
"""Which forward kernel a bfloat16 call runs on this host. Where the library prefers the bf16
tiles (mha_experimental_cpu_bf16_tiles: AMD CPUs with AVX512-BF16, under MHA_MAX_ISA), every
forward whose q, k and v are all bfloat16 runs the bf16-tile kernel (P rounded to bf16 before P V: docs/SEMANTICS.md "bf16 tile products"), so its output is no
longer bit-equal to the float32 call rounded once; tests then compare it at that kernel's bound,
TOL_HALF_TILE_C 2^-8 (max|V| + max|o|) (tests/common/tolerance.h). Backward, lse-free checks and
every other dtype keep their exact comparisons."""
import numpy as np

from tolerances import TOL_HALF_TILE_C, TOL_HALF_U_BF16, TOL_OUT_REL


def bf16_tiles_active() -> bool:
    from mha import _lib as L
    f = L.lib.mha_experimental_cpu_bf16_tiles
    f.restype = __import__("ctypes").c_int32
    f.argtypes = []
    return f() != 0


def assert_tile_close(got, want, v) -> None:
    """got (the bf16-tile kernel's output) against want (the float32 result) within the tile
    kernel's bound, all as float64 NumPy arrays."""
    got, want, v = (np.asarray(x, dtype=np.float64) for x in (got, want, v))
    bound = TOL_HALF_TILE_C * TOL_HALF_U_BF16 * (np.abs(v).max() + np.abs(want).max())
    err = np.abs(got - want).max()
    assert err <= bound + TOL_OUT_REL * np.abs(want).max(), f"{err} > {bound}"
