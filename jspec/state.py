"""The decode state carried by the generation loop: an explicit pytree, every shape fixed by the setup.

Invariant between steps, per sequence b::

    tokens[b, :seq_len[b]]                  prompt + generated tokens (slot = position)
    cache.k[l][b, :seq_len[b] - 1]          K of tokens[b, :seq_len[b] - 1] in layer l (V likewise); the last
                                            token is the root of the next step's tree, its K/V not in the cache yet
    tokens[b, prompt_len[b] : seq_len[b]]   the num_generated[b] new tokens
    logprobs.*[b, prompt_len[b]:seq_len[b]] when recording (``GenerateSetup.logprobs``): the generated tokens'
                                            log-probabilities (``jspec.logprobs``)
    hidden_states[:, b, :seq_len[b] - 1]    when capturing (``GenerateSetup.capture_layers``): the target's states
                                            at each captured layer for those tokens; like its K/V, the last
                                            token's come with the next step (or ``generate``'s final pass)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jspec.logprobs import Logprobs
from jspec.state_layout import SHARED, TARGET_KV, PerPosition, PerRow, per_position, per_row
from models.attention import KVCache


class DecodeState(NamedTuple):
    tokens: jax.Array         # i32[B, S] prompt + generated tokens; slots >= seq_len are padding
    seq_len: jax.Array        # i32[B] tokens committed so far (prompt included)
    cache: KVCache            # target K/V per layer: k, v tuples of num_layers arrays [B, S_cache, Hkv, D]
    num_generated: jax.Array  # i32[B] new tokens committed
    done: jax.Array           # bool[B] stopped (EOS / stop id / max_new_tokens); frozen from then on
    num_steps: jax.Array      # i32[B] target verify steps taken while not done
    accepted_hist: jax.Array  # i32[B, D + 1] steps that committed exactly n = 1..D+1 tokens (index n - 1)
    step: jax.Array           # i32[] loop iteration
    draft: Any = None         # the drafter's own state (its KV cache, its next prediction); None when plain
    hidden_states: jax.Array | None = None  # [C, B, S, H] compute dtype: captured states, slot = position; None
                                            # unless GenerateSetup.capture_layers (C of them)
    logprobs: Logprobs | None = None        # [B, S(, K)] the generated tokens' log-probabilities; None unless
                                            # GenerateSetup.logprobs
    output_counts: jax.Array | None = None  # i32[B, V] how often each token was generated (the logits processors'
                                            # penalties); None unless GenerateSetup.logits_processors

    @property
    def cache_len(self) -> jax.Array:
        """i32[B] tokens whose K/V are in the cache."""
        return self.seq_len - 1


def declare_layout(state: DecodeState, *, max_seq_len: int, cache_slots: int, drafter: Any) -> DecodeState:
    """``state``'s structure with each leaf's declaration (``jspec.state_layout``); the drafter declares its own
    state's (``Drafter.state_layout``). max_seq_len, cache_slots: the setup's (``GenerateSetup.cache_slots``)."""
    return DecodeState(
        tokens=PerPosition("tokens", max_seq_len), seq_len=PerRow(),
        cache=per_position(state.cache, TARGET_KV, cache_slots), num_generated=PerRow(), done=PerRow(),
        num_steps=PerRow(), accepted_hist=PerRow(), step=SHARED,
        draft=None if state.draft is None else drafter.state_layout(state.draft),
        hidden_states=None if state.hidden_states is None else PerPosition("captured states", max_seq_len, 1, 2),
        logprobs=per_position(state.logprobs, "log-probabilities", max_seq_len),
        output_counts=per_row(state.output_counts))


def write_hidden_states(hidden: jax.Array, states: jax.Array, start: jax.Array, count: jax.Array) -> jax.Array:
    """Writes states of consecutive positions into the capture buffer, row by row.

    hidden: [C, B, S, H]; states: [C, B, N, H], row b's n-th at position start[b] + n; start, count: i32[B]: only
    the first count[b] of row b are written (0: the row is left as it is).
    """
    width, slots = states.shape[2], hidden.shape[2]

    def row(buffer, new, first, n):  # [C, S, H], [C, N, H], i32[], i32[]
        index = jnp.arange(width)
        slot = jnp.where(index < n, first + index, slots)  # out of range: dropped
        return buffer.at[:, slot].set(new.astype(buffer.dtype), mode="drop")

    return jax.vmap(row, in_axes=(1, 1, 0, 0), out_axes=1)(hidden, states, start, count)
