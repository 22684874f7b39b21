"""The ``jspec`` command::

    jspec generate [PROMPT ...]   speculative generation, streamed for one prompt, timed against plain decoding
    jspec convert --src HF_DIR --dst OUT_DIR
    jspec bench ...               every argument goes to jspec.tools.bench.main
    jspec train-target ...        jspec.train.commands.train_target_main (same as scripts/train_target.py)
    jspec train-drafter ...       jspec.train.commands.train_drafter_main (same as scripts/train_drafter.py)

Sampling flags are named as in vLLM and Hugging Face (--temperature, --top-p, --top-k, --seed, --max-new-tokens
or --max-tokens, --stop-token-ids). Bad input (ValueError, a missing or existing path) is reported as one line
``jspec: error: ...`` with exit code 2, like argparse's own errors; ``--debug``, before or after the subcommand,
shows the traceback instead. Any other exception is a bug and shows its traceback.

Ctrl-C ends any command within moments, with ``jspec: interrupted`` and exit code 130 (see
:func:`exit_on_interrupt`). generate and training keep their compiled programs in JAX's persistent compilation
cache under ``$JSPEC_HOME/compile-cache`` (JSPEC_HOME defaults to ~/.cache/jspec; ``--no-compile-cache`` turns it
off), so a second identical call loads them instead of compiling again.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError)
DEFAULT_MAX_SEQ_LEN = 1024


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default in --help, except None (the help text says what happens then) and switches."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool) or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


# --- Ctrl-C ----------------------------------------------------------------------------------------------------

_interrupt_cleanups: list[Callable[[], None]] = []
_exiting = threading.Lock()


def _exit_interrupted() -> None:
    """Runs the registered cleanups, flushes what was printed, says so on stderr, and ends the process: exit 130.

    ``os._exit`` rather than KeyboardInterrupt: an exception can land inside a JAX/XLA callback (where it is
    swallowed and the run goes on) or wait behind a jitted call blocking in C++, and interpreter shutdown with XLA
    threads still running has crashed. A JAX program cannot be cancelled cleanly anyway."""
    if not _exiting.acquire(blocking=False):
        return  # the other path (signal handler or watcher thread) is already exiting
    for cleanup in reversed(_interrupt_cleanups):
        with contextlib.suppress(Exception):  # exiting regardless
            cleanup()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # e.g. a reentrant flush from the handler, or a closed pipe
            stream.flush()
    os.write(2, b"\njspec: interrupted\n")
    os._exit(130)


def _watch_for_interrupt(read_fd: int) -> None:
    """Reads the signal numbers CPython writes to its wakeup fd, so that SIGINT exits even while the main thread is
    in C++ (compiling, or waiting for a jitted call), where the Python signal handler runs only once that code
    checks for signals. A second SIGINT exits without waiting for the first one's cleanups."""
    interrupts = 0
    while True:
        data = os.read(read_fd, 64)
        if not data:
            return  # the write end was closed: exit_on_interrupt is done
        interrupts += data.count(signal.SIGINT)
        if interrupts > 1:
            os._exit(130)
        if interrupts:
            _exit_interrupted()


