# SPDX-License-Identifier: MIT
"""mha from JAX: :func:`dot_product_attention`, a drop-in for ``jax.nn.dot_product_attention``.

    from mha.jax import dot_product_attention
    out = dot_product_attention(q, k, v, mask=m, is_causal=True)        # [B, T, N, H]
    out, lse = dot_product_attention(q, k, v, softcap=50.0, sinks=s, return_residual=True)

The attention runs in the C library, called through XLA's FFI (``jax.ffi.ffi_call`` on the
handlers of mha/_jax_ffi.cc): inside a compiled program it is one custom call on XLA's own
buffers, with no Python and no host callback. It works under ``jax.jit``, ``jax.grad`` (a
``jax.custom_vjp`` whose backward is mha's backward, reusing the forward's log-sum-exp) and
``jax.vmap`` (the vmapped dimensions fold into the batch). CPU only.

Semantics are those of ``jax.nn.dot_product_attention`` (jax 0.10), with these documented
differences (docs/PYTHON.md, "JAX"): a row whose keys are all masked gives zeros (JAX: the average
of the values), and its residual is -inf; computation is float32 whatever the input dtype (the
result has the input's dtype; bfloat16/float16 arrays reach the handler without conversion). Extras: value heads of another size than the query's, ``softcap``,
``sinks`` (per-head sink logits, differentiable), ``implementation`` naming mha's kernels
("auto", "fast", "reference"), ``threads``.
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
from typing import NamedTuple, Optional, Tuple, Union

import numpy as np

import jax
import jax.numpy as jnp

from . import _lib

__all__ = ["dot_product_attention"]

_FORWARD = "mha_attention_forward"
_BACKWARD = "mha_attention_backward"
_IMPLS = {None: 0, "auto": 0, "reference": 1, "fast": 2}


def _load_handlers() -> str:
    """Loads mha/_jax_ffi.so (or $MHA_JAX_FFI) and registers its handlers with XLA (CPU)."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.abspath(os.environ.get("MHA_JAX_FFI") or os.path.join(here, "_jax_ffi.so"))
    if not os.path.exists(path):
        raise ImportError(
            f"mha.jax: the XLA FFI handler {path} was not found: this mha was built without it "
            "(MHA_JAX=OFF, no C++ compiler, or no jaxlib 0.10.2 wheel for this Python and "
            "platform at build time: the build's log says which; docs/PYTHON.md, \"JAX: "
            "packaging\"). Reinstall mha with a C++ compiler, or set "
            "MHA_JAX_FFI=/path/to/_jax_ffi.so.")
    # _lib has loaded libmha (same SONAME, so the handler's dependency resolves to that copy).
    try:
        handlers = ctypes.CDLL(path)
    except OSError as e:
        raise ImportError(f"mha.jax: could not load the XLA FFI handler {path}: {e}") from e
    jax.ffi.register_ffi_target(_FORWARD, jax.ffi.pycapsule(handlers.MhaJaxForward),
                                platform="cpu")
    jax.ffi.register_ffi_target(_BACKWARD, jax.ffi.pycapsule(handlers.MhaJaxBackward),
                                platform="cpu")
    return path


assert _lib.library_path  # libmha first: the handler links it
handler_path: str = _load_handlers()


class _Static(NamedTuple):
    """The attributes of one call (hashable: the custom_vjp's non-differentiable argument)."""
    scale: float
    softcap: float
    causal: bool
    window_left: int
    window_right: int
    impl: int
    threads: int

    def attrs(self) -> dict:
        return dict(scale=np.float64(self.scale), softcap=np.float64(self.softcap),
                    causal=bool(self.causal), window_left=np.int64(self.window_left),
                    window_right=np.int64(self.window_right), impl=np.int64(self.impl),
                    threads=np.int64(self.threads))


_ABSENT = (0,)  # shape of the zero-size placeholder of an absent optional operand


def _or_absent(x, dtype):
    return jnp.zeros(_ABSENT, dtype) if x is None else x


