"""Medians and spreads of repeated timings, and side-by-side (interleaved) measurement."""

from __future__ import annotations

import statistics
from typing import Callable, Mapping


def summarize(values: list[float]) -> dict:
    """``median``, quartiles ``p25``/``p75``, ``min``, ``max``, ``n`` and the raw ``samples``."""
    if not values:
        raise ValueError("no samples to summarize")
    ordered = sorted(values)
    if len(ordered) >= 2:
        p25, _, p75 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        p25 = p75 = ordered[0]
    return {"median": statistics.median(ordered), "p25": p25, "p75": p75, "min": ordered[0], "max": ordered[-1],
            "n": len(ordered), "samples": list(values)}


def interleaved(cases: Mapping[str, Callable[[], float]], repeats: int,
                on_sample: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Run every case once per round for ``repeats`` rounds, rotating the order each round so
    that no case always runs first (after a different one, on a differently warm cache).
    Each case returns the seconds it measured."""
    names = list(cases)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(cases[name]())
            if on_sample is not None:
                on_sample()
    return samples


def ratio(numerator: dict, denominator: dict) -> float:
    """Ratio of two summaries' medians."""
    return numerator["median"] / denominator["median"]


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median of the ratios of samples taken in the same round: robust to load that drifts
    between rounds on a shared machine."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


def common_prefix(a: list, b: list) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
