"""Gather + rotate's Triton kernel: gather-concat's grid and meta table plus a per-range delta;
one launch places every range, layer, head, K and V. Key planes rotate the first ``2 * HALF``
dims in fp32 (angle ``delta * inv_freq[l]``, libdevice sin/cos when compiled) and round once;
the rest is copied bit-exactly.

Two variants, one ``ALIGNED`` constexpr chosen per launch on the host (the same check as
gather-concat's): **aligned**, rows of ``D`` contiguous elements with 16-byte aligned addresses
and plane strides, so value planes (and key planes of unrotated layers) are copied as flat runs
with 16-byte vectors and key rows are read and written with vectors too; **generic**, any strides,
read at run time.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pckernels.kernels._common import INTERPRET, as_bits, count_launch, next_pow2, warps_for
from pckernels.kernels._triton_common import (
    PRECISE_TRIG,
    check_grid,
    launch_tables,
    libdevice,
    out_run_offset,
    out_strided_rows,
    plane_index,
    run_start,
    store_rounded,
    strided_rows,
)

TABLE_W = 5
TILE = 4096


@triton.jit
def _trig(inv_ptr, l, delta, HALF: tl.constexpr, BLOCK_J: tl.constexpr, PRECISE: tl.constexpr):
    """``cos, sin [1, BLOCK_J]`` of ``delta * inv_freq[l]`` (fp32), and the column mask ``[1, BLOCK_J]``."""
    j = tl.arange(0, BLOCK_J)
    mj = j < HALF
    ang = delta * tl.load(inv_ptr + l * HALF + j, mask=mj, other=0.0)
    if PRECISE:
        c = libdevice.cos(ang)
        s = libdevice.sin(ang)
    else:
        c = tl.cos(ang)
        s = tl.sin(ang)
    return c[None, :], s[None, :], mj[None, :]


@triton.jit
def _rotate_rows(src_rows, dst_rows, bits_rows, mr, c, s, mj, HALF: tl.constexpr, BLOCK_J: tl.constexpr,
                 ROUND_BF16: tl.constexpr):
    """Rotate-half of ``[BLOCK_R, 2 * HALF]`` key rows: ``src_rows``/``dst_rows`` point at each
    row's first element (``[BLOCK_R, 1]``; ``bits_rows`` the int16 view of ``dst_rows``)."""
    j = tl.arange(0, BLOCK_J)[None, :]
    m = mr[:, None] & mj
    x1 = tl.load(src_rows + j, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src_rows + HALF + j, mask=m, other=0.0).to(tl.float32)
    if ROUND_BF16:
        store_rounded(bits_rows + j, x1 * c - x2 * s, m, True)
        store_rounded(bits_rows + HALF + j, x2 * c + x1 * s, m, True)
    else:
        store_rounded(dst_rows + j, x1 * c - x2 * s, m, False)
        store_rounded(dst_rows + HALF + j, x2 * c + x1 * s, m, False)


@triton.jit
def _copy_tail(src_rows, dst_rows, mr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr):
    """Copy dims ``2 * HALF .. D`` of ``[BLOCK_R]`` rows (contiguous along ``d``)."""
    t = 2 * HALF + tl.arange(0, BLOCK_T)[None, :]
    m = mr[:, None] & (t < D)
    tl.store(dst_rows + t, tl.load(src_rows + t, mask=m), mask=m)


