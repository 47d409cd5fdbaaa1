"""Names of the modules, parameters and unions a program compiles to: valid PML names that are
also XML tag names (so prompts import them as ``<name/>``) and no PML keyword, read from the
tests and values that pick them where they can be."""

from __future__ import annotations

import enum
import re
from typing import Any

from pckernels.program import nodes as n

_KEYWORDS = frozenset({"module", "scaffold", "system", "user", "assistant", "union", "param", "parameter",
                       "schema", "prompt"})


def safe_name(hint: str) -> str:
    """``hint`` as a PML name that is also an XML tag name and no PML keyword."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", hint).strip("_.-")[:60] or "m"
    if not (name[0].isalpha() or name[0] == "_") or name.lower().startswith("xml"):
        name = "m" + name
    return name + "-m" if name in _KEYWORDS else name


class Scope:
    """Names taken in one PML scope (the program's root or a module): modules and parameters."""

    def __init__(self) -> None:
        self.taken: set[str] = set()

    def take(self, hint: str) -> str:
        base = safe_name(hint)
        name, index = base, 2
        while name in self.taken:
            name, index = f"{base}-{index}", index + 1
        self.taken.add(name)
        return name


def value_label(value: Any, index: int) -> str:
    """A readable name part for a case value (``case{index}`` when none fits)."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, int):
        return str(value) if value >= 0 else f"neg{-value}"
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,40}", value):
        return value
    return f"case{index}"


def test_label(test: n.Expr | None) -> str:
    """A readable module name for a branch taken when ``test`` holds."""
    if test is None:
        return "else"
    if isinstance(test, n.Arg):
        return test.name
    if isinstance(test, n.Not) and isinstance(test.operand, n.Arg):
        return f"not-{test.operand.name}"
    if isinstance(test, n.Compare) and isinstance(test.left, n.Arg) and len(test.ops) == 1:
        right = test.comparators[0]
        if isinstance(right, n.Const) and test.ops[0] in ("Eq", "Is"):
            return f"{test.left.name}-{value_label(right.value, 0)}"
        if isinstance(right, n.Const) and test.ops[0] in ("NotEq", "IsNot"):
            return f"{test.left.name}-not-{value_label(right.value, 0)}"
    return "branch"


def common_subject(tests: list[n.Expr | None]) -> str | None:
    """The parameter every comparison among ``tests`` is about, if they share one."""
    names = {t.left.name for t in tests if isinstance(t, n.Compare) and isinstance(t.left, n.Arg)}
    return names.pop() if len(names) == 1 else None
