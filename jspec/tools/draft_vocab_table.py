"""Acceptance against draft cost over the draft-vocabulary size N of one trained EAGLE-3 head
(scripts/draft_vocab_table.py).

For each N the head is cut to its N most frequent members (jspec.train.draft_vocab.shrink_draft_vocab: the kept
lm_head rows unchanged) and converted. Then, on the same HumanEval prompts, greedy, float32:

- acceptance length (pooled over all verify steps), and mismatches against plain decoding (must be 0);
- seconds per speculative step at batch 1 with force_accept=0 (jspec.autotune.measure_step_seconds), for the tree and
  for a chain of 3 (the draft-heavy and the verify-heavy case);
- token coverage: the fraction of the counting tokens that are draft-vocabulary members.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Callable, Sequence

import numpy as np

import jspec


def _engine_factory(target: str, head: str, max_seq_len: int, dtype: str):
    import logging

    def make_engine(candidate, force_accept):
        quiet = logging.getLogger("jspec").level
        logging.getLogger("jspec").setLevel(logging.ERROR)  # force_accept's benchmark warning: timing only
        try:
            return jspec.SpecEngine.from_pretrained(target, drafter=head, spec=candidate.spec, max_batch_size=1,
                                                    max_seq_len=max_seq_len, dtype=dtype, force_accept=force_accept)
        finally:
            logging.getLogger("jspec").setLevel(quiet)

    return make_engine


def draft_vocab_rows(target: str, head_hf: str, tokens: np.ndarray, sizes: Sequence[int], prompts: Sequence[str],
                     spec: jspec.SpecConfig, *, batch_size: int = 8, max_new_tokens: int = 128,
                     max_seq_len: int = 1024, dtype: str = "float32", repeats: int = 5,
                     log: Callable[[str], None] = print) -> list[dict]:
    """One row per N in ``sizes``: {draft_vocab_size, coverage, acceptance_length, mismatches,
    step_ms (the tree), chain3_step_ms, accepted_per_position}. ``head_hf``: the HF EAGLE-3 head to cut;
    ``tokens``: the text its draft vocabulary is counted on (the training data); ``repeats``: timing runs per
    step cost (their median)."""
    from jspec.auto import Candidate
    from jspec.autotune import measure_step_seconds
    from jspec.tools.eval_acceptance import run_method
    from jspec.train.draft_vocab import shrink_draft_vocab
    from models.checkpoint import convert_hf_checkpoint

    plain = jspec.SpecEngine.from_pretrained(target, max_batch_size=batch_size, max_seq_len=max_seq_len,
                                             dtype=dtype)
    ids = plain.encode(prompts)
    reference, _ = run_method(plain, ids, batch_size, max_new_tokens)
    counts = np.bincount(np.asarray(tokens, np.int64).ravel())
    timing_prompt = ids[0][-64:]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            cut = shrink_draft_vocab(head_hf, os.path.join(tmp, f"hf{size}"), size, tokens)
            head = convert_hf_checkpoint(cut, os.path.join(tmp, f"head{size}"), dtype=dtype, progress=False)
            with open(os.path.join(cut, "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
            from safetensors.numpy import load_file
            t2d = load_file(os.path.join(cut, "model.safetensors"))["t2d"]
            coverage = float(counts[:vocab][t2d[:len(counts)]].sum() / counts.sum())
            engine = jspec.SpecEngine.from_pretrained(target, drafter=head, spec=spec, max_batch_size=batch_size,
                                                      max_seq_len=max_seq_len, dtype=dtype)
            outputs, stats = run_method(engine, ids, batch_size, max_new_tokens)
            make_engine = _engine_factory(target, head, max_seq_len, dtype)
            step = measure_step_seconds(make_engine, Candidate("eagle3", spec), timing_prompt, repeats=repeats)
            chain = measure_step_seconds(make_engine, Candidate("eagle3", jspec.SpecConfig(tree="chain",
                                                                                           num_steps=3)),
                                         timing_prompt, repeats=repeats)
            row = {"draft_vocab_size": size, "coverage": coverage,
                   "acceptance_length": stats["acceptance_length"],
                   "mismatches": sum(a != b for a, b in zip(outputs, reference)),
                   "step_ms": step * 1e3, "chain3_step_ms": chain * 1e3,
                   "accepted_per_position": stats["accepted_per_position"]}
            log(format_row(row))
            rows.append(row)
    return rows


HEADER = "| draft vocab N | token coverage | acceptance | mismatches | tree step (ms) | chain-3 step (ms) |"


def format_row(row: dict) -> str:
    return (f"| {row['draft_vocab_size']} | {100 * row['coverage']:.1f} % | {row['acceptance_length']:.2f} | "
            f"{row['mismatches']} | {row['step_ms']:.2f} | {row['chain3_step_ms']:.2f} |")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draft_vocab_table", description=__doc__.split("\n\n")[0])
    parser.add_argument("--eagle3", required=True, help="an HF EAGLE-3 head (what train-drafter writes)")
    parser.add_argument("--tokens", required=True,
                        help=".npy of target token ids the vocabulary is counted on (train-drafter's "
                             "WORK_DIR/generated.npy)")
    parser.add_argument("--target", default=None, help="converted target (default: the bundled one)")
    parser.add_argument("--sizes", default="512,1024,2048,4096", help="comma-separated draft vocabulary sizes")
    parser.add_argument("--prompts", default=None, metavar="START:END", help="a slice of the 164 HumanEval prompts")
    parser.add_argument("--num-steps", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--num-draft-tokens", type=int, default=24)
    parser.add_argument("--selection", default="top1_chain", choices=["eagle2", "top1_chain"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timing runs per step cost (median)")
    parser.add_argument("--json", default=None, help="write the rows here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from jspec.tools.eval_acceptance import prompt_slice
    from jspec.train.corpus import human_eval_prompts

    args = build_parser().parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    problems = human_eval_prompts()
    if args.prompts:
        problems = problems[prompt_slice(args.prompts, len(problems))]
    spec = jspec.SpecConfig(tree="dynamic", num_steps=args.num_steps, topk=args.topk,
                            num_draft_tokens=args.num_draft_tokens, selection=args.selection)
    tokens = np.load(args.tokens)
    print(HEADER + "\n|---|---|---|---|---|---|")
    rows = draft_vocab_rows(args.target or jspec.bundled_model(), args.eagle3, tokens, sizes,
                            [p["prompt"] for p in problems], spec, max_new_tokens=args.max_new_tokens,
                            repeats=args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"eagle3": args.eagle3, "prompts": args.prompts or ":", "spec": vars(args), "rows": rows}, f,
                      indent=2)
    return 0
