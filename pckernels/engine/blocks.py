"""Module blocks as the engine addresses them: store keys, arena keys, fetching, positions, moving.

:class:`ModuleBlocks` is the engine's :class:`~pckernels.engine.context.BlockSource`: it names a
module's block in the tiered store (model, tokenizer, numerics, schema, module, scaffold,
geometry), fetches it (encoding it when no tier holds it), knows the positions it was encoded at,
and whether this model's cached keys can move to other positions (compact placement), probed
once on the model thread.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from pckernels.engine.encoder import ModuleEncoder
from pckernels.engine.plan import BlockRef
from pckernels.errors import PMLError
from pckernels.integration.adapters import ModelAdapter
from pckernels.integration.positions import KeyRotation, probe_key_rotation
from pckernels.pml.model import Schema
from pckernels.store import BlockKey, BlockKeys, TieredStore


class ModuleBlocks:
    """Blocks of one engine's schemas (module docstring). ``keys`` names them in ``store``;
    ``run(fn)`` runs model work on the engine's model thread (the key-rotation probe)."""

    def __init__(self, adapter: ModelAdapter, store: TieredStore, encoder: ModuleEncoder, keys: BlockKeys,
                 run: Callable[[Callable], object]) -> None:
        self.adapter = adapter
        self.store = store
        self.encoder = encoder
        self.keys = keys
        self.run = run
        self._rotation: KeyRotation | None = None

    def block_key(self, schema: Schema, module: str, scaffold: str = "", geometry: str = "schema") -> BlockKey:
        """The store key of ``module``'s block in ``schema`` (jointly encoded within ``scaffold``;
        ``geometry="packed"``: the encoding compact placement reads, ``pckernels.pml.placement``)."""
        return self.keys(schema, module, scaffold, geometry)

    def arena_key(self, schema: Schema, ref: BlockRef) -> Hashable:
        """What a block placed for ``ref`` is kept under in the arena: its store key, with the
        shifts it was moved by when they are not zero (a moved block has other keys)."""
        key = self.block_key(schema, ref.module, ref.scaffold, ref.geometry)
        return (key, ref.shifts) if ref.shifts else key

    def fetch_block(self, schema: Schema, module: str, scaffold: str = "", geometry: str = "schema") -> torch.Tensor:
        """A module's block ``[L, 2, H, n, D]`` from the store, encoded again if no tier holds it
        (call with the model lock held)."""
        return self.encoder.fetch(schema, module, scaffold, geometry)

    def block_positions(self, schema: Schema, module: str, scaffold: str = "",
                        geometry: str = "schema") -> torch.Tensor:
        """Positions ``[n]`` (device) the block of ``module`` was encoded at."""
        key = self.block_key(schema, module, scaffold, geometry)
        return self.encoder.positions(schema, module, key, geometry, scaffold)

    def key_rotation(self) -> KeyRotation:
        """How this model's cached keys move with their position (probed once, on the model
        thread: a probe forward on the caller's thread would give it an OpenMP team of its own
        and slow every later step, :mod:`pckernels.engine.threads`)."""
        if self._rotation is None:
            def probe() -> KeyRotation:
                if self._rotation is None:
                    self._rotation = probe_key_rotation(self.adapter)
                return self._rotation

            return self.run(probe)
        return self._rotation

    def check_movable(self, location: tuple[int | None, int | None], what: str, label: str | None = None) -> None:
        """A located ``PMLError`` when this model's blocks cannot be moved (compact placement)."""
        rotation = self.key_rotation()
        if not rotation.movable:
            line, column = location
            raise PMLError(f"{what}, but this model cannot move cached modules to other positions: "
                           f"{rotation.reason}; use placement=\"schema\"", line=line, column=column, source=label)

    def prefetch_siblings(self, schema: Schema, modules: list[str]) -> None:
        """Stage the union siblings of ``modules`` (likely next) closer to the device."""
        used = set(modules)
        unions = {schema.modules[m].union for m in used} - {None}
        siblings = [m for u in sorted(unions) for m in schema.unions.get(u, ()) if m not in used]
        self.store.prefetch(self.block_key(schema, sibling) for sibling in siblings)
