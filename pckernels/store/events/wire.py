"""vLLM's KV-event wire format: msgpack (msgspec) structs; the batch positional, each event a tagged map.

A published message has three frames: the topic, the batch's sequence number (8 bytes,
big-endian, from 0) and the payload, a ``KVEventBatch`` encoded with msgspec's msgpack encoder:
``[ts, [event, ...], data_parallel_rank]``. Each event is a map tagged with its type's name under
``"type"``: ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
"block_size", "lora_id", "medium", "lora_name", "extra_keys"}`` (``extra_keys`` omitted when
``None``), ``{"type": "BlockRemoved", "block_hashes", "medium"}``, ``{"type": "AllBlocksCleared"}``.
This is the named form vLLM publishes since it moved events from positional arrays to maps, and the
one vllm-router 0.1.17's ``kv_aware`` policy decodes (a positional event is dropped there with "KV
event must be a tagged map"); a subscriber declaring fewer fields reads the same bytes, as msgspec
ignores the map keys it does not declare.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A timestamped batch of events (``ts``: seconds since the epoch)."""

    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, tag_field="type"):
    """Base of the three events: maps, tagged with the class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    """Blocks a medium gained: ``block_hashes`` chained from ``parent_block_hash``, holding
    ``token_ids`` (``block_size`` per block); ``extra_keys``: one entry per block (``None`` or a
    tuple of what else its key depends on)."""

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple]]] = None


class BlockRemoved(KVCacheEvent):
    """Blocks a medium lost."""

    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    """Every block of every medium is gone."""


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def batch_events(ledger_events: list[tuple]) -> list[KVCacheEvent]:
    """Ledger events (``pckernels.store.events.ledger``) as wire events, consecutive ones merged:
    stored blocks of one medium and size that chain on each other into one ``BlockStored``,
    removals of one medium into one ``BlockRemoved``."""
    out: list[KVCacheEvent] = []
    for event in ledger_events:
        kind = event[0]
        last = out[-1] if out else None
        if kind == "stored":
            _, medium, info = event
            if (isinstance(last, BlockStored) and last.medium == medium and last.block_size == info.block_size
                    and last.block_hashes[-1] == info.parent and len(info.token_ids) == info.block_size):
                last.block_hashes.append(info.hash)
                last.token_ids.extend(info.token_ids)
                extras = last.extra_keys or [None] * (len(last.block_hashes) - 1)
                extras.append(info.extra)
                last.extra_keys = extras if any(e is not None for e in extras) else None
                continue
            out.append(BlockStored(block_hashes=[info.hash], parent_block_hash=info.parent,
                                   token_ids=list(info.token_ids), block_size=info.block_size, lora_id=None,
                                   medium=medium, lora_name=None,
                                   extra_keys=None if info.extra is None else [info.extra]))
        elif kind == "removed":
            _, medium, block = event
            if isinstance(last, BlockRemoved) and last.medium == medium:
                last.block_hashes.append(block)
            else:
                out.append(BlockRemoved(block_hashes=[block], medium=medium))
        else:
            out.append(AllBlocksCleared())
    return out
