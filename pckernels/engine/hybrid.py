"""The runner of models with recurrent layers: prompts read alone in fixed chunks, decoding batched.

A request of a hybrid (attention + recurrent) or purely recurrent model owns, beside its keys
and values, the running states of its recurrent layers; nothing else may touch them. Its prompt is
read alone through the engine's :class:`~pckernels.prefix.PrefixCache` — the longest stored prefix
restored (keys, values and the recurrent snapshot at a chunk boundary), the rest read in the
same fixed chunks a cold read uses, a few chunks per step (``step_tokens``) so other requests keep
decoding and a cancelled request stops between two chunks — so reuse on and off compute the
same bits. Only states created while reading a prompt are stored; a next chat turn re-reads the
answer. Requests past their prompt decode together in one batched forward per step
(:class:`~pckernels.engine.hybrid_batch.HybridBatch`), rebuilt when a request joins or leaves.

Drafts (lookahead) are verified when one request decodes alone: its recurrent states are copied
before the step, and when part of the draft is rejected they are put back and the accepted
tokens read again, so no rejected token leaves a trace. In a batch of several requests the
batch already shares each weight read, and no drafts are made.
"""

from __future__ import annotations

import collections
import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pckernels.engine.context import EngineContext
from pckernels.engine.hybrid_batch import HybridBatch, Source
from pckernels.engine.request import Request, RequestHandle
from pckernels.engine.runner import Emit, PromptBudget, StepOutput, StepResult, read_prompt
from pckernels.engine.running import Running
from pckernels.errors import RequestTooLargeError
from pckernels.generation import TokenChoice
from pckernels.prefix.base import BasePrefixCache
from pckernels.prefix.states import CacheFootprint, CacheStates

log = logging.getLogger(__name__)


@dataclass(eq=False)
class HybridRequest(Running):
    """A running request of a hybrid model: its prompt's reading, then its own cache until it joins
    the batch; ``tokens``: what admission counted it for (prompt and ``max_new_tokens``)."""

    own: object | None = None
    """Its transformers cache (one row) between the end of its reading and joining the batch."""
    tokens: int = 0


