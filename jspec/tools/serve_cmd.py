"""``jspec serve``: an OpenAI-compatible HTTP server (``jspec.serve.app``) over a slot engine
(``jspec.serve.slots``), on uvicorn.

Start-up: the port is bound first (a taken port fails at once), the model loads as ``jspec generate`` loads it
(the same --model / --drafter / tree defaults), every program compiles in the slot engine's warm-up, then the
server listens and prints one ``... ready`` line. SIGTERM drains: the listening socket closes and requests on open
connections get 503, the running ones get up to --shutdown-timeout seconds to finish, then the rest are ended, and
the process exits 0. Ctrl-C exits at once (130),
as every jspec command does.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import threading

import uvicorn

from jspec.calibration_prompts import CALIBRATION_PROMPTS
from jspec.serve import tool_parsers
from jspec.tools.generate_cmd import (checked_max_seq_len, resolve_models, add_model_args, add_tree_args, as_flags,
                                     draft_spec)
from jspec.tools.parallel_args import add_parallel_args, mesh_kwargs, start_processes

# The load adapter's cost table and starting acceptance are measured on it at warm-up: code a drafter drafts on as
# it would on a request (openings of standard-library functions).
CALIBRATION_PROMPT = "\n\n".join(CALIBRATION_PROMPTS)
BUNDLED_NAME = "jspec-code"
GPU_MAX_NUM_SEQS = 256  # vLLM's default
CPU_MAX_NUM_SEQS = 32   # a CPU steps rows one after another: more rows add latency, not throughput
# On by default, as vLLM's (up to 20 top log-probabilities; penalties always): clients send them without asking. Their
# arrays ride in every program; a step where no row uses them skips the work (docs/benchmarks.md has their cost).
DEFAULT_MAX_LOGPROBS = 20
DEFAULT_LOGITS_PROCESSORS = True


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    models = add_model_args(parser)
    models.add_argument("--served-model-name", default=None,
                        help=f"the model name clients send (default: {BUNDLED_NAME!r} for the bundled model, else the "
                             f"--model directory's name)")
    add_tree_args(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    server.add_argument("--max-num-seqs", "--max-batch-size", dest="max_num_seqs", type=int, default=None,
                        help=f"requests running at once (rows stepped together; default {GPU_MAX_NUM_SEQS} on a GPU "
                             f"or TPU, {CPU_MAX_NUM_SEQS} on a CPU)")
    server.add_argument("--block-size", type=int, default=16, help="token slots per page of the KV cache")
    server.add_argument("--max-total-tokens", type=int, default=None,
                        help="the KV cache in token slots, over all requests (default: on a GPU or TPU, "
                             "--kv-cache-memory-fraction of device memory; on a CPU, 65536)")
    server.add_argument("--kv-cache-memory-fraction", type=float, default=0.9,
                        help="on a GPU or TPU, the fraction of device memory weights, programs' workspace and the KV "
                             "cache may fill (vLLM's --gpu-memory-utilization)")
    server.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="prompt tokens prefilled between two decode chunks; a longer prompt is prefilled "
                             "in pieces (chunked prefill; default 2048; MTP prefills a prompt whole: at least "
                             "--max-seq-len - 1)")
    server.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV pages of a prompt's prefix computed before (every drafter but MTP)")
    server.add_argument("--max-queue", type=int, default=256,
                        help="requests waiting for a row and pages before new ones get 503")
    server.add_argument("--steps-per-chunk", type=int, default=4,
                        help="steps between admissions and streamed pieces")
    server.add_argument("--no-adapt", action="store_true",
                        help="always run speculative steps (by default the server switches to plain steps under "
                             "load when those are faster; sampled tokens then depend on the load)")
    server.add_argument("--short-draft-len", type=int, default=None,
                        help="with load adaptation and a chain drafter, a third step program verifies only the "
                             "chain's first N drafts, for loads where the whole chain's verify pass costs more than "
                             "it saves (default: a quarter of the chain, at least 1; 0: none)")
    server.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="dispatch each chunk before reading the one before back, so the host streams tokens "
                             "and admits requests while the device steps (vLLM's name; default: on a GPU or TPU, "
                             "off on a CPU, where host and steps share the cores)")
    server.add_argument("--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS,
                        help="the most top log-probabilities a request may ask for per token (completions' logprobs, "
                             "chat's top_logprobs, echo's prompt logprobs; vLLM's name and default, 20); every step "
                             "records them; 0: the sampled token's only; -1: none (requests asking for logprobs get "
                             "400)")
    server.add_argument("--logits-processors", action=argparse.BooleanOptionalAction,
                        default=DEFAULT_LOGITS_PROCESSORS,
                        help="requests may use presence/frequency/repetition penalties, logit_bias, banned ids and "
                             "min_tokens (every program carries their per-row arrays; a step where no row uses them "
                             "skips the work); default on, as vLLM's; --no-logits-processors: such requests get 400")
    server.add_argument("--logprobs-mode", default="raw_logprobs", choices=["raw_logprobs", "processed_logprobs"],
                        help="vLLM's: the target's log-softmax (raw_logprobs), or that of the distribution each token "
                             "was drawn from, after logits processors, grammar masks, temperature, top-k and top-p "
                             "(processed_logprobs)")
    server.add_argument("--warm-up-structured-outputs", action="store_true",
                        help="compile and run the structured-output programs (grammar masks on the host between a "
                             "step's proposal and its verify pass) at start-up for every bucket; default: each "
                             "compiles at the first structured request of its bucket")
    server.add_argument("--precompile", choices=["needed", "all"], default="needed",
                        help="needed: compile at start-up the programs of the widest buckets (they serve every "
                             "request) and those start-up runs; a request whose own bucket is not compiled runs on a "
                             "larger one while its own compiles in the background; all: every bucket at start-up "
                             "(slower to start; on a CPU each program holds about a thousand of the process's "
                             "vm.max_map_count memory mappings)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="parse chat replies' tool calls into tool_calls when a request has tools and "
                             "tool_choice 'auto' (vLLM's flag; needs --tool-call-parser)")
    server.add_argument("--tool-call-parser", choices=tool_parsers.PARSERS, default=None,
                        help="how the model writes tool calls: hermes (<tool_call> JSON; Qwen, Hermes) or "
                             "llama3_json (Llama 3.1+ JSON)")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds running requests get to finish after SIGTERM")
    add_parallel_args(parser)


def paged_kwargs(args: argparse.Namespace) -> dict:
    """The SlotEngine arguments of the KV cache and scheduling flags."""
    return dict(max_num_seqs=args.max_num_seqs, block_size=args.block_size, max_total_tokens=args.max_total_tokens,
                kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=args.enable_prefix_caching, async_scheduling=args.async_scheduling,
                max_logprobs=None if args.max_logprobs == -1 else args.max_logprobs,
                logits_processors=args.logits_processors,
                warm_up_structured_outputs=args.warm_up_structured_outputs, logprobs_mode=args.logprobs_mode,
                precompile=args.precompile)


def run_serve(args: argparse.Namespace) -> int:
    """``jspec serve``; the engine's errors about lengths name the flags."""
    try:
        if args.data_parallel_size > 1:  # replicas behind a router (jspec.tools.serve_fleet)
            from jspec.tools.serve_fleet import run_fleet

            _check_args(args)
            return run_fleet(args)
        return _run_serve(args)
    except ValueError as error:
        raise ValueError(as_flags(str(error))) from error


