"""The ``jspec`` command: ``jspec generate`` and ``jspec convert``.

Bad input is reported as one readable line (exit code 2); ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import sys


def _add_convert_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--src", required=True, help="Hugging Face directory: config.json + *.safetensors "
                                                      "(a Llama-family target or an EAGLE-3 head)")
    parser.add_argument("--dst", required=True, help="output directory (must not exist unless --overwrite)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="parameter dtype (auto: the checkpoint's own)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --dst")


def run_convert(args: argparse.Namespace) -> int:
    from models.checkpoint import convert_hf_checkpoint

    out = convert_hf_checkpoint(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def _add_generate_args(parser: argparse.ArgumentParser) -> None:
    from jspec.bundled import DEFAULT_SPEC

    parser.add_argument("prompts", nargs="*", default=["def fibonacci(n):"], help="prompt texts")
    parser.add_argument("--model", default=None,
                        help="converted target directory (default: the bundled code model)")
    parser.add_argument("--drafter", default=None,
                        help="'eagle3' or 'draft' (the bundled head / draft model), 'ngram', 'none', or a converted "
                             "drafter directory (default: the bundled EAGLE-3 head without --model, none with it)")
    parser.add_argument("--tree", default=DEFAULT_SPEC.tree, choices=["chain", "static", "dynamic"])
    parser.add_argument("--num-draft-tokens", type=int, default=DEFAULT_SPEC.num_draft_tokens,
                        help="tree nodes per step, root included (chain: depth + 1)")
    parser.add_argument("--num-steps", type=int, default=DEFAULT_SPEC.num_steps, help="dynamic tree depth")
    parser.add_argument("--topk", type=int, default=DEFAULT_SPEC.topk, help="dynamic tree branching")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the plain-decoding run that the speedup is measured against")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = disabled")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="compute dtype (default: the checkpoint's; float32 for the bundled bf16 model, "
                             "faster on CPU)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _resolve_models(args: argparse.Namespace) -> tuple[str, str | None, str]:
    """-> (target dir, drafter (dir, "ngram" or None), a description for the user)."""
    from jspec.bundled import bundled_dir
    from jspec.demo_model import ensure_demo_model

    bundled = {"eagle3": bundled_dir("eagle3"), "draft": bundled_dir("draft")}
    drafter = args.drafter
    if args.model is not None:
        model_dir, what = args.model, args.model
    elif bundled_dir("target") is not None:
        model_dir, what = bundled_dir("target"), "the bundled code model (trained on the Python stdlib)"
        drafter = "eagle3" if drafter is None else drafter
    else:
        model_dir = ensure_demo_model()
        what = f"the tiny RANDOM-weight demo model at {model_dir} (no bundled model installed): gibberish by design"
    if drafter in bundled:
        if bundled[drafter] is None:
            raise ValueError(f"--drafter {drafter}: the bundled code model has no {drafter} part installed")
        drafter = bundled[drafter]
    if drafter == "none":
        drafter = None
    return model_dir, drafter, what


def run_generate(args: argparse.Namespace) -> int:
    import jspec
    from jspec.bundled import spec_for

    model_dir, drafter, what = _resolve_models(args)
    spec = spec_for(args.tree, args.num_draft_tokens, args.num_steps, args.topk) if drafter else None
    dtype = args.dtype or ("float32" if args.model is None else None)
    kwargs = dict(max_batch_size=max(1, len(args.prompts)), max_seq_len=args.max_seq_len, dtype=dtype)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed)
    engine = jspec.SpecEngine.from_pretrained(model_dir, drafter=drafter, spec=spec, **kwargs)
    out = engine.generate(args.prompts, **sampling)
    baseline = None
    if drafter is not None and not args.no_baseline:
        baseline = jspec.SpecEngine.from_pretrained(model_dir, **kwargs).generate(args.prompts, **sampling).stats
    stats = out.stats
    speedup = stats.tokens_per_second / baseline.tokens_per_second if baseline else None
    if args.json:
        print(json.dumps({"prompts": args.prompts, "texts": out.texts, "token_ids": out.token_ids,
                          "stats": stats.__dict__, "model": model_dir, "drafter": drafter,
                          "spec": spec.__dict__ if spec else None,
                          "baseline": baseline.__dict__ if baseline else None, "speedup": speedup}))
        return 0
    print(f"[jspec] target: {what}")
    if drafter is not None:
        print(f"[jspec] drafter: {drafter} ({spec.tree} tree, {spec.tree_size} tokens per step)")
    for prompt, text in zip(args.prompts, out.texts or [str(t) for t in out.token_ids]):
        print(f"--- {prompt!r}\n{prompt}{text}")
    print(f"--- {stats.num_generated_tokens} tokens, acceptance length {stats.acceptance_length:.2f} "
          f"({stats.num_verify_steps} target steps), {stats.tokens_per_second:.1f} tokens/s, compile "
          f"{stats.compile_seconds:.1f}s")
    if baseline is not None:
        print(f"--- plain decoding: {baseline.tokens_per_second:.1f} tokens/s -> speedup {speedup:.2f}x")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jspec", description="Speculative decoding in JAX.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from prompts")
    _add_generate_args(gen)
    gen.set_defaults(func=run_generate)
    conv = sub.add_parser("convert", help="convert a Hugging Face checkpoint to a jspec directory")
    _add_convert_args(conv)
    conv.set_defaults(func=run_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.debug:
        return args.func(args)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        print(f"jspec: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
