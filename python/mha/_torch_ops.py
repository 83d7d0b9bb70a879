# SPDX-License-Identifier: MIT
"""mha's attention core as PyTorch operators (``torch.library`` custom ops).

``torch.ops.mha.attention`` and ``torch.ops.mha.attention_backward`` wrap mha_attention and
mha_attention_backward. Registered as real operators, with fake (meta) implementations that give
the output shapes without running anything, and with the backward registered as the forward's
autograd formula, they are opaque nodes that ``torch.compile(fullgraph=True)`` and
``torch.export`` trace through without a graph break (a ctypes call inside a Python
``autograd.Function`` cannot be traced: dynamo breaks the graph there and export refuses it).

Operands (CPU): q [B, h, n, d], k [B, g, m, d], v [B, g, m, d_v] of one floating dtype, last
dimension contiguous (other strides are passed to mha as they are; a copy otherwise). float32,
bfloat16 and float16 are read as they are stored (arithmetic in float32, docs/SEMANTICS.md "Half
precision") and out is written in that dtype (rounded once); float64 is converted to float32 and
out converted back. probs is returned in q's dtype, lse in float32; the backward returns dq, dk,
dv in the operands' dtype (the fake implementations say the same dtypes). Under
``torch.autocast('cpu')`` the attention operator computes in the autocast dtype as
torch's scaled_dot_product_attention does: float32/float16/bfloat16 q, k, v are cast to it
(float64 ones are not), so out is in that dtype; masks and sinks are not cast. Any other dtype, device or rank, shapes that do not agree,
a non-bool ``attend``, a non-float ``additive`` or ``sinks`` of another size than [h] raise
TypeError / ValueError before C reads anything (docs/PYTHON.md). Masks: ``attend`` is a bool
mask, True = the key takes part (broadcastable to [B, h, n, m] as the C API broadcasts: [n, m],
[B, 1, n, m], [1, h, n, m], ...); ``additive`` a float mask added to the scores (computed in
float32); ``causal`` the top-left
causal mask. ``seed`` is an int64 tensor of one element (a tensor, so that a compiled program
draws it from torch's generator at run time instead of baking one constant into the graph).
Trailing options (defaults: off), those of a model's layer (``MultiheadAttention.from_pretrained``
traces to them): ``softcap`` (tanh soft-capping of the scores), ``alibi``, ``sinks`` ([h], read
in float32; sinks that require grad get dL/d sinks from the autograd formula, see
sinks_gradient), and a sliding window ``window_left`` /
``window_right`` (-1 = unbounded on that side; below -1 raises ValueError); ``bottom_right`` aligns the causal mask, the
window, ALiBi and chunks to the last key (docs/SEMANTICS.md) instead of the first, with or
without ``causal``; ``chunk_size`` (0 = off) is
Llama 4's chunked attention (key j visible iff j // C == p // C, p the query's diagonal).

attention(...) -> (out [B, h, n, d_v], lse [B, h, n], probs): probs is [B, h, n, m], [B, n, m]
averaged over heads (average_probs), or an empty tensor when need_probs is False. out and lse are
differentiable (a loss may read both: attention_backward's trailing ``dlse``), and so is probs
(mha_attention_grads.dprobs: the softmax's derivative, computed by the C backward).
"""
from __future__ import annotations

import collections
import threading
from typing import Optional, Tuple

import torch
import torch.optim.optimizer as _optimizer
from torch import Tensor

from . import _lib as L
from . import _marshal as M
from . import _mask_rule

_F32 = torch.float32
# Storage dtypes the library reads and writes as they are (mha_attention_args.q_dtype, ...).
_STORAGE = {torch.float32: L.DTYPE_F32, torch.bfloat16: L.DTYPE_BF16,
            torch.float16: L.DTYPE_F16}
_STRIDED = torch.strided
_AUTO = L.IMPLS["auto"]
# A model layer's options beyond an SDPA call's: (softcap, alibi, sinks, window_left,
# window_right, bottom_right, chunk_size); NO_MODEL turns them all off.
NO_MODEL = (0.0, False, None, -1, -1, False, 0)


