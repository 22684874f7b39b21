"""The decode state carried by the generation loop: an explicit pytree, every shape fixed by the setup.

Invariant between steps, per sequence b::

    tokens[b, :seq_len[b]]                  prompt + generated tokens (slot = position)
    cache.k[l][b, :seq_len[b] - 1]          K of tokens[b, :seq_len[b] - 1] in layer l (V likewise); the last
                                            token is the root of the next step's tree, its K/V not in the cache yet
    tokens[b, prompt_len[b] : seq_len[b]]   the num_generated[b] new tokens
    features.logprobs.*[b, prompt_len[b]:seq_len[b]]
                                            when recording (``GenerateSetup.logprobs``): the generated tokens'
                                            log-probabilities (``jspec.logprobs``)
    features.hidden_states[:, b, :seq_len[b] - 1]
                                            when capturing (``GenerateSetup.capture_layers``): the target's states
                                            at each captured layer for those tokens; like its K/V, the last
                                            token's come with the next step (or ``generate``'s final pass)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from jspec.features import FeatureState
from jspec.state_layout import SHARED, TARGET_KV, TARGET_WINDOW_KV, PerPosition, PerRow, per_position, per_row
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
    features: FeatureState = FeatureState()  # the optional features' buffers (jspec.features), each None when off

    @property
    def cache_len(self) -> jax.Array:
        """i32[B] tokens whose K/V are in the cache."""
        return self.seq_len - 1


def declare_layout(state: DecodeState, *, max_seq_len: int, cache_slots: int, drafter: Any,
                   window_layers: frozenset[int] = frozenset()) -> DecodeState:
    """``state``'s structure with each leaf's declaration (``jspec.state_layout``); the drafter declares its own
    state's (``Drafter.state_layout``). max_seq_len, cache_slots: the setup's (``GenerateSetup.cache_slots``);
    window_layers: the target layers whose sliding window binds (their K/V in ``TARGET_WINDOW_KV``; per-layer
    caches only)."""
    features = state.features

    def layer_pools(buffers):
        if not window_layers:
            return per_position(buffers, TARGET_KV, cache_slots)
        return tuple(per_position(buffer, TARGET_WINDOW_KV if i in window_layers else TARGET_KV, cache_slots)
                     for i, buffer in enumerate(buffers))

    return DecodeState(
        tokens=PerPosition("tokens", max_seq_len), seq_len=PerRow(),
        cache=type(state.cache)(layer_pools(state.cache.k), layer_pools(state.cache.v)), num_generated=PerRow(),
        done=PerRow(),
        num_steps=PerRow(), accepted_hist=PerRow(), step=SHARED,
        draft=None if state.draft is None else drafter.state_layout(state.draft),
        features=FeatureState(hidden_states=per_position(features.hidden_states, "captured states", max_seq_len,
                                                         row_axis=1, slot_axis=2),
                              logprobs=per_position(features.logprobs, "log-probabilities", max_seq_len),
                              output_counts=per_row(features.output_counts)))
