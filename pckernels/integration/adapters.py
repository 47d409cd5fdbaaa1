"""How promptcache drives a HuggingFace causal LM: one small adapter per model family.

An adapter answers four questions for the engine: how position ids reach the model, how
the KV cache is laid out (layers, real KV-head count, head dim), how an attention mask is
taken, and how a forward over some tokens with a promptcache-owned cache is called. The
engine, kernels and stores stay family-agnostic.

The base :class:`ModelAdapter` covers every family whose positions enter only through
``position_ids`` (RoPE, learned absolute embeddings) and whose model takes a prepared 4D
additive mask, or a ``{layer_type: mask}`` dict for models with per-layer sliding windows.
Sliding windows are applied here, by schema position. Families that need more (ALiBi,
unusual cache layouts) live in :mod:`pckernels.integration.families`, each a small subclass.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from typing import Callable

import torch
from transformers import DynamicCache

from pckernels.errors import UnsupportedModelError
from pckernels.integration.attention import (AttentionSpec, ForwardState, KVLayout, QUERY_CHUNK, forward_state,
                                             select_attention, windowed_bias)
from pckernels.integration.linear import apply_fast_linear
from pckernels.kernels._common import to_device

log = logging.getLogger(__name__)

SLIDING = "sliding_attention"
"""HF's ``config.layer_types`` entry for layers attending within ``config.sliding_window``."""


class _ProbeCache(DynamicCache):
    """The model's own dynamic cache, recording per layer index the key/value shapes a forward
    hands to ``update`` (recurrent layers of hybrids keep their own states and are not recorded)."""

    def __init__(self, config) -> None:
        super().__init__(config=config)
        self.seen: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.seen[layer_idx] = (tuple(key_states.shape), tuple(value_states.shape))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


PROBE_TOKENS = 3
"""Tokens in the probe forward (more than one, so a model cannot special-case decoding)."""


def probe_kv_layout(adapter: "ModelAdapter") -> tuple[KVLayout, tuple[int, ...]]:
    """What ``adapter.model`` really caches, read off one forward of :data:`PROBE_TOKENS` tokens
    through a recording cache with the engine's kind of attention (4D mask, the adapter's patches).

    Returns the layout and the indices of the layers that cached keys and values. Raises
    ``UnsupportedModelError`` when the layers disagree on heads or head dim, or keys and values
    differ in shape: the assembly buffer holds ``[L, 2, H, rows, D]``.
    """
    model = adapter.model
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    n = PROBE_TOKENS
    ids = torch.zeros(1, n, dtype=torch.long, device=device)
    positions = torch.arange(n, device=device)
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    bias = torch.zeros(n, n, dtype=dtype, device=device).masked_fill(~causal, float("-inf"))
    cache = _ProbeCache(model.config)
    with torch.inference_mode():
        adapter.forward(ids, positions[None], AttentionSpec(bias, positions, positions), cache)
    seen = cache.seen
    name = getattr(model.config, "model_type", type(model).__name__)
    if not seen:
        raise UnsupportedModelError(f"model type {name!r} cached no keys or values in a probe forward")
    shapes = {}
    for index, (key, value) in seen.items():
        if key != value or len(key) != 4 or key[0] != 1 or key[2] != n:
            raise UnsupportedModelError(
                f"model type {name!r}, layer {index}: cached keys {key} and values {value}; module reuse "
                f"needs both as [1, heads, {n}, head_dim]")
        shapes.setdefault((key[1], key[3]), []).append(index)
    if len(shapes) > 1:
        detail = "; ".join(f"layers {v}: {h} heads x {d}" for (h, d), v in shapes.items())
        raise UnsupportedModelError(f"model type {name!r} caches different KV shapes per layer ({detail}); "
                                    "module reuse needs one shape for every layer")
    (heads, head_dim), = shapes
    layers = tuple(sorted(seen))
    return KVLayout(len(layers), heads, head_dim), layers


