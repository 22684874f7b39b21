"""The model runner of the slot engine (vLLM v1's GPU model runner, for jspec's fused programs): the compiled
programs (:class:`jspec.serve.program_cache.ProgramCache`, keyed by :meth:`ModelRunner.every_key`), the device
store of KV pools and rows (:mod:`jspec.serve.kv_store`), the host page tables and the arguments each program
takes (its warm-up runs and the cost table's timed chunks: :mod:`jspec.serve.calibration`). The scheduler (:class:`jspec.serve.slots.SlotEngine`) decides which
requests run where and hands the runner plain data: prompts and their parameters, rows, page tables, cancelled
flags, grammars; the runner calls a program and returns its readout (not waited for)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.batching import prompt_bucket, prompt_buckets
from jspec.config import SamplingParams
from jspec.logprobs import SequenceLogprobs
from jspec.prompt_logprobs import score_prompts
from jspec.serve import kv_store, paged
from jspec.serve.adapt import FULL, PLAIN, SHORT
from jspec.serve.block_manager import pages_for
from jspec.serve.calibration import calibration_width
from jspec.serve.kv_cache_coordinator import KVCacheCoordinator
from jspec.serve.program_cache import ProgramCache
from jspec.serve.plans import PrefillPlan, StepPlan
from jspec.serve.programs import admit_row
from jspec.serve.serve_config import ServeConfig
from jspec.sharding import per_device_bytes, put
from jspec.structured_outputs.bitmask import bitmask_words
from jspec.structured_outputs.tree_masks import constrain_proposal, root_bitmask

logger = logging.getLogger("jspec.serve")

CPU_MAX_TOTAL_TOKENS = 65536  # the KV pool on a CPU, where device memory cannot size it (--max-total-tokens)
# The uncached rest of a prefix-cache hit (a shared system prompt's user turn) that the cached prefill compiled at
# warm-up holds: a first burst of such hits is served from the cache while the rests' own widths compile.
CACHED_STAND_IN = 64


@dataclasses.dataclass(frozen=True)
class FirstHalf:
    """A structured step's first half, dispatched (:meth:`ModelRunner.masked_step`): ``kind`` "forward" (a plain
    step's target pass, ``paged.forward_rows``: ``out`` its ``jspec.step.RootForward``) or "propose" (a speculative
    step's proposal, ``paged.propose_rows``: ``out`` (the drafter's state, the DraftTree)), over the program rows
    ``rows`` (row ids in program order, None an idle row) of the occupancy bucket ``bucket`` at context
    ``seq_len``. ``out`` holds device arrays; the step's second half reads them."""

    kind: str
    rows: tuple[int | None, ...]
    bucket: int
    seq_len: int
    out: object


class StructuredStep(NamedTuple):
    """What :meth:`ModelRunner.structured_step` ran: the program, its rows in program order (None: an idle row),
    its readout (in flight), the next step's first half over the same rows (dispatched already, or None) and
    whether it used the first half it was given."""

    program: str
    rows: list[int | None]
    readout: paged.Readout
    ahead: FirstHalf | None
    used_ahead: bool


