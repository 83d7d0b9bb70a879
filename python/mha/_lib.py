# SPDX-License-Identifier: MIT
"""ctypes binding of libmha: the C structs of include/mha.h, the loaded library, and error handling.

This module only marshals: it mirrors the structs field for field (tests/test_python_api.py checks
every size and offset against a C compiler), loads the shared library, and turns a non-OK status
into :class:`MhaError`. No math happens here.

Why ctypes: it is in the standard library (nothing to install, no compiler needed at import), and a
call through a ``ctypes.CDLL`` function releases the GIL for its whole duration, so several Python
threads can run attention at once. The few calls whose Python overhead matters at small sizes (a
layer's forward without options, the PyTorch drop-in's inference forward) go through the
compiled extension ``mha._fastcall`` instead, bound here to this same library (:data:`fast`;
None when the extension is not built, e.g. running from the source tree: then ctypes serves
everything).
"""
from __future__ import annotations

import ctypes
import operator
import os
import sys
from ctypes import (POINTER, Structure, c_char, c_char_p, c_double, c_float, c_int, c_int32,
                    c_int64, c_size_t, c_uint64, c_void_p)

__all__ = ["MhaError", "lib", "library_path", "check"]

MAX_MASK_DIMS = 4
ERROR_MESSAGE_SIZE = 512

# Status codes (mha_status); values are stable.
STATUS_NAMES = {
    0: "OK", 1: "INVALID_ARG", 2: "UNSUPPORTED", 3: "NO_MEMORY", 4: "WORKSPACE_TOO_SMALL",
    5: "OVERFLOW", 6: "IO", 7: "BAD_FILE", 8: "NOT_FOUND", 9: "INTERNAL",
}

# mha_dtype
DTYPE_F32, DTYPE_F64, DTYPE_F16, DTYPE_BF16, DTYPE_BOOL, DTYPE_U8, DTYPE_I32, DTYPE_I64 = range(8)
DTYPE_Q8_0 = 8  # ggml q8_0 blocks: the KV cache dtype and the layer's weight_dtype (mha.h)
DTYPE_Q4_0 = 10  # ggml q4_0 blocks: a layer's weight_dtype only (mha.h)
DTYPE_FP8_E4M3 = 9  # fp8 e4m3 with per-kv-head scales: the KV cache dtype only (mha.h)
# mha_alignment
ALIGN_BOTTOM_RIGHT, ALIGN_TOP_LEFT, ALIGN_EXPLICIT = range(3)
# mha_mask_polarity
MASK_ATTEND, MASK_BLOCK = range(2)
# mha_impl
IMPLS = {"auto": 0, "reference": 1, "fast": 2}
# mha_rope_style
ROPE_STYLES = {None: 0, "none": 0, "interleaved": 1, "half": 2}
# mha_rope_scaling_type
ROPE_SCALINGS = {None: 0, "none": 0, "linear": 1, "ntk": 2, "llama3": 3, "yarn": 4,
                 "dynamic": 5, "longrope": 6}
ROPE_MAX_PAIRS = 128  # MHA_ROPE_MAX_PAIRS


def int_arg(x, name: str, bits: int = 64) -> int:
    """x as a C intN_t argument: an integer (TypeError otherwise; a bool or float is not one) in
    [-2^(bits-1), 2^(bits-1)) (ValueError otherwise: ctypes would pass it modulo 2^bits, another
    sequence, rank or length without a word)."""
    if isinstance(x, bool):
        raise TypeError(f"{name}: expected an integer, got bool")
    try:
        i = operator.index(x)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(x).__name__}") from None
    if not -2 ** (bits - 1) <= i < 2 ** (bits - 1):
        raise ValueError(f"{name}={i} is outside int{bits}")
    return i


class MhaError(RuntimeError):
    """An error reported by libmha.

    Attributes:
        status: the numeric ``mha_status`` (e.g. 1 for INVALID_ARG).
        status_name: its name (``"INVALID_ARG"``, ``"UNSUPPORTED"``, ...).
        message: the library's one-line message naming the offending argument.
    """

    def __init__(self, status: int, message: str):
        self.status = int(status)
        self.status_name = STATUS_NAMES.get(self.status, "UNKNOWN")
        self.message = message
        super().__init__(f"{message} [{self.status_name}]")


