"""One step of the scheduler as a plan, then its run (flashinfer's plan/run habit).

:func:`plan_step` chooses what the step computes: one decode item per request past its prompt
(its pending token and any draft) and, within the step's prompt budget (``step_tokens``,
:class:`~pckernels.engine.runner.PromptBudget`), the next piece of each prompt still being read
(chunked prefill) — a PML prompt's piece goes into the packed forward, a plain prompt's chunks are
read by the arena runner alone through its reading, exactly as a cold read does them. :meth:`StepPlan.build` packs the items into one input with their
positions and arena rows, writes the rows' positions, makes the rows written by the step visible
to their requests, and builds the mask: each query sees, by schema position, its own request's
visible rows only — its modules' rows and its own — never another request's; reference-mode
requests bring the oracle's explicit mask. :meth:`StepPlan.run` is the forward; it returns the
logits of the tokens that choose a next token, which :meth:`StepPlan.outputs` hands back per item.
Given a :class:`~pckernels.engine.graphs.StaticStep`, a step within its buckets is built into its
static buffers, padded, and run by it (captured on CUDA). Inputs reach the device without a host
wait (:func:`~pckernels.engine.graphs.stage`); sizes come from host lists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from pckernels.engine.arena import KVArena
from pckernels.engine.buffer import BufferCache
from pckernels.engine.graphs import StaticStep, dynamic_forward, stage
from pckernels.engine.runner import PromptBudget
from pckernels.engine.running import ArenaRequest
from pckernels.integration.adapters import ModelAdapter
from pckernels.integration.attention import AttentionSpec
from pckernels.integration.row_attention import RowMask

NEG_INF = float("-inf")


@dataclass
class StepItem:
    """One request's share of a step: ``tokens`` at ``positions`` into arena ``rows``, from
    ``offset`` in the packed input; ``decode``: its pending token (and a draft), else a piece of
    its prompt (``last_of_prompt``: the piece that ends it)."""

    active: ArenaRequest
    tokens: list[int]
    positions: list[int]
    rows: list[int]
    offset: int
    decode: bool
    last_of_prompt: bool


def plan_step(running: list[ArenaRequest], budget: PromptBudget,
              drafts: Callable[[ArenaRequest], list[int]]) -> tuple[list[StepItem], list[tuple[ArenaRequest, int]]]:
    """The work of the next step: the packed forward's items — a decode item per request past its
    prompt, then pieces of PML prompts — and the plain prompts' reads ``(request, tokens)``, the
    prompts sharing ``budget`` in arrival order (a PML prompt with an explicit mask is read whole,
    in a step of its own if it must; a plain prompt in whole chunks of its reading)."""
    items: list[StepItem] = []
    reads: list[tuple[ArenaRequest, int]] = []
    offset = 0
    for active in running:
        if not active.in_prompt and active.pending is not None:
            tokens = [active.pending] + drafts(active)
            first = len(active.new_tokens) + active.decoded_rows
            items.append(StepItem(active, tokens, list(range(active.next_pos, active.next_pos + len(tokens))),
                                  active.rows[first:first + len(tokens)], offset, True, False))
            offset += len(tokens)
    for active in running:
        if not active.in_prompt:
            continue
        if active.reading is not None:
            count = budget.take(active.reading.left, active.reading.chunk)
            if count:
                reads.append((active, count))
            continue
        left = len(active.new_tokens) - active.prefilled
        whole = active.live is not None  # an explicit prefill mask needs every token in one forward
        count = budget.take(left, left if whole else 1)
        if count <= 0:
            continue
        first = active.prefilled
        items.append(StepItem(active, active.new_tokens[first:first + count],
                              active.new_positions[first:first + count], active.rows[first:first + count],
                              offset, False, first + count == len(active.new_tokens)))
        offset += count
    return items, reads


@dataclass
class StepPlan:
    """A built step: ``ids [1, Q]`` at ``positions [Q]`` into arena ``rows [Q]``, attention over
    rows ``0 .. extent - 1`` as ``spec`` says; ``keep [k]``: the packed indices whose logits are
    wanted, those of ``wanted`` items in order (a decode item's every token, a prompt's last)."""

    items: list[StepItem]
    ids: torch.Tensor
    positions: torch.Tensor
    rows: torch.Tensor
    extent: int
    spec: AttentionSpec
    keep: torch.Tensor
    wanted: list[StepItem]

    static: StaticStep | None = None
    """The static-shape step whose buffers hold this step's inputs (None: dynamic shapes);
    ``ids``, ``positions``, ``rows``, ``keep`` and ``spec`` are then its padded views."""
    count: int = 0
    """Logits ``run`` returns: ``len(keep)`` before padding."""

    @classmethod
    def build(cls, items: list[StepItem], arena: KVArena, dtype: torch.dtype, device: torch.device,
              static: StaticStep | None = None, rows: bool = False) -> "StepPlan":
        """Pack ``items`` (module docstring). Writes the rows' positions into ``arena.row_pos`` and
        the step's visible rows into each request: the step's keys are the rows as they will be.
        With ``static`` (and a step within its buckets) the inputs go to its buffers, padded.
        With ``rows`` the spec also carries the mask by rows (:func:`row_mask`; not for a step
        with an oracle's explicit mask) for the row-attention backends.
        Sizes come from host lists; device tensors are only written (no host wait on CUDA)."""
        ids_list = [t for item in items for t in item.tokens]
        pos_list = [p for item in items for p in item.positions]
        row_list = [r for item in items for r in item.rows]
        wanted = [item for item in items if item.decode or item.last_of_prompt]
        keep_list = [row for item in wanted
                     for row in (range(item.offset, item.offset + len(item.tokens)) if item.decode
                                 else (item.offset + len(item.tokens) - 1,))]
        q = len(ids_list)
        extent = 1 + max(max(max(item.rows), item.active.max_row) for item in items)
        if static is not None and static.fits(q, extent):
            ids, positions, row_tensor, keep, bias = static.load(ids_list, pos_list, row_list, keep_list, extent)
            width = bias.shape[1]
        else:
            static = None
            ids = stage([ids_list], torch.long, device)
            positions = stage(pos_list, torch.long, device)
            row_tensor = stage(row_list, torch.long, device)
            keep = stage(keep_list, torch.long, device)
            width = extent
        arena.row_pos[row_tensor[:q]] = positions[:q]
        for item in items:
            _make_visible(item, device)
        key_pos = arena.row_pos[:width]
        allowed = _allowed(items, key_pos, positions[:q], width, device)
        if static is None:
            bias = torch.full(allowed.shape, NEG_INF, dtype=dtype, device=device)
            bias.masked_fill_(allowed, 0.0)
        else:
            bias[:q].fill_(NEG_INF).masked_fill_(allowed, 0.0)
        by_rows = None
        if rows and all(item.decode or item.active.live is None for item in items):
            by_rows = row_mask(items, key_pos, positions, width, device, static)
        return cls(items, ids, positions, row_tensor, width, AttentionSpec(bias, positions, key_pos, by_rows), keep,
                   wanted, static, len(keep_list))

    def run(self, adapter: ModelAdapter, cache: BufferCache) -> torch.Tensor:
        """The step's forward over the arena (``cache``); logits ``[k, vocab]`` of ``keep``."""
        if self.static is None:
            return dynamic_forward(adapter, cache, self.ids, self.positions, self.rows, self.extent, self.spec,
                                   self.keep)
        logits = self.static.forward(adapter, cache, self.ids, self.positions, self.rows, self.keep,
                                     self.spec.bias, self.spec.key_pos, self.spec.rows)
        return logits[:self.count]

    def outputs(self, logits: torch.Tensor) -> Iterator[tuple[StepItem, torch.Tensor]]:
        """Per wanted item, its logits: ``[len(tokens), vocab]`` for a decode item, ``[vocab]`` for
        the last token of a prompt."""
        index = 0
        for item in self.wanted:
            if item.decode:
                yield item, logits[index:index + len(item.tokens)]
                index += len(item.tokens)
            else:
                yield item, logits[index]
                index += 1


def _make_visible(item: StepItem, device: torch.device) -> None:
    """Own rows written by this step become visible to the request (its live ones)."""
    active = item.active
    if item.decode:
        fresh = item.rows[max(0, active.shown_decoded - active.decoded_rows):]
        active.shown_decoded = max(active.shown_decoded, active.decoded_rows + len(item.rows))
    elif active.live is not None:
        first = active.prefilled
        fresh = [row for row, live in zip(item.rows, active.live[first:first + len(item.rows)]) if live]
    else:
        fresh = item.rows
    if fresh:
        add = stage(fresh, torch.long, device)
        active.own_visible = torch.cat([active.own_visible, add])
        active.max_row = max(active.max_row, max(fresh))


def _allowed(items: list[StepItem], key_pos: torch.Tensor, positions: torch.Tensor, width: int,
             device: torch.device) -> torch.Tensor:
    """``[Q, width]`` booleans: query i may attend row j — its request's visible rows at positions
    up to its own (``key_pos [width]``, ``positions [Q]``), or the oracle's explicit mask."""
    allowed = torch.zeros(len(positions), width, dtype=torch.bool, device=device)
    for item in items:
        active = item.active
        span = slice(item.offset, item.offset + len(item.tokens))
        if not item.decode and active.live is not None:
            own = stage(active.rows[:len(active.new_tokens)], torch.long, device)
            view = torch.zeros(len(item.tokens), width, dtype=torch.bool, device=device)
            view[:, own] = _on(active.request.plan.prefill_mask, device)
            allowed[span] = view
            continue
        visible = torch.zeros(width, dtype=torch.bool, device=device)
        visible[active.block_rows] = True
        visible[active.own_visible] = True
        allowed[span] = visible[None, :] & (key_pos[None, :] <= positions[span, None])
    return allowed


def row_mask(items: list[StepItem], key_pos: torch.Tensor, positions: torch.Tensor, width: int,
             device: torch.device, static: StaticStep | None = None) -> RowMask:
    """The step's mask by rows: a group per item (its request's visible rows, ``seen [G, width]``),
    each query's group, and its rows' range ``0 .. 1 + max(visible row)`` (from host integers).
    Padded queries of a static step (``positions`` longer than the items' tokens) form one more
    group that sees every row; their outputs are never read. In a static step the tensors are
    views of its buffers (:meth:`StaticStep.row_buffers`), so a captured graph reads them."""
    q = sum(len(item.tokens) for item in items)
    total = len(positions)
    groups = [g for g, item in enumerate(items) for _ in item.tokens] + [len(items)] * (total - q)
    stops = [1 + max(max(item.rows), item.active.max_row) for item in items for _ in item.tokens]
    stops += [width] * (total - q)
    if static is None:
        seen = torch.zeros(len(items) + (total > q), width, dtype=torch.bool, device=device)
        info = stage([groups, [0] * total, stops], torch.int32, device)
    else:
        seen, info = static.row_buffers(len(items) + 1, width, [groups, [0] * total, stops])
        seen.zero_()
    for g, item in enumerate(items):
        seen[g, item.active.block_rows] = True
        seen[g, item.active.own_visible] = True
    if total > q:
        seen[len(items)].fill_(True)
    return RowMask(seen, info[0], positions, key_pos, info[1], info[2])


def _on(mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` (pinned and ``non_blocking`` on CUDA)."""
    if mask.device == device:
        return mask
    if device.type == "cuda":
        return mask.pin_memory().to(device, non_blocking=True)
    return mask.to(device)
