"""Measuring what auto chooses by: a candidate's seconds per step (two timing runs of different lengths at its
expected acceptance, forced: prefill and dispatch cancel; through ``stream`` for a caller streaming one prompt, one
host sync per step) and its accepted drafts per step on the calibration prompts (cut from the Python standard
library, not from HumanEval)."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from jspec.auto import Candidate, candidates
from jspec.calibration_prompts import CALIBRATION_PROMPTS
from jspec.step_cost import step_seconds

# Tokens generated per calibration prompt: `jspec generate`'s default --max-new-tokens. Acceptance grows along a
# completion (a small model repeats itself more as it goes, and prompt lookup finds more), so a shorter
# calibration undercounts it: on the bundled model the n-gram chain of 4 accepted 0.55 drafts per step over 64
# tokens, 1.03 over 128.
CALIBRATION_NEW_TOKENS = 128


def measure_step_seconds(make_engine: Callable[[Candidate, int | None], object], candidate: Candidate,
                         prompt: list[int], short: int = 4, long: int = 24, repeats: int = 5, accept: int = 0,
                         streamed: bool = False) -> float:
    """Seconds per step of ``candidate``: ``make_engine(candidate, force_accept)`` runs with force_accept=``accept``
    (every step commits accept + 1 tokens, as a step at that acceptance would); the fastest of ``repeats`` runs of
    ``long`` steps minus the fastest of ``repeats`` of ``short``, over their difference in steps
    (``jspec.step_cost.step_seconds``). ``streamed``: the runs go through ``engine.stream`` one step per chunk, so
    each step also pays its host sync (what a caller streaming one prompt sees); else through ``generate`` (the
    whole loop on the device)."""
    engine = make_engine(candidate, None if candidate.drafter is None else accept)
    per_step = 1 if candidate.drafter is None else accept + 1

    def run(steps: int) -> tuple[float, int]:
        new_tokens = steps * per_step + 1
        if not streamed:
            stats = engine.generate([prompt], max_new_tokens=new_tokens).stats
            return stats.run_seconds, stats.num_verify_steps
        started, chunks = time.perf_counter(), 0
        for _ in engine.stream([prompt], max_new_tokens=new_tokens):
            chunks += 1
        return time.perf_counter() - started, chunks - 1

    # its first runs compile both (their token slots may fall in different power-of-two buckets)
    return step_seconds(run, short=short, long=long, repeats=repeats)


def measure_acceptance(make_engine: Callable[[Candidate, int | None], object], candidate: Candidate,
                       prompts: Sequence[list[int]],
                       max_new_tokens: int = CALIBRATION_NEW_TOKENS) -> float:
    """Mean accepted drafts per verify step of ``candidate`` over ``prompts`` (greedy, one prompt at a time)."""
    engine = make_engine(candidate, None)
    committed = steps = 0.0
    for prompt in prompts:
        stats = engine.generate([prompt], max_new_tokens=max_new_tokens).stats
        committed += stats.acceptance_length * stats.num_verify_steps
        steps += stats.num_verify_steps
    return committed / max(steps, 1.0) - 1.0


def timing_key(candidate: Candidate, accept: int, streamed: bool) -> str:
    return f"{candidate.label} | accept {accept} | {'streamed' if streamed else 'loop'}"


def timed_acceptance(candidate: Candidate, accepted: float) -> int:
    """The force_accept a candidate's step is timed at: its expected accepted drafts, rounded, within its depth."""
    return 0 if candidate.drafter is None else max(0, min(round(accepted), candidate.spec.num_steps))


