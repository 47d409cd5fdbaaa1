"""Where a prompt's imported modules sit: at their schema positions, or packed together.

``schema`` placement (the default, the paper's) keeps every token at its schema position.
``compact`` placement lays the prompt out contiguously, in the prompt's order:

* the prompt's **units** — a top-level module with everything nested in it, or the members of a
  top-level scaffold whose joint states apply — fill the places the imported units take in the
  schema's order, in the order the prompt imports them; a unit moves rigidly (one shift for all
  of its tokens, so its own gaps — unused parameter room, children it leaves out — stay);
* the schema's anonymous text keeps its place between units and closes up the gaps of modules
  the prompt does not import;
* text written before the first import goes just before the first unit, text written after an
  import right after that import's unit, and text after the last import after everything.

Each cached module is read from one of two encodings of its block (``Module`` tokens and their
context are the same; only where they sat while encoded differs):

* ``schema``: encoded at its schema positions (what schema placement reads);
* ``packed``: encoded with its unit moved right after the anonymous text before it (the layout of
  a prompt importing that unit alone; :func:`packed_shift`). Its position is a function of that
  context, so the same module under the same context in two schemas is one block.

A compact unit reads the encoding whose distance to the anonymous text just before it is nearest
the distance it gets in the prompt (ties: ``schema``); either is exact when the distances agree.
Keys are re-rotated from the encoding's positions to the prompt's when the block is placed.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import NamedTuple

from pckernels.pml.model import ROOT, Schema, Segment, ShiftRuns

PLACEMENTS = ("schema", "compact")
GEOMETRIES = ("schema", "packed")


def top_module(schema: Schema, module: str) -> str:
    """The top-level module holding ``module`` (itself when top-level; ``ROOT`` for the root)."""
    modules = schema.modules
    name = module
    while name != ROOT and modules[name].parent not in (None, ROOT):
        name = modules[name].parent
    return name


def top_scaffold_members(schema: Schema, scaffold: str) -> tuple[str, ...]:
    """The members of ``scaffold`` when it sits at schema level (its members are top-level), else ()."""
    members = schema.scaffolds[scaffold].members
    return members if schema.modules[members[0]].parent == ROOT else ()


def unit_span(schema: Schema, module: str, scaffold: str = "") -> tuple[int, int]:
    """``(start, end)`` schema positions of the unit ``module`` moves with: its top-level module's
    span, or the span of a top-level ``scaffold``'s members when it is encoded within one."""
    members = top_scaffold_members(schema, scaffold) if scaffold else ()
    tops = members or (top_module(schema, module),)
    mods = [schema.modules[m] for m in tops]
    return min(m.start for m in mods), max(m.start + m.length for m in mods)


def root_before(schema: Schema, position: int) -> int:
    """How many of the root's own tokens lie before schema position ``position``."""
    return bisect_left(schema.modules[ROOT].position_ids, position)


def packed_shift(schema: Schema, module: str, scaffold: str = "") -> int:
    """Shift from schema positions to ``module``'s packed encoding: its unit starts right after
    the last anonymous token before it (at 0 when there is none). The root never moves."""
    if module == ROOT:
        return 0
    start, _ = unit_span(schema, module, scaffold)
    count = root_before(schema, start)
    first = schema.modules[ROOT].position_ids[count - 1] + 1 if count else 0
    return first - start


def encoded_shift(schema: Schema, module: str, geometry: str = "schema", scaffold: str = "") -> int:
    """Shift from ``module``'s schema positions to those of its ``geometry`` encoding (one for all of
    its own tokens)."""
    return 0 if geometry == "schema" else packed_shift(schema, module, scaffold)


def encoded_positions(schema: Schema, module: str, geometry: str = "schema", scaffold: str = "") -> tuple[int, ...]:
    """Positions of ``module``'s own tokens in its ``geometry`` encoding."""
    positions = schema.modules[module].position_ids
    shift = encoded_shift(schema, module, geometry, scaffold)
    return tuple(p + shift for p in positions) if shift else positions


@dataclass
class Layout:
    """A compact layout: ``segments`` sorted by position, ``shifts[module]`` where each imported
    module's own tokens sit (runs ``(first, stop, shift)`` over its own-token indices: prompt position
    minus schema position), ``geometry[module]`` the encoding it is read from, and ``end`` the first
    position after the prompt."""

    segments: list[Segment]
    shifts: dict[str, ShiftRuns] = field(default_factory=dict)
    geometry: dict[str, str] = field(default_factory=dict)
    end: int = 0


