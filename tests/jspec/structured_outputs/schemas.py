"""Twenty JSON schemas for the structured-output tests: nested objects, arrays, enums, numbers, strings with
patterns. Strings and arrays are bounded so that a small model's output ends within the tests' token budget."""

NAME = {"type": "string", "maxLength": 12}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 999}

SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": SMALL_INT}, "required": ["name", "age"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "array", "items": SMALL_INT, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": SMALL_INT, "y": SMALL_INT},
                                                "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"],
     "additionalProperties": False},
    {"type": "object", "properties": {"version": {"type": "string", "pattern": "^v[0-9]\\.[0-9]$"}},
     "required": ["version"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score"],
     "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": -50, "maximum": 50},
                                      "label": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
     "required": ["id", "label"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": NAME, "roles": {"type": "array", "items": {"enum": ["admin", "dev"]}, "maxItems": 2}},
        "required": ["name", "roles"], "additionalProperties": False}}, "required": ["user"],
     "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": SMALL_INT},
     "required": ["status", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [SMALL_INT, {"type": "boolean"}]}}, "required": ["value"],
     "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"}},
     "required": ["email"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}$"}, "qty": SMALL_INT},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
     "additionalProperties": False},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "object", "properties": {"lang": {"enum": ["python", "c", "go"]}, "lines": SMALL_INT,
                                      "tested": {"type": "boolean"}},
     "required": ["lang", "lines", "tested"], "additionalProperties": False},
    {"type": "object", "properties": {"temp": {"type": "number", "minimum": -10, "maximum": 40},
                                      "unit": {"enum": ["C", "F"]}},
     "required": ["temp", "unit"], "additionalProperties": False},
    {"type": "object", "properties": {"config": {"type": "object", "properties": {
        "debug": {"type": "boolean"}, "level": {"enum": ["low", "high"]},
        "paths": {"type": "array", "items": {"type": "string", "pattern": "^/[a-z]{1,5}$"}, "maxItems": 2}},
        "required": ["debug", "level", "paths"], "additionalProperties": False}}, "required": ["config"],
     "additionalProperties": False},
]
