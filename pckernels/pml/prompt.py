"""Prompt resolution: PML prompt text + schemas -> ``ResolvedPrompt``.

Imports may come in any order: every module sits at its schema positions whatever the order
it is imported in (the paper's §3.4: "the order of concatenation does not matter").

Text placement rule (uncached text is never dropped):

* Text after the last import starts at ``Schema.length`` and continues contiguously.
* Text before or between imports starts right after the import written before it (the end
  of that import's span, or position 0 for text before the first import), skipping tokens
  already there that the prompt imports earlier (anonymous schema text counts as imported)
  and text placed earlier, and must end before the next imported token or placed text. If it
  does not fit, ``PMLError`` says how many positions are missing and how to declare room (a
  ``<param>`` buffer in the schema).

``placement="compact"`` (on the prompt, or the schema's default) lays the prompt out contiguously
in its order instead (``pckernels.pml.placement``); text between imports then needs no room.
"""

from __future__ import annotations

import bisect
import difflib
from dataclasses import dataclass, field
from typing import Any, Mapping

from pckernels.errors import PMLError, UnknownSchemaError
from pckernels.pml.document import Limits, Source, TextPart, is_valid_name, local_tag, read_document
from pckernels.pml.elements import (
    ROLE_TAGS,
    Pieces,
    RoleTags,
    attributes,
    check_placement,
    is_empty,
    qualify,
    space_mode,
    text_offset,
    text_runs,
)
from pckernels.pml.model import ROOT, Module, ResolvedPrompt, Schema, Segment
from pckernels.pml.placement import Layout, compact_layout
from pckernels.pml.tokens import encode_batch


@dataclass
class _TextRun(Pieces):
    """A run of prompt text."""

    offset: int | None
    ids: tuple[int, ...] = ()


@dataclass
class _Import:
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
    children: list["_Import"] = field(default_factory=list)


