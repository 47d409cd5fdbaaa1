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

import contextlib
import functools
import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from transformers import DynamicCache

from pckernels.errors import UnsupportedModelError

log = logging.getLogger(__name__)

SLIDING = "sliding_attention"
"""HF's ``config.layer_types`` entry for layers attending within ``config.sliding_window``."""


@dataclass(frozen=True)
class AttentionSpec:
    """Who attends to whom in one forward.

    ``bias [q, kv]``: additive, 0 where query i may attend key j and -inf elsewhere, in the
    model's dtype. ``query_pos [q]`` and ``key_pos [kv]``: the schema positions of queries and
    keys, for families whose attention depends on them beyond RoPE (sliding windows, ALiBi).
    """

    bias: torch.Tensor
    query_pos: torch.Tensor
    key_pos: torch.Tensor


@dataclass(frozen=True)
class KVLayout:
    """KV cache shape per layer: ``[1, num_kv_heads, tokens, head_dim]`` for ``num_layers`` layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


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


@contextlib.contextmanager
def replaced(owner: object, name: str, replacement: object) -> Iterator[None]:
    """Temporarily set ``owner.name`` to ``replacement`` (an instance attribute shadowing a
    method, or a module global looked up at call time); the original is restored on exit."""
    missing = object()
    saved = owner.__dict__.get(name, missing) if hasattr(owner, "__dict__") else missing
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        if saved is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, saved)


@functools.cache
def _sdpa_module():
    """HF's SDPA attention module (imported once), or None when this transformers lacks it."""
    try:
        return importlib.import_module("transformers.integrations.sdpa_attention")
    except ImportError:
        return None


def grouped_kv_on_cpu(device: torch.device) -> contextlib.AbstractContextManager:
    """While a masked forward runs on CPU, let HF's SDPA attention pass grouped KV heads to
    ``scaled_dot_product_attention(enable_gqa=True)`` instead of expanding them with
    ``repeat_kv`` (HF only does so without a mask, for CUDA's sake: there a mask plus GQA falls
    back to the math kernel). Same arithmetic per head, so outputs are unchanged; it saves
    copying every cached K/V ``num_heads / num_kv_heads`` times per layer. No-op elsewhere."""
    module = _sdpa_module()
    original = getattr(module, "use_gqa_in_sdpa", None)
    if device.type != "cpu" or original is None:
        return contextlib.nullcontext()

    def use_gqa_on_cpu(*args, **kwargs):
        key = kwargs.get("key", args[1] if len(args) > 1 else None)
        if key is not None and key.device.type == "cpu":
            return True
        return original(*args, **kwargs)

    return replaced(module, "use_gqa_in_sdpa", use_gqa_on_cpu)


QUERY_CHUNK = 256
"""Query rows per SDPA call when a long masked forward runs on CPU (see :func:`query_chunked_on_cpu`)."""


def visible_extents(mask: torch.Tensor, chunk: int) -> list[int]:
    """For each run of ``chunk`` query rows of the additive ``mask [b, h, q, kv]``: one past the
    last key column any of those rows may see (``kv`` when a run sees nothing at all)."""
    visible = (mask != float("-inf")).any(dim=1).any(dim=0)
    keys = visible.shape[1]
    per_row = (visible * torch.arange(1, keys + 1, device=mask.device)).amax(dim=1)
    last = [int(run.max()) for run in per_row.split(chunk)]
    return [x if x > 0 else keys for x in last]


def _query_chunked(attend: Callable, chunk: int) -> Callable:
    """``attend`` (HF's SDPA attention function) run ``chunk`` query rows at a time, each run over
    the keys up to the last one it may see. CPU SDPA cannot skip masked blocks, so a long span of
    new text (each token seeing the cached rows and the new rows before it) otherwise pays for
    the whole ``q x kv`` rectangle: twice the causal triangle's work when all the text is new."""
    extents: dict[tuple, list[int]] = {}

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        rows = query.shape[2]
        if (rows <= chunk or attention_mask is None or attention_mask.ndim != 4
                or attention_mask.dtype == torch.bool or attention_mask.shape[-2] != rows
                or kwargs.get("position_bias") is not None):
            return attend(module, query, key, value, attention_mask, *args, **kwargs)
        mask = attention_mask[..., :key.shape[2]]
        memo = (mask.data_ptr(), tuple(mask.shape), mask.stride())
        if memo not in extents:
            extents[memo] = visible_extents(mask, chunk)
        if min(extents[memo]) == key.shape[2]:
            return attend(module, query, key, value, attention_mask, *args, **kwargs)
        pieces = []
        for index, stop in enumerate(extents[memo]):
            first, last = index * chunk, min(index * chunk + chunk, rows)
            out, _ = attend(module, query[:, :, first:last], key[:, :, :stop], value[:, :, :stop],
                            mask[:, :, first:last, :stop], *args, **kwargs)
            pieces.append(out)
        return torch.cat(pieces, dim=1), None

    return attention


