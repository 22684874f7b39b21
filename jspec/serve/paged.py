"""The server's decode state in pages: KV (and every other per-position buffer) in a pool of pages, the rest of
each request's state in a row store; programs that prefill and step any set of rows over it.

Every leaf of the slot engine's (``DecodeState``, ``StepInputs``) is one of three kinds, found at trace time by
comparing the shapes of idle states (``programs.idle_slots``) of one and two rows and of two context lengths:

- **slot leaves** have a row axis and a slot axis (slot = position): the target's K/V per layer, the token buffer,
  a drafter's K/V or token buffer. Stored as a pool ``[num_pages, page_size, *rest]`` (the row axis dropped, the
  slot axis cut into pages): row r's position p lives at ``pool[page_table[r, p // page_size], p % page_size]``.
  Page 0 is the null page every unused page-table entry points to (never -1: gathers would wrap it), so padded
  rows and positions past a row's pages read and write garbage there and nowhere else.
- **row leaves** have a row axis only (lengths, done, budgets, sampling parameters, keys, a drafter's next
  prediction): stored as ``[max_rows + 1, *rest]``; row ``max_rows`` is the null row padded rows point to, idle
  (done) forever.
- **shared leaves** have no row axis (the loop's step counter): stored as they are.

A program over R rows at context ``seq_len`` builds the state those rows have in an engine of
``max_seq_len = seq_len`` and runs the unchanged prefill or step loop on it (``jspec.generate``). The target's K/V,
by far the largest leaves, stay in their pools: each layer's is a ``models.paged_kv.PagedKV`` over the rows' page
table, which the model writes through and ``models.paged_kv.paged_attention`` reads (the committed prefix under a
length mask, the new tokens under their tree or causal mask, merged by log-sum-exp), so a step reads a row's
prefix where it lies and the accepted path's K/V goes straight into its pages. The other slot leaves (the token
buffer, a drafter's cache) are gathered into a dense view of the rows' pages and the pages a program may have
touched written back; row leaves likewise. A page shared by several rows (a cached prefix) holds committed tokens
no step changes: a row writes only from its committed length on, in pages of its own. The pool is the persistent
memory (sized by ``--max-total-tokens``). A fresh prompt's prefill computes its K/V densely and writes its pages.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jspec.compile_options import setup_jit
from jspec.generate import run_loop, shard_state
from jspec.generate_setup import GenerateSetup
from jspec.commit import commit_tokens
from jspec.drafters.base import DraftTree, PrefillContext
from jspec.logits_processors import context_output_counts, process
from jspec.logprobs import Logprobs, record, recorded_logits
from jspec.sampling import SamplingArrays, keys_at, sample_tokens
from jspec.serve.programs import idle_slots, start_state
from jspec.sharding import KV_POOL, TAPS, constrain, traced_on
from jspec.state import DecodeState
from jspec.step import StepInputs, propose, verify_proposal
from jspec.structured_outputs.bitmask import apply_token_bitmask
from models.paged_kv import PagedKV

SLOT, ROW, SHARED = "slot", "row", "shared"


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Where one leaf keeps its rows and positions. kind: SLOT, ROW or SHARED; row_axis, slot_axis: the axes in the
    dense leaf (None where absent); extra_slots: the slot axis holds ``seq_len + extra_slots`` slots (a tree
    window past the context, for instance); kv: a target K/V buffer (its pool is split by KV heads on a mesh)."""

    kind: str
    row_axis: int | None = None
    slot_axis: int | None = None
    extra_slots: int = 0
    kv: bool = False


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """The paged form of a setup's decode state (hashable: a static argument of the programs below).

    treedef: the structure of (DecodeState, StepInputs); leaves: one :class:`LeafLayout` per leaf, in flattening
    order; page_size: tokens per page; num_pages: pages in the pool, the null page included; max_rows: requests
    held at once (``--max-num-seqs``); max_seq_len: the longest context a row may reach."""

    treedef: Any
    leaves: tuple[LeafLayout, ...]
    page_size: int
    num_pages: int
    max_rows: int
    max_seq_len: int

    def pages_in_view(self, seq_len: int) -> int:
        """Page-table entries a view of ``seq_len`` context reads (the widest slot leaf's)."""
        widths = [leaf.extra_slots for leaf in self.leaves if leaf.kind == SLOT]
        return math.ceil((seq_len + max(widths, default=0)) / self.page_size)

    @property
    def pages_per_row(self) -> int:
        """Page-table width: the pages of a row at ``max_seq_len``."""
        return self.pages_in_view(self.max_seq_len)

    @property
    def null_row(self) -> int:
        return self.max_rows

    def slots_per_position(self) -> int:
        """Slot leaves (each a pool indexed like the target's K/V); for the docs' memory figures."""
        return sum(leaf.kind == SLOT for leaf in self.leaves)


