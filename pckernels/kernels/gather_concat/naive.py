"""Plain-torch reference of gather-concat: an obvious loop, no tricks, used by the tests."""

from __future__ import annotations

import torch


def gather_concat_ref(out: torch.Tensor, blocks: list[torch.Tensor], table: torch.Tensor) -> None:
    """Row by row: ``out[:, :, :, dst + i] = blocks[b][:, :, :, src + i]`` for each table entry ``(b, src, dst, n)``.

    ``out [L, 2, H, cap, D]``, ``blocks[b] [L, 2, H, n_b, D]``, ``table [M, 4]``.
    """
    for b, src, dst, n in table.tolist():
        for i in range(n):
            out[:, :, :, dst + i] = blocks[b][:, :, :, src + i]
