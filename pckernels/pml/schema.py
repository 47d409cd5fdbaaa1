"""Schema parsing and layout: PML text -> ``Schema`` (modules, positions, unions, scaffolds).

Parsing happens in three passes: the element tree is checked and turned into declarations
(names, nesting, text runs), all text runs are tokenized in one batch, and the layout pass
assigns positions in document order.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lxml import etree

from pckernels.errors import PMLError
from pckernels.pml.document import Limits, Source, TextPart, local_tag, read_document
from pckernels.pml.elements import (
    ROLE_TAGS,
    XML_WHITESPACE,
    Pieces,
    RoleTags,
    attributes,
    check_name,
    check_placement,
    is_empty,
    qualify,
    space_mode,
    text_offset,
    text_runs,
)
from pckernels.pml.model import ROOT, LayoutEntry, Module, Param, Scaffold, Schema
from pckernels.pml.tokens import encode_batch, fingerprint, placeholder_token_id, special_prefix

log = logging.getLogger(__name__)

LAYOUT_VERSION = "pml-layout-1"
"""Changes whenever the same schema text could lay out differently (part of the digest)."""

_PARAM_TAGS = ("param", "parameter")
_SCHEMA_TAGS = ("module", "union", "scaffold") + _PARAM_TAGS + ROLE_TAGS


@dataclass
class _Text(Pieces):
    """A run of module text."""

    ids: tuple[int, ...] | None = None
    """Set by ``_LazyEncoder`` when the layout reaches the text."""


@dataclass
class _Tokens:
    ids: tuple[int, ...]


@dataclass
class _Slot:
    name: str
    length: int
    default_text: str | None
    default_ids: tuple[int, ...] = ()
    element: Any = None
    original_spelling: bool = False
    """The default came from the original implementation's ``scaffold=``."""


@dataclass
class _ModuleDecl:
    name: str
    parent: str | None
    layout_parent: str | None
    element: Any
    union: str | None = None
    scaffold: str | None = None
    cached: bool = True
    items: list = field(default_factory=list)
    local_names: set[str] = field(default_factory=set)

    def add_text(self, text: str) -> None:
        if self.items and isinstance(self.items[-1], _Text):
            self.items[-1].pieces.append(text)
        else:
            self.items.append(_Text([text]))


@dataclass
class _GroupDecl:
    """A ``<union>`` (``kind``; its members are alternatives at the same positions) or a
    ``<scaffold>`` (its members follow one another and are encoded together)."""

    kind: str
    name: str
    layout_parent: str | None
    members: list[_ModuleDecl] = field(default_factory=list)


def _is_param(part: Any) -> bool:
    return isinstance(part, etree._Element) and part.tag in _PARAM_TAGS


@dataclass(frozen=True)
class _PositionLimit:
    """The binding position limit: the model's ``max_positions`` or ``Limits.max_positions``."""

    value: int
    model: bool

    @classmethod
    def of(cls, limits: Limits, max_positions: int | None) -> "_PositionLimit":
        if max_positions is not None and max_positions <= limits.max_positions:
            return cls(max_positions, True)
        return cls(limits.max_positions, False)

    def __str__(self) -> str:
        if self.model:
            return f"the model's limit of {self.value} positions (max_positions)"
        return f"the limit of {self.value} positions (Limits.max_positions)"