def _args(q: Tensor, k: Tensor, v: Tensor, attend: Optional[Tensor], additive: Optional[Tensor],
          causal: bool, scale: float, dropout_p: float, seed: Optional[Tensor], model: tuple,
          threads: int):
    """The mha_attention_args of one call, the tensors it points at (kept alive by the caller for
    the duration of the call) and its block mask (or None): a single mask tensor that is no rule
    has its block mask built once and cached (python/mha/_mask_rule.py), so that the forward and
    the backward, and later steps with the same tensor, read it once."""
    keep = [q.contiguous() if q.stride(-1) != 1 else q,
            k.contiguous() if k.stride(-1) != 1 else k,
            v.contiguous() if v.stride(-1) != 1 else v]
    q, k, v = keep
    a = M.attention_args((q.data_ptr(), q.shape, q.stride()[:3]),
                         (k.data_ptr(), k.shape, k.stride()[:3]),
                         (v.data_ptr(), v.shape, v.stride()[:3]), scale)
    if q.dtype is not _F32 or k.dtype is not _F32 or v.dtype is not _F32:
        a.q_dtype, a.k_dtype, a.v_dtype = _STORAGE[q.dtype], _STORAGE[k.dtype], _STORAGE[v.dtype]
    if causal:
        M.causal_top_left(a.mask)
    if model is not NO_MODEL:
        _set_model(a, model, keep)
    if (attend is None) != (additive is None) and _as_rule(a, keep, attend, additive, causal,
                                                           model):
        attend = additive = None  # the rule runs instead (exactly the same results)
    src = attend if attend is not None else additive
    if attend is not None:
        attend = attend.contiguous()
        keep.append(attend)
        M.set_mask_tensor(a.mask.bool_mask, attend.data_ptr(), L.DTYPE_BOOL, attend.shape)
        a.mask.bool_mask_polarity = L.MASK_ATTEND
    if additive is not None:
        additive = additive.contiguous()
        keep.append(additive)
        M.set_mask_tensor(a.mask.additive_mask, additive.data_ptr(), L.DTYPE_F32, additive.shape)
    if dropout_p > 0.0:
        M.set_dropout(a.dropout, dropout_p, int(seed.item()))
    bm = None
    if (attend is None) != (additive is None) and _mask_rule.block_masks:
        data = attend if attend is not None else additive
        bm = _mask_rule.block_mask(src, data, additive is not None, a,
                                   M.exec_struct(_AUTO, threads))
        if bm.data is not None:  # the copy it was built on (src is not contiguous)
            t = a.mask.bool_mask if attend is not None else a.mask.additive_mask
            t.data = bm.data.data_ptr()
        keep.append(bm)
    return a, keep, bm


def _as_rule(a: L.mha_attention_args, keep: list, attend: Optional[Tensor],
             additive: Optional[Tensor], causal: bool, model: tuple) -> bool:
    """The one mask tensor of the call replaced by the built-in rule it equals, combined with the
    call's causal flag and the model's window and alignment (python/mha/_mask_rule.py), when
    that gives exactly the tensor's results; False: keep the tensor."""
    src = attend if attend is not None else additive
    data = src.contiguous()
    B, h, n = a.batch, a.num_heads, a.q_len
    m = a.kv_len
    rule = _mask_rule.lookup(src, data, additive is not None, L.MASK_ATTEND, B, h, n, m)
    if rule is None:
        return False
    _, alibi, _, window_left, window_right, _, _ = model  # (a chunk_size stays ANDed)
    # The call's own diagonal offset, as the lines above left the alignment (without a model, the
    # default, bottom-right, when not causal: no window is there then).
    delta = m - n if a.mask.alignment == L.ALIGN_BOTTOM_RIGHT else 0
    own_hi = delta if causal else None
    if window_right >= 0:
        own_hi = delta + window_right if own_hi is None else min(own_hi, delta + window_right)
    own_lo = delta - window_left if window_left >= 0 else None
    return _mask_rule.substitute(a.mask, keep, rule, additive is not None, B, n, m, delta, own_lo,
                                 own_hi, bool(alibi))


def _set_model(a: L.mha_attention_args, model: tuple, keep: list) -> None:
    softcap, alibi, sinks, window_left, window_right, bottom_right, chunk_size = model
    a.mask.chunk_size = chunk_size
    a.softcap, a.alibi = softcap, 1 if alibi else 0
    if sinks is not None:
        sinks = sinks.detach().to(_F32).contiguous()
        keep.append(sinks)
        a.sinks = sinks.data_ptr()
    if window_left < -1 or window_right < -1:  # (-1 = unbounded; -5, -5 would pass unseen)
        raise ValueError(f"mha::attention: window_left / window_right must be >= -1 (-1 = "
                         f"unbounded), got {window_left}, {window_right}")
    if window_left >= 0 or window_right >= 0:
        a.mask.use_window = 1
        a.mask.window_left, a.mask.window_right = window_left, window_right
    # The causal mask, the window, ALiBi and chunks all align by the flag, causal or not (until
    # session 51 a call without causal kept the C default, bottom-right, whatever the flag said).
    a.mask.alignment = L.ALIGN_BOTTOM_RIGHT if bottom_right else L.ALIGN_TOP_LEFT


def empty(shape, dtype: torch.dtype = _F32) -> Tensor:
    """torch.empty(shape, dtype=dtype), for float32 at a third of the cost: torch's argument
    parser is slow for a shape tuple with a dtype keyword (~5 us) and fast for plain int
    arguments (~1.5 us)."""
    if shape and dtype is _F32 and torch.get_default_dtype() is _F32:
        return torch.empty(*shape)
    return torch.empty(shape, dtype=dtype)


