"""The slot engine over a model runner whose programs (prefill, cached prefill, step) run on the host over a toy
model (:class:`HostRunner`, through the seam ``SlotEngine.runner_class``): the scheduler's tests (admission by
pages, preemption by recompute, prefix hits, chunked prefill, cancelling, readout ownership, buckets compiled on
first use) run the real scheduler and compile nothing.

The toy model's next token is a function of the last two tokens of a row's context, which the programs read
through the page table they are given from a host pool of pages, and every token they commit is written there the
same way. So a scheduler that hands a row the wrong pages, frees or shares pages still being written, reuses a
cached prefix that is not the prompt's, or gives a readout to the wrong request changes what a request returns, and
``toy_generate`` (the same model, one request alone) tells. Where a real program would write a row's token to the
null page (a reservation short of what the chunk commits) and lose it, these raise.
"""

from __future__ import annotations

import functools
import threading
import time

import numpy as np

from jspec.serve import paged
from jspec.serve.model_runner import ModelRunner
from jspec.serve.slots import SlotEngine


def toy_next(context: list[int] | np.ndarray, vocab_size: int) -> int:
    """The toy model's next token after ``context`` (at least one token)."""
    last = int(context[-1])
    before = int(context[-2]) if len(context) > 1 else 0
    return (31 * last + 17 * before + 7) % vocab_size


def toy_generate(prompt: list[int], max_tokens: int, stop_ids, vocab_size: int) -> list[int]:
    """What one request returns alone: tokens until ``max_tokens`` or the first of ``stop_ids`` (included)."""
    context, out = list(prompt), []
    while len(out) < max_tokens:
        token = toy_next(context, vocab_size)
        context.append(token)
        out.append(token)
        if token in stop_ids:
            break
    return out