def _check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port {args.port}: expected 0 .. 65535")
    for flag, value, low in (("--max-num-seqs", 1 if args.max_num_seqs is None else args.max_num_seqs, 1),
                             ("--max-queue", args.max_queue, 0),
                             ("--steps-per-chunk", args.steps_per_chunk, 1), ("--block-size", args.block_size, 1),
                             ("--max-total-tokens", 1 if args.max_total_tokens is None else args.max_total_tokens, 1),
                             ("--max-num-batched-tokens",
                              1 if args.max_num_batched_tokens is None else args.max_num_batched_tokens, 1)):
        if value < low:
            raise ValueError(f"{flag} {value}: expected an integer >= {low}")
    if not 0.0 < args.kv_cache_memory_fraction <= 1.0:
        raise ValueError(f"--kv-cache-memory-fraction {args.kv_cache_memory_fraction}: expected a number in (0, 1]")
    if args.short_draft_len is not None and args.short_draft_len < 0:
        raise ValueError(f"--short-draft-len {args.short_draft_len}: expected an integer >= 0 (0: no short chain)")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
    if args.max_logprobs < -1:
        raise ValueError(f"--max-logprobs {args.max_logprobs}: expected an integer >= 0, or -1 for none")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout {args.shutdown_timeout}: expected seconds >= 0")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size {args.data_parallel_size}: expected replicas >= 1")
    if args.coordinator_address is not None or args.distributed:
        raise ValueError("jspec serve runs on one host (no --coordinator-address / --distributed)")


