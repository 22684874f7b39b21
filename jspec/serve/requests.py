"""A request's life on the host: what a client submits (:class:`Request`), how it waits (:class:`Pending`: new, or
preempted with the tokens it already has), how it runs in a row (:class:`Running`), the chunk in flight
(:class:`Flight`), and how tokens reach its sink (:func:`deliver`)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import numpy as np

from jspec.config import SamplingParams
from jspec.logprobs import SequenceLogprobs
from jspec.serve import paged
from jspec.structured_outputs import StructuredOutputsParams

logger = logging.getLogger("jspec.serve")

Sink = Callable[..., None]  # (new token ids, finish_reason or None while running[, their SequenceLogprobs where the
                           # request asked for logprobs])


class QueueFull(Exception):
    """The waiting queue holds max_queue requests (HTTP 503)."""


class NotAccepting(Exception):
    """The server is shutting down (or not warm yet) and takes no new requests (HTTP 503)."""


@dataclasses.dataclass
class Request:
    """A request. prompt_ids: its tokens; max_tokens: new tokens at most; temperature, top_k, top_p, seed,
    stop_token_ids: as ``jspec.SamplingParams`` has them (:meth:`sampling_params`), but seed None draws one when
    the request is submitted, and stop_token_ids come besides the model's EOS; sink: called from the scheduler
    thread with the tokens the request gained and, last, its finish reason ("stop", "length" or "abort"); logprobs:
    None, or K (at most the server's ``max_logprobs``): the sink gets a third argument, the new tokens'
    ``jspec.logprobs.SequenceLogprobs`` with the K most likely tokens at each position; prompt_logprobs: with
    logprobs, also score the prompt (OpenAI's ``echo``): ``scored_prompt`` holds its tokens' 1 .. P - 1 before the
    sink is first called. processors: the logits processors' ``jspec.SamplingParams`` fields (presence_penalty,
    ..., ignore_eos) that the request sets. structured_outputs: what its output must match (a JSON schema, regex,
    choice or grammar; ``jspec.structured_outputs``), or None."""

    prompt_ids: list[int]
    max_tokens: int
    sink: Sink
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    processors: dict[str, Any] = dataclasses.field(default_factory=dict)
    logprobs: int | None = None
    prompt_logprobs: bool = False
    scored_prompt: SequenceLogprobs | None = None
    structured_outputs: StructuredOutputsParams | None = None
    num_speculative_tokens: int | None = None  # at most this many drafts accepted a step (SamplingParams')
    spec_steps: int = 0        # its verify steps so far (speculative and the adapter's plain ones)
    spec_accepted: int = 0     # drafts accepted in them
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: str | None = None  # the finish reason asked for by cancel()

    def cancel(self, reason: str = "abort") -> None:
        """Ends the request at a chunk boundary: its row and pages are freed when the next chunk dispatched is read
        back (within two chunks; one without async scheduling)."""
        if self.cancelled is None:
            self.cancelled = reason

    def sampling_params(self) -> SamplingParams:
        """The request's parameters as the offline engine takes them (and checks them: ValueError); seed None
        stands as 0."""
        return SamplingParams(max_new_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=0 if self.seed is None else self.seed,
                              stop_token_ids=tuple(self.stop_token_ids),
                              num_speculative_tokens=self.num_speculative_tokens, **self.processors)


@dataclasses.dataclass
class Pending:
    """A request in the queue: new, or preempted with ``generated`` tokens already handed to its sink (they
    become part of the context it is prefilled with again)."""

    request: Request
    generated: list[int] = dataclasses.field(default_factory=list)
    first_token_at: float | None = None
    matcher: Any = None  # structured outputs: the request's grammar (an llguidance matcher) after ``generated``

    @property
    def context(self) -> list[int]:
        return list(self.request.prompt_ids) + self.generated

    @property
    def budget(self) -> int:
        return self.request.max_tokens - len(self.generated)


@dataclasses.dataclass
class Flight:
    """A chunk dispatched and not yet read back: its rows (in program order), the requests that held them at
    dispatch, its readout (device arrays), and what the adapter and metrics need when it lands."""

    rows: list[int]
    owners: list["Running"]
    out: paged.Readout
    program: str
    bucket: int          # the occupancy bucket it ran at
    seq_len: int         # the context bucket
    sampled: bool
    dispatched: float    # time.perf_counter() at dispatch


@dataclasses.dataclass
class Running:
    pending: Pending
    pages: list[int]
    stops: frozenset[int]
    order: int              # admission order: the newest is preempted first
    context_len: int        # tokens prefilled (prompt, and after a preemption the tokens it had)
    cached: int = 0         # of those, tokens whose K/V a prefix-cache hit brought (whole pages)
    registered: int = 0     # pages whose tokens the block manager keys (``BlockManager.register``)
    generated: int = 0      # tokens committed since the prefill (the readout's num_generated)
    emitted: int = 0        # of those, handed to the sink
    steps_seen: int = 0     # verify steps already counted
    hist_seen: np.ndarray | int = 0  # accepted_hist already counted
    acceptance: float | None = None  # its own running tokens per verify step (None: none measured yet)
    measured_steps: int = 0          # the verify steps that average is over
    prefilled: int | None = None     # a prompt prefilled in pieces: tokens whose K/V are in its pages so far
                                     # (None: prefilled whole, or its last piece done; it steps in chunks)
    window_pages: list[int] | None = None  # its page table in the window group (a binding sliding window's;
                                           # jspec.serve.kv_cache_coordinator), 0 where it holds none; else None

    @property
    def request(self) -> Request:
        return self.pending.request

    @property
    def need(self) -> int:
        """Token slots the request needs in all: prompt + max_tokens."""
        return len(self.request.prompt_ids) + self.request.max_tokens

    @property
    def seq_len(self) -> int:
        return self.context_len + self.generated


def uses_api_features(request: Request) -> bool:
    """Whether a request asks for log-probabilities or sets a logits processor's field (its rows then run the
    step programs that record and apply them)."""
    return request.logprobs is not None or bool(request.processors)


def deliver(request: Request, tokens: list[int], reason: str | None, *logprobs: SequenceLogprobs) -> None:
    """A sink that raises (a client gone mid-write) must not stop the scheduler: the request is cancelled."""
    try:
        request.sink(tokens, reason, *logprobs)
    except Exception:  # the client's problem, never the loop's
        logger.warning("a request's sink failed; cancelling it", exc_info=True)
        request.cancel()