def calibration_prompts(tokenize: Callable[[str], list[int]], max_seq_len: int) -> tuple[list[list[int]], int]:
    """(CALIBRATION_PROMPTS as token ids, new tokens per prompt), fitted to ``max_seq_len``: at most half of it
    generated, each prompt cut to its last tokens."""
    new_tokens = max(2, min(CALIBRATION_NEW_TOKENS, max_seq_len // 2))
    return [tokenize(p)[-(max_seq_len - new_tokens):] for p in CALIBRATION_PROMPTS], new_tokens


def timing_prompt(tokenize: Callable[[str], list[int]], max_seq_len: int) -> list[int]:
    """The prompt every candidate's step is timed on: CALIBRATION_PROMPTS joined, a code prompt's length (a
    couple of hundred tokens: with CALIBRATION_NEW_TOKENS more, the cache size a `jspec generate` of a typical
    code prompt runs at), cut to its last ``max_seq_len // 4`` tokens where the cache is smaller."""
    return tokenize("\n\n".join(CALIBRATION_PROMPTS))[-max(1, max_seq_len // 4):]


def timing_run_lengths(prompt_len: int, per_step: int, max_seq_len: int,
                       new_tokens: int = CALIBRATION_NEW_TOKENS) -> tuple[int, int]:
    """(short, long) verify steps of a step's two timing runs (:func:`measure_step_seconds`), each committing
    ``per_step`` tokens a step after the prefill's one. Every candidate's runs use the token slots (the cache
    size, ``jspec.batching.pad_batch``'s bucket) of this prompt and ``new_tokens``: attention reads the whole
    cache, so a step's cost depends on it, and the candidates are compared as the same call would run them. The
    long run fills those slots, the short one needs them just as well: one compiled program, differing in steps
    only (a long run on a larger cache than the short one's made the fused loop's step look dearer than the same
    step streamed)."""
    from jspec.batching import next_power_of_two, prompt_bucket

    width = prompt_bucket(prompt_len, max_seq_len)
    slots = lambda steps: min(next_power_of_two(width + steps * per_step + 1), max_seq_len)  # noqa: E731
    target = slots(-(-new_tokens // per_step))
    long = max(2, (target - width - 1) // per_step)
    short = next(n for n in range(1, long + 1) if slots(n) == slots(long))
    return min(short, long - 1), long


def time_candidates(make_engine: Callable[[Candidate, int | None], object], pool: Sequence[Candidate],
                    accepted: dict[str, float], prompt: list[int], *, max_seq_len: int, streamed: bool,
                    log: Callable[[str], None] = lambda s: None) -> dict[str, float]:
    """{timing key: seconds per step} of every candidate of ``pool``, each timed at its expected acceptance
    (``accepted``: {label: accepted drafts per step}) on ``prompt`` (:func:`measure_step_seconds`)."""
    timings = {}
    for candidate in pool:
        accept = timed_acceptance(candidate, accepted.get(candidate.label, 0.0))
        short, long = timing_run_lengths(len(prompt), 1 if candidate.drafter is None else accept + 1, max_seq_len)
        key = timing_key(candidate, accept, streamed)
        timings[key] = measure_step_seconds(make_engine, candidate, prompt, short=short, long=long,
                                            accept=accept, streamed=streamed)
        log(f"auto:   {candidate.label}: {timings[key] * 1e3:.2f} ms per step")
    return timings


def calibrate_profile(drafters: Sequence[str], make_engine: Callable[[Candidate, int | None], object],
                      tokenize: Callable[[str], list[int]],
                      max_new_tokens: int = CALIBRATION_NEW_TOKENS) -> dict:
    """{"accepted": {label: accepted drafts per step}, ...} of every candidate of ``drafters`` on
    CALIBRATION_PROMPTS (greedy): the profile a model ships as PROFILE_FILE (scripts/calibrate_auto.py)."""
    prompts = [tokenize(p) for p in CALIBRATION_PROMPTS]
    accepted = {c.label: measure_acceptance(make_engine, c, prompts, max_new_tokens)
                for c in candidates(drafters) if c.drafter is not None}
    return {"accepted": accepted, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "note": "mean accepted drafts per verify step, greedy, float32, one prompt at a time; "
                    "written by scripts/calibrate_auto.py"}
