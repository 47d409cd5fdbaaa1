"""Plain-torch references of the RoPE extras (HF conventions): obvious code, no tricks, used by the tests.

RoPE inputs are ``[B, H, S, D]``; re-rotation of cached keys is
:func:`pckernels.kernels.gather_rotate.naive.rerotate_keys_ref`.
"""

from __future__ import annotations

import torch


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
