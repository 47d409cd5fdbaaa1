"""The remote (Redis) tier against a real ``redis-server`` on loopback: values round-trip in
chunks and are verified; a fresh process answers from blocks another process encoded with zero
encodes and identical outputs; prefix blocks are shared; tenants never collide; a server that is
killed, slow, restarted empty or full costs misses, never a wrong answer or a hung request; two
processes encoding at once leave one copy.

``.ci/run`` installs ``redis-server`` and sets ``PROMPTCACHE_REQUIRE_REDIS=1``, so there a
missing server fails the run; elsewhere these tests skip without one.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time

import pytest
import torch

from pckernels.engine import PromptCache
from pckernels.store import BlockKey, RemoteTier, parse_remote_url
from pckernels.store.remote import REMOTE_FORMAT
from pckernels.store.testing import LocalRedis, server_binary
from test_engine import PROMPTS, SCHEMA, tiny_llama, tokenizer  # noqa: F401  (tokenizer is a fixture)

if server_binary() is None:
    if os.environ.get("PROMPTCACHE_REQUIRE_REDIS"):
        raise RuntimeError("PROMPTCACHE_REQUIRE_REDIS is set but redis-server is not installed")
    pytest.skip("redis-server is not installed", allow_module_level=True)

NEW_TOKENS = 4
ORDER = ["all-of-union-one", "other-member", "nested", "scaffold-all", "params-short"]
LONG_PLAIN = "The archive holds letters, maps and ledgers from the harbour office. " * 40


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_llama(len(tokenizer))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture()
def redis_server():
    with LocalRedis() as server:
        yield server


@pytest.fixture(scope="module")
def expected(model, tokenizer):
    """Outputs of an engine without any remote tier."""
    pc = PromptCache(model, tokenizer, placement="schema")
    pc.add_schema(SCHEMA)
    out = answers(pc)
    out["plain"] = pc.complete(LONG_PLAIN, max_new_tokens=NEW_TOKENS)
    pc.close()
    return out


def same(got, want) -> bool:
    return got.token_ids == want.token_ids and torch.equal(got.first_logits, want.first_logits)


def answers(pc: PromptCache, salt: str = "") -> dict:
    """Each prompt from a clean arena (every block comes from the store; placement, hence rounding,
    is the same for every engine, so results compare bitwise)."""
    out = {}
    for name in ORDER:
        pc.evict_resident()
        out[name] = pc.submit(pc.request(PROMPTS[name], max_new_tokens=NEW_TOKENS, salt=salt)).result()
    return out


def key(digest_char: str, shape=None, dtype=None) -> BlockKey:
    return BlockKey(digest_char * 64, schema="s", module="m", shape=shape, dtype=dtype)


def meta_keys(client) -> list[bytes]:
    return [k for k in client.scan_iter(match="promptcache:kv:*") if k.count(b":") == 2]


# -- the tier on its own -----------------------------------------------------------------------


@pytest.mark.parametrize("shape,dtype", [((3, 2, 1, 7, 5), torch.float32), ((2, 2, 3, 1, 4), torch.bfloat16),
                                         ((2, 2, 2, 0, 8), torch.float32), ((1, 2, 1, 1, 1), torch.float16)])
def test_blocks_round_trip_in_chunks(redis_server, shape, dtype):
    tier = RemoteTier(redis_server.url, chunk_bytes=100)
    block = torch.randn(shape).to(dtype)
    k = key("a", shape=shape, dtype=dtype)
    assert not tier.contains(k) and tier.read(k) is None
    assert tier.write_behind(k, block, block.numel() * block.element_size())
    assert tier.flush(10)
    assert tier.contains(k)
    got = tier.read(k)
    assert got is not None and got.dtype == dtype and torch.equal(got, block)
    client = redis_server.client()
    nbytes = block.numel() * block.element_size()
    assert len(list(client.scan_iter(match="promptcache:kv:*"))) == 1 + -(-nbytes // 100)
    meta = json.loads(client.get(f"promptcache:kv:{'a' * 64}"))
    assert meta["format"] == REMOTE_FORMAT and meta["chunks"] == -(-nbytes // 100)
    tier.write_behind(k, block, nbytes)
    tier.flush(10)
    assert tier.describe()["present"] == 1 and tier.describe()["writes"] == 1
    tier.close()


def _corrupt_chunk(client, meta, name):
    value = bytearray(client.get(name))
    value[len(value) // 2] ^= 0x40
    client.set(name, bytes(value))


CORRUPTIONS = {
    "checksum mismatch": _corrupt_chunk,
    "truncated chunk": lambda client, meta, name: client.set(name, client.get(name)[:-1]),
    "incomplete": lambda client, meta, name: client.delete(name),
    "foreign value": lambda client, meta, name: client.set(f"promptcache:kv:{'b' * 64}", b"not json at all"),
    "foreign value (wrong key)": lambda client, meta, name: client.set(
        f"promptcache:kv:{'b' * 64}", client.get(f"promptcache:kv:{'a' * 64}")),
    "foreign value (type)": lambda client, meta, name: (client.delete(f"promptcache:kv:{'b' * 64}"),
                                                         client.hset(f"promptcache:kv:{'b' * 64}", "x", "1")),
    "corrupt metadata": lambda client, meta, name: client.set(
        f"promptcache:kv:{'b' * 64}", json.dumps({**meta, "key": "b" * 64, "chunks": meta["chunks"] + 1})),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_a_bad_value_is_a_miss_and_is_deleted(redis_server, kind):
    tier = RemoteTier(redis_server.url, chunk_bytes=64)
    shape = (2, 2, 1, 5, 3)
    block = torch.randn(shape)
    good = key("a", shape=shape, dtype=torch.float32)
    victim = key("b", shape=shape, dtype=torch.float32)
    for k in (good, victim):
        tier.write_behind(k, block, 1)
    tier.flush(10)
    client = redis_server.client()
    meta = json.loads(client.get(f"promptcache:kv:{'b' * 64}"))
    chunk = f"promptcache:kv:{'b' * 64}:{meta['writer']}:1"
    CORRUPTIONS[kind](client, meta, chunk)
    assert tier.read(victim) is None
    stats = tier.describe()
    assert stats["discarded"] == 1 and sum(stats["discard_reasons"].values()) == 1
    assert next(iter(stats["discard_reasons"])) == kind.split(" (")[0]
    assert not client.exists(f"promptcache:kv:{'b' * 64}")
    assert torch.equal(tier.read(good), block)
    tier.close()


def test_a_block_of_another_shape_or_dtype_is_refused(redis_server):
    tier = RemoteTier(redis_server.url)
    block = torch.randn(2, 2, 1, 5, 3)
    tier.write_behind(key("c"), block, 1)
    tier.flush(10)
    assert tier.read(key("c", shape=(2, 2, 1, 6, 3))) is None
    assert tier.describe()["discard_reasons"] == {"wrong shape": 1}
    tier.write_behind(key("d"), block, 1)
    tier.flush(10)
    assert tier.read(key("d", dtype=torch.float16)) is None
    tier.close()


@pytest.mark.parametrize("url", ["ftp://host:1", "redis://", "redis://host:port", "redis://h:1/x", "", 7])
def test_bad_urls_are_refused_before_the_model_is_touched(model, tokenizer, url):
    with pytest.raises(ValueError, match="remote"):
        parse_remote_url(url)
    with pytest.raises(ValueError):
        PromptCache.from_pretrained("smollm2", remote=url, placement="schema")


def test_valkey_urls_and_passwords():
    assert parse_remote_url("valkey://10.0.0.1:6380/2") == "redis://10.0.0.1:6380/2"
    tier = RemoteTier("redis://:hunter2@127.0.0.1:1/0")
    assert "hunter2" not in json.dumps(tier.describe())
    tier.close(timeout_s=0)


# -- two processes --------------------------------------------------------------------------------


def _child(fn, args, queue):
    torch.set_num_threads(1)
    try:
        queue.put(("ok", fn(*args)))
    except BaseException as exc:  # noqa: BLE001  (reported to the parent)
        queue.put(("error", repr(exc)))


def in_child(fn, *args, timeout=180):
    """Run ``fn(*args)`` in a forked process (a fresh engine: empty local tiers) and return its result."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, args, queue))
    proc.start()
    status, value = queue.get(timeout=timeout)
    proc.join(timeout=30)
    assert status == "ok", value
    return value


