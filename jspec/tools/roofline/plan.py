"""The work order and the budget.

Configurations run by priority tier across all requested shapes (plain decoding and each tree's deepest k at the
two smallest batches, then at the larger ones, then each tree's k = 0, then the chain's other k, then the dynamic
tree's; see ``_tier``). A configuration whose estimated cost (the largest one of the same shape and method so
far) no longer fits the budget is skipped and listed under ``skipped``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

from jspec.config import SpecConfig
from jspec.tools.roofline.shapes import CHAIN, METHODS, PLAIN, SPECULATIVE, SyntheticModels


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """One configuration to time; ``tier`` orders the work (lower first)."""

    model: str
    batch: int
    method: str
    force_accept: int | None
    tier: int

    def key(self) -> dict:
        return {"batch": self.batch, "method": self.method, "force_accept": self.force_accept}


def accept_counts(spec: SpecConfig, force_accepts: Sequence[int] | None) -> list[int]:
    """The forced acceptances timed for ``spec``: 0..max_depth, or the requested ones that fit the depth."""
    depth = spec.max_depth
    wanted = range(depth + 1) if force_accepts is None else force_accepts
    return sorted({k for k in wanted if 0 <= k <= depth})


def _tier(method: str, k: int | None, counts: Sequence[int], batch_rank: int) -> int:
    """0: plain and each tree's deepest k at the two smallest batches; 1: the same at larger batches;
    2: each tree's smallest k; 3: the chain's other k; 4: the dynamic tree's other k.

    A step's cost does not depend on k (static shapes), so the deepest k of each tree already gives its step
    time; the other k re-measure it at other acceptance lengths."""
    batch_tier = 0 if batch_rank < 2 else 1
    if method == PLAIN or k == counts[-1]:
        return batch_tier
    if k == counts[0]:
        return 2
    return 3 if method == CHAIN else 4


def plan_rows(models: Sequence[SyntheticModels], batches: Sequence[int], force_accepts: Sequence[int] | None,
              methods: Sequence[str] = METHODS) -> list[RowPlan]:
    """Every configuration of ``methods``, highest priority first: by tier, then batch, model, method, k."""
    batches = sorted(set(batches))
    plans = []
    for model_rank, m in enumerate(models):
        for batch_rank, batch in enumerate(batches):
            if PLAIN in methods:
                plans.append((RowPlan(m.name, batch, PLAIN, None, _tier(PLAIN, None, (), batch_rank)), model_rank))
            for method in SPECULATIVE:
                if method not in methods:
                    continue
                counts = accept_counts(m.shape.spec(method), force_accepts)
                for k in counts:
                    plans.append((RowPlan(m.name, batch, method, k, _tier(method, k, counts, batch_rank)),
                                  model_rank))
    plans.sort(key=lambda p: (p[0].tier, p[0].batch, p[1], METHODS.index(p[0].method), p[0].force_accept or 0))
    return [plan for plan, _ in plans]


class Budget:
    """Decides which configurations still start: within the wall-clock budget, and not at a batch that already
    ran out of memory for the same shape and method at a batch no larger."""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.perf_counter()
        self._cost: dict[tuple[str, str], tuple[float, int]] = {}  # (model, method) -> (max wall, max batch)
        self._oom_batch: dict[tuple[str, str], int] = {}  # (model, method) -> smallest batch out of memory

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def estimate(self, plan: RowPlan) -> float:
        """The costliest configuration of this model and method so far (x1.5 for a larger batch); else of
        this model; 0 when nothing was timed yet."""
        seen = self._cost.get((plan.model, plan.method))
        if seen is None:
            same_model = [wall for (model, _), (wall, _) in self._cost.items() if model == plan.model]
            return max(same_model, default=0.0)
        wall, batch = seen
        return wall * (1.5 if plan.batch > batch else 1.0)

    def skip_reason(self, plan: RowPlan) -> str | None:
        oom_batch = self._oom_batch.get((plan.model, plan.method))
        if oom_batch is not None and plan.batch >= oom_batch:
            return f"out of memory at batch {oom_batch}"
        estimate = self.estimate(plan)
        if self.elapsed + estimate > self.seconds:
            return f"budget: {self.elapsed:.0f} s of {self.seconds:.0f} s elapsed, ~{estimate:.0f} s needed"
        return None

    def record(self, plan: RowPlan, row: dict) -> None:
        key = (plan.model, plan.method)
        wall_max, batch_max = self._cost.get(key, (0.0, 0))
        self._cost[key] = (max(wall_max, row["wall_seconds"]), max(batch_max, plan.batch))
        if row["status"] == "oom":
            self._oom_batch[key] = min(plan.batch, self._oom_batch.get(key, plan.batch))
