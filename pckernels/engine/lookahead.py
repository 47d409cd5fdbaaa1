"""Draft tokens from the request's own context: prompt lookup (n-gram) speculation.

Answers over a long document, code or a template often copy runs of it. :class:`NgramDrafter`
keeps, for every n-gram of the prompt and the answer so far, where it last occurred with a token
after it; when the answer's last ``n`` tokens occurred before, the tokens that followed them are
the draft. The scheduler forwards the pending token and the draft in one step and keeps the
draft's longest prefix that greedy decoding would have chosen (``docs/engine.md``): a step reads
the weights and the KV once for several tokens. Nothing here touches the model.
"""

from __future__ import annotations

NGRAMS = (3, 2)
"""Match lengths tried, longest first (a single token matches too often to be worth a draft)."""


class NgramDrafter:
    """Prompt-lookup drafts over ``tokens`` (the prompt, then every chosen token via :meth:`extend`)."""

    def __init__(self, tokens: list[int], ngrams: tuple[int, ...] = NGRAMS) -> None:
        self.tokens: list[int] = []
        self.ngrams = ngrams
        self._last: dict[tuple[int, ...], int] = {}
        """n-gram -> start of its latest occurrence that has a token after it."""
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens`` to the context."""
        seq = self.tokens
        last = self._last
        for token in tokens:
            end = len(seq)
            for n in self.ngrams:
                if end >= n:
                    last[tuple(seq[end - n:end])] = end - n
            seq.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the context's last
        n-gram (longest match first); ``[]`` when none occurred or ``k < 1``."""
        if k < 1:
            return []
        seq = self.tokens
        for n in self.ngrams:
            if len(seq) <= n:
                continue
            start = self._last.get(tuple(seq[-n:]))
            if start is not None:
                return seq[start + n:start + n + k]
        return []
