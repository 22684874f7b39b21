"""SlotEngine: continuous batching over a paged KV cache (vLLM v1's engine core, in front of jspec's fused step).

Its parts, named as vLLM v1 names them: the input processor checks a request (:mod:`jspec.serve.input_processor`);
the scheduler (:mod:`jspec.serve.scheduler`, host only) holds the queue and the rows, the KV cache manager's pages,
preemption and the load adapter's choice, and plans each call; the model runner (:mod:`jspec.serve.model_runner`)
executes a plan on the compiled programs over the KV store; the output processor delivers each request's tokens.
The SlotEngine runs the loop that joins them, on a thread of its own, and the warm-up before it.

The KV of the target and of every drafter with a cache lives in one pool of ``--max-total-tokens`` token slots in
pages of ``--block-size`` (:mod:`jspec.serve.paged`); the host's block manager (:mod:`jspec.serve.block_manager`)
hands pages out. One scheduler thread loops:

1. **admit**: waiting requests, first come first served, while a row (``--max-num-seqs``) and the pages for the
   request's prompt plus one chunk's lookahead are free; all of them prefilled together, one program call per
   prompt-width bucket (at most ``--max-num-batched-tokens`` prompt slots a call); requests arriving meanwhile
   are admitted the same way before the next chunk, up to ``--max-num-batched-tokens`` prompt tokens in all;
2. **reserve**: every running request's pages for one more chunk (its committed tokens, ``steps_per_chunk``
   full steps and the tree window). When the pool runs out, the newest running request is preempted: its pages
   are freed and it goes back to the head of the queue with the tokens it already has, to be prefilled again
   (vLLM's recompute policy): nothing is lost or altered, only recomputed;
3. **step**: one chunk of up to ``steps_per_chunk`` fused steps over the running rows (the occupancy bucket of
   their count, the length bucket holding prompt + max_tokens of each), then each request gets the tokens it
   gained and finished ones free their row and pages. With async scheduling (vLLM's ``--async-scheduling``; by
   default on a GPU or TPU, ``serve_config.default_async_scheduling``) the chunk is dispatched before the one before
   it is read back, where that wastes nothing the host can foresee (``Scheduler.may_overlap``): the host hands
   out the last chunk's tokens, admits and reserves while the device steps (JAX dispatch is asynchronous). The rows'
   state lives in the device's store, so the next chunk needs nothing the host has not read: a row that finished in
   the chunk in flight steps no further (its ``done`` is on the device), pages are reserved two chunks ahead (or the
   chunk in flight is read back first where the pool cannot hold that, so no request is preempted with tokens on the
   way), and a readout is handed only to the request that held the row when its chunk was dispatched (a row freed and
   given to a new request since is skipped).

Programs (one prefill per prompt width and batch bucket, one step program per step kind, occupancy bucket and
length bucket) live in a :class:`jspec.serve.program_cache.ProgramCache`. By default (``precompile="needed"``)
:meth:`SlotEngine.warm_up` compiles those that hold every request (the widest buckets) and those warm-up runs; a
chunk or prefill whose own bucket is missing runs on the smallest compiled one holding it while the cache compiles
its own on a thread of its own, so the scheduler never compiles (``precompile="all"``: every bucket at warm-up).
With load adaptation, warm-up also measures the step programs' costs (``adapt.measure_costs``).

A request's tokens depend only on (prompt, parameters, seed): its key is ``jspec.sampling.seed_keys([seed], 1)``
and each step draws at the request's own positions (``jspec.sampling.keys_at``), never at its row or the loop's
step count. So a request returns what ``SpecEngine.generate([prompt], seed=[seed])`` returns, alone or among
others, greedy or sampled, as long as one step program runs and it is not preempted (with load adaptation or a
preemption, greedy output is unchanged and sampled output keeps the target's distribution, but where the steps
fall changes the draws).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
import threading
import time
from typing import Sequence

from jspec.batching import prompt_bucket
from jspec.config import SEED_RANGE, SamplingParams
from jspec.serve import kv_store, paged
from jspec.serve.adapt import FULL, PLAIN, SHORT, CostTable, LoadAdapter, measure_costs
from jspec.serve.block_manager import BlockManager
from jspec.serve.kv_cache_coordinator import KVCacheCoordinator
from jspec.serve.calibration import calibration_chunks, first_runs
from jspec.serve.kv_cache_manager import KVCacheManager
from jspec.serve.input_processor import InputProcessor
from jspec.serve.metrics import ServeMetrics
from jspec.serve.model_runner import FirstHalf, ModelRunner
from jspec.serve.plans import PrefillPlan
from jspec.serve.output_processor import OutputProcessor
from jspec.serve.requests import Flight, NotAccepting, Pending, QueueFull, Request, Running, deliver, uses_api_features
from jspec.serve.scheduler import Scheduler
from jspec.serve.serve_config import serve_config

logger = logging.getLogger("jspec.serve")

CHUNK_LABELS = {FULL: "speculative", SHORT: "speculative_short", PLAIN: "plain"}  # jspec:chunks' program label
# A structured step's label, by the program it masks (a plain server's: "structured").
STRUCTURED_LABELS = {FULL: "structured", SHORT: "structured_short", PLAIN: "structured_plain"}


class SlotEngine:
    """Serves a :class:`jspec.SpecEngine`'s model and drafter with continuous batching over a paged KV cache
    (module docstring).

    engine: the offline engine (its weights, drafter and setup are reused as placed); options: the server's
    settings, :func:`jspec.serve.serve_config.serve_config`'s arguments (what each means, their defaults).
    """

    runner_class = ModelRunner  # what runs the programs (tests run the scheduler over host programs)

    def __init__(self, engine, **options):
        self.engine = engine
        self.config, self.setup = serve_config(engine, **options)
        for field in dataclasses.fields(self.config):  # read as the scheduler's own settings
            if field.name != "max_total_tokens":
                setattr(self, field.name, getattr(self.config, field.name))
        self._max_total_tokens = self.config.max_total_tokens  # known after warm_up() where not given
        self.metrics = ServeMetrics(self.setup.tokens_per_step)
        self.input_processor = InputProcessor(self.config, self.setup, engine.tokenizer, engine.config.vocab_size)
        self.output_processor = OutputProcessor(self.metrics)
        self.costs: CostTable | None = None
        self.layout: kv_store.PagedLayout | None = None
        self.blocks: KVCacheCoordinator | None = None
        self.runner = self.runner_class(engine, self.setup, self.config, ways_out=(
            "a smaller --max-num-seqs or --max-seq-len (fewer buckets), without --warm-up-structured-outputs"))
        self.metrics.watch_programs(self.runner.programs)
        self.scheduler = Scheduler(self.config, self.setup, self.metrics, self.runner)
        self._accepting = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._flight: Flight | None = None  # the chunk dispatched and not read back (async scheduling)
        self._landed = 0.0  # time.perf_counter() when the last chunk was read back
        # A structured step's next first half, in flight over its rows, and the requests that held them
        # (``ModelRunner.structured_step``); a chunk drops it.
        self._ahead: tuple[FirstHalf, list[Running | None]] | None = None
        self.ready = False

    # --- requests ----------------------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raises ValueError naming the bad value (the server answers 400) before the request is queued
        (``InputProcessor.check``)."""
        self.input_processor.check(request)

    def submit(self, request: Request) -> Request:
        """Queues a request (checked first: ValueError); QueueFull / NotAccepting when it cannot be taken."""
        self.check(request)
        if request.seed is None:
            request.seed = secrets.randbelow(SEED_RANGE)
        with self._lock:
            if not self._accepting:
                raise NotAccepting("the server is not accepting requests (starting up or shutting down)")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (--max-queue {self.max_queue})")
            self._waiting.append(Pending(request, matcher=None if request.structured_outputs is None else
                                          self.input_processor.matcher(request.structured_outputs)))
            self.metrics.waiting.set(len(self._waiting))
            self._lock.notify()
        return request

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def flush_prefix_cache(self) -> bool:
        """Forgets the prefix cache's pages while no request runs or waits (SGLang's /flush_cache) -> whether it
        did; False, changing nothing, while requests are in the server."""
        with self._lock:
            if self.blocks is None or self.num_running or self._waiting:
                return False
            self.blocks.flush_cache()
            return True

    def load(self) -> dict:
        """What a router weighs replicas by (SGLang's /get_load): requests running and waiting, and the token
        slots their pages hold."""
        used = 0 if self.blocks is None else self.blocks.num_used_pages * self.block_size
        return {"dp_rank": 0, "num_reqs": self.num_running + self.num_waiting, "num_waiting_reqs": self.num_waiting,
                "num_tokens": used}

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def _waiting(self):
        return self.scheduler.waiting

    @property
    def _rows(self) -> list[Running | None]:
        return self.scheduler.rows

    @property
    def _lock(self) -> threading.Condition:
        return self.scheduler.lock

    @property
    def adapter(self) -> LoadAdapter | None:
        """The load adapter choosing each chunk's step program (the scheduler's; None without load adaptation)."""
        return self.scheduler.adapter

    @adapter.setter
    def adapter(self, adapter: LoadAdapter | None) -> None:
        self.scheduler.adapter = adapter

    @property
    def num_compiled(self) -> int:
        """Programs compiled: at :meth:`warm_up`, and since on the compiling thread (``precompile="needed"``)."""
        return len(self.runner.programs)

    @property
    def max_total_tokens(self) -> int:
        """The KV pool in token slots (known after :meth:`warm_up` when not given)."""
        return self._max_total_tokens

    # --- start and stop -----------------------------------------------------------------------------------------

    def warm_up(self, calibration_prompt: Sequence[int] | None = None) -> CostTable | None:
        """Sizes the KV pool, compiles every program, measures the cost table (with load adaptation:
        ``adapt.measure_costs``, on ``calibration_prompt``), then starts accepting."""
        self.layout, self._max_total_tokens = self.runner.plan(self._max_total_tokens)
        num_pages = self.layout.num_pages
        window = None
        if self.layout.window:
            window = BlockManager(self.layout.window_pages, self.block_size, enable_prefix_caching=self.prefix_caching)
        self.blocks = KVCacheCoordinator(BlockManager(num_pages, self.block_size,
                                                      enable_prefix_caching=self.prefix_caching),
                                         window, self.layout.window)
        self.runner.allocate(self.blocks)
        self.scheduler.kv = KVCacheManager(self.blocks, self.runner, self.metrics, self.config,
                                           self.setup.tokens_per_step)
        logger.info("KV pools: %d pages of %d token slots (%d tokens), %d rows, %.0f bytes per token: %s", num_pages - 1,
                    self.block_size, (num_pages - 1) * self.block_size, self.max_num_seqs,
                    self.layout.bytes_per_token(), "; ".join(pool.describe() for pool in self.layout.pools))
        if window is not None:
            logger.info("sliding window %d: its layers' K/V in %d pages of their own (%d tokens; a request holds "
                        "its window's)", self.layout.window, self.layout.window_pages - 1,
                        (self.layout.window_pages - 1) * self.block_size)
        real = list(calibration_prompt) if calibration_prompt else list(range(1, 17))
        structured = self.runner.masked_programs_per_bucket() * len(self.row_buckets) * len(self.seq_buckets)
        began = time.perf_counter()
        self.runner.compile_up_front(real, structured if self.warm_up_structured_outputs else 0)
        logger.info("compiled %d programs in %.1f s", len(self.runner.programs), time.perf_counter() - began)
        began = time.perf_counter()
        first_runs(self.runner, real)
        logger.info("ran every program once in %.1f s", time.perf_counter() - began)
        if self.warm_up_structured_outputs:
            began = time.perf_counter()
            self.runner.warm_structured()
            logger.info("compiled and ran the structured-output programs in %.1f s", time.perf_counter() - began)
        if self.adapt:
            began = time.perf_counter()
            # Costs with every row on its own rotation of the prompt: under load some row always drafts, so a
            # verify pass runs every step (rows all alike would draft, or skip the verify pass, all at once).
            chunks = calibration_chunks(self.runner, real, rotate=True)
            self.costs = measure_costs(chunks, self.row_buckets, self.steps_per_chunk, repeats=1,
                                       short_rows=self.short_row_buckets)
            chunks.release()
            chunks = calibration_chunks(self.runner, real)
            sample = chunks(FULL, self.row_buckets[0], 3 * self.steps_per_chunk, False)
            chunks.release()
            acceptance = sample.tokens / max(sample.verify_steps, 1)
            self.scheduler.adapter = LoadAdapter(self.costs, acceptance, max_acceptance=self.setup.tokens_per_step,
                                       short_draft_len=self.short_draft_len, accepted_hist=sample.accepted_hist)
            logger.info("cost table %s, starting acceptance %.2f (%.1f s)", self.costs.to_dict(), acceptance,
                        time.perf_counter() - began)
        self.metrics.kv_cache_usage.set(0.0)
        self.ready = self._accepting = True
        return self.costs

    def start(self) -> None:
        """Starts the scheduler thread (after :meth:`warm_up`)."""
        if not self.ready:
            raise RuntimeError("warm_up() first")
        self._thread = threading.Thread(target=self._serve, name="jspec-slots", daemon=True)
        self._thread.start()

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops admitting; lets waiting and running requests finish for up to ``timeout`` seconds, then aborts
        what is left; joins the scheduler thread."""
        self.stop_accepting()
        deadline = time.monotonic() + timeout
        with self._lock:
            while (self._waiting or self.num_running) and time.monotonic() < deadline and self._thread is not None:
                self._lock.wait(0.05)
            for pending in self._waiting:
                pending.request.cancel()
            for running in self._rows:
                if running is not None:
                    running.request.cancel()
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout=60.0)
        self.runner.programs.stop()

    # --- the scheduler ------------------------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stopping and not self._waiting and not self.num_running:
                        self._lock.wait()
                    if self._stopping and not self.num_running and not self._waiting:
                        break
                    land_first = self._flight is not None and not self.scheduler.may_overlap(self._flight)
                if land_first:  # outside the lock: submit() must not wait on the device
                    self._land()
                with self._lock:
                    admitted = self.scheduler.take_waiting()
                prefilled = 0
                while admitted:
                    prefilled += self._admit(admitted)
                    if prefilled >= self.max_num_batched_tokens:
                        break
                    # Requests that arrived during that prefill are prefilled before the next chunk (a burst's
                    # later arrivals would otherwise wait a whole chunk for their first token), within one
                    # --max-num-batched-tokens budget so the running rows are not held back longer.
                    with self._lock:
                        admitted = self.scheduler.take_waiting()
                if self.piece_width:
                    self._continue_prefills(self.max_num_batched_tokens - prefilled)
                if self.num_running:
                    self._chunk()
                with self._lock:
                    self._lock.notify_all()  # shutdown() waits on the count
                    if self._stopping and not self.num_running and not self._waiting:
                        break
            self._land()
        except Exception:  # a bug, not a request: end every request rather than hang its client
            logger.exception("the scheduler failed")
            for running in self._rows:
                if running is not None:
                    deliver(running.request, [], "abort")
            with self._lock:
                for pending in self._waiting:
                    deliver(pending.request, [], "abort")
                self._waiting.clear()
                self._accepting = False
            raise

    def _admit(self, admitted: list[tuple[int, Running]]) -> int:
        """Prefills the admitted requests, grouped by prompt-width bucket, as many at once as a program takes ->
        the prompt tokens computed (cached ones not counted)."""
        groups: dict[tuple[int, bool], list[tuple[int, Running]]] = collections.defaultdict(list)
        computed = 0
        for row, running in admitted:
            self._rows[row] = running
            self.scheduler.kv.hold(row, running)
            request = running.request
            if request.prompt_logprobs and request.scored_prompt is None:
                request.scored_prompt = self.runner.score_prompt(request.prompt_ids, request.logprobs)
            if not running.pending.generated:
                self.metrics.prompt_tokens.inc(running.context_len)
            rest = running.context_len - running.cached
            if self.piece_width and rest > self.piece_width:
                running.prefilled = running.cached  # prefilled in pieces (:meth:`_continue_prefills`)
                continue
            computed += rest
            width = prompt_bucket(rest, self.max_prompt_width, half_steps=False)
            groups[width, running.cached > 0].append((row, running))
        start = time.perf_counter()
        for (width, hit), group in groups.items():
            widest = self.runner.widest_cached([r.cached for _, r in group] if hit else None)
            for part in self.runner.prefill_parts("prefill_cached" if hit else "prefill", group, width, widest):
                items = [(r.pending.context[r.cached:], dataclasses.replace(r.request.sampling_params(),
                                                                            max_new_tokens=r.pending.budget))
                         for _, r in part]
                out = self._prefill(items, width, [row for row, _ in part], [r.cached for _, r in part] if hit
                                    else None, [r.context_len for _, r in part])
                began = time.perf_counter()  # after the chunk before it is read back (in _prefill)
                for _, running in part:
                    self.scheduler.kv.register(running)
                self._update_from_output([row for row, _ in part], out, program=None, chunk_start=start)
                self.metrics.busy_seconds.labels("prefill").inc(time.perf_counter() - began)
        self.metrics.running.set(self.num_running)
        return computed

    def _continue_prefills(self, budget: int) -> None:
        """Prefills the next piece of prompts prefilled in pieces (chunked prefill), oldest first, while the
        ``budget`` of prompt tokens lasts (one piece at least, so a long prompt always advances). A piece is one
        cached-prefill call over ``piece_width`` tokens from the row's ``prefilled`` (whole pages) on; its readout
        is dropped (its sampled token is overwritten by the next piece). The last piece is a cached prefill of the
        rest, after which the row steps in chunks."""
        pending = sorted((i for i, r in enumerate(self._rows) if r is not None and r.prefilled is not None),
                         key=lambda i: self._rows[i].order)
        spent = 0
        for row in pending:
            running = self._rows[row]
            if running.request.cancelled is not None:
                self.scheduler.release(row)
                self.metrics.requests.labels(running.request.cancelled).inc()
                deliver(running.request, [], running.request.cancelled)
                continue
            if spent and spent + self.piece_width > budget:
                break
            if not self.scheduler.kv.advance(row, running):
                break  # the window group's pages for this piece: once running rows free theirs
            start, end = running.prefilled, running.prefilled + self.piece_width
            if end < running.context_len:  # a middle piece
                params = dataclasses.replace(running.request.sampling_params(), max_new_tokens=1)
                self._prefill([(running.pending.context[start:end], params)], self.piece_width, [row], [start],
                              [end])
                began = time.perf_counter()
                # The head of a drafter reading target states pairs slot p with token p + 1: the piece's last
                # page is computed again with the next piece (as a prefix-cache hit's is).
                running.prefilled = end - (self.block_size if self.drop_last_hit else 0)
                spent += self.piece_width
            else:
                width = prompt_bucket(running.context_len - start, self.max_prompt_width, half_steps=False)
                running.prefilled = None
                out = self._prefill([(running.pending.context[start:], dataclasses.replace(
                    running.request.sampling_params(), max_new_tokens=running.pending.budget))], width, [row],
                    [start], [running.context_len])
                began = time.perf_counter()
                self.scheduler.kv.register(running)
                self._update_from_output([row], out, program=None, chunk_start=began)
                spent += width
            self.metrics.busy_seconds.labels("prefill").inc(time.perf_counter() - began)

    def _prefill(self, items: list[tuple[list[int], SamplingParams]], width: int, rows: list[int],
                 cached: list[int] | None, lengths: list[int]) -> paged.Readout:
        """One prefill program call (``ModelRunner.prefill``) of ``items`` into ``rows``, which hold their requests
        already (their history and grammars go with them) -> the readout (in flight). The chunk in flight before
        it, if any, is read back first."""
        history = [(None, 0) if self._rows[row] is None else
                   (self._rows[row].request.prompt_ids, len(self._rows[row].pending.generated)) for row in rows]
        matchers = [None if self._rows[row] is None else self._rows[row].pending.matcher for row in rows]
        out = self.runner.prefill(PrefillPlan(tuple(items), width, tuple(rows), None if cached is None else
                                              tuple(cached), tuple(lengths), tuple(history), tuple(matchers)))
        self._land()  # readouts are read in dispatch order: the chunk before this prefill first
        return out

    def _cancelled(self, running: list[int]) -> list[bool]:
        return [self._rows[i].request.cancelled is not None for i in running]

    def _chunk(self) -> None:
        """Dispatches a chunk over the running rows, then reads back the one in flight before it (async
        scheduling) or this one (not)."""
        self.scheduler.reserve(self._flight is not None, self._land)
        running = [i for i, row in enumerate(self._rows) if row is not None and row.prefilled is None]
        if any(self._rows[i].pending.matcher is not None for i in running):
            self._land()
            self._structured_step(running)
            return
        if self._ahead is not None:  # its logits are stale once a chunk commits (its K/V writes are the chunk's)
            self.metrics.structured_ahead.labels("dropped").inc()
            self._ahead = None
        flight = self._dispatch(running) if running else None
        self._land()
        self._flight = flight
        if not self.async_scheduling or not self.num_running:  # nobody left to step: nothing to overlap
            self._land()

    def _structured_step(self, running: list[int]) -> None:
        """One step over ``running`` rows when any of them has a grammar (``ModelRunner.structured_step``: the
        masked form of the program the load adapter picks, by its start-up costs: a plain step under each row's
        mask, or every node a speculative step verifies masked from its path's grammar state), read back at once.
        Its first half (the target's pass, or the proposal) may have been dispatched by the step before, over rows
        among which every running one is with the request it ran then; it dispatches the next one's before its
        readout. Its acceptance feeds the adapter; its time does not (a masked step waits on the host between
        programs)."""
        start = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            first, owners = ahead
            held = {row: owner for row, owner in zip(first.rows, owners) if row is not None}
            ahead = first if all(held.get(i) is self._rows[i] for i in running) else None
            if ahead is None:
                self.metrics.structured_ahead.labels("dropped").inc()
        rows = next(r for r in self.row_buckets if r >= len(running))
        program, _ = self.scheduler.choose_program(running, rows, None)
        step = self.runner.structured_step(
            running, self._cancelled(running), max(self._rows[i].need for i in running),
            [self._rows[i].pending.matcher for i in running],
            greedy=all(self._rows[i].request.temperature <= 0.0 for i in running), program=program,
            lean=not any(uses_api_features(self._rows[i].request) for i in running), ahead=ahead)
        if ahead is not None:
            self.metrics.structured_ahead.labels("used" if step.used_ahead else "dropped").inc()
        owners = [None if i is None else self._rows[i] for i in step.rows]
        if step.ahead is not None:
            self._ahead = (step.ahead, owners)
        _, (tokens, verify_steps, _) = self._update_from_output(step.rows, step.readout, program=step.program,
                                                                chunk_start=start, owners=owners)
        self._landed = time.perf_counter()
        if self.adapter is not None:
            self.adapter.observe(step.program, tokens, verify_steps)
        self.metrics.observe_chunk(STRUCTURED_LABELS[step.program] if self.speculative else "structured",
                                   self._landed - start, 1)
        self.metrics.busy_seconds.labels("step").inc(self._landed - start)

    def _dispatch(self, running: list[int]) -> Flight:
        """Calls the step program the scheduler plans over ``running`` rows (not waiting for it) -> its flight."""
        plan, sampled = self.scheduler.plan_step(running)
        dispatched = time.perf_counter()
        out = self.runner.step(plan)
        return Flight(running, [self._rows[i] for i in running], out, plan.program, plan.bucket, plan.seq_len,
                      sampled, dispatched)

    def _land(self) -> None:
        """Reads back the chunk in flight, if any (waiting for it), hands its rows' requests their tokens and
        feeds its time to the metrics and the adapter. Its seconds run from its dispatch or the last chunk's
        readout, whichever is later: the device steps it from then on."""
        flight, self._flight = self._flight, None
        if flight is None:
            return
        start = max(flight.dispatched, self._landed)
        steps, (tokens, verify_steps, hist) = self._update_from_output(flight.rows, flight.out, program=flight.program,
                                                         chunk_start=start, owners=flight.owners)
        self._landed = time.perf_counter()
        seconds = self._landed - start
        program = flight.program
        self.metrics.observe_chunk(CHUNK_LABELS[program] if self.speculative else "plain", seconds, steps)
        self.metrics.busy_seconds.labels("step").inc(seconds)
        if self.adapter is not None:
            if program == FULL:
                self.adapter.observe_accepted(hist)
            self.adapter.observe(program, tokens, verify_steps, rows=flight.bucket, seconds=seconds,
                                 loop_steps=steps, sampled=flight.sampled, seq_len=flight.seq_len)

    def _update_from_output(self, rows: list[int], out: paged.Readout, *, program: str | None, chunk_start: float,
                            owners: list[Running] | None = None) -> tuple:
        """The scheduler's update from a program's readout (``Scheduler.update_from_output``, waiting for it); the
        requests that gained tokens or finished go to the output processor -> (the loop steps the program ran,
        the chunk's (tokens, verify steps, acceptance histogram))."""
        steps, stats, outputs, now = self.scheduler.update_from_output(rows, out, program=program, owners=owners)
        self.output_processor.process(outputs, now=now, chunk_seconds=0.0 if program is None else now - chunk_start)
        return steps, stats
