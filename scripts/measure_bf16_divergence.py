"""Measures bf16 speculative-vs-plain divergence on the bundled model (docs/numerics.md).

    .venv/bin/python scripts/measure_bf16_divergence.py --start 0 --stop 48 --max-new-tokens 128

Prints one JSON report (see ``jspec.tools.numerics.measure``) and a summary against the stated bound.
"""

import argparse
import json

from jspec.tools import numerics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", type=int, default=0, help="first HumanEval prompt")
    parser.add_argument("--stop", type=int, default=48, help="one past the last HumanEval prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--drafters", nargs="+", default=["eagle3", "ngram"])
    parser.add_argument("--chunks", nargs="+", type=int, default=[4, 16], help="T of the T-token passes")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    report = numerics.measure(numerics.human_eval_prompts(args.start, args.stop),
                              max_new_tokens=args.max_new_tokens, drafters=tuple(args.drafters),
                              chunks=tuple(args.chunks), dtype=args.dtype, batch_size=args.batch_size)
    print(json.dumps(report, indent=1))
    bound = numerics.LOGIT_DIFF_BOUND
    print(f"stated bound: |verify - decode| logit <= {bound}; divergence only where plain top-2 gap <= {2 * bound}")
    print(f"measured max |T-token pass - decode step|: {report['logit_diff']} over {report['tokens']} tokens")
    for name, found in report["divergences"].items():
        gaps = sorted(d["top2_gap"] for d in found)
        ok = all(d["pick_gap"] <= 2 * bound for d in found)
        print(f"{name}: {len(found)} of {report['prompts']} prompts diverge; plain top-2 gaps there {gaps}; "
              f"all within 2 x bound: {ok}")


if __name__ == "__main__":
    main()
