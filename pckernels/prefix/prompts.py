"""Turning a prompt (text, token ids or chat messages) into token ids."""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

Prompt = str | Sequence[int] | torch.Tensor | Sequence[dict]


HERMES_TOOLS = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
                "</tools>\n\nFor each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}}\n</tool_call>")
"""The tools block of Hermes / Qwen chat templates, for templates that have none of their own."""


def render_chat(tokenizer, messages: Sequence[dict], tools: list[dict] | None = None,
                template_kwargs: dict | None = None) -> str:
    """Chat ``messages`` as the text the model reads: the tokenizer's chat template with the
    generation prompt, ``tools`` given to it (or, for a template that takes none, as a Hermes tools
    block appended to the system message; one is added when there is none);
    ``template_kwargs``: more variables for the template."""
    messages = list(messages)
    if tools and "tools" not in (getattr(tokenizer, "chat_template", None) or ""):
        block = HERMES_TOOLS.format(tools="\n".join(json.dumps(tool) for tool in tools))
        if messages and messages[0].get("role") == "system":
            messages[0] = {**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{block}"}
        else:
            messages.insert(0, {"role": "system", "content": block})
        tools = None
    options = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **options)


def encode_prompt(tokenizer, prompt: Prompt, tools: list[dict] | None = None,
                  template_kwargs: dict | None = None) -> list[int]:
    """Token ids of ``prompt``.

    Text is encoded with the tokenizer's special tokens; token ids pass through (a 1-D tensor
    or ``[1, seq]`` tensor is accepted); chat messages (``{"role", "content"}`` dicts) are
    rendered with the tokenizer's chat template plus the generation prompt, then encoded
    without adding special tokens again. ``tools`` (OpenAI's function definitions) go to the
    template; a template that does not take tools gets them as a Hermes tools block appended to
    the system message (one is added when there is none). ``template_kwargs``: extra variables
    for the template (chat messages only).
    """
    chat = (isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt)
            and all(isinstance(m, dict) for m in prompt))
    if tools and not chat:
        raise ValueError("tools apply to chat messages")
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
    elif chat:
        if tokenizer is None:
            raise ValueError("chat messages need a tokenizer with a chat template")
        ids = tokenizer(render_chat(tokenizer, prompt, tools, template_kwargs), add_special_tokens=False)["input_ids"]
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise TypeError("prompt must be text, a sequence of token ids, or a list of chat message dicts")
    if not ids:
        raise ValueError("the prompt is empty")
    return [int(t) for t in ids]
