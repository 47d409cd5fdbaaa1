"""Placing requests in the KV arena: module blocks once and shared, own rows, plain prompts' prefills.

A PML request's module blocks are placed in the :class:`~pckernels.engine.arena.KVArena` once
(from the store; a moved block re-rotated on the way by one gather-rotate) and shared read-only by
every request that imports them; the request gets the rows of its blocks it may see and rows of
its own for its new and decoded tokens. A plain prompt is read exactly through the engine's
prefix cache straight into one contiguous run of its own rows (``pckernels.engine.prefix_rows``):
its stored prefix restored at admission, the rest a few chunks per step (the arena runner), so its
decoding joins the batch with nothing moved.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from collections.abc import Callable, Hashable

import torch

from pckernels import ops
from pckernels.engine.arena import KVArena, ResidentBlock, row_ranges
from pckernels.engine.context import EngineContext
from pckernels.engine.graphs import stage
from pckernels.engine.plan import BlockRef
from pckernels.engine.request import Request, RequestHandle
from pckernels.engine.running import ArenaRequest, SharedRows, admitted_rows, own_rows
from pckernels.generation import TokenChoice
from pckernels.pml.model import Schema
from pckernels.prefix.base import BasePrefixCache, PromptRows


class Placer:
    """Places requests and blocks in ``arena`` (module docstring). ``prefix()`` gives the engine's
    prefix cache (made on first use); ``counters``: the scheduler's."""

    def __init__(self, ctx: EngineContext, arena: KVArena, prefix: Callable[[], BasePrefixCache],
                 counters: collections.Counter) -> None:
        self.ctx = ctx
        self.arena = arena
        self.prefix = prefix
        self.counters = counters

    def added_rows(self, request: Request) -> int:
        """Rows admitting ``request`` adds to what running requests hold: its own, and those of
        its blocks no running request holds."""
        rows = admitted_rows(request)
        if request.plan is not None:
            for ref in request.plan.blocks:
                block = self.arena.block(self.ctx.blocks.arena_key(request.schema, ref))
                if block is None or block.refs == 0:
                    rows += ref.n_rows
        return rows

    def start(self, handle: RequestHandle, choice: TokenChoice) -> tuple[ArenaRequest, torch.Tensor | None]:
        """``handle``'s request placed in the arena; with the logits ``[vocab]`` of its prompt's
        last token when the prompt is already read (plain prompts), else None."""
        if handle.request.prefix is not None:
            return self._start_prefix(handle, choice)
        return self._start_pml(handle, choice), None

    def _start_pml(self, handle: RequestHandle, choice: TokenChoice) -> ArenaRequest:
        request = handle.request
        plan = request.plan
        device = self.ctx.device
        active = ArenaRequest(handle, choice, cached_tokens=plan.cached_tokens, computed_tokens=len(plan.new_tokens),
                              mode=request.mode, new_tokens=list(plan.new_tokens),
                              new_positions=list(plan.new_positions), live=plan.live)
        pending: list[_Pending] = []
        try:
            visible: list[torch.Tensor] = []
            top = -1
            for ref in plan.blocks:
                if ref.n_rows == 0:
                    continue
                key = self.ctx.blocks.arena_key(request.schema, ref)
                block = self.arena.block(key)
                if block is None:
                    pending.append(self._prepare(request.schema, ref, key))
                    block = pending[-1].block
                self.arena.acquire(block)
                active.block_keys.append(key)
                if ref.hidden:  # chosen on the host: a boolean index would wait for the device on CUDA
                    hidden = set(ref.hidden)
                    shown = [row for index, row in enumerate(block.rows) if index not in hidden]
                    visible.append(stage(shown, torch.long, block.index.device))
                    top = max(top, max(shown, default=-1))
                else:
                    visible.append(block.index)
                    top = max(top, max(block.rows, default=-1))
            active.block_rows = torch.cat(visible) if visible else torch.zeros(0, dtype=torch.long, device=device)
            active.max_row = top
            active.rows = self.arena.allocate(own_rows(request))
            self._copy(pending)
        except BaseException:
            self.release(active)
            for entry in pending:  # rows never filled: no later request may find them resident
                self.arena.forget_block(entry.block.key)
            raise
        self.ctx.blocks.prefetch_siblings(request.schema, [ref.module for ref in plan.blocks])
        active.next_pos = max(request.positions) + 1
        active.own_visible = torch.zeros(0, dtype=torch.long, device=device)
        return active

    def place(self, schema: Schema, ref: BlockRef, key: Hashable) -> ResidentBlock:
        """Copy one module block ``[L, 2, H, n, D]`` from the store (encoding it if no tier holds it)
        into new rows (:meth:`_prepare` and :meth:`_copy` for one block)."""
        entry = self._prepare(schema, ref, key)
        try:
            self._copy([entry])
        except BaseException:
            self.arena.forget_block(key)
            raise
        return entry.block

    def _prepare(self, schema: Schema, ref: BlockRef, key: Hashable) -> "_Pending":
        """A block to place: fetched from the store (or encoded), given new rows in the arena, and its
        copy planned — table entries ``(src, dst, n, delta)`` per run of rows: a moved block's
        own-token runs (``ref.shifts``: ``(first, stop, delta)``) get their new positions and, for
        RoPE keys, a turn by ``R(delta)`` on the way. Nothing is copied yet (:meth:`_copy`)."""
        blocks = self.ctx.blocks
        tensor = blocks.fetch_block(schema, ref.module, ref.scaffold, ref.geometry)
        positions = blocks.block_positions(schema, ref.module, ref.scaffold, ref.geometry)
        block = self.arena.add_block(key, ref.n_rows)
        shifts = ref.shifts or ((0, ref.n_rows, 0),)
        runs = []
        src = 0
        for start, stop in row_ranges(block.rows):
            for first, last, shift in shifts:
                a, b = max(first, src), min(last, src + stop - start)
                if a < b:
                    runs.append((a, start + a - src, b - a, shift))
            src += stop - start
        if ref.shifts:
            delta = torch.repeat_interleave(torch.tensor([s for _, _, s in shifts], dtype=torch.long),
                                            torch.tensor([b - a for a, b, _ in shifts], dtype=torch.long))
            positions = positions + delta.to(positions.device)
        return _Pending(block, tensor, runs, positions, bool(ref.shifts))

    def _copy(self, pending: list["_Pending"]) -> None:
        """Copy every pending block into its rows: one gather-rotate for all moved blocks (RoPE keys)
        and one gather-concat for the rest — a launch per kind, not per block — then their rows'
        positions in one write."""
        if not pending:
            return
        rotation = self.ctx.blocks.key_rotation() if any(p.moved for p in pending) else None
        rope = rotation is not None and rotation.kind == "rope"
        plain: tuple[list, list] = ([], [])
        turned: tuple[list, list] = ([], [])
        for entry in pending:
            tensors, table = turned if entry.moved and rope else plain
            index = len(tensors)
            tensors.append(entry.tensor)
            table.extend((index, *run) for run in entry.runs)
        if plain[1]:
            ops.gather_concat(self.arena.data, plain[0], torch.tensor(plain[1], dtype=torch.int64)[:, :4].contiguous())
        if turned[1]:
            ops.gather_rotate(self.arena.data, turned[0], torch.tensor(turned[1], dtype=torch.int64), rotation.inv_freq)
        index = torch.cat([entry.block.index for entry in pending])
        self.arena.row_pos[index] = torch.cat([entry.positions for entry in pending])
        self.counters["blocks_placed"] += len(pending)
        self.counters["blocks_moved"] += sum(entry.moved for entry in pending)

    def _start_prefix(self, handle: RequestHandle, choice: TokenChoice) -> tuple[ArenaRequest, torch.Tensor | None]:
        """Begin reading a plain prompt through the prefix cache straight into a contiguous run of
        its own rows: its rows reserved and the longest stored prefix restored there now (cheap),
        the rest read by later steps (:meth:`read` when done). When free rows still hold the
        prompt's leading blocks from an earlier request (:meth:`KVArena.remember_prefix`), the run
        starts there and those blocks are not copied again. With the logits ``[vocab]`` of its last
        token when the whole prompt was stored (an exact repeat), else None."""
        request = handle.request
        ids = request.prefix.token_ids
        n = len(ids)
        prefix = self.prefix()
        keys = prefix.chain_keys(ids, request.prefix.salt) if request.prefix.reuse else []
        start, blocks = self.arena.prefix_run(keys)
        run = self.arena.allocate_at(start, n) if blocks else None
        placed = blocks * prefix.block_size if run is not None else 0
        if run is None:
            run = self.arena.allocate_run(n)
        rest = self.arena.allocate(own_rows(request) - n) if run is not None else None
        own = (run + rest) if run is not None else self.arena.allocate(own_rows(request))
        arena = self.arena
        into = PromptRows(lambda: arena.data[:, :, :, run[0]:run[0] + n], placed) if run else None
        try:
            reading = prefix.begin(ids, reuse=request.prefix.reuse, salt=request.prefix.salt, into=into)
        except BaseException:
            self.arena.release(own)
            raise
        if placed:
            self.counters["prefix_tokens_in_place"] += placed
        active = ArenaRequest(handle, choice, mode=reading.mode, rows=own, new_tokens=list(ids),
                              new_positions=list(range(n)), reading=reading, prompt_run=run or None,
                              prompt_keys=keys or None)
        active.block_rows = torch.zeros(0, dtype=torch.long, device=self.ctx.device)
        active.own_visible = torch.zeros(0, dtype=torch.long, device=self.ctx.device)
        if reading.done:
            return active, self.read(active)
        return active, None

    def read(self, active: ArenaRequest) -> torch.Tensor:
        """``active``'s plain prompt is read: it decodes on in the rows after it (a prompt read into
        a private buffer is moved there in one copy first); the logits ``[vocab]`` of its last token."""
        reading, active.reading = active.reading, None
        reading.close()
        prefill = reading.prefill()
        n = reading.num_tokens
        device = self.ctx.device
        active.cached_tokens = prefill.cached_tokens
        active.computed_tokens = n - prefill.cached_tokens
        run, active.prompt_run = active.prompt_run, None
        if run:
            prefix = self.prefix()
            exact = prefill.exact_tokens if prefill.exact_tokens is not None else n
            keys = active.prompt_keys or prefix.chain_keys(active.new_tokens, active.request.prefix.salt)
            active.prefix_blocks = (keys[:exact // prefix.block_size], run[0], prefix.block_size)
        rows = stage(active.rows[:n], torch.long, device)
        if run is None and n:
            self.counters["prefix_rows_moved"] += 1
            self.arena.data.index_copy_(3, rows, prefill.cache.buffer.data[:, :, :, :n])
        self.arena.row_pos[rows] = torch.arange(n, device=device)
        active.max_row = max(active.rows[:n]) if n else -1
        active.prefilled = n
        active.own_visible = rows
        active.next_pos = n
        return prefill.logits

    def fork(self, lead: ArenaRequest, handle: RequestHandle, choice: TokenChoice) -> ArenaRequest:
        """Another answer of ``lead``'s request, starting where its prompt was just read: it reads the
        lead's module blocks and prompt rows (shared, freed with the last of them) and decodes
        into rows of its own."""
        if lead.shared is None:
            lead.shared = SharedRows(lead.rows[:len(lead.new_tokens)])
        lead.shared.refs += 1
        for key in lead.block_keys:
            self.arena.acquire(self.arena.block(key))
        device = self.ctx.device
        return ArenaRequest(handle, choice, cached_tokens=lead.cached_tokens, computed_tokens=0, mode=lead.mode,
                            rows=self.arena.allocate(handle.request.params.max_new_tokens - 1),
                            block_keys=list(lead.block_keys), block_rows=torch.cat([lead.block_rows, lead.own_visible]),
                            own_visible=torch.zeros(0, dtype=torch.long, device=device), max_row=lead.max_row,
                            next_pos=lead.next_pos, shared=lead.shared)

    def release(self, active: ArenaRequest) -> None:
        """Give back ``active``'s blocks and rows (a plain prompt's run is remembered, so a later
        request reading the same blocks may take those rows as they are); prompt rows shared with
        other answers go with the last of them."""
        for key in active.block_keys:
            self.arena.release_block(key)
        active.block_keys = []
        if active.reading is not None:  # stopped while its prompt was read: nothing is remembered
            active.reading.close()
            active.reading = None
        if active.prefix_blocks is not None:
            self.arena.remember_prefix(*active.prefix_blocks)
            active.prefix_blocks = None
        shared = active.shared
        if shared is not None:
            active.shared = None
            kept = set(shared.rows)
            active.rows = [row for row in active.rows if row not in kept]
            shared.refs -= 1
            if shared.refs == 0:
                self.arena.release(shared.rows)
        if active.rows:
            self.arena.release(active.rows)
            active.rows = []


@dataclass
class _Pending:
    """A block given rows but not yet copied (:meth:`Placer._prepare`): the store's ``tensor``
    ``[L, 2, H, n, D]``, its ``runs`` ``(src, dst, n, delta)``, its rows' ``positions``, and whether
    it ``moved``."""

    block: ResidentBlock
    tensor: torch.Tensor
    runs: list[tuple[int, int, int, int]]
    positions: torch.Tensor
    moved: bool
