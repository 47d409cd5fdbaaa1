"""One engine's settings as a typed object, checked in one place before any model is loaded.

:class:`EngineConfig` holds everything :class:`~pckernels.engine.PromptCache` and its
``from_pretrained`` take besides the model itself: device and dtype, the CPU matmul, the block
store's tiers, the scheduler's limits, the prefix cache's blocks and the default placement. Making
one checks every field (``__post_init__``) and raises :class:`~pckernels.errors.OptionError`
naming the field, so a library caller, the command line (``--max-queue 0``) and the server's
start all refuse bad settings before a model is touched. The engine's keyword arguments stay
as a convenience: they build an ``EngineConfig`` (:func:`engine_config`).

What depends on the model is checked once it is loaded: ``matmul="bf16"`` or
``prefix_resume="token"`` on a model with recurrent layers.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pckernels.engine.graphs import StepGraphs
from pckernels.engine.options import resolve_device, resolve_dtype
from pckernels.errors import OptionError
from pckernels.typed import typed_options
from pckernels.integration.native import MATMULS, bf16_matmul_supported
from pckernels.integration.row_attention import ATTENTION_BACKENDS
from pckernels.kernels._common import triton_runnable
from pckernels.pml.placement import PLACEMENTS
from pckernels.prefix.cache import RESUME
from pckernels.store import RemoteTier, parse_remote_url
from pckernels.store.events import KVEventsConfig, kv_events_config
from pckernels.store.remote import DEFAULT_NAMESPACE
from pckernels.store.tiered import parse_size

DEFAULT_PREFIX_BLOCK = 256
"""Tokens per block of the engine's exact prefix reuse (``prefix_block_size``)."""

TOKEN_RESUME_CHUNK = 256
"""Tokens a ``prefix_resume="token"`` engine reads a plain prompt in per forward by default (the
smallest multiple of the block at least this): with 16-token blocks a 2-core CPU reads a cold
231-token prompt in 0.77 s in one forward against 2.0 s in 16-token forwards (SmolLM2, one thread)."""


