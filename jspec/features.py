"""The decode loop's optional features as one typed structure on each side of a step: what the state carries for
them (:class:`FeatureState`, ``DecodeState.features``) and what each call gives them (:class:`FeatureInputs`,
``StepInputs.features``).

- log-probabilities: ``FeatureState.logprobs`` (``GenerateSetup.logprobs``);
- logits processors: ``FeatureState.output_counts`` (``GenerateSetup.logits_processors``) and
  ``FeatureInputs.processors``;
- structured outputs: ``FeatureInputs.token_bitmask``;
- hidden-state capture: ``FeatureState.hidden_states`` (``GenerateSetup.capture_layers``).

A part is None when its feature is off. None is an empty pytree, so an absent part has no buffer and none of its
code is traced: a setup without features compiles the program it compiled before they existed. The prefill, the
step and the commit read the features only through the functions here, the one place that asks whether a feature
is on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jspec.logits_processors import ProcessorArrays, add_committed, context_output_counts, process
from jspec.logprobs import Logprobs, record
from jspec.structured_outputs.bitmask import apply_token_bitmask

if TYPE_CHECKING:
    from jspec.generate_setup import GenerateSetup

# The parts only the API's requests use (log-probabilities, the logits processors and their counts): a server
# steps without them while no running request asks for them (``jspec.serve.paged.step_rows``).
API_STATE_PARTS = ("logprobs", "output_counts")
API_INPUT_PARTS = ("processors",)


class FeatureState(NamedTuple):
    """What the loop carries for the features, per row (slot = position, as ``DecodeState.tokens``)."""

    hidden_states: jax.Array | None = None  # [C, B, S, H] compute dtype: the capture layers' states
    logprobs: Logprobs | None = None        # [B, S(, K)] the generated tokens' log-probabilities (jspec.logprobs)
    output_counts: jax.Array | None = None  # i32[B, V] how often each token was generated (the penalties')

    def without_api(self) -> "FeatureState":
        """These features with the API's parts (:data:`API_STATE_PARTS`) off."""
        return self._replace(**dict.fromkeys(API_STATE_PARTS))

    def with_api_from(self, other: "FeatureState") -> "FeatureState":
        """These features with the API's parts (:data:`API_STATE_PARTS`) taken from ``other``."""
        return self._replace(**{name: getattr(other, name) for name in API_STATE_PARTS})

    def api_parts(self) -> tuple:
        return tuple(getattr(self, name) for name in API_STATE_PARTS)


class FeatureInputs(NamedTuple):
    """What a call gives the features, per row (arrays, so changing them never recompiles)."""

    processors: ProcessorArrays | None = None  # the logits processors' parameters (setup.logits_processors)
    token_bitmask: jax.Array | None = None     # i32[B, N, ceil(V / 32)] a grammar's allowed tokens at each of a
                                               # step's N nodes (bit v % 32 of word v // 32; node 0 the root)

    def without_api(self) -> "FeatureInputs":
        """These inputs with the API's parts (:data:`API_INPUT_PARTS`) off."""
        return self._replace(**dict.fromkeys(API_INPUT_PARTS))

    def api_parts(self) -> tuple:
        return tuple(getattr(self, name) for name in API_INPUT_PARTS)


def shaped_logits(logits: jax.Array, features: FeatureInputs, history: Callable[[], tuple], stop_ids: jax.Array
                  ) -> jax.Array:
    """The logits a token is drawn from: the target's f32[B, N, V] at N positions per row, through the logits
    processors (with ``processors``) and then the grammar's mask (with ``token_bitmask``); as they are without
    either. history() -> (counts, generated), called only with processors: counts i32[B, N or 1, V] each position's
    output token counts, or a function returning them (``jspec.logits_processors.process``); generated i32[B, N]
    the output tokens before each position. stop_ids: i32[B, K] (-1 padded)."""
    if features.processors is not None:
        counts, generated = history()
        logits = process(logits, features.processors, counts, generated, stop_ids)
    return apply_token_bitmask(logits, features.token_bitmask)


def prompt_counts(features: FeatureInputs, context: jax.Array, context_lens: jax.Array,
                  vocab_size: int) -> jax.Array | None:
    """i32[B, V] the output token counts of a prefilled context i32[B, W] (its tokens from the processors'
    ``output_start`` to context_lens[b]: output generated before a preemption), or None without processors."""
    if features.processors is None:
        return None
    return context_output_counts(context, features.processors.output_start, context_lens, vocab_size)


def prefill_features(setup: GenerateSetup, batch: int, counts: jax.Array | None,
                     cached: FeatureState | None) -> FeatureState:
    """The features' buffers a prefill of ``batch`` rows starts from: zeros for fresh prompts, the log-probabilities
    the rows recorded before for a prefill from a cached prefix (``cached``, their state's; it captures no hidden
    states), and counts (:func:`prompt_counts`)."""
    logprobs = hidden = None
    if setup.logprobs is not None:
        logprobs = Logprobs.zeros(batch, setup.max_seq_len, setup.logprobs) if cached is None else cached.logprobs
    if setup.capture_layers:
        hidden = jnp.zeros((len(setup.capture_layers), batch, setup.max_seq_len, setup.target.hidden_size),
                           setup.jnp_dtype)
    return FeatureState(hidden_states=hidden, logprobs=logprobs, output_counts=counts)


def with_committed(features: FeatureState, new_tokens: jax.Array, committed: jax.Array) -> FeatureState:
    """The output counts (where kept) plus the first committed[b] of new_tokens i32[B, N] of each row."""
    if features.output_counts is None:
        return features
    return features._replace(output_counts=add_committed(features.output_counts, new_tokens, committed))


def with_logprobs(features: FeatureState, logits: Callable[[], jax.Array], tokens: jax.Array, start: jax.Array,
                  committed: jax.Array) -> FeatureState:
    """The log-probabilities (where recorded) of tokens i32[B, N] at positions start[b] .., the first
    committed[b] of each row, under ``logits()`` f32[B, N, V] (called only when recording: ``jspec.logprobs``)."""
    if features.logprobs is None:
        return features
    return features._replace(logprobs=record(features.logprobs, logits(), tokens, start, committed))


def with_captured(features: FeatureState, states: Callable[[], jax.Array], start: jax.Array,
                  count: jax.Array) -> FeatureState:
    """The captured hidden states (where captured) with ``states()`` [C, B, N, H] written at positions start[b] ..,
    the first count[b] of each row (0: the row is left as it is)."""
    if features.hidden_states is None:
        return features
    return features._replace(hidden_states=write_hidden_states(features.hidden_states, states(), start, count))


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
