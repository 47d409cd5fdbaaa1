"""Families whose positions enter only through ``position_ids``: RoPE (rotated keys are cached
after rotation at their schema positions) and learned absolute embeddings (GPT-2: any position
below ``n_positions``, gaps included). The base adapter is all they need; sliding windows
(Mistral, Gemma 2/3, Qwen2 with ``use_sliding_window``...) are applied by position in its mask."""

from __future__ import annotations

from pckernels.integration.adapters import ModelAdapter, register_adapter


@register_adapter
class LlamaFamilyAdapter(ModelAdapter):
    """RoPE decoders taking ``position_ids``, a 4D mask (or per-layer-type dict) and a ``Cache``."""

    families = ("llama", "mistral", "qwen2", "qwen3", "smollm3", "olmo2", "gemma3_text", "gemma2", "phi3",
                "starcoder2", "gpt_neox", "cohere")


@register_adapter
class LearnedPositionsAdapter(ModelAdapter):
    """Learned absolute positions (``wpe[position_ids]``); the limit is ``n_positions``."""

    families = ("gpt2",)
