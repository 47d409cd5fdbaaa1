"""Plain-torch references of gather + rotate and of the key re-rotation it applies: obvious
loops, no tricks, used by the tests (and by :mod:`pckernels.integration.positions`' probe)."""

from __future__ import annotations

import torch


def rerotate_keys_ref(k: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys already rotated at p, ``k [B, H, n, D]``, moved to p + delta: ``R(delta) k`` over the first
    ``2 * len(inv_freq)`` dims (rotate-half, HF's fp32 angle, no scaling), the rest passed through.

    ``delta`` is 0-d, ``[n]`` or ``[B, n]``; fp32 math, result in ``k.dtype``.
    """
    delta = delta.expand(k.shape[-2]) if delta.dim() == 0 else delta
    freqs = (delta if delta.dim() == 2 else delta[None])[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    r = cos.shape[-1]
    kf = k.float()
    x1, x2 = kf[..., :r // 2], kf[..., r // 2:r]
    rot = kf[..., :r] * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rot, kf[..., r:]), dim=-1).to(k.dtype)


def gather_rotate_ref(out: torch.Tensor, blocks: list[torch.Tensor], table: torch.Tensor,
                      inv_freq: torch.Tensor) -> None:
    """Row by row: gather-concat's copy for each entry ``(b, src, dst, n, delta)`` of ``table [M, 5]``,
    then layer ``l``'s keys of the copied rows rotated by ``delta`` with ``inv_freq [L, half]``.

    ``out [L, 2, H, cap, D]``, ``blocks[b] [L, 2, H, n_b, D]``.
    """
    for b, src, dst, n, delta in table.tolist():
        for i in range(n):
            out[:, :, :, dst + i] = blocks[b][:, :, :, src + i]
        if not n or not inv_freq.shape[1]:
            continue
        for layer in range(out.shape[0]):
            keys = out[layer, 0, :, dst:dst + n][None]
            moved = rerotate_keys_ref(keys, torch.tensor(delta), inv_freq[layer])
            out[layer, 0, :, dst:dst + n] = moved[0]
