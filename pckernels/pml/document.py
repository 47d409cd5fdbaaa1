"""Hardened XML reading for PML: limits, source locations, names and element content.

Everything that touches raw PML text lives here, so that the schema and prompt parsers
only see a well-formed element tree plus a way to turn an element into a line and column.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass

from lxml import etree

from pckernels.errors import PMLError

XML_SPACE = "{http://www.w3.org/XML/1998/namespace}space"

NAME_RULE = (
    "1 to 128 characters: letters, digits, '_', '-' and '.' (no '/', no spaces)"
)
_NAME_RE = re.compile(r"[\w.\-]{1,128}")
_FORBIDDEN_DECLARATION = re.compile(r"<!(DOCTYPE|ENTITY|ELEMENT|ATTLIST)", re.IGNORECASE)
_MARKUP = re.compile(
    r"<!--.*?-->"
    r"|<!\[CDATA\[.*?\]\]>"
    r"|<\?.*?\?>"
    r"|</[^>]*>"
    r"|<[^\s/>!?][^\s/>]*(?:[^>\"']+|\"[^\"]*\"|'[^']*')*>",
    re.DOTALL,
)


@dataclass(frozen=True)
class Limits:
    """Bounds on what a PML document may ask for; exceeding one raises ``PMLError``."""

    max_input_bytes: int = 8 * 1024 * 1024
    """Size of the PML text itself (UTF-8 bytes)."""
    max_src_bytes: int = 64 * 1024 * 1024
    """Total size of the files a schema loads through ``src=``."""
    max_depth: int = 32
    """Element nesting depth (the root element is depth 1)."""
    max_elements: int = 200_000
    """Elements in one document."""
    max_modules: int = 100_000
    """Modules in one schema."""
    max_positions: int = 1 << 22
    """Positions a schema (or a prompt) may span, whatever the model allows; also the most
    positions all parameters of one schema may reserve together."""


def is_valid_name(name: str) -> bool:
    """Whether ``name`` follows the PML name rule (``NAME_RULE``)."""
    return _NAME_RE.fullmatch(name) is not None


class Source:
    """A parsed PML document: its root element and the source offset of every element."""

    def __init__(self, text: str, root: etree._Element, label: str | None) -> None:
        self.text = text
        self.root = root
        self.label = label
        self._line_starts: list[int] | None = None
        self._elements = [el for el in root.iter() if isinstance(el.tag, str)]
        self._index = {el: i for i, el in enumerate(self._elements)}
        self._spans = _scan_element_spans(text, len(self._elements))

    def location(self, offset: int) -> tuple[int, int]:
        """1-based (line, column) of a character offset."""
        if self._line_starts is None:
            self._line_starts = [0] + [m.end() for m in re.finditer("\n", self.text)]
        line = bisect.bisect_right(self._line_starts, offset)
        return line, offset - self._line_starts[line - 1] + 1

    def element_offset(self, element: etree._Element) -> int | None:
        """Offset of the element's start tag."""
        span = self._span(element)
        return span[0] if span else None

    def text_offset(self, element: etree._Element, tail: bool = False) -> int | None:
        """Offset where the element's text (or tail) begins."""
        span = self._span(element)
        if span is None:
            return None
        return span[2] if tail else span[1]

    def _span(self, element: etree._Element) -> tuple[int, int, int] | None:
        if self._spans is None:
            return None
        index = self._index.get(element)
        return None if index is None else self._spans[index]

    def error(self, message: str, element: etree._Element | None = None, *,
              offset: int | None = None, kind: type[PMLError] = PMLError) -> PMLError:
        """A ``PMLError`` (or subclass ``kind``) located at ``offset``, or at ``element``'s start tag."""
        if offset is None and element is not None:
            offset = self.element_offset(element)
        if offset is not None:
            line, column = self.location(offset)
        elif element is not None:
            line, column = element.sourceline, None
        else:
            line, column = 1, 1
        return kind(message, line=line, column=column, source=self.label)


def _scan_element_spans(text: str, expected: int) -> list[tuple[int, int, int]] | None:
    """Per element in document order: (start tag offset, end of start tag, end of element).

    Only called on text lxml accepted as well-formed, where ``<`` never occurs inside text
    or attribute values, so a flat scan over markup is exact. Returns ``None`` if the scan
    disagrees with lxml's element count (locations then fall back to line numbers).
    """
    spans: list[list[int]] = []
    open_stack: list[int] = []
    for match in _MARKUP.finditer(text):
        token = match.group()
        if token.startswith(("<!", "<?")):
            continue
        if token.startswith("</"):
            if not open_stack:
                return None
            spans[open_stack.pop()][2] = match.end()
            continue
        spans.append([match.start(), match.end(), match.end()])
        if not token.endswith("/>"):
            open_stack.append(len(spans) - 1)
    if len(spans) != expected or open_stack:
        return None
    return [tuple(s) for s in spans]


