"""The remote tier on a real Redis Cluster of three masters on loopback (``LocalRedisCluster``):
a URL naming any node works (``redis+cluster://`` or a plain ``redis://`` node, detected); a
block's keys share one slot while blocks spread over every master; results equal a single
server's; two engines sharing the cluster answer exactly as a cold engine; a master killed mid-run
costs misses only (answers exact, nothing raised, faults counted per node) and its slots serve
again once it is back; two ``promptcache serve`` processes on the cluster, one master killed.

``.ci/run`` installs ``redis-server`` (with ``redis-cli``) and sets ``PROMPTCACHE_REQUIRE_REDIS=1``.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from pckernels.store.testing import LocalRedis, LocalRedisCluster, cli_binary, server_binary

if server_binary() is None or cli_binary() is None:
    if os.environ.get("PROMPTCACHE_REQUIRE_REDIS"):
        raise RuntimeError("PROMPTCACHE_REQUIRE_REDIS is set but redis-server or redis-cli is not installed")
    pytest.skip("redis-server or redis-cli is not installed", allow_module_level=True)

from pckernels.engine import PromptCache  # noqa: E402
from pckernels.store import BlockKey, RemoteTier, parse_remote_url  # noqa: E402
from pckernels.store.remote.url import cluster_nodes  # noqa: E402
from test_engine import SCHEMA, tokenizer  # noqa: E402,F401  (tokenizer is a fixture)
from test_remote import _encode_and_answer, answers, expected, in_child, model, same  # noqa: E402,F401
from test_server import SCHEMA as SCHEMA_PML  # noqa: E402
from test_server import model_dir  # noqa: E402,F401  (a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cluster():
    with LocalRedisCluster() as c:
        yield c


@pytest.fixture()
def live(cluster):
    """The module's cluster, emptied, with every master running (a test that killed one gets it back)."""
    for i, node in enumerate(cluster.nodes):
        if node.proc is None:
            cluster.restart(i)
        with node.client() as client:
            client.flushall()
    yield cluster
    for i, node in enumerate(cluster.nodes):
        if node.proc is None:
            cluster.restart(i)


def block_key(i: int, shape, dtype=torch.float32) -> BlockKey:
    return BlockKey(f"{i:04x}" * 16, schema="s", module=f"m{i}", shape=shape, dtype=dtype)


def meta_names(client) -> list[bytes]:
    """The metadata keys (``promptcache:kv:{digest}``) on the cluster."""
    return [k for k in client.scan_iter(match="promptcache:kv:*", count=1000) if k.count(b":") == 2]


# -- URLs ---------------------------------------------------------------------------------------


def test_cluster_urls():
    assert parse_remote_url("valkey+cluster://10.0.0.1:7000,10.0.0.2:7000") == \
        "redis+cluster://10.0.0.1:7000,10.0.0.2:7000"
    assert parse_remote_url("valkeys+cluster://:pw@h:1/0") == "rediss+cluster://:pw@h:1/0"
    assert cluster_nodes("rediss+cluster://u:pw@a:1,b:2") == ["rediss://u:pw@a:1", "rediss://u:pw@b:2"]
    assert cluster_nodes("redis://a:1/0") is None
    for bad, words in (("redis+cluster://a:1/2", "only database 0"), ("redis+cluster://a:1,", "no host"),
                       ("redis+cluster://a:1,b:x", "bad port"), ("unix+cluster:///tmp/s", "scheme")):
        with pytest.raises(ValueError, match=words):
            parse_remote_url(bad)
    tier = RemoteTier("redis+cluster://:hunter2@127.0.0.1:1,127.0.0.1:2")
    assert "hunter2" not in json.dumps(tier.describe())
    tier.close(timeout_s=0)


def test_serve_and_encode_refuse_a_bad_cluster_url_at_start(tmp_path, cli_without_loading):
    from typer.testing import CliRunner

    from pckernels.cli import app
    from test_cli import assert_one_line_error

    schema = tmp_path / "schema.xml"
    schema.write_text(SCHEMA, encoding="utf-8")
    for line in (["serve", "--store-dir", str(tmp_path / "kv")], ["encode", str(schema)]):
        result = CliRunner().invoke(app, [*line, "--remote", "valkey+cluster://127.0.0.1:7000/1"])
        assert_one_line_error(result, "--remote", "only database 0")


