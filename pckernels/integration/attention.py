"""The attention vocabulary shared by the adapters and the native forward.

:class:`AttentionSpec` says who attends to whom in one forward (an additive mask and the schema
positions of queries and keys); :class:`KVLayout` is the shape of a model's cached keys and
values. The rest turns a spec into what a model's attention takes: sliding windows and ALiBi by
schema position, the visible key extent of query chunks, SDPA over grouped KV heads, and
:func:`promptcache_attention` — the attention function registered once in transformers'
``AttentionInterface`` and selected per model instance, which reads the running forward's state
from a ``ContextVar`` (:func:`current_forward`), never from module globals.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable

import torch

from pckernels.integration.row_attention import RowMask, attend_rows

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class AttentionSpec:
    """Who attends to whom in one forward.

    ``bias [q, kv]``: additive, 0 where query i may attend key j and -inf elsewhere, in the
    model's dtype. ``query_pos [q]`` and ``key_pos [kv]``: the schema positions of queries and
    keys, for families whose attention depends on them beyond RoPE (sliding windows, ALiBi).
    ``rows``: the same mask by rows (:class:`~pckernels.integration.row_attention.RowMask`), for
    the row-attention backends; None where the step did not build it (dense attention only).
    """

    bias: torch.Tensor
    query_pos: torch.Tensor
    key_pos: torch.Tensor
    rows: RowMask | None = None


@dataclass(frozen=True)
class KVLayout:
    """KV cache shape per layer: ``[1, num_kv_heads, tokens, head_dim]`` for ``num_layers`` layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def windowed_bias(spec: AttentionSpec, window: int | None) -> torch.Tensor:
    """``spec.bias [q, kv]`` restricted to keys less than ``window`` positions behind the query
    (HF's sliding-window rule ``query_pos - key_pos < window``, applied to schema positions)."""
    if window is None:
        return spec.bias
    inside = (spec.query_pos[:, None] - spec.key_pos[None, :]) < window
    return spec.bias.masked_fill(~inside, float("-inf"))


