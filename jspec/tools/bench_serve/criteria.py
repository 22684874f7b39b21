"""The three checks of a run (see ``jspec.tools.bench_serve.run``): per round, then the median over rounds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jspec.tools.bench_serve.figures import PassSummary
from jspec.tools.bench_serve.schedule import SEQUENTIAL, rate_label


def criteria(passes: Sequence[PassSummary], offline: dict[str, Any] | None, batch_size: int) -> list[dict]:
    """The three checks (``jspec.tools.bench_serve.run``'s docstring) on one round, each {"name", "ratio", "low",
    "high" (None: no upper bound), "detail"}; a check whose figures the round lacks is left out. (c)'s ratio is its
    worst rate's; "per_rate" has them all."""
    by = {(p.server, p.rate): p for p in passes}
    checks = []
    seq_spec, seq_plain = by.get(("spec", SEQUENTIAL)), by.get(("plain", SEQUENTIAL))
    if offline and "spec_batch1" in offline and seq_spec and seq_plain and seq_plain.output_throughput > 0:
        served = seq_spec.output_throughput / seq_plain.output_throughput
        alone = offline["spec_batch1"]["tokens_per_second"] / offline["plain_batch1"]["tokens_per_second"]
        checks.append({"name": "(a) server speedup, one request at a time / offline speedup at batch 1",
                       "ratio": served / alone, "low": 0.90, "high": 1.10,
                       "detail": f"{served:.2f}x / {alone:.2f}x"})
    saturated, key = by.get(("spec", math.inf)), f"spec_batch{batch_size}"
    if offline and saturated and key in offline:
        reference = offline[key]["tokens_per_second"]
        checks.append({"name": f"(b) spec server at saturation / offline spec generate at batch {batch_size}",
                       "ratio": saturated.output_throughput / reference, "low": 0.80, "high": None,
                       "detail": f"{saturated.output_throughput:.0f} / {reference:.0f} tokens/s"})
    rates = [p.rate for p in passes if p.server == "spec" and ("plain", p.rate) in by]
    if rates:
        per_rate = {rate_label(r): by[("spec", r)].output_throughput / max(by[("plain", r)].output_throughput, 1e-9)
                    for r in rates}
        checks.append({"name": "(c) spec server / plain server, output tokens/s, worst rate",
                       "ratio": min(per_rate.values()), "low": 0.95, "high": None, "per_rate": per_rate,
                       "detail": ", ".join(f"{r}: {v:.2f}x" for r, v in per_rate.items())})
    return checks


def combine_checks(rounds: Sequence[Sequence[dict]]) -> list[dict]:
    """Each check over the rounds: its median ratio (for (c): per rate, then the worst) against its bounds ->
    {"name", "ratio", "ratios" (per round), "target", "holds", "measured"}."""
    combined = []
    for name in dict.fromkeys(c["name"] for r in rounds for c in r):
        mine = [c for r in rounds for c in r if c["name"] == name]
        if "per_rate" in mine[0]:
            per_rate = {rate: float(np.median([c["per_rate"][rate] for c in mine if rate in c["per_rate"]]))
                        for rate in mine[0]["per_rate"]}
            ratio = min(per_rate.values())
        else:
            per_rate, ratio = None, float(np.median([c["ratio"] for c in mine]))
        low, high = mine[0]["low"], mine[0]["high"]
        target = f">= {low:.2f}" if high is None else f"{low:.2f}..{high:.2f}"
        measured = (f"median {ratio:.2f}" if per_rate is None else
                    "median per rate " + ", ".join(f"{r}: {v:.2f}x" for r, v in per_rate.items()))
        combined.append({"name": name, "ratio": ratio, "ratios": [c["ratio"] for c in mine], "target": target,
                         "holds": low <= ratio and (high is None or ratio <= high), "per_rate": per_rate,
                         "measured": f"{measured} (rounds: " + "; ".join(c["detail"] for c in mine) + ")"})
    return combined

