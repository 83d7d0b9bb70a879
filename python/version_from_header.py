# SPDX-License-Identifier: MIT
"""scikit-build-core metadata provider: the package's version read from include/mha.h
(MHA_VERSION_MAJOR/MINOR/PATCH), the one place the version is written. In a checkout the header
is ../include/mha.h; in the sdist it is _csrc/include/mha.h (python/CMakeLists.txt copies the C
sources there when the sdist is made)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

__all__ = ["dynamic_metadata"]

_HEADERS = (Path("..") / "include" / "mha.h", Path("_csrc") / "include" / "mha.h")


def dynamic_metadata(field: str, settings: Mapping[str, Any]) -> str:
    if field != "version" or settings:
        raise RuntimeError("version_from_header provides only 'version' and takes no settings")
    for header in _HEADERS:
        if header.is_file():
            text = header.read_text(encoding="utf-8")
            parts = [re.search(rf"^#define MHA_VERSION_{p} (\d+)$", text, re.MULTILINE)
                     for p in ("MAJOR", "MINOR", "PATCH")]
            if not all(parts):
                raise RuntimeError(f"{header}: no MHA_VERSION_MAJOR/MINOR/PATCH defines")
            return ".".join(m.group(1) for m in parts)
    raise RuntimeError("mha: include/mha.h not found (looked in ../include and _csrc/include): "
                       "build from a checkout of the repository or from mha's sdist")
