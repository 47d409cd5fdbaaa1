"""``promptcache serve``: the OpenAI-compatible server (``pckernels.server``) under uvicorn."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from pckernels import cli_engine as opts
from pckernels.cli_common import console, fail

log = logging.getLogger(__name__)

_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) only listens on this machine."""
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def serve(model: str = opts.MODEL,
          host: str = typer.Option("127.0.0.1", help="Address to bind; anything but loopback needs --api-keys."),
          port: int = typer.Option(8000, help="TCP port."),
          schemas: Optional[Path] = typer.Option(None, help="Folder of PML schemas (*.xml, *.pml) to load as shared "
                                                            "schemas at start."),
          api_keys: Optional[Path] = typer.Option(None, help='JSON file {"KEY": "tenant" | {"tenant": ..., '
                                                             '"admin": true}}; without it: one open tenant.'),
          store_dir: Optional[Path] = opts.STORE_DIR,
          memory_only: bool = opts.MEMORY_ONLY,
          device_budget: Optional[str] = opts.DEVICE_BUDGET,
          host_budget: Optional[str] = opts.HOST_BUDGET,
          disk_budget: Optional[str] = opts.DISK_BUDGET,
          kv_budget: Optional[str] = opts.KV_BUDGET,
          remote: Optional[str] = opts.REMOTE,
          remote_namespace: str = opts.REMOTE_NAMESPACE,
          max_queue: int = opts.MAX_QUEUE,
          max_batch: int = opts.MAX_BATCH,
          step_tokens: int = opts.STEP_TOKENS,
          request_timeout: float = typer.Option(600.0, min=0.0, help="Default deadline of a request in seconds "
                                                                     "(0: none)."),
          max_tokens: int = typer.Option(512, min=1, help="Tokens a chat request may generate when it says none."),
          served_model_name: Optional[str] = typer.Option(None, help="The model id clients send (default: the "
                                                                     "model's name)."),
          device: Optional[str] = opts.DEVICE,
          dtype: Optional[str] = opts.DTYPE,
          matmul: str = opts.MATMUL,
          prefix_block: int = opts.PREFIX_BLOCK,
          prefix_chunk: Optional[int] = opts.PREFIX_CHUNK,
          prefix_budget: Optional[str] = opts.PREFIX_BUDGET,
          prefix_resume: str = opts.PREFIX_RESUME,
          lookahead: int = opts.LOOKAHEAD,
          placement: str = opts.PLACEMENT,
          allow_no_reuse: bool = opts.ALLOW_NO_REUSE,
          tool_call_parser: str = typer.Option("auto", help="Tool-call format parsed from answers: hermes, "
                                                            "llama3_json, mistral, pythonic, or auto (the one "
                                                            "the chat template teaches)."),
          responses_max: int = typer.Option(1000, help="Stored responses (/v1/responses, store: true) kept per "
                                                       "tenant; the oldest go first."),
          responses_ttl: float = typer.Option(3600.0, help="Seconds a stored response is kept."),
          kv_events_config: Optional[str] = opts.KV_EVENTS_CONFIG,
          log_level: str = opts.LOG_LEVEL) -> None:
    """Serve the OpenAI API (chat, completions, models) plus PML schemas, tenants and /metrics."""
    import uvicorn

    from pckernels.errors import PMLError
    from pckernels.server import Tenants, create_app, load_keys, server_secret
    from pckernels.server.tenants import SECRET_ENV
    from pckernels.server.tool_parsers import PARSERS

    if tool_call_parser not in ("auto", *PARSERS):
        fail(f"--tool-call-parser must be auto or one of {', '.join(PARSERS)}, got {tool_call_parser!r}")
    level = opts.log_level(log_level)
    keys = None
    if api_keys is not None:
        try:
            keys = load_keys(api_keys)
        except ValueError as exc:
            fail(exc)
    elif not is_loopback(host):
        fail(f"--host {host} is reachable from other machines: give --api-keys, or bind 127.0.0.1")
    if schemas is not None and not schemas.is_dir():
        fail(f"--schemas {str(schemas)!r} is not a folder")
    config = opts.serving_config(model, locals())
    if remote is not None and keys and not os.environ.get(SECRET_ENV):
        log.warning("--remote with --api-keys but no $%s: each server derives its own tenant salts, so "
                    "tenants' blocks are not shared across the fleet; give every server the same secret",
                    SECRET_ENV)
    tenants = Tenants(keys, server_secret(None if config.store_dir is False else config.store_dir))
    engine = opts.load_serving_engine(model, config, allow_no_reuse)
    try:
        app = create_app(engine, tenants=tenants, model_name=served_model_name or model, schemas_dir=schemas,
                         request_timeout=request_timeout or None, default_max_tokens=max_tokens,
                         tool_call_parser=tool_call_parser,
                         responses_max=responses_max, responses_ttl_s=responses_ttl)
    except (PMLError, OSError) as exc:
        engine.close()
        fail(f"cannot load the schemas: {exc}")
    except ValueError as exc:
        engine.close()
        fail(exc)
    opts.log_to_stderr(level)
    tenants_note = f"{len(tenants.names)} tenants" if keys else "open (one tenant, loopback only)"
    console.print(f"promptcache: serving {escape(str(model))} as {escape(app.server.model_name)!r} on "
                  f"http://{escape(host)}:{port} — {tenants_note}", highlight=False)
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower(), timeout_graceful_shutdown=30,
                access_log=False)
