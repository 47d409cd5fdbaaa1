"""The engine options every serving command takes (``serve``, ``dynamo-worker``): one definition of
each flag, the :class:`~pckernels.engine.config.EngineConfig` they make, the KV-event publisher
started before the model loads, and the model loaded with its prefix-reuse self-check."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import typer

from pckernels.cli_common import MODEL_HELP, PLACEMENT_HELP, engine_settings, fail, load_engine

if TYPE_CHECKING:
    from pckernels.engine.config import EngineConfig

MODEL = typer.Option("smollm2", help=MODEL_HELP)
STORE_DIR = typer.Option(None, help="Disk tier directory (default: $PROMPTCACHE_CACHE_DIR/kv or the XDG cache dir).")
MEMORY_ONLY = typer.Option(False, help="No disk tier: blocks live in memory only.")
DEVICE_BUDGET = typer.Option(None, help="Device tier budget, e.g. 2GiB.")
HOST_BUDGET = typer.Option(None, help="Host tier budget.")
DISK_BUDGET = typer.Option(None, help="Disk tier budget.")
KV_BUDGET = typer.Option(None, help="KV arena budget of running requests.")
REMOTE = typer.Option(None, help="Redis/Valkey URL (redis://host:port/db) of a tier shared by a fleet of servers; "
                                 "a cluster: any node's URL, or redis+cluster://host:port[,host:port...].")
REMOTE_NAMESPACE = typer.Option("promptcache", help="Key prefix in the --remote server.")
MAX_QUEUE = typer.Option(256, help="Requests that may wait; more get 429.")
MAX_BATCH = typer.Option(64, help="Requests decoded together.")
STEP_TOKENS = typer.Option(2048, help="Prompt tokens a scheduler step reads at most, across every prompt being "
                                      "read (oldest first); lower: shorter gaps between a stream's tokens while "
                                      "long prompts are read.")
DEVICE = typer.Option(None, help="cpu, cuda, … (default: best available).")
DTYPE = typer.Option(None, help="float32, bfloat16, float16.")
MATMUL = typer.Option("fp32", help="CPU matmul precision: fp32, or bf16 (oneDNN over packed bf16 weights; faster, "
                                   "changes numerics: docs/perf.md).")
PREFIX_BLOCK = typer.Option(256, help="Tokens per block of plain prompts' exact prefix reuse.")
PREFIX_CHUNK = typer.Option(None, help="Tokens per forward when a plain prompt is read, a multiple of "
                                       "--prefix-block (default: the block; with --prefix-resume token, >= 256).")
PREFIX_BUDGET = typer.Option(None, help="Bytes of prefix blocks kept in memory before the least recently used "
                                        "spill to the store's tiers (default 1GiB).")
PREFIX_RESUME = typer.Option("block", help="Where a plain prompt's hit resumes: block (bitwise equal to no reuse) "
                                           "or token (from the first new token; equal to rounding; attention-only "
                                           "models).")
LOOKAHEAD = typer.Option(0, help="Draft tokens a greedy request's decode step verifies besides its own (prompt "
                                 "lookup from its context; 0: none).")
PLACEMENT = typer.Option("compact", help=PLACEMENT_HELP)
ALLOW_NO_REUSE = typer.Option(False, help="Serve even when the model fails the prefix cache's self-check (every "
                                          "prompt then computed in full).")
KV_EVENTS_CONFIG = typer.Option(None, help='KV events in vLLM\'s format, as vLLM\'s JSON: \'{"enable_kv_cache_events": '
                                           'true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": '
                                           '"tcp://*:5558"}\' (docs/kv-events.md; absent: off).')
LOG_LEVEL = typer.Option("info", help="debug, info, warning, error.")


ENGINE_FLAGS = {"device": "device", "dtype": "dtype", "matmul": "matmul", "device_budget": "device_budget",
                "host_budget": "host_budget", "disk_budget": "disk_budget", "kv_budget": "kv_budget",
                "remote": "remote", "remote_namespace": "remote_namespace", "max_queue": "max_queue",
                "max_batch": "max_batch", "step_tokens": "step_tokens", "lookahead": "lookahead",
                "prefix_block": "prefix_block_size", "prefix_chunk": "prefix_chunk", "prefix_budget": "prefix_budget",
                "prefix_resume": "prefix_resume", "placement": "placement", "kv_events_config": "kv_events"}
"""A command's parameter name -> the :class:`EngineConfig` field it sets."""


def serving_config(model: str, given: dict) -> "EngineConfig":
    """The checked :class:`EngineConfig` of a serving command's parameters ``given`` (its
    ``locals()``: the :data:`ENGINE_FLAGS` it has, the store at ``store_dir`` or none with
    ``memory_only``), with its KV-event publisher started: a bad option, or an event endpoint in
    use, ends the command with one line and exit status 2."""
    from pckernels.store import default_store_dir

    store = False if given.get("memory_only") else (given.get("store_dir") or default_store_dir())
    options = {field: given[name] for name, field in ENGINE_FLAGS.items() if name in given}
    config = engine_settings(model, store_dir=store, **options)
    publisher = start_kv_events(config.kv_events)
    return config if publisher is None else config.replace(kv_events=publisher)


def start_kv_events(config):
    """The KV-event publisher of ``--kv-events-config`` (``None`` when off), its sockets bound before
    the model loads: an endpoint in use ends the command with one line and exit status 2."""
    from pckernels.store.events import start_publisher

    if config is None or not getattr(config, "active", False):
        return None
    try:
        return start_publisher(config)
    except OSError as exc:
        fail(exc)


def load_serving_engine(model: str, config: "EngineConfig", allow_no_reuse: bool):
    """The engine of ``config``, refused (one line, exit status 2) when exact prefix reuse fails its
    self-check on the model and ``allow_no_reuse`` is not given; the event publisher is closed when
    loading fails."""
    publisher = config.kv_events if hasattr(config.kv_events, "close") else None
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
    return engine


def log_level(name: str) -> int:
    """``--log-level`` as a ``logging`` level; an unknown name ends the command (exit status 2)."""
    level = getattr(logging, name.upper(), None)
    if not isinstance(level, int):
        fail(f"unknown --log-level {name!r}: expected debug, info, warning or error")
    return level


def log_to_stderr(level: int) -> None:
    """The package's log records at ``level`` and above to stderr, timestamped, not passed to the root."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    package = logging.getLogger("pckernels")
    package.setLevel(level)
    package.addHandler(handler)
    package.propagate = False
