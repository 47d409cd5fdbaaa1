"""The access log: an ASGI wrapper giving each request an id, a body-size limit, the request
counter and one structured log line."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid

from fastapi import FastAPI

from pckernels.server.errors import error_response
from pckernels.server.protocol import APIError
from pckernels.server.state import ServerState

access_log = logging.getLogger("pckernels.server.access")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_ROUTES = ("/v1/chat/completions/render", "/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/schemas", "/tokenize", "/detokenize", "/metrics",
           "/health", "/ready")


class AccessLog:
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
                await error_response(error)(scope, receive, send_with_id)
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