@dataclass
class _Unit:
    """What moves with one shift: ``modules`` (a top-level module, or a top-level scaffold's members)
    spanning schema positions ``start .. end - 1``; ``rank`` the first place in the prompt's import
    order of anything in it; ``imported`` the imported modules inside it; ``segments`` their segments
    and ``texts`` the text written after its imports."""

    modules: list[str]
    start: int
    end: int
    rank: int
    scaffold: str = ""
    imported: list[str] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    texts: list[Segment] = field(default_factory=list)


class _Units(NamedTuple):
    """The prompt's units: ``of[module]`` the unit an imported module moves with; ``in_schema`` in
    schema order (the places to fill), ``in_prompt`` in the prompt's import order (what fills them)."""

    of: dict[str, _Unit]
    in_schema: list[_Unit]
    in_prompt: list[_Unit]


class _Routed(NamedTuple):
    """The segments no unit carries: the root's runs (schema order) and the text written before any
    import."""

    root: list[Segment]
    head: list[Segment]


class _RootRun(NamedTuple):
    """A run of anonymous text, at schema position ``position``: it keeps its place between units."""

    position: int
    segment: Segment


class _Place(NamedTuple):
    """The ``index``-th place (schema order) a unit takes in the schema, at ``position``: filled by
    the ``index``-th unit in the prompt's order."""

    position: int
    index: int


def _units(schema: Schema, imported: list[str], scaffolds: tuple[str, ...], order: list[str]) -> _Units:
    """Group the imported modules into units (top-level scaffolds whose joint states apply first),
    each ranked by its first import in ``order``."""
    modules = schema.modules
    of: dict[str, _Unit] = {}
    units: list[_Unit] = []
    never = len(order)
    rank = {name: i for i, name in reversed(list(enumerate(order)))}
    for name in scaffolds:
        members = top_scaffold_members(schema, name)
        if members:
            start, end = unit_span(schema, members[0], name)
            unit = _Unit(list(members), start, end, min(rank.get(m, never) for m in members), name)
            units.append(unit)
            of.update((m, unit) for m in members)
    for name in imported:
        if name == ROOT:
            continue
        top = top_module(schema, name)
        unit = of.get(top)
        if unit is None:
            mod = modules[top]
            unit = _Unit([top], mod.start, mod.start + mod.length, never)
            units.append(unit)
            of[top] = unit
        of[name] = unit
        unit.imported.append(name)
        unit.rank = min(unit.rank, rank.get(name, never))
    return _Units(of, sorted(units, key=lambda u: u.start), sorted(units, key=lambda u: (u.rank, u.start)))


def _route(units: _Units, module_segments: list[Segment], texts: list[tuple[str | None, Segment]]) -> _Routed:
    """Hand each module segment to its unit and each text to the unit of the import written before it;
    what is left is the root's and the text before any import."""
    root: list[Segment] = []
    for seg in module_segments:
        (root if seg.module == ROOT else units.of[seg.module].segments).append(seg)
    head: list[Segment] = []
    for after, seg in texts:
        (head if after is None else units.of[after].texts).append(seg)
    return _Routed(root, head)


def _events(root: list[Segment], units: _Units) -> list[_RootRun | _Place]:
    """Root runs and unit places in schema order (a root run first where both start at one position)."""
    events: list[_RootRun | _Place] = [_RootRun(seg.position_ids[0], seg) for seg in root]
    events += [_Place(unit.start, i) for i, unit in enumerate(units.in_schema)]
    return sorted(events, key=lambda e: (e.position, isinstance(e, _Place)))


