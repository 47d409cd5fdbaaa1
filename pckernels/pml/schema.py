"""Schema parsing: PML text -> ``Schema`` (modules, positions, unions, scaffolds).

Parsing happens in three passes: the element tree is checked and turned into declarations
(names, nesting, text runs; ``schema_reader``), the texts are tokenized as the layout reaches
them (``schema_tokens``), and the layout pass assigns positions in document order
(``schema_layout``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from pckernels.errors import PMLError
from pckernels.pml.document import Limits, read_document
from pckernels.pml.model import Scaffold, Schema
from pckernels.pml.placement import PLACEMENTS
from pckernels.pml.schema_decls import PositionLimit, SlotDecl, TextDecl, walk
from pckernels.pml.schema_layout import Layout
from pckernels.pml.schema_reader import SchemaReader
from pckernels.pml.schema_tokens import LazyEncoder
from pckernels.pml.tokens import encode_batch, fingerprint, placeholder_token_id

log = logging.getLogger(__name__)

LAYOUT_VERSION = "pml-layout-1"
"""Changes whenever the same schema text could lay out differently (part of the digest)."""


def parse_schema(text: str | bytes, tokenizer: Any, *, base_dir: str | os.PathLike | None = None,
                 max_positions: int | None = None, limits: Limits | None = None,
                 label: str | None = None, placement: str = "schema") -> Schema:
    """Parse a PML schema and lay it out.

    ``base_dir`` is the directory ``src=`` paths are relative to; ``max_positions`` the
    model's position limit (the schema must end at or before it); ``label`` names the
    source in error messages; ``placement``: its prompts' placement when the ``<schema>`` tag
    has no ``placement=`` (an engine passes its default). Raises ``PMLError`` for every rejection.
    """
    limits = limits or Limits()
    if max_positions is not None and max_positions < 1:
        raise PMLError(f"max_positions must be positive, not {max_positions}")
    source = read_document(text, limits, label=label, kind="schema")
    limit = PositionLimit.of(limits, max_positions)
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    reader = SchemaReader(source, tokenizer, Path(base_dir) if base_dir is not None else None,
                          limits, limit, placement)
    name, root = reader.read()

    items = list(walk(root))
    slots = [item for item in items if isinstance(item, SlotDecl) and item.default_text]
    for slot, ids in zip(slots, encode_batch(tokenizer, [s.default_text for s in slots])):
        if len(ids) > slot.length and slot.original_spelling:
            line, column = source.location(source.element_offset(slot.element) or 0)
            log.warning("%sline %d, column %d: scaffold=%r on parameter %r is %d tokens, longer "
                        "than its length=%d; ignored, the parameter has no default (the original "
                        "implementation refuses it too, with some tokenizers)",
                        f"{label}: " if label else "", line, column, slot.default_text,
                        slot.name, len(ids), slot.length)
            continue
        if len(ids) > slot.length:
            raise source.error(f"the default of parameter {slot.name!r} is {len(ids)} tokens, "
                               f"longer than its len={slot.length}", slot.element)
        slot.default_ids = ids

    encoder = LazyEncoder(tokenizer, [item for item in items if isinstance(item, TextDecl)])
    layout = Layout(name, placeholder_token_id(tokenizer), limits, limit, source, encoder)
    length = layout.module(root, 0)

    digest = hashlib.sha256()
    for part in (LAYOUT_VERSION, source.text, fingerprint(tokenizer)):
        digest.update(part.encode("utf-8"))
        digest.update(b"\x00")
    for src, file_digest in reader.src_records:
        digest.update(f"{src}\x00{file_digest}\x00".encode("utf-8"))

    scaffolds = {s.name: Scaffold(s.name, tuple(m.name for m in s.members))
                 for s in reader.scaffolds.values()}
    unions = {u.name: tuple(m.name for m in u.members) for u in reader.unions.values()}
    return Schema(name=name, modules=layout.modules, layout=tuple(layout.entries),
                  scaffolds=scaffolds, length=length, digest=digest.hexdigest(),
                  placeholder_token_id=layout.placeholder, tokenizer=tokenizer,
                  source=source.text, unions=unions, max_positions=max_positions,
                  placement=reader.placement, location=source.location(source.element_offset(source.root) or 0))