def alibi_bias(slopes: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """ALiBi from positions (the paper's lookup table): ``slopes [H]`` times
    ``key_pos - query_pos`` -> ``[H, q, kv]`` in ``dtype``. Keys carry no position under ALiBi,
    so this is the only place their schema positions enter attention."""
    distance = (key_pos[None, :] - query_pos[:, None]).to(torch.float32)
    return (slopes.to(torch.float32)[:, None, None] * distance[None]).to(dtype)


QUERY_CHUNK = 256
"""Query rows per SDPA call when a long masked forward runs on CPU (:func:`promptcache_attention` and
the native forward)."""

ATTENTION = "promptcache_sdpa"
"""Name under which :func:`promptcache_attention` is registered in transformers' ``AttentionInterface``."""


@dataclass
class ForwardState:
    """What one promptcache forward tells the code it reaches inside the model: the attention
    spec, the adapter's CPU attention settings, the attention backend (``"dense"``, ``"flex"``,
    ``"split_kv"``: :mod:`~pckernels.integration.row_attention`), and memos made during the forward. Held in a
    ``ContextVar`` for the duration of :meth:`ModelAdapter.forward`, so concurrent forwards in
    other threads (and baseline forwards of any model) never see it."""

    spec: AttentionSpec
    query_chunk: int | None
    grouped_kv: bool
    memo: dict = field(default_factory=dict)
    backend: str = "dense"

    def alibi(self, slopes: torch.Tensor, *, per_query: bool = True) -> torch.Tensor:
        """ALiBi from schema positions for ``slopes [H]``: ``[H, q, kv]``, or ``[H, 1, kv]`` against
        the last query (``per_query=False``; the per-query offset it drops is softmax-invariant)."""
        key = ("alibi", slopes.data_ptr(), per_query)
        if key not in self.memo:
            spec = self.spec
            query = spec.query_pos if per_query else spec.query_pos.max().reshape(1)
            self.memo[key] = alibi_bias(slopes.to(spec.key_pos.device), query, spec.key_pos, spec.bias.dtype)
        return self.memo[key]


_FORWARD: ContextVar[ForwardState | None] = ContextVar("promptcache_forward", default=None)


def current_forward() -> ForwardState | None:
    """The promptcache forward running in this context, or None (baseline, or not ours)."""
    return _FORWARD.get()


@contextlib.contextmanager
def forward_state(state: ForwardState):
    """Make ``state`` the running forward's (:func:`current_forward`) for the ``with`` block."""
    token = _FORWARD.set(state)
    try:
        yield state
    finally:
        _FORWARD.reset(token)


def visible_extents(mask: torch.Tensor, chunk: int) -> list[int]:
    """For each run of ``chunk`` query rows of the additive ``mask [b, h, q, kv]``: one past the
    last key column any of those rows may see (``kv`` when a run sees nothing at all). Works one
    run at a time, so it holds ``[b, h, chunk, kv]`` booleans at most (a 32K-token forward's whole
    ``[q, kv]`` would be gigabytes)."""
    keys = mask.shape[-1]
    extents = []
    for first in range(0, mask.shape[-2], chunk):
        seen = (mask[..., first:first + chunk, :] != float("-inf")).flatten(0, -2).any(dim=0).nonzero()
        extents.append(int(seen[-1]) + 1 if len(seen) else keys)
    return extents


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
          scaling: float | None, grouped: bool) -> torch.Tensor:
    """``query [b, Hq, q, D]`` over ``key/value [b, Hkv, kv, D]`` with the additive ``mask
    [b, 1|Hq, q, kv]``; KV groups are handed to SDPA as they are (``enable_gqa``) or expanded
    first. Returns ``[b, q, Hq, D]`` as HF attention functions do."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and not grouped:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=groups > 1 and grouped)
    return out.transpose(1, 2).contiguous()


def promptcache_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs):
    """The attention function of models driven by promptcache (registered once as
    :data:`ATTENTION`, selected per model instance by :class:`ModelAdapter`).

    Outside a promptcache forward, or off the CPU, it is HF's ``"sdpa"`` unchanged. In a
    promptcache forward on CPU with an additive 4D mask it makes two changes that keep every
    query's keys and mask values: grouped KV heads go to SDPA without ``repeat_kv`` copies
    (HF only does so without a mask, for CUDA's sake), and a long forward runs
    ``query_chunk`` query rows at a time, each run over the keys up to the last one it may see —
    CPU SDPA cannot skip masked blocks, so a long span of new text otherwise pays for the whole
    ``q x kv`` rectangle. Outputs agree with one SDPA call to rounding.

    On any device, a forward whose state selects a row-attention backend (``"flex"``,
    ``"split_kv"``) and whose spec carries the mask by rows runs that backend instead of SDPA
    (:func:`~pckernels.integration.row_attention.attend_rows`; where it does not apply, SDPA)."""
    state = _FORWARD.get()
    if (state is not None and state.backend != "dense" and state.spec.rows is not None and attention_mask is not None
            and not dropout and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
            and kwargs.get("sliding_window") is None):
        out = attend_rows(state.backend, query, key, value, state.spec.rows, scaling, state.memo)
        if out is not None:
            return out, None
    if (state is None or query.device.type != "cpu" or attention_mask is None or attention_mask.ndim != 4
            or attention_mask.dtype == torch.bool or dropout or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None):
        return _hf_attention("sdpa")(module, query, key, value, attention_mask, dropout=dropout,
                                     scaling=scaling, **kwargs)
    mask = attention_mask[..., :key.shape[2]]
    rows, chunk = query.shape[2], state.query_chunk
    if chunk is None or rows <= chunk:
        return sdpa(query, key, value, mask, scaling, state.grouped_kv), None
    memo = ("extents", mask.data_ptr(), tuple(mask.shape), mask.stride(), chunk)
    if memo not in state.memo:
        state.memo[memo] = visible_extents(mask, chunk)
    extents = state.memo[memo]
    if min(extents) == key.shape[2]:
        return sdpa(query, key, value, mask, scaling, state.grouped_kv), None
    pieces = []
    for index, stop in enumerate(extents):
        first, last = index * chunk, min(index * chunk + chunk, rows)
        pieces.append(sdpa(query[:, :, first:last], key[:, :, :stop], value[:, :, :stop],
                            mask[:, :, first:last, :stop], scaling, state.grouped_kv))
    return torch.cat(pieces, dim=1), None


@functools.cache
def _interfaces():
    """transformers' attention and mask-function registries."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS


def _hf_attention(name: str) -> Callable:
    return _interfaces()[0][name]


_register_lock = threading.Lock()


def _register_attention() -> None:
    """Register :func:`promptcache_attention` (with SDPA's mask function) once per process; HF's
    own entries are never touched."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    attention, masks = _interfaces()
    with _register_lock:
        if attention.get(ATTENTION) is not promptcache_attention:
            AttentionInterface.register(ATTENTION, promptcache_attention)
            AttentionMaskInterface.register(ATTENTION, masks["sdpa"])


def select_attention(model: torch.nn.Module) -> bool:
    """Switch ``model`` (this instance only) from HF's ``"sdpa"`` to :data:`ATTENTION`. Models
    on another implementation (eager, flash, or a family that computes attention itself) are left
    as they are. Returns whether the model now uses promptcache's attention."""
    current = getattr(model.config, "_attn_implementation", None)
    if current == ATTENTION:
        return True
    if current != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    _register_attention()
    try:
        model.set_attn_implementation(ATTENTION)
    except (ValueError, ImportError, NotImplementedError) as exc:
        log.info("keeping %r attention for %s: %s", current, type(model).__name__, exc)
        return False
    return True
