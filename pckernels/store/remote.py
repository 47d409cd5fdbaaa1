"""The remote tier: encoded blocks shared by a fleet of processes through Redis or Valkey.

Layout under ``namespace`` (default ``promptcache``), for a block of key digest ``d``:

* ``{ns}:kv:{d}`` — the block's metadata, JSON: format, key, dtype, shape, byte count, chunk
  size, sha256 of the bytes, the writer's id and the descriptive fields of the key;
* ``{ns}:kv:{d}:{writer}:{i}`` — chunk ``i`` of the block's bytes (``chunk_bytes`` each but the
  last; Redis values stop at 512 MB, a 4K-token module of a 7B model is ~2 GB).

Writes are idempotent and never on a request's critical path: a background thread uploads the
chunks with pipelines, then sets the metadata with ``SET NX`` — the first complete copy wins, a
writer that loses the race deletes its own chunks, so two processes writing the same key leave
one copy. A reader checks the metadata against the key (format, digest, shape, dtype), that every
chunk is there and has its length, then the sha256. A value that fails is deleted and reported as
a miss: the engine encodes the block again (and writes it back).

Encoding leases keep a fleet from encoding one block many times at once: before encoding, a
process claims the block (``SET NX PX`` on ``{ns}:lease:{d}``); the others ``wait_for`` its
upload instead, and encode it themselves if the lease goes away without one (the holder failed
or died: the lease expires after ``lease_s``). The writer releases the lease after the upload.

Faults degrade to the local tiers: a connection error or timeout puts the tier in back-off (no
remote calls for 0.25 s, doubling to 30 s) with one warning, then a single call probes it again;
"OOM" refusals (a full server without eviction) drop that write. Eviction is left to the server
(``maxmemory-policy allkeys-lru``): a block whose chunk was evicted is found incomplete and
deleted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import torch

from pckernels.store.blocks import DTYPE_NAMES, DTYPES, BlockFileError, TierStats, check_expected, tensor_bytes
from pckernels.store.keys import FORMAT_VERSION, BlockKey

log = logging.getLogger(__name__)

REMOTE_FORMAT = f"promptcache-remote/{FORMAT_VERSION}"
DEFAULT_NAMESPACE = "promptcache"
DEFAULT_CHUNK_BYTES = 32 << 20
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_CONNECT_TIMEOUT_S = 0.5
DEFAULT_MAX_PENDING_BYTES = 1 << 30
BACKOFF_S = (0.25, 30.0)
DEFAULT_LEASE_S = 120.0
"""How long an encoding lease lasts if its holder never releases it (crashed mid-encode)."""
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
PIPELINE_BYTES = 64 << 20
"""Bytes of chunks fetched or sent per pipeline round trip (bounds the memory in flight)."""

SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys")


def parse_remote_url(url: str) -> str:
    """Check a remote URL (``redis://[:password@]host:port/db``, ``rediss://``, ``unix://``, or the
    ``valkey://`` / ``valkeys://`` spellings) and return it in the form redis-py reads; a
    ``ValueError`` saying what is wrong otherwise."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"remote must be a URL such as redis://127.0.0.1:6379/0, got {url!r}")
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"remote URL scheme must be one of {', '.join(SCHEMES)}, got {url!r}")
    if scheme != "unix":
        if not parts.hostname:
            raise ValueError(f"remote URL has no host: {url!r}")
        try:
            parts.port
        except ValueError:
            raise ValueError(f"remote URL has a bad port: {url!r}") from None
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"remote URL database must be a number, got {db!r} in {url!r}")
    scheme = {"valkey": "redis", "valkeys": "rediss"}.get(scheme, scheme)
    return urlunsplit((scheme, parts.netloc, parts.path, parts.query, parts.fragment))


