"""The serving scheduler (vLLM v1's name): host only, it decides which requests run in which rows and hands the
slot engine plans; it never calls a program. It holds the waiting queue and the running rows, the KV cache manager
(:mod:`jspec.serve.kv_cache_manager`: pages, prefix hits), preemption by recompute, and the load adapter's choice of
step program; it updates its state from each program's readout (:meth:`Scheduler.update_from_output`) and returns
what the output processor delivers. :class:`jspec.serve.slots.SlotEngine` runs the loop around it."""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Callable

import jax
import numpy as np

from jspec.serve import paged
from jspec.serve.adapt import FULL, PLAIN, SHORT, LoadAdapter
from jspec.serve.kv_cache_manager import KVCacheManager
from jspec.serve.metrics import ServeMetrics
from jspec.serve.model_runner import ModelRunner
from jspec.serve.output_processor import RequestOutput
from jspec.serve.plans import StepPlan
from jspec.serve.requests import Flight, Pending, Running, deliver, uses_api_features
from jspec.serve.serve_config import ServeConfig
from jspec.structured_outputs.tree_masks import advance

logger = logging.getLogger("jspec.serve")


class Scheduler:
    """The queues and rows of one slot engine. config: the server's (buckets, pages, prefix caching); setup: its
    programs' (``tokens_per_step``, which API features it offers); runner: read for stop ids, page lookahead, the
    compiled buckets. ``kv`` (the KV cache manager) and ``adapter`` (load adaptation, or None) are set at warm-up.
    ``lock`` guards ``waiting`` (clients submit from other threads)."""

    def __init__(self, config: ServeConfig, setup, metrics: ServeMetrics, runner: ModelRunner):
        self.config, self.setup, self.metrics, self.runner = config, setup, metrics, runner
        self.lock = threading.Condition()
        self.waiting: collections.deque[Pending] = collections.deque()
        self.rows: list[Running | None] = [None] * config.max_num_seqs
        self.kv: KVCacheManager | None = None
        self.adapter: LoadAdapter | None = None
        # Chunks whose requests use none of them run step programs without the features (compiled on first use).
        self.offers_api_features = setup.logprobs is not None or setup.logits_processors
        self._admitted = itertools.count()

    @property
    def num_running(self) -> int:
        return sum(row is not None for row in self.rows)

    def take_waiting(self) -> list[tuple[int, Running]]:
        """Pairs waiting requests (first come, first served) with free rows while their pages fit; drops cancelled
        ones. With prefix caching, a request whose context equals one taken now or still being prefilled in pieces
        (a request's n / best_of choices) waits until that prefill has put the prompt's pages in the cache: the
        choices share the prompt's prefill. Under the lock."""
        free = [i for i, row in enumerate(self.rows) if row is None]
        taken: list[tuple[int, Running]] = []
        contexts = {tuple(row.pending.context) for row in self.rows if row is not None and row.prefilled is not None}
        while self.waiting and len(taken) < len(free):
            pending = self.waiting[0]
            request = pending.request
            if request.cancelled is not None:
                self.waiting.popleft()
                deliver(request, [], request.cancelled)
                continue
            context = pending.context
            if self.config.prefix_caching and tuple(context) in contexts:
                break
            contexts.add(tuple(context))
            need = len(request.prompt_ids) + request.max_tokens
            allocation = self.kv.allocate(context, need)
            if allocation is None:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            params = request.sampling_params()
            running = Running(pending, allocation.pages, frozenset(self.runner.stop_ids(params)),
                               next(self._admitted), len(context), cached=allocation.cached_tokens,
                               registered=allocation.cached_tokens // self.config.block_size,
                               window_pages=allocation.window_pages)
            taken.append((free[len(taken)], running))
        self.metrics.waiting.set(len(self.waiting))
        return taken

    def reserve(self, in_flight: bool, land: Callable[[], None]) -> None:
        """Every running request's pages for one more chunk, oldest first; preempts the newest while the pool
        cannot hold them. With a chunk in flight the host's lengths lag the device's by that chunk, so the pages
        reach two chunks ahead; where the pool cannot hold that for every row, the chunk in flight is read back
        first (its rows' lengths are then known and finished ones free theirs) rather than preempting a request
        over pages it may not need. in_flight: a chunk is in flight; land: reads it back."""
        order = sorted((i for i, r in enumerate(self.rows) if r is not None), key=lambda i: self.rows[i].order)
        if in_flight and self.kv.pages_wanted({i: self.rows[i] for i in order}, 2) > \
                self.kv.num_free_pages:
            land()
            in_flight = False
            order = [i for i in order if self.rows[i] is not None]
        chunks = 2 if in_flight else 1
        for row in order:
            running = self.rows[row]
            if running is None:  # preempted below for an older one
                continue
            while not self.kv.extend(row, running, chunks):
                newest = max((i for i, r in enumerate(self.rows) if r is not None),
                             key=lambda i: self.rows[i].order)
                self.preempt(newest)
                if newest == row:
                    break
        self.kv.observe_usage()

    def preempt(self, row: int) -> None:
        """Frees a running request's row and pages and queues it first again, with the tokens it has (it will be
        prefilled with them: vLLM's recompute preemption)."""
        running = self.rows[row]
        self.release(row)
        pending = running.pending
        with self.lock:
            self.waiting.appendleft(pending)
            self.metrics.waiting.set(len(self.waiting))
        self.metrics.preemptions.inc()
        logger.info("preempted a request with %d tokens (the KV pool is full)", running.seq_len)

    def release(self, row: int) -> None:
        """Frees a row and its pages (``KVCacheManager.release``)."""
        self.kv.release(row, self.rows[row])
        self.rows[row] = None

    def may_overlap(self, flight: Flight) -> bool:
        """Whether the next chunk may be dispatched before the one in flight is read back: only where that wastes
        nothing the host can foresee. A row that may reach its budget in the chunk in flight (it commits at most
        ``steps_per_chunk * tokens_per_step`` tokens there) would ride the next chunk finished and keep its row from
        a waiting request, and a waiting request would wait a chunk longer for a free row; in both cases the chunk
        in flight (``flight``) is read back first (rows ending on a stop token cannot be foreseen: they ride one chunk). Under
        the lock."""
        if self.waiting and any(row is None for row in self.rows):
            return False
        reach = self.config.steps_per_chunk * self.setup.tokens_per_step
        return all(running.need - running.seq_len > reach for running in flight.owners
                   if running.request.cancelled is None)

    def plan_step(self, running: list[int]) -> tuple[StepPlan, bool]:
        """The chunk over ``running`` rows: their occupancy and length buckets, the step program the adapter picks
        (a plain server has one per bucket), its form without the API features where no request uses them and it
        is compiled (else asked for, off this thread) -> (the plan, whether any row samples)."""
        config = self.config
        rows = next(r for r in config.row_buckets if r >= len(running))
        need = max(self.rows[i].need for i in running)
        seq_len = next(n for n in config.seq_buckets if n >= need)
        program, sampled = self.choose_program(running, rows, seq_len)
        rows, seq_len = self.runner.step_bucket(program, rows, seq_len)
        lean = False
        if self.offers_api_features and not any(uses_api_features(self.rows[i].request) for i in running):
            lean = ("step_lean", program, rows, seq_len) in self.runner.programs
            if not lean:  # until it is compiled (off this thread), the program with the features runs these rows too
                self.runner.programs.request(("step_lean", program, rows, seq_len))
        cancelled = tuple(self.rows[i].request.cancelled is not None for i in running)
        return StepPlan(tuple(running), cancelled, program, rows, seq_len, config.steps_per_chunk, lean), sampled

    def choose_program(self, running: list[int], rows: int, seq_len: int | None) -> tuple[str, bool]:
        """The step program (:data:`FULL`, :data:`SHORT` or :data:`PLAIN`) the load adapter picks for ``running``
        rows in the occupancy bucket ``rows`` at context ``seq_len`` (None: by the start-up cost table), from their
        expected acceptance (the whole tree without an adapter) -> (it, whether any row samples)."""
        sampled = any(self.rows[i].request.temperature > 0.0 for i in running)
        if self.adapter is None:
            return FULL, sampled
        expected = self.adapter.expected_acceptance(
            [(self.rows[i].acceptance, self.rows[i].measured_steps) for i in running])
        return self.adapter.choose_program(rows, expected, sampled, seq_len), sampled

    def draft_tokens(self, program: str) -> int:
        """Draft tokens a speculative step of ``program`` verifies: the tree's nodes but the root (the short
        chain's for SHORT)."""
        if self.setup.spec is None:  # a plain server's steps draft nothing
            return 0
        if program == SHORT and self.config.short_draft_len:
            return self.config.short_draft_len
        return self.setup.spec.tree_size - 1

    def update_from_output(self, rows: list[int | None], out: paged.Readout, *, program: str | None,
                           owners: list[Running | None] | None = None) -> tuple:
        """Reads a program's readout (waiting for it) into the scheduler's state (tokens committed, the adapter's
        per-row acceptance, grammars advanced, finished rows freed). rows: the program's rows in order (None: an
        idle one); program: the chunk's step program (None: a prefill); owners: the requests that held the rows when the program was dispatched (default: those
        holding them now; a row whose request was preempted or freed since is skipped) -> (the loop steps the
        program ran, (tokens the rows gained, verify steps they took, how many of those committed n tokens at
        index n - 1), a RequestOutput per request that gained tokens or finished (for the output processor), the
        time it was read back)."""
        tokens, num_generated, num_steps, done, hist, step, logprobs = jax.device_get(out)
        now = time.perf_counter()
        speculated = program is not None and program != PLAIN
        # A short chain's acceptance counts as the whole tree's would (the adapter's estimates are the whole's).
        scale = self.adapter.short_ratio() if program == SHORT and self.adapter is not None else 1.0
        chunk_tokens = chunk_steps = 0
        chunk_hist = np.zeros(hist.shape[1:], np.int64)
        outputs = []
        for k, row in enumerate(rows):
            if row is None:  # an idle program row
                continue
            running = self.rows[row]
            if owners is not None and running is not owners[k]:
                continue
            request, pending = running.request, running.pending
            running.generated = int(num_generated[k])
            # The readout's window starts at the row's length before the program, which is first_new: readouts land
            # in dispatch order, so the tokens before it were handed out from the chunk or prefill before.
            first_new = running.context_len + running.emitted
            new = tokens[k, first_new:running.seq_len].tolist()
            steps = int(num_steps[k]) - running.steps_seen
            if program is not None and steps > 0:
                chunk_tokens += len(new)
                chunk_steps += steps
                if speculated:  # hist is cumulative per row: observe this chunk's steps
                    chunk_hist += hist[k] - running.hist_seen
                    self.metrics.observe_acceptance(hist[k] - running.hist_seen, self.draft_tokens(program))
                    if self.adapter is not None:
                        mine = self.adapter.acceptance if running.acceptance is None else running.acceptance
                        running.acceptance = mine + self.adapter.smoothing * (len(new) / steps / scale - mine)
                        running.measured_steps += steps
            if steps > 0:  # the request's own count, which its response reports
                request.spec_steps += steps
                request.spec_accepted += int(np.dot(np.arange(hist.shape[1]), hist[k] - running.hist_seen))
            running.steps_seen, running.hist_seen = int(num_steps[k]), hist[k].copy()
            if new and pending.matcher is not None:
                advance([pending.matcher], np.asarray([new]), np.zeros(1, int), np.asarray([len(new)]))
            if new:
                running.emitted = running.generated
                pending.generated += new
            reason = None
            if done[k]:
                if request.cancelled is not None:
                    reason = request.cancelled
                else:
                    reason = "stop" if pending.generated and pending.generated[-1] in running.stops else "length"
                self.release(row)
            if new or reason is not None:
                outputs.append(RequestOutput(pending, new, reason,
                                             None if logprobs is None else tuple(x[k] for x in logprobs)))
        self.metrics.running.set(self.num_running)
        self.kv.observe_usage()
        return self.runner.steps_ran(step), (chunk_tokens, chunk_steps, chunk_hist), outputs, now
