"""Log-probabilities of the generated tokens (OpenAI's ``logprobs`` / ``top_logprobs``), kept per position like the
tokens themselves.

The values are vLLM's default ("raw_logprobs"): the log-softmax of the target's logits at the position before, in
float32, before temperature, top-k or top-p; or, with vLLM's "processed_logprobs" (:data:`LOGPROBS_MODES`), those of
the distribution the token was drawn from: after the logits processors and a grammar's mask, then, for a sampled
row, temperature, top-k and top-p (a greedy row's are not scaled; :func:`recorded_logits`). Each committed token's
comes from the target pass that committed it: the prefill for the first, the decode step in plain decoding, and
under speculation the verify pass, where the step's new token i (the accepted drafts, then the bonus) is drawn from
the logits of accepted path node i (node ``accept_index[i]``; i = 0: the root). So a speculative run's
log-probabilities are those of the same target on the same prefix, as plain decoding's are (equal up to the float
rounding of a wider pass).

Buffers, slot = position as in ``DecodeState.tokens`` (prompt slots stay 0)::

    token    f32[B, S]     log p(tokens[b, s] | tokens[b, :s])
    top_ids  i32[B, S, K]  the K most likely tokens at position s, most likely first (ties: lower id first)
    top      f32[B, S, K]  their log-probabilities
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # vLLM's --logprobs-mode values jspec has
SHARED_TOP = 20  # vLLM's default --max-logprobs: every request for up to this many top tokens runs one program


def recorded_top(num_top: int, vocab_size: int) -> int:
    """How many top tokens a program records for a call asking for ``num_top``: at least :data:`SHARED_TOP` (within
    the vocabulary), so calls asking for 0 to 20 share one compiled program and the host keeps the first
    ``num_top`` (``jax.lax.top_k`` orders them, most likely first: the first K of more are the top K)."""
    return max(num_top, min(SHARED_TOP, vocab_size))


def recorded_logits(raw: jax.Array, processed: jax.Array, sampling, mode: str) -> jax.Array:
    """The logits whose log-softmax is recorded: ``raw`` f32[B, N, V] (the target's) under "raw_logprobs"; under
    "processed_logprobs" ``processed`` (after the logits processors and a grammar's mask) with each sampled row's
    temperature, top-k and top-p applied (``jspec.sampling.filtered_logits``; greedy rows as processed)."""
    if mode == "raw_logprobs":
        return raw
    from jspec.sampling import filtered_logits

    greedy = (sampling.temperature <= 0.0).reshape((-1,) + (1,) * (processed.ndim - 1))
    return jnp.where(greedy, processed, filtered_logits(processed, sampling))


def check_logprobs_mode(mode: str) -> str:
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode={mode!r}: expected one of {LOGPROBS_MODES}")
    return mode


class Logprobs(NamedTuple):
    """Per-position log-probabilities (module docstring); device arrays inside ``generate``, numpy after."""

    token: jax.Array
    top_ids: jax.Array
    top: jax.Array

    @classmethod
    def zeros(cls, batch: int, slots: int, num_top: int) -> "Logprobs":
        return cls(jnp.zeros((batch, slots), jnp.float32), jnp.zeros((batch, slots, num_top), jnp.int32),
                   jnp.zeros((batch, slots, num_top), jnp.float32))


class SequenceLogprobs(NamedTuple):
    """One sequence's generated tokens' log-probabilities (host numpy): token f32[n], top_ids i32[n, K],
    top f32[n, K] (n = the tokens generated, K = the ``logprobs`` asked for)."""

    token: np.ndarray
    top_ids: np.ndarray
    top: np.ndarray


def of_tokens(logits: jax.Array, tokens: jax.Array, num_top: int) -> Logprobs:
    """logits f32[B, N, V] (row n predicts tokens[:, n]), tokens i32[B, N] -> Logprobs of shape [B, N(, K)]."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token = jnp.take_along_axis(log_probs, tokens[..., None], axis=-1)[..., 0]
    if num_top == 0:
        empty = tokens.shape + (0,)
        return Logprobs(token, jnp.zeros(empty, jnp.int32), jnp.zeros(empty, jnp.float32))
    top, top_ids = jax.lax.top_k(log_probs, num_top)
    return Logprobs(token, top_ids.astype(jnp.int32), top)


def write(buffers: Logprobs, values: Logprobs, start: jax.Array, count: jax.Array) -> Logprobs:
    """Writes values [B, N(, K)] at positions start[b] .. start[b] + count[b] - 1 of buffers [B, S(, K)]; the rest
    of each row (n >= count[b]) is dropped."""
    batch, width = values.token.shape
    index = jnp.arange(width)[None, :]
    slot = jnp.where(index < count[:, None], start[:, None] + index, buffers.token.shape[1])  # out of range: dropped
    rows = jnp.arange(batch)[:, None]
    return Logprobs(*(old.at[rows, slot].set(new, mode="drop") for old, new in zip(buffers, values)))


def record(buffers: Logprobs | None, logits: jax.Array, tokens: jax.Array, start: jax.Array,
           count: jax.Array) -> Logprobs | None:
    """The committed tokens' log-probabilities written into ``buffers`` (identity when None: not recording).

    logits f32[B, N, V]: row n the distribution tokens[:, n] was drawn from; start i32[B]: the position of
    tokens[:, 0]; count i32[B]: how many of them were committed."""
    if buffers is None:
        return None
    return write(buffers, of_tokens(logits, tokens, buffers.top_ids.shape[-1]), start, count)


def check_num_logprobs(logprobs: int | None, vocab_size: int, name: str = "logprobs") -> int | None:
    """``logprobs`` when it is None (none recorded) or an integer in [0, vocab_size] (the most likely tokens
    returned per position beside the chosen one); else ValueError naming it as ``name``."""
    if logprobs is None:
        return None
    if not isinstance(logprobs, (int, np.integer)) or isinstance(logprobs, bool) or not 0 <= logprobs <= vocab_size:
        raise ValueError(f"{name}={logprobs!r}: expected None or an integer in [0, {vocab_size}] (the most likely "
                         f"tokens to return per position beside the chosen one)")
    return int(logprobs)
