"""Checks of the options that pick a model, device and dtype, made before anything is loaded.

Each raises a ``ValueError`` (or ``FileNotFoundError`` / ``NotADirectoryError`` for a model path)
with a one-line message, so a command line can report bad input without loading a model first.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from pckernels.integration.fetched import is_fetchable

DTYPE_NAMES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
               "bfloat16": torch.bfloat16, "float64": torch.float64, "double": torch.float64}
"""Names accepted for a model dtype (``torch.`` prefix allowed)."""

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
"""``name`` or ``org/name``: what may be a Hugging Face model id rather than a local path."""


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as a floating-point ``torch.dtype`` (``None`` stays ``None``: the default)."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in DTYPE_NAMES.values():
        return dtype
    if isinstance(dtype, str) and dtype.strip().removeprefix("torch.") in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.strip().removeprefix("torch.")]
    raise ValueError(f"unknown dtype {str(dtype)!r}: expected float32, bfloat16, float16 or float64")


def resolve_device(device: torch.device | str | None) -> torch.device | None:
    """``device`` as a ``torch.device`` that exists on this machine (``None`` stays ``None``)."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"unknown device {str(device)!r}: expected cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device {str(device)!r} is not available: torch sees no CUDA GPU")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {str(device)!r} is not available: torch sees {count} CUDA GPU(s)")
    elif dev.type != "cpu":
        try:
            torch.empty(0, device=dev)
        except (RuntimeError, AssertionError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"device {str(device)!r} is not available: {first}") from None
    return dev


def check_model_path(name_or_path: str) -> None:
    """Refuse a model meant as a local path that is not a directory. ``"smollm2"``, the fetchable
    models' short names (``pckernels.integration.fetched``, fetched on first load) and what may be a
    Hugging Face id (``name``, or ``org/name`` where no local ``org`` directory exists) pass."""
    if name_or_path == "smollm2" or is_fetchable(name_or_path):
        return
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return
    if path.exists():
        raise NotADirectoryError(f"model path {name_or_path!r} is a file, not a model directory")
    if _HUB_ID.fullmatch(name_or_path) and ".." not in name_or_path and not (
            "/" in name_or_path and path.parent.is_dir()):
        return
    raise FileNotFoundError(f"no such model directory: {name_or_path!r}")


def check_load_options(name_or_path: str, device: torch.device | str | None,
                       dtype: torch.dtype | str | None) -> tuple[torch.device | None, torch.dtype | None]:
    """Check a model, device and dtype before loading; returns the resolved device and dtype."""
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    check_model_path(name_or_path)
    return dev, dt
