"""vLLM's sampling extras, ``chat_template_kwargs``, ``reasoning_effort`` and ``prompt_cache_key``
through a real ``promptcache serve`` (the ``openai`` client's ``extra_body``, as a vLLM user
sends them): answers equal the library's with the same :class:`SamplingParams`, and values out of
range are a 400 naming the field."""

from __future__ import annotations

import copy

import httpx
import openai
import pytest

from pckernels.generation import SamplingParams
from pckernels.prefix import encode_prompt
from test_engine import tokenizer  # noqa: F401  (a fixture)
from test_server import COMMON, MODEL, Server, library, model_dir  # noqa: F401  (fixtures)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]
VLLM = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05, "min_tokens": 4, "ignore_eos": False,
        "stop_token_ids": [13], "skip_special_tokens": True, "include_stop_str_in_output": False}


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("sampling"), "--model", str(model_dir), "--lookahead", "4", *COMMON)
    yield srv
    assert srv.stop() == 0, srv.output()


def test_a_vllm_style_body_is_answered_as_the_library_answers(server, library):
    client = server.client()
    extra = {**VLLM, "chat_template_kwargs": {"enable_thinking": False}, "prompt_cache_key": "user-7"}
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                           reasoning_effort="low", extra_body=extra)
    want = library.complete(MESSAGES, SamplingParams(max_new_tokens=12, **{**VLLM, "stop_token_ids": (13,)}))
    assert reply.choices[0].message.content == want.text
    assert reply.usage.completion_tokens == len(want.token_ids) >= 4
    sampled = dict(temperature=0.8, seed=5, top_k=3, min_p=0.1, repetition_penalty=1.3)
    text = client.completions.create(model=MODEL, prompt="The colours are", max_tokens=10, temperature=0.8, seed=5,
                                     extra_body={k: v for k, v in sampled.items() if k not in ("temperature", "seed")})
    want = library.complete("The colours are", SamplingParams(max_new_tokens=10, **sampled))
    assert text.choices[0].text == want.text
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=MODEL, prompt="The colours are", max_tokens=10, temperature=0.8, seed=5, stream=True,
        extra_body={k: v for k, v in sampled.items() if k not in ("temperature", "seed")}) if chunk.choices)
    assert streamed == want.text


def test_ignore_eos_and_skip_special_tokens(server, library, tokenizer):  # noqa: F811
    eos = tokenizer.eos_token_id
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(eos): 100}, "skip_special_tokens": False}
    reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert reply["usage"]["completion_tokens"] == 5 and reply["choices"][0]["finish_reason"] == "length"
    assert reply["choices"][0]["text"] == tokenizer.eos_token * 5
    body["skip_special_tokens"] = True
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == ""


@pytest.mark.parametrize("field,value", [("top_k", -5), ("min_p", 1.5), ("repetition_penalty", 0),
                                          ("min_tokens", 99), ("stop_token_ids", [-1]),
                                          ("reasoning_effort", "lots"),
                                          ("chat_template_kwargs", {"add_generation_prompt": False})])
def test_out_of_range_is_a_400_naming_the_field(server, field, value):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, field: value}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == field and field in error["message"]


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(tokenizer):  # noqa: F811
    from pckernels.server.generation import template_kwargs
    from pckernels.server.protocol import ChatCompletionRequest

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
                         "{% if enable_thinking %}<think>{% endif %}{% if reasoning_effort %}[{{ reasoning_effort }}]"
                         "{% endif %}")
    plain = encode_prompt(tok, MESSAGES)
    thinking = encode_prompt(tok, MESSAGES, None, {"enable_thinking": True})
    assert tok.decode(thinking).endswith("<think>") and not tok.decode(plain).endswith("<think>")
    body = ChatCompletionRequest(model=MODEL, messages=MESSAGES, reasoning_effort="high",
                                 chat_template_kwargs={"enable_thinking": True})
    assert template_kwargs(tok, body) == {"enable_thinking": True, "reasoning_effort": "high"}
    assert template_kwargs(tokenizer, body) == {"enable_thinking": True}, "a template that ignores it: dropped"
    assert tok.decode(encode_prompt(tok, MESSAGES, None, template_kwargs(tok, body))).endswith("<think>[high]")
