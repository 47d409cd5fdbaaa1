"""Pass 3 of schema parsing: positions assigned in document order, and the ``Module`` and
``LayoutEntry`` data of the schema."""

from __future__ import annotations

from typing import Any

from pckernels.errors import PMLError
from pckernels.pml.document import Limits, Source
from pckernels.pml.model import ROOT, LayoutEntry, Module, Param
from pckernels.pml.schema_decls import GroupDecl, ModuleDecl, PositionLimit, SlotDecl, TextDecl, TokensDecl
from pckernels.pml.schema_tokens import LazyEncoder, TooLong


class Layout:
    """Assigns positions in document order and builds the contract's data (pass 3).

    Positions and the total token count are checked before anything is allocated for a text
    or a parameter slot, so the work done is bounded by the limits, not by what the schema asks.
    """

    def __init__(self, name: str, placeholder: int, limits: Limits, limit: PositionLimit,
                 source: Source, encoder: LazyEncoder) -> None:
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

    def module(self, decl: ModuleDecl, start: int) -> int:
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
            if isinstance(item, (TextDecl, TokensDecl)):
                what = "anonymous text" if is_root else f"module {decl.name!r}"
                if isinstance(item, TextDecl):
                    try:
                        ids = self.encoder.ids(item, self.limit.value - position)
                    except TooLong as exc:
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
            elif isinstance(item, SlotDecl):
                self._check(position + item.length, item.length, item.element,
                            f"parameter {item.name!r} of module {decl.name!r}")
                params.append(Param(item.name, decl.name, position, item.length,
                                    len(token_ids), item.default_ids))
                self.entries.append(LayoutEntry(f"{decl.name}/{item.name}", "param", position,
                                                item.length, decl.name))
                token_ids.extend([self.placeholder] * item.length)
                position_ids.extend(range(position, position + item.length))
                position += item.length
            elif isinstance(item, ModuleDecl):
                children.append(item.name)
                position = self.module(item, position)
            elif isinstance(item, GroupDecl):
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

    def _group(self, group: GroupDecl, start: int, children: list[str]) -> int:
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
