"""``jspec bench-serve``: the OpenAI-compatible server under load, speculative vs plain, in one run (like vLLM's
``benchmark_serving.py``)::

    jspec bench-serve                                         # launches both servers itself, 32 HumanEval prompts
    jspec bench-serve --num-prompts 16 --max-tokens 64 --request-rates 1,inf --max-batch-size 4 \\
        --json serve.json --chart serve.png
    jspec bench-serve --base-url http://127.0.0.1:8000        # a server already running (one column; vLLM too)

Load: ``--num-prompts`` HumanEval prompts sent to POST /v1/completions (``stream: true``, greedy, ``stream_options:
{"include_usage": true}``) with Poisson arrivals at each of ``--request-rates`` requests/s (exponential
inter-arrival times drawn from ``--seed``; ``inf`` sends them all at once: saturation), plus, first, a sequential
pass (one request after another; ``--no-sequential`` skips it). Per server and rate: request throughput, output
tokens/s (tokens of completed requests / wall time of the pass, first send to last byte), time to first token
(TTFT: send to the first chunk carrying text), inter-token latency (ITL, per token: the gap between two successive
chunks that carry text divided by the tokens in the later one, one sample per token, as ``jspec serve``'s
``jspec_inter_token_latency_seconds`` histogram counts it; tokens per chunk are the server's ``token_ids`` or
``logprobs.tokens`` when it sends them, otherwise the request's ``usage.completion_tokens`` shared among its chunks
in proportion to their text) and time per output token (TPOT: (latency - TTFT) / (tokens - 1), per request), each
as p50/p90/p99. Output tokens are what the server reports it produced (``usage``): the servers stop at EOS, so a
request may return fewer than ``--max-tokens`` (``--ignore-eos`` asks servers that offer it, like vLLM, not to).

Without ``--base-url`` two servers run in this process on 127.0.0.1 (uvicorn in a thread each, one
:class:`jspec.serve.slots.SlotEngine` each, sharing one copy of the weights): ``spec``, the configuration ``jspec
serve`` uses by default (``jspec.tools.bundled.default_method``: the n-gram chain on a CPU), and ``plain``, the same
model with no drafter. Each pass runs on one server while the other idles; the two servers take turns at each rate,
so drift on a shared machine hits both alike. Token ids are sent as the prompt, so the servers and the offline
reference see the same tokens (prompts longer than ``--max-seq-len - --max-tokens`` keep their last tokens).

The offline reference, in the same run on the same engines and prompts (``SpecEngine.generate``, greedy, the
same EOS), timed in every round beside the passes it is compared with (batch 1 at the start of the round, batch
``--max-batch-size`` just before the saturated passes): (a) the speedup of speculative over plain at batch 1, against the servers' speedup in the sequential
pass (criterion: within 10%); (b) speculative ``generate`` tokens/s at batch ``--max-batch-size`` against the
speculative server's at saturation (criterion: >= 0.8x); and (c) the speculative server against the plain one at
every rate (load adaptation should never lose to plain decoding by more than noise; criterion: >= 0.95x).
``--repeats R`` runs R rounds: the table pools their requests; each check is the median of its per-round ratios
(for (c), per rate, then the worst rate).
``--direct`` adds rows ``spec-direct`` and ``plain-direct``: the same passes submitted straight to each server's
slot engine from this process (no HTTP, no detokenizing), which splits the gap to the offline figures between the
scheduler and the HTTP layer. ``--json`` writes every figure (``--json-requests``: and each request's chunk
timings), ``--chart`` a PNG: throughput, TTFT and ITL by rate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from jspec.tools.bench import environment

PERCENTILES = (50, 90, 99)
SEQUENTIAL = "sequential"  # the pass label of one request after another


# --- the arrival schedule ---------------------------------------------------------------------------------------

def parse_rates(text: str) -> list[float]:
    """--request-rates "0.5,1,inf" -> [0.5, 1.0, inf] (requests per second; inf: all at once)."""
    rates = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--request-rates {text!r}: {part!r} is not a number (or inf)") from None
        if not rate > 0:
            raise ValueError(f"--request-rates {text!r}: {part!r} is not > 0")
        rates.append(rate)
    if not rates:
        raise ValueError(f"--request-rates {text!r}: expected comma-separated rates, e.g. 0.5,1,inf")
    return rates


def poisson_offsets(num_requests: int, rate: float, seed: int) -> np.ndarray:
    """Send times f64[num_requests] in seconds after the pass starts: a Poisson process of ``rate`` requests/s
    (the first at 0, then exponential gaps of mean 1 / rate drawn from ``seed``); rate inf: all zeros."""
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests}: expected >= 1")
    if math.isinf(rate):
        return np.zeros(num_requests)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


# --- figures ----------------------------------------------------------------------------------------------------

def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """{"mean", "p50", "p90", "p99"} of ``values`` times ``scale`` (numpy's linear-interpolation percentiles);
    None each when there are no values."""
    if len(values) == 0:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    array = np.asarray(values, np.float64) * scale
    return {"mean": float(array.mean()), **{f"p{q}": float(np.percentile(array, q)) for q in PERCENTILES}}


@dataclasses.dataclass
class RequestResult:
    """One streamed request. Times in seconds after it was sent; chunk_times/chunk_texts: each SSE chunk that
    carried text; chunk_token_counts: the server's tokens per such chunk when it sends them (else None);
    output_tokens: usage.completion_tokens (else the server's per-chunk counts, else the chunks)."""

    index: int
    sent_at: float = 0.0             # seconds after the pass started
    ttft: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    tokens_from: str = "usage"       # "usage" | "token_ids" | "chunks"
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    chunk_texts: list[str] = dataclasses.field(default_factory=list)
    chunk_token_counts: list[int] | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.latency is not None


def request_record(result: RequestResult) -> dict[str, Any]:
    """A request for the JSON report: times rounded to microseconds, the text as its length and SHA-1 (enough to
    compare outputs across servers without storing them)."""
    record = dataclasses.asdict(result)
    text = "".join(record.pop("chunk_texts"))
    record.update(text_chars=len(text), text_sha1=hashlib.sha1(text.encode()).hexdigest())
    for key in ("sent_at", "ttft", "latency"):
        record[key] = None if record[key] is None else round(record[key], 6)
    record["chunk_times"] = [round(t, 6) for t in record["chunk_times"]]
    return record


def tokens_per_chunk(result: RequestResult) -> list[float]:
    """Tokens each text chunk carried: the server's counts, or output_tokens shared in proportion to text length
    (equal shares when no chunk has text)."""
    if result.chunk_token_counts is not None:
        return [float(n) for n in result.chunk_token_counts]
    lengths = np.asarray([len(t) for t in result.chunk_texts], np.float64)
    if len(lengths) == 0:
        return []
    shares = lengths / lengths.sum() if lengths.sum() > 0 else np.full(len(lengths), 1.0 / len(lengths))
    return (shares * result.output_tokens).tolist()


def inter_token_latencies(result: RequestResult) -> list[float]:
    """Per-token ITL samples of one request: for every chunk after the first, (its arrival - the previous chunk's)
    / its tokens, once per token (rounded; at least once)."""
    counts = tokens_per_chunk(result)
    samples = []
    for i in range(1, len(result.chunk_times)):
        tokens = max(counts[i], 1e-9)
        gap = (result.chunk_times[i] - result.chunk_times[i - 1]) / max(tokens, 1.0)
        samples += [gap] * max(round(tokens), 1)
    return samples


def time_per_output_token(result: RequestResult) -> float | None:
    """(latency - TTFT) / (tokens - 1): the mean gap between tokens after the first (None for one token)."""
    if not result.ok or result.ttft is None or result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


@dataclasses.dataclass
class PassSummary:
    """One server at one rate. Throughputs over the pass's wall time (first send to last byte); latencies in
    milliseconds (mean, p50, p90, p99)."""

    server: str
    rate: float | str                # requests/s, inf, or "sequential"
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float        # completed requests / s
    output_tokens: int
    output_throughput: float         # output tokens / s
    ttft_ms: dict
    itl_ms: dict
    tpot_ms: dict
    latency_ms: dict
    tokens_from: str
    errors: list[str]
    server_counters: dict = dataclasses.field(default_factory=dict)  # jspec serve's /metrics over the pass


def summarize_pass(server: str, rate: float | str, results: Sequence[RequestResult], duration: float) -> PassSummary:
    done = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in done)
    itl = [x for r in done for x in inter_token_latencies(r)]
    tpot = [t for t in (time_per_output_token(r) for r in done) if t is not None]
    sources = sorted({r.tokens_from for r in done}) or ["-"]
    return PassSummary(server, rate, len(results), len(done), len(results) - len(done), duration,
                       len(done) / duration if duration > 0 else 0.0, tokens,
                       tokens / duration if duration > 0 else 0.0,
                       summarize([r.ttft for r in done if r.ttft is not None], 1e3), summarize(itl, 1e3),
                       summarize(tpot, 1e3), summarize([r.latency for r in done], 1e3), "+".join(sources),
                       sorted({r.error for r in results if r.error})[:5])


# --- the client -------------------------------------------------------------------------------------------------

def completion_payload(model: str, prompt: str | list[int], max_tokens: int, seed: int, ignore_eos: bool = False,
                       token_ids: bool = True) -> dict[str, Any]:
    """An OpenAI /v1/completions streaming request, greedy, with a final usage chunk; ``return_token_ids`` (vLLM's
    extension, which ``jspec serve`` has too) puts each chunk's token ids in its choice."""
    payload = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "seed": seed,
               "stream": True, "stream_options": {"include_usage": True}}
    if token_ids:
        payload["return_token_ids"] = True
    if ignore_eos:
        payload["ignore_eos"] = True
    return payload


