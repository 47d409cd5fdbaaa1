"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: OpenAI's Responses API over the engine.

A request's ``input`` (text, or a list of items: messages with ``input_text`` / ``output_text``
parts, earlier ``function_call`` items and their ``function_call_output``) becomes chat messages,
``instructions`` a system message before them. With ``previous_response_id`` the stored
conversation (``response_store.py``) comes first, and its very token ids (the earlier prompt and
answer) start the new prompt, so exact prefix reuse covers it all. Function tools (the flat shape)
and ``text.format`` go through the chat machinery (``tools.py``, the grammars); the answer is a
``message`` item or ``function_call`` items, whole or streamed as typed events (each with its
``sequence_number``). What this server cannot do — built-in tools, files, images, ``background``
— is a 400 naming it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from pckernels.generation import TextStream
from pckernels.prefix.prompts import render_chat
from pckernels.server.errors import SUBMIT_ERRORS, request_error, run_error, submit_error
from pckernels.server.generation import Watcher, compile_constraint, observe, sampling
from pckernels.server.protocol import APIError, ChatCompletionRequest
from pckernels.server.response_store import StoredResponse
from pckernels.server.state import ServerState
from pckernels.server.tenants import Tenant
from pckernels.server.tool_parsers import HermesParser, ToolParser
from pckernels.server.tools import check_tools, forced, template_messages

IGNORED = frozenset({"user", "metadata", "truncation", "service_tier", "reasoning", "include", "prompt_cache_key",
                     "safety_identifier"})
"""Fields accepted and not acted on: they cannot change the answer (``reasoning``: no reasoning model here)."""
UNSUPPORTED = ("conversation", "prompt", "top_logprobs", "max_tool_calls", "stream_options")
"""Responses API fields this server does not honour: a 400 naming them."""


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses`` (the fields this server acts on; see the module docstring)."""

    model_config = ConfigDict(extra="allow")
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    background: bool | None = None
    timeout_s: float | None = Field(default=None, gt=0.0)

    def check_supported(self) -> None:
        """400 naming the first part this server cannot serve."""
        extra = sorted(set(self.model_extra or {}) - IGNORED)
        if extra:
            name = next((n for n in extra if n in UNSUPPORTED), extra[0])
            why = "is not supported by this server" if name in UNSUPPORTED else "is not a field this server knows"
            raise APIError(400, f"{name!r} {why}", param=name, code="unsupported_field")
        if self.background:
            raise APIError(400, "background responses are not supported by this server", param="background",
                           code="unsupported_field")
        for index, tool in enumerate(self.tools or []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise APIError(400, f"tools[{index}]: built-in tool {kind!r} is not supported by this server "
                               "(function tools only)", param="tools", code="unsupported_tool")

    def chat_tools(self) -> list[dict] | None:
        """The flat function tools in the chat shape ``{"type": "function", "function": {...}}``."""
        if not self.tools:
            return None
        out = []
        for index, tool in enumerate(self.tools):
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise APIError(400, f"tools[{index}] needs a name (the flat shape: {{\"type\": \"function\", "
                               "\"name\": ..., \"parameters\": {...}}})", param="tools")
            function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            out.append({"type": "function", "function": function})
        return out

    def chat_tool_choice(self):
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function":
                raise APIError(400, f"tool_choice {choice!r} is not supported (auto, none, required or a function)",
                               param="tool_choice")
            return {"type": "function", "function": {"name": choice.get("name")}}
        return choice

    def response_format(self) -> dict | None:
        """``text.format`` as chat's ``response_format``."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise APIError(400, "text.format json_schema needs a schema (an object)", param="text.format")
            return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "schema"), "schema": fmt["schema"]}}
        if kind in ("text", "json_object"):
            return {"type": kind}
        raise APIError(400, f"text.format type must be text, json_object or json_schema, got {kind!r}",
                       param="text.format")


