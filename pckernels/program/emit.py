"""Nodes -> PML: the schema (once per program) and the prompt (once per call).

The schema is written under ``xml:space="preserve"`` with no whitespace between elements (line
breaks go inside tags, where XML ignores them), so every module holds exactly the program's text.
The program's *tail* — what follows its last module, from the first parameter on (else its last
piece) — is not in the schema: each prompt writes it as text after the imports, computed fresh,
so the model answers from a token computed in the prompt's forward (docs/pml.md, *Text comes
last*).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pckernels.program import nodes as n
from pckernels.program.names import Scope

_INVALID_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_TEXT_ESCAPES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", "\r": "&#13;"}
_ATTR_ESCAPES = {**_TEXT_ESCAPES, '"': "&quot;", "\n": "&#10;", "\t": "&#9;"}


def check_xml_text(text: str) -> str | None:
    """Why ``text`` cannot be written in XML (a character XML 1.0 has no way to express), else None."""
    bad = _INVALID_XML.search(text)
    return None if bad is None else f"the character {bad.group()!r} cannot be written in PML (XML 1.0)"


def _escape(text: str, table: Mapping[str, str]) -> str:
    problem = check_xml_text(text)
    if problem:
        raise ValueError(problem)
    return "".join(table.get(ch, ch) for ch in text)


class _Writer:
    """Builds XML as a list of items; ``render(pretty)`` breaks lines inside tags only."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def text(self, text: str) -> None:
        if text:
            self.items.append(("text", _escape(text, _TEXT_ESCAPES)))

    def _tag(self, tag: str, attrs: Mapping[str, str] | None) -> str:
        return "<" + tag + "".join(f' {k}="{_escape(v, _ATTR_ESCAPES)}"' for k, v in (attrs or {}).items())

    def open(self, tag: str, attrs: Mapping[str, str] | None = None) -> None:
        self.items.append(("open", self._tag(tag, attrs)))

    def close(self, tag: str) -> None:
        self.items.append(("close", "</" + tag))

    def empty(self, tag: str, attrs: Mapping[str, str] | None = None) -> None:
        self.items.append(("empty", self._tag(tag, attrs)))

    def element(self, tag: str, attrs: Mapping[str, str], inner: _Writer) -> None:
        if inner.items:
            self.open(tag, attrs)
            self.items += inner.items
            self.close(tag)
        else:
            self.empty(tag, attrs)

    def render(self, pretty: bool = False) -> str:
        out, depth = [], 0
        for index, (kind, value) in enumerate(self.items):
            if kind == "text":
                out.append(value)
                continue
            if kind == "close":
                depth -= 1
            elif kind == "open":
                depth += 1
            end = "/>" if kind == "empty" else ">"
            following = self.items[index + 1][0] if index + 1 < len(self.items) else None
            if pretty and following in ("open", "close", "empty"):
                out.append(value + "\n" + "  " * (depth - (following == "close")) + end)
            else:
                out.append(value + end)
        return "".join(out)


@dataclass
class Structure:
    """What a schema declares: qualified module names (document order), unions and their members,
    and each module's parameters. Compared with the parsed ``Schema`` in the tests."""

    modules: list[str] = field(default_factory=list)
    unions: dict[str, tuple[str, ...]] = field(default_factory=dict)
    params: dict[str, tuple[str, ...]] = field(default_factory=dict)


def split_tail(nodes: tuple[n.Node, ...]) -> int:
    """Index of the first top-level node of the tail (``len(nodes)`` when there is none)."""
    last = max((i for i, node in enumerate(nodes) if n.is_structure(node)), default=-1)
    start = next((i for i in range(last + 1, len(nodes)) if n.has_slot(nodes[i])), None)
    if start is None:
        start = len(nodes) - 1 if last + 1 < len(nodes) else len(nodes)
    if start == 0:
        start = min(len(nodes), 1)
    return start


def write_schema(name: str, nodes: tuple[n.Node, ...], *, pretty: bool = True) -> tuple[str, Structure]:
    """The ``<schema>`` for the schema part of ``nodes`` and its :class:`Structure`."""
    writer, structure = _Writer(), Structure()
    unions = Scope()
    _root_names(nodes, unions)
    _schema_nodes(nodes, writer, "", unions, structure)
    outer = _Writer()
    outer.open("schema", {"name": name, "xml:space": "preserve"})
    outer.items += writer.items
    outer.close("schema")
    return outer.render(pretty), structure


def schema_body(nodes: tuple[n.Node, ...]) -> str:
    """The schema's content alone (what its name's hash covers)."""
    writer = _Writer()
    unions = Scope()
    _root_names(nodes, unions)
    _schema_nodes(nodes, writer, "", unions, Structure())
    return writer.render()