class _SchemaReader:
    """Turns a schema element tree into declarations (pass 1)."""

    def __init__(self, source: Source, tokenizer: Any, base_dir: Path | None,
                 limits: Limits, position_limit: _PositionLimit) -> None:
        self.source = source
        self.tokenizer = tokenizer
        self.base_dir = base_dir
        self.limits = limits
        self.position_limit = position_limit
        self.slot_positions = 0
        self.union_scaffolds: list[Any] = []
        self.module_count = 0
        self.src_bytes = 0
        self.src_records: list[tuple[str, str]] = []
        self.unions: dict[str, _GroupDecl] = {}
        self.scaffolds: dict[str, _GroupDecl] = {}
        self.top_names: dict[str, str] = {}
        self.placement = "schema"
        self.roles = RoleTags(source, tokenizer)

    def error(self, message: str, element: Any = None, offset: int | None = None) -> PMLError:
        return self.source.error(message, element, offset=offset)

    def read(self) -> tuple[str, _ModuleDecl]:
        root = self.source.root
        if local_tag(root) != "schema":
            raise self.error(f"a schema document must start with <schema name=\"…\">, "
                             f"not <{root.tag}>", root)
        values = attributes(self.source, root, ("name", "placement"), ("name",))
        name = check_name(self.source, root, values["name"], "schema")
        self.placement = check_placement(self.source, root, values.get("placement", "schema"))
        scope = _ModuleDecl(ROOT, None, None, root)
        self._fill(scope, root, preserve=space_mode(self.source, root, False),
                   in_role=False, in_scaffold=False)
        prefix = special_prefix(self.tokenizer)
        if prefix:
            scope.items.insert(0, _Tokens(prefix))
        elif self.roles.format is not None and self.roles.format.conversation_start:
            scope.items.insert(0, _Text([self.roles.format.conversation_start]))
        if not any(isinstance(item, (_Text, _ModuleDecl, _GroupDecl))
                   for item in scope.items):
            raise self.error(f"empty schema {name!r}: add text or <module> elements", root)
        if self.union_scaffolds:
            first = self.source.location(self.source.element_offset(self.union_scaffolds[0]) or 0)
            log.warning("%sschema %r: scaffold= on %d <union> element(s) (the first at line %d, "
                        "column %d) is accepted and ignored: promptcache encodes each module "
                        "against its ancestors only, so no union member stands in for the chosen "
                        "one while other text is encoded (the original implementation's meaning "
                        "of a union without scaffold=)",
                        f"{self.source.label}: " if self.source.label else "", name,
                        len(self.union_scaffolds), *first)
        return name, scope

    def _fill(self, scope: _ModuleDecl, element: Any, *, preserve: bool, in_role: bool,
              in_scaffold: bool) -> None:
        for part in text_runs(element, preserve, _is_param):
            if isinstance(part, TextPart):
                scope.add_text(part.text)
            else:
                self._child(scope, part, preserve=preserve, in_role=in_role,
                            in_scaffold=in_scaffold)

    def _child(self, scope: _ModuleDecl, element: Any, *, preserve: bool, in_role: bool,
               in_scaffold: bool) -> None:
        tag = local_tag(element)
        if tag == "module":
            scope.items.append(self._module(scope, element, preserve=preserve, in_role=in_role,
                                            in_scaffold=in_scaffold))
        elif tag in _PARAM_TAGS:
            scope.items.append(self._param(scope, element))
        elif tag == "union":
            scope.items.append(self._union(scope, element, preserve=preserve, in_role=in_role,
                                           in_scaffold=in_scaffold))
        elif tag == "scaffold":
            scope.items.append(self._scaffold(scope, element, preserve=preserve,
                                              in_role=in_role, in_scaffold=in_scaffold))
        elif tag in ROLE_TAGS:
            self._role(scope, element, preserve=preserve, in_role=in_role,
                       in_scaffold=in_scaffold)
        else:
            expected = ", ".join(f"<{t}>" for t in _SCHEMA_TAGS)
            raise self.error(f"unknown element <{element.tag}> in a schema; expected one of "
                             f"{expected}", element)

    def _claim(self, scope: _ModuleDecl, element: Any, name: str, what: str) -> None:
        if name in scope.local_names:
            where = "at the top level of the schema" if scope.name == ROOT else \
                f"in module {scope.name!r}"
            raise self.error(f"duplicate name {name!r} {where}: module and parameter names "
                             "must be unique within their module", element)
        if scope.name == ROOT:
            kind = self.top_names.get(name) or ("union" if name in self.unions else None) or \
                ("scaffold" if name in self.scaffolds else None)
            if kind is not None:
                raise self.error(f"duplicate name {name!r}: a {kind} of that name already "
                                 "exists; top-level modules, unions and scaffolds need distinct "
                                 "names", element)
        scope.local_names.add(name)
        if scope.name == ROOT:
            self.top_names[name] = what

    def _module(self, scope: _ModuleDecl, element: Any, *, preserve: bool, in_role: bool,
                in_scaffold: bool, union: str | None = None, scaffold: str | None = None,
                layout_parent: str | None = None) -> _ModuleDecl:
        values = attributes(self.source, element, ("name", "src", "cache"), ("name",))
        local = check_name(self.source, element, values["name"], "module")
        self._claim(scope, element, local, "module")
        self.module_count += 1
        if self.module_count > self.limits.max_modules:
            raise self.error(f"too many modules: the limit is {self.limits.max_modules} "
                             "(Limits.max_modules)", element)
        if layout_parent is None and scope.name != ROOT:
            layout_parent = scope.name
        decl = _ModuleDecl(qualify(scope.name, local), scope.name, layout_parent, element,
                           union=union, scaffold=scaffold,
                           cached=self._cached(scope, element, values.get("cache"), scaffold))
        preserve = space_mode(self.source, element, preserve)
        if "src" in values:
            text = self._load_src(element, values["src"])
            if not preserve:
                text = text.strip(XML_WHITESPACE)
            if text:
                decl.add_text(text)
        else:
            self._fill(decl, element, preserve=preserve, in_role=in_role,
                       in_scaffold=in_scaffold)
        return decl

    def _cached(self, scope: _ModuleDecl, element: Any, value: str | None,
                scaffold: str | None) -> bool:
        """Whether a module is cached: ``cache="false"`` turns it off for the module and
        everything inside it (their states would depend on text computed per prompt)."""
        if value is None:
            return scope.cached
        value = value.strip(XML_WHITESPACE)
        if value not in ("true", "false"):
            raise self.error(f"cache={value!r}: expected cache=\"true\" (the default) or "
                             "cache=\"false\" (compute the module in every prompt)", element)
        if value == "true" and not scope.cached:
            raise self.error(f"cache=\"true\" inside module {scope.name!r}, which is not cached: "
                             "a module inside an uncached module is computed in every prompt "
                             "too; drop the attribute", element)
        if value == "false" and scaffold is not None:
            raise self.error(f"scaffold {scaffold!r}: a scaffold member cannot have "
                             "cache=\"false\" (the members are encoded together and cached); "
                             "move the module out of the scaffold", element)
        return value == "true"

    def _load_src(self, element: Any, src: str) -> str:
        if not is_empty(element):
            raise self.error("a <module> with src= must be empty (its text comes from the "
                             "file)", element)
        if self.base_dir is None:
            raise self.error(f"src={src!r} needs a base directory: pass base_dir= to "
                             "parse_schema", element)
        if not src or "\x00" in src or os.path.isabs(src) or src.startswith(("/", "\\")):
            raise self.error(f"src={src!r} must be a relative path inside the schema "
                             "directory", element)
        shown = src if len(src) <= 80 else f"{src[:60]}…({len(src)} characters)"
        try:
            base = self.base_dir.resolve()
            path = (base / src).resolve()
            if path != base and base not in path.parents:
                raise self.error(f"src={shown!r} escapes the schema directory {str(base)!r}; "
                                 "only files inside it may be loaded", element)
            if not path.is_file():
                raise self.error(f"src={shown!r}: no such file in {str(base)!r}", element)
            size = path.stat().st_size
            self.src_bytes += size
            if self.src_bytes > self.limits.max_src_bytes:
                raise self.error(f"src={shown!r}: files loaded by this schema exceed "
                                 f"{self.limits.max_src_bytes} bytes (Limits.max_src_bytes)",
                                 element)
            data = path.read_bytes()
        except (OSError, RuntimeError) as exc:
            reason = getattr(exc, "strerror", None) or exc
            raise self.error(f"src={shown!r} cannot be read: {reason}; expected a relative path "
                             "to a readable file inside the schema directory", element) from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.error(f"src={shown!r} is not UTF-8 text ({exc.reason} at byte "
                             f"{exc.start}); save the file as UTF-8", element) from None
        self.src_records.append((src, hashlib.sha256(data).hexdigest()))
        return text

    def _param(self, scope: _ModuleDecl, element: Any) -> _Slot:
        tag = element.tag
        if scope.name == ROOT:
            raise self.error(f"<{tag}> must be inside a <module> (a parameter is a slot in a "
                             "module's text)", element)
        values = attributes(self.source, element, ("name", "len", "length", "default",
                                                   "scaffold"), ("name",))
        name = check_name(self.source, element, values["name"], "parameter")
        if not (name[0].isalpha() or name[0] == "_"):
            raise self.error(f"invalid parameter name {name!r}: it must start with a letter "
                             "or '_' so prompts can pass it as an attribute", element)
        if "len" in values and "length" in values:
            raise self.error(f"<{tag}> takes len= or length=, not both", element)
        if "default" in values and "scaffold" in values:
            raise self.error(f"<{tag}> takes default= or scaffold= (its default text), not "
                             "both", element)
        raw = values.get("len", values.get("length"))
        if raw is None:
            raise self.error(f"<{tag} name=\"{name}\"> needs len=\"N\": the number of positions "
                             "reserved for its argument", element)
        raw = raw.strip(XML_WHITESPACE)
        if not raw.isascii() or not raw.isdigit() or not raw.strip("0"):
            raise self.error(f"invalid len={raw!r} on parameter {name!r}: expected a whole "
                             "number of tokens, at least 1", element)
        digits = raw.lstrip("0")
        limit = self.position_limit
        if len(digits) > len(str(limit.value)) or int(digits) > limit.value:
            shown = digits if len(digits) <= 20 else f"{digits[:20]}… ({len(digits)} digits)"
            raise self.error(f"len={shown} on parameter {name!r} is past {limit}; a "
                             "parameter cannot reserve more positions than the schema may span",
                             element)
        length = int(digits)
        self.slot_positions += length
        if self.slot_positions > self.limits.max_positions:
            raise self.error(f"the parameters up to {name!r} reserve {self.slot_positions} "
                             f"positions in all, more than {self.limits.max_positions} "
                             "(Limits.max_positions); lower their len=", element)
        if not is_empty(element):
            raise self.error(f"<{tag}> must be empty: write <{tag} name=\"{name}\" "
                             f"len=\"{length}\"/>", element)
        self._claim(scope, element, name, "parameter")
        default = values.get("default", values.get("scaffold"))
        return _Slot(name, length, default or None, element=element,
                     original_spelling="scaffold" in values)

    def _members(self, scope: _ModuleDecl, element: Any, what: str, *, preserve: bool,
                 in_role: bool, in_scaffold: bool, union: str | None,
                 scaffold: str | None) -> list[_ModuleDecl]:
        members = []
        preserve = space_mode(self.source, element, preserve)
        for part in text_runs(element, False, lambda _: False):
            if isinstance(part, TextPart):
                raise self.error(f"text inside <{what}> must be inside one of its modules",
                                 offset=text_offset(self.source, part), element=element)
            if local_tag(part) != "module":
                raise self.error(f"<{part.tag}> cannot appear directly inside <{what}>; only "
                                 "<module> elements can", part)
            member = self._module(scope, part, preserve=preserve, in_role=in_role,
                                  in_scaffold=in_scaffold, union=union, scaffold=scaffold,
                                  layout_parent=union or scaffold)
            if scaffold is not None and any(
                    isinstance(item, (_ModuleDecl, _GroupDecl))
                    for item in member.items):
                raise self.error(f"scaffold {scaffold!r}: member {member.name!r} contains nested "
                                 "modules; scaffold members must be leaf modules (their joint "
                                 "states replace the individual ones, and a nested module's "
                                 "cached states depend on its parent's)", part)
            members.append(member)
        if not members:
            raise self.error(f"empty <{what}>: it needs at least one <module>", element)
        return members

    def _union(self, scope: _ModuleDecl, element: Any, *, preserve: bool, in_role: bool,
               in_scaffold: bool) -> _GroupDecl:
        values = attributes(self.source, element, ("name", "scaffold"))
        if "scaffold" in values:
            self.union_scaffolds.append(element)
        return self._group(scope, element, "union", values.get("name"), preserve=preserve,
                           in_role=in_role, in_scaffold=in_scaffold)

    def _scaffold(self, scope: _ModuleDecl, element: Any, *, preserve: bool, in_role: bool,
                  in_scaffold: bool) -> _GroupDecl:
        if in_scaffold:
            raise self.error("scaffolds do not nest: this <scaffold> is inside another "
                             "scaffold's module", element)
        if not scope.cached:
            raise self.error(f"a <scaffold> cannot be inside module {scope.name!r}, which has "
                             "cache=\"false\": scaffold members are encoded together and "
                             "cached", element)
        values = attributes(self.source, element, ("name",), ("name",))
        return self._group(scope, element, "scaffold", values["name"], preserve=preserve,
                           in_role=in_role, in_scaffold=True)

    def _group(self, scope: _ModuleDecl, element: Any, kind: str, name: str | None, *,
               preserve: bool, in_role: bool, in_scaffold: bool) -> _GroupDecl:
        """Declare a ``kind`` (``"union"`` or ``"scaffold"``) named ``name`` (``None``: an
        unnamed union) and read its member modules."""
        if name is None:
            name = f"@union{len(self.unions) + 1}"
        else:
            name = check_name(self.source, element, name, kind)
            if name in self.unions or name in self.scaffolds or name in self.top_names:
                others = "unions, scaffolds" if kind == "union" else "scaffolds, unions"
                raise self.error(f"duplicate name {name!r}: {kind} names must differ from other "
                                 f"{others} and top-level modules", element)
        if scope.name == ROOT:
            self.top_names[name] = kind
        decl = _GroupDecl(kind, name, None if scope.name == ROOT else scope.name)
        (self.unions if kind == "union" else self.scaffolds)[name] = decl
        decl.members = self._members(scope, element, kind, preserve=preserve, in_role=in_role,
                                     in_scaffold=in_scaffold, union=name if kind == "union" else None,
                                     scaffold=name if kind == "scaffold" else None)
        return decl

    def _role(self, scope: _ModuleDecl, element: Any, *, preserve: bool, in_role: bool,
              in_scaffold: bool) -> None:
        self.roles.expand(element, preserve, in_role=in_role, add_text=scope.add_text,
                          add_content=lambda keep: self._fill(scope, element, preserve=keep, in_role=True,
                                                              in_scaffold=in_scaffold))


