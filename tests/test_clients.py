"""Clients nobody here wrote, against one live ``promptcache serve`` on the embedded SmolLM2:
langchain-openai (invoke, stream, batch, ``with_structured_output`` by each method, ``bind_tools``
with a named and an ``any`` choice, logprobs), instructor (TOOLS and JSON_SCHEMA), LiteLLM (chat
and text completions through its ``openai/`` provider) and the ``openai`` client's
``responses.create``, streamed and not.

Every test checks what the client hands back — its types, the parsed fields, streamed text equal
to the whole greedy answer, logprobs' shape — not only that no exception was raised. Answers are
greedy and short, and structured ones constrained, so the tiny model's output is valid and the
file runs in a few minutes on two busy cores. The clients reach nothing but loopback: LiteLLM's
cost map is read from the package and tracing is off, and a guard on ``socket`` records (and
refuses) any other address; the last test asserts it recorded none.
"""

from __future__ import annotations

import ipaddress
import json
import socket

import openai
import pytest
from pydantic import BaseModel, ConfigDict

from test_server import Server

pytestmark = pytest.mark.slow

MODEL = "smollm2"
QUESTION = "What is the capital of France?"
STRUCTURED = "Which city is the capital of France?"
"""Structured answers: to QUESTION SmolLM2 fills ``name`` with "France" in a valid shape."""
EOS = "<|im_end|>"
"""SmolLM2's end of turn: a chat answer's last logprobs entry when it stops (as vLLM counts it)."""
MAX_TOKENS = 10
"""Plain answers: enough for the model's first sentence to name the city."""
CALL_TOKENS = 48
"""A Hermes block ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`` with two short
fields is about 30 tokens: a forced call cut shorter is not a call (see the test at the end)."""

OFFLINE_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # else LiteLLM fetches its model-cost map at import
    "LITELLM_TELEMETRY": "False",
    "LANGSMITH_TRACING": "false",
    "LANGCHAIN_TRACING_V2": "false",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class City(BaseModel):
    """A city and the country it is in."""

    # additionalProperties false in every client's schema: SmolLM2 adds keys ("city": …) otherwise
    model_config = ConfigDict(extra="forbid")
    name: str
    country: str


def _loopback(host) -> bool:
    if host in (None, "", "localhost"):
        return True
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False


class _LoopbackOnly:
    """Refuses (and records) every connection or name lookup of this process that is not loopback."""

    def __init__(self) -> None:
        self.refused: list[str] = []
        self._connect, self._connect_ex = socket.socket.connect, socket.socket.connect_ex
        self._getaddrinfo = socket.getaddrinfo

    def _check(self, sock, address) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _loopback(address[0]):
            self.refused.append(f"connect {address!r}")
            raise OSError(f"test_clients: no network beyond loopback ({address!r})")

    def install(self) -> None:
        guard = self

        def connect(sock, address):
            guard._check(sock, address)
            return guard._connect(sock, address)

        def connect_ex(sock, address):
            guard._check(sock, address)
            return guard._connect_ex(sock, address)

        def getaddrinfo(host, *args, **kwargs):
            if not _loopback(host.decode() if isinstance(host, bytes) else host):
                guard.refused.append(f"lookup {host!r}")
                raise socket.gaierror(f"test_clients: no network beyond loopback ({host!r})")
            return guard._getaddrinfo(host, *args, **kwargs)

        socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo

    def remove(self) -> None:
        socket.socket.connect, socket.socket.connect_ex = self._connect, self._connect_ex
        socket.getaddrinfo = self._getaddrinfo


@pytest.fixture(scope="module")
def offline():
    """The offline environment and the loopback guard, for this module only (the clients are
    imported under it: LiteLLM reads its environment at import)."""
    guard = _LoopbackOnly()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in OFFLINE_ENV.items():
            patch.setenv(name, value)
        guard.install()
        try:
            yield guard
        finally:
            guard.remove()


@pytest.fixture(scope="module")
def server(offline, tmp_path_factory):
    # the embedded model is converted and self-checked first: minutes when the two cores are shared
    srv = Server(tmp_path_factory.mktemp("clients"), "--memory-only", "--max-tokens", "64", ready_s=600)
    yield srv
    assert srv.stop() == 0, srv.output()
    out = srv.output()
    assert "Traceback" not in out, out[-3000:]


@pytest.fixture(scope="module")
def chat(offline, server):
    """A greedy langchain-openai ``ChatOpenAI`` on the server."""
    from langchain_openai import ChatOpenAI

    def make(**kwargs):
        kwargs = {"max_tokens": MAX_TOKENS, **kwargs}
        return ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="none", temperature=0, max_retries=0,
                          timeout=300, **kwargs)

    return make


@pytest.fixture(scope="module")
def litellm(offline):
    import litellm

    litellm.telemetry = False
    return litellm


@pytest.fixture(scope="module")
def reference(server):
    """The ``openai`` client's greedy chat answer to QUESTION: what every client must show."""
    return server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                   temperature=0, max_tokens=MAX_TOKENS)


def test_reference_answer(reference):
    text = reference.choices[0].message.content
    assert "Paris" in text, text
    assert reference.usage.completion_tokens <= MAX_TOKENS