def _listen(host: str, port: int) -> socket.socket:
    """The bound socket uvicorn will serve on (bound before the model loads, so a taken port fails at once)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} (--host/--port): {error.strerror or error}") from None
    sock.set_inheritable(True)
    return sock


def resolve_serve_args(args: argparse.Namespace):
    """Completes ``args`` as ``jspec serve`` does (the model and drafter, --max-num-seqs and --max-seq-len
    defaults), checking what can be checked before loading -> (model_dir, drafter, spec)."""
    from jspec.serve.serve_config import checked_short_draft_len

    model_dir, drafter, _ = resolve_models(args)
    if args.max_num_seqs is None:
        import jax

        args.max_num_seqs = CPU_MAX_NUM_SEQS if jax.default_backend() == "cpu" else GPU_MAX_NUM_SEQS
    args.max_seq_len = checked_max_seq_len(args.max_seq_len, model_dir)
    spec = draft_spec(args, drafter)
    if drafter is not None and not args.no_adapt:
        try:
            checked_short_draft_len(args.short_draft_len, spec)
        except ValueError as error:
            raise ValueError(str(error).replace("short_draft_len=", "--short-draft-len ")) from None
    return model_dir, drafter, spec


def _run_serve(args: argparse.Namespace) -> int:
    from jspec.bundle import is_bundled
    from jspec.serve.app import create_app

    _check_args(args)
    start_processes(args)
    model_dir, drafter, spec = resolve_serve_args(args)
    name = args.served_model_name or (BUNDLED_NAME if is_bundled(model_dir) else
                                      os.path.basename(os.path.normpath(model_dir)))
    sock = _listen(args.host, args.port)
    slots = warm_slot_engine(args, model_dir, drafter, spec)
    slots.start()
    host, port = sock.getsockname()[:2]
    method = f"drafter {drafter} {spec.tree} {spec.tree_size}" if drafter is not None else "no drafter"
    ready = f"jspec serve: http://{_url_host(host)}:{port}/v1 (model {name!r}, {method}) ready"
    parser = args.tool_call_parser if args.enable_auto_tool_choice else None
    config = uvicorn.Config(create_app(slots, name, parser, model_dir), loop="asyncio", lifespan="off",
                            log_level="warning", timeout_graceful_shutdown=args.shutdown_timeout + 5.0)
    server = DrainingServer(config, slots, args.shutdown_timeout, ready)
    server.run(sockets=[sock])
    server.drain()
    return 0


def warm_slot_engine(args: argparse.Namespace, model_dir: str, drafter, spec):
    """The slot engine ``jspec serve`` runs for ``args`` (checked), loaded and warmed up (not started)."""
    import jspec
    from jspec.serve.slots import SlotEngine

    engine = jspec.SpecEngine.from_pretrained(model_dir, drafter=drafter, spec=spec,
                                              max_batch_size=min(args.max_num_seqs, 8), max_seq_len=args.max_seq_len,
                                              dtype=args.dtype, quantization=args.quantization,
                                              **mesh_kwargs(args))
    slots = SlotEngine(engine, max_queue=args.max_queue, steps_per_chunk=args.steps_per_chunk,
                       adapt=not args.no_adapt, short_draft_len=args.short_draft_len, **paged_kwargs(args))
    slots.warm_up(engine.tokenizer.encode(CALIBRATION_PROMPT).ids if engine.tokenizer is not None else None)
    return slots


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class DrainingServer(uvicorn.Server):
    """uvicorn's server with jspec's shutdown: SIGTERM stops admissions and drains the slot engine (in a thread, so
    the event loop keeps streaming the requests still running) while uvicorn waits for their connections; SIGINT is
    left to the command line's own handler (exit 130 at once)."""

    def __init__(self, config, slots, shutdown_timeout: float, ready_line: str | None = None):
        super().__init__(config)
        self.slots, self.shutdown_timeout, self.ready_line = slots, shutdown_timeout, ready_line
        self._drain_thread: threading.Thread | None = None
        self._drain_lock = threading.RLock()  # a signal may arrive while drain() holds it

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.ready_line:
            print(self.ready_line, flush=True)

    @contextlib.contextmanager
    def capture_signals(self):
        """SIGTERM -> :meth:`handle_exit`; restored afterwards and, unlike uvicorn's, not raised again (the process
        exits 0 once drained)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = signal.signal(signal.SIGTERM, self.handle_exit)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def handle_exit(self, sig, frame) -> None:
        self._start_drain()
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        with self._drain_lock:
            if self._drain_thread is None:
                self._drain_thread = threading.Thread(target=self.slots.shutdown, args=(self.shutdown_timeout,),
                                                      name="jspec-drain", daemon=True)
                self._drain_thread.start()

    def drain(self) -> None:
        """Stops the slot engine (if a signal has not already) and waits for it."""
        self._start_drain()
        self._drain_thread.join()
