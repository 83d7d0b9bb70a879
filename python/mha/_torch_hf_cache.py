# SPDX-License-Identifier: MIT
"""``mha.torch.MhaCache``: a transformers ``Cache`` whose keys and values live in mha's C KV cache
(docs/PYTHON.md "Hugging Face generate", docs/INFERENCE.md "transformers' generate").

With a model whose attention is mha's (``attn_implementation`` registered by
:func:`mha.torch.register_hf_attention`), ``model.generate(ids, cache=MhaCache(model.config,
max_seq=...))`` (or ``past_key_values=``) keeps every layer's post-RoPE K/V in one
``mha_kv_cache`` per layer (float32, float16, bfloat16, q8_0 or fp8_e4m3, contiguous or paged)
and runs each layer's attention with ``mha_kv_cache_attention`` (the split-KV decode kernels, the
cache read in its storage dtype): HF keeps no float copy of K/V.

How it fits transformers' protocol: a layer's ``update(k, v)`` only holds the new K/V and returns
placeholders (NaN tensors of the full K/V shape, zero bytes: ``expand`` of one element) tagged
with the cache layer; the registered attention function recognises the tag, reads from the mask
which new tokens are real (a padded prompt's padding is not appended: every sequence keeps its
own length, as mha's cache is made for), checks that the mask of every real token is exactly what
the cache's causal (window / chunk) rule gives over the real tokens (else ValueError), appends,
and attends. The rows of padding tokens are zeros (transformers computes something there that no
real token reads: no real token sees a padding token's keys).
Anything else reaching the placeholders would compute NaN, and is refused first: ``update``
checks that the model's attention implementation is mha's, and a layer whose attention did not
consume its pending K/V refuses the next update.

transformers is imported by this module (mha.torch imports it only when ``MhaCache`` is used).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from . import _api

_DTYPES = {"float32": "float32", "f32": "float32", torch.float32: "float32",
           "float16": "float16", "f16": "float16", torch.float16: "float16",
           "bfloat16": "bfloat16", "bf16": "bfloat16", torch.bfloat16: "bfloat16",
           "q8_0": "q8_0", "fp8_e4m3": "fp8_e4m3"}
_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def _refuse(what: str) -> ValueError:
    return ValueError(f"mha.torch.MhaCache: {what}")


def _layer_rules(config) -> list:
    """Per decoder layer: (window, chunk_size) of its attention, from the config (transformers'
    layer_types; sliding_window / attention_chunk_size)."""
    text = config.get_text_config(decoder=True)
    if getattr(text, "kv_lora_rank", None) is not None:
        # (transformers' MLA modules give the cache their compressed latents and expand them
        # after the update, so the placeholders would reach kv_b_proj: NaN logits, no error)
        raise _refuse(f"{text.model_type} is multi-head latent attention (kv_lora_rank "
                      f"{text.kv_lora_rank}): transformers caches its latents, which MhaCache "
                      f"does not hold; use DynamicCache (the attention stays mha's), or "
                      f"mha.MLACache for mha's own MLA decode")
    if getattr(text, "num_kv_shared_layers", 0):
        raise _refuse(f"{text.model_type}'s last {text.num_kv_shared_layers} layers read the "
                      f"keys and values of earlier layers (num_kv_shared_layers), which MhaCache "
                      f"does not give out; use DynamicCache (the attention stays mha's)")
    n = int(text.num_hidden_layers)
    types = getattr(text, "layer_types", None)
    if types is None:
        if getattr(text, "sliding_window", None) is not None:
            types = ["sliding_attention"] * n
        elif getattr(text, "attention_chunk_size", None) is not None:
            types = ["chunked_attention"] * n
        else:
            types = ["full_attention"] * n
    rules = []
    for i, t in enumerate(types[:n]):
        if t == "full_attention":
            rules.append((0, 0))
        elif t == "sliding_attention":
            rules.append((int(text.sliding_window), 0))
        elif t == "chunked_attention":
            rules.append((0, int(text.attention_chunk_size)))
        else:
            raise _refuse(f"layer {i} is a {t!r} layer; MhaCache holds full, sliding-window and "
                          f"chunked attention layers only")
    return rules


class MhaCacheLayer(CacheLayerMixin):
    """One decoder layer's K/V in an mha KV cache (mha.KVCache without a layer, created at the
    first update when the batch and head sizes are known)."""

    is_compileable = False
    is_croppable = True

    def __init__(self, owner: "MhaCache", index: int, window: int, chunk_size: int):
        super().__init__()
        self._owner, self._index = owner, index
        self._window, self._chunk = window, chunk_size
        self.is_sliding = bool(window)
        self.cache: Optional[_api.KVCache] = None  # the mha cache (after the first update)
        self._len = 0  # transformers' length: every position fed, padding included
        self._kept: Optional[Tensor] = None  # [B, _len] bool, which were appended; None = all
        self._pending = None  # (k, v) of the last update, until the attention consumes them
        self._phys: list = []  # the mha cache's sequence id of each batch row (beam search)
        self._desync = False  # a failed append could not be undone: refuse until reset()

    def __repr__(self):
        return (f"MhaCacheLayer(index={self._index}, length={self._len}, window={self._window}, "
                f"chunk_size={self._chunk})")

    # -- transformers' layer protocol --------------------------------------------------------
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        o = self._owner
        B, g, _, d = key_states.shape
        kw = dict(dtype=o.dtype, window=self._window, chunk_size=self._chunk,
                  block_size=o.block_size, num_blocks=o.num_blocks, num_kv_heads=g,
                  head_dim=d, v_head_dim=value_states.shape[3])
        if self._window or self._chunk:
            kw["max_step_tokens"] = o.max_step_tokens
        self.cache = _api.KVCache(None, o.max_seq, B, **kw)
        self._phys = list(range(B))
        if o.fp8_scales is not None:
            ks, vs = o.fp8_scales[self._index] if isinstance(o.fp8_scales, list) \
                else o.fp8_scales
            self.cache.set_fp8_scales(ks, vs)
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        try:
            return self._update(key_states, value_states)
        except Exception:
            self._owner._roll_back(self._len)  # (the layers this forward ran before this one)
            raise

    def _update(self, key_states: Tensor, value_states: Tensor):
        o = self._owner
        if self._pending is not None:
            raise _refuse(f"layer {self._index}: the previous update's keys and values were not "
                          f"consumed by mha's attention (the model's attention implementation "
                          f"must be one registered by mha.torch.register_hf_attention)")
        o._check_implementation()
        if self._desync:
            raise _refuse(f"layer {self._index}: a failed update left part of its keys in the "
                          f"mha cache; reset() the cache")
        for nm, t in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(t, Tensor) or t.dim() != 4:
                raise _refuse(f"{nm} must be a [batch, kv_heads, tokens, head_dim] tensor")
            if t.device.type != "cpu" or t.dtype not in _FLOAT:
                raise _refuse(f"{nm} is {t.dtype} on {t.device}; mha holds float32, bfloat16 "
                              f"and float16 CPU tensors")
        if key_states.shape[:3] != value_states.shape[:3]:
            raise _refuse(f"key_states {tuple(key_states.shape)} and value_states "
                          f"{tuple(value_states.shape)} differ in batch, heads or tokens")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        c = self.cache
        B, g, T, d = key_states.shape
        if (B, g, d, value_states.shape[3]) != (c.batch, c.num_kv_heads, c.head_dim,
                                                c.v_head_dim):
            raise _refuse(f"layer {self._index}: keys [{B}, {g}, {T}, {d}] / values of head size "
                          f"{value_states.shape[3]} do not match the cache made at the first "
                          f"update (batch {c.batch}, {c.num_kv_heads} kv heads, head sizes "
                          f"{c.head_dim} / {c.v_head_dim}); reset() it for another batch")
        self._pending = (key_states, value_states)
        self._len += T
        ks = key_states.new_full((1, 1, 1, 1), float("nan")).expand(B, g, self._len, d)
        vs = value_states.new_full((1, 1, 1, 1), float("nan")).expand(
            B, g, self._len, value_states.shape[3])
        ks._mha_cache_layer = self
        vs._mha_cache_layer = self
        return ks, vs

    def get_mask_sizes(self, query_length: int) -> tuple:
        return self._len + query_length, 0

    def get_seq_length(self) -> int:
        return self._len

    def get_max_length(self) -> int:
        return self._owner.max_seq

    def reset(self) -> None:
        if self.cache is not None:
            for s in range(self.cache.batch):
                self.cache.reset(s)
            self._phys = list(range(self.cache.batch))
        self._len, self._kept, self._pending, self._desync = 0, None, None, False

    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last -tokens_to_remove positions (transformers' convention: a count <= 0;
        0 changes nothing, a positive count is refused as by DynamicLayer)."""
        n = int(tokens_to_remove)
        if n > 0:
            raise _refuse(f"crop({n}): pass a negative count of positions to remove")
        new = self._len + n
        if n == 0 or self.cache is None:
            return
        if new < 0:
            raise _refuse(f"crop({n}) of a cache of {self._len} positions")
        kept = self._kept_mask()
        for b, s in enumerate(self._phys):
            self.cache.truncate(s, int(kept[b, :new].sum()))
        self._kept = None if self._kept is None else self._kept[:, :new]
        self._len = new

    def reorder_cache(self, beam_idx) -> None:
        """Beam search: batch row i becomes a copy of row beam_idx[i]. A row kept by one beam
        keeps its storage (the table of rows is permuted); a row taken by several beams is
        copied (mha_kv_cache_copy: a paged cache shares its blocks) into the storage of a row no
        beam took."""
        if self.cache is None or not self._len:
            return
        src = [int(i) for i in torch.as_tensor(beam_idx).reshape(-1).tolist()]
        B = self.cache.batch
        if len(src) != B or any(not 0 <= i < B for i in src):
            raise _refuse(f"reorder_cache: beam_idx {src} is not {B} row indices")
        free = [self._phys[j] for j in range(B) if j not in set(src)]
        taken, phys = set(), []
        for i in src:
            if i in taken:
                dst = free.pop()
                self.cache.fork(self._phys[i], dst)
                phys.append(dst)
            else:
                taken.add(i)
                phys.append(self._phys[i])
        self._phys = phys
        if self._kept is not None:
            self._kept = self._kept[torch.tensor(src)]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._len:
            raise NotImplementedError("mha.torch.MhaCache: batch_repeat_interleave of a filled "
                                      "cache is not supported")

    def batch_select_indices(self, indices) -> None:
        if self._len:
            raise NotImplementedError("mha.torch.MhaCache: batch_select_indices of a filled "
                                      "cache is not supported")

    # -- the attention (called by mha's registered attention function) -----------------------
    def _kept_mask(self) -> Tensor:
        if self._kept is None:
            return torch.ones(self.cache.batch, self._len, dtype=torch.bool)
        return self._kept

    def _real_tokens(self, mask: Optional[Tensor], T: int, causal: bool) -> Optional[Tensor]:
        """Which of the T new tokens of each sequence are real (appended): None = all. Checks
        that the mask is the cache's rule over the real tokens; ValueError otherwise."""
        B, past = self.cache.batch, self._len - T
        if mask is None:
            if T > 1 and not causal:
                raise _refuse("a non-causal attention (no mask, is_causal=False) cannot read a "
                              "KV cache")
            if self._kept is not None:
                raise _refuse("no attention mask, but the cache holds padding of an earlier "
                              "call: pass the same attention_mask (extended) on every call")
            return None
        if mask.dtype != torch.bool:
            raise _refuse(f"attention_mask must be boolean (sdpa's, as register_hf_attention "
                          f"registers); got {mask.dtype}")
        if mask.dim() != 4 or mask.shape[2] != T or mask.shape[3] != self._len \
                or mask.shape[1] != 1 or mask.shape[0] not in (1, B):
            raise _refuse(f"attention_mask of shape {tuple(mask.shape)}; expected [{B}, 1, {T}, "
                          f"{self._len}]")
        m = mask[:, 0].expand(B, T, self._len)
        ar = torch.arange(T)
        real = m[:, ar, past + ar]  # a real token sees itself; padding sees nothing
        kept = torch.cat([self._kept_mask()[:, :past], real], 1)
        idx = kept.cumsum(1) - 1  # position in the mha cache of each kept column
        qi = idx[:, past:, None]
        ki = idx[:, None, :]
        want = kept[:, None, :] & (ki <= qi)
        if self._window:
            want &= ki > qi - self._window
        if self._chunk:
            want &= torch.div(ki, self._chunk, rounding_mode="floor") == \
                torch.div(qi, self._chunk, rounding_mode="floor")
        # (a padding token's own row is not checked: its output, zeros here, is read by no real
        # token, since no real token sees a padding token's keys)
        if ((m != want) & real[:, :, None]).any():
            raise _refuse(f"layer {self._index}: the attention mask is not the cache's causal "
                          f"rule (window {self._window}, chunk {self._chunk}) over the real "
                          f"tokens (padding may only hide whole tokens); mha's cache cannot "
                          f"compute it")
        if bool(real.all()) and self._kept is None:
            return None
        return real

    def attend(self, query: Tensor, mask: Optional[Tensor], *, scaling: float, softcap: float,
               sinks: Optional[Tensor], causal: bool, dropout: float, threads: int) -> Tensor:
        """Appends the pending K/V (the real tokens) and returns the attention of query
        [B, h, T, d] over the cache: [B, T, h, d_v] in the query's dtype."""
        if self._pending is None:
            raise _refuse(f"layer {self._index}: attention without a pending update")
        k, v = self._pending
        self._pending = None  # (consumed, even if refused below: the error ends the forward)
        past = self._len - k.shape[2]
        try:
            return self._attend(query, k, v, mask, scaling=scaling, softcap=softcap,
                                sinks=sinks, causal=causal, dropout=dropout, threads=threads)
        except Exception:
            # A refused forward changes nothing: this layer and the layers it already ran go
            # back to `past` positions, so that the cache stays usable and its layers agree
            # (before, a refusal left some layers counting tokens they do not hold: the next
            # forward then ran at shifted positions without an error).
            self._owner._roll_back(past)
            raise

    def _attend(self, query: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], *,
                scaling: float, softcap: float, sinks: Optional[Tensor], causal: bool,
                dropout: float, threads: int) -> Tensor:
        # (any operand, not only the query: with a frozen q_proj, a trainable k_proj's or sinks'
        # gradient was dropped without a word until session 48)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (query, k, v, sinks)):
            raise _refuse("the cache is for inference: no gradient flows through it (run under "
                          "torch.no_grad(), or use DynamicCache to train)")
        if dropout:
            raise _refuse(f"dropout {dropout} with a cache (inference): call model.eval()")
        B, h, T, d = query.shape
        c = self.cache
        if B != c.batch or T != k.shape[2] or d != c.head_dim:
            raise _refuse(f"query {tuple(query.shape)} does not match the update "
                          f"({tuple(k.shape)})")
        real = self._real_tokens(mask, T, causal)
        snk = None if sinks is None else sinks.detach().float().reshape(-1).numpy()
        opts = dict(scale=float(scaling), softcap=float(softcap or 0.0), sinks=snk,
                    threads=threads)
        kf = k.detach().float().transpose(1, 2)  # [B, T, g, d]
        vf = v.detach().float().transpose(1, 2)
        qf = query.detach().float().transpose(1, 2)  # [B, T, h, d]
        out = torch.zeros(B, T, h, c.v_head_dim, dtype=torch.float32)
        if real is None:
            self._run(list(range(B)), kf, vf, qf, out, None, opts)
        else:
            counts = real.sum(1).tolist()
            for n in sorted(set(counts)):
                if n:
                    ids = [b for b in range(B) if counts[b] == n]
                    self._run(ids, kf, vf, qf, out, real, opts)
        if real is not None:
            kept = self._kept_mask()[:, :self._len - T]
            self._kept = torch.cat([kept, real], 1)
        return out.to(query.dtype)

    def _run(self, ids: Sequence[int], kf, vf, qf, out, real, opts) -> None:
        """Appends the real tokens of sequences `ids` (each has the same number n) and writes
        their attention rows into out; ring caches in steps of max_step_tokens."""
        c = self.cache
        if real is None:
            k, v, q = kf, vf, qf
            ids_arg = None if self._phys == list(range(len(self._phys))) else self._phys
        else:
            k = torch.stack([kf[b][real[b]] for b in ids])
            v = torch.stack([vf[b][real[b]] for b in ids])
            q = torch.stack([qf[b][real[b]] for b in ids])
            ids_arg = [self._phys[b] for b in ids]
        n = k.shape[1]
        step = c.max_step_tokens if (c.window or c.chunk_size) else n
        res = []
        for s in range(0, n, step):
            e = min(n, s + step)
            c.append(np.ascontiguousarray(k[:, s:e].numpy()),
                     np.ascontiguousarray(v[:, s:e].numpy()), seq_ids=ids_arg)
            res.append(torch.from_numpy(c.attention(
                np.ascontiguousarray(q[:, s:e].numpy()), seq_ids=ids_arg, **opts)))
        o = torch.cat(res, 1)
        if real is None:
            out.copy_(o)
        else:
            for j, b in enumerate(ids):
                out[b][real[b]] = o[j]


