"""The remote tier: encoded blocks shared by a fleet of processes through Redis or Valkey, one
server or a cluster (``connect.py``: ``redis+cluster://`` or any node's URL, detected).

A block is JSON metadata plus chunks of its bytes, checked on read (``wire.py``). Writes are
idempotent and never on a request's critical path: a background thread uploads them
(``writer.py``) and the first complete copy wins. Encoding leases keep a fleet from encoding one
block many times at once (``leases.py``). Faults degrade to the local tiers: the tier backs off
and probes the server again (``health.py``). Eviction is left to the server
(``maxmemory-policy allkeys-lru``): a block whose chunk was evicted is found incomplete and
deleted. :class:`RemoteTier` (``tier.py``) is what ``TieredStore`` uses.
"""

from pckernels.store.remote.stats import RemoteStats
from pckernels.store.remote.tier import DEFAULT_NAMESPACE, RemoteTier
from pckernels.store.remote.url import parse_remote_url, redact
from pckernels.store.remote.wire import REMOTE_FORMAT

__all__ = ["DEFAULT_NAMESPACE", "REMOTE_FORMAT", "RemoteStats", "RemoteTier", "parse_remote_url", "redact"]
