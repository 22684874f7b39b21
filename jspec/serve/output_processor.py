"""The output processor: what a landed readout means for each request's client (vLLM v1's output processor, on the
scheduler's thread). The scheduler updates its own state from a readout (``SlotEngine._update_from_output``: tokens
committed, rows freed, grammars advanced) and hands over one :class:`RequestOutput` per request that gained tokens
or finished; this delivers each to the request's sink (the new tokens, their log-probabilities cut to the K it asked
for, the finish reason) without letting a failing sink stop the scheduler, and keeps the per-request metrics: time
to first token, tokens and their inter-token time, finished requests by reason. Text (detokenizing, stop strings)
is the sink's business (``jspec.serve.app``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jspec.logprobs import SequenceLogprobs
from jspec.serve.metrics import ServeMetrics
from jspec.serve.requests import Pending, deliver


@dataclasses.dataclass
class RequestOutput:
    """One request's part of a readout. new: the token ids it gained; reason: its finish reason ("stop", "length",
    "abort"), None while it runs; logprobs: the readout row's (token f32[W], top_ids i32[W, K], top f32[W, K]) from
    its length before the program on (W >= len(new); None where the server records none)."""

    pending: Pending
    new: list[int]
    reason: str | None
    logprobs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None


class OutputProcessor:
    """Delivers :class:`RequestOutput` s to their requests' sinks and counts them in ``metrics``."""

    def __init__(self, metrics: ServeMetrics):
        self.metrics = metrics

    def process(self, outputs: list[RequestOutput], *, now: float, chunk_seconds: float) -> None:
        """now: time.perf_counter() when the readout landed; chunk_seconds: the chunk's time (0 for a prefill),
        over which its tokens came (the inter-token time)."""
        for output in outputs:
            pending, new = output.pending, output.new
            request = pending.request
            if new:
                waited = None
                if pending.first_token_at is None:
                    pending.first_token_at = now
                    waited = now - request.arrival
                self.metrics.observe_tokens(len(new), waited=waited, chunk_seconds=chunk_seconds)
            if output.reason is not None:
                self.metrics.requests.labels(output.reason).inc()
                self.metrics.e2e_request_latency.observe(now - request.arrival)
            extra = ()
            if request.logprobs is not None and output.logprobs is not None:
                token, top_ids, top = (x[:len(new)] for x in output.logprobs)
                extra = (SequenceLogprobs(token, top_ids[:, :request.logprobs], top[:, :request.logprobs]),)
            deliver(request, new, output.reason, *extra)
