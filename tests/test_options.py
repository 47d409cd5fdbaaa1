"""Options as typed objects (issue 42): a :class:`SamplingParams` is accepted by every request method
and the loose keywords build the same object; an :class:`EngineConfig` holds the engine's settings;
both check every field when they are made, naming it, before anything is queued or loaded; the
command line refuses bad settings before loading; the server builds one ``SamplingParams`` per request.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from pckernels.cli import app
from pckernels.engine import PromptCache
from pckernels.engine import core as core_module
from pckernels.engine.config import ENGINE_OPTIONS, EngineConfig
from pckernels.errors import OptionError
from pckernels.generation import SAMPLING_OPTIONS, SamplingParams
from pckernels.server.generation import _build, sampling
from pckernels.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from pckernels.server.tenants import Tenant
from test_cli import assert_one_line_error
from test_engine import PROMPTS, SCHEMA, tiny_llama, tokenizer  # noqa: F401  (tokenizer is a fixture)

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def embedded():
    """The embedded SmolLM2 with the test schema encoded."""
    pc = PromptCache.from_pretrained("smollm2", store_dir=False, placement="schema")
    pc.add_schema(SCHEMA)
    yield pc
    pc.close()


# -- the same answer either way ------------------------------------------------------------------

def test_params_and_keywords_give_the_same_answers_on_the_embedded_model(embedded):
    """Greedy tokens (and a seeded sample) are identical whether a request gets a ``SamplingParams``
    or the keywords that build it, through generate, stream, complete and submit."""
    keywords = dict(max_new_tokens=6, stop=["\n\n\n"])
    params = SamplingParams(max_new_tokens=6, stop="\n\n\n")
    prompt = PROMPTS["all-of-union-one"]
    by_keywords = embedded.generate(prompt, **keywords)
    by_params = embedded.generate(prompt, params)
    assert by_params.token_ids == by_keywords.token_ids and by_params.text == by_keywords.text
    assert len(by_params.token_ids) > 0
    assert "".join(embedded.stream(prompt, params)) == by_keywords.text
    assert embedded.submit(prompt, params).result().token_ids == by_keywords.token_ids
    plain_keywords = embedded.complete(MESSAGES, **keywords)
    plain_params = embedded.complete(MESSAGES, params)
    assert plain_params.token_ids == plain_keywords.token_ids and len(plain_params.token_ids) > 0
    sampled = dict(max_new_tokens=6, temperature=0.9, top_p=0.95, seed=7)
    assert embedded.complete(MESSAGES, SamplingParams(**sampled)).token_ids == \
        embedded.complete(MESSAGES, **sampled).token_ids
    request = embedded.complete_request(MESSAGES, SamplingParams(max_new_tokens=3, n=2))
    assert request.n == 2 and request.params.n == 2
    assert [len(h.result().token_ids) for h in embedded.submit(request).choices] == [3, 3]


@pytest.mark.parametrize("call", ["generate", "stream", "submit", "request", "complete", "complete_request"])
def test_params_and_keywords_together_are_refused_and_queue_nothing(embedded, call):
    prompt = MESSAGES if call.startswith("complete") else PROMPTS["none"]
    before = embedded.stats()["engine"].get("submitted", 0)
    with pytest.raises(TypeError, match="not both.*max_new_tokens"):
        getattr(embedded, call)(prompt, SamplingParams(), max_new_tokens=2)
    with pytest.raises(TypeError, match="'temprature'"):
        getattr(embedded, call)(prompt, temprature=0.5)
    with pytest.raises(TypeError, match="must be a SamplingParams"):
        getattr(embedded, call)(prompt, {"max_new_tokens": 2})
    assert embedded.stats()["engine"].get("submitted", 0) == before


# -- SamplingParams: one place checks every field -------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("max_new_tokens", 0), ("max_new_tokens", 2.5), ("max_new_tokens", True), ("temperature", -0.1),
    ("temperature", float("nan")), ("temperature", "hot"), ("top_p", 0.0), ("top_p", 1.5), ("stop", ["ok", 3]),
    ("seed", 1.5), ("logit_bias", {-1: 1.0}), ("logit_bias", {5: 101.0}), ("logit_bias", {"five": 1.0}),
    ("presence_penalty", 2.5), ("frequency_penalty", float("inf")), ("logprobs", 21), ("logprobs", -1), ("n", 0),
])
def test_sampling_params_name_the_field_they_refuse(field, value):
    with pytest.raises(OptionError, match=field) as caught:
        SamplingParams(**{field: value})
    assert caught.value.option == field and isinstance(caught.value, ValueError)


def test_sampling_params_take_the_public_forms():
    params = SamplingParams(stop="END", logit_bias={9: -1, 3: 2.5})
    assert params.stop == ("END",) and params.logit_bias == ((3, 2.5), (9, -1.0))
    assert params == SamplingParams.of(stop=["END"], logit_bias={3: 2.5, 9: -1})
    assert dataclasses.replace(params, seed=4).stop == ("END",)
    assert set(SAMPLING_OPTIONS) == {f.name for f in dataclasses.fields(SamplingParams)}


# -- EngineConfig: one place checks every setting, before any model is loaded ---------------------

BAD_SETTINGS = [("max_queue", 0), ("max_batch", 0), ("step_tokens", 0), ("lookahead", -1), ("lookahead", 1.5),
                ("prefix_block_size", 0), ("matmul", "int3"), ("prefix_resume", "chunk"), ("placement", "paper"),
                ("kv_budget", "lots"), ("device_budget", -1), ("remote", "http://nowhere"), ("remote_namespace", "a b"),
                ("device", "bogus"), ("dtype", "int8"), ("store_dir", 3), ("prefix_budget", "lots"),
                ("prefix_budget", -1), ("prefix_chunk", 0), ("prefix_chunk", 100)]


@pytest.mark.parametrize("field, value", BAD_SETTINGS)
def test_engine_config_names_the_setting_it_refuses(field, value):
    with pytest.raises(OptionError) as caught:
        EngineConfig(**{field: value})
    assert caught.value.option == field
    assert field.split("_")[0] in str(caught.value)


@pytest.mark.parametrize("field, value", BAD_SETTINGS[:9])
def test_bad_settings_are_refused_before_any_model_is_loaded(tokenizer, monkeypatch, field, value):  # noqa: F811
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before its settings were checked")

    monkeypatch.setattr(core_module, "load_pretrained", no_loading)
    with pytest.raises(OptionError, match=field):
        PromptCache.from_pretrained("smollm2", store_dir=False, **{field: value})
    model = tiny_llama(len(tokenizer))
    with pytest.raises(OptionError, match=field):
        PromptCache(model, tokenizer, dtype=torch.float64, **{field: value})
    assert next(model.parameters()).dtype == torch.float32


def test_a_config_object_or_the_keywords_make_the_same_engine(tokenizer, monkeypatch):  # noqa: F811
    config = EngineConfig(max_queue=3, max_batch=2, step_tokens=5, lookahead=1, placement="schema",
                          kv_budget="8MiB", prefix_block_size=16)
    by_config = PromptCache(tiny_llama(len(tokenizer)), tokenizer, config=config)
    by_keywords = PromptCache(tiny_llama(len(tokenizer)), tokenizer, max_queue=3, max_batch=2, step_tokens=5,
                              lookahead=1, placement="schema", kv_budget=8 << 20, prefix_block_size=16)
    try:
        assert by_config.config == by_keywords.config == config.replace(kv_budget=8 << 20)
        for pc in (by_config, by_keywords):
            assert (pc.scheduler.max_queue, pc.scheduler.max_batch, pc.scheduler.step_tokens, pc.lookahead,
                    pc.prefix_block_size) == (3, 2, 5, 1, 16)
        assert set(ENGINE_OPTIONS) == {f.name for f in dataclasses.fields(EngineConfig)}
    finally:
        by_config.close()
        by_keywords.close()

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded")

    monkeypatch.setattr(core_module, "load_pretrained", no_loading)
    with pytest.raises(TypeError, match="not both"):
        PromptCache.from_pretrained("smollm2", config=config, max_queue=4)
    with pytest.raises(TypeError, match="'max_que'"):
        PromptCache.from_pretrained("smollm2", max_que=4)
    with pytest.raises(TypeError, match="must be an EngineConfig"):
        PromptCache(tiny_llama(len(tokenizer)), tokenizer, config={"max_queue": 4})


def test_prefix_budget_bounds_what_the_prefix_cache_keeps(tokenizer):  # noqa: F811
    """``prefix_budget`` reaches the engine's prefix cache: a budget of two blocks keeps at most two
    (evicting the rest), the default keeps everything; the answers are the same either way."""
    ids = [[(7 * i + 3 * j) % 200 + 5 for j in range(83)] for i in range(2)]
    answers = {}
    for budget in ("8KiB", None):
        pc = PromptCache(tiny_llama(len(tokenizer)), tokenizer, prefix_block_size=16, prefix_budget=budget)
        try:
            answers[budget] = [pc.complete(x, max_new_tokens=3).token_ids for x in ids]
            stats = pc.prefix.stats()
        finally:
            pc.close()
        if budget is None:
            assert stats["budget_bytes"] == 1 << 30 and stats["evictions"] == 0
        else:
            # tiny_llama: 2 layers x K,V x 2 heads x 8 dims x 4 bytes x 16 tokens = 4 KiB a block
            assert stats["budget_bytes"] == 8 << 10 and 0 < stats["bytes"] <= 8 << 10
            assert stats["evictions"] > 0
    assert answers["8KiB"] == answers[None]


# -- the command line refuses before loading -----------------------------------------------------

@pytest.mark.parametrize("line, words", [
    (["serve", "--max-queue", "0"], ("--max-queue", "max_queue must be an int >= 1, got 0")),
    (["serve", "--max-batch", "0"], ("--max-batch", ">= 1")),
    (["serve", "--step-tokens", "0"], ("--step-tokens", "step_tokens must be an int >= 1, got 0")),
    (["serve", "--kv-budget", "lots"], ("--kv-budget", "not a size")),
    (["serve", "--prefix-budget", "lots"], ("--prefix-budget", "not a size")),
    (["serve", "--lookahead", "-1"], ("--lookahead", ">= 0")),
    (["serve", "--prefix-block", "0"], ("--prefix-block", ">= 1")),
    (["serve", "--prefix-block", "16", "--prefix-chunk", "40"], ("--prefix-chunk", "multiple of prefix_block_size (16)")),
    (["serve", "--prefix-resume", "chunk"], ("unknown --prefix-resume 'chunk'", "block or token")),
    (["serve", "--matmul", "int3"], ("unknown --matmul 'int3'", "fp32 or bf16")),
    (["serve", "--remote", "http://nowhere"], ("--remote", "scheme")),
    (["run", "SCHEMA", "<prompt/>", "--max-new-tokens", "0"], ("--max-new-tokens", ">= 1")),
    (["run", "SCHEMA", "<prompt/>", "--temperature", "-1"], ("--temperature", ">= 0")),
    (["run", "SCHEMA", "<prompt/>", "--lookahead", "-1"], ("--lookahead", ">= 0")),
    (["demo", "--max-new-tokens", "0"], ("--max-new-tokens", ">= 1")),
])
def test_the_command_line_refuses_bad_settings_before_loading(tmp_path, cli_without_loading, line, words):
    schema = tmp_path / "schema.xml"
    schema.write_text(SCHEMA, encoding="utf-8")
    line = [str(schema) if part == "SCHEMA" else part for part in line]
    assert_one_line_error(CliRunner().invoke(app, [*line, "--store-dir", str(tmp_path / "kv")]
                                             if line[0] == "serve" else line), *words)
    assert not (tmp_path / "kv").exists() and not (tmp_path / "cache").exists()



def test_serve_hands_its_scheduler_settings_to_the_engine(tmp_path, cli_without_loading, monkeypatch):
    """``--step-tokens``, ``--max-batch``, ``--prefix-chunk`` reach the one ``EngineConfig`` serve loads."""
    from pckernels import cli_engine

    seen = {}

    def loaded(model, config):
        seen["config"] = config
        raise SystemExit(3)

    monkeypatch.setattr(cli_engine, "load_engine", loaded)
    result = CliRunner().invoke(app, ["serve", "--step-tokens", "300", "--max-batch", "5", "--prefix-block", "16",
                                      "--prefix-chunk", "48", "--store-dir", str(tmp_path / "kv")])
    assert result.exit_code == 3, result.output
    config = seen["config"]
    assert (config.step_tokens, config.max_batch, config.prefix_block_size, config.prefix_chunk) == (300, 5, 16, 48)


# -- the server builds one SamplingParams --------------------------------------------------------

class _Recorder:
    """A ``ServingEngine`` stand-in that records what the server's bridge asks of it."""

    tokenizer = [None] * 100

    def __init__(self) -> None:
        self.calls = []

    def request(self, prompt, params=None, **options):
        self.calls.append(("request", prompt, params, options))
        return "request"

    def complete_request(self, prompt, params=None, **options):
        self.calls.append(("complete_request", prompt, params, options))
        return "request"


