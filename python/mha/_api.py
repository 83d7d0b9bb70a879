# SPDX-License-Identifier: MIT
"""The NumPy API of mha: layers, the attention core, RoPE, backward and KV-cache decoding.

Everything here marshals NumPy arrays into the C structs of ``_lib`` and calls libmha; the math is
in C (docs/SEMANTICS.md is the contract). Arrays: float32 (float64/float16 are converted), any
memory order (copied when the C side needs C order or a contiguous last dimension). The attention
core (:func:`attention`, :func:`attention_backward`) also reads float16 and bfloat16
(``ml_dtypes.bfloat16``, what JAX uses) as they are stored, and writes its outputs in them.
"""
from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from . import _lib as L
from . import _marshal as M
from ._lib import MhaError

ArrayLike = Any  # numpy arrays, or anything np.asarray accepts (lists, CPU torch tensors, ...)

__all__ = ["Rope", "Config", "MultiheadAttention", "TrainState", "KVCache", "MLA", "MLACache",
           "attention",
           "attention_backward", "rope", "rope_frequencies", "shard_rows"]

_F32 = np.dtype(np.float32)
_fast = L.fast  # the compiled hot path, or None (then ctypes serves every call)
# Storage dtypes of the core's tensors (mha_attention_args.q_dtype, ...): the rest is converted to
# float32. ml_dtypes' bfloat16 is added at its first sight (_storage_code).
_STORAGE_CODES = {_F32: L.DTYPE_F32, np.dtype(np.float16): L.DTYPE_F16}
_MASK_DTYPES = {np.dtype(np.bool_): L.DTYPE_BOOL, np.dtype(np.uint8): L.DTYPE_U8,
                np.dtype(np.int32): L.DTYPE_I32, np.dtype(np.int64): L.DTYPE_I64}


# ------------------------------------------------------------------------------------------------
# Small marshalling helpers
# ------------------------------------------------------------------------------------------------
def _ptr_portable(a: Optional[np.ndarray]) -> Optional[int]:
    return None if a is None else a.__array_interface__["data"][0]


def _make_ptr():
    """The data pointer of an ndarray, fast.

    ``a.__array_interface__`` (and ``a.ctypes.data``, built on it) makes a dict per call, about
    2-4 us, which was the largest single item of a small forward call. In CPython an object's id
    is its address, and NumPy's ``PyArrayObject`` is ``PyObject_HEAD`` followed by ``char *data``
    (the field ``PyArray_DATA`` reads; part of NumPy's ABI), so the pointer is one load at
    ``id(a) + object.__basicsize__`` (0.2 us). The layout is checked at import against
    ``__array_interface__`` on arrays and views; anywhere it does not hold (another interpreter, a
    NumPy with another layout) the portable version is used."""
    import platform
    if platform.python_implementation() != "CPython":
        return _ptr_portable
    read = ctypes.c_void_p.from_address
    off = object.__basicsize__
    ndarray = np.ndarray

    def fast(a: Optional[np.ndarray]) -> Optional[int]:
        if a is None:
            return None
        if isinstance(a, ndarray):
            return read(id(a) + off).value
        return a.__array_interface__["data"][0]

    try:
        base = np.arange(64, dtype=np.float32)
        probes = [base, base[5:], base.reshape(8, 8)[2:, 3], base.reshape(4, 16).T,
                  np.zeros((3, 5), np.int64)[1:], np.asarray(memoryview(bytearray(40)))[8:]]
        if all(fast(x) == _ptr_portable(x) for x in probes):
            return fast
    except Exception:  # pragma: no cover - anything unexpected: the portable path
        pass
    return _ptr_portable  # pragma: no cover


_ptr = _make_ptr()


def _is_float(dt: np.dtype) -> bool:
    """A floating dtype: NumPy's (float16/32/64, longdouble, any byte order), or one of ml_dtypes'
    (bfloat16, the float8 types: what np.asarray gives for a JAX bfloat16 array), whose kind is
    'V'."""
    return dt.kind == "f" or (dt.kind == "V" and dt.type.__module__.startswith("ml_dtypes")
                              and dt.name.startswith(("bfloat16", "float")))


def _storage_code(dt: np.dtype) -> Optional[int]:
    """The mha_dtype the core reads an array of dtype dt in as it is stored: float32, float16, or
    ml_dtypes' bfloat16 (kind 'V', named 'bfloat16'; ml_dtypes itself is not imported: an array
    of that dtype exists only if it is installed), in native byte order; None for any other."""
    if not dt.isnative:
        return None
    code = _STORAGE_CODES.get(dt)
    if code is None and dt.kind == "V" and dt.name == "bfloat16" and \
            dt.type.__module__.startswith("ml_dtypes"):
        _STORAGE_CODES[dt] = code = L.DTYPE_BF16
    return code


def _float32(x: ArrayLike, name: str, contiguous: bool = True) -> np.ndarray:
    """x as a float32 array (converted from other float types, bfloat16 included), C-contiguous
    if asked; TypeError for any other dtype."""
    a = np.asarray(x)
    if a.dtype != _F32:
        if not _is_float(a.dtype):
            raise TypeError(f"{name}: expected a floating-point array, got dtype {a.dtype}")
        a = a.astype(_F32)
    if contiguous and not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    return a


_i64 = L.int_arg  # (x, name): an int64_t argument


def _layer_index(layer: Any) -> None:
    """A model's layer index: a non-negative integer below 2^63 (ValueError otherwise: ctypes
    passes an int64_t modulo 2^64, so 2^64 would load layer 0)."""
    if (isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0
            or layer >= 2**63):
        raise ValueError(f"layer: expected a non-negative integer below 2**63, got {layer!r}")


def _int_array(x: ArrayLike, name: str, dtype, shape: Tuple[int, ...]) -> np.ndarray:
    """Integer array broadcast to `shape`, C-contiguous, of `dtype`."""
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array, got dtype {a.dtype}")
    try:
        a = np.broadcast_to(a, shape)
    except ValueError:
        raise ValueError(f"{name}: shape {a.shape} does not broadcast to {shape}") from None
    if a.dtype != dtype and a.size:  # narrowing would wrap (2^32 -> 0): refuse, never reinterpret
        info = np.iinfo(dtype)
        lo, hi = int(a.min()), int(a.max())
        if lo < info.min or hi > info.max:
            raise ValueError(f"{name}: value {lo if lo < info.min else hi} is outside "
                             f"{np.dtype(dtype).name}")
    return np.ascontiguousarray(a, dtype=dtype)


def _core_operand(x: ArrayLike, name: str, native: bool) -> np.ndarray:
    """x as an array the core reads: as it is if `native` and its dtype is a storage dtype
    (_storage_code: float32, float16, bfloat16), else converted to float32 (float64, float8, ...;
    TypeError for a non-float dtype). Any strides (_strided fixes them)."""
    a = np.asarray(x)
    if a.dtype is _F32 or (native and _storage_code(a.dtype) is not None):
        return a
    return _float32(a, name, contiguous=False)


def _layer_arrays(arrays: Dict[str, ArrayLike], storage: Optional[int]):
    """({name: C-contiguous array}, weight_dtype) of a layer's weights, biases and sinks (one
    mha_config.weight_dtype for all of them). storage None: kept in their dtype if they all have
    one storage dtype (float32, float16, ml_dtypes' bfloat16), else all converted to float32
    (widening is exact: nothing is rounded). storage = a code: the arrays hold that dtype's bits
    already (2-byte integers for a half, as the PyTorch drop-in passes torch's bfloat16)."""
    arrs = {nm: np.asarray(x) for nm, x in arrays.items()}
    if storage is not None:
        return {nm: np.ascontiguousarray(a) for nm, a in arrs.items()}, storage
    codes = {_storage_code(a.dtype) for a in arrs.values()}
    if len(codes) == 1 and None not in codes:
        return {nm: np.ascontiguousarray(a) for nm, a in arrs.items()}, codes.pop()
    return {nm: _float32(a, nm) for nm, a in arrs.items()}, L.DTYPE_F32


def _layer_inputs(xs: Dict[str, ArrayLike]):
    """({name: C-contiguous array}, x_dtype, out dtype) of the layer's query/key/value: kept in
    their dtype if they share one storage dtype (float32, float16, bfloat16), else all converted
    to float32 (exact). The output has query's dtype when it is a storage dtype, else float32
    (float64 input: computed in float32 as before)."""
    arrs = {nm: np.asarray(x) for nm, x in xs.items() if x is not None}
    for nm, a in arrs.items():
        if not _is_float(a.dtype):
            raise TypeError(f"{nm}: expected a floating-point array, got dtype {a.dtype}")
    qdt = arrs["query"].dtype
    out_dt = qdt if _storage_code(qdt) is not None else _F32
    codes = {_storage_code(a.dtype) for a in arrs.values()}
    if len(codes) == 1 and None not in codes:
        code = codes.pop()
        return {nm: np.ascontiguousarray(a) for nm, a in arrs.items()}, code, out_dt
    return {nm: _float32(a, nm) for nm, a in arrs.items()}, L.DTYPE_F32, out_dt


def _half_to_f32(a: np.ndarray, code: int) -> np.ndarray:
    """A copy of a layer's stored weights (2-byte bits for a half) as an array of their dtype:
    float16, ml_dtypes' bfloat16 when it is installed, else bfloat16 widened to float32 (exact:
    its bits are float32's top half)."""
    if code == L.DTYPE_F16:
        return a.view(np.float16).copy()
    try:
        import ml_dtypes
        return a.view(ml_dtypes.bfloat16).copy()
    except ImportError:
        return (a.view(np.uint16).astype(np.uint32) << 16).view(_F32)


def _strided(a: np.ndarray, name: str, ndim: int = 4) -> np.ndarray:
    """a (float32/float16/bfloat16) with a contiguous last dimension and non-negative strides
    that are whole elements (copied otherwise); other strides are kept as they are."""
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
    st, size = a.strides, a.itemsize
    if (a.shape[-1] > 1 and st[-1] != size) or any(s < 0 or s % size for s in st):
        a = np.ascontiguousarray(a)
    return a


