"""Request parsing (jspec/serve/protocol.py) of structured outputs: OpenAI's response_format, vLLM's
structured_outputs and its older guided_* fields, one way at a time, bad constraints refused by name."""

import pytest
import tokenizers

from jspec.serve.protocol import APIError, ModelInfo, parse_chat, parse_completion
from jspec.structured_outputs import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}


@pytest.fixture(scope="module")
def model():
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    return ModelInfo(name="m", tokenizer=tokenizer, chat_template=None, max_seq_len=64, vocab_size=10)


@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputsParams(regex="[0-9]+")),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=("a", "b"))),
    ({"guided_grammar": 'start: "x"'}, StructuredOutputsParams(grammar='start: "x"')),
])
def test_each_way_of_asking_gives_its_constraint(model, fields, expected):
    assert parse_completion({"prompt": [1, 2], **fields}, model).structured_outputs == expected
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}, model)
    assert chat.structured_outputs == expected


@pytest.mark.parametrize("fields, param, match", [
    ({"response_format": {"type": "xml"}}, "response_format", "expected 'text', 'json_object' or 'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, "response_format",
     "json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs", "unknown fields"),
    ({"structured_outputs": "a+"}, "structured_outputs", "expected a StructuredOutputsParams or a dict"),
    ({"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "one way"),
])
def test_bad_constraints_are_400s_naming_the_field(model, fields, param, match):
    with pytest.raises(APIError, match=match) as error:
        parse_completion({"prompt": [1, 2], **fields}, model)
    assert error.value.param == param and error.value.status == 400
