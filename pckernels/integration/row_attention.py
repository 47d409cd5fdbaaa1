"""Attention over the arena's rows with the mask given by rows: the backends beside dense SDPA.

A step's mask is, per query, "the rows of my request that are not after me": its request's
visible rows (modules and own) and its position. The dense path (:mod:`.attention`) expands that
to an additive ``[q, kv]`` bias and runs SDPA over every row up to the step's extent. For a few
new tokens over many rows two backends read it from the rows instead (:class:`RowMask`):

* ``"flex"`` — torch's FlexAttention: a ``mask_mod`` over the rows' validity and positions, and a
  block-sparse ``BlockMask`` (``create_block_mask``, built once per forward and shared by the
  layers) so blocks no query sees are skipped. Compiled (``torch.compile``) on CUDA; eager on the
  CPU, where torch runs its unfused reference (correct, slow: for tests). Rows inside a visible
  block must be finite (the arena zeroes new rows).
* ``"split_kv"`` — :func:`pckernels.ops.row_attention`: the split-KV Triton kernel for up to 16
  new tokens and 64 query rows per KV head (16 tokens at 4 query heads per KV head); a call beyond
  that runs dense.

:data:`ATTENTION_BACKENDS` names them; ``"auto"`` is ``"dense"`` everywhere until a GPU run
decides (:func:`resolve_attention`). A backend is used only where it applies (no sliding windows,
ALiBi or softcap; the adapter and :func:`pckernels.integration.attention.promptcache_attention`
check): otherwise the forward keeps the dense path.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from pckernels.kernels.row_attention.naive import row_allowed

log = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "dense", "flex", "split_kv")
SPLIT_KV_MAX_TOKENS = 16
"""New tokens up to which ``"split_kv"`` runs the kernel (more: the dense path)."""


@dataclass(frozen=True)
class RowMask:
    """Who attends to whom, by rows: query ``i`` sees row ``j`` when ``seen[group[i], j]`` and
    ``start[i] <= j < stop[i]`` and ``key_pos[j] <= query_pos[i]``. ``seen [G, kv]`` bool (a
    group: one request of the step), ``group [q]`` int, ``query_pos [q]``, ``key_pos [kv]``,
    ``start [q]``, ``stop [q]`` int (a query's rows lie in ``start .. stop - 1``: what lets a
    kernel skip rows)."""

    seen: torch.Tensor
    group: torch.Tensor
    query_pos: torch.Tensor
    key_pos: torch.Tensor
    start: torch.Tensor
    stop: torch.Tensor

    def allowed(self) -> torch.Tensor:
        """``[q, kv]`` booleans (the dense mask this stands for)."""
        return row_allowed(self.seen, self.group, self.query_pos, self.key_pos, self.start, self.stop)


def resolve_attention(name: str, device: torch.device) -> str:
    """The backend ``name`` runs on ``device``: ``"auto"`` is ``"dense"`` (no GPU measurement has
    chosen another yet: ``python -m perf.bench_attention --gpu``)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    return "dense" if name == "auto" else name


def attend_rows(backend: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: RowMask,
                scaling: float | None, memo: dict) -> torch.Tensor | None:
    """``query [1, Hq, q, D]`` over ``key, value [1, Hkv, kv, D]`` under ``rows`` with ``backend``
    -> ``[1, q, Hq, D]`` (HF's attention output), or None when the backend does not take this call
    (the caller runs the dense path). ``memo``: the forward's (a block mask is built once)."""
    if query.shape[0] != 1 or rows.seen.shape[1] != key.shape[2] or rows.group.shape[0] != query.shape[2]:
        return None
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if backend == "split_kv":
        from pckernels import ops
        from pckernels.kernels.row_attention import triton_fits

        if query.shape[2] > SPLIT_KV_MAX_TOKENS or not triton_fits(query[0], key[0]):
            return None  # the kernel's tile would not hold them: dense, not the op's torch path

        out = ops.row_attention(query[0], key[0], value[0], rows.seen, rows.group, rows.query_pos, rows.key_pos,
                                rows.start, rows.stop, scale=scale)
        return out[None]
    if backend == "flex":
        block_mask = memo.get(("flex", tuple(key.shape[2:3])))
        if block_mask is None:
            block_mask = memo[("flex", tuple(key.shape[2:3]))] = flex_block_mask(rows, query.shape[2], key.shape[2],
                                                                               query.device)
        out = _flex(query.device)(query, key, value, block_mask=block_mask, scale=scale,
                      enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2)
    return None


def mask_mod_for(rows: RowMask):
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` for ``rows``."""
    seen, group, query_pos, key_pos, start, stop = (rows.seen, rows.group, rows.query_pos, rows.key_pos, rows.start,
                                                    rows.stop)

    def mask_mod(b, h, q_idx, kv_idx):
        return (seen[group[q_idx], kv_idx] & (kv_idx >= start[q_idx]) & (kv_idx < stop[q_idx])
                & (key_pos[kv_idx] <= query_pos[q_idx]))

    return mask_mod


def flex_block_mask(rows: RowMask, q: int, kv: int, device: torch.device):
    """The block-sparse ``BlockMask`` of ``rows`` for ``q`` queries over ``kv`` rows."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod_for(rows), None, None, q, kv, device=device)


@functools.cache
def _flex_compiled():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex(device: torch.device):
    """FlexAttention: compiled on CUDA, torch's eager reference elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    return _flex_compiled() if device.type == "cuda" else flex_attention
