"""An answer's text, built a token at a time in constant work per token, and cut at a stop string.

Two pieces, used by every way of generating (the engine's :class:`~pckernels.generation.TokenChoice`,
``PromptCache.stream`` and the server's SSE responses):

:class:`Detokenizer`
    Incremental detokenisation with the usual offset technique: each token decodes only a short
    window of ids, ``ids[prefix_offset:]``, and the text it adds is that window's text less the text
    of ``ids[prefix_offset:read_offset]`` (the context before it: SentencePiece-style decoders treat
    the first token of a decode differently). Text that ends in an incomplete UTF-8 sequence (the
    decoder's replacement character ``\\ufffd`` last) is held back until a later token completes it;
    when the text is stable, the window moves on, so a window is a few tokens long however long the
    answer grows. The text of the ids pushed one at a time is a function of the ids alone (never of
    how they were grouped into calls); for byte-level BPE tokenizers (GPT-2 style: SmolLM2, Llama 3,
    Qwen) it equals ``tokenizer.decode(ids, skip_special_tokens=True)``, and so it does for
    SentencePiece-style decoders (a leading space stripped, byte fallback) on valid UTF-8
    (tests/test_text.py); a decoder whose earlier text changes with later ids (byte fallback on
    invalid bytes) can differ from a whole decode there, never between the stream and the result.

:class:`TextStream`
    A :class:`Detokenizer` and the answer's stop strings: the one routine that cuts an answer at its
    first stop string, for the final result and for the stream alike. :meth:`TextStream.push` returns
    the text that is safe to show (it will be in the final answer whatever comes next): a tail that
    could still begin a stop string is held back (only as much as could: the longest suffix that is
    a prefix of one), and so is an incomplete character. The deltas joined with
    :meth:`TextStream.finish`'s rest are the final text, exactly.
"""

from __future__ import annotations

import logging
import os

from pckernels.generation.stops import first_stop

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"
"""What a tokenizer decodes an incomplete (or invalid) UTF-8 sequence to."""

MAX_PENDING = 8
"""Every this many tokens held back (their text ends in ``\\ufffd``, or adds nothing), the
detokenizer looks for a clean point inside them to move its window to, so that a run of odd bytes
cannot grow the window for long (a run of special tokens, which decode to nothing, still does)."""


class Detokenizer:
    """Text of a growing list of token ids (module docstring). ``decode(ids) -> str`` is the
    tokenizer's, called with ``skip_special_tokens`` (vLLM's option; True unless asked) on windows of a few ids."""

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        """Start of the decode window: the context of the text not yet stable."""
        self.read_offset = 0
        """Ids before this have given stable text (``pieces``)."""
        self._prefix_text = ""
        """``decode(ids[prefix_offset:read_offset])``."""
        self.pending = ""
        """Text of ``ids[read_offset:]`` as it decodes now (may end in ``\\ufffd``; not stable)."""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def push(self, token: int) -> str:
        """Append ``token``; the text that became stable with it (often ``""`` while held back)."""
        self.ids.append(int(token))
        window = self._decode(self.ids[self.prefix_offset:])
        prefix = self._prefix_text
        new = window[len(prefix):] if window.startswith(prefix) else None
        if new and not new.endswith(REPLACEMENT):
            return self._advance(len(self.ids), new)
        # A decoder whose earlier text changes with later ids (byte fallback turning an invalid
        # run of bytes into one replacement each, spaces cleaned up across the window's start):
        # what differs from the context is pending, and the window waits for a clean point.
        self.pending = new if new is not None else window[len(os.path.commonprefix([window, prefix])):]
        if (len(self.ids) - self.read_offset) % MAX_PENDING == 0:
            return self._advance_inside(window)
        return ""

    def _advance(self, read: int, stable: str) -> str:
        """Ids up to ``read`` gave ``stable`` (text after ``_prefix_text``): the window moves on,
        its context now the ids from the old ``read_offset`` to ``read``."""
        self.prefix_offset, self.read_offset = self.read_offset, read
        self._prefix_text = self._decode(self.ids[self.prefix_offset:read])
        if read < len(self.ids):
            window = self._decode(self.ids[self.prefix_offset:])
            prefix = self._prefix_text
            self.pending = window[len(prefix):] if window.startswith(prefix) else self.pending[len(stable):]
        else:
            self.pending = ""
        return stable

    def _advance_inside(self, window: str) -> str:
        """The last point inside the held ids where the text ends cleanly and is a prefix of
        ``window``; advance to it (``""`` when there is none yet)."""
        prefix = self._prefix_text
        for read in range(len(self.ids) - 1, self.read_offset, -1):
            text = self._decode(self.ids[self.prefix_offset:read])
            if len(text) > len(prefix) and not text.endswith(REPLACEMENT) and window.startswith(text) \
                    and text.startswith(prefix):
                return self._advance(read, text[len(prefix):])
        return ""

    def flush(self) -> str:
        """The held-back text as it decodes now (the answer has ended); the window is emptied."""
        rest, self.pending = self.pending, ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self._prefix_text = ""
        return rest


