"""Committing a step's new tokens: stop conditions, truncation, the output buffer, statistics.

A step proposes ``new_tokens`` i32[B, N] of which the first ``num_new[b]`` are real (accepted drafts then the
bonus token). Per sequence, the committed count is cut at the first stop token (kept, as HF and vLLM keep EOS in
``token_ids``) and at the ``max_new_tokens`` budget; a sequence already done commits nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.features import with_committed
from jspec.state import DecodeState


def count_to_commit(new_tokens: jax.Array, num_new: jax.Array, state: DecodeState, max_new_tokens: jax.Array,
                    stop_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """-> (n i32[B] tokens to commit, hit_stop bool[B] a stop token is among them).

    new_tokens: i32[B, N]; num_new: i32[B]; max_new_tokens: i32[B]; stop_ids: i32[B, K] padded with -1.
    """
    n_max = new_tokens.shape[1]
    index = jnp.arange(n_max)[None, :]
    is_stop = jnp.any(new_tokens[:, :, None] == stop_ids[:, None, :], axis=-1) & (index < num_new[:, None])
    first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), n_max)
    budget = max_new_tokens - state.num_generated
    n = jnp.minimum(jnp.minimum(num_new, first_stop + 1), budget)
    n = jnp.where(state.done, 0, jnp.maximum(n, 0))
    return n, first_stop < n


def commit_tokens(state: DecodeState, new_tokens: jax.Array, num_new: jax.Array, max_new_tokens: jax.Array,
                  stop_ids: jax.Array, counts_as_step: bool = True) -> tuple[DecodeState, jax.Array]:
    """Writes the committed prefix of new_tokens at tokens[b, seq_len[b]:]; returns (state, n i32[B]).

    The cache is not touched here (the step commits K/V of the same n tokens). ``counts_as_step`` is False for
    the prefill's first token, which no verify step produced.
    """
    n, hit_stop = count_to_commit(new_tokens, num_new, state, max_new_tokens, stop_ids)
    batch, n_max = new_tokens.shape
    slot = state.seq_len[:, None] + jnp.arange(n_max)[None, :]
    slot = jnp.where(jnp.arange(n_max)[None, :] < n[:, None], slot, state.tokens.shape[1])  # out of range: dropped
    tokens = state.tokens.at[jnp.arange(batch)[:, None], slot].set(new_tokens, mode="drop")
    num_generated = state.num_generated + n
    active = ~state.done
    done = state.done | hit_stop | (num_generated >= max_new_tokens)
    num_steps, hist = state.num_steps, state.accepted_hist
    if counts_as_step:
        num_steps = num_steps + active.astype(jnp.int32)
        bucket = jnp.clip(n - 1, 0, hist.shape[1] - 1)
        hist = hist.at[jnp.arange(batch), bucket].add((active & (n > 0)).astype(jnp.int32))
    state = state._replace(tokens=tokens, seq_len=state.seq_len + n, num_generated=num_generated, done=done,
                           num_steps=num_steps, accepted_hist=hist,
                           features=with_committed(state.features, new_tokens, n))
    return state, n
