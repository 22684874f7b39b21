"""``jspec tune``: times every method spec="auto" weighs on this device now and caches the step costs under
``$JSPEC_HOME/auto``, so that later ``jspec generate`` runs choose by this device's timings rather than the step
costs the model ships (jspec/autotune/)."""

from __future__ import annotations

import argparse
import sys

from jspec.tools.generate_cmd import add_model_args, checked_max_seq_len, resolve_models
from jspec.tools.parallel_args import add_parallel_args, mesh_kwargs, start_processes


def add_tune_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    parser.add_argument("--batch-size", type=int, default=1,
                        help="prompts per call to time at (jspec generate's is its number of prompts)")
    parser.add_argument("--no-stream", action="store_true",
                        help="time whole generate calls (what jspec generate --no-stream / --json and several "
                             "prompts run) instead of one streamed prompt, one host sync per step")
    add_parallel_args(parser)


def run_tune(args: argparse.Namespace) -> int:
    import jspec
    from jspec.autotune import from_pretrained_auto
    from jspec.tools.compile_cache import jspec_home

    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size}: expected an integer >= 1")
    if args.drafter == "none":
        raise ValueError("--drafter none: jspec tune times drafters against plain decoding; name one, or none "
                         "for every drafter the model has")
    if args.quantization is not None:
        raise ValueError(f"--quantization {args.quantization}: jspec tune times the checkpoint's own weights (auto "
                         f"configuration does not cover quantized ones yet)")
    start_processes(args)
    model_dir, _, _ = resolve_models(args)
    max_seq_len = checked_max_seq_len(args.max_seq_len, model_dir)
    engine = from_pretrained_auto(jspec.SpecEngine, model_dir, args.drafter, max_batch_size=args.batch_size,
                                  max_seq_len=max_seq_len, dtype=args.dtype, cache_dir=jspec_home(),
                                  log=lambda line: print(f"[jspec] {line}", file=sys.stderr),
                                  streamed=args.batch_size == 1 and not args.no_stream, retime=True,
                                  **mesh_kwargs(args))
    print("\n".join(f"[jspec] {line}" for line in engine.auto_choice.describe().split("\n")))
    return 0
