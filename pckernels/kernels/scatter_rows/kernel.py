"""Slot scatter's Triton kernels: one launch writes the K and V rows of all batch entries and heads.

Two variants, chosen per launch on the host: **aligned** when ``k_out``/``v_out`` share their
strides, ``k``/``v`` share theirs, and all four pass
:func:`pckernels.kernels._align.rows_aligned` (innermost stride 1, rows of 16-byte multiples,
16-byte aligned addresses and strides; the row stride need not be ``D``): ``D`` is a constant,
the strides carry ``tl.multiple_of`` hints and rows move as 16-byte vectors, with six stride
arguments instead of sixteen; **generic** otherwise (every stride a run-time argument).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pckernels.kernels._align import ALIGN_BYTES, kernel_strides, rows_aligned
from pckernels.kernels._common import count_launch, next_pow2, to_device, warps_for

TILE = 4096


@triton.jit
def _scatter_rows_aligned(
    ko_ptr, vo_ptr, k_ptr, v_ptr, rows_ptr, q,
    so_b, so_h, so_r, si_b, si_h, si_r,
    H: tl.constexpr, D: tl.constexpr, VEC: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    i = tl.program_id(0).to(tl.int64) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    d = tl.arange(0, BLOCK_D)[None, :]
    mi = i < q
    mask = mi[:, None] & (d < D)
    r = tl.load(rows_ptr + i, mask=mi, other=0).to(tl.int64)
    src = b * tl.multiple_of(si_b, VEC) + h * tl.multiple_of(si_h, VEC) + i[:, None] * tl.multiple_of(si_r, VEC) + d
    dst = b * tl.multiple_of(so_b, VEC) + h * tl.multiple_of(so_h, VEC) + r[:, None] * tl.multiple_of(so_r, VEC) + d
    tl.store(ko_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(vo_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


@triton.jit
def _scatter_rows_generic(
    ko_ptr, vo_ptr, k_ptr, v_ptr, rows_ptr, q,
    sko_b, sko_h, sko_r, sko_d,
    svo_b, svo_h, svo_r, svo_d,
    sk_b, sk_h, sk_r, sk_d,
    sv_b, sv_h, sv_r, sv_d,
    H: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    i = tl.program_id(0).to(tl.int64) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    d = tl.arange(0, BLOCK_D)
    mi = i < q
    mask = mi[:, None] & (d < D)[None, :]
    r = tl.load(rows_ptr + i, mask=mi, other=0).to(tl.int64)
    kv = tl.load(k_ptr + b * sk_b + h * sk_h + i[:, None] * sk_r + d[None, :] * sk_d, mask=mask)
    tl.store(ko_ptr + b * sko_b + h * sko_h + r[:, None] * sko_r + d[None, :] * sko_d, kv, mask=mask)
    vv = tl.load(v_ptr + b * sv_b + h * sv_h + i[:, None] * sv_r + d[None, :] * sv_d, mask=mask)
    tl.store(vo_ptr + b * svo_b + h * svo_h + r[:, None] * svo_r + d[None, :] * svo_d, vv, mask=mask)


@functools.lru_cache(maxsize=256)
def config(q: int, B: int, H: int, D: int, itemsize: int) -> tuple[tuple[int, int], int, int, int]:
    """``(grid, BLOCK_Q, BLOCK_D, num_warps)``: programs over (chunks of ``BLOCK_Q`` rows, batch x
    heads); one warp for a decode step's row, so that its threads still move 16-byte vectors."""
    block_d = next_pow2(D)
    block_q = min(next_pow2(q), max(1, TILE // block_d))
    return (triton.cdiv(q, block_q), B * H), block_q, block_d, warps_for(block_q * block_d, itemsize)


@functools.lru_cache(maxsize=1024)
def layout(out_shape: tuple[int, ...], ko_strides: tuple[int, ...], vo_strides: tuple[int, ...],
           in_shape: tuple[int, ...], k_strides: tuple[int, ...], v_strides: tuple[int, ...],
           itemsize: int) -> tuple[bool, tuple[int, ...], tuple[int, ...]]:
    """``(fits, out strides, in strides)``: whether, addresses aside, a launch over these layouts
    may take the aligned variant (``k_out``/``v_out`` and ``k``/``v`` share their strides, all
    pass :func:`~pckernels.kernels._align.rows_aligned` without flat rows), and the ``(b, h, r)``
    strides it is given (size-1 dims 0). A memo: the same few layouts recur every forward."""
    so, svo = kernel_strides(out_shape, ko_strides), kernel_strides(out_shape, vo_strides)
    si, svi = kernel_strides(in_shape, k_strides), kernel_strides(in_shape, v_strides)
    fits = (so == svo and si == svi and rows_aligned((0, itemsize, out_shape, so), flat_rows=False)
            and rows_aligned((0, itemsize, in_shape, si), flat_rows=False))
    return fits, so[:3], si[:3]


def aligned(k_out: torch.Tensor, v_out: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a launch over these tensors may take the aligned variant (see the module docstring)."""
    fits = layout(k_out.shape, k_out.stride(), v_out.stride(), k.shape, k.stride(), v.stride(), k_out.element_size())[0]
    return fits and (k_out.data_ptr() | v_out.data_ptr() | k.data_ptr() | v.data_ptr()) % ALIGN_BYTES == 0


def launch(k_out: torch.Tensor, v_out: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
    """``k_out[:, :, rows[i]] = k[:, :, i]`` and the same for v: ``[B, H, cap|q, D]``, ``rows [q]``."""
    B, H, _, D = k_out.shape
    q = rows.shape[0]
    if q == 0 or B * H == 0:
        return
    rows = to_device(rows, k_out.device).contiguous()
    grid, block_q, block_d, warps = config(q, B, H, D, k_out.element_size())
    count_launch("scatter_rows")
    fits, so, si = layout(k_out.shape, k_out.stride(), v_out.stride(), k.shape, k.stride(), v.stride(),
                          k_out.element_size())
    if fits and (k_out.data_ptr() | v_out.data_ptr() | k.data_ptr() | v.data_ptr()) % ALIGN_BYTES == 0:
        _scatter_rows_aligned[grid](
            k_out, v_out, k, v, rows, q, so[0], so[1], so[2], si[0], si[1], si[2],
            H=H, D=D, VEC=16 // k_out.element_size(), BLOCK_Q=block_q, BLOCK_D=block_d, num_warps=warps,
        )
    else:
        _scatter_rows_generic[grid](
            k_out, v_out, k, v, rows, q, *k_out.stride(), *v_out.stride(), *k.stride(), *v.stride(),
            H=H, D=D, BLOCK_Q=block_q, BLOCK_D=block_d, num_warps=warps,
        )
