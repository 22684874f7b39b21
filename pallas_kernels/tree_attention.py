"""Tree attention: T draft-tree queries per sequence against its KV cache plus the tree itself.

Each tree query (node t of sequence b) attends to

- the cache positions ``< cache_len[b]`` (the committed context), and
- the tree tokens j with ``mask[b, t, j]`` (node t itself and its ancestors).

``tree_attention_reference`` is the specification: one dense softmax over ``concat(cache, tree)``.

The kernel is flash-decoding (split-k) with the GQA trick::

    rows of one KV head h:  r = t * G + g   (G = Hq // Hkv query heads share KV head h)

        q_rows[b, h]: [T*G, D]  -- every tree token x every query head of h, stacked as one matrix
        cache[b, :, h]: [L, D]  -- split into num_splits chunks of whole block_k blocks

    grid (row_block, split, h, b):  online softmax over the split's blocks -> partial (o, m, l)
    jnp epilogue:  the tree keys (T of them, tree mask) as one more partial, then a logsumexp merge

so the cache is read once per KV head, not once per query head (once per row block when
T * G > block_rows; those programs run side by side and share the blocks through L2), and a long
cache keeps the GPU busy even at batch 1. The loop stops at ``cache_len[b]``: unused cache slots
are never read except inside the last partial block, where scores are masked (``jnp.where``) and
V rows zeroed, because ``0 * NaN = NaN`` and unused slots may hold anything.

Lowering: Pallas Triton (``pallas.triton.CompilerParams``). It is simple, handles dynamic loop
bounds and strided [block_k, D] loads straight out of the ``[B, L, Hkv, D]`` cache (no transpose
or copy of the cache), and works on both JAX 0.10 and 0.11; Mosaic GPU would buy TMA/wgmma
pipelining on Hopper at the price of a much larger kernel. Triton wants power-of-two tiles of at
least 16 for ``dot``: rows are padded to that, and so is D (the one case that copies the cache;
Llama/Qwen/Mistral have D = 128).

bf16 in, f32 accumulation, output dtype = ``q.dtype``.
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
from pallas_kernels.paged_tree_attention_tpu import tree_attention_tpu

MIN_TILE = 16  # Triton's smallest dot operand dimension.
TARGET_PROGRAMS = 264  # ~2 waves of an H100's 132 SMs; more splits than this buys nothing.


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("scale", "window"))
def tree_attention_reference(q, k_cache, v_cache, cache_len, k_new, v_new, mask, *, scale: float,
                             window: int | None = None, sinks=None):
    """Dense tree attention: softmax over concat(cache, tree) with one boolean mask.

    q: [B, T, Hq, D]; k_cache, v_cache: [B, L, Hkv, D]; cache_len: i32[B];
    k_new, v_new: [B, T, Hkv, D]; mask: bool[B, T, T] -> [B, T, Hq, D] in q.dtype.
    Query head h reads KV head h // (Hq // Hkv). window: node t (position cache_len + depth(t)) reads the keys less
    than ``window`` positions behind it; sinks f32[Hq]: a logit per head in the softmax that reads no value.
    """
    batch, num_tokens, q_heads, _ = q.shape
    cache_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    in_cache = jnp.arange(cache_size)[None, :] < cache_len[:, None]  # [B, L]
    # Unused slots may hold NaN; zero them so that 0 * NaN never enters the weighted sum.
    k_cache = jnp.where(in_cache[:, :, None, None], k_cache, 0)
    v_cache = jnp.where(in_cache[:, :, None, None], v_cache, 0)
    keys = jnp.concatenate([k_cache, k_new], axis=1).astype(jnp.float32)  # [B, L+T, Hkv, D]
    values = jnp.concatenate([v_cache, v_new], axis=1).astype(jnp.float32)
    keys = jnp.repeat(keys, q_heads // kv_heads, axis=2)  # [B, L+T, Hq, D]
    values = jnp.repeat(values, q_heads // kv_heads, axis=2)
    prefix = jnp.broadcast_to(in_cache[:, None, :], (batch, num_tokens, cache_size))
    if window is not None:
        depth = jnp.sum(mask, axis=-1) - 1  # [B, T]
        query = cache_len[:, None] + depth
        prefix = prefix & (jnp.arange(cache_size)[None, None, :] > query[:, :, None] - window)
        mask = mask & (depth[:, :, None] - depth[:, None, :] < window)
    visible = jnp.concatenate([prefix, mask], axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), keys,
                        precision=lax.Precision.HIGHEST) * scale  # [B, Hq, T, L+T]
    logits = jnp.where(visible[:, None], logits, -jnp.inf)
    if sinks is not None:  # one more column, dropped after the softmax (as transformers' eager gpt-oss attention)
        sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, None], logits.shape[:3] + (1,))
        weights = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    else:
        weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", weights, values, precision=lax.Precision.HIGHEST)
    return out.astype(q.dtype)


# ----------------------------------------------------------------------------------------------
# Pallas kernel: partial attention of the stacked rows over one split of the cache
# ----------------------------------------------------------------------------------------------


def _cache_split_kernel(
    cache_len_ref,  # i32[]  cache_len[b], clipped to [0, L]
    first_ref,      # i32[block_rows]  each row's first visible position (a sliding window's; 0 without)
    q_ref,          # [block_rows, D]  rows t * G + g of KV head h
    k_ref,          # [L, D]  k_cache[b, :, h]
    v_ref,          # [L, D]  v_cache[b, :, h]
    o_ref,          # f32[block_rows, D]  unnormalised sum_j p_j v_j over this split
    m_ref,          # f32[block_rows]  running max of the scaled scores
    l_ref,          # f32[block_rows]  sum_j p_j
    *,
    scale: float,
    block_k: int,
    split_size: int,
    windowed: bool,
):
    cache_size = k_ref.shape[0]
    block_rows, head_dim = q_ref.shape
    split_start = pl.program_id(1) * split_size
    split_end = jnp.minimum(split_start + split_size, cache_len_ref[()])
    row_first = first_ref[...] if windowed else None
    if windowed:  # keys before every row's window are never read
        split_start = jnp.maximum(split_start, jnp.min(row_first))
    num_blocks = (jnp.maximum(split_end - split_start, 0) + block_k - 1) // block_k
    q = q_ref[...]
    precision = dot_precision(q.dtype)

    def body(i, carry):
        start = split_start + i * block_k
        # The last block of the buffer is shifted back to end at L (no out-of-bounds reads, no
        # padded cache); keys before `start` were counted by the previous block and are masked.
        window = jnp.minimum(start, cache_size - block_k)
        positions = window + jnp.arange(block_k)
        valid = (positions >= start) & (positions < split_end)  # [block_k]
        k = k_ref[pl.ds(window, block_k), :]
        v = v_ref[pl.ds(window, block_k), :]
        return flash_step(q, k, v, valid, carry, scale=scale, precision=precision, row_first=row_first,
                          positions=positions)

    o, m, l = lax.fori_loop(0, num_blocks, body, flash_init(block_rows, head_dim))
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _default_num_splits(batch: int, kv_heads: int, row_blocks: int, rows: int, cache_size: int,
                        block_k: int) -> int:
    """Enough splits to fill the GPU, but no more than the partials' traffic can afford.

    Each split writes and re-reads f32 [rows, D] partials (8 * rows * D bytes) per (b, h), while the
    cache costs 4 * L * D bytes (bf16 K and V); splits <= L / (8 * rows) keeps the partials at most
    about a quarter of the cache traffic.
    """
    fill = -(-TARGET_PROGRAMS // (batch * kv_heads * row_blocks))
    traffic = max(1, cache_size // (8 * rows))
    return max(1, min(fill, traffic, -(-cache_size // block_k)))


def _cache_partials(q_rows, k_cache, v_cache, cache_len, row_first, *, scale, block_k, block_rows,
                    num_splits, num_warps, num_stages, interpret, windowed):
    """Per-split partial attention of the stacked rows over the cache.

    q_rows: [B, Hkv, R, D] (R and D powers of two >= 16, block_rows divides R);
    k_cache, v_cache: [B, L, Hkv, D] with L >= block_k; cache_len: i32[B] in [0, L]; row_first: i32[B, R] each
    row's first visible position (read when ``windowed``) -> o f32[B, Hkv, S, R, D] (unnormalised), m, l
    f32[B, Hkv, S, R].
    """
    batch, kv_heads, rows, head_dim = q_rows.shape
    cache_size = k_cache.shape[1]
    row_blocks = rows // block_rows
    if num_splits is None:
        num_splits = _default_num_splits(batch, kv_heads, row_blocks, rows, cache_size, block_k)
    split_size = -(-(-(-cache_size // num_splits)) // block_k) * block_k  # whole blocks per split
    num_splits = -(-cache_size // split_size)  # drop splits that would start past L
    if num_warps is None:  # as jax's pallas/ops/gpu/attention.py: more warps for bigger tiles
        num_warps = 4 if block_rows * head_dim <= 64 * 64 else 8
    kernel = functools.partial(_cache_split_kernel, scale=scale, block_k=block_k,
                               split_size=split_size, windowed=windowed)
    out_shape = [
        jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows), jnp.float32),
    ]
    # Row blocks vary fastest, so the programs that read the same KV block run side by side (L2).
    return pl.pallas_call(
        kernel,
        grid=(row_blocks, num_splits, kv_heads, batch),
        in_specs=[
            pl.BlockSpec((None,), lambda r, s, h, b: (b,)),
            pl.BlockSpec((None, block_rows), lambda r, s, h, b: (b, r)),
            pl.BlockSpec((None, None, block_rows, head_dim), lambda r, s, h, b: (b, h, r, 0)),
            pl.BlockSpec((None, cache_size, None, head_dim), lambda r, s, h, b: (b, 0, h, 0)),
            pl.BlockSpec((None, cache_size, None, head_dim), lambda r, s, h, b: (b, 0, h, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_rows, head_dim),
                         lambda r, s, h, b: (b, h, s, r, 0)),
            pl.BlockSpec((None, None, None, block_rows), lambda r, s, h, b: (b, h, s, r)),
            pl.BlockSpec((None, None, None, block_rows), lambda r, s, h, b: (b, h, s, r)),
        ],
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="tree_attention_cache",
    )(cache_len, row_first, q_rows, k_cache, v_cache)


# ----------------------------------------------------------------------------------------------
# jnp glue: stacking heads, the tree block, the merge
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "block_rows", "num_splits",
                                             "num_warps", "num_stages", "interpret", "window"))
def _tree_attention_kernel(q, k_cache, v_cache, cache_len, k_new, v_new, mask, sinks, *, scale, block_k,
                           block_rows, num_splits, num_warps, num_stages, interpret, window):
    """Shapes as tree_attention_reference; the cache half runs in Pallas, the tree half in jnp."""
    head_dim = q.shape[3]
    cache_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    q_rows = stack_query_heads(q, kv_heads)  # [B, Hkv, R, D]
    rows = q_rows.shape[2]

    # Triton tiles: rows and D powers of two >= 16; the cache at least one block long.
    padded_rows = max(MIN_TILE, next_pow2(rows), block_rows)
    block_rows = min(block_rows, padded_rows)
    padded_dim = max(MIN_TILE, next_pow2(head_dim))
    padded_cache = max(MIN_TILE, cache_size)
    block_k = min(block_k, 1 << (padded_cache.bit_length() - 1))
    block_rows, block_k, num_stages = fit_tiles(block_rows, block_k, num_stages, padded_dim, k_cache.dtype.itemsize,
                                                min_tile=MIN_TILE)
    k_cache = pad_axis(pad_axis(k_cache, 3, padded_dim), 1, padded_cache)
    v_cache = pad_axis(pad_axis(v_cache, 3, padded_dim), 1, padded_cache)
    q_padded = pad_axis(pad_axis(q_rows, 3, padded_dim), 2, padded_rows)
    cache_len = jnp.clip(cache_len.astype(jnp.int32), 0, cache_size)

    row_first = window_starts(mask, cache_len, window, q.shape[2] // kv_heads, padded_rows)
    o, m, l = _cache_partials(q_padded, k_cache, v_cache, cache_len, row_first, scale=scale, block_k=block_k,
                              block_rows=block_rows, num_splits=num_splits, num_warps=num_warps,
                              num_stages=num_stages, interpret=interpret, windowed=window is not None)
    return with_tree(q_rows, o, m, l, k_new, v_new, mask, scale=scale, dtype=q.dtype, window=window, sinks=sinks)


# ----------------------------------------------------------------------------------------------
# Public op
# ----------------------------------------------------------------------------------------------


def _validate(q, k_cache, v_cache, cache_len, k_new, v_new, mask):
    """Raises ValueError naming the offending shapes; runs on static shapes, before any tracing."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, Hq, D], got shape {q.shape}")
    batch, num_tokens, q_heads, head_dim = q.shape
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [B, L, Hkv, D], got shapes "
                         f"{k_cache.shape} and {v_cache.shape}")
    _, cache_size, kv_heads, _ = k_cache.shape
    if k_cache.shape != (batch, cache_size, kv_heads, head_dim):
        raise ValueError(f"k_cache shape {k_cache.shape} does not match q shape {q.shape}: "
                         f"expected ({batch}, L, Hkv, {head_dim})")
    expected_new = (batch, num_tokens, kv_heads, head_dim)
    if k_new.shape != expected_new or v_new.shape != expected_new:
        raise ValueError(f"k_new and v_new must be {expected_new} (B, T, Hkv, D), got shapes "
                         f"{k_new.shape} and {v_new.shape}")
    if q_heads % kv_heads:
        raise ValueError(f"Hq={q_heads} query heads is not a multiple of Hkv={kv_heads} KV heads")
    if mask.shape != (batch, num_tokens, num_tokens) or mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be bool[{batch}, {num_tokens}, {num_tokens}], got "
                         f"{mask.dtype}{list(mask.shape)}")
    if cache_len.shape != (batch,) or not jnp.issubdtype(cache_len.dtype, jnp.integer):
        raise ValueError(f"cache_len must be int[{batch}], got "
                         f"{cache_len.dtype}{list(cache_len.shape)}")


