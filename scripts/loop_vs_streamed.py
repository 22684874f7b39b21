"""Seconds per verify step of the fused loop (``generate``: prefill and every step in one program) against the same
steps driven from the host (``generate_start``, then ``generate_continue`` one step per call, a host sync each; and
all steps in one ``generate_continue`` call), per method, in one run: natural acceptance, greedy, one prompt at a
time, HumanEval prompts the auto estimator was not calibrated on.

    python scripts/loop_vs_streamed.py --json loop_vs_streamed.json

Each figure is a whole call's seconds over its verify steps (prefill included, as a caller pays it), the fastest
and the median of ``--rounds`` rounds over the prompts, after one warm round that compiles.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

METHODS = (("plain", None, None), ("ngram chain 9", "ngram", 9), ("eagle3 chain 3", "eagle3", 3),
           ("draft chain 3", "draft", 3), ("ngram+eagle3 chain 11", "ngram+eagle3", 11))


def per_step_seconds(engine, prompts: list[list[int]], new_tokens: int, rounds: int) -> dict[str, list[float]]:
    from jspec.generate import generate_continue, generate_start

    def fused(ids):
        stats = engine.generate([ids], max_new_tokens=new_tokens).stats
        return stats.num_verify_steps

    def streamed(ids, chunk):
        batch, params = engine._prepare([ids], new_tokens, 0.0, 0, 1.0, 0, None)
        args = engine._arguments(batch, params)
        setup = engine.setup.with_max_seq_len(batch.seq_len)
        state, inputs = generate_start(*args, setup=setup)
        steps = jnp.asarray(chunk, jnp.int32)
        while not bool(jax.device_get(state.done).all()):
            state = generate_continue(engine.params, engine.drafter_params, state, inputs, steps, setup=setup)
        return int(jax.device_get(state.num_steps)[0])

    modes = {"loop": fused, "streamed, a sync per step": lambda ids: streamed(ids, 1),
             "streamed, one call": lambda ids: streamed(ids, 1 << 20)}
    for ids in prompts:  # compiles every program once
        for run in modes.values():
            run(ids)
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(rounds):
        for ids in prompts:
            for mode, run in modes.items():
                start = time.perf_counter()
                steps = run(ids)
                seconds[mode].append((time.perf_counter() - start) / max(steps, 1))
    return seconds


def main(argv: list[str] | None = None) -> int:
    import jspec
    from jspec.train.corpus import human_eval_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="100:104", help="HumanEval prompt slice")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    first, last = (int(x) for x in args.prompts.split(":"))
    texts = [p["prompt"] for p in human_eval_prompts()][first:last]
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "methods": {}}
    print(f"{'method':<24}{'loop':>16}{'a sync per step':>18}{'one call':>16}   ms per verify step, min / median")
    for label, drafter, steps in METHODS:
        spec = None if drafter is None else jspec.SpecConfig(tree="chain", num_steps=steps)
        engine = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter=drafter, spec=spec,
                                                  max_batch_size=1, max_seq_len=1024)
        seconds = per_step_seconds(engine, engine.encode(texts), args.max_new_tokens, args.rounds)
        figures = {mode: {"min_ms": 1e3 * min(v), "median_ms": 1e3 * float(np.median(v))}
                   for mode, v in seconds.items()}
        report["methods"][label] = figures
        print(f"{label:<24}" + "".join(f"{f['min_ms']:>8.2f} / {f['median_ms']:<6.2f}"
                                       for f in figures.values()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
