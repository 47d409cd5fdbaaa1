"""The runner of attention-only models: one KV arena, module blocks placed once, packed steps.

Every running request's keys and values live in rows of one
:class:`~pckernels.engine.arena.KVArena`: module blocks once and shared, each request's own rows
for its new and decoded tokens (:mod:`~pckernels.engine.placement`). A step packs every request's
tokens into one forward with a per-request mask (:mod:`~pckernels.engine.step`) — with bucketed
static shapes, captured as a CUDA graph on CUDA (:mod:`~pckernels.engine.graphs`) — and reads the
logits of all its requests back once (``graphs.readout``); a rejected draft's rows need nothing
undone, their positions hide them.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch

from pckernels.engine import graphs
from pckernels.engine.arena import KVArena
from pckernels.engine.buffer import BufferCache
from pckernels.engine.context import EngineContext
from pckernels.engine.graphs import StaticStep, StepGraphs
from pckernels.engine.placement import Placer
from pckernels.engine.request import Request, RequestHandle
from pckernels.engine.runner import Emit, PromptBudget, StepOutput, StepResult, read_prompt
from pckernels.engine.running import ArenaRequest, admitted_rows
from pckernels.engine.step import StepPlan, plan_step
from pckernels.errors import RequestTooLargeError
from pckernels.generation import TokenChoice
from pckernels.prefix.base import BasePrefixCache


class ArenaRunner:
    """Runs the requests of an attention-only model in one arena of ``max_bytes`` (module docstring).
    ``prefix()``: the engine's prefix cache. ``counters``: what placement and steps count (the
    scheduler's counters too)."""

    def __init__(self, ctx: EngineContext, prefix: Callable[[], BasePrefixCache], *, max_bytes: int,
                 step_graphs: StepGraphs | str | None = None) -> None:
        self.ctx = ctx
        self.graphs = StepGraphs.of(step_graphs)
        self.graph_mode = self.graphs.resolved(torch.device(ctx.device))
        """``off``, ``static`` or ``captured`` (:class:`~pckernels.engine.graphs.StepGraphs`)."""
        self.static: StaticStep | None = None
        self.counters: collections.Counter = collections.Counter()
        self.arena = KVArena(ctx.layout, dtype=ctx.dtype, device=ctx.device, max_bytes=max_bytes)
        self.cache = BufferCache(self.arena)
        self.placer = Placer(ctx, self.arena, prefix, self.counters)
        self.peak = {"rows": 0, "module_rows": 0, "private_module_rows": 0}
        """KV rows in use at the busiest moment since the last ``reset_peak``: all referenced rows,
        the rows of the distinct modules running requests share, and what private copies of those
        modules per request would have taken."""

    def too_large(self, request: Request) -> BaseException | None:
        alone = admitted_rows(request) + sum(b.n_rows for b in (request.plan.blocks if request.plan else ()))
        if alone > self.arena.max_rows:
            return RequestTooLargeError(alone, self.arena.max_rows, self.arena.bytes_per_row)
        return None

    def fits(self, request: Request) -> bool:
        return self.arena.referenced_rows() + self.placer.added_rows(request) <= self.arena.max_rows

    def start(self, handle: RequestHandle, choice: TokenChoice) -> tuple[ArenaRequest, torch.Tensor | None]:
        active, logits = self.placer.start(handle, choice)
        return active, None if logits is None else graphs.readout(logits)

    def _static(self) -> StaticStep | None:
        """The static-shape step (``graph_mode`` other than ``off``), made on first use with a
        scratch row of its own for padded queries; None when off, or when no row is left for it
        (the step then runs with dynamic shapes)."""
        if self.graph_mode == "off":
            return None
        if self.static is None:
            try:
                scratch = self.arena.allocate(1)[0]
            except MemoryError:
                return None
            self.static = StaticStep(self.arena, self.ctx.dtype, torch.device(self.ctx.device), scratch,
                                     self.graphs, capture=False)
        self.static.capture = self.graph_mode == "captured"  # the mode may change between steps
        return self.static

    def fork(self, lead: ArenaRequest, handle: RequestHandle, choice: TokenChoice) -> ArenaRequest:
        return self.placer.fork(lead, handle, choice)

    def admitted(self, active: ArenaRequest) -> None:
        """Note the arena's busiest moment (``peak``)."""
        rows = self.arena.referenced_rows()
        if rows > self.peak["rows"]:
            shared = sum(len(b.rows) for b in self.arena.blocks.values() if b.refs > 0)
            private = sum(len(b.rows) * b.refs for b in self.arena.blocks.values() if b.refs > 0)
            self.peak = {"rows": rows, "module_rows": shared, "private_module_rows": private}

    def step(self, running: list[ArenaRequest], step_tokens: int,
             drafts: Callable[[ArenaRequest], list[int]], emit: Emit) -> StepResult | None:
        """One packed forward over the decode items and PML prompt pieces (their outputs emitted
        after it), then the plain prompts' chunks, each read alone into its rows as a cold read does
        and its first-token logits emitted as soon as its prompt is read (``Runner.step``)."""
        items, reads = plan_step(running, PromptBudget(step_tokens), drafts)
        if not items and not reads:
            return None
        result = StepResult(items=len(items) + len(reads))
        if items:
            try:
                plan = StepPlan.build(items, self.arena, self.ctx.dtype, self.ctx.device, self._static(),
                                      rows=self.ctx.adapter.attention_backend != "dense")
                logits = graphs.readout(plan.run(self.ctx.adapter, self.cache))
            except Exception as exc:  # the step's requests fail, the others go on
                result.failed.extend(item.active for item in items)
                result.error = exc
            else:
                for item in items:
                    if not item.decode:
                        item.active.prefilled += len(item.tokens)
                for item, item_logits in plan.outputs(logits):
                    result.emitted += 1
                    emit(StepOutput(item.active, item_logits, item.tokens if item.decode else None))
        for active, tokens in reads:
            try:
                self.counters["prompt_tokens_read"] += read_prompt(active, tokens)
                self.counters["prompt_reads"] += 1
                logits = graphs.readout(self.placer.read(active)) if active.reading.done else None
            except Exception as exc:  # this request fails, the others go on
                result.failed.append(active)
                result.error = exc
                continue
            if logits is not None:
                result.emitted += 1
                emit(StepOutput(active, logits))
        return result

    def settle(self, active: ArenaRequest, forwarded: int, consumed: int) -> None:
        """Nothing to undo: a rejected draft's rows are after every query until overwritten."""

    def release(self, active: ArenaRequest) -> None:
        self.placer.release(active)

    def reset_peak(self) -> None:
        self.peak = {"rows": 0, "module_rows": 0, "private_module_rows": 0}

    def stats(self) -> dict:
        arena = self.arena
        blocks = list(arena.blocks.values())
        free = arena.allocator.free_rows
        capacity = arena.capacity
        idle = sum(len(b.rows) for b in blocks if b.refs == 0)
        return {"arena": {"capacity_rows": capacity, "max_rows": arena.max_rows, "used_rows": capacity - free,
                          "referenced_rows": capacity - free - idle, "bytes_per_row": arena.bytes_per_row,
                          "bytes": capacity * arena.bytes_per_row, "resident_blocks": len(blocks),
                          "shared_blocks": sum(1 for b in blocks if b.refs > 1), "growths": arena.growths}}
