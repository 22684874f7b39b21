"""Stop strings over streamed text: the text is cut before the stop string that completes first (the earliest end;
at equal ends the one that starts first), and while the text so far ends in what could be the start of one, that
tail is held back until the next piece decides it. Where the text is cut therefore does not depend on how it was
split into pieces (as generation goes, the first stop string to appear stops it, as in vLLM)."""

from __future__ import annotations

from typing import Sequence


class StopMatcher:
    """Feed it the text pieces of one completion; it returns what may be sent.

    Invariant: the text sent so far holds no stop string and does not end inside one, so the stop string in
    ``text[sent:]`` that ends first is the first one to complete in the whole completion.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.text = ""
        self.sent = 0  # characters of self.text handed out

    def feed(self, piece: str, final: bool = False) -> tuple[str, bool]:
        """-> (text to send now, whether a stop string ended the completion). ``final``: no more text follows,
        so nothing is held back."""
        self.text += piece
        found = [(i + len(s), i) for s, i in ((s, self.text.find(s, self.sent)) for s in self.stops) if i >= 0]
        if found:
            return self._send_up_to(min(found)[1]), True
        end = len(self.text) if final else len(self.text) - self._held_back()
        return self._send_up_to(end), False

    def _held_back(self) -> int:
        """Length of the longest tail of the unsent text that is a proper prefix of a stop string."""
        unsent = self.text[self.sent:]
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(unsent)), longest, -1):
                if unsent.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _send_up_to(self, end: int) -> str:
        out = self.text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out
