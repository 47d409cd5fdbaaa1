"""A request while the scheduler runs it: its progress and its token choices, and what its runner
keeps for it (arena rows for attention-only models, :class:`ArenaRequest`; the hybrid runner's in
:mod:`~pckernels.engine.hybrid`).

Everything in a :class:`Running` belongs to one request and is touched by the scheduler thread
only; the caller sees the request through its :class:`~pckernels.engine.request.RequestHandle`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pckernels.engine.lookahead import NgramDrafter
from pckernels.engine.request import Request, RequestHandle
from pckernels.generation import GenerationResult, TokenChoice
from pckernels.prefix.base import PromptReading


def own_rows(request: Request) -> int:
    """Rows a request owns: its new tokens, and every decoded token but the last (never forwarded)."""
    return request.new_tokens + request.params.max_new_tokens - 1


def admitted_rows(request: Request) -> int:
    """Rows admitting a request may come to take: its new tokens once, and the decoded tokens of
    each of its ``n`` answers."""
    return own_rows(request) + (request.n - 1) * (request.params.max_new_tokens - 1)


@dataclass(eq=False)
class SharedRows:
    """A prompt's rows read once and read by ``refs`` answers (``n > 1``): freed with the last."""

    rows: list[int]
    refs: int = 1


@dataclass(eq=False)
class Running:
    """A running request: what every runner tracks (module docstring)."""

    handle: RequestHandle
    choice: TokenChoice
    cached_tokens: int = 0
    computed_tokens: int = 0
    mode: str = "cached"
    decoded_rows: int = 0
    """Decoded tokens forwarded so far."""
    pending: int | None = None
    """The last chosen token, forwarded at ``next_pos`` by the next step."""
    next_pos: int = 0
    drafter: NgramDrafter | None = None
    """Its prompt-lookup drafts (greedy requests of a scheduler with ``lookahead``), made at its first
    decode step."""
    draft_room: int = 0
    """Longest draft its next step may verify: halved when a draft is rejected outright, doubled
    (up to the scheduler's ``lookahead``) when one is taken whole."""
    reading: PromptReading | None = None
    """Its plain prompt's reading through the prefix cache while steps read it (a few chunks each,
    :class:`~pckernels.engine.runner.PromptBudget`); None once read, and for PML prompts."""

    @property
    def request(self) -> Request:
        return self.handle.request

    @property
    def token_ids(self) -> list[int]:
        """The tokens chosen so far."""
        return self.choice.token_ids

    def result(self) -> GenerationResult:
        """The finished request's result."""
        request = self.request
        return self.choice.result(request.prompt_token_ids, request.positions, cached_tokens=self.cached_tokens,
                                  computed_tokens=self.computed_tokens, mode=self.mode)


@dataclass(eq=False)
class ArenaRequest(Running):
    """A running request of an attention-only model: its rows and blocks in the KV arena."""

    rows: list[int] = field(default_factory=list)
    """Own rows: its new tokens' first, then its decoded tokens'."""
    new_tokens: list[int] = field(default_factory=list)
    new_positions: list[int] = field(default_factory=list)
    live: list[bool] | None = None
    """Which new tokens later tokens may see (``None``: all)."""
    block_keys: list = field(default_factory=list)
    """Arena keys of the module blocks it holds."""
    block_rows: torch.Tensor | None = None
    """Rows of its modules it may see ``[k]`` (device, long)."""
    prefilled: int = 0
    """New tokens computed so far (own rows ``0 .. prefilled - 1`` written)."""
    own_visible: torch.Tensor | None = None
    """Own rows later tokens may see ``[m]`` (device, long), kept up to date."""
    max_row: int = -1
    """The highest arena row the request may see (its steps' key extent), kept without device syncs."""
    prefix_blocks: tuple | None = None
    """A plain prompt read into one run of rows: ``(block keys, first row, block size)``, remembered
    by the arena when its rows are freed."""
    shown_decoded: int = 0
    """Decoded-token rows already in ``own_visible`` (a rejected draft's rows stay there, hidden by
    position until the tokens at those positions overwrite them)."""
    shared: SharedRows | None = None
    """The prompt rows it shares with the other answers of its request (``n > 1``)."""
    prompt_run: list[int] | None = None
    """A plain prompt's rows while it is read: the contiguous run its reading writes, or None when
    it is read into a private buffer (moved into ``rows`` when read)."""
    prompt_keys: list[bytes] | None = None
    """A plain prompt's block names (the arena remembers the blocks it read in its run)."""

    @property
    def in_prompt(self) -> bool:
        """Whether its prompt (PML or plain) is still being read."""
        return self.prefilled < len(self.new_tokens)
