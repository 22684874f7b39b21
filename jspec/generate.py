"""``jspec.generate``: prefill, then one ``lax.while_loop`` of the step; one XLA program per call.

The step is the fused speculative step when ``setup.drafter`` is set, plain decoding otherwise.

Hidden-state capture (``setup.capture_layers``, TensorRT-LLM's SAVE_HIDDEN_STATES): the target taps the capture
layers besides the drafter's; the prefill writes the prompt's states, every step those of the tokens it commits
that the target ran on, and after the loop one more target pass on each sequence's last token fills its states,
still inside the program (``GenerateResult.hidden_states``).

Prompts arrive right-padded: prompt_ids i32[B, P] with the real tokens of sequence b in [0, prompt_lens[b]).
Causal prefill never lets a real token see padding, and the padded slots' K/V are overwritten as the sequence
grows, so no left-shift or per-sequence position offset is needed.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jspec.commit import commit_tokens
from jspec.compile_options import setup_jit
from jspec.drafters.base import PrefillContext
from jspec.generate_setup import GenerateSetup
from jspec.features import FeatureInputs, prefill_features, prompt_counts, shaped_logits, with_captured, \
    with_logprobs, write_hidden_states
from jspec.logits_processors import ProcessorArrays
from jspec.logprobs import Logprobs, recorded_logits
from jspec.sampling import SamplingArrays, keys_at, row_keys, sample_tokens
from jspec.sharding import KV_CACHE, KV_POOL, TAPS, constrain, constrain_kv, constrain_rows, traced_on
from jspec.state import DecodeState
from jspec.step import StepInputs, last_tokens, plain_step, root_step, spec_step
from models.attention import KVCache, pad_slots
from models.llama import unstack_layers
from models.paged_kv import PagedKV


class GenerateResult(NamedTuple):
    tokens: jax.Array         # i32[B, S] prompt + generated; new tokens at [prompt_len, prompt_len + num_generated)
    num_generated: jax.Array  # i32[B]
    num_steps: jax.Array      # i32[B] verify steps each sequence took (prefill excluded)
    accepted_hist: jax.Array  # i32[B, D + 1] steps that committed 1..D+1 tokens
    hidden_states: jax.Array | None = None  # [C, B, S, H] the capture layers' states at positions
                                            # [0, prompt_len + num_generated); None unless capturing
    logprobs: Logprobs | None = None        # [B, S(, K)] the generated tokens' (jspec.logprobs); None unless
                                            # setup.logprobs


class CachedPrefix(NamedTuple):
    """What a prefill continues from (the server's prefix-cache hits and prompt pieces): ``view``, the rows' state as
    gathered from the server's KV store (``jspec.serve.kv_store.gather_view``: the target's K/V still in their pages,
    holding each row's first ``cached_lens[b]`` positions; the token buffer; the drafter's state); cached_lens:
    i32[B]."""

    view: DecodeState
    cached_lens: jax.Array


def prefill(params_t, params_d, prompt_ids: jax.Array, prompt_lens: jax.Array, inputs: StepInputs, *,
            setup: GenerateSetup, cached: CachedPrefix | None = None) -> DecodeState:
    """Runs the target (then the drafter) over the prompts, samples each first token (with each row's key at its
    first new position, ``keys_at(inputs.keys, prompt_lens)``): the loop's first state.

    prompt_ids: i32[B, W] right-padded, each prompt's tokens from its cached length on; prompt_lens: i32[B] whole
    prompts. cached: None for fresh prompts (cached length 0), else what they continue from: the target runs on the
    uncached tokens only, attending the cached K/V where they lie, and the drafter continues from its own state
    (``Drafter.prefill_cached``); positions past a row's pages may take the padding (the view is W slots longer)."""
    batch, width = prompt_ids.shape
    cfg = setup.target
    if cached is None:
        # The prompt attends within itself, so it runs on a cache of its own width, padded to the loop's
        # afterwards: attention over all cache_slots would score every prompt token against slots nothing wrote
        # (on the bundled model's 186-token prompt in a 512-slot cache, about a quarter of the prefill's FLOPs).
        cache = KVCache.for_model(cfg, batch, width, setup.jnp_dtype, per_layer=True)
        cache = constrain_kv(cache, KV_CACHE)  # on a mesh: rows over "data", KV heads over "model"
        positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
        zeros = jnp.zeros((batch,), jnp.int32)
        start, last, context = zeros, prompt_lens - 1, prompt_ids  # context: the tokens the processors count
    else:
        if setup.capture_layers:
            raise ValueError("a prefill from a cached prefix captures no hidden states (capture_layers is set)")
        cache, start = cached.view.cache, cached.cached_lens
        last = prompt_lens - start - 1
        positions = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
        tokens = context = cached.view.tokens.at[jnp.arange(batch)[:, None], positions].set(prompt_ids, mode="drop")
        zeros = jnp.zeros((batch,), jnp.int32)
    out = setup.target_model().apply({"params": params_t}, prompt_ids, positions, cache, start,
                                     logits_index=last[:, None], tap_layers=setup.tap_layers)
    if cached is None:
        out = out._replace(cache=constrain_kv(pad_slots(out.cache, setup.cache_slots), KV_CACHE))
    counts = prompt_counts(inputs.features, context, prompt_lens, cfg.vocab_size)

    def history():
        return counts[:, None], jnp.zeros((batch, 1), jnp.int32)

    first_logits = shaped_logits(out.logits, inputs.features, history, inputs.stop_ids)
    first = sample_tokens(first_logits[:, 0], inputs.sampling, keys_at(inputs.keys, prompt_lens))
    if cached is None:
        tokens = jnp.zeros((batch, setup.max_seq_len), jnp.int32).at[:, :width].set(prompt_ids)
    features = prefill_features(setup, batch, counts, None if cached is None else cached.view.features)
    features = with_captured(features, lambda: setup.captured_taps(out.taps), zeros, prompt_lens)
    state = DecodeState(tokens=tokens, seq_len=prompt_lens, cache=out.cache, num_generated=zeros,
                        done=jnp.zeros((batch,), bool), num_steps=zeros,
                        accepted_hist=jnp.zeros((batch, setup.tokens_per_step), jnp.int32),
                        step=jnp.zeros((), jnp.int32) if cached is None else cached.view.step, features=features)
    state, committed = commit_tokens(state, first[:, None], jnp.ones_like(zeros), inputs.max_new_tokens,
                                     inputs.stop_ids, counts_as_step=False)
    state = state._replace(features=with_logprobs(
        state.features, lambda: recorded_logits(out.logits, first_logits, inputs.sampling, setup.logprobs_mode),
        first[:, None], prompt_lens, committed))
    if setup.drafter is not None:
        taps = constrain(setup.drafter_taps(out.taps), TAPS)
        if cached is None:
            draft = setup.drafter.prefill(params_t, params_d, PrefillContext(prompt_ids, prompt_lens, first, taps))
        else:
            draft = setup.drafter.prefill_cached(params_t, params_d, cached.view.draft,
                                                 PrefillContext(tokens, prompt_lens, first, taps), start)
        state = state._replace(draft=draft)
    return shard_state(state)


