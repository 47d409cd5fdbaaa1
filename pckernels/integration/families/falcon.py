"""Falcon: RoPE or ALiBi (``config.alibi``), multi-query or grouped KV heads.

KV layout: with ``new_decoder_architecture`` HF broadcasts each KV group to every query head
before caching, so the cache holds ``num_attention_heads`` heads; plain multi-query caches one.
ALiBi: Falcon builds it from the 2D mask's cumulative sum with the module-level
``build_alibi_tensor``; while a promptcache attention is in force that function is replaced by
one returning ALiBi from schema positions (shape ``[H, 1, kv]``: Falcon views it per key, and
the per-query offset it drops is softmax-invariant). Falcon then scales and masks it itself.
"""

from __future__ import annotations

import sys

import torch

from pckernels.integration.adapters import AttentionSpec, KVLayout, ModelAdapter, alibi_bias, register_adapter, \
    replaced


@register_adapter
class FalconAdapter(ModelAdapter):
    families = ("falcon",)

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._modeling = sys.modules[type(model.base_model).__module__]
        heads = self.config.num_attention_heads
        self._slopes = self._modeling.build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)[:, 0, 1]

    def kv_layout(self) -> KVLayout:
        cfg = self.config
        heads = cfg.num_attention_heads
        kv_heads = heads if cfg.new_decoder_architecture else 1 if cfg.multi_query else cfg.num_kv_heads
        return KVLayout(cfg.num_hidden_layers, kv_heads, cfg.hidden_size // heads)

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
