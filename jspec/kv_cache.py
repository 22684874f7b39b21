"""Committing the accepted path's K/V in the target's cache.

The verify pass wrote the K/V of all T tree nodes at slots cache_len .. cache_len + T - 1 (node i at
cache_len + i). The accepted path (root first) must end up contiguous::

    before:  | committed | root | n1 | n2 | n3 | n4 | ... |      accepted path: root, n2, n4
    after:   | committed | root | n2 | n4 | (garbage ...)       cache_len advances by the committed count

Path node ids increase along the path and i <= accept_index[i], so reading every source row before writing any
destination row (one gather, one scatter) is safe. Rows past the committed count land in the garbage region.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.attention import KVCache
from models.paged_kv import PagedKV, move_paged


def commit_path(cache: KVCache, accept_index: jax.Array, cache_len: jax.Array) -> KVCache:
    """Moves the accepted path's K/V to cache[b, cache_len[b] : cache_len[b] + D + 1] in every layer.

    cache: per layer (``KVCache.k``, ``KVCache.v``: tuples of num_layers arrays [B, S, Hkv, D], or of
    ``models.paged_kv.PagedKV``: the move goes through each row's page table);
    accept_index: i32[B, D + 1] local node ids of the accepted path, root first, -1 padded; cache_len: i32[B].
    Slots before cache_len are untouched; padded (-1) entries copy the root's row into the garbage region.
    """
    if not cache.per_layer:
        raise ValueError(f"commit_path expects a per-layer cache (tuples of [B, S, Hkv, D]); got a stacked "
                         f"{cache.k.shape} buffer")
    batch, width = accept_index.shape
    rows = jnp.arange(batch)[:, None]
    source = cache_len[:, None] + jnp.maximum(accept_index, 0)
    target = cache_len[:, None] + jnp.arange(width)[None]

    def move(buffer: jax.Array | PagedKV) -> jax.Array | PagedKV:  # [B, S, Hkv, D] or pages
        if isinstance(buffer, PagedKV):
            return move_paged(buffer, source, target)
        return buffer.at[rows, target].set(buffer[rows, source])

    return jax.tree.map(move, cache, is_leaf=lambda x: isinstance(x, PagedKV))