def forward(q: Tensor, k: Tensor, v: Tensor, options: tuple, want_lse: bool,
            probs_shape: Optional[tuple] = None):
    """mha_attention: (out [B, h, n, d_v], lse [B, h, n] or None, probs or None). options =
    (attend, additive, causal, scale, dropout_p, seed, threads, model) (model: NO_MODEL or its
    form); probs_shape [B, h, n, m], or [B, n, m] for probabilities averaged over the heads.
    q, k, v: float32, bfloat16 or float16 (any mix); out is in q's dtype, lse and probs in
    float32."""
    attend, additive, causal, scale, dropout_p, seed, threads, model = options
    a, keep, bm = _args(q, k, v, attend, additive, causal, scale, dropout_p, seed, model, threads)
    out = empty((a.batch, a.num_heads, a.q_len, a.v_head_dim), q.dtype)
    M.set_strided(a, "out", out.data_ptr(), out.stride()[:3])
    a.out_dtype = a.q_dtype
    lse = probs = None
    if want_lse:
        lse = empty((a.batch, a.num_heads, a.q_len))
        a.lse = lse.data_ptr()
    if probs_shape is not None:
        probs = empty(probs_shape)
        a.probs = probs.data_ptr()
        a.average_probs = 1 if len(probs_shape) == 3 else 0
    if bm is not None:
        M.call(L.mha_attention_masked, a, bm.ptr, M.exec_struct(_AUTO, threads))
    else:
        M.call(L.mha_attention, a, M.exec_struct(_AUTO, threads))
    del keep
    return out, lse, probs


