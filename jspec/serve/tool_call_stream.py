"""A streamed chat reply's tool calls as deltas, as vLLM's streaming tool parsers send them (OpenAI's streaming
shape): a call's first delta carries its index, id, type and function name with empty arguments once the name is
written; the next ones carry the pieces of its arguments object as the model writes them; content before the calls
streams as content.

The calls are read out of the reply's text as it grows (``jspec.serve.tool_parsers``' formats): from where the
parser says a call may begin (``tool_call_start``) the text is held back from the content, each call's JSON object
is scanned (strings and nesting tracked) for its ``name`` and its arguments value (``arguments``, or llama3's and
"required"'s ``parameters``), and the arguments object's text streams as far as it is written (its trailing
whitespace held until more follows). A named forced tool choice's whole reply is the arguments object.

At the end the whole text is parsed as :func:`jspec.serve.tool_parsers.parse` parses a whole reply: the calls it
finds are what the reply was (any call not streamed yet is sent whole, and each streamed call's rest). A reply
that turns out to be no well-formed call, after a call's first deltas were sent, sends its held text as content
and finishes as "stop": the client has seen a call begin that never completed (vLLM's streaming parsers leave the
same). The arguments streamed are the model's own text, which parses to the same object as the whole reply's
``arguments`` (those re-serialized: their whitespace may differ).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from jspec.serve import tool_parsers
from jspec.serve.tool_parsers import HERMES_START, NAMED, PYTHON_TAG, REQUIRED


def scan_object(text: str, start: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The JSON object opening at text[start] ("{"), as far as ``text`` goes -> (its keys' values as
    (start, end) spans in ``text``, end None while a value is still being written; the index after its closing
    brace, None while open). Only the object's own keys are read; nested values are skipped over whole."""
    fields: dict[str, tuple[int, int | None]] = {}
    depth, i, key, value_start, key_start = 0, start, None, None, None
    in_string = escaped = False
    last = start  # the last non-space character of the value being read
    while i < len(text):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 1 and key_start is not None and value_start is None:
                    try:
                        key = json.loads(text[key_start:i + 1])
                    except ValueError:
                        key = None
                    key_start = None
            last = i
            i += 1
            continue
        if ch == '"':
            in_string = True
            if depth == 1 and key is None and value_start is None:
                key_start = i
            elif depth == 1 and key is not None and value_start is None:
                value_start = i
        elif ch in "{[":
            depth += 1
            if depth == 2 and key is not None and value_start is None:
                value_start = i
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                if key is not None and value_start is not None:
                    fields[key] = (value_start, last + 1)
                return fields, i + 1
        elif ch == ":" and depth == 1:
            pass
        elif ch == "," and depth == 1:
            if key is not None and value_start is not None:
                fields[key] = (value_start, last + 1)
            key = value_start = None
        elif not ch.isspace() and depth == 1 and key is not None and value_start is None:
            value_start = i  # a number, true, false, null
        if not ch.isspace():
            last = i
        i += 1
    if key is not None and value_start is not None:
        fields[key] = (value_start, None)
    return fields, None