def shard_state(state: DecodeState) -> DecodeState:
    """On a mesh: the state's per-sequence arrays split by rows over "data", the target cache also by KV heads over
    "model", captured hidden states by rows (axis 1) (the drafter's state is left to the partitioner). Identity on
    one device."""
    cache, draft, features = state.cache, state.draft, state.features
    state = constrain_rows(state._replace(cache=None, draft=None, features=features._replace(hidden_states=None)))
    hidden = constrain(features.hidden_states, TAPS)
    return state._replace(cache=constrain_cache(cache), draft=draft,
                          features=state.features._replace(hidden_states=hidden))


def constrain_cache(cache: KVCache) -> KVCache:
    """The target cache split as :func:`shard_state` splits it: dense buffers by rows and KV heads, a paged
    cache's pages by KV heads (its page tables left to the partitioner)."""
    def one(buffer):
        if isinstance(buffer, PagedKV):
            return buffer._replace(pages=constrain_kv(buffer.pages, KV_POOL))
        return constrain_kv(buffer, KV_CACHE)

    return jax.tree.map(one, cache, is_leaf=lambda x: isinstance(x, PagedKV))


def _start(params_t, params_d, prompt_ids: jax.Array, prompt_lens: jax.Array, key: jax.Array,
           max_new_tokens: jax.Array, stop_ids: jax.Array, sampling: SamplingArrays,
           processors: ProcessorArrays | None = None, token_bitmask: jax.Array | None = None, *,
           setup: GenerateSetup) -> tuple[Any, DecodeState, StepInputs]:
    """The start :func:`generate` and :func:`generate_start` share -> (params_t per layer, state, inputs).

    Unstacks the target params, derives the per-row keys (``jspec.sampling.row_keys``), bundles the loop's inputs
    and prefills.
    """
    params_t = unstack_layers(params_t, setup.target)
    inputs = StepInputs(max_new_tokens, stop_ids, sampling, row_keys(key, prompt_ids.shape[0]),
                        FeatureInputs(processors, token_bitmask))
    state = prefill(params_t, params_d, prompt_ids, prompt_lens, inputs, setup=setup)
    return params_t, state, inputs


