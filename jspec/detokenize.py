"""Incremental detokenization: the text a growing token list adds, piece by piece."""

from __future__ import annotations


class TextStream:
    """Turns the growing token list of one sequence into printable pieces of text.

    Each call decodes the whole list and returns what was not returned before, so BPE merges and multi-byte
    characters split over several tokens come out right; while the text ends in U+FFFD (a UTF-8 sequence whose
    remaining bytes are still to come) that tail is held back until the next call or ``final=True``. The pieces
    concatenate to ``tokenizer.decode(token_ids, skip_special_tokens=True)``.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.printed = ""

    def piece(self, token_ids: list[int], final: bool = False) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        if not final:
            text = text.rstrip("\ufffd")
        if len(text) <= len(self.printed):
            return ""
        new, self.printed = text[len(self.printed):], text
        return new
