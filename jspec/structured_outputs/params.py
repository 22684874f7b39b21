"""StructuredOutputsParams: what a request's output must match (vLLM's ``StructuredOutputsParams`` and OpenAI's
``response_format``), validated before any work is done."""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: json (a JSON schema, as a dict or its JSON text), regex, choice (the output is one of these
    strings), grammar (Lark or GBNF/EBNF text, llguidance's), json_object (any JSON object). Hashable: the schema
    is kept as canonical JSON text, the key compiled grammars are cached under.

    disable_any_whitespace (vLLM's): JSON without whitespace between its tokens (the default allows any, as
    vLLM's; a small model may then spend its tokens on indentation)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self):
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs disable_any_whitespace={self.disable_any_whitespace!r}: expected "
                             f"true or false")
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs json_object={self.json_object!r}: expected true or false")
        if len(given) != 1:
            raise ValueError(f"structured_outputs sets {given or 'nothing'}: expected exactly one of json, regex, "
                             f"choice, grammar, json_object")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs json: not valid JSON ({e})") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs json={self.json!r}: expected a JSON schema (an object)")
            object.__setattr__(self, "json", json.dumps(schema, sort_keys=True))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs {name}={value!r}: expected a non-empty string")
        if self.choice is not None:
            choice = self.choice
            if (isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice
                    or not all(isinstance(c, str) and c for c in choice)):
                raise ValueError(f"structured_outputs choice={choice!r}: expected a non-empty list of non-empty "
                                 f"strings")
            object.__setattr__(self, "choice", tuple(choice))

    @property
    def kind(self) -> str:
        """Which of the five this is (the name of the field set)."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)

    @property
    def schema(self) -> Any:
        """The JSON schema as an object (json), {"type": "object"} (json_object), else None."""
        if self.json_object:
            return {"type": "object"}
        return None if self.json is None else json.loads(self.json)

    @classmethod
    def coerce(cls, value: "StructuredOutputsParams | dict") -> "StructuredOutputsParams":
        """A StructuredOutputsParams, or vLLM's dict of the same fields (``{"json": {...}}``, ``{"regex": "..."}``,
        ...)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs={value!r}: expected a StructuredOutputsParams or a dict of its "
                             f"fields")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"structured_outputs: unknown fields {unknown}; expected json, regex, choice, grammar, "
                             f"json_object or disable_any_whitespace")
        fields = {k: v for k, v in value.items() if v is not None and v is not False}
        return cls(**fields)

    @classmethod
    def from_response_format(cls, response_format: dict | None) -> "StructuredOutputsParams | None":
        """OpenAI's chat ``response_format``: {"type": "text"} (None), {"type": "json_object"}, or
        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}."""
        if response_format is None:
            return None
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
                raise ValueError("response_format json_schema: expected {\"json_schema\": {\"name\": ..., "
                                 "\"schema\": {...}}}")
            return cls(json=spec.get("schema", {}))
        raise ValueError(f"response_format type={kind!r}: expected 'text', 'json_object' or 'json_schema'")
