"""Tiny random models, one per supported family configuration, for the family oracle tests.

Each entry builds a 2-layer model from a config (no hub access); weights are redrawn from
N(0, 0.3) so that attention is far from uniform and masking mistakes show in the logits.
``window`` is the sliding window the config sets (None: global attention only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import transformers
from transformers import AutoModelForCausalLM

SLIDING = "sliding_attention"
FULL = "full_attention"
WINDOW = 12
"""Smaller than most schema modules, so windowed layers see a module only partly."""
WIDE_WINDOW = 40
"""For models whose every layer is windowed: two such layers must still reach the prompt's modules."""


@dataclass(frozen=True)
class Family:
    name: str
    config: str
    kwargs: dict = field(default_factory=dict)
    window: int | None = None
    scheme: str = "RoPE"
    relative: bool = True
    """Attention depends only on position differences (RoPE, ALiBi), not on absolute positions."""

    def build(self, vocab_size: int, *, seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
        torch.manual_seed(seed)
        kwargs = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, **self.kwargs)
        config = getattr(transformers, self.config)(vocab_size=vocab_size, **kwargs)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.3)
        return model.to(dtype).eval()


_LLAMA = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True)


def _rope(rope_type: str, **extra) -> dict:
    return dict(_LLAMA, rope_parameters=dict(rope_type=rope_type, rope_theta=10000.0, **extra))


FAMILIES = [
    Family("llama", "LlamaConfig", _rope("default")),
    Family("llama-linear", "LlamaConfig", _rope("linear", factor=2.0), scheme="RoPE linear x2"),
    Family("llama-dynamic", "LlamaConfig", _rope("dynamic", factor=2.0), scheme="RoPE dynamic NTK"),
    Family("llama-yarn", "LlamaConfig", _rope("yarn", factor=4.0, original_max_position_embeddings=512),
           scheme="RoPE YaRN x4"),
    Family("llama3", "LlamaConfig", _rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=512), scheme="RoPE llama3"),
    Family("mistral", "MistralConfig", dict(_LLAMA, sliding_window=WIDE_WINDOW), WIDE_WINDOW, "RoPE + window"),
    Family("qwen2", "Qwen2Config", dict(_LLAMA, use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=1), WINDOW, "RoPE + window (layer 2)"),
    Family("qwen3", "Qwen3Config", dict(_LLAMA, head_dim=16), scheme="RoPE + q/k norm"),
    Family("gemma3", "Gemma3TextConfig", dict(_LLAMA, head_dim=16, query_pre_attn_scalar=16,
                                               layer_types=[SLIDING, FULL], sliding_window=WINDOW),
           WINDOW, "RoPE local/global + window"),
    Family("gemma2", "Gemma2Config", dict(_LLAMA, head_dim=16, query_pre_attn_scalar=16,
                                          layer_types=[SLIDING, FULL], sliding_window=WINDOW),
           WINDOW, "RoPE + window, softcap"),
    Family("falcon", "FalconConfig", dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                          multi_query=True, max_position_embeddings=2048),
           scheme="RoPE, multi-query"),
    Family("falcon-new", "FalconConfig", dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                              num_kv_heads=2, new_decoder_architecture=True,
                                              max_position_embeddings=2048),
           scheme="RoPE, new decoder arch"),
    Family("falcon-alibi", "FalconConfig", dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                                alibi=True, multi_query=False, parallel_attn=False, bias=True),
           scheme="ALiBi"),
    Family("mpt", "MptConfig", dict(d_model=48, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=1024),
           scheme="ALiBi"),
    Family("bloom", "BloomConfig", dict(hidden_size=48, n_layer=2, n_head=4), scheme="ALiBi"),
    Family("gpt2", "GPT2Config", dict(n_embd=48, n_layer=2, n_head=4, n_positions=512),
           scheme="learned absolute", relative=False),
    Family("phi3", "Phi3Config", dict(_LLAMA)),
    Family("starcoder2", "Starcoder2Config", dict(_LLAMA, sliding_window=WIDE_WINDOW), WIDE_WINDOW, "RoPE + window"),
    Family("gpt_neox", "GPTNeoXConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=4, max_position_embeddings=2048),
           scheme="partial RoPE"),
    Family("cohere", "CohereConfig", dict(_LLAMA)),
    Family("olmo2", "Olmo2Config", dict(_LLAMA)),
    Family("smollm3", "SmolLM3Config", dict(_LLAMA, num_hidden_layers=4), scheme="RoPE + NoPE layers"),
]

BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES}