def input_messages(items: str | list[dict]) -> list[dict]:
    """``input`` as chat messages (the chat-completions shape ``template_messages`` takes); 400 naming
    an item this server cannot read (files, images, other item types)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for index, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None)
        where = f"input[{index}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}: role must be user, system, developer or assistant", param="input")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None \
                    and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = json.dumps(output)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported by this server",
                           param="input", code="unsupported_input")
    return out


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise APIError(400, f"{where}.content[{k}]: content of type {kind!r} is not supported by this server "
                           "(text only: no images, files or audio)", param="input", code="unsupported_input")
        parts.append(part.get("text") or "")
    return "".join(parts)


@dataclasses.dataclass
class _Turn:
    """One request made ready: its chat form, its prompt ids, the conversation so far (no answer yet)."""

    chat: ChatCompletionRequest
    prompt: list[int]
    messages: list[dict]
    tools: list[dict] | None
    parser: ToolParser
    """The format tool calls are parsed in (a forced call's is Hermes: its grammar's)."""


def _prepare(state: ServerState, body: ResponsesRequest, who: Tenant) -> _Turn:
    """The request's prompt (in a worker thread): the stored conversation (token ids as kept, so
    its blocks are hit exactly), then the new messages; bad input is a 4xx."""
    previous = None
    if body.previous_response_id is not None:
        previous = state.responses.get(who.name, body.previous_response_id)
        if previous is None:
            raise APIError(404, f"Previous response with id {body.previous_response_id!r} not found (unknown, "
                           "not stored, or expired).", param="previous_response_id", code="previous_response_not_found")
    tools = body.chat_tools()
    conversation = (previous.messages if previous is not None else []) + input_messages(body.input)
    if not conversation:
        raise APIError(400, "input must not be empty", param="input")
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    chat = ChatCompletionRequest(model=body.model, messages=messages, max_tokens=body.max_output_tokens,
                                 temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                                 tools=tools, tool_choice=body.chat_tool_choice(),
                                 parallel_tool_calls=body.parallel_tool_calls, response_format=body.response_format(),
                                 timeout_s=body.timeout_s)
    chat_tools = check_tools(tools, chat.tool_choice) if chat.tool_choice != "none" else None
    tokenizer = state.engine.tokenizer
    try:
        rendered = template_messages(chat.messages)
        text = render_chat(tokenizer, rendered, chat_tools)
        prompt = None
        if previous is not None:
            before = tokenizer.decode(previous.ids, skip_special_tokens=False)
            if text.startswith(before):
                prompt = previous.ids + tokenizer(text[len(before):], add_special_tokens=False)["input_ids"]
        if prompt is None:
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    except APIError:
        raise
    except Exception as exc:
        error = request_error(exc, state.registry, who.salt, "input")
        if error is None:
            raise
        raise error from None
    forced_call = chat.tool_choice == "required" or isinstance(chat.tool_choice, dict)
    return _Turn(chat, prompt, conversation, chat_tools, HermesParser() if forced_call else state.tool_parser)


def _build(state: ServerState, turn: _Turn, who: Tenant):
    """The engine request of ``turn`` (its sampling, its constraint or forced tool call)."""
    engine = state.engine
    params = sampling(state, turn.chat, True)
    grammar = compile_constraint(engine, turn.chat)
    if turn.tools:
        lark = forced(turn.tools, turn.chat.tool_choice, turn.chat.parallel_tool_calls)
        if lark is not None:
            if grammar is not None:
                raise APIError(400, "tool_choice required or named constrains the answer already; drop text.format",
                               param="text.format")
            grammar = engine.grammars.lark(lark)
    if grammar is not None:
        params = dataclasses.replace(params, grammar=grammar)
    try:
        return engine.complete_request(turn.prompt, params, deadline_s=turn.chat.timeout_s or state.request_timeout,
                                       salt=who.salt)
    except Exception as exc:
        error = request_error(exc, state.registry, who.salt, "input")
        if error is None:
            raise
        raise error from None


class _Answer:
    """The response object of one request, built up as its answer comes."""

    def __init__(self, state: ServerState, body: ResponsesRequest, turn: _Turn) -> None:
        self.id = "resp_" + uuid.uuid4().hex
        self.body, self.turn, self.state = body, turn, state
        self.created = int(time.time())
        self.sequence = 0

    def obj(self, status: str, output: list[dict], result=None) -> dict:
        body = self.body
        usage = None
        incomplete = None
        if result is not None:
            prompt, answer = len(result.prompt_token_ids), len(result.token_ids)
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": result.cached_tokens},
                     "output_tokens": answer, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": prompt + answer}
            if result.finish_reason == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        fmt = (body.text or {}).get("format") or {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": incomplete, "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "model": body.model, "output": output,
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "store": body.store, "temperature": 1.0 if body.temperature is None else body.temperature,
                "text": {"format": fmt}, "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
                "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled", "usage": usage,
                "user": None, "metadata": (body.model_extra or {}).get("metadata") or {}}

    def items(self, text: str) -> tuple[list[dict], list[dict]]:
        """The output items of answer ``text`` (a message, or function calls) and the assistant's
        chat message of it (for the stored conversation)."""
        calls = []
        if self.turn.tools:
            content, calls = self.turn.parser.parse(text)
        if calls:
            items = [{"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": c["id"],
                      "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}
                     for c in calls]
            if content:
                items.insert(0, self.message(content))
            return items, [{"role": "assistant", "content": content or "", "tool_calls": calls}]
        return [self.message(text)], [{"role": "assistant", "content": text}]

    @staticmethod
    def message(text: str, item_id: str | None = None, status: str = "completed") -> dict:
        return {"type": "message", "id": item_id or "msg_" + uuid.uuid4().hex[:24], "status": status,
                "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": [],
                                                  "logprobs": []}]}

    def finish(self, who: Tenant, result) -> dict:
        """The completed response object of ``result``, stored when asked."""
        output, said = self.items(result.text)
        whole = self.obj("completed", output, result)
        if self.body.store:
            ids = list(result.prompt_token_ids) + list(result.token_ids)
            self.state.responses.put(who.name, StoredResponse(whole, self.turn.messages + said, ids, self.turn.tools))
        return whole

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def create_response(state: ServerState, http: Request, body: ResponsesRequest, who: Tenant):
    """Answer ``POST /v1/responses``: the response object, or its events as SSE."""
    arrival = time.perf_counter()
    body.check_supported()
    state.check_model(body.model)
    turn = await asyncio.to_thread(_prepare, state, body, who)
    request = await asyncio.to_thread(_build, state, turn, who)
    try:
        handle = state.engine.submit(request)
    except SUBMIT_ERRORS as exc:
        raise submit_error(exc) from None
    watcher = Watcher(handle, asyncio.get_running_loop())
    info = http.scope.setdefault("state", {})
    info["engine_request"] = handle.id
    answer = _Answer(state, body, turn)
    if body.stream:
        return StreamingResponse(_events(state, answer, watcher, who, arrival, info), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    while not handle.done:
        await watcher.wait(0.25)
        if not handle.done and await http.is_disconnected():
            handle.cancel()
            state.metrics.cancelled.inc()
            info["cancelled"] = True
            return Response(status_code=499)
    try:
        result = handle.result(timeout=0)
    except BaseException as exc:
        raise run_error(exc) from None
    observe(state, "responses", result, watcher, arrival, info)
    return answer.finish(who, result)


async def _events(state: ServerState, answer: _Answer, watcher: Watcher, who: Tenant, arrival: float, info: dict):
    """The typed events of one streamed response: created, in progress, the message item's text
    deltas (held back while the answer may still become tool calls), the items done, completed."""
    handle = watcher.handle
    texts = TextStream(state.engine.tokenizer, handle.request.params.stop)
    item_id = "msg_" + uuid.uuid4().hex[:24]
    opened = False
    shown = 0
    """Characters of the answer sent as text deltas."""
    held = bool(answer.turn.tools)
    """Whether the answer may hold tool calls (then only what the parser calls safe is sent)."""

    def open_message():
        yield answer.event("response.output_item.added", output_index=0,
                           item=answer.message("", item_id, "in_progress") | {"content": []})
        yield answer.event("response.content_part.added", item_id=item_id, output_index=0, content_index=0,
                           part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    try:
        start = answer.obj("in_progress", [])
        yield answer.event("response.created", response=start)
        yield answer.event("response.in_progress", response=start)
        while True:
            tokens = await watcher.tokens(0.25)
            if tokens is None:
                break
            if not tokens:
                continue
            texts.push(tokens)
            if held:
                so_far = texts.emitted
                delta = so_far[shown:answer.turn.parser.safe(so_far)]
            else:
                delta = texts.since(shown)
            if not delta:
                continue
            if not opened:
                opened = True
                for event in open_message():
                    yield event
            shown += len(delta)
            yield answer.event("response.output_text.delta", item_id=item_id, output_index=0, content_index=0,
                               delta=delta, logprobs=[])
        try:
            result = handle.result(timeout=0)
        except BaseException as exc:
            error = run_error(exc)
            info["error"] = error.code
            yield answer.event("error", code=error.code, message=error.message, param=None)
            return
        texts.finish(result.text)
        whole = answer.finish(who, result)
        output = whole["output"]
        if output and output[0]["type"] == "message":
            output[0]["id"] = item_id
            text = output[0]["content"][0]["text"]
            if not opened:
                for event in open_message():
                    yield event
            if text[shown:]:
                yield answer.event("response.output_text.delta", item_id=item_id, output_index=0, content_index=0,
                                   delta=text[shown:], logprobs=[])
            part = output[0]["content"][0]
            yield answer.event("response.output_text.done", item_id=item_id, output_index=0, content_index=0,
                               text=text, logprobs=[])
            yield answer.event("response.content_part.done", item_id=item_id, output_index=0, content_index=0,
                               part=part)
            yield answer.event("response.output_item.done", output_index=0, item=output[0])
        for index, item in enumerate(output):
            if item["type"] != "function_call":
                continue
            yield answer.event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                       "status": "in_progress"})
            yield answer.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=item["arguments"])
            yield answer.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               arguments=item["arguments"])
            yield answer.event("response.output_item.done", output_index=index, item=item)
        yield answer.event("response.completed" if whole["status"] == "completed" else "response.incomplete",
                           response=whole)
        observe(state, "responses", result, watcher, arrival, info)
    finally:
        if not handle.done:
            handle.cancel()
            state.metrics.cancelled.inc()
            info["cancelled"] = True


def stored_response(state: ServerState, response_id: str, who: Tenant) -> dict:
    """``GET /v1/responses/{id}``: a stored response of the tenant, or 404."""
    record = state.responses.get(who.name, response_id)
    if record is None:
        raise APIError(404, f"No response with id {response_id!r} (unknown, not stored, or expired).",
                       param="response_id", code="response_not_found")
    return record.body


__all__ = ["ResponsesRequest", "create_response", "input_messages", "stored_response"]
