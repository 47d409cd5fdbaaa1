"""Backend selection, the Triton launch counter and small helpers shared by the kernels.

Triton itself is not imported here: each kernel's ``kernel`` module (the ``@triton.jit`` code)
is imported the first time its Triton path runs. ``TRITON_INTERPRET`` is read when this module
is imported, so ``TRITON_INTERPRET=1`` must be set before ``import pckernels`` for the kernels
to run on CPU tensors (tests/conftest.py does this when CUDA is unavailable).
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections import Counter

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
BACKENDS = ("auto", "triton", "torch")
BACKEND_ENV = "PROMPTCACHE_KERNEL_BACKEND"

_counts: Counter[str] = Counter()
_lock = threading.Lock()
_choices: dict[tuple, bool] = {}
"""Memo of :func:`triton_for`: written under ``_lock``, read without it (a dict read is atomic)."""

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: a host tensor bound for CUDA goes through pinned memory, ``non_blocking``
    (no host wait); one already there is returned as is (nothing copied on the CPU)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def launch_counts() -> dict[str, int]:
    """How many times each Triton kernel was launched from Python (eager launches only)."""
    with _lock:
        return dict(_counts)


def reset_launch_counts() -> None:
    """Zero the launch counter."""
    with _lock:
        _counts.clear()


def count_launch(name: str) -> None:
    """Record one launch of the Triton kernel ``name``."""
    with _lock:
        _counts[name] += 1


def resolve_backend(backend: str | None) -> str:
    """``None`` means ``$PROMPTCACHE_KERNEL_BACKEND`` (default ``"auto"``)."""
    if backend is None:
        backend = os.environ.get(BACKEND_ENV, "auto") or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def triton_runnable(device: torch.device) -> bool:
    """True when a Triton kernel can run on tensors of ``device`` (CUDA, or CPU in the interpreter)."""
    if not HAS_TRITON:
        return False
    return device.type == "cuda" or (device.type == "cpu" and INTERPRET)


def use_triton(device: torch.device, backend: str) -> bool:
    """Whether ``backend`` selects the Triton kernel for tensors on ``device``.

    ``"auto"`` picks Triton on CUDA and the torch path elsewhere; ``"triton"`` forces the
    kernel and raises when it cannot run there.
    """
    if backend == "torch":
        return False
    if backend == "triton":
        if not triton_runnable(device):
            raise RuntimeError(
                f"backend='triton' cannot run on {device}: needs CUDA, or TRITON_INTERPRET=1 set "
                "before pckernels.kernels is imported (CPU)"
            )
        return True
    if backend == "auto":
        return device.type == "cuda" and HAS_TRITON
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def triton_for(device: torch.device, backend: str | None) -> bool:
    """:func:`use_triton` of :func:`resolve_backend`, resolved once per (device type, backend,
    ``$PROMPTCACHE_KERNEL_BACKEND`` when ``backend`` is None, interpreter, Triton installed) and
    then read from a memo: the ops' hot path does a dict lookup instead of re-deciding. Bad names
    raise every time (they are never stored)."""
    env = os.environ.get(BACKEND_ENV) if backend is None else None
    key = (device.type, backend, env, INTERPRET, HAS_TRITON)
    choice = _choices.get(key)
    if choice is None:
        choice = use_triton(device, resolve_backend(backend))
        with _lock:
            _choices[key] = choice
    return choice


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """Same-size integer view of ``t`` (same shape and strides): copies through it are bit-exact."""
    return t.view(_BITS[t.element_size()])


def warps_for(elements: int, itemsize: int, most: int = 4) -> int:
    """Warps for a program moving ``elements`` of ``itemsize`` bytes: as many as give every thread
    at least one 16-byte vector (a power of two, 1 .. ``most``). Four warps over a decode-sized
    tile would leave each thread a scalar or nothing, and no vector access."""
    fit = max(1, elements * itemsize // (16 * 32))
    return min(most, 1 << (fit.bit_length() - 1))


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()
