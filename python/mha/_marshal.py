# SPDX-License-Identifier: MIT
"""Plain Python values into the C structs of ``_lib``: written once for the NumPy face (_api.py)
and the PyTorch face (torch.py).

Each face checks and converts its own inputs, with the errors its users expect (ValueError and
TypeError in the NumPy API, PyTorch's own RuntimeError/AssertionError texts in the drop-ins), and
hands this module plain ints: data pointers, shapes, element strides, dtype codes. The functions
here fill the structs and call the library; the compiled fast path (_fastcall.c) fills the same
fields the same way for its calls. No array library is imported here and no math is done.
"""
from __future__ import annotations

import ctypes
import os
from typing import Dict, Optional, Sequence, Tuple

from . import _lib as L

_SEED_MASK = 0xFFFFFFFFFFFFFFFF  # mha_dropout.seed is a uint64

_EXECS: Dict[Tuple[int, int], L.mha_exec] = {}
_POOLS: Dict[int, Optional[int]] = {}
_CACHE: Dict[str, Optional[int]] = {}

# Idle bytes this process's mha_block_cache keeps for the next call (blocks freed beyond it go back
# to the system): a training step of (2048, 1024, 16) frees 106 MB per step.
BLOCK_CACHE_IDLE_BYTES = 256 << 20


def _forget_pools() -> None:
    """In a child made by fork(): the parent's pool workers do not exist here, so its pools
    (and the execs pointing at them) are dropped, never used (their memory is not freed); so is
    the block cache, whose mutex another parent thread may have held."""
    _POOLS.clear()
    _EXECS.clear()
    _CACHE.clear()


os.register_at_fork(after_in_child=_forget_pools)


def pool_for(threads) -> Optional[int]:
    """The address of this process's thread pool for `threads` threads (0 = every online CPU),
    made at the first call that asks for it and kept for the life of the process (a decode
    loop or a training step then starts no thread per call); None for 1 thread, for a value the
    library will refuse, or when the pool cannot be made (calls then start their threads)."""
    if type(threads) is not int or threads == 1 or not 0 <= threads <= 1024:
        return None
    size = threads or int(L.mha_default_threads())
    if size == 1:
        return None
    if size not in _POOLS and len(_POOLS) < 16:
        handle = ctypes.c_void_p()
        err = L.mha_error()
        ok = L.mha_threadpool_create(size, None, ctypes.byref(handle), err) == 0
        _POOLS[size] = handle.value if ok else None
    return _POOLS.get(size)


def block_cache_allocator() -> Optional[int]:
    """The address of the mha_allocator of this process's mha_block_cache (made at the first call,
    kept for the life of the process, BLOCK_CACHE_IDLE_BYTES idle at most): calls repeated with
    the same shapes (a training loop's forward_train and backward) then reuse their memory
    instead of faulting in fresh pages every call. None when it cannot be made (calls then
    allocate with malloc)."""
    if "allocator" not in _CACHE:
        handle = ctypes.c_void_p()
        ok = L.mha_block_cache_create(BLOCK_CACHE_IDLE_BYTES, ctypes.byref(handle),
                                      L.mha_error()) == 0
        _CACHE["allocator"] = L.mha_block_cache_allocator(handle) if ok else None
    return _CACHE["allocator"]


def exec_struct(impl: int, threads: int) -> L.mha_exec:
    """The mha_exec of (impl code, threads), the one place Python fills one. Built once per
    pair and shared (the library only reads it; saves ~1 us per call); threads that are not a
    plain int are not cached; `pool` is this process's pool for that many threads (pool_for),
    `allocator` this process's block cache (block_cache_allocator), workspace stays NULL. The
    caller has checked both values or lets the library do it."""
    ex = _EXECS.get((impl, threads))
    if ex is None:
        ex = L.mha_exec()
        ex.impl = impl
        ex.n_threads = threads
        ex.pool = pool_for(threads)
        ex.allocator = block_cache_allocator()
        if type(threads) is int and len(_EXECS) < 256:
            _EXECS[(impl, threads)] = ex
    return ex


def call(fn, *args) -> None:
    """fn(*args, &error) for a libmha function whose last argument is the mha_error; raises
    MhaError with the library's message for a non-OK status. Structs are passed as they are
    (ctypes passes them by reference): ~2 us cheaper per call than ctypes.byref objects."""
    err = L.mha_error()
    L.check(fn(*args, err), err)


# ------------------------------------------------------------------------------------------------
# Masks and dropout (mha_masking, mha_dropout)
# ------------------------------------------------------------------------------------------------
def no_window(mk: L.mha_masking) -> None:
    """window (-1, -1): unbounded on both sides. A zeroed mha_masking is otherwise "no masking"."""
    mk.window_left = mk.window_right = -1


