"""``promptcache dynamo-worker``: Dynamo's requests mapped onto the engine, its answers streamed back.

Dynamo itself (``ai-dynamo``) is not installed here or in CI; its part of the worker — the runtime,
the model's registration, the KV-event relay — is measured end to end by ``python -m
perf.fleet_dynamo`` (docs/fleet.md). These tests drive :class:`DynamoHandler` as Dynamo's runtime
does (one ``PreprocessedRequest`` dict in, an async stream of ``LLMEngineOutput`` dicts out) over a
tiny random Llama and check the answers against the engine's own ``complete``.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from typer.testing import CliRunner

from pckernels.cli import app
from pckernels.errors import OptionError
from pckernels.generation import SamplingParams
from pckernels.server.dynamo_worker import DynamoHandler, DynamoSettings, model_folder, sampling_from
from test_engine_prefix import BLOCK, doc, engine
from test_families import tokenizer  # noqa: F401  (fixture)


def request(ids, max_tokens=6, **sections) -> dict:
    out = {"token_ids": list(ids), "stop_conditions": {"max_tokens": max_tokens}, "sampling_options": {},
           "output_options": {}}
    for name, fields in sections.items():
        out.setdefault(name, {}).update(fields)
    return out


def collect(handler, req, context=None) -> list[dict]:
    async def go():
        return [chunk async for chunk in handler.generate(req, context)]

    return asyncio.run(go())


def answers(chunks) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for chunk in chunks:
        out.setdefault(chunk["index"], []).extend(chunk["token_ids"])
    return out


@pytest.fixture(scope="module")
def pc(tokenizer):  # noqa: F811
    return engine(tokenizer)


# -- the request mapping ----------------------------------------------------------------------------

def test_a_dynamo_request_becomes_one_sampling_params():
    req = request([1, 2, 3], max_tokens=9,
                  sampling_options={"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 11,
                                    "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1,
                                    "n": 2, "best_of": None, "use_beam_search": False},
                  stop_conditions={"min_tokens": 2, "ignore_eos": True, "stop_token_ids_hidden": [7, 8],
                                   "stop": ["never applied here"]},
                  output_options={"logprobs": 3, "skip_special_tokens": True})
    assert sampling_from(req) == SamplingParams(
        max_new_tokens=9, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=11, presence_penalty=0.5,
        frequency_penalty=0.25, repetition_penalty=1.1, n=2, min_tokens=2, ignore_eos=True, stop_token_ids=(7, 8),
        logprobs=3)
    assert sampling_from({"token_ids": [1]}, default_max_tokens=33) == SamplingParams(max_new_tokens=33)


@pytest.mark.parametrize("sections, field", [
    ({"sampling_options": {"use_beam_search": True}}, "use_beam_search"),
    ({"sampling_options": {"n": 1, "best_of": 3}}, "best_of"),
    ({"output_options": {"prompt_logprobs": 2}}, "prompt_logprobs"),
    ({"sampling_options": {"temperature": -1.0}}, "temperature"),
    ({"stop_conditions": {"max_tokens": -4}}, "max_new_tokens"),
    ({"sampling_options": {"guided_decoding": {"json": {"type": "object"}, "regex": "a+"}}}, "guided_decoding"),
])
def test_what_the_engine_cannot_do_is_refused_by_name(sections, field):
    with pytest.raises(OptionError) as caught:
        sampling_from(request([1, 2], **sections))
    assert caught.value.option == field


def test_settings_take_dynamos_endpoint_form():
    assert DynamoSettings().path == "dynamo.backend.generate"
    assert DynamoSettings(endpoint="dyn://ns-1.worker_a.gen", discovery_backend="file").path == "ns-1.worker_a.gen"
    for fields, name in (({"endpoint": "dynamo.backend.generate"}, "endpoint"),
                         ({"endpoint": "dyn://a.b"}, "endpoint"),
                         ({"discovery_backend": "consul"}, "discovery_backend"),
                         ({"request_plane": "http"}, "request_plane"),
                         ({"event_plane": "kafka"}, "event_plane")):
        with pytest.raises(OptionError) as caught:
            DynamoSettings(**fields)
        assert caught.value.option == name


# -- the handler over a real engine -----------------------------------------------------------------

def test_a_streamed_answer_is_the_engines_and_its_usage_counts_the_hit(pc, tokenizer):  # noqa: F811
    base = doc(tokenizer, 40, 3 * BLOCK + 5)
    first, second = base + doc(tokenizer, 41, 6), base + doc(tokenizer, 42, 9)
    handler = DynamoHandler(pc)
    expected = pc.complete(second, max_new_tokens=6, reuse=False)
    cold = collect(handler, request(first))
    warm = collect(handler, request(second))
    for chunks in (cold, warm):
        assert all(c["index"] == 0 for c in chunks)
        assert chunks[-1]["finish_reason"] == "length" and chunks[-1]["token_ids"], "the 6th token ends it"
        assert all("finish_reason" not in c for c in chunks[:-1]) and all(c["token_ids"] for c in chunks[:-1])
    assert answers(warm)[0] == expected.token_ids
    usage = warm[-1]["completion_usage"]
    assert usage["prompt_tokens"] == len(second) and usage["completion_tokens"] == len(expected.token_ids)
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(base) // BLOCK * BLOCK
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_the_token_that_ends_an_answer_travels_with_the_finish_reason(pc, tokenizer):  # noqa: F811
    """Dynamo's frontend ends a stream at a stop id: the id, the finish and the usage come in one chunk."""
    prompt = doc(tokenizer, 47, 25)
    free = answers(collect(DynamoHandler(pc), request(prompt, max_tokens=8)))[0]
    stop = free[3]
    chunks = collect(DynamoHandler(pc), request(prompt, max_tokens=8,
                                                stop_conditions={"stop_token_ids_hidden": [stop]}))
    assert answers(chunks)[0] == free[:free.index(stop) + 1]
    assert chunks[-1]["token_ids"][-1] == stop and chunks[-1]["finish_reason"] == "stop"
    assert chunks[-1]["completion_usage"]["completion_tokens"] == free.index(stop) + 1
    assert all("finish_reason" not in c and stop not in c["token_ids"] for c in chunks[:-1])