# ------------------------------------------------------------------------------------------------
# Structs (include/mha.h). Enums are C ints.
# ------------------------------------------------------------------------------------------------
class mha_error(Structure):
    _fields_ = [("status", c_int), ("message", c_char * ERROR_MESSAGE_SIZE)]


class mha_mask_tensor(Structure):
    _fields_ = [("data", c_void_p), ("dtype", c_int), ("ndim", c_int32),
                ("shape", c_int64 * MAX_MASK_DIMS)]


class mha_mask_fn(Structure):
    """mha_mask_fn: a mask given as C functions (visible, optional classify); None = absent."""
    _fields_ = [("visible", c_void_p), ("classify", c_void_p), ("ctx", c_void_p),
                ("per_batch", c_int32), ("per_head", c_int32)]


class mha_masking(Structure):
    _fields_ = [
        ("causal", c_int32), ("alignment", c_int), ("align_offsets", c_void_p),
        ("window_left", c_int64), ("window_right", c_int64), ("use_window", c_int32),
        ("bool_mask", mha_mask_tensor), ("bool_mask_polarity", c_int),
        ("additive_mask", mha_mask_tensor), ("key_padding", mha_mask_tensor),
        ("q_segment_ids", c_void_p), ("kv_segment_ids", c_void_p),
        ("mask_fn", mha_mask_fn),
        ("chunk_size", c_int64),
    ]


class mha_dropout(Structure):
    _fields_ = [("p", c_float), ("seed", c_uint64), ("training", c_int32),
                ("row_offset", c_int64), ("col_offset", c_int64)]


class mha_exec(Structure):
    _fields_ = [("impl", c_int), ("n_threads", c_int32), ("workspace", c_void_p),
                ("workspace_bytes", c_size_t), ("allocator", c_void_p), ("pool", c_void_p)]


class mha_rope(Structure):
    _fields_ = [
        ("style", c_int), ("theta", c_double), ("rotary_dim", c_int64), ("scaling", c_int),
        ("factor", c_double), ("original_max_position", c_double),
        ("low_freq_factor", c_double), ("high_freq_factor", c_double),
        ("beta_fast", c_double), ("beta_slow", c_double), ("attention_factor", c_double),
        ("yarn_no_truncate", c_int32), ("short_factor", c_double * ROPE_MAX_PAIRS),
        ("long_factor", c_double * ROPE_MAX_PAIRS),
    ]


class mha_attention_args(Structure):
    _fields_ = [
        ("batch", c_int64), ("num_heads", c_int64), ("num_kv_heads", c_int64),
        ("q_len", c_int64), ("kv_len", c_int64), ("head_dim", c_int64), ("v_head_dim", c_int64),
        ("scale", c_double), ("softcap", c_double), ("alibi", c_int32), ("sinks", c_void_p),
        ("q", c_void_p), ("q_strides", c_int64 * 3),
        ("k", c_void_p), ("k_strides", c_int64 * 3),
        ("v", c_void_p), ("v_strides", c_int64 * 3),
        ("out", c_void_p), ("out_strides", c_int64 * 3),
        ("q_dtype", c_int), ("k_dtype", c_int), ("v_dtype", c_int), ("out_dtype", c_int),
        ("lse", c_void_p), ("probs", c_void_p), ("average_probs", c_int32),
        ("mask", mha_masking), ("dropout", mha_dropout),
    ]


QK_NORM_NONE, QK_NORM_RMS_HEAD, QK_NORM_RMS_ALL, QK_NORM_L2_AFTER_ROPE = 0, 1, 2, 3


class mha_qk_norm(Structure):
    _fields_ = [("kind", c_int), ("eps", c_double), ("unit_offset", c_int32)]
class mha_temperature_tuning(Structure):
    _fields_ = [("enabled", c_int32), ("floor_scale", c_double), ("attn_scale", c_double)]


