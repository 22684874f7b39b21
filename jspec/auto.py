"""``spec="auto"``: the method (drafter and tree) with the most expected tokens per second, chosen from step costs
and acceptance.

Expected tokens per second of a method = (1 + mean accepted drafts per step) / seconds per step. The two factors
depend on different things: seconds per step on the device, the model, the tree and ``max_seq_len``; accepted
drafts per step on the model and drafter, not the device. Where each comes from (this device's timings cached on
disk, the model's shipped prior and calibration profile, timing runs now) is :mod:`jspec.autotune`'s business;
this module holds what is weighed (:func:`candidates`) and the choice itself (:func:`choose`).

Plain decoding is a candidate (0 accepted drafts, its own step cost), so auto picks it when no drafter pays; a
drafter must be expected to beat it by MIN_GAIN, since a smaller margin is inside the timings' noise.

One approximation: ``ngram+eagle3`` skips the head's drafting forwards on a step where lookup found a draft, and
under forced acceptance the committed drafts make the text repeat, so lookup keeps finding one. Its timed step is
therefore close to the lookup step (plus the head's commit), a lower bound on what a step costs on text where
lookup misses (docs/benchmarks.md compares the expected and the delivered speedup).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Sequence

from jspec.config import SpecConfig

# A drafter must be expected to beat plain decoding by this ratio (the step-cost timings' noise is a few %).
MIN_GAIN = 1.05


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One method auto may choose: a drafter name (None: plain decoding) and its tree."""

    drafter: str | None
    spec: SpecConfig | None

    @property
    def label(self) -> str:
        if self.drafter is None:
            return "plain"
        s = self.spec
        if s.tree == "chain":
            shape = f"chain {s.num_steps}"
        elif s.tree == "dynamic":
            shape = f"dynamic {s.num_steps}x{s.topk}/{s.num_draft_tokens}" + (
                " top1" if s.selection == "top1_chain" else "")
        else:
            shape = f"static {s.tree_size}"
        return f"{self.drafter} {shape}"


def _chain(n: int) -> SpecConfig:
    return SpecConfig(tree="chain", num_steps=n)


def _top1(steps: int, topk: int, tokens: int) -> SpecConfig:
    return SpecConfig(tree="dynamic", num_steps=steps, topk=topk, num_draft_tokens=tokens, selection="top1_chain")


# What auto considers per drafter: few shapes, because each costs one compile when it is timed on a device.
# The EAGLE-3 head's longer chain is left to "ngram+eagle3", which drafts the same chain with lookup in front (at
# least its acceptance, at most its cost plus a lookup). Its chain of 11 (the head drafts 7 of them) and not 7: a
# step where lookup misses verifies the head's 8 nodes either way, and only lookup's steps pay for the longer
# chain, which the timing here charges to every step (docs/results/history.md has the comparison).
CANDIDATE_SPECS: dict[str, tuple[SpecConfig, ...]] = {
    "ngram": (_chain(4), _chain(9)),
    "eagle3": (_chain(3), _top1(6, 3, 12), _top1(8, 4, 24)),
    "ngram+eagle3": (_chain(5), _chain(11)),
    "draft": (_chain(3), _chain(5)),
    "mtp": (_chain(1), _chain(3)),
}


