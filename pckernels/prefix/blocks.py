"""Hash-chained token blocks held under a byte budget, with reference counts and LRU eviction.

A prompt is cut into fixed-size token blocks. Block ``i`` is named by a hash of its parent's
name and its own token ids, so a name identifies the whole prefix up to and including that
block: two prompts share block ``i`` only when their first ``(i + 1) * block_size`` tokens are
equal. A *prompt-end* entry names a complete prompt (its full blocks plus the partial tail)
and lets an exact repeat skip the forward entirely.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

_BLOCK_TAG = b"block"
_END_TAG = b"prompt-end"


def _token_bytes(token_ids: list[int]) -> bytes:
    return array("q", token_ids).tobytes()


def block_keys(token_ids: list[int], block_size: int, root: bytes) -> list[bytes]:
    """Chained names of the full blocks of ``token_ids`` (a trailing partial block gets none)."""
    keys: list[bytes] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        digest = hashlib.blake2b(_BLOCK_TAG + parent, digest_size=16)
        digest.update(_token_bytes(token_ids[start:start + block_size]))
        parent = digest.digest()
        keys.append(parent)
    return keys


def prompt_end_key(parent: bytes, tail_ids: list[int]) -> bytes:
    """Name of a complete prompt: its last full block's name plus the tokens after that block."""
    digest = hashlib.blake2b(_END_TAG + parent, digest_size=16)
    digest.update(_token_bytes(tail_ids))
    return digest.digest()


def tensor_bytes(obj) -> int:
    """Bytes held by the tensors in ``obj`` (nested lists, tuples and dicts of tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class BlockKV(list):
    """Per-layer ``(keys [1, H, n, D], values)`` that are views of one block ``[L, 2, H, n, D]``
    (``.block``), so it can be placed or spilled with one copy."""

    block: torch.Tensor

    @classmethod
    def of(cls, block: torch.Tensor) -> "BlockKV":
        kv = cls((block[layer, 0].unsqueeze(0), block[layer, 1].unsqueeze(0)) for layer in range(block.shape[0]))
        kv.block = block
        return kv


def head_kv(kv: list, count: int) -> list:
    """The first ``count`` tokens of an entry's ``kv`` (per layer ``(keys, values)`` or None), as
    views (a :class:`BlockKV` stays one)."""
    if isinstance(kv, BlockKV):
        return BlockKV.of(kv.block[:, :, :, :count])
    return [None if pair is None else (pair[0][..., :count, :], pair[1][..., :count, :]) for pair in kv]


def common_prefix(stored: array, tokens: list[int]) -> int:
    """How many leading ``tokens`` equal ``stored``'s."""
    count = 0
    for a, b in zip(stored, tokens):
        if a != b:
            break
        count += 1
    return count


@dataclass(eq=False)
class CachedEntry:
    """One stored block (or prompt end) and the model states it produced.

    ``kv``: per cache layer, ``(keys, values)`` of shape ``[batch, kv_heads, num_tokens, head_dim]``
    for the entry's own tokens, or ``None`` for layers without growing attention states.
    ``states``: per cache layer, the recurrent/convolution state snapshot taken right after the
    entry's last token (``None`` where the entry does not end a prefill chunk or the model has no
    such layers). ``final_logits``: float ``[vocab]`` logits of the prompt's last token (prompt
    ends only). ``refcount``: children in the store plus requests currently using the entry.
    """

    key: bytes
    parent: CachedEntry | None
    start: int
    num_tokens: int
    kv: list
    states: list | None = None
    final_logits: torch.Tensor | None = None
    refcount: int = 0
    token_ids: array | None = None
    anchor: bytes | None = None
    info: object | None = None
    """How KV events name a full block (``pckernels.store.events.BlockInfo``), made when first published."""
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = tensor_bytes(self.kv) + tensor_bytes(self.states) + tensor_bytes(self.final_logits)

    @property
    def end(self) -> int:
        """Number of prompt tokens covered up to and including this entry."""
        return self.start + self.num_tokens

    def chain(self) -> list[CachedEntry]:
        """This entry and its ancestors, root first."""
        out = []
        entry: CachedEntry | None = self
        while entry is not None:
            out.append(entry)
            entry = entry.parent
        return out[::-1]


