"""``RemoteTier``: the remote tier's reads, writes and state, over its wire format, leases, health
and write queue.

A read checks the value (``wire.py``); one that fails is deleted and reported as a miss: the
engine encodes the block again (and writes it back). Writes go through the write-behind queue
(``writer.py``) and skip blocks the server already holds. "OOM" refusals (a full server without
eviction) drop that write, with one warning.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from pckernels.store.blocks import BlockFileError
from pckernels.store.keys import BlockKey
from pckernels.store.remote.connect import Connector
from pckernels.store.remote.health import Health
from pckernels.store.remote.leases import Leases
from pckernels.store.remote.stats import RemoteStats
from pckernels.store.remote.url import parse_remote_url, redact
from pckernels.store.remote.wire import Wire
from pckernels.store.remote.writer import Block, WriteQueue

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "promptcache"
DEFAULT_CHUNK_BYTES = 32 << 20
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_CONNECT_TIMEOUT_S = 0.5
DEFAULT_MAX_PENDING_BYTES = 1 << 30
BACKOFF_S = (0.25, 30.0)
DEFAULT_LEASE_S = 120.0
"""How long an encoding lease lasts if its holder never releases it (crashed mid-encode)."""


class RemoteTier:
    """Blocks in a Redis/Valkey server shared by many processes (see ``pckernels.store.remote``).

    ``url``: the server (:func:`parse_remote_url`); ``namespace``: prefix of every key (separate
    fleets or deployments on one server); ``chunk_bytes``: size of the value chunks;
    ``timeout_s`` / ``connect_timeout_s``: per socket operation; ``max_pending_bytes``: bytes of
    blocks waiting for the background writer before further writes are dropped; ``backoff_s``:
    the first and the longest pause after a fault (doubling in between); ``lease_s``: lifetime of an
    encoding lease nobody releases. ``client``: a ready ``redis.Redis`` or
    ``redis.cluster.RedisCluster`` (tests); otherwise one is made from ``url`` on first use
    (``connect.py``: a cluster URL, or a node of a cluster detected; hiredis parses replies where
    installed). Thread-safe: reads may come from any thread; writes go through one writer thread.
    """

    def __init__(self, url: str, *, namespace: str = DEFAULT_NAMESPACE, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 timeout_s: float = DEFAULT_TIMEOUT_S, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES, backoff_s: tuple[float, float] = BACKOFF_S,
                 lease_s: float = DEFAULT_LEASE_S, client=None) -> None:
        import redis

        self.url = parse_remote_url(url)
        if not namespace or any(c.isspace() for c in namespace):
            raise ValueError(f"remote namespace must be a non-empty word, got {namespace!r}")
        if int(chunk_bytes) < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes!r}")
        self.namespace = namespace
        self.chunk_bytes = int(chunk_bytes)
        self._redis = redis
        self.connector = Connector(self.url, timeout_s, connect_timeout_s, client)
        self.stats = RemoteStats()
        self._lock = threading.Lock()
        """Guards ``stats`` (shared with the health and the write queue)."""
        self._warned_full = False
        self.wire = Wire(self.connector, namespace, self.chunk_bytes)
        self.health = Health(self.url, backoff_s, self.stats, self._lock, self.connector)
        self.leases = Leases(self.wire, self.health, lease_s, self.contains)
        self.writes = WriteQueue(self._write, self.leases.release,
                                 lambda key: self.health.available_for(self.meta_key(key.digest)), self.stats,
                                 self._lock, max_pending_bytes)

    @property
    def client(self):
        """The ``redis.Redis`` (one server) or ``redis.cluster.RedisCluster``, connected on first use
        (``redis.ConnectionError`` when it cannot be now)."""
        return self.connector.client

    @property
    def cluster(self) -> bool:
        """Whether the server is a cluster (known from the first connection on)."""
        return self.connector.cluster

    def meta_key(self, digest: str) -> str:
        return self.wire.meta_key(digest)

    def chunk_key(self, digest: str, writer: str, index: int) -> str:
        return self.wire.chunk_key(digest, writer, index)

    def lease_key(self, digest: str) -> str:
        return self.wire.lease_key(digest)

    # -- encoding leases and health (leases.py, health.py) -------------------------------------

    def claim(self, key: BlockKey) -> bool:
        """Whether this process should encode ``key`` (:meth:`Leases.claim`)."""
        return self.leases.claim(key)

    def wait_for(self, key: BlockKey, timeout_s: float | None = None, poll_s: float = 0.05) -> bool:
        """Wait for another process's upload of ``key``; whether the server now holds it (:meth:`Leases.wait_for`)."""
        return self.leases.wait_for(key, timeout_s, poll_s)

    def release(self, key: BlockKey) -> None:
        """Give up this process's lease on ``key`` (if it holds one)."""
        self.leases.release(key)

    @property
    def available(self) -> bool:
        """Whether a call may go to the server now (not in back-off after a fault)."""
        return self.health.available

    @property
    def down_reason(self) -> str | None:
        """Why the server is considered down (``None`` while it answers)."""
        return self.health.down_reason

    # -- reads -------------------------------------------------------------------------------

    def contains(self, key: BlockKey) -> bool:
        """Whether the server holds metadata for ``key`` (its chunks are checked on read)."""
        try:
            return bool(self.health.call("looking up a block", lambda: self.client.exists(self.meta_key(key.digest)),
                                         0, key=self.meta_key(key.digest)))
        except self._redis.RedisError as exc:
            log.warning("remote lookup of block %s failed: %s", key.label, exc)
            return False

    def read(self, key: BlockKey, *, pin: bool = False) -> torch.Tensor | None:
        """The verified block ``[L, 2, H, n, D]`` in CPU memory (pinned when ``pin``), or ``None`` when
        the server lacks it, cannot be reached, or holds an unusable value (then deleted)."""
        t0 = time.perf_counter()
        try:
            block = self.health.call("reading a block", lambda: self.wire.read(key, pin), key=self.meta_key(key.digest))
        except BlockFileError as exc:
            self._discard(key, str(exc), getattr(exc, "names", []))
            block = None
        except self._redis.RedisError as exc:
            if "WRONGTYPE" in str(exc):
                self._discard(key, "foreign value (not a string)")
            else:
                log.warning("remote read of block %s failed: %s", key.label, exc)
            block = None
        with self._lock:
            if block is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                self.stats.bytes_read += block.numel() * block.element_size()
                self.stats.read_s += time.perf_counter() - t0
        return block

    def _discard(self, key: BlockKey, reason: str, chunks: list[str] = ()) -> None:
        log.warning("discarding remote block %s (%s): %s; it will be encoded again", key.label or "",
                    key.digest[:16], reason)
        with self._lock:
            self.stats.discard(reason)
        try:
            self.health.call("deleting a bad block", lambda: self.client.delete(self.meta_key(key.digest), *chunks),
                             key=self.meta_key(key.digest))
        except self._redis.RedisError as exc:
            log.warning("cannot delete remote block %s: %s", key.digest[:16], exc)

    # -- writes ------------------------------------------------------------------------------

    def write_behind(self, key: BlockKey, block: Block, nbytes: int) -> bool:
        """Queue ``block`` (a tensor, or a function making the CPU tensor in the writer thread) for
        upload unless the server already has it; returns whether it was queued. Never waits on the
        server. ``nbytes``: the block's size, for the pending-bytes bound."""
        return self.writes.put(key, block, nbytes)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write is done (or ``timeout_s`` passed); returns whether all are."""
        return self.writes.flush(timeout_s)

    def pending_bytes(self) -> int:
        return self.writes.pending_bytes

    def _write(self, key: BlockKey, block: Block) -> None:
        """Upload ``block`` unless the server holds ``key`` (the write queue's thread)."""
        name = self.meta_key(key.digest)
        present = self.health.call("checking a block", lambda: self.client.exists(self.meta_key(key.digest)),
                                   key=name)
        if present is None:
            with self._lock:
                self.stats.dropped_writes += 1
            return
        if present:
            with self._lock:
                self.stats.present += 1
            return
        tensor = block() if callable(block) else block
        tensor = tensor.detach().to("cpu").contiguous()
        t0 = time.perf_counter()
        try:
            outcome = self.health.call("writing a block", lambda: self.wire.upload(key, tensor), key=name)
        except self._redis.ResponseError as exc:
            self._refused(key, exc)
            return
        with self._lock:
            if outcome is None:
                self.stats.dropped_writes += 1
            elif outcome:
                self.stats.writes += 1
                self.stats.bytes_written += tensor.numel() * tensor.element_size()
                self.stats.write_s += time.perf_counter() - t0
            else:
                self.stats.lost_races += 1

    def _refused(self, key: BlockKey, exc: Exception) -> None:
        """A write the server refused (``OOM``: full and not evicting; read-only replica; …)."""
        with self._lock:
            self.stats.dropped_writes += 1
            first = not self._warned_full
            self._warned_full = True
        if first:
            log.warning("remote tier %s refused a write (%s); blocks stay local. Give the server room or "
                        "set maxmemory-policy allkeys-lru", redact(self.url), exc)

    # -- lifecycle and inspection --------------------------------------------------------------

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish queued writes (for at most ``timeout_s``), stop the writer and close connections."""
        if not self.writes.close(timeout_s):
            return
        try:
            self.connector.close()
        except Exception:
            log.debug("closing the remote client failed", exc_info=True)

    def describe(self) -> dict:
        """Counters and state for ``TieredStore.stats()``."""
        down_reason = self.health.down_reason
        cluster = self._describe_cluster()
        with self._lock:
            s = self.stats
            return {"url": redact(self.url), "namespace": self.namespace, "up": down_reason is None,
                    "down_reason": down_reason, "hits": s.hits, "misses": s.misses,
                    "bytes_read": s.bytes_read, "read_s": s.read_s, "writes": s.writes,
                    "bytes_written": s.bytes_written, "write_s": s.write_s, "present": s.present,
                    "lost_races": s.lost_races, "dropped_writes": s.dropped_writes, "errors": s.errors,
                    "reconnects": s.reconnects, "discarded": s.discarded, "discard_reasons": dict(s.reasons),
                    "pending_bytes": self.writes.pending_bytes, "chunk_bytes": self.chunk_bytes,
                    "cluster": cluster}

    def _describe_cluster(self) -> dict | None:
        """``None`` for one server (or before the first connection); for a cluster its masters as the
        client knows them, those in back-off, and the faults counted per master."""
        if not self.connector.cluster:
            return None
        nodes_down = self.health.nodes_down()
        with self._lock:
            node_errors = dict(self.stats.node_errors)
        return {"nodes": self.connector.nodes(), "nodes_down": nodes_down, "node_errors": node_errors}
