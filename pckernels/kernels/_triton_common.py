"""Triton pieces shared by the kernel modules: the gather launches' preamble (meta table, table,
grid) and ``@triton.jit`` helpers. Imported only with a Triton path, like the kernels themselves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pckernels.kernels._common import INTERPRET, next_pow2
from pckernels.kernels.gather_concat import check_table_host

try:
    from triton.language.extra import libdevice
except ImportError:
    libdevice = None

PRECISE_TRIG = libdevice is not None and not INTERPRET
"""Accurate ``libdevice`` sin/cos when compiled (the interpreter has none: it uses numpy's)."""

META_W = 6
_META_CACHE: dict[tuple, torch.Tensor] = {}
_META_CACHE_MAX = 256


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


@triton.jit
def source_rows(out_ptr, meta_ptr, blk, plane, H, src, r, META_W: tl.constexpr):
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
def store_rounded(ptr, val, mask, ROUND_BF16: tl.constexpr):
    """Store fp32 ``val``; with ROUND_BF16, ``ptr`` is an int16 view of bf16 and rounding is done by hand (RTNE)."""
    if ROUND_BF16:
        bits = val.to(tl.uint32, bitcast=True)
        rnd = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rnd = tl.where(val != val, 0x7FC0, rnd)
        tl.store(ptr, rnd.to(tl.int16), mask=mask)
    else:
        tl.store(ptr, val.to(ptr.dtype.element_ty), mask=mask)
