"""Load adaptation: per chunk, speculative steps or plain steps (that keep the drafter current), whichever
commits more tokens per second.

A chunk steps the running rows of its occupancy bucket (the next bucket over their count), and every step of a
bucket costs about the same whatever its rows hold, but for one thing: a step where every row is greedy skips the
sampling path (``jspec.sampling``'s and ``jspec.accept``'s ``lax.cond``), so each bucket has a cost for chunks of
greedy rows only and one for chunks with a sampled row. The choice per chunk reduces to comparing, per row,

    speculative: acceptance / spec_step_seconds[rows]     against     plain: 1 / plain_step_seconds[rows]

with step seconds per bucket from a cost table measured at start-up (:func:`measure_costs`, at the longest context)
and kept current by every chunk the scheduler times, and per context length bucket too: a step's cost falls with
its context, a plain step's faster than a verify pass's (its gathered pages and attention are most of it), so
the first chunk timed at a (bucket, context) replaces the start-up figure there and later ones average in (each
program runs once at a (bucket, context) before the two are compared there). The acceptance is the running
requests' own running averages of tokens committed per verify step (new ones start from the average over all),
raised by an exploration bonus, an upper confidence bound of that mean as a bandit's: each request's uncertainty
falls with the verify steps it was measured over, and the mean's with the number of rows. Only speculative chunks
measure a request, so without it a request the starting estimate puts below break-even would never be measured.
Where a step is bound by memory (few rows, a GPU) a verify pass of T tokens costs about one plain step and
speculation wins; where it is bound by compute (many rows) it costs up to T plain steps and plain decoding wins.
While plain steps run nothing measures the acceptance, and while one program runs nothing corrects the other's cost,
so every ``probe_every``-th chunk in a row of one kind runs the other where that could pay.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Seconds per step of each compiled step program, per occupancy bucket (rows stepped), measured at
    start-up: with greedy rows only, and (``sampled_*``; None: as the greedy ones) with a sampled row."""

    spec_step_seconds: dict[int, float]
    plain_step_seconds: dict[int, float]
    sampled_spec_step_seconds: dict[int, float] | None = None
    sampled_plain_step_seconds: dict[int, float] | None = None

    def seconds(self, speculate: bool, sampled: bool = False) -> dict[int, float]:
        """The table of a step program (speculate) over rows of which some are sampled (sampled)."""
        if sampled and self.sampled_spec_step_seconds is not None:
            return self.sampled_spec_step_seconds if speculate else self.sampled_plain_step_seconds
        return self.spec_step_seconds if speculate else self.plain_step_seconds

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class TimedChunk:
    """One chunk over freshly admitted slots: its seconds, the loop steps it ran, and over its rows the tokens they
    gained and the verify steps they took."""

    seconds: float
    steps: int
    tokens: int
    verify_steps: int


def measure_costs(run_chunk: Callable[[bool, int, int, bool], TimedChunk], row_buckets: Sequence[int],
                  steps_per_chunk: int, repeats: int = 2, sampled: bool = True) -> CostTable:
    """The start-up cost table: per step program and occupancy bucket, seconds per step of a chunk of
    ``steps_per_chunk`` steps as the scheduler runs them (what a chunk pays once, gathering its rows' pages and
    writing them back, included), the fastest of ``repeats`` after one warm run, each
    ``run_chunk(speculate, rows, steps, sampled)`` over ``rows`` freshly admitted slots, greedy or (sampled) with
    a sampled one; ``sampled=False`` measures greedy rows only. The adapter corrects it with every chunk it times
    (:meth:`LoadAdapter.observe`)."""
    seconds: dict[tuple[bool, bool, int], float] = {}
    for kind in ((False, True) if sampled else (False,)):
        for speculate in (True, False):
            for rows in row_buckets:
                runs = [run_chunk(speculate, rows, steps_per_chunk, kind) for _ in range(repeats + 1)][1:]
                seconds[kind, speculate, rows] = min(chunk.seconds / max(chunk.steps, 1) for chunk in runs)
    tables = [{rows: seconds[kind, speculate, rows] for rows in row_buckets}
              for kind in ((False, True) if sampled else (False,)) for speculate in (True, False)]
    return CostTable(*tables)


