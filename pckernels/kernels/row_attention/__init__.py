"""Row attention: a few new queries over many KV rows, each query seeing the rows its mask gives.

``q [Hq, n, D]`` over ``k, v [Hkv, kv, D]`` (grouped heads: query head ``h`` reads KV head
``h // (Hq // Hkv)``) -> ``[n, Hq, D]``. The mask is given by rows, not as a dense ``[n, kv]``
bias: ``seen [G, kv]`` (bool: the rows visibility group ``g`` may see), ``group [n]`` (each query's
group), ``query_pos [n]`` / ``key_pos [kv]`` (a query sees no row at a later position),
``start [n]`` / ``stop [n]`` (a query sees rows ``start[i] <= j < stop[i]`` only: what lets the
kernel skip whole stretches of rows) and an optional sliding ``window`` (positions). In the engine
a group is one request of the step: its modules' rows and its own (:mod:`naive` has the rule).
A row no query sees contributes nothing even when it holds NaN; a query that sees nothing gets 0.

Here: the checks, the torch path (grouped, fp32 scores) and the entry to the Triton path
(:mod:`.kernel`: split-KV, flash-decoding style, for up to :data:`MAX_ROWS` query rows per KV
head); the reference is in :mod:`.naive`.
"""

from __future__ import annotations

import torch

from pckernels.kernels.row_attention.naive import row_allowed

MAX_ROWS = 64
"""Query rows per KV head (``Hq // Hkv * n``) the Triton kernel holds in one tile; beyond that
the op runs the torch path."""

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX = (torch.int32, torch.int64)


def check_row_attention_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor,
                             group: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
                             start: torch.Tensor, stop: torch.Tensor) -> None:
    """Shape/dtype/device checks (no device sync): ``ValueError`` naming the argument."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"q must be [Hq, n, D] and k, v [Hkv, kv, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    hq, n, d = q.shape
    hkv, kv, dk = k.shape
    if dk != d or hkv == 0 or hq % hkv:
        raise ValueError(f"q [Hq={hq}, n, D={d}] does not fit k [Hkv={hkv}, kv, D={dk}] (Hq a multiple of Hkv)")
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype of {DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if seen.dim() != 2 or seen.shape[1] != kv or seen.dtype != torch.bool:
        raise ValueError(f"seen must be bool [G, {kv}], got {seen.dtype} {tuple(seen.shape)}")
    for name, t, size in (("group", group, n), ("query_pos", query_pos, n), ("key_pos", key_pos, kv),
                          ("start", start, n), ("stop", stop, n)):
        if t.dim() != 1 or t.shape[0] != size or t.dtype not in _INDEX:
            raise ValueError(f"{name} must be int32/int64 [{size}], got {t.dtype} {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v), ("seen", seen), ("group", group), ("query_pos", query_pos),
                    ("key_pos", key_pos), ("start", start), ("stop", stop)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")


def row_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor, group: torch.Tensor,
                        query_pos: torch.Tensor, key_pos: torch.Tensor, start: torch.Tensor, stop: torch.Tensor,
                        scale: float, window: int | None = None) -> torch.Tensor:
    """Torch path: the mask expanded to ``[n, kv]``, scores of each KV head's query rows in one
    batched fp32 matmul (``[Hkv, Hq/Hkv * n, kv]``), unseen rows' values zeroed -> ``[n, Hq, D]``."""
    hq, n, d = q.shape
    hkv, kv, _ = k.shape
    groups = hq // hkv
    allowed = row_allowed(seen, group, query_pos, key_pos, start, stop, window)
    scores = torch.bmm(q.float().reshape(hkv, groups * n, d), k.float().transpose(1, 2)).mul_(scale)
    scores = scores.view(hkv, groups, n, kv).masked_fill_(~allowed, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isinf(top), 0.0, top)
    weights = torch.exp(scores - top)
    total = weights.sum(dim=-1, keepdim=True)
    values = torch.where(allowed.any(dim=0)[:, None], v.float(), 0.0)
    out = torch.bmm(weights.view(hkv, groups * n, kv), values).view(hkv, groups, n, d)
    out = torch.where(total > 0, out / total.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return out.view(hq, n, d).transpose(0, 1).to(q.dtype).contiguous()


def triton_fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the Triton kernel takes this launch: at most :data:`MAX_ROWS` query rows per KV
    head and a head dim of at most 256 (larger tiles spill registers: :func:`.kernel.config`)."""
    return q.shape[0] // k.shape[0] * q.shape[1] <= MAX_ROWS and q.shape[2] <= 256


def row_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor, group: torch.Tensor,
                         query_pos: torch.Tensor, key_pos: torch.Tensor, start: torch.Tensor, stop: torch.Tensor,
                         scale: float, window: int | None = None, splits: int = -1) -> torch.Tensor:
    """Triton path: two launches (split-KV partials, then their combination; :func:`.kernel.launch`;
    imports Triton). ``splits`` (-1: chosen for the device) sets how many stretches of rows each
    KV head is cut into."""
    from pckernels.kernels.row_attention import kernel

    return kernel.launch(q, k, v, seen, group, query_pos, key_pos, start, stop, scale, window, splits)
