"""RoPE at arbitrary positions, HF ``apply_rotary_pos_emb`` conventions (rotate-half).

For ``x [B, H, S, D]`` and a rotary width ``R = 2 * half <= D`` (partial rotary: the
last ``D - R`` dims pass through), with halves ``x1 = x[..., :half]``, ``x2 = x[..., half:R]``::

    out1 = x1 * cos1 - x2 * sin1        out2 = x2 * cos2 + x1 * sin2

where ``cos = [cos1 | cos2]`` comes either from HF's precomputed ``cos/sin [B|1, S, R]``
or from ``positions`` and ``inv_freq [half]`` as ``cos(pos * inv_freq) * attention_scaling``
(fp32 angle, exactly as HF's rotary embedding computes it). Math is fp32 with one rounding
to the output dtype. Re-rotating cached keys by a position delta is the same computation with
``positions = delta`` and no scaling: ``R(p + d) = R(d) R(p)``.

Here: the checks, the torch-native paths and the entries to the Triton path (:mod:`.kernel`,
imported on first use); the references are in :mod:`.naive`.
"""

from __future__ import annotations

import torch


def check_rope_x(x: torch.Tensor, half: int, name: str = "x") -> None:
    """``x`` must be fp32/fp16/bf16 ``[B, H, S, D]`` with ``2 * half <= D``."""
    if x.dim() != 4:
        raise ValueError(f"{name} must be [B, H, S, D], got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name} must be fp32/fp16/bf16, got {x.dtype}")
    if 2 * half > x.shape[-1]:
        raise ValueError(f"rotary width {2 * half} exceeds head dim {x.shape[-1]} of {name}")


def positions_2d(positions: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """``positions [S] | [1, S] | [B, S]`` (any int/float dtype) -> ``[B, S]`` view (stride 0 where broadcast)."""
    p = positions if positions.dim() == 2 else positions.reshape(1, -1)
    if p.shape[-1] != S or p.shape[0] not in (1, B):
        raise ValueError(f"positions must be [S], [1, S] or [B, S] with S={S}, B={B}, got {tuple(positions.shape)}")
    return p.expand(B, S)


def rope_positions_torch(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, out: torch.Tensor
) -> None:
    """Torch path: ``out = rope(x, positions)``; ``out`` may be ``x`` (in place)."""
    B, _, S, _ = x.shape
    half = inv_freq.shape[0]
    pos = positions_2d(positions, B, S).to(device=x.device, dtype=torch.float32)
    freqs = pos[..., None] * inv_freq.to(device=x.device, dtype=torch.float32)
    cos = (freqs.cos() * attention_scaling)[:, None]
    sin = (freqs.sin() * attention_scaling)[:, None]
    _rotate_into(x, out, cos, sin, cos, sin, half)


def rope_cos_sin_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor) -> None:
    """Torch path with HF's ``cos, sin [B|1, S, R]``: ``out = x * cos + rotate_half(x) * sin`` on the first R dims."""
    half = cos.shape[-1] // 2
    c = cos[:, None].float()
    s = sin[:, None].float()
    _rotate_into(x, out, c[..., :half], s[..., :half], c[..., half:], s[..., half:], half)


def _rotate_into(x, out, c1, s1, c2, s2, half: int) -> None:
    r = 2 * half
    x1 = x[..., :half].float()
    x2 = x[..., half:r].float()
    o1 = x1 * c1 - x2 * s1
    o2 = x2 * c2 + x1 * s2
    out[..., :half].copy_(o1)
    out[..., half:r].copy_(o2)
    if out is not x and r < x.shape[-1]:
        out[..., r:].copy_(x[..., r:])


def rope_positions_triton(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, out: torch.Tensor
) -> None:
    """Triton path of :func:`rope_positions_torch` (``out`` may be ``x``; imports Triton)."""
    from pckernels.extras.rope import kernel

    B, _, S, _ = x.shape
    kernel.launch([(x, out)], inv_freq.shape[0], positions=positions_2d(positions, B, S), inv_freq=inv_freq,
                  scaling=attention_scaling)


def rope_cos_sin_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor
) -> None:
    """Triton path of HF's ``apply_rotary_pos_emb``: q and k in one launch (imports Triton)."""
    from pckernels.extras.rope import kernel

    kernel.launch([(q, q_out), (k, k_out)], cos.shape[-1] // 2, cos=cos, sin=sin)
