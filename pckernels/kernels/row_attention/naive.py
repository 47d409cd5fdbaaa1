"""Plain-torch reference of row attention: one query head at a time in fp32, no tricks, used by the
tests (flash-linear-attention's ``naive.py`` habit)."""

from __future__ import annotations

import torch


def row_allowed(seen: torch.Tensor, group: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
                start: torch.Tensor, stop: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """``[n, kv]`` booleans: query ``i`` may attend row ``j`` when its group sees the row
    (``seen[group[i], j]``), the row lies in its range ``start[i] <= j < stop[i]``, the row's
    position is not after the query's (``key_pos[j] <= query_pos[i]``) and, with ``window``, less
    than ``window`` positions behind it."""
    kv = seen.shape[1]
    j = torch.arange(kv, device=seen.device)
    allowed = seen.bool()[group.long()]
    allowed &= (j[None, :] >= start.long()[:, None]) & (j[None, :] < stop.long()[:, None])
    allowed &= key_pos.long()[None, :] <= query_pos.long()[:, None]
    if window is not None:
        allowed &= (query_pos.long()[:, None] - key_pos.long()[None, :]) < window
    return allowed


def row_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seen: torch.Tensor, group: torch.Tensor,
                      query_pos: torch.Tensor, key_pos: torch.Tensor, start: torch.Tensor, stop: torch.Tensor,
                      scale: float, window: int | None = None) -> torch.Tensor:
    """``q [Hq, n, D]`` over ``k, v [Hkv, kv, D]`` (query head ``h`` reads KV head
    ``h // (Hq // Hkv)``) under :func:`row_allowed` -> ``[n, Hq, D]`` in ``q``'s dtype. A row no
    query may see contributes nothing even if it holds NaN; a query that sees no row gets zeros."""
    hq, n, _ = q.shape
    groups = hq // k.shape[0]
    allowed = row_allowed(seen, group, query_pos, key_pos, start, stop, window)
    used = allowed.any(dim=0)
    out = torch.zeros(n, hq, q.shape[2], dtype=torch.float32, device=q.device)
    for h in range(hq):
        keys = k[h // groups].float()
        values = torch.where(used[:, None], v[h // groups].float(), 0.0)
        for i in range(n):
            if not allowed[i].any():
                continue
            scores = (keys[allowed[i]] @ q[h, i].float()) * scale
            weights = torch.softmax(scores, dim=0)
            out[i, h] = weights @ values[allowed[i]]
    return out.to(q.dtype)