class mha_config(Structure):
    _fields_ = [
        ("q_dim", c_int64), ("k_dim", c_int64), ("v_dim", c_int64), ("num_heads", c_int64),
        ("num_kv_heads", c_int64), ("head_dim", c_int64), ("v_head_dim", c_int64),
        ("out_dim", c_int64),
        ("bias_q", c_int32), ("bias_k", c_int32), ("bias_v", c_int32), ("bias_o", c_int32),
        ("sinks", c_int32), ("scale", c_double), ("softcap", c_double), ("alibi", c_int32),
        ("rope", mha_rope), ("weight_dtype", c_int),
        ("qk_norm", mha_qk_norm), ("output_gate", c_int32),
        ("temperature", mha_temperature_tuning),
    ]


MHA_HF_TEXT_SIZE = 128


class mha_hf_layer_info(Structure):
    _fields_ = [
        ("model_type", c_char * MHA_HF_TEXT_SIZE), ("layout", c_char * MHA_HF_TEXT_SIZE),
        ("prefix", c_char * MHA_HF_TEXT_SIZE), ("layer", c_int64), ("num_layers", c_int64),
        ("config", mha_config), ("causal", c_int32), ("use_window", c_int32),
        ("window_left", c_int64), ("window_right", c_int64), ("chunk_size", c_int64),
    ]


class mha_weights(Structure):
    _fields_ = [(name, c_void_p) for name in
                ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o", "sinks",
                 "q_norm", "k_norm")]


class mha_forward_args(Structure):
    _fields_ = [
        ("batch", c_int64), ("q_len", c_int64), ("kv_len", c_int64),
        ("query", c_void_p), ("key", c_void_p), ("value", c_void_p),
        ("q_positions", c_void_p), ("k_positions", c_void_p),
        ("mask", mha_masking), ("dropout", mha_dropout),
        ("out", c_void_p), ("probs", c_void_p), ("average_probs", c_int32),
        ("x_dtype", c_int), ("out_dtype", c_int),
    ]


class mha_name_map(Structure):
    _fields_ = [(name, c_char_p) for name in ("q", "k", "v", "o", "sinks")]


class mha_attention_grads(Structure):
    _fields_ = [
        ("dout", c_void_p), ("dout_strides", c_int64 * 3),
        ("dq", c_void_p), ("dq_strides", c_int64 * 3),
        ("dk", c_void_p), ("dk_strides", c_int64 * 3),
        ("dv", c_void_p), ("dv_strides", c_int64 * 3),
        ("dsinks", c_void_p), ("accumulate", c_int32),
        ("dout_dtype", c_int), ("dq_dtype", c_int), ("dk_dtype", c_int), ("dv_dtype", c_int),
        ("dlse", c_void_p), ("dprobs", c_void_p),
    ]


class mha_layer_grads(Structure):
    _fields_ = [(name, c_void_p) for name in
                ("d_query", "d_key", "d_value", "dw_q", "dw_k", "dw_v", "dw_o",
                 "db_q", "db_k", "db_v", "db_o", "d_sinks")] + [("accumulate", c_int32)] + [
                    (name, c_void_p) for name in ("d_q_norm", "d_k_norm", "d_probs")]


class mha_kv_cache_config(Structure):
    _fields_ = [("num_kv_heads", c_int64), ("head_dim", c_int64), ("v_head_dim", c_int64),
                ("max_seq", c_int64), ("batch", c_int64), ("dtype", c_int),
                ("window", c_int64), ("max_step_tokens", c_int64), ("chunk_size", c_int64),
                ("block_size", c_int64), ("num_blocks", c_int64)]


class mha_decode_args(Structure):
    _fields_ = [("num_seqs", c_int64), ("seq_ids", c_void_p), ("num_tokens", c_int64),
                ("x", c_void_p), ("out", c_void_p), ("tree_parents", c_void_p)]


