"""A mixed, sampled, ragged load against two `jspec serve` processes (speculative: the default drafter; plain:
``--drafter none``) over HTTP, and offline ``SpecEngine.generate`` of the same prompts as one batch, in one run.

    python scripts/serve_load.py --num-requests 64 --json load.json

Each server gets ``--warmup`` requests first, then ``--num-requests`` concurrent ``/v1/completions`` requests (at most
``--max-concurrency`` in flight, the next sent as one ends, where given):
HumanEval prompts (their last 400 characters), ``max_tokens`` drawn from {8, 32, 64, 128}, every second request
sampled (temperature 0.8, its own seed). Prints tokens/s, latency p50/p90, and the server's counters (chunks,
preemptions, KV usage) for each, then the ratios. Extra ``jspec serve`` flags for every server go after ``--``.

``--server NAME=FLAGS`` (repeatable) runs other servers instead, side by side, the first two compared; for
instance async scheduling against none on the speculative server, with longer outputs:

    python scripts/serve_load.py --no-offline --max-tokens 256 \
        --server "async=--async-scheduling" --server "sync=--no-async-scheduling"

``--request NAME=JSON`` adds fields to every request body sent to server NAME (a feature's cost under the same
load), for instance log-probabilities and penalties on the default server against none:

    python scripts/serve_load.py --no-offline --server "plain-api=--max-logprobs -1 --no-logits-processors" \
        --server "default=" --server "asking=" --request 'asking={"logprobs": 5, "presence_penalty": 0.5}'

``--rounds N --settle`` compares servers in their steady state: all of them up at once, each settled (the load run
unmeasured until a pass leaves no program compiling on first use: ``jspec:programs_compiling``), then N measured rounds
in alternating order (A B, B A, ...), tokens/s the mean of a server's rounds. Without it a fresh server's first
requests share the CPU with the compiles they set off, which a server with bigger programs pays more for.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np

MAX_TOKENS = (8, 32, 64, 128)
DEFAULT_SERVERS = ("spec=", "plain=--drafter none")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load(num: int, seed: int, max_tokens: tuple[int, ...] = MAX_TOKENS) -> list[dict]:
    from jspec.train.corpus import human_eval_prompts

    prompts = [p["prompt"][-400:] for p in human_eval_prompts()]
    rng = np.random.default_rng(seed)
    return [dict(prompt=prompts[i % len(prompts)], max_tokens=int(rng.choice(max_tokens)),
                 temperature=0.8 if i % 2 else 0.0, seed=seed + i) for i in range(num)]


COUNTERS = ("chunks_total", "preemptions", "kv_cache_usage", "generation_tokens_total", "prompt_tokens_total",
            "busy_seconds_total", "prefix_cache", "programs_compiled", "structured_ahead", "step_seconds_sum",
            "step_seconds_count")  # the step_seconds pair: seconds per step of each program, summed over its chunks


def counters(base: str, keys: tuple[str, ...] = COUNTERS) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("jspec:") and " " in line:
            name, value = line.rsplit(" ", 1)
            if any(key in name for key in keys):
                out[name] = float(value)
    return out


def request_extras(items: list[str], names: set[str]) -> dict[str, dict]:
    """``--request NAME=JSON`` items -> {NAME: the fields added to every request body sent to server NAME};
    ValueError naming an item that is not NAME=JSON object for one of ``names``."""
    extras: dict[str, dict] = {}
    for item in items:
        name, sep, text = item.partition("=")
        try:
            extras[name] = json.loads(text)
        except ValueError:
            extras[name] = None
        if not sep or name not in names or not isinstance(extras[name], dict):
            raise ValueError(f"--request {item!r}: expected NAME=JSON object for one of the servers {sorted(names)}")
    return extras


def fire(base: str, model: str, requests: list[dict], per_request: list[int] | None = None,
         max_concurrency: int | None = None) -> tuple[float, list[float], int]:
    """All requests at once, or at most ``max_concurrency`` in flight (the next sent as one ends, in order: vLLM's
    ``benchmark_serving --max-concurrency``) -> (seconds, latency per request, completion tokens); per_request:
    filled with each request's completion tokens."""
    def one(body: dict) -> tuple[float, int]:
        start = time.perf_counter()
        reply = httpx.post(f"{base}/v1/completions", json=dict(model=model, **body), timeout=1200)
        reply.raise_for_status()
        return time.perf_counter() - start, reply.json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(min(max_concurrency or len(requests), len(requests))) as pool:
        results = list(pool.map(one, requests))
    if per_request is not None:
        per_request[:] = [r[1] for r in results]
    return time.perf_counter() - start, [r[0] for r in results], sum(r[1] for r in results)


