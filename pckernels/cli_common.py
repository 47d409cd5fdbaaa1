"""What the ``promptcache`` commands share: the consoles, one-line errors, checked model loading.

Text that comes from the user or from files (paths, model names, schema and module names, model
output, error messages) is printed through ``rich.markup.escape`` so that brackets in it are shown,
not read as markup.
"""

from __future__ import annotations

import sys
from typing import NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape

console = Console(width=None if sys.stdout.isatty() else 120)
err_console = Console(stderr=True)

USAGE_ERROR = 2
"""Exit status of a command refused for bad input (click's own usage errors exit with 2 too)."""


PLACEMENT_HELP = ("Where a PML prompt places its modules when neither it nor its schema says: compact (moved "
                  "together, the first 8 stale tokens of each recomputed; answers closest to no reuse) or schema "
                  "(the paper's: at schema positions, equal to the reference forward). docs/pml.md")


def check_placement(placement: str) -> None:
    """Refuse a ``--placement`` other than compact or schema."""
    if placement not in ("compact", "schema"):
        fail(f"unknown --placement {placement!r}: expected compact or schema")


def one_line(text: object) -> str:
    """``text`` with its whitespace runs, newlines included, folded to single spaces."""
    return " ".join(str(text).split())


def fail(message: object, code: int = USAGE_ERROR) -> NoReturn:
    """Print ``error: message`` as one line on stderr and exit with ``code``."""
    err_console.print(f"[red]error:[/red] {escape(one_line(message))}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


def check_model_options(model: str, device: Optional[str], dtype: Optional[str]) -> None:
    """Refuse a bad ``--model`` path, ``--device`` or ``--dtype`` before anything is loaded."""
    from pckernels.engine.options import check_load_options

    try:
        check_load_options(model, device, dtype)
    except (ValueError, OSError) as exc:
        fail(exc)


def load_engine(model: str, device: Optional[str], dtype: Optional[str], **kwargs):
    """``PromptCache.from_pretrained`` (call ``check_model_options`` first, before other work); a
    model that cannot be loaded (not in the hub cache, unsupported: ``UnsupportedModelError`` is a
    ``ValueError``, …) ends the command with one line."""
    from pckernels.engine import PromptCache

    try:
        with console.status(f"loading {escape(model)} …"):
            return PromptCache.from_pretrained(model, device=device, dtype=dtype, **kwargs)
    except (OSError, ValueError) as exc:
        fail(f"cannot load model {model!r}: {exc}")