class ModelRunner:
    """The programs, store and page tables of one slot engine over ``engine``'s weights, for ``setup`` (the
    engine's, with the server's logprobs and logits processors) and ``config`` (its buckets and sizes).
    :meth:`plan` sizes the pool, :meth:`allocate` builds the store, :meth:`compile_up_front` compiles what warm-up
    runs (``calibration.first_runs``)."""

    def __init__(self, engine, setup, config: ServeConfig, ways_out: str):
        self.engine, self.setup = engine, setup
        for field in dataclasses.fields(config):  # read as the runner's own settings
            setattr(self, field.name, getattr(config, field.name))
        self.programs = ProgramCache(self.lower, ways_out=ways_out)
        self.layout: kv_store.PagedLayout | None = None
        self.blocks: KVCacheCoordinator | None = None  # the scheduler's; the cost table's rows take pages from it
        self.store = None
        self.store_shape = None  # the store's shapes and shardings: what programs are lowered for
        self.tables = np.zeros((config.max_num_seqs + 1, 1, 1), np.int32)  # [rows, groups, pages]: allocate()
        self.host_step = 0  # the store's loop step counter, as last read back

    # --- the pool and the store ---------------------------------------------------------------------------------

    def plan(self, max_total_tokens: int | None) -> tuple[kv_store.PagedLayout, int]:
        """The store's layout and the pool in token slots (default: :meth:`pool_tokens`); ValueError where the pool
        cannot hold one request of max_seq_len."""
        args = (self.engine.params, self.engine.drafter_params)
        layout = kv_store.paged_layout(*args, setup=self.setup, num_stop_ids=self.num_stop_ids,
                                    page_size=self.block_size, num_pages=2, max_rows=self.max_num_seqs)
        if max_total_tokens is None:
            max_total_tokens = self.pool_tokens(layout)
        num_pages = 1 + pages_for(max_total_tokens, self.block_size)
        if num_pages - 1 < layout.pages_per_row:
            raise ValueError(f"max_total_tokens={max_total_tokens}: expected at least "
                             f"{layout.pages_per_row * self.block_size} token slots, one request of max_seq_len="
                             f"{self.max_seq_len} with its lookahead")
        self.layout = dataclasses.replace(layout, num_pages=num_pages,
                                          window_pages=1 + self.window_pool_pages(layout, num_pages - 1))
        return self.layout, max_total_tokens

    def window_pages_per_row(self, layout: kv_store.PagedLayout) -> int:
        """The most window-group pages one request holds at once (``jspec.serve.kv_cache_coordinator``): its window
        before the earliest query of its next programs, and what they write: a prompt's piece (or the widest
        prefill of a prompt's rest), three chunks of steps (two reserved, and the cost table's runs) and the
        lookahead's extra slots, each end rounded out to a page."""
        prompt = self.piece_width or self.max_prompt_width
        reach = layout.window - 1 + prompt + 3 * self.steps_per_chunk * self.setup.tokens_per_step
        return pages_for(reach + layout.extra_slots, self.block_size) + 2

    def window_pool_pages(self, layout: kv_store.PagedLayout, full_pages: int) -> int:
        """Usable pages of the window group's pool beside ``full_pages`` in the full group's (0 without a binding
        window): every row's window and three chunks of steps past it, and twice the prompt tokens one scheduler
        round prefills (whose pages out of the window go at the rows' next reservation), never fewer than one
        row's most (:meth:`window_pages_per_row`) nor more than the full group's pages."""
        if not layout.window:
            return 0
        steps = 3 * self.steps_per_chunk * self.setup.tokens_per_step
        decoding = pages_for(layout.window - 1 + steps + layout.extra_slots, self.block_size) + 2
        prefilling = pages_for(2 * max(self.max_num_batched_tokens, self.piece_width or self.max_prompt_width),
                               self.block_size)
        wanted = max(self.max_num_seqs * decoding + prefilling, self.window_pages_per_row(layout))
        return min(full_pages, wanted)

    def allocate(self, blocks: KVCacheCoordinator) -> None:
        """The empty store and page tables for :meth:`plan`'s layout; ``blocks``: the scheduler's block manager."""
        self.blocks = blocks
        self.tables = np.zeros((self.max_num_seqs + 1, self.layout.num_groups, self.layout.pages_per_row), np.int32)
        self.store = kv_store.empty_store(self.engine.params, self.engine.drafter_params, self.layout, setup=self.setup,
                                       num_stop_ids=self.num_stop_ids)
        self.store_shape = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                        self.store)

    def compile_up_front(self, calibration_prompt: list[int], structured_later: int = 0) -> None:
        """Compiles what warm-up compiles (``precompile``: every key, or :meth:`needed_keys`); structured_later:
        programs the structured-output warm-up compiles next (counted against the memory-mapping budget)."""
        keys = self.every_key() if self.precompile == "all" else self.needed_keys(calibration_prompt)
        self.programs.compile_up_front(keys, later=structured_later)

    def lookahead(self, seq_len: int, need: int, chunks: int = 1) -> int:
        """Token slots a request of ``seq_len`` committed tokens (``need`` at most) holds for ``chunks`` more
        chunks: up to ``steps_per_chunk`` full steps each, and the widest tree window or drafter slots past them."""
        return min(need, seq_len + chunks * self.steps_per_chunk * self.setup.tokens_per_step) + self.layout.extra_slots

    def clear_table(self, row: int) -> None:
        self.tables[row] = 0

    def steps_ran(self, step: int) -> int:
        """Loop steps since the last readout, from a readout's step counter."""
        ran, self.host_step = int(step) - self.host_step, int(step)
        return ran

    # --- calling programs -----------------------------------------------------------------------------------------

    def prefill(self, plan: PrefillPlan) -> paged.Readout:
        """Runs ``plan`` on the prefill program of its batch and width bucket (or the compiled one standing in,
        :meth:`prefill_program`) -> its readout (in flight)."""
        program = "prefill" if plan.cached is None else "prefill_cached"
        size, width = self.prefill_program(program, len(plan.items), plan.width, self.widest_cached(plan.cached))
        assert size >= len(plan.items), (program, size, len(plan.items))  # callers prefill in parts of that size
        arrays = self.prefill_arrays(list(plan.items), width, size, list(plan.rows), plan.history, plan.matchers)
        if plan.cached is not None:
            arrays = self.cached_arrays(arrays, list(plan.cached), plan.lengths)
        self.store, out = self.programs[program, size, width](self.engine.params, self.engine.drafter_params,
                                                              self.store, *arrays)
        return out

    def step(self, plan: StepPlan) -> paged.Readout:
        """Runs ``plan`` on its step program -> its readout (in flight)."""
        arrays = self.step_arrays(list(plan.rows), plan.bucket, list(plan.cancelled))
        return self.run_step(plan.program, plan.bucket, plan.seq_len, arrays, plan.steps,
                             "step_lean" if plan.lean else "step")

    def pool_tokens(self, layout: kv_store.PagedLayout) -> int:
        """The default KV pool in token slots: on a GPU or a TPU, ``kv_cache_memory_fraction`` of device memory
        less what is in use (weights) and the largest program's workspace (:meth:`workspace_bytes`), over the bytes
        a slot takes in every pool (vLLM's ``gpu_memory_utilization``); elsewhere ``CPU_MAX_TOTAL_TOKENS`` (which
        at Llama-3-8B would not fit one v5e beside int8 weights: docs/aot.md)."""
        stats = device_memory()
        if stats is None:
            return CPU_MAX_TOTAL_TOKENS
        model = 1 if self.setup.mesh is None else self.setup.mesh.shape.get("model", 1)
        per_slot = layout.bytes_per_token(kv_split=model)
        window_slot = layout.bytes_per_token(kv_split=model, group=kv_store.WINDOW_GROUP)
        workspace = self.workspace_bytes(layout)
        free = self.kv_cache_memory_fraction * stats["bytes_limit"] - stats.get("bytes_in_use", 0) - workspace
        free -= 2 * self.block_size * window_slot  # the window pool's null page, and a page of rounding
        # The window pool holds as many slots as the full one up to its cap, then stops growing.
        cap = self.window_pool_pages(layout, 1 << 40) * self.block_size
        tokens = free / (per_slot + window_slot)
        if tokens > cap:
            tokens = (free - cap * window_slot) / per_slot
        tokens = (int(tokens) // self.block_size - 1) * self.block_size  # whole pages, and the null page
        logger.info("KV pool: %.2f GiB, %.0f%% of %.2f GiB less %.2f GiB in use (weights) and the largest program's "
                    "workspace, %.2f GiB", max(tokens, 0) * per_slot / 2**30, 100 * self.kv_cache_memory_fraction,
                    stats["bytes_limit"] / 2**30, stats.get("bytes_in_use", 0) / 2**30, workspace / 2**30)
        return max(tokens, layout.pages_per_row * self.block_size)

    def workspace_bytes(self, layout: kv_store.PagedLayout) -> int:
        """Bytes one device needs beside the weights and the store while the largest programs run (vLLM's profile
        run, read from the compiler's memory analysis instead): their other arguments, temporaries and the outputs
        that do not update the store in place, of :meth:`profiled_keys` compiled over a pool of one request. A
        program's store is donated and placed as it came in (``kv_store.scatter_view``), so none of these grows
        with the pool."""
        self.layout = dataclasses.replace(layout, num_pages=1 + layout.pages_per_row,
                                          window_pages=1 + self.window_pool_pages(layout, layout.pages_per_row))
        self.tables = np.zeros((self.max_num_seqs + 1, layout.num_groups, layout.pages_per_row), np.int32)
        self.store_shape = kv_store.store_shapes(self.engine.params, self.engine.drafter_params, self.layout,
                                                 setup=self.setup, num_stop_ids=self.num_stop_ids)
        weights = per_device_bytes((self.engine.params, self.engine.drafter_params))
        try:
            return max(workspace_of(self.lower(key).compile(), weights + per_device_bytes(self.store_shape)
                                    if key[0] != "score" else per_device_bytes(self.engine.params))
                       for key in self.profiled_keys())
        finally:
            self.layout = self.store_shape = None

    def profiled_keys(self) -> list[tuple]:
        """The programs :meth:`workspace_bytes` measures: the step over the most rows at the longest context, the
        prefill of the most prompt tokens, prompt scoring at the widest prompt (its logits are the prompt's)."""
        keys = [("step", FULL, self.row_buckets[-1], self.seq_buckets[-1])]
        keys.append(max((("prefill", rows, width) for width in self.widths for rows in self.prefill_batches(width)),
                        key=lambda key: key[1] * key[2]))
        if self.setup.logprobs is not None:
            keys.append(("score", prompt_buckets(self.max_prompt_width, half_steps=False)[-1]))
        return keys

    def cached_prefill_width(self, width: int, cached_tokens: int) -> int | None:
        """The width of the compiled cached prefill a prompt of uncached width bucket ``width`` after
        ``cached_tokens`` cached ones runs on: its own, else (that asked for on the compiling thread) the narrowest
        compiled one wider (its padded positions must stay in the context: ``cached_tokens`` + it <=
        ``max_seq_len``); None: none yet."""
        widths = [key[2] for key in self.programs.keys() if key[0] == "prefill_cached"]
        if width not in widths:
            self.programs.request(("prefill_cached", 1, width))
        fitting = [w for w in widths if width <= w <= self.max_seq_len - cached_tokens]
        return min(fitting, default=None)

    def score_prompt(self, prompt_ids: list[int], num_top: int) -> SequenceLogprobs:
        """A prompt's tokens 1 .. P - 1 scored by the target (``jspec.prompt_logprobs``), their num_top most likely
        tokens too: one program call over its width bucket."""
        width = prompt_bucket(len(prompt_ids), self.max_prompt_width, half_steps=False)
        if ("score", width) not in self.programs:  # a wider compiled one meanwhile (only padding differs)
            self.programs.request(("score", width))
            width = min(key[1] for key in self.programs.keys() if key[0] == "score" and key[1] >= width)
        ids = np.zeros((1, width), np.int32)
        ids[0, :len(prompt_ids)] = prompt_ids
        values = jax.device_get(self.programs["score", width](self.engine.params, self.place(ids),
                                                              self.place(np.asarray([len(prompt_ids)], np.int32))))
        token, top_ids, top = (x[0, 1:len(prompt_ids)] for x in values)
        return SequenceLogprobs(token, top_ids[:, :num_top], top[:, :num_top])

    def structured_step(self, running: list[int], cancelled: list[bool], need: int, matchers: list, *,
                        greedy: bool, program: str = FULL, lean: bool = False,
                        ahead: FirstHalf | None = None) -> StructuredStep:
        """One structured step (:meth:`masked_step`) of ``program`` (the load adapter's choice: :data:`FULL`,
        :data:`SHORT` or :data:`PLAIN`) over ``running`` rows, ``need`` token slots at most, at the occupancy and
        context bucket holding them (:meth:`masked_bucket`: its own programs where compiled, else compiled ones
        standing in while they compile off this thread), matchers[i] the grammar of running[i] (None:
        unconstrained); lean: in its form without the API features (no row's request uses them). ahead: the
        first half the step before dispatched, over program rows among which every running row is (with the
        request it ran); used where it is this step's own (a plain step's target pass, or a speculative one's
        proposal) at its bucket: rows since finished run idle. The step dispatches the next one's first half
        over the same program rows before its readout: the device runs it while the host reads this step back and
        computes the next masks -> :class:`StructuredStep`."""
        rows = next(r for r in self.row_buckets if r >= len(running))
        seq_len = next(n for n in self.seq_buckets if n >= need)
        masked = self.masked_program(program)
        first = self.masked_keys(masked, rows, seq_len, lean)[0]
        if ahead is not None and (ahead.kind, ahead.bucket, ahead.seq_len) == first and \
                ("masked", masked, rows, seq_len, lean) in self.programs:
            live = dict(zip(running, zip(cancelled, matchers)))
            order = [row if row in live else None for row in ahead.rows]
            cancelled = [row is not None and live[row][0] for row in order]
            matchers = [None if row is None else live[row][1] for row in order]
            program = masked
        else:
            ahead, order, matchers = None, list(running), list(matchers)
            program, rows, seq_len, lean = self.masked_bucket(masked, rows, seq_len, lean)
        matchers += [None] * (rows - len(order))
        out, following = self.masked_step(order, cancelled, rows, seq_len, matchers, greedy=greedy, program=program,
                                          lean=lean, first=ahead, prepare_next=True)
        return StructuredStep(program, order, out, following, ahead is not None)

    def masked_program(self, program: str) -> str:
        """The masked form a structured step of ``program`` runs: a plain server's one program is its plain step;
        the short chain's is the whole tree's where the server has none."""
        if not self.speculative:
            return PLAIN
        return FULL if program == SHORT and self.short_nodes is None else program

    def masked_programs(self) -> tuple[str, ...]:
        """The step programs that have a masked form (:meth:`masked_step`)."""
        if not self.speculative:
            return (PLAIN,)
        return (FULL, PLAIN) if self.short_nodes is None else (FULL, SHORT, PLAIN)

    def masked_programs_per_bucket(self) -> int:
        """Compiled programs the masked steps of one bucket take: the proposal (shared by the speculative ones)
        and a verify pass per speculative program; the plain step's two halves."""
        speculative = [p for p in self.masked_programs() if p != PLAIN]
        return 2 + len(speculative) + (1 if speculative else 0)

    def masked_keys(self, program: str, rows: int, seq_len: int, lean: bool) -> list[tuple]:
        """The program-cache keys a masked step of ``program`` runs: its first half, ("forward", rows, seq_len)
        for a plain step (``paged.forward_rows``) or ("propose", rows, seq_len) for a speculative one, then
        ("masked", program, rows, seq_len, lean), the draw under the masks (``paged.sample_rows``) or the verify
        pass (``paged.verify_rows``)."""
        first = ("forward" if program == PLAIN else "propose", rows, seq_len)
        return [first, ("masked", program, rows, seq_len, lean)]

    def masked_bucket(self, program: str, rows: int, seq_len: int, lean: bool) -> tuple[str, int, int, bool]:
        """(program, rows, seq_len, lean) of the masked step that serves a structured step of ``program`` over
        ``rows`` rows at context ``seq_len``: its own where compiled; else (its own asked for on the compiling
        thread) the smallest compiled bucket holding it, of that program or, failing that, of another (every
        masked program commits the constrained target's tokens), a lean step standing in only for a lean one;
        with none compiled, its own, compiled here (the server's first structured step, without
        ``--warm-up-structured-outputs``)."""
        wanted = self.masked_keys(program, rows, seq_len, lean)
        if all(key in self.programs for key in wanted):
            return program, rows, seq_len, lean
        for key in wanted:
            self.programs.request(key)
        compiled = [key[1:] for key in self.programs.keys() if key[0] == "masked"]
        others = tuple(p for p in (PLAIN, SHORT, FULL) if p != program and p in self.masked_programs())
        for candidate in (program,) + others:  # the cheaper stand-ins first
            held = [(r, s, f) for p, r, s, f in compiled if p == candidate and r >= rows and s >= seq_len
                    and (lean or not f) and all(k in self.programs for k in self.masked_keys(p, r, s, f))]
            if held:
                r, s, f = min(held, key=lambda bucket: (bucket[0] * bucket[1], bucket[0], bucket[2] != lean))
                return candidate, r, s, f
        logger.info("compiling the structured-output programs %s on first use (--warm-up-structured-outputs "
                    "compiles them at start-up)", wanted)
        self.programs.compile_now(wanted)
        return program, rows, seq_len, lean

    def warm_structured(self) -> None:
        """Compiles every bucket's structured steps (``warm_up_structured_outputs``), of every program the load
        adapter may choose, in their form without the API features (requests with a grammar that also ask for
        log-probabilities or logits processors compile theirs on first use), and runs each once on the idle null
        row (its pages are the null page) with nothing masked; the prefills take their grammar masks already."""
        buckets = [(program, rows, seq_len) for program in self.masked_programs() for rows in self.row_buckets
                   for seq_len in self.seq_buckets]
        keys = [key for bucket in buckets for key in self.masked_keys(*bucket, True)]
        later = sum(key[0] == "masked" for key in keys)
        self.programs.compile_up_front((key for key in keys if key[0] != "masked"), later=later)
        self.programs.compile_up_front(key for key in keys if key[0] == "masked")  # second halves read first ones'
        for program, rows, seq_len in buckets:
            jax.block_until_ready(self.masked_step([], [], rows, seq_len, [None] * rows, greedy=True,
                                                   program=program, lean=True)[0])

    def masked_step(self, running: list[int | None], cancelled: list[bool], rows: int, seq_len: int, matchers: list,
                    *, greedy: bool, program: str = FULL, lean: bool = False, first: FirstHalf | None = None,
                    prepare_next: bool = False) -> tuple[paged.Readout, FirstHalf | None]:
        """One structured step of ``program`` over ``running`` rows (None: an idle row; ``cancelled``: each one's
        request cancelled) padded to ``rows`` at context ``seq_len`` by its compiled programs (:meth:`masked_keys`),
        matchers[i] the grammar of program row i (None: unconstrained); greedy: every row's temperature is 0 (forced
        drafts may then stand in for a deterministic drafter's) -> (its readout, with prepare_next the next step's
        first half over the same program rows, dispatched at once). :data:`PLAIN` (and a plain server's): the
        target on each row's last token (``paged.forward_rows``), then the draw under each row's mask
        (``paged.sample_rows``). :data:`FULL` and :data:`SHORT`: the drafter proposes (``paged.propose_rows``), the
        host masks every tree node the step verifies (the short chain's first ``short_nodes``) from its path's
        grammar state (``jspec.structured_outputs.tree_masks``), the target verifies under the masks
        (``paged.verify_rows``). first: the first half, dispatched already over the same program rows. lean: the
        second half's form without the API features (``paged.step_rows``' ``api_features=False``)."""
        row_ids, table, cancel = self.step_arrays(running, rows, cancelled)
        vocab = self.engine.config.vocab_size
        args = (self.engine.params, self.engine.drafter_params)
        first_key, second_key = self.masked_keys(program, rows, seq_len, lean)
        if first is None:
            first = self._first_half(first_key, running, row_ids, table)
        if program == PLAIN:
            self.store, out = self.programs[second_key](*args, self.store, row_ids, table, cancel, first.out,
                                                        self.place(root_bitmask(matchers, vocab)))
        else:
            draft, tree = first.out
            tree, bitmask = constrain_proposal(matchers, tree, vocab, greedy=greedy,
                                               nodes=self.short_nodes if program == SHORT else None)
            self.store, out = self.programs[second_key](*args, self.store, row_ids, table, cancel, draft, tree,
                                                        self.place(bitmask))
        return out, self._first_half(first_key, running, row_ids, table) if prepare_next else None

    def _first_half(self, key: tuple, running: list[int | None], row_ids: jax.Array, table: jax.Array) -> FirstHalf:
        """Dispatches the first half of ``key`` (:meth:`masked_keys`) over ``running`` program rows."""
        kind, rows, seq_len = key
        args = (self.engine.params, self.engine.drafter_params)
        if kind == "forward":  # writes the rows' K/V at their last token
            self.store, out = self.programs[key](*args, self.store, row_ids, table)
        else:  # reads the store only
            out = self.programs[key](*args, self.store, row_ids, table)
        return FirstHalf(kind, tuple(running), rows, seq_len, out)

    def step_programs(self) -> list[tuple[str, int]]:
        """(program, occupancy bucket) of every compiled step program (each at every context bucket): a plain
        server's one program per bucket is its FULL; a speculative one's PLAIN too, and SHORT at the
        ``short_row_buckets``."""
        programs = [(FULL, rows) for rows in self.row_buckets]
        if self.speculative:
            programs += [(PLAIN, rows) for rows in self.row_buckets]
        return programs + [(SHORT, rows) for rows in self.short_row_buckets]

    def run_step(self, program: str, rows: int, seq_len: int, arrays: tuple, steps: int,
                  kind: str = "step") -> tuple:
        """Calls the step program of ``program`` (:data:`FULL`, :data:`SHORT` or :data:`PLAIN`; a plain server's
        one program is its FULL) over the bucket of ``rows`` at context ``seq_len``; kind
        "step_lean": its form without the API features (``paged.step_rows``'s ``api_features=False``) -> its
        readout (not waited for; the store updated)."""
        compiled = self.programs[kind, program, rows, seq_len]
        self.store, out = compiled(self.engine.params, self.engine.drafter_params, self.store, *arrays,
                                   self.place(np.asarray(steps, np.int32)))
        return out

    def prefill_batches(self, width: int) -> list[int]:
        """The batch buckets of prefill programs at a prompt width: powers of four (fewer programs to compile; a
        padded prompt row costs a prefill row) up to as many prompts as ``max_num_batched_tokens`` slots and
        max_num_seqs rows hold (at least one)."""
        most = max(1, min(self.max_num_seqs, self.max_num_batched_tokens // width))
        sizes = [1]
        while sizes[-1] < most:
            sizes.append(min(4 * sizes[-1], most))
        return sizes

    def prefill_seq_len(self, width: int) -> int:
        """The context a prefill of ``width`` runs at: the shortest length bucket holding the prompt and its first
        new token."""
        return next(n for n in self.seq_buckets if n >= min(width + 1, self.max_seq_len))

    def stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """A request's stop ids: EOS (unless ignore_eos) and its stop_token_ids."""
        return (() if params.ignore_eos else self.eos_token_ids) + params.stop_token_ids

    def prefill_arrays(self, items: list[tuple[list[int], SamplingParams]], width: int, rows: int,
                       row_ids: list[int], history: list[tuple[list[int], int]] | None = None,
                       matchers: list | None = None) -> tuple:
        """The arguments of a prefill program after the store: ``items`` (context, parameters) padded to ``rows``
        with idle rows of the null row; history: per item, (the request's own prompt, tokens it generated that end
        the context: a preempted request's), for the logits processors (default: the context is a fresh prompt);
        matchers: per item, its grammar (None: unconstrained; default: none), whose mask the first token is drawn
        under (``root_bitmask``; the other rows allowed everything: one program serves both)."""
        null = ([1], SamplingParams(max_new_tokens=1))
        history = list(history or [(None, 0)] * len(items)) + [(None, 0)] * (rows - len(items))
        vocab = self.engine.config.vocab_size if self.setup.logits_processors else None
        parts = [admit_row(ids, params, self.stop_ids(params), width=width, num_stop_ids=self.num_stop_ids,
                           vocab_size=vocab, prompt=prompt, generated_before=before)
                 for (ids, params), (prompt, before) in zip(items + [null] * (rows - len(items)), history)]
        arrays = [np.concatenate(column) for column in zip(*[part[:5] for part in parts])]
        sampling = jax.tree.map(lambda *a: np.concatenate(a), *[part[5] for part in parts])
        processors = None if vocab is None else jax.tree.map(lambda *a: np.concatenate(a), *[p[6] for p in parts])
        ids = np.full((rows,), self.layout.null_row, np.int32)
        ids[:len(row_ids)] = row_ids
        matchers = list(matchers or [None] * len(items)) + [None] * (rows - len(items))
        bitmask = root_bitmask(matchers, self.engine.config.vocab_size)
        return tuple(jax.tree.map(self.place, (*arrays, sampling, processors, ids, self.tables[ids], bitmask)))

    def cached_arrays(self, arrays: tuple, cached: list[int], lengths: list[int] | None = None) -> tuple:
        """A cached prefill's arguments from :meth:`prefill_arrays` over the prompts' uncached rest: the whole
        prompts' lengths (``lengths``; default: as given) and the cached lengths inserted after them."""
        rows = arrays[0].shape[0]
        whole = np.asarray(jax.device_get(arrays[1])).copy()
        if lengths is not None:
            whole[:len(lengths)] = lengths
        cached_lens = np.zeros((rows,), np.int32)
        cached_lens[:len(cached)] = cached
        return (arrays[0], self.place(whole), self.place(cached_lens), *arrays[2:])

    def step_arrays(self, running: list[int | None], rows: int, cancelled: list[bool] | None = None) -> tuple:
        """(row_ids, page_table, cancel) of a chunk over ``running`` rows (None: an idle row) padded to ``rows``;
        cancelled: each running row's request cancelled (default: none)."""
        ids = np.full((rows,), self.layout.null_row, np.int32)
        ids[:len(running)] = [self.layout.null_row if row is None else row for row in running]
        cancel = np.zeros((rows,), bool)
        cancel[:len(running)] = cancelled if cancelled is not None else False
        return tuple(self.place(a) for a in (ids, self.tables[ids], cancel))

    def set_table(self, row: int, pages: list[int], window_pages: list[int] | None = None) -> None:
        """Row ``row``'s page table: ``pages`` in the full group, ``window_pages`` in the window group (where a
        sliding window binds; ``jspec.serve.kv_cache_coordinator``)."""
        self.tables[row] = 0
        self.tables[row, kv_store.FULL_GROUP, :len(pages)] = pages
        if window_pages is not None:
            self.tables[row, kv_store.WINDOW_GROUP, :len(window_pages)] = window_pages

    def place(self, array: np.ndarray) -> jax.Array:
        """On a mesh: replicated over it (the compiled programs expect their inputs there)."""
        if self.setup.mesh is None:
            return jnp.asarray(array)
        return put(array, jax.sharding.NamedSharding(self.setup.mesh, jax.sharding.PartitionSpec()))

    def every_key(self) -> list[tuple]:
        """Every program's key: ("prefill" | "prefill_cached", batch, width), ("score", width) and ("step",
        program, rows, seq_len). ("step_lean", program, rows, seq_len), a step program without the API features,
        is never listed: the scheduler asks for it at its bucket's first chunk without them."""
        keys = []
        for width in self.widths:
            for rows in self.prefill_batches(width):
                keys.append(("prefill", rows, width))
                if self.prefix_caching or self.piece_width:  # reads its cached pages (or its earlier pieces')
                    keys.append(("prefill_cached", rows, width))
        if self.setup.logprobs is not None:  # prompt scoring (echo), one row at any prompt width
            keys += [("score", width) for width in prompt_buckets(self.max_prompt_width, half_steps=False)]
        return keys + [("step", program, rows, seq_len) for program, rows in self.step_programs()
                       for seq_len in self.seq_buckets]

    def needed_keys(self, calibration_prompt: list[int]) -> list[tuple]:
        """The programs warm-up compiles with ``precompile="needed"``: those every request fits (one prompt at the
        widest width; the step programs at the longest context, fewest and most rows; with chunked prefill, a
        cached prefill of one prompt at every width: its pieces run on them; else, with prefix caching, one at
        :data:`CACHED_STAND_IN` tokens, which a hit whose uncached rest is no wider runs on while its own width
        compiles: a prefix-cache hit is cut to a compiled width, ``KVCacheManager.allocate``), and those warm-up
        runs (with load adaptation, the cost table's: every step program and occupancy at the longest context,
        the calibration prompt's prefills)."""
        keys = [("prefill", 1, self.widths[-1])]
        if self.piece_width:
            keys += [("prefill_cached", 1, width) for width in self.widths]
        elif self.prefix_caching:
            keys.append(("prefill_cached", 1, prompt_bucket(CACHED_STAND_IN, self.max_prompt_width, half_steps=False)))
        if self.setup.logprobs is not None:
            keys.append(("score", prompt_buckets(self.max_prompt_width, half_steps=False)[-1]))
        top = self.seq_buckets[-1]
        if not self.adapt:
            rows = sorted({self.row_buckets[0], self.row_buckets[-1]})
            return keys + [("step", FULL, n, top) for n in rows]
        width = calibration_width(self, calibration_prompt, top)
        keys += [("prefill", n, width) for n in self.prefill_batches(width)]
        return keys + [("step", program, rows, top) for program, rows in self.step_programs()]

    def example(self, key: tuple) -> tuple:
        """Arguments after the store of the program of ``key`` (idle rows)."""
        kind = key[0]
        if kind in ("step", "step_lean"):
            _, _, rows, _ = key
            return (*self.step_arrays([], rows), self.place(np.asarray(self.steps_per_chunk, np.int32)))
        if kind in ("propose", "forward"):
            return self.step_arrays([], key[1])[:2]
        if kind == "masked":
            return self.step_arrays([], key[2])
        if kind == "score":
            return (self.place(np.zeros((1, key[1]), np.int32)), self.place(np.ones((1,), np.int32)))
        _, rows, width = key
        example = self.prefill_arrays([([1], SamplingParams(max_new_tokens=1))], width, rows, [self.layout.null_row])
        return example if kind == "prefill" else self.cached_arrays(example, [0] * rows)

    def lower(self, key: tuple):
        """The program of ``key`` (:meth:`every_key`) lowered for the store's shapes (any thread)."""
        args = (self.engine.params, self.engine.drafter_params)
        kind, example = key[0], self.example(key)
        if kind == "score":
            return score_prompts.lower(self.engine.params, *example,
                                       setup=self.setup.with_max_seq_len(self.max_seq_len), num_top=self.setup.logprobs)
        if kind == "prefill":
            return paged.prefill_rows.lower(*args, self.store_shape, *example, layout=self.layout, setup=self.setup,
                                            seq_len=self.prefill_seq_len(key[2]))
        if kind == "prefill_cached":
            return paged.prefill_cached_rows.lower(*args, self.store_shape, *example, layout=self.layout,
                                                   setup=self.setup, seq_len=self.max_seq_len)
        if kind == "propose":
            return paged.propose_rows.lower(*args, self.store_shape, *example, layout=self.layout, setup=self.setup,
                                            seq_len=key[2])
        if kind == "forward":
            return paged.forward_rows.lower(*args, self.store_shape, *example, layout=self.layout, setup=self.setup,
                                            seq_len=key[2])
        if kind == "masked":
            return self.lower_masked(key, example)
        _, program, _, seq_len = key
        return paged.step_rows.lower(
            *args, self.store_shape, *example, layout=self.layout, setup=self.setup, seq_len=seq_len,
            speculate=program != PLAIN, write_pages=paged.write_pages(self.layout, self.setup, self.steps_per_chunk),
            short_nodes=self.short_nodes if program == SHORT else None, chunk_steps=self.steps_per_chunk,
            api_features=kind != "step_lean")

    def lower_masked(self, key: tuple, example: tuple):
        """The second half of the masked step of ``key`` (:meth:`masked_keys`) lowered, its first half's outputs'
        shapes and shardings those the compiled first half returns: the draw under a root mask i32[rows, 1, W], or
        the verify pass of the proposal under a mask per node i32[rows, T, W]."""
        _, program, rows, seq_len, lean = key
        args = (self.engine.params, self.engine.drafter_params)
        words = bitmask_words(self.engine.config.vocab_size)
        write_pages = paged.write_pages(self.layout, self.setup, 1)
        first_key = self.masked_keys(program, rows, seq_len, lean)[0]
        first = self.programs[first_key] if first_key in self.programs else self.lower(first_key).compile()
        outputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                               first.out_info)
        if program == PLAIN:
            bitmask = self.place(np.zeros((rows, 1, words), np.int32))
            return paged.sample_rows.lower(*args, self.store_shape, *example, outputs[1], bitmask,
                                           layout=self.layout, setup=self.setup, seq_len=seq_len,
                                           write_pages=write_pages, api_features=not lean)
        draft, tree = outputs
        bitmask = self.place(np.zeros((rows, tree.tokens.shape[1], words), np.int32))
        return paged.verify_rows.lower(*args, self.store_shape, *example, draft, tree, bitmask, layout=self.layout,
                                       setup=self.setup, seq_len=seq_len, write_pages=write_pages,
                                       short_nodes=self.short_nodes if program == SHORT else None,
                                       api_features=not lean)

    def step_bucket(self, program: str, rows: int, seq_len: int) -> tuple[int, int]:
        """(rows, seq_len) of the compiled step program a chunk of ``program`` over ``rows`` rows at context
        ``seq_len`` runs: its own bucket's, else (its own asked for on the compiling thread) the smallest compiled
        one holding it: more rows (idle ones) and a longer context give the same tokens."""
        if ("step", program, rows, seq_len) in self.programs:
            return rows, seq_len
        self.programs.request(("step", program, rows, seq_len))
        held = [key[2:] for key in self.programs.keys()
                if key[:2] == ("step", program) and key[2] >= rows and key[3] >= seq_len]
        return min(held, key=lambda bucket: (bucket[0] * bucket[1], bucket[0]))

    def widest_cached(self, cached: Sequence[int] | None) -> int | None:
        """The widest cached prefill prompts with ``cached`` tokens cached may run on (None: fresh prompts)."""
        return None if cached is None else self.max_seq_len - max(cached)

    def prefill_parts(self, program: str, group: list, width: int, max_width: int | None = None) -> Iterator[list]:
        """``group`` (prompts of width bucket ``width``) in the parts one prefill program call takes each: as many
        as its batch bucket holds (at most ``max_num_batched_tokens`` prompt slots), or the largest compiled
        program's (:meth:`prefill_program`; ``max_width`` as there)."""
        most = self.prefill_batches(width)[-1]
        while group:
            size, _ = self.prefill_program(program, len(group), width, max_width)
            part, group = group[:min(size, most)], group[min(size, most):]
            yield part

    def prefill_program(self, program: str, count: int, width: int,
                        max_width: int | None = None) -> tuple[int, int]:
        """(batch, width) of the compiled prefill program (``program``: "prefill" or "prefill_cached") that
        ``count`` prompts of width bucket ``width`` run on: its own bucket's, else (that asked for on the
        compiling thread) the cheapest compiled one of a batch and width at least theirs, else the one of the
        largest batch (the caller prefills them in parts). A cached prefill's width stays at most ``max_width``
        (:meth:`widest_cached`: its padded positions stay in the context; the KV cache manager admitted a hit only
        where one fits, :meth:`cached_prefill_width`)."""
        sizes = self.prefill_batches(width)
        size = next((n for n in sizes if n >= count), sizes[-1])
        if (program, size, width) in self.programs:
            return size, width
        self.programs.request((program, size, width))
        held = [key[1:] for key in self.programs.keys() if key[0] == program
                and width <= key[2] <= (max_width if program == "prefill_cached" else key[2])]
        fits = [bucket for bucket in held if bucket[0] >= min(count, size)]
        if fits:
            return min(fits, key=lambda bucket: (bucket[0] * bucket[1], bucket[1]))
        return max(held, key=lambda bucket: (bucket[0], -bucket[1]))


def workspace_of(compiled, resident: int) -> int:
    """Bytes a compiled program needs beside its ``resident`` arguments (the weights and store one device holds
    anyway): its other arguments, temporaries and the outputs not aliasing a donated argument."""
    stats = compiled.memory_analysis()
    return (stats.argument_size_in_bytes - resident + stats.temp_size_in_bytes + stats.output_size_in_bytes
            - stats.alias_size_in_bytes)


def device_memory() -> dict | None:
    """The first device's ``memory_stats()`` on a GPU or a TPU (``bytes_limit``, ``bytes_in_use``); None elsewhere
    (a CPU's memory is the host's, shared)."""
    stats = jax.devices()[0].memory_stats() if jax.default_backend() in ("gpu", "tpu") else None
    return stats if stats and "bytes_limit" in stats else None
