"""Tiny random models and a byte-level ChatML tokenizer, for tests and examples without a model hub."""

from __future__ import annotations

import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_HIDDEN = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16)

TINY_CONFIGS: dict[str, dict] = {
    "llama": {},
    "mamba2": dict(num_heads=8, head_dim=16, state_size=16, n_groups=1, expand=2, chunk_size=16),
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"] * 2, linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "lfm2": dict(layer_types=["conv", "full_attention"] * 2, block_ff_dim=128),
    "falcon_h1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  num_experts=2, mamba_d_state=8, mamba_dt_rank=8),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"] * 2, mamba_n_heads=4, mamba_d_head=32,
                             mamba_d_state=8, mamba_chunk_size=16, num_local_experts=2, num_experts_per_tok=1,
                             shared_intermediate_size=64),
    "bamba": dict(attn_layer_indices=[1, 3], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8,
                  mamba_chunk_size=16),
    "nemotron_h": dict(hybrid_override_pattern="M*M*", mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=8,
                       n_groups=1, chunk_size=16),
}
"""Config overrides per ``model_type`` for four-layer, 64-wide random models (CPU, milliseconds)."""


def tiny_tokenizer():
    """A byte-level tokenizer (one token per UTF-8 byte) with ChatML special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        pad_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def tiny_model(model_type: str, vocab_size: int, *, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A random ``model_type`` causal LM from :data:`TINY_CONFIGS`, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, **{**_HIDDEN, **TINY_CONFIGS[model_type]})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
