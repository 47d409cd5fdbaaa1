"""What the schema reader declares and the layout places: text, tokens, parameter slots,
modules and their groups (unions, scaffolds), in document order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pckernels.pml.document import Limits
from pckernels.pml.elements import Pieces


@dataclass
class TextDecl(Pieces):
    """A run of module text."""

    ids: tuple[int, ...] | None = None
    """Set by ``LazyEncoder`` when the layout reaches the text."""


@dataclass
class TokensDecl:
    """Tokens placed as they are: the special tokens the tokenizer puts first (typically BOS)."""

    ids: tuple[int, ...]


@dataclass
class SlotDecl:
    """A parameter: ``length`` positions reserved in its module, and its default."""

    name: str
    length: int
    default_text: str | None
    default_ids: tuple[int, ...] = ()
    element: Any = None
    original_spelling: bool = False
    """The default came from the original implementation's ``scaffold=``."""


@dataclass
class ModuleDecl:
    """A module, or the schema's top level (``ROOT``): its items in document order and the
    names declared directly in it."""

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
        if self.items and isinstance(self.items[-1], TextDecl):
            self.items[-1].pieces.append(text)
        else:
            self.items.append(TextDecl([text]))


@dataclass
class GroupDecl:
    """A ``<union>`` (``kind``; its members are alternatives at the same positions) or a
    ``<scaffold>`` (its members follow one another and are encoded together)."""

    kind: str
    name: str
    layout_parent: str | None
    members: list[ModuleDecl] = field(default_factory=list)


@dataclass(frozen=True)
class PositionLimit:
    """The binding position limit: the model's ``max_positions`` or ``Limits.max_positions``."""

    value: int
    model: bool

    @classmethod
    def of(cls, limits: Limits, max_positions: int | None) -> "PositionLimit":
        if max_positions is not None and max_positions <= limits.max_positions:
            return cls(max_positions, True)
        return cls(limits.max_positions, False)

    def __str__(self) -> str:
        if self.model:
            return f"the model's limit of {self.value} positions (max_positions)"
        return f"the limit of {self.value} positions (Limits.max_positions)"


def walk(decl: ModuleDecl):
    """Every item inside ``decl``, in document order (group members included)."""
    for item in decl.items:
        yield item
        if isinstance(item, ModuleDecl):
            yield from walk(item)
        elif isinstance(item, GroupDecl):
            for member in item.members:
                yield member
                yield from walk(member)
