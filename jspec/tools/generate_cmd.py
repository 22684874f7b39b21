"""``jspec generate``: speculative generation from the command line, streamed for one prompt, timed against plain
decoding on the same weights."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from typing import Any, Callable

from jspec.detokenize import TextStream
from jspec.tools.parallel_args import add_parallel_args, mesh_kwargs, start_processes

DEFAULT_MAX_SEQ_LEN = 1024

def _token_ids(text: str) -> list[int]:
    """argparse type of --stop-token-ids: "2,13" -> [2, 13]."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated token ids, e.g. 2,13") from None


def _structured_outputs(text: str):
    """argparse type of --structured-outputs: vLLM's fields as JSON, checked now."""
    from jspec.structured_outputs import StructuredOutputsParams

    try:
        return StructuredOutputsParams.coerce(json.loads(text))
    except (ValueError, TypeError) as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", default=["def fibonacci(n):"],
                        help="prompt texts (one prompt is streamed as it is generated)")
    parser.add_argument("--chat", action="store_true",
                        help="each prompt is a user message, rendered with the model's chat template "
                             "(tokenizer_config.json); generation also stops at its end-of-turn token")
    add_model_args(parser)
    add_tree_args(parser)
    sampling = parser.add_argument_group("sampling (as in vLLM / Hugging Face)")
    sampling.add_argument("--max-new-tokens", "--max-tokens", dest="max_new_tokens", type=int, default=128,
                          help="new tokens per prompt at most")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    sampling.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    sampling.add_argument("--top-p", type=float, default=1.0, help="1.0 = disabled")
    sampling.add_argument("--seed", type=int, default=0, help="seed of the sampling keys")
    sampling.add_argument("--stop-token-ids", type=_token_ids, action="extend", default=None, metavar="IDS",
                          help="comma-separated token ids that end a sequence (kept in the output), besides EOS")
    sampling.add_argument("--structured-outputs", type=_structured_outputs, default=None, metavar="JSON",
                          help='constrain the output, as vLLM\'s structured_outputs: {"json": SCHEMA}, {"regex": '
                               '"..."}, {"choice": [...]}, {"grammar": "LARK"} or {"json_object": true} '
                               '(jspec.structured_outputs; not streamed)')
    output = parser.add_argument_group("output")
    output.add_argument("--no-stream", action="store_true",
                        help="print the completion at the end (several prompts are never streamed)")
    output.add_argument("--no-baseline", action="store_true",
                        help="skip the plain-decoding run that the speedup is measured against")
    output.add_argument("--json", action="store_true", help="print one JSON object instead of text (no streaming)")
    output.add_argument("--verbose", action="store_true",
                        help="print every method auto weighed (expected acceptance, step cost, tokens/s) and why")
    add_parallel_args(parser)


def add_model_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """--model, --drafter, --max-seq-len, --dtype (generate and serve); returns their group."""
    models = parser.add_argument_group("models")
    models.add_argument("--model", default=None,
                        help="converted target directory (default: the bundled code model)")
    models.add_argument("--drafter", default=None,
                        help="a drafter name (jspec.drafters.DRAFTERS: 'eagle3' / 'draft' are the bundled head / draft "
                             "model, 'ngram' prompt lookup, 'mtp' / 'mtp_vanilla' the MTP modules inside the --model "
                             "checkpoint; or a user drafter's, registered by an entry point in the "
                             "group jspec.drafters: docs/drafters.md), 'none', or a converted drafter directory "
                             "(jspec generate's default without --model: auto, the drafter and tree with the most "
                             "expected tokens/s on this device, plain decoding included (jspec/auto.py); none with "
                             "--model)")
    models.add_argument("--max-seq-len", type=int, default=None,
                        help=f"token slots per sequence: prompt + new tokens (default: {DEFAULT_MAX_SEQ_LEN}, or the "
                             f"model's max_position_embeddings if smaller)")
    models.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="compute dtype (default: float32 on a CPU, the checkpoint's own on a GPU/TPU)")
    models.add_argument("--quantization", "-q", default=None, choices=["int8", "fp8", "int4", "none"],
                        help="weight-only quantization of the target's and drafter's linear layers at load (qwix; "
                             "int4 in groups of 128 input features); output equals plain decoding of the same "
                             "quantized target")
    return models


