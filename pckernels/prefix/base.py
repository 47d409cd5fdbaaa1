"""The prefix cache's interface: what a reader of prompts may ask of stored prefixes.

Shaped like SGLang's ``BasePrefixCache``: :meth:`~BasePrefixCache.match` finds the longest stored
prefix of a prompt that a prefill can resume after (and holds it), :meth:`~BasePrefixCache.insert`
stores a block a prefill computed, :meth:`~BasePrefixCache.acquire` / :meth:`~BasePrefixCache.release`
keep entries from eviction while a request uses them, :meth:`~BasePrefixCache.evict` frees memory.
:meth:`~BasePrefixCache.prefill` reads a whole prompt through them. The engine types its prefix
cache by this class; :class:`~pckernels.prefix.PrefixCache` is the implementation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pckernels.prefix.blocks import CachedEntry


@dataclass
class PrefixMatch:
    """What :meth:`BasePrefixCache.match` found for one prompt of ``num_tokens`` tokens.

    ``keys``: the chained names of the prompt's full blocks; ``end_key``: the name of the whole
    prompt; ``root``: its chain's root (salted). ``chain``: the stored entries to restore, root
    first (empty on a miss); ``end``: the prompt-end entry when the whole prompt is stored (an exact
    repeat: ``chain`` then ends with it and no forward is needed). ``held``: the deepest entry this
    reader holds from eviction (the last of ``chain`` at first, then each block it inserts);
    release it when done. ``partial`` / ``partial_tokens``: with token-granular resumption, a
    stored entry after the chain whose first ``partial_tokens`` tokens are the prompt's next ones
    (held as well: release ``partial`` too). ``foreign``: with token-granular resumption, the first
    prompt token from which the reader's cache may hold other bits than the store (a block it
    computed was already stored, by a reader whose chunks were cut elsewhere); None: nowhere.
    """

    num_tokens: int
    keys: list[bytes]
    end_key: bytes
    root: bytes = b""
    chain: list[CachedEntry] = field(default_factory=list)
    end: CachedEntry | None = None
    held: CachedEntry | None = None
    partial: CachedEntry | None = None
    partial_tokens: int = 0
    foreign: int | None = None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose states the match restores."""
        return (self.chain[-1].end if self.chain else 0) + self.partial_tokens


@dataclass(frozen=True)
class PromptRows:
    """Where a reading puts a prompt's keys and values, for prefix caches that read into given rows
    (the engine's arena). ``view()``: the rows as they are now, ``[L, 2, H, >= n, D]``, row i holding
    token i — asked again at every chunk, so the storage behind them may move between two chunks
    (the arena grows); ``placed``: the leading tokens whose states those rows already hold (left by
    an earlier request that read the same blocks there), which a restore does not copy over."""

    view: Callable[[], torch.Tensor]
    placed: int = 0


class PromptReading(Protocol):
    """A prompt being read chunk by chunk (what :meth:`BasePrefixCache.begin` returns; the
    implementation is :class:`~pckernels.prefix.reading.Reading`): ``position`` tokens of
    ``num_tokens`` read, in forwards of ``chunk`` tokens; ``logits [vocab]`` of the last token once
    ``done``; ``cached_tokens`` restored rather than computed; ``mode`` as :class:`Prefill`'s;
    ``cache``: the states it reads into."""

    num_tokens: int
    position: int
    chunk: int
    cached_tokens: int
    mode: str
    logits: torch.Tensor | None
    cache: object

    @property
    def done(self) -> bool: ...

    @property
    def left(self) -> int: ...

    def advance(self, tokens: int | None = None) -> bool: ...

    def close(self) -> None: ...

    def prefill(self) -> "Prefill": ...


@dataclass
class Prefill:
    """What a prefill leaves behind: ``logits`` ``[vocab]`` of the last prompt token, the cache
    holding the prompt's states, how many prompt tokens were restored rather than computed,
    ``mode``: ``"prefix"`` (the store was used) or ``"uncached"``, and ``exact_tokens``: the
    leading tokens whose states are bitwise the stored blocks' for the prompt's keys (all of them,
    unless, token-granular, a block this prefill computed had been stored by another first)."""

    logits: torch.Tensor
    cache: object
    cached_tokens: int
    mode: str = "prefix"
    exact_tokens: int | None = None


class BasePrefixCache(ABC):
    """Exact prefix reuse over hash-chained token blocks (module docstring).

    ``block_size``: tokens per block; a prompt's blocks are named by :meth:`chain_keys`.
    """

    block_size: int

    @abstractmethod
    def chain_keys(self, prompt_ids: list[int], salt: str = "") -> list[bytes]:
        """The names of the full blocks of ``prompt_ids`` under ``salt`` (another salt matches nothing)."""

    @abstractmethod
    def match(self, prompt_ids: list[int], salt: str = "") -> PrefixMatch:
        """The longest stored prefix of ``prompt_ids`` a prefill can resume after, or the whole
        prompt when it is stored; its deepest entry is held (``PrefixMatch.held``)."""

    @abstractmethod
    def insert(self, entry: CachedEntry) -> CachedEntry:
        """Store ``entry`` (its parent must be stored) and return the stored entry, held for the
        caller; when the name is already stored, the stored entry wins."""

    @abstractmethod
    def acquire(self, entry: CachedEntry | None) -> None:
        """Hold ``entry`` (and through it its ancestors) from eviction."""

    @abstractmethod
    def release(self, entry: CachedEntry | None) -> None:
        """Undo one :meth:`acquire` (or the hold :meth:`insert` and :meth:`match` give)."""

    @abstractmethod
    def evict(self, nbytes: int) -> int:
        """Evict least recently used entries no one holds until ``nbytes`` bytes are freed (or
        none is left to evict), as the budget does; returns the bytes freed."""

    @abstractmethod
    def begin(self, prompt_ids: list[int], *, reuse: bool = True, salt: str = "",
              into: PromptRows | None = None) -> PromptReading:
        """Start reading ``prompt_ids``: the longest stored prefix restored now (when ``reuse``), the
        rest read by the returned :class:`PromptReading` a few chunks at a time
        (close it when done or abandoned). ``into``, where the implementation supports it: the rows
        that receive the prompt's keys and values."""

    def prefill(self, prompt_ids: list[int], *, reuse: bool = True, salt: str = "",
                into: PromptRows | None = None) -> Prefill:
        """Read the whole of ``prompt_ids`` at once (:meth:`begin`, then every chunk)."""
        reading = self.begin(prompt_ids, reuse=reuse, salt=salt, into=into)
        try:
            reading.advance()
        finally:
            reading.close()
        return reading.prefill()
