"""Helpers shared by the schema and prompt parsers: attributes, names, text runs, role tags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from lxml import etree

from pckernels.pml.document import (
    NAME_RULE,
    XML_SPACE,
    Source,
    TextPart,
    element_content,
    is_valid_name,
)
from pckernels.pml.model import ROOT
from pckernels.pml.placement import PLACEMENTS
from pckernels.pml.roles import RoleFormat, role_format

XML_WHITESPACE = " \t\r\n"
ROLE_TAGS = ("system", "user", "assistant")


def attributes(source: Source, element: etree._Element, allowed: tuple[str, ...],
               required: tuple[str, ...] = ()) -> dict[str, str]:
    """The element's attributes, refusing unknown and missing ones (``xml:space`` is allowed)."""
    values: dict[str, str] = {}
    for key, value in element.attrib.items():
        if key == XML_SPACE:
            continue
        if key not in allowed:
            expected = ", ".join(allowed) if allowed else "none"
            raise source.error(f"<{element.tag}> has no attribute {key!r}; expected: {expected}",
                               element)
        values[key] = value
    for key in required:
        if key not in values:
            raise source.error(f"<{element.tag}> needs a {key}=\"…\" attribute", element)
    return values


def check_placement(source: Source, element: etree._Element, value: str) -> str:
    """``value`` of a ``placement=`` attribute if it is ``schema`` or ``compact``, else a located ``PMLError``."""
    if value not in PLACEMENTS:
        raise source.error(f"placement={value!r} is not a placement; expected 'schema' (modules at their schema "
                           "positions) or 'compact' (modules laid out contiguously in the prompt's order)", element)
    return value


def check_name(source: Source, element: etree._Element, name: str, what: str) -> str:
    """Return ``name`` if it follows the name rule, else raise a located ``PMLError``."""
    if not is_valid_name(name):
        raise source.error(f"invalid {what} name {name!r}: a name is {NAME_RULE}", element)
    return name


def space_mode(source: Source, element: etree._Element, inherited: bool) -> bool:
    """Whether whitespace is preserved inside ``element`` (``xml:space``, inherited)."""
    value = element.get(XML_SPACE)
    if value is None:
        return inherited
    if value not in ("preserve", "default"):
        raise source.error(f"xml:space must be \"preserve\" or \"default\", not {value!r}",
                           element)
    return value == "preserve"


def text_runs(element: etree._Element, preserve: bool,
              is_inline: Callable[[etree._Element], bool]) -> list[TextPart | etree._Element]:
    """The element's content with the PML whitespace rule applied to its text.

    A text run loses its leading XML whitespace unless it follows an inline element (a
    parameter), and its trailing whitespace unless an inline element follows it; the
    element's own start and end tags and every other element are block boundaries. Nothing
    is stripped under ``xml:space="preserve"``. Empty runs are dropped.
    """
    parts = element_content(element)
    out: list[TextPart | etree._Element] = []
    for index, part in enumerate(parts):
        if not isinstance(part, TextPart):
            out.append(part)
            continue
        text = part.text
        if not preserve:
            if not (index > 0 and is_inline(parts[index - 1])):
                stripped = text.lstrip(XML_WHITESPACE)
                part.skipped = len(text) - len(stripped)
                text = stripped
            if not (index + 1 < len(parts) and is_inline(parts[index + 1])):
                text = text.rstrip(XML_WHITESPACE)
        if text:
            part.text = text
            out.append(part)
    return out


def is_empty(element: etree._Element) -> bool:
    """Whether the element holds no child elements and only whitespace (comments aside)."""
    for part in element_content(element):
        if not isinstance(part, TextPart) or part.text.strip(XML_WHITESPACE):
            return False
    return True


def text_offset(source: Source, part: TextPart) -> int | None:
    """Source offset of the first kept character of a text run (approximate after comments)."""
    offset = source.text_offset(part.anchor, tail=part.tail)
    return None if offset is None else offset + part.skipped


def qualify(parent: str, name: str) -> str:
    """The qualified name of module ``name`` inside module ``parent`` (``ROOT``: the top level)."""
    return name if parent == ROOT else f"{parent}/{name}"


@dataclass
class Pieces:
    """A run of text kept as pieces until it is read (so appending stays linear)."""

    pieces: list[str]

    @property
    def text(self) -> str:
        if len(self.pieces) != 1:
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0]


class RoleTags:
    """Expands role tags (``<system>``, ``<user>``, ``<assistant>``) in ``tokenizer``'s chat
    format, found when the first role tag is read (``format``; ``None`` until then)."""

    def __init__(self, source: Source, tokenizer: Any) -> None:
        self.source = source
        self.tokenizer = tokenizer
        self.format: RoleFormat | None = None

    def expand(self, element: etree._Element, preserve: bool, *, in_role: bool,
               add_text: Callable[[str], None], add_content: Callable[[bool], None]) -> None:
        """Add the role's prefix, its content (``add_content(preserve)``) and its suffix; an
        empty ``<assistant/>`` adds the generation prompt."""
        tag = element.tag
        if in_role:
            raise self.source.error(f"<{tag}> cannot be inside another role tag", element)
        attributes(self.source, element, ())
        if self.format is None:
            self.format = role_format(self.tokenizer)
        preserve = space_mode(self.source, element, preserve)
        if tag == "assistant" and is_empty(element) and not (preserve and element.text):
            add_text(self.format.generation_prompt)
            return
        if tag not in self.format.affixes:
            raise self.source.error(f"<{tag}> cannot be expanded: {self.format.unsupported[tag]}",
                                    element)
        prefix, suffix = self.format.affixes[tag]
        if prefix:
            add_text(prefix)
        add_content(preserve)
        if suffix:
            add_text(suffix)
