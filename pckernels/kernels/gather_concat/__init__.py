"""Gather-concat: copy row ranges of many cached KV blocks into the assembly buffer.

``out [L, 2, H, cap, D]``, ``blocks[b] [L, 2, H, n_b, D]``, ``table [M, 4]`` rows ``(block,
src_row, dst_row, n_rows)``: ``out[..., dst:dst+n, :] = blocks[block][..., src:src+n, :]`` for
every layer, K and V and head. Here: the argument checks, the torch-native path and the entry
to the Triton path (:mod:`.kernel`, imported on first use); the reference is in :mod:`.naive`.
"""

from __future__ import annotations

import torch


def check_gather_args(out: torch.Tensor, blocks: list[torch.Tensor], table: torch.Tensor) -> None:
    """Shape/dtype/device checks that need no device sync.

    ``out [L, 2, H, cap, D]``, each block ``[L, 2, H, n_b, D]`` with ``out``'s dtype and device,
    ``table [M, 4]`` integer ``(block, src_row, dst_row, n_rows)``.
    """
    if out.dim() != 5 or out.shape[1] != 2:
        raise ValueError(f"out must be [L, 2, H, cap, D], got {tuple(out.shape)}")
    if table.dim() != 2 or table.shape[1] != 4 or table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"table must be an int32/int64 [M, 4] tensor, got {table.dtype} {tuple(table.shape)}")
    L, _, H, _, D = out.shape
    for i, b in enumerate(blocks):
        if b.dim() != 5 or b.shape[0] != L or b.shape[1] != 2 or b.shape[2] != H or b.shape[4] != D:
            raise ValueError(f"block {i} has shape {tuple(b.shape)}, expected [{L}, 2, {H}, n, {D}]")
        if b.dtype != out.dtype or b.device != out.device:
            raise ValueError(f"block {i} is {b.dtype} on {b.device}, out is {out.dtype} on {out.device}")


def check_table_host(entries: list[list[int]], blocks: list[torch.Tensor], cap: int) -> int:
    """Bounds-check host-side table entries (their first four columns: ``block, src_row, dst_row,
    n_rows``); returns the largest ``n_rows``."""
    max_rows = 0
    for e in entries:
        b, src, dst, n = e[0], e[1], e[2], e[3]
        if not 0 <= b < len(blocks):
            raise IndexError(f"table block index {b} out of range for {len(blocks)} blocks")
        if n < 0 or src < 0 or dst < 0 or src + n > blocks[b].shape[3] or dst + n > cap:
            raise IndexError(f"table entry {(b, src, dst, n)} out of range (block rows {blocks[b].shape[3]}, cap {cap})")
        max_rows = max(max_rows, n)
    return max_rows


def gather_concat_torch(out: torch.Tensor, blocks: list[torch.Tensor], table: torch.Tensor) -> None:
    """Torch path: one strided ``copy_`` per table entry (all layers, K and V at once)."""
    entries = table.tolist()
    check_table_host(entries, blocks, out.shape[3])
    for b, src, dst, n in entries:
        if n:
            out[:, :, :, dst : dst + n].copy_(blocks[b][:, :, :, src : src + n])


def gather_concat_triton(out: torch.Tensor, blocks: list[torch.Tensor], table: torch.Tensor,
                         max_rows: int = -1) -> None:
    """Triton path, one launch for the whole table (:func:`.kernel.launch`; imports Triton)."""
    from pckernels.kernels.gather_concat import kernel

    kernel.launch(out, blocks, table, max_rows)
