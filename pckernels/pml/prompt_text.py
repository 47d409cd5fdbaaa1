"""Where a prompt's uncached text goes.

At schema placement (uncached text is never dropped):

* Text after the last import starts at ``Schema.length`` and continues contiguously.
* Text before or between imports starts right after the import written before it (the end
  of that import's span, or position 0 for text before the first import), skipping tokens
  already there that the prompt imports earlier (anonymous schema text counts as imported)
  and text placed earlier, and must end before the next imported token or placed text. If it
  does not fit, ``PMLError`` says how many positions are missing and how to declare room (a
  ``<param>`` buffer in the schema).

At compact placement the text follows the import written before it
(``pckernels.pml.placement``) and needs no room.
"""

from __future__ import annotations

import bisect
from typing import Any

from pckernels.pml.document import Limits, Source
from pckernels.pml.model import ROOT, Schema, Segment
from pckernels.pml.placement import Layout, compact_layout
from pckernels.pml.prompt_reader import Import, TextRun, flatten_import


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
            for start, end in schema.modules[name].position_runs:
                occupied.append((start, end, name))
        occupied.sort()
        self.occupied = occupied
        self.starts = [start for start, _, _ in occupied]
        self.segments: list[Segment] = []

    def _owner(self, name: str) -> str:
        if name == _PLACED:
            return "text placed earlier"
        return "the schema's anonymous text" if name == ROOT else f"module {name!r}"

    def place(self, run: TextRun, cursor: int, done: set[str], previous: str | None,
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

    def place_trailing(self, run: TextRun, position: int) -> int:
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


def schema_placement(source: Source, schema: Schema, imported: list[str], stream: list[Any],
                     limits: Limits) -> list[Segment]:
    """Text segments at schema placement (the rule in the module docstring)."""
    placer = _Placer(source, schema, imported, limits)
    last_import = max((i for i, item in enumerate(stream) if isinstance(item, Import)), default=-1)
    cursor = 0
    trailing = schema.length
    previous: str | None = None
    done = {ROOT}
    for index, item in enumerate(stream):
        if isinstance(item, Import):
            cursor = item.end
            previous = item.label
            for node in flatten_import(item):
                done.update(node.modules)
                done.update(node.implied)
        elif not item.ids:
            continue
        elif index > last_import:
            trailing = placer.place_trailing(item, trailing)
        else:
            following = next(i.label for i in stream[index + 1:] if isinstance(i, Import))
            cursor = placer.place(item, cursor, done, previous, following)
            previous = "the text"
    return list(placer.segments)


def compact_placement(source: Source, schema: Schema, imported: list[str], scaffolds: tuple[str, ...],
                      module_segments: list[Segment], stream: list[Any], imports: list[Import],
                      limits: Limits) -> Layout:
    """The compact layout (``pckernels.pml.placement``); text before or between imports needs no
    room in the schema here: it follows the import written before it."""
    order = [m for node in imports for m in (*node.implied, *node.modules)]
    last_import = max((i for i, item in enumerate(stream) if isinstance(item, Import)), default=-1)
    texts: list[tuple[str | None, Segment]] = []
    trailing: list[Segment] = []
    after: str | None = None
    last_offset: int | None = None
    for index, item in enumerate(stream):
        if isinstance(item, Import):
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
