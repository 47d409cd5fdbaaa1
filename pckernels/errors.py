"""Errors raised by promptcache."""

from __future__ import annotations


class PMLError(ValueError):
    """A schema or prompt was rejected.

    ``line`` and ``column`` are 1-based positions in the PML source (``None`` when the
    problem is not tied to a place in the text, e.g. an unknown schema name passed
    from code). The message names what was wrong and what was expected.
    """

    def __init__(self, message: str, *, line: int | None = None, column: int | None = None,
                 source: str | None = None) -> None:
        self.message = message
        self.line = line
        self.column = column
        self.source = source
        where = ""
        if line is not None:
            where = f"line {line}" + (f", column {column}" if column is not None else "")
            if source:
                where = f"{source}: {where}"
            where += ": "
        super().__init__(where + message)


class PromptTooLongError(ValueError):
    """A prompt leaves no room to generate within the model's positions.

    ``last_position``: the prompt's highest position id; ``limit``: how many positions the
    model takes (its adapter's ``max_positions()``).
    """

    def __init__(self, last_position: int, limit: int) -> None:
        self.last_position = last_position
        self.limit = limit
        super().__init__(f"the prompt reaches position {last_position}, leaving no room to generate within the "
                         f"model's {limit} positions")


class PMLPromptTooLongError(PromptTooLongError, PMLError):
    """A PML prompt too long for the model: a :class:`PromptTooLongError` and a :class:`PMLError`."""


class UnsupportedModelError(ValueError):
    """The model's architecture is not supported by promptcache (the message names those that are)."""
