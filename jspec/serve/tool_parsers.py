"""A chat model's tool calls parsed out of its text, as vLLM's ``--tool-call-parser`` does, into OpenAI's
``tool_calls``.

- ``hermes`` (Hermes 2 Pro, Qwen2.5 / Qwen3 and their chat templates): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; the text before the first one is the content.
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 with JSON tool calling): the reply, after an optional ``<|python_tag|>``,
  is one JSON object ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), or several separated by ``;``.

A reply that is not a well-formed call stays content: a parser never invents a call, and never drops text it
could not read.

A forced ``tool_choice`` is vLLM's: the reply is constrained by a JSON schema (``jspec.structured_outputs``) and read
by a parser of its own, whatever format the model was trained on (:func:`forced_tool_choice`): a named function's
reply is its arguments object; "required" is a list of ``{"name": ..., "parameters": {...}}`` calls.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Callable

PARSERS = ("hermes", "llama3_json")
REQUIRED = "required"    # the parser of tool_choice "required" replies (a JSON list of calls)
NAMED = "function:"      # + a function's name: the parser of a reply forced to call it (its arguments object)
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
HERMES_START = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """name: the function's; arguments: its arguments as a JSON string (OpenAI's shape)."""

    name: str
    arguments: str

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _call(obj: Any, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # already a JSON string: keep it if it parses
        try:
            json.loads(arguments)
        except ValueError:
            return None
        return ToolCall(obj["name"], arguments)
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """-> (content, calls); with no well-formed call, (text, [])."""
    calls = []
    for block in HERMES_CALL.findall(text):
        try:
            call = _call(json.loads(block), "arguments")
        except ValueError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    content = text[:text.index(HERMES_START)].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """-> (None, calls) when the whole reply is calls; else (text, [])."""
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _call(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return None, calls


def tool_call_start(parser: str) -> Callable[[str], int | None]:
    """The parser's rule for where a streamed reply's calls may begin: text -> the index from which the text must
    be held back (a call, or the start of one), or None while it is plain content."""
    def hermes(text: str) -> int | None:
        if HERMES_START in text:
            return text.index(HERMES_START)
        for n in range(len(HERMES_START) - 1, 0, -1):  # a tag cut across pieces
            if text.endswith(HERMES_START[:n]):
                return len(text) - n
        return None

    def llama3(text: str) -> int | None:
        stripped = text.lstrip()
        if not stripped:
            return 0
        return 0 if stripped[0] == "{" or PYTHON_TAG.startswith(stripped[:len(PYTHON_TAG)]) else None

    if parser == REQUIRED or parser.startswith(NAMED):
        return lambda text: 0  # the whole reply is the call(s)
    return {"hermes": hermes, "llama3_json": llama3}[parser]


def parse(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """``text`` through the named parser (one of :data:`PARSERS`, or a forced tool choice's) -> (content or None,
    calls)."""
    if parser == REQUIRED or parser.startswith(NAMED):
        return _parse_forced(parser, text)
    return {"hermes": parse_hermes, "llama3_json": parse_llama3_json}[parser](text)


def forced_tool_choice(tools: list[dict[str, Any]], choice: Any) -> tuple[str, dict[str, Any]]:
    """A chat request's tool_choice "required" or ``{"type": "function", "function": {"name": ...}}`` over its
    ``tools`` -> (the parser of its reply, the JSON schema the reply is constrained by). ValueError naming a
    choice that is neither, or a function not among the tools."""
    functions = {tool["function"]["name"]: tool["function"].get("parameters") or {"type": "object"}
                 for tool in tools}
    if choice == REQUIRED:
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, parameters in functions.items()]
        return REQUIRED, {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
        raise ValueError(f"tool_choice={choice!r}: expected 'none', 'auto', 'required' or {{'type': 'function', "
                         f"'function': {{'name': ...}}}}")
    if name not in functions:
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools "
                         f"{sorted(functions)}")
    return NAMED + name, functions[name]


def _parse_forced(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """A forced tool choice's reply (valid JSON under its grammar, unless cut by max_tokens) -> calls, or
    (text, []) where it does not parse."""
    try:
        value = json.loads(text)
    except ValueError:
        return text, []
    if parser.startswith(NAMED):
        return (None, [ToolCall(parser[len(NAMED):], json.dumps(value, ensure_ascii=False))]) \
            if isinstance(value, dict) else (text, [])
    calls = [_call(item, "parameters") for item in value] if isinstance(value, list) else [None]
    return (None, calls) if calls and None not in calls else (text, [])