class mha_kv_attention_args(Structure):
    _fields_ = [("num_seqs", c_int64), ("seq_ids", c_void_p), ("num_tokens", c_int64),
                ("num_heads", c_int64), ("scale", c_double), ("softcap", c_double),
                ("alibi", c_int32), ("sinks", c_void_p), ("q", c_void_p), ("out", c_void_p),
                ("lse", c_void_p), ("tree_parents", c_void_p)]


class mha_attention_stats(Structure):
    _fields_ = [("received", c_void_p), ("received_total", c_void_p), ("entropy", c_void_p),
                ("top_k", c_int64), ("topk_index", c_void_p), ("topk_prob", c_void_p),
                ("pool_rows", c_int64), ("pool_cols", c_int64), ("pooled", c_void_p),
                ("pooled_visible", c_void_p)]


# Every struct mirrored here, by C name (tests compare sizes and offsets with the compiler's).
# mha_mask_rule_kind (mha_mask_recognize)
(MASK_RULE_NONE, MASK_RULE_ALL_VISIBLE, MASK_RULE_BAND, MASK_RULE_KEY_PADDING,
 MASK_RULE_BAND_AND_KEY_PADDING) = range(5)


class mha_mask_rule(Structure):
    _fields_ = [("kind", c_int), ("causal", c_int32), ("delta", c_int64), ("use_window", c_int32),
                ("window_left", c_int64), ("window_right", c_int64),
                ("chunk_size", c_int64)]


STRUCTS = [mha_error, mha_mask_tensor, mha_masking, mha_dropout, mha_exec, mha_rope, mha_qk_norm,
           mha_attention_args, mha_config, mha_weights, mha_forward_args, mha_name_map,
           mha_attention_grads, mha_layer_grads, mha_kv_cache_config, mha_decode_args,
           mha_kv_attention_args,
           mha_attention_stats, mha_mask_rule, mha_temperature_tuning, mha_hf_layer_info]

# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------
def _installed_files(name: str) -> list:
    """Where the installed distribution `mha` put mha/<name>, from its RECORD: an editable
    install (`pip install -e ./python`) runs the package from the source tree and keeps the
    built library in site-packages."""
    try:
        from importlib import metadata
        files = metadata.files("mha") or []
    except Exception:  # no (or an unreadable) installed distribution
        return []
    return [str(f.locate()) for f in files if f.as_posix() == f"mha/{name}"]


def _candidates() -> list:
    """MHA_LIBRARY if set; else the library beside these files (a wheel or `pip install ./python`),
    then the installed distribution's (an editable install)."""
    env = os.environ.get("MHA_LIBRARY")
    if env:
        return [env]
    here = os.path.dirname(os.path.abspath(__file__))
    name = "libmha.dylib" if sys.platform == "darwin" else "libmha.so"
    return [os.path.join(here, name)] + _installed_files(name)


def _load():
    tried = []
    for path in _candidates():
        if os.path.exists(path):
            try:
                return ctypes.CDLL(path), path
            except OSError as e:  # e.g. libcjson missing
                raise ImportError(f"mha: could not load the C library {path}: {e}") from e
        tried.append(path)
    raise ImportError(
        "mha: the C library libmha was not found (looked for: " + ", ".join(tried) + "). "
        "Install the package with `pip install ./python` (it builds the library), or set "
        "MHA_LIBRARY=/path/to/libmha.so (e.g. the one CMake builds in build/).")


lib, library_path = _load()


def _fn(name, argtypes, restype=c_int):
    f = getattr(lib, name)
    f.argtypes = argtypes
    f.restype = restype
    return f


P = POINTER
mha_version = _fn("mha_version", [], c_char_p)
mha_status_string = _fn("mha_status_string", [c_int], c_char_p)
mha_rope_apply = _fn("mha_rope_apply", [P(mha_rope), c_int64, c_int64, c_int64, c_int64, c_void_p,
                                        P(c_int64 * 4), c_void_p, c_int64, P(mha_error)])
mha_rope_frequencies = _fn("mha_rope_frequencies", [P(mha_rope), c_int64, c_void_p, c_void_p,
                                                    P(mha_error)])
