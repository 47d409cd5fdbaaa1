"""Waiting for a scheduler request from an event loop, and streaming its text safely.

The scheduler runs on its own thread; a :class:`Watcher` registers a listener on the request's
handle that wakes the loop (``call_soon_threadsafe``) after every token, so no thread is parked
per request (text deltas come from :class:`pckernels.generation.text.TextStream`).
"""

from __future__ import annotations

import asyncio
import time

from pckernels.engine.request import RequestHandle
__all__ = ["Watcher"]


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