def read_event(line: str) -> dict | str | None:
    """One SSE line -> its JSON object, "[DONE]", or None (blank lines, comments, other fields)."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        return data
    return json.loads(data) if data else None


async def stream_completion(client, url: str, payload: dict, index: int, pass_start: float) -> RequestResult:
    """POSTs one streaming completion and times its chunks (``time.perf_counter``); errors are recorded, never
    raised (a failed request counts as failed, the pass goes on)."""
    result = RequestResult(index)
    start = time.perf_counter()
    result.sent_at = start - pass_start
    server_counts: list[int] | None = []
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {response.status_code}: {body}"
                return result
            async for line in response.aiter_lines():
                event = read_event(line)
                if event is None:
                    continue
                if event == "[DONE]":
                    break
                if event.get("error"):
                    result.error = f"stream error: {str(event['error'])[:300]}"
                    return result
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or []:
                    text = choice.get("text") or ""
                    ids = choice.get("token_ids")
                    if ids is None and isinstance(choice.get("logprobs"), dict):
                        ids = choice["logprobs"].get("tokens")
                    if text and ids is None:
                        server_counts = None  # this server does not send them
                    if text or ids:
                        now = time.perf_counter() - start
                        if result.ttft is None:
                            result.ttft = now
                        result.chunk_times.append(now)
                        result.chunk_texts.append(text)
                        if server_counts is not None:
                            server_counts.append(len(ids))
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
        result.latency = time.perf_counter() - start
    except Exception as error:  # noqa: BLE001 -- the network's or the server's failure: this request failed
        result.error = f"{type(error).__name__}: {error}"[:300]
        return result
    result.chunk_token_counts = server_counts if server_counts else None
    if usage_tokens is not None:
        result.output_tokens, result.tokens_from = int(usage_tokens), "usage"
    elif result.chunk_token_counts is not None:
        result.output_tokens, result.tokens_from = sum(result.chunk_token_counts), "token_ids"
    else:
        result.output_tokens, result.tokens_from = len(result.chunk_times), "chunks"
    return result


async def run_pass(base_url: str, model: str, prompts: Sequence[str | list[int]], max_tokens: int,
                   rate: float | str, seed: int, **payload_flags) -> tuple[list[RequestResult], float]:
    """Sends every prompt once: sequentially (rate "sequential") or at Poisson times of ``rate`` requests/s ->
    (results in prompt order, wall seconds from the first send to the last byte)."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        start = time.perf_counter()
        if rate == SEQUENTIAL:
            results = []
            for i, prompt in enumerate(prompts):
                results.append(await stream_completion(
                    client, url, completion_payload(model, prompt, max_tokens, seed + i, **payload_flags), i, start))
            return results, time.perf_counter() - start
        offsets = poisson_offsets(len(prompts), float(rate), seed)

        async def send(i: int, prompt) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            return await stream_completion(
                client, url, completion_payload(model, prompt, max_tokens, seed + i, **payload_flags), i, start)

        results = await asyncio.gather(*(send(i, p) for i, p in enumerate(prompts)))
        return list(results), time.perf_counter() - start


