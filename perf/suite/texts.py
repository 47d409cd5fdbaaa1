"""Synthetic, deterministic prompt material sized in tokens of a given tokenizer.

Every source yields endless varied text for a seed; ``sized`` cuts it to an exact number of
tokens of that tokenizer. ``pml_escape`` makes text safe inside PML (it is XML).
"""

from __future__ import annotations

import itertools
import random
from typing import Iterator
from xml.sax.saxutils import escape

GOODS = ("wool", "salt", "timber", "barley", "copper", "honey", "linen", "amber", "dyes", "iron")
TOWNS = ("Arden", "Bexley", "Corran", "Dunmore", "Elstow", "Fenwick", "Garth", "Hollin", "Ivesby", "Jarrow")
WEATHER = ("fog", "hail", "clear sky", "drizzle", "snow", "strong gusts")
FUNCTIONS = ("parse", "load", "merge", "score", "render", "validate", "index", "fetch", "encode", "prune")
NOUNS = ("record", "batch", "config", "token", "user", "order", "frame", "block", "route", "query")


def archive(seed: int) -> Iterator[str]:
    """Chronicle sentences about trading towns (long-document QA, RAG documents)."""
    rng = random.Random(seed)
    for year in itertools.count(1400 + 37 * seed):
        town, other = rng.sample(TOWNS, 2)
        a, b = rng.sample(GOODS, 2)
        yield (f"In {year} the council of {town} counted {rng.randint(20, 900)} carts of {a} bound for {other}, "
               f"and the mills ground {rng.randint(3, 90)} tons of {b}; the river bridge was repaired after "
               f"{rng.choice(WEATHER)} in the {rng.choice(('spring', 'summer', 'autumn', 'winter'))}.")


def weather_log(seed: int) -> Iterator[str]:
    """Station records (the hit-ratio sweep's uncached text)."""
    rng = random.Random(seed)
    for i in itertools.count():
        yield (f"Record {i}: the station at grid {rng.randint(1, 999)} measured {rng.randint(0, 90)} mm of rain "
               f"and a wind of {rng.randint(0, 60)} knots; the observer noted {rng.choice(WEATHER)}.")


def guidelines(seed: int) -> Iterator[str]:
    """Policy rules for a long system prompt."""
    rng = random.Random(seed)
    for i in itertools.count(1):
        noun, other = rng.sample(NOUNS, 2)
        yield (f"Rule {i}: when a customer asks about a {noun}, confirm the {other} number first, answer in at "
               f"most {rng.randint(2, 6)} sentences, and never promise delivery within {rng.randint(1, 9)} days.")


def source_file(seed: int) -> Iterator[str]:
    """Python-like source lines for the code-files workload."""
    rng = random.Random(seed)
    for i in itertools.count():
        fn, noun = rng.choice(FUNCTIONS), rng.choice(NOUNS)
        yield (f"def {fn}_{noun}_{seed}_{i}(items, limit={rng.randint(1, 64)}):\n"
               f"    result = [x for x in items if x.{noun}_id % {rng.randint(2, 9)} == 0]\n"
               f"    if len(result) > limit:\n        result = result[:limit]\n"
               f"    return {{'{noun}': result, 'count': len(result)}}\n")


def sized(tokenizer, source: Iterator[str], n_tokens: int) -> str:
    """The first ``n_tokens`` tokens of ``source``'s text, decoded back to text."""
    pieces: list[str] = []
    count = 0
    while count < n_tokens:
        piece = next(source)
        pieces.append(piece)
        count += len(tokenizer(piece, add_special_tokens=False)["input_ids"])
    ids = tokenizer(" ".join(pieces), add_special_tokens=False)["input_ids"][:n_tokens]
    return tokenizer.decode(ids).strip()


def pml_escape(text: str) -> str:
    return escape(text)