def default_prefix_chunk(block: int, resume: str) -> int:
    """``prefix_chunk`` when none is given: the block (``"block"`` resumption: a hit may resume at
    every block, bitwise), or the smallest multiple of the block >= :data:`TOKEN_RESUME_CHUNK`
    (``"token"``: hits resume anywhere, so the chunk need not be the block)."""
    if resume == "token":
        return -(-TOKEN_RESUME_CHUNK // block) * block
    return block


@dataclass(frozen=True)
class EngineConfig:
    """An engine's settings (``docs/engine.md``); every field is checked when it is made.

    The model: ``device`` (``None``: the model's own in ``PromptCache(...)``, the best available
    in ``from_pretrained``), ``dtype`` (``None``: the model's / float32 on CPU, bf16 or fp16 on
    CUDA), ``matmul`` (``"fp32"``, or ``"bf16"``: oneDNN bf16 projections where the CPU has them).

    The block store (``docs/store.md``): ``store_dir`` (``True``: ``default_store_dir()``;
    ``False``: none; ``None``: none in ``PromptCache(...)``, the default directory in
    ``from_pretrained``), ``device_budget`` / ``host_budget`` / ``disk_budget`` (bytes or
    ``"2GiB"``-style strings, kept as bytes; ``None``: the tier's default), ``remote`` (a Redis/
    Valkey URL or a :class:`~pckernels.store.RemoteTier`) and ``remote_namespace``.

    The scheduler: ``kv_budget`` (arena bytes; ``None``: 2 GiB on CPU, a quarter of the GPU),
    ``max_queue`` waiting requests before ``EngineBusyError``, ``max_batch`` running requests,
    ``step_tokens`` prompt tokens read per forward, ``lookahead`` draft tokens per greedy decode
    step (0: none).

    Reuse: ``prefix_block_size`` tokens per block of plain prompts' prefix reuse,
    ``prefix_chunk`` tokens per forward when one is read (a multiple of the block; ``None``:
    :func:`default_prefix_chunk` — the block with ``"block"`` resumption, >= 256 tokens with
    ``"token"``), ``prefix_budget`` bytes of them the prefix cache keeps before it evicts (least recently used
    first, full blocks spilling into the store's tiers; ``None``: 1 GiB),
    ``prefix_resume`` (``"block"`` or ``"token"``), ``placement`` of PML schemas that do not say
    (``"compact"`` or ``"schema"``).

    The step: ``step_graphs`` (a :class:`~pckernels.engine.graphs.StepGraphs` or its mode
    ``"auto"``, ``"off"``, ``"static"``, ``"captured"``; ``None``: ``"auto"``) — bucketed static
    shapes replayed from CUDA graphs on CUDA, exact shapes on CPU by default (``docs/engine.md``,
    "The captured step"); ``"captured"`` on a CPU engine is refused. ``attention``: the attention
    backend of the step's forward through the model's modules (``"auto"``, ``"dense"``, ``"flex"``,
    ``"split_kv"``; :mod:`pckernels.integration.row_attention`, ``docs/engine.md``, "Attention
    backends"): ``"auto"`` is ``"dense"`` until GPU measurements choose; ``"split_kv"`` needs CUDA
    (or the Triton interpreter, for tests).
    """

    device: torch.device | str | None = None
    dtype: torch.dtype | str | None = None
    matmul: str = "fp32"
    store_dir: str | os.PathLike | bool | None = None
    device_budget: int | str | None = None
    host_budget: int | str | None = None
    disk_budget: int | str | None = None
    remote: RemoteTier | str | None = None
    remote_namespace: str = DEFAULT_NAMESPACE
    kv_budget: int | str | None = None
    max_queue: int = 256
    max_batch: int = 64
    step_tokens: int = 2048
    lookahead: int = 0
    prefix_block_size: int = DEFAULT_PREFIX_BLOCK
    prefix_chunk: int | None = None
    prefix_budget: int | str | None = None
    prefix_resume: str = "block"
    placement: str = "compact"
    step_graphs: StepGraphs | str | None = None
    kv_events: KVEventsConfig | Any = None
    attention: str = "auto"

    def __post_init__(self) -> None:
        for name in ("device_budget", "host_budget", "disk_budget", "kv_budget", "prefix_budget"):
            value = getattr(self, name)
            if value is not None:
                self._set(name, _checked(name, value, lambda v, n=name: parse_size(v, n)))
        if self.remote is not None and not isinstance(self.remote, RemoteTier):
            _checked("remote", self.remote, parse_remote_url)
        namespace = self.remote_namespace
        if not isinstance(namespace, str) or not namespace or any(c.isspace() for c in namespace):
            raise OptionError("remote_namespace", namespace, "a non-empty word")
        if not (self.store_dir is None or isinstance(self.store_dir, (bool, str, os.PathLike))):
            raise OptionError("store_dir", self.store_dir, "a directory, True, False or None")
        self._set("device", _checked("device", self.device, resolve_device))
        self._set("dtype", _checked("dtype", self.dtype, resolve_dtype))
        _choice(self.matmul, "matmul", MATMULS)
        if self.matmul == "bf16" and _on_cpu(self.device) and not bf16_matmul_supported():
            raise OptionError("matmul", self.matmul, "fp32 on this CPU", choices=MATMULS,
                              message="matmul='bf16' needs promptcache's native forward with native bf16 matmuls "
                                      "(AVX512-BF16 or AMX), which this CPU or torch build does not have")
        for name, least in (("max_queue", 1), ("max_batch", 1), ("step_tokens", 1), ("lookahead", 0),
                            ("prefix_block_size", 1)):
            _count(getattr(self, name), name, least)
        _choice(self.prefix_resume, "prefix_resume", RESUME)
        if self.prefix_chunk is not None:
            _count(self.prefix_chunk, "prefix_chunk", 1)
            if self.prefix_chunk % self.prefix_block_size:
                raise OptionError("prefix_chunk", self.prefix_chunk, f"a multiple of prefix_block_size "
                                  f"({self.prefix_block_size})", message=f"prefix_chunk must be a multiple of "
                                  f"prefix_block_size ({self.prefix_block_size}), got {self.prefix_chunk}")
        _choice(self.placement, "placement", tuple(sorted(PLACEMENTS)))
        graphs = _checked("step_graphs", self.step_graphs, StepGraphs.of)
        if graphs.mode == "captured" and _on_cpu(self.device):
            raise OptionError("step_graphs", graphs.mode, "auto, off or static on the CPU",
                              message="step_graphs='captured' needs a CUDA device; the engine runs on the CPU")
        self._set("step_graphs", graphs)
        if self.kv_events is not None and not hasattr(self.kv_events, "ledger"):
            self._set("kv_events", kv_events_config(self.kv_events))
        _choice(self.attention, "attention", ATTENTION_BACKENDS)
        if self.attention == "split_kv" and _on_cpu(self.device) and not triton_runnable(torch.device("cpu")):
            raise OptionError("attention", self.attention, "auto, dense or flex on the CPU", choices=ATTENTION_BACKENDS,
                              message="attention='split_kv' runs a Triton kernel: it needs a CUDA device (or "
                                      "TRITON_INTERPRET=1 set before import, for tests); the engine runs on the CPU")

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def replace(self, **changes: Any) -> "EngineConfig":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


ENGINE_OPTIONS = tuple(f.name for f in dataclasses.fields(EngineConfig))
"""The keyword arguments ``PromptCache(...)`` and ``from_pretrained`` take for an :class:`EngineConfig`."""


def engine_config(config: EngineConfig | None = None, options: Mapping[str, Any] | None = None) -> EngineConfig:
    """The one way the engine's entry points turn what they were given into an
    :class:`EngineConfig`: ``config`` itself, or one built from the keyword ``options``
    (:data:`ENGINE_OPTIONS`); mistakes are refused as :func:`pckernels.typed.typed_options` says,
    a bad value is an :class:`~pckernels.errors.OptionError`."""
    return typed_options(EngineConfig, config, options, ENGINE_OPTIONS, arg="config", what="engine option")


def _checked(name: str, value: Any, check) -> Any:
    """``check(value)``, its ``ValueError`` (message kept) as an :class:`OptionError` naming ``name``."""
    try:
        return check(value)
    except OptionError:
        raise
    except ValueError as exc:
        raise OptionError(name, value, "valid", message=str(exc)) from None


def _count(value: Any, name: str, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise OptionError(name, value, f"an int >= {least}", message=f"{name} must be an int >= {least}, got {value!r}")


def _choice(value: Any, name: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise OptionError(name, value, f"one of {', '.join(choices)}", choices=choices)


def _on_cpu(device: torch.device | None) -> bool:
    """Whether the engine will run on the CPU (``None``: no GPU to pick instead)."""
    return device.type == "cpu" if device is not None else not torch.cuda.is_available()
