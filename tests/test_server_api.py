"""The OpenAI fields a vLLM user sends daily, through a real ``promptcache serve`` and the ``openai``
client: logprobs (chat and completions, streamed and whole), logit_bias, presence and frequency
penalties, cache_salt, /tokenize and /detokenize — each against the library's own answer — and
every field the server does not honour refused with a 400 naming it, never dropped."""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pckernels.prefix import encode_prompt
from test_engine import tokenizer  # noqa: F401  (a fixture)
from test_server import COMMON, MODEL, Server, library, model_dir  # noqa: F401  (fixtures)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # with prompt-lookup drafts: constrained answers must still follow their grammar
    srv = Server(tmp_path_factory.mktemp("api"), "--model", str(model_dir), "--lookahead", "4", *COMMON)
    yield srv
    assert srv.stop() == 0, srv.output()


def test_chat_logprobs_are_the_librarys(server, library):
    client = server.client()
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                           logprobs=True, top_logprobs=3)
    ref = library.complete(MESSAGES, max_new_tokens=8, logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids) == len(ref.logprobs)
    for entry, record in zip(content, ref.logprobs):
        assert entry.logprob == pytest.approx(record.logprob, abs=1e-5)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5), "greedy: the best is chosen"
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    assert sum(math.exp(t.logprob) for t in content[0].top_logprobs) <= 1.0 + 1e-6
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == reply.choices[0].message.content


def test_streamed_logprobs_cover_every_token(server, library):
    client = server.client()
    ref = library.complete(MESSAGES, max_new_tokens=10, logprobs=2)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)
    entries, text = [], ""
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            entries += chunk.choices[0].logprobs.content
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert text == ref.text
    assert [round(e.logprob, 4) for e in entries] == [round(r.logprob, 4) for r in ref.logprobs]


def test_completion_logprobs_shape(server, library):
    client = server.client()
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                      logprobs=2)
    ref = library.complete("Once upon a time", max_new_tokens=6, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert logprobs.token_logprobs == pytest.approx([r.logprob for r in ref.logprobs], abs=1e-5)
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]


def test_logit_bias_and_penalties_change_the_answer_as_the_library_does(server, library, tokenizer):  # noqa: F811
    client = server.client()
    plain = library.complete(MESSAGES, max_new_tokens=6)
    banned = plain.token_ids[0]
    forced = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" blue"))[0]
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                           logit_bias={str(banned): -100, str(forced): 100})
    ref = library.complete(MESSAGES, max_new_tokens=6, logit_bias={banned: -100, forced: 100})
    assert ref.token_ids[0] == forced and banned not in ref.token_ids
    assert reply.choices[0].message.content == ref.text
    for penalty in ({"frequency_penalty": 1.5}, {"presence_penalty": -1.0}):
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                               **penalty)
        assert reply.choices[0].message.content == library.complete(MESSAGES, max_new_tokens=12, **penalty).text
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, logit_bias={"colour": 1})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, frequency_penalty=3)


def test_cache_salt_separates_prefix_reuse(server):
    client = server.client()
    long = [{"role": "system", "content": "You answer from the ledger. " + "Entry: one barrel of oil. " * 40},
            {"role": "user", "content": "How many barrels?"}]

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt else {}
        return client.chat.completions.create(model=MODEL, messages=long, max_tokens=2, temperature=0,
                                              extra_body=extra).usage.prompt_tokens_details.cached_tokens

    cached("alpha")
    assert cached("alpha") > 0
    assert cached("beta") == 0, "another cache_salt shares nothing"
    assert cached(None) == 0, "no cache_salt shares nothing with a salted request"
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2, extra_body={
            "cache_salt": "alpha", "pml": '<prompt schema="s"><m/></prompt>'})


@pytest.mark.parametrize("field,value", [("functions", [{"name": "f"}]), ("structured_outputs", {}),
                                          ("frobnicate", 1)])
