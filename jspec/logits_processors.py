"""Logits processors that keep speculation lossless: presence, frequency and repetition penalties, logit_bias (and
banned token ids), min_tokens; vLLM's semantics, applied to the target's logits before temperature, top-k and
top-p, wherever the target's distribution is taken (the prefill's first token, a decode step, every node of a
verified tree).

A penalty depends on the tokens before the position it scores. In a draft tree node n's history is the committed
sequence and then the drafts on the path from the root to n (n included), so each node is processed with its own
counts: the committed output's (``FeatureState.output_counts``, kept at every commit) plus its path's, read off the
tree mask (mask[n, m]: m is n or an ancestor of n; the root is committed already). The verifier then compares each
draft with the processed distribution at its parent, which is exactly what plain decoding with the same
processors draws from at that position: greedy output equals plain decoding's, sampled output follows the
processed target distribution.

Per row, with c[v] the count of token v in the output so far (the history at the node)::

    logits[v] -= frequency_penalty * c[v] + presence_penalty * (c[v] > 0)
    logits[v]  = logits[v] / r if logits[v] > 0 else logits[v] * r     where v is in the prompt or c[v] > 0
                                                                        (r = repetition_penalty, as HF's)
    logits    += logit_bias                                             (banned ids: -inf)
    logits[s]  = -inf for every stop id s (EOS included)                while the output has < min_tokens tokens

in this order (the repetition rule on the raw logits, as HF's ``RepetitionPenaltyLogitsProcessor`` and vLLM's
penalties apply it).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class ProcessorArrays(NamedTuple):
    """Per-row processor parameters (arrays, so changing them never recompiles): enabled bool[B] (any processor on
    in the row: a batch with none skips the processing), presence_penalty, frequency_penalty, repetition_penalty
    f32[B] (0, 0, 1: off), logit_bias f32[B, V] (banned ids -inf), min_tokens i32[B], prompt_mask bool[B, V] (the
    prompt's tokens, for the repetition penalty), output_start i32[B] (where the output starts in the prefilled
    context: the prompt's length, or less for a request prefilled again with tokens it had generated, which
    count as output; the server's preemption)."""

    enabled: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repetition_penalty: jax.Array
    logit_bias: jax.Array
    min_tokens: jax.Array
    prompt_mask: jax.Array
    output_start: jax.Array


def host_arrays(params_list, prompts: list[list[int]], rows: int, vocab_size: int,
                generated_before: list[int] | None = None) -> ProcessorArrays:
    """Host arrays for ``rows`` rows from each prompt's ``jspec.SamplingParams`` (padding rows: off).
    generated_before: per prompt, tokens it generated before that follow it in the context prefilled now (default
    none); min_tokens counts them."""
    enabled = np.zeros((rows,), bool)
    presence = np.zeros((rows,), np.float32)
    frequency = np.zeros((rows,), np.float32)
    repetition = np.ones((rows,), np.float32)
    bias = np.zeros((rows, vocab_size), np.float32)
    min_tokens = np.zeros((rows,), np.int32)
    prompt_mask = np.zeros((rows, vocab_size), bool)
    output_start = np.zeros((rows,), np.int32)
    before = generated_before or [0] * len(prompts)
    for b, (params, prompt) in enumerate(zip(params_list, prompts)):
        enabled[b] = params.processes_logits
        presence[b], frequency[b] = params.presence_penalty, params.frequency_penalty
        repetition[b], min_tokens[b] = params.repetition_penalty, max(0, params.min_tokens - before[b])
        output_start[b] = len(prompt)
        for token, value in params.logit_bias:
            bias[b, token] += value
        bias[b, list(params.banned_token_ids)] = -np.inf
        prompt_mask[b, prompt] = True
    return ProcessorArrays(enabled, presence, frequency, repetition, bias, min_tokens, prompt_mask, output_start)


def context_output_counts(tokens: jax.Array, output_start: jax.Array, context_lens: jax.Array,
                          vocab_size: int) -> jax.Array:
    """tokens i32[B, W] (a prefilled context per row) -> i32[B, V]: the counts of its tokens at positions
    output_start[b] .. context_lens[b] - 1 (output generated before a preemption; none for a fresh prompt)."""
    index = jnp.arange(tokens.shape[1])[None, :]
    real = ((index >= output_start[:, None]) & (index < context_lens[:, None])).astype(jnp.int32)
    return jnp.zeros((tokens.shape[0], vocab_size), jnp.int32).at[jnp.arange(tokens.shape[0])[:, None],
                                                                  tokens].add(real)


def path_counts(tokens: jax.Array, mask: jax.Array, vocab_size: int) -> jax.Array:
    """tokens i32[B, T], mask bool[B, T, T] (a draft tree's) -> i32[B, T, V]: at node n, how often each token
    appears among the drafts on the path root -> n (n included, the root not: it is committed)."""
    batch, nodes = tokens.shape
    on_path = mask.at[:, :, 0].set(False).astype(jnp.int32)  # [B, n, m]
    rows = jnp.arange(batch)[:, None, None]
    node = jnp.arange(nodes)[None, :, None]
    ids = jnp.broadcast_to(tokens[:, None, :], (batch, nodes, nodes))
    return jnp.zeros((batch, nodes, vocab_size), jnp.int32).at[rows, node, ids].add(on_path)


def process(logits: jax.Array, procs: ProcessorArrays, counts, generated: jax.Array,
            stop_ids: jax.Array) -> jax.Array:
    """logits f32[B, N, V] of N positions per row -> processed logits (float32). counts: i32[B, N, V] (or
    [B, 1, V]) each position's output token counts, or a function returning them (computed only where some row
    has a processor on: the whole processing is skipped, by ``lax.cond``, in a batch with none); generated
    i32[B, N]: the output tokens before each position's prediction; stop_ids i32[B, K] (-1 padded)."""
    logits = logits.astype(jnp.float32)
    return jax.lax.cond(jnp.any(procs.enabled),
                        lambda: _process(logits, procs, counts() if callable(counts) else counts, generated,
                                         stop_ids),
                        lambda: logits)


def _process(logits, procs: ProcessorArrays, counts, generated, stop_ids):
    def rows(x):
        return x[:, None, None]

    seen = counts > 0
    repeated = seen | procs.prompt_mask[:, None, :]
    penalty = rows(procs.repetition_penalty)
    logits = jnp.where(repeated, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)
    logits = logits - rows(procs.frequency_penalty) * counts - rows(procs.presence_penalty) * seen
    logits = logits + procs.logit_bias[:, None, :]
    vocab = logits.shape[-1]
    is_stop = jnp.zeros((logits.shape[0], vocab), bool).at[jnp.arange(logits.shape[0])[:, None],
                                                           jnp.where(stop_ids >= 0, stop_ids, vocab)].set(
        True, mode="drop")
    early = generated < procs.min_tokens[:, None]  # [B, N]
    return jnp.where(early[:, :, None] & is_stop[:, None, :], -jnp.inf, logits)


def add_committed(counts: jax.Array, new_tokens: jax.Array, num_committed: jax.Array) -> jax.Array:
    """counts i32[B, V] plus the first num_committed[b] of new_tokens i32[B, N] of each row."""
    batch, width = new_tokens.shape
    real = (jnp.arange(width)[None, :] < num_committed[:, None]).astype(jnp.int32)
    return counts.at[jnp.arange(batch)[:, None], new_tokens].add(real)
