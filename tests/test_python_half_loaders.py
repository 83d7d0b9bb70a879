# SPDX-License-Identifier: MIT
"""The loaders in half precision seen from Python (ctypes on libmha): a BF16 safetensors file
written by safetensors.numpy and a bf16 transformers checkpoint, loaded with config.weight_dtype =
MHA_DTYPE_BF16 by mha_layer_load_safetensors / mha_hf_layer_load, give a layer whose weights ARE the
files' bytes (no widening). The CLI side of the same files is tests/test_cli_half.py. Named
test_python_* because it loads libmha.so into the interpreter (skipped in sanitizer builds).
"""
import ctypes
import json
import os
import sys

import numpy as np
import pytest

from test_cli_half import bf16_safetensors, llama_bf16

SRC = os.environ.get("MHA_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(SRC, "python"))
if not os.environ.get("MHA_LIBRARY"):
    pytest.skip("MHA_LIBRARY is not set", allow_module_level=True)
from mha import _lib as L  # noqa: E402

MHA_DTYPE_BF16 = 3
PROJ = (("w_q", "q_proj"), ("w_k", "k_proj"), ("w_v", "v_proj"), ("w_o", "o_proj"))


def _bytes_of_layer(ptr):
    """The layer's weight_dtype and its four projections' bytes (2 bytes per element)."""
    try:
        cfg = L.mha_layer_config(ptr).contents
        w = L.mha_layer_weights(ptr).contents
        rows_cols = {"w_q": (cfg.num_heads * cfg.head_dim, cfg.q_dim),
                     "w_k": (cfg.num_kv_heads * cfg.head_dim, cfg.k_dim),
                     "w_v": (cfg.num_kv_heads * cfg.v_head_dim, cfg.v_dim),
                     "w_o": (cfg.out_dim, cfg.num_heads * cfg.v_head_dim)}
        return cfg.weight_dtype, {nm: ctypes.string_at(getattr(w, nm), 2 * r * c)
                                  for nm, (r, c) in rows_cols.items()}
    finally:
        L.mha_layer_destroy(ptr)


def test_bf16_safetensors_kept_as_bytes(tmp_path):
    p = tmp_path / "Wb.safetensors"
    w = bf16_safetensors(p, np.random.default_rng(7))
    c = L.mha_config()
    c.num_heads = 4
    c.weight_dtype = MHA_DTYPE_BF16
    ptr, err = ctypes.c_void_p(), L.mha_error()
    assert L.mha_layer_load_safetensors(str(p).encode(), None, None, ctypes.byref(c), None,
                                        ctypes.byref(ptr), ctypes.byref(err)) == 0, err.message
    dtype, got = _bytes_of_layer(ptr)
    assert dtype == MHA_DTYPE_BF16
    for nm, t in PROJ:
        assert got[nm] == w[t + ".weight"].tobytes(), nm


def test_hf_bf16_checkpoint_kept_as_bytes(tmp_path):
    d = tmp_path / "llama_bf16"
    llama_bf16(d)
    with open(d / "model.safetensors", "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        hdr = json.loads(f.read(n))
        data = f.read()
    info, err, ptr = L.mha_hf_layer_info(), L.mha_error(), ctypes.c_void_p()
    assert L.mha_hf_layer_info_read(str(d).encode(), 0, ctypes.byref(info),
                                    ctypes.byref(err)) == 0, err.message
    assert info.config.weight_dtype == 0  # the info says float32 whatever torch_dtype is
    info.config.weight_dtype = MHA_DTYPE_BF16
    assert L.mha_hf_layer_load(str(d).encode(), 0, ctypes.byref(info.config), None,
                               ctypes.byref(ptr), ctypes.byref(err)) == 0, err.message
    dtype, got = _bytes_of_layer(ptr)
    assert dtype == MHA_DTYPE_BF16
    for nm, t in PROJ:
        e = hdr[f"model.layers.0.self_attn.{t}.weight"]
        assert e["dtype"] == "BF16"
        lo, hi = e["data_offsets"]
        assert got[nm] == data[lo:hi], nm
