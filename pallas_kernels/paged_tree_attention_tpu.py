"""Paged tree attention on a TPU (Mosaic): the prefix half of ``pallas_kernels.paged_tree_attention`` as a
Pallas TPU kernel, the pages fetched by the pipeline through the page table.

The page table and the lengths are scalar-prefetched (SMEM); the grid is (row, page): each step's K and V blocks
are whole pages, every KV head's slots ``[page_size * Hkv, D]`` as the cache holds them (a block of one head's
``[page_size, 1, D]`` would tile the head axis, which Mosaic refuses), whose index map reads ``page_table[b, j]``,
so the DMA engine gathers a row's pages in order while the previous one is computed. In VMEM a page is regrouped
head-major (``pltpu.einshape``) for one batched matmul over the heads. Past a row's last page the index map repeats
that page (the pipeline skips a fetch whose block index does not change) and the step computes nothing, so unread
pages (the null page, never-written ones, NaN) are never read. The query heads of KV head h are stacked as the rows
of one matrix (``r = t * G + g``), so a page is read once; the online softmax (m, l, acc) lives in VMEM scratch
across the page axis and is written out at the last page as (o, m, l) for the same log-sum-exp merge with the tree
block as the GPU kernel's. TPU tiles: rows padded to a multiple of 8, D a multiple of 128 (Llama/Qwen heads);
bf16 or float32 in, float32 accumulation.

Checked two ways on a CPU: against the reference in Pallas's TPU interpret mode (``impl="tpu_interpret"``), and
compiled by the real TPU compiler for v5e, v6e and v5p at Llama-3-8B and 70B heads (tests/aot). It has not run on
a TPU yet.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attention_parts import (MASK_VALUE, dot_precision, pad_axis, stack_query_heads, window_starts,
                                            with_tree)

ROW_TILE = 8     # a TPU vreg's sublanes
LANE_TILE = 128  # its lanes
DENSE_BLOCK = 128  # cache slots per step when a dense cache is read as pages


def _page_kernel(table_ref, lens_ref, starts_ref, first_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, m_scr,
                 l_scr, acc_scr, *, scale: float, page_size: int, kv_heads: int, windowed: bool):
    """Grid (b, j): the rows of every KV head of row b against its j-th page. q_ref [Hkv, R, D]; k_ref, v_ref
    [page_size * Hkv, D] (slot-major, as the cache holds them), regrouped head-major in VMEM, ``[Hkv, page_size,
    D]``, for one batched matmul over the heads. Under a sliding window (``windowed``), first_ref i32[R, 1] holds
    each row's first visible position and starts_ref[b] the earliest of them: pages before it are neither fetched
    nor computed."""
    b, j = pl.program_id(0), pl.program_id(1)
    length = lens_ref[b]

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, MASK_VALUE, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    in_window = (j + 1) * page_size > starts_ref[b] if windowed else True

    @pl.when((j * page_size < length) & in_window)
    def _page():
        q = q_ref[...]
        precision = dot_precision(q.dtype)
        head_major = lambda x: pltpu.einshape("(sh)d->hsd", x, s=page_size, h=kv_heads)
        columns = j * page_size + jax.lax.broadcasted_iota(jnp.int32, (1, 1, page_size), 2)
        rows = j * page_size + jax.lax.broadcasted_iota(jnp.int32, (1, page_size, 1), 1)
        k = head_major(k_ref[...])
        v = jnp.where(rows < length, head_major(v_ref[...]), jnp.zeros((), v_ref.dtype))  # 0 * NaN is NaN
        scores = jax.lax.dot_general(q, k, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32,
                                     precision=precision)
        seen = columns < length  # [1, 1 or R, page_size]
        if windowed:
            seen = seen & (columns >= first_ref[...][None])
        scores = jnp.where(seen, scores * scale, MASK_VALUE)  # [Hkv, R, page_size]
        m_prev = m_scr[...]
        m_next = jnp.maximum(m_prev, scores.max(axis=-1, keepdims=True))
        correction = jnp.exp(m_prev - m_next)
        p = jnp.where(seen, jnp.exp(scores - m_next), 0.0)
        l_scr[...] = l_scr[...] * correction + p.sum(axis=-1, keepdims=True)
        acc_scr[...] = acc_scr[...] * correction + jax.lax.dot_general(
            p.astype(v.dtype), v, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32,
            precision=precision)
        m_scr[...] = m_next

    @pl.when(j == pl.num_programs(1) - 1)
    def _write():
        o_ref[...] = acc_scr[...]
        m_ref[...] = m_scr[...]
        l_ref[...] = l_scr[...]


def _vmem_limit() -> int:
    """Scoped VMEM for the kernel: three quarters of the chip's. The compiler's default (16 MiB on v5p) is too small
    for 70B's 512 rows a KV head (64 tree tokens x 8 query heads), whose accumulators and scores all live there."""
    return pltpu.get_tpu_info().vmem_capacity_bytes * 3 // 4