def _state(engine) -> SimpleNamespace:
    return SimpleNamespace(engine=engine, request_timeout=30.0, default_max_tokens=512, registry=None)


def test_the_server_passes_one_sampling_params_through():
    engine = _Recorder()
    chat = ChatCompletionRequest(model="m", messages=MESSAGES, max_tokens=5, temperature=0, stop=["x"], seed=3, n=2,
                                 logit_bias={"5": 1}, presence_penalty=0.5, cache_salt="s")
    assert _build(_state(engine), chat, Tenant("t", "salt"), True) == ["request"]
    (method, _, params, options), = engine.calls
    assert method == "complete_request" and params == SamplingParams(
        max_new_tokens=5, temperature=0.0, stop=("x",), seed=3, logit_bias={5: 1.0}, presence_penalty=0.5, n=2)
    assert set(options) == {"reuse", "deadline_s", "salt", "tools"} and options["deadline_s"] == 30.0
    assert options["salt"].startswith("salt|cache_salt:")
    pml = CompletionRequest(model="m", pml='<prompt schema="g"/>', max_tokens=4)
    _build(_state(engine), pml, Tenant("t", "salt"), False)
    method, prompt, params, options = engine.calls[-1]
    assert method == "request" and params == SamplingParams(max_new_tokens=4, temperature=1.0, top_p=1.0)
    assert options == dict(recompute=None, recompute_policy=None, deadline_s=30.0, salt="salt")


def test_a_value_sampling_params_refuses_is_a_400_naming_the_field():
    body = CompletionRequest(model="m", prompt="hi", max_tokens=None)
    with pytest.raises(APIError) as caught:
        sampling(_state(_Recorder()), body, False)
    assert caught.value.status == 400 and caught.value.param == "max_tokens"
    assert "max_new_tokens" in str(caught.value)
