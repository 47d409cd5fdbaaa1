"""The fleet script's pure parts (workload, summary, answer comparison, recovery), the Grafana
dashboard (every query names series ``/metrics`` exports), and — when ``vllm-router`` is installed —
two replicas behind its ``round_robin`` and ``kv_aware`` policies end to end.

``vllm-router`` is the ``fleet`` extra (a 60 MB wheel with a Rust binary; ``install.sh`` leaves it out):
without it the end-to-end test skips, saying why; ``pip install -e ".[fleet]"`` (or
``VLLM_ROUTER=/path/to/vllm-router``) runs it. ``.ci/run`` installs the extra and sets
``PROMPTCACHE_REQUIRE_ROUTER=1``: there a missing router fails the test instead of skipping it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from perf.fleet import (Conversation, Fleet, Options, Record, compare, messages, recovery, router_binary, summary,
                        workload)
from pckernels.server.metrics import ServerMetrics
from pckernels.store.testing import server_binary

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "promptcache.json"
SCRAPE_LABELS = {"instance", "job", "le"}
"""Labels Prometheus adds at scrape time (``le``: a histogram's buckets)."""


@pytest.fixture(scope="module")
def tok():
    from pckernels.integration.embedded import load_tokenizer

    return load_tokenizer()


def test_workload_shares_documents_and_is_deterministic(tok):
    opts = Options(tenants=2, docs_per_tenant=3, doc_tokens=40, chats=13, turns=3, seed=3)
    convs = workload(tok, opts)
    assert len(convs) == 13 and all(len(c.questions) == 3 for c in convs)
    docs = {c.doc for c in convs}
    assert docs == set(range(6)), "every document is asked about"
    assert max(sum(c.doc == d for c in convs) for d in docs) >= 2, "documents are shared between conversations"
    tenants = {c.tenant for c in convs}
    assert len(tenants) == 2 and all(c.system.startswith(f"You are the assistant of {c.tenant}.") for c in convs)
    for c in convs:  # the document part is sized in tokens
        body = c.system.split("\n\n", 1)[1]
        assert abs(len(tok(body, add_special_tokens=False)["input_ids"]) - 40) <= 2
    again = workload(tok, opts)
    assert [(c.doc, c.questions, c.system) for c in again] == [(c.doc, c.questions, c.system) for c in convs]
    other = workload(tok, Options(tenants=2, docs_per_tenant=3, doc_tokens=40, chats=13, turns=3, seed=4))
    assert [c.questions for c in other] != [c.questions for c in convs]
    with pytest.raises(ValueError):
        workload(tok, Options(chats=0))


def test_messages_grow_with_the_history():
    conv = Conversation(0, "T", 0, "SYS", ["q0", "q1", "q2"])
    assert messages(conv, [], 0) == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "q0"}]
    two = messages(conv, ["a0", "a1"], 2)
    assert [m["content"] for m in two] == ["SYS", "q0", "a0", "q1", "a1", "q2"]
    assert [m["role"] for m in two] == ["system", "user", "assistant", "user", "assistant", "user"]


def _rec(conv, turn, ok=True, start=0.0, end=1.0, ttft=0.1, prompt=100, cached=50, answer="x", **kw):
    return Record(conv, turn, ok, start, end, ttft, prompt, cached, answer, **kw)


def test_summary_counts_only_answered_requests():
    recs = [_rec(0, 0, ttft=0.1, prompt=100, cached=0), _rec(0, 1, ttft=0.3, prompt=200, cached=150),
            _rec(1, 0, ok=False, ttft=9.0, prompt=0, cached=0)]
    s = summary(recs, 2.0)
    assert (s["requests"], s["ok"], s["failed"]) == (3, 2, 1)
    assert s["hit_rate"] == pytest.approx(150 / 300)
    assert s["ttft_p50_s"] == pytest.approx(0.2) and 0.2 < s["ttft_p99_s"] <= 0.3
    assert s["requests_per_s"] == pytest.approx(1.0)
    # the opening wave (started before the first answer was in) is left out of one p99 only
    wave = [_rec(c, 0, start=0.0, end=5.0 + c, ttft=4.0 + c) for c in range(3)]
    wave += [_rec(c, 1, start=5.0 + c + 0.1 * t, end=6.0 + c, ttft=0.2 + 0.1 * c) for c in range(3) for t in range(3)]
    s = summary(wave, 10.0)
    assert s["after_opening"] == 9 and s["ttft_p99_s"] > 5.0
    assert 0.2 <= s["ttft_p99_after_opening_s"] <= 0.41 and s["ttft_p50_s"] <= s["ttft_p95_s"] <= s["ttft_p99_s"]
    empty = summary([], 0.0)
    assert empty["hit_rate"] == 0.0 and empty["ttft_p50_s"] is None and empty["requests_per_s"] == 0.0