def paged_layout(params_t, params_d, *, setup: GenerateSetup, num_stop_ids: int, page_size: int, num_pages: int,
                 max_rows: int) -> PagedLayout:
    """The :class:`PagedLayout` of ``setup``'s slot-engine state (shapes only: nothing runs). Raises ValueError for
    a state leaf whose slot axis does not grow one for one with the context (nothing to page)."""
    def shapes(rows: int, seq_len: int):
        return jax.eval_shape(functools.partial(idle_slots, setup=setup.with_max_seq_len(seq_len), num_slots=rows,
                                                num_stop_ids=num_stop_ids), params_t, params_d)

    short, long = 32, 48
    one, two, longer = shapes(1, short), shapes(2, short), shapes(1, long)
    state_flags = jax.tree.map(lambda _: False, one[0])
    kv_flags = (state_flags._replace(cache=jax.tree.map(lambda _: True, one[0].cache)),
                jax.tree.map(lambda _: False, one[1]))
    leaves = []
    for a, b, c, kv in zip(jax.tree.leaves(one), jax.tree.leaves(two), jax.tree.leaves(longer),
                           jax.tree.leaves(kv_flags)):
        row = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        slot = [i for i, (x, y) in enumerate(zip(a.shape, c.shape)) if x != y]
        if not row:
            leaves.append(LeafLayout(SHARED))
        elif not slot:
            leaves.append(LeafLayout(ROW, row_axis=row[0]))
        else:
            if len(slot) != 1 or c.shape[slot[0]] - a.shape[slot[0]] != long - short:
                raise ValueError(f"a decode-state leaf of shape {a.shape} grows as {c.shape} from context {short} to "
                                 f"{long}: expected one slot axis growing one for one with the context")
            leaves.append(LeafLayout(SLOT, row[0], slot[0], a.shape[slot[0]] - short, kv))
    return PagedLayout(jax.tree.structure(one), tuple(leaves), page_size, num_pages, max_rows, setup.max_seq_len)


def empty_store(params_t, params_d, layout: PagedLayout, *, setup: GenerateSetup, num_stop_ids: int) -> list:
    """The store of an empty server: zeroed pools, every row idle (done), placed on ``setup.mesh`` (pools of the
    target's K/V split by KV heads over "model", everything else replicated)."""
    idle = jax.tree.leaves(idle_slots(params_t, params_d, setup=setup.with_max_seq_len(32), num_slots=1,
                                      num_stop_ids=num_stop_ids))
    store = []
    for spec, leaf in zip(layout.leaves, idle):
        if spec.kind == SLOT:
            rest = tuple(n for i, n in enumerate(leaf.shape) if i not in (spec.row_axis, spec.slot_axis))
            value = jnp.zeros((layout.num_pages, layout.page_size) + rest, leaf.dtype)
        elif spec.kind == ROW:
            value = jnp.repeat(jnp.moveaxis(leaf, spec.row_axis, 0), layout.max_rows + 1, axis=0)
        else:
            value = leaf
        if setup.mesh is not None:
            value = jax.device_put(value, NamedSharding(setup.mesh, KV_POOL if spec.kv else P()))
        store.append(value)
    return store


def bytes_per_slot(params_t, params_d, layout: PagedLayout, *, setup: GenerateSetup, num_stop_ids: int,
                   kv_split: int = 1) -> float:
    """Device bytes one token slot takes over every pool (the target's K/V divided over ``kv_split`` devices)."""
    idle = jax.eval_shape(functools.partial(idle_slots, setup=setup.with_max_seq_len(32), num_slots=1,
                                            num_stop_ids=num_stop_ids), params_t, params_d)
    return sum(leaf.size * leaf.dtype.itemsize / (32 + spec.extra_slots) / (kv_split if spec.kv else 1)
               for spec, leaf in zip(layout.leaves, jax.tree.leaves(idle)) if spec.kind == SLOT)