def test_the_cluster_metrics_are_exported(live):
    """``/metrics`` families from ``RemoteTier.describe()``: per-master fault counters and masters
    down for a cluster; for one server the same names, the counter without samples, 0 down."""
    from prometheus_client.core import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from pckernels.server.metrics import _remote_metrics

    def exported(describe: dict) -> str:
        class One:
            def collect(self):
                return _remote_metrics(describe)

        registry = CollectorRegistry()
        registry.register(One())
        return generate_latest(registry).decode()

    tier = RemoteTier(live.url)
    client = live.client()
    k = next(k for k in (block_key(i, (1, 2, 1, 2, 2)) for i in range(100))
             if live.node_of(tier.meta_key(k.digest), client) == 2)  # a block of the master about to die
    client.close()
    tier.contains(k)
    live.kill(2)
    assert tier.read(k) is None
    text = exported(tier.describe())
    dead, alive = f"127.0.0.1:{live.nodes[2].port}", f"127.0.0.1:{live.nodes[0].port}"
    assert f'promptcache_remote_cluster_node_errors_total{{node="{dead}"}} 1.0' in text, text
    assert f'promptcache_remote_cluster_node_errors_total{{node="{alive}"}} 0.0' in text
    assert "promptcache_remote_cluster_nodes_down 1.0" in text
    tier.close(timeout_s=0)
    single = RemoteTier("redis://127.0.0.1:1/0")
    text = exported(single.describe())
    assert "# TYPE promptcache_remote_cluster_node_errors_total counter" in text
    assert "promptcache_remote_cluster_node_errors_total{" not in text
    assert "promptcache_remote_cluster_nodes_down 0.0" in text
    single.close(timeout_s=0)


# -- the tier on its own --------------------------------------------------------------------------


def test_a_url_naming_any_node_finds_the_cluster(live):
    block = torch.randn(2, 2, 1, 3, 5)
    k = block_key(1, block.shape)
    for url in (live.url, *(live.node_url(i) for i in range(3)),
                "valkey+cluster://127.0.0.1:1," + live.url.split("//")[1]):  # a dead first node
        tier = RemoteTier(url)
        tier.write_behind(k, block, 1)
        assert tier.flush(10)
        assert torch.equal(tier.read(k), block), url
        assert tier.cluster and tier.describe()["cluster"]["nodes"] == sorted(
            f"127.0.0.1:{n.port}" for n in live.nodes)
        tier.close()
    wrong_db = RemoteTier(live.node_url(0).replace("/0", "/3"), backoff_s=(0.05, 0.1))
    assert wrong_db.read(k) is None and not wrong_db.contains(k)
    assert "only database 0" in wrong_db.describe()["down_reason"]
    wrong_db.close(timeout_s=0)


