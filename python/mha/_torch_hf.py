# SPDX-License-Identifier: MIT
"""mha as a Hugging Face transformers attention implementation (``attn_implementation="mha"``).

:func:`register_hf_attention` registers, under one name, an attention function in transformers'
``AttentionInterface`` and sdpa's mask builder in its ``AttentionMaskInterface``, so that a model
built or loaded with ``attn_implementation=name`` (or switched with
``model.set_attn_implementation(name)``) runs the core of every attention layer
(softmax(q kᵀ · scaling) v after the model's projections, RoPE and cache update) through mha,
in ``model(...)`` and in ``model.generate(...)``. The masks are the ones transformers builds for
sdpa (a boolean [B, 1, q, kv] tensor, True = takes part, with padding, sliding window, chunks,
or None when the causal flag says it all); what the layer passes is used as given: grouped-query
heads (no repeat), ``scaling``, ``softcap`` (Gemma 2), ``s_aux`` sinks (gpt-oss; they get
their gradient when they require one), ``dropout`` (mha's RNG). What mha cannot compute as
the layer asks is refused with ValueError naming it:
``position_bias`` (T5-style biases), ``output_attentions=True``, tensors not on the CPU, a
float64 model, operands of different dtypes. transformers is imported only when the function is
called (docs/PYTHON.md "Hugging Face generate").

With ``mha.torch.MhaCache`` as the model's cache (python/mha/_torch_hf_cache.py) the keys and
values the function receives are that cache's placeholders: it then appends the new ones to
mha's C KV cache and attends over it (mha_kv_cache_attention) instead.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _torch_ops

_HALF = (torch.float32, torch.bfloat16, torch.float16)


def _refuse(what: str) -> ValueError:
    return ValueError(f"mha attention (attn_implementation): {what}")


def _operands(query: Tensor, key: Tensor, value: Tensor) -> None:
    for nm, t in (("query", query), ("key", key), ("value", value)):
        if t.device.type != "cpu":
            raise _refuse(f"{nm} is on {t.device}; mha runs on the CPU")
        if t.dtype not in _HALF:
            raise _refuse(f"{nm} is {t.dtype}; mha computes float32, bfloat16 and float16 "
                          f"models (a float64 model would be computed in float32)")
    if not (query.dtype is key.dtype is value.dtype):
        raise _refuse(f"query, key and value have different dtypes ({query.dtype}, {key.dtype}, "
                      f"{value.dtype})")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise _refuse("query, key and value must be [batch, heads, length, head_dim]")


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Optional[Tensor], dropout: float = 0.0,
                      scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                      *, threads: int = 0, **kwargs):
    """The attention function registered by :func:`register_hf_attention` (transformers'
    signature): query [B, h, q, d], key/value [B, g, kv, d] (after the cache update; g divides
    h), attention_mask a bool [B or 1, 1, q, kv] (True = takes part), a float one (added to the
    scores) or None; returns (out [B, q, h, d_v], None)."""
    if kwargs.get("position_bias") is not None:
        raise _refuse("position_bias (an additive position bias, T5-style) is not supported")
    if kwargs.get("output_attentions"):
        raise _refuse("output_attentions=True is not supported (use attn_implementation='eager' "
                      "to get the attention weights)")
    _operands(query, key, value)
    q_len = query.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    layer = getattr(key, "_mha_cache_layer", None)
    if layer is not None:  # an mha.torch.MhaCache: attend over mha's cache (no float K/V)
        if getattr(value, "_mha_cache_layer", None) is not layer:
            raise _refuse("key comes from an MhaCache but value does not")
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            raise _refuse(f"attention_mask must be bool with an MhaCache, got "
                          f"{attention_mask.dtype}")
        softcap = kwargs.get("softcap")
        s = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        out = layer.attend(query, attention_mask, scaling=s, softcap=softcap or 0.0,
                           sinks=kwargs.get("s_aux"), causal=bool(is_causal),
                           dropout=float(dropout or 0.0), threads=threads)
        return out, None
    if key.numel() and all(st == 0 for st in key.stride()) and key.isnan().all():
        raise _refuse("key is an MhaCache placeholder that lost its tag (an operation between "
                      "the cache update and the attention): mha cannot find the cache")
    # As transformers' sdpa path: the causal flag (top-left, as torch's SDPA) only when no mask
    # was built and there is more than one query; one query with no mask sees every key.
    causal = bool(q_len > 1 and attention_mask is None and is_causal)
    if causal and key.shape[2] > q_len:
        # An empty static cache's prefill: top-left causal hides the keys past q_len anyway.
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    attend = additive = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            attend = attention_mask
        elif attention_mask.is_floating_point():
            additive = attention_mask
        else:
            raise _refuse(f"attention_mask must be bool (True = takes part) or float (added), "
                          f"got {attention_mask.dtype}")
    softcap = kwargs.get("softcap")
    softcap = float(softcap) if softcap else 0.0
    sinks = kwargs.get("s_aux")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scaling = float(scaling)
    if not scaling > 0.0 and not scaling < 0.0:
        raise _refuse(f"scaling must be finite and nonzero, got {scaling}")
    seed = None
    if dropout and dropout > 0.0:
        from .torch import _seed_tensor
        seed = _seed_tensor()
    model = (_torch_ops.NO_MODEL if not softcap and sinks is None
             else (softcap, False, sinks, -1, -1, False, 0))
    if ((torch.compiler.is_compiling() or torch.compiler.is_exporting())
            or (sinks is not None and sinks.requires_grad and torch.is_grad_enabled())):
        # (learned sinks that require grad get theirs from the operator's backward)
        out = torch.ops.mha.attention(query, key, value, attend, additive, causal, scaling,
                                      float(dropout), seed, False, False, threads, softcap, False,
                                      sinks)[0]
    else:
        q, k, v, attend, additive, sinks = _torch_ops._checked(
            "mha attention (attn_implementation)", query, key, value, attend, additive,
            float(dropout), seed, sinks)
        if sinks is not None:
            model = (softcap, False, sinks, -1, -1, False, 0)
        from .torch import _CoreFunction  # (mha.torch imports this module)
        out = _CoreFunction.apply((attend, additive, causal, scaling, float(dropout), seed,
                                   threads, model), q, k, v)
    return out.transpose(1, 2).contiguous(), None


def is_mha_attention(name) -> bool:
    """Whether transformers' attention implementation ``name`` is mha's (registered by
    :func:`register_hf_attention`, with any thread count)."""
    import functools

    from transformers import AttentionInterface
    fn = AttentionInterface._global_mapping.get(name) if isinstance(name, str) else None
    if isinstance(fn, functools.partial):
        fn = fn.func
    return fn is attention_forward


def register_hf_attention(name: str = "mha", threads: int = 0) -> str:
    """Registers mha as transformers attention implementation ``name`` (returned): its attention
    function in ``transformers.AttentionInterface`` and sdpa's mask builder in
    ``transformers.masking_utils.AttentionMaskInterface`` (so padding and sliding-window masks
    are built as for sdpa). Then ``AutoModelForCausalLM.from_config(cfg,
    attn_implementation=name)``, ``from_pretrained(..., attn_implementation=name)`` or
    ``model.set_attn_implementation(name)`` run every attention layer's core through mha.
    ``threads``: mha's thread count for these calls (0 = its default). Registering again under
    the same name replaces the function (e.g. with another thread count)."""
    import functools

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if not isinstance(name, str) or not name or name in ("eager", "sdpa") \
            or name.startswith("flash") or name.startswith("flex") or name.startswith("paged"):
        raise ValueError(f"register_hf_attention: name must be a new non-empty string (not one "
                         f"of transformers' own implementations), got {name!r}")
    if not isinstance(threads, int) or threads < 0:
        raise ValueError(f"register_hf_attention: threads must be an int >= 0, got {threads!r}")
    fn = functools.partial(attention_forward, threads=threads) if threads else attention_forward
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