def add_tree_args(parser: argparse.ArgumentParser) -> None:
    """The draft tree's flags (generate and serve)."""
    tree = parser.add_argument_group("draft tree (jspec generate's default: auto, the tree with the most expected "
                                     "tokens/s on this device; otherwise a chain of 10 tokens for ngram, a dynamic "
                                     "tree of 32 tokens, depth 8, top-4, keeping the top-1 chain, for model "
                                     "drafters)")
    tree.add_argument("--tree", default=None, choices=["chain", "static", "dynamic"],
                      help="shape of the draft tree")
    tree.add_argument("--num-draft-tokens", type=int, default=None,
                      help="tree nodes per step, root included (chain: depth + 1)")
    tree.add_argument("--num-steps", type=int, default=None, help="dynamic tree depth")
    tree.add_argument("--topk", type=int, default=None, help="dynamic tree branching")
    tree.add_argument("--selection", default=None, choices=["eagle2", "top1_chain"],
                      help="dynamic tree: keep the drafter's top-1 chain to full depth (top1_chain) or only the "
                           "best cumulative scores (eagle2)")
    tree.add_argument("--kernels", default=None,
                      choices=["auto", "pallas", "interpret", "tpu", "tpu_interpret", "reference"],
                      help="lowering of the tree kernels (tree build, verify, tree attention): auto = Pallas on a "
                           "GPU, Mosaic on a TPU, jnp elsewhere (SpecConfig.kernels)")


def resolve_models(args: argparse.Namespace) -> tuple[str, str | None, str]:
    """-> (target dir, drafter as SpecEngine.from_pretrained takes it (a registered name, a directory, or None),
    a description of the target for the user). The drafter is checked against the registry now, before loading."""
    import jax

    from jspec.bundle import bundled_dir
    from jspec.drafters import resolve
    from jspec.tools.bundled import default_method
    from jspec.tools.demo_model import ensure_demo_model

    drafter = args.drafter
    if args.model is not None:
        model_dir, what = args.model, args.model
    elif bundled_dir("target") is not None:
        model_dir, what = bundled_dir("target"), "the bundled code model (trained on the Python stdlib)"
        drafter = default_method(jax.default_backend())[0] if drafter is None else drafter
    else:
        model_dir = ensure_demo_model()
        what = f"the tiny RANDOM-weight demo model at {model_dir} (no bundled model installed): gibberish by design"
    if drafter == "none":
        drafter = None
    if drafter is not None:
        resolve(drafter, model_dir)
    return model_dir, drafter, what


def _check_prompts(prompts: list[str]) -> None:
    """Refuses an empty or all-whitespace prompt text (a tokenizer that adds BOS would otherwise turn it into a
    one-token prompt and generate from nothing)."""
    for i, prompt in enumerate(prompts):
        if not prompt.strip():
            raise ValueError(f"prompt {i} is {'empty' if not prompt else 'only whitespace'} ({prompt!r}): give the "
                             f"text to continue")


def checked_max_seq_len(requested: int | None, model_dir: str) -> int:
    """--max-seq-len (default: DEFAULT_MAX_SEQ_LEN, or the model's max_position_embeddings if smaller), checked
    against the model's config.json before anything loads. Without a config.json, loading the model reports what
    is wrong with the directory."""
    from models.config import load_hf_config

    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return DEFAULT_MAX_SEQ_LEN if requested is None else requested
    config = load_hf_config(model_dir)
    max_seq_len = min(DEFAULT_MAX_SEQ_LEN, config.max_position_embeddings) if requested is None else requested
    config.check_max_seq_len(max_seq_len)
    return max_seq_len


_ENGINE_LENGTHS = re.compile(r"(?<![\w.-])(max_seq_len|max_new_tokens)\b(=)?")


def as_flags(message: str) -> str:
    """An engine error in the CLI's terms: ``max_seq_len=32`` -> ``--max-seq-len 32`` (and max_new_tokens)."""
    return _ENGINE_LENGTHS.sub(lambda m: "--" + m.group(1).replace("_", "-") + (" " if m.group(2) else ""), message)


SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids")  # the CLI's


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags, validated now (before any model loads), as SpecEngine.generate keyword arguments."""
    from jspec.config import SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop_token_ids=tuple(args.stop_token_ids or ()))
    flags = {name: getattr(params, name) for name in SAMPLING_FLAGS}
    if getattr(args, "structured_outputs", None) is not None:
        flags["structured_outputs"] = args.structured_outputs
    return flags


def _chat_template(args: argparse.Namespace, model_dir: str):
    """--chat: the model's chat template, refused now (before loading) if it has none; None without --chat."""
    from jspec.chat import load_chat_template

    if not args.chat:
        return None
    template = load_chat_template(model_dir)
    if template is None:
        raise ValueError(f"--chat: the model at {model_dir} has no chat_template (tokenizer_config.json); "
                         f"give plain prompts without --chat")
    return template


