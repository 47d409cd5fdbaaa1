"""Where a Prompt Cache query's time goes: a cProfile run of ``generate`` attributed to the
functions the engine's ``_run`` and ``_prefill_cached`` call directly (resolve, plan, place
blocks, attention bias, model forward, sampling, …), plus the heaviest torch calls overall.

cProfile adds a little per Python call (about a thousand per forward); the shares are what
matters, and the model forward is the same call as the floor's.
"""

from __future__ import annotations

import cProfile
import pstats
from typing import Callable

ENGINE_FILE = "pckernels/engine/core.py"
MIN_SHARE = 0.002
"""Components under this share of the total are counted as other."""
PARENTS = ("_run", "_prefill_cached")
FRIENDLY = {"resolve": "parse prompt", "plan_cached": "plan", "_place_blocks": "place blocks (store + copy)",
            "attention": "attention bias", "forward": "model forward", "select_token": "sample first token",
            "ensure_capacity": "buffer capacity", "_decode_step": "decode closure", "select_recompute": "recompute "
            "selection", "prepare": "cache prepare"}


def _label(func: tuple[str, int, str]) -> str:
    filename, line, name = func
    short = filename.split("site-packages/")[-1].split("/work/main/")[-1]
    return FRIENDLY.get(name, f"{name} ({short}:{line})")


def profile(fn: Callable[[], object]) -> dict:
    """``{"total_s", "components": {label: s}, "other_s", "top_calls": {label: self seconds}}``."""
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    components: dict[str, float] = {}
    total = 0.0
    for func, (_, _, _, cumulative, callers) in stats.items():
        if func[0].endswith(ENGINE_FILE) and func[2] == "_run":
            total = max(total, cumulative)
        if func[0].endswith(ENGINE_FILE) and func[2] == "_prefill_cached":
            continue
        for caller, (_, _, _, caller_cumulative) in callers.items():
            if caller[0].endswith(ENGINE_FILE) and caller[2] in PARENTS:
                label = _label(func)
                components[label] = components.get(label, 0.0) + caller_cumulative
    heavy = sorted(((tt, func) for func, (_, _, tt, _, _) in stats.items() if func[0] == "~"), reverse=True)[:6]
    shown = {k: v for k, v in sorted(components.items(), key=lambda kv: -kv[1]) if v >= MIN_SHARE * total}
    return {"total_s": total, "components": shown, "other_s": max(total - sum(shown.values()), 0.0),
            "top_calls": {func[2]: tt for tt, func in heavy}}
