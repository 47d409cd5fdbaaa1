"""The generation bridge: an OpenAI request made an engine request, submitted, awaited from the
event loop and answered whole or streamed as server-sent events; a client that goes away cancels it.

The engine request is built in a worker thread (bad input raises there and changes nothing). The
scheduler runs on its own thread; a :class:`Watcher` registers a listener on the request's handle
that wakes the loop (``call_soon_threadsafe``) after every token, so no thread is parked per
request. Text deltas come from :class:`pckernels.generation.text.TextStream` fed the request's
own stop strings: the routine that builds the result's text, so the deltas join to it exactly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pckernels.engine.request import RequestHandle
from pckernels.errors import OptionError
from pckernels.generation import SamplingParams, TextStream
from pckernels.generation.grammar import GrammarError
from pckernels.prefix.prompts import encode_prompt
from pckernels.server.errors import SUBMIT_ERRORS, request_error, run_error, submit_error
from pckernels.server.protocol import APIError
from pckernels.server.replies import Reply, finish_reason
from pckernels.server.state import ServerState
from pckernels.server.tool_parsers import ForcedCallParser, ToolStream
from pckernels.server.tools import check_tools, forced, template_messages
from pckernels.server.tenants import Tenant

__all__ = ["Watcher", "generate"]


class Watcher:
    """Awaits the tokens of one :class:`RequestHandle` on ``loop``; records when each arrived.
    Watchers of one request's several answers share ``event`` (set when any of them moves), so
    :meth:`wait` on any of them wakes when any answer moves."""

    def __init__(self, handle: RequestHandle, loop: asyncio.AbstractEventLoop, event: asyncio.Event | None = None) -> None:
        self.handle = handle
        self.loop = loop
        self.times: list[float] = []
        """``perf_counter()`` of each notification (one per token, then one at the end)."""
        self._event = event or asyncio.Event()
        handle.add_listener(self._poke)

    def _poke(self) -> None:
        self.times.append(time.perf_counter())
        try:
            self.loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:
            pass

    async def wait(self, timeout: float | None = None) -> None:
        """Until something happened (a token, the end) or ``timeout`` seconds passed."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except asyncio.TimeoutError:
            return
        self._event.clear()

    def take(self) -> list[int] | None:
        """Tokens chosen since the last call, without waiting (``[]`` when none came); ``None`` once
        the request has ended and every token was taken."""
        ended = self.handle.done
        tokens = self.handle.take()
        return tokens if tokens or not ended else None

    async def tokens(self, timeout: float | None = None) -> list[int] | None:
        """Like :meth:`take`, waiting up to ``timeout`` for a token when none is there yet."""
        tokens = self.take()
        if tokens == []:
            await self.wait(timeout)
            tokens = self.take()
        return tokens

    def gaps(self, n_tokens: int) -> list[float]:
        """Seconds between consecutive tokens (of the first ``n_tokens`` notifications)."""
        stamps = self.times[:n_tokens]
        return [b - a for a, b in zip(stamps, stamps[1:])]


