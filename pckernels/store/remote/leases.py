"""Encoding leases: one process of a fleet encodes a block while the others wait for its upload.

Before encoding, a process claims the block (``SET NX PX`` on ``{ns}:lease:{d}``); the others
``wait_for`` its upload instead, and encode it themselves if the lease goes away without one (the
holder failed or died: the lease expires after ``lease_s``). The writer releases the lease after
the upload.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Callable

from pckernels.store.keys import BlockKey
from pckernels.store.remote.health import Health
from pckernels.store.remote.wire import Wire

log = logging.getLogger(__name__)

_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class Leases:
    """The encoding leases this process takes on the server of ``wire`` (calls go through
    ``health``); ``contains(key)``: whether the server holds ``key``'s block. Thread-safe."""

    def __init__(self, wire: Wire, health: Health, lease_s: float, contains: Callable[[BlockKey], bool]) -> None:
        import redis

        self.wire = wire
        self.health = health
        self.lease_s = float(lease_s)
        self._contains = contains
        self._redis_error = redis.RedisError
        self._held: dict[str, str] = {}
        """digest -> token of the leases this process holds."""
        self._lock = threading.Lock()

    def claim(self, key: BlockKey) -> bool:
        """Whether this process should encode ``key``: ``True`` when it took the lease (released after
        its upload) or the server cannot be asked; ``False`` while another process holds it."""
        token = uuid.uuid4().hex
        try:
            taken = self.health.call("claiming a block", lambda: self.wire.client.set(
                self.wire.lease_key(key.digest), token, nx=True, px=max(1, int(self.lease_s * 1000))), True,
                key=self.wire.meta_key(key.digest))
        except self._redis_error as exc:
            log.debug("cannot take the lease of %s (%s); encoding without one", key.digest[:16], exc)
            return True
        if taken:
            with self._lock:
                self._held[key.digest] = token
            return True
        return False

    def wait_for(self, key: BlockKey, timeout_s: float | None = None, poll_s: float = 0.05) -> bool:
        """Wait for another process's upload of ``key``: ``True`` once the server holds it, ``False``
        when the lease is gone without it (or ``timeout_s``, default ``lease_s``, passed, or the
        server faults) — then encode it here."""
        deadline = time.monotonic() + (self.lease_s if timeout_s is None else timeout_s)
        while time.monotonic() < deadline:
            try:
                state = self.health.call("waiting for a block", lambda: self.wire.client.pipeline(
                    transaction=False).exists(self.wire.meta_key(key.digest)).exists(
                    self.wire.lease_key(key.digest)).execute(), key=self.wire.meta_key(key.digest))
            except self._redis_error:
                return False
            if state is None:
                return False
            if state[0]:
                return True
            if not state[1]:
                return bool(self._contains(key))
            time.sleep(poll_s)
        return False

    def release(self, key: BlockKey) -> None:
        """Give up this process's lease on ``key`` (if it holds one)."""
        with self._lock:
            token = self._held.pop(key.digest, None)
        if token is not None:
            try:
                self.health.call("releasing a lease", lambda: self.wire.client.eval(
                    _RELEASE, 1, self.wire.lease_key(key.digest), token), key=self.wire.meta_key(key.digest))
            except self._redis_error as exc:
                log.debug("cannot release the lease of %s: %s", key.digest[:16], exc)
