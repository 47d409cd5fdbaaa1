"""Why a statement in a program body is not compiled: the message its ``ProgramError`` gives."""

from __future__ import annotations

import ast

_REFUSALS: dict[type, str] = {
    ast.While: "while loops are not compiled: loop with `for x in CONSTANT:` over a fixed list",
    ast.Try: "try is not compiled: a program only builds text",
    ast.With: "with is not compiled: a program only builds text",
    ast.Raise: "raise is not compiled: validate arguments before calling the program",
    ast.Assert: "assert is not compiled: validate arguments before calling the program",
    ast.Import: "imports go outside the program",
    ast.ImportFrom: "imports go outside the program",
    ast.FunctionDef: "define helpers outside the program (decorate them with @program to call them)",
    ast.AsyncFunctionDef: "define helpers outside the program",
    ast.ClassDef: "define classes outside the program",
    ast.Global: "global is not compiled: a program has no side effects",
    ast.Nonlocal: "nonlocal is not compiled: a program has no side effects",
    ast.Delete: "del is not compiled",
    ast.Return: "return only at the end of the program",
    ast.Break: "break is not compiled: every element of a loop gets a module (skip one with `if`)",
    ast.Continue: "continue is not compiled: skip elements with `if`",
}


def refusal(stmt: ast.stmt, acc: str | None) -> str:
    """Why ``stmt`` is not compiled, and what to write instead (``acc``: the prompt accumulator)."""
    if type(stmt) in _REFUSALS:
        return _REFUSALS[type(stmt)]
    if isinstance(stmt, ast.Expr):
        if isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str):
            target = acc or "p"
            return (f"a bare string does nothing in Python (the original compiler's style); append it: "
                    f"`{target} += \"…\"`")
        return "an expression statement is a side effect, not prompt text: append text with `p += …`"
    if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        return (f"only the prompt accumulator is assigned, once at the start (`p = …`) and then with "
                f"`+=`{f' (it is {acc!r} here)' if acc else ''}; compute other values before calling the "
                "program and pass them as parameters")
    return f"{type(stmt).__name__} statements are not compiled"