def test_blocks_spread_over_every_master_and_each_keeps_to_one_slot(live):
    """Odd shapes and dtypes in several chunks round-trip as on one server; a block's metadata,
    chunks and lease share its hash slot; the blocks land on all three masters."""
    shapes = [((3, 2, 1, 7, 5), torch.float32), ((2, 2, 3, 1, 4), torch.bfloat16), ((2, 2, 2, 0, 8), torch.float32),
              ((1, 2, 1, 1, 1), torch.float16), ((2, 2, 1, 9, 3), torch.float32)]
    blocks = {block_key(i, *shapes[i % len(shapes)]): torch.randn(shapes[i % len(shapes)][0]).to(
        shapes[i % len(shapes)][1]) for i in range(24)}
    with LocalRedis() as single:
        got = {}
        for url in (single.url, live.url):
            tier = RemoteTier(url, chunk_bytes=48)
            for k, b in blocks.items():
                assert tier.write_behind(k, b, b.numel() * b.element_size())
            assert tier.flush(20)
            got[url] = {k.digest: tier.read(k) for k in blocks}
            assert tier.describe()["hits"] == len(blocks)
            tier.close()
        metas = {url: {name.decode(): json.loads(client.get(name)) for name in meta_names(client)}
                 for url, client in ((single.url, single.client()), (live.url, live.client()))}
    for k, b in blocks.items():
        for url in got:
            assert got[url][k.digest].dtype == b.dtype and torch.equal(got[url][k.digest], b)
    strip = lambda meta: {f: v for f, v in meta.items() if f != "writer"}  # noqa: E731
    assert sorted(map(strip, metas[single.url].values()), key=str) == \
        sorted(map(strip, metas[live.url].values()), key=str)

    client = live.client()
    tier = RemoteTier(live.url)
    masters = set()
    for name, meta in metas[live.url].items():
        digest = meta["key"]
        assert name == f"promptcache:kv:{{{digest}}}"
        slot = client.keyslot(name)
        chunks = [tier.chunk_key(digest, meta["writer"], i) for i in range(meta["chunks"])]
        assert all(client.exists(c) for c in chunks)
        assert {client.keyslot(c) for c in chunks} <= {slot}, "a chunk is on another slot than its metadata"
        assert client.keyslot(tier.lease_key(digest)) == slot
        masters.add(live.node_of(name, client))
    assert masters == {0, 1, 2}, f"the blocks landed on masters {masters} only"
    claimed = next(iter(blocks))
    assert tier.claim(claimed)
    assert client.get(tier.lease_key(claimed.digest)) and tier.wait_for(claimed, timeout_s=1)
    tier.close()
    client.close()


def test_a_cluster_that_requires_a_password():
    """Nodes with ``requirepass``: the password in a ``redis+cluster://:pw@…`` URL (or a plain node
    URL) reaches every master — blocks written through it land on all three and read back; a
    wrong password costs misses, raises nothing, and no password shows in what the tier reports."""
    with LocalRedisCluster(password="s3cret-pw") as secured:
        assert secured.url.startswith("redis+cluster://:s3cret-pw@")
        blocks = {block_key(i, (2, 2, 1, 3, 5)): torch.randn(2, 2, 1, 3, 5) for i in range(12)}
        tier = RemoteTier(secured.url)
        for k, b in blocks.items():
            assert tier.write_behind(k, b, b.numel() * 4)
        assert tier.flush(20)
        assert all(torch.equal(tier.read(k), b) for k, b in blocks.items())
        assert tier.cluster and len(tier.describe()["cluster"]["nodes"]) == 3
        assert "s3cret" not in json.dumps(tier.describe(), default=str)
        tier.close()
        with secured.client() as client:
            assert {secured.node_of(name, client) for name in meta_names(client)} == {0, 1, 2}
        by_node = RemoteTier(secured.node_url(2))
        assert all(torch.equal(by_node.read(k), b) for k, b in blocks.items())
        by_node.close()
        wrong = RemoteTier(secured.url.replace("s3cret-pw", "wrong-pw"), backoff_s=(0.05, 0.1))
        assert all(wrong.read(k) is None for k in blocks) and not wrong.contains(next(iter(blocks)))
        described = json.dumps(wrong.describe(), default=str)
        assert "wrong-pw" not in described and wrong.describe()["down_reason"]
        wrong.close(timeout_s=0)


def test_a_bad_value_on_the_cluster_is_a_miss_and_is_deleted(live):
    tier = RemoteTier(live.url, chunk_bytes=64)
    block = torch.randn(2, 2, 1, 5, 3)
    k = block_key(7, block.shape)
    tier.write_behind(k, block, 1)
    assert tier.flush(10)
    client = live.client()
    meta = json.loads(client.get(tier.meta_key(k.digest)))
    client.delete(tier.chunk_key(k.digest, meta["writer"], 1))
    assert tier.read(k) is None
    assert tier.describe()["discard_reasons"] == {"incomplete": 1}
    assert not list(client.scan_iter(match=f"promptcache:kv:{{{k.digest}}}*"))
    tier.close()
    client.close()


