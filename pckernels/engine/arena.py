"""The KV arena: rows of keys and values shared by every request in flight.

Layout as the assembly buffer's: ``data [L, 2, H, capacity, D]`` with a schema position per row
(``row_pos``). Rows are handed out in pieces (any free rows, lowest first), so the arena never
fragments into failure; attention reads rows by position and a per-request visibility mask, not
by order. Two kinds of tenants:

* **module blocks**, placed once and shared: a block imported by five requests occupies its rows
  once, reference-counted; a block no request uses stays resident (a later request needs no copy)
  until its rows are wanted;
* **request rows**, owned by one request (its arguments, text and decoded tokens) and freed when it
  finishes.

Every row always holds finite values (new capacity is zeroed): a masked key must contribute
exactly nothing, and ``0 * NaN`` would not. Capacity grows (by at least 1.5x, rounded to 256 rows,
contents kept) up to ``max_rows`` (the byte budget over the bytes of a row), which the scheduler's
admission keeps the working set under.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from pckernels.engine.graphs import stage
from pckernels.integration.attention import KVLayout

GROWTH_ROUND = 256


class RowAllocator:
    """Free rows of ``[0, capacity)`` as sorted, coalesced ``(start, stop)`` ranges."""

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity else []

    @property
    def free_rows(self) -> int:
        return sum(stop - start for start, stop in self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` free rows, lowest first, or None when fewer are free (nothing taken then)."""
        if n > self.free_rows:
            return None
        rows: list[int] = []
        while len(rows) < n:
            start, stop = self._free[0]
            take = min(stop - start, n - len(rows))
            rows.extend(range(start, start + take))
            if start + take == stop:
                self._free.pop(0)
            else:
                self._free[0] = (start + take, stop)
        return rows

    def allocate_run(self, n: int) -> list[int] | None:
        """``n`` consecutive free rows (the lowest run that fits), or None (nothing taken then)."""
        for index, (start, stop) in enumerate(self._free):
            if stop - start >= n:
                if start + n == stop:
                    self._free.pop(index)
                else:
                    self._free[index] = (start + n, stop)
                return list(range(start, start + n))
        return None

    def allocate_at(self, start: int, n: int) -> list[int] | None:
        """Rows ``start .. start + n - 1`` if they are all free, else None (nothing taken then)."""
        for index, (lo, hi) in enumerate(self._free):
            if lo <= start and start + n <= hi:
                pieces = [(lo, start)] if lo < start else []
                if start + n < hi:
                    pieces.append((start + n, hi))
                self._free[index:index + 1] = pieces
                return list(range(start, start + n))
        return None

    def release(self, rows: list[int]) -> None:
        """Give ``rows`` back (each must be allocated)."""
        for start, stop in row_ranges(sorted(rows)):
            index = bisect.bisect_left(self._free, (start, stop))
            self._free.insert(index, (start, stop))
        merged: list[tuple[int, int]] = []
        for start, stop in self._free:
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], stop)
            else:
                merged.append((start, stop))
        self._free = merged

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        self.release(list(range(self.capacity, capacity)))
        self.capacity = capacity