def gather_view(layout: PagedLayout, store: list, row_ids: jax.Array, page_table: jax.Array, seq_len: int, *,
                paged_kv: bool = False) -> Any:
    """The dense (state, inputs) of rows ``row_ids`` (i32[R]) at context ``seq_len``; page_table: i32[R, >= pages
    of the view] (0: the null page). paged_kv: the target's K/V stay in their pools, each layer's a
    ``models.paged_kv.PagedKV`` over the view's page table (the step reads them through it), not a dense copy."""
    leaves = []
    for spec, stored in zip(layout.leaves, store):
        if spec.kind == SHARED:
            leaves.append(stored)
        elif spec.kind == ROW:
            leaves.append(jnp.moveaxis(stored[row_ids], 0, spec.row_axis))
        elif spec.kv and paged_kv:
            leaves.append(PagedKV(stored, page_table[:, :layout.pages_in_view(seq_len)]))
        else:
            extent = seq_len + spec.extra_slots
            pages = math.ceil(extent / layout.page_size)
            gathered = stored[page_table[:, :pages]]  # [R, pages, page_size, *rest]
            gathered = gathered.reshape((gathered.shape[0], pages * layout.page_size) + gathered.shape[3:])
            leaves.append(jnp.moveaxis(gathered[:, :extent], (0, 1), (spec.row_axis, spec.slot_axis)))
    return jax.tree.unflatten(layout.treedef, leaves)


def scatter_view(layout: PagedLayout, store: list, view: Any, row_ids: jax.Array, page_table: jax.Array,
                 seq_len: int, *, since: jax.Array | None = None, write_pages: int | None = None,
                 unchanged: frozenset[int] = frozenset()) -> list:
    """Writes a view (as :func:`gather_view` returns) back into the store -> the new store. since: i32[R], with
    ``write_pages``: only the ``write_pages`` pages from the one holding position since[r] are written back (the
    rest of each row is unchanged since the gather, so a chunk writes what its steps touched, not the whole
    context). A target K/V kept in pages (:func:`gather_view`'s ``paged_kv``) is stored as the step left it.
    unchanged: indices of leaves the program left as gathered: stored as they were (their gather, unused, is
    compiled away)."""
    out = []
    for index, (spec, stored, leaf) in enumerate(zip(layout.leaves, store, jax.tree.leaves(view, is_leaf=_is_paged))):
        if index in unchanged:
            out.append(stored)
        elif isinstance(leaf, PagedKV):
            out.append(constrain(leaf.pages, KV_POOL))
        elif spec.kind == SHARED:
            out.append(leaf.astype(stored.dtype))
        elif spec.kind == ROW:
            out.append(stored.at[row_ids].set(jnp.moveaxis(leaf, spec.row_axis, 0).astype(stored.dtype)))
        else:
            extent = seq_len + spec.extra_slots
            pages = math.ceil(extent / layout.page_size)
            rows = jnp.moveaxis(leaf, (spec.row_axis, spec.slot_axis), (0, 1))  # [R, extent, *rest]
            table = page_table[:, :pages]
            if since is not None:
                first = since // layout.page_size
                pages += write_pages  # room for a window that starts at the last page
                table = jnp.pad(table, ((0, 0), (0, write_pages)))  # past the row's pages: the null page
                table = jnp.take_along_axis(table, first[:, None] + jnp.arange(write_pages)[None], axis=1)
            widths = [(0, 0)] * rows.ndim
            widths[1] = (0, pages * layout.page_size - extent)
            rows = jnp.pad(rows, widths)
            if since is not None:
                span = write_pages * layout.page_size
                rows = jax.vmap(lambda row, at: jax.lax.dynamic_slice_in_dim(row, at, span, axis=0))(
                    rows, first * layout.page_size)
            rows = rows.reshape((-1, layout.page_size) + rows.shape[2:])
            updated = stored.at[table.reshape(-1)].set(rows.astype(stored.dtype))
            out.append(constrain(updated, KV_POOL) if spec.kv else updated)
    return out


def _is_paged(x: Any) -> bool:
    return isinstance(x, PagedKV)