_BATCH_CHARS = 1 << 20
"""About how many characters of schema text are tokenized per batch."""
_PROBE_MARGIN = 64


class _TooLong(Exception):
    """A text needs at least ``at_least`` positions, more than the room left for it."""

    def __init__(self, at_least: int) -> None:
        super().__init__(at_least)
        self.at_least = at_least


class _LazyEncoder:
    """Tokenizes the schema's texts in document order — the order the layout reads them — about
    ``_BATCH_CHARS`` characters per batch, so a schema past its position limit is refused after
    tokenizing at most one batch beyond the limit instead of all of it. A single text longer
    than a batch is first probed with a prefix: when the prefix alone needs more than twice the
    room left, the text is refused without tokenizing the rest."""

    def __init__(self, tokenizer: Any, texts: list[_Text]) -> None:
        self.tokenizer = tokenizer
        self.texts = texts
        self.index = {id(text): i for i, text in enumerate(texts)}

    def ids(self, item: _Text, room: int) -> tuple[int, ...]:
        """Token ids of ``item``; raises ``_TooLong`` when it certainly exceeds ``room``."""
        if item.ids is None:
            if len(item.text) > _BATCH_CHARS:
                self._probe(item.text, room)
            start = self.index[id(item)]
            end, size = start, 0
            while end < len(self.texts) and self.texts[end].ids is None and (
                    end == start or size + len(self.texts[end].text) <= _BATCH_CHARS):
                size += len(self.texts[end].text)
                end += 1
            batch = self.texts[start:end]
            for text, ids in zip(batch, encode_batch(self.tokenizer, [t.text for t in batch])):
                text.ids = ids
        return item.ids

    def _probe(self, text: str, room: int) -> None:
        chars = 32 * (max(room, 0) + _PROBE_MARGIN)
        if len(text) <= chars:
            return
        cut = max(text.rfind(" ", 0, chars), text.rfind("\n", 0, chars))
        count = len(encode_batch(self.tokenizer, [text[:cut if cut > 0 else chars]])[0])
        if count > 2 * max(room, 0) + _PROBE_MARGIN:
            raise _TooLong(count - _PROBE_MARGIN)


