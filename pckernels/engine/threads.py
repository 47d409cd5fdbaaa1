"""Where the engine's tensor work runs, and why it matters on CPU.

PyTorch's CPU kernels run their parallel loops on OpenMP (libgomp). Every thread that has run a
parallel region keeps its own team of worker threads for as long as it lives, and once a process
holds more OpenMP threads than CPUs, libgomp stops spin-waiting between regions: each region then
pays a futex wake-up. A decode step is a few hundred small regions, so a scheduler thread running
next to a caller thread that once ran a large op (loading the model, encoding a schema) decodes
about 1.4x slower on two cores (measured: 22.5 vs 16.2 tokens/s on the embedded model at 4K
context). The engine therefore runs all of its model work on one thread — the scheduler's
(:meth:`~pckernels.engine.scheduler.Scheduler.call`) — and what must happen before that thread
exists (loading, probing the model) in a short-lived thread whose OpenMP team ends with it
(:func:`in_fresh_thread`). A caller that runs large torch ops on its own long-lived threads
brings the slowdown back; ``docs/perf.md`` says how to avoid it.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Callable, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)
_ENGINES: "weakref.WeakSet" = weakref.WeakSet()


def close_at_exit(engine) -> None:
    """Have ``engine.close()`` run when the interpreter exits, so that its threads end between
    two steps instead of being stopped inside a torch op while the runtime shuts down."""
    _ENGINES.add(engine)


@atexit.register
def _close_engines() -> None:
    for engine in list(_ENGINES):
        try:
            engine.close()
        except Exception:  # exiting anyway: say why, close the others
            log.exception("closing %r at exit failed", engine)


def in_fresh_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` run in a new thread that ends afterwards; returns its result or
    raises its exception (with the original traceback)."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as exc:  # re-raised in the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name="promptcache-setup", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
