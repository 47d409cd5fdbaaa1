"""``promptcache dynamo-worker``: the engine as an NVIDIA Dynamo worker (``pckernels.server.dynamo_worker``)
behind ``python -m dynamo.frontend`` — Dynamo's KV router reads its KV events."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import tempfile
from pathlib import Path
from typing import Optional

import typer

from pckernels import cli_engine as opts
from pckernels.cli_common import fail, option_message
from pckernels.errors import OptionError

log = logging.getLogger(__name__)

DYNAMO_MISSING = ("promptcache dynamo-worker needs NVIDIA Dynamo in this Python: pip install ai-dynamo "
                  "ai-dynamo-runtime (docs/fleet.md, \"Dynamo's KV router\")")


def relay_endpoint(config) -> str:
    """Where Dynamo's relay connects to the engine's KV-event publisher of ``config`` (a
    :class:`~pckernels.store.events.KVEventsConfig`): its ``ipc://`` path, or its wildcard TCP
    port on loopback. An endpoint the engine would connect to (not bind) is refused (``OptionError``)."""
    from pckernels.store.events.publisher import binds

    endpoint = config.endpoint
    if binds(endpoint) and endpoint.startswith("ipc://"):
        return endpoint
    if binds(endpoint) and endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        return f"tcp://127.0.0.1:{port}" if host == "*" else f"tcp://[::1]:{port}"
    raise OptionError("kv_events", endpoint, "an endpoint the worker binds (ipc://PATH or tcp://*:PORT) for "
                      "Dynamo's relay to connect to", message=f"endpoint {endpoint!r} is connected to, not bound: "
                      "Dynamo's relay needs one the worker binds (ipc://PATH or tcp://*:PORT)")


def dynamo_worker(model: str = opts.MODEL,
                  endpoint: str = typer.Option("dyn://dynamo.backend.generate", envvar="DYN_ENDPOINT",
                                               help="Dynamo endpoint, dyn://namespace.component.endpoint."),
                  served_model_name: Optional[str] = typer.Option(None, help="The model id the frontend serves "
                                                                             "(default: the model's name)."),
                  discovery_backend: str = typer.Option("etcd", envvar="DYN_DISCOVERY_BACKEND",
                                                        help="Dynamo discovery: etcd, file, mem or kubernetes."),
                  request_plane: str = typer.Option("tcp", envvar="DYN_REQUEST_PLANE", help="tcp or nats."),
                  event_plane: Optional[str] = typer.Option(None, envvar="DYN_EVENT_PLANE",
                                                            help="zmq or nats (default: Dynamo's choice for the "
                                                                 "discovery backend)."),
                  max_tokens: int = typer.Option(512, min=1, help="Tokens a request may generate when it says none."),
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
                  device: Optional[str] = opts.DEVICE,
                  dtype: Optional[str] = opts.DTYPE,
                  matmul: str = opts.MATMUL,
                  prefix_block: int = typer.Option(16, help="Tokens per block of exact prefix reuse: the block "
                                                            "size Dynamo's router hashes (vLLM's default, 16)."),
                  prefix_chunk: Optional[int] = opts.PREFIX_CHUNK,
                  prefix_budget: Optional[str] = opts.PREFIX_BUDGET,
                  prefix_resume: str = opts.PREFIX_RESUME,
                  lookahead: int = opts.LOOKAHEAD,
                  allow_no_reuse: bool = opts.ALLOW_NO_REUSE,
                  kv_events_config: Optional[str] = typer.Option(
                      None, help="The engine's KV-event publisher as vLLM's JSON (docs/kv-events.md); its endpoint "
                                 "must be one the worker binds (ipc://PATH or tcp://*:PORT), Dynamo's relay "
                                 "connects to it. Default: an ipc:// socket in a private folder."),
                  log_level: str = opts.LOG_LEVEL) -> None:
    """Serve the engine as an NVIDIA Dynamo worker (token in, tokens out) with its KV events relayed to
    Dynamo's KV router; clients talk to `python -m dynamo.frontend` (docs/fleet.md)."""
    from pckernels.server.dynamo_worker import DynamoSettings
    from pckernels.store.events import kv_events_config as parse_events

    level = opts.log_level(log_level)
    try:
        settings = DynamoSettings(endpoint=endpoint, model_name=served_model_name,
                                  discovery_backend=discovery_backend, request_plane=request_plane,
                                  event_plane=event_plane)
    except OptionError as exc:
        fail(option_message(exc))
    if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo._core") is None:
        fail(DYNAMO_MISSING)
    with tempfile.TemporaryDirectory(prefix="promptcache-dynamo-") as private:  # events socket, model card
        if kv_events_config is None:
            kv_events_config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                           "endpoint": f"ipc://{private}/events",
                                           "replay_endpoint": f"ipc://{private}/replay"})
        try:
            events = parse_events(kv_events_config)
            relay = relay_endpoint(events) if events is not None and events.active else None
        except OptionError as exc:
            fail(option_message(exc))
        config = opts.serving_config(model, locals())
        engine = opts.load_serving_engine(model, config, allow_no_reuse)
        opts.log_to_stderr(level)
        try:
            run_worker(engine, settings, model=model, events_endpoint=relay, work_dir=Path(private),
                       max_tokens=max_tokens)
        finally:
            engine.close()


def run_worker(engine, settings, *, model: str, events_endpoint: str | None, work_dir: Path, max_tokens: int,
               observe=None) -> None:
    """Serve ``engine`` with Dynamo on a fresh event loop (uvloop when installed, as Dynamo's workers)
    until the process is stopped."""
    from pckernels.server.dynamo_worker import DynamoHandler, serve

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    handler = DynamoHandler(engine, default_max_tokens=max_tokens, observe=observe)
    try:
        asyncio.run(serve(engine, settings, model=model, events_endpoint=events_endpoint, work_dir=work_dir,
                          handler=handler))
    except KeyboardInterrupt:
        log.info("stopped")