class BlockStore:
    """Entries by name, with reference counts and least-recently-used eviction under a byte budget.

    An entry is evictable only when its ``refcount`` is zero: no child entry hangs from it and no
    request holds it. Eviction therefore always removes leaves, and a stored chain never has a
    gap. ``on_evict(entry)`` runs for each entry evicted for the budget, just before it leaves
    (not for :meth:`clear`); ``listener(entry, stored)``, when set, runs after an entry is stored
    (``True``) and after one leaves (``False``: evicted or cleared). Not thread-safe on its own; the
    owner serialises calls.
    """

    def __init__(self, budget_bytes: int, on_evict: Callable[[CachedEntry], None] | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.on_evict = on_evict
        self.listener: Callable[[CachedEntry, bool], None] | None = None
        self._entries: OrderedDict[bytes, CachedEntry] = OrderedDict()
        self._children: dict[bytes, dict[bytes, CachedEntry]] = {}
        """anchor -> the stored entries that follow it (:meth:`children`)."""
        self.bytes = 0
        self.evictions = 0
        self.evicted_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> CachedEntry | None:
        """The entry named ``key`` (marked as recently used), or ``None``."""
        entry = self._entries.get(key)
        if entry is not None:
            self._touch(entry)
        return entry

    def longest_chain(self, keys: list[bytes]) -> list[CachedEntry]:
        """The stored entries for the longest run ``keys[:m]`` present in the store."""
        found = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                break
            found.append(entry)
        for entry in found:
            self._touch(entry)
        return found

    def insert(self, entry: CachedEntry) -> CachedEntry:
        """Store ``entry`` (its parent must be stored) and return it acquired for the caller.

        When an entry already has that name, the stored one wins and is returned acquired.
        """
        existing = self._entries.get(entry.key)
        if existing is not None:
            self._touch(existing)
            existing.refcount += 1
            return existing
        if entry.parent is not None:
            if self._entries.get(entry.parent.key) is not entry.parent:
                raise ValueError("the parent of a stored entry must itself be stored")
            entry.parent.refcount += 1
        entry.refcount += 1
        self._entries[entry.key] = entry
        if entry.anchor is not None:
            self._children.setdefault(entry.anchor, {})[entry.key] = entry
        self.bytes += entry.nbytes
        if self.listener is not None:
            self.listener(entry, True)
        self.evict_to_budget()
        return entry

    def acquire(self, entry: CachedEntry | None) -> None:
        """Hold ``entry`` (and through it, its ancestors) so that eviction skips it."""
        if entry is not None:
            entry.refcount += 1

    def release(self, entry: CachedEntry | None) -> None:
        """Undo one :meth:`acquire`, then evict down to the budget."""
        if entry is not None:
            if entry.refcount <= 0:
                raise RuntimeError("release without a matching acquire")
            entry.refcount -= 1
        self.evict_to_budget()

    def evict_to_budget(self) -> None:
        """Drop least recently used unreferenced entries until the store fits its budget."""
        self.evict_to(self.budget_bytes)

    def evict_to(self, limit: int) -> None:
        """Drop least recently used unreferenced entries until the store holds at most ``limit``
        bytes (or none is left to drop); ``on_evict`` runs for each."""
        self._evict_to(limit, notify=True)

    def clear(self) -> None:
        """Drop every unreferenced entry (entries held by running requests stay); ``on_evict`` is not called."""
        self._evict_to(0, notify=False)

    def _evict_to(self, limit: int, *, notify: bool) -> None:
        while self.bytes > limit:
            victim = next((e for e in self._entries.values() if e.refcount == 0), None)
            if victim is None:
                log.debug("prefix store over budget (%d > %d bytes) but every entry is in use", self.bytes, limit)
                return
            if notify and self.on_evict is not None:
                self.on_evict(victim)
            self._remove(victim)

    def children(self, anchor: bytes) -> list[CachedEntry]:
        """The stored entries whose parent is the entry named ``anchor`` (or, for a chain's root,
        its first blocks and short prompts' ends)."""
        return list(self._children.get(anchor, {}).values())

    def _remove(self, entry: CachedEntry) -> None:
        del self._entries[entry.key]
        siblings = self._children.get(entry.anchor)
        if siblings is not None:
            siblings.pop(entry.key, None)
            if not siblings:
                del self._children[entry.anchor]
        self.bytes -= entry.nbytes
        self.evictions += 1
        self.evicted_tokens += entry.num_tokens
        if entry.parent is not None:
            entry.parent.refcount -= 1
        if self.listener is not None:
            self.listener(entry, False)

    def entries(self) -> list[CachedEntry]:
        """The stored entries, least recently used first."""
        return list(self._entries.values())

    def _touch(self, entry: CachedEntry) -> None:
        self._entries.move_to_end(entry.key)
