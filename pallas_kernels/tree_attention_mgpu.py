"""Tree attention's Mosaic GPU form, for Hopper: TMA copies into shared memory and warpgroup matmuls (WGMMA).

The contract is :func:`pallas_kernels.tree_attention.tree_attention`'s: each of T tree tokens attends to the
``cache_len[b]`` committed slots of its sequence's cache and to the tree tokens its mask row allows, read from
``k_new``/``v_new``.

One program (one warpgroup, 128 threads) per (sequence, KV head). Its rows are the T x G queries that share the KV
head (G = Hq / Hkv), regrouped head-major and padded to the 64 rows a WGMMA takes in the wrapper (the queries are a
few KiB). The committed slots are read straight out of the ``[B, S, Hkv, D]`` cache, one ``[block_kv, D]`` tile of
this head at a time by TMA (a strided box, no copy of the cache), double-buffered: the next tile's copy is in flight
while the tensor cores work on this one. Scores and the online softmax stay in registers (``exp2`` with log2(e)
folded in, as JAX's FlashAttention-3 kernel); each tile's P @ V is a WGMMA into a fresh accumulator, added to the
output in registers (storing into an accumulator is what Pallas's Mosaic GPU interpreter cannot run). The loop runs
``ceil(cache_len / block_kv)`` tiles: slots past ``cache_len`` are never read but in the last tile, where they are
masked; the last tile starts at most at ``S - block_kv``, so no copy leaves the row's cache. The kernel reads the
cache as its ``[B * S, Hkv, D]`` view (a free reshape), whose rows TMA tiles by 8: the engine's caches hold
max_seq_len plus a tree's slots, rarely a multiple of 8, and B * S is one in its buckets of 8 rows and more (a
smaller B with such an S pads the view: a copy). The tree tokens come last, as one more tile (padded to 64) under
an additive mask.

bf16 or f16 in (WGMMA's operands; float32 goes to the Triton form), f32 softmax and accumulation, out in q's dtype.
D a multiple of 64; S at least ``block_kv``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS = 64  # a WGMMA's M: one warpgroup's rows
_MASKED = -1e30  # finite, so a padded row that sees nothing stays a number (it is dropped)
_LOG2E = math.log2(math.e)


def _smem_transforms(minor: int, dtype) -> tuple:
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle)


def _kernel(q_ref, k_cache_ref, v_cache_ref, cache_len_ref, table_ref, k_new_ref, v_new_ref, bias_ref, out_ref,
            q_smem, k_smem, v_smem, kn_smem, vn_smem, bias_smem, barriers, k_bars, v_bars, *, block_kv: int,
            scale: float, interpret: bool, slots_per_row: int, page_size: int | None):
    """page_size None: the dense cache, [B * S, Hkv, D] (S = slots_per_row); else a pool of pages, [P * page_size,
    Hkv, D], row b's position p in page table_ref[b, p // page_size], a tile of block_kv slots that many pages."""
    batch, head = lax.axis_index("b"), lax.axis_index("h")
    rows, head_dim = q_smem.shape
    slots = slots_per_row
    dtype = q_smem.dtype
    q_bar, kn_bar, vn_bar, bias_bar = (barriers.at[i] for i in range(4))  # one copy a barrier
    cache_len = cache_len_ref[batch]
    steps = lax.div(cache_len + block_kv - 1, block_kv)
    copies = 1 if page_size is None else block_kv // page_size  # TMA copies (and barriers) a tile
    last_page = None if page_size is None else table_ref.shape[1] - 1

    def start_of(step):  # the dense cache's last tile ends at the row's end at most
        return step * block_kv if page_size is not None else jnp.minimum(step * block_kv, slots - block_kv)

    def fetch(step):
        slot = lax.rem(step, 2)
        for cache, smem, bars in ((k_cache_ref, k_smem, k_bars), (v_cache_ref, v_smem, v_bars)):
            if page_size is None:
                window = pl.ds(batch * slots + start_of(step), block_kv)
                plgpu.copy_gmem_to_smem(cache.at[window, head], smem.at[slot], bars.at[slot])
                continue
            for i in range(copies):  # past the row's table: its last entry (padding, the null page), masked
                page = table_ref[batch, jnp.minimum(step * copies + i, last_page)]
                plgpu.copy_gmem_to_smem(cache.at[pl.ds(page * page_size, page_size), head],
                                        smem.at[slot, pl.ds(i * page_size, page_size)], bars.at[slot * copies + i])

    plgpu.copy_gmem_to_smem(q_ref.at[batch, head], q_smem, q_bar)
    plgpu.copy_gmem_to_smem(k_new_ref.at[batch, head], kn_smem, kn_bar)
    plgpu.copy_gmem_to_smem(v_new_ref.at[batch, head], vn_smem, vn_bar)
    plgpu.copy_gmem_to_smem(bias_ref.at[batch], bias_smem, bias_bar)
    pl.when(steps > 0)(lambda: fetch(0))
    plgpu.barrier_wait(q_bar)

    def matmul(lhs, rhs, *, transposed: bool = False):
        """lhs @ rhs (rhs a [K, N] ref in shared memory, or its [N, K] transpose) into a fresh (zeroed) WGMMA
        accumulator -> f32[rows, N] in registers. Interpreted: a dot of the loaded values (the interpreter runs no
        WGMMA over a transposed ref)."""
        if interpret:
            lhs = lhs if isinstance(lhs, jax.Array) else lhs[...]
            return lax.dot_general(lhs, rhs[...], (((1,), (1 if transposed else 0,)), ((), ())),
                                   preferred_element_type=jnp.float32)

        def run(acc_ref):
            plgpu.wgmma(acc_ref, lhs, plgpu.transpose_ref(rhs, (1, 0)) if transposed else rhs)
            return acc_ref[...]

        columns = rhs.shape[0] if transposed else rhs.shape[1]
        return pl.run_scoped(run, plgpu.ACC((rows, columns), jnp.float32))

    def attend(carry, k_tile, v_tile, extra):
        """One tile of keys and values: scores, the online softmax's update, and P @ V added to the output."""
        acc, m_i, l_i = carry
        s = extra(matmul(q_smem, k_tile, transposed=True) * (scale * _LOG2E))
        m_new = jnp.maximum(m_i, s.max(axis=1))
        alpha = jnp.exp2(m_i - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + matmul(p.astype(dtype), v_tile)
        return acc, m_new, l_i * alpha + p.sum(axis=1)

    # The loop's carries in the accumulator's layout (the interpreter has no layouts, and no rule for the cast)
    in_layout = (lambda x, layout: x) if interpret else plgpu.layout_cast
    acc = in_layout(jnp.zeros((rows, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    m_i = in_layout(jnp.full((rows,), _MASKED, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = in_layout(jnp.zeros((rows,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))

    def cache_step(step, carry):
        slot = lax.rem(step, 2)
        for i in range(copies):
            plgpu.barrier_wait(k_bars.at[slot * copies + i])
            plgpu.barrier_wait(v_bars.at[slot * copies + i])
        pl.when(step + 1 < steps)(lambda: fetch(step + 1))  # into the other buffer, read a step ago
        first, start = step * block_kv, start_of(step)

        @pl.when(step == steps - 1)
        def _():  # the last tile's slots past the committed ones may hold anything, NaN too: 0 * NaN is NaN
            v_ref = v_smem.at[slot]
            values = v_ref[...]
            ids = start + in_layout(lax.broadcasted_iota(jnp.int32, values.shape, 0), plgpu.Layout.WGMMA)
            v_ref[...] = jnp.where(ids < cache_len, values, jnp.zeros_like(values))
            plgpu.commit_smem()  # the threads' writes, visible to the WGMMA that reads them

        def visible(s):  # slots already attended (a clamped last tile) or past the committed ones: masked
            ids = start + in_layout(lax.broadcasted_iota(jnp.int32, s.shape, 1), plgpu.Layout.WGMMA)
            return jnp.where((ids >= first) & (ids < cache_len), s, _MASKED)

        return attend(carry, k_smem.at[slot], v_smem.at[slot], visible)

    carry = lax.fori_loop(0, steps, cache_step, (acc, m_i, l_i))
    for bar in (kn_bar, vn_bar, bias_bar):
        plgpu.barrier_wait(bar)
    bias = bias_smem[...]
    acc, _, l_i = attend(carry, kn_smem, vn_smem, lambda s: s + bias)
    q_smem[...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(dtype)  # the queries' buffer: spent
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, out_ref.at[batch, head])
    plgpu.wait_smem_to_gmem(0)


def supports(q: jax.Array, k_cache: jax.Array, block_kv: int = 64) -> bool:
    """Whether this form takes these queries [B, T, Hq, D] and this cache [B, S, Hkv, D]."""
    batch, nodes, q_heads, head_dim = q.shape
    return (q.dtype in (jnp.bfloat16, jnp.float16) and head_dim % 64 == 0 and k_cache.shape[1] >= block_kv
            and nodes * (q_heads // k_cache.shape[2]) <= 256)


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "interpret"))
def tree_attention_mgpu(q, k_cache, v_cache, cache_len, k_new, v_new, mask, *, scale: float, block_kv: int = 64,
                        interpret: bool = False):
    """q: [B, T, Hq, D]; k_cache, v_cache: [B, S, Hkv, D]; cache_len: i32[B]; k_new, v_new: [B, T, Hkv, D];
    mask: bool[B, T, T] -> [B, T, Hq, D] in q's dtype. interpret: Pallas's Mosaic GPU interpreter (on a CPU)."""
    batch, slots, kv_heads, head_dim = k_cache.shape
    if not supports(q, k_cache, block_kv):
        raise ValueError(f"the Mosaic GPU form takes bf16 or f16 (got {q.dtype}), a head_dim that is a multiple of 64 "
                         f"(got {head_dim}), at least block_kv={block_kv} cache slots (got {slots}) and at most 256 "
                         f"rows of tree tokens x query heads a KV head (got {q.shape[1] * (q.shape[2] // kv_heads)})")
    # TMA tiles the rows of the cache's [B * S, Hkv, D] view (a free reshape) by 8: where B * S is not a multiple of
    # 8, a few rows of padding, a copy of the cache (the engine's 8-row buckets never need one)
    flat = [c.astype(q.dtype).reshape(batch * slots, kv_heads, head_dim) for c in (k_cache, v_cache)]
    if batch * slots % 8:
        flat = [jnp.pad(c, ((0, 8 - batch * slots % 8), (0, 0), (0, 0))) for c in flat]
    table = jnp.zeros((1, 1), jnp.int32)  # unread
    return _call(q, *flat, cache_len, table, k_new, v_new, mask, scale=scale, block_kv=block_kv,
                 interpret=interpret, slots_per_row=slots, page_size=None)


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "interpret"))
def paged_tree_attention_mgpu(q, k_pages, v_pages, page_table, cache_len, k_new, v_new, mask, *, scale: float,
                              block_kv: int = 64, interpret: bool = False):
    """q: [B, T, Hq, D]; k_pages, v_pages: [P, page_size, Hkv, D] (page_size a multiple of 8 dividing block_kv);
    page_table: i32[B, N]; cache_len: i32[B] (<= N * page_size); k_new, v_new: [B, T, Hkv, D]; mask: bool[B, T, T]
    -> [B, T, Hq, D] in q's dtype (:func:`pallas_kernels.paged_tree_attention.paged_tree_attention`'s contract). A
    tile of block_kv slots is that many pages, a TMA copy each from the pool's [P * page_size, Hkv, D] view."""
    num_pages, page_size, kv_heads, head_dim = k_pages.shape
    if not supports(q, k_pages[:1, :1], 1) or page_size % 8 or block_kv % page_size:
        raise ValueError(f"the Mosaic GPU form takes bf16 or f16 (got {q.dtype}), a head_dim that is a multiple of 64 "
                         f"(got {head_dim}), pages of a multiple of 8 slots dividing block_kv={block_kv} (got "
                         f"{page_size}) and at most 256 rows of tree tokens x query heads a KV head")
    flat = [p.astype(q.dtype).reshape(num_pages * page_size, kv_heads, head_dim) for p in (k_pages, v_pages)]
    return _call(q, *flat, cache_len, page_table.astype(jnp.int32), k_new, v_new, mask, scale=scale,
                 block_kv=block_kv, interpret=interpret, slots_per_row=0, page_size=page_size)


def _call(q, k_flat, v_flat, cache_len, table, k_new, v_new, mask, *, scale, block_kv, interpret, slots_per_row,
          page_size):
    """The kernel over [B, Hkv] programs: queries regrouped head-major, the tree's keys, values and mask padded to a
    tile, the output back in q's layout."""
    batch, nodes, q_heads, head_dim = q.shape
    kv_heads = k_flat.shape[1]
    group = q_heads // kv_heads
    rows = -(-nodes * group // ROWS) * ROWS
    new = -(-nodes // ROWS) * ROWS
    # [B, Hkv, rows, D]: row t * G + g is node t's query head h * G + g
    grouped = q.reshape(batch, nodes, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    grouped = jnp.pad(grouped.reshape(batch, kv_heads, nodes * group, head_dim),
                      ((0, 0), (0, 0), (0, rows - nodes * group), (0, 0)))
    new_k, new_v = (jnp.pad(x.astype(q.dtype).transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, new - nodes), (0, 0)))
                    for x in (k_new, v_new))
    seen = jnp.repeat(mask, group, axis=1)  # [B, T * G, T]
    bias = jnp.pad(jnp.where(seen, 0.0, _MASKED), ((0, 0), (0, rows - nodes * group), (0, new - nodes)),
                   constant_values=_MASKED).astype(jnp.float32)
    copies = 1 if page_size is None else block_kv // page_size
    qt, kt, ft = (_smem_transforms(head_dim, q.dtype),) * 2 + (_smem_transforms(new, jnp.float32),)
    kernel = plgpu.kernel(
        functools.partial(_kernel, block_kv=block_kv, scale=scale, interpret=interpret, slots_per_row=slots_per_row,
                          page_size=page_size),
        out_type=jax.ShapeDtypeStruct((batch, kv_heads, rows, head_dim), q.dtype),
        scratch_types=[plgpu.SMEM((rows, head_dim), q.dtype, transforms=qt),
                       plgpu.SMEM((2, block_kv, head_dim), q.dtype, transforms=kt),
                       plgpu.SMEM((2, block_kv, head_dim), q.dtype, transforms=kt),
                       plgpu.SMEM((new, head_dim), q.dtype, transforms=kt),
                       plgpu.SMEM((new, head_dim), q.dtype, transforms=kt),
                       plgpu.SMEM((rows, new), jnp.float32, transforms=ft),
                       plgpu.Barrier(num_barriers=4),  # the queries, the tree's keys, values and mask
                       plgpu.Barrier(num_barriers=2 * copies),  # K tiles: two buffers of `copies` copies
                       plgpu.Barrier(num_barriers=2 * copies)],  # V tiles
        grid=(batch, kv_heads), grid_names=("b", "h"), interpret=_interpret_params() if interpret else None)
    out = kernel(grouped, k_flat, v_flat, cache_len.astype(jnp.int32), table, new_k, new_v, bias)
    out = out[:, :, :nodes * group].reshape(batch, kv_heads, nodes, group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(batch, nodes, q_heads, head_dim)


def _interpret_params():
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()
