"""Distilling an EAGLE-3 head from a frozen target, with EAGLE-3's training-time test.

Data: token sequences (ideally the target's own generations). The target runs once per batch, giving the
features (residual-stream inputs of layers 2, L//2, L-3) and its next-token distributions. The head is trained
to reproduce, at position p, the target's distribution for position p + 2 given (token p + 1, feature p) —
the pairing the drafter uses (jspec/drafters/eagle3.py). Training-time test: the head is unrolled
``unroll`` times; unroll step j replaces the feature at p by the head's own pre-norm output at p - 1 from step
j - 1, as drafting does at depth j + 1, and its loss is weighted by ``decay ** j``. (Simplification: at step j
the head attends to the step-j inputs of earlier positions, where drafting would see true-feature pairs
further back.)
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from models.attention import KVCache
from models.config import ModelConfig
from models.eagle3 import Eagle3Config, Eagle3Head
from models.llama import LlamaModel


class DistillBatch(NamedTuple):
    tokens: jax.Array        # i32[B, N]
    features: jax.Array      # f32[B, N, 3H] target features at each position
    target_probs: jax.Array  # f32[B, N, V_draft] the target's next-token distribution at each position
    valid: jax.Array         # bool[B, N] positions holding real tokens


@functools.partial(jax.jit, static_argnames=("target",))
def target_features(params_t: Any, tokens: jax.Array, *, target: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """tokens: i32[B, N] -> (features f32[B, N, 3H], logits f32[B, N, V]) from one causal target pass."""
    batch, width = tokens.shape
    cache = KVCache.zeros(target.num_layers, batch, width, target.num_kv_heads, target.head_dim, jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(width), (batch, width))
    out = LlamaModel(target).apply({"params": params_t}, tokens, positions, cache, jnp.zeros((batch,), jnp.int32),
                                   tap_layers=Eagle3Config.tap_layers(target))
    return jnp.concatenate(list(out.taps), axis=-1), out.logits


def make_batch(params_t: Any, target: ModelConfig, tokens: np.ndarray, lengths: np.ndarray,
               t2d: np.ndarray | None = None) -> DistillBatch:
    """tokens: i32[B, N] right-padded, lengths: i32[B]; t2d: target ids kept in the draft vocab (None: all)."""
    features, logits = target_features(params_t, jnp.asarray(tokens), target=target)
    if t2d is not None:
        logits = logits[..., np.nonzero(t2d)[0]]
    valid = np.arange(tokens.shape[1])[None] < np.asarray(lengths)[:, None]
    return DistillBatch(jnp.asarray(tokens), features, jax.nn.softmax(logits, axis=-1), jnp.asarray(valid))


def distill_loss(head_params: Any, embedding: jax.Array, batch: DistillBatch, *, config: Eagle3Config,
                 unroll: int, decay: float) -> jax.Array:
    """Weighted cross-entropy (target distribution vs head) summed over the unrolled steps."""
    head = Eagle3Head(config)
    b, n = batch.tokens.shape
    tokens_next = jnp.concatenate([batch.tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)  # token p + 1
    targets = jnp.concatenate([batch.target_probs[:, 1:], jnp.zeros_like(batch.target_probs[:, :1])], axis=1)
    embeds = jnp.take(embedding, tokens_next, axis=0)
    positions = jnp.broadcast_to(jnp.arange(n), (b, n))
    cache = KVCache.zeros(1, b, n, config.layer.num_kv_heads, config.layer.head_dim, jnp.float32)
    hidden, total, weight_sum = batch.features, 0.0, 0.0
    for step in range(unroll):
        out = head.apply({"params": head_params}, embeds, hidden, positions, cache, jnp.zeros((b,), jnp.int32))
        # position p predicts p + 2 at step 0; step j's position p stands for depth j + 1 of a draft from p - j
        valid = batch.valid & (jnp.arange(n)[None] + 2 < batch.valid.sum(axis=1, keepdims=True))
        valid = valid & (jnp.arange(n)[None] >= step)
        ce = -jnp.sum(targets * jax.nn.log_softmax(out.logits), axis=-1)
        total += decay ** step * jnp.sum(jnp.where(valid, ce, 0.0)) / jnp.maximum(valid.sum(), 1)
        weight_sum += decay ** step
        hidden = jnp.concatenate([jnp.zeros_like(out.hidden[:, :1]), out.hidden[:, :-1]], axis=1)
    return total / weight_sum


def distill_eagle3_head(head_params: Any, params_t: Any, batch: DistillBatch, *, config: Eagle3Config,
                        steps: int, learning_rate: float = 3e-3, unroll: int = 3, decay: float = 0.8,
                        progress: bool = False) -> tuple[Any, list[float]]:
    """Full-batch AdamW (warmup + cosine) on ``batch`` -> (trained head params, loss per step)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(1, steps // 10), steps)
    optimizer = optax.adamw(schedule, weight_decay=0.0)
    embedding = params_t["embed_tokens"]["embedding"]
    loss_fn = functools.partial(distill_loss, config=config, unroll=unroll, decay=decay)

    @jax.jit
    def update(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params, embedding, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = optimizer.init(head_params)
    losses = []
    iterator = range(steps)
    if progress:
        from tqdm import tqdm
        iterator = tqdm(iterator, desc="eagle3 head", unit="step")
    for _ in iterator:
        head_params, opt_state, loss = update(head_params, opt_state)
        losses.append(float(loss))
    return head_params, losses