@functools.cache
def _attention_functions():
    """HF's attention-function registry (``ALL_ATTENTION_FUNCTIONS``), or None without one."""
    try:
        return importlib.import_module("transformers.modeling_utils").ALL_ATTENTION_FUNCTIONS
    except (ImportError, AttributeError):
        return None


@contextlib.contextmanager
def query_chunked_on_cpu(device: torch.device, chunk: int | None = None) -> Iterator[None]:
    """While a masked forward runs on CPU, HF's ``"sdpa"`` attention goes through
    :func:`_query_chunked`: a prompt whose uncached text is long costs about what a causal prefill
    of that text costs, not up to twice as much. Each query row sees the same keys and mask
    values, so outputs agree to rounding (the kernel's blocking changes). No-op elsewhere.
    ``chunk``: query rows per call (default :data:`QUERY_CHUNK`)."""
    registry = _attention_functions()
    local = getattr(registry, "_local_mapping", None)
    if device.type != "cpu" or local is None:
        yield
        return
    missing = object()
    saved = local.get("sdpa", missing)
    local["sdpa"] = _query_chunked(registry["sdpa"], QUERY_CHUNK if chunk is None else chunk)
    try:
        yield
    finally:
        if saved is missing:
            del local["sdpa"]
        else:
            local["sdpa"] = saved


class ModelAdapter:
    """Adapter for decoder-only models whose positions enter through ``position_ids`` and whose
    attention takes a prepared 4D additive float mask ``[1, 1, q, kv]`` (or a dict of them per
    layer type) and a ``Cache`` whose ``update`` returns the full key/value states.

    Subclasses override what differs: :meth:`kv_layout`, :meth:`max_positions`,
    :meth:`attention_mask`, and :meth:`forward_context` for patches that must hold while the
    model runs with a promptcache attention (never in baseline mode).
    """

    families: tuple[str, ...] = ()

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._takes_logits_to_keep = "logits_to_keep" in params
        self.windows = self._layer_windows()
        self._layout: KVLayout | None = None

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

    def forward_context(self, attention: AttentionSpec) -> contextlib.AbstractContextManager:
        """Patches in force while the model runs with ``attention`` (none by default)."""
        return contextlib.nullcontext()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention: AttentionSpec | None,
                cache, *, last_logits_only: bool = True) -> torch.Tensor:
        """Run the model on ``input_ids [1, q]`` at ``position_ids [1, q]`` with a promptcache
        ``cache`` (``attention`` given) or a plain HF cache with causal attention (``None``).
        Returns logits ``[q, vocab]`` (``[1, vocab]`` for the last token when ``last_logits_only``)."""
        kwargs = {self._cache_kwarg: cache, "use_cache": True}
        if self._takes_logits_to_keep and last_logits_only:
            kwargs["logits_to_keep"] = 1
        if attention is None:
            out = self.model(input_ids=input_ids, position_ids=position_ids, **kwargs)
        else:
            with (grouped_kv_on_cpu(input_ids.device), query_chunked_on_cpu(input_ids.device),
                  self.forward_context(attention)):
                out = self.model(input_ids=input_ids, position_ids=position_ids,
                                 attention_mask=self.attention_mask(attention), **kwargs)
        logits = out.logits[0]
        return logits[-1:] if last_logits_only else logits


def _rope_parameter_sets(config) -> list[dict]:
    """The RoPE parameter dicts of ``config`` (one, or one per layer type); empty if none."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        return []
    if all(isinstance(v, dict) for v in params.values()) and params:
        return list(params.values())
    return [params]


_ADAPTERS: dict[str, Callable[[torch.nn.Module], ModelAdapter]] = {}
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


def adapter_for(model: torch.nn.Module) -> ModelAdapter:
    """The adapter for ``model``'s family, or ``UnsupportedModelError`` naming the supported ones."""
    _load_families()
    model_type = getattr(model.config, "model_type", None)
    try:
        factory = _ADAPTERS[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; supported families: {', '.join(supported_families())}"
        ) from None
    adapter = factory(model)
    log.debug("model type %r driven by %s", model_type, type(adapter).__name__)
    return adapter
