"""The module store: encoded blocks kept on the device, in (pinned) host memory, on disk and,
shared by a fleet, in Redis/Valkey.

See ``docs/store.md``. ``TieredStore`` is what ``PromptCache`` uses; ``BlockKeys`` makes its
content-addressed keys.
"""

from __future__ import annotations

from pathlib import Path

from pckernels.store.blocks import BlockFileError
from pckernels.store.disk import DiskTier, list_blocks
from pckernels.store.keys import FORMAT_VERSION, BlockKey, BlockKeys
from pckernels.store.policy import CostModel, GreedyDualSizePolicy, LRUPolicy
from pckernels.store.remote import RemoteTier, parse_remote_url
from pckernels.store.tiered import TieredStore, parse_budgets, parse_size


def default_store_dir() -> Path:
    """Where ``PromptCache.from_pretrained`` keeps block files: ``<cache_root>/kv``
    (``$PROMPTCACHE_CACHE_DIR`` or the XDG cache directory)."""
    from pckernels.integration.embedded import cache_root

    return cache_root() / "kv"


__all__ = ["BlockFileError", "BlockKey", "BlockKeys", "CostModel", "DiskTier", "FORMAT_VERSION",
           "GreedyDualSizePolicy", "LRUPolicy", "RemoteTier", "TieredStore", "default_store_dir", "list_blocks", "parse_budgets",
           "parse_remote_url", "parse_size"]