def served_model(base_url: str) -> str:
    """The first model id GET /v1/models lists (what --model-name defaults to)."""
    import httpx

    response = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30.0)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model: pass --model-name")
    return models[0]["id"]


# --- the servers, in this process -------------------------------------------------------------------------------

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
        "steps_per_chunk": args.steps_per_chunk, "adapt": not args.no_adapt}


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
    calibration prompt) per engine, each on uvicorn in a thread on a free port -> {name: its HTTP target}, and
    with ``args.direct`` also {name-direct: the same slot engine without HTTP}; all are shut down when the block
    ends. ``costs``, when given, receives each server's start-up cost table."""
    from jspec.bundle import is_bundled
    from jspec.serve.app import create_app
    from jspec.serve.slots import SlotEngine
    from jspec.tools.serve_cmd import BUNDLED_NAME, CALIBRATION_PROMPT

    model_dir = args.model or ""
    name = BUNDLED_NAME if not model_dir or is_bundled(model_dir) else os.path.basename(os.path.normpath(model_dir))
    flags = {"ignore_eos": args.ignore_eos, "token_ids": not args.no_token_ids}
    with contextlib.ExitStack() as stack:
        targets = {}
        for server, engine in engines.items():
            slots = SlotEngine(engine, max_queue=max(256, args.num_prompts), steps_per_chunk=args.steps_per_chunk,
                               adapt=not args.no_adapt)
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


