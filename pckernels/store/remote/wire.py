"""The remote tier's wire format: a block as JSON metadata plus chunks of its bytes, checked on read.

Layout under namespace ``ns`` (default ``promptcache``), for a block of key digest ``d`` (on a
cluster ``t`` is ``{d}`` with the braces, a hash tag: a block's keys share one slot, hence one
master, while blocks spread over the slots; on one server ``t`` is ``d``):

* ``ns:kv:t`` — the block's metadata, JSON: format, key, dtype, shape, byte count, chunk
  size, sha256 of the bytes, the writer's id and the descriptive fields of the key;
* ``ns:kv:t:writer:i`` — chunk ``i`` of the block's bytes (``chunk_bytes`` each but the
  last; Redis values stop at 512 MB, a 4K-token module of a 7B model is ~2 GB);
* ``ns:lease:t`` — the block's encoding lease (``leases.py``).

An upload sends the chunks with pipelines, then sets the metadata with ``SET NX``: the first
complete copy wins, a writer that loses the race deletes its own chunks, so two processes writing
the same key leave one copy. A reader checks the metadata against the key (format, digest, shape,
dtype), that every chunk is there and has its length, then the sha256; a value that fails raises
``BlockFileError``.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid

import numpy as np
import torch

from pckernels.store.blocks import DTYPE_NAMES, DTYPES, BlockFileError, check_expected, tensor_bytes
from pckernels.store.keys import FORMAT_VERSION, BlockKey
from pckernels.store.remote.connect import Connector

REMOTE_FORMAT = f"promptcache-remote/{FORMAT_VERSION}"
PIPELINE_BYTES = 64 << 20
"""Bytes of chunks fetched or sent per pipeline round trip (bounds the memory in flight)."""


class Wire:
    """Blocks of one ``namespace`` on the server behind ``connector``, in chunks of ``chunk_bytes``.
    Key names depend on whether the server is a cluster: take the client (:attr:`client`) first."""

    def __init__(self, connector: Connector, namespace: str, chunk_bytes: int) -> None:
        import redis

        self.connector = connector
        self.namespace = namespace
        self.chunk_bytes = chunk_bytes
        self._redis_error = redis.RedisError

    @property
    def client(self):
        """The connected client (``Connector.client``)."""
        return self.connector.client

    def _tag(self, digest: str) -> str:
        return f"{{{digest}}}" if self.connector.cluster else digest

    def meta_key(self, digest: str) -> str:
        return f"{self.namespace}:kv:{self._tag(digest)}"

    def chunk_key(self, digest: str, writer: str, index: int) -> str:
        return f"{self.namespace}:kv:{self._tag(digest)}:{writer}:{index}"

    def lease_key(self, digest: str) -> str:
        return f"{self.namespace}:lease:{self._tag(digest)}"

    def read(self, key: BlockKey, pin: bool) -> torch.Tensor | None:
        """The verified block of ``key`` in CPU memory (pinned when ``pin``), ``None`` when the server
        has no metadata for it; ``BlockFileError`` when the value must not be used (its ``names``:
        the chunks to delete with the metadata)."""
        client = self.client
        raw = client.get(self.meta_key(key.digest))
        if raw is None:
            return None
        meta = parse_meta(raw, key)
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
            pipe = self.client.pipeline(transaction=False)  # one slot on a cluster: one master, one round trip
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

    def upload(self, key: BlockKey, tensor: torch.Tensor) -> bool:
        """Chunks of the CPU ``tensor``, then the metadata with ``SET NX``; returns whether this copy
        is the one kept (a copy that lost the race, or failed, has its chunks deleted)."""
        client = self.client  # connects first: the key names depend on the mode
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
                pipe = client.pipeline(transaction=False)
                for index in range(first, min(first + per_round, count)):
                    pipe.set(names[index], memoryview(data[index * chunk:(index + 1) * chunk]))
                pipe.execute()
            meta = {"format": REMOTE_FORMAT, "key": key.digest, "dtype": DTYPE_NAMES[tensor.dtype],
                    "shape": list(tensor.shape), "nbytes": nbytes, "chunk_bytes": chunk, "chunks": count,
                    "writer": writer, "sha256": checksum, **key.describe()}
            kept = bool(client.set(self.meta_key(key.digest), json.dumps(meta), nx=True))
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
            self.client.delete(*names)  # one slot on a cluster: one DEL
        except Exception:  # the server or cluster cannot answer: the chunks age out (LRU)
            pass


def parse_meta(raw: bytes, key: BlockKey) -> dict:
    """The checked metadata of ``key``'s block; ``BlockFileError`` when it is foreign or corrupt."""
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
