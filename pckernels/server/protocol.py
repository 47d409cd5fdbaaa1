"""The OpenAI request bodies the server accepts (pydantic), and its error type.

Every field is honoured, refused with a 400 naming it, or — when it cannot change the answer
(``user``, ``metadata``, ``store``, ``service_tier``) — accepted and ignored; a field the server
does not know is refused, never dropped (``docs/server.md`` lists them all). The promptcache
extension fields ride in the same bodies (the ``openai`` client sends them with ``extra_body``):

* ``pml``: a PML ``<prompt>`` used instead of ``messages`` / ``prompt``;
* ``timeout_s``: a deadline for this request (the server's ``--request-timeout`` otherwise);
* ``cache``: ``false`` computes a plain prompt without prefix reuse;
* ``recompute``, ``recompute_policy``: as in ``PromptCache.generate`` (PML prompts only).

vLLM's sampling extras (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``) and
chat's ``chat_template_kwargs`` ride there too, with vLLM's meaning; ``SamplingParams`` checks
their ranges (a 400 naming the field).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 16
"""Answers one request may ask for."""
IGNORED = frozenset({"user", "metadata", "store", "service_tier"})
"""Fields accepted and ignored: they cannot change an answer."""
NEUTRAL = {"no_stop_trim": False, "continue_final_message": False, "separate_reasoning": True,
           "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True}
"""SGLang/vLLM extension fields a router (``vllm-router``, ``sglang-router``) adds to every body it
re-serializes, at these values: accepted when they hold exactly these values (they cannot change the
answer — this server neither trims stops nor separates reasoning); any other value is refused."""
NOT_YET = ("functions", "function_call", "prediction", "modalities", "audio",
           "web_search_options", "guided_decoding_backend", "structured_outputs")
"""Fields OpenAI or vLLM clients send that this server does not honour: refused with a 400."""
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
TEMPLATE_OWN = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "conversation", "documents",
                          "chat_template", "return_dict", "continue_final_message"})
"""``apply_chat_template`` arguments ``chat_template_kwargs`` may not set."""


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
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    """vLLM's per-request cache namespace: a plain prompt's prefix blocks are shared only with
    requests of the same tenant and the same ``cache_salt``."""
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    pml: str | None = None
    timeout_s: float | None = Field(default=None, gt=0.0)
    cache: bool = True
    recompute: float | None = Field(default=None, ge=0.0)
    """A share (0 to 1), or with ``recompute_policy="epic"`` tokens per module (the engine checks);
    unset: the engine's default for the prompt's placement (compact: 8 per module, ``epic``)."""
    recompute_policy: Literal["first", "deviation", "epic"] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    """vLLM's sampling extras, with vLLM's meaning (:class:`~pckernels.generation.SamplingParams`)."""
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    """OpenAI's cache-routing hint: accepted; exact prefix reuse needs no key (``docs/server.md``)."""

    def check_supported(self) -> None:
        given = self.model_extra or {}
        extra = sorted(name for name in set(given) - IGNORED
                       if not (name in NEUTRAL and given[name] is NEUTRAL[name]))
        if extra:
            known = [name for name in extra if name in NOT_YET]
            name = (known or extra)[0]
            why = "is not supported by this server" if known else "is not a field this server knows"
            raise APIError(400, f"{name!r} {why}; it would change the answer, so it is refused rather than "
                           "ignored", param=name, code="unsupported_field")
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be between 1 and {MAX_N}", param="n")
        if self.pml is not None and self.cache_salt is not None:
            raise APIError(400, "cache_salt applies to plain prompts; PML schemas are isolated per tenant",
                           param="cache_salt")
        stops = self.stops()
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop takes up to 4 non-empty strings", param="stop")

    def bias(self, vocab: int) -> dict[int, float] | None:
        """``logit_bias`` as token ids (keys are token ids as strings); 400 for a key that is not one."""
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            if not key.strip().isdigit() or int(key) >= vocab:
                raise APIError(400, f"logit_bias key {key!r} is not a token id of this model (0 to {vocab - 1})",
                               param="logit_bias")
            if not -100.0 <= value <= 100.0:
                raise APIError(400, f"logit_bias values must be between -100 and 100, got {value}",
                               param="logit_bias")
            out[int(key)] = value
        return out

    def logprob_count(self) -> int | None:
        """Alternatives to record per token (``None``: no log-probabilities)."""
        raise NotImplementedError

    def constraint(self) -> tuple[str, str, Any] | None:
        """``(field, kind, value)`` of the one constraint on the answer's form, if any: kind
        ``json_object``, ``json_schema``, ``regex``, ``grammar`` or ``choice``. 400 for a malformed
        ``response_format`` or for two constraints at once."""
        found = []
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_object":
                found.append(("response_format", "json_object", None))
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise APIError(400, "response_format json_schema needs json_schema.schema (an object)",
                                   param="response_format")
                found.append(("response_format", "json_schema", spec["schema"]))
            elif kind != "text":
                raise APIError(400, f"response_format type must be text, json_object or json_schema, got {kind!r}",
                               param="response_format")
        if self.guided_json is not None:
            value = self.guided_json
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise APIError(400, f"guided_json is not JSON: {exc}", param="guided_json") from None
            found.append(("guided_json", "json_schema", value))
        for field, kind in (("guided_regex", "regex"), ("guided_grammar", "grammar"), ("guided_choice", "choice")):
            if getattr(self, field) is not None:
                found.append((field, kind, getattr(self, field)))
        if len(found) > 1:
            raise APIError(400, f"give one of {', '.join(f for f, _, _ in found)}, not several", param=found[1][0])
        return found[0] if found else None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(default_factory=list)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (vLLM's; e.g. ``enable_thinking``)."""
    reasoning_effort: str | None = None
    """OpenAI's: passed to a chat template that reads ``reasoning_effort``, else ignored."""

    def check_supported(self) -> None:
        super().check_supported()
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise APIError(400, f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}",
                           param="reasoning_effort")
        if self.chat_template_kwargs:
            taken = sorted(set(self.chat_template_kwargs) & TEMPLATE_OWN)
            if taken:
                raise APIError(400, f"chat_template_kwargs must not set {', '.join(taken)} (the server does)",
                               param="chat_template_kwargs")
            if self.pml is not None:
                raise APIError(400, "chat_template_kwargs apply to messages, not to a PML prompt",
                               param="chat_template_kwargs")
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.tools and self.pml is not None:
            raise APIError(400, "tools apply to messages, not to a PML prompt", param="tools")

    @property
    def calls_tools(self) -> bool:
        """Whether the answer is parsed for tool calls (tools given, ``tool_choice`` not ``none``)."""
        return bool(self.tools) and self.tool_choice != "none"

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(_Sampling):
    calls_tools: ClassVar[bool] = False

    prompt: str | list[int] | list[str] | None = None
    max_tokens: int | None = Field(default=16, ge=0)
    """0 only with ``echo``: the prompt alone, no answer."""
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)

    def logprob_count(self) -> int | None:
        return self.logprobs

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix or (self.best_of or 1) != 1:
            raise APIError(400, "suffix and best_of are not supported", param="suffix" if self.suffix else "best_of")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo: the prompt alone)",
                           param="max_tokens")
        if self.echo and self.pml is not None:
            raise APIError(400, "echo applies to a plain prompt, not to a PML prompt", param="echo")


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` as vLLM serves it: a ``prompt`` or chat ``messages``."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class SchemaUpload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pml: str = Field(min_length=1)
    shared: bool = False
