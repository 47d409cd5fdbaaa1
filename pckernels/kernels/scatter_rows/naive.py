"""Plain-torch reference of slot scatter: an obvious loop, no tricks, used by the tests."""

from __future__ import annotations

import torch


def scatter_rows_ref(
    k_out: torch.Tensor, v_out: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor
) -> None:
    """Row by row: ``k_out[:, :, rows[i]] = k[:, :, i]`` (and the same for ``v``).

    ``k_out, v_out [B, H, cap, D]``, ``k, v [B, H, q, D]``, ``rows [q]``.
    """
    for i, r in enumerate(rows.tolist()):
        k_out[:, :, r] = k[:, :, i]
        v_out[:, :, r] = v[:, :, i]
