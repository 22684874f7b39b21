"""OpenAI request bodies -> validated generation parameters, or an :class:`APIError` that names the bad field.

Only the HTTP shapes live here, and what jspec checks the same way everywhere (a seed, prompt ids against the
vocabulary) is checked by ``jspec.config``'s own functions; the slot engine checks the rest (lengths against the
context, stop ids) and its ValueError is answered the same way (HTTP 400). Fields follow OpenAI's API reference,
plus vLLM's extensions ``top_k`` (-1 or 0 = off), ``stop_token_ids`` and ``return_token_ids`` (the generated token
ids in each choice). Log-probabilities as OpenAI asks for them: completions ``logprobs: K`` (the K most likely
tokens beside the chosen one), chat ``logprobs: true`` with ``top_logprobs: K``; at most the server's
``--max-logprobs``. Completions' ``echo`` returns the prompt before the completion (with ``logprobs``, the prompt
tokens' too). ``n`` choices (``best_of`` candidates, the n most likely kept) run as requests of their own, choice i
with seed ``choice_seed(seed, i)`` (:func:`choice_params`). The logits processors: OpenAI's ``presence_penalty``,
``frequency_penalty`` and ``logit_bias`` ({"token id": bias}), vLLM's ``repetition_penalty``, ``min_tokens``,
``ignore_eos`` and ``bad_words_ids``-style ``banned_token_ids``. Structured outputs: OpenAI's ``response_format``
(``json_object``, ``json_schema``) and vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``; its older ``guided_*`` names too). Chat ``tools`` are rendered by the chat template and, with
``tool_choice`` "auto" on a server started with ``--enable-auto-tool-choice --tool-call-parser NAME``, the reply's
calls parsed into ``tool_calls`` (``jspec.serve.tool_parsers``); "required" or a named function constrain the reply
to a JSON schema of the call(s), as vLLM does. Features this server does not have (``suffix``, ``functions``) are
refused by name rather than ignored; fields that mean nothing here (``user``, ``metadata``, ...) are ignored.

Chat prompts use the checkpoint's chat template; a model without one gets a plain fallback, one line per message
and an open assistant line::

    system: You write Python.
    user: Sort a list.
    assistant:
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable

import numpy as np

from jspec.config import check_seed, check_token_ids
from jspec.serve import tool_parsers
from jspec.structured_outputs import StructuredOutputsParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 16  # n and best_of at most (each choice is a request of its own)


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What parsing needs to know of the served model."""

    name: str
    tokenizer: Any          # tokenizers.Tokenizer, or None (token-id prompts only)
    chat_template: Any      # jspec.chat.ChatTemplate, or None (the plain fallback)
    max_seq_len: int
    vocab_size: int
    max_logprobs: int | None = None  # the most top log-probabilities a request may ask for (None: no logprobs)
    tool_call_parser: str | None = None  # --tool-call-parser with --enable-auto-tool-choice (None: no tool calls)


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    """One validated request: what the slot engine runs and how the answer is shaped."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    logprobs: int | None = None  # None: no log-probabilities; K: each token's and the K most likely at its position
    echo: bool = False           # completions: the prompt's text (and log-probabilities) before the completion's
    prompt_text: str | None = None  # the prompt as the client sent it (a string), for echo
    n: int = 1                   # choices answered
    best_of: int = 1             # choices generated (>= n): the n with the highest cumulative log-probability kept
    processors: tuple[tuple[str, Any], ...] = ()  # the logits processors' fields set (jspec.SamplingParams names)
    tool_call_parser: str | None = None  # chat with tools and tool_choice "auto": the parser of the reply's calls
    structured_outputs: StructuredOutputsParams | None = None  # what the output must match (a grammar), or None
    num_speculative_tokens: int | None = None  # at most this many drafts accepted a step (0: none); None: the server's


# field -> the values that ask for nothing (anything else asks for a feature this server lacks)
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "suffix": lambda v: v is None or v == "",
    "functions": lambda v: v is None or v == [],
}


def parse_completion(body: Any, model: ModelInfo) -> GenerationParams:
    """A ``/v1/completions`` body (prompt: a string or a list of token ids; one prompt)."""
    body = _common_checks(body, model)
    if isinstance(body.get("logprobs"), bool):
        raise APIError(f"logprobs={body['logprobs']}: expected an integer >= 0 (the most likely tokens to return "
                       f"beside the chosen one) or null", param="logprobs")
    if body.get("top_logprobs") is not None:
        raise APIError("top_logprobs is a chat field: completions take logprobs=K", param="top_logprobs")
    prompt_ids = _prompt_ids(body.get("prompt"), model)
    default = max(1, min(COMPLETIONS_DEFAULT_MAX_TOKENS, model.max_seq_len - len(prompt_ids)))
    params = _params(body, prompt_ids, _int(body, "max_tokens", default, low=1), model.vocab_size)
    prompt = body.get("prompt")
    prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)) \
        else prompt
    return dataclasses.replace(params, logprobs=_logprobs("logprobs", _int(body, "logprobs", None, low=0), model),
                               echo=_bool(body, "echo", False), prompt_text=prompt if isinstance(prompt, str) else None)


def parse_chat(body: Any, model: ModelInfo) -> GenerationParams:
    """A ``/v1/chat/completions`` body; max_completion_tokens (or the older max_tokens) defaults to the rest of
    the context. With a chat template, its end-of-turn token is a stop token too."""
    body = _common_checks(body, model)
    if body.get("echo") not in (None, False):
        raise APIError(f"echo={_show(body['echo'])} is not supported for chat: it is a completions field",
                       param="echo", code="unsupported")
    messages = _messages(body.get("messages"))
    if model.tokenizer is None:
        raise APIError("chat needs the model's tokenizer.json, and this model has none", param="messages")
    tools, parser, forced = _tools(body, model)
    stop_ids: tuple[int, ...] = ()
    if model.chat_template is not None:
        try:
            prompt_ids = model.chat_template.encode(model.tokenizer, [messages], tools=tools)[0]
        except Exception as error:  # the template refused the conversation (raise_exception, a sandbox rule)
            raise APIError(f"the chat template refused the messages: {error}", param="messages") from None
        stop_ids = tuple(model.chat_template.end_of_turn_ids(model.tokenizer))
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        prompt_ids = model.tokenizer.encode(text).ids
    default = max(1, model.max_seq_len - len(prompt_ids))
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params = _params(body, prompt_ids, _int(body, name, default, low=1), model.vocab_size)
    extra = tuple(i for i in stop_ids if i not in params.stop_token_ids)
    wanted = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, low=0)
    if top is not None and top > 0 and not wanted:
        raise APIError(f"top_logprobs={top} needs logprobs=true", param="top_logprobs")
    logprobs = _logprobs("top_logprobs" if top else "logprobs", (top or 0) if wanted else None, model)
    if forced is not None and params.structured_outputs is not None:
        raise APIError("tool_choice forces a call, and its arguments' schema is the reply's constraint: give no "
                       "response_format or structured_outputs with it", param="tool_choice")
    return dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra, logprobs=logprobs,
                               tool_call_parser=parser, structured_outputs=forced or params.structured_outputs)


def _tools(body: dict[str, Any],
           model: ModelInfo) -> tuple[list[dict] | None, str | None, StructuredOutputsParams | None]:
    """(the tools to render, the parser of the reply's calls or None, the constraint of a forced call or None) of
    a chat body. tool_choice "required" or a named function: vLLM's, the reply constrained by a JSON schema of
    the call(s) (``jspec.serve.tool_parsers.forced_tool_choice``), whatever --tool-call-parser is."""
    tools = body.get("tools")
    if tools in (None, []):
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise APIError(f"tool_choice={_show(body['tool_choice'])} without tools", param="tool_choice")
        return None, None, None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise APIError(f"tools={_show(tools)}: expected a list of {{'type': 'function', 'function': {{'name', ...}}}}",
                       param="tools")
    if model.chat_template is None:
        raise APIError("tools need the model's chat template to show them to the model, and this model has none",
                       param="tools")
    choice = body.get("tool_choice", "auto")
    if choice == "none":
        return tools, None, None
    if choice != "auto":
        try:
            parser, schema = tool_parsers.forced_tool_choice(tools, choice)
        except ValueError as error:
            raise APIError(str(error), param="tool_choice") from None
        return tools, parser, StructuredOutputsParams(json=schema)
    if model.tool_call_parser is None:
        raise APIError('tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                       '--tool-call-parser', param="tool_choice")
    return tools, model.tool_call_parser, None


def _logprobs(param: str, wanted: int | None, model: ModelInfo) -> int | None:
    """``wanted`` top log-probabilities, if the server records that many."""
    if wanted is not None and (model.max_logprobs is None or wanted > model.max_logprobs):
        most = ("none: start it with --max-logprobs K" if model.max_logprobs is None
                else f"at most {model.max_logprobs} (--max-logprobs)")
        raise APIError(f"{param}={wanted}: this server returns {most} top log-probabilities per token", param=param)
    return wanted


# --- fields ------------------------------------------------------------------------------------------------------

def _common_checks(body: Any, model: ModelInfo) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(f"the request body is {_kind(body)}: expected a JSON object")
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise APIError(f"model={_show(name)}: expected a string", param="model")
    if name is not None and name != model.name:
        raise APIError(f"the model {_show(name)} does not exist: this server serves {model.name!r}", param="model",
                       code="model_not_found")
    for field, neutral in _NEUTRAL.items():
        if not neutral(body.get(field)):
            raise APIError(f"{field}={_show(body[field])} is not supported by this server", param=field,
                           code="unsupported")
    return body


def _params(body: dict[str, Any], prompt_ids: list[int], max_tokens: int, vocab_size: int) -> GenerationParams:
    top_k = _int(body, "top_k", 0, low=-1)
    top_k = 0 if top_k < 0 or top_k >= vocab_size else top_k  # -1 (vLLM) and 0 are off; k >= vocabulary is too
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise APIError(f"top_p={top_p!r}: expected a number in (0, 1] (1 = off)", param="top_p")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError(f"stream_options={_show(options)}: expected an object", param="stream_options")
    include_usage = _bool(options or {}, "include_usage", False, param="stream_options.include_usage")
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)):
        raise APIError(f"stop={_show(stop)}: expected a string or a list of strings", param="stop")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not (isinstance(stop_ids, list) and all(_is_int(t) for t in stop_ids)):
        raise APIError(f"stop_token_ids={_show(stop_ids)}: expected a list of token ids", param="stop_token_ids")
    n = _int(body, "n", 1, low=1)
    best_of = _int(body, "best_of", n, low=1)
    if n > MAX_CHOICES or best_of > MAX_CHOICES:
        raise APIError(f"n={n}, best_of={best_of}: at most {MAX_CHOICES} choices per request", param="n")
    if best_of < n:
        raise APIError(f"best_of={best_of} must be at least n={n}", param="best_of")
    if best_of > n and stream:
        raise APIError(f"best_of={best_of} > n={n} cannot be streamed (the best are known only at the end)",
                       param="best_of")
    return GenerationParams(
        processors=_processors(body, vocab_size), structured_outputs=_structured_outputs(body),
        prompt_ids=prompt_ids, max_tokens=max_tokens, temperature=_number(body, "temperature", 0.0, 0.0, 2.0),
        top_k=top_k, top_p=top_p, seed=_checked("seed", check_seed, _int(body, "seed", None)),
        stop=tuple(s for s in stop or () if s), stop_token_ids=tuple(dict.fromkeys(stop_ids or ())), stream=stream,
        include_usage=include_usage and stream, return_token_ids=_bool(body, "return_token_ids", False), n=n,
        best_of=best_of, num_speculative_tokens=_int(body, "num_speculative_tokens", None, low=0))


GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}  # vLLM's older names of structured_outputs' fields


def _structured_outputs(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """What a body's output must match: OpenAI's ``response_format`` (json_object, json_schema), vLLM's
    ``structured_outputs`` ({"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...}) or its older
    ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``; at most one of those ways."""
    given = [name for name in ("response_format", "structured_outputs", *GUIDED_FIELDS)
             if body.get(name) is not None and body.get(name) != {"type": "text"}]
    if len(given) > 1:
        raise APIError(f"{' and '.join(given)}: give one way of constraining the output", param=given[1])
    if not given:
        return None
    name = given[0]
    try:
        if name == "response_format":
            return StructuredOutputsParams.from_response_format(body[name])
        if name == "structured_outputs":
            return StructuredOutputsParams.coerce(body[name])
        return StructuredOutputsParams.coerce({GUIDED_FIELDS[name]: body[name]})
    except (ValueError, TypeError) as error:
        raise APIError(f"{name}: {error}", param=name) from None


def _processors(body: dict[str, Any], vocab_size: int) -> tuple[tuple[str, Any], ...]:
    """The logits processors a body sets, checked, as (``SamplingParams`` field, value) pairs."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, 0.0, -2.0, 2.0)
        if value:
            out[name] = value
    repetition = _number(body, "repetition_penalty", 1.0, 0.0, 100.0)
    if repetition == 0.0:
        raise APIError("repetition_penalty=0: expected a number in (0, 100] (1 = off)", param="repetition_penalty")
    if repetition != 1.0:
        out["repetition_penalty"] = repetition
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise APIError(f"logit_bias={_show(bias)}: expected an object of token id -> bias", param="logit_bias")
        pairs = []
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.strip().isdigit() else None
            if token is None or token >= vocab_size or isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not -100 <= value <= 100:
                raise APIError(f"logit_bias[{_show(key)}]={_show(value)}: expected a token id below {vocab_size} "
                               f"and a bias in [-100, 100]", param="logit_bias")
            pairs.append((token, float(value)))
        if pairs:
            out["logit_bias"] = tuple(pairs)
    banned = body.get("banned_token_ids")
    if banned is not None:
        if not (isinstance(banned, list) and all(_is_int(t) and 0 <= t < vocab_size for t in banned)):
            raise APIError(f"banned_token_ids={_show(banned)}: expected a list of token ids below {vocab_size}",
                           param="banned_token_ids")
        if banned:
            out["banned_token_ids"] = tuple(banned)
    min_tokens = _int(body, "min_tokens", 0, low=0)
    if min_tokens:
        out["min_tokens"] = min_tokens
    if _bool(body, "ignore_eos", False):
        out["ignore_eos"] = True
    return tuple(out.items())


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request with ``seed``: the seed itself for choice 0 (so n=1 is the request
    alone), else a 32-bit word of numpy's SeedSequence([seed, index])."""
    if index == 0:
        return seed
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


def choice_params(params: GenerationParams) -> list[GenerationParams]:
    """One request's ``best_of`` choices as requests of their own: choice i with seed ``choice_seed(seed, i)`` (no
    seed: each draws its own), logprobs recorded (0 at least) where best_of > n ranks them."""
    if params.best_of == 1:
        return [params]
    logprobs = params.logprobs if params.best_of == params.n or params.logprobs is not None else 0
    return [dataclasses.replace(params, seed=None if params.seed is None else choice_seed(params.seed, i),
                                logprobs=logprobs, n=1, best_of=1) for i in range(params.best_of)]


def _prompt_ids(prompt: Any, model: ModelInfo) -> list[int]:
    """A string, a list of token ids, or a list holding one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if prompt == "":
        raise APIError("the prompt is empty: give the text to continue", param="prompt")
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise APIError("text prompts need the model's tokenizer.json, and this model has none: send token ids",
                           param="prompt")
        ids = model.tokenizer.encode(prompt).ids
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(f"{len(prompt)} prompts in one request are not supported: send one request per prompt",
                       param="prompt", code="unsupported")
    else:
        raise APIError(f"prompt={_show(prompt)}: expected a string or a non-empty list of token ids", param="prompt")
    if not ids:
        raise APIError("the prompt is empty: expected at least one token", param="prompt")
    _checked("prompt", check_token_ids, ids, model.vocab_size, "the prompt")
    return ids


def _messages(messages: Any) -> list[dict[str, Any]]:
    """[{"role", "content"}] with content a string, null, or a list of {"type": "text", "text"} parts -> plain
    {"role": str, "content": str} dicts, keeping an assistant's ``tool_calls`` (their JSON ``arguments`` strings
    as objects, as vLLM hands them to chat templates) and a tool message's ``tool_call_id`` and ``name``; other
    keys dropped."""
    if not isinstance(messages, list) or not messages:
        raise APIError(f"messages={_show(messages)}: expected a non-empty list of {{'role', 'content'}} objects",
                       param="messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(f"{where}={_show(message)}: expected an object with a string 'role'", param=where)
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                               param=f"{where}.content")
            content = "".join(p["text"] for p in content)
        elif content is None:
            if message["role"] in ("user", "system", "developer"):
                raise APIError(f"{where}.content is missing: a {message['role']} message needs its content",
                               param=f"{where}.content")
            content = ""
        elif not isinstance(content, str):
            raise APIError(f"{where}.content={_show(content)}: expected a string or a list of text parts",
                           param=f"{where}.content")
        kept: dict[str, Any] = {"role": message["role"], "content": content}
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                kept[key] = message[key]
        if message.get("tool_calls") is not None:
            kept["tool_calls"] = _tool_calls(message["tool_calls"], where)
        out.append(kept)
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's OpenAI ``tool_calls`` checked, each function's arguments as an object."""
    if not isinstance(calls, list):
        raise APIError(f"{where}.tool_calls={_show(calls)}: expected a list", param=f"{where}.tool_calls")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(f"{where}.tool_calls: {_show(call)}: expected {{'function': {{'name', 'arguments'}}}}",
                           param=f"{where}.tool_calls")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise APIError(f"{where}.tool_calls: arguments {_show(arguments)} are not JSON",
                               param=f"{where}.tool_calls") from None
        out.append({**call, "function": {"name": function["name"], "arguments": arguments}})
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _checked(param: str, check: Callable[..., Any], value: Any, *args: Any) -> Any:
    """``check(value, *args)`` (a ``jspec.config`` check) unless ``value`` is None; its ValueError is answered as a
    400 naming ``param``."""
    if value is None:
        return None
    try:
        return check(value, *args)
    except ValueError as error:
        raise APIError(str(error), param=param) from None


def _int(body: dict[str, Any], name: str, default: int | None, low: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value) or (low is not None and value < low):
        raise APIError(f"{name}={_show(value)}: expected an integer{'' if low is None else f' >= {low}'}",
                       param=name)
    return value


def _number(body: dict[str, Any], name: str, default: float, low: float = -math.inf,
            high: float = math.inf) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise APIError(f"{name}={_show(value)}: expected a number in [{low}, {high}]", param=name)
    return float(value)


def _bool(body: dict[str, Any], name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(f"{param or name}={_show(value)}: expected true or false", param=param or name)
    return value


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _show(value: Any, limit: int = 80) -> str:
    """repr of a client's value, cut short (a fuzzer's megabyte of JSON does not belong in an error message)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