def read_document(text: str | bytes, limits: Limits, *, label: str | None = None,
                  kind: str = "PML") -> Source:
    """Parse PML text with a hardened lxml parser; every failure is a ``PMLError``."""
    if isinstance(text, bytes):
        if len(text) > limits.max_input_bytes:
            raise PMLError(f"{kind} input is {len(text)} bytes; the limit is "
                           f"{limits.max_input_bytes} (Limits.max_input_bytes)",
                           line=1, column=1, source=label)
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            before = text[:exc.start]
            line_start = before.rfind(b"\n") + 1
            column = len(before[line_start:].decode("utf-8")) + 1
            raise PMLError(f"{kind} input is not valid UTF-8 ({exc.reason} at byte {exc.start}); "
                           "PML is read as UTF-8: save the file as UTF-8",
                           line=before.count(b"\n") + 1, column=column, source=label) from None
    if not isinstance(text, str):
        raise PMLError(f"{kind} input must be str or bytes, not {type(text).__name__}",
                       line=None, column=None, source=label)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        line = text.count("\n", 0, exc.start) + 1
        column = exc.start - (text.rfind("\n", 0, exc.start) + 1) + 1
        raise PMLError(f"{kind} input holds a character that cannot be encoded as UTF-8 "
                       f"({exc.reason})", line=line, column=column, source=label) from None
    if len(data) > limits.max_input_bytes:
        cut = len(data[: limits.max_input_bytes].decode("utf-8", errors="ignore"))
        line = text.count("\n", 0, cut) + 1
        column = cut - (text.rfind("\n", 0, cut) + 1) + 1
        raise PMLError(f"{kind} input is {len(data)} bytes; the limit is "
                       f"{limits.max_input_bytes} (Limits.max_input_bytes)",
                       line=line, column=column, source=label)
    declaration = _FORBIDDEN_DECLARATION.search(text)
    if declaration:
        offset = declaration.start()
        line = text.count("\n", 0, offset) + 1
        column = offset - (text.rfind("\n", 0, offset) + 1) + 1
        raise PMLError(f"<!{declaration.group(1)}> declarations are not allowed in PML "
                       "(no DTDs or entities); remove it", line=line, column=column,
                       source=label)
    parser = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False,
                             huge_tree=False, dtd_validation=False, encoding="utf-8",
                             remove_comments=False, remove_pis=False, collect_ids=False)
    try:
        root = etree.fromstring(data, parser)
    except etree.XMLSyntaxError as exc:
        line, column = exc.position if exc.position else (None, None)
        message = exc.msg or str(exc)
        message = re.sub(r", line \d+, column \d+$", "", message)
        if "EntityRef" in message or "StartTag: invalid element name" in message:
            message += ("; a literal & or < in text must be written &amp; or &lt; (or put the "
                        "text in a CDATA section or a src= file)")
        raise PMLError(f"malformed XML: {message}", line=line or 1, column=column,
                       source=label) from None
    except (ValueError, etree.LxmlError) as exc:
        raise PMLError(f"malformed XML: {exc}", line=1, column=1, source=label) from None
    if root is None:
        raise PMLError(f"empty {kind} document", line=1, column=1, source=label)
    docinfo = root.getroottree().docinfo
    if docinfo.doctype or docinfo.internalDTD is not None:
        raise PMLError("DTD declarations are not allowed in PML", line=1, column=1,
                       source=label)
    source = Source(text, root, label)
    _check_shape(source, limits, kind)
    return source


def _check_shape(source: Source, limits: Limits, kind: str) -> None:
    """Refuse documents nested too deeply or holding too many elements (iteratively)."""
    depth = 0
    count = 0
    for event, element in etree.iterwalk(source.root, events=("start", "end")):
        if event == "end":
            depth -= 1
            continue
        depth += 1
        count += 1
        if depth > limits.max_depth:
            raise source.error(f"nesting too deep: {kind} elements may nest at most "
                               f"{limits.max_depth} levels (Limits.max_depth)", element)
        if count > limits.max_elements:
            raise source.error(f"too many elements: the limit is {limits.max_elements} "
                               "(Limits.max_elements)", element)


def local_tag(element: etree._Element) -> str | None:
    """The element's tag, or ``None`` for namespaced tags (never valid in PML)."""
    tag = element.tag
    if not isinstance(tag, str) or tag.startswith("{"):
        return None
    return tag


@dataclass
class TextPart:
    """A run of source text and where it starts (element plus text/tail flag)."""

    text: str
    anchor: etree._Element
    tail: bool
    skipped: int = 0
    """Characters dropped from the start by the whitespace rule (for error locations)."""


def element_content(element: etree._Element) -> list[TextPart | etree._Element]:
    """The element's content: ``TextPart``s and child elements, alternating.

    Comments and processing instructions vanish and the text around them joins. Text parts
    are present (possibly empty) before, between and after child elements.
    """
    parts: list[TextPart | etree._Element] = [TextPart(element.text or "", element, False)]
    pieces: list[str] = []
    for child in element:
        if isinstance(child.tag, str):
            _join_pieces(parts[-1], pieces)
            parts.append(child)
            parts.append(TextPart(child.tail or "", child, True))
        elif child.tail:
            pieces.append(child.tail)
    _join_pieces(parts[-1], pieces)
    return parts


def _join_pieces(part: TextPart | etree._Element, pieces: list[str]) -> None:
    """Append the tails of the comments after ``part`` in one join (linear in their size)."""
    if pieces:
        assert isinstance(part, TextPart)
        part.text = "".join([part.text, *pieces])
        pieces.clear()

