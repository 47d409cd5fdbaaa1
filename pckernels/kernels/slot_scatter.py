"""Slot scatter: write freshly computed K/V rows into given rows of one layer's buffer, in place.

``k_out, v_out [B, H, cap, D]``, ``k, v [B, H, q, D]``, ``rows [q]`` int32/int64:
``k_out[:, :, rows[i]] = k[:, :, i]``. Duplicate rows leave an unspecified winner
(as ``index_copy_``). Pure loads/stores, no arithmetic: bit-exact for every dtype.
"""

from __future__ import annotations

import torch

from pckernels.kernels._common import HAS_TRITON, count_launch, next_pow2, tl, triton


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


if HAS_TRITON:

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


def scatter_rows_triton(
    k_out: torch.Tensor, v_out: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor,
    launch=None,
) -> None:
    """Triton path: one launch writes the K and V rows of all batch entries and heads.

    ``launch`` wraps the kernel (``torch.library.wrap_triton`` inside a ``triton_op``).
    """
    B, H, _, D = k_out.shape
    q = rows.shape[0]
    if q == 0 or B * H == 0:
        return
    if rows.device != k_out.device:
        rows = rows.to(k_out.device, non_blocking=True)
    block_d = next_pow2(D)
    block_q = min(next_pow2(q), max(1, 4096 // block_d))
    grid = (triton.cdiv(q, block_q), B * H)
    kernel = _scatter_rows_kernel if launch is None else launch(_scatter_rows_kernel)
    count_launch("scatter_rows")
    kernel[grid](
        k_out, v_out, k, v, rows, H, q, D, rows.stride(0),
        *k_out.stride(), *v_out.stride(), *k.stride(), *v.stride(),
        BLOCK_Q=block_q, BLOCK_D=block_d,
    )
