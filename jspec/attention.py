"""The target's attention inside generate: the tree-attention kernel for verify passes, cuDNN/XLA otherwise.

A verify pass (T tree tokens, mask over exactly those T, written at cache_len) goes to
``pallas_kernels.tree_attention``'s Pallas kernel on GPU. Everything else (prefill, plain decode, drafter windows
wider than T, and verify passes off the GPU) goes to ``models.attention.dense_attention`` (cuDNN/XLA's
``dot_product_attention``): the kernel's jnp reference is its specification, and slower than that on a CPU.
"""

from __future__ import annotations

import jax

from models.attention import dense_attention
from pallas_kernels._impl import Impl, resolve_impl
from pallas_kernels.tree_attention import tree_attention


def target_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, k_new: jax.Array, v_new: jax.Array,
                     cache_len: jax.Array, local_mask: jax.Array | None, *, scale: float) -> jax.Array:
    """An ``models.attention.AttentionFn``; shapes as documented there."""
    if local_mask is None or local_mask.shape[2] != q.shape[1] or resolve_impl("auto") is not Impl.PALLAS:
        return dense_attention(q, k_cache, v_cache, k_new, v_new, cache_len, local_mask, scale=scale)
    return tree_attention(q, k_cache, v_cache, cache_len, k_new, v_new, local_mask, scale=scale, impl="auto")
