"""The HTTP layer: a FastAPI app that translates OpenAI's completions and chat completions into slot-engine
requests and their tokens back into OpenAI's responses (JSON, or server-sent events when ``stream`` is true).

    POST /v1/completions        POST /v1/chat/completions     GET /v1/models
    GET  /health (200 once warm, 503 before)                  GET /metrics (Prometheus)
    and what routers and fleet tools read (``jspec.serve.fleet_routes``: /health_generate, /get_server_info,
    /get_model_info, /get_load, /flush_cache)

Threads: a request's sink runs on the scheduler thread and hands (tokens, finish_reason) to the event loop with
``loop.call_soon_threadsafe``; everything else runs on the loop. A client that goes away (a closed stream, or a
dropped connection while a non-streamed answer is pending) cancels its request, which frees its slot within two
chunks (one with ``--no-async-scheduling``). Errors are OpenAI's shape (:class:`jspec.serve.protocol.APIError`): 400 for what the client sent, 503 with
Retry-After when the queue is full or the server is shutting down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

import numpy as np
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from jspec.detokenize import TextStream
from jspec.logprobs import SequenceLogprobs
from jspec.serve import tool_parsers
from jspec.serve.tool_call_stream import ToolCallStream
from jspec.serve.fleet_routes import add_fleet_routes
from jspec.serve.logprobs import chat_logprobs, completion_logprobs, with_prompt
from jspec.serve.protocol import APIError, GenerationParams, ModelInfo, choice_params, parse_chat, parse_completion
from jspec.serve.requests import NotAccepting, QueueFull, Request
from jspec.serve.slots import SlotEngine
from jspec.serve.stop_strings import StopMatcher

logger = logging.getLogger("jspec.serve")

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DISCONNECT_POLL_SECONDS = 0.25  # how often a pending non-streamed answer checks that its client is still there
RETRY_AFTER_SECONDS = 1


def create_app(slots: SlotEngine, served_model_name: str, tool_call_parser: str | None = None,
               model_path: str | None = None) -> FastAPI:
    """The app serving ``slots`` (started, or warming up: /health says which) as ``served_model_name``;
    tool_call_parser: the parser of chat replies' tool calls (``jspec.serve.tool_parsers.PARSERS``; vLLM's
    ``--enable-auto-tool-choice --tool-call-parser``), None: tool_choice "auto" is refused; model_path: the model
    directory (what /get_model_info reports)."""
    if tool_call_parser is not None and tool_call_parser not in tool_parsers.PARSERS:
        raise ValueError(f"tool_call_parser={tool_call_parser!r}: expected one of {tool_parsers.PARSERS}")
    engine = slots.engine
    model = ModelInfo(name=served_model_name, tokenizer=engine.tokenizer,
                      chat_template=getattr(engine, "chat_template", None), max_seq_len=slots.max_seq_len,
                      vocab_size=engine.config.vocab_size, max_logprobs=slots.setup.logprobs,
                      tool_call_parser=tool_call_parser)
    app = FastAPI(title="jspec", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(_: HTTPRequest, error: APIError) -> JSONResponse:
        headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(_: HTTPRequest, error: HTTPException) -> JSONResponse:  # 404, 405 in OpenAI's shape
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(str(error.detail), status=error.status_code, type=kind).body(),
                            status_code=error.status_code)

    @app.get("/health")
    async def health() -> Response:
        if not slots.ready:
            raise APIError("warming up", status=503, type="service_unavailable", retry_after=RETRY_AFTER_SECONDS)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(slots.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": created,
                                            "owned_by": "jspec", "max_model_len": model.max_seq_len}]}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest) -> Response:
        params = parse_completion(await _json(http), model)
        return await _answer(http, slots, model, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest) -> Response:
        params = parse_chat(await _json(http), model)
        return await _answer(http, slots, model, params, chat=True)

    add_fleet_routes(app, slots, served_model_name, model_path)
    return app


async def _json(http: HTTPRequest) -> Any:
    body = await http.body()
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise APIError(f"the request body is not valid JSON: {error}") from None


class _Generation:
    """One submitted request as seen from the event loop: its token ids (and their log-probabilities, when asked
    for), and its text cut at stop strings."""

    def __init__(self, slots: SlotEngine, model: ModelInfo, params: GenerationParams):
        loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[tuple[list[int], str | None, SequenceLogprobs | None]] = asyncio.Queue()
        self.token_ids: list[int] = []
        self.logprobs: list[SequenceLogprobs] = []
        self.text = TextStream(model.tokenizer) if model.tokenizer is not None else None
        self.stops = StopMatcher(params.stop)
        self.finish_reason: str | None = None

        def sink(tokens, reason, logprobs=None):
            loop.call_soon_threadsafe(self.events.put_nowait, (tokens, reason, logprobs))

        self.request = Request(
            list(params.prompt_ids), params.max_tokens, sink, temperature=params.temperature, top_k=params.top_k,
            top_p=params.top_p, seed=params.seed, stop_token_ids=params.stop_token_ids, logprobs=params.logprobs,
            prompt_logprobs=params.echo and params.logprobs is not None, processors=dict(params.processors),
            structured_outputs=params.structured_outputs, num_speculative_tokens=params.num_speculative_tokens)
        try:
            slots.submit(self.request)
        except ValueError as error:
            raise APIError(str(error)) from None
        except QueueFull as error:
            raise APIError(f"the server is busy: {error}; retry later", status=503, type="service_unavailable",
                           retry_after=RETRY_AFTER_SECONDS) from None
        except NotAccepting as error:
            raise APIError(str(error), status=503, type="service_unavailable",
                           retry_after=RETRY_AFTER_SECONDS) from None

    async def pieces(self) -> AsyncIterator[tuple[str, list[int], SequenceLogprobs | None]]:
        """Yields (new text, new token ids, their log-probabilities or None) until the request ends; then
        ``finish_reason`` is set. A stop string ends it at once (the text is cut before it, the request cancelled
        with reason "stop")."""
        while self.finish_reason is None:
            tokens, reason, logprobs = await self.events.get()
            self.token_ids += tokens
            if logprobs is not None:
                self.logprobs.append(logprobs)
            final = reason is not None
            if self.text is not None:
                text, stopped = self.stops.feed(self.text.piece(self.token_ids, final=final), final=final)
            else:
                text, stopped = "", False
            if stopped:
                self.request.cancel("stop")
                reason = "stop"
            self.finish_reason = reason
            if text or tokens or reason is not None:
                yield text, tokens, logprobs

    def cancel_unless_finished(self) -> None:
        if self.finish_reason is None:
            self.request.cancel()


async def _answer(http: HTTPRequest, slots: SlotEngine, model: ModelInfo, params: GenerationParams,
                  chat: bool) -> Response:
    """Submits the request's ``best_of`` choices (``choice_params``) and answers with ``n`` of them."""
    generations: list[_Generation] = []
    try:
        for child in choice_params(params):
            generations.append(_Generation(slots, model, child))
    except APIError:
        for generation in generations:
            generation.cancel_unless_finished()
        raise
    shape = _Shape(model, chat, params, len(params.prompt_ids))
    if params.stream:
        return StreamingResponse(_stream(generations, shape), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    watcher = asyncio.ensure_future(_cancel_on_disconnect(http, generations))

    async def whole_text(generation: _Generation) -> str:
        return shape.echoed_text + "".join([piece async for piece, _, _ in generation.pieces()])

    try:
        texts = await asyncio.gather(*(whole_text(g) for g in generations))
    finally:
        watcher.cancel()
        for generation in generations:
            generation.cancel_unless_finished()
    chosen = best_choices(generations, params.n)
    return JSONResponse(shape.whole([texts[i] for i in chosen], [generations[i] for i in chosen],
                                    completion_tokens=sum(len(g.token_ids) for g in generations)))


def best_choices(generations: list["_Generation"], n: int) -> list[int]:
    """The n choices to answer with: all of them in order when there are n, else (``best_of``) the n with the
    highest cumulative log-probability of their tokens, best first (vLLM's and OpenAI's rule)."""
    if len(generations) == n:
        return list(range(n))
    score = [sum(float(part.token.sum()) for part in g.logprobs) for g in generations]
    return sorted(range(len(generations)), key=lambda i: -score[i])[:n]


async def _cancel_on_disconnect(http: HTTPRequest, generations: list[_Generation]) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_SECONDS)
    for generation in generations:
        generation.cancel_unless_finished()


