"""Gather-concat's Triton kernel: one launch covers every table entry, every layer and both
keys and values.

The source blocks are separate allocations with their own strides, so they reach the kernel
through a small int64 *meta table* on the device, one row per block: ``(base address, stride_l,
stride_kv, stride_h, stride_n, stride_d)``; the kernel casts the address to a typed pointer.
Copies go through same-size integer views, so fp32/fp16/bf16 (and NaN payloads) are
bit-exact. Because the meta table holds raw addresses, this kernel runs only on real tensors:
the op wrapping it is an opaque ``custom_op`` (see :mod:`pckernels.ops`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pckernels.kernels._common import as_bits, count_launch
from pckernels.kernels._triton_common import META_W, gather_grid, launch_tables, source_rows


@triton.jit
def _gather_concat_kernel(
    out_ptr, meta_ptr, table_ptr, H, D,
    so_l, so_kv, so_h, so_n, so_d,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, META_W: tl.constexpr,
):
    chunk = tl.program_id(0)
    m = tl.program_id(1)
    plane = tl.program_id(2)
    blk = tl.load(table_ptr + m * 4).to(tl.int64)
    src = tl.load(table_ptr + m * 4 + 1).to(tl.int64)
    dst = tl.load(table_ptr + m * 4 + 2).to(tl.int64)
    n = tl.load(table_ptr + m * 4 + 3).to(tl.int64)
    r = chunk.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    src_rows, s_d, l, kv, h = source_rows(out_ptr, meta_ptr, blk, plane, H, src, r, META_W)
    d = tl.arange(0, BLOCK_D)
    mask = (r < n)[:, None] & (d < D)[None, :]
    vals = tl.load(src_rows + d[None, :] * s_d, mask=mask)
    dst_off = l * so_l + kv * so_kv + h * so_h + (dst + r)[:, None] * so_n + d[None, :] * so_d
    tl.store(out_ptr + dst_off, vals, mask=mask)


def launch(out: torch.Tensor, blocks: list[torch.Tensor], table: torch.Tensor, max_rows: int = -1) -> None:
    """One launch for the whole table.

    ``max_rows`` bounds ``n_rows`` over the table and sizes the grid; ``-1`` reads it from a
    host table, or falls back to ``cap`` for a device table (correct, more idle programs).
    The table is not bounds-checked when it already lives on the device (no sync).
    """
    tables = launch_tables(out, blocks, table, max_rows)
    if tables is None:
        return
    table, max_rows, meta = tables
    L, _, H, cap, D = out.shape
    ob = as_bits(out)
    grid, block_r, block_d = gather_grid(max_rows, table.shape[0], L * 2 * H, D, 8192, "gather")
    count_launch("gather_concat")
    _gather_concat_kernel[grid](
        ob, meta, table, H, D, *ob.stride(), BLOCK_R=block_r, BLOCK_D=block_d, META_W=META_W
    )
