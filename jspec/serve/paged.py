"""Programs that prefill and step any set of the server's rows over its KV store (``jspec.serve.kv_store``: the
decode state of every request in pools of pages and a row store, laid out as the state's owners declare).

A program over R rows at context ``seq_len`` builds the state those rows have in an engine of
``max_seq_len = seq_len`` and runs the unchanged prefill or step loop on it (``jspec.generate``). The target's K/V,
by far the largest leaves, stay in their pools: each layer's is a ``models.paged_kv.PagedKV`` over the rows' page
table, which the model writes through and ``models.paged_kv.paged_attention`` reads (the committed prefix under a
length mask, the new tokens under their tree or causal mask, merged by log-sum-exp), so a step reads a row's
prefix where it lies and the accepted path's K/V goes straight into its pages. The other per-position leaves (the
token buffer, a drafter's cache) are gathered into a dense view of the rows' pages and the pages a program may have
touched written back; per-row leaves likewise. A page shared by several rows (a cached prefix) holds committed
tokens no step changes: a row writes only from its committed length on, in pages of its own. The pools are the
persistent memory (sized by ``--max-total-tokens``). A fresh prompt's prefill computes its K/V densely and writes
its pages.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jspec.compile_options import setup_jit
from jspec.generate import CachedPrefix, prefill, run_loop, shard_state
from jspec.generate_setup import GenerateSetup
from jspec.drafters.base import DraftTree
from jspec.features import FeatureInputs
from jspec.logprobs import Logprobs
from jspec.sampling import SamplingArrays
from jspec.serve.kv_store import (PagedLayout, Store, api_feature_leaves, gather_view, non_kv_leaves,
                                  scatter_view)
from jspec.serve.programs import start_state
from jspec.sharding import traced_on
from jspec.state import DecodeState
from jspec.step import RootForward, StepInputs, propose, root_commit, root_forward, verify_proposal


def without_api_features(setup: GenerateSetup) -> GenerateSetup:
    """``setup`` recording no log-probabilities and with no logits processors."""
    return dataclasses.replace(setup, logprobs=None, logits_processors=False)


class Readout(NamedTuple):
    """What the host reads after a program, for its R rows: tokens i32[R, seq_len] (prompt + generated, slot =
    position), num_generated, num_steps i32[R], done bool[R], accepted_hist i32[R, D + 1], step i32[] (the loop's
    counter), logprobs: where the setup records them (``jspec.logprobs``; else None), those of the W positions from
    each row's length before the program on ([R, W(, K)]; a prefill's W = 1, its first token's): only the tokens
    the program may have committed travel to the host."""

    tokens: jax.Array
    num_generated: jax.Array
    num_steps: jax.Array
    done: jax.Array
    accepted_hist: jax.Array
    step: jax.Array
    logprobs: Logprobs | None = None


def _readout(state: DecodeState, since: jax.Array, width: int) -> Readout:
    """state's readout; since: i32[R] each row's length before the program, width: W (:class:`Readout`)."""
    logprobs = None
    if state.features.logprobs is not None:
        slots = jnp.minimum(since[:, None] + jnp.arange(width)[None], state.tokens.shape[1] - 1)
        logprobs = Logprobs(*(jnp.take_along_axis(x, slots.reshape(slots.shape + (1,) * (x.ndim - 2)), axis=1)
                              for x in state.features.logprobs))
    return Readout(state.tokens, state.num_generated, state.num_steps, state.done, state.accepted_hist, state.step,
                   logprobs)


@functools.partial(setup_jit, static_argnames=("layout", "setup", "seq_len"), donate_argnames=("store",))
def prefill_rows(params_t, params_d, store: Store, prompt_ids: jax.Array, prompt_lens: jax.Array,
                 key_data: jax.Array, max_new_tokens: jax.Array, stop_ids: jax.Array, sampling: SamplingArrays,
                 processors, row_ids: jax.Array, page_table: jax.Array, token_bitmask: jax.Array | None = None, *,
                 layout: PagedLayout, setup: GenerateSetup, seq_len: int) -> tuple[Store, Readout]:
    """Prefills N requests at once into rows ``row_ids`` and their pages (the store is donated) -> (store, readout).

    prompt_ids: i32[N, W] right-padded (W <= seq_len - 1); prompt_lens, max_new_tokens: i32[N]; key_data: u32[N, ...]
    each request's own key; stop_ids: i32[N, K] -1 padded; sampling: [N] each; processors: the logits processors'
    arrays (``setup.logits_processors``) or None; row_ids: i32[N] (padding: the null row); page_table: i32[N, G,
    pages_per_row] (``kv_store``'s page-table groups; padding: 0); token_bitmask: i32[N, 1, W] the rows' grammar
    masks for their first token
    (structured outputs) or None. Each row's first token is committed, as in ``generate``.
    """
    with traced_on(setup.mesh):
        key = jax.random.wrap_key_data(key_data)
        state, inputs = start_state(params_t, params_d, prompt_ids, prompt_lens, key, max_new_tokens, stop_ids,
                                    sampling, processors, token_bitmask, setup=setup.with_max_seq_len(seq_len))
        inputs = inputs.with_token_bitmask(None)  # a step's masks are its own, never stored
        state = state._replace(step=store[0].step)
        since = jnp.zeros_like(prompt_lens)
        return (scatter_view(layout, store, (state, inputs), row_ids, page_table, seq_len, since=since,
                             write_pages=prefill_pages(layout, prompt_ids.shape[1])), _readout(state, prompt_lens, 1))


def prefill_pages(layout: PagedLayout, width: int) -> int:
    """Pages a prefill of ``width`` tokens writes per row, from the page of its first uncached token: the prompt,
    its first new token and the widest slot leaf's extra slots past them."""
    return math.ceil((width + 1 + layout.extra_slots) / layout.page_size) + 1


def continues_from_cache(setup: GenerateSetup) -> bool:
    """Whether :func:`prefill_cached_rows` serves this setup: plain decoding, or a drafter that continues from a
    cached prefix (``DrafterBase.caches_prefix``: n-gram lookup and a draft model rerun over the whole prompt
    from the token buffer; EAGLE-3 and the hybrid run their head over the uncached positions only). MTP, whose
    state at a position needs the target's states of the cached prefix (no page keeps them), does not."""
    drafter = setup.drafter
    return drafter is None or drafter.caches_prefix


def recomputes_last_hit(setup: GenerateSetup) -> bool:
    """Whether a prefix hit's last page is computed again (``BlockManager.allocate(drop_last_hit=True)``): for a
    drafter reading target states, whose slot p pairs the token at p + 1."""
    return setup.drafter is not None and bool(setup.drafter.tap_layers)


@functools.partial(setup_jit, static_argnames=("layout", "setup", "seq_len"), donate_argnames=("store",))
def prefill_cached_rows(params_t, params_d, store: Store, suffix_ids: jax.Array, prompt_lens: jax.Array,
                        cached_lens: jax.Array, key_data: jax.Array, max_new_tokens: jax.Array, stop_ids: jax.Array,
                        sampling: SamplingArrays, processors, row_ids: jax.Array, page_table: jax.Array,
                        token_bitmask: jax.Array | None = None, *, layout: PagedLayout, setup: GenerateSetup,
                        seq_len: int) -> tuple[Store, Readout]:
    """Prefills N requests whose first ``cached_lens[b]`` prompt tokens (whole pages) are in their pages already
    (a prefix-cache hit), by the offline engine's prefill from a cached prefix (``jspec.generate.prefill``): the
    target runs on the rest of each prompt only, attending the cached K/V in their pages
    (``models.paged_kv.paged_attention``); the drafter (:func:`continues_from_cache`) continues from its state.
    The cached pages are read, never written (the write-back starts at the page of position cached_lens[b], a
    whole page), so rows sharing them keep them bit for bit. It also prefills a prompt's pieces (chunked
    prefill): cached_lens[b] the tokens its earlier pieces put in its pages, prompt_lens[b] where this piece ends.
    -> (store, readout).

    suffix_ids: i32[N, W] each prompt's tokens from cached_lens[b] on, right-padded (prompt_lens[b] <= seq_len - 1;
    the padding may run past seq_len: the program's view is W slots longer, and positions past a row's pages are
    the null page's); prompt_lens: i32[N] whole prompts; the other arguments as :func:`prefill_rows`.
    """
    if not continues_from_cache(setup):
        raise ValueError(f"prefill_cached_rows: the drafter reads target layers {setup.drafter.tap_layers} and "
                         f"does not continue from a cached prefix")
    width = suffix_ids.shape[1]
    seq_len += width
    missing = max(0, layout.pages_in_view(seq_len) - page_table.shape[2])
    page_table = jnp.pad(page_table, ((0, 0), (0, 0), (0, missing)))
    with traced_on(setup.mesh):
        view, _ = gather_view(layout, store, row_ids, page_table, seq_len, paged_kv=True)
        inputs = StepInputs(max_new_tokens, stop_ids, sampling, jax.random.wrap_key_data(key_data),
                            FeatureInputs(processors, token_bitmask))
        state = prefill(params_t, params_d, suffix_ids, prompt_lens, inputs, setup=setup.with_view_len(seq_len),
                        cached=CachedPrefix(view, cached_lens))
        inputs = inputs.with_token_bitmask(None)  # a step's masks are its own, never stored
        return (scatter_view(layout, store, (state, inputs), row_ids, page_table, seq_len, since=cached_lens,
                             write_pages=prefill_pages(layout, width)), _readout(state, prompt_lens, 1))


def rewritten_margin(setup: GenerateSetup) -> int:
    """Positions before a row's committed length a chunk may still rewrite: a drafter may redo the slots of its last
    step's tokens (EAGLE-3 writes their K/V once the target's states for them are known); two steps' worth."""
    return 2 * setup.tokens_per_step


def write_pages(layout: PagedLayout, setup: GenerateSetup, steps: int) -> int:
    """Pages a chunk of at most ``steps`` steps writes back per row (``step_rows``'s ``write_pages``): from
    :func:`rewritten_margin` before the committed length to every slot its steps and their windows may reach."""
    reach = rewritten_margin(setup) + 1 + steps * setup.tokens_per_step + layout.extra_slots
    return math.ceil(reach / layout.page_size) + 1


def _feature_form(layout: PagedLayout, setup: GenerateSetup, state: DecodeState, inputs, api_features: bool):
    """The gathered (state, inputs) in the form a program runs them: as they are, or (``api_features`` False)
    without the API features' leaves -> (the leaves not to write back, the setup to run, the state as gathered,
    the state to run, the inputs to run); the caller puts ``with_api_from`` the gathered state's features back
    before the write-back."""
    if api_features:
        return frozenset(), setup, state, state, inputs
    return (api_feature_leaves(layout), without_api_features(setup), state,
            state._replace(features=state.features.without_api()),
            inputs._replace(features=inputs.features.without_api()))


@functools.partial(setup_jit, static_argnames=("layout", "setup", "seq_len", "speculate", "write_pages",
                                               "short_nodes", "chunk_steps", "api_features"),
                   donate_argnames=("store",))
def step_rows(params_t, params_d, store: Store, row_ids: jax.Array, page_table: jax.Array, cancel: jax.Array,
              max_steps: jax.Array, token_bitmask: jax.Array | None = None, *, layout: PagedLayout,
              setup: GenerateSetup, seq_len: int,
              speculate: bool = True, write_pages: int | None = None, short_nodes: int | None = None,
              chunk_steps: int = 1, api_features: bool = True) -> tuple[Store, Readout]:
    """Finishes the rows where ``cancel`` (bool[R]) is set, then runs at most ``max_steps`` (i32[]) steps over rows
    ``row_ids`` (i32[R], padding: the null row) at context ``seq_len`` (>= prompt + max_tokens of every row) ->
    (store, readout). speculate=False: plain steps that keep the drafter current (``jspec.step.root_step``; a
    plain server ignores it). page_table: i32[R, G, pages_per_row]; a row's pages must cover every position the
    steps may write (its committed tokens, max_steps steps' worth of new ones and the tree window): the
    scheduler allocates them before the call. write_pages: None writes every page of the rows
    back; else (``write_pages(layout, setup, steps)`` for chunks of at most ``steps`` steps) only the pages the
    steps may have touched. short_nodes (a chain's, ``jspec.step.short_draft_nodes``): the speculative steps verify
    only the chain's first short_nodes nodes (``jspec.step.spec_step``). chunk_steps: the most steps ``max_steps``
    asks for; the readout's log-probabilities cover the chunk_steps * tokens_per_step positions those may commit.
    token_bitmask: i32[R, 1, W] the rows' grammar masks (structured outputs on a plain server; one step) or None.
    api_features=False (rows none of whose requests asks for log-probabilities or logits processors): the steps
    of ``without_api_features(setup)``, which neither read nor write those leaves (:func:`api_feature_leaves`:
    stored as they were; the readout has no log-probabilities), so a server that offers the features steps as
    fast as one without them while no running request uses them."""
    with traced_on(setup.mesh):
        state, inputs = gather_view(layout, store, row_ids, page_table, seq_len, paged_kv=True)
        entry_len = state.seq_len
        since = None if write_pages is None else jnp.maximum(state.seq_len - 1 - rewritten_margin(setup), 0)
        state = shard_state(state._replace(done=state.done | cancel))
        unchanged, loop_setup, gathered, state, loop_inputs = _feature_form(layout, setup, state, inputs, api_features)
        state = run_loop(params_t, params_d, state, loop_inputs.with_token_bitmask(token_bitmask),
                         setup=loop_setup.with_max_seq_len(seq_len), max_steps=max_steps, speculate=speculate,
                         short_nodes=short_nodes)
        readout = _readout(state, entry_len, chunk_steps * setup.tokens_per_step)
        if not api_features:  # the tree as stored; these leaves are not written back
            state = state._replace(features=state.features.with_api_from(gathered.features))
        return (scatter_view(layout, store, (state, inputs), row_ids, page_table, seq_len, since=since,
                             write_pages=write_pages, unchanged=unchanged), readout)


@functools.partial(setup_jit, static_argnames=("layout", "setup", "seq_len"))
def propose_rows(params_t, params_d, store: Store, row_ids: jax.Array, page_table: jax.Array, *,
                 layout: PagedLayout, setup: GenerateSetup, seq_len: int):
    """A structured step's first half over rows ``row_ids`` (as :func:`step_rows`): the drafter's proposal ->
    (the drafter's new state in the rows' dense view, the DraftTree). The store is only read; the host masks the
    tree's nodes and :func:`verify_rows` goes on from here."""
    with traced_on(setup.mesh):
        state, inputs = gather_view(layout, store, row_ids, page_table, seq_len, paged_kv=True)
        return propose(params_t, params_d, state, inputs, setup=setup.with_max_seq_len(seq_len))


@functools.partial(setup_jit, static_argnames=("layout", "setup", "seq_len", "write_pages", "short_nodes",
                                               "api_features"),
                   donate_argnames=("store",))
def verify_rows(params_t, params_d, store: Store, row_ids: jax.Array, page_table: jax.Array, cancel: jax.Array,
                draft_state, tree: DraftTree, token_bitmask: jax.Array, *, layout: PagedLayout,
                setup: GenerateSetup, seq_len: int, write_pages: int, short_nodes: int | None = None,
                api_features: bool = True) -> tuple[Store, Readout]:
    """A structured step's second half: finishes the rows where ``cancel`` is set, verifies :func:`propose_rows`'s
    ``tree`` (``draft_state`` the drafter's state it left) under ``token_bitmask`` (i32[R, T, W], one mask per
    node), accepts and commits -> (store, readout), as one step of :func:`step_rows` (short_nodes, api_features:
    as there)."""
    def verify(state, inputs, step_setup):
        return verify_proposal(params_t, params_d, state, draft_state, tree, inputs, setup=step_setup,
                               short_nodes=short_nodes)

    return _second_half(verify, store, row_ids, page_table, cancel, token_bitmask, layout=layout, setup=setup,
                        seq_len=seq_len, write_pages=write_pages, api_features=api_features)


@functools.partial(setup_jit, static_argnames=("layout", "setup", "seq_len"), donate_argnames=("store",))
def forward_rows(params_t, params_d, store: Store, row_ids: jax.Array, page_table: jax.Array, *,
                 layout: PagedLayout, setup: GenerateSetup, seq_len: int) -> tuple[Store, RootForward]:
    """A masked plain step's first half over rows ``row_ids`` (as :func:`step_rows`): the target on each row's last
    token, its K/V written into the row's pages -> (store, ``jspec.step.RootForward``: the raw logits f32[R, 1, V]
    and tap states). Nothing is drawn: the server computes the rows' grammar masks while this runs, then
    :func:`sample_rows` draws under them. Only the K/V pools change."""
    del params_d  # the signature of the other row programs
    with traced_on(setup.mesh):
        state, inputs = gather_view(layout, store, row_ids, page_table, seq_len, paged_kv=True)
        state, forward = root_forward(params_t, shard_state(state), setup=setup.with_max_seq_len(seq_len))
        return scatter_view(layout, store, (state, inputs), row_ids, page_table, seq_len,
                            unchanged=non_kv_leaves(layout)), forward


@functools.partial(setup_jit, static_argnames=("layout", "setup", "seq_len", "write_pages", "api_features"),
                   donate_argnames=("store",))
def sample_rows(params_t, params_d, store: Store, row_ids: jax.Array, page_table: jax.Array, cancel: jax.Array,
                forward: RootForward, token_bitmask: jax.Array, *, layout: PagedLayout, setup: GenerateSetup,
                seq_len: int, write_pages: int, api_features: bool = True) -> tuple[Store, Readout]:
    """A masked plain step's second half after :func:`forward_rows` over the same rows: finishes the rows where
    ``cancel`` is set, draws each row's next token from ``forward``'s logits under ``token_bitmask`` (i32[R, 1,
    W]), commits it and the drafter's commit of it -> (store, readout): one plain step of :func:`step_rows`
    (api_features: as there)."""
    def commit(state, inputs, step_setup):
        return root_commit(params_t, params_d, state, forward, inputs, setup=step_setup)

    return _second_half(commit, store, row_ids, page_table, cancel, token_bitmask, layout=layout, setup=setup,
                        seq_len=seq_len, write_pages=write_pages, api_features=api_features)


def _second_half(step, store: Store, row_ids: jax.Array, page_table: jax.Array, cancel: jax.Array,
                 token_bitmask: jax.Array, *, layout: PagedLayout, setup: GenerateSetup, seq_len: int,
                 write_pages: int, api_features: bool) -> tuple[Store, Readout]:
    """A masked step's commit over the rows' view (traced): ``step(state, inputs, setup)`` -> the state after one
    step, run on the gathered rows (``cancel``'s finished) with ``token_bitmask`` and the setup's form
    (:func:`_feature_form`) -> (store, readout of one step's tokens)."""
    with traced_on(setup.mesh):
        state, inputs = gather_view(layout, store, row_ids, page_table, seq_len, paged_kv=True)
        entry_len = state.seq_len
        since = jnp.maximum(state.seq_len - 1 - rewritten_margin(setup), 0)
        state = shard_state(state._replace(done=state.done | cancel))
        unchanged, step_setup, gathered, state, step_inputs = _feature_form(layout, setup, state, inputs, api_features)
        state = step(state, step_inputs.with_token_bitmask(token_bitmask), step_setup.with_max_seq_len(seq_len))
        readout = _readout(state, entry_len, setup.tokens_per_step)
        if not api_features:  # the tree as stored; these leaves are not written back
            state = state._replace(features=state.features.with_api_from(gathered.features))
        return (scatter_view(layout, store, (shard_state(state), inputs), row_ids, page_table, seq_len, since=since,
                             write_pages=write_pages, unchanged=unchanged), readout)
