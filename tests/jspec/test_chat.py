"""Chat templates (jspec.chat): the same prompt ids as transformers' apply_chat_template for Llama-3- and
Qwen3-style templates, SpecEngine.chat end to end on a tiny random model, `jspec generate --chat`, and the errors
for a model without a template and for malformed messages."""

import contextlib
import io
import json
import os

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

import jspec
from jspec.chat import ChatTemplate, as_conversations, load_chat_template
from jspec.tools.cli import main
from jspec.tools.demo_model import write_random_hf_checkpoint
from models.checkpoint import convert_hf_checkpoint

# Llama-3-8B-Instruct's template, verbatim.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")

# Llama-3.1-Instruct's structure (its tool-calling branches left out): a system header with dates, always.
LLAMA31 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- else %}
        {{- raise_exception("tool calls are not in this test's template") }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Qwen3's structure: namespace, a reversed scan for the last user query, <think> blocks, tools as tojson.
QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["You are a helpful assistant. Answer briefly.", "What is the capital of France? Paris is.",
          "def add(a, b):\n    return a + b\n", "Tell me a joke about  spaces\tand tabs\n\n and trailing  "] * 4

CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is 2 + 2?"}],
    "system+multi-turn": [
        {"role": "system", "content": "You are a helpful assistant.  "},
        {"role": "user", "content": "  Hi there!\n"},
        {"role": "assistant", "content": "<think>\ngreeting\n</think>\n\nHello! How can I help?"},
        {"role": "user", "content": "Write add(a, b) in Python."},
    ],
}


def _added(content: str) -> dict:
    """An AddedToken as transformers writes it into tokenizer_config.json."""
    return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def write_chat_tokenizer(directory: str, style: str) -> Tokenizer:
    """A byte-level BPE (300 tokens) plus the style's special tokens, and a tokenizer_config.json with its
    template. Llama-3: BOS prepended by the post-processor (so encoding the rendered text WITH special tokens
    would double it), eos_token <|eot_id|>; Qwen3: no BOS, eos_token <|im_end|> as an AddedToken dict."""
    special = LLAMA3_SPECIAL if style == "llama3" else QWEN3_SPECIAL
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if style == "llama3":
        bos = tokenizer.token_to_id("<|begin_of_text|>")
        tokenizer.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                                 special_tokens=[("<|begin_of_text|>", bos)])
        config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA31}
    else:
        tokenizer.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
        config = {"bos_token": None, "eos_token": _added("<|im_end|>"), "pad_token": "<|endoftext|>",
                  "chat_template": QWEN3}
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **config},
                  f, indent=2)
    return tokenizer


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def chat_tokenizer(request, tmp_path_factory):
    """(directory, tokenizers.Tokenizer, transformers tokenizer) of one style."""
    from transformers import AutoTokenizer

    directory = str(tmp_path_factory.mktemp(request.param))
    tokenizer = write_chat_tokenizer(directory, request.param)
    return directory, tokenizer, AutoTokenizer.from_pretrained(directory)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_ids_equal_transformers_apply_chat_template(chat_tokenizer, name, add_generation_prompt):
    directory, tokenizer, hf = chat_tokenizer
    conversation = CONVERSATIONS[name]
    template = load_chat_template(directory)
    expected = hf.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
                                      return_dict=False)
    assert template.encode(tokenizer, [conversation], add_generation_prompt) == [list(expected)]
    text = hf.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert template.render([conversation], add_generation_prompt) == [text]
    assert text.count("<|begin_of_text|>") == ("<|begin_of_text|>" in template.special_tokens.values())