# Operands the operators take: float32, bfloat16 and float16 as they are stored, float64 converted
# to float32 (out and probs returned in the query's dtype, lse always float32); anything else
# (integer, bool, complex) raises TypeError.
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _where(t: Tensor, name: str, op: str) -> None:
    """TypeError unless t is a tensor on the CPU (mha reads CPU memory only); the fake (meta)
    implementation's checks ("fake" in op) take meta tensors too."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.device.type != "cpu" and not (t.device.type == "meta" and "fake" in op):
        raise TypeError(f"{op}: {name} must be a CPU tensor (mha runs on the CPU), got device "
                        f"{t.device}")
    if t.layout is not _STRIDED:
        raise TypeError(f"{op}: {name} must be a dense (strided) tensor, got layout {t.layout}")


def _float_operand(t: Tensor, name: str, op: str, ndim: Optional[int],
                   native: bool = False) -> Tensor:
    """t as float32 (converted from float64/float16/bfloat16; with `native`, float16 and
    bfloat16 are kept as they are, storage dtypes of the library), its last dimension
    contiguous; TypeError for another dtype or device, ValueError for another number of
    dimensions."""
    _where(t, name, op)
    if t.dtype not in _FLOATS:
        raise TypeError(f"{op}: {name} must be floating point (float32, bfloat16, float16; "
                        f"float64 is computed in float32), got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype is not _F32 and not (native and t.dtype in _STORAGE):
        t = t.detach().to(_F32)
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _checked(op: str, q: Tensor, k: Tensor, v: Tensor, attend: Optional[Tensor],
             additive: Optional[Tensor], dropout_p: float, seed: Optional[Tensor],
             sinks: Optional[Tensor]):
    """The operator's tensors checked against what mha_attention reads (dtype, device, rank,
    sizes): (q, k, v, attend, additive, sinks), q, k, v in their storage dtype (float64 ones
    converted to float32), additive and sinks in float32. Mask shapes that do not broadcast to
    [B, h, n, m] are refused by the library (MhaError)."""
    if (attend is None and additive is None and sinks is None and dropout_p == 0.0
            and type(q) is Tensor and type(k) is Tensor and type(v) is Tensor
            and q.dtype is _F32 and k.dtype is _F32 and v.dtype is _F32
            and q.is_cpu and k.is_cpu and v.is_cpu
            and q.layout is _STRIDED and k.layout is _STRIDED and v.layout is _STRIDED
            and q.dim() == 4 and k.dim() == 4 and v.dim() == 4
            and q.stride(3) == 1 and k.stride(3) == 1 and v.stride(3) == 1):
        # The usual call (float32 CPU operands, no mask tensors): the same checks, spelled out
        # (the general path below costs ~10 us; this ~2 us).
        (B, h, n, d), (Bk, g, m, dk), (Bv, gv, mv, _) = q.shape, k.shape, v.shape
        if Bk == B and Bv == B and gv == g and mv == m and dk == d and g and not h % g:
            return q, k, v, None, None, None
    dtypes = {q.dtype, k.dtype, v.dtype} if all(isinstance(t, Tensor) for t in (q, k, v)) else ()
    devices = {t.device for t in (q, k, v, attend, additive, seed, sinks)
               if isinstance(t, Tensor)}
    if len(devices) > 1:  # (a meta tensor among CPU ones sends the call to the fake kernel)
        raise TypeError(f"{op}: all tensors must be on one device (the CPU), got "
                        f"{', '.join(sorted(str(d) for d in devices))}")
    q, k, v = (_float_operand(t, nm, op, 4, True) for t, nm in ((q, "q"), (k, "k"), (v, "v")))
    if len(dtypes) > 1:
        raise TypeError(f"{op}: q, k and v must have the same dtype, got "
                        f"{', '.join(sorted(str(d) for d in dtypes))}")
    B, h, n, d = q.shape
    Bk, g, m, dk = k.shape
    if (Bk != B or tuple(v.shape[:3]) != (B, g, m) or dk != d or g == 0 or h % g):
        raise ValueError(f"{op}: shapes do not agree: q {tuple(q.shape)} [B, h, n, d], k "
                         f"{tuple(k.shape)} [B, g, m, d], v {tuple(v.shape)} [B, g, m, d_v] "
                         f"(g dividing h)")
    if attend is not None:
        _where(attend, "attend", op)
        if attend.dtype != torch.bool:
            raise TypeError(f"{op}: attend must be a bool mask (True = takes part), got "
                            f"{attend.dtype}")
        if not 1 <= attend.dim() <= 4:
            raise ValueError(f"{op}: attend must have 1 to 4 dimensions, got shape "
                             f"{tuple(attend.shape)}")
    if additive is not None:
        additive = _float_operand(additive, "additive", op, None)
        if not 1 <= additive.dim() <= 4:
            raise ValueError(f"{op}: additive must have 1 to 4 dimensions, got shape "
                             f"{tuple(additive.shape)}")
    if not 0.0 <= dropout_p < 1.0:  # (a negative or NaN one would silently mean no dropout)
        raise ValueError(f"{op}: dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0.0:
        if seed is None:
            raise ValueError(f"{op}: dropout_p > 0 needs a seed (an int64 tensor of one element)")
        _where(seed, "seed", op)
        if seed.dtype not in (torch.int64, torch.int32) or seed.numel() != 1:
            raise TypeError(f"{op}: seed must be an int64 tensor of one element, got {seed.dtype} "
                            f"{tuple(seed.shape)}")
    if sinks is not None:
        sinks = _float_operand(sinks, "sinks", op, None)
        if tuple(sinks.shape) != (h,):
            raise ValueError(f"{op}: sinks must have shape ({h},) (one per query head), got "
                             f"{tuple(sinks.shape)}")
    return q, k, v, attend, additive, sinks


def _model(*model) -> tuple:
    return NO_MODEL if model == NO_MODEL else model


def _probs_shape(q: Tensor, m: int, need_probs: bool, average_probs: bool) -> Optional[tuple]:
    B, h, n, _ = q.shape
    if not need_probs:
        return None
    return (B, n, m) if average_probs else (B, h, n, m)


def _attention_op(q: Tensor, k: Tensor, v: Tensor, attend: Optional[Tensor],
                  additive: Optional[Tensor], causal: bool, scale: float, dropout_p: float,
                  seed: Optional[Tensor], need_probs: bool, average_probs: bool, threads: int,
                  softcap: float = 0.0, alibi: bool = False, sinks: Optional[Tensor] = None,
                  window_left: int = -1, window_right: int = -1,
                  bottom_right: bool = False, chunk_size: int = 0) -> Tuple[Tensor, Tensor, Tensor]:
    """torch.ops.mha.attention: see the module docstring."""
    dtype = q.dtype if isinstance(q, Tensor) else None
    q, k, v, attend, additive, sinks = _checked("mha::attention", q, k, v, attend, additive,
                                                dropout_p, seed, sinks)
    options = (attend, additive, causal, scale, dropout_p, seed, threads,
               _model(softcap, alibi, sinks, window_left, window_right, bottom_right,
                      chunk_size))
    out, lse, probs = forward(q, k, v, options, True,
                              _probs_shape(q, v.shape[2], need_probs, average_probs))
    # out is in q's storage dtype (float64: computed in float32, converted back); probs (float32)
    # returned in q's dtype; lse float32.
    probs = probs.to(dtype) if probs is not None else empty((0,), dtype)
    return (out if out.dtype is dtype else out.to(dtype)), lse, probs


attention = torch.library.custom_op("mha::attention", _attention_op, mutates_args=(),
                                    device_types="cpu")


@attention.register_fake
def _attention_fake(q, k, v, attend, additive, causal, scale, dropout_p, seed, need_probs,
                    average_probs, threads, softcap=0.0, alibi=False, sinks=None, window_left=-1,
                    window_right=-1, bottom_right=False, chunk_size=0):
    # The real implementation's checks, so that a traced program refuses at trace time what the
    # call would refuse at run time; outputs of the dtypes the real one returns.
    _checked("mha::attention (fake)", q, k, v, attend, additive, dropout_p, seed, sinks)
    B, h, n, _ = q.shape
    probs_shape = _probs_shape(q, v.shape[2], need_probs, average_probs)
    return (q.new_empty((B, h, n, v.shape[3])), q.new_empty((B, h, n), dtype=_F32),
            q.new_empty(probs_shape if probs_shape is not None else (0,)))


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
             options: tuple, dlse: Optional[Tensor] = None,
             dprobs: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """mha_attention_backward: (dq, dk, dv) of the forward(q, k, v, options, ...) call that gave
    out and lse. q, k, v, out, dout: float32, bfloat16 or float16 (any mix); dq, dk, dv are in
    the dtypes of q, k, v. dlse [B, h, n] (any float dtype): the loss's gradient through lse,
    None when the loss does not read it; dprobs likewise through the probabilities, [B, h, n, m]
    or [B, n, m] (the head average)."""
    attend, additive, causal, scale, dropout_p, seed, threads, model = options
    a, keep, bm = _args(q, k, v, attend, additive, causal, scale, dropout_p, seed, model, threads)
    out = out if out.stride(-1) == 1 else out.contiguous()
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    lse = lse.contiguous()
    M.set_strided(a, "out", out.data_ptr(), out.stride()[:3])
    a.out_dtype = _STORAGE[out.dtype]
    a.lse = lse.data_ptr()
    g = L.mha_attention_grads()
    if dlse is not None:
        dlse = dlse.to(_F32).contiguous()
        g.dlse = dlse.data_ptr()
    if dprobs is not None:
        dprobs = dprobs.to(_F32).contiguous()
        g.dprobs = dprobs.data_ptr()
        a.average_probs = 1 if dprobs.dim() == 3 else 0
    M.set_strided(g, "dout", dout.data_ptr(), dout.stride()[:3])
    grads = tuple(empty(t.shape, t.dtype) for t in keep[:3])
    for name, d in zip(("dq", "dk", "dv"), grads):
        M.set_strided(g, name, d.data_ptr(), d.stride()[:3])
    g.dout_dtype, g.dq_dtype, g.dk_dtype, g.dv_dtype = (
        _STORAGE[t.dtype] for t in (dout,) + grads)
    if bm is not None:
        M.call(L.mha_attention_backward_masked, a, g, bm.ptr, M.exec_struct(_AUTO, threads))
    else:
        M.call(L.mha_attention_backward, a, g, M.exec_struct(_AUTO, threads))
    del keep
    return grads


def _attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                           lse: Tensor, attend: Optional[Tensor], additive: Optional[Tensor],
                           causal: bool, scale: float, dropout_p: float, seed: Optional[Tensor],
                           threads: int, softcap: float = 0.0, alibi: bool = False,
                           sinks: Optional[Tensor] = None, window_left: int = -1,
                           window_right: int = -1, bottom_right: bool = False,
                           chunk_size: int = 0, dlse: Optional[Tensor] = None,
                           dprobs: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """torch.ops.mha.attention_backward: the gradients of one torch.ops.mha.attention call;
    dlse (shape of lse) and dprobs (shape of probs: [B, h, n, m], or [B, n, m] for the head
    average), optional: the loss's gradient through lse and the probabilities as well."""
    op = "mha::attention_backward"
    dtypes = tuple(t.dtype if isinstance(t, Tensor) else None for t in (q, k, v))
    q, k, v, attend, additive, sinks = _checked(op, q, k, v, attend, additive, dropout_p, seed,
                                                sinks)
    B, h, n, _ = q.shape
    want = (B, h, n, v.shape[3])
    out, dout = _float_operand(out, "out", op, 4, True), _float_operand(dout, "dout", op, 4, True)
    lse = _float_operand(lse, "lse", op, 3)
    if dlse is not None:
        dlse = _float_operand(dlse, "dlse", op, 3)
    if dprobs is not None:
        dprobs = _float_operand(dprobs, "dprobs", op, None)
        m = k.shape[2]
        if tuple(dprobs.shape) not in ((B, h, n, m), (B, n, m)):
            raise ValueError(f"{op}: dprobs must have shape {(B, h, n, m)} or, for the head "
                             f"average, {(B, n, m)}, got {tuple(dprobs.shape)}")
    if len({t.device for t in (q, out, dout, lse, dlse, dprobs) if t is not None}) > 1:
        raise TypeError(f"{op}: all tensors must be on one device (the CPU)")
    if tuple(out.shape) != want or tuple(dout.shape) != want or tuple(lse.shape) != want[:3] or \
            (dlse is not None and tuple(dlse.shape) != want[:3]):
        raise ValueError(f"{op}: out and dout must have shape {want} and lse (and dlse) "
                         f"{want[:3]}, got {tuple(out.shape)}, {tuple(dout.shape)}, "
                         f"{tuple(lse.shape)}"
                         + (f" and {tuple(dlse.shape)}" if dlse is not None else ""))
    grads = backward(dout, q, k, v, out, lse,
                     (attend, additive, causal, scale, dropout_p, seed, threads,
                      _model(softcap, alibi, sinks, window_left, window_right, bottom_right,
                             chunk_size)), dlse, dprobs)
    return tuple(g if g.dtype is dt else g.to(dt) for g, dt in zip(grads, dtypes))