@triton.jit
def _gather_rotate_kernel(
    out_ptr, bits_ptr, meta_ptr, table_ptr, table_at, inv_ptr,
    H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, ALIGNED: tl.constexpr, VEC: tl.constexpr,
    PRECISE: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    chunk = tl.program_id(0).to(tl.int64)
    entry = table_ptr + table_at + tl.program_id(1) * 5
    blk = tl.load(entry).to(tl.int64)
    src = tl.load(entry + 1).to(tl.int64)
    dst = tl.load(entry + 2).to(tl.int64)
    n = tl.load(entry + 3).to(tl.int64)
    delta = tl.load(entry + 4).to(tl.float32)
    l, kv, h = plane_index(tl.program_id(2), H)
    desc = meta_ptr + (1 + blk) * 6
    r = chunk * BLOCK_R + tl.arange(0, BLOCK_R)
    mr = r < n
    if ALIGNED:
        src_run = run_start(out_ptr, desc, l, kv, h, src, D, VEC)
        dst_off = out_run_offset(meta_ptr, l, kv, h, dst, D, VEC)
        dst_run = out_ptr + dst_off
        if (kv == 0) & (HALF > 0):
            c, s, mj = _trig(inv_ptr, l, delta, HALF, BLOCK_J, PRECISE)
            rows = r[:, None] * D
            _rotate_rows(src_run + rows, dst_run + rows, bits_ptr + dst_off + rows, mr, c, s, mj,
                         HALF, BLOCK_J, ROUND_BF16)
            if 2 * HALF < D:
                _copy_tail(src_run + rows, dst_run + rows, mr, D, HALF, BLOCK_T)
        else:  # a flat run: BLOCK_R rows in pieces of BLOCK_F elements
            for i in tl.static_range(BLOCK_R * D // BLOCK_F):
                e = (chunk * BLOCK_R * D + i * BLOCK_F) + tl.arange(0, BLOCK_F)
                m = e < n * D
                tl.store(dst_run + e, tl.load(src_run + e, mask=m), mask=m)
    else:
        src_rows, s_d = strided_rows(out_ptr, desc, l, kv, h, src + r)
        dst_offs, so_d = out_strided_rows(meta_ptr, l, kv, h, dst + r)
        d = tl.arange(0, BLOCK_D)
        lo = 0
        if (kv == 0) & (HALF > 0):
            lo = 2 * HALF
            c, s, mj = _trig(inv_ptr, l, delta, HALF, BLOCK_J, PRECISE)
            j = tl.arange(0, BLOCK_J)[None, :]
            m = mr[:, None] & mj
            x1 = tl.load(src_rows + j * s_d, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(src_rows + (j + HALF) * s_d, mask=m, other=0.0).to(tl.float32)
            o1 = dst_offs + j * so_d
            o2 = dst_offs + (j + HALF) * so_d
            if ROUND_BF16:
                store_rounded(bits_ptr + o1, x1 * c - x2 * s, m, True)
                store_rounded(bits_ptr + o2, x2 * c + x1 * s, m, True)
            else:
                store_rounded(out_ptr + o1, x1 * c - x2 * s, m, False)
                store_rounded(out_ptr + o2, x2 * c + x1 * s, m, False)
        mask = mr[:, None] & ((d >= lo) & (d < D))[None, :]
        tl.store(out_ptr + dst_offs + d[None, :] * so_d, tl.load(src_rows + d[None, :] * s_d, mask=mask), mask=mask)


@functools.lru_cache(maxsize=256)
def config(max_rows: int, D: int, half: int, aligned: bool, itemsize: int
           ) -> tuple[int, int, int, int, int, int, int]:
    """``(chunks, BLOCK_R, BLOCK_D, BLOCK_J, BLOCK_T, BLOCK_F, num_warps)``: programs over chunks of
    ``BLOCK_R`` rows (``BLOCK_R * next_pow2(D)`` at most ``TILE`` elements); aligned value planes
    go in flat pieces of ``BLOCK_F`` elements, the largest power of two dividing ``BLOCK_R * D``;
    fewer warps for a few rows."""
    block_d = next_pow2(D)
    block_r = min(next_pow2(max_rows), max(1, TILE // block_d))
    block_f = block_r * (D & -D) if aligned else 1
    return (triton.cdiv(max_rows, block_r), block_r, block_d, next_pow2(half), next_pow2(max(D - 2 * half, 1)),
            min(block_f, TILE), warps_for(block_r * block_d, itemsize))


def launch(out: torch.Tensor, blocks: list[torch.Tensor], table: torch.Tensor, inv_freq: torch.Tensor,
           max_rows: int = -1) -> None:
    """One launch for the whole table (``max_rows`` as in gather-concat's launch)."""
    tables = launch_tables(out, blocks, table, max_rows)
    if tables is None:
        return
    meta, table, table_at, entries, max_rows, aligned = tables
    L, _, H, _, D = out.shape
    inv = inv_freq if inv_freq.device == out.device and inv_freq.is_contiguous() else \
        inv_freq.to(out.device).contiguous()
    half = inv.shape[1]
    round_bf16 = INTERPRET and out.dtype == torch.bfloat16
    chunks, block_r, block_d, block_j, block_t, block_f, warps = config(max_rows, D, half, aligned,
                                                                      out.element_size())
    grid = check_grid((chunks, entries, L * 2 * H), "gather-rotate")
    count_launch("gather_rotate")
    _gather_rotate_kernel[grid](
        out, as_bits(out) if round_bf16 else out, meta, table, table_at, inv,
        H=H, D=D, HALF=half, ALIGNED=aligned, VEC=16 // out.element_size(), PRECISE=PRECISE_TRIG,
        ROUND_BF16=round_bf16, BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_J=block_j, BLOCK_T=block_t,
        BLOCK_F=block_f, num_warps=warps,
    )