class ScriptedEngine:
    """An engine whose one answer is ``tokens``, emitted ``gap`` seconds apart (the last flagged as
    final, as the scheduler flags the token that ends an answer), ended ``gap`` after the last: what a
    slow scheduler step looks like to the handler."""

    tokenizer = None
    grammars = None

    def __init__(self, tokens: list[int], finish: str, gap: float = 0.2) -> None:
        self.tokens, self.finish, self.gap = tokens, finish, gap

    def complete_request(self, ids, params, salt=""):
        from pckernels.engine.request import PrefixPrefill, Request

        return Request(params=params, mode="prefix", prompt_token_ids=ids, positions=list(range(len(ids))),
                       prefix=PrefixPrefill(ids))

    def submit(self, req):
        import threading

        import torch

        from pckernels.engine.request import RequestHandle
        from pckernels.generation import GenerationResult

        handle = RequestHandle(req)

        def play():
            for i, token in enumerate(self.tokens):
                handle._emit(token, final=i == len(self.tokens) - 1)
                time.sleep(self.gap)
            handle._finish(GenerationResult(text="", token_ids=list(self.tokens), prompt_token_ids=req.prompt_token_ids,
                                            positions=[], ttft_s=0.0, total_s=0.0, cached_tokens=0,
                                            computed_tokens=len(req.prompt_token_ids), first_logits=torch.zeros(1),
                                            finish_reason=self.finish))

        threading.Thread(target=play, daemon=True).start()
        return handle


