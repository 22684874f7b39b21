"""EAGLE-3's training-time test (TTT), exactly as jspec drafts a chain.

A window of N real tokens t_0..t_{N-1} with target features f_p (the fused taps) and the target's next-token
distributions P_p (P_p is the target's distribution of t_{p+1}). Index p of unroll step j stands for the draft
chain rooted after slot p: the head's cache slots 0..p hold the real pairs (t_{q+1}, f_q), and the chain's node
at depth j + 1 is::

    input    (t_{p+j+1}, g^{j-1}_p)      g^{j-1}_p: step j-1's pre-norm output at index p (f_p at step 0)
    position p + j                       rope, as drafting gives the node (jspec/drafters/tree_search.py)
    attends  step 0 at indices <= p      the real context
             steps 1..j at index p       its own ancestors in the chain
    label    P_{p+j+1}                   the target's distribution after t_{p+j+1}

This is what ``Eagle3Drafter`` computes when the chain drafts the true tokens (tests/jspec/train/test_ttt.py
checks it against step-by-step drafting with a KV cache). Every step runs the head over all N indices at
once: its keys go to cache block j (slots jN .. jN + N - 1) and a static mask picks what each query reads, as
SpecForge's ``cache_hidden`` does (SpecForge keeps rope positions at p; jspec uses p + j, the drafting ones).
The loss is sum_j decay^j CE_j / sum_j decay^j, CE_j the mean over valid indices (p + j + 1 < length) of the
cross-entropy of the head against the target's distribution.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.attention import KVCache
from models.eagle3 import Eagle3Config, Eagle3Head


class TttMetrics(NamedTuple):
    loss: jax.Array      # f32[] the weighted loss
    step_loss: jax.Array  # f32[unroll] cross-entropy per unroll step
    accuracy: jax.Array  # f32[unroll] head top-1 == target top-1, per unroll step, over valid indices


def ttt_mask(width: int, step: int, unroll: int) -> np.ndarray:
    """bool[N, unroll * N]: what index p of unroll step ``step`` attends (causal block 0, diagonal blocks
    1..step, nothing after)."""
    mask = np.zeros((width, unroll * width), bool)
    mask[:, :width] = np.tril(np.ones((width, width), bool))
    for block in range(1, step + 1):
        mask[:, block * width:(block + 1) * width] = np.eye(width, dtype=bool)
    return mask


def _masked_attention(mask: np.ndarray, q, k_cache, v_cache, k_new, v_new, cache_len, local_mask, write_offset,
                      *, scale):
    """AttentionFn reading the whole TTT cache through the static ``mask`` (the same for every row)."""
    del k_new, v_new, cache_len, local_mask, write_offset
    visible = jnp.broadcast_to(jnp.asarray(mask)[None, None], (q.shape[0], 1) + mask.shape)
    read = jnp.asarray(mask.any(axis=0))[None, :, None, None]
    v_cache = jnp.where(read, v_cache, jnp.zeros((), v_cache.dtype))  # unwritten slots may hold anything
    return jax.nn.dot_product_attention(q, k_cache, v_cache, mask=visible, scale=scale)


def ttt_logits(head_params: Any, config: Eagle3Config, embedding: jax.Array, tokens: jax.Array,
               features: jax.Array, unroll: int) -> tuple[list[jax.Array], list[jax.Array]]:
    """tokens i32[B, N], features f32[B, N, 3H] -> per unroll step j: (logits f32[B, N, V_draft] at index p for
    the draft node at depth j + 1 of the chain rooted after slot p, the input token id i32[B, N] it read).

    Indices whose token would fall past the window read token 0; the loss masks them."""
    batch, width = tokens.shape
    cfg = config.layer
    cache = KVCache.zeros(1, batch, unroll * width, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    hidden, logits, inputs = features, [], []
    for step in range(unroll):
        shifted = jnp.concatenate([tokens[:, step + 1:], jnp.zeros((batch, step + 1), tokens.dtype)], axis=1)
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32) + step, (batch, width))
        head = Eagle3Head(config, attention_fn=functools.partial(_masked_attention, ttt_mask(width, step, unroll)))
        out = head.apply({"params": head_params}, jnp.take(embedding, shifted, axis=0), hidden, positions, cache,
                         jnp.zeros((batch,), jnp.int32), None, step * width)
        cache, hidden = out.cache, out.hidden
        logits.append(out.logits)
        inputs.append(shifted)
    return logits, inputs


def ttt_loss(head_params: Any, config: Eagle3Config, embedding: jax.Array, tokens: jax.Array,
             features: jax.Array, target_probs: jax.Array, lengths: jax.Array, *, unroll: int,
             decay: float) -> TttMetrics:
    """The TTT loss of a batch. target_probs f32[B, N, V_draft]: the target's next-token distribution at each
    position over the draft vocabulary; lengths i32[B]: real tokens per row."""
    _, width = tokens.shape
    logits, _ = ttt_logits(head_params, config, embedding, tokens, features, unroll)
    index = jnp.arange(width)[None]
    total = weight = 0.0
    step_loss, accuracy = [], []
    for step, step_logits in enumerate(logits):
        label = jnp.concatenate([target_probs[:, step + 1:],
                                 jnp.zeros_like(target_probs[:, :step + 1])], axis=1)  # P_{p+j+1}
        valid = index + step + 1 < lengths[:, None]
        count = jnp.maximum(valid.sum(), 1)
        ce = -jnp.sum(label * jax.nn.log_softmax(step_logits), axis=-1)
        ce = jnp.sum(jnp.where(valid, ce, 0.0)) / count
        hit = jnp.argmax(step_logits, axis=-1) == jnp.argmax(label, axis=-1)
        step_loss.append(ce)
        accuracy.append(jnp.sum(valid & hit) / count)
        total += decay ** step * ce
        weight += decay ** step
    return TttMetrics(total / weight, jnp.stack(step_loss), jnp.stack(accuracy))