class _Layout:
    """Assigns positions in document order and builds the contract's data (pass 3).

    Positions and the total token count are checked before anything is allocated for a text
    or a parameter slot, so the work done is bounded by the limits, not by what the schema asks.
    """

    def __init__(self, name: str, placeholder: int, limits: Limits, limit: _PositionLimit,
                 source: Source, encoder: _LazyEncoder) -> None:
        self.name = name
        self.placeholder = placeholder
        self.limits = limits
        self.limit = limit
        self.source = source
        self.encoder = encoder
        self.entries: list[LayoutEntry] = []
        self.modules: dict[str, Module] = {}
        self.total_tokens = 0

    def _past(self, end: int, element: Any, what: str, at_least: bool = False) -> PMLError:
        where = f"past position {end - 1}" if at_least else f"at position {end}"
        return self.source.error(f"schema {self.name!r} does not fit: {what} ends {where}, "
                                 f"past {self.limit}", element)

    def _check(self, end: int, count: int, element: Any, what: str) -> None:
        """Refuse ``count`` more tokens ending at ``end`` before they are allocated."""
        if end > self.limit.value:
            raise self._past(end, element, what)
        self.total_tokens += count
        budget = self.limits.max_positions * 4
        if self.total_tokens > budget:
            raise self.source.error(f"the schema's modules hold more than {budget} tokens "
                                    "together (4 x Limits.max_positions)", element)

    def module(self, decl: _ModuleDecl, start: int) -> int:
        """Lay out ``decl`` from ``start``; returns the first position after it."""
        is_root = decl.name == ROOT
        entry_index = None
        if not is_root:
            entry_index = len(self.entries)
            self.entries.append(LayoutEntry(decl.name, "module", start, 0, decl.layout_parent))
        self.modules[decl.name] = None  # reserves the document-order slot
        position = start
        token_ids: list[int] = []
        position_ids: list[int] = []
        params: list[Param] = []
        children: list[str] = []
        for item in decl.items:
            if isinstance(item, (_Text, _Tokens)):
                what = "anonymous text" if is_root else f"module {decl.name!r}"
                if isinstance(item, _Text):
                    try:
                        ids = self.encoder.ids(item, self.limit.value - position)
                    except _TooLong as exc:
                        raise self._past(position + exc.at_least, decl.element, what,
                                         at_least=True) from None
                else:
                    ids = item.ids
                count = len(ids)
                self._check(position + count, count, decl.element, what)
                if is_root and count:
                    self._anonymous(position, count)
                token_ids.extend(ids)
                position_ids.extend(range(position, position + count))
                position += count
            elif isinstance(item, _Slot):
                self._check(position + item.length, item.length, item.element,
                            f"parameter {item.name!r} of module {decl.name!r}")
                params.append(Param(item.name, decl.name, position, item.length,
                                    len(token_ids), item.default_ids))
                self.entries.append(LayoutEntry(f"{decl.name}/{item.name}", "param", position,
                                                item.length, decl.name))
                token_ids.extend([self.placeholder] * item.length)
                position_ids.extend(range(position, position + item.length))
                position += item.length
            elif isinstance(item, _ModuleDecl):
                children.append(item.name)
                position = self.module(item, position)
            elif isinstance(item, _GroupDecl):
                position = self._group(item, position, children)
        if entry_index is not None:
            self.entries[entry_index] = LayoutEntry(decl.name, "module", start, position - start,
                                                    decl.layout_parent)
        self.modules[decl.name] = Module(
            name=decl.name, parent=decl.parent, token_ids=tuple(token_ids),
            position_ids=tuple(position_ids), params=tuple(params), union=decl.union,
            scaffolds=(decl.scaffold,) if decl.scaffold else (), children=tuple(children),
            start=start, length=position - start, cached=decl.cached)
        return position

    def _group(self, group: _GroupDecl, start: int, children: list[str]) -> int:
        """Lay out a union's members from ``start`` each, or a scaffold's one after another;
        returns the first position after the group."""
        index = len(self.entries)
        self.entries.append(LayoutEntry(group.name, group.kind, start, 0, group.layout_parent))
        end = start
        for member in group.members:
            children.append(member.name)
            end = max(end, self.module(member, start)) if group.kind == "union" else self.module(member, end)
        self.entries[index] = LayoutEntry(group.name, group.kind, start, end - start, group.layout_parent)
        return end

    def _anonymous(self, start: int, count: int) -> None:
        if self.entries:
            last = self.entries[-1]
            if last.kind == "anonymous" and last.start + last.length == start:
                self.entries[-1] = LayoutEntry(ROOT, "anonymous", last.start,
                                               last.length + count, None)
                return
        self.entries.append(LayoutEntry(ROOT, "anonymous", start, count, None))


