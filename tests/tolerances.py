# SPDX-License-Identifier: MIT
"""The Python tests' tolerances, read from THE place they live: tests/common/tolerance.h (each
value is justified there by the precision). ``from tolerances import TOL_OUT_REL``."""
import os
import re

_HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "common", "tolerance.h")
_DEFINE = re.compile(r"^#define\s+(TOL_\w+)\s+(.+?)\s*(?:/\*.*)?$")
_HEX_FLOAT = re.compile(r"0x[0-9a-fA-F.]+p[-+]?\d+")


def _read(path: str) -> dict:
    """Every `#define TOL_* <expression>` of the header, evaluated as a float (expressions are
    numbers, + - * / and parentheses, hexadecimal floats and earlier TOL_* names)."""
    values: dict = {}
    with open(path) as f:
        for line in f:
            m = _DEFINE.match(line.strip())
            if not m:
                continue
            expr = _HEX_FLOAT.sub(lambda h: repr(float.fromhex(h.group(0))), m.group(2))
            if not re.fullmatch(r"[\w\s.+\-*/()]+", expr):
                raise ValueError(f"{path}: cannot read {m.group(1)} = {m.group(2)!r}")
            values[m.group(1)] = float(eval(expr, {"__builtins__": {}}, dict(values)))
    return values


globals().update(_read(_HEADER))