def _summary(result):
    return {"tokens": result.token_ids, "logits": result.first_logits.tolist()}


def _encode_and_answer(model, tokenizer, url, store_dir=None):
    pc = PromptCache(model, tokenizer, remote=url, store_dir=store_dir, placement="schema")
    pc.add_schema(SCHEMA)
    out = {name: _summary(r) for name, r in answers(pc).items()}
    out["plain"] = _summary(pc.complete(LONG_PLAIN, max_new_tokens=NEW_TOKENS))
    assert pc.store.flush(30)
    stats = pc.stats()
    pc.close()
    return out, stats


def test_a_fresh_process_answers_from_blocks_another_encoded(model, tokenizer, redis_server, expected, tmp_path):
    first, first_stats = in_child(_encode_and_answer, model, tokenizer, redis_server.url)
    assert first_stats["encodes"] > 0 and first_stats["remote"]["writes"] > 0
    second, stats = in_child(_encode_and_answer, model, tokenizer, redis_server.url, tmp_path)
    assert stats["encodes"] == 0, "the second process encoded modules the first had uploaded"
    assert stats["remote"]["hits"] > 0 and stats["remote"]["discarded"] == 0
    assert stats["prefix"]["restored_tokens"] >= 512, "plain-prompt prefix blocks were not shared"
    assert second == first
    for name in ORDER:
        assert first[name]["tokens"] == expected[name].token_ids
        assert torch.equal(torch.tensor(first[name]["logits"]), expected[name].first_logits)
    assert second["plain"]["tokens"] == expected["plain"].token_ids
    assert torch.equal(torch.tensor(second["plain"]["logits"]), expected["plain"].first_logits)
    assert stats["disk"]["entries"] > 0, "blocks read from the remote tier were not kept on local disk"


