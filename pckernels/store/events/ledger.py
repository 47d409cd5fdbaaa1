"""Which blocks this process holds, per medium, and the KV events that tell a subscriber so.

The store's places — the prefix cache's memory, the device and host tiers, the disk tier — tell a
:class:`BlockLedger` when they gain or lose a block (``Place.hold`` / ``Place.drop``). A block is
named outward by its :class:`BlockInfo` (the 64-bit hash a consumer sees, its parent's, its
tokens). Two places of one medium may hold the same block (a prefix block in the prefix cache's
memory and, spilled, in the device tier): the ledger counts them and publishes ``stored`` when
the first place of a medium gains the block and ``removed`` when the last one loses it, so a
subscriber's set per medium is exactly what the process holds.

Events wait in a bounded list for the publisher thread (:meth:`BlockLedger.drain`). When it is
full, the waiting events are dropped (counted) and the next drain starts over: ``cleared``
followed by ``stored`` for every block held, so a subscriber that missed events is right again.
Pure Python, no sockets: the publisher (``publisher.py``) turns these into vLLM's wire format.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from array import array
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

MEDIUMS = {"device": "GPU", "host": "CPU", "disk": "DISK"}
"""The ``medium`` of each tier, as vLLM names its KV cache (``GPU``: the engine's device tier, also
on a CPU engine) and its CPU offload (``CPU``); ``DISK``: the disk tier."""
PREFIX_MEDIUM = "GPU"
"""The prefix cache's own memory is on the engine's device, next to the device tier."""

_BLOCK_TAG = b"promptcache-kv-block/1\0"


@dataclass(frozen=True)
class BlockInfo:
    """What a KV-event consumer is told about one block.

    ``hash``: the block's 64-bit name (``block_hashes``); ``parent``: its parent's (``None`` for
    the first block of a chain); ``token_ids``: the tokens it holds; ``block_size``: how many;
    ``extra``: vLLM's ``extra_keys`` entry for it (``None``, or a tuple of strings naming what
    besides the tokens its key depends on).
    """

    hash: int
    parent: int | None
    token_ids: Sequence[int]
    block_size: int
    extra: tuple | None = None


def digest_hash(digest: str) -> int:
    """The 64-bit event hash of a store key's sha256 ``digest`` (hex): its first 8 bytes, big-endian."""
    return int(digest[:16], 16)


def salt_tag(salt: str | bytes) -> str:
    """What a tenant's salt shows in events: the first 16 hex digits of its sha256 (``""``: none)."""
    if not salt:
        return ""
    return hashlib.sha256(salt.encode() if isinstance(salt, str) else salt).hexdigest()[:16]


def chain_hash(parent: int | None, token_ids: Sequence[int], extra: tuple | None = None) -> int:
    """The event hash of a prefix block: the first 8 bytes (big-endian) of
    ``sha256(tag, parent, extra, tokens)`` — ``tag`` = ``b"promptcache-kv-block/1\\0"``; ``parent``
    = ``b"\\0"`` for none, else ``b"\\1"`` and its 8 bytes big-endian; ``extra`` = each string of
    the tuple, UTF-8, followed by ``b"\\0"``; then ``b"\\0"``; the tokens as little-endian uint32."""
    h = hashlib.sha256(_BLOCK_TAG)
    h.update(b"\0" if parent is None else b"\1" + parent.to_bytes(8, "big"))
    for part in extra or ():
        h.update(str(part).encode() + b"\0")
    h.update(b"\0")
    tokens = array("I", token_ids)
    if sys.byteorder != "little":
        tokens.byteswap()
    h.update(tokens.tobytes())
    return int.from_bytes(h.digest()[:8], "big")


def prefix_block_info(parent: int | None, token_ids: Sequence[int], salt: str | bytes = "",
                      recurrent: bool = False) -> BlockInfo:
    """The :class:`BlockInfo` of a prefix-cache block: chained on its parent's hash; the first block
    of a tenant's chain (``salt``) carries ``("salt", salt_tag(salt))`` in its extra keys and hash;
    a block of a model with recurrent layers that carries their state snapshot says ``"recurrent"``
    in its extra keys (not in its hash)."""
    extra = ("salt", salt_tag(salt)) if salt and parent is None else None
    tokens = array("I", token_ids)
    block = chain_hash(parent, tokens, extra)
    if recurrent:
        extra = (*(extra or ()), "recurrent")
    return BlockInfo(block, parent, tokens, len(tokens), extra)


class Place:
    """One place blocks are kept (``name``), in ``medium``; tells its ledger what it gains and loses.
    ``ident``: the place's own name of a block (a store digest, a chain key)."""

    __slots__ = ("ledger", "name", "medium")

    def __init__(self, ledger: "BlockLedger", name: str, medium: str) -> None:
        self.ledger = ledger
        self.name = name
        self.medium = medium

    def hold(self, ident, info: BlockInfo | None) -> None:
        """The place holds ``ident`` (``info``: how it is named outward; ``None``: not known yet —
        not published until a later ``hold`` says)."""
        self.ledger._hold(self, ident, info)

    def drop(self, ident) -> None:
        """The place no longer holds ``ident`` (no-op when it did not)."""
        self.ledger._drop(self, ident)

    def drop_all(self) -> None:
        """The place holds nothing any more."""
        self.ledger._drop_all(self)


