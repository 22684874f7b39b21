"""Paged tree attention: T draft-tree queries per sequence against its committed prefix, read through a page
table from a pool of pages, plus the tree itself.

Each tree query (node t of sequence b) attends to

- the prefix positions ``< cache_len[b]``: position p lives at ``k_pages[page_table[b, p // page_size],
  p % page_size]`` (the serving engine's layout, ``models.paged_kv``), and
- the tree tokens j with ``mask[b, t, j]`` (node t itself and its ancestors).

``paged_tree_attention_reference`` is the specification: the rows' pages gathered into a dense cache, then
``tree_attention_reference`` (one softmax over ``concat(prefix, tree)``).

The kernel is :mod:`pallas_kernels.tree_attention`'s flash-decoding with the GQA trick, over pages: the query heads
of one KV head are stacked as the rows of one matrix (``r = t * G + g``), so a page is read once per KV head; each
program takes a split of a row's pages and walks them one page (``page_size`` keys) at a time, loading the page
number from the row's page table, under an online softmax -> partial (o, m, l); the tree keys are one more partial
(jnp) and a log-sum-exp merges them. The walk stops at the last page holding a position ``< cache_len[b]``: pages
past it (the null page in a table's padding, pages never written, whatever they hold, NaN included) are never
read; inside the last page, scores past the length are masked and their V rows zeroed (``0 * NaN = NaN``).

Lowering: Pallas Triton, as the dense kernel (a page is a ``[page_size, D]`` load at a dynamic leading index).
Triton wants power-of-two tiles of at least 16: ``page_size`` must be one (16 is the server's default block size),
rows and D are padded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.attention_parts import (dot_precision, fit_tiles, flash_init, flash_step, next_pow2, pad_axis,
                                            stack_query_heads, window_starts, with_tree)
from pallas_kernels.impl import Impl, ImplName, resolve_impl
from pallas_kernels.paged_tree_attention_tpu import paged_tree_attention_tpu
from pallas_kernels.tree_attention import MIN_TILE, TARGET_PROGRAMS, tree_attention_reference, validate_window


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """pages [P, page_size, Hkv, D], page_table i32[B, N] -> the rows' dense caches [B, N * page_size, Hkv, D]."""
    batch, per_row = page_table.shape
    gathered = pages[page_table]  # [B, N, page_size, Hkv, D]
    return gathered.reshape(batch, per_row * pages.shape[1], *pages.shape[2:])


@functools.partial(jax.jit, static_argnames=("scale", "window"))
def paged_tree_attention_reference(q, k_pages, v_pages, page_table, cache_len, k_new, v_new, mask, *,
                                   scale: float, window: int | None = None, sinks=None):
    """Dense paged tree attention: the pages gathered, then ``tree_attention_reference`` (window and sinks as
    there).

    q: [B, T, Hq, D]; k_pages, v_pages: [P, page_size, Hkv, D]; page_table: i32[B, N]; cache_len: i32[B]
    (<= N * page_size); k_new, v_new: [B, T, Hkv, D]; mask: bool[B, T, T] -> [B, T, Hq, D] in q.dtype.
    """
    return tree_attention_reference(q, gather_pages(k_pages, page_table), gather_pages(v_pages, page_table),
                                    cache_len, k_new, v_new, mask, scale=scale, window=window, sinks=sinks)


# ----------------------------------------------------------------------------------------------
# Pallas kernel: partial attention of the stacked rows over one split of a row's pages
# ----------------------------------------------------------------------------------------------


