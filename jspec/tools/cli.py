"""The ``jspec`` command::

    jspec generate [PROMPT ...]   speculative generation, streamed for one prompt, timed against plain decoding
    jspec convert --src HF_DIR --dst OUT_DIR
    jspec serve                   an OpenAI-compatible HTTP server (continuous batching; SIGTERM drains)
    jspec tune                    time spec="auto"'s methods on this device and cache them for jspec generate
    jspec bench ...               every argument goes to jspec.tools.bench.main
    jspec bench-serve ...         every argument goes to jspec.tools.bench_serve.main
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
import sys

from jspec.tools.compile_cache import compile_cache_dir, persistent_compile_cache
from jspec.tools.convert_cmd import add_convert_args, run_convert
from jspec.tools.generate_cmd import add_generate_args, run_generate
from jspec.tools.interrupt import exit_on_interrupt
from jspec.tools.serve_cmd import add_serve_args, run_serve
from jspec.tools.tune_cmd import add_tune_args, run_tune

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default in --help, except None (the help text says what happens then) and switches."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool) or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


# --- commands that own their arguments -------------------------------------------------------------------------

def run_bench(args: argparse.Namespace) -> int:
    """``jspec bench ARGS`` is ``jspec.tools.bench.main(ARGS)``."""
    from jspec.tools.bench import main as bench_main

    return bench_main(args.forwarded) or 0


def run_bench_serve(args: argparse.Namespace) -> int:
    """``jspec bench-serve ARGS`` is ``jspec.tools.bench_serve.main(ARGS)``."""
    from jspec.tools.bench_serve import main as bench_serve_main

    return bench_serve_main(args.forwarded) or 0


def run_train_target(args: argparse.Namespace) -> int:
    from jspec.train.commands import train_target_main

    return train_target_main(args.forwarded, prog="jspec train-target")


def run_train_drafter(args: argparse.Namespace) -> int:
    from jspec.train.commands import train_drafter_main

    return train_drafter_main(args.forwarded, prog="jspec train-drafter")


# subcommand -> (run, help); each parses its own arguments, so its --help is its own
FORWARDED = {
    "bench": (run_bench, "time generation methods side by side (arguments: see `jspec bench --help`)"),
    "bench-serve": (run_bench_serve, "load the HTTP server, speculative vs plain (see `jspec bench-serve --help`)"),
    "train-target": (run_train_target, "train a small Llama target on the Python stdlib"),
    "train-drafter": (run_train_drafter, "train a drafter (EAGLE-3, draft model, DFlash, DSpark, PARD) for a "
                                         "trained target"),
}


# Commands whose programs go to the compilation cache: not bench, which reports compile seconds as a measurement,
# nor convert, which compiles next to nothing.
CACHED_COMMANDS = ("generate", "serve", "tune", "train-target", "train-drafter")
COMMON_FLAGS = {
    "--debug": "show tracebacks",
    "--no-compile-cache": "compile every program afresh instead of reusing them from $JSPEC_HOME/compile-cache",
}


# subcommand -> (adds its arguments, run, help, description), for the commands that own their arguments
OWN_ARGUMENTS = {
    "generate": (add_generate_args, run_generate, "generate text from prompts",
                 "Speculative generation; one prompt is streamed as it is committed."),
    "convert": (add_convert_args, run_convert, "convert a Hugging Face checkpoint to a jspec directory", None),
    "serve": (add_serve_args, run_serve, "serve the model over HTTP (OpenAI's API)",
              "An OpenAI-compatible server: POST /v1/completions, /v1/chat/completions; GET /v1/models, /health, "
              "/metrics."),
    "tune": (add_tune_args, run_tune, "time spec=auto's methods on this device (cached)",
             "Times plain decoding and every drafter/tree spec='auto' weighs, on this device, and caches the step "
             "costs under $JSPEC_HOME/auto for jspec generate."),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jspec", description="Speculative decoding in JAX.")
    common = argparse.ArgumentParser(add_help=False)  # these flags after the subcommand too
    for flag, help_text in COMMON_FLAGS.items():
        parser.add_argument(flag, action="store_true", help=help_text)
        common.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=help_text)  # keeps the first
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add_args, run, help_text, description) in OWN_ARGUMENTS.items():
        command = sub.add_parser(name, parents=[common], help=help_text, description=description,
                                 formatter_class=HelpFormatter)
        add_args(command)
        command.set_defaults(func=run)
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
        args.argv = list(sys.argv[1:] if argv is None else argv)  # as given (``jspec serve -dp N`` passes it on)
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
