"""``promptcache serve`` as users run it: a real uvicorn process on 127.0.0.1, driven by the
official ``openai`` client and httpx, compared with the library's own answers.

Two servers with a tiny random Llama (the embedded tokenizer): one with API keys for two tenants
(``a`` is an admin), one open with a queue of one for overload; and one test on the embedded model.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pckernels.engine import PromptCache
from test_engine import tiny_llama, tokenizer  # noqa: F401  (tokenizer is a fixture)

KEY_A, KEY_B = "key-tenant-a-0001", "key-tenant-b-0002"
MODEL = "tiny"
LONG_SYSTEM = "You answer from the handbook. " + " ".join(f"Rule {i}: keep the floor {i} clean." for i in range(60))
SCHEMA = """<schema name="docs">
  <system>Answer from the documents.</system>
  <module name="alpha">Alpha is the first document. It talks about rivers and bridges in detail.</module>
  <module name="beta">Beta is the second document. It lists mountains, their heights and their names.</module>
</schema>"""
PML = '<prompt schema="docs"><alpha/><beta/><user>Which document is about rivers?</user><assistant/></prompt>'


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``promptcache serve`` subprocess on a free loopback port."""

    def __init__(self, tmp: Path, *args: str, ready_s: float = 180) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"server-{self.port}.log"
        env = {**os.environ, "PROMPTCACHE_CACHE_DIR": str(tmp / "cache"), "PYTHONUNBUFFERED": "1"}
        env.pop("TRITON_INTERPRET", None)
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "pckernels.cli", "serve", "--port", str(self.port),
                                      *args], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + ready_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.output()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server did not become ready:\n{self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=180)  # a 9K-token cold read on two busy cores

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return out

    def stop(self) -> int:
        """SIGTERM, as a supervisor stops it; the exit status (uvicorn re-raises the signal after
        a clean shutdown: -SIGTERM, or 0)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return 0 if self.proc.returncode == -signal.SIGTERM else self.proc.returncode


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny-llama"
    tiny_llama(len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def library(model_dir):
    """The same model in this process: what the server's answers must equal."""
    engine = PromptCache.from_pretrained(str(model_dir), device="cpu", dtype="float32", store_dir=False)
    yield engine
    engine.close()


COMMON = ["--device", "cpu", "--dtype", "float32", "--memory-only", "--served-model-name", MODEL, "--log-level", "info"]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps({KEY_A: {"tenant": "a", "admin": True}, KEY_B: "b"}))
    # with prompt-lookup drafts: every answer below must still equal the library's (no lookahead)
    srv = Server(tmp, "--model", str(model_dir), "--api-keys", str(keys), "--lookahead", "4", *COMMON)
    yield srv
    code = srv.stop()
    assert code == 0, srv.output()
    out = srv.output()
    assert "INFO pckernels.server: stopped" in out, out[-2000:]
    assert "Traceback" not in out, out


@pytest.fixture(scope="module")
def busy_server(model_dir, tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("busy"), "--model", str(model_dir), "--max-queue", "1", "--max-batch", "1",
                 *COMMON)
    yield srv
    assert srv.stop() == 0, srv.output()


def test_models_and_health(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/ready").json()["status"] == "ready"
    models = server.client(KEY_A).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_and_completion_equal_the_library(server, library):
    client = server.client(KEY_A)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    ref = library.complete(messages, max_new_tokens=12)
    assert chat.choices[0].message.content == ref.text
    assert chat.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")
    assert chat.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert chat.usage.completion_tokens == len(ref.token_ids)
    text = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=9, temperature=0)
    assert text.choices[0].text == library.complete("Once upon a time", max_new_tokens=9).text
    assert text.usage.completion_tokens == 9 and text.choices[0].finish_reason == "length"


