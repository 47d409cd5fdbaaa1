"""KV events in vLLM's wire format (``--kv-events-config``, ``pckernels.store.events``).

A subscriber written like vLLM's ``examples/online_serving/kv_events_subscriber.py`` (msgspec
structs, the batch array-like and each event a map tagged under "type"; SUB socket; replay on a gap) follows a session of the embedded
SmolLM2 under small budgets — chats, RAG prompts importing PML modules, a schema uploaded through
the server's app, evictions down every tier, a restart of the subscriber that replays what it
missed — and the blocks it believes the server holds equal the store's, per medium. Then: bad
configurations are refused naming the field, an endpoint in use is a clear error, a subscriber
that never reads blocks nothing, a publisher that cannot keep up drops (counted) and resyncs, and
nothing is bound without the option.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Union

import msgspec
import pytest
import zmq

from pckernels.engine.config import EngineConfig
from pckernels.errors import OptionError
from pckernels.store.events import BlockLedger, KVEventsConfig, kv_events_config
from pckernels.store.events.ledger import digest_hash


# -- the subscriber, as vLLM's example writes it ------------------------------------------------------

class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, tag_field="type"):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str] = None
    extra_keys: Optional[list[Optional[list]]] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


class Subscriber:
    """Follows one publisher: the blocks held per medium, from live batches and replays."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str = "",
                 state: dict | None = None, last_seq: int = -1) -> None:
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.replay = None
        if replay_endpoint is not None:
            self.replay = self.ctx.socket(zmq.DEALER)  # REQ's framing, several answers to one request
            self.replay.connect(replay_endpoint)
        self.held: dict[str, set[int]] = {m: set(v) for m, v in (state or {}).items()}
        self.last_seq = last_seq
        self.stored: list[BlockStored] = []
        self.removed: list[BlockRemoved] = []
        self.cleared = 0
        self.replayed = 0

    def ask_replay(self, start: int) -> None:
        self.replay.send_multipart((b"", start.to_bytes(8, "big")))
        while self.replay.poll(5000):
            _, seq_bytes, payload = self.replay.recv_multipart()
            if not payload:
                return
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.last_seq:
                self.apply(self.decoder.decode(payload))
                self.last_seq = seq
                self.replayed += 1
        raise AssertionError("the replay never ended")

    def poll(self, timeout_ms: int = 200) -> int:
        """Take every batch waiting (replaying over gaps); how many live batches were read."""
        count = 0
        while self.sub.poll(timeout_ms):
            _, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            count += 1
            if seq <= self.last_seq:
                continue
            if self.last_seq >= 0 and seq > self.last_seq + 1:
                assert self.replay is not None, f"missed batches {self.last_seq + 1}..{seq - 1} and no replay"
                self.ask_replay(self.last_seq + 1)
                if seq <= self.last_seq:
                    continue
            self.apply(self.decoder.decode(payload))
            self.last_seq = seq
            timeout_ms = 50
        return count

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.stored.append(event)
                self.held.setdefault(event.medium, set()).update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.removed.append(event)
                missing = set(event.block_hashes) - self.held.get(event.medium, set())
                assert not missing, f"removed blocks never stored in {event.medium}: {missing}"
                self.held[event.medium] -= set(event.block_hashes)
            else:
                self.cleared += 1
                self.held = {}

    def view(self) -> dict[str, set[int]]:
        return {m: set(v) for m, v in self.held.items() if v}

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def documented_hash(parent: int | None, token_ids: list[int], extra) -> int:
    """docs/kv-events.md's prefix-block hash, written from the page."""
    h = hashlib.sha256(b"promptcache-kv-block/1\0")
    h.update(b"\0" if parent is None else b"\1" + parent.to_bytes(8, "big"))
    for part in extra or ():
        h.update(part.encode() + b"\0")
    h.update(b"\0")
    h.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return int.from_bytes(h.digest()[:8], "big")


# -- the session ------------------------------------------------------------------------------------

BLOCK = 16
SCHEMA = """<schema name="rag">
  <system>Answer from the documents.</system>
  <union name="doc">
    <module name="rivers">The Loire is the longest river in France; it flows into the Atlantic at Saint-Nazaire.</module>
    <module name="peaks">Mont Blanc is the highest mountain of the Alps, 4806 metres above the sea.</module>
  </union>
</schema>"""
UPLOADED = """<schema name="notes">
  <module name="memo">The meeting moved to Thursday at ten, in the small room on the second floor.</module>
</schema>"""