def row_ranges(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted rows as ``(start, stop)`` runs."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs


@dataclass
class ResidentBlock:
    """A module block in the arena: its ``rows`` (block row i at ``rows[i]``) and users."""

    key: object
    rows: list[int]
    refs: int = 0
    last_use: int = 0
    index: torch.Tensor | None = field(default=None, repr=False)
    """``rows`` as a device tensor, made once."""


class KVArena:
    """Shared KV rows (see the module docstring). Not thread-safe: the scheduler owns it."""

    def __init__(self, layout: KVLayout, *, dtype: torch.dtype, device: torch.device | str, max_bytes: int) -> None:
        self.layout = layout
        self.dtype = dtype
        self.device = torch.device(device)
        self.allocator = RowAllocator(0)
        self.data = self._alloc(0)
        self.row_pos = torch.zeros(0, dtype=torch.long, device=self.device)
        self.blocks: dict[object, ResidentBlock] = {}
        self.prefix_rows: dict[bytes, int] = {}
        """Prefix-cache block (chain key) -> first of the ``prefix_block`` free rows that still hold
        its keys and values since the request that read it finished (forgotten once handed out)."""
        self.prefix_block = 0
        self.growths = 0
        self._clock = 0
        self.max_rows = max(1, max_bytes // self.bytes_per_row)

    @property
    def capacity(self) -> int:
        return self.data.shape[3]

    @property
    def bytes_per_row(self) -> int:
        lay = self.layout
        return lay.num_layers * 2 * lay.num_kv_heads * lay.head_dim * self.data.element_size()

    def _alloc(self, rows: int) -> torch.Tensor:
        """Uninitialised ``[L, 2, H, rows, D]`` (callers fill or zero it)."""
        lay = self.layout
        return torch.empty((lay.num_layers, 2, lay.num_kv_heads, rows, lay.head_dim), dtype=self.dtype,
                           device=self.device)

    # -- views for the HF cache -----------------------------------------------------------------

    def keys(self, layer: int, rows: int) -> torch.Tensor:
        """View ``[1, H, rows, D]`` of layer ``layer``'s keys."""
        return self.data[layer, 0, :, :rows].unsqueeze(0)

    def values(self, layer: int, rows: int) -> torch.Tensor:
        return self.data[layer, 1, :, :rows].unsqueeze(0)

    # -- rows -------------------------------------------------------------------------------------

    def used_rows(self) -> int:
        return self.capacity - self.allocator.free_rows

    def referenced_rows(self) -> int:
        """Rows of blocks some request uses, plus request rows: what cannot be reclaimed now."""
        idle = sum(len(b.rows) for b in self.blocks.values() if b.refs == 0)
        return self.used_rows() - idle

    def allocate(self, n: int) -> list[int]:
        """``n`` rows: free ones, then rows of idle blocks (least recently used first), then new
        capacity. Raises ``MemoryError`` past ``max_rows`` (admission prevents it)."""
        return self._handed_out(self._allocate(n))

    def _allocate(self, n: int) -> list[int]:
        rows = self.allocator.allocate(n)
        while rows is None and self._evict_one_idle():
            rows = self.allocator.allocate(n)
        if rows is None:
            self._grow(self.used_rows() + n)
            rows = self.allocator.allocate(n)
        if rows is None:
            raise MemoryError(f"KV arena: {n} rows requested, {self.allocator.free_rows} free of {self.max_rows}")
        return rows

    def allocate_run(self, n: int) -> list[int] | None:
        """``n`` consecutive rows: a free run, else one made by dropping idle blocks (least recently
        used first) or growing; None when the budget leaves no such run (the caller takes pieces)."""
        if n == 0:
            return []
        rows = self.allocator.allocate_run(n)
        while rows is None and self._evict_one_idle():
            rows = self.allocator.allocate_run(n)
        if rows is None:
            tail = self.allocator._free[-1] if self.allocator._free else None
            at_end = tail[1] - tail[0] if tail is not None and tail[1] == self.capacity else 0
            self._grow(self.capacity + n - at_end)
            rows = self.allocator.allocate_run(n)
        return self._handed_out(rows)

    def allocate_at(self, start: int, n: int) -> list[int] | None:
        """Rows ``start .. start + n - 1`` if all are free (None otherwise, nothing taken)."""
        rows = self.allocator.allocate_at(start, n)
        return self._handed_out(rows)

    def remember_prefix(self, keys: list[bytes], start: int, block: int) -> None:
        """Rows from ``start`` (about to be freed) hold the prefix blocks ``keys`` in order, ``block``
        rows each: a later request reading the same blocks may take those rows as they are."""
        if self.prefix_block != block:
            self.prefix_rows.clear()
            self.prefix_block = block
        for index, key in enumerate(keys):
            self.prefix_rows[key] = start + index * block

    def prefix_run(self, keys: list[bytes]) -> tuple[int, int]:
        """``(start, blocks)``: the longest leading run of ``keys`` remembered in consecutive rows."""
        start = self.prefix_rows.get(keys[0]) if keys else None
        if start is None:
            return -1, 0
        count = 1
        while count < len(keys) and self.prefix_rows.get(keys[count]) == start + count * self.prefix_block:
            count += 1
        return start, count

    def _handed_out(self, rows: list[int] | None) -> list[int] | None:
        """Forget remembered prefix blocks whose rows are being handed out (they will be written)."""
        if rows and self.prefix_rows:
            block = self.prefix_block
            spans = row_ranges(sorted(rows))
            stale = [key for key, first in self.prefix_rows.items()
                     if any(lo < first + block and first < hi for lo, hi in spans)]
            for key in stale:
                del self.prefix_rows[key]
        return rows

    def release(self, rows: list[int]) -> None:
        self.allocator.release(rows)

    def _evict_one_idle(self) -> bool:
        idle = [b for b in self.blocks.values() if b.refs == 0]
        if not idle:
            return False
        victim = min(idle, key=lambda b: b.last_use)
        del self.blocks[victim.key]
        self.allocator.release(victim.rows)
        return True

    def drop_idle(self) -> int:
        """Forget every block no request uses (their rows become free); returns how many."""
        count = 0
        while self._evict_one_idle():
            count += 1
        return count

    def _grow(self, rows: int) -> None:
        """Grow to hold at least ``rows`` rows (no more than ``max_rows``), keeping the contents."""
        target = max(rows, int(self.capacity * 1.5), GROWTH_ROUND)
        capacity = min(self.max_rows, -(-target // GROWTH_ROUND) * GROWTH_ROUND)
        if capacity < rows or capacity <= self.capacity:
            return
        old = self.capacity
        data = self._alloc(capacity)
        data[:, :, :, :old].copy_(self.data)
        data[:, :, :, old:].zero_()
        row_pos = torch.zeros(capacity, dtype=torch.long, device=self.device)
        row_pos[:old] = self.row_pos
        self.data, self.row_pos = data, row_pos
        self.allocator.grow(capacity)
        self.growths += 1

    # -- blocks -----------------------------------------------------------------------------------

    def block(self, key) -> ResidentBlock | None:
        return self.blocks.get(key)

    def add_block(self, key, n: int) -> ResidentBlock:
        """Rows for a new resident block of ``n`` rows (the caller fills them)."""
        rows = self.allocate(n)
        block = ResidentBlock(key, rows)
        block.index = stage(rows, torch.long, self.device)
        self.blocks[key] = block
        return block

    def acquire(self, block: ResidentBlock) -> None:
        self._clock += 1
        block.refs += 1
        block.last_use = self._clock

    def forget_block(self, key) -> None:
        """Forget block ``key`` if no request holds it (its rows become free): a block whose rows
        were never filled must not be found resident."""
        block = self.blocks.get(key)
        if block is not None and block.refs == 0:
            del self.blocks[key]
            self.allocator.release(block.rows)

    def release_block(self, key) -> None:
        block = self.blocks.get(key)
        if block is not None and block.refs > 0:
            block.refs -= 1

    def poison_(self, value: float = 1e3) -> None:
        """Fill every free row with ``value`` (tests: a row read before it is written shows in the
        logits). Finite on purpose: masked keys must contribute exactly zero, and NaN would not."""
        self.prefix_rows.clear()
        with torch.inference_mode():
            for start, stop in self.allocator._free:
                self.data[:, :, :, start:stop] = value
