"""Where encoded module KV blocks live between prompts.

A block is ``[L, 2, H, n, D]`` (layers, key/value, KV heads, the module's own tokens, head
dim) in the model's dtype, keyed by ``BlockKey``. This is the resident (in-memory) tier.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockKey:
    """Identifies one encoded block: a module of a schema, encoded alone (``scaffold=""``)
    or jointly within ``scaffold``. ``schema_digest`` covers the schema text, its sources and
    the tokenizer; ``model_id`` the model (config, weights identity, dtype)."""

    model_id: str
    schema_digest: str
    module: str
    scaffold: str = ""


class MemoryStore:
    """Blocks held on one device, in insertion/use order."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[BlockKey, torch.Tensor] = OrderedDict()

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: BlockKey) -> torch.Tensor:
        block = self._blocks[key]
        self._blocks.move_to_end(key)
        return block

    def put(self, key: BlockKey, block: torch.Tensor) -> None:
        self._blocks[key] = block
        self._blocks.move_to_end(key)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._blocks.values())

    def clear(self) -> None:
        self._blocks.clear()