class TextStream:
    """An answer's text and its cut at the first of ``stops`` (module docstring).

    ``push(tokens)`` after each chosen token(s) returns the new text safe to show; ``stopped`` turns
    true with the token that completes a stop string (the text is cut before it, and later tokens
    are ignored); ``finish()`` returns the rest once the answer has ended; ``text`` is the answer so
    far (all of it after ``finish``). Work per token is bounded by the stop strings' lengths and the
    detokenizer's window, not by the answer's length.
    """

    def __init__(self, tokenizer, stops=(), *, skip_special_tokens: bool = True) -> None:
        self.stops = [s for s in ([stops] if isinstance(stops, str) else stops or ()) if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.detok = Detokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self._pieces: list[str] = []
        """Stable text, cut at the stop when stopped."""
        self._length = 0
        """Characters in ``_pieces``."""
        self._tail = ""
        """The last ``longest - 1`` characters of the stable text (where a stop string may begin)."""
        self.shown = 0
        """Characters handed out by ``push`` / ``finish``."""
        self.stopped = False
        self.finished = False

    @property
    def text(self) -> str:
        """The answer's stable text so far (cut at the stop); the whole answer after ``finish``."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def emitted(self) -> str:
        """The text handed out so far (joins the deltas: not for every token)."""
        return self.text[:self.shown]

    def since(self, start: int) -> str:
        """The text handed out from character ``start`` on (reads only the pieces after it)."""
        return self._slice(start, self.shown) if start < self.shown else ""

    def push(self, tokens) -> str:
        """Add the chosen ``tokens`` (ids, in order); the new text that is safe to show."""
        for token in tokens:
            if self.stopped or self.finished:
                break
            self._add(self.detok.push(token))
        return self._show()

    def _add(self, stable: str) -> None:
        """Take ``stable`` new text; stop at a stop string in it or in the pending text after it
        (``_tail`` first: a stop string may have begun there; none lies wholly in earlier text)."""
        if self.stops:
            region = self._tail + stable + self.detok.pending
            cut = first_stop(region, self.stops)
            if cut is not None:
                kept = cut - len(self._tail)
                if kept < 0:
                    whole = self.text[:self._length + kept]
                    self._pieces, self._length = [whole], len(whole)
                else:
                    self._append(region[len(self._tail):cut])
                self.stopped = True
                return
        self._append(stable)

    def _append(self, text: str) -> None:
        if text:
            self._pieces.append(text)
            self._length += len(text)
            if self.longest > 1:
                self._tail = (self._tail + text)[-(self.longest - 1):]

    def _held(self) -> int:
        """Characters at the end of the stable text that could begin a stop string."""
        if self.stopped or self.finished:
            return 0
        tail = self._tail
        for size in range(min(len(tail), self.longest - 1), 0, -1):
            end = tail[len(tail) - size:]
            if any(s.startswith(end) for s in self.stops):
                return size
        return 0

    def _show(self) -> str:
        safe = self._length - self._held()
        if safe <= self.shown:
            return ""
        delta = self._slice(self.shown, safe)
        self.shown = safe
        return delta

    def _slice(self, start: int, end: int) -> str:
        """``text[start:end]`` reading only the last pieces (``start`` is near the end)."""
        out, at = [], self._length
        for piece in reversed(self._pieces):
            if at <= start:
                break
            piece_start = at - len(piece)
            if end > piece_start:
                out.append(piece[max(0, start - piece_start):end - piece_start])
            at = piece_start
        return "".join(reversed(out))

    def finish(self, final_text: str | None = None) -> str:
        """The answer has ended: the rest of its text not yet handed out (the pending text of an
        unstopped answer was searched for stop strings with its last token). ``final_text``, the
        request's result (built by this same routine in its :class:`TokenChoice`), is checked
        against: a mismatch is logged and the result's text wins."""
        if not self.finished:
            if not self.stopped:
                self._append(self.detok.flush())
            self.finished = True
        delta = self._show()
        if final_text is not None and final_text != self.text:
            log.warning("streamed text %r differs from the result's %r", self.text, final_text)
            done = self.text[:self.shown - len(delta)]
            return final_text[len(done):] if final_text.startswith(done) else ""
        return delta
