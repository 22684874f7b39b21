"""StructuredOutputsParams: exactly one constraint, each checked before any work, OpenAI's response_format mapped."""

import pytest

from jspec.structured_outputs import StructuredOutputsParams


def test_a_schema_is_kept_as_canonical_json_so_equal_schemas_share_a_grammar():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    assert a == b and hash(a) == hash(b) and a.kind == "json"
    assert a.schema == {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one"),
    ({"regex": "a+", "choice": ["a"]}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1, 2]"}, "expected a JSON schema"),
    ({"choice": "yes"}, "non-empty list"),
    ({"choice": []}, "non-empty list"),
    ({"regex": ""}, "non-empty string"),
    ({"json_object": "yes"}, "json_object"),
])
def test_bad_params_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_coerce_takes_vllm_dicts_and_names_unknown_fields():
    assert StructuredOutputsParams.coerce({"choice": ["x", "y"]}) == StructuredOutputsParams(choice=("x", "y"))
    assert StructuredOutputsParams.coerce({"json_object": True, "regex": None}).kind == "json_object"
    with pytest.raises(ValueError, match="unknown fields \\['pattern'\\]"):
        StructuredOutputsParams.coerce({"pattern": "a"})


def test_openai_response_format():
    assert StructuredOutputsParams.from_response_format(None) is None
    assert StructuredOutputsParams.from_response_format({"type": "text"}) is None
    assert StructuredOutputsParams.from_response_format({"type": "json_object"}).kind == "json_object"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    params = StructuredOutputsParams.from_response_format({"type": "json_schema",
                                                           "json_schema": {"name": "n", "schema": schema}})
    assert params.schema == schema
    with pytest.raises(ValueError, match="response_format type='xml'"):
        StructuredOutputsParams.from_response_format({"type": "xml"})