def validate_window(window, sinks, q_heads: int):
    """A sliding window must be a positive Python int (a static kernel argument); sinks f32[Hq]."""
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window={window!r}: expected a positive int (static) or None")
    if sinks is not None and tuple(sinks.shape) != (q_heads,):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)}: expected one per query head, ({q_heads},)")


def _validate_knobs(block_k: int, block_rows: int, num_splits: int | None):
    for name, value in (("block_k", block_k), ("block_rows", block_rows)):
        if value < MIN_TILE or value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two >= {MIN_TILE}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1 (or None for automatic)")


def tree_attention(q, k_cache, v_cache, cache_len, k_new, v_new, mask, *,
                   scale: float | None = None, impl: ImplName = "auto", block_k: int = 64,
                   block_rows: int = 64, num_splits: int | None = None,
                   num_warps: int | None = None, num_stages: int = 2, window: int | None = None,
                   sinks=None):
    """Attention of T tree queries over the cache (positions < cache_len) and the masked tree.

    Args:
      q: [B, T, Hq, D] queries of the T tree tokens.
      k_cache, v_cache: [B, L, Hkv, D]; slots >= cache_len[b] are ignored (may hold anything).
      cache_len: int[B] committed length of each sequence (clipped to [0, L]).
      k_new, v_new: [B, T, Hkv, D] keys and values of the tree tokens.
      mask: bool[B, T, T]; mask[b, t, j] iff tree query t may see tree key j.
      scale: score scale, default D ** -0.5.
      impl: "auto" | "pallas" | "interpret" | "tpu" | "tpu_interpret" | "reference" (see pallas_kernels.impl);
        the TPU forms are the paged TPU kernel reading the dense cache in place.
      block_k: cache keys per inner-loop step (power of two >= 16).
      block_rows: stacked (token, head) rows per program (power of two >= 16).
      num_splits: cache splits per (b, KV head); None picks one from the shapes.
      num_warps, num_stages: Triton launch parameters (num_warps None: 4, or 8 for tiles bigger
        than 64 x 64). Defaults are reasoned, not yet tuned on a GPU (scripts/bench_kernels.py).
      window: a sliding window (gpt-oss, Gemma-3): node t, at position cache_len + depth(t), reads the keys less
        than ``window`` positions behind it, and the kernel's loop starts at the window (reads only its blocks).
      sinks: f32[Hq] or None, a logit per query head in every softmax's denominator (gpt-oss).

    Returns:
      [B, T, Hq, D] in q.dtype. Every query must see at least one key (node t sees itself).
    """
    _validate(q, k_cache, v_cache, cache_len, k_new, v_new, mask)
    _validate_knobs(block_k, block_rows, num_splits)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    validate_window(window, sinks, q.shape[2])
    resolved = resolve_impl(impl, "tree_attention")
    if resolved.is_tpu:
        return tree_attention_tpu(q, k_cache, v_cache, cache_len, k_new, v_new, mask, scale=scale,
                                  interpret=resolved.interpreted, window=window, sinks=sinks)
    if resolved is Impl.REFERENCE:
        return tree_attention_reference(q, k_cache, v_cache, cache_len, k_new, v_new, mask,
                                        scale=scale, window=window, sinks=sinks)
    return _tree_attention_kernel(q, k_cache, v_cache, cache_len, k_new, v_new, mask, sinks, scale=scale,
                                  block_k=block_k, block_rows=block_rows, num_splits=num_splits,
                                  num_warps=num_warps, num_stages=num_stages,
                                  interpret=resolved is Impl.INTERPRET, window=window)
