"""The scheduler: one thread owns the model and runs every request in flight in shared forwards.

Callers ``submit`` a :class:`~pckernels.engine.request.Request` (parsed and planned in their own
thread) and get a :class:`~pckernels.engine.request.RequestHandle`. The scheduler thread loops:

1. **sweep** — drop cancelled requests and those past their deadline, freeing their rows;
2. **admit** — waiting requests in arrival order while the KV rows they would add (their own
   rows, and the rows of blocks no running request already holds) fit the budget: their module
   blocks are placed in the :class:`~pckernels.engine.arena.KVArena` once and shared (a block
   five requests import is placed once), their own rows reserved for their new tokens and
   ``max_new_tokens``; a plain prompt's stored prefix is restored here through the exact prefix
   cache;
3. **step** — one forward over the packed tokens of every running request: one decode token
   each, plus pieces of PML prompts still being read; then plain prompts' chunks, read alone as a
   cold read does them — every prompt sharing ``step_tokens`` per step, oldest first
   (:class:`~pckernels.engine.runner.PromptBudget`; the fairness rule of ``docs/engine.md``). No padding: each query attends, by schema position, to its own request's
   visible rows only — its modules' rows (parameter slots and recomputed tokens hidden) and its
   own rows — never another request's. Each request samples its next token from its own logits;
   finished requests free their rows at once and their slots go to waiting requests at the next
   step (continuous batching).

Requests never share mutable state: a request owns its rows, its sampler and its stop checker;
shared blocks are read-only while referenced. The model is used under the context's
``model_lock``, which encoding (``add_schema``) also takes.

The rooms: this module admits requests and runs the model thread;
:mod:`~pckernels.engine.placement` places blocks and requests in the arena;
:mod:`~pckernels.engine.step` plans a step (batch and mask) and runs it;
:mod:`~pckernels.engine.decoding` chooses tokens and verifies drafts.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import torch

from pckernels.engine.context import EngineContext
from pckernels.engine.decoding import Decoding
from pckernels.engine.request import Request, RequestHandle
from pckernels.engine.runner import Runner, StepOutput
from pckernels.engine.running import Running
from pckernels.errors import DeadlineExceeded, EngineBusyError, RequestCancelled
from pckernels.generation import TokenChoice

log = logging.getLogger(__name__)


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


class Scheduler:
    """Runs requests for one engine (see the module docstring).

    ``ctx``: the model; ``runner``: keeps the requests' states and runs the steps
    (:mod:`~pckernels.engine.runner`);
    ``max_queue``: waiting requests before ``submit`` raises ``EngineBusyError``;
    ``max_batch``: running requests at once; ``step_tokens``: prompt tokens read per step at most,
    across every prompt being read, oldest first (:class:`~pckernels.engine.runner.PromptBudget`);
    ``idle_exit_s``: the thread stops after that long without work and restarts on demand;
    ``lookahead``: draft tokens a greedy request's decode step may verify besides its own
    (prompt lookup, :mod:`pckernels.engine.lookahead`; 0: none).
    """

    def __init__(self, ctx: EngineContext, runner: Runner, *, max_queue: int = 256, max_batch: int = 64,
                 step_tokens: int = 2048, idle_exit_s: float = 5.0, lookahead: int = 0) -> None:
        if max_queue < 1 or max_batch < 1 or step_tokens < 1:
            raise ValueError(f"need max_queue, max_batch and step_tokens >= 1, got {max_queue}, {max_batch}, "
                             f"{step_tokens}")
        self.ctx = ctx
        self.runner = runner
        self.counters = runner.counters
        self.decoding = Decoding(ctx.max_positions, self.counters, lookahead)
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.step_tokens = step_tokens
        self.idle_exit_s = idle_exit_s
        self._cv = threading.Condition()
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._running: list[Running] = []
        self._calls: collections.deque[_Call] = collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.profiler = None
        """A ``cProfile.Profile`` enabled around the loop's work while set (perf's time breakdown)."""
        self.batch_sizes: collections.Counter = collections.Counter()

    @property
    def arena(self):
        """The attention-only runner's KV arena (None for hybrid models)."""
        return getattr(self.runner, "arena", None)

    @property
    def peak(self) -> dict:
        """The runner's busiest moment since :meth:`reset_peak` (``ArenaRunner.peak``: arena rows;
        ``HybridRunner.peak``: requests and bytes)."""
        return self.runner.peak

    def reset_peak(self) -> None:
        self.runner.reset_peak()

    @property
    def lookahead(self) -> int:
        """Draft tokens a greedy request's decode step may verify besides its own (read per step)."""
        return self.decoding.lookahead

    @lookahead.setter
    def lookahead(self, value: int) -> None:
        self.decoding.lookahead = value

    # -- the callers' side ----------------------------------------------------------------------------

    def submit(self, request: Request) -> RequestHandle:
        """Queue ``request``; raises ``RequestTooLargeError`` if it can never fit the KV budget and
        ``EngineBusyError`` if the queue is full (nothing is queued then)."""
        error = self.runner.too_large(request)
        if error is not None:
            raise error
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
        lock = self.ctx.model_lock
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
        """Counters and the runner's state (read from snapshots: safe while the loop runs)."""
        with self._cv:
            waiting, running = len(self._waiting), len(self._running)
        return {"waiting": waiting, "running": running, **self.counters,
                "batch_sizes": dict(sorted(self.batch_sizes.items())), **self.runner.stats()}

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
                try:
                    if profiler is not None:
                        profiler.enable()
                except Exception:  # e.g. Python 3.12+ allows one cProfile per process: run unprofiled
                    log.warning("the engine's profiler could not be enabled; the engine runs unprofiled", exc_info=True)
                    if self.profiler is profiler:  # dropped, so that it is tried (and warned of) once
                        self.profiler = None
                    profiler = None
                try:
                    with self.ctx.model_lock:
                        with self._cv:
                            job = self._calls.popleft() if self._calls else None
                        if job is not None:
                            job.run()
                        self._sweep()
                        self._admit()
                        if self._running:
                            self._step()
                except Exception as exc:  # a bug here must fail the requests in flight, never hang them
                    log.exception("the engine's model thread failed; failing the requests in flight")
                    with self._cv:
                        self._fail_all(RuntimeError(f"the engine failed: {type(exc).__name__}: {exc}"))
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
            try:
                self.runner.release(active)
            except Exception:  # the runner may be what failed; the handle must still hear of it
                log.exception("releasing request %d failed", active.handle.id)
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
            error = self._stop_reason(active.handle, active.token_ids, now)
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

    def _drop(self, active: Running, error: BaseException) -> None:
        self._running.remove(active)
        self.runner.release(active)
        active.handle._fail(error)

    # -- admission ------------------------------------------------------------------------------------

    def _admissible(self) -> bool:
        if len(self._running) >= self.max_batch:
            return False
        request = self._waiting[0].request
        return self.runner.fits(request)

    def _admit(self) -> None:
        while True:
            with self._cv:
                if not self._waiting or not self._admissible():
                    return
                handle = self._waiting.popleft()
            try:
                active = self._start(handle)
            except Exception as exc:  # a failure to start fails this request only
                log.exception("request %d failed to start", handle.id)
                handle._fail(exc)
                continue
            if active is not None:
                self._running.append(active)
                self.counters["admitted"] += 1
                self.runner.admitted(active)

    def _start(self, handle: RequestHandle) -> Running | None:
        """Place ``handle``'s request (a plain prompt's stored prefix restored; the rest is read by
        the steps); an exact repeat chooses its first token here (None when that already ends it)."""
        active, logits = self.runner.start(handle, self._choice(handle))
        if logits is None:
            return active
        ended: list[Running] = []
        going = self._read(active, logits, ended)
        for other in ended:
            self._finish(other)
        if not going:
            self._finish(active)
            return None
        return active

    def _choice(self, handle: RequestHandle) -> TokenChoice:
        request = handle.request
        return TokenChoice(request.params, self.ctx.tokenizer, self.ctx.eos_ids, max_positions=self.ctx.max_positions,
                           started=request.submitted, prompt_token_ids=request.prompt_token_ids)

    def _read(self, active: Running, logits: torch.Tensor, ended: list[Running]) -> bool:
        """``active``'s prompt is read (``logits [vocab]``): its request's other answers start from
        the same states (``n > 1``) and every answer chooses its first token (those it ends go to
        ``ended``, for the caller to finish); False when that ends ``active`` (the caller finishes it)."""
        pending, active.handle.pending = active.handle.pending, []
        for handle in pending:
            if handle.cancel_requested:
                self.counters["cancelled"] += 1
                handle._fail(RequestCancelled([]))
                continue
            child = self.runner.fork(active, handle, self._choice(handle))
            if self.decoding.choose(child, logits):
                self._running.append(child)
            else:
                ended.append(child)
        return self.decoding.choose(active, logits)

    # -- a step -----------------------------------------------------------------------------------------

    def _step(self) -> None:
        ended: list[Running] = []
        done = self.runner.step(self._running, self.step_tokens, self.decoding.drafts,
                                lambda output: self._output(output, ended))
        if done is None:
            return
        if done.failed:
            log.error("a forward of %d requests failed", len(done.failed), exc_info=done.error)
            for active in done.failed:
                if active in self._running:
                    self._drop(active, done.error)
        if done.emitted or not done.failed:  # a step whose forwards all failed is not counted
            self.counters["steps"] += 1
            self.batch_sizes[done.items] += 1
        for active in ended:
            self._finish(active)

    def _output(self, output: StepOutput, ended: list[Running]) -> None:
        """Choose from one output the moment the runner has it (``runner.Emit``: a prompt's first
        token, or a decode item's verified tokens, streamed at once); a request this ends goes to
        ``ended``, finished (its rows given back, its result delivered) once the step is counted."""
        active = output.active
        if output.tokens is None:
            going = self._read(active, output.logits, ended)
        else:
            before = active.decoded_rows
            going = self.decoding.verify(active, output.tokens, output.logits)
            if going:
                self.runner.settle(active, len(output.tokens), active.decoded_rows - before)
        if not going:
            ended.append(active)

    def _finish(self, active: Running) -> None:
        if active in self._running:
            self._running.remove(active)
        self.runner.release(active)
        self.counters["finished"] += 1
        active.handle._finish(active.result())
