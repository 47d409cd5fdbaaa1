"""The generation bridge: an OpenAI request made an engine request, submitted, awaited from the
event loop and answered whole or streamed as server-sent events; a client that goes away cancels it.

The engine request is built in a worker thread (bad input raises there and changes nothing). The
scheduler runs on its own thread; a :class:`Watcher` registers a listener on the request's handle
that wakes the loop (``call_soon_threadsafe``) after every token, so no thread is parked per
request (text deltas come from :class:`pckernels.generation.text.TextStream`).
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pckernels.engine.request import RequestHandle
from pckernels.generation import TextStream
from pckernels.server.errors import SUBMIT_ERRORS, request_error, run_error, submit_error
from pckernels.server.protocol import APIError
from pckernels.server.replies import Reply, finish_reason
from pckernels.server.state import ServerState
from pckernels.server.tenants import Tenant

__all__ = ["Watcher", "generate"]


class Watcher:
    """Awaits the tokens of one :class:`RequestHandle` on ``loop``; records when each arrived."""

    def __init__(self, handle: RequestHandle, loop: asyncio.AbstractEventLoop) -> None:
        self.handle = handle
        self.loop = loop
        self.times: list[float] = []
        """``perf_counter()`` of each notification (one per token, then one at the end)."""
        self._event = asyncio.Event()
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

    async def tokens(self, timeout: float | None = None) -> list[int] | None:
        """Tokens chosen since the last call, waiting up to ``timeout`` for one (``[]`` when none
        came); ``None`` once the request has ended and every token was taken."""
        tokens = self.handle.take()
        if tokens:
            return tokens
        if self.handle.done:
            return self.handle.take() or None
        await self.wait(timeout)
        tokens = self.handle.take()
        if not tokens and self.handle.done:
            return self.handle.take() or None
        return tokens

    def gaps(self, n_tokens: int) -> list[float]:
        """Seconds between consecutive tokens (of the first ``n_tokens`` notifications)."""
        stamps = self.times[:n_tokens]
        return [b - a for a, b in zip(stamps, stamps[1:])]


async def generate(state: ServerState, http: Request, body, who: Tenant, *, chat: bool):
    """Answer a chat (``chat``) or completion ``body`` from tenant ``who``: the whole reply, an SSE
    stream, or 499 when the client went away first."""
    arrival = time.perf_counter()
    endpoint = "chat" if chat else "completions"
    body.check_supported()
    state.check_model(body.model)
    request = await asyncio.to_thread(_build, state, body, who, chat)
    try:
        handle = state.engine.submit(request)
    except SUBMIT_ERRORS as exc:
        raise submit_error(exc) from None
    watcher = Watcher(handle, asyncio.get_running_loop())
    info = http.scope.setdefault("state", {})
    info["engine_request"] = handle.id
    reply = Reply(state.fingerprint, endpoint, body, chat)
    if body.stream:
        return StreamingResponse(_stream(state, watcher, reply, body, arrival, info), media_type="text/event-stream",
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
    _observe(state, endpoint, result, watcher, arrival, info)
    return reply.complete(result)


def _build(state: ServerState, body, who: Tenant, chat: bool):
    """The engine request of ``body`` (in a worker thread); input errors become APIErrors."""
    engine = state.engine
    options = dict(temperature=1.0 if body.temperature is None else body.temperature,
                   top_p=1.0 if body.top_p is None else body.top_p, stop=body.stops() or None, seed=body.seed,
                   deadline_s=body.timeout_s or state.request_timeout, salt=who.salt)
    limit = body.limit(state.default_max_tokens) if chat else body.max_tokens
    plain = (chat and body.messages) or (not chat and body.prompt not in (None, "", []))
    try:
        if body.pml is not None:
            if plain:
                raise APIError(400, "give either pml or " + ("messages" if chat else "prompt") + ", not both",
                               param="pml")
            return engine.request(body.pml, max_new_tokens=limit, recompute=body.recompute,
                                  recompute_policy=body.recompute_policy, **options)
        if not plain:
            raise APIError(400, ("messages" if chat else "prompt") + " must not be empty (or give a PML prompt "
                           "in the 'pml' field)", param="messages" if chat else "prompt")
        if chat:
            prompt = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                      for m in body.messages]
        else:
            prompt = _completion_prompt(body.prompt)
        return engine.complete_request(prompt, max_new_tokens=limit, reuse=body.cache, **options)
    except APIError:
        raise
    except Exception as exc:
        error = request_error(exc, state.registry, who.salt,
                              "pml" if body.pml is not None else "messages" if chat else "prompt")
        if error is None:
            raise
        raise error from None


def _completion_prompt(prompt):
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "one prompt per request (n=1)", param="prompt")
        return prompt[0]
    return prompt


async def _stream(state: ServerState, watcher: Watcher, reply: Reply, body, arrival: float, info: dict):
    handle = watcher.handle
    text = TextStream(state.engine.tokenizer, body.stops())
    try:
        if reply.chat:
            yield reply.sse(reply.chunk({"role": "assistant", "content": ""}))
        while True:
            tokens = await watcher.tokens(timeout=None)
            if tokens is None:
                break
            delta = text.push(tokens)
            if delta:
                yield reply.sse(reply.chunk(delta))
        try:
            result = handle.result(timeout=0)
        except BaseException as exc:
            error = run_error(exc)
            info["error"] = error.code
            yield reply.sse(error.body())
            return
        rest = text.finish(result.text)
        if rest:
            yield reply.sse(reply.chunk(rest))
        yield reply.sse(reply.chunk(None, finish_reason=finish_reason(result.finish_reason)))
        if body.stream_options is not None and body.stream_options.include_usage:
            yield reply.sse(reply.usage_chunk(result))
        yield "data: [DONE]\n\n"
        _observe(state, reply.endpoint, result, watcher, arrival, info)
    finally:
        if not handle.done:
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
