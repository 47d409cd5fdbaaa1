"""Typed option objects from what a caller gave: the object itself, or its fields as keywords.

``SamplingParams`` (per request) and ``EngineConfig`` (per engine) are both accepted either as an
object or as loose keywords that build one; :func:`typed_options` is the one place that decides
which, so both entry points refuse the same mistakes the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def typed_options(cls: type[T], given: T | None, options: Mapping[str, Any] | None, names: tuple[str, ...], *,
                  arg: str, what: str) -> T:
    """``given`` itself, or ``cls(**options)``. Both at once, a ``given`` that is no ``cls`` or a
    keyword not in ``names`` is a ``TypeError`` naming ``arg`` (the parameter's name) and ``what``
    (what the keywords are called); a bad value is ``cls``'s own error."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise TypeError(f"unknown {what}(s) {', '.join(map(repr, unknown))}: they are {', '.join(names)}")
    if given is None:
        return cls(**options)
    if not isinstance(given, cls):
        article = "an" if cls.__name__[0] in "AEIOU" else "a"
        raise TypeError(f"{arg} must be {article} {cls.__name__}, got {type(given).__name__}")
    if options:
        raise TypeError(f"give either {arg} or the {what}s, not both (got {arg} and {', '.join(sorted(options))}); "
                        f"dataclasses.replace({arg}, ...) changes a field")
    return given