def _root_names(nodes: tuple[n.Node, ...], into: Scope) -> None:
    for node in nodes:
        if isinstance(node, (n.Module, n.Slot)):
            into.taken.add(node.name)
        elif isinstance(node, n.Union):
            into.taken.update(m.name for m in node.members)
        elif isinstance(node, n.Role) and node.body:
            _root_names(node.body, into)


def _qualify(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def _schema_nodes(nodes, writer: _Writer, module: str, unions: Scope, structure: Structure) -> None:
    """``module``: the enclosing module's qualified name (``""``: the schema's root)."""
    for node in nodes:
        if isinstance(node, n.Text):
            writer.text(node.text)
        elif isinstance(node, n.Slot):
            if module:
                writer.empty("param", {"name": node.name, "len": str(node.max_tokens)})
                structure.params[module] = structure.params.get(module, ()) + (node.name,)
            else:
                writer.open("module", {"name": node.name})
                writer.empty("param", {"name": node.name, "len": str(node.max_tokens)})
                writer.close("module")
                structure.modules.append(node.name)
                structure.params[node.name] = (node.name,)
        elif isinstance(node, n.Role):
            if node.body is None:
                writer.empty("assistant")
            else:
                writer.open(node.role)
                _schema_nodes(node.body, writer, module, unions, structure)
                writer.close(node.role)
        elif isinstance(node, n.Module):
            _module(node.name, node.body, writer, module, unions, structure)
        elif isinstance(node, n.Union):
            name = unions.take(node.hint)
            writer.open("union", {"name": name})
            for member in node.members:
                _module(member.name, member.body, writer, module, unions, structure)
            writer.close("union")
            structure.unions[name] = tuple(_qualify(module, m.name) for m in node.members)


def _module(name: str, body, writer: _Writer, parent: str, unions: Scope, structure: Structure) -> None:
    qualified = _qualify(parent, name)
    structure.modules.append(qualified)
    writer.open("module", {"name": name})
    _schema_nodes(body, writer, qualified, unions, structure)
    writer.close("module")


@dataclass
class Argument:
    """A ``MaxTokens`` argument of one call: checked against its limit with the engine's tokenizer."""

    program: str
    param: str
    value: str
    max_tokens: int


def write_prompt(schema_name: str, nodes: tuple[n.Node, ...], tail_start: int, env: Mapping[str, Any],
                 program: str) -> tuple[str, list[Argument]]:
    """The ``<prompt>`` for one call (``env``: the program's arguments) and its arguments."""
    writer, arguments = _Writer(), []
    _imports(nodes[:tail_start], env, writer, {}, arguments, program, at_root=True)
    _tail(nodes[tail_start:], env, writer, arguments, program)
    outer = _Writer()
    outer.open("prompt", {"schema": schema_name, "xml:space": "preserve"})
    outer.items += writer.items
    outer.close("prompt")
    return outer.render(), arguments


def _argument(slot: n.Slot, env: Mapping[str, Any], arguments: list[Argument], program: str) -> str:
    value = slot.value(env)
    arguments.append(Argument(program, slot.param, value, slot.max_tokens))
    return value


def _imports(nodes, env, writer: _Writer, args: dict[str, str], arguments: list[Argument], program: str, *,
             at_root: bool) -> None:
    for node in nodes:
        if isinstance(node, n.Slot):
            value = _argument(node, env, arguments, program)
            if at_root:
                writer.empty(node.name, {node.name: value})
            else:
                args[node.name] = value
        elif isinstance(node, n.Role) and node.body:
            _imports(node.body, env, writer, args, arguments, program, at_root=at_root)
        elif isinstance(node, n.Module):
            if node.test is not None and not node.test.eval(env):
                continue
            if node.call is not None:
                _import(node.name, node.body, node.call.env(env), writer, arguments,
                        node.call.program.function.__qualname__)
            else:
                _import(node.name, node.body, env, writer, arguments, program)
        elif isinstance(node, n.Union):
            member = node.chosen(env)
            if member is not None:
                _import(member.name, member.body, env, writer, arguments, program)


def _import(name: str, body, env, writer: _Writer, arguments: list[Argument], program: str) -> None:
    inner, args = _Writer(), {}
    _imports(body, env, inner, args, arguments, program, at_root=False)
    writer.element(name, args, inner)


def _tail(nodes, env, writer: _Writer, arguments: list[Argument], program: str) -> None:
    for node in nodes:
        if isinstance(node, n.Text):
            writer.text(node.text)
        elif isinstance(node, n.Slot):
            writer.text(_argument(node, env, arguments, program))
        elif isinstance(node, n.Role):
            if node.body is None:
                writer.empty("assistant")
            else:
                inner = _Writer()
                _tail(node.body, env, inner, arguments, program)
                writer.open(node.role)
                writer.items += inner.items
                writer.close(node.role)
