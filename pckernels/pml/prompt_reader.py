"""Pass 1 of prompt resolution: the prompt's element tree -> a stream of text runs and imports,
each import resolved against the schema's modules and scaffolds."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from pckernels.errors import PMLError
from pckernels.pml.document import Source, TextPart, is_valid_name, local_tag
from pckernels.pml.elements import (
    ROLE_TAGS,
    Pieces,
    RoleTags,
    attributes,
    is_empty,
    qualify,
    space_mode,
    text_offset,
    text_runs,
)
from pckernels.pml.model import ROOT, Schema


@dataclass
class TextRun(Pieces):
    """A run of prompt text."""

    offset: int | None
    ids: tuple[int, ...] = ()


@dataclass
class Import:
    """One import element: a module (with arguments and nested imports) or a scaffold."""

    element: Any
    modules: tuple[str, ...]
    """Modules this element imports explicitly (one, or a scaffold's members)."""
    start: int
    end: int
    label: str
    arguments: dict[str, str] = field(default_factory=dict)
    implied: tuple[str, ...] = ()
    """Enclosing modules this element imports implicitly (qualified names, scaffolds)."""
    children: list["Import"] = field(default_factory=list)


class PromptReader:
    """Reads the prompt tree into a stream of text runs and imports (pass 1)."""

    def __init__(self, source: Source, schema: Schema) -> None:
        self.source = source
        self.schema = schema
        self.stream: list[TextRun | Import] = []
        self.explicit: dict[str, Any] = {}
        self.implicit: set[str] = set()
        self.roles = RoleTags(source, schema.tokenizer)

    def error(self, message: str, element: Any = None, offset: int | None = None) -> PMLError:
        return self.source.error(message, element, offset=offset)

    def read(self) -> None:
        root = self.source.root
        self._content(root, space_mode(self.source, root, False), in_role=False)

    def _add_text(self, text: str, offset: int | None) -> None:
        if self.stream and isinstance(self.stream[-1], TextRun):
            self.stream[-1].pieces.append(text)
        else:
            self.stream.append(TextRun([text], offset))

    def _content(self, element: Any, preserve: bool, *, in_role: bool) -> None:
        for part in text_runs(element, preserve, lambda _: False):
            if isinstance(part, TextPart):
                self._add_text(part.text, text_offset(self.source, part))
                continue
            tag = local_tag(part)
            if tag in ROLE_TAGS:
                self._role(part, preserve, in_role=in_role)
            else:
                self.stream.append(self._import(part, ROOT))

    def _role(self, element: Any, preserve: bool, *, in_role: bool) -> None:
        offset = self.source.element_offset(element)
        self.roles.expand(element, preserve, in_role=in_role,
                          add_text=lambda text: self._add_text(text, offset),
                          add_content=lambda keep: self._content(element, keep, in_role=True))

    def _resolve(self, scope: str, name: str, element: Any) -> list[str]:
        """Qualified names from ``scope`` down to the module ``name`` (a path with '/')."""
        parts = name.split("/")
        chain = []
        current = scope
        for part in parts:
            qualified = qualify(current, part) if part else None
            if not part or not is_valid_name(part) or qualified not in self.schema.modules:
                raise self.error(self._unknown_message(scope, name), element)
            chain.append(qualified)
            current = qualified
        return chain

    def _unknown_message(self, scope: str, name: str) -> str:
        modules = self.schema.modules
        where = f"schema {self.schema.name!r}" if scope == ROOT else f"module {scope!r}"
        local = [c.rsplit("/", 1)[-1] for c in modules[scope].children] if scope in modules else []
        qualified = [m for m in modules if m != ROOT]
        message = f"unknown module {name!r} in {where}"
        nested = [m for m in qualified
                  if m.rsplit("/", 1)[-1] == name and m != qualify(scope, name)]
        if nested:
            target = nested[0]
            message += (f"; {target!r} is nested: import it as <module name=\"{target}\"/> or "
                        "inside its parent's import")
            return message
        close = difflib.get_close_matches(name, local + qualified, n=3, cutoff=0.6)
        if close:
            message += "; did you mean " + " or ".join(repr(c) for c in dict.fromkeys(close)) + "?"
        elif local:
            shown = ", ".join(local[:10]) + (", …" if len(local) > 10 else "")
            message += f"; it has: {shown}"
        return message

    def _mark(self, name: str, element: Any) -> None:
        if name in self.explicit:
            raise self.error(f"module {name!r} is imported twice; import it once (put all of "
                             "its nested imports inside that one element)", element)
        self.explicit[name] = element

    def _import(self, element: Any, scope: str) -> Import:
        tag = local_tag(element)
        if tag is None:
            raise self.error(f"namespaced element <{element.tag}> is not PML; import modules "
                             "with <name/> or <module name=\"…\"/>", element)
        if tag in ROLE_TAGS:
            raise self.error(f"<{tag}> cannot be inside a module import; put role tags "
                             "around imports, not inside them", element)
        if tag == "scaffold":
            name = attributes(self.source, element, ("name",), ("name",))["name"]
            return self._scaffold_import(element, scope, name)
        if tag != "module" and qualify(scope, tag) not in self.schema.modules \
                and tag in self.schema.scaffolds:
            if element.attrib:
                raise self.error(f"scaffold {tag!r} takes no arguments; import its members "
                                 "individually to pass arguments", element)
            return self._scaffold_import(element, scope, tag)
        if tag == "module":
            values = dict(element.attrib)
            if "name" not in values:
                raise self.error("<module> in a prompt needs name=\"…\": the module to import",
                                 element)
            name = values.pop("name")
        else:
            values = dict(element.attrib)
            name = tag
        values = {k: v for k, v in values.items() if not k.startswith("{")}
        chain = self._resolve(scope, name, element)
        implied = tuple(chain[:-1])
        self.implicit.update(implied)
        target = chain[-1]
        self._mark(target, element)
        module = self.schema.modules[target]
        params = {p.name for p in module.params}
        for key in values:
            if key not in params:
                known = ", ".join(sorted(params)) if params else "none"
                close = difflib.get_close_matches(key, sorted(params), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise self.error(f"module {target!r} has no parameter {key!r} (its parameters: "
                                 f"{known}){hint}", element)
        node = Import(element, (target,), module.start, module.start + module.length,
                       f"module {target!r}", arguments=values, implied=implied)
        preserve = space_mode(self.source, element, False)
        for part in text_runs(element, preserve, lambda _: False):
            if isinstance(part, TextPart):
                raise self.error(f"text inside the import of {target!r} is not allowed (it would "
                                 "land inside the module); put it before or after the import, "
                                 "or pass it as a parameter argument",
                                 offset=text_offset(self.source, part), element=element)
            node.children.append(self._import(part, target))
        return node

    def _scaffold_import(self, element: Any, scope: str, name: str) -> Import:
        scaffold = self.schema.scaffolds.get(name)
        if scaffold is None:
            close = difflib.get_close_matches(name, list(self.schema.scaffolds), n=3)
            hint = ("; did you mean " + " or ".join(map(repr, close)) + "?") if close else \
                f"; it has: {', '.join(self.schema.scaffolds) or 'no scaffolds'}"
            raise self.error(f"unknown scaffold {name!r} in schema {self.schema.name!r}{hint}",
                             element)
        if not is_empty(element):
            raise self.error(f"the import of scaffold {name!r} must be empty; import members "
                             "individually to pass arguments", element)
        members = scaffold.members
        parent = self.schema.modules[members[0]].parent or ROOT
        if scope != ROOT and parent != scope:
            raise self.error(f"scaffold {name!r} is not inside module {scope!r}", element)
        node = self.schema.modules[parent]
        implied = []
        while node.name != ROOT and node.name != scope:
            implied.append(node.name)
            node = self.schema.modules[node.parent]
        self.implicit.update(implied)
        for member in members:
            self._mark(member, element)
        modules = [self.schema.modules[m] for m in members]
        start = min(m.start for m in modules)
        end = max(m.start + m.length for m in modules)
        return Import(element, tuple(members), start, end, f"scaffold {name!r}",
                      implied=tuple(implied))


def flatten_imports(stream: list[Any]):
    """Every import in ``stream``, nested ones included, in document order."""
    for item in stream:
        if isinstance(item, Import):
            yield from flatten_import(item)


def flatten_import(node: Import):
    """``node`` and the imports nested in it, in document order."""
    yield node
    for child in node.children:
        yield from flatten_import(child)
