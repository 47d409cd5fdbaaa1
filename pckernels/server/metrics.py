"""Prometheus metrics of one server (its own registry, so several apps can live in a process).

Request-side series are updated as requests run; engine-side ones (queue depth, running
requests, store hits / misses / evictions per tier, prefix-cache hits) are read from
the engine's ``stats()`` at scrape time by a custom collector.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pckernels.server.engine import ServingEngine

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_GAP = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The series ``/metrics`` exposes (all prefixed ``promptcache_``)."""

    def __init__(self, engine: ServingEngine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("promptcache_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("promptcache_time_to_first_token_seconds", "Arrival to first token",
                              ["endpoint"], buckets=_LATENCY, registry=r)
        self.e2e = Histogram("promptcache_request_duration_seconds", "Arrival to last token of a generation",
                             ["endpoint"], buckets=_LATENCY, registry=r)
        self.inter_token = Histogram("promptcache_inter_token_seconds", "Gap between streamed tokens",
                                     buckets=_GAP, registry=r)
        self.generated = Counter("promptcache_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("promptcache_prompt_tokens", "Prompt tokens, cached (reused) or computed",
                                     ["kind"], registry=r)
        self.cancelled = Counter("promptcache_cancelled_requests", "Generations cancelled by a disconnect",
                                 registry=r)
        r.register(_EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and counters read from the engine at scrape time."""

    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine

    def describe(self):
        return []

    def collect(self):
        stats = self.engine.stats()
        sched = stats.get("engine", {})
        yield _gauge("promptcache_queue_depth", "Requests waiting for a batch slot", sched.get("waiting", 0))
        yield _gauge("promptcache_running_requests", "Requests in the running batch", sched.get("running", 0))
        steps = CounterMetricFamily("promptcache_batch_steps", "Forward steps by batch size", labels=["size"])
        for size, count in sched.get("batch_sizes", {}).items():
            steps.add_metric([str(size)], count)
        yield steps
        drafts = CounterMetricFamily("promptcache_draft_tokens", "Lookahead draft tokens verified, and taken",
                                     labels=["outcome"])
        drafts.add_metric(["verified"], sched.get("draft_tokens", 0))
        drafts.add_metric(["accepted"], sched.get("draft_accepted", 0))
        yield drafts
        arena = sched.get("arena", {})
        yield _gauge("promptcache_kv_arena_rows_used", "KV arena rows in use", arena.get("used_rows", 0))
        yield _gauge("promptcache_kv_arena_bytes", "KV arena bytes allocated", arena.get("bytes", 0))
        hits = CounterMetricFamily("promptcache_store_hits", "Block hits per tier", labels=["tier"])
        evictions = CounterMetricFamily("promptcache_store_evictions", "Module block evictions per tier",
                                        labels=["tier"])
        entries = GaugeMetricFamily("promptcache_store_bytes", "Bytes held per tier", labels=["tier"])
        for tier in ("device", "host", "disk", "remote"):
            t = stats.get(tier)
            if isinstance(t, dict):
                hits.add_metric([tier], t.get("hits", 0))
                if tier != "remote":
                    evictions.add_metric([tier], t.get("evictions", 0))
                    entries.add_metric([tier], t.get("bytes", 0))
        yield hits
        yield evictions
        yield entries
        misses = CounterMetricFamily("promptcache_store_misses", "Module block lookups no tier held")
        misses.add_metric([], stats.get("misses", 0))
        yield misses
        encodes = CounterMetricFamily("promptcache_store_encodes", "Module blocks encoded by this process")
        encodes.add_metric([], stats.get("encodes", 0))
        yield encodes
        remote = stats.get("remote")
        if isinstance(remote, dict):
            yield from _remote_metrics(remote)
        events = stats.get("kv_events")
        if isinstance(events, dict):
            yield from _kv_event_metrics(events)
        prefix = stats.get("prefix")
        if isinstance(prefix, dict):
            family = CounterMetricFamily("promptcache_prefix_queries", "Plain prompts looked up in the prefix cache",
                                         labels=["result"])
            queries, hit = prefix.get("queries", 0), prefix.get("hits", 0)
            family.add_metric(["hit"], hit)
            family.add_metric(["miss"], max(0, queries - hit))
            yield family
            yield _gauge("promptcache_prefix_bytes", "Bytes of prefix blocks held in memory", prefix.get("bytes", 0))
            yield _gauge("promptcache_prefix_budget_bytes", "The prefix cache's byte budget (--prefix-budget)",
                         prefix.get("budget_bytes", 0))
            evicted = CounterMetricFamily("promptcache_prefix_evictions", "Prefix entries evicted for the budget")
            evicted.add_metric([], prefix.get("evictions", 0))
            yield evicted


def _remote_metrics(remote: dict):
    """The remote (Redis/Valkey) tier's state and counters."""
    yield _gauge("promptcache_remote_up", "1 while the remote tier answers, 0 in back-off after a fault",
                 1 if remote.get("up") else 0)
    yield _gauge("promptcache_remote_pending_bytes", "Bytes of blocks queued for upload",
                 remote.get("pending_bytes", 0))
    moved = CounterMetricFamily("promptcache_remote_bytes", "Block bytes moved to and from the remote tier",
                                labels=["direction"])
    moved.add_metric(["read"], remote.get("bytes_read", 0))
    moved.add_metric(["written"], remote.get("bytes_written", 0))
    yield moved
    writes = CounterMetricFamily("promptcache_remote_writes", "Remote block writes by outcome", labels=["result"])
    for result, field in (("written", "writes"), ("present", "present"), ("lost_race", "lost_races"),
                          ("dropped", "dropped_writes")):
        writes.add_metric([result], remote.get(field, 0))
    yield writes
    for name, doc, field in (("promptcache_remote_misses", "Remote lookups that found no usable block", "misses"),
                             ("promptcache_remote_errors", "Remote connection errors and timeouts", "errors"),
                             ("promptcache_remote_discarded", "Remote values found corrupt, foreign or incomplete",
                              "discarded"),
                             ("promptcache_remote_reconnects", "Times the remote tier answered again after a fault",
                              "reconnects")):
        family = CounterMetricFamily(name, doc)
        family.add_metric([], remote.get(field, 0))
        yield family
    # Exported with any remote tier (for one server: the counter without samples, 0 down), so
    # dashboards find the names.
    cluster = remote.get("cluster") if isinstance(remote.get("cluster"), dict) else {}
    nodes = CounterMetricFamily("promptcache_remote_cluster_node_errors",
                                "Remote connection errors and timeouts of one cluster master (its slots miss "
                                "while it backs off)", labels=["node"])
    errors = cluster.get("node_errors", {})
    for node in sorted(set(cluster.get("nodes", [])) | set(errors)):
        nodes.add_metric([node], errors.get(node, 0))
    yield nodes
    yield _gauge("promptcache_remote_cluster_nodes_down", "Cluster masters in back-off after a fault",
                 len(cluster.get("nodes_down", [])))


def _kv_event_metrics(events: dict):
    """The KV-event publisher's counters (``--kv-events-config``; docs/kv-events.md)."""
    for name, doc, field in (("promptcache_kv_events_published", "KV events sent (BlockStored, BlockRemoved, "
                                                                 "AllBlocksCleared)", "published"),
                             ("promptcache_kv_event_batches", "KV event batches sent (one sequence number each)",
                              "batches"),
                             ("promptcache_kv_events_dropped", "KV events dropped because the publisher's queue "
                                                               "was full (a full resync followed)", "dropped"),
                             ("promptcache_kv_event_replays", "KV event replay requests answered", "replays")):
        family = CounterMetricFamily(name, doc)
        family.add_metric([], events.get(field, 0))
        yield family
    yield _gauge("promptcache_kv_event_subscribers", "Live subscriptions to the KV event socket",
                 events.get("subscribers", 0))
    yield _gauge("promptcache_kv_event_blocks", "Blocks the KV events say this server holds (all mediums)",
                 events.get("held", 0))


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    family.add_metric([], float(value))
    return family
