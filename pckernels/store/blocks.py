"""What the disk and remote tiers share about a stored block: its dtypes by name, its bytes, the
check that refuses a block other than its key names, and the counters of blocks found, written
and refused."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8}
"""Stored dtype names (safetensors' spelling) and their torch dtypes (``U8``: packed blocks of models
with recurrent layers, ``pckernels.prefix.packing``)."""
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class BlockFileError(Exception):
    """A stored block that must not be used (truncated, corrupted, foreign, wrong shape or dtype)."""


def tensor_bytes(tensor: torch.Tensor):
    """The bytes of a contiguous CPU tensor as a writable numpy ``uint8`` view (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def check_expected(stored_shape: list[int], stored_dtype: torch.dtype, shape: tuple[int | None, ...] | None,
                   dtype: torch.dtype | None) -> None:
    """Refuse a well-formed block whose tensor is not the one its key names (``None``: any)."""
    if dtype is not None and stored_dtype != dtype:
        raise BlockFileError(f"wrong dtype (holds {stored_dtype}, expected {dtype})")
    if shape is not None and (len(stored_shape) != len(shape)
                              or any(want is not None and got != want for got, want in zip(stored_shape, shape))):
        want = ", ".join("*" if d is None else str(d) for d in shape)
        raise BlockFileError(f"wrong shape (holds {list(stored_shape)}, expected [{want}])")


@dataclass
class TierStats:
    """The counters of a tier below memory: blocks found, written (with the seconds spent) and refused."""

    hits: int = 0
    writes: int = 0
    write_s: float = 0.0
    discarded: int = 0
    """Stored blocks found unusable (truncated, incomplete, corrupt, foreign, wrong shape or dtype) and deleted."""
    reasons: dict[str, int] = field(default_factory=dict)
    """Discards by kind of reason."""

    def discard(self, reason: str) -> None:
        """Count a discarded block under its reason's kind, the text before any `` (`` detail."""
        kind = reason.split(" (")[0]
        self.discarded += 1
        self.reasons[kind] = self.reasons.get(kind, 0) + 1
