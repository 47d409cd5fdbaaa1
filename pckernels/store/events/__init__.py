"""KV events: which blocks this process gains and loses, per tier, published in vLLM's wire format.

``config.py`` (:class:`KVEventsConfig`, vLLM's ``--kv-events-config`` fields), ``ledger.py`` (what
the store's places hold, per medium, and the events that say so), ``wire.py`` (the msgspec
structs), ``publisher.py`` (the ZeroMQ thread, replay; imported only when events are on). See
``docs/kv-events.md``.
"""

from __future__ import annotations

from pckernels.store.events.config import KVEventsConfig, kv_events_config
from pckernels.store.events.ledger import (MEDIUMS, NO_PLACE, PREFIX_MEDIUM, BlockInfo, BlockLedger, Place,
                                           chain_hash, digest_hash, prefix_block_info, salt_tag)


def start_publisher(config: KVEventsConfig):
    """A running :class:`~pckernels.store.events.publisher.KVEventPublisher` for an active
    ``config`` (sockets bound now: ``KVEventsBindError``, an ``OSError``, when they cannot be)."""
    from pckernels.store.events.publisher import KVEventPublisher

    return KVEventPublisher(config)


__all__ = ["BlockInfo", "BlockLedger", "KVEventsConfig", "MEDIUMS", "NO_PLACE", "PREFIX_MEDIUM", "Place",
           "chain_hash", "digest_hash", "kv_events_config", "prefix_block_info", "salt_tag", "start_publisher"]
