"""The step's host<->device traffic, and the static-shape step that CUDA graphs capture.

**Traffic.** A step's inputs are host lists (token ids, positions, arena rows); :func:`stage` puts
them on the device without a host wait (pinned memory, ``non_blocking``). The step's one wait is
:func:`readout`: the logits every request of the step chooses from, copied to the host at once.

**Static shapes.** On CUDA an eager forward is ~1,300 kernel launches and the GPU waits for
Python; a captured graph replays them in one call, but only for fixed shapes and fixed addresses.
:class:`StaticStep` gives a step both: the number of new tokens ``q`` is rounded up to a bucket
(1, 2, 4, … ``max_tokens``), the key extent (rows ``0 .. extent - 1``) to a row bucket
(:func:`row_bucket`), and the inputs are written into preallocated buffers — ids, positions,
rows, ``keep`` and the additive mask — whose first ``q`` (``extent``) entries are the step's and
the rest padding: a padded query has id 0 at position 0, sees every row of the extent (its output
stays finite, and is never read) and writes its keys and values to one **scratch row** of the
arena that the runner owns and no request sees (several padded queries write it at once: any of
their finite values may land there). The extra key columns are masked (-inf), so a real query's
attention is the dynamic step's up to rounding (longer reductions).

With ``capture`` (CUDA) each ``(q bucket, row bucket)`` is warmed up on a side stream, captured
with ``torch.cuda.CUDAGraph`` and then replayed after the inputs are copied in; when capture
fails — an op that synchronises with the host, or one that may not be captured — the failure is
logged once, naming the exception and where it was raised, and the step runs eager (static shapes
still). Graphs are dropped when the arena grows (its tensors move).

:func:`dynamic_forward` is the plain reference beside it: the same forward at the exact shapes.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass

import torch

from pckernels.integration.adapters import ModelAdapter
from pckernels.integration.attention import AttentionSpec

log = logging.getLogger(__name__)

NEG_INF = float("-inf")
GRAPH_MODES = ("auto", "off", "static", "captured")


@dataclass(frozen=True)
class StepGraphs:
    """How a packed step's forward runs. ``mode``: ``"off"`` — exact shapes, eager (the dynamic
    step); ``"static"`` — bucketed shapes in static buffers, eager; ``"captured"`` — static and
    replayed from CUDA graphs (CUDA only); ``"auto"`` — captured on CUDA, off elsewhere (on CPU the
    static step is no faster: ``perf/bench_graphs.py``). ``max_tokens``: the largest bucket of new
    tokens (a step with more runs dynamic); ``min_rows``: the smallest row bucket."""

    mode: str = "auto"
    max_tokens: int = 64
    min_rows: int = 64

    def __post_init__(self) -> None:
        if self.mode not in GRAPH_MODES:
            raise ValueError(f"step_graphs mode must be one of {', '.join(GRAPH_MODES)}, got {self.mode!r}")
        if self.max_tokens < 1 or self.min_rows < 1:
            raise ValueError(f"step_graphs needs max_tokens and min_rows >= 1, got {self.max_tokens}, "
                             f"{self.min_rows}")

    @classmethod
    def of(cls, value: "StepGraphs | str | None") -> "StepGraphs":
        """``value`` as options (a mode name, or None for the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, cls):
            return value
        raise TypeError(f"step_graphs: expected a StepGraphs, a mode name or None, got {type(value).__name__}")

    def resolved(self, device: torch.device) -> str:
        """The mode on ``device``: ``auto`` decided, ``captured`` off CUDA refused."""
        if self.mode == "auto":
            return "captured" if device.type == "cuda" else "off"
        if self.mode == "captured" and device.type != "cuda":
            raise ValueError(f"step_graphs='captured' needs a CUDA device, the engine runs on {device}")
        return self.mode


