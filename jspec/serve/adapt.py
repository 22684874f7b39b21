"""Load adaptation: per chunk, speculative steps or plain steps (that keep the drafter current), whichever
commits more tokens per second.

The slot state has fixed shapes, so one step costs the same whatever the occupancy (idle slots are computed and
masked), and the choice per chunk reduces to comparing, per running slot,

    speculative: acceptance / spec_step_seconds     against     plain: 1 / plain_step_seconds

with step seconds from a cost table measured at start-up (:class:`CostTable`) and the acceptance (tokens
committed per verify step) as the running average of recent speculative chunks. While plain steps run nothing
measures the acceptance, so every ``probe_every``-th chunk in a row of plain ones speculates again to refresh it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Seconds per step of each compiled step program over all slots, measured at start-up."""

    spec_step_seconds: float
    plain_step_seconds: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class LoadAdapter:
    """Chooses the step program of each chunk; see the module docstring.

    costs: the start-up table; acceptance: the starting estimate (tokens per verify step, >= 1); smoothing: the
    weight of a new chunk's acceptance in the running average; probe_every: speculate at least once in this many
    chunks.
    """

    def __init__(self, costs: CostTable, acceptance: float, smoothing: float = 0.3, probe_every: int = 8):
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing={smoothing!r}: expected a number in (0, 1]")
        if not isinstance(probe_every, int) or probe_every < 1:
            raise ValueError(f"probe_every={probe_every!r}: expected an integer >= 1")
        self.costs = costs
        self.acceptance = max(1.0, float(acceptance))
        self.smoothing = smoothing
        self.probe_every = probe_every
        self._plain_in_a_row = 0

    def speculative_rate(self) -> float:
        """Expected tokens per second per running slot with speculative steps."""
        return self.acceptance / self.costs.spec_step_seconds

    def plain_rate(self) -> float:
        return 1.0 / self.costs.plain_step_seconds

    def choose(self) -> bool:
        """True: the next chunk speculates."""
        if self.speculative_rate() >= self.plain_rate() or self._plain_in_a_row + 1 >= self.probe_every:
            self._plain_in_a_row = 0
            return True
        self._plain_in_a_row += 1
        return False

    def observe(self, speculated: bool, tokens: int, steps: int) -> None:
        """A chunk's outcome: ``tokens`` committed by ``steps`` verify steps over all running slots."""
        if speculated and steps > 0:
            self.acceptance += self.smoothing * (tokens / steps - self.acceptance)