def test_a_batch_of_conversations_equals_transformers_batched(chat_tokenizer):
    directory, tokenizer, hf = chat_tokenizer
    batch = [CONVERSATIONS["user"], CONVERSATIONS["system+multi-turn"]]
    expected = hf.apply_chat_template(batch, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert load_chat_template(directory).encode(tokenizer, as_conversations(batch)) == [list(e) for e in expected]


def test_llama3_verbatim_template_and_tojson_match_transformers(tmp_path):
    """Llama-3-8B-Instruct's own template; a tojson template (no HTML escaping, non-ASCII kept) over None-valued
    keys (dropped) and a template naming a special token that is an AddedToken dict."""
    from transformers import AutoTokenizer

    write_chat_tokenizer(str(tmp_path), "llama3")
    conversation = CONVERSATIONS["system+multi-turn"] + [{"role": "assistant", "content": "a<b & 'c' é",
                                                          "tool_calls": None}]
    for source in (LLAMA3, "{{ messages | tojson }}{{ messages | tojson(indent=2) }}{{ eos_token }}"):
        with open(tmp_path / "tokenizer_config.json") as f:
            config = json.load(f)
        config.update(chat_template=source, eos_token=_added("<|eot_id|>"))
        with open(tmp_path / "tokenizer_config.json", "w") as f:
            json.dump(config, f)
        hf = AutoTokenizer.from_pretrained(str(tmp_path))
        template = load_chat_template(tmp_path)
        assert template.render([conversation]) == [hf.apply_chat_template(conversation, add_generation_prompt=True,
                                                                          tokenize=False)]


def test_template_list_uses_default_and_chat_template_jinja_wins(tmp_path):
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
                   "bos_token": {"content": "<s>"}}, f)
    template = load_chat_template(tmp_path)
    assert template.source == "D" and template.special_tokens == {"bos_token": "<s>"}
    (tmp_path / "chat_template.jinja").write_text("J{{ bos_token }}")
    assert load_chat_template(tmp_path).render([[{"role": "user", "content": "x"}]]) == ["J<s>"]
    os.remove(tmp_path / "chat_template.jinja")
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": [{"name": "tool_use", "template": "T"}]}, f)
    with pytest.raises(ValueError, match="none is named 'default'"):
        load_chat_template(tmp_path)
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "</s>"}, f)
    assert load_chat_template(tmp_path) is None
    assert load_chat_template(tmp_path / "missing") is None


@pytest.mark.parametrize("messages,match", [
    ("hello", "messages='hello': expected a non-empty list"),
    ([], "messages=\\[\\]: expected a non-empty list"),
    ([{"role": "user"}], "messages\\[0\\]=\\{'role': 'user'\\}: expected a dict with a string 'role' and a 'content'"),
    ([{"content": "hi"}], "messages\\[0\\]="),
    (["hi"], "messages\\[0\\]='hi'"),
    ([{"role": "user", "content": 3}], "messages\\[0\\]="),
    ([[{"role": "user", "content": "hi"}], []], "conversation 1=\\[\\]"),
    ([[{"role": "user", "content": "hi"}], [{"role": 1, "content": "x"}]], "conversation 1\\[0\\]="),
    ([{"role": "user", "content": [{"type": "text", "text": object()}]}], "not JSON"),
])
def test_bad_messages_are_value_errors_naming_the_value(messages, match):
    with pytest.raises(ValueError, match=match):
        as_conversations(messages)


def test_a_template_refusal_is_a_value_error():
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}", {})
    with pytest.raises(ValueError, match="the chat template refused the conversation: roles must alternate"):
        template.render([[{"role": "user", "content": "x"}]])
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}", {}).render([[{"role": "user", "content": "x"}]])


# --- end to end: SpecEngine.chat and jspec generate --chat on a tiny random model ------------------------------

def tiny_model(directory: str, style: str | None) -> str:
    """A converted random 2-layer Llama; with a style, its chat tokenizer and template (no generation_config:
    the template's eos_token is the only end of turn)."""
    hf = os.path.join(directory, "hf")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320, "hidden_size": 32,
              "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "rms_norm_eps": 1e-5, "eos_token_id": 0, "max_position_embeddings": 256}
    write_random_hf_checkpoint(hf, config=config)
    if style is not None:
        tokenizer = write_chat_tokenizer(hf, style)
        assert tokenizer.get_vocab_size() <= config["vocab_size"]
    return convert_hf_checkpoint(hf, os.path.join(directory, "out"), dtype="float32", progress=False)


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory):
    return tiny_model(str(tmp_path_factory.mktemp("qwen_model")), "qwen3")


@pytest.fixture(scope="module")
def qwen_engine(qwen_model):
    return jspec.SpecEngine.from_pretrained(qwen_model, max_batch_size=2, max_seq_len=128)


