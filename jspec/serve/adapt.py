"""Load adaptation: per chunk, speculative steps (at the drafter's whole draft length, or at a shorter one where
the drafter's tree is a chain) or plain steps (that keep the drafter current), whichever commits more tokens per
second.

A chunk steps the running rows of its occupancy bucket (the next bucket over their count), and every step of a
bucket costs about the same whatever its rows hold, but for one thing: a step where every row is greedy skips the
sampling path (``jspec.sampling``'s and ``jspec.accept``'s ``lax.cond``), so each bucket has a cost for chunks of
greedy rows only and one for chunks with a sampled row. The choice per chunk reduces to comparing, per row,

    speculative: acceptance / spec_step_seconds[rows]     against     plain: 1 / plain_step_seconds[rows]
    short:       acceptance * short_ratio / short_step_seconds[rows]

with step seconds per bucket from a cost table measured at start-up (:func:`measure_costs`, at the longest context)
and kept current by every chunk the scheduler times, and per context length bucket too: a step's cost falls with
its context, a plain step's faster than a verify pass's (its gathered pages and attention are most of it), so
the first chunk timed at a (bucket, context) replaces the start-up figure there and later ones average in. A
program not yet timed at a (bucket, context) is costed at the table's figure scaled by the most another program's
fell there (optimistic for it), and is timed there first only where that estimate could pay within the probe
headroom: each probe of a verify pass over many rows costs several plain steps, and there are many (bucket,
context) pairs. The acceptance is the running
requests' own running averages of tokens committed per verify step (new ones start from the average over all),
raised by an exploration bonus, an upper confidence bound of that mean as a bandit's: each request's uncertainty
falls with the verify steps it was measured over, and the mean's with the number of rows. Only speculative chunks
measure a request, so without it a request the starting estimate puts below break-even would never be measured.
Where a step is bound by memory (few rows, a GPU) a verify pass of T tokens costs about one plain step and
speculation wins; where it is bound by compute (many rows) it costs up to T plain steps and plain decoding wins.
While plain steps run nothing measures the acceptance, and while one program runs nothing corrects the other's cost,
so every ``probe_every``-th chunk in a row of one kind runs the runner-up where that could pay.

The short program verifies only a chain's first ``short_draft_len`` drafts (``jspec.step.spec_step``): a verify
pass of fewer tokens, which pays where the whole chain's pass costs more than it saves (many rows) but a short one
does not (TensorRT-LLM's ``draft_len_schedule``, measured rather than given). Its acceptance is the whole chain's
times ``short_ratio``: the share of the tokens committed per whole-chain verify step that a chain cut after
``short_draft_len`` drafts would have committed, from the running distribution of tokens committed per step (a
drafter whose drafts do not depend on how many are verified commits exactly that).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

PLAIN, SHORT, FULL = "plain", "short", "full"  # the step programs: plain steps, a short chain, the whole tree


def program_name(program: bool | str) -> str:
    """A program as :data:`FULL`, :data:`SHORT` or :data:`PLAIN`; True and False name the whole tree and plain."""
    if program is True or program is False:
        return FULL if program else PLAIN
    if program not in (PLAIN, SHORT, FULL):
        raise ValueError(f"program={program!r}: expected one of {PLAIN!r}, {SHORT!r}, {FULL!r} (or a bool)")
    return program


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Seconds per step of each compiled step program, per occupancy bucket (rows stepped), measured at
    start-up: with greedy rows only, and (``sampled_*``; None: as the greedy ones) with a sampled row;
    ``short_*``: the short chain's, at the buckets that have one (None: the server has no short program)."""

    spec_step_seconds: dict[int, float]
    plain_step_seconds: dict[int, float]
    sampled_spec_step_seconds: dict[int, float] | None = None
    sampled_plain_step_seconds: dict[int, float] | None = None
    short_step_seconds: dict[int, float] | None = None
    sampled_short_step_seconds: dict[int, float] | None = None

    def seconds(self, program: bool | str, sampled: bool = False) -> dict[int, float]:
        """The table of a step program (True: the whole tree, False: plain; or a name) over rows of which some are
        sampled (sampled)."""
        program = program_name(program)
        greedy, drawn = {FULL: (self.spec_step_seconds, self.sampled_spec_step_seconds),
                         PLAIN: (self.plain_step_seconds, self.sampled_plain_step_seconds),
                         SHORT: (self.short_step_seconds, self.sampled_short_step_seconds)}[program]
        if greedy is None:
            raise ValueError("the cost table has no short program")
        return drawn if sampled and drawn is not None else greedy

    @property
    def has_short(self) -> bool:
        return self.short_step_seconds is not None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class TimedChunk:
    """One chunk over freshly admitted slots: its seconds, the loop steps it ran, over its rows the tokens they
    gained and the verify steps they took, and (None: not read) how many of those steps committed n tokens
    (``accepted_hist[n - 1]``)."""

    seconds: float
    steps: int
    tokens: int
    verify_steps: int
    accepted_hist: tuple[int, ...] | None = None


