"""A layer's K or V in pages, and the attention that reads it through a page table.

:class:`PagedKV` stands where a dense ``[B, S, Hkv, D]`` buffer stands in a per-layer ``KVCache``: the model
writes its new tokens with :func:`write_paged` and the attention function reads the committed prefix through the
table. Row b's position p lives at ``pages[page_table[b, p // page_size], p % page_size]``::

    page_table[b]:  [ 7 | 3 | 12 | 0 | 0 ]        0: the null page (never -1: a gather would wrap it)
    positions:        0..15 16..31 32..47 48..     a row's positions past its pages read and write the null page

Pages may be shared between rows (a cached prefix): they hold committed tokens, and a row writes only at
positions from its committed length on, which lie in pages of its own.

:func:`paged_attention` is the attention of a verify pass (T tree nodes under a T x T mask) or a causal
continuation over a paged cache, with no dense prefix mask: (a) the committed prefix through the page table under
a length mask, (b) the T new tokens' own K/V under the tree (or causal) mask, the two softmax partials merged by
log-sum-exp, as ``pallas_kernels.tree_attention``'s kernel merges its splits. It is the jnp reference: it gathers a
row's pages into one array per layer, which a paged kernel reads in place.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# What a masked score becomes: finite, so exp(masked - max) underflows to 0 and a row that sees nothing in one
# partial never turns into NaN (inf - inf).
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


class PagedKV(NamedTuple):
    """One layer's K (or V) in pages. pages: [num_pages, page_size, Hkv, D]; page_table: i32[B, P], row b's
    pages in position order (0 past its last one)."""

    pages: jax.Array
    page_table: jax.Array

    @property
    def page_size(self) -> int:
        return self.pages.shape[1]


def page_slots(page_table: jax.Array, positions: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """(page, offset) i32[B, N] each where positions i32[B, N] live; a position past the table (or negative) maps
    to the null page 0."""
    column = positions // page_size
    inside = (column >= 0) & (column < page_table.shape[1])
    page = jnp.take_along_axis(page_table, jnp.clip(column, 0, page_table.shape[1] - 1), axis=1)
    return jnp.where(inside, page, 0), positions % page_size


def write_paged(cache: PagedKV, new: jax.Array, start: jax.Array) -> PagedKV:
    """Writes new: [B, T, Hkv, D] at positions start[b] .. start[b] + T - 1 of each row."""
    positions = start[:, None] + jnp.arange(new.shape[1], dtype=start.dtype)[None]
    page, offset = page_slots(cache.page_table, positions, cache.page_size)
    return cache._replace(pages=cache.pages.at[page, offset].set(new.astype(cache.pages.dtype)))


def read_paged(cache: PagedKV, positions: jax.Array) -> jax.Array:
    """The K (or V) at positions i32[B, N] of each row -> [B, N, Hkv, D]."""
    page, offset = page_slots(cache.page_table, positions, cache.page_size)
    return cache.pages[page, offset]


def move_paged(cache: PagedKV, source: jax.Array, target: jax.Array) -> PagedKV:
    """Copies each row's positions ``source`` i32[B, N] to ``target`` i32[B, N]: every source read before any
    target is written."""
    page, offset = page_slots(cache.page_table, target, cache.page_size)
    return cache._replace(pages=cache.pages.at[page, offset].set(read_paged(cache, source)))


def paged_attention(q: jax.Array, k_cache: PagedKV, v_cache: PagedKV, k_new: jax.Array, v_new: jax.Array,
                    cache_len: jax.Array, local_mask: jax.Array | None, write_offset: jax.Array | int, *,
                    scale: float, window: int | jax.Array | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """An ``models.attention.AttentionFn`` over paged K/V for new tokens that fill their window from its start
    (a verify pass: local_mask bool[B, T, T]; a causal continuation: None): query i reads positions
    ``< cache_len[b]`` through the page table and new token j where the mask allows (causal: j <= i), from
    k_new/v_new. q: [B, T, Hq, D]; k_new, v_new: [B, T, Hkv, D]; cache_len: i32[B] -> [B, T, Hq, D] in q's dtype.
    A sliding ``window`` and ``sinks`` f32[Hq] as ``models.attention.AttentionFn`` defines them: a query at depth i
    (position cache_len + i) reads prefix positions > cache_len + i - window and tree nodes less than window deep
    above it; each sink joins its head's denominator as a third partial that reads no value.

    Logits and the softmax in float32, as ``models.attention.grouped_attention``'s; the weights meet V in V's dtype.
    """
    batch, num_new, num_heads, head_dim = q.shape
    static_zero = isinstance(write_offset, (int, np.integer)) and int(write_offset) == 0
    if not static_zero or (local_mask is not None and local_mask.shape[2] != num_new):
        raise ValueError(f"paged_attention reads new tokens from k_new/v_new: it needs them at the window's start "
                         f"(write_offset the int 0, got {write_offset!r}) and a window of T={num_new} slots (got a "
                         f"mask of shape {None if local_mask is None else local_mask.shape})")
    if local_mask is None:
        local_mask = jnp.broadcast_to(jnp.tril(jnp.ones((num_new, num_new), bool)), (batch, num_new, num_new))
    kv_heads = k_new.shape[2]
    grouped = q.reshape(batch, num_new, kv_heads, num_heads // kv_heads, head_dim)

    pages = k_cache.page_table.shape[1]
    keys = k_cache.pages[k_cache.page_table].reshape(batch, pages * k_cache.page_size, kv_heads, head_dim)
    values = v_cache.pages[v_cache.page_table].reshape(keys.shape)
    positions = jnp.arange(keys.shape[1])[None]
    committed = positions < cache_len[:, None]  # [B, S]
    if window is not None:  # out of every query's window: pages a windowed pool may have let go (the null page's)
        committed = committed & (positions > cache_len[:, None] - window)
    values = jnp.where(committed[:, :, None, None], values, jnp.zeros((), values.dtype))  # 0 * NaN is NaN
    prefix_mask, fresh_mask = committed[:, None, :], local_mask
    if window is not None:
        depth = jnp.sum(local_mask, axis=2, dtype=jnp.int32) - 1  # [B, T]: each node's position - cache_len
        query = cache_len[:, None] + depth
        prefix_mask = prefix_mask & (positions[:, None, :] > query[:, :, None] - window)
        fresh_mask = fresh_mask & (depth[:, :, None] - depth[:, None, :] < window)
    prefix = _partial(grouped, keys, values, prefix_mask, scale)
    fresh = _partial(grouped, k_new, v_new, fresh_mask, scale)
    out = _merge(prefix, fresh, None if sinks is None else sinks.reshape(kv_heads, num_heads // kv_heads))
    return out.reshape(batch, num_new, num_heads, head_dim).astype(q.dtype)


def _partial(grouped: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array, scale: float):
    """One softmax partial: grouped [B, T, Hkv, G, D] over keys, values [B, S, Hkv, D] where mask bool[B, T or 1,
    S] -> (out f32[B, T, Hkv, G, D] unnormalised, max, sum f32[B, Hkv, G, T])."""
    logits = jnp.einsum("btkgd,bskd->bkgts", grouped, keys, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask[:, None, None], logits, _MASKED)
    peak = jnp.max(logits, axis=-1)
    weights = jnp.where(mask[:, None, None], jnp.exp(logits - peak[..., None]), 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", weights.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return out, peak, jnp.sum(weights, axis=-1)


def _merge(first, second, sinks: jax.Array | None = None) -> jax.Array:
    """Two partials of :func:`_partial` merged by log-sum-exp -> f32[B, T, Hkv, G, D]; sinks f32[Hkv, G]: a logit
    per head added to the denominator (a partial of sum 1 at that logit, reading nothing)."""
    (out_a, max_a, sum_a), (out_b, max_b, sum_b) = first, second
    peak = jnp.maximum(max_a, max_b)
    if sinks is not None:
        sink = sinks.astype(jnp.float32)[None, :, :, None]  # [1, Hkv, G, 1]
        peak = jnp.maximum(peak, sink)
    scale_a, scale_b = jnp.exp(max_a - peak), jnp.exp(max_b - peak)  # [B, Hkv, G, T]
    total = sum_a * scale_a + sum_b * scale_b
    if sinks is not None:
        total = total + jnp.exp(sink - peak)

    def rows(x):  # [B, Hkv, G, T] -> [B, T, Hkv, G, 1]
        return jnp.transpose(x, (0, 3, 1, 2))[..., None]

    out = out_a * rows(scale_a) + out_b * rows(scale_b)
    return out / rows(jnp.where(total > 0, total, 1.0))