def test_a_failover_to_a_replica_brings_the_blocks_back(tmp_path):
    """Three masters with a replica each: a master SIGKILLed, its blocks miss (faults counted against
    it) until its replica has taken its slots over; then the tier, refreshing its slot map on the
    next probe, reads every block again, bit-exact, from the new master."""
    with LocalRedisCluster(masters=3, replicas=1, node_timeout_ms=500) as cluster:
        tier = RemoteTier(cluster.url, chunk_bytes=64, backoff_s=(0.1, 0.4))
        blocks = {block_key(i, (2, 2, 1, 3 + i % 4, 5)): torch.randn(2, 2, 1, 3 + i % 4, 5) for i in range(18)}
        for k, b in blocks.items():
            tier.write_behind(k, b, 1)
        assert tier.flush(20)
        for i in cluster.masters():
            with cluster.nodes[i].client() as client:
                assert client.execute_command("WAIT", 1, 5000) == 1, "a replica did not catch up"
        client = cluster.client()
        holders = {k: cluster.node_of(tier.meta_key(k.digest), client) for k in blocks}
        client.close()
        victim = max(set(holders.values()), key=lambda i: sum(h == i for h in holders.values()))
        victim_name = f"127.0.0.1:{cluster.nodes[victim].port}"
        cluster.kill(victim)
        lost = [k for k in blocks if holders[k] == victim]
        assert all(tier.read(k) is None for k in lost)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            got = {k: tier.read(k) for k in blocks}
            if all(v is not None for v in got.values()):
                break
            time.sleep(0.1)
        assert all(got[k] is not None and torch.equal(got[k], b) for k, b in blocks.items()), \
            f"not every block came back within 30 s of the failover ({sum(v is None for v in got.values())} missing)"
        stats = tier.describe()
        assert set(stats["cluster"]["node_errors"]) == {victim_name} and stats["reconnects"] >= 1
        assert victim_name not in stats["cluster"]["nodes"], "the client still maps slots to the dead master"
        assert stats["up"] and stats["cluster"]["nodes_down"] == [], "the dead master's back-off outlived the failover"
        assert stats["discarded"] == 0
        tier.close()


def test_a_cluster_that_requires_full_coverage_goes_down_whole_and_comes_back(tmp_path):
    """With the servers' default ``cluster-require-full-coverage yes``, a dead master soon makes every
    node answer ``CLUSTERDOWN``: the whole tier backs off (all misses, nothing raised, no value
    discarded), and serves again, bit-exact, once the master is back."""
    with LocalRedisCluster(full_coverage=True, node_timeout_ms=500) as cluster:
        tier = RemoteTier(cluster.url, chunk_bytes=64, backoff_s=(0.1, 0.4))
        blocks = {block_key(i, (2, 2, 1, 4, 3)): torch.randn(2, 2, 1, 4, 3) for i in range(12)}
        for k, b in blocks.items():
            tier.write_behind(k, b, 1)
        assert tier.flush(20)
        cluster.kill(1)
        deadline = time.monotonic() + 30
        while cluster.info(0).get("cluster_state") != "fail":
            assert time.monotonic() < deadline, "the cluster never noticed the dead master"
            time.sleep(0.1)
        time.sleep(0.5)  # past the back-off of faults the dead master itself caused
        assert all(tier.read(k) is None for k in blocks) and not tier.contains(next(iter(blocks)))
        stats = tier.describe()
        assert not stats["up"] and "ClusterDown" in stats["down_reason"] and stats["discarded"] == 0, stats
        cluster.restart(1)
        deadline = time.monotonic() + 30
        while True:
            got = {k: tier.read(k) for k in blocks}
            survivors = [k for k, v in got.items() if v is not None]
            if len(survivors) == len(blocks) - sum(cluster.node_of(tier.meta_key(k.digest)) == 1 for k in blocks):
                break
            assert time.monotonic() < deadline, "the tier did not serve again after the cluster recovered"
            time.sleep(0.1)
        assert survivors and all(torch.equal(got[k], blocks[k]) for k in survivors)
        assert tier.describe()["up"] and tier.describe()["reconnects"] >= 1
        tier.close()


