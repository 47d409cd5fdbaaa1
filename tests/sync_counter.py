"""Count, on the CPU path, every construct that would synchronise the host with a CUDA device.

On CUDA the host waits for the GPU whenever a device value is read on the host (``.item()``,
``.tolist()``, ``int()`` / ``float()`` / ``bool()`` / ``operator.index`` of a tensor, ``.cpu()``,
``.numpy()``, ``.to("cpu")``), when an op must know a data-dependent size (``nonzero``,
``masked_select``, ``unique``, indexing with a boolean tensor), and when a host list or tensor is
copied to the device from pageable memory without ``non_blocking`` (``torch.tensor(list,
device=...)``, ``.to(device)``). On the CPU none of these wait, so the engine's CPU path is where a
test can count them: :class:`SyncCounter` patches those methods for the duration of a ``with`` and
counts each call made in another thread than the one that opened it (the scheduler thread; the
caller waits meanwhile).

What runs after the engine's one explicit readout per step (``pckernels.engine.graphs.readout``:
the logits copied to the host) works on host tensors on CUDA too — token choice — so calls made
inside ``readout`` and inside the ``host`` functions given are not counted; ``readouts`` counts
the readouts themselves.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import traceback

import torch

_METHODS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy", "nonzero",
            "masked_select", "unique", "argwhere")


def _to_syncs(args, kwargs) -> bool:
    """Whether ``tensor.to(*args, **kwargs)`` copies between host and device without
    ``non_blocking`` (on the CPU path every device is the CPU: any copy with a device counts)."""
    if kwargs.get("non_blocking") or (len(args) > 2 and isinstance(args[2], bool) and args[2]):
        return False
    target = kwargs.get("device")
    if target is None and len(args) > 1 and isinstance(args[1], (str, torch.device, torch.Tensor)):
        target = args[1]
    return target is not None


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class SyncCounter:
    """``with SyncCounter(host=((owner, "name"), ...)) as c:`` counts would-be syncs (module
    docstring) in ``c.count`` (``c.where``: ``construct @ dir/file:line`` -> count); ``c.readouts``:
    explicit readouts. ``host``: functions that work on host tensors only (not counted inside);
    ``exempt``: ``dir/file:line`` pieces whose calls read host tensors (not counted)."""

    def __init__(self, host: tuple = (), exempt: tuple[str, ...] = ()) -> None:
        self.count = 0
        self.readouts = 0
        self.where: collections.Counter = collections.Counter()
        self._host = host
        self._exempt = exempt
        self._owner = threading.get_ident()
        self._local = threading.local()
        self._saved: list = []

    def _counting(self) -> bool:
        return threading.get_ident() != self._owner and not getattr(self._local, "suspended", 0)

    def _note(self, name: str) -> None:
        frame = next((f for f in reversed(traceback.extract_stack(limit=8)[:-2])
                      if "sync_counter" not in f.filename), None)
        place = f"{'/'.join(frame.filename.rsplit('/', 2)[-2:])}:{frame.lineno}" if frame else "?"
        if any(part in place for part in self._exempt):
            return
        self.count += 1
        self.where[f"{name} @ {place}"] += 1

    @contextlib.contextmanager
    def suspended(self):
        self._local.suspended = getattr(self._local, "suspended", 0) + 1
        try:
            yield
        finally:
            self._local.suspended -= 1

    def _patch(self, owner, name: str, make) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, make(original))

    def __enter__(self) -> "SyncCounter":
        counter = self

        def method(name, original):
            @functools.wraps(original)
            def wrapped(*args, **kwargs):
                if counter._counting():
                    counter._note(name)
                return original(*args, **kwargs)
            return wrapped

        for name in _METHODS:
            self._patch(torch.Tensor, name, functools.partial(method, name))

        def to(original):
            @functools.wraps(original)
            def wrapped(*args, **kwargs):
                if counter._counting() and _to_syncs(args, kwargs):
                    counter._note("to(device)")
                return original(*args, **kwargs)
            return wrapped

        self._patch(torch.Tensor, "to", to)

        def indexing(name):
            def make(original):
                @functools.wraps(original)
                def wrapped(self_, index, *rest):
                    if counter._counting() and _bool_index(index):
                        counter._note(f"{name}[bool]")
                    return original(self_, index, *rest)
                return wrapped
            return make

        self._patch(torch.Tensor, "__getitem__", indexing("__getitem__"))
        self._patch(torch.Tensor, "__setitem__", indexing("__setitem__"))

        def factory(name):
            def make(original):
                @functools.wraps(original)
                def wrapped(data, *args, **kwargs):
                    if counter._counting() and kwargs.get("device") is not None:
                        counter._note(f"torch.{name}(device=)")
                    return original(data, *args, **kwargs)
                return wrapped
            return make

        self._patch(torch, "tensor", factory("tensor"))
        self._patch(torch, "as_tensor", factory("as_tensor"))

        def host(original):
            @functools.wraps(original)
            def wrapped(*args, **kwargs):
                with counter.suspended():
                    return original(*args, **kwargs)
            return wrapped

        for owner, name in self._host:
            self._patch(owner, name, host)

        from pckernels.engine import graphs

        def readout(original):
            @functools.wraps(original)
            def wrapped(*args, **kwargs):
                if counter._counting():
                    counter.readouts += 1
                with counter.suspended():
                    return original(*args, **kwargs)
            return wrapped

        self._patch(graphs, "readout", readout)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