def truth(cache) -> dict[str, set[int]]:
    """The blocks the store and the prefix cache hold, per medium, read from them."""
    store, prefix = cache.store, cache.prefix
    ledger = cache.kv_events.ledger
    gpu = {e.info.hash for e in prefix._store.entries() if e.final_logits is None and e.num_tokens == BLOCK}
    gpu |= {key.info.hash for key in store.device_tier.blocks}
    cpu = {key.info.hash for key in store.host_tier.blocks}
    disk = set()
    for digest in store.disk._sizes:
        named = ledger._where.get(("disk", digest))
        assert named is not None and named[1] is not None, f"disk block {digest[:12]} has no name"
        disk.add(named[1].hash)
    return {m: s for m, s in (("GPU", gpu), ("CPU", cpu), ("DISK", disk)) if s}


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def session(request, tokenizer, tmp_path_factory):
    """An engine publishing KV events, its tiers a few blocks each: a tiny random Llama with the
    embedded tokenizer (the suite's), or the embedded SmolLM2 itself (``slow``: minutes on a busy
    machine)."""
    from pckernels.engine import PromptCache
    from test_engine import tiny_llama

    tmp = tmp_path_factory.mktemp("kv-events")
    endpoint, replay = f"ipc://{tmp}/pub", f"ipc://{tmp}/replay"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay,
              "topic": "kv@test", "buffer_steps": 10_000}
    if request.param == "tiny":
        model = tiny_llama(len(tokenizer), layers=2)
        per_token = 2 * 2 * 2 * 8 * 4  # layers, keys and values, KV heads, head size, fp32
    else:
        from pckernels.integration.embedded import load_model

        model, per_token = load_model(), 30 * 2 * 3 * 64 * 4
    budgets = dict(device_budget=60 * per_token, host_budget=60 * per_token, disk_budget=200 * per_token)
    cache = PromptCache(model, tokenizer, store_dir=tmp / "kv", prefix_block_size=BLOCK, kv_events=config, **budgets)
    yield cache, endpoint, replay, tmp
    cache.close()


def wait_for_subscribers(cache, count: int) -> None:
    deadline = time.monotonic() + 10
    while cache.kv_events.stats()["subscribers"] < count and time.monotonic() < deadline:
        time.sleep(0.01)


def chat(cache, turns: list[str], salt: str = "") -> None:
    messages = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        result = cache.complete(messages, max_new_tokens=3, salt=salt)
        messages.append({"role": "assistant", "content": result.text})


