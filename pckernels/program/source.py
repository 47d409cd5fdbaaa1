"""Reading a prompt function: its source as an AST, located errors, its parameters' ``MaxTokens``."""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing
from collections.abc import Callable
from dataclasses import dataclass

from pckernels.errors import ProgramError
from pckernels.program.roles import MaxTokens


@dataclass
class Source:
    """The program's parsed source and how to locate its nodes in the file."""

    filename: str
    lines: list[str]
    first_line: int
    indent: int

    def error(self, node: ast.AST | None, message: str) -> ProgramError:
        if node is None or not hasattr(node, "lineno"):
            return ProgramError(message, filename=self.filename)
        text = self.lines[node.lineno - 1] if node.lineno <= len(self.lines) else ""
        column = len(text.encode("utf-8")[:node.col_offset].decode("utf-8", "replace")) + self.indent + 1
        segment = ast.get_source_segment("\n".join(self.lines), node) or ""
        segment = " ".join(segment.split())
        shown = f"`{segment[:60]}{'…' if len(segment) > 60 else ''}`: " if segment else ""
        return ProgramError(shown + message, filename=self.filename, line=node.lineno + self.first_line - 1,
                            column=column)


def read_function(function: Callable) -> tuple[ast.FunctionDef, Source]:
    """The function's ``def`` as an AST and its ``Source`` (refusing what cannot be read)."""
    try:
        filename = inspect.getsourcefile(function) or function.__code__.co_filename
        raw, first = inspect.getsourcelines(function)
    except (OSError, TypeError, AttributeError) as exc:
        raise ProgramError(f"cannot read the source of {getattr(function, '__qualname__', function)!r} "
                           f"({exc}): define prompt programs in a file") from None
    text = "".join(raw)
    dedented = textwrap.dedent(text)
    indent = len(raw[0]) - len(raw[0].lstrip()) if raw else 0
    source = Source(filename, dedented.splitlines(), first, indent)
    try:
        module = ast.parse(dedented)
    except SyntaxError as exc:
        raise ProgramError(f"cannot parse the source of {function.__qualname__}: {exc.msg}", filename=filename,
                           line=(exc.lineno or 1) + first - 1) from None
    tree = module.body[0] if module.body else None
    if isinstance(tree, ast.AsyncFunctionDef):
        raise source.error(tree, "async functions are not compiled: a program only builds text")
    if not isinstance(tree, ast.FunctionDef):
        raise source.error(tree, "only functions defined with `def` are compiled (no lambdas)")
    return tree, source


def read_params(function: Callable, signature: inspect.Signature, tree: ast.FunctionDef,
                source: Source) -> dict[str, int | None]:
    """Parameter name -> its ``MaxTokens`` limit (``None``: none declared)."""
    try:
        hints = typing.get_type_hints(function, include_extras=True)
    except Exception:  # an annotation that does not evaluate: read the raw ones (no MaxTokens there)
        hints = dict(getattr(function, "__annotations__", {}))
    args = {a.arg: a for a in tree.args.posonlyargs + tree.args.args + tree.args.kwonlyargs}
    out: dict[str, int | None] = {}
    for param in signature.parameters.values():
        node = args.get(param.name, tree)
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise source.error(tree.args.vararg or tree.args.kwarg or tree,
                               "*args and **kwargs are not compiled: name every parameter")
        hint = hints.get(param.name)
        limits = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, MaxTokens)]
        if len(limits) > 1:
            raise source.error(node, f"parameter {param.name!r} declares MaxTokens twice")
        if limits and getattr(hint, "__origin__", None) is not str:
            raise source.error(node, f"MaxTokens applies to str parameters: `{param.name}: "
                                     "Annotated[str, MaxTokens(n)]`")
        out[param.name] = limits[0].tokens if limits else None
    return out