def _el_strides(a: np.ndarray) -> Tuple[int, int, int]:
    s, size = a.strides, a.itemsize
    return (s[0] // size, s[1] // size, s[2] // size)


def _mask_tensor(t: L.mha_mask_tensor, x: ArrayLike, name: str, additive: bool,
                 keep: list, insert_head_axis: bool = False) -> None:
    a = np.asarray(x)
    if additive:
        a = _float32(a, name)
        code = L.DTYPE_F32
    else:
        if a.dtype not in _MASK_DTYPES:
            if a.dtype.kind not in "biu":
                raise TypeError(f"{name}: expected a bool or integer array, got {a.dtype}")
            a = a != 0
        a = np.ascontiguousarray(a)
        code = _MASK_DTYPES[a.dtype]
    if insert_head_axis and a.ndim == 3:
        a = a[:, None]  # [B, n, m] -> [B, 1, n, m] (inputs without a head axis)
    if a.ndim < 1 or a.ndim > L.MAX_MASK_DIMS:
        raise ValueError(f"{name}: expected 1 to {L.MAX_MASK_DIMS} dimensions, got shape {a.shape}")
    keep.append(a)
    M.set_mask_tensor(t, _ptr(a), code, a.shape)


def _chunk_size(c) -> int:
    """chunk_size as an int64 (None = 0); a bool or non-integer raises naming it."""
    if c is None:
        return 0
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
        raise TypeError(f"chunk_size: expected an integer (0 = off), got {c!r}")
    if not -2**63 <= int(c) < 2**63:
        raise ValueError(f"chunk_size={c} is outside int64")
    return int(c)


def _fill_masking(mk: L.mha_masking, keep: list, *, batch: int, causal, alignment, mask,
                  mask_means: str, attn_bias, key_padding_mask, window, q_segment_ids,
                  kv_segment_ids, n: int, m: int, insert_head_axis: bool = False,
                  chunk_size: Optional[int] = 0) -> None:
    """The masking options into mk, which comes from M.forward_args or M.attention_args (zeroed:
    no masking, window already unbounded); keeps what it points at."""
    if (causal is False and alignment is None and mask is None and attn_bias is None
            and key_padding_mask is None and window is None and q_segment_ids is None
            and kv_segment_ids is None and not chunk_size):
        return  # no masking (the common call: skip the rest)
    if chunk_size:  # the library refuses a negative one naming mask.chunk_size
        mk.chunk_size = _chunk_size(chunk_size)
    if isinstance(causal, str):
        if causal not in ("bottom-right", "top-left"):
            raise ValueError(f"causal: expected True/False, 'bottom-right' or 'top-left', got {causal!r}")
        if alignment is not None and alignment != causal:
            raise ValueError("causal and alignment disagree")
        alignment = causal
        causal = True
    mk.causal = 1 if causal else 0
    if alignment is None or (isinstance(alignment, str) and alignment == "bottom-right"):
        mk.alignment = L.ALIGN_BOTTOM_RIGHT
    elif isinstance(alignment, str) and alignment == "top-left":
        mk.alignment = L.ALIGN_TOP_LEFT
    elif isinstance(alignment, str):
        raise ValueError(f"alignment: expected 'bottom-right', 'top-left' or offsets, got {alignment!r}")
    else:
        off = _int_array(alignment, "alignment", np.int64, (batch,))
        keep.append(off)
        mk.alignment = L.ALIGN_EXPLICIT
        mk.align_offsets = _ptr(off)
    if window is not None:
        if len(window) != 2:
            raise ValueError("window: expected (left, right); None or -1 = unbounded")
        left, right = (-1 if w is None else _i64(int(w), "window") for w in window)
        mk.window_left, mk.window_right, mk.use_window = left, right, 1
    if mask is not None:
        ma = np.asarray(mask)
        if _is_float(ma.dtype):
            if mask_means != "attend":  # (a float mask is added: 'block' would be ignored)
                raise ValueError(f"mask_means={mask_means!r} with a float mask: a float mask is "
                                 f"added to the scores (-inf blocks); mask_means reads boolean "
                                 f"and integer masks only")
            if attn_bias is not None:
                raise ValueError("mask is a float (additive) mask and attn_bias is also given; "
                                 "add them, or pass a boolean mask")
            attn_bias, mask = ma, None
    if mask is not None:
        if mask_means not in ("attend", "block"):
            raise ValueError(f"mask_means: expected 'attend' or 'block', got {mask_means!r}")
        _mask_tensor(mk.bool_mask, mask, "mask", False, keep, insert_head_axis)
        mk.bool_mask_polarity = L.MASK_ATTEND if mask_means == "attend" else L.MASK_BLOCK
    if attn_bias is not None:
        _mask_tensor(mk.additive_mask, attn_bias, "attn_bias", True, keep, insert_head_axis)
    if key_padding_mask is not None:
        _mask_tensor(mk.key_padding, key_padding_mask, "key_padding_mask", False, keep)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids go together (give both or neither)")
    if q_segment_ids is not None:
        qs = _int_array(q_segment_ids, "q_segment_ids", np.int32, (batch, n))
        ks = _int_array(kv_segment_ids, "kv_segment_ids", np.int32, (batch, m))
        keep += [qs, ks]
        mk.q_segment_ids, mk.kv_segment_ids = _ptr(qs), _ptr(ks)


def _exec(impl: str, threads: int) -> L.mha_exec:
    """The (shared, cached) mha_exec of impl 'auto', 'reference' or 'fast' and threads >= 0."""
    code = L.IMPLS.get(impl)
    if code is None:
        raise ValueError(f"impl: expected 'auto', 'reference' or 'fast', got {impl!r}")
    if not 0 <= threads < 2 ** 31:  # mha_exec.n_threads is an int32 (ctypes would wrap it)
        raise ValueError(f"threads: expected 0 (all CPUs) to 2^31 - 1, got {threads}")
    return M.exec_struct(code, threads if type(threads) is int else int(threads))


def _dropout(d: L.mha_dropout, p: float, seed: int) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout: expected a probability in [0, 1), got {p}")
    M.set_dropout(d, p, seed)


_SCALE_ZERO = "scale=0 is not supported (0 means the default 1/sqrt(d_k) in libmha)"
_RING_ONLY = "seq_len and shard_layout go with comm= (ring attention over MPI); comm is None"


# ------------------------------------------------------------------------------------------------
# RoPE
# ------------------------------------------------------------------------------------------------
@dataclass
class Rope:
    """Rotary position embedding options (docs/SEMANTICS.md, "RoPE").

    style: 'interleaved' (pairs 2k, 2k+1: RoFormer, CS336, GPT-J) or 'half' (pairs k, k+R/2:
    GPT-NeoX, HF Llama). rotary_dim: R (even, <= head_dim; None = head_dim). scaling: None,
    'linear', 'ntk', 'dynamic' (NTK at each call's length beyond original_max_position, which it
    requires), 'llama3', 'yarn' or 'longrope' (each pair's frequency divided by its entry of
    short_factor, or of long_factor for calls longer than original_max_position: R/2 numbers
    each), with its parameters (None = the documented default); yarn_no_truncate keeps YaRN's
    ramp ends unrounded (transformers' ``truncate: false``).
    """
    style: str = "interleaved"
    theta: float = 10000.0
    rotary_dim: Optional[int] = None
    scaling: Optional[str] = None
    factor: Optional[float] = None
    original_max_position: Optional[float] = None
    low_freq_factor: Optional[float] = None
    high_freq_factor: Optional[float] = None
    beta_fast: Optional[float] = None
    beta_slow: Optional[float] = None
    attention_factor: Optional[float] = None
    yarn_no_truncate: bool = False
    short_factor: Optional[Sequence[float]] = None
    long_factor: Optional[Sequence[float]] = None

    def _to_c(self) -> L.mha_rope:
        r = L.mha_rope()
        if self.style not in ("interleaved", "half"):
            raise ValueError(f"rope style: expected 'interleaved' or 'half', got {self.style!r}")
        if self.scaling not in L.ROPE_SCALINGS:
            raise ValueError(f"rope scaling: expected None, 'linear', 'ntk', 'dynamic', 'llama3', "
                             f"'yarn' or 'longrope', got {self.scaling!r}")
        r.style = L.ROPE_STYLES[self.style]
        r.theta = float(self.theta)
        r.rotary_dim = _i64(int(self.rotary_dim or 0), "rope rotary_dim")
        r.scaling = L.ROPE_SCALINGS[self.scaling]
        for f in ("factor", "original_max_position", "low_freq_factor", "high_freq_factor",
                  "beta_fast", "beta_slow", "attention_factor"):
            setattr(r, f, float(getattr(self, f) or 0.0))
        r.yarn_no_truncate = 1 if self.yarn_no_truncate else 0
        for name in ("short_factor", "long_factor"):
            values = getattr(self, name)
            if values is None:
                continue
            values = [float(v) for v in values]
            if len(values) > L.ROPE_MAX_PAIRS:
                raise ValueError(f"rope {name}: at most {L.ROPE_MAX_PAIRS} entries, got "
                                 f"{len(values)}")
            getattr(r, name)[:len(values)] = values
        return r

    @classmethod
    def _from_c(cls, r: L.mha_rope) -> Optional["Rope"]:
        if r.style == 0:
            return None
        style = {1: "interleaved", 2: "half"}[r.style]
        scaling = {0: None, 1: "linear", 2: "ntk", 3: "llama3", 4: "yarn", 5: "dynamic",
                   6: "longrope"}[r.scaling]
        kw = {f: (getattr(r, f) or None) for f in (
            "factor", "original_max_position", "low_freq_factor", "high_freq_factor",
            "beta_fast", "beta_slow", "attention_factor")}
        if scaling == "longrope":  # R/2 entries (R = 0: head_dim, unknown here: the given ones)
            pairs = r.rotary_dim // 2 or next(
                (k for k in range(L.ROPE_MAX_PAIRS) if r.short_factor[k] == 0.0), L.ROPE_MAX_PAIRS)
            kw["short_factor"] = tuple(r.short_factor[:pairs])
            kw["long_factor"] = tuple(r.long_factor[:pairs])
        return cls(style=style, theta=r.theta, rotary_dim=r.rotary_dim or None, scaling=scaling,
                   yarn_no_truncate=bool(r.yarn_no_truncate), **kw)


def _as_rope(r: Union[None, str, dict, Rope]) -> Optional[Rope]:
    if r is None or isinstance(r, Rope):
        return r
    if isinstance(r, str):
        return Rope(style=r)
    if isinstance(r, dict):
        return Rope(**r)
    raise TypeError(f"rope: expected None, a style name, a dict or mha.Rope, got {type(r).__name__}")


