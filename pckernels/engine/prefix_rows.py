"""Exact prefix reuse inside the engine: a plain prompt's keys and values live in its own arena rows.

:class:`EnginePrefixCache` is the :class:`~pckernels.prefix.PrefixCache` the engine answers plain
prompts with. Its block store, hash chains, prompt ends, spill and self-check are the prefix
cache's; what changes is where states are kept. A prompt is read into **one contiguous run of
the request's own arena rows**: a hit places the stored blocks there with one
:func:`~pckernels.ops.gather_concat` launch (the blocks stay where they are stored; no
concatenated copy is built, nothing is moved afterwards), the rest is computed in the same
chunks as without reuse by the engine's forward (the native one where it applies) reading and
writing those rows, and decoding continues in them. Every chunk therefore sees the same keys in
the same layout with or without reuse — first-token logits stay bitwise equal to
``reuse=False``; the self-check verifies it, with the restored prompt placed at another row
offset than the original. Computed full blocks are copied out of the rows into the store.
"""

from __future__ import annotations

import itertools
from typing import Callable, TypeVar

import torch

from pckernels import ops
from pckernels.engine.buffer import BufferCache
from pckernels.engine.context import EngineContext
from pckernels.integration.attention import AttentionSpec, KVLayout
from pckernels.prefix import PrefixCache
from pckernels.prefix.blocks import BlockKV
from pckernels.prefix.base import Prefill, PromptRows
from pckernels.prefix.states import KV

NEG_INF = float("-inf")
T = TypeVar("T")

class RowsBuffer:
    """``data [L, 2, H, capacity, D]``: the rows a prompt's states occupy — a view of the arena asked
    for anew at each use (``view()``: the arena may grow, and move, between two chunks of a prompt)
    or a private tensor that grows on demand."""

    def __init__(self, layout: KVLayout, *, data: torch.Tensor | None = None,
                 view: Callable[[], torch.Tensor] | None = None) -> None:
        self._data = data
        self._view = view
        self.layout = layout
        self.growable = view is None

    @property
    def data(self) -> torch.Tensor:
        return self._view() if self._view is not None else self._data

    def keys(self, layer: int, rows: int) -> torch.Tensor:
        return self.data[layer, 0, :, :rows].unsqueeze(0)

    def values(self, layer: int, rows: int) -> torch.Tensor:
        return self.data[layer, 1, :, :rows].unsqueeze(0)

    def ensure(self, rows: int) -> None:
        """Room for ``rows`` rows (a private buffer grows, keeping its contents)."""
        if rows <= self.data.shape[3]:
            return
        if not self.growable:
            raise RuntimeError(f"prompt rows hold {self.data.shape[3]} tokens, {rows} needed")
        data = self._data
        grown = torch.zeros((*data.shape[:3], max(rows, 2 * data.shape[3]), data.shape[4]),
                            dtype=data.dtype, device=data.device)
        grown[:, :, :, :data.shape[3]] = data
        self._data = grown


class _RowStates:
    """The prefix cache's state handling (``CacheStates``' interface) over :class:`RowsBuffer` rows:
    every layer holds keys and values, there are no recurrent states."""

    has_recurrent_layers = False

    def __init__(self, layout: KVLayout, dtype: torch.dtype, device: torch.device) -> None:
        self.layout = layout
        self.dtype = dtype
        self.device = device
        self.kinds = [KV] * layout.num_layers
        self._offsets = itertools.cycle((0, 5, 2))

    def new_cache(self, into: PromptRows | None = None) -> BufferCache:
        """A cache over ``into``'s rows (``[L, 2, H, >= n, D]``, a view of the arena), or a private
        buffer whose rows start at a varying offset (so the self-check compares different addresses)."""
        if into is not None:
            return BufferCache(RowsBuffer(self.layout, view=into.view))
        lay = self.layout
        offset = next(self._offsets)
        data = torch.zeros((lay.num_layers, 2, lay.num_kv_heads, offset + 64, lay.head_dim), dtype=self.dtype,
                           device=self.device)
        return BufferCache(RowsBuffer(lay, data=data[:, :, :, offset:]))

    def inspect(self, cache) -> list[str]:
        return self.kinds

    def kv_slice(self, cache: BufferCache, start: int, end: int) -> BlockKV:
        """An owned copy of rows ``[start, end)`` as a block ``[L, 2, H, n, D]`` with per-layer views."""
        return BlockKV.of(cache.buffer.data[:, :, :, start:end].clone())

    def recurrent_snapshot(self, cache) -> list:
        return [None] * self.layout.num_layers

    def restore(self, cache: BufferCache, kv_pieces: list, states, placed: int = 0) -> None:
        """Place the pieces (in token order) in rows ``0 ..`` with one gather-concat launch; pieces
        within the first ``placed`` tokens (the rows already hold them) are not copied."""
        buf = cache.buffer
        total = sum(piece[0][0].shape[2] for piece in kv_pieces)
        buf.ensure(total)
        blocks, table, row = [], [], 0
        for piece in kv_pieces:
            n = piece[0][0].shape[2]
            if n and row + n > placed:
                blocks.append(piece.block if isinstance(piece, BlockKV) else _stack(piece))
                table.append((len(blocks) - 1, 0, row, n))
            row += n
        if table:
            ops.gather_concat(buf.data, blocks, torch.tensor(table, dtype=torch.int64))


