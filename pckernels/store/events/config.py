"""``KVEventsConfig``: vLLM's ``--kv-events-config`` fields, checked in one place.

The fields, their names and defaults are vLLM's (``vllm/config/kv_events.py``), so a fleet's
launch scripts pass the same JSON to promptcache and to vLLM. A bad value is an
:class:`~pckernels.errors.OptionError` that names the field, raised before anything is bound.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pckernels.errors import OptionError

PUBLISHERS = ("null", "zmq")
OPTION = "kv_events"
"""The engine option (``EngineConfig.kv_events``; ``promptcache serve --kv-events-config``)."""

_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """How KV events are published (vLLM's ``KVEventsConfig``; ``docs/kv-events.md``).

    ``enable_kv_cache_events``: publish at all. ``publisher``: ``"zmq"`` or ``"null"`` (nothing is
    bound or sent); ``None`` means ``"zmq"`` when enabled. ``endpoint``: the PUB socket (bound when
    it holds ``*``, ``::`` or is ``ipc://``/``inproc://``, connected otherwise, as vLLM does).
    ``replay_endpoint``: a ROUTER socket answering replay requests (``None``: no replay).
    ``buffer_steps``: published batches kept for replay. ``hwm``: the PUB socket's high-water mark
    (messages queued per subscriber before ZeroMQ drops for that subscriber). ``max_queue_size``:
    events waiting for the publisher thread before new ones are dropped (counted; the next batch
    then starts with ``AllBlocksCleared`` and re-announces every held block). ``topic``: the first
    frame of every message (subscribers filter on its prefix).
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise _bad("enable_kv_cache_events", self.enable_kv_cache_events, "true or false")
        publisher = self.publisher
        if publisher is None:
            publisher = "zmq" if self.enable_kv_cache_events else "null"
        if publisher not in PUBLISHERS:
            raise _bad("publisher", publisher, "one of " + ", ".join(map(repr, PUBLISHERS)))
        object.__setattr__(self, "publisher", publisher)
        _endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _endpoint("replay_endpoint", self.replay_endpoint)
            if self.replay_endpoint == self.endpoint:
                raise _bad("replay_endpoint", self.replay_endpoint, "another endpoint than endpoint")
        for name, least in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise _bad(name, value, f"an integer >= {least}")
        if not isinstance(self.topic, str):
            raise _bad("topic", self.topic, "a string")

    @property
    def active(self) -> bool:
        """Whether events are published (enabled, with the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


FIELDS = tuple(f.name for f in dataclasses.fields(KVEventsConfig))


def kv_events_config(value: KVEventsConfig | Mapping[str, Any] | str | None) -> KVEventsConfig | None:
    """A :class:`KVEventsConfig` from itself, a mapping of its fields or their JSON text (what
    ``--kv-events-config`` takes); ``None`` stays ``None`` (off). Malformed JSON, an unknown field
    or a bad value is an :class:`~pckernels.errors.OptionError` naming it."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise OptionError(OPTION, value, "a JSON object",
                              message=f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if not isinstance(value, Mapping):
        raise OptionError(OPTION, value, "a JSON object", message=f"must be a JSON object of {', '.join(FIELDS)}, "
                                                                  f"got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in FIELDS)
    if unknown:
        raise OptionError(OPTION, value, "known fields",
                          message=f"unknown field {unknown[0]!r}: the fields are {', '.join(FIELDS)}")
    return KVEventsConfig(**value)


def _bad(name: str, value: Any, expected: str) -> OptionError:
    return OptionError(OPTION, value, expected, message=f"field {name!r} must be {expected}, got {value!r}")


def _endpoint(name: str, value: Any) -> None:
    if not isinstance(value, str) or not value.startswith(_SCHEMES) or len(value) <= len("tcp://"):
        raise _bad(name, value, "a ZeroMQ endpoint (tcp://*:5557, tcp://host:port, ipc://path)")
    if value.startswith("tcp://"):
        host, _, port = value[len("tcp://"):].rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise _bad(name, value, "a ZeroMQ endpoint with a port (tcp://*:5557, tcp://host:port)")