def _chat_inputs(args: argparse.Namespace, engine, template) -> None:
    """--chat: args.inputs become each prompt's one-message conversation as token ids (what transformers'
    apply_chat_template gives), args.prompts the rendered texts (what is printed), and the end-of-turn token
    a stop id."""
    if engine.tokenizer is None:
        raise ValueError("--chat needs the model's tokenizer.json, and it has none")
    conversations = [[{"role": "user", "content": prompt}] for prompt in args.prompts]
    args.prompts = template.render(conversations)
    args.inputs = template.encode(engine.tokenizer, conversations)
    end_of_turn = [i for i in template.end_of_turn_ids(engine.tokenizer) if i not in engine.eos_token_ids]
    args.stop_token_ids = (args.stop_token_ids or []) + end_of_turn


def streams(args: argparse.Namespace) -> bool:
    """Whether the completion is streamed: one prompt, neither --json nor --no-stream nor --structured-outputs."""
    return (len(args.prompts) == 1 and not args.no_stream and not args.json
            and getattr(args, "structured_outputs", None) is None)


def _engines(args: argparse.Namespace, model_dir: str, drafter: str | None, spec):
    """-> (the engine with the drafter, the plain-decoding engine on the same params or None). spec "auto": the
    engine auto chose (``engine.auto_choice``), step costs cached under $JSPEC_HOME/auto."""
    import jspec
    from jspec.tools.compile_cache import jspec_home
    from jspec.tools.force_accept import force_accept_from_env

    if spec == "auto":
        engine = jspec.SpecEngine.from_pretrained(model_dir, drafter=drafter, spec="auto",
                                                  max_batch_size=max(1, len(args.prompts)),
                                                  max_seq_len=args.max_seq_len, dtype=args.dtype,
                                                  auto_cache_dir=jspec_home(),
                                                  auto_log=lambda line: print(f"[jspec] {line}", file=sys.stderr),
                                                  auto_streamed=streams(args),
                                                  **mesh_kwargs(args))  # auto never runs with --quantization
        if engine.auto_choice.drafter is None or args.no_baseline:
            return engine, None
        return engine, engine.plain()
    engine = jspec.SpecEngine.from_pretrained(model_dir, drafter=drafter, spec=spec,
                                              max_batch_size=max(1, len(args.prompts)),
                                              max_seq_len=args.max_seq_len, dtype=args.dtype,
                                              force_accept=force_accept_from_env() if drafter else None,
                                              quantization=args.quantization, **mesh_kwargs(args))
    if drafter is None or args.no_baseline:
        return engine, None
    return engine, engine.plain()


