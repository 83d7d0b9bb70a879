# SPDX-License-Identifier: MIT
"""PyTorch drop-ins running forward and backward through libmha (float32 CPU tensors).

- :class:`MultiheadAttention`: a ``torch.nn.Module`` with ``nn.MultiheadAttention``'s constructor
  arguments, parameter names (so its ``state_dict`` loads both ways) and ``forward`` signature;
  PyTorch's conventions are translated (bool ``attn_mask``/``key_padding_mask`` True = masked out,
  float masks additive, ``is_causal`` = top-left causal, ``batch_first``).
- :func:`scaled_dot_product_attention`: ``F.scaled_dot_product_attention``'s signature.

Both are ``torch.autograd.Function`` s whose backward calls mha's backward (mha_layer_backward,
mha_attention_backward), so a model can be trained with them. This module imports torch; the
rest of the package does not (``import mha`` works without torch).

Differences from PyTorch (docs/PYTHON.md): fully masked query rows give 0 (PyTorch: NaN); the
returned attention weights are the probabilities before dropout and carry no gradient; dropout
uses mha's counter-based RNG seeded from torch's generator (reproducible with
``torch.manual_seed``, but not the same random mask as PyTorch's); gradients do not flow into
masks; ``add_bias_kv`` and ``add_zero_attn`` raise NotImplementedError.
"""
from __future__ import annotations

import ctypes
import math
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from . import _lib as L
from ._api import MultiheadAttention as _Layer
from ._lib import MhaError

__all__ = ["MultiheadAttention", "scaled_dot_product_attention", "MhaError"]

_byref = ctypes.byref
_F32 = torch.float32
_MASK_CODES = {torch.bool: L.DTYPE_BOOL, torch.uint8: L.DTYPE_U8, torch.int32: L.DTYPE_I32,
               torch.int64: L.DTYPE_I64, torch.float32: L.DTYPE_F32}


def _check_backward() -> None:
    if not L.HAS_BACKWARD:
        raise NotImplementedError(
            "mha: the loaded libmha has no backward (mha_layer_backward / "
            "mha_attention_backward); rebuild the library from a version that has them")


def _exec(threads: int) -> L.mha_exec:
    ex = L.mha_exec()
    ex.n_threads = threads
    return ex


def _set_mask(t: L.mha_mask_tensor, m: Tensor) -> None:
    """Points a mha_mask_tensor at a contiguous CPU tensor (bool/uint8/int32/int64/float32)."""
    t.data = m.data_ptr()
    t.dtype = _MASK_CODES[m.dtype]
    t.ndim = m.dim()
    for i, s in enumerate(m.shape):
        t.shape[i] = s


def _seed() -> int:
    return int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64).item())


def _check_cpu_f32(name: str, t: Tensor) -> None:
    if t.device.type != "cpu":
        raise TypeError(f"mha.torch: {name} must be a CPU tensor (mha runs on the CPU), got "
                        f"device {t.device}")


def _mask_arg(name: str, m: Tensor) -> Tensor:
    _check_cpu_f32(name, m)
    if m.dtype == torch.bool:
        return m.contiguous()
    if m.is_floating_point():
        return m.detach().to(_F32).contiguous()
    raise TypeError(f"mha.torch: only bool and floating types of {name} are supported, got "
                    f"{m.dtype}")


# ------------------------------------------------------------------------------------------------
# The layer: nn.MultiheadAttention
# ------------------------------------------------------------------------------------------------
class _LayerSpec:
    """Everything of one layer call that is not a differentiable tensor."""
    __slots__ = ("layer", "args", "keep", "threads", "need_weights", "average", "state",
                 "mode", "packed", "E")