def test_fields_the_server_does_not_honour_are_refused(server, field, value):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, field: value}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == field and field in error["message"] and error["code"] == "unsupported_field"


def test_ignored_fields_change_nothing(server, library):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "user": "u-1",
            "metadata": {"a": "b"}, "store": False}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["content"] == library.complete(MESSAGES, max_new_tokens=6).text


def test_tokenize_and_detokenize(server, tokenizer):  # noqa: F811
    text = "Once upon a time"
    got = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=30).json()
    assert got["tokens"] == tokenizer(text)["input_ids"] and got["count"] == len(got["tokens"])
    assert got["max_model_len"] > 0
    chat = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}, timeout=30).json()
    assert chat["tokens"] == encode_prompt(tokenizer, MESSAGES), "as the engine reads a chat"
    back = httpx.post(server.url + "/detokenize", json={"tokens": got["tokens"]}, timeout=30).json()
    assert back["prompt"] == tokenizer.decode(got["tokens"])
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10 ** 9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    neither = httpx.post(server.url + "/tokenize", json={}, timeout=30)
    assert neither.status_code == 400


def test_n_answers_read_the_prompt_once(server, library):
    client = server.client()
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0.8, seed=11,
                                           n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    expected = [library.complete(MESSAGES, max_new_tokens=6, temperature=0.8, seed=11 + i).text for i in range(3)]
    assert [c.message.content for c in reply.choices] == expected
    prompt = len(library.complete_request(MESSAGES).prompt_token_ids)
    assert reply.usage.prompt_tokens == prompt
    assert reply.usage.completion_tokens == sum(len(library.complete(MESSAGES, max_new_tokens=6, temperature=0.8,
                                                                     seed=11 + i).token_ids) for i in range(3))
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0.8, seed=11,
                                            n=3, stream=True)
    texts = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == expected


def test_several_prompts_per_completion(server, library):
    client = server.client()
    prompts = ["Once upon a time", "The river"]
    reply = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert len(reply.choices) == 4
    for index, choice in enumerate(reply.choices):
        assert choice.index == index
        assert choice.text == library.complete(prompts[index // 2], max_new_tokens=5).text
    with pytest.raises(openai.BadRequestError, match="n must be"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=99)


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "days", "sunny"], "additionalProperties": False}


def check(answer: dict) -> None:
    assert set(answer) == {"city", "days", "sunny"} and isinstance(answer["city"], str)
    assert len(answer["city"]) <= 12 and 1 <= answer["days"] <= 9 and isinstance(answer["sunny"], bool)


def test_json_schema_answers_follow_the_schema(server, library):
    client = server.client()
    form = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
                                           response_format=form)
    assert reply.choices[0].finish_reason == "stop"
    check(json.loads(reply.choices[0].message.content))
    ref = library.complete(MESSAGES, max_new_tokens=80, grammar=library.grammars.json_schema(SCHEMA))
    assert reply.choices[0].message.content == ref.text
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0, response_format=form, stream=True) if c.choices)
    assert streamed == ref.text


def test_constraints_compose_with_batching(server):
    """Eight requests at once, each with its own constraint (or none), in the same batched steps."""
    client = server.client()
    forms = [{"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}},
             {"response_format": {"type": "json_object"}}, {"extra_body": {"guided_regex": "[0-9]{3}-[a-z]{2}"}},
             {"extra_body": {"guided_choice": ["yes", "no", "maybe"]}}, {}]

    def ask(index: int):
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0.7,
                                              seed=index, **forms[index % len(forms)])

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, range(8)))
    for index, reply in enumerate(replies):
        text = replies[index].choices[0].message.content
        kind = index % len(forms)
        if kind == 0:
            check(json.loads(text))
        elif kind == 1:  # any object: a random model may still be inside a string when tokens run out
            assert text.startswith("{") and (reply.choices[0].finish_reason == "length"
                                             or isinstance(json.loads(text), dict))
        elif kind == 2:
            assert re.fullmatch("[0-9]{3}-[a-z]{2}", text)
        elif kind == 3:
            assert text in ("yes", "no", "maybe")


