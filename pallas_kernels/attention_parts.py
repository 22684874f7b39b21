"""The pieces of tree attention every kernel form shares: the online-softmax block, the query-head stacking, the
tree block as one more partial and the log-sum-exp merge (pure jnp: they run inside Triton and Mosaic kernels and
around them).

Used by ``tree_attention`` (Triton), ``paged_tree_attention`` (Triton) and ``paged_tree_attention_tpu`` (Mosaic TPU,
dense and paged).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

# A finite "minus infinity": exp(MASK_VALUE - m) underflows to 0 and MASK_VALUE - MASK_VALUE = 0,
# so a row that has seen no valid key yet never produces inf - inf = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# Bytes of an H100 SM's 227 KiB of shared memory a Triton program's tiles may take (some is the compiler's).
SHARED_MEMORY_BUDGET = 200 * 1024


def fit_tiles(block_rows: int, block_k: int, num_stages: int, head_dim: int, itemsize: int, *, min_tile: int,
              fixed_k: bool = False) -> tuple[int, int, int]:
    """(block_rows, block_k, num_stages) whose tiles (the rows' queries, and num_stages buffers of K and V blocks,
    each ``head_dim`` wide of ``itemsize`` bytes) fit :data:`SHARED_MEMORY_BUDGET`: K blocks halved first (not
    when ``fixed_k``: a page), then row blocks, down to ``min_tile``, then one stage. Head dims up to 256 keep the
    given tiles; MLA's latent (576, padded to 1024) takes 16 x 16. ValueError where nothing fits (pages too large
    for such a head: smaller --block-size)."""
    def size(rows, keys, stages):
        return itemsize * head_dim * (rows + 2 * stages * keys)

    while size(block_rows, block_k, num_stages) > SHARED_MEMORY_BUDGET:
        if not fixed_k and block_k > min_tile and block_k >= block_rows:
            block_k //= 2
        elif block_rows > min_tile:
            block_rows //= 2
        elif not fixed_k and block_k > min_tile:
            block_k //= 2
        elif num_stages > 1:
            num_stages = 1
        else:
            raise ValueError(f"a head dim of {head_dim} with K/V blocks of {block_k} ({itemsize}-byte values) takes "
                             f"{size(block_rows, block_k, num_stages)} bytes of shared memory, over "
                             f"{SHARED_MEMORY_BUDGET}: expected smaller pages")
    return block_rows, block_k, num_stages


def dot_precision(dtype) -> lax.Precision:
    """f32 inputs get true f32 dots (no TF32); bf16 products are exact in f32 accumulation."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def flash_init(rows: int, head_dim: int) -> tuple:
    """An online softmax's start: (o f32[rows, D] zeros, m f32[rows] at MASK_VALUE, l f32[rows] zeros)."""
    return (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def flash_step(q, k, v, valid, carry, *, scale: float, precision, row_first=None, positions=None) -> tuple:
    """One block of an online softmax inside a kernel: q [R, D] against keys k and values v [K, D] where valid
    bool[K] -> the carry (o, m, l) updated. Invalid keys are masked and their V rows zeroed (unused slots may hold
    anything, and ``0 * NaN = NaN``). Under a sliding window, row r reads only the keys whose position (i32[K]
    ``positions``) is at least ``row_first`` i32[R][r] (``window_starts``)."""
    o_prev, m_prev, l_prev = carry
    v = jnp.where(valid[:, None], v, jnp.zeros_like(v))
    scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=precision)
    seen = valid[None, :]  # [1 or R, K]
    if row_first is not None:
        seen = seen & (positions[None, :] >= row_first[:, None])
    scores = jnp.where(seen, scores * scale, MASK_VALUE)  # [R, K]
    m_next = jnp.maximum(m_prev, scores.max(axis=-1))
    correction = jnp.exp(m_prev - m_next)
    p = jnp.where(seen, jnp.exp(scores - m_next[:, None]), 0.0)
    l_next = l_prev * correction + p.sum(axis=-1)
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32, precision=precision)
    return o_prev * correction[:, None] + pv, m_next, l_next