@contextlib.contextmanager
def exit_on_interrupt() -> Iterator[None]:
    """Within this block, SIGINT (Ctrl-C) calls :func:`_exit_interrupted`: from the Python signal handler when the
    main thread runs Python, and from a watcher thread woken by ``signal.set_wakeup_fd`` when it does not.
    Restores the previous handler on exit. Outside the main thread (where signals cannot be handled) it does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_handler = signal.signal(signal.SIGINT, lambda signum, frame: _exit_interrupted())
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=_watch_for_interrupt, args=(read_fd,), name="jspec-interrupt", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGINT, previous_handler)
        os.close(write_fd)
        watcher.join()
        os.close(read_fd)


@contextlib.contextmanager
def on_interrupt(cleanup: Callable[[], None]) -> Iterator[None]:
    """Within this block, an interrupt runs ``cleanup()`` before the process exits."""
    _interrupt_cleanups.append(cleanup)
    try:
        yield
    finally:
        _interrupt_cleanups.remove(cleanup)


# --- the persistent compilation cache --------------------------------------------------------------------------

def jspec_home() -> str:
    """$JSPEC_HOME, default ~/.cache/jspec (as in jspec.tools.demo_model)."""
    return os.environ.get("JSPEC_HOME", os.path.join(os.path.expanduser("~"), ".cache", "jspec"))


def compile_cache_dir() -> str:
    return os.path.join(jspec_home(), "compile-cache")


# Every program is cached however fast it compiled or small it is: on CPU most take well under JAX's default
# threshold of 1 s each, and they add up to several seconds per call.
_CACHE_SETTINGS = {"jax_persistent_cache_min_compile_time_secs": 0.0,
                   "jax_persistent_cache_min_entry_size_bytes": -1}


@contextlib.contextmanager
def persistent_compile_cache(directory: str | None) -> Iterator[None]:
    """Within this block JAX reads and writes compiled programs under ``directory`` (None: leaves JAX as it is).

    A cache directory the user gave JAX (JAX_COMPILATION_CACHE_DIR) is left as it is, with JAX's own settings.
    The previous settings are restored afterwards, so that ``main`` called in-process leaves no cache switched on.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if directory is None or jax.config.jax_compilation_cache_dir is not None:
        yield
        return
    settings = {"jax_compilation_cache_dir": directory, **_CACHE_SETTINGS}
    previous = {name: getattr(jax.config, name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()  # JAX keeps the cache it opened on the first compile until reset


# --- jspec convert ---------------------------------------------------------------------------------------------

def add_convert_args(parser: argparse.ArgumentParser) -> None:
    """The flags of ``jspec convert`` (scripts/convert_checkpoint.py shows the same)."""
    parser.add_argument("--src", required=True, help="Hugging Face directory: config.json + *.safetensors "
                                                      "(a Llama-family target or an EAGLE-3 head)")
    parser.add_argument("--dst", required=True, help="output directory (must not exist unless --overwrite)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="parameter dtype; auto: the checkpoint's own")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --dst")


def _remove_tree(path: str) -> None:
    """Removes ``path``, trying again while another thread (orbax's writers) still adds files to it."""
    for _ in range(5):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return


def run_convert(args: argparse.Namespace) -> int:
    """Converts into a staging directory beside --dst and renames it into place, so that neither a failure nor
    Ctrl-C (which ends the process at once: see :func:`exit_on_interrupt`) leaves anything at --dst or beside it."""
    from models.checkpoint import check_destination, convert_hf_checkpoint

    dst = os.path.abspath(args.dst)
    check_destination(dst, args.overwrite)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.converting-", dir=os.path.dirname(dst))
    try:
        with on_interrupt(lambda: _remove_tree(staging)):
            converted = convert_hf_checkpoint(args.src, os.path.join(staging, "out"), dtype=args.dtype)
            check_destination(dst, args.overwrite)
            if os.path.exists(dst):
                shutil.rmtree(dst)
            os.rename(converted, dst)
    finally:
        _remove_tree(staging)
    print(f"wrote {dst}")
    return 0


# --- jspec generate: arguments ---------------------------------------------------------------------------------

def _token_ids(text: str) -> list[int]:
    """argparse type of --stop-token-ids: "2,13" -> [2, 13]."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated token ids, e.g. 2,13") from None


def _add_generate_args(parser: argparse.ArgumentParser) -> None:
    from jspec.tools.bundled import DEFAULT_SPEC

    parser.add_argument("prompts", nargs="*", default=["def fibonacci(n):"],
                        help="prompt texts (one prompt is streamed as it is generated)")
    models = parser.add_argument_group("models")
    models.add_argument("--model", default=None,
                        help="converted target directory (default: the bundled code model)")
    models.add_argument("--drafter", default=None,
                        help="'eagle3' or 'draft' (the bundled head / draft model), 'ngram', 'none', or a converted "
                             "drafter directory (default: the bundled EAGLE-3 head without --model, none with it)")
    models.add_argument("--max-seq-len", type=int, default=None,
                        help=f"token slots per sequence: prompt + new tokens (default: {DEFAULT_MAX_SEQ_LEN}, or the "
                             f"model's max_position_embeddings if smaller)")
    models.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="compute dtype (default: the checkpoint's; float32 for the bundled bf16 model, "
                             "faster on CPU)")
    tree = parser.add_argument_group("draft tree")
    tree.add_argument("--tree", default=DEFAULT_SPEC.tree, choices=["chain", "static", "dynamic"],
                      help="shape of the draft tree")
    tree.add_argument("--num-draft-tokens", type=int, default=DEFAULT_SPEC.num_draft_tokens,
                      help="tree nodes per step, root included (chain: depth + 1)")
    tree.add_argument("--num-steps", type=int, default=DEFAULT_SPEC.num_steps, help="dynamic tree depth")
    tree.add_argument("--topk", type=int, default=DEFAULT_SPEC.topk, help="dynamic tree branching")
    sampling = parser.add_argument_group("sampling (as in vLLM / Hugging Face)")
    sampling.add_argument("--max-new-tokens", "--max-tokens", dest="max_new_tokens", type=int, default=128,
                          help="new tokens per prompt at most")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    sampling.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    sampling.add_argument("--top-p", type=float, default=1.0, help="1.0 = disabled")
    sampling.add_argument("--seed", type=int, default=0, help="seed of the sampling keys")
    sampling.add_argument("--stop-token-ids", type=_token_ids, action="extend", default=None, metavar="IDS",
                          help="comma-separated token ids that end a sequence (kept in the output), besides EOS")
    output = parser.add_argument_group("output")
    output.add_argument("--no-stream", action="store_true",
                        help="print the completion at the end (several prompts are never streamed)")
    output.add_argument("--no-baseline", action="store_true",
                        help="skip the plain-decoding run that the speedup is measured against")
    output.add_argument("--json", action="store_true", help="print one JSON object instead of text (no streaming)")


def _resolve_models(args: argparse.Namespace) -> tuple[str, str | None, str]:
    """-> (target dir, drafter (dir, "ngram" or None), a description for the user)."""
    from jspec.tools.bundled import bundled_dir
    from jspec.tools.demo_model import ensure_demo_model

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


def _check_prompts(prompts: list[str]) -> None:
    """Refuses an empty or all-whitespace prompt text (a tokenizer that adds BOS would otherwise turn it into a
    one-token prompt and generate from nothing)."""
    for i, prompt in enumerate(prompts):
        if not prompt.strip():
            raise ValueError(f"prompt {i} is {'empty' if not prompt else 'only whitespace'} ({prompt!r}): give the "
                             f"text to continue")


def _max_seq_len(requested: int | None, model_dir: str) -> int:
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


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags, validated now (before any model loads), as SpecEngine.generate keyword arguments."""
    from jspec.config import SamplingParams

    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop_token_ids=tuple(args.stop_token_ids or ()))
    return dataclasses.asdict(params)


def _engines(args: argparse.Namespace, model_dir: str, drafter: str | None, spec):
    """-> (the engine with the drafter, the plain-decoding engine on the same params or None)."""
    import jspec

    dtype = args.dtype or ("float32" if args.model is None else None)
    engine = jspec.SpecEngine.from_pretrained(model_dir, drafter=drafter, spec=spec,
                                              max_batch_size=max(1, len(args.prompts)),
                                              max_seq_len=args.max_seq_len, dtype=dtype)
    if drafter is None or args.no_baseline:
        return engine, None
    baseline = jspec.SpecEngine(engine.config, engine.params, tokenizer=engine.tokenizer,
                                max_batch_size=engine.max_batch_size, max_seq_len=args.max_seq_len,
                                dtype=engine.setup.dtype, eos_token_ids=engine.eos_token_ids)
    return engine, baseline


# --- jspec generate: streaming ---------------------------------------------------------------------------------

class TextStream:
    """Turns the growing token list of one sequence into printable pieces of text.

    Each call decodes the whole list and returns what was not returned before, so BPE merges and multi-byte
    characters split over several tokens come out right; while the text ends in U+FFFD (a UTF-8 sequence whose
    remaining bytes are still to come) that tail is held back until the next call or ``final=True``. The pieces
    concatenate to ``tokenizer.decode(token_ids, skip_special_tokens=True)``.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.printed = ""

    def piece(self, token_ids: list[int], final: bool = False) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if not final:
            text = text.rstrip("\ufffd")
        if len(text) <= len(self.printed):
            return ""
        new, self.printed = text[len(self.printed):], text
        return new


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


def warm_up_stream(engine, prompt: str, sampling: dict[str, Any]) -> float:
    """Streams ``prompt`` through its prefill and first step, which compiles both streaming programs at this
    request's shapes, so that a following :func:`timed_stream` of it compiles nothing. -> seconds taken."""
    start = time.perf_counter()
    for i, _ in enumerate(engine.stream([prompt], **sampling)):
        if i == 1:
            break
    return time.perf_counter() - start


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


def _generate_streamed(args: argparse.Namespace, engine, baseline, sampling: dict[str, Any]) -> None:
    """Prints the one prompt's completion as it is committed, then stats measured on that streamed run."""
    prompt = args.prompts[0]
    warmup_seconds = warm_up_stream(engine, prompt, sampling)
    print(f"--- {prompt!r}")
    _write(prompt)
    text = TextStream(engine.tokenizer)
    run = timed_stream(engine, prompt, sampling, on_tokens=lambda ids: _write(text.piece(ids)))
    _write(text.piece(run.token_ids, final=True) + "\n")
    print(f"--- {len(run.token_ids)} tokens, acceptance length {run.acceptance_length:.2f} "
          f"({run.num_verify_steps} target steps), {run.tokens_per_second:.1f} tokens/s as streamed (a host sync "
          f"per step; compile + warm-up {warmup_seconds:.1f}s not counted)")
    if baseline is not None:
        warm_up_stream(baseline, prompt, sampling)
        plain = timed_stream(baseline, prompt, sampling)
        print(f"--- plain decoding, streamed the same way: {plain.tokens_per_second:.1f} tokens/s -> speedup "
              f"{run.tokens_per_second / plain.tokens_per_second:.2f}x")


# --- jspec generate: all at once -------------------------------------------------------------------------------

def _generate_batch(args: argparse.Namespace, engine, baseline, sampling: dict[str, Any]) -> dict[str, Any]:
    """One timed ``generate`` call for all prompts (and one for the baseline) -> the JSON report's fields."""
    out = engine.generate(args.prompts, **sampling)
    plain = baseline.generate(args.prompts, **sampling).stats if baseline is not None else None
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
          f"call), compile {stats['compile_seconds']:.1f}s")
    if plain is not None:
        print(f"--- plain decoding: {plain['tokens_per_second']:.1f} tokens/s -> speedup {report['speedup']:.2f}x")


def run_generate(args: argparse.Namespace) -> int:
    """``jspec generate``; the engine's errors about lengths name the flags (see :func:`as_flags`)."""
    try:
        return _run_generate(args)
    except ValueError as error:
        raise ValueError(as_flags(str(error))) from error


def _run_generate(args: argparse.Namespace) -> int:
    from jspec.tools.bundled import spec_for

    _check_prompts(args.prompts)
    sampling = _sampling(args)
    model_dir, drafter, what = _resolve_models(args)
    args.max_seq_len = _max_seq_len(args.max_seq_len, model_dir)
    spec = spec_for(args.tree, args.num_draft_tokens, args.num_steps, args.topk) if drafter else None
    engine, baseline = _engines(args, model_dir, drafter, spec)
    if args.json:
        report = _generate_batch(args, engine, baseline, sampling)
        report.update(model=model_dir, drafter=drafter, spec=dataclasses.asdict(spec) if spec else None,
                      sampling=sampling)
        print(json.dumps(report))
        return 0
    print(f"[jspec] target: {what}")
    if drafter is not None:
        print(f"[jspec] drafter: {drafter} ({spec.tree} tree, {spec.tree_size} tokens per step)")
    if len(args.prompts) == 1 and not args.no_stream:
        _generate_streamed(args, engine, baseline, sampling)
    else:
        _print_batch(_generate_batch(args, engine, baseline, sampling))
    return 0


# --- commands that own their arguments -------------------------------------------------------------------------

def run_bench(args: argparse.Namespace) -> int:
    """``jspec bench ARGS`` is ``jspec.tools.bench.main(ARGS)``."""
    from jspec.tools.bench import main as bench_main

    return bench_main(args.forwarded) or 0


def run_train_target(args: argparse.Namespace) -> int:
    from jspec.train.commands import train_target_main

    return train_target_main(args.forwarded, prog="jspec train-target")


def run_train_drafter(args: argparse.Namespace) -> int:
    from jspec.train.commands import train_drafter_main

    return train_drafter_main(args.forwarded, prog="jspec train-drafter")


# subcommand -> (run, help); each parses its own arguments, so its --help is its own
FORWARDED = {
    "bench": (run_bench, "time generation methods side by side (arguments: see `jspec bench --help`)"),
    "train-target": (run_train_target, "train a small Llama target on the Python stdlib"),
    "train-drafter": (run_train_drafter, "train an EAGLE-3 head or a draft model for a trained target"),
}


# Commands whose programs go to the compilation cache: not bench, which reports compile seconds as a measurement,
# nor convert, which compiles next to nothing.
CACHED_COMMANDS = ("generate", "train-target", "train-drafter")
COMMON_FLAGS = {
    "--debug": "show tracebacks",
    "--no-compile-cache": "compile every program afresh instead of reusing them from $JSPEC_HOME/compile-cache",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jspec", description="Speculative decoding in JAX.")
    common = argparse.ArgumentParser(add_help=False)  # these flags after the subcommand too
    for flag, help_text in COMMON_FLAGS.items():
        parser.add_argument(flag, action="store_true", help=help_text)
        common.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=help_text)  # keeps the first
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser("generate", parents=[common], help="generate text from prompts", formatter_class=HelpFormatter,
                         description="Speculative generation; one prompt is streamed as it is committed.")
    _add_generate_args(gen)
    gen.set_defaults(func=run_generate)
    conv = sub.add_parser("convert", parents=[common], help="convert a Hugging Face checkpoint to a jspec directory",
                          formatter_class=HelpFormatter)
    add_convert_args(conv)
    conv.set_defaults(func=run_convert)
    for name, (run, help_text) in FORWARDED.items():
        forwarded = sub.add_parser(name, parents=[common], help=help_text, add_help=False, allow_abbrev=False)
        forwarded.set_defaults(func=run)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the command line; the arguments of a FORWARDED command are left, in order, in ``args.forwarded``."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in FORWARDED:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.forwarded = rest
    return args


def _error_line(error: BaseException) -> str:
    return "jspec: error: " + str(error).replace("\n", " ")


def main(argv: list[str] | None = None) -> int:
    with exit_on_interrupt():
        args = parse_args(argv)
        use_cache = args.command in CACHED_COMMANDS and not args.no_compile_cache
        with persistent_compile_cache(compile_cache_dir() if use_cache else None):
            if args.debug:
                return args.func(args)
            try:
                return args.func(args)
            except USER_ERRORS as error:
                print(_error_line(error), file=sys.stderr)
                return 2


if __name__ == "__main__":
    sys.exit(main())
