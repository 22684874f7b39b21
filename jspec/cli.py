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
    parser.add_argument("prompts", nargs="*", default=["def fibonacci(n):"], help="prompt texts")
    parser.add_argument("--model", default=None,
                        help="converted checkpoint directory (default: the demo model, built on first use)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = disabled")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="compute dtype (default: the checkpoint's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run_generate(args: argparse.Namespace) -> int:
    import jspec
    from jspec.demo_model import ensure_demo_model

    model_dir = args.model
    if model_dir is None:
        model_dir = ensure_demo_model()
        if not args.json:
            print(f"[demo] using the tiny RANDOM-weight demo model at {model_dir}: output is gibberish by design")
    engine = jspec.SpecEngine.from_pretrained(model_dir, max_batch_size=max(1, len(args.prompts)),
                                              max_seq_len=args.max_seq_len, dtype=args.dtype)
    out = engine.generate(args.prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    stats = out.stats
    if args.json:
        print(json.dumps({"prompts": args.prompts, "texts": out.texts, "token_ids": out.token_ids,
                          "stats": stats.__dict__}))
        return 0
    for prompt, text in zip(args.prompts, out.texts or [str(t) for t in out.token_ids]):
        print(f"--- {prompt!r}\n{prompt}{text}")
    print(f"--- {stats.num_generated_tokens} tokens, {stats.tokens_per_second:.1f} tokens/s, acceptance length "
          f"{stats.acceptance_length:.2f}, {stats.num_verify_steps} target steps, compile "
          f"{stats.compile_seconds:.1f}s")
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