def test_warming_a_schema_the_fleet_has_loads_it_in_the_background(model, tokenizer, redis_server, expected):
    seed = PromptCache(model, tokenizer, remote=redis_server.url, placement="schema")
    seed.add_schema(SCHEMA)
    blocks = len(seed.store)
    assert seed.store.flush(10)
    seed.close()
    pc = PromptCache(model, tokenizer, remote=redis_server.url, placement="schema")
    assert pc.warm_schema(pc.add_schema(SCHEMA)) == blocks
    deadline = time.monotonic() + 20
    while pc.stats()["prefetched"] < blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(pc.store) == blocks and pc.stats()["encodes"] == 0
    reads = pc.stats()["remote"]["hits"]
    for name, result in answers(pc).items():
        assert same(result, expected[name]), name
    assert pc.stats()["remote"]["hits"] == reads, "a query went to Redis for a block install had loaded"
    pc.close()


def _encode_at_barrier(model, tokenizer, url, barrier):
    pc = PromptCache(model, tokenizer, remote=url, placement="schema")
    barrier.wait()
    pc.add_schema(SCHEMA)
    out = {name: _summary(r) for name, r in answers(pc).items()}
    assert pc.store.flush(30)
    encodes = pc.stats()["encodes"]
    pc.close()
    return out, encodes


