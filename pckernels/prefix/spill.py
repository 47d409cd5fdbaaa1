"""Full prefix blocks demoted to a :class:`~pckernels.store.TieredStore` and brought back from it.

When the prefix cache evicts a full block from memory, its keys/values are written to the tiered
store (the engine's module store: device, host and disk tiers) as one ``[L, 2, H, n, D]`` block.
A later lookup whose in-memory chain ends early continues in the store. When the store has a
remote tier (a fleet sharing Redis/Valkey), every full block is also published there as soon as
it is computed (``publish``: packed and uploaded by the remote tier's writer thread), so another
process's lookup of the same prompt continues from the server. A block of a model with recurrent
layers — keys and values of its attention layers and the recurrent snapshot at its end — is
stored as one byte tensor (:mod:`~pckernels.prefix.packing`), checked against the model's layer
kinds when it comes back.

The store key's digest is ``sha256(format tag, store format version, model identity, device kind,
chain key)``. The chain key already encodes the block and chunk sizes and every token up to the
block's end, so equal digests mean equal states, bit for bit, on the same kind of device.
"""

from __future__ import annotations

import hashlib
import json
import logging

import torch

from pckernels.prefix.blocks import BlockKV, CachedEntry
from pckernels.prefix.packing import pack, unpack
from pckernels.prefix.states import KV
from pckernels.store import FORMAT_VERSION, BlockKey, TieredStore

log = logging.getLogger(__name__)

SPILL_FORMAT = "promptcache-prefix-block/1"
"""Bump when the meaning of a spilled prefix block changes (layout, chunking, key material)."""

SPILL_SCHEMA = "(prefix)"
"""The ``schema`` field of spilled blocks' keys, which tells them apart in store listings."""