class Served:
    """One `jspec serve` process on a free local port, started (ready) on creation."""

    def __init__(self, name: str, flags: list[str]):
        self.name, self.flags = name, flags
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen([sys.executable, "-m", "jspec.tools.cli", "serve", "--port", str(port), *flags],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started = time.perf_counter()
        self.replicas: list[str] = []
        for line in self.process.stdout:
            sys.stdout.write(f"[{name}] {line}")
            if "ready" in line and self.base in line:  # its own address (a fleet's replicas print theirs first)
                # a fleet's line names its replicas, whose metrics are the fleet's (the router's are its own)
                self.replicas = re.findall(r"http://[^\s)]+", line.split("sglang-router:", 1)[-1]) \
                    if "sglang-router:" in line else []
                break
        threading.Thread(target=lambda: [None for _ in self.process.stdout], daemon=True).start()  # never full
        self.model = httpx.get(f"{self.base}/v1/models", timeout=30).json()["data"][0]["id"]
        self.start_up_seconds = time.perf_counter() - started

    def settle(self, requests: list[dict], passes: int = 8, timeout: float = 900.0) -> None:
        """Runs ``requests`` unmeasured and waits for the compiles they set off, again until a pass sets off none
        (a repeated load hits the prefix cache: other prefill programs), at most ``passes`` times: measured rounds
        then time serving, not first-use compiles."""
        end = time.monotonic() + timeout
        for _ in range(passes):
            before = self.programs()
            fire(self.base, self.model, requests)
            while self.programs("programs_compiling") and time.monotonic() < end:
                time.sleep(1.0)
            if self.programs() == before:
                return

    def programs(self, gauge: str = "programs_compiled") -> float:
        return self.counters((gauge,)).get(f"jspec:{gauge}", 0.0)

    def counters(self, keys: tuple[str, ...] = COUNTERS) -> dict[str, float]:
        """Its counters (``counters``); a fleet's summed over its replicas (its gauges too: the usage fractions add
        up to the replicas' count at most)."""
        out: dict[str, float] = {}
        for base in self.replicas or [self.base]:
            for name, value in counters(base, keys).items():
                out[name] = out.get(name, 0.0) + value
        return out

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def measure(servers: list[Served], requests: dict[str, list[dict]], rounds: int,
            max_concurrency: int | None = None) -> list[dict]:
    """``rounds`` measured rounds of each server's requests (at most ``max_concurrency`` in flight: :func:`fire`),
    the order alternating (A B, B A, ...: drift in the machine's speed falls on both) -> per server its mean
    tokens/s, each round's, latencies and counters."""
    per = {s.name: dict(seconds=[], tokens=[], latencies=[], before=s.counters()) for s in servers}
    for round_ in range(rounds):
        for server in (servers if round_ % 2 == 0 else servers[::-1]):
            seconds, latencies, tokens = fire(server.base, server.model, requests[server.name],
                                              max_concurrency=max_concurrency)
            record = per[server.name]
            record["seconds"].append(seconds)
            record["tokens"].append(tokens)
            record["latencies"] += latencies
    results = []
    for server in servers:
        record, after = per[server.name], server.counters()
        rates = [t / s for t, s in zip(record["tokens"], record["seconds"])]
        results.append(dict(name=server.name, flags=server.flags, start_up_seconds=server.start_up_seconds,
                            rounds=rounds, max_concurrency=max_concurrency, seconds=float(np.mean(record["seconds"])),
                            tokens=int(np.mean(record["tokens"])), tokens_per_second=float(np.mean(rates)),
                            round_tokens_per_second=rates, p50=float(np.percentile(record["latencies"], 50)),
                            p90=float(np.percentile(record["latencies"], 90)),
                            counters={k: after[k] - record["before"].get(k, 0.0) for k in after}))
    return results


def offline(requests: list[dict], max_seq_len: int) -> dict:
    """The server's default drafter in ``SpecEngine.generate`` over every prompt as one batch, greedy. One call
    takes one max_new_tokens: it runs the largest, and each request counts the tokens its own max_tokens keeps (a
    batch steps until its longest row is done, every row at the same cost, so ragged budgets take as long)."""
    import jax

    import jspec
    from jspec.tools.bundled import default_method

    drafter, spec = default_method(jax.default_backend())
    engine = jspec.SpecEngine.from_pretrained(jspec.bundled_model(), drafter=drafter, spec=spec,
                                              max_batch_size=len(requests), max_seq_len=max_seq_len)
    prompts = [r["prompt"] for r in requests]
    budget = max(r["max_tokens"] for r in requests)
    engine.generate(prompts[:2], max_new_tokens=budget)  # compile
    engine.generate(prompts, max_new_tokens=budget)
    start = time.perf_counter()
    out = engine.generate(prompts, max_new_tokens=budget)
    seconds = time.perf_counter() - start
    tokens = sum(min(len(ids), r["max_tokens"]) for ids, r in zip(out.token_ids, requests))
    return dict(drafter=drafter, seconds=seconds, tokens=tokens, tokens_per_second=tokens / seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--no-offline", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--rounds", type=int, default=1,
                        help="measured rounds per server, every server up at once and the order alternating (A B, "
                             "B A, ...); tokens/s is the mean of the rounds")
    parser.add_argument("--settle", action="store_true",
                        help="before measuring, run the load unmeasured until a pass sets off no compile on "
                             "first use (time serving, not first-use compiles)")
    parser.add_argument("--max-tokens", default=",".join(map(str, MAX_TOKENS)),
                        help="the max_tokens each request draws from, comma-separated")
    parser.add_argument("--server", action="append", default=None, metavar="NAME=FLAGS",
                        help="a server to run and its jspec serve flags (repeatable, at least two; default: "
                             f"{' and '.join(repr(s) for s in DEFAULT_SERVERS)})")
    parser.add_argument("--request", action="append", default=[], metavar="NAME=JSON",
                        help="fields added to every request body sent to server NAME (repeatable)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="measured rounds keep at most this many requests in flight, the next sent as one ends "
                             "(vLLM's benchmark_serving flag; default: all of a round's requests at once)")
    parser.add_argument("--lengths-from", default=None, metavar="NAME",
                        help="every other server's request i asks for at most the completion tokens server NAME's "
                             "request i got (measured once, unmeasured, before the rounds): the same output lengths "
                             "where NAME's requests end sooner (a JSON schema that closes)")
    parser.add_argument("serve_flags", nargs="*", help="extra jspec serve flags for every server (after --)")
    args = parser.parse_args(argv)
    servers = [s.partition("=") for s in args.server or DEFAULT_SERVERS]
    if len(servers) < 2 or any(not name or not sep for name, sep, _ in servers):
        parser.error(f"--server {args.server}: expected at least two NAME=FLAGS")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        parser.error(f"--max-concurrency {args.max_concurrency}: expected at least 1")
    if args.lengths_from is not None and args.lengths_from not in {name for name, _, _ in servers}:
        parser.error(f"--lengths-from {args.lengths_from!r}: expected one of the --server names")
    try:
        extras = request_extras(args.request, {name for name, _, _ in servers})
    except ValueError as error:
        parser.error(str(error))
    max_tokens = tuple(int(n) for n in args.max_tokens.split(","))
    requests = load(args.num_requests, args.seed, max_tokens)
    warmup = load(args.warmup, args.seed + 10_000, max_tokens)
    common = ["--max-seq-len", str(args.max_seq_len), *args.serve_flags]
    bodies = {name: [{**r, **extras.get(name, {})} for r in requests] for name, _, _ in servers}
    running: list[Served] = []
    try:
        for name, _, flags in servers:  # one at a time: a server warming up would slow the other's
            running.append(Served(name, [*shlex.split(flags), *common]))
            fire(running[-1].base, running[-1].model, [{**r, **extras.get(name, {})} for r in warmup])
            if args.settle:
                running[-1].settle(bodies[name])
        if args.lengths_from is not None:
            source = next(server for server in running if server.name == args.lengths_from)
            lengths: list[int] = []
            fire(source.base, source.model, bodies[source.name], lengths)
            for server in running:
                if server is not source:
                    bodies[server.name] = [{**r, "max_tokens": max(1, min(r["max_tokens"], n))}
                                           for r, n in zip(bodies[server.name], lengths)]
                    if args.settle:  # other lengths, other buckets: compiled before the rounds
                        server.settle(bodies[server.name])
            print(f"max_tokens of the others from {source.name}'s outputs: {sum(lengths)} tokens in all")
        results = measure(running, bodies, args.rounds, args.max_concurrency)
    finally:
        for server in running:
            server.stop()
    if not args.no_offline:
        results.append(dict(name="offline", **offline(requests, args.max_seq_len)))
    spec, plain = results[0], results[1]
    print(f"{'':8} {'tokens/s':>9} {'p50 s':>7} {'p90 s':>7} {'seconds':>8}")
    for r in results:
        print(f"{r['name']:8} {r['tokens_per_second']:9.1f} {r.get('p50', float('nan')):7.2f} "
              f"{r.get('p90', float('nan')):7.2f} {r['seconds']:8.2f}")
    print(f"{spec['name']} / {plain['name']} tokens/s: {spec['tokens_per_second'] / plain['tokens_per_second']:.2f}x; "
          f"p50 {spec['p50']:.2f} s vs {plain['p50']:.2f} s")
    if not args.no_offline:
        print(f"{spec['name']} server / offline batch tokens/s: "
              f"{spec['tokens_per_second'] / results[-1]['tokens_per_second']:.2f}x")
    if args.rounds > 1:
        for r in results[:len(servers)]:
            print(f"{r['name']} tokens/s by round: {', '.join(f'{x:.1f}' for x in r['round_tokens_per_second'])}")
    for r in results[:len(servers)]:
        print(r["name"], json.dumps(r["counters"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