attention_backward = torch.library.custom_op("mha::attention_backward", _attention_backward_op,
                                             mutates_args=(), device_types="cpu")


@attention_backward.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, attend, additive, causal, scale, dropout_p,
                             seed, threads, softcap=0.0, alibi=False, sinks=None, window_left=-1,
                             window_right=-1, bottom_right=False, chunk_size=0, dlse=None,
                             dprobs=None):
    _checked("mha::attention_backward (fake)", q, k, v, attend, additive, dropout_p, seed, sinks)
    if len({t.device for t in (q, dout, out, lse, dlse, dprobs)
            if isinstance(t, Tensor)}) > 1:
        raise TypeError("mha::attention_backward: all tensors must be on one device (the CPU)")
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    (q, k, v, attend, additive, causal, scale, dropout_p, seed, need_probs, _, threads, softcap,
     alibi, sinks, window_left, window_right, bottom_right, chunk_size) = inputs
    out, lse, _ = output
    ctx.save_for_backward(q, k, v, out, lse, attend, additive, seed, sinks)
    ctx.options = (causal, scale, dropout_p, threads, softcap, alibi, window_left, window_right,
                   bottom_right, chunk_size)
    ctx.need_probs = need_probs


def sinks_gradient(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor,
                   dlse: Optional[Tensor] = None, probs_sums: Optional[Tensor] = None) -> Tensor:
    """dL/d sinks [h] (in sinks' dtype) of the attention call with learned sinks that gave out
    [B, h, n, d_v] and lse [B, h, n] (lse over the keys and the sink): the sink takes
    p_sink,i = exp(sink_h - lse_i) of row i's mass, so d out_i / d sink_h = -p_sink,i out_i
    (dropout included: it scales out_i and every p_ij alike) and dL/d sink_h = -sum over the
    batch and the rows i of head h of p_sink,i (dOut_i . out_i), mha_attention_backward's dsinks,
    computed in float32. A loss that reads lse adds sum p_sink,i dlse_i (d lse_i / d sink_h =
    p_sink,i), one that reads the probabilities -sum p_sink,i c_i (c_i = sum_j p_ij G_ij, given as
    probs_sums: d p_ij / d sink_h = -p_ij p_sink,i). A fully masked row (lse = -inf, out = 0)
    adds nothing."""
    s = sinks.detach().to(_F32).view(1, -1, 1)
    lse = lse.to(_F32)
    p = torch.where(torch.isfinite(lse), torch.exp(s - lse), torch.zeros_like(lse))
    d = (dout.to(_F32) * out.to(_F32)).sum(-1)
    if dlse is not None:
        d = d - dlse.to(_F32)
    if probs_sums is not None:
        d = d + probs_sums
    return (-(p * d).sum((0, 2))).to(sinks.dtype)