@pytest.mark.parametrize("tokens, finish, sections", [
    ([5, 6, 2], "stop", {}),                                          # EOS
    ([5, 6, 9], "stop", {"stop_conditions": {"stop_token_ids_hidden": [9]}}),  # a stop id
    ([5, 6, 7, 8], "length", {}),                                     # the max_tokens-th
])
def test_a_slow_engines_last_token_still_travels_with_the_finish(tokens, finish, sections):
    chunks = collect(DynamoHandler(ScriptedEngine(tokens, finish)), request([1, 2, 3], max_tokens=4, **sections))
    assert [c["token_ids"] for c in chunks] == [[t] for t in tokens]
    assert chunks[-1]["finish_reason"] == finish and "finish_reason" not in chunks[-2]
    assert chunks[-1]["completion_usage"]["completion_tokens"] == len(tokens)


def test_n_answers_stream_under_their_index_with_logprobs(pc, tokenizer):  # noqa: F811
    prompt = doc(tokenizer, 43, 2 * BLOCK + 3)
    req = request(prompt, max_tokens=5, sampling_options={"n": 3, "temperature": 0.9, "seed": 5},
                  output_options={"logprobs": 2})
    chunks = collect(DynamoHandler(pc), req)
    got = answers(chunks)
    assert sorted(got) == [0, 1, 2]
    ends = [c for c in chunks if "finish_reason" in c]
    assert sorted(c["index"] for c in ends) == [0, 1, 2]
    params = SamplingParams(max_new_tokens=5, temperature=0.9, seed=5, n=3)
    handle = pc.submit(pc.complete_request(prompt, params))
    assert [got[i] for i in range(3)] == [h.result().token_ids for h in handle.choices]
    for chunk in chunks:
        if chunk["token_ids"]:
            assert len(chunk["log_probs"]) == len(chunk["token_ids"]) == len(chunk["top_logprobs"])
            assert all(len(top) == 2 and [e["rank"] for e in top] == [1, 2] for top in chunk["top_logprobs"])
            assert all(lp <= 0.0 for lp in chunk["log_probs"])


def test_guided_json_constrains_the_answer(pc, tokenizer):  # noqa: F811
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = request(doc(tokenizer, 44, 20), max_tokens=24, sampling_options={"guided_decoding": {"json": schema}})
    chunks = collect(DynamoHandler(pc), req)
    text = tokenizer.decode(answers(chunks)[0])
    assert text.lstrip().startswith("{"), text


def test_a_bad_request_ends_with_an_error_and_queues_nothing(pc):
    before = pc.stats()["engine"]["submitted"]
    for req in (request([]), request([1, 2, 3], sampling_options={"temperature": -2.0})):
        chunks = collect(DynamoHandler(pc), req)
        assert len(chunks) == 1 and chunks[0]["finish_reason"].startswith("error: ") and chunks[0]["token_ids"] == []
    assert pc.stats()["engine"]["submitted"] == before


class StopAfter:
    """A Dynamo request context whose client goes away after ``calls`` checks."""

    def __init__(self, calls: int) -> None:
        self.calls = calls

    def is_stopped(self) -> bool:
        self.calls -= 1
        return self.calls < 0


def test_a_stopped_context_cancels_the_engine_request(pc, tokenizer):  # noqa: F811
    chunks = collect(DynamoHandler(pc), request(doc(tokenizer, 45, 30), max_tokens=400,
                                                stop_conditions={"ignore_eos": True}), StopAfter(3))
    assert chunks[-1]["finish_reason"] == "cancelled"
    assert len(answers(chunks)[0]) < 400
    deadline = time.monotonic() + 10
    while pc.scheduler.stats()["running"] and time.monotonic() < deadline:  # freed at the scheduler's next step
        time.sleep(0.01)
    assert pc.scheduler.stats()["running"] == 0


def test_many_requests_at_once_answer_as_each_alone(pc, tokenizer):  # noqa: F811
    shared = doc(tokenizer, 46, 2 * BLOCK)
    prompts = [shared + doc(tokenizer, 50 + i, 3 + i) for i in range(6)]
    alone = [pc.complete(p, max_new_tokens=5, reuse=False).token_ids for p in prompts]
    handler = DynamoHandler(pc)

    async def together():
        async def one(p):
            return [c async for c in handler.generate(request(p, max_tokens=5))]

        return await asyncio.gather(*(one(p) for p in prompts))

    assert [answers(chunks)[0] for chunks in asyncio.run(together())] == alone


