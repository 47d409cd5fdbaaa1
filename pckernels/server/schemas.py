"""The server's schemas: uploaded PML parsed at once, encoded in the background, per tenant.

A schema lives in its tenant's namespace (the tenant's salt, so its blocks' keys differ from
every other tenant's) or, when an admin declares it *shared*, in the default namespace that every
tenant sees. Parsing happens in the request (bad PML is a 400 with line and column and changes
nothing); encoding runs on one background thread, module by module between the scheduler's steps,
and its progress is what ``GET /v1/schemas/{name}`` reports. A new version of a name keeps the old
one answering until it is encoded.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pckernels.pml.model import Schema
from pckernels.server.engine import ServingEngine

log = logging.getLogger(__name__)

ENCODING, READY, FAILED = "encoding", "ready", "failed"


@dataclass
class SchemaRecord:
    """What the server knows of one uploaded schema version."""

    name: str
    salt: str
    shared: bool
    owner: str
    digest: str
    modules: list[str]
    tokens: int
    status: str = ENCODING
    done: int = 0
    total: int = 0
    error: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    encode_s: float | None = None

    def to_dict(self) -> dict:
        return {"object": "schema", "id": self.name, "name": self.name, "status": self.status,
                "shared": self.shared, "owner": self.owner, "digest": self.digest, "created": self.created,
                "modules": self.modules, "tokens": self.tokens,
                "progress": {"done": self.done, "total": self.total}, "encode_s": self.encode_s,
                "error": self.error}


class SchemaRegistry:
    """Uploaded schemas of one engine by ``(salt, name)``; thread-safe."""

    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine
        self._records: dict[tuple[str, str], SchemaRecord] = {}
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="promptcache-encode")

    def submit(self, text: str, *, salt: str, shared: bool, owner: str) -> tuple[SchemaRecord, bool]:
        """Parse ``text`` (``PMLError`` on bad input, nothing changed) and queue its encoding.
        Returns the record and whether a new version was queued (False: the same text is already
        there, ready or encoding)."""
        schema = self.engine.parse_schema(text, salt=salt)
        record = SchemaRecord(schema.name, salt, shared, owner, schema.digest, list(schema.modules),
                              sum(len(m.token_ids) for m in schema.modules.values()))
        with self._lock:
            existing = self._records.get((salt, schema.name))
            if existing is not None and existing.digest == schema.digest and existing.status != FAILED:
                return existing, False
            self._records[(salt, schema.name)] = record
            self._executor.submit(self._encode, record, schema)
        return record, True

    def _encode(self, record: SchemaRecord, schema: Schema) -> None:
        t0 = time.perf_counter()

        def progress(done: int, total: int) -> None:
            record.done, record.total = done, total

        try:
            self.engine.install_schema(schema, on_progress=progress)
            self.engine.warm_schema(schema)
        except Exception as exc:
            record.status, record.error = FAILED, f"{type(exc).__name__}: {exc}"
            log.exception("encoding schema %r failed", schema.name)
            return
        record.encode_s = round(time.perf_counter() - t0, 4)
        record.done = record.total = max(record.total, record.done)
        with self._lock:
            latest = self._records.get((record.salt, record.name))
        if latest is None:
            self.engine.remove_schema(record.name, salt=record.salt)
        if latest is not record:
            return
        record.status = READY
        log.info("schema %r ready (%d modules, %d tokens, %.2f s)", record.name, len(record.modules),
                 record.tokens, record.encode_s)

    def get(self, name: str, salt: str) -> SchemaRecord | None:
        """The tenant's own version of ``name``, else the shared one."""
        with self._lock:
            return self._records.get((salt, name)) or self._records.get(("", name))

    def visible(self, salt: str) -> list[SchemaRecord]:
        """The tenant's schemas and the shared ones it does not shadow, by name."""
        with self._lock:
            own = {n: r for (s, n), r in self._records.items() if s == salt}
            shared = {n: r for (s, n), r in self._records.items() if s == "" and n not in own}
        return [r for _, r in sorted({**shared, **own}.items())]

    def delete(self, name: str, salt: str) -> SchemaRecord | None:
        """Remove the namespace's version of ``name`` from the registry and the engine."""
        with self._lock:
            record = self._records.pop((salt, name), None)
        if record is not None:
            self.engine.remove_schema(name, salt=salt)
        return record

    def close(self) -> None:
        """Drop queued encodings and wait for the running one."""
        self._executor.shutdown(wait=True, cancel_futures=True)