mha_rope_at_length = _fn("mha_rope_at_length", [P(mha_rope), c_int64, c_int64, P(mha_rope),
                                                P(mha_error)])
mha_attention = _fn("mha_attention", [P(mha_attention_args), P(mha_exec), P(mha_error)])
mha_attention_statistics = _fn("mha_attention_statistics", [P(mha_attention_args),
                                                            P(mha_attention_stats), P(mha_exec),
                                                            P(mha_error)])
mha_layer_attention_statistics = _fn("mha_layer_attention_statistics",
                                     [c_void_p, P(mha_forward_args), P(mha_attention_stats),
                                      P(mha_exec), P(mha_error)])
mha_attention_supported = _fn("mha_attention_supported",
                              [P(mha_attention_args), P(mha_exec), P(mha_error)])
mha_layer_create = _fn("mha_layer_create", [P(mha_config), P(mha_weights), c_int, c_void_p,
                                            P(c_void_p), P(mha_error)])
mha_layer_destroy = _fn("mha_layer_destroy", [c_void_p], None)
mha_threadpool_create = _fn("mha_threadpool_create",
                            [c_int32, c_void_p, ctypes.POINTER(c_void_p), P(mha_error)])
mha_default_threads = _fn("mha_default_threads", [], c_int32)
mha_block_cache_create = _fn("mha_block_cache_create",
                             [c_size_t, ctypes.POINTER(c_void_p), P(mha_error)])
mha_block_cache_allocator = _fn("mha_block_cache_allocator", [c_void_p], c_void_p)
mha_layer_config = _fn("mha_layer_config", [c_void_p], P(mha_config))
mha_layer_weights = _fn("mha_layer_weights", [c_void_p], P(mha_weights))
mha_q8_0_quantize = _fn("mha_q8_0_quantize", [c_void_p, c_int64, c_void_p, P(mha_error)])
mha_q8_0_dequantize = _fn("mha_q8_0_dequantize", [c_void_p, c_int64, c_void_p, P(mha_error)])
mha_q4_0_quantize = _fn("mha_q4_0_quantize", [c_void_p, c_int64, c_void_p, P(mha_error)])
mha_q4_0_dequantize = _fn("mha_q4_0_dequantize", [c_void_p, c_int64, c_void_p, P(mha_error)])
mha_layer_forward = _fn("mha_layer_forward", [c_void_p, P(mha_forward_args), P(mha_exec),
                                              P(mha_error)])
mha_layer_forward_supported = _fn("mha_layer_forward_supported",
                                  [c_void_p, P(mha_forward_args), P(mha_exec), P(mha_error)])
mha_layer_load_safetensors = _fn("mha_layer_load_safetensors",
                                 [c_char_p, c_char_p, P(mha_name_map), P(mha_config), c_void_p,
                                  P(c_void_p), P(mha_error)])

mha_hf_layer_info_read = _fn("mha_hf_layer_info_read",
                             [c_char_p, c_int64, P(mha_hf_layer_info), P(mha_error)])
mha_hf_layer_load = _fn("mha_hf_layer_load", [c_char_p, c_int64, P(mha_config), c_void_p,
                                              P(c_void_p), P(mha_error)])
mha_gguf_layer_info_read = _fn("mha_gguf_layer_info_read",
                               [c_char_p, c_int64, P(mha_hf_layer_info), P(mha_error)])
mha_layer_load_gguf = _fn("mha_layer_load_gguf", [c_char_p, c_int64, P(mha_config), c_void_p,
                                                  P(c_void_p), P(mha_error)])


def version() -> str:
    """Version string of the loaded C library ("MAJOR.MINOR.PATCH")."""
    return mha_version().decode()


def check(status: int, err: mha_error) -> None:
    """Raises MhaError for a non-OK status, with the library's message."""
    if status != 0:
        msg = err.message.decode(errors="replace") or mha_status_string(status).decode()
        raise MhaError(status, msg)