def _ffi_forward(st: _Static, q, k, v, bias, mask, kv_pad, sinks, want_probs: bool):
    """out [B, T, N, Hv], lse [B, N, T] (and probs [B, N, T, S] when want_probs)."""
    B, T, N, _ = q.shape
    S, Hv = k.shape[1], v.shape[3]
    f32 = jnp.float32
    # out in q's dtype (float32, bfloat16 or float16: the handler writes it as it is stored).
    shapes = (jax.ShapeDtypeStruct((B, T, N, Hv), q.dtype), jax.ShapeDtypeStruct((B, N, T), f32),
              jax.ShapeDtypeStruct((B, N, T, S) if want_probs else _ABSENT, f32))
    call = jax.ffi.ffi_call(_FORWARD, shapes, vmap_method="expand_dims")
    return call(q, k, v, _or_absent(bias, f32), _or_absent(mask, jnp.bool_),
                _or_absent(kv_pad, jnp.bool_), _or_absent(sinks, f32), **st.attrs())


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st, q, k, v, bias, mask, kv_pad, sinks):
    out, lse, _ = _ffi_forward(st, q, k, v, bias, mask, kv_pad, sinks, False)
    return out, lse


def _attention_fwd(st, q, k, v, bias, mask, kv_pad, sinks):
    out, lse, _ = _ffi_forward(st, q, k, v, bias, mask, kv_pad, sinks, False)
    return (out, lse), (q, k, v, bias, mask, kv_pad, sinks, out, lse)


def _attention_bwd(st, res, cts):
    # The lse output reaches users only under stop_gradient (as JAX's residual), so its
    # cotangent is zero and only dout matters.
    q, k, v, bias, mask, kv_pad, sinks, out, lse = res
    dout = cts[0]
    f32 = jnp.float32
    N = q.shape[2]
    # dq, dk, dv in the dtypes of q, k, v (written by the handler as they are stored).
    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
              jax.ShapeDtypeStruct(v.shape, v.dtype),
              jax.ShapeDtypeStruct((N,) if sinks is not None else _ABSENT, f32))
    call = jax.ffi.ffi_call(_BACKWARD, shapes, vmap_method="expand_dims")
    dq, dk, dv, dsinks = call(q, k, v, _or_absent(bias, f32), _or_absent(mask, jnp.bool_),
                              _or_absent(kv_pad, jnp.bool_), _or_absent(sinks, f32), out, lse,
                              dout, **st.attrs())
    dbias = None if bias is None else _bias_grad(st, res, dout)
    return dq, dk, dv, dbias, None, None, (dsinks if sinks is not None else None)


def _bias_grad(st, res, dout):
    """dL/dbias = dS = P (dP - D), with P the probabilities recomputed by mha's forward,
    dP_ij = dO_i . V_j and D_i = dO_i . O_i (the bias is added after the soft-cap, so no tanh
    factor), summed over the dimensions the bias broadcasts along. O(B N T S), as the bias.
    In float32 whatever the operands' storage (as the library's own dS): dP and D of bfloat16 /
    float16 operands rounded to their dtype would cancel in dP - D (until session 48 they were:
    dbias off by up to 2.8% of max|dbias| with bfloat16 q, k, v)."""
    q, k, v, bias, mask, kv_pad, sinks, out, _ = res
    _, _, probs = _ffi_forward(st, q, k, v, bias, mask, kv_pad, sinks, True)
    group = q.shape[2] // k.shape[2]
    f32 = jnp.float32
    dout, v, out = dout.astype(f32), v.astype(f32), out.astype(f32)  # (no-ops for float32)
    v_heads = jnp.repeat(v, group, axis=2) if group > 1 else v  # query head n reads n // group
    dp = jnp.einsum("btnd,bsnd->bnts", dout, v_heads)
    d = jnp.einsum("btnd,btnd->bnt", dout, out)[..., None]
    ds = probs * (dp - d)
    axes = tuple(i for i in range(4) if bias.shape[i] == 1 and ds.shape[i] != 1)
    return jnp.sum(ds, axis=axes, keepdims=True).astype(bias.dtype)


_attention.defvjp(_attention_fwd, _attention_bwd)


# ------------------------------------------------------------------------------------------------
# The public function: validation and conversion, then _attention.
# ------------------------------------------------------------------------------------------------
_FLOATS = (jnp.float32, jnp.float16, jnp.bfloat16, jnp.float64)


def _storage(x):
    """x as the handler reads it: float32, bfloat16 and float16 as they are (no conversion),
    float64 converted to float32."""
    return x if x.dtype in _STORAGE else x.astype(jnp.float32)