def run_direct_pass(slots, prompts: Sequence[list[int]], max_tokens: int, rate: float | str,
                    seed: int) -> tuple[list[RequestResult], float]:
    """As :func:`run_pass`, but submitted straight to the slot engine (no HTTP, no detokenizing): what the
    scheduler alone costs. A chunk is a sink call; its tokens are exact."""
    from jspec.serve.slots import Request

    results = [RequestResult(i, chunk_token_counts=[]) for i in range(len(prompts))]
    finished = [threading.Event() for _ in prompts]

    def sink_for(i: int, sent: float):
        def sink(tokens: list[int], reason: str | None) -> None:
            now, result = time.perf_counter() - sent, results[i]
            if tokens:
                result.ttft = now if result.ttft is None else result.ttft
                result.chunk_times.append(now)
                result.chunk_texts.append("")
                result.chunk_token_counts.append(len(tokens))
                result.output_tokens += len(tokens)
            if reason is not None:
                result.latency, result.finish_reason = now, reason
                finished[i].set()
        return sink

    offsets = None if rate == SEQUENTIAL else poisson_offsets(len(prompts), float(rate), seed)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        if offsets is not None:
            time.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
        sent = time.perf_counter()
        results[i].sent_at, results[i].tokens_from = sent - start, "token_ids"
        slots.submit(Request(list(prompt), max_tokens, sink_for(i, sent), seed=seed + i))
        if offsets is None:
            finished[i].wait()
    for event in finished:
        event.wait()
    return results, time.perf_counter() - start


def scrape_counters(base_url: str) -> dict[str, float]:
    """``jspec serve``'s step-program and acceptance counters from GET /metrics ({} from servers without them)."""
    import httpx

    try:
        return parse_counters(httpx.get(base_url.rstrip("/") + "/metrics", timeout=10.0).text)
    except Exception:  # noqa: BLE001 -- another server's metrics, or none: the figures are extras
        return {}


def parse_counters(text: str) -> dict[str, float]:
    """Prometheus text -> {"chunks_<program>": chunks run, "sum"/"count": of jspec:acceptance_length}."""
    from prometheus_client.parser import text_string_to_metric_families

    counters = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "jspec:chunks_total":
                counters[f"chunks_{sample.labels.get('program')}"] = sample.value
            elif sample.name in ("jspec:acceptance_length_sum", "jspec:acceptance_length_count"):
                counters[sample.name.split("_")[-1]] = sample.value
    return counters


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def counter_figures(delta: dict[str, float]) -> dict[str, float | None]:
    """What the counters' change over passes says: the share of chunks that ran the speculative program, and the
    mean tokens committed per verify step of a running request."""
    spec, plain = delta.get("chunks_speculative", 0.0), delta.get("chunks_plain", 0.0)
    return {"speculative_chunk_share": spec / (spec + plain) if spec + plain else None,
            "acceptance_length": delta["sum"] / delta["count"] if delta.get("count") else None}


# --- the offline reference --------------------------------------------------------------------------------------

class OfflineReference:
    """``SpecEngine.generate`` on the servers' engines and prompts, greedy, at batch 1 (one prompt per call) and at
    ``batch_size`` (prompts grouped by length, as ``jspec bench``). Everything compiles in the constructor; each
    :meth:`time` is one timed pass per engine. Tokens/s: new tokens / run seconds (``GenerateStats``: the compiled
    program's wall time, prefill included, compilation and host-side batching excluded, as ``jspec bench``)."""

    def __init__(self, engines: dict[str, Any], ids: Sequence[list[int]], max_tokens: int, batch_size: int):
        from jspec.tools.eval_acceptance import run_method

        self.engines, self.ids, self.max_tokens, self.batch_size = engines, ids, max_tokens, batch_size
        self._run = run_method
        for batch in dict.fromkeys((1, batch_size)):
            for engine in engines.values():
                run_method(engine, ids, batch, max_tokens)  # compiles every bucket

    def time(self, batch: int) -> dict[str, dict]:
        figures = {}
        for name, engine in self.engines.items():
            _, stats = self._run(engine, self.ids, batch, self.max_tokens)
            figures[f"{name}_batch{batch}"] = {
                "batch_size": batch, "tokens_per_second": stats["num_generated_tokens"] / stats["run_seconds"],
                "output_tokens": stats["num_generated_tokens"], "acceptance_length": stats["acceptance_length"],
                "run_seconds": stats["run_seconds"]}
            print(f"[bench-serve] offline {name} batch {batch}: "
                  f"{figures[f'{name}_batch{batch}']['tokens_per_second']:.1f} tokens/s", flush=True)
        return figures


