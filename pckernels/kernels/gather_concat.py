"""Gather-concat: copy row ranges of many cached KV blocks into the assembly buffer.

One launch covers every table entry, every layer and both keys and values. The source
blocks are separate allocations with their own strides, so they reach the kernel through
a small int64 *meta table* on the device, one row per block: ``(base address, stride_l,
stride_kv, stride_h, stride_n, stride_d)``; the kernel casts the address to a typed pointer.
Copies go through same-size integer views, so fp32/fp16/bf16 (and NaN payloads) are
bit-exact. Because the meta table holds raw addresses, this kernel runs only on real tensors:
the op wrapping it is an opaque ``custom_op`` (see ``pckernels.ops``), not a ``triton_op``.
"""

from __future__ import annotations

import torch

from pckernels.kernels._common import HAS_TRITON, as_bits, count_launch, next_pow2, tl, triton

_META_W = 6
_META_CACHE: dict[tuple, torch.Tensor] = {}
_META_CACHE_MAX = 256


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
    """Bounds-check host-side table entries; returns the largest ``n_rows``."""
    max_rows = 0
    for b, src, dst, n in entries:
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


def _meta_table(blocks: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Device int64 ``[n_blocks, 6]``: base address and element strides of each block.

    Cached by its own contents (addresses and strides), so a hit is always correct.
    """
    rows = tuple((b.data_ptr(), *b.stride()) for b in blocks)
    key = (device, rows)
    meta = _META_CACHE.get(key)
    if meta is None:
        if len(_META_CACHE) >= _META_CACHE_MAX:
            _META_CACHE.pop(next(iter(_META_CACHE)))
        meta = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        _META_CACHE[key] = meta
    return meta


def launch_tables(out: torch.Tensor, blocks: list[torch.Tensor], table: torch.Tensor,
                  max_rows: int) -> tuple[torch.Tensor, int, torch.Tensor] | None:
    """What a gather launch reads: ``table`` on ``out``'s device (contiguous), the launch's row
    bound and the blocks' meta table; None when there is nothing to copy. A host table is
    bounds-checked (its first four columns) and gives the bound when ``max_rows`` is ``-1``; a
    device table is not checked (no sync) and falls back to ``cap``."""
    if not blocks or table.shape[0] == 0:
        return None
    if table.device.type == "cpu":
        longest = check_table_host([e[:4] for e in table.tolist()], blocks, out.shape[3])
        max_rows = longest if max_rows < 0 else max_rows
        table = table.to(out.device, non_blocking=True)
    elif max_rows < 0:
        max_rows = out.shape[3]
    if max_rows == 0:
        return None
    return table.contiguous(), max_rows, _meta_table(blocks, out.device)


def gather_grid(max_rows: int, entries: int, planes: int, D: int, tile: int,
                what: str) -> tuple[tuple[int, int, int], int, int]:
    """``(grid, BLOCK_R, BLOCK_D)`` of a gather launch: programs over (row chunks, table entries,
    layer/k-v/head planes), ``BLOCK_R * BLOCK_D`` at most ``tile`` elements."""
    block_d = next_pow2(D)
    block_r = min(next_pow2(max_rows), max(1, tile // block_d))
    grid = (triton.cdiv(max_rows, block_r), entries, planes)
    if grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"{what} grid {grid} exceeds CUDA limits (table entries or L*2*H > 65535)")
    return grid, block_r, block_d


if HAS_TRITON:

    @triton.jit
    def _source_rows(out_ptr, meta_ptr, blk, plane, H, src, r, META_W: tl.constexpr):
        """For program plane ``plane`` (layer, k/v, head) of a launch over ``[L, 2, H, ...]``:
        pointers ``[BLOCK_R, 1]`` to rows ``src + r`` of block ``blk`` (described in ``meta`` by its
        base pointer and strides), that block's stride over ``d``, and ``l, kv, h``."""
        l = (plane // (2 * H)).to(tl.int64)
        kv = ((plane // H) % 2).to(tl.int64)
        h = (plane % H).to(tl.int64)
        meta = meta_ptr + blk * META_W
        base = tl.load(meta).to(tl.pointer_type(out_ptr.dtype.element_ty))
        rows = base + l * tl.load(meta + 1) + kv * tl.load(meta + 2) + h * tl.load(meta + 3) \
            + (src + r)[:, None] * tl.load(meta + 4)
        return rows, tl.load(meta + 5), l, kv, h

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
        src_rows, s_d, l, kv, h = _source_rows(out_ptr, meta_ptr, blk, plane, H, src, r, META_W)
        d = tl.arange(0, BLOCK_D)
        mask = (r < n)[:, None] & (d < D)[None, :]
        vals = tl.load(src_rows + d[None, :] * s_d, mask=mask)
        dst_off = l * so_l + kv * so_kv + h * so_h + (dst + r)[:, None] * so_n + d[None, :] * so_d
        tl.store(out_ptr + dst_off, vals, mask=mask)


def gather_concat_triton(
    out: torch.Tensor, blocks: list[torch.Tensor], table: torch.Tensor, max_rows: int = -1
) -> None:
    """Triton path: one launch for the whole table.

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
        ob, meta, table, H, D, *ob.stride(), BLOCK_R=block_r, BLOCK_D=block_d, META_W=_META_W
    )