class _NoPlace:
    """A place whose changes go nowhere (events off)."""

    __slots__ = ()
    name = ""
    medium = ""

    def hold(self, ident, info) -> None:
        pass

    def drop(self, ident) -> None:
        pass

    def drop_all(self) -> None:
        pass


NO_PLACE = _NoPlace()


class BlockLedger:
    """Blocks held per place and per medium, and the events waiting to be published (module
    docstring). Thread-safe: one lock, never held while calling out (``notify`` excepted, which
    must only wake the publisher).

    ``max_pending``: events that may wait; ``notify()``: called when events are added.
    Events are tuples: ``("stored", medium, BlockInfo)``, ``("removed", medium, hash)``,
    ``("cleared",)``.
    """

    def __init__(self, max_pending: int = 100_000, notify: Callable[[], None] | None = None) -> None:
        self.max_pending = max(1, int(max_pending))
        self.notify = notify or (lambda: None)
        self._lock = threading.Lock()
        self._where: dict[tuple[str, object], tuple[str, BlockInfo | None]] = {}
        self._held: dict[tuple[str, int], list] = {}
        """``(medium, hash)`` -> ``[places holding it, BlockInfo]``."""
        self._pending: list[tuple] = []
        self._resync = False
        self._drains = 0
        self.events = 0
        """Events added (published or waiting)."""
        self.dropped = 0
        """Events dropped because too many waited (then a resync followed)."""
        self.resyncs = 0
        self.unknown = 0
        """Blocks held that could not be named (files a disk scan found; named once used)."""

    def place(self, name: str, medium: str) -> Place:
        """The :class:`Place` ``name`` keeping blocks in ``medium``."""
        return Place(self, name, medium)

    # -- what the places say ---------------------------------------------------------------------

    def _hold(self, place: Place, ident, info: BlockInfo | None) -> None:
        with self._lock:
            where = (place.name, ident)
            known = self._where.get(where)
            if known is not None and (known[1] is not None or info is None):
                return
            if known is not None:
                self.unknown -= 1
            self._where[where] = (place.medium, info)
            if info is None:
                self.unknown += 1
                return
            slot = self._held.get((place.medium, info.hash))
            if slot is not None:
                slot[0] += 1
                return
            self._held[(place.medium, info.hash)] = [1, info]
            self._add(("stored", place.medium, info))
        self.notify()

    def _drop(self, place: Place, ident) -> None:
        with self._lock:
            added = self._release(place.name, ident)
        if added:
            self.notify()

    def _drop_all(self, place: Place) -> None:
        with self._lock:
            added = False
            for name, ident in [w for w in self._where if w[0] == place.name]:
                added |= self._release(name, ident)
        if added:
            self.notify()

    def _release(self, name: str, ident) -> bool:
        """Forget ``(name, ident)``; whether an event was added. Call with the lock held."""
        found = self._where.pop((name, ident), None)
        if found is None:
            return False
        medium, info = found
        if info is None:
            self.unknown -= 1
            return False
        slot = self._held[(medium, info.hash)]
        slot[0] -= 1
        if slot[0] > 0:
            return False
        del self._held[(medium, info.hash)]
        self._add(("removed", medium, info.hash))
        return True

    def _add(self, event: tuple) -> None:
        self.events += 1
        if self._resync:
            return
        if len(self._pending) >= self.max_pending:
            self.dropped += len(self._pending) + 1
            self._pending.clear()
            self._resync = True
            return
        self._pending.append(event)

    def cleared(self) -> None:
        """Publish ``AllBlocksCleared`` (a publisher's first event: whatever a subscriber knew of
        an earlier process on this endpoint is gone)."""
        with self._lock:
            self._add(("cleared",))
        self.notify()

    @contextmanager
    def clearing(self):
        """Wrap a clear of one or more places: when nothing at all is held afterwards, the removals
        it caused are published as one ``AllBlocksCleared``."""
        with self._lock:
            mark, drains = len(self._pending), self._drains
        try:
            yield
        finally:
            with self._lock:
                if not self._held and not self._resync:
                    if drains == self._drains and all(e[0] == "removed" for e in self._pending[mark:]):
                        del self._pending[mark:]
                    self._add(("cleared",))
            self.notify()

    # -- what the publisher takes ------------------------------------------------------------------

    def drain(self) -> list[tuple]:
        """The events waiting, oldest first (emptied); after a drop, ``cleared`` and every held block."""
        with self._lock:
            self._drains += 1
            if self._resync:
                self._resync = False
                self.resyncs += 1
                return [("cleared",)] + [("stored", medium, slot[1]) for (medium, _), slot in self._held.items()]
            out, self._pending = self._pending, []
            return out

    @property
    def resync_due(self) -> bool:
        """Whether events were dropped and the next drain re-announces everything."""
        return self._resync

    def held(self) -> dict[str, set[int]]:
        """The hashes held per medium: what a subscriber that missed nothing believes."""
        with self._lock:
            out: dict[str, set[int]] = {}
            for medium, block in self._held:
                out.setdefault(medium, set()).add(block)
            return out

    def stats(self) -> dict:
        with self._lock:
            return {"events": self.events, "dropped": self.dropped, "resyncs": self.resyncs,
                    "pending": len(self._pending), "held": len(self._held), "unknown": self.unknown}
