"""A request as the scheduler sees it, and the handle its caller holds.

A :class:`Request` is plain data made in the caller's thread (the prompt is parsed and planned
there, so bad input raises at once and changes nothing). The scheduler thread owns everything
that changes while it runs (its rows, its decode state); the caller only reads the
:class:`RequestHandle`, which streams token ids and ends with a :class:`GenerationResult` or an
error.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from pckernels.engine.plan import RequestPlan
from pckernels.generation import GenerationResult, SamplingParams

_ids = itertools.count(1)


@dataclass
class PrefixPrefill:
    """A plain prompt for exact prefix reuse: the scheduler prefills it through the prefix cache
    (``reuse`` or not) and then decodes it with the batch."""

    token_ids: list[int]
    reuse: bool = True
    salt: str = ""
    """Namespace of the prompt's prefix blocks (a server's tenant salt)."""


@dataclass
class Request:
    """One generation. Exactly one of ``plan`` (PML prompts: cached, reference and baseline modes)
    and ``prefix`` (plain prompts through the prefix cache) is set.

    ``schema``: the schema ``plan``'s blocks belong to. ``prompt_token_ids`` / ``positions``: the
    prompt as reported in the result. ``deadline``: ``time.monotonic()`` value after which the
    request fails with :class:`~pckernels.errors.DeadlineExceeded` (None: none). ``n``: answers to
    generate from the one reading of the prompt (OpenAI's ``n``): the handle's ``choices``.
    """

    params: SamplingParams
    mode: str
    prompt_token_ids: list[int]
    positions: list[int]
    plan: RequestPlan | None = None
    schema: object = None
    prefix: PrefixPrefill | None = None
    deadline: float | None = None
    submitted: float = field(default_factory=time.perf_counter)
    id: int = field(default_factory=lambda: next(_ids))
    n: int = 1

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

    def sibling(self, index: int) -> "Request":
        """The ``index``-th further answer of an ``n > 1`` request: the same prompt, a request of its
        own (its own id; with a ``seed``, ``seed + index``, so sampled answers differ reproducibly)."""
        seed = self.params.seed
        params = dataclasses.replace(self.params, seed=None if seed is None else seed + index)
        return dataclasses.replace(self, params=params, id=next(_ids), n=1)

    @property
    def new_tokens(self) -> int:
        """Prompt tokens this request computes itself."""
        return len(self.plan.new_tokens) if self.plan is not None else len(self.prefix.token_ids)


_DONE = object()


class RequestHandle:
    """The caller's side of a request: iterate it for token ids as they are chosen, ``result()``
    for the :class:`GenerationResult`, ``cancel()`` to stop it (its rows are freed at the next
    step). Iteration and ``result()`` raise the request's error, if it failed."""

    def __init__(self, request: Request, wake: Callable[[], None] = lambda: None) -> None:
        self.request = request
        self._wake = wake
        self.choices: list[RequestHandle] = [self]
        """Every answer of the request (``request.n``), this one first; the others start when this
        one's prompt is read, from the same states."""
        self.pending: list[RequestHandle] = []
        """The other answers not started yet (they fail with this one until then)."""
        if request.n > 1:
            self.pending = [RequestHandle(request.sibling(index), wake) for index in range(1, request.n)]
            self.choices = [self, *self.pending]
        self._tokens: queue.SimpleQueue = queue.SimpleQueue()
        self._finished = threading.Event()
        self._result: GenerationResult | None = None
        self._error: BaseException | None = None
        self._cancelled = threading.Event()
        self._listeners: list[Callable[[], None]] = []
        self.final_emitted = False
        """Whether the token that ends this answer has been streamed (set before it is queued; the
        result follows once its scheduler step is counted)."""
        self.logprobs: list = []
        """Per token emitted so far, its :class:`~pckernels.generation.TokenLogprob` when the request
        asked for log-probabilities (appended before the token is streamed)."""

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    @property
    def cancel_requested(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Ask the scheduler to stop this request; a finished request is left as it is."""
        if not self.done:
            self._cancelled.set()
            self._wake()

    def __iter__(self) -> Iterator[int]:
        while True:
            item = self._tokens.get()
            if item is _DONE:
                break
            yield item
        if self._error is not None:
            raise self._error

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (from the scheduler's thread; it must not block) after each token
        and when the request ends, for callers that wait without a thread (an event loop's
        ``call_soon_threadsafe``). It is called once at once if the request already ended."""
        self._listeners.append(callback)
        if self.done:
            callback()

    def take(self) -> list[int]:
        """The tokens chosen since the last ``take``, without waiting (do not mix with iterating)."""
        out = []
        while True:
            try:
                item = self._tokens.get_nowait()
            except queue.Empty:
                return out
            if item is not _DONE:
                out.append(item)

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait for the request to finish; its result, or its error raised."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"request {self.id} not finished after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    # -- the scheduler's side ------------------------------------------------------------------------

    def _emit(self, token: int, logprob=None, final: bool = False) -> None:
        self.final_emitted = final
        if logprob is not None:
            self.logprobs.append(logprob)
        self._tokens.put(token)
        self._notify()

    def _finish(self, result: GenerationResult) -> None:
        self._result = result
        self._tokens.put(_DONE)
        self._finished.set()
        self._notify()

    def _fail(self, error: BaseException) -> None:
        for sibling in self.pending:
            sibling._fail(error)
        self.pending = []
        self._error = error
        self._tokens.put(_DONE)
        self._finished.set()
        self._notify()

    def _notify(self) -> None:
        for callback in list(self._listeners):
            callback()