async def generate(state: ServerState, http: Request, body, who: Tenant, *, chat: bool):
    """Answer a chat (``chat``) or completion ``body`` from tenant ``who``: the whole reply, an SSE
    stream, or 499 when the client went away first. Every prompt of the body (completions take
    several) gives ``n`` answers, read once."""
    arrival = time.perf_counter()
    endpoint = "chat" if chat else "completions"
    body.check_supported()
    state.check_model(body.model)
    reply = Reply(state.fingerprint, endpoint, body, chat, state.engine.tokenizer)
    if not chat and body.echo:
        reply.echoes, counts = await asyncio.to_thread(_echoes, state, body, who)
        if body.max_tokens == 0:
            return _prompt_only(reply, body, counts)
    requests = await asyncio.to_thread(_build, state, body, who, chat)
    handles: list[RequestHandle] = []
    try:
        for request in requests:
            handles += state.engine.submit(request).choices
    except SUBMIT_ERRORS as exc:
        for handle in handles:
            handle.cancel()
        raise submit_error(exc) from None
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    watchers = [Watcher(handle, loop, event) for handle in handles]
    info = http.scope.setdefault("state", {})
    info["engine_request"] = handles[0].id
    if chat:
        forced_call = body.calls_tools and (body.tool_choice == "required" or isinstance(body.tool_choice, dict))
        named = body.tool_choice["function"]["name"] if isinstance(body.tool_choice, dict) else None
        reply.parser = ForcedCallParser(named) if forced_call else state.tool_parser
    if body.stream:
        return StreamingResponse(_stream(state, watchers, reply, body, arrival, info), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    for watcher in watchers:
        while not watcher.handle.done:
            await watcher.wait(0.25)
            if not watcher.handle.done and await http.is_disconnected():
                for handle in handles:
                    handle.cancel()
                state.metrics.cancelled.inc()
                info["cancelled"] = True
                return Response(status_code=499)
    try:
        results = [handle.result(timeout=0) for handle in handles]
    except BaseException as exc:
        raise run_error(exc) from None
    for result, watcher in zip(results, watchers):
        _observe(state, endpoint, result, watcher, arrival, info)
    return reply.complete(results)


def _build(state: ServerState, body, who: Tenant, chat: bool) -> list:
    """The engine requests of ``body``, one per prompt (in a worker thread); input errors become APIErrors."""
    engine = state.engine
    params = sampling(state, body, chat)
    grammar = _grammar(engine, body)
    tools = lark = None
    if chat:
        tools = check_tools(body.tools, body.tool_choice) if body.tool_choice != "none" else None
        lark = forced(tools, body.tool_choice, body.parallel_tool_calls) if tools else None
        if lark is not None:
            if grammar is not None:
                raise APIError(400, "tool_choice required or named constrains the answer already; drop "
                               "response_format", param="response_format")
            try:
                grammar = engine.grammars.lark(lark)
            except GrammarError as exc:
                raise APIError(400, f"a tool's parameters cannot constrain decoding: {exc}", param="tools",
                               code="invalid_grammar") from None
    if grammar is not None:
        params = dataclasses.replace(params, grammar=grammar)
    if tools and lark is None and state.tool_parser.name == "mistral":
        params = dataclasses.replace(params, skip_special_tokens=False)  # as vLLM: [TOOL_CALLS] is a special token
    deadline_s = body.timeout_s or state.request_timeout
    plain = (chat and body.messages) or (not chat and body.prompt not in (None, "", []))
    try:
        if body.pml is not None:
            if plain:
                raise APIError(400, "give either pml or " + ("messages" if chat else "prompt") + ", not both",
                               param="pml")
            return [engine.request(body.pml, params, recompute=body.recompute, recompute_policy=body.recompute_policy,
                                   deadline_s=deadline_s, salt=who.salt)]
        if not plain:
            raise APIError(400, ("messages" if chat else "prompt") + " must not be empty (or give a PML prompt "
                           "in the 'pml' field)", param="messages" if chat else "prompt")
        prompts = [template_messages(body.messages)] if chat else _completion_prompts(body.prompt)
        salt = who.salt if body.cache_salt is None else cache_salt(who.salt, body.cache_salt)
        template = template_kwargs(engine.tokenizer, body) if chat else None
        extra = {"chat_template_kwargs": template} if template else {}
        return [engine.complete_request(prompt, params, reuse=body.cache, deadline_s=deadline_s, salt=salt, tools=tools,
                                        **extra)
                for prompt in prompts]
    except APIError:
        raise
    except Exception as exc:
        error = request_error(exc, state.registry, who.salt,
                              "pml" if body.pml is not None else "messages" if chat else "prompt")
        if error is None:
            raise
        raise error from None


def _echoes(state: ServerState, body, who: Tenant) -> tuple[list[tuple[str, list]], list[int]]:
    """Completions with ``echo`` (in a worker thread): per prompt its text and, with ``logprobs``,
    its tokens' log-probabilities from one cold forward; and each prompt's token count."""
    engine = state.engine
    echoes, counts = [], []
    for prompt in _completion_prompts(body.prompt):
        try:
            if body.logprobs is not None:
                ids, records = engine.prompt_logprobs(prompt, body.logprobs)
            else:
                ids, records = (engine.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)), []
        except Exception as exc:
            error = request_error(exc, state.registry, who.salt, "prompt")
            if error is None:
                raise
            raise error from None
        text = prompt if isinstance(prompt, str) else engine.tokenizer.decode(ids)
        echoes.append((text, records))
        counts.append(len(ids))
    return echoes, counts


