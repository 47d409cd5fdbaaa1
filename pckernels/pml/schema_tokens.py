"""Pass 2 of schema parsing: the schema's texts tokenized lazily, in the order the layout reads
them, so a schema past its position limit is refused without tokenizing all of it."""

from __future__ import annotations

from typing import Any

from pckernels.pml.schema_decls import TextDecl
from pckernels.pml.tokens import encode_batch

_BATCH_CHARS = 1 << 20
"""About how many characters of schema text are tokenized per batch."""
_PROBE_MARGIN = 64


class TooLong(Exception):
    """A text needs at least ``at_least`` positions, more than the room left for it."""

    def __init__(self, at_least: int) -> None:
        super().__init__(at_least)
        self.at_least = at_least


class LazyEncoder:
    """Tokenizes the schema's texts in document order — the order the layout reads them — about
    ``_BATCH_CHARS`` characters per batch, so a schema past its position limit is refused after
    tokenizing at most one batch beyond the limit instead of all of it. A single text longer
    than a batch is first probed with a prefix: when the prefix alone needs more than twice the
    room left, the text is refused without tokenizing the rest."""

    def __init__(self, tokenizer: Any, texts: list[TextDecl]) -> None:
        self.tokenizer = tokenizer
        self.texts = texts
        self.index = {id(text): i for i, text in enumerate(texts)}

    def ids(self, item: TextDecl, room: int) -> tuple[int, ...]:
        """Token ids of ``item``; raises ``TooLong`` when it certainly exceeds ``room``."""
        if item.ids is None:
            if len(item.text) > _BATCH_CHARS:
                self._probe(item.text, room)
            start = self.index[id(item)]
            end, size = start, 0
            while end < len(self.texts) and self.texts[end].ids is None and (
                    end == start or size + len(self.texts[end].text) <= _BATCH_CHARS):
                size += len(self.texts[end].text)
                end += 1
            batch = self.texts[start:end]
            for text, ids in zip(batch, encode_batch(self.tokenizer, [t.text for t in batch])):
                text.ids = ids
        return item.ids

    def _probe(self, text: str, room: int) -> None:
        chars = 32 * (max(room, 0) + _PROBE_MARGIN)
        if len(text) <= chars:
            return
        cut = max(text.rfind(" ", 0, chars), text.rfind("\n", 0, chars))
        count = len(encode_batch(self.tokenizer, [text[:cut if cut > 0 else chars]])[0])
        if count > 2 * max(room, 0) + _PROBE_MARGIN:
            raise TooLong(count - _PROBE_MARGIN)
