"""The figures of a pass: one streamed request's timings (:class:`RequestResult`), its per-token latencies, and
one server at one rate summarized (:class:`PassSummary`, percentiles in milliseconds)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


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