def causal_top_left(mk: L.mha_masking) -> None:
    """PyTorch's is_causal: key j visible from query i iff j <= i (docs/SEMANTICS.md)."""
    mk.causal = 1
    mk.alignment = L.ALIGN_TOP_LEFT


def set_mask_tensor(t: L.mha_mask_tensor, data: int, dtype: int, shape: Sequence[int]) -> None:
    """Points a mha_mask_tensor at C-order memory: data pointer, mha_dtype code, 1 to 4 dims
    (ValueError otherwise: the struct holds 4, and C reads the product of them from data)."""
    if not 1 <= len(shape) <= L.MAX_MASK_DIMS:
        raise ValueError(f"a mask has 1 to {L.MAX_MASK_DIMS} dimensions, got shape "
                         f"{tuple(shape)}")
    t.data = data
    t.dtype = dtype
    t.ndim = len(shape)
    for i, s in enumerate(shape):
        t.shape[i] = s


def set_dropout(d: L.mha_dropout, p: float, seed: int) -> None:
    """Dropout probability p (the caller checked 0 <= p < 1) with the counter-based RNG keyed by
    seed (taken modulo 2^64); p = 0 leaves dropout off."""
    d.p = float(p)
    d.seed = int(seed) & _SEED_MASK
    d.training = 1 if p > 0 else 0


def scale_value(scale: Optional[float], message: str) -> float:
    """The scale as libmha reads it: None -> 0.0, which means 1/sqrt(d_k). An explicit 0 would
    silently mean the same, so it is refused with ValueError(message)."""
    if scale is not None and scale == 0:
        raise ValueError(message)
    return float(scale or 0.0)


# ------------------------------------------------------------------------------------------------
# The attention core (mha_attention_args, mha_attention_grads)
# ------------------------------------------------------------------------------------------------
Operand = Tuple[int, Sequence[int], Sequence[int]]  # (data pointer, [B, heads, L, d], strides)


def attention_args(q: Operand, k: Operand, v: Operand, scale: float) -> L.mha_attention_args:
    """mha_attention_args for q [B, h, n, d], k [B, g, m, d], v [B, g, m, d_v], each given as
    (data pointer, shape, element strides {batch, head, row}); the caller checked that the shapes
    agree. Masks, dropout and outputs are left zeroed (off) except the unbounded window."""
    (qp, (B, h, n, d), qs), (kp, kshape, ks), (vp, vshape, vs) = q, k, v
    a = L.mha_attention_args()
    a.batch, a.num_heads, a.num_kv_heads, a.q_len, a.kv_len = B, h, kshape[1], n, kshape[2]
    a.head_dim, a.v_head_dim = d, vshape[3]
    a.scale = scale
    a.q, a.k, a.v = qp, kp, vp
    a.q_strides[:] = qs
    a.k_strides[:] = ks
    a.v_strides[:] = vs
    no_window(a.mask)
    return a


def set_strided(s: ctypes.Structure, name: str, data: int, strides: Sequence[int]) -> None:
    """Field `name` of s (out, dout, dq, dk, dv) and its `name`_strides: a [B, heads, L, d]
    tensor with element strides {batch, head, row}."""
    setattr(s, name, data)
    getattr(s, name + "_strides")[:] = strides


# ------------------------------------------------------------------------------------------------
# The layer (mha_forward_args, mha_layer_forward[_train], mha_layer_backward)
# ------------------------------------------------------------------------------------------------
def forward_args(batch: int, q_len: int, kv_len: int, query: int, key: Optional[int] = None,
                 value: Optional[int] = None) -> L.mha_forward_args:
    """mha_forward_args for query [batch, q_len, q_dim] and, unless None (self-attention; value =
    key), key/value [batch, kv_len, k_dim/v_dim]: data pointers of C-order float32 memory. Masks,
    positions, dropout and outputs are left zeroed (off) except the unbounded window."""
    a = L.mha_forward_args()
    a.batch, a.q_len, a.kv_len = batch, q_len, kv_len
    a.query = query
    if key is not None:  # (setting a NULL field costs as much as any other)
        a.key, a.value = key, value
    no_window(a.mask)
    return a


def layer_forward(layer: int, a: L.mha_forward_args, ex: L.mha_exec, train: bool) -> Optional[int]:
    """mha_layer_forward, or with `train` mha_layer_forward_train, whose mha_train_state pointer
    (owned by the caller, freed with mha_train_state_destroy) is returned."""
    if not train:
        call(L.mha_layer_forward, layer, a, ex)
        return None
    st = ctypes.c_void_p()
    call(L.mha_layer_forward_train, layer, a, ex, st)
    return st.value
