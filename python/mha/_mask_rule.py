# SPDX-License-Identifier: MIT
"""Mask tensors that equal a built-in rule (issue 29), for the PyTorch drop-ins.

Before a mask tensor goes to C, :func:`lookup` asks ``mha_mask_recognize`` (one exact pass over the
tensor's distinct elements; docs/SEMANTICS.md, "Recognised masks") whether it is a causal /
sliding-window band (possibly chunked causal: Llama 4), key padding, both, or hides nothing, and
:func:`substitute` turns the answer into ``mha_masking`` fields (causal, alignment, window, chunk
size, key padding) when they give exactly the
tensor's results together with the call's own rules; the kernels then never read the tensor per
score.

The answer is cached per process for the last ``CACHE_SIZE`` tensors (LRU), keyed by the tensor's
identity AND contents version: a weak reference to the tensor object (checked with ``is``: a freed
tensor's entry dies with it, and a new tensor at the same address is never taken for it),
data_ptr, storage_offset, shape, stride, dtype and ``t._version`` (bumped by every in-place
operation torch sees), plus the sizes it was recognised for. Writes that bypass torch's version
counter (through ``.numpy()``, a DLPack capsule, ctypes) are not seen: docs/PYTHON.md.

A mask tensor that is no rule gets its block mask (``mha_block_mask``, a bit per score:
docs/SEMANTICS.md, "Block masks") built once and cached the same way (:func:`block_mask`, the last
``BLOCK_CACHE_SIZE`` tensors), so the forward and the backward of a step, and the steps after it
with the same tensor, read the tensor once.
"""
from __future__ import annotations

import ctypes as C
import threading
import weakref
from collections import OrderedDict
from typing import Optional

import torch
from torch import Tensor

from . import _lib as L
from . import _marshal as M

CACHE_SIZE = 32
BLOCK_CACHE_SIZE = 8  # a block mask is n m / 8 bytes per distinct (batch row, head) plane
# False: never recognise (every mask tensor goes to C as it is; the tests compare both paths).
enabled = True
# False: no block mask cache (every call builds its own in C).
block_masks = True
# Calls made to the C recognizer in this process (the cache's tests count hits with it).
recognize_calls = 0

_CODES = {torch.bool: L.DTYPE_BOOL, torch.uint8: L.DTYPE_U8, torch.int32: L.DTYPE_I32,
          torch.int64: L.DTYPE_I64, torch.float32: L.DTYPE_F32}
_cache: "OrderedDict[tuple, tuple]" = OrderedDict()
_blocks: "OrderedDict[tuple, tuple]" = OrderedDict()
# Block masks built in this process (the tests count reuse with it).
block_mask_builds = 0
_lock = threading.Lock()


class Rule:
    """A recognised mask: visible iff lo <= j - i <= hi (None = unbounded) and keys[b, j] != 0
    (keys: uint8 [B, m], None = every key real) and, with chunk = C > 0 (then hi is not None),
    j // C == (i + hi) // C (chunked causal, mha_mask_rule.chunk_size)."""
    __slots__ = ("lo", "hi", "keys", "chunk")

    def __init__(self, lo: Optional[int], hi: Optional[int], keys: Optional[Tensor],
                 chunk: int = 0):
        self.lo, self.hi, self.keys, self.chunk = lo, hi, keys, chunk


def _edges(r: L.mha_mask_rule):
    """(lo, hi) of a C rule: the band's diagonal offsets, None where unbounded (mha.h's formula
    j <= p (causal), p - left <= j <= p + right (window), p = i + delta)."""
    lo = hi = None
    if r.causal:
        hi = r.delta
    if r.use_window:
        if r.window_right >= 0:
            hi = r.delta + r.window_right if hi is None else min(hi, r.delta + r.window_right)
        if r.window_left >= 0:
            lo = r.delta - r.window_left
    return lo, hi


def _recognise(data: Tensor, additive: bool, polarity: int, B: int, h: int, n: int,
               m: int) -> Optional[Rule]:
    global recognize_calls
    recognize_calls += 1
    t = L.mha_mask_tensor()
    M.set_mask_tensor(t, data.data_ptr(), _CODES[data.dtype], data.shape)
    rule = L.mha_mask_rule()
    keys = torch.empty((B, m), dtype=torch.uint8)
    M.call(L.mha_mask_recognize, t, 1 if additive else 0, polarity, B, h, n, m, rule,
           keys.data_ptr())
    if rule.kind == L.MASK_RULE_NONE:
        return None
    lo, hi = _edges(rule)
    padded = rule.kind in (L.MASK_RULE_KEY_PADDING, L.MASK_RULE_BAND_AND_KEY_PADDING)
    return Rule(lo, hi, keys if padded else None, int(rule.chunk_size))


def lookup(src: Tensor, data: Tensor, additive: bool, polarity: int, B: int, h: int, n: int,
           m: int) -> Optional[Rule]:
    """The rule the mask `data` (C-contiguous, broadcastable to [B, h, n, m]; a bool/integer mask
    read with `polarity`, or an additive float32 one) equals, or None; cached under the identity
    of `src`, the caller's tensor that `data` was made from (often `data` itself)."""
    if not enabled:
        return None
    key = _identity(src) + (data.dtype, additive, polarity, B, h, n, m)
    return _cached(_cache, CACHE_SIZE, key, src,
                   lambda: _recognise(data, additive, polarity, B, h, n, m))


def _identity(src: Tensor) -> tuple:
    """What a cache entry is keyed by: the tensor object and its contents version."""
    return (id(src), src.data_ptr(), src.storage_offset(), tuple(src.shape), src.stride(),
            src.dtype, src._version)