_STORAGE = (jnp.float32, jnp.bfloat16, jnp.float16)


def _float_input(x, name):
    x = jnp.asarray(x)
    if not any(x.dtype == d for d in _FLOATS):
        raise TypeError(f"mha.jax: {name} must be a floating-point array (float32, float16, "
                        f"bfloat16 or float64), got {x.dtype}")
    return x


def _ensure_4d(x, name):
    if x.ndim > 4:
        raise ValueError(f"mha.jax: {name} must have at most 4 dimensions, got shape {x.shape}")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _check_broadcast(x, target, name):
    if any(a != 1 and a != b for a, b in zip(x.shape, target)):
        raise ValueError(f"mha.jax: {name} of shape {x.shape} does not broadcast to (B, N, T, S)"
                         f"={target}")


def _lengths(x, batch, name):
    x = jnp.asarray(x)
    if x.shape != (batch,) or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"mha.jax: {name} must be an integer array of shape (B,)=({batch},), "
                         f"got {x.dtype} {x.shape}")
    return x


def _window(local_window_size) -> Tuple[int, int]:
    if local_window_size is None:
        return -1, -1
    w = local_window_size
    if isinstance(w, (int, np.integer)):
        w = (w, w)
    if (not isinstance(w, tuple) or len(w) != 2
            or not all(isinstance(s, (int, np.integer)) and 0 <= s < 2 ** 63 for s in w)):
        raise ValueError("mha.jax: local_window_size must be a non-negative int (below 2^63) or a "
                         f"(left, right) tuple of them, got {local_window_size!r}")
    return int(w[0]), int(w[1])


def _static_float(x, name, default: float) -> float:
    if x is None:
        return default
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"mha.jax: {name} must be a Python number (it is compiled into the call), "
                        "not a traced value")
    x = float(x)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"mha.jax: {name} must be finite and >= 0, got {x}")
    return x


def _check_cpu(*arrays) -> None:
    """mha runs on the CPU only: refuse arrays on another device, and tracing for another backend
    (under jit the arrays are tracers; the default device then decides where the program runs)."""
    platforms = set()
    for x in arrays:
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            platforms |= {d.platform for d in x.devices()}
    if not platforms:
        device = jax.config.jax_default_device
        platforms = {device.platform if hasattr(device, "platform") else
                     (device or jax.default_backend())}
    other = sorted(p for p in platforms if p != "cpu")
    if other:
        raise RuntimeError(f"mha.jax runs on the CPU only, but the arrays are on {other[0]}; "
                           "put them on the CPU (jax.device_put(x, jax.devices('cpu')[0])) or "
                           "use jax.nn.dot_product_attention")


