"""The OpenAI response bodies of one request: the whole answer, stream chunks and usage."""

from __future__ import annotations

import json
import time
import uuid

from pckernels.server.logprobs import chat_logprobs, completion_logprobs
from pckernels.server.tool_parsers import ForcedCallParser, HermesParser, ToolParser, ToolStream


def finish_reason(reason: str) -> str:
    """OpenAI's finish reason for the engine's (``length``, else ``stop``)."""
    return "length" if reason == "length" else "stop"


class Reply:
    """The bodies answering one chat (``chat``) or completion request; ``endpoint`` labels its metrics."""

    def __init__(self, fingerprint: str, endpoint: str, body, chat: bool, tokenizer=None,
                 parser: ToolParser | None = None) -> None:
        self.fingerprint, self.endpoint, self.chat = fingerprint, endpoint, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = body.model
        self.tokenizer = tokenizer
        self.n = body.n
        self.wants_logprobs = body.logprob_count() is not None
        self.calls_tools = body.calls_tools
        self.echoes: list[tuple[str, list]] | None = None
        """Completions with ``echo``: per prompt its text and its tokens' records (empty without logprobs)."""
        self._offset: dict[int, int] = {}
        self.parser = parser or HermesParser()
        """The tool-call format answers are parsed in (a forced call is always Hermes: its grammar's)."""

    def logprobs(self, records, index: int = 0) -> dict | None:
        """The ``logprobs`` of choice ``index`` holding ``records`` (None when the request asked for none)."""
        if not self.wants_logprobs:
            return None
        if self.chat:
            return chat_logprobs(records, self.tokenizer)
        out = completion_logprobs(records, self.tokenizer, self._offset.get(index, 0))
        self._offset[index] = self._offset.get(index, 0) + sum(len(t) for t in out["tokens"])
        return out

    def echo(self, index: int) -> tuple[str, list]:
        """The echoed prompt of choice ``index``: its text and records (``("", [])`` without echo)."""
        return self.echoes[index // self.n] if self.echoes is not None else ("", [])

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def usage(self, results: list) -> dict:
        """Tokens of every prompt (once, however many answers it had: results come ``n`` per prompt)
        and of every answer."""
        prompts = results[::self.n]
        prompt = sum(len(r.prompt_token_ids) for r in prompts)
        completion = sum(len(r.token_ids) for r in results)
        cached = sum(r.cached_tokens for r in prompts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    @staticmethod
    def extension(results: list) -> dict:
        first = results[0]
        return {"mode": first.mode, "cached_tokens": first.cached_tokens,
                "computed_tokens": sum(r.computed_tokens for r in results), "ttft_s": round(first.ttft_s, 6),
                "finish_reason": first.finish_reason}

    def complete(self, results: list) -> dict:
        """The whole answer: one choice per result, in order."""
        choices = []
        for index, result in enumerate(results):
            reason = finish_reason(result.finish_reason)
            echoed, prompt_records = self.echo(index)
            logprobs = self.logprobs(prompt_records + (result.logprobs or []), index)
            if self.chat:
                message = {"role": "assistant", "content": result.text, "refusal": None}
                if self.calls_tools:
                    message["content"], calls = self.parser.parse(result.text)
                    if calls:
                        message["tool_calls"] = calls
                        reason = self.calls_reason(result)
                choices.append({"index": index, "message": message, "finish_reason": reason, "logprobs": logprobs})
            else:
                choices.append({"index": index, "text": echoed + result.text, "finish_reason": reason,
                                "logprobs": logprobs})
        head = self._head("chat.completion" if self.chat else "text_completion")
        return {**head, "choices": choices, "usage": self.usage(results), "promptcache": self.extension(results)}

    def calls_reason(self, result) -> str:
        """The finish reason of an answer holding tool calls: ``tool_calls``, or ``length`` when
        ``max_tokens`` cut a forced call (its last call's arguments are then unfinished)."""
        return "length" if result.finish_reason == "length" and isinstance(self.parser, ForcedCallParser) \
            else "tool_calls"

    def chunk(self, delta, finish_reason: str | None = None, records=None, index: int = 0) -> dict:
        """A stream chunk of choice ``index``: ``delta`` text (a dict for chat's first chunk), the
        ``records`` of the tokens it carries (their log-probabilities, when asked)."""
        logprobs = self.logprobs(records, index) if records else None
        if self.chat:
            content = delta if isinstance(delta, dict) else ({} if delta is None else {"content": delta})
            choice = {"index": index, "delta": content, "finish_reason": finish_reason, "logprobs": logprobs}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": delta or "", "finish_reason": finish_reason, "logprobs": logprobs}
        return {**self._head("text_completion"), "choices": [choice]}

    def tool_stream(self) -> ToolStream | None:
        """What holds a streamed answer's text back while it may become tool calls (None: no tools)."""
        return ToolStream(self.parser) if self.calls_tools else None

    def ending(self, result, rest: str, shown: int, index: int, tools: ToolStream | None = None) -> list[dict]:
        """The last chunks of answer ``index``: its held-back text ``rest`` (``shown`` characters
        already sent; ``tools``: its tool stream), as tool-call deltas when it is tool calls, then
        its finish reason."""
        reason = finish_reason(result.finish_reason)
        chunks = []
        if tools is not None:
            rest, deltas = tools.finish(result.text)
            if deltas:
                if rest:
                    chunks.append(self.chunk(rest, index=index))
                chunks.append(self.chunk({"tool_calls": deltas}, index=index))
                chunks.append(self.chunk(None, finish_reason=self.calls_reason(result), index=index))
                return chunks
        if rest:
            chunks.append(self.chunk(rest, index=index))
        chunks.append(self.chunk(None, finish_reason=reason, index=index))
        return chunks

    def prompt_only(self, prompt_tokens: list[int]) -> dict:
        """The whole answer of ``echo`` with ``max_tokens=0``: each prompt echoed, nothing generated
        (``prompt_tokens``: each prompt's token count)."""
        choices = []
        for index in range(len(self.echoes) * self.n):
            text, records = self.echo(index)
            choices.append({"index": index, "text": text, "finish_reason": "length",
                            "logprobs": self.logprobs(records, index)})
        prompt = sum(prompt_tokens)
        usage = {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        return {**self._head("text_completion"), "choices": choices, "usage": usage}

    def usage_chunk(self, results: list) -> dict:
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": self.usage(results), "promptcache": self.extension(results)}

    @staticmethod
    def sse(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

