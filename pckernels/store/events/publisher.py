"""The ZeroMQ publisher of KV events: its own thread, a bounded queue, a replay buffer.

:class:`KVEventPublisher` binds (or connects) its sockets when made — an endpoint in use is a
:class:`KVEventsBindError` there and then — and runs one thread that takes the events its
:class:`~pckernels.store.events.ledger.BlockLedger` collected, sends each batch as three frames
(topic, sequence number as 8 bytes big-endian, msgpack payload: ``wire.py``) and keeps the last
``buffer_steps`` batches for replay. Nothing the server does waits for it: the store's threads only
append to the ledger's bounded list, and the PUB socket drops, per subscriber, what a subscriber
that does not read leaves past ``hwm`` (that subscriber sees a gap in the sequence and asks the
replay socket).

Replay (vLLM's protocol): a client sends ``[b"", start_seq]`` (a REQ socket's framing; 8 bytes
big-endian) to the ROUTER ``replay_endpoint``; the publisher answers ``[b"", seq, payload]`` for
each buffered batch from ``start_seq`` on, then ``[b"", -1 as 8 signed bytes, b""]``.

The PUB socket is an XPUB, which looks the same to subscribers and tells the publisher who
subscribes: ``stats()["subscribers"]`` counts live subscriptions.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import msgspec
import zmq

from pckernels.store.events.config import KVEventsConfig
from pckernels.store.events.ledger import BlockLedger
from pckernels.store.events.wire import KVEventBatch, batch_events

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame that ends a replay."""
WAKE_S = 0.02
"""How long the thread sleeps between looks at its sockets when no event wakes it."""


class KVEventsBindError(OSError):
    """An endpoint of ``--kv-events-config`` could not be bound or connected (in use, no permission)."""


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, IPv6 or local endpoint, connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Publishes the events of :attr:`ledger` as ``config`` says (module docstring).
    ``data_parallel_rank``: the batches' rank field (vLLM's; one publisher per process here)."""

    def __init__(self, config: KVEventsConfig, *, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.rank = data_parallel_rank
        self._wake = threading.Event()
        self.ledger = BlockLedger(config.max_queue_size, notify=self._wake.set)
        self._topic = config.topic.encode()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._replay = None
        try:
            self._pub = self._socket(zmq.XPUB, config.endpoint, "endpoint")
            if config.replay_endpoint is not None:
                self._replay = self._socket(zmq.ROUTER, config.replay_endpoint, "replay_endpoint", bind=True)
        except BaseException:
            self._close_sockets()
            raise
        self._seq = 0
        self.batches = 0
        self.sent_events = 0
        self.send_errors = 0
        self.replays = 0
        self.subscribers = 0
        self._running = True
        self._loops = 0
        self.ledger.cleared()
        self._thread = threading.Thread(target=self._run, name="promptcache-kv-events", daemon=True)
        self._thread.start()
        log.info("publishing KV events on %s%s", config.endpoint,
                 f" (replay on {config.replay_endpoint})" if config.replay_endpoint else "")

    def _socket(self, kind: int, endpoint: str, field: str, *, bind: bool | None = None):
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.XPUB:
            sock.setsockopt(zmq.SNDHWM, self.config.hwm)
            sock.setsockopt(zmq.XPUB_VERBOSER, 1)
        try:
            if (binds(endpoint) if bind is None else bind):
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise KVEventsBindError(f"--kv-events-config field {field!r}: cannot use {endpoint}: {exc}") from None
        return sock

    # -- the thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while self._running:
            self._wake.wait(WAKE_S)
            self._wake.clear()
            try:
                self._service()
                events = self.ledger.drain()
                if events:
                    self._send(encoder, events)
            except Exception:  # a publisher fault must never reach the store's threads
                log.exception("KV event publisher")
                time.sleep(0.1)
            self._loops += 1
        try:
            events = self.ledger.drain()
            if events:
                self._send(encoder, events)
        except Exception:
            log.exception("KV event publisher (last batch)")

    def _send(self, encoder, ledger_events: list[tuple]) -> None:
        wire = batch_events(ledger_events)
        payload = encoder.encode(KVEventBatch(ts=time.time(), events=wire, data_parallel_rank=self.rank))
        seq = self._seq
        self._seq += 1
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.send_errors += 1
        self._buffer.append((seq, payload))
        self.batches += 1
        self.sent_events += len(wire)

    def _service(self) -> None:
        """Answer waiting replay requests and count (un)subscriptions."""
        while self._pub.poll(0, zmq.POLLIN):
            message = self._pub.recv()
            if message[:1] == b"\x01":
                self.subscribers += 1
            elif message[:1] == b"\x00":
                self.subscribers = max(0, self.subscribers - 1)
        while self._replay is not None and self._replay.poll(0, zmq.POLLIN):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignoring a malformed KV-event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            self.replays += 1
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))

    # -- the server's side ---------------------------------------------------------------------------

    def stats(self) -> dict:
        """``published`` events and ``batches`` sent, ``dropped`` events (queue full; a resync
        followed), ``subscribers`` (live subscriptions), ``replays`` answered, and the ledger's."""
        ledger = self.ledger.stats()
        return {"published": self.sent_events, "batches": self.batches, "dropped": ledger["dropped"],
                "resyncs": ledger["resyncs"], "pending": ledger["pending"], "subscribers": self.subscribers,
                "replays": self.replays, "send_errors": self.send_errors, "held": ledger["held"],
                "unknown": ledger["unknown"], "endpoint": self.config.endpoint}

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every event added so far is sent (tests, shutdown); whether it was in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = self.ledger.stats()
            if stats["pending"] == 0 and not self.ledger.resync_due:
                loops = self._loops
                while self._loops < loops + 2 and time.monotonic() < deadline and self._thread.is_alive():
                    self._wake.set()
                    time.sleep(0.002)
                return self._loops >= loops + 2
            self._wake.set()
            time.sleep(0.002)
        return False

    def close(self) -> None:
        """Send what is waiting, stop the thread, close the sockets (no linger)."""
        if not self._running:
            return
        self._running = False
        self._wake.set()
        self._thread.join(timeout=2.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(0)
        self._ctx.term()