def dot_product_attention(query, key, value, bias=None, mask=None, *,
                          scale: Optional[float] = None, is_causal: bool = False,
                          query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size: Union[int, Tuple[int, int], None] = None,
                          implementation: Optional[str] = None, return_residual: bool = False,
                          softcap: Optional[float] = None, sinks=None, threads: int = 0):
    """``jax.nn.dot_product_attention`` computed by mha (same arguments, same layout).

    Args (as JAX's; B batch, T query length, S key length, N query heads, K kv heads):
        query: [B, T, N, H] (or [T, N, H]); key: [B, S, K, H]; value: [B, S, K, Hv]
            (N a multiple of K: GQA/MQA; Hv may differ from H). float32, bfloat16 and float16
            go to the library as they are (float32 arithmetic, the output rounded once to the
            query's dtype, gradients in the operands' dtypes); float64 is converted to float32
            and the result converted back.
        bias: added to the scores, broadcasting to [B, N, T, S] (at most 4 dims). Differentiable.
        mask: bool, broadcasting to [B, N, T, S]; True = may attend.
        scale: a Python number; None = 1/sqrt(H).
        is_causal: key j visible to query i iff j <= i (top-left aligned, as JAX).
        query_seq_lengths, key_value_seq_lengths: int [B]; query rows past the length give 0,
            keys past the length are masked.
        local_window_size: w or (left, right): query i sees keys i-left .. i+right.
        implementation: None or "auto" (fastest kernel), "fast" (error if the fast kernels
            cannot), "reference" (the plain loops). "xla" and "cudnn" are refused.
        return_residual: also return the log-sum-exp [B, T, N] (under stop_gradient, as JAX).
        softcap: s -> softcap * tanh(s / softcap) before bias and masks (Gemma 2); None = off.
        sinks: [N] per-head sink logits (gpt-oss), differentiable.
        threads: threads of each call (0 = all cores).

    Returns: [B, T, N, Hv] in the query's dtype (and the residual when asked).
    """
    if implementation not in _IMPLS:
        raise ValueError(f"mha.jax: implementation={implementation!r} is not supported: mha.jax is "
                         "mha's implementation; choose None, 'auto', 'fast' or 'reference' (use "
                         "jax.nn.dot_product_attention for 'xla' or 'cudnn')")
    q = _float_input(query, "query")
    k = _float_input(key, "key")
    v = _float_input(value, "value")
    unbatched = q.ndim == 3
    if q.ndim not in (3, 4) or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError("mha.jax: query, key and value must all be [B, L, heads, dim] (or all "
                         f"[L, heads, dim]), got {q.shape}, {k.shape}, {v.shape}")
    q, k, v = (x[None] if unbatched else x for x in (q, k, v))
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[3] != H:
        raise ValueError(f"mha.jax: shapes do not agree: query {q.shape} [B, T, N, H], key "
                         f"{k.shape} [B, S, K, H], value {v.shape} [B, S, K, Hv]")
    if 0 in (N, K, H):  # (a ZeroDivisionError below otherwise)
        raise ValueError(f"mha.jax: heads N, K and head size H must be > 0, got N={N}, K={K}, "
                         f"H={H}")
    if N % K:
        raise ValueError(f"mha.jax: the number of query heads ({N}) must be a multiple of the "
                         f"number of key/value heads ({K})")
    target = (B, N, T, S)
    f32 = jnp.float32
    if bias is not None:
        bias = _ensure_4d(_float_input(bias, "bias"), "bias").astype(f32)
        _check_broadcast(bias, target, "bias")
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise ValueError(f"mha.jax: mask must be bool (True = may attend), got {mask.dtype}; "
                             "pass an additive mask as bias")
        mask = _ensure_4d(mask, "mask")
        _check_broadcast(mask, target, "mask")
    if query_seq_lengths is not None:
        q_len = _lengths(query_seq_lengths, B, "query_seq_lengths")
        # Rows past the length are fully masked, which gives them zeros (as JAX's padding).
        rows = (jnp.arange(T)[None, :] < q_len[:, None])[:, None, :, None]
        mask = rows if mask is None else jnp.logical_and(mask, rows)
    kv_pad = None
    if key_value_seq_lengths is not None:
        kv_len = _lengths(key_value_seq_lengths, B, "key_value_seq_lengths")
        kv_pad = jnp.arange(S)[None, :] < kv_len[:, None]
    if sinks is not None:
        sinks = _float_input(sinks, "sinks").astype(f32)
        if sinks.shape != (N,):
            raise ValueError(f"mha.jax: sinks must have shape (N,)=({N},), got {sinks.shape}")
    if type(threads) is not int or not 0 <= threads < 2 ** 31:
        raise ValueError(f"mha.jax: threads must be an int in [0, 2^31) (0 = all cores), got "
                         f"{threads!r}")
    left, right = _window(local_window_size)
    st = _Static(scale=_static_float(scale, "scale", 1.0 / math.sqrt(H)),
                 softcap=_static_float(softcap, "softcap", 0.0), causal=bool(is_causal),
                 window_left=left, window_right=right, impl=_IMPLS[implementation],
                 threads=int(threads))
    if st.scale == 0:
        raise ValueError("mha.jax: scale must be > 0")
    _check_cpu(q, k, v, bias, mask, sinks)
    out, lse = _attention(st, _storage(q), _storage(k), _storage(v), bias, mask, kv_pad, sinks)
    out = out.astype(q.dtype)  # (float64: computed in float32)
    if unbatched:
        out = out[0]
    if not return_residual:
        return out
    # [B, N, T] -> [B, T, N], in the query's dtype (as JAX's residual).
    residual = jax.lax.stop_gradient(jnp.swapaxes(lse, 1, 2)).astype(q.dtype)
    return out, (residual[0] if unbatched else residual)
