"""Data produced by the PML layer and consumed by the engine.

This module is the contract between ``pckernels.pml`` (parsing, layout) and
``pckernels.engine`` (encoding, assembly). Everything here is plain, immutable data.

Vocabulary
----------
* A *module* is a named unit whose KV states are encoded once. Its *own tokens* are the
  tokens written directly inside it (children excluded), parameter slots included as
  ``len`` placeholder tokens. Own tokens may be non-contiguous in position when children
  interrupt them.
* The *root* module (name ``ROOT``) holds the schema's anonymous text (text outside any
  module, role-tag expansions at schema level, the BOS token if the tokenizer adds one).
  It is imported by every prompt.
* *Positions* are fixed by the schema (see ``Schema.layout``). Text after the schema
  starts at ``Schema.length``.
* Encoding scope (used by the engine): a module's own tokens attend to its own tokens and
  to the own tokens of its ancestors (root included) at earlier-or-equal positions, which
  are present whenever it is imported; scaffold members additionally attend to the other
  members of the scaffold.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal, Mapping, Union

ROOT = ""
"""Name of the anonymous root module."""

LayoutKind = Literal["anonymous", "module", "union", "param", "scaffold"]
SegmentKind = Literal["cached", "slot", "argument", "text"]
ShiftRuns = tuple[tuple[int, int, int], ...]
"""Runs ``(first, stop, shift)`` over a module's own-token indices: tokens ``first .. stop - 1`` sit
``shift`` positions after their schema positions."""


@dataclass(frozen=True)
class LayoutEntry:
    """One element of a schema's layout: positions ``start .. start + length - 1``.

    ``name`` is the qualified name (``"parent/child"``; ``"module/param"`` for parameters;
    ``ROOT`` for anonymous text runs); ``parent`` the qualified name of the enclosing module,
    union or scaffold (``None`` at top level).
    """

    name: str
    kind: LayoutKind
    start: int
    length: int
    parent: str | None


@dataclass(frozen=True)
class Param:
    """A parameter slot of ``length`` positions starting at ``start``.

    ``offset`` is the index of the slot's first token within the owning module's own tokens.
    ``default`` holds the token ids of the optional default (``scaffold=`` in the original
    spelling), used when a prompt imports the module without an argument.
    """

    name: str
    module: str
    start: int
    length: int
    offset: int
    default: tuple[int, ...] = ()


@dataclass(frozen=True)
class Module:
    """A module's own tokens and their schema positions (``len(token_ids) == len(position_ids)``)."""

    name: str
    parent: str | None
    token_ids: tuple[int, ...]
    position_ids: tuple[int, ...]
    params: tuple[Param, ...] = ()
    union: str | None = None
    scaffolds: tuple[str, ...] = ()
    children: tuple[str, ...] = ()
    start: int = 0
    length: int = 0
    """Span of the module including its children."""
    cached: bool = True
    """``False`` for ``cache="false"`` (and everything inside such a module): its tokens are
    never encoded or stored; a prompt that imports it computes them in its forward, at the
    module's positions, like uncached text."""

    def ancestors(self, modules: Mapping[str, "Module"]) -> tuple[str, ...]:
        """Qualified names of the enclosing modules, innermost first, ending with ``ROOT``."""
        out = []
        parent = self.parent
        while parent is not None:
            out.append(parent)
            parent = modules[parent].parent
        return tuple(out)

    # What follows is derived from the module's tokens once, on first use, and kept on the module
    # (a schema replaced by a new version brings new modules): prompts and plans read it instead of
    # walking every token per request.

    def index_of(self, position: int) -> int:
        """Index into ``token_ids`` of the own token at schema ``position`` (``KeyError`` when none
        is there); positions increase with the index."""
        positions = self.position_ids
        index = bisect_left(positions, position)
        if index == len(positions) or positions[index] != position:
            raise KeyError(position)
        return index

    @cached_property
    def position_runs(self) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` schema position ranges of the own tokens' consecutive runs."""
        runs: list[tuple[int, int]] = []
        first = 0
        positions = self.position_ids
        for index in range(1, len(positions) + 1):
            if index == len(positions) or positions[index] != positions[index - 1] + 1:
                runs.append((positions[first], positions[index - 1] + 1))
                first = index
        return tuple(runs)

    @cached_property
    def pieces(self) -> tuple[Union["Segment", Param], ...]:
        """The module as a prompt imports it, in order: its own tokens as segments split at parameter
        slots and position gaps (``cached`` runs and ``slot`` placeholders; ``text`` runs and no slots
        for an uncached module), and after each slot the :class:`Param` whose argument goes there."""
        out: list[Segment | Param] = []
        kind = "cached" if self.cached else "text"
        tokens, positions = self.token_ids, self.position_ids
        bounds = {p.offset: p for p in self.params}
        index = 0
        while index < len(tokens):
            param = bounds.get(index)
            if param is not None:
                end = index + param.length
                if self.cached:
                    out.append(Segment("slot", tokens[index:end], positions[index:end], module=self.name,
                                       param=param.name))
                out.append(param)
                index = end
                continue
            stop = index + 1
            while stop < len(tokens) and stop not in bounds and positions[stop] == positions[stop - 1] + 1:
                stop += 1
            out.append(Segment(kind, tokens[index:stop], positions[index:stop], module=self.name))
            index = stop
        return tuple(out)


@dataclass(frozen=True)
class Scaffold:
    """Modules encoded jointly in one attention span; their joint states override the
    individual ones when a prompt imports all of ``members``."""

    name: str
    members: tuple[str, ...]


@dataclass(eq=False)
class Schema:
    """A parsed schema. ``modules`` is in document order and starts with ``ROOT``."""

    name: str
    modules: dict[str, Module]
    layout: tuple[LayoutEntry, ...]
    scaffolds: dict[str, Scaffold]
    length: int
    digest: str
    """sha256 of the schema source text, module sources and tokenizer identity."""
    placeholder_token_id: int
    tokenizer: Any = field(repr=False, default=None)
    source: str | None = None
    unions: dict[str, tuple[str, ...]] = field(default_factory=dict)
    max_positions: int | None = None
    """The model's position limit the schema was laid out for (prompts are checked against it)."""
    salt: str = ""
    """Namespace of the cache keys of this schema's blocks (a server's tenant salt; "" in the
    library): the same text under two salts shares nothing."""
    placement: str = "schema"
    """Where its prompts place imported modules unless they say otherwise (``placement=``):
    ``"schema"`` or ``"compact"`` (``pckernels.pml.placement``); the ``<schema>`` tag's
    ``placement=``, else the default the parser was given (an engine's: compact where it can)."""
    location: tuple[int | None, int | None] = (None, None)
    """``(line, column)`` of the ``<schema>`` tag, to locate errors about the schema as a whole."""
    _counting: tuple[int, ...] = field(default=(), init=False, repr=False)

    def position_range(self, start: int, stop: int) -> tuple[int, ...]:
        """``tuple(range(start, stop))`` as a slice of one tuple the schema keeps (grown on demand), so
        the positions of a moved run of tokens are not new integers per request."""
        counting = self._counting
        if len(counting) < stop:
            counting = tuple(range(max(stop, min(2 * len(counting), 2 * stop))))
            self._counting = counting
        return counting[start:stop]


@dataclass(frozen=True)
class Segment:
    """A run of prompt tokens.

    * ``cached``: own tokens of an imported module (``module``), states from the cache;
    * ``slot``: a parameter's placeholder tokens (cached, never seen by uncached tokens);
    * ``argument``: fresh tokens of an argument, at the slot's first positions;
    * ``text``: fresh uncached text.
    """

    kind: SegmentKind
    token_ids: tuple[int, ...]
    position_ids: tuple[int, ...]
    module: str | None = None
    param: str | None = None


@dataclass(eq=False)
class ResolvedPrompt:
    """A prompt resolved against its schema.

    ``modules``: imported module names (``ROOT`` first, document order).
    ``scaffolds``: scaffolds all of whose members are imported (their joint states apply).
    ``arguments``: ``(module, param) -> token ids`` for every imported parameter (defaults
    filled in; an empty tuple when no argument and no default).
    ``segments``: every token of the prompt, sorted by position (slots before the
    argument at the same position).
    ``locations``: ``module -> (line, column)`` of the element that imports it (``ROOT``: the
    ``<prompt>`` tag), so later checks can locate their errors; ``label`` names the source.
    """

    schema: Schema
    modules: tuple[str, ...]
    scaffolds: tuple[str, ...]
    arguments: dict[tuple[str, str], tuple[int, ...]]
    segments: tuple[Segment, ...]
    source: str | None = None
    locations: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)
    label: str | None = None
    placement: str = "schema"
    """``"schema"``: every token at its schema position; ``"compact"``: laid out contiguously in
    the prompt's order (``pckernels.pml.placement``), then ``module_shifts`` and ``geometry``
    say where each imported module's own tokens sit and which encoding of its block it reads."""
    module_shifts: dict[str, ShiftRuns] = field(default_factory=dict)
    """``module -> runs (first, stop, shift)`` covering its own tokens (compact placement; none at
    schema placement): where the prompt puts them relative to their schema positions."""
    geometry: dict[str, str] = field(default_factory=dict)

    def own_shifts(self, module: str) -> ShiftRuns:
        """Runs ``(first, stop, shift)`` covering ``module``'s own tokens (slots included): each
        token's prompt position minus its schema position; one run of 0 unless placed compactly."""
        runs = self.module_shifts.get(module)
        if runs is None:
            n = len(self.schema.modules[module].token_ids)
            return ((0, n, 0),) if n else ()
        return runs

    def own_positions(self, module: str) -> tuple[int, ...]:
        """Prompt positions of ``module``'s own tokens (slots included): its schema positions
        unless the prompt is laid out compactly. (Built per call: planning uses :meth:`own_shifts`.)"""
        positions = self.schema.modules[module].position_ids
        if module not in self.module_shifts:
            return positions
        return tuple(p + shift for first, stop, shift in self.module_shifts[module] for p in positions[first:stop])

    def own_index(self, module: str, position: int) -> int:
        """Index into ``module``'s own tokens of the one this prompt puts at ``position`` (``KeyError``
        when none is there)."""
        mod = self.schema.modules[module]
        for first, stop, shift in self.own_shifts(module):
            index = bisect_left(mod.position_ids, position - shift, first, stop)
            if index < stop and mod.position_ids[index] == position - shift:
                return index
        raise KeyError(position)

    @cached_property
    def module_positions(self) -> dict[str, tuple[int, ...]]:
        """``module -> own positions`` of every compactly placed module (empty at schema placement)."""
        return {name: self.own_positions(name) for name in self.module_shifts}

    def geometry_of(self, module: str) -> str:
        """The encoding of ``module``'s block this prompt reads: ``"schema"`` or ``"packed"``."""
        return self.geometry.get(module, "schema")

    def live_segments(self) -> tuple[Segment, ...]:
        """Segments whose tokens make up the prompt as the model reads it (no slots)."""
        return tuple(s for s in self.segments if s.kind != "slot")

    @cached_property
    def token_ids(self) -> tuple[int, ...]:
        """Token ids of the live prompt, in position order."""
        out: list[int] = []
        for s in self.live_segments():
            out.extend(s.token_ids)  # a copy of references, not an iteration per token
        return tuple(out)

    @cached_property
    def position_ids(self) -> tuple[int, ...]:
        """Schema positions of ``token_ids``."""
        out: list[int] = []
        for s in self.live_segments():
            out.extend(s.position_ids)
        return tuple(out)

    @property
    def last_position(self) -> int:
        """The highest position of a live token (-1 when there is none)."""
        return max((s.position_ids[-1] for s in self.live_segments() if s.position_ids), default=-1)

    @property
    def uncached_segments(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.kind in ("argument", "text"))