class ToolCallStream:
    """One streamed chat reply under ``parser`` (one of ``tool_parsers.PARSERS``, a forced tool choice's, or None:
    no tool calls, the text passes through). :meth:`feed` each decoded piece, :meth:`finish` at the end."""

    def __init__(self, parser: str | None):
        self.parser, self.text, self.sent = parser, "", 0
        self.start = None if parser is None else tool_parsers.tool_call_start(parser)
        self.held: int | None = None  # where the held-back text (the calls) begins
        self.calls: list[dict[str, Any]] = []  # per call begun: its id, name and the arguments' characters sent

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        """-> (the content that may be sent now, the tool-call deltas the reply so far allows)."""
        if self.parser is None:
            return piece, []
        self.text += piece
        held = self.start(self.text) if self.held is None else self.held
        upto = len(self.text) if held is None else max(held, self.sent)
        content, self.sent = self.text[self.sent:upto], upto
        if held is not None and self._region_begins(held):
            self.held = held
        return content, self._deltas() if self.held is not None else []

    def finish(self) -> tuple[str, list[dict[str, Any]], bool]:
        """-> (held text to send as content, the last deltas, whether the reply was tool calls)."""
        if self.parser is None:
            return "", [], False
        _, calls = tool_parsers.parse(self.parser, self.text)
        if not calls or len(calls) < len(self.calls) or any(
                begun["name"] != call.name for begun, call in zip(self.calls, calls)):
            return self.text[self.sent:], [], False
        spans = self._objects() if self.held is not None else []
        deltas = []
        for index, call in enumerate(calls):
            raw = self._arguments(spans[index]) if index < len(spans) else None
            if raw is not None and not _same_json(raw, call.arguments):
                raw = None
            if index >= len(self.calls):
                self._begin(call.name)
                deltas.append(self._header(index))
            begun = self.calls[index]
            if begun["sent"] and raw is None:  # what was streamed is not this call's text: nothing to add to it
                continue
            whole = call.arguments if raw is None else raw
            if len(whole) > begun["sent"]:
                deltas.append(_arguments_delta(index, whole[begun["sent"]:]))
                begun["sent"] = len(whole)
        return "", deltas, True

    # --- reading the held text ----------------------------------------------------------------------------------

    def _region_begins(self, held: int) -> bool:
        """Whether the held text from ``held`` is where the calls begin (not a tag cut across pieces, which may
        still turn out to be content)."""
        if self.parser == "hermes":
            return self.text.startswith(HERMES_START, held)
        if self.parser == "llama3_json":
            rest = self.text[held:].lstrip()
            return rest.startswith("{") or rest.startswith(PYTHON_TAG)
        return True

    def _objects(self) -> list[tuple[int, dict[str, tuple[int, int | None]], int | None]]:
        """Each call object in the held text so far -> (its start, its fields, its end or None)."""
        text, at, out = self.text, self.held, []
        if self.parser.startswith(NAMED):  # the reply is the arguments object
            at += len(text[at:]) - len(text[at:].lstrip())
            return [(at, {}, scan_object(text, at)[1])] if text.startswith("{", at) else []
        if self.parser == REQUIRED:
            at = text.find("[", at)
            if at < 0:
                return []
            at += 1
        elif self.parser == "llama3_json":
            stripped = text[at:].lstrip()
            at = len(text) - len(stripped)
            if stripped.startswith(PYTHON_TAG):
                at += len(PYTHON_TAG)
        while True:
            if self.parser == "hermes":
                tag = text.find(HERMES_START, at)
                if tag < 0:
                    return out
                at = tag + len(HERMES_START)
            while at < len(text) and (text[at].isspace() or text[at] in ";,"):
                at += 1
            if at >= len(text) or text[at] != "{":
                return out
            fields, end = scan_object(text, at)
            out.append((at, fields, end))
            if end is None:
                return out
            at = end

    def _arguments(self, span) -> str | None:
        """The arguments object's text of a call object (None: none written yet, or not an object)."""
        start, fields, end = span
        if self.parser.startswith(NAMED):
            return self.text[start:end] if end is not None else self.text[start:].rstrip()
        key = "arguments" if "arguments" in fields else "parameters" if "parameters" in fields else None
        if key is None:
            return None
        value_start, value_end = fields[key]
        if self.text[value_start] != "{":
            return None
        return self.text[value_start:value_end] if value_end is not None else self.text[value_start:].rstrip()

    def _name(self, span) -> str | None:
        """A call object's function name, once written whole."""
        if self.parser.startswith(NAMED):
            return self.parser[len(NAMED):]
        _, fields, _ = span
        if "name" not in fields or fields["name"][1] is None:
            return None
        start, end = fields["name"]
        try:
            name = json.loads(self.text[start:end])
        except ValueError:
            return None
        return name if isinstance(name, str) else None

    def _deltas(self) -> list[dict[str, Any]]:
        """The deltas the held text allows beyond those sent: a call's header once its name is written (calls in
        order), then what of its arguments object is written."""
        deltas = []
        for index, span in enumerate(self._objects()):
            if index >= len(self.calls):
                name = self._name(span)
                if name is None:
                    break
                self._begin(name)
                deltas.append(self._header(index))
            arguments = self._arguments(span)
            begun = self.calls[index]
            if arguments is not None and len(arguments) > begun["sent"]:
                deltas.append(_arguments_delta(index, arguments[begun["sent"]:]))
                begun["sent"] = len(arguments)
        return deltas

    def _begin(self, name: str) -> None:
        self.calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "name": name, "sent": 0})

    def _header(self, index: int) -> dict[str, Any]:
        call = self.calls[index]
        return {"index": index, "id": call["id"], "type": "function",
                "function": {"name": call["name"], "arguments": ""}}


def _arguments_delta(index: int, piece: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": piece}}


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False
