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

from pckernels.cli_common import MODEL_HELP, PLACEMENT_HELP, console, engine_settings, fail, load_engine

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


def start_kv_events(config):
    """The KV-event publisher of ``--kv-events-config`` (``None`` when off), its sockets bound before
    the model loads: an endpoint in use ends the command with one line and exit status 2."""
    from pckernels.store.events import start_publisher

    if config is None or not config.active:
        return None
    try:
        return start_publisher(config)
    except OSError as exc:
        fail(exc)


def serve(model: str = typer.Option("smollm2", help=MODEL_HELP),
          host: str = typer.Option("127.0.0.1", help="Address to bind; anything but loopback needs --api-keys."),
          port: int = typer.Option(8000, help="TCP port."),
          schemas: Optional[Path] = typer.Option(None, help="Folder of PML schemas (*.xml, *.pml) to load as shared "
                                                            "schemas at start."),
          api_keys: Optional[Path] = typer.Option(None, help='JSON file {"KEY": "tenant" | {"tenant": ..., '
                                                             '"admin": true}}; without it: one open tenant.'),
          store_dir: Optional[Path] = typer.Option(None, help="Disk tier directory (default: "
                                                              "$PROMPTCACHE_CACHE_DIR/kv or the XDG cache dir)."),
          memory_only: bool = typer.Option(False, help="No disk tier: blocks live in memory only."),
          device_budget: Optional[str] = typer.Option(None, help="Device tier budget, e.g. 2GiB."),
          host_budget: Optional[str] = typer.Option(None, help="Host tier budget."),
          disk_budget: Optional[str] = typer.Option(None, help="Disk tier budget."),
          kv_budget: Optional[str] = typer.Option(None, help="KV arena budget of running requests."),
          remote: Optional[str] = typer.Option(None, help="Redis/Valkey URL (redis://host:port/db) of a tier shared "
                                                          "by a fleet of servers; a cluster: any node's URL, or "
                                                          "redis+cluster://host:port[,host:port...]."),
          remote_namespace: str = typer.Option("promptcache", help="Key prefix in the --remote server."),
          max_queue: int = typer.Option(256, help="Requests that may wait; more get 429."),
          max_batch: int = typer.Option(64, help="Requests decoded together."),
          step_tokens: int = typer.Option(2048, help="Prompt tokens a scheduler step reads at most, across every "
                                                     "prompt being read (oldest first); lower: shorter gaps "
                                                     "between a stream's tokens while long prompts are read."),
          request_timeout: float = typer.Option(600.0, min=0.0, help="Default deadline of a request in seconds "
                                                                     "(0: none)."),
          max_tokens: int = typer.Option(512, min=1, help="Tokens a chat request may generate when it says none."),
          served_model_name: Optional[str] = typer.Option(None, help="The model id clients send (default: the "
                                                                     "model's name)."),
          device: Optional[str] = typer.Option(None, help="cpu, cuda, … (default: best available)."),
          dtype: Optional[str] = typer.Option(None, help="float32, bfloat16, float16."),
          matmul: str = typer.Option("fp32", help="CPU matmul precision: fp32, or bf16 (oneDNN over packed bf16 "
                                                 "weights; faster, changes numerics: docs/perf.md)."),
          prefix_block: int = typer.Option(256, help="Tokens per block of plain prompts' exact prefix reuse."),
          prefix_chunk: Optional[int] = typer.Option(None, help="Tokens per forward when a plain prompt is read, a "
                                                                "multiple of --prefix-block (default: the block; "
                                                                "with --prefix-resume token, >= 256)."),
          prefix_budget: Optional[str] = typer.Option(None, help="Bytes of prefix blocks kept in memory before the "
                                                                 "least recently used spill to the store's tiers "
                                                                 "(default 1GiB)."),
          prefix_resume: str = typer.Option("block", help="Where a plain prompt's hit resumes: block (bitwise "
                                                          "equal to no reuse) or token (from the first new token; "
                                                          "equal to rounding; attention-only models)."),
          lookahead: int = typer.Option(0, help="Draft tokens a greedy request's decode step verifies besides "
                                                       "its own (prompt lookup from its context; 0: none)."),
          placement: str = typer.Option("compact", help=PLACEMENT_HELP),
          allow_no_reuse: bool = typer.Option(False, help="Serve even when the model fails the prefix cache's "
                                                          "self-check (every prompt then computed in full)."),
          tool_call_parser: str = typer.Option("auto", help="Tool-call format parsed from answers: hermes, "
                                                            "llama3_json, mistral, pythonic, or auto (the one "
                                                            "the chat template teaches)."),
          responses_max: int = typer.Option(1000, help="Stored responses (/v1/responses, store: true) kept per "
                                                       "tenant; the oldest go first."),
          responses_ttl: float = typer.Option(3600.0, help="Seconds a stored response is kept."),
          kv_events_config: Optional[str] = typer.Option(None, help='KV events in vLLM\'s format, as vLLM\'s JSON: '
                                                                    '\'{"enable_kv_cache_events": true, "publisher": '
                                                                    '"zmq", "endpoint": "tcp://*:5557", '
                                                                    '"replay_endpoint": "tcp://*:5558"}\' '
                                                                    '(docs/kv-events.md; absent: off).'),
          log_level: str = typer.Option("info", help="debug, info, warning, error.")) -> None:
    """Serve the OpenAI API (chat, completions, models) plus PML schemas, tenants and /metrics."""
    import uvicorn

    from pckernels.errors import PMLError
    from pckernels.server import Tenants, create_app, load_keys, server_secret
    from pckernels.server.tenants import SECRET_ENV
    from pckernels.server.tool_parsers import PARSERS

    if tool_call_parser not in ("auto", *PARSERS):
        fail(f"--tool-call-parser must be auto or one of {', '.join(PARSERS)}, got {tool_call_parser!r}")
    from pckernels.store import default_store_dir

    level = getattr(logging, log_level.upper(), None)
    if not isinstance(level, int):
        fail(f"unknown --log-level {log_level!r}: expected debug, info, warning or error")
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
    store = False if memory_only else (store_dir or default_store_dir())
    config = engine_settings(model, device=device, dtype=dtype, matmul=matmul, store_dir=store,
                             device_budget=device_budget, host_budget=host_budget, disk_budget=disk_budget,
                             remote=remote, remote_namespace=remote_namespace, kv_budget=kv_budget,
                             max_queue=max_queue, max_batch=max_batch, step_tokens=step_tokens, lookahead=lookahead,
                             prefix_block_size=prefix_block, prefix_chunk=prefix_chunk,
                             prefix_budget=prefix_budget,
                             prefix_resume=prefix_resume, placement=placement,
                             kv_events=kv_events_config)
    publisher = start_kv_events(config.kv_events)
    if publisher is not None:
        config = config.replace(kv_events=publisher)
    if remote is not None and keys and not os.environ.get(SECRET_ENV):
        log.warning("--remote with --api-keys but no $%s: each server derives its own tenant salts, so "
                    "tenants' blocks are not shared across the fleet; give every server the same secret",
                    SECRET_ENV)
    tenants = Tenants(keys, server_secret(None if store is False else store))
    try:
        engine = load_engine(model, config)
    except BaseException:
        if publisher is not None:
            publisher.close()
        raise
    refusal = engine.prefix.refusal
    if refusal is not None and not allow_no_reuse:
        engine.close()
        fail(f"exact prefix reuse fails its self-check on this model ({refusal}); "
             "serve it anyway with --allow-no-reuse (prompts computed in full)")
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
    logging.getLogger("pckernels").setLevel(level)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("pckernels").addHandler(handler)
    logging.getLogger("pckernels").propagate = False
    tenants_note = f"{len(tenants.names)} tenants" if keys else "open (one tenant, loopback only)"
    console.print(f"promptcache: serving {escape(str(model))} as {escape(app.server.model_name)!r} on "
                  f"http://{escape(host)}:{port} — {tenants_note}", highlight=False)
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower(), timeout_graceful_shutdown=30,
                access_log=False)