# -- the model card and the command line ------------------------------------------------------------

def test_the_model_card_names_its_architecture(tmp_path):
    folder = model_folder("smollm2", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and None not in config.values()
    assert (folder / "tokenizer.json").exists()
    own = tmp_path / "own"
    own.mkdir()
    (own / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}))
    assert model_folder(str(own), tmp_path / "cards") == own


@pytest.mark.parametrize("line, words", [
    (["--endpoint", "backend.generate"], ["--endpoint", "dyn://namespace.component.endpoint"]),
    (["--discovery-backend", "consul"], ["--discovery-backend", "consul"]),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5599"}'],
     ["--kv-events-config", "connected to, not bound"]),
    (["--kv-events-config", '{"enable_kv_cache_events": "yes"}'], ["--kv-events-config", "enable_kv_cache_events"]),
    (["--prefix-resume", "sideways"], ["--prefix-resume", "sideways"]),
])
def test_the_command_refuses_bad_settings_before_loading(tmp_path, cli_without_loading, monkeypatch, line, words):
    from pckernels import cli_dynamo

    monkeypatch.setattr(cli_dynamo.importlib.util, "find_spec", lambda name: object())
    result = CliRunner().invoke(app, ["dynamo-worker", *line, "--store-dir", str(tmp_path / "kv")])
    assert result.exit_code == 2, result.output
    assert all(word in result.output for word in words), result.output
    assert not (tmp_path / "kv").exists()


def test_without_dynamo_the_command_says_how_to_install_it(tmp_path, cli_without_loading, monkeypatch):
    from pckernels import cli_dynamo

    monkeypatch.setattr(cli_dynamo.importlib.util, "find_spec", lambda name: None)
    result = CliRunner().invoke(app, ["dynamo-worker", "--store-dir", str(tmp_path / "kv")])
    assert result.exit_code == 2 and "pip install ai-dynamo ai-dynamo-runtime" in result.output, result.output


def test_the_relay_connects_where_the_worker_binds():
    from types import SimpleNamespace

    from pckernels.cli_dynamo import relay_endpoint

    assert relay_endpoint(SimpleNamespace(endpoint="tcp://*:5557")) == "tcp://127.0.0.1:5557"
    assert relay_endpoint(SimpleNamespace(endpoint="ipc:///tmp/x/events")) == "ipc:///tmp/x/events"
    with pytest.raises(OptionError):
        relay_endpoint(SimpleNamespace(endpoint="tcp://10.0.0.5:5557"))


def test_the_command_hands_its_engine_flags_to_the_engine(tmp_path, cli_without_loading, monkeypatch):
    """Every engine flag of ``dynamo-worker`` reaches the one ``EngineConfig`` it loads, with the
    KV-event publisher started on the private ``ipc://`` endpoint Dynamo's relay will read."""
    from pckernels import cli_dynamo, cli_engine

    seen = {}

    def loaded(model, config):
        seen["config"] = config
        config.kv_events.close()
        raise SystemExit(3)

    monkeypatch.setattr(cli_dynamo.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(cli_engine, "load_engine", loaded)
    result = CliRunner().invoke(app, ["dynamo-worker", "--step-tokens", "300", "--max-batch", "5", "--prefix-chunk",
                                      "48", "--prefix-budget", "64MiB", "--memory-only", "--max-queue", "7"])
    assert result.exit_code == 3, result.output
    config = seen["config"]
    assert (config.step_tokens, config.max_batch, config.prefix_block_size, config.prefix_chunk,
            config.max_queue, config.store_dir) == (300, 5, 16, 48, 7, False)
    assert config.prefix_budget == 64 * 2**20
    assert config.kv_events.config.endpoint.startswith("ipc://")
