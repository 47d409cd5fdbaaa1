"""Gather-concat's Triton kernel: one launch covers every table entry, every layer and both
keys and values.

The source blocks are separate allocations with their own strides, so they reach the kernel
through the meta table (:mod:`pckernels.kernels._triton_common`): one row for ``out``, one per
block, ``(address, stride_l, stride_kv, stride_h, stride_n, stride_d)``; the kernel casts an
address to a typed pointer. Copies go through same-size integer views, so fp32/fp16/bf16 (and
NaN payloads) are bit-exact. Because the meta table holds raw addresses, this kernel runs only
on real tensors: the op wrapping it is an opaque ``custom_op`` (see :mod:`pckernels.ops`).

Two variants, one ``ALIGNED`` constexpr, chosen per launch on the host:

- **aligned** (``out`` and every block pass :func:`pckernels.kernels._align.rows_aligned` with
  flat rows: rows of ``D`` contiguous elements, 16-byte multiples, 16-byte aligned addresses and
  plane strides): each (entry, layer, K/V, head) plane is one flat run of ``n * D`` elements;
  a program copies ``BLOCK`` of them with 16-byte vector loads and stores.
- **generic**: any strides; a program copies a ``[BLOCK_R, BLOCK_D]`` tile of rows with the
  strides read at run time (scalar accesses).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pckernels.kernels._common import as_bits, count_launch, next_pow2, warps_for
from pckernels.kernels._triton_common import (
    RUN_BYTES,
    check_grid,
    launch_tables,
    out_run_offset,
    out_strided_rows,
    plane_index,
    run_start,
    strided_rows,
)

TABLE_W = 4
GENERIC_TILE = 4096


@triton.jit
def _gather_concat_kernel(
    out_ptr, meta_ptr, table_ptr, table_at,
    H: tl.constexpr, D: tl.constexpr, ALIGNED: tl.constexpr, VEC: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    chunk = tl.program_id(0).to(tl.int64)
    entry = table_ptr + table_at + tl.program_id(1) * 4
    blk = tl.load(entry).to(tl.int64)
    src = tl.load(entry + 1).to(tl.int64)
    dst = tl.load(entry + 2).to(tl.int64)
    n = tl.load(entry + 3).to(tl.int64)
    l, kv, h = plane_index(tl.program_id(2), H)
    desc = meta_ptr + (1 + blk) * 6
    if ALIGNED:
        src_run = run_start(out_ptr, desc, l, kv, h, src, D, VEC)
        dst_run = out_ptr + out_run_offset(meta_ptr, l, kv, h, dst, D, VEC)
        e = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = e < n * D
        tl.store(dst_run + e, tl.load(src_run + e, mask=mask), mask=mask)
    else:
        r = chunk * BLOCK_R + tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        mask = (r < n)[:, None] & (d < D)[None, :]
        src_rows, s_d = strided_rows(out_ptr, desc, l, kv, h, src + r)
        dst_rows, so_d = out_strided_rows(meta_ptr, l, kv, h, dst + r)
        tl.store(out_ptr + dst_rows + d[None, :] * so_d, tl.load(src_rows + d[None, :] * s_d, mask=mask), mask=mask)


@functools.lru_cache(maxsize=256)
def config(max_rows: int, D: int, itemsize: int, aligned: bool) -> tuple[int, int, int, int, int]:
    """``(chunks, BLOCK, BLOCK_R, BLOCK_D, num_warps)`` of a launch: aligned, flat pieces of
    ``BLOCK`` elements (``RUN_BYTES`` at most, no more than the longest run); generic, tiles of
    ``BLOCK_R`` rows; fewer warps for short runs (each thread keeps a 16-byte vector)."""
    if aligned:
        block = min(RUN_BYTES // itemsize, next_pow2(max_rows * D))
        return triton.cdiv(max_rows * D, block), block, 1, 1, warps_for(block, itemsize)
    block_d = next_pow2(D)
    block_r = min(next_pow2(max_rows), max(1, GENERIC_TILE // block_d))
    return triton.cdiv(max_rows, block_r), 1, block_r, block_d, warps_for(block_r * block_d, itemsize)


def launch(out: torch.Tensor, blocks: list[torch.Tensor], table: torch.Tensor, max_rows: int = -1) -> None:
    """One launch for the whole table.

    ``max_rows`` bounds ``n_rows`` over the table and sizes the grid; ``-1`` reads it from a
    host table, or falls back to ``cap`` for a device table (correct, more idle programs).
    The table is not bounds-checked when it already lives on the device (no sync).
    """
    tables = launch_tables(out, blocks, table, max_rows)
    if tables is None:
        return
    meta, table, table_at, entries, max_rows, aligned = tables
    L, _, H, _, D = out.shape
    chunks, block, block_r, block_d, warps = config(max_rows, D, out.element_size(), aligned)
    grid = check_grid((chunks, entries, L * 2 * H), "gather")
    count_launch("gather_concat")
    _gather_concat_kernel[grid](
        as_bits(out), meta, table, table_at, H=H, D=D, ALIGNED=aligned, VEC=16 // out.element_size(),
        BLOCK=block, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps,
    )

