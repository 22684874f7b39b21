"""One step of the generation loop.

``plain_step`` is autoregressive decoding (drafter=None): the baseline every speedup is measured against, and
the same commit path the speculative step uses.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec.commit import commit_tokens
from jspec.sampling import SamplingArrays, sample_tokens
from jspec.generate_setup import GenerateSetup
from jspec.state import DecodeState


class StepInputs(NamedTuple):
    """Per-call values the loop body reads (arrays, so they never recompile)."""

    max_new_tokens: jax.Array  # i32[B]
    stop_ids: jax.Array        # i32[B, K], -1 padded
    sampling: SamplingArrays
    key: jax.Array             # the loop's base key; step keys are fold_in(key, step)


def last_tokens(state: DecodeState) -> jax.Array:
    """i32[B] the last committed token of each sequence (the root of the next step)."""
    return jnp.take_along_axis(state.tokens, (state.seq_len - 1)[:, None], axis=1)[:, 0]


def plain_step(params_t, state: DecodeState, inputs: StepInputs, *, setup: GenerateSetup) -> DecodeState:
    """Runs the target on each sequence's last token, samples the next one, commits it."""
    cache_len = state.cache_len
    out = setup.target_model().apply({"params": params_t}, last_tokens(state)[:, None], cache_len[:, None],
                                     state.cache, cache_len)
    key = jax.random.fold_in(inputs.key, state.step)
    next_token = sample_tokens(out.logits[:, 0], inputs.sampling, key)
    # A done sequence's cache_len is frozen, so its rewrite of slot cache_len harms nothing.
    state = state._replace(cache=out.cache)
    state, _ = commit_tokens(state, next_token[:, None], jnp.ones_like(cache_len), inputs.max_new_tokens,
                             inputs.stop_ids)
    return state._replace(step=state.step + 1)