# --- langchain-openai -------------------------------------------------------------------------

def test_langchain_invoke_stream_and_batch(chat, reference):
    from langchain_core.messages import AIMessage, AIMessageChunk

    llm = chat(stream_usage=True)
    message = llm.invoke(QUESTION)
    assert isinstance(message, AIMessage)
    assert message.content == reference.choices[0].message.content
    assert message.response_metadata["finish_reason"] == reference.choices[0].finish_reason
    assert message.response_metadata["model_name"] == MODEL
    assert message.usage_metadata["input_tokens"] == reference.usage.prompt_tokens
    assert message.usage_metadata["output_tokens"] == reference.usage.completion_tokens
    assert message.usage_metadata["input_token_details"]["cache_read"] > 0, "the same prompt twice: a prefix hit"

    chunks = list(llm.stream(QUESTION))
    assert chunks and all(isinstance(chunk, AIMessageChunk) for chunk in chunks)
    assert sum(1 for chunk in chunks if chunk.content) > 1, "streamed token by token, not in one piece"
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole = whole + chunk
    assert whole.content == message.content
    assert whole.usage_metadata["output_tokens"] == message.usage_metadata["output_tokens"]
    assert whole.response_metadata["finish_reason"] == message.response_metadata["finish_reason"]

    answers = llm.batch([QUESTION, "What is the capital of Germany?"])
    assert [type(a) for a in answers] == [AIMessage, AIMessage]
    assert answers[0].content == message.content, "greedy answers do not depend on the batch"
    assert "Berlin" in answers[1].content, answers[1].content


STRUCTURED_PROMPTS = {
    "json_schema": STRUCTURED,
    "function_calling": STRUCTURED,
    # json_mode sends no schema, only response_format json_object: the prompt must name the keys
    "json_mode": STRUCTURED + ' Answer in JSON with the keys "name" and "country".',
}


@pytest.mark.parametrize("method", list(STRUCTURED_PROMPTS))
def test_langchain_structured_output(chat, method):
    structured = chat(max_tokens=CALL_TOKENS).with_structured_output(City, method=method, include_raw=True)
    out = structured.invoke(STRUCTURED_PROMPTS[method])
    assert out["parsing_error"] is None
    city, raw = out["parsed"], out["raw"]
    assert isinstance(city, City), out
    assert city.name == "Paris" and city.country.lower() == "france", city
    if method == "function_calling":
        # one call (a named tool_choice): no repeated call running into max_tokens
        assert raw.response_metadata["finish_reason"] == "tool_calls"
        assert raw.content == ""
        [call] = raw.tool_calls
        assert call["name"] == "City" and call["args"] == city.model_dump() and call["id"].startswith("call_")
    else:
        assert raw.response_metadata["finish_reason"] == "stop"
        assert json.loads(raw.content) == city.model_dump()
        assert raw.content == json.dumps(city.model_dump()), "JSON on one line, as json.dumps writes it"


