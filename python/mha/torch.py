# SPDX-License-Identifier: MIT
"""PyTorch drop-ins running forward and backward through libmha (float32, bfloat16 and float16
CPU tensors).

- :class:`MultiheadAttention`: a ``torch.nn.Module`` with ``nn.MultiheadAttention``'s constructor
  arguments, parameter names (so its ``state_dict`` loads both ways) and ``forward`` signature;
  PyTorch's conventions are translated (bool ``attn_mask``/``key_padding_mask`` True = masked out,
  float masks additive, ``is_causal`` = top-left causal, ``batch_first``).
- :func:`scaled_dot_product_attention`: ``F.scaled_dot_product_attention``'s signature.
- :func:`ring_attention`: ring attention over MPI (an mpi4py communicator), each process holding
  its shard of a long sequence (docs/distributed.md).

Both are ``torch.autograd.Function`` s whose backward calls mha's backward (mha_layer_backward,
mha_attention_backward), so a model can be trained with them. Under torch.compile / torch.export
they trace to the operator torch.ops.mha.attention (_torch_ops.py; docs/PYTHON.md) instead, with
no graph break. This module imports torch; the
rest of the package does not (``import mha`` works without torch).

Differences from PyTorch (docs/PYTHON.md): fully masked query rows give 0 (PyTorch: NaN); the
returned attention weights are the probabilities before dropout and carry no gradient; dropout
uses mha's counter-based RNG seeded from torch's generator (reproducible with
``torch.manual_seed``, but not the same random mask as PyTorch's); gradients do not flow into
masks (a float mask that requires grad raises ValueError while grad mode is on); the gradients
are not differentiable again (a double backward, e.g. a gradient penalty through
``torch.autograd.grad(..., create_graph=True)``, raises RuntimeError instead of dropping
the second-order terms); ``add_bias_kv`` and ``add_zero_attn`` raise NotImplementedError.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from . import _api
from . import _lib as L
from . import _marshal as M
from . import _mask_rule
from . import _torch_ops  # noqa: F401  (registers torch.ops.mha.attention[_backward])
from ._api import MultiheadAttention as _Layer
from ._lib import MhaError

__all__ = ["MultiheadAttention", "scaled_dot_product_attention", "MhaError"]

_F32 = torch.float32
_STRIDED = torch.strided
_fast = L.fast  # the compiled hot path (inference forward), or None: ctypes for everything
_MASK_CODES = {torch.bool: L.DTYPE_BOOL, torch.uint8: L.DTYPE_U8, torch.int32: L.DTYPE_I32,
               torch.int64: L.DTYPE_I64, torch.float32: L.DTYPE_F32}
_AUTO = L.IMPLS["auto"]


_empty = _torch_ops.empty


def _set_mask(t: L.mha_mask_tensor, m: Tensor) -> None:
    """Points a mha_mask_tensor at a contiguous CPU tensor (bool/uint8/int32/int64/float32)."""
    M.set_mask_tensor(t, m.data_ptr(), _MASK_CODES[m.dtype], m.shape)


def _seed() -> int:
    return int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64).item())


def _dropout_p(p: float, name: str) -> float:
    """p when it is a dropout probability mha takes, [0, 1); ValueError otherwise (a negative or
    NaN p would silently mean no dropout)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {p}")
    return p


def _seed_tensor() -> Tensor:
    """A dropout seed drawn from torch's generator, as a tensor: traced, it stays a run-time
    draw in a compiled graph (an int would be baked in as a constant)."""
    return torch.randint(0, 2 ** 62, (1,), dtype=torch.int64)


def _check_cpu_f32(name: str, t: Tensor) -> None:
    """TypeError unless t is a dense (strided) CPU tensor: mha reads CPU memory through a data
    pointer and strides (a sparse, mkldnn or meta tensor has none it could read)."""
    if not t.is_cpu:
        raise TypeError(f"mha.torch: {name} must be a CPU tensor (mha runs on the CPU), got "
                        f"device {t.device}")
    if t.layout is not _STRIDED:
        raise TypeError(f"mha.torch: {name} must be a dense (strided) tensor, got layout "
                        f"{t.layout}")


def _mask_arg(name: str, m: Tensor) -> Tensor:
    _check_cpu_f32(name, m)
    if m.dtype == torch.bool:
        return m.contiguous()
    if m.is_floating_point():
        if m.requires_grad and torch.is_grad_enabled():
            # (no gradient flows into masks: a learned bias passed as a mask, Swin's relative
            # positions, would silently stop training; until session 48 it was detached)
            raise ValueError(f"mha.torch: {name} requires grad, but mha computes no gradient for "
                             f"masks; detach() it, or use torch's attention for a learned bias")
        # (no detach unless needed: a mask's identity is what _mask_rule caches its rule under)
        return (m.detach() if m.requires_grad else m).to(_F32).contiguous()
    raise TypeError(f"mha.torch: only bool and floating types of {name} are supported, got "
                    f"{m.dtype}")


# ------------------------------------------------------------------------------------------------
# The layer: nn.MultiheadAttention
# ------------------------------------------------------------------------------------------------
class _LayerSpec:
    """Everything of one layer call that is not a differentiable tensor."""
    __slots__ = ("layer", "args", "keep", "threads", "out_shape", "probs_shape", "state", "fields",
                 "shapes", "dtypes", "n_inputs", "out_dtype")


def _layer_forward(layer_ptr: int, a: L.mha_forward_args, threads: int, out_shape,
                   probs_shape, spec: Optional[_LayerSpec] = None, out_dtype=_F32):
    """Allocates the outputs (out in out_dtype, a.out_dtype's) and runs mha_layer_forward, or
    with `spec` mha_layer_forward_train (the state goes to spec.state)."""
    out = _empty(out_shape, out_dtype)
    a.out = out.data_ptr()
    probs = None
    if probs_shape is not None:
        probs = _empty(probs_shape)
        a.probs = probs.data_ptr()
    st = M.layer_forward(layer_ptr, a, M.exec_struct(_AUTO, threads), spec is not None)
    if spec is not None:
        spec.state = _StateHandle(st)
    return out, probs


# mha_layer_grads fields of each parameter, in the order of MultiheadAttention._params(); a
# triple is a packed parameter holding the q, k and v parts one after the other: in_proj_weight's
# thirds, in_proj_bias's [b_q; b_k; b_v] (thirds, except from_pretrained's GQA: h*d, g*d, g*d_v).
_PARAM_GRAD_FIELDS = (("dw_q", "dw_k", "dw_v"), "dw_q", "dw_k", "dw_v", ("db_q", "db_k", "db_v"),
                      "dw_o", "db_o")