def _prompt_only(reply: Reply, body, counts: list[int]):
    """``echo`` with ``max_tokens=0``: the prompts alone, whole or as one stream."""
    whole = reply.prompt_only(counts)
    if not body.stream:
        return whole

    async def events():
        for choice in whole["choices"]:
            yield reply.sse({**reply._head("text_completion"), "choices": [{**choice, "finish_reason": None}]})
            yield reply.sse(reply.chunk(None, finish_reason="length", index=choice["index"]))
        if body.stream_options is not None and body.stream_options.include_usage:
            yield reply.sse({**reply._head("text_completion"), "choices": [], "usage": whole["usage"]})
        yield "data: [DONE]\n\n"
    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


OPENAI_FIELDS = {"max_new_tokens": "max_tokens"}
"""The body field of a :class:`SamplingParams` field where OpenAI names it otherwise."""


def sampling(state: ServerState, body, chat: bool) -> SamplingParams:
    """How ``body`` wants its tokens chosen, as one :class:`SamplingParams` (its constraint, if any,
    is added by the caller). Unset ``temperature`` and ``top_p`` are 1.0, as in OpenAI's API; a
    value ``SamplingParams`` refuses is a 400 naming the field."""
    try:
        return SamplingParams(max_new_tokens=body.limit(state.default_max_tokens) if chat else body.max_tokens,
                              temperature=1.0 if body.temperature is None else body.temperature,
                              top_p=1.0 if body.top_p is None else body.top_p, stop=body.stops(), seed=body.seed,
                              logit_bias=body.bias(len(state.engine.tokenizer)) or (),
                              presence_penalty=body.presence_penalty or 0.0,
                              frequency_penalty=body.frequency_penalty or 0.0, logprobs=body.logprob_count(),
                              n=body.n, top_k=0 if body.top_k is None else body.top_k,
                              min_p=0.0 if body.min_p is None else body.min_p,
                              repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                              min_tokens=body.min_tokens, ignore_eos=body.ignore_eos,
                              stop_token_ids=tuple(body.stop_token_ids or ()),
                              skip_special_tokens=body.skip_special_tokens,
                              include_stop_str_in_output=body.include_stop_str_in_output)
    except OptionError as exc:
        raise APIError(400, str(exc), param=OPENAI_FIELDS.get(exc.option, exc.option)) from None


def render_ids(tokenizer, body) -> list[int]:
    """The prompt token ids of a chat ``body``'s messages, rendered as :func:`_build` has the engine
    render them (template, tools, template variables); 400 for what the template refuses."""
    tools = check_tools(body.tools, body.tool_choice) if body.tool_choice != "none" else None
    try:
        return encode_prompt(tokenizer, template_messages(body.messages), tools, template_kwargs(tokenizer, body))
    except Exception as exc:  # the template's own refusal
        raise APIError(400, f"cannot render the messages: {exc}", param="messages") from None


def template_kwargs(tokenizer, body) -> dict | None:
    """The extra chat-template variables of a chat ``body``: its ``chat_template_kwargs``, and its
    ``reasoning_effort`` when the template reads that variable (ignored otherwise, as it cannot
    change the prompt)."""
    out = dict(body.chat_template_kwargs or {})
    template = getattr(tokenizer, "chat_template", None)
    text = template if isinstance(template, str) else " ".join(map(str, (template or {}).values())) \
        if isinstance(template, dict) else ""
    if body.reasoning_effort is not None and "reasoning_effort" in text:
        out.setdefault("reasoning_effort", body.reasoning_effort)
    return out or None


def _grammar(engine, body):
    """The compiled constraint of ``body`` (``response_format`` or a ``guided_*`` field), or None;
    a schema, regex or grammar that does not compile is a 400 naming the field."""
    constraint = body.constraint()
    if constraint is None:
        return None
    field, kind, value = constraint
    try:
        return engine.grammars.compile(kind, value)
    except GrammarError as exc:
        raise APIError(400, str(exc), param=field, code="invalid_grammar") from None


def cache_salt(tenant_salt: str, salt: str) -> str:
    """The prefix-cache namespace of a request with vLLM's ``cache_salt``: its tenant's and its own."""
    return f"{tenant_salt}|cache_salt:{hashlib.sha256(salt.encode()).hexdigest()[:32]}"


MAX_PROMPTS = 64
"""Prompts one completions request may hold."""


