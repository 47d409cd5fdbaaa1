"""Where a Prompt Cache query's time goes: cProfile runs of the caller's thread (parse and plan)
and of the engine's scheduler thread (block placement, attention bias, model forward, sampling),
attributed to the functions the engine calls directly, plus the heaviest torch calls overall.

cProfile adds a little per Python call (about a thousand per forward); the shares are what
matters, and the model forward is the same call as the floor's.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
from typing import Callable

MIN_SHARE = 0.002
"""Components under this share of the total are counted as other."""
TOTALS = {("pckernels/engine/core.py", "request"), ("pckernels/engine/scheduler.py", "_admit"),
          ("pckernels/engine/scheduler.py", "_step"), ("pckernels/engine/scheduler.py", "_sweep")}
"""The work of one query: planning in the caller, admission and steps in the scheduler."""
PARENTS = {("pckernels/engine/core.py", "request"), ("pckernels/engine/requests.py", "pml"),
           ("pckernels/engine/scheduler.py", "_start"), ("pckernels/engine/scheduler.py", "_step"),
           ("pckernels/engine/scheduler.py", "_sweep"), ("pckernels/engine/scheduler.py", "_admit"),
           ("pckernels/engine/arena_runner.py", "start"), ("pckernels/engine/arena_runner.py", "step"),
           ("pckernels/engine/placement.py", "start"), ("pckernels/engine/placement.py", "_start_pml"),
           ("pckernels/engine/step.py", "run")}
"""The calls whose callees are the components: the façade and request building in the caller, the
scheduler, the arena runner, the placer and the planned step (a component is a callee of one of
these that is not itself one of these)."""
FRIENDLY = {"resolve": "parse prompt", "plan_request": "plan", "check_answerable": "prompt checks",
            "_place": "place blocks (store + copy)", "forward": "model forward", "_choose": "sample",
            "select_recompute": "recompute selection", "prepare": "cache prepare", "allocate": "arena rows",
            "_make_visible": "visibility", "plan_step": "step plan", "masked_fill_": "attention bias",
            "full": "attention bias", "zeros": "attention bias", "acquire": "arena rows",
            "place": "place blocks (store + copy)", "build": "attention bias"}


def _key(func: tuple[str, int, str]) -> tuple[str, str]:
    filename, _, name = func
    for path, parent in PARENTS | TOTALS:
        if filename.endswith(path) and name == parent:
            return path, parent
    return "", name


def _label(func: tuple[str, int, str]) -> str:
    filename, line, name = func
    short = filename.split("site-packages/")[-1].split("/work/main/")[-1]
    return FRIENDLY.get(name, f"{name} ({short}:{line})")


def profile(engine, fn: Callable[[], object]) -> dict:
    """``{"total_s", "components": {label: s}, "other_s", "top_calls": {label: self seconds}}`` of
    ``fn()`` (a query on ``engine``), over the calling thread and the engine's scheduler thread (the
    calling thread alone on Python 3.12+, where only one cProfile can be active)."""
    caller, worker = cProfile.Profile(), cProfile.Profile()
    both_threads = sys.version_info < (3, 12)  # from 3.12 (sys.monitoring) a second profiler cannot be enabled
    if both_threads:
        engine.scheduler.profiler = worker
    caller.enable()
    try:
        fn()
    finally:
        caller.disable()
        engine.scheduler.profiler = None
    stats = pstats.Stats(caller)
    if both_threads:
        stats.add(worker)
    components: dict[str, float] = {}
    total = 0.0
    for func, (_, _, _, cumulative, callers) in stats.stats.items():
        if _key(func) in TOTALS:
            total += cumulative
        if _key(func) in PARENTS:
            continue
        for caller_func, (_, _, _, caller_cumulative) in callers.items():
            if _key(caller_func) in PARENTS:
                label = _label(func)
                components[label] = components.get(label, 0.0) + caller_cumulative
    heavy = sorted(((tt, func) for func, (_, _, tt, _, _) in stats.stats.items() if func[0] == "~"), reverse=True)[:6]
    shown = {k: v for k, v in sorted(components.items(), key=lambda kv: -kv[1]) if v >= MIN_SHARE * total}
    return {"total_s": total, "components": shown, "other_s": max(total - sum(shown.values()), 0.0),
            "top_calls": {func[2]: tt for tt, func in heavy}}