class _Placer:
    """Lays segments out one after another from position 0: the cursor is the next free position."""

    def __init__(self, schema: Schema, head: list[Segment]) -> None:
        self.schema = schema
        self.head = head
        """Text written before any import: placed just before the first unit (or after everything)."""
        self.layout = Layout([])
        self.cursor = 0
        self.root_shifts: list[tuple[int, int, int]] = []
        self.last_root: tuple[int, int] | None = None
        """``(schema position, prompt position)`` of the last anonymous token placed."""

    def _moved(self, positions: tuple[int, ...], shift: int) -> tuple[int, ...]:
        if not shift or not positions:
            return positions
        first, n = positions[0] + shift, len(positions)
        if positions[-1] - positions[0] == n - 1:  # a run (every segment is one)
            return self.schema.position_range(first, first + n)
        return tuple(p + shift for p in positions)

    def text(self, seg: Segment) -> None:
        """Uncached text at the cursor."""
        n = len(seg.token_ids)
        if n:
            self.layout.segments.append(Segment("text", seg.token_ids, self.schema.position_range(self.cursor,
                                                                                                  self.cursor + n),
                                                module=seg.module, param=seg.param))
            self.cursor += n

    def root_run(self, seg: Segment) -> None:
        """A run of anonymous text at the cursor."""
        position, n = seg.position_ids[0], len(seg.token_ids)
        shift = self.cursor - position
        self.layout.segments.append(Segment(seg.kind, seg.token_ids, self._moved(seg.position_ids, shift),
                                            module=ROOT))
        first = self.schema.modules[ROOT].index_of(position)
        runs = self.root_shifts
        if runs and runs[-1][1] == first and runs[-1][2] == shift:
            runs[-1] = (runs[-1][0], first + n, shift)
        else:
            runs.append((first, first + n, shift))
        self.last_root = (seg.position_ids[-1], self.cursor + n - 1)
        self.cursor += n

    def place_head(self) -> None:
        """The text written before any import, at the cursor (once)."""
        for seg in self.head:
            self.text(seg)
        self.head = []

    def unit(self, unit: _Unit) -> None:
        """A unit moved whole to the cursor, reading the encoding nearest its new distance to the
        anonymous text before it, then the text written after its imports."""
        self.place_head()
        shift = self.cursor - unit.start
        for seg in unit.segments:
            self.layout.segments.append(seg if not shift else Segment(
                seg.kind, seg.token_ids, self._moved(seg.position_ids, shift), module=seg.module, param=seg.param))
        geometry = _nearest_geometry(self.schema, unit.start, self.cursor, self.last_root)
        for name in unit.imported:
            n = len(self.schema.modules[name].token_ids)
            self.layout.shifts[name] = ((0, n, shift),) if n else ()
            self.layout.geometry[name] = geometry
        self.cursor += unit.end - unit.start
        for seg in unit.texts:
            self.text(seg)

    def finish(self) -> Layout:
        layout = self.layout
        layout.shifts[ROOT] = tuple(self.root_shifts)
        layout.geometry[ROOT] = "schema"
        layout.segments.sort(key=lambda s: (s.position_ids[0] if s.position_ids else self.cursor,
                                            s.kind == "argument"))
        layout.end = self.cursor
        return layout


def compact_layout(schema: Schema, imported: list[str], scaffolds: tuple[str, ...], module_segments: list[Segment],
                   texts: list[tuple[str | None, Segment]], trailing: list[Segment], order: list[str]) -> Layout:
    """Lay a resolved prompt out compactly (see the module docstring).

    ``module_segments``: the imported modules' segments at schema positions (cached, slot,
    argument, and ``text`` of uncached modules); ``texts``: text written before or between
    imports with the module of the import written before it (``None``: before any import);
    ``trailing``: text after the last import; ``order``: modules in the order the prompt imports
    them. Text segments come with any positions (they are replaced).
    """
    units = _units(schema, imported, scaffolds, order)
    routed = _route(units, module_segments, texts)
    placer = _Placer(schema, routed.head)
    for event in _events(routed.root, units):
        if isinstance(event, _RootRun):
            placer.root_run(event.segment)
        else:
            placer.unit(units.in_prompt[event.index])
    placer.place_head()
    for seg in trailing:
        placer.text(seg)
    return placer.finish()


def _nearest_geometry(schema: Schema, start: int, at: int, last_root: tuple[int, int] | None) -> str:
    """The encoding of a unit starting at schema position ``start`` and prompt position ``at``
    whose distance to the anonymous text before it is nearest the distance it gets in the prompt
    (to ``last_root``, the last anonymous token placed before it: ``(schema, prompt)`` position);
    ties, and units with no anonymous text before them, read the schema encoding."""
    count = root_before(schema, start)
    if not count or last_root is None:
        return "schema"
    wanted = at - last_root[1] - 1
    in_schema = start - schema.modules[ROOT].position_ids[count - 1] - 1
    return "packed" if abs(wanted) < abs(wanted - in_schema) else "schema"
