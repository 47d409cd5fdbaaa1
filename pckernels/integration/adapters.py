"""How promptcache drives a HuggingFace causal LM: one small adapter per model family.

An adapter answers four questions for the engine: how position ids reach the model, how
the KV cache is laid out (layers, real KV-head count, head dim), how an attention mask is
taken, and how a forward over some tokens with a promptcache-owned cache is called. The
engine, kernels and stores stay family-agnostic.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from pckernels.errors import UnsupportedModelError


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


class ModelAdapter:
    """Adapter for decoder-only models whose attention layers take explicit ``position_ids``,
    a 4D additive float mask ``[1, 1, q, kv]`` and a ``Cache`` whose ``update`` returns the
    full key/value states (RoPE Llama-family models)."""

    families: tuple[str, ...] = ()

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.config = model.config
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._takes_logits_to_keep = "logits_to_keep" in params

    def kv_layout(self) -> KVLayout:
        cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return KVLayout(cfg.num_hidden_layers, kv_heads, head_dim)

    def max_positions(self) -> int | None:
        return getattr(self.config, "max_position_embeddings", None)

    def attention_mask(self, spec: AttentionSpec):
        """What the model takes as ``attention_mask`` for ``spec``: here a 4D additive mask."""
        return spec.bias[None, None]

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention: AttentionSpec | None,
                cache, *, last_logits_only: bool = True) -> torch.Tensor:
        """Run the model on ``input_ids [1, q]`` at ``position_ids [1, q]`` with a promptcache
        ``cache`` (``attention`` given) or a plain HF cache with causal attention (``None``).
        Returns logits ``[q, vocab]`` (``[1, vocab]`` for the last token when ``last_logits_only``)."""
        kwargs = {self._cache_kwarg: cache, "use_cache": True}
        if self._takes_logits_to_keep and last_logits_only:
            kwargs["logits_to_keep"] = 1
        mask = None if attention is None else self.attention_mask(attention)
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, **kwargs)
        logits = out.logits[0]
        return logits[-1:] if last_logits_only else logits


class LlamaFamilyAdapter(ModelAdapter):
    families = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo2")


_ADAPTERS: dict[str, Callable[[torch.nn.Module], ModelAdapter]] = {
    family: LlamaFamilyAdapter for family in LlamaFamilyAdapter.families
}


def register_adapter(adapter: type[ModelAdapter]) -> type[ModelAdapter]:
    """Register ``adapter`` for each model type in ``adapter.families`` (usable as a decorator)."""
    for family in adapter.families:
        _ADAPTERS[family] = adapter
    return adapter


def supported_families() -> tuple[str, ...]:
    return tuple(sorted(_ADAPTERS))


def adapter_for(model: torch.nn.Module) -> ModelAdapter:
    """The adapter for ``model``'s family, or ``UnsupportedModelError`` naming the supported ones."""
    model_type = getattr(model.config, "model_type", None)
    try:
        factory = _ADAPTERS[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; supported families: {', '.join(supported_families())}"
        ) from None
    return factory(model)
