"""Sending one pass of requests: the streaming OpenAI /v1/completions client (SSE, one chunk timed at a time) at
Poisson arrival times or one after another, and the same pass submitted straight to a slot engine (no HTTP)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

from jspec.tools.bench_serve.figures import RequestResult
from jspec.tools.bench_serve.schedule import SEQUENTIAL, poisson_offsets


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



def run_direct_pass(slots, prompts: Sequence[list[int]], max_tokens: int, rate: float | str,
                    seed: int) -> tuple[list[RequestResult], float]:
    """As :func:`run_pass`, but submitted straight to the slot engine (no HTTP, no detokenizing): what the
    scheduler alone costs. A chunk is a sink call; its tokens are exact."""
    from jspec.serve.requests import Request

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

