"""OpenAI's ``logprobs`` objects from the engine's log-probabilities (``jspec.logprobs.SequenceLogprobs``).

Completions (the legacy shape): ``{"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}],
"text_offset": [int]}``, each top dict the K most likely tokens and the chosen one (up to K + 1 entries, as OpenAI
documents). Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``
with K entries each. A token's string is its own decoded text (a byte-level token that is part of a longer UTF-8
character decodes to U+FFFD, as in vLLM); without a tokenizer, ``"token_id:<id>"`` (vLLM's
``return_tokens_as_token_ids``). -inf (a token with no mass) is written as -9999.0, as vLLM does: JSON has no
infinity.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from jspec.logprobs import SequenceLogprobs

NO_MASS = -9999.0


def _value(logprob: float) -> float:
    return float(logprob) if math.isfinite(logprob) else NO_MASS


class _Names:
    """Token id -> its string, decoded once per id; :meth:`width`: the characters it adds to the text (0 for a
    special token such as BOS, which the text does not show)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache, self.widths = tokenizer, {}, {}

    def width(self, token_id: int) -> int:
        token_id = int(token_id)
        if token_id not in self.widths:
            self.widths[token_id] = (len(self(token_id)) if self.tokenizer is None
                                     else len(self.tokenizer.decode([token_id], skip_special_tokens=True)))
        return self.widths[token_id]

    def __call__(self, token_id: int) -> str:
        token_id = int(token_id)
        if token_id not in self.cache:
            self.cache[token_id] = (f"token_id:{token_id}" if self.tokenizer is None
                                    else self.tokenizer.decode([token_id], skip_special_tokens=False))
        return self.cache[token_id]


def completion_logprobs(tokenizer, token_ids: Sequence[int], values: SequenceLogprobs) -> dict[str, Any]:
    """The completions ``logprobs`` object of ``token_ids`` (text offsets from the completion's start)."""
    name = _Names(tokenizer)
    tokens = [name(t) for t in token_ids]
    offsets, at = [], 0
    for token_id in token_ids:
        offsets.append(at)
        at += name.width(token_id)
    tops = []
    for chosen, logprob, ids, logprobs in zip(token_ids, values.token, values.top_ids, values.top):
        top = {name(i): _value(lp) for i, lp in zip(ids, logprobs)}
        top.setdefault(name(chosen), _value(logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [_value(x) for x in values.token], "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: Sequence[int], values: SequenceLogprobs) -> dict[str, Any]:
    """The chat ``logprobs`` object of ``token_ids``."""
    name = _Names(tokenizer)

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = name(token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for chosen, logprob, ids, logprobs in zip(token_ids, values.token, values.top_ids, values.top):
        content.append({**entry(chosen, logprob), "top_logprobs": [entry(i, lp) for i, lp in zip(ids, logprobs)]})
    return {"content": content}


def with_prompt(tokenizer, prompt_ids: Sequence[int], scored: SequenceLogprobs | None,
                completion: dict[str, Any] | None) -> dict[str, Any]:
    """A completions ``logprobs`` object for ``echo``: the prompt's tokens first (the first with null values, as
    OpenAI's: nothing predicts it; ``scored``: the rest's), then ``completion``'s (None: none yet), text offsets
    running from the prompt's start."""
    name = _Names(tokenizer)
    prompt = {"tokens": [name(prompt_ids[0])], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [0]}
    if scored is not None and len(prompt_ids) > 1:
        rest = completion_logprobs(tokenizer, prompt_ids[1:], scored)
        for field in ("tokens", "token_logprobs", "top_logprobs"):
            prompt[field] += rest[field]
        prompt["text_offset"] += [name.width(prompt_ids[0]) + at for at in rest["text_offset"]]
    if completion is None:
        return prompt
    shift = prompt["text_offset"][-1] + name.width(prompt_ids[len(prompt["tokens"]) - 1])
    return {"tokens": prompt["tokens"] + completion["tokens"],
            "token_logprobs": prompt["token_logprobs"] + completion["token_logprobs"],
            "top_logprobs": prompt["top_logprobs"] + completion["top_logprobs"],
            "text_offset": prompt["text_offset"] + [shift + at for at in completion["text_offset"]]}