class LoadAdapter:
    """Chooses the step program of each chunk; see the module docstring.

    costs: the start-up table; acceptance: the starting estimate (tokens per verify step, >= 1); smoothing: the
    weight of a new chunk's acceptance in the running average; probe_every: run the other program at least once
    in this many chunks (where it could pay); max_acceptance: the most tokens a verify step can commit (the tree's
    depth + 1), None: no bound; probe_headroom: how far off the expected rates may be (the acceptance, or the
    faster program's cost) for a probe to be worth its cost; explore: the exploration bonus of a request measured
    over no verify step (tokens per verify step; ``explore / sqrt(1 + n)`` after n; see
    :meth:`expected_acceptance`), 0: none.
    """

    def __init__(self, costs: CostTable, acceptance: float, smoothing: float = 0.3, probe_every: int = 8,
                 max_acceptance: float | None = None, probe_headroom: float = 1.5, explore: float = 1.0):
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing={smoothing!r}: expected a number in (0, 1]")
        if not explore >= 0.0:
            raise ValueError(f"explore={explore!r}: expected a number >= 0")
        if not isinstance(probe_every, int) or probe_every < 1:
            raise ValueError(f"probe_every={probe_every!r}: expected an integer >= 1")
        self.costs = costs
        self.acceptance = max(1.0, float(acceptance))
        self.smoothing = smoothing
        self.probe_every = probe_every
        self.max_acceptance = max_acceptance
        self.probe_headroom = probe_headroom
        self.explore = float(explore)
        self._streak = 0    # chunks in a row that ran the same program
        self._last: bool | None = None
        self._by_context: dict[tuple[bool, bool, int, int], float] = {}  # (speculate, sampled, rows, seq_len)

    def _context_key(self, speculate: bool, rows: int, sampled: bool, seq_len: int) -> tuple[bool, bool, int, int]:
        """The key of a (program, table side, bucket, context) timing: chunks with a sampled row have their own
        side only where the start-up table has one."""
        return speculate, sampled and self.costs.sampled_spec_step_seconds is not None, rows, seq_len

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

    def step_seconds(self, speculate: bool, rows: int, sampled: bool = False, seq_len: int | None = None) -> float:
        """Seconds per step of a step program over the bucket of ``rows`` (``sampled``: some of them sampled) at
        context ``seq_len``: as timed there, else the start-up table's (kept current over all contexts)."""
        timed = None if seq_len is None else self._by_context.get(self._context_key(speculate, rows, sampled, seq_len))
        return self.costs.seconds(speculate, sampled)[rows] if timed is None else timed

    def speculative_rate(self, rows: int, acceptance: float | None = None, sampled: bool = False,
                         seq_len: int | None = None) -> float:
        """Expected tokens per second per running slot with speculative steps over ``rows`` slots (``sampled``:
        some of them sampled) at context ``seq_len``, at ``acceptance`` (default: the running estimate)."""
        expected = self.acceptance if acceptance is None else acceptance
        return expected / self.step_seconds(True, rows, sampled, seq_len)

    def plain_rate(self, rows: int, sampled: bool = False, seq_len: int | None = None) -> float:
        return 1.0 / self.step_seconds(False, rows, sampled, seq_len)

    def choose(self, rows: int, acceptance: float | None = None, sampled: bool = False,
               seq_len: int | None = None) -> bool:
        """True: the next chunk, over the occupancy bucket of ``rows`` slots (``sampled``: some of them sampled)
        at context ``seq_len`` (None: costs as in the start-up table), speculates. acceptance: what the running
        requests are expected to accept (:meth:`expected_acceptance`; default: the running estimate over all). The
        faster program by the table, but every ``probe_every``-th chunk in a row of one kind a probe of the other,
        where it would pay at ``probe_headroom``
        times the expected acceptance (a speculative probe) or at the faster program's cost over
        ``probe_headroom`` (a plain one), and the other program at once, whatever it would pay, where it was never
        timed at this bucket and context (each is timed there before the two are compared); never speculative
        where even ``max_acceptance`` (every draft accepted)
        would not pay: there a verify pass costs more than the most it can save."""
        expected = self.acceptance if acceptance is None else acceptance
        plain = self.plain_rate(rows, sampled, seq_len)
        if (self.max_acceptance is not None
                and self.speculative_rate(rows, self.max_acceptance, sampled, seq_len) < plain):
            return False
        speculative = self.speculative_rate(rows, expected, sampled, seq_len)
        choice = speculative >= plain
        if seq_len is not None and self._context_key(not choice, rows, sampled, seq_len) not in self._by_context:
            choice = not choice  # the other program, never timed here: its table cost is the longest context's
        elif self._streak + 1 >= self.probe_every:
            other_could_pay = (plain * self.probe_headroom >= speculative if choice else
                               self.speculative_rate(rows, self.probe_headroom * expected, sampled, seq_len) >= plain)
            choice ^= other_could_pay
        self._streak = self._streak + 1 if choice == self._last else 1
        self._last = choice
        return choice

    def observe(self, speculated: bool, tokens: int, steps: int, *, rows: int | None = None,
                seconds: float = 0.0, loop_steps: int = 0, sampled: bool = False,
                seq_len: int | None = None) -> None:
        """A chunk's outcome: ``tokens`` committed by ``steps`` verify steps over all running slots; with ``rows``
        (its occupancy bucket; ``sampled``: some of them sampled), its ``seconds`` over ``loop_steps`` steps move
        that bucket's cost (a running average, as the acceptance's: the start-up table is only where the costs
        begin), and with ``seq_len`` (its context bucket) set the cost there at first, then move it."""
        if speculated and steps > 0:
            self.acceptance += self.smoothing * (tokens / steps - self.acceptance)
        if rows is not None and loop_steps > 0:
            measured = seconds / loop_steps
            table = self.costs.seconds(speculated, sampled)
            table[rows] += self.smoothing * (measured - table[rows])
            if seq_len is not None:
                key = self._context_key(speculated, rows, sampled, seq_len)
                timed = self._by_context.get(key)
                self._by_context[key] = measured if timed is None else timed + self.smoothing * (measured - timed)
