"""What the scheduler asks of the part of the engine that runs the model: a runner.

The scheduler admits requests, keeps the loop and chooses tokens; a :class:`Runner` keeps the
requests' states and runs the steps. Two exist: the arena runner
(:mod:`~pckernels.engine.arena_runner`) for attention-only models — every request's keys and values
in one shared KV arena, module blocks placed once, one packed forward per step — and the hybrid
runner (:mod:`~pckernels.engine.hybrid`) for models with recurrent layers — prompts read alone in
fixed chunks through the prefix cache, decoding batched with a row per request.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pckernels.engine.request import Request, RequestHandle
from pckernels.engine.running import Running
from pckernels.generation import TokenChoice


@dataclass
class StepOutput:
    """One request's logits from a step: ``tokens`` it forwarded as its decode item (its pending
    token, then a draft; ``logits [len(tokens), vocab]``), or ``None`` when the step read the end of
    its prompt (``logits [vocab]``: its first token's)."""

    active: Running
    logits: torch.Tensor
    tokens: list[int] | None = None


@dataclass
class StepResult:
    """What a step did: ``outputs`` to choose from; ``items``: requests it served (its batch size);
    ``failed``: requests whose forward raised ``error`` (the scheduler fails them, the others go on)."""

    outputs: list[StepOutput] = field(default_factory=list)
    items: int = 0
    failed: list[Running] = field(default_factory=list)
    error: BaseException | None = None


class Runner(Protocol):
    """The model side of a scheduler (module docstring). ``counters``: what it counts; the
    scheduler adds its own to them."""

    counters: collections.Counter

    def too_large(self, request: Request) -> BaseException | None:
        """The error when ``request`` could never run within the budget, else None."""

    def fits(self, request: Request) -> bool:
        """Whether admitting ``request`` now keeps what running requests hold within the budget."""

    def start(self, handle: RequestHandle, choice: TokenChoice) -> tuple[Running, torch.Tensor | None]:
        """``handle``'s request made a running one; with its first token's logits ``[vocab]`` when
        its prompt is already read, else None (a step will read it)."""

    def fork(self, lead: Running, handle: RequestHandle, choice: TokenChoice) -> Running:
        """Another answer of ``lead``'s request (``n > 1``), from the states ``lead``'s prompt was
        just read into; ``handle`` is its handle."""

    def admitted(self, active: Running) -> None:
        """``active`` joined the running requests (its first token did not end it)."""

    def step(self, running: list[Running], step_tokens: int,
             drafts: Callable[[Running], list[int]]) -> StepResult | None:
        """One step over ``running`` (in arrival order), reading up to ``step_tokens`` prompt tokens;
        ``drafts(active)`` gives a decode item's draft. None when there was nothing to do."""

    def settle(self, active: Running, forwarded: int, consumed: int) -> None:
        """After verification: ``active`` forwarded ``forwarded`` tokens in its decode item and keeps
        ``consumed`` of them; leave no trace of the others."""

    def release(self, active: Running) -> None:
        """Give back everything ``active`` holds (it finished, failed or was cancelled)."""

    def stats(self) -> dict:
        """The runner's state for ``PromptCache.stats()["engine"]``."""
