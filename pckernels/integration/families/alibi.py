"""MPT and BLOOM: ALiBi, so keys carry no position and the bias must come from the schema
positions of query and key (``slope * (key_pos - query_pos)``), not from row order or the 2D
mask's cumulative sum. Both models build their ALiBi through a method of the base model; while
a promptcache attention is in force an instance attribute shadows it with the position-based
``[H, q, kv]`` bias (both models add a 3D bias of that shape to the scores). Slopes are read
from the model's own builder, so they match HF's exactly."""

from __future__ import annotations

import torch

from pckernels.integration.adapters import AttentionSpec, ModelAdapter, alibi_bias, register_adapter, replaced


class _AlibiAdapter(ModelAdapter):
    builder = ""
    """Name of the base model's method that returns its ALiBi tensor."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._slopes = self.model_slopes()

    def model_slopes(self) -> torch.Tensor:
        """Per-head slopes ``[H]`` as the model's own builder computes them."""
        raise NotImplementedError

    def forward_context(self, attention: AttentionSpec):
        slopes = self._slopes.to(attention.key_pos.device)
        dtype = attention.bias.dtype
        bias = alibi_bias(slopes, attention.query_pos, attention.key_pos, dtype)
        return replaced(self.model.base_model, self.builder, lambda *args, **kwargs: bias)


@register_adapter
class MptAdapter(_AlibiAdapter):
    families = ("mpt",)
    builder = "build_mpt_alibi_tensor"

    def model_slopes(self) -> torch.Tensor:
        cfg = self.config
        return -self.model.base_model.build_mpt_alibi_tensor(cfg.n_heads, 2, cfg.attn_config.alibi_bias_max)[:, 0, 0]

    def max_positions(self) -> int | None:
        return self.config.max_seq_len


@register_adapter
class BloomAdapter(_AlibiAdapter):
    families = ("bloom",)
    builder = "build_alibi_tensor"

    def model_slopes(self) -> torch.Tensor:
        heads = self.config.n_head
        return self.model.base_model.build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)[:, 0, 1]

    def max_positions(self) -> int | None:
        return None
