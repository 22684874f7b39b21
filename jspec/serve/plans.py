"""What the scheduler hands the model runner per call (vLLM v1's scheduler output): plain host data, frozen."""

from __future__ import annotations

import dataclasses

from jspec.config import SamplingParams


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One chunk, as the scheduler decided it: ``rows`` (running rows, in program order; ``cancelled``: each one's
    request cancelled) stepped by ``program`` (adapt's FULL, SHORT or PLAIN) of the occupancy bucket ``bucket`` at
    context ``seq_len``, up to ``steps`` loop steps; lean: its form without the API features."""

    rows: tuple[int, ...]
    cancelled: tuple[bool, ...]
    program: str
    bucket: int
    seq_len: int
    steps: int
    lean: bool = False


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """One prefill call, as the scheduler decided it: ``items`` (each prompt's uncached rest, its parameters) into
    ``rows`` at prompt width ``width``; cached: None, or each prompt's tokens already in its pages (prefix-cache
    hits, earlier pieces), ``lengths`` its whole prompt; history and matchers: as :meth:`ModelRunner.prefill_arrays`
    takes them (None: fresh prompts, unconstrained)."""

    items: tuple[tuple[list[int], SamplingParams], ...]
    width: int
    rows: tuple[int, ...]
    cached: tuple[int, ...] | None = None
    lengths: tuple[int, ...] | None = None
    history: tuple[tuple[list[int] | None, int], ...] | None = None
    matchers: tuple | None = None