# Training (backward) and KV-cache decoding (the package and the library have the same version,
# checked at import, so every function is there).
mha_attention_backward = _fn(
    "mha_attention_backward", [P(mha_attention_args), P(mha_attention_grads), P(mha_exec),
                               P(mha_error)])
mha_layer_forward_train = _fn(
    "mha_layer_forward_train", [c_void_p, P(mha_forward_args), P(mha_exec), P(c_void_p),
                                P(mha_error)])
mha_layer_backward = _fn(
    "mha_layer_backward", [c_void_p, c_void_p, c_void_p, P(mha_layer_grads), P(mha_exec),
                           P(mha_error)])
mha_train_state_destroy = _fn("mha_train_state_destroy", [c_void_p], None)
mha_kv_cache_create = _fn(
    "mha_kv_cache_create", [P(mha_kv_cache_config), c_void_p, c_void_p, P(c_void_p),
                            P(mha_error)])
mha_kv_cache_destroy = _fn("mha_kv_cache_destroy", [c_void_p], None)
mha_kv_cache_length = _fn("mha_kv_cache_length", [c_void_p, c_int64], c_int64)
mha_kv_cache_reset = _fn("mha_kv_cache_reset", [c_void_p, c_int64, P(mha_error)])
mha_kv_cache_truncate = _fn("mha_kv_cache_truncate",
                                    [c_void_p, c_int64, c_int64, P(mha_error)])
mha_kv_cache_set_fp8_scales = _fn("mha_kv_cache_set_fp8_scales",
                                  [c_void_p, P(c_float), P(c_float), P(mha_error)])
mha_kv_cache_copy = _fn("mha_kv_cache_copy", [c_void_p, c_int64, c_int64, P(mha_error)])
mha_kv_cache_share_prefix = _fn("mha_kv_cache_share_prefix",
                                [c_void_p, c_int64, c_int64, c_int64, P(mha_error)])
mha_kv_cache_free_blocks = _fn("mha_kv_cache_free_blocks", [c_void_p], c_int64)
mha_kv_cache_compact = _fn("mha_kv_cache_compact", [c_void_p, P(mha_error)])
mha_kv_cache_accept = _fn("mha_kv_cache_accept",
                          [c_void_p, c_int64, c_int64, c_int64, c_void_p, P(mha_error)])
mha_kv_cache_get_config = _fn("mha_kv_cache_get_config", [c_void_p], P(mha_kv_cache_config))
mha_kv_cache_read = _fn("mha_kv_cache_read",
                        [c_void_p, c_int64, c_int64, c_void_p, c_void_p, P(mha_error)])
mha_kv_cache_append = _fn("mha_kv_cache_append", [c_void_p, c_int64, c_void_p, c_int64, c_void_p,
                                                  c_void_p, P(mha_error)])
mha_kv_cache_attention = _fn("mha_kv_cache_attention", [c_void_p, P(mha_kv_attention_args),
                                                        P(mha_exec), P(mha_error)])
mha_layer_prefill = _fn(
    "mha_layer_prefill", [c_void_p, c_void_p, P(mha_decode_args), P(mha_exec), P(mha_error)])
mha_layer_decode_step = _fn(
    "mha_layer_decode_step", [c_void_p, c_void_p, P(mha_decode_args), P(mha_exec),
                              P(mha_error)])

mha_block_mask_create = _fn("mha_block_mask_create", [P(mha_attention_args), P(mha_exec),
                                                      P(c_void_p), P(mha_error)])
mha_block_mask_destroy = _fn("mha_block_mask_destroy", [c_void_p], None)
mha_attention_masked = _fn("mha_attention_masked", [P(mha_attention_args), c_void_p, P(mha_exec),
                                                    P(mha_error)])
mha_attention_backward_masked = _fn(
    "mha_attention_backward_masked", [P(mha_attention_args), P(mha_attention_grads), c_void_p,
                                      P(mha_exec), P(mha_error)])

mha_mask_recognize = _fn("mha_mask_recognize",
                         [P(mha_mask_tensor), c_int32, c_int, c_int64, c_int64, c_int64, c_int64,
                          P(mha_mask_rule), c_void_p, P(mha_error)])