def test_two_processes_encoding_at_once_leave_one_copy(model, tokenizer, redis_server):
    """Both start encoding the same schema at one barrier: the encoding leases make each unit
    encoded once across the two (the other waits for its upload), and one copy of each is stored."""
    solo = PromptCache(model, tokenizer, placement="schema")
    solo.add_schema(SCHEMA)
    units = solo.stats()["encodes"]
    solo.close()
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(_encode_at_barrier, (model, tokenizer, redis_server.url, barrier),
                                              queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert all(status == "ok" for status, _ in results), results
    (first, first_encodes), (second, second_encodes) = (value for _, value in results)
    assert first == second
    assert first_encodes + second_encodes == units, (first_encodes, second_encodes, units)
    assert not list(redis_server.client().scan_iter(match="promptcache:lease:*")), "a lease was left behind"
    client = redis_server.client()
    writers: dict[bytes, set[bytes]] = {}
    for name in client.scan_iter(match="promptcache:kv:*:*:*"):
        _, _, digest, writer, _ = name.split(b":")
        writers.setdefault(digest, set()).add(writer)
    metas = {k.split(b":")[2]: json.loads(client.get(k)) for k in meta_keys(client)}
    assert metas and set(writers) <= set(metas)
    for digest, meta in metas.items():
        assert writers.get(digest, set()) <= {meta["writer"].encode()}, "a losing writer's chunks were left"


def test_a_lease_whose_holder_never_uploads_is_waited_out(model, tokenizer, redis_server, expected):
    """A holder that died mid-encode leaves its lease: the others wait until it expires, then encode."""
    pc = PromptCache(model, tokenizer, remote=RemoteTier(redis_server.url, lease_s=1.0), placement="schema")
    client = redis_server.client()
    schema = pc.parse_schema(SCHEMA)
    first = pc.block_key(schema, next(name for name, m in schema.modules.items() if m.cached))
    client.set(pc.store.remote.lease_key(first.digest), "a-dead-process", px=800)
    t0 = time.monotonic()
    pc.add_schema(SCHEMA)
    waited = time.monotonic() - t0
    assert 0.5 < waited < 5, waited
    for name, result in answers(pc).items():
        assert same(result, expected[name]), name
    pc.close()


def test_tenants_never_share_or_collide(model, tokenizer, redis_server):
    pc = PromptCache(model, tokenizer, remote=redis_server.url, placement="schema")
    pc.add_schema(SCHEMA, salt="tenant-a")
    pc.store.flush(10)
    client = redis_server.client()
    per_tenant = len(meta_keys(client))
    pc.add_schema(SCHEMA, salt="tenant-b")
    pc.store.flush(10)
    assert len(meta_keys(client)) == 2 * per_tenant
    assert pc.stats()["remote"]["present"] == 0
    pc.close()
    other = PromptCache(model, tokenizer, remote=redis_server.url, placement="schema")
    other.add_schema(SCHEMA, salt="tenant-c")
    assert other.stats()["encodes"] > 0 and other.stats()["remote"]["hits"] == 0
    got = answers(other, salt="tenant-c")
    plain = other.submit(other.complete_request(LONG_PLAIN, max_new_tokens=NEW_TOKENS, salt="tenant-c")).result()
    assert other.stats()["prefix"]["restored_tokens"] == 0
    other.store.flush(10)
    shared = PromptCache(model, tokenizer, remote=redis_server.url, placement="schema")
    shared.add_schema(SCHEMA, salt="tenant-c")
    assert shared.stats()["encodes"] == 0
    for name, result in answers(shared, salt="tenant-c").items():
        assert same(result, got[name]), name
    again = shared.submit(shared.complete_request(LONG_PLAIN, max_new_tokens=NEW_TOKENS, salt="tenant-c")).result()
    assert same(again, plain)
    restored = shared.stats()["prefix"]["restored_tokens"]
    assert restored >= 512
    shared.complete(LONG_PLAIN, max_new_tokens=NEW_TOKENS)
    assert shared.stats()["prefix"]["restored_tokens"] == restored, "a salted block served a prompt without the salt"
    other.close()
    shared.close()


# -- faults ---------------------------------------------------------------------------------------


def test_killed_then_restarted_empty(model, tokenizer, redis_server, expected):
    tier = RemoteTier(redis_server.url, timeout_s=0.5, connect_timeout_s=0.2, backoff_s=(0.1, 0.4))
    pc = PromptCache(model, tokenizer, remote=tier, device_budget=0, host_budget=0, placement="schema")
    pc.add_schema(SCHEMA)
    assert pc.store.flush(10)
    redis_server.kill()
    t0 = time.monotonic()
    for name, result in answers(pc).items():
        assert same(result, expected[name]), name
    assert time.monotonic() - t0 < 30
    stats = pc.stats()
    assert stats["remote"]["errors"] >= 1 and not stats["remote"]["up"]
    assert stats["encodes"] > len(ORDER), "with no memory tiers and the server gone, blocks are encoded again"
    redis_server.start()
    time.sleep(0.5)
    for name, result in answers(pc).items():
        assert same(result, expected[name]), name
    assert pc.store.flush(10)
    stats = pc.stats()["remote"]
    assert stats["up"] and stats["reconnects"] >= 1 and stats["writes"] > 0
    assert meta_keys(redis_server.client()), "the restarted server was not repopulated"
    pc.close()
    encoder = PromptCache(model, tokenizer, remote=redis_server.url, placement="schema")
    encoder.add_schema(SCHEMA)
    assert encoder.stats()["encodes"] > 0 and encoder.store.flush(10)
    encoder.close()
    fresh = PromptCache(model, tokenizer, remote=redis_server.url, placement="schema")
    fresh.add_schema(SCHEMA)
    for name in ORDER:
        fresh.generate(PROMPTS[name], max_new_tokens=1)
    assert fresh.stats()["encodes"] == 0
    fresh.close()


def test_a_slow_server_times_out_and_the_request_completes(model, tokenizer, redis_server, expected):
    seed = PromptCache(model, tokenizer, remote=redis_server.url, placement="schema")
    seed.add_schema(SCHEMA)
    seed.store.flush(10)
    seed.close()
    pc = PromptCache(model, tokenizer, remote=RemoteTier(redis_server.url, timeout_s=0.3, connect_timeout_s=0.2),
                     placement="schema")
    pc.store.remote.contains(key("e"))
    sleeper = threading.Thread(target=lambda: redis_server.client().execute_command("DEBUG", "SLEEP", "4"))
    sleeper.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    pc.add_schema(SCHEMA)
    result = pc.generate(PROMPTS["nested"], max_new_tokens=NEW_TOKENS)
    elapsed = time.monotonic() - t0
    sleeper.join()
    assert same(result, expected["nested"])
    assert elapsed < 3.5, f"a stalled server held the request for {elapsed:.1f} s"
    assert pc.stats()["remote"]["errors"] >= 1 and pc.stats()["encodes"] > 0
    pc.close()


def test_a_full_server_refuses_writes_and_answers_stay_exact(model, tokenizer, redis_server, expected, caplog):
    client = redis_server.client()
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)
    pc = PromptCache(model, tokenizer, remote=redis_server.url, placement="schema")
    pc.add_schema(SCHEMA)
    assert pc.store.flush(10)
    for name, result in answers(pc).items():
        assert same(result, expected[name]), name
    stats = pc.stats()["remote"]
    assert stats["writes"] == 0 and stats["dropped_writes"] > 0 and stats["up"]
    assert any("refused a write" in r.getMessage() for r in caplog.records)
    assert not meta_keys(client) and not list(client.scan_iter(match="promptcache:*"))
    pc.close()