def test_streaming_gives_the_same_text_and_holds_back_stop_strings(server, library):
    client = server.client(KEY_A)
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    full = library.complete(messages, max_new_tokens=24).text
    assert len(full) > 12
    stop = full[8:11]
    expected = library.complete(messages, max_new_tokens=24, stop=stop)
    assert stop not in expected.text
    for stops in (None, [stop]):
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                stream=True, stop=stops, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == (full if stops is None else expected.text)
        assert chunks[-1].usage.completion_tokens == (24 if stops is None else len(expected.token_ids))
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert reasons == (["length"] if stops is None else ["stop"])
    stream = client.completions.create(model=MODEL, prompt="A list of fruits:", max_tokens=10, temperature=0,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == library.complete("A list of fruits:", max_new_tokens=10).text


def test_cached_tokens_grow_over_a_conversation(server):
    client = server.client(KEY_A)
    messages = [{"role": "system", "content": LONG_SYSTEM}]
    cached = []
    for turn in range(3):
        messages.append({"role": "user", "content": f"Question {turn}: " + "what about the rules? " * 40})
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        assert cached[-1] < reply.usage.prompt_tokens
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert cached[0] == 0 and 0 < cached[1] < cached[2], cached


def test_pml_through_extra_body_equals_the_library(server, library):
    client = server.client(KEY_A)
    upload = httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA},
                        headers={"Authorization": f"Bearer {KEY_A}"})
    assert upload.status_code in (200, 202), upload.text
    _wait_ready(server, "docs", KEY_A)
    library.add_schema(SCHEMA)
    ref = library.generate(PML, max_new_tokens=10)
    chat = client.chat.completions.create(model=MODEL, messages=[], max_tokens=10, temperature=0,
                                          extra_body={"pml": PML})
    assert chat.choices[0].message.content == ref.text
    assert chat.usage.prompt_tokens_details.cached_tokens == ref.cached_tokens > 0
    text = client.completions.create(model=MODEL, prompt="", max_tokens=10, temperature=0, extra_body={"pml": PML})
    assert text.choices[0].text == ref.text


def test_schema_crud_errors_and_tenants(server):
    a = {"Authorization": f"Bearer {KEY_A}"}
    b = {"Authorization": f"Bearer {KEY_B}"}
    private = SCHEMA.replace('name="docs"', 'name="private"')
    bad = httpx.post(server.url + "/v1/schemas", content='<schema name="x">\n  <modul name="m">t</modul>\n</schema>',
                     headers={**a, "Content-Type": "application/xml"})
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["code"] == "pml_error" and error["line"] == 2 and error["column"] == 3 and "line 2" in error["message"]
    assert httpx.post(server.url + "/v1/schemas", json={"pml": private}, headers=a).status_code == 202
    assert httpx.post(server.url + "/v1/schemas", json={"pml": private}, headers=a).status_code == 200
    _wait_ready(server, "private", KEY_A)
    assert "private" in [s["name"] for s in httpx.get(server.url + "/v1/schemas", headers=a).json()["data"]]
    assert httpx.get(server.url + "/v1/schemas/private", headers=b).status_code == 404
    assert "private" not in [s["name"] for s in httpx.get(server.url + "/v1/schemas", headers=b).json()["data"]]
    prompt = PML.replace('schema="docs"', 'schema="private"')
    with pytest.raises(openai.NotFoundError) as err:
        server.client(KEY_B).chat.completions.create(model=MODEL, messages=[], max_tokens=2,
                                                     extra_body={"pml": prompt})
    assert err.value.body["code"] == "schema_not_found"
    shared = SCHEMA.replace('name="docs"', 'name="common"')
    refused = httpx.post(server.url + "/v1/schemas", json={"pml": shared, "shared": True}, headers=b)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
    assert httpx.post(server.url + "/v1/schemas", json={"pml": shared, "shared": True}, headers=a).status_code == 202
    _wait_ready(server, "common", KEY_B)
    reply = server.client(KEY_B).chat.completions.create(
        model=MODEL, messages=[], max_tokens=3, temperature=0,
        extra_body={"pml": PML.replace('schema="docs"', 'schema="common"')})
    assert reply.usage.prompt_tokens_details.cached_tokens > 0
    assert httpx.delete(server.url + "/v1/schemas/common", headers=b).status_code == 403
    assert httpx.delete(server.url + "/v1/schemas/private", headers=a).json()["deleted"] is True
    assert httpx.get(server.url + "/v1/schemas/private", headers=a).status_code == 404
    with pytest.raises(openai.NotFoundError):
        server.client(KEY_A).chat.completions.create(model=MODEL, messages=[], max_tokens=2,
                                                     extra_body={"pml": prompt})


