"""Load adapters that choose by script rather than by cost, for tests that must see every step program run."""

from __future__ import annotations

from typing import Sequence

from jspec.serve.adapt import FULL, PLAIN, SHORT, LoadAdapter


class Scripted(LoadAdapter):
    """Runs ``programs`` in turn, over and over, whatever they cost (the short chain only at the buckets that have
    it; the whole chain elsewhere)."""

    def __init__(self, adapter: LoadAdapter, programs: Sequence[str]):
        super().__init__(adapter.costs, adapter.acceptance, short_draft_len=adapter.short_draft_len)
        self.programs, self.turn = tuple(programs), 0

    def choose_program(self, rows, acceptance=None, sampled=False, seq_len=None):
        program = self.programs[self.turn % len(self.programs)]
        self.turn += 1
        return FULL if program == SHORT and rows not in self.costs.short_step_seconds else program


class Cycling(Scripted):
    """The short chain, plain steps and the whole chain in turn."""

    def __init__(self, adapter: LoadAdapter):
        super().__init__(adapter, (SHORT, PLAIN, FULL))