def _tools():
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city today."""
        return "sunny"

    @tool
    def get_population(city: str) -> int:
        """How many people live in a city."""
        return 1

    return [get_weather, get_population]


@pytest.mark.parametrize("choice", ["get_weather", "any"])
def test_langchain_bind_tools(chat, choice):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    tools = _tools()
    # `any` (required) may call several times unless told not to; a named choice is one call anyway
    parallel = {"parallel_tool_calls": False} if choice == "any" else {}
    llm = chat(max_tokens=CALL_TOKENS).bind_tools(tools, tool_choice=choice, **parallel)
    question = HumanMessage("What is the weather like in Paris today?")
    message = llm.invoke([question])
    assert isinstance(message, AIMessage)
    assert message.response_metadata["finish_reason"] == "tool_calls"
    assert message.invalid_tool_calls == []
    [call] = message.tool_calls
    assert call["name"] in {"get_weather", "get_population"}
    if choice == "get_weather":
        assert call["name"] == "get_weather"
    assert set(call["args"]) == {"city"} and isinstance(call["args"]["city"], str), call
    assert call["args"]["city"] == "Paris"

    if choice == "get_weather":
        # the call and its result go back through LangChain's message conversion and the template
        tool = {t.name: t for t in tools}[call["name"]]
        result = tool.invoke(call)
        assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
        answer = chat(max_tokens=MAX_TOKENS).bind_tools(tools).invoke([question, message, result])
        assert isinstance(answer, AIMessage) and answer.tool_calls == []
        assert answer.content.strip() and answer.response_metadata["finish_reason"] in ("stop", "length")


def test_langchain_logprobs(chat):
    top = 3
    message = chat(logprobs=True, top_logprobs=top).invoke(QUESTION)
    content = message.response_metadata["logprobs"]["content"]
    assert len(content) == message.usage_metadata["output_tokens"]
    # every generated token has its entry, the end of turn too when the answer stops on it
    stopped = message.response_metadata["finish_reason"] == "stop"
    assert "".join(entry["token"] for entry in content) == message.content + (EOS if stopped else "")
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == top
        alternatives = [alt["logprob"] for alt in entry["top_logprobs"]]
        assert alternatives == sorted(alternatives, reverse=True)
        # greedy: the chosen token is the likeliest
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-6)
        assert bytes(entry["bytes"]).decode("utf-8") == entry["token"]
        assert len({alt["token"] for alt in entry["top_logprobs"]}) == top


# --- instructor -------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(offline, server, mode):
    import instructor

    client = instructor.from_openai(server.client(), mode=instructor.Mode[mode])
    city, completion = client.chat.completions.create_with_completion(
        model=MODEL, response_model=City, messages=[{"role": "user", "content": STRUCTURED}], temperature=0,
        max_tokens=CALL_TOKENS, max_retries=1)
    assert isinstance(city, City) and city.name == "Paris" and city.country.lower() == "france", city
    message = completion.choices[0].message
    if mode == "TOOLS":
        assert completion.choices[0].finish_reason == "tool_calls"
        [call] = message.tool_calls
        assert call.function.name == "City" and json.loads(call.function.arguments) == city.model_dump()
    else:
        assert completion.choices[0].finish_reason == "stop"
        assert json.loads(message.content) == city.model_dump()


# --- LiteLLM ----------------------------------------------------------------------------------

def test_litellm_chat(litellm, server, reference):
    kwargs = dict(model=f"openai/{MODEL}", api_base=server.url + "/v1", api_key="none", temperature=0,
                  max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": QUESTION}])
    reply = litellm.completion(**kwargs)
    assert isinstance(reply, litellm.ModelResponse)
    assert reply.choices[0].message.content == reference.choices[0].message.content
    assert reply.choices[0].finish_reason == reference.choices[0].finish_reason
    assert reply.usage.prompt_tokens == reference.usage.prompt_tokens
    assert reply.usage.completion_tokens == reference.usage.completion_tokens

    chunks = list(litellm.completion(stream=True, **kwargs))
    assert len(chunks) > 2
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content


def test_litellm_text_completion(litellm, server):
    prompt = "The capital of France is"
    expected = server.client().completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6)
    assert "Paris" in expected.choices[0].text, expected
    reply = litellm.text_completion(model=f"openai/{MODEL}", api_base=server.url + "/v1", api_key="none",
                                    prompt=prompt, temperature=0, max_tokens=6)
    assert isinstance(reply, litellm.TextCompletionResponse)
    assert reply.choices[0].text == expected.choices[0].text
    assert reply.choices[0].finish_reason == expected.choices[0].finish_reason
    assert reply.usage.completion_tokens == expected.usage.completion_tokens


# --- the openai client's Responses API ----------------------------------------------------------

def test_openai_responses_streamed_and_not(server):
    client = server.client()
    kwargs = dict(model=MODEL, input=QUESTION, instructions="You are a helpful assistant.",
                  max_output_tokens=MAX_TOKENS, temperature=0)
    response = client.responses.create(**kwargs)
    assert isinstance(response, openai.types.responses.Response)
    assert response.status in ("completed", "incomplete") and response.id.startswith("resp_")
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert "Paris" in response.output_text, response.output_text
    assert 0 < response.usage.output_tokens <= MAX_TOKENS
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens

    events = list(client.responses.create(stream=True, **kwargs))
    types = [event.type for event in events]
    assert types[0] == "response.created" and types[-1] == f"response.{response.status}", types
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == response.output_text
    final = events[-1].response
    assert final.output_text == response.output_text and final.usage.output_tokens == response.usage.output_tokens
    assert final.usage.input_tokens_details.cached_tokens > 0, "the same prompt again: a prefix hit"


def test_openai_responses_parse(server):
    parsed = server.client().responses.parse(model=MODEL, input=STRUCTURED, text_format=City,
                                             max_output_tokens=CALL_TOKENS, temperature=0)
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name == "Paris", parsed.output_text


# --- the open question, and the guard -------------------------------------------------

def test_a_cut_forced_call_is_not_silent(chat):
    """``with_structured_output(City, method="function_calling")`` returned None in issue 43: the
    forced call was cut by ``max_tokens`` (a Hermes block needs about 30 tokens) and came back as
    text, which LangChain reads as "no call". The cut call now comes back as OpenAI and vLLM send
    it — in ``tool_calls`` with its partial arguments, ``finish_reason`` ``length`` — and LangChain
    shows it as an invalid tool call on the raw message. (LangChain 1.8's parser still answers
    ``parsed: None`` with no ``parsing_error`` for it: it reads only valid calls.)"""
    structured = chat(max_tokens=16).with_structured_output(City, method="function_calling", include_raw=True)
    out = structured.invoke(STRUCTURED)
    raw = out["raw"]
    assert out["parsed"] is None and raw.response_metadata["finish_reason"] == "length"
    assert raw.tool_calls == [] and raw.content == ""
    [cut] = raw.invalid_tool_calls
    assert cut["name"] == "City" and cut["id"].startswith("call_") and "not valid JSON" in cut["error"]
    assert cut["args"] and '{"name": "Paris", "country": "France"}'.startswith(cut["args"]), cut["args"]


def test_no_network_beyond_loopback(offline):
    assert offline.refused == [], offline.refused
