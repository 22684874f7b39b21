"""The servers a pass runs against: two launched in this process (one slot engine and uvicorn thread each, over
one copy of the weights), or one already running at a URL (:func:`http_target`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jspec.tools.bench_serve.client import run_direct_pass, run_pass
from jspec.tools.bench_serve.counters import parse_counters, scrape_counters
from jspec.tools.bench_serve.figures import RequestResult


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def uvicorn_thread(app, host: str, port: int, start_timeout: float = 600.0) -> Iterator[str]:
    """Runs ``app`` with uvicorn in a daemon thread until the block ends -> its base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"the server on {host}:{port} did not start (see its log above)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server on {host}:{port} did not start within {start_timeout:.0f} s")
        time.sleep(0.05)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=120.0)


def load_engines(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """The speculative engine ``jspec serve`` would run (``--drafter``, else the backend's default method) and a
    plain engine over the same weights -> (spec, plain, a description for the report)."""
    import jax

    import jspec
    from jspec.tools.bundled import default_method, default_spec

    drafter, spec = default_method(jax.default_backend())
    if args.drafter is not None:
        drafter, spec = args.drafter, default_spec(args.drafter)
    target = args.model or jspec.bundled_model()
    spec_engine = jspec.SpecEngine.from_pretrained(target, drafter=drafter, spec=spec,
                                                   max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len)
    return spec_engine, spec_engine.plain(), {
        "model": str(target), "drafter": drafter, "spec": dataclasses.asdict(spec),
        "max_batch_size": args.max_batch_size, "max_seq_len": args.max_seq_len,
        "steps_per_chunk": args.steps_per_chunk, "adapt": not args.no_adapt,
        "short_draft_len": args.short_draft_len, "async_scheduling": args.async_scheduling}


@dataclasses.dataclass
class Target:
    """What a pass runs against: ``run(prompts, max_tokens, rate, seed) -> (results, seconds)``; ``counters()``:
    the server's step-program and acceptance counters now ({} when it has none)."""

    run: Callable[[Sequence, int, float | str, int], tuple[list[RequestResult], float]]
    counters: Callable[[], dict[str, float]]


def http_target(base_url: str, model: str, **payload_flags) -> Target:
    return Target(lambda prompts, max_tokens, rate, seed: asyncio.run(
        run_pass(base_url, model, prompts, max_tokens, rate, seed, **payload_flags)),
        lambda: scrape_counters(base_url))


@contextlib.contextmanager
def launch_servers(engines: dict[str, Any], args: argparse.Namespace, host: str = "127.0.0.1",
                   costs: dict | None = None) -> Iterator[dict[str, Target]]:
    """One slot engine and app (``jspec.serve.app.create_app``, as ``jspec serve`` builds them: warmed up on its
    calibration prompt, log-probabilities and logits processors available) per engine, each on uvicorn in a thread on a free port -> {name: its HTTP target}, and
    with ``args.direct`` also {name-direct: the same slot engine without HTTP}; all are shut down when the block
    ends. ``costs``, when given, receives each server's start-up cost table."""
    from jspec.bundle import is_bundled
    from jspec.serve.app import create_app
    from jspec.serve.slots import SlotEngine
    from jspec.tools.serve_cmd import BUNDLED_NAME, CALIBRATION_PROMPT, DEFAULT_LOGITS_PROCESSORS, DEFAULT_MAX_LOGPROBS

    model_dir = args.model or ""
    name = BUNDLED_NAME if not model_dir or is_bundled(model_dir) else os.path.basename(os.path.normpath(model_dir))
    flags = {"ignore_eos": args.ignore_eos, "token_ids": not args.no_token_ids}
    with contextlib.ExitStack() as stack:
        targets = {}
        for server, engine in engines.items():
            slots = SlotEngine(engine, max_queue=max(256, args.num_prompts), steps_per_chunk=args.steps_per_chunk,
                               adapt=not args.no_adapt, async_scheduling=args.async_scheduling,
                               short_draft_len=args.short_draft_len if engine.setup.drafter is not None else None,
                               max_logprobs=DEFAULT_MAX_LOGPROBS, logits_processors=DEFAULT_LOGITS_PROCESSORS)
            slots.warm_up(engine.tokenizer.encode(CALIBRATION_PROMPT).ids if engine.tokenizer is not None else None)
            slots.start()
            stack.callback(slots.shutdown, 30.0)
            if costs is not None:
                costs[server] = slots.costs.to_dict() if slots.costs is not None else None
            url = stack.enter_context(uvicorn_thread(create_app(slots, name), host, free_port(host)))
            targets[server] = http_target(url, args.model_name or name, **flags)
            if args.direct:
                targets[f"{server}-direct"] = Target(
                    lambda prompts, max_tokens, rate, seed, slots=slots: run_direct_pass(
                        slots, prompts, max_tokens, rate, seed),
                    lambda slots=slots: parse_counters(slots.metrics.render().decode()))
            print(f"[bench-serve] {server} server ready at {url} (cost table "
                  f"{costs.get(server) if costs is not None else '-'})", flush=True)
        yield targets