class _PromptReader:
    """Reads the prompt tree into a stream of text runs and imports (pass 1)."""

    def __init__(self, source: Source, schema: Schema) -> None:
        self.source = source
        self.schema = schema
        self.stream: list[_TextRun | _Import] = []
        self.explicit: dict[str, Any] = {}
        self.implicit: set[str] = set()
        self.roles = RoleTags(source, schema.tokenizer)

    def error(self, message: str, element: Any = None, offset: int | None = None) -> PMLError:
        return self.source.error(message, element, offset=offset)

    def read(self) -> None:
        root = self.source.root
        self._content(root, space_mode(self.source, root, False), in_role=False)

    def _add_text(self, text: str, offset: int | None) -> None:
        if self.stream and isinstance(self.stream[-1], _TextRun):
            self.stream[-1].pieces.append(text)
        else:
            self.stream.append(_TextRun([text], offset))

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

    def _import(self, element: Any, scope: str) -> _Import:
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
        node = _Import(element, (target,), module.start, module.start + module.length,
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

    def _scaffold_import(self, element: Any, scope: str, name: str) -> _Import:
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
        return _Import(element, tuple(members), start, end, f"scaffold {name!r}",
                       implied=tuple(implied))


def _runs(module: Module) -> list[tuple[int, int]]:
    """Contiguous position runs of a module's own tokens, as (start, end)."""
    runs: list[tuple[int, int]] = []
    for position in module.position_ids:
        if runs and runs[-1][1] == position:
            runs[-1] = (runs[-1][0], position + 1)
        else:
            runs.append((position, position + 1))
    return runs


_PLACED = "@text"
"""Owner of positions taken by text placed earlier in the prompt (not a valid module name)."""


class _Placer:
    """Places uncached text (pass 3)."""

    def __init__(self, source: Source, schema: Schema, imported: list[str],
                 limits: Limits) -> None:
        self.source = source
        self.schema = schema
        self.limits = limits
        occupied: list[tuple[int, int, str]] = []
        for name in imported:
            for start, end in _runs(schema.modules[name]):
                occupied.append((start, end, name))
        occupied.sort()
        self.occupied = occupied
        self.starts = [start for start, _, _ in occupied]
        self.segments: list[Segment] = []

    def _owner(self, name: str) -> str:
        if name == _PLACED:
            return "text placed earlier"
        return "the schema's anonymous text" if name == ROOT else f"module {name!r}"

    def place(self, run: _TextRun, cursor: int, done: set[str], previous: str | None,
              following: str) -> int:
        """Place text that precedes an import: from the cursor (the end of the import written
        before it), past what is already there, up to the next imported token or placed text."""
        count = len(run.ids)
        position = cursor
        index = max(bisect.bisect_right(self.starts, position) - 1, 0)
        while index < len(self.occupied):
            start, end, owner = self.occupied[index]
            if start > position:
                break
            if end > position and (owner in done or owner == _PLACED):
                position = end
            index += 1
        limit, blocker = self.schema.length, "the end of the schema"
        for start, end, owner in self.occupied:
            if end > position and (start >= position or owner not in done) and start < limit:
                limit, blocker = start, self._owner(owner)
        if position + count > limit:
            after = f"after {previous}" if previous else "at the start of the prompt"
            free = max(limit - position, 0)
            raise self.source.error(
                f"text {after} needs {count} positions but only {free} are free at "
                f"{position} before {blocker} (next import: {following}); declare room for it in "
                f"the schema, e.g. <param name=\"buffer\" len=\"{count}\"/> inside a module, and "
                "pass the text as that parameter's argument, or move the text after the last "
                "import", offset=run.offset)
        self.segments.append(Segment("text", run.ids, tuple(range(position, position + count))))
        if count:
            entry = (position, position + count, _PLACED)
            bisect.insort(self.occupied, entry)
            self.starts.insert(bisect.bisect_left(self.occupied, entry), position)
        return position + count

    def place_trailing(self, run: _TextRun, position: int) -> int:
        count = len(run.ids)
        end = position + count
        model_limit = self.schema.max_positions
        if model_limit is not None and end > model_limit:
            raise self.source.error(f"the prompt ends at position {end}, past the model's limit "
                                    f"of {model_limit} positions (schema ends at "
                                    f"{self.schema.length}); shorten the text",
                                    offset=run.offset)
        if end > self.limits.max_positions:
            raise self.source.error(f"the prompt ends at position {end}, past "
                                    f"{self.limits.max_positions} (Limits.max_positions)",
                                    offset=run.offset)
        self.segments.append(Segment("text", run.ids, tuple(range(position, end))))
        return end


def _module_segments(module: Module, arguments: dict[tuple[str, str], tuple[int, ...]]
                     ) -> list[Segment]:
    """Cached runs, slots and arguments of one imported module. An uncached module
    (``cache="false"``) gives ``text`` runs and its arguments, and no slots: nothing cached
    needs placeholders."""
    out: list[Segment] = []
    slots = {p.offset: p for p in module.params}
    tokens, positions = module.token_ids, module.position_ids
    kind = "cached" if module.cached else "text"
    run_start = 0

    def flush(end: int) -> None:
        if end > run_start:
            out.append(Segment(kind, tokens[run_start:end], positions[run_start:end],
                               module=module.name))

    index = 0
    while index < len(tokens):
        param = slots.get(index)
        if param is not None:
            flush(index)
            end = index + param.length
            if module.cached:
                out.append(Segment("slot", tokens[index:end], positions[index:end],
                                   module=module.name, param=param.name))
            argument = arguments[(module.name, param.name)]
            if argument:
                out.append(Segment("argument", argument,
                                   tuple(range(param.start, param.start + len(argument))),
                                   module=module.name, param=param.name))
            index = end
            run_start = index
            continue
        if index > run_start and positions[index] != positions[index - 1] + 1:
            flush(index)
            run_start = index
        index += 1
    flush(len(tokens))
    return out


def parse_prompt(text: str | bytes, schemas: Mapping[str, Schema] | Schema, *,
                 limits: Limits | None = None, label: str | None = None) -> ResolvedPrompt:
    """Resolve a PML prompt against the schema it names (``<prompt schema="…">``).

    ``schemas`` maps schema names to parsed schemas (a single ``Schema`` also works).
    Raises ``PMLError`` for every rejection; nothing is modified on failure.
    """
    limits = limits or Limits()
    source = read_document(text, limits, label=label, kind="prompt")
    root = source.root
    if local_tag(root) != "prompt":
        raise source.error(f"a prompt must start with <prompt schema=\"…\">, not <{root.tag}>",
                           root)
    values = attributes(source, root, ("schema", "placement"), ("schema",))
    if isinstance(schemas, Schema):
        schemas = {schemas.name: schemas}
    schema = schemas.get(values["schema"])
    if not isinstance(schema, Schema):
        name = values["schema"]
        close = difflib.get_close_matches(name, [str(k) for k in schemas], n=3)
        hint = ("; did you mean " + " or ".join(map(repr, close)) + "?") if close else \
            f"; known schemas: {', '.join(map(str, schemas)) or 'none'}"
        error = source.error(f"unknown schema {name!r}{hint}", root, kind=UnknownSchemaError)
        error.schema = name
        raise error

    placement = check_placement(source, root, values.get("placement", schema.placement))
    reader = _PromptReader(source, schema)
    reader.read()
    imported_set = set(reader.explicit) | reader.implicit | {ROOT}
    imported = [name for name in schema.modules if name in imported_set]

    for union, members in schema.unions.items():
        chosen = [m for m in members if m in imported_set]
        if len(chosen) > 1:
            second = reader.explicit.get(chosen[1])
            raise source.error(f"modules {chosen[0]!r} and {chosen[1]!r} belong to the same "
                               f"union {union!r}; a prompt may import at most one of its "
                               "members", second)

    imports = list(_flatten(reader.stream))
    runs = [item for item in reader.stream if isinstance(item, _TextRun)]
    argument_items = [(node, key, value)
                      for node in imports for key, value in node.arguments.items()]
    encoded = encode_batch(schema.tokenizer,
                           [r.text for r in runs] + [v for _, _, v in argument_items])
    for run, ids in zip(runs, encoded):
        run.ids = ids

    arguments: dict[tuple[str, str], tuple[int, ...]] = {}
    for name in imported:
        for param in schema.modules[name].params:
            arguments[(name, param.name)] = param.default
    for (node, key, _), ids in zip(argument_items, encoded[len(runs):]):
        target = node.modules[0]
        param = next(p for p in schema.modules[target].params if p.name == key)
        if len(ids) > param.length:
            raise source.error(f"argument for parameter {key!r} of module {target!r} is "
                               f"{len(ids)} tokens, longer than its len={param.length}; "
                               "shorten it or raise len in the schema", node.element)
        arguments[(target, key)] = ids

    scaffolds = tuple(name for name, scaffold in schema.scaffolds.items()
                      if all(m in imported_set for m in scaffold.members))
    module_segments = [seg for name in imported for seg in _module_segments(schema.modules[name], arguments)]
    extra: dict[str, Any] = {}
    if placement == "compact":
        layout = _compact(source, schema, imported, scaffolds, module_segments, reader.stream, imports, limits)
        segments = layout.segments
        extra = {"placement": "compact", "module_positions": layout.positions, "geometry": layout.geometry}
    else:
        segments = _place_text(source, schema, imported, reader.stream, limits) + module_segments
        segments.sort(key=lambda s: (s.position_ids[0], s.kind == "argument"))
    return ResolvedPrompt(schema=schema, modules=tuple(imported), scaffolds=scaffolds,
                          arguments=arguments, segments=tuple(segments), source=source.text,
                          locations=_locations(source, imports), label=label, **extra)


def _place_text(source: Source, schema: Schema, imported: list[str], stream: list[Any],
                limits: Limits) -> list[Segment]:
    """Text segments at schema placement (see the module docstring)."""
    placer = _Placer(source, schema, imported, limits)
    last_import = max((i for i, item in enumerate(stream) if isinstance(item, _Import)), default=-1)
    cursor = 0
    trailing = schema.length
    previous: str | None = None
    done = {ROOT}
    for index, item in enumerate(stream):
        if isinstance(item, _Import):
            cursor = item.end
            previous = item.label
            for node in _flatten_import(item):
                done.update(node.modules)
                done.update(node.implied)
        elif not item.ids:
            continue
        elif index > last_import:
            trailing = placer.place_trailing(item, trailing)
        else:
            following = next(i.label for i in stream[index + 1:] if isinstance(i, _Import))
            cursor = placer.place(item, cursor, done, previous, following)
            previous = "the text"
    return list(placer.segments)


def _compact(source: Source, schema: Schema, imported: list[str], scaffolds: tuple[str, ...],
             module_segments: list[Segment], stream: list[Any], imports: list[_Import], limits: Limits) -> Layout:
    """The compact layout (``pckernels.pml.placement``); text before or between imports needs no
    room in the schema here: it follows the import written before it."""
    order = [m for node in imports for m in (*node.implied, *node.modules)]
    last_import = max((i for i, item in enumerate(stream) if isinstance(item, _Import)), default=-1)
    texts: list[tuple[str | None, Segment]] = []
    trailing: list[Segment] = []
    after: str | None = None
    last_offset: int | None = None
    for index, item in enumerate(stream):
        if isinstance(item, _Import):
            after = item.modules[0]
        elif item.ids:
            segment = Segment("text", item.ids, ())
            if index > last_import:
                trailing.append(segment)
            else:
                texts.append((after, segment))
            last_offset = item.offset
    layout = compact_layout(schema, imported, list(scaffolds), module_segments, texts, trailing, order)
    model_limit = schema.max_positions
    for limit, what in ((model_limit, f"the model's limit of {model_limit} positions"),
                        (limits.max_positions, f"{limits.max_positions} (Limits.max_positions)")):
        if limit is not None and layout.end > limit:
            raise source.error(f"the prompt laid out compactly ends at position {layout.end}, past {what}; "
                               "shorten the text or import fewer modules", offset=last_offset)
    return layout


def _locations(source: Source, imports: list[_Import]) -> dict[str, tuple[int | None, int | None]]:
    """``module -> (line, column)`` of the element importing it; ``ROOT`` -> the ``<prompt>`` tag."""
    def where(element: Any) -> tuple[int | None, int | None]:
        offset = source.element_offset(element)
        return source.location(offset) if offset is not None else (element.sourceline, None)

    out = {ROOT: where(source.root)}
    for node in imports:
        for name in (*node.modules, *node.implied):
            out.setdefault(name, where(node.element))
    return out


def check_answerable(prompt: ResolvedPrompt, *, baseline: bool = False) -> None:
    """Refuse, located in the prompt's source, a prompt the engine cannot answer: one without
    tokens, or — in cached and reference modes (not ``baseline``) — one whose last token (the
    highest position) is cached. The next token is predicted from the last token's fresh
    states; a cached token's states come from the store and were encoded without the rest of
    the prompt, so text (or an argument) must come last."""
    live = prompt.live_segments()
    if not live:
        line, column = prompt.locations.get(ROOT, (None, None))
        raise PMLError("the prompt has no tokens; import a module or add text", line=line,
                       column=column, source=prompt.label)
    if baseline:
        return
    last = max(live, key=lambda s: s.position_ids[-1])
    if last.kind == "cached":
        line, column = prompt.locations.get(last.module, (None, None))
        owner = "the schema's anonymous text" if last.module == ROOT else f"module {last.module!r}"
        raise PMLError(f"the prompt ends with {owner}: its last token (position "
                       f"{last.position_ids[-1]}) is cached, and a cached token's states cannot "
                       "predict what follows; add text after the last import (for example "
                       "<user>…</user><assistant/>) so the model has something to answer",
                       line=line, column=column, source=prompt.label)


def _flatten(stream: list[Any]):
    for item in stream:
        if isinstance(item, _Import):
            yield from _flatten_import(item)


def _flatten_import(node: _Import):
    yield node
    for child in node.children:
        yield from _flatten_import(child)