def _qk_norm_traced(qn, x: Tensor, w: Optional[Tensor]) -> Tensor:
    """QK-norm over x's last axis in torch operations (docs/SEMANTICS.md "QK-norm"): x / sqrt(
    mean(x^2) + eps) times w, 1 + w (unit_offset) or 1 (w None); the sum of squares in float64
    as libmha's."""
    ms = x.to(torch.float64).square().mean(-1, keepdim=True)
    y = x * torch.rsqrt(ms + qn.eps).to(x.dtype)
    if w is None:
        return y
    w = w.to(x.dtype)
    return y * (1.0 + w if qn.unit_offset else w)


class _LayerFunction(torch.autograd.Function):
    """apply(spec, *tensors): the distinct differentiable inputs only (query; key and value when
    they are other tensors; the parameters that exist), whose mha_layer_grads fields are
    spec.fields: torch's apply costs about a microsecond per argument, None ones included."""

    @staticmethod
    def forward(ctx, spec: _LayerSpec, *tensors: Tensor):
        train = any(ctx.needs_input_grad)
        out, probs = _layer_forward(spec.layer._ptr, spec.args, spec.threads, spec.out_shape,
                                    spec.probs_shape, spec if train else None, spec.out_dtype)
        if train:
            ctx.spec = spec
        if probs is None:  # need_weights=False: one output, no empty weights tensor to make
            return out
        return out, probs

    @staticmethod
    @once_differentiable  # (mha's backward is not differentiable: a double backward raises)
    def backward(ctx, dy: Tensor, *dprobs: Optional[Tensor]):
        spec = ctx.spec
        need = ctx.needs_input_grad
        if not dy.is_contiguous():
            dy = dy.contiguous()
        g = L.mha_layer_grads()
        # The weights' gradient (a loss that reads them: attention distillation), in their
        # layout; zeros when they were returned but not used (skipped: they cost one more pass).
        gp = dprobs[0] if dprobs and dprobs[0] is not None and bool(dprobs[0].any()) else None
        if gp is not None:
            gp = gp.to(_F32).contiguous()
            g.d_probs = gp.data_ptr()
        res = [None] * len(need)
        shapes = spec.shapes
        # Gradients have the shapes of the tensors given to apply; for query/key/value their
        # memory is the [B, L, features] order mha writes.
        # Input gradients are written in the inputs' dtype (x_dtype); parameter gradients are
        # float32 in C (the master weights' dtype) and converted to a half parameter's dtype.
        dtypes = spec.dtypes
        for i, f in enumerate(spec.fields, 1):
            if need[i]:
                t = _empty(shapes[i - 1], dtypes[i - 1] if i <= spec.n_inputs else _F32)
                res[i] = t
                p = t.data_ptr()
                if type(f) is str:
                    setattr(g, f, p)
                else:  # in_proj_weight / in_proj_bias: q, k, v parts at element offsets
                    names, (k_at, v_at) = f
                    setattr(g, names[0], p)
                    setattr(g, names[1], p + 4 * k_at)
                    setattr(g, names[2], p + 4 * v_at)
        if dy.dtype is not spec.out_dtype:  # (mha reads dy in the forward output's dtype)
            dy = dy.to(spec.out_dtype)
        M.call(L.mha_layer_backward, spec.layer._ptr, spec.state.ptr, dy.data_ptr(), g,
               M.exec_struct(_AUTO, spec.threads))
        for i in range(spec.n_inputs + 1, len(res)):
            if res[i] is not None and dtypes[i - 1] is not _F32:
                res[i] = res[i].to(dtypes[i - 1])
        return tuple(res)


def _as_ble(t: Tensor, unbatched: bool, batch_first: bool, dtype=_F32):
    """(tensor, B, L, features): a tensor of `dtype` (a storage dtype: float32, bfloat16,
    float16) whose memory is C-order [B, L, features], the layout mha reads. No copy and no view
    op (each costs microseconds in torch) when the input is already of that dtype and laid out
    so: batch_first or unbatched contiguous inputs, and (L, 1, E) inputs (one sequence,
    batch_first=False). Otherwise (L, N, E) is transposed and copied."""
    if t.dtype is not dtype:
        t = t.to(dtype)
    if unbatched:
        n, e = t.shape
        b = 1
    elif batch_first:
        b, n, e = t.shape
    else:
        n, b, e = t.shape
        if b != 1:
            return t.transpose(0, 1).contiguous(), b, n, e
    return t.contiguous(), b, n, e


_STORAGE = _torch_ops._STORAGE  # torch dtype -> mha_dtype: float32, bfloat16, float16


def _autocast_dtype() -> Optional[torch.dtype]:
    """torch.autocast('cpu')'s dtype when it is on (bfloat16 or float16), else None."""
    if torch.is_autocast_enabled("cpu"):
        dt = torch.get_autocast_dtype("cpu")
        if dt in _STORAGE and dt is not _F32:
            return dt
    return None


def _input_dtype(ts, autocast: Optional[torch.dtype]) -> torch.dtype:
    """The storage dtype the layer reads query, key and value in (mha_forward_args.x_dtype; the
    output is written in it too): under autocast its dtype if they are float32/bfloat16/float16
    (cast to it, as torch's autocast casts a linear's input; float64 stays), else their common
    dtype when it is a storage dtype, else float32 (all converted: widening loses nothing)."""
    if autocast is not None and all(t.dtype in _STORAGE for t in ts):
        return autocast
    dt = ts[0].dtype
    if dt in _STORAGE and all(t.dtype is dt for t in ts):
        return dt
    return _F32


def _weight_dtype(params, autocast: Optional[torch.dtype]) -> torch.dtype:
    """The dtype the C layer keeps the weights in (mha_config.weight_dtype): under autocast its
    dtype (torch's autocast runs a linear on the weights cast to it), else the parameters' own,
    which must be one storage dtype (TypeError otherwise)."""
    if autocast is not None:
        return autocast
    dt = None
    for p in params:
        if p is not None:
            if dt is None:
                dt = p.dtype
            elif p.dtype is not dt:
                raise TypeError(f"mha.torch.MultiheadAttention: parameters must share one dtype, "
                                f"got {dt} and {p.dtype}")
    if dt not in _STORAGE:
        raise TypeError(f"mha.torch.MultiheadAttention: parameters must be float32, bfloat16 or "
                        f"float16, got {dt}")
    return dt


def _weight_array(t: Tensor):
    """A parameter (detached, already in the layer's weight dtype) as a NumPy array of its bits:
    NumPy has no bfloat16, so a bfloat16 tensor is viewed as int16 (the layer is told the
    dtype); no copy for a contiguous tensor."""
    if t.dtype is torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy()
    return t.contiguous().numpy()


class _StateHandle:
    """Owns a mha_train_state (freed when the autograd graph that holds it is freed)."""
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __del__(self):
        if self.ptr:
            L.mha_train_state_destroy(self.ptr)
            self.ptr = None


