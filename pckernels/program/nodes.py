"""The compiled form of a prompt program: a tree of nodes, and the conditions that pick modules.

A program body compiles to a tuple of nodes — ``Text``, ``Slot`` (a parameter), ``Role``,
``Module`` (conditional, a loop element, or a call to another program) and ``Union``. Names are
assigned when compiling (unique per scope: the program's root or a module); union names are
assigned when the schema is written. Conditions (``Expr``) are pure: they read arguments and
compile-time constants only, and evaluate exactly as Python would.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class Expr:
    """A condition or call argument evaluated per call over the program's arguments."""

    def eval(self, env: Mapping[str, Any]) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class Const(Expr):
    value: Any

    def eval(self, env: Mapping[str, Any]) -> Any:
        return self.value


@dataclass(frozen=True)
class Arg(Expr):
    """The value of the program's parameter ``name``."""

    name: str

    def eval(self, env: Mapping[str, Any]) -> Any:
        return env[self.name]


@dataclass(frozen=True)
class Not(Expr):
    operand: Expr

    def eval(self, env: Mapping[str, Any]) -> Any:
        return not self.operand.eval(env)


@dataclass(frozen=True)
class BoolOp(Expr):
    """``and`` (``is_and``) or ``or`` over ``values``, short-circuiting like Python."""

    is_and: bool
    values: tuple[Expr, ...]

    def eval(self, env: Mapping[str, Any]) -> Any:
        value = None
        for expr in self.values:
            value = expr.eval(env)
            if bool(value) != self.is_and:
                return value
        return value


COMPARISONS: dict[str, Callable[[Any, Any], Any]] = {
    "Eq": operator.eq, "NotEq": operator.ne, "Lt": operator.lt, "LtE": operator.le, "Gt": operator.gt,
    "GtE": operator.ge, "Is": operator.is_, "IsNot": operator.is_not,
    "In": lambda a, b: a in b, "NotIn": lambda a, b: a not in b,
}


@dataclass(frozen=True)
class Compare(Expr):
    """``left op1 c1 op2 c2 …`` (a Python comparison chain; ``ops`` are ``ast`` class names)."""

    left: Expr
    ops: tuple[str, ...]
    comparators: tuple[Expr, ...]

    def eval(self, env: Mapping[str, Any]) -> Any:
        left = self.left.eval(env)
        for op, expr in zip(self.ops, self.comparators):
            right = expr.eval(env)
            if not COMPARISONS[op](left, right):
                return False
            left = right
        return True


def is_static(expr: Expr) -> bool:
    """Whether ``expr`` reads no argument, so compiling decides it."""
    if isinstance(expr, Const):
        return True
    if isinstance(expr, Arg):
        return False
    if isinstance(expr, Not):
        return is_static(expr.operand)
    if isinstance(expr, BoolOp):
        return all(is_static(v) for v in expr.values)
    if isinstance(expr, Compare):
        return is_static(expr.left) and all(is_static(c) for c in expr.comparators)
    return False


@dataclass(frozen=True)
class Text:
    """Literal text (compile-time constants included)."""

    text: str


@dataclass(frozen=True)
class Slot:
    """A ``MaxTokens`` parameter interpolated here: PML ``<param name=… len=max_tokens/>``.

    ``param`` is the Python parameter; its value is formatted like an f-string field
    (``conversion`` ``"s"``/``"r"``/``"a"`` or ``None``, then ``format(value, spec)``);
    ``exact_str``: written bare (``p += name``), so the value must be a ``str``.
    """

    name: str
    param: str
    max_tokens: int
    conversion: str | None = None
    spec: str = ""
    exact_str: bool = False
    where: tuple[int | None, int | None] = (None, None)

    def value(self, env: Mapping[str, Any]) -> str:
        value = env[self.param]
        if self.exact_str:
            if not isinstance(value, str):
                raise TypeError(f"argument {self.param!r} must be a str, not {type(value).__name__}")
            return value
        if self.conversion == "r":
            value = repr(value)
        elif self.conversion == "a":
            value = ascii(value)
        elif self.conversion == "s":
            value = str(value)
        return format(value, self.spec)


@dataclass(frozen=True)
class Role:
    """A role helper: ``<system>``/``<user>``/``<assistant>`` around ``body``; ``body is None``
    is the generation prompt (``assistant()``)."""

    role: str
    body: tuple[Node, ...] | None


@dataclass(frozen=True)
class Call:
    """A call to another program: its parameters' arguments as expressions over the caller's."""

    program: Any
    arguments: tuple[tuple[str, Expr], ...]

    def env(self, env: Mapping[str, Any]) -> dict[str, Any]:
        return {name: expr.eval(env) for name, expr in self.arguments}


@dataclass(frozen=True)
class Module:
    """A PML module: imported when ``test`` is true (``None``: always). ``call`` when it is a
    call to another program (``body`` is that program's, evaluated over ``call.env``)."""

    name: str
    test: Expr | None
    body: tuple[Node, ...]
    call: Call | None = None


@dataclass(frozen=True)
class Member:
    """A union member: the first whose ``test`` is true is imported (``None``: the default)."""

    name: str
    test: Expr | None
    body: tuple[Node, ...]


@dataclass(frozen=True)
class Union:
    """A PML ``<union>`` (an ``if``/``elif``/``else`` chain or a ``match``); ``hint`` names it."""

    hint: str
    members: tuple[Member, ...]

    def chosen(self, env: Mapping[str, Any]) -> Member | None:
        for member in self.members:
            if member.test is None or member.test.eval(env):
                return member
        return None


Node = Text | Slot | Role | Module | Union


def is_structure(node: Node) -> bool:
    """Whether ``node`` holds a module or union (a role wrapping one does)."""
    if isinstance(node, (Module, Union)):
        return True
    return isinstance(node, Role) and node.body is not None and any(is_structure(n) for n in node.body)


def has_slot(node: Node) -> bool:
    if isinstance(node, Slot):
        return True
    return isinstance(node, Role) and node.body is not None and any(has_slot(n) for n in node.body)


def has_role(nodes: tuple[Node, ...]) -> bool:
    """Whether a role helper occurs anywhere in ``nodes`` (nested modules included)."""
    for node in nodes:
        if isinstance(node, Role):
            return True
        if isinstance(node, Module) and has_role(node.body):
            return True
        if isinstance(node, Union) and any(has_role(m.body) for m in node.members):
            return True
    return False
