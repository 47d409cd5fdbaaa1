"""Prometheus metrics of one server (its own registry, so several apps can live in a process).

Request-side series are updated as requests run; engine-side ones (queue depth, running
requests, store hits / misses / evictions per tier, prefix-cache hits) are read from
``PromptCache.stats()`` at scrape time by a custom collector.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_GAP = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The series ``/metrics`` exposes (all prefixed ``promptcache_``)."""

    def __init__(self, engine) -> None:
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

    def __init__(self, engine) -> None:
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
        arena = sched.get("arena", {})
        yield _gauge("promptcache_kv_arena_rows_used", "KV arena rows in use", arena.get("used_rows", 0))
        yield _gauge("promptcache_kv_arena_bytes", "KV arena bytes allocated", arena.get("bytes", 0))
        hits = CounterMetricFamily("promptcache_store_hits", "Module block hits per tier", labels=["tier"])
        evictions = CounterMetricFamily("promptcache_store_evictions", "Module block evictions per tier",
                                        labels=["tier"])
        entries = GaugeMetricFamily("promptcache_store_bytes", "Bytes held per tier", labels=["tier"])
        for tier in ("device", "host", "disk"):
            t = stats.get(tier)
            if isinstance(t, dict):
                hits.add_metric([tier], t.get("hits", 0))
                evictions.add_metric([tier], t.get("evictions", 0))
                entries.add_metric([tier], t.get("bytes", 0))
        yield hits
        yield evictions
        yield entries
        misses = CounterMetricFamily("promptcache_store_misses", "Module block lookups no tier held")
        misses.add_metric([], stats.get("misses", 0))
        yield misses
        prefix = stats.get("prefix")
        if isinstance(prefix, dict):
            family = CounterMetricFamily("promptcache_prefix_queries", "Plain prompts looked up in the prefix cache",
                                         labels=["result"])
            queries, hit = prefix.get("queries", 0), prefix.get("hits", 0)
            family.add_metric(["hit"], hit)
            family.add_metric(["miss"], max(0, queries - hit))
            yield family


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    family.add_metric([], float(value))
    return family