# -- engines sharing the cluster --------------------------------------------------------------------


def test_two_engines_sharing_the_cluster_answer_as_a_cold_engine(model, tokenizer, live, expected, tmp_path):
    """One process encodes and uploads through the cluster URL, a fresh one given a plain URL of
    another node answers with zero encodes; both equal an engine without any remote tier, bitwise."""
    first, first_stats = in_child(_encode_and_answer, model, tokenizer, live.url)
    assert first_stats["encodes"] > 0 and first_stats["remote"]["writes"] > 0
    second, stats = in_child(_encode_and_answer, model, tokenizer, live.node_url(2), tmp_path)
    assert stats["encodes"] == 0, "the second process encoded modules the first had uploaded"
    assert stats["remote"]["hits"] > 0 and stats["remote"]["discarded"] == 0 and stats["remote"]["errors"] == 0
    assert stats["prefix"]["restored_tokens"] >= 512, "plain-prompt prefix blocks were not shared"
    assert second == first
    for name, result in expected.items():
        assert first[name]["tokens"] == result.token_ids, name
        assert torch.equal(torch.tensor(first[name]["logits"]), result.first_logits), name
    with live.client() as client:
        holders = {live.node_of(name, client) for name in meta_names(client)}
    assert holders == {0, 1, 2}


def test_a_master_killed_mid_run_costs_misses_only(model, tokenizer, live, expected):
    """With no memory tiers every block comes from the cluster: a master killed while prompts run
    makes its blocks miss (re-encoded, exact), the others keep serving theirs, nothing is raised,
    and the faults are counted against that master. Restarted (empty), its slots take writes and
    serve again."""
    seed = PromptCache(model, tokenizer, remote=live.url, placement="schema")
    seed.add_schema(SCHEMA)
    assert seed.store.flush(20)
    seed.close()
    client = live.client()
    per_node = {}
    for name in meta_names(client):
        per_node.setdefault(live.node_of(name, client), []).append(name)
    assert len(per_node) >= 2, per_node
    victim = max(per_node, key=lambda i: len(per_node[i]))
    victim_name = f"127.0.0.1:{live.nodes[victim].port}"

    tier = RemoteTier(live.url, backoff_s=(0.1, 0.4))
    pc = PromptCache(model, tokenizer, remote=tier, device_budget=0, host_budget=0, placement="schema")
    pc.add_schema(SCHEMA)
    assert pc.stats()["encodes"] == 0
    started = threading.Event()
    killer = threading.Thread(target=lambda: (started.wait(30), time.sleep(0.05), live.kill(victim)))
    killer.start()
    t0 = time.monotonic()
    for round_ in range(3):
        started.set()
        for name, result in answers(pc).items():
            assert same(result, expected[name]), (round_, name)
    killer.join()
    assert time.monotonic() - t0 < 40
    stats = pc.stats()
    remote = stats["remote"]
    assert remote["errors"] >= 1 and remote["cluster"]["node_errors"].get(victim_name, 0) >= 1, remote
    assert set(remote["cluster"]["node_errors"]) == {victim_name}, "a live master was blamed"
    assert remote["cluster"]["nodes_down"] in ([victim_name], []) and remote["discarded"] == 0
    assert stats["encodes"] > 0, "the dead master's blocks were not re-encoded"
    hits = remote["hits"]
    for name, result in answers(pc).items():
        assert same(result, expected[name]), name
    assert pc.stats()["remote"]["hits"] > hits, "the live masters stopped serving their blocks"

    live.restart(victim)
    time.sleep(0.5)  # past the longest back-off (0.4 s)
    for name, result in answers(pc).items():  # the victim's blocks are encoded again and written back
        assert same(result, expected[name]), name
    assert pc.store.flush(20)
    remote = pc.stats()["remote"]
    assert remote["reconnects"] >= 1 and remote["up"] and remote["cluster"]["nodes_down"] == []
    assert any(live.node_of(name, client) == victim for name in meta_names(client)), \
        "the restarted master took no writes"
    pc.close()
    fresh = PromptCache(model, tokenizer, remote=live.node_url(victim), placement="schema")
    fresh.add_schema(SCHEMA)
    for name, result in answers(fresh).items():
        assert same(result, expected[name]), name
    # Only blocks lost with the victim and used by no prompt since (add_schema encodes them) are missing.
    assert fresh.stats()["encodes"] <= len(per_node[victim]) and fresh.stats()["remote"]["errors"] == 0
    fresh.close()
    client.close()


