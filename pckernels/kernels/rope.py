"""RoPE at arbitrary positions, HF ``apply_rotary_pos_emb`` conventions (rotate-half).

For ``x [B, H, S, D]`` and a rotary width ``R = 2 * half <= D`` (partial rotary: the
last ``D - R`` dims pass through), with halves ``x1 = x[..., :half]``, ``x2 = x[..., half:R]``::

    out1 = x1 * cos1 - x2 * sin1        out2 = x2 * cos2 + x1 * sin2

where ``cos = [cos1 | cos2]`` comes either from HF's precomputed ``cos/sin [B|1, S, R]``
or from ``positions`` and ``inv_freq [half]`` as ``cos(pos * inv_freq) * attention_scaling``
(fp32 angle, exactly as HF's rotary embedding computes it). Math is fp32 with one rounding
to the output dtype. Re-rotating cached keys by a position delta is the same kernel with
``positions = delta`` and no scaling: ``R(p + d) = R(d) R(p)``.

One launch handles two tensors (q and k, with different head counts); each program owns a
block of ``BLOCK_S`` positions of one batch entry and ``HPP`` heads, so cos/sin are computed
once per program and reused across its heads.

**Gather + rotate** (``gather_rotate``): gather-concat's copy of row ranges of cached KV blocks
into the assembly buffer / arena, with each range's keys re-rotated by its own position delta on
the way, one launch for every range, layer, head, K and V. Layer ``l`` rotates with its own
``inv_freq[l]`` (models mix RoPE bases per layer, or leave layers unrotated: a zero row is the
identity, bit for bit); values and the non-rotary dims of keys are copied bit-exactly.
"""

from __future__ import annotations

import torch

from pckernels.kernels._common import HAS_TRITON, INTERPRET, as_bits, count_launch, next_pow2, tl, triton
from pckernels.kernels.gather_concat import check_gather_args, check_table_host, gather_grid, launch_tables

try:
    from triton.language.extra import libdevice
except ImportError:
    libdevice = None

_PRECISE_TRIG = libdevice is not None and not INTERPRET


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


if HAS_TRITON:

    @triton.jit
    def _store_rounded(ptr, val, mask, ROUND_BF16: tl.constexpr):
        """Store fp32 ``val``; with ROUND_BF16, ``ptr`` is an int16 view of bf16 and rounding is done by hand (RTNE)."""
        if ROUND_BF16:
            bits = val.to(tl.uint32, bitcast=True)
            rnd = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rnd = tl.where(val != val, 0x7FC0, rnd)
            tl.store(ptr, rnd.to(tl.int16), mask=mask)
        else:
            tl.store(ptr, val.to(ptr.dtype.element_ty), mask=mask)

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
            _store_rounded(ob + j[None, :] * so_d, x1 * c1 - x2 * s1, m, ROUND_BF16)
            _store_rounded(ob + (j + half)[None, :] * so_d, x2 * c2 + x1 * s2, m, ROUND_BF16)
            if COPY_PASS:
                p = 2 * half + tl.arange(0, BLOCK_P)
                mp = msh[:, None] & (p < D)[None, :]
                xp = tl.load(xb + p[None, :] * sx_d, mask=mp, other=0.0).to(tl.float32)
                _store_rounded(ob + p[None, :] * so_d, xp, mp, ROUND_BF16)

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


def _launch_rope(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], half: int, *, cos=None, sin=None, positions=None,
    inv_freq=None, scaling: float = 1.0, launch=None,
) -> None:
    """Launch the RoPE kernel over one or two ``(x, out)`` pairs sharing B, S, D and dtype."""
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
    kernel = _rope_kernel if launch is None else launch(_rope_kernel)
    count_launch("rope")
    kernel[grid](
        x0, o0, x1, o1, csrc, ssrc, pos, inv_freq, float(scaling),
        S, H0, H1, g0, half, D,
        *x0.stride(), *o0.stride(), *x1.stride(), *o1.stride(),
        *cst, *sst, *pst,
        FROM_POS=from_pos, HAS_X1=len(pairs) > 1, COPY_PASS=copy_pass, PRECISE=_PRECISE_TRIG,
        HPP=hpp, BLOCK_S=block_s, BLOCK_J=block_j, BLOCK_P=next_pow2(max(D - 2 * half, 1)),
        ROUND_BF16=round_bf16,
    )


def rope_positions_triton(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
    out: torch.Tensor, launch=None,
) -> None:
    """Triton path of :func:`rope_positions_torch` (``out`` may be ``x``)."""
    B, _, S, _ = x.shape
    pos = positions_2d(positions, B, S)
    _launch_rope([(x, out)], inv_freq.shape[0], positions=pos, inv_freq=inv_freq,
                 scaling=attention_scaling, launch=launch)


