"""Load adapters that choose by script rather than by cost, for tests that must see every step program run."""

from __future__ import annotations

from jspec.serve.adapt import FULL, PLAIN, SHORT, LoadAdapter


class Cycling(LoadAdapter):
    """Runs the whole chain, the short chain and plain steps in turn, whatever they cost (the short chain only at
    the buckets that have it)."""

    def __init__(self, adapter: LoadAdapter):
        super().__init__(adapter.costs, adapter.acceptance, short_draft_len=adapter.short_draft_len)
        self.turn = 0

    def choose_program(self, rows, acceptance=None, sampled=False, seq_len=None):
        self.turn += 1
        program = (FULL, SHORT, PLAIN)[self.turn % 3]
        return FULL if program == SHORT and rows not in self.costs.short_step_seconds else program
