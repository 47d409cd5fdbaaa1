"""Slot scatter's Triton kernel: one launch writes the K and V rows of all batch entries and heads."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pckernels.kernels._common import count_launch, next_pow2


@triton.jit
def _scatter_rows_kernel(
    ko_ptr, vo_ptr, k_ptr, v_ptr, rows_ptr, H, q, D, s_rows,
    sko_b, sko_h, sko_r, sko_d,
    svo_b, svo_h, svo_r, svo_d,
    sk_b, sk_h, sk_r, sk_d,
    sv_b, sv_h, sv_r, sv_d,
    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_q = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    i = pid_q.to(tl.int64) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    d = tl.arange(0, BLOCK_D)
    mi = i < q
    mask = mi[:, None] & (d < D)[None, :]
    r = tl.load(rows_ptr + i * s_rows, mask=mi, other=0).to(tl.int64)
    kv = tl.load(k_ptr + b * sk_b + h * sk_h + i[:, None] * sk_r + d[None, :] * sk_d, mask=mask)
    tl.store(ko_ptr + b * sko_b + h * sko_h + r[:, None] * sko_r + d[None, :] * sko_d, kv, mask=mask)
    vv = tl.load(v_ptr + b * sv_b + h * sv_h + i[:, None] * sv_r + d[None, :] * sv_d, mask=mask)
    tl.store(vo_ptr + b * svo_b + h * svo_h + r[:, None] * svo_r + d[None, :] * svo_d, vv, mask=mask)


def launch(k_out: torch.Tensor, v_out: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> None:
    """``k_out[:, :, rows[i]] = k[:, :, i]`` and the same for v: ``[B, H, cap|q, D]``, ``rows [q]``."""
    B, H, _, D = k_out.shape
    q = rows.shape[0]
    if q == 0 or B * H == 0:
        return
    if rows.device != k_out.device:
        rows = rows.to(k_out.device, non_blocking=True)
    block_d = next_pow2(D)
    block_q = min(next_pow2(q), max(1, 4096 // block_d))
    grid = (triton.cdiv(q, block_q), B * H)
    count_launch("scatter_rows")
    _scatter_rows_kernel[grid](
        k_out, v_out, k, v, rows, H, q, D, rows.stride(0),
        *k_out.stride(), *v_out.stride(), *k.stride(), *v.stride(),
        BLOCK_Q=block_q, BLOCK_D=block_d,
    )