def candidate_specs(drafter: str) -> tuple[SpecConfig, ...]:
    """The trees auto weighs for a drafter: CANDIDATE_SPECS by its name, or by the name a converted directory
    resolves to; a DFlash / DSpark directory's whole block as a chain and half of it; the n-gram shapes for any
    other name."""
    if drafter in CANDIDATE_SPECS:
        return CANDIDATE_SPECS[drafter]
    if os.path.isdir(drafter):
        from jspec.drafters import dflash, resolve

        name, path = resolve(drafter, None)
        if name == "dflash":
            whole = dflash.default_spec(path).num_steps
            return tuple(_chain(n) for n in sorted({max(1, whole // 2), whole}))
        return CANDIDATE_SPECS.get(name, CANDIDATE_SPECS["ngram"])
    return CANDIDATE_SPECS["ngram"]


def candidates(drafters: Sequence[str]) -> list[Candidate]:
    """Plain decoding, then :func:`candidate_specs` of each named drafter."""
    out = [Candidate(None, None)]
    for name in drafters:
        out += [Candidate(name, spec) for spec in candidate_specs(name)]
    return out


@dataclasses.dataclass(frozen=True)
class Estimate:
    candidate: Candidate
    accepted_per_step: float  # mean accepted drafts per verify step (0 for plain decoding)
    step_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return (1.0 + self.accepted_per_step) / self.step_seconds


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """The chosen method and every estimate behind it (best first)."""

    drafter: str | None
    spec: SpecConfig | None
    estimates: tuple[Estimate, ...]
    source: str  # where the numbers came from, for the user
    from_prior: bool = False  # the step costs are the model's shipped ones, not this device's (reject_prior)
    cache_path: str | None = None  # the JSON file this device's timings are cached in, None when not cached

    @property
    def best(self) -> Estimate:
        return self.estimates[0]

    @property
    def plain(self) -> Estimate:
        return next(e for e in self.estimates if e.candidate.drafter is None)

    @property
    def expected_speedup(self) -> float:
        return self.best.tokens_per_second / self.plain.tokens_per_second

    def summary(self) -> str:
        return (f"auto chose {self.best.candidate.label}: expected {self.expected_speedup:.2f}x plain decoding "
                f"({self.source})")

    def describe(self) -> str:
        """The whole table: what each candidate was expected to do, best first."""
        lines = [self.summary(), f"{'method':28s} {'accepted/step':>13s} {'step ms':>8s} {'tok/s':>8s} "
                                 f"{'vs plain':>8s}"]
        for e in self.estimates:
            lines.append(f"{e.candidate.label:28s} {e.accepted_per_step:13.2f} {e.step_seconds * 1e3:8.2f} "
                         f"{e.tokens_per_second:8.0f} {e.tokens_per_second / self.plain.tokens_per_second:7.2f}x")
        lines.append("expected tok/s = (1 + accepted drafts per step) / step seconds; plain decoding is a candidate")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"drafter": self.drafter, "spec": dataclasses.asdict(self.spec) if self.spec else None,
                "expected_speedup": self.expected_speedup, "source": self.source, "from_prior": self.from_prior,
                "candidates": [{"method": e.candidate.label, "accepted_per_step": e.accepted_per_step,
                                "step_ms": e.step_seconds * 1e3, "expected_tokens_per_second": e.tokens_per_second}
                               for e in self.estimates]}


def choose(accepted: dict[str, float], step_seconds: dict[str, float], pool: Sequence[Candidate],
           source: str = "", min_gain: float = 1.0) -> AutoChoice:
    """The candidate of ``pool`` with the most expected tokens/s. accepted / step_seconds: by candidate label
    (plain's acceptance is 0 by definition). A candidate missing from either is skipped; plain must be timed.
    A drafter is chosen only when it is expected to beat plain decoding by ``min_gain`` (a ratio >= 1): a
    smaller margin is inside the error of the estimate."""
    if min_gain < 1.0:
        raise ValueError(f"min_gain={min_gain}: expected a ratio >= 1")
    estimates = []
    for candidate in pool:
        label = candidate.label
        if label not in step_seconds or (candidate.drafter is not None and label not in accepted):
            continue
        if step_seconds[label] <= 0:
            raise ValueError(f"step_seconds[{label!r}]={step_seconds[label]}: expected a positive number")
        estimates.append(Estimate(candidate, 0.0 if candidate.drafter is None else float(accepted[label]),
                                  float(step_seconds[label])))
    if not any(e.candidate.drafter is None for e in estimates):
        raise ValueError("choose: plain decoding must be among the timed candidates")
    estimates.sort(key=lambda e: -e.tokens_per_second)
    plain = next(e for e in estimates if e.candidate.drafter is None)
    if estimates[0].tokens_per_second < min_gain * plain.tokens_per_second:
        estimates.remove(plain)
        estimates.insert(0, plain)
    best = estimates[0].candidate
    return AutoChoice(best.drafter, best.spec, tuple(estimates), source)


AUTO_DRAFTERS = ("eagle3", "ngram+eagle3", "draft", "ngram", "mtp")


def available_drafters(target_dir: str, drafter: str | os.PathLike | None) -> list[str]:
    """The drafters auto weighs for ``target_dir``: ``drafter`` alone when one is named (its trees), else every
    AUTO_DRAFTERS entry that resolves for this model (the bundled model has the head and the draft model)."""
    from jspec.drafters import resolve

    if drafter is not None:
        resolve(os.fspath(drafter), target_dir)
        return [os.fspath(drafter)]
    names = []
    for name in AUTO_DRAFTERS:
        try:
            resolve(name, target_dir)
        except (ValueError, FileNotFoundError):
            continue
        names.append(name)
    return names
