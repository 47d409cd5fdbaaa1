"""The assembly buffer: a preallocated KV area reused across calls, and the HF cache over it.

Layout: ``data [L, 2, H, capacity, D]`` (layers, key/value, KV heads, rows, head dim). Each
row holds one token's key and value at its schema position (``row_pos``); ``row_bias`` is
``0`` for live rows and ``-inf`` for rows that must never be attended (unused parameter
slot rows). The buffer only grows. It remembers which cached block occupies which rows, so
a later prompt that places the same block at the same rows skips the copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from pckernels import ops
from pckernels.integration.attention import AttentionSpec, KVLayout

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Placement:
    """Rows ``dst_row .. dst_row + n_rows`` hold rows ``src_row ..`` of the block ``key``."""

    key: tuple
    src_row: int
    dst_row: int
    n_rows: int


class AssemblyBuffer:
    """Grow-only KV buffer with per-row positions and liveness.

    ``data [L, 2, H, capacity, D]``; ``row_pos [capacity]`` int64; ``row_bias [capacity]`` in the
    buffer's dtype (0 live, -inf dead).
    """

    def __init__(self, layout: KVLayout, *, dtype: torch.dtype, device: torch.device | str,
                 capacity: int = 0) -> None:
        self.layout = layout
        self.dtype = dtype
        self.device = torch.device(device)
        self.allocations = 0
        self._resident: dict[int, Placement] = {}
        self.data = self._alloc_data(0)
        self.row_pos = torch.zeros(0, dtype=torch.long, device=self.device)
        self.row_bias = torch.zeros(0, dtype=dtype, device=self.device)
        self.ensure_capacity(capacity)

    @property
    def capacity(self) -> int:
        return self.data.shape[3]

    def _alloc_data(self, rows: int) -> torch.Tensor:
        lay = self.layout
        return torch.empty((lay.num_layers, 2, lay.num_kv_heads, rows, lay.head_dim),
                           dtype=self.dtype, device=self.device)

    def ensure_capacity(self, rows: int) -> None:
        """Grow to hold ``rows`` rows (by at least 1.5x, rounded to 256); contents are dropped."""
        if rows <= self.capacity:
            return
        new_cap = max(rows, int(self.capacity * 1.5))
        new_cap = -(-new_cap // 256) * 256
        self.data = self._alloc_data(new_cap)
        self.row_pos = torch.zeros(new_cap, dtype=torch.long, device=self.device)
        self.row_bias = torch.zeros(new_cap, dtype=self.dtype, device=self.device)
        self._resident.clear()
        self.allocations += 1

    def keys(self, layer: int, rows: int) -> torch.Tensor:
        """View ``[1, H, rows, D]`` of layer ``layer``'s keys."""
        return self.data[layer, 0, :, :rows].unsqueeze(0)

    def values(self, layer: int, rows: int) -> torch.Tensor:
        return self.data[layer, 1, :, :rows].unsqueeze(0)

    def missing(self, placement: Placement) -> list[Placement]:
        """Sub-ranges of ``placement`` whose rows do not already hold that block's data."""
        if self._resident.get(placement.dst_row) == placement:
            return []
        shift = placement.dst_row - placement.src_row
        covered = sorted((p.dst_row, p.dst_row + p.n_rows) for p in self._resident.values()
                         if p.key == placement.key and p.dst_row - p.src_row == shift)
        gaps, row, stop = [], placement.dst_row, placement.dst_row + placement.n_rows
        for lo, hi in covered:
            if hi <= row or lo >= stop:
                continue
            if lo > row:
                gaps.append(Placement(placement.key, row - shift, row, lo - row))
            row = max(row, hi)
        if row < stop:
            gaps.append(Placement(placement.key, row - shift, row, stop - row))
        return gaps

    def mark_resident(self, placement: Placement) -> None:
        self.invalidate_rows(placement.dst_row, placement.dst_row + placement.n_rows)
        self._resident[placement.dst_row] = placement

    def invalidate_rows(self, start: int, stop: int) -> None:
        """Rows ``start .. stop - 1`` are being overwritten: forget them, keeping the parts of
        overlapping placements that lie outside."""
        if stop <= start or not self._resident:
            return
        stale = [p for p in self._resident.values() if p.dst_row < stop and start < p.dst_row + p.n_rows]
        for p in stale:
            del self._resident[p.dst_row]
            if p.dst_row < start:
                self._resident[p.dst_row] = Placement(p.key, p.src_row, p.dst_row, start - p.dst_row)
            end = p.dst_row + p.n_rows
            if end > stop:
                self._resident[stop] = Placement(p.key, p.src_row + stop - p.dst_row, stop, end - stop)

    def invalidate_all(self) -> None:
        self._resident.clear()

    def poison_(self) -> None:
        """Fill every row with NaN and forget residency (tests: unwritten rows cannot pass)."""
        with torch.inference_mode():
            self.data.fill_(float("nan"))
        self._resident.clear()

    def attention(self, query_pos: torch.Tensor, rows: int) -> AttentionSpec:
        """Queries at ``query_pos [q]`` see the live rows ``0 .. rows - 1`` at positions <= their own."""
        key_pos = self.row_pos[:rows]
        visible = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
        bias = self.row_bias[:rows].unsqueeze(0).expand(visible.shape)
        return AttentionSpec(torch.where(visible, bias, NEG_INF), query_pos, key_pos)


class _BufferLayer(CacheLayerMixin):
    """One layer's view of the assembly buffer: ``update`` writes the new rows in place and
    returns the keys/values of rows ``0 .. extent - 1``."""

    def __init__(self, cache: "BufferCache", layer: int) -> None:
        super().__init__()
        self._cache = cache
        self._layer = layer
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        cache = self._cache
        buf = cache.buffer
        cache.write_rows_fn(buf, self._layer, key_states, value_states, cache.write_rows, cache.write_start)
        self.keys = buf.keys(self._layer, cache.extent)
        self.values = buf.values(self._layer, cache.extent)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.extent, 0

    def get_seq_length(self) -> int:
        return self._cache.extent

    def get_max_length(self) -> int:
        return -1


class BufferCache(Cache):
    """A transformers ``Cache`` backed by an :class:`AssemblyBuffer`.

    Before each forward the engine sets ``write_rows`` (the rows of the new tokens, or None with
    ``write_start`` for a contiguous run) and ``extent`` (rows visible to attention).
    """

    def __init__(self, buffer: AssemblyBuffer, write_rows_fn=ops.write_rows) -> None:
        self.buffer = buffer
        self.write_rows_fn = write_rows_fn
        self.write_rows: torch.Tensor | None = None
        self.write_start = 0
        self.extent = 0
        super().__init__(layers=[_BufferLayer(self, i) for i in range(buffer.layout.num_layers)])

    def prepare(self, *, rows: torch.Tensor | None, start: int, extent: int) -> None:
        self.write_rows = rows
        self.write_start = start
        self.extent = extent
