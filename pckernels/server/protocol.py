"""The OpenAI request bodies the server accepts (pydantic), and its error type.

Fields the server does not implement are refused with a 400 naming them rather than silently
ignored when they would change the answer (``n > 1``, ``logprobs``, penalties, ``echo``); fields
that do not (``user``, ``metadata``, …) are accepted and ignored. The promptcache extension
fields ride in the same bodies (the ``openai`` client sends them with ``extra_body``):

* ``pml``: a PML ``<prompt>`` used instead of ``messages`` / ``prompt``;
* ``timeout_s``: a deadline for this request (the server's ``--request-timeout`` otherwise);
* ``cache``: ``false`` computes a plain prompt without prefix reuse;
* ``recompute``, ``recompute_policy``: as in ``PromptCache.generate`` (PML prompts only).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error answered with an OpenAI-style body ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"content parts of type {part.type!r} are not supported (text only)",
                               param="messages")
            parts.append(part.text)
        return "".join(parts)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logprobs: Any = None
    user: str | None = None
    pml: str | None = None
    timeout_s: float | None = Field(default=None, gt=0.0)
    cache: bool = True
    recompute: float = Field(default=0.0, ge=0.0)
    """A share (0 to 1), or with ``recompute_policy="epic"`` tokens per module (the engine checks)."""
    recompute_policy: Literal["first", "deviation", "epic"] = "first"

    def check_supported(self) -> None:
        if self.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        if self.presence_penalty or self.frequency_penalty:
            raise APIError(400, "presence_penalty and frequency_penalty are not supported", param="presence_penalty")
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported", param="logprobs")
        stops = self.stops()
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop takes up to 4 non-empty strings", param="stop")

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(default_factory=list)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | None = None
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo or self.suffix or (self.best_of or 1) != 1:
            raise APIError(400, "echo, suffix and best_of are not supported", param="echo")


class SchemaUpload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pml: str = Field(min_length=1)
    shared: bool = False
