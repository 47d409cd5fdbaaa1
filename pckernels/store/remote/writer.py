"""The remote tier's write-behind queue: uploads never wait on, or fail, a request.

``put`` queues a block (or a function making it) and returns at once; one writer thread works
through the queue. Bytes waiting are bounded by ``max_pending_bytes``: past it, while the server (on
a cluster: the master holding the block) is in back-off, or once closed, a write is dropped
(counted) and its encoding lease released.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

import torch

from pckernels.store.keys import BlockKey
from pckernels.store.remote.stats import RemoteStats

log = logging.getLogger(__name__)

Block = torch.Tensor | Callable[[], torch.Tensor]


class WriteQueue:
    """Blocks waiting for ``write(key, block)`` on the writer thread, which then calls ``release(key)``.
    ``ready(key)`` is false while the server (or the cluster master holding ``key``) is in back-off:
    such writes are refused; drops are counted in ``stats`` under ``lock`` (the tier's)."""

    def __init__(self, write: Callable[[BlockKey, Block], None], release: Callable[[BlockKey], None],
                 ready: Callable[[BlockKey], bool], stats: RemoteStats, lock: threading.Lock,
                 max_pending_bytes: int) -> None:
        self.write = write
        self.release = release
        self.ready = ready
        self.stats = stats
        self.max_pending_bytes = int(max_pending_bytes)
        self._lock = lock
        self._idle = threading.Condition(lock)
        self._queue: queue.Queue = queue.Queue()
        self._pending_bytes = 0
        self._inflight = 0
        self._closed = False
        self._writer = threading.Thread(target=self._loop, name="promptcache-remote-writer", daemon=True)
        self._writer.start()

    @property
    def pending_bytes(self) -> int:
        """Bytes of the blocks queued and not yet written."""
        return self._pending_bytes

    def put(self, key: BlockKey, block: Block, nbytes: int) -> bool:
        """Queue ``block`` (``nbytes``, for the bound) unless refused; returns whether it was queued."""
        ready = self.ready(key)
        with self._lock:
            refused = bool(self._closed or not ready or (
                self._pending_bytes + nbytes > self.max_pending_bytes and self._pending_bytes))
            if refused:
                self.stats.dropped_writes += 1
            else:
                self._pending_bytes += nbytes
                self._inflight += 1
        if refused:
            self.release(key)
            return False
        self._queue.put((key, block, nbytes))
        return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write is done (or ``timeout_s`` passed); returns whether all are."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._idle:
            while self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout_s: float) -> bool:
        """Refuse further writes, finish the queued ones (for at most ``timeout_s``) and stop the
        writer thread; ``False`` when it was closed already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        if not self.flush(timeout_s):
            log.warning("remote tier: %d bytes of queued writes not sent at close", self._pending_bytes)
        self._queue.put(None)
        self._writer.join(timeout=1.0)
        return True

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, block, nbytes = item
            try:
                self.write(key, block)
            except Exception:
                log.exception("remote write of block %s failed", key.label)
                with self._lock:
                    self.stats.dropped_writes += 1
            finally:
                self.release(key)
                with self._idle:
                    self._pending_bytes -= nbytes
                    self._inflight -= 1
                    self._idle.notify_all()
