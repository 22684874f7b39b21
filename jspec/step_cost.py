"""Seconds per step of a compiled step program, the marginal cost of one more step: the estimator ``jspec.auto``
times its candidates with (the server's load adaptation prices whole chunks instead, what it pays once per chunk
included: ``jspec.serve.adapt``).

A run of n steps costs what it pays once (prefill, dispatch, a host sync) plus n times the step; so the step is the
difference between a long run and a short one over their difference in steps. Each is the fastest of a few runs,
because interference on a shared machine only ever slows a run down (the median of 2 let one disturbed run move a
first-run choice).
"""

from __future__ import annotations

from typing import Callable

MIN_STEP_SECONDS = 1e-7  # a floor, so a noisy difference never makes a step free


def step_seconds(run: Callable[[int], tuple[float, int]], *, short: int, long: int, repeats: int) -> float:
    """Seconds per step from ``run(steps) -> (seconds, steps it ran)``: one run of each length first (compiling
    and warming caches), then the fastest of ``repeats`` runs of ``long`` steps minus the fastest of ``repeats`` of
    ``short``, over their difference in steps."""
    run(short), run(long)
    shorts, longs = [], []
    for _ in range(repeats):
        shorts.append(run(short))
        longs.append(run(long))
    (t_short, n_short), (t_long, n_long) = min(shorts), min(longs)
    return max((t_long - t_short) / max(n_long - n_short, 1), MIN_STEP_SECONDS)
