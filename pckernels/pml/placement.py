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

from pckernels.pml.model import ROOT, Schema, Segment

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


def encoded_positions(schema: Schema, module: str, geometry: str = "schema", scaffold: str = "") -> tuple[int, ...]:
    """Positions of ``module``'s own tokens in its ``geometry`` encoding."""
    positions = schema.modules[module].position_ids
    if geometry == "schema":
        return positions
    shift = packed_shift(schema, module, scaffold)
    return tuple(p + shift for p in positions)


@dataclass
class Layout:
    """A compact layout: ``segments`` sorted by position, ``positions[module]`` the prompt
    positions of each imported module's own tokens, ``geometry[module]`` the encoding it is read
    from, and ``end`` the first position after the prompt."""

    segments: list[Segment]
    positions: dict[str, tuple[int, ...]] = field(default_factory=dict)
    geometry: dict[str, str] = field(default_factory=dict)
    end: int = 0


@dataclass
class _Unit:
    modules: list[str]
    start: int
    end: int
    rank: int
    scaffold: str = ""
    segments: list[Segment] = field(default_factory=list)
    texts: list[Segment] = field(default_factory=list)


def compact_layout(schema: Schema, imported: list[str], scaffolds: tuple[str, ...], module_segments: list[Segment],
                   texts: list[tuple[str | None, Segment]], trailing: list[Segment], order: list[str]) -> Layout:
    """Lay a resolved prompt out compactly (see the module docstring).

    ``module_segments``: the imported modules' segments at schema positions (cached, slot,
    argument, and ``text`` of uncached modules); ``texts``: text written before or between
    imports with the module of the import written before it (``None``: before any import);
    ``trailing``: text after the last import; ``order``: modules in the order the prompt imports
    them. Text segments come with any positions (they are replaced).
    """
    modules = schema.modules
    unit_of: dict[str, _Unit] = {}
    units: list[_Unit] = []
    rank = {name: i for i, name in reversed(list(enumerate(order)))}
    for name in scaffolds:
        members = top_scaffold_members(schema, name)
        if members:
            start, end = unit_span(schema, members[0], name)
            unit = _Unit(list(members), start, end, min(rank.get(m, len(order)) for m in members), name)
            units.append(unit)
            unit_of.update((m, unit) for m in members)
    for name in imported:
        if name == ROOT:
            continue
        top = top_module(schema, name)
        unit = unit_of.get(top)
        if unit is None:
            mod = modules[top]
            unit = _Unit([top], mod.start, mod.start + mod.length, len(order))
            units.append(unit)
            unit_of[top] = unit
        unit_of[name] = unit
        unit.rank = min(unit.rank, rank.get(name, len(order)))
    root_segments = []
    for seg in module_segments:
        if seg.module == ROOT:
            root_segments.append(seg)
        else:
            unit_of[seg.module].segments.append(seg)
    head: list[Segment] = []
    for after, seg in texts:
        (head if after is None else unit_of[after].texts).append(seg)

    slots = sorted(units, key=lambda u: u.start)
    filled = sorted(units, key=lambda u: (u.rank, u.start))
    events = sorted([(seg.position_ids[0], 0, seg) for seg in root_segments]
                    + [(u.start, 1, i) for i, u in enumerate(slots)], key=lambda e: (e[0], e[1]))
    layout = Layout([])
    shifts: dict[int, int] = {}
    cursor = 0
    root_rows: list[tuple[int, int]] = []
    """(schema position of a root run's last token, its prompt position), in schema order."""

    def text(seg: Segment) -> None:
        nonlocal cursor
        if not seg.token_ids:
            return
        layout.segments.append(Segment("text", seg.token_ids, tuple(range(cursor, cursor + len(seg.token_ids))),
                                       module=seg.module, param=seg.param))
        cursor += len(seg.token_ids)

    placed_head = False
    for position, kind, item in events:
        if kind == 0:
            n = len(item.token_ids)
            shift = cursor - position
            for p in item.position_ids:
                shifts[p] = shift
            layout.segments.append(Segment(item.kind, item.token_ids, tuple(range(cursor, cursor + n)),
                                           module=ROOT))
            root_rows.append((item.position_ids[-1], cursor + n - 1))
            cursor += n
            continue
        if not placed_head:
            for seg in head:
                text(seg)
            placed_head = True
        unit = filled[item]
        shift = cursor - unit.start
        for seg in unit.segments:
            layout.segments.append(Segment(seg.kind, seg.token_ids, tuple(p + shift for p in seg.position_ids),
                                           module=seg.module, param=seg.param))
        geometry = _nearest_geometry(schema, unit.start, cursor, root_rows[-1] if root_rows else None)
        for name in imported:
            if name != ROOT and unit_of[name] is unit:
                layout.positions[name] = tuple(p + shift for p in modules[name].position_ids)
                layout.geometry[name] = geometry
        cursor += unit.end - unit.start
        for seg in unit.texts:
            text(seg)
    if not placed_head:
        for seg in head:
            text(seg)
    for seg in trailing:
        text(seg)
    root = modules[ROOT]
    layout.positions[ROOT] = tuple(p + shifts[p] for p in root.position_ids)
    layout.geometry[ROOT] = "schema"
    layout.segments.sort(key=lambda s: (s.position_ids[0] if s.position_ids else cursor, s.kind == "argument"))
    layout.end = cursor
    return layout


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
