"""Whether the remote server answers: a fault costs the local tiers a miss, never a failed request.

A connection error or timeout puts the tier in back-off (no remote calls for ``backoff_s[0]``,
0.25 s by default, doubling up to ``backoff_s[1]``, 30 s) with one warning; after it a single
call probes the server again, and the first answer ends the back-off.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from pckernels.store.remote.stats import RemoteStats
from pckernels.store.remote.url import redact

log = logging.getLogger(__name__)


class Health:
    """The back-off state of the server at ``url``; every server call goes through :meth:`call`.
    Faults and reconnects are counted in ``stats`` under ``lock`` (the tier's)."""

    def __init__(self, url: str, backoff_s: tuple[float, float], stats: RemoteStats, lock: threading.Lock) -> None:
        import redis

        self.url = url
        self.backoff_s = (float(backoff_s[0]), float(backoff_s[1]))
        self.stats = stats
        self._lock = lock
        self._faults = (redis.ConnectionError, redis.TimeoutError)
        self._down_until = 0.0
        self._backoff = 0.0
        self._down_reason: str | None = None

    @property
    def available(self) -> bool:
        """Whether a call may go to the server now (not in back-off after a fault)."""
        return time.monotonic() >= self._down_until

    @property
    def down_reason(self) -> str | None:
        """Why the server is considered down (``None`` while it answers)."""
        return self._down_reason

    def call(self, doing: str, fn: Callable, default=None):
        """``fn()`` unless in back-off; a connection fault or timeout starts the back-off and gives ``default``."""
        if not self.available:
            return default
        try:
            out = fn()
        except self._faults as exc:
            self._fault(exc, doing)
            return default
        self._answered()
        return out

    def _fault(self, exc: Exception, doing: str) -> None:
        with self._lock:
            self.stats.errors += 1
            first_s, max_s = self.backoff_s
            self._backoff = first_s if self._down_reason is None else min(self._backoff * 2, max_s)
            self._down_until = time.monotonic() + self._backoff
            first = self._down_reason is None
            self._down_reason = f"{type(exc).__name__}: {exc}"
        if first:
            log.warning("remote tier %s unreachable while %s (%s); serving from local tiers and retrying "
                        "with back-off", redact(self.url), doing, self._down_reason)

    def _answered(self) -> None:
        if self._down_reason is None:
            return
        with self._lock:
            if self._down_reason is None:
                return
            self._down_reason = None
            self._backoff = 0.0
            self._down_until = 0.0
            self.stats.reconnects += 1
        log.warning("remote tier %s answers again", redact(self.url))
