"""Falcon: RoPE or ALiBi (``config.alibi``), multi-query or grouped KV heads.

KV layout: probed like every family's (transformers 5.24 broadcast each KV group of
``new_decoder_architecture`` to every query head before caching, 5.25 caches the groups).
ALiBi: Falcon builds it from the 2D mask's cumulative sum with the module-level
``build_alibi_tensor``; while a promptcache attention is in force that function is replaced by
one returning ALiBi from schema positions (shape ``[H, 1, kv]``: Falcon views it per key, and
the per-query offset it drops is softmax-invariant). Falcon then scales and masks it itself.
"""

from __future__ import annotations

import sys

import torch

from pckernels.integration.adapters import AttentionSpec, ModelAdapter, alibi_bias, register_adapter, \
    replaced


@register_adapter
class FalconAdapter(ModelAdapter):
    families = ("falcon",)

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._modeling = sys.modules[type(model.base_model).__module__]
        heads = self.config.num_attention_heads
        self._slopes = self._modeling.build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)[:, 0, 1]

    def max_positions(self) -> int | None:
        return None if self.config.alibi else super().max_positions()

    def forward_context(self, attention: AttentionSpec):
        if not self.config.alibi:
            return super().forward_context(attention)
        query = attention.query_pos.max().reshape(1)
        slopes = self._slopes.to(attention.key_pos.device)

        def position_alibi(mask, num_heads, dtype):
            return alibi_bias(slopes, query, attention.key_pos, dtype)

        return replaced(self._modeling, "build_alibi_tensor", position_alibi)