def run_loop(params_t, params_d, state: DecodeState, inputs: StepInputs, *, setup: GenerateSetup,
             max_steps: jax.Array | None = None, speculate: bool = True,
             short_nodes: int | None = None) -> DecodeState:
    """Steps until every sequence is done (or ``max_steps`` more iterations ran, for streaming chunks).

    speculate=False (with a drafter) steps with :func:`jspec.step.root_step`: plain decoding that keeps the
    drafter's state current, so a later speculative chunk can continue from it. short_nodes: the speculative
    steps verify only a chain's first nodes (:func:`jspec.step.spec_step`)."""
    stop_at = None if max_steps is None else state.step + max_steps

    def cond(s: DecodeState) -> jax.Array:
        going = jnp.any(~s.done)
        return going if stop_at is None else going & (s.step < stop_at)

    step = plain_step if setup.drafter is None else spec_step if speculate else root_step
    if step is spec_step and short_nodes is not None:
        step = functools.partial(spec_step, short_nodes=short_nodes)

    def body(s: DecodeState) -> DecodeState:
        return shard_state(step(params_t, params_d, s, inputs=inputs, setup=setup))

    return jax.lax.while_loop(cond, body, state)


@functools.partial(setup_jit, static_argnames=("setup",))
def generate(params_t, params_d, prompt_ids: jax.Array, prompt_lens: jax.Array, key: jax.Array,
             max_new_tokens: jax.Array, stop_ids: jax.Array, sampling: SamplingArrays,
             processors: ProcessorArrays | None = None, *, setup: GenerateSetup) -> GenerateResult:
    """Generates up to max_new_tokens[b] tokens after each prompt; one XLA program. With
    ``setup.capture_layers``, also the target's states at those layers for every token (``hidden_states``).

    params_t: target params; params_d: drafter params (None for plain decoding); prompt_ids: i32[B, P]
    right-padded; prompt_lens: i32[B] (>= 1, prompt_lens + max_new_tokens <= setup.max_seq_len);
    key: one PRNG key (row b draws with ``fold_in(key, b)``) or one per row, key[B] (a row's tokens then depend
    only on its prompt, parameters and key, not on the rows beside it); max_new_tokens: i32[B];
    stop_ids: i32[B, K] (-1 padded; EOS ids belong here);
    sampling: per-sequence temperature/top_k/top_p; processors: the logits processors' per-row parameters (with
    ``setup.logits_processors``, else None). Inputs are trusted: SpecEngine validates them.
    Target params may be stacked (as loaded) or per layer (``models.llama.unstack_layers``); pass them per layer
    to keep the per-call unstacking copy out of the program (SpecEngine does).
    """
    with traced_on(setup.mesh):
        params_t, state, inputs = _start(params_t, params_d, prompt_ids, prompt_lens, key, max_new_tokens,
                                         stop_ids, sampling, processors, setup=setup)
        state = run_loop(params_t, params_d, state, inputs, setup=setup)
        if setup.capture_layers:
            state = capture_last_token(params_t, state, setup=setup)
    return GenerateResult(state.tokens, state.num_generated, state.num_steps, state.accepted_hist,
                          state.features.hidden_states, state.features.logprobs)


def capture_last_token(params_t, state: DecodeState, *, setup: GenerateSetup) -> DecodeState:
    """After the loop: the target on each sequence's last token (position seq_len - 1, which no step has run) fills
    its captured states. Its K/V land at slot cache_len, where the root's already are; nothing else changes."""
    cache_len = state.cache_len
    out = setup.target_model().apply({"params": params_t}, last_tokens(state)[:, None], cache_len[:, None],
                                     state.cache, cache_len, tap_layers=setup.capture_layers)
    hidden = write_hidden_states(state.features.hidden_states, out.taps, cache_len, jnp.ones_like(cache_len))
    return state._replace(features=state.features._replace(hidden_states=constrain(hidden, TAPS)))


@functools.partial(setup_jit, static_argnames=("setup",))
def generate_start(params_t, params_d, prompt_ids: jax.Array, prompt_lens: jax.Array, key: jax.Array,
                   max_new_tokens: jax.Array, stop_ids: jax.Array, sampling: SamplingArrays,
                   processors: ProcessorArrays | None = None, token_bitmask: jax.Array | None = None, *,
                   setup: GenerateSetup) -> tuple[DecodeState, StepInputs]:
    """Streaming, part 1: prefill only -> (state, inputs) to pass to :func:`generate_continue`. token_bitmask:
    the tokens each row's first new token may be (``FeatureInputs.token_bitmask``, node 0 read), or None."""
    with traced_on(setup.mesh):
        _, state, inputs = _start(params_t, params_d, prompt_ids, prompt_lens, key, max_new_tokens, stop_ids,
                                  sampling, processors, token_bitmask, setup=setup)
    return state, inputs


@functools.partial(setup_jit, static_argnames=("setup",), donate_argnames=("state",))
def generate_continue(params_t, params_d, state: DecodeState, inputs: StepInputs, max_steps: jax.Array, *,
                      setup: GenerateSetup) -> DecodeState:
    """Streaming, part 2: at most ``max_steps`` more steps (the state's buffers are donated and reused)."""
    params_t = unstack_layers(params_t, setup.target)
    with traced_on(setup.mesh):
        return run_loop(params_t, params_d, state, inputs, setup=setup, max_steps=max_steps)
