"""Grammars compiled with llguidance for one tokenizer: a fresh matcher per request from a cache keyed by the
request's StructuredOutputsParams (a matcher is copied from the cached one, never rebuilt)."""

from __future__ import annotations

import functools
import json
from typing import Sequence

from jspec.structured_outputs.params import StructuredOutputsParams


class GrammarCompiler:
    """llguidance over a ``tokenizers.Tokenizer`` of ``vocab_size`` ids (the model's, padded ids included, which
    no grammar allows); eos_token_ids: the ids a finished grammar allows (the sequence's end)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 256):
        import llguidance

        if tokenizer is None:
            raise ValueError("structured outputs need the checkpoint's tokenizer.json, and this engine has none")
        if not eos_token_ids:
            raise ValueError("structured outputs need an EOS token id to end a finished grammar; the engine has none")
        self._llguidance = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids))
        self._compiled = functools.lru_cache(maxsize=cache_size)(self._compile)

    def _compile(self, params: StructuredOutputsParams):
        """-> a matcher at the grammar's start (copied for each request); ValueError when the grammar is bad."""
        llguidance = self._llguidance
        try:
            if params.json_object or params.json is not None:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    json.dumps(params.schema), defaults={"whitespace_flexible": not params.disable_any_whitespace})
            elif params.regex is not None:
                grammar = llguidance.grammar_from("regex", params.regex)
            elif params.choice is not None:
                grammar = llguidance.grammar_from("choice", list(params.choice))
            else:
                grammar = llguidance.grammar_from("grammar", params.grammar)
        except ValueError as e:
            raise ValueError(f"structured_outputs {params.kind}: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"structured_outputs {params.kind}: {error}")
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs {params.kind}: {matcher.get_error()}")
        return matcher

    def matcher(self, params: StructuredOutputsParams):
        """A new ``llguidance.LLMatcher`` for one request, at the grammar's start."""
        return self._compiled(params).deep_copy()
