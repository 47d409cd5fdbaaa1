"""Log-probabilities in OpenAI's shapes: chat's ``logprobs.content`` and completions' ``logprobs``.

The engine records, per chosen token, its log-probability and the requested number of best
alternatives, from the logits the token was chosen from (after logit bias, penalties and any
grammar): :class:`~pckernels.generation.TokenLogprob`. Tokens are shown as their decoded text
with its UTF-8 bytes (a token that is part of a multi-byte character decodes to U+FFFD alone;
its ``bytes`` are those of that text).
"""

from __future__ import annotations

from pckernels.generation import TokenLogprob


def _text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def chat_logprobs(records: list[TokenLogprob], tokenizer) -> dict:
    """``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}``."""
    def entry(token: int, logprob: float) -> dict:
        text = _text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]} for r in records]
    return {"content": content, "refusal": None}


def completion_logprobs(records: list[TokenLogprob], tokenizer, offset: int = 0) -> dict:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; ``offset``: the text offset
    of the first token (in the streamed answer so far). An echoed prompt's first token has no
    log-probability: ``None`` in ``token_logprobs`` and ``top_logprobs``."""
    tokens = [_text(tokenizer, r.token) for r in records]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [None if r.logprob is None else {_text(tokenizer, t): lp for t, lp in r.top}
                             for r in records],
            "text_offset": offsets}
