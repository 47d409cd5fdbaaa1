"""The OpenAI response bodies of one request: the whole answer, stream chunks and usage."""

from __future__ import annotations

import json
import time
import uuid


def finish_reason(reason: str) -> str:
    """OpenAI's finish reason for the engine's (``length``, else ``stop``)."""
    return "length" if reason == "length" else "stop"


class Reply:
    """The bodies answering one chat (``chat``) or completion request; ``endpoint`` labels its metrics."""

    def __init__(self, fingerprint: str, endpoint: str, body, chat: bool) -> None:
        self.fingerprint, self.endpoint, self.chat = fingerprint, endpoint, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = body.model

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    @staticmethod
    def usage(result) -> dict:
        prompt, completion = len(result.prompt_token_ids), len(result.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}

    @staticmethod
    def extension(result) -> dict:
        return {"mode": result.mode, "cached_tokens": result.cached_tokens,
                "computed_tokens": result.computed_tokens, "ttft_s": round(result.ttft_s, 6),
                "finish_reason": result.finish_reason}

    def complete(self, result) -> dict:
        reason = finish_reason(result.finish_reason)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text, "refusal": None},
                      "finish_reason": reason, "logprobs": None}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": result.text, "finish_reason": reason, "logprobs": None}
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": self.usage(result), "promptcache": self.extension(result)}

    def chunk(self, delta, finish_reason: str | None = None) -> dict:
        if self.chat:
            content = delta if isinstance(delta, dict) else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": content, "finish_reason": finish_reason, "logprobs": None}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": delta or "", "finish_reason": finish_reason, "logprobs": None}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, result) -> dict:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": self.usage(result), "promptcache": self.extension(result)}

    @staticmethod
    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
