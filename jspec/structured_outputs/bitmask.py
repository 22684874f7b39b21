"""Structured outputs on the device: a grammar's allowed tokens, as llguidance's bitmask, applied to logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def bitmask_words(vocab_size: int) -> int:
    """Words of one node's bitmask: ceil(V / 32) int32s (token v is bit v % 32 of word v // 32)."""
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array | None) -> jax.Array:
    """Sets every disallowed token's logit to -inf; identity without a bitmask.

    logits: [B, N, V] the target's at a step's first N nodes; bitmask: i32[B, M, ceil(V / 32)] with M >= N, node n's
    allowed tokens in row n (a node read as the first N of M: a verify pass over a shortened chain, a decode of the
    root alone)."""
    if bitmask is None:
        return logits
    nodes, vocab = logits.shape[1], logits.shape[2]
    if bitmask.shape[1] < nodes or bitmask.shape[2] != bitmask_words(vocab):
        raise ValueError(f"token bitmask of shape {bitmask.shape}: expected [B, >= {nodes}, {bitmask_words(vocab)}] "
                         f"for logits of shape {logits.shape}")
    token = np.arange(vocab)
    words = jnp.take(bitmask[:, :nodes], jnp.asarray(token // 32, jnp.int32), axis=2)  # [B, N, V]
    allowed = (jnp.right_shift(words, jnp.asarray(token % 32, jnp.int32)) & 1) == 1
    return jnp.where(allowed, logits, -jnp.inf)
