# SPDX-License-Identifier: MIT
"""mha from Equinox: :class:`MultiheadAttention`, a drop-in for ``eqx.nn.MultiheadAttention``.

    import mha.equinox
    att = mha.equinox.MultiheadAttention(8, 512, key=jax.random.PRNGKey(0))
    y = jax.vmap(att)(xq, xk, xv)                     # [batch, q_seq, 512]

It IS an ``eqx.nn.MultiheadAttention`` (a subclass): the same constructor, the same fields
(query_proj, key_proj, value_proj, output_proj, dropout, num_heads, query_size, ..., so the same
initialisation from the same key, and serialisation and tree surgery see the same tree) and the
same call and mask convention (bool [q_seq, kv_seq] or [num_heads, q_seq, kv_seq], True = may
attend). Only the attention itself differs: mha.jax.dot_product_attention (the C library through
XLA's FFI) instead of Equinox's einsum-softmax-einsum. Differences (docs/PYTHON.md, "JAX"): a
query row with every key masked gives zeros (Equinox: the mean of the values); the attention is
computed in float32; dropout on the attention weights is refused (call it with inference=True or
build it with dropout_p=0).
"""
from __future__ import annotations

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp

from .jax import dot_product_attention

__all__ = ["MultiheadAttention"]


class MultiheadAttention(eqx.nn.MultiheadAttention):
    """``eqx.nn.MultiheadAttention`` with its attention computed by mha (see the module doc)."""

    def __call__(self, query, key_, value, mask=None, *, key=None, inference=None,
                 deterministic=None, process_heads=None):
        """query [q_seq, query_size], key_ [kv_seq, key_size], value [kv_seq, value_size],
        mask bool [q_seq, kv_seq] or [num_heads, q_seq, kv_seq] (True = may attend); returns
        [q_seq, output_size]. ``key`` (dropout) is unused: dropout is refused."""
        del key
        if deterministic is not None:
            inference = deterministic
            warnings.warn("MultiheadAttention()(deterministic=...) is deprecated in favour of "
                          "MultiheadAttention()(inference=...)")
        if inference is None:
            inference = self.dropout.inference
        if self.dropout.p > 0 and not inference:
            raise NotImplementedError(
                "mha.equinox.MultiheadAttention: dropout on the attention weights "
                f"(dropout_p={self.dropout.p}) is not supported; call with inference=True or "
                "build the layer with dropout_p=0")
        n, m = query.shape[0], key_.shape[0]
        if value.shape[0] != m:
            raise ValueError("key and value must both be sequences of equal length.")
        heads = [jax.vmap(proj)(x).reshape(x.shape[0], self.num_heads, -1) for proj, x in
                 ((self.query_proj, query), (self.key_proj, key_), (self.value_proj, value))]
        if process_heads is not None:
            shapes = [h.shape for h in heads]
            heads = list(process_heads(*heads))
            if [h.shape for h in heads] != shapes:
                raise ValueError("process_heads must not change the shape of the heads.")
        q, k, v = (h[None] for h in heads)  # [1, L, heads, d]: JAX's layout, batch 1
        attn = dot_product_attention(q, k, v, mask=_mask4(mask, self.num_heads, n, m))
        return jax.vmap(self.output_proj)(attn.reshape(n, -1))


def _mask4(mask, num_heads, n, m):
    """Equinox's mask, [n, m] or [num_heads, n, m], as dot_product_attention's [1, 1|h, n, m]
    bool (nonzero = may attend, as Equinox's jnp.where reads it)."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.shape not in ((n, m), (num_heads, n, m)):
        raise ValueError(f"mask must have shape (query_seq_length, kv_seq_length)=({n}, {m}) or "
                         f"(num_heads, query_seq_length, kv_seq_length)=({num_heads}, {n}, {m}). "
                         f"Got {mask.shape}.")
    return mask.astype(jnp.bool_).reshape((1,) * (4 - mask.ndim) + mask.shape)
