"""The HTTP routes: health and readiness, metrics, models, completions, responses and schemas."""

from __future__ import annotations

import asyncio

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pckernels.errors import PMLError
from pckernels.server.errors import no_schema, pml_error, validation_message
from pckernels.server.generation import generate, render_ids
from pckernels.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       SchemaUpload, TokenizeRequest)
from pckernels.server.responses import ResponsesRequest, create_response, stored_response
from pckernels.server.schemas import ENCODING, FAILED
from pckernels.server.state import ServerState
from pckernels.server.tenants import Tenant


def add_routes(app: FastAPI, state: ServerState) -> None:
    """The routes of ``app``, serving ``state``; every ``/v1`` route authenticates its tenant."""

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
        state.check_model(model_id)
        return _model_card(state)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request, who: Tenant = Depends(tenant)):
        return await generate(state, request, body, who, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, who: Tenant = Depends(tenant)):
        return await generate(state, request, body, who, chat=False)

    @app.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest, _: Tenant = Depends(tenant)):
        """vLLM's render endpoint: the prompt token ids a chat body would be read as, generating
        nothing (what ``vllm-router``'s ``kv_aware`` policy asks each worker before it scores)."""
        body.check_supported()
        state.check_model(body.model)
        if body.pml is not None or not body.messages:
            raise APIError(400, "render takes chat messages (not a PML prompt)", param="messages")
        ids = await asyncio.to_thread(render_ids, state.engine.tokenizer, body)
        return {"model": state.model_name, "token_ids": ids, "features": None}

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request, who: Tenant = Depends(tenant)):
        return await create_response(state, request, body, who)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, who: Tenant = Depends(tenant)):
        return stored_response(state, response_id, who)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, _: Tenant = Depends(tenant)):
        if body.model is not None:
            state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        tokenizer = state.engine.tokenizer
        try:
            if body.prompt is not None:
                ids = tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
            else:
                messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                            for m in body.messages]
                text = await asyncio.to_thread(tokenizer.apply_chat_template, messages, tokenize=False,
                                               add_generation_prompt=body.add_generation_prompt)
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        except APIError:
            raise
        except Exception as exc:  # the tokenizer's or the template's own refusal
            raise APIError(400, f"cannot tokenize: {exc}", param="messages" if body.messages else "prompt") from None
        return {"tokens": list(ids), "count": len(ids), "max_model_len": state.engine.max_positions}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, _: Tenant = Depends(tenant)):
        if body.model is not None:
            state.check_model(body.model)
        tokenizer = state.engine.tokenizer
        bad = [t for t in body.tokens if not 0 <= t < len(tokenizer)]
        if bad:
            raise APIError(400, f"token ids out of the vocabulary (0 to {len(tokenizer) - 1}): {bad[:5]}",
                           param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

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
            raise pml_error(exc, "pml") from None
        return JSONResponse(record.to_dict(), status_code=202 if new else 200,
                            headers={"Location": f"/v1/schemas/{record.name}"})

    @app.get("/v1/schemas")
    async def list_schemas(who: Tenant = Depends(tenant)):
        return {"object": "list", "data": [r.to_dict() for r in state.registry.visible(who.salt)]}

    @app.get("/v1/schemas/{name}")
    async def get_schema(name: str, who: Tenant = Depends(tenant)):
        record = state.registry.get(name, who.salt)
        if record is None:
            raise no_schema(name)
        return record.to_dict()

    @app.delete("/v1/schemas/{name}")
    async def delete_schema(name: str, who: Tenant = Depends(tenant)):
        record = state.registry.get(name, who.salt)
        if record is None:
            raise no_schema(name)
        if record.salt != who.salt and not who.admin:
            raise APIError(403, f"schema {name!r} is shared; only an admin key may delete it",
                           type="permission_error", code="permission_denied")
        if record.status == ENCODING:
            raise APIError(409, f"schema {name!r} is still encoding; delete it once it is ready",
                           code="schema_encoding", headers={"Retry-After": "1"})
        await asyncio.to_thread(state.registry.delete, name, record.salt)
        return {"id": name, "object": "schema", "deleted": True}


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "promptcache",
            "max_model_len": state.engine.max_positions}


async def _schema_upload(request: Request) -> SchemaUpload:
    """A schema upload: JSON (``{"pml": ..., "shared": ...}``) or the PML text itself (``?shared=``)."""
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
        raise APIError(400, validation_message(exc.errors()), param="pml") from None