class BlockSpill:
    """Writes evicted full blocks of one model to ``store`` and reads them back as entries.

    ``model_id``: identity of config, weights and dtype (``model_fingerprint``); ``device``: where
    restored keys/values go, in ``kv_dtype``; ``num_layers``: cache layers; ``kinds``: their kinds
    (``pckernels.prefix.states``; None: all keys/values) — a model with recurrent layers has its
    blocks packed as bytes; ``model_name``: a label for listings; ``numerics``: what decides the
    blocks' bits in their keys (default: the device kind). Counters: ``spilled_blocks`` (blocks written),
    ``restored_blocks`` / ``restored_tokens`` (blocks and tokens read back). Not thread-safe; the
    owner serialises calls.
    """

    def __init__(self, store: TieredStore, *, model_id: str, device: torch.device, kv_dtype: torch.dtype,
                 num_layers: int, model_name: str = "", numerics: str | None = None,
                 kinds: list[str] | None = None) -> None:
        self.store = store
        self.device = device
        self.kv_dtype = kv_dtype
        self.num_layers = num_layers
        self.model_name = model_name
        self.kinds = list(kinds) if kinds is not None and any(kind != KV for kind in kinds) else None
        """Layer kinds of a model with recurrent layers (its blocks are packed), else None."""
        material = {"format": SPILL_FORMAT, "store_format": FORMAT_VERSION, "model": model_id,
                    "device": numerics or device.type}
        if self.kinds is not None:
            material["packed"] = self.kinds
        self._prefix = json.dumps(material, sort_keys=True).encode()
        self.spilled_blocks = 0
        self.restored_blocks = 0
        self.restored_tokens = 0

    def key(self, chain_key: bytes, start: int, num_tokens: int, info=None) -> BlockKey:
        """The store key of the block named ``chain_key`` covering tokens ``[start, start + num_tokens)``;
        ``info``: its KV-event name (``pckernels.store.events.BlockInfo``), when events are on."""
        digest = hashlib.sha256(self._prefix)
        digest.update(chain_key)
        if self.kinds is not None:
            shape, dtype = (None,), torch.uint8
        else:
            shape, dtype = (self.num_layers, 2, None, num_tokens, None), self.kv_dtype
        return BlockKey(digest.hexdigest(), model=self.model_name, schema=SPILL_SCHEMA, module=f"block@{start}",
                        tokens=num_tokens, shape=shape, dtype=dtype, info=info)

    @property
    def shared(self) -> bool:
        """Whether the store has a remote tier, so new full blocks are published to the fleet."""
        return self.store.remote is not None

    def publish(self, entry: CachedEntry) -> bool:
        """Queue a just-computed full block for the remote tier (packed in the writer thread, not
        kept in the local tiers); returns whether queued."""
        if not self.shared or not self._fits(entry):
            return False
        key = self.key(entry.key, entry.start, entry.num_tokens, entry.info)
        return self.store.publish(key, lambda: self._pack(entry, torch.device("cpu")), entry.nbytes)

    def put(self, entry: CachedEntry) -> bool:
        """Write a full block's keys/values to the store unless it holds them already; returns whether written.

        Blocks whose layers differ in shape (per-layer head counts, keys and values of different
        head sizes) do not fit one ``[L, 2, H, n, D]`` tensor and are not written.
        """
        key = self.key(entry.key, entry.start, entry.num_tokens, entry.info)
        if key in self.store:
            return False
        if not self._fits(entry):
            log.debug("prefix block %s not spilled: its layers' keys/values differ in shape", key.module)
            return False
        self.store.put(key, self._pack(entry, self.store.device))
        self.spilled_blocks += 1
        log.debug("spilled prefix block %s (%d tokens) to the store", key.module, entry.num_tokens)
        return True

    def get(self, chain_key: bytes, parent: CachedEntry | None, start: int, num_tokens: int,
            info=None) -> CachedEntry | None:
        """The entry for ``chain_key`` rebuilt from the store (keys/values are views of the returned
        block, moved to ``device`` when the store lives elsewhere), or ``None`` when no tier has it;
        ``info``: its KV-event name, when events are on."""
        key = self.key(chain_key, start, num_tokens, info)
        block = self.store.get(key)
        if block is None:
            return None
        if self.kinds is not None:
            try:
                kv, states = unpack(block, self.kinds, num_tokens, self.device)
            except ValueError as exc:
                log.warning("ignoring spilled prefix block %s: %s", key.digest[:16], exc)
                return None
            self.restored_blocks += 1
            self.restored_tokens += num_tokens
            return CachedEntry(key=chain_key, parent=parent, start=start, num_tokens=num_tokens, kv=kv, states=states,
                               info=info)
        if block.dim() != 5 or block.shape[:2] != (self.num_layers, 2) or block.shape[3] != num_tokens:
            log.warning("ignoring spilled prefix block %s of shape %s (expected [%d, 2, H, %d, D])",
                        key.digest[:16], tuple(block.shape), self.num_layers, num_tokens)
            return None
        block = block.to(device=self.device, dtype=self.kv_dtype)
        kv = BlockKV.of(block)
        self.restored_blocks += 1
        self.restored_tokens += num_tokens
        return CachedEntry(key=chain_key, parent=parent, start=start, num_tokens=num_tokens, kv=kv, info=info)


    def _fits(self, entry: CachedEntry) -> bool:
        """Whether ``entry`` can be stored: packed (models with recurrent layers), or its layers'
        keys and values all of one shape."""
        return self.kinds is not None or _uniform(entry)

    def _pack(self, entry: CachedEntry, device: torch.device) -> torch.Tensor:
        if self.kinds is not None:
            return pack(entry.kv, entry.states, device)
        return _pack(entry.kv, device)


def _uniform(entry: CachedEntry) -> bool:
    """Whether every layer's keys and values have one shape (so they fit one ``[L, 2, H, n, D]`` block)."""
    first_keys = entry.kv[0][0]
    return all(k.shape == first_keys.shape and v.shape == first_keys.shape for k, v in entry.kv)


def _pack(kv: list, device: torch.device) -> torch.Tensor:
    """Per-layer ``(keys, values)`` of shape ``[1, H, n, D]`` as one block ``[L, 2, H, n, D]`` on ``device``."""
    if isinstance(kv, BlockKV) and kv.block.device == device:
        return kv.block.clone()
    first_keys = kv[0][0]
    _, heads, num_tokens, head_dim = first_keys.shape
    block = torch.empty((len(kv), 2, heads, num_tokens, head_dim), dtype=first_keys.dtype, device=device)
    for layer, (keys, values) in enumerate(kv):
        block[layer, 0].copy_(keys[0])
        block[layer, 1].copy_(values[0])
    return block
