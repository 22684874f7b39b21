"""Tool calls (jspec/serve/tool_parsers.py and the chat API around them): the hermes and llama3_json parsers on the
formats those models write, the streamed reply sending its calls as deltas (name first, then the arguments as
written), tools rendered through
the chat template with the request's messages (tool calls and tool results kept), and the answer's shape."""

import json
from types import SimpleNamespace

import pytest
import tokenizers

from jspec.chat import ChatTemplate
from jspec.serve import tool_parsers
from jspec.serve.app import _Shape
from jspec.serve.tool_call_stream import ToolCallStream
from jspec.serve.protocol import APIError, ModelInfo, parse_chat

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
HERMES_REPLY = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
TEMPLATE = ("{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}: "
            "{{ m.content }}{% if m.tool_calls %} CALLS {{ m.tool_calls | tojson }}{% endif %}"
            "{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}\n{% endfor %}assistant:")


def test_hermes_calls_and_the_content_before_them():
    content, calls = tool_parsers.parse("hermes", HERMES_REPLY)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_weather", {"city": "Oslo"})]
    call = calls[0].as_openai(0)
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")


@pytest.mark.parametrize("text", ["no call here", "<tool_call>{not json}</tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>{\"name\": \"f\""])
def test_hermes_text_that_is_no_well_formed_call_stays_content(text):
    assert tool_parsers.parse("hermes", text) == (text, [])


def test_llama3_json_calls():
    content, calls = tool_parsers.parse(
        "llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                       '{"name": "get_time", "parameters": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert tool_parsers.parse("llama3_json", "The weather is fine.") == ("The weather is fine.", [])
    assert tool_parsers.parse("llama3_json", '{"name": "f", "parameters": {}} and more')[1] == []


def streamed(parser: str | None, pieces: list[str]) -> tuple[str, list[dict], bool, int]:
    """``pieces`` through a ToolCallStream -> (the content sent, the tool-call deltas, whether the reply was calls,
    the number of pieces after which some delta was sent)."""
    stream, content, deltas, with_deltas = ToolCallStream(parser), "", [], 0
    for piece in pieces:
        text, new = stream.feed(piece)
        content, deltas, with_deltas = content + text, deltas + new, with_deltas + bool(new)
    rest, new, called = stream.finish()
    return content + rest, deltas + new, called, with_deltas


def assembled(deltas: list[dict]) -> list[tuple[str, str, dict]]:
    """Deltas as a client assembles them -> per call (id, name, arguments parsed)."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"id": None, "name": "", "arguments": ""})
        if "id" in delta:
            assert call["id"] is None and delta["type"] == "function" and delta["function"]["arguments"] == ""
            call["id"], call["name"] = delta["id"], delta["function"]["name"]
        call["arguments"] += delta["function"]["arguments"]
    return [(c["id"], c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_streamed_calls_come_as_deltas_name_first_then_arguments_as_written(size):
    """The reply in pieces of ``size`` characters: the content before the calls streams, each call's header
    (id, name) comes once its name is written, its arguments in pieces as the model writes them (a brace inside
    a string, nested lists), and they assemble into what the whole reply parses to."""
    reply = HERMES_REPLY.replace('{"city": "Paris"}', '{"city": "Paris", "tags": [1, {"note": "a } b"}]}')
    content, deltas, called, with_deltas = streamed("hermes", [reply[i:i + size] for i in range(0, len(reply), size)])
    _, whole = tool_parsers.parse("hermes", reply)
    calls = assembled(deltas)
    assert called and content == "Let me look.\n"
    assert [(name, args) for _, name, args in calls] == [(c.name, json.loads(c.arguments)) for c in whole]
    assert all(call_id.startswith("call_") for call_id, _, _ in calls) and calls[0][0] != calls[1][0]
    if size == 1:  # streamed as written: the first call's arguments before the second call's name
        assert with_deltas > 20
        first_second = next(i for i, d in enumerate(deltas) if d["index"] == 1)
        assert "".join(d["function"]["arguments"] for d in deltas[:first_second]).startswith('{"city": "Paris"')


def test_a_streamed_reply_holds_back_a_call_even_when_its_tag_is_cut():
    pieces = ["Let me look.\n<to", "ol_call>\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": \"Paris\"}}",
              "\n</tool_call>"]
    content, deltas, called, _ = streamed("hermes", pieces)
    assert content == "Let me look.\n" and called and [name for _, name, _ in assembled(deltas)] == ["get_weather"]
    assert streamed("hermes", ["a <b", " c <", "to"])[:3] == ("a <b c <to", [], False)
    assert streamed(None, ["<tool_call>"])[:3] == ("<tool_call>", [], False)


def test_other_formats_stream_their_calls_and_plain_text_stays_content():
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "parameters": {}}')
    _, deltas, called, _ = streamed("llama3_json", [text[i:i + 2] for i in range(0, len(text), 2)])
    assert called and [(n, a) for _, n, a in assembled(deltas)] == [("get_weather", {"city": "Paris"}),
                                                                    ("get_time", {})]
    assert streamed("llama3_json", [" The weather", " is fine."])[:3] == (" The weather is fine.", [], False)


def test_a_call_cut_short_ends_as_content_after_its_first_deltas():
    """A reply whose call never completes (max_tokens): the deltas sent stay sent, the held text comes as
    content and the reply finishes as text (vLLM's streaming parsers leave the same)."""
    content, deltas, called, _ = streamed("hermes", ["x <tool_call>{\"name\": \"f\", ", "\"arguments\": {\"a\": 1"])
    assert not called and content == 'x <tool_call>{"name": "f", "arguments": {"a": 1'
    assert deltas[0]["function"]["name"] == "f"


@pytest.fixture(scope="module")
def model():
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    return ModelInfo(name="m", tokenizer=tokenizer, chat_template=ChatTemplate(TEMPLATE, {}), max_seq_len=4096,
                     vocab_size=10, tool_call_parser="hermes")


def test_tools_and_tool_messages_reach_the_template(model, monkeypatch):
    rendered = []
    original = ChatTemplate.render

    def spy(self, conversations, add_generation_prompt=True, tools=None):
        texts = original(self, conversations, add_generation_prompt, tools)
        rendered.extend(texts)
        return texts

    monkeypatch.setattr(ChatTemplate, "render", spy)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    params = parse_chat({"messages": messages, "tools": [WEATHER], "max_tokens": 4}, model)
    assert params.tool_call_parser == "hermes"
    text = rendered[-1]
    assert text.startswith("TOOLS " + json.dumps([WEATHER]))
    assert 'CALLS [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ' \
           '{"city": "Paris"}}}]' in text  # the arguments as an object, as vLLM hands them over
    assert "tool: sunny FOR call_1" in text
    assert parse_chat({"messages": messages[:1], "tools": [WEATHER], "tool_choice": "none"},
                      model).tool_call_parser is None


@pytest.mark.parametrize("body, param, match", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "expected 'none', 'auto', 'required'"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "give no response_format"),
    ({"tools": [{"type": "function"}]}, "tools", "expected a list"),
    ({"tool_choice": "required"}, "tool_choice", "without tools"),
])
def test_tool_requests_this_server_cannot_serve_are_refused_by_name(model, body, param, match):
    with pytest.raises(APIError, match=match) as error:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}, model)
    assert error.value.param == param


