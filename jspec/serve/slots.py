"""SlotEngine: continuous batching over ``max_batch_size`` slots of one donated decode state.

One scheduler thread loops: admit waiting requests into free slots (one jitted prefill-and-insert each,
``programs.admit``), run one jitted chunk of up to ``steps_per_chunk`` fused steps over all slots
(``programs.run_chunk``) over the occupancy bucket (the lowest power of two of slots holding every busy one),
hand each request the tokens it gained, free the slots that finished. Every program is compiled ahead of time in
:meth:`SlotEngine.warm_up` (one admit per prompt-width bucket, one chunk per step program and occupancy bucket),
so serving compiles nothing.

A request's tokens depend only on (prompt, parameters, seed): its key is fold_in(key(seed), 0) and each step draws
at the request's own positions (``jspec.sampling.keys_at``), never at its slot or the loop's step count. So a
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

from jspec.batching import MIN_PROMPT_BUCKET, next_power_of_two
from jspec.sampling import SamplingArrays
from jspec.serve.adapt import CostTable, LoadAdapter
from jspec.serve.metrics import ServeMetrics
from jspec.serve.programs import admit, host_key, idle_slots, run_chunk
from jspec.sharding import put

logger = logging.getLogger("jspec.serve")

Sink = Callable[[list[int], "str | None"], None]  # (new token ids, finish_reason or None while running)


class QueueFull(Exception):
    """The waiting queue holds max_queue requests (HTTP 503)."""


class NotAccepting(Exception):
    """The server is shutting down (or not warm yet) and takes no new requests (HTTP 503)."""


@dataclasses.dataclass
class Request:
    """A validated request. prompt_ids: its tokens; max_tokens: new tokens at most; seed: None draws one;
    stop_token_ids: besides the model's EOS; sink: called from the scheduler thread with the tokens the request
    gained and, last, its finish reason ("stop", "length" or "abort")."""

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
        self.widths = _width_buckets(max_seq_len)
        self.row_buckets = _check_buckets("row_buckets", row_buckets, self.num_slots, 1, "max_batch_size")
        self.seq_buckets = _check_buckets("seq_buckets", seq_buckets, max_seq_len, MIN_SEQ_BUCKET, "max_seq_len")
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
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise ValueError(f"max_tokens={request.max_tokens!r}: expected an integer >= 1")
        if len(ids) + request.max_tokens > self.max_seq_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; with max_tokens={request.max_tokens} that exceeds "
                             f"the context of {self.max_seq_len} tokens (--max-seq-len)")
        stops = set(self.eos_token_ids) | set(request.stop_token_ids)
        if len(stops) > self.num_stop_ids:
            raise ValueError(f"{len(request.stop_token_ids)} stop_token_ids: at most "
                             f"{self.num_stop_ids - len(self.eos_token_ids)} besides EOS")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in request.stop_token_ids):
            raise ValueError(f"stop_token_ids={list(request.stop_token_ids)!r}: expected ids in [0, {vocab})")
        if request.seed is not None and (not isinstance(request.seed, int) or not 0 <= request.seed < 2 ** 32):
            raise ValueError(f"seed={request.seed!r}: expected an integer in [0, 2**32)")

    def submit(self, request: Request) -> Request:
        """Queues a request (checked first: ValueError); QueueFull / NotAccepting when it cannot be taken."""
        self.check(request)
        if request.seed is None:
            request.seed = secrets.randbelow(2 ** 32)
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
        """Compiles every program, measures the cost table (with load adaptation), then starts accepting."""
        engine = self.engine
        args = (engine.params, engine.drafter_params)
        self._state, self._inputs = idle_slots(*args, setup=self.setup, num_slots=self.num_slots,
                                               num_stop_ids=self.num_stop_ids)
        cancel, steps = self._place(np.zeros((self.num_slots,), bool)), self._steps_arg()
        lowered = {}
        for width in self.widths:
            row = self._row_arguments(Request([0], 1, _ignore), width)
            lowered["admit", width] = admit.lower(*args, self._state, self._inputs, *row,
                                                  self._place(np.zeros((), np.int32)), setup=self.setup)
        for speculate in ((True, False) if self.speculative else (True,)):
            for rows in self.row_buckets:
                for seq_len in self.seq_buckets:
                    lowered["chunk", speculate, rows, seq_len] = run_chunk.lower(
                        *args, self._state, self._inputs, cancel, steps, setup=self.setup, speculate=speculate,
                        rows=rows, seq_len=seq_len)
        self._compiled.update((name, program.compile()) for name, program in lowered.items())
        host_key(0)  # the host's key derivation, compiled once too
        if self.adapt:
            self.costs, acceptance = self._measure(calibration_prompt)
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
        args = (self.engine.params, self.engine.drafter_params)
        for slot, request in admitted:
            width = next(w for w in self.widths if w >= len(request.prompt_ids))
            row = self._row_arguments(request, width)
            self._state, self._inputs = self._compiled[("admit", width)](
                *args, self._state, self._inputs, *row, self._place(np.asarray(slot, np.int32)))
            self._slots[slot] = _Running(request, len(request.prompt_ids),
                                         frozenset(self.eos_token_ids + request.stop_token_ids))
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
        self._state = self._compiled[("chunk", speculate, rows, seq_len)](
            self.engine.params, self.engine.drafter_params, self._state, self._inputs, self._place(cancel),
            self._steps_arg())
        self._emit(start, speculated=speculate)  # waits for the chunk
        seconds, steps = time.perf_counter() - start, self._host_step - step_before
        program = "speculative" if self.speculative and speculate else "plain"
        self.metrics.chunks.labels(program).inc()
        if steps:
            self.metrics.step_seconds.labels(program).observe(seconds / steps)

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
                    for n, count in enumerate(hist[slot] - running.hist_seen, start=1):
                        for _ in range(int(count)):
                            self.metrics.acceptance_length.observe(n)
            running.steps_seen, running.hist_seen = int(num_steps[slot]), hist[slot].copy()
            if new:
                if running.first_token_at is None:
                    running.first_token_at = now
                    self.metrics.time_to_first_token.observe(now - request.arrival)
                elif chunk_seconds > 0:
                    for _ in new:
                        self.metrics.inter_token_latency.observe(chunk_seconds / len(new))
                self.metrics.generation_tokens.inc(len(new))
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

    def _row_arguments(self, request: Request, width: int) -> tuple:
        prompt = np.zeros((1, width), np.int32)
        prompt[0, :len(request.prompt_ids)] = request.prompt_ids
        stops = sorted(set(self.eos_token_ids) | set(request.stop_token_ids))
        stop_ids = np.full((1, self.num_stop_ids), -1, np.int32)
        stop_ids[0, :len(stops)] = stops
        sampling = SamplingArrays(np.full((1,), request.temperature, np.float32),
                                  np.full((1,), request.top_k, np.int32), np.full((1,), request.top_p, np.float32))
        row = (prompt, np.asarray([len(request.prompt_ids)], np.int32), host_key(request.seed or 0),
               np.asarray([request.max_tokens], np.int32), stop_ids, sampling)
        return jax.tree.map(self._place, row)

    def _place(self, array: np.ndarray) -> jax.Array:
        """On a mesh: replicated over it (the compiled programs expect their inputs there)."""
        if self.setup.mesh is None:
            return jnp.asarray(array)
        return put(array, jax.sharding.NamedSharding(self.setup.mesh, jax.sharding.PartitionSpec()))

    def _steps_arg(self) -> jax.Array:
        return self._place(np.asarray(self.steps_per_chunk, np.int32))

    def _measure(self, prompt: Sequence[int] | None) -> tuple[CostTable, float]:
        """Per occupancy bucket and step program: fills the bucket's slots with ``prompt`` (greedy), times chunks
        (best of 2 after one that warms caches) at the length bucket holding the prompt and its budget (one length
        stands for all: the ratio of the two programs' costs is what matters) and frees the slots. The speculative chunks' acceptance over all
        slots is the starting estimate."""
        prompt = list(prompt) if prompt else list(range(1, 17))
        budget = max(1, min(self.max_seq_len // 2, 3 * self.steps_per_chunk * self.setup.tokens_per_step))
        prompt = prompt[:self.max_seq_len - budget]
        width = next(w for w in self.widths if w >= len(prompt))
        seq_len = next(n for n in self.seq_buckets if n >= len(prompt) + budget)
        args = (self.engine.params, self.engine.drafter_params)
        steps_arg = self._steps_arg()
        seconds: dict[tuple[bool, int], float] = {}
        acceptance = 1.0
        for speculate in (True, False):
            for rows in self.row_buckets:
                for slot in range(rows):
                    row = self._row_arguments(Request(prompt, budget, _ignore, seed=0), width)
                    self._state, self._inputs = self._compiled[("admit", width)](
                        *args, self._state, self._inputs, *row, self._place(np.asarray(slot, np.int32)))
                timings = []
                generated_before = np.asarray(self._state.num_generated)[:rows].sum()
                for _ in range(3):
                    steps_before = int(self._state.step)
                    start = time.perf_counter()
                    self._state = self._compiled[("chunk", speculate, rows, seq_len)](
                        *args, self._state, self._inputs, self._place(np.zeros((self.num_slots,), bool)), steps_arg)
                    steps = int(self._state.step) - steps_before
                    timings.append((time.perf_counter() - start) / steps if steps else float("inf"))
                if speculate and rows == self.num_slots:
                    gained = np.asarray(self._state.num_generated)[:rows].sum() - generated_before
                    verify_steps = max(1, int(np.asarray(self._state.num_steps)[:rows].sum()))
                    acceptance = float(gained) / verify_steps
                seconds[speculate, rows] = min(timings[1:])
                self._state = self._compiled[("chunk", speculate, self.num_slots, self.max_seq_len)](
                    *args, self._state, self._inputs, self._place(np.ones((self.num_slots,), bool)), steps_arg)
        return CostTable({rows: seconds[True, rows] for rows in self.row_buckets},
                         {rows: seconds[False, rows] for rows in self.row_buckets}), acceptance


MIN_SEQ_BUCKET = 256  # below it, a shorter context saves less than its programs cost to compile


def _check_buckets(name: str, given: Sequence[int] | None, last: int, first: int, last_name: str) -> tuple[int, ...]:
    """``given`` checked (ascending, ending at ``last``), or the default: powers of two from ``first`` below
    ``last``, then ``last``."""
    if given is None:
        buckets, size = [], first
        while size < last:
            buckets.append(size)
            size *= 2
        return tuple(buckets) + (last,)
    buckets = tuple(given)
    if (not buckets or list(buckets) != sorted(set(buckets)) or buckets[-1] != last or buckets[0] < 1
            or any(not isinstance(b, int) for b in buckets)):
        raise ValueError(f"{name}={given!r}: expected ascending integers ending at {last_name}={last}")
    return buckets


def _width_buckets(max_seq_len: int) -> tuple[int, ...]:
    """Prompt-width buckets: powers of two from 16, the last one max_seq_len - 1 at most (a prompt leaves room for
    one new token)."""
    widths, width = [], MIN_PROMPT_BUCKET
    while width < max_seq_len - 1:
        widths.append(width)
        width *= 2
    widths.append(max_seq_len - 1) if not widths or widths[-1] < max_seq_len - 1 else None
    return tuple(widths)


def _ignore(tokens: list[int], reason: str | None) -> None:
    del tokens, reason


def _safe_sink(request: Request, tokens: list[int], reason: str | None) -> None:
    """A sink that raises (a client gone mid-write) must not stop the scheduler: the request is cancelled."""
    try:
        request.sink(tokens, reason)
    except Exception:  # the client's problem, never the loop's
        logger.warning("a request's sink failed; cancelling it", exc_info=True)
        request.cancel()