def _cached(table: "OrderedDict[tuple, tuple]", size: int, key: tuple, src: Tensor, make):
    """table[key]'s value when its weak reference still is `src`, else make()'s, stored under
    key (LRU, at most `size` entries; the entry dies with `src`)."""
    with _lock:
        hit = table.get(key)
        if hit is not None and hit[0]() is src:
            table.move_to_end(key)
            return hit[1]
    value = make()

    def forget(_ref, key=key):
        with _lock:
            entry = table.get(key)
            if entry is not None and entry[0] is _ref:
                del table[key]

    with _lock:
        table[key] = (weakref.ref(src, forget), value)
        table.move_to_end(key)
        while len(table) > size:
            table.popitem(last=False)
    return value


def clear() -> None:
    """Forgets every cached recognition and block mask."""
    with _lock:
        _cache.clear()
        _blocks.clear()


def substitute(mk: L.mha_masking, keep: list, rule: Optional[Rule], additive: bool, B: int,
               n: int, m: int, own_delta: int, own_lo: Optional[int], own_hi: Optional[int],
               alibi: bool) -> bool:
    """Writes `rule` AND the call's own band (own_lo <= j - i <= own_hi, None = unbounded; the
    call's diagonal offset own_delta) into mk's causal, alignment, window and key padding, and
    returns True, when that is exactly the tensor's result; False (mk untouched: keep the tensor)
    otherwise. Exactly means:
      - the intersection of two bands is one band, lo = max, hi = min; an empty one is kept as a
        tensor (rare);
      - with ALiBi the alignment also places the ALiBi distance, so the delta stays the call's:
        the band must then be a window around it (lo <= own_delta <= hi);
      - a tensor's fully hidden tiles are skipped as a rule's are (the block mask), so a bool or
        additive mask and its rule give the same bits (docs/SEMANTICS.md, "Recognised masks");
      - a chunk (the rule's, or mk's own chunk_size, e.g. a Llama 4 model's) is placed by the
        alignment: the rule's chunk needs the final delta to be the rule's hi, mk's own needs it
        to stay own_delta, and two chunks must be one (same C).
    mk must have no key padding of its own; keep gets the tensors mk points at."""
    if rule is None:
        return False
    own_chunk = int(mk.chunk_size)
    if rule.chunk and own_chunk and (own_chunk != rule.chunk or rule.hi != own_delta):
        return False
    los = [x for x in (rule.lo, own_lo) if x is not None]
    his = [x for x in (rule.hi, own_hi) if x is not None]
    lo, hi = (max(los) if los else None), (min(his) if his else None)
    if lo is not None and hi is not None and lo > hi:
        return False
    if alibi:
        if (hi is not None and hi < own_delta) or (lo is not None and lo > own_delta):
            return False
        delta = own_delta
        causal = hi == delta
        left = -1 if lo is None else delta - lo
        right = -1 if hi is None else hi - delta
    elif hi is not None:
        delta, causal, left, right = hi, True, (-1 if lo is None else hi - lo), 0
    else:
        delta, causal, left, right = (0 if lo is None else lo), False, 0, -1
    if rule.chunk and delta != rule.hi:
        return False  # the call's own band moved the diagonal the chunk is placed by
    if own_chunk and (lo is not None or hi is not None) and delta != own_delta:
        return False  # the new alignment would move the call's own chunk
    mk.causal = 1 if causal else 0
    mk.use_window = 1 if (left >= 0 or right > 0) and (lo is not None or hi is not None) else 0
    mk.window_left, mk.window_right = (left, right) if mk.use_window else (-1, -1)
    if lo is None and hi is None:
        mk.causal = 0
    if not alibi and (mk.causal or mk.use_window):
        if delta == m - n:
            mk.alignment = L.ALIGN_BOTTOM_RIGHT
        elif delta == 0:
            mk.alignment = L.ALIGN_TOP_LEFT
        else:
            offsets = torch.full((B,), delta, dtype=torch.int64)
            keep.append(offsets)
            mk.alignment = L.ALIGN_EXPLICIT
            mk.align_offsets = offsets.data_ptr()
    if rule.chunk:
        mk.chunk_size = rule.chunk
    if rule.keys is not None:
        keep.append(rule.keys)
        M.set_mask_tensor(mk.key_padding, rule.keys.data_ptr(), L.DTYPE_U8, rule.keys.shape)
    return True


class BlockMask:
    """A C block mask (mha_block_mask) and, when the caller's tensor was not contiguous, the
    contiguous copy it points at (a contiguous tensor is the caller's own: not held here, so the
    cache entry dies with it). Destroyed when the last call holding it is done."""
    __slots__ = ("ptr", "data")

    def __init__(self, ptr: int, data: Optional[Tensor]):
        self.ptr, self.data = ptr, data

    def __del__(self):
        L.mha_block_mask_destroy(self.ptr)


def block_mask(src: Tensor, data: Tensor, additive: bool, a: L.mha_attention_args,
               ex: L.mha_exec) -> BlockMask:
    """The block mask of the call `a`, whose one mask tensor `data` (C-contiguous, made from the
    caller's `src`) is already set in a.mask: from the cache (same tensor, same version, same
    sizes) or built now. The caller points a.mask at the returned .data when it is not None."""
    key = _identity(src) + (additive, a.mask.bool_mask_polarity, a.batch, a.num_heads, a.q_len,
                            a.kv_len)

    def build() -> BlockMask:
        global block_mask_builds
        ptr = C.c_void_p()
        M.call(L.mha_block_mask_create, a, ex, C.byref(ptr))
        block_mask_builds += 1
        return BlockMask(ptr.value, None if data is src else data)

    return _cached(_blocks, BLOCK_CACHE_SIZE, key, src, build)