def test_auto_without_a_parser_is_refused(model):
    bare = ModelInfo(**{**model.__dict__, "tool_call_parser": None})
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}, bare)


def test_the_answer_carries_the_calls_and_finish_reason_tool_calls(model):
    params = parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}, model)
    shape = _Shape(model, True, params, 3)
    generation = SimpleNamespace(token_ids=[1, 2], logprobs=[], finish_reason="stop", request=None)
    choice = shape.whole([HERMES_REPLY], [generation], completion_tokens=2)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    assert [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        {"city": "Paris"}, {"city": "Oslo"}]
    plain = shape.whole(["No need."], [generation], completion_tokens=2)["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"] == {"role": "assistant", "content": "No need."}


TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_choice_constrains_the_reply_to_its_calls_schema(model, choice):
    """vLLM's forced tool choice: the reply's grammar is the call(s)' JSON schema (compiled by llguidance over a real
    tokenizer: a valid reply passes it, a reply naming another function does not) and the reply parses into
    tool_calls whatever --tool-call-parser is."""
    import jspec
    from jspec.structured_outputs.grammar import GrammarCompiler
    from jspec.tokenizer import load_tokenizer

    params = parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, TIME],
                         "tool_choice": choice}, model)
    named = choice != "required"
    reply = '{"city":"Paris"}' if named else '[{"name":"get_weather","parameters":{"city":"Paris"}}]'
    wrong = '{"city":3}' if named else '[{"name":"get_date","parameters":{}}]'
    tokenizer = load_tokenizer(jspec.bundled_model())
    compiler = GrammarCompiler(tokenizer, tokenizer.get_vocab_size(), (2,))
    for text, valid in ((reply, True), (wrong, False)):
        matcher = compiler.matcher(params.structured_outputs)
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert (matcher.validate_tokens(ids) == len(ids)) == valid, text
    shape = _Shape(model, True, params, 3)
    generation = SimpleNamespace(token_ids=[1, 2], logprobs=[], finish_reason="stop", request=None)
    choice_out = shape.whole([reply], [generation], completion_tokens=2)["choices"][0]
    assert choice_out["finish_reason"] == "tool_calls" and choice_out["message"]["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in choice_out["message"]["tool_calls"]] == [("get_weather", {"city": "Paris"})]
    content, deltas, called, _ = streamed(params.tool_call_parser, [reply[:5], reply[5:]])
    assert content == "" and called and [(name, args) for _, name, args in assembled(deltas)] == [
        ("get_weather", {"city": "Paris"})]