def test_tenants_never_reuse_each_others_prefix(server):
    messages = [{"role": "system", "content": "Tenant test. " + LONG_SYSTEM}, {"role": "user", "content": "Hi."}]
    a, b = server.client(KEY_A), server.client(KEY_B)
    first = a.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    again = a.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    other = b.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    other_again = b.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other_again.usage.prompt_tokens_details.cached_tokens > 0
    assert first.choices[0].message.content == other.choices[0].message.content


def test_auth_failures_are_401_with_an_openai_body(server):
    with pytest.raises(openai.AuthenticationError) as err:
        server.client("wrong-key-123456").models.list()
    assert err.value.body["code"] == "invalid_api_key"
    plain = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert plain.status_code == 401 and plain.json()["error"]["type"] == "authentication_error"


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    h = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    post = lambda path, body: httpx.post(server.url + path, content=body, headers=h, timeout=30)  # noqa: E731
    cases = [
        ("/v1/chat/completions", "{not json", 400, "invalid_json"),
        ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}), 400,
         None),
        ("/v1/chat/completions", json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}), 404,
         "model_not_found"),
        ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [], "pml": "<prompt schema='docs'><zzz/>"}),
         400, "pml_error"),
        ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [], "pml": "<prompt schema='nope'/>"}), 404,
         "schema_not_found"),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": "word " * 3000, "max_tokens": 2}), 413,
         "context_length_exceeded"),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "n": 99}), 400, None),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "temperature": -1}), 400, None),
        ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}), 400, None),
    ]
    for path, body, status, code in cases:
        reply = post(path, body)
        assert reply.status_code == status, (body[:80], reply.text)
        error = reply.json()["error"]
        assert error["message"] and error["type"]
        if code:
            assert error["code"] == code, error
    timeout = post("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1500,
                                                  "timeout_s": 0.05}))
    assert timeout.status_code == 504 and timeout.json()["error"]["code"] == "deadline_exceeded"
    assert post("/v1/completions", json.dumps({"model": MODEL, "prompt": "still fine", "max_tokens": 2})).status_code \
        == 200


def test_a_client_that_disconnects_cancels_its_request(server):
    before = server.metrics().get("promptcache_cancelled_requests_total", 0)
    h = {"Authorization": f"Bearer {KEY_A}"}
    body = {"model": MODEL, "prompt": "Count forever:", "max_tokens": 1900, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=h, timeout=30) as reply:
        assert reply.status_code == 200
        next(reply.iter_lines())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = server.metrics()
        if m.get("promptcache_cancelled_requests_total", 0) > before and m["promptcache_running_requests"] == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the request kept running after the client left: {m}")
    assert m["promptcache_kv_arena_rows_used"] < 1900


def test_metrics_parse_and_count(server):
    server.client(KEY_A).completions.create(model=MODEL, prompt="metrics please", max_tokens=3, temperature=0)
    m = server.metrics()
    assert m["promptcache_requests_total{endpoint=/v1/completions,status=200}"] >= 1
    assert m["promptcache_requests_total{endpoint=/v1/chat/completions,status=401}"] >= 1
    assert m["promptcache_time_to_first_token_seconds_count{endpoint=completions}"] >= 1
    assert m["promptcache_generated_tokens_total"] >= 3
    assert m["promptcache_prompt_tokens_total{kind=cached}"] > 0
    assert m["promptcache_prompt_tokens_total{kind=computed}"] > 0
    assert m["promptcache_inter_token_seconds_count"] > 0
    assert m["promptcache_prefix_queries_total{result=hit}"] > 0
    assert 0 < m["promptcache_prefix_bytes"] <= m["promptcache_prefix_budget_bytes"] == 1 << 30
    assert m["promptcache_prefix_evictions_total"] == 0
    assert "promptcache_queue_depth" in m and "promptcache_store_hits_total{tier=device}" in m
    assert any(k.startswith("promptcache_batch_steps_total{size=") for k in m)
    assert 0 <= m["promptcache_draft_tokens_total{outcome=accepted}"] <= m["promptcache_draft_tokens_total{outcome=verified}"]