# slow: engine.chat = generate on the rendered ids, stopping at the end of turn; default tier:
# test_cli_chat_prints_what_engine_chat_generates (engine.chat through the CLI) and the rendering tests against
# transformers' apply_chat_template
@pytest.mark.slow
def test_engine_chat_is_generate_on_the_rendered_ids_and_stops_at_end_of_turn(qwen_engine):
    engine = qwen_engine
    im_end = engine.tokenizer.token_to_id("<|im_end|>")
    assert im_end not in engine.eos_token_ids and engine.chat_template.end_of_turn_ids(engine.tokenizer) == (im_end,)
    conversations = [CONVERSATIONS["user"], CONVERSATIONS["system+multi-turn"]]
    ids = engine.chat_template.encode(engine.tokenizer, conversations)
    plain = engine.generate(ids, max_new_tokens=12)
    out = engine.chat(conversations, max_new_tokens=12)
    for got, free in zip(out.token_ids, plain.token_ids):
        cut = free.index(im_end) + 1 if im_end in free else len(free)
        assert got == free[:cut]  # the same tokens, up to and including the end of turn
    # Random weights rarely say <|im_end|>: make it a stop the way chat does, from a prompt that predicts it.
    first = plain.token_ids[0][0]
    template = engine.chat_template
    engine.chat_template = ChatTemplate(template.source, {**template.special_tokens,
                                                          "eos_token": engine.tokenizer.id_to_token(first)})
    try:
        stopped = engine.chat(CONVERSATIONS["user"], max_new_tokens=12)
    finally:
        engine.chat_template = template
    assert stopped.token_ids == [[first]]
    assert engine.chat(CONVERSATIONS["user"], max_new_tokens=12, add_generation_prompt=False).token_ids == \
        engine.generate(engine.chat_template.encode(engine.tokenizer, [CONVERSATIONS["user"]], False),
                        max_new_tokens=12, stop_token_ids=[im_end]).token_ids


def test_engine_chat_errors_before_any_work(qwen_engine):
    with pytest.raises(ValueError, match="messages\\[0\\]="):
        qwen_engine.chat([{"role": "user", "text": "hi"}])
    bare = jspec.SpecEngine(qwen_engine.config, qwen_engine.params, tokenizer=qwen_engine.tokenizer, max_seq_len=128)
    with pytest.raises(ValueError, match="chat needs the checkpoint's chat_template"):
        bare.chat(CONVERSATIONS["user"])
    assert bare.num_compiled == 0


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_cli_chat_prints_what_engine_chat_generates(qwen_model, qwen_engine, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JSPEC_HOME", str(tmp_path_factory.mktemp("home")))
        code, out, err = run("generate", "--model", qwen_model, "--chat", "--json", "--max-tokens", "6", "What is 2 + 2?")
    assert code == 0, err
    report = json.loads(out)
    expected = qwen_engine.chat(CONVERSATIONS["user"], max_new_tokens=6)
    assert report["token_ids"] == expected.token_ids
    assert report["prompts"] == ["<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"]


def test_cli_chat_without_a_template_is_one_error_line(tmp_path):
    model = tiny_model(str(tmp_path), None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JSPEC_HOME", str(tmp_path / "home"))
        code, out, err = run("generate", "--model", model, "--chat", "hello")
    assert code == 2 and out == ""
    assert err == (f"jspec: error: --chat: the model at {model} has no chat_template (tokenizer_config.json); "
                   f"give plain prompts without --chat\n")


# slow: jspec generate --chat streamed = engine.chat; default tier: test_cli_chat_prints_what_engine_chat_generates
@pytest.mark.slow
def test_cli_chat_streams_the_rendered_prompt_and_engine_chats_reply(qwen_model, qwen_engine, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JSPEC_HOME", str(tmp_path_factory.mktemp("home")))
        code, out, err = run("generate", "--model", qwen_model, "--chat", "--max-tokens", "6", "What is 2 + 2?")
    assert code == 0, err
    rendered = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    expected = qwen_engine.chat(CONVERSATIONS["user"], max_new_tokens=6)
    assert f"--- {rendered!r}\n{rendered}{expected.texts[0]}\n--- {len(expected.token_ids[0])} tokens" in out, out