def test_a_subscriber_follows_the_store_per_medium(session):
    from fastapi.testclient import TestClient

    from pckernels.server import create_app

    cache, endpoint, replay, _ = session
    first = Subscriber(endpoint, replay, topic="kv@")
    wait_for_subscribers(cache, 1)
    first.ask_replay(0)  # what was published before it connected (the start's AllBlocksCleared)

    chat(cache, ["Name three rivers of France.", "Which one is the longest?"])
    chat(cache, ["Name three rivers of France.", "Which one is the shortest?"], salt="tenant-b")
    cache.add_schema(SCHEMA)
    cache.generate('<prompt schema="rag"><rivers/><user>Where does the Loire end?</user><assistant/></prompt>',
                   max_new_tokens=3)
    cache.generate('<prompt schema="rag"><peaks/><user>How high is Mont Blanc?</user><assistant/></prompt>',
                   max_new_tokens=3)
    app = create_app(cache, close_engine=False)
    with TestClient(app) as client:
        assert client.post("/v1/schemas", json={"pml": UPLOADED}).status_code in (200, 202)
        deadline = time.monotonic() + 60
        while client.get("/v1/schemas/notes").json().get("status") != "ready":
            assert time.monotonic() < deadline, "the uploaded schema never became ready"
            time.sleep(0.05)
        reply = client.post("/v1/completions", json={"model": cache.name, "prompt": "",
                                                     "max_tokens": 2,
                                                     "pml": '<prompt schema="notes"><memo/><user>When?</user>'
                                                            '<assistant/></prompt>'})
        assert reply.status_code == 200, reply.text
        cache.kv_events.flush()
        first.poll()
        metrics = client.get("/metrics").text
    for name in ("promptcache_kv_events_published_total", "promptcache_kv_events_dropped_total",
                 "promptcache_kv_event_subscribers 1.0", "promptcache_kv_event_replays_total 1.0"):
        assert name in metrics, name

    # evictions down every tier: the prefix cache spills to the device tier, which overflows to host,
    # which leaves for disk, whose small budget deletes files
    cache.prefix.evict(1 << 40)
    chat(cache, ["Tell me a short fact about Lyon, the city by the Rhone.", "And one about Marseille?"])
    cache.prefix.evict(1 << 40)
    cache.kv_events.flush()
    first.poll()
    assert first.view() == truth(cache) == cache.kv_events.ledger.held()

    # the subscriber goes away; the server goes on; it comes back with what it had and replays the rest
    saved, last_seq = first.view(), first.last_seq
    first.close()
    chat(cache, ["Name three rivers of France.", "Which one is the longest?", "Is it navigable?"])
    chat(cache, ["Tell me a short fact about Lyon, the city by the Rhone.", "And one about Nice?"])
    cache.generate('<prompt schema="rag"><peaks/><user>Which range?</user><assistant/></prompt>', max_new_tokens=2)
    cache.prefix.evict(1 << 40)
    cache.kv_events.flush()
    back = Subscriber(endpoint, replay, topic="kv@", state=saved, last_seq=last_seq)
    fresh = Subscriber(endpoint, replay, topic="kv@")  # knows nothing: replays from 0
    wait_for_subscribers(cache, 2)
    back.ask_replay(last_seq + 1)
    fresh.ask_replay(0)
    chat(cache, ["Name a river of Spain."])  # a live batch after the restart
    cache.kv_events.flush()
    back.poll()
    fresh.poll()
    expected = truth(cache)
    assert back.view() == expected, {m: (back.view().get(m, set()) ^ s) for m, s in expected.items()}
    assert fresh.view() == expected
    assert back.replayed > 0 and fresh.replayed > back.replayed

    # not vacuous: every medium gained and lost blocks, modules and prefix blocks alike
    seen = first.stored + back.stored
    assert {e.medium for e in seen} >= {"GPU", "CPU", "DISK"}
    assert {e.medium for e in first.removed + back.removed} >= {"GPU", "CPU", "DISK"}
    modules = [e for e in seen if e.extra_keys and e.extra_keys[0] and e.extra_keys[0][0] == "pml"]
    assert {tuple(e.extra_keys[0][1:3]) for e in modules} >= {("rag", "rivers"), ("rag", "peaks"), ("notes", "memo")}
    for event in modules:
        assert len(event.block_hashes) == 1 and event.block_size == len(event.token_ids)
        assert event.block_hashes[0] == digest_hash(event.extra_keys[0][-1])
    # prefix blocks carry their tokens and parent; their hashes are the documented chain
    prefix = [e for e in seen if not (e.extra_keys and e.extra_keys[0] and e.extra_keys[0][0] == "pml")]
    salted = 0
    for event in prefix:
        assert event.block_size == BLOCK and len(event.token_ids) == BLOCK * len(event.block_hashes)
        parent = event.parent_block_hash
        for i, block in enumerate(event.block_hashes):
            extra = (event.extra_keys or [None] * len(event.block_hashes))[i]
            salted += bool(extra and extra[0] == "salt")
            assert block == documented_hash(parent, event.token_ids[i * BLOCK:(i + 1) * BLOCK], extra)
            parent = block
    assert salted, "the tenant's chain was not salted"
    stats = cache.kv_events.stats()
    assert stats["dropped"] == 0 and stats["unknown"] == 0
    back.close()
    fresh.close()


def test_a_clear_is_all_blocks_cleared(session):
    cache, endpoint, replay, _ = session
    sub = Subscriber(endpoint, replay, topic="kv@")
    wait_for_subscribers(cache, 1)
    sub.ask_replay(0)
    assert sub.view() == truth(cache) != {}
    cache.prefix.clear()
    cache.store.clear(disk=True)
    cache.kv_events.flush()
    sub.poll()
    assert sub.view() == {} == truth(cache)
    assert sub.cleared >= 2  # the start's, then the clear's
    sub.close()


# -- bad input and the server's safety --------------------------------------------------------------