# --- jspec generate: streaming ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StreamRun:
    """One streamed prompt: its new tokens, the target verify steps taken, and the seconds spent in the engine
    (prefill included; the caller's time to print each chunk is not)."""

    token_ids: list[int]
    num_verify_steps: int
    run_seconds: float

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per verify step, the prefill's token excluded (GenerateStats' definition)."""
        return (len(self.token_ids) - 1) / self.num_verify_steps if self.num_verify_steps else 1.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.run_seconds if self.run_seconds > 0 else 0.0


def timed_stream(engine, prompt: str, sampling: dict[str, Any],
                 on_tokens: Callable[[list[int]], None] | None = None) -> StreamRun:
    """Streams one prompt, calling ``on_tokens(all new tokens so far)`` after each chunk.

    With one prompt and one step per chunk, the first chunk is the prefill's token and every later chunk is one
    verify step (a step of an unfinished sequence commits at least one token).
    """
    token_ids: list[int] = []
    chunks, outside = 0, 0.0
    start = time.perf_counter()
    for chunk in engine.stream([prompt], **sampling):
        token_ids += chunk[0]
        chunks += 1
        if on_tokens is not None:
            before = time.perf_counter()
            on_tokens(token_ids)
            outside += time.perf_counter() - before
    return StreamRun(token_ids, max(chunks - 1, 0), time.perf_counter() - start - outside)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _generate_streamed(args: argparse.Namespace, engine, baseline, sampling: dict[str, Any]) -> float | None:
    """Prints the one prompt's completion as its first run commits it (that run compiles the programs, so the
    first token shows as soon as the prefill is compiled), then times a second, identical run, unprinted, and the
    baseline's the same way. -> the speedup over plain decoding, or None without a baseline.

    The timed run is the second because a program's first run is slow on XLA:CPU beyond its compilation: each
    branch of a ``lax.cond`` runs slowly the first time it executes. Greedy, or sampled from the same seed, the
    timed run commits the tokens the printed one did."""
    prompt, inputs = args.prompts[0], args.inputs[0]
    print(f"--- {prompt!r}")
    _write(prompt)
    text = TextStream(engine.tokenizer)
    start = time.perf_counter()
    first = timed_stream(engine, inputs, sampling, on_tokens=lambda ids: _write(text.piece(ids)))
    _write(text.piece(first.token_ids, final=True) + "\n")
    first_seconds = time.perf_counter() - start
    run = timed_stream(engine, inputs, sampling)
    print(f"--- {len(run.token_ids)} tokens, acceptance length {run.acceptance_length:.2f} "
          f"({run.num_verify_steps} target steps), {run.tokens_per_second:.1f} tokens/s as streamed (a host sync "
          f"per step; timed on a second run: the printed one, {first_seconds:.1f}s with compilation, not counted)")
    if baseline is None:
        return None
    timed_stream(baseline, inputs, sampling)
    plain = timed_stream(baseline, inputs, sampling)
    speedup = run.tokens_per_second / plain.tokens_per_second
    print(f"--- plain decoding, streamed the same way: {plain.tokens_per_second:.1f} tokens/s -> speedup "
          f"{speedup:.2f}x")
    return speedup


# --- jspec generate: all at once -------------------------------------------------------------------------------

def warm_generate(engine, inputs: list, sampling: dict[str, Any]):
    """``engine.generate`` twice: the first call compiles and warms up (its compile seconds are reported), the
    second, identical in output, is the one timed. A program's first run after compiling is several times slower
    on a CPU (64 tokens of the demo: 0.10 s first, 0.03 s after), which one call would report as its speed."""
    first = engine.generate(inputs, **sampling)
    out = engine.generate(inputs, **sampling)
    return dataclasses.replace(out, stats=dataclasses.replace(out.stats,
                                                              compile_seconds=first.stats.compile_seconds))


def _generate_batch(args: argparse.Namespace, engine, baseline, sampling: dict[str, Any]) -> dict[str, Any]:
    """One timed ``generate`` call for all prompts (and one for the baseline), each after a warm-up call -> the
    JSON report's fields."""
    out = warm_generate(engine, args.inputs, sampling)
    plain = warm_generate(baseline, args.inputs, sampling).stats if baseline is not None else None
    speedup = out.stats.tokens_per_second / plain.tokens_per_second if plain else None
    return {"prompts": args.prompts, "texts": out.texts, "token_ids": out.token_ids,
            "stats": dataclasses.asdict(out.stats), "baseline": dataclasses.asdict(plain) if plain else None,
            "speedup": speedup}


def _print_batch(report: dict[str, Any]) -> None:
    stats, plain = report["stats"], report["baseline"]
    for prompt, text in zip(report["prompts"], report["texts"] or [str(t) for t in report["token_ids"]]):
        print(f"--- {prompt!r}\n{prompt}{text}")
    print(f"--- {stats['num_generated_tokens']} tokens, acceptance length {stats['acceptance_length']:.2f} "
          f"({stats['num_verify_steps']} target steps), {stats['tokens_per_second']:.1f} tokens/s (one generate "
          f"call after a warm-up), compile {stats['compile_seconds']:.1f}s")
    if plain is not None:
        print(f"--- plain decoding: {plain['tokens_per_second']:.1f} tokens/s -> speedup {report['speedup']:.2f}x")


def run_generate(args: argparse.Namespace) -> int:
    """``jspec generate``; the engine's errors about lengths name the flags (see :func:`as_flags`)."""
    try:
        return _run_generate(args)
    except ValueError as error:
        raise ValueError(as_flags(str(error))) from error


