"""auto's printed estimate against the speedup it then measures: what `jspec generate --json PROMPT` does, one
prompt at a time, on HumanEval prompts (auto is calibrated on openings of standard-library functions, never on
these), with a fresh auto cache so the choice is made from the step costs the bundled model ships.

    python scripts/check_auto_estimate.py --first 120 --count 8 --rounds 3 --json auto_estimate.json

Per prompt: the chosen engine's and plain decoding's tokens/s, each the median of ``--rounds`` timed ``generate``
calls after one warm-up call (as `jspec generate` times one), greedy, 128 new tokens, and their ratio. The
measured figure set beside the estimate is the geometric mean of the per-prompt ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--first", type=int, default=120, help="first HumanEval prompt (index)")
    parser.add_argument("--count", type=int, default=8, help="prompts, from --first on")
    parser.add_argument("--rounds", type=int, default=3, help="timed calls per prompt and engine")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="jspec generate's default")
    parser.add_argument("--max-seq-len", type=int, default=1024, help="jspec generate's default")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    if args.count < 1 or args.rounds < 1:
        parser.error(f"--count {args.count} and --rounds {args.rounds}: expected integers >= 1")

    import jspec
    from jspec.train.corpus import human_eval_prompts

    problems = human_eval_prompts()
    prompts = [p["prompt"] for p in problems[args.first:args.first + args.count]]
    if args.first < 0 or len(prompts) < args.count:
        parser.error(f"--first {args.first} --count {args.count}: HumanEval has prompts 0 to {len(problems) - 1}")
    with tempfile.TemporaryDirectory() as cache:
        engine = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), spec="auto", max_batch_size=1,
                                                  max_seq_len=args.max_seq_len, auto_cache_dir=cache)
    choice = engine.auto_choice
    print(choice.describe())
    if choice.drafter is None:
        print("auto chose plain decoding: nothing to compare")
        return 0
    plain = engine.plain()

    def tokens_per_second(which, prompt: str) -> float:
        which.generate([prompt], max_new_tokens=args.max_new_tokens)  # compiles, warms
        return statistics.median(which.generate([prompt], max_new_tokens=args.max_new_tokens).stats.tokens_per_second
                                 for _ in range(args.rounds))

    rows = []
    for i, prompt in enumerate(prompts, start=args.first):
        spec, base = tokens_per_second(engine, prompt), tokens_per_second(plain, prompt)
        acceptance = engine.generate([prompt], max_new_tokens=args.max_new_tokens).stats.acceptance_length
        rows.append({"prompt": i, "tokens_per_second": spec, "plain_tokens_per_second": base, "speedup": spec / base,
                     "acceptance_length": acceptance})
        print(f"HumanEval/{i}: {spec:7.1f} tok/s, plain {base:7.1f} -> {spec / base:.2f}x "
              f"(acceptance length {acceptance:.2f})")
    measured = math.exp(statistics.fmean(math.log(r["speedup"]) for r in rows))
    error = choice.expected_speedup / measured - 1.0
    print(f"auto chose {choice.best.candidate.label}: estimate {choice.expected_speedup:.2f}x, measured "
          f"{measured:.2f}x (geometric mean of {len(rows)} prompts), estimate off by {error:+.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"choice": choice.to_json(), "measured_speedup": measured, "estimate_error": error,
                       "prompts": rows, "args": vars(args), "jax": jax_version()}, f, indent=1)
    return 0


def jax_version() -> str:
    import jax

    return jax.__version__


if __name__ == "__main__":
    raise SystemExit(main())
