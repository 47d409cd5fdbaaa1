"""Reading a program body's expressions: conditions as ``Expr`` over the parameters, and the
compile-time constants (globals, closure cells, loop variables) they compare with."""

from __future__ import annotations

import ast
import builtins
from collections.abc import Callable
from typing import Any

from pckernels.errors import ProgramError
from pckernels.program import nodes as n
from pckernels.program.source import Source

MISSING = object()
"""What ``static`` returns for an expression that is not a compile-time constant."""


def snapshot(value: Any) -> Any:
    """What tells a mutable global changed since it was read (``None``: its identity says it)."""
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, (dict, set)):
        return repr(value)
    return None


class ExpressionReader:
    """Reads the expressions of one function (``func``, parsed as ``tree``) with its parameters
    ``params``; records the globals it reads in ``watched``. ``acc`` names the prompt
    accumulator once the compiler has found it."""

    def __init__(self, func: Callable, tree: ast.FunctionDef, source: Source,
                 params: dict[str, int | None]) -> None:
        self.func = func
        self.source = source
        self.params = params
        self.acc: str | None = None
        self.loop_names = {t.id for node in ast.walk(tree) if isinstance(node, (ast.For, ast.comprehension))
                           for t in ast.walk(node.target) if isinstance(t, ast.Name)}
        closure = func.__closure__ or ()
        self.nonlocals = dict(zip(func.__code__.co_freevars, closure))
        self.watched: dict[str, tuple[Any, Any]] = {}

    def error(self, node: ast.AST | None, message: str) -> ProgramError:
        return self.source.error(node, message)

    def test(self, expr: ast.expr, bindings: dict[str, Any]) -> n.Expr:
        """A condition (or a call argument) as an ``Expr`` over the parameters."""
        if isinstance(expr, ast.Name) and expr.id in self.params:
            return n.Arg(expr.id)
        if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
            return n.Not(self.test(expr.operand, bindings))
        if isinstance(expr, ast.BoolOp):
            return n.BoolOp(isinstance(expr.op, ast.And), tuple(self.test(v, bindings) for v in expr.values))
        if isinstance(expr, ast.Compare):
            return n.Compare(self.test(expr.left, bindings), tuple(type(op).__name__ for op in expr.ops),
                             tuple(self.test(c, bindings) for c in expr.comparators))
        value = self.static(expr, bindings)
        if value is not MISSING:
            return n.Const(value)
        if isinstance(expr, (ast.Attribute, ast.Subscript)) and any(
                isinstance(x, ast.Name) and x.id in self.params for x in ast.walk(expr)):
            raise self.error(expr, "test a parameter itself (`style == Style.FORMAL`, `\"x\" in tags`), "
                                   "not its attributes or items")
        raise self.error(expr, "a condition compares parameters with constants (==, !=, <, is, in, …) "
                               "and combines them with and/or/not; compute anything else before calling "
                               "the program and pass it as a parameter")

    def static(self, expr: ast.expr, bindings: dict[str, Any]) -> Any:
        """The value of a compile-time constant expression, else ``MISSING``."""
        if isinstance(expr, ast.Constant):
            return expr.value
        if isinstance(expr, ast.Name):
            return self.lookup(expr, bindings)
        if isinstance(expr, ast.Attribute):
            base = self.static(expr.value, bindings)
            if base is MISSING:
                return MISSING
            try:
                return getattr(base, expr.attr)
            except Exception as exc:  # whatever reading the constant raised: refuse, located
                raise self.error(expr, f"cannot read this constant: {exc}") from None
        if isinstance(expr, ast.Subscript):
            base, index = self.static(expr.value, bindings), self.static(expr.slice, bindings)
            if base is MISSING or index is MISSING:
                return MISSING
            try:
                return base[index]
            except Exception as exc:  # whatever reading the constant raised: refuse, located
                raise self.error(expr, f"cannot read this constant: {exc}") from None
        if isinstance(expr, (ast.Tuple, ast.List, ast.Set)):
            values = [self.static(e, bindings) for e in expr.elts]
            if any(v is MISSING for v in values):
                return MISSING
            return frozenset(values) if isinstance(expr, ast.Set) else tuple(values)
        if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, (ast.USub, ast.UAdd)):
            value = self.static(expr.operand, bindings)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return -value if isinstance(expr.op, ast.USub) else value
        return MISSING

    def lookup(self, expr: ast.Name, bindings: dict[str, Any]) -> Any:
        name = expr.id
        if name in bindings:
            return bindings[name]
        if name in self.params:
            return MISSING
        if name == self.acc:
            raise self.error(expr, "the prompt built so far cannot be read inside the program")
        if name in self.loop_names:
            raise self.error(expr, f"the loop variable {name!r} is used outside its loop")
        if name in self.nonlocals:
            try:
                return self.nonlocals[name].cell_contents
            except ValueError:
                raise self.error(expr, f"{name!r} is not defined yet") from None
        value = self.func.__globals__.get(name, MISSING)
        if value is MISSING:
            if name in ("True", "False", "None"):
                return {"True": True, "False": False, "None": None}[name]
            value = getattr(builtins, name, MISSING)
            if value is MISSING:
                raise self.error(expr, f"unknown name {name!r}: define it before the program")
            return value
        self.watched[name] = (value, snapshot(value))
        return value
