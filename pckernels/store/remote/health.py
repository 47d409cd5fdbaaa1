"""Whether the remote server answers: a fault costs the local tiers a miss, never a failed request.

A connection error or timeout puts the server in back-off (no remote calls for ``backoff_s[0]``,
0.25 s by default, doubling up to ``backoff_s[1]``, 30 s) with one warning; after it a single
call probes the server again, and the first answer ends the back-off.

On a cluster the back-off is per master: a call about a key goes to the master holding the key's
slot (``Connector.node_of``), and only that master's fault pauses the calls about its keys, so a
dead master costs the misses of its slots while the others serve theirs. Faults are counted per
master too (``RemoteStats.node_errors``). Cluster-wide faults (no node reachable, the cluster
reporting ``CLUSTERDOWN``, a slot no master holds) pause every call, like a single server's. When
the cluster reconfigures (a replica takes a dead master's slots over), redis-py refreshes its slot
map on the next fault, calls go to the new master, and the old one's back-off is forgotten.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from pckernels.store.remote.connect import Connector
from pckernels.store.remote.stats import RemoteStats
from pckernels.store.remote.url import redact

log = logging.getLogger(__name__)

WHOLE = ""
"""The back-off state of the whole server or cluster (the only one for a single server)."""


@dataclass
class _State:
    down_until: float = 0.0
    backoff: float = 0.0
    reason: str | None = None


def fault_types() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "the server (or a master) cannot answer now": connection errors,
    timeouts, and a cluster that is down, failing over or lacks a slot's master."""
    import redis
    from redis.exceptions import ClusterDownError, RedisClusterException, TryAgainError

    return (redis.ConnectionError, redis.TimeoutError, ClusterDownError, TryAgainError, RedisClusterException)


class Health:
    """The back-off state of the server at ``url`` (per master of a cluster, through ``connector``);
    every server call goes through :meth:`call`. Faults and reconnects are counted in ``stats``
    under ``lock`` (the tier's)."""

    def __init__(self, url: str, backoff_s: tuple[float, float], stats: RemoteStats, lock: threading.Lock,
                 connector: Connector | None = None) -> None:
        self.url = url
        self.backoff_s = (float(backoff_s[0]), float(backoff_s[1]))
        self.stats = stats
        self.connector = connector
        self._lock = lock
        self._faults = fault_types()
        self._states: dict[str, _State] = {}
        """node (``host:port``, or ``WHOLE``) -> its back-off; only nodes that faulted."""

    @property
    def available(self) -> bool:
        """Whether calls may go to the server now (it is not in back-off as a whole)."""
        return self._ready(WHOLE)

    def available_for(self, key: str) -> bool:
        """Whether a call about the server key ``key`` may go now (neither the server nor, on a
        cluster, the master holding ``key`` is in back-off)."""
        return self._ready(WHOLE) and self._ready(self._node(key))

    @property
    def down_reason(self) -> str | None:
        """Why the server, or a master of the cluster, is considered down (``None`` while all answer)."""
        with self._lock:
            reasons = [(node, s.reason) for node, s in sorted(self._states.items()) if s.reason is not None]
        if not reasons:
            return None
        node, reason = reasons[0]
        return reason if node == WHOLE else f"node {node}: {reason}"

    def nodes_down(self) -> list[str]:
        """The cluster masters in back-off now (``host:port``)."""
        with self._lock:
            return sorted(node for node, s in self._states.items() if node != WHOLE and s.reason is not None)

    def call(self, doing: str, fn: Callable, default=None, key: str | None = None):
        """``fn()`` unless in back-off (the whole server, or the master holding the server key ``key``);
        a fault starts that back-off and gives ``default``."""
        node = self._node(key)
        if not (self._ready(WHOLE) and self._ready(node)):
            return default
        try:
            out = fn()
        except self._faults as exc:
            # A keyed call that failed for the cluster as a whole (CLUSTERDOWN, no slot map) pauses all.
            whole = node == WHOLE or self._cluster_wide(exc)
            self._fault(exc, doing, WHOLE if whole else node)
            return default
        self._answered(node)
        if node != WHOLE:
            self._answered(WHOLE)
            if len(self._states) > 1 or WHOLE not in self._states:
                self._forget_gone()
        return out

    def _node(self, key: str | None) -> str:
        if key is None or self.connector is None:
            return WHOLE
        return self.connector.node_of(key) or WHOLE

    def _ready(self, node: str) -> bool:
        state = self._states.get(node)
        return state is None or time.monotonic() >= state.down_until

    @staticmethod
    def _cluster_wide(exc: BaseException) -> bool:
        from redis.exceptions import ClusterDownError, RedisClusterException

        return isinstance(exc, (ClusterDownError, RedisClusterException))

    def _fault(self, exc: Exception, doing: str, node: str) -> None:
        with self._lock:
            self.stats.errors += 1
            if node != WHOLE:
                self.stats.node_errors[node] = self.stats.node_errors.get(node, 0) + 1
            state = self._states.setdefault(node, _State())
            first_s, max_s = self.backoff_s
            first = state.reason is None
            state.backoff = first_s if first else min(state.backoff * 2, max_s)
            state.down_until = time.monotonic() + state.backoff
            state.reason = f"{type(exc).__name__}: {exc}"
        if first:
            where = redact(self.url) if node == WHOLE else f"{redact(self.url)} (cluster node {node})"
            log.warning("remote tier %s unreachable while %s (%s); serving from local tiers and retrying "
                        "with back-off", where, doing, state.reason)

    def _forget_gone(self) -> None:
        """End the back-off of masters that hold no slots any more (a replica took them over, or they
        were resharded away): the cluster recovered without them."""
        masters = set(self.connector.nodes())
        if not masters:
            return
        with self._lock:
            gone = [node for node, s in self._states.items()
                    if node != WHOLE and node not in masters and s.reason is not None]
            for node in gone:
                del self._states[node]
                self.stats.reconnects += 1
        for node in gone:
            log.warning("remote tier %s: cluster node %s holds no slots any more (failed over or resharded); "
                        "its keys are served by their new masters", redact(self.url), node)

    def _answered(self, node: str) -> None:
        state = self._states.get(node)
        if state is None or state.reason is None:
            return
        with self._lock:
            if state.reason is None:
                return
            state.reason = None
            state.backoff = 0.0
            state.down_until = 0.0
            self.stats.reconnects += 1
        where = redact(self.url) if node == WHOLE else f"{redact(self.url)} (cluster node {node})"
        log.warning("remote tier %s answers again", where)
