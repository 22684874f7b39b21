"""Tokens/s and acceptance of each method side by side, on the same prompts, in one run.

    python scripts/benchmark.py --target DIR [--eagle3 DIR] [--max-new-tokens 64] [--batch 1] [--json OUT]
    python scripts/benchmark.py --tiny-distilled      # no checkpoints: tiny near-bigram target + distilled head
    python scripts/benchmark.py --target DIR --hf HF_DIR   # also transformers' generate on the same weights

Methods: drafter=None (the baseline), then EAGLE-3 with chain, static and dynamic trees when a head is given.
Greedy; every method's output is compared with the baseline's token for token.
"""

import argparse
import dataclasses
import json
import sys

import numpy as np

import jspec
from jspec.bench import MethodResult, compare_methods, format_table, transformers_plain

STATIC_CHOICES = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0))


def spec_configs(num_steps: int, topk: int, num_draft_tokens: int) -> dict[str, jspec.SpecConfig]:
    return {"eagle3-chain": jspec.SpecConfig(tree="chain", num_steps=num_steps),
            "eagle3-static": jspec.SpecConfig(tree="static", tree_choices=STATIC_CHOICES),
            "eagle3-dynamic": jspec.SpecConfig(tree="dynamic", num_steps=num_steps, topk=topk,
                                               num_draft_tokens=num_draft_tokens)}


def engines_from_dirs(args) -> tuple[dict, list]:
    kwargs = dict(max_batch_size=args.batch, max_seq_len=args.max_seq_len)
    engines = {"plain": jspec.SpecEngine.from_pretrained(args.target, **kwargs)}
    if args.eagle3:
        for name, spec in spec_configs(args.num_steps, args.topk, args.num_draft_tokens).items():
            engines[name] = jspec.SpecEngine.from_pretrained(args.target, drafter=args.eagle3, spec=spec, **kwargs)
    prompts = [" ".join(["def f(x):"] * 3)] * args.batch
    return engines, prompts


def engines_tiny_distilled(args) -> tuple[dict, list]:
    sys.path.insert(0, ".")
    from jspec.drafters.eagle3 import Eagle3Drafter
    from tests import spec_fixtures as fx

    target = fx.near_bigram_target()
    head = fx.distilled_head(target)
    engines = {"plain": fx.plain_engine(target, max_batch_size=args.batch)}
    for name, spec in spec_configs(args.num_steps, args.topk, args.num_draft_tokens).items():
        drafter = Eagle3Drafter(fx.HEAD, fx.TARGET, spec, fx.MAX_SEQ_LEN)
        engines[name] = jspec.SpecEngine(fx.TARGET, target, drafter=drafter, drafter_params=head,
                                         max_batch_size=args.batch, max_seq_len=fx.MAX_SEQ_LEN)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, fx.TARGET.vocab_size, 5).tolist() for _ in range(args.batch)]
    return engines, prompts


def transformers_row(args, plain_engine, prompts, baseline: MethodResult) -> MethodResult:
    ids = plain_engine._encode(prompts)
    tps, outputs = transformers_plain(args.hf, ids, args.max_new_tokens, args.repeats)
    expected = plain_engine.generate(prompts, max_new_tokens=args.max_new_tokens).token_ids
    mismatches = sum(a != b for a, b in zip(outputs, expected))
    return MethodResult("transformers-plain", tps, 1.0, tps / baseline.tokens_per_second, 0.0, 0.0,
                        sum(len(o) for o in outputs), mismatches, [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target")
    parser.add_argument("--eagle3")
    parser.add_argument("--tiny-distilled", action="store_true")
    parser.add_argument("--hf", help="the HF directory --target was converted from: adds transformers' plain "
                                     "generate (batch 1, CPU) as a peer")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--num-steps", type=int, default=4)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--num-draft-tokens", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not args.tiny_distilled and not args.target:
        parser.error("give --target DIR (optionally --eagle3 DIR) or --tiny-distilled")
    engines, prompts = engines_tiny_distilled(args) if args.tiny_distilled else engines_from_dirs(args)
    results = compare_methods(engines, prompts, args.max_new_tokens, args.repeats)
    if args.hf:
        results.append(transformers_row(args, engines["plain"], prompts, results[0]))
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