def stage(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host ``values`` (a list) as a tensor on ``device`` without a host wait: built in pinned
    memory and copied with ``non_blocking`` on CUDA (the caching host allocator keeps the pinned
    block until the copy is done); a plain tensor on the CPU."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def readout(logits: torch.Tensor) -> torch.Tensor:
    """The step's one explicit device->host read: ``logits [k, vocab]`` (or ``[vocab]``) as a host
    tensor, for every request of the step at once (token choice then works on the host)."""
    if logits.device.type == "cpu":
        return logits
    return logits.to("cpu")


def token_bucket(q: int) -> int:
    """New tokens rounded up to a power of two."""
    return 1 << max(0, q - 1).bit_length()


def row_bucket(extent: int, capacity: int, min_rows: int) -> int:
    """Rows read rounded up: to a multiple of ``max(min_rows, 2^(bits - 4))`` (at most 1/8th more
    than needed past ``8 * min_rows``), never past ``capacity``."""
    grain = max(min_rows, 1 << max(0, extent.bit_length() - 4))
    return min(capacity, -(-extent // grain) * grain)


def dynamic_forward(adapter: ModelAdapter, cache, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                    extent: int, spec: AttentionSpec, keep: torch.Tensor) -> torch.Tensor:
    """The reference: one eager forward of ``ids [1, q]`` at ``positions [q]`` into arena ``rows
    [q]`` over rows ``0 .. extent - 1``; logits ``[k, vocab]`` of ``keep [k]``."""
    cache.prepare(rows=rows, start=0, extent=extent)
    return adapter.forward(ids, positions[None], spec, cache, keep=keep)


class StaticStep:
    """Static buffers and captured graphs for one arena (module docstring). ``scratch``: the arena
    row padded queries write (the runner's, never visible to a request). Not thread-safe: the
    scheduler thread owns it."""

    def __init__(self, arena, dtype: torch.dtype, device: torch.device, scratch: int, options: StepGraphs,
                 capture: bool) -> None:
        self.arena = arena
        self.dtype = dtype
        self.device = device
        self.scratch = scratch
        self.options = options
        self.capture = capture
        n = options.max_tokens
        self.inputs = torch.zeros(4, n, dtype=torch.long, device=device)
        """Rows: ids, positions, arena rows, keep; the first ``q`` (``k``) entries used."""
        self.bias = torch.empty(0, dtype=dtype, device=device)
        """Flat: the step's ``[qb, eb]`` mask is its first ``qb * eb`` entries."""
        self.seen = torch.empty(0, dtype=torch.bool, device=device)
        """Flat: the mask by rows' ``seen [qb + 1, eb]`` (row attention backends only)."""
        self.row_info = torch.zeros(3, n, dtype=torch.int32, device=device)
        """The mask by rows' ``group``, ``start``, ``stop`` per query."""
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._data = None
        self.failed: str | None = None
        """Why capture was given up (the exception and where), or None."""
        self.replays = 0
        self.captures = 0

    def fits(self, q: int, extent: int) -> bool:
        return q <= self.options.max_tokens and extent <= self.arena.capacity

    def poison_(self) -> None:
        """Fill the buffers with values no step may use (tests: every used entry is written)."""
        self._sync_arena()
        self.inputs.fill_(1 << 40)
        self.bias.fill_(float("nan"))

    def _sync_arena(self) -> None:
        """Buffers sized for the arena's capacity; graphs dropped when its tensors moved."""
        arena = self.arena
        if self._data is not arena.data:
            self._graphs.clear()
            self._data = arena.data
        need = self.options.max_tokens * arena.capacity
        if self.bias.numel() < need:
            self._graphs.clear()
            self.bias = torch.full((need,), float("nan"), dtype=self.dtype, device=self.device)

    def row_buffers(self, groups: int, width: int, info: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Views for the step's mask by rows: ``seen [qb + 1, width]`` (the caller fills its first
        ``groups`` rows and the last; ``groups <= qb + 1``) and ``info [3, qb]`` with ``info``
        (group, start, stop per query) copied in."""
        qb = len(info[0])
        need = (self.options.max_tokens + 1) * self.arena.capacity
        if self.seen.numel() < need:
            self._graphs.clear()
            self.seen = torch.zeros(need, dtype=torch.bool, device=self.device)
        host = torch.tensor(info, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self.row_info[:, :qb].copy_(host, non_blocking=True)
        return self.seen[:(qb + 1) * width].view(qb + 1, width), self.row_info[:, :qb]

    def load(self, ids: list[int], positions: list[int], rows: list[int], keep: list[int],
             extent: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write the step's inputs, padded to their buckets, into the static buffers (one copy);
        returns the views ``ids [1, qb]``, ``positions [qb]``, ``rows [qb]``, ``keep [qb]`` and the
        mask ``[qb, eb]`` (the caller fills its first ``q`` rows; padded ones are zero here)."""
        self._sync_arena()
        q = len(ids)
        qb = token_bucket(q)
        eb = row_bucket(extent, self.arena.capacity, self.options.min_rows)
        pad = qb - q
        host = torch.tensor([ids + [0] * pad, positions + [0] * pad, rows + [self.scratch] * pad,
                             keep + [0] * (qb - len(keep))], dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.inputs[:, :qb].copy_(host, non_blocking=True)
        bias = self.bias[:qb * eb].view(qb, eb)
        bias[q:].zero_()
        return self.inputs[0, :qb][None], self.inputs[1, :qb], self.inputs[2, :qb], self.inputs[3, :qb], bias

    def forward(self, adapter: ModelAdapter, cache, ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                keep: torch.Tensor, bias: torch.Tensor, key_pos: torch.Tensor, by_rows=None) -> torch.Tensor:
        """The forward over the loaded buffers: logits ``[qb, vocab]`` (the first ``k`` are the
        step's; a captured graph's output is overwritten by its next replay — read it first)."""
        spec = AttentionSpec(bias, positions, key_pos, by_rows)
        if not self.capture or self.failed is not None:
            return dynamic_forward(adapter, cache, ids, positions, rows, bias.shape[1], spec, keep)
        key = (tuple(bias.shape), by_rows is not None)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(adapter, cache, ids, positions, rows, spec, keep)
            if entry is None:
                return dynamic_forward(adapter, cache, ids, positions, rows, bias.shape[1], spec, keep)
            self._graphs[key] = entry
        graph, out = entry
        graph.replay()
        self.replays += 1
        return out

    def _capture(self, adapter, cache, ids, positions, rows, spec, keep):
        """Warm up on a side stream, then capture one forward; None (and ``failed`` set, logged
        once) when capture breaks."""
        extent = spec.bias.shape[1]
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    dynamic_forward(adapter, cache, ids, positions, rows, extent, spec, keep)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = dynamic_forward(adapter, cache, ids, positions, rows, extent, spec, keep)
        except Exception as exc:  # capture is an optimisation: the step runs eager instead
            self.failed = f"{type(exc).__name__}: {exc}{_where(exc)}"
            log.warning("CUDA graph capture of the step failed; steps run eager with static shapes: %s",
                        self.failed)
            self._graphs.clear()
            return None
        self.captures += 1
        log.debug("captured the step for %d tokens over %d rows", ids.shape[1], extent)
        return graph, out


def _where(exc: BaseException) -> str:
    """`` at file:line (function)`` of the innermost frame of ``exc``, and of the innermost one
    outside torch itself when they differ (the model's line that called the op)."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    if not frames:
        return ""
    inner = frames[-1]
    text = f" at {inner.filename}:{inner.lineno} ({inner.name})"
    caller = next((f for f in reversed(frames) if "/torch/" not in f.filename), None)
    if caller is not None and caller is not inner:
        text += f", called from {caller.filename}:{caller.lineno} ({caller.name}): {(caller.line or '').strip()}"
    return text
