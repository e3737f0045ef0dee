"""Stop strings: the generated text is cut before the first stop string it contains.

`StopText` sits after the incremental detokeniser (`replicas.model.TextStream`). Text is pushed a
token at a time; it hands back the text that may be shown now. It holds back the longest tail that could
still grow into a stop string, so text already shown never holds the start of a stop string that a later
token completes, and it reports which token completed a stop: the request keeps the tokens up to and
including that one (as vLLM does), and its text ends just before the stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final


@final
class StopText:
    """The text of one generation, cut at its first stop string (see the module docstring).

    Invariant: `shown + held` is all the text pushed so far (until a stop is found, then `shown` is the
    text before it and nothing more is taken).
    """

    def __init__(self, stops: Sequence[str], *, min_tokens: int = 0) -> None:
        if any(not stop for stop in stops):
            raise ValueError("a stop string must not be empty")
        self._stops = tuple(stops)
        self._min_tokens = min_tokens
        self._tokens = 0
        self.shown = ""
        self._held = ""
        self.stopped_at: int | None = None  # tokens kept once a stop string was found

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    def push(self, text: str) -> str:
        """Take the text one more token completed; returns the text that may be shown now ("" once
        stopped). Stop strings match only from the `min_tokens`-th token on, as vLLM matches them."""
        if self.stopped_at is not None:
            return ""
        self._tokens += 1
        return self._take(text, final=False)

    def finish(self, tail: str = "") -> str:
        """The end of the text: `tail` (what the detokeniser held back) and whatever was held here, up to
        a stop string if they complete one."""
        if self.stopped_at is not None:
            return ""
        return self._take(tail, final=True)

    def _take(self, text: str, *, final: bool) -> str:
        held = self._held + text
        if self._tokens >= self._min_tokens:
            found = [at for at in (held.find(stop) for stop in self._stops) if at >= 0]
            if found:
                self.stopped_at = self._tokens
                out, self._held = held[: min(found)], ""
                self.shown += out
                return out
        keep = 0 if final else self._longest_stop_prefix(held)
        out, self._held = held[: len(held) - keep], held[len(held) - keep :]
        self.shown += out
        return out

    def _longest_stop_prefix(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:size]):
                    best = size
                    break
        return best