def _stack(kv: list) -> torch.Tensor:
    """Per-layer ``(keys [1, H, n, D], values)`` as one block ``[L, 2, H, n, D]``."""
    return torch.stack([torch.stack((k[0], v[0])) for k, v in kv])


class EnginePrefixCache(PrefixCache):
    """The prefix cache over the engine's forward and arena rows (module docstring).

    ``ctx``: the engine's model (adapter, tokenizer, KV layout and dtype) and numerics tag (kept
    apart from other forwards' blocks in chains and spilled keys). ``run``: how model work is run
    (the engine passes its scheduler's ``call``, so that a caller using ``complete``/``prefill``
    directly runs alone on the scheduler thread, under the model lock: ``pckernels.engine.threads``).
    Other arguments as :class:`~pckernels.prefix.PrefixCache`.
    """

    def __init__(self, ctx: EngineContext, *, run: Callable[[Callable[[], T]], T] | None = None, **options) -> None:
        self.adapter = ctx.adapter
        self.layout = ctx.layout
        self.kv_dtype = ctx.dtype
        self.numerics = ctx.numerics
        self.run = run if run is not None else (lambda fn: fn())
        super().__init__(ctx.adapter.model, ctx.tokenizer, **options)

    def complete(self, prompt, **options):
        """As :meth:`PrefixCache.complete`, run through ``run`` (alone, not batched: the engine's
        own ``complete`` is the batched way)."""
        return self.run(lambda: super(EnginePrefixCache, self).complete(prompt, **options))

    def _make_states(self) -> _RowStates:
        return _RowStates(self.layout, self.kv_dtype, self.device)

    def _root_tag(self) -> str:
        return f"/rows/{self.numerics}"

    def _spill_numerics(self) -> str:
        return f"{self.numerics}/rows"

    def prefill(self, prompt_ids: list[int], *, reuse: bool = True, salt: str = "",
                into: PromptRows | None = None) -> Prefill:
        """As :meth:`PrefixCache.prefill`, run through ``run``; with ``into``
        (:class:`~pckernels.prefix.base.PromptRows`: a view of arena rows) the prompt's states are
        read into those rows, row i holding token i. The engine's scheduler does not call this: it
        reads a prompt a few chunks per step (:meth:`begin`)."""
        return self.run(lambda: super(EnginePrefixCache, self).prefill(prompt_ids, reuse=reuse, salt=salt, into=into))

    def forward_chunk(self, cache: BufferCache, input_ids: torch.Tensor, first_position: int) -> torch.Tensor:
        """One forward of ``input_ids [1, q]`` at positions ``first_position ..`` over rows
        ``0 .. first_position + q - 1`` (causal); logits ``[vocab]`` of its last token."""
        q = input_ids.shape[1]
        end = first_position + q
        cache.buffer.ensure(end)
        cache.prepare(rows=None, start=first_position, extent=end)
        positions = torch.arange(first_position, end, device=self.device)
        keys = torch.arange(end, device=self.device)
        causal = torch.ones(q, end, dtype=torch.bool, device=self.device).tril(first_position)
        bias = torch.zeros(q, end, dtype=self.kv_dtype, device=self.device).masked_fill_(~causal, NEG_INF)
        logits = self.adapter.forward(input_ids, positions[None], AttentionSpec(bias, positions, keys), cache)
        return logits[-1]
