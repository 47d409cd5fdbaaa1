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


class UnknownSchemaError(PMLError):
    """A prompt names a schema that is not loaded (HTTP 404); ``schema`` is the name."""

    schema: str = ""


class OptionError(ValueError):
    """An option was refused before anything ran (a sampling parameter, an engine setting).

    ``option``: its name as the library spells it (``max_new_tokens``, ``max_queue``); ``value``:
    what was given; ``expected``: what it takes (``">= 1"``, ``"one of fp32, bf16"``);
    ``choices``: the values it takes when they are few. A ``ValueError``, so the server answers
    it with a 400 and a command line with a one-line usage error naming the option.
    """

    def __init__(self, option: str, value: object, expected: str, *, choices: tuple[str, ...] = (),
                 message: str | None = None) -> None:
        self.option = option
        self.value = value
        self.expected = expected
        self.choices = tuple(choices)
        super().__init__(message or f"{option} must be {expected}, got {value!r}")


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


class EngineBusyError(RuntimeError):
    """The engine's queue of waiting requests is full; retry later (HTTP 429/503)."""


class RequestTooLargeError(ValueError):
    """A request can never fit the engine's KV budget, even alone; ``rows`` it needs, ``limit``."""

    def __init__(self, rows: int, limit: int, bytes_per_row: int) -> None:
        self.rows = rows
        self.limit = limit
        super().__init__(f"the request needs {rows} KV rows ({rows * bytes_per_row / 2**20:.1f} MiB: its modules, "
                         f"its new tokens and max_new_tokens) but the engine's KV budget holds {limit} rows "
                         f"({limit * bytes_per_row / 2**20:.1f} MiB); lower max_new_tokens or raise kv_budget")


class RequestCancelled(Exception):
    """The request was cancelled before it finished; ``token_ids`` were generated until then."""

    def __init__(self, token_ids: list[int] | None = None) -> None:
        self.token_ids = list(token_ids or [])
        super().__init__(f"the request was cancelled after {len(self.token_ids)} tokens")


class DeadlineExceeded(TimeoutError):
    """The request's deadline passed before it finished; ``token_ids`` were generated until then."""

    def __init__(self, token_ids: list[int] | None = None) -> None:
        self.token_ids = list(token_ids or [])
        super().__init__(f"the request's deadline passed after {len(self.token_ids)} tokens")


class ProgramError(ValueError):
    """A prompt program (``pckernels.program``) was refused: a construct it cannot compile (at
    decoration time) or arguments it cannot take (at call time).

    ``filename``, ``line`` and ``column`` (1-based) locate the Python source of the construct
    (``None`` when the problem is not tied to it, e.g. an argument longer than its
    ``MaxTokens``); the message says what was wrong and what to write instead.
    """

    def __init__(self, message: str, *, filename: str | None = None, line: int | None = None,
                 column: int | None = None) -> None:
        self.message = message
        self.filename = filename
        self.line = line
        self.column = column
        where = ""
        if line is not None:
            where = f"{filename or '<source>'}:{line}" + (f":{column}" if column is not None else "") + ": "
        super().__init__(where + message)