def redact(url: str) -> str:
    """``url`` without its password (for logs, stats and metrics)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + netloc, parts.path, parts.query, parts.fragment))


@dataclass
class RemoteStats(TierStats):
    misses: int = 0
    bytes_read: int = 0
    read_s: float = 0.0
    bytes_written: int = 0
    present: int = 0
    """Writes skipped because the server already held the block (another process wrote it)."""
    lost_races: int = 0
    """Complete uploads that found another copy set meanwhile (their chunks were deleted)."""
    dropped_writes: int = 0
    """Writes not made: the write queue was full, the server was unreachable or refused (full)."""
    errors: int = 0
    """Connection errors and timeouts."""
    reconnects: int = 0


class RemoteTier:
    """Blocks in a Redis/Valkey server shared by many processes (see the module docstring).

    ``url``: the server (:func:`parse_remote_url`); ``namespace``: prefix of every key (separate
    fleets or deployments on one server); ``chunk_bytes``: size of the value chunks;
    ``timeout_s`` / ``connect_timeout_s``: per socket operation; ``max_pending_bytes``: bytes of
    blocks waiting for the background writer before further writes are dropped; ``backoff_s``:
    the first and the longest pause after a fault (doubling in between); ``lease_s``: lifetime of an
    encoding lease nobody releases. ``client``: a
    ready ``redis.Redis`` (tests); otherwise one is made from ``url`` (hiredis parses replies where
    installed). Thread-safe: reads may come from any thread; writes go through one writer thread.
    """

    def __init__(self, url: str, *, namespace: str = DEFAULT_NAMESPACE, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 timeout_s: float = DEFAULT_TIMEOUT_S, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES, backoff_s: tuple[float, float] = BACKOFF_S,
                 lease_s: float = DEFAULT_LEASE_S, client=None) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = parse_remote_url(url)
        if not namespace or any(c.isspace() for c in namespace):
            raise ValueError(f"remote namespace must be a non-empty word, got {namespace!r}")
        if int(chunk_bytes) < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes!r}")
        self.namespace = namespace
        self.chunk_bytes = int(chunk_bytes)
        self.max_pending_bytes = int(max_pending_bytes)
        self.backoff_s = (float(backoff_s[0]), float(backoff_s[1]))
        self.lease_s = float(lease_s)
        self._leases: dict[str, str] = {}
        """digest -> token of the encoding leases this process holds."""
        self._redis = redis
        self.client = client if client is not None else redis.Redis.from_url(
            self.url, socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0)
        self.stats = RemoteStats()
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = 0.0
        self._down_reason: str | None = None
        self._warned_full = False
        self._queue: queue.Queue = queue.Queue()
        self._pending_bytes = 0
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="promptcache-remote-writer", daemon=True)
        self._writer.start()

    # -- keys --------------------------------------------------------------------------------

    def meta_key(self, digest: str) -> str:
        return f"{self.namespace}:kv:{digest}"

    def chunk_key(self, digest: str, writer: str, index: int) -> str:
        return f"{self.namespace}:kv:{digest}:{writer}:{index}"

    def lease_key(self, digest: str) -> str:
        return f"{self.namespace}:lease:{digest}"

    # -- encoding leases -----------------------------------------------------------------------

    def claim(self, key: BlockKey) -> bool:
        """Whether this process should encode ``key``: ``True`` when it took the lease (released after
        its upload) or the server cannot be asked; ``False`` while another process holds it."""
        token = uuid.uuid4().hex
        try:
            taken = self._call("claiming a block", lambda: self.client.set(
                self.lease_key(key.digest), token, nx=True, px=max(1, int(self.lease_s * 1000))), True)
        except self._redis.RedisError as exc:
            log.debug("cannot take the lease of %s (%s); encoding without one", key.digest[:16], exc)
            return True
        if taken:
            with self._lock:
                self._leases[key.digest] = token
            return True
        return False

    def wait_for(self, key: BlockKey, timeout_s: float | None = None, poll_s: float = 0.05) -> bool:
        """Wait for another process's upload of ``key``: ``True`` once the server holds it, ``False``
        when the lease is gone without it (or ``timeout_s``, default ``lease_s``, passed, or the
        server faults) — then encode it here."""
        deadline = time.monotonic() + (self.lease_s if timeout_s is None else timeout_s)
        while time.monotonic() < deadline:
            try:
                state = self._call("waiting for a block", lambda: self.client.pipeline(transaction=False).exists(
                    self.meta_key(key.digest)).exists(self.lease_key(key.digest)).execute())
            except self._redis.RedisError:
                return False
            if state is None:
                return False
            if state[0]:
                return True
            if not state[1]:
                return bool(self.contains(key))
            time.sleep(poll_s)
        return False

    def release(self, key: BlockKey) -> None:
        """Give up this process's lease on ``key`` (if it holds one)."""
        with self._lock:
            token = self._leases.pop(key.digest, None)
        if token is not None:
            try:
                self._call("releasing a lease", lambda: self.client.eval(_RELEASE, 1, self.lease_key(key.digest), token))
            except self._redis.RedisError as exc:
                log.debug("cannot release the lease of %s: %s", key.digest[:16], exc)

    # -- health ------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Whether a call may go to the server now (not in back-off after a fault)."""
        return time.monotonic() >= self._down_until

    @property
    def down_reason(self) -> str | None:
        """Why the server is considered down (``None`` while it answers)."""
        return self._down_reason

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

    def _call(self, doing: str, fn: Callable, default=None):
        """``fn()`` unless in back-off; a connection fault or timeout starts the back-off and gives ``default``."""
        if not self.available:
            return default
        try:
            out = fn()
        except (self._redis.ConnectionError, self._redis.TimeoutError) as exc:
            self._fault(exc, doing)
            return default
        self._answered()
        return out

    # -- reads -------------------------------------------------------------------------------

    def contains(self, key: BlockKey) -> bool:
        """Whether the server holds metadata for ``key`` (its chunks are checked on read)."""
        return bool(self._call("looking up a block", lambda: self.client.exists(self.meta_key(key.digest)), 0))

    def read(self, key: BlockKey, *, pin: bool = False) -> torch.Tensor | None:
        """The verified block ``[L, 2, H, n, D]`` in CPU memory (pinned when ``pin``), or ``None`` when
        the server lacks it, cannot be reached, or holds an unusable value (then deleted)."""
        t0 = time.perf_counter()
        try:
            block = self._call("reading a block", lambda: self._read(key, pin))
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

    def _read(self, key: BlockKey, pin: bool) -> torch.Tensor | None:
        raw = self.client.get(self.meta_key(key.digest))
        if raw is None:
            return None
        meta = self._parse_meta(raw, key)
        try:
            return self._read_chunks(key, meta, pin)
        except BlockFileError as exc:
            exc.names = [self.chunk_key(key.digest, meta["writer"], i) for i in range(meta["chunks"])]
            raise

    def _read_chunks(self, key: BlockKey, meta: dict, pin: bool) -> torch.Tensor:
        shape, dtype, nbytes, writer = meta["shape"], DTYPES[meta["dtype"]], meta["nbytes"], meta["writer"]
        check_expected(shape, dtype, key.shape, key.dtype)
        tensor = torch.empty(shape, dtype=dtype, pin_memory=pin)
        view = tensor_bytes(tensor)
        if view.nbytes != nbytes:
            raise BlockFileError("corrupt metadata (shape and size disagree)")
        digest = hashlib.sha256()
        chunk = meta["chunk_bytes"]
        count = meta["chunks"]
        per_round = max(1, PIPELINE_BYTES // chunk)
        offset = 0
        for first in range(0, count, per_round):
            pipe = self.client.pipeline(transaction=False)
            for index in range(first, min(first + per_round, count)):
                pipe.get(self.chunk_key(key.digest, writer, index))
            for value in pipe.execute():
                want = min(chunk, nbytes - offset)
                if value is None:
                    raise BlockFileError("incomplete (a chunk is missing, evicted by the server?)")
                if len(value) != want:
                    raise BlockFileError(f"truncated chunk ({len(value)} bytes, expected {want})")
                view[offset:offset + want] = np.frombuffer(value, dtype=np.uint8)
                digest.update(value)
                offset += want
        if digest.hexdigest() != meta["sha256"]:
            raise BlockFileError("checksum mismatch")
        return tensor

    def _parse_meta(self, raw: bytes, key: BlockKey) -> dict:
        try:
            meta = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise BlockFileError("foreign value (not block metadata)") from None
        if not isinstance(meta, dict) or meta.get("format") != REMOTE_FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
            raise BlockFileError(f"foreign value (format {found!r})")
        if meta.get("key") != key.digest:
            raise BlockFileError(f"foreign value (holds key {str(meta.get('key'))[:16]}…)")
        try:
            shape = [int(d) for d in meta["shape"]]
            nbytes, chunk, count = int(meta["nbytes"]), int(meta["chunk_bytes"]), int(meta["chunks"])
            writer, checksum = str(meta["writer"]), str(meta["sha256"])
            dtype_name = str(meta["dtype"])
        except (KeyError, TypeError, ValueError) as exc:
            raise BlockFileError(f"corrupt metadata ({exc!r})") from None
        if dtype_name not in DTYPES or chunk < 1 or count != math.ceil(nbytes / chunk) or min(shape, default=0) < 0:
            raise BlockFileError("corrupt metadata")
        return {"shape": shape, "dtype": dtype_name, "nbytes": nbytes, "chunk_bytes": chunk, "chunks": count,
                "writer": writer, "sha256": checksum}

    def _discard(self, key: BlockKey, reason: str, chunks: list[str] = ()) -> None:
        log.warning("discarding remote block %s (%s): %s; it will be encoded again", key.label or "",
                    key.digest[:16], reason)
        with self._lock:
            self.stats.discard(reason)
        try:
            self._call("deleting a bad block", lambda: self.client.delete(self.meta_key(key.digest), *chunks))
        except self._redis.RedisError as exc:
            log.warning("cannot delete remote block %s: %s", key.digest[:16], exc)

    # -- writes ------------------------------------------------------------------------------

    def write_behind(self, key: BlockKey, block: torch.Tensor | Callable[[], torch.Tensor], nbytes: int) -> bool:
        """Queue ``block`` (a tensor, or a function making the CPU tensor in the writer thread) for
        upload unless the server already has it; returns whether it was queued. Never waits on the
        server. ``nbytes``: the block's size, for the pending-bytes bound."""
        with self._lock:
            refused = bool(self._closed or not self.available or (
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

    def pending_bytes(self) -> int:
        return self._pending_bytes

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            key, block, nbytes = item
            try:
                self._write(key, block)
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

    def _write(self, key: BlockKey, block) -> None:
        present = self._call("checking a block", lambda: self.client.exists(self.meta_key(key.digest)))
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
            outcome = self._call("writing a block", lambda: self._upload(key, tensor))
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

    def _upload(self, key: BlockKey, tensor: torch.Tensor) -> bool:
        """Chunks, then the metadata with ``SET NX``; returns whether this copy is the one kept."""
        data = tensor_bytes(tensor) if tensor.numel() else np.zeros(0, dtype=np.uint8)
        nbytes = data.nbytes
        writer = uuid.uuid4().hex[:12]
        chunk = self.chunk_bytes
        count = math.ceil(nbytes / chunk)
        names = [self.chunk_key(key.digest, writer, i) for i in range(count)]
        checksum = hashlib.sha256(data).hexdigest()
        try:
            per_round = max(1, PIPELINE_BYTES // chunk)
            for first in range(0, count, per_round):
                pipe = self.client.pipeline(transaction=False)
                for index in range(first, min(first + per_round, count)):
                    pipe.set(names[index], memoryview(data[index * chunk:(index + 1) * chunk]))
                pipe.execute()
            meta = {"format": REMOTE_FORMAT, "key": key.digest, "dtype": DTYPE_NAMES[tensor.dtype],
                    "shape": list(tensor.shape), "nbytes": nbytes, "chunk_bytes": chunk, "chunks": count,
                    "writer": writer, "sha256": checksum, **key.describe()}
            kept = bool(self.client.set(self.meta_key(key.digest), json.dumps(meta), nx=True))
        except BaseException:
            self._forget_chunks(names)
            raise
        if not kept:
            self._forget_chunks(names)
        return kept

    def _forget_chunks(self, names: list[str]) -> None:
        if not names:
            return
        try:
            self.client.delete(*names)
        except self._redis.RedisError:
            pass

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
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not self.flush(timeout_s):
            log.warning("remote tier: %d bytes of queued writes not sent at close", self._pending_bytes)
        self._queue.put(None)
        self._writer.join(timeout=1.0)
        try:
            self.client.close()
        except Exception:
            log.debug("closing the remote client failed", exc_info=True)

    def describe(self) -> dict:
        """Counters and state for ``TieredStore.stats()``."""
        with self._lock:
            s = self.stats
            return {"url": redact(self.url), "namespace": self.namespace, "up": self._down_reason is None,
                    "down_reason": self._down_reason, "hits": s.hits, "misses": s.misses,
                    "bytes_read": s.bytes_read, "read_s": s.read_s, "writes": s.writes,
                    "bytes_written": s.bytes_written, "write_s": s.write_s, "present": s.present,
                    "lost_races": s.lost_races, "dropped_writes": s.dropped_writes, "errors": s.errors,
                    "reconnects": s.reconnects, "discarded": s.discarded, "discard_reasons": dict(s.reasons),
                    "pending_bytes": self._pending_bytes, "chunk_bytes": self.chunk_bytes}
