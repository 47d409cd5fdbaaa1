"""Python prompt function -> nodes (``pckernels.program.nodes``), refusing what it cannot compile.

The body is read with ``ast`` once, at decoration time. Accepted (``docs/program.md``):

* ``p = <text>`` (the first statement), ``p += <text>``, ``return p`` / ``return p + <text>``, or
  a single ``return <text>``; ``pass``; a docstring.
* ``<text>``: string literals, f-strings, ``+``, compile-time constants (module-level names,
  loop variables and their attributes), ``MaxTokens`` parameters (-> ``Slot``), role helpers
  (``system(…)``, ``user(…)``, ``assistant(…)``, ``assistant()``) and calls to other programs.
* ``if``/``elif``/``else`` and ``match`` over parameters (-> ``Module`` / ``Union``); a test
  over constants only is decided here. ``for x in CONSTANT:`` -> one ``Module`` per element.

Everything else raises :class:`~pckernels.errors.ProgramError` with the file, line and column.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pckernels.program import nodes as n
from pckernels.program.expressions import MISSING, ExpressionReader
from pckernels.program.names import Scope, common_subject, test_label, value_label
from pckernels.program.refusals import refusal
from pckernels.program.roles import ROLE_HELPERS
from pckernels.program.source import Source


@dataclass
class Compiled:
    """What compiling a function gives: its nodes and the global values they were built from."""

    nodes: tuple[n.Node, ...]
    watched: list[tuple[str, Any, Any]] = field(default_factory=list)
    """``(name, object, snapshot)`` of the globals read (a snapshot of mutable containers)."""


class Compiler(ExpressionReader):
    """Compiles one function's ``ast.FunctionDef`` (``tree``) with its parameters ``params``
    (name -> ``MaxTokens`` limit or ``None``). ``is_program`` tells a decorated program."""

    def __init__(self, func: Callable, tree: ast.FunctionDef, source: Source,
                 params: dict[str, int | None], is_program: Callable[[Any], bool]) -> None:
        super().__init__(func, tree, source, params)
        self.tree = tree
        self.is_program = is_program
        self.root = Scope()

    def compile(self) -> Compiled:
        body = list(self.tree.body)
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]
        if not body or not isinstance(body[-1], ast.Return) or body[-1].value is None:
            raise self.error(body[-1] if body else self.tree,
                             "a prompt program ends with `return <prompt>`: build the prompt with "
                             "`p = …` and `p += …` and return it, or return one expression")
        scope = self.root
        out: list[n.Node] = []
        first = body[0]
        if isinstance(first, (ast.Assign, ast.AnnAssign)) and len(body) > 1:
            target = first.targets[0] if isinstance(first, ast.Assign) else first.target
            if isinstance(first, ast.Assign) and len(first.targets) != 1 or not isinstance(target, ast.Name) \
                    or first.value is None:
                raise self.error(first, "start the prompt with one `p = <text>` assignment")
            if target.id in self.params or target.id in self.loop_names:
                raise self.error(first, f"{target.id!r} is a parameter or loop variable; name the prompt "
                                        "accumulator differently")
            self.acc = target.id
            out += self.pieces(first.value, {}, scope, in_role=False)
            body = body[1:]
        for stmt in body[:-1]:
            out += self.statement(stmt, {}, scope)
        out += self.returned(body[-1])
        return Compiled(tuple(_merge(out)), [(k, *v) for k, v in self.watched.items()])

    def returned(self, node: ast.Return) -> list[n.Node]:
        value = node.value
        if self.acc is None:
            return self.pieces(value, {}, self.root, in_role=False)
        operands = _flatten_add(value)
        if not (isinstance(operands[0], ast.Name) and operands[0].id == self.acc):
            raise self.error(value, f"return the prompt built in {self.acc!r}: `return {self.acc}` "
                                    f"(or `return {self.acc} + …`)")
        out: list[n.Node] = []
        for operand in operands[1:]:
            out += self.pieces(operand, {}, self.root, in_role=False)
        return out

    def block(self, stmts: list[ast.stmt], bindings: dict[str, Any], scope: Scope) -> list[n.Node]:
        out: list[n.Node] = []
        for stmt in stmts:
            out += self.statement(stmt, bindings, scope)
        return out

    def statement(self, stmt: ast.stmt, bindings: dict[str, Any], scope: Scope) -> list[n.Node]:
        if isinstance(stmt, ast.AugAssign):
            if not (isinstance(stmt.target, ast.Name) and stmt.target.id == self.acc and self.acc is not None):
                raise self.error(stmt, "only the prompt accumulator is assigned: start with `p = …`, "
                                       "then `p += …`")
            if not isinstance(stmt.op, ast.Add):
                raise self.error(stmt, "the prompt only grows with `+=`")
            return self.pieces(stmt.value, bindings, scope, in_role=False)
        if isinstance(stmt, ast.Pass):
            return []
        if isinstance(stmt, ast.If):
            return self.if_chain(stmt, bindings, scope)
        if isinstance(stmt, ast.Match):
            return self.match(stmt, bindings, scope)
        if isinstance(stmt, ast.For):
            return self.loop(stmt, bindings, scope)
        raise self.error(stmt, refusal(stmt, self.acc))

    def if_chain(self, stmt: ast.If, bindings: dict[str, Any], scope: Scope) -> list[n.Node]:
        chain: list[tuple[ast.expr | None, list[ast.stmt]]] = []
        current: ast.If | None = stmt
        while current is not None:
            chain.append((current.test, current.body))
            orelse = current.orelse
            current = orelse[0] if len(orelse) == 1 and isinstance(orelse[0], ast.If) else None
            if current is None and orelse:
                chain.append((None, orelse))
        tests = [None if test is None else self.test(test, bindings) for test, _ in chain]
        labels = [test_label(t) for t in tests]
        flag = tests[0].name if isinstance(tests[0], n.Arg) else None
        if flag and len(tests) == 2 and tests[1] is None:
            labels[1] = f"not-{flag}"
        return self._choice(chain, tests, labels, common_subject(tests) or flag or "choice", bindings, scope,
                            single=len(chain) == 1)

    def _choice(self, chain, tests, labels, hint: str, bindings, scope: Scope, *, single: bool) -> list[n.Node]:
        """Branches -> a module (``single``), a union, or (tests decided here) the chosen body."""
        dynamic = []
        for (test_node, body), test, label in zip(chain, tests, labels):
            if test is not None and n.is_static(test):
                try:
                    taken = bool(test.eval({}))
                except Exception as exc:  # the constants' own comparison failed: refuse, located
                    raise self.error(test_node, f"this test over constants fails: {exc}") from None
                if not taken:
                    continue
                if not dynamic:
                    return self.block(body, bindings, scope)
                test = None
            dynamic.append((body, test, label))
            if test is None:
                break
        if not dynamic:
            return []
        if single and dynamic[0][1] is not None:
            body, test, label = dynamic[0]
            name = scope.take(label)
            return [n.Module(name, test, tuple(_merge(self.block(body, bindings, Scope()))))]
        members = []
        for body, test, label in dynamic:
            name = scope.take(label if not label.startswith("else") or test is not None else f"{hint}-else")
            members.append(n.Member(name, test, tuple(_merge(self.block(body, bindings, Scope())))))
        return [n.Union(hint, tuple(members))]

    def match(self, stmt: ast.Match, bindings: dict[str, Any], scope: Scope) -> list[n.Node]:
        subject = self.test(stmt.subject, bindings)
        hint = subject.name if isinstance(subject, n.Arg) else "match"
        chain, tests, labels = [], [], []
        for index, case in enumerate(stmt.cases):
            if case.guard is not None:
                raise self.error(case.guard, "case guards (`case … if …`) are not compiled: test in the "
                                             "case body with `if`")
            test, label = self.pattern(case.pattern, subject, bindings, index)
            chain.append((case.pattern, case.body))
            tests.append(test)
            labels.append(f"{hint}-{label}")
        return self._choice(chain, tests, labels, hint, bindings, scope, single=False)

    def pattern(self, pattern: ast.pattern, subject: n.Expr, bindings, index: int) -> tuple[n.Expr | None, str]:
        if isinstance(pattern, ast.MatchValue):
            value = self.static(pattern.value, bindings)
            if value is MISSING:
                raise self.error(pattern, "a case value must be a constant")
            return n.Compare(subject, ("Eq",), (n.Const(value),)), value_label(value, index)
        if isinstance(pattern, ast.MatchSingleton):
            return n.Compare(subject, ("Is",), (n.Const(pattern.value),)), value_label(pattern.value, index)
        if isinstance(pattern, ast.MatchOr):
            parts = [self.pattern(p, subject, bindings, index) for p in pattern.patterns]
            if any(test is None for test, _ in parts):
                raise self.error(pattern, "`_` inside an or-pattern: write `case _:` on its own")
            return n.BoolOp(False, tuple(t for t, _ in parts)), "-or-".join(label for _, label in parts)
        if isinstance(pattern, ast.MatchAs) and pattern.pattern is None and pattern.name is None:
            return None, "default"
        raise self.error(pattern, "only literal, enum-member and `_` case patterns are compiled (no "
                                  "captures, classes, sequences or mappings)")

    def loop(self, stmt: ast.For, bindings: dict[str, Any], scope: Scope) -> list[n.Node]:
        if stmt.orelse:
            raise self.error(stmt, "`for … else` is not compiled")
        names = [t.id for t in ast.walk(stmt.target) if isinstance(t, ast.Name)]
        if not all(isinstance(t, (ast.Name, ast.Tuple, ast.Store)) for t in ast.walk(stmt.target)):
            raise self.error(stmt.target, "loop over names only: `for doc in DOCS:` or `for a, b in PAIRS:`")
        for name in names:
            if name in self.params or name == self.acc:
                raise self.error(stmt.target, f"the loop variable {name!r} hides a parameter or the prompt")
        items = self.static(stmt.iter, bindings)
        if not isinstance(items, (list, tuple)):
            raise self.error(stmt.iter, "a loop runs over a constant list or tuple defined outside the "
                                        "program (e.g. a module-level DOCS); loops over arguments are not "
                                        "compiled: pass which elements to include and test it "
                                        "(`for doc in DOCS: if doc in chosen: …`)")
        out: list[n.Node] = []
        hint = names[0] if len(names) == 1 else "item"
        for index, item in enumerate(items):
            inner = dict(bindings)
            try:
                _bind(stmt.target, item, inner)
            except (TypeError, ValueError) as exc:
                raise self.error(stmt.target, f"element {index} cannot be unpacked: {exc}") from None
            body = _merge(self.block(stmt.body, inner, Scope()))
            if not body:
                continue
            name = scope.take(f"{hint}-{index}")
            if len(body) == 1 and isinstance(body[0], n.Module) and body[0].test is not None \
                    and body[0].call is None:
                out.append(n.Module(name, body[0].test, body[0].body))
            else:
                out.append(n.Module(name, None, tuple(body)))
        return out

    def pieces(self, expr: ast.expr, bindings: dict[str, Any], scope: Scope, *, in_role: bool) -> list[n.Node]:
        """The nodes a text expression appends."""
        if isinstance(expr, ast.Constant):
            if isinstance(expr.value, str):
                return [n.Text(expr.value)]
            raise self.error(expr, f"a prompt is built from str, not {type(expr.value).__name__}")
        if isinstance(expr, ast.JoinedStr):
            out: list[n.Node] = []
            for part in expr.values:
                if isinstance(part, ast.Constant):
                    out.append(n.Text(part.value))
                else:
                    out += self.field(part, bindings, scope, in_role=in_role)
            return out
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
            out = []
            for operand in _flatten_add(expr):
                out += self.pieces(operand, bindings, scope, in_role=in_role)
            return out
        if isinstance(expr, ast.Call):
            return self.call(expr, bindings, scope, in_role=in_role)
        if isinstance(expr, ast.Name) and expr.id in self.params:
            return [self.slot(expr, expr.id, scope, exact_str=True)]
        value = self.static(expr, bindings)
        if value is not MISSING:
            if not isinstance(value, str):
                raise self.error(expr, f"this is a {type(value).__name__}, not a str: format it in an "
                                       "f-string (`f\"{…}\"`)")
            return [n.Text(value)]
        raise self.error(expr, "not compiled: a prompt is built from string literals, f-strings, `+`, "
                               "constants, MaxTokens parameters, role helpers and calls to other "
                               "programs; compute anything else before calling the program and pass it "
                               "as a parameter")

    def field(self, part: ast.FormattedValue, bindings, scope: Scope, *, in_role: bool) -> list[n.Node]:
        conversion = None if part.conversion == -1 else chr(part.conversion)
        spec = ""
        if part.format_spec is not None:
            values = part.format_spec.values if isinstance(part.format_spec, ast.JoinedStr) else []
            if not all(isinstance(v, ast.Constant) for v in values):
                raise self.error(part.format_spec, "a format spec must be constant")
            spec = "".join(v.value for v in values)
        value = part.value
        if isinstance(value, ast.Name) and value.id in self.params:
            return [self.slot(value, value.id, scope, conversion=conversion, spec=spec)]
        if isinstance(value, ast.Call):
            if conversion or spec:
                raise self.error(part, "no conversion or format spec on a role helper or program call")
            return self.call(value, bindings, scope, in_role=in_role)
        static = self.static(value, bindings)
        if static is MISSING:
            raise self.error(value, "an f-string field is a MaxTokens parameter, a constant, a loop "
                                    "variable, a role helper or a program call; compute anything else "
                                    "before calling the program and pass it as a parameter")
        if conversion == "r":
            static = repr(static)
        elif conversion == "a":
            static = ascii(static)
        elif conversion == "s":
            static = str(static)
        try:
            return [n.Text(format(static, spec))]
        except (TypeError, ValueError) as exc:
            raise self.error(part, f"cannot format this constant: {exc}") from None

    def slot(self, node: ast.Name, param: str, scope: Scope, *, conversion: str | None = None, spec: str = "",
             exact_str: bool = False) -> n.Slot:
        limit = self.params[param]
        if limit is None:
            raise self.error(node, f"parameter {param!r} is interpolated but has no maximum length: annotate "
                                   f"it `{param}: Annotated[str, MaxTokens(n)]` (PML reserves n positions "
                                   "for it)")
        return n.Slot(scope.take(param), param, limit, conversion, spec, exact_str,
                      (node.lineno + self.source.first_line - 1, node.col_offset + self.source.indent + 1))

    def call(self, expr: ast.Call, bindings, scope: Scope, *, in_role: bool) -> list[n.Node]:
        callee = self.static(expr.func, bindings)
        if any(isinstance(a, ast.Starred) for a in expr.args) or any(k.arg is None for k in expr.keywords):
            raise self.error(expr, "no *args or **kwargs in a compiled call")
        if callee is not MISSING and _is_role(callee):
            return [self.role(expr, ROLE_HELPERS[callee], bindings, scope, in_role=in_role)]
        if callee is not MISSING and self.is_program(callee):
            return [self.program_call(expr, callee, bindings, scope, in_role=in_role)]
        raise self.error(expr, "only role helpers (system, user, assistant) and other prompt programs "
                               "are called in a program; compute anything else before calling it and "
                               "pass the result as a parameter")

    def role(self, expr: ast.Call, role: str, bindings, scope: Scope, *, in_role: bool) -> n.Role:
        if in_role:
            raise self.error(expr, "role helpers do not nest")
        if expr.keywords or len(expr.args) > 1 or (role != "assistant" and len(expr.args) != 1):
            raise self.error(expr, f"{role}() takes one text argument" +
                             (" (none for the generation prompt)" if role == "assistant" else ""))
        if not expr.args:
            return n.Role(role, None)
        arg = expr.args[0]
        body = tuple(_merge(self.pieces(arg, bindings, scope, in_role=True)))
        if role == "assistant" and not body:
            raise self.error(expr, "this assistant message is empty, but an empty PML <assistant/> is the "
                                   "generation prompt: write assistant() for that")
        return n.Role(role, body)

    def program_call(self, expr: ast.Call, callee: Any, bindings, scope: Scope, *, in_role: bool) -> n.Module:
        if in_role and n.has_role(callee.nodes):
            raise self.error(expr, f"{callee.function.__name__}() uses role helpers, and role helpers do not "
                                   "nest: call it outside the role helper")
        args = [self.test(a, bindings) for a in expr.args]
        kwargs = {k.arg: self.test(k.value, bindings) for k in expr.keywords}
        try:
            bound = callee.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise self.error(expr, f"bad arguments for {callee.function.__name__}(): {exc}") from None
        bound.apply_defaults()
        arguments = tuple((k, v if isinstance(v, n.Expr) else n.Const(v)) for k, v in bound.arguments.items())
        return n.Module(scope.take(callee.function.__name__), None, callee.nodes, n.Call(callee, arguments))

def _is_role(value: Any) -> bool:
    try:
        return value in ROLE_HELPERS
    except TypeError:
        return False


def _flatten_add(expr: ast.expr) -> list[ast.expr]:
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        return _flatten_add(expr.left) + _flatten_add(expr.right)
    return [expr]


def _bind(target: ast.expr, value: Any, into: dict[str, Any]) -> None:
    if isinstance(target, ast.Name):
        into[target.id] = value
        return
    items = tuple(value)
    if len(items) != len(target.elts):
        raise ValueError(f"expected {len(target.elts)} values, got {len(items)}")
    for sub, item in zip(target.elts, items):
        _bind(sub, item, into)


def _merge(nodes: list[n.Node]) -> list[n.Node]:
    """Adjacent texts joined, empty ones dropped (the text is the same)."""
    out: list[n.Node] = []
    for node in nodes:
        if isinstance(node, n.Text):
            if not node.text:
                continue
            if out and isinstance(out[-1], n.Text):
                out[-1] = n.Text(out[-1].text + node.text)
                continue
        out.append(node)
    return out
