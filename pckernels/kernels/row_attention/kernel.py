"""Row attention's Triton kernels: split-KV attention (flash-decoding style) for a few queries.

Launch 1 (:func:`_row_attention_split`), grid ``(splits, Hkv)``: a program takes one KV head and
one stretch of ``split_len`` rows, and all ``Hq / Hkv * n`` query rows that read that head as one
``[BLOCK_M, D]`` tile — so each key and value row is loaded once per KV head, not once per query
head. It narrows its stretch to the rows its queries may see (``min(start) .. max(stop)``; a
stretch outside is skipped), runs an online softmax over ``BLOCK_N``-row tiles with the mask
computed from ``seen``/``group``/positions, and writes its partial output, running max and sum
(fp32) to a workspace. Launch 2 (:func:`_row_attention_combine`), grid ``(Hq / Hkv * n, Hkv)``:
rescales and sums the partials of one query row and writes it in the output dtype.

Splits spread a decode step's few programs over the GPU: with 8 KV heads and one split each, an
H100's 132 SMs would sit mostly idle. :func:`split_plan` cuts each head's rows into enough
stretches for about two programs per SM. Rows come as 16-byte vectors (innermost stride 1 is
required; the launcher copies a tensor that lacks it). fp32 inputs multiply in IEEE fp32 (no TF32).
Keys and values of rows no query of the tile sees are not read (a NaN there contributes nothing,
and a step's rows of other requests cost no bandwidth: the dense path reads every row up to the
extent). Under the interpreter
(tests on CPU) ``tl.dot`` of bf16 tiles returns garbage and bf16 stores are wrong, so there the
tiles are multiplied in fp32 (after the same rounding of the weights to the values' dtype) and the
output is rounded by hand (``UPCAST``, ``ROUND_BF16``); compiled, neither is used.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pckernels.kernels._common import INTERPRET, as_bits, count_launch, next_pow2
from pckernels.kernels._triton_common import store_rounded

PROGRAMS_PER_SM = 2
INTERPRET_PROGRAMS = 4
"""Programs aimed at when no GPU is there to ask (the interpreter): a few splits, so tests cross them."""


@triton.jit
def _row_attention_split(
    q_ptr, k_ptr, v_ptr, seen_ptr, group_ptr, qpos_ptr, kpos_ptr, start_ptr, stop_ptr, acc_ptr, stat_ptr,
    n, kv, split_len, window, scale,
    s_qh, s_qn, s_kh, s_kn, s_vh, s_vn, s_seen,
    GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    heads = tl.num_programs(1)
    m = tl.arange(0, BLOCK_M)
    row_ok = m < GROUPS * n
    i = m % n
    qh = (kvh * GROUPS + m // n).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    qv = tl.load(q_ptr + qh[:, None] * s_qh + i[:, None] * s_qn + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                 other=0.0)
    grp = tl.load(group_ptr + i, mask=row_ok, other=0).to(tl.int32)
    qpos = tl.load(qpos_ptr + i, mask=row_ok, other=0).to(tl.int32)
    lo = tl.where(row_ok, tl.load(start_ptr + i, mask=row_ok, other=0), kv)
    hi = tl.where(row_ok, tl.load(stop_ptr + i, mask=row_ok, other=0), 0)
    first = tl.maximum(split * split_len, tl.min(lo, axis=0))
    last = tl.minimum(tl.minimum(split * split_len + split_len, kv), tl.max(hi, axis=0))
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = k_ptr + kvh.to(tl.int64) * s_kh
    v_base = v_ptr + kvh.to(tl.int64) * s_vh
    for first_n in range(first, last, BLOCK_N):
        cols = first_n + tl.arange(0, BLOCK_N)
        c_ok = cols < last
        kpos = tl.load(kpos_ptr + cols, mask=c_ok, other=0).to(tl.int32)
        sn = tl.load(seen_ptr + grp[:, None] * s_seen + cols[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0)
        ok = (sn != 0) & (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None]) & (kpos[None, :] <= qpos[:, None])
        if HAS_WINDOW:
            ok = ok & ((qpos[:, None] - kpos[None, :]) < window)
        used = tl.max(ok.to(tl.int32), axis=0) > 0  # rows some query of the tile sees: only those are read
        kt = tl.load(k_base + cols[:, None].to(tl.int64) * s_kn + d[None, :],
                     mask=(c_ok & used)[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            s = tl.dot(qv.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision=PRECISION) * scale
        else:
            s = tl.dot(qv, tl.trans(kt), input_precision=PRECISION) * scale
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_base + cols[:, None].to(tl.int64) * s_vn + d[None, :],
                     mask=(c_ok & used)[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype).to(tl.float32), vt.to(tl.float32),
                                                input_precision=PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m_i = m_new
    slot = (split * heads + kvh).to(tl.int64)
    tl.store(acc_ptr + slot * (BLOCK_M * BLOCK_D) + m[:, None] * BLOCK_D + d[None, :], acc)
    tl.store(stat_ptr + slot * (2 * BLOCK_M) + m, m_i)
    tl.store(stat_ptr + slot * (2 * BLOCK_M) + BLOCK_M + m, l_i)


@triton.jit
def _row_attention_combine(
    acc_ptr, stat_ptr, out_ptr, n, splits, s_on, s_oh,
    GROUPS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    m = tl.program_id(0)
    kvh = tl.program_id(1)
    heads = tl.num_programs(1)
    sp = tl.arange(0, BLOCK_S)
    sp_ok = sp < splits
    slot = (sp * heads + kvh).to(tl.int64)
    mx = tl.load(stat_ptr + slot * (2 * BLOCK_M) + m, mask=sp_ok, other=float("-inf"))
    total = tl.load(stat_ptr + slot * (2 * BLOCK_M) + BLOCK_M + m, mask=sp_ok, other=0.0)
    top = tl.max(mx, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(mx - top)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    part = tl.load(acc_ptr + slot[:, None] * (BLOCK_M * BLOCK_D) + m * BLOCK_D + d[None, :],
                   mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
    num = tl.sum(part * w[:, None], axis=0)
    den = tl.sum(total * w, axis=0)
    o = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    i = m % n
    qh = kvh * GROUPS + m // n
    store_rounded(out_ptr + i.to(tl.int64) * s_on + qh.to(tl.int64) * s_oh + d, o, d_ok, ROUND_BF16)


@functools.cache
def _programs(device_index: int) -> int:
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device_index).multi_processor_count


def config(groups: int, n: int, d: int, kv: int) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_D, warps, stages)``: the query tile (at least 16 rows, ``tl.dot``'s
    least), the key tile, the head dim padded to a power of two, and warps and pipeline stages.
    Chosen from offline sm_90 compiles (``python -m perf.kernels.ptx``) so that no register spills:
    at ``D = 128`` a 64-row query tile with 64-row key tiles on 4 warps spilled ~1 KB, with 32-row
    key tiles on 8 warps it needs 210 registers and spills nothing."""
    block_m = max(16, next_pow2(groups * n))
    block_d = max(16, next_pow2(d))
    wide = block_m * block_d >= 64 * 128
    block_n = 32 if wide or block_d > 128 else 64
    block_n = min(block_n, max(16, next_pow2(kv)))
    return block_m, block_n, block_d, 8 if wide else 4, 2


