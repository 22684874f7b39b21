"""Run by test_default_server.py in a fresh process: the slot engine `jspec serve` builds with no flags (or the
flags given), warmed up under a memory-mapping limit of the stock vm.max_map_count whatever this machine's is, one
greedy request served; prints one JSON line: the mappings in use, the tokens served and offline generate's, and
the compiles heard on the scheduler's thread."""

import json
import sys
import threading
import time

import jax

from jspec.serve import memory_maps
from jspec.serve.requests import Request
from jspec.tools import cli
from jspec.tools.serve_cmd import resolve_serve_args, warm_slot_engine

STOCK_MAX_MAP_COUNT = 65530


def main(argv: list[str]) -> None:
    memory_maps.max_map_count = lambda: STOCK_MAX_MAP_COUNT
    args = cli.build_parser().parse_args(["serve", *argv])
    model_dir, drafter, spec = resolve_serve_args(args)
    began = time.perf_counter()
    slots = warm_slot_engine(args, model_dir, drafter, spec)
    warm_seconds = time.perf_counter() - began
    served_compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: served_compiles.append(event)
        if "backend_compile" in event and threading.current_thread().name == "jspec-slots" else None)
    slots.start()
    prompt = slots.engine.tokenizer.encode("def fibonacci(n):").ids
    done, tokens = threading.Event(), []

    def sink(new, reason, *logprobs):
        tokens.extend(new)
        if reason is not None:
            done.set()

    slots.submit(Request(prompt_ids=prompt, max_tokens=24, sink=sink))
    assert done.wait(120), "the request did not finish"
    slots.runner.programs.wait_idle()  # the programs the request asked for count in the mappings measured below
    slots.shutdown()
    expected = slots.engine.generate([prompt], max_new_tokens=24).token_ids[0]
    print(json.dumps({"maps": memory_maps.maps_in_use(), "warm_seconds": warm_seconds, "tokens": tokens,
                      "expected": expected, "served_compiles": served_compiles,
                      "num_compiled": slots.num_compiled}))


if __name__ == "__main__":
    main(sys.argv[1:])
