"""Waiting for a scheduler request from an event loop, and streaming its text safely.

The scheduler runs on its own thread; a :class:`Watcher` registers a listener on the request's
handle that wakes the loop (``call_soon_threadsafe``) after every token, so no thread is parked
per request. :class:`TextStream` turns token ids into text deltas that are always a prefix of
the final answer: it holds back the last ``len(longest stop) - 1`` characters (a stop string may
still be completing) and never emits half a UTF-8 character.
"""

from __future__ import annotations

import asyncio
import time

from pckernels.engine.request import RequestHandle


class Watcher:
    """Awaits the tokens of one :class:`RequestHandle` on ``loop``; records when each arrived."""

    def __init__(self, handle: RequestHandle, loop: asyncio.AbstractEventLoop) -> None:
        self.handle = handle
        self.loop = loop
        self.times: list[float] = []
        """``perf_counter()`` of each notification (one per token, then one at the end)."""
        self._event = asyncio.Event()
        handle.add_listener(self._poke)

    def _poke(self) -> None:
        self.times.append(time.perf_counter())
        try:
            self.loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:
            pass

    async def wait(self, timeout: float | None = None) -> None:
        """Until something happened (a token, the end) or ``timeout`` seconds passed."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except asyncio.TimeoutError:
            return
        self._event.clear()

    async def tokens(self, timeout: float | None = None) -> list[int] | None:
        """Tokens chosen since the last call, waiting up to ``timeout`` for one (``[]`` when none
        came); ``None`` once the request has ended and every token was taken."""
        tokens = self.handle.take()
        if tokens:
            return tokens
        if self.handle.done:
            return self.handle.take() or None
        await self.wait(timeout)
        tokens = self.handle.take()
        if not tokens and self.handle.done:
            return self.handle.take() or None
        return tokens

    def gaps(self, n_tokens: int) -> list[float]:
        """Seconds between consecutive tokens (of the first ``n_tokens`` notifications)."""
        stamps = self.times[:n_tokens]
        return [b - a for a, b in zip(stamps, stamps[1:])]


class TextStream:
    """Text deltas of a growing list of token ids; see the module docstring."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, tokens: list[int]) -> str:
        """The new text that is safe to send after ``tokens``."""
        self.ids.extend(tokens)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
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
