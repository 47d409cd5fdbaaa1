"""Reading and restoring the per-layer states of a transformers ``DynamicCache``.

Three kinds of cache layer are understood, all through the layer objects of
``transformers.cache_utils`` rather than any model's own code:

* growing attention layers (``DynamicLayer``): keys/values ``[batch, kv_heads, seq, head_dim]``
  that are sliced per block;
* linear-attention / state-space / short-convolution layers (``LinearAttentionLayer``): a
  fixed-size convolution window and recurrent state per sub-state, snapshotted whole;
* hybrids of both (``LinearAttentionAndFullAttentionLayer``) and empty ``DummyLayer``\\ s.

Anything else (sliding-window, static, quantized or indexed layers) is reported as
unsupported, so the caller can refuse reuse instead of restoring something approximate.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import cache_utils

_KV_TYPES = tuple(t for t in (getattr(cache_utils, "DynamicLayer", None),) if t is not None)
_LINEAR_TYPES = tuple(t for t in (getattr(cache_utils, "LinearAttentionLayer", None),) if t is not None)
_HYBRID_TYPES = tuple(
    t for t in (getattr(cache_utils, "LinearAttentionAndFullAttentionLayer", None),) if t is not None
)
_EMPTY_TYPES = tuple(t for t in (getattr(cache_utils, "DummyLayer", None),) if t is not None)

KV, LINEAR, HYBRID, EMPTY = "kv", "linear", "kv+linear", "empty"


class UnsupportedCacheError(RuntimeError):
    """The model's cache holds a layer kind whose states cannot be restored exactly."""


def layer_kind(layer) -> str:
    """``"kv"``, ``"linear"``, ``"kv+linear"`` or ``"empty"``; raises for other layer classes."""
    cls = type(layer)
    if cls in _HYBRID_TYPES:
        return HYBRID
    if cls in _KV_TYPES:
        return KV
    if cls in _LINEAR_TYPES:
        return LINEAR
    if cls in _EMPTY_TYPES:
        return EMPTY
    supported = [t.__name__ for t in _KV_TYPES + _LINEAR_TYPES + _HYBRID_TYPES + _EMPTY_TYPES]
    raise UnsupportedCacheError(
        f"cache layer {cls.__name__} cannot be checkpointed exactly (supported: {', '.join(supported)})"
    )