def _probs_row_sums(q: Tensor, k: Tensor, v: Tensor, dprobs: Tensor, options: tuple) -> Tensor:
    """c_i = sum_j p_ij G_ij [B, h, n] (float32) of the call's probabilities and G = dL/dprobs
    (the head average's: G / h per head), for the sinks' gradient: p is recomputed per head by
    the operator itself (no dropout: the probabilities are taken before it)."""
    (attend, additive, causal, scale, threads, softcap, alibi, sinks, window_left, window_right,
     bottom_right, chunk_size) = options
    p = torch.ops.mha.attention(
        *(t.detach().to(_F32) for t in (q, k, v)), attend, additive, causal, scale, 0.0, None,
        True, False, threads, softcap, alibi, sinks, window_left, window_right, bottom_right,
        chunk_size)[2]
    g = dprobs.to(_F32)
    if g.dim() == 3:
        g = (g / q.shape[1]).unsqueeze(1)
    return (p * g).sum(-1)


def _backward(ctx, dout, dlse, dprobs):
    """The gradients through out, lse (a loss may read both: merging partial attentions by
    their lse does) and the probabilities when they were asked for (attention distillation reads
    them; mha_attention_grads.dprobs)."""
    q, k, v, out, lse, attend, additive, seed, sinks = ctx.saved_tensors
    (causal, scale, dropout_p, threads, softcap, alibi, window_left, window_right,
     bottom_right, chunk_size) = ctx.options
    need_probs = ctx.need_probs
    # (Probabilities returned but unused get zeros, which cost the C backward one more pass of
    # Q K^T: the values are not looked at, which no traced or AOT-dispatched graph could do.)
    if not need_probs:
        dprobs = None
    dq, dk, dv = torch.ops.mha.attention_backward(
        dout, q, k, v, out, lse, attend, additive, causal, scale, dropout_p, seed, threads,
        softcap, alibi, sinks, window_left, window_right, bottom_right, chunk_size, dlse, dprobs)
    # The learned sinks' gradient (inputs[14]), when they require one.
    dsinks = None
    if sinks is not None and ctx.needs_input_grad[14]:
        c = None if dprobs is None else _probs_row_sums(
            q, k, v, dprobs, (attend, additive, causal, scale, threads, softcap, alibi, sinks,
                              window_left, window_right, bottom_right, chunk_size))
        dsinks = sinks_gradient(dout, out, lse, sinks, dlse, c)
    return (dq, dk, dv) + (None,) * 11 + (dsinks,) + (None,) * 4