def measure_costs(run_chunk: Callable[[str, int, int, bool], TimedChunk], row_buckets: Sequence[int],
                  steps_per_chunk: int, repeats: int = 2, sampled: bool = True,
                  short_rows: Sequence[int] = ()) -> CostTable:
    """The start-up cost table: per step program and occupancy bucket, seconds per step of a chunk of
    ``steps_per_chunk`` steps as the scheduler runs them (what a chunk pays once, gathering its rows' pages and
    writing them back, included), the fastest of ``repeats`` after one warm run, each
    ``run_chunk(program, rows, steps, sampled)`` (program: :data:`FULL`, :data:`PLAIN`, and :data:`SHORT` at
    the buckets ``short_rows``) over ``rows`` freshly admitted slots, greedy or (sampled) with a sampled one;
    ``sampled=False`` measures greedy rows only. The adapter corrects it with every chunk it times
    (:meth:`LoadAdapter.observe`)."""
    kinds = (False, True) if sampled else (False,)
    buckets = {FULL: tuple(row_buckets), PLAIN: tuple(row_buckets), SHORT: tuple(short_rows)}
    seconds: dict[tuple[bool, str, int], float] = {}
    for kind in kinds:
        for rows in sorted({rows for rows_of in buckets.values() for rows in rows_of}):  # rows outermost: the
            for program, rows_of in buckets.items():                                  # programs share admissions
                if rows in rows_of:
                    runs = [run_chunk(program, rows, steps_per_chunk, kind) for _ in range(repeats + 1)][1:]
                    seconds[kind, program, rows] = min(chunk.seconds / max(chunk.steps, 1) for chunk in runs)

    def table(kind: bool, program: str) -> dict[int, float] | None:
        if kind not in kinds or not buckets[program]:
            return None
        return {rows: seconds[kind, program, rows] for rows in buckets[program]}

    return CostTable(table(False, FULL), table(False, PLAIN), table(True, FULL), table(True, PLAIN),
                     table(False, SHORT), table(True, SHORT))