def put_kv(cache: cache_utils.Cache, index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Layer ``index`` of ``cache`` holds ``keys``/``values`` ``[B, H, n, D]`` (as they are, no copy)."""
    layer = cache.layers[index]
    if not getattr(layer, "is_initialized", False):
        layer.lazy_initialization(keys[..., :0, :], values[..., :0, :])
    layer.keys, layer.values = keys, values


def layer_states(cache: cache_utils.Cache, index: int) -> tuple:
    """Layer ``index``'s convolution and recurrent states as they are (views, not copies): one
    ``(conv, recurrent)`` pair per sub-state, each a tensor ``[B, ...]`` or ``None`` (not made yet)."""
    layer = cache.layers[index]
    return tuple((layer.conv_states[idx] if layer.is_conv_states_initialized[idx] else None,
                  layer.recurrent_states[idx] if layer.is_recurrent_states_initialized[idx] else None)
                 for idx in range(layer.number_of_states))


def put_states(cache: cache_utils.Cache, index: int, pairs: tuple) -> None:
    """Give layer ``index`` of a new ``cache`` the ``(conv, recurrent)`` states ``pairs`` (as
    :func:`layer_states` gives them), copied into the layer's own buffers."""
    for idx, (conv, rec) in enumerate(pairs):
        if conv is not None:
            cache.update_conv_state(conv, index, state_idx=idx)
        if rec is not None:
            cache.update_recurrent_state(rec, index, state_idx=idx)


def copy_states(cache: cache_utils.Cache, index: int, pairs: tuple) -> None:
    """Put layer ``index``'s states back to ``pairs`` (taken from this cache earlier, same shapes):
    copied over its buffers, nothing else about the layer changed."""
    layer = cache.layers[index]
    for idx, (conv, rec) in enumerate(pairs):
        if conv is not None:
            layer.conv_states[idx].copy_(conv)
        if rec is not None:
            layer.recurrent_states[idx].copy_(rec)


class CacheStates:
    """Creates working caches for ``model`` and copies states out of and into them, one layer at a
    time through :func:`put_kv`, :func:`layer_states`, :func:`put_states` and :func:`copy_states`
    (the engine's decoding batch uses the same functions).

    ``kinds`` (per layer: :data:`KV`, :data:`LINEAR`, ...) is given, or filled from the first cache
    passed to :meth:`inspect`.
    """

    def __init__(self, model, kinds: list[str] | tuple[str, ...] | None = None) -> None:
        self.model = model
        self.config = model.config
        self.kinds: list[str] | None = list(kinds) if kinds is not None else None
        params = inspect.signature(model.forward).parameters
        self.cache_argument = "cache" if "cache" in params else "past_key_values"

    def new_cache(self, into=None) -> cache_utils.Cache:
        """An empty cache laid out for the model's layers (it keeps its own states: rows to read
        into, ``into``, are refused)."""
        if into is not None:
            raise ValueError("a transformers cache keeps its own states; it cannot read a prompt into given rows")
        return cache_utils.DynamicCache(config=self.config)

    def inspect(self, cache: cache_utils.Cache) -> list[str]:
        """Per-layer kinds of a cache that has seen a forward pass (raises if unsupported)."""
        kinds = [layer_kind(layer) for layer in cache.layers]
        if not kinds:
            raise UnsupportedCacheError("the model's cache has no layers")
        self.kinds = kinds
        return kinds

    @property
    def has_recurrent_layers(self) -> bool:
        """Whether some layer carries a fixed-size state that must be checkpointed at boundaries."""
        return any(kind in (LINEAR, HYBRID) for kind in self.kinds or ())

    def kv_slice(self, cache: cache_utils.Cache, start: int, end: int) -> list:
        """Per layer, owned copies of keys/values for tokens ``[start, end)`` (``None`` if no KV)."""
        out = []
        for layer, kind in zip(cache.layers, self.kinds):
            if kind in (KV, HYBRID):
                out.append((layer.keys[..., start:end, :].clone(), layer.values[..., start:end, :].clone()))
            else:
                out.append(None)
        return out

    def recurrent_snapshot(self, cache: cache_utils.Cache) -> list:
        """Per layer, owned copies of the convolution and recurrent states as they are now.

        Each item is ``None`` (no such state) or a tuple of one ``(conv, recurrent)`` pair per
        sub-state, each tensor or ``None``.
        """
        return [tuple((None if conv is None else conv.clone(), None if rec is None else rec.clone())
                      for conv, rec in layer_states(cache, index)) if kind in (LINEAR, HYBRID) else None
                for index, kind in enumerate(self.kinds)]

    def restore(self, cache: cache_utils.Cache, kv_pieces: list[list], states: list | None, placed: int = 0) -> None:
        """Fill an empty ``cache`` with concatenated KV pieces and a recurrent snapshot.

        ``kv_pieces``: one :meth:`kv_slice` result per stored entry, in token order.
        ``states``: a :meth:`recurrent_snapshot` taken at the end of the last piece. ``placed``:
        leading tokens already in place (only for caches over given rows; 0 here).
        The restored tensors are fresh contiguous copies, laid out exactly as the cache's own
        concatenation would have produced them.
        """
        for layer_idx, kind in enumerate(self.kinds):
            if kind in (KV, HYBRID):
                pieces = [piece[layer_idx] for piece in kv_pieces if piece[layer_idx][0].shape[-2] > 0]
                if pieces:
                    put_kv(cache, layer_idx, torch.cat([k for k, _ in pieces], dim=-2),
                           torch.cat([v for _, v in pieces], dim=-2))
            if kind in (LINEAR, HYBRID):
                if states is None or states[layer_idx] is None:
                    raise ValueError(f"layer {layer_idx} needs a recurrent snapshot to be restored")
                put_states(cache, layer_idx, states[layer_idx])


@dataclass(frozen=True)
class CacheFootprint:
    """What a model's cache holds per request: layer ``kinds``, key/value bytes per token (all
    attention layers together) and the bytes of the fixed-size recurrent/convolution states."""

    kinds: tuple[str, ...]
    kv_bytes_per_token: int
    state_bytes: int

    @property
    def recurrent(self) -> bool:
        """Whether some layer carries a running state (a hybrid or recurrent model)."""
        return any(kind in (LINEAR, HYBRID) for kind in self.kinds)


PROBE_TOKENS = 2


def probe_footprint(model) -> CacheFootprint:
    """Read ``model``'s cache layout off a :data:`PROBE_TOKENS`-token forward into a transformers
    ``DynamicCache``; raises :class:`UnsupportedCacheError` for layer kinds that cannot be restored
    exactly."""
    states = CacheStates(model)
    device = next(model.parameters()).device
    cache = states.new_cache()
    ids = torch.zeros(1, PROBE_TOKENS, dtype=torch.long, device=device)
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.arange(PROBE_TOKENS, device=device)[None], use_cache=True,
              logits_to_keep=1, **{states.cache_argument: cache})
    kinds = states.inspect(cache)
    if any(kind in (KV, HYBRID) and getattr(layer, "keys", None) is None for layer, kind in zip(cache.layers, kinds)):
        raise UnsupportedCacheError("the model keeps its states outside the transformers cache it was given")
    kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
             for pair in states.kv_slice(cache, 0, PROBE_TOKENS) if pair is not None for k, v in [pair])
    snapshot = states.recurrent_snapshot(cache)
    state = sum(t.numel() * t.element_size() for layer in snapshot if layer for pair in layer for t in pair
                if t is not None)
    return CacheFootprint(tuple(kinds), kv // PROBE_TOKENS, state)
