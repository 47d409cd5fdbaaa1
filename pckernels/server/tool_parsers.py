"""The tool-call formats models write, parsed into OpenAI's ``tool_calls`` (as vLLM's parsers of
the same names): ``hermes`` (``<tool_call>{"name", "arguments"}</tool_call>`` blocks, Hermes /
Qwen), ``llama3_json`` (the answer is ``{"name": …, "parameters": {…}}`` objects separated by
``;``, possibly after ``<|python_tag|>``), ``mistral`` (``[TOOL_CALLS] [{"name", "arguments"}, …]``)
and ``pythonic`` (the answer is a Python list of calls, ``[f(a=1), g(b="x")]``, read with
:mod:`ast` — literals only, never evaluated). :func:`pick_parser` takes the format the chat
template teaches (its markers), or the one ``serve --tool-call-parser`` names.

A parser says how an answer splits into content and calls (:meth:`ToolParser.parse`; text that
is not a well-formed call stays content; the content before calls loses its trailing space) and
how much of a streamed answer is safe to show as
content (:meth:`ToolParser.safe`: never the part that may still become a call).
:class:`ToolStream` streams one answer: content deltas while text is safe, the calls as OpenAI
``tool_calls`` deltas at the end — the deltas joined equal the whole answer's parse.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from typing import Any

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
"""The formats known; ``auto`` picks one from the chat template."""


def _call(name: str, arguments: Any) -> dict:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that begins ``marker`` (0: none)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolParser:
    """One format (module docstring)."""

    name = ""

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """``(content, tool_calls)``; ``(text, [])`` when it holds no well-formed call."""
        raise NotImplementedError

    def safe(self, text: str) -> int:
        """Characters at the start of a streamed ``text`` that are content whatever follows."""
        raise NotImplementedError


class HermesParser(ToolParser):
    """``<tool_call>`` blocks anywhere in the answer; the text around them is content."""

    name = "hermes"
    OPEN = "<tool_call>"
    CLOSE = re.compile(r"\s*</tool_call>")

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        calls, kept, position = [], [], 0
        decoder = json.JSONDecoder()
        while (start := text.find(self.OPEN, position)) >= 0:
            body = start + len(self.OPEN)
            while body < len(text) and text[body].isspace():
                body += 1
            try:
                call, end = decoder.raw_decode(text, body)
            except json.JSONDecodeError:
                kept.append(text[position:body])
                position = body
                continue
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                kept.append(text[position:end])
                position = end
                continue
            calls.append(_call(call["name"], call.get("arguments", {})))
            kept.append(text[position:start])
            close = self.CLOSE.match(text, end)
            position = close.end() if close else end
        kept.append(text[position:])
        if not calls:
            return text, []
        content = "".join(kept).rstrip()
        return content if content.strip() else None, calls

    def safe(self, text: str) -> int:
        at = text.find(self.OPEN)
        if at >= 0:
            return at
        return len(text) - _partial_marker(text, self.OPEN)


class ForcedCallParser(HermesParser):
    """A forced call's answer (``tool_choice`` ``required`` or a named function): Hermes blocks, as
    its grammar writes them, and — since that grammar ends no answer inside a block — an unfinished
    last block means ``max_tokens`` cut it. That block is still a call, with the arguments written
    so far (text that is not valid JSON), as OpenAI and vLLM return a cut forced call: clients see
    the call and ``finish_reason`` ``length`` and report the bad arguments, where an answer without
    calls passes for "no call" (LangChain's ``with_structured_output`` then returns None). The name
    is the named function's, else the block's when it was written whole; a block cut before its
    name stays content."""

    NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
    ARGUMENTS = re.compile(r'\s*,\s*"arguments"\s*:\s*')

    def __init__(self, function: str | None = None) -> None:
        self.function = function
        """The named function of ``tool_choice`` (None for ``required``)."""

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        content, calls = super().parse(text)
        tail = (content or "") if calls else text
        at = tail.find(self.OPEN)
        if at < 0 or tail[:at].strip():
            return content, calls
        body = tail[at + len(self.OPEN):]
        name = self.NAME.match(body)
        if name is None and self.function is None:
            return content, calls
        arguments = ""
        if name is not None:
            rest = self.ARGUMENTS.match(body, name.end())
            arguments = body[rest.end():].rstrip() if rest else ""
        return None, calls + [_call(json.loads(name.group(1)) if name else self.function, arguments)]


class MistralParser(ToolParser):
    """Content, then ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}`` objects."""

    name = "mistral"
    MARKER = "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        at = text.find(self.MARKER)
        if at < 0:
            return text, []
        rest = text[at + len(self.MARKER):].strip()
        try:
            items = json.loads(rest)
        except json.JSONDecodeError:
            return text, []
        items = [items] if isinstance(items, dict) else items
        if not isinstance(items, list) or not items or not all(_named(item, "arguments") for item in items):
            return text, []
        content = text[:at].rstrip()
        return content if content.strip() else None, [_call(item["name"], item.get("arguments", {})) for item in items]

    def safe(self, text: str) -> int:
        at = text.find(self.MARKER)
        return at if at >= 0 else len(text) - _partial_marker(text, self.MARKER)


class Llama3JsonParser(ToolParser):
    """The whole answer is calls: ``{"name": …, "parameters": {…}}`` objects (``arguments`` is read
    too) separated by ``;``, possibly after ``<|python_tag|>``."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, position = json.JSONDecoder(), [], 0
        while True:
            try:
                item, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text, []
            if not _named(item, "parameters") and not _named(item, "arguments"):
                return text, []
            calls.append(_call(item["name"], item.get("parameters", item.get("arguments", {}))))
            rest = body[position:].lstrip()
            if not rest:
                return None, calls
            if not rest.startswith(";"):
                return text, []
            position = len(body) - len(rest) + 1
            while position < len(body) and body[position].isspace():
                position += 1
            if position == len(body):
                return None, calls

    def safe(self, text: str) -> int:
        head = text.lstrip()
        return 0 if head.startswith(("{", self.TAG)) or self.TAG.startswith(head) else len(text)