def test_a_flood_gets_429_with_retry_after_and_the_rest_is_answered(busy_server):
    async def flood():
        async with httpx.AsyncClient(base_url=busy_server.url, timeout=60) as client:
            body = {"model": MODEL, "prompt": "Flood", "max_tokens": 200, "temperature": 0}
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(10)))

    replies = asyncio.run(flood())
    codes = sorted(r.status_code for r in replies)
    assert set(codes) == {200, 429}, codes
    busy = [r for r in replies if r.status_code == 429]
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "engine_busy" for r in busy)
    texts = {r.json()["choices"][0]["text"] for r in replies if r.status_code == 200}
    assert len(texts) == 1, "the same greedy request must give the same answer however it was batched"
    assert httpx.get(busy_server.url + "/ready").status_code == 200
    assert httpx.get(busy_server.url + "/v1/models").status_code == 200, "an open server needs no key"


def test_open_server_refuses_a_public_host_without_keys(model_dir):
    out = subprocess.run([sys.executable, "-m", "pckernels.cli", "serve", "--model", str(model_dir), "--host",
                          "0.0.0.0", "--port", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--api-keys" in out.stderr + out.stdout


@pytest.mark.slow
def test_embedded_model_server_answers_like_the_library(tmp_path):
    srv = Server(tmp_path, "--memory-only", "--max-tokens", "8")
    try:
        client = srv.client()
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(model="smollm2", messages=messages, temperature=0)
        again = client.chat.completions.create(model="smollm2", messages=messages, temperature=0)
    finally:
        assert srv.stop() == 0, srv.output()
    engine = PromptCache.from_pretrained("smollm2", store_dir=False)
    try:
        ref = engine.complete(messages, max_new_tokens=8)
    finally:
        engine.close()
    assert reply.choices[0].message.content == ref.text == again.choices[0].message.content
    assert "Paris" in ref.text
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def _wait_ready(server: Server, name: str, key: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        record = httpx.get(f"{server.url}/v1/schemas/{name}", headers={"Authorization": f"Bearer {key}"}).json()
        if record.get("status") == "ready":
            return
        assert record.get("status") == "encoding", record
        time.sleep(0.05)
    pytest.fail(f"schema {name!r} never became ready")


def test_the_readme_client_example_runs_as_written(busy_server, capsys):
    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Serving", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    code = example.replace('"http://127.0.0.1:8000"', repr(busy_server.url)).replace('model="smollm2"',
                                                                                      f'model="{MODEL}"')
    assert code != example
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.split()
    assert printed and int(printed[-1]) > 0, "the PML prompt must reuse the schema's modules"


def test_the_load_generator_runs_against_a_server(busy_server, tmp_path):
    """``perf.server_load`` end to end, tiny: every method answers and Prompt Cache reuses modules."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from perf import server_load

    out = tmp_path / "load"
    assert server_load.main(["--url", busy_server.url, "--model", MODEL, "--clients", "1", "2", "--requests", "1",
                             "--rag", "3", "24", "2", "--template-tokens", "24", "--tokens", "2",
                             "--out", str(out)]) == 0
    rows = json.loads((out / "server_load.json").read_text())["rows"]
    assert {(r["method"], r["clients"]) for r in rows} == {(m, n) for m in server_load.METHODS for n in (1, 2)}
    assert all(r["mean_cached_tokens"] > 0 for r in rows if r["method"] == "prompt_cache")
    assert all(r["mean_cached_tokens"] == 0 for r in rows if r["method"] == "no_reuse")
    assert "| 2 | prompt_cache |" in (out / "summary.md").read_text()
