"""Slot scatter: write freshly computed K/V rows into given rows of one layer's buffer, in place.

``k_out, v_out [B, H, cap, D]``, ``k, v [B, H, q, D]``, ``rows [q]`` int32/int64:
``k_out[:, :, rows[i]] = k[:, :, i]``. Duplicate rows leave an unspecified winner
(as ``index_copy_``). Pure loads/stores, no arithmetic: bit-exact for every dtype.
Here: the checks, the torch-native path and the entry to the Triton path (:mod:`.kernel`,
imported on first use); the reference is in :mod:`.naive`.
"""

from __future__ import annotations

import torch


def check_scatter_args(
    k_out: torch.Tensor, v_out: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor
) -> None:
    """Shape/dtype checks (no device sync)."""
    if k_out.dim() != 4 or v_out.shape != k_out.shape:
        raise ValueError(f"k_out/v_out must both be [B, H, cap, D], got {tuple(k_out.shape)}, {tuple(v_out.shape)}")
    B, H, _, D = k_out.shape
    q = rows.shape[0] if rows.dim() == 1 else -1
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != (B, H, q, D):
            raise ValueError(f"{name} must be [{B}, {H}, {q}, {D}] to match k_out and rows, got {tuple(t.shape)}")
        if t.dtype != k_out.dtype or t.device != k_out.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}, k_out is {k_out.dtype} on {k_out.device}")
    if v_out.dtype != k_out.dtype or v_out.device != k_out.device:
        raise ValueError("v_out must match k_out's dtype and device")
    if rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be int32/int64, got {rows.dtype}")


def scatter_rows_torch(
    k_out: torch.Tensor, v_out: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor
) -> None:
    """Torch path: two ``index_copy_`` along the row dimension."""
    idx = rows if rows.dtype == torch.int64 else rows.long()
    if idx.device != k_out.device:
        idx = idx.to(k_out.device)
    k_out.index_copy_(2, idx, k)
    v_out.index_copy_(2, idx, v)


def scatter_rows_triton(
    k_out: torch.Tensor, v_out: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor
) -> None:
    """Triton path, one launch for K and V of all batch entries and heads (:func:`.kernel.launch`;
    imports Triton)."""
    from pckernels.kernels.scatter_rows import kernel

    kernel.launch(k_out, v_out, k, v, rows)
