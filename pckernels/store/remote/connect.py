"""The remote tier's client: one Redis/Valkey server, or a Redis Cluster / Valkey cluster.

A ``redis+cluster://`` URL (``rediss+``, ``valkey+``, ``valkeys+``) names one or more nodes of a
cluster; a plain ``redis://`` URL may name a node of one too: the first connection asks it
(``INFO cluster``, ``cluster_enabled:1``) and switches to ``redis.cluster.RedisCluster``, which
keeps the slot map and sends each key to the master holding its slot. The client is made on first
use, inside the tier's fault handling (``health.py``), so a server or cluster that is down when the
tier is made costs misses, not a failed start. No client-side retries in either mode: the tier's
back-off decides when to try again.
"""

from __future__ import annotations

import logging
import threading

from pckernels.store.remote.url import cluster_nodes, redact

log = logging.getLogger(__name__)


class Connector:
    """The client for ``url`` (checked by ``parse_remote_url``), made on first use.

    ``timeout_s`` / ``connect_timeout_s``: per socket operation. ``client``: a ready client (tests):
    a ``RedisCluster`` is used in cluster mode, anything else as one server. Thread-safe.
    """

    def __init__(self, url: str, timeout_s: float, connect_timeout_s: float, client=None) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        from redis.cluster import RedisCluster

        self.url = url
        self._redis = redis
        self._cluster_class = RedisCluster
        self._options = dict(socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s,
                             retry_on_timeout=False)
        self._no_retry = lambda: Retry(NoBackoff(), 0)
        self._lock = threading.Lock()
        self._client = client
        self._cluster: bool | None = isinstance(client, RedisCluster) if client is not None else (
            True if cluster_nodes(url) is not None else None)
        """Whether the server is a cluster: known from a cluster URL or a given client, otherwise
        from the first connection (``None`` until then)."""

    @property
    def cluster(self) -> bool:
        """Whether the server is a cluster (for a plain URL, ``False`` until the first connection tells)."""
        return bool(self._cluster)

    @property
    def client(self):
        """The ``redis.Redis`` or ``redis.cluster.RedisCluster``, connected (and the mode detected) on
        first use; ``redis.ConnectionError`` when that cannot be done now."""
        client = self._client
        if client is not None:
            return client
        with self._lock:
            if self._client is None:
                self._client, self._cluster = self._connect()
            return self._client

    def _connect(self):
        redis = self._redis
        nodes = cluster_nodes(self.url)
        if nodes is None:
            single = redis.Redis.from_url(self.url, retry=self._no_retry(), health_check_interval=0, **self._options)
            try:
                enabled = single.info("cluster").get("cluster_enabled")
            except redis.ResponseError as exc:
                if "cluster mode" in str(exc):  # the SELECT of a database other than 0, refused by a cluster node
                    single.close()
                    # A fault like an unreachable server (logged, retried with back-off) until the URL is fixed.
                    raise redis.ConnectionError(f"{redact(self.url)} is a node of a cluster, which has only "
                                                f"database 0 ({exc})") from None
                log.info("remote tier %s: INFO cluster refused (%s); using it as one server", redact(self.url), exc)
                return single, False
            except BaseException:
                single.close()
                raise
            if not enabled:
                return single, False
            single.close()
            log.info("remote tier %s is a node of a cluster; using the cluster client", redact(self.url))
            nodes = [self.url]
        return self._cluster_client(nodes), True

    def _cluster_client(self, urls: list[str]):
        from redis.cluster import ClusterNode
        from redis.connection import parse_url

        first, *others = urls
        try:
            startup = [ClusterNode(o["host"], o.get("port", 6379)) for o in map(parse_url, others)]
            return self._cluster_class(url=first, startup_nodes=startup, retry=self._no_retry(),
                                       require_full_coverage=False, **self._options)
        except self._redis.RedisError:
            raise
        except Exception as exc:  # RedisClusterException: no node reachable, or no slot map yet
            raise self._redis.ConnectionError(f"cannot reach the cluster: {exc}") from exc

    def node_of(self, key: str) -> str:
        """``host:port`` of the cluster master holding ``key``'s slot by the client's slot map; ``""``
        for one server, before the first connection, or when no node holds the slot."""
        client = self._client
        if not self._cluster or client is None:
            return ""
        try:
            return client.get_node_from_key(key).name
        except Exception:  # SlotNotCoveredError: the slot map lacks it (being refreshed)
            return ""

    def nodes(self) -> list[str]:
        """``host:port`` of the cluster's masters as the client knows them (empty for one server)."""
        client = self._client
        if not self._cluster or client is None:
            return []
        try:
            return sorted(node.name for node in client.get_primaries())
        except Exception:
            return []

    def close(self) -> None:
        """Close the connections (a later use connects again)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
