"""Timing one configuration through the public ``SpecEngine`` API: greedy, random prompts of ``prompt_len``
tokens, at one batch size:

- plain decoding (drafter=None), EAGLE-3 with a chain and a dynamic (EAGLE-2) tree, and a DFlash chain of its
  whole block, each forced to accept exactly k drafts per step (``SpecEngine(..., force_accept=k)``; a compile
  per k);
- step time: ``t(max_new_tokens=N) - t(max_new_tokens=1)`` (the second call is prefill only) divided by the
  verify steps the N-token call took, N = 1 + steps * (k + 1) so every row times ``steps`` loop iterations (fewer
  for the deepest DFlash commits: ``SyntheticShape.steps_for``) and every call lands in the same sequence bucket
  (2 * prompt_len). Median of ``repeats`` pairs after a warm-up.

Out-of-memory and other failures are recorded in the row, never raised.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from jspec.drafters.dflash import DFlashDrafter
from jspec.drafters.eagle3 import Eagle3Drafter
from jspec.engine import SpecEngine
from jspec.tools.roofline.floor import drafter_forwards, floor_bytes
from jspec.tools.roofline.plan import RowPlan
from jspec.tools.roofline.shapes import DFLASH, SyntheticModels


def make_engine(models: SyntheticModels, plan: RowPlan, mesh=None) -> SpecEngine:
    """An engine whose one sequence bucket (2 * prompt_len) holds every call of the row; on ``mesh`` (a
    ``jspec.sharding.make_mesh``) when given."""
    shape, seq_len = models.shape, 2 * models.shape.prompt_len
    spec = shape.spec(plan.method)
    if spec is None:
        return SpecEngine(models.target, models.params_t, max_batch_size=plan.batch, max_seq_len=seq_len,
                          dtype=shape.dtype, mesh=mesh)
    if plan.method == DFLASH:
        drafter = DFlashDrafter(models.dflash, models.target, spec, seq_len, shape.dtype)
    else:
        drafter = Eagle3Drafter(models.head, models.target, spec, seq_len, shape.dtype)
    return SpecEngine(models.target, models.params_t, drafter=drafter,
                      drafter_params=models.drafter_params(plan.method),
                      max_batch_size=plan.batch, max_seq_len=seq_len, dtype=shape.dtype,
                      force_accept=plan.force_accept, mesh=mesh)


def random_prompts(vocab_size: int, batch: int, length: int, seed: int) -> list[list[int]]:
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, length)).tolist()


def time_steps(engine: SpecEngine, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    """Warm-up (compiles) then ``repeats`` pairs of (prefill-only call, N-token call) -> timings in seconds.

    step_seconds = (median t_N - median t_1) / loop iterations of the N-token call."""
    warm = engine.generate(prompts, max_new_tokens=new_tokens)
    prefill_runs, full_runs, out = [], [], warm
    for _ in range(repeats):
        prefill_runs.append(engine.generate(prompts, max_new_tokens=1).stats.run_seconds)
        out = engine.generate(prompts, max_new_tokens=new_tokens)
        full_runs.append(out.stats.run_seconds)
    steps = out.stats.num_verify_steps / len(prompts)  # every row takes the same steps: lockstep acceptance
    prefill_s, full_s = statistics.median(prefill_runs), statistics.median(full_runs)
    return {"compile_seconds": warm.stats.compile_seconds, "prefill_seconds": prefill_s,
            "total_seconds": full_s, "prefill_runs": prefill_runs, "total_runs": full_runs,
            "verify_steps": steps, "acceptance_length": out.stats.acceptance_length,
            "step_seconds": (full_s - prefill_s) / steps if steps else float("nan")}


def is_out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def measure_row(models: SyntheticModels, plan: RowPlan, repeats: int, seed: int, mesh=None) -> dict:
    """Times one configuration -> its JSON row (status "ok", "oom" or "error"; never raises an Exception)."""
    shape = models.shape
    spec = shape.spec(plan.method)
    expected = 1 if spec is None else plan.force_accept + 1
    new_tokens = shape.new_tokens(expected)
    row = {**plan.key(), "tier": plan.tier, "new_tokens": new_tokens, "status": "ok", "error": None}
    start = time.perf_counter()
    try:
        engine = make_engine(models, plan, mesh)
        prompts = random_prompts(models.target.vocab_size, plan.batch, shape.prompt_len, seed)
        row.update(time_steps(engine, prompts, new_tokens, repeats))
    except Exception as error:  # noqa: BLE001 -- one failed configuration must not end the benchmark
        row["status"] = "oom" if is_out_of_memory(error) else "error"
        row["error"] = f"{type(error).__name__}: {str(error)[:2000]}"
    row["wall_seconds"] = time.perf_counter() - start
    if row["status"] == "ok":
        row["forced_acceptance_reached"] = abs(row["acceptance_length"] - expected) < 1e-6
        row["mean_context"] = shape.prompt_len + row["acceptance_length"] * (row["verify_steps"] - 1) / 2
        row["drafter_forwards_per_step"] = 0 if spec is None else drafter_forwards(plan.method, spec)
        row["floor_bytes"] = floor_bytes(models, plan.method, plan.batch, row["mean_context"])
        row["tokens_per_second"] = plan.batch * row["acceptance_length"] / row["step_seconds"]
    return row
