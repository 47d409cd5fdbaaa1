"""MPT and BLOOM: ALiBi, so keys carry no position and the bias must come from the schema
positions of query and key (``slope * (key_pos - query_pos)``), not from row order or the 2D
mask's cumulative sum. Both models build their ALiBi through a method of the base model; the
adapter shadows it once, on that model instance, with a builder that returns the position-based
``[H, q, kv]`` bias during a promptcache forward (:func:`current_forward`) and calls the model's
own method otherwise (both models add a 3D bias of that shape to the scores). Slopes are read
from the model's own builder, so they match HF's exactly."""

from __future__ import annotations

import torch

from pckernels.integration.adapters import ModelAdapter, register_adapter
from pckernels.integration.attention import current_forward


class _AlibiAdapter(ModelAdapter):
    row_attention = False  # ALiBi enters through the mask, which a row mask does not carry
    builder = ""
    """Name of the base model's method that returns its ALiBi tensor."""

    def __init__(self, model: torch.nn.Module, *, attach: bool = True, matmul: str = "fp32") -> None:
        super().__init__(model, attach=False, matmul=matmul)
        self._slopes = self.model_slopes()
        if attach:
            self.attach()

    def attach(self) -> None:
        super().attach()
        self._install_builder()

    def model_slopes(self) -> torch.Tensor:
        """Per-head slopes ``[H]`` as the model's own builder computes them."""
        raise NotImplementedError

    def _install_builder(self) -> None:
        """Shadow the base model's ALiBi method on this instance, once (the instance attribute
        stays; outside promptcache forwards it is the model's own method)."""
        base = self.model.base_model
        own = getattr(base, self.builder)
        if getattr(own, "promptcache_positions", False):
            return
        slopes = self._slopes

        def position_builder(*args, **kwargs):
            state = current_forward()
            return own(*args, **kwargs) if state is None else state.alibi(slopes)

        position_builder.promptcache_positions = True
        setattr(base, self.builder, position_builder)


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