class ModelAdapter:
    """Adapter for decoder-only models whose positions enter through ``position_ids`` and whose
    attention takes a prepared 4D additive float mask ``[1, 1, q, kv]`` (or a dict of them per
    layer type) and a ``Cache`` whose ``update`` returns the full key/value states.

    Subclasses override what differs: :meth:`kv_layout`, :meth:`max_positions` and
    :meth:`attention_mask`. Code inside the model that must know the forward's positions (ALiBi
    builders) reads :func:`current_forward`, set only while :meth:`forward` runs with a spec.
    The adapter selects promptcache's attention function for its model instance
    (:func:`select_attention`); ``query_chunk`` and ``grouped_kv`` tune it for this instance.
    """

    families: tuple[str, ...] = ()
    row_attention = True
    """Whether the family's attention may run a row-attention backend (False where the family adds
    to attention what a row mask does not carry, e.g. ALiBi)."""

    def __init__(self, model: torch.nn.Module, *, attach: bool = True, matmul: str = "fp32") -> None:
        self.model = model
        self.config = model.config
        self.text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._takes_logits_to_keep = "logits_to_keep" in params
        self.windows = self._layer_windows()
        self._layout: KVLayout | None = None
        self.query_chunk: int | None = QUERY_CHUNK
        """Query rows per SDPA call in long masked CPU forwards (None: one call)."""
        self.grouped_kv = True
        """Hand grouped KV heads to SDPA on CPU instead of expanding them."""
        self.owns_attention = False
        self.native = None
        """The :class:`~pckernels.integration.native.NativeDecoder` running forwards over promptcache's
        KV buffers, when the model is one it recognises (on CPU); None: HF's modules run them."""
        self.matmul = matmul
        self.attention_backend = "dense"
        """The attention backend of this instance's promptcache forwards (``"dense"``, ``"flex"``,
        ``"split_kv"``; :mod:`~pckernels.integration.row_attention`). The engine sets it; it applies
        to the HF modules' forward (never the native CPU forward) of models without sliding windows,
        and only in families that keep HF's attention interface (:attr:`row_attention`)."""
        if attach:
            self.attach()

    def attach(self) -> None:
        """Prepare the model instance for promptcache forwards, once: select promptcache's
        attention (:func:`select_attention`); families add their position hooks. An adapter made
        with ``attach=False`` only answers questions about the model (limits, windows). A model
        on CPU also gets :func:`~pckernels.integration.linear.apply_fast_linear` (oneDNN GEMMs in
        fp32; ``PROMPTCACHE_KERNEL_BACKEND=torch`` keeps ``F.linear``) and, when its architecture
        is recognised, the native forward (``PROMPTCACHE_NATIVE=0`` turns it off); ``matmul="bf16"``
        needs the native forward and raises ``ValueError`` without it."""
        self.owns_attention = select_attention(self.model)
        weight = next(self.model.parameters(), None)
        on_cpu = weight is not None and weight.device.type == "cpu"
        if on_cpu:
            apply_fast_linear(self.model)
        if self.matmul != "fp32" and not on_cpu:
            raise ValueError(f"matmul={self.matmul!r} is a CPU option (oneDNN); this model is on "
                             f"{weight.device if weight is not None else 'no device'}")
        if on_cpu and (os.environ.get("PROMPTCACHE_NATIVE", "1") != "0" or self.matmul != "fp32"):
            from pckernels.integration.native import NativeDecoder

            self.native = NativeDecoder.build(self.model, self.layer_windows(), self.matmul)

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: global attention)."""
        layers = getattr(self.text_config, "num_hidden_layers", 0)
        if isinstance(self.windows, dict):
            types = self.text_config.layer_types
            return [self.windows[types[i]] for i in range(layers)]
        return [self.windows] * layers

    def _layer_windows(self) -> dict[str, int | None] | int | None:
        """Sliding windows: ``{layer_type: window or None}`` when the model has sliding layer types
        and takes one mask per type; else one window for every layer (Mistral-style) or None."""
        cfg = self.text_config
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:
            if SLIDING not in layer_types:
                return None
            return {t: cfg.sliding_window if t == SLIDING else None for t in set(layer_types)}
        return getattr(cfg, "sliding_window", None)

    def kv_layout(self) -> KVLayout:
        """Layers, KV heads and head dim as the model really caches them (:func:`probe_kv_layout`,
        run once per adapter), so no assumption about a family or a transformers version is made.
        Every layer must cache: a layer without KV (recurrent, shared KV) has no block to reuse."""
        if self._layout is None:
            layout, layers = probe_kv_layout(self)
            if layers != tuple(range(len(layers))):
                raise UnsupportedModelError(
                    f"model type {self.config.model_type!r} caches keys and values only in layers {list(layers)}; "
                    "modular reuse needs every layer's attention states (recurrent or KV-sharing layers "
                    "are supported by exact prefix reuse, cache.complete())")
            self._layout = layout
        return self._layout

    def max_positions(self) -> int | None:
        """Positions the model can take. RoPE whose frequencies depend on the forward's largest
        position (``longrope``) is limited to its original length, where they stay fixed."""
        limit = getattr(self.text_config, "max_position_embeddings", None)
        for params in _rope_parameter_sets(self.text_config):
            original = params.get("original_max_position_embeddings")
            if params.get("rope_type") == "longrope" and original:
                limit = original if limit is None else min(limit, original)
        return limit

    def attention_mask(self, spec: AttentionSpec):
        """What the model takes as ``attention_mask`` for ``spec``: a 4D additive mask
        ``[1, 1, q, kv]``, or ``{layer_type: mask}`` with sliding windows applied by position."""
        if isinstance(self.windows, dict):
            return {kind: windowed_bias(spec, window)[None, None] for kind, window in self.windows.items()}
        return windowed_bias(spec, self.windows)[None, None]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention: AttentionSpec | None,
                cache, *, last_logits_only: bool = True, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Run the model on ``input_ids [1, q]`` at ``position_ids [1, q]`` with a promptcache
        ``cache`` (``attention`` given) or a plain HF cache with causal attention (``None``).
        Returns logits ``[q, vocab]``: ``[1, vocab]`` for the last token when ``last_logits_only``,
        ``[k, vocab]`` for the token indices ``keep [k]`` when given (a packed batch)."""
        if self.native is not None and attention is not None and getattr(cache, "buffer", None) is not None:
            if keep is None and last_logits_only:
                keep = to_device(torch.tensor([input_ids.shape[1] - 1]), input_ids.device)
            return self.native.forward(input_ids[0], position_ids[0], attention, cache, keep)
        kwargs = {self._cache_kwarg: cache, "use_cache": True}
        if keep is not None:
            if self._takes_logits_to_keep:
                kwargs["logits_to_keep"] = keep
        elif self._takes_logits_to_keep and last_logits_only:
            kwargs["logits_to_keep"] = 1
        if attention is None:
            out = self.model(input_ids=input_ids, position_ids=position_ids, **kwargs)
        else:
            backend = self.attention_backend if self.row_attention and self.windows is None else "dense"
            with forward_state(ForwardState(attention, self.query_chunk, self.grouped_kv, backend=backend)):
                out = self.model(input_ids=input_ids, position_ids=position_ids,
                                 attention_mask=self.attention_mask(attention), **kwargs)
        logits = out.logits[0]
        if keep is not None:
            return logits if self._takes_logits_to_keep else logits[keep]
        return logits[-1:] if last_logits_only else logits


