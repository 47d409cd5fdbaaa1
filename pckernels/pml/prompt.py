"""Prompt resolution: PML prompt text + schemas -> ``ResolvedPrompt``.

Imports may come in any order: every module sits at its schema positions whatever the order
it is imported in (the paper's §3.4: "the order of concatenation does not matter"). The
prompt is read into text runs and imports (``prompt_reader``), its texts and arguments are
tokenized in one batch, and its uncached text is placed (``prompt_text``): at schema placement
by the rule there, or with ``placement="compact"`` (on the prompt, or the schema's default)
laid out contiguously in the prompt's order (``pckernels.pml.placement``).
"""

from __future__ import annotations

import difflib
from typing import Any, Mapping

from pckernels.errors import PMLError, UnknownSchemaError
from pckernels.pml.document import Limits, Source, local_tag, read_document
from pckernels.pml.elements import attributes, check_placement
from pckernels.pml.model import ROOT, Module, ResolvedPrompt, Schema, Segment
from pckernels.pml.prompt_reader import Import, PromptReader, TextRun, flatten_imports
from pckernels.pml.prompt_text import compact_placement, schema_placement
from pckernels.pml.tokens import encode_batch


def _module_segments(module: Module, arguments: dict[tuple[str, str], tuple[int, ...]]
                     ) -> list[Segment]:
    """Cached runs, slots and arguments of one imported module (its ``pieces``, made once per module,
    with this prompt's arguments after their slots). An uncached module (``cache="false"``) gives
    ``text`` runs and its arguments, and no slots: nothing cached needs placeholders."""
    out: list[Segment] = []
    for piece in module.pieces:
        if isinstance(piece, Segment):
            out.append(piece)
            continue
        argument = arguments[(module.name, piece.name)]
        if argument:
            out.append(Segment("argument", argument, tuple(range(piece.start, piece.start + len(argument))),
                               module=module.name, param=piece.name))
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
    reader = PromptReader(source, schema)
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

    imports = list(flatten_imports(reader.stream))
    runs = [item for item in reader.stream if isinstance(item, TextRun)]
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
        layout = compact_placement(source, schema, imported, scaffolds, module_segments, reader.stream, imports, limits)
        segments = layout.segments
        extra = {"placement": "compact", "module_shifts": layout.shifts, "geometry": layout.geometry}
    else:
        segments = schema_placement(source, schema, imported, reader.stream, limits) + module_segments
        segments.sort(key=lambda s: (s.position_ids[0], s.kind == "argument"))
    return ResolvedPrompt(schema=schema, modules=tuple(imported), scaffolds=scaffolds,
                          arguments=arguments, segments=tuple(segments), source=source.text,
                          locations=_locations(source, imports), label=label, **extra)


def _locations(source: Source, imports: list[Import]) -> dict[str, tuple[int | None, int | None]]:
    """``module -> (line, column)`` of the element importing it; ``ROOT`` -> the ``<prompt>`` tag."""
    def where(element: Any) -> tuple[int | None, int | None]:
        offset = source.element_offset(element)
        return source.location(offset) if offset is not None else (element.sourceline, None)

    out = {ROOT: where(source.root)}
    for node in imports:
        for name in (*node.modules, *node.implied):
            out.setdefault(name, where(node.element))
    return out


def check_answerable(prompt: ResolvedPrompt) -> None:
    """Refuse, located in the prompt's source, a prompt without tokens (in every mode). A prompt may
    end with an import: the engine then computes that last cached token afresh
    (``pckernels.engine.plan.last_cached_token``)."""
    live = prompt.live_segments()
    if not live:
        line, column = prompt.locations.get(ROOT, (None, None))
        raise PMLError("the prompt has no tokens; import a module or add text", line=line,
                       column=column, source=prompt.label)
