"""The Responses API (``/v1/responses``) and completions' ``echo`` + ``logprobs``, through a real
``promptcache serve`` and the ``openai`` client: text and message input, instructions, streamed
typed events, ``previous_response_id`` continued from the stored tokens (cached tokens on turn 2),
a function tool round trip, ``text.format`` json_schema, refusals of what is not served, the
store's bound and expiry; the prompt's log-probabilities equal to a plain Hugging Face forward's."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from pckernels.server.response_store import ResponseStore, StoredResponse
from test_engine import tokenizer  # noqa: F401  (a fixture)
from test_server import COMMON, MODEL, Server, library, model_dir  # noqa: F401  (fixtures)

KEEP = 3
"""Responses the test server keeps per tenant."""
INSTRUCTIONS = "You are a careful assistant. " * 6


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("responses"), "--model", str(model_dir), "--prefix-block", "16",
                 "--responses-max", str(KEEP), *COMMON)
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def hf(model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    return model.eval()


def hf_logprobs(hf, ids: list[int]) -> list[float]:
    """The plain forward's log_softmax of each prompt token given those before it."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def test_text_input_and_instructions(server, library):
    client = server.client()
    reply = client.responses.create(model=MODEL, input="Name three colours.", instructions="Be brief.",
                                    max_output_tokens=6, temperature=0)
    ref = library.complete([{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Name three colours."}], max_new_tokens=6)
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.output_text == ref.text
    assert reply.output[0].type == "message" and reply.output[0].content[0].type == "output_text"
    assert reply.usage.input_tokens == len(ref.prompt_token_ids) and reply.usage.output_tokens == len(ref.token_ids)
    assert reply.status == ("incomplete" if ref.finish_reason == "length" else "completed")
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Name three colours."}]}]
    again = client.responses.create(model=MODEL, input=items, instructions="Be brief.", max_output_tokens=6,
                                    temperature=0)
    assert again.output_text == ref.text
    assert client.responses.retrieve(again.id).output_text == ref.text


def test_streamed_events(server, library):
    client = server.client()
    ref = library.complete([{"role": "user", "content": "Tell me a story."}], max_new_tokens=10)
    events = list(client.responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=10,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    end = "response.incomplete" if ref.finish_reason == "length" else "response.completed"
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", end]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == ref.text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == ref.text
    assert events[-1].response.output[0].content[0].text == ref.text
    assert events[-1].response.usage.output_tokens == len(ref.token_ids)


def test_previous_response_id_reuses_the_conversation(server):
    client = server.client()
    first = client.responses.create(model=MODEL, input="Remember the word lantern. " * 8, instructions=INSTRUCTIONS,
                                    max_output_tokens=5, temperature=0)
    second = client.responses.create(model=MODEL, input="Which word?", instructions=INSTRUCTIONS,
                                     previous_response_id=first.id, max_output_tokens=5, temperature=0)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16 * (first.usage.input_tokens // 16)
    assert second.usage.input_tokens_details.cached_tokens > 0
    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError, match="Previous response"):
        client.responses.create(model=MODEL, input="more", previous_response_id=unstored.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                          "required": ["city"], "additionalProperties": False}}


def test_function_call_round_trip(server):
    client = server.client()
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": json.dumps({"temperature": 21})}],
                                     max_output_tokens=5, temperature=0)
    assert second.output[0].type == "message"
    assert second.usage.input_tokens_details.cached_tokens > 0
    # the same turn sent statelessly: the call item and its output as input items
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
              "arguments": calls[0].arguments},
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": json.dumps({"temperature": 21})}]
    stateless = client.responses.create(model=MODEL, input=items, tools=[WEATHER], max_output_tokens=5, temperature=0)
    assert stateless.output_text == second.output_text
    streamed = list(client.responses.create(model=MODEL, input="Weather in Rome?", tools=[WEATHER],
                                            tool_choice="required", parallel_tool_calls=False, max_output_tokens=120,
                                            temperature=0, stream=True))
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert done and done[0].type == "function_call" and done[0].name == "get_weather"
    assert not any(e.type == "response.output_text.delta" for e in streamed)


def test_json_schema_format(server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = server.client().responses.create(model=MODEL, input="A person as JSON.", max_output_tokens=120,
                                             text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                              "strict": True}})
    answer = json.loads(reply.output_text)
    assert set(answer) == {"name", "age"} and isinstance(answer["age"], int)
    assert reply.text.format.type == "json_schema"


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs"]}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]}, "input"),
    ({"background": True}, "background"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_unsupported_parts_are_a_400_naming_them(server, extra, param):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **extra}
    reply = httpx.post(server.url + "/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    named = (extra.get("tools") or [{}])[0].get("type") or param
    if param == "input":
        named = extra["input"][0]["content"][0]["type"]
    assert named in error["message"]


def test_the_store_keeps_a_bounded_number(server):
    client = server.client()
    ids = [client.responses.create(model=MODEL, input=f"turn {k}", max_output_tokens=1).id for k in range(KEEP + 1)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert all(client.responses.retrieve(i).id == i for i in ids[1:])


def test_the_store_expires_and_separates_tenants(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("pckernels.server.response_store.time.monotonic", lambda: now[0])
    store = ResponseStore(max_count=2, ttl_s=10.0)
    store.put("a", StoredResponse({"id": "r1"}, [], []))
    assert store.get("a", "r1") is not None and store.get("b", "r1") is None
    now[0] += 11
    assert store.get("a", "r1") is None and len(store) == 0
    with pytest.raises(ValueError):
        ResponseStore(ttl_s=0)


def test_echo_logprobs_equal_a_plain_forward(server, hf, tokenizer):  # noqa: F811
    prompt = "The river runs under the old stone bridge, and the town listens."
    ids = tokenizer(prompt)["input_ids"]
    reply = server.client().completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=3, max_tokens=4,
                                               temperature=0)
    choice = reply.choices[0]
    logprobs = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(logprobs.tokens) == len(ids) + reply.usage.completion_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    ref = hf_logprobs(hf, ids)
    assert max(abs(a - b) for a, b in zip(logprobs.token_logprobs[1:len(ids)], ref)) <= 1e-4
    assert all(len(top) == 3 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    # a second time the prompt's blocks are cached: the numbers do not change
    again = server.client().completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=3, max_tokens=4,
                                               temperature=0)
    assert again.choices[0].logprobs.token_logprobs == logprobs.token_logprobs


def test_echo_with_max_tokens_0_and_streamed(server, hf, tokenizer):  # noqa: F811
    client = server.client()
    prompt = "Once upon a time there was a lantern."
    ids = tokenizer(prompt)["input_ids"]
    only = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0
    assert only.usage.prompt_tokens == len(ids) == len(only.choices[0].logprobs.tokens)
    assert max(abs(a - b) for a, b in zip(only.choices[0].logprobs.token_logprobs[1:], hf_logprobs(hf, ids))) <= 1e-4
    whole = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=5, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=5,
                                            temperature=0, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert text == whole.choices[0].text
    assert streamed == whole.choices[0].logprobs.token_logprobs
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset
    plain = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=3, temperature=0)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
