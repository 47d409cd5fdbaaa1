"""Encoding modules once: each module's KV block at its schema positions, over its ancestors
(or, for compact placement, *packed*: its unit right after the anonymous text before it).

A module's tokens are read in one forward that attends, causally by position, to the module's
ancestors' blocks (placed in a private assembly buffer) and to its own earlier tokens; a
scaffold's members are read together. The blocks ``[L, 2, H, n, D]`` go to the tiered store.
The encoder's buffer is its own, so encoding never touches rows of requests in flight. Each unit
runs under the engine's model lock (``lock``), so a long schema interleaves with the scheduler's
steps instead of stalling them. With a remote tier, a unit another process is encoding (it holds
the unit's lease) is waited for, outside the model lock, and read from the server instead.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from pckernels import ops
from pckernels.engine.buffer import AssemblyBuffer, BufferCache, Placement
from pckernels.integration.adapters import ModelAdapter
from pckernels.integration.attention import KVLayout
from pckernels.pml.model import ROOT, Schema
from pckernels.pml.placement import encoded_positions, root_before, unit_span
from pckernels.store import BlockKey, TieredStore

log = logging.getLogger(__name__)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def units(schema: Schema) -> list[tuple[str, tuple[str, ...]]]:
    """The encoding units of ``schema``: ``("", (module,))`` per cached module, then
    ``(scaffold, members)`` per scaffold (its members are encoded together)."""
    out: list[tuple[str, tuple[str, ...]]] = [("", (name,)) for name, m in schema.modules.items() if m.cached]
    return out + [(s.name, s.members) for s in schema.scaffolds.values()]


def geometry_units(schema: Schema, geometries: tuple[str, ...] = ("schema",)) -> list[tuple[str, tuple[str, ...], str]]:
    """``(scaffold, members, geometry)`` for every unit in each of ``geometries``; the root is
    only ever encoded at schema positions (packed blocks read it as their context)."""
    out: list[tuple[str, tuple[str, ...], str]] = []
    for geometry in geometries:
        for scaffold, members in units(schema):
            unit = (scaffold, members, "schema" if members[0] == ROOT else geometry)
            if unit not in out:
                out.append(unit)
    return out


class ModuleEncoder:
    """Encodes the modules of schemas into ``store`` under the keys ``block_key`` makes.

    A unit longer than ``run_tokens`` is read in runs of that many tokens, each over the rows
    before it (as prompts are read), so the mask is ``[run, rows]`` instead of ``[n, n]`` (4 GiB
    in fp32 for a 32K-token module). Units whose positions repeat are read in one forward."""

    run_tokens = 4096

    def __init__(self, adapter: ModelAdapter, store: TieredStore, layout: KVLayout, *, dtype: torch.dtype,
                 device: torch.device, block_key: Callable[..., BlockKey],
                 lock: threading.RLock | None = None, run: Callable[[Callable], object] | None = None) -> None:
        self.adapter = adapter
        self.lock = lock if lock is not None else threading.RLock()
        self.run = run if run is not None else self._run_locked
        """``run(fn)``: where encoding work runs (the engine's model thread; by default here, under ``lock``)."""
        self.store = store
        self.device = device
        self.block_key = block_key
        self.buffer = AssemblyBuffer(layout, dtype=dtype, device=device)
        self.cache = BufferCache(self.buffer)
        self._positions: dict[tuple[str, str], dict[BlockKey, torch.Tensor]] = {}

    @torch.inference_mode()
    def encode_schema(self, schema: Schema, *, progress: bool = False,
                      on_progress: Callable[[int, int], None] | None = None,
                      geometries: tuple[str, ...] = ("schema",)) -> None:
        """Encode every cached module and scaffold of ``schema`` that no tier holds yet, in each of
        ``geometries`` (``pckernels.pml.placement``); ``on_progress(done, total)`` is called before
        the first unit and after each one."""
        todo = [u for u in geometry_units(schema, geometries)
                if self.block_key(schema, u[1][0], u[0], u[2]) not in self.store]
        if not todo:
            return
        t0 = time.perf_counter()
        tokens = sum(len(schema.modules[m].token_ids) for _, members, _ in todo for m in members)
        iterator = todo
        if progress:
            from rich.progress import track

            iterator = track(todo, description=f"encoding {schema.name}", transient=True)
        if on_progress is not None:
            on_progress(0, len(todo))
        for done, (scaffold, members, geometry) in enumerate(iterator, 1):
            key = self.block_key(schema, members[0], scaffold, geometry)
            if self.store.claim(key) or not self.store.wait_for(key):
                encoded = False
                try:
                    encoded = self.run(lambda: key not in self.store
                                       and self.encode_unit(schema, scaffold, members, geometry) is not None)
                finally:
                    if not encoded:
                        self.store.release(key)
            if on_progress is not None:
                on_progress(done, len(todo))
        log.info("encoded %d blocks (%d tokens) of schema %r in %.2f s", len(todo), tokens, schema.name,
                 time.perf_counter() - t0)

    def _run_locked(self, fn):
        with self.lock:
            return fn()

    def warm(self, schema: Schema, geometries: tuple[str, ...] = ("schema",)) -> int:
        """Start loading, in the background, the blocks of ``schema`` that only the fleet's remote
        tier holds, so later queries find them in local memory; returns how many reads started."""
        return self.store.warm(self.block_keys(schema, geometries))

    def block_keys(self, schema: Schema, geometries: tuple[str, ...] = ("schema",)) -> list[BlockKey]:
        """The store keys of every block of ``schema`` (each cached module, each scaffold member)
        in each of ``geometries``."""
        return [self.block_key(schema, member, scaffold, geometry)
                for scaffold, members, geometry in geometry_units(schema, geometries) for member in members]

    @torch.inference_mode()
    def encode_unit(self, schema: Schema, scaffold: str, members: tuple[str, ...],
                    geometry: str = "schema") -> dict[str, torch.Tensor]:
        """Encode ``members`` (one module, or a scaffold's members jointly) over their ancestors'
        blocks, attending causally by position, at the positions of ``geometry`` (packed: the unit
        right after the anonymous text before it, which alone of the root's rows it sees); store
        and return one block per member."""
        modules = schema.modules
        geometry = "schema" if members[0] == ROOT else geometry
        context = []
        for ancestor in reversed(modules[members[0]].ancestors(modules)):
            rows = len(modules[ancestor].token_ids)
            if ancestor == ROOT and geometry == "packed":
                rows = root_before(schema, unit_span(schema, members[0], scaffold)[0])
            context.append((ancestor, "schema" if ancestor == ROOT else geometry, rows))
        own = sorted((p, t, m) for m in members
                     for p, t in zip(encoded_positions(schema, m, geometry, scaffold), modules[m].token_ids))
        buf = self.buffer
        ctx_rows = sum(rows for _, _, rows in context)
        total = ctx_rows + len(own)
        buf.ensure_capacity(total)
        self._place_context(schema, context)
        t0 = time.perf_counter()
        if own:
            positions = torch.tensor([p for p, _, _ in own], dtype=torch.long, device=self.device)
            buf.row_pos[ctx_rows:total] = positions
            buf.row_bias[:total] = 0
            ids = torch.tensor([[t for _, t, _ in own]], dtype=torch.long, device=self.device)
            increasing = len(own) > self.run_tokens and bool((positions[1:] > positions[:-1]).all())
            step = self.run_tokens if increasing else len(own)
            for first in range(0, len(own), step):
                last = min(first + step, len(own))
                self.cache.prepare(rows=None, start=ctx_rows + first, extent=ctx_rows + last)
                self.adapter.forward(ids[:, first:last], positions[None, first:last],
                                     buf.attention(positions[first:last], ctx_rows + last), self.cache)
            buf.invalidate_rows(ctx_rows, total)
        offset = ctx_rows
        encoded = {}
        for member in members:
            n = len(modules[member].token_ids)
            rows = [offset + i for i, (_, _, m) in enumerate(own) if m == member]
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            block = buf.data.index_select(3, index) if n else buf.data[:, :, :, :0].clone()
            self.store.put(self.block_key(schema, member, scaffold, geometry), block)
            encoded[member] = block
        sync(self.device)
        self.store.record_encode(len(members), time.perf_counter() - t0)
        return encoded

    def _place_context(self, schema: Schema, context: list[tuple[str, str, int]]) -> None:
        """Put the first ``rows`` rows of each ``(module, geometry, rows)`` block in consecutive
        rows from 0 with one gather-concat over the row ranges that do not already hold them; set
        their positions. Blocks no tier holds are encoded first (which uses this buffer and may
        displace rows, hence the loop)."""
        buf = self.buffer
        placements, row = [], 0
        for module, geometry, rows in context:
            placements.append(Placement(self.block_key(schema, module, "", geometry), 0, row, rows))
            row += rows
        fetched: dict[BlockKey, torch.Tensor] = {}
        while lacking := [(c, p.key) for c, p in zip(context, placements)
                          if p.n_rows and p.key not in fetched and buf.missing(p)]:
            for (module, geometry, _), key in lacking:
                fetched[key] = self.fetch(schema, module, "", geometry)
        sources: list[torch.Tensor] = []
        table: list[tuple[int, int, int, int]] = []
        for (module, geometry, rows), placement in zip(context, placements):
            gaps = buf.missing(placement) if placement.n_rows else []
            if gaps:
                sources.append(fetched[placement.key])
                table.extend((len(sources) - 1, g.src_row, g.dst_row, g.n_rows) for g in gaps)
                buf.row_pos[placement.dst_row:placement.dst_row + placement.n_rows] = self.positions(
                    schema, module, placement.key, geometry)[:rows]
                buf.mark_resident(placement)
        if table:
            ops.gather_concat(buf.data, sources, torch.tensor(table, dtype=torch.int64))

    def fetch(self, schema: Schema, module: str, scaffold: str, geometry: str = "schema") -> torch.Tensor:
        """The block ``[L, 2, H, n, D]`` from the store, re-encoded (its whole scaffold) if no tier holds it."""
        block = self.store.get(self.block_key(schema, module, scaffold, geometry))
        if block is None:
            members = schema.scaffolds[scaffold].members if scaffold else (module,)
            block = self.encode_unit(schema, scaffold, members, geometry)[module]
        return block

    def positions(self, schema: Schema, module: str, key: BlockKey, geometry: str = "schema",
                  scaffold: str = "") -> torch.Tensor:
        """Positions ``[n]`` a block's rows were encoded at (on the device, made once per key; kept
        for the current version of each schema name only)."""
        memo = self._positions.setdefault((schema.salt, schema.name), {})
        positions = memo.get(key)
        if positions is None:
            positions = torch.tensor(encoded_positions(schema, module, geometry, scaffold), dtype=torch.long,
                                     device=self.device)
            memo[key] = positions
        return positions

    def forget(self, schema_name: str, salt: str = "") -> None:
        """Drop the position memo of a schema name (a new version replaces it)."""
        self._positions.pop((salt, schema_name), None)