def _translate_masks(mk: L.mha_masking, keep: list, attn_mask: Optional[Tensor],
                     key_padding_mask: Optional[Tensor], is_causal: bool, B: int, h: int, n: int,
                     m: int, unbatched: bool, alibi: bool = False) -> None:
    """nn.MultiheadAttention's masks in mha's terms (docs/PYTHON.md); keeps what it points at.
    An attn_mask that equals a built-in rule (causal, sliding window, key padding: _mask_rule)
    runs as that rule when the results are exactly the tensor's."""
    add = None
    blk = None
    ruled = False  # attn_mask replaced by its rule (mk's causal/window/key padding)
    rule = None
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
        additive = am.dtype != torch.bool
        rule = _mask_rule.lookup(attn_mask, am, additive, L.MASK_BLOCK, B, h, n, m)
        # No rule of the call's own (is_causal is ignored with a mask; the model's mask is not
        # applied); the default alignment (bottom-right, delta m - n) places ALiBi.
        ruled = _mask_rule.substitute(mk, keep, rule, additive, B, n, m, m - n, None, None, alibi)
        if ruled:
            pass
        elif am.dtype == torch.bool:
            blk = am
        else:
            add = am
    elif is_causal:
        M.causal_top_left(mk)
    if key_padding_mask is not None:
        kp = _mask_arg("key_padding_mask", key_padding_mask)
        if unbatched:
            kp = kp.view(1, -1)
        if tuple(kp.shape) != (B, m):
            raise AssertionError(f"expecting key_padding_mask shape of {(B, m)}, but got "
                                 f"{tuple(kp.shape)}")
        if kp.dtype == torch.bool:
            if blk is None and not ruled:
                blk = kp.view(B, 1, 1, m)  # True = padding: a block-polarity mask, no copy
            else:
                kp = torch.logical_not(kp)  # mha's key padding: nonzero = real token
                if ruled and rule.keys is not None:  # the rule's keys AND these
                    kp = torch.logical_and(kp, rule.keys.bool())
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


def _temperature_traced(temperature: Tuple[float, float], n: int) -> Tensor:
    """Temperature tuning's factors tau(p), p = 0 .. n-1 (docs/SEMANTICS.md), as libmha forms
    them: (float32(p) + 1) / float32(floor_scale) and its floor in float32, then
    ln(k + 1) attn_scale + 1 in float64, rounded to float32."""
    floor_scale, attn_scale = temperature
    p = torch.arange(n, dtype=_F32)
    k = torch.floor((p + 1.0) / torch.tensor(floor_scale, dtype=_F32))
    return (torch.log1p(k.to(torch.float64)) * attn_scale + 1.0).to(_F32)


def _model_mask(mk: L.mha_masking, causal: bool, window: Optional[tuple],
                chunk_size: int = 0) -> None:
    """A from_pretrained layer's own mask: causal (bottom-right), its sliding window and its
    chunk size (Llama 4's chunked attention)."""
    mk.chunk_size = chunk_size
    if causal:
        mk.causal = 1
        mk.alignment = L.ALIGN_BOTTOM_RIGHT
    if window is not None:
        mk.use_window = 1
        mk.window_left, mk.window_right = window


def _qkv_offsets(packed: Tensor, params) -> Tuple[int, int]:
    """Element offsets of the k and v parts of a packed q/k/v parameter (see _PARAM_GRAD_FIELDS)."""
    q_w, k_w = params[1], params[2]
    if packed.dim() == 1 and q_w is not None:
        return q_w.shape[0], q_w.shape[0] + k_w.shape[0]
    third = packed.numel() // 3
    return third, 2 * third


def _traced_masks(attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], B: int,
                  h: int, n: int, m: int) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """nn.MultiheadAttention's attn_mask and key_padding_mask as the operator's (attend,
    additive): bool masks say True = not allowed there, True = takes part here."""
    attend = additive = None
    for nm, t in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask)):
        if t is not None and t.dtype != torch.bool and not t.is_floating_point():
            raise TypeError(f"mha.torch: only bool and floating types of {nm} are supported, "
                            f"got {t.dtype}")  # (as the eager path: _mask_arg)
    if attn_mask is not None:
        am = attn_mask if attn_mask.dim() == 2 else attn_mask.view(B, h, n, m)
        if am.dtype == torch.bool:
            attend = torch.logical_not(am)
        else:
            additive = am.to(_F32)
    if key_padding_mask is not None:
        kp = key_padding_mask.reshape(B, 1, 1, m)
        if kp.dtype == torch.bool:
            real = torch.logical_not(kp)
            attend = real if attend is None else torch.logical_and(attend, real)
        else:
            kp = kp.to(_F32)
            additive = kp if additive is None else additive + kp
    return attend, additive


def _config_attention_dropout(path: str) -> float:
    """The attention dropout probability of a model directory's config.json (transformers'
    ``attention_dropout``; 0 when absent or null). The C loader has read the file already; a
    value outside [0, 1) raises ValueError naming the field."""
    import json
    import os
    cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    with open(cfg_path) as f:
        p = json.load(f).get("attention_dropout")
    if p is None:
        return 0.0
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"{cfg_path}: attention_dropout must be a number in [0, 1), got {p!r}")
    return float(p)


_STEPS = _torch_ops.OPTIMIZER_STEPS
# The buffers a from_pretrained layer holds (its options; not trained): part of the cache key.
_LAYER_BUFFERS = ("sinks", "q_norm", "k_norm")


def _param_key(params) -> tuple:
    """What identifies the parameter values: (data_ptr, version counter) of each parameter, and
    the optimizer steps taken (_torch_ops.OPTIMIZER_STEPS: fused steps bump no version)."""
    in_w, q_w, _, _, in_b, ow, ob = params
    if q_w is None and in_w is not None and in_b is not None and ob is not None:
        # The usual layer (packed in_proj, biases), spelled out: half the cost of the loop.
        return (in_w.data_ptr(), in_w._version, in_b.data_ptr(), in_b._version,
                ow.data_ptr(), ow._version, ob.data_ptr(), ob._version, _STEPS[0])
    return tuple([None if p is None else (p.data_ptr(), p._version) for p in params]) + (
        _STEPS[0],)