def test_bad_constraints_are_a_400_naming_the_field(server):
    client = server.client()
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, "response_format"),
             ({"response_format": {"type": "xml"}}, "response_format"),
             ({"extra_body": {"guided_regex": "([a-z"}}, "guided_regex"),
             ({"extra_body": {"guided_regex": "a", "guided_choice": ["a"]}}, "guided_choice")]
    for options, field in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **options)
        assert err.value.body["param"] == field, err.value.body


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 10},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def check_call(call, names) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("c", "f") and len(arguments["city"]) <= 10
    else:
        assert arguments == {"zone": arguments["zone"]} and arguments["zone"] in ("utc", "local")
    return arguments


def test_required_and_named_tool_calls(server):
    client = server.client()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=120, temperature=0,
                                           tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0], {"get_weather", "get_time"})
    named = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=120, temperature=0.8, seed=3,
                                           tools=[WEATHER, TIME], parallel_tool_calls=False,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and check_call(call, {"get_time"})
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_time", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    follow = client.chat.completions.create(model=MODEL, messages=history, max_tokens=6, temperature=0,
                                            tools=[WEATHER, TIME])
    assert follow.choices[0].message.content is not None or follow.choices[0].message.tool_calls


def test_streamed_tool_calls(server):
    client = server.client()
    ask = [{"role": "user", "content": "Weather in Rome, in celsius?"}]
    whole = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=120, temperature=0,
                                           tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    deltas, reasons = [], []
    for chunk in client.chat.completions.create(model=MODEL, messages=ask, max_tokens=120, temperature=0,
                                                tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                                stream=True):
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            assert not choice.delta.content, "a tool call is not streamed as text"
            reasons.append(choice.finish_reason)
    assert reasons[-1] == "tool_calls" and len(deltas) == 1
    assert deltas[0].function.name == "get_weather"
    assert deltas[0].function.arguments == whole.choices[0].message.tool_calls[0].function.arguments


def test_tool_choice_none_and_bad_tools(server):
    client = server.client()
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                           tools=[WEATHER], tool_choice="none")
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason in ("stop", "length")
    for tools, choice, param in (([{"type": "function"}], "auto", "tools"),
                                 ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
                                 ([WEATHER], "sometimes", "tool_choice")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, tools=tools,
                                           tool_choice=choice)
        assert err.value.body["param"] == param


def test_tool_calls_are_parsed_from_hermes_blocks():
    from pckernels.server.tools import parse

    text = 'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n' \
           '<tool_call>{"name": "b", "arguments": {}}</tool_call><tool_call>{not json}</tool_call>'
    content, calls = parse(text)
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert content.split() == ["Let", "me", "check.", "<tool_call>{not", "json}</tool_call>"]
    assert parse("no calls here") == ("no calls here", [])
    content, calls = parse('<tool_call>\n{"name": "c", "arguments": {"y": [1]}}')
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"y": [1]}, "a missing close"


def test_pml_gets_the_default_recompute_unless_it_says(server, library):
    """A PML request that names no recompute gets the engine's default (compact placement: the
    first 8 stale tokens of each module recomputed), as in the library; ``recompute: 0`` none."""
    from test_server import PML, SCHEMA, _wait_ready

    assert httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).status_code in (200, 202)
    _wait_ready(server, "docs", "none")
    if "docs" not in library.schemas:
        library.add_schema(SCHEMA)
    client = server.client()
    for extra, options in (({}, {}), ({"recompute": 0}, {"recompute": 0}),
                           ({"recompute": 0.5, "recompute_policy": "first"}, {"recompute": 0.5})):
        ref = library.generate(PML, max_new_tokens=8, **options)
        reply = client.completions.create(model=MODEL, prompt="", max_tokens=8, temperature=0,
                                          extra_body={"pml": PML, **extra})
        assert reply.choices[0].text == ref.text
        assert reply.usage.prompt_tokens_details.cached_tokens == ref.cached_tokens
    assert library.resolve(PML).placement == "compact"
    assert (library.generate(PML, max_new_tokens=1).computed_tokens
            > library.generate(PML, max_new_tokens=1, recompute=0).computed_tokens)


