"""One prompt read chunk by chunk: a prefill that can stop between chunks and go on later.

A :class:`Reading` is what :meth:`PrefixCache.begin <pckernels.prefix.PrefixCache.begin>` returns:
the longest stored prefix already restored into its working cache (``reuse``), then
:meth:`Reading.advance` reads the rest in the same ``chunk_size`` pieces from the same chunk
boundaries as a prefill from scratch, storing each full block (and, with it, the recurrent
snapshot at its end) and finally the prompt end. A caller that interleaves prompts with other
work (the engine's scheduler) advances it a few chunks per step; :meth:`PrefixCache.prefill`
advances it to the end at once. Either way the chunks, and so the bits, are the same. A reading
that resumed off a chunk boundary or within a stored entry (token-granular resumption,
``PrefixCache(resume="token")``) reads on from the first new token in ``chunk_size`` pieces: its
chunks are cut elsewhere than a cold read's, so its states equal those only to rounding; the
blocks and prompt end it completes are stored all the same (a later turn of a chat resumes after
them).
:meth:`Reading.close` lets go of what it holds; a reading closed before its end stores what it
completed and nothing else.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pckernels.kernels._common import to_device
from pckernels.prefix.base import Prefill, PrefixMatch, PromptRows
from pckernels.prefix.blocks import head_kv


class Owner(Protocol):
    """What a reading uses of its :class:`~pckernels.prefix.PrefixCache`."""

    device: torch.device
    refusal: str | None
    chunk_size: int
    states: object

    def check_length(self, num_tokens: int) -> None: ...

    def match(self, prompt_ids: list[int], salt: str = "") -> PrefixMatch: ...

    def release(self, entry) -> None: ...

    def forward_chunk(self, cache, input_ids: torch.Tensor, first_position: int) -> torch.Tensor: ...

    def store_blocks(self, found: PrefixMatch, prompt_ids: list[int], cache, chunk_start: int,
                     chunk_end: int) -> None: ...

    def store_end(self, found: PrefixMatch, prompt_ids: list[int], cache, logits: torch.Tensor) -> None: ...

    def count(self, num_tokens: int, cached_tokens: int, *, whole: bool, partial: int = 0) -> None: ...


class Reading:
    """A prompt being read (module docstring). ``owner``: the prefix cache; ``prompt_ids``: the
    prompt; ``reuse``: restore and store (else read in the same chunks, nothing looked up or stored);
    ``salt``: the chain's namespace; ``into``: where the states go, for caches that read into given
    rows (:class:`~pckernels.prefix.base.PromptRows`; None: a cache of the reading's own)."""

    def __init__(self, owner: Owner, prompt_ids: list[int], *, reuse: bool = True, salt: str = "",
                 into: PromptRows | None = None) -> None:
        owner.check_length(len(prompt_ids))
        self.owner = owner
        self.prompt_ids = list(prompt_ids)
        self.num_tokens = len(prompt_ids)
        self.ids = to_device(torch.tensor([prompt_ids], dtype=torch.long), owner.device)
        self.use_store = reuse and owner.refusal is None
        self.chunk = owner.chunk_size if owner.refusal is None else self.num_tokens
        self.mode = "prefix" if self.use_store else "uncached"
        self.logits: torch.Tensor | None = None
        """``[vocab]`` logits of the prompt's last token, once it is read."""
        self.found: PrefixMatch | None = owner.match(prompt_ids, salt) if self.use_store else None
        self._closed = False
        try:
            self.cache = owner.states.new_cache(into)
            found = self.found
            if found is not None and (found.chain or found.partial is not None):
                pieces = [entry.kv for entry in found.chain]
                if found.partial is not None:
                    pieces.append(head_kv(found.partial.kv, found.partial_tokens))
                with torch.no_grad():
                    owner.states.restore(self.cache, pieces, found.chain[-1].states if found.chain else None,
                                         placed=into.placed if into is not None else 0)
            if found is not None and found.end is not None:
                self.logits = found.end.final_logits.clone()
                self.position = self.num_tokens
                self.cached_tokens = self.num_tokens
            else:
                self.position = self.cached_tokens = found.cached_tokens if found is not None else 0
        except BaseException:
            self.close()
            raise

    @property
    def done(self) -> bool:
        """Whether the whole prompt is read (:attr:`logits` set)."""
        return self.logits is not None

    @property
    def left(self) -> int:
        """Prompt tokens still to read."""
        return 0 if self.done else self.num_tokens - self.position

    def advance(self, tokens: int | None = None) -> bool:
        """Read chunks until at least ``tokens`` more prompt tokens are read (``None``: to the end);
        returns :attr:`done`."""
        owner = self.owner
        read = 0
        with torch.no_grad():
            while not self.done and (tokens is None or read < tokens):
                start = self.position
                end = min(start + self.chunk, self.num_tokens)
                logits = owner.forward_chunk(self.cache, self.ids[:, start:end], start)
                if self.use_store:
                    owner.store_blocks(self.found, self.prompt_ids, self.cache, start, end)
                self.position = end
                read += end - start
                if end == self.num_tokens:
                    if self.use_store:
                        owner.store_end(self.found, self.prompt_ids, self.cache, logits)
                    self.logits = logits
        return self.done

    def close(self) -> None:
        """Let go of the stored entries this reading holds; a finished reading is counted in the
        owner's statistics. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self.found is not None:
            self.owner.release(self.found.held)
            self.owner.release(self.found.partial)
            if self.done:
                self.owner.count(self.num_tokens, self.cached_tokens, whole=self.found.end is not None,
                                 partial=self.found.partial_tokens)

    def prefill(self) -> Prefill:
        """The finished reading as a :class:`~pckernels.prefix.base.Prefill`."""
        found = self.found
        exact = self.num_tokens if found is None or found.foreign is None else found.foreign
        return Prefill(self.logits, self.cache, self.cached_tokens, self.mode, exact)