class HybridRunner:
    """Runs the requests of a model with recurrent layers (module docstring).

    ``prefix()``: the engine's prefix cache (transformers caches, exact reuse; used through
    ``BasePrefixCache.begin`` only); ``footprint``: the model's cache layout (the decoding batch's
    layer kinds come from it); ``max_bytes``: the budget of running requests' states (the batch
    pads every row to the longest, and admission counts it so).
    """

    arena = None

    def __init__(self, ctx: EngineContext, prefix: Callable[[], BasePrefixCache], footprint: CacheFootprint, *,
                 max_bytes: int) -> None:
        self.ctx = ctx
        self.prefix = prefix
        self.footprint = footprint
        self.states = CacheStates(ctx.adapter.model, kinds=footprint.kinds)
        """How the decoding batch's cache is made and its layers' states read and put."""
        self.max_bytes = max_bytes
        self.counters: collections.Counter = collections.Counter()
        self.peak = {"requests": 0, "bytes": 0}
        """The busiest moment since the last ``reset_peak``: admitted requests' answers (rows of
        the batch they may come to fill) and the bytes admission counted for them."""
        self.budgeted: dict[int, tuple[int, int]] = {}
        """Request id -> (tokens, rows) admission counted for it: rows are its answers not started
        on their own (``n`` until its prompt is read and the others fork off)."""
        self.batch: HybridBatch | None = None
        self.rows: list[HybridRequest] = []
        """The requests of ``batch``, in its row order."""
        self._snapshot: tuple | None = None
        """The batch before a step that verifies a draft (:meth:`settle` goes back to it)."""

    # -- admission ----------------------------------------------------------------------------------

    def _bytes(self, rows: int, tokens: int) -> int:
        return rows * (tokens * self.footprint.kv_bytes_per_token + self.footprint.state_bytes)

    def too_large(self, request: Request) -> BaseException | None:
        tokens = _tokens(request)
        if self._bytes(request.n, tokens) > self.max_bytes:
            per_token = max(1, self.footprint.kv_bytes_per_token)
            return RequestTooLargeError(tokens, max(0, self.max_bytes - self.footprint.state_bytes) // per_token,
                                        per_token)
        return None

    def fits(self, request: Request) -> bool:
        counted = [*self.budgeted.values(), (_tokens(request), request.n)]
        return self._bytes(sum(rows for _, rows in counted), max(tokens for tokens, _ in counted)) <= self.max_bytes

    # -- requests -----------------------------------------------------------------------------------

    def start(self, handle: RequestHandle, choice: TokenChoice) -> tuple[HybridRequest, torch.Tensor | None]:
        """Begin reading the prompt (the stored prefix restored now); an exact repeat is read at once."""
        request = handle.request
        reading = self.prefix().begin(request.prefix.token_ids, reuse=request.prefix.reuse, salt=request.prefix.salt)
        active = HybridRequest(handle, choice, mode=reading.mode, reading=reading, tokens=_tokens(request))
        self.budgeted[request.id] = (active.tokens, request.n)
        if reading.done:
            return active, self._read(active)
        return active, None

    def fork(self, lead: HybridRequest, handle: RequestHandle, choice: TokenChoice) -> HybridRequest:
        """Another answer of ``lead``'s request: a copy of the states its prompt was just read into
        (its recurrent states must be its own)."""
        child = HybridRequest(handle, choice, cached_tokens=lead.cached_tokens, computed_tokens=0, mode=lead.mode,
                              own=copy.deepcopy(lead.own), tokens=lead.tokens, next_pos=lead.next_pos)
        tokens, rows = self.budgeted[lead.request.id]
        self.budgeted[lead.request.id] = (tokens, rows - 1)
        self.budgeted[handle.request.id] = (child.tokens, 1)
        return child

    def admitted(self, active: HybridRequest) -> None:
        """Note the busiest moment (``peak``); admission counted it at :meth:`start`."""
        counted = self.budgeted.values()
        rows = sum(rows for _, rows in counted)
        used = self._bytes(rows, max((tokens for tokens, _ in counted), default=0))
        if used > self.peak["bytes"]:
            self.peak = {"requests": rows, "bytes": used}

    def reset_peak(self) -> None:
        self.peak = {"requests": 0, "bytes": 0}

    def _read(self, active: HybridRequest) -> torch.Tensor:
        """``active``'s prompt is read: keep its cache until it joins the batch; its first logits."""
        reading = active.reading
        reading.close()
        active.reading = None
        active.own = reading.cache
        active.cached_tokens = reading.cached_tokens
        active.computed_tokens = reading.num_tokens - reading.cached_tokens
        active.next_pos = reading.num_tokens
        return reading.logits

    def release(self, active: HybridRequest) -> None:
        if active.reading is not None:
            active.reading.close()
            active.reading = None
        active.own = None
        self.budgeted.pop(active.request.id, None)

    # -- steps --------------------------------------------------------------------------------------

    def step(self, running: list[HybridRequest], step_tokens: int,
             drafts: Callable[[HybridRequest], list[int]], emit: Emit) -> StepResult | None:
        """The decoding requests' batched forward (its outputs emitted after it), then the prompts
        still being read, in their chunks, as far as a :class:`~pckernels.engine.runner.PromptBudget`
        of ``step_tokens`` lets them, each prompt's first-token logits emitted as soon as it is read."""
        result = StepResult()
        running = list(running)  # emit may fork requests into the scheduler's list
        decoding = [a for a in running if a.reading is None and a.pending is not None]
        if decoding:
            self._decode(decoding, drafts, result, emit)
        elif self.batch is not None:
            self.batch, self.rows = None, []
        budget = PromptBudget(step_tokens)
        for active in running:
            reading = active.reading
            if reading is None:
                continue
            tokens = budget.take(reading.left, reading.chunk)
            if not tokens:
                continue
            try:
                read_prompt(active, tokens)
                logits = self._read(active) if reading.done else None
            except Exception as exc:  # this request fails; the others go on
                result.failed.append(active)
                result.error = exc
                continue
            result.items += 1
            self.counters["prompt_chunks"] += 1
            if logits is not None:
                result.emitted += 1
                emit(StepOutput(active, logits))
        if not result.items and not result.failed:
            return None
        return result

    def _decode(self, decoding: list[HybridRequest], drafts: Callable[[HybridRequest], list[int]],
                result: StepResult, emit: Emit) -> None:
        """One batched forward: every decoding request's pending token (and, decoding alone, a draft)."""
        try:
            self._compose(decoding)
            draft = drafts(decoding[0]) if len(decoding) == 1 else []
            tokens = [[active.pending] + draft for active in decoding]
            device = self.ctx.device
            ids = torch.tensor(tokens, dtype=torch.long, device=device)
            positions = torch.tensor([[active.next_pos + i for i in range(len(row))]
                                      for active, row in zip(decoding, tokens)], dtype=torch.long, device=device)
            self._snapshot = self.batch.snapshot() if draft else None
            logits = self.batch.forward(self.ctx.adapter.model, ids, positions)
        except Exception as exc:  # the batch's requests fail, the others go on
            self.batch, self.rows = None, []
            result.failed.extend(decoding)
            result.error = exc
            return
        result.items += len(decoding)
        self.counters["decode_steps"] += 1
        for row, active in enumerate(decoding):
            result.emitted += 1
            emit(StepOutput(active, logits[row], tokens[row]))

    def _compose(self, decoding: list[HybridRequest]) -> None:
        """Make the batch's rows ``decoding``: rebuilt (staying rows copied once) when they changed."""
        if self.batch is not None and self.rows == decoding:
            return
        rows = {id(active): row for row, active in enumerate(self.rows)}
        sources = []
        for active in decoding:
            if id(active) in rows:
                sources.append(self.batch.source(rows[id(active)]))
            else:
                sources.append(Source(active.own, 0, active.next_pos))
        self.batch = HybridBatch(self.states, sources, self.ctx.device)
        self.rows = list(decoding)
        for active in decoding:
            active.own = None
        self.counters["batch_rebuilds"] += 1

    def settle(self, active: HybridRequest, forwarded: int, consumed: int) -> None:
        """A draft was partly rejected (the request decodes alone): its states go back to before the
        step and the ``consumed`` tokens are read again."""
        if consumed == forwarded:
            return
        self.batch.rewind(self._snapshot)
        tokens = active.token_ids[-consumed - 1:-1]
        first = active.next_pos - consumed
        device = self.ctx.device
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        positions = torch.arange(first, first + consumed, device=device)[None]
        self.batch.forward(self.ctx.adapter.model, ids, positions)
        self.counters["draft_rewinds"] += 1

    def stats(self) -> dict:
        return {"hybrid": {"batch_rows": len(self.rows), "admitted": len(self.budgeted),
                           "kv_bytes_per_token": self.footprint.kv_bytes_per_token,
                           "state_bytes": self.footprint.state_bytes, "budget_bytes": self.max_bytes}}


def _tokens(request: Request) -> int:
    """Tokens a request's states may come to hold: its prompt and every token it may generate."""
    return len(request.prefix.token_ids) + request.params.max_new_tokens
