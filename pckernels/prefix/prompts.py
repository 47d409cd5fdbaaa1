"""Turning a prompt (text, token ids or chat messages) into token ids."""

from __future__ import annotations

from collections.abc import Sequence

import torch

Prompt = str | Sequence[int] | torch.Tensor | Sequence[dict]


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of ``prompt``.

    Text is encoded with the tokenizer's special tokens; token ids pass through (a 1-D tensor
    or ``[1, seq]`` tensor is accepted); chat messages (``{"role", "content"}`` dicts) are
    rendered with the tokenizer's chat template plus the generation prompt, then encoded
    without adding special tokens again.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer")
        ids = tokenizer(prompt)["input_ids"]
    elif isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1 or prompt.is_floating_point():
            raise ValueError(f"token ids must be a 1-D integer tensor, got shape {tuple(prompt.shape)}")
        ids = prompt.tolist()
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
        if tokenizer is None:
            raise ValueError("chat messages need a tokenizer with a chat template")
        text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise TypeError("prompt must be text, a sequence of token ids, or a list of chat message dicts")
    if not ids:
        raise ValueError("the prompt is empty")
    return [int(t) for t in ids]
