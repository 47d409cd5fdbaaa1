"""Gather + rotate: gather-concat's copy of row ranges of cached KV blocks into the assembly buffer /
arena, with each range's keys re-rotated by its own position delta on the way.

``out [L, 2, H, cap, D]``, ``blocks[b] [L, 2, H, n_b, D]``, ``table [M, 5]`` rows ``(block, src_row,
dst_row, n_rows, delta)``, ``inv_freq [L, half]`` float32. Keys move from position p to p + delta by
``R(delta)`` (rotate-half over the first ``2 * half`` dims, fp32 math, no attention scaling: the
keys already carry it); layer ``l`` rotates with its own ``inv_freq[l]`` (models mix RoPE bases per
layer, or leave layers unrotated: a zero row is the identity, bit for bit); values and the
non-rotary dims of keys are copied bit-exactly. Here: the checks, the torch-native path and the
entry to the Triton path (:mod:`.kernel`, imported on first use); the reference is in :mod:`.naive`.
"""

from __future__ import annotations

import torch

from pckernels.kernels.gather_concat import check_gather_args, check_table_host

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


def gather_rotate_triton(out: torch.Tensor, blocks: list[torch.Tensor], table: torch.Tensor,
                         inv_freq: torch.Tensor, max_rows: int = -1) -> None:
    """Triton path, one launch for the whole table (:func:`.kernel.launch`; imports Triton)."""
    from pckernels.kernels.gather_rotate import kernel

    kernel.launch(out, blocks, table, inv_freq, max_rows)