def median_offline(rounds: Sequence[dict[str, dict]]) -> dict[str, Any]:
    """Per figure, the round with the median tokens/s (the rounds themselves are in the report), and the median
    over rounds of each round's batch-1 speedup."""
    merged: dict[str, Any] = {}
    for key in dict.fromkeys(k for r in rounds for k in r):
        figures = sorted((r[key] for r in rounds if key in r), key=lambda f: f["tokens_per_second"])
        merged[key] = {**figures[len(figures) // 2], "tokens_per_second_runs": [f["tokens_per_second"]
                                                                             for f in figures]}
    speedups = [r["spec_batch1"]["tokens_per_second"] / r["plain_batch1"]["tokens_per_second"]
                for r in rounds if "spec_batch1" in r and "plain_batch1" in r]
    if speedups:
        merged["speedup_batch1"] = float(np.median(speedups))
    return merged


def criteria(passes: Sequence[PassSummary], offline: dict[str, Any] | None, batch_size: int) -> list[dict]:
    """The three checks (module docstring) on one round, each {"name", "ratio", "low", "high" (None: no upper
    bound), "detail"}; a check whose figures the round lacks is left out. (c)'s ratio is its worst rate's;
    "per_rate" has them all."""
    by = {(p.server, p.rate): p for p in passes}
    checks = []
    seq_spec, seq_plain = by.get(("spec", SEQUENTIAL)), by.get(("plain", SEQUENTIAL))
    if offline and "spec_batch1" in offline and seq_spec and seq_plain and seq_plain.output_throughput > 0:
        served = seq_spec.output_throughput / seq_plain.output_throughput
        alone = offline["spec_batch1"]["tokens_per_second"] / offline["plain_batch1"]["tokens_per_second"]
        checks.append({"name": "(a) server speedup, one request at a time / offline speedup at batch 1",
                       "ratio": served / alone, "low": 0.90, "high": 1.10,
                       "detail": f"{served:.2f}x / {alone:.2f}x"})
    saturated, key = by.get(("spec", math.inf)), f"spec_batch{batch_size}"
    if offline and saturated and key in offline:
        reference = offline[key]["tokens_per_second"]
        checks.append({"name": f"(b) spec server at saturation / offline spec generate at batch {batch_size}",
                       "ratio": saturated.output_throughput / reference, "low": 0.80, "high": None,
                       "detail": f"{saturated.output_throughput:.0f} / {reference:.0f} tokens/s"})
    rates = [p.rate for p in passes if p.server == "spec" and ("plain", p.rate) in by]
    if rates:
        per_rate = {rate_label(r): by[("spec", r)].output_throughput / max(by[("plain", r)].output_throughput, 1e-9)
                    for r in rates}
        checks.append({"name": "(c) spec server / plain server, output tokens/s, worst rate",
                       "ratio": min(per_rate.values()), "low": 0.95, "high": None, "per_rate": per_rate,
                       "detail": ", ".join(f"{r}: {v:.2f}x" for r, v in per_rate.items())})
    return checks


def combine_checks(rounds: Sequence[Sequence[dict]]) -> list[dict]:
    """Each check over the rounds: its median ratio (for (c): per rate, then the worst) against its bounds ->
    {"name", "ratio", "ratios" (per round), "target", "holds", "measured"}."""
    combined = []
    for name in dict.fromkeys(c["name"] for r in rounds for c in r):
        mine = [c for r in rounds for c in r if c["name"] == name]
        if "per_rate" in mine[0]:
            per_rate = {rate: float(np.median([c["per_rate"][rate] for c in mine if rate in c["per_rate"]]))
                        for rate in mine[0]["per_rate"]}
            ratio = min(per_rate.values())
        else:
            per_rate, ratio = None, float(np.median([c["ratio"] for c in mine]))
        low, high = mine[0]["low"], mine[0]["high"]
        target = f">= {low:.2f}" if high is None else f"{low:.2f}..{high:.2f}"
        measured = (f"median {ratio:.2f}" if per_rate is None else
                    "median per rate " + ", ".join(f"{r}: {v:.2f}x" for r, v in per_rate.items()))
        combined.append({"name": name, "ratio": ratio, "ratios": [c["ratio"] for c in mine], "target": target,
                         "holds": low <= ratio and (high is None or ratio <= high), "per_rate": per_rate,
                         "measured": f"{measured} (rounds: " + "; ".join(c["detail"] for c in mine) + ")"})
    return combined


# --- output -----------------------------------------------------------------------------------------------------

