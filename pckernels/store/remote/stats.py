"""The remote tier's counters (``RemoteTier.describe`` reports them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pckernels.store.blocks import TierStats


@dataclass
class RemoteStats(TierStats):
    """The remote tier's counters (``RemoteTier.describe``)."""

    misses: int = 0
    bytes_read: int = 0
    read_s: float = 0.0
    bytes_written: int = 0
    present: int = 0
    """Writes skipped because the server already held the block (another process wrote it)."""
    lost_races: int = 0
    """Complete uploads that found another copy set meanwhile (their chunks were deleted)."""
    dropped_writes: int = 0
    """Writes not made: the write queue was full, the server was unreachable or refused (full)."""
    errors: int = 0
    """Connection errors and timeouts (and, on a cluster, its being down or lacking a slot's master)."""
    node_errors: dict[str, int] = field(default_factory=dict)
    """Of ``errors``, those of one cluster master, by its ``host:port``."""
    reconnects: int = 0