def test_compare_and_recovery():
    reference = {(0, 0): "a", (0, 1): "b", (1, 0): "c"}
    recs = [_rec(0, 0, answer="a"), _rec(0, 1, answer="B"), _rec(1, 0, ok=False, answer="")]
    out = compare(reference, recs)
    assert (out["compared"], out["same"], out["differ"]) == (2, 1, [(0, 1)])
    timeline = [_rec(0, 0, start=0.0, end=1.0), _rec(0, 1, ok=False, start=4.0, end=6.0),   # in flight at 5
                _rec(0, 1, start=6.0, end=7.5, retried=True), _rec(1, 0, ok=False, start=5.5, end=5.6),
                _rec(1, 0, start=5.7, end=8.0, retried=True)]
    rec = recovery(timeline, killed_at=5.0)
    assert rec["failed"] == 2 and rec["failed_in_flight"] == 1 and rec["failed_after_kill_started"] == 1
    assert rec["retried_ok"] == 2 and rec["started_after_kill"] == 3 and rec["ok_after_kill"] == 2
    assert rec["first_ok_after_kill_s"] == pytest.approx(2.5)


class _Engine:
    """Stats with every section the collector reads, as a server with every tier and events has."""

    def stats(self) -> dict:
        tier = {"hits": 1, "evictions": 0, "bytes": 10}
        return {"engine": {"waiting": 0, "running": 1, "batch_sizes": {1: 3}, "draft_tokens": 0, "draft_accepted": 0,
                           "arena": {"used_rows": 1, "bytes": 2}},
                "device": tier, "host": tier, "disk": tier, "remote": {"hits": 1, "up": True,
                           "cluster": {"nodes": ["127.0.0.1:7000"], "node_errors": {"127.0.0.1:7000": 1},
                                       "nodes_down": []}}, "misses": 0,
                "encodes": 1, "prefix": {"queries": 2, "hits": 1},
                "kv_events": {"published": 1, "batches": 1, "dropped": 0, "replays": 0, "subscribers": 1, "held": 3}}


def _exported(text: str) -> dict[str, set[str] | None]:
    """Sample name -> label names, from an exposition; ``None`` for a family declared without samples
    (a labelled counter nothing has counted yet, e.g. cluster node errors on a single Redis): its
    name is exported, its labels cannot be seen."""
    out: dict[str, set[str] | None] = {}
    for family in text_string_to_metric_families(text):
        if not family.samples:
            out.setdefault(family.name + ("_total" if family.type == "counter" else ""), None)
        for sample in family.samples:
            out[sample.name] = (out.get(sample.name) or set()) | set(sample.labels)
    return out


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            out.append((var["name"], var["definition"]))
    return out