async def _stream(generations: list[_Generation], shape: "_Shape") -> AsyncIterator[str]:
    """Server-sent events, the choices' pieces interleaved as they come (each chunk names its choice's index); a
    client that leaves cancels this generator (Starlette), and so the requests."""
    events: asyncio.Queue[tuple[int, tuple | None]] = asyncio.Queue()

    async def pump(index: int, generation: _Generation) -> None:
        async for piece in generation.pieces():
            await events.put((index, piece))
        await events.put((index, None))

    pumps = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        if shape.chat:
            for index in range(len(generations)):
                yield _event(shape.chunk({"role": "assistant", "content": ""}, None, index=index))
        echo = [shape.params.echo] * len(generations)
        calls = [ToolCallStream(shape.params.tool_call_parser) for _ in generations]
        running = len(generations)
        while running:
            index, piece = await events.get()
            generation = generations[index]
            if piece is None:
                rest, deltas, called = calls[index].finish()
                if rest:
                    yield _event(shape.chunk(rest, None, index=index))
                if deltas:
                    yield _event(shape.chunk({"tool_calls": deltas}, None, index=index))
                yield _event(shape.chunk("", "tool_calls" if called else generation.finish_reason, index=index))
                running -= 1
                continue
            text, tokens, logprobs = piece
            text, deltas = calls[index].feed(text)
            if echo[index]:  # the prompt first (scored before the first tokens arrive)
                yield _event(shape.echo_chunk(generation.request.scored_prompt, index))
                echo[index] = False
            # tokens whose text is held back: no event, unless their ids or log-probabilities are asked for
            if text or (tokens and (shape.params.return_token_ids or logprobs is not None)):
                yield _event(shape.chunk(text, None, tokens, logprobs, index=index))
            if deltas:
                yield _event(shape.chunk({"tool_calls": deltas}, None, index=index))
        if shape.params.include_usage:
            yield _event(shape.usage_chunk(sum(len(g.token_ids) for g in generations), generations))
        yield "data: [DONE]\n\n"
    finally:
        for task in pumps:
            task.cancel()
        for generation in generations:
            generation.cancel_unless_finished()


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Shape:
    """OpenAI's response objects for one request (text_completion or chat.completion, whole or in chunks)."""

    def __init__(self, model: ModelInfo, chat: bool, params: GenerationParams, prompt_tokens: int):
        self.chat, self.params, self.prompt_tokens = chat, params, prompt_tokens
        self.tokenizer = model.tokenizer
        self.echoed_text = ""
        if params.echo:
            self.echoed_text = params.prompt_text if params.prompt_text is not None else (
                model.tokenizer.decode(params.prompt_ids) if model.tokenizer is not None else "")
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.head = {"id": self.id, "object": "chat.completion" if chat else "text_completion",
                     "created": int(time.time()), "model": model.name}

    def usage(self, completion_tokens: int, generations: list[_Generation] = ()) -> dict[str, Any]:
        """OpenAI's usage; with speculation, SGLang's per-request acceptance too: the verify steps the request's
        choices took (``spec_verify_ct``), the drafts they accepted, and completion tokens per verify step
        (``spec_accept_length``; its first token, the prefill's, counted as SGLang counts it)."""
        usage: dict[str, Any] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                                 "total_tokens": self.prompt_tokens + completion_tokens}
        requests = [g.request for g in generations if g.request is not None]
        steps = sum(request.spec_steps for request in requests)
        if steps:
            usage.update(spec_verify_ct=steps, spec_accepted_tokens=sum(r.spec_accepted for r in requests),
                         spec_accept_length=completion_tokens / steps)
        return usage

    def whole(self, texts: list[str], generations: list[_Generation], completion_tokens: int) -> dict[str, Any]:
        """The whole answer: one choice per text (index in order); usage counts every choice generated (best_of's
        too, as OpenAI bills them)."""
        choices = []
        for index, (text, generation) in enumerate(zip(texts, generations)):
            choice: dict[str, Any] = {"index": index}
            finish_reason = generation.finish_reason
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
                if self.params.tool_call_parser is not None:
                    content, calls = tool_parsers.parse(self.params.tool_call_parser, text)
                    if calls:
                        choice["message"] = {"role": "assistant", "content": content,
                                             "tool_calls": [call.as_openai() for call in calls]}
                        finish_reason = "tool_calls"
            else:
                choice["text"] = text
            logprobs = None
            if self.params.logprobs is not None:
                logprobs = self.logprobs(generation.token_ids, generation.logprobs)
                if self.params.echo:
                    logprobs = with_prompt(self.tokenizer, self.params.prompt_ids, generation.request.scored_prompt,
                                           logprobs)
            choice.update(logprobs=logprobs, finish_reason=finish_reason)
            if self.params.return_token_ids:
                choice["token_ids"] = generation.token_ids
            choices.append(choice)
        return {**self.head, "choices": choices, "usage": self.usage(completion_tokens, generations)}

    def logprobs(self, token_ids: list[int], parts: list[SequenceLogprobs]) -> dict[str, Any]:
        """OpenAI's ``logprobs`` object of ``token_ids`` from their log-probabilities (in pieces, in order)."""
        if not parts:
            return {"content": []} if self.chat else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                     "text_offset": []}
        values = SequenceLogprobs(*(np.concatenate(x) for x in zip(*parts)))
        return (chat_logprobs if self.chat else completion_logprobs)(self.tokenizer, token_ids, values)

    def echo_chunk(self, scored: SequenceLogprobs | None, index: int = 0) -> dict[str, Any]:
        """The first chunk of an echoed completion: the prompt's text (and its tokens' log-probabilities)."""
        out = self.chunk(self.echoed_text, None, index=index)
        if self.params.logprobs is not None:
            out["choices"][0]["logprobs"] = with_prompt(self.tokenizer, self.params.prompt_ids, scored, None)
        return out

    def chunk(self, delta: str | dict, finish_reason: str | None, tokens: list[int] | None = None,
              logprobs: SequenceLogprobs | None = None, index: int = 0) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
        else:
            choice["text"] = delta
        shaped = None if logprobs is None else self.logprobs(tokens or [], [logprobs])
        choice.update(logprobs=shaped, finish_reason=finish_reason)
        if self.params.return_token_ids:
            choice["token_ids"] = tokens or []
        out = {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "choices": [choice]}
        if self.params.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, completion_tokens: int, generations: list[_Generation] = ()) -> dict[str, Any]:
        return {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion", "choices": [],
                "usage": self.usage(completion_tokens, generations)}