class LoadAdapter:
    """Chooses the step program of each chunk; see the module docstring.

    costs: the start-up table; acceptance: the starting estimate (tokens per verify step of the whole tree, >= 1);
    smoothing: the weight of a new chunk's acceptance in the running average; probe_every: run the runner-up
    program at least once in this many chunks (where it could pay); max_acceptance: the most tokens a verify
    step can commit (the tree's depth + 1), None: no bound; probe_headroom: how far off the expected rates may be
    (the acceptance, or the faster program's cost) for a probe to be worth its cost; explore: the exploration
    bonus of a request measured over no verify step (tokens per verify step; ``explore / sqrt(1 + n)`` after n;
    see :meth:`expected_acceptance`), 0: none; short_draft_len: the drafts the short program verifies (the
    table's ``short_*`` columns), None: no short program; accepted_hist: the starting distribution of tokens
    committed per whole-tree verify step (``accepted_hist[n - 1]``: steps that committed n), None: every step
    commits ``acceptance``.
    """

    def __init__(self, costs: CostTable, acceptance: float, smoothing: float = 0.3, probe_every: int = 8,
                 max_acceptance: float | None = None, probe_headroom: float = 1.5, explore: float = 1.0,
                 short_draft_len: int | None = None, accepted_hist: Sequence[float] | None = None):
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing={smoothing!r}: expected a number in (0, 1]")
        if not explore >= 0.0:
            raise ValueError(f"explore={explore!r}: expected a number >= 0")
        if not isinstance(probe_every, int) or probe_every < 1:
            raise ValueError(f"probe_every={probe_every!r}: expected an integer >= 1")
        if (short_draft_len is None) != (not costs.has_short):
            which = "with" if costs.has_short else "without"
            raise ValueError(f"short_draft_len={short_draft_len!r} with a cost table {which} a short program: "
                             f"expected both or neither")
        if short_draft_len is not None and (not isinstance(short_draft_len, int) or short_draft_len < 1):
            raise ValueError(f"short_draft_len={short_draft_len!r}: expected an integer >= 1")
        self.costs = costs
        self.acceptance = max(1.0, float(acceptance))
        self.smoothing = smoothing
        self.probe_every = probe_every
        self.max_acceptance = max_acceptance
        self.probe_headroom = probe_headroom
        self.explore = float(explore)
        self.short_draft_len = short_draft_len
        self._committed: np.ndarray | None = None  # the running distribution of tokens committed per step
        if accepted_hist is not None:
            self.observe_accepted(accepted_hist, weight=1.0)
        self._streak = 0    # chunks in a row that ran the same program
        self._last: str | None = None
        self._by_context: dict[tuple[str, bool, int, int], float] = {}  # (program, sampled, rows, seq_len)

    def _context_key(self, program: str, rows: int, sampled: bool, seq_len: int) -> tuple[str, bool, int, int]:
        """The key of a (program, table side, bucket, context) timing: chunks with a sampled row have their own
        side only where the start-up table has one."""
        return program, sampled and self.costs.sampled_spec_step_seconds is not None, rows, seq_len

    def expected_acceptance(self, rows: Sequence[tuple[float | None, int]]) -> float:
        """What the next chunk's R rows are expected to accept per verify step, optimistically: over rows, each
        given as (its own running average or None, the verify steps n it was measured over), the mean of those
        averages (the estimate over all where a row has none) plus ``explore * sqrt(sum(1 / (1 + n))) / R``, the
        spread of that mean were each row's own spread ``explore / sqrt(1 + n)``. One fresh request alone is
        worth a speculative chunk where the estimate alone would keep it plain; a crowd of fresh ones moves the
        mean's bound by ``explore / sqrt(R)``, and one fresh row among many measured ones by about
        ``explore / R``."""
        if not rows:
            return self.acceptance
        mean = sum(self.acceptance if own is None else own for own, _ in rows) / len(rows)
        return mean + self.explore * math.sqrt(sum(1.0 / (1 + steps) for _, steps in rows)) / len(rows)

    def observe_accepted(self, accepted_hist: Sequence[float], weight: float | None = None) -> None:
        """Whole-tree verify steps of a chunk: ``accepted_hist[n - 1]`` of them committed n tokens; their
        distribution moves the running one by ``weight`` (default: the smoothing)."""
        counts = np.asarray(accepted_hist, np.float64)
        if counts.sum() <= 0:
            return
        share = counts / counts.sum()
        weight = self.smoothing if weight is None else weight
        self._committed = share if self._committed is None or len(self._committed) != len(share) else \
            self._committed + weight * (share - self._committed)

    def short_ratio(self) -> float:
        """What a chain cut after ``short_draft_len`` drafts commits per verify step over what the whole one does:
        from the running distribution of tokens committed per whole-tree step (each step's n cut to
        ``short_draft_len + 1``); without one, as if every step committed the running acceptance."""
        if self.short_draft_len is None:
            raise ValueError("the adapter has no short program")
        most = self.short_draft_len + 1
        if self._committed is None:
            return min(self.acceptance, most) / self.acceptance
        n = np.arange(1, len(self._committed) + 1)
        return float((self._committed * np.minimum(n, most)).sum() / (self._committed * n).sum())

    def step_seconds(self, program: bool | str, rows: int, sampled: bool = False, seq_len: int | None = None) -> float:
        """Seconds per step of a step program (True: the whole tree, False: plain; or a name) over the bucket of
        ``rows`` (``sampled``: some of them sampled) at context ``seq_len``: as timed there, else the start-up
        table's (kept current over all contexts), scaled by the most another program's timed cost there fell below its
        table figure."""
        program = program_name(program)
        table = self.costs.seconds(program, sampled)[rows]
        if seq_len is None:
            return table
        timed = self._by_context.get(self._context_key(program, rows, sampled, seq_len))
        if timed is not None:
            return timed
        # untimed here: the table's cost scaled as another program's fell here, the most it fell
        scales = [self._by_context[key] / self.costs.seconds(other, sampled)[rows]
                  for other in (FULL, SHORT, PLAIN) if other != program
                  and (key := self._context_key(other, rows, sampled, seq_len)) in self._by_context]
        return table * min(scales, default=1.0)

    def rate(self, program: bool | str, rows: int, acceptance: float | None = None, sampled: bool = False,
             seq_len: int | None = None) -> float:
        """Expected tokens per second per running slot with ``program``'s steps over ``rows`` slots (``sampled``:
        some of them sampled) at context ``seq_len``, at whole-tree ``acceptance`` (default: the running
        estimate)."""
        program = program_name(program)
        expected = self.acceptance if acceptance is None else acceptance
        tokens = {PLAIN: 1.0, FULL: expected}.get(program)
        if tokens is None:
            tokens = max(1.0, expected * self.short_ratio())
        return tokens / self.step_seconds(program, rows, sampled, seq_len)

    def speculative_rate(self, rows: int, acceptance: float | None = None, sampled: bool = False,
                         seq_len: int | None = None) -> float:
        """:meth:`rate` of the whole tree."""
        return self.rate(FULL, rows, acceptance, sampled, seq_len)

    def plain_rate(self, rows: int, sampled: bool = False, seq_len: int | None = None) -> float:
        return self.rate(PLAIN, rows, None, sampled, seq_len)

    def _could_pay(self, program: str, rows: int, sampled: bool, seq_len: int | None) -> bool:
        """False where even every draft accepted would not make ``program``'s steps pay against plain ones."""
        if program == PLAIN or self.max_acceptance is None:
            return True
        most = self.max_acceptance if program == FULL else min(self.max_acceptance, self.short_draft_len + 1)
        seconds = self.step_seconds(program, rows, sampled, seq_len)
        return most / seconds >= self.plain_rate(rows, sampled, seq_len)

    def choose(self, rows: int, acceptance: float | None = None, sampled: bool = False,
               seq_len: int | None = None) -> bool:
        """True: the next chunk speculates (:meth:`choose_program` is not plain)."""
        return self.choose_program(rows, acceptance, sampled, seq_len) != PLAIN

    def choose_program(self, rows: int, acceptance: float | None = None, sampled: bool = False,
                       seq_len: int | None = None) -> str:
        """The next chunk's step program (:data:`FULL`, :data:`SHORT` or :data:`PLAIN`) over the occupancy bucket
        of ``rows`` slots (``sampled``: some of them sampled) at context ``seq_len`` (None: costs as in the
        start-up table). acceptance: what the running requests are expected to accept per whole-tree verify step
        (:meth:`expected_acceptance`; default: the running estimate over all). The fastest program by the table,
        but every ``probe_every``-th chunk in a row of one kind a probe of the runner-up where it would pay at
        ``probe_headroom`` times its expected rate, and a program never timed at this bucket and context at once
        where its estimate (:meth:`step_seconds`) would pay at that headroom; never a speculative program where
        even every draft accepted (``max_acceptance``) would not pay: there a verify pass costs more than the
        most it can save."""
        expected = self.acceptance if acceptance is None else acceptance
        programs = [p for p in (FULL, SHORT, PLAIN) if (p != SHORT or rows in (self.costs.short_step_seconds or ()))
                    and self._could_pay(p, rows, sampled, seq_len)]
        ranked = sorted(programs, key=lambda p: -self.rate(p, rows, expected, sampled, seq_len))
        choice = ranked[0]
        untimed = [] if seq_len is None else [
            p for p in ranked[1:] if self._context_key(p, rows, sampled, seq_len) not in self._by_context
            and self.rate(p, rows, expected, sampled, seq_len) * self.probe_headroom
            >= self.rate(ranked[0], rows, expected, sampled, seq_len)]
        if untimed:
            choice = untimed[0]  # never timed here: its estimate is a guess from the longest context's
        elif len(ranked) > 1 and self._streak + 1 >= self.probe_every:
            best, runner_up = (self.rate(p, rows, expected, sampled, seq_len) for p in ranked[:2])
            if runner_up * self.probe_headroom >= best and self._last == ranked[0]:
                choice = ranked[1]
        self._streak = self._streak + 1 if choice == self._last else 1
        self._last = choice
        return choice

    def observe(self, program: bool | str, tokens: int, steps: int, *, rows: int | None = None,
                seconds: float = 0.0, loop_steps: int = 0, sampled: bool = False,
                seq_len: int | None = None) -> None:
        """A chunk's outcome: ``tokens`` committed by ``steps`` verify steps over all running slots (a short
        chain's count as the whole tree's would, over :meth:`short_ratio`); with ``rows`` (its occupancy bucket;
        ``sampled``: some of them sampled), its ``seconds`` over ``loop_steps`` steps move that bucket's cost (a
        running average, as the acceptance's: the start-up table is only where the costs begin), and with
        ``seq_len`` (its context bucket) set the cost there at first, then move it."""
        program = program_name(program)
        if program != PLAIN and steps > 0:
            measured = tokens / steps / (self.short_ratio() if program == SHORT else 1.0)
            self.acceptance += self.smoothing * (measured - self.acceptance)
        if rows is not None and loop_steps > 0:
            measured = seconds / loop_steps
            table = self.costs.seconds(program, sampled)
            table[rows] += self.smoothing * (measured - table[rows])
            if seq_len is not None:
                key = self._context_key(program, rows, sampled, seq_len)
                timed = self._by_context.get(key)
                self._by_context[key] = measured if timed is None else timed + self.smoothing * (measured - timed)