def api_feature_leaves(layout: PagedLayout) -> frozenset[int]:
    """Indices of the leaves only the API features use: the log-probability buffers, the output token counts and
    the logits processors' parameters (empty for a setup without them)."""
    state, inputs = jax.tree.unflatten(layout.treedef, list(range(len(layout.leaves))))
    return frozenset(jax.tree.leaves((state.logprobs, state.output_counts, inputs.processors)))


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
    if state.logprobs is not None:
        slots = jnp.minimum(since[:, None] + jnp.arange(width)[None], state.tokens.shape[1] - 1)
        logprobs = Logprobs(*(jnp.take_along_axis(x, slots.reshape(slots.shape + (1,) * (x.ndim - 2)), axis=1)
                              for x in state.logprobs))
    return Readout(state.tokens, state.num_generated, state.num_steps, state.done, state.accepted_hist, state.step,
                   logprobs)


@functools.partial(setup_jit, static_argnames=("layout", "setup", "seq_len"), donate_argnames=("store",))
def prefill_rows(params_t, params_d, store: list, prompt_ids: jax.Array, prompt_lens: jax.Array,
                 key_data: jax.Array, max_new_tokens: jax.Array, stop_ids: jax.Array, sampling: SamplingArrays,
                 processors, row_ids: jax.Array, page_table: jax.Array, token_bitmask: jax.Array | None = None, *,
                 layout: PagedLayout, setup: GenerateSetup, seq_len: int) -> tuple[list, Readout]:
    """Prefills N requests at once into rows ``row_ids`` and their pages (the store is donated) -> (store, readout).

    prompt_ids: i32[N, W] right-padded (W <= seq_len - 1); prompt_lens, max_new_tokens: i32[N]; key_data: u32[N, ...]
    each request's own key; stop_ids: i32[N, K] -1 padded; sampling: [N] each; processors: the logits processors'
    arrays (``setup.logits_processors``) or None; row_ids: i32[N] (padding: the null row); page_table: i32[N,
    pages_per_row] (padding: 0); token_bitmask: i32[N, 1, W] the rows' grammar masks for their first token
    (structured outputs) or None. Each row's first token is committed, as in ``generate``.
    """
    with traced_on(setup.mesh):
        key = jax.random.wrap_key_data(key_data)
        state, inputs = start_state(params_t, params_d, prompt_ids, prompt_lens, key, max_new_tokens, stop_ids,
                                    sampling, processors, token_bitmask, setup=setup.with_max_seq_len(seq_len))
        inputs = inputs._replace(token_bitmask=None)  # a step's masks are its own, never stored
        step_index = [i for i, spec in enumerate(layout.leaves) if spec.kind == SHARED]
        state = state._replace(step=store[step_index[0]] if step_index else state.step)
        since = jnp.zeros_like(prompt_lens)
        return (scatter_view(layout, store, (state, inputs), row_ids, page_table, seq_len, since=since,
                             write_pages=prefill_pages(layout, prompt_ids.shape[1])), _readout(state, prompt_lens, 1))