class PythonicParser(ToolParser):
    """The whole answer is a Python list of calls with keyword arguments whose values are literals."""

    name = "pythonic"

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        body = text.strip()
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError):
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            name = _dotted(node.func) if isinstance(node, ast.Call) else None
            if name is None or node.args or any(k.arg is None for k in node.keywords):
                return text, []
            try:
                arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                encoded = json.dumps(arguments)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return text, []
            calls.append(_call(name, encoded))
        return None, calls

    def safe(self, text: str) -> int:
        head = text.lstrip()
        return 0 if not head or head.startswith("[") else len(text)


def _named(item: Any, field: str) -> bool:
    return isinstance(item, dict) and isinstance(item.get("name"), str) and bool(item["name"]) \
        and isinstance(item.get(field, {}), (dict, str)) and field in item


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


BY_NAME = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser(), PythonicParser())}


def template_parser(template: Any) -> str:
    """The format a chat template teaches, from its markers (``hermes`` when it shows none)."""
    text = template if isinstance(template, str) else " ".join(map(str, template.values())) \
        if isinstance(template, dict) else ""
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "func_name1(" in text or "[func_name(" in text:
        return "pythonic"
    if "<|python_tag|>" in text or ('"parameters"' in text and "<|eot_id|>" in text):
        return "llama3_json"
    return "hermes"


def pick_parser(name: str, tokenizer) -> ToolParser:
    """The parser ``name`` names, or for ``auto`` the one the tokenizer's chat template teaches."""
    if name == "auto":
        name = template_parser(getattr(tokenizer, "chat_template", None))
    if name not in BY_NAME:
        raise ValueError(f"tool-call parser must be auto or one of {', '.join(PARSERS)}, got {name!r}")
    return BY_NAME[name]


class ToolStream:
    """One streamed answer that may hold tool calls: :meth:`push` the text so far, get the content
    that is safe to send; :meth:`finish` with the final text gives the rest of the content and
    the calls as OpenAI ``tool_calls`` deltas (one per call: index, id, type, name, arguments)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.shown = ""

    def push(self, text: str) -> str:
        safe = text[:self.parser.safe(text)].rstrip()  # trailing space may end the content (it is cut then)
        if len(safe) <= len(self.shown) or not safe.startswith(self.shown):
            return ""
        delta, self.shown = safe[len(self.shown):], safe
        return delta

    def finish(self, text: str) -> tuple[str, list[dict]]:
        """``(content delta, tool_call deltas)`` for the final ``text``."""
        content, calls = self.parser.parse(text)
        if not calls:
            rest = text[len(self.shown):] if text.startswith(self.shown) else ""
            return rest, []
        content = content or ""
        rest = content[len(self.shown):] if content.startswith(self.shown) else ""
        return rest, [{"index": k, **call} for k, call in enumerate(calls)]