class MultiheadAttention(nn.Module):
    """Drop-in replacement of ``torch.nn.MultiheadAttention`` computed by libmha.

    Same constructor arguments, parameters (``in_proj_weight``, ``in_proj_bias``,
    ``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` when kdim/vdim differ from embed_dim,
    ``out_proj.weight``/``out_proj.bias``), initialisation and ``forward`` signature; forward and
    backward run in mha. Parameters in float32, bfloat16 or float16 (``dtype=`` or ``.to()``),
    kept by the C layer in that dtype; inputs in float32, bfloat16 or float16 are read as they
    are (others converted to float32), the output in the input's dtype; under
    ``torch.autocast('cpu')`` inputs and weights are taken in the autocast dtype and the output
    is in it, as torch's module gives; arithmetic is float32 (docs/PYTHON.md, "Half precision").
    ``add_bias_kv`` and ``add_zero_attn`` are not supported (NotImplementedError).
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
        if dtype is not None and dtype not in _STORAGE:
            raise TypeError(f"mha.torch.MultiheadAttention holds float32, bfloat16 or float16 "
                            f"parameters, got dtype={dtype}")
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = _dropout_p(dropout, "dropout")
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        self.threads = threads
        fk = {"dtype": dtype or _F32}
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

    # Layer options beyond nn.MultiheadAttention's (from_pretrained: GQA, RoPE, scale, soft-cap,
    # sinks), and the model's (causal, window) applied when forward() gets no mask.
    _options: dict = {}
    _model_mask: Optional[tuple] = None
    model_info: Optional[dict] = None

    @classmethod
    def from_pretrained(cls, path: str, layer: int = 0, *, batch_first: bool = False,
                        threads: int = 0) -> "MultiheadAttention":
        """Layer ``layer`` of a Hugging Face model directory, as this module (see
        :meth:`mha.MultiheadAttention.from_pretrained` and docs/MODELS.md).

        The projections become the parameters of nn.MultiheadAttention's separate-weight form:
        ``q_proj_weight`` [h*d, E], ``k_proj_weight`` / ``v_proj_weight`` [g*d, E] (GQA keeps its
        g kv heads), ``in_proj_bias`` = [b_q; b_k; b_v] and ``out_proj`` (missing biases of a
        partly biased model are zeros, which changes nothing). RoPE, scale, soft-cap and the
        sinks (a buffer, not trained) are fixed options. Without ``attn_mask`` and
        ``is_causal``, forward() applies the model's own mask: causal (bottom-right) and its
        sliding window, if any. config.json's ``attention_dropout`` (0 if absent) is the
        module's ``dropout``, applied in training as the model's attention does it.
        """
        self = cls._from_layer(_Layer.from_pretrained(path, layer), batch_first, threads)
        self.dropout = _config_attention_dropout(path)
        return self

    @classmethod
    def from_gguf(cls, path: str, layer: int = 0, *, batch_first: bool = False,
                  threads: int = 0) -> "MultiheadAttention":
        """Layer ``layer`` (0-based) of a llama.cpp GGUF file (general.architecture llama,
        mistral, qwen2, qwen3 or phi3), as this module: read by :meth:`mha.MultiheadAttention.from_gguf`
        (F32 / F16 / BF16 tensors; Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, Q2_K..Q6_K dequantised to
        float32; llama's permuted Q/K rows put back; docs/MODELS.md "GGUF files"), then the parameters, fixed options and default mask
        of :meth:`from_pretrained`. The parameters are float32 (``.to(torch.bfloat16)`` etc. as
        for any module). Unsupported tensor types or options raise MhaError naming them."""
        return cls._from_layer(_Layer.from_gguf(path, layer), batch_first, threads)

    @classmethod
    def _from_layer(cls, src: _Layer, batch_first: bool, threads: int) -> "MultiheadAttention":
        c, w = src.config, src.weights
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        E = c.q_dim
        self.embed_dim, self.kdim, self.vdim = E, c.k_dim, c.v_dim
        self._qkv_same_embed_dim = False
        self.num_heads, self.dropout, self.batch_first = c.num_heads, 0.0, batch_first
        self.head_dim, self.threads = c.head_dim, threads
        for nm in ("q", "k", "v"):
            setattr(self, nm + "_proj_weight", nn.Parameter(torch.from_numpy(w["w_" + nm])))
        self.register_parameter("in_proj_weight", None)
        biased = any(k.startswith("b_") for k in w)
        rows = {"b_q": w["w_q"].shape[0], "b_k": w["w_k"].shape[0], "b_v": w["w_v"].shape[0],
                "b_o": c.out_dim}
        b = {k: torch.from_numpy(w[k]) if k in w else torch.zeros(n, dtype=_F32)
             for k, n in rows.items()}
        if biased:
            self.in_proj_bias = nn.Parameter(torch.cat([b["b_q"], b["b_k"], b["b_v"]]))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(w["w_o"].shape[1], c.out_dim, bias=biased, dtype=_F32)
        with torch.no_grad():
            self.out_proj.weight.copy_(torch.from_numpy(w["w_o"]))
            if biased:
                self.out_proj.bias.copy_(b["b_o"])
        if "sinks" in w:
            self.register_buffer("sinks", torch.from_numpy(w["sinks"]))
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self._cache_key = None
        self._layer = None
        self._options = dict(num_kv_heads=c.num_kv_heads, scale=c.scale, softcap=c.softcap,
                             alibi=c.alibi, rope=c.rope, sinks=w.get("sinks"))
        if c.output_gate:  # Qwen3-Next: q_proj_weight's rows are the query's, then the gate's
            self._options["output_gate"] = True
        if c.qk_norm is not None:  # QK-norm: its weights are buffers (not trained), as sinks
            self._options.update(qk_norm=c.qk_norm, q_norm=w.get("q_norm"),
                                 k_norm=w.get("k_norm"))
            for nm in ("q_norm", "k_norm"):
                if nm in w:
                    self.register_buffer(nm, torch.from_numpy(w[nm]))
        self._model_mask = (src._causal, src._window, src._chunk_size)
        if c.temperature is not None:  # Llama 4's NoPE layers
            self._options["temperature"] = c.temperature
        self.model_info = src.model_info
        if c.rope is not None:  # for the traced forward (the eager one runs libmha's RoPE)
            r = dataclasses.asdict(c.rope)
            if c.rope.scaling == "dynamic":  # its frequencies unscaled, up to original_max
                r.update(scaling=None, factor=None, original_max_position=None)
            orig = int(c.rope.original_max_position or 0)
            length = orig if c.rope.scaling == "longrope" else None  # the short list's
            freqs, factor = _api.rope_frequencies(c.head_dim, length=length, **r)
            self._rope_traced_freqs = (c.rope.style, torch.from_numpy(freqs), factor)
            if c.rope.scaling == "longrope":  # the long list's, for calls beyond orig
                freqs, factor = _api.rope_frequencies(c.head_dim, length=orig + 1, **r)
                self._rope_traced_long = (torch.from_numpy(freqs), factor)
        return self

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
        # The parameter dicts directly (nn.Module.__getattr__ costs ~0.5 us per name); anything
        # unusual (a parametrized out_proj, a deleted parameter) takes the attribute path.
        try:
            P = self._parameters
            op = self._modules["out_proj"]._parameters
            ow, ob = op["weight"], op["bias"]
            if self._qkv_same_embed_dim:
                return (P["in_proj_weight"], None, None, None, P["in_proj_bias"], ow, ob)
            return (None, P["q_proj_weight"], P["k_proj_weight"], P["v_proj_weight"],
                    P["in_proj_bias"], ow, ob)
        except KeyError:
            pass
        ow, ob = self.out_proj.weight, self.out_proj.bias
        if self._qkv_same_embed_dim:
            return (self.in_proj_weight, None, None, None, self.in_proj_bias, ow, ob)
        return (None, self.q_proj_weight, self.k_proj_weight, self.v_proj_weight,
                self.in_proj_bias, ow, ob)

    def _mha_layer(self, params, wdt: Optional[torch.dtype] = None) -> _Layer:
        """The C layer for the current parameter values, its weights in wdt (default: the
        parameters' dtype; _weight_dtype), rebuilt when any of them or wdt changed."""
        if wdt is None:
            wdt = _weight_dtype(params, None)
        bufs = [(nm, b) for nm, b in self._buffers.items() if nm in _LAYER_BUFFERS and
                b is not None]
        key = _param_key(params) + (wdt,) + tuple((b.data_ptr(), b._version) for _, b in bufs)
        if "parametrizations" in self._modules or "parametrizations" in getattr(
                self._modules.get("out_proj"), "_modules", {}):
            # A parametrized weight is a new tensor at every access (often at the address and
            # version of the last one, freed), so nothing identifies its value: rebuilt each call.
            key += (object(),)
        if key != self._cache_key or self._layer is None:
            for p in params:
                if p is not None:
                    _check_cpu_f32("parameter", p)
            in_w, q_w, k_w, v_w, in_b, ow, ob = (None if p is None else
                                                 _weight_array(p.detach().to(wdt))
                                                 for p in params)
            E = self.embed_dim
            if in_w is not None:
                q_w, k_w, v_w = in_w[:E], in_w[E:2 * E], in_w[2 * E:]
            bq = bk = bv = None
            if in_b is not None:  # rows of q, k, v (E each, unless from_pretrained's GQA)
                rq, rk = q_w.shape[0], k_w.shape[0]
                bq, bk, bv = in_b[:rq], in_b[rq:rq + rk], in_b[rq + rk:]
            # The layer copies the weights (so an in-place optimizer step cannot change a graph
            # that is waiting for its backward); one copy per parameter update.
            # The sinks and QK-norm weights as the buffers hold them now (edited in place or
            # replaced: the key above sees it), in the weights' dtype.
            opts = dict(self._options, **{nm: _weight_array(b.detach().to(wdt)) for nm, b in bufs})
            self._layer = _Layer(q_w, k_w, v_w, ow, bq, bk, bv, ob, num_heads=self.num_heads,
                                 _weight_dtype=_STORAGE[wdt], **opts)
            self._cache_key = key
        return self._layer

    def _forward_fast(self, x: Tensor, need_weights: bool, average: bool):
        """Self-attention without masks or dropout, in inference (no gradient wanted), on a
        contiguous CPU input (float32, bfloat16 or float16, outside autocast: the output in its
        dtype) whose memory is mha's [B, n, E] order (batch_first, unbatched,
        or (L, 1, E)): one compiled call (mha._fastcall), no ctypes struct, the output made with
        empty_like (mha writes it in the input's layout). Returns None for anything else: the
        general path handles it.

        Every microsecond counts here: the module's plain attributes are read from its __dict__
        (``self.name`` costs ~70 ns on an nn.Module, whose __getattr__ defeats CPython's attribute
        cache), and the usual layer's cache key is spelled out (as in _param_key)."""
        d = self.__dict__
        if ((d["training"] and d["dropout"] != 0.0) or not d["_qkv_same_embed_dim"]
                or x.dtype not in _STORAGE or not x.is_cpu or x.layout is not _STRIDED
                or not x.is_contiguous() or torch.is_autocast_enabled("cpu")):
            return None
        shape = x.shape
        nd = len(shape)
        if nd == 3:
            if d["batch_first"]:
                B, n, E = shape
            else:
                n, B, E = shape
                if B != 1:
                    return None
        elif nd == 2:
            n, E = shape
            B = 1
        else:
            return None
        if E != d["embed_dim"]:
            return None
        try:
            P = d["_parameters"]
            op = d["_modules"]["out_proj"]._parameters
            in_w, in_b, ow, ob = P["in_proj_weight"], P["in_proj_bias"], op["weight"], op["bias"]
        except KeyError:  # a parametrized out_proj, a deleted parameter: the general path
            return None
        if in_w is None or ow is None:
            return None
        if torch.is_grad_enabled() and (x.requires_grad or in_w.requires_grad or any(
                p is not None and p.requires_grad for p in (in_b, ow, ob))):
            return None
        layer = d["_layer"]
        if in_b is not None and ob is not None:  # (as _param_key + the weights' dtype)
            key = (in_w.data_ptr(), in_w._version, in_b.data_ptr(), in_b._version,
                   ow.data_ptr(), ow._version, ob.data_ptr(), ob._version, _STEPS[0],
                   in_w.dtype)
        else:
            key = None
        if layer is None or key is None or key != d["_cache_key"]:
            layer = self._mha_layer(self._params())
        out = torch.empty_like(x)
        probs = None
        if need_weights:
            h = d["num_heads"]
            if average:
                probs = _empty((n, n) if nd == 2 else (B, n, n))
            else:
                probs = _empty((h, n, n) if nd == 2 else (B, h, n, n))
        _fast.layer_call(layer._ptr, B, n, x.data_ptr(), out.data_ptr(),
                         None if probs is None else probs.data_ptr(), average, d["threads"],
                         M.pool_for(d["threads"]), M.block_cache_allocator(), _STORAGE[x.dtype])
        if probs is not None and x.dtype is not _F32:
            probs = probs.to(x.dtype)  # (torch's weights have the computation's dtype)
        return out, probs

    def _forward_traced(self, query: Tensor, key: Tensor, value: Tensor,
                        key_padding_mask: Optional[Tensor], need_weights: bool,
                        attn_mask: Optional[Tensor], average: bool,
                        is_causal: bool) -> Tuple[Tensor, Optional[Tensor]]:
        """The forward under torch.compile / torch.export, in traceable operations only: the
        projections are torch's linear ops (differentiated by torch's autograd) and attention is
        the operator torch.ops.mha.attention (mha's forward, its backward registered as the
        autograd formula). Eager calls run the whole layer in libmha (mha_layer_forward), whose
        C layer object and training state cannot enter a traced graph. Same results within the
        layer tolerance (the GEMMs differ), same masks, weights and dropout semantics.

        A from_pretrained layer traces the same way, with its options: GQA (the operator reads
        g kv heads), RoPE in torch ops (the frequencies and cos/sin factor are libmha's own,
        mha_rope_frequencies; angles in float64 as the C code computes them), and scale,
        soft-cap, sinks and the model's causal / sliding-window mask as operator arguments."""
        h, bf, opts = self.num_heads, self.batch_first, self._options
        for nm, t in (("query", query), ("key", key), ("value", value)):
            if not t.is_floating_point():  # (as the eager path; .to(float32) would accept it)
                raise TypeError(f"mha.torch.MultiheadAttention: {nm} must be a floating-point "
                                f"tensor, got {t.dtype}")
        unbatched = query.dim() == 2
        in_dtype = query.dtype
        autocast = _autocast_dtype()
        # The eager path's dtypes (forward): under autocast torch's linear ops cast inputs and
        # weights to the autocast dtype and the operator reads them so; otherwise float32
        # arithmetic on the widened inputs and weights (the eager layer's: its GEMMs widen half
        # operands), the output rounded once to the input's dtype.
        xdt = _input_dtype((query, key, value), autocast)
        res_dtype = xdt if (autocast is not None and xdt is autocast) else in_dtype

        def ble(t: Tensor) -> Tensor:  # [B, L, features] float32
            t = t.to(_F32)
            return t.unsqueeze(0) if unbatched else (t if bf else t.transpose(0, 1))

        q, k, v = ble(query), ble(key), ble(value)
        B, n, m = q.shape[0], q.shape[1], k.shape[1]
        in_w, q_w, k_w, v_w, in_b, ow, ob = (
            p if p is None or autocast is not None or p.dtype is _F32 else p.to(_F32)
            for p in self._params())
        if in_w is not None:
            q_w, k_w, v_w = in_w.chunk(3)
        bq = bk = bv = None
        if in_b is not None:  # rows of q, k, v (E each, unless from_pretrained's GQA)
            rq, rk = q_w.shape[0], k_w.shape[0]
            bq, bk, bv = in_b[:rq], in_b[rq:rq + rk], in_b[rq + rk:]
        g = opts.get("num_kv_heads") or h

        qn = opts.get("qk_norm")

        def heads(x: Tensor, w: Tensor, b: Optional[Tensor], nh: int,
                  norm: Optional[str] = None) -> Tensor:  # [B, nh, L, d]
            y = torch.nn.functional.linear(x, w, b)
            if norm is not None and qn.kind == "rms_all":  # over the whole projection
                y = _qk_norm_traced(qn, y, self._buffers.get(norm))
            y = y.view(y.shape[0], y.shape[1], nh, w.shape[0] // nh).transpose(1, 2)
            if norm is not None and qn.kind == "rms_head":  # per head, before RoPE
                y = _qk_norm_traced(qn, y, self._buffers.get(norm))
            return y

        gate = None
        if opts.get("output_gate"):  # the gate's rows of w_q (and b_q) after the query's
            hd = h * self.head_dim
            gate = torch.nn.functional.linear(q, q_w[hd:], None if bq is None else bq[hd:])
            q_w, bq = q_w[:hd], None if bq is None else bq[:hd]
        norms = ("q_norm", "k_norm") if qn is not None else (None, None)
        qh, kh = heads(q, q_w, bq, h, norms[0]), heads(k, k_w, bk, g, norms[1])
        vh = heads(v, v_w, bv, g)
        if opts.get("rope") is not None:
            qh, kh = self._rope_traced(qh, max(n, m)), self._rope_traced(kh, max(n, m))
        if qn is not None and qn.kind == "l2_after_rope":
            qh, kh = _qk_norm_traced(qn, qh, None), _qk_norm_traced(qn, kh, None)
        if opts.get("temperature") is not None:
            qh = qh * _temperature_traced(opts["temperature"], n).view(1, 1, n, 1)
        attend, additive = _traced_masks(attn_mask, key_padding_mask, B, h, n, m)
        drop = _dropout_p(self.dropout, "dropout") if self.training else 0.0
        seed = _seed_tensor() if drop > 0.0 else None
        causal = is_causal and attn_mask is None
        # (without causal the eager path keeps mha's default alignment, bottom-right: ALiBi's)
        window, bottom_right, chunk = (-1, -1), not causal, 0
        if self._model_mask is not None and attn_mask is None and not is_causal:
            causal, bottom_right = self._model_mask[0], True
            window = self._model_mask[1] or window
            chunk = self._model_mask[2]
        o, _, probs = torch.ops.mha.attention(
            qh, kh, vh, attend, additive, causal, float(opts.get("scale") or 0.0), drop, seed,
            need_weights, average, self.threads, float(opts.get("softcap") or 0.0),
            bool(opts.get("alibi")), self._buffers.get("sinks"), window[0], window[1],
            bottom_right, chunk)
        att = o.transpose(1, 2).reshape(B, n, -1)
        if gate is not None:
            att = att * torch.sigmoid(gate)
        out = torch.nn.functional.linear(att, ow, ob)
        out = out.squeeze(0) if unbatched else (out if bf else out.transpose(0, 1))
        if not need_weights:
            probs = None
        else:
            if unbatched:
                probs = probs.squeeze(0)
            if res_dtype in (torch.bfloat16, torch.float16):
                probs = probs.to(res_dtype)  # (as the eager path)
        return out.to(res_dtype), probs

    def _rope_traced(self, x: Tensor, length: int) -> Tensor:
        """RoPE of x [B, heads, L, d] at positions 0 .. L-1 in torch operations
        (docs/SEMANTICS.md, "RoPE"): pair (a, b) -> (a cos - b sin, a sin + b cos) with the
        angle position * f_k in float64, cos and sin times libmha's factor, then float32. A
        longrope or dynamic rope is taken at the call's `length` (mha_rope_at_length): longrope's
        long-list table beyond original_max; dynamic's NTK-aware theta' = theta factor'^(R/(R-2))
        with factor' = factor length / original_max - (factor - 1) there."""
        style, freqs, factor = self._rope_traced_freqs
        R = 2 * freqs.shape[0]
        rope = self._options["rope"]
        if rope.scaling == "longrope" and length > rope.original_max_position:
            freqs, factor = self._rope_traced_long
        if rope.scaling == "dynamic" and length > rope.original_max_position:
            f = rope.factor * length / rope.original_max_position - (rope.factor - 1.0)
            theta = rope.theta * f ** (R / (R - 2.0))
            freqs = theta ** (torch.arange(R // 2, dtype=torch.float64) * (-2.0 / R))
        angle = torch.arange(x.shape[2], dtype=torch.float64).unsqueeze(1) * freqs
        cos, sin = (torch.cos(angle) * factor).to(_F32), (torch.sin(angle) * factor).to(_F32)
        if style == "half":
            a, b = x[..., :R // 2], x[..., R // 2:R]
            rotated = torch.cat([a * cos - b * sin, a * sin + b * cos], -1)
        else:
            a, b = x[..., 0:R:2], x[..., 1:R:2]
            rotated = torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
        return torch.cat([rotated, x[..., R:]], -1)

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
        if torch.compiler.is_compiling() or torch.compiler.is_exporting():
            return self._forward_traced(query, key, value, key_padding_mask, need_weights,
                                        attn_mask, average_attn_weights, is_causal)
        if (query is key and key is value and attn_mask is None and key_padding_mask is None
                and not is_causal and _fast is not None):
            res = self._forward_fast(query, need_weights, average_attn_weights)
            if res is not None:
                return res
        self_attn = query is key and key is value
        kv_same = key is value
        nd = query.dim()
        in_dtype = query.dtype
        for nm, t in ((("query", query),) if self_attn else
                      (("query", query), ("key", key), ("value", value))):
            _check_cpu_f32(nm, t)
            if not t.is_floating_point():
                raise TypeError(f"mha.torch.MultiheadAttention: {nm} must be a floating-point "
                                f"tensor, got {t.dtype}")
            if t.dim() != nd:
                raise AssertionError(f"query, key and value must have the same number of "
                                     f"dimensions, got {query.dim()}, {key.dim()}, {value.dim()}")
        if nd not in (2, 3):
            raise AssertionError(f"query should be unbatched 2D or batched 3D tensor but "
                                 f"received {nd}-D query tensor")
        unbatched = nd == 2
        bf = self.batch_first
        autocast = _autocast_dtype()
        xdt = _input_dtype((query, key, value), autocast)
        # The output's dtype: the inputs' (as read); under autocast the autocast dtype (float64
        # inputs stay float64, as torch's autocast leaves them).
        res_dtype = xdt if (autocast is not None and xdt is autocast) else in_dtype
        q, B, n, E = _as_ble(query, unbatched, bf, xdt)
        if self_attn:
            k, Bk, m, Ek = q, B, n, E
        else:
            k, Bk, m, Ek = _as_ble(key, unbatched, bf, xdt)
        if kv_same:
            v, Bv, mv, Ev = k, Bk, m, Ek
        else:
            v, Bv, mv, Ev = _as_ble(value, unbatched, bf, xdt)
        if E != self.embed_dim:
            raise AssertionError(f"was expecting embedding dimension of {self.embed_dim}, but "
                                 f"got {E}")
        if Bk != B or Bv != Bk or mv != m:
            raise AssertionError(f"key and value must have the batch and length of each other "
                                 f"and the batch of query; got query {tuple(query.shape)}, key "
                                 f"{tuple(key.shape)}, value {tuple(value.shape)}")
        if Ek != self.kdim or Ev != self.vdim:
            raise AssertionError(f"key/value feature sizes {Ek}/{Ev} differ from "
                                 f"kdim={self.kdim}/vdim={self.vdim}")
        params = self._params()
        layer = self._mha_layer(params, _weight_dtype(params, autocast))

        h = self.num_heads
        # Outputs are allocated in the caller's layout when mha's [B, n, E] memory order is it
        # (batch_first, unbatched, or one sequence): no transpose or squeeze view afterwards.
        transpose_out = not bf and not unbatched and B != 1
        if unbatched:
            out_shape = (n, E)
        elif bf or transpose_out:
            out_shape = (B, n, E)
        else:
            out_shape = (n, 1, E)
        probs_shape = None
        if need_weights:
            if average_attn_weights:
                probs_shape = (n, m) if unbatched else (B, n, m)
            else:
                probs_shape = (h, n, m) if unbatched else (B, h, n, m)
        if self_attn:
            mode = "self"
            if self.kdim != E or self.vdim != E:
                raise AssertionError("self-attention needs kdim == vdim == embed_dim")
            a = M.forward_args(B, n, m, q.data_ptr())
        elif kv_same and self.kdim == self.vdim:
            mode = "kv"
            a = M.forward_args(B, n, m, q.data_ptr(), k.data_ptr())
        else:
            mode = "cross"
            a = M.forward_args(B, n, m, q.data_ptr(), k.data_ptr(), v.data_ptr())
        if xdt is not _F32:
            a.x_dtype = a.out_dtype = _STORAGE[xdt]
        a.average_probs = 1 if need_weights and average_attn_weights else 0
        keep = None
        if attn_mask is not None or key_padding_mask is not None:
            keep = []
            _translate_masks(a.mask, keep, attn_mask, key_padding_mask, is_causal, B, h, n, m,
                             unbatched, bool(self._options.get("alibi")))
        elif is_causal:
            M.causal_top_left(a.mask)
        if self._model_mask is not None and attn_mask is None and not is_causal:
            _model_mask(a.mask, *self._model_mask)
        if self.training and _dropout_p(self.dropout, "dropout") > 0.0:
            M.set_dropout(a.dropout, self.dropout, _seed())
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or any(p is not None and p.requires_grad
                                               for p in params)):
            if mode == "self":
                ins, fields = [q], ["d_query"]
            elif mode == "kv":
                ins, fields = [q, k], ["d_query", "d_key"]
            else:
                ins, fields = [q, k, v], ["d_query", "d_key", "d_value"]
            n_in = len(ins)
            for f, p in zip(_PARAM_GRAD_FIELDS, params):
                if p is not None:
                    ins.append(p)
                    fields.append(f if type(f) is str else (f, _qkv_offsets(p, params)))
            spec = _LayerSpec()
            spec.layer, spec.args, spec.threads = layer, a, self.threads
            spec.out_shape, spec.probs_shape = out_shape, probs_shape
            spec.fields, spec.shapes = fields, [t.shape for t in ins]
            spec.dtypes, spec.n_inputs, spec.out_dtype = [t.dtype for t in ins], n_in, xdt
            spec.keep = (q, k, v, keep)  # the training state points at them until backward
            spec.state = None
            res = _LayerFunction.apply(spec, *ins)
            out, probs = (res, None) if probs_shape is None else res
        else:  # inference: no autograd node, no training state (saves the Function overhead)
            out, probs = _layer_forward(layer._ptr, a, self.threads, out_shape, probs_shape,
                                        None, xdt)
        if transpose_out:
            out = out.transpose(0, 1)
        if res_dtype is not xdt:
            out = out.to(res_dtype)
        if probs is not None and res_dtype in (torch.bfloat16, torch.float16):
            probs = probs.to(res_dtype)  # (torch's weights have the computation's dtype)
        return out, probs


# ------------------------------------------------------------------------------------------------
# The core: F.scaled_dot_product_attention
# ------------------------------------------------------------------------------------------------
class _CoreFunction(torch.autograd.Function):
    """Eager calls: the operator's implementation without the torch.ops dispatch (half the
    overhead per call); compiled and exported graphs call torch.ops.mha.attention instead."""

    @staticmethod
    def forward(ctx, options: tuple, q: Tensor, k: Tensor, v: Tensor):
        train = any(ctx.needs_input_grad)
        out, lse, _ = _torch_ops.forward(q, k, v, options, train)
        if train:
            ctx.options = options
            ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    @once_differentiable  # (mha's backward is not differentiable: a double backward raises)
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors  # also checks nothing was modified in place
        dq, dk, dv = _torch_ops.backward(dout, q, k, v, out, lse, ctx.options)
        return None, dq, dk, dv


def _to4(t: Tensor, nd: int) -> Tensor:
    if nd == 4:
        return t
    if nd == 3:
        return t.unsqueeze(1)
    if nd == 2:
        return t.unsqueeze(0).unsqueeze(0)
    return t.reshape((-1,) + tuple(t.shape[-3:]))


def _sdpa_operands(query: Tensor, key: Tensor, value: Tensor):
    """(q, k, v, the output's dtype): under torch.autocast('cpu') the float32, float16 and
    bfloat16 operands cast to the autocast dtype (as PyTorch's autocast does for its SDPA;
    float64 stays); then kept if they share one storage dtype (float32, bfloat16, float16),
    else all converted to float32. The output is in the dtype of query after the cast."""
    qkv = (query, key, value)
    if torch.is_autocast_enabled("cpu"):
        dt = torch.get_autocast_dtype("cpu")
        qkv = tuple(t.to(dt) if t.dtype in _torch_ops._STORAGE else t for t in qkv)
    q, k, v = qkv
    if q.dtype is k.dtype and q.dtype is v.dtype and q.dtype in _torch_ops._STORAGE:
        return q, k, v, q.dtype
    return tuple(t if t.dtype is _F32 else t.to(_F32) for t in qkv) + (q.dtype,)


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False, *, threads: int = 0) -> Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` computed by mha.

    query (N, ..., L, E), key (N, ..., S, E), value (N, ..., S, Ev); the dimension before L/S is
    the heads (key/value may have fewer with ``enable_gqa``). attn_mask broadcasts to
    (N, ..., L, S): bool True = takes part in attention, float = added. ``is_causal``: top-left
    causal (PyTorch's). ``dropout_p`` is applied whenever > 0 (as in PyTorch), seeded from
    torch's generator. Differentiable in query, key and value. CPU tensors of one dtype:
    float32, bfloat16 or float16 are read and written as they are (float32 arithmetic; the output
    and the gradients in that dtype), float64 is computed in float32 and cast back, as are
    operands of mixed dtypes (the output in query's). Under ``torch.autocast('cpu')`` float32,
    float16 and bfloat16 operands are cast to the autocast dtype first, as PyTorch's does. Fully
    masked rows give 0 (PyTorch: NaN or 0).
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
    lead = tuple(query.shape[:-2])
    q, k, v, out_dtype = _sdpa_operands(query, key, value)
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
    scale = M.scale_value(scale, "mha: scale=0 is not supported (0 means the default "
                                 "1/sqrt(E))")
    seed = _seed_tensor() if _dropout_p(dropout_p, "dropout_p") > 0.0 else None
    attend = additive = None
    if attn_mask is not None:
        am = _mask_arg("attn_mask", attn_mask)
        if am.dim() > nd:
            raise RuntimeError(f"attn_mask has {am.dim()} dimensions, more than query's {nd}")
        if am.dim() > 4 or (nd != 4 and am.dim() > 2):
            am = _to4(am.reshape((1,) * (nd - am.dim()) + tuple(am.shape)).expand(
                lead + (n, m)), nd)
        if am.dtype == torch.bool:
            attend = am
        else:
            additive = am
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        out = torch.ops.mha.attention(q4, k4, v4, attend, additive, is_causal, scale, dropout_p,
                                      seed, False, False, threads)[0]
    else:
        out = _CoreFunction.apply((attend, additive, is_causal, scale, dropout_p, seed, threads,
                                   _torch_ops.NO_MODEL), q4, k4, v4)
    if nd != 4:
        out = out.reshape(lead + (n, v4.shape[3]))
    if out.dtype != out_dtype:
        out = out.to(out_dtype)
    return out


# Ring attention over MPI (an mpi4py communicator): python/mha/_torch_ring.py.
from ._torch_ring import ring_attention  # noqa: E402

__all__.append("ring_attention")

# Hugging Face transformers' attention registry (attn_implementation="mha"): _torch_hf.py.
from ._torch_hf import register_hf_attention  # noqa: E402


def __getattr__(name: str):
    # mha.torch.MhaCache: a transformers Cache, so transformers is imported on first use only.
    if name in ("MhaCache", "MhaCacheLayer"):
        from . import _torch_hf_cache
        return getattr(_torch_hf_cache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__.append("register_hf_attention")


# ------------------------------------------------------------------------------------------------
# Multi-head latent attention (DeepSeek-V2/V3): mha.MLA as a torch module
# ------------------------------------------------------------------------------------------------
class MLA(nn.Module):
    """Multi-head latent attention as a ``torch.nn.Module``: the weights are parameters named
    as mha_mla_weights' fields (``w_q`` or ``w_q_a``/``b_q_a``/``q_a_norm``/``w_q_b``,
    ``w_kv_a``, ``b_kv_a``, ``kv_a_norm``, ``w_kv_b``, ``w_o``, ``b_o``), ``forward(x)`` is the
    causal expanded form (x [B, n, hidden] float32 CPU) and its backward gives every parameter's
    gradient (mha_mla_backward). ``MLA.from_pretrained(dir, layer)`` loads a deepseek_v2 /
    deepseek_v3 layer. The forward is the operator ``torch.ops.mha.mla`` (its backward
    ``torch.ops.mha.mla_backward``, python/mha/_torch_ops.py) with the parameters as its inputs,
    in eager mode as under ``torch.compile(fullgraph=True)`` and ``torch.export``: one code path,
    so that a compiled or exported module gives the eager results bit for bit."""

    def __init__(self, mla: "_api.MLA", threads: int = 0):
        super().__init__()
        self._config = mla.config
        self._config_str = _torch_ops.mla_config_string(self._config)
        self._threads = threads
        self._names = tuple(mla.weight_shapes())
        got = _mla_weights(mla)
        for n in self._names:
            self.register_parameter(n, nn.Parameter(torch.from_numpy(got[n])))

    @classmethod
    def from_pretrained(cls, path: str, layer: int = 0, threads: int = 0) -> "MLA":
        return cls(_api.MLA.from_pretrained(path, layer), threads)

    def forward(self, x: Tensor, causal: bool = True) -> Tensor:
        _check_cpu_f32("x", x)
        return torch.ops.mha.mla(x, [getattr(self, n) for n in self._names], self._config_str,
                                 bool(causal), self._threads)


def _mla_weights(mla: "_api.MLA"):
    """Copies of an mha.MLA's weights (mha_mla_get_weights: the layer's own copy), by name."""
    import ctypes

    import numpy as np
    w = L.mha_mla_get_weights(mla._ptr).contents
    out = {}
    for n, shape in mla.weight_shapes().items():
        p = ctypes.cast(getattr(w, n), ctypes.POINTER(ctypes.c_float))
        out[n] = np.ctypeslib.as_array(p, shape=shape).copy()
    return out


__all__.append("MLA")