def test_a_pml_prompt_ending_with_an_import_is_answered(server, library):
    """``<prompt schema="docs"><alpha/></prompt>`` continues the document: its last token computed
    afresh, the answer the library's (which equals the reference forward, test_engine)."""
    from test_server import SCHEMA, _wait_ready

    assert httpx.post(server.url + "/v1/schemas", json={"pml": SCHEMA}).status_code in (200, 202)
    _wait_ready(server, "docs", "none")
    if "docs" not in library.schemas:
        library.add_schema(SCHEMA)
    for pml in ('<prompt schema="docs"><alpha/></prompt>', '<prompt schema="docs"><beta/><alpha/></prompt>'):
        ref = library.generate(pml, max_new_tokens=8)
        reply = server.client().completions.create(model=MODEL, prompt="", max_tokens=8, temperature=0,
                                                   extra_body={"pml": pml})
        assert reply.choices[0].text == ref.text and ref.token_ids
        assert reply.usage.prompt_tokens_details.cached_tokens == ref.cached_tokens


def test_a_cut_forced_call_is_a_call_with_finish_reason_length(server):
    """A named call cut by max_tokens comes back as OpenAI and vLLM send it: in ``tool_calls``,
    arguments unfinished, ``finish_reason`` ``length`` — whole and streamed alike (issue 43: as
    content, LangChain's with_structured_output read it as no call and answered None)."""
    client = server.client()
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], max_tokens=14,
               temperature=0, tools=[WEATHER, TIME], parallel_tool_calls=False,
               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = client.chat.completions.create(**ask).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    deltas, reasons = [], []
    for chunk in client.chat.completions.create(stream=True, **ask):
        for streamed in chunk.choices:
            deltas += streamed.delta.tool_calls or []
            assert not streamed.delta.content
            reasons.append(streamed.finish_reason)
    assert reasons[-1] == "length" and [(d.function.name, d.function.arguments) for d in deltas] == \
        [("get_weather", call.function.arguments)]
ROUTER_FIELDS = {"no_stop_trim": False, "continue_final_message": False, "separate_reasoning": True,
                 "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True}
"""What vllm-router 0.1.17 adds to every chat body it forwards (captured from a live router)."""


def test_router_fields_at_their_neutral_values_change_nothing(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    plain = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    routed = httpx.post(server.url + "/v1/chat/completions", json={**body, **ROUTER_FIELDS, "logprobs": False},
                        timeout=60)
    assert plain.status_code == routed.status_code == 200, routed.text
    assert routed.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    for name, value in ROUTER_FIELDS.items():  # any other value would change the answer: refused, named
        reply = httpx.post(server.url + "/v1/chat/completions", json={**body, name: not value}, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == name, (name, reply.text)


def test_render_gives_the_prompt_ids_the_engine_reads(server, tokenizer):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, "temperature": 0, **ROUTER_FIELDS}
    reply = httpx.post(server.url + "/v1/chat/completions/render", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    ids = reply.json()["token_ids"]
    assert ids == encode_prompt(tokenizer, MESSAGES)
    assert ids == httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}, timeout=60).json()["tokens"]
    usage = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["usage"]
    assert usage["prompt_tokens"] == len(ids)
    bad = httpx.post(server.url + "/v1/chat/completions/render", json={"model": MODEL, "messages": []}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    other = httpx.post(server.url + "/v1/chat/completions/render", json={**body, "model": "nope"}, timeout=60)
    assert other.status_code == 404
