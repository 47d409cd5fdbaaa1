"""The OpenAI-compatible HTTP API over one engine (FastAPI; ``engine.py`` says what it uses of one).

``create_app(engine, ...)`` returns the ASGI app ``promptcache serve`` runs with uvicorn. A
request is authenticated (its tenant gives the cache salt), parsed and planned in a worker
thread (bad input raises there and changes nothing), submitted to the engine's scheduler, and
awaited without a thread: the scheduler wakes the event loop after each token. Plain prompts
(``messages`` / ``prompt``) get exact prefix reuse; PML prompts (the ``pml`` field) import the
tenant's and the shared schemas' modules. See ``docs/server.md``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pckernels.errors import (DeadlineExceeded, EngineBusyError, PMLError, PromptTooLongError, RequestCancelled,
                              RequestTooLargeError, UnknownSchemaError)
from pckernels.generation import TextStream
from pckernels.server.engine import ServingEngine
from pckernels.server.generation import Watcher
from pckernels.server.metrics import ServerMetrics
from pckernels.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, SchemaUpload
from pckernels.server.schemas import ENCODING, FAILED, SchemaRecord, SchemaRegistry
from pckernels.server.tenants import Tenant, Tenants

log = logging.getLogger("pckernels.server")
access_log = logging.getLogger("pckernels.server.access")

SCHEMA_SUFFIXES = (".xml", ".pml")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/schemas", "/metrics", "/health", "/ready")


@dataclass
class ServerState:
    """What the routes share: the engine, tenants, schemas, metrics and limits."""

    engine: ServingEngine
    tenants: Tenants
    registry: SchemaRegistry
    metrics: ServerMetrics
    model_name: str
    request_timeout: float | None
    default_max_tokens: int
    startup: list[SchemaRecord] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))
    stopping: bool = False

    @property
    def fingerprint(self) -> str:
        return "promptcache-" + str(getattr(self.engine, "model_id", ""))[:12]


def create_app(engine: ServingEngine, *, tenants: Tenants | None = None, model_name: str | None = None,
               schemas_dir: str | Path | None = None, request_timeout: float | None = 600.0,
               default_max_tokens: int = 512, max_body_bytes: int = 32 << 20, close_engine: bool = True) -> FastAPI:
    """The app serving ``engine``. ``tenants``: API keys (None: one open tenant, no salt);
    ``schemas_dir``: PML files (``*.xml``, ``*.pml``) parsed now (``PMLError`` naming the file on
    bad input) and encoded in the background as shared schemas, ``/ready`` says when;
    ``request_timeout``: the default deadline of a generation in seconds; ``default_max_tokens``:
    for chat requests that give none; ``close_engine``: close it when the app shuts down."""
    from pckernels.server.tenants import server_secret

    state = ServerState(engine, tenants or Tenants(None, server_secret()), SchemaRegistry(engine),
                        ServerMetrics(engine), model_name or str(engine.name), request_timeout, default_max_tokens)
    if schemas_dir is not None:
        files = sorted(p for p in Path(schemas_dir).iterdir() if p.suffix in SCHEMA_SUFFIXES and p.is_file())
        for path in files:
            record, _ = state.registry.submit(path, salt="", shared=True, owner="server")
            state.startup.append(record)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        log.info("serving %s (%d startup schemas)", state.model_name, len(state.startup))
        yield
        state.stopping = True
        await asyncio.to_thread(state.registry.close)
        if close_engine:
            await asyncio.to_thread(engine.close)
        log.info("stopped")

    app = FastAPI(title="promptcache", version="0.1.0", lifespan=lifespan)
    app.state.server = state
    _install_errors(app)
    _routes(app, state)
    return _AccessLog(app, state, max_body_bytes)


def _routes(app: FastAPI, state: ServerState) -> None:
    def tenant(request: Request) -> Tenant:
        found = state.tenants.authenticate(request.headers.get("authorization"))
        if found is None:
            raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                           type="authentication_error", code="invalid_api_key")
        request.scope.setdefault("state", {})["tenant"] = found.name
        return found

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        encoding = [r.name for r in state.startup if r.status == ENCODING]
        if state.stopping or encoding:
            return JSONResponse({"status": "stopping" if state.stopping else "encoding", "encoding": encoding},
                                status_code=503)
        return {"status": "ready", "failed": [r.name for r in state.startup if r.status == FAILED]}

    @app.get("/metrics")
    async def metrics():
        body = await asyncio.to_thread(state.metrics.render)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(_: Tenant = Depends(tenant)):
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, _: Tenant = Depends(tenant)):
        _check_model(state, model_id)
        return _model_card(state)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request, who: Tenant = Depends(tenant)):
        return await _generate(state, request, body, who, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, who: Tenant = Depends(tenant)):
        return await _generate(state, request, body, who, chat=False)

    @app.post("/v1/schemas")
    async def upload_schema(request: Request, who: Tenant = Depends(tenant)):
        upload = await _schema_upload(request)
        if upload.shared and not who.admin:
            raise APIError(403, "only an admin key may declare a shared schema", type="permission_error",
                           param="shared", code="permission_denied")
        salt = "" if upload.shared else who.salt
        try:
            record, new = await asyncio.to_thread(state.registry.submit, upload.pml, salt=salt,
                                                  shared=upload.shared or not salt, owner=who.name)
        except PMLError as exc:
            raise _pml_error(exc, "pml") from None
        return JSONResponse(record.to_dict(), status_code=202 if new else 200,
                            headers={"Location": f"/v1/schemas/{record.name}"})

    @app.get("/v1/schemas")
    async def list_schemas(who: Tenant = Depends(tenant)):
        return {"object": "list", "data": [r.to_dict() for r in state.registry.visible(who.salt)]}

    @app.get("/v1/schemas/{name}")
    async def get_schema(name: str, who: Tenant = Depends(tenant)):
        record = state.registry.get(name, who.salt)
        if record is None:
            raise _no_schema(name)
        return record.to_dict()

    @app.delete("/v1/schemas/{name}")
    async def delete_schema(name: str, who: Tenant = Depends(tenant)):
        record = state.registry.get(name, who.salt)
        if record is None:
            raise _no_schema(name)
        if record.salt != who.salt and not who.admin:
            raise APIError(403, f"schema {name!r} is shared; only an admin key may delete it",
                           type="permission_error", code="permission_denied")
        if record.status == ENCODING:
            raise APIError(409, f"schema {name!r} is still encoding; delete it once it is ready",
                           code="schema_encoding", headers={"Retry-After": "1"})
        await asyncio.to_thread(state.registry.delete, name, record.salt)
        return {"id": name, "object": "schema", "deleted": True}


# -- generation ---------------------------------------------------------------------------------------


async def _generate(state: ServerState, http: Request, body, who: Tenant, *, chat: bool):
    arrival = time.perf_counter()
    endpoint = "chat" if chat else "completions"
    body.check_supported()
    _check_model(state, body.model)
    request = await asyncio.to_thread(_build, state, body, who, chat)
    try:
        handle = state.engine.submit(request)
    except EngineBusyError as exc:
        raise APIError(429, f"The server is busy: {exc}", type="rate_limit_error", code="engine_busy",
                       headers={"Retry-After": "1"}) from None
    except RequestTooLargeError as exc:
        raise APIError(413, str(exc), code="request_too_large") from None
    except RuntimeError as exc:
        raise APIError(503, f"The server is shutting down: {exc}", type="server_error", code="unavailable") from None
    watcher = Watcher(handle, asyncio.get_running_loop())
    info = http.scope.setdefault("state", {})
    info["engine_request"] = handle.id
    reply = _Reply(state, endpoint, body, chat)
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
        raise _run_error(exc) from None
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
    except UnknownSchemaError as exc:
        raise _unknown_schema(state, exc, who) from None
    except PromptTooLongError as exc:
        raise APIError(413, str(exc), param="pml" if body.pml is not None else "messages" if chat else "prompt",
                       code="context_length_exceeded") from None
    except PMLError as exc:
        raise _pml_error(exc, "pml") from None
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc) or type(exc).__name__) from None
    except Exception as exc:
        if type(exc).__name__ == "TemplateError":
            raise APIError(400, f"the chat template refused the messages: {exc}", param="messages") from None
        raise


def _completion_prompt(prompt):
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "one prompt per request (n=1)", param="prompt")
        return prompt[0]
    return prompt


async def _stream(state: ServerState, watcher: Watcher, reply: "_Reply", body, arrival: float, info: dict):
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
            error = _run_error(exc)
            info["error"] = error.code
            yield reply.sse(error.body())
            return
        rest = text.finish(result.text)
        if rest:
            yield reply.sse(reply.chunk(rest))
        yield reply.sse(reply.chunk(None, finish_reason=_finish_reason(result.finish_reason)))
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


def _finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


class _Reply:
    """OpenAI response bodies of one request."""

    def __init__(self, state: ServerState, endpoint: str, body, chat: bool) -> None:
        self.state, self.endpoint, self.chat = state, endpoint, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = body.model

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.state.fingerprint}

    @staticmethod
    def usage(result) -> dict:
        prompt, completion = len(result.prompt_token_ids), len(result.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}

    @staticmethod
    def extension(result) -> dict:
        return {"mode": result.mode, "cached_tokens": result.cached_tokens,
                "computed_tokens": result.computed_tokens, "ttft_s": round(result.ttft_s, 6),
                "finish_reason": result.finish_reason}

    def complete(self, result) -> dict:
        reason = _finish_reason(result.finish_reason)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text, "refusal": None},
                      "finish_reason": reason, "logprobs": None}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": result.text, "finish_reason": reason, "logprobs": None}
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": self.usage(result), "promptcache": self.extension(result)}

    def chunk(self, delta, finish_reason: str | None = None) -> dict:
        if self.chat:
            content = delta if isinstance(delta, dict) else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": content, "finish_reason": finish_reason, "logprobs": None}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": delta or "", "finish_reason": finish_reason, "logprobs": None}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, result) -> dict:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": self.usage(result), "promptcache": self.extension(result)}

    @staticmethod
    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# -- errors -------------------------------------------------------------------------------------------


def _check_model(state: ServerState, name: str) -> None:
    if name not in (state.model_name, "default"):
        raise APIError(404, f"The model {name!r} does not exist; this server serves {state.model_name!r}.",
                       param="model", code="model_not_found")


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "promptcache",
            "max_model_len": state.engine.max_positions}


def _pml_error(exc: PMLError, param: str) -> APIError:
    error = APIError(400, str(exc), param=param, code="pml_error")
    error.extra = {"line": exc.line, "column": exc.column}
    return error


def _no_schema(name: str) -> APIError:
    return APIError(404, f"no schema named {name!r}", param="name", code="schema_not_found")


def _unknown_schema(state: ServerState, exc: UnknownSchemaError, who: Tenant) -> APIError:
    record = state.registry.get(exc.schema, who.salt) if exc.schema else None
    if record is not None and record.status == ENCODING:
        return APIError(409, f"schema {record.name!r} is still encoding ({record.done}/{record.total} blocks); "
                        "retry when GET /v1/schemas/{name} reports ready", param="pml", code="schema_encoding",
                        headers={"Retry-After": "1"})
    if record is not None and record.status == FAILED:
        return APIError(404, f"schema {record.name!r} failed to encode: {record.error}", param="pml",
                        code="schema_failed")
    error = APIError(404, str(exc), param="pml", code="schema_not_found")
    error.extra = {"line": exc.line, "column": exc.column}
    return error


def _run_error(exc: BaseException) -> APIError:
    """An error of a submitted request (the engine failed it) as an APIError."""
    if isinstance(exc, DeadlineExceeded):
        return APIError(504, "The request passed its deadline (timeout_s or the server's --request-timeout).",
                        type="timeout_error", code="deadline_exceeded")
    if isinstance(exc, RequestCancelled):
        return APIError(499, "The request was cancelled.", type="server_error", code="cancelled")
    log.error("request failed in the engine", exc_info=exc)
    return APIError(500, f"The engine failed the request: {type(exc).__name__}", type="server_error",
                    code="internal_error")


async def _schema_upload(request: Request) -> SchemaUpload:
    raw = await request.body()
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    try:
        if kind in ("", "application/json"):
            return SchemaUpload.model_validate_json(raw)
        shared = request.query_params.get("shared", "false").lower() in ("1", "true", "yes")
        return SchemaUpload(pml=raw.decode("utf-8"), shared=shared)
    except UnicodeDecodeError:
        raise APIError(400, "the schema is not UTF-8 text", param="pml") from None
    except ValidationError as exc:
        raise APIError(400, _validation_message(exc.errors()), param="pml") from None


def _validation_message(errors) -> str:
    parts = []
    for err in errors[:5]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "Invalid request: " + "; ".join(parts)


def _error_response(error: APIError) -> JSONResponse:
    body = error.body()
    body["error"].update(getattr(error, "extra", {}))
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        request.scope.setdefault("state", {})["error"] = exc.code or exc.type
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return _error_response(APIError(400, "The request body is not valid JSON.", code="invalid_json"))
        param = next((str(e["loc"][1]) for e in errors if len(e.get("loc", ())) > 1), None)
        return _error_response(APIError(400, _validation_message(errors), param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error_response(APIError(exc.status_code, str(exc.detail), code="not_found"
                                        if exc.status_code == 404 else None, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception):
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return _error_response(APIError(500, f"Internal error: {type(exc).__name__}", type="server_error",
                                        code="internal_error"))


class _AccessLog:
    """ASGI wrapper: a request id per request (``X-Request-Id``, the client's if it sent a sane
    one), a size limit on bodies, the request counter, and one structured log line per request."""

    def __init__(self, app: FastAPI, state: ServerState, max_body_bytes: int) -> None:
        self.app = app
        self.server = state
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        given = headers.get("x-request-id", "")
        rid = given if _REQUEST_ID.match(given) else uuid.uuid4().hex[:16]
        info = scope.setdefault("state", {})
        info["request_id"] = rid
        t0 = time.perf_counter()
        status = {"code": 500}

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            length = int(headers.get("content-length") or 0)
        except ValueError:
            length = 0
        try:
            if length > self.max_body_bytes:
                error = APIError(413, f"The request body has {length} bytes; the limit is {self.max_body_bytes}.",
                                 code="body_too_large")
                await _error_response(error)(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            path = scope.get("path", "")
            endpoint = next((r for r in _ROUTES if path == r or path.startswith(r + "/")), "other")
            self.server.metrics.requests.labels(endpoint, str(status["code"])).inc()
            fields = {"request_id": rid, "method": scope.get("method"), "path": path, "status": status["code"],
                      "ms": round((time.perf_counter() - t0) * 1e3, 2)}
            fields.update({k: v for k, v in info.items() if k != "request_id"})
            access_log.info(" ".join(f"{k}={_logfmt(v)}" for k, v in fields.items()))


def _logfmt(value) -> str:
    text = str(value)
    return json.dumps(text) if (not text or any(c in text for c in ' "=\n')) else text
