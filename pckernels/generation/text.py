"""Streaming text that is always a prefix of the final answer.

:class:`TextStream` turns a growing list of token ids into text deltas: it holds back the last
``len(longest stop) - 1`` characters (a stop string may still be completing, and the final answer
is trimmed before it) and never emits half a UTF-8 character. Used by ``PromptCache.stream`` and
by the server's SSE responses.
"""

from __future__ import annotations


class TextStream:
    """Text deltas of a growing list of token ids; see the module docstring."""

    def __init__(self, tokenizer, stops: list[str], *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, tokens: list[int]) -> str:
        """The new text that is safe to send after ``tokens``."""
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        if text.endswith("\ufffd"):
            return ""
        cut = min((text.find(s) for s in self.stops if s in text), default=-1)
        if cut >= 0:
            safe = text[:cut]
        else:
            safe = text[:len(text) - self.hold] if self.hold else text
        return self._advance(safe)

    def finish(self, final_text: str) -> str:
        """What is left to send of ``final_text`` (the request's result)."""
        return self._advance(final_text)

    def _advance(self, safe: str) -> str:
        if len(safe) <= len(self.emitted) or not safe.startswith(self.emitted):
            return ""
        delta = safe[len(self.emitted):]
        self.emitted = safe
        return delta
