"""The scheduler: one thread owns the model and runs every request in flight in shared forwards.

Callers ``submit`` a :class:`~pckernels.engine.request.Request` (parsed and planned in their own
thread) and get a :class:`~pckernels.engine.request.RequestHandle`. The scheduler thread loops:

1. **sweep** — drop cancelled requests and those past their deadline, freeing their rows;
2. **admit** — waiting requests in arrival order while the KV rows they would add (their own
   rows, and the rows of blocks no running request already holds) fit the budget: their module
   blocks are placed in the :class:`~pckernels.engine.arena.KVArena` once and shared (a block
   five requests import is placed once), their own rows reserved for their new tokens and
   ``max_new_tokens``; plain prompts are prefilled here through the exact prefix cache;
3. **step** — one forward over the packed tokens of every running request: one decode token
   each, plus up to ``step_tokens`` prompt tokens of requests still reading their prompt
   (chunked prefill). No padding: each query attends, by schema position, to its own request's
   visible rows only — its modules' rows (parameter slots and recomputed tokens hidden) and its
   own rows — never another request's. Each request samples its next token from its own logits;
   finished requests free their rows at once and their slots go to waiting requests at the next
   step (continuous batching).

Requests never share mutable state: a request owns its rows, its sampler and its stop checker;
shared blocks are read-only while referenced. The model is used under ``engine.model_lock``,
which encoding (``add_schema``) also takes.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from pckernels import ops
from pckernels.engine.arena import KVArena, _ranges
from pckernels.engine.buffer import BufferCache
from pckernels.engine.lookahead import NgramDrafter
from pckernels.engine.request import Request, RequestHandle
from pckernels.generation import GenerationResult, StopChecker, make_generator, select_token
from pckernels.errors import DeadlineExceeded, EngineBusyError, RequestCancelled, RequestTooLargeError
from pckernels.integration.attention import AttentionSpec

log = logging.getLogger(__name__)

NEG_INF = float("-inf")


@dataclass
class _Active:
    """A running request: everything here belongs to it alone (the scheduler thread's)."""

    handle: RequestHandle
    rows: list[int]
    """Own rows: its new tokens' first, then its decoded tokens'."""
    new_tokens: list[int]
    new_positions: list[int]
    live: list[bool] | None
    block_keys: list = field(default_factory=list)
    block_rows: torch.Tensor | None = None
    """Rows of its modules it may see ``[k]`` (device, long)."""
    prefilled: int = 0
    """New tokens computed so far (own rows ``0 .. prefilled - 1`` written)."""
    decoded_rows: int = 0
    """Decoded tokens forwarded so far (own rows after the new tokens')."""
    pending: int | None = None
    """The last chosen token, forwarded at ``next_pos`` by the next step."""
    next_pos: int = 0
    out_ids: list[int] = field(default_factory=list)
    first_logits: torch.Tensor | None = None
    ttft: float = 0.0
    generator: torch.Generator | None = None
    stopper: StopChecker | None = None
    cached_tokens: int = 0
    computed_tokens: int = 0
    mode: str = "cached"
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
    drafter: NgramDrafter | None = None
    """Its prompt-lookup drafts (greedy requests of a scheduler with ``lookahead``), made at its first
    decode step."""
    draft_room: int = 0
    """Longest draft its next step may verify: halved when a draft is rejected outright, doubled
    (up to the scheduler's ``lookahead``) when one is taken whole."""

    @property
    def request(self) -> Request:
        return self.handle.request

    @property
    def reading(self) -> bool:
        return self.prefilled < len(self.new_tokens)


class _Call:
    """A function to run on the scheduler thread, and what it gave."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the caller
            self.error = exc
        finally:
            self.done.set()


@dataclass
class _Item:
    """One request's share of a step: ``count`` tokens from ``offset`` in the packed input."""

    active: _Active
    tokens: list[int]
    positions: list[int]
    rows: list[int]
    offset: int
    decode: bool
    last_of_prompt: bool


class Scheduler:
    """Runs requests for one engine (see the module docstring).

    ``max_bytes``: the KV arena's budget;
    ``max_queue``: waiting requests before ``submit`` raises ``EngineBusyError``;
    ``max_batch``: running requests at once; ``step_tokens``: prompt tokens read per step;
    ``idle_exit_s``: the thread stops after that long without work and restarts on demand;
    ``lookahead``: draft tokens a greedy request's decode step may verify besides its own
    (prompt lookup, :mod:`pckernels.engine.lookahead`; 0: none).
    """

    def __init__(self, engine, *, max_bytes: int, max_queue: int = 256, max_batch: int = 64,
                 step_tokens: int = 2048, idle_exit_s: float = 5.0, lookahead: int = 0) -> None:
        if max_queue < 1 or max_batch < 1 or step_tokens < 1:
            raise ValueError(f"need max_queue, max_batch and step_tokens >= 1, got {max_queue}, {max_batch}, "
                             f"{step_tokens}")
        self.lookahead = lookahead
        self.engine = engine
        self.arena = KVArena(engine.layout, dtype=engine.dtype, device=engine.device, max_bytes=max_bytes)
        self.cache = BufferCache(self.arena)
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.step_tokens = step_tokens
        self.idle_exit_s = idle_exit_s
        self._cv = threading.Condition()
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._running: list[_Active] = []
        self._calls: collections.deque[_Call] = collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.counters = collections.Counter()
        self.profiler = None
        self.peak = {"rows": 0, "module_rows": 0, "private_module_rows": 0}
        """KV rows in use at the busiest moment since the last ``reset_peak``: all referenced rows,
        the rows of the distinct modules running requests share, and what private copies of those
        modules per request would have taken."""
        """A ``cProfile.Profile`` enabled around the loop's work while set (perf's time breakdown)."""
        self.batch_sizes: collections.Counter = collections.Counter()

    @property
    def lookahead(self) -> int:
        """Draft tokens a greedy request's decode step may verify besides its own (read per step)."""
        return self._lookahead

    @lookahead.setter
    def lookahead(self, value: int) -> None:
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"lookahead must be an int >= 0, got {value!r}")
        self._lookahead = value

    # -- the callers' side ----------------------------------------------------------------------------

    def submit(self, request: Request) -> RequestHandle:
        """Queue ``request``; raises ``RequestTooLargeError`` if it can never fit the KV budget and
        ``EngineBusyError`` if the queue is full (nothing is queued then)."""
        alone = self._own_rows(request) + sum(b.n_rows for b in (request.plan.blocks if request.plan else ()))
        if alone > self.arena.max_rows:
            raise RequestTooLargeError(alone, self.arena.max_rows, self.arena.bytes_per_row)
        handle = RequestHandle(request, wake=self._wake)
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            if len(self._waiting) >= self.max_queue:
                self.counters["busy"] += 1
                raise EngineBusyError(f"{len(self._waiting)} requests are waiting (max_queue={self.max_queue}); "
                                      "retry later")
            self._waiting.append(handle)
            self.counters["submitted"] += 1
            self._ensure_thread()
            self._cv.notify()
        return handle

    def call(self, fn):
        """Run ``fn()`` on the scheduler thread, under the model lock, between two steps, and return
        its result (or raise its exception). Model work from other threads (encoding, scoring) goes
        through here so that one thread runs every parallel op (:mod:`pckernels.engine.threads`).
        Runs ``fn`` directly when called from the scheduler thread itself, or by a thread that holds
        the model lock (the scheduler could not take it)."""
        lock = self.engine.model_lock
        if threading.current_thread() is self._thread or lock._is_owned():
            with lock:
                return fn()
        job = _Call(fn)
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._calls.append(job)
            self._ensure_thread()
            self._cv.notify()
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def _ensure_thread(self) -> None:
        """Start the scheduler thread if it is not running (called with the condition held)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="promptcache-scheduler", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Fail waiting and running requests and stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def stats(self) -> dict:
        """Counters and the arena's state (read from snapshots: safe while the loop runs)."""
        with self._cv:
            waiting, running = len(self._waiting), len(self._running)
        arena = self.arena
        blocks = list(arena.blocks.values())
        free = arena.allocator.free_rows
        capacity = arena.capacity
        idle = sum(len(b.rows) for b in blocks if b.refs == 0)
        return {"waiting": waiting, "running": running, **self.counters,
                "batch_sizes": dict(sorted(self.batch_sizes.items())),
                "arena": {"capacity_rows": capacity, "max_rows": arena.max_rows, "used_rows": capacity - free,
                          "referenced_rows": capacity - free - idle, "bytes_per_row": arena.bytes_per_row,
                          "bytes": capacity * arena.bytes_per_row, "resident_blocks": len(blocks),
                          "shared_blocks": sum(1 for b in blocks if b.refs > 1), "growths": arena.growths}}

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    # -- the loop -------------------------------------------------------------------------------------

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    if not self._wait_for_work():
                        return
                profiler = self.profiler
                if profiler is not None:
                    profiler.enable()
                try:
                    with self.engine.model_lock:
                        with self._cv:
                            job = self._calls.popleft() if self._calls else None
                        if job is not None:
                            job.run()
                        self._sweep()
                        self._admit()
                        if self._running:
                            self._step()
                finally:
                    if profiler is not None:
                        profiler.disable()

    def _wait_for_work(self) -> bool:
        """Block until there is something to do; False when the thread should end (closed, or idle
        for ``idle_exit_s``). Called with the condition held."""
        idle_since = time.monotonic()
        while True:
            if self._closed:
                self._fail_all(RuntimeError("the engine was closed"))
                self._thread = None
                return False
            if self._running or self._calls or any(h.cancel_requested for h in self._waiting):
                return True
            if self._waiting and self._admissible():
                return True
            deadlines = [h.request.deadline for h in self._waiting if h.request.deadline is not None]
            now = time.monotonic()
            if any(d <= now for d in deadlines):
                return True
            if not self._waiting and now - idle_since >= self.idle_exit_s:
                self._thread = None
                return False
            timeout = self.idle_exit_s if not self._waiting else 0.05
            if deadlines:
                timeout = min(timeout, max(0.0, min(deadlines) - now))
            self._cv.wait(timeout)

    def _fail_all(self, error: BaseException) -> None:
        for job in self._calls:
            job.error = error
            job.done.set()
        self._calls.clear()
        for handle in self._waiting:
            handle._fail(error)
        self._waiting.clear()
        for active in self._running:
            self._release(active)
            active.handle._fail(error)
        self._running.clear()

    def _sweep(self) -> None:
        now = time.monotonic()
        with self._cv:
            keep = collections.deque()
            for handle in self._waiting:
                error = self._stop_reason(handle, [], now)
                if error is None:
                    keep.append(handle)
                else:
                    handle._fail(error)
            self._waiting = keep
        for active in list(self._running):
            error = self._stop_reason(active.handle, active.out_ids, now)
            if error is not None:
                self._drop(active, error)

    def _stop_reason(self, handle: RequestHandle, tokens: list[int], now: float) -> BaseException | None:
        if handle.cancel_requested:
            self.counters["cancelled"] += 1
            return RequestCancelled(tokens)
        deadline = handle.request.deadline
        if deadline is not None and now >= deadline:
            self.counters["deadline_exceeded"] += 1
            return DeadlineExceeded(tokens)
        return None

    def _drop(self, active: _Active, error: BaseException) -> None:
        self._running.remove(active)
        self._release(active)
        active.handle._fail(error)

    # -- admission ------------------------------------------------------------------------------------

    @staticmethod
    def _own_rows(request: Request) -> int:
        """Rows a request owns: its new tokens, and every decoded token but the last (never forwarded)."""
        return request.new_tokens + request.params.max_new_tokens - 1

    def _added_rows(self, request: Request) -> int:
        """Rows admitting ``request`` adds to what running requests hold."""
        rows = self._own_rows(request)
        if request.plan is not None:
            for ref in request.plan.blocks:
                block = self.arena.block(self.engine.arena_key(request.schema, ref))
                if block is None or block.refs == 0:
                    rows += ref.n_rows
        return rows

    def _admissible(self) -> bool:
        if len(self._running) >= self.max_batch:
            return False
        request = self._waiting[0].request
        return self.arena.referenced_rows() + self._added_rows(request) <= self.arena.max_rows

    def _admit(self) -> None:
        while True:
            with self._cv:
                if not self._waiting or not self._admissible():
                    return
                handle = self._waiting.popleft()
            active = None
            try:
                active = self._start(handle)
            except Exception as exc:  # a failure to start fails this request only
                log.exception("request %d failed to start", handle.id)
                handle._fail(exc)
                continue
            if active is not None:
                self._running.append(active)
                self.counters["admitted"] += 1
                self._note_peak()

    def reset_peak(self) -> None:
        self.peak = {"rows": 0, "module_rows": 0, "private_module_rows": 0}

    def _note_peak(self) -> None:
        rows = self.arena.referenced_rows()
        if rows > self.peak["rows"]:
            shared = sum(len(b.rows) for b in self.arena.blocks.values() if b.refs > 0)
            private = sum(len(b.rows) * b.refs for b in self.arena.blocks.values() if b.refs > 0)
            self.peak = {"rows": rows, "module_rows": shared, "private_module_rows": private}

    def _start(self, handle: RequestHandle) -> _Active | None:
        request = handle.request
        params = request.params
        generator = make_generator(params.seed)
        stopper = StopChecker(self.engine.tokenizer, list(params.stop), self.engine.eos_ids)
        if request.prefix is not None:
            return self._start_prefix(handle, generator, stopper)
        plan = request.plan
        active = _Active(handle, [], list(plan.new_tokens), list(plan.new_positions), plan.live,
                         generator=generator, stopper=stopper, cached_tokens=plan.cached_tokens,
                         computed_tokens=len(plan.new_tokens), mode=request.mode)
        try:
            visible: list[torch.Tensor] = []
            for ref in plan.blocks:
                if ref.n_rows == 0:
                    continue
                key = self.engine.arena_key(request.schema, ref)
                block = self.arena.block(key) or self._place(request.schema, ref, key)
                self.arena.acquire(block)
                active.block_keys.append(key)
                if ref.hidden:
                    keep = torch.ones(ref.n_rows, dtype=torch.bool, device=block.index.device)
                    keep[list(ref.hidden)] = False
                    visible.append(block.index[keep])
                else:
                    visible.append(block.index)
            active.block_rows = (torch.cat(visible) if visible
                                 else torch.zeros(0, dtype=torch.long, device=self.engine.device))
            active.max_row = int(active.block_rows.max()) if visible else -1
            active.rows = self.arena.allocate(self._own_rows(request))
        except BaseException:
            self._release(active)
            raise
        self.engine.prefetch_siblings(request.schema, [ref.module for ref in plan.blocks])
        active.next_pos = max(request.positions) + 1
        active.own_visible = torch.zeros(0, dtype=torch.long, device=self.engine.device)
        return active

    def _place(self, schema, ref, key):
        """Copy one module block ``[L, 2, H, n, D]`` from the store (encoding it if no tier holds it)
        into new rows; a moved block's own-token runs (``ref.shifts``: ``(first, stop, delta)``) get
        their new positions and, for RoPE keys, a turn by ``R(delta)`` on the way (one gather-rotate)."""
        tensor = self.engine.fetch_block(schema, ref.module, ref.scaffold, ref.geometry)
        block = self.arena.add_block(key, ref.n_rows)
        positions = self.engine.block_positions(schema, ref.module, ref.scaffold, ref.geometry)
        shifts = ref.shifts or ((0, ref.n_rows, 0),)
        table = []
        src = 0
        for start, stop in _ranges(block.rows):
            for first, last, shift in shifts:
                a, b = max(first, src), min(last, src + stop - start)
                if a < b:
                    table.append((0, a, start + a - src, b - a, shift))
            src += stop - start
        rows = torch.tensor(table, dtype=torch.int64)
        rotation = self.engine.key_rotation() if ref.shifts else None
        if rotation is not None and rotation.kind == "rope":
            ops.gather_rotate(self.arena.data, [tensor], rows, rotation.inv_freq)
        else:  # unmoved, or moved keys without position (ALiBi): a plain copy
            ops.gather_concat(self.arena.data, [tensor], rows[:, :4].contiguous())
        if ref.shifts:
            delta = torch.repeat_interleave(torch.tensor([s for _, _, s in shifts], dtype=torch.long),
                                            torch.tensor([b - a for a, b, _ in shifts], dtype=torch.long))
            positions = positions + delta.to(positions.device)
            self.counters["blocks_moved"] += 1
        self.arena.row_pos[block.index] = positions
        self.counters["blocks_placed"] += 1
        return block

    def _start_prefix(self, handle: RequestHandle, generator, stopper) -> _Active | None:
        """Prefill a plain prompt exactly through the engine's prefix cache (alone), straight into a
        contiguous run of its own rows (``pckernels.engine.prefix_rows``), so its decoding joins the
        batch with nothing moved; its first token is chosen here. When free rows still hold the
        prompt's leading blocks from an earlier request (:meth:`KVArena.remember_prefix`), the run
        starts there and those blocks are not copied again."""
        request = handle.request
        ids = request.prefix.token_ids
        n = len(ids)
        device = self.engine.device
        prefix = self.engine.prefix
        keys = prefix.chain_keys(ids, request.prefix.salt) if request.prefix.reuse else []
        start, blocks = self.arena.prefix_run(keys)
        run = self.arena.allocate_at(start, n) if blocks else None
        placed = blocks * prefix.block_size if run is not None else 0
        if run is None:
            run = self.arena.allocate_run(n)
        rest = self.arena.allocate(self._own_rows(request) - n) if run is not None else None
        own = (run + rest) if run is not None else self.arena.allocate(self._own_rows(request))
        try:
            target = self.arena.data[:, :, :, run[0]:run[0] + n] if run else None
            prefill = prefix.prefill(ids, reuse=request.prefix.reuse, salt=request.prefix.salt, rows=target,
                                     placed=placed)
        except BaseException:
            self.arena.release(own)
            raise
        if placed:
            self.counters["prefix_tokens_in_place"] += placed
        active = _Active(handle, own, list(ids), list(range(n)), None,
                         generator=generator, stopper=stopper, cached_tokens=prefill.cached_tokens,
                         computed_tokens=n - prefill.cached_tokens, mode=prefill.mode)
        if run:
            active.prefix_blocks = (keys or prefix.chain_keys(ids, request.prefix.salt), run[0], prefix.block_size)
        rows = torch.tensor(active.rows[:n], dtype=torch.long, device=device)
        if run is None and n:
            self.counters["prefix_rows_moved"] += 1
            data = self.arena.data
            source = prefill.cache.buffer.data
            data.index_copy_(3, rows, source[:, :, :, :n])
        self.arena.row_pos[rows] = torch.arange(n, device=device)
        active.max_row = max(active.rows[:n]) if n else -1
        active.prefilled = n
        active.own_visible = rows
        active.block_rows = torch.zeros(0, dtype=torch.long, device=device)
        active.next_pos = n
        self._choose(active, prefill.logits, first=True)
        return None if active.handle.done else active

    def _release(self, active: _Active) -> None:
        for key in active.block_keys:
            self.arena.release_block(key)
        active.block_keys = []
        if active.prefix_blocks is not None:
            self.arena.remember_prefix(*active.prefix_blocks)
            active.prefix_blocks = None
        if active.rows:
            self.arena.release(active.rows)
            active.rows = []

    # -- a step -----------------------------------------------------------------------------------------

    def _plan_step(self) -> list[_Item]:
        items: list[_Item] = []
        offset = 0
        for active in self._running:
            if not active.reading and active.pending is not None:
                tokens = [active.pending] + self._drafts(active)
                first = len(active.new_tokens) + active.decoded_rows
                items.append(_Item(active, tokens, list(range(active.next_pos, active.next_pos + len(tokens))),
                                   active.rows[first:first + len(tokens)], offset, True, False))
                offset += len(tokens)
        budget = self.step_tokens
        for active in self._running:
            if not active.reading:
                continue
            left = len(active.new_tokens) - active.prefilled
            whole = active.live is not None  # an explicit prefill mask needs every token in one forward
            if whole and left > budget and budget < self.step_tokens:
                continue
            count = left if whole else min(left, budget)
            if count <= 0:
                break
            first = active.prefilled
            items.append(_Item(active, active.new_tokens[first:first + count],
                               active.new_positions[first:first + count], active.rows[first:first + count],
                               offset, False, first + count == len(active.new_tokens)))
            offset += count
            budget -= count
            if budget <= 0:
                break
        return items

    def _drafts(self, active: _Active) -> list[int]:
        """Tokens to verify after ``active``'s pending one: a prompt-lookup draft for greedy requests,
        as long as its rows (``max_new_tokens``) and the model's positions leave room."""
        params = active.request.params
        if active.drafter is None:
            active.draft_room = self.lookahead
        room = min(active.draft_room, params.max_new_tokens - len(active.out_ids) - 1)
        limit = self.engine.max_positions
        if limit is not None:
            room = min(room, limit - active.next_pos - 1)
        if room < 1 or params.temperature != 0:
            return []
        prompt = active.request.prompt_token_ids
        if active.drafter is None:
            active.drafter = NgramDrafter(list(prompt))
        active.drafter.extend(active.out_ids[len(active.drafter.tokens) - len(prompt):])
        return active.drafter.propose(room)

    def _step(self) -> None:
        items = self._plan_step()
        if not items:
            return
        try:
            logits, wanted = self._forward(items)
        except Exception as exc:  # the step failed: its requests fail, the others go on
            log.exception("a forward of %d requests failed", len(items))
            for item in items:
                if item.active in self._running:
                    self._drop(item.active, exc)
            return
        self.counters["steps"] += 1
        self.batch_sizes[len(items)] += 1
        for item in items:
            if not item.decode:
                item.active.prefilled += len(item.tokens)
        index = 0
        for item in wanted:
            if item.decode:
                self._verify(item, logits[index:index + len(item.tokens)])
                index += len(item.tokens)
            else:
                self._choose(item.active, logits[index], first=True)
                index += 1

    def _verify(self, item: _Item, logits: torch.Tensor) -> None:
        """A decode item's tokens (the pending one, then a draft) were forwarded: choose after each
        in turn, keeping the draft while it is what was chosen (``logits [len(item.tokens), vocab]``).
        Rows of the rejected rest stay as they are: their positions hide them from every query
        before the tokens at those positions overwrite them."""
        active = item.active
        drafts = item.tokens[1:]
        accepted = 0
        for index in range(len(item.tokens)):
            active.decoded_rows += 1
            active.next_pos += 1
            if not self._choose(active, logits[index], first=False):
                break
            if index == len(drafts) or active.pending != drafts[index]:
                break
            accepted += 1
        if drafts:
            self.counters["draft_tokens"] += len(drafts)
            self.counters["draft_accepted"] += accepted
            if accepted == len(drafts):
                active.draft_room = min(self.lookahead, 2 * active.draft_room)
            elif accepted == 0:
                active.draft_room = max(1, active.draft_room // 2)

    def _forward(self, items: list[_Item]) -> tuple[torch.Tensor, list[_Item]]:
        """One forward over the packed tokens of ``items``; logits ``[k, vocab]`` of the tokens that
        choose a next token (a decode item's every token, a prompt's last), and their items."""
        device = self.engine.device
        arena = self.arena
        ids = torch.tensor([[t for item in items for t in item.tokens]], dtype=torch.long, device=device)
        positions = torch.tensor([p for item in items for p in item.positions], dtype=torch.long, device=device)
        rows = torch.tensor([r for item in items for r in item.rows], dtype=torch.long, device=device)
        arena.row_pos[rows] = positions
        for item in items:
            self._make_visible(item)
        extent = 1 + max(max(max(item.rows), item.active.max_row) for item in items)
        allowed = torch.zeros(len(positions), extent, dtype=torch.bool, device=device)
        key_pos = arena.row_pos[:extent]
        for item in items:
            active = item.active
            span = slice(item.offset, item.offset + len(item.tokens))
            if not item.decode and active.live is not None:
                own = torch.tensor(active.rows[:len(active.new_tokens)], dtype=torch.long, device=device)
                view = torch.zeros(len(item.tokens), extent, dtype=torch.bool, device=device)
                view[:, own] = active.request.plan.prefill_mask.to(device)
                allowed[span] = view
                continue
            visible = torch.zeros(extent, dtype=torch.bool, device=device)
            visible[active.block_rows] = True
            visible[active.own_visible] = True
            allowed[span] = visible[None, :] & (key_pos[None, :] <= positions[span, None])
        bias = torch.full(allowed.shape, NEG_INF, dtype=self.engine.dtype, device=device)
        bias.masked_fill_(allowed, 0.0)
        wanted = [item for item in items if item.decode or item.last_of_prompt]
        keep = torch.tensor([row for item in wanted
                             for row in (range(item.offset, item.offset + len(item.tokens)) if item.decode
                                         else (item.offset + len(item.tokens) - 1,))],
                            dtype=torch.long, device=device)
        self.cache.prepare(rows=rows, start=0, extent=extent)
        logits = self.engine.adapter.forward(ids, positions[None], AttentionSpec(bias, positions, key_pos),
                                             self.cache, keep=keep)
        return logits, wanted

    def _make_visible(self, item: _Item) -> None:
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
            add = torch.tensor(fresh, dtype=torch.long, device=self.engine.device)
            active.own_visible = torch.cat([active.own_visible, add])
            active.max_row = max(active.max_row, max(fresh))

    def _choose(self, active: _Active, logits: torch.Tensor, *, first: bool) -> bool:
        """Pick the request's next token from its ``logits [vocab]``; finish it (False) or keep it
        going (True)."""
        params = active.request.params
        scores = logits.float()
        token = select_token(scores, temperature=params.temperature, top_p=params.top_p,
                             generator=active.generator)
        if first:
            active.first_logits = scores.cpu()
            active.ttft = time.perf_counter() - active.request.submitted
        active.out_ids.append(token)
        active.handle._emit(token)
        done, reason = active.stopper.check(active.out_ids)
        limit = self.engine.max_positions
        if not done and (len(active.out_ids) >= params.max_new_tokens
                         or (limit is not None and active.next_pos >= limit)):
            done, reason = True, "length"
        if done:
            self._finish(active, reason)
            return False
        active.pending = token
        return True

    def _finish(self, active: _Active, reason: str) -> None:
        if active in self._running:
            self._running.remove(active)
        self._release(active)
        request = active.request
        tokenizer = self.engine.tokenizer
        text = active.stopper.trim(tokenizer.decode(active.out_ids, skip_special_tokens=True))
        self.counters["finished"] += 1
        active.handle._finish(GenerationResult(
            text=text, token_ids=active.out_ids, prompt_token_ids=list(request.prompt_token_ids),
            positions=list(request.positions), ttft_s=active.ttft,
            total_s=time.perf_counter() - request.submitted, cached_tokens=active.cached_tokens,
            computed_tokens=active.computed_tokens, first_logits=active.first_logits, mode=active.mode,
            finish_reason=reason))
