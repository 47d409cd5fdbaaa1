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


class PromptBudget:
    """The prompt tokens one step may read: ``step_tokens`` across every request still reading a
    prompt, handed out in arrival order (the fairness rule of ``docs/engine.md``). Both runners,
    and the arena runner's PML prompts and plain prompts alike, take from it the same way.

    A request takes whole pieces of ``unit`` tokens (a plain prompt: its reading's chunk, which must
    be read whole to stay bitwise a cold read's; a PML prompt: 1 token, or all of it when its
    explicit mask needs one forward). The first request of a step always gets one piece, even a
    piece larger than the budget, so every step reads something and no prompt waits forever."""

    def __init__(self, step_tokens: int) -> None:
        self.left = step_tokens
        self.given = 0

    def take(self, left: int, unit: int = 1) -> int:
        """Tokens a request with ``left`` prompt tokens still to read reads in this step (0: none)."""
        if left <= 0:
            return 0
        if left <= self.left:
            count = left
        else:
            count = self.left // unit * unit
            if count == 0 and self.given == 0:
                count = min(unit, left)
        self.left = max(0, self.left - count)
        self.given += count
        return count


def read_prompt(active: Running, tokens: int) -> int:
    """Read ``tokens`` more of ``active``'s prompt (its ``reading``, whole chunks, as
    :meth:`PromptBudget.take` gave), stopping between two chunks once its request is cancelled;
    returns the tokens read."""
    reading = active.reading
    start = reading.position
    while not reading.done and reading.position - start < tokens and not active.handle.cancel_requested:
        reading.advance(1)
    return reading.position - start


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
    """What a step did: ``emitted`` outputs handed to the scheduler while it ran; ``items``:
    requests it served (its batch size); ``failed``: requests whose forward raised ``error`` (the
    scheduler fails them, the others go on)."""

    emitted: int = 0
    items: int = 0
    failed: list[Running] = field(default_factory=list)
    error: BaseException | None = None


Emit = Callable[[StepOutput], None]
"""Where a runner hands each :class:`StepOutput` the moment its logits exist — the decode forward's
outputs after that forward, a prompt's first-token logits right after its last chunk — so the
scheduler chooses (and streams) that token before the step reads the next prompt: a prompt read
earlier in a step does not wait for the later ones (``docs/engine.md``, "Fairness"). ``emit`` may
fork new requests into the scheduler's ``running`` (a runner iterates over its own lists while it
emits); requests it ends are finished — rows given back, results delivered — after the step."""


class Runner(Protocol):
    """The model side of a scheduler (module docstring). ``counters``: what it counts; the
    scheduler adds its own to them."""

    counters: collections.Counter
    peak: dict
    """What the running requests held at the busiest moment since :meth:`reset_peak`."""

    def too_large(self, request: Request) -> BaseException | None:
        """The error when ``request`` could never run within the budget, else None."""

    def fits(self, request: Request) -> bool:
        """Whether admitting ``request`` now keeps what running requests hold within the budget."""

    def start(self, handle: RequestHandle, choice: TokenChoice) -> tuple[Running, torch.Tensor | None]:
        """``handle``'s request made a running one (cheap: a plain prompt's stored prefix is
        restored, the rest is read by later steps); with its first token's logits ``[vocab]`` when
        its prompt is already read (an exact repeat), else None (steps will read it)."""

    def fork(self, lead: Running, handle: RequestHandle, choice: TokenChoice) -> Running:
        """Another answer of ``lead``'s request (``n > 1``), from the states ``lead``'s prompt was
        just read into; ``handle`` is its handle."""

    def admitted(self, active: Running) -> None:
        """``active`` joined the running requests (its first token did not end it)."""

    def step(self, running: list[Running], step_tokens: int,
             drafts: Callable[[Running], list[int]], emit: Emit) -> StepResult | None:
        """One step over ``running`` (in arrival order): every request past its prompt decodes, and
        requests still reading a prompt read what a :class:`PromptBudget` of ``step_tokens`` gives
        them; ``drafts(active)`` gives a decode item's draft; each output goes to ``emit`` as soon as
        it exists (:data:`Emit`). None when there was nothing to do."""

    def settle(self, active: Running, forwarded: int, consumed: int) -> None:
        """After verification: ``active`` forwarded ``forwarded`` tokens in its decode item and keeps
        ``consumed`` of them; leave no trace of the others."""

    def release(self, active: Running) -> None:
        """Give back everything ``active`` holds (it finished, failed or was cancelled)."""

    def reset_peak(self) -> None:
        """Start a new ``peak``: what the runner's requests held at their busiest moment since."""

    def stats(self) -> dict:
        """The runner's state for ``PromptCache.stats()["engine"]``."""