def rate_label(rate: float | str) -> str:
    if rate == SEQUENTIAL:
        return "seq"
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _ms(stats: dict, key: str) -> str:
    return "-" if stats.get(key) is None else f"{stats[key]:.1f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def table_rows(passes: Sequence[PassSummary]) -> tuple[list[str], list[list[str]]]:
    header = ["rate", "server", "ok/n", "req/s", "out tok/s", "TTFT p50", "p90", "p99", "ITL p50", "p90", "p99",
              "TPOT p50", "spec chunks"]
    rows = [[rate_label(p.rate), p.server, f"{p.completed}/{p.num_requests}", f"{p.request_throughput:.2f}",
             f"{p.output_throughput:.1f}", _ms(p.ttft_ms, "p50"), _ms(p.ttft_ms, "p90"), _ms(p.ttft_ms, "p99"),
             _ms(p.itl_ms, "p50"), _ms(p.itl_ms, "p90"), _ms(p.itl_ms, "p99"), _ms(p.tpot_ms, "p50"),
             _share(p.server_counters.get("speculative_chunk_share"))]
            for p in passes]
    return header, rows


def print_report(passes: Sequence[PassSummary], offline: dict | None, checks: Sequence[dict]) -> None:
    """A rich table of every pass (plain text when rich is not installed), then the offline figures and checks."""
    header, rows = table_rows(passes)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        for line in [header] + rows:
            print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    else:
        table = Table(title="jspec bench-serve (latencies in ms; ITL per token)")
        for h in header:
            table.add_column(h, justify="left" if h in ("rate", "server") else "right", no_wrap=True)
        for p, r in zip(passes, rows):
            table.add_row(*r, style="red" if p.failed else None)
        Console(width=None if sys.stdout.isatty() else 132).print(table)
    if offline is not None:
        for key, figure in offline.items():
            if isinstance(figure, dict):
                print(f"offline {key}: {figure['tokens_per_second']:.1f} tokens/s (median of "
                      f"{len(figure.get('tokens_per_second_runs', [0]))}; acceptance {figure['acceptance_length']:.2f})")
        if "speedup_batch1" in offline:
            print(f"offline speedup at batch 1: {offline['speedup_batch1']:.2f}x (median over rounds)")
    for check in checks:
        print(f"{'HOLDS' if check['holds'] else 'FAILS'}  {check['name']}: {check['measured']} "
              f"(target {check['target']})")