# ------------------------------------------------------------------------------------------------
# The compiled fast path (python/mha/_fastcall.c): given the addresses of this library's functions,
# so a layer made here is run by the same code whatever MHA_LIBRARY says.
# ------------------------------------------------------------------------------------------------
def _bind_fast():
    try:
        from . import _fastcall
    except ImportError:
        return None
    import numpy as np
    fns = (mha_layer_forward, mha_layer_config, mha_status_string)
    _fastcall.bind(tuple(ctypes.cast(f, c_void_p).value for f in fns), MhaError, np.empty,
                   np.dtype(np.float32))
    return _fastcall


fast = _bind_fast()


# Multi-head latent attention (mha.h "Multi-head latent attention").
class mha_mla_config(Structure):
    _fields_ = [
        ("hidden", c_int64), ("num_heads", c_int64), ("q_lora_rank", c_int64),
        ("kv_lora_rank", c_int64), ("qk_nope_head_dim", c_int64), ("qk_rope_head_dim", c_int64),
        ("v_head_dim", c_int64), ("bias", c_int32), ("rms_eps", c_double), ("scale", c_double),
        ("rope", mha_rope),
    ]


MLA_WEIGHT_NAMES = ("w_q", "w_q_a", "b_q_a", "q_a_norm", "w_q_b", "w_kv_a", "b_kv_a",
                    "kv_a_norm", "w_kv_b", "w_o", "b_o")


class mha_mla_weights(Structure):
    _fields_ = [(name, c_void_p) for name in MLA_WEIGHT_NAMES]


class mha_mla_forward_args(Structure):
    _fields_ = [("batch", c_int64), ("seq_len", c_int64), ("x", c_void_p),
                ("positions", c_void_p), ("causal", c_int32), ("out", c_void_p)]


mha_mla_create = _fn("mha_mla_create", [P(mha_mla_config), P(mha_mla_weights), c_void_p,
                                        P(c_void_p), P(mha_error)])
mha_mla_destroy = _fn("mha_mla_destroy", [c_void_p], None)
mha_mla_get_config = _fn("mha_mla_get_config", [c_void_p], P(mha_mla_config))
mha_mla_forward = _fn("mha_mla_forward", [c_void_p, P(mha_mla_forward_args), P(mha_exec),
                                          P(mha_error)])
mha_mla_cache_create = _fn("mha_mla_cache_create", [c_void_p, c_int64, c_int64, c_int, c_void_p,
                                                    P(c_void_p), P(mha_error)])
mha_mla_cache_destroy = _fn("mha_mla_cache_destroy", [c_void_p], None)
mha_mla_cache_length = _fn("mha_mla_cache_length", [c_void_p, c_int64], c_int64)
mha_mla_cache_bytes_per_token = _fn("mha_mla_cache_bytes_per_token", [c_void_p], c_int64)
mha_mla_cache_reset = _fn("mha_mla_cache_reset", [c_void_p, c_int64, P(mha_error)])
mha_mla_decode_step = _fn("mha_mla_decode_step", [c_void_p, c_void_p, P(mha_decode_args),
                                                  P(mha_exec), P(mha_error)])
mha_hf_mla_load = _fn("mha_hf_mla_load", [c_char_p, c_int64, c_void_p, P(c_void_p),
                                          P(mha_hf_layer_info), P(mha_error)])


class mha_mla_grads(Structure):
    _fields_ = [("dy", c_void_p), ("dx", c_void_p)] + [(n, c_void_p) for n in MLA_WEIGHT_NAMES]


mha_mla_backward = _fn("mha_mla_backward", [c_void_p, P(mha_mla_forward_args), P(mha_mla_grads),
                                            P(mha_exec), P(mha_error)])
mha_mla_cache_append = _fn("mha_mla_cache_append", [c_void_p, c_int64, c_void_p, c_int64,
                                                    c_void_p, P(mha_error)])
mha_mla_get_weights = _fn("mha_mla_get_weights", [c_void_p], P(mha_mla_weights))