# -- two servers ------------------------------------------------------------------------------------


MANY = "<schema name=\"many\">\n  <system>Answer from the notes.</system>\n" + "".join(
    f'  <module name="n{i}">Note {i}: the parcel for room {i * 7 + 3} waits at desk {i % 4}.</module>\n'
    for i in range(12)) + "</schema>"
MANY_PML = '<prompt schema="many"><n2/><n7/><n11/><user>Where is the parcel for room 52?</user><assistant/></prompt>'


def test_two_servers_on_the_cluster_answer_exactly_and_outlive_a_master(model_dir, live, tmp_path):  # noqa: F811
    """``promptcache serve --remote redis+cluster://…`` and ``--remote redis://<a node>``: a schema
    encoded by one is installed by the other with zero encodes and answers alike. Then a master is
    SIGKILLed: a new schema (twelve modules, whose lookups reach every master) installs on both and
    every answer stays the same, no request fails, and ``/metrics`` counts the faults against that
    master only."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from test_remote_server import KEY_A, _wait_uploaded, chat
    from test_server import COMMON, LONG_SYSTEM, PML, Server, _wait_ready

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({KEY_A: {"tenant": "a", "admin": True}}))
    mp = pytest.MonkeyPatch()
    mp.setenv("PROMPTCACHE_SALT_SECRET", "cluster-secret-shared-by-every-server")
    args = ("--model", str(model_dir), "--api-keys", str(keys), *COMMON)
    auth = {"Authorization": f"Bearer {KEY_A}"}
    messages = [{"role": "system", "content": "Cluster. " + LONG_SYSTEM}, {"role": "user", "content": "Hello."}]
    with ThreadPoolExecutor(2) as pool:  # both start at once: half the wall time on a busy machine
        starting = [pool.submit(Server, tmp_path, *args, "--remote", url) for url in (live.url, live.node_url(1))]
    servers = [f.result() for f in starting if f.exception() is None]
    try:
        assert len(servers) == 2, [f.exception() for f in starting]
        a, b = servers

        def install(server, pml, name):
            assert httpx.post(server.url + "/v1/schemas", json={"pml": pml}, headers=auth).status_code == 202
            _wait_ready(server, name, KEY_A)

        def contents(server):
            replies = [chat(server, KEY_A, messages=[], extra_body={"pml": PML}),
                       chat(server, KEY_A, messages=messages)]
            return [r.choices[0].message.content for r in replies]

        install(a, SCHEMA_PML, "docs")
        on_a = contents(a)
        _wait_uploaded(a)
        install(b, SCHEMA_PML, "docs")
        assert contents(b) == on_a
        assert b.metrics()["promptcache_store_encodes_total"] == 0, "server B encoded what server A had uploaded"

        live.kill(0)
        dead = f"127.0.0.1:{live.nodes[0].port}"
        many = []
        for server in (a, b):
            install(server, MANY, "many")
            many.append(chat(server, KEY_A, messages=[], extra_body={"pml": MANY_PML}).choices[0].message.content)
            assert contents(server) == on_a
        assert many[0] == many[1]
        metrics = [server.metrics() for server in (a, b)]
        blamed = {name.split("node=")[1].rstrip("}"): value for m in metrics for name, value in m.items()
                  if name.startswith("promptcache_remote_cluster_node_errors_total") and value}
        assert set(blamed) == {dead}, blamed
        assert all(not (name.startswith("promptcache_requests_total") and "status=5" in name)
                   for m in metrics for name in m), "a request failed"
    finally:
        mp.undo()
        for server in servers:
            assert server.stop() == 0, server.output()
            assert "Traceback" not in server.output(), server.output()
