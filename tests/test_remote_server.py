"""Two ``promptcache serve`` processes sharing one real Redis (``--remote``): a schema encoded by
one server is installed on the other with zero encodes and answers identically; a plain prompt
read by one is a prefix hit on the other; tenants stay apart across the fleet; killing Redis
leaves both serving.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from pckernels.store.testing import LocalRedis, server_binary
from test_engine import tokenizer  # noqa: F401  (a fixture, used through model_dir)
from test_server import COMMON, LONG_SYSTEM, MODEL, PML, SCHEMA, Server, _wait_ready, model_dir  # noqa: F401

if server_binary() is None:
    if os.environ.get("PROMPTCACHE_REQUIRE_REDIS"):
        raise RuntimeError("PROMPTCACHE_REQUIRE_REDIS is set but redis-server is not installed")
    pytest.skip("redis-server is not installed", allow_module_level=True)

KEY_A, KEY_B = "fleet-key-a-0001", "fleet-key-b-0002"


def _wait_uploaded(server: Server, timeout_s: float = 60.0) -> dict[str, float]:
    """Metrics once the server has written blocks to Redis and has nothing left queued."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if metrics.get("promptcache_remote_writes_total{result=written}", 0) > 0 \
                and metrics.get("promptcache_remote_pending_bytes", 1) == 0:
            return metrics
        time.sleep(0.1)
    pytest.fail("the server never finished uploading to Redis")


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("fleet")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps({KEY_A: {"tenant": "a", "admin": True}, KEY_B: "b"}))
    with LocalRedis() as redis_server:
        mp = pytest.MonkeyPatch()
        mp.setenv("PROMPTCACHE_SALT_SECRET", "fleet-secret-shared-by-every-server")
        args = ("--model", str(model_dir), "--api-keys", str(keys), "--remote", redis_server.url, *COMMON)
        servers = []
        try:
            servers.append(Server(tmp, *args))
            servers.append(Server(tmp, *args))
            yield redis_server, servers
        finally:
            mp.undo()
            for server in servers:
                assert server.stop() == 0, server.output()
                assert "Traceback" not in server.output(), server.output()


def chat(server: Server, key: str, **body):
    return server.client(key).chat.completions.create(model=MODEL, max_tokens=6, temperature=0, **body)


def test_a_schema_encoded_by_one_server_is_not_encoded_by_the_other(fleet):
    _, (a, b) = fleet
    auth = {"Authorization": f"Bearer {KEY_A}"}
    assert httpx.post(a.url + "/v1/schemas", json={"pml": SCHEMA}, headers=auth).status_code == 202
    _wait_ready(a, "docs", KEY_A)
    uploaded = _wait_uploaded(a)
    assert uploaded["promptcache_store_encodes_total"] > 0
    assert httpx.post(b.url + "/v1/schemas", json={"pml": SCHEMA}, headers=auth).status_code == 202
    _wait_ready(b, "docs", KEY_A)
    first_a = chat(a, KEY_A, messages=[], extra_body={"pml": PML})
    first_b = chat(b, KEY_A, messages=[], extra_body={"pml": PML})
    metrics = b.metrics()
    assert metrics["promptcache_store_encodes_total"] == 0, "server B encoded what server A had uploaded"
    assert metrics["promptcache_store_hits_total{tier=remote}"] > 0
    assert first_b.choices[0].message.content == first_a.choices[0].message.content
    assert first_b.usage.prompt_tokens_details.cached_tokens == first_a.usage.prompt_tokens_details.cached_tokens > 0


def test_a_plain_prompt_read_by_one_server_is_a_prefix_hit_on_the_other(fleet):
    _, (a, b) = fleet
    messages = [{"role": "system", "content": "Fleet. " + LONG_SYSTEM}, {"role": "user", "content": "Hello."}]
    on_a = chat(a, KEY_A, messages=messages)
    assert on_a.usage.prompt_tokens_details.cached_tokens == 0
    _wait_uploaded(a)
    on_b = chat(b, KEY_A, messages=messages)
    assert on_b.usage.prompt_tokens_details.cached_tokens >= 256
    assert on_b.choices[0].message.content == on_a.choices[0].message.content
    other_tenant = chat(b, KEY_B, messages=messages)
    assert other_tenant.usage.prompt_tokens_details.cached_tokens == 0, "tenant b reused tenant a's blocks"
    assert other_tenant.choices[0].message.content == on_a.choices[0].message.content


def test_both_servers_keep_answering_when_redis_dies(fleet):
    redis_server, (a, b) = fleet
    messages = [{"role": "system", "content": "Outage. " + LONG_SYSTEM}, {"role": "user", "content": "Still there?"}]
    before = chat(a, KEY_A, messages=messages)
    redis_server.kill()
    try:
        for server in (a, b):
            t0 = time.monotonic()
            reply = chat(server, KEY_A, messages=messages + [{"role": "user", "content": "Again."}])
            assert reply.choices[0].message.content and time.monotonic() - t0 < 30
            fresh = chat(server, KEY_A, messages=[], extra_body={"pml": PML})
            assert fresh.choices[0].message.content
        metrics = b.metrics()
        assert metrics["promptcache_remote_up"] == 0 and metrics["promptcache_remote_errors_total"] >= 1
        assert chat(a, KEY_A, messages=messages).choices[0].message.content == before.choices[0].message.content
    finally:
        redis_server.start()
