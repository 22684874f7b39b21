"""Side-by-side timing of generation methods on the same prompts (used by scripts/benchmark.py).

Every method runs through the same engine API; the first call of each is a warm-up (compilation reported
apart), then ``repeats`` timed calls give the median. Each method's greedy output is compared token-for-token
with the first method's (drafter=None), and mismatches are counted, never hidden.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Sequence

import jspec


@dataclasses.dataclass
class MethodResult:
    method: str
    tokens_per_second: float
    acceptance_length: float
    speedup: float
    compile_seconds: float
    run_seconds: float
    num_generated_tokens: int
    mismatches: int
    accepted_per_position: list[float]


def time_method(engine: jspec.SpecEngine, prompts: Sequence, max_new_tokens: int, repeats: int):
    """-> (median tokens/s, last output, compile seconds of the warm-up)."""
    warm = engine.generate(prompts, max_new_tokens=max_new_tokens)
    speeds, out = [], warm
    for _ in range(repeats):
        out = engine.generate(prompts, max_new_tokens=max_new_tokens)
        speeds.append(out.stats.tokens_per_second)
    return statistics.median(speeds), out, warm.stats.compile_seconds


def compare_methods(engines: dict[str, jspec.SpecEngine], prompts: Sequence, max_new_tokens: int,
                    repeats: int = 3) -> list[MethodResult]:
    """engines: method name -> engine, the baseline (drafter=None) first."""
    results, baseline_tps, baseline_ids = [], None, None
    for name, engine in engines.items():
        tps, out, compile_seconds = time_method(engine, prompts, max_new_tokens, repeats)
        if baseline_ids is None:
            baseline_tps, baseline_ids = tps, out.token_ids
        mismatches = sum(a != b for a, b in zip(out.token_ids, baseline_ids))
        results.append(MethodResult(name, tps, out.stats.acceptance_length, tps / baseline_tps, compile_seconds,
                                    out.stats.run_seconds, out.stats.num_generated_tokens, mismatches,
                                    out.stats.accepted_per_position))
    return results


def format_table(results: list[MethodResult]) -> str:
    header = f"{'method':<22}{'tokens/s':>10}{'speedup':>9}{'accept':>8}{'compile s':>11}{'mismatch':>10}"
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(f"{r.method:<22}{r.tokens_per_second:>10.1f}{r.speedup:>8.2f}x{r.acceptance_length:>8.2f}"
                     f"{r.compile_seconds:>11.1f}{r.mismatches:>10d}")
    return "\n".join(lines)


def transformers_plain(hf_dir: str, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       repeats: int = 3) -> tuple[float, list[list[int]]]:
    """The CPU peer: transformers' greedy ``generate`` on the same weights -> (median tokens/s, outputs).

    Prompts run one at a time (no padding), so the outputs are the reference token for token.
    """
    import time

    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id

    def run():
        outputs, tokens, start = [], 0, time.perf_counter()
        with torch.no_grad():
            for prompt in prompts:
                ids = model.generate(torch.tensor([list(prompt)]), max_new_tokens=max_new_tokens, do_sample=False,
                                     eos_token_id=eos, pad_token_id=eos if eos is not None else 0)
                new = ids[0, len(prompt):].tolist()
                outputs.append(new)
                tokens += len(new)
        return tokens / (time.perf_counter() - start), outputs

    run()  # warm-up
    speeds, outputs = [], None
    for _ in range(repeats):
        speed, outputs = run()
        speeds.append(speed)
    return statistics.median(speeds), outputs