def rope(x: ArrayLike, positions: Optional[ArrayLike] = None, *, style: str = "interleaved",
         theta: float = 10000.0, rotary_dim: Optional[int] = None, scaling: Optional[str] = None,
         layout: str = "blhd", **scaling_params: float) -> np.ndarray:
    """Applies RoPE to x and returns a new float32 array (mha_rope_apply).

    x: [L, D], [B, L, D] or [B, L, H, D] (layout 'blhd'), or [B, H, L, D] with layout='bhld'.
    positions: integers [L] (broadcast over the batch) or [B, L]; None = 0 .. L-1.
    Other keywords: as :class:`Rope` (scaling parameters by name, e.g. factor=8).
    """
    r = Rope(style=style, theta=theta, rotary_dim=rotary_dim, scaling=scaling,
             **scaling_params)._to_c()
    a = _float32(x, "x")
    out = np.array(a, dtype=_F32, order="C", copy=True)
    if out.ndim == 2:
        v = out[None, :, None, :]
    elif out.ndim == 3:
        v = out[:, :, None, :]
    elif out.ndim == 4:
        if layout == "blhd":
            v = out
        elif layout == "bhld":
            v = out.transpose(0, 2, 1, 3)
        else:
            raise ValueError(f"layout: expected 'blhd' or 'bhld', got {layout!r}")
    else:
        raise ValueError(f"x: expected 2 to 4 dimensions, got shape {a.shape}")
    B, T, H, D = v.shape
    strides = (ctypes.c_int64 * 4)(*(s // 4 for s in v.strides))
    pos, pstride = None, 0
    if positions is not None:
        p = np.asarray(positions)
        if p.ndim == 1:
            pos = _int_array(p, "positions", np.int64, (T,))
        else:
            pos = _int_array(p, "positions", np.int64, (B, T))
            pstride = T
    M.call(L.mha_rope_apply, r, B, T, H, D, _ptr(out), strides, _ptr(pos), pstride)
    return out


def rope_frequencies(head_dim: int, *, style: str = "interleaved", theta: float = 10000.0,
                     rotary_dim: Optional[int] = None, scaling: Optional[str] = None,
                     length: Optional[int] = None,
                     **scaling_params: float) -> Tuple[np.ndarray, float]:
    """The (scaled) inverse frequencies f_k (float64, R/2 of them) and the cos/sin factor.
    length: the call's length (1 + its largest position), which scaling='dynamic' needs
    (mha_rope_at_length)."""
    rp = Rope(style=style, theta=theta, rotary_dim=rotary_dim, scaling=scaling, **scaling_params)
    r = rp._to_c()
    head_dim = _i64(head_dim, "head_dim")
    if length is not None:
        fixed = L.mha_rope()
        M.call(L.mha_rope_at_length, r, head_dim, _i64(int(length), "length"),
               ctypes.byref(fixed))
        r = fixed
    R = rotary_dim or head_dim
    freqs = np.zeros(max(R // 2, 1), dtype=np.float64)
    fac = ctypes.c_double()
    M.call(L.mha_rope_frequencies, r, head_dim, _ptr(freqs), ctypes.byref(fac))
    return freqs[:R // 2], fac.value


# ------------------------------------------------------------------------------------------------
# The attention core
# ------------------------------------------------------------------------------------------------
def _core_views(q, k, v, layout: str, native: bool = True):
    """Returns (q4, k4, v4, ndim_in) with every tensor viewed as [B, heads, L, d], each in its
    storage dtype (float32, float16, bfloat16; others converted to float32), or all in float32
    unless `native`."""
    arrs = [_core_operand(q, "q", native), _core_operand(k, "k", native),
            _core_operand(v, "v", native)]
    qa = arrs[0]
    nd = qa.ndim
    for a, nm in zip(arrs, "qkv"):
        if a.ndim != nd:
            raise ValueError(f"{nm}: expected {nd} dimensions like q, got shape {a.shape}")
    if nd == 2:
        arrs = [a[None, None] for a in arrs]
    elif nd == 3:
        arrs = [a[:, None] for a in arrs]
    elif nd == 4:
        if layout == "blhd":
            arrs = [a.transpose(0, 2, 1, 3) for a in arrs]
        elif layout != "bhld":
            raise ValueError(f"layout: expected 'bhld' or 'blhd', got {layout!r}")
    else:
        raise ValueError(f"q: expected 2 to 4 dimensions ([L, d], [B, L, d], [B, h, L, d]), "
                         f"got shape {qa.shape}")
    return [_strided(a, nm) for a, nm in zip(arrs, "qkv")] + [nd]


def _core_args(q4, k4, v4, keep: list, *, scale, softcap, alibi, sinks, causal, alignment,
               mask, mask_means, attn_bias, key_padding_mask, window, q_segment_ids,
               kv_segment_ids, dropout, seed, insert_head_axis,
               chunk_size=0) -> L.mha_attention_args:
    B, h, n, d = q4.shape
    Bk, g, m, dk = k4.shape
    Bv, gv, mv, dv = v4.shape
    if (Bk, Bv) != (B, B) or gv != g or mv != m or dk != d:
        raise ValueError(f"q {q4.shape}, k {k4.shape}, v {v4.shape} ([B, heads, L, d]) do not "
                         f"agree: k and v need q's batch and head_dim, the same heads and length")
    a = M.attention_args((_ptr(q4), q4.shape, _el_strides(q4)),
                         (_ptr(k4), k4.shape, _el_strides(k4)),
                         (_ptr(v4), v4.shape, _el_strides(v4)), M.scale_value(scale, _SCALE_ZERO))
    if q4.dtype is not _F32 or k4.dtype is not _F32 or v4.dtype is not _F32:
        a.q_dtype, a.k_dtype, a.v_dtype = (_storage_code(t.dtype) for t in (q4, k4, v4))
    a.softcap = float(softcap or 0.0)
    a.alibi = 1 if alibi else 0
    if sinks is not None:
        s = _float32(sinks, "sinks")
        if s.shape != (h,):
            raise ValueError(f"sinks: expected shape ({h},), got {s.shape}")
        keep.append(s)
        a.sinks = _ptr(s)
    _fill_masking(a.mask, keep, batch=B, causal=causal, alignment=alignment, mask=mask,
                  mask_means=mask_means, attn_bias=attn_bias, key_padding_mask=key_padding_mask,
                  window=window, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                  n=n, m=m, insert_head_axis=insert_head_axis, chunk_size=chunk_size)
    if dropout != 0.0 or seed != 0:  # else the zeroed struct already says "no dropout"
        _dropout(a.dropout, dropout, seed)
    return a


def attention(q: ArrayLike, k: ArrayLike, v: ArrayLike, *, layout: str = "bhld",
              scale: Optional[float] = None, softcap: Optional[float] = None,
              alibi: bool = False, sinks: Optional[ArrayLike] = None,
              causal: Union[bool, str] = False, alignment=None,
              mask: Optional[ArrayLike] = None, mask_means: str = "attend",
              attn_bias: Optional[ArrayLike] = None, key_padding_mask: Optional[ArrayLike] = None,
              window: Optional[Tuple[Optional[int], Optional[int]]] = None,
              q_segment_ids: Optional[ArrayLike] = None, kv_segment_ids: Optional[ArrayLike] = None,
              dropout: float = 0.0, seed: int = 0,
              need_weights: bool = False, average_attn_weights: bool = False,
              return_lse: bool = False, impl: str = "auto", threads: int = 0,
              comm: Any = None, seq_len: Optional[int] = None, shard_layout: str = "zigzag",
              chunk_size: int = 0):
    """The attention core on already projected Q, K, V (mha_attention).

    Shapes: [B, h, L, d] (layout 'bhld', the default) or [B, L, h, d] (layout='blhd'); also
    [B, L, d] (one head) and [L, d]. k and v may have fewer heads than q (GQA: query head i reads
    kv head i // (h/g)); v may have another head size. Any strides are used as they are (in
    elements) when the last dimension is contiguous; otherwise the array is copied.

    Masks broadcast to the scores [B, h, n, m] (or [B, n, m] for 3-d inputs). ``mask`` is boolean
    or integer, read with ``mask_means`` ('attend': nonzero = may attend, the default; 'block':
    nonzero = masked out); a float ``mask`` is additive (same as ``attn_bias``; -inf blocks).
    ``key_padding_mask`` [B, m]: nonzero = real token. ``causal``: True (bottom-right alignment,
    query i sees key j <= i + m - n), 'top-left' (PyTorch is_causal) or 'bottom-right';
    ``alignment`` may also be per-row offsets [B]. ``window=(left, right)``. ``chunk_size=C``
    (Llama 4's chunked attention): query i (at p = i + delta) sees key j only if j // C == p // C
    (0 = off). Fully masked rows give 0 (never NaN).

    Distributed (ring attention over MPI, docs/distributed.md): with ``comm`` (an mpi4py
    communicator) the call is collective: every rank of comm makes it with its shard of a
    self-attention over ``seq_len`` (N) global rows, the rows :func:`shard_rows` gives it for
    ``shard_layout`` ('zigzag' or 'contiguous'), in q, k and v alike; it returns its rows of the
    output (and lse), equal to the single-process call on the whole sequence. Options: those of
    mha_ring_attention (scale, softcap, alibi, causal, window, GQA, sinks, and the rank's rows of
    key_padding_mask and of the segment ids); others raise MhaError (UNSUPPORTED). A bad
    argument on any rank raises on every rank.

    Returns the output in the layout and shape of q (head size d_v), then the log-sum-exp
    [B, h, n] if ``return_lse``, then the probabilities [B, h, n, m] (or [B, n, m] averaged) if
    ``need_weights``: a single array when only the output is asked for, else a tuple.
    """
    def prepare():  # (positional: the call is on the hot path of small problems)
        return _attention_prepare(q, k, v, layout, scale, softcap, alibi, sinks, causal,
                                  alignment, mask, mask_means, attn_bias, key_padding_mask,
                                  window, q_segment_ids, kv_segment_ids, dropout, seed,
                                  need_weights, average_attn_weights, return_lse, impl, threads,
                                  comm is None, chunk_size)

    if comm is None:
        if seq_len is not None or shard_layout != "zigzag":
            raise ValueError(_RING_ONLY)
        call = prepare()
        M.call(L.mha_attention, call[0], call[1])
    else:
        from . import _mpi
        _mpi.comm_info(comm)
        call, cfg = _mpi.collective(comm, lambda: (
            prepare(), _mpi.config(seq_len, shard_layout), _mpi.library()))[:2]
        _mpi.forward(comm, cfg, call[0], call[1])
        call = call[:3] + (_as_storage(call[3], q),) + call[4:]
    return _attention_result(*call[2:], return_lse, need_weights, average_attn_weights)


def _as_storage(a: np.ndarray, like: ArrayLike) -> np.ndarray:
    """a (float32, computed by the ring, which reads float32 only) in the storage dtype the
    single-process call would have given for an operand like `like` (rounded once)."""
    dt = getattr(like, "dtype", None)
    dt = dt if isinstance(dt, np.dtype) else np.asarray(like).dtype
    return a if _storage_code(dt) in (None, L.DTYPE_F32) else a.astype(dt)


def _attention_prepare(q, k, v, layout, scale, softcap, alibi, sinks, causal, alignment, mask,
                       mask_means, attn_bias, key_padding_mask, window, q_segment_ids,
                       kv_segment_ids, dropout, seed, need_weights, average, return_lse, impl,
                       threads, native=True, chunk_size=0):
    """The checked arguments of :func:`attention`: (args, exec, keep, out, lse, probs, ndim).
    The output is in q's storage dtype (float32 for any other, or for every one unless
    `native`); lse and probs in float32."""
    q4, k4, v4, nd = _core_views(q, k, v, layout, native)
    keep: list = [q4, k4, v4]  # (maybe converted copies) alive until the call returns
    a = _core_args(q4, k4, v4, keep, scale=scale, softcap=softcap, alibi=alibi, sinks=sinks,
                   causal=causal, alignment=alignment, mask=mask, mask_means=mask_means,
                   attn_bias=attn_bias, key_padding_mask=key_padding_mask, window=window,
                   q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                   dropout=dropout, seed=seed, insert_head_axis=(nd == 3), chunk_size=chunk_size)
    B, h, n, _ = q4.shape
    m, dv = k4.shape[2], v4.shape[3]
    if nd == 4 and layout == "blhd":
        out_user = np.empty((B, n, h, dv), q4.dtype)
        out4 = out_user.transpose(0, 2, 1, 3)
    else:
        out4 = np.empty((B, h, n, dv), q4.dtype)
        out_user = out4
    M.set_strided(a, "out", _ptr(out4), _el_strides(out4))
    if q4.dtype is not _F32:
        a.out_dtype = a.q_dtype
    lse = np.empty((B, h, n), _F32) if return_lse else None
    probs = None
    if need_weights:
        probs = np.empty((B, n, m) if average else (B, h, n, m), _F32)
        a.average_probs = 1 if average else 0
    a.lse, a.probs = _ptr(lse), _ptr(probs)
    return a, _exec(impl, threads), keep, out_user, lse, probs, nd


def _attention_result(keep, out_user, lse, probs, nd, return_lse, need_weights, average):
    """The return value of :func:`attention` from its filled outputs (views for 2-d/3-d q)."""
    if nd == 3:
        out_user = out_user[:, 0]
        lse = None if lse is None else lse[:, 0]
        if probs is not None and not average:
            probs = probs[:, 0]
    elif nd == 2:
        out_user = out_user[0, 0]
        lse = None if lse is None else lse[0, 0]
        if probs is not None:
            probs = probs[0] if average else probs[0, 0]
    res = [out_user] + ([lse] if return_lse else []) + ([probs] if need_weights else [])
    return res[0] if len(res) == 1 else tuple(res)


_STAT_NAMES = ("received", "entropy", "topk", "pool")


def parse_stats(spec: Union[str, Sequence[str]], top_k: Optional[int] = None,
                pool: Optional[Tuple[int, int]] = None) -> Tuple[set, int, Tuple[int, int]]:
    """The statistics asked for: `spec` is "received,entropy,topk=8,pool=256x256" (the CLI's
    --stats syntax) or a sequence of those items; `top_k` / `pool` give the parameters of "topk"
    / "pool" written without them (defaults 8 and 256 x 256). Returns (names, k, (R, C))."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    names, k, grid = set(), top_k, pool
    for item in (str(i).strip() for i in items):
        name, _, value = item.partition("=")
        if name not in _STAT_NAMES:
            raise ValueError(f"stats: unknown statistic {item!r} (known: received, entropy, "
                             f"topk[=K], pool[=RxC])")
        try:
            if name == "topk" and value:
                k = int(value)
            elif name == "pool" and value:
                r, _, c = value.partition("x")
                grid = (int(r), int(c))
            elif value:
                raise ValueError
        except ValueError:
            raise ValueError(f"stats: cannot read {item!r} (topk=K, pool=RxC with integers; "
                             f"received and entropy take no value)") from None
        names.add(name)
    if not names:
        raise ValueError("stats: no statistic requested")
    def count(x, what):  # an integer (2.5 is not 2, True not 1); clamped to the map later
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"stats: {what} must be an integer, got {x!r}")
        return int(x)
    k = 8 if k is None else count(k, "top_k")
    if grid is not None and (isinstance(grid, str) or len(grid) != 2):
        raise ValueError(f"stats: pool must be (R, C), got {grid!r}")
    grid = (256, 256) if grid is None else (count(grid[0], "pool R"), count(grid[1], "pool C"))
    if k < 1 or grid[0] < 1 or grid[1] < 1:
        raise ValueError(f"stats: topk={k} and pool={grid[0]}x{grid[1]} must be >= 1")
    return names, k, grid


def _stats_call(fn, lead: tuple, shape: Tuple[int, int, int, int], names: set, top: int, R: int,
                C: int, ex) -> Dict[str, np.ndarray]:
    """Allocates the statistics asked for (k and the grid clamped to the map, shape = (B, h, n,
    m)), runs fn(*lead, stats, exec, error) and returns them by member name."""
    B, h, n, m = shape
    top, R, C = min(top, m), min(R, n), min(C, m)
    out: Dict[str, np.ndarray] = {}
    s = L.mha_attention_stats()
    if "received" in names:
        out["received"] = np.empty((B, h, m), _F32)
        out["received_total"] = np.empty((B, m), _F32)
    if "entropy" in names:
        out["entropy"] = np.empty((B, h, n), _F32)
    if "topk" in names:
        out["topk_index"] = np.empty((B, h, n, top), np.int64)
        out["topk_prob"] = np.empty((B, h, n, top), _F32)
        s.top_k = top
    if "pool" in names:
        out["pooled"] = np.empty((B, h, R, C), _F32)
        out["pooled_visible"] = np.empty((B, h, R, C), _F32)
        s.pool_rows, s.pool_cols = R, C
    for name, arr in out.items():
        setattr(s, name, _ptr(arr))  # the dict's keys are the struct's field names
    M.call(fn, *lead, s, ex)
    return out


def attention_stats(q: ArrayLike, k: ArrayLike, *,
                    stats: Union[str, Sequence[str]] = "received,entropy",
                    top_k: Optional[int] = None, pool: Optional[Tuple[int, int]] = None,
                    layout: str = "bhld", scale: Optional[float] = None,
                    softcap: Optional[float] = None, alibi: bool = False,
                    sinks: Optional[ArrayLike] = None, causal: Union[bool, str] = False,
                    alignment=None, mask: Optional[ArrayLike] = None, mask_means: str = "attend",
                    attn_bias: Optional[ArrayLike] = None,
                    key_padding_mask: Optional[ArrayLike] = None,
                    window: Optional[Tuple[Optional[int], Optional[int]]] = None,
                    q_segment_ids: Optional[ArrayLike] = None,
                    kv_segment_ids: Optional[ArrayLike] = None,
                    threads: int = 0, chunk_size: int = 0) -> Dict[str, np.ndarray]:
    """Statistics of the attention probabilities of ``attention(q, k, v, ...)`` with the same
    options, computed without any n x m matrix (mha_attention_statistics; v is not needed).

    ``stats``: "received,entropy,topk=8,pool=256x256" or a list of those items (``top_k`` and
    ``pool=(R, C)`` give the parameters otherwise; defaults 8 and 256 x 256). A grid larger than
    the map is clamped to it (R <= n, C <= m), and top_k to m. Returns a dict of NumPy arrays:
    "received" [B, h, m] (sum over queries of P, per key) and "received_total" [B, m] (summed over
    heads); "entropy" [B, h, n] (natural log, the sink counted as one outcome, 0 for fully masked
    rows); "topk_index" [B, h, n, k] int64 and "topk_prob" [B, h, n, k] (P descending, ties by the
    lower key index, -1 / 0 past the visible keys); "pooled" [B, h, R, C] (mean P per cell) and
    "pooled_visible" [B, h, R, C] (fraction of the cell not masked). 3-d inputs drop the head
    axis, 2-d ones the batch axis too. Bit-identical for any ``threads``.
    """
    names, top, (R, C) = parse_stats(stats, top_k, pool)
    q4, k4, _, nd = _core_views(q, k, k, layout, native=False)  # (the statistics read float32)
    keep: list = []
    a = _core_args(q4, k4, k4, keep, scale=scale, softcap=softcap, alibi=alibi, sinks=sinks,
                   causal=causal, alignment=alignment, mask=mask, mask_means=mask_means,
                   attn_bias=attn_bias, key_padding_mask=key_padding_mask, window=window,
                   q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                   dropout=0.0, seed=0, insert_head_axis=(nd == 3), chunk_size=chunk_size)
    a.v = None  # not read
    B, h, n, _ = q4.shape
    out = _stats_call(L.mha_attention_statistics, (a,), (B, h, n, k4.shape[2]), names, top, R,
                      C, _exec("auto", threads))
    if nd < 4:  # one head: drop its axis (and the batch axis of 2-d inputs)
        for name, arr in out.items():
            arr = arr if name == "received_total" else arr[:, 0]
            out[name] = arr[0] if nd == 2 else arr
    return out


def attention_backward(dout: ArrayLike, q: ArrayLike, k: ArrayLike, v: ArrayLike,
                       out: ArrayLike, lse: ArrayLike, *, layout: str = "bhld",
                       sinks: Optional[ArrayLike] = None, dlse: Optional[ArrayLike] = None,
                       dprobs: Optional[ArrayLike] = None, impl: str = "auto", threads: int = 0,
                       comm: Any = None, seq_len: Optional[int] = None,
                       shard_layout: str = "zigzag", **options) -> Tuple[np.ndarray, ...]:
    """Backward of :func:`attention` (mha_attention_backward).

    Give the forward's inputs, its output ``out`` and log-sum-exp ``lse`` (``return_lse=True``),
    the upstream gradient ``dout`` (shape of out) and the same keyword options the forward had
    (masks, scale, softcap, alibi, dropout and seed, ...). Returns (dq, dk, dv), plus dsinks
    when ``sinks`` is given, shaped like q, k, v (and sinks). ``dlse`` (shaped like ``lse``) is
    the gradient of a loss that also reads lse (as a merge of partial attentions does); None
    means the loss reads out alone. ``dprobs`` likewise for a loss that reads the probabilities
    (``need_weights=True``'s, before dropout): [B, h, n, m] per head or [B, n, m] for their head
    average (4-d inputs), [B, n, m] or [n, m] for 3-d and 2-d ones. The ring backward (``comm``)
    takes neither.

    With ``comm`` (collective, mha_ring_attention_backward): every rank gives its shard's rows of
    everything, ``out`` and ``lse`` as the distributed forward returned them, and the same
    ``seq_len`` and ``shard_layout``; it gets its rows of dq, dk, dv, equal to those of the
    single-process backward on the whole sequence.
    """
    if comm is None:
        if seq_len is not None or shard_layout != "zigzag":
            raise ValueError(_RING_ONLY)
        call = _backward_prepare(dout, q, k, v, out, lse, layout, sinks, impl, threads, options,
                                 dlse=dlse, dprobs=dprobs)
        M.call(L.mha_attention_backward, *call[:3])
    else:
        if dlse is not None or dprobs is not None:
            raise ValueError("dlse / dprobs: the ring backward (comm=...) takes no gradient of lse "
                             "or of the probabilities")
        from . import _mpi
        _mpi.comm_info(comm)
        call, cfg = _mpi.collective(comm, lambda: (
            _backward_prepare(dout, q, k, v, out, lse, layout, sinks, impl, threads, options,
                              False), _mpi.config(seq_len, shard_layout), _mpi.library()))[:2]
        _mpi.backward(comm, cfg, *call[:3])
        call = call[:4] + ([_as_storage(g_, t) for g_, t in zip(call[4], (q, k, v))],) + \
            call[5:]
    grads, dsinks, nd = call[4:]
    if nd == 4 and layout == "blhd":
        grads = [g_.transpose(0, 2, 1, 3) for g_ in grads]
    elif nd == 3:
        grads = [g_[:, 0] for g_ in grads]
    elif nd == 2:
        grads = [g_[0, 0] for g_ in grads]
    return tuple(grads) + ((dsinks,) if sinks is not None else ())


def _backward_prepare(dout, q, k, v, out, lse, layout, sinks, impl, threads, options,
                      native=True, dlse=None, dprobs=None):
    """The checked arguments of :func:`attention_backward`: (args, grads, exec, keep, [dq, dk,
    dv], dsinks, ndim). q, k, v, out and dout are read in their storage dtypes (float32 for
    others, or for every one unless `native`); dq, dk, dv are in those of q, k, v."""
    q4, k4, v4, nd = _core_views(q, k, v, layout, native)
    o4, do4 = _core_views(out, dout, dout, layout, native)[:2]
    keep: list = [q4, k4, v4, o4, do4]  # (maybe converted copies) alive until the call returns
    a = _core_args(q4, k4, v4, keep, sinks=sinks, insert_head_axis=(nd == 3),
                   **{**dict(scale=None, softcap=None, alibi=False, causal=False, alignment=None,
                             mask=None, mask_means="attend", attn_bias=None,
                             key_padding_mask=None, window=None, q_segment_ids=None,
                             kv_segment_ids=None, dropout=0.0, seed=0, chunk_size=0),
                      **options})
    B, h, n, _ = q4.shape
    if o4.shape != (B, h, n, v4.shape[3]) or do4.shape != o4.shape:
        raise ValueError(f"out and dout: expected [B, h, n, d_v] = {(B, h, n, v4.shape[3])} "
                         f"(in the layout of q), got {o4.shape} and {do4.shape}")
    # lse exactly as attention() returns it: [B, h, n], [B, n] (3-d q) or [n] (2-d q); its
    # size alone would let [B, n, h] through, read as [B, h, n]
    want = {4: (B, h, n), 3: (B, n), 2: (n,)}[nd]
    if np.shape(lse) != want:
        raise ValueError(f"lse: expected shape {want} (as attention() returns it), got "
                         f"{np.shape(lse)}")
    ls = _float32(lse, "lse").reshape(-1)
    keep.append(ls)
    a.lse = _ptr(ls)
    if dlse is not None:
        if np.shape(dlse) != want:
            raise ValueError(f"dlse: expected the shape of lse, {want}, got {np.shape(dlse)}")
        dl = _float32(dlse, "dlse").reshape(-1)
        keep.append(dl)
    M.set_strided(a, "out", _ptr(o4), _el_strides(o4))
    a.out_dtype = _storage_code(o4.dtype)
    gr = L.mha_attention_grads()
    gr.dlse = _ptr(dl) if dlse is not None else None
    if dprobs is not None:
        m = k4.shape[2]
        shapes = {4: ((B, h, n, m), (B, n, m)), 3: ((B, n, m),), 2: ((n, m),)}[nd]
        if np.shape(dprobs) not in shapes:
            raise ValueError(f"dprobs: expected the shape of the probabilities, "
                             f"{' or '.join(map(str, shapes))}, got {np.shape(dprobs)}")
        dp = _float32(dprobs, "dprobs").reshape(-1)
        keep.append(dp)
        gr.dprobs = _ptr(dp)
        a.average_probs = 1 if nd == 4 and np.ndim(dprobs) == 3 else 0
    M.set_strided(gr, "dout", _ptr(do4), _el_strides(do4))
    grads = [np.empty(t.shape, t.dtype) for t in (q4, k4, v4)]
    for g_, nm in zip(grads, ("dq", "dk", "dv")):
        M.set_strided(gr, nm, _ptr(g_), _el_strides(g_))
    gr.dout_dtype, gr.dq_dtype, gr.dk_dtype, gr.dv_dtype = (
        _storage_code(t.dtype) for t in (do4, q4, k4, v4))
    dsinks = None
    if sinks is not None:
        dsinks = np.empty((h,), _F32)
        gr.dsinks = _ptr(dsinks)
    return a, gr, _exec(impl, threads), keep, grads, dsinks, nd


# ------------------------------------------------------------------------------------------------
# The layer
# ------------------------------------------------------------------------------------------------
_QK_NORM_KINDS = {"rms_head": L.QK_NORM_RMS_HEAD, "rms_all": L.QK_NORM_RMS_ALL,
                  "l2_after_rope": L.QK_NORM_L2_AFTER_ROPE}


@dataclass
class QKNorm:
    """Normalization of q and k in the layer (mha_qk_norm; docs/SEMANTICS.md "QK-norm"):
    ``kind`` 'rms_head' (RMSNorm per head before RoPE, weights q_norm / k_norm [head_dim]: Qwen3,
    Gemma 3), 'rms_all' (RMSNorm over the whole projection, weights [h*head_dim] and
    [g*head_dim]: OLMo 2) or 'l2_after_rope' (weightless, per head, after RoPE: Llama 4);
    ``eps`` > 0; ``unit_offset`` scales by 1 + w (Gemma 3)."""
    kind: str
    eps: float = 1e-6
    unit_offset: bool = False

    def _to_c(self) -> L.mha_qk_norm:
        if self.kind not in _QK_NORM_KINDS:
            raise ValueError(f"qk_norm.kind: expected one of {sorted(_QK_NORM_KINDS)}, got "
                             f"{self.kind!r}")
        q = L.mha_qk_norm()
        q.kind, q.eps, q.unit_offset = _QK_NORM_KINDS[self.kind], float(self.eps), \
            1 if self.unit_offset else 0
        return q

    @classmethod
    def _from_c(cls, q: L.mha_qk_norm) -> Optional["QKNorm"]:
        names = {v: k for k, v in _QK_NORM_KINDS.items()}
        if q.kind == L.QK_NORM_NONE:
            return None
        return cls(names[q.kind], float(q.eps), bool(q.unit_offset))

    @property
    def has_weights(self) -> bool:
        return self.kind in ("rms_head", "rms_all")


def _as_qk_norm(x) -> Optional[QKNorm]:
    if x is None or isinstance(x, QKNorm):
        return x
    if isinstance(x, dict):
        return QKNorm(**x)
    raise TypeError(f"qk_norm: expected a QKNorm, a dict of its fields or None, got {x!r}")


@dataclass
class Config:
    """The resolved configuration of a layer (mha_config with every default filled in)."""
    q_dim: int
    k_dim: int
    v_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    out_dim: int
    bias_q: bool
    bias_k: bool
    bias_v: bool
    bias_o: bool
    sinks: bool
    scale: float
    softcap: float
    alibi: bool
    rope: Optional[Rope]
    weight_dtype: str = "float32"  # the storage of weights, biases, sinks: float16, bfloat16;
    # q8_0, q4_0: the projections only (biases, sinks, norms float32)
    qk_norm: Optional[QKNorm] = None
    output_gate: bool = False
    # Llama 4's temperature tuning (docs/SEMANTICS.md): (floor_scale, attn_scale), or None
    temperature: Optional[Tuple[float, float]] = None

    @classmethod
    def _from_c(cls, c: L.mha_config) -> "Config":
        kw = {f.name: getattr(c, f.name) for f in fields(cls)
              if f.name not in ("rope", "weight_dtype", "qk_norm", "temperature")}
        for b in ("bias_q", "bias_k", "bias_v", "bias_o", "sinks", "alibi", "output_gate"):
            kw[b] = bool(kw[b])
        t = c.temperature
        temp = (float(t.floor_scale), float(t.attn_scale)) if t.enabled else None
        return cls(rope=Rope._from_c(c.rope), weight_dtype=_DTYPE_NAMES[c.weight_dtype],
                   qk_norm=QKNorm._from_c(c.qk_norm), temperature=temp, **kw)


_DTYPE_NAMES = {L.DTYPE_F32: "float32", L.DTYPE_F16: "float16", L.DTYPE_BF16: "bfloat16",
                L.DTYPE_Q8_0: "q8_0", L.DTYPE_Q4_0: "q4_0"}
_DTYPE_CODES = {v: k for k, v in _DTYPE_NAMES.items()}


def _options_config(num_heads: int, num_kv_heads: Optional[int], scale, softcap, alibi,
                    rope_opt) -> L.mha_config:
    c = L.mha_config()
    c.num_heads = int(num_heads)
    c.num_kv_heads = int(num_kv_heads or 0)
    c.scale = M.scale_value(scale, _SCALE_ZERO)
    c.softcap = float(softcap or 0.0)
    c.alibi = 1 if alibi else 0
    r = _as_rope(rope_opt)
    if r is not None:
        c.rope = r._to_c()
    return c


class _Handle:
    """Owns a C pointer and frees it exactly once (also at interpreter exit)."""

    def __init__(self, ptr: int, destroy):
        self.ptr = ptr
        self._fin = weakref.finalize(self, destroy, ptr)

    def close(self) -> None:
        self._fin()


class TrainState:
    """What :meth:`MultiheadAttention.forward_train` saved for :meth:`MultiheadAttention.backward`.

    It keeps the forward's inputs alive (the C state points at them). Use it with the layer that
    made it; it may be used for several backward calls. ``close()`` frees it early."""

    def __init__(self, layer: "MultiheadAttention", ptr: int, keep: list, shapes: dict):
        self._layer = layer
        self._handle = _Handle(ptr, L.mha_train_state_destroy)
        self._keep = keep
        self.shapes = shapes

    def close(self) -> None:
        self._handle.close()


class RingTrainState:
    """What :meth:`MultiheadAttention.forward_train` with ``comm`` saved for
    :meth:`MultiheadAttention.backward`: the rank's forward arguments (the ring backward
    recomputes the forward; nothing is held in C). It keeps the forward's inputs alive."""

    def __init__(self, layer: "MultiheadAttention", comm: Any, cfg: Any,
                 args: L.mha_forward_args, keep: list, shapes: dict):
        self._layer = layer
        self.comm, self.cfg, self.args = comm, cfg, args
        self._keep = keep
        self.shapes = shapes

    def close(self) -> None:
        self._keep = []


class MultiheadAttention:
    """A multi-head attention layer: projections, RoPE, attention, output projection (mha_layer).

    Weights are in PyTorch ``nn.Linear`` layout (``y = x W^T + b``): w_q [h*d_k, q_dim],
    w_k [g*d_k, k_dim], w_v [g*d_v, v_dim], w_o [out_dim, h*d_v]; every size is inferred from
    them and ``num_heads`` (and ``num_kv_heads`` for GQA/MQA, else inferred). Biases are optional.
    The layer keeps its own copy of the weights and is immutable: it may be called from several
    threads at once (the GIL is released during the C call).

    Half precision (docs/PYTHON.md): when every weight, bias and sinks array has one storage dtype
    (float32, float16, or ``ml_dtypes.bfloat16``) the layer keeps them in it
    (mha_config.weight_dtype), else all are converted to float32. Inputs likewise: query, key
    and value are read in their common storage dtype (else converted to float32); the output has
    query's dtype (float32 for float64 input). Arithmetic is float32, the output rounded once.

    ``weight_dtype="q8_0"`` (docs/SEMANTICS.md "q8_0 weights"): the four projection matrices
    are quantised to ggml's q8_0 blocks (mha_q8_0_quantize: 34 bytes per 32 weights, each
    matrix's input features a multiple of 32), biases, sinks and norm weights kept float32; the
    layer then computes exactly the float32 layer on the dequantised weights (``weights`` returns
    them; on the AVX2 tier the products of at most 4 rows, e.g. decode steps, sum each block
    before its scale: the same bound, not the same bits), for inference only (forward, decode; no
    forward_train). ``weight_dtype="q4_0"`` likewise in ggml's q4_0 blocks (mha_q4_0_quantize:
    18 bytes per 32 weights; docs/SEMANTICS.md "q4_0 weights"): bit-identical to the q8_0 layer
    holding the same values.

    Options: ``scale`` (None = 1/sqrt(d_k)), ``softcap``, ``alibi``, ``sinks`` ([h] logits),
    ``rope`` (a :class:`Rope`, a dict of its fields, or a style name; None = no RoPE),
    ``qk_norm`` (a :class:`QKNorm` or a dict of its fields; None = none) with its weights
    ``q_norm`` / ``k_norm`` when its kind has them.
    """

    def __init__(self, w_q: ArrayLike, w_k: ArrayLike, w_v: ArrayLike, w_o: ArrayLike,
                 b_q: Optional[ArrayLike] = None, b_k: Optional[ArrayLike] = None,
                 b_v: Optional[ArrayLike] = None, b_o: Optional[ArrayLike] = None, *,
                 num_heads: int, num_kv_heads: Optional[int] = None,
                 sinks: Optional[ArrayLike] = None, scale: Optional[float] = None,
                 softcap: Optional[float] = None, alibi: bool = False,
                 rope: Union[None, str, dict, Rope] = None,
                 qk_norm: Union[None, dict, QKNorm] = None, q_norm: Optional[ArrayLike] = None,
                 k_norm: Optional[ArrayLike] = None, output_gate: bool = False,
                 temperature: Optional[Tuple[float, float]] = None,
                 weight_dtype: Optional[str] = None,
                 _weight_dtype: Optional[int] = None):
        # (_weight_dtype: the PyTorch drop-in's arrays hold that mha_dtype's bits: _layer_arrays)
        if num_heads is None or int(num_heads) < 1:
            raise ValueError(f"num_heads: expected a positive integer, got {num_heads!r}")
        c = _options_config(num_heads, num_kv_heads, scale, softcap, alibi, rope)
        if temperature is not None:  # Llama 4's temperature tuning: (floor_scale, attn_scale)
            try:
                fs, ats = (float(v) for v in temperature)
            except (TypeError, ValueError):
                raise TypeError(f"temperature: expected (floor_scale, attn_scale) or None, got "
                                f"{temperature!r}") from None
            c.temperature.enabled, c.temperature.floor_scale, c.temperature.attn_scale = 1, fs, ats
        qn = _as_qk_norm(qk_norm)
        if qn is not None:
            c.qk_norm = qn._to_c()
            if qn.has_weights != (q_norm is not None and k_norm is not None) or (
                    not qn.has_weights and (q_norm is not None or k_norm is not None)):
                raise ValueError(f"q_norm, k_norm: qk_norm kind {qn.kind!r} "
                                 f"{'needs both' if qn.has_weights else 'has no weights: give neither'}")
        elif q_norm is not None or k_norm is not None:
            raise ValueError("q_norm, k_norm given without qk_norm")
        given = {nm: x for nm, x in (("w_q", w_q), ("w_k", w_k), ("w_v", w_v), ("w_o", w_o),
                                     ("b_q", b_q), ("b_k", b_k), ("b_v", b_v), ("b_o", b_o),
                                     ("sinks", sinks), ("q_norm", q_norm), ("k_norm", k_norm))
                 if x is not None}
        for nm, x in given.items():
            if _weight_dtype is None and not _is_float(np.asarray(x).dtype):
                raise TypeError(f"{nm}: expected a floating-point array, got dtype "
                                f"{np.asarray(x).dtype}")
        if weight_dtype not in (None, "q8_0", "q4_0"):
            raise ValueError(f"weight_dtype: expected None (the arrays' dtype), 'q8_0' or 'q4_0', "
                             f"got {weight_dtype!r}")
        q8 = weight_dtype in ("q8_0", "q4_0")
        if q8 and _weight_dtype is not None:
            raise ValueError(f"weight_dtype={weight_dtype!r} takes float arrays")
        arrs, c.weight_dtype = _layer_arrays(given, _weight_dtype)
        if q8:  # float32 first (exact), the projections quantised below once their shapes hold
            arrs = {nm: _float32(a, nm) for nm, a in arrs.items()}
            c.weight_dtype = _DTYPE_CODES[weight_dtype]
        ws = {}
        for nm in ("w_q", "w_k", "w_v", "w_o"):
            a = arrs[nm]
            if a.ndim != 2:
                raise ValueError(f"{nm}: expected a 2-d [out, in] matrix, got shape {a.shape}")
            ws[nm] = a
        h = int(num_heads)
        gq = 2 if output_gate else 1  # w_q: the query's rows, then the gate's
        c.output_gate = 1 if output_gate else 0
        if ws["w_q"].shape[0] % (gq * h):
            raise ValueError(f"w_q: {ws['w_q'].shape[0]} rows are not divisible by "
                             f"{'2 x ' if output_gate else ''}num_heads={h}")
        dk = ws["w_q"].shape[0] // (gq * h)
        if ws["w_k"].shape[0] % dk:
            raise ValueError(f"w_k: {ws['w_k'].shape[0]} rows are not a multiple of "
                             f"head_dim={dk}")
        g = int(num_kv_heads) if num_kv_heads else ws["w_k"].shape[0] // dk
        if ws["w_k"].shape[0] != g * dk:
            raise ValueError(f"w_k: expected {g * dk} rows (num_kv_heads={g} x head_dim={dk}), "
                             f"got {ws['w_k'].shape[0]}")
        if ws["w_v"].shape[0] % g:
            raise ValueError(f"w_v: {ws['w_v'].shape[0]} rows are not divisible by "
                             f"num_kv_heads={g}")
        dv = ws["w_v"].shape[0] // g
        if ws["w_o"].shape[1] != h * dv:
            raise ValueError(f"w_o: expected {h * dv} columns (num_heads={h} x v_head_dim={dv}), "
                             f"got {ws['w_o'].shape[1]}")
        c.q_dim, c.k_dim, c.v_dim = ws["w_q"].shape[1], ws["w_k"].shape[1], ws["w_v"].shape[1]
        c.num_kv_heads, c.head_dim, c.v_head_dim = g, dk, dv
        c.out_dim = ws["w_o"].shape[0]
        if q8:
            for nm in ("w_q", "w_k", "w_v", "w_o"):
                a = ws[nm]
                if a.shape[1] % 32:
                    raise ValueError(f"{nm}: weight_dtype={weight_dtype!r} needs input features "
                                     f"that are a multiple of 32 (whole blocks), got {a.shape[1]}")
                q4 = weight_dtype == "q4_0"
                qb = np.empty((a.shape[0], a.shape[1] // 32 * (18 if q4 else 34)), np.uint8)
                M.call(L.mha_q4_0_quantize if q4 else L.mha_q8_0_quantize, _ptr(a), a.size,
                       _ptr(qb))
                ws[nm] = qb
        w = L.mha_weights()
        for nm in ws:
            setattr(w, nm, _ptr(ws[nm]))
        rows = {"b_q": gq * h * dk, "b_k": g * dk, "b_v": g * dv, "b_o": c.out_dim}
        for nm in ("b_q", "b_k", "b_v", "b_o"):
            if nm in arrs:
                a = arrs[nm]
                if a.shape != (rows[nm],):
                    raise ValueError(f"{nm}: expected shape ({rows[nm]},), got {a.shape}")
                ws[nm] = a
                setattr(w, nm, _ptr(a))
                setattr(c, "bias_" + nm[2], 1)
        if sinks is not None:
            a = arrs["sinks"]
            if a.shape != (h,):
                raise ValueError(f"sinks: expected shape ({h},), got {a.shape}")
            ws["sinks"] = a
            w.sinks = _ptr(a)
            c.sinks = 1
        if q_norm is not None:
            per_head = qn.kind == "rms_head"
            for nm, heads in (("q_norm", h), ("k_norm", g)):
                a = arrs[nm]
                want = (dk,) if per_head else (heads * dk,)
                if a.shape != want:
                    raise ValueError(f"{nm}: expected shape {want}, got {a.shape}")
                ws[nm] = a
                setattr(w, nm, _ptr(a))
        ptr = ctypes.c_void_p()
        M.call(L.mha_layer_create, c, w, 0, None, ptr)
        self._init_handle(ptr.value)

    def _init_handle(self, ptr: int) -> None:
        self._handle = _Handle(ptr, L.mha_layer_destroy)
        self._ptr = ptr
        self.config = Config._from_c(L.mha_layer_config(ptr).contents)

    @classmethod
    def from_safetensors(cls, path: str, num_heads: int, *, num_kv_heads: Optional[int] = None,
                         prefix: Optional[str] = None, names: Optional[Dict[str, str]] = None,
                         scale: Optional[float] = None, softcap: Optional[float] = None,
                         alibi: bool = False,
                         rope: Union[None, str, dict, Rope] = None,
                         qk_norm: Union[None, dict, QKNorm] = None) -> "MultiheadAttention":
        """Loads a layer from a safetensors file (mha_layer_load_safetensors).

        Tensor names are searched as documented in docs/FORMATS.md (HF q_proj/k_proj/v_proj/
        o_proj, PyTorch nn.MultiheadAttention's in_proj_weight..., CS336's q_proj_weight...)
        under ``prefix``, or given by ``names`` = {'q': stem, 'k': ..., 'v': ..., 'o': ...,
        'sinks': full name} (stems get '.weight'/'.bias'). Sizes and biases come from the file.
        ``qk_norm`` (a :class:`QKNorm`): its weights are read from 'q_norm.weight' and
        'k_norm.weight' under ``prefix`` (transformers' names).
        """
        c = _options_config(num_heads, num_kv_heads, scale, softcap, alibi, rope)
        qn = _as_qk_norm(qk_norm)
        if qn is not None:
            c.qk_norm = qn._to_c()
        nm = None
        keep = []
        if names:
            unknown = set(names) - {"q", "k", "v", "o", "sinks"}
            if unknown:
                raise ValueError(f"names: unknown keys {sorted(unknown)} (use q, k, v, o, sinks)")
            nm = L.mha_name_map()
            for key, val in names.items():
                b = val.encode()
                keep.append(b)
                setattr(nm, key, b)
        ptr = ctypes.c_void_p()
        M.call(L.mha_layer_load_safetensors, str(path).encode(),
               prefix.encode() if prefix else None, nm, c, None, ptr)
        self = cls.__new__(cls)
        self._init_handle(ptr.value)
        return self

    # Masking a layer applies when forward() is not told otherwise: none for layers built from
    # weights; from_pretrained() sets the model's (causal, sliding window).
    _causal: Union[bool, str] = False
    _window: Optional[Tuple[int, int]] = None
    _chunk_size: int = 0  # chunked attention (Llama 4's attention_chunk_size); 0 = none
    model_info: Optional[Dict[str, object]] = None

    @classmethod
    def from_pretrained(cls, path: str, layer: int = 0, *,
                        weight_dtype: Optional[str] = None) -> "MultiheadAttention":
        """Layer ``layer`` (0-based) of a Hugging Face model directory (config.json with
        model.safetensors, or model.safetensors.index.json and its shards), with every option
        its config implies (mha_hf_layer_load; the table per model_type is in docs/MODELS.md).
        Fused projections (GPT-2, GPT-NeoX, Phi-3, Falcon) are split at load time. The model's
        causal mask and sliding window become this layer's defaults for :meth:`forward`
        (``causal=None`` / ``window=None`` there); ``model_info`` says what was read. An
        unsupported architecture or attention option raises MhaError naming the config field.
        ``weight_dtype="q8_0"`` or ``"q4_0"``: the four projection matrices read in float32 and
        quantised (mha_q8_0_quantize / mha_q4_0_quantize; docs/SEMANTICS.md "q8_0 weights",
        "q4_0 weights"), for inference.
        """
        if weight_dtype not in (None, "q8_0", "q4_0"):
            raise ValueError(f"weight_dtype: expected None (float32), 'q8_0' or 'q4_0', got "
                             f"{weight_dtype!r}")
        return cls._from_model(path, layer, L.mha_hf_layer_info_read, L.mha_hf_layer_load,
                               _DTYPE_CODES[weight_dtype] if weight_dtype else None)

    @classmethod
    def from_gguf(cls, path: str, layer: int = 0, *,
                  weight_dtype: Optional[str] = None) -> "MultiheadAttention":
        """Layer ``layer`` (0-based) of a llama.cpp GGUF file (general.architecture llama,
        mistral, qwen2, qwen3 or phi3; F32/F16/BF16 tensors, Q8_0, Q4_0, Q5_0, Q4_1, Q5_1 and Q2_K..Q6_K
        dequantised to float32 as ggml does; llama's permuted Q/K rows put back:
        mha_layer_load_gguf, docs/MODELS.md "GGUF files"), with the
        same defaults and ``model_info`` as :meth:`from_pretrained` (``model_type`` is the
        architecture). ``weight_dtype="q8_0"`` keeps the file's Q8_0 projection blocks as they
        are and maps Q4_0/Q5_0 blocks to q8_0 exactly (a q8_0 layer, docs/SEMANTICS.md "q8_0
        weights", "GGUF quantised types"; other tensor types are quantised with
        mha_q8_0_quantize; biases and norms float32); ``weight_dtype="q4_0"`` keeps the file's
        Q4_0 blocks (a q4_0 layer, "q4_0 weights"; other types quantised with
        mha_q4_0_quantize). Unsupported types (IQ*, TQ*, MXFP4, ...) or options raise MhaError
        naming them."""
        if weight_dtype not in (None, "q8_0", "q4_0"):
            raise ValueError(f"weight_dtype: expected None (the file's default), 'q8_0' or "
                             f"'q4_0', got {weight_dtype!r}")
        return cls._from_model(path, layer, L.mha_gguf_layer_info_read, L.mha_layer_load_gguf,
                               _DTYPE_CODES[weight_dtype] if weight_dtype else None)

    @classmethod
    def _from_model(cls, path, layer, info_fn, load_fn, weight_dtype=None) -> "MultiheadAttention":
        _layer_index(layer)
        info = L.mha_hf_layer_info()
        M.call(info_fn, str(path).encode(), int(layer), info)
        if weight_dtype is not None:
            info.config.weight_dtype = weight_dtype
        ptr = ctypes.c_void_p()
        M.call(load_fn, str(path).encode(), int(layer), info.config, None, ptr)
        self = cls.__new__(cls)
        self._init_handle(ptr.value)
        self._causal = bool(info.causal)
        self._window = (int(info.window_left), int(info.window_right)) if info.use_window \
            else None
        self._chunk_size = int(info.chunk_size)  # Llama 4's chunked layers
        self.model_info = {
            "model_type": info.model_type.decode(), "layout": info.layout.decode(),
            "prefix": info.prefix.decode(), "layer": int(info.layer),
            "num_layers": int(info.num_layers), "causal": self._causal, "window": self._window,
            "chunk_size": self._chunk_size or None, "rope": info.config.rope.style != 0,
            "temperature": self.config.temperature,
        }
        return self

    def close(self) -> None:
        """Frees the C layer now (it is otherwise freed when garbage-collected)."""
        self._handle.close()

    @property
    def weights(self) -> Dict[str, np.ndarray]:
        """Copies of the layer's weights: w_q, w_k, w_v, w_o, and b_* / sinks when present."""
        c = self.config
        w = L.mha_layer_weights(self._ptr).contents
        gq = 2 if c.output_gate else 1  # (the gate's rows follow the query's)
        shapes = {"w_q": (gq * c.num_heads * c.head_dim, c.q_dim),
                  "w_k": (c.num_kv_heads * c.head_dim, c.k_dim),
                  "w_v": (c.num_kv_heads * c.v_head_dim, c.v_dim),
                  "w_o": (c.out_dim, c.num_heads * c.v_head_dim),
                  "b_q": (gq * c.num_heads * c.head_dim,),
                  "b_k": (c.num_kv_heads * c.head_dim,),
                  "b_v": (c.num_kv_heads * c.v_head_dim,), "b_o": (c.out_dim,),
                  "sinks": (c.num_heads,)}
        if c.qk_norm is not None and c.qk_norm.has_weights:
            all_ = c.qk_norm.kind == "rms_all"
            shapes["q_norm"] = (c.num_heads * c.head_dim if all_ else c.head_dim,)
            shapes["k_norm"] = (c.num_kv_heads * c.head_dim if all_ else c.head_dim,)
        res = {}
        code = _DTYPE_CODES[c.weight_dtype]
        if code in (L.DTYPE_Q8_0, L.DTYPE_Q4_0):  # projections dequantised, the rest float32
            for nm, shp in shapes.items():
                p = getattr(w, nm)
                if p and nm.startswith("w_"):
                    res[nm] = np.empty(shp, _F32)
                    M.call(L.mha_q4_0_dequantize if code == L.DTYPE_Q4_0 else
                           L.mha_q8_0_dequantize, p, res[nm].size, _ptr(res[nm]))
                elif p:
                    n = int(np.prod(shp))
                    res[nm] = np.frombuffer((ctypes.c_float * n).from_address(p), _F32).reshape(
                        shp).copy()
            return res
        half = code != L.DTYPE_F32  # (a half layer's: 2-byte elements of that dtype)
        for nm, shp in shapes.items():
            p = getattr(w, nm)
            if p:
                ct = ctypes.c_uint16 if half else ctypes.c_float
                buf = (ct * int(np.prod(shp))).from_address(p)
                a = np.frombuffer(buf, np.uint16 if half else _F32).reshape(shp)
                res[nm] = _half_to_f32(a, code) if half else np.array(a)
        return res

    # -- forward ---------------------------------------------------------------------------------
    def _forward_args(self, query, key, value, keep: list, *, causal, alignment, mask,
                      mask_means, attn_bias, key_padding_mask, window, positions, key_positions,
                      q_segment_ids, kv_segment_ids, dropout, seed, need_weights,
                      average_attn_weights, chunk_size=0):
        c = self.config
        xs, x_code, out_dt = _layer_inputs({"query": query, "key": key, "value": value})
        x = xs["query"]
        unbatched = x.ndim == 2
        if unbatched:
            x = x[None]
        if x.ndim != 3 or x.shape[2] != c.q_dim:
            raise ValueError(f"query: expected [B, n, {c.q_dim}] or [n, {c.q_dim}], got shape "
                             f"{np.shape(query)}")
        B, n = x.shape[:2]
        m = n
        keep.append(x)
        kx = vx = None
        if key is None and value is not None:
            raise ValueError("value given without key")
        if key is not None:
            kx = xs["key"]
            kx = kx[None] if unbatched else kx
            if kx.ndim != 3 or kx.shape[0] != B or kx.shape[2] != c.k_dim:
                raise ValueError(f"key: expected [{B}, m, {c.k_dim}]"
                                 f"{' (unbatched: [m, k_dim])' if unbatched else ''}, got shape "
                                 f"{np.shape(key)}")
            m = kx.shape[1]
            keep.append(kx)
            if value is not None:
                vx = xs["value"]
                vx = vx[None] if unbatched else vx
                if vx.shape != (B, kx.shape[1], c.v_dim):
                    raise ValueError(f"value: expected [{B}, {kx.shape[1]}, {c.v_dim}], got "
                                     f"shape {np.shape(value)}")
                keep.append(vx)
            elif c.v_dim != c.k_dim:
                raise ValueError(f"value is needed: v_dim={c.v_dim} differs from k_dim={c.k_dim}")
        elif c.k_dim != c.q_dim or c.v_dim != c.q_dim:
            raise ValueError("self-attention (key=None) needs q_dim == k_dim == v_dim; pass key "
                             "and value")
        a = M.forward_args(B, n, m, _ptr(x), _ptr(kx), _ptr(vx))
        a.x_dtype, a.out_dtype = x_code, _storage_code(out_dt)
        if positions is not None:
            p = _int_array(positions, "positions", np.int64, (B, n))
            keep.append(p)
            a.q_positions = _ptr(p)
        if key_positions is not None:
            p = _int_array(key_positions, "key_positions", np.int64, (B, m))
            keep.append(p)
            a.k_positions = _ptr(p)
        _fill_masking(a.mask, keep, batch=B, causal=causal, alignment=alignment, mask=mask,
                      mask_means=mask_means, attn_bias=attn_bias,
                      key_padding_mask=key_padding_mask, window=window,
                      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, n=n, m=m,
                      chunk_size=chunk_size)
        if dropout != 0.0 or seed != 0:  # else the zeroed struct already says "no dropout"
            _dropout(a.dropout, dropout, seed)
        out = np.empty((B, n, c.out_dim), out_dt)
        a.out = _ptr(out)
        probs = None
        if need_weights:
            probs = np.empty((B, n, m) if average_attn_weights else (B, c.num_heads, n, m), _F32)
            a.probs = _ptr(probs)
            a.average_probs = 1 if average_attn_weights else 0
        return a, out, probs, unbatched

    def attention_stats(self, query: ArrayLike, key: Optional[ArrayLike] = None,
                        value: Optional[ArrayLike] = None, *,
                        stats: Union[str, Sequence[str]] = "received,entropy",
                        top_k: Optional[int] = None, pool: Optional[Tuple[int, int]] = None,
                        causal: Union[bool, str] = False, alignment=None,
                        mask: Optional[ArrayLike] = None, mask_means: str = "attend",
                        attn_bias: Optional[ArrayLike] = None,
                        key_padding_mask: Optional[ArrayLike] = None,
                        window: Optional[Tuple[Optional[int], Optional[int]]] = None,
                        positions: Optional[ArrayLike] = None,
                        key_positions: Optional[ArrayLike] = None,
                        q_segment_ids: Optional[ArrayLike] = None,
                        kv_segment_ids: Optional[ArrayLike] = None,
                        impl: str = "auto", threads: int = 0,
                        chunk_size: Optional[int] = None) -> Dict[str, np.ndarray]:
        """Statistics of this layer's attention probabilities for the forward with the same
        arguments (mha_layer_attention_statistics: Q and K projected and rotated, no n x m
        matrix). ``stats``, ``top_k``, ``pool`` and the returned dict as in
        :func:`attention_stats` (h = the layer's heads); unbatched input drops the batch axis."""
        names, top, (R, C) = parse_stats(stats, top_k, pool)
        keep: list = []
        a, _, _, unbatched = self._forward_args(
            query, key, value, keep, causal=causal, alignment=alignment, mask=mask,
            mask_means=mask_means, attn_bias=attn_bias, key_padding_mask=key_padding_mask,
            window=window, positions=positions, key_positions=key_positions,
            q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, dropout=0.0, seed=0,
            need_weights=False, average_attn_weights=False,
            chunk_size=self._chunk_size if chunk_size is None else chunk_size)
        a.out = None  # not written
        shape = (a.batch, self.config.num_heads, a.q_len, a.kv_len)
        out = _stats_call(L.mha_layer_attention_statistics, (self._ptr, a), shape, names, top,
                          R, C, _exec(impl, threads))
        return {name: arr[0] for name, arr in out.items()} if unbatched else out

    def forward(self, query: ArrayLike, key: Optional[ArrayLike] = None,
                value: Optional[ArrayLike] = None, *, causal: Union[bool, str, None] = None,
                alignment=None, mask: Optional[ArrayLike] = None, mask_means: str = "attend",
                attn_bias: Optional[ArrayLike] = None,
                key_padding_mask: Optional[ArrayLike] = None,
                window: Optional[Tuple[Optional[int], Optional[int]]] = None,
                positions: Optional[ArrayLike] = None, key_positions: Optional[ArrayLike] = None,
                q_segment_ids: Optional[ArrayLike] = None,
                kv_segment_ids: Optional[ArrayLike] = None, dropout: float = 0.0, seed: int = 0,
                need_weights: bool = False, average_attn_weights: bool = False,
                impl: str = "auto", threads: int = 0, comm: Any = None,
                seq_len: Optional[int] = None, shard_layout: str = "zigzag",
                chunk_size: Optional[int] = None):
        """Runs the layer (mha_layer_forward).

        query [B, n, q_dim] (or unbatched [n, q_dim]); key [B, m, k_dim] and value [B, m, v_dim]
        for cross-attention (key=None: self-attention; value=None: value = key).
        Masks as in :func:`attention` (``mask`` + ``mask_means``, float masks additive,
        ``key_padding_mask`` nonzero = real token, ``causal``, ``alignment``, ``window``, segment
        ids). ``positions`` [B, n] / [n] and ``key_positions`` [B, m] are RoPE positions.
        ``dropout`` > 0 drops probabilities (training) with the counter-based RNG keyed by
        ``seed``. ``threads`` = 0 uses every CPU; ``impl`` is 'auto', 'reference' or 'fast'.

        ``chunk_size=C``: chunked attention (Llama 4), as in :func:`attention`.
        ``causal=None``, ``window=None`` and ``chunk_size=None`` take the layer's defaults: off,
        or the model's for a layer made by :meth:`from_pretrained`.

        Distributed (mha_ring_layer_forward; docs/distributed.md): with ``comm`` (an mpi4py
        communicator) the call is collective, self-attention only: every rank passes its rows of
        the input (``mha.shard_rows(seq_len, comm, shard_layout=...)``) and of every per-row
        option (positions, key padding, segment ids), the same ``seq_len`` (the global N) and
        ``shard_layout``, and gets its rows of y, equal to those of the single-process forward on
        the whole sequence (RoPE at global positions unless ``positions`` are given).

        Returns y [B, n, out_dim], or (y, weights) with ``need_weights`` (weights [B, h, n, m],
        or [B, n, m] with ``average_attn_weights``; before dropout).
        """
        if causal is None:
            causal = self._causal
        if window is None:
            window = self._window
        if chunk_size is None:
            chunk_size = self._chunk_size
        if comm is not None or seq_len is not None or shard_layout != "zigzag":
            opts = dict(causal=causal, alignment=alignment, mask=mask, mask_means=mask_means,
                        chunk_size=chunk_size,
                        attn_bias=attn_bias, key_padding_mask=key_padding_mask, window=window,
                        positions=positions, key_positions=key_positions,
                        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                        dropout=dropout, seed=seed, need_weights=need_weights,
                        average_attn_weights=average_attn_weights)
            return self._ring_forward(comm, seq_len, shard_layout, query, key, value, impl,
                                      threads, opts)[0]
        if (key is None and value is None and causal is False and alignment is None
                and mask is None and attn_bias is None and key_padding_mask is None
                and window is None and positions is None and key_positions is None
                and q_segment_ids is None and kv_segment_ids is None and not need_weights
                and dropout == 0.0 and seed == 0 and not chunk_size and _fast is not None):
            # The common call (self-attention, no options): one compiled call does the checks,
            # the output, the struct and the library call (python/mha/_fastcall.c), or returns
            # NotImplemented (not a float32 C-contiguous [B, n, q_dim] / [n, q_dim] buffer, bad
            # impl or threads) and the general path below converts or raises.
            out = _fast.layer_forward(self._ptr, query, L.IMPLS.get(impl, -1), threads,
                                      M.pool_for(threads), M.block_cache_allocator())
            if out is not NotImplemented:
                return out
        keep: list = []
        a, out, probs, unbatched = self._forward_args(
            query, key, value, keep, causal=causal, alignment=alignment, mask=mask,
            mask_means=mask_means, attn_bias=attn_bias, key_padding_mask=key_padding_mask,
            window=window, positions=positions, key_positions=key_positions,
            q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, dropout=dropout,
            seed=seed, need_weights=need_weights, average_attn_weights=average_attn_weights,
            chunk_size=chunk_size)
        M.layer_forward(self._ptr, a, _exec(impl, threads), False)
        if unbatched:
            out = out[0]
            probs = None if probs is None else probs[0]
        return (out, probs) if need_weights else out

    __call__ = forward

    # -- training --------------------------------------------------------------------------------
    def forward_train(self, query: ArrayLike, key: Optional[ArrayLike] = None,
                      value: Optional[ArrayLike] = None, *, impl: str = "auto", threads: int = 0,
                      comm: Any = None, seq_len: Optional[int] = None,
                      shard_layout: str = "zigzag", **options):
        """Forward in training mode (mha_layer_forward_train): the same outputs as
        :meth:`forward` followed by a :class:`TrainState` for :meth:`backward`. With ``comm``
        (collective, as :meth:`forward`): the rank's rows of y and a state whose
        :meth:`backward` runs mha_ring_layer_backward (it recomputes the forward)."""
        keep: list = []
        opts = dict(causal=self._causal, alignment=None, mask=None, mask_means="attend",
                    attn_bias=None, key_padding_mask=None, window=self._window, positions=None,
                    key_positions=None, q_segment_ids=None, kv_segment_ids=None, dropout=0.0,
                    seed=0, need_weights=False, average_attn_weights=False,
                    chunk_size=self._chunk_size)
        bad = set(options) - set(opts)
        if bad:
            raise TypeError(f"forward_train: unexpected keyword arguments {sorted(bad)}")
        opts.update({k: v for k, v in options.items()
                     if v is not None or k not in ("causal", "window", "chunk_size")})
        if comm is not None or seq_len is not None or shard_layout != "zigzag":
            out, state = self._ring_forward(comm, seq_len, shard_layout, query, key, value, impl,
                                            threads, opts)
            return out, state
        a, out, probs, unbatched = self._forward_args(query, key, value, keep, **opts)
        st = M.layer_forward(self._ptr, a, _exec(impl, threads), True)
        shapes = {"batch": a.batch, "q_len": a.q_len, "kv_len": a.kv_len,
                  "self": key is None, "value_is_key": key is not None and value is None,
                  "unbatched": unbatched, "x_dtype": keep[0].dtype, "out_dtype": out.dtype,
                  "weights": None if probs is None else probs.shape}
        state = TrainState(self, st, keep, shapes)
        if unbatched:
            out = out[0]
            probs = None if probs is None else probs[0]
        return (out, probs, state) if opts["need_weights"] else (out, state)

    def backward(self, state: TrainState, dy: ArrayLike, *, inputs: bool = True,
                 params: bool = True, d_weights: Optional[ArrayLike] = None, impl: str = "auto",
                 threads: int = 0) -> Dict[str, np.ndarray]:
        """Backward of the layer (mha_layer_backward) given dy = dL/dy of the forward_train call
        that made ``state``. Returns a dict of gradients: 'query' (and 'key', 'value' for
        cross-attention; in self-attention 'query' is the sum of all three paths), and with
        ``params`` 'w_q', 'w_k', 'w_v', 'w_o', 'b_*' (biases present) and 'sinks'. ``d_weights``:
        dL/d of the attention weights that call returned (``need_weights=True``; their shape), for
        a loss that reads them (mha_layer_grads.d_probs)."""
        if isinstance(state, RingTrainState):
            if d_weights is not None:
                raise ValueError("d_weights: the ring (comm=...) returns no attention weights")
            return self._ring_backward(state, dy, inputs, params, impl, threads)
        d, g, res = self._grads_for(state, dy, inputs, params)
        if d_weights is not None:
            want = state.shapes.get("weights")
            if want is None:
                raise ValueError("d_weights: the forward_train call had need_weights=False")
            if state.shapes["unbatched"]:
                want = want[1:]
            if np.shape(d_weights) != want:
                raise ValueError(f"d_weights: expected the weights' shape {want}, got "
                                 f"{np.shape(d_weights)}")
            dw = _float32(d_weights, "d_weights")
            g.d_probs = _ptr(dw)
        M.call(L.mha_layer_backward, self._ptr, state._handle.ptr, _ptr(d), g,
               _exec(impl, threads))
        if state.shapes["unbatched"]:
            for nm in ("query", "key", "value"):
                if nm in res:
                    res[nm] = res[nm][0]
        return res

    def _grads_for(self, state, dy: ArrayLike, inputs: bool, params: bool):
        """(dy [B, n, out_dim] in the forward's output dtype, the mha_layer_grads pointing at
        new arrays, the dict of those arrays) for a backward of `state`; ValueError for a wrong
        dy or state. The input gradients have the inputs' dtype as the layer read them (a half
        dtype, else float32), the parameter gradients are float32 (docs/SEMANTICS.md)."""
        if state._layer is not self:
            raise ValueError("state was made by another layer")
        c = self.config
        s = state.shapes
        B, n, m = s["batch"], s["q_len"], s["kv_len"]
        out_dt, x_dt = s.get("out_dtype", _F32), s.get("x_dtype", _F32)
        if out_dt == _F32:
            d = _float32(dy, "dy")
        else:  # dy has the forward output's dtype (mha_layer_backward reads it so)
            d = np.asarray(dy)
            if not _is_float(d.dtype):
                raise TypeError(f"dy: expected a floating-point array, got dtype {d.dtype}")
            d = np.ascontiguousarray(d if d.dtype == out_dt else d.astype(out_dt))
        if s["unbatched"]:
            d = d[None]
        if d.shape != (B, n, c.out_dim):
            raise ValueError(f"dy: expected shape {(B, n, c.out_dim)}, got {np.shape(dy)}")
        g = L.mha_layer_grads()
        res: Dict[str, np.ndarray] = {}

        def want(nm, field, shape):
            arr = np.empty(shape, x_dt if nm in ("query", "key", "value") else _F32)
            res[nm] = arr
            setattr(g, field, _ptr(arr))

        if inputs:
            want("query", "d_query", (B, n, c.q_dim))
            if not s["self"]:
                want("key", "d_key", (B, m, c.k_dim))
                if not s["value_is_key"]:
                    want("value", "d_value", (B, m, c.v_dim))
        if params:
            hk, gk, gv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, \
                c.num_kv_heads * c.v_head_dim
            gq = 2 if c.output_gate else 1  # (the gate's rows follow the query's)
            want("w_q", "dw_q", (gq * hk, c.q_dim))
            want("w_k", "dw_k", (gk, c.k_dim))
            want("w_v", "dw_v", (gv, c.v_dim))
            want("w_o", "dw_o", (c.out_dim, c.num_heads * c.v_head_dim))
            for nm, on, shp in (("b_q", c.bias_q, gq * hk), ("b_k", c.bias_k, gk),
                                ("b_v", c.bias_v, gv), ("b_o", c.bias_o, c.out_dim)):
                if on:
                    want(nm, "d" + nm, (shp,))
            if c.sinks:
                want("sinks", "d_sinks", (c.num_heads,))
            if c.qk_norm is not None and c.qk_norm.has_weights:
                all_ = c.qk_norm.kind == "rms_all"
                want("q_norm", "d_q_norm", (c.num_heads * c.head_dim if all_ else c.head_dim,))
                want("k_norm", "d_k_norm",
                     (c.num_kv_heads * c.head_dim if all_ else c.head_dim,))
        return d, g, res

    # -- distributed (ring attention over MPI, libmha_mpi) ---------------------------------------
    def _ring_forward(self, comm, seq_len, shard_layout, query, key, value, impl, threads,
                      opts):
        """mha_ring_layer_forward (collective): (this rank's rows of y, a RingTrainState)."""
        if comm is None:
            raise ValueError(_RING_ONLY)
        from . import _mpi
        _mpi.comm_info(comm)

        def prepare():
            if key is not None or value is not None:
                raise ValueError("comm=: the distributed layer is self-attention (key and value "
                                 "must be None)")
            if opts["need_weights"]:
                raise ValueError("comm=: need_weights is not available distributed (no rank "
                                 "holds a whole row of probabilities)")
            keep: list = []
            a, out, _, unbatched = self._forward_args(query, None, None, keep, **opts)
            return a, out, unbatched, keep, _mpi.config(seq_len, shard_layout), _mpi.library()

        a, out, unbatched, keep, cfg, _ = _mpi.collective(comm, prepare)
        _mpi.layer_forward(comm, cfg, self._ptr, a, _exec(impl, threads))
        shapes = {"batch": a.batch, "q_len": a.q_len, "kv_len": a.kv_len, "self": True,
                  "value_is_key": False, "unbatched": unbatched}
        state = RingTrainState(self, comm, cfg, a, keep, shapes)
        return (out[0] if unbatched else out), state

    def _ring_backward(self, state: "RingTrainState", dy, inputs, params, impl, threads):
        """mha_ring_layer_backward (collective): the rank's rows of d query, and the whole
        parameter gradients (summed over the ranks)."""
        from . import _mpi
        d, g, res = _mpi.collective(state.comm,
                                    lambda: self._grads_for(state, dy, inputs, params))
        _mpi.layer_backward(state.comm, state.cfg, self._ptr, state.args, _ptr(d), g,
                            _exec(impl, threads))
        if state.shapes["unbatched"] and "query" in res:
            res["query"] = res["query"][0]
        return res

    # -- decoding --------------------------------------------------------------------------------
    def kv_cache(self, max_seq: int, batch: int = 1, *, dtype: str = "float32",
                 window: int = 0, max_step_tokens: int = 0,
                 chunk_size: Optional[int] = None, block_size: int = 0,
                 num_blocks: int = 0) -> "KVCache":
        """A KV cache for this layer (mha_kv_cache_create): ``batch`` sequences of up to
        ``max_seq`` positions, stored as 'float32', 'float16', 'bfloat16', 'q8_0' or 'fp8_e4m3'
        (KVCache.set_fp8_scales). ``chunk_size=C``:
        chunked attention (a token at p sees the keys C (p // C) .. p; the cache is a ring);
        None takes the layer's default. ``block_size=B``: a paged cache (KVCache)."""
        return KVCache(self, max_seq, batch, dtype=dtype, window=window,
                       max_step_tokens=max_step_tokens,
                       chunk_size=self._chunk_size if chunk_size is None else chunk_size,
                       block_size=block_size, num_blocks=num_blocks)

    def __repr__(self) -> str:
        c = self.config
        return (f"mha.MultiheadAttention(q_dim={c.q_dim}, k_dim={c.k_dim}, v_dim={c.v_dim}, "
                f"num_heads={c.num_heads}, num_kv_heads={c.num_kv_heads}, head_dim={c.head_dim}, "
                f"v_head_dim={c.v_head_dim}, out_dim={c.out_dim}, rope={c.rope})")


class KVCache:
    """Autoregressive decoding with a key/value cache (docs/INFERENCE.md).

    ``prefill(x)`` appends a prompt and returns its outputs, ``step(x)`` appends the next token(s);
    the result equals the full causal forward over the whole sequence (bottom-right aligned).
    x: [num_seqs, t, q_dim] (or [t, q_dim] for sequence 0); ``seq_ids`` picks sequences.
    ``dtype``: the storage, "float32", "float16", "bfloat16", "q8_0" (ggml's blocks of 32 int8 and
    a float16 scale; head sizes multiples of 32) or "fp8_e4m3" (per-kv-head scales, 1.0 unless
    ``set_fp8_scales`` is called before the first token); docs/SEMANTICS.md has the error
    bounds."""

    _DTYPES = {"float32": L.DTYPE_F32, "float16": L.DTYPE_F16, "bfloat16": L.DTYPE_BF16,
               "q8_0": L.DTYPE_Q8_0, "fp8_e4m3": L.DTYPE_FP8_E4M3}

    def __init__(self, layer: Optional[MultiheadAttention], max_seq: int, batch: int = 1, *,
                 dtype: str = "float32", window: int = 0, max_step_tokens: int = 0,
                 chunk_size: int = 0, block_size: int = 0, num_blocks: int = 0,
                 num_kv_heads: int = 0, head_dim: int = 0, v_head_dim: int = 0):
        """block_size > 0 makes the cache paged (docs/INFERENCE.md "Paged cache"): blocks of
        block_size positions from a pool of num_blocks (0 = enough for every sequence at
        max_seq), shared by ``fork``/``share_prefix`` and copied on write.

        ``layer=None`` makes a cache for the core-level calls only (:meth:`append` and
        :meth:`attention`, for callers with their own projections): then ``num_kv_heads`` and
        ``head_dim`` are required (``v_head_dim`` defaults to ``head_dim``); with a layer they
        default to the layer's and must match it."""
        if dtype not in self._DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(self._DTYPES)}, got {dtype!r}")
        if layer is None and (num_kv_heads <= 0 or head_dim <= 0):
            raise ValueError(f"a cache without a layer needs num_kv_heads and head_dim > 0, got "
                             f"num_kv_heads={num_kv_heads}, head_dim={head_dim}")
        c = L.mha_kv_cache_config()
        c.num_kv_heads, c.head_dim, c.v_head_dim = int(num_kv_heads), int(head_dim), \
            int(v_head_dim)
        c.max_seq, c.batch, c.dtype = int(max_seq), int(batch), self._DTYPES[dtype]
        c.window, c.max_step_tokens = int(window), int(max_step_tokens)
        c.chunk_size = _chunk_size(chunk_size)
        c.block_size, c.num_blocks = int(block_size), int(num_blocks)
        ptr = ctypes.c_void_p()
        M.call(L.mha_kv_cache_create, c, None if layer is None else layer._ptr, None, ptr)
        self._layer = layer
        self._handle = _Handle(ptr.value, L.mha_kv_cache_destroy)
        r = L.mha_kv_cache_get_config(ptr.value).contents  # (the defaults resolved)
        self.dtype = dtype
        self.num_kv_heads, self.head_dim, self.v_head_dim = \
            int(r.num_kv_heads), int(r.head_dim), int(r.v_head_dim)
        self.max_seq, self.batch = int(r.max_seq), int(r.batch)
        self.window, self.chunk_size = int(r.window), int(r.chunk_size)
        self.max_step_tokens = int(r.max_step_tokens)
        self.block_size, self.num_blocks = int(r.block_size), int(r.num_blocks)

    def length(self, seq: int = 0) -> int:
        """Positions appended so far to sequence ``seq``."""
        n = L.mha_kv_cache_length(self._handle.ptr, _i64(seq, "seq"))
        if n < 0:
            raise ValueError(f"seq={seq} is not a sequence of this cache")
        return n

    def reset(self, seq: int = 0) -> None:
        M.call(L.mha_kv_cache_reset, self._handle.ptr, _i64(seq, "seq"))

    def truncate(self, seq: int, new_len: int) -> None:
        M.call(L.mha_kv_cache_truncate, self._handle.ptr, _i64(seq, "seq"),
               _i64(new_len, "new_len"))

    def set_fp8_scales(self, k_scales: Optional[ArrayLike] = None,
                       v_scales: Optional[ArrayLike] = None) -> None:
        """fp8_e4m3 caches: the keys' and values' scale per kv head (stored e4m3(x / scale), read
        e4m3 * scale). Only while every sequence is empty (mha_kv_cache_set_fp8_scales)."""
        g = self.num_kv_heads
        arrs = []
        for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
            if s is None:
                arrs.append(None)
                continue
            a = np.ascontiguousarray(np.asarray(s, dtype=np.float32).reshape(-1))
            if a.shape[0] != g:
                raise ValueError(f"{name}: expected {g} scales (one per kv head), got {a.shape[0]}")
            arrs.append(a)
        ptrs = [None if a is None else a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
                for a in arrs]
        M.call(L.mha_kv_cache_set_fp8_scales, self._handle.ptr, ptrs[0], ptrs[1])

    def fork(self, src: int, dst: int) -> None:
        """Sequence dst becomes a copy of src (a paged cache shares src's blocks)."""
        M.call(L.mha_kv_cache_copy, self._handle.ptr, _i64(src, "src"), _i64(dst, "dst"))

    def share_prefix(self, src: int, dst: int, length: int) -> None:
        """Sequence dst becomes src's first ``length`` positions (shared blocks when paged)."""
        M.call(L.mha_kv_cache_share_prefix, self._handle.ptr, _i64(src, "src"), _i64(dst, "dst"),
               _i64(length, "length"))

    def free_blocks(self) -> int:
        """Free blocks of a paged cache's pool (0 for a contiguous cache)."""
        return int(L.mha_kv_cache_free_blocks(self._handle.ptr))

    def compact(self) -> None:
        """Paged cache: moves blocks so each sequence's blocks are consecutive in the pool and
        the free ones one run at the end (mha_kv_cache_compact); contents and results unchanged,
        later decode steps read each sequence as one run. Nothing to do for a contiguous
        cache."""
        M.call(L.mha_kv_cache_compact, self._handle.ptr)

    def accept(self, seq: int, base_len: int, draft_idx: Sequence[int]) -> None:
        """Keeps the accepted drafts of a verified tree (mha_kv_cache_accept): the rows of drafts
        ``draft_idx`` (strictly increasing indices into the drafts appended at ``base_len``) move
        to positions base_len .. base_len+n-1 and the length becomes base_len + n."""
        idx = np.asarray(draft_idx)
        if idx.size and idx.dtype.kind not in "iu":
            raise TypeError(f"draft_idx: expected integers, got dtype {idx.dtype}")
        idx = np.ascontiguousarray(idx.reshape(-1), dtype=np.int64)
        M.call(L.mha_kv_cache_accept, self._handle.ptr, _i64(seq, "seq"),
               _i64(base_len, "base_len"), idx.size,
               _ptr(idx) if idx.size else None)

    def _seq_ids(self, seq_ids, n: int):
        """(array, pointer) of seq_ids [n] int64, or (None, None) for 0 .. n-1."""
        if seq_ids is None:
            return None, None
        ids = _int_array(seq_ids, "seq_ids", np.int64, (n,))
        return ids, _ptr(ids)

    def read(self, seq: int, pos: int) -> Tuple[np.ndarray, np.ndarray]:
        """Position ``pos`` of sequence ``seq`` as stored (dequantised to float32): k [g, d_k],
        v [g, d_v] (mha_kv_cache_read)."""
        k = np.empty((self.num_kv_heads, self.head_dim), _F32)
        v = np.empty((self.num_kv_heads, self.v_head_dim), _F32)
        M.call(L.mha_kv_cache_read, self._handle.ptr, _i64(seq, "seq"), _i64(pos, "pos"), _ptr(k),
               _ptr(v))
        return k, v

    def append(self, k: ArrayLike, v: ArrayLike,
               seq_ids: Optional[Sequence[int]] = None) -> None:
        """Core level (mha_kv_cache_append): appends t post-RoPE key / value rows to each listed
        sequence, k [num_seqs, t, g, d_k], v [num_seqs, t, g, d_v] (or without the first axis
        for sequence 0), rounded once to the cache's dtype. Nothing is appended on error (a
        sequence past max_seq, a full pool: MhaError)."""
        g, dk, dv = self.num_kv_heads, self.head_dim, self.v_head_dim
        ka, va = _float32(k, "k"), _float32(v, "v")
        if ka.ndim == 3:
            ka = ka[None]
        if va.ndim == 3:
            va = va[None]
        if ka.ndim != 4 or ka.shape[2:] != (g, dk):
            raise ValueError(f"k: expected [num_seqs, t, {g}, {dk}], got shape {np.shape(k)}")
        if va.shape != ka.shape[:2] + (g, dv):
            raise ValueError(f"v: expected [{ka.shape[0]}, {ka.shape[1]}, {g}, {dv}] (as k), got "
                             f"shape {np.shape(v)}")
        if ka.shape[0] < 1 or ka.shape[1] < 1:
            raise ValueError(f"k: num_seqs and t must be >= 1, got shape {np.shape(k)}")
        ids, pid = self._seq_ids(seq_ids, ka.shape[0])
        M.call(L.mha_kv_cache_append, self._handle.ptr, ka.shape[0], pid, ka.shape[1], _ptr(ka),
               _ptr(va))

    def attention(self, q: ArrayLike, seq_ids: Optional[Sequence[int]] = None, *,
                  scale: Optional[float] = None, softcap: float = 0.0, alibi: bool = False,
                  sinks: Optional[ArrayLike] = None,
                  tree_parents: Optional[Sequence[int]] = None, return_lse: bool = False,
                  impl: str = "auto", threads: int = 0):
        """Core level (mha_kv_cache_attention): the LAST t positions of each listed sequence
        (already appended) attend to everything the cache holds for it, causal, bottom-right
        aligned, with the cache's window / chunk rule (docs/INFERENCE.md).
        q [num_seqs, t, h, d_k] post-RoPE (or without the first axis for sequence 0), h a
        multiple of the cache's kv heads (query head i reads kv head i // (h / g)); returns
        out [num_seqs, t, h, d_v] float32, and lse [num_seqs, h, t] with ``return_lse``.
        ``scale`` None = 1/sqrt(d_k); ``softcap``, ``alibi``, ``sinks`` [h] as in
        :func:`mha.attention`; ``tree_parents`` [t]: the t positions are a draft tree
        (docs/SEMANTICS.md "Draft trees")."""
        qa = _float32(q, "q")
        single = qa.ndim == 3
        if single:
            qa = qa[None]
        if qa.ndim != 4 or qa.shape[3] != self.head_dim or qa.shape[0] < 1 or qa.shape[1] < 1:
            raise ValueError(f"q: expected [num_seqs, t, h, {self.head_dim}], got shape "
                             f"{np.shape(q)}")
        S, t, h = qa.shape[:3]
        a = L.mha_kv_attention_args()
        a.num_seqs, a.num_tokens, a.num_heads = S, t, h
        ids, a.seq_ids = self._seq_ids(seq_ids, S)
        if scale is not None:
            scale = float(scale)
            if scale == 0.0:
                raise ValueError("scale: must be nonzero (None = 1/sqrt(head_dim))")
            a.scale = scale
        a.softcap, a.alibi = float(softcap), int(bool(alibi))
        snk = None
        if sinks is not None:
            snk = _float32(sinks, "sinks").reshape(-1)
            if snk.shape[0] != h:
                raise ValueError(f"sinks: expected [{h}] (one per query head), got shape "
                                 f"{np.shape(sinks)}")
            a.sinks = _ptr(snk)
        tree = None
        if tree_parents is not None:
            tree = _int_array(tree_parents, "tree_parents", np.int64, (t,))
            a.tree_parents = _ptr(tree)
        out = np.empty((S, t, h, self.v_head_dim), _F32)
        lse = np.empty((S, h, t), _F32) if return_lse else None
        a.q, a.out = _ptr(qa), _ptr(out)
        a.lse = _ptr(lse) if lse is not None else None
        M.call(L.mha_kv_cache_attention, self._handle.ptr, a, _exec(impl, threads))
        if single:
            out = out[0]
            lse = lse[0] if lse is not None else None
        return (out, lse) if return_lse else out

    def _run(self, fn, x, seq_ids, impl, threads, tree_parents=None) -> np.ndarray:
        if self._layer is None:
            raise ValueError("this cache has no layer (made with layer=None): use append() and "
                             "attention(), or make it with layer.kv_cache(...)")
        c = self._layer.config
        a = _float32(x, "x")
        single = a.ndim == 2
        if single:
            a = a[None]
        if a.ndim != 3 or a.shape[2] != c.q_dim:
            raise ValueError(f"x: expected [num_seqs, t, {c.q_dim}], got shape {np.shape(x)}")
        d = L.mha_decode_args()
        d.num_seqs, d.num_tokens = a.shape[0], a.shape[1]
        ids = None
        if seq_ids is not None:
            ids = _int_array(seq_ids, "seq_ids", np.int64, (a.shape[0],))
            d.seq_ids = _ptr(ids)
        tree = None
        if tree_parents is not None:
            tree = _int_array(tree_parents, "tree_parents", np.int64, (a.shape[1],))
            d.tree_parents = _ptr(tree)
        out = np.empty((a.shape[0], a.shape[1], c.out_dim), _F32)
        d.x, d.out = _ptr(a), _ptr(out)
        M.call(fn, self._layer._ptr, self._handle.ptr, d, _exec(impl, threads))
        return out[0] if single else out

    def prefill(self, x: ArrayLike, seq_ids: Optional[Sequence[int]] = None, *,
                impl: str = "auto", threads: int = 0) -> np.ndarray:
        """Appends t tokens per listed sequence (mha_layer_prefill) and returns their outputs."""
        return self._run(L.mha_layer_prefill, x, seq_ids, impl, threads)

    def step(self, x: ArrayLike, seq_ids: Optional[Sequence[int]] = None, *,
             impl: str = "auto", threads: int = 0,
             tree_parents: Optional[Sequence[int]] = None) -> np.ndarray:
        """One decoding step (mha_layer_decode_step): usually t = 1 new token per sequence.
        ``tree_parents`` [t] makes the t tokens a draft tree (docs/SEMANTICS.md "Draft trees"):
        parent index or -1; keep the accepted path with ``accept``."""
        return self._run(L.mha_layer_decode_step, x, seq_ids, impl, threads, tree_parents)

    def close(self) -> None:
        self._handle.close()


def mla_weight_shapes(c: "L.mha_mla_config") -> Dict[str, Tuple[int, ...]]:
    """The shape of every weight an MLA layer of config c has, by mha_mla_weights' names (in the
    order of mha.torch.MLA's parameters and of torch.ops.mha.mla's weights)."""
    h, dn, dr, dv = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    E, r, rq, b = c.hidden, c.kv_lora_rank, c.q_lora_rank, bool(c.bias)
    s = {"w_kv_a": (r + dr, E), "kv_a_norm": (r,), "w_kv_b": (h * (dn + dv), r),
         "w_o": (E, h * dv)}
    if rq:
        s.update(w_q_a=(rq, E), q_a_norm=(rq,), w_q_b=(h * (dn + dr), rq))
        if b:
            s["b_q_a"] = (rq,)
    else:
        s["w_q"] = (h * (dn + dr), E)
    if b:
        s.update(b_kv_a=(r + dr,), b_o=(E,))
    return s


class MLA:
    """Multi-head latent attention (DeepSeek-V2/V3; mha.h "Multi-head latent attention",
    docs/SEMANTICS.md). ``MLA.from_pretrained(dir, layer)`` loads a deepseek_v2 / deepseek_v3
    layer; ``MLA(config, weights)`` builds one from an :class:`mha._lib.mha_mla_config` and a
    dict of float32 arrays named as mha_mla_weights' fields (w_q or w_q_a/b_q_a/q_a_norm/w_q_b,
    w_kv_a, b_kv_a, kv_a_norm, w_kv_b, w_o, b_o). ``forward`` is the expanded form (per-head k
    and v); :class:`MLACache` decodes through the compressed cache."""

    model_info: Optional[Dict[str, object]] = None

    def __init__(self, config: "L.mha_mla_config", weights: Dict[str, ArrayLike]):
        w = L.mha_mla_weights()
        keep = []
        unknown = set(weights) - set(L.MLA_WEIGHT_NAMES)
        if unknown:
            raise ValueError(f"weights: unknown names {sorted(unknown)}")
        # mha_mla_create reads each pointer for its shape's elements: a smaller array would be
        # read past its end, another shape of the same size taken in another layout. The config
        # is checked first (by mha_mla_create without weights: its config errors name the field;
        # with a valid config it stops at the first weight, NULL).
        try:
            M.call(L.mha_mla_create, config, L.mha_mla_weights(), None, ctypes.c_void_p())
        except MhaError as e:
            if not (e.message.startswith("weights.") and "is NULL" in e.message):
                raise
        shapes = mla_weight_shapes(config)
        for name in L.MLA_WEIGHT_NAMES:
            if weights.get(name) is None:
                continue
            if name not in shapes:
                raise ValueError(f"weights: {name} is given but the config does not use it "
                                 f"(it uses {', '.join(shapes)})")
            a = _float32(weights[name], name)
            if a.shape != shapes[name]:
                raise ValueError(f"weights: {name} must have shape {shapes[name]}, got {a.shape}")
            keep.append(a)
            setattr(w, name, _ptr(a))
        ptr = ctypes.c_void_p()
        M.call(L.mha_mla_create, config, w, None, ptr)
        self._handle = _Handle(ptr.value, L.mha_mla_destroy)
        self._ptr = ptr.value

    @classmethod
    def from_pretrained(cls, path: str, layer: int = 0) -> "MLA":
        """Layer ``layer`` of a Hugging Face deepseek_v2 / deepseek_v3 model directory
        (mha_hf_mla_load; docs/MODELS.md). Hostile configs raise MhaError naming the field."""
        _layer_index(layer)
        info = L.mha_hf_layer_info()
        ptr = ctypes.c_void_p()
        M.call(L.mha_hf_mla_load, str(path).encode(), int(layer), None, ptr, info)
        self = cls.__new__(cls)
        self._handle = _Handle(ptr.value, L.mha_mla_destroy)
        self._ptr = ptr.value
        self.model_info = {"model_type": info.model_type.decode(), "layout": info.layout.decode(),
                           "prefix": info.prefix.decode(), "layer": int(info.layer),
                           "num_layers": int(info.num_layers), "causal": True}
        return self

    @property
    def config(self) -> "L.mha_mla_config":
        """The resolved mha_mla_config (a copy)."""
        c = L.mha_mla_config()
        ctypes.pointer(c)[0] = L.mha_mla_get_config(self._ptr).contents
        return c

    def forward(self, x: ArrayLike, positions: Optional[ArrayLike] = None, *,
                causal: bool = True, threads: int = 0) -> np.ndarray:
        """x [B, n, hidden] (or [n, hidden]) -> out of the same shape (mha_mla_forward)."""
        E = self.config.hidden
        a = _float32(x, "x")
        single = a.ndim == 2
        if single:
            a = a[None]
        if a.ndim != 3 or a.shape[2] != E:
            raise ValueError(f"x: expected [B, n, {E}], got shape {np.shape(x)}")
        args = L.mha_mla_forward_args()
        args.batch, args.seq_len, args.causal = a.shape[0], a.shape[1], int(bool(causal))
        pos = None
        if positions is not None:
            pos = _int_array(positions, "positions", np.int64, a.shape[:2])
            args.positions = _ptr(pos)
        out = np.empty(a.shape, _F32)
        args.x, args.out = _ptr(a), _ptr(out)
        M.call(L.mha_mla_forward, self._ptr, args, _exec("auto", threads))
        return out[0] if single else out

    __call__ = forward

    def weight_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """The shape of every weight this layer has, by mha_mla_weights' names."""
        return mla_weight_shapes(self.config)

    def backward(self, x: ArrayLike, dy: ArrayLike, positions: Optional[ArrayLike] = None, *,
                 causal: bool = True, threads: int = 0) -> Dict[str, np.ndarray]:
        """Gradients of :meth:`forward` (mha_mla_backward): {"x": dL/dx, and every weight of
        :meth:`weight_shapes` (norm weights included)} for the upstream gradient dy."""
        E = self.config.hidden
        a = _float32(x, "x")
        g = _float32(dy, "dy")
        single = a.ndim == 2
        if single:
            a, g = a[None], g[None]
        if a.ndim != 3 or a.shape[2] != E or g.shape != a.shape:
            raise ValueError(f"x, dy: expected [B, n, {E}] each, got {np.shape(x)}, "
                             f"{np.shape(dy)}")
        args = L.mha_mla_forward_args()
        args.batch, args.seq_len, args.causal = a.shape[0], a.shape[1], int(bool(causal))
        pos = None
        if positions is not None:
            pos = _int_array(positions, "positions", np.int64, a.shape[:2])
            args.positions = _ptr(pos)
        args.x = _ptr(a)
        out = {"x": np.empty(a.shape, _F32)}
        gr = L.mha_mla_grads()
        gr.dy, gr.dx = _ptr(g), _ptr(out["x"])
        for name, shape in self.weight_shapes().items():
            out[name] = np.empty(shape, _F32)
            setattr(gr, name, _ptr(out[name]))
        M.call(L.mha_mla_backward, self._ptr, args, gr, _exec("auto", threads))
        if single:
            out["x"] = out["x"][0]
        return out

    def close(self) -> None:
        self._handle.close()


class MLACache:
    """The compressed cache of an :class:`MLA` layer: per token [c, k_pe] (kv_lora_rank +
    qk_rope_head_dim values) in float32, float16 or bfloat16. ``step(x)`` appends t tokens per
    sequence and returns their outputs through the absorbed form (mha_mla_decode_step)."""

    def __init__(self, mla: MLA, max_seq: int, batch: int = 1, *, dtype: str = "float32"):
        if dtype not in KVCache._DTYPES:
            raise ValueError(f"dtype: expected one of {sorted(KVCache._DTYPES)}, got {dtype!r}")
        ptr = ctypes.c_void_p()
        M.call(L.mha_mla_cache_create, mla._ptr, _i64(batch, "batch"), _i64(max_seq, "max_seq"),
               KVCache._DTYPES[dtype], None, ptr)
        self._mla = mla
        self._handle = _Handle(ptr.value, L.mha_mla_cache_destroy)

    @property
    def bytes_per_token(self) -> int:
        return int(L.mha_mla_cache_bytes_per_token(self._handle.ptr))

    def length(self, seq: int = 0) -> int:
        n = L.mha_mla_cache_length(self._handle.ptr, _i64(seq, "seq"))
        if n < 0:
            raise ValueError(f"seq={seq} is not a sequence of this cache")
        return n

    def reset(self, seq: int = 0) -> None:
        M.call(L.mha_mla_cache_reset, self._handle.ptr, _i64(seq, "seq"))

    def step(self, x: ArrayLike, seq_ids: Optional[Sequence[int]] = None, *,
             threads: int = 0) -> np.ndarray:
        E = self._mla.config.hidden
        a = _float32(x, "x")
        single = a.ndim == 2
        if single:
            a = a[None]
        if a.ndim != 3 or a.shape[2] != E:
            raise ValueError(f"x: expected [num_seqs, t, {E}], got shape {np.shape(x)}")
        d = L.mha_decode_args()
        d.num_seqs, d.num_tokens = a.shape[0], a.shape[1]
        ids = None
        if seq_ids is not None:
            ids = _int_array(seq_ids, "seq_ids", np.int64, (a.shape[0],))
            d.seq_ids = _ptr(ids)
        out = np.empty(a.shape, _F32)
        d.x, d.out = _ptr(a), _ptr(out)
        M.call(L.mha_mla_decode_step, self._mla._ptr, self._handle.ptr, d, _exec("auto", threads))
        return out[0] if single else out

    def close(self) -> None:
        self._handle.close()


__all__ += ["MhaError"]


# ------------------------------------------------------------------------------------------------
# Ring attention over MPI: sharding
# ------------------------------------------------------------------------------------------------
def shard_rows(seq_len: int, comm: Any = None, *, shard_layout: str = "zigzag",
               num_ranks: Optional[int] = None, rank: Optional[int] = None) -> np.ndarray:
    """The global rows (int64 indices into the N = ``seq_len`` rows, in local order) that a rank
    holds in ring attention (mha_ring_shard; docs/distributed.md): of ``comm`` (an mpi4py
    communicator: its size and this process's rank), or of ``rank`` of ``num_ranks``. 'zigzag'
    cuts the sequence into 2P chunks and gives rank r chunks r and 2P-1-r (equal causal work);
    'contiguous' into P, chunk r. A rank's shard of a [B, h, N, d] array is ``x[:, :, rows]``
    (``x[:, rows]`` for [B, N, h, d]); the full output is put back with
    ``full[:, :, rows] = out``. Needs libmha_mpi (MhaError otherwise); no communication."""
    from . import _mpi
    return _mpi.shard_rows_of(seq_len, comm, shard_layout, num_ranks, rank)