def write_chart(passes: Sequence[PassSummary], offline: dict | None, batch_size: int, path: str) -> bool:
    """Output tokens/s, TTFT and ITL (p50 solid, p99 dashed) by rate, one colour per server (its ``-direct`` rows
    dash-dotted, p50 only); the offline ``generate`` figures: batch 1 as crosses at "seq", batch ``batch_size``
    as dotted lines. False when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = list(dict.fromkeys(rate_label(p.rate) for p in passes))
    servers = list(dict.fromkeys(p.server for p in passes))
    bases = list(dict.fromkeys(s.removesuffix("-direct") for s in servers))
    color = {s: f"C{bases.index(s.removesuffix('-direct'))}" for s in servers}
    x = np.arange(len(labels))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))

    def series(server: str, figure) -> list[float]:
        mine = {rate_label(p.rate): p for p in passes if p.server == server}
        values = [figure(mine[label]) if label in mine else None for label in labels]
        return [np.nan if v is None else v for v in values]

    for server in servers:
        direct = server.endswith("-direct")
        line = {"color": color[server], "alpha": 0.55 if direct else 1.0, "lw": 1.0 if direct else 1.8}
        axes[0].plot(x, series(server, lambda p: p.output_throughput), "^-." if direct else "o-", label=server,
                     **line)
        for ax, field in ((axes[1], "ttft_ms"), (axes[2], "itl_ms")):
            for q, style in (("p50", "^-." if direct else "o-"), ("p99", None if direct else "s--")):
                if style is not None:
                    ax.plot(x, series(server, lambda p, f=field, q=q: getattr(p, f)[q]), style,
                            label=f"{server} {q}", **{**line, "alpha": line["alpha"] * (1.0 if q == "p50" else 0.6)})
    if offline is not None:
        for server in ("spec", "plain"):
            if server not in color:
                continue
            key = f"{server}_batch{batch_size}"
            if key in offline:
                axes[0].axhline(offline[key]["tokens_per_second"], color=color[server], ls=":",
                                label=f"offline {server} generate, batch {batch_size}")
            if f"{server}_batch1" in offline and "seq" in labels:
                axes[0].plot([labels.index("seq")], [offline[f"{server}_batch1"]["tokens_per_second"]], "x",
                             color=color[server], ms=9, mew=2, label=f"offline {server} generate, batch 1")
    titles = ("output tokens/s (at a rate r: at most r x tokens per request)", "time to first token (ms)",
              "inter-token latency per token (ms)")
    for ax, title in zip(axes, titles):
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s; seq: one at a time, inf: all at once)")
        ax.set_title(title, fontsize=10)
        values = np.concatenate([np.asarray(line.get_ydata(), np.float64) for line in ax.get_lines()])
        finite = values[np.isfinite(values)]
        ax.set_ylim(0, 1.6 * (finite.max() if finite.size else 1.0))  # the legend's room above the data
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run_rounds(targets: dict[str, Target], prompts: Sequence, rates: Sequence[float | str],
               args: argparse.Namespace, reference: OfflineReference | None, report: dict) -> tuple:
    """``args.repeats`` rounds of every pass on every target, the offline reference timed in each round (batch 1
    first, batch max_batch_size just before the saturated passes) -> (requests, seconds and counter changes per
    (server, rate), pooled over rounds; offline figures per round; checks per round). Each pass's requests go to
    ``report["requests"]`` (with --json-requests)."""
    results: dict[tuple, list[RequestResult]] = {}
    seconds: dict[tuple, float] = {}
    deltas: dict[tuple, dict[str, float]] = {}
    offline_rounds: list[dict] = []
    round_checks = []
    for target in targets.values():  # the first request of a server pays for what warm-up left (HTTP, threads)
        target.run(prompts[:1], 4, SEQUENTIAL, args.seed)
    for round_index in range(args.repeats):
        offline_round: dict[str, dict] = {} if reference is None else reference.time(1)
        round_passes = []
        for n, rate in enumerate(rates):
            if reference is not None and rate == math.inf:  # timed beside the saturated passes
                offline_round.update(reference.time(args.max_batch_size))
            for server, target in targets.items():
                before = target.counters()
                got, duration = target.run(prompts, args.max_tokens, rate, args.seed + 1000 * n)
                key = (server, rate)
                delta = counter_delta(before, target.counters())
                results.setdefault(key, []).extend(got)
                seconds[key] = seconds.get(key, 0.0) + duration
                deltas[key] = {k: deltas.get(key, {}).get(k, 0.0) + v for k, v in delta.items()}
                summary = summarize_pass(server, rate, got, duration)
                round_passes.append(summary)
                if args.json_requests:
                    report["requests"].append({"server": server, "rate": rate_label(rate), "round": round_index,
                                               "duration_s": duration, "results": [request_record(r) for r in got]})
                print(f"[bench-serve] round {round_index + 1}/{args.repeats} {server} rate {rate_label(rate)}: "
                      f"{summary.completed}/{summary.num_requests} ok, {summary.output_throughput:.1f} tokens/s, "
                      f"TTFT p50 {_ms(summary.ttft_ms, 'p50')} ms, ITL p50 {_ms(summary.itl_ms, 'p50')} ms",
                      flush=True)
        if reference is not None and f"spec_batch{args.max_batch_size}" not in offline_round:
            offline_round.update(reference.time(args.max_batch_size))
        offline_rounds.append(offline_round)
        round_checks.append(criteria(round_passes, offline_round or None, args.max_batch_size))
    return results, seconds, deltas, offline_rounds, round_checks

# --- command line -----------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jspec bench-serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_argument_group("servers")
    target.add_argument("--base-url", default=None,
                        help="benchmark a server already running there (one column, no offline reference); by "
                             "default two servers (spec, plain) are launched in this process")
    target.add_argument("--model-name", default=None,
                        help="the 'model' field sent (default: the first id of GET /v1/models)")
    target.add_argument("--model", default=None, help="converted target directory (default: the bundled code model)")
    target.add_argument("--drafter", default=None,
                        help="the speculative server's drafter (default: what `jspec serve` runs on this backend, "
                             "jspec.tools.bundled.default_method: 'ngram' chain of 9 on a CPU)")
    target.add_argument("--max-batch-size", type=int, default=8, help="slots per server (and the offline batch)")
    target.add_argument("--max-seq-len", type=int, default=1024, help="prompt + new tokens per request")
    target.add_argument("--steps-per-chunk", type=int, default=4, help="the slot engine's steps per chunk")
    target.add_argument("--no-adapt", action="store_true", help="the spec server never falls back to plain steps")
    load = parser.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=32, help="the first N HumanEval prompts, per pass")
    load.add_argument("--max-tokens", type=int, default=128, help="new tokens per request at most")
    load.add_argument("--request-rates", default="0.5,1,2,inf",
                      help="Poisson arrival rates in requests/s, comma-separated; inf: all at once")
    load.add_argument("--no-sequential", action="store_true", help="skip the pass of one request after another")
    load.add_argument("--repeats", type=int, default=1,
                      help="rounds of every pass (and of the offline reference beside them); the table pools the "
                           "rounds' requests, each check takes the median of its per-round ratios")
    load.add_argument("--seed", type=int, default=0, help="arrival times; request i gets seed + i")
    load.add_argument("--ignore-eos", action="store_true",
                      help="send ignore_eos (vLLM's extension; jspec serve has none and stops at EOS)")
    load.add_argument("--no-token-ids", action="store_true",
                      help="do not send return_token_ids (ITL then shares tokens among chunks by text length)")
    load.add_argument("--no-offline", action="store_true", help="skip the offline generate reference")
    load.add_argument("--direct", action="store_true",
                      help="also run every pass straight against each launched server's slot engine (no HTTP): "
                           "rows spec-direct, plain-direct")
    out = parser.add_argument_group("output")
    out.add_argument("--json", default=None, help="write every figure here")
    out.add_argument("--json-requests", action="store_true",
                     help="--json also holds every request's chunk timings (hundreds of kB)")
    out.add_argument("--chart", default=None, help="write a PNG chart here (throughput, TTFT, ITL by rate)")
    return parser


def check_args(args: argparse.Namespace) -> list[float | str]:
    """Validates before anything loads -> the passes' rates (SEQUENTIAL first unless --no-sequential)."""
    for flag in ("num_prompts", "max_tokens", "max_batch_size", "steps_per_chunk", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: expected an integer >= 1")
    if args.max_seq_len <= args.max_tokens:
        raise ValueError(f"--max-seq-len {args.max_seq_len} leaves no room for a prompt beside --max-tokens "
                         f"{args.max_tokens}")
    rates = parse_rates(args.request_rates)
    return ([] if args.no_sequential else [SEQUENTIAL]) + rates


def load_prompts(num_prompts: int) -> list[str]:
    from jspec.train.corpus import human_eval_prompts

    problems = human_eval_prompts()
    if num_prompts > len(problems):
        raise ValueError(f"--num-prompts {num_prompts}: HumanEval has {len(problems)} prompts")
    return [p["prompt"] for p in problems[:num_prompts]]


def fit_prompts(ids: Sequence[list[int]], max_seq_len: int, max_tokens: int) -> tuple[list[list[int]], int]:
    """Keeps each prompt's last max_seq_len - max_tokens tokens -> (prompts, how many were cut)."""
    room = max_seq_len - max_tokens
    return [list(p[-room:]) for p in ids], sum(len(p) > room for p in ids)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    rates = check_args(args)
    texts = load_prompts(args.num_prompts)
    report: dict[str, Any] = {"environment": environment(), "args": vars(args), "passes": [], "requests": [],
                              "cost_tables": {}}
    if args.base_url is not None:
        model_name = args.model_name or served_model(args.base_url)
        target = http_target(args.base_url, model_name, ignore_eos=args.ignore_eos, token_ids=not args.no_token_ids)
        prompts: list = texts
        reference = None
        servers = contextlib.nullcontext({"server": target})
    else:
        spec_engine, plain_engine, config = load_engines(args)
        report["servers"] = config
        prompts, cut = fit_prompts(spec_engine.encode(texts), args.max_seq_len, args.max_tokens)
        report["prompts_cut"] = cut
        reference = None if args.no_offline else OfflineReference({"spec": spec_engine, "plain": plain_engine},
                                                                   prompts, args.max_tokens, args.max_batch_size)
        servers = launch_servers({"spec": spec_engine, "plain": plain_engine}, args, costs=report["cost_tables"])
    with servers as targets:
        results, seconds, deltas, offline_rounds, round_checks = run_rounds(targets, prompts, rates, args,
                                                                            reference, report)
    passes = []
    for (server, rate), got in results.items():  # every round's requests pooled
        summary = summarize_pass(server, rate, got, seconds[(server, rate)])
        summary.server_counters = counter_figures(deltas[(server, rate)])
        passes.append(summary)
        report["passes"].append({**dataclasses.asdict(summary), "rate": rate_label(rate)})
    offline = median_offline(offline_rounds) if reference is not None else None
    report["offline"], report["offline_rounds"] = offline, offline_rounds
    checks = combine_checks(round_checks)
    report["criteria"], report["criteria_rounds"] = checks, round_checks
    print_report(passes, offline, checks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=None if args.json_requests else 1, default=_json_default)
        print(f"[bench-serve] wrote {args.json}")
    if args.chart:
        if write_chart(passes, offline, args.max_batch_size, args.chart):
            print(f"[bench-serve] wrote {args.chart}")
        else:
            print("[bench-serve] no chart: pip install matplotlib")
    return 1 if any(p.failed for p in passes) else 0


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


if __name__ == "__main__":
    sys.exit(main())
