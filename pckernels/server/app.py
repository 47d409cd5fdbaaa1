"""The OpenAI-compatible HTTP API over one engine (FastAPI): ``create_app`` puts it together.

``create_app(engine, ...)`` returns the ASGI app ``promptcache serve`` runs with uvicorn. A
request is authenticated (its tenant gives the cache salt), parsed and planned in a worker
thread (bad input raises there and changes nothing), submitted to the engine's scheduler, and
awaited without a thread: the scheduler wakes the event loop after each token. Plain prompts
(``messages`` / ``prompt``) get exact prefix reuse; PML prompts (the ``pml`` field) import the
tenant's and the shared schemas' modules. See ``docs/server.md``.

The parts: ``routes.py`` (the routes), ``generation.py`` (a request to the engine and back, streamed
or whole), ``replies.py`` (OpenAI response bodies), ``errors.py`` (errors as OpenAI answers),
``access.py`` (request ids, body limit, access log), ``state.py`` (what they share),
``engine.py`` (what the server uses of its engine).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from pckernels.server.access import AccessLog
from pckernels.server.engine import ServingEngine
from pckernels.server.errors import install_errors
from pckernels.server.metrics import ServerMetrics
from pckernels.server.response_store import DEFAULT_MAX, DEFAULT_TTL_S, ResponseStore
from pckernels.server.routes import add_routes
from pckernels.server.schemas import SchemaRegistry
from pckernels.server.tool_parsers import pick_parser
from pckernels.server.state import ServerState
from pckernels.server.tenants import Tenants, server_secret

log = logging.getLogger("pckernels.server")

SCHEMA_SUFFIXES = (".xml", ".pml")


def create_app(engine: ServingEngine, *, tenants: Tenants | None = None, model_name: str | None = None,
               schemas_dir: str | Path | None = None, request_timeout: float | None = 600.0,
               default_max_tokens: int = 512, max_body_bytes: int = 32 << 20, close_engine: bool = True,
               tool_call_parser: str = "auto", responses_max: int = DEFAULT_MAX,
               responses_ttl_s: float = DEFAULT_TTL_S) -> FastAPI:
    """The app serving ``engine``. ``tenants``: API keys (None: one open tenant, no salt);
    ``schemas_dir``: PML files (``*.xml``, ``*.pml``) parsed now (``PMLError`` naming the file on
    bad input) and encoded in the background as shared schemas, ``/ready`` says when;
    ``request_timeout``: the default deadline of a generation in seconds; ``default_max_tokens``:
    for chat requests that give none; ``close_engine``: close it when the app shuts down;
    ``tool_call_parser``: the tool-call format answers are parsed in (``auto``: the chat template's);
    ``responses_max``, ``responses_ttl_s``: stored responses kept per tenant, and for how long."""
    state = ServerState(engine, tenants or Tenants(None, server_secret()), SchemaRegistry(engine),
                        ServerMetrics(engine), model_name or str(engine.name), request_timeout, default_max_tokens,
                        tool_parser=pick_parser(tool_call_parser, engine.tokenizer),
                        responses=ResponseStore(responses_max, responses_ttl_s))
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
    install_errors(app)
    add_routes(app, state)
    return AccessLog(app, state, max_body_bytes)
