"""Tool calls as OpenAI's API has them, in the Hermes / Qwen ``<tool_call>`` format models write.

The request's ``tools`` are rendered by the tokenizer's chat template (or, for a template that
takes none, as a Hermes tools block in the system message: ``pckernels.prefix.prompts``). With
``tool_choice`` ``"required"``, decoding is constrained to one or more (one when
``parallel_tool_calls`` is false) ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``
blocks, with a named function to exactly one (OpenAI's and vLLM's meaning); their arguments
follow the function's JSON schema (a Lark grammar with embedded JSON schemas, llguidance's
dialect). With ``"auto"`` the model decides, and the answer is parsed:
every well-formed block becomes an entry of ``message.tool_calls`` (``finish_reason``
``"tool_calls"``), the text around them the message's content. Earlier calls and their results
(``tool`` messages) go back to the template on the next turn.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pckernels.generation.grammar import JSON_LAYOUT
from pckernels.server.protocol import APIError
from pckernels.server.tool_parsers import HermesParser

OPEN = "<tool_call>"


def check_tools(tools: list[dict] | None, choice: Any) -> list[dict] | None:
    """The request's function definitions, checked (400 naming what is wrong); ``choice`` must be
    ``none``, ``auto``, ``required`` or a named function among them."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    names = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise APIError(400, f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           param="tools")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise APIError(400, f"tools[{index}].function.parameters must be a JSON schema object", param="tools")
        names.append(function["name"])
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise APIError(400, f"tool_choice names no tool of the request: {choice!r}", param="tool_choice")
    elif choice not in (None, "none", "auto", "required"):
        raise APIError(400, f"tool_choice must be none, auto, required or a function, got {choice!r}",
                       param="tool_choice")
    return tools


def forced(tools: list[dict], choice: Any, parallel: bool | None) -> str | None:
    """The Lark grammar an answer must follow for ``choice`` (``required``: one or more calls, one
    when ``parallel`` is false; a named function: exactly one call, as OpenAI and vLLM force it),
    None when the model may answer freely."""
    if choice == "required":
        chosen = [t["function"] for t in tools]
    elif isinstance(choice, dict):
        chosen = [t["function"] for t in tools if t["function"]["name"] == choice["function"]["name"]]
    else:
        return None
    schemas = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 "arguments": f.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for f in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema["x-guidance"] = JSON_LAYOUT
    # a named choice is one call whatever parallel_tool_calls says: a model that repeats the call
    # until max_tokens would end in finish_reason "length" (instructor then raises)
    repeat = "+" if choice == "required" and parallel is not False else ""
    return f'start: call{repeat}\ncall: "<tool_call>\\n" %json{json.dumps(schema)} "\\n</tool_call>" "\\n"?\n'


def parse(text: str) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of an answer in the Hermes format (what a forced call writes):
    :class:`~pckernels.server.tool_parsers.HermesParser`; the other formats live there too."""
    return HermesParser().parse(text)


def template_messages(messages) -> list[dict]:
    """The request's messages for a chat template: text content, earlier ``tool_calls`` with their
    arguments as objects (templates write them with ``tojson``) and ``tool`` results."""
    out = []
    for message in messages:
        item: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                "content": message.text()}
        extra = message.model_extra or {}
        if message.role == "assistant" and extra.get("tool_calls"):
            item["tool_calls"] = [_template_call(call) for call in extra["tool_calls"]]
        if message.role == "tool":
            if extra.get("tool_call_id") is not None:
                item["tool_call_id"] = extra["tool_call_id"]
            if message.name:
                item["name"] = message.name
        out.append(item)
    return out


def _template_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            raise APIError(400, "an earlier tool call's arguments are not JSON", param="messages") from None
    return {"id": call.get("id"), "type": "function", "function": function}
