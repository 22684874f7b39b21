"""The attention a decoder layer calls, and the KV cache it reads.

The model writes the K/V of its T new tokens into the cache at slots ``cache_len[b] .. cache_len[b] + T - 1``
before it attends, then calls an injectable ``AttentionFn``. Which new tokens a query sees is ``local_mask``:

- ``None``: a causal continuation (prefill, plain decode): new token i sees new tokens 0..i.
- ``bool[B, T, T]``: an arbitrary mask over the new tokens (a draft tree: node j visible to node i iff j is i or
  an ancestor of i).

Every query sees all cache slots ``< cache_len[b]``. Cache slots at or past ``cache_len[b] + T`` hold garbage and
are never read. Cache layout of one layer, one sequence::

    slot:   0 ........ cache_len-1 | cache_len ... cache_len+T-1 | ... S-1
            committed tokens        | the T new tokens            | unused (garbage)

``AttentionFn(q, k_cache, v_cache, k_new, v_new, cache_len, local_mask, *, scale) -> out`` with
q: [B, T, Hq, D]; k_cache, v_cache: [B, S, Hkv, D] (already holding the new tokens); k_new, v_new:
[B, T, Hkv, D]; cache_len: i32[B]; out: [B, T, Hq, D]. An implementation may read the new tokens from the cache
or from k_new/v_new (the tree-attention kernel does the latter).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp


class KVCache(NamedTuple):
    """Per-layer key and value buffers: k, v: [num_layers, B, S, Hkv, D]."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, num_layers: int, batch: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
              dtype) -> "KVCache":
        shape = (num_layers, batch, max_seq_len, num_kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


class AttentionFn(Protocol):
    def __call__(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, k_new: jax.Array,
                 v_new: jax.Array, cache_len: jax.Array, local_mask: jax.Array | None, *,
                 scale: float) -> jax.Array: ...


def visibility_mask(cache_len: jax.Array, local_mask: jax.Array | None, num_new: int,
                    cache_size: int) -> jax.Array:
    """bool[B, T, S]: whether query i may read cache slot s (committed, or a new token its mask allows)."""
    rel = jnp.arange(cache_size)[None, None, :] - cache_len[:, None, None]  # [B, 1, S]
    committed = rel < 0
    query = jnp.arange(num_new)[None, :, None]  # [1, T, 1]
    if local_mask is None:
        new = (rel >= 0) & (rel <= query)
    else:
        column = jnp.broadcast_to(jnp.clip(rel, 0, num_new - 1), (cache_len.shape[0], num_new, cache_size))
        new = (rel >= 0) & (rel < num_new) & jnp.take_along_axis(local_mask, column, axis=2)
    return committed | new


def dense_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, k_new: jax.Array, v_new: jax.Array,
                    cache_len: jax.Array, local_mask: jax.Array | None, *, scale: float) -> jax.Array:
    """Attention over the whole cache through ``jax.nn.dot_product_attention`` (GQA native; cuDNN on GPU)."""
    del k_new, v_new  # already in the cache
    mask = visibility_mask(cache_len, local_mask, q.shape[1], k_cache.shape[1])
    # A masked score's weight is exactly 0, but 0 * NaN is NaN: zero the values of slots no query reads, so
    # garbage in unused slots can never reach the output.
    read = jnp.any(mask, axis=1)[:, :, None, None]  # [B, S, 1, 1]
    v_cache = jnp.where(read, v_cache, jnp.zeros((), v_cache.dtype))
    return jax.nn.dot_product_attention(q, k_cache, v_cache, mask=mask[:, None], scale=scale)


def write_new_tokens(cache: jax.Array, new: jax.Array, cache_len: jax.Array) -> jax.Array:
    """Writes new: [B, T, H, D] into cache: [B, S, H, D] at slots cache_len[b] .. cache_len[b] + T - 1.

    The caller guarantees cache_len[b] + T <= S (dynamic_update_slice would clamp, not fail).
    """
    def one(c, n, start):
        return jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (start, 0, 0))

    return jax.vmap(one)(cache, new, cache_len)