@pytest.mark.parametrize("given, field", [
    ('{"enable_kv_cache_events": true,', "JSON"),
    ('[1, 2]', "JSON object"),
    ('{"enable_kv_cache_events": true, "topics": "x"}', "'topics'"),
    ('{"enable_kv_cache_events": "yes"}', "'enable_kv_cache_events'"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "'publisher'"),
    ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', "'endpoint'"),
    ('{"enable_kv_cache_events": true, "endpoint": "tcp://*:70000"}', "'endpoint'"),
    ('{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:5557"}', "'replay_endpoint'"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "'buffer_steps'"),
    ('{"enable_kv_cache_events": true, "hwm": -1}', "'hwm'"),
    ('{"enable_kv_cache_events": true, "max_queue_size": true}', "'max_queue_size'"),
    ('{"enable_kv_cache_events": true, "topic": 5}', "'topic'"),
])
def test_a_bad_configuration_is_refused_naming_the_field(given, field):
    with pytest.raises(OptionError) as caught:
        kv_events_config(given)
    assert field in str(caught.value) and caught.value.option == "kv_events"
    with pytest.raises(OptionError):
        EngineConfig(kv_events=given)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_command_line_names_the_flag_and_refuses_a_port_in_use_before_loading():
    from pckernels.cli_common import option_message

    with pytest.raises(OptionError) as caught:
        EngineConfig(kv_events='{"enable_kv_cache_events": true, "hwm": "lots"}')
    assert option_message(caught.value) == ("--kv-events-config: field 'hwm' must be an integer >= 0, got 'lots'")
    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        given = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
        # the embedded model: the endpoint is refused before it loads
        done = subprocess.run([sys.executable, "-m", "pckernels.cli", "serve", "--memory-only",
                               "--kv-events-config", given], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert f"--kv-events-config field 'endpoint': cannot use tcp://*:{port}: Address already in use" in done.stderr
        assert "Traceback" not in done.stderr and "loading" not in done.stdout
    finally:
        busy.close()


def test_nothing_is_bound_or_told_without_the_option(tokenizer):
    from pckernels.engine import PromptCache
    from pckernels.store.events import NO_PLACE
    from test_engine import tiny_llama

    assert EngineConfig().kv_events is None
    port = free_port()
    off = kv_events_config({"enable_kv_cache_events": False, "endpoint": f"tcp://*:{port}"})
    assert not off.active and off.publisher == "null"
    for given in (None, {"enable_kv_cache_events": True, "publisher": "null", "endpoint": f"tcp://*:{port}"}):
        cache = PromptCache(tiny_llama(len(tokenizer)), tokenizer, prefix_block_size=BLOCK, kv_events=given)
        try:
            cache.complete("Nothing is published about this prompt, which fills a block or two.", max_new_tokens=1)
            assert cache.kv_events is None and cache.store.events is None and "kv_events" not in cache.stats()
            assert cache.store.device_tier.events is NO_PLACE and cache.prefix._events is None
            with socket.socket() as s:
                s.bind(("0.0.0.0", port))  # still free
        finally:
            cache.close()


@pytest.fixture(scope="module")
def tokenizer():
    from pckernels.integration.embedded import load_tokenizer

    return load_tokenizer()


def _info(n: int):
    from pckernels.store.events import prefix_block_info

    return prefix_block_info(None, [n % 50_000] * 4)


def test_a_subscriber_that_never_reads_blocks_nothing(tmp_path):
    from pckernels.store.events import start_publisher

    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/pub", hwm=8,
                            max_queue_size=100_000)
    publisher = start_publisher(config)
    ctx = zmq.Context()
    try:
        stuck = ctx.socket(zmq.SUB)
        stuck.setsockopt(zmq.RCVHWM, 1)
        stuck.connect(config.endpoint)
        stuck.setsockopt(zmq.SUBSCRIBE, b"")
        reader = Subscriber(config.endpoint, None)
        deadline = time.monotonic() + 10
        while publisher.stats()["subscribers"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        place = publisher.ledger.place("device", "GPU")
        started = time.monotonic()
        for n in range(3000):
            place.hold(n, _info(n))
            if n % 50 == 0:
                assert publisher.flush(5.0)
                reader.poll(20)
        spent = time.monotonic() - started
        assert publisher.flush(5.0)
        reader.poll()
        assert reader.view() == publisher.ledger.held() and len(reader.view()["GPU"]) == 3000
        assert publisher.stats()["batches"] > 60 > 8  # far past the stuck subscriber's high-water mark
        assert spent < 60
    finally:
        ctx.destroy(linger=0)
        publisher.close()


def test_a_publisher_that_cannot_keep_up_drops_counted_then_resyncs(tmp_path, monkeypatch):
    from pckernels.store.events import start_publisher
    from pckernels.store.events.publisher import KVEventPublisher

    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/pub", max_queue_size=16)
    publisher = start_publisher(config)
    reader = Subscriber(config.endpoint, None)
    try:
        deadline = time.monotonic() + 10
        while publisher.stats()["subscribers"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        place = publisher.ledger.place("host", "CPU")
        stall = __import__("threading").Event()
        send = KVEventPublisher._send
        monkeypatch.setattr(publisher, "_send", lambda *a: (stall.wait(10), send(publisher, *a)))
        place.hold(-1, _info(10_000))
        time.sleep(0.1)  # the thread is stuck sending that one
        started = time.monotonic()
        for n in range(200):
            place.hold(n, _info(n))
        for n in range(0, 200, 2):
            place.drop(n)
        assert time.monotonic() - started < 5  # the store's threads never wait for it
        assert publisher.ledger.dropped > 0
        stall.set()
        assert publisher.flush(10.0)
        reader.poll()
        assert reader.cleared >= 1 and reader.view() == publisher.ledger.held()
        assert len(reader.view()["CPU"]) == 101
        assert publisher.stats()["dropped"] == publisher.ledger.dropped and publisher.stats()["resyncs"] == 1
    finally:
        reader.close()
        publisher.close()


def test_the_ledger_publishes_a_block_once_per_medium():
    ledger = BlockLedger()
    info = _info(7)
    prefix, device, host = ledger.place("prefix", "GPU"), ledger.place("device", "GPU"), ledger.place("host", "CPU")
    prefix.hold(b"chain", info)
    device.hold("digest", info)  # the same block spilled: GPU already has it
    device.drop("digest")
    host.hold("digest", info)
    prefix.drop(b"chain")
    prefix.drop(b"chain")  # twice: nothing more
    assert ledger.drain() == [("stored", "GPU", info), ("stored", "CPU", info), ("removed", "GPU", info.hash)]
    disk = ledger.place("disk", "DISK")
    disk.hold("found-at-start", None)  # a file whose key is not known yet: not published
    assert ledger.drain() == [] and ledger.stats()["unknown"] == 1
    disk.hold("found-at-start", info)
    assert ledger.drain() == [("stored", "DISK", info)] and ledger.stats()["unknown"] == 0
    with ledger.clearing():
        host.drop_all()
        disk.drop_all()
    assert ledger.drain() == [("cleared",)] and ledger.held() == {}


def test_hybrid_blocks_say_they_carry_recurrent_snapshots(tokenizer, tmp_path):
    """A hybrid model's prefix blocks (LFM2: short convolutions and attention) are published in
    memory and, spilled with their snapshots, in the store's tiers; a block ending a chunk carries
    the recurrent state and says so in its extra keys (its hash is the plain chain's)."""
    from pckernels.prefix import PrefixCache
    from pckernels.prefix.testing import tiny_model
    from pckernels.store import TieredStore

    ledger = BlockLedger()
    store = TieredStore(disk_dir=tmp_path, device_budget=0, host_budget=1 << 20)
    store.attach_events(ledger)
    cache = PrefixCache(tiny_model("lfm2", len(tokenizer)), tokenizer, block_size=8, chunk_size=16,
                        budget_bytes=1 << 20, spill=store, events=ledger)
    if not cache.reuse_supported:
        pytest.skip(f"reuse refused with this transformers version: {cache.refusal}")
    text = "Doc 0. You answer questions about tide tables for a small harbour; the tide turns at noon. Be brief."
    cache.complete(text, max_new_tokens=2)
    stored = [e for e in ledger.drain() if e[0] == "stored"]
    assert stored and {e[1] for e in stored} == {"GPU"}
    ids = tokenizer(text)["input_ids"]
    parent = None
    for n, (_, _, info) in enumerate(stored):
        assert list(info.token_ids) == ids[n * 8:(n + 1) * 8] and info.parent == parent
        assert info.hash == documented_hash(parent, list(info.token_ids), None)
        assert info.extra == (("recurrent",) if (n + 1) * 8 % 16 == 0 else None)
        parent = info.hash
    cache.evict(1 << 30)  # spilled, packed with their snapshots: host tier and disk
    held = ledger.held()
    assert held == {"CPU": {i.hash for _, _, i in stored}, "DISK": {i.hash for _, _, i in stored}}
    again = cache.complete(text, max_new_tokens=2)
    assert again.cached_tokens > 0 and ledger.held()["GPU"] <= held["CPU"]
    store.close()