def wants_auto(args: argparse.Namespace, drafter: str | None) -> bool:
    """Whether jspec generate chooses by measurement (spec="auto"): no tree flag (--kernels included), no benchmark
    knob, no --quantization (auto's step costs are those of the checkpoint's weights), and either the bundled model
    with no --drafter (auto may pick any drafter, or none) or a named drafter (its best tree)."""
    from jspec.tools.force_accept import force_accept_from_env

    if args.tree is not None or (args.num_draft_tokens, args.num_steps, args.topk, args.selection,
                                 args.kernels) != (None,) * 5:
        return False
    if force_accept_from_env() is not None or args.drafter == "none" or args.quantization is not None:
        return False
    return args.drafter is not None or args.model is None


def draft_spec(args: argparse.Namespace, drafter: str | None):
    """The tree flags over the drafter's default tree (``jspec.tools.bundled.default_spec``) -> SpecConfig, or
    None for plain decoding."""
    from jspec.tools.bundled import default_spec, spec_for

    if drafter is None:
        return None
    spec = _tree_spec(args, default_spec(drafter), spec_for)
    return spec if args.kernels is None else dataclasses.replace(spec, kernels=args.kernels)


def _tree_spec(args: argparse.Namespace, base, spec_for):
    """The tree flags over ``base``, the drafter's default tree."""
    tree = args.tree or base.tree
    if tree == base.tree and args.num_draft_tokens is args.num_steps is args.topk is args.selection is None:
        return base
    given = lambda value, default: default if value is None else value
    if args.selection is not None and tree != "dynamic":
        raise ValueError(f"--selection {args.selection} applies to dynamic trees, not --tree {tree}")
    tokens, steps = given(args.num_draft_tokens, base.tree_size), given(args.num_steps, base.num_steps)
    # The default tree's selection carries over where it fits (top1_chain needs a node per depth).
    inherited = base.selection if base.tree == "dynamic" and tokens - 1 >= steps else "eagle2"
    return spec_for(tree, tokens, steps, given(args.topk, base.topk), given(args.selection, inherited))


def _run_generate(args: argparse.Namespace) -> int:
    start_processes(args)
    _check_prompts(args.prompts)
    sampling = _sampling(args)
    model_dir, drafter, what = resolve_models(args)
    args.max_seq_len = checked_max_seq_len(args.max_seq_len, model_dir)
    template = _chat_template(args, model_dir)
    auto = wants_auto(args, drafter)
    if auto:
        drafter = args.drafter  # None: auto may choose any drafter, or none
    spec = "auto" if auto else draft_spec(args, drafter)
    engine, baseline = _engines(args, model_dir, drafter, spec)
    choice = engine.auto_choice
    if choice is not None:
        drafter, spec = choice.drafter, choice.spec
    args.inputs = args.prompts  # what the engines are given: texts, or --chat's token ids
    if template is not None:
        _chat_inputs(args, engine, template)
        sampling = _sampling(args)
    if args.json:
        report = _generate_batch(args, engine, baseline, sampling)
        report.update(model=model_dir, drafter=drafter, spec=dataclasses.asdict(spec) if spec else None,
                      sampling=sampling, auto=choice.to_json() if choice is not None else None)
        print(json.dumps(report))
        _check_auto(choice, report["speedup"])
        return 0
    print(f"[jspec] target: {what}")
    if choice is not None:
        print("[jspec] " + (choice.describe() if args.verbose else choice.summary()).replace("\n", "\n[jspec] "))
    if drafter is not None:
        print(f"[jspec] drafter: {drafter} ({spec.tree} tree, {spec.tree_size} tokens per step)")
    elif choice is not None:
        print("[jspec] plain decoding: no drafter is expected to pay on this device (`--drafter eagle3` forces one)")
    if streams(args):
        speedup = _generate_streamed(args, engine, baseline, sampling)
    else:
        report = _generate_batch(args, engine, baseline, sampling)
        _print_batch(report)
        speedup = report["speedup"]
    _check_auto(choice, speedup)
    return 0


def _check_auto(choice, speedup: float | None) -> None:
    """When auto chose a drafter by the model's shipped step costs and it lost to plain decoding here, says so and
    records it, so that the next run times every candidate on this device (``jspec.autotune.reject_prior``)."""
    from jspec.autotune import reject_prior

    if choice is None or speedup is None or not choice.from_prior or speedup >= 1.0:
        return
    reject_prior(choice, speedup)
    print(f"[jspec] auto: {choice.best.candidate.label} ran at {speedup:.2f}x plain decoding here, below the "
          f"shipped step costs' {choice.expected_speedup:.2f}x; the next run times every method on this device "
          f"(or run `jspec tune` now)", file=sys.stderr)