def _completion_prompts(prompt) -> list:
    """A completions ``prompt``: text, token ids, several texts or several lists of token ids."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        return list(prompt)
    return [prompt]


class _Answer:
    """One answer's stream: its watcher, its text (:class:`TextStream`, with the request's own stop
    strings and ``skip_special_tokens``, so the deltas join to the result's text) and what of it
    was sent; ``tools``: what holds back text that may become tool calls (None: no tools)."""

    def __init__(self, watcher: Watcher, tokenizer, tools: ToolStream | None) -> None:
        self.watcher = watcher
        params = watcher.handle.request.params
        self.text = TextStream(tokenizer, params.stop, skip_special_tokens=params.skip_special_tokens)
        self.hidden = set() if params.include_stop_str_in_output else set(params.stop_token_ids)
        """Stop ids whose text the answer leaves out (vLLM)."""
        self.tools = tools
        self.sent = 0
        """Tokens whose log-probabilities were sent."""
        self.shown = 0
        """Characters of the answer sent as content."""

    def push(self, tokens: list[int]) -> str:
        """The content to send after ``tokens`` (what may still become tool calls is held back)."""
        self.text.push([t for t in tokens if t not in self.hidden] if self.hidden else tokens)
        if self.tools is not None:
            delta = self.tools.push(self.text.emitted)
        else:
            delta = self.text.since(self.shown)
        self.shown += len(delta)
        return delta


async def _stream(state: ServerState, watchers: list[Watcher], reply: Reply, body, arrival: float, info: dict):
    """Server-sent events of every answer as its tokens come (a chunk names its choice's ``index``),
    then each answer's end, usage when asked, and ``[DONE]``."""
    handles = [w.handle for w in watchers]
    answers = [_Answer(watcher, state.engine.tokenizer, reply.tool_stream()) for watcher in watchers]
    results: list = [None] * len(handles)
    try:
        if reply.chat:
            for index in range(len(handles)):
                yield reply.sse(reply.chunk({"role": "assistant", "content": ""}, index=index))
        elif reply.echoes is not None:
            for index in range(len(handles)):
                echoed, records = reply.echo(index)
                yield reply.sse(reply.chunk(echoed, records=records, index=index))
        while any(r is None for r in results):
            moved = False
            for index, answer in enumerate(answers):
                if results[index] is not None:
                    continue
                handle = answer.watcher.handle
                tokens = answer.watcher.take()
                if tokens:
                    moved = True
                    delta = answer.push(tokens)
                    if delta or reply.wants_logprobs:
                        records = handle.logprobs[answer.sent:answer.sent + len(tokens)]
                        answer.sent += len(tokens)
                        yield reply.sse(reply.chunk(delta, records=records, index=index))
                elif tokens is None:
                    moved = True
                    try:
                        results[index] = result = handle.result(timeout=0)
                    except BaseException as exc:
                        error = run_error(exc)
                        info["error"] = error.code
                        yield reply.sse(error.body())
                        return
                    answer.text.finish(result.text)
                    for chunk in reply.ending(result, answer.text.since(answer.shown), answer.shown, index,
                                              answer.tools):
                        yield reply.sse(chunk)
            if not moved:
                await watchers[0].wait()
        if body.stream_options is not None and body.stream_options.include_usage:
            yield reply.sse(reply.usage_chunk(results))
        yield "data: [DONE]\n\n"
        for result, watcher in zip(results, watchers):
            _observe(state, reply.endpoint, result, watcher, arrival, info)
    finally:
        if not all(handle.done for handle in handles):
            for handle in handles:
                handle.cancel()
            state.metrics.cancelled.inc()
            info["cancelled"] = True


def _observe(state: ServerState, endpoint: str, result, watcher: Watcher, arrival: float, info: dict) -> None:
    m = state.metrics
    m.ttft.labels(endpoint).observe(result.ttft_s)
    m.e2e.labels(endpoint).observe(time.perf_counter() - arrival)
    for gap in watcher.gaps(len(result.token_ids)):
        m.inter_token.observe(gap)
    m.generated.inc(len(result.token_ids))
    m.prompt_tokens.labels("cached").inc(result.cached_tokens)
    m.prompt_tokens.labels("computed").inc(max(0, len(result.prompt_token_ids) - result.cached_tokens))
    info.update(prompt_tokens=len(result.prompt_token_ids), cached_tokens=result.cached_tokens,
                completion_tokens=len(result.token_ids), ttft_ms=round(result.ttft_s * 1e3, 2), mode=result.mode)


compile_constraint = _grammar
"""The compiled constraint of a chat-shaped body (``responses.py`` shares it)."""
observe = _observe
"""Record one answer's timings and token counts (``responses.py`` shares it)."""