def prefill_pages(layout: PagedLayout, width: int) -> int:
    """Pages a prefill of ``width`` tokens writes per row, from the page of its first uncached token: the prompt,
    its first new token and the widest slot leaf's extra slots past them."""
    extra = max((leaf.extra_slots for leaf in layout.leaves if leaf.kind == SLOT), default=0)
    return math.ceil((width + 1 + extra) / layout.page_size) + 1


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
def prefill_cached_rows(params_t, params_d, store: list, suffix_ids: jax.Array, prompt_lens: jax.Array,
                        cached_lens: jax.Array, key_data: jax.Array, max_new_tokens: jax.Array, stop_ids: jax.Array,
                        sampling: SamplingArrays, processors, row_ids: jax.Array, page_table: jax.Array,
                        token_bitmask: jax.Array | None = None, *, layout: PagedLayout, setup: GenerateSetup,
                        seq_len: int) -> tuple[list, Readout]:
    """Prefills N requests whose first ``cached_lens[b]`` prompt tokens (whole pages) are in their pages already
    (a prefix-cache hit): the target runs on the rest of each prompt only, attending the cached K/V in their pages
    (``models.paged_kv.paged_attention``); the drafter (:func:`continues_from_cache`) prefills over the whole
    prompt. The cached pages are read, never written (the write-back starts at the page of position cached_lens[b],
    a whole page), so rows sharing them keep them bit for bit. It also prefills a prompt's pieces (chunked
    prefill): cached_lens[b] the tokens its earlier pieces put in its pages, prompt_lens[b] where this piece ends.
    -> (store, readout).

    suffix_ids: i32[N, W] each prompt's tokens from cached_lens[b] on, right-padded (prompt_lens[b] <= seq_len - 1;
    the padding may run past seq_len: the program's view is W slots longer, and positions past a row's pages are
    the null page's); prompt_lens: i32[N] whole prompts; the other arguments as :func:`prefill_rows`.
    """
    if not continues_from_cache(setup):
        raise ValueError(f"prefill_cached_rows: the drafter reads target layers {setup.drafter.tap_layers} and "
                         f"does not continue from a cached prefix")
    batch, width = suffix_ids.shape
    seq_len += width
    page_table = jnp.pad(page_table, ((0, 0), (0, max(0, layout.pages_in_view(seq_len) - page_table.shape[1]))))
    small = setup.with_view_len(seq_len)
    with traced_on(setup.mesh):
        view, _ = gather_view(layout, store, row_ids, page_table, seq_len, paged_kv=True)
        rows = jnp.arange(batch)[:, None]
        positions = cached_lens[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
        tokens = view.tokens.at[rows, positions].set(suffix_ids, mode="drop")
        out = small.target_model().apply({"params": params_t}, suffix_ids, positions, view.cache, cached_lens,
                                         logits_index=(prompt_lens - cached_lens - 1)[:, None],
                                         tap_layers=small.tap_layers)
        keys = jax.random.wrap_key_data(key_data)
        first_logits, counts = out.logits, None
        zeros = jnp.zeros((batch,), jnp.int32)
        if small.logits_processors:
            counts = context_output_counts(tokens, processors.output_start, prompt_lens, small.target.vocab_size)
            first_logits = process(first_logits, processors, counts[:, None], zeros[:, None], stop_ids)
        first_logits = apply_token_bitmask(first_logits, token_bitmask)
        first = sample_tokens(first_logits[:, 0], sampling, keys_at(keys, prompt_lens))
        state = DecodeState(tokens=tokens, seq_len=prompt_lens, cache=out.cache, num_generated=zeros,
                            done=jnp.zeros((batch,), bool), num_steps=zeros,
                            accepted_hist=jnp.zeros_like(view.accepted_hist), step=view.step, output_counts=counts)
        state, committed = commit_tokens(state, first[:, None], jnp.ones_like(zeros), max_new_tokens, stop_ids,
                                         counts_as_step=False)
        recorded = recorded_logits(out.logits, first_logits, sampling, small.logprobs_mode)
        state = state._replace(logprobs=record(view.logprobs, recorded, first[:, None], prompt_lens, committed))
        if small.drafter is not None:
            taps = constrain(small.drafter_taps(out.taps), TAPS) if small.drafter.tap_layers else None
            state = state._replace(draft=small.drafter.prefill_cached(
                params_t, params_d, view.draft, PrefillContext(tokens, prompt_lens, first, taps), cached_lens))
        inputs = StepInputs(max_new_tokens, stop_ids, sampling, keys, processors)
        state = shard_state(state)
        return (scatter_view(layout, store, (state, inputs), row_ids, page_table, seq_len, since=cached_lens,
                             write_pages=prefill_pages(layout, width)), _readout(state, prompt_lens, 1))


def rewritten_margin(setup: GenerateSetup) -> int:
    """Positions before a row's committed length a chunk may still rewrite: a drafter may redo the slots of its last
    step's tokens (EAGLE-3 writes their K/V once the target's states for them are known); two steps' worth."""
    return 2 * setup.tokens_per_step


def write_pages(layout: PagedLayout, setup: GenerateSetup, steps: int) -> int:
    """Pages a chunk of at most ``steps`` steps writes back per row (``step_rows``'s ``write_pages``): from
    :func:`rewritten_margin` before the committed length to every slot its steps and their windows may reach."""
    extra = max((leaf.extra_slots for leaf in layout.leaves if leaf.kind == SLOT), default=0)
    reach = rewritten_margin(setup) + 1 + steps * setup.tokens_per_step + extra
    return math.ceil(reach / layout.page_size) + 1


@functools.partial(setup_jit, static_argnames=("layout", "setup", "seq_len", "speculate", "write_pages",
                                               "short_nodes", "chunk_steps", "api_features"),
                   donate_argnames=("store",))
def step_rows(params_t, params_d, store: list, row_ids: jax.Array, page_table: jax.Array, cancel: jax.Array,
              max_steps: jax.Array, token_bitmask: jax.Array | None = None, *, layout: PagedLayout,
              setup: GenerateSetup, seq_len: int,
              speculate: bool = True, write_pages: int | None = None, short_nodes: int | None = None,
              chunk_steps: int = 1, api_features: bool = True) -> tuple[list, Readout]:
    """Finishes the rows where ``cancel`` (bool[R]) is set, then runs at most ``max_steps`` (i32[]) steps over rows
    ``row_ids`` (i32[R], padding: the null row) at context ``seq_len`` (>= prompt + max_tokens of every row) ->
    (store, readout). speculate=False: plain steps that keep the drafter current (``jspec.step.root_step``; a
    plain server ignores it). page_table: i32[R, pages_per_row]; a row's pages must cover every position the
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
        unchanged, loop_setup, loop_inputs = frozenset(), setup, inputs
        if not api_features:
            unchanged, loop_setup = api_feature_leaves(layout), without_api_features(setup)
            gathered = state
            state = state._replace(logprobs=None, output_counts=None)
            loop_inputs = inputs._replace(processors=None)
        state = run_loop(params_t, params_d, state, loop_inputs._replace(token_bitmask=token_bitmask),
                         setup=loop_setup.with_max_seq_len(seq_len), max_steps=max_steps, speculate=speculate,
                         short_nodes=short_nodes)
        readout = _readout(state, entry_len, chunk_steps * setup.tokens_per_step)
        if not api_features:  # the tree as stored; these leaves are not written back
            state = state._replace(logprobs=gathered.logprobs, output_counts=gathered.output_counts)
        return (scatter_view(layout, store, (state, inputs), row_ids, page_table, seq_len, since=since,
                             write_pages=write_pages, unchanged=unchanged), readout)


@functools.partial(setup_jit, static_argnames=("layout", "setup", "seq_len"))
def propose_rows(params_t, params_d, store: list, row_ids: jax.Array, page_table: jax.Array, *,
                 layout: PagedLayout, setup: GenerateSetup, seq_len: int):
    """A structured step's first half over rows ``row_ids`` (as :func:`step_rows`): the drafter's proposal ->
    (the drafter's new state in the rows' dense view, the DraftTree). The store is only read; the host masks the
    tree's nodes and :func:`verify_rows` goes on from here."""
    with traced_on(setup.mesh):
        state, inputs = gather_view(layout, store, row_ids, page_table, seq_len, paged_kv=True)
        return propose(params_t, params_d, state, inputs, setup=setup.with_max_seq_len(seq_len))


@functools.partial(setup_jit, static_argnames=("layout", "setup", "seq_len", "write_pages"),
                   donate_argnames=("store",))
def verify_rows(params_t, params_d, store: list, row_ids: jax.Array, page_table: jax.Array, cancel: jax.Array,
                draft_state, tree: DraftTree, token_bitmask: jax.Array, *, layout: PagedLayout,
                setup: GenerateSetup, seq_len: int, write_pages: int) -> tuple[list, Readout]:
    """A structured step's second half: finishes the rows where ``cancel`` is set, verifies :func:`propose_rows`'s
    ``tree`` (``draft_state`` the drafter's state it left) under ``token_bitmask`` (i32[R, T, W], one mask per
    node), accepts and commits -> (store, readout), as one step of :func:`step_rows`."""
    with traced_on(setup.mesh):
        state, inputs = gather_view(layout, store, row_ids, page_table, seq_len, paged_kv=True)
        entry_len = state.seq_len
        since = jnp.maximum(state.seq_len - 1 - rewritten_margin(setup), 0)
        state = shard_state(state._replace(done=state.done | cancel))
        state = verify_proposal(params_t, params_d, state, draft_state, tree,
                                inputs._replace(token_bitmask=token_bitmask), setup=setup.with_max_seq_len(seq_len))
        return (scatter_view(layout, store, (shard_state(state), inputs), row_ids, page_table, seq_len, since=since,
                             write_pages=write_pages), _readout(state, entry_len, setup.tokens_per_step))