def rope_cos_sin_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_out: torch.Tensor, k_out: torch.Tensor, launch=None,
) -> None:
    """Triton path of HF's ``apply_rotary_pos_emb``: q and k in one launch."""
    _launch_rope([(q, q_out), (k, k_out)], cos.shape[-1] // 2, cos=cos, sin=sin, launch=launch)


GATHER_ROTATE_CHUNK = 512 * 1024
"""Bytes of keys per thread the CPU path rotates at a time (fits a core's L2 with its output)."""


def check_gather_rotate_args(out: torch.Tensor, blocks: list[torch.Tensor], table: torch.Tensor,
                             inv_freq: torch.Tensor) -> None:
    """Checks that need no device sync: ``out [L, 2, H, cap, D]`` fp32/fp16/bf16, blocks
    ``[L, 2, H, n_b, D]`` like it, ``table [M, 5]`` integer ``(block, src_row, dst_row, n_rows,
    delta)``, ``inv_freq [L, half]`` float32 with ``2 * half <= D``."""
    if table.dim() != 2 or table.shape[1] != 5 or table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"table must be an int32/int64 [M, 5] tensor, got {table.dtype} {tuple(table.shape)}")
    check_gather_args(out, blocks, table[:, :4])
    if out.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"out must be fp32/fp16/bf16, got {out.dtype}")
    L, D = out.shape[0], out.shape[4]
    if inv_freq.dim() != 2 or inv_freq.shape[0] != L or 2 * inv_freq.shape[1] > D or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be float32 [{L}, half] with 2 * half <= {D}, got {inv_freq.dtype} "
                         f"{tuple(inv_freq.shape)}")


def gather_rotate_torch(out: torch.Tensor, blocks: list[torch.Tensor], table: torch.Tensor,
                        inv_freq: torch.Tensor) -> None:
    """Torch path: per table entry one copy of the values and the rotated keys computed from the
    source straight into ``out`` (fp32 math). In fp32 the keys go in cache-sized pieces of
    ``GATHER_ROTATE_CHUNK`` bytes per thread, each a multiply by ``[cos, cos, 1]`` over whole rows
    and two fused multiply-adds for the ``-x2 sin`` and ``+x1 sin`` halves, so the second and third
    pass read from cache (bitwise the same arithmetic as multiply-then-add per half)."""
    entries = table.tolist()
    check_table_host([e[:4] for e in entries], blocks, out.shape[3])
    half = inv_freq.shape[1]
    r = 2 * half
    L, _, H, _, D = out.shape
    trig: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    rows = max(1, GATHER_ROTATE_CHUNK * torch.get_num_threads() // (H * D * out.element_size()))
    for b, src, dst, n, delta in entries:
        if not n:
            continue
        o = out[:, :, :, dst:dst + n]
        x = blocks[b][:, :, :, src:src + n]
        if not delta or not half:
            o.copy_(x)
            continue
        o[:, 1].copy_(x[:, 1])
        if delta not in trig:
            ang = float(delta) * inv_freq.to(device=out.device, dtype=torch.float32)
            cos = ang.cos()
            full = torch.cat([cos, cos, cos.new_ones(L, D - r)], -1)
            trig[delta] = full[:, None, None], ang.sin()[:, None, None]
        c, s = trig[delta]
        k, ko = x[:, 0], o[:, 0]
        if out.dtype == torch.float32 and k.dtype == torch.float32:
            for layer in range(L):
                cl, sl = c[layer], s[layer]
                for a in range(0, n, rows):
                    kk, oo = k[layer, :, a:a + rows], ko[layer, :, a:a + rows]
                    torch.mul(kk, cl, out=oo)
                    oo[..., :half].addcmul_(kk[..., half:r], sl, value=-1.0)
                    oo[..., half:r].addcmul_(kk[..., :half], sl)
            continue
        if r < D:
            ko[..., r:].copy_(k[..., r:])
        x1 = k[..., :half].float()
        x2 = k[..., half:r].float()
        ko[..., :half].copy_(x1 * c[..., :half] - x2 * s)
        ko[..., half:r].copy_(x2 * c[..., :half] + x1 * s)


if HAS_TRITON:
    from pckernels.kernels.gather_concat import _source_rows

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
        src_rows, s_d, l, kv, h = _source_rows(out_ptr, meta_ptr, blk, plane, H, src, r, META_W)
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
                    _store_rounded(bits_ptr + o1, x1 * c - x2 * s, mrj, True)
                    _store_rounded(bits_ptr + o2, x2 * c + x1 * s, mrj, True)
                else:
                    _store_rounded(out_ptr + o1, x1 * c - x2 * s, mrj, False)
                    _store_rounded(out_ptr + o2, x2 * c + x1 * s, mrj, False)
        mask = mr[:, None] & ((d >= lo) & (d < D))[None, :]
        vals = tl.load(src_rows + d[None, :] * s_d, mask=mask)
        tl.store(out_ptr + dst_rows + d[None, :] * so_d, vals, mask=mask)


def gather_rotate_triton(out: torch.Tensor, blocks: list[torch.Tensor], table: torch.Tensor,
                         inv_freq: torch.Tensor, max_rows: int = -1) -> None:
    """Triton path: one launch for the whole table (``max_rows`` as in gather-concat's)."""
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
        HAS_ROT=half > 0, PRECISE=_PRECISE_TRIG, ROUND_BF16=round_bf16,
        BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_J=next_pow2(half), META_W=6,
    )
