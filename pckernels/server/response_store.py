"""Stored responses of the Responses API (``store: true``): per tenant, bounded in count and age.

A stored response keeps its body (``GET /v1/responses/{id}``), the conversation it ended (chat
messages, the answer included) and that conversation's token ids (its prompt's and its answer's),
so a request naming it as ``previous_response_id`` continues the very tokens the cache holds:
exact prefix reuse covers the whole earlier conversation. Tenants never see each other's.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_MAX = 1000
"""Responses kept per tenant (the oldest go first)."""
DEFAULT_TTL_S = 3600.0
"""Seconds a stored response is kept."""


@dataclass
class StoredResponse:
    """One stored response: its ``body``, the conversation's ``messages`` (answer included), its
    token ids ``ids`` (prompt + answer), the ``tools`` it was given and when it was kept."""

    body: dict
    messages: list[dict]
    ids: list[int]
    tools: list[dict] | None = None
    kept: float = 0.0
    """``time.monotonic()`` when stored (``ResponseStore.put`` sets it)."""


class ResponseStore:
    """Stored responses per tenant: at most ``max_count`` each, each for ``ttl_s`` seconds."""

    def __init__(self, max_count: int = DEFAULT_MAX, ttl_s: float = DEFAULT_TTL_S) -> None:
        if max_count < 0 or ttl_s <= 0:
            raise ValueError("the response store needs max_count >= 0 and ttl_s > 0")
        self.max_count, self.ttl_s = max_count, ttl_s
        self._by_tenant: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._lock = threading.Lock()

    def put(self, tenant: str, record: StoredResponse) -> None:
        """Keep ``record`` for ``tenant`` (evicting its oldest past the bound)."""
        if self.max_count == 0:
            return
        with self._lock:
            record.kept = time.monotonic()
            kept = self._by_tenant.setdefault(tenant, OrderedDict())
            self._expire(kept)
            kept[record.body["id"]] = record
            while len(kept) > self.max_count:
                kept.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """``tenant``'s stored response ``response_id``; None when unknown, expired or evicted."""
        with self._lock:
            kept = self._by_tenant.get(tenant)
            if kept is None:
                return None
            self._expire(kept)
            return kept.get(response_id)

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            return self._by_tenant.get(tenant, {}).pop(response_id, None) is not None

    def _expire(self, kept: OrderedDict[str, StoredResponse]) -> None:
        limit = time.monotonic() - self.ttl_s
        while kept and next(iter(kept.values())).kept < limit:
            kept.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._by_tenant.values())