def check_dashboard(exported: dict[str, set[str] | None]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = _queries(dashboard)
    assert len(queries) >= 20
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert panels and all(p.get("targets") for p in panels), "every panel queries something"
    for title, expr in queries:
        names = re.findall(r"\bpromptcache_[a-z_]+", expr)
        assert names, (title, expr)
        for name in names:
            assert name in exported, f"panel {title!r} queries {name}, which /metrics does not export"
        for selector in re.findall(r"promptcache_[a-z_]+\{([^}]*)\}", expr):
            for label in re.findall(r"([a-z_]+)\s*=~?", selector):
                name = re.search(r"promptcache_[a-z_]+(?=\{" + re.escape(selector) + ")", expr).group(0)
                assert exported[name] is None or label in exported[name] | SCRAPE_LABELS, \
                    f"{title!r}: {name} has no label {label!r}"
        for label in re.findall(r"by \(([^)]*)\)", expr):
            for one in (x.strip() for x in label.split(",")):
                seen = [labels for n, labels in exported.items() if n in names]
                assert any(labels is None or one in labels for labels in seen) or one in SCRAPE_LABELS, \
                    f"{title!r} groups by {one!r}, which none of {names} carries"


def _scrape(engine) -> dict[str, set[str] | None]:
    """What ``/metrics`` exports for ``engine``'s stats after one chat request."""
    metrics = ServerMetrics(engine)
    metrics.requests.labels("chat", "200").inc()
    metrics.ttft.labels("chat").observe(0.1)
    metrics.e2e.labels("chat").observe(0.2)
    metrics.inter_token.observe(0.01)
    metrics.prompt_tokens.labels("cached").inc()
    return _exported(metrics.render().decode())


def test_dashboard_queries_only_exported_series():
    exported = _scrape(_Engine())
    check_dashboard(exported)
    # sabotage guard: a made-up series or label is caught
    with pytest.raises(AssertionError):
        check_dashboard({k: v for k, v in exported.items() if k != "promptcache_kv_event_blocks"})
    with pytest.raises(AssertionError):
        check_dashboard({**exported, "promptcache_store_hits_total": set()})
    assert exported["promptcache_remote_cluster_node_errors_total"] == {"node"}


def test_dashboard_on_a_single_redis_server():
    """One Redis, no cluster: the cluster panel's counter is declared without samples and still passes;
    a name nobody exports still fails."""

    class _SingleRedis(_Engine):
        def stats(self) -> dict:
            stats = super().stats()
            stats["remote"] = {"hits": 1, "up": True}
            return stats

    exported = _scrape(_SingleRedis())
    assert exported["promptcache_remote_cluster_node_errors_total"] is None
    check_dashboard(exported)
    with pytest.raises(AssertionError):
        check_dashboard({k: v for k, v in exported.items() if k != "promptcache_remote_cluster_node_errors_total"})


ROUTER = router_binary(os.environ.get("VLLM_ROUTER"))
REQUIRE_ROUTER = bool(os.environ.get("PROMPTCACHE_REQUIRE_ROUTER"))


@pytest.mark.skipif(ROUTER is None and not REQUIRE_ROUTER,
                    reason="vllm-router is not installed (pip install -e '.[fleet]'; docs/fleet.md)")
@pytest.mark.skipif(server_binary() is None, reason="redis-server is not installed")
def test_two_replicas_behind_the_router(tok, tmp_path):
    """round_robin spreads; kv_aware sends a conversation's next turn where its prefix is (the replica's
    events told it), the answers equal a direct request's; the dashboard's series are on a live scrape."""
    import asyncio
    import time

    import httpx

    from perf.fleet import run

    assert ROUTER is not None, "PROMPTCACHE_REQUIRE_ROUTER is set but vllm-router is not installed"
    convs = workload(tok, Options(tenants=1, docs_per_tenant=1, doc_tokens=64, chats=2, turns=2, tokens=4))
    fleet = Fleet(2, remote=True, log_dir=tmp_path)  # as perf.fleet runs it: every section of /metrics
    try:
        # the router first: it learns a replica's blocks from live events only (a late subscriber
        # misses what was published before it, and 0.1.17's replay client reads another framing)
        url = fleet.start_router(ROUTER, "kv_aware")
        time.sleep(1.0)
        direct, _ = asyncio.run(run(fleet.urls[0], "smollm2", convs, Options(concurrency=1, tokens=4), 300))
        check_dashboard(_exported(httpx.get(fleet.urls[0] + "/metrics", timeout=10).text))
        time.sleep(1.0)  # the events of the direct run reach the router
        before = [fleet.metric_of(i, "promptcache_time_to_first_token_seconds_count", "chat") for i in range(2)]
        routed, _ = asyncio.run(run(url, "smollm2", convs, Options(concurrency=1, tokens=4), 300))
        after = [fleet.metric_of(i, "promptcache_time_to_first_token_seconds_count", "chat") for i in range(2)]
    finally:
        fleet.stop()
    assert all(r.ok for r in routed), [r.error for r in routed]
    reference = {(r.conv, r.turn): r.answer for r in direct}
    assert compare(reference, routed)["same"] == len(routed)
    # replica 0 holds both conversations' prefixes (the direct run): kv_aware sends every request there
    assert after[1] - before[1] == 0 and after[0] - before[0] == len(routed), (before, after)
    assert summary(routed, 1.0)["hit_rate"] > 0.5


def test_readme_names_what_was_killed_and_the_local_hit_rates():
    from perf.fleet import prefix_flags, table

    opts = asdict(Options())
    row = {"hit_rate": 0.6, "local_hit_rate": 0.5, "ttft_p50_s": 0.1, "ttft_p99_s": 0.4, "requests_per_s": 1.0,
           "failed": 0, "remote_mib_read": 1.0, "answers": {"same": 9, "compared": 9}}
    rr = {**row, "hit_rate": 0.55, "local_hit_rate": 0.2, "ttft_p99_s": 0.8}
    rec = {"failed": 0, "failed_in_flight": 0, "failed_after_kill_started": 0, "retried_ok": 0,
           "started_after_kill": 4, "ok_after_kill": 4, "first_ok_after_kill_s": 0.5}
    result = {"argv": ["--cluster"], "options": opts, "replicas": 3, "remote": True, "cluster": True,
              "router": "vllm-router", "single": {**row, "answers": None},
              "policies": {"kv_aware": row, "round_robin": rr},
              "kill": {**row, "requests": 9, "policy": "kv_aware", "target": "master", "recovery": rec,
                       "killed_after_answers": 4, "cluster_node_errors": 7.0}}
    text = table(result)
    assert "a shared 3-master Redis Cluster" in text
    assert "kv_aware, one Redis Cluster master (of 3) killed" in text and "## One Redis Cluster master" in text
    assert "**1.09x**, local hit rate **2.50x**" in text
    assert "TTFT p99 400 ms vs 800 ms" in text and "after the opening – vs –" in text
    assert "(`promptcache_remote_cluster_node_errors_total`): 7." in text
    result["kill"]["target"] = "replica"
    assert "kv_aware, one replica killed" in table(result) and "the last replica SIGKILLed once 4 of" in table(result)
    assert "`--prefix-block 16`" in text, "a run recorded before --prefix-resume reads as it ran"
    result["prefix_flags"] = prefix_flags("token", 256)
    assert "`--prefix-block 16 --prefix-resume token --prefix-chunk 256`" in table(result)
    result["prefix_flags"] = prefix_flags("token", step_tokens=256)
    assert "`--prefix-block 16 --prefix-resume token --step-tokens 256`" in table(result)


def _cluster_support() -> bool:
    try:
        from pckernels.store.testing import LocalRedisCluster, cli_binary  # noqa: F401
    except ImportError:
        return False
    return cli_binary() is not None and server_binary() is not None


@pytest.mark.skipif(ROUTER is None and not REQUIRE_ROUTER,
                    reason="vllm-router is not installed (pip install -e '.[fleet]'; docs/fleet.md)")
@pytest.mark.skipif(not _cluster_support(), reason="no Redis Cluster support (LocalRedisCluster, redis-cli)")
def test_fleet_on_a_redis_cluster_with_a_master_killed(tok, tmp_path):
    """The shared tier a 3-master cluster: routed answers equal direct ones, and one master's death
    mid-run fails no request (its blocks become misses)."""
    import asyncio
    import time

    from perf.fleet import run

    assert ROUTER is not None, "PROMPTCACHE_REQUIRE_ROUTER is set but vllm-router is not installed"
    convs = workload(tok, Options(tenants=1, docs_per_tenant=2, doc_tokens=64, chats=4, turns=2, tokens=4))
    # two API-key tenants: the routed run's blocks are its own (computed, written to the cluster after the kill)
    fleet = Fleet(2, remote=True, log_dir=tmp_path, keys={"fleet-ref-key": "ref", "fleet-run-key": "run"}, cluster=True)
    killed: dict = {}

    def on_done(records) -> None:
        if not killed and len(records) >= 3:
            killed["at"] = time.perf_counter()
            fleet.kill_master()

    try:
        url = fleet.start_router(ROUTER, "kv_aware")
        time.sleep(1.0)
        direct, _ = asyncio.run(run(fleet.urls[1], "smollm2", convs, Options(concurrency=1, tokens=4), 300,
                                    key="fleet-ref-key"))
        time.sleep(1.0)
        routed, _ = asyncio.run(run(url, "smollm2", convs, Options(concurrency=2, tokens=4), 300, on_done,
                                    "fleet-run-key"))
        time.sleep(1.0)  # write-behind to the dead master's slots
        node_errors = fleet.metric("promptcache_remote_cluster_node_errors_total")
    finally:
        fleet.stop()
    assert killed and node_errors > 0, "the master was killed mid-run, and the replicas felt it"
    assert all(r.ok for r in direct) and all(r.ok for r in routed), [r.error for r in routed if not r.ok]
    assert len(routed) == 8
    reference = {(r.conv, r.turn): r.answer for r in direct}
    assert compare(reference, routed)["same"] == len(routed)


def test_dynamo_fleet_counts_hits_from_the_workers():
    """perf.fleet_dynamo's own arithmetic (the run itself needs ai-dynamo: docs/fleet.md; the worker's
    handler is tests/test_dynamo_worker.py's)."""
    from perf.fleet_dynamo import table, worker_hits

    lines = [{"worker": "w0", "prompt": 100, "cached": 0, "remote_hits": 0, "t": 1.0},
             {"worker": "w0", "prompt": 120, "cached": 96, "remote_hits": 2, "t": 2.0},
             {"worker": "w1", "prompt": 100, "cached": 80, "remote_hits": 3, "t": 1.5}]
    hits = worker_hits(lines)
    assert hits["hit_rate"] == 176 / 320 and hits["remote_blocks"] == 5
    assert hits["local_hit_rate"] == (176 - 16 * 5) / 320 and hits["per_worker"] == {"w0": 2, "w1": 1}
    row = {"hit_rate": 0.5, "local_hit_rate": 0.4, "ttft_p50_s": 0.1, "ttft_p95_s": 0.2, "ttft_p99_s": 0.3,
           "ttft_p99_after_opening_s": None, "requests_per_s": 1.0, "failed": 0, "per_worker": {"w0": 3}}
    result = {"argv": [], "options": asdict(Options()), "workers": 1, "budget": "96MiB",
              "modes": {"kv": {**row, "answers_vs_reference": {"same": 3, "compared": 3}}}}
    assert "| kv | 50.0% | 40.0% | 100 ms | 200 ms | 300 ms | – | 1.00 | 0 | 3 | 3/3 |" in table(result)
    result["modes"]["round-robin"] = {**row, "local_hit_rate": 0.2, "hit_rate": 0.25, "ttft_p99_s": 0.4}
    assert "local hit rate: **2.00x** (hit rate 2.00x); TTFT p99 300 ms vs 400 ms" in table(result)
    assert "a shared Redis" in table(result)
    assert "no Redis: private stores" in table({**result, "remote": False})
    result["kill"] = {**row, "per_worker": {"w0": 5, "w1": 2}, "killed_after_answers": 4,
                      "answers": {"same": 7, "compared": 7},
                      "recovery": {"failed": 1, "failed_in_flight": 1, "failed_after_kill_started": 0,
                                   "retried_ok": 1, "ok_after_kill": 3, "started_after_kill": 3,
                                   "first_ok_after_kill_s": 0.5}}
    assert ("Failed requests: 1 (1 in flight at the kill, 0 started after it); retried and answered: 1. Requests "
            "started after the kill: 3/3 answered; first answer after the kill 0.50 s after it.") in table(result)