def _page_split_kernel(
    cache_len_ref,  # i32[]  cache_len[b]
    table_ref,      # i32[N]  page_table[b]
    first_ref,      # i32[block_rows]  each row's first visible position (a sliding window's; 0 without)
    q_ref,          # [block_rows, D]  rows t * G + g of KV head h
    k_ref,          # [P, page_size, D]  k_pages[:, :, h]
    v_ref,          # [P, page_size, D]  v_pages[:, :, h]
    o_ref,          # f32[block_rows, D]  unnormalised sum_j p_j v_j over this split
    m_ref,          # f32[block_rows]  running max of the scaled scores
    l_ref,          # f32[block_rows]  sum_j p_j
    *,
    scale: float,
    pages_per_split: int,
    windowed: bool,
):
    page_size = k_ref.shape[1]
    block_rows, head_dim = q_ref.shape
    length = cache_len_ref[()]
    first = pl.program_id(1) * pages_per_split
    end = first + pages_per_split
    row_first = first_ref[...] if windowed else None
    if windowed:  # pages before every row's window are never read
        first = jnp.maximum(first, jnp.min(row_first) // page_size)
    used = (length + page_size - 1) // page_size  # pages holding a position < length
    count = jnp.maximum(jnp.minimum(end, used) - first, 0)
    q = q_ref[...]
    precision = dot_precision(q.dtype)

    def body(i, carry):
        index = first + i
        page = table_ref[index]
        positions = index * page_size + jnp.arange(page_size)
        valid = positions < length  # [page_size]
        return flash_step(q, k_ref[page], v_ref[page], valid, carry, scale=scale, precision=precision,
                          row_first=row_first, positions=positions)

    o, m, l = lax.fori_loop(0, count, body, flash_init(block_rows, head_dim))
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _page_partials(q_rows, k_pages, v_pages, page_table, cache_len, row_first, *, scale, block_rows, num_splits,
                   num_warps, num_stages, interpret, windowed):
    """Per-split partial attention of the stacked rows over each row's pages.

    q_rows: [B, Hkv, R, D] (R and D powers of two >= 16, block_rows divides R); k_pages, v_pages:
    [P, page_size, Hkv, D]; page_table: i32[B, N]; cache_len: i32[B] in [0, N * page_size]
    -> o f32[B, Hkv, S, R, D] (unnormalised), m, l f32[B, Hkv, S, R].
    """
    batch, kv_heads, rows, head_dim = q_rows.shape
    num_pages, page_size = k_pages.shape[:2]
    per_row = page_table.shape[1]
    row_blocks = rows // block_rows
    if num_splits is None:  # enough programs to fill a GPU; a split's partials cost at most ~ its pages' bytes / 4
        fill = -(-TARGET_PROGRAMS // (batch * kv_heads * row_blocks))
        num_splits = max(1, min(fill, max(1, per_row * page_size // (8 * rows)), per_row))
    pages_per_split = -(-per_row // num_splits)
    num_splits = -(-per_row // pages_per_split)
    if num_warps is None:
        num_warps = 4 if block_rows * head_dim <= 64 * 64 else 8
    kernel = functools.partial(_page_split_kernel, scale=scale, pages_per_split=pages_per_split, windowed=windowed)
    out_shape = [
        jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows), jnp.float32),
    ]
    return pl.pallas_call(
        kernel,
        grid=(row_blocks, num_splits, kv_heads, batch),
        in_specs=[
            pl.BlockSpec((None,), lambda r, s, h, b: (b,)),
            pl.BlockSpec((None, per_row), lambda r, s, h, b: (b, 0)),
            pl.BlockSpec((None, block_rows), lambda r, s, h, b: (b, r)),
            pl.BlockSpec((None, None, block_rows, head_dim), lambda r, s, h, b: (b, h, r, 0)),
            pl.BlockSpec((num_pages, page_size, None, head_dim), lambda r, s, h, b: (0, 0, h, 0)),
            pl.BlockSpec((num_pages, page_size, None, head_dim), lambda r, s, h, b: (0, 0, h, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_rows, head_dim), lambda r, s, h, b: (b, h, s, r, 0)),
            pl.BlockSpec((None, None, None, block_rows), lambda r, s, h, b: (b, h, s, r)),
            pl.BlockSpec((None, None, None, block_rows), lambda r, s, h, b: (b, h, s, r)),
        ],
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_tree_attention",
    )(cache_len, page_table, row_first, q_rows, k_pages, v_pages)


@functools.partial(jax.jit, static_argnames=("scale", "block_rows", "num_splits", "num_warps", "num_stages",
                                             "interpret", "window"))
def _paged_tree_attention_kernel(q, k_pages, v_pages, page_table, cache_len, k_new, v_new, mask, sinks, *, scale,
                                 block_rows, num_splits, num_warps, num_stages, interpret, window):
    """Shapes as paged_tree_attention_reference; the pages in Pallas, the tree in jnp."""
    head_dim = q.shape[3]
    kv_heads = k_pages.shape[2]
    q_rows = stack_query_heads(q, kv_heads)  # [B, Hkv, R, D]
    rows = q_rows.shape[2]
    padded_rows = max(MIN_TILE, next_pow2(rows), block_rows)
    block_rows = min(block_rows, padded_rows)
    padded_dim = max(MIN_TILE, next_pow2(head_dim))
    block_rows, _, num_stages = fit_tiles(block_rows, k_pages.shape[1], num_stages, padded_dim,
                                          k_pages.dtype.itemsize, min_tile=MIN_TILE, fixed_k=True)
    k_pages = pad_axis(k_pages, 3, padded_dim)
    v_pages = pad_axis(v_pages, 3, padded_dim)
    q_padded = pad_axis(pad_axis(q_rows, 3, padded_dim), 2, padded_rows)
    limit = page_table.shape[1] * k_pages.shape[1]
    cache_len = jnp.clip(cache_len.astype(jnp.int32), 0, limit)
    row_first = window_starts(mask, cache_len, window, q.shape[2] // kv_heads, padded_rows)
    o, m, l = _page_partials(q_padded, k_pages, v_pages, page_table.astype(jnp.int32), cache_len, row_first,
                             scale=scale, block_rows=block_rows, num_splits=num_splits, num_warps=num_warps,
                             num_stages=num_stages, interpret=interpret, windowed=window is not None)
    return with_tree(q_rows, o, m, l, k_new, v_new, mask, scale=scale, dtype=q.dtype, window=window, sinks=sinks)


# ----------------------------------------------------------------------------------------------
# Public op
# ----------------------------------------------------------------------------------------------


def _validate(q, k_pages, v_pages, page_table, cache_len, k_new, v_new, mask):
    """Raises ValueError naming the offending shapes (static shapes, before any tracing)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, Hq, D], got shape {q.shape}")
    batch, num_tokens, q_heads, head_dim = q.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must both be [P, page_size, Hkv, D], got shapes {k_pages.shape} "
                         f"and {v_pages.shape}")
    _, page_size, kv_heads, page_dim = k_pages.shape
    if page_dim != head_dim:
        raise ValueError(f"k_pages shape {k_pages.shape} does not match q shape {q.shape}: expected head_dim "
                         f"{head_dim}")
    if page_size < MIN_TILE or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size} must be a power of two >= {MIN_TILE}")
    if page_table.ndim != 2 or page_table.shape[0] != batch or not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"page_table must be int[{batch}, N], got {page_table.dtype}{list(page_table.shape)}")
    expected_new = (batch, num_tokens, kv_heads, head_dim)
    if k_new.shape != expected_new or v_new.shape != expected_new:
        raise ValueError(f"k_new and v_new must be {expected_new} (B, T, Hkv, D), got shapes {k_new.shape} and "
                         f"{v_new.shape}")
    if q_heads % kv_heads:
        raise ValueError(f"Hq={q_heads} query heads is not a multiple of Hkv={kv_heads} KV heads")
    if mask.shape != (batch, num_tokens, num_tokens) or mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be bool[{batch}, {num_tokens}, {num_tokens}], got {mask.dtype}"
                         f"{list(mask.shape)}")
    if cache_len.shape != (batch,) or not jnp.issubdtype(cache_len.dtype, jnp.integer):
        raise ValueError(f"cache_len must be int[{batch}], got {cache_len.dtype}{list(cache_len.shape)}")


def paged_tree_attention(q, k_pages, v_pages, page_table, cache_len, k_new, v_new, mask, *,
                         scale: float | None = None, impl: ImplName | str = "auto", block_rows: int = 64,
                         num_splits: int | None = None, num_warps: int | None = None, num_stages: int = 2,
                         window: int | None = None, sinks=None):
    """Attention of T tree queries over each row's paged prefix (positions < cache_len) and the masked tree.

    Args:
      q: [B, T, Hq, D] queries of the T tree tokens.
      k_pages, v_pages: [P, page_size, Hkv, D] the pool (page_size a power of two >= 16); pages a row does not
        reach (its table's padding, the null page) may hold anything.
      page_table: int[B, N] each row's pages in order: position p in page_table[b, p // page_size].
      cache_len: int[B] committed length of each row (clipped to [0, N * page_size]).
      k_new, v_new: [B, T, Hkv, D] keys and values of the tree tokens.
      mask: bool[B, T, T]; mask[b, t, j] iff tree query t may see tree key j.
      scale: score scale, default D ** -0.5.
      impl: "auto" | "pallas" | "interpret" | "tpu" | "tpu_interpret" | "reference" (pallas_kernels.impl); the
        TPU forms are ``pallas_kernels.paged_tree_attention_tpu`` (page_size a multiple of 8).
      block_rows: stacked (token, head) rows per program (power of two >= 16).
      num_splits: page splits per (b, KV head); None picks one from the shapes.
      num_warps, num_stages: Triton launch parameters (reasoned, not tuned on a GPU).
      window, sinks: a sliding window and attention sinks, as ``tree_attention``'s (the loop starts at the page
        holding the window's first position).

    Returns:
      [B, T, Hq, D] in q.dtype. Every query must see at least one key (node t sees itself).
    """
    _validate(q, k_pages, v_pages, page_table, cache_len, k_new, v_new, mask)
    if block_rows < MIN_TILE or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows={block_rows} must be a power of two >= {MIN_TILE}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1 (or None for automatic)")
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    validate_window(window, sinks, q.shape[2])
    resolved = resolve_impl(impl, "paged_tree_attention")
    if resolved.is_tpu:
        return paged_tree_attention_tpu(q, k_pages, v_pages, page_table, cache_len, k_new, v_new, mask, scale=scale,
                                        interpret=resolved.interpreted, window=window, sinks=sinks)
    if resolved is Impl.REFERENCE:
        return paged_tree_attention_reference(q, k_pages, v_pages, page_table, cache_len, k_new, v_new, mask,
                                              scale=scale, window=window, sinks=sinks)
    return _paged_tree_attention_kernel(q, k_pages, v_pages, page_table, cache_len, k_new, v_new, mask, sinks,
                                        scale=scale, block_rows=block_rows, num_splits=num_splits,
                                        num_warps=num_warps, num_stages=num_stages,
                                        interpret=resolved is Impl.INTERPRET, window=window)