attention.register_autograd(_backward, setup_context=_setup_context)


def _autocast_attention(keyset, q: Tensor, k: Tensor, v: Tensor, *rest):
    """torch.ops.mha.attention under torch.autocast('cpu'): what the autocast kernel of torch's
    scaled_dot_product_attention does (a "lower precision" op): q, k, v that are float32,
    float16 or bfloat16 are cast to the autocast dtype (float64 stays, as torch leaves it), the
    operator runs below autocast and its out is then in that dtype. Masks and sinks are not
    cast (the library reads them in float32 anyway, so they lose no bits). Registered by hand
    rather than with register_autocast, which casts to one dtype fixed at registration."""
    dt = torch.get_autocast_dtype("cpu")
    q, k, v = (t.to(dt) if isinstance(t, Tensor) and t.dtype in _STORAGE else t
               for t in (q, k, v))
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_AUTOCAST_CPU)):
        return torch.ops.mha.attention.default(q, k, v, *rest)


_AUTOCAST_CPU = torch._C.DispatchKey.AutocastCPU
_LIB = torch.library.Library("mha", "IMPL")  # (kept: a registration lives as long as its Library)
_LIB.impl("attention", _autocast_attention, "AutocastCPU", with_keyset=True)


# ------------------------------------------------------------------------------------------------
# Multi-head latent attention (mha.torch.MLA): torch.ops.mha.mla and torch.ops.mha.mla_backward
# ------------------------------------------------------------------------------------------------
# mla(x [B, n, hidden], weights, config, causal, threads) -> y [B, n, hidden]: mha_mla_forward of
# the layer built from `weights` (float32 CPU tensors, mha_mla_weights' fields the config uses, in
# mha.MLA.weight_shapes' order, each of its shape) and `config` (the mha_mla_config's bytes in
# hex: a string, so that a traced or exported program holds the whole layer description as a
# constant and needs no Python object beside it). mla_backward(dy, x, weights, config, causal,
# threads) -> [dx, d weight for each weight] (mha_mla_backward). The C layer (mha_mla_create:
# checks and copies the weights, ~10 ms for DeepSeek-V2-Lite's 14 M weights of one layer, more
# than a one-token forward) is cached, keyed on the config and each weight's data pointer, shape
# and strides, and valid while each weight's version counter is the one it was built at (torch
# bumps it at every in-place change: an optimizer step, load_state_dict, any in-place op under
# torch.no_grad()): a call after an update rebuilds it in place of the old one (one entry per set
# of weights, however many steps), and the forward and backward of one step share one. The cache
# holds its weight tensors (so that no other tensor can take their addresses) and the layers of
# the last MLA_CACHE_SIZE sets of weights (each a copy of its weights); mla_cache_clear() empties
# it. A change through `.data` bypasses the version counter and is not seen: change
# parameters in place under torch.no_grad() (as torch's optimizers do), or call mla_cache_clear().
MLA_CACHE_SIZE = 8
_MLA_CACHE: "collections.OrderedDict" = collections.OrderedDict()
_MLA_LOCK = threading.Lock()


def mla_cache_clear() -> None:
    """Drops every cached MLA layer (torch.ops.mha.mla rebuilds them at their next call)."""
    with _MLA_LOCK:
        _MLA_CACHE.clear()


def mla_config_string(config: "L.mha_mla_config") -> str:
    """The operator's `config` argument for an mha_mla_config."""
    import ctypes
    return bytes(ctypes.string_at(ctypes.addressof(config), ctypes.sizeof(config))).hex()


def _mla_config(s: str, op: str) -> "L.mha_mla_config":
    import ctypes
    try:
        raw = bytes.fromhex(s)
    except (TypeError, ValueError):
        raw = b""
    size = ctypes.sizeof(L.mha_mla_config)
    if len(raw) != size:
        raise ValueError(f"{op}: config must be an mha_mla_config's {size} bytes in hex "
                         f"(mla_config_string), got {len(str(s))} characters")
    return L.mha_mla_config.from_buffer_copy(raw)