class _LayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: _LayerSpec, query: Tensor, key: Tensor, value: Tensor,
                in_w: Optional[Tensor], q_w: Optional[Tensor], k_w: Optional[Tensor],
                v_w: Optional[Tensor], in_b: Optional[Tensor], o_w: Tensor,
                o_b: Optional[Tensor]):
        a = spec.args
        cfg = spec.layer.config
        B, n, m = a.batch, a.q_len, a.kv_len
        out = torch.empty((B, n, cfg.out_dim), dtype=_F32)
        a.out = out.data_ptr()
        probs = None
        if spec.need_weights:
            probs = torch.empty((B, n, m) if spec.average else (B, cfg.num_heads, n, m),
                                dtype=_F32)
            a.probs = probs.data_ptr()
            a.average_probs = 1 if spec.average else 0
        err = L.mha_error()
        ex = _exec(spec.threads)
        train = any(ctx.needs_input_grad)
        if train:
            _check_backward()
            st = ctypes.c_void_p()
            L.check(L.mha_layer_forward_train(spec.layer._ptr, _byref(a), _byref(ex),
                                              _byref(st), _byref(err)), err)
            spec.state = _StateHandle(st.value)
        else:
            L.check(L.mha_layer_forward(spec.layer._ptr, _byref(a), _byref(ex), _byref(err)),
                    err)
        if train:
            ctx.spec = spec
        if probs is None:
            probs = torch.empty(0, dtype=_F32)
        ctx.mark_non_differentiable(probs)
        return out, probs

    @staticmethod
    def backward(ctx, dy: Tensor, _dprobs: Optional[Tensor]):
        _check_backward()
        spec = ctx.spec
        cfg = spec.layer.config
        a = spec.args
        B, n, m = a.batch, a.q_len, a.kv_len
        need = ctx.needs_input_grad
        dy = dy.contiguous()
        g = L.mha_layer_grads()
        res = [None] * 11

        def buf(i: int, shape, field: Optional[str] = None) -> Optional[Tensor]:
            if not need[i]:
                return None
            t = torch.empty(shape, dtype=_F32)
            res[i] = t
            if field:
                setattr(g, field, t.data_ptr())
            return t

        buf(1, (B, n, cfg.q_dim), "d_query")
        if spec.mode == "cross":
            buf(2, (B, m, cfg.k_dim), "d_key")
            buf(3, (B, m, cfg.v_dim), "d_value")
        elif spec.mode == "kv":
            buf(2, (B, m, cfg.k_dim), "d_key")
        E = spec.E
        if spec.packed:
            t = buf(4, (3 * E, E))
            if t is not None:
                p = t.data_ptr()
                g.dw_q, g.dw_k, g.dw_v = p, p + 4 * E * E, p + 8 * E * E
        else:
            buf(5, (E, cfg.q_dim), "dw_q")
            buf(6, (E, cfg.k_dim), "dw_k")
            buf(7, (E, cfg.v_dim), "dw_v")
        if cfg.bias_q:
            t = buf(8, (3 * E,))
            if t is not None:
                p = t.data_ptr()
                g.db_q, g.db_k, g.db_v = p, p + 4 * E, p + 8 * E
        buf(9, (E, E), "dw_o")
        if cfg.bias_o:
            buf(10, (E,), "db_o")
        err = L.mha_error()
        ex = _exec(spec.threads)
        L.check(L.mha_layer_backward(spec.layer._ptr, spec.state.ptr, dy.data_ptr(), _byref(g),
                                     _byref(ex), _byref(err)), err)
        return tuple(res)


class _NoGradCtx:
    """Stands in for the autograd context when no gradient is needed."""
    needs_input_grad = (False,) * 11

    @staticmethod
    def mark_non_differentiable(*args) -> None:
        pass


class _StateHandle:
    """Owns a mha_train_state (freed when the autograd graph that holds it is freed)."""
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __del__(self):
        if self.ptr and L.mha_train_state_destroy is not None:
            L.mha_train_state_destroy(self.ptr)
            self.ptr = None