class MhaCache(Cache):
    """A transformers ``Cache`` backed by mha's C KV cache (one per decoder layer).

    ``MhaCache(config, max_seq, dtype="float32", block_size=0, num_blocks=0, max_step_tokens=0,
    fp8_scales=None)``: ``config`` the model's config (``model.config``: the layers' sliding
    windows and chunk sizes are read from it, and its attention implementation is checked at
    every update); ``max_seq`` the most positions of a sequence (prompt, padding included, plus
    new tokens); ``dtype`` the storage: "float32" ("f32"), "float16" ("f16"), "bfloat16"
    ("bf16"), "q8_0" (head sizes multiples of 32) or "fp8_e4m3" (``fp8_scales=(k_scales,
    v_scales)`` per kv head for every layer, or a list of such pairs per layer; 1.0 if None);
    ``block_size`` > 0 makes each layer's cache paged (``num_blocks`` blocks, 0 = room for
    every sequence at max_seq); ``max_step_tokens`` the ring slack of sliding-window / chunked
    layers (0 = 64: a prompt is appended in steps of it).

    The model must run mha's attention (``attn_implementation`` = a name registered with
    :func:`mha.torch.register_hf_attention`). Sequences may be left-padded (the padding is not
    stored). Beam search is supported (``reorder_cache``: rows taken by several beams are copied,
    sharing blocks when paged). Not supported (refused with an exception naming it): other
    attention implementations, masks other than the causal /
    sliding-window / chunked rule over the real tokens, gradients, devices other than the CPU.
    ``crop`` (assisted decoding) truncates each sequence. The batch and head sizes are taken at
    the first update; ``reset()`` empties it for reuse with the same batch size."""

    def __init__(self, config, max_seq: int, dtype="float32", *, block_size: int = 0,
                 num_blocks: int = 0, max_step_tokens: int = 0, fp8_scales=None):
        if isinstance(max_seq, bool) or not isinstance(max_seq, int) or max_seq < 1:
            raise _refuse(f"max_seq must be a positive int, got {max_seq!r}")
        if dtype not in _DTYPES:
            raise _refuse(f"dtype must be one of 'float32' ('f32'), 'float16' ('f16'), "
                          f"'bfloat16' ('bf16'), 'q8_0', 'fp8_e4m3', got {dtype!r}")
        self.dtype = _DTYPES[dtype]
        if fp8_scales is not None and self.dtype != "fp8_e4m3":
            raise _refuse(f"fp8_scales given for a {self.dtype} cache")
        self.max_seq, self.block_size, self.num_blocks = max_seq, int(block_size), \
            int(num_blocks)
        self.max_step_tokens = int(max_step_tokens) or 64
        self.config = config
        rules = _layer_rules(config)
        if isinstance(fp8_scales, list) and len(fp8_scales) != len(rules):
            raise _refuse(f"fp8_scales: a list of {len(fp8_scales)} pairs for {len(rules)} "
                          f"layers")
        self.fp8_scales = fp8_scales
        self._checked_name = None
        super().__init__(layers=[MhaCacheLayer(self, i, w, ch)
                                 for i, (w, ch) in enumerate(rules)])

    def _check_implementation(self) -> None:
        name = self.config._attn_implementation
        if name == self._checked_name:  # (checked already; a pending K/V not read by the
            return  # attention is refused at the next update anyway)
        from ._torch_hf import is_mha_attention
        if not is_mha_attention(name):
            raise _refuse(f"the model's attention implementation is {name!r}; MhaCache needs "
                          f"mha's (mha.torch.register_hf_attention(), then "
                          f"attn_implementation='mha' or model.set_attn_implementation('mha'))")
        self._checked_name = name

    def _roll_back(self, past: int) -> None:
        """After a refused forward: every layer holding more than `past` positions (the ones
        this forward updated) is cropped back to it; a layer that cannot go back that far (a
        ring that overwrote them) refuses further updates until reset()."""
        for lay in self.layers:
            if lay._len > past:
                try:
                    lay.crop(past - lay._len)
                except Exception:
                    lay._len = past
                    lay._desync = True

    def free_blocks(self) -> list:
        """Per layer, the free blocks of its paged cache's pool (0 for contiguous caches, None
        before the first update)."""
        return [None if lay.cache is None else lay.cache.free_blocks() for lay in self.layers]

    def lengths(self, layer_idx: int = 0) -> list:
        """The positions each sequence holds in layer ``layer_idx``'s mha cache (padding not
        counted, unlike ``get_seq_length``)."""
        lay = self.layers[layer_idx]
        return [] if lay.cache is None else [lay.cache.length(s) for s in lay._phys]
