"""``@program``: a Python prompt function compiled to a PML schema; each call gives the PML prompt."""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

from pckernels.errors import ProgramError
from pckernels.program import nodes as n
from pckernels.program.call import ProgramCall
from pckernels.program.compiler import Compiler
from pckernels.program.emit import (
    Structure,
    schema_body,
    split_tail,
    write_prompt,
    write_schema,
)
from pckernels.program.expressions import snapshot
from pckernels.program.names import safe_name
from pckernels.program.source import read_function, read_params

log = logging.getLogger(__name__)

_MISSING = object()


class Program:
    """A compiled prompt program; decorate a function with :func:`program` to make one.

    ``schema`` (PML text) and ``schema_name`` (``<qualname>-<hash of the schema's content>``) are
    fixed at decoration; ``program(*args, **kwargs)`` returns a :class:`ProgramCall` that
    ``PromptCache.generate`` / ``stream`` / ``complete`` accept. ``function`` is the original
    function, unchanged; ``render(*args)`` runs it (plain role format). Immutable: safe to call
    from many threads.
    """

    def __init__(self, function: Callable[..., str], *, name: str | None = None) -> None:
        self.function = function
        functools.update_wrapper(self, function)
        self.signature = inspect.signature(function)
        tree, source = read_function(function)
        params = read_params(function, self.signature, tree, source)
        compiled = Compiler(function, tree, source, params, lambda v: isinstance(v, Program)).compile()
        self.nodes: tuple[n.Node, ...] = compiled.nodes
        self.max_tokens = {k: v for k, v in params.items() if v is not None}
        """``MaxTokens`` limits of the parameters that have one."""
        self.tail_start = split_tail(self.nodes)
        watched = [(function.__globals__, k, obj, snap) for k, obj, snap in compiled.watched]
        for callee in _callees(self.nodes):
            watched += callee._watched
        self._watched = tuple(watched)
        head = self.nodes[:self.tail_start]
        qualname = function.__qualname__.replace("<locals>.", "")
        digest = hashlib.sha256(schema_body(head).encode("utf-8")).hexdigest()[:12]
        self.schema_name = f"{safe_name(name or qualname)[:100]}-{digest}"
        schema, structure = write_schema(self.schema_name, head)
        self.schema: str = schema
        self.structure: Structure = structure
        log.debug("compiled %s into schema %r (%d modules)", qualname, self.schema_name,
                  len(self.structure.modules))

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramCall:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.function.__qualname__}(): {exc}") from None
        bound.apply_defaults()
        self.check_constants()
        env = dict(bound.arguments)
        try:
            prompt, arguments = write_prompt(self.schema_name, self.nodes, self.tail_start, env,
                                             self.function.__qualname__)
        except ValueError as exc:
            raise ProgramError(f"{self.function.__qualname__}(): {exc}") from None
        return ProgramCall(self, bound.args, bound.kwargs, prompt, tuple(arguments))

    def render(self, *args: Any, **kwargs: Any) -> str:
        """The text the function returns for these arguments (plain role format); for a
        tokenizer's chat format use ``program(*args).render(tokenizer)``."""
        return self(*args, **kwargs).render()

    def check_constants(self) -> None:
        """Refuse (``ProgramError``) when a global the program was compiled from has changed
        since (rebound, or a list's elements changed): its schema would no longer match."""
        for namespace, name, obj, snap in self._watched:
            current = namespace.get(name, _MISSING)
            if current is not obj or (snap is not None and snapshot(current) != snap):
                raise ProgramError(f"{name!r} changed after {self.function.__qualname__} was compiled from "
                                   "it; decorate the program again (or keep its constants constant)")

    def __repr__(self) -> str:
        return f"<Program {self.function.__qualname__} schema={self.schema_name!r}>"


def program(function: Callable[..., str] | None = None, *, name: str | None = None):
    """Decorator: compile a prompt function into a :class:`Program` (``docs/program.md``).

    ``@program`` or ``@program(name="travel")`` (the schema name's prefix; default: the
    function's qualified name). Raises :class:`~pckernels.errors.ProgramError`, located in the
    function's source, for anything it cannot compile.
    """
    if function is None:
        return lambda f: Program(f, name=name)
    return Program(function, name=name)


def _callees(nodes: tuple[n.Node, ...]) -> list[Program]:
    out: list[Program] = []
    for node in nodes:
        if isinstance(node, n.Module):
            if node.call is not None:
                out.append(node.call.program)
            else:
                out += _callees(node.body)
        elif isinstance(node, n.Union):
            for member in node.members:
                out += _callees(member.body)
        elif isinstance(node, n.Role) and node.body:
            out += _callees(node.body)
    return out
