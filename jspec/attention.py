"""The target's attention inside generate: the tree-attention kernel for verify passes, cuDNN/XLA otherwise.

A verify pass (T tree tokens, mask over exactly those T, written at cache_len) goes to
``pallas_kernels.tree_attention`` — the Pallas kernel on GPU, its jnp reference elsewhere (impl="auto").
Prefill and plain decode (causal, ``local_mask`` None) and drafter windows wider than T go to
``jax.nn.dot_product_attention`` via ``models.attention.dense_attention``.
"""

from __future__ import annotations

import jax

from models.attention import dense_attention
from pallas_kernels.tree_attention import tree_attention


def target_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, k_new: jax.Array, v_new: jax.Array,
                     cache_len: jax.Array, local_mask: jax.Array | None, *, scale: float) -> jax.Array:
    """An ``models.attention.AttentionFn``; shapes as documented there."""
    if local_mask is None or local_mask.shape[2] != q.shape[1]:
        return dense_attention(q, k_cache, v_cache, k_new, v_new, cache_len, local_mask, scale=scale)
    return tree_attention(q, k_cache, v_cache, cache_len, k_new, v_new, local_mask, scale=scale, impl="auto")
