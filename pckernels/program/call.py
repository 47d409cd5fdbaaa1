"""``ProgramCall``: one call of a prompt program, what ``PromptCache.generate`` / ``stream`` /
``complete`` accept."""

from __future__ import annotations

from typing import Any

from pckernels.errors import ProgramError
from pckernels.pml.tokens import encode_batch
from pckernels.program.emit import Argument
from pckernels.program.format import chat_format


class ProgramCall:
    """One call of a :class:`Program`: its PML ``prompt`` (and the program's ``schema``).

    ``render(tokenizer)`` is the text the function returns for these arguments with that
    tokenizer's chat format; ``str()`` / ``+`` / f-strings give the plain-format render, so a
    program's function can call another program like a function returning ``str``.
    """

    __slots__ = ("args", "arguments", "kwargs", "program", "prompt")

    def __init__(self, program: Any, args: tuple, kwargs: dict, prompt: str,
                 arguments: tuple[Argument, ...]) -> None:
        self.program = program
        self.args = args
        self.kwargs = kwargs
        self.prompt = prompt
        self.arguments = arguments

    @property
    def schema(self) -> str:
        return self.program.schema

    @property
    def schema_name(self) -> str:
        return self.program.schema_name

    def render(self, tokenizer: Any = None) -> str:
        """The function's output; role helpers expand in ``tokenizer``'s chat format (``None``: plain)."""
        with chat_format(tokenizer):
            return self.program.function(*self.args, **self.kwargs)

    def check(self, tokenizer: Any) -> None:
        """Refuse (``ProgramError``) an argument longer than its ``MaxTokens`` with ``tokenizer``."""
        if not self.arguments:
            return
        for argument, ids in zip(self.arguments, encode_batch(tokenizer, [a.value for a in self.arguments])):
            if len(ids) > argument.max_tokens:
                raise ProgramError(f"argument {argument.param!r} of {argument.program}() is {len(ids)} tokens, "
                                   f"longer than its MaxTokens({argument.max_tokens}); shorten it or raise "
                                   "the limit")

    def __str__(self) -> str:
        return self.program.function(*self.args, **self.kwargs)

    def __add__(self, other: Any) -> str:
        if isinstance(other, (str, ProgramCall)):
            return str(self) + str(other)
        return NotImplemented

    def __radd__(self, other: Any) -> str:
        if isinstance(other, str):
            return other + str(self)
        return NotImplemented

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)

    def __repr__(self) -> str:
        return f"<ProgramCall {self.program.function.__qualname__} prompt={self.prompt!r}>"
