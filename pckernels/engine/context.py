"""What the engine's rooms may know of the engine: one typed context instead of the whole front object.

The scheduler, block placement, deviation scoring and the prefix rows read the model through an
:class:`EngineContext` (adapter, KV layout, dtype, device, tokenizer, end-of-sequence ids,
positions, the model lock) and get module blocks from a :class:`BlockSource`
(:class:`~pckernels.engine.blocks.ModuleBlocks` in the engine). :class:`~pckernels.engine.PromptCache`
builds both; nothing below it holds the façade.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pckernels.engine.plan import BlockRef
from pckernels.integration.adapters import ModelAdapter
from pckernels.integration.attention import KVLayout
from pckernels.integration.positions import KeyRotation
from pckernels.pml.model import Schema


class BlockSource(Protocol):
    """Where a request's module blocks come from, and under which keys the arena keeps them."""

    def arena_key(self, schema: Schema, ref: BlockRef) -> Hashable:
        """The key a block placed for ``ref`` is kept under in the arena (moved blocks apart)."""

    def fetch_block(self, schema: Schema, module: str, scaffold: str = "", geometry: str = "schema") -> torch.Tensor:
        """A module's block ``[L, 2, H, n, D]``, encoded if no tier holds it (model thread only)."""

    def block_positions(self, schema: Schema, module: str, scaffold: str = "",
                        geometry: str = "schema") -> torch.Tensor:
        """Positions ``[n]`` (device) the block was encoded at."""

    def key_rotation(self) -> KeyRotation:
        """How the model's cached keys move with their position."""

    def prefetch_siblings(self, schema: Schema, modules: list[str]) -> None:
        """Stage the union siblings of ``modules`` (likely next) closer to the device."""


@dataclass(frozen=True)
class EngineContext:
    """The model an engine serves and how to reach it (module docstring).

    ``eos_ids``: ids that end a generation; ``max_positions``: positions the model takes
    (``None``: no limit); ``numerics``: what besides model and tokenizer decides a block's bits
    (``PromptCache.numerics``); ``model_lock``: held by whoever runs the model. ``layout`` and
    ``blocks`` are None for models with recurrent layers (no module reuse: a module's recurrent
    state depends on everything before it).
    """

    adapter: ModelAdapter
    tokenizer: Any
    layout: KVLayout | None
    dtype: torch.dtype
    device: torch.device
    eos_ids: frozenset[int]
    max_positions: int | None
    numerics: str
    model_lock: threading.RLock
    blocks: BlockSource | None
