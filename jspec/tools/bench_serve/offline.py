"""The offline reference: ``SpecEngine.generate`` on the servers' engines and prompts, timed in every round, and
the median over rounds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class OfflineReference:
    """``SpecEngine.generate`` on the servers' engines and prompts, greedy, at batch 1 (one prompt per call) and at
    ``batch_size`` (prompts grouped by length, as ``jspec bench``). Everything compiles in the constructor; each
    :meth:`time` is one timed pass per engine. Tokens/s: new tokens / run seconds (``GenerateStats``: the compiled
    program's wall time, prefill included, compilation and host-side batching excluded, as ``jspec bench``)."""

    def __init__(self, engines: dict[str, Any], ids: Sequence[list[int]], max_tokens: int, batch_size: int):
        from jspec.tools.eval_acceptance import run_method

        self.engines, self.ids, self.max_tokens, self.batch_size = engines, ids, max_tokens, batch_size
        self._run = run_method
        for batch in dict.fromkeys((1, batch_size)):
            for engine in engines.values():
                run_method(engine, ids, batch, max_tokens)  # compiles every bucket

    def time(self, batch: int) -> dict[str, dict]:
        figures = {}
        for name, engine in self.engines.items():
            _, stats = self._run(engine, self.ids, batch, self.max_tokens)
            figures[f"{name}_batch{batch}"] = {
                "batch_size": batch, "tokens_per_second": stats["num_generated_tokens"] / stats["run_seconds"],
                "output_tokens": stats["num_generated_tokens"], "acceptance_length": stats["acceptance_length"],
                "run_seconds": stats["run_seconds"]}
            print(f"[bench-serve] offline {name} batch {batch}: "
                  f"{figures[f'{name}_batch{batch}']['tokens_per_second']:.1f} tokens/s", flush=True)
        return figures


def median_offline(rounds: Sequence[dict[str, dict]]) -> dict[str, Any]:
    """Per figure, the round with the median tokens/s (the rounds themselves are in the report), and the median
    over rounds of each round's batch-1 speedup."""
    merged: dict[str, Any] = {}
    for key in dict.fromkeys(k for r in rounds for k in r):
        figures = sorted((r[key] for r in rounds if key in r), key=lambda f: f["tokens_per_second"])
        merged[key] = {**figures[len(figures) // 2], "tokens_per_second_runs": [f["tokens_per_second"]
                                                                             for f in figures]}
    speedups = [r["spec_batch1"]["tokens_per_second"] / r["plain_batch1"]["tokens_per_second"]
                for r in rounds if "spec_batch1" in r and "plain_batch1" in r]
    if speedups:
        merged["speedup_batch1"] = float(np.median(speedups))
    return merged