class HostPrograms:
    """The programs' shared device state, on the host: the token pool [num_pages, page_size] and per row (the null
    row last) its length, budget, stop ids, tokens generated, verify steps and done flag; the loop's step counter."""

    def __init__(self, runner: ModelRunner):
        layout = runner.layout
        self.tokens_per_step = runner.setup.tokens_per_step
        self.vocab = runner.engine.config.vocab_size
        self.null_row, self.page_size = layout.null_row, layout.page_size
        self.pool = np.zeros((layout.num_pages, layout.page_size), np.int64)
        rows = layout.max_rows + 1
        self.length = np.zeros(rows, np.int64)
        self.budget = np.zeros(rows, np.int64)
        self.generated = np.zeros(rows, np.int64)
        self.steps = np.zeros(rows, np.int64)
        self.done = np.ones(rows, bool)
        self.stops: list[frozenset] = [frozenset()] * rows
        self.step = 0
        self.width = runner.max_seq_len + 64  # readout columns: past any row's tokens
        self.lock = threading.Lock()

    def _write(self, table: np.ndarray, position: int, token: int) -> None:
        page = table[0, position // self.page_size]  # the full group's: the token buffer's
        if page == 0:
            raise AssertionError(f"a row's token at position {position} went to the null page: its pages were not "
                                 f"reserved")
        self.pool[page, position % self.page_size] = token

    def _context(self, table: np.ndarray, length: int) -> np.ndarray:
        slots = np.arange(length)
        return self.pool[table[0, slots // self.page_size], slots % self.page_size]

    def _commit(self, row: int, table: np.ndarray) -> None:
        token = toy_next(self._context(table, self.length[row])[-2:], self.vocab)
        self._write(table, self.length[row], token)
        self.length[row] += 1
        self.generated[row] += 1
        self.done[row] = self.generated[row] >= self.budget[row] or token in self.stops[row]

    def _readout(self, ids: np.ndarray, tables: np.ndarray) -> paged.Readout:
        tokens = np.zeros((len(ids), self.width), np.int32)
        for k, row in enumerate(ids):
            if row != self.null_row:
                tokens[k, :self.length[row]] = self._context(tables[k], self.length[row])
        hist = np.zeros((len(ids), self.tokens_per_step + 1), np.int32)
        return paged.Readout(tokens, self.generated[ids].copy(), self.steps[ids].copy(), self.done[ids].copy(), hist,
                             np.asarray(self.step), None)

    def prefill(self, cached: bool, store, *arrays):
        """``paged.prefill_rows`` (``cached``: ``prefill_cached_rows``) over the slot engine's arguments."""
        arrays = [np.asarray(a) if a is not None and not isinstance(a, (dict, tuple)) else a for a in arrays]
        if cached:
            prompts, lengths, cached_lens, _, budgets, stops, *_, ids, tables, _ = arrays
        else:
            prompts, lengths, _, budgets, stops, *_, ids, tables, _ = arrays
            cached_lens = np.zeros_like(lengths)
        with self.lock:
            for k, row in enumerate(ids):
                if row == self.null_row:
                    continue
                start, end = int(cached_lens[k]), int(lengths[k])
                for position in range(start, end):
                    self._write(tables[k], position, int(prompts[k, position - start]))
                self.length[row], self.budget[row] = end, budgets[k]
                self.generated[row] = self.steps[row] = 0
                self.stops[row] = frozenset(int(s) for s in stops[k] if s >= 0)
                self._commit(row, tables[k])
            return store, self._readout(ids, tables)

    def step_rows(self, store, ids, tables, cancel, steps):
        """``paged.step_rows``: up to ``steps`` loop steps of one token per row, while any row is not done."""
        ids, tables, cancel = np.asarray(ids), np.asarray(tables), np.asarray(cancel)
        with self.lock:
            self.done[ids[cancel]] = True
            for _ in range(int(steps)):
                live = [k for k, row in enumerate(ids) if row != self.null_row and not self.done[row]]
                if not live:
                    break
                for k in live:
                    self._commit(ids[k], tables[k])
                    self.steps[ids[k]] += 1
                self.step += 1
            return store, self._readout(ids, tables)


class _Lowered:
    """What ``ModelRunner.lower`` returns: ``compile()`` (on whichever thread compiles it) gives the host program."""

    def __init__(self, runner: "HostRunner", key: tuple):
        self.runner, self.key = runner, key

    def compile(self):
        runner, kind = self.runner, self.key[0]
        runner.compile_threads.append(threading.current_thread().name)
        time.sleep(runner.compile_seconds)
        host = runner.host
        if kind in ("prefill", "prefill_cached"):
            run = functools.partial(host.prefill, kind == "prefill_cached")
        elif kind in ("step", "step_lean"):
            run = host.step_rows
        else:
            run = None  # compiled at warm-up (a prompt's log-probabilities), never run by these tests

        def program(params_t, params_d, store, *arrays):
            runner.calls.append(self.key)
            if run is None:
                raise NotImplementedError(f"no host form of the {kind!r} program")
            return run(store, *arrays)

        return program


class HostRunner(ModelRunner):
    """A :class:`ModelRunner` whose programs are :class:`HostPrograms`' (no device store is built); compile_seconds:
    how long each one takes to "compile" (on the thread that compiles it, recorded in ``compile_threads``); calls:
    the key of each program run, in order."""

    compile_seconds = 0.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.compile_threads: list[str] = []
        self.calls: list[tuple] = []
        self.host: HostPrograms | None = None

    def allocate(self, blocks) -> None:
        self.blocks = blocks
        self.tables = np.zeros((self.max_num_seqs + 1, self.layout.num_groups, self.layout.pages_per_row), np.int32)
        self.host = HostPrograms(self)

    def lower(self, key: tuple) -> _Lowered:
        return _Lowered(self, key)


class HostSlotEngine(SlotEngine):
    """A :class:`SlotEngine` (the scheduler unchanged) over a :class:`HostRunner`; compile_seconds: as its."""

    runner_class = HostRunner

    def __init__(self, engine, *, compile_seconds: float = 0.0, **kwargs):
        super().__init__(engine, **kwargs)
        self.runner.compile_seconds = compile_seconds

    def expected(self, prompt: list[int], max_tokens: int, stop_ids=()) -> list[int]:
        """What a request returns alone (its stop ids besides the model's EOS)."""
        return toy_generate(prompt, max_tokens, set(self.eos_token_ids) | set(stop_ids),
                            self.engine.config.vocab_size)
