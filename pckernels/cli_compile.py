"""``promptcache compile FILE.py[:NAME]``: print the PML schemas of a file's prompt programs."""

from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path

import typer

from pckernels.cli_common import fail


def load_programs(target: str) -> list:
    """The :class:`~pckernels.program.Program` objects of ``FILE.py`` (its module-level names, in
    definition order), or the one named by ``FILE.py:NAME``. Importing the file runs it."""
    from pckernels.program import Program

    path_text, _, name = target.rpartition(":") if target.count(":") and not Path(target).is_file() \
        else (target, "", "")
    path = Path(path_text)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path_text!r}")
    module_name = f"_promptcache_compile_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import {path_text!r} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    sys.path.insert(0, str(path.resolve().parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.resolve().parent))
        sys.modules.pop(module_name, None)
    if name:
        found = getattr(module, name, None)
        if not isinstance(found, Program):
            raise ValueError(f"{name!r} in {path_text!r} is not a prompt program (decorate it with @program)")
        return [found]
    programs = [v for v in vars(module).values() if isinstance(v, Program)]
    if not programs:
        raise ValueError(f"{path_text!r} defines no prompt programs (functions decorated with @program)")
    return list(dict.fromkeys(programs))


def compile_programs(target: str = typer.Argument(..., metavar="FILE.py[:NAME]",
                                                  help="A Python file, or FILE.py:NAME for one program.")) -> None:
    """Print the PML schema of each prompt program (``@program``) in a Python file."""
    from pckernels.errors import ProgramError

    try:
        programs = load_programs(target)
    except ProgramError as exc:
        fail(exc)
    except SyntaxError as exc:
        fail(f"{exc.filename}:{exc.lineno}:{exc.offset}: {exc.msg}")
    except (OSError, ValueError, ImportError) as exc:
        fail(exc)
    for index, prog in enumerate(programs):
        typer.echo(("\n" if index else "") + prog.schema)
