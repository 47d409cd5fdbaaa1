"""Plain-torch references for every kernel: obvious loops, no tricks, used by the tests.

Shapes: a KV block is ``[L, 2, H, n, D]``, the assembly buffer ``[L, 2, H, cap, D]``;
per-layer K/V tensors are ``[B, H, rows, D]``; RoPE inputs are ``[B, H, S, D]``.
"""

from __future__ import annotations

import torch


def gather_concat_ref(out: torch.Tensor, blocks: list[torch.Tensor], table: torch.Tensor) -> None:
    """Row by row: ``out[:, :, :, dst + i] = blocks[b][:, :, :, src + i]`` for each table entry ``(b, src, dst, n)``."""
    for b, src, dst, n in table.tolist():
        for i in range(n):
            out[:, :, :, dst + i] = blocks[b][:, :, :, src + i]


def scatter_rows_ref(
    k_out: torch.Tensor, v_out: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor
) -> None:
    """Row by row: ``k_out[:, :, rows[i]] = k[:, :, i]`` (and the same for ``v``)."""
    for i, r in enumerate(rows.tolist()):
        k_out[:, :, r] = k[:, :, i]
        v_out[:, :, r] = v[:, :, i]


def rotate_half_ref(x: torch.Tensor) -> torch.Tensor:
    """``cat(-x2, x1)`` over the last dimension, halves ``x1 | x2``."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def cos_sin_ref(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF convention: ``positions [..., S]`` -> fp32 ``cos, sin [..., S, 2 * len(inv_freq)]``."""
    freqs = positions[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def rope_cos_sin_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, S, D]`` by ``cos, sin [B|1, S, R]`` (R <= D, rest passes through), in fp32.

    Returns fp32; callers round to the dtype they compare in.
    """
    r = cos.shape[-1]
    xf = x.float()
    rot = xf[..., :r] * cos[:, None].float() + rotate_half_ref(xf[..., :r]) * sin[:, None].float()
    return torch.cat((rot, xf[..., r:]), dim=-1)


def rope_at_positions_ref(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> torch.Tensor:
    """``x [B, H, S, D]`` rotated at ``positions [S]`` or ``[B, S]``; fp32 math, result in ``x.dtype``."""
    pos = positions if positions.dim() == 2 else positions[None]
    cos, sin = cos_sin_ref(pos, inv_freq, attention_scaling)
    return rope_cos_sin_ref(x, cos, sin).to(x.dtype)


def rerotate_keys_ref(k: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys already rotated at p, ``k [B, H, n, D]``, moved to p + delta: apply R(delta), no scaling."""
    delta = delta.expand(k.shape[-2]) if delta.dim() == 0 else delta
    return rope_at_positions_ref(k, delta, inv_freq, 1.0)


def gather_rotate_ref(out: torch.Tensor, blocks: list[torch.Tensor], table: torch.Tensor,
                      inv_freq: torch.Tensor) -> None:
    """Row by row: gather-concat's copy for each entry ``(b, src, dst, n, delta)`` of ``table``,
    then layer ``l``'s keys of the copied rows rotated by ``delta`` with ``inv_freq [L, half]``."""
    for b, src, dst, n, delta in table.tolist():
        for i in range(n):
            out[:, :, :, dst + i] = blocks[b][:, :, :, src + i]
        if not n or not inv_freq.shape[1]:
            continue
        for layer in range(out.shape[0]):
            keys = out[layer, 0, :, dst:dst + n][None]
            moved = rerotate_keys_ref(keys, torch.tensor(delta), inv_freq[layer])
            out[layer, 0, :, dst:dst + n] = moved[0]