def _walk(decl: _ModuleDecl):
    for item in decl.items:
        yield item
        if isinstance(item, _ModuleDecl):
            yield from _walk(item)
        elif isinstance(item, _GroupDecl):
            for member in item.members:
                yield member
                yield from _walk(member)


def parse_schema(text: str | bytes, tokenizer: Any, *, base_dir: str | os.PathLike | None = None,
                 max_positions: int | None = None, limits: Limits | None = None,
                 label: str | None = None) -> Schema:
    """Parse a PML schema and lay it out.

    ``base_dir`` is the directory ``src=`` paths are relative to; ``max_positions`` the
    model's position limit (the schema must end at or before it); ``label`` names the
    source in error messages. Raises ``PMLError`` for every rejection.
    """
    limits = limits or Limits()
    if max_positions is not None and max_positions < 1:
        raise PMLError(f"max_positions must be positive, not {max_positions}")
    source = read_document(text, limits, label=label, kind="schema")
    limit = _PositionLimit.of(limits, max_positions)
    reader = _SchemaReader(source, tokenizer, Path(base_dir) if base_dir is not None else None,
                           limits, limit)
    name, root = reader.read()

    items = list(_walk(root))
    slots = [item for item in items if isinstance(item, _Slot) and item.default_text]
    for slot, ids in zip(slots, encode_batch(tokenizer, [s.default_text for s in slots])):
        if len(ids) > slot.length and slot.original_spelling:
            line, column = source.location(source.element_offset(slot.element) or 0)
            log.warning("%sline %d, column %d: scaffold=%r on parameter %r is %d tokens, longer "
                        "than its length=%d; ignored, the parameter has no default (the original "
                        "implementation refuses it too, with some tokenizers)",
                        f"{label}: " if label else "", line, column, slot.default_text,
                        slot.name, len(ids), slot.length)
            continue
        if len(ids) > slot.length:
            raise source.error(f"the default of parameter {slot.name!r} is {len(ids)} tokens, "
                               f"longer than its len={slot.length}", slot.element)
        slot.default_ids = ids

    encoder = _LazyEncoder(tokenizer, [item for item in items if isinstance(item, _Text)])
    layout = _Layout(name, placeholder_token_id(tokenizer), limits, limit, source, encoder)
    length = layout.module(root, 0)

    digest = hashlib.sha256()
    for part in (LAYOUT_VERSION, source.text, fingerprint(tokenizer)):
        digest.update(part.encode("utf-8"))
        digest.update(b"\x00")
    for src, file_digest in reader.src_records:
        digest.update(f"{src}\x00{file_digest}\x00".encode("utf-8"))

    scaffolds = {s.name: Scaffold(s.name, tuple(m.name for m in s.members))
                 for s in reader.scaffolds.values()}
    unions = {u.name: tuple(m.name for m in u.members) for u in reader.unions.values()}
    return Schema(name=name, modules=layout.modules, layout=tuple(layout.entries),
                  scaffolds=scaffolds, length=length, digest=digest.hexdigest(),
                  placeholder_token_id=layout.placeholder, tokenizer=tokenizer,
                  source=source.text, unions=unions, max_positions=max_positions,
                  placement=reader.placement, location=source.location(source.element_offset(source.root) or 0))