def _rope_parameter_sets(config) -> list[dict]:
    """The RoPE parameter dicts of ``config`` (one, or one per layer type); empty if none."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return []
    if all(isinstance(v, dict) for v in params.values()) and params:
        return list(params.values())
    return [params]


_ADAPTERS: dict[str, Callable[..., ModelAdapter]] = {}
_FAMILY_MODULES = ("position_ids", "falcon", "alibi")


def register_adapter(adapter: type[ModelAdapter]) -> type[ModelAdapter]:
    """Register ``adapter`` for each model type in ``adapter.families`` (usable as a decorator)."""
    for family in adapter.families:
        _ADAPTERS[family] = adapter
    return adapter


def _load_families() -> None:
    for name in _FAMILY_MODULES:
        importlib.import_module(f"pckernels.integration.families.{name}")


def supported_families() -> tuple[str, ...]:
    _load_families()
    return tuple(sorted(_ADAPTERS))


def adapter_for(model: torch.nn.Module, *, attach: bool = True, matmul: str = "fp32") -> ModelAdapter:
    """The adapter for ``model``'s family, or ``UnsupportedModelError`` naming the supported ones.
    ``attach=False``: leave the model untouched (see :meth:`ModelAdapter.attach`); ``matmul``: see
    :class:`~pckernels.integration.native.NativeDecoder`."""
    _load_families()
    model_type = getattr(model.config, "model_type", None)
    try:
        factory = _ADAPTERS[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; supported families: {', '.join(supported_families())}"
        ) from None
    adapter = factory(model, attach=attach, matmul=matmul)
    log.debug("model type %r driven by %s", model_type, type(adapter).__name__)
    return adapter
