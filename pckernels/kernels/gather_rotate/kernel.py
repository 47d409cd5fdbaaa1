"""Gather + rotate's Triton kernel: gather-concat's grid and meta table plus a per-range delta;
one launch places every range, layer, head, K and V. Key planes rotate the first ``2 * half``
dims in fp32 (angle ``delta * inv_freq[l]``, libdevice sin/cos when compiled) and round once;
the rest is copied bit-exactly."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pckernels.kernels._common import INTERPRET, as_bits, count_launch, next_pow2
from pckernels.kernels._triton_common import (
    META_W,
    PRECISE_TRIG,
    gather_grid,
    launch_tables,
    libdevice,
    source_rows,
    store_rounded,
)


@triton.jit
def _gather_rotate_kernel(
    out_ptr, bits_ptr, meta_ptr, table_ptr, inv_ptr, H, D, half,
    so_l, so_kv, so_h, so_n, so_d, si_l,
    HAS_ROT: tl.constexpr, PRECISE: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr, META_W: tl.constexpr,
):
    chunk = tl.program_id(0)
    m = tl.program_id(1)
    plane = tl.program_id(2)
    row = table_ptr + m * 5
    blk = tl.load(row).to(tl.int64)
    src = tl.load(row + 1).to(tl.int64)
    dst = tl.load(row + 2).to(tl.int64)
    n = tl.load(row + 3).to(tl.int64)
    delta = tl.load(row + 4).to(tl.float32)
    r = chunk.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    mr = r < n
    src_rows, s_d, l, kv, h = source_rows(out_ptr, meta_ptr, blk, plane, H, src, r, META_W)
    dst_rows = l * so_l + kv * so_kv + h * so_h + (dst + r)[:, None] * so_n
    d = tl.arange(0, BLOCK_D)
    lo = half * 0
    if HAS_ROT:  # noqa: SIM102 (a constexpr branch, compiled out; the key-plane test is at run time)
        if kv == 0:
            lo = 2 * half
            j = tl.arange(0, BLOCK_J)
            mj = j < half
            f = tl.load(inv_ptr + l * si_l + j, mask=mj, other=0.0)
            ang = delta * f
            if PRECISE:
                c = libdevice.cos(ang)[None, :]
                s = libdevice.sin(ang)[None, :]
            else:
                c = tl.cos(ang)[None, :]
                s = tl.sin(ang)[None, :]
            mrj = mr[:, None] & mj[None, :]
            x1 = tl.load(src_rows + j[None, :] * s_d, mask=mrj, other=0.0).to(tl.float32)
            x2 = tl.load(src_rows + (j + half)[None, :] * s_d, mask=mrj, other=0.0).to(tl.float32)
            o1 = dst_rows + j[None, :] * so_d
            o2 = dst_rows + (j + half)[None, :] * so_d
            if ROUND_BF16:
                store_rounded(bits_ptr + o1, x1 * c - x2 * s, mrj, True)
                store_rounded(bits_ptr + o2, x2 * c + x1 * s, mrj, True)
            else:
                store_rounded(out_ptr + o1, x1 * c - x2 * s, mrj, False)
                store_rounded(out_ptr + o2, x2 * c + x1 * s, mrj, False)
    mask = mr[:, None] & ((d >= lo) & (d < D))[None, :]
    vals = tl.load(src_rows + d[None, :] * s_d, mask=mask)
    tl.store(out_ptr + dst_rows + d[None, :] * so_d, vals, mask=mask)


def launch(out: torch.Tensor, blocks: list[torch.Tensor], table: torch.Tensor, inv_freq: torch.Tensor,
           max_rows: int = -1) -> None:
    """One launch for the whole table (``max_rows`` as in gather-concat's launch)."""
    tables = launch_tables(out, blocks, table, max_rows)
    if tables is None:
        return
    table, max_rows, meta = tables
    L, _, H, cap, D = out.shape
    inv = inv_freq.to(out.device).contiguous()
    half = inv.shape[1]
    round_bf16 = INTERPRET and out.dtype == torch.bfloat16
    bits = as_bits(out) if round_bf16 else out
    grid, block_r, block_d = gather_grid(max_rows, table.shape[0], L * 2 * H, D, 4096, "gather-rotate")
    count_launch("gather_rotate")
    _gather_rotate_kernel[grid](
        out, bits, meta, table, inv, H, D, half, *out.stride(), max(half, 1),
        HAS_ROT=half > 0, PRECISE=PRECISE_TRIG, ROUND_BF16=round_bf16,
        BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_J=next_pow2(half), META_W=META_W,
    )
