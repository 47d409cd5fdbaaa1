"""The RoPE Triton kernel: one launch handles one or two tensors (q and k, with different head
counts); each program owns a block of ``BLOCK_S`` positions of one batch entry and ``HPP`` heads,
so cos/sin are computed once per program and reused across its heads."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pckernels.kernels._common import INTERPRET, as_bits, count_launch, next_pow2
from pckernels.kernels._triton_common import PRECISE_TRIG, libdevice, store_rounded


@triton.jit
def _rope_heads(
    x_ptr, o_ptr, h0, Hn, b, s, ms, j, mj, c1, s1, c2, s2, half, D,
    sx_b, sx_h, sx_s, sx_d, so_b, so_h, so_s, so_d,
    HPP: tl.constexpr, COPY_PASS: tl.constexpr, BLOCK_P: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    for hh in tl.static_range(HPP):
        h = (h0 + hh).to(tl.int64)
        msh = ms & ((s * 0 + h) < Hn)
        m = msh[:, None] & mj[None, :]
        xb = x_ptr + b * sx_b + h * sx_h + s[:, None] * sx_s
        ob = o_ptr + b * so_b + h * so_h + s[:, None] * so_s
        x1 = tl.load(xb + j[None, :] * sx_d, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xb + (j + half)[None, :] * sx_d, mask=m, other=0.0).to(tl.float32)
        store_rounded(ob + j[None, :] * so_d, x1 * c1 - x2 * s1, m, ROUND_BF16)
        store_rounded(ob + (j + half)[None, :] * so_d, x2 * c2 + x1 * s2, m, ROUND_BF16)
        if COPY_PASS:
            p = 2 * half + tl.arange(0, BLOCK_P)
            mp = msh[:, None] & (p < D)[None, :]
            xp = tl.load(xb + p[None, :] * sx_d, mask=mp, other=0.0).to(tl.float32)
            store_rounded(ob + p[None, :] * so_d, xp, mp, ROUND_BF16)

@triton.jit
def _rope_kernel(
    x0_ptr, o0_ptr, x1_ptr, o1_ptr, cos_ptr, sin_ptr, pos_ptr, inv_ptr, scaling,
    S, H0, H1, G0, half, D,
    sx0_b, sx0_h, sx0_s, sx0_d, so0_b, so0_h, so0_s, so0_d,
    sx1_b, sx1_h, sx1_s, sx1_d, so1_b, so1_h, so1_s, so1_d,
    sc_b, sc_s, sc_d, ss_b, ss_s, ss_d, sp_b, sp_s,
    FROM_POS: tl.constexpr, HAS_X1: tl.constexpr, COPY_PASS: tl.constexpr, PRECISE: tl.constexpr,
    HPP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_P: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    pid_s = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    g = tl.program_id(2)
    s = pid_s.to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    ms = s < S
    j = tl.arange(0, BLOCK_J)
    mj = j < half
    msj = ms[:, None] & mj[None, :]
    if FROM_POS:
        p = tl.load(pos_ptr + b * sp_b + s * sp_s, mask=ms, other=0).to(tl.float32)
        f = tl.load(inv_ptr + j, mask=mj, other=0.0).to(tl.float32)
        ang = p[:, None] * f[None, :]
        if PRECISE:
            c1 = libdevice.cos(ang) * scaling
            s1 = libdevice.sin(ang) * scaling
        else:
            c1 = tl.cos(ang) * scaling
            s1 = tl.sin(ang) * scaling
        c2 = c1
        s2 = s1
    else:
        cb = cos_ptr + b * sc_b + s[:, None] * sc_s
        sb = sin_ptr + b * ss_b + s[:, None] * ss_s
        c1 = tl.load(cb + j[None, :] * sc_d, mask=msj, other=0.0).to(tl.float32)
        c2 = tl.load(cb + (j + half)[None, :] * sc_d, mask=msj, other=0.0).to(tl.float32)
        s1 = tl.load(sb + j[None, :] * ss_d, mask=msj, other=0.0).to(tl.float32)
        s2 = tl.load(sb + (j + half)[None, :] * ss_d, mask=msj, other=0.0).to(tl.float32)
    if HAS_X1:
        if g >= G0:
            _rope_heads(
                x1_ptr, o1_ptr, (g - G0) * HPP, H1, b, s, ms, j, mj, c1, s1, c2, s2, half, D,
                sx1_b, sx1_h, sx1_s, sx1_d, so1_b, so1_h, so1_s, so1_d,
                HPP, COPY_PASS, BLOCK_P, ROUND_BF16,
            )
        else:
            _rope_heads(
                x0_ptr, o0_ptr, g * HPP, H0, b, s, ms, j, mj, c1, s1, c2, s2, half, D,
                sx0_b, sx0_h, sx0_s, sx0_d, so0_b, so0_h, so0_s, so0_d,
                HPP, COPY_PASS, BLOCK_P, ROUND_BF16,
            )
    else:
        _rope_heads(
            x0_ptr, o0_ptr, g * HPP, H0, b, s, ms, j, mj, c1, s1, c2, s2, half, D,
            sx0_b, sx0_h, sx0_s, sx0_d, so0_b, so0_h, so0_s, so0_d,
            HPP, COPY_PASS, BLOCK_P, ROUND_BF16,
        )


def launch(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], half: int, *, cos=None, sin=None, positions=None,
    inv_freq=None, scaling: float = 1.0,
) -> None:
    """Launch the RoPE kernel over one or two ``(x, out)`` pairs ``[B, H_i, S, D]`` sharing B, S, D and
    dtype (``out`` may be ``x``), rotated by HF's ``cos, sin [B|1, S, 2 * half]`` or at ``positions
    [B, S]`` with ``inv_freq [half]`` and ``scaling``."""
    x0, o0 = pairs[0]
    B, H0, S, D = x0.shape
    x1, o1 = pairs[1] if len(pairs) > 1 else (x0, o0)
    H1 = x1.shape[1] if len(pairs) > 1 else 0
    if B == 0 or S == 0 or half == 0 or H0 + H1 == 0:
        for x, o in pairs:
            if o is not x:
                o.copy_(x)
        return
    copy_pass = 2 * half < D and any(o is not x for x, o in pairs)
    round_bf16 = INTERPRET and x0.dtype == torch.bfloat16
    if round_bf16:
        o0, o1 = as_bits(o0), as_bits(o1)
    block_j = next_pow2(half)
    block_s = min(next_pow2(S), max(1, 2048 // block_j))
    hpp = min(next_pow2(max(H0, H1)), 4)
    g0 = triton.cdiv(H0, hpp)
    grid = (triton.cdiv(S, block_s), B, g0 + triton.cdiv(H1, hpp))
    if grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"rope grid {grid} exceeds CUDA limits")
    from_pos = positions is not None
    if from_pos:
        pos = positions
        csrc = ssrc = inv_freq
        cst = sst = (0, 0, 0)
        pst = pos.stride()
    else:
        pos = inv_freq = cos
        csrc, ssrc = cos.expand(B, S, cos.shape[-1]), sin.expand(B, S, sin.shape[-1])
        cst, sst = csrc.stride(), ssrc.stride()
        pst = (0, 0)
    count_launch("rope")
    _rope_kernel[grid](
        x0, o0, x1, o1, csrc, ssrc, pos, inv_freq, float(scaling),
        S, H0, H1, g0, half, D,
        *x0.stride(), *o0.stride(), *x1.stride(), *o1.stride(),
        *cst, *sst, *pst,
        FROM_POS=from_pos, HAS_X1=len(pairs) > 1, COPY_PASS=copy_pass, PRECISE=PRECISE_TRIG,
        HPP=hpp, BLOCK_S=block_s, BLOCK_J=block_j, BLOCK_P=next_pow2(max(D - 2 * half, 1)),
        ROUND_BF16=round_bf16,
    )