class MultiheadAttention(nn.Module):
    """Drop-in replacement of ``torch.nn.MultiheadAttention`` computed by libmha.

    Same constructor arguments, parameters (``in_proj_weight``, ``in_proj_bias``,
    ``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` when kdim/vdim differ from embed_dim,
    ``out_proj.weight``/``out_proj.bias``), initialisation and ``forward`` signature; forward and
    backward run in mha. float32 CPU tensors (other float dtypes are computed in float32 and cast
    back). ``add_bias_kv`` and ``add_zero_attn`` are not supported (NotImplementedError).
    ``threads`` (an extra keyword) is the number of threads mha uses (0 = all CPUs).
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False,
                 kdim: Optional[int] = None, vdim: Optional[int] = None,
                 batch_first: bool = False, device=None, dtype=None, *, threads: int = 0):
        if add_bias_kv:
            raise NotImplementedError(
                "mha.torch.MultiheadAttention: add_bias_kv=True is not supported (mha has no "
                "learned extra key/value token); use torch.nn.MultiheadAttention")
        if add_zero_attn:
            raise NotImplementedError(
                "mha.torch.MultiheadAttention: add_zero_attn=True is not supported; use "
                "torch.nn.MultiheadAttention")
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be greater than 0, got "
                             f"embed_dim={embed_dim} and num_heads={num_heads} instead")
        if embed_dim % num_heads:
            raise AssertionError("embed_dim must be divisible by num_heads")
        if device is not None and torch.device(device).type != "cpu":
            raise TypeError("mha.torch.MultiheadAttention runs on the CPU only")
        if dtype is not None and dtype != _F32:
            raise TypeError("mha.torch.MultiheadAttention holds float32 parameters only")
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        self.threads = threads
        fk = {"dtype": _F32}
        if not self._qkv_same_embed_dim:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **fk))
            self.k_proj_weight = nn.Parameter(torch.empty((embed_dim, self.kdim), **fk))
            self.v_proj_weight = nn.Parameter(torch.empty((embed_dim, self.vdim), **fk))
            self.register_parameter("in_proj_weight", None)
        else:
            self.in_proj_weight = nn.Parameter(torch.empty((3 * embed_dim, embed_dim), **fk))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **fk))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **fk)
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self._cache_key = None
        self._layer: Optional[_Layer] = None
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # As nn.MultiheadAttention: xavier-uniform projections, zero biases.
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)

    def _params(self):
        ow, ob = self.out_proj.weight, self.out_proj.bias
        if self._qkv_same_embed_dim:
            return (self.in_proj_weight, None, None, None, self.in_proj_bias, ow, ob)
        return (None, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight,
                self.in_proj_bias, ow, ob)

    def _mha_layer(self, params) -> _Layer:
        """The C layer for the current parameter values (rebuilt when any of them changed)."""
        key = tuple((p.data_ptr(), p._version) if p is not None else None for p in params)
        if key != self._cache_key or self._layer is None:
            for p in params:
                if p is not None:
                    _check_cpu_f32("parameter", p)
                    if p.dtype != _F32:
                        raise TypeError("mha.torch.MultiheadAttention: parameters must be float32")
            in_w, q_w, k_w, v_w, in_b, ow, ob = (None if p is None else p.detach().numpy()
                                                 for p in params)
            E = self.embed_dim
            if in_w is not None:
                q_w, k_w, v_w = in_w[:E], in_w[E:2 * E], in_w[2 * E:]
            bq = bk = bv = None
            if in_b is not None:
                bq, bk, bv = in_b[:E], in_b[E:2 * E], in_b[2 * E:]
            # The layer copies the weights (so an in-place optimizer step cannot change a graph
            # that is waiting for its backward); one copy per parameter update.
            self._layer = _Layer(q_w, k_w, v_w, ow, bq, bk, bv, ob, num_heads=self.num_heads)
            self._cache_key = key
        return self._layer

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Optional[Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """As ``nn.MultiheadAttention.forward``: returns (attn_output, attn_weights or None).

        query (L, N, E) — (N, L, E) with batch_first — or unbatched (L, E); key/value
        (S, N, kdim/vdim). key_padding_mask (N, S): True (or nonzero) = padding, ignored; a float
        one is added. attn_mask (L, S) or (N*num_heads, L, S): bool True = not allowed, float
        added. is_causal: top-left causal mask (with attn_mask given, the mask is used, as
        PyTorch does). Weights: (N, L, S) averaged over heads, or (N, num_heads, L, S).
        """
        self_attn = query is key and key is value
        kv_same = key is value
        unbatched = query.dim() == 2
        in_dtype = query.dtype
        for nm, t in (("query", query), ("key", key), ("value", value)):
            _check_cpu_f32(nm, t)
            if not t.is_floating_point():
                raise TypeError(f"mha.torch.MultiheadAttention: {nm} must be a floating-point "
                                f"tensor, got {t.dtype}")
            if t.dim() != query.dim():
                raise AssertionError(f"query, key and value must have the same number of "
                                     f"dimensions, got {query.dim()}, {key.dim()}, {value.dim()}")
        if query.dim() not in (2, 3):
            raise AssertionError(f"query should be unbatched 2D or batched 3D tensor but "
                                 f"received {query.dim()}-D query tensor")

        def prep(t: Tensor) -> Tensor:
            if t.dtype != _F32:
                t = t.to(_F32)
            if unbatched:
                t = t.unsqueeze(0)
            elif not self.batch_first:
                t = t.transpose(0, 1)
            return t.contiguous()

        q = prep(query)
        k = q if self_attn else prep(key)
        v = k if kv_same else prep(value)
        B, n, E = q.shape
        if E != self.embed_dim:
            raise AssertionError(f"was expecting embedding dimension of {self.embed_dim}, but "
                                 f"got {E}")
        m = k.shape[1]
        if k.shape[0] != B or v.shape[:2] != k.shape[:2]:
            raise AssertionError(f"key and value must have the batch and length of each other "
                                 f"and the batch of query; got query {tuple(query.shape)}, key "
                                 f"{tuple(key.shape)}, value {tuple(value.shape)}")
        if k.shape[2] != self.kdim or v.shape[2] != self.vdim:
            raise AssertionError(f"key/value feature sizes {k.shape[2]}/{v.shape[2]} differ from "
                                 f"kdim={self.kdim}/vdim={self.vdim}")
        params = self._params()
        layer = self._mha_layer(params)

        spec = _LayerSpec()
        spec.layer = layer
        spec.threads = self.threads
        spec.need_weights = bool(need_weights)
        spec.average = bool(average_attn_weights)
        spec.packed = self._qkv_same_embed_dim
        spec.E = self.embed_dim
        spec.state = None
        a = L.mha_forward_args()
        a.batch, a.q_len, a.kv_len = B, n, m
        a.query = q.data_ptr()
        keep = [q, k, v]
        if self_attn:
            spec.mode = "self"
            if self.kdim != E or self.vdim != E:
                raise AssertionError("self-attention needs kdim == vdim == embed_dim")
        else:
            a.key = k.data_ptr()
            if kv_same and self.kdim == self.vdim:
                spec.mode = "kv"
            else:
                spec.mode = "cross"
                a.value = v.data_ptr()
        # Masks: PyTorch's conventions translated (docs/PYTHON.md).
        h = self.num_heads
        mk = a.mask
        add = None
        blk = None
        if attn_mask is not None:
            am = _mask_arg("attn_mask", attn_mask)
            if am.dim() == 2:
                if tuple(am.shape) != (n, m):
                    raise RuntimeError(f"The shape of the 2D attn_mask is {tuple(am.shape)}, but "
                                       f"should be {(n, m)}.")
            elif am.dim() == 3:
                if tuple(am.shape) != (B * h, n, m):
                    raise RuntimeError(f"The shape of the 3D attn_mask is {tuple(am.shape)}, but "
                                       f"should be {(B * h, n, m)}.")
                am = am.view(B, h, n, m)
            else:
                raise RuntimeError(f"attn_mask's dimension {am.dim()} is not supported")
            if am.dtype == torch.bool:
                blk = am
            else:
                add = am
        elif is_causal:
            mk.causal = 1
            mk.alignment = L.ALIGN_TOP_LEFT
        if key_padding_mask is not None:
            kp = _mask_arg("key_padding_mask", key_padding_mask)
            if unbatched:
                kp = kp.view(1, -1)
            if tuple(kp.shape) != (B, m):
                raise AssertionError(f"expecting key_padding_mask shape of {(B, m)}, but got "
                                     f"{tuple(kp.shape)}")
            if kp.dtype == torch.bool:
                if blk is None:
                    blk = kp.view(B, 1, 1, m)  # True = padding: a block-polarity mask, no copy
                else:
                    kp = torch.logical_not(kp)  # mha's key padding: nonzero = real token
                    keep.append(kp)
                    _set_mask(mk.key_padding, kp)
            else:
                kp = kp.view(B, 1, 1, m)
                add = kp if add is None else (add + kp).contiguous()
        if blk is not None:
            keep.append(blk)
            _set_mask(mk.bool_mask, blk)
            mk.bool_mask_polarity = L.MASK_BLOCK
        if add is not None:
            keep.append(add)
            _set_mask(mk.additive_mask, add)
        mk.window_left = mk.window_right = -1
        if self.training and self.dropout > 0.0:
            a.dropout.p = self.dropout
            a.dropout.seed = _seed()
            a.dropout.training = 1
        spec.args = a
        spec.keep = keep
        in_w, q_w, k_w, v_w, in_b, o_w, o_b = params
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or any(p is not None and p.requires_grad
                                               for p in params)):
            out, probs = _LayerFunction.apply(spec, q, k, v, in_w, q_w, k_w, v_w, in_b, o_w,
                                              o_b)
        else:  # inference: no autograd node, no training state (saves the Function overhead)
            out, probs = _LayerFunction.forward(_NoGradCtx, spec, q, k, v, in_w, q_w, k_w, v_w,
                                                in_b, o_w, o_b)
        if unbatched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        if in_dtype != _F32:
            out = out.to(in_dtype)
        if not need_weights:
            return out, None
        if unbatched:
            probs = probs.squeeze(0)
        return out, probs


# ------------------------------------------------------------------------------------------------
# The core: F.scaled_dot_product_attention
# ------------------------------------------------------------------------------------------------
class _CoreFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, args: L.mha_attention_args, keep: list, threads: int, q: Tensor,
                k: Tensor, v: Tensor):
        B, h, n, dv = args.batch, args.num_heads, args.q_len, args.v_head_dim
        out = torch.empty((B, h, n, dv), dtype=_F32)
        args.out = out.data_ptr()
        args.out_strides[:] = out.stride()[:3]
        train = any(ctx.needs_input_grad)
        lse = None
        if train:
            _check_backward()
            lse = torch.empty((B, h, n), dtype=_F32)
            args.lse = lse.data_ptr()
        err = L.mha_error()
        ex = _exec(threads)
        L.check(L.mha_attention(_byref(args), _byref(ex), _byref(err)), err)
        if train:
            ctx.args, ctx.keep, ctx.threads = args, keep, threads
            ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        _check_backward()
        q, k, v, out, lse = ctx.saved_tensors  # also checks nothing was modified in place
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        g = L.mha_attention_grads()
        g.dout = dout.data_ptr()
        g.dout_strides[:] = dout.stride()[:3]
        need = ctx.needs_input_grad
        res = [None, None, None, None, None, None]
        for i, t, nm in ((3, q, "dq"), (4, k, "dk"), (5, v, "dv")):
            if need[i]:
                d = torch.empty(t.shape, dtype=_F32)
                res[i] = d
                setattr(g, nm, d.data_ptr())
                getattr(g, nm + "_strides")[:] = d.stride()[:3]
        err = L.mha_error()
        ex = _exec(ctx.threads)
        L.check(L.mha_attention_backward(_byref(ctx.args), _byref(g), _byref(ex), _byref(err)),
                err)
        return tuple(res)


def _to4(t: Tensor, nd: int) -> Tensor:
    if nd == 4:
        return t
    if nd == 3:
        return t.unsqueeze(1)
    if nd == 2:
        return t.unsqueeze(0).unsqueeze(0)
    return t.reshape((-1,) + tuple(t.shape[-3:]))


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False, *, threads: int = 0) -> Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` computed by mha.

    query (N, ..., L, E), key (N, ..., S, E), value (N, ..., S, Ev); the dimension before L/S is
    the heads (key/value may have fewer with ``enable_gqa``). attn_mask broadcasts to
    (N, ..., L, S): bool True = takes part in attention, float = added. ``is_causal``: top-left
    causal (PyTorch's). ``dropout_p`` is applied whenever > 0 (as in PyTorch), seeded from
    torch's generator. Differentiable in query, key and value. float32 CPU tensors (other float
    dtypes are computed in float32 and cast back). Fully masked rows give 0 (PyTorch: NaN or 0).
    """
    for nm, t in (("query", query), ("key", key), ("value", value)):
        _check_cpu_f32(nm, t)
        if not t.is_floating_point():
            raise TypeError(f"mha.torch.scaled_dot_product_attention: {nm} must be floating "
                            f"point, got {t.dtype}")
    nd = query.dim()
    if nd < 2 or key.dim() != nd or value.dim() != nd:
        raise ValueError(f"query, key and value must have the same number (>= 2) of "
                         f"dimensions, got {query.dim()}, {key.dim()}, {value.dim()}")
    if attn_mask is not None and is_causal:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set "
                           "when is_causal=True")
    in_dtype = query.dtype
    lead = tuple(query.shape[:-2])
    q, k, v = (t if t.dtype == _F32 else t.to(_F32) for t in (query, key, value))
    q4, k4, v4 = (_to4(t, nd) for t in (q, k, v))
    q4, k4, v4 = (t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()
                  for t in (q4, k4, v4))
    B, h, n, d = q4.shape
    Bk, g, m, dk = k4.shape
    if Bk != B or v4.shape[0] != B or v4.shape[1] != g or v4.shape[2] != m or dk != d:
        raise RuntimeError(f"scaled_dot_product_attention: shapes do not agree: query "
                           f"{tuple(query.shape)}, key {tuple(key.shape)}, value "
                           f"{tuple(value.shape)}")
    if g != h and not enable_gqa:
        raise RuntimeError(f"scaled_dot_product_attention: query has {h} heads and key/value "
                           f"{g}; pass enable_gqa=True for grouped-query attention")
    if g != h and h % g:
        raise RuntimeError(f"number of heads in key/value ({g}) must divide the number of "
                           f"heads in query ({h})")
    a = L.mha_attention_args()
    a.batch, a.num_heads, a.num_kv_heads, a.q_len, a.kv_len = B, h, g, n, m
    a.head_dim, a.v_head_dim = d, v4.shape[3]
    if scale is not None:
        if scale == 0:
            raise ValueError("mha: scale=0 is not supported (0 means the default 1/sqrt(E))")
        a.scale = float(scale)
    a.q, a.k, a.v = q4.data_ptr(), k4.data_ptr(), v4.data_ptr()
    a.q_strides[:] = q4.stride()[:3]
    a.k_strides[:] = k4.stride()[:3]
    a.v_strides[:] = v4.stride()[:3]
    keep = [q4, k4, v4]
    mk = a.mask
    mk.window_left = mk.window_right = -1
    if is_causal:
        mk.causal = 1
        mk.alignment = L.ALIGN_TOP_LEFT
    if attn_mask is not None:
        am = _mask_arg("attn_mask", attn_mask)
        if am.dim() > nd:
            raise RuntimeError(f"attn_mask has {am.dim()} dimensions, more than query's {nd}")
        if am.dim() > 4 or (nd != 4 and am.dim() > 2):
            am = _to4(am.reshape((1,) * (nd - am.dim()) + tuple(am.shape)).expand(
                lead + (n, m)), nd).contiguous()
        keep.append(am)
        if am.dtype == torch.bool:
            _set_mask(mk.bool_mask, am)
            mk.bool_mask_polarity = L.MASK_ATTEND
        else:
            _set_mask(mk.additive_mask, am)
    if dropout_p > 0.0:
        if not dropout_p < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
        a.dropout.p = dropout_p
        a.dropout.seed = _seed()
        a.dropout.training = 1
    out = _CoreFunction.apply(a, keep, threads, q4, k4, v4)
    if nd != 4:
        out = out.reshape(lead + (n, v4.shape[3]))
    if in_dtype != _F32:
        out = out.to(in_dtype)
    return out
