"""Chat templates: a checkpoint's ``chat_template`` (tokenizer_config.json, or chat_template.jinja beside it)
rendered with jinja2 and encoded to token ids the way transformers' ``apply_chat_template(..., tokenize=True)``
does, so a conversation becomes the same prompt ids here as there.

What transformers does, and this module matches (transformers/utils/chat_template_utils.py and
``PreTrainedTokenizerBase.apply_chat_template``):

- the template runs in jinja2's ImmutableSandboxedEnvironment (templates from the Hub are untrusted code) with
  ``trim_blocks=True, lstrip_blocks=True`` and the ``loopcontrols`` extension; ``raise_exception(msg)``,
  ``strftime_now(fmt)`` and a ``tojson`` filter that is ``json.dumps`` (no HTML escaping) are defined;
- it sees ``messages`` (message keys whose value is None dropped), ``add_generation_prompt``, ``tools`` (None, or
  the request's list of ``{"type": "function", "function": {...}}``, as transformers passes JSON-schema tools),
  ``documents=None`` and the named special tokens of tokenizer_config.json as strings (``bos_token``,
  ``eos_token``, ...; AddedToken dicts give their ``content``);
- the rendered text is encoded WITHOUT the tokenizer's own special tokens (``add_special_tokens=False``): the
  template already wrote BOS where the model wants it; special tokens written in the text are matched as tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from datetime import datetime
from typing import Any, Sequence

# The named special tokens transformers passes to every template (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TEMPLATE_FILE = "chat_template.jinja"

Message = dict[str, Any]
Conversation = list[Message]


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """source: the jinja2 template text; special_tokens: {"bos_token": "<|begin_of_text|>", ...} as strings."""

    source: str
    special_tokens: dict[str, str]

    def render(self, conversations: Sequence[Conversation], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> list[str]:
        """One text per conversation (validate with :func:`as_conversations` first); tools: the functions the
        model may call, rendered by the template. A template's own refusal (``raise_exception``, e.g. roles that do
        not alternate) is a ValueError."""
        import jinja2

        try:
            template = _compile(self.source)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"the checkpoint's chat_template does not compile: {error}") from error
        texts = []
        for conversation in conversations:
            messages = [{k: v for k, v in message.items() if v is not None} for message in conversation]
            try:
                texts.append(template.render(messages=messages, add_generation_prompt=bool(add_generation_prompt),
                                             tools=tools or None, documents=None, **self.special_tokens))
            except jinja2.TemplateError as error:
                raise ValueError(f"the chat template refused the conversation: {error}") from error
        return texts

    def encode(self, tokenizer, conversations: Sequence[Conversation], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> list[list[int]]:
        """Rendered conversations -> token ids (``tokenizers.Tokenizer``; no special tokens added: the template's)."""
        return [tokenizer.encode(text, add_special_tokens=False).ids
                for text in self.render(conversations, add_generation_prompt, tools)]

    def end_of_turn_ids(self, tokenizer) -> tuple[int, ...]:
        """The id of tokenizer_config.json's eos_token (Qwen's ``<|im_end|>``, Llama-3-Instruct's ``<|eot_id|>``):
        the token a chat model ends its turn with. () if there is none or the vocabulary lacks it."""
        token = self.special_tokens.get("eos_token")
        token_id = tokenizer.token_to_id(token) if token is not None else None
        return () if token_id is None else (token_id,)


def load_chat_template(model_dir: str | os.PathLike) -> ChatTemplate | None:
    """The chat template of a checkpoint directory, or None when it has none. As transformers: a
    chat_template.jinja file wins over tokenizer_config.json's ``chat_template``, which is a string or a list of
    {"name", "template"} (the one named "default" is used)."""
    model_dir = os.fspath(model_dir)
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    config: dict[str, Any] = {}
    if os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    source = config.get("chat_template")
    if os.path.isfile(os.path.join(model_dir, TEMPLATE_FILE)):
        with open(os.path.join(model_dir, TEMPLATE_FILE), encoding="utf-8") as f:
            source = f.read()
    if isinstance(source, list):
        named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
        if "default" not in named:
            raise ValueError(f"{config_path}: chat_template is a list of templates named {sorted(map(str, named))} "
                             f"and none is named 'default'")
        source = named["default"]
    if source is None:
        return None
    if not isinstance(source, str):
        raise ValueError(f"{config_path}: chat_template={source!r}: expected a string or a list of "
                         f"{{'name', 'template'}}")
    special = {name: _token_text(config[name]) for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None}
    return ChatTemplate(source, special)


def as_conversations(messages: Any) -> list[Conversation]:
    """Validates a conversation (a list of {"role", "content"} dicts) or a list of them -> a list of
    conversations, each a fresh copy made of plain JSON values (what the sandboxed template may see)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages={messages!r}: expected a non-empty list of {{'role': ..., 'content': ...}} "
                         f"dicts, or a list of such lists")
    batched = isinstance(messages[0], (list, tuple))
    conversations = list(messages) if batched else [messages]
    for i, conversation in enumerate(conversations):
        where = f"conversation {i}" if batched else "messages"
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError(f"{where}={conversation!r}: expected a non-empty list of {{'role', 'content'}} dicts")
        for j, message in enumerate(conversation):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str) and "content" in message
                    and isinstance(message["content"], (str, list, type(None)))):
                raise ValueError(f"{where}[{j}]={message!r}: expected a dict with a string 'role' and a 'content' "
                                 f"(a string, or a list of content parts)")
    try:
        return json.loads(json.dumps([list(c) for c in conversations]))
    except (TypeError, ValueError) as error:
        raise ValueError(f"messages hold a value that is not JSON ({error}): pass strings, numbers, lists and "
                         f"dicts") from None


def _token_text(token: Any) -> str:
    """tokenizer_config.json's special token: a string, or an AddedToken dict {"content": ..., ...}."""
    return token["content"] if isinstance(token, dict) else str(token)


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    """The template compiled in a sandbox configured as transformers configures its own."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja2's own tojson escapes HTML characters (< > & '), which would change the prompt
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks the assistant's tokens for training) renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