def _page_partials(q_rows, k_pages, v_pages, page_table, cache_len, row_first=None, *, scale, interpret,
                   dense_page=None):
    """q_rows [B, Hkv, R, D] (R a multiple of 8) over each row's pages -> o f32[B, Hkv, R, D] (unnormalised),
    m, l f32[B, Hkv, R, 1].

    dense_page None: k_pages, v_pages [P, page_size, Hkv, D] read through page_table i32[B, N]. dense_page an int:
    they are dense caches [B, L, Hkv, D] read in blocks of dense_page slots (page_table unused; the last block may
    run past L, whose slots are masked like any past cache_len). Either way a block holds every KV head of its slots,
    ``[slots * Hkv, D]`` (a free reshape): Mosaic tiles a block's last two dims, and a block of one head's
    ``[slots, 1, D]`` would tile the head axis. row_first: i32[B, R] each row's first visible position under a
    sliding window (None: no window).
    """
    batch, kv_heads, rows, head_dim = q_rows.shape
    page_size = k_pages.shape[1] if dense_page is None else dense_page
    per_row = page_table.shape[1] if dense_page is None else -(-k_pages.shape[1] // dense_page)

    windowed = row_first is not None
    if row_first is None:
        row_first = jnp.zeros((batch, rows), jnp.int32)
    starts = jnp.min(row_first, axis=1)  # each row's earliest visible position

    def page_of(b, j, table, lengths, starts):
        last = jnp.maximum((lengths[b] + page_size - 1) // page_size - 1, 0)
        first = jnp.minimum(starts[b] // page_size, last) if windowed else 0
        at = jnp.clip(j, first, last)  # before the window: the first page's block (fetched once, not computed)
        if dense_page is not None:
            return b, at, 0
        return table[b, at], 0, 0

    whole_row = lambda b, j, table, lengths, starts: (b, 0, 0, 0)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(batch, per_row),
        in_specs=[
            pl.BlockSpec((None, rows, 1), lambda b, j, table, lengths, starts: (b, 0, 0)),
            pl.BlockSpec((None, kv_heads, rows, head_dim), whole_row),
            pl.BlockSpec((None, page_size * kv_heads, head_dim), page_of),
            pl.BlockSpec((None, page_size * kv_heads, head_dim), page_of),
        ],
        out_specs=[
            pl.BlockSpec((None, kv_heads, rows, head_dim), whole_row),
            pl.BlockSpec((None, kv_heads, rows, 1), whole_row),
            pl.BlockSpec((None, kv_heads, rows, 1), whole_row),
        ],
        scratch_shapes=[pltpu.VMEM((kv_heads, rows, 1), jnp.float32), pltpu.VMEM((kv_heads, rows, 1), jnp.float32),
                        pltpu.VMEM((kv_heads, rows, head_dim), jnp.float32)],
    )
    out_shape = [jax.ShapeDtypeStruct((batch, kv_heads, rows, head_dim), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv_heads, rows, 1), jnp.float32),
                 jax.ShapeDtypeStruct((batch, kv_heads, rows, 1), jnp.float32)]
    slot_major = lambda x: x.reshape(x.shape[0], x.shape[1] * kv_heads, head_dim)
    return pl.pallas_call(
        functools.partial(_page_kernel, scale=scale, page_size=page_size, kv_heads=kv_heads, windowed=windowed),
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=None if interpret else _vmem_limit()),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paged_tree_attention_tpu",
    )(page_table, cache_len, starts, row_first[:, :, None], q_rows, slot_major(k_pages), slot_major(v_pages))


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "dense_page", "window"))
def _tree_attention_tpu(q, k, v, page_table, cache_len, k_new, v_new, mask, sinks, *, scale, interpret, dense_page,
                        window):
    head_dim = q.shape[3]
    kv_heads = k.shape[2]
    q_rows = stack_query_heads(q, kv_heads)  # [B, Hkv, R, D]
    rows = q_rows.shape[2]
    padded_rows = -(-rows // ROW_TILE) * ROW_TILE
    padded_dim = -(-head_dim // LANE_TILE) * LANE_TILE
    q_padded = pad_axis(pad_axis(q_rows, 3, padded_dim), 2, padded_rows)
    limit = k.shape[1] if dense_page is not None else page_table.shape[1] * k.shape[1]
    cache_len = jnp.clip(cache_len.astype(jnp.int32), 0, limit)
    row_first = None
    if window is not None:
        row_first = window_starts(mask, cache_len, window, q.shape[2] // kv_heads, padded_rows)
    o, m, l = _page_partials(q_padded, pad_axis(k, 3, padded_dim), pad_axis(v, 3, padded_dim),
                             page_table.astype(jnp.int32), cache_len, row_first, scale=scale, interpret=interpret,
                             dense_page=dense_page)
    return with_tree(q_rows, o[:, :, None], m[:, :, None, :, 0], l[:, :, None, :, 0], k_new, v_new, mask,
                     scale=scale, dtype=q.dtype, window=window, sinks=sinks)


def paged_tree_attention_tpu(q, k_pages, v_pages, page_table, cache_len, k_new, v_new, mask, *, scale: float,
                             interpret: bool = False, window: int | None = None, sinks=None):
    """Shapes as ``paged_tree_attention_reference`` (checked by ``paged_tree_attention``); the pages in the TPU
    kernel, the tree in jnp, one log-sum-exp merge (window and sinks as ``tree_attention``'s)."""
    return _tree_attention_tpu(q, k_pages, v_pages, page_table, cache_len, k_new, v_new, mask, sinks, scale=scale,
                               interpret=interpret, dense_page=None, window=window)


def tree_attention_tpu(q, k_cache, v_cache, cache_len, k_new, v_new, mask, *, scale: float, interpret: bool = False,
                       window: int | None = None, sinks=None):
    """Dense tree attention (``pallas_kernels.tree_attention``'s shapes: caches [B, L, Hkv, D]) through the same
    kernel, the cache read in place in blocks of 128 slots (all L when L <= 128): a page table that is the
    identity."""
    batch, cache_slots = k_cache.shape[:2]
    no_table = jnp.zeros((batch, 1), jnp.int32)
    return _tree_attention_tpu(q, k_cache, v_cache, no_table, cache_len, k_new, v_new, mask, sinks, scale=scale,
                               interpret=interpret, dense_page=min(cache_slots, DENSE_BLOCK), window=window)
