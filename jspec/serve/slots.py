"""SlotEngine: continuous batching over ``max_batch_size`` slots of one donated decode state.

One scheduler thread loops: admit waiting requests into free slots (one jitted prefill-and-insert each,
``programs.admit``), run one jitted chunk of up to ``steps_per_chunk`` fused steps over all slots
(``programs.run_chunk``) over the occupancy bucket (the lowest power of two of slots holding every busy one),
hand each request the tokens it gained, free the slots that finished. Every program is compiled ahead of time in
:meth:`SlotEngine.warm_up` (``programs.compile_programs``: one admit per prompt width of ``jspec.batching``, the
engine's own buckets, one chunk per step program, occupancy bucket and length bucket), so serving compiles nothing.
With load adaptation, warm-up also measures the step programs' costs (``adapt.measure_costs``).

A request's tokens depend only on (prompt, parameters, seed): its key is ``jspec.sampling.seed_keys([seed], 1)``
and each step draws at the request's own positions (``jspec.sampling.keys_at``), never at its slot or the loop's
step count. So a
request returns what ``SpecEngine.generate([prompt], seed=[seed])`` returns, alone or among others, greedy or
sampled, as long as one step program runs (with load adaptation on, greedy output is unchanged and sampled output
keeps the target's distribution, but which program ran a step changes the draws).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import secrets
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.batching import MIN_SEQ_BUCKET, compile_buckets, next_power_of_two, prompt_bucket, prompt_buckets
from jspec.config import SEED_RANGE, SamplingParams, check_seed, check_token_ids
from jspec.serve.adapt import CostTable, LoadAdapter, TimedChunk, measure_costs
from jspec.serve.metrics import ServeMetrics
from jspec.serve.programs import admit_row, compile_programs, idle_slots
from jspec.sharding import put

logger = logging.getLogger("jspec.serve")

Sink = Callable[[list[int], "str | None"], None]  # (new token ids, finish_reason or None while running)


class QueueFull(Exception):
    """The waiting queue holds max_queue requests (HTTP 503)."""


class NotAccepting(Exception):
    """The server is shutting down (or not warm yet) and takes no new requests (HTTP 503)."""


@dataclasses.dataclass
class Request:
    """A request. prompt_ids: its tokens; max_tokens: new tokens at most; temperature, top_k, top_p, seed,
    stop_token_ids: as ``jspec.SamplingParams`` has them (:meth:`sampling_params`), but seed None draws one when
    the request is submitted, and stop_token_ids come besides the model's EOS; sink: called from the scheduler
    thread with the tokens the request gained and, last, its finish reason ("stop", "length" or "abort")."""

    prompt_ids: list[int]
    max_tokens: int
    sink: Sink
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: str | None = None  # the finish reason asked for by cancel()

    def cancel(self, reason: str = "abort") -> None:
        """Ends the request at the next chunk boundary (its slot is freed within one chunk)."""
        if self.cancelled is None:
            self.cancelled = reason

    def sampling_params(self) -> SamplingParams:
        """The request's parameters as the offline engine takes them (and checks them: ValueError); seed None
        stands as 0."""
        return SamplingParams(max_new_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=0 if self.seed is None else self.seed,
                              stop_token_ids=tuple(self.stop_token_ids))


@dataclasses.dataclass
class _Running:
    request: Request
    prompt_len: int
    stops: frozenset[int]
    emitted: int = 0        # tokens handed to the sink
    steps_seen: int = 0     # verify steps already counted
    hist_seen: np.ndarray | int = 0  # accepted_hist already counted
    first_token_at: float | None = None

    @property
    def need(self) -> int:
        """Token slots the request needs: prompt + max_tokens."""
        return self.prompt_len + self.request.max_tokens


class SlotEngine:
    """Serves a :class:`jspec.SpecEngine`'s model and drafter with continuous batching (module docstring).

    engine: the offline engine (its weights, drafter and setup are reused as placed); max_seq_len: token slots per
    request (prompt + max_tokens), at most the engine's; max_queue: waiting requests before 503;
    steps_per_chunk: K, the steps one chunk runs at most (the streaming and admission granularity);
    adapt: choose per chunk between speculative and plain steps (:mod:`jspec.serve.adapt`); max_stop_ids:
    stop token ids per request (EOS included); row_buckets: the occupancy buckets a chunk may step (ascending,
    the last one max_batch_size; default: powers of two, then max_batch_size), one compiled chunk program per
    bucket and step program (vLLM's cudagraph capture sizes play this part); seq_buckets: likewise the context
    lengths a chunk may run at (the last one max_seq_len; default: powers of two from 256, then max_seq_len): a
    chunk runs at the smallest one holding prompt + max_tokens of every request in its rows.
    """

    def __init__(self, engine, *, max_seq_len: int | None = None, max_queue: int = 256, steps_per_chunk: int = 4,
                 adapt: bool = True, max_stop_ids: int = 8, row_buckets: Sequence[int] | None = None,
                 seq_buckets: Sequence[int] | None = None):
        max_seq_len = engine.setup.max_seq_len if max_seq_len is None else max_seq_len
        for name, value, low in (("max_queue", max_queue, 0), ("steps_per_chunk", steps_per_chunk, 1),
                                 ("max_stop_ids", max_stop_ids, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r}: expected an integer >= {low}")
        if not isinstance(max_seq_len, int) or not 2 <= max_seq_len <= engine.setup.max_seq_len:
            raise ValueError(f"max_seq_len={max_seq_len!r}: expected an integer in [2, "
                             f"{engine.setup.max_seq_len}] (the engine's max_seq_len)")
        if engine.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={engine.data_parallel_size}: the server runs one replica; "
                             f"use tensor parallelism (-tp), or one server per data-parallel group")
        self.engine = engine
        self.setup = engine.setup.with_max_seq_len(max_seq_len)
        self.max_seq_len = max_seq_len
        self.num_slots = engine.max_batch_size
        self.max_queue = max_queue
        self.steps_per_chunk = steps_per_chunk
        self.num_stop_ids = next_power_of_two(max_stop_ids)
        self.speculative = self.setup.drafter is not None
        self.adapt = adapt and self.speculative
        self.eos_token_ids = tuple(engine.eos_token_ids)
        self.max_prompt_width = max_seq_len - 1  # a prompt leaves room for one new token
        self.widths = prompt_buckets(self.max_prompt_width, half_steps=False)
        self.row_buckets = compile_buckets("row_buckets", row_buckets, first=1, last=self.num_slots,
                                           last_name="max_batch_size")
        self.seq_buckets = compile_buckets("seq_buckets", seq_buckets, first=MIN_SEQ_BUCKET, last=max_seq_len,
                                           last_name="max_seq_len")
        self.metrics = ServeMetrics(self.setup.tokens_per_step)
        self.costs: CostTable | None = None
        self.adapter: LoadAdapter | None = None
        self._compiled: dict[tuple, object] = {}
        self._waiting: collections.deque[Request] = collections.deque()
        self._slots: list[_Running | None] = [None] * self.num_slots
        self._lock = threading.Condition()
        self._accepting = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._state = self._inputs = None
        self._host_step = 0  # the state's loop step counter, as last read back
        self.ready = False

    # --- requests ----------------------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raises ValueError naming the bad value (the server answers 400) before the request is queued."""
        ids, vocab = request.prompt_ids, self.engine.config.vocab_size
        if not ids:
            raise ValueError("the prompt is empty: expected at least one token")
        check_token_ids(ids, vocab, "the prompt")
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise ValueError(f"max_tokens={request.max_tokens!r}: expected an integer >= 1")
        if len(ids) + request.max_tokens > self.max_seq_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; with max_tokens={request.max_tokens} that exceeds "
                             f"the context of {self.max_seq_len} tokens (--max-seq-len)")
        params = request.sampling_params()
        if len(set(self.eos_token_ids) | set(params.stop_token_ids)) > self.num_stop_ids:
            raise ValueError(f"{len(params.stop_token_ids)} stop_token_ids: at most "
                             f"{self.num_stop_ids - len(self.eos_token_ids)} besides EOS")
        check_token_ids(params.stop_token_ids, vocab, "stop_token_ids")
        if request.seed is not None:
            check_seed(request.seed)

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
            self._waiting.append(request)
            self.metrics.waiting.set(len(self._waiting))
            self._lock.notify()
        return request

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return sum(slot is not None for slot in self._slots)

    @property
    def num_compiled(self) -> int:
        """Programs compiled: all of them in :meth:`warm_up`, none after."""
        return len(self._compiled)

    # --- start and stop -----------------------------------------------------------------------------------------

    def warm_up(self, calibration_prompt: Sequence[int] | None = None) -> CostTable | None:
        """Compiles every program (``programs.compile_programs``), measures the cost table (with load adaptation:
        ``adapt.measure_costs``, on ``calibration_prompt``), then starts accepting."""
        args = (self.engine.params, self.engine.drafter_params)
        self._state, self._inputs = idle_slots(*args, setup=self.setup, num_slots=self.num_slots,
                                               num_stop_ids=self.num_stop_ids)
        rows = {width: self._admit_row([0], SamplingParams(max_new_tokens=1), width) for width in self.widths}
        examples = (self._place(np.zeros((), np.int32)), self._place(np.zeros((self.num_slots,), bool)),
                    self._place(np.asarray(self.steps_per_chunk, np.int32)))  # slot, cancel, max_steps
        self._compiled.update(compile_programs(
            *args, self._state, self._inputs, rows, *examples, setup=self.setup,
            step_kinds=(True, False) if self.speculative else (True,), row_buckets=self.row_buckets,
            seq_buckets=self.seq_buckets))
        if self.adapt:
            self.costs, acceptance = measure_costs(self._calibration_chunks(calibration_prompt), self.row_buckets,
                                                   self.steps_per_chunk)
            self.adapter = LoadAdapter(self.costs, acceptance)
            logger.info("cost table %s, starting acceptance %.2f", self.costs.to_dict(), acceptance)
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
            for request in self._waiting:
                request.cancel()
            for running in self._slots:
                if running is not None:
                    running.request.cancel()
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout=60.0)

    # --- the scheduler ------------------------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stopping and not self._waiting and not self.num_running:
                        self._lock.wait()
                    if self._stopping and not self.num_running and not self._waiting:
                        return
                    admitted = self._take_waiting()
                if admitted:
                    self._admit(admitted)
                if self.num_running:
                    self._chunk()
                with self._lock:
                    self._lock.notify_all()  # shutdown() waits on the count
                    if self._stopping and not self.num_running and not self._waiting:
                        return
        except Exception:  # a bug, not a request: end every request rather than hang its client
            logger.exception("the scheduler failed")
            for running in self._slots:
                if running is not None:
                    _safe_sink(running.request, [], "abort")
            with self._lock:
                for request in self._waiting:
                    _safe_sink(request, [], "abort")
                self._waiting.clear()
                self._accepting = False
            raise

    def _take_waiting(self) -> list[tuple[int, Request]]:
        """Pairs waiting requests (FIFO) with free slots; drops cancelled ones. Under the lock."""
        free = [i for i, slot in enumerate(self._slots) if slot is None]
        taken = []
        while self._waiting and len(taken) < len(free):
            request = self._waiting.popleft()
            if request.cancelled is not None:
                _safe_sink(request, [], request.cancelled)
                continue
            taken.append((free[len(taken)], request))
        self.metrics.waiting.set(len(self._waiting))
        return taken

    def _admit(self, admitted: list[tuple[int, Request]]) -> None:
        for slot, request in admitted:
            params = request.sampling_params()
            width = prompt_bucket(len(request.prompt_ids), self.max_prompt_width, half_steps=False)
            self._admit_into(slot, width, self._admit_row(request.prompt_ids, params, width))
            self._slots[slot] = _Running(request, len(request.prompt_ids),
                                         frozenset(self.eos_token_ids + params.stop_token_ids))
            self.metrics.prompt_tokens.inc(len(request.prompt_ids))
        self.metrics.running.set(self.num_running)
        self._emit(None, speculated=None)

    def _chunk(self) -> None:
        cancel = np.array([slot is not None and slot.request.cancelled is not None for slot in self._slots])
        busy = max(i for i, slot in enumerate(self._slots) if slot is not None) + 1
        rows = next(r for r in self.row_buckets if r >= busy)
        need = max(slot.need for slot in self._slots[:rows] if slot is not None)
        seq_len = next(n for n in self.seq_buckets if n >= need)
        # a plain server has one program per bucket
        speculate = self.adapter.choose(rows) if self.adapter is not None else True
        start = time.perf_counter()
        step_before = self._host_step
        self._run_chunk(speculate, rows, seq_len, cancel, self.steps_per_chunk)
        self._emit(start, speculated=speculate)  # waits for the chunk
        seconds, steps = time.perf_counter() - start, self._host_step - step_before
        self.metrics.observe_chunk("speculative" if self.speculative and speculate else "plain", seconds, steps)

    def _emit(self, chunk_start: float | None, speculated: bool | None) -> None:
        """Reads the slots back (waiting for the programs in flight), hands each request its new tokens, frees
        finished slots. chunk_start: when the chunk was launched (None after admissions)."""
        tokens, num_generated, done, num_steps, hist, step = jax.device_get(
            (self._state.tokens, self._state.num_generated, self._state.done, self._state.num_steps,
             self._state.accepted_hist, self._state.step))
        self._host_step = int(step)
        now = time.perf_counter()
        chunk_seconds = 0.0 if chunk_start is None else now - chunk_start
        chunk_tokens = chunk_steps = 0
        for slot, running in enumerate(self._slots):
            if running is None:
                continue
            request, generated = running.request, int(num_generated[slot])
            new = tokens[slot, running.prompt_len + running.emitted:running.prompt_len + generated].tolist()
            steps = int(num_steps[slot]) - running.steps_seen
            if speculated is not None and steps > 0:
                chunk_tokens += len(new)
                chunk_steps += steps
                if speculated:  # hist is cumulative per request: observe this chunk's steps
                    self.metrics.observe_acceptance(hist[slot] - running.hist_seen)
            running.steps_seen, running.hist_seen = int(num_steps[slot]), hist[slot].copy()
            if new:
                waited = None
                if running.first_token_at is None:
                    running.first_token_at = now
                    waited = now - request.arrival
                self.metrics.observe_tokens(len(new), waited=waited, chunk_seconds=chunk_seconds)
                running.emitted = generated
            reason = None
            if done[slot]:
                if request.cancelled is not None:
                    reason = request.cancelled
                else:
                    last = int(tokens[slot, running.prompt_len + generated - 1]) if generated else -1
                    reason = "stop" if last in running.stops else "length"
                self._slots[slot] = None
                self.metrics.requests.labels(reason).inc()
            if new or reason is not None:
                _safe_sink(request, new, reason)
        if speculated is not None and self.adapter is not None:
            self.adapter.observe(speculated and self.speculative, chunk_tokens, chunk_steps)
        self.metrics.running.set(self.num_running)

    # --- helpers ------------------------------------------------------------------------------------------------

    def _admit_row(self, prompt_ids: Sequence[int], params: SamplingParams, width: int) -> tuple:
        """``programs.admit_row`` for a request, placed (its stop ids: EOS and its own)."""
        row = admit_row(prompt_ids, params, self.eos_token_ids + params.stop_token_ids, width=width,
                        num_stop_ids=self.num_stop_ids)
        return jax.tree.map(self._place, row)

    def _admit_into(self, slot: int, width: int, row: tuple) -> None:
        self._state, self._inputs = self._compiled["admit", width](
            self.engine.params, self.engine.drafter_params, self._state, self._inputs, *row,
            self._place(np.asarray(slot, np.int32)))

    def _run_chunk(self, speculate: bool, rows: int, seq_len: int, cancel: np.ndarray, steps: int) -> None:
        self._state = self._compiled["chunk", speculate, rows, seq_len](
            self.engine.params, self.engine.drafter_params, self._state, self._inputs, self._place(cancel),
            self._place(np.asarray(steps, np.int32)))

    def _place(self, array: np.ndarray) -> jax.Array:
        """On a mesh: replicated over it (the compiled programs expect their inputs there)."""
        if self.setup.mesh is None:
            return jnp.asarray(array)
        return put(array, jax.sharding.NamedSharding(self.setup.mesh, jax.sharding.PartitionSpec()))

    def _calibration_chunks(self, prompt: Sequence[int] | None) -> Callable[[bool, int, int], TimedChunk]:
        """The timed chunks ``adapt.measure_costs`` calls: each admits ``prompt`` (greedy, a budget of three
        chunks at full acceptance) into the slots of its occupancy bucket, runs one chunk at the length bucket
        holding prompt and budget, and frees every slot."""
        prompt = list(prompt) if prompt else list(range(1, 17))
        budget = max(1, min(self.max_seq_len // 2, 3 * self.steps_per_chunk * self.setup.tokens_per_step))
        prompt = prompt[:self.max_seq_len - budget]
        width = prompt_bucket(len(prompt), self.max_prompt_width, half_steps=False)
        seq_len = next(n for n in self.seq_buckets if n >= len(prompt) + budget)
        row = self._admit_row(prompt, SamplingParams(max_new_tokens=budget), width)

        def timed_chunk(speculate: bool, rows: int, steps: int) -> TimedChunk:
            for slot in range(rows):
                self._admit_into(slot, width, row)
            step_before, generated_before = jax.device_get((self._state.step, self._state.num_generated))
            start = time.perf_counter()
            self._run_chunk(speculate, rows, seq_len, np.zeros((self.num_slots,), bool), steps)
            steps_run = int(self._state.step) - int(step_before)
            seconds = time.perf_counter() - start
            generated, verify_steps = jax.device_get((self._state.num_generated, self._state.num_steps))
            self._run_chunk(speculate, self.num_slots, self.max_seq_len, np.ones((self.num_slots,), bool), steps)
            return TimedChunk(seconds, steps_run, int(generated[:rows].sum() - generated_before[:rows].sum()),
                              int(verify_steps[:rows].sum()))

        return timed_chunk


def _safe_sink(request: Request, tokens: list[int], reason: str | None) -> None:
    """A sink that raises (a client gone mid-write) must not stop the scheduler: the request is cancelled."""
    try:
        request.sink(tokens, reason)
    except Exception:  # the client's problem, never the loop's
        logger.warning("a request's sink failed; cancelling it", exc_info=True)
        request.cancel()