def _mla_checked(op: str, x: Tensor, weights, config: str, extra=()):
    """(config, weight names, shapes): x [B, n, hidden] and every weight float32 on the CPU, the
    weights the config uses in their order and shapes; TypeError / ValueError naming the tensor."""
    from ._api import mla_weight_shapes
    c = _mla_config(config, op)
    shapes = mla_weight_shapes(c)
    for name, t in (("x", x),) + tuple(extra):
        _where(t, name, op)
        if t.dtype is not _F32:
            raise TypeError(f"{op}: {name} must be float32, got {t.dtype}")
        if t.dim() != 3 or t.shape[2] != c.hidden or t.shape != x.shape:
            raise ValueError(f"{op}: {name} must have shape [B, n, {c.hidden}] (as x), got "
                             f"{tuple(t.shape)}")
    if len(weights) != len(shapes):
        raise ValueError(f"{op}: expected {len(shapes)} weights ({', '.join(shapes)}), got "
                         f"{len(weights)}")
    for (name, shape), w in zip(shapes.items(), weights):
        _where(w, name, op)
        if w.dtype is not _F32:
            raise TypeError(f"{op}: {name} must be float32, got {w.dtype}")
        if tuple(w.shape) != shape:
            raise ValueError(f"{op}: {name} must have shape {shape}, got {tuple(w.shape)}")
    return c, tuple(shapes)


# Optimizer steps taken anywhere in the process (torch.optim's global step post hook). A fused
# optimizer (fused=True) updates its parameters in place without bumping their version counters,
# so the C layers cached on (data_ptr, version) would keep the old weights: the count is part of
# every cache key, and a step makes each layer rebuild once (a plain step's version bumps did so
# already).
OPTIMIZER_STEPS = [0]


def _count_optimizer_step(_optimizer, _args, _kwargs) -> None:
    OPTIMIZER_STEPS[0] += 1


_optimizer.register_optimizer_step_post_hook(_count_optimizer_step)


def _mla_layer(c, names, weights, config: str):
    """The mha.MLA of these weights: the cached one if no weight changed since it was made."""
    from ._api import MLA
    if any(w.is_inference() for w in weights):  # (no version counter: not cached)
        return MLA(c, {n: w.detach().contiguous().numpy() for n, w in zip(names, weights)})
    key = (config,) + tuple((w.data_ptr(), tuple(w.shape), w.stride()) for w in weights)
    versions = tuple(w._version for w in weights) + (OPTIMIZER_STEPS[0],)
    with _MLA_LOCK:
        hit = _MLA_CACHE.get(key)
        if hit is not None and hit[1] == versions:
            _MLA_CACHE.move_to_end(key)
            return hit[2]
        _MLA_CACHE.pop(key, None)  # (an older version of these weights: replaced, not kept)
    layer = MLA(c, {n: w.detach().contiguous().numpy() for n, w in zip(names, weights)})
    with _MLA_LOCK:
        _MLA_CACHE[key] = (tuple(weights), versions, layer)
        while len(_MLA_CACHE) > max(int(MLA_CACHE_SIZE), 0):
            _MLA_CACHE.popitem(last=False)
    return layer


def _mla_op(x: Tensor, weights: list[Tensor], config: str, causal: bool,
            threads: int) -> Tensor:
    """torch.ops.mha.mla: see above."""
    c, names = _mla_checked("mha::mla", x, weights, config)
    layer = _mla_layer(c, names, weights, config)
    return torch.from_numpy(layer.forward(x.detach().contiguous().numpy(), causal=causal,
                                          threads=threads))


mla = torch.library.custom_op("mha::mla", _mla_op, mutates_args=(), device_types="cpu")


@mla.register_fake
def _mla_fake(x, weights, config, causal, threads):
    _mla_checked("mha::mla (fake)", x, weights, config)
    return x.new_empty(x.shape)


def _mla_backward_op(dy: Tensor, x: Tensor, weights: list[Tensor], config: str, causal: bool,
                     threads: int) -> list[Tensor]:
    """torch.ops.mha.mla_backward: [dx] + the weights' gradients of one torch.ops.mha.mla call."""
    c, names = _mla_checked("mha::mla_backward", x, weights, config, (("dy", dy),))
    layer = _mla_layer(c, names, weights, config)
    g = layer.backward(x.detach().contiguous().numpy(), dy.detach().contiguous().numpy(),
                       causal=causal, threads=threads)
    return [torch.from_numpy(g["x"])] + [torch.from_numpy(g[n]) for n in names]


mla_backward = torch.library.custom_op("mha::mla_backward", _mla_backward_op, mutates_args=(),
                                       device_types="cpu")


@mla_backward.register_fake
def _mla_backward_fake(dy, x, weights, config, causal, threads):
    _mla_checked("mha::mla_backward (fake)", x, weights, config, (("dy", dy),))
    return [x.new_empty(x.shape)] + [w.new_empty(w.shape) for w in weights]


def _mla_setup_context(ctx, inputs, output) -> None:
    x, weights, config, causal, threads = inputs
    ctx.save_for_backward(x, *weights)
    ctx.options = (config, causal, threads)


def _mla_backward(ctx, dy):
    x, *weights = ctx.saved_tensors
    config, causal, threads = ctx.options
    g = torch.ops.mha.mla_backward(dy, x, weights, config, causal, threads)
    return g[0], list(g[1:]), None, None, None


mla.register_autograd(_mla_backward, setup_context=_mla_setup_context)