def test_an_evicted_chunk_is_detected_and_re_encoded(model, tokenizer, redis_server, expected):
    seed = PromptCache(model, tokenizer, remote=RemoteTier(redis_server.url, chunk_bytes=512), placement="schema")
    seed.add_schema(SCHEMA)
    seed.store.flush(10)
    seed.close()
    client = redis_server.client()
    chunks = sorted(client.scan_iter(match="promptcache:kv:*:*:1"))
    client.delete(chunks[0])
    pc = PromptCache(model, tokenizer, remote=RemoteTier(redis_server.url, chunk_bytes=512), placement="schema")
    pc.add_schema(SCHEMA)
    for name, result in answers(pc).items():
        assert same(result, expected[name]), name
    stats = pc.stats()
    assert stats["remote"]["discard_reasons"] == {"incomplete": 1}
    assert stats["encodes"] >= 1
    assert stats["remote"]["hits"] > 0
    assert pc.store.flush(10) and pc.stats()["remote"]["writes"] >= 1, "the re-encoded block was not written back"
    pc.close()
    third = PromptCache(model, tokenizer, remote=redis_server.url, placement="schema")
    third.add_schema(SCHEMA)
    for name, result in answers(third).items():
        assert same(result, expected[name]), name
    assert third.stats()["encodes"] == 0 and third.stats()["remote"]["discarded"] == 0
    third.close()


def test_the_remote_benchmark_runs(tmp_path):
    """``perf.remote_fleet``'s cold-process part end to end, tiny: every way gives the seed's output
    and the remote way encodes nothing."""
    from perf import remote_fleet

    out = tmp_path / "remote"
    assert remote_fleet.main(["--repeats", "1", "--servers", "0", "--rag", "2", "24", "1", "--threads", "1",
                              "--out", str(out)]) == 0
    result = json.loads((out / "remote_fleet.json").read_text())
    modes = result["cold"]["modes"]
    assert all(m["same_output"] for m in modes.values())
    assert modes["remote"]["encodes"] == 0 and modes["encode"]["encodes"] > 0
    assert modes["remote"]["bytes_per_cached_token"] > 0
    assert "faster" in (out / "summary.md").read_text()


def _hybrid_answers(url, salt, store_dir=None):
    from pckernels.prefix.testing import tiny_model, tiny_tokenizer

    byte_tokenizer = tiny_tokenizer()
    pc = PromptCache(tiny_model("qwen3_next", len(byte_tokenizer)), byte_tokenizer, remote=url, store_dir=store_dir,
                     prefix_block_size=32, placement="schema")
    out = [_summary(pc.submit(pc.complete_request(LONG_PLAIN + f" Question {i}?", max_new_tokens=NEW_TOKENS,
                                                  salt=salt)).result()) for i in range(2)]
    assert pc.store.flush(30)
    stats = pc.stats()
    pc.close()
    return out, stats


def test_a_hybrid_models_prefix_blocks_cross_the_fleet_with_their_states(redis_server, tmp_path):
    """A hybrid model's prefix blocks (keys, values and recurrent snapshots, packed) published by one
    process restore exactly in a fresh one, per tenant salt only."""
    first, first_stats = in_child(_hybrid_answers, redis_server.url, "tenant-a")
    assert first_stats["remote"]["writes"] > 0
    second, stats = in_child(_hybrid_answers, redis_server.url, "tenant-a", tmp_path)
    assert stats["prefix"]["restored_tokens"] >= 1024 and stats["remote"]["discarded"] == 0
    assert second == first
    other, other_stats = in_child(_hybrid_answers, redis_server.url, "tenant-b")
    assert other_stats["prefix"]["restored_tokens"] == 0 and other == first
