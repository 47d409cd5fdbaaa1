"""Errors as OpenAI-style answers: engine and PML errors mapped to :class:`APIError`, and the app's
exception handlers (validation, HTTP, anything unhandled)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pckernels.errors import (DeadlineExceeded, EngineBusyError, PMLError, PromptTooLongError, RequestCancelled,
                              RequestTooLargeError, UnknownSchemaError)
from pckernels.server.protocol import APIError
from pckernels.server.schemas import ENCODING, FAILED, SchemaRegistry

log = logging.getLogger("pckernels.server")

SUBMIT_ERRORS = (EngineBusyError, RequestTooLargeError, RuntimeError)
"""What ``submit`` raises when the engine will not queue a request (:func:`submit_error`)."""


def pml_error(exc: PMLError, param: str) -> APIError:
    error = APIError(400, str(exc), param=param, code="pml_error")
    error.extra = {"line": exc.line, "column": exc.column}
    return error


def no_schema(name: str) -> APIError:
    return APIError(404, f"no schema named {name!r}", param="name", code="schema_not_found")


def unknown_schema(registry: SchemaRegistry, exc: UnknownSchemaError, salt: str) -> APIError:
    """A prompt importing a schema the tenant cannot use yet (encoding, failed) or at all."""
    record = registry.get(exc.schema, salt) if exc.schema else None
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


def request_error(exc: Exception, registry: SchemaRegistry, salt: str, param: str) -> APIError | None:
    """The input's error that building an engine request raised, as an APIError (``param``: the field
    of the prompt); ``None`` when it is not the input's (the caller raises it on)."""
    if isinstance(exc, UnknownSchemaError):
        return unknown_schema(registry, exc, salt)
    if isinstance(exc, PromptTooLongError):
        return APIError(413, str(exc), param=param, code="context_length_exceeded")
    if isinstance(exc, PMLError):
        return pml_error(exc, "pml")
    if isinstance(exc, (ValueError, TypeError)):
        return APIError(400, str(exc) or type(exc).__name__)
    if type(exc).__name__ == "TemplateError":
        return APIError(400, f"the chat template refused the messages: {exc}", param="messages")
    return None


def submit_error(exc: Exception) -> APIError:
    """A request the engine would not queue (one of :data:`SUBMIT_ERRORS`) as an APIError."""
    if isinstance(exc, EngineBusyError):
        return APIError(429, f"The server is busy: {exc}", type="rate_limit_error", code="engine_busy",
                        headers={"Retry-After": "1"})
    if isinstance(exc, RequestTooLargeError):
        return APIError(413, str(exc), code="request_too_large")
    return APIError(503, f"The server is shutting down: {exc}", type="server_error", code="unavailable")


def run_error(exc: BaseException) -> APIError:
    """An error of a submitted request (the engine failed it) as an APIError."""
    if isinstance(exc, DeadlineExceeded):
        return APIError(504, "The request passed its deadline (timeout_s or the server's --request-timeout).",
                        type="timeout_error", code="deadline_exceeded")
    if isinstance(exc, RequestCancelled):
        return APIError(499, "The request was cancelled.", type="server_error", code="cancelled")
    log.error("request failed in the engine", exc_info=exc)
    return APIError(500, f"The engine failed the request: {type(exc).__name__}", type="server_error",
                    code="internal_error")


def validation_message(errors) -> str:
    parts = []
    for err in errors[:5]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "Invalid request: " + "; ".join(parts)


def error_response(error: APIError) -> JSONResponse:
    body = error.body()
    body["error"].update(getattr(error, "extra", {}))
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def install_errors(app: FastAPI) -> None:
    """Answer every error of ``app``'s routes with an OpenAI-style body."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        request.scope.setdefault("state", {})["error"] = exc.code or exc.type
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return error_response(APIError(400, "The request body is not valid JSON.", code="invalid_json"))
        param = next((str(e["loc"][1]) for e in errors if len(e.get("loc", ())) > 1), None)
        return error_response(APIError(400, validation_message(errors), param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail), code="not_found"
                                       if exc.status_code == 404 else None, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception):
        log.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(APIError(500, f"Internal error: {type(exc).__name__}", type="server_error",
                                       code="internal_error"))
