"""The decode state carried by the generation loop: an explicit pytree, every shape fixed by the setup.

Invariant between steps, per sequence b::

    tokens[b, :seq_len[b]]                  prompt + generated tokens (slot = position)
    cache.k[l][b, :seq_len[b] - 1]          K of tokens[b, :seq_len[b] - 1] in layer l (V likewise); the last
                                            token is the root of the next step's tree, its K/V not in the cache yet
    tokens[b, prompt_len[b] : seq_len[b]]   the num_generated[b] new tokens
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

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

    @property
    def cache_len(self) -> jax.Array:
        """i32[B] tokens whose K/V are in the cache."""
        return self.seq_len - 1