def with_tree(q_rows, o, m, l, k_new, v_new, mask, *, scale: float, dtype, window: int | None = None,
              sinks=None):
    """The prefix partials (o f32[B, Hkv, S, R', D'] unnormalised, m, l f32[B, Hkv, S, R'], rows and D possibly
    padded) merged with the tree block's of the unpadded q_rows [B, Hkv, R, D] -> [B, T, Hq, D] in ``dtype``. A
    sliding ``window`` keeps a node's ancestors less than window deep above it; ``sinks`` f32[Hq] join each head's
    denominator as one more partial that reads no value."""
    batch, kv_heads, rows, head_dim = q_rows.shape
    if window is not None:
        depth = tree_depths(mask)
        mask = mask & (depth[:, :, None] - depth[:, None, :] < window)
    o_tree, m_tree, l_tree = tree_partial(q_rows, k_new, v_new, mask, scale=scale)
    parts = ([o[:, :, :, :rows, :head_dim], o_tree[:, :, None]], [m[:, :, :, :rows], m_tree[:, :, None]],
             [l[:, :, :, :rows], l_tree[:, :, None]])
    if sinks is not None:  # row r = t * G + g holds query head h * G + g
        sink = jnp.tile(sinks.astype(jnp.float32).reshape(kv_heads, -1), (1, mask.shape[1]))  # [Hkv, R]
        parts[0].append(jnp.zeros((batch, kv_heads, 1, rows, head_dim), jnp.float32))
        parts[1].append(jnp.broadcast_to(sink, (batch, kv_heads, rows))[:, :, None])
        parts[2].append(jnp.ones((batch, kv_heads, 1, rows), jnp.float32))
    out = merge_partials(*(jnp.concatenate(part, axis=2) for part in parts))
    return unstack_query_heads(out, mask.shape[1]).astype(dtype)


def tree_depths(mask):
    """mask bool[B, T, T] (each node sees itself and its ancestors) -> i32[B, T]: each node's depth."""
    return jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1


def window_starts(mask, cache_len, window: int | None, group: int, rows: int):
    """Each stacked row's first visible prefix position under a sliding window -> i32[B, rows] (rows past the
    T * G real ones, padding: the last real row's): node t at position cache_len + depth(t) reads prefix positions
    past cache_len + depth(t) - window. No window: zeros."""
    batch, num_tokens = mask.shape[:2]
    if window is None:
        return jnp.zeros((batch, rows), jnp.int32)
    first = cache_len[:, None] + tree_depths(mask) - window + 1  # [B, T]
    first = jnp.repeat(jnp.maximum(first, 0), group, axis=1)      # [B, T * G]
    if rows == first.shape[1]:
        return first
    return jnp.concatenate([first, jnp.broadcast_to(first[:, -1:], (batch, rows - first.shape[1]))], axis=1)


def stack_query_heads(q, kv_heads: int):
    """q: [B, T, Hq, D] -> [B, Hkv, T * G, D], row r = t * G + g holding query head h * G + g."""
    batch, num_tokens, q_heads, head_dim = q.shape
    group = q_heads // kv_heads
    q = q.reshape(batch, num_tokens, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    return q.reshape(batch, kv_heads, num_tokens * group, head_dim)


def unstack_query_heads(out, num_tokens: int):
    """out: [B, Hkv, T * G, D] -> [B, T, Hq, D] (inverse of stack_query_heads)."""
    batch, kv_heads, rows, head_dim = out.shape
    group = rows // num_tokens
    out = out.reshape(batch, kv_heads, num_tokens, group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(batch, num_tokens, kv_heads * group, head_dim)


def tree_partial(q_rows, k_new, v_new, mask, *, scale):
    """The tree keys as one more flash block.

    q_rows: [B, Hkv, T*G, D]; k_new, v_new: [B, T, Hkv, D]; mask: bool[B, T, T]
    -> o f32[B, Hkv, T*G, D] (unnormalised), m, l f32[B, Hkv, T*G].
    """
    group = q_rows.shape[2] // mask.shape[1]
    precision = dot_precision(q_rows.dtype)
    visible = jnp.repeat(mask, group, axis=1)[:, None]  # [B, 1, T*G, T]
    scores = jnp.einsum("bhrd,bjhd->bhrj", q_rows, k_new, preferred_element_type=jnp.float32,
                        precision=precision)
    scores = jnp.where(visible, scores * scale, MASK_VALUE)
    m = scores.max(axis=-1)
    p = jnp.where(visible, jnp.exp(scores - m[..., None]), 0.0)
    o = jnp.einsum("bhrj,bjhd->bhrd", p, v_new.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return o, m, p.sum(axis=-1)


def merge_partials(o, m, l):
    """Logsumexp merge over axis 2.

    o: f32[B, Hkv, S, R, D] (unnormalised); m, l: f32[B, Hkv, S, R] -> f32[B, Hkv, R, D].
    """
    m_all = m.max(axis=2, keepdims=True)
    weight = jnp.exp(m - m_all)  # [B, Hkv, S, R]
    l_all = (l * weight).sum(axis=2)
    o_all = (o * weight[..., None]).sum(axis=2)
    # l_all = 0 only for rows that see no key at all (padding); give them 0, not 0/0.
    return o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None]


def pad_axis(x, axis: int, size: int):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad) if size != x.shape[axis] else x