def split_plan(kv: int, kv_heads: int, block_n: int, programs: int) -> tuple[int, int]:
    """``(splits, split_len)``: each KV head's ``kv`` rows cut into stretches of whole ``block_n``
    tiles, as many as give about ``programs`` programs in all (at least one tile each)."""
    tiles = max(1, -(-kv // block_n))
    splits = min(tiles, max(1, -(-programs // kv_heads)))
    per = -(-tiles // splits)
    return -(-tiles // per), per * block_n


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor, group: torch.Tensor,
           query_pos: torch.Tensor, key_pos: torch.Tensor, start: torch.Tensor, stop: torch.Tensor, scale: float,
           window: int | None, splits: int = -1) -> torch.Tensor:
    """``[n, Hq, D]`` (see the package docstring); two launches, sizes from host integers only."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    seen = seen if seen.stride(-1) == 1 else seen.contiguous()
    hq, n, d = q.shape
    hkv, kv, _ = k.shape
    groups = hq // hkv
    out = torch.empty(n, hq, d, dtype=q.dtype, device=q.device)
    block_m, block_n, block_d, warps, stages = config(groups, n, d, kv)
    if splits < 1:
        programs = INTERPRET_PROGRAMS if INTERPRET or q.device.type != "cuda" else _programs(q.device.index or 0)
        splits, split_len = split_plan(kv, hkv, block_n, programs)
    else:
        tiles = max(1, -(-kv // block_n))
        per = -(-tiles // min(splits, tiles))
        splits, split_len = -(-tiles // per), per * block_n
    acc = torch.empty(splits, hkv, block_m, block_d, dtype=torch.float32, device=q.device)
    stat = torch.empty(splits, hkv, 2, block_m, dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _row_attention_split[(splits, hkv)](
        q, k, v, seen.view(torch.uint8), group, query_pos, key_pos, start, stop, acc, stat,
        n, kv, split_len, 0 if window is None else int(window), float(scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), seen.stride(0),
        GROUPS=groups, D=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, HAS_WINDOW=window is not None,
        PRECISION=precision, UPCAST=INTERPRET and q.dtype != torch.float32, num_warps=warps, num_stages=stages)
    round_bf16 = INTERPRET and out.dtype == torch.bfloat16  # the interpreter's bf16 stores are wrong
    _row_attention_combine[(groups * n, hkv)](
        acc, stat, as_bits(out) if round_bf16 else out, n, splits, out.stride(0), out.stride(1),
        GROUPS=groups, D=d, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_S=max(2, next_pow2(splits)),
        ROUND_BF16=round_bf16, num_warps=1 if block_d <= 128 else 2)
    count_launch("row_attention")
    return out
