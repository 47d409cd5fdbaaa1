"""Pass 1 of schema parsing: the element tree -> declarations (names, nesting, text runs), with
every check that needs no tokens."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from lxml import etree

from pckernels.errors import PMLError
from pckernels.pml.document import Limits, Source, TextPart, local_tag
from pckernels.pml.elements import (
    ROLE_TAGS,
    XML_WHITESPACE,
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
from pckernels.pml.model import ROOT
from pckernels.pml.schema_decls import GroupDecl, ModuleDecl, PositionLimit, SlotDecl, TextDecl, TokensDecl
from pckernels.pml.tokens import special_prefix

log = logging.getLogger(__name__)

_PARAM_TAGS = ("param", "parameter")
_SCHEMA_TAGS = ("module", "union", "scaffold") + _PARAM_TAGS + ROLE_TAGS


def _is_param(part: Any) -> bool:
    return isinstance(part, etree._Element) and part.tag in _PARAM_TAGS


class SchemaReader:
    """Turns a schema element tree into declarations (pass 1)."""

    def __init__(self, source: Source, tokenizer: Any, base_dir: Path | None,
                 limits: Limits, position_limit: PositionLimit, placement: str = "schema") -> None:
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
        self.unions: dict[str, GroupDecl] = {}
        self.scaffolds: dict[str, GroupDecl] = {}
        self.top_names: dict[str, str] = {}
        self.placement = placement
        self.roles = RoleTags(source, tokenizer)

    def error(self, message: str, element: Any = None, offset: int | None = None) -> PMLError:
        return self.source.error(message, element, offset=offset)

    def read(self) -> tuple[str, ModuleDecl]:
        root = self.source.root
        if local_tag(root) != "schema":
            raise self.error(f"a schema document must start with <schema name=\"…\">, "
                             f"not <{root.tag}>", root)
        values = attributes(self.source, root, ("name", "placement"), ("name",))
        name = check_name(self.source, root, values["name"], "schema")
        self.placement = check_placement(self.source, root, values.get("placement", self.placement))
        scope = ModuleDecl(ROOT, None, None, root)
        self._fill(scope, root, preserve=space_mode(self.source, root, False),
                   in_role=False, in_scaffold=False)
        prefix = special_prefix(self.tokenizer)
        if prefix:
            scope.items.insert(0, TokensDecl(prefix))
        elif self.roles.format is not None and self.roles.format.conversation_start:
            scope.items.insert(0, TextDecl([self.roles.format.conversation_start]))
        if not any(isinstance(item, (TextDecl, ModuleDecl, GroupDecl))
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

    def _fill(self, scope: ModuleDecl, element: Any, *, preserve: bool, in_role: bool,
              in_scaffold: bool) -> None:
        for part in text_runs(element, preserve, _is_param):
            if isinstance(part, TextPart):
                scope.add_text(part.text)
            else:
                self._child(scope, part, preserve=preserve, in_role=in_role,
                            in_scaffold=in_scaffold)

    def _child(self, scope: ModuleDecl, element: Any, *, preserve: bool, in_role: bool,
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

    def _claim(self, scope: ModuleDecl, element: Any, name: str, what: str) -> None:
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

    def _module(self, scope: ModuleDecl, element: Any, *, preserve: bool, in_role: bool,
                in_scaffold: bool, union: str | None = None, scaffold: str | None = None,
                layout_parent: str | None = None) -> ModuleDecl:
        values = attributes(self.source, element, ("name", "src", "cache"), ("name",))
        local = check_name(self.source, element, values["name"], "module")
        self._claim(scope, element, local, "module")
        self.module_count += 1
        if self.module_count > self.limits.max_modules:
            raise self.error(f"too many modules: the limit is {self.limits.max_modules} "
                             "(Limits.max_modules)", element)
        if layout_parent is None and scope.name != ROOT:
            layout_parent = scope.name
        decl = ModuleDecl(qualify(scope.name, local), scope.name, layout_parent, element,
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

    def _cached(self, scope: ModuleDecl, element: Any, value: str | None,
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

    def _param(self, scope: ModuleDecl, element: Any) -> SlotDecl:
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
        return SlotDecl(name, length, default or None, element=element,
                        original_spelling="scaffold" in values)

    def _members(self, scope: ModuleDecl, element: Any, what: str, *, preserve: bool,
                 in_role: bool, in_scaffold: bool, union: str | None,
                 scaffold: str | None) -> list[ModuleDecl]:
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
                    isinstance(item, (ModuleDecl, GroupDecl))
                    for item in member.items):
                raise self.error(f"scaffold {scaffold!r}: member {member.name!r} contains nested "
                                 "modules; scaffold members must be leaf modules (their joint "
                                 "states replace the individual ones, and a nested module's "
                                 "cached states depend on its parent's)", part)
            members.append(member)
        if not members:
            raise self.error(f"empty <{what}>: it needs at least one <module>", element)
        return members

    def _union(self, scope: ModuleDecl, element: Any, *, preserve: bool, in_role: bool,
               in_scaffold: bool) -> GroupDecl:
        values = attributes(self.source, element, ("name", "scaffold"))
        if "scaffold" in values:
            self.union_scaffolds.append(element)
        return self._group(scope, element, "union", values.get("name"), preserve=preserve,
                           in_role=in_role, in_scaffold=in_scaffold)

    def _scaffold(self, scope: ModuleDecl, element: Any, *, preserve: bool, in_role: bool,
                  in_scaffold: bool) -> GroupDecl:
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

    def _group(self, scope: ModuleDecl, element: Any, kind: str, name: str | None, *,
               preserve: bool, in_role: bool, in_scaffold: bool) -> GroupDecl:
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
        decl = GroupDecl(kind, name, None if scope.name == ROOT else scope.name)
        (self.unions if kind == "union" else self.scaffolds)[name] = decl
        decl.members = self._members(scope, element, kind, preserve=preserve, in_role=in_role,
                                     in_scaffold=in_scaffold, union=name if kind == "union" else None,
                                     scaffold=name if kind == "scaffold" else None)
        return decl

    def _role(self, scope: ModuleDecl, element: Any, *, preserve: bool, in_role: bool,
              in_scaffold: bool) -> None:
        self.roles.expand(element, preserve, in_role=in_role, add_text=scope.add_text,
                          add_content=lambda keep: self._fill(scope, element, preserve=keep, in_role=True,
                                                              in_scaffold=in_scaffold))
